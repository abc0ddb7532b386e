//! The memnode's heap: subtables and KV chunks carved from the region after the directory.
//!
//! Only the memnode allocates (clients ask by RPC), and it does so through its loopback
//! connection, under one lock. The heap top and counters live in the superblock, so a
//! restarted memnode continues where it stopped.

use std::sync::Arc;

use parking_lot::Mutex;
use racekv_transport::{Batch, Connection};

use crate::directory::read_word;
use crate::error::Error;
use crate::layout::{round_up, sb, Layout};

pub struct Heap {
    conn: Arc<dyn Connection>,
    layout: Layout,
    lock: Mutex<Batch>,
}

/// What the heap holds, in bytes and counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeapUsage {
    pub heap_capacity_bytes: u64,
    pub heap_used_bytes: u64,
    pub subtables: u64,
    pub chunks: u64,
}

impl Heap {
    pub fn new(conn: Arc<dyn Connection>, layout: Layout) -> Self {
        Self { conn, layout, lock: Mutex::new(Batch::new()) }
    }

    /// Bumps the heap top by `bytes` (aligned to `align`) and counts it in `counter`.
    fn bump(&self, batch: &mut Batch, bytes: u64, align: u64, counter: u64) -> Result<u64, Error> {
        batch.clear();
        let top = batch.read(sb::HEAP_TOP, 8);
        self.conn.execute(batch)?;
        let top = read_word(batch.read_result(top)?);
        let start = round_up(top, align);
        let end = start.checked_add(bytes).filter(|&end| end <= self.layout.region_len).ok_or_else(|| {
            Error::OutOfMemory(format!(
                "region of {} B has {} B left; {bytes} B requested (grow --region-bytes)",
                self.layout.region_len,
                self.layout.region_len.saturating_sub(top)
            ))
        })?;
        batch.clear();
        let cas = batch.cas(sb::HEAP_TOP, top, end);
        batch.faa(counter, 1);
        self.conn.execute(batch)?;
        if !batch.cas_succeeded(cas)? {
            return Err(Error::Corrupt(
                "the heap top moved under the memnode's lock (two memnodes on one region?)".into(),
            ));
        }
        assert!(start >= self.layout.heap_offset && end <= self.layout.region_len);
        Ok(start)
    }

    /// Space for a new subtable (not initialized).
    pub fn alloc_subtable(&self) -> Result<u64, Error> {
        let mut batch = self.lock.lock();
        self.bump(&mut batch, self.layout.subtable_bytes(), 64, sb::SUBTABLES)
    }

    /// A chunk for a client's KV blocks: (offset, bytes).
    pub fn alloc_chunk(&self) -> Result<(u64, u64), Error> {
        let mut batch = self.lock.lock();
        let offset = self.bump(&mut batch, self.layout.chunk_bytes, 4096, sb::CHUNKS)?;
        Ok((offset, self.layout.chunk_bytes))
    }

    pub fn usage(&self) -> Result<HeapUsage, Error> {
        let mut batch = self.lock.lock();
        batch.clear();
        let top = batch.read(sb::HEAP_TOP, 8);
        let subtables = batch.read(sb::SUBTABLES, 8);
        let chunks = batch.read(sb::CHUNKS, 8);
        self.conn.execute(&mut batch)?;
        Ok(HeapUsage {
            heap_capacity_bytes: self.layout.region_len - self.layout.heap_offset,
            heap_used_bytes: read_word(batch.read_result(top)?) - self.layout.heap_offset,
            subtables: read_word(batch.read_result(subtables)?),
            chunks: read_word(batch.read_result(chunks)?),
        })
    }
}
