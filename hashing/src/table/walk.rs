//! Walks over a whole table with a cursor (`scan.rs` has the cursor and the argument for
//! the guarantee): [`TableClient::scan`] returns keys a piece at a time,
//! [`TableClient::delete_all`] empties the table, [`TableClient::random_key`] picks a key
//! ([`TableClient::random_keys`] a few).
//!
//! Every step reads a run of up to [`SCAN_CHUNK_BUCKETS`] buckets of the subtable at the
//! cursor's position, then its bucket 0's header (which vouches for the run's slots), then
//! acts on the slots from the cursor's slot index on: one batch of block READs (scan) or one
//! batch of CASes to 0 (delete_all).

use std::time::{Duration, Instant};

use racekv_transport::ReadId;

use super::{Attempts, TableClient};
use crate::error::Error;
use crate::hash::KeyHash;
use crate::layout::{decode_block, slot_offset, BucketHeader, Extent, Slot, BUCKET_BYTES, SLOTS_PER_BUCKET};
use crate::scan::{
    ScanLimits, ScanPage, TableCursor, SCAN_CHUNK_BUCKETS, SCAN_MAX_IDLE_STEPS, SCAN_SLOTS_PER_WANTED_KEY,
};
use crate::stall::Stamp;

/// Keys a [`TableClient::random_key`] step gathers to pick from (a step's worth of slots at
/// about half load): more keys per step spare round trips over empty stretches.
const RANDOM_KEY_CANDIDATES: usize = (SCAN_CHUNK_BUCKETS as usize * SLOTS_PER_BUCKET) / 2;

/// A run of buckets as one step read it.
struct Run {
    /// The run's headers, when they all agree with bucket 0's, read after them.
    header: Option<BucketHeader>,
    /// (slot index in the subtable, slot offset, word) of every used slot.
    used: Vec<(u64, u64, u64)>,
    /// When the run's read was sent (for the stall rule).
    sent: Stamp,
    /// Slot index just past the run.
    end: u64,
}

/// A key a scan step found: in its block, or a long key in an extent still to read.
enum FoundKey {
    Inline(Vec<u8>),
    Long(Extent),
}

impl FoundKey {
    fn len(&self) -> usize {
        match self {
            Self::Inline(key) => key.len(),
            Self::Long(extent) => extent.value_len as usize,
        }
    }
}

/// What a step's cursor should do after acting on a run.
enum Outcome {
    /// Every slot of the run was handled.
    Whole,
    /// Slots from this index on were not (a block changing under the read, a lost CAS, a
    /// limit reached).
    CutAt(u64),
}

impl TableClient {
    /// Up to about `limits.count` keys of the table, from `cursor` on (`scan.rs`: a key
    /// present from the first call of a walk to its last is returned at least once; some
    /// may be returned twice). The page's `next` is where the next call starts; None when
    /// the walk is over. A call that meets a split in progress waits briefly, and may then
    /// return fewer keys (none at all) with the cursor where it stood: call again.
    pub fn scan(&mut self, cursor: TableCursor, limits: ScanLimits) -> Result<ScanPage, Error> {
        let sample = self.begin();
        let result = self.scan_from(cursor, limits);
        self.end(6, sample, result, |_| true)
    }

    /// Removes every key of the table; returns how many slots it emptied. Not atomic: a key
    /// written while it runs may survive it (one being rewritten at every attempt is left
    /// after [`SCAN_MAX_IDLE_STEPS`] tries), and one removed is gone however it was written.
    pub fn delete_all(&mut self) -> Result<u64, Error> {
        let sample = self.begin();
        let result = self.delete_all_inner();
        self.end(7, sample, result, |_| true)
    }

    /// A key of the table, or None when it holds none: the keys of the first step that finds
    /// any, walking from a point of the table that `seed` picks, one of them by `seed`.
    /// Keys after long empty stretches come up more often than others.
    pub fn random_key(&mut self, seed: u64) -> Result<Option<Vec<u8>>, Error> {
        let limits = ScanLimits::new(RANDOM_KEY_CANDIDATES, RANDOM_KEY_CANDIDATES, usize::MAX);
        let mut keys = self.random_page(seed, limits)?;
        if keys.is_empty() {
            return Ok(None);
        }
        let pick = (seed >> 55) as usize % keys.len();
        Ok(Some(keys.swap_remove(pick)))
    }

    /// Up to `most` keys of the table (none when it holds none): the first ones from a
    /// point of the table `seed` picks. Neighbours in the table, so as random as their
    /// hashes (as Redis' `dictGetSomeKeys` takes neighbouring buckets): cache mode's
    /// eviction samples with it, reading only the blocks of the keys it returns.
    pub fn random_keys(&mut self, seed: u64, most: usize) -> Result<Vec<Vec<u8>>, Error> {
        assert!(most >= 1, "asking for no keys");
        self.random_page(seed, ScanLimits::new(most, most, usize::MAX))
    }

