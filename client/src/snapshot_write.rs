//! A replicated single-key write by the snapshot protocol (`docs/design/replication-fast-path.md`,
//! "SNAP-P"): every replica's steps run together, and no record is written.
//!
//! 1. Every replica's copy of the key is read (its word, and on the primary the item the
//!    operation decides from), all replicas at once.
//! 2. Every replica is locked from the word it held, with an intent carrying the write's
//!    random id (a snapshot mark), all at once, each at the slot it was read at (the intent
//!    block and the CAS in one round trip). The primary's lock orders the write among the
//!    key's writes: a write that loses it takes its backup intents back and runs again; one
//!    that holds it locks each backup it lost again once that backup's copy settles (another
//!    writer's intent there is taken back by its writer, or past its lease by `snapshot.rs`).
//! 3. Every intent is published, all at once; a delete publishes on the backups first (see
//!    `snapshot.rs`). The primary's publish is the write's linearization point, and it
//!    happens only within the write's lease: past it, resolvers decide (they roll a primary's
//!    intent forward), and the write reports that it may have applied.
//!
//! About 4 rounds for any R (2 to read, 1 to lock, 1 to publish) where the one-key
//! transaction (`replicated.rs`) takes about 9 + R - 1.

use racekv_hashing::layout::TxnMark;
use racekv_hashing::table::txn::{Lock, TXN_LEASE_MS};
use racekv_hashing::Item;

use crate::error::ClientError;
use crate::replicated::Change;
use crate::session::{Redo, Session, Shards};

/// An intent placed on one replica, as `TableClient::txn_settle_placed` takes it.
type Placed<'k> = (&'k [u8], Lock, TxnMark);

/// What one attempt of a snapshot write came to.
pub(crate) enum Attempt<R> {
    /// Published (or nothing to write): the operation's result.
    Done(R),
    /// Another write held the primary: nothing of this one stands. Run again.
    Lost,
}

impl<S: Shards> Session<S> {
    /// One attempt of a write of `key` on every replica (see [`Self::write_snapshot_once`])
    /// by one map: None when it lost the primary to another write (nothing of it stands).
    /// When the map changed under it, a published write stands if the key's primary is
    /// still among the memnodes written (and is copied to any new replica, as `commit`
    /// does); otherwise the map change is the error.
    pub(crate) fn write_snapshot<'v, R>(
        &mut self,
        key: &[u8],
        decide: &mut impl FnMut(Option<Item>) -> (Option<Change<'v>>, R),
    ) -> Result<Option<R>, ClientError> {
        let write_id = crate::seed::random_seed();
        let mut went = Vec::new();
        let mut attempt = None;
        let result = self.under_map(std::iter::once(key), Redo::No, |s| {
            went = s.write_set(key);
            attempt = Some(s.write_snapshot_once(key, write_id, decide)?);
            Ok(())
        });
        match (result, attempt) {
            (Ok(()), Some(Attempt::Done(r))) => Ok(Some(r)),
            (Ok(()) | Err(ClientError::MapChanged { .. }), Some(Attempt::Lost)) => Ok(None),
            (Err(ClientError::MapChanged { .. }), Some(Attempt::Done(r))) if went.contains(&self.route(key)) => {
                if self.write_set(key) != went {
                    self.sync_key(key)?;
                }
                Ok(Some(r))
            }
            (Err(e), _) => Err(e),
            (Ok(()), None) => unreachable!("an attempt that returned Ok ran"),
        }
    }

