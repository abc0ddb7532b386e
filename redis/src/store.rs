//! The storage interface the Redis front end is written against.
//!
//! The front end knows nothing of the RACE table: it drives one [`KvSession`] per client
//! connection, obtained from a shared [`KvStore`]. The real implementation (workers over the
//! RACE table through pre-initialized connections) lives elsewhere; `MemStore` (feature
//! `test-support`) is an in-memory test double for the protocol layer's own tests.
//!
//! Contract every implementation keeps:
//! * Keys and values are arbitrary bytes (empty included). Limits on their sizes are the
//!   store's: it reports them as [`StoreErrorKind::KeyTooLarge`] / [`StoreErrorKind::ValueTooLarge`].
//! * A session is used by one thread at a time and never shared (`Send`, not `Sync`), so an
//!   implementation may keep per-connection state (a borrowed connection, caches, buffers)
//!   without locking.
//! * Every call is blocking: it returns once the operation is complete (or has failed).
//! * A failed call may or may not have taken effect when the error kind is
//!   [`StoreErrorKind::Timeout`] or [`StoreErrorKind::Unavailable`]; the front end reports the
//!   error to the client and does not retry writes on its own.
//! * Keys may expire. Expiry times are absolute Unix milliseconds on the hosts' wall clocks
//!   (`racekv_telemetry::clock::now_unix_ms`); a key is live through its expiry millisecond
//!   and gone after it. An expired key is absent to every call (reads, conditions, DEL), as
//!   in Redis. A plain [`KvSession::put`] and [`KvSession::multi_put`] leave the key with no
//!   expiry (Redis' SET and MSET); [`KvSession::compare_and_swap`] keeps the key's expiry
//!   (INCR and friends keep a key's TTL); [`KvSession::put_opts`] says what to do.

use std::fmt;

/// The most keys one [`KvSession::scan`] page may hold (SCAN's COUNT is clamped to it).
pub const SCAN_PAGE_MAX_KEYS: usize = 100_000;
/// The most bytes of keys one [`KvSession::scan`] page may hold, each key counting its
/// length plus 8; a single longer key comes on its own.
pub const SCAN_PAGE_MAX_BYTES: usize = 16 << 20;

/// How a put treats an existing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Insert or overwrite (plain `SET`).
    Upsert,
    /// Only when the key is absent (`SET ... NX`, `SETNX`).
    InsertOnly,
    /// Only when the key is present (`SET ... XX`).
    UpdateOnly,
}

/// What a write does to the key's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// No expiry (plain `SET`).
    Never,
    /// Expires after this absolute Unix time in milliseconds (one already past writes a key
    /// no read sees, as Redis 7 does for `SET ... PXAT <past>`).
    At(u64),
    /// Whatever expiry the key has (none for an absent key): `SET ... KEEPTTL`.
    Keep,
}

/// How [`KvSession::put_opts`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOptions {
    /// Whether the key must be absent (NX), present (XX), or either.
    pub mode: PutMode,
    /// What the write does to the key's expiry.
    pub expiry: Expiry,
    /// Return the value the key had (`SET ... GET`).
    pub get: bool,
}

/// What [`KvSession::put_opts`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutResult {
    /// Whether the write was applied (false: NX found the key / XX did not).
    pub applied: bool,
    /// With [`PutOptions::get`]: the value the key had when the write ran (None: absent or
    /// expired), whether or not it applied.
    pub old: Option<Vec<u8>>,
}

/// A key's value and expiry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The value's bytes.
    pub value: Vec<u8>,
    /// Absolute Unix milliseconds; None: never expires.
    pub expires_at_ms: Option<u64>,
}

/// What a store knows of a key's reads ([`KvSession::access`]: `OBJECT IDLETIME`, `OBJECT
/// FREQ`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyAccess {
    /// Seconds since it was last read (reads are recorded under an LRU policy; under
    /// others this counts from its last write).
    pub idle_s: u64,
    /// Its LFU counter as of now, decayed (counted under an LFU policy).
    pub lfu_counter: u8,
}

/// A new expiry for a key, decided from its current one ([`KvSession::update_expiry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryUpdate {
    /// Leave the key as it is.
    Unchanged,
    /// Expire after this time (None: never).
    Set(Option<u64>),
    /// Remove the key (an expiry in the past: `EXPIRE` deletes at once).
    Delete,
}

/// What a transaction saw of a key ([`KvSession::read_versioned`]): the store defines the
/// fields; the front end only keeps a version and hands it back to [`KvSession::commit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyVersion {
    /// The store's word for the key's current state (0: absent). A write of the key,
    /// whatever its value, gives it another word, or (racekv, rarely: a block reused
    /// after the grace period) the same word with other `content`.
    pub word: u64,
    /// What tells apart two states with one word (racekv: the block's checksum; 0 where the
    /// store's words never recur). The same word and content again is the same value again.
    pub content: u64,
    /// The key's expiry when read (None: never, or absent): a key that has expired since
    /// counts as changed (as Redis' WATCH treats an expired key).
    pub expires_at_ms: Option<u64>,
}

