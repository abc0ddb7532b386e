//! Cache mode's access metadata: when a key was last read and how often, kept in its KV
//! block's access word and updated by readers with one-sided CAS (Ditto, SOSP'23, keeps
//! its eviction metadata with the object the same way). Nothing on the GET path runs on
//! the memnode's CPU.
//!
//! The word (8 bytes at [`crate::layout::ACCESS_WORD_OFFSET`] of every block written by
//! this build, outside the block's checksum) holds both of Redis' encodings side by side:
//!
//! ```text
//! access word: last read, Unix seconds u32 | LFU decrement time, minutes mod 2^16 u16 |
//!              LFU counter u8 | reserved u8 (0)
//! ```
//!
//! What a read updates depends on the [`Tracking`] its table is set to (the computenode
//! sets it from `maxmemory-policy`): nothing (every policy but the LRU and LFU ones, so
//! their GETs cost nothing more), the last-read second (LRU: a key read again within the
//! same second is not written), or Redis' logarithmic counter with its decay (LFU: the
//! counter grows with probability 1 / ((counter - 5) x log factor + 1), so a hot key's
//! word changes rarely). A reader writes the word only when it changes, by CAS from the
//! word it read: two readers racing lose one update (approximate, as Redis' sampled
//! eviction is anyway), and a CAS that reaches a block reused since changes nothing
//! unless the very same word is there.

/// Redis' `LFU_INIT_VAL`: a new key's counter, so it is not evicted before it is read.
pub const LFU_INIT_VAL: u8 = 5;
/// Redis' default `lfu-log-factor`.
pub const DEFAULT_LFU_LOG_FACTOR: u32 = 10;
/// Redis' default `lfu-decay-time`, in minutes.
pub const DEFAULT_LFU_DECAY_MINUTES: u32 = 1;

/// A block's access word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// When the key was last read (or written), Unix seconds.
    pub last_read_s: u32,
    /// When the LFU counter was last decremented (or read), minutes since the Unix epoch
    /// modulo 2^16 (Redis' `LFUGetTimeInMinutes`).
    pub lfu_minutes: u16,
    /// Redis' logarithmic access counter.
    pub lfu_counter: u8,
}

/// What reads update in their blocks' access words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tracking {
    /// Nothing: reads write nothing.
    #[default]
    Off,
    /// The last-read second (`*-lru` policies).
    Lru,
    /// The LFU counter and its decrement time (`*-lfu` policies).
    Lfu {
        /// Redis' `lfu-log-factor`: how much harder each increment gets.
        log_factor: u32,
        /// Redis' `lfu-decay-time`: minutes per decrement of an unread key (0: never).
        decay_minutes: u32,
    },
}

/// Most `lfu-decay-time` a [`Tracking`] word holds (2^24 - 1 minutes, 31 years).
pub const MAX_DECAY_MINUTES: u32 = (1 << 24) - 1;

impl Tracking {
    /// As one word, for an atomic a table's readers load on every read.
    pub fn encode(self) -> u64 {
        match self {
            Self::Off => 0,
            Self::Lru => 1,
            Self::Lfu { log_factor, decay_minutes } => {
                2 | (u64::from(log_factor) << 8) | (u64::from(decay_minutes.min(MAX_DECAY_MINUTES)) << 40)
            }
        }
    }

    /// The word back.
    pub fn decode(word: u64) -> Self {
        match word & 0xFF {
            1 => Self::Lru,
            2 => Self::Lfu { log_factor: (word >> 8) as u32, decay_minutes: (word >> 40) as u32 },
            _ => Self::Off,
        }
    }
}

impl Access {
    /// The word of a block written at `now_ms`: read now, a new key's counter.
    pub fn fresh(now_ms: u64) -> Self {
        Self { last_read_s: seconds(now_ms), lfu_minutes: minutes(now_ms), lfu_counter: LFU_INIT_VAL }
    }

