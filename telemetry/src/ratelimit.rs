//! Rate-limited warnings: what a hostile or broken peer can trigger at will (failed AUTH,
//! cross-protocol requests) is logged, but at most once per period, so it cannot flood the
//! logs; the metrics count every occurrence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// At most one line per period; counts the lines it held back.
#[derive(Debug)]
pub struct RateLimit {
    period_ms: u64,
    /// When the last line was written (Unix ms); 0: never.
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimit {
    /// One line per `period_ms`.
    pub const fn new(period_ms: u64) -> Self {
        Self { period_ms, last_ms: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// One line a minute.
    pub const fn per_minute() -> Self {
        Self::new(60_000)
    }

    /// Whether a line may be written now; if so, how many were held back since the last.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(now_ms())
    }

    fn admit_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now_ms.saturating_sub(last) < self.period_ms {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // One thread wins the period; the others count as held back.
        match self.last_ms.compare_exchange(last, now_ms.max(1), Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => Some(self.suppressed.swap(0, Ordering::Relaxed)),
            Err(_) => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Logs `message()` as a warning unless `limit` wrote a line less than its period ago.
pub fn limited_warn(limit: &RateLimit, message: impl FnOnce() -> String) {
    if let Some(held_back) = limit.admit() {
        if held_back > 0 {
            tracing::warn!("{} ({held_back} similar lines held back)", message());
        } else {
            tracing::warn!("{}", message());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_and_held_back_lines_are_counted() {
        let limit = RateLimit::per_minute();
        assert_eq!(limit.admit_at(1_000_000), Some(0));
        assert_eq!(limit.admit_at(1_000_001), None);
        assert_eq!(limit.admit_at(1_059_999), None);
        assert_eq!(limit.admit_at(1_060_000), Some(2));
        assert_eq!(limit.admit_at(1_060_001), None);
    }
}
