//! Client-side allocation of KV blocks.
//!
//! Blocks come from heap chunks the memnode hands out (one RPC per chunk), carved in 64 B
//! units. A block a client replaces or deletes is freed into a grace queue first: it may be
//! reused only after `grace_period`, longer than nearly every operation that could still be
//! reading it, and at least the memnode's published grace period. (Readers also verify key
//! and checksum, so a late reader that finds another key's block re-reads; and a reader that
//! may have taken longer than the grace period reads its slot again before it trusts the
//! block, which could hold a newer, not yet swung write of the same key: `stall.rs`. The
//! grace period keeps those re-reads rare and protects CAS from ABA.)
//!
//! Each client has its own lists (no locks on the hot path). A client that goes away hands
//! its lists and the rest of its chunk to the [`FreePool`] it shares with its siblings.
//!
//! All the space a client or pool holds comes from one run of the memnode ([`Chunk`]):
//! space of a run that is gone is dropped, never written (the memnode's start reclaimed it).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::Error;
use crate::layout::{BLOCK_UNIT_BYTES, MAX_BLOCK_UNITS};

/// Heap space a memnode handed out, and the run of the memnode that did: `instance` is its
/// server instance (random per start, [`racekv_transport::Connection::instance`]). A memnode
/// that starts reclaims every heap byte no slot references (`reclaim.rs`), so space held
/// from an earlier run may be someone else's now: whatever a client writes into it must
/// reach that same run ([`racekv_transport::Batch::require_instance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Region offset of the chunk's first byte.
    pub offset: u64,
    /// Length of the chunk in bytes.
    pub bytes: u64,
    /// The memnode run (server instance) that handed it out.
    pub instance: u64,
}

/// Free runs shorter than a chunk, from one run of the memnode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragments {
    /// The memnode run (server instance) the runs came from.
    pub instance: u64,
    /// (offset, bytes)
    pub ranges: Vec<(u64, u64)>,
}

/// Where chunks come from (the memnode, through its RPC).
pub trait ChunkSource: Send + Sync {
    /// A heap chunk of about `preferred` bytes. Offsets and sizes are multiples of 64 and
    /// at least [`MIN_CHUNK_BYTES`]; the size may differ from the wish.
    fn chunk(&self, preferred: u64) -> Result<Chunk, Error>;
    /// Hands unused ranges that run `instance` handed out back (a process going away).
    /// Best effort.
    fn give_back(&self, instance: u64, ranges: &[(u64, u64)]) {
        let _ = (instance, ranges);
    }
    /// Free runs shorter than a chunk, up to about `most_bytes`, each to be used as one
    /// free block of its size (at most [`MAX_BLOCK_UNITS`] units). Best effort.
    fn fragments(&self, most_bytes: u64) -> Option<Fragments> {
        let _ = most_bytes;
        None
    }
    /// Run `instance` of the memnode is gone: drop any space from it held for later.
    fn forget(&self, instance: u64) {
        let _ = instance;
    }
}

/// Fragments a client takes from the memnode each time it fetches a chunk.
pub const FRAGMENT_INTAKE_BYTES: u64 = 1 << 20;

/// No chunk is smaller: it must hold the largest block.
pub const MIN_CHUNK_BYTES: u64 = 16 * 1024;
/// A client's first chunk; each next one doubles, up to the memnode's chunk size. Small
/// first chunks keep short-lived clients (one command, one function call) from pinning
/// a whole chunk each.
pub const FIRST_CHUNK_BYTES: u64 = 64 * 1024;

const CLASSES: usize = MAX_BLOCK_UNITS as usize + 1;
/// Blocks moved from the shared pool to a client at once.
const POOL_REFILL_BLOCKS: usize = 64;

#[derive(Default)]
struct PoolInner {
    /// The memnode run everything below came from (None: the pool is empty).
    instance: Option<u64>,
    free: Vec<Vec<u64>>,
    pending: VecDeque<(Instant, u64, u8)>,
    ranges: Vec<(u64, u64)>,
}

impl PoolInner {
    fn clear(&mut self, instance: Option<u64>) {
        *self = PoolInner { instance, ..PoolInner::default() };
    }
}

