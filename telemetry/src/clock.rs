//! The wall clock racekv keeps expiry times in: absolute Unix time in milliseconds. One
//! function, so the table, the client library and the Redis front end all read the same
//! clock; what a skew between hosts does is `racekv_hashing::clock`'s to say.

use std::time::{SystemTime, UNIX_EPOCH};

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
