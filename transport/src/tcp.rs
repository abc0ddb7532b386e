//! The tcp backend: batches travel as frames to the software NIC in the region server, over
//! TLS when [`ConnectOptions::tls`] is set.

use std::sync::LazyLock;
use std::time::Instant;

use prometheus::{Histogram, IntCounter};

use crate::batch::Batch;
use crate::error::TransportError;
use crate::flock::stream::open_tcp_lane;
use crate::flock::{Channel, FlockOptions};
use crate::mux::{Mux, Ticket};
use crate::net::dial;
use crate::tls::TcpLink;
use crate::wire::{self, Kind};
use crate::{ConnectOptions, Connection, Started, StartedState, TransportKind};

struct Metrics {
    batches: IntCounter,
    batch_seconds: Histogram,
    rpcs: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        batches: metric::counter("racekv_transport_tcp_batches_total", "Batches sent over tcp"),
        batch_seconds: metric::latency_histogram("racekv_transport_tcp_batch_seconds", "Round trip of one tcp batch"),
        rpcs: metric::counter("racekv_transport_tcp_rpcs_total", "RPCs sent over tcp"),
    }
});

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
        let sent = self.send_batch(batch);
        self.finish(sent, batch)
    }

    /// Sends `batch`; its round trip is timed from here.
    fn send_batch(&self, batch: &Batch) -> Started {
        let at = Instant::now();
        Started(match self.mux.send(|out, id| wire::encode_batch(out, id, batch)) {
            Ok(ticket) => StartedState::Sent(ticket, at),
            Err(e) => StartedState::Done(Err(e)),
        })
    }

    /// Waits for the answer to the batch `ticket` sent and records it in `batch`.
    fn complete(&self, ticket: Ticket, batch: &mut Batch, started: Instant) -> Result<(), TransportError> {
        let (kind, body) = self.mux.wait(ticket)?;
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
        let started = self.start(batch);
        self.finish(started, batch)
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

    fn check_healthy(&self) -> bool {
        self.mux.poll_hang_up();
        !self.mux.is_broken()
    }

    fn abort(&self, reason: &str) {
        self.mux.break_with(reason.to_string());
        self.rpc.abort(reason);
    }

    fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        TcpConnection::execute_unchecked(self, batch)
    }

    fn start(&self, batch: &mut Batch) -> Started {
        match batch.validate(self.hello.region_len, self.hello.instance) {
            Ok(()) => self.send_batch(batch),
            Err(e) => Started::done(Err(e)),
        }
    }

    fn finish(&self, started: Started, batch: &mut Batch) -> Result<(), TransportError> {
        match started.0 {
            StartedState::Done(result) => result,
            StartedState::Sent(ticket, at) => self.complete(ticket, batch, at),
            StartedState::Forwarded(..) => unreachable!("a wrapper's batch finished on the connection it wraps"),
        }
    }
}
