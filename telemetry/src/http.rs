//! The daemons' HTTP endpoint: `/metrics`, `/healthz` (alive), `/readyz` (ready to take
//! traffic: 503 with the reason when a [`ReadyFn`] says not) and an optional JSON `/status`.
//!
//! Anyone who can reach the port can talk to it (example configs bind `0.0.0.0`), so every
//! byte is untrusted and nothing a peer claims sizes an allocation:
//!
//! * hyper's HTTP/1 server parses requests into a buffer of at most
//!   [`HttpLimits::max_header_bytes`] (request line and headers together) with at most
//!   [`HttpLimits::max_headers`] headers; a longer head gets 431 and the connection closes.
//! * A request that carries a body (a `Content-Length` above 0, or any `Transfer-Encoding`)
//!   gets 413 and the connection closes: the body is never read or buffered.
//! * Only `GET` and `HEAD` (405 otherwise); routing looks at the path only, so `/metrics?x=1`
//!   is `/metrics`; an unknown path is 404.
//! * A connection must deliver each request head within [`HttpLimits::header_read_timeout_ms`]
//!   (this also ends idle keep-alive connections) and lives at most
//!   [`HttpLimits::connection_lifetime_ms`] (which ends slow readers of a response).
//! * At most [`HttpLimits::max_connections`] connections are open; one more is closed at once.
//!
//! Bad input closes at most its own connection. Refusals are counted in
//! `racekv_http_connections_refused_total{reason}` and logged at most once per
//! [`REFUSED_WARN_INTERVAL_MS`].
//!
//! Everything runs on one current-thread tokio runtime on the thread `metrics-http`:
//! rendering the metrics is synchronous and quick, and scrapes are rare.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::ratelimit::RateLimit;
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use http_body_util::Full;
use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{HeaderValue, ALLOW, CONNECTION, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::{metric, render};

/// Most connections open at once; one more is closed as soon as it is accepted.
pub const MAX_CONNECTIONS: usize = 64;
/// Most bytes of a request head (request line and headers); also the read buffer's size.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Most headers in one request.
pub const MAX_HEADERS: usize = 64;
/// How long a connection may take to deliver a request head, counted from when the server
/// starts waiting for one (so it also ends idle keep-alive connections).
pub const HEADER_READ_TIMEOUT_MS: u64 = 5_000;
/// How long a connection may stay open in all; then it finishes the request in progress
/// (within [`HttpLimits::header_read_timeout_ms`] more) and closes.
pub const CONNECTION_LIFETIME_MS: u64 = 30_000;
/// At most one warning line per this interval about refused connections (the rest are
/// counted in the metric and summed into the next line).
pub const REFUSED_WARN_INTERVAL_MS: u64 = 10_000;
/// Pause after a failed `accept` (out of descriptors, say), instead of spinning on it.
const ACCEPT_ERROR_PAUSE_MS: u64 = 50;
/// hyper refuses a read buffer smaller than this (`max_buf_size` panics below it).
const HYPER_MIN_BUF_BYTES: usize = 8192;

/// Renders a JSON status document on request.
pub type StatusFn = Arc<dyn Fn() -> String + Send + Sync>;

/// Says whether the process should get traffic now, or why not (the `/readyz` body). Called
/// on the endpoint's one thread for each probe, so it must be quick and never block.
pub type ReadyFn = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Most bytes of a not-ready reason sent back (a [`ReadyFn`] may list many memnodes).
const MAX_READY_REASON_BYTES: usize = 4096;

/// What the endpoint serves besides `/metrics` and `/healthz`.
#[derive(Clone, Default)]
pub struct Routes {
    /// `/status` (404 without it).
    pub status: Option<StatusFn>,
    /// `/readyz`; without it `/readyz` answers 200 whenever the endpoint serves (daemons
    /// start the endpoint last, once everything else serves).
    pub ready: Option<ReadyFn>,
}

/// The bounds the HTTP endpoint enforces on every peer. [`Default`] gives the constants above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most bytes of a request head (at least 8192, hyper's smallest read buffer).
    pub max_header_bytes: usize,
    /// Most headers in one request.
    pub max_headers: usize,
    /// Longest wait for a request head (and so longest idle keep-alive), in milliseconds.
    pub header_read_timeout_ms: u64,
    /// Longest a connection stays open, in milliseconds.
    pub connection_lifetime_ms: u64,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            max_header_bytes: MAX_HEADER_BYTES,
            max_headers: MAX_HEADERS,
            header_read_timeout_ms: HEADER_READ_TIMEOUT_MS,
            connection_lifetime_ms: CONNECTION_LIFETIME_MS,
        }
    }
}