    /// The keys of the first step that finds any, walking from a point `seed` picks.
    fn random_page(&mut self, seed: u64, limits: ScanLimits) -> Result<Vec<Vec<u8>>, Error> {
        let total = self.shared.layout.slots_per_subtable();
        let start = TableCursor { position: TableCursor::decode(seed << 25).position, slot: (seed >> 30) % total };
        let mut cursor = start;
        let mut wrapped = false;
        let mut stuck_since: Option<Instant> = None;
        loop {
            let page = self.scan_from(cursor, limits)?;
            if !page.keys.is_empty() {
                return Ok(page.keys);
            }
            let next = match page.next {
                None if wrapped => return Ok(Vec::new()),
                None => {
                    wrapped = true;
                    TableCursor::START
                }
                Some(next) => next,
            };
            if wrapped && next >= start {
                return Ok(Vec::new()); // all the way round
            }
            self.check_moving(cursor, next, &mut stuck_since, "a random key's walk met a split that never ended")?;
            cursor = next;
        }
    }

    /// Fails once the cursor has stood still for the operation timeout (a split that never
    /// finishes: its memnode died mid-way and is not back).
    fn check_moving(
        &self,
        from: TableCursor,
        to: TableCursor,
        since: &mut Option<Instant>,
        what: &'static str,
    ) -> Result<(), Error> {
        if to != from {
            *since = None;
            return Ok(());
        }
        let started = *since.get_or_insert_with(Instant::now);
        let timeout = self.shared.options.op_timeout;
        if started.elapsed() > timeout {
            return Err(Error::Timeout { waited_ms: timeout.as_millis() as u64, what });
        }
        std::thread::sleep(Duration::from_millis(1));
        Ok(())
    }

    /// Reads buckets `first..first + n` of `subtable`, then the header of its bucket 0 again:
    /// a split claims bucket 0 before any other (`split.rs`, invariant 8), so when that
    /// header, read after the run's slots (in the same batch where a batch's READs run in
    /// order, else in a second batch), still says what the run's headers say, no bucket had
    /// been claimed for a deeper split when the slots were read.
    fn read_run(&mut self, subtable: u64, first: u64, n: u64) -> Result<Run, Error> {
        let offset = subtable + first * BUCKET_BYTES;
        let len = (n * BUCKET_BYTES) as u32;
        self.batch.clear();
        self.queue_count();
        let sent = self.shared.stall.now();
        let run_read = self.batch.read(offset, len);
        let in_order = self.conn.kind().batch_reads_in_order();
        let first_header_read = in_order.then(|| self.batch.read(subtable, 8));
        self.execute()?;
        let image = self.batch.read_result(run_read)?.to_vec();
        let first_header_read = match first_header_read {
            Some(id) => id,
            None => {
                self.batch.clear();
                let id = self.batch.read(subtable, 8);
                self.execute()?;
                id
            }
        };
        let word = |bytes: &[u8], at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let first_header = BucketHeader::decode(word(self.batch.read_result(first_header_read)?, 0));
        let bucket_bytes = BUCKET_BYTES as usize;
        let mut header = Some(first_header);
        let mut used = Vec::new();
        for b in 0..n as usize {
            if BucketHeader::decode(word(&image, b * bucket_bytes)) != first_header {
                header = None;
            }
            for j in 0..SLOTS_PER_BUCKET {
                let w = word(&image, b * bucket_bytes + 8 + j * 8);
                if Slot::decode(w).is_some() {
                    let index = (first + b as u64) * SLOTS_PER_BUCKET as u64 + j as u64;
                    used.push((index, slot_offset(offset + (b * bucket_bytes) as u64, j), w));
                }
            }
        }
        let end = (first + n) * SLOTS_PER_BUCKET as u64;
        // The run's slots, in index order, none past its end (debug: one pass over them).
        debug_assert!(
            used.windows(2).all(|w| w[0].0 < w[1].0) && used.last().is_none_or(|u| u.0 < end),
            "a run's used slots out of order or past slot {end}"
        );
        Ok(Run { header, used, sent, end })
    }