/// Free blocks and chunk remainders left by clients that went away, all from one run of the
/// memnode: the latest one a sibling heard from ([`FreePool::observe`]).
#[derive(Default)]
pub struct FreePool {
    inner: Mutex<PoolInner>,
}

impl FreePool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sibling got space from memnode run `instance`: anything from another run is stale.
    fn observe(&self, instance: u64) {
        let mut inner = self.inner.lock();
        if inner.instance != Some(instance) {
            inner.clear(Some(instance));
        }
    }

    /// Drops everything if it came from run `stale`.
    fn forget(&self, stale: u64) {
        let mut inner = self.inner.lock();
        if inner.instance == Some(stale) {
            inner.clear(None);
        }
    }

    /// Whether a client holding space of run `instance` (None: nothing yet) may take from
    /// the pool; a client with nothing adopts the pool's run.
    fn same_run(inner: &PoolInner, instance: &mut Option<u64>) -> bool {
        match (inner.instance, *instance) {
            (Some(pool), None) => {
                *instance = Some(pool);
                true
            }
            (Some(pool), Some(mine)) => pool == mine,
            (None, _) => false,
        }
    }

    fn take_blocks(&self, units: u8, out: &mut Vec<u64>, grace: Duration, instance: &mut Option<u64>) -> bool {
        let mut inner = self.inner.lock();
        if !Self::same_run(&inner, instance) {
            return false;
        }
        let now = Instant::now();
        while let Some(&(at, block, u)) = inner.pending.front() {
            if now.duration_since(at) < grace {
                break;
            }
            inner.pending.pop_front();
            ensure_classes(&mut inner.free);
            inner.free[u as usize].push(block);
        }
        ensure_classes(&mut inner.free);
        let list = &mut inner.free[units as usize];
        let n = list.len().min(POOL_REFILL_BLOCKS);
        out.extend(list.drain(list.len() - n..));
        n > 0
    }

    fn take_range(&self, instance: &mut Option<u64>) -> Option<(u64, u64)> {
        let mut inner = self.inner.lock();
        if inner.ranges.is_empty() || !Self::same_run(&inner, instance) {
            return None;
        }
        inner.ranges.pop()
    }

    /// Empties the pool for a process that is done with the table: waits out the grace
    /// period of blocks still in it, merges free blocks and chunk remainders that touch into
    /// runs, and returns the runs of at least `min_bytes` as (offset, bytes) for the memnode
    /// to take back. Shorter runs are counted in [`Drained::lost_bytes`]. Freed blocks used
    /// to be lost whole: a daemon restart after deleting 100 K keys of 1 KiB leaked 100 MiB.
    pub fn drain_all(&self, grace: Duration, min_bytes: u64) -> Drained {
        let newest = self.inner.lock().pending.iter().map(|&(at, _, _)| at).max();
        if let Some(wait) = newest.and_then(|at| grace.checked_sub(at.elapsed())) {
            std::thread::sleep(wait);
        }
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let mut drained = Drained { instance: inner.instance.take(), ..Drained::default() };
        let mut pieces: Vec<(u64, u64)> = inner.ranges.drain(..).collect();
        for (units, list) in inner.free.iter_mut().enumerate() {
            pieces.extend(list.drain(..).map(|b| (b, b + units as u64 * BLOCK_UNIT_BYTES)));
        }
        pieces.extend(inner.pending.drain(..).map(|(_, b, u)| (b, b + u64::from(u) * BLOCK_UNIT_BYTES)));
        pieces.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (start, end) in pieces {
            debug_assert!(start < end, "an empty free piece at {start}");
            match runs.last_mut() {
                Some(last) if start < last.1 => {
                    // Two holders of the same bytes would be a double free: give back
                    // neither copy of the overlap rather than memory someone may be using.
                    tracing::error!("free pieces overlap at {start} (run ends at {}); not giving it back", last.1);
                    debug_assert!(false, "free pieces overlap at {start}");
                    drained.lost_bytes += end.saturating_sub(start);
                }
                Some(last) if start == last.1 => last.1 = end,
                _ => runs.push((start, end)),
            }
        }
        for (start, end) in runs {
            if end - start >= min_bytes {
                drained.ranges.push((start, end - start));
                drained.given_bytes += end - start;
            } else {
                drained.lost_bytes += end - start;
            }
        }
        drained
    }

    /// Bytes held by the pool (free, in grace, and chunk remainders).
    pub fn bytes(&self) -> u64 {
        let inner = self.inner.lock();
        let free: u64 = inner.free.iter().enumerate().map(|(u, l)| u as u64 * BLOCK_UNIT_BYTES * l.len() as u64).sum();
        let pending: u64 = inner.pending.iter().map(|&(_, _, u)| u64::from(u) * BLOCK_UNIT_BYTES).sum();
        let ranges: u64 = inner.ranges.iter().map(|&(a, b)| b - a).sum();
        free + pending + ranges
    }
}

