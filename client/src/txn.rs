//! Multi-key transactions: the coordinator, over any [`Shards`] (one or many memnodes).
//!
//! A transaction reads optimistically ([`Session::read_versioned`]: each key's value and its
//! version, the canonical slot word) and buffers its writes; [`Session::commit`] then makes
//! the writes atomic, if nothing it read has changed, with one-sided operations only
//! (the per-memnode steps are `racekv_hashing::table::txn`):
//!
//! 1. **Record**: a 64 B record on the memnode of the first key written (the *home*),
//!    pending until a lease deadline ([`TXN_LEASE_MS`] from now). It is written in the first
//!    batch of that key's lock, before any lock's CAS: no round trip of its own.
//! 2. **Lock** each written key: write an intent block (the new value, or a tombstone for a
//!    delete, marked with the record's place, the version read and the deadline) and CAS
//!    the key's slot from the version read to the intent's *locked* word. A key written but
//!    not read has its version read first. When the probe shows that version still at the
//!    key's lowest fingerprint slot, the CAS follows without reading the block again. Locks
//!    never wait: a CAS that fails (the key
//!    changed, or another transaction holds it) aborts this attempt.
//! 3. **Validate** the keys read but not written: their slot words are still the versions
//!    read (a locked word never is one), and none of them has expired since.
//! 4. **Decide**: one CAS of the record from pending to committed (or aborted). This is
//!    the commit point. A reader that met a lock past the lease CASes the same word to
//!    aborted first; exactly one of the two wins, and everyone follows the record.
//! 5. **Settle** the locks, one batch of CASes per memnode at the slots they went into (a
//!    lock a split moved is found by its key): committed, the slot gets the intent's word unlocked (a delete:
//!    0) and the old block is retired; aborted, the old word comes back and the intent is
//!    retired. Then the record is freed, but only when every lock is known settled.
//!
//! **Isolation: serializable** (strictly: the order is the commit points'). Every key written
//! is locked at its version read, and every key only read is checked while all locks are
//! held, so at the commit point every read still holds: the transaction is equivalent to
//! running all at once there. Readers never see half of one: a locked slot is waited on by
//! every other operation (reads included) until it is settled, and settling happens only
//! after the record is decided, so a reader sees each key's old value before the commit
//! point and its new one after, and a reader that meets a key still locked after the
//! commit point waits for it.
//!
//! **Crashes**: a coordinator that dies holding locks leaves them until its lease ends;
//! then the first operation to meet one gets `Error::Locked`, and [`Session`] aborts the
//! record if it is still pending (or finds it committed) and settles that lock. Each lock
//! is settled by whoever meets it; the record of a dead coordinator is freed at its
//! memnode's next start (with the blocks its locks kept, `racekv_hashing::reclaim`).
//!
//! **Round trips**, uncontended, on one memnode, for `w` keys written (`r` more read):
//! per written key 2 (version, unless it was read) + 2 (lock; 3 if the probe no longer shows
//! the version in place), `r` checks of 2, decide 1, settle 1 per memnode. Versions and locks
//! go one key at a time today.

use std::time::Duration;

use racekv_hashing::layout::TxnMark;
use racekv_hashing::table::txn::{Lock, TxnState, TXN_LEASE_MS};
use racekv_hashing::Item;

use crate::error::ClientError;
use crate::session::{Session, Shards};

/// Attempts [`Session::transaction`] makes before it gives up with
/// [`ClientError::Conflict`].
pub const MAX_TXN_ATTEMPTS: u32 = 64;
/// Attempts after which a transaction also locks the keys it only read (writing back what
/// it read), so a long reader among busy writers stops losing every validation.
pub const LOCK_READS_AFTER_ATTEMPTS: u32 = 4;
/// Times a key written without being read has its version read again when its lock loses
/// a race, before the attempt counts as a conflict.
const BLIND_LOCK_ATTEMPTS: u32 = 3;
/// Most distinct keys one transaction may write (each holds a lock until the commit).
pub const MAX_TXN_WRITES: usize = 4096;

