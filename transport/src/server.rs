//! The remote side of a region: accepts connections, checks credentials, executes one-sided
//! batches against the region (the software NIC of the tcp backend) and answers RPCs.
//!
//! Every connection first passes TLS (tcp listeners with a certificate, [`crate::tls`]) and
//! the token handshake ([`crate::auth`]) within the I/O timeout; a peer that fails is
//! counted, refused with an Error frame where it can still read one, and closed. Only then
//! does the server say HelloOk and read anything else.
//!
//! The same connection loop serves TCP and Unix sockets. On a Unix socket the hello reply
//! carries the region's file descriptor (SCM_RIGHTS), which is how the shm backend maps the
//! region; after that, shm clients use the socket only for RPC and to notice a server exit.
//! A `verbs:` endpoint (feature `rdma`) is a TCP control channel served by the same loop: the
//! region is registered with the NIC once at start, and after hello each client exchanges
//! queue-pair details (VerbsConnect/VerbsAccept) and gets its own RC queue pair, kept until
//! its control connection closes; batches then travel on the queue pair.
//!
//! RPC goes through FLOCK lanes on every listener: a lane is a connection that sent
//! FlockOpen after hello, handed over to FLOCK's receiver ([`crate::flock`]). On tcp its
//! messages travel on that stream, on a Unix socket in shared-memory rings, on verbs as RDMA
//! WRITEs into registered rings over the lane's own queue pair. The legacy RpcRequest frame
//! is still answered here. An RPC-only server ([`RegionServer::serve_rpc`]) runs the same
//! loop with no region.
//!
//! The software NIC knows nothing of what lives in the region: it bounds-checks and executes.
//! Malformed, truncated or oversized frames, and any frame before the handshake, get an
//! Error frame and cost only their own connection.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader};
use std::net::TcpListener;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGaugeVec};

use crate::auth::{self, Accepted, AuthFailure, Caller, Credentials, Token};
use crate::batch::{Batch, OpKind};
use crate::flock::accept::{serve_lane_connection, LaneHost};
use crate::flock::service::record_rpc;
use crate::flock::RpcService;
use crate::net::random_u64;
use crate::region::Region;
#[cfg(feature = "rdma")]
use crate::server_stream::VerbsControl;
use crate::server_stream::{refuse, ServerStream};
use crate::stop::StopSignal;
use crate::stream::{read_frame, starts_with_whole_frame, FrameRead, POLL_INTERVAL, READ_BUFFER_BYTES};
use crate::tls::{self, ServerTls, TcpLink};
use crate::wire::{self, error_code, Kind};
use crate::Endpoint;

/// Limits and credentials of a region server.
#[derive(Clone)]
pub struct ServerOptions {
    /// Shared secret every connection must prove it knows ([`crate::auth`]).
    pub token: String,
    /// Who may connect instead of `token`'s holders: users with their password keys (a
    /// computenode's remote front end, from its ACL).
    pub credentials: Option<Arc<dyn Credentials>>,
    /// TLS on tcp endpoints: with it they speak only TLS. Unix sockets stay on the host and
    /// need none; verbs control channels do not use it.
    pub tls: Option<ServerTls>,
    /// Connections beyond this are refused with an error frame.
    pub max_connections: usize,
    /// A frame that stalls longer than this mid-way costs its connection; also the write
    /// timeout and the time a new connection has for TLS and the token handshake.
    pub io_timeout: Duration,
    /// The FLOCK credit scheduler: credits per grant, MAX_AQP, overload limits.
    pub flock: crate::flock::SchedulerOptions,
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("token", &"***")
            .field("credentials", &self.credentials)
            .field("tls", &self.tls)
            .field("max_connections", &self.max_connections)
            .field("io_timeout", &self.io_timeout)
            .finish()
    }
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            token: String::new(),
            credentials: None,
            tls: None,
            max_connections: 1024,
            io_timeout: Duration::from_secs(10),
            flock: crate::flock::SchedulerOptions::default(),
        }
    }
}

