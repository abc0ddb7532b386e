//! Active expiry: the memnode finds expired items nobody reads and gives their memory back.
//!
//! Readers never return an expired item and remove the ones they meet (lazy expiry,
//! `table.rs`), but a key written with a TTL and never read again would hold its block
//! forever. So the memnode sweeps the table in the background, as Redis' active expiry
//! sweeps its expires dictionary with a cursor: each round ([`ActiveExpiry::sample_round`])
//! takes the next run of [`BUCKETS_PER_ROUND`] buckets (one READ; directory entries are
//! read 64 at a time to find the next subtable), then the first 24 bytes of the blocks of
//! their used slots (sizes and expiry; one batch), and CASes the slots of expired items from
//! the word it read to 0 (one batch). A cycle ([`ActiveExpiry::cycle`], ten a second while
//! items with an expiry are around; [`ActiveExpiry::run_due`] keeps them that far apart)
//! runs [`MIN_ROUNDS_PER_CYCLE`] rounds, and more while more than [`STALE_PERCENT`] of the
//! items with an expiry in the last round had expired, until its time budget (a share of
//! one core) is spent: a table full of expired items is swept fast, one with few costs a
//! few rounds a cycle. A sweep, not random samples, so an item the sweep passes is found
//! within one pass, however sparse the table. A cycle that finds no item with an expiry
//! at all doubles the wait before the next, up to a second (an idle memnode does not wake
//! ten times a second for nothing).
//!
//! Safety is the clients' own: the CAS succeeds only if the slot still holds the very word
//! whose block was judged expired (a later write, a split's move, a client's lazy removal
//! all change it), and whoever swings a word away frees its block, so each block is freed
//! once. That CAS is also why reading a block's header without its checksum is enough:
//! while the slot holds the word, the block it points to is complete and immutable, so the
//! header read was that block's; a header read from a block reused meanwhile belongs to a
//! slot that moved on, and the CAS fails. The block goes back to the heap (`heap.rs`:
//! merged with free runs beside it, used again by clients as free blocks or, grown to a
//! chunk, as a chunk) only after the grace period, as a client's freed block would: a
//! reader may still be reading it. The work goes through the memnode's loopback
//! connection, so its CAS is atomic against clients' NIC atomics.
//!
//! An item is removed only once its expiry is [`crate::clock::MAX_CLOCK_SKEW_MS`] past by
//! the memnode's clock: clients judge expiry by their own clocks, and one a little behind
//! the memnode's must not find a live key gone.

use std::collections::VecDeque;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge};
use racekv_transport::{Batch, Connection};

use crate::clock::{now_unix_ms, MAX_CLOCK_SKEW_MS};
use crate::error::Error;
use crate::extents::Extents;
use crate::heap::Heap;
use crate::layout::{
    decode_block, parse_bucket, peek_block_header, sb, slot_offset, DirEntry, Layout, Slot, BLOCK_PEEK_BYTES,
    BUCKET_BYTES,
};
use crate::words::read_word;

/// Expired items removed, by how they were found: `lazy` (a client met one while reading or
/// writing its key) or `active` (the memnode's sampling).
pub(crate) static EXPIRED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_table_expired_total",
        "Expired items removed, by how they were found (lazy or active)",
        &["how"],
        &[],
    )
});

struct Metrics {
    active: IntCounter,
    cycles: IntCounter,
    passes: IntCounter,
    rounds: IntCounter,
    sampled_slots: IntCounter,
    freed_bytes: IntCounter,
    pending_bytes: IntGauge,
    stale_ratio: Gauge,
    cycle_seconds: Histogram,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        active: EXPIRED.with_label_values(&["active"]),
        cycles: metric::counter("racekv_expiry_cycles_total", "Active expiry cycles run"),
        passes: metric::counter("racekv_expiry_passes_total", "Active expiry sweeps through the whole directory"),
        rounds: metric::counter("racekv_expiry_rounds_total", "Active expiry rounds (one run of buckets each)"),
        sampled_slots: metric::counter("racekv_expiry_sampled_slots_total", "Used slots the active expiry looked at"),
        freed_bytes: metric::counter(
            "racekv_expiry_freed_bytes_total",
            "Heap bytes of expired items' blocks given back to the heap after the grace period",
        ),
        pending_bytes: metric::gauge(
            "racekv_expiry_pending_bytes",
            "Heap bytes of expired items' blocks removed and waiting out the grace period",
        ),
        stale_ratio: metric::float_gauge(
            "racekv_expiry_stale_ratio",
            "Of the sampled items with an expiry in the last cycle, the share that had expired",
        ),
        cycle_seconds: metric::latency_histogram("racekv_expiry_cycle_seconds", "Time one active expiry cycle took"),
    }
});

