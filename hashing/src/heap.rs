//! The memnode's heap: subtables and KV chunks carved from the region after the directory.
//!
//! Only the memnode allocates (clients ask by RPC), through its loopback connection, under
//! one lock. The heap top and counters live in the superblock, so a restarted memnode
//! continues where it stopped. Chunk ranges that departing clients give back (the unused
//! tails of their chunks: no block was ever carved there, so nobody can be reading them)
//! join a free list kept inside the ranges themselves (first word: next range, second:
//! length), so it survives a restart too; new chunks come from that list before the heap
//! top moves.

use std::sync::Arc;

use parking_lot::Mutex;
use racekv_transport::{Batch, Connection};

use crate::alloc::MIN_CHUNK_BYTES;
use crate::directory::read_word;
use crate::error::Error;
use crate::layout::{round_up, sb, Layout};

pub struct Heap {
    conn: Arc<dyn Connection>,
    layout: Layout,
    batch: Mutex<Batch>,
}

/// What the heap holds, in bytes and counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeapUsage {
    pub heap_capacity_bytes: u64,
    /// Handed out and not given back (subtables, and chunks clients hold).
    pub heap_used_bytes: u64,
    /// Given back and waiting for reuse.
    pub heap_free_bytes: u64,
    pub subtables: u64,
    pub chunks: u64,
}

impl Heap {
    pub fn new(conn: Arc<dyn Connection>, layout: Layout) -> Self {
        Self { conn, layout, batch: Mutex::new(Batch::new()) }
    }

    fn words(&self, b: &mut Batch, offsets: &[u64]) -> Result<Vec<u64>, Error> {
        b.clear();
        let ids: Vec<_> = offsets.iter().map(|&o| b.read(o, 8)).collect();
        self.conn.execute(b)?;
        ids.into_iter().map(|id| Ok(read_word(b.read_result(id)?))).collect()
    }

    fn write_words(&self, b: &mut Batch, words: &[(u64, u64)]) -> Result<(), Error> {
        b.clear();
        for &(offset, value) in words {
            b.write(offset, &value.to_le_bytes());
        }
        self.conn.execute(b)?;
        Ok(())
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
        assert!(start >= self.layout.heap_offset && end <= self.layout.region_len);
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
            batch.clear();
            batch.faa(sb::CHUNKS, 1);
            self.conn.execute(batch)?;
            return Ok((offset, handed));
        }
        let offset = self.bump(batch, bytes, 4096, sb::CHUNKS)?;
        Ok((offset, bytes))
    }

    /// Links the unused range (`offset`, `bytes`) into the free list (the caller checked it).
    fn push_free(&self, b: &mut Batch, offset: u64, bytes: u64) -> Result<(), Error> {
        assert!(offset.is_multiple_of(64) && bytes.is_multiple_of(64) && bytes >= MIN_CHUNK_BYTES);
        let w = self.words(b, &[sb::FREE_CHUNKS, sb::FREE_BYTES])?;
        // The range's own first words link it in; the head moves last.
        self.write_words(b, &[(offset, w[0]), (offset + 8, bytes)])?;
        self.write_words(b, &[(sb::FREE_BYTES, w[1] + bytes), (sb::FREE_CHUNKS, offset)])
    }

    /// Takes back unused chunk ranges from a client, after checking they lie in the handed-
    /// out heap, onto the free list.
    pub fn return_ranges(&self, ranges: &[(u64, u64)]) -> Result<(), Error> {
        let mut batch = self.batch.lock();
        let b = &mut *batch;
        let top = self.words(b, &[sb::HEAP_TOP])?[0];
        for &(offset, bytes) in ranges {
            let end = offset.checked_add(bytes);
            let ok = offset >= self.layout.heap_offset
                && end.is_some_and(|e| e <= top)
                && offset % 64 == 0
                && bytes % 64 == 0
                && bytes >= MIN_CHUNK_BYTES;
            if !ok {
                return Err(Error::Remote(format!(
                    "range ({offset}, {bytes} B) is not an unused chunk range of this heap"
                )));
            }
        }
        for &(offset, bytes) in ranges {
            self.push_free(b, offset, bytes)?;
        }
        Ok(())
    }

    fn pop_free(&self, b: &mut Batch) -> Result<Option<(u64, u64)>, Error> {
        let w = self.words(b, &[sb::FREE_CHUNKS, sb::FREE_BYTES])?;
        let head = w[0];
        if head == 0 {
            return Ok(None);
        }
        let link = self.words(b, &[head, head + 8])?;
        let (next, bytes) = (link[0], link[1]);
        let sane = head >= self.layout.heap_offset
            && head.checked_add(bytes).is_some_and(|e| e <= self.layout.region_len)
            && bytes >= MIN_CHUNK_BYTES
            && bytes <= w[1]
            && (next == 0 || next >= self.layout.heap_offset);
        if !sane {
            return Err(Error::Corrupt(format!("free chunk list entry at {head} says next={next} bytes={bytes}")));
        }
        self.write_words(b, &[(sb::FREE_BYTES, w[1] - bytes), (sb::FREE_CHUNKS, next)])?;
        Ok(Some((head, bytes)))
    }

    pub fn usage(&self) -> Result<HeapUsage, Error> {
        let mut batch = self.batch.lock();
        let w = self.words(&mut batch, &[sb::HEAP_TOP, sb::SUBTABLES, sb::CHUNKS, sb::FREE_BYTES])?;
        let free = w[3];
        Ok(HeapUsage {
            heap_capacity_bytes: self.layout.region_len - self.layout.heap_offset,
            heap_used_bytes: (w[0] - self.layout.heap_offset).saturating_sub(free),
            heap_free_bytes: free,
            subtables: w[1],
            chunks: w[2],
        })
    }
}