struct Metrics {
    connections: IntGaugeVec,
    accepted: IntCounterVec,
    refused: IntCounterVec,
    frame_errors: IntCounterVec,
    batches: IntCounter,
    /// Per op kind, in [`OpKind`] order (looked up once, not per op).
    ops: [IntCounter; 4],
    read_bytes: IntCounter,
    written_bytes: IntCounter,
    batch_seconds: Histogram,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    let ops = metric::counter_vec("racekv_softnic_ops_total", "One-sided ops executed", &["op"], &[]);
    Metrics {
        connections: metric::gauge_vec(
            "racekv_softnic_connections",
            "Open connections to the region server",
            &["listener"],
        ),
        accepted: metric::counter_vec(
            "racekv_softnic_connections_accepted_total",
            "Connections accepted",
            &["listener"],
            &[],
        ),
        refused: metric::counter_vec(
            "racekv_softnic_connections_refused_total",
            "Connections refused",
            &["reason"],
            &[],
        ),
        frame_errors: metric::counter_vec(
            "racekv_softnic_frame_errors_total",
            "Connections closed for a bad frame or I/O error",
            &["reason"],
            &[],
        ),
        batches: metric::counter("racekv_softnic_batches_total", "One-sided batches executed"),
        ops: ["read", "write", "cas", "faa"].map(|op| ops.with_label_values(&[op])),
        read_bytes: metric::counter("racekv_softnic_read_bytes_total", "Bytes returned by READs"),
        written_bytes: metric::counter("racekv_softnic_written_bytes_total", "Bytes stored by WRITEs"),
        batch_seconds: metric::latency_histogram(
            "racekv_softnic_batch_seconds",
            "Time to execute one batch against the region",
        ),
    }
});

#[cfg(feature = "rdma")]
type VerbsHost = crate::verbs::VerbsHost;
/// Stands in for the verbs host in builds without RDMA support (never constructed).
#[cfg(not(feature = "rdma"))]
enum VerbsHost {}
/// A verbs client's queue pair on this side (none without RDMA support).
#[cfg(feature = "rdma")]
type ServerQp = crate::verbs::ServerQp;
#[cfg(not(feature = "rdma"))]
type ServerQp = ();

/// Registers the region with the RDMA device for `endpoint`.
#[cfg(feature = "rdma")]
fn register_verbs(region: &Arc<Region>, endpoint: &Endpoint) -> io::Result<VerbsHost> {
    VerbsHost::register(Arc::clone(region)).map_err(|e| {
        let kind = if e.is_no_device() { io::ErrorKind::NotFound } else { io::ErrorKind::Other };
        io::Error::new(kind, format!("cannot serve {endpoint}: {e}"))
    })
}

#[cfg(not(feature = "rdma"))]
fn register_verbs(_region: &Arc<Region>, endpoint: &Endpoint) -> io::Result<VerbsHost> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        format!("cannot serve {endpoint}: this build has no RDMA support (rebuild with `--features rdma`); serve an shm: or tcp: endpoint instead"),
    ))
}

/// Answers a VerbsConnect: creates the client's queue pair (kept alive by the returned value
/// until the connection ends) and encodes the VerbsAccept reply into `out`.
#[cfg(feature = "rdma")]
fn accept_verbs(host: &VerbsHost, client: &wire::QpInfo, out: &mut Vec<u8>) -> Result<ServerQp, String> {
    let (qp, accept) = host.accept(client).map_err(|e| e.to_string())?;
    wire::encode_verbs_accept(out, &accept);
    Ok(qp)
}

#[cfg(not(feature = "rdma"))]
fn accept_verbs(host: &VerbsHost, _client: &wire::QpInfo, _out: &mut Vec<u8>) -> Result<ServerQp, String> {
    match *host {}
}

