//! A Redis front end's settings: limits, timeouts, the I/O model, users and the TLS port.

use std::sync::Arc;
use std::time::Duration;

use racekv_transport::ServerTls;

use super::acl::Acl;
use super::commands;
use super::maxmemory::Maxmemory;
use super::resp::Limits;

/// Limits and timeouts of a Redis server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Connections beyond this are refused with `-ERR max number of clients reached`.
    /// Each connection holds a thread (thread model) and up to
    /// [`UNCHARGED_BYTES`](super::resp::UNCHARGED_BYTES) of input buffers of its own; more
    /// comes out of `query_buffer_budget`.
    pub max_clients: usize,
    /// Close a connection from which nothing arrives for this long (`None`: never, like
    /// Redis' default `timeout 0`). Also bounds a request that stalls half-way.
    pub idle_timeout: Option<Duration>,
    /// Close a connection whose client does not take its replies for this long.
    pub write_timeout: Duration,
    /// What one connection may make the parser hold: `max_bulk_bytes` is
    /// `proto-max-bulk-len`, `max_command_bytes` is `client-query-buffer-limit` (`CONFIG
    /// SET` changes it for every connection).
    pub limits: Limits,
    /// `query-buffer-budget`: the most bytes the partly received large commands of all
    /// connections may hold together (each connection's first
    /// [`UNCHARGED_BYTES`](super::resp::UNCHARGED_BYTES) excepted); a connection whose
    /// command would go past it gets `-ERR query buffer budget exhausted ...` and is closed.
    /// 0: unlimited. Default [`default_query_buffer_budget`].
    pub query_buffer_budget: usize,
    /// How connections are served.
    pub io: IoModel,
    /// Event loops only: after a turn that served something, a loop keeps polling (without
    /// sleeping) this long before it blocks. A request that arrives meanwhile finds it
    /// awake, so its sender pays no wake-up of a sleeping thread (measured: +5-8% GET/s
    /// for a one-request-per-connection client); an idle loop sleeps after one spin.
    pub poll_spin: Duration,
    /// Users and what they may do; the default ACL lets anyone do anything (no password).
    pub acl: Arc<Acl>,
    /// Redis' protected mode: while the default user needs no password, serve only
    /// loopback clients (others get `-DENIED ...` and are closed).
    pub protected_mode: bool,
    /// A second port that speaks only TLS (Redis' `tls-port`); its connections are served
    /// by a thread each, whatever `io` says.
    pub tls: Option<TlsPort>,
    /// Cache mode's settings (`CONFIG GET/SET maxmemory*` and INFO show and change these;
    /// the store enforces them).
    pub maxmemory: Arc<Maxmemory>,
}

/// The TLS port of a [`RedisServer`].
#[derive(Debug, Clone)]
pub struct TlsPort {
    /// Where to listen (port 0 picks a free port).
    pub addr: String,
    /// Certificate, key, CA and client-certificate rule; reloadable.
    pub tls: ServerTls,
}

/// How a [`RedisServer`] serves its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoModel {
    /// One blocking thread per connection: storage calls of different clients overlap, which
    /// suits storage behind a network round trip (tcp memnodes).
    ThreadPerConnection,
    /// `threads` event loops (at least 1), each polling its share of the connections and
    /// executing their commands inline, as redis-server does: no wake-up of a sleeping
    /// thread per request, but one slow storage call delays the other clients of its loop.
    EventLoop {
        /// How many event loops.
        threads: usize,
    },
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_clients: 1024,
            idle_timeout: None,
            write_timeout: Duration::from_secs(30),
            limits: Limits::default(),
            query_buffer_budget: default_query_buffer_budget(),
            io: IoModel::ThreadPerConnection,
            poll_spin: DEFAULT_POLL_SPIN,
            acl: Arc::new(Acl::open(commands::catalog())),
            protected_mode: true,
            tls: None,
            maxmemory: Arc::default(),
        }
    }
}

/// [`ServerOptions::query_buffer_budget`]'s default: a quarter of the machine's memory, at
/// most 2 GiB (2 GiB where the memory cannot be read): four full-size (512 MiB) values
/// arriving at once.
pub fn default_query_buffer_budget() -> usize {
    const MAX: usize = 2 << 30;
    match super::info::total_memory_bytes() {
        0 => MAX,
        total => (total / 4).min(MAX as u64) as usize,
    }
}

/// [`ServerOptions::poll_spin`]'s default.
pub const DEFAULT_POLL_SPIN: Duration = Duration::from_micros(20);
/// The longest [`ServerOptions::poll_spin`] the computenode's configuration accepts.
pub const MAX_POLL_SPIN: Duration = Duration::from_millis(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_redis_limits_under_a_bounded_budget() {
        let options = ServerOptions::default();
        assert_eq!(options.limits.max_bulk_bytes, 512 << 20, "proto-max-bulk-len");
        assert_eq!(options.limits.max_command_bytes, 1 << 30, "client-query-buffer-limit");
        assert!(options.limits.max_command_bytes > options.limits.max_bulk_bytes + (1 << 20));
        assert!(options.query_buffer_budget > 0 && options.query_buffer_budget <= 2 << 30);
    }
}
