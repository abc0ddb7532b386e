//! Per-server state shared by a server's connections ([`ServerStats`]: counters, run-time
//! settings, the client registry, the slow log) and the text of `INFO`.
//!
//! Prometheus metrics are process-wide (several servers in one process sum up); these
//! belong to one server, so `INFO` describes the server the client talks to. `INFO` speaks
//! Redis' field names, which redis-cli, redis_exporter and RedisInsight read; racekv's own
//! facts are in fields and a section (`storage`) of their own.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::acl::catalog::MAX_COMMAND_IDS;
use super::clients::Registry;
use super::metrics::METRICS;
use super::settings::Settings;
use super::slowlog::{unix_seconds, LatencyMonitor, SlowLog};
use super::store::StoreError;

/// The Redis version racekv speaks (RESP2 and RESP3, a subset of 7.2's commands). Tools parse
/// `redis_version` as a version number, so racekv's own version has a field of its own.
pub const REDIS_COMPAT_VERSION: &str = "7.2.0";

/// Most distinct error codes `INFO errorstats` tracks (Redis' `ERROR_STATS_NUMBER`); later
/// codes are counted in `total_error_replies` only.
pub const MAX_ERROR_CODES: usize = 128;

/// `INFO`'s rates (`instantaneous_ops_per_sec`, ...) are measured between the current call
/// and the newest sample at least this old (or the oldest one kept): racekv samples when
/// `INFO` runs instead of waking up ten times a second as Redis' cron does.
const RATE_WINDOW: Duration = Duration::from_secs(1);
/// Samples closer together than this are not kept.
const MIN_SAMPLE_GAP: Duration = Duration::from_millis(100);

/// Per-command counters (`INFO commandstats`), indexed by catalog id.
#[derive(Debug, Default)]
pub(crate) struct CommandStat {
    calls: AtomicU64,
    usec: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
}

/// How a command ended, for `INFO commandstats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It ran and answered without an error.
    Ok,
    /// It ran and answered an error.
    Failed,
    /// It was refused before running (arity, access control, ...).
    Rejected,
}

/// Commands of one catalog id, as `INFO commandstats` counts them: a connection's tally
/// gathers them, [`ServerStats::command_stats`] adds them to the server's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CommandCounts {
    /// Commands that ran (answered or failed).
    pub calls: u64,
    /// Of those, the ones that answered an error.
    pub failed: u64,
    /// Commands refused before running.
    pub rejected: u64,
    /// Microseconds the calls took together.
    pub usec: u64,
}

impl CommandCounts {
    /// Counts one command that ended with `outcome` after `micros`.
    pub fn add(&mut self, outcome: Outcome, micros: u64) {
        if outcome == Outcome::Rejected {
            self.rejected += 1;
            return;
        }
        self.calls += 1;
        self.usec += micros;
        if outcome == Outcome::Failed {
            self.failed += 1;
        }
    }
}

/// A sample of the cumulative counters, for rates.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    commands: u64,
    input: u64,
    output: u64,
}

/// Counters and shared state of one server.
#[derive(Debug)]
pub struct ServerStats {
    started: Instant,
    started_unix: u64,
    run_id: String,
    tcp_port: u16,
    pub(crate) settings: Settings,
    pub(crate) clients: Registry,
    pub(crate) slowlog: SlowLog,
    pub(crate) latency: LatencyMonitor,
    connected_clients: AtomicUsize,
    total_connections: AtomicU64,
    rejected_connections: AtomicU64,
    total_commands: AtomicU64,
    net_input_bytes: AtomicU64,
    net_output_bytes: AtomicU64,
    protocol_errors: AtomicU64,
    keyspace_hits: AtomicU64,
    keyspace_misses: AtomicU64,
    total_error_replies: AtomicU64,
    /// Connections watching keys (WATCH) and the keys they watch (Redis 7.4's INFO fields).
    watching_clients: AtomicU64,
    watched_keys: AtomicU64,
    commands: Vec<CommandStat>,
    errors: Mutex<BTreeMap<String, u64>>,
    samples: Mutex<VecDeque<Sample>>,
}

