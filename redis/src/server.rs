//! The TCP server: accepts Redis clients and runs one [`Client`] per connection.
//!
//! Threading ([`IoModel`]): by default one blocking OS thread per connection, plus one
//! accepting thread; or a few event-loop threads ([`super::event_loop`]), each serving
//! many connections, which saves a cross-CPU wake-up per request when many clients each
//! keep one request outstanding. Thread per connection: the storage
//! trait is blocking and a session belongs to one connection, so a thread per connection
//! calls it directly with no executor hand-off (an async runtime would need `spawn_blocking`
//! around every storage call, which is the same threads with more machinery). Backpressure is
//! free: a client that does not read its replies blocks only its own thread, up to
//! `write_timeout`. The cost, a stack per client, is bounded by `max_clients`.
//!
//! Per read: every complete command in the buffer is executed, the replies are gathered and
//! written with one `write` (pipelining), so a pipelined batch costs one syscall each way.
//!
//! A malformed request gets `-ERR Protocol error: ...` and closes that connection only.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use racekv_transport::stop::StopSignal;
use racekv_transport::ServerTls;

use super::acl::Acl;
use super::commands::Client;
use super::conn::ClientConn;
use super::event_loop::{self, Loop};
use super::info::ServerStats;
use super::metrics::METRICS;
use super::reply::Output;
use super::resp::QueryBudget;
use super::serving::{feed, new_client, new_parser, release, run_commands, Serving, Step, LINGER, LINGER_MAX_BYTES};
use super::store::KvStore;
use racekv_telemetry::ratelimit::{limited_warn, RateLimit};

// Where these were first defined, for the crates that name them here.
pub use super::options::{
    default_query_buffer_budget, IoModel, ServerOptions, TlsPort, DEFAULT_POLL_SPIN, MAX_POLL_SPIN,
};
pub use super::serving::{MAX_PENDING_REPLY_BYTES, READ_CHUNK_BYTES};

/// A server: what its connections share, and the threads that serve them.
struct Shared {
    serving: Serving,
    next_id: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The event loops ([`IoModel::EventLoop`]); empty otherwise.
    loops: Vec<Loop>,
}

/// A running Redis front end; stops (closing every connection) on [`RedisServer::shutdown`]
/// or drop.
pub struct RedisServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    tls_addr: Option<SocketAddr>,
    acceptors: Vec<JoinHandle<()>>,
}