impl HttpLimits {
    /// Checks the limits are usable (all positive; the header buffer at least 8192 bytes).
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.max_connections >= 1, "max_connections must be at least 1");
        anyhow::ensure!(
            self.max_header_bytes >= HYPER_MIN_BUF_BYTES,
            "max_header_bytes must be at least {HYPER_MIN_BUF_BYTES}"
        );
        anyhow::ensure!(self.max_headers >= 1, "max_headers must be at least 1");
        anyhow::ensure!(self.header_read_timeout_ms >= 1, "header_read_timeout_ms must be at least 1");
        anyhow::ensure!(self.connection_lifetime_ms >= 1, "connection_lifetime_ms must be at least 1");
        Ok(())
    }

    fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
}

/// Why a connection was closed by the server rather than by its peer. A fixed set, so the
/// metric's label values never come from a peer's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// [`HttpLimits::max_connections`] were already open.
    TooManyConnections,
    /// No complete request head in time, or the lifetime ran out mid-request.
    Timeout,
    /// Not parseable HTTP/1, or a head over the limits.
    BadRequest,
    /// The request carried a body.
    Body,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::Timeout => "timeout",
            Refusal::BadRequest => "bad_request",
            Refusal::Body => "body",
        }
    }
}

/// The routes served; `Other` is every other path (the label never copies the path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Metrics,
    Healthz,
    Readyz,
    Status,
    Other,
}

impl Route {
    fn of(path: &str, has_status: bool) -> Self {
        match path {
            "/metrics" => Route::Metrics,
            "/healthz" => Route::Healthz,
            "/readyz" => Route::Readyz,
            "/status" if has_status => Route::Status,
            _ => Route::Other,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Route::Metrics => "/metrics",
            Route::Healthz => "/healthz",
            Route::Readyz => "/readyz",
            Route::Status => "/status",
            Route::Other => "other",
        }
    }
}

static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    metric::counter_vec(
        "racekv_http_requests_total",
        "HTTP requests answered by the metrics endpoint",
        &["path", "code"],
        &[],
    )
});
static REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    metric::counter_vec(
        "racekv_http_connections_refused_total",
        "Connections to the metrics endpoint the server closed (over the limits, timed out, or malformed)",
        &["reason"],
        &[],
    )
});
static ACCEPTED: LazyLock<IntCounter> = LazyLock::new(|| {
    metric::counter("racekv_http_connections_accepted_total", "Connections accepted by the metrics endpoint")
});
static OPEN: LazyLock<IntGauge> =
    LazyLock::new(|| metric::gauge("racekv_http_connections", "Open connections to the metrics endpoint"));

/// Counts refusals and warns about them at most once per [`REFUSED_WARN_INTERVAL_MS`].
struct RefusalLog {
    limit: RateLimit,
}

impl RefusalLog {
    fn new() -> Self {
        Self { limit: RateLimit::new(REFUSED_WARN_INTERVAL_MS) }
    }

    fn refused(&self, reason: Refusal, peer: Option<SocketAddr>) {
        REFUSED.with_label_values(&[reason.label()]).inc();
        if let Some(held_back) = self.limit.admit() {
            let peer = peer.map_or_else(|| "-".to_string(), |p| p.to_string());
            tracing::warn!(
                refused = held_back + 1,
                latest_reason = reason.label(),
                latest_peer = %peer,
                "metrics endpoint refused connections (at most one line per {} s; see racekv_http_connections_refused_total)",
                REFUSED_WARN_INTERVAL_MS / 1000
            );
        }
    }
}

/// What every connection of one server shares.
struct Shared {
    routes: Routes,
    limits: HttpLimits,
    open: AtomicUsize,
    log: RefusalLog,
}

impl Shared {
    fn new(routes: Routes, limits: HttpLimits) -> Self {
        Self { routes, limits, open: AtomicUsize::new(0), log: RefusalLog::new() }
    }
}

/// One open connection, counted until dropped (when its task ends or is cancelled).
struct OpenConnection(Arc<Shared>);

