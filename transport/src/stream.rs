//! Reading and writing whole frames on blocking byte streams (TCP and Unix sockets).
//!
//! Public only for the `stream_frames` fuzz target; not an API.

use std::io::{self, Read};
use std::time::{Duration, Instant};

use crate::wire::{self, Header, HEADER_BYTES};

/// Read timeout set on every socket: the granularity at which a blocked reader looks up
/// (for shutdown, deadlines, or to let another thread read).
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(5);

/// Bytes read per `read` call while filling a body; the body buffer grows only as fast as the
/// peer actually sends, so a header that merely claims a huge body costs nothing.
pub const READ_CHUNK_BYTES: usize = 64 * 1024;

/// Bytes a connection takes from its socket per read: every frame already queued (several
/// threads' requests, several answers) comes in one system call, not two per frame.
pub const READ_BUFFER_BYTES: usize = 64 * 1024;

/// Whether `buffered` starts with a whole frame, so reading it will not block. A malformed
/// header counts as not whole: the read that follows reports it.
pub fn starts_with_whole_frame(buffered: &[u8]) -> bool {
    buffered.first_chunk::<HEADER_BYTES>().is_some_and(|header| {
        wire::decode_header(header).is_ok_and(|h| (buffered.len() - HEADER_BYTES) as u64 >= u64::from(h.body_len))
    })
}

/// What one attempt to read a frame produced.
pub enum FrameRead {
    /// A whole frame; its body is in the buffer passed to [`read_frame`].
    Frame(Header),
    /// Nothing arrived within one poll interval (no byte of a new frame was consumed).
    Idle,
    /// The peer closed the stream cleanly between frames.
    Closed,
}

/// Whether a read failed only because nothing arrived within the socket's read timeout.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Fills `buf` completely; a stall longer than `stall_limit` in the middle is an error.
pub(crate) fn read_full<R: Read>(r: &mut R, buf: &mut [u8], stall_limit: Duration) -> io::Result<()> {
    let mut filled = 0;
    let mut last_progress = Instant::now();
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed mid-frame")),
            Ok(n) => {
                filled += n;
                last_progress = Instant::now();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                if last_progress.elapsed() > stall_limit {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "peer stalled mid-frame"));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame into `body`. Returns [`FrameRead::Idle`] when nothing arrives within the
/// socket's read timeout; once a frame has started, waits up to `stall_limit` for the rest.
/// A malformed header is an `InvalidData` error.
pub fn read_frame<R: Read>(r: &mut R, body: &mut Vec<u8>, stall_limit: Duration) -> io::Result<FrameRead> {
    let mut header = [0u8; HEADER_BYTES];
    let first = loop {
        match r.read(&mut header) {
            Ok(0) => return Ok(FrameRead::Closed),
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Ok(FrameRead::Idle),
            Err(e) => return Err(e),
        }
    };
    read_full(r, &mut header[first..], stall_limit)?;
    let header = wire::decode_header(&header).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    read_body(r, body, header.body_len as usize, stall_limit)?;
    Ok(FrameRead::Frame(header))
}

/// Reads exactly `len` body bytes, growing `body` chunk by chunk.
pub(crate) fn read_body<R: Read>(r: &mut R, body: &mut Vec<u8>, len: usize, stall_limit: Duration) -> io::Result<()> {
    body.clear();
    while body.len() < len {
        let start = body.len();
        let step = (len - start).min(READ_CHUNK_BYTES);
        body.resize(start + step, 0);
        read_full(r, &mut body[start..], stall_limit)?;
    }
    Ok(())
}