struct Shared {
    region: Arc<Region>,
    /// An RPC-only server (see [`RegionServer::serve_rpc`]): no region to serve.
    rpc_only: bool,
    region_file: Option<File>,
    /// The region's registration with the NIC, when a `verbs:` endpoint is served.
    verbs: Option<VerbsHost>,
    rpc: Arc<dyn RpcService>,
    flock: crate::flock::Scheduler,
    options: ServerOptions,
    instance: u64,
    /// Set at shutdown; wakes the acceptors, which wait on it with no timeout.
    stopping: StopSignal,
    live: AtomicUsize,
    next_conn: AtomicU64,
    /// Open connections, so shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, Box<dyn Fn() + Send>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    /// What FLOCK's lanes borrow from the server.
    fn lane_host(&self) -> LaneHost<'_> {
        LaneHost {
            rpc: &*self.rpc,
            scheduler: &self.flock,
            stopping: &self.stopping,
            stall: self.options.io_timeout,
            #[cfg(feature = "rdma")]
            verbs: self.verbs.as_ref(),
        }
    }
}

/// A running region server; stops (closing every connection) on [`RegionServer::shutdown`]
/// or drop.
pub struct RegionServer {
    shared: Arc<Shared>,
    endpoints: Vec<Endpoint>,
    unix_paths: Vec<PathBuf>,
}

impl RegionServer {
    /// Serves `region` on every endpoint in `listen` (tcp, shm and, with feature `rdma`, verbs
    /// endpoints; port 0 picks a free port). `region_file` is the file backing the region; shm
    /// endpoints need it. A verbs endpoint registers the whole region with the RDMA device
    /// here, once; without a device this fails with an error that names the alternatives.
    /// Serving verbs next to tcp or shm mixes NIC atomics with CPU atomics on one region, and
    /// real NICs (atomic_cap HCA) are atomic only with respect to themselves: do that only when
    /// the two kinds of client never race on the same words (tests, migrations).
    pub fn start(
        region: Arc<Region>,
        region_file: Option<File>,
        rpc: Arc<dyn RpcService>,
        options: ServerOptions,
        listen: &[Endpoint],
    ) -> io::Result<Self> {
        Self::start_inner(region, region_file, rpc, options, listen, false)
    }

