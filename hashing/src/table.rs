//! The client protocols: search, upsert/insert/update, delete and compare-and-swap, over
//! one-sided operations on a memnode's region.
//!
//! Round trips, uncontended: search 1 (no fingerprint match) or 2; insert 2 (3 when a
//! fingerprint collides); update and delete 3. Writes go out of place: the new KV block is
//! written in the same batch as the first bucket read, then one CAS swings the slot.
//!
//! Races handled here (the memnode-side half is in `split.rs`):
//! * Duplicate keys: two inserts of one key can land in different empty slots. After an
//!   insert CAS the client re-reads the buckets (same batch); if other copies exist, the
//!   copy at the lowest slot address wins, losers are CASed to 0. Readers also prefer the
//!   lowest address, so everyone agrees which copy is current. An inserter whose re-read no
//!   longer shows its own word in its slot was superseded and removes nothing (a thread can
//!   stall between the CAS and the re-read for longer than others take to update the key);
//!   a winner reads its slot once more before removing the others, because a bucket read is
//!   not a snapshot (a thread preempted inside the copy sees early and late words side by side).
//! * Stale directory: every bucket read checks each header's (depth, suffix) against the
//!   key; a mismatch re-reads the directory entry (or the whole directory if it grew).
//! * Insert racing a split: if the re-read shows the bucket was re-assigned to a deeper
//!   split that excludes the key, the insert CASes its slot back to 0 and retries; if that
//!   CAS fails, the splitter has already moved the entry, and the insert stands.
//! * Reuse of freed blocks: blocks are reused only after a grace period, and every block
//!   read is checked (key and checksum) before its value is used. A read that may have
//!   taken longer than the grace period reads its slot again before it trusts the block
//!   (`stall.rs`): the block may hold a newer write of the same key by then.
//!
//! Expiry: a block may carry an absolute expiry time (`layout.rs`, [`crate::clock`]). An
//! item past it is absent to every operation; its slot is still the key's, so a write
//! swings it (no second copy beside it), and a reader that meets one removes it with a CAS
//! from the word it followed (lazy expiry: it fails harmlessly if the slot moved on).
//! Rewrites that keep a value and change its expiry (`update_expiry`) read, then CAS the
//! slot word they read; writes that keep the expiry (`Expiry::Keep`, compare-and-swap)
//! encode their block with a guess and, when the key's expiry turns out to differ, encode
//! it again before anything is swung.
//!
//! Large values: a value too large for a block goes into an extent the memnode allocates
//! (`crate::extents`); the client writes it there, then publishes an indirect block that
//! says where, through the same CAS as any other write. A reader checks the value it read
//! against the block's checksum of it, and, if the read may have outlasted the grace
//! period, that the slot still holds the word that led to the block. Whoever swings an
//! indirect block's word away retires its extent by RPC at the end of the operation (its
//! block, retired into the grace queue, still says where the extent is).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use prometheus::local::{LocalHistogram, LocalIntCounter};
use prometheus::{HistogramVec, IntCounter, IntCounterVec};
use racekv_transport::{overlap, Batch, Connection, ReadId, TransportError};

use crate::access::{Access, Tracking};
use crate::alloc::{BlockAllocator, Chunk, ChunkSource, Fragments, FreePool};
use crate::directory::{CachedEntry, DirectoryCache};
use crate::error::Error;
use crate::hash::KeyHash;
use crate::layout::{
    block_head_bytes, block_units_for, decode_block, encode_any_block, key_digest, peek_block_head, sb,
    stored_block_checksum, value_checksum, Extent, Layout, LongKey, Slot, TxnMark, BLOCK_UNIT_BYTES,
    EXTENT_DESCRIPTOR_BYTES, LONG_KEY_DESCRIPTOR_BYTES, MAX_BLOCK_UNITS, MAX_INLINE_KEY_BYTES, MAX_KEY_BYTES,
    MAX_VALUE_BYTES, SLOTS_PER_BUCKET, TXN_MARK_BYTES,
};
use crate::probe::{Probe, ProbeReads};
use crate::rpc::{self, method, SplitRequest};
use crate::stall::{StallClock, Stamp};

mod held;
mod touch;
pub mod txn;
mod walk;
mod witness;

pub use held::HeldCopy;
pub use witness::Witness;

/// Tunables of table clients.
#[derive(Debug, Clone, Copy)]
pub struct TableOptions {
    /// How long a freed block waits before reuse: longer than most operations in flight (a
    /// read that takes longer is checked again). The memnode's published grace period, if
    /// longer, wins.
    pub grace_period: Duration,
    /// An operation that keeps retrying (contention, a split in progress) gives up after this.
    pub op_timeout: Duration,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self { grace_period: Duration::from_millis(10), op_timeout: Duration::from_secs(10) }
    }
}

/// Counts one client's protocol work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Operations run.
    pub ops: u64,
    /// Round trips (batches) to the memnode.
    pub round_trips: u64,
    /// CAS operations that lost to another writer.
    pub cas_failures: u64,
    /// Times a bucket header showed the cached directory out of date.
    pub stale_directory: u64,
    /// Split requests sent to the memnode.
    pub split_requests: u64,
    /// Block reads that did not match their slot and were retried.
    pub torn_reads: u64,
    /// Extra bucket reads that confirmed a key's absence after fingerprint collisions.
    pub absence_checks: u64,
    /// Reads that may have outlasted the grace period and read their slot again.
    pub stalled_reads: u64,
    /// Expired items this client found and removed (lazy expiry).
    pub expired_removed: u64,
    /// Retries spent waiting for a transaction's lock on a key.
    pub lock_waits: u64,
}

/// The outcome of a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The key was absent and is now stored.
    Inserted,
    /// The key was present and its value replaced.
    Updated,
    /// The condition did not hold (insert-if-absent found the key, update found none, or a
    /// compare-and-swap saw another value).
    NotApplied,
}

/// How a put treats an existing key. An expired key counts as absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Insert the key or replace its value.
    Upsert,
    /// Write only if the key is absent (Redis' `NX`).
    InsertOnly,
    /// Write only if the key is present (Redis' `XX`).
    UpdateOnly,
}

/// What a write does to the key's expiry. Times are absolute Unix milliseconds
/// ([`crate::clock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Expiry {
    /// The key never expires (a plain put clears any expiry the key had, as Redis' SET).
    #[default]
    Never,
    /// The key expires after this time (a time already past writes an item no reader sees).
    At(u64),
    /// The key keeps the expiry it has (none for a key that is absent or expired): Redis'
    /// `KEEPTTL`.
    Keep,
}

impl Expiry {
    /// [`Expiry::At`] for `Some`, [`Expiry::Never`] for `None`.
    pub fn from_ms(expires_at_ms: Option<u64>) -> Self {
        expires_at_ms.map_or(Expiry::Never, Expiry::At)
    }
}

/// How [`TableClient::put_opts`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutOptions {
    /// Whether the key must be absent, present, or either.
    pub mode: PutMode,
    /// What the write does to the key's expiry.
    pub expiry: Expiry,
    /// Return the value the key had before (Redis' `SET ... GET`).
    pub return_old: bool,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self { mode: PutMode::Upsert, expiry: Expiry::Never, return_old: false }
    }
}

/// What [`TableClient::put_opts`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutResult {
    /// Whether the put applied.
    pub outcome: PutOutcome,
    /// The live value the key had when the put ran (asked for with
    /// [`PutOptions::return_old`]; None: absent or expired, or not asked for). Set whether
    /// or not the put applied.
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

/// A new expiry for a key, decided from its current one ([`TableClient::update_expiry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryUpdate {
    /// Leave the key as it is.
    Unchanged,
    /// Expire at this time (None: never).
    Set(Option<u64>),
    /// Remove the key (an expiry already past, as Redis' EXPIRE with a time in the past).
    Delete,
}

#[derive(Clone, Copy)]
enum Cond<'a> {
    Any,
    Absent,
    Present,
    Equals(Option<&'a [u8]>),
    /// The key's canonical slot still holds this word (a read-then-CAS rewrite).
    Word(u64),
}

/// How far one attempt of a write got.
enum Step {
    Done(PutOutcome),
    /// A write keeping the key's expiry found it is not the one its block was encoded with:
    /// encode again with this one.
    Reencode(Option<u64>),
    /// A lock in place went back (`txn.rs`, `lock_in_place`): again, in a fresh block, so
    /// the word it showed never comes back.
    FreshBlock,
}

const OPS: [&str; 11] =
    ["get", "put", "insert", "update", "delete", "cas", "scan", "delete_all", "expire", "txn_lock", "txn_settle"];
const OP_GET: usize = 0;
const OP_EXPIRE: usize = 8;
const RESULTS: [&str; 3] = ["ok", "not_applied", "error"];

struct Metrics {
    ops: IntCounterVec,
    op_seconds: HistogramVec,
    round_trips: IntCounter,
    cas_failures: IntCounter,
    stale: IntCounter,
    splits: IntCounter,
    torn: IntCounter,
    stalled: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        ops: metric::counter_vec(
            "racekv_table_operations_total",
            "Table operations by kind and result",
            &["op", "result"],
            &[],
        ),
        op_seconds: metric::latency_histogram_vec(
            "racekv_table_operation_seconds",
            "Latency of table operations (sampled 1 in 16)",
            &["op"],
        ),
        round_trips: metric::counter("racekv_table_round_trips_total", "Batches sent by table operations"),
        cas_failures: metric::counter("racekv_table_cas_failures_total", "Slot CASes that lost a race and were retried"),
        stale: metric::counter(
            "racekv_table_stale_directory_total",
            "Bucket reads that found the directory cache stale",
        ),
        splits: metric::counter(
            "racekv_table_split_requests_total",
            "Splits requested because a key's buckets were full",
        ),
        torn: metric::counter(
            "racekv_table_torn_reads_total",
            "Block reads that found the block changed under them (a failed checksum, or not the block its slot word was written for) and were retried",
        ),
        stalled: metric::counter(
            "racekv_table_stalled_reads_total",
            "Reads that may have outlasted the grace period, so read their slot again before trusting the block",
        ),
    }
});

/// Per-client copies of the metrics, published every [`FLUSH_EVERY_OPS`] operations.
/// Extents a client could not retire (the memnode's next start reclaims them).
static EXTENTS_LEAKED: LazyLock<IntCounter> = LazyLock::new(|| {
    racekv_telemetry::metric::counter(
        "racekv_table_extents_unretired_total",
        "Value extents a client swung away but could not retire (reclaimed at the memnode's next start)",
    )
});

struct LocalMetrics {
    ops: Vec<LocalIntCounter>,
    op_seconds: Vec<LocalHistogram>,
    round_trips: LocalIntCounter,
    cas_failures: LocalIntCounter,
    stale: LocalIntCounter,
    splits: LocalIntCounter,
    torn: LocalIntCounter,
    stalled: LocalIntCounter,
    expired: LocalIntCounter,
    since_flush: u32,
}

const FLUSH_EVERY_OPS: u32 = 256;
/// Keys per round of `get_many` (six READs each in the first batch: two combined buckets,
/// then their four headers).
pub const KEYS_PER_ROUND: usize = racekv_transport::MAX_BATCH_OPS / 8;
const SAMPLE_EVERY_OPS: u64 = 16;
/// Times a write starts over because the memnode restarted under it (each time its space
/// from the old run is dropped; a stale prefetched chunk can cost one more).
const MAX_RESTARTED_ATTEMPTS: u32 = 4;
/// Fingerprint matches one probe can find: the slots of a key's four buckets.
const MAX_CANDIDATES: usize = 4 * SLOTS_PER_BUCKET;

