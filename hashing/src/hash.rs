//! Where a key goes: its directory hash, fingerprint and two combined buckets (their offsets
//! in a subtable are layout: `KeyHash::combined_buckets` is in `layout.rs`).

/// Everything the table derives from a key's bytes (one xxh3-128 per operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    /// Its low bits pick the directory entry (suffix), at any depth.
    pub dir: u64,
    pub fingerprint: u8,
    /// Two (group, side) choices in a subtable; the groups always differ.
    pub choices: [(u64, u8); 2],
}

impl KeyHash {
    pub fn of(key: &[u8], groups_per_subtable: u32) -> Self {
        debug_assert!(groups_per_subtable.is_power_of_two() && groups_per_subtable >= 2);
        let h = xxhash_rust::xxh3::xxh3_128(key);
        let (lo, hi) = (h as u64, (h >> 64) as u64);
        let combined = 2 * u64::from(groups_per_subtable);
        let c1 = (hi & 0xFFFF_FFFF) & (combined - 1);
        let c2 = (hi >> 32) & (combined - 1);
        let (g1, s1) = (c1 / 2, (c1 % 2) as u8);
        let (mut g2, s2) = (c2 / 2, (c2 % 2) as u8);
        if g2 == g1 {
            // Two distinct groups give four distinct buckets.
            g2 = (g1 + 1) % u64::from(groups_per_subtable);
        }
        Self { dir: lo, fingerprint: (lo >> 56) as u8, choices: [(g1, s1), (g2, s2)] }
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