impl KeyVersion {
    /// The version of an absent key.
    pub const ABSENT: KeyVersion = KeyVersion { word: 0, content: 0, expires_at_ms: None };
}

/// One write of a transaction ([`KvSession::commit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnWrite<'a> {
    /// The key written.
    pub key: &'a [u8],
    /// Its new value; None deletes it.
    pub value: Option<&'a [u8]>,
    /// The new value's expiry (absolute Unix milliseconds; None: never). Ignored for a delete.
    pub expires_at_ms: Option<u64>,
}

/// What went wrong in the store, coarse enough to choose a client-facing reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// The key exceeds what the store can hold.
    KeyTooLarge,
    /// The value exceeds what the store can hold (the RACE table's KV blocks are small).
    ValueTooLarge,
    /// No room left for the write (memory nodes full).
    Full,
    /// Over `maxmemory` with nothing the policy may evict (Redis' OOM reply, verbatim).
    OverMaxmemory,
    /// The storage backend cannot be reached right now (memory node down, no connection).
    Unavailable,
    /// The backend did not answer in time; a write may or may not have been applied.
    Timeout,
    /// Anything else (a bug, corrupted data, ...).
    Other,
}

impl StoreErrorKind {
    /// Stable lower-case name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            StoreErrorKind::KeyTooLarge => "key_too_large",
            StoreErrorKind::ValueTooLarge => "value_too_large",
            StoreErrorKind::Full => "full",
            StoreErrorKind::OverMaxmemory => "over_maxmemory",
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Timeout => "timeout",
            StoreErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed storage operation: a [`StoreErrorKind`] plus a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct StoreError {
    /// What went wrong.
    pub kind: StoreErrorKind,
    /// Detail for the client and the logs (e.g. "value of 20000 bytes, limit 16320").
    pub message: String,
}

impl StoreError {
    /// An error of `kind` with `message`.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// The RESP error line (without the leading `-` and trailing CRLF) a client receives.
    ///
    /// The first word is the error code clients dispatch on: `OOM` for a full store (as
    /// Redis reports `maxmemory`), `TRYAGAIN` for conditions that may clear by themselves,
    /// `ERR` otherwise.
    pub fn to_resp_error(&self) -> String {
        let (code, what) = match self.kind {
            StoreErrorKind::KeyTooLarge => ("ERR", "key too large"),
            StoreErrorKind::ValueTooLarge => ("ERR", "value too large"),
            StoreErrorKind::Full => ("OOM", "storage is full"),
            StoreErrorKind::OverMaxmemory => ("OOM", "command not allowed when used memory > 'maxmemory'."),
            StoreErrorKind::Unavailable => ("TRYAGAIN", "storage unavailable"),
            StoreErrorKind::Timeout => ("TRYAGAIN", "storage timed out, the write may have been applied"),
            StoreErrorKind::Other => ("ERR", "storage error"),
        };
        if self.message.is_empty() {
            format!("{code} {what}")
        } else {
            format!("{code} {what}: {}", self.message)
        }
    }
}

/// One storage session (one per client connection; not shared between threads).
// `len` is DBSIZE; an `is_empty` would be one more method for every implementation to write
// and nothing here needs it.
#[allow(clippy::len_without_is_empty)]
pub trait KvSession: Send {
    /// The value of `key`, or `None` when absent.
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// Writes `value` under `key` as `mode` allows.
    /// Returns whether the write was applied (false: NX found the key / XX did not).
    fn put(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, StoreError>;

    /// Removes `key`; returns whether it was present.
    fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError>;

    /// Atomically replace the value if it currently equals `expected` (None = absent). The
    /// key keeps its expiry (a new key gets none). Returns whether the swap happened.
    fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError>;

    /// Atomically removes `key` if its value currently equals `expected`; returns whether it
    /// did (GETDEL is built on it). The default refuses: a read then a delete would not be
    /// atomic, and another writer's value could be deleted unseen.
    fn compare_and_delete(&mut self, key: &[u8], expected: &[u8]) -> Result<bool, StoreError> {
        let _ = (key, expected);
        Err(StoreError::new(StoreErrorKind::Other, "this store has no atomic compare-and-delete"))
    }

    /// Bytes `key` takes in storage, `None` when absent (`MEMORY USAGE`). The default reads
    /// the value and counts key and value bytes only; a store with per-item overhead (the
    /// RACE table's blocks and slots) reports that too.
    fn memory_usage(&mut self, key: &[u8]) -> Result<Option<u64>, StoreError> {
        Ok(self.get(key)?.map(|value| (key.len() + value.len()) as u64))
    }

    /// Writes `value` under `key` as `options` say: its mode, its expiry, and whether to
    /// return the value the key had (atomically with the write).
    fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, StoreError>;

    /// The value and expiry of `key`, or `None` when absent.
    fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError>;

    /// What the store knows of `key`'s reads, read without counting as one: `None` when
    /// absent, `Some(None)` when it keeps nothing for the key. The default keeps nothing.
    fn access(&mut self, key: &[u8]) -> Result<Option<Option<KeyAccess>>, StoreError> {
        Ok(self.get(key)?.map(|_| None))
    }

    /// Atomically changes `key`'s expiry as `decide` says given its current one (None: no
    /// expiry): `decide` is not called for an absent key, and may be called again when a
    /// write got in between. Returns the key's value as it was and whether `decide` asked
    /// for a change (setting the same time counts); `None` when the key is absent.
    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError>;

    /// The values of `keys`, in order (`None` for absent keys), exactly as consecutive
    /// [`KvSession::get`]s would return them (each read after the one before; not a snapshot
    /// across keys). Pipelined GETs, MGET and EXISTS use it; implementations may batch.
    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Upserts every pair, in order (a later pair with the same key wins). Not atomic across
    /// keys: on error, a prefix may have been applied.
    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError>;

    /// Number of keys (DBSIZE): exact while no write is in flight (a write in flight may
    /// or may not be counted yet); counts expired keys nobody has removed yet (as Redis'
    /// DBSIZE does).
    fn len(&mut self) -> Result<u64, StoreError>;

    /// One page of a walk over every key (SCAN): about `count` keys from `cursor` on, and
    /// the cursor to continue from. The walk starts at 0 and is over when the returned
    /// cursor is 0. Every number is a cursor (one that no walk returned may end the walk or
    /// continue it from anywhere; never an error). A key present from a walk's first call
    /// to its last is returned at least once; a key may be returned more than once, and a
    /// page may be empty before the end. A page holds at most [`SCAN_PAGE_MAX_KEYS`] keys
    /// and [`SCAN_PAGE_MAX_BYTES`] bytes of them.
    fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError>;

    /// A key picked at random (RANDOMKEY), or `None` when there are none.
    fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError>;

    /// Deletes every key (FLUSHALL); returns how many. Not atomic: a key written while it
    /// runs may survive it.
    fn flush(&mut self) -> Result<u64, StoreError>;

    /// Extra `key:value` lines for INFO (cluster/memnode/worker details), one per line,
    /// without a section header; lines end in `\n` or `\r\n` (the front end normalizes).
    fn info(&mut self) -> Result<String, StoreError>;

    /// The connection has answered everything it was sent and waits for more: a moment for
    /// deferred work (publishing counts). Errors are the store's to log.
    fn idle(&mut self) {}

    /// The key's item and its version, for a transaction's read set (MULTI/EXEC, WATCH).
    /// An expired key reads as absent. A key a transaction is committing right now is
    /// waited for (bounded), never read half-way. The default refuses.
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        let _ = key;
        Err(StoreError::new(StoreErrorKind::Other, "this store has no transactions"))
    }

