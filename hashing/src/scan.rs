//! Walking a table's keys a piece at a time with a cursor (Redis' `SCAN`), with Redis'
//! guarantee: a key present for the whole walk is returned at least once, however the table
//! splits meanwhile. This module is the cursor and its arithmetic; the walk itself is
//! `TableClient::scan` (`table/walk.rs`).
//!
//! ## The cursor
//!
//! ```text
//! table cursor (55 bits): position 30 | slot index 25
//! ```
//!
//! *Position* is a point of the hash space in Redis' reverse-binary order (dict.c's
//! `dictScan`): a key's position is the reversal of the low [`POSITION_BITS`] bits of its
//! directory hash. A subtable at local depth `LD` with suffix `s` holds the keys whose hash
//! ends in `s`, i.e. whose position *starts* with the reversal of `s`: one contiguous range
//! of `2^(30-LD)` positions. A split halves that range in place (suffix `s` keeps the lower
//! half, `s + 2^LD` takes the upper). Redis keeps the unreversed value and increments its
//! reversal (`v |= ~mask; v = rev(v); v++; v = rev(v)`); racekv keeps the reversal, so the
//! cursor only grows, and finishing a subtable is "jump to the end of its range".
//!
//! *Slot index* counts slots inside the subtable at that position (bucket * 7 + slot): a
//! call may stop inside a subtable, so a page's size is bounded by the caller, not by how
//! many keys a subtable holds. It can, because a key keeps its slot index while it
//! exists: an update swings the same slot word, and a split moves bucket b slot j of the old
//! subtable to bucket b slot j of the new one (`split.rs`, invariant 3).
//!
//! ## The guarantee
//!
//! Every step reads a run of buckets of the subtable `T` the directory cache names for the
//! cursor's position, then bucket 0's header again, after the run (in the same batch where
//! a batch's READs run in order, else in a second one). It goes on only if the run's headers
//! and that re-read all say the same (local depth `D`, suffix `s`), and `s` is the
//! position's suffix at depth `D`; otherwise it refreshes the directory entry and tries
//! again. A split of `T` CASes each bucket's header to `D + 1` before it moves anything out
//! of the bucket, and bucket 0's before any other (`split.rs`, invariants 1 and 8). So
//! bucket 0 still at `D` after the run was read means no bucket of `T` had been claimed
//! when its slots were read: every key whose hash ends in `s` at depth `D` was in its slot.
//! Keys are taken from that read (blocks checked as reads are: checksum,
//! `Slot::fits_block`, the stall rule of `stall.rs`); an entry whose hash does not end in
//! `s` is an insert its client is about to undo (`split.rs`, invariant 6) and is skipped.
//!
//! Claim: a key present for the whole walk, at position `r` and slot index `j`, is returned.
//! The position only grows and ends past `2^30`, so exactly one step moved it from some
//! `c <= r` to some `c' > r`: the step that finished a subtable `T_m` at depth `D_m`, whose
//! range contains `c` and ends at `c'`, so contains `r`. The steps at position `c` covered
//! slot indices `0..end` between them (each starts where the one before stopped; a new
//! position starts at slot index 0), step `i` in the subtable `T_i` found then, at the
//! depth `D_i` of its bucket 0. Every `T_i` contains `c`, and `D_i <= D_m`: bucket 0's depth
//! only grows, and a subtable a split makes starts at the depth that split gave its
//! parent's bucket 0. Ranges containing `c` are nested, so each `T_i`'s range
//! contains `T_m`'s, which contains `r`: the key belonged to `T_i` when step `i` read it,
//! and was in its slot `j`, which one of those steps read.
//!
//! This is why a step insists on bucket 0: without it, a step at the end of a subtable
//! whose split has claimed the first buckets but not yet these would finish the subtable
//! at the old depth, jumping past the new half the split is filling from the first ones
//! (`hashing/tests/scan.rs` replays that, and a read torn by a split).
//!
//! A key can be returned twice: one returned from a subtable's first slots moves to the new
//! half by a split and is read there again.
//!
//! What it does not cover: a key that is written again while the walk reads its bucket by
//! an upsert that missed its current copy (possible only for a writer stalled past the
//! grace period) lands in another slot of its buckets and the old copy is removed; if that
//! slot index was already passed, the walk misses the key.

use crate::layout::MAX_GLOBAL_DEPTH_LIMIT;

/// Bits of a cursor's position: the deepest directory a region can have.
pub const POSITION_BITS: u32 = MAX_GLOBAL_DEPTH_LIMIT;
/// Bits of a cursor's slot index: slots of the largest subtable (2^20 groups of 3 buckets of
/// 7 slots is 22,020,096 < 2^25).
pub const SLOT_INDEX_BITS: u32 = 25;
/// Bits of a table cursor; a session puts the memnode above them.
pub const TABLE_CURSOR_BITS: u32 = POSITION_BITS + SLOT_INDEX_BITS;

/// Positions in the hash space.
const POSITIONS: u64 = 1 << POSITION_BITS;
const SLOT_INDEX_MASK: u64 = (1 << SLOT_INDEX_BITS) - 1;