// A block is read in one op; a `get_many` round's first batch (six READs a key) and one
// probe's block reads fit a batch.
const _: () = assert!(MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES <= racekv_transport::MAX_OP_BYTES);
const _: () = assert!(KEYS_PER_ROUND >= 1 && KEYS_PER_ROUND * 6 < racekv_transport::MAX_BATCH_OPS);
const _: () = assert!(MAX_CANDIDATES == 28 && MAX_CANDIDATES < racekv_transport::MAX_BATCH_OPS);
// A full batch of candidate block reads stays within a batch's bytes.
const _: () = assert!(
    racekv_transport::MAX_BATCH_OPS as u64 * crate::layout::MAX_BLOCK_UNITS * crate::layout::BLOCK_UNIT_BYTES
        <= racekv_transport::MAX_BATCH_BYTES
);

impl LocalMetrics {
    fn new() -> Self {
        let m = &*METRICS;
        Self {
            ops: OPS
                .iter()
                .flat_map(|op| RESULTS.iter().map(move |r| m.ops.with_label_values(&[op, r]).local()))
                .collect(),
            op_seconds: OPS.iter().map(|op| m.op_seconds.with_label_values(&[op]).local()).collect(),
            round_trips: m.round_trips.local(),
            cas_failures: m.cas_failures.local(),
            stale: m.stale.local(),
            splits: m.splits.local(),
            torn: m.torn.local(),
            stalled: m.stalled.local(),
            expired: crate::expiry::EXPIRED.with_label_values(&["lazy"]).local(),
            since_flush: 0,
        }
    }

    fn flush(&mut self) {
        self.ops.iter().for_each(|c| c.flush());
        self.op_seconds.iter().for_each(|h| h.flush());
        for c in
            [&self.round_trips, &self.cas_failures, &self.stale, &self.splits, &self.torn, &self.stalled, &self.expired]
        {
            c.flush();
        }
        self.since_flush = 0;
    }

    /// Counts one op of `op` that ended as `outcome` (an index of `RESULTS`), flushing every
    /// [`FLUSH_EVERY_OPS`] ops so a process's counters lag by a bounded amount.
    fn count_op(&mut self, op: usize, outcome: usize) {
        self.ops[op * RESULTS.len() + outcome].inc();
        self.since_flush += 1;
        if self.since_flush >= FLUSH_EVERY_OPS {
            self.flush();
        }
    }
}

/// A table on one memnode, shared by all its clients in this process.
pub struct Table {
    shared: Arc<Shared>,
}

struct Shared {
    layout: Layout,
    directory: DirectoryCache,
    chunks: Arc<dyn ChunkSource>,
    pool: Arc<FreePool>,
    options: TableOptions,
    /// The grace period this process waits: its own, or the memnode's if longer.
    grace: Duration,
    /// Readers trust a block only if they surely read it within the shortest grace period
    /// any client of the region waits (the memnode's, where it published one).
    stall: StallClock,
    /// What reads update in access words: a [`Tracking`], encoded (cache mode sets it).
    tracking: AtomicU64,
}

/// Gets KV chunks from the memnode by RPC.
pub struct RpcChunkSource {
    conn: Arc<dyn Connection>,
}

impl RpcChunkSource {
    /// A chunk source that asks the memnode over `conn`'s RPC.
    pub fn new(conn: Arc<dyn Connection>) -> Self {
        Self { conn }
    }
}

impl ChunkSource for RpcChunkSource {
    fn chunk(&self, preferred: u64) -> Result<Chunk, Error> {
        let reply = self.conn.call(method::ALLOC_CHUNK, &preferred.to_le_bytes()).map_err(rpc::map_error)?;
        let chunk = rpc::decode_chunk(&reply).map_err(|e| Error::Remote(e.to_string()))?;
        let Chunk { offset, bytes, .. } = chunk;
        let end = offset.checked_add(bytes).filter(|&end| end <= self.conn.region_len());
        if end.is_none() || offset % 64 != 0 || bytes % 64 != 0 || bytes < crate::alloc::MIN_CHUNK_BYTES {
            return Err(Error::Remote(format!("the memnode handed out a bad chunk ({offset}, {bytes} B)")));
        }
        Ok(chunk)
    }

    fn fragments(&self, most_bytes: u64) -> Option<Fragments> {
        // Usually there are none: one read of the superblock (a load on shm) spares the RPC.
        match crate::words::read_words(&*self.conn, &mut Batch::new(), &[sb::FRAGMENT_BYTES]) {
            Ok(w) if w[0] == 0 => return None,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("reading the memnode's fragment count failed: {e}");
                return None;
            }
        }
        let reply = match self.conn.call(method::TAKE_FRAGMENTS, &most_bytes.to_le_bytes()) {
            Ok(reply) => reply,
            Err(e) => {
                tracing::debug!("taking fragments from the memnode failed: {e}");
                return None;
            }
        };
        let region_len = self.conn.region_len();
        let good = |&(offset, bytes): &(u64, u64)| {
            offset.is_multiple_of(64)
                && bytes.is_multiple_of(64)
                && (64..=crate::layout::MAX_BLOCK_UNITS * 64).contains(&bytes)
                && offset.checked_add(bytes).is_some_and(|end| end <= region_len)
        };
        match rpc::decode_ranges(&reply) {
            Ok((instance, ranges)) if ranges.iter().all(good) => Some(Fragments { instance, ranges }),
            // Nothing from a reply that is wrong anywhere (those bytes stay unused).
            _ => {
                tracing::warn!("the memnode answered TAKE_FRAGMENTS with a bad list ({} bytes)", reply.len());
                None
            }
        }
    }

    fn give_back(&self, instance: u64, ranges: &[(u64, u64)]) {
        for batch in ranges.chunks(rpc::MAX_RANGES_PER_CALL) {
            if let Err(e) = self.conn.call(method::RETURN_RANGES, &rpc::encode_ranges(instance, batch)) {
                tracing::debug!("could not return {} unused ranges to the memnode: {e}", batch.len());
                return;
            }
        }
    }
}

impl Table {
    /// Opens the table of the memnode behind `conn`: its layout by RPC, then its directory.
    pub fn open(conn: Arc<dyn Connection>, options: TableOptions) -> Result<Self, Error> {
        let layout = rpc::metadata(&*conn)?.layout;
        if layout.region_len != conn.region_len() {
            return Err(Error::Corrupt(format!(
                "metadata says {} B, the connection maps {} B",
                layout.region_len,
                conn.region_len()
            )));
        }
        let chunks = Arc::new(RpcChunkSource::new(Arc::clone(&conn)));
        Self::open_with(&*conn, layout, chunks, options)
    }

    /// Opens with a known layout and chunk source (a daemon that prefetches chunks).
    pub fn open_with(
        conn: &dyn Connection,
        layout: Layout,
        chunks: Arc<dyn ChunkSource>,
        options: TableOptions,
    ) -> Result<Self, Error> {
        let directory = DirectoryCache::load(conn, layout)?;
        let published = crate::format::read_grace_period(conn)?;
        let grace = published.map_or(options.grace_period, |p| p.max(options.grace_period));
        if grace > options.grace_period {
            tracing::debug!(?grace, own = ?options.grace_period, "waiting the memnode's longer grace period");
        }
        let stall = StallClock::new(published.unwrap_or(options.grace_period));
        let pool = Arc::new(FreePool::new());
        LazyLock::force(&touch::UPDATES); // exported (as 0) before cache mode records a read
        let tracking = AtomicU64::new(Tracking::Off.encode());
        Ok(Self { shared: Arc::new(Shared { layout, directory, chunks, pool, options, grace, stall, tracking }) })
    }

    /// Sets what this process's reads record in the blocks they read (cache mode's LRU or
    /// LFU policies; [`crate::access`]). Off by default: reads write nothing.
    pub fn set_tracking(&self, tracking: Tracking) {
        self.shared.tracking.store(tracking.encode(), Ordering::Relaxed);
    }

    /// What reads record now.
    pub fn tracking(&self) -> Tracking {
        self.shared.tracking()
    }

    /// The grace period this process waits before reusing a freed block.
    pub fn grace_period(&self) -> Duration {
        self.shared.grace
    }

    /// The region's layout.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// The client's directory cache.
    pub fn directory(&self) -> &DirectoryCache {
        &self.shared.directory
    }

    /// Bytes held by departed clients' free lists.
    pub fn pooled_bytes(&self) -> u64 {
        self.shared.pool.bytes()
    }

    /// Gives what departed clients left free (their free blocks and chunk remainders,
    /// merged into runs) back to the memnode now, for a process that is shutting down and
    /// whose clients are gone; the last handle's drop does the same. Waits out the grace
    /// period of recently freed blocks first (milliseconds).
    pub fn give_back_free_memory(&self) -> crate::alloc::Drained {
        self.shared.give_back_free_memory()
    }

    /// A client doing its operations over `conn` (one per thread; clients are cheap).
    pub fn client(&self, conn: Arc<dyn Connection>) -> TableClient {
        let s = &self.shared;
        TableClient {
            alloc: BlockAllocator::new(Arc::clone(&s.chunks), Arc::clone(&s.pool), s.grace),
            shared: Arc::clone(s),
            conn,
            batch: Batch::new(),
            block: Vec::with_capacity(256),
            value: Vec::new(),
            cands: Vec::with_capacity(MAX_CANDIDATES),
            copies: Vec::with_capacity(4),
            others: Vec::with_capacity(MAX_CANDIDATES),
            round: RoundScratch::default(),
            probe_sent: s.stall.now(),
            tag: first_tag(),
            coin: xxhash_rust::xxh3::xxh3_64(&[first_tag()]) | 1,
            count_delta: 0,
            found_live: false,
            read_large: false,
            retired_indirect: Vec::new(),
            intent: None,
            lock_at: None,
            replaced: 0,
            replaced_checksum: 0,
            last_word: 0,
            placed_at: 0,
            staged_record: None,
            record_run: None,
            stats: ClientStats::default(),
            metrics: LocalMetrics::new(),
        }
    }
}

impl Shared {
    /// What reads record now ([`Table::set_tracking`]).
    fn tracking(&self) -> Tracking {
        Tracking::decode(self.tracking.load(Ordering::Relaxed))
    }

    fn give_back_free_memory(&self) -> crate::alloc::Drained {
        let drained = self.pool.drain_all(self.grace, crate::layout::BLOCK_UNIT_BYTES);
        // Chunk-sized runs first, in calls of their own: a memnode from before fragments
        // were taken back refuses a call with a shorter run in it.
        let (runs, fragments): (Vec<_>, Vec<_>) =
            drained.ranges.iter().partition(|&&(_, bytes)| bytes >= crate::alloc::MIN_CHUNK_BYTES);
        if let Some(instance) = drained.instance {
            for ranges in [runs, fragments] {
                if !ranges.is_empty() {
                    self.chunks.give_back(instance, &ranges);
                }
            }
        }
        if drained.given_bytes + drained.lost_bytes > 0 {
            tracing::debug!(
                given_bytes = drained.given_bytes,
                lost_bytes = drained.lost_bytes,
                "gave free heap space back to the memnode"
            );
        }
        drained
    }
}

impl Drop for Shared {
    /// The last handle on the table is going: hand free space back.
    fn drop(&mut self) {
        self.give_back_free_memory();
    }
}

impl Clone for Table {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

/// Bounds the retries of one operation: spins first, then sleeps, then gives up.
struct Attempts {
    started: Option<Instant>,
    retries: u32,
    timeout: Duration,
}

impl Attempts {
    fn new(timeout: Duration) -> Self {
        Self { started: None, retries: 0, timeout }
    }