impl OpenConnection {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.open.fetch_add(1, Ordering::Relaxed);
        OPEN.inc();
        Self(Arc::clone(shared))
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
        OPEN.dec();
    }
}

/// An HTTP server for `/metrics`, `/healthz`, `/readyz` (and `/status` when given), stopped
/// when dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    /// Dropping it tells the accept loop to stop.
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port) and serves on a background thread.
    pub fn start(addr: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with_status(addr, None)
    }

    /// Like [`MetricsServer::start`], also serving `status()` as JSON on `/status`.
    pub fn start_with_status(addr: SocketAddr, status: Option<StatusFn>) -> anyhow::Result<Self> {
        Self::start_with_options(addr, status, HttpLimits::default())
    }

    /// Like [`MetricsServer::start_with_status`], with explicit limits (tests use short ones).
    pub fn start_with_options(addr: SocketAddr, status: Option<StatusFn>, limits: HttpLimits) -> anyhow::Result<Self> {
        Self::start_with_routes(addr, Routes { status, ready: None }, limits)
    }

    /// Serves `routes` besides `/metrics` and `/healthz`, within `limits`.
    pub fn start_with_routes(addr: SocketAddr, routes: Routes, limits: HttpLimits) -> anyhow::Result<Self> {
        limits.validate().context("metrics endpoint limits")?;
        crate::process::register_process_metrics();
        // Register the server's own series now, so a scrape shows them before any refusal.
        LazyLock::force(&REQUESTS);
        LazyLock::force(&REFUSED);
        LazyLock::force(&ACCEPTED);
        LazyLock::force(&OPEN);
        let listener =
            std::net::TcpListener::bind(addr).with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let addr = listener.local_addr().context("reading the metrics endpoint's address")?;
        listener.set_nonblocking(true).context("making the metrics listener non-blocking")?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .context("building the metrics endpoint's runtime")?;
        let listener = {
            let _context = runtime.enter();
            tokio::net::TcpListener::from_std(listener).context("registering the metrics listener")?
        };
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let shared = Arc::new(Shared::new(routes, limits));
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                runtime.block_on(accept_loop(listener, shared, stopped));
                // Dropping the runtime drops every connection's task, idle or not.
                drop(runtime);
            })
            .context("spawning the metrics thread")?;
        Ok(Self { addr, stop: Some(stop), thread: Some(thread) })
    }

    /// The bound address (useful when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let mut next_accept_warn: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut stopped => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                ACCEPTED.inc();
                if shared.open.load(Ordering::Relaxed) >= shared.limits.max_connections {
                    // Closed unread: the peer sees a reset or an EOF, and no slot is held.
                    drop(stream);
                    shared.log.refused(Refusal::TooManyConnections, Some(peer));
                    continue;
                }
                let open = OpenConnection::new(&shared);
                tokio::spawn(async move {
                    serve_connection(stream, &open.0, Some(peer)).await;
                    drop(open);
                });
            }
            Err(e) => {
                // Out of descriptors, say: a line per interval, not one per pause.
                let now = Instant::now();
                if next_accept_warn.is_none_or(|at| now >= at) {
                    next_accept_warn = Some(now + Duration::from_millis(REFUSED_WARN_INTERVAL_MS));
                    tracing::warn!("metrics endpoint: accept failed (at most one line per interval): {e}");
                }
                tokio::time::sleep(Duration::from_millis(ACCEPT_ERROR_PAUSE_MS)).await;
            }
        }
    }
}