    /// Starts the server; `rpc_only`: with no region to serve ([`RegionServer::serve_rpc`]).
    pub(crate) fn start_inner(
        region: Arc<Region>,
        region_file: Option<File>,
        rpc: Arc<dyn RpcService>,
        options: ServerOptions,
        listen: &[Endpoint],
        rpc_only: bool,
    ) -> io::Result<Self> {
        // Export every series from the start, at zero, so dashboards and alerts see them.
        for reason in ["malformed", "auth", "io", "hello_timeout"] {
            METRICS.frame_errors.with_label_values(&[reason]);
        }
        METRICS.refused.with_label_values(&["too_many_connections"]);
        for endpoint in listen {
            auth::register_listener(match endpoint {
                Endpoint::Tcp(_) => "tcp",
                Endpoint::Shm(_) => "unix",
                Endpoint::Verbs(_) => "verbs",
            });
        }
        if options.tls.is_some() && !listen.iter().any(|e| matches!(e, Endpoint::Tcp(_))) {
            tracing::warn!("region server: TLS is configured but no tcp endpoint is served; it applies to none");
        }
        let verbs = match listen.iter().find(|e| matches!(e, Endpoint::Verbs(_))) {
            Some(endpoint) => Some(register_verbs(&region, endpoint)?),
            None => None,
        };
        if verbs.is_some() && listen.iter().any(|e| !matches!(e, Endpoint::Verbs(_))) {
            tracing::warn!("region server: verbs and non-verbs endpoints on one region; NIC and CPU atomics are not atomic with respect to each other");
        }
        let shared = Arc::new(Shared {
            region,
            rpc_only,
            region_file,
            verbs,
            rpc,
            flock: crate::flock::Scheduler::new(options.flock.clone()),
            options,
            instance: random_u64(),
            stopping: StopSignal::new()?,
            live: AtomicUsize::new(0),
            next_conn: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let mut server = Self { shared: Arc::clone(&shared), endpoints: Vec::new(), unix_paths: Vec::new() };
        for endpoint in listen {
            server.listen(endpoint)?;
        }
        Ok(server)
    }

    /// Binds `endpoint` and starts accepting on it.
    fn listen(&mut self, endpoint: &Endpoint) -> io::Result<()> {
        match endpoint {
            Endpoint::Tcp(addr) => {
                let listener = TcpListener::bind(addr.as_str())?;
                let bound = listener.local_addr()?;
                self.endpoints.push(Endpoint::Tcp(bound.to_string()));
                self.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| TcpLink::Plain(s)))?;
            }
            Endpoint::Shm(path) => {
                if self.shared.region_file.is_none() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "an shm endpoint needs a file-backed region",
                    ));
                }
                let listener = crate::listen::bind_unix(path, "another region server")?;
                self.unix_paths.push(path.clone());
                self.endpoints.push(endpoint.clone());
                self.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| s))?;
            }
            #[cfg(feature = "rdma")]
            Endpoint::Verbs(addr) => {
                let listener = TcpListener::bind(addr.as_str())?;
                let bound = listener.local_addr()?;
                self.endpoints.push(Endpoint::Verbs(bound.to_string()));
                self.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| VerbsControl(s)))?;
            }
            #[cfg(not(feature = "rdma"))]
            Endpoint::Verbs(_) => unreachable!("register_verbs refused it"),
        }
        Ok(())
    }

    /// Where the server listens (bound addresses, so port 0 is resolved).
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The TLS settings of the tcp endpoints, to reload them ([`ServerTls::reload`]).
    pub fn tls(&self) -> Option<&ServerTls> {
        self.shared.options.tls.as_ref()
    }

    /// Random per start; clients see it in the hello reply.
    pub fn instance(&self) -> u64 {
        self.shared.instance
    }

    /// FLOCK lanes the credit scheduler holds active.
    pub fn flock_active_lanes(&self) -> usize {
        self.shared.flock.active()
    }

    /// Credit renewals this server's scheduler refused so far.
    pub fn flock_refusals(&self) -> u64 {
        self.shared.flock.refusals()
    }

    /// Number of open client connections (FLOCK lanes included: each is a connection).
    pub fn connections(&self) -> usize {
        self.shared.live.load(Ordering::Relaxed)
    }

    /// A function reporting the open connections, for a metrics thread to hold.
    pub fn connections_handle(&self) -> impl Fn() -> usize + Send + 'static {
        let shared = Arc::clone(&self.shared);
        move || shared.live.load(Ordering::Relaxed)
    }

    fn spawn_acceptor<L, S>(&self, listener: L, accept: fn(&L) -> io::Result<S>) -> io::Result<()>
    where
        L: AsFd + Send + 'static,
        S: ServerStream,
    {
        let shared = Arc::clone(&self.shared);
        let handle = std::thread::Builder::new().name("region-accept".into()).spawn(move || {
            shared.stopping.accept_until_stopped("region server", &listener, accept, |stream| admit(&shared, stream))
        })?;
        self.shared.threads.lock().push(handle);
        Ok(())
    }

    /// Stops accepting, closes every connection and waits for their threads.
    pub fn shutdown(&mut self) {
        self.shared.stopping.stop();
        for close in self.shared.conns.lock().values() {
            close();
        }
        let threads: Vec<_> = std::mem::take(&mut *self.shared.threads.lock());
        for thread in threads {
            let _ = thread.join();
        }
        for path in self.unix_paths.drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for RegionServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn admit<S: ServerStream>(shared: &Arc<Shared>, mut stream: S) {
    let listener = stream.listener();
    if shared.live.load(Ordering::Acquire) >= shared.options.max_connections {
        METRICS.refused.with_label_values(&["too_many_connections"]).inc();
        let mut out = Vec::new();
        wire::encode_error(
            &mut out,
            0,
            error_code::TOO_MANY_CONNECTIONS,
            &format!("connection limit of {} reached", shared.options.max_connections),
        );
        let _ = stream.set_timeouts(POLL_INTERVAL, Duration::from_millis(100));
        let _ = stream.write_all(&out);
        return;
    }
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let closer = match stream.try_clone_stream() {
        Ok(clone) => clone,
        Err(e) => {
            tracing::warn!("region server: cannot clone a connection handle: {e}");
            return;
        }
    };
    shared.conns.lock().insert(id, Box::new(move || closer.shutdown_both()));
    // Connection threads block in reads with no short timeout: shutdown unblocks them by
    // closing their sockets. One admitted after shutdown went over the map closes itself.
    if shared.stopping.is_stopped() {
        if let Some(close) = shared.conns.lock().remove(&id) {
            close();
        }
    }
    shared.live.fetch_add(1, Ordering::AcqRel);
    METRICS.connections.with_label_values(&[listener]).inc();
    METRICS.accepted.with_label_values(&[listener]).inc();
    let conn_shared = Arc::clone(shared);
    let spawned = crate::listen::spawn_tracked(&shared.threads, format!("region-conn-{id}"), move || {
        if let Err(reason) = serve(&conn_shared, stream) {
            METRICS.frame_errors.with_label_values(&[reason]).inc();
        }
        conn_shared.conns.lock().remove(&id);
        conn_shared.live.fetch_sub(1, Ordering::AcqRel);
        METRICS.connections.with_label_values(&[listener]).dec();
    });
    if let Err(e) = spawned {
        tracing::error!("region server: cannot spawn a connection thread: {e}");
        if let Some(close) = shared.conns.lock().remove(&id) {
            close();
        }
        shared.live.fetch_sub(1, Ordering::AcqRel);
        METRICS.connections.with_label_values(&[listener]).dec();
    }
}

/// TLS where configured, then the handshake, within the I/O timeout: who the peer is, or
/// Ok(None) when it left before saying anything (a port probe).
fn authenticate<S: ServerStream>(shared: &Shared, stream: &mut S) -> Result<Option<Caller>, AuthFailure> {
    let deadline = Instant::now() + shared.options.io_timeout;
    if let Err(e) = stream.start_tls(shared.options.tls.as_ref(), deadline) {
        return match e.kind() {
            io::ErrorKind::UnexpectedEof => Ok(None),
            io::ErrorKind::TimedOut => Err(AuthFailure::Timeout),
            _ if tls::is_tls_error(&e) => Err(AuthFailure::Tls(e.to_string())),
            _ => Err(AuthFailure::Io(e.to_string())),
        };
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let token;
    let credentials: &dyn Credentials = match &shared.options.credentials {
        Some(credentials) => &**credentials,
        None => {
            token = Token(shared.options.token.as_bytes().to_vec());
            &token
        }
    };
    Ok(match auth::accept(stream, credentials, left)? {
        Accepted::Authenticated(caller) => Some(caller),
        Accepted::Gone => None,
    })
}

/// A decoded frame; a malformed one is refused and the connection closed.
fn decoded<S: ServerStream, T>(
    stream: &mut S,
    out: &mut Vec<u8>,
    request_id: u64,
    decoded: Result<T, crate::decode::DecodeError>,
) -> Result<T, &'static str> {
    match decoded {
        Ok(value) => Ok(value),
        Err(e) => refuse(stream, out, request_id, error_code::MALFORMED, &e.to_string(), "malformed"),
    }
}

/// Serves one connection until it closes. Returns the reason when it ends badly.
fn serve<S: ServerStream>(shared: &Shared, mut stream: S) -> Result<(), &'static str> {
    // Reads wait up to the I/O timeout, which bounds a stall mid-frame and the wait for hello;
    // an idle connection costs no wake-ups in between (shutdown closes the socket).
    if stream.set_timeouts(shared.options.io_timeout, shared.options.io_timeout).is_err() {
        return Err("io");
    }
    let Some(caller) = admit_peer(shared, &mut stream)? else {
        return Ok(());
    };
    let mut out = Vec::with_capacity(4096);
    say_hello(shared, &mut stream, &mut out)?;
    serve_frames(shared, stream, &caller, out)
}

