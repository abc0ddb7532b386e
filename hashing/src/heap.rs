//! The memnode's heap: subtables and KV chunks carved from the region after the directory.
//!
//! Only the memnode allocates (clients ask by RPC), through its loopback connection, under
//! one lock. The heap top and counters live in the superblock, so a restarted memnode
//! continues where it stopped. Chunk ranges that departing clients give back (the unused
//! tails of their chunks: no block was ever carved there, so nobody can be reading them)
//! join a free list kept inside the ranges themselves (first word: next range, second:
//! length), so it survives a restart too; new chunks come from that list before the heap
//! top moves.
//!
//! Runs shorter than a chunk (free blocks between live ones, given back by a process that
//! exits) cannot be handed out: a chunk must hold the largest block. The heap keeps them
//! in memory, merges each with the free runs beside it as they come back, and moves a run
//! that reaches [`MIN_CHUNK_BYTES`] onto the free list. They are not written down: the next
//! start finds them again, with everything else nobody references ([`crate::reclaim`]).

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use prometheus::IntCounter;
use racekv_transport::{Batch, Connection};

use crate::alloc::MIN_CHUNK_BYTES;
use crate::error::Error;
use crate::layout::{round_up, sb, Layout};
use crate::words::{read_words, write_words};

/// Fragments the heap keeps at most (about 64 MiB of memnode memory); a fragment that
/// would be one more is dropped (its bytes stay allocated to nobody) and counted.
pub const MAX_FRAGMENTS: usize = 1 << 20;

/// Free-list ranges an extent allocation looks at before it moves the heap top (each is
/// a loopback read; the list is LIFO, so recently freed extents come first).
pub const MAX_FIT_PROBES: usize = 64;

static DROPPED_FRAGMENT_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    racekv_telemetry::metric::counter(
        "racekv_memnode_heap_fragment_bytes_dropped_total",
        "Free bytes given back in runs too short to reuse, dropped because the heap held MAX_FRAGMENTS already",
    )
});

/// The memnode's heap: subtables, KV chunks, extents and free space above the directory, managed through the
/// superblock's words.
pub struct Heap {
    conn: Arc<dyn Connection>,
    layout: Layout,
    /// Also the heap's lock: every change to the superblock's words and the fragments
    /// happens while it is held.
    batch: Mutex<Batch>,
    /// Free runs shorter than a chunk (see the module doc).
    fragments: Mutex<Fragments>,
}

#[derive(Default)]
struct Fragments {
    /// start -> end
    runs: BTreeMap<u64, u64>,
    bytes: u64,
}

impl Fragments {
    /// Adds the free run [start, end) (the caller checked it overlaps none), merged with
    /// the fragments beside it. Returns the merged run when it is chunk-sized (for the free
    /// list) instead of keeping it; past [`MAX_FRAGMENTS`] a run is dropped and counted.
    fn add(&mut self, start: u64, end: u64) -> Option<(u64, u64)> {
        // Callers' checks make every run non-empty (its alignment may come from the region).
        assert!(start < end, "an empty free run at {start:#x}");
        let (merged_start, merged_end) = merge(&mut self.runs, start, end);
        assert!(merged_start <= start && end <= merged_end, "merging [{start:#x}, {end:#x}) lost part of it");
        self.bytes -= (merged_end - merged_start) - (end - start); // the neighbours merged in
        let merged = merged_end - merged_start;
        if merged >= MIN_CHUNK_BYTES {
            return Some((merged_start, merged_end));
        }
        if self.runs.len() < MAX_FRAGMENTS {
            self.runs.insert(merged_start, merged_end);
            self.bytes += merged;
        } else {
            DROPPED_FRAGMENT_BYTES.inc_by(merged);
        }
        self.check();
        None
    }

    /// Debug builds: `bytes` is what the runs hold, and the runs are disjoint, neither empty
    /// nor touching (touching ones are merged) and each shorter than a chunk. A walk over
    /// them all.
    fn check(&self) {
        debug_assert_eq!(self.bytes, self.runs.iter().map(|(s, e)| e - s).sum::<u64>(), "fragment bytes");
        debug_assert!(
            self.runs.iter().all(|(s, e)| s < e && e - s < MIN_CHUNK_BYTES)
                && self.runs.iter().zip(self.runs.iter().skip(1)).all(|((_, e), (s, _))| e < s),
            "fragments overlap, touch, or reach a chunk's size"
        );
    }
}

/// What the heap holds, in bytes and counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeapUsage {
    /// Bytes between the heap's start and the region's end.
    pub heap_capacity_bytes: u64,
    /// Handed out and not given back (subtables, and chunks clients hold).
    pub heap_used_bytes: u64,
    /// Given back and waiting for reuse.
    pub heap_free_bytes: u64,
    /// Subtables allocated so far.
    pub subtables: u64,
    /// KV chunks handed out so far.
    pub chunks: u64,
}

