//! Random numbers where nothing needs a seeded generator.

use std::hash::{BuildHasher, Hasher};

/// A random number for picking keys (no generator to seed: std's hasher keys are random).
pub fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}
