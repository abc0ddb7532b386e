//! The memnode's start-time reclaim: every heap byte that no slot references becomes free.
//!
//! Clients carve blocks out of their chunks and keep their own free lists, so while a
//! memnode runs it cannot tell which bytes of a chunk a process that died was holding: a
//! crashed process leaks its free space, and the fragments a memnode keeps in memory die
//! with the memnode. When a memnode starts, though, nobody holds anything: heap space
//! belongs to one run of the memnode, and clients drop what they hold from an earlier run
//! instead of using it (`alloc::Chunk`, `Batch::require_instance`). So the live heap is
//! exactly the subtables the directory reaches and the blocks their slots point to;
//! everything else below the heap top is free. [`reclaim`] marks the live bytes in a bitmap
//! (one bit per 64 B unit: 2 MiB per GiB of heap) and rebuilds the free space from the
//! gaps: runs of a chunk or more onto the free list, a run at the top cut off the top,
//! shorter runs returned as fragments for the heap to keep.
//!
//! It only reads the table, and writes free space and superblock words, so a crash midway
//! leaves nothing that a second attempt cannot redo from scratch. Run it before serving and
//! after a journaled split finished.

use racekv_transport::{Batch, Connection, MAX_OP_BYTES};

use crate::alloc::MIN_CHUNK_BYTES;
use crate::directory::read_directory;
use crate::error::Error;
use crate::layout::{decode_block, parse_bucket, sb, DirEntry, Layout, Slot, BLOCK_UNIT_BYTES, BUCKET_BYTES};
use crate::words::{read_words, write_words};

/// What [`reclaim`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Distinct subtables the directory reaches.
    pub subtables: u64,
    /// Slots pointing to blocks (a block two slots share counts twice).
    pub live_blocks: u64,
    /// Bytes below the heap top that subtables and blocks use.
    pub live_bytes: u64,
    /// Slots whose block lies outside the heap (corrupt): left as they are.
    pub bad_slots: u64,
    /// Live value extents (offset, bytes), for the memnode's [`crate::extents::Extents`].
    pub extents: Vec<(u64, u64)>,
    /// Indirect blocks that did not decode, or whose extent lies outside the heap: their
    /// extents (if any) cannot be known and may be reused.
    pub bad_extents: u64,
    /// The heap's top (next free byte) before the reclaim.
    pub heap_top_before: u64,
    /// The heap's top after it (lowered past free space at the end).
    pub heap_top_after: u64,
    /// Bytes put on the free list (runs of at least [`MIN_CHUNK_BYTES`]).
    pub free_list_bytes: u64,
    /// Shorter free runs, (offset, bytes), for the heap to keep as fragments.
    pub fragments: Vec<(u64, u64)>,
    /// Bytes in `fragments`.
    pub fragment_bytes: u64,
}

impl Reclaimed {
    /// Every free byte found: the free list, the fragments and the tail cut off the top.
    pub fn free_bytes(&self) -> u64 {
        self.free_list_bytes + self.fragment_bytes + (self.heap_top_before - self.heap_top_after)
    }
}

