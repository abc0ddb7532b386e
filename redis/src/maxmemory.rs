//! Cache mode's settings (`maxmemory`, `maxmemory-policy`, `maxmemory-samples`), shared by
//! `CONFIG GET/SET`, INFO and whoever enforces them (the computenode's eviction), and its
//! counters (`evicted_keys`, `keyspace_hits`, `keyspace_misses`).
//!
//! The settings are atomics: `CONFIG SET` changes apply at the next write, without locks.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::LazyLock;

use prometheus::IntCounter;

/// `maxmemory-samples`' default (Redis').
pub const DEFAULT_SAMPLES: u32 = 5;
/// Most `maxmemory-samples` accepted: each sample costs a read on the write path.
pub const MAX_SAMPLES: u32 = 64;

/// Redis' eviction policies that racekv implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum MaxmemoryPolicy {
    /// Writes over the limit fail with OOM.
    #[default]
    NoEviction = 0,
    /// Evict a random key.
    AllkeysRandom = 1,
    /// Evict a random key among those with an expiry.
    VolatileRandom = 2,
    /// Evict the key with the soonest expiry among the sampled ones.
    VolatileTtl = 3,
}

/// Policies Redis has and racekv does not implement yet (they need access metadata).
const NOT_YET: &[&str] = &["allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu"];

impl MaxmemoryPolicy {
    const ALL: [Self; 4] = [Self::NoEviction, Self::AllkeysRandom, Self::VolatileRandom, Self::VolatileTtl];

    /// Redis' name of the policy.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoEviction => "noeviction",
            Self::AllkeysRandom => "allkeys-random",
            Self::VolatileRandom => "volatile-random",
            Self::VolatileTtl => "volatile-ttl",
        }
    }

    /// The policy Redis names `text` (any case); the LRU and LFU policies are refused with
    /// a reason saying so.
    pub fn parse(text: &str) -> Result<Self, String> {
        let lower = text.to_ascii_lowercase();
        if let Some(p) = Self::ALL.into_iter().find(|p| p.name() == lower) {
            return Ok(p);
        }
        if NOT_YET.contains(&lower.as_str()) {
            return Err(format!(
                "maxmemory-policy {lower} is not supported yet (racekv keeps no access metadata yet): use \
                 noeviction, allkeys-random, volatile-random or volatile-ttl"
            ));
        }
        Err(format!("invalid maxmemory-policy '{text}'"))
    }

    /// Whether only keys with an expiry may be evicted.
    pub fn volatile_only(self) -> bool {
        matches!(self, Self::VolatileRandom | Self::VolatileTtl)
    }

    fn from_u8(v: u8) -> Self {
        Self::ALL[v as usize]
    }
}

/// The cache-mode settings of one computenode (every memnode gets the same limit).
#[derive(Debug)]
pub struct Maxmemory {
    /// Bytes per memnode; 0: no limit.
    bytes: AtomicU64,
    policy: AtomicU8,
    samples: AtomicU32,
}

impl Default for Maxmemory {
    fn default() -> Self {
        Self::new(0, MaxmemoryPolicy::NoEviction, DEFAULT_SAMPLES)
    }
}

impl Maxmemory {
    /// Settings with these values (`samples` clamped to 1..=[`MAX_SAMPLES`]).
    pub fn new(bytes: u64, policy: MaxmemoryPolicy, samples: u32) -> Self {
        Self {
            bytes: AtomicU64::new(bytes),
            policy: AtomicU8::new(policy as u8),
            samples: AtomicU32::new(samples.clamp(1, MAX_SAMPLES)),
        }
    }

    /// The limit per memnode in bytes (0: none).
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The eviction policy.
    pub fn policy(&self) -> MaxmemoryPolicy {
        MaxmemoryPolicy::from_u8(self.policy.load(Ordering::Relaxed))
    }

    /// Keys sampled per eviction.
    pub fn samples(&self) -> u32 {
        self.samples.load(Ordering::Relaxed)
    }

    /// Changes the limit (`CONFIG SET maxmemory`).
    pub fn set_bytes(&self, bytes: u64) {
        self.bytes.store(bytes, Ordering::Relaxed);
    }