impl RedisServer {
    /// Binds `addr` (port 0 picks a free port) and serves `store` on background threads.
    pub fn start(addr: impl ToSocketAddrs, store: Arc<dyn KvStore>, options: ServerOptions) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        crate::maxmemory::register_metrics();
        let mut stats = ServerStats::new(addr.port(), options.max_clients, options.idle_timeout);
        stats.settings.set_maxmemory(Arc::clone(&options.maxmemory));
        let stats = Arc::new(stats);
        stats.settings.set_protected_mode(options.protected_mode);
        stats.settings.set_proto_max_bulk_len(options.limits.max_bulk_bytes);
        stats.settings.set_client_query_buffer_limit(options.limits.max_command_bytes);
        stats.settings.query_budget().set_limit(options.query_buffer_budget);
        let loops = match options.io {
            IoModel::ThreadPerConnection => Vec::new(),
            IoModel::EventLoop { threads } => (0..threads.max(1)).map(Loop::new).collect::<io::Result<_>>()?,
        };
        let shared = Arc::new(Shared {
            serving: Serving { store, options, stats, stopping: StopSignal::new()?, open: Mutex::new(HashMap::new()) },
            next_id: AtomicU64::new(1),
            threads: Mutex::new(Vec::new()),
            loops,
        });
        // CLIENT KILL and CLIENT UNPAUSE reach connections through the server; a weak handle
        // keeps the registry (inside `shared`) from keeping `shared` alive.
        let weak = Arc::downgrade(&shared);
        shared.serving.stats.clients.set_closer(move |id| {
            if let Some(shared) = weak.upgrade() {
                close_connection(&shared, id);
            }
        });
        let weak = Arc::downgrade(&shared);
        shared.serving.stats.clients.pause.add_waker(move || {
            for l in weak.upgrade().iter().flat_map(|shared| shared.loops.iter()) {
                l.wake();
            }
        });
        for i in 0..shared.loops.len() {
            let serving = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("redis-loop-{i}"))
                .spawn(move || event_loop::run(&serving.serving, &serving.loops[i], i))?;
            shared.threads.lock().push(handle);
        }
        let accepting = Arc::clone(&shared);
        let mut acceptors = vec![std::thread::Builder::new()
            .name("redis-accept".into())
            .spawn(move || accept_loop(&accepting, &listener, None))?];
        tracing::info!("redis front end listening on {addr}");
        let mut tls_addr = None;
        if let Some(port) = shared.serving.options.tls.clone() {
            let listener = TcpListener::bind(port.addr.as_str())?;
            tls_addr = Some(listener.local_addr()?);
            let accepting = Arc::clone(&shared);
            acceptors.push(
                std::thread::Builder::new()
                    .name("redis-tls-accept".into())
                    .spawn(move || accept_loop(&accepting, &listener, Some(port.tls)))?,
            );
            tracing::info!("redis front end listening for TLS on {}", tls_addr.expect("just set"));
        }
        Ok(Self { shared, addr, tls_addr, acceptors })
    }

    /// The TLS port's bound address, if it has one.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// The bound address (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This server's counters (what `INFO` reports).
    pub fn stats(&self) -> &ServerStats {
        &self.shared.serving.stats
    }

    /// The query buffer budget all this server's connections share.
    pub fn query_budget(&self) -> &Arc<QueryBudget> {
        self.shared.serving.stats.settings.query_budget()
    }

    /// Stops accepting, closes every connection and waits for their threads. A command
    /// already executing finishes in storage; its reply is lost with the connection.
    pub fn shutdown(&mut self) {
        self.shared.serving.stopping.stop();
        if self.acceptors.is_empty() {
            return;
        }
        // After the acceptors are gone no connection can be added behind our back.
        for acceptor in self.acceptors.drain(..) {
            let _ = acceptor.join();
        }
        for stream in self.shared.serving.open.lock().values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        // Connection threads waiting out a CLIENT PAUSE look at the stop flag.
        self.shared.serving.stats.clients.pause.stop();
        for l in &self.shared.loops {
            l.wake();
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for thread in threads {
            let _ = thread.join();
        }
        for l in &self.shared.loops {
            l.release_inbox(&self.shared.serving);
        }
        tracing::info!("redis front end on {} stopped", self.addr);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Accepts on `listener` until the server stops; `tls`: the port speaks TLS.
fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener, tls: Option<ServerTls>) {
    // A failed accept (e.g. EMFILE) keeps serving the clients we have.
    shared.serving.stopping.accept_until_stopped("redis front end", listener, TcpListener::accept, |(stream, peer)| {
        admit(shared, stream, peer, tls.as_ref())
    });
}

fn admit(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr, tls: Option<&ServerTls>) {
    // A refusal is a Redis error line on the plain port; a TLS client could not read one
    // before its handshake, so it just sees the close.
    let refusal = |reply: &'static [u8]| if tls.is_none() { reply } else { b"" };
    if protected_mode_refuses(shared.serving.stats.settings.protected_mode(), &shared.serving.options.acl, peer) {
        METRICS.connections_rejected.with_label_values(&["protected_mode"]).inc();
        limited_warn(&PROTECTED_MODE_LOG, || {
            format!("redis front end: refused {peer}: protected mode, and the default user has no password")
        });
        refuse(stream, refusal(PROTECTED_MODE_DENIED));
        return;
    }
    if !shared.serving.stats.try_admit() {
        METRICS.connections_rejected.with_label_values(&["max_clients"]).inc();
        refuse(stream, refusal(b"-ERR max number of clients reached\r\n"));
        return;
    }
    METRICS.connections.inc();
    METRICS.connected_clients.inc();
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    if !shared.loops.is_empty() && tls.is_none() {
        let l = &shared.loops[id as usize % shared.loops.len()];
        if let Err(e) = l.adopt(id, stream, peer) {
            tracing::warn!("redis front end: cannot hand a connection to its event loop: {e}");
            release(&shared.serving, id, "io_error");
        }
        return;
    }
    match stream.try_clone() {
        Ok(handle) => {
            shared.serving.open.lock().insert(id, handle);
        }
        Err(e) => {
            tracing::warn!("redis front end: cannot clone a connection handle: {e}");
            release(&shared.serving, id, "io_error");
            return;
        }
    }
    let conn_shared = Arc::clone(shared);
    let tls = tls.cloned();
    let spawned = racekv_transport::listen::spawn_tracked(&shared.threads, format!("redis-conn-{id}"), move || {
        let reason = match tls {
            None => serve(&conn_shared.serving, stream, id),
            Some(tls) => match super::tls::accept(&tls, stream) {
                Ok(conn) => serve(&conn_shared.serving, conn, id),
                Err(e) => {
                    METRICS.tls_handshake_failures.inc();
                    limited_warn(&TLS_HANDSHAKE_LOG, || {
                        format!("redis front end: TLS handshake with {peer} failed: {e}")
                    });
                    "tls_handshake"
                }
            },
        };
        tracing::debug!("redis client {id} ({peer}) closed: {reason}");
        release(&conn_shared.serving, id, reason);
    });
    if let Err(e) = spawned {
        tracing::error!("redis front end: cannot spawn a connection thread: {e}");
        if let Some(stream) = shared.serving.open.lock().get(&id) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        release(&shared.serving, id, "io_error");
    }
}

/// Whether protected mode turns `peer` away: it is on (`CONFIG SET protected-mode` may
/// change it), the peer is not on loopback, and anyone could connect without a password.
fn protected_mode_refuses(protected_mode: bool, acl: &Acl, peer: SocketAddr) -> bool {
    protected_mode && !peer.ip().is_loopback() && acl.is_open()
}

/// Closes connection `id` for `CLIENT KILL`: a connection thread's socket is shut down (its
/// blocked read returns), an event loop is told to drop it.
fn close_connection(shared: &Shared, id: u64) {
    if let Some(stream) = shared.serving.open.lock().get(&id) {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    if !shared.loops.is_empty() {
        shared.loops[id as usize % shared.loops.len()].kill_requested();
    }
}

/// Redis' reply to a non-loopback client in protected mode.
const PROTECTED_MODE_DENIED: &[u8] = b"-DENIED Redis is running in protected mode because protected mode is enabled and no password is set for the default user. In this mode connections are only accepted from the loopback interface. If you want to connect from external computers to Redis you may adopt one of the following solutions: 1) Just disable protected mode sending the command 'CONFIG SET protected-mode no' from the loopback interface by connecting to Redis from the same host the server is running, however MAKE SURE Redis is not publicly accessible from internet if you do so. Use CONFIG REWRITE to make this change permanent. 2) Alternatively you can just disable the protected mode by editing the Redis configuration file, and setting the protected mode option to 'no', and then restarting the server. 3) If you started the server manually just for testing, restart it with the '--protected-mode no' option. 4) Set up an authentication password for the default user. NOTE: You only need to do one of the above things in order for the server to start accepting connections from the outside.\r\n";

static PROTECTED_MODE_LOG: RateLimit = RateLimit::per_minute();
static TLS_HANDSHAKE_LOG: RateLimit = RateLimit::per_minute();

/// Answers a connection we will not serve, without blocking the accepting thread: the reply
/// fits an empty socket buffer, and whatever the client already sent is drained so the close
/// is a FIN, not a reset that could destroy the reply.
fn refuse(mut stream: TcpStream, reply: &[u8]) {
    let _ = stream.set_nonblocking(true);
    let _ = stream.write_all(reply);
    let _ = stream.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match stream.read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Serves one connection until it ends; returns why it ended (a metric label).
fn serve<C: ClientConn>(shared: &Serving, mut stream: C, id: u64) -> &'static str {
    let options = &shared.options;
    let tcp = stream.tcp();
    let configured = tcp.set_nodelay(true).and_then(|()| tcp.set_write_timeout(Some(options.write_timeout)));
    if configured.is_err() {
        return "io_error";
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(tcp);
    let mut client = new_client(shared, id, tcp.peer_addr().ok(), tcp.local_addr().ok(), i64::from(fd));
    let reason = serve_client(shared, &mut stream, &mut client);
    if client.killed() {
        "killed"
    } else {
        reason
    }
}

/// The read-execute-write loop of [`serve`].
fn serve_client<C: ClientConn>(shared: &Serving, stream: &mut C, client: &mut Client) -> &'static str {
    let mut parser = new_parser(shared);
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    let mut out = Output::with_capacity(READ_CHUNK_BYTES);
    let mut last_input = Instant::now();
    // The idle timeout the socket's read timeout was last set from (`CONFIG SET timeout`
    // changes it while we run: a read already waiting keeps the old one); `None` forces
    // setting it again. `partial`: it was set to what was left of an idle period (after a
    // timeout under an older, shorter setting), so the next input re-arms a full one.
    let mut armed: Option<Option<Duration>> = None;
    let mut partial = false;
    let mut rearm_partial = false;
    loop {
        if shared.stopping.is_stopped() {
            return "shutdown";
        }
        let idle = shared.stats.idle_timeout().filter(|t| !t.is_zero());
        if armed != Some(idle) {
            let left = match idle {
                Some(t) if rearm_partial => Some(t.saturating_sub(last_input.elapsed()).max(Duration::from_millis(1))),
                full => full,
            };
            if stream.tcp().set_read_timeout(left).is_err() {
                return "io_error";
            }
            partial = rearm_partial;
            rearm_partial = false;
            armed = Some(idle);
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) if shared.stopping.is_stopped() => return "shutdown",
            Ok(0) if parser.has_partial_command() => return "peer_closed_mid_command",
            Ok(0) => return "peer_closed",
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => {
                if idle.is_some_and(|t| last_input.elapsed() >= t) {
                    return "idle_timeout";
                }
                // The timeout was armed from an older, shorter setting: wait out what is left.
                armed = None;
                rearm_partial = true;
                continue;
            }
            Err(_) => return if shared.stopping.is_stopped() { "shutdown" } else { "io_error" },
        };
        if partial {
            // Armed with what was left of an idle period: the next read gets a full one.
            armed = None;
        }
        last_input = Instant::now();
        METRICS.received_bytes.inc_by(n as u64);
        feed(shared, &mut parser, &chunk[..n]);
        let mut sent = 0;
        let ending = loop {
            match run_commands(shared, client, &mut parser, &mut out) {
                Step::Flush => match out.write_all_to(stream).and_then(|n| stream.flush().map(|()| n)) {
                    Ok(n) => sent += n,
                    Err(_) => return "io_error",
                },
                Step::Paused(until) => {
                    // Answer what ran before the held command, then wait out the pause.
                    match out.write_all_to(stream).and_then(|n| stream.flush().map(|()| n)) {
                        Ok(n) => sent += n,
                        Err(_) => return "io_error",
                    }
                    client.wait_for_pause(until);
                    if shared.stopping.is_stopped() {
                        return "shutdown";
                    }
                }
                Step::NeedInput => break None,
                Step::End(reason) => break Some(reason),
            }
        };
        let pending = out.len();
        let written = out.write_all_to(stream).and_then(|_| stream.flush());
        sent += pending;
        out.clear();
        shared.stats.add_io(n as u64, sent as u64);
        METRICS.sent_bytes.inc_by(sent as u64);
        if written.is_err() {
            return "io_error";
        }
        if let Some(reason) = ending {
            linger(stream, &mut chunk);
            return reason;
        }
        if !parser.has_partial_command() {
            client.idle();
        }
    }
}

/// Half-closes and discards input for a moment, so the client reads our last reply before
/// it sees the connection end (see [`LINGER`]).
fn linger<C: ClientConn>(stream: &mut C, buf: &mut [u8]) {
    stream.finish();
    let _ = stream.tcp().shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut discarded = 0;
    while discarded < LINGER_MAX_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.tcp().set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => discarded += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protected_mode_serves_only_loopback_while_there_is_no_password() {
        let remote: SocketAddr = "10.1.2.3:5000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let local6: SocketAddr = "[::1]:5000".parse().unwrap();
        let open = Acl::open(crate::commands::catalog());
        assert!(protected_mode_refuses(true, &open, remote));
        assert!(!protected_mode_refuses(true, &open, local) && !protected_mode_refuses(true, &open, local6));
        assert!(!protected_mode_refuses(false, &open, remote));
        let options = crate::acl::AclOptions { requirepass: Some("pw".into()), file: None };
        let with_password = Acl::new(crate::commands::catalog(), options).unwrap();
        assert!(!protected_mode_refuses(true, &with_password, remote));
        with_password.set_user(b"default", &[b"nopass"]).unwrap();
        assert!(protected_mode_refuses(true, &with_password, remote), "looked at per connection, not once at start");
    }
}
