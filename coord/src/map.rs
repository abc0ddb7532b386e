//! The cluster map: which memnodes there are, how keys fall into partitions, and which
//! memnodes hold each partition (its replica set, primary first), under an epoch that grows
//! with every change.
//!
//! It lives in etcd as JSON (`etcd.rs`), so every byte of it is untrusted on the way in:
//! [`ClusterMap::decode`] refuses more than [`MAX_MAP_BYTES`] before parsing and checks
//! every field against the limits below ([`ClusterMap::check`]) before anyone routes by it.

use serde::{Deserialize, Serialize};

use crate::CoordError;

/// Largest encoded map accepted (1 MiB: thousands of memnodes and partitions).
pub const MAX_MAP_BYTES: usize = 1 << 20;
/// Largest encoded memnode registration accepted.
pub const MAX_MEMNODE_INFO_BYTES: usize = 4096;
/// Most memnodes in one cluster.
pub const MAX_MEMNODES: usize = 1024;
/// Most partitions in one cluster.
pub const MAX_PARTITIONS: usize = 16_384;
/// Most endpoints one memnode lists (one per transport, with room to spare).
pub const MAX_ENDPOINTS: usize = 8;
/// Longest endpoint string (`tcp:host:port`, `shm:/path`, `verbs:host:port`).
pub const MAX_ENDPOINT_BYTES: usize = 256;
/// Replication factor bounds (issue 17: 1 to 5).
pub const MAX_REPLICAS: u8 = 5;
/// Partitions per memnode of a new map: enough for moves to spread load in small steps.
pub const DEFAULT_PARTITIONS_PER_MEMNODE: usize = 16;

/// One memnode, as it registers itself and as the map names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemnodeInfo {
    /// Its persistent node id (in its data file; the ring and the map name it by this).
    pub node_id: u64,
    /// Where clients reach it (`tcp:host:port`, `shm:/path`, `verbs:host:port`).
    pub endpoints: Vec<String>,
    /// Its region's size.
    pub region_bytes: u64,
}

/// The cluster map (see the module's comment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterMap {
    /// Grows by one with every change; requests routed by an older epoch are refused.
    pub epoch: u64,
    /// The replication factor R: each partition's replica set has R memnodes (fewer only
    /// while the cluster has fewer live memnodes).
    pub replicas: u8,
    /// Every memnode of the map, by ascending node id.
    pub memnodes: Vec<MemnodeInfo>,
    /// Per partition, its replica set: node ids, the primary first.
    pub partitions: Vec<Vec<u64>>,
    /// Per partition, memnodes catching up to join its replica set (rejoin and
    /// re-replication, `catchup.rs`; moves, `membership.rs`): written to like backups,
    /// never read from, never promoted by failover. Empty (or absent, in maps written before it existed) when no
    /// partition has one; otherwise one list per partition.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joining: Vec<Vec<u64>>,
    /// Replicated single-key writes go by the snapshot protocol (no transaction record; a
    /// mark every build since it reads, `client/src/snapshot_write.rs`) rather than as
    /// one-key transactions. Set in every map this build starts; absent (false) in maps
    /// written by builds before it, until `racekv cluster set-snapshot-writes on` once every
    /// process runs a build that reads the marks.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot_writes: bool,
}

fn bad(what: impl Into<String>) -> CoordError {
    CoordError::BadMap(what.into())
}

impl MemnodeInfo {
    /// Checks the limits: some endpoints, each short and printable.
    pub fn check(&self) -> Result<(), CoordError> {
        if self.endpoints.is_empty() || self.endpoints.len() > MAX_ENDPOINTS {
            return Err(bad(format!(
                "memnode {:#x} lists {} endpoints (1 to {MAX_ENDPOINTS})",
                self.node_id,
                self.endpoints.len()
            )));
        }
        for e in &self.endpoints {
            let printable = e.bytes().all(|b| b.is_ascii_graphic());
            if e.is_empty() || e.len() > MAX_ENDPOINT_BYTES || !printable {
                return Err(bad(format!(
                    "memnode {:#x}: endpoint of {} bytes (1 to {MAX_ENDPOINT_BYTES} printable ASCII)",
                    self.node_id,
                    e.len()
                )));
            }
        }
        Ok(())
    }

