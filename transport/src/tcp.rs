//! The tcp backend: batches travel as frames to the software NIC in the region server, over
//! TLS when [`ConnectOptions::tls`] is set.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramOpts, IntCounter};

use crate::batch::Batch;
use crate::error::TransportError;
use crate::flock::stream::open_tcp_lane;
use crate::flock::{Channel, FlockOptions};
use crate::mux::{error_frame, Mux};
use crate::stream::{read_frame, FrameRead, POLL_INTERVAL};
use crate::tls::{TcpLink, TlsStream};
use crate::wire::{self, Kind};
use crate::{ConnectOptions, Connection, TransportKind};

struct Metrics {
    batches: IntCounter,
    batch_seconds: Histogram,
    rpcs: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::{register, LATENCY_BUCKETS_SECONDS};
    Metrics {
        batches: register(IntCounter::new("racekv_transport_tcp_batches_total", "Batches sent over tcp").unwrap()),
        batch_seconds: register(
            Histogram::with_opts(
                HistogramOpts::new("racekv_transport_tcp_batch_seconds", "Round trip of one tcp batch")
                    .buckets(LATENCY_BUCKETS_SECONDS.to_vec()),
            )
            .unwrap(),
        ),
        rpcs: register(IntCounter::new("racekv_transport_tcp_rpcs_total", "RPCs sent over tcp").unwrap()),
    }
});

/// Reads the HelloOk that ends the handshake (blocking, bounded by `timeout`).
fn await_hello_ok<S: Read>(stream: &mut S, timeout: Duration, peer: &str) -> Result<wire::HelloOk, TransportError> {
    let started = Instant::now();
    let mut body = Vec::new();
    loop {
        match read_frame(stream, &mut body, timeout) {
            Ok(FrameRead::Frame(h)) if h.kind == Kind::HelloOk => {
                return wire::decode_hello_ok(&body).map_err(|e| TransportError::Protocol(e.to_string()));
            }
            Ok(FrameRead::Frame(h)) if h.kind == Kind::Error => return Err(error_frame(&body, peer)),
            Ok(FrameRead::Frame(h)) => {
                return Err(TransportError::Protocol(format!("{peer} answered hello with {:?}", h.kind)))
            }
            Ok(FrameRead::Idle) if started.elapsed() < timeout => continue,
            Ok(FrameRead::Idle) => return Err(TransportError::Timeout { waited_ms: timeout.as_millis() as u64 }),
            Ok(FrameRead::Closed) => {
                return Err(TransportError::Connect { endpoint: peer.into(), reason: "closed during hello".into() })
            }
            Err(e) => return Err(TransportError::Connect { endpoint: peer.into(), reason: e.to_string() }),
        }
    }
}

/// Connects to the first address `addr` resolves to that accepts, as `TcpStream::connect`
/// does (a name like `localhost` may resolve to `::1` before `127.0.0.1`), each try
/// bounded by what is left of the deadline.
fn connect_any(addr: &str, deadline: Instant) -> Result<TcpStream, String> {
    let mut last = String::from("the name resolves to no address");
    for target in addr.to_socket_addrs().map_err(|e| e.to_string())? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("timed out ({last})"));
        }
        match TcpStream::connect_timeout(&target, left) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = format!("{target}: {e}"),
        }
    }
    Err(last)
}

/// Connects to the region server at `addr` and authenticates: connected within the
/// timeout, no Nagle delay, reads that wake every [`POLL_INTERVAL`], writes bounded by the
/// timeout, TLS if [`ConnectOptions::tls`] is set, the token handshake done and HelloOk
/// read. `endpoint` names the server in errors (`tcp:host:port`, `verbs:host:port`).
pub(crate) fn dial(
    addr: &str,
    endpoint: &str,
    options: &ConnectOptions,
) -> Result<(TcpLink, wire::HelloOk), TransportError> {
    let fail = |reason: String| TransportError::Connect { endpoint: endpoint.into(), reason };
    let deadline = Instant::now() + options.timeout;
    let stream = connect_any(addr, deadline).map_err(fail)?;
    stream.set_nodelay(true).map_err(|e| fail(e.to_string()))?;
    stream.set_read_timeout(Some(POLL_INTERVAL)).map_err(|e| fail(e.to_string()))?;
    stream.set_write_timeout(Some(options.timeout)).map_err(|e| fail(e.to_string()))?;
    let mut link = match &options.tls {
        Some(tls) => TcpLink::Tls(TlsStream::client(stream, tls, addr, deadline).map_err(|e| fail(e.to_string()))?),
        None => TcpLink::Plain(stream),
    };
    let left = deadline.saturating_duration_since(Instant::now());
    crate::auth::connect(&mut link, &options.token, options.user.as_deref(), left, endpoint)?;
    let hello = await_hello_ok(&mut link, deadline.saturating_duration_since(Instant::now()), endpoint)?;
    Ok((link, hello))
}

