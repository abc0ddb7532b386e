//! Splitting a full subtable, done by the memnode through a loopback connection of the same
//! transport (NIC atomics are atomic only against other NIC atomics).
//!
//! Invariants (design.md, and the bugs of public implementations it lists):
//! 1. A bucket's header is CASed to the new depth before its slots are read, in the same
//!    batch. A client whose CAS lands in a bucket after that sees the new header when it
//!    re-reads, and corrects itself (see `table.rs`); one whose CAS landed before is seen here.
//! 2. A move copies the slot word into the new subtable, then CASes the old slot to 0. If
//!    that CAS fails a client changed the slot: the move is redone with the new word (0
//!    included), so no update or delete is lost.
//! 3. Entries go slot for slot: bucket b slot j of the old subtable moves to bucket b slot j
//!    of the new one, which only ever receives that slot's key, so a move never needs room.
//! 4. The directory is published last; until then clients that find a changed header wait.
//! 5. A journal in the superblock names the split in progress; every step is idempotent, so
//!    a memnode restarted mid-split finishes it before serving.
//! 6. An entry that belongs to neither half (misplaced) is left where it is. It is a client's
//!    insert into a bucket split under it, which that client undoes when its re-read shows
//!    the new header; if the splitter removed it, the client's undo CAS would fail, and the
//!    client could not tell "moved for me" from "removed": an acknowledged insert would be
//!    lost. The price: a client that dies between such an insert and its undo leaves one
//!    invisible slot and block behind.
//! 7. A slot is judged by its block's key only while the slot still holds the word that
//!    pointed there, checked in a later round trip than the block's READ (the move's CAS, or
//!    a re-read for a slot that stays): a client may swing the slot meanwhile and, its grace
//!    period over, the old block may hold another key, whose fate is not this key's.
//!    A block that does not fit its slot word (the key's fingerprint and the block's size,
//!    which the writer put there) was reused: it is not judged at all, the slot is looked
//!    at again. The one-slot path (`settle_slot`), for slots that changed during their
//!    round, checks the word again only for moves (the CAS): a slot that must change again
//!    within its two round trips, with its block reused past the grace period for a key of
//!    the same fingerprint and size, is left as rare; waiting for such a slot to hold still
//!    could stall a split behind a hot key.
//! 8. Buckets are claimed in order, bucket 0 first (its CAS is the first op of the first
//!    round's batch, and a batch's ops run in order): a subtable's bucket 0 is always at
//!    least as deep as any of its buckets. A scan relies on it (`scan.rs`): bucket 0's header
//!    read after a run of buckets says whether any of them could have been claimed yet.

use std::sync::{Arc, LazyLock};
use std::time::Instant;

use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter};
use racekv_transport::{Batch, Connection, MAX_BATCH_OPS};

use crate::error::Error;
use crate::hash::KeyHash;
use crate::heap::Heap;
use crate::layout::{
    decode_block, depth_mask, parse_bucket, sb, slot_offset, BucketHeader, DirEntry, Layout, Slot, BUCKET_BYTES,
    SLOTS_PER_BUCKET,
};
use crate::rpc::SplitRequest;
use crate::words;

struct Metrics {
    splits: IntCounter,
    split_seconds: Histogram,
    moved: IntCounter,
    misplaced: IntCounter,
    doublings: IntCounter,
    slow_path: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        splits: metric::counter("racekv_split_total", "Subtable splits completed"),
        split_seconds: metric::latency_histogram("racekv_split_seconds", "Time to split one subtable"),
        moved: metric::counter("racekv_split_moved_entries_total", "Entries moved to new subtables"),
        misplaced: metric::counter(
            "racekv_split_misplaced_entries_total",
            "Entries found in a subtable they do not belong to (an insert its client is about to undo, or one \
             left by a client that died mid-insert); left in place",
        ),
        doublings: metric::counter("racekv_split_directory_doublings_total", "Times the global depth grew"),
        slow_path: metric::counter(
            "racekv_split_slot_retries_total",
            "Slots re-processed because a client changed them during the move",
        ),
    }
});