impl Heap {
    /// The heap of the region with `layout`, reached through `conn` (the memnode's loopback connection).
    pub fn new(conn: Arc<dyn Connection>, layout: Layout) -> Self {
        Self { conn, layout, batch: Mutex::new(Batch::new()), fragments: Mutex::new(Fragments::default()) }
    }

    fn words(&self, b: &mut Batch, offsets: &[u64]) -> Result<Vec<u64>, Error> {
        read_words(&*self.conn, b, offsets)
    }

    fn write_words(&self, b: &mut Batch, words: &[(u64, u64)]) -> Result<(), Error> {
        write_words(&*self.conn, b, words)
    }

    /// Bumps the heap top by `bytes` (aligned to `align`) and counts it in `counter`.
    fn bump(&self, b: &mut Batch, bytes: u64, align: u64, counter: u64) -> Result<u64, Error> {
        let top = self.words(b, &[sb::HEAP_TOP])?[0];
        let start = round_up(top, align);
        let end = start.checked_add(bytes).filter(|&end| end <= self.layout.region_len).ok_or_else(|| {
            Error::OutOfMemory(format!(
                "region of {} B has {} B left; {bytes} B requested (grow --region-bytes)",
                self.layout.region_len,
                self.layout.region_len.saturating_sub(top)
            ))
        })?;
        b.clear();
        let cas = b.cas(sb::HEAP_TOP, top, end);
        b.faa(counter, 1);
        self.conn.execute(b)?;
        if !b.cas_succeeded(cas)? {
            return Err(Error::Corrupt(
                "the heap top moved under the memnode's lock (two memnodes on one region?)".into(),
            ));
        }
        assert!(
            start >= self.layout.heap_offset && start.is_multiple_of(align) && end <= self.layout.region_len,
            "bumped [{start:#x}, {end:#x}) outside the heap"
        );
        Ok(start)
    }

    /// Space for a new subtable (not initialized).
    pub fn alloc_subtable(&self) -> Result<u64, Error> {
        let mut batch = self.batch.lock();
        self.bump(&mut batch, self.layout.subtable_bytes(), 64, sb::SUBTABLES)
    }

    /// A chunk for a client's KV blocks of about `preferred` bytes: (offset, bytes). Given-back
    /// ranges come first: a short one whole, a long one split (a client going away can give
    /// back hundreds of MiB in one run; handing that to one client would strand it there
    /// while the others grow the heap).
    pub fn alloc_chunk(&self, preferred: u64) -> Result<(u64, u64), Error> {
        let mut batch = self.batch.lock();
        let batch = &mut *batch;
        let bytes = round_up(preferred.clamp(MIN_CHUNK_BYTES, self.layout.chunk_bytes.max(MIN_CHUNK_BYTES)), 4096);
        if let Some((offset, free_bytes)) = self.pop_free(batch)? {
            let handed = if free_bytes >= bytes + MIN_CHUNK_BYTES {
                self.push_free(batch, offset + bytes, free_bytes - bytes)?;
                bytes
            } else {
                free_bytes
            };
            // `free_entry` checked the range: what is handed out is a whole chunk in the heap.
            assert!(
                handed >= MIN_CHUNK_BYTES
                    && handed <= free_bytes
                    && offset >= self.layout.heap_offset
                    && offset + handed <= self.layout.region_len,
                "handing out chunk ({offset:#x}, {handed} B) of a free range of {free_bytes} B"
            );
            batch.clear();
            batch.faa(sb::CHUNKS, 1);
            self.conn.execute(batch)?;
            return Ok((offset, handed));
        }
        let offset = self.bump(batch, bytes, 4096, sb::CHUNKS)?;
        Ok((offset, bytes))
    }

    /// Space for a value's extent of `bytes` (a multiple of 64): the first free-list range
    /// that holds it among the first [`MAX_FIT_PROBES`] (the rest of that range stays free),
    /// else the heap top moves.
    pub fn alloc_extent(&self, bytes: u64) -> Result<u64, Error> {
        assert!(bytes > 0 && bytes.is_multiple_of(64));
        let mut batch = self.batch.lock();
        let b = &mut *batch;
        let head = self.words(b, &[sb::FREE_CHUNKS])?[0];
        let (mut link, mut at) = (sb::FREE_CHUNKS, head);
        for _ in 0..MAX_FIT_PROBES {
            if at == 0 {
                break;
            }
            let (next, len) = self.free_entry(b, at)?;
            if len >= bytes {
                // Checked by `free_entry`: the extent lies in the heap.
                assert!(at >= self.layout.heap_offset && at + bytes <= self.layout.region_len, "extent at {at:#x}");
                let free_bytes = self.words(b, &[sb::FREE_BYTES])?[0];
                self.write_words(b, &[(sb::FREE_BYTES, free_bytes - len), (link, next)])?;
                if len > bytes {
                    let mut fragments = self.fragments.lock();
                    self.keep_free(b, &mut fragments, at + bytes, at + len)?;
                    self.write_words(b, &[(sb::FRAGMENT_BYTES, fragments.bytes)])?;
                }
                return Ok(at);
            }
            (link, at) = (at, next);
        }
        self.bump(b, bytes, 64, sb::CHUNKS)
    }