/// Registers the expiry metrics now, so they are exported (at zero) before anything expires.
pub fn register_metrics() {
    LazyLock::force(&METRICS);
}

/// Buckets one round reads: one READ of 2 KiB, up to 224 slots (their block-header READs
/// and CASes fit one batch each).
pub const BUCKETS_PER_ROUND: u64 = 32;
/// A cycle samples another round while more than this share (percent) of the last round's
/// items with an expiry had expired (Redis' `ACTIVE_EXPIRE_CYCLE_ACCEPTABLE_STALE`).
pub const STALE_PERCENT: u64 = 10;
/// Rounds every cycle runs (time budget permitting): 256 buckets, so a sweep of a table
/// with few items to expire still passes 2560 buckets a second.
pub const MIN_ROUNDS_PER_CYCLE: u64 = 8;
/// Directory entries read at once while looking for the next subtable to sweep.
const DIRECTORY_ENTRIES_PER_READ: u64 = 64;

// A round's header READs and CASes each fit one batch (the bucket READ carries an FAA).
const _: () = assert!(BUCKETS_PER_ROUND as usize * crate::layout::SLOTS_PER_BUCKET <= racekv_transport::MAX_BATCH_OPS);

/// How the active expiry paces itself.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryOptions {
    /// Between cycles while items with an expiry are around (Redis: 10 a second).
    pub interval: Duration,
    /// The longest wait between cycles that found no item with an expiry.
    pub idle_interval: Duration,
    /// Share of one core (percent of `interval`) a cycle may spend sampling.
    pub cpu_percent: u32,
    /// How long a removed item's block waits before it goes back to the heap: the memnode's
    /// published grace period (readers may still be reading it).
    pub grace: Duration,
}

impl Default for ExpiryOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            idle_interval: Duration::from_secs(1),
            cpu_percent: 25,
            grace: Duration::from_millis(10),
        }
    }
}

/// What one round or cycle saw and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sampled {
    /// Rounds of sampling (one bucket group each).
    pub rounds: u64,
    /// Used slots looked at.
    pub slots: u64,
    /// Of those, items with an expiry.
    pub with_expiry: u64,
    /// Of those, items expired (by the memnode's clock, less the tolerated skew).
    pub expired: u64,
    /// Of those, items this removed (a CAS can lose to a client's write).
    pub removed: u64,
    /// Block bytes of the items removed.
    pub removed_bytes: u64,
}

impl Sampled {
    fn add(&mut self, other: &Sampled) {
        self.rounds += other.rounds;
        self.slots += other.slots;
        self.with_expiry += other.with_expiry;
        self.expired += other.expired;
        self.removed += other.removed;
        self.removed_bytes += other.removed_bytes;
    }

    /// Whether more than [`STALE_PERCENT`] of the items with an expiry had expired.
    pub fn stale(&self) -> bool {
        self.expired * 100 > self.with_expiry * STALE_PERCENT
    }
}

/// One cycle's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cycle {
    /// What the cycle's rounds saw and removed.
    pub sampled: Sampled,
    /// Heap bytes given back this cycle (blocks whose grace period ended).
    pub freed_bytes: u64,
    /// How long after this cycle the next one is due.
    pub next_in: Duration,
}

