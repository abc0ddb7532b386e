//! YCSB's key generators, as its Java classes compute them: the zipfian generator of Gray
//! et al. ("Quickly generating billion-record synthetic databases", SIGMOD 1994; YCSB's
//! `ZipfianGenerator`), its scrambled form (`ScrambledZipfianGenerator`: the zipfian rank
//! over 10^10 items, FNV-hashed onto the key space so hot keys are spread), the latest
//! distribution of workload D (`SkewedLatestGenerator`), and YCSB's key names
//! (`CoreWorkload.buildKeyName`: `user` and the FNV hash of the key number).

use rand::rngs::SmallRng;
use rand::Rng;

/// YCSB's zipfian constant (theta).
pub const ZIPFIAN_CONSTANT: f64 = 0.99;
/// The item count YCSB's scrambled zipfian draws ranks from.
const SCRAMBLED_ITEMS: u64 = 10_000_000_000;
/// zeta(10^10, 0.99), as YCSB hard-codes it (`ScrambledZipfianGenerator.ZETAN`).
const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

const FNV_OFFSET_BASIS_64: i64 = 0xCBF2_9CE4_8422_2325_u64 as i64;
const FNV_PRIME_64: i64 = 1_099_511_628_211;

/// YCSB's `Utils.fnvhash64`: FNV-1a over the value's 8 bytes, low byte first, made
/// non-negative as Java's `Math.abs` does (which leaves `i64::MIN` as it is).
pub fn fnv_hash64(value: i64) -> i64 {
    let mut value = value;
    let mut hash = FNV_OFFSET_BASIS_64;
    for _ in 0..8 {
        let octet = value & 0xff;
        value >>= 8;
        hash ^= octet;
        hash = hash.wrapping_mul(FNV_PRIME_64);
    }
    hash.wrapping_abs()
}

/// Writes YCSB's name of key number `n` (`user` and the FNV hash of `n`, in decimal) into
/// `out`, replacing what it held.
pub fn key_name(n: u64, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(b"user");
    let hash = fnv_hash64(n as i64);
    if hash < 0 {
        // Only i64::MIN, which Java's Math.abs leaves negative.
        out.push(b'-');
    }
    push_decimal(out, hash.unsigned_abs());
}

/// Appends `n` in decimal to `out`.
pub fn push_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// zeta(n, theta) = sum over i in 1..=n of 1 / i^theta, continued from `from` items whose sum
/// is `initial` (YCSB's incremental `zeta(st, n, theta, initialsum)`).
fn zeta(from: u64, n: u64, theta: f64, initial: f64) -> f64 {
    (from..n).fold(initial, |sum, i| sum + 1.0 / ((i + 1) as f64).powf(theta))
}

/// Gray et al.'s zipfian generator over `0..items` (rank 0 the most popular), as YCSB's
/// `ZipfianGenerator`; the item count may grow between draws (workload D's latest keys):
/// zeta is then extended incrementally.
#[derive(Debug, Clone)]
pub struct Zipfian {
    items: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    zeta2theta: f64,
    eta: f64,
    /// The item count `zetan` was computed for.
    count_for_zeta: u64,
}

impl Zipfian {
    /// Over `0..items` with constant `theta` (0 < theta < 1), computing zeta(items).
    pub fn new(items: u64, theta: f64) -> Self {
        Self::with_zetan(items, theta, zeta(0, items, theta, 0.0))
    }

    /// Over `0..items`, with zeta(items, theta) already known.
    fn with_zetan(items: u64, theta: f64, zetan: f64) -> Self {
        assert!(items >= 1, "a zipfian over no items");
        assert!(theta > 0.0 && theta < 1.0, "zipfian constant {theta} outside (0, 1)");
        let zeta2theta = zeta(0, 2, theta, 0.0);
        let mut z =
            Self { items, theta, alpha: 1.0 / (1.0 - theta), zetan, zeta2theta, eta: 0.0, count_for_zeta: items };
        z.eta = z.eta_for(items);
        z
    }