    /// Puts the free run [start, end) where it belongs: onto the free list when it (merged
    /// with the fragments beside it) is chunk-sized, else among the fragments.
    fn keep_free(&self, b: &mut Batch, fragments: &mut Fragments, start: u64, end: u64) -> Result<(), Error> {
        if let Some((start, end)) = fragments.add(start, end) {
            self.push_free(b, start, end - start)?;
        }
        Ok(())
    }

    /// The free-list range at `at`: (next, bytes), checked.
    fn free_entry(&self, b: &mut Batch, at: u64) -> Result<(u64, u64), Error> {
        let link = self.words(b, &[at, at + 8])?;
        let (next, bytes) = (link[0], link[1]);
        let sane = at >= self.layout.heap_offset
            && at.checked_add(bytes).is_some_and(|e| e <= self.layout.region_len)
            && bytes >= MIN_CHUNK_BYTES
            && (next == 0 || next >= self.layout.heap_offset);
        if !sane {
            return Err(Error::Corrupt(format!("free chunk list entry at {at} says next={next} bytes={bytes}")));
        }
        Ok((next, bytes))
    }

    /// Links the unused range (`offset`, `bytes`) into the free list (the caller checked it).
    fn push_free(&self, b: &mut Batch, offset: u64, bytes: u64) -> Result<(), Error> {
        assert!(offset.is_multiple_of(64) && bytes.is_multiple_of(64) && bytes >= MIN_CHUNK_BYTES);
        let w = self.words(b, &[sb::FREE_CHUNKS, sb::FREE_BYTES])?;
        // The range's own first words link it in; the head moves last.
        self.write_words(b, &[(offset, w[0]), (offset + 8, bytes)])?;
        self.write_words(b, &[(sb::FREE_BYTES, w[1] + bytes), (sb::FREE_CHUNKS, offset)])
    }