/// What [`FreePool::drain_all`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Drained {
    /// The memnode run that handed the runs out (None: the pool was empty).
    pub instance: Option<u64>,
    /// Runs to give back to the memnode: (offset, bytes).
    pub ranges: Vec<(u64, u64)>,
    /// Bytes in `ranges`, the runs given back.
    pub given_bytes: u64,
    /// Free bytes not given back (runs under the minimum; overlapping pieces).
    pub lost_bytes: u64,
}

fn ensure_classes(free: &mut Vec<Vec<u64>>) {
    if free.len() < CLASSES {
        free.resize_with(CLASSES, Vec::new);
    }
}

/// At most this many allocations in a row that find a free block of their size reclaim by
/// [`BlockAllocator`]'s last reading of the clock (a workload that stopped retiring still
/// frees its grace queue every so often).
const CLOCK_EVERY_ALLOCS: u32 = 64;

/// One client's allocator.
pub struct BlockAllocator {
    source: Arc<dyn ChunkSource>,
    pool: Arc<FreePool>,
    grace: Duration,
    /// The memnode run all the space below came from (None: none held).
    instance: Option<u64>,
    /// Size to ask for next time.
    next_request: u64,
    cursor: u64,
    end: u64,
    free: Vec<Vec<u64>>,
    pending: VecDeque<(Instant, u64, u8)>,
    /// The latest time this allocator read (a retire's stamp): what an allocation that
    /// finds a free block of its size reclaims by, short of every [`CLOCK_EVERY_ALLOCS`]th
    /// one; the others read the clock. A time earlier than now only releases fewer blocks,
    /// and an update's retire and its next write's allocation read the clock once, not
    /// twice.
    seen: Instant,
    /// Allocations since the last that read the clock.
    allocs_since_clock: u32,
    /// Bytes in `free` and `pending`, for statistics.
    held_bytes: u64,
    /// Debug builds: every block in `free` and `pending`, so that a block freed or retired
    /// twice, or handed out while held, fails an assertion (a hash set per client is too
    /// much for release builds' hot path).
    #[cfg(debug_assertions)]
    held: std::collections::HashSet<u64>,
}

impl BlockAllocator {
    /// An allocator taking chunks from `source`, sharing freed blocks through `pool`, reusing a freed block only after
    /// `grace`.
    pub fn new(source: Arc<dyn ChunkSource>, pool: Arc<FreePool>, grace: Duration) -> Self {
        let mut free = Vec::new();
        ensure_classes(&mut free);
        Self {
            source,
            pool,
            grace,
            instance: None,
            next_request: FIRST_CHUNK_BYTES,
            cursor: 0,
            end: 0,
            free,
            pending: VecDeque::new(),
            seen: Instant::now(),
            allocs_since_clock: 0,
            held_bytes: 0,
            #[cfg(debug_assertions)]
            held: std::collections::HashSet::new(),
        }
    }

    /// Debug builds: notes that this allocator now holds `block`; `once`: it must not
    /// already (false for space whose origin is another process's word: fragments).
    #[allow(unused_variables)]
    fn hold(&mut self, block: u64, once: bool) {
        #[cfg(debug_assertions)]
        {
            let new = self.held.insert(block);
            assert!(new || !once, "block {block:#x} freed or retired twice (it is already free or in grace)");
        }
    }

    /// Debug builds: notes that `block`, just taken from the free lists, is handed out.
    #[allow(unused_variables)]
    fn unhold(&mut self, block: u64) {
        #[cfg(debug_assertions)]
        assert!(self.held.remove(&block), "handed out block {block:#x}, which the free lists did not hold");
    }

