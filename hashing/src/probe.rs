//! What one READ of a key's two combined buckets shows: four buckets with their headers.
//!
//! A bucket is read word by word, header first, so a split can change the header and move
//! a slot between those loads: the header seen first would vouch for slots it no longer
//! governs. So every probe re-reads the four headers *after* the slots, in the same batch,
//! and judges with those. The splitter CASes a bucket's header before it touches the
//! bucket's slots, so a header read after the slots covers them: a key the split keeps
//! never moves, and a key it moves no longer matches the header.

use racekv_transport::{Batch, OpError, ReadId};

use crate::layout::{
    parse_bucket, slot_offset, BucketHeader, CombinedBucket, Slot, BUCKET_BYTES, COMBINED_BUCKET_BYTES,
    SLOTS_PER_BUCKET,
};

/// The reads of one probe, queued in a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeReads {
    cbs: [CombinedBucket; 2],
    buckets: [ReadId; 2],
    headers: [ReadId; 4],
}

impl ProbeReads {
    /// Queues the two combined buckets, then their four headers again.
    pub fn queue(batch: &mut Batch, cbs: [CombinedBucket; 2]) -> Self {
        let buckets = cbs.map(|cb| batch.read(cb.offset, COMBINED_BUCKET_BYTES as u32));
        let headers =
            [cbs[0].bucket(0), cbs[0].bucket(1), cbs[1].bucket(0), cbs[1].bucket(1)].map(|b| batch.read(b, 8));
        Self { cbs, buckets, headers }
    }

    /// The probe, once the batch ran.
    pub fn parse(&self, batch: &Batch) -> Result<Probe, OpError> {
        let mut probe =
            Probe::parse(&self.cbs, batch.read_result(self.buckets[0])?, batch.read_result(self.buckets[1])?);
        for (bucket, id) in probe.buckets.iter_mut().zip(self.headers) {
            let word = u64::from_le_bytes(batch.read_result(id)?.try_into().expect("an 8-byte read"));
            bucket.header = BucketHeader::decode(word);
        }
        Ok(probe)
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbedBucket {
    pub offset: u64,
    pub header: BucketHeader,
    pub slots: [u64; SLOTS_PER_BUCKET],
}

/// The four buckets of a key, in read order: combined bucket 0 (two buckets), then 1.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probe {
    pub buckets: [ProbedBucket; 4],
    /// Index (0..4) of each combined bucket's main bucket.
    mains: [usize; 2],
}

impl Probe {
    fn parse(cbs: &[CombinedBucket; 2], first: &[u8], second: &[u8]) -> Self {
        let bucket = |cb: &CombinedBucket, bytes: &[u8], i: usize| {
            let (header, slots) = parse_bucket(&bytes[i * BUCKET_BYTES as usize..(i + 1) * BUCKET_BYTES as usize]);
            ProbedBucket { offset: cb.bucket(i), header, slots }
        };
        Self {
            buckets: [
                bucket(&cbs[0], first, 0),
                bucket(&cbs[0], first, 1),
                bucket(&cbs[1], second, 0),
                bucket(&cbs[1], second, 1),
            ],
            mains: [cbs[0].main_index(), 2 + cbs[1].main_index()],
        }
    }

    /// Whether every bucket still holds keys like this one (else the directory cache is stale
    /// or a split is moving them).
    pub fn admits(&self, dir_hash: u64) -> bool {
        self.buckets.iter().all(|b| b.header.admits(dir_hash))
    }

    /// Whether the bucket holding `slot` admits the key.
    pub fn admits_slot(&self, slot: u64, dir_hash: u64) -> bool {
        self.buckets
            .iter()
            .find(|b| (b.offset..b.offset + BUCKET_BYTES).contains(&slot))
            .is_some_and(|b| b.header.admits(dir_hash))
    }

    /// The word of `slot` if it lies in one of these buckets.
    pub fn word_at(&self, slot: u64) -> Option<u64> {
        let b = self.buckets.iter().find(|b| (b.offset + 8..b.offset + BUCKET_BYTES).contains(&slot))?;
        Some(b.slots[((slot - b.offset - 8) / 8) as usize])
    }

    /// (slot offset, word) of every used slot whose fingerprint matches.
    pub fn candidates(&self, fingerprint: u8, out: &mut Vec<(u64, u64)>) {
        out.clear();
        for b in &self.buckets {
            for (j, &word) in b.slots.iter().enumerate() {
                if Slot::decode(word).is_some_and(|s| s.fingerprint == fingerprint) {
                    out.push((slot_offset(b.offset, j), word));
                }
            }
        }
    }

    /// A free slot for an insert: in the emptier combined bucket, main bucket first.
    pub fn free_slot(&self) -> Option<u64> {
        let used = |range: std::ops::Range<usize>| {
            self.buckets[range].iter().flat_map(|b| b.slots).filter(|&w| w != 0).count()
        };
        let first = if used(0..2) <= used(2..4) { 0 } else { 1 };
        for cb in [first, 1 - first] {
            let main = self.mains[cb];
            let overflow = if main.is_multiple_of(2) { main + 1 } else { main - 1 };
            for index in [main, overflow] {
                let b = &self.buckets[index];
                if let Some(j) = b.slots.iter().position(|&w| w == 0) {
                    return Some(slot_offset(b.offset, j));
                }
            }
        }
        None
    }
}
