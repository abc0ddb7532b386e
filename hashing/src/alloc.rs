//! Client-side allocation of KV blocks.
//!
//! Blocks come from heap chunks the memnode hands out (one RPC per chunk), carved in 64 B
//! units. A block a client replaces or deletes is freed into a grace queue first: it may be
//! reused only after `grace_period`, longer than any operation that could still be reading
//! it. (Readers also verify key and checksum, so a late reader that finds another key's
//! block re-reads. One that finds the block reused for a newer write of the same key returns
//! that value, possibly before the write's CAS, which a conditional write may then lose: a
//! read stalled for longer than the grace period between its bucket and block reads. The
//! grace period keeps that rare and protects CAS from ABA.)
//!
//! Each client has its own lists (no locks on the hot path). A client that goes away hands
//! its lists and the rest of its chunk to the [`FreePool`] it shares with its siblings.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::Error;
use crate::layout::{BLOCK_UNIT_BYTES, MAX_BLOCK_UNITS};

/// Where chunks come from (the memnode, through its RPC).
pub trait ChunkSource: Send + Sync {
    /// A heap chunk of about `preferred` bytes: (offset, bytes). Offsets and sizes are
    /// multiples of 64 and at least [`MIN_CHUNK_BYTES`]; the size may differ from the wish.
    fn chunk(&self, preferred: u64) -> Result<(u64, u64), Error>;
    /// Hands unused ranges back (a client going away). Best effort.
    fn give_back(&self, ranges: &[(u64, u64)]) {
        let _ = ranges;
    }
    /// Free runs shorter than a chunk, up to about `most_bytes`, each to be used as one
    /// free block of its size (at most [`MAX_BLOCK_UNITS`] units). Best effort.
    fn fragments(&self, most_bytes: u64) -> Vec<(u64, u64)> {
        let _ = most_bytes;
        Vec::new()
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
    free: Vec<Vec<u64>>,
    pending: VecDeque<(Instant, u64, u8)>,
    ranges: Vec<(u64, u64)>,
}

/// Free blocks and chunk remainders left by clients that went away.
#[derive(Default)]
pub struct FreePool {
    inner: Mutex<PoolInner>,
}

impl FreePool {
    pub fn new() -> Self {
        Self::default()
    }