// The largest subtable's slot indices fit.
const _: () = assert!(
    (1u64 << 20) * crate::layout::BUCKETS_PER_GROUP * crate::layout::SLOTS_PER_BUCKET as u64 <= SLOT_INDEX_MASK + 1
);

/// Buckets one step reads (one batch of bucket READs, then one batch of block READs: 36
/// buckets have 252 slots, within a batch's 256 ops).
pub const SCAN_CHUNK_BUCKETS: u64 = 36;
/// A call stops once it has examined this many slots per key it was asked for, found or
/// not (Redis visits at most 10 empty buckets per key of COUNT): a sparse table costs a
/// bounded amount of work per call.
pub const SCAN_SLOTS_PER_WANTED_KEY: u64 = 10;
/// What each returned key counts against [`ScanLimits::max_bytes`] besides its bytes (room
/// for a length prefix in the reply of any front end).
pub const SCAN_KEY_OVERHEAD_BYTES: usize = 8;
/// Steps in a row a call may make without progress (a split in progress, a block changing
/// under the read) before it returns what it has with the cursor where it stands.
pub const SCAN_MAX_IDLE_STEPS: u32 = 24;

const _: () =
    assert!(SCAN_CHUNK_BUCKETS * crate::layout::SLOTS_PER_BUCKET as u64 <= racekv_transport::MAX_BATCH_OPS as u64);

/// Where a walk over one table stands (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct TableCursor {
    /// Reverse-binary position, `0..=2^30` (`2^30`: the walk is over).
    pub position: u64,
    /// Slot index within the subtable at `position`.
    pub slot: u64,
}

impl TableCursor {
    /// A new walk.
    pub const START: Self = Self { position: 0, slot: 0 };

    /// The cursor `encoded` stands for. Every value is one: bits above
    /// [`TABLE_CURSOR_BITS`] are ignored, and a slot index past a subtable's end means its end.
    pub fn decode(encoded: u64) -> Self {
        Self { position: (encoded >> SLOT_INDEX_BITS) & (POSITIONS - 1), slot: encoded & SLOT_INDEX_MASK }
    }

    /// The cursor as a number below 2^[`TABLE_CURSOR_BITS`] (0 for [`Self::START`]).
    pub fn encode(self) -> u64 {
        debug_assert!(!self.is_done());
        (self.position << SLOT_INDEX_BITS) | (self.slot & SLOT_INDEX_MASK)
    }

    /// Whether the walk has passed every position.
    pub fn is_done(self) -> bool {
        self.position >= POSITIONS
    }

    /// The directory hash bits this position stands for (its low 30 bits; the rest are 0).
    pub fn hash_bits(self) -> u64 {
        reverse_position(self.position)
    }

    /// The cursor after finishing the subtable at this position, at local depth `depth`:
    /// the first position past its range, slot index 0.
    pub fn after_subtable(self, depth: u32) -> Self {
        let span = 1u64 << (POSITION_BITS - depth.min(POSITION_BITS));
        Self { position: (self.position & !(span - 1)) + span, slot: 0 }
    }
}

/// The position of directory-hash bits `hash` (the reversal of its low 30 bits), and back:
/// the reversal is its own inverse.
pub fn reverse_position(hash: u64) -> u64 {
    u64::from((hash as u32).reverse_bits() >> (32 - POSITION_BITS))
}

/// How much one scan call may do and return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanLimits {
    /// Keys wanted (Redis' COUNT, a hint): the call stops once it has this many, or has
    /// examined [`SCAN_SLOTS_PER_WANTED_KEY`] slots per key wanted.
    pub count: usize,
    /// Most keys returned.
    pub max_keys: usize,
    /// Most bytes returned, each key counting its length plus [`SCAN_KEY_OVERHEAD_BYTES`].
    /// A single key longer than this is still returned on its own, so a walk always moves.
    pub max_bytes: usize,
}

impl ScanLimits {
    /// About `count` keys, within `max_keys` and `max_bytes`.
    pub fn new(count: usize, max_keys: usize, max_bytes: usize) -> Self {
        Self { count: count.max(1), max_keys: max_keys.max(1), max_bytes }
    }

    /// What a key costs against [`Self::max_bytes`].
    pub fn key_cost(key_len: usize) -> usize {
        key_len + SCAN_KEY_OVERHEAD_BYTES
    }
}