    fn eta_for(&self, items: u64) -> f64 {
        (1.0 - (2.0 / items as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2theta / self.zetan)
    }

    /// A rank in `0..items`.
    pub fn next(&mut self, rng: &mut SmallRng) -> u64 {
        self.next_of(self.items, rng)
    }

    /// A rank in `0..items` for an item count that may have changed since the last draw
    /// (YCSB's `nextLong(itemcount)`).
    pub fn next_of(&mut self, items: u64, rng: &mut SmallRng) -> u64 {
        if items != self.count_for_zeta {
            self.zetan = if items > self.count_for_zeta {
                zeta(self.count_for_zeta, items, self.theta, self.zetan)
            } else {
                zeta(0, items, self.theta, 0.0)
            };
            self.count_for_zeta = items;
            self.eta = self.eta_for(items);
        }
        let u: f64 = rng.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1.min(items - 1);
        }
        let rank = (items as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        rank.min(items - 1)
    }
}

/// YCSB's scrambled zipfian over `0..items`: a zipfian rank over 10^10 items (theta 0.99),
/// FNV-hashed and reduced modulo `items`, so the popular keys are spread over the key space.
#[derive(Debug, Clone)]
pub struct ScrambledZipfian {
    items: u64,
    ranks: Zipfian,
}

impl ScrambledZipfian {
    /// Over `0..items`.
    pub fn new(items: u64) -> Self {
        assert!(items >= 1, "a scrambled zipfian over no items");
        Self { items, ranks: Zipfian::with_zetan(SCRAMBLED_ITEMS, ZIPFIAN_CONSTANT, SCRAMBLED_ZETAN) }
    }

    /// A key number in `0..items`.
    pub fn next(&mut self, rng: &mut SmallRng) -> u64 {
        let rank = self.ranks.next(rng);
        fnv_hash64(rank as i64).unsigned_abs() % self.items
    }
}

/// Workload D's latest distribution: recently inserted keys are the most popular (YCSB's
/// `SkewedLatestGenerator`: the newest key number minus a zipfian rank over all of them).
#[derive(Debug, Clone)]
pub struct SkewedLatest {
    ranks: Zipfian,
}

impl SkewedLatest {
    /// For a key space that now holds `items` keys.
    pub fn new(items: u64) -> Self {
        Self { ranks: Zipfian::new(items.max(1), ZIPFIAN_CONSTANT) }
    }