    /// The 8 bytes stored in the block (little-endian).
    pub fn encode(self) -> u64 {
        u64::from(self.last_read_s) | (u64::from(self.lfu_minutes) << 32) | (u64::from(self.lfu_counter) << 48)
    }

    /// The word back (the reserved byte is ignored).
    pub fn decode(word: u64) -> Self {
        Self { last_read_s: word as u32, lfu_minutes: (word >> 32) as u16, lfu_counter: (word >> 48) as u8 }
    }

    /// The word after a read at `now_ms` under `tracking`; `random` is a uniform draw in
    /// [0, 1) for the LFU increment. Equal to `self` when nothing changes.
    pub fn touched(self, tracking: Tracking, now_ms: u64, random: f64) -> Self {
        match tracking {
            Tracking::Off => self,
            Tracking::Lru => Self { last_read_s: seconds(now_ms), ..self },
            Tracking::Lfu { log_factor, decay_minutes } => {
                let counter = log_increment(self.decayed_counter(now_ms, decay_minutes), log_factor, random);
                Self { lfu_minutes: minutes(now_ms), lfu_counter: counter, ..self }
            }
        }
    }

    /// Seconds since the last read at `now_ms` (0 for a read "in the future": another
    /// host's clock ahead of this one).
    pub fn idle_s(self, now_ms: u64) -> u64 {
        u64::from(seconds(now_ms)).saturating_sub(u64::from(self.last_read_s))
    }

    /// The LFU counter as of `now_ms`: one less per `decay_minutes` unread (Redis'
    /// `LFUDecrAndReturn`).
    pub fn decayed_counter(self, now_ms: u64, decay_minutes: u32) -> u8 {
        if decay_minutes == 0 {
            return self.lfu_counter;
        }
        let elapsed = minutes(now_ms).wrapping_sub(self.lfu_minutes);
        let periods = u32::from(elapsed) / decay_minutes;
        self.lfu_counter.saturating_sub(periods.min(255) as u8)
    }

    /// How good an eviction victim the key is under `tracking`, higher is better (Redis'
    /// "idle" score): seconds unread for LRU, 255 minus the decayed counter for LFU. A block
    /// of an earlier build, which has no access word, scores as never read.
    pub fn eviction_score(access: Option<Self>, tracking: Tracking, now_ms: u64) -> u64 {
        match (access, tracking) {
            (None, _) => u64::MAX,
            (Some(_), Tracking::Off) => 0,
            (Some(a), Tracking::Lru) => a.idle_s(now_ms),
            (Some(a), Tracking::Lfu { decay_minutes, .. }) => 255 - u64::from(a.decayed_counter(now_ms, decay_minutes)),
        }
    }
}

/// Redis' `LFULogIncr`: the counter grows by one with probability 1 / (base x factor + 1),
/// where base is how far it is above [`LFU_INIT_VAL`].
fn log_increment(counter: u8, log_factor: u32, random: f64) -> u8 {
    if counter == u8::MAX {
        return counter;
    }
    let base = f64::from(counter.saturating_sub(LFU_INIT_VAL));
    let p = 1.0 / (base * f64::from(log_factor) + 1.0);
    if random < p {
        counter + 1
    } else {
        counter
    }
}

fn seconds(now_ms: u64) -> u32 {
    (now_ms / 1000).min(u64::from(u32::MAX)) as u32
}