    /// Debug builds: `held_bytes` is what the free lists and the grace queue hold (a walk
    /// over both: only where the allocator gives its space away).
    fn check_held_bytes(&self) {
        debug_assert_eq!(
            self.held_bytes,
            self.free.iter().enumerate().map(|(u, l)| u as u64 * BLOCK_UNIT_BYTES * l.len() as u64).sum::<u64>()
                + self.pending.iter().map(|&(_, _, u)| u64::from(u) * BLOCK_UNIT_BYTES).sum::<u64>(),
            "held bytes out of step with the free lists and the grace queue"
        );
    }

    /// A block of `units` x 64 B.
    pub fn alloc(&mut self, units: u8) -> Result<u64, Error> {
        assert!(units >= 1, "blocks are at least one unit");
        self.allocs_since_clock += 1;
        let may_wait = self.free[units as usize].is_empty() && !self.pending.is_empty();
        if may_wait || self.allocs_since_clock >= CLOCK_EVERY_ALLOCS {
            self.allocs_since_clock = 0;
            self.seen = self.seen.max(Instant::now());
        }
        self.reclaim(self.seen);
        if let Some(block) = self.free[units as usize].pop() {
            self.held_bytes -= u64::from(units) * BLOCK_UNIT_BYTES;
            self.unhold(block);
            return Ok(block);
        }
        let mut refill = std::mem::take(&mut self.free[units as usize]);
        let refilled = self.pool.take_blocks(units, &mut refill, self.grace, &mut self.instance);
        #[cfg(debug_assertions)]
        for &block in &refill {
            self.hold(block, true);
        }
        self.free[units as usize] = refill;
        if refilled {
            let block = self.free[units as usize].pop().expect("refilled");
            self.held_bytes += (self.free[units as usize].len() as u64) * u64::from(units) * BLOCK_UNIT_BYTES;
            self.unhold(block);
            return Ok(block);
        }
        let bytes = u64::from(units) * BLOCK_UNIT_BYTES;
        if self.end - self.cursor < bytes {
            // Space between other clients' live blocks first (one round trip per chunk's
            // worth of allocations, not one per allocation).
            self.take_fragments(units);
            if let Some(block) = self.free[units as usize].pop() {
                self.held_bytes -= bytes;
                self.unhold(block);
                return Ok(block);
            }
            self.next_chunk(bytes)?;
        }
        let block = self.cursor;
        self.cursor += bytes;
        assert!(self.cursor <= self.end, "a block past the end of its range");
        assert!(block.is_multiple_of(BLOCK_UNIT_BYTES), "block {block:#x} is not 64 B aligned");
        #[cfg(debug_assertions)]
        assert!(!self.held.contains(&block), "handed out block {block:#x} from the range while it is free or in grace");
        Ok(block)
    }

    /// Makes room for a block of `need` bytes: a range from the pool that holds one, or a
    /// new chunk. What is left of the current range, and pool ranges too short for the
    /// block, become free blocks of their own sizes (a range that short is under 255 units).
    fn next_chunk(&mut self, need: u64) -> Result<(), Error> {
        assert!(need <= MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES);
        self.keep_rest();
        while let Some((start, end)) = self.pool.take_range(&mut self.instance) {
            (self.cursor, self.end) = (start, end);
            if end - start >= need {
                return Ok(());
            }
            self.keep_rest();
        }
        let Chunk { offset, bytes, instance } = self.source.chunk(self.next_request)?;
        assert!(
            offset % BLOCK_UNIT_BYTES == 0
                && bytes % BLOCK_UNIT_BYTES == 0
                && bytes >= MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES
        );
        self.next_request = self.next_request.saturating_mul(2);
        self.adopt(instance);
        (self.cursor, self.end) = (offset, offset + bytes);
        Ok(())
    }