    /// One attempt of a write of `key` on every replica, `decide` as in
    /// [`Session::write_replicated`]; `write_id` is this attempt's (random) id.
    pub(crate) fn write_snapshot_once<'v, R>(
        &mut self,
        key: &[u8],
        write_id: u64,
        decide: &mut impl FnMut(Option<Item>) -> (Option<Change<'v>>, R),
    ) -> Result<Attempt<R>, ClientError> {
        let all = self.write_set(key);
        let read = self.on_all(&all, async |c, _| c.read_versioned_overlapped(key).await)?;
        let now_ms = racekv_hashing::clock::now_unix_ms();
        let mut words = Vec::with_capacity(all.len());
        let mut slots = Vec::with_capacity(all.len());
        let (mut item, mut read_checksum) = (None, 0);
        for (i, result) in read.into_iter().enumerate() {
            let (read_item, version) = result?;
            if i == 0 {
                item = read_item.filter(|it| it.expires_at_ms.is_none_or(|at| now_ms <= at));
                read_checksum = version.checksum;
            }
            words.push(version.word);
            slots.push(version.slot);
        }
        let (change, result) = decide(item);
        let Some(change) = change else { return Ok(Attempt::Done(result)) };
        let (value, expires_at_ms) = match &change {
            Change::Put(value, at) => (Some(&value[..]), *at),
            Change::Delete => (None, None),
        };
        let deadline_ms = now_ms + TXN_LEASE_MS;
        let mark_from =
            |old_word| TxnMark { tombstone: value.is_none(), ..TxnMark::of_snapshot(write_id, old_word, deadline_ms) };
        let mut marks: Vec<TxnMark> = words.iter().map(|&w| mark_from(w)).collect();
        // Each lock goes straight to the slot its word was read at (one round trip, not two).
        let locked = self
            .on_all(&all, async |c, i| c.txn_lock_at_overlapped(key, value, expires_at_ms, marks[i], slots[i]).await)?;
        let mut locks: Vec<Option<Lock>> = Vec::with_capacity(all.len());
        let mut failed = None;
        for result in locked {
            match result {
                Ok(lock) => locks.push(lock),
                Err(e) => {
                    failed.get_or_insert(e);
                    locks.push(None);
                }
            }
        }
        if let Some(e) = failed {
            // A replica failed: holding the primary, the write takes back what it placed
            // (an intent that went in unseen on the failed replica goes back by the primary,
            // which will not carry this write). Not holding it, whether its intent there went
            // in is unknown: resolvers roll it forward past its lease, and settle the rest by it.
            if locks[0].is_some() {
                self.take_back(key, &all, &locks, &marks, deadline_ms)?;
            }
            return Err(e);
        }
        // The primary's word may have come back since it was read, on a reused block: the
        // lock read the header of the block it replaced, which says which write that was.
        // The decision was made from another one: take the lock back too (within the lease,
        // before anyone else may act on it, the writer may).
        let stale = locks[0].is_some_and(|lock| words[0] != 0 && lock.replaced_checksum != read_checksum);
        if locks[0].is_none() || stale {
            self.take_back(key, &all, &locks, &marks, deadline_ms)?;
            return Ok(Attempt::Lost);
        }
        // Backups whose copy changed since it was read: read and lock each again, until
        // their copies settle (bounded by the lease: past it, resolvers decide).
        while let Some(i) = locks.iter().position(Option::is_none) {
            if racekv_hashing::clock::now_unix_ms() >= deadline_ms {
                return Err(self.past_lease(all[0]));
            }
            let shard = all[i];
            let word = self.on(shard, |c| c.read_versioned(key))?.1.word;
            let mark = mark_from(word);
            marks[i] = mark;
            locks[i] = self.on(shard, |c| c.txn_lock(key, value, expires_at_ms, mark))?;
        }
        // No replica may have served a newer map when its lock went in (as a transaction's
        // commit, `txn.rs`): the write is taken back and runs again by the new map.
        if self.shards().map_changed().is_some() {
            self.take_back(key, &all, &locks, &marks, deadline_ms)?;
            return Ok(Attempt::Lost);
        }
        if racekv_hashing::clock::now_unix_ms() >= deadline_ms {
            return Err(self.past_lease(all[0]));
        }
        let placed: Vec<Placed<'_>> =
            locks.iter().zip(&marks).map(|(lock, &mark)| (key, lock.expect("every replica locked"), mark)).collect();
        if value.is_none() && all.len() > 1 {
            self.settle_all(&all[1..], &placed[1..], true)?;
            self.settle_all(&all[..1], &placed[..1], true)?;
        } else {
            self.settle_all(&all, &placed, true)?;
        }
        Ok(Attempt::Done(result))
    }

    /// Settles each of `placed` (one per shard of `shards`), all at once: published, or taken back.
    fn settle_all(&mut self, shards: &[usize], placed: &[Placed<'_>], publish: bool) -> Result<(), ClientError> {
        let settled =
            self.on_all(shards, async |c, i| c.txn_settle_placed_overlapped(&placed[i..=i], publish).await)?;
        settled.into_iter().try_for_each(|r| r.map(|_| ()))
    }

    /// Takes back the intents `locks` placed (the write lost the primary, decided from a
    /// copy gone since, or met a newer map): each replica goes back to the word it held. Its
    /// lock on the primary only within its lease (`deadline_ms`): past it, resolvers may be
    /// rolling it forward, so it stays, and the write may apply.
    fn take_back(
        &mut self,
        key: &[u8],
        all: &[usize],
        locks: &[Option<Lock>],
        marks: &[TxnMark],
        deadline_ms: u64,
    ) -> Result<(), ClientError> {
        if locks[0].is_some() && racekv_hashing::clock::now_unix_ms() >= deadline_ms {
            return Err(self.past_lease(all[0]));
        }
        let (shards, placed): (Vec<usize>, Vec<Placed<'_>>) = all
            .iter()
            .zip(locks.iter().zip(marks))
            .filter_map(|(&shard, (lock, &mark))| lock.map(|lock| (shard, (key, lock, mark))))
            .unzip();
        self.settle_all(&shards, &placed, false)
    }

    /// The error of a write that holds the lock on `primary` past its lease: it may still
    /// apply (resolvers roll it forward).
    fn past_lease(&self, primary: usize) -> ClientError {
        let endpoint = self.shards().label(primary).to_string();
        ClientError::Timeout { endpoint, after: std::time::Duration::from_millis(TXN_LEASE_MS) }
    }
}
