//! `SLOWLOG` and `LATENCY`: per-server records of slow commands, bounded.
//!
//! Every command compares its time with two thresholds (one atomic load each); only a
//! command past one takes a lock. The slow log is a ring of at most `slowlog-max-len` entries
//! (itself at most [`MAX_SLOWLOG_LEN`]), each holding at most [`SLOWLOG_ENTRY_MAX_ARGC`]
//! arguments of at most [`SLOWLOG_ENTRY_MAX_STRING`] bytes, as Redis trims them. The latency
//! monitor keeps, per event (`command`, `fast-command`), the latest and largest latency and
//! one sample per second for the last [`LATENCY_HISTORY_LEN`] samples, as Redis' does; with
//! `latency-monitor-threshold 0` (the default) it records nothing and `LATENCY LATEST` is
//! empty.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::resp::Command;

/// Most arguments a slow log entry keeps (Redis' `SLOWLOG_ENTRY_MAX_ARGC`); the last one
/// kept then says how many more there were.
pub const SLOWLOG_ENTRY_MAX_ARGC: usize = 32;
/// Longest argument a slow log entry keeps (Redis' `SLOWLOG_ENTRY_MAX_STRING`).
pub const SLOWLOG_ENTRY_MAX_STRING: usize = 128;
/// Largest `slowlog-max-len` racekv accepts: at most ~4 KiB per entry, 40 MiB in all.
pub const MAX_SLOWLOG_LEN: u64 = 10_000;
/// Samples per event the latency monitor keeps (Redis' `LATENCY_TS_LEN`).
pub const LATENCY_HISTORY_LEN: usize = 160;

/// Seconds since the Unix epoch.
pub(crate) fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// One slow command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlowEntry {
    pub id: u64,
    pub unix_time: u64,
    pub micros: u64,
    pub args: Vec<Vec<u8>>,
    pub peer: String,
    pub name: Vec<u8>,
}

/// The slow log of one server.
#[derive(Debug, Default)]
pub(crate) struct SlowLog {
    entries: Mutex<VecDeque<SlowEntry>>,
    next_id: AtomicU64,
}

/// What a slow log entry keeps of a command's arguments: Redis' trimming, and secrets
/// replaced (passwords of AUTH, HELLO AUTH, ACL SETUSER and CONFIG SET requirepass).
pub(crate) fn logged_args(cmd: &Command) -> Vec<Vec<u8>> {
    let argc = cmd.len();
    let kept = argc.min(SLOWLOG_ENTRY_MAX_ARGC);
    let redact_from = redacted_from(cmd);
    (0..kept)
        .map(|j| {
            if kept != argc && j == kept - 1 {
                return format!("... ({} more arguments)", argc - kept + 1).into_bytes();
            }
            if j >= redact_from {
                return b"(redacted)".to_vec();
            }
            let arg = cmd.arg(j);
            if arg.len() > SLOWLOG_ENTRY_MAX_STRING {
                let mut trimmed = arg[..SLOWLOG_ENTRY_MAX_STRING].to_vec();
                trimmed
                    .extend_from_slice(format!("... ({} more bytes)", arg.len() - SLOWLOG_ENTRY_MAX_STRING).as_bytes());
                trimmed
            } else {
                arg.to_vec()
            }
        })
        .collect()
}

/// The first argument of `cmd` that may hold a secret.
fn redacted_from(cmd: &Command) -> usize {
    let is = |i: usize, name: &[u8]| cmd.get(i).is_some_and(|a| a.eq_ignore_ascii_case(name));
    if is(0, b"auth") {
        1
    } else if is(0, b"hello") {
        (2..cmd.len()).find(|&i| is(i, b"auth")).map_or(usize::MAX, |i| i + 1)
    } else if (is(0, b"acl") && is(1, b"setuser")) || (is(0, b"config") && is(1, b"set")) {
        3
    } else {
        usize::MAX
    }
}

impl SlowLog {
    /// Adds an entry, dropping the oldest beyond `max_len` (0: keep none).
    pub fn push(&self, max_len: usize, micros: u64, args: Vec<Vec<u8>>, peer: String, name: Vec<u8>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock();
        entries.push_front(SlowEntry { id, unix_time: unix_seconds(), micros, args, peer, name });
        entries.truncate(max_len);
    }

