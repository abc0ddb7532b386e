//! Cache mode's settings (`maxmemory`, `maxmemory-policy`, `maxmemory-samples`,
//! `lfu-log-factor`, `lfu-decay-time`), shared by
//! `CONFIG GET/SET`, INFO and whoever enforces them (the computenode's eviction), and its
//! counters (`evicted_keys`, `keyspace_hits`, `keyspace_misses`).
//!
//! The settings are atomics: `CONFIG SET` changes apply at the next write, without locks.
//! `maxmemory` is bytes per memnode or a share of each memnode's region ([`Limit`]).

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::LazyLock;

use prometheus::IntCounter;

/// `maxmemory-samples`' default (Redis').
pub const DEFAULT_SAMPLES: u32 = 5;
/// Most `maxmemory-samples` accepted: each sample costs a read on the write path.
pub const MAX_SAMPLES: u32 = 64;
/// `lfu-log-factor`'s default (Redis').
pub const DEFAULT_LFU_LOG_FACTOR: u32 = 10;
/// `lfu-decay-time`'s default in minutes (Redis').
pub const DEFAULT_LFU_DECAY_MINUTES: u32 = 1;
/// Largest `lfu-log-factor` and `lfu-decay-time` accepted (Redis': `INT_MAX`).
pub const MAX_LFU_SETTING: u32 = i32::MAX as u32;
/// A share of the region is kept in hundredths of a percent: `12.34%` is the finest.
pub const SHARE_SCALE: u32 = 100 * 100;
/// Marks an encoded [`Limit::Share`] (a byte count never reaches it: Redis' sizes are i64).
const SHARE_FLAG: u64 = 1 << 63;

/// `maxmemory` as set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Limit {
    /// Bytes per memnode (0: no limit).
    Bytes(u64),
    /// A share of each memnode's region, in hundredths of a percent (1 to [`SHARE_SCALE`]).
    Share(u32),
    /// No limit (`maxmemory 0`).
    #[default]
    None,
}

impl Limit {
    /// Bytes with Redis' units (`100mb`, `1gb`, `0`), or a share of the region (`50%`,
    /// `12.5%`, above 0 and at most 100).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some(number) = text.strip_suffix('%') {
            let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
            let digits = |d: &str| !d.is_empty() && d.len() <= 3 && d.bytes().all(|b| b.is_ascii_digit());
            if !digits(whole) || (!fraction.is_empty() && (fraction.len() > 2 || !digits(fraction))) {
                return Err(format!("maxmemory '{text}': a share is like 50% or 12.5%"));
            }
            let hundredths = whole.parse::<u32>().unwrap_or(u32::MAX).saturating_mul(100)
                + format!("{fraction:0<2}").parse::<u32>().unwrap_or(0);
            if hundredths == 0 || hundredths > SHARE_SCALE {
                return Err(format!("maxmemory '{text}': a share must be above 0% and at most 100%"));
            }
            return Ok(Self::Share(hundredths));
        }
        match parse_bytes(text) {
            Some(0) => Ok(Self::None),
            Some(n) => Ok(Self::Bytes(n)),
            None => Err(format!("maxmemory '{text}' is not a size (like 100mb) or a share of the region (like 50%)")),
        }
    }

    /// Whether there is a limit.
    pub fn is_set(self) -> bool {
        !matches!(self, Self::None | Self::Bytes(0))
    }

    /// The limit in bytes of a memnode whose region is `region_bytes` (0: none).
    pub fn bytes_of(self, region_bytes: u64) -> u64 {
        match self {
            Self::None => 0,
            Self::Bytes(n) => n,
            // At least 1 byte: 0 would mean no limit.
            Self::Share(h) => (u128::from(region_bytes) * u128::from(h) / u128::from(SHARE_SCALE)).max(1) as u64,
        }
    }

    fn encode(self) -> u64 {
        match self {
            Self::None => 0,
            Self::Bytes(n) => n.min(SHARE_FLAG - 1),
            Self::Share(h) => SHARE_FLAG | u64::from(h),
        }
    }

    fn decode(word: u64) -> Self {
        match word {
            0 => Self::None,
            w if w & SHARE_FLAG != 0 => Self::Share((w & !SHARE_FLAG) as u32),
            n => Self::Bytes(n),
        }
    }
}

