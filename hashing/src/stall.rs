//! Whether a read surely finished within the grace period, or must check its slot again.
//!
//! A block unlinked from its slot is reused only after the grace period (`alloc.rs`),
//! counted from when its writer saw the CAS that unlinked it. That CAS ran after any reader
//! that saw the old slot word had read it, so a reader whose block READ came back less than
//! the grace period after it *sent* its bucket READ read the block its slot pointed to. A
//! reader that took longer (preempted, a slow network) may have read the block after it was
//! reused for a newer write of the same key, one whose CAS may never happen; it must read
//! the slot again and trust the block only if the slot still holds the word it followed.
//!
//! Every lookup takes two readings, so they come from the CPU's time-stamp counter (quanta:
//! ~10 ns, against ~25-35 ns for `Instant` on a VM) where the kernel itself keeps time with
//! it, which says the counter is steady and in step across CPUs (a thread may move between
//! its two readings); elsewhere from the OS's monotonic clock. Not the coarse clock: it lags
//! for as long as timer ticks are late (a VM whose timekeeping vCPU is descheduled), so it
//! can shorten a stall, and stalls are what this is for.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// A reading of a [`StallClock`] (units are the clock's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp(u64);

/// Tells reads that surely beat the grace period from those that may not have.
#[derive(Debug, Clone)]
pub(crate) struct StallClock {
    /// The time-stamp counter, or None for the OS clock (nanoseconds since `origin`).
    counter: Option<&'static quanta::Clock>,
    origin: Instant,
    /// A read is trusted when it took fewer raw units than this: the grace period less a
    /// tenth, kept back for what no clock here sees (the writer's clock running a little
    /// fast against ours, its bookkeeping between CAS and timestamp).
    trust_below_raw: u64,
}

/// The time-stamp counter, where the kernel keeps time with it; calibrated once per
/// process (about half a millisecond, at the first table's opening).
static COUNTER: LazyLock<Option<quanta::Clock>> = LazyLock::new(|| {
    std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        .is_ok_and(|name| name.trim() == "tsc")
        .then(quanta::Clock::new)
});

impl StallClock {
    /// A clock for readers of a table whose writers wait at least `grace` before reuse.
    pub fn new(grace: Duration) -> Self {
        Self::with_counter(COUNTER.as_ref(), grace)
    }

    fn with_counter(counter: Option<&'static quanta::Clock>, grace: Duration) -> Self {
        let trust_ns = u64::try_from((grace - grace / 10).as_nanos()).unwrap_or(u64::MAX);
        let trust_below_raw = match counter {
            // The most raw units that still scale to less than `trust_ns` (scaling is
            // monotonic), so each check is a subtraction and a comparison.
            Some(clock) => {
                let (mut below, mut above) = (0u64, u64::MAX);
                while above - below > 1 {
                    let mid = below + (above - below) / 2;
                    if clock.delta_as_nanos(0, mid) < trust_ns {
                        below = mid;
                    } else {
                        above = mid;
                    }
                }
                if trust_ns == 0 {
                    0
                } else {
                    above
                }
            }
            None => trust_ns,
        };
        Self { counter, origin: Instant::now(), trust_below_raw }
    }

    #[inline]
    pub fn now(&self) -> Stamp {
        Stamp(match self.counter {
            Some(clock) => clock.raw(),
            None => u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX),
        })
    }

    /// Whether an operation that began at `since` and ends now surely took less than the
    /// grace period allows. A clock that seems to run backwards (counters out of step
    /// across CPUs) trusts nothing.
    #[inline]
    pub fn surely_within(&self, since: Stamp) -> bool {
        self.now().0.wrapping_sub(since.0) < self.trust_below_raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static ANY_COUNTER: LazyLock<quanta::Clock> = LazyLock::new(quanta::Clock::new);

    fn both(grace: Duration) -> [StallClock; 2] {
        [StallClock::with_counter(Some(&ANY_COUNTER), grace), StallClock::with_counter(None, grace)]
    }

    #[test]
    fn a_quick_read_is_trusted_and_a_slow_one_is_not() {
        for clock in both(Duration::from_secs(10)) {
            assert!(clock.surely_within(clock.now()), "{clock:?}: a read of (nearly) no time at all");
        }
        for clock in both(Duration::from_millis(100)) {
            let start = clock.now();
            std::thread::sleep(Duration::from_millis(120));
            assert!(!clock.surely_within(start), "{clock:?}: 120 ms against a grace period of 100 ms");
        }
    }

    #[test]
    fn a_read_near_the_grace_period_is_not_trusted() {
        // 95 ms of a 100 ms grace period: past the tenth kept back.
        for clock in both(Duration::from_millis(100)) {
            let start = clock.now();
            std::thread::sleep(Duration::from_millis(95));
            assert!(!clock.surely_within(start), "{clock:?}");
        }
    }

    #[test]
    fn a_clock_running_backwards_trusts_nothing() {
        for clock in both(Duration::from_secs(10)) {
            let later = Stamp(clock.now().0 + 1_000_000_000);
            assert!(!clock.surely_within(later), "{clock:?}");
        }
    }

    #[test]
    fn the_threshold_in_counter_units_is_the_grace_period_less_a_tenth() {
        let clock = StallClock::with_counter(Some(&ANY_COUNTER), Duration::from_millis(10));
        assert!(ANY_COUNTER.delta(0, clock.trust_below_raw - 1) < Duration::from_millis(9));
        assert!(ANY_COUNTER.delta(0, clock.trust_below_raw) >= Duration::from_millis(9));
    }

    #[test]
    fn no_grace_period_trusts_nothing() {
        for clock in both(Duration::ZERO) {
            assert!(!clock.surely_within(clock.now()), "{clock:?}");
        }
    }

    #[test]
    fn the_counter_measures_what_the_os_clock_does() {
        // Best of three, so a preemption between two paired readings cannot fail it.
        let counter = &*ANY_COUNTER;
        let offs: Vec<_> = (0..3)
            .map(|_| {
                let (raw, started) = (counter.raw(), Instant::now());
                std::thread::sleep(Duration::from_millis(50));
                let (by_os, by_counter) = (started.elapsed(), counter.delta(raw, counter.raw()));
                by_counter.abs_diff(by_os)
            })
            .collect();
        assert!(offs.iter().any(|&off| off < Duration::from_millis(2)), "counter vs OS clock over 50 ms: {offs:?}");
    }
}