/// [`dial`] for a verbs control channel, which has no TLS: its one-sided traffic travels on
/// queue pairs, unencrypted, whatever the channel does.
#[cfg(feature = "rdma")]
pub(crate) fn dial_plain(
    addr: &str,
    endpoint: &str,
    options: &ConnectOptions,
) -> Result<(TcpStream, wire::HelloOk), TransportError> {
    if options.tls.is_some() {
        return Err(TransportError::Connect {
            endpoint: endpoint.into(),
            reason: "verbs endpoints have no TLS (their one-sided traffic is not encrypted): connect without TLS options, or over tcp".into(),
        });
    }
    match dial(addr, endpoint, options)? {
        (TcpLink::Plain(stream), hello) => Ok((stream, hello)),
        (TcpLink::Tls(_), _) => unreachable!("no TLS was asked for"),
    }
}

/// A tcp connection; many threads may share it (batches are multiplexed by id on one
/// stream; RPCs travel on FLOCK lanes of their own, opened on the first call).
pub struct TcpConnection {
    mux: Mux<TcpLink>,
    rpc: Channel,
    hello: wire::HelloOk,
}

impl TcpConnection {
    /// Connects to `addr` (`host:port`) and authenticates.
    pub fn connect(addr: &str, options: &ConnectOptions) -> Result<Self, TransportError> {
        Self::connect_with(addr, options, &FlockOptions::default())
    }

    /// [`Self::connect`] with explicit settings for the RPC channel.
    pub fn connect_with(addr: &str, options: &ConnectOptions, rpc: &FlockOptions) -> Result<Self, TransportError> {
        let endpoint = format!("tcp:{addr}");
        let fail = |reason: String| TransportError::Connect { endpoint: endpoint.clone(), reason };
        let (stream, hello) = dial(addr, &endpoint, options)?;
        let read_half = stream.try_clone().map_err(|e| fail(e.to_string()))?;
        let (lane_addr, lane_options) = (addr.to_string(), options.clone());
        let open = move |sender, lanes: usize| {
            (0..lanes).map(|lane| open_tcp_lane(&lane_addr, &lane_options, sender, lane as u16)).collect()
        };
        let peer = format!("tcp:{addr}");
        Ok(Self {
            mux: Mux::new(stream, read_half, options.timeout, peer.clone()),
            rpc: Channel::new(rpc.clone(), options.timeout, peer, Box::new(open)),
            hello,
        })
    }

    /// FLOCK lanes of this connection that hold credits (0 before the first call).
    pub fn active_rpc_lanes(&self) -> usize {
        self.rpc.active_lanes()
    }

    /// Sends `batch` without the local checks, so tests can prove the server's own checks.
    #[doc(hidden)]
    pub fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        let started = Instant::now();
        let (kind, body) = self.mux.request(|out, id| wire::encode_batch(out, id, batch))?;
        if kind != Kind::BatchResult {
            return Err(TransportError::Protocol(format!("batch answered with a {kind:?} frame")));
        }
        if let Err(e) = wire::decode_batch_result(&body, batch, self.hello.region_len) {
            self.mux.break_with(format!("bad batch result: {e}"));
            return Err(TransportError::Protocol(e.to_string()));
        }
        METRICS.batches.inc();
        METRICS.batch_seconds.observe(started.elapsed().as_secs_f64());
        batch.first_failure()
    }
}

impl Connection for TcpConnection {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        batch.validate(self.hello.region_len, self.hello.instance)?;
        self.execute_unchecked(batch)
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        if self.mux.is_broken() {
            return Err(TransportError::ConnectionLost {
                reason: "the connection to the region server broke".into(),
                maybe_executed: false,
            });
        }
        METRICS.rpcs.inc();
        self.rpc.call(method, request)
    }

    fn region_len(&self) -> u64 {
        self.hello.region_len
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn instance(&self) -> u64 {
        self.hello.instance
    }

    fn is_healthy(&self) -> bool {
        !self.mux.is_broken()
    }

    fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        TcpConnection::execute_unchecked(self, batch)
    }
}