/// [`authenticate`], with a failure counted, logged and refused.
fn admit_peer<S: ServerStream>(shared: &Shared, stream: &mut S) -> Result<Option<Caller>, &'static str> {
    authenticate(shared, stream).map_err(|failure| {
        auth::record_failure(stream.listener(), &stream.peer(), &failure);
        if let Some(frame) = failure.refusal() {
            let _ = stream.write_all(&frame);
        }
        stream.shutdown_both();
        if failure == AuthFailure::Timeout {
            "hello_timeout"
        } else {
            "auth"
        }
    })
}

/// HelloOk: the region's size, this start's instance and, on a Unix socket, the region's
/// file descriptor.
fn say_hello<S: ServerStream>(shared: &Shared, stream: &mut S, out: &mut Vec<u8>) -> Result<(), &'static str> {
    let send_fd = stream.listener() == "unix";
    let flags = if send_fd { wire::HELLO_FLAG_REGION_FD } else { 0 };
    let region_len = if shared.rpc_only { 0 } else { shared.region.len() };
    wire::encode_hello_ok(out, &wire::HelloOk { region_len, instance: shared.instance, flags });
    let sent = match (&shared.region_file, send_fd) {
        (Some(file), true) => stream.send_with_fd(out, file.as_fd()),
        (None, true) => Err(io::Error::new(io::ErrorKind::Unsupported, "no region file")),
        (_, false) => stream.write_all(out),
    };
    sent.map_err(|_| "io")
}

