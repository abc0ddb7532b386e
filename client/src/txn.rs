//! Multi-key transactions: the coordinator, over any [`Shards`] (one or many memnodes).
//!
//! A transaction reads optimistically ([`Session::read_versioned`]: each key's value and its
//! version, the canonical slot word) and buffers its writes; [`Session::commit`] then makes
//! the writes atomic, if nothing it read has changed, with one-sided operations only
//! (the per-memnode steps are `racekv_hashing::table::txn`):
//!
//! 1. **Records**: a record on the memnode of the first key written (the *home*), pending
//!    until a lease deadline ([`TXN_LEASE_MS`] from now), listing a *participant record* on
//!    every other memnode written, each naming the home record. Each is written in the
//!    first batch of its memnode's first lock, before that lock's CAS: no round trip of its
//!    own. A lock names the record on its own memnode.
//! 2. **Lock** each written key: write an intent block (the new value, or a tombstone for a
//!    delete, marked with the record's place, the version read and the deadline) and CAS
//!    the key's slot from the version read to the intent's *locked* word. A key written but
//!    not read has its version read first. When the probe shows that version still at the
//!    key's lowest fingerprint slot, the CAS follows without reading the block again. Locks
//!    never wait: a CAS that fails (the key
//!    changed, or another transaction holds it) aborts this attempt. A slot word can come
//!    back (a block reused after the grace period may get the same word), so the CAS's
//!    batch also reads the header of the block the lock replaced: for a key that was read,
//!    its checksum must be the one read.
//! 3. **Validate** the keys read but not written: their slot words and block checksums are
//!    still the versions read (a locked word never is one), and none has expired since.
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
//! then the first operation to meet one gets `Error::Locked`, and [`Session`] settles it as
//! decided: by a participant record that holds the decision, else by the home record
//! (aborted first if still pending). A lock on the home memnode is settled only after the
//! decision is copied into every participant record, and the coordinator settles the
//! home's locks last: so a home memnode that restarts after its locks were settled (its
//! reclaim frees the home record) leaves every other lock its decision in a record its own
//! memnode keeps. Records of a dead coordinator are freed at their memnode's next start
//! (`racekv_hashing::reclaim`). A memnode that restarts under its first lock aborts the
//! commit (ARCHITECTURE.md, "Multi-key transactions").
//!
//! **Round trips**, uncontended, on one memnode, for `w` keys written (`r` more read):
//! per written key 2 (version, unless it was read) + 2 (lock; 3 if the probe no longer shows
//! the version in place), `r` checks of 2, decide 1, settle 1 per memnode. Versions and locks
//! go one key at a time. A key's replicas are worked on together ([`Session::on_all`]):
//! its backups' versions are read while its primary's lock goes in, their locks go in
//! together, and all backups' settles go out together before the primaries'. The decision's
//! copies into the participant records stay one after another (resolve.rs needs a prefix).

use racekv_hashing::layout::{MarkOwner, TxnMark};
use racekv_hashing::table::txn::{Lock, RecordLinks, SlotVersion, TxnState, MAX_TXN_PARTICIPANTS, TXN_LEASE_MS};
use racekv_hashing::Item;

use crate::error::ClientError;
use crate::optimistic::{last_write_per_key, run, Coordinator};
pub use crate::optimistic::{
    Transaction, Version, Write, LOCK_READS_AFTER_ATTEMPTS, MAX_TXN_ATTEMPTS, MAX_TXN_WRITES, TXN_CONFLICT_BUDGET,
};
use crate::session::{Redo, Session, Shards};

/// Times a key written without being read has its version read again when its lock loses
/// a race, before the attempt counts as a conflict.
const BLIND_LOCK_ATTEMPTS: u32 = 3;

/// What one memnode's part of a write's first lock round gave: the primary's lock, or a
/// backup's version (its slot word).
enum Step {
    Locked(Option<Lock>),
    Version(SlotVersion),
}

