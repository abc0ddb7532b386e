//! What every report carries about where and when it ran.

use serde::Serialize;

/// Where and when a benchmark ran.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    /// When it ran (RFC 3339, UTC).
    pub date_utc: String,
    /// The host's name.
    pub host: String,
    /// CPUs available to the process.
    pub cpus: usize,
    /// The CPU model, from /proc/cpuinfo.
    pub cpu_model: String,
    /// The kernel release.
    pub kernel: String,
    /// This build's version.
    pub racekv_version: &'static str,
    /// The command line.
    pub command: String,
}

impl Environment {
    /// Reads all of it now.
    pub fn capture() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_string()))
            .unwrap_or_else(|| "unknown".into());
        Self {
            date_utc: utc_now(),
            host: read("/proc/sys/kernel/hostname").trim().to_string(),
            cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            racekv_version: env!("CARGO_PKG_VERSION"),
            command: std::env::args().collect::<Vec<_>>().join(" "),
        }
    }
}

/// The current time as RFC 3339 UTC, from the system clock (no time-zone database needed).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_now_looks_like_rfc3339() {
        let t = super::utc_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'));
    }
}