/// As set: bytes as a number, a share as `50%` (what `CONFIG GET` and the configuration show).
impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::None => f.write_str("0"),
            Self::Bytes(n) => write!(f, "{n}"),
            Self::Share(h) if h % 100 == 0 => write!(f, "{}%", h / 100),
            Self::Share(h) => {
                let fraction = format!("{:02}", h % 100);
                write!(f, "{}.{}%", h / 100, fraction.trim_end_matches('0'))
            }
        }
    }
}

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
    /// Evict the least recently read key (approximated by sampling).
    AllkeysLru = 4,
    /// Evict the least frequently read key (Redis' logarithmic counter, sampled).
    AllkeysLfu = 5,
    /// As `allkeys-lru`, among keys with an expiry.
    VolatileLru = 6,
    /// As `allkeys-lfu`, among keys with an expiry.
    VolatileLfu = 7,
}

impl MaxmemoryPolicy {
    const ALL: [Self; 8] = [
        Self::NoEviction,
        Self::AllkeysRandom,
        Self::VolatileRandom,
        Self::VolatileTtl,
        Self::AllkeysLru,
        Self::AllkeysLfu,
        Self::VolatileLru,
        Self::VolatileLfu,
    ];

    /// Redis' name of the policy.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoEviction => "noeviction",
            Self::AllkeysRandom => "allkeys-random",
            Self::VolatileRandom => "volatile-random",
            Self::VolatileTtl => "volatile-ttl",
            Self::AllkeysLru => "allkeys-lru",
            Self::AllkeysLfu => "allkeys-lfu",
            Self::VolatileLru => "volatile-lru",
            Self::VolatileLfu => "volatile-lfu",
        }
    }

    /// The policy Redis names `text` (any case).
    pub fn parse(text: &str) -> Result<Self, String> {
        let lower = text.to_ascii_lowercase();
        Self::ALL.into_iter().find(|p| p.name() == lower).ok_or_else(|| format!("invalid maxmemory-policy '{text}'"))
    }

    /// Whether only keys with an expiry may be evicted.
    pub fn volatile_only(self) -> bool {
        matches!(self, Self::VolatileRandom | Self::VolatileTtl | Self::VolatileLru | Self::VolatileLfu)
    }

    /// Whether it evicts by recency (reads then record when they happened).
    pub fn lru(self) -> bool {
        matches!(self, Self::AllkeysLru | Self::VolatileLru)
    }

    /// Whether it evicts by frequency (reads then count themselves).
    pub fn lfu(self) -> bool {
        matches!(self, Self::AllkeysLfu | Self::VolatileLfu)
    }

    fn from_u8(v: u8) -> Self {
        Self::ALL[v as usize]
    }
}

/// The cache-mode settings of one computenode (every memnode gets the same limit, or the
/// same share of its region).
#[derive(Debug)]
pub struct Maxmemory {
    /// The [`Limit`], encoded.
    limit: AtomicU64,
    /// The smallest memnode's region (0: not known), for [`Maxmemory::bytes`].
    region_bytes: AtomicU64,
    policy: AtomicU8,
    samples: AtomicU32,
    lfu_log_factor: AtomicU32,
    lfu_decay_minutes: AtomicU32,
}

impl Default for Maxmemory {
    fn default() -> Self {
        Self::new(Limit::None, MaxmemoryPolicy::NoEviction, DEFAULT_SAMPLES)
    }
}

impl Maxmemory {
    /// Settings with these values (`samples` clamped to 1..=[`MAX_SAMPLES`]).
    pub fn new(limit: Limit, policy: MaxmemoryPolicy, samples: u32) -> Self {
        Self {
            limit: AtomicU64::new(limit.encode()),
            region_bytes: AtomicU64::new(0),
            policy: AtomicU8::new(policy as u8),
            samples: AtomicU32::new(samples.clamp(1, MAX_SAMPLES)),
            lfu_log_factor: AtomicU32::new(DEFAULT_LFU_LOG_FACTOR),
            lfu_decay_minutes: AtomicU32::new(DEFAULT_LFU_DECAY_MINUTES),
        }
    }

    /// `maxmemory` as set.
    pub fn limit(&self) -> Limit {
        Limit::decode(self.limit.load(Ordering::Relaxed))
    }

    /// The limit per memnode in bytes (0: none), as INFO shows it; for a share, that of the
    /// smallest region [`Maxmemory::set_region_bytes`] was told of (0 until then).
    pub fn bytes(&self) -> u64 {
        match self.limit() {
            Limit::Share(_) if self.region_bytes.load(Ordering::Relaxed) == 0 => 0,
            limit => limit.bytes_of(self.region_bytes.load(Ordering::Relaxed)),
        }
    }