/// Serves one connection until the peer leaves, a limit closes it, or the runtime stops.
async fn serve_connection<I>(io: I, shared: &Shared, peer: Option<SocketAddr>)
where
    I: AsyncRead + AsyncWrite + Unpin,
{
    let limits = &shared.limits;
    let answered = AtomicU64::new(0);
    let service = hyper::service::service_fn(|request: Request<Incoming>| {
        answered.fetch_add(1, Ordering::Relaxed);
        let response = respond(shared, &request, peer);
        async move { Ok::<_, Infallible>(response) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout())
        .max_buf_size(limits.max_header_bytes)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers)
        // A peer that shuts down its sending side after a request (`printf ... | nc -N`)
        // still gets its answer; the connection then closes.
        .half_close(true)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let lifetime = tokio::time::sleep(Duration::from_millis(limits.connection_lifetime_ms));
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = lifetime => {
            // Let a request in progress finish; an idle connection closes at once.
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(limits.header_read_timeout(), connection.as_mut()).await {
                Ok(result) => result,
                Err(_) => {
                    shared.log.refused(Refusal::Timeout, peer);
                    return;
                }
            }
        }
    };
    let Err(e) = result else { return };
    if e.is_timeout() {
        // An idle keep-alive connection ending is normal; one that never sent a whole
        // request head in time is a refusal.
        if answered.load(Ordering::Relaxed) == 0 {
            shared.log.refused(Refusal::Timeout, peer);
        }
    } else if e.is_parse() || e.is_parse_too_large() || e.is_parse_version_h2() {
        shared.log.refused(Refusal::BadRequest, peer);
    } else {
        tracing::debug!("metrics client went away: {e}");
    }
}

fn respond(shared: &Shared, request: &Request<Incoming>, peer: Option<SocketAddr>) -> Response<Full<Bytes>> {
    let route = Route::of(request.uri().path(), shared.routes.status.is_some());
    let response = if request.headers().contains_key(TRANSFER_ENCODING) || !request.body().is_end_stream() {
        // Never read: the connection closes after this answer, so the body's bytes (or a
        // claimed length) cost nothing.
        shared.log.refused(Refusal::Body, peer);
        let mut response = text(StatusCode::PAYLOAD_TOO_LARGE, "request bodies are not accepted\n");
        response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
        response
    } else if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        response
    } else {
        match route {
            Route::Metrics => with_type(text(StatusCode::OK, render()), "text/plain; version=0.0.4; charset=utf-8"),
            Route::Healthz => text(StatusCode::OK, "ok\n"),
            Route::Readyz => readiness(shared.routes.ready.as_ref()),
            Route::Status => {
                let status = shared.routes.status.as_ref().expect("Route::Status only when a status function is set");
                with_type(text(StatusCode::OK, status()), "application/json")
            }
            Route::Other => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    };
    REQUESTS.with_label_values(&[route.label(), response.status().as_str()]).inc();
    response
}

fn readiness(ready: Option<&ReadyFn>) -> Response<Full<Bytes>> {
    match ready.map_or(Ok(()), |ready| ready()) {
        Ok(()) => text(StatusCode::OK, "ready\n"),
        Err(mut reason) => {
            if reason.len() > MAX_READY_REASON_BYTES {
                let mut end = MAX_READY_REASON_BYTES;
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                reason.truncate(end);
            }
            text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n"))
        }
    }
}

fn text(code: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = code;
    response
}

fn with_type(mut response: Response<Full<Bytes>>, content_type: &'static str) -> Response<Full<Bytes>> {
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// Most bytes [`serve_bytes_for_fuzzing`] collects of the server's answer.
#[doc(hidden)]
pub const FUZZ_MAX_OUTPUT_BYTES: usize = 64 << 20;

/// Runs one connection of the real server (default limits, `/status` and a not-ready `/readyz`) over an
/// in-memory pipe carrying `input` then EOF, and returns what the server wrote (at most
/// [`FUZZ_MAX_OUTPUT_BYTES`]). For the fuzz target only.
#[doc(hidden)]
pub fn serve_bytes_for_fuzzing(input: &[u8]) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const PIPE_BYTES: usize = 64 * 1024;
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime");
    let status: StatusFn = Arc::new(|| "{\"fuzz\":true}".to_string());
    let ready: ReadyFn = Arc::new(|| Err("fuzzing".to_string()));
    let shared = Shared::new(Routes { status: Some(status), ready: Some(ready) }, HttpLimits::default());
    runtime.block_on(async {
        let (client, server) = tokio::io::duplex(PIPE_BYTES);
        let (mut from_server, mut to_server) = tokio::io::split(client);
        let send = async move {
            // The server may close early (a refusal): the rest of the input is dropped.
            let _ = to_server.write_all(input).await;
            let _ = to_server.shutdown().await;
        };
        let receive = async move {
            let mut output = Vec::new();
            let _ = (&mut from_server).take(FUZZ_MAX_OUTPUT_BYTES as u64).read_to_end(&mut output).await;
            output
        };
        let ((), (), output) = tokio::join!(serve_connection(server, &shared, None), send, receive);
        output
    })
}
