//! Where a key lives: on a fixed consistent-hashing ring of memnodes (no coordinator), or in
//! a partition of the cluster map (issue 17), whose primary memnode serves it. A map's
//! routing is replaced whole when a newer map arrives, while sessions keep routing: readers
//! never wait (arc-swap).

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::ring::{key_hash, Ring};

pub use racekv_coord::map::MAX_PARTITIONS;

/// One cluster map's routing: per partition, the shards (a session's memnode indexes) of
/// its replica set, the primary first. A key's partition is its [`key_hash`] modulo the
/// partition count; its primary serves reads, and writes go to every replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionTable {
    epoch: u64,
    primary_shards: Vec<u16>,
    /// Per partition, its replicas after the primary (empty boxes, no allocation, at R = 1).
    backup_shards: Vec<Box<[u16]>>,
    /// How many replicas every partition has, when they all have as many.
    uniform_copies: Option<usize>,
    /// The map's replication factor R (the most replicas a partition has, at least).
    replicas: usize,
    /// Per shard, (partitions it is primary of, partitions it holds).
    held: Vec<(u32, u32)>,
    /// Replicated writes go by the snapshot protocol (the map's `snapshot_writes`).
    snapshot_writes: bool,
}

impl PartitionTable {
    /// The routing of map `epoch` whose partition `p` has its only replica on shard
    /// `primary_shards[p]`, over `shard_count` shards (see [`PartitionTable::replicated`]).
    pub fn new(epoch: u64, primary_shards: &[usize], shard_count: usize) -> Result<Self, String> {
        let sets: Vec<Vec<usize>> = primary_shards.iter().map(|&s| vec![s]).collect();
        Self::replicated(epoch, &sets, shard_count)
    }

    /// The routing of map `epoch` whose partition `p` lives on shards `replica_shards[p]`
    /// (the primary first), over `shard_count` shards. Refuses an empty table, more than
    /// [`MAX_PARTITIONS`], an empty replica set or one naming a shard twice, and a shard out
    /// of range.
    pub fn replicated(epoch: u64, replica_shards: &[Vec<usize>], shard_count: usize) -> Result<Self, String> {
        if replica_shards.is_empty() || replica_shards.len() > MAX_PARTITIONS {
            return Err(format!("{} partitions (1 to {MAX_PARTITIONS})", replica_shards.len()));
        }
        if shard_count > usize::from(u16::MAX) {
            return Err(format!("{shard_count} memnodes (at most {})", u16::MAX));
        }
        for (p, set) in replica_shards.iter().enumerate() {
            if set.is_empty() {
                return Err(format!("partition {p} has no replica"));
            }
            if let Some(&s) = set.iter().find(|&&s| s >= shard_count) {
                return Err(format!("partition {p} routes to memnode #{s} of {shard_count}"));
            }
            if (1..set.len()).any(|i| set[..i].contains(&set[i])) {
                return Err(format!("partition {p} names a memnode twice in its replica set"));
            }
        }
        let primary_shards = replica_shards.iter().map(|set| set[0] as u16).collect();
        let backup_shards = replica_shards.iter().map(|set| set[1..].iter().map(|&s| s as u16).collect()).collect();
        let first = replica_shards[0].len();
        let uniform_copies = replica_shards.iter().all(|set| set.len() == first).then_some(first);
        let mut held = vec![(0u32, 0u32); shard_count];
        for set in replica_shards {
            held[set[0]].0 += 1;
            set.iter().for_each(|&s| held[s].1 += 1);
        }
        let replicas = replica_shards.iter().map(Vec::len).max().unwrap_or(1);
        Ok(Self { epoch, primary_shards, backup_shards, uniform_copies, replicas, held, snapshot_writes: false })
    }

