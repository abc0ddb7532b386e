//! Per-server counters and the text of `INFO`.
//!
//! Prometheus metrics are process-wide (several servers in one process sum up); these
//! counters belong to one server, so `INFO` describes the server the client talks to.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::store::StoreError;

/// The Redis version racekv speaks (RESP2 and RESP3, a subset of 7.2's commands). Tools parse
/// `redis_version` as a version number, so racekv's own version has a field of its own.
pub const REDIS_COMPAT_VERSION: &str = "7.2.0";

/// Counters of one server, shared by its connections.
#[derive(Debug)]
pub struct ServerStats {
    started: Instant,
    tcp_port: u16,
    max_clients: usize,
    idle_timeout: Option<Duration>,
    connected_clients: AtomicUsize,
    total_connections: AtomicU64,
    rejected_connections: AtomicU64,
    total_commands: AtomicU64,
    net_input_bytes: AtomicU64,
    net_output_bytes: AtomicU64,
    protocol_errors: AtomicU64,
}

impl ServerStats {
    /// Fresh counters for a server on `tcp_port` admitting `max_clients`.
    pub fn new(tcp_port: u16, max_clients: usize, idle_timeout: Option<Duration>) -> Self {
        Self {
            started: Instant::now(),
            tcp_port,
            max_clients,
            idle_timeout,
            connected_clients: AtomicUsize::new(0),
            total_connections: AtomicU64::new(0),
            rejected_connections: AtomicU64::new(0),
            total_commands: AtomicU64::new(0),
            net_input_bytes: AtomicU64::new(0),
            net_output_bytes: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
        }
    }

    /// Connections open now.
    pub fn connected_clients(&self) -> usize {
        self.connected_clients.load(Ordering::Acquire)
    }

    /// The configured client limit.
    pub fn max_clients(&self) -> usize {
        self.max_clients
    }

    /// The configured idle timeout (`None`: never).
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
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

    /// Takes a slot if fewer than `max_clients` are connected. Only the accepting thread
    /// calls this, so check-then-add cannot overshoot.
    pub(crate) fn try_admit(&self) -> bool {
        if self.connected_clients.load(Ordering::Acquire) >= self.max_clients {
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

    pub(crate) fn command_done(&self) {
        self.total_commands.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_io(&self, input_bytes: u64, output_bytes: u64) {
        self.net_input_bytes.fetch_add(input_bytes, Ordering::Relaxed);
        self.net_output_bytes.fetch_add(output_bytes, Ordering::Relaxed);
    }

    pub(crate) fn protocol_error(&self) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// The sections `INFO` knows, in output order.
const SECTIONS: [&str; 4] = ["server", "clients", "stats", "storage"];

/// Renders `INFO` for the requested `sections` (none, `default`, `all` or `everything`: every
/// section; unknown names are ignored, as in Redis). `storage` supplies the store's lines and
/// is called only when the storage section is wanted.
pub(crate) fn render(
    stats: &ServerStats,
    sections: &[&[u8]],
    mut storage: impl FnMut() -> Result<String, StoreError>,
) -> Result<String, StoreError> {
    let everything = sections.is_empty()
        || sections
            .iter()
            .any(|s| [b"default".as_slice(), b"all", b"everything"].iter().any(|all| s.eq_ignore_ascii_case(all)));
    let wanted = |name: &str| everything || sections.iter().any(|s| s.eq_ignore_ascii_case(name.as_bytes()));
    let mut out = String::new();
    for name in SECTIONS.into_iter().filter(|name| wanted(name)) {
        if !out.is_empty() {
            out.push_str("\r\n");
        }
        match name {
            "server" => {
                let uptime = stats.started.elapsed().as_secs();
                out.push_str("# Server\r\n");
                let _ = write!(
                    out,
                    "redis_version:{REDIS_COMPAT_VERSION}\r\n\
                     racekv_version:{v}\r\n\
                     redis_mode:standalone\r\n\
                     arch_bits:{bits}\r\n\
                     process_id:{pid}\r\n\
                     tcp_port:{port}\r\n\
                     uptime_in_seconds:{uptime}\r\n\
                     uptime_in_days:{days}\r\n",
                    v = env!("CARGO_PKG_VERSION"),
                    bits = usize::BITS,
                    pid = std::process::id(),
                    port = stats.tcp_port,
                    days = uptime / 86_400,
                );
            }
            "clients" => {
                let _ = write!(
                    out,
                    "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n",
                    stats.connected_clients(),
                    stats.max_clients,
                );
            }
            "stats" => {
                let _ = write!(
                    out,
                    "# Stats\r\n\
                     total_connections_received:{}\r\n\
                     total_commands_processed:{}\r\n\
                     total_net_input_bytes:{}\r\n\
                     total_net_output_bytes:{}\r\n\
                     rejected_connections:{}\r\n\
                     total_protocol_errors:{}\r\n",
                    stats.total_connections(),
                    stats.total_commands_processed(),
                    stats.net_input_bytes.load(Ordering::Relaxed),
                    stats.net_output_bytes.load(Ordering::Relaxed),
                    stats.rejected_connections(),
                    stats.protocol_errors(),
                );
            }
            _ => {
                out.push_str("# Storage\r\n");
                for line in storage()?.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.is_empty()) {
                    out.push_str(line);
                    out.push_str("\r\n");
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_info_has_every_section_and_the_store_lines() {
        let stats = ServerStats::new(6379, 10, None);
        assert!(stats.try_admit());
        stats.command_done();
        let text = render(&stats, &[], || Ok("memnodes:2\nworkers:4\r\n".into())).unwrap();
        for needle in [
            "# Server\r\nredis_version:7.2.0\r\nracekv_version:",
            "tcp_port:6379\r\n",
            "# Clients\r\nconnected_clients:1\r\nmaxclients:10\r\n",
            "total_commands_processed:1\r\n",
            "# Storage\r\nmemnodes:2\r\nworkers:4\r\n",
        ] {
            assert!(text.contains(needle), "{needle:?} not in {text:?}");
        }
        assert!(!text.contains("\n\n") && !text.contains("\r\r"), "{text:?}");
    }

    #[test]
    fn sections_can_be_selected_and_storage_is_asked_only_when_needed() {
        let stats = ServerStats::new(1, 1, None);
        let text = render(&stats, &[b"CLIENTS"], || panic!("storage info not requested")).unwrap();
        assert!(text.starts_with("# Clients\r\n") && !text.contains("# Server"), "{text}");
        assert_eq!(render(&stats, &[b"nosuchsection"], || unreachable!()).unwrap(), "");
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
}