    /// Keeps the rest of the current range, shorter than the block being allocated, as one
    /// free block.
    fn keep_rest(&mut self) {
        let rest = self.end - self.cursor;
        debug_assert!(rest < MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES + BLOCK_UNIT_BYTES);
        if rest >= BLOCK_UNIT_BYTES {
            let units = (rest / BLOCK_UNIT_BYTES).min(MAX_BLOCK_UNITS);
            self.free[units as usize].push(self.cursor);
            self.held_bytes += units * BLOCK_UNIT_BYTES;
            self.hold(self.cursor, true);
        }
        self.cursor = self.end;
    }

    /// Takes fragments from the source and cuts each into blocks of `units` (the size being
    /// asked for: key-value sizes tend to repeat), the rest of it one block of its own size.
    fn take_fragments(&mut self, units: u8) {
        let want = u64::from(units) * BLOCK_UNIT_BYTES;
        let Some(Fragments { instance, ranges }) = self.source.fragments(FRAGMENT_INTAKE_BYTES) else { return };
        if ranges.is_empty() {
            return;
        }
        self.adopt(instance);
        for (offset, bytes) in ranges {
            assert!(
                offset.is_multiple_of(BLOCK_UNIT_BYTES)
                    && bytes.is_multiple_of(BLOCK_UNIT_BYTES)
                    && (1..=MAX_BLOCK_UNITS).contains(&(bytes / BLOCK_UNIT_BYTES)),
                "the chunk source handed out a bad fragment ({offset}, {bytes} B)"
            );
            let end = offset + bytes;
            let mut at = offset;
            while end - at >= want {
                self.free[units as usize].push(at);
                self.hold(at, false);
                at += want;
            }
            if at < end {
                self.free[((end - at) / BLOCK_UNIT_BYTES) as usize].push(at);
                self.hold(at, false);
            }
            self.held_bytes += bytes;
        }
    }

    /// Makes sure a chunk is at hand, so the next allocation makes no RPC (for clients
    /// prepared ahead of need).
    pub fn reserve(&mut self) -> Result<(), Error> {
        if self.end - self.cursor < MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES {
            self.next_chunk(MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES)?;
        }
        Ok(())
    }

    /// The memnode run the space this client holds came from (None: it holds none).
    pub fn instance(&self) -> Option<u64> {
        self.instance
    }

    /// Space from memnode run `instance` arrived (a chunk, fragments): the latest word from
    /// the memnode, so space held from another run is dropped (the memnode reclaimed it).
    fn adopt(&mut self, instance: u64) {
        if self.instance != Some(instance) {
            if let Some(stale) = self.instance {
                tracing::debug!(stale, instance, "the memnode restarted: dropping the space held from its last run");
                self.drop_space();
            }
            self.instance = Some(instance);
            self.pool.observe(instance);
        }
    }

    fn drop_space(&mut self) {
        self.check_held_bytes();
        self.free.iter_mut().for_each(Vec::clear);
        self.pending.clear();
        self.cursor = 0;
        self.end = 0;
        self.held_bytes = 0;
        #[cfg(debug_assertions)]
        self.held.clear();
    }

    /// Memnode run `stale` is gone (a batch requiring it was refused): drops the space held
    /// from it here, in the shared pool and in the chunk source. The next allocation takes a
    /// chunk from the run serving now.
    pub fn forget(&mut self, stale: u64) {
        if self.instance == Some(stale) {
            self.drop_space();
            self.instance = None;
        }
        self.pool.forget(stale);
        self.source.forget(stale);
    }

    /// Whether a block freed by a CAS that ran on memnode run `instance` may join this
    /// client's space (a client holding none starts holding that run's).
    fn owns_run(&mut self, instance: u64) -> bool {
        match self.instance {
            None => {
                self.instance = Some(instance);
                true
            }
            Some(mine) => mine == instance,
        }
    }

    /// Frees a block other clients may still be reading: reusable after the grace period.
    /// `instance` is the memnode run whose slot last held it (the run the unlinking CAS
    /// ran on); a block of another run is left to that run's reclaim.
    pub fn retire(&mut self, block: u64, units: u8, instance: u64) {
        assert!(units >= 1 && block.is_multiple_of(BLOCK_UNIT_BYTES), "retiring block {block:#x} of {units} units");
        if !self.owns_run(instance) {
            return;
        }
        self.hold(block, true);
        // After the unlinking CAS (the caller's), so its grace starts no earlier than it.
        self.seen = self.seen.max(Instant::now());
        self.pending.push_back((self.seen, block, units));
        self.held_bytes += u64::from(units) * BLOCK_UNIT_BYTES;
    }