    /// The registration's JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a memnode's info serializes")
    }

    /// A registration read from etcd: bounded, parsed, checked.
    pub fn decode(bytes: &[u8]) -> Result<Self, CoordError> {
        if bytes.len() > MAX_MEMNODE_INFO_BYTES {
            return Err(bad(format!(
                "a memnode registration of {} bytes (at most {MAX_MEMNODE_INFO_BYTES})",
                bytes.len()
            )));
        }
        let info: Self = serde_json::from_slice(bytes).map_err(|e| bad(format!("a memnode registration: {e}")))?;
        info.check()?;
        Ok(info)
    }
}

impl ClusterMap {
    /// The first map of a cluster: `partitions_per_memnode` partitions per memnode, each
    /// replicated on `replicas` memnodes (fewer if there are fewer), placed round-robin so
    /// every memnode is primary of as many partitions as any other and the replicas of a
    /// partition are distinct. Epoch 1.
    pub fn initial(
        mut memnodes: Vec<MemnodeInfo>,
        replicas: u8,
        partitions_per_memnode: usize,
    ) -> Result<Self, CoordError> {
        memnodes.sort_by_key(|m| m.node_id);
        let n = memnodes.len();
        if n == 0 {
            return Err(bad("a map needs at least one memnode"));
        }
        let count = n.saturating_mul(partitions_per_memnode.max(1)).min(MAX_PARTITIONS);
        let width = usize::from(replicas).min(n);
        let partitions = (0..count).map(|p| (0..width).map(|r| memnodes[(p + r) % n].node_id).collect()).collect();
        let map = Self { epoch: 1, replicas, memnodes, partitions, joining: Vec::new(), snapshot_writes: true };
        map.check()?;
        Ok(map)
    }

