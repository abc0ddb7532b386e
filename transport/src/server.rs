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
//! FlockOpen after hello. On tcp its messages travel on that stream, on a Unix socket in
//! shared-memory rings, on verbs as RDMA WRITEs into registered rings over the lane's own
//! queue pair ([`crate::flock`]). The legacy RpcRequest frame is still answered.
//!
//! The software NIC knows nothing of what lives in the region: it bounds-checks and executes.
//! Malformed, truncated or oversized frames, and any frame before the handshake, get an
//! Error frame and cost only their own connection.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts};

use crate::auth::{self, Accepted, AuthFailure, Caller, Credentials, Token};
use crate::batch::{Batch, OpKind};
use crate::error::RpcStatus;
use crate::region::Region;
use crate::stop::StopSignal;
use crate::stream::{read_frame, FrameRead, POLL_INTERVAL};
use crate::tls::{self, ServerTls, TcpLink, TlsStream};
use crate::wire::{self, error_code, Kind};
use crate::Endpoint;

/// Answers RPCs arriving on a region server's connections.
pub trait RpcService: Send + Sync + 'static {
    /// Handles one request. Errors go back to the caller as an [`RpcStatus`].
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus>;
    /// Handles one request from a connection that authenticated as `caller`. The default
    /// serves everyone alike (every caller of a memnode holds the same token); a service
    /// whose callers are users checks what each may do.
    fn call_as(&self, caller: &Caller, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        let _ = caller;
        self.call(method, request)
    }
    /// A metric label for `method`.
    fn method_name(&self, method: u16) -> &'static str {
        let _ = method;
        "unknown"
    }
}

/// An [`RpcService`] that knows no methods (a bare region server).
pub struct NoRpc;

impl RpcService for NoRpc {
    fn call(&self, method: u16, _request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        Err(RpcStatus::new(RpcStatus::UNKNOWN_METHOD, format!("no rpc method {method} on this server")))
    }
}

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
    rpc_requests: IntCounterVec,
    rpc_seconds: HistogramVec,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::{register, LATENCY_BUCKETS_SECONDS};
    Metrics {
        connections: register(
            IntGaugeVec::new(
                Opts::new("racekv_softnic_connections", "Open connections to the region server"),
                &["listener"],
            )
            .unwrap(),
        ),
        accepted: register(
            IntCounterVec::new(
                Opts::new("racekv_softnic_connections_accepted_total", "Connections accepted"),
                &["listener"],
            )
            .unwrap(),
        ),
        refused: register(
            IntCounterVec::new(
                Opts::new("racekv_softnic_connections_refused_total", "Connections refused"),
                &["reason"],
            )
            .unwrap(),
        ),
        frame_errors: register(
            IntCounterVec::new(
                Opts::new("racekv_softnic_frame_errors_total", "Connections closed for a bad frame or I/O error"),
                &["reason"],
            )
            .unwrap(),
        ),
        batches: register(IntCounter::new("racekv_softnic_batches_total", "One-sided batches executed").unwrap()),
        ops: {
            let ops = register(
                IntCounterVec::new(Opts::new("racekv_softnic_ops_total", "One-sided ops executed"), &["op"]).unwrap(),
            );
            ["read", "write", "cas", "faa"].map(|op| ops.with_label_values(&[op]))
        },
        read_bytes: register(IntCounter::new("racekv_softnic_read_bytes_total", "Bytes returned by READs").unwrap()),
        written_bytes: register(
            IntCounter::new("racekv_softnic_written_bytes_total", "Bytes stored by WRITEs").unwrap(),
        ),
        batch_seconds: register(
            Histogram::with_opts(
                HistogramOpts::new("racekv_softnic_batch_seconds", "Time to execute one batch against the region")
                    .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
            )
            .unwrap(),
        ),
        rpc_requests: register(
            IntCounterVec::new(Opts::new("racekv_rpc_server_requests_total", "RPCs served"), &["method", "status"])
                .unwrap(),
        ),
        rpc_seconds: register(
            HistogramVec::new(
                HistogramOpts::new("racekv_rpc_server_seconds", "Time to serve one RPC")
                    .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
                &["method"],
            )
            .unwrap(),
        ),
    }
});

/// A socket the server loop can serve.
trait ServerStream: Read + Write + AsFd + Send + 'static {
    fn listener(&self) -> &'static str;
    /// The peer, for logs.
    fn peer(&self) -> String;
    /// Turns the connection into TLS when `tls` is given and this listener uses it (tcp).
    fn start_tls(&mut self, tls: Option<&ServerTls>, deadline: Instant) -> io::Result<()> {
        let _ = (tls, deadline);
        Ok(())
    }
    fn try_clone_stream(&self) -> io::Result<Self>
    where
        Self: Sized;
    fn shutdown_both(&self);
    /// Sends `bytes` with `fd` attached (Unix sockets only).
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()>;
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()>;
}