    /// Frees a block allocated from memnode run `instance` that was never published (no
    /// slot ever pointed to it): reusable now.
    pub fn release_unpublished(&mut self, block: u64, units: u8, instance: u64) {
        assert!(units >= 1 && block.is_multiple_of(BLOCK_UNIT_BYTES), "releasing block {block:#x} of {units} units");
        if !self.owns_run(instance) {
            return;
        }
        self.hold(block, true);
        self.free[units as usize].push(block);
        self.held_bytes += u64::from(units) * BLOCK_UNIT_BYTES;
    }

    fn reclaim(&mut self, now: Instant) {
        debug_assert!(now <= Instant::now(), "reclaiming by a time not yet come frees blocks early");
        while let Some(&(at, block, units)) = self.pending.front() {
            if now.duration_since(at) < self.grace {
                break;
            }
            // Released only after its grace; the queue is in retire order (debug: per block).
            debug_assert!(self.pending.get(1).is_none_or(|next| next.0 >= at), "the grace queue is out of order");
            self.pending.pop_front();
            self.free[units as usize].push(block);
        }
    }

    /// Bytes this client holds free or in grace.
    pub fn held_bytes(&self) -> u64 {
        self.check_held_bytes();
        self.held_bytes
    }
}

impl Drop for BlockAllocator {
    fn drop(&mut self) {
        self.check_held_bytes();
        let Some(instance) = self.instance else { return };
        let mut inner = self.pool.inner.lock();
        match inner.instance {
            None => inner.instance = Some(instance),
            Some(pool) if pool == instance => {}
            // Space from a run the pool's siblings no longer use: reclaimed by the memnode.
            Some(_) => return,
        }
        ensure_classes(&mut inner.free);
        for (units, list) in self.free.iter_mut().enumerate() {
            inner.free[units].append(list);
        }
        inner.pending.extend(self.pending.drain(..));
        if self.end > self.cursor {
            inner.ranges.push((self.cursor, self.end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const RUN: u64 = 1;

    /// Chunks of 64 KiB from the memnode run its `run` says.
    struct Bump(AtomicU64, AtomicU64);
    impl ChunkSource for Bump {
        fn chunk(&self, _preferred: u64) -> Result<Chunk, Error> {
            let offset = self.0.fetch_add(1 << 16, Ordering::Relaxed);
            Ok(Chunk { offset, bytes: 1 << 16, instance: self.1.load(Ordering::Relaxed) })
        }
    }

    fn allocator(grace_ms: u64) -> (BlockAllocator, Arc<Bump>, Arc<FreePool>) {
        let source = Arc::new(Bump(AtomicU64::new(1 << 20), AtomicU64::new(RUN)));
        let pool = Arc::new(FreePool::new());
        (BlockAllocator::new(source.clone(), pool.clone(), Duration::from_millis(grace_ms)), source, pool)
    }

    #[test]
    fn blocks_never_overlap() {
        let (mut a, _, _) = allocator(0);
        let mut spans = Vec::new();
        for i in 0..5_000u64 {
            let units = (i % 7 + 1) as u8;
            spans.push((a.alloc(units).unwrap(), units as u64 * 64));
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?}");
        }
    }

    #[test]
    fn retired_blocks_wait_out_the_grace_period() {
        let (mut a, _, _) = allocator(50);
        let b = a.alloc(2).unwrap();
        a.retire(b, 2, RUN);
        assert_ne!(a.alloc(2).unwrap(), b, "reused inside the grace period");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(a.alloc(2).unwrap(), b, "not reused after the grace period");
        let u = a.alloc(3).unwrap();
        a.release_unpublished(u, 3, RUN);
        assert_eq!(a.alloc(3).unwrap(), u, "unpublished blocks are reusable at once");
    }

    #[test]
    fn steady_updates_stop_asking_for_chunks() {
        let (mut a, source, _) = allocator(0);
        let mut live = Vec::new();
        for _ in 0..1_000 {
            live.push(a.alloc(1).unwrap());
        }
        let chunks_before = source.0.load(Ordering::Relaxed);
        for i in 0..100_000 {
            let at = i % live.len();
            let old = live[at];
            live[at] = a.alloc(1).unwrap();
            a.retire(old, 1, RUN);
        }
        assert_eq!(source.0.load(Ordering::Relaxed), chunks_before, "memory grew under a steady update load");
    }

    #[test]
    fn a_departing_client_leaves_its_memory_to_the_pool() {
        let (mut a, source, pool) = allocator(0);
        let block = a.alloc(4).unwrap();
        a.release_unpublished(block, 4, RUN);
        drop(a);
        let mut b = BlockAllocator::new(source, pool.clone(), Duration::ZERO);
        assert_eq!(b.alloc(4).unwrap(), block);
        assert!(pool.bytes() > 0, "the first client's chunk remainder went missing");
    }

    /// A departing client's chunk remainder can be shorter than the next client's block: it
    /// becomes a free block of its own size, never the start of a longer block (which ran
    /// past its end into someone else's space until the stress test of memnode restarts,
    /// where clients come and go, caught it).
    #[test]
    fn a_short_remainder_in_the_pool_is_never_overrun() {
        let (mut a, source, pool) = allocator(0);
        for _ in 0..4 {
            a.alloc(255).unwrap();
        }
        let last = a.alloc(3).unwrap(); // 1023 of the chunk's 1024 units used
        let remainder = last + 3 * 64;
        drop(a);
        let mut b = BlockAllocator::new(source, pool, Duration::ZERO);
        let block = b.alloc(4).unwrap();
        assert!(
            block + 4 * 64 <= remainder || block >= remainder + 64,
            "a 4-unit block at {block} overruns the 1-unit remainder at {remainder}"
        );
        assert_eq!(b.alloc(1).unwrap(), remainder, "the remainder was not kept as a 1-unit block");
    }

    #[test]
    fn space_from_a_memnode_run_that_is_gone_is_never_handed_out_again() {
        let (mut a, source, pool) = allocator(0);
        let first = a.alloc(1).unwrap();
        let freed = a.alloc(2).unwrap();
        a.release_unpublished(freed, 2, RUN);
        let sibling = BlockAllocator::new(source.clone(), pool.clone(), Duration::ZERO);
        drop(sibling); // holds nothing: leaves nothing
        let mut departed = BlockAllocator::new(source.clone(), pool.clone(), Duration::ZERO);
        departed.alloc(3).unwrap();
        drop(departed); // its chunk's remainder goes to the pool
        assert!(pool.bytes() > 0);
        assert_eq!(a.instance(), Some(RUN));

        // The memnode restarted (run 2): a batch requiring run 1 was refused.
        source.1.store(2, Ordering::Relaxed);
        a.forget(RUN);
        assert_eq!((a.instance(), a.held_bytes(), pool.bytes()), (None, 0, 0));
        let fresh_start = source.0.load(Ordering::Relaxed);
        for units in [1u8, 2, 3] {
            let block = a.alloc(units).unwrap();
            assert!(
                block >= fresh_start,
                "handed out {block} from the last run's space (fresh chunks start at {fresh_start})"
            );
        }
        assert_eq!(a.instance(), Some(2));
        // A block a CAS of the old run freed is left to that run's reclaim; one of this
        // run's joins the client's space.
        a.retire(first, 1, RUN);
        assert_eq!(a.held_bytes(), 0);
        a.release_unpublished(first, 1, 2);
        assert_eq!(a.held_bytes(), 64);
    }

    #[test]
    fn a_client_that_learns_of_a_new_run_drops_the_old_space_and_so_does_the_pool() {
        let (mut a, source, pool) = allocator(0);
        let mut b = BlockAllocator::new(source.clone(), pool.clone(), Duration::ZERO);
        let old = a.alloc(4).unwrap();
        a.release_unpublished(old, 4, RUN);
        b.alloc(1).unwrap();
        drop(b);
        assert!(pool.bytes() > 0);
        // Run 2 serves now; `a` learns of it when it next needs a chunk.
        source.1.store(2, Ordering::Relaxed);
        let fresh_start = source.0.load(Ordering::Relaxed);
        for _ in 0..20 {
            let block = a.alloc(255).unwrap();
            if a.instance() == Some(2) {
                assert!(block >= fresh_start);
                break;
            }
        }
        assert_eq!(a.instance(), Some(2));
        assert!(a.alloc(4).unwrap() >= fresh_start, "reused a block of the last run");
        assert_eq!(pool.bytes(), 0, "the pool kept the last run's space");
        // A client still holding run 1 leaves it to nobody.
        let mut stale = BlockAllocator::new(source.clone(), pool.clone(), Duration::ZERO);
        stale.instance = Some(RUN);
        stale.release_unpublished(old, 4, RUN);
        drop(stale);
        assert_eq!(pool.bytes(), 0);
    }

    mod drain_all {
        use super::*;
        use proptest::prelude::*;

        /// What a stretch of heap holds when the process is done with it.
        #[derive(Debug, Clone, Copy)]
        enum Piece {
            Live(u8),
            Free(u8),
            InGrace(u8),
            /// A chunk remainder of this many units (up to a whole 64 KiB chunk).
            Remainder(u16),
        }

        fn piece() -> impl Strategy<Value = Piece> {
            prop_oneof![
                (1u8..=255).prop_map(Piece::Live),
                (1u8..=255).prop_map(Piece::Free),
                (1u8..=255).prop_map(Piece::InGrace),
                (1u16..=1024).prop_map(Piece::Remainder),
            ]
        }

        proptest! {
            /// The runs given back are exactly the maximal stretches of free space at least
            /// `min` long; every free byte is either given back or counted lost; nothing
            /// live is ever given back; the pool is left empty.
            #[test]
            fn gives_back_exactly_the_long_free_runs(
                pieces in proptest::collection::vec(piece(), 1..200),
                min_units in 1u64..600,
            ) {
                let pool = FreePool::new();
                let mut at = 1u64 << 20;
                let mut expected: Vec<(u64, u64)> = Vec::new(); // maximal free runs
                let mut free_bytes = 0;
                {
                    let mut inner = pool.inner.lock();
                    ensure_classes(&mut inner.free);
                    for p in &pieces {
                        let (bytes, free) = match *p {
                            Piece::Live(u) => (u64::from(u) * 64, false),
                            Piece::Free(u) => {
                                inner.free[u as usize].push(at);
                                (u64::from(u) * 64, true)
                            }
                            Piece::InGrace(u) => {
                                inner.pending.push_back((Instant::now(), at, u));
                                (u64::from(u) * 64, true)
                            }
                            Piece::Remainder(u) => {
                                inner.ranges.push((at, at + u64::from(u) * 64));
                                (u64::from(u) * 64, true)
                            }
                        };
                        if free {
                            free_bytes += bytes;
                            match expected.last_mut() {
                                Some(run) if run.0 + run.1 == at => run.1 += bytes,
                                _ => expected.push((at, bytes)),
                            }
                        }
                        at += bytes;
                    }
                }
                let min = min_units * 64;
                let drained = pool.drain_all(Duration::from_millis(1), min);
                let long: Vec<_> = expected.into_iter().filter(|r| r.1 >= min).collect();
                prop_assert_eq!(&drained.ranges, &long);
                prop_assert_eq!(drained.given_bytes, long.iter().map(|r| r.1).sum::<u64>());
                prop_assert_eq!(drained.given_bytes + drained.lost_bytes, free_bytes);
                prop_assert_eq!(pool.bytes(), 0);
            }
        }

        #[test]
        fn waits_out_the_grace_period_of_blocks_freed_last() {
            let (mut a, _, pool) = allocator(30);
            let block = a.alloc(4).unwrap();
            let before_retiring = Instant::now();
            a.retire(block, 4, RUN);
            drop(a);
            let drained = pool.drain_all(Duration::from_millis(30), MIN_CHUNK_BYTES);
            // The block's grace began after `before_retiring`, so it ends 30 ms after it.
            assert!(before_retiring.elapsed() >= Duration::from_millis(30), "gave back a block in its grace period");
            // The retired block and the chunk's remainder touch: one run, the whole chunk.
            assert_eq!(drained.ranges, vec![(1 << 20, 1 << 16)]);
            assert_eq!(drained.lost_bytes, 0);
        }
    }
}