    /// Checks every limit and reference: R in 1..=[`MAX_REPLICAS`]; memnodes unique, by
    /// ascending id, within [`MAX_MEMNODES`]; partitions within [`MAX_PARTITIONS`], each with
    /// 1 to R distinct memnodes of the map.
    pub fn check(&self) -> Result<(), CoordError> {
        if self.replicas == 0 || self.replicas > MAX_REPLICAS {
            return Err(bad(format!("replication factor {} (1 to {MAX_REPLICAS})", self.replicas)));
        }
        if self.memnodes.is_empty() || self.memnodes.len() > MAX_MEMNODES {
            return Err(bad(format!("{} memnodes (1 to {MAX_MEMNODES})", self.memnodes.len())));
        }
        if !self.memnodes.windows(2).all(|w| w[0].node_id < w[1].node_id) {
            return Err(bad("memnodes are not unique and in ascending node id order"));
        }
        self.memnodes.iter().try_for_each(MemnodeInfo::check)?;
        if self.partitions.is_empty() || self.partitions.len() > MAX_PARTITIONS {
            return Err(bad(format!("{} partitions (1 to {MAX_PARTITIONS})", self.partitions.len())));
        }
        for (p, set) in self.partitions.iter().enumerate() {
            if set.is_empty() || set.len() > usize::from(self.replicas) {
                return Err(bad(format!("partition {p} has {} replicas (1 to {})", set.len(), self.replicas)));
            }
            for (i, id) in set.iter().enumerate() {
                if set[..i].contains(id) {
                    return Err(bad(format!("partition {p} names memnode {id:#x} twice")));
                }
                if self.memnode(*id).is_none() {
                    return Err(bad(format!("partition {p} names memnode {id:#x}, which the map does not list")));
                }
            }
        }
        if !self.joining.is_empty() && self.joining.len() != self.partitions.len() {
            return Err(bad(format!("{} joining lists for {} partitions", self.joining.len(), self.partitions.len())));
        }
        for (p, (set, joining)) in self.partitions.iter().zip(&self.joining).enumerate() {
            // A move's joiner may join a full set (it takes a replica's place when done).
            if joining.len() > usize::from(self.replicas) {
                return Err(bad(format!("partition {p} has {} joining (R = {})", joining.len(), self.replicas)));
            }
            for (i, id) in joining.iter().enumerate() {
                if set.contains(id) || joining[..i].contains(id) {
                    return Err(bad(format!("partition {p} names memnode {id:#x} twice")));
                }
                if self.memnode(*id).is_none() {
                    return Err(bad(format!(
                        "partition {p} names joining memnode {id:#x}, which the map does not list"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The memnodes joining `partition` (none when it has none).
    pub fn joining_of(&self, partition: usize) -> &[u64] {
        self.joining.get(partition).map_or(&[], Vec::as_slice)
    }

    /// Per partition, the memnodes a write of its keys goes to: its replica set (primary
    /// first), then its joining memnodes.
    pub fn write_sets(&self) -> Vec<Vec<u64>> {
        (0..self.partitions.len()).map(|p| [self.replicas_of(p), self.joining_of(p)].concat()).collect()
    }

    /// Drops empty joining lists' storage when no partition has a joiner (the form the map
    /// is stored in).
    pub fn normalize_joining(&mut self) {
        if self.joining.iter().all(Vec::is_empty) {
            self.joining.clear();
        }
    }

    /// The memnode with this id.
    pub fn memnode(&self, node_id: u64) -> Option<&MemnodeInfo> {
        self.memnodes.binary_search_by_key(&node_id, |m| m.node_id).ok().map(|i| &self.memnodes[i])
    }

    /// The partition a key whose hash is `key_hash` falls in.
    pub fn partition_of(&self, key_hash: u64) -> usize {
        debug_assert!(!self.partitions.is_empty(), "a checked map has partitions");
        (key_hash % self.partitions.len() as u64) as usize
    }

    /// The replica set of `partition`, the primary first.
    pub fn replicas_of(&self, partition: usize) -> &[u64] {
        &self.partitions[partition]
    }

    /// The map's JSON.
    pub fn encode(&self) -> Vec<u8> {
        let bytes = serde_json::to_vec(self).expect("a map serializes");
        assert!(bytes.len() <= MAX_MAP_BYTES, "a checked map encodes to {} bytes", bytes.len());
        bytes
    }

    /// A map read from etcd: bounded before parsing, checked after.
    pub fn decode(bytes: &[u8]) -> Result<Self, CoordError> {
        if bytes.len() > MAX_MAP_BYTES {
            return Err(bad(format!("a map of {} bytes (at most {MAX_MAP_BYTES})", bytes.len())));
        }
        let map: Self = serde_json::from_slice(bytes).map_err(|e| bad(format!("the map: {e}")))?;
        map.check()?;
        Ok(map)
    }
}

/// A map of memnodes `ids` (4 partitions each, R = `replicas`) for this crate's tests.
#[cfg(test)]
pub(crate) fn sample(ids: &[u64], replicas: u8) -> ClusterMap {
    let memnodes = ids
        .iter()
        .map(|&node_id| MemnodeInfo {
            node_id,
            endpoints: vec![format!("tcp:127.0.0.1:{}", 7000 + node_id)],
            region_bytes: 1 << 20,
        })
        .collect();
    ClusterMap::initial(memnodes, replicas, 4).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn memnode(node_id: u64) -> MemnodeInfo {
        MemnodeInfo {
            node_id,
            endpoints: vec![format!("tcp:127.0.0.1:{}", 7400 + node_id % 100)],
            region_bytes: 1 << 30,
        }
    }

    proptest! {
        /// A new map is valid, balanced and round-trips: every partition has min(R, n)
        /// distinct replicas, and primaries differ by at most one partition per memnode.
        #[test]
        fn initial_maps_are_balanced_and_round_trip(ids in proptest::collection::btree_set(any::<u64>(), 1..40), replicas in 1u8..=MAX_REPLICAS, per in 1usize..32) {
            let memnodes: Vec<_> = ids.iter().rev().map(|&id| memnode(id)).collect();
            let map = ClusterMap::initial(memnodes, replicas, per).unwrap();
            prop_assert_eq!(ClusterMap::decode(&map.encode()).unwrap(), map.clone());
            let width = usize::from(replicas).min(ids.len());
            prop_assert!(map.partitions.iter().all(|set| set.len() == width));
            let mut primaries = std::collections::BTreeMap::new();
            for set in &map.partitions {
                *primaries.entry(set[0]).or_insert(0usize) += 1;
            }
            let (lo, hi) = (primaries.values().min().unwrap(), primaries.values().max().unwrap());
            prop_assert!(hi - lo <= 1, "primaries per memnode from {} to {}", lo, hi);
            for key_hash in [0u64, 1, u64::MAX, 0x9E37_79B9_7F4A_7C15] {
                let p = map.partition_of(key_hash);
                prop_assert!(map.replicas_of(p).iter().all(|id| map.memnode(*id).is_some()));
            }
        }

        /// Whatever bytes come from etcd, decoding returns a checked map or an error.
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(map) = ClusterMap::decode(&bytes) {
                prop_assert!(map.check().is_ok());
            }
            let _ = MemnodeInfo::decode(&bytes);
        }
    }

    #[test]
    fn new_maps_use_snapshot_writes_and_maps_of_earlier_builds_do_not() {
        let map = ClusterMap::initial(vec![memnode(1), memnode(2)], 2, 2).unwrap();
        assert!(map.snapshot_writes, "a new cluster's processes all read snapshot marks");
        assert_eq!(ClusterMap::decode(&map.encode()).unwrap(), map);
        // A map as an earlier build wrote it has no such field: transactions, as before.
        let off = ClusterMap { snapshot_writes: false, ..map };
        let bytes = off.encode();
        assert!(!String::from_utf8_lossy(&bytes).contains("snapshot_writes"), "readable by earlier builds");
        assert_eq!(ClusterMap::decode(&bytes).unwrap(), off);
    }

    #[test]
    fn bad_maps_are_refused_with_the_reason() {
        let good = ClusterMap::initial(vec![memnode(1), memnode(2), memnode(3)], 2, 2).unwrap();
        type Damage = fn(&mut ClusterMap);
        let cases: Vec<(&str, Damage)> = vec![
            ("replication factor 0", |m| m.replicas = 0),
            ("replication factor 6", |m| m.replicas = 6),
            ("ascending", |m| m.memnodes.swap(0, 1)),
            ("names memnode 0x9", |m| m.partitions[0][1] = 9),
            ("twice", |m| m.partitions[0][1] = m.partitions[0][0]),
            ("has 3 replicas", |m| m.partitions[0].push(3)),
            ("0 partitions", |m| m.partitions.clear()),
            ("endpoint of 0 bytes", |m| m.memnodes[0].endpoints[0].clear()),
            ("lists 0 endpoints", |m| m.memnodes[0].endpoints.clear()),
            ("1 joining lists for 6 partitions", |m| m.joining = vec![vec![]]),
            ("partition 0 has 2 joining (R = 1)", |m| {
                m.partitions.iter_mut().for_each(|set| set.truncate(1));
                m.replicas = 1;
                m.joining = vec![Vec::new(); 6];
                m.joining[0] = vec![2, 3];
            }),
            ("names memnode 0x1 twice", |m| {
                m.partitions[0] = vec![1];
                m.joining = vec![Vec::new(); 6];
                m.joining[0].push(1);
            }),
            ("joining memnode 0x9", |m| {
                m.partitions[0] = vec![1];
                m.joining = vec![Vec::new(); 6];
                m.joining[0].push(9);
            }),
        ];
        for (reason, damage) in cases {
            let mut map = good.clone();
            damage(&mut map);
            let bytes = serde_json::to_vec(&map).unwrap();
            let e = ClusterMap::decode(&bytes).unwrap_err().to_string();
            assert!(e.contains(reason), "{reason}: {e}");
        }
        let huge = vec![b' '; MAX_MAP_BYTES + 1];
        assert!(ClusterMap::decode(&huge).unwrap_err().to_string().contains("at most"));
        assert!(ClusterMap::decode(br#"{"epoch":1,"extra":true}"#).is_err());
        assert!(ClusterMap::initial(Vec::new(), 1, 1).is_err());
    }

    #[test]
    fn fewer_memnodes_than_replicas_replicate_on_all_of_them() {
        let map = ClusterMap::initial(vec![memnode(7), memnode(5)], 3, 4).unwrap();
        assert_eq!(map.partitions.len(), 8);
        assert!(map.partitions.iter().all(|set| set.len() == 2));
        assert_eq!(map.memnodes.iter().map(|m| m.node_id).collect::<Vec<_>>(), vec![5, 7]);
    }
}