/// What a transaction read of a key: its slot word (0: absent) and its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Version {
    /// The key's canonical slot word when read (0: absent). A write gives a new one.
    pub word: u64,
    /// Its expiry when read (None: never, or absent): expiring since counts as a change.
    pub expires_at_ms: Option<u64>,
}

impl Version {
    /// The version of an absent key.
    pub const ABSENT: Version = Version { word: 0, expires_at_ms: None };

    fn expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| now_ms > at)
    }
}

/// One write of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write<'a> {
    /// The key.
    pub key: &'a [u8],
    /// Its new value; None deletes it.
    pub value: Option<&'a [u8]>,
    /// The new value's expiry (absolute Unix ms; None: never).
    pub expires_at_ms: Option<u64>,
}

/// A lock this coordinator placed.
struct Held<'a> {
    key: &'a [u8],
    shard: usize,
    lock: Lock,
    mark: TxnMark,
}

impl<S: Shards> Session<S> {
    /// `key`'s item (None: absent or expired) and its version, for a transaction's read
    /// set. A key another transaction is committing is waited for.
    pub fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        let (item, word) = self.on_key(key, |c| c.read_versioned(key))?;
        let expires_at_ms = item.as_ref().and_then(|i| i.expires_at_ms);
        Ok((item, Version { word, expires_at_ms }))
    }

    /// Applies `writes` atomically if every key of `reads` still has the version read (and
    /// has not expired since); returns false, with nothing applied, when one changed or
    /// another transaction held a key. Writes of one key: the last wins. A key both read and
    /// written is checked by its lock.
    pub fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        let writes = last_write_per_key(writes);
        if writes.len() > MAX_TXN_WRITES {
            return Err(ClientError::TooLarge { key: 0, value: writes.len(), max: MAX_TXN_WRITES });
        }
        let Some(first) = writes.first() else {
            return self.validate(reads, &[]);
        };
        let home = self.route(first.key);
        let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
        let record_offset = self.on(home, |c| c.txn_record(deadline_ms))?;
        let base = TxnMark {
            record_node: self.shards().node_id(home),
            record_offset,
            old_word: 0,
            deadline_ms,
            tombstone: false,
        };
        let mut held = Vec::with_capacity(writes.len());
        let mut uncertain = false;
        let prepared = self
            .lock_all(reads, &writes, base, &mut held, &mut uncertain)
            .and_then(|locked| Ok(locked && self.validate(reads, &writes)?));
        if held.is_empty() && !uncertain {
            // No lock was placed: nothing names the record (which may not even be written).
            let _ = self.on(home, |c| {
                c.txn_free_record(record_offset);
                Ok(())
            });
            return prepared.map(|_| false);
        }
        let still_leased = racekv_hashing::clock::now_unix_ms() < deadline_ms;
        let to = if matches!(prepared, Ok(true)) && still_leased { TxnState::Committed } else { TxnState::Aborted };
        let decided = self.on(home, |c| c.txn_decide(record_offset, deadline_ms, to));
        let committed = match &decided {
            Ok(Some(TxnState::Committed)) => true,
            Ok(Some(TxnState::Aborted)) => false,
            // Unknown: the locks stay for readers to resolve from the record after the lease.
            Ok(_) | Err(_) => {
                let e = decided.err().unwrap_or_else(|| ClientError::Internal {
                    endpoint: self.shards().label(home).to_string(),
                    reason: "a transaction record changed under its coordinator".into(),
                });
                return Err(prepared.err().unwrap_or(e));
            }
        };
        let mut shards: Vec<usize> = held.iter().map(|h| h.shard).collect();
        shards.sort_unstable();
        shards.dedup();
        for shard in shards {
            let locks: Vec<(&[u8], Lock, TxnMark)> =
                held.iter().filter(|h| h.shard == shard).map(|h| (h.key, h.lock, h.mark)).collect();
            if let Err(e) = self.on(shard, |c| c.txn_settle_placed(&locks, committed)) {
                tracing::warn!(
                    "a transaction's locks could not be settled (readers resolve them after the lease): {e}"
                );
                uncertain = true;
            }
        }
        if !uncertain {
            let _ = self.on(home, |c| {
                c.txn_free_record(record_offset);
                Ok(())
            });
        }
        prepared?;
        Ok(committed)
    }

    /// Runs `body` as a transaction: its reads ([`Transaction::get`]) see one snapshot and
    /// its writes ([`Transaction::put`], [`Transaction::delete`]) apply atomically when it
    /// returns, or not at all. On a conflict `body` runs again (at most [`MAX_TXN_ATTEMPTS`]
    /// times, then [`ClientError::Conflict`]), so it should have no other effects.
    pub fn transaction<T>(
        &mut self,
        body: impl FnMut(&mut dyn Transaction) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        run(self, body)
    }

    /// Locks every write; false at the first conflict. Locks placed go to `held`; a lock
    /// whose outcome is unknown (a failed round trip) sets `uncertain`.
    fn lock_all<'w>(
        &mut self,
        reads: &[(&[u8], Version)],
        writes: &[Write<'w>],
        base: TxnMark,
        held: &mut Vec<Held<'w>>,
        uncertain: &mut bool,
    ) -> Result<bool, ClientError> {
        for w in writes {
            let shard = self.route(w.key);
            let read = reads.iter().rev().find(|(k, _)| *k == w.key).map(|(_, v)| v.word);
            let mut attempt = 0;
            let lock = loop {
                let old_word = match read {
                    Some(word) => word,
                    None => self.on(shard, |c| c.txn_version(w.key))?,
                };
                if read.is_none() && racekv_hashing::layout::Slot::decode(old_word).is_some_and(|s| s.locked) {
                    break None; // another transaction holds it
                }
                let mark = TxnMark { old_word, ..base };
                let locked = self.on(shard, |c| c.txn_lock(w.key, w.value, w.expires_at_ms, mark));
                match locked {
                    Ok(Some(lock)) => break Some((lock, mark)),
                    Ok(None) if read.is_none() && attempt + 1 < BLIND_LOCK_ATTEMPTS => attempt += 1,
                    Ok(None) => break None,
                    Err(e) => {
                        *uncertain = true;
                        return Err(e);
                    }
                }
            };
            let Some((lock, mark)) = lock else { return Ok(false) };
            held.push(Held { key: w.key, shard, lock, mark: TxnMark { tombstone: w.value.is_none(), ..mark } });
        }
        Ok(true)
    }

    /// Whether every read not among `writes` still has its version, and none has expired.
    fn validate(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        let now = racekv_hashing::clock::now_unix_ms();
        if reads.iter().any(|(_, v)| v.expired(now)) {
            return Ok(false);
        }
        for &(key, version) in reads {
            if writes.iter().any(|w| w.key == key) {
                continue;
            }
            let shard = self.route(key);
            if self.on(shard, |c| c.txn_version(key))? != version.word {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The writes, one per key (the last of each), in first-seen order.
pub(crate) fn last_write_per_key<'a>(writes: &[Write<'a>]) -> Vec<Write<'a>> {
    let mut out: Vec<Write<'a>> = Vec::with_capacity(writes.len());
    for w in writes {
        match out.iter_mut().find(|o| o.key == w.key) {
            Some(o) => *o = *w,
            None => out.push(*w),
        }
    }
    out
}