    /// The run of buckets at `cursor` (`wanted_slots` of them at most, at least one), if its
    /// headers say it is the subtable of the cursor's position and no split is moving its
    /// keys; None after refreshing the directory entry when they do not.
    fn step_run(&mut self, cursor: TableCursor, wanted_slots: u64) -> Result<Option<Run>, Error> {
        let layout = self.shared.layout;
        let bits = cursor.hash_bits();
        let cached = self.shared.directory.lookup(bits);
        if !cached.entry.is_valid(&layout) {
            self.refresh_bits(bits)?;
            return Ok(None);
        }
        let buckets = layout.buckets_per_subtable();
        let first = (cursor.slot / SLOTS_PER_BUCKET as u64).min(buckets - 1);
        let n = wanted_slots.div_ceil(SLOTS_PER_BUCKET as u64).clamp(1, SCAN_CHUNK_BUCKETS).min(buckets - first);
        assert!(n >= 1 && first + n <= buckets, "a run of {n} buckets from {first} in a subtable of {buckets}");
        let run = self.read_run(cached.entry.subtable, first, n)?;
        let vouches = run.header.is_some_and(|h| h.local_depth <= layout.max_global_depth && h.admits(bits));
        if !vouches {
            // A stale cache entry, or a split of this subtable in progress.
            self.stats.stale_directory += 1;
            self.metrics.stale.inc();
            self.refresh_bits(bits)?;
            return Ok(None);
        }
        Ok(Some(run))
    }

    fn refresh_bits(&mut self, bits: u64) -> Result<(), Error> {
        self.stats.round_trips += 1;
        self.shared.directory.refresh(&*self.conn, &mut self.batch, bits)?;
        Ok(())
    }

    /// Where the cursor goes after a step over `run` at `cursor`.
    fn advance(&self, cursor: TableCursor, run: &Run, outcome: Outcome) -> TableCursor {
        let total = self.shared.layout.slots_per_subtable();
        match outcome {
            // A cut is at a slot the step looked at: the cursor never moves back.
            Outcome::CutAt(index) => {
                assert!(
                    index >= cursor.slot && index < run.end,
                    "cut at slot {index}, outside [{}, {})",
                    cursor.slot,
                    run.end
                );
                TableCursor { slot: index, ..cursor }
            }
            Outcome::Whole if run.end >= total => {
                cursor.after_subtable(run.header.expect("a run that vouches has a header").local_depth)
            }
            Outcome::Whole => TableCursor { slot: run.end, ..cursor },
        }
    }

    fn scan_from(&mut self, mut cursor: TableCursor, limits: ScanLimits) -> Result<ScanPage, Error> {
        let groups = self.shared.layout.groups_per_subtable;
        let wanted = limits.count.min(limits.max_keys);
        let work = (wanted as u64).saturating_mul(SCAN_SLOTS_PER_WANTED_KEY);
        let mut keys: Vec<Vec<u8>> = Vec::new();
        let (mut bytes, mut examined, mut idle) = (0usize, 0u64, 0u32);
        let mut attempts = Attempts::new(Duration::MAX);
        loop {
            let full = keys.len() >= wanted || examined >= work || bytes >= limits.max_bytes;
            if cursor.is_done() || full || idle >= SCAN_MAX_IDLE_STEPS {
                return Ok(ScanPage { keys, next: (!cursor.is_done()).then_some(cursor) });
            }
            // Sized for the keys still wanted at about half load.
            let wanted_slots = 2 * (wanted - keys.len()) as u64;
            let Some(run) = self.step_run(cursor, wanted_slots)? else {
                idle += 1;
                attempts.retry("waiting for a split")?;
                continue;
            };
            let header = run.header.expect("a run that vouches has a header");
            let cands: Vec<(u64, u64, u64)> = run.used.iter().copied().filter(|&(i, _, _)| i >= cursor.slot).collect();
            self.batch.clear();
            let reads: Vec<ReadId> = cands
                .iter()
                .map(|&(_, _, word)| {
                    let slot = Slot::decode(word).expect("used slots decode");
                    self.batch.read(slot.block, slot.block_bytes() as u32)
                })
                .collect();
            if !reads.is_empty() {
                self.execute()?;
            }
            // Judge slots in order and stop at the first one that cannot be judged: its block
            // changed under the read (it will be read again).
            let mut cut = None;
            let mut judged: Vec<(u64, u64, Option<FoundKey>)> = Vec::with_capacity(cands.len());
            let now_ms = crate::clock::now_unix_ms();
            for (&(index, slot_at, word), read) in cands.iter().zip(&reads) {
                let slot = Slot::decode(word).expect("used slots decode");
                match decode_block(self.batch.read_result(*read)?) {
                    Some(block) if slot.fits_block(&block) => {
                        // An entry the header does not admit is an insert its client is
                        // about to undo (`split.rs`, invariant 6): not a key of this table.
                        // An expired one is absent, as to every other operation.
                        let admitted = header.admits(KeyHash::from_digest(block.key_digest(), groups).dir);
                        // A key a transaction holds counts as it was before: present if
                        // the lock replaced a copy (`txn.rs`).
                        let before = !slot.locked || block.txn.is_some_and(|t| t.old_word != 0);
                        let live = admitted && before && !block.expired_at(now_ms);
                        let key = match block.long_key {
                            Some(long) => FoundKey::Long(long.extent),
                            None => FoundKey::Inline(block.key.to_vec()),
                        };
                        judged.push((index, slot_at, live.then_some(key)));
                    }
                    _ => {
                        self.stats.torn_reads += 1;
                        self.metrics.torn.inc();
                        cut = Some(index);
                        break;
                    }
                }
            }
            if !judged.is_empty() && !self.shared.stall.surely_within(run.sent) {
                // Blocks read past the grace period count only where their slot still holds
                // the word that led there (`stall.rs`).
                self.count_stall();
                let slots: Vec<u64> = judged.iter().map(|&(_, slot_at, _)| slot_at).collect();
                let now = self.read_slot_words(&slots)?;
                let words = cands.iter().map(|&(_, _, word)| word);
                if let Some(k) = now.iter().zip(words).position(|(now, word)| *now != word) {
                    cut = Some(judged[k].0);
                    judged.truncate(k);
                }
            }
            let mut limited = false;
            for (index, _, key) in judged {
                let Some(key) = key else { continue };
                let cost = ScanLimits::key_cost(key.len());
                if !keys.is_empty() && (keys.len() >= limits.max_keys || bytes + cost > limits.max_bytes) {
                    cut = Some(index);
                    limited = true;
                    break;
                }
                let key = match key {
                    FoundKey::Inline(key) => key,
                    FoundKey::Long(extent) => {
                        let mut key = Vec::new();
                        if !self.read_extent(&extent, &mut key)? {
                            // Its block was retired and the extent reused since: look again.
                            cut = Some(index);
                            break;
                        }
                        key
                    }
                };
                bytes += cost;
                keys.push(key);
            }
            let from = cursor.slot.min(run.end);
            let next = self.advance(cursor, &run, cut.map_or(Outcome::Whole, Outcome::CutAt));
            examined += cut.unwrap_or(run.end).saturating_sub(from);
            if next == cursor {
                idle += 1;
                attempts.retry("a block kept changing under a scan")?;
            } else {
                idle = 0;
                attempts = Attempts::new(Duration::MAX);
            }
            cursor = next;
            if limited {
                return Ok(ScanPage { keys, next: Some(cursor) });
            }
        }
    }