    /// The same routing, of a map whose replication factor is `replicas` (a partition
    /// below it has lost a memnode and is re-replicated later).
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = self.replicas.max(replicas);
        self
    }

    /// The same routing, its replicated writes by the snapshot protocol or not.
    pub fn with_snapshot_writes(mut self, snapshot_writes: bool) -> Self {
        self.snapshot_writes = snapshot_writes;
        self
    }

    /// Whether replicated writes go by the snapshot protocol (`snapshot_write.rs`).
    pub fn snapshot_writes(&self) -> bool {
        self.snapshot_writes
    }

    /// The map epoch this routing came from.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many partitions.
    pub fn partitions(&self) -> usize {
        self.primary_shards.len()
    }

    /// The partition of `key`.
    pub fn partition(&self, key: &[u8]) -> usize {
        (key_hash(key) % self.primary_shards.len() as u64) as usize
    }

    /// The shard that serves `key`.
    pub fn shard(&self, key: &[u8]) -> usize {
        usize::from(self.primary_shards[self.partition(key)])
    }

    /// The shards of `key`'s other replicas (empty at R = 1).
    pub fn backups(&self, key: &[u8]) -> &[u16] {
        &self.backup_shards[self.partition(key)]
    }

    /// Whether writes of `key` go through its primary's lock (a one-key transaction,
    /// `replicated.rs`): when its partition has other replicas, and at R > 1 when it has
    /// lost them too. A partition below R gets a memnode joining it next (`catchup.rs`),
    /// and a write by a map older than that join must not show on the primary unless the
    /// copier, or the epoch check before its commit point, can see it: a plain upsert is
    /// visible at once, and the joiner would miss it if its writer failed before copying it.
    pub fn locks_writes(&self, key: &[u8]) -> bool {
        self.replicas > 1 || !self.backups(key).is_empty()
    }

    /// Whether `shard` holds any partition.
    pub fn serves(&self, shard: usize) -> bool {
        self.held.get(shard).is_some_and(|&(_, held)| held > 0)
    }

    /// The share of `shard`'s items that counting keys counts, as (numerator,
    /// denominator): with R replicas of every partition each key is on R memnodes, so
    /// 1/R, exactly; while partitions have different replica counts (a failed memnode's,
    /// until they are re-replicated) the share of its partitions it is primary of, which
    /// assumes keys spread evenly over partitions (they do by hash, not exactly). A shard
    /// holding no partition counts none.
    pub fn item_share(&self, shard: usize) -> (u64, u64) {
        match (self.uniform_copies, self.held.get(shard)) {
            // A memnode holding nothing (failed over, drained) counts nothing: what it
            // keeps is stale.
            (_, None | Some(&(_, 0))) => (0, 1),
            (Some(r), _) => (1, r as u64),
            (None, Some(&(primary, held))) => (u64::from(primary), u64::from(held)),
        }
    }
}

/// How a set of sessions routes keys (see the module's comment).
#[derive(Debug)]
pub enum Placement {
    /// A fixed ring over the memnodes' node ids.
    Ring(Ring),
    /// The cluster map's partitions; [`Placement::install`] replaces them.
    Partitions(ArcSwap<PartitionTable>),
}

impl Placement {
    /// Routing by the partitions of one map.
    pub fn partitions(table: PartitionTable) -> Self {
        Self::Partitions(ArcSwap::from_pointee(table))
    }

    /// The shard that serves `key`.
    pub fn shard(&self, key: &[u8]) -> usize {
        match self {
            Self::Ring(ring) => ring.shard(key),
            Self::Partitions(table) => table.load().shard(key),
        }
    }

    /// The epoch of the map routed by (None: a fixed ring).
    pub fn epoch(&self) -> Option<u64> {
        match self {
            Self::Ring(_) => None,
            Self::Partitions(table) => Some(table.load().epoch),
        }
    }

    /// The partitions routed by now (None: a fixed ring).
    pub fn table(&self) -> Option<Arc<PartitionTable>> {
        match self {
            Self::Ring(_) => None,
            Self::Partitions(table) => Some(table.load_full()),
        }
    }