/// Waits a little before a transaction runs again: more after each conflict, with jitter
/// so two conflicting coordinators do not meet again in lockstep.
fn backoff(attempt: u32) {
    let most_us = 20u64 << attempt.min(8);
    let jitter = crate::session::random_seed() % most_us;
    std::thread::sleep(Duration::from_micros(most_us / 2 + jitter / 2));
}

/// What a transaction's body may do (`crate::Client::transaction`, [`Session::transaction`]).
pub trait Transaction {
    /// The value of `key` as this transaction sees it: its own write if it made one, else
    /// the stored value (read once, and checked at commit).
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError>;
    /// Sets `key` to `value` (no expiry) when the transaction commits.
    fn put(&mut self, key: &[u8], value: &[u8]);
    /// Sets `key` to `value`, expiring at `expires_at_ms` (Unix ms), when it commits.
    fn put_expiring(&mut self, key: &[u8], value: &[u8], expires_at_ms: u64);
    /// Deletes `key` when the transaction commits.
    fn delete(&mut self, key: &[u8]);
}

/// How a transaction's reads and commit are done: a [`Session`] runs the protocol itself;
/// an attached or remote client asks its computenode (`Request::ReadVersioned`,
/// `Request::Commit`), whose session runs it.
pub(crate) trait Coordinator {
    /// [`Session::read_versioned`].
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError>;
    /// [`Session::commit`].
    fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError>;
}