    fn retry(&mut self, what: &'static str) -> Result<(), Error> {
        let started = *self.started.get_or_insert_with(Instant::now);
        self.retries += 1;
        if started.elapsed() > self.timeout {
            return Err(Error::Timeout { waited_ms: self.timeout.as_millis() as u64, what });
        }
        match self.retries {
            0..=4 => std::hint::spin_loop(),
            5..=16 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(1 << (n - 16).min(10))),
        }
        Ok(())
    }
}

/// A slot holding a copy of the key.
#[derive(Debug, Clone, Copy)]
struct KeyCopy {
    slot: u64,
    word: u64,
    /// The expiry in its block.
    expires_at_ms: Option<u64>,
    /// The mark of an intent block (a transaction's write, `txn.rs`).
    txn: Option<TxnMark>,
    /// Its block's access word as read (None: an earlier build's block, or not read).
    access: Option<Access>,
    /// Its block's checksum (0: the block was not read, in a lock's fast path).
    checksum: u64,
}

impl KeyCopy {
    /// Whether the item has expired by this host's clock (read only for items that expire).
    fn expired(&self) -> bool {
        self.expires_at_ms.is_some_and(|at| crate::clock::now_unix_ms() > at)
    }

    /// Whether a transaction holds the slot (its word is locked).
    fn locked(&self) -> bool {
        Slot::decode(self.word).is_some_and(|s| s.locked)
    }
}

/// Who is responsible for a put's new block when the operation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    /// No slot ever pointed to it: reusable at once.
    Unpublished,
    /// A slot points to it: it is the key's value now.
    InSlot,
    /// A slot pointed to it and no longer does: readers may still see it (grace period).
    VisibleNotInSlot,
    /// Another client removed our copy and retired the block itself.
    RetiredByOther,
    /// The batch with the CAS that would put it in a slot failed in a way that may have
    /// executed it (a lost answer, a timeout): it may be the key's value now, so it is
    /// neither reused nor retired (leaked, with its extent, until the memnode's next start).
    MaybeInSlot,
}

impl BlockState {
    /// Moves to `to`, as only the write path's steps may: published (or maybe published)
    /// from unpublished or unlinked; unlinked or taken over from in a slot. `MaybeInSlot`
    /// and `RetiredByOther` are final.
    fn advance(&mut self, to: BlockState) {
        use BlockState::*;
        let forward = matches!(
            (*self, to),
            (Unpublished | VisibleNotInSlot, InSlot | MaybeInSlot) | (InSlot, VisibleNotInSlot | RetiredByOther)
        );
        assert!(forward, "a new block's state went from {self:?} to {to:?}");
        *self = to;
    }
}

/// Whether a failed batch may still have been carried out.
fn may_have_executed(e: &Error) -> bool {
    matches!(
        e,
        Error::Transport(TransportError::ConnectionLost { maybe_executed: true, .. } | TransportError::Timeout { .. })
    )
}

/// Where a new client's per-write slot tags start: spread over clients, so two clients
/// writing in lockstep (same keys, same sizes) do not also write the same tags.
fn first_tag() -> u8 {
    static CLIENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CLIENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let seed = n ^ (u64::from(std::process::id()) << 32);
    xxhash_rust::xxh3::xxh3_64(&seed.to_le_bytes()) as u8
}

/// A new block written for a put.
#[derive(Debug, Clone, Copy)]
struct NewBlock {
    block: u64,
    units: u8,
    /// The extent holding the value, for an indirect block.
    extent: Option<Extent>,
    /// The extent holding the key, for a long-key block.
    long_key: Option<LongKey>,
    /// The expiry encoded in it.
    expires_at_ms: Option<u64>,
    word: u64,
}

impl NewBlock {
    /// The extents the block's item occupies (as [`crate::layout::Block::extents`]).
    fn extents(&self) -> impl Iterator<Item = Extent> {
        self.extent.into_iter().chain(self.long_key.map(|long| long.extent))
    }
}

enum Verified {
    Done,
    /// A block changed under the read (it failed its checks, or the read stalled and the
    /// slot has moved on since): look again.
    Torn,
}

/// How much of each candidate block [`TableClient::verify`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// Whole blocks, each checked against its checksum.
    Whole,
    /// Of a direct block longer than its head, the head alone ([`peek_block_head`]): for a
    /// write that replaces the item whatever its value. What the heads say is trusted only
    /// if read within the grace period of the bucket read (the blocks cannot have been
    /// reused yet), and the write's CAS on the slot word checks it again. A block's intent
    /// mark is read only under a locked slot (a committed intent's is of no use to a
    /// write). A 1 KiB item's 17 lines read become 1.
    Heads,
}

/// What [`TableClient::verify`] learned of one candidate block, whole or from its head.
struct Seen {
    /// It holds the key looked for.
    ours: bool,
    /// It can be the block its slot word was written for (else it was reused since).
    fits: bool,
    expires_at_ms: Option<u64>,
    txn: Option<TxnMark>,
    access: Option<Access>,
    checksum: u64,
}

/// [`TableClient::get_round`]'s working space (cleared, not freed, between rounds).
#[derive(Default)]
struct RoundScratch {
    probes: Vec<(KeyHash, Option<ProbeReads>)>,
    /// (key index, slot, slot word) of every candidate block, in read order.
    wanted: Vec<(usize, u64, u64)>,
    reads: Vec<ReadId>,
    /// Index into `wanted` of the copy each key settled on (when it did).
    settled: Vec<usize>,
    foreign: Vec<bool>,
    /// Keys one of whose candidates held another key's block.
    collided: Vec<bool>,
    done: Vec<bool>,
    /// Index into `wanted` of settled copies that had expired (removed after the round).
    expired: Vec<usize>,
    /// (key index, slot word, access word) of each live value the round returned, for
    /// recording the reads (`touch.rs`).
    touched: Vec<(usize, u64, Option<Access>)>,
    /// The earliest expiry among the live values the round returned.
    earliest_expiry_ms: Option<u64>,
}

impl RoundScratch {
    fn clear(&mut self) {
        self.earliest_expiry_ms = None;
        self.probes.clear();
        self.wanted.clear();
        self.reads.clear();
        self.settled.clear();
        self.foreign.clear();
        self.collided.clear();
        self.done.clear();
        self.expired.clear();
        self.touched.clear();
    }
}

/// One worker's handle on a table: not shared between threads, reuses its buffers.
pub struct TableClient {
    // Field order is drop order: the allocator hands its leftovers to the shared pool before
    // the last `Arc<Shared>` (whose drop gives the pool's ranges back) can go.
    alloc: BlockAllocator,
    shared: Arc<Shared>,
    conn: Arc<dyn Connection>,
    batch: Batch,
    block: Vec<u8>,
    /// The current value found by the last verification (for compare-and-swap).
    value: Vec<u8>,
    cands: Vec<(u64, u64)>,
    copies: Vec<KeyCopy>,
    others: Vec<(u64, u64)>,
    /// Working space of [`TableClient::get_round`], kept so rounds allocate nothing.
    round: RoundScratch,
    /// When the last [`TableClient::probe`] was sent: a block read after it is trusted only
    /// within the grace period (`stall.rs`).
    probe_sent: Stamp,
    tag: u8,
    /// Item-count changes not yet added to the superblock (sent with the next batch).
    count_delta: i64,
    /// Whether the last write attempt found the key live (present and not expired); its
    /// value is then in `value` (a large one only if `read_large` was set).
    found_live: bool,
    /// Whether writes read a large current value into `value` (compare-and-swap, and a
    /// put returning the old value); others do not move megabytes they will not use.
    read_large: bool,
    /// Indirect blocks this client retired whose extents are still to be retired
    /// (block, units, server instance): done at the end of the operation.
    retired_indirect: Vec<(u64, u8, u64)>,
    /// While a transaction locks a key (`txn.rs`): the mark its intent block carries. New
    /// blocks are then intents, their words locked.
    intent: Option<TxnMark>,
    /// With `intent`: where the lock's expected word was read as the key's lowest
    /// fingerprint match (`txn::SlotVersion::slot`), so its first try goes straight there
    /// (`txn.rs`, `lock_in_place`). Taken by that try.
    lock_at: Option<u64>,
    /// The word the last write swung away (0: it inserted), for a lock to know what it
    /// replaced; a locking write does not retire it.
    replaced: u64,
    /// For a lock that swung a word away: the checksum in the header of the block it
    /// replaced, read in the CAS's batch after the CAS (so the block the lock holds); 0
    /// otherwise. A transaction compares it with its version (`txn::SlotVersion`).
    replaced_checksum: u64,
    /// The word of the last new block (the one a write's last attempt published).
    last_word: u64,
    /// The slot the last write's CAS put its word in (a hint: splits move slots).
    placed_at: u64,
    /// A transaction record (offset, bytes) to write with the next new block (`txn.rs`).
    staged_record: Option<(u64, Vec<u8>)>,
    /// The last transaction record this client allocated: (offset, memnode run). A lock
    /// naming it is published only in that run (`txn.rs`).
    record_run: Option<(u64, u64)>,
    /// State of the coin LFU's counter increments toss (`touch.rs`).
    coin: u64,
    stats: ClientStats,
    metrics: LocalMetrics,
}

impl TableClient {
    /// Counts of this client's protocol work so far.
    pub fn stats(&self) -> ClientStats {
        self.stats
    }