    /// Routes by `table` from now on. Refused on a fixed ring, and for a table not newer
    /// than the current one (maps only move forward; a watch may deliver one twice).
    pub fn install(&self, table: PartitionTable) -> Result<(), String> {
        let Self::Partitions(current) = self else {
            return Err("this placement is a fixed ring, not a cluster map".into());
        };
        let mut refused = None;
        let table = Arc::new(table);
        current.rcu(|old| {
            if old.epoch >= table.epoch {
                refused = Some(old.epoch);
                Arc::clone(old)
            } else {
                refused = None;
                Arc::clone(&table)
            }
        });
        match refused {
            Some(epoch) => Err(format!("map epoch {} is not newer than epoch {epoch}", table.epoch)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A key routes to the primary of its partition, which is its hash modulo the
        /// partition count (the rule the cluster map states).
        #[test]
        fn keys_route_to_their_partitions_primary(shards in proptest::collection::vec(0usize..5, 1..64), key in proptest::collection::vec(any::<u8>(), 0..64)) {
            let table = PartitionTable::new(3, &shards, 5).unwrap();
            let p = (key_hash(&key) % shards.len() as u64) as usize;
            prop_assert_eq!(table.partition(&key), p);
            prop_assert_eq!(Placement::partitions(table).shard(&key), shards[p]);
        }
    }

    #[test]
    fn writes_see_every_replica_and_reads_the_primary() {
        let table = PartitionTable::replicated(2, &[vec![0, 2, 1], vec![1, 0]], 3).unwrap();
        for i in 0..64u32 {
            let key = i.to_le_bytes();
            let (shard, backups) = (table.shard(&key), table.backups(&key));
            match table.partition(&key) {
                0 => assert_eq!((shard, backups), (0, &[2u16, 1][..])),
                _ => assert_eq!((shard, backups), (1, &[0u16][..])),
            }
        }
        assert!((0..3).all(|s| table.serves(s)));
        assert_eq!(table.item_share(2), (0, 1), "no partition has shard 2 as primary");
        let failed_over = PartitionTable::replicated(3, &[vec![0, 1], vec![1, 0]], 3).unwrap();
        assert!(!failed_over.serves(2) && failed_over.serves(0));
        assert_eq!(failed_over.item_share(0), (1, 2), "uniform: every key on two memnodes");
        assert_eq!(failed_over.item_share(2), (0, 1), "holding nothing: its keys are stale");
        let degraded = PartitionTable::replicated(4, &[vec![0, 1], vec![1]], 2).unwrap();
        assert_eq!((degraded.item_share(0), degraded.item_share(1)), ((1, 1), (1, 2)));
        assert!((0..64u32).all(|i| degraded.locks_writes(&i.to_le_bytes())), "R = 2: a lone primary's too");
        let lost = PartitionTable::replicated(5, &[vec![0], vec![1]], 2).unwrap();
        assert!(!lost.locks_writes(b"k") && lost.clone().with_replicas(2).locks_writes(b"k"));
        assert!(PartitionTable::new(1, &[0, 1], 2).unwrap().backups(b"k").is_empty());
        assert!(PartitionTable::replicated(1, &[vec![]], 1).unwrap_err().contains("no replica"));
        assert!(PartitionTable::replicated(1, &[vec![0, 0]], 1).unwrap_err().contains("twice"));
        assert!(PartitionTable::replicated(1, &[vec![0, 3]], 2).unwrap_err().contains("memnode #3 of 2"));
    }

    #[test]
    fn bad_tables_are_refused() {
        assert!(PartitionTable::new(1, &[], 1).unwrap_err().contains("0 partitions"));
        assert!(PartitionTable::new(1, &[0, 2], 2).unwrap_err().contains("partition 1 routes to memnode #2 of 2"));
        assert!(PartitionTable::new(1, &vec![0; MAX_PARTITIONS + 1], 1).is_err());
    }

    #[test]
    fn only_newer_maps_are_installed() {
        let placement = Placement::partitions(PartitionTable::new(5, &[0, 1], 2).unwrap());
        assert_eq!(placement.epoch(), Some(5));
        assert!(placement.install(PartitionTable::new(5, &[1, 1], 2).unwrap()).unwrap_err().contains("not newer"));
        assert!(placement.install(PartitionTable::new(4, &[1, 1], 2).unwrap()).is_err());
        let key = b"some key";
        let before = placement.shard(key);
        placement.install(PartitionTable::new(6, &[1 - before, 1 - before], 2).unwrap()).unwrap();
        assert_eq!((placement.epoch(), placement.shard(key)), (Some(6), 1 - before));
        let ring = Placement::Ring(Ring::new(&[1, 2]));
        assert_eq!(ring.epoch(), None);
        assert!(ring.install(PartitionTable::new(1, &[0], 2).unwrap()).is_err());
    }

    #[test]
    fn readers_route_while_maps_are_installed() {
        let placement = Arc::new(Placement::partitions(PartitionTable::new(1, &[1; 8], 4).unwrap()));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let placement = Arc::clone(&placement);
                s.spawn(move || {
                    let mut last_epoch = 0;
                    for i in 0..20_000u32 {
                        // Epochs only grow, and every table sends all keys to shard epoch % 4.
                        let epoch = placement.epoch().unwrap();
                        assert!(epoch >= last_epoch, "epoch {epoch} after {last_epoch}");
                        last_epoch = epoch;
                        assert!(placement.shard(&i.to_le_bytes()) < 4);
                    }
                });
            }
            for epoch in 2..200u64 {
                let shard = (epoch % 4) as usize;
                placement.install(PartitionTable::new(epoch, &[shard; 8], 4).unwrap()).unwrap();
            }
        });
        assert_eq!(placement.epoch(), Some(199));
        assert_eq!(placement.shard(b"x"), 3);
    }
}