impl ServerStream for TcpStream {
    fn listener(&self) -> &'static str {
        "tcp"
    }
    fn peer(&self) -> String {
        self.peer_addr().map_or_else(|_| "unknown".into(), |a| a.to_string())
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn send_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "file descriptors travel only over Unix sockets"))
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

impl ServerStream for TcpLink {
    fn listener(&self) -> &'static str {
        "tcp"
    }
    fn peer(&self) -> String {
        self.socket().peer()
    }
    fn start_tls(&mut self, tls: Option<&ServerTls>, deadline: Instant) -> io::Result<()> {
        if let (Some(tls), TcpLink::Plain(socket)) = (tls, &*self) {
            *self = TcpLink::Tls(TlsStream::server(socket.try_clone()?, tls, deadline)?);
        }
        Ok(())
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        self.shutdown();
    }
    fn send_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "file descriptors travel only over Unix sockets"))
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.socket().set_timeouts(read, write)
    }
}

impl ServerStream for UnixStream {
    fn listener(&self) -> &'static str {
        "unix"
    }
    fn peer(&self) -> String {
        "unix socket".into()
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        crate::fdpass::send_with_fd(self, bytes, fd)
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

/// The control channel of a verbs client: a TCP stream that may carry the QP exchange and
/// RPC, but no batches.
#[cfg(feature = "rdma")]
struct VerbsControl(TcpStream);

#[cfg(feature = "rdma")]
impl Read for VerbsControl {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

#[cfg(feature = "rdma")]
impl Write for VerbsControl {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(feature = "rdma")]
impl AsFd for VerbsControl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(feature = "rdma")]
impl ServerStream for VerbsControl {
    fn listener(&self) -> &'static str {
        "verbs"
    }
    fn peer(&self) -> String {
        self.0.peer()
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.0.try_clone().map(VerbsControl)
    }
    fn shutdown_both(&self) {
        self.0.shutdown_both();
    }
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        self.0.send_with_fd(bytes, fd)
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.0.set_timeouts(read, write)
    }
}

#[cfg(feature = "rdma")]
type VerbsHost = crate::verbs::VerbsHost;
/// Stands in for the verbs host in builds without RDMA support (never constructed).
#[cfg(not(feature = "rdma"))]
enum VerbsHost {}

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
fn accept_verbs(host: &VerbsHost, client: &wire::QpInfo, out: &mut Vec<u8>) -> Result<crate::verbs::ServerQp, String> {
    let (qp, accept) = host.accept(client).map_err(|e| e.to_string())?;
    wire::encode_verbs_accept(out, &accept);
    Ok(qp)
}

#[cfg(not(feature = "rdma"))]
fn accept_verbs(host: &VerbsHost, _client: &wire::QpInfo, _out: &mut Vec<u8>) -> Result<(), String> {
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

    /// Serves only RPCs (FLOCK lanes and RPC frames), on tcp endpoints, with no region: for
    /// request/response services between tiers, such as a computenode's remote clients.
    /// One-sided batches are refused; hello reports a region of 0 bytes.
    pub fn serve_rpc(rpc: Arc<dyn RpcService>, options: ServerOptions, listen: &[Endpoint]) -> io::Result<Self> {
        if let Some(other) = listen.iter().find(|e| !matches!(e, Endpoint::Tcp(_))) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("an RPC-only server listens on tcp endpoints, not {other}"),
            ));
        }
        let placeholder = Arc::new(Region::anonymous(crate::region::REGION_ALIGN_BYTES)?);
        Self::start_inner(placeholder, None, rpc, options, listen, true)
    }

    fn start_inner(
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
            match endpoint {
                Endpoint::Tcp(addr) => {
                    let listener = TcpListener::bind(addr.as_str())?;
                    let bound = listener.local_addr()?;
                    server.endpoints.push(Endpoint::Tcp(bound.to_string()));
                    server.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| TcpLink::Plain(s)))?;
                }
                Endpoint::Shm(path) => {
                    if shared.region_file.is_none() {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            "an shm endpoint needs a file-backed region",
                        ));
                    }
                    if path.exists() {
                        // A socket left by a killed server; refuse if something still answers.
                        if UnixStream::connect(path).is_ok() {
                            return Err(io::Error::new(
                                io::ErrorKind::AddrInUse,
                                format!("{} is served by another process", path.display()),
                            ));
                        }
                        std::fs::remove_file(path)?;
                    }
                    let listener = UnixListener::bind(path)?;
                    server.unix_paths.push(path.clone());
                    server.endpoints.push(endpoint.clone());
                    server.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| s))?;
                }
                #[cfg(feature = "rdma")]
                Endpoint::Verbs(addr) => {
                    let listener = TcpListener::bind(addr.as_str())?;
                    let bound = listener.local_addr()?;
                    server.endpoints.push(Endpoint::Verbs(bound.to_string()));
                    server.spawn_acceptor(listener, |l| l.accept().map(|(s, _)| VerbsControl(s)))?;
                }
                #[cfg(not(feature = "rdma"))]
                Endpoint::Verbs(_) => unreachable!("register_verbs refused it"),
            }
        }
        Ok(server)
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