/// The memnode's active expiry over its loopback connection (one per memnode; not shared).
pub struct ActiveExpiry {
    conn: Arc<dyn Connection>,
    layout: Layout,
    heap: Arc<Heap>,
    extents: Arc<Extents>,
    options: ExpiryOptions,
    batch: Batch,
    /// The sweep's position: the next directory index to look at, and the subtable being
    /// swept with its next bucket.
    next_index: u64,
    sweeping: Option<(u64, u64)>,
    /// Removed blocks waiting out the grace period: (removed at, offset, bytes).
    pending: VecDeque<(Instant, u64, u64)>,
    pending_bytes: u64,
    /// Current wait between cycles (grows while nothing expires).
    wait: Duration,
    /// When [`ActiveExpiry::run_due`] runs the next cycle.
    next_cycle: Instant,
    cycles: u64,
    /// Removals not yet taken off the superblock's item count (it rides on the next batch,
    /// as clients' counts do; a cycle's end sends it).
    count_delta: u64,
    /// A round's working space: used slots (offset, word, slot), then the expired ones.
    used: Vec<(u64, u64, Slot)>,
    expired: Vec<(u64, u64, Slot)>,
}

impl ActiveExpiry {
    /// The active expiry of the table in `layout`, over the memnode's loopback `conn`, freeing removed blocks on `heap`
    /// and their extents on `extents`.
    pub fn new(
        conn: Arc<dyn Connection>,
        layout: Layout,
        heap: Arc<Heap>,
        extents: Arc<Extents>,
        options: ExpiryOptions,
    ) -> Self {
        register_metrics();
        Self {
            conn,
            layout,
            heap,
            extents,
            options,
            batch: Batch::new(),
            next_index: 0,
            sweeping: None,
            pending: VecDeque::new(),
            pending_bytes: 0,
            wait: options.interval,
            next_cycle: Instant::now(),
            cycles: 0,
            count_delta: 0,
            used: Vec::new(),
            expired: Vec::new(),
        }
    }

    /// Cycles run so far.
    pub fn cycles(&self) -> u64 {
        self.cycles
    }

    /// What a memnode's expiry thread calls whenever it wakes: runs a cycle if one is due
    /// (cycles are at least the interval apart, so a cycle's time budget bounds the share
    /// of a core they take), gives back the blocks whose grace period ended, and returns
    /// how long to sleep until either is due again.
    pub fn run_due(&mut self) -> Result<Duration, Error> {
        let now = Instant::now();
        if now >= self.next_cycle {
            let cycle = self.cycle()?;
            self.next_cycle = Instant::now() + cycle.next_in;
        } else {
            self.release_due(now)?;
        }
        let release = self.pending.front().map(|&(removed, ..)| removed + self.options.grace);
        let next = release.map_or(self.next_cycle, |r| r.min(self.next_cycle));
        Ok(next.saturating_duration_since(Instant::now()))
    }

    /// Heap bytes removed and waiting out the grace period.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// One cycle: [`MIN_ROUNDS_PER_CYCLE`] rounds, more while the items sampled keep being
    /// stale, within the time budget (at least one round); then the blocks whose grace
    /// period ended go back to the heap.
    pub fn cycle(&mut self) -> Result<Cycle, Error> {
        let started = Instant::now();
        let budget = self.options.interval * self.options.cpu_percent.min(100) / 100;
        let mut sampled = Sampled::default();
        loop {
            let round = self.sample_round(now_unix_ms())?;
            sampled.add(&round);
            if started.elapsed() >= budget || (sampled.rounds >= MIN_ROUNDS_PER_CYCLE && !round.stale()) {
                break;
            }
        }
        let freed_bytes = self.release_due(Instant::now())?;
        let m = &*METRICS;
        m.cycles.inc();
        self.cycles += 1;
        m.cycle_seconds.observe(started.elapsed().as_secs_f64());
        if sampled.with_expiry > 0 {
            m.stale_ratio.set(sampled.expired as f64 / sampled.with_expiry as f64);
        }
        self.wait = if sampled.with_expiry > 0 {
            self.options.interval
        } else {
            (self.wait * 2).min(self.options.idle_interval.max(self.options.interval))
        };
        Ok(Cycle { sampled, freed_bytes, next_in: self.wait })
    }