/// Buckets processed per round of batches (3 round trips per round).
const BUCKETS_PER_ROUND: u64 = 16;
/// Attempts to settle one contended slot before declaring the table corrupt.
const MAX_SLOT_ATTEMPTS: u32 = 10_000;

/// What a split request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitOutcome {
    /// Someone split it already (the client's view was stale); just refresh and retry.
    AlreadyDone,
    /// The subtable was split.
    Split {
        /// Region offset of the new subtable.
        new_subtable: u64,
        /// Local depth of both halves after the split.
        local_depth: u32,
    },
}

/// The memnode side of a split: moves half of a full subtable's keys to a new one and publishes it in the directory.
pub struct Splitter {
    conn: Arc<dyn Connection>,
    layout: Layout,
    heap: Arc<Heap>,
    /// One split at a time per memnode.
    batch: Mutex<Batch>,
}

#[derive(Clone, Copy)]
struct Job {
    old: u64,
    new: u64,
    depth: u32,
    suffix: u64,
}

enum Fate {
    Stay,
    Move,
    Misplaced,
}

impl Job {
    /// What every split's parameters satisfy, whoever made them (a request, checked against
    /// the directory; a journal, checked by `recover`): the old subtable's keys end in
    /// `suffix` at `depth` bits, and the split makes two halves at `depth + 1`.
    fn assert_sane(&self, layout: &Layout) {
        assert!(
            self.depth < layout.max_global_depth && self.suffix <= depth_mask(self.depth),
            "split of depth {} suffix {:#x} (max depth {})",
            self.depth,
            self.suffix,
            layout.max_global_depth
        );
    }

    fn fate(&self, dir_hash: u64) -> Fate {
        let fate = if dir_hash & depth_mask(self.depth) != self.suffix {
            Fate::Misplaced
        } else if (dir_hash >> self.depth) & 1 == 1 {
            Fate::Move
        } else {
            Fate::Stay
        };
        // Paired with the headers the split writes (`run`), which clients judge keys by: a
        // key moved is one the new half admits, a key kept one the old half admits, and a
        // misplaced key (invariant 6) neither. Debug only: it runs per slot.
        debug_assert!({
            let half = |suffix: u64| BucketHeader { local_depth: self.depth + 1, suffix: suffix as u32 };
            let (old, new) = (half(self.suffix).admits(dir_hash), half(self.suffix | 1 << self.depth).admits(dir_hash));
            match fate {
                Fate::Move => new && !old,
                Fate::Stay => old && !new,
                Fate::Misplaced => !old && !new,
            }
        });
        fate
    }
}

/// Registers the split metrics now, so they are exported (at zero) before the first split.
pub fn register_metrics() {
    LazyLock::force(&METRICS);
}

impl Splitter {
    /// A splitter over the memnode's loopback `conn`, taking new subtables from `heap`.
    pub fn new(conn: Arc<dyn Connection>, layout: Layout, heap: Arc<Heap>) -> Self {
        Self { conn, layout, heap, batch: Mutex::new(Batch::new()) }
    }

    fn read_words(&self, b: &mut Batch, offsets: &[u64]) -> Result<Vec<u64>, Error> {
        words::read_words(&*self.conn, b, offsets)
    }

    fn write_words(&self, b: &mut Batch, words: &[(u64, u64)]) -> Result<(), Error> {
        words::write_words(&*self.conn, b, words)
    }

    /// Splits the subtable the client saw for `req.dir_hash`, unless that already happened.
    pub fn split(&self, req: &SplitRequest) -> Result<SplitOutcome, Error> {
        self.split_until(req, u64::MAX)
    }

    /// Like [`Splitter::split`], but stops dead after `rounds` rounds of buckets, leaving the
    /// journal set and the directory locked, as a crash would. For crash-recovery tests.
    #[cfg(feature = "testing")]
    pub fn split_then_crash(&self, req: &SplitRequest, rounds: u64) -> Result<SplitOutcome, Error> {
        self.split_until(req, rounds)
    }