fn minutes(now_ms: u64) -> u16 {
    (now_ms / 60_000) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LFU: Tracking =
        Tracking::Lfu { log_factor: DEFAULT_LFU_LOG_FACTOR, decay_minutes: DEFAULT_LFU_DECAY_MINUTES };

    proptest! {
        #[test]
        fn words_round_trip(last_read_s in any::<u32>(), lfu_minutes in any::<u16>(), lfu_counter in any::<u8>()) {
            let a = Access { last_read_s, lfu_minutes, lfu_counter };
            prop_assert_eq!(Access::decode(a.encode()), a);
            prop_assert_eq!(a.encode() >> 56, 0, "the reserved byte stays 0");
        }

        /// Reads never lower a counter within a decay period, and an LRU read stamps now.
        #[test]
        fn reads_only_raise_what_they_track(counter in any::<u8>(), random in 0.0f64..1.0, now_s in 1_000u64..4_000_000_000) {
            let now_ms = now_s * 1000;
            let a = Access { lfu_counter: counter, ..Access::fresh(now_ms) };
            let lfu = a.touched(LFU, now_ms, random);
            prop_assert!(lfu.lfu_counter == counter || lfu.lfu_counter == counter + 1);
            prop_assert_eq!(lfu.last_read_s, a.last_read_s);
            let lru = Access { last_read_s: 0, ..a }.touched(Tracking::Lru, now_ms, random);
            prop_assert_eq!((lru.last_read_s, lru.lfu_counter), (now_s as u32, counter));
            prop_assert_eq!(a.touched(Tracking::Off, now_ms + 5_000_000, random), a);
        }
    }

    #[test]
    fn tracking_round_trips_through_its_word() {
        for t in [
            Tracking::Off,
            Tracking::Lru,
            LFU,
            Tracking::Lfu { log_factor: u32::MAX, decay_minutes: 0 },
            Tracking::Lfu { log_factor: 0, decay_minutes: MAX_DECAY_MINUTES },
        ] {
            assert_eq!(Tracking::decode(t.encode()), t);
        }
        let clamped = Tracking::Lfu { log_factor: 1, decay_minutes: u32::MAX };
        assert_eq!(
            Tracking::decode(clamped.encode()),
            Tracking::Lfu { log_factor: 1, decay_minutes: MAX_DECAY_MINUTES }
        );
    }

    #[test]
    fn lfu_counts_logarithmically_and_decays_by_the_minute() {
        let start = 1_700_000_000_000u64;
        let mut a = Access::fresh(start);
        assert_eq!(a.lfu_counter, LFU_INIT_VAL);
        // Deterministic draws spread over [0, 1): 1,000 reads give Redis' factor-10 figure
        // (18 at 1 K hits in redis.conf's table), far from the 255 a plain count reaches.
        for i in 0..1_000u64 {
            a = a.touched(LFU, start, (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as f64 / (1u64 << 53) as f64);
        }
        assert!((14..=24).contains(&a.lfu_counter), "counter {} after 1 K reads", a.lfu_counter);
        let later = start + 7 * 60_000;
        assert_eq!(a.decayed_counter(later, 1), a.lfu_counter - 7);
        assert_eq!(a.decayed_counter(later, 0), a.lfu_counter, "decay time 0: never");
        assert_eq!(a.decayed_counter(start + 1000 * 60_000, 1), 0);
        let score = |a, now| Access::eviction_score(Some(a), LFU, now);
        assert!(score(a, later) < score(Access::fresh(later), later), "the often-read key is kept");
        assert_eq!(Access::eviction_score(None, LFU, later), u64::MAX, "an old block goes first");
    }

    #[test]
    fn lru_idle_time_is_in_seconds_and_never_negative() {
        let a = Access::fresh(10_000);
        assert_eq!(a.idle_s(70_500), 60);
        assert_eq!(a.idle_s(1_000), 0);
        assert_eq!(Access::eviction_score(Some(a), Tracking::Lru, 70_500), 60);
        assert_eq!(a.touched(Tracking::Lru, 10_999, 0.5), a, "a read in the same second writes nothing");
    }

    #[test]
    fn the_minute_clock_wraps_as_redis_does() {
        let at = |minute: u64| minute * 60_000;
        let a = Access { lfu_minutes: u16::MAX, lfu_counter: 10, last_read_s: 0 };
        assert_eq!(a.decayed_counter(at(65_536 + 2), 1), 7, "3 minutes across the wrap");
    }
}