/// Answers frames after hello until the connection closes, or hands it to FLOCK when it
/// opens a lane.
///
/// Frames come through a buffer, so every request already queued arrives in one read, and
/// batches' answers wait in `replies` until no whole frame is left buffered: one write
/// answers all the batches one read brought (fewer system calls, packets and wake-ups on
/// both sides). Nothing is held while the loop could block.
fn serve_frames<S: ServerStream>(
    shared: &Shared,
    stream: S,
    caller: &Caller,
    mut out: Vec<u8>,
) -> Result<(), &'static str> {
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, stream);
    let mut replies = Vec::with_capacity(4096);
    let mut body = Vec::new();
    let mut batch = Batch::new();
    // A verbs client's queue pair on this side; destroyed when this connection ends.
    let mut queue_pair = None;
    loop {
        if shared.stopping.is_stopped() {
            return Ok(());
        }
        if !replies.is_empty() && (replies.len() >= READ_BUFFER_BYTES || !starts_with_whole_frame(reader.buffer())) {
            send_replies(reader.get_mut(), &mut replies)?;
        }
        let header = match read_frame(&mut reader, &mut body, shared.options.io_timeout) {
            Ok(FrameRead::Frame(header)) => header,
            Ok(FrameRead::Idle) => continue,
            Ok(FrameRead::Closed) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                let stream = reader.get_mut();
                send_replies(stream, &mut replies)?;
                return refuse(stream, &mut out, 0, error_code::MALFORMED, &e.to_string(), "malformed");
            }
            Err(_) => return Err("io"),
        };
        let id = header.request_id;
        if header.kind == Kind::Batch {
            execute_batch(shared, reader.get_mut(), id, &body, &mut batch, &mut replies)?;
            continue;
        }
        // Anything else is answered in order after the batches before it.
        let stream = reader.get_mut();
        send_replies(stream, &mut replies)?;
        out.clear();
        match header.kind {
            Kind::VerbsConnect => {
                let has_queue_pair = queue_pair.is_some();
                queue_pair = Some(connect_verbs(shared, stream, id, &body, has_queue_pair, &mut out)?);
            }
            Kind::RpcRequest => answer_rpc(shared, stream, caller, id, &body, &mut out)?,
            Kind::FlockOpen => {
                if !reader.buffer().is_empty() {
                    let message = "frames sent after FlockOpen before its answer";
                    return refuse(reader.get_mut(), &mut out, id, error_code::MALFORMED, message, "malformed");
                }
                let stream = reader.get_mut();
                let open = decoded(stream, &mut out, id, wire::decode_flock_open(&body))?;
                // The connection is a FLOCK lane from now on (nothing of it is buffered).
                return serve_lane_connection(&shared.lane_host(), stream, &open, caller, &mut out);
            }
            kind => {
                let message = format!("a client may not send {kind:?} frames");
                return refuse(stream, &mut out, id, error_code::UNSUPPORTED, &message, "malformed");
            }
        }
    }
}