impl ServerStats {
    /// Fresh counters for a server on `tcp_port` admitting `max_clients`.
    pub fn new(tcp_port: u16, max_clients: usize, idle_timeout: Option<Duration>) -> Self {
        let started = Instant::now();
        let mut run_id = [0u8; 20];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut run_id);
        Self {
            started,
            started_unix: unix_seconds(),
            run_id: crate::acl::user::to_hex(&run_id),
            tcp_port,
            settings: Settings::new(max_clients, idle_timeout),
            clients: Registry::new(started),
            slowlog: SlowLog::default(),
            latency: LatencyMonitor::default(),
            connected_clients: AtomicUsize::new(0),
            total_connections: AtomicU64::new(0),
            rejected_connections: AtomicU64::new(0),
            total_commands: AtomicU64::new(0),
            net_input_bytes: AtomicU64::new(0),
            net_output_bytes: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            keyspace_hits: AtomicU64::new(0),
            keyspace_misses: AtomicU64::new(0),
            total_error_replies: AtomicU64::new(0),
            watching_clients: AtomicU64::new(0),
            watched_keys: AtomicU64::new(0),
            commands: (0..MAX_COMMAND_IDS).map(|_| CommandStat::default()).collect(),
            errors: Mutex::new(BTreeMap::new()),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// The port the server listens on.
    pub fn tcp_port(&self) -> u16 {
        self.tcp_port
    }

    /// Connections open now.
    pub fn connected_clients(&self) -> usize {
        self.connected_clients.load(Ordering::Acquire)
    }

    /// The client limit now (`CONFIG SET maxclients` changes it).
    pub fn max_clients(&self) -> usize {
        self.settings.max_clients()
    }

    /// The idle timeout now (`None`: never; `CONFIG SET timeout` changes it).
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.settings.idle_timeout()
    }

    /// Connections accepted since start (refused ones excluded).
    pub fn total_connections(&self) -> u64 {
        self.total_connections.load(Ordering::Relaxed)
    }

    /// Connections refused because of `max_clients`.
    pub fn rejected_connections(&self) -> u64 {
        self.rejected_connections.load(Ordering::Relaxed)
    }

    /// Commands executed since start (errors included).
    pub fn total_commands_processed(&self) -> u64 {
        self.total_commands.load(Ordering::Relaxed)
    }

    /// Connections closed for a protocol error since start.
    pub fn protocol_errors(&self) -> u64 {
        self.protocol_errors.load(Ordering::Relaxed)
    }

    /// Lookups of reading commands that found their key, and that did not.
    pub fn keyspace_hits_and_misses(&self) -> (u64, u64) {
        (self.keyspace_hits.load(Ordering::Relaxed), self.keyspace_misses.load(Ordering::Relaxed))
    }

    /// The longest string a command may build (`proto-max-bulk-len`: the parser's limit).
    pub(crate) fn proto_max_bulk_len(&self) -> usize {
        self.settings.proto_max_bulk_len()
    }

