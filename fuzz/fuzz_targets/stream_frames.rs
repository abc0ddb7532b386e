//! Fuzzes the frame reader of tcp connections (`racekv_transport::stream`): the bytes a
//! peer sends, arriving in arbitrary pieces with read timeouts in between, read through the
//! same buffered reader the region server and the client multiplexer use.
//!
//! Input: one plan byte saying how to build and deliver the stream, then the stream. The
//! stream is either the raw bytes, or frames built from them (a kind, a length, a body:
//! well-formed headers, so the reader gets far), optionally with one byte flipped. Checked
//! against a reference walk of the same bytes:
//! - every whole frame comes out with its header and its body, in order; then the stream
//!   ends cleanly at a frame boundary, or with the error that fits what follows (a malformed
//!   header, or a stream cut mid-frame);
//! - a timeout before a frame's first byte is `Idle` and consumes nothing;
//! - when `starts_with_whole_frame` says the buffer holds a whole frame, reading it makes no
//!   read on the socket (the server and the multiplexer rely on it not to block);
//! - the body buffer grows only as fast as bytes arrive (never by a header's claimed length).
#![no_main]

use std::io::{self, BufReader, ErrorKind, Read};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use racekv_transport::stream::{read_frame, starts_with_whole_frame, FrameRead, READ_BUFFER_BYTES, READ_CHUNK_BYTES};
use racekv_transport::wire::{self, Kind, HEADER_BYTES};

/// A socket that hands out `stream` in pieces whose sizes `pieces` gives (0: a read timeout;
/// never two in a row, so a reader waiting out a stall always gets further).
struct Socket<'a> {
    stream: &'a [u8],
    at: usize,
    pieces: &'a [u8],
    next_piece: usize,
    timed_out_last: bool,
    reads: usize,
}

impl Read for Socket<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reads += 1;
        let piece = match self.pieces.is_empty() {
            true => usize::MAX,
            false => usize::from(self.pieces[self.next_piece % self.pieces.len()]),
        };
        self.next_piece += 1;
        if piece == 0 && !self.timed_out_last {
            self.timed_out_last = true;
            return Err(io::Error::new(ErrorKind::WouldBlock, "read timeout"));
        }
        self.timed_out_last = false;
        let n = piece.max(1).min(buf.len()).min(self.stream.len() - self.at);
        buf[..n].copy_from_slice(&self.stream[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// What the reader must produce next at `at` of `stream`: the frame there (header and body
/// range), or how reading ends.
enum Expected {
    Frame(wire::Header, std::ops::Range<usize>),
    Closed,
    Error(ErrorKind),
}

fn expected_at(stream: &[u8], at: usize) -> Expected {
    let rest = &stream[at..];
    if rest.is_empty() {
        return Expected::Closed;
    }
    let Some(header) = rest.first_chunk::<HEADER_BYTES>() else { return Expected::Error(ErrorKind::UnexpectedEof) };
    let Ok(header) = wire::decode_header(header) else { return Expected::Error(ErrorKind::InvalidData) };
    let body_len = header.body_len as usize;
    assert!(body_len <= wire::MAX_BODY_BYTES, "a decoded header's length is bounded");
    if rest.len() - HEADER_BYTES < body_len {
        return Expected::Error(ErrorKind::UnexpectedEof);
    }
    let body = at + HEADER_BYTES..at + HEADER_BYTES + body_len;
    Expected::Frame(header, body)
}

/// Frames built from `data`: per frame a kind byte, a length byte and that many body bytes.
fn frames(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = data;
    while let [tag, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let kind = match tag % 4 {
            0 => Kind::Batch,
            1 => Kind::BatchResult,
            2 => Kind::RpcRequest,
            _ => Kind::FlockOpen,
        };
        wire::put_header(&mut out, kind, u64::from(*tag), len);
        out.extend_from_slice(&tail[..len]);
        rest = &tail[len..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&plan, data)) = data.split_first() else { return };
    // Plan: bit 0 builds frames; bit 1 flips a byte of them; bits 2-3 pick the buffer's
    // capacity; the rest, how many bytes of the input give the piece sizes.
    let piece_count = usize::from(plan >> 4).min(data.len());
    let (pieces, data) = data.split_at(piece_count);
    let mut stream = if plan & 1 == 1 { frames(data) } else { data.to_vec() };
    if plan & 2 == 2 && !stream.is_empty() {
        let at = usize::from(pieces.first().copied().unwrap_or(0)) * 7 % stream.len();
        stream[at] ^= 0x5a;
    }
    let capacity = [1, 17, HEADER_BYTES + 3, READ_BUFFER_BYTES][usize::from(plan >> 2 & 3)];
    let mut reader = BufReader::with_capacity(
        capacity,
        Socket { stream: &stream, at: 0, pieces, next_piece: 0, timed_out_last: false, reads: 0 },
    );
    let stall_limit = Duration::from_secs(3600);
    let mut body = Vec::new();
    let mut at = 0;
    // Each loop reads a frame, or times out once between frames: bounded by the stream.
    for _ in 0..2 * stream.len() + 2 {
        let whole = starts_with_whole_frame(reader.buffer());
        let reads_before = reader.get_ref().reads;
        let consumed_before = reader.get_ref().at - reader.buffer().len();
        let got = read_frame(&mut reader, &mut body, stall_limit);
        assert!(
            body.capacity() <= 2 * (stream.len() + READ_CHUNK_BYTES),
            "a body buffer of {} B from a stream of {} B",
            body.capacity(),
            stream.len()
        );
        if whole {
            assert_eq!(reader.get_ref().reads, reads_before, "a buffered whole frame made a socket read");
            assert!(matches!(got, Ok(FrameRead::Frame(_))), "a buffered whole frame was not read");
        }
        match (got, expected_at(&stream, at)) {
            (Ok(FrameRead::Idle), _) => {
                assert_eq!(reader.get_ref().at - reader.buffer().len(), consumed_before, "an idle read consumed bytes");
                assert!(reader.buffer().is_empty(), "idle with bytes buffered");
            }
            (Ok(FrameRead::Frame(got)), Expected::Frame(header, range)) => {
                assert_eq!((got.kind, got.request_id, got.body_len), (header.kind, header.request_id, header.body_len));
                assert_eq!(body, stream[range.clone()], "the body of the frame at {at}");
                at = range.end;
            }
            (Ok(FrameRead::Closed), Expected::Closed) => return,
            (Err(e), Expected::Error(kind)) => {
                assert_eq!(e.kind(), kind, "reading the frame at {at}: {e}");
                return;
            }
            (got, _) => {
                panic!("at {at}: read {:?}, not what the bytes hold", got.map(|f| matches!(f, FrameRead::Frame(_))))
            }
        }
    }
    panic!("the reader made no progress through {} B", stream.len());
});