    fn split_until(&self, req: &SplitRequest, rounds: u64) -> Result<SplitOutcome, Error> {
        let mut b = self.batch.lock();
        let global_depth = self.read_words(&mut b, &[sb::GLOBAL_DEPTH])?[0] as u32;
        let index = req.dir_hash & depth_mask(global_depth);
        let entry = DirEntry::decode(self.read_words(&mut b, &[self.layout.dir_entry_offset(index)])?[0]);
        if entry.subtable != req.observed_subtable || entry.local_depth != req.observed_depth {
            return Ok(SplitOutcome::AlreadyDone);
        }
        if entry.locked || !entry.is_valid(&self.layout) {
            return Err(Error::Corrupt(format!("directory entry {index} is {entry:?} outside a split")));
        }
        let depth = entry.local_depth;
        if depth >= self.layout.max_global_depth {
            return Err(Error::TableFull(format!(
                "the subtable for this key is at the maximum depth {depth}; the region's directory cannot grow (use a larger region)"
            )));
        }
        let started = Instant::now();
        if depth == global_depth {
            self.double(&mut b, global_depth)?;
        }
        let new = self.heap.alloc_subtable()?;
        let job = Job { old: entry.subtable, new, depth, suffix: req.dir_hash & depth_mask(depth) };
        job.assert_sane(&self.layout);
        // The heap's contract: a fresh subtable inside the heap.
        assert!(
            new >= self.layout.heap_offset && new + self.layout.subtable_bytes() <= self.layout.region_len,
            "new subtable at {new:#x} outside the heap"
        );
        // Journal: parameters first, the state word last.
        self.write_words(
            &mut b,
            &[
                (sb::SPLIT_OLD, job.old),
                (sb::SPLIT_NEW, job.new),
                (sb::SPLIT_DEPTH, u64::from(depth)),
                (sb::SPLIT_SUFFIX, job.suffix),
            ],
        )?;
        self.write_words(&mut b, &[(sb::SPLIT_STATE, 1)])?;
        if !self.run(&mut b, job, rounds)? {
            return Ok(SplitOutcome::Split { new_subtable: new, local_depth: depth + 1 });
        }
        self.write_words(&mut b, &[(sb::SPLIT_STATE, 0)])?;
        METRICS.splits.inc();
        METRICS.split_seconds.observe(started.elapsed().as_secs_f64());
        tracing::debug!(old = job.old, new = job.new, depth, "split subtable");
        Ok(SplitOutcome::Split { new_subtable: new, local_depth: depth + 1 })
    }

    /// Finishes a split a previous run of the memnode left half done. Returns whether there was one.
    pub fn recover(&self) -> Result<bool, Error> {
        let mut b = self.batch.lock();
        let w = self
            .read_words(&mut b, &[sb::SPLIT_STATE, sb::SPLIT_OLD, sb::SPLIT_NEW, sb::SPLIT_DEPTH, sb::SPLIT_SUFFIX])?;
        match w[0] {
            0 => Ok(false),
            1 => {
                let job = Job { old: w[1], new: w[2], depth: w[3] as u32, suffix: w[4] };
                let sane = job.depth < self.layout.max_global_depth
                    && job.suffix <= depth_mask(job.depth)
                    && [job.old, job.new]
                        .iter()
                        .all(|&s| DirEntry { subtable: s, local_depth: 0, locked: false }.is_valid(&self.layout));
                if !sane {
                    return Err(Error::Corrupt(format!(
                        "split journal holds old={} new={} depth={} suffix={}",
                        job.old, job.new, job.depth, job.suffix
                    )));
                }
                tracing::warn!(
                    old = job.old,
                    new = job.new,
                    depth = job.depth,
                    "finishing a split interrupted by a crash"
                );
                self.run(&mut b, job, u64::MAX)?;
                self.write_words(&mut b, &[(sb::SPLIT_STATE, 0)])?;
                Ok(true)
            }
            other => Err(Error::Corrupt(format!("split journal state {other}"))),
        }
    }