impl Step {
    fn into_lock(self) -> Option<Lock> {
        match self {
            Step::Locked(lock) => lock,
            Step::Version(_) => unreachable!("the primary's part is its lock"),
        }
    }

    fn into_version(self) -> SlotVersion {
        match self {
            Step::Version(version) => version,
            Step::Locked(_) => unreachable!("a backup's part is its version"),
        }
    }
}

/// A lock this coordinator placed.
struct Held<'a> {
    key: &'a [u8],
    shard: usize,
    /// On a replica other than the key's primary (settled before any primary's lock).
    backup: bool,
    lock: Lock,
    mark: TxnMark,
}

impl<S: Shards> Session<S> {
    /// `key`'s item (None: absent or expired) and its version, for a transaction's read
    /// set. A key another transaction is committing is waited for.
    pub fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        let (item, version) = self.on_key(key, |c| c.read_versioned(key))?;
        let expires_at_ms = item.as_ref().and_then(|i| i.expires_at_ms);
        Ok((item, Version { word: version.word, checksum: version.checksum, expires_at_ms }))
    }

    /// Applies `writes` atomically if every key of `reads` still has the version read (and
    /// has not expired since); returns false, with nothing applied, when one changed or
    /// another transaction held a key. Writes of one key: the last wins. A key both read and
    /// written is checked by its lock.
    pub fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        // By one map. A commit decides only while no participant served a newer map
        // (`commit_routed`), so when the map moved its keys: an aborted one applied
        // nothing (the caller reads again by the new map), a committed one stands if each
        // key's new primary is among the memnodes it wrote. Otherwise it is reported (it
        // may have applied where its keys no longer live).
        let keys = reads.iter().map(|(k, _)| *k).chain(writes.iter().map(|w| w.key));
        let mut routed: Vec<Vec<usize>> = Vec::new();
        let mut outcome = None;
        let result = self.under_map(keys, Redo::No, |s| {
            routed = writes.iter().map(|w| s.write_set(w.key)).collect();
            let result = s.commit_routed(reads, writes);
            outcome = result.as_ref().ok().copied();
            result
        });
        let committed = match result {
            Err(ClientError::MapChanged { .. }) if outcome == Some(false) => return Ok(false),
            Err(ClientError::MapChanged { .. })
                if outcome == Some(true)
                    && writes.iter().zip(&routed).all(|(w, went)| went.contains(&self.route(w.key))) =>
            {
                true
            }
            result => result?,
        };
        if committed {
            // The map changed under the commit but kept each key's primary among the
            // memnodes written: the result stands, and a key whose replicas changed (a
            // memnode joining its partition, `catchup.rs`; one leaving it) is copied to
            // the ones it has now.
            for (write, went) in writes.iter().zip(&routed) {
                if self.write_set(write.key) != *went {
                    self.sync_key(write.key)?;
                }
            }
        }
        Ok(committed)
    }

    /// The shards a write of `key` goes to, the primary first.
    pub(crate) fn write_set(&self, key: &[u8]) -> Vec<usize> {
        let mut shards = self.backups_of(key);
        shards.insert(0, self.route(key));
        shards
    }

    fn commit_routed(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        let writes = last_write_per_key(writes);
        if writes.len() > MAX_TXN_WRITES {
            return Err(ClientError::TooLarge { key: 0, value: writes.len(), max: MAX_TXN_WRITES });
        }
        let Some(first) = writes.first() else {
            return self.validate(reads, &[]);
        };
        let home = self.route(first.key);
        let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
        let records = self.stage_records(home, &writes, deadline_ms)?;
        let record_offset = records[0].1;
        let base = TxnMark::of_record(self.shards().node_id(home), record_offset, 0, deadline_ms);
        let mut held = Vec::with_capacity(writes.len());
        let mut uncertain = false;
        let prepared = self
            .lock_all(reads, &writes, &records, base, &mut held, &mut uncertain)
            .and_then(|locked| Ok(locked && self.validate(reads, &writes)?));
        if held.is_empty() && !uncertain {
            // No lock was placed: nothing names the records (which may not even be written).
            self.free_records(&records);
            return prepared.map(|_| false);
        }
        let still_leased = racekv_hashing::clock::now_unix_ms() < deadline_ms;
        // No participant may have served a newer map when its lock went in: a mover raises
        // the epoch word of every memnode of a partition whose primary changes before the
        // map that changes it is written, so a lock placed after that is seen here, and one
        // placed before it comes before every lock by the new map (which then waits for it).
        let same_map = self.shards().map_changed().is_none();
        let to = if matches!(prepared, Ok(true)) && still_leased && same_map {
            TxnState::Committed
        } else {
            TxnState::Aborted
        };
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
        let committed = match self.copy_commit(&records, deadline_ms, &held, committed) {
            Ok(committed) => committed,
            Err(e) => return Err(prepared.err().unwrap_or(e)),
        };
        // Backups' locks first, so that a key's value is on every replica before its
        // primary (which readers use) shows it. The home memnode's primary locks last:
        // while one stands, its start's reclaim keeps the record, so a coordinator dying
        // midway leaves every other lock resolvable.
        let phase = |h: &Held<'_>| (!h.backup, h.shard == home && !h.backup, h.shard);
        let mut groups: Vec<(bool, bool, usize)> = held.iter().map(phase).collect();
        groups.sort_unstable();
        groups.dedup();
        let mut backup_unsettled = None;
        let locks_of = |group| -> Vec<(&[u8], Lock, TxnMark)> {
            held.iter().filter(|h| phase(h) == group).map(|h| (h.key, h.lock, h.mark)).collect()
        };
        let unsettled = |e: &ClientError| {
            tracing::warn!("a transaction's locks could not be settled (readers resolve them after the lease): {e}")
        };
        // The backups' memnodes all together (their round trips overlap), then the primaries'.
        let (primaries, backups): (Vec<_>, Vec<_>) = groups.into_iter().partition(|&(primary, ..)| primary);
        let shards: Vec<usize> = backups.iter().map(|&(.., shard)| shard).collect();
        let locks: Vec<_> = backups.into_iter().map(locks_of).collect();
        let settled = self.on_all(&shards, async |c, i| c.txn_settle_placed_overlapped(&locks[i], committed).await);
        for result in settled.unwrap_or_else(|e| vec![Err(e)]) {
            if let Err(e) = result {
                unsettled(&e);
                uncertain = true;
                backup_unsettled.get_or_insert(e);
            }
        }
        for group in primaries {
            let (_, at_home, shard) = group;
            if (at_home && uncertain) || (committed && backup_unsettled.is_some()) {
                // Another memnode's locks may stand: the home's stay too (their record, kept
                // through restarts, holds the decision), for resolvers, who copy it into the
                // participant records before they settle a lock here. A committed backup
                // lock left standing keeps the primaries' too (conservative: its record
                // already holds the commit, so resolvers settle it alike either way), and
                // the caller hears the error rather than an acknowledgement.
                break;
            }
            let locks = locks_of(group);
            if let Err(e) = self.on(shard, |c| c.txn_settle_placed(&locks, committed)) {
                unsettled(&e);
                uncertain = true;
            }
        }
        if !uncertain {
            self.free_records(&records);
        }
        prepared?;
        match backup_unsettled {
            // Committed, but not yet settled on every replica (the primary's lock stands
            // until a resolver settles it, from the records): not acknowledged; the caller
            // hears that it may have applied.
            Some(e) if committed => Err(e),
            _ => Ok(committed),
        }
    }

    /// A replicated transaction's commit, copied into every participant record in order
    /// before any lock is settled (so a lock that outlives the home memnode's failover is
    /// settled alike by whoever resolves it: resolve.rs). Returns whether it still commits:
    /// a participant record a resolver already aborted (it saw the home failed over) means
    /// the cluster decided against it. An error leaves every lock for the resolvers.
    fn copy_commit(
        &mut self,
        records: &[(usize, u64, u8)],
        deadline_ms: u64,
        held: &[Held<'_>],
        committed: bool,
    ) -> Result<bool, ClientError> {
        if !committed || !held.iter().any(|h| h.backup) {
            return Ok(committed);
        }
        for &(shard, offset, _) in &records[1..] {
            match self.on(shard, |c| c.txn_decide(offset, deadline_ms, TxnState::Committed))? {
                Some(TxnState::Committed) => {}
                Some(TxnState::Aborted) => return Ok(false),
                other => {
                    return Err(ClientError::Internal {
                        endpoint: self.shards().label(shard).to_string(),
                        reason: format!("a transaction's participant record holds {other:?}, not its decision"),
                    })
                }
            }
        }
        Ok(true)
    }

    /// Runs `body` as a transaction: its reads ([`Transaction::get`]) see one snapshot and
    /// its writes ([`Transaction::put`], [`Transaction::delete`]) apply atomically when it
    /// returns, or not at all. On a conflict `body` runs again (at least [`MAX_TXN_ATTEMPTS`]
    /// times, and until [`TXN_CONFLICT_BUDGET`] has passed, then [`ClientError::Conflict`]),
    /// so it should have no other effects.
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
        records: &[(usize, u64, u8)],
        base: TxnMark,
        held: &mut Vec<Held<'w>>,
        uncertain: &mut bool,
    ) -> Result<bool, ClientError> {
        for w in writes {
            // The primary, then the backups.
            let all = self.write_set(w.key);
            let shard = all[0];
            let read = reads.iter().rev().find(|(k, _)| *k == w.key).map(|(_, v)| *v);
            // The backups' versions, read while the primary's first lock goes in.
            let mut versions = None;
            let mut attempt = 0;
            let lock = loop {
                let old_word = match read {
                    Some(version) => version.word,
                    None => self.on(shard, |c| c.txn_version(w.key))?.word,
                };
                if read.is_none() && racekv_hashing::layout::Slot::decode(old_word).is_some_and(|s| s.locked) {
                    break None; // another transaction holds it
                }
                let mark = self.mark_on(shard, records, old_word, base);
                let locked = if all.len() == 1 || versions.is_some() {
                    self.on(shard, |c| c.txn_lock(w.key, w.value, w.expires_at_ms, mark))
                } else {
                    // One round trip less per write: read before the primary's lock is held,
                    // a backup's version may be stale, and then its lock fails and reads
                    // it again (`lock_backups`).
                    let mut results = self.on_all(&all, async |c, i| match i {
                        0 => c.txn_lock_overlapped(w.key, w.value, w.expires_at_ms, mark).await.map(Step::Locked),
                        _ => c.read_versioned_overlapped(w.key).await.map(|(_, v)| Step::Version(v)),
                    })?;
                    let locked = results.remove(0).map(Step::into_lock);
                    versions = Some(results.into_iter().map(|r| r.map(Step::into_version)).collect());
                    locked
                };
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
            let tombstone = w.value.is_none();
            held.push(Held { key: w.key, shard, backup: false, lock, mark: TxnMark { tombstone, ..mark } });
            // The word read may have come back since, on a reused block (`Version`): the
            // lock read the header of the block it replaced, which says which write that was.
            // (A key read absent needs no check: absent again is the same content.)
            if read.is_some_and(|v| v.word != 0 && v.checksum != lock.replaced_checksum) {
                return Ok(false);
            }
            if !self.lock_backups(w, records, base, versions, held, uncertain)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Locks `w`'s key on its partition's other replicas, once its primary's lock is held,
    /// all of them together (their round trips overlap). Nothing else writes a backup
    /// without that lock, so a backup's version is read blind (a lock a dead transaction
    /// left there is waited out and resolved by the read); a lock that still loses its race
    /// (a settle landing meanwhile) is tried again a few times, then counts as a conflict.
    /// Every lock placed goes to `held`, also when another failed. `versions`: the backups'
    /// versions, read already (for the first try).
    fn lock_backups<'w>(
        &mut self,
        w: &Write<'w>,
        records: &[(usize, u64, u8)],
        base: TxnMark,
        mut versions: Option<Vec<Result<SlotVersion, ClientError>>>,
        held: &mut Vec<Held<'w>>,
        uncertain: &mut bool,
    ) -> Result<bool, ClientError> {
        let mut pending = self.backups_of(w.key);
        for _ in 0..BLIND_LOCK_ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            let versions = match versions.take() {
                Some(versions) => versions,
                None => {
                    let read = self.on_all(&pending, async |c, _| c.read_versioned_overlapped(w.key).await)?;
                    read.into_iter().map(|r| r.map(|(_, version)| version)).collect()
                }
            };
            assert_eq!(versions.len(), pending.len(), "a version per backup");
            let (mut marks, mut slots) = (Vec::with_capacity(pending.len()), Vec::with_capacity(pending.len()));
            for (&shard, version) in pending.iter().zip(versions) {
                let version = version?;
                marks.push(self.mark_on(shard, records, version.word, base));
                slots.push(version.slot);
            }
            let locked = self.on_all(&pending, async |c, i| {
                c.txn_lock_at_overlapped(w.key, w.value, w.expires_at_ms, marks[i], slots[i]).await
            })?;
            let mut failed = None;
            let mut lost = Vec::new();
            for ((&shard, mark), result) in pending.iter().zip(&marks).zip(locked) {
                match result {
                    Ok(Some(lock)) => {
                        let mark = TxnMark { tombstone: w.value.is_none(), ..*mark };
                        held.push(Held { key: w.key, shard, backup: true, lock, mark });
                    }
                    Ok(None) => lost.push(shard),
                    Err(e) => {
                        *uncertain = true;
                        failed.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            pending = lost;
        }
        Ok(pending.is_empty())
    }

    /// The shards of `key`'s partition's other replicas.
    pub(crate) fn backups_of(&self, key: &[u8]) -> Vec<usize> {
        self.shards().backups(key).iter().map(|&b| usize::from(b)).collect()
    }

    /// The lock mark of a write on `shard`: it names the transaction's record on that
    /// memnode (the home's or a participant's).
    fn mark_on(&self, shard: usize, records: &[(usize, u64, u8)], old_word: u64, base: TxnMark) -> TxnMark {
        let &(_, record_offset, _) = records.iter().find(|r| r.0 == shard).expect("a record per memnode");
        TxnMark {
            owner: MarkOwner::Record { node: self.shards().node_id(shard), offset: record_offset },
            old_word,
            ..base
        }
    }

    /// Allocates the transaction's records, staged to go out with each memnode's first lock:
    /// the home record first, listing a participant record on every other memnode written,
    /// which names it. Returns (shard, offset, units), the home's first.
    fn stage_records(
        &mut self,
        home: usize,
        writes: &[Write<'_>],
        deadline_ms: u64,
    ) -> Result<Vec<(usize, u64, u8)>, ClientError> {
        let mut shards = vec![home];
        for w in writes {
            for shard in self.write_set(w.key) {
                if !shards.contains(&shard) {
                    shards.push(shard);
                }
            }
        }
        if shards.len() - 1 > MAX_TXN_PARTICIPANTS {
            return Err(ClientError::TooLarge { key: 0, value: shards.len() - 1, max: MAX_TXN_PARTICIPANTS });
        }
        let home_node = self.shards().node_id(home);
        let placeholder = RecordLinks::Home(vec![(0, 0); shards.len() - 1]);
        let home_offset = self.on(home, |c| c.txn_record(deadline_ms, &placeholder))?;
        let mut records = vec![(home, home_offset, placeholder.units())];
        for &shard in &shards[1..] {
            // Each participant names those before it (resolve.rs: who decides once the
            // home memnode is failed over).
            let before = records[1..].iter().map(|&(s, offset, _)| (self.shards().node_id(s), offset)).collect();
            let participant = RecordLinks::Participant { home_node, home_offset, before };
            match self.on(shard, |c| c.txn_record(deadline_ms, &participant)) {
                Ok(offset) => records.push((shard, offset, participant.units())),
                Err(e) => {
                    self.free_records(&records);
                    return Err(e);
                }
            }
        }
        let links =
            RecordLinks::Home(records[1..].iter().map(|&(s, offset, _)| (self.shards().node_id(s), offset)).collect());
        self.on(home, |c| {
            c.txn_relink_record(home_offset, deadline_ms, &links);
            Ok(())
        })?;
        Ok(records)
    }

    /// Frees the transaction's records (best effort: a record left is freed at its
    /// memnode's next start).
    fn free_records(&mut self, records: &[(usize, u64, u8)]) {
        for &(shard, offset, units) in records {
            let _ = self.on(shard, |c| {
                c.txn_free_record(offset, units);
                Ok(())
            });
        }
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
            let now = self.on(shard, |c| c.txn_version(key))?;
            if (now.word, now.checksum) != (version.word, version.checksum) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl<S: Shards> Coordinator for Session<S> {
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        Session::read_versioned(self, key)
    }

    fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        Session::commit(self, reads, writes)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use racekv_hashing::testing::{TestMemnode, Via};
    use racekv_transport::TransportKind;

    use crate::optimistic::{Version, Write};
    use crate::{Client, Path};

    const GRACE: Duration = Duration::from_millis(1);

    fn client(memnode: &TestMemnode) -> Client {
        Client::builder()
            .memnode(memnode.endpoint().unwrap().to_string())
            .token(TestMemnode::TOKEN)
            .timeout(Duration::from_secs(10))
            .grace_period(GRACE)
            .connect()
            .unwrap()
    }

    fn read_versioned(client: &Client, key: &[u8]) -> Version {
        let Path::Embedded(c) = client.path() else { panic!("an embedded client") };
        c.with(|s| s.read_versioned(key).unwrap().1)
    }

    fn commit(client: &Client, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> bool {
        let Path::Embedded(c) = client.path() else { panic!("an embedded client") };
        c.with(|s| s.commit(reads, writes).unwrap())
    }

    /// A writer that waits out the grace period between writes gets its freed blocks back,
    /// and with them, every so often, the very slot word a transaction read long before.
    /// That transaction's commit must still see the writes in between.
    #[test]
    fn a_slot_word_that_comes_back_on_a_reused_block_is_still_a_conflict() {
        let memnode = TestMemnode::start(Via::Transport(TransportKind::Tcp), 32 << 20, 8);
        let (reader, writer) = (client(&memnode), client(&memnode));
        writer.put(b"k", b"v000").unwrap();
        let read = read_versioned(&reader, b"k");
        let mut recurred = false;
        for i in 1..400 {
            std::thread::sleep(GRACE * 2);
            writer.put(b"k", format!("v{i:03}").as_bytes()).unwrap();
            let now = read_versioned(&reader, b"k");
            if now.word == read.word {
                assert_ne!(now.checksum, read.checksum, "another value, another checksum");
                recurred = true;
                break;
            }
        }
        assert!(recurred, "the word never came back: this no longer tests a recurring word");
        let value = reader.get(b"k").unwrap().unwrap();
        // Written after it was read: the lock's CAS from the word succeeds, its check not.
        let rewrite = [Write { key: b"k", value: Some(b"lost update"), expires_at_ms: None }];
        assert!(!commit(&reader, &[(b"k", read)], &rewrite), "a lost update");
        // Only read: validated by word and checksum.
        let other = [Write { key: b"other", value: Some(b"x"), expires_at_ms: None }];
        assert!(!commit(&reader, &[(b"k", read)], &other), "a stale read committed");
        assert_eq!(reader.get(b"k").unwrap(), Some(value), "the failed commits left the key alone");
        assert_eq!(reader.get(b"other").unwrap(), None);
        // The version as it is now commits.
        let now = read_versioned(&reader, b"k");
        assert!(commit(&reader, &[(b"k", now)], &rewrite));
        assert_eq!(reader.get(b"k").unwrap().as_deref(), Some(&b"lost update"[..]));
    }
}