pub(crate) fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_err() {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        return xxhash_rust::xxh3::xxh3_64(&nanos.to_le_bytes()) ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(bytes)
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
    let spawned = std::thread::Builder::new().name(format!("region-conn-{id}")).spawn(move || {
        if let Err(reason) = serve(&conn_shared, stream) {
            METRICS.frame_errors.with_label_values(&[reason]).inc();
        }
        conn_shared.conns.lock().remove(&id);
        conn_shared.live.fetch_sub(1, Ordering::AcqRel);
        METRICS.connections.with_label_values(&[listener]).dec();
    });
    match spawned {
        Ok(handle) => {
            let mut threads = shared.threads.lock();
            threads.retain(|t| !t.is_finished());
            threads.push(handle);
        }
        Err(e) => {
            tracing::error!("region server: cannot spawn a connection thread: {e}");
            if let Some(close) = shared.conns.lock().remove(&id) {
                close();
            }
            shared.live.fetch_sub(1, Ordering::AcqRel);
            METRICS.connections.with_label_values(&[listener]).dec();
        }
    }
}

/// Refuses the connection with an error frame; returns the metric reason.
fn refuse<S: ServerStream>(
    stream: &mut S,
    out: &mut Vec<u8>,
    request_id: u64,
    code: u16,
    message: &str,
    reason: &'static str,
) -> Result<(), &'static str> {
    out.clear();
    wire::encode_error(out, request_id, code, message);
    let _ = stream.write_all(out);
    stream.shutdown_both();
    Err(reason)
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
    decoded: Result<T, wire::WireError>,
) -> Result<T, &'static str> {
    decoded.map_err(|e| {
        refuse(stream, out, request_id, error_code::MALFORMED, &e.to_string(), "malformed")
            .expect_err("a refusal ends the connection")
    })
}