    /// Sweeps the next run of buckets and removes the expired items in it, judging expiry
    /// at `now_ms` (Unix milliseconds) less [`MAX_CLOCK_SKEW_MS`].
    pub fn sample_round(&mut self, now_ms: u64) -> Result<Sampled, Error> {
        let mut out = Sampled { rounds: 1, ..Sampled::default() };
        METRICS.rounds.inc();
        let Some((subtable, first)) = self.next_subtable()? else {
            return Ok(out); // directory entries only, this round
        };
        let buckets = self.layout.buckets_per_subtable();
        let run = BUCKETS_PER_ROUND.min(buckets - first);
        self.sweeping = (first + run < buckets).then_some((subtable, first + run));
        let mut used = std::mem::take(&mut self.used);
        let mut expired = std::mem::take(&mut self.expired);
        let result = self.sweep_run(subtable + first * BUCKET_BYTES, run, now_ms, &mut used, &mut expired, &mut out);
        (self.used, self.expired) = (used, expired);
        result.map(|()| out)
    }

    /// One round's work on the run of `run` buckets at `start` (see `sample_round`).
    fn sweep_run(
        &mut self,
        start: u64,
        run: u64,
        now_ms: u64,
        used: &mut Vec<(u64, u64, Slot)>,
        expired: &mut Vec<(u64, u64, Slot)>,
        out: &mut Sampled,
    ) -> Result<(), Error> {
        used.clear();
        expired.clear();
        let b = &mut self.batch;
        b.clear();
        if self.count_delta > 0 {
            b.faa(sb::ITEM_COUNT, self.count_delta.wrapping_neg());
        }
        let image = b.read(start, (run * BUCKET_BYTES) as u32);
        self.conn.execute(b)?;
        self.count_delta = 0;
        for (i, bucket) in b.read_result(image)?.chunks_exact(BUCKET_BYTES as usize).enumerate() {
            let (_, slots) = parse_bucket(bucket);
            for (j, &word) in slots.iter().enumerate() {
                // A slot a transaction holds is settled by it, never swept (`table::txn`).
                if let Some(slot) = Slot::decode(word).filter(|s| !s.locked) {
                    used.push((slot_offset(start + i as u64 * BUCKET_BYTES, j), word, slot));
                }
            }
        }
        out.slots = used.len() as u64;
        METRICS.sampled_slots.inc_by(out.slots);
        if used.is_empty() {
            return Ok(());
        }
        // The start of their blocks: sizes and expiry (not the whole block: the CAS below
        // is what makes acting on it safe, see `peek_block_header`).
        b.clear();
        let reads: Vec<_> = used.iter().map(|&(_, _, slot)| b.read(slot.block, BLOCK_PEEK_BYTES as u32)).collect();
        self.conn.execute(b)?;
        for (&(at, word, slot), read) in used.iter().zip(reads) {
            // A block that does not fit its word was reused since the bucket read: the
            // slot moved on, and its new word is not what was judged. Left for next time.
            let Some((units, expires_at_ms)) = peek_block_header(b.read_result(read)?) else { continue };
            let Some(expires_at_ms) = expires_at_ms.filter(|_| units == slot.units) else { continue };
            out.with_expiry += 1;
            if now_ms > expires_at_ms.saturating_add(MAX_CLOCK_SKEW_MS) {
                expired.push((at, word, slot));
            }
        }
        out.expired = expired.len() as u64;
        if expired.is_empty() {
            return Ok(());
        }
        // Remove them: each CAS succeeds only if its slot still holds the word judged.
        b.clear();
        let cases: Vec<_> = expired.iter().map(|&(at, word, _)| b.cas(at, word, 0)).collect();
        self.conn.execute(b)?;
        let removed_at = Instant::now();
        let mut indirect = Vec::new();
        for (&(_, _, slot), cas) in expired.iter().zip(cases) {
            if b.cas_succeeded(cas)? {
                out.removed += 1;
                out.removed_bytes += slot.block_bytes();
                self.pending.push_back((removed_at, slot.block, slot.block_bytes()));
                if slot.indirect {
                    indirect.push(slot);
                }
            }
        }
        if !indirect.is_empty() {
            // Their blocks are ours until the grace period ends: read where the values are.
            b.clear();
            let reads: Vec<_> = indirect.iter().map(|s| b.read(s.block, s.block_bytes() as u32)).collect();
            self.conn.execute(b)?;
            for read in reads {
                match decode_block(b.read_result(read)?).filter(|block| block.extent.is_some()) {
                    Some(block) => block.extents().try_for_each(|e| self.extents.retire(e.offset, e.value_len))?,
                    None => tracing::warn!("an expired indirect block did not decode; its extent waits for reclaim"),
                }
            }
        }
        // The item count, as clients keep it for their deletes (with the next batch).
        self.count_delta += out.removed;
        self.pending_bytes += out.removed_bytes;
        METRICS.active.inc_by(out.removed);
        METRICS.pending_bytes.set(self.pending_bytes as i64);
        Ok(())
    }