    /// Copies directory entries [0, 2^gd) to [2^gd, 2^(gd+1)), then raises the global depth.
    fn double(&self, b: &mut Batch, global_depth: u32) -> Result<(), Error> {
        if global_depth >= self.layout.max_global_depth {
            return Err(Error::TableFull(format!("the directory is at its maximum depth {global_depth}")));
        }
        let count = 1u64 << global_depth;
        let per_round = (racekv_transport::MAX_OP_BYTES / 8).min(1 << 20);
        let mut next = 0;
        while next < count {
            let n = per_round.min(count - next);
            b.clear();
            let r = b.read(self.layout.dir_entry_offset(next), (n * 8) as u32);
            self.conn.execute(b)?;
            let entries = b.read_result(r)?.to_vec();
            b.clear();
            b.write(self.layout.dir_entry_offset(count + next), &entries);
            self.conn.execute(b)?;
            next += n;
        }
        // Every entry was copied before the depth that exposes the copies is raised.
        assert_eq!(next, count, "doubled {next} of {count} directory entries");
        self.write_words(b, &[(sb::GLOBAL_DEPTH, u64::from(global_depth + 1))])?;
        METRICS.doublings.inc();
        Ok(())
    }

    /// Directory indices that point at the subtable being split.
    fn entry_indices(&self, b: &mut Batch, job: &Job) -> Result<Vec<u64>, Error> {
        let global_depth = self.read_words(b, &[sb::GLOBAL_DEPTH])?[0] as u32;
        if global_depth <= job.depth {
            return Err(Error::Corrupt(format!("global depth {global_depth} not above the split depth {}", job.depth)));
        }
        let indices: Vec<u64> = (job.suffix..1u64 << global_depth).step_by(1 << job.depth).collect();
        // Exactly the entries whose low `depth` bits are the suffix: 2^(global - depth).
        assert_eq!(indices.len() as u64, 1 << (global_depth - job.depth), "entries of a depth-{} subtable", job.depth);
        debug_assert!(
            indices.iter().all(|&i| i & depth_mask(job.depth) == job.suffix),
            "an entry outside suffix {:#x}",
            job.suffix
        );
        Ok(indices)
    }

    /// Runs (or re-runs) a split. Returns false if it stopped after `rounds` (tests only).
    fn run(&self, b: &mut Batch, job: Job, rounds: u64) -> Result<bool, Error> {
        job.assert_sane(&self.layout);
        let buckets = self.layout.buckets_per_subtable();
        let new_header =
            BucketHeader { local_depth: job.depth + 1, suffix: (job.suffix | 1 << job.depth) as u32 }.encode();
        let old_before = BucketHeader { local_depth: job.depth, suffix: job.suffix as u32 }.encode();
        let old_after = BucketHeader { local_depth: job.depth + 1, suffix: job.suffix as u32 }.encode();
        // The halves: both one deeper, suffixes the old one with the new bit clear (old) or
        // set (new); and the claim CAS (invariant 1) really changes the header.
        debug_assert!({
            let (new, after) = (BucketHeader::decode(new_header), BucketHeader::decode(old_after));
            new.local_depth == job.depth + 1
                && after.local_depth == job.depth + 1
                && u64::from(new.suffix) == job.suffix | 1 << job.depth
                && u64::from(after.suffix) == job.suffix
        });
        assert_ne!(old_before, old_after, "claiming a bucket must change its header");

        // The new subtable's headers (its slots are zero, or hold copies from a crashed run).
        let headers: Vec<_> = (0..buckets).map(|i| (job.new + i * BUCKET_BYTES, new_header)).collect();
        self.write_words(b, &headers)?;

        // Lock the entries that point at the old subtable.
        let indices = self.entry_indices(b, &job)?;
        let locked: Vec<_> = indices
            .iter()
            .map(|&i| {
                (
                    self.layout.dir_entry_offset(i),
                    DirEntry { subtable: job.old, local_depth: job.depth, locked: true }.encode(),
                )
            })
            .collect();
        self.write_words(b, &locked)?;

        let mut first = 0;
        let mut round = 0;
        while first < buckets {
            if round == rounds {
                return Ok(false);
            }
            let n = BUCKETS_PER_ROUND.min(buckets - first);
            self.split_buckets(b, &job, first, n, old_before, old_after)?;
            first += n;
            round += 1;
        }
        // Invariant 4: the directory is published last, after every bucket was split.
        assert_eq!(first, buckets, "publishing a split after {first} of {buckets} buckets");

        // Publish: the halves at depth + 1, unlocked.
        let published: Vec<_> = indices
            .iter()
            .map(|&i| {
                let subtable = if (i >> job.depth) & 1 == 1 { job.new } else { job.old };
                (
                    self.layout.dir_entry_offset(i),
                    DirEntry { subtable, local_depth: job.depth + 1, locked: false }.encode(),
                )
            })
            .collect();
        // The entries that pointed at the old subtable, half to each half (debug: one pass).
        debug_assert_eq!(
            indices.iter().filter(|&&i| (i >> job.depth) & 1 == 1).count() * 2,
            indices.len(),
            "a split's entries not shared evenly between its halves"
        );
        self.write_words(b, &published)?;
        Ok(true)
    }