/// Writes the batches' answers gathered so far.
fn send_replies<S: ServerStream>(stream: &mut S, replies: &mut Vec<u8>) -> Result<(), &'static str> {
    if replies.is_empty() {
        return Ok(());
    }
    let sent = stream.write_all(replies).map_err(|_| "io");
    replies.clear();
    sent
}

/// A one-sided batch, executed against the region: the software NIC. Its answer is appended
/// to `replies` (written by the caller); a refusal writes those first, then closes.
fn execute_batch<S: ServerStream>(
    shared: &Shared,
    stream: &mut S,
    request_id: u64,
    body: &[u8],
    batch: &mut Batch,
    replies: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let refusal = if shared.rpc_only {
        let message = "this server answers RPCs only: it has no region for one-sided operations";
        Some((error_code::UNSUPPORTED, message.to_string()))
    } else if stream.listener() == "verbs" {
        let message = "a verbs control channel carries no batches: post them on the queue pair";
        Some((error_code::UNSUPPORTED, message.to_string()))
    } else {
        wire::decode_batch(body, batch).err().map(|e| (error_code::MALFORMED, e.to_string()))
    };
    if let Some((code, message)) = refusal {
        send_replies(stream, replies)?;
        return refuse(stream, replies, request_id, code, &message, "malformed");
    }
    let started = Instant::now();
    shared.region.apply(batch);
    METRICS.batch_seconds.observe(started.elapsed().as_secs_f64());
    record_batch(batch);
    wire::encode_batch_result(replies, request_id, batch);
    Ok(())
}

/// A VerbsConnect: the client's queue pair on this side (one per control connection),
/// answered with VerbsAccept.
fn connect_verbs<S: ServerStream>(
    shared: &Shared,
    stream: &mut S,
    request_id: u64,
    body: &[u8],
    has_queue_pair: bool,
    out: &mut Vec<u8>,
) -> Result<ServerQp, &'static str> {
    let client = decoded(stream, out, request_id, wire::decode_verbs_connect(body))?;
    let host = match (&shared.verbs, stream.listener()) {
        (Some(host), "verbs") => host,
        _ => {
            let message = "this endpoint does not serve verbs";
            return refuse(stream, out, request_id, error_code::UNSUPPORTED, message, "malformed");
        }
    };
    if has_queue_pair {
        let message = "one queue pair per control connection";
        return refuse(stream, out, request_id, error_code::MALFORMED, message, "malformed");
    }
    match accept_verbs(host, &client, out) {
        Ok(qp) => {
            stream.write_all(out).map_err(|_| "io")?;
            Ok(qp)
        }
        Err(message) => {
            tracing::warn!("region server: cannot set up a verbs client: {message}");
            refuse(stream, out, request_id, error_code::SETUP_FAILED, &message, "verbs_setup")
        }
    }
}

/// The legacy RpcRequest frame: one RPC answered on the connection itself.
fn answer_rpc<S: ServerStream>(
    shared: &Shared,
    stream: &mut S,
    caller: &Caller,
    request_id: u64,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let (method, payload) = decoded(stream, out, request_id, wire::decode_rpc_request(body))?;
    let started = Instant::now();
    let name = shared.rpc.method_name(method);
    let result = shared.rpc.call_as(caller, method, payload);
    record_rpc(name, result.is_ok(), started.elapsed());
    match result {
        Ok(response) => wire::encode_rpc_response(out, request_id, 0, &response),
        Err(status) => wire::encode_rpc_response(out, request_id, status.code.max(1), status.message.as_bytes()),
    }
    stream.write_all(out).map_err(|_| "io")
}

fn record_batch(batch: &Batch) {
    METRICS.batches.inc();
    let (read, written) = batch.byte_totals();
    METRICS.read_bytes.inc_by(read);
    METRICS.written_bytes.inc_by(written);
    for op in batch.ops() {
        METRICS.ops[op.kind as usize - OpKind::Read as usize].inc();
    }
}