/// Rebuilds the heap's free space from what the table references (see the module doc).
/// Call it while nothing else uses the region.
pub fn reclaim(conn: &dyn Connection, layout: &Layout) -> Result<Reclaimed, Error> {
    let mut b = Batch::new();
    let w = read_words(conn, &mut b, &[sb::HEAP_TOP, sb::SPLIT_STATE, sb::NODE_ID])?;
    let (top, split_state, node_id) = (w[0], w[1], w[2]);
    if split_state != 0 {
        return Err(Error::Corrupt("a split is still in progress: finish it before reclaiming".into()));
    }
    let heap = layout.heap_offset;
    if top < heap
        || top > layout.region_len
        || !top.is_multiple_of(BLOCK_UNIT_BYTES)
        || !heap.is_multiple_of(BLOCK_UNIT_BYTES)
    {
        return Err(Error::Corrupt(format!("heap top {top} is outside the heap [{heap}, {}]", layout.region_len)));
    }
    let mut live = UnitMap::new(heap, top);
    let mut found = Reclaimed { heap_top_before: top, ..Reclaimed::default() };

    // The subtables the directory reaches. A bad entry means we cannot know what is live:
    // refuse rather than free someone's data.
    let mut subtables = Vec::new();
    for word in read_directory(conn, layout, &mut b)?.1 {
        let entry = DirEntry::decode(word);
        if !entry.is_valid(layout) || entry.subtable + layout.subtable_bytes() > top {
            return Err(Error::Corrupt(format!("directory entry {entry:?} is not a subtable of the heap")));
        }
        subtables.push(entry.subtable);
    }
    subtables.sort_unstable();
    subtables.dedup();
    found.subtables = subtables.len() as u64;

    let mut indirect = Vec::new();
    let mut locked = Vec::new();
    for &subtable in &subtables {
        live.mark(subtable, layout.subtable_bytes());
        read_pieces(conn, &mut b, subtable, layout.subtable_bytes(), |bytes| {
            for bucket in bytes.chunks_exact(BUCKET_BYTES as usize) {
                for word in parse_bucket(bucket).1 {
                    let Some(slot) = Slot::decode(word) else { continue };
                    if slot.block < heap || slot.block + slot.block_bytes() > top {
                        found.bad_slots += 1;
                        continue;
                    }
                    live.mark(slot.block, slot.block_bytes());
                    found.live_blocks += 1;
                    if slot.indirect {
                        indirect.push(slot);
                    }
                    if slot.locked {
                        locked.push(slot);
                    }
                }
            }
            Ok(())
        })?;
    }
    if found.bad_slots > 0 {
        tracing::error!(bad_slots = found.bad_slots, "slots point outside the heap; left as they are");
    }
    // A locked slot keeps two more things alive (`table::txn`): the block its lock replaced
    // (an abort puts it back) and, for a transaction's lock on this memnode, its record.
    let mut records = Vec::new();
    for_each_block(conn, &mut b, &locked, |block| {
        let Some(mark) = block.and_then(|block| block.txn) else { return };
        if let Some((_, offset)) = mark
            .record()
            .filter(|&(node, offset)| node == node_id && offset >= heap && offset + BLOCK_UNIT_BYTES <= top)
        {
            records.push(offset);
        }
        let Some(old) = Slot::decode(mark.old_word) else { return };
        if old.block >= heap && old.block + old.block_bytes() <= top {
            live.mark(old.block, old.block_bytes());
            found.live_blocks += 1;
            if old.indirect {
                indirect.push(old);
            }
        }
    })?;
    // A record's size is in its header word (a home record lists its participants).
    records.sort_unstable();
    records.dedup();
    for chunk in records.chunks(racekv_transport::MAX_BATCH_OPS) {
        let headers = crate::words::read_words(conn, &mut b, &chunk.iter().map(|r| r + 8).collect::<Vec<_>>())?;
        for (&record, header) in chunk.iter().zip(headers) {
            let units = crate::table::txn::record_units(header).unwrap_or(1);
            let bytes = (u64::from(units) * BLOCK_UNIT_BYTES).min(top - record);
            live.mark(record, bytes);
        }
    }
    // The extents the indirect blocks point to (a block shared by two slots, as in a
    // duplicate, names its extent twice: kept once).
    indirect.sort_unstable_by_key(|s| s.block);
    indirect.dedup_by_key(|s| s.block);
    for_each_block(conn, &mut b, &indirect, |block| {
        let Some(block) = block.filter(|block| block.extent.is_some()) else {
            found.bad_extents += 1;
            return;
        };
        for e in block.extents() {
            if e.offset >= heap && e.offset + e.bytes() <= top {
                live.mark(e.offset, e.bytes());
                found.extents.push((e.offset, e.bytes()));
            } else {
                found.bad_extents += 1;
            }
        }
    })?;
    if found.bad_extents > 0 {
        tracing::error!(bad_extents = found.bad_extents, "indirect blocks with no readable extent");
    }

    let mut runs = live.free_runs();
    found.live_bytes = (top - heap) - runs.iter().map(|r| r.1 - r.0).sum::<u64>();
    found.heap_top_after = match runs.last() {
        Some(&(start, end)) if end == top => {
            runs.pop();
            start
        }
        _ => top,
    };
    let (chunks, fragments): (Vec<_>, Vec<_>) = runs.into_iter().partition(|r| r.1 - r.0 >= MIN_CHUNK_BYTES);
    found.fragments = fragments.into_iter().map(|(s, e)| (s, e - s)).collect();
    found.fragment_bytes = found.fragments.iter().map(|f| f.1).sum();
    found.free_list_bytes = chunks.iter().map(|r| r.1 - r.0).sum();

    // The old list is dropped first, so a crash from here on leaves an empty list (and the
    // next start reclaims again), never half of one.
    write_words(conn, &mut b, &[(sb::FREE_CHUNKS, 0), (sb::FREE_BYTES, 0), (sb::FRAGMENT_LIST, 0)])?;
    let links: Vec<(u64, u64)> = chunks
        .iter()
        .enumerate()
        .flat_map(|(i, &(start, end))| [(start, chunks.get(i + 1).map_or(0, |next| next.0)), (start + 8, end - start)])
        .collect();
    write_words(conn, &mut b, &links)?;
    write_words(
        conn,
        &mut b,
        &[
            (sb::HEAP_TOP, found.heap_top_after),
            (sb::CHUNKS, 0),
            (sb::FREE_BYTES, found.free_list_bytes),
            (sb::FREE_CHUNKS, chunks.first().map_or(0, |c| c.0)),
        ],
    )?;
    Ok(found)
}