    fn split_buckets(
        &self,
        b: &mut Batch,
        job: &Job,
        first: u64,
        n: u64,
        old_before: u64,
        old_after: u64,
    ) -> Result<(), Error> {
        // Round 1: claim each bucket for the new depth, then read its slots (in that order).
        b.clear();
        let mut reads = Vec::with_capacity(n as usize);
        for i in first..first + n {
            let bucket = job.old + i * BUCKET_BYTES;
            // Invariants 1 and 8: each bucket's claim right before its read, bucket 0's the
            // batch's first op.
            assert_eq!(b.len() as u64, 2 * (i - first), "bucket {i}'s claim out of order");
            let cas = b.cas(bucket, old_before, old_after);
            reads.push((i, cas, b.read(bucket, BUCKET_BYTES as u32)));
        }
        self.conn.execute(b)?;
        let mut occupied = Vec::new();
        for &(i, cas, read) in &reads {
            let old = b.result(cas)?;
            if old != old_before && old != old_after {
                return Err(Error::Corrupt(format!(
                    "bucket {i} of subtable {} has header {old:#x} during a split",
                    job.old
                )));
            }
            let (_, slots) = parse_bucket(b.read_result(read)?);
            for (j, &word) in slots.iter().enumerate() {
                if let Some(slot) = Slot::decode(word) {
                    occupied.push((i, j, word, slot));
                }
            }
        }
        if occupied.is_empty() {
            return Ok(());
        }
        // Round 2: read the blocks to learn each key's hash.
        b.clear();
        let blocks: Vec<_> =
            occupied.iter().map(|&(_, _, _, slot)| b.read(slot.block, slot.block_bytes() as u32)).collect();
        self.conn.execute(b)?;
        let mut moves = Vec::new();
        // Slots judged to stay (misplaced: true for entries of neither half).
        let mut kept = Vec::new();
        let mut slow = Vec::new();
        for (k, &(i, j, word, slot)) in occupied.iter().enumerate() {
            let old_slot = slot_offset(job.old + i * BUCKET_BYTES, j);
            let new_slot = slot_offset(job.new + i * BUCKET_BYTES, j);
            // Invariant 3: slot for slot.
            debug_assert_eq!(old_slot - job.old, new_slot - job.new, "slot {j} of bucket {i} moves elsewhere");
            match decode_block(b.read_result(blocks[k])?) {
                // Torn, or reused for a block its slot word was not written for.
                None => slow.push((old_slot, new_slot)),
                Some(block) if !slot.fits_block(&block) => slow.push((old_slot, new_slot)),
                Some(block) => {
                    match job.fate(KeyHash::from_digest(block.key_digest(), self.layout.groups_per_subtable).dir) {
                        Fate::Stay => kept.push((old_slot, new_slot, word, false)),
                        Fate::Move => moves.push((old_slot, new_slot, word)),
                        Fate::Misplaced => kept.push((old_slot, new_slot, word, true)),
                    }
                }
            }
        }
        // Round 3: copy, then clear the old slot; and read each kept slot again (at most
        // 2 x 112 ops per round). A block is only known to be the slot's key while the slot
        // still holds the word that led to it: a client may have swung the slot since round
        // 1 and, its grace period over, the old block may hold any key now. The CAS checks
        // that for a move, the re-read (a later round trip than the block's) for the others.
        b.clear();
        let mut cases = Vec::new();
        for &(old_slot, new_slot, word) in &moves {
            // Invariant 2: the copy before the CAS that clears the old slot, in one batch;
            // the word moved is the one judged (invariant 7), never an empty one.
            debug_assert!(Slot::decode(word).is_some(), "moving empty word {word:#x} from {old_slot:#x}");
            b.write(new_slot, &word.to_le_bytes());
            cases.push((b.cas(old_slot, word, 0), old_slot, new_slot));
        }
        let rereads: Vec<_> = kept.iter().map(|&(old_slot, ..)| b.read(old_slot, 8)).collect();
        assert!(b.len() <= MAX_BATCH_OPS, "round 3 of a split holds {} ops", b.len());
        self.conn.execute(b)?;
        for (cas, old_slot, new_slot) in cases {
            if b.cas_succeeded(cas)? {
                METRICS.moved.inc();
            } else {
                // A client changed the slot meanwhile: judge its new word on the slow path.
                slow.push((old_slot, new_slot));
            }
        }
        for (&(old_slot, new_slot, word, misplaced), read) in kept.iter().zip(rereads) {
            if words::read_word(b.read_result(read)?) != word {
                slow.push((old_slot, new_slot));
            } else if misplaced {
                METRICS.misplaced.inc();
            }
        }
        for (old_slot, new_slot) in slow {
            self.settle_slot(b, job, old_slot, new_slot)?;
        }
        Ok(())
    }