    /// The newest `count` entries (all with `None`), newest first.
    pub fn newest(&self, count: Option<usize>) -> Vec<SlowEntry> {
        let entries = self.entries.lock();
        entries.iter().take(count.unwrap_or(usize::MAX)).cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn reset(&self) {
        self.entries.lock().clear();
    }

    /// Applies a smaller `slowlog-max-len` now.
    pub fn trim(&self, max_len: usize) {
        self.entries.lock().truncate(max_len);
    }
}

/// One latency event's record.
#[derive(Debug, Clone, Default)]
pub(crate) struct LatencyEvent {
    /// (unix time, milliseconds), oldest first, one per second.
    pub samples: VecDeque<(u64, u64)>,
    pub max_ms: u64,
}

/// The latency monitor of one server.
#[derive(Debug, Default)]
pub(crate) struct LatencyMonitor {
    events: Mutex<BTreeMap<&'static str, LatencyEvent>>,
}

impl LatencyMonitor {
    /// Records `ms` for `event` (within a second, the larger sample is kept).
    pub fn add(&self, event: &'static str, ms: u64) {
        let now = unix_seconds();
        let mut events = self.events.lock();
        let record = events.entry(event).or_default();
        record.max_ms = record.max_ms.max(ms);
        match record.samples.back_mut() {
            Some((time, latest)) if *time == now => *latest = (*latest).max(ms),
            _ => {
                record.samples.push_back((now, ms));
                if record.samples.len() > LATENCY_HISTORY_LEN {
                    record.samples.pop_front();
                }
            }
        }
    }

    /// Every event with its latest sample and maximum.
    pub fn latest(&self) -> Vec<(&'static str, u64, u64, u64)> {
        let events = self.events.lock();
        events.iter().filter_map(|(name, e)| e.samples.back().map(|&(time, ms)| (*name, time, ms, e.max_ms))).collect()
    }

    /// The samples of `event`, oldest first.
    pub fn history(&self, event: &[u8]) -> Vec<(u64, u64)> {
        let events = self.events.lock();
        events
            .iter()
            .find(|(name, _)| name.as_bytes() == event)
            .map(|(_, e)| e.samples.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Forgets `events` (all when empty); returns how many were reset.
    pub fn reset(&self, events: &[&[u8]]) -> usize {
        let mut all = self.events.lock();
        if events.is_empty() {
            let n = all.len();
            all.clear();
            return n;
        }
        let before = all.len();
        all.retain(|name, _| !events.iter().any(|e| e.eq_ignore_ascii_case(name.as_bytes())));
        before - all.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_log_is_a_bounded_ring_newest_first() {
        let log = SlowLog::default();
        for i in 0..5u64 {
            log.push(3, i, vec![b"get".to_vec()], "1.2.3.4:5".into(), Vec::new());
        }
        let entries = log.newest(None);
        assert_eq!(entries.iter().map(|e| e.id).collect::<Vec<_>>(), [4, 3, 2]);
        assert_eq!(log.newest(Some(1))[0].micros, 4);
        log.trim(1);
        assert_eq!(log.len(), 1);
        log.reset();
        assert_eq!(log.len(), 0);
    }

    #[test]
    fn arguments_are_trimmed_and_secrets_redacted_as_redis_does() {
        let long = "x".repeat(200);
        let mut args: Vec<String> = vec!["mset".into(), long.clone()];
        args.extend((0..40).map(|i| i.to_string()));
        let logged = logged_args(&Command::from_args(&args));
        assert_eq!(logged.len(), SLOWLOG_ENTRY_MAX_ARGC);
        assert_eq!(logged[1], format!("{}... (72 more bytes)", &long[..128]).into_bytes());
        assert_eq!(logged[31], b"... (11 more arguments)".to_vec());
        let auth = logged_args(&Command::from_args(["AUTH", "user", "secret"]));
        assert_eq!(auth, [b"AUTH".to_vec(), b"(redacted)".to_vec(), b"(redacted)".to_vec()]);
        let hello = logged_args(&Command::from_args(["hello", "3", "AUTH", "u", "p", "SETNAME", "n"]));
        assert_eq!(hello[2], b"AUTH".to_vec());
        assert_eq!(hello[3], b"(redacted)".to_vec());
        let config = logged_args(&Command::from_args(["config", "set", "requirepass", "pw"]));
        assert_eq!(config[2], b"requirepass".to_vec());
        assert_eq!(config[3], b"(redacted)".to_vec());
        assert_eq!(logged_args(&Command::from_args(["get", "k"]))[1], b"k".to_vec());
    }

    #[test]
    fn latency_monitor_keeps_latest_and_max() {
        let monitor = LatencyMonitor::default();
        assert!(monitor.latest().is_empty());
        monitor.add("command", 5);
        monitor.add("command", 3);
        monitor.add("fast-command", 1);
        let latest = monitor.latest();
        assert_eq!(latest.len(), 2);
        let (name, _, _, max) = latest[0];
        assert_eq!((name, max), ("command", 5));
        assert!(!monitor.history(b"command").is_empty());
        assert_eq!(monitor.reset(&[b"COMMAND"]), 1);
        assert_eq!(monitor.reset(&[]), 1);
    }
}
