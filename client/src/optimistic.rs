//! A transaction as its body sees it: reads each key once (its value and version),
//! buffers writes, then hands both to a [`Coordinator`] to commit at once, running the body
//! again on a conflict. The coordinator is a `Session` (the protocol itself, `txn.rs`) or
//! an attached or remote client's computenode (`channel.rs`). Kept below both, so neither
//! imports the other.

use std::time::Duration;

use racekv_hashing::Item;

use crate::error::ClientError;

/// Attempts a transaction (`Session::transaction`, `crate::Client::transaction`) makes at
/// least before it gives up with [`ClientError::Conflict`]; it goes on past them until
/// [`TXN_CONFLICT_BUDGET`] has passed since its first (a reader of many keys among busy
/// writers on a loaded machine can lose more than 64 in a row, and then get through).
pub const MAX_TXN_ATTEMPTS: u32 = 64;
/// How long a transaction that keeps conflicting goes on running again (past its first
/// [`MAX_TXN_ATTEMPTS`] attempts) before it gives up.
pub const TXN_CONFLICT_BUDGET: Duration = Duration::from_secs(5);
/// Attempts after which a transaction also locks the keys it only read (writing back what
/// it read), so a long reader among busy writers stops losing every validation.
pub const LOCK_READS_AFTER_ATTEMPTS: u32 = 4;
/// Most distinct keys one transaction may write (each holds a lock until the commit).
pub const MAX_TXN_WRITES: usize = 4096;

/// What a transaction read of a key: its slot word and block checksum (both 0: absent),
/// and its expiry. The word alone can recur once its block is reused (after the grace
/// period), so a commit checks both: the same pair again is the same content again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Version {
    /// The key's canonical slot word when read (0: absent). A write gives a new one.
    pub word: u64,
    /// The checksum of the block the word names (0: absent).
    pub checksum: u64,
    /// Its expiry when read (None: never, or absent): expiring since counts as a change.
    pub expires_at_ms: Option<u64>,
}

impl Version {
    /// The version of an absent key.
    pub const ABSENT: Version = Version { word: 0, checksum: 0, expires_at_ms: None };

    /// Whether the key has expired since it was read, at `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
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
    let most_us = 20u64 << attempt.min(9);
    let jitter = crate::seed::random_seed() % most_us;
    std::thread::sleep(Duration::from_micros(most_us / 2 + jitter / 2));
}

/// What a transaction's body may do (`crate::Client::transaction`, `Session::transaction`).
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

/// How a transaction's reads and commit are done: a `Session` runs the protocol itself;
/// an attached or remote client asks its computenode (`Request::ReadVersioned`,
/// `Request::Commit`), whose session runs it.
pub(crate) trait Coordinator {
    /// A key's item and version (`Session::read_versioned`).
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError>;
    /// Applies `writes` if every read holds (`Session::commit`).
    fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError>;
}

/// Runs `body` as a transaction through `coordinator` (`Session::transaction`,
/// `crate::Client::transaction`): its reads (each key once) and writes are buffered, then
/// committed at once; on a conflict it runs again, after a backoff (20 us doubling to
/// 10 ms, jittered), [`MAX_TXN_ATTEMPTS`] times and on until [`TXN_CONFLICT_BUDGET`]
/// has passed. From attempt [`LOCK_READS_AFTER_ATTEMPTS`] on, the keys
/// only read are written back as read, so their locks hold them still until the commit.
pub(crate) fn run<C: Coordinator + ?Sized, T>(
    coordinator: &mut C,
    mut body: impl FnMut(&mut dyn Transaction) -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let started = std::time::Instant::now();
    let mut attempt = 0;
    loop {
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
        attempt += 1;
        if attempt >= MAX_TXN_ATTEMPTS && started.elapsed() >= TXN_CONFLICT_BUDGET {
            return Err(ClientError::Conflict(format!(
                "the transaction conflicted {attempt} times in a row, for {} ms",
                started.elapsed().as_millis()
            )));
        }
        backoff(attempt);
    }
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
