//! Consistent hashing of keys onto memnodes, by the memnodes' persistent node ids, so every
//! client agrees where a key lives whatever endpoint it used to reach a memnode.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Points per memnode on the ring: enough to keep shares within a few percent.
pub const VIRTUAL_NODES: u32 = 160;
const KEY_SEED: u64 = 0x52_41_43_45; // independent of the table's own key hash

/// A key's placement hash: where it falls on the ring, and (modulo the partition count)
/// its partition in a cluster map. Independent of the table's own key hash.
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64_with_seed(key, KEY_SEED)
}

/// The consistent-hashing ring: [`VIRTUAL_NODES`] points per memnode, a key owned by the
/// first point at or after its hash.
#[derive(Debug, Clone)]
pub struct Ring {
    /// (point, shard index), sorted by point.
    points: Vec<(u64, usize)>,
}

impl Ring {
    /// A ring over shards with these node ids (index = position in `node_ids`).
    pub fn new(node_ids: &[u64]) -> Self {
        let mut points: Vec<(u64, usize)> = node_ids
            .iter()
            .enumerate()
            .flat_map(|(shard, &id)| {
                (0..VIRTUAL_NODES).map(move |v| (xxh3_64_with_seed(&u64::from(v).to_le_bytes(), id), shard))
            })
            .collect();
        points.sort_unstable();
        Self { points }
    }

    /// The shard that owns `key`.
    pub fn shard(&self, key: &[u8]) -> usize {
        if self.points.len() <= VIRTUAL_NODES as usize {
            return 0; // one memnode (the common local case): no hash, no search
        }
        let h = key_hash(key);
        let at = self.points.partition_point(|&(p, _)| p < h);
        self.points[at % self.points.len()].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_even_and_stable() {
        let ring = Ring::new(&[11, 22, 33]);
        let mut counts = [0u32; 3];
        for i in 0..90_000u32 {
            counts[ring.shard(&i.to_le_bytes())] += 1;
        }
        assert!(counts.iter().all(|&c| (25_000..35_000).contains(&c)), "{counts:?}");
        // Order of ids does not matter, only the ids.
        let shuffled = Ring::new(&[33, 11, 22]);
        let ids = [11u64, 22, 33];
        let shuffled_ids = [33u64, 11, 22];
        for i in 0..1_000u32 {
            let k = i.to_le_bytes();
            assert_eq!(ids[ring.shard(&k)], shuffled_ids[shuffled.shard(&k)]);
        }
    }

    #[test]
    fn adding_a_node_moves_only_its_share() {
        let before = Ring::new(&[1, 2, 3]);
        let after = Ring::new(&[1, 2, 3, 4]);
        let moved = (0..40_000u32).filter(|i| before.shard(&i.to_le_bytes()) != after.shard(&i.to_le_bytes())).count();
        assert!(moved < 40_000 * 35 / 100, "{moved} of 40000 keys moved");
    }
}
