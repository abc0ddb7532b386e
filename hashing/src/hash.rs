//! Where a key goes: its directory hash, fingerprint and two combined buckets.

use crate::layout::{combined_bucket, digest_fingerprint, key_digest, CombinedBucket};

/// Everything the table derives from a key's bytes (one xxh3-128 per operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    /// Its low bits pick the directory entry (suffix), at any depth.
    pub dir: u64,
    /// The slot fingerprint: 8 bits of the digest, compared before a block is read.
    pub fingerprint: u8,
    /// Two (group, side) choices in a subtable; the groups always differ.
    pub choices: [(u64, u8); 2],
}

impl KeyHash {
    /// Hashes `key` for a table with `groups_per_subtable` bucket groups per subtable.
    pub fn of(key: &[u8], groups_per_subtable: u32) -> Self {
        Self::from_digest(key_digest(key), groups_per_subtable)
    }

    /// The hash of the key whose [`key_digest`] is `digest` (a long-key block keeps it, so
    /// its key need not be read to place it).
    pub fn from_digest(digest: u128, groups_per_subtable: u32) -> Self {
        debug_assert!(groups_per_subtable.is_power_of_two() && groups_per_subtable >= 2);
        let (lo, hi) = (digest as u64, (digest >> 64) as u64);
        let combined = 2 * u64::from(groups_per_subtable);
        let c1 = (hi & 0xFFFF_FFFF) & (combined - 1);
        let c2 = (hi >> 32) & (combined - 1);
        let (g1, s1) = (c1 / 2, (c1 % 2) as u8);
        let (mut g2, s2) = (c2 / 2, (c2 % 2) as u8);
        if g2 == g1 {
            // Two distinct groups give four distinct buckets.
            g2 = (g1 + 1) % u64::from(groups_per_subtable);
        }
        Self { dir: lo, fingerprint: digest_fingerprint(digest), choices: [(g1, s1), (g2, s2)] }
    }

    /// The key's two combined buckets in the subtable at `subtable`.
    pub fn combined_buckets(&self, subtable: u64, groups_per_subtable: u32) -> [CombinedBucket; 2] {
        self.choices.map(|(group, side)| combined_bucket(subtable, groups_per_subtable, group, side))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_in_range_and_distinct() {
        for i in 0u32..10_000 {
            let h = KeyHash::of(&i.to_le_bytes(), 64);
            assert!(h.choices.iter().all(|&(g, s)| g < 64 && s < 2));
            assert_ne!(h.choices[0].0, h.choices[1].0);
        }
    }

    #[test]
    fn spreads_evenly_over_groups() {
        let mut counts = [0u32; 16];
        for i in 0u32..160_000 {
            let h = KeyHash::of(&i.to_le_bytes(), 16);
            counts[h.choices[0].0 as usize] += 1;
        }
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }
}
