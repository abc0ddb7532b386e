//! The wall clock racekv keeps expiry times in: absolute Unix time in milliseconds. One
//! function, so the table, the client library and the Redis front end all read the same
//! clock; what a skew between hosts does is `racekv_hashing::clock`'s to say.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, as absolute Unix time in milliseconds (0 for a clock set before 1970).
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, unix_ms)
}

/// [`now_unix_ms`] from the kernel's tick-granular clock (`CLOCK_REALTIME_COARSE`, a few
/// milliseconds behind at most), which costs a memory read where the precise one reads and
/// scales the TSC. For what counts in seconds (an item's last access, its LFU decay): never
/// for expiry, which [`now_unix_ms`] decides.
pub fn now_unix_ms_coarse() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE) {
        Ok(t) if t.tv_sec() < 0 => 0,
        Ok(t) => unix_ms(Duration::from(t)),
        Err(_) => now_unix_ms(),
    }
}

/// Milliseconds of a time since the Unix epoch.
fn unix_ms(since_epoch: Duration) -> u64 {
    u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_is_unix_milliseconds() {
        let seconds = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        let ms = now_unix_ms();
        // Within a second of the seconds read just before (2020-01-01 is 1_577_836_800 s).
        assert!(ms / 1000 >= seconds && ms / 1000 <= seconds + 1, "{ms} ms against {seconds} s");
        assert!(ms > 1_577_836_800_000);
    }

    #[test]
    fn the_coarse_clock_is_the_same_clock_within_a_tick() {
        let before = now_unix_ms();
        let coarse = now_unix_ms_coarse();
        let after = now_unix_ms();
        // A tick is at most 10 ms (HZ >= 100), a tickless idle CPU's catch-up a little more;
        // the coarse clock lags, never leads.
        assert!(coarse + 50 >= before && coarse <= after, "{before} <= {coarse} (+50) <= {after}");
    }
}