    /// Takes back free ranges from a client, after checking they lie in the handed-out heap
    /// and overlap no fragment it holds: chunk-sized ones onto the free list, shorter ones
    /// into the fragments, each merged with the fragments beside it.
    pub fn return_ranges(&self, ranges: &[(u64, u64)]) -> Result<(), Error> {
        let mut batch = self.batch.lock();
        let b = &mut *batch;
        let mut fragments = self.fragments.lock();
        let top = self.words(b, &[sb::HEAP_TOP])?[0];
        for &(offset, bytes) in ranges {
            let end = offset.checked_add(bytes);
            let ok = offset >= self.layout.heap_offset
                && end.is_some_and(|e| e <= top)
                && offset.is_multiple_of(64)
                && bytes.is_multiple_of(64)
                && bytes > 0;
            let overlaps = end.is_some_and(|e| overlaps(&fragments.runs, offset, e));
            if !ok || overlaps {
                return Err(Error::Remote(format!("range ({offset}, {bytes} B) is not a free range of this heap")));
            }
        }
        let mut sorted = ranges.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(Error::Remote(format!(
                "ranges ({}, {} B) and ({}, {} B) overlap",
                w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
        for &(offset, bytes) in ranges {
            self.keep_free(b, &mut fragments, offset, offset + bytes)?;
        }
        self.write_words(b, &[(sb::FRAGMENT_BYTES, fragments.bytes)])
    }

    /// Publishes the fragment bytes for clients ([`sb::FRAGMENT_BYTES`]): zero at start, as
    /// fragments live in memory.
    pub fn publish_fragment_bytes(&self) -> Result<(), Error> {
        let mut batch = self.batch.lock();
        let bytes = self.fragments.lock().bytes;
        self.write_words(&mut batch, &[(sb::FRAGMENT_BYTES, bytes)])
    }

    /// Takes fragments out, lowest addresses first, up to `most_bytes` (at least one if
    /// there is any) and [`crate::rpc::MAX_RANGES_PER_CALL`]: a client uses them as free
    /// blocks of their sizes, so space between live blocks is used again.
    pub fn take_fragments(&self, most_bytes: u64) -> Result<Vec<(u64, u64)>, Error> {
        let mut batch = self.batch.lock();
        let mut fragments = self.fragments.lock();
        let mut taken = Vec::new();
        let mut bytes = 0;
        while taken.len() < crate::rpc::MAX_RANGES_PER_CALL && (taken.is_empty() || bytes < most_bytes) {
            let Some((start, end)) = fragments.runs.pop_first() else { break };
            fragments.bytes -= end - start;
            bytes += end - start;
            taken.push((start, end - start));
        }
        fragments.check();
        self.write_words(&mut batch, &[(sb::FRAGMENT_BYTES, fragments.bytes)])?;
        Ok(taken)
    }

    /// Adds free runs found at start ([`crate::reclaim`]), merging any that touch; one that
    /// overlaps a fragment already held is dropped.
    pub fn seed_fragments(&self, saved: &[(u64, u64)]) -> Result<(), Error> {
        let mut batch = self.batch.lock();
        let mut fragments = self.fragments.lock();
        for &(offset, bytes) in saved {
            if overlaps(&fragments.runs, offset, offset + bytes) {
                tracing::warn!(offset, bytes, "dropped a saved fragment that overlaps another");
                continue;
            }
            if let Some((start, end)) = fragments.add(offset, offset + bytes) {
                self.push_free(&mut batch, start, end - start)?;
            }
        }
        self.write_words(&mut batch, &[(sb::FRAGMENT_BYTES, fragments.bytes)])
    }

    /// Bytes in free runs too short to hand out yet.
    pub fn fragment_bytes(&self) -> u64 {
        self.fragments.lock().bytes
    }

    fn pop_free(&self, b: &mut Batch) -> Result<Option<(u64, u64)>, Error> {
        let w = self.words(b, &[sb::FREE_CHUNKS, sb::FREE_BYTES])?;
        let head = w[0];
        if head == 0 {
            return Ok(None);
        }
        let (next, bytes) = self.free_entry(b, head)?;
        if bytes > w[1] {
            return Err(Error::Corrupt(format!("free chunk list entry at {head} holds {bytes} B of {} B free", w[1])));
        }
        self.write_words(b, &[(sb::FREE_BYTES, w[1] - bytes), (sb::FREE_CHUNKS, next)])?;
        Ok(Some((head, bytes)))
    }

    /// Reads the heap's capacity, used and free bytes and its allocation counts.
    pub fn usage(&self) -> Result<HeapUsage, Error> {
        let mut batch = self.batch.lock();
        let w = self.words(&mut batch, &[sb::HEAP_TOP, sb::SUBTABLES, sb::CHUNKS, sb::FREE_BYTES])?;
        let free = w[3] + self.fragment_bytes();
        Ok(HeapUsage {
            heap_capacity_bytes: self.layout.region_len - self.layout.heap_offset,
            heap_used_bytes: (w[0] - self.layout.heap_offset).saturating_sub(free),
            heap_free_bytes: free,
            subtables: w[1],
            chunks: w[2],
        })
    }
}

/// Whether [start, end) overlaps a fragment.
fn overlaps(fragments: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
    let before = fragments.range(..end).next_back();
    before.is_some_and(|(_, &e)| e > start)
}

/// Takes the fragments that touch [start, end) out of `fragments` and returns the merged run.
fn merge(fragments: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) -> (u64, u64) {
    debug_assert!(!overlaps(fragments, start, end), "merging [{start:#x}, {end:#x}) over a fragment");
    if let Some((&s, &e)) = fragments.range(..start).next_back() {
        debug_assert!(e <= start, "overlap checked by the caller");
        if e == start {
            fragments.remove(&s);
            start = s;
        }
    }
    if let Some(e) = fragments.remove(&end) {
        end = e;
    }
    (start, end)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::{merge, overlaps};

    proptest! {
        /// Fragments given back in any order merge into exactly the maximal runs they form,
        /// and overlaps are caught.
        #[test]
        fn fragments_merge_into_maximal_runs(units in proptest::collection::vec((1u64..40, any::<bool>()), 1..60), seed in any::<u64>()) {
            // Lay the pieces out; free ones are given back in a shuffled order.
            let mut at = 0u64;
            let mut free = Vec::new();
            for &(u, is_free) in &units {
                if is_free {
                    free.push((at, at + u * 64));
                }
                at += u * 64;
            }
            let mut order = free.clone();
            let mut state = seed | 1;
            for i in (1..order.len()).rev() {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                order.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let mut map = BTreeMap::new();
            for &(s, e) in &order {
                prop_assert!(!overlaps(&map, s, e));
                let (s, e) = merge(&mut map, s, e);
                map.insert(s, e);
                prop_assert!(overlaps(&map, s, e));
            }
            let mut expected: Vec<(u64, u64)> = Vec::new();
            for (s, e) in free {
                match expected.last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => expected.push((s, e)),
                }
            }
            prop_assert_eq!(map.into_iter().collect::<Vec<_>>(), expected);
        }
    }
}
