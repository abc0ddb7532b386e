//! Waiting, between the runs of a side-by-side benchmark, until every server is idle.
//!
//! On a 2-core machine a server still busy after its own run takes a core from the next
//! server measured: valkey-server's I/O thread keeps polling for 5 to 15+ seconds after its
//! clients leave (measured with io-threads 2, 2026-11-29), so whichever server ran right
//! after it was measured on one core. Each run therefore starts only once the servers'
//! processes (and this one, which hosts racekv's) have used at most [`IDLE_CPU_FRACTION`]
//! of a core over one [`SAMPLE`], waiting at most a bounded time.

use std::time::{Duration, Instant};

use serde::Serialize;

/// Linux's USER_HZ: the unit of `utime` and `stime` in `/proc/<pid>/stat` (100 on every
/// architecture the kernel exports it for).
const USER_HZ: u64 = 100;
/// One sample of the processes' CPU time.
const SAMPLE: Duration = Duration::from_millis(300);
/// The most of one core the processes may use, together, over a sample, to count as idle.
const IDLE_CPU_FRACTION: f64 = 0.1;

/// CPU time (user + system) of process `pid` so far, in USER_HZ ticks; None when it is gone
/// or its stat line is unreadable.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    parse_cpu_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// utime + stime of a `/proc/<pid>/stat` line.
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields are counted from
    // after its closing one, where field 3 (the state) is index 0.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// How the waits of one benchmark went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IdleWaits {
    /// Waits made (one before each run).
    pub waits: u32,
    /// Waits that gave up at their limit: those runs started with a server still busy.
    pub timeouts: u32,
    /// The longest wait, in milliseconds.
    pub longest_ms: u64,
}

impl IdleWaits {
    /// Sleeps until processes `pids` (together) are idle, or `max_wait` has passed (zero:
    /// returns at once, counting nothing).
    pub fn wait(&mut self, pids: &[u32], max_wait: Duration) {
        if max_wait.is_zero() {
            return;
        }
        let start = Instant::now();
        let idle_ticks = (IDLE_CPU_FRACTION * SAMPLE.as_secs_f64() * USER_HZ as f64).ceil() as u64;
        let total = || pids.iter().filter_map(|&pid| cpu_ticks(pid)).sum::<u64>();
        let mut before = total();
        let idle = loop {
            std::thread::sleep(SAMPLE);
            let now = total();
            if now.saturating_sub(before) <= idle_ticks {
                break true;
            }
            if start.elapsed() >= max_wait {
                break false;
            }
            before = now;
        };
        self.waits += 1;
        self.longest_ms = self.longest_ms.max(start.elapsed().as_millis() as u64);
        if !idle {
            self.timeouts += 1;
            eprintln!("a server was still busy after {max_wait:?}: the next run shares the CPU with it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time_that_grows_when_it_works() {
        let pid = std::process::id();
        let before = cpu_ticks(pid).expect("our own stat line");
        let start = Instant::now();
        let mut x = 0u64;
        while cpu_ticks(pid).expect("our own stat line") == before {
            assert!(start.elapsed() < Duration::from_secs(30), "30 s of work left the ticks at {before}");
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
    }

    #[test]
    fn the_times_come_from_after_the_command_name_whatever_it_holds() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 567 0 0 20 0 3 0 99 0 0";
        assert_eq!(parse_cpu_ticks(line), Some(1234 + 567));
        assert_eq!(parse_cpu_ticks("4242 (x) S 1 2"), None);
        assert_eq!(parse_cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn a_missing_process_has_no_ticks_and_counts_as_idle() {
        assert_eq!(cpu_ticks(u32::MAX), None);
        let mut waits = IdleWaits::default();
        waits.wait(&[u32::MAX], Duration::from_secs(5));
        assert_eq!((waits.waits, waits.timeouts), (1, 0));
    }
}