/// Serves one connection until it closes. Returns the reason when it ends badly.
fn serve<S: ServerStream>(shared: &Shared, mut stream: S) -> Result<(), &'static str> {
    // Reads wait up to the I/O timeout, which bounds a stall mid-frame and the wait for hello;
    // an idle connection costs no wake-ups in between (shutdown closes the socket).
    if stream.set_timeouts(shared.options.io_timeout, shared.options.io_timeout).is_err() {
        return Err("io");
    }
    let caller = match authenticate(shared, &mut stream) {
        Ok(Some(caller)) => caller,
        Ok(None) => return Ok(()),
        Err(failure) => {
            auth::record_failure(stream.listener(), &stream.peer(), &failure);
            if let Some(frame) = failure.refusal() {
                let _ = stream.write_all(&frame);
            }
            stream.shutdown_both();
            return Err(if failure == AuthFailure::Timeout { "hello_timeout" } else { "auth" });
        }
    };
    let mut out = Vec::with_capacity(4096);
    let send_fd = stream.listener() == "unix";
    let flags = if send_fd { wire::HELLO_FLAG_REGION_FD } else { 0 };
    let region_len = if shared.rpc_only { 0 } else { shared.region.len() };
    wire::encode_hello_ok(&mut out, &wire::HelloOk { region_len, instance: shared.instance, flags });
    let sent = match (&shared.region_file, send_fd) {
        (Some(file), true) => stream.send_with_fd(&out, file.as_fd()),
        (None, true) => Err(io::Error::new(io::ErrorKind::Unsupported, "no region file")),
        (_, false) => stream.write_all(&out),
    };
    sent.map_err(|_| "io")?;

    let mut body = Vec::new();
    let mut batch = Batch::new();
    // A verbs client's queue pair on this side; destroyed when this connection ends.
    let mut queue_pair = None;
    loop {
        if shared.stopping.is_stopped() {
            return Ok(());
        }
        let header = match read_frame(&mut stream, &mut body, shared.options.io_timeout) {
            Ok(FrameRead::Frame(header)) => header,
            Ok(FrameRead::Idle) => continue,
            Ok(FrameRead::Closed) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return refuse(&mut stream, &mut out, 0, error_code::MALFORMED, &e.to_string(), "malformed");
            }
            Err(_) => return Err("io"),
        };
        out.clear();
        match header.kind {
            Kind::Batch if shared.rpc_only => {
                return refuse(
                    &mut stream,
                    &mut out,
                    header.request_id,
                    error_code::UNSUPPORTED,
                    "this server answers RPCs only: it has no region for one-sided operations",
                    "malformed",
                );
            }
            Kind::Batch if stream.listener() == "verbs" => {
                return refuse(
                    &mut stream,
                    &mut out,
                    header.request_id,
                    error_code::UNSUPPORTED,
                    "a verbs control channel carries no batches: post them on the queue pair",
                    "malformed",
                );
            }
            Kind::VerbsConnect => {
                let client = decoded(&mut stream, &mut out, header.request_id, wire::decode_verbs_connect(&body))?;
                let host = match (&shared.verbs, stream.listener()) {
                    (Some(host), "verbs") => host,
                    _ => {
                        return refuse(
                            &mut stream,
                            &mut out,
                            header.request_id,
                            error_code::UNSUPPORTED,
                            "this endpoint does not serve verbs",
                            "malformed",
                        )
                    }
                };
                if queue_pair.is_some() {
                    return refuse(
                        &mut stream,
                        &mut out,
                        header.request_id,
                        error_code::MALFORMED,
                        "one queue pair per control connection",
                        "malformed",
                    );
                }
                match accept_verbs(host, &client, &mut out) {
                    Ok(qp) => queue_pair = Some(qp),
                    Err(message) => {
                        tracing::warn!("region server: cannot set up a verbs client: {message}");
                        return refuse(
                            &mut stream,
                            &mut out,
                            header.request_id,
                            error_code::SETUP_FAILED,
                            &message,
                            "verbs_setup",
                        );
                    }
                }
                stream.write_all(&out).map_err(|_| "io")?;
            }
            Kind::Batch => {
                decoded(&mut stream, &mut out, header.request_id, wire::decode_batch(&body, &mut batch))?;
                let started = Instant::now();
                shared.region.apply(&mut batch);
                METRICS.batch_seconds.observe(started.elapsed().as_secs_f64());
                record_batch(&batch);
                wire::encode_batch_result(&mut out, header.request_id, &batch);
                stream.write_all(&out).map_err(|_| "io")?;
            }
            Kind::RpcRequest => {
                let (method, payload) =
                    decoded(&mut stream, &mut out, header.request_id, wire::decode_rpc_request(&body))?;
                let started = Instant::now();
                let name = shared.rpc.method_name(method);
                let result = shared.rpc.call_as(&caller, method, payload);
                METRICS.rpc_seconds.with_label_values(&[name]).observe(started.elapsed().as_secs_f64());
                match result {
                    Ok(response) => {
                        METRICS.rpc_requests.with_label_values(&[name, "ok"]).inc();
                        wire::encode_rpc_response(&mut out, header.request_id, 0, &response);
                    }
                    Err(status) => {
                        METRICS.rpc_requests.with_label_values(&[name, "error"]).inc();
                        wire::encode_rpc_response(
                            &mut out,
                            header.request_id,
                            status.code.max(1),
                            status.message.as_bytes(),
                        );
                    }
                }
                stream.write_all(&out).map_err(|_| "io")?;
            }
            Kind::FlockOpen => {
                let open = decoded(&mut stream, &mut out, header.request_id, wire::decode_flock_open(&body))?;
                // The connection is a FLOCK lane from now on.
                let (lane, credits) = shared.flock.open(open.sender);
                let result = serve_flock_lane(shared, &mut stream, &open, lane, credits, &caller, &mut out);
                shared.flock.close(lane);
                return result;
            }
            kind => {
                return refuse(
                    &mut stream,
                    &mut out,
                    header.request_id,
                    error_code::UNSUPPORTED,
                    &format!("a client may not send {kind:?} frames"),
                    "malformed",
                );
            }
        }
    }
}

/// Counts one RPC served (by FLOCK's receiver or the legacy RpcRequest frame).
pub(crate) fn record_rpc(name: &'static str, ok: bool, took: Duration) {
    METRICS.rpc_seconds.with_label_values(&[name]).observe(took.as_secs_f64());
    METRICS.rpc_requests.with_label_values(&[name, if ok { "ok" } else { "error" }]).inc();
}