/// One call's keys, and where the next call starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanPage {
    /// Keys found, each once per page.
    pub keys: Vec<Vec<u8>>,
    /// None: the walk over this table is finished.
    pub next: Option<TableCursor>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::depth_mask;
    use proptest::prelude::*;

    /// Redis' dictScan step on the unreversed value, over `bits` bits, for a table of
    /// `2^depth` buckets.
    fn redis_next(v: u64, depth: u32, bits: u32) -> u64 {
        let mask = depth_mask(depth);
        let mut v = v | (!mask & depth_mask(bits));
        v = u64::from((v as u32).reverse_bits() >> (32 - bits));
        v += 1;
        u64::from((v as u32).reverse_bits() >> (32 - bits))
    }

    #[test]
    fn the_position_is_redis_reverse_binary_order() {
        // At a fixed depth, jumping subtable by subtable visits suffixes in Redis' order.
        for depth in 0..=6u32 {
            let mut ours = TableCursor::START;
            let mut redis = 0u64;
            for _ in 0..(1u64 << depth) {
                assert_eq!(ours.hash_bits() & depth_mask(depth), redis & depth_mask(depth), "depth {depth}");
                ours = ours.after_subtable(depth);
                redis = redis_next(redis, depth, POSITION_BITS);
            }
            assert!(ours.is_done(), "depth {depth}: {} subtables cover the space", 1u64 << depth);
            assert_eq!(redis, 0, "Redis' cursor wrapped to 0 as well");
        }
    }

    #[test]
    fn reversal_is_its_own_inverse_and_puts_low_bits_first() {
        assert_eq!(reverse_position(1), 1 << (POSITION_BITS - 1));
        assert_eq!(reverse_position(1 << (POSITION_BITS - 1)), 1);
        for h in [0u64, 1, 2, 3, 0x1234_5678, (1 << 30) - 1, u64::MAX] {
            assert_eq!(reverse_position(reverse_position(h)), h & ((1 << 30) - 1));
        }
    }

    #[test]
    fn encoding_round_trips_and_every_number_decodes() {
        let c = TableCursor { position: 12345, slot: 678 };
        assert_eq!(TableCursor::decode(c.encode()), c);
        assert_eq!(TableCursor::START.encode(), 0);
        let junk = TableCursor::decode(u64::MAX);
        assert!(!junk.is_done() && junk.position < POSITIONS && junk.slot <= SLOT_INDEX_MASK);
    }

    /// A model of a table that splits while a walk goes through it: subtables are suffixes
    /// at a depth, each with slots holding key ids; keys keep their slot index on splits.
    #[derive(Debug, Clone)]
    struct Model {
        /// (depth, suffix) -> slots (key hash per slot, or None).
        subtables: Vec<(u32, u64, Vec<Option<u64>>)>,
    }

    const MODEL_SLOTS: usize = 12;

    impl Model {
        fn find(&self, hash: u64) -> usize {
            self.subtables
                .iter()
                .position(|(d, s, _)| hash & depth_mask(*d) == *s)
                .expect("the subtables cover the space")
        }

        fn split(&mut self, i: usize) {
            let (depth, suffix, slots) = self.subtables[i].clone();
            if depth >= 8 {
                return;
            }
            let high = suffix | 1 << depth;
            let (stay, moved): (Vec<_>, Vec<_>) = slots
                .iter()
                .map(|s| s.filter(|h| (h >> depth) & 1 == 0))
                .zip(slots.iter().map(|s| s.filter(|h| (h >> depth) & 1 == 1)))
                .unzip();
            self.subtables[i] = (depth + 1, suffix, stay);
            self.subtables.push((depth + 1, high, moved));
        }

        /// One step of the walk as `TableClient::scan` takes it, with `n` slots at most.
        fn step(&self, cursor: TableCursor, n: u64, out: &mut Vec<u64>) -> TableCursor {
            let hash = cursor.hash_bits();
            let (depth, _, slots) = &self.subtables[self.find(hash)];
            let end = (cursor.slot + n).min(MODEL_SLOTS as u64);
            for j in cursor.slot.min(MODEL_SLOTS as u64)..end {
                if let Some(h) = slots[j as usize] {
                    out.push(h);
                }
            }
            if end == MODEL_SLOTS as u64 {
                cursor.after_subtable(*depth)
            } else {
                TableCursor { slot: end, ..cursor }
            }
        }
    }

    proptest! {
        /// The guarantee, on the model: splits between steps, keys that stay put are all
        /// returned.
        #[test]
        fn keys_present_throughout_are_returned_across_splits(
            keys in proptest::collection::vec((any::<u32>(), 0..MODEL_SLOTS), 1..60),
            script in proptest::collection::vec((1u64..8, any::<u32>(), 0u8..3), 1..80),
        ) {
            let mut model = Model { subtables: vec![(0, 0, vec![None; MODEL_SLOTS])] };
            let mut present = Vec::new();
            for (k, j) in keys {
                let h = u64::from(k) & ((1 << 30) - 1);
                let i = model.find(h);
                if model.subtables[i].2[j].is_none() {
                    model.subtables[i].2[j] = Some(h);
                    present.push(h);
                }
            }
            let mut cursor = TableCursor::START;
            let mut seen = Vec::new();
            let mut script = script.into_iter().cycle();
            let mut steps = 0;
            while !cursor.is_done() {
                let (n, pick, splits) = script.next().expect("cycled");
                for s in 0..splits {
                    let i = (pick as usize + s as usize) % model.subtables.len();
                    model.split(i);
                }
                cursor = model.step(cursor, n, &mut seen);
                steps += 1;
                prop_assert!(steps < 100_000, "the walk does not end");
            }
            for h in present {
                prop_assert!(seen.contains(&h), "key with hash {h:#x} was never returned");
            }
        }
    }
}