    fn delete_all_inner(&mut self) -> Result<u64, Error> {
        let mut cursor = TableCursor::START;
        let mut removed = 0u64;
        // Lost CASes in a row at one slot: a key rewritten at every attempt is left.
        let mut lost_at_slot = 0u32;
        let mut stuck_since = None;
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        while !cursor.is_done() {
            let Some(run) = self.step_run(cursor, SCAN_CHUNK_BUCKETS * SLOTS_PER_BUCKET as u64)? else {
                attempts.retry("emptying the table met a split that never ended")?;
                continue;
            };
            attempts = Attempts::new(self.shared.options.op_timeout);
            // A slot a transaction holds is left to it (as a key written meanwhile).
            let cands: Vec<(u64, u64, u64)> = run
                .used
                .iter()
                .copied()
                .filter(|&(i, _, word)| i >= cursor.slot && !Slot::decode(word).is_some_and(|s| s.locked))
                .collect();
            self.batch.clear();
            self.queue_count();
            // `run.used` holds used slots only: every CAS expects a used word (debug: per slot).
            debug_assert!(cands.iter().all(|&(_, _, word)| Slot::decode(word).is_some()), "emptying an empty slot");
            let cases: Vec<_> = cands.iter().map(|&(_, slot_at, word)| self.batch.cas(slot_at, word, 0)).collect();
            if !cases.is_empty() {
                self.execute()?;
            }
            let mut lost = None;
            for (&(index, _, word), cas) in cands.iter().zip(cases) {
                if self.batch.cas_succeeded(cas)? {
                    self.retire_word(word);
                    removed += 1;
                } else if lost.is_none() {
                    // Written meanwhile, or moved by a split: read again from here.
                    lost = Some(index);
                }
            }
            let mut next = self.advance(cursor, &run, lost.map_or(Outcome::Whole, Outcome::CutAt));
            if next == cursor {
                lost_at_slot += 1;
                if lost_at_slot > SCAN_MAX_IDLE_STEPS {
                    next = TableCursor { slot: cursor.slot + 1, ..cursor };
                    lost_at_slot = 0;
                }
            } else {
                lost_at_slot = 0;
            }
            self.check_moving(cursor, next, &mut stuck_since, "emptying the table kept losing races")?;
            cursor = next;
        }
        self.publish_count()?;
        Ok(removed)
    }
}