    /// Takes removals not yet counted off the superblock's item count now (rounds leave
    /// theirs to ride on the next batch; cycles and [`Self::release_due`] send them).
    pub fn flush_count(&mut self) -> Result<(), Error> {
        if self.count_delta > 0 {
            self.batch.clear();
            self.batch.faa(sb::ITEM_COUNT, self.count_delta.wrapping_neg());
            self.conn.execute(&mut self.batch)?;
            self.count_delta = 0;
        }
        Ok(())
    }

    /// The subtable the sweep is in and its next bucket, moving on through the directory
    /// when it is done with one. Each subtable is swept once per pass, under its lowest
    /// directory index (the others alias it). None: this round read directory entries and
    /// found no subtable to sweep among them (a split in progress locks its entries; the
    /// next pass sees its halves).
    fn next_subtable(&mut self) -> Result<Option<(u64, u64)>, Error> {
        if let Some(at) = self.sweeping {
            return Ok(Some(at));
        }
        let b = &mut self.batch;
        b.clear();
        let depth = b.read(sb::GLOBAL_DEPTH, 8);
        self.conn.execute(b)?;
        let global_depth = (read_word(b.read_result(depth)?) as u32).min(self.layout.max_global_depth);
        let entries = 1u64 << global_depth;
        if self.next_index >= entries {
            self.next_index = 0;
            METRICS.passes.inc();
        }
        let count = DIRECTORY_ENTRIES_PER_READ.min(entries - self.next_index);
        b.clear();
        let read = b.read(self.layout.dir_entry_offset(self.next_index), (count * 8) as u32);
        self.conn.execute(b)?;
        let first = self.next_index;
        self.next_index += count;
        for (i, word) in b.read_result(read)?.chunks_exact(8).enumerate() {
            let index = first + i as u64;
            let entry = DirEntry::decode(read_word(word));
            let canonical = index < 1u64 << entry.local_depth.min(63);
            if canonical && !entry.locked && entry.is_valid(&self.layout) {
                self.next_index = index + 1;
                return Ok(Some((entry.subtable, 0)));
            }
        }
        Ok(None)
    }

    /// Gives the blocks whose grace period has passed by `now` back to the heap; returns
    /// their bytes.
    pub fn release_due(&mut self, now: Instant) -> Result<u64, Error> {
        self.flush_count()?;
        self.extents.release()?;
        let mut due = Vec::new();
        while let Some(&(removed, offset, bytes)) = self.pending.front() {
            if now.saturating_duration_since(removed) < self.options.grace {
                break;
            }
            self.pending.pop_front();
            due.push((offset, bytes));
        }
        if due.is_empty() {
            return Ok(0);
        }
        let bytes: u64 = due.iter().map(|&(_, b)| b).sum();
        self.pending_bytes -= bytes;
        METRICS.pending_bytes.set(self.pending_bytes as i64);
        self.heap.return_ranges(&due)?;
        METRICS.freed_bytes.inc_by(bytes);
        Ok(bytes)
    }

    /// Gives back every block still in grace, after waiting it out (a memnode stopping).
    pub fn drain(&mut self) -> Result<u64, Error> {
        if let Some(&(last, ..)) = self.pending.back() {
            std::thread::sleep((last + self.options.grace).saturating_duration_since(Instant::now()));
        }
        self.release_due(Instant::now())
    }
}