    /// Takes a slot if fewer than `max_clients` are connected. Only the accepting thread
    /// calls this, so check-then-add cannot overshoot.
    pub(crate) fn try_admit(&self) -> bool {
        if self.connected_clients.load(Ordering::Acquire) >= self.max_clients() {
            self.rejected_connections.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.connected_clients.fetch_add(1, Ordering::AcqRel);
        self.total_connections.fetch_add(1, Ordering::Relaxed);
        true
    }

    pub(crate) fn client_gone(&self) {
        self.connected_clients.fetch_sub(1, Ordering::AcqRel);
    }

    /// A connection's WATCHed keys went from `before` to `after`.
    pub(crate) fn watching(&self, before: usize, after: usize) {
        if before == 0 && after > 0 {
            self.watching_clients.fetch_add(1, Ordering::Relaxed);
        } else if before > 0 && after == 0 {
            self.watching_clients.fetch_sub(1, Ordering::Relaxed);
        }
        if after >= before {
            self.watched_keys.fetch_add((after - before) as u64, Ordering::Relaxed);
        } else {
            self.watched_keys.fetch_sub((before - after) as u64, Ordering::Relaxed);
        }
    }

    /// `n` more commands processed (`INFO`'s `total_commands_processed`).
    pub(crate) fn commands_done(&self, n: u64) {
        if n > 0 {
            self.total_commands.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn add_io(&self, input_bytes: u64, output_bytes: u64) {
        self.net_input_bytes.fetch_add(input_bytes, Ordering::Relaxed);
        self.net_output_bytes.fetch_add(output_bytes, Ordering::Relaxed);
    }

    pub(crate) fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A reading command looked a key up (`INFO`'s `keyspace_hits` / `keyspace_misses`).
    pub(crate) fn keyspace_lookup(&self, hit: bool) {
        self.keyspace_lookups(u64::from(hit), u64::from(!hit));
    }

    /// Reading commands found `hits` keys and missed `misses`.
    pub(crate) fn keyspace_lookups(&self, hits: u64, misses: u64) {
        if hits > 0 {
            self.keyspace_hits.fetch_add(hits, Ordering::Relaxed);
            METRICS.keyspace_lookups.with_label_values(&["hit"]).inc_by(hits);
        }
        if misses > 0 {
            self.keyspace_misses.fetch_add(misses, Ordering::Relaxed);
            METRICS.keyspace_lookups.with_label_values(&["miss"]).inc_by(misses);
        }
        crate::maxmemory::count_lookups(hits, misses);
    }

    /// Counts one command (`id`: its catalog id) for `INFO commandstats`.
    #[cfg(test)]
    pub(crate) fn command_stat(&self, id: u16, micros: u64, outcome: Outcome) {
        let mut counts = CommandCounts::default();
        counts.add(outcome, micros);
        self.command_stats(id, &counts);
    }

    /// Adds commands of catalog id `id` to `INFO commandstats`.
    pub(crate) fn command_stats(&self, id: u16, counts: &CommandCounts) {
        let Some(stat) = self.commands.get(usize::from(id)) else { return };
        let CommandCounts { calls, failed, rejected, usec } = *counts;
        for (counter, n) in
            [(&stat.calls, calls), (&stat.failed, failed), (&stat.rejected, rejected), (&stat.usec, usec)]
        {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Counts an error reply by its code (the first word, as Redis takes it).
    pub(crate) fn error_reply(&self, message: &str) {
        self.total_error_replies.fetch_add(1, Ordering::Relaxed);
        let head = &message.as_bytes()[..message.len().min(32)];
        let code = match head.iter().position(|&b| b == b' ') {
            Some(end) => &message[..end],
            None => "ERR",
        };
        let mut errors = self.errors.lock();
        if let Some(count) = errors.get_mut(code) {
            *count += 1;
        } else if errors.len() < MAX_ERROR_CODES {
            errors.insert(code.to_string(), 1);
        } else {
            return;
        }
        METRICS.error_replies.with_label_values(&[code]).inc();
    }

    /// `CONFIG RESETSTAT`: zeroes what Redis' does (command, error and keyspace counters,
    /// connection and traffic totals); the slow log and settings stay.
    pub(crate) fn reset(&self) {
        for counter in [
            &self.total_connections,
            &self.rejected_connections,
            &self.total_commands,
            &self.net_input_bytes,
            &self.net_output_bytes,
            &self.protocol_errors,
            &self.keyspace_hits,
            &self.keyspace_misses,
            &self.total_error_replies,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        for stat in &self.commands {
            for counter in [&stat.calls, &stat.usec, &stat.rejected, &stat.failed] {
                counter.store(0, Ordering::Relaxed);
            }
        }
        self.errors.lock().clear();
        self.samples.lock().clear();
    }

    /// Per second over the rate window: commands, input KiB, output KiB.
    fn rates(&self) -> (u64, f64, f64) {
        let now = Sample {
            at: Instant::now(),
            commands: self.total_commands_processed(),
            input: self.net_input_bytes.load(Ordering::Relaxed),
            output: self.net_output_bytes.load(Ordering::Relaxed),
        };
        let mut samples = self.samples.lock();
        let base =
            samples.iter().rev().find(|s| now.at.duration_since(s.at) >= RATE_WINDOW).or(samples.front()).copied();
        if samples.back().is_none_or(|last| now.at.duration_since(last.at) >= MIN_SAMPLE_GAP) {
            samples.push_back(now);
        }
        // Keep one sample older than the window, and everything newer.
        while samples.len() > 1 && now.at.duration_since(samples[1].at) >= RATE_WINDOW {
            samples.pop_front();
        }
        let Some(base) = base.filter(|b| now.at > b.at) else {
            return (0, 0.0, 0.0);
        };
        let seconds = now.at.duration_since(base.at).as_secs_f64();
        let per_second = |later: u64, earlier: u64| later.saturating_sub(earlier) as f64 / seconds;
        (
            per_second(now.commands, base.commands).round() as u64,
            per_second(now.input, base.input) / 1024.0,
            per_second(now.output, base.output) / 1024.0,
        )
    }
}

/// What `INFO` asks the storage (only for the sections that need it).
pub(crate) trait InfoSource {
    /// racekv's storage lines (the `storage` section).
    fn storage_lines(&mut self) -> Result<String, StoreError>;
    /// Keys stored (`db0:keys=`).
    fn key_count(&mut self) -> Result<u64, StoreError>;
    /// Keys with an expiry (`db0:expires=`).
    fn keys_with_expiry(&mut self) -> Result<u64, StoreError>;
}

/// The sections `INFO` knows, in output order, and whether `INFO` / `INFO default` shows
/// each (`all` and `everything` show every one).
const SECTIONS: [(&str, bool); 13] = [
    ("server", true),
    ("clients", true),
    ("memory", true),
    ("persistence", true),
    ("stats", true),
    ("replication", true),
    ("cpu", true),
    ("modules", true),
    ("commandstats", false),
    ("errorstats", true),
    ("cluster", true),
    ("keyspace", true),
    ("storage", true),
];

/// Renders `INFO` for the requested `sections` (none or `default`: the default ones, `all`
/// or `everything`: all; unknown names are ignored, as in Redis). `names` gives a catalog
/// id's command name (`client|list`).
pub(crate) fn render(
    stats: &ServerStats,
    sections: &[&[u8]],
    names: &dyn Fn(u16) -> String,
    store: &mut dyn InfoSource,
) -> Result<String, StoreError> {
    let asked = |name: &str| sections.iter().any(|s| s.eq_ignore_ascii_case(name.as_bytes()));
    let all = asked("all") || asked("everything");
    let default = sections.is_empty() || asked("default");
    let mut out = String::new();
    for (name, in_default) in SECTIONS {
        if !(all || (default && in_default) || asked(name)) {
            continue;
        }
        if !out.is_empty() {
            out.push_str("\r\n");
        }
        match name {
            "server" => server(stats, &mut out),
            "clients" => clients(stats, &mut out),
            "memory" => memory(stats, &mut out),
            "persistence" => persistence(stats, &mut out),
            "stats" => stats_section(stats, &mut out),
            "replication" => replication(stats, &mut out),
            "cpu" => cpu(&mut out),
            "modules" => out.push_str("# Modules\r\n"),
            "commandstats" => commandstats(stats, names, &mut out),
            "errorstats" => errorstats(stats, &mut out),
            "cluster" => out.push_str("# Cluster\r\ncluster_enabled:0\r\n"),
            "keyspace" => {
                out.push_str("# Keyspace\r\n");
                // Counting keys asks the memnodes; when they cannot answer, INFO still
                // answers (monitoring polls it hardest when something is wrong) and says so.
                match store.key_count().and_then(|keys| Ok((keys, store.keys_with_expiry()?))) {
                    // Redis lists only databases that have keys.
                    Ok((0, _)) => {}
                    Ok((keys, expires)) => {
                        let _ = write!(out, "db0:keys={keys},expires={expires},avg_ttl=0\r\n");
                    }
                    Err(e) => {
                        METRICS.store_errors.with_label_values(&[e.kind.as_str()]).inc();
                        let _ = write!(out, "racekv_keyspace_error:{}\r\n", e.kind);
                    }
                }
            }
            _ => {
                out.push_str("# Storage\r\n");
                for line in store.storage_lines()?.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.is_empty()) {
                    out.push_str(line);
                    out.push_str("\r\n");
                }
            }
        }
    }
    Ok(out)
}

/// Writes `key:value` lines.
fn fields(out: &mut String, header: &str, lines: &[(&str, String)]) {
    out.push_str(header);
    out.push_str("\r\n");
    for (key, value) in lines {
        let _ = write!(out, "{key}:{value}\r\n");
    }
}

fn server(stats: &ServerStats, out: &mut String) {
    let uptime = stats.started.elapsed().as_secs();
    let now_usec = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros());
    fields(
        out,
        "# Server",
        &[
            ("redis_version", REDIS_COMPAT_VERSION.into()),
            ("racekv_version", env!("CARGO_PKG_VERSION").into()),
            ("redis_git_sha1", "00000000".into()),
            ("redis_git_dirty", "0".into()),
            ("redis_build_id", "0".into()),
            ("redis_mode", "standalone".into()),
            ("os", format!("{} {}", os_name(), std::env::consts::ARCH)),
            ("arch_bits", usize::BITS.to_string()),
            ("multiplexing_api", "epoll".into()),
            ("process_id", std::process::id().to_string()),
            ("process_supervised", "no".into()),
            ("run_id", stats.run_id.clone()),
            ("tcp_port", stats.tcp_port.to_string()),
            ("server_time_usec", now_usec.to_string()),
            ("uptime_in_seconds", uptime.to_string()),
            ("uptime_in_days", (uptime / 86_400).to_string()),
            ("hz", "10".into()),
            ("configured_hz", "10".into()),
            ("executable", std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_default()),
            ("config_file", String::new()),
            ("io_threads_active", "0".into()),
        ],
    );
}

fn os_name() -> &'static str {
    match std::env::consts::OS {
        "linux" => "Linux",
        "macos" => "Darwin",
        other => other,
    }
}

fn clients(stats: &ServerStats, out: &mut String) {
    let paused = stats.clients.pause.state().map_or("none", |(_, all)| if all { "all" } else { "write" });
    fields(
        out,
        "# Clients",
        &[
            ("connected_clients", stats.connected_clients().to_string()),
            ("cluster_connections", "0".into()),
            ("maxclients", stats.max_clients().to_string()),
            ("client_recent_max_input_buffer", "0".into()),
            ("client_recent_max_output_buffer", "0".into()),
            // Connections whose command waits for a CLIENT PAUSE (Redis counts them here).
            ("blocked_clients", stats.clients.pause.held().to_string()),
            ("tracking_clients", "0".into()),
            ("clients_in_timeout_table", "0".into()),
            ("total_blocking_keys", "0".into()),
            ("watching_clients", stats.watching_clients.load(Ordering::Relaxed).to_string()),
            ("total_watched_keys", stats.watched_keys.load(Ordering::Relaxed).to_string()),
            ("paused_actions", paused.into()),
        ],
    );
}

/// Redis' `bytesToHuman`.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["K", "M", "G", "T", "P"];
    if n < 1024 {
        return format!("{n}B");
    }
    let mut value = n as f64 / 1024.0;
    for unit in UNITS {
        if value < 1024.0 || unit == "P" {
            return format!("{value:.2}{unit}");
        }
        value /= 1024.0;
    }
    unreachable!("the last unit returns")
}

/// A `kB` field of `/proc/self/status` or `/proc/meminfo`, in bytes (0 where there is none).
fn proc_kib(path: &str, field: &str) -> u64 {
    let Ok(text) = std::fs::read_to_string(path) else { return 0 };
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// `used_memory` is the process' resident memory: racekv keeps its data in the memnodes
/// (see the storage section), so what Redis reports as the dataset's allocation is the front
/// end's (and its process') own memory here.
fn memory(stats: &ServerStats, out: &mut String) {
    let rss = proc_kib("/proc/self/status", "VmRSS");
    let peak = proc_kib("/proc/self/status", "VmHWM").max(rss);
    let total = proc_kib("/proc/meminfo", "MemTotal");
    let peak_perc = if peak == 0 { 0.0 } else { rss as f64 * 100.0 / peak as f64 };
    fields(
        out,
        "# Memory",
        &[
            ("used_memory", rss.to_string()),
            ("used_memory_human", human_bytes(rss)),
            ("used_memory_rss", rss.to_string()),
            ("used_memory_rss_human", human_bytes(rss)),
            ("used_memory_peak", peak.to_string()),
            ("used_memory_peak_human", human_bytes(peak)),
            ("used_memory_peak_perc", format!("{peak_perc:.2}%")),
            ("total_system_memory", total.to_string()),
            ("total_system_memory_human", human_bytes(total)),
            ("maxmemory", stats.settings.maxmemory().bytes().to_string()),
            ("maxmemory_human", human_bytes(stats.settings.maxmemory().bytes())),
            ("maxmemory_policy", stats.settings.maxmemory().policy().name().into()),
            ("mem_fragmentation_ratio", "1.00".into()),
            ("mem_allocator", "libc".into()),
            // racekv's own: large commands' buffers against the query buffer budget.
            ("racekv_query_buffer_bytes", stats.settings.query_budget().used().to_string()),
            ("racekv_query_buffer_budget", stats.settings.query_budget().limit().to_string()),
        ],
    );
}

/// The machine's memory in bytes (0 when it cannot be read).
pub(crate) fn total_memory_bytes() -> u64 {
    proc_kib("/proc/meminfo", "MemTotal")
}

/// racekv writes no RDB or AOF: durability is the memnodes' business.
fn persistence(stats: &ServerStats, out: &mut String) {
    fields(
        out,
        "# Persistence",
        &[
            ("loading", "0".into()),
            ("async_loading", "0".into()),
            ("rdb_changes_since_last_save", "0".into()),
            ("rdb_bgsave_in_progress", "0".into()),
            ("rdb_last_save_time", stats.started_unix.to_string()),
            ("rdb_last_bgsave_status", "ok".into()),
            ("rdb_last_bgsave_time_sec", "-1".into()),
            ("rdb_current_bgsave_time_sec", "-1".into()),
            ("aof_enabled", "0".into()),
            ("aof_rewrite_in_progress", "0".into()),
            ("aof_rewrite_scheduled", "0".into()),
            ("aof_last_rewrite_time_sec", "-1".into()),
            ("aof_current_rewrite_time_sec", "-1".into()),
            ("aof_last_bgrewrite_status", "ok".into()),
            ("aof_last_write_status", "ok".into()),
        ],
    );
}

fn stats_section(stats: &ServerStats, out: &mut String) {
    let (ops, input_kbps, output_kbps) = stats.rates();
    let (hits, misses) = stats.keyspace_hits_and_misses();
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed).to_string();
    fields(
        out,
        "# Stats",
        &[
            ("total_connections_received", stats.total_connections().to_string()),
            ("total_commands_processed", stats.total_commands_processed().to_string()),
            ("instantaneous_ops_per_sec", ops.to_string()),
            ("total_net_input_bytes", load(&stats.net_input_bytes)),
            ("total_net_output_bytes", load(&stats.net_output_bytes)),
            ("instantaneous_input_kbps", format!("{input_kbps:.2}")),
            ("instantaneous_output_kbps", format!("{output_kbps:.2}")),
            ("rejected_connections", stats.rejected_connections().to_string()),
            ("sync_full", "0".into()),
            ("sync_partial_ok", "0".into()),
            ("sync_partial_err", "0".into()),
            // Expired keys are removed by readers and by the memnodes' sweep, not by this
            // server: see racekv_table_expired_total{how} (README: differences).
            ("expired_keys", "0".into()),
            // Per process, every memnode (the computenode's eviction counts them).
            ("evicted_keys", crate::maxmemory::evicted_keys().to_string()),
            ("keyspace_hits", hits.to_string()),
            ("keyspace_misses", misses.to_string()),
            ("pubsub_channels", "0".into()),
            ("pubsub_patterns", "0".into()),
            ("latest_fork_usec", "0".into()),
            ("total_forks", "0".into()),
            ("total_error_replies", load(&stats.total_error_replies)),
            ("total_protocol_errors", stats.protocol_errors().to_string()),
        ],
    );
}

fn replication(stats: &ServerStats, out: &mut String) {
    fields(
        out,
        "# Replication",
        &[
            ("role", "master".into()),
            ("connected_slaves", "0".into()),
            ("master_failover_state", "no-failover".into()),
            ("master_replid", stats.run_id.clone()),
            ("master_replid2", "0".repeat(40)),
            ("master_repl_offset", "0".into()),
            ("second_repl_offset", "-1".into()),
            ("repl_backlog_active", "0".into()),
            ("repl_backlog_size", "0".into()),
            ("repl_backlog_first_byte_offset", "0".into()),
            ("repl_backlog_histlen", "0".into()),
        ],
    );
}

fn cpu(out: &mut String) {
    use nix::sys::resource::{getrusage, UsageWho};
    let seconds = |who: UsageWho| {
        getrusage(who).map_or((String::from("0.000000"), String::from("0.000000")), |u| {
            let format = |t: nix::sys::time::TimeVal| format!("{}.{:06}", t.tv_sec(), t.tv_usec());
            (format(u.system_time()), format(u.user_time()))
        })
    };
    let (sys, user) = seconds(UsageWho::RUSAGE_SELF);
    let (sys_children, user_children) = seconds(UsageWho::RUSAGE_CHILDREN);
    fields(
        out,
        "# CPU",
        &[
            ("used_cpu_sys", sys),
            ("used_cpu_user", user),
            ("used_cpu_sys_children", sys_children),
            ("used_cpu_user_children", user_children),
        ],
    );
}

fn commandstats(stats: &ServerStats, names: &dyn Fn(u16) -> String, out: &mut String) {
    out.push_str("# Commandstats\r\n");
    for (id, stat) in stats.commands.iter().enumerate() {
        let calls = stat.calls.load(Ordering::Relaxed);
        let rejected = stat.rejected.load(Ordering::Relaxed);
        let failed = stat.failed.load(Ordering::Relaxed);
        if calls == 0 && rejected == 0 && failed == 0 {
            continue;
        }
        let usec = stat.usec.load(Ordering::Relaxed);
        let per_call = if calls == 0 { 0.0 } else { usec as f64 / calls as f64 };
        let _ = write!(
            out,
            "cmdstat_{}:calls={calls},usec={usec},usec_per_call={per_call:.2},rejected_calls={rejected},failed_calls={failed}\r\n",
            names(id as u16)
        );
    }
}

fn errorstats(stats: &ServerStats, out: &mut String) {
    out.push_str("# Errorstats\r\n");
    for (code, count) in stats.errors.lock().iter() {
        let _ = write!(out, "errorstat_{code}:count={count}\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(u64);

    impl InfoSource for Fixed {
        fn storage_lines(&mut self) -> Result<String, StoreError> {
            Ok("memnodes:2\nworkers:4\r\n".into())
        }
        fn key_count(&mut self) -> Result<u64, StoreError> {
            Ok(self.0)
        }
        fn keys_with_expiry(&mut self) -> Result<u64, StoreError> {
            Ok(0)
        }
    }

    /// Panics if the storage is asked anything.
    struct Untouched;

    impl InfoSource for Untouched {
        fn storage_lines(&mut self) -> Result<String, StoreError> {
            panic!("storage lines not requested")
        }
        fn key_count(&mut self) -> Result<u64, StoreError> {
            panic!("key count not requested")
        }
        fn keys_with_expiry(&mut self) -> Result<u64, StoreError> {
            panic!("expiries not requested")
        }
    }

    fn names(id: u16) -> String {
        format!("cmd{id}")
    }

    #[test]
    fn default_info_has_every_default_section_and_the_store_lines() {
        let stats = ServerStats::new(6379, 10, None);
        assert!(stats.try_admit());
        stats.commands_done(1);
        stats.command_stat(3, 10, Outcome::Ok);
        stats.error_reply("WRONGPASS invalid username-password pair");
        let text = render(&stats, &[], &names, &mut Fixed(5)).unwrap();
        for needle in [
            "# Server\r\nredis_version:7.2.0\r\nracekv_version:",
            "tcp_port:6379\r\n",
            "# Clients\r\nconnected_clients:1\r\ncluster_connections:0\r\nmaxclients:10\r\n",
            "total_commands_processed:1\r\n",
            "# Memory\r\nused_memory:",
            "maxmemory_policy:noeviction\r\n",
            "racekv_query_buffer_bytes:0\r\nracekv_query_buffer_budget:0\r\n",
            "# Persistence\r\nloading:0\r\n",
            "# Replication\r\nrole:master\r\n",
            "# CPU\r\nused_cpu_sys:",
            "# Errorstats\r\nerrorstat_WRONGPASS:count=1\r\n",
            "total_error_replies:1\r\n",
            "# Keyspace\r\ndb0:keys=5,expires=0,avg_ttl=0\r\n",
            "# Storage\r\nmemnodes:2\r\nworkers:4\r\n",
        ] {
            assert!(text.contains(needle), "{needle:?} not in {text:?}");
        }
        assert!(!text.contains("# Commandstats"), "commandstats is not a default section");
        assert!(!text.contains("\n\n") && !text.contains("\r\r"), "{text:?}");
        let all = render(&stats, &[b"ALL"], &names, &mut Fixed(0)).unwrap();
        assert!(all.contains(
            "# Commandstats\r\ncmdstat_cmd3:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n"
        ));
        assert!(all.contains("# Keyspace\r\n\r\n# Storage"), "an empty database is not listed: {all:?}");
    }

    /// A store that cannot count its keys.
    struct Unavailable;

    impl InfoSource for Unavailable {
        fn storage_lines(&mut self) -> Result<String, StoreError> {
            Ok("memnodes:0\n".into())
        }
        fn key_count(&mut self) -> Result<u64, StoreError> {
            Err(StoreError::new(crate::store::StoreErrorKind::Unavailable, "memnode 0"))
        }
        fn keys_with_expiry(&mut self) -> Result<u64, StoreError> {
            unreachable!("asked only after the key count")
        }
    }

    #[test]
    fn info_answers_when_the_keys_cannot_be_counted() {
        let stats = ServerStats::new(1, 1, None);
        let text = render(&stats, &[], &names, &mut Unavailable).unwrap();
        assert!(text.contains("# Keyspace\r\nracekv_keyspace_error:unavailable\r\n"), "{text}");
        assert!(text.contains("# Server\r\n") && text.contains("# Storage\r\nmemnodes:0\r\n"), "{text}");
    }

    #[test]
    fn sections_can_be_selected_and_storage_is_asked_only_when_needed() {
        let stats = ServerStats::new(1, 1, None);
        let text = render(&stats, &[b"CLIENTS", b"stats"], &names, &mut Untouched).unwrap();
        assert!(text.starts_with("# Clients\r\n") && text.contains("# Stats\r\n"), "{text}");
        assert!(!text.contains("# Server"), "{text}");
        assert_eq!(render(&stats, &[b"nosuchsection"], &names, &mut Untouched).unwrap(), "");
        let text = render(&stats, &[b"commandstats"], &names, &mut Untouched).unwrap();
        assert_eq!(text, "# Commandstats\r\n");
    }

    #[test]
    fn command_and_error_stats_count_by_outcome_and_reset() {
        let stats = ServerStats::new(1, 1, None);
        stats.command_stat(0, 5, Outcome::Ok);
        stats.command_stat(0, 7, Outcome::Failed);
        stats.command_stat(0, 1, Outcome::Rejected);
        let text = render(&stats, &[b"commandstats"], &names, &mut Untouched).unwrap();
        assert!(text.contains("cmdstat_cmd0:calls=2,usec=12,usec_per_call=6.00,rejected_calls=1,failed_calls=1\r\n"));
        stats.error_reply("ERR x");
        stats.error_reply("nospace");
        stats.error_reply("TRYAGAIN later");
        let text = render(&stats, &[b"errorstats"], &names, &mut Untouched).unwrap();
        assert_eq!(text, "# Errorstats\r\nerrorstat_ERR:count=2\r\nerrorstat_TRYAGAIN:count=1\r\n");
        stats.keyspace_lookup(true);
        stats.reset();
        assert_eq!(stats.keyspace_hits_and_misses(), (0, 0));
        assert_eq!(render(&stats, &[b"errorstats"], &names, &mut Untouched).unwrap(), "# Errorstats\r\n");
    }

    #[test]
    fn error_codes_tracked_are_bounded() {
        let stats = ServerStats::new(1, 1, None);
        for i in 0..MAX_ERROR_CODES + 10 {
            stats.error_reply(&format!("CODE{i} text"));
        }
        assert_eq!(stats.errors.lock().len(), MAX_ERROR_CODES);
        assert_eq!(stats.total_error_replies.load(Ordering::Relaxed), (MAX_ERROR_CODES + 10) as u64);
    }

    #[test]
    fn admission_stops_at_max_clients() {
        let stats = ServerStats::new(1, 2, None);
        assert!(stats.try_admit() && stats.try_admit());
        assert!(!stats.try_admit());
        assert_eq!(stats.rejected_connections(), 1);
        stats.client_gone();
        assert!(stats.try_admit());
        assert_eq!(stats.total_connections(), 3);
    }

    #[test]
    fn human_sizes_as_redis_writes_them() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(1023), "1023B");
        assert_eq!(human_bytes(1536), "1.50K");
        assert_eq!(human_bytes(3 << 20), "3.00M");
        assert_eq!(human_bytes(5 << 30), "5.00G");
    }
}