impl<S: Shards> Coordinator for Session<S> {
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        Session::read_versioned(self, key)
    }

    fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        Session::commit(self, reads, writes)
    }
}

/// Runs `body` as a transaction through `coordinator` ([`Session::transaction`],
/// `crate::Client::transaction`): its reads (each key once) and writes are buffered, then
/// committed at once; on a conflict it runs again, after a backoff, at most
/// [`MAX_TXN_ATTEMPTS`] times. From attempt [`LOCK_READS_AFTER_ATTEMPTS`] on, the keys
/// only read are written back as read, so their locks hold them still until the commit.
pub(crate) fn run<C: Coordinator + ?Sized, T>(
    coordinator: &mut C,
    mut body: impl FnMut(&mut dyn Transaction) -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    for attempt in 0..MAX_TXN_ATTEMPTS {
        let mut txn = Txn { coordinator: &mut *coordinator, reads: Vec::new(), writes: Vec::new() };
        let value = body(&mut txn)?;
        let Txn { reads, writes, .. } = txn;
        let mut writes: Vec<Write<'_>> =
            writes.iter().map(|(k, v, at)| Write { key: k, value: v.as_deref(), expires_at_ms: *at }).collect();
        if attempt >= LOCK_READS_AFTER_ATTEMPTS {
            // Write back what was read: its lock keeps it still until the commit point.
            let read_only = reads.iter().filter(|(k, _, _)| !writes.iter().any(|w| w.key == k.as_slice()));
            let rewrites: Vec<Write<'_>> = read_only
                .map(|(k, v, item)| Write {
                    key: k,
                    value: item.as_ref().map(|i| i.value.as_slice()),
                    expires_at_ms: v.expires_at_ms,
                })
                .collect();
            writes.splice(0..0, rewrites);
        }
        let reads: Vec<(&[u8], Version)> = reads.iter().map(|(k, v, _)| (k.as_slice(), *v)).collect();
        if coordinator.commit(&reads, &writes)? {
            return Ok(value);
        }
        backoff(attempt);
    }
    Err(ClientError::Conflict(format!("the transaction conflicted {MAX_TXN_ATTEMPTS} times in a row")))
}

/// A buffered write: key, value (None: a delete), expiry.
type BufferedWrite = (Vec<u8>, Option<Vec<u8>>, Option<u64>);

/// A transaction being built by a body ([`run`]).
struct Txn<'c, C: ?Sized> {
    coordinator: &'c mut C,
    /// (key, version, item) of every key read, in order.
    reads: Vec<(Vec<u8>, Version, Option<Item>)>,
    /// The writes, in order.
    writes: Vec<BufferedWrite>,
}

impl<C: Coordinator + ?Sized> Transaction for Txn<'_, C> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        if let Some((_, value, _)) = self.writes.iter().rev().find(|(k, _, _)| k == key) {
            return Ok(value.clone());
        }
        if let Some((_, _, item)) = self.reads.iter().find(|(k, _, _)| k == key) {
            return Ok(item.as_ref().map(|i| i.value.clone()));
        }
        let (item, version) = self.coordinator.read_versioned(key)?;
        let value = item.as_ref().map(|i| i.value.clone());
        self.reads.push((key.to_vec(), version, item));
        Ok(value)
    }

    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.writes.push((key.to_vec(), Some(value.to_vec()), None));
    }

    fn put_expiring(&mut self, key: &[u8], value: &[u8], expires_at_ms: u64) {
        self.writes.push((key.to_vec(), Some(value.to_vec()), Some(expires_at_ms)));
    }

    fn delete(&mut self, key: &[u8]) {
        self.writes.push((key.to_vec(), None, None));
    }
}