    /// A key number in `0..items`, `items` being the keys inserted so far (it may have
    /// grown since the last draw); the newest, `items - 1`, is the most likely.
    pub fn next(&mut self, items: u64, rng: &mut SmallRng) -> u64 {
        let items = items.max(1);
        items - 1 - self.ranks.next_of(items, rng)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn fnv_matches_ycsb() {
        // YCSB's Utils.fnvhash64 for these inputs (worked out independently, in Python, from
        // its Java source: FNV-1a over 8 bytes low first, then Math.abs).
        assert_eq!(fnv_hash64(0), 6_284_781_860_667_377_211);
        assert_eq!(fnv_hash64(1), 8_517_097_267_634_966_620);
        assert_eq!(fnv_hash64(12345), 1_792_800_413_050_876_852);
        let mut key = Vec::new();
        key_name(0, &mut key);
        assert_eq!(key, b"user6284781860667377211");
    }

    #[test]
    fn scrambled_zetan_is_zeta_of_ten_billion() {
        // The hard-coded constant is what the incremental sum gives (checked to 10^7 terms
        // plus the integral tail, to stay fast).
        let head = zeta(0, 10_000_000, ZIPFIAN_CONSTANT, 0.0);
        let tail = |x: f64| x.powf(1.0 - ZIPFIAN_CONSTANT) / (1.0 - ZIPFIAN_CONSTANT);
        let estimate = head + tail(1e10 + 0.5) - tail(1e7 + 0.5);
        assert!((estimate - SCRAMBLED_ZETAN).abs() < 1e-3, "{estimate} vs {SCRAMBLED_ZETAN}");
    }

    /// The share of draws of rank 0 and of the top 1% of ranks, over `draws`.
    fn shares(items: u64, draws: u32, mut next: impl FnMut() -> u64) -> (f64, f64) {
        let (mut first, mut top) = (0u32, 0u32);
        for _ in 0..draws {
            let r = next();
            assert!(r < items, "{r} outside 0..{items}");
            first += u32::from(r == 0);
            top += u32::from(r < items / 100);
        }
        (f64::from(first) / f64::from(draws), f64::from(top) / f64::from(draws))
    }

    #[test]
    fn zipfian_skew_is_what_theta_says() {
        // With theta 0.99 over 10,000 items, P(rank 0) = 1 / zeta(10^4) = 0.1005 and the top 1%
        // (100 ranks) draw zeta(100) / zeta(10^4) = 0.5247 of all.
        let items = 10_000;
        let mut z = Zipfian::new(items, ZIPFIAN_CONSTANT);
        let mut rng = SmallRng::seed_from_u64(7);
        let (first, top) = shares(items, 200_000, || z.next(&mut rng));
        let zn = zeta(0, items, ZIPFIAN_CONSTANT, 0.0);
        assert!((first - 1.0 / zn).abs() < 0.01, "rank 0 drew {first}, expected {}", 1.0 / zn);
        let expected_top = zeta(0, 100, ZIPFIAN_CONSTANT, 0.0) / zn;
        assert!((top - expected_top).abs() < 0.02, "top 1% drew {top}, expected {expected_top}");
    }

    #[test]
    fn scrambled_zipfian_is_skewed_but_spread() {
        let items = 100_000;
        let mut z = ScrambledZipfian::new(items);
        let mut rng = SmallRng::seed_from_u64(11);
        let mut counts = std::collections::HashMap::<u64, u32>::new();
        let draws = 200_000;
        for _ in 0..draws {
            *counts.entry(z.next(&mut rng)).or_default() += 1;
        }
        let mut by_count: Vec<(u64, u32)> = counts.into_iter().collect();
        by_count.sort_by_key(|entry| std::cmp::Reverse(entry.1));
        // The hottest key is rank 0 of 10^10 hashed: 1 / zeta(10^10) = 3.8% of draws.
        let hottest = f64::from(by_count[0].1) / f64::from(draws);
        assert!((hottest - 1.0 / SCRAMBLED_ZETAN).abs() < 0.005, "hottest key drew {hottest}");
        // ... and the 10 hottest are not neighbours (the scrambling spreads them).
        let mut hot: Vec<u64> = by_count[..10].iter().map(|e| e.0).collect();
        hot.sort_unstable();
        assert!(hot.windows(2).all(|w| w[1] - w[0] > 1), "{hot:?}");
        // Uniform would give the top 1% of keys 1% of draws; zipfian far more.
        let top: u32 = by_count[..(items / 100) as usize].iter().map(|e| e.1).sum();
        assert!(f64::from(top) / f64::from(draws) > 0.2, "top 1% drew {top}");
    }

    #[test]
    fn latest_prefers_the_newest_keys_and_follows_growth() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut latest = SkewedLatest::new(1000);
        let (newest, _) = shares(1000, 50_000, || 999 - latest.next(1000, &mut rng));
        assert!(newest > 0.1, "the newest key drew {newest}");
        // Grown by 500 keys: the newest is now 1499.
        let mut hits = 0;
        for _ in 0..10_000 {
            let k = latest.next(1500, &mut rng);
            assert!(k < 1500);
            hits += u32::from(k == 1499);
        }
        assert!(hits > 1000, "the new newest key drew {hits} of 10000");
    }

    proptest! {
        #[test]
        fn zipfian_stays_in_range(items in 1u64..5_000, grow in 0u64..500, seed: u64) {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut z = Zipfian::new(items, ZIPFIAN_CONSTANT);
            for _ in 0..200 {
                prop_assert!(z.next(&mut rng) < items);
            }
            // Grown (zeta extended, not recomputed): draws cover the new items too.
            for _ in 0..200 {
                prop_assert!(z.next_of(items + grow, &mut rng) < items + grow);
            }
        }

        #[test]
        fn scrambled_and_latest_stay_in_range(items in 1u64..1_000_000, seed: u64) {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut s = ScrambledZipfian::new(items);
            let mut l = SkewedLatest::new(items);
            for _ in 0..200 {
                prop_assert!(s.next(&mut rng) < items);
                prop_assert!(l.next(items, &mut rng) < items);
            }
        }

        #[test]
        fn key_names_are_user_and_digits(n: u64) {
            let mut key = Vec::new();
            key_name(n, &mut key);
            prop_assert!(key.starts_with(b"user"));
            let digits = &key[4..];
            prop_assert!(!digits.is_empty() && digits.len() <= 20);
            let text = std::str::from_utf8(digits).unwrap();
            prop_assert_eq!(text.parse::<i64>().unwrap(), fnv_hash64(n as i64));
        }
    }
}