    fn take_blocks(&self, units: u8, out: &mut Vec<u64>, grace: Duration) -> bool {
        let mut inner = self.inner.lock();
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

    fn take_range(&self) -> Option<(u64, u64)> {
        self.inner.lock().ranges.pop()
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
        let mut pieces: Vec<(u64, u64)> = inner.ranges.drain(..).collect();
        for (units, list) in inner.free.iter_mut().enumerate() {
            pieces.extend(list.drain(..).map(|b| (b, b + units as u64 * BLOCK_UNIT_BYTES)));
        }
        pieces.extend(inner.pending.drain(..).map(|(_, b, u)| (b, b + u64::from(u) * BLOCK_UNIT_BYTES)));
        pieces.sort_unstable();
        let mut drained = Drained::default();
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
    /// Runs to give back to the memnode: (offset, bytes).
    pub ranges: Vec<(u64, u64)>,
    pub given_bytes: u64,
    /// Free bytes not given back (runs under the minimum; overlapping pieces).
    pub lost_bytes: u64,
}

fn ensure_classes(free: &mut Vec<Vec<u64>>) {
    if free.len() < CLASSES {
        free.resize_with(CLASSES, Vec::new);
    }
}

/// One client's allocator.
pub struct BlockAllocator {
    source: Arc<dyn ChunkSource>,
    pool: Arc<FreePool>,
    grace: Duration,
    /// Size to ask for next time.
    next_request: u64,
    cursor: u64,
    end: u64,
    free: Vec<Vec<u64>>,
    pending: VecDeque<(Instant, u64, u8)>,
    /// Bytes in `free` and `pending`, for statistics.
    held_bytes: u64,
}

impl BlockAllocator {
    pub fn new(source: Arc<dyn ChunkSource>, pool: Arc<FreePool>, grace: Duration) -> Self {
        let mut free = Vec::new();
        ensure_classes(&mut free);
        Self {
            source,
            pool,
            grace,
            next_request: FIRST_CHUNK_BYTES,
            cursor: 0,
            end: 0,
            free,
            pending: VecDeque::new(),
            held_bytes: 0,
        }
    }

    /// A block of `units` x 64 B.
    pub fn alloc(&mut self, units: u8) -> Result<u64, Error> {
        assert!(units >= 1, "blocks are at least one unit");
        self.reclaim(Instant::now());
        if let Some(block) = self.free[units as usize].pop() {
            self.held_bytes -= u64::from(units) * BLOCK_UNIT_BYTES;
            return Ok(block);
        }
        let mut refill = std::mem::take(&mut self.free[units as usize]);
        let refilled = self.pool.take_blocks(units, &mut refill, self.grace);
        self.free[units as usize] = refill;
        if refilled {
            let block = self.free[units as usize].pop().expect("refilled");
            self.held_bytes += (self.free[units as usize].len() as u64) * u64::from(units) * BLOCK_UNIT_BYTES;
            return Ok(block);
        }
        let bytes = u64::from(units) * BLOCK_UNIT_BYTES;
        if self.end - self.cursor < bytes {
            // Space between other clients' live blocks first (one round trip per chunk's
            // worth of allocations, not one per allocation).
            self.take_fragments(units);
            if let Some(block) = self.free[units as usize].pop() {
                self.held_bytes -= bytes;
                return Ok(block);
            }
            self.next_chunk()?;
        }
        let block = self.cursor;
        self.cursor += bytes;
        debug_assert!(self.cursor <= self.end);
        Ok(block)
    }

    fn next_chunk(&mut self) -> Result<(), Error> {
        // Keep the remainder of the old chunk as one free block (it is under 255 units).
        let rest = self.end - self.cursor;
        if rest >= BLOCK_UNIT_BYTES {
            let units = (rest / BLOCK_UNIT_BYTES).min(MAX_BLOCK_UNITS);
            self.free[units as usize].push(self.cursor);
            self.held_bytes += units * BLOCK_UNIT_BYTES;
        }
        let (start, end) = match self.pool.take_range() {
            Some(range) => range,
            None => {
                let (offset, bytes) = self.source.chunk(self.next_request)?;
                assert!(
                    offset % BLOCK_UNIT_BYTES == 0
                        && bytes % BLOCK_UNIT_BYTES == 0
                        && bytes >= MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES
                );
                self.next_request = self.next_request.saturating_mul(2);
                (offset, offset + bytes)
            }
        };
        self.cursor = start;
        self.end = end;
        Ok(())
    }

    /// Takes fragments from the source and cuts each into blocks of `units` (the size being
    /// asked for: key-value sizes tend to repeat), the rest of it one block of its own size.
    fn take_fragments(&mut self, units: u8) {
        let want = u64::from(units) * BLOCK_UNIT_BYTES;
        for (offset, bytes) in self.source.fragments(FRAGMENT_INTAKE_BYTES) {
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
                at += want;
            }
            if at < end {
                self.free[((end - at) / BLOCK_UNIT_BYTES) as usize].push(at);
            }
            self.held_bytes += bytes;
        }
    }

    /// Makes sure a chunk is at hand, so the next allocation makes no RPC (for clients
    /// prepared ahead of need).
    pub fn reserve(&mut self) -> Result<(), Error> {
        if self.end - self.cursor < MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES {
            self.next_chunk()?;
        }
        Ok(())
    }

    /// Frees a block other clients may still be reading: reusable after the grace period.
    pub fn retire(&mut self, block: u64, units: u8) {
        self.pending.push_back((Instant::now(), block, units));
        self.held_bytes += u64::from(units) * BLOCK_UNIT_BYTES;
    }

    /// Frees a block that was never published (no slot ever pointed to it): reusable now.
    pub fn release_unpublished(&mut self, block: u64, units: u8) {
        self.free[units as usize].push(block);
        self.held_bytes += u64::from(units) * BLOCK_UNIT_BYTES;
    }

    fn reclaim(&mut self, now: Instant) {
        while let Some(&(at, block, units)) = self.pending.front() {
            if now.duration_since(at) < self.grace {
                break;
            }
            self.pending.pop_front();
            self.free[units as usize].push(block);
        }
    }

    /// Bytes this client holds free or in grace.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }
}

impl Drop for BlockAllocator {
    fn drop(&mut self) {
        let mut inner = self.pool.inner.lock();
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

    struct Bump(AtomicU64);
    impl ChunkSource for Bump {
        fn chunk(&self, _preferred: u64) -> Result<(u64, u64), Error> {
            Ok((self.0.fetch_add(1 << 16, Ordering::Relaxed), 1 << 16))
        }
    }

    fn allocator(grace_ms: u64) -> (BlockAllocator, Arc<Bump>, Arc<FreePool>) {
        let source = Arc::new(Bump(AtomicU64::new(1 << 20)));
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
        a.retire(b, 2);
        assert_ne!(a.alloc(2).unwrap(), b, "reused inside the grace period");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(a.alloc(2).unwrap(), b, "not reused after the grace period");
        let u = a.alloc(3).unwrap();
        a.release_unpublished(u, 3);
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
            a.retire(old, 1);
        }
        assert_eq!(source.0.load(Ordering::Relaxed), chunks_before, "memory grew under a steady update load");
    }

    #[test]
    fn a_departing_client_leaves_its_memory_to_the_pool() {
        let (mut a, source, pool) = allocator(0);
        let block = a.alloc(4).unwrap();
        a.release_unpublished(block, 4);
        drop(a);
        let mut b = BlockAllocator::new(source, pool.clone(), Duration::ZERO);
        assert_eq!(b.alloc(4).unwrap(), block);
        assert!(pool.bytes() > 0, "the first client's chunk remainder went missing");
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
            a.retire(block, 4);
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
