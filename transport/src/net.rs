//! Sockets and small helpers below every backend, FLOCK's carriers and the region server:
//! dialling a region server (tcp, verbs control, Unix socket) and reading its first
//! replies, noticing a peer hang up, and random ids.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::auth;
use crate::error::TransportError;
use crate::fdpass::recv_with_fd;
use crate::mux::error_frame;
use crate::stream::{read_body, read_frame, FrameRead, POLL_INTERVAL};
use crate::tls::{TcpLink, TlsStream};
use crate::wire::{self, Kind, HEADER_BYTES};
use crate::ConnectOptions;

/// Waits for one frame of `kind` and returns its body (blocking, bounded by `timeout`).
/// Another kind is a protocol error, a hang-up a connect error; an Error frame is what
/// `refused` makes of its body. `during` names the exchange in errors ("hello").
pub(crate) fn await_frame<S: Read>(
    stream: &mut S,
    kind: Kind,
    timeout: Duration,
    peer: &str,
    during: &str,
    refused: impl Fn(&[u8]) -> TransportError,
) -> Result<Vec<u8>, TransportError> {
    let fail = |reason: String| TransportError::Connect { endpoint: peer.to_string(), reason };
    let started = Instant::now();
    let mut body = Vec::new();
    loop {
        match read_frame(stream, &mut body, timeout) {
            Ok(FrameRead::Frame(h)) if h.kind == kind => return Ok(body),
            Ok(FrameRead::Frame(h)) if h.kind == Kind::Error => return Err(refused(&body)),
            Ok(FrameRead::Frame(h)) => {
                return Err(TransportError::Protocol(format!("{peer} answered {during} with {:?}", h.kind)))
            }
            Ok(FrameRead::Idle) if started.elapsed() < timeout => continue,
            Ok(FrameRead::Idle) => return Err(TransportError::Timeout { waited_ms: timeout.as_millis() as u64 }),
            Ok(FrameRead::Closed) => return Err(fail(format!("closed during {during}"))),
            Err(e) => return Err(fail(e.to_string())),
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
    auth::connect(&mut link, &options.token, options.user.as_deref(), left, endpoint)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let body = await_frame(&mut link, Kind::HelloOk, left, endpoint, "hello", |body| error_frame(body, endpoint))?;
    let hello = wire::decode_hello_ok(&body).map_err(|e| TransportError::Protocol(e.to_string()))?;
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

/// Connects to the region server's Unix socket at `path`, reads and writes bounded by
/// `timeout`; `fail` turns an error into the caller's connect error.
pub(crate) fn dial_unix(
    path: &Path,
    timeout: Duration,
    fail: &dyn Fn(String) -> TransportError,
) -> Result<UnixStream, TransportError> {
    let stream = UnixStream::connect(path).map_err(|e| fail(e.to_string()))?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| fail(e.to_string()))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| fail(e.to_string()))?;
    Ok(stream)
}

/// Reads one frame whose first bytes may carry a descriptor: returns its header and the
/// descriptor if one came, its body in `body`. `during` names the exchange for the error
/// when the server hangs up.
pub(crate) fn read_frame_with_fd(
    stream: &mut UnixStream,
    body: &mut Vec<u8>,
    timeout: Duration,
    during: &str,
    fail: &dyn Fn(String) -> TransportError,
) -> Result<(wire::Header, Option<OwnedFd>), TransportError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    let mut passed = None;
    while got < HEADER_BYTES {
        let (n, fd) = recv_with_fd(stream, &mut header[got..]).map_err(|e| fail(e.to_string()))?;
        if n == 0 {
            return Err(fail(format!("closed {during}")));
        }
        got += n;
        passed = passed.or(fd);
    }
    let header = wire::decode_header(&header).map_err(|e| TransportError::Protocol(e.to_string()))?;
    read_body(stream, body, header.body_len as usize, timeout).map_err(|e| fail(e.to_string()))?;
    Ok((header, passed))
}

/// Waits for the FlockAccept that answers a FlockOpen (blocking, bounded by `timeout`).
pub(crate) fn await_accept<S: Read>(
    stream: &mut S,
    timeout: Duration,
    peer: &str,
) -> Result<wire::FlockAccept, TransportError> {
    let body = await_frame(stream, Kind::FlockAccept, timeout, peer, "FlockOpen", |body| error_frame(body, peer))?;
    wire::decode_flock_accept(&body).map_err(|e| TransportError::Protocol(format!("{peer}: {e}")))
}

/// Blocks until the peer hangs up (or we shut the socket down), then raises `lost`. Also
/// watches the verbs backend's control channel (a TCP stream).
pub(crate) fn watch_peer(stream: &impl AsFd, lost: &AtomicBool) {
    // nix has no name for POLLRDHUP (Linux: the peer shut down its writing half).
    let rdhup = PollFlags::from_bits_retain(libc::POLLRDHUP);
    loop {
        let mut fds = [PollFd::new(stream.as_fd(), rdhup)];
        match poll(&mut fds, PollTimeout::NONE) {
            // We only asked for hang-up events (POLLHUP and POLLERR always come too), so any
            // ready descriptor means the peer is gone. (nix cannot decode POLLRDHUP in revents.)
            Ok(n) if n > 0 => break,
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    lost.store(true, Ordering::Release);
}

/// True when the peer has hung up its end of `socket` (a non-blocking check).
pub(crate) fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let rdhup = PollFlags::from_bits_retain(libc::POLLRDHUP);
    let mut fds = [PollFd::new(socket, rdhup)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// A random id (server instances, FLOCK senders, lane keys).
pub(crate) use racekv_telemetry::random::random_u64;