    /// Tells the settings the smallest memnode's region (at start), for [`Maxmemory::bytes`].
    pub fn set_region_bytes(&self, bytes: u64) {
        self.region_bytes.store(bytes, Ordering::Relaxed);
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
    pub fn set_limit(&self, limit: Limit) {
        self.limit.store(limit.encode(), Ordering::Relaxed);
    }

    /// Changes the policy (`CONFIG SET maxmemory-policy`).
    pub fn set_policy(&self, policy: MaxmemoryPolicy) {
        self.policy.store(policy as u8, Ordering::Relaxed);
    }

    /// Changes the sample count, clamped to 1..=[`MAX_SAMPLES`].
    pub fn set_samples(&self, samples: u32) {
        self.samples.store(samples.clamp(1, MAX_SAMPLES), Ordering::Relaxed);
    }

    /// `lfu-log-factor`: how much harder each increment of a key's LFU counter gets.
    pub fn lfu_log_factor(&self) -> u32 {
        self.lfu_log_factor.load(Ordering::Relaxed)
    }

    /// `lfu-decay-time`: minutes per decrement of an unread key's LFU counter (0: never).
    pub fn lfu_decay_minutes(&self) -> u32 {
        self.lfu_decay_minutes.load(Ordering::Relaxed)
    }

    /// Changes `lfu-log-factor` (at most [`MAX_LFU_SETTING`]).
    pub fn set_lfu_log_factor(&self, factor: u32) {
        self.lfu_log_factor.store(factor.min(MAX_LFU_SETTING), Ordering::Relaxed);
    }

    /// Changes `lfu-decay-time` (at most [`MAX_LFU_SETTING`]).
    pub fn set_lfu_decay_minutes(&self, minutes: u32) {
        self.lfu_decay_minutes.store(minutes.min(MAX_LFU_SETTING), Ordering::Relaxed);
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

/// Counts key lookups of reading commands.
pub(crate) fn count_lookups(hits: u64, misses: u64) {
    if hits > 0 {
        METRICS.hits.inc_by(hits);
    }
    if misses > 0 {
        METRICS.misses.inc_by(misses);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_redis_names() {
        for p in MaxmemoryPolicy::ALL {
            assert_eq!(MaxmemoryPolicy::parse(&p.name().to_uppercase()), Ok(p));
            assert_eq!(MaxmemoryPolicy::from_u8(p as u8), p);
            assert!(!(p.lru() && p.lfu()));
            assert_eq!(p.volatile_only(), p.name().starts_with("volatile-"), "{p:?}");
        }
        assert!(MaxmemoryPolicy::AllkeysLru.lru() && MaxmemoryPolicy::VolatileLfu.lfu());
        assert!(MaxmemoryPolicy::parse("sometimes").is_err());
        assert_eq!(parse_bytes("100mb"), Some(100 << 20));
        assert_eq!(parse_bytes("12"), Some(12));
        assert_eq!(parse_bytes("12 apples"), None);
        let m = Maxmemory::new(Limit::Bytes(1), MaxmemoryPolicy::VolatileTtl, 1000);
        assert_eq!((m.bytes(), m.policy(), m.samples()), (1, MaxmemoryPolicy::VolatileTtl, MAX_SAMPLES));
        assert!(m.policy().volatile_only() && !MaxmemoryPolicy::AllkeysRandom.volatile_only());
    }

    #[test]
    fn limits_are_bytes_or_a_share_of_the_region_and_show_as_set() {
        for (text, limit, shown) in [
            ("0", Limit::None, "0"),
            ("100mb", Limit::Bytes(100 << 20), "104857600"),
            ("50%", Limit::Share(5_000), "50%"),
            (" 12.5% ", Limit::Share(1_250), "12.5%"),
            ("0.01%", Limit::Share(1), "0.01%"),
            ("100%", Limit::Share(SHARE_SCALE), "100%"),
        ] {
            assert_eq!(Limit::parse(text), Ok(limit), "{text}");
            assert_eq!(limit.to_string(), shown);
            assert_eq!(Limit::parse(shown), Ok(limit), "{shown}");
            assert_eq!(Limit::decode(limit.encode()), limit);
        }
        for bad in ["0%", "101%", "50.001%", "%", "-5%", "5e2%", "50 %", "lots", "1.5mb"] {
            assert!(Limit::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Limit::Share(5_000).bytes_of(64 << 20), 32 << 20);
        assert_eq!(Limit::Share(1).bytes_of(100), 1, "a share never rounds to no limit");
        let m = Maxmemory::new(Limit::Share(2_500), MaxmemoryPolicy::AllkeysRandom, 5);
        assert_eq!(m.bytes(), 0, "no region known yet");
        m.set_region_bytes(1 << 30);
        assert_eq!(m.bytes(), 256 << 20);
        m.set_limit(Limit::Bytes(5));
        assert_eq!((m.limit(), m.bytes()), (Limit::Bytes(5), 5));
    }
}
