//! Catching a memnode up on a partition (issue 17: rejoin and re-replication). The map
//! first names the memnode as *joining* the partition (`racekv_coord::map`): from then on
//! every write of the partition's keys goes to it too, like a backup's, while reads stay on
//! the primary and failover never promotes it. Then [`Session::catch_up`] copies what was
//! there before: each key of the partition on the primary is synced ([`Session::sync_key`]:
//! its item on the primary written to every memnode of its write set, in one replicated
//! write, so ordered with every other write of the key by the primary's lock), and each key
//! of the partition the joiner holds but the primary does not (a stale copy from before it
//! failed) is removed the same way. Then the map makes the joiner a replica.
//!
//! Why no write is missed: at R > 1 every write is a one-key transaction, a partition down
//! to its primary's too (`PartitionTable::locks_writes`). A writer routing by a map without
//! the joiner either placed its primary's lock before the primary served the joining map
//! (the copier starts only after that, and its read of the key waits for the lock, so its
//! sync copies that write), or after: its commit's epoch check (`map_fence`) sees the newer
//! map before the commit point, so it aborts, showing nothing, and runs again by that map.
//! A plain upsert would show on the primary at once, and its writer failing before it
//! copied the key (`write_unreplicated`) would leave the joiner without it: so only R = 1
//! maps use them, and a change of R from 1 while writers still route by the R = 1 map has
//! that gap (ARCHITECTURE.md, "Catch-up").

use std::time::{Duration, Instant};

use racekv_hashing::{ScanLimits, TableCursor};

use crate::error::ClientError;
use crate::replicated::Change;
use crate::session::{Session, Shards};

/// How often a catch-up looks whether the primary serves its map yet.
const SERVED_EPOCH_POLL: Duration = Duration::from_millis(10);
/// Keys asked for per scan page of a catch-up.
const CATCH_UP_PAGE_KEYS: usize = 256;
/// Most bytes of keys per scan page of a catch-up.
const CATCH_UP_PAGE_BYTES: usize = 1 << 20;

/// Where a catch-up copies from: a primary, and which of its keys (those of the joined
/// partitions it is primary of).
pub struct CatchUpSource<'a> {
    /// The primary's node id.
    pub primary: u64,
    /// Whether a key is one to copy.
    pub belongs: &'a dyn Fn(&[u8]) -> bool,
}

/// What a catch-up did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Keys of the partition copied from the primary to every memnode of their write set.
    pub synced: u64,
    /// Keys the joiner held that the primary does not: removed from it.
    pub removed: u64,
}

impl<S: Shards> Session<S> {
    /// Writes `key`'s item on its primary (or its absence) to every memnode its writes go
    /// to, as one replicated write. Nothing to do when the key has no other replica.
    pub fn sync_key(&mut self, key: &[u8]) -> Result<(), ClientError> {
        self.shards_mut().refresh_routing();
        if self.shards().backups(key).is_empty() {
            return Ok(());
        }
        self.write_replicated(key, |item| {
            let change = match item {
                Some(item) => Change::Put(item.value.into(), item.expires_at_ms),
                None => Change::Delete,
            };
            (Some(change), ())
        })
    }

    /// Copies the keys each source picks from its memnode (`sources`: a primary's node id
    /// and which of its keys belong to the partitions it is primary of that `joiner` joins)
    /// to every memnode of their write sets, the joining one included, and removes those
    /// that memnode `joiner` holds and their source does not. Each table is walked once,
    /// however many partitions it serves. `progress` hears of each key handled. Routes by
    /// map `epoch` (the one that names `joiner` as joining) or newer, and copies from each
    /// source once it serves that map, waiting for both (bounded by the timeout).
    pub fn catch_up(
        &mut self,
        epoch: u64,
        joiner: u64,
        sources: &[CatchUpSource<'_>],
        progress: &mut dyn FnMut(u64),
    ) -> Result<CatchUp, ClientError> {
        if !self.shards_mut().await_map(epoch) {
            return Err(ClientError::Config(format!("no cluster map of epoch {epoch} or newer came to route by")));
        }
        let to = self.shard_for(joiner)?;
        // The joiner too: a purge of its stale copies notices the join from then on
        // (`moves.rs`).
        self.await_served_epoch(to, epoch)?;
        let mut from = Vec::with_capacity(sources.len());
        for source in sources {
            let shard = self.shard_for(source.primary)?;
            assert_ne!(shard, to, "a memnode catching up from itself");
            self.await_served_epoch(shard, epoch)?;
            from.push(shard);
        }
        let mut done = CatchUp::default();
        for (source, &shard) in sources.iter().zip(&from) {
            self.each_key(shard, source.belongs, |s, key| {
                s.sync_key(key)?;
                done.synced += 1;
                progress(1);
                Ok(())
            })?;
        }
        let source_of = |key: &[u8]| sources.iter().zip(&from).find(|(source, _)| (source.belongs)(key));
        self.each_key(to, &|key| source_of(key).is_some(), |s, key| {
            let (_, &shard) = source_of(key).expect("the walk keeps only keys of a source");
            if s.on(shard, |c| c.get(key))?.is_none() {
                s.sync_key(key)?;
                done.removed += 1;
            }
            progress(1);
            Ok(())
        })?;
        // The joiner's item count includes its copies before the map counts it a replica
        // (DBSIZE is exact again the moment R is).
        self.publish_counts()?;
        Ok(done)
    }

    /// The shard of memnode `node`.
    pub(crate) fn shard_for(&self, node: u64) -> Result<usize, ClientError> {
        self.shard_of_node(node)
            .ok_or_else(|| ClientError::Config(format!("memnode {node:#x} is not one this client reaches")))
    }

    /// Waits (bounded by the timeout) until memnode `shard` serves map `epoch` or newer:
    /// writers by older maps notice the joiner from then on.
    pub(crate) fn await_served_epoch(&mut self, shard: usize, epoch: u64) -> Result<(), ClientError> {
        let deadline = Instant::now() + self.shards().timeout();
        while self.on(shard, |c| c.map_epoch())? < epoch {
            if Instant::now() >= deadline {
                let endpoint = self.shards().label(shard).to_string();
                return Err(ClientError::Timeout { endpoint, after: self.shards().timeout() });
            }
            std::thread::sleep(SERVED_EPOCH_POLL);
        }
        Ok(())
    }

    /// Runs `each` on every key of memnode `shard`'s table that `belongs` picks (a walk:
    /// keys present throughout are seen at least once).
    pub(crate) fn each_key<F>(
        &mut self,
        shard: usize,
        belongs: &dyn Fn(&[u8]) -> bool,
        mut each: F,
    ) -> Result<(), ClientError>
    where
        F: FnMut(&mut Self, &[u8]) -> Result<(), ClientError>,
    {
        let limits = ScanLimits::new(CATCH_UP_PAGE_KEYS, CATCH_UP_PAGE_KEYS, CATCH_UP_PAGE_BYTES);
        let mut cursor = TableCursor::START;
        loop {
            let page = self.on(shard, |c| c.scan(cursor, limits))?;
            for key in page.keys.iter().filter(|k| belongs(k)) {
                each(self, key)?;
            }
            match page.next {
                Some(next) => cursor = next,
                None => return Ok(()),
            }
        }
    }
}