    /// Applies every write atomically if every read still has its version (and no read key
    /// has expired since it was read); returns false, writing nothing, when one changed.
    /// Readers see all of the writes or none of them. A key both read and written is
    /// checked by its write. Writes to one key: the last wins. The default refuses.
    fn commit(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> Result<bool, StoreError> {
        let _ = (reads, writes);
        Err(StoreError::new(StoreErrorKind::Other, "this store has no transactions"))
    }
}

/// A store that hands out sessions; shared by every connection of a server.
pub trait KvStore: Send + Sync + 'static {
    /// A new session for one client connection. Called on the connection's own thread, so
    /// it may block (e.g. to attach a pre-initialized connection).
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_errors_name_the_condition_and_keep_the_detail() {
        let e = StoreError::new(StoreErrorKind::ValueTooLarge, "20000 bytes, limit 16320");
        assert_eq!(e.to_resp_error(), "ERR value too large: 20000 bytes, limit 16320");
        assert_eq!(StoreError::new(StoreErrorKind::Full, "").to_resp_error(), "OOM storage is full");
        assert_eq!(
            StoreError::new(StoreErrorKind::OverMaxmemory, "").to_resp_error(),
            "OOM command not allowed when used memory > 'maxmemory'."
        );
        assert!(StoreError::new(StoreErrorKind::Unavailable, "memnode 2").to_resp_error().starts_with("TRYAGAIN "));
        assert_eq!(e.to_string(), "value_too_large: 20000 bytes, limit 16320");
    }
}
