//! The client's cache of a memnode's directory.
//!
//! A snapshot holds the global depth and one word per entry. Entries are refreshed in place
//! (one atomic word) when a bucket header says the cached one is stale; when the global
//! depth grows the whole snapshot is re-read and swapped, and the old one is reclaimed by
//! crossbeam-epoch. Many workers share one cache; reads take no lock.

use std::sync::atomic::{AtomicU64, Ordering};

use racekv_transport::{Batch, Connection, MAX_OP_BYTES};

use crate::epoch_cell::EpochCell;
use crate::error::Error;
use crate::layout::{depth_mask, sb, DirEntry, Layout};
use crate::words::read_word;

struct Snapshot {
    global_depth: u32,
    entries: Box<[AtomicU64]>,
}

/// A shared, lock-free cache of the directory.
pub struct DirectoryCache {
    layout: Layout,
    snapshot: EpochCell<Snapshot>,
    refreshes: AtomicU64,
    reloads: AtomicU64,
}

/// A cached entry and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedEntry {
    /// The directory entry as cached.
    pub entry: DirEntry,
    /// Its index in the directory.
    pub index: u64,
    /// The global depth of the snapshot it was read from.
    pub global_depth: u32,
}

impl DirectoryCache {
    /// Reads the whole directory through `conn`.
    pub fn load(conn: &dyn Connection, layout: Layout) -> Result<Self, Error> {
        let snapshot = read_snapshot(conn, &layout, &mut Batch::new())?;
        Ok(Self {
            layout,
            snapshot: EpochCell::new(snapshot),
            refreshes: AtomicU64::new(0),
            reloads: AtomicU64::new(0),
        })
    }

    /// The region layout the directory belongs to.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The global depth of the cached snapshot.
    pub fn global_depth(&self) -> u32 {
        self.snapshot.read(|s| s.global_depth)
    }

    /// The cached entry for a key's directory hash.
    pub fn lookup(&self, dir_hash: u64) -> CachedEntry {
        self.snapshot.read(|s| {
            let index = dir_hash & depth_mask(s.global_depth);
            CachedEntry {
                entry: DirEntry::decode(s.entries[index as usize].load(Ordering::Acquire)),
                index,
                global_depth: s.global_depth,
            }
        })
    }

    /// Re-reads the entry for `dir_hash` (and the global depth; if that grew, the whole
    /// directory). Returns the fresh entry.
    pub fn refresh(&self, conn: &dyn Connection, batch: &mut Batch, dir_hash: u64) -> Result<CachedEntry, Error> {
        self.refreshes.fetch_add(1, Ordering::Relaxed);
        let cached = self.lookup(dir_hash);
        batch.clear();
        let gd = batch.read(sb::GLOBAL_DEPTH, 8);
        let entry = batch.read(self.layout.dir_entry_offset(cached.index), 8);
        conn.execute(batch)?;
        let global_depth = read_word(batch.read_result(gd)?) as u32;
        if global_depth > self.layout.max_global_depth || global_depth < cached.global_depth {
            return Err(Error::Corrupt(format!(
                "global depth {global_depth} read back (cached {}, max {})",
                cached.global_depth, self.layout.max_global_depth
            )));
        }
        if global_depth == cached.global_depth {
            let word = read_word(batch.read_result(entry)?);
            self.snapshot.read(|s| {
                if s.global_depth == global_depth {
                    s.entries[cached.index as usize].store(word, Ordering::Release);
                }
            });
        } else {
            self.reload(conn, batch)?;
        }
        Ok(self.lookup(dir_hash))
    }

    /// Re-reads the whole directory and swaps the snapshot.
    pub fn reload(&self, conn: &dyn Connection, batch: &mut Batch) -> Result<(), Error> {
        self.reloads.fetch_add(1, Ordering::Relaxed);
        let fresh = read_snapshot(conn, &self.layout, batch)?;
        self.snapshot.replace(fresh);
        Ok(())
    }

    /// (entry refreshes, whole reloads) so far.
    pub fn refresh_counts(&self) -> (u64, u64) {
        (self.refreshes.load(Ordering::Relaxed), self.reloads.load(Ordering::Relaxed))
    }
}

fn read_snapshot(conn: &dyn Connection, layout: &Layout, batch: &mut Batch) -> Result<Snapshot, Error> {
    let (global_depth, words) = read_directory(conn, layout, batch)?;
    let entries = words.into_iter().map(AtomicU64::new).collect();
    Ok(Snapshot { global_depth, entries })
}

/// Reads the global depth, then every entry word below it. The memnode writes entries
/// before it raises the depth, and ops in a batch run in order, so the entries read are at
/// least as new as the depth.
pub(crate) fn read_directory(
    conn: &dyn Connection,
    layout: &Layout,
    batch: &mut Batch,
) -> Result<(u32, Vec<u64>), Error> {
    batch.clear();
    let gd = batch.read(sb::GLOBAL_DEPTH, 8);
    conn.execute(batch)?;
    let global_depth = read_word(batch.read_result(gd)?) as u32;
    if global_depth > layout.max_global_depth {
        return Err(Error::Corrupt(format!(
            "global depth {global_depth} exceeds the maximum {}",
            layout.max_global_depth
        )));
    }
    let count = 1u64 << global_depth;
    let mut entries = Vec::with_capacity(count as usize);
    let per_read = MAX_OP_BYTES / 8;
    let mut next = 0u64;
    while next < count {
        let n = per_read.min(count - next);
        batch.clear();
        let r = batch.read(layout.dir_entry_offset(next), (n * 8) as u32);
        conn.execute(batch)?;
        entries.extend(batch.read_result(r)?.chunks_exact(8).map(read_word));
        next += n;
    }
    Ok((global_depth, entries))
}
