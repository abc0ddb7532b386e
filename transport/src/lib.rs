//! One-sided operations on a remote memory region, and RPC to its owner.
//!
//! A [`Connection`] executes a [`Batch`] of READ, WRITE, CAS (8 B) and FAA (8 B) ops against
//! the region as one unit (one frame, or one doorbell on a NIC) with one completion per op,
//! and carries request/response RPCs to the service that owns the region. Backends:
//!
//! * [`shm`]: same host; the region is a shared mapping and ops are CPU loads, stores and
//!   atomics. The owner is not involved in data operations.
//! * [`tcp`]: any host; a software NIC in the owner ([`server::RegionServer`]) executes each
//!   batch against the region. It knows nothing of what the region holds.
//! * `verbs` (feature `rdma`): RDMA RC queue pairs through rdma-sys; the region server
//!   registers the region with the NIC once and the NIC executes each batch. Without an RDMA
//!   device it fails with an error naming the alternatives (shm, tcp, Soft-RoCE).
//!
//! RPC ([`Connection::call`]) goes through [`flock`] on every backend: threads share a
//! connection's RPC lanes, a leader coalesces concurrent requests into one message, and the
//! region server's credit scheduler keeps the load it accepts within what it can serve.
//!
//! Every connection starts with a challenge-response on the shared token ([`auth`]); tcp
//! connections may run inside TLS ([`tls`]).
//!
//! Every backend passes the same [`conformance`] suite (feature `conformance`).

// `unsafe` only in the modules that opt in below by name (FFI, words of shared mappings,
// the FLOCK queue's raw pointers), each block with the argument for its soundness.
#![deny(unsafe_code)]

pub mod auth;
pub mod batch;
pub mod decode;
pub mod error;
#[allow(unsafe_code)] // SCM_RIGHTS: owning the descriptors the kernel installed
pub mod fdpass;
pub mod flock;
pub mod lend;
pub mod listen;
pub mod local;
mod mux;
mod net;
pub mod overlap;
#[allow(unsafe_code)] // atomic words inside the mapping
pub mod region;
mod rpc_server;
pub mod server;
mod server_stream;
pub mod shm;
pub mod stop;
// Public (hidden) only for the `stream_frames` fuzz target.
#[doc(hidden)]
pub mod stream;
pub mod tcp;
pub mod tls;
#[cfg(feature = "rdma")]
pub mod verbs;
pub mod wire;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "test-pki")]
#[doc(hidden)]
pub mod test_pki;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use auth::{Caller, Credentials, Keys};
pub use batch::{Batch, OpId, OpKind, Outcome, ReadId, MAX_BATCH_BYTES, MAX_BATCH_OPS, MAX_OP_BYTES};
pub use error::{OpError, RpcStatus, TransportError};
pub use flock::{NoRpc, RpcService};
pub use region::Region;
pub use server::{RegionServer, ServerOptions};
pub use tls::{ClientAuth, ClientTls, ServerTls, ServerTlsFiles};

/// Which backend a connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Same host, over a shared mapping.
    Shm,
    /// Any host, over TCP (optionally TLS).
    Tcp,
    /// RDMA RC queue pairs (feature `rdma`).
    Verbs,
}

impl TransportKind {
    /// Its name, as in endpoints (`shm`, `tcp`, `verbs`).
    pub fn as_str(&self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Verbs => "verbs",
        }
    }

    /// Whether the READs of one batch observe memory in batch order (each sees everything
    /// an earlier one saw). True where one thread executes the batch op by op (shm, the tcp
    /// software NIC); not on verbs, where a NIC may service the READs of a batch in any
    /// order (PCIe lets read requests pass each other).
    pub fn batch_reads_in_order(&self) -> bool {
        !matches!(self, TransportKind::Verbs)
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            "verbs" => Ok(TransportKind::Verbs),
            other => Err(format!("unknown transport {other:?}; use shm, tcp or verbs")),
        }
    }
}

/// Where a region server listens: `shm:/path/to.sock`, `tcp:host:port` or `verbs:host:port`
/// (the verbs control channel).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// The region server's Unix socket.
    Shm(PathBuf),
    /// The region server's `host:port`.
    Tcp(String),
    /// The `host:port` of the region server's verbs control channel.
    Verbs(String),
}