    /// Moves one slot that clients are changing, one round trip at a time, until its fate
    /// is settled: the new subtable's copy of the slot ends equal to what belongs there.
    fn settle_slot(&self, b: &mut Batch, job: &Job, old_slot: u64, new_slot: u64) -> Result<(), Error> {
        METRICS.slow_path.inc();
        for _ in 0..MAX_SLOT_ATTEMPTS {
            let word = self.read_words(b, &[old_slot])?[0];
            let Some(slot) = Slot::decode(word) else {
                return self.write_words(b, &[(new_slot, 0)]);
            };
            b.clear();
            let r = b.read(slot.block, slot.block_bytes() as u32);
            self.conn.execute(b)?;
            let Some(block) = decode_block(b.read_result(r)?).filter(|block| slot.fits_block(block)) else {
                continue; // the slot changed and its old block was reused: look again
            };
            match job.fate(KeyHash::from_digest(block.key_digest(), self.layout.groups_per_subtable).dir) {
                // Not re-checked here as round 3 does: under hot updates the slot may never
                // hold still for three round trips, and a split must finish (see the note on
                // invariant 7).
                Fate::Stay => return self.write_words(b, &[(new_slot, 0)]),
                Fate::Misplaced => {
                    METRICS.misplaced.inc();
                    return self.write_words(b, &[(new_slot, 0)]);
                }
                Fate::Move => {
                    debug_assert_eq!(old_slot - job.old, new_slot - job.new, "invariant 3: slot for slot");
                    b.clear();
                    b.write(new_slot, &word.to_le_bytes());
                    let cas = b.cas(old_slot, word, 0);
                    self.conn.execute(b)?;
                    if b.cas_succeeded(cas)? {
                        METRICS.moved.inc();
                        return Ok(());
                    }
                }
            }
        }
        Err(Error::Corrupt(format!("slot at {old_slot} kept changing for {MAX_SLOT_ATTEMPTS} attempts during a split")))
    }
}

// Round 1 of a round issues two ops per bucket (claim, read), round 2 one per slot, round 3
// up to two per slot.
const _: () = assert!(BUCKETS_PER_ROUND as usize * 2 <= MAX_BATCH_OPS);
const _: () = assert!(BUCKETS_PER_ROUND as usize * SLOTS_PER_BUCKET * 2 <= MAX_BATCH_OPS);