/// Answers FlockOpen with the carrier this listener offers and serves the lane.
fn serve_flock_lane<S: ServerStream>(
    shared: &Shared,
    stream: &mut S,
    open: &wire::FlockOpen,
    lane: crate::flock::scheduler::LaneId,
    credits: u32,
    caller: &Caller,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    use crate::flock::receiver::{serve_lane, LaneContext};
    let key = (random_u64() as u32) | 1;
    let batch = shared.flock.options().credits;
    let cx = LaneContext {
        rpc: &*shared.rpc,
        caller,
        scheduler: &shared.flock,
        lane,
        key,
        initial_credits: credits,
        stopping: &shared.stopping,
    };
    out.clear();
    match stream.listener() {
        "tcp" => {
            if open.verbs.is_some() {
                return refuse(stream, out, 0, error_code::MALFORMED, "a tcp lane has no queue pair", "malformed");
            }
            wire::encode_flock_accept(out, &wire::FlockAccept { key, credits, batch, ring_bytes: 0, verbs: None });
            stream.write_all(out).map_err(|_| "io")?;
            let stall = shared.options.io_timeout;
            serve_lane(&mut crate::flock::stream::StreamCarrier { stream, stall }, &cx)
        }
        "unix" => {
            if open.verbs.is_some() {
                return refuse(stream, out, 0, error_code::MALFORMED, "an shm lane has no queue pair", "malformed");
            }
            let (file, mut carrier) = match crate::flock::shm::ServerRings::create() {
                Ok(parts) => parts,
                Err(e) => {
                    tracing::warn!("region server: cannot create flock rings: {e}");
                    return refuse(stream, out, 0, error_code::SETUP_FAILED, &e.to_string(), "io");
                }
            };
            carrier.keyed(key, shared.options.io_timeout);
            let ring_bytes = carrier.ring_bytes();
            wire::encode_flock_accept(out, &wire::FlockAccept { key, credits, batch, ring_bytes, verbs: None });
            stream.send_with_fd(out, file.as_fd()).map_err(|_| "io")?;
            drop(file);
            carrier.watch(stream.as_fd());
            serve_lane(&mut carrier, &cx)
        }
        _ => serve_verbs_lane(shared, stream, open, &cx, credits, batch, out),
    }
}

/// A verbs lane: the client's FlockOpen carries its queue pair and response ring; we make
/// ours (QP and request ring), connect, answer with their description and serve the lane
/// over RDMA, keeping this TCP connection only to notice the client leaving.
#[cfg(feature = "rdma")]
fn serve_verbs_lane<S: ServerStream>(
    shared: &Shared,
    stream: &mut S,
    open: &wire::FlockOpen,
    cx: &crate::flock::receiver::LaneContext<'_>,
    credits: u32,
    batch: u32,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    let Some(peer) = open.verbs else {
        return refuse(
            stream,
            out,
            0,
            error_code::MALFORMED,
            "a verbs lane needs the sender's queue pair and ring (FlockOpen without its verbs part)",
            "malformed",
        );
    };
    let Some(host) = &shared.verbs else {
        return refuse(stream, out, 0, error_code::UNSUPPORTED, "this endpoint does not serve verbs", "malformed");
    };
    let stall = shared.options.io_timeout;
    let (mut carrier, mine) = match crate::flock::verbs::ServerLane::accept(host.device(), &peer, cx.key, stall) {
        Ok(parts) => parts,
        Err(message) => {
            tracing::warn!("region server: cannot set up a flock verbs lane: {message}");
            return refuse(stream, out, 0, error_code::SETUP_FAILED, &message, "verbs_setup");
        }
    };
    let accept = wire::FlockAccept { key: cx.key, credits, batch, ring_bytes: mine.ring_len, verbs: Some(mine) };
    wire::encode_flock_accept(out, &accept);
    stream.write_all(out).map_err(|_| "io")?;
    carrier.watch(stream.as_fd());
    crate::flock::receiver::serve_lane(&mut carrier, cx)
}

#[cfg(not(feature = "rdma"))]
fn serve_verbs_lane<S: ServerStream>(
    _shared: &Shared,
    stream: &mut S,
    _open: &wire::FlockOpen,
    _cx: &crate::flock::receiver::LaneContext<'_>,
    _credits: u32,
    _batch: u32,
    out: &mut Vec<u8>,
) -> Result<(), &'static str> {
    // No verbs listener exists in a build without RDMA support.
    refuse(stream, out, 0, error_code::UNSUPPORTED, "this build serves no verbs lanes", "malformed")
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