    /// The region's layout.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// The value of `key`, if present (an expired key is absent: see [`crate::clock`]).
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        let mut out = Vec::new();
        Ok(self.get_into(key, &mut out)?.then_some(out))
    }

    /// Puts the value of `key` into `out` (cleared first); returns whether the key exists.
    /// An expired item found on the way is removed (lazy expiry).
    pub fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, Error> {
        let sample = self.begin();
        let result = self.search_now(key, out, true).map(|found| found.is_some());
        self.end(0, sample, result, |&found| found)
    }

    /// The value and expiry of `key`, if present.
    pub fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, Error> {
        let sample = self.begin();
        let mut value = Vec::new();
        let result = self
            .search_now(key, &mut value, true)
            .map(|found| found.map(|c| Item { value, expires_at_ms: c.expires_at_ms }));
        self.end(0, sample, result, Option::is_some)
    }

    /// Looks up many keys at once: the bucket reads of up to [`KEYS_PER_ROUND`] keys travel
    /// in one batch and their block reads in a second, so a round costs two round trips
    /// whatever its size. Keys that hit a rare case (stale directory, a block changing under
    /// the read, fingerprint collisions) finish on the single-key path.
    pub fn get_many(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, Error> {
        let mut values = vec![None; keys.len()];
        for (round, chunk) in keys.chunks(KEYS_PER_ROUND).enumerate() {
            let base = round * KEYS_PER_ROUND;
            let mut slow = Vec::new();
            self.get_round(chunk, &mut values[base..base + chunk.len()], &mut slow)?;
            let settled = (0..chunk.len()).filter(|i| !slow.contains(i)).map(|i| &values[base + i]);
            self.count_batched_gets(settled);
            for i in slow {
                let mut out = Vec::new();
                values[base + i] = self.get_into(chunk[i], &mut out)?.then_some(out);
            }
        }
        Ok(values)
    }

    /// Looks up `keys` as consecutive [`TableClient::get`]s would, in one or two round trips
    /// per [`KEYS_PER_ROUND`] keys where the transport allows: each key is read after every
    /// key before it (its bucket read is its linearization point, as for `get`), so a reader
    /// that sees one write also sees every write before it. Pipelined Redis GETs rely on
    /// this. Where the batch's reads may observe memory out of order (verbs), each key is
    /// its own lookup. A key that needs the single-key path is looked up on its own, and
    /// every key after it is read again after it.
    pub fn get_many_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, Error> {
        self.read_in_order(keys, &mut None)
    }

    /// Whether [`TableClient::get_many_in_order`] reads many keys per round trip here (not
    /// on verbs, where each key is its own lookup).
    pub fn reads_in_order_together(&self) -> bool {
        self.conn.kind().batch_reads_in_order()
    }

    /// [`TableClient::get_many_in_order`], adding each round's slot words to `witness`
    /// while it is Some (`witness.rs`; None once a round cannot be witnessed).
    fn read_in_order(&mut self, keys: &[&[u8]], witness: &mut Option<Witness>) -> Result<Vec<Option<Vec<u8>>>, Error> {
        if !self.conn.kind().batch_reads_in_order() {
            *witness = None;
            return keys.iter().map(|key| self.get(key)).collect();
        }
        let mut values = vec![None; keys.len()];
        let mut next = 0;
        while next < keys.len() {
            let end = (next + KEYS_PER_ROUND).min(keys.len());
            let mut slow = Vec::new();
            self.get_round(&keys[next..end], &mut values[next..end], &mut slow)?;
            Self::witness_round(witness, &self.round, &values[next..end], &slow);
            let Some(&first) = slow.iter().min() else {
                self.count_batched_gets(values[next..end].iter());
                next = end;
                continue;
            };
            let i = next + first;
            self.count_batched_gets(values[next..i].iter());
            let mut out = Vec::new();
            values[i] = self.get_into(keys[i], &mut out)?.then_some(out);
            values[i + 1..end].iter_mut().for_each(|v| *v = None);
            next = i + 1;
        }
        Ok(values)
    }

    /// One round of [`TableClient::get_many`]; indices needing the single-key path go to `slow`.
    fn get_round(
        &mut self,
        keys: &[&[u8]],
        values: &mut [Option<Vec<u8>>],
        slow: &mut Vec<usize>,
    ) -> Result<(), Error> {
        let mut scratch = std::mem::take(&mut self.round);
        scratch.clear();
        let result = self.get_round_with(&mut scratch, keys, values, slow);
        self.round = scratch;
        result
    }

    fn get_round_with(
        &mut self,
        r: &mut RoundScratch,
        keys: &[&[u8]],
        values: &mut [Option<Vec<u8>>],
        slow: &mut Vec<usize>,
    ) -> Result<(), Error> {
        let groups = self.shared.layout.groups_per_subtable;
        self.batch.clear();
        for key in keys {
            Self::check_key(key)?;
            let hash = self.hash(key);
            let cached = self.shared.directory.lookup(hash.dir);
            let cbs = hash.combined_buckets(cached.entry.subtable, groups);
            let usable = !cached.entry.locked && cached.entry.is_valid(&self.shared.layout);
            let reads = usable.then(|| ProbeReads::queue(&mut self.batch, cbs));
            r.probes.push((hash, reads));
        }
        let sent = self.shared.stall.now();
        if !self.batch.is_empty() {
            self.execute()?;
        }
        for (i, (hash, reads)) in r.probes.iter().enumerate() {
            let Some(reads) = reads else {
                slow.push(i);
                continue;
            };
            let probe = reads.parse(&self.batch)?;
            if !probe.admits(hash.dir) {
                slow.push(i);
                continue;
            }
            probe.candidates(hash.fingerprint, &mut self.cands);
            assert!(self.cands.len() <= MAX_CANDIDATES, "{} candidates in 4 buckets", self.cands.len());
            // The block reads go in one batch: a key whose candidates would overflow it
            // (many fingerprint matches: crafted keys) takes the single-key path.
            if r.wanted.len() + self.cands.len() > racekv_transport::MAX_BATCH_OPS {
                slow.push(i);
                continue;
            }
            r.wanted.extend(self.cands.iter().map(|&(slot, word)| (i, slot, word)));
        }
        if r.wanted.is_empty() {
            return Ok(());
        }
        self.batch.clear();
        for &(_, _, word) in &r.wanted {
            let slot = Slot::decode(word).expect("candidates are used slots");
            r.reads.push(self.batch.read(slot.block, slot.block_bytes() as u32));
        }
        self.execute()?;
        let stalled = !self.shared.stall.surely_within(sent);
        // A key is settled here when exactly one copy was found (other candidates may hold
        // other keys' blocks, as fingerprints collide; the single-key path ignores them too
        // when it finds a copy). Anything more (no copy but another key's block, which needs
        // the absence check; a torn block; duplicate copies) goes the single-key way.
        r.foreign.resize(keys.len(), false);
        r.done.resize(keys.len(), false);
        r.collided.resize(keys.len(), false);
        for (n, &(i, _, word)) in r.wanted.iter().enumerate() {
            match decode_block(self.batch.read_result(r.reads[n])?) {
                None => r.foreign[i] = true,
                // A transaction holds it: the single-key way waits for it.
                Some(_) if Slot::decode(word).is_some_and(|s| s.locked) => r.foreign[i] = true,
                // A large value: read by the single-key way, which fetches its extent.
                Some(block) if block.extent.is_some() => r.foreign[i] = true,
                Some(block) if block.key == keys[i] => {
                    if !r.done[i] {
                        if block.expires_at_ms.is_some_and(|at| crate::clock::now_unix_ms() > at) {
                            r.expired.push(n);
                        } else {
                            values[i] = Some(block.value.to_vec());
                            r.touched.push((i, word, block.access));
                            r.earliest_expiry_ms = r.earliest_expiry_ms.into_iter().chain(block.expires_at_ms).min();
                        }
                        r.done[i] = true;
                        r.settled.push(n);
                    } else {
                        // Duplicate copies: let the single-key path pick the canonical one.
                        r.foreign[i] = true;
                    }
                }
                // Another key's block: it matters only if this key has no copy (the absence
                // check), as on the single-key path.
                Some(block) if Slot::decode(word).is_some_and(|s| s.fits_block(&block)) => r.collided[i] = true,
                // Not the block its slot word was written for: reused since the bucket read
                // (the single-key path reads again).
                Some(_) => r.foreign[i] = true,
            }
        }
        for i in 0..keys.len() {
            r.foreign[i] |= r.collided[i] && !r.done[i];
        }
        if stalled {
            self.recheck_settled(r)?;
        }
        for (i, value) in values.iter_mut().enumerate() {
            if r.foreign[i] && !slow.contains(&i) {
                *value = None;
                slow.push(i);
            }
        }
        // Expired copies the round settled on: removed now, by a CAS from the very word
        // that led to them (lazy expiry; it fails harmlessly if the slot moved on).
        let expired: Vec<(u64, u64)> = r
            .expired
            .iter()
            .map(|&n| r.wanted[n])
            .filter(|&(i, _, _)| !r.foreign[i])
            .map(|(_, slot, word)| (slot, word))
            .collect();
        self.expire_lazily(&expired)?;
        let touched = r.touched.iter().filter(|&&(i, _, _)| !r.foreign[i]).map(|&(_, word, access)| (word, access));
        self.touch(touched, sent);
        Ok(())
    }

    /// Removes expired copies (slot, word) by CAS, counting those that swung.
    fn expire_lazily(&mut self, copies: &[(u64, u64)]) -> Result<(), Error> {
        let removed = self.remove_copies(copies)? as u64;
        self.stats.expired_removed += removed;
        self.metrics.expired.inc_by(removed);
        Ok(())
    }

    /// A round that may have outlasted the grace period trusts a key's block only if its
    /// slot still holds the word that led there (`stall.rs`): one batch reads every settled
    /// key's slot again; a key whose slot moved on goes the single-key way.
    fn recheck_settled(&mut self, r: &mut RoundScratch) -> Result<(), Error> {
        self.count_stall();
        r.settled.retain(|&n| !r.foreign[r.wanted[n].0]);
        if r.settled.is_empty() {
            return Ok(());
        }
        let slots: Vec<u64> = r.settled.iter().map(|&n| r.wanted[n].1).collect();
        let now = self.read_slot_words(&slots)?;
        for (&n, now) in r.settled.iter().zip(now) {
            let (i, _, word) = r.wanted[n];
            if now != word {
                r.foreign[i] = true;
            }
        }
        Ok(())
    }

    fn count_stall(&mut self) {
        self.stats.stalled_reads += 1;
        self.metrics.stalled.inc();
    }

    /// Sets `key` to `value` (insert or replace), with no expiry.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<PutOutcome, Error> {
        self.put_with(key, value, PutMode::Upsert)
    }

    /// Sets `key` to `value` if `mode` allows it, with no expiry.
    pub fn put_with(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<PutOutcome, Error> {
        Ok(self.put_opts(key, value, PutOptions { mode, ..PutOptions::default() })?.outcome)
    }

    /// Sets `key` to `value` as `options` say: if its mode allows (an expired key counts as
    /// absent), with its expiry, returning the value the key had when asked to.
    ///
    /// [`Expiry::Keep`] costs nothing extra for a key without an expiry; for one with an
    /// expiry the first attempt learns it (two round trips) and writes again.
    pub fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, Error> {
        let (kind, cond) = match options.mode {
            PutMode::Upsert => (1, Cond::Any),
            PutMode::InsertOnly => (2, Cond::Absent),
            PutMode::UpdateOnly => (3, Cond::Present),
        };
        let sample = self.begin();
        self.read_large = options.return_old;
        let result = overlap::block_on(self.mutate(key, Some(value), options.expiry, cond)).map(|outcome| PutResult {
            outcome,
            old: (options.return_old && self.found_live).then(|| self.value.clone()),
        });
        self.end(kind, sample, result, |r| r.outcome != PutOutcome::NotApplied)
    }

    /// Removes `key`; returns whether it was there (an expired item is removed too, and
    /// counts as not there).
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, Error> {
        let sample = self.begin();
        let result =
            overlap::block_on(self.mutate(key, None, Expiry::Never, Cond::Any)).map(|o| o != PutOutcome::NotApplied);
        self.end(4, sample, result, |&d| d)
    }

    /// Atomically replaces the value of `key` with `new` (None deletes) if it currently is
    /// `expected` (None: absent or expired). Returns whether it did. The key keeps its
    /// expiry (as Redis' INCR and friends keep a key's TTL; a new key gets none).
    pub fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: Option<&[u8]>) -> Result<bool, Error> {
        let sample = self.begin();
        let result = match new {
            // Absent -> absent: true exactly when the key is absent.
            None if expected.is_none() => self.search_now(key, &mut Vec::new(), false).map(|found| found.is_none()),
            _ => {
                self.read_large = expected.is_some();
                overlap::block_on(self.mutate(key, new, Expiry::Keep, Cond::Equals(expected)))
                    .map(|o| o != PutOutcome::NotApplied)
            }
        };
        self.end(5, sample, result, |&d| d)
    }

    /// Changes the expiry of `key` as `decide` says, given its current one (None: never);
    /// `decide` is not called for an absent or expired key. Returns the item as it was
    /// before (None: absent) and whether `decide` asked for a change (an unchanged time
    /// counts, as Redis' EXPIRE does; nothing is written then).
    ///
    /// A read, then a compare-and-swap of the slot word read: a write in between wins and
    /// this starts over (calling `decide` again). Five round trips, uncontended.
    pub fn update_expiry(
        &mut self,
        key: &[u8],
        mut decide: impl FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Item, bool)>, Error> {
        let sample = self.begin();
        let result = self.update_expiry_loop(key, &mut decide);
        self.end(OP_EXPIRE, sample, result, |r| r.as_ref().is_some_and(|(_, changed)| *changed))
    }

    fn update_expiry_loop(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Item, bool)>, Error> {
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        loop {
            let mut value = Vec::new();
            let Some(copy) = self.search_now(key, &mut value, false)? else { return Ok(None) };
            let item = Item { value, expires_at_ms: copy.expires_at_ms };
            let (new, expiry) = match decide(item.expires_at_ms) {
                ExpiryUpdate::Unchanged => return Ok(Some((item, false))),
                ExpiryUpdate::Set(at) if at == item.expires_at_ms => return Ok(Some((item, true))),
                ExpiryUpdate::Set(at) => (Some(&item.value[..]), Expiry::from_ms(at)),
                ExpiryUpdate::Delete => (None, Expiry::Never),
            };
            if overlap::block_on(self.mutate(key, new, expiry, Cond::Word(copy.word)))? != PutOutcome::NotApplied {
                return Ok(Some((item, true)));
            }
            attempts.retry("the key kept changing under an expiry update")?;
        }
    }

    /// Gets ready ahead of need: fetches a heap chunk now, so the first write makes no
    /// allocation RPC.
    pub fn prepare(&mut self) -> Result<(), Error> {
        self.alloc.reserve()
    }

    /// The memnode's table statistics (an RPC on this client's connection). Sends this
    /// client's pending item-count change first.
    pub fn table_stats(&mut self) -> Result<crate::TableStats, Error> {
        self.flush()?;
        let reply = self.conn.call(method::STATS, &[]).map_err(rpc::map_error)?;
        crate::service::decode_stats(&reply).ok_or_else(|| Error::Remote("unreadable stats".into()))
    }

    /// The newest cluster map epoch the memnode serves by (its `sb::MAP_EPOCH` word; 0
    /// without a map).
    pub fn map_epoch(&mut self) -> Result<u64, Error> {
        crate::format::read_map_epoch(&*self.conn)
    }

    /// Raises the memnode's map epoch word to `epoch` unless it is newer (a mover, before a
    /// map takes a primary role from the memnode); the word's value after.
    pub fn raise_map_epoch(&mut self, epoch: u64) -> Result<u64, Error> {
        crate::format::raise_map_epoch(&*self.conn, epoch)
    }

    /// Sends any pending item-count change now (one FAA; nothing when there is none). It
    /// otherwise rides on the next batch: call this when the client goes idle.
    pub fn publish_count(&mut self) -> Result<(), Error> {
        if self.count_delta != 0 {
            self.batch.clear();
            self.queue_count();
            self.conn.execute(&mut self.batch)?;
        }
        Ok(())
    }

    /// Sends the pending item-count change and publishes this client's metric counts.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.publish_count()?;
        self.metrics.flush();
        Ok(())
    }

    // ---- bookkeeping ----

    fn begin(&mut self) -> Option<Instant> {
        self.stats.ops += 1;
        self.stats.ops.is_multiple_of(SAMPLE_EVERY_OPS).then(Instant::now)
    }

    /// Records the GETs a batched round settled (those it left to the single-key path are
    /// recorded there), as [`Self::end`] records one: batched reads count in the op metrics,
    /// and flush them, like single ones.
    fn count_batched_gets<'v>(&mut self, values: impl Iterator<Item = &'v Option<Vec<u8>>>) {
        for value in values {
            self.metrics.count_op(OP_GET, if value.is_some() { 0 } else { 1 });
            self.stats.ops += 1;
        }
    }

    fn end<T>(
        &mut self,
        op: usize,
        sample: Option<Instant>,
        result: Result<T, Error>,
        applied: impl FnOnce(&T) -> bool,
    ) -> Result<T, Error> {
        self.read_large = false;
        self.retire_extents();
        let outcome = match &result {
            Ok(v) if applied(v) => 0,
            Ok(_) => 1,
            Err(_) => 2,
        };
        if let Some(started) = sample {
            self.metrics.op_seconds[op].observe(started.elapsed().as_secs_f64());
        }
        self.metrics.count_op(op, outcome);
        result
    }

    fn execute(&mut self) -> Result<(), Error> {
        self.count_round_trip();
        self.conn.execute(&mut self.batch)?;
        Ok(())
    }

    /// [`Self::execute`] inside an operation that [`overlap::run_all`] may drive beside
    /// others on other memnodes (the batch is sent, then waited for once they sent theirs).
    async fn execute_overlapped(&mut self) -> Result<(), Error> {
        self.count_round_trip();
        overlap::execute(&*self.conn, &mut self.batch).await?;
        Ok(())
    }

    /// [`Self::execute`] for a batch whose CAS may put the write's new block in a slot
    /// (`publishes`): if it fails in a way that may have executed, the block may be in the
    /// slot, which `state` records.
    async fn execute_publishing(&mut self, publishes: bool, state: &mut BlockState) -> Result<(), Error> {
        let result = self.execute_overlapped().await;
        if let Err(e) = &result {
            if publishes && may_have_executed(e) {
                state.advance(BlockState::MaybeInSlot);
            }
        }
        result
    }

    fn count_round_trip(&mut self) {
        self.stats.round_trips += 1;
        self.metrics.round_trips.inc();
    }

    /// Checks `key` is one the table can hold (not empty, not past [`MAX_KEY_BYTES`]).
    fn check_key(key: &[u8]) -> Result<(), Error> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::TooLarge { key: key.len(), value: 0 });
        }
        Ok(())
    }

    fn hash(&self, key: &[u8]) -> KeyHash {
        KeyHash::of(key, self.shared.layout.groups_per_subtable)
    }

    // ---- directory ----

    /// The cached directory entry for the key, waiting out a split in progress.
    fn entry(&mut self, hash: &KeyHash, attempts: &mut Attempts) -> Result<CachedEntry, Error> {
        loop {
            let cached = self.shared.directory.lookup(hash.dir);
            if !cached.entry.locked && cached.entry.is_valid(&self.shared.layout) {
                return Ok(cached);
            }
            attempts.retry("waiting for a split of the key's subtable")?;
            self.refresh(hash)?;
        }
    }

    fn refresh(&mut self, hash: &KeyHash) -> Result<(), Error> {
        self.stats.round_trips += 1;
        self.shared.directory.refresh(&*self.conn, &mut self.batch, hash.dir)?;
        Ok(())
    }

    fn stale(&mut self, hash: &KeyHash, attempts: &mut Attempts) -> Result<(), Error> {
        self.stats.stale_directory += 1;
        self.metrics.stale.inc();
        attempts.retry("the directory kept changing")?;
        self.refresh(hash)
    }

    // ---- reading ----

    /// READs the key's buckets (no write), again as long as a split in progress or a stale
    /// directory entry asks, and puts its fingerprint matches in `self.cands`. Returns the
    /// subtable read (for [`Self::others_unchanged`]).
    async fn read_candidates(&mut self, hash: &KeyHash, attempts: &mut Attempts) -> Result<u64, Error> {
        loop {
            let entry = self.entry(hash, attempts)?;
            let probe = self.probe(hash, entry.entry.subtable, None).await?;
            if !probe.admits(hash.dir) {
                self.stale(hash, attempts)?;
                continue;
            }
            probe.candidates(hash.fingerprint, &mut self.cands);
            return Ok(entry.entry.subtable);
        }
    }

    /// READs the key's two combined buckets (after `write`, if any: the new block goes out
    /// in the same doorbell). Also carries any pending item-count change.
    async fn probe(&mut self, hash: &KeyHash, subtable: u64, write: Option<&NewBlock>) -> Result<Probe, Error> {
        self.batch.clear();
        if let Some(new) = write {
            self.queue_new_block(new);
        }
        self.queue_count();
        let reads =
            ProbeReads::queue(&mut self.batch, hash.combined_buckets(subtable, self.shared.layout.groups_per_subtable));
        self.probe_sent = self.shared.stall.now();
        self.execute_overlapped().await?;
        Ok(reads.parse(&self.batch)?)
    }

    /// Queues the WRITE of `new` (as `new_block` encoded it), and a transaction's record
    /// staged to go out with its first lock's block (`txn.rs`), before the batch's CAS.
    fn queue_new_block(&mut self, new: &NewBlock) {
        assert_eq!(
            self.block.len() as u64,
            u64::from(new.units) * BLOCK_UNIT_BYTES,
            "writing {} B for a block of {} units at {:#x}",
            self.block.len(),
            new.units,
            new.block
        );
        self.batch.write(new.block, &self.block);
        if let Some((offset, record)) = self.staged_record.take() {
            self.batch.write(offset, &record);
        }
    }

    /// The lowest slot among the last probe's fingerprint matches (`self.cands`), with its
    /// word: the key's canonical copy when it is the key's.
    fn lowest_candidate(&self) -> Option<(u64, u64)> {
        self.cands.iter().min_by_key(|&&(slot, _)| slot).copied()
    }

    /// READs the blocks of `self.cands` (found by the last probe) and sorts them into copies
    /// of `key` (lowest slot first; the first one's value lands in `value_out`) and other
    /// keys. A value is handed out only if it was surely read within the grace period of
    /// the probe, or its slot still holds the word that led to it.
    ///
    /// A large value (in an extent) is read only when `read_large`, else `value_out` is left
    /// empty; one read is checked against its block's checksum of it.
    async fn verify(
        &mut self,
        key: &[u8],
        value_out: Option<&mut Vec<u8>>,
        read_large: bool,
        reading: Reading,
    ) -> Result<Verified, Error> {
        self.copies.clear();
        self.others.clear();
        if self.cands.is_empty() {
            return Ok(Verified::Done);
        }
        assert!(self.cands.len() <= MAX_CANDIDATES, "{} candidates in 4 buckets", self.cands.len());
        assert!(reading == Reading::Whole || value_out.is_none(), "a value from a block's head");
        // A long key is compared in its extent, which only a whole block names.
        let heads_wanted = reading == Reading::Heads && key.len() <= MAX_INLINE_KEY_BYTES;
        self.batch.clear();
        let mut reads: [Option<ReadId>; MAX_CANDIDATES] = [None; MAX_CANDIDATES];
        let mut heads = [false; MAX_CANDIDATES];
        for (i, &(_, word)) in self.cands.iter().enumerate() {
            let slot = Slot::decode(word).expect("candidates are used slots");
            let whole = slot.block_bytes();
            // A locked slot's intent mark says whom a write waits for.
            let head = heads_wanted
                .then(|| block_head_bytes(key.len(), slot.locked).next_multiple_of(BLOCK_UNIT_BYTES))
                .filter(|&head| !slot.indirect && head < whole);
            heads[i] = head.is_some();
            reads[i] = Some(self.batch.read(slot.block, head.unwrap_or(whole) as u32));
        }
        self.execute_overlapped().await?;
        let long_keys_found = self.find_long_keys(key, &reads)?;
        let mut torn = false;
        let mut best: Option<(u64, ReadId)> = None;
        for (i, &(slot, word)) in self.cands.iter().enumerate() {
            let read = reads[i].expect("read issued");
            let slot_word = Slot::decode(word).expect("candidates are used slots");
            let bytes = self.batch.read_result(read)?;
            let seen = match heads[i] {
                true => peek_block_head(bytes).map(|head| Seen {
                    ours: head.key == Some(key),
                    fits: slot_word.fits_head(&head),
                    expires_at_ms: head.expires_at_ms,
                    txn: head.txn,
                    access: head.access,
                    checksum: head.checksum,
                }),
                false => decode_block(bytes).map(|block| Seen {
                    ours: block.key == key || long_keys_found.contains(&i),
                    fits: slot_word.fits_block(&block),
                    expires_at_ms: block.expires_at_ms,
                    txn: block.txn,
                    access: block.access,
                    checksum: block.checksum,
                }),
            };
            match seen {
                None => torn = true,
                Some(seen) if seen.ours => {
                    let Seen { expires_at_ms, txn, access, checksum, .. } = seen;
                    self.copies.push(KeyCopy { slot, word, expires_at_ms, txn, access, checksum });
                    if best.is_none_or(|(s, _)| slot < s) {
                        best = Some((slot, read));
                    }
                }
                // Another key whose fingerprint collides: the slot is its.
                Some(seen) if seen.fits => self.others.push((slot, word)),
                // A block that cannot be the one its slot word was written for: reused
                // since the bucket read. Judging the key absent by it would lean on the slot
                // word alone, which a 6-bit tag guards against ABA only so far.
                Some(_) => torn = true,
            }
        }
        if !torn && heads.contains(&true) && !self.shared.stall.surely_within(self.probe_sent) {
            // Heads carry no checksum: past the grace period one may be a reused block's.
            self.count_stall();
            torn = true;
        }
        if torn {
            self.stats.torn_reads += 1;
            self.metrics.torn.inc();
            return Ok(Verified::Torn);
        }
        self.copies.sort_by_key(|c| c.slot);
        if let (Some(out), Some((_, read))) = (value_out, best) {
            let block = decode_block(self.batch.read_result(read)?).expect("verified above");
            out.clear();
            out.extend_from_slice(block.value);
            if let Some(extent) = block.extent.filter(|_| read_large) {
                if !self.read_extent(&extent, out)? {
                    out.clear();
                    return Ok(Verified::Torn);
                }
            }
            if !self.shared.stall.surely_within(self.probe_sent) {
                self.count_stall();
                let canonical = self.copies[0];
                if !self.still_holds(canonical.slot, canonical.word)? {
                    out.clear();
                    return Ok(Verified::Torn);
                }
            }
        }
        Ok(Verified::Done)
    }

    /// Which of the candidate blocks `reads` read hold `key`, when it is a long key: those
    /// whose length and digest match, confirmed by reading the key. One that turns out to
    /// hold other bytes counts as another key's (the absence check then makes sure its slot
    /// held still, so its key extent was not reused under the read).
    fn find_long_keys(&mut self, key: &[u8], reads: &[Option<ReadId>]) -> Result<Vec<usize>, Error> {
        if key.len() <= MAX_INLINE_KEY_BYTES {
            return Ok(Vec::new());
        }
        let digest = key_digest(key);
        let mut maybe = Vec::new();
        for (i, read) in reads.iter().enumerate().take(self.cands.len()) {
            let read = read.expect("read issued");
            if let Some(long) = decode_block(self.batch.read_result(read)?).and_then(|b| b.long_key) {
                if long.may_be(key, digest) {
                    maybe.push((i, long.extent));
                }
            }
        }
        if maybe.is_empty() {
            return Ok(Vec::new());
        }
        // The candidates' reads stay in the batch for the caller: read the keys in another.
        let candidates = std::mem::take(&mut self.batch);
        let mut found = Vec::new();
        let mut result = Ok(());
        for (i, extent) in maybe {
            match self.extent_holds(&extent, key) {
                Ok(true) => found.push(i),
                Ok(false) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.batch = candidates;
        result.map(|()| found)
    }

    /// Whether `extent` holds exactly `bytes` (read a piece at a time, compared as it comes).
    fn extent_holds(&mut self, extent: &Extent, bytes: &[u8]) -> Result<bool, Error> {
        if extent.value_len != bytes.len() as u64 || !self.inside_heap(extent) {
            return Ok(false);
        }
        let piece = racekv_transport::MAX_OP_BYTES as usize;
        for (i, want) in bytes.chunks(piece).enumerate() {
            self.batch.clear();
            let read = self.batch.read(extent.offset + (i * piece) as u64, want.len() as u32);
            self.execute()?;
            if self.batch.read_result(read)? != want {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether `extent` lies inside the heap (a descriptor from a torn or reused block may
    /// point anywhere).
    fn inside_heap(&self, extent: &Extent) -> bool {
        let layout = &self.shared.layout;
        let end = extent.offset.checked_add(extent.value_len);
        extent.offset >= layout.heap_offset && end.is_some_and(|e| e <= layout.region_len)
    }

    /// Finds `key`: its value goes to `out`, its canonical copy is returned; None when it
    /// is absent or expired (an expired copy is removed on the way: lazy expiry). A read
    /// that `touch`es records itself in the block's access word (`touch.rs`).
    fn search_now(&mut self, key: &[u8], out: &mut Vec<u8>, touch: bool) -> Result<Option<KeyCopy>, Error> {
        overlap::block_on(self.search(key, out, touch))
    }

    /// [`Self::search_now`] as an operation [`overlap::run_all`] can drive.
    async fn search(&mut self, key: &[u8], out: &mut Vec<u8>, touch: bool) -> Result<Option<KeyCopy>, Error> {
        Self::check_key(key)?;
        let hash = self.hash(key);
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        loop {
            let subtable = self.read_candidates(&hash, &mut attempts).await?;
            if self.cands.is_empty() {
                return Ok(None);
            }
            match self.verify(key, Some(out), true, Reading::Whole).await? {
                Verified::Torn => attempts.retry("a block kept changing under a read")?,
                Verified::Done if self.copies.first().is_some_and(KeyCopy::locked) => {
                    out.clear();
                    let canonical = self.copies[0];
                    self.wait_for_lock(key, &canonical, &mut attempts)?;
                }
                Verified::Done if !self.copies.is_empty() => {
                    let canonical = self.copies[0];
                    if !canonical.expired() {
                        if touch {
                            self.touch([(canonical.word, canonical.access)], self.probe_sent);
                        }
                        return Ok(Some(canonical));
                    }
                    out.clear();
                    self.expire_lazily(&[(canonical.slot, canonical.word)])?;
                    return Ok(None);
                }
                Verified::Done => {
                    if self.others_unchanged(&hash, subtable)? {
                        return Ok(None);
                    }
                    attempts.retry("the key's buckets kept changing")?;
                }
            }
        }
    }

    /// After fingerprint matches turned out to hold other keys, a key is absent only if
    /// those slots still hold the same words: a block freed and reused under the read can
    /// hold any key (the grace period makes that rare, this makes it harmless). One extra
    /// round trip, and only when fingerprints collided.
    fn others_unchanged(&mut self, hash: &KeyHash, subtable: u64) -> Result<bool, Error> {
        if self.others.is_empty() {
            return Ok(true);
        }
        self.stats.absence_checks += 1;
        let probe = overlap::block_on(self.probe(hash, subtable, None))?;
        let unchanged =
            probe.admits(hash.dir) && self.others.iter().all(|&(slot, word)| probe.word_at(slot) == Some(word));
        Ok(unchanged)
    }

    // ---- writing ----

    fn next_word(&mut self, hash: &KeyHash, block: u64, units: u8, indirect: bool) -> u64 {
        self.tag = self.tag.wrapping_add(1);
        let locked = self.intent.is_some();
        let word = Slot { fingerprint: hash.fingerprint, units, tag: self.tag, block, indirect, locked }.encode();
        self.last_word = word;
        // The word a reader will follow names the block we wrote; and (debug only: it
        // checksums the block again) readers (`verify`, splits, scans) accept the block as
        // the one the word was written for.
        let slot = Slot::decode(word).expect("an encoded slot is used");
        assert!(
            slot.block == block && slot.units == units && slot.indirect == indirect && word != 0,
            "slot word {word:#x} does not name block {block:#x} ({units} units)"
        );
        debug_assert!(
            decode_block(&self.block).is_some_and(|b| slot.fits_block(&b)),
            "the block encoded for word {word:#x} does not fit it"
        );
        word
    }

    /// Adds the pending item-count change to the batch being built (one FAA; nothing when
    /// there is none).
    fn queue_count(&mut self) {
        if self.count_delta != 0 {
            self.batch.faa(sb::ITEM_COUNT, self.count_delta as u64);
            self.count_delta = 0;
        }
    }

    /// Whether `slot` holds `word` now (one 8-byte READ): a slot word does not come back once
    /// replaced (its block is retired with it and reused only after the grace period, as
    /// for CAS), so "still there" means "there all along".
    fn still_holds(&mut self, slot: u64, word: u64) -> Result<bool, Error> {
        Ok(self.read_slot_words(&[slot])?[0] == word)
    }

    /// The words `slots` hold now, in one batch (one round trip).
    fn read_slot_words(&mut self, slots: &[u64]) -> Result<Vec<u64>, Error> {
        self.count_round_trip();
        crate::words::read_words(&*self.conn, &mut self.batch, slots)
    }

    /// CASes each (slot, word) to 0 in one batch; retires the blocks of those that swung.
    /// Returns how many did.
    fn remove_copies(&mut self, copies: &[(u64, u64)]) -> Result<usize, Error> {
        if copies.is_empty() {
            return Ok(0);
        }
        self.batch.clear();
        // Words from this client's own filters (candidates, used slots): a CAS expects a used slot.
        debug_assert!(copies.iter().all(|&(_, word)| Slot::decode(word).is_some()), "removing an empty slot word");
        let ids: Vec<_> = copies.iter().map(|&(slot, word)| self.batch.cas(slot, word, 0)).collect();
        self.execute()?;
        let mut removed = 0;
        for (i, &(_, word)) in copies.iter().enumerate() {
            if self.batch.cas_succeeded(ids[i])? {
                self.retire_word(word);
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Retires the block of `word`, which a CAS of this client just swung away (the callers
    /// retire only after `cas_succeeded`); the allocator asserts a block is retired once.
    fn retire_word(&mut self, word: u64) {
        let slot = Slot::decode(word).expect("a used slot");
        self.retire_slot(&slot, self.batch.executed_instance());
        self.count_delta -= 1;
    }

    /// Retires the block `slot` pointed to (swung away by this client), and notes its
    /// extent, if any, for [`Self::retire_extents`].
    fn retire_slot(&mut self, slot: &Slot, instance: u64) {
        self.alloc.retire(slot.block, slot.units, instance);
        if slot.indirect {
            self.retired_indirect.push((slot.block, slot.units, instance));
        }
    }

    /// Retires the extents of the indirect blocks this operation swung away: each block
    /// is in this client's grace queue, so it still says where its extent is. A failure
    /// leaves the extent to the memnode's next start (logged and counted).
    fn retire_extents(&mut self) {
        while let Some((block, units, instance)) = self.retired_indirect.pop() {
            let extents = self.read_descriptor(block, units, instance);
            let result = extents.and_then(|extents| extents.iter().try_for_each(|e| self.retire_extent(e, instance)));
            if let Err(e) = result {
                EXTENTS_LEAKED.inc();
                tracing::warn!("an extent could not be retired (the memnode's next start reclaims it): {e}");
            }
        }
    }

    /// The extents an indirect block of ours (retired, in grace) describes.
    fn read_descriptor(&mut self, block: u64, units: u8, instance: u64) -> Result<Vec<Extent>, Error> {
        self.batch.clear();
        self.batch.require_instance(Some(instance));
        let read = self.batch.read(block, u32::from(units) * crate::layout::BLOCK_UNIT_BYTES as u32);
        let executed = self.execute();
        self.batch.require_instance(None);
        executed?;
        decode_block(self.batch.read_result(read)?)
            .filter(|b| b.extent.is_some())
            .map(|b| b.extents().collect())
            .ok_or_else(|| Error::Corrupt(format!("the retired indirect block at {block} does not decode")))
    }

    fn retire_extent(&mut self, extent: &Extent, instance: u64) -> Result<(), Error> {
        let request = rpc::encode_words(&[instance, extent.offset, extent.value_len]);
        self.conn.call(method::RETIRE_EXTENT, &request).map_err(rpc::map_error)?;
        Ok(())
    }

    /// Allocates an extent for `value` in server instance `run` and writes the value there
    /// (not yet visible: no block points to it).
    fn write_extent(&mut self, value: &[u8], run: u64) -> Result<Extent, Error> {
        let reply =
            self.conn.call(method::ALLOC_EXTENT, &rpc::encode_words(&[value.len() as u64])).map_err(rpc::map_error)?;
        let [instance, offset] = rpc::decode_words::<2>(&reply).map_err(|e| Error::Remote(e.to_string()))?;
        let extent = Extent::of(offset, value);
        if instance != run {
            // The memnode restarted since our block's run: start over in the new one.
            let _ = self.retire_extent(&extent, instance);
            return Err(Error::Transport(TransportError::InstanceChanged { expected: run, found: instance }));
        }
        let layout = &self.shared.layout;
        let inside =
            offset >= layout.heap_offset && offset.checked_add(extent.bytes()).is_some_and(|e| e <= layout.region_len);
        if !inside || !offset.is_multiple_of(crate::layout::BLOCK_UNIT_BYTES) {
            return Err(Error::Remote(format!("the memnode handed out an extent at {offset} outside its heap")));
        }
        let written = self.write_pieces(offset, value, run);
        if let Err(e) = written {
            let _ = self.retire_extent(&extent, run);
            return Err(e);
        }
        Ok(extent)
    }

    fn write_pieces(&mut self, offset: u64, value: &[u8], run: u64) -> Result<(), Error> {
        let piece = racekv_transport::MAX_OP_BYTES as usize;
        let result = value.chunks(piece).enumerate().try_for_each(|(i, bytes)| {
            self.batch.clear();
            self.batch.require_instance(Some(run));
            self.batch.write(offset + (i * piece) as u64, bytes);
            self.execute()
        });
        self.batch.require_instance(None);
        result
    }

    /// Reads the value `extent` holds into `out` (appended); whether it matches the
    /// checksum its block keeps (a mismatch: the extent was freed and reused under us).
    pub(super) fn read_extent(&mut self, extent: &Extent, out: &mut Vec<u8>) -> Result<bool, Error> {
        if !self.inside_heap(extent) {
            return Ok(false);
        }
        let start = out.len();
        let round_trips = crate::words::read_bytes(&*self.conn, &mut self.batch, extent.offset, extent.value_len, out)?;
        for _ in 0..round_trips {
            self.count_round_trip();
        }
        Ok(value_checksum(&out[start..]) == extent.checksum)
    }

    async fn mutate(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        expiry: Expiry,
        cond: Cond<'_>,
    ) -> Result<PutOutcome, Error> {
        let mut restarts = 0;
        // The expiry the block is encoded with; for `Keep`, first a guess (most keys have
        // none), corrected once the key's own is known.
        let mut expires_at_ms = match expiry {
            Expiry::At(at) => Some(at),
            Expiry::Never | Expiry::Keep => None,
        };
        let keep = matches!(expiry, Expiry::Keep) && value.is_some();
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        self.found_live = false;
        self.replaced = 0;
        self.replaced_checksum = 0;
        loop {
            let (e, state) = match self.mutate_once(key, value, expires_at_ms, keep, cond).await {
                Ok(Step::Done(outcome)) => return Ok(outcome),
                Ok(Step::Reencode(at)) => {
                    expires_at_ms = at;
                    attempts.retry("the key's expiry kept changing under a write keeping it")?;
                    continue;
                }
                Ok(Step::FreshBlock) => {
                    attempts.retry("locks in place kept going back")?;
                    continue;
                }
                Err(failed) => failed,
            };
            let Error::Transport(TransportError::InstanceChanged { expected, .. }) = e else { return Err(e) };
            self.alloc.forget(expected);
            // The memnode restarted under the write. Before its block was in a slot nothing
            // of it is visible, so it starts over in space from the new run; but a lock
            // naming this memnode's record does not (the record may not have survived the
            // restart's reclaim): its transaction aborts.
            if !matches!(state, BlockState::Unpublished)
                || restarts == MAX_RESTARTED_ATTEMPTS
                || self.locks_local_record()
            {
                return Err(e);
            }
            restarts += 1;
        }
    }

    /// The block a write of `value` expiring at `expires_at_ms` goes into (None for a
    /// delete), after checking sizes.
    fn new_block(
        &mut self,
        hash: &KeyHash,
        key: &[u8],
        value: Option<&[u8]>,
        expires_at_ms: Option<u64>,
    ) -> Result<Option<NewBlock>, Error> {
        Self::check_key(key)?;
        let Some(value) = value else {
            return Ok(None);
        };
        let expires = expires_at_ms.is_some();
        let intent = self.intent;
        let mark_bytes = if intent.is_some() { TXN_MARK_BYTES } else { 0 };
        if let Some(units) = block_units_for(key.len(), value.len() + mark_bytes, expires) {
            let block = self.alloc.alloc(units)?;
            self.check_record_run(block, units)?;
            let access = Access::fresh(racekv_telemetry::clock::now_unix_ms_coarse());
            let encoded =
                encode_any_block(&mut self.block, key, value, None, None, expires_at_ms, intent.as_ref(), access);
            assert_eq!(encoded, units, "a block sized {units} units encoded to {encoded}");
            let word = self.next_word(hash, block, units, false);
            return Ok(Some(NewBlock { block, units, extent: None, long_key: None, expires_at_ms, word }));
        }
        if value.len() as u64 > MAX_VALUE_BYTES {
            return Err(Error::TooLarge { key: key.len(), value: value.len() });
        }
        // Too large for a block: the value in an extent, and a long key in another.
        let long = key.len() > MAX_INLINE_KEY_BYTES;
        let inline_key_len = if long { LONG_KEY_DESCRIPTOR_BYTES } else { key.len() };
        let units = block_units_for(inline_key_len, EXTENT_DESCRIPTOR_BYTES + mark_bytes, expires)
            .expect("descriptors fit a block");
        let block = self.alloc.alloc(units)?;
        self.check_record_run(block, units)?;
        let run = self.alloc.instance().expect("an allocated block belongs to a run");
        let (extent, long_key) = match self.write_extents(key, value, long, run) {
            Ok(extents) => extents,
            Err(e) => {
                self.alloc.release_unpublished(block, units, run);
                return Err(e);
            }
        };
        let encoded = encode_any_block(
            &mut self.block,
            key,
            &[],
            Some(&extent),
            long_key.as_ref(),
            expires_at_ms,
            intent.as_ref(),
            Access::fresh(racekv_telemetry::clock::now_unix_ms_coarse()),
        );
        assert_eq!(encoded, units, "an indirect block sized {units} units encoded to {encoded}");
        let word = self.next_word(hash, block, units, true);
        Ok(Some(NewBlock { block, units, extent: Some(extent), long_key, expires_at_ms, word }))
    }

    /// Writes `value`, and `key` when `long`, each in an extent of server instance `run`.
    fn write_extents(
        &mut self,
        key: &[u8],
        value: &[u8],
        long: bool,
        run: u64,
    ) -> Result<(Extent, Option<LongKey>), Error> {
        let long_key = match long {
            true => Some(LongKey { extent: self.write_extent(key, run)?, digest: key_digest(key) }),
            false => None,
        };
        match self.write_extent(value, run) {
            Ok(extent) => Ok((extent, long_key)),
            Err(e) => {
                if let Some(long_key) = long_key {
                    let _ = self.retire_extent(&long_key.extent, run);
                }
                Err(e)
            }
        }
    }

    /// One attempt of [`Self::mutate`]; an error comes with how far the new block got.
    async fn mutate_once(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        expires_at_ms: Option<u64>,
        keep: bool,
        cond: Cond<'_>,
    ) -> Result<Step, (Error, BlockState)> {
        let hash = self.hash(key);
        let new = self.new_block(&hash, key, value, expires_at_ms).map_err(|e| (e, BlockState::Unpublished))?;
        // The block is space of the run that handed it out: write it, and put it in a
        // slot, only there (see `alloc::Chunk`).
        let run = new.map(|_| self.alloc.instance().expect("an allocated block belongs to a run"));
        assert_eq!(new.is_some(), value.is_some(), "a new block exactly for a write with a value");
        self.batch.require_instance(run);
        let mut state = BlockState::Unpublished;
        let result = self.mutate_loop(key, &hash, new.as_ref(), keep, cond, &mut state).await;
        self.batch.require_instance(None);
        if let (Some(new), Some(run)) = (new, run) {
            match state {
                BlockState::Unpublished => self.alloc.release_unpublished(new.block, new.units, run),
                BlockState::VisibleNotInSlot => self.alloc.retire(new.block, new.units, run),
                BlockState::InSlot | BlockState::RetiredByOther => {}
                BlockState::MaybeInSlot => EXTENTS_LEAKED.inc_by(new.extents().count() as u64),
            }
            // Our extents go with our block (the memnode waits out the grace period).
            if matches!(state, BlockState::Unpublished | BlockState::VisibleNotInSlot) {
                for extent in new.extents() {
                    if let Err(e) = self.retire_extent(&extent, run) {
                        EXTENTS_LEAKED.inc();
                        tracing::warn!(
                            "an unused extent could not be retired (the memnode's next start reclaims it): {e}"
                        );
                    }
                }
            }
        }
        result.map_err(|e| (e, state))
    }

    /// Runs a write until it applies or its condition fails. `keep`: the block must carry
    /// the key's current expiry (none for an absent or expired key); one that does not
    /// comes back as [`Step::Reencode`] before anything is swung.
    async fn mutate_loop(
        &mut self,
        key: &[u8],
        hash: &KeyHash,
        new: Option<&NewBlock>,
        keep: bool,
        cond: Cond<'_>,
        state: &mut BlockState,
    ) -> Result<Step, Error> {
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        let mut written = false;
        // A plain upsert needs of the key's current block only what its head says.
        let replaces_whatever = matches!(cond, Cond::Any) && !keep && !self.read_large && self.intent.is_none();
        let mut reading = if new.is_some() && replaces_whatever { Reading::Heads } else { Reading::Whole };
        if let (Some(at), Some(new), Cond::Word(expected)) = (self.lock_at.take(), new, cond) {
            // A lock from a version read at `at`: one batch, no probe first.
            written = true;
            if let Some(step) = self.lock_in_place(key, hash, at, expected, new, state, &mut attempts).await? {
                return Ok(step);
            }
        }
        loop {
            let entry = self.entry(hash, &mut attempts)?;
            let probe = self.probe(hash, entry.entry.subtable, new.filter(|_| !written)).await?;
            written = true;
            if !probe.admits(hash.dir) {
                self.stale(hash, &mut attempts)?;
                continue;
            }
            probe.candidates(hash.fingerprint, &mut self.cands);
            if let Some(copy) = self.expected_copy_in_place(cond) {
                // A lock from a version just read: the word names one block, and it still
                // stands at the lowest slot with the key's fingerprint, so no other copy can
                // precede it. Its block needs no second read.
                self.copies.clear();
                self.copies.push(copy);
                match self.replace(new, state).await? {
                    Some(outcome) => {
                        state.advance(BlockState::InSlot);
                        return Ok(Step::Done(outcome));
                    }
                    None => {
                        attempts.retry("the key kept changing under an update")?;
                        continue;
                    }
                }
            }
            let verified = match reading {
                Reading::Heads => {
                    self.value.clear();
                    self.verify(key, None, false, Reading::Heads).await
                }
                Reading::Whole => {
                    let mut current = std::mem::take(&mut self.value);
                    let verified = self.verify(key, Some(&mut current), self.read_large, Reading::Whole).await;
                    self.value = current;
                    verified
                }
            };
            if let Verified::Torn = verified? {
                // Whole blocks from now on: their checksums tell a torn read from a stall.
                reading = Reading::Whole;
                attempts.retry("a block kept changing under a read")?;
                continue;
            }
            if let Some(&held) = self.copies.first().filter(|c| c.locked()) {
                // Another transaction holds the key: a lock fails at once (no waiting, no
                // deadlock); any other write waits for the holder to finish.
                if self.intent.is_some() {
                    return Ok(Step::Done(PutOutcome::NotApplied));
                }
                self.wait_for_lock(key, &held, &mut attempts)?;
                continue;
            }
            let exists = !self.copies.is_empty();
            // An upsert that misjudges absence is settled by duplicate resolution after its
            // CAS; everything else acting on "absent" must be sure of it.
            let absence_matters = new.is_none() || !matches!(cond, Cond::Any);
            if !exists && absence_matters && !self.others_unchanged(hash, entry.entry.subtable)? {
                attempts.retry("the key's buckets kept changing")?;
                continue;
            }
            // An expired key is absent to every condition; its slot is still the one a write
            // swings (an insert beside it would leave two copies).
            let live = exists && !self.copies[0].expired();
            self.found_live = live;
            let allowed = match cond {
                Cond::Any => true,
                Cond::Absent => !live,
                Cond::Present => live,
                Cond::Equals(None) => !live,
                Cond::Equals(Some(expected)) => live && self.value == expected,
                Cond::Word(word) => exists && self.copies[0].word == word,
            };
            if !allowed {
                return Ok(Step::Done(PutOutcome::NotApplied));
            }
            if let Some(new) = new.filter(|_| keep) {
                let current = if live { self.copies[0].expires_at_ms } else { None };
                if current != new.expires_at_ms {
                    return Ok(Step::Reencode(current));
                }
            }
            if exists {
                match self.replace(new, state).await? {
                    Some(outcome) => {
                        if new.is_some() {
                            state.advance(BlockState::InSlot);
                        }
                        if live {
                            return Ok(Step::Done(outcome));
                        }
                        // It replaced (or removed) an expired item: the key was absent.
                        self.stats.expired_removed += 1;
                        self.metrics.expired.inc();
                        let outcome = if new.is_some() { PutOutcome::Inserted } else { PutOutcome::NotApplied };
                        return Ok(Step::Done(outcome));
                    }
                    None => {
                        attempts.retry("the key kept changing under an update")?;
                        continue;
                    }
                }
            }
            let Some(new) = new else {
                return Ok(Step::Done(PutOutcome::NotApplied)); // deleting an absent key
            };
            let Some(free) = probe.free_slot() else {
                self.request_split(hash, &entry)?;
                attempts.retry("the table kept filling up")?;
                continue;
            };
            match self.insert_at(key, hash, free, new, cond, &entry, state).await? {
                Some(outcome) => return Ok(Step::Done(outcome)),
                None => attempts.retry("inserts kept racing")?,
            }
        }
    }

    /// For a transaction's lock (only: its intent replaces whatever the version was), the
    /// key's copy when the probe shows the expected word at the lowest candidate slot.
    fn expected_copy_in_place(&self, cond: Cond<'_>) -> Option<KeyCopy> {
        let Cond::Word(expected) = cond else { return None };
        self.intent?;
        let (slot, word) = self.lowest_candidate()?;
        (word == expected).then_some(KeyCopy { slot, word, expires_at_ms: None, txn: None, access: None, checksum: 0 })
    }

    /// Swings the canonical copy to `new` (or to 0 to delete) and removes any duplicates, in
    /// one batch. None when the canonical CAS lost a race.
    async fn replace(&mut self, new: Option<&NewBlock>, state: &mut BlockState) -> Result<Option<PutOutcome>, Error> {
        let canonical = self.copies[0];
        // Copies come from `candidates` (used slots only), lowest slot first.
        debug_assert!(self.copies.windows(2).all(|w| w[0].slot < w[1].slot), "copies out of slot order");
        assert!(Slot::decode(canonical.word).is_some(), "a CAS expecting empty slot word {:#x}", canonical.word);
        if self.copies.len() > 1 && !self.still_holds(canonical.slot, canonical.word)? {
            // The copies came from one bucket read, which is not a snapshot: the canonical
            // copy may be long gone and a "duplicate" a later insert. Look again.
            return Ok(None);
        }
        self.batch.clear();
        // A delete is counted in the batch of its CAS (see `insert_at`).
        if new.is_none() {
            self.count_delta -= 1;
        }
        self.queue_count();
        // Duplicates go first: they are shadows only while the canonical copy stands, and a
        // reader between the two must not see one surface.
        let dups: Vec<_> = self.copies[1..].iter().map(|c| (self.batch.cas(c.slot, c.word, 0), c.word)).collect();
        let swing = self.batch.cas(canonical.slot, canonical.word, new.map_or(0, |n| n.word));
        let old = Slot::decode(canonical.word).expect("a used slot");
        // A lock's CAS keeps the block it replaced from reuse: its header, read after the
        // CAS, says which write the lock replaced.
        let replaced_header = self.intent.is_some().then(|| self.batch.read(old.block, BLOCK_UNIT_BYTES as u32));
        self.execute_publishing(new.is_some(), state).await?;
        for (id, word) in dups {
            if self.batch.cas_succeeded(id)? {
                self.retire_word(word);
            }
        }
        if !self.batch.cas_succeeded(swing)? {
            if new.is_none() {
                self.count_delta += 1;
            }
            self.stats.cas_failures += 1;
            self.metrics.cas_failures.inc();
            return Ok(None);
        }
        self.replaced = canonical.word;
        self.placed_at = canonical.slot;
        // A lock keeps the block it replaced: an abort puts it back (`txn.rs`).
        match replaced_header {
            Some(id) => {
                let header = self.batch.read_result(id)?;
                self.replaced_checksum = stored_block_checksum(header).expect("a block unit holds a header");
            }
            None => self.retire_slot(&old, self.batch.executed_instance()),
        }
        Ok(Some(PutOutcome::Updated))
    }

    /// CASes `new` into the empty slot `free`, then settles split races and duplicates.
    /// None when the CAS lost, or the insert had to be undone: retry.
    #[allow(clippy::too_many_arguments)]
    async fn insert_at(
        &mut self,
        key: &[u8],
        hash: &KeyHash,
        free: u64,
        new: &NewBlock,
        cond: Cond<'_>,
        entry: &CachedEntry,
        state: &mut BlockState,
    ) -> Result<Option<PutOutcome>, Error> {
        let cbs = hash.combined_buckets(entry.entry.subtable, self.shared.layout.groups_per_subtable);
        self.batch.clear();
        // Counted in the same batch as the CAS, so the count includes the key once the insert
        // is acknowledged (a lost CAS takes it back with the next batch).
        self.count_delta += 1;
        self.queue_count();
        assert!(
            new.word != 0 && Slot::decode(new.word).is_some_and(|s| s.block == new.block),
            "new word {:#x}",
            new.word
        );
        let cas = self.batch.cas(free, 0, new.word);
        let reads = ProbeReads::queue(&mut self.batch, cbs);
        self.execute_publishing(true, state).await?;
        if !self.batch.cas_succeeded(cas)? {
            self.count_delta -= 1;
            self.stats.cas_failures += 1;
            self.metrics.cas_failures.inc();
            return Ok(None);
        }
        state.advance(BlockState::InSlot);
        self.placed_at = free;
        let after = reads.parse(&self.batch)?;
        if !after.admits_slot(free, hash.dir) {
            // A split re-assigned the bucket; the key belongs elsewhere now.
            self.batch.clear();
            let undo = self.batch.cas(free, new.word, 0);
            self.execute()?;
            if self.batch.cas_succeeded(undo)? {
                state.advance(BlockState::VisibleNotInSlot);
                self.count_delta -= 1;
                self.refresh(hash)?;
                return Ok(None);
            }
            return Ok(Some(PutOutcome::Inserted)); // the splitter moved it for us
        }
        if after.word_at(free) != Some(new.word) {
            // Others already updated or deleted our copy (this thread stalled between its CAS
            // and the re-read): the insert took effect and was superseded. Copies found now
            // are newer than ours, not duplicates to remove.
            return Ok(Some(PutOutcome::Inserted));
        }
        // Copies inserted concurrently by others: fingerprint matches we have not already
        // identified as other keys.
        let known = std::mem::take(&mut self.others);
        after.candidates(hash.fingerprint, &mut self.cands);
        self.cands.retain(|&(slot, word)| slot != free && !known.contains(&(slot, word)));
        assert!(self.cands.len() < MAX_CANDIDATES, "{} other candidates beside ours", self.cands.len());
        self.others = known;
        if self.cands.is_empty() {
            return Ok(Some(PutOutcome::Inserted));
        }
        if let Verified::Torn = self.verify(key, None, false, Reading::Whole).await? {
            // A candidate changed under us: whatever copies exist, readers and later
            // writers settle on the lowest address, so the insert stands.
            return Ok(Some(PutOutcome::Inserted));
        }
        if self.copies.iter().all(|c| c.slot > free) {
            // Ours is the lowest address: it wins; remove the others. But the re-read is not
            // a snapshot: a bucket is copied word by word, lowest address first, so a thread
            // preempted inside that copy can see our word (read early) beside a copy written
            // much later, after ours was deleted. Look at our slot again, after the others
            // were seen: our word cannot come back once gone, so if it is still there it
            // stood all along and the others are shadows of it.
            if !self.still_holds(free, new.word)? {
                return Ok(Some(PutOutcome::Inserted)); // superseded (as above)
            }
            let losers: Vec<_> = self.copies.iter().map(|c| (c.slot, c.word)).collect();
            self.remove_copies(&losers)?;
            return Ok(Some(PutOutcome::Inserted));
        }
        // Another copy wins: remove ours, unless its owner already did (and retired it).
        self.batch.clear();
        let undo = self.batch.cas(free, new.word, 0);
        self.execute()?;
        if self.batch.cas_succeeded(undo)? {
            self.count_delta -= 1;
            state.advance(BlockState::VisibleNotInSlot);
        } else {
            state.advance(BlockState::RetiredByOther);
        }
        Ok(Some(match cond {
            Cond::Absent | Cond::Equals(None) => PutOutcome::NotApplied,
            _ => PutOutcome::Updated,
        }))
    }

    fn request_split(&mut self, hash: &KeyHash, entry: &CachedEntry) -> Result<(), Error> {
        self.stats.split_requests += 1;
        self.metrics.splits.inc();
        let req = SplitRequest {
            dir_hash: hash.dir,
            observed_depth: entry.entry.local_depth,
            observed_subtable: entry.entry.subtable,
        };
        self.conn.call(method::SPLIT, &req.encode()).map_err(rpc::map_error)?;
        self.refresh(hash)
    }
}

impl Drop for TableClient {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("could not send a pending item-count change of {}: {e}", self.count_delta);
        }
    }
}