impl Endpoint {
    /// The backend this endpoint is served by.
    pub fn kind(&self) -> TransportKind {
        match self {
            Endpoint::Shm(_) => TransportKind::Shm,
            Endpoint::Tcp(_) => TransportKind::Tcp,
            Endpoint::Verbs(_) => TransportKind::Verbs,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Shm(path) => write!(f, "shm:{}", path.display()),
            Endpoint::Tcp(addr) => write!(f, "tcp:{addr}"),
            Endpoint::Verbs(addr) => write!(f, "verbs:{addr}"),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (scheme, rest) = s
            .split_once(':')
            .ok_or_else(|| format!("endpoint {s:?} needs a scheme: shm:/path, tcp:host:port or verbs:host:port"))?;
        if rest.is_empty() {
            return Err(format!("endpoint {s:?} has nothing after {scheme}:"));
        }
        match scheme {
            "shm" => Ok(Endpoint::Shm(PathBuf::from(rest))),
            "tcp" | "verbs" => {
                let (_, port) = rest.rsplit_once(':').ok_or_else(|| format!("endpoint {s:?} needs host:port"))?;
                port.parse::<u16>().map_err(|_| format!("endpoint {s:?} has a bad port {port:?}"))?;
                Ok(if scheme == "tcp" { Endpoint::Tcp(rest.to_string()) } else { Endpoint::Verbs(rest.to_string()) })
            }
            other => Err(format!("unknown endpoint scheme {other:?} in {s:?}; use shm, tcp or verbs")),
        }
    }
}

/// Credentials and timeouts for connecting. Build it with [`ConnectOptions::new`] or
/// `..Default::default()`, so new settings need no change at every call site.
#[derive(Clone)]
pub struct ConnectOptions {
    /// The shared secret of the region server, or, with `user`, that user's password
    /// (proved, never sent: [`auth`]).
    pub token: String,
    /// Who to authenticate as on a server that knows users (a computenode's remote front
    /// end); `None`: the shared token (memnodes).
    pub user: Option<String>,
    /// Longest wait for connecting and for any one request.
    pub timeout: Duration,
    /// TLS for tcp endpoints (a server whose tcp listener has a certificate speaks only
    /// TLS). Not used by shm (same host) and refused by verbs endpoints.
    pub tls: Option<ClientTls>,
}

impl ConnectOptions {
    /// `token` and `timeout`, no TLS.
    pub fn new(token: impl Into<String>, timeout: Duration) -> Self {
        Self { token: token.into(), user: None, timeout, tls: None }
    }

    /// Authenticates as `user` with `password` instead of a token.
    pub fn with_user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self.token = password.into();
        self
    }

    /// The same, over TLS on tcp endpoints.
    pub fn with_tls(mut self, tls: ClientTls) -> Self {
        self.tls = Some(tls);
        self
    }
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("token", &"***")
            .field("user", &self.user)
            .field("timeout", &self.timeout)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self::new(String::new(), Duration::from_secs(5))
    }
}

/// A connection to a region and its owner.
pub trait Connection: Send + Sync {
    /// Executes every op of `batch`, in order, as one unit. Per-op outcomes are recorded in
    /// the batch; the first failed op is also returned as [`TransportError::Op`].
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError>;
    /// One request/response RPC to the region's owner.
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError>;
    /// Size of the region in bytes.
    fn region_len(&self) -> u64;
    /// The backend this connection runs on.
    fn kind(&self) -> TransportKind;
    /// The server's instance id from hello (changes when the server restarts).
    fn instance(&self) -> u64;
    /// False once the connection is known to be unusable.
    fn is_healthy(&self) -> bool;
    /// Like [`Connection::is_healthy`], after looking for a peer that hung up while the
    /// connection sat idle (backends that learn of it without traffic just answer
    /// `is_healthy`). Sends nothing; may wait a few milliseconds. For readiness probes.
    fn check_healthy(&self) -> bool {
        self.is_healthy()
    }
    /// Fails every batch waiting on this connection now, and every later one, with
    /// [`TransportError::ConnectionLost`] (they may have executed): the peer was declared
    /// down (failed over), so waiting out the timeout would only delay the caller. RPCs
    /// waiting on its FLOCK lanes fail too (the next opens new lanes). Backends whose
    /// batches do not wait on the peer's CPU (shm, local) fail only the RPCs.
    fn abort(&self, _reason: &str) {}
    /// Sends `batch` without the local checks, so the remote side's own checks (and, on a
    /// NIC, a queue pair going to the error state) can be provoked: fault injection for
    /// tests. Backends that check nothing locally beyond `execute` just run `execute`.
    #[doc(hidden)]
    fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        self.execute(batch)
    }
    /// The first half of [`Connection::execute`]: sends `batch` and returns without waiting
    /// for it where the backend can ([`Connection::finish`] waits), so batches on several
    /// connections travel together ([`execute_all`]). Backends whose batches do not wait on
    /// a peer (shm, local) execute it here.
    ///
    /// A connection that wraps another (a pool's, a fence's) forwards both halves to it
    /// ([`Started::forwarded`]).
    fn start(&self, batch: &mut Batch) -> Started {
        Started::done(self.execute(batch))
    }
    /// The second half of [`Connection::execute`]: waits for the batch `started` sent (on
    /// this connection) and records its outcomes in `batch`.
    fn finish(&self, started: Started, batch: &mut Batch) -> Result<(), TransportError> {
        let _ = batch;
        match started.0 {
            StartedState::Done(result) => result,
            StartedState::Sent(..) | StartedState::Forwarded(..) => {
                unreachable!("a batch sent by another backend's start")
            }
        }
    }
}

/// A batch [`Connection::start`] sent and [`Connection::finish`] has yet to complete.
#[must_use = "a started batch must be finished on its connection"]
pub struct Started(StartedState);

