//! The tcp carrier: FLOCK messages back to back on a dedicated TCP stream.
//!
//! A lane is its own TCP connection to the region server (TLS where configured, the token
//! handshake, then FlockOpen/FlockAccept; see [`crate::wire`]). After the handshake the stream carries nothing but FLOCK messages,
//! each sent with one `write` (TCP_NODELAY is on, so a coalesced message leaves as one
//! segment train instead of one per request). The receiver reads the 32-byte header, checks
//! it (canary, kind, length bound), then reads exactly the rest. Ordering and flow control
//! are TCP's, so the "ring head" acknowledged in responses is 0 here; credits still bound
//! what a sender may have outstanding at the receiver.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::message::{self, HEADER_BYTES};
use super::receiver::{Received, ServerCarrier};
use super::ClientCarrier;
use crate::stream::{is_timeout, read_full};
use crate::tls::TcpLink;

/// Reads one message: `Ok(None)` when nothing arrived within the stream's read timeout,
/// `Ok(Some(false))` when the peer closed between messages.
pub(crate) fn read_message<R: Read>(
    r: &mut R,
    buf: &mut Vec<u8>,
    expect: u32,
    max: usize,
    stall: Duration,
) -> io::Result<Option<bool>> {
    let mut header = [0u8; HEADER_BYTES];
    let first = loop {
        match r.read(&mut header) {
            Ok(0) => return Ok(Some(false)),
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
    };
    read_full(r, &mut header[first..], stall)?;
    let h = message::decode_header(&header, Some(expect), max)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    buf.clear();
    buf.extend_from_slice(&header);
    buf.resize(h.len as usize, 0);
    read_full(r, &mut buf[HEADER_BYTES..], stall)?;
    Ok(Some(true))
}

/// A sender's lane over TCP.
pub(crate) struct TcpLane {
    write: TcpLink,
    read: TcpLink,
    stall: Duration,
}

impl TcpLane {
    /// `stream` has finished the handshake and has a short read timeout (the poll interval).
    pub fn new(stream: TcpLink, stall: Duration) -> io::Result<Self> {
        Ok(Self { read: stream.try_clone()?, write: stream, stall })
    }
}

impl ClientCarrier for TcpLane {
    fn send(&self, message: &[u8]) -> io::Result<()> {
        (&self.write).write_all(message)
    }

    fn recv(&self, buf: &mut Vec<u8>, expect: u32) -> io::Result<bool> {
        match read_message(&mut &self.read, buf, expect, message::MAX_MESSAGE_BYTES, self.stall)? {
            None => Ok(false),
            Some(true) => Ok(true),
            Some(false) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the receiver closed the lane")),
        }
    }

    fn max_message(&self) -> usize {
        message::MAX_MESSAGE_BYTES
    }

    fn shutdown(&self) {
        self.write.shutdown();
    }
}

/// The receiver's end on any byte stream (the region server's connection socket).
pub(crate) struct StreamCarrier<'a, S: Read + Write> {
    pub stream: &'a mut S,
    pub stall: Duration,
}

impl<S: Read + Write> ServerCarrier for StreamCarrier<'_, S> {
    fn recv(&mut self, buf: &mut Vec<u8>, expect: u32) -> io::Result<Received> {
        Ok(match read_message(self.stream, buf, expect, message::MAX_MESSAGE_BYTES, self.stall)? {
            None => Received::Idle,
            Some(true) => Received::Message,
            Some(false) => Received::Closed,
        })
    }

    fn send(&mut self, message: &[u8]) -> io::Result<()> {
        self.stream.write_all(message)
    }
}

/// Opens lane `lane` of sender `sender` as its own TCP connection to `addr`.
pub(crate) fn open_tcp_lane(
    addr: &str,
    options: &crate::ConnectOptions,
    sender: u64,
    lane: u16,
) -> Result<super::sender::LaneSetup, crate::TransportError> {
    use crate::wire;
    use crate::TransportError;
    let peer = format!("tcp:{addr}");
    let fail = |reason: String| TransportError::Connect { endpoint: peer.clone(), reason };
    let (mut stream, _) = crate::net::dial(addr, &peer, options)?;
    let mut out = Vec::new();
    wire::encode_flock_open(&mut out, &wire::FlockOpen { sender, lane, verbs: None });
    stream.write_all(&out).map_err(|e| fail(e.to_string()))?;
    let accept = crate::net::await_accept(&mut stream, options.timeout, &peer)?;
    let carrier = TcpLane::new(stream, options.timeout).map_err(|e| fail(e.to_string()))?;
    Ok(super::sender::LaneSetup {
        carrier: Box::new(carrier),
        key: accept.key,
        credits: accept.credits,
        batch: accept.batch,
    })
}