/// Reads the blocks `slots` point to, a batch at a time, giving `f` each one decoded (None:
/// not a valid block).
fn for_each_block(
    conn: &dyn Connection,
    b: &mut Batch,
    slots: &[Slot],
    mut f: impl FnMut(Option<crate::layout::Block<'_>>),
) -> Result<(), Error> {
    for group in slots.chunks(racekv_transport::MAX_BATCH_OPS) {
        b.clear();
        let reads: Vec<_> = group.iter().map(|s| b.read(s.block, s.block_bytes() as u32)).collect();
        conn.execute(b)?;
        for read in reads {
            f(decode_block(b.read_result(read)?));
        }
    }
    Ok(())
}

/// Reads [offset, offset + len) in pieces a batch can carry, giving `f` each piece.
fn read_pieces(
    conn: &dyn Connection,
    b: &mut Batch,
    offset: u64,
    len: u64,
    mut f: impl FnMut(&[u8]) -> Result<(), Error>,
) -> Result<(), Error> {
    // Whole buckets per piece.
    let piece = MAX_OP_BYTES - MAX_OP_BYTES % BUCKET_BYTES;
    let mut at = offset;
    while at < offset + len {
        let n = piece.min(offset + len - at);
        b.clear();
        let r = b.read(at, n as u32);
        conn.execute(b)?;
        f(b.read_result(r)?)?;
        at += n;
    }
    Ok(())
}

/// One bit per 64 B unit of [start, end): set where something lives.
struct UnitMap {
    start: u64,
    units: u64,
    bits: Vec<u64>,
}

impl UnitMap {
    fn new(start: u64, end: u64) -> Self {
        let units = (end - start) / BLOCK_UNIT_BYTES;
        Self { start, units, bits: vec![0; units.div_ceil(64) as usize] }
    }

    /// Marks [offset, offset + bytes) live (the caller checked it lies inside).
    fn mark(&mut self, offset: u64, bytes: u64) {
        let first = (offset - self.start) / BLOCK_UNIT_BYTES;
        let end = (offset + bytes - self.start).div_ceil(BLOCK_UNIT_BYTES);
        assert!(first <= end && end <= self.units, "marking [{offset}, +{bytes}) outside the map");
        let mut unit = first;
        while unit < end {
            let (word, bit) = ((unit / 64) as usize, unit % 64);
            let n = (64 - bit).min(end - unit);
            let mask = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << bit };
            self.bits[word] |= mask;
            unit += n;
        }
    }

    /// The first unit at or after `from` that is live (`live`) or free (!`live`); `units`
    /// if there is none.
    fn next(&self, from: u64, live: bool) -> u64 {
        let flip = if live { 0 } else { u64::MAX };
        let mut index = (from / 64) as usize;
        let mut word = (self.bits[index] ^ flip) & (u64::MAX << (from % 64));
        loop {
            if word != 0 {
                return (index as u64 * 64 + u64::from(word.trailing_zeros())).min(self.units);
            }
            index += 1;
            if index == self.bits.len() {
                return self.units;
            }
            word = self.bits[index] ^ flip;
        }
    }

    /// The maximal unmarked runs, (start, end) in region offsets, in address order.
    fn free_runs(&self) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut unit = 0;
        while unit < self.units {
            let begin = self.next(unit, false);
            if begin == self.units {
                break;
            }
            unit = self.next(begin, true);
            runs.push((self.start + begin * BLOCK_UNIT_BYTES, self.start + unit * BLOCK_UNIT_BYTES));
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::UnitMap;
    use proptest::prelude::*;

    proptest! {
        /// The free runs are exactly the maximal stretches no mark covers.
        #[test]
        fn free_runs_are_the_gaps_between_marks(units in 1u64..400, marks in proptest::collection::vec((0u64..400, 1u64..150), 0..40)) {
            let start = 4096u64;
            let mut map = UnitMap::new(start, start + units * 64);
            let mut live = vec![false; units as usize];
            for &(at, len) in &marks {
                let at = at % units;
                let len = len.min(units - at);
                if len == 0 { continue; }
                map.mark(start + at * 64, len * 64);
                live[at as usize..(at + len) as usize].iter_mut().for_each(|l| *l = true);
            }
            let mut expected = Vec::new();
            let mut u = 0;
            while u < units as usize {
                if live[u] { u += 1; continue; }
                let b = u;
                while u < units as usize && !live[u] { u += 1; }
                expected.push((start + b as u64 * 64, start + u as u64 * 64));
            }
            prop_assert_eq!(map.free_runs(), expected);
        }
    }
}