impl Started {
    /// A batch executed (or refused) already: [`Connection::finish`] returns `result`.
    pub fn done(result: Result<(), TransportError>) -> Self {
        Self(StartedState::Done(result))
    }

    /// A wrapping connection's start: `inner` was started on `conn`, the connection it
    /// wraps; `note` is whatever the wrapper's finish needs back (a pool slot, say).
    /// The wrapper's finish post-processes either way, also when `inner` is done already.
    pub fn forwarded(conn: Arc<dyn Connection>, inner: Started, note: u64) -> Self {
        Self(StartedState::Forwarded(conn, Box::new(inner), note))
    }

    /// What [`Started::forwarded`] was given, for the wrapper's finish: `Err` with the
    /// outcome when the wrapper's own start finished the batch ([`Started::done`]).
    pub fn into_forwarded(self) -> Result<Forwarded, Result<(), TransportError>> {
        match self.0 {
            StartedState::Forwarded(conn, inner, note) => Ok(Forwarded { conn, inner: *inner, note }),
            StartedState::Done(result) => Err(result),
            StartedState::Sent(..) => unreachable!("a batch a backend sent, finished by a wrapper"),
        }
    }

    /// Whether the batch has executed already (nothing to wait for in
    /// [`Connection::finish`]).
    pub fn is_done(&self) -> bool {
        match &self.0 {
            StartedState::Done(_) => true,
            StartedState::Sent(..) => false,
            StartedState::Forwarded(_, inner, _) => inner.is_done(),
        }
    }
}

/// A wrapping connection's batch, started on the connection it wraps
/// ([`Started::forwarded`]).
pub struct Forwarded {
    /// The wrapped connection the batch went to: finish it there.
    pub conn: Arc<dyn Connection>,
    /// Its start there.
    pub inner: Started,
    /// What the wrapper noted for its finish.
    pub note: u64,
}

enum StartedState {
    /// Executed (or refused) already.
    Done(Result<(), TransportError>),
    /// On its way: the ticket of its response, and when it was sent (for the latency metric).
    Sent(mux::Ticket, std::time::Instant),
    /// Started on the connection a wrapper wraps, with the wrapper's note.
    Forwarded(Arc<dyn Connection>, Box<Started>, u64),
}

/// Executes each batch on its connection, all of them sent before any is waited for, so a
/// write to R replicas costs one round trip, not R. Returns each batch's outcome, in order
/// ([`Connection::execute`]'s); one connection's failure leaves the others' batches alone.
pub fn execute_all(work: &mut [(&dyn Connection, &mut Batch)]) -> Vec<Result<(), TransportError>> {
    let mut running: Vec<_> = work.iter_mut().map(|(conn, batch)| Box::pin(overlap::execute(*conn, batch))).collect();
    overlap::run_all(&mut running)
}

/// Connects to `endpoint` with the backend its scheme names (RPC with the default
/// [`flock::FlockOptions`]).
pub fn connect(endpoint: &Endpoint, options: &ConnectOptions) -> Result<Arc<dyn Connection>, TransportError> {
    connect_with(endpoint, options, &flock::FlockOptions::default())
}

/// [`connect`] with explicit settings for the connection's RPC channel.
pub fn connect_with(
    endpoint: &Endpoint,
    options: &ConnectOptions,
    rpc: &flock::FlockOptions,
) -> Result<Arc<dyn Connection>, TransportError> {
    match endpoint {
        Endpoint::Shm(path) => Ok(Arc::new(shm::ShmConnection::connect_with(path, options, rpc)?)),
        Endpoint::Tcp(addr) => Ok(Arc::new(tcp::TcpConnection::connect_with(addr, options, rpc)?)),
        Endpoint::Verbs(addr) => verbs_connect(addr, options, rpc),
    }
}

#[cfg(not(feature = "rdma"))]
fn verbs_connect(
    addr: &str,
    _options: &ConnectOptions,
    _rpc: &flock::FlockOptions,
) -> Result<Arc<dyn Connection>, TransportError> {
    Err(TransportError::Connect {
        endpoint: format!("verbs:{addr}"),
        reason: "this build has no RDMA support (rebuild with `--features rdma`); use an shm: or tcp: endpoint instead"
            .into(),
    })
}

#[cfg(feature = "rdma")]
fn verbs_connect(
    addr: &str,
    options: &ConnectOptions,
    rpc: &flock::FlockOptions,
) -> Result<Arc<dyn Connection>, TransportError> {
    Ok(Arc::new(verbs::VerbsConnection::connect_with(addr, options, rpc)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_print() {
        for text in ["shm:/tmp/a.sock", "tcp:127.0.0.1:7000", "verbs:[::1]:9"] {
            let e: Endpoint = text.parse().unwrap();
            assert_eq!(e.to_string(), text);
        }
        assert!("tcp:localhost".parse::<Endpoint>().is_err());
        assert!("ftp:x:1".parse::<Endpoint>().is_err());
        assert!("shm:".parse::<Endpoint>().is_err());
    }
}