    /// Changes the policy (`CONFIG SET maxmemory-policy`).
    pub fn set_policy(&self, policy: MaxmemoryPolicy) {
        self.policy.store(policy as u8, Ordering::Relaxed);
    }

    /// Changes the sample count, clamped to 1..=[`MAX_SAMPLES`].
    pub fn set_samples(&self, samples: u32) {
        self.samples.store(samples.clamp(1, MAX_SAMPLES), Ordering::Relaxed);
    }
}

/// A byte count with Redis' units (`100mb`, `1gb`, `512k`; k = 1000, kb = 1024), as
/// `CONFIG SET maxmemory` takes it.
pub fn parse_bytes(text: &str) -> Option<u64> {
    parse_memory(text.trim().as_bytes()).and_then(|n| u64::try_from(n).ok())
}

/// A byte count as Redis' `memtoull` reads it: digits and an optional unit, `b`, `k`
/// (1000), `kb` (1024), `m`, `mb`, `g`, `gb`, in any case.
pub(crate) fn parse_memory(raw: &[u8]) -> Option<i64> {
    let split = raw.iter().position(|b| !b.is_ascii_digit()).unwrap_or(raw.len());
    let (digits, unit) = raw.split_at(split);
    let multiplier: i64 = match unit.to_ascii_lowercase().as_slice() {
        b"" | b"b" => 1,
        b"k" => 1000,
        b"kb" => 1024,
        b"m" => 1000 * 1000,
        b"mb" => 1024 * 1024,
        b"g" => 1000 * 1000 * 1000,
        b"gb" => 1024 * 1024 * 1024,
        _ => return None,
    };
    crate::resp::parse_i64(digits)?.checked_mul(multiplier)
}

struct CacheMetrics {
    evicted: IntCounter,
    hits: IntCounter,
    misses: IntCounter,
}

static METRICS: LazyLock<CacheMetrics> = LazyLock::new(|| {
    use racekv_telemetry::metric::counter;
    CacheMetrics {
        evicted: counter(
            "racekv_evicted_keys_total",
            "Keys evicted to keep a memnode under maxmemory: INFO's evicted_keys",
        ),
        hits: counter(
            "racekv_keyspace_hits_total",
            "Reading commands' key lookups that found the key: INFO's keyspace_hits",
        ),
        misses: counter(
            "racekv_keyspace_misses_total",
            "Reading commands' key lookups that found no key: INFO's keyspace_misses",
        ),
    }
});

/// Registers the counters now, so they show (as 0) before anything happens.
pub fn register_metrics() {
    LazyLock::force(&METRICS);
}

/// Counts `n` evicted keys.
pub fn count_evicted(n: u64) {
    METRICS.evicted.inc_by(n);
}

/// Keys evicted by this process so far.
pub fn evicted_keys() -> u64 {
    METRICS.evicted.get()
}

/// Counts one key lookup of a reading command.
pub(crate) fn count_lookup(hit: bool) {
    if hit {
        METRICS.hits.inc();
    } else {
        METRICS.misses.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_redis_names_and_lru_lfu_are_refused() {
        for p in MaxmemoryPolicy::ALL {
            assert_eq!(MaxmemoryPolicy::parse(&p.name().to_uppercase()), Ok(p));
        }
        for name in NOT_YET {
            assert!(MaxmemoryPolicy::parse(name).unwrap_err().contains("not supported yet"), "{name}");
        }
        assert!(MaxmemoryPolicy::parse("sometimes").is_err());
        assert_eq!(parse_bytes("100mb"), Some(100 << 20));
        assert_eq!(parse_bytes("12"), Some(12));
        assert_eq!(parse_bytes("12 apples"), None);
        let m = Maxmemory::new(1, MaxmemoryPolicy::VolatileTtl, 1000);
        assert_eq!((m.bytes(), m.policy(), m.samples()), (1, MaxmemoryPolicy::VolatileTtl, MAX_SAMPLES));
        assert!(m.policy().volatile_only() && !MaxmemoryPolicy::AllkeysRandom.volatile_only());
    }
}
