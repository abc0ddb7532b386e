//! The clock expiry times are kept in: absolute Unix time in milliseconds, the wall clock of
//! whichever host reads it.
//!
//! An item's expiry lives in its KV block as such a time, so every computenode and every
//! client library reading the block agrees on *when* it expires; each judges *whether* it
//! has by its own clock. Hosts are expected to keep their clocks in sync with NTP (on a LAN
//! they typically agree within a few milliseconds). A reader whose clock is `s` ms ahead of
//! the writer's sees a key expire `s` ms early, one behind sees it `s` ms late: a key lives
//! up to the skew longer or shorter than asked, never otherwise wrong.
//!
//! The memnode's active expiry ([`crate::expiry`]) removes an item only once its expiry is
//! [`MAX_CLOCK_SKEW_MS`] past by the memnode's clock, so a memnode within that skew of the
//! computenodes never removes a key that a computenode still considers live. Beyond it,
//! keys go early by the excess.
//!
//! The wall clock can step (an NTP correction, an administrator): a step forward expires
//! keys early, one back keeps them longer, by the step.

use std::time::{SystemTime, UNIX_EPOCH};

/// The clock skew between hosts racekv is built to tolerate (see the module doc): the
/// memnode's active expiry waits this long past an item's expiry before removing it.
pub const MAX_CLOCK_SKEW_MS: u64 = 100;

/// Now, as absolute Unix time in milliseconds (0 for a clock set before 1970).
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
}
