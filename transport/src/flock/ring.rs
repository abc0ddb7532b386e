//! A message ring in memory the peer writes (shared memory, or an RDMA-registered buffer).
//!
//! Messages sit back to back at 8-byte aligned offsets. The writer keeps 40 bytes free at
//! the end for a wrap marker (a bodiless message of kind WRAP) that sends the reader back to
//! offset 0. Wrap markers have their own canary sequence ([`wrap_canary`]), so messages are
//! numbered 0, 1, 2, ... whatever the wrapping. The reader polls the 8-byte word at its
//! position (canary | length << 32): zero means nothing yet; the expected canary means a
//! message has started; it is whole once its trailing canary matches too. The reader copies
//! it out (every access to the shared bytes is an 8-byte atomic: the peer may write them at
//! any time, and a torn or hostile message is caught by [`super::message::decode`] on the
//! private copy), zeroes every byte of it (wrap markers too), and advances its head (bytes
//! consumed, counting skipped tails), which goes back to the writer (in shared memory
//! directly, or riding on responses). The writer never writes where the last head it knows
//! says the reader has not been.
//!
//! Zeroing whole messages keeps an invariant: every ring byte is zero except those of
//! messages written and not yet consumed. So wherever a later lap's message boundaries fall,
//! the word at the reader's position is zero (nothing yet) or the start of the next message;
//! a non-zero word that is neither is a write still landing or a hostile peer, and only
//! those run into the stall limit. (Zeroing just the header and trailer words would leave
//! an older lap's payload under a later lap's boundaries, and an idle lane parked on such
//! bytes would be closed after the stall limit.)

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::message::{self, HEADER_BYTES, TRAILER_BYTES};

/// Size of a wrap marker.
pub(crate) const WRAP_BYTES: usize = HEADER_BYTES + TRAILER_BYTES;
/// An empty ring whose writer is past this offset starts over at 0, so a ring that is
/// mostly idle keeps touching only its first pages.
const REWIND_AFTER: usize = 256 * 1024;

/// The canary of the `n`th wrap marker of a lane.
pub(crate) fn wrap_canary(key: u32, n: u64) -> u32 {
    message::canary(key ^ 0x5752_4150, n) // "WRAP"
}

/// Ring bytes for messages up to `max_message`: room for two of them plus a marker.
pub(crate) fn ring_bytes_for(max_message: usize) -> usize {
    (2 * max_message + WRAP_BYTES).next_multiple_of(4096)
}

/// A region of memory both sides may touch; all accesses are 8-byte atomics.
#[derive(Clone, Copy)]
pub(crate) struct Span {
    base: *mut u8,
    len: usize,
}

// SAFETY: a Span is a pointer into a mapping kept alive by its owner; all accesses are atomic.
unsafe impl Send for Span {}
// SAFETY: as above.
unsafe impl Sync for Span {}

impl Span {
    /// A span over the `len` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned and `base..base+len` mapped for as long as the span is
    /// used; `len` a multiple of 8.
    pub unsafe fn new(base: *mut u8, len: usize) -> Self {
        assert!((base as usize).is_multiple_of(8) && len.is_multiple_of(8));
        Self { base, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn word(&self, offset: usize) -> &AtomicU64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= self.len, "ring word {offset} out of bounds");
        // SAFETY: in bounds and aligned (checked); AtomicU64 has u64's layout.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    pub fn word32(&self, offset: usize) -> &AtomicU32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= self.len, "ring word {offset} out of bounds");
        // SAFETY: in bounds and aligned (checked).
        unsafe { &*(self.base.add(offset) as *const AtomicU32) }
    }

    /// Copies `out.len()` (a multiple of 8) bytes from `offset`.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) {
        for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&self.word(offset + i * 8).load(Ordering::Relaxed).to_le_bytes());
        }
    }

    /// Zeroes `len` (a multiple of 8) bytes from `offset`.
    pub fn zero(&self, offset: usize, len: usize) {
        for i in (0..len).step_by(8) {
            self.word(offset + i).store(0, Ordering::Relaxed);
        }
    }

    /// Copies `bytes` (a multiple of 8) to `offset`, except the first word, which the caller
    /// publishes last.
    pub fn copy_in_after_first(&self, offset: usize, bytes: &[u8]) {
        for (i, chunk) in bytes.chunks_exact(8).enumerate().skip(1) {
            self.word(offset + i * 8).store(u64::from_le_bytes(chunk.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
    }
}

/// The reading end.
pub(crate) struct RingReader {
    span: Span,
    key: u32,
    pos: usize,
    /// Bytes consumed, skipped tails included.
    head: u64,
    wraps: u64,
    /// When the message at `pos` was first seen incomplete.
    waiting_since: Option<Instant>,
    stall: Duration,
}

impl RingReader {
    pub fn new(span: Span, key: u32, stall: Duration) -> Self {
        Self { span, key, pos: 0, head: 0, wraps: 0, waiting_since: None, stall }
    }

    pub fn head(&self) -> u64 {
        self.head
    }

    /// Whether a message (or marker) has started to arrive at the reading position.
    pub fn has_data(&self) -> bool {
        self.span.word(self.pos).load(Ordering::Acquire) != 0
    }

    /// Takes the next message into `buf` if it has arrived whole: `Ok(true)`; `Ok(false)`
    /// if nothing (or only part of it) is there yet; an `InvalidData` error for anything that
    /// cannot become the expected message.
    pub fn poll(&mut self, buf: &mut Vec<u8>, expect: u32, max: usize) -> io::Result<bool> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
        loop {
            let first = self.span.word(self.pos).load(Ordering::Acquire);
            if first == 0 {
                self.waiting_since = None;
                return Ok(false);
            }
            let canary = first as u32;
            let len = (first >> 32) as usize;
            if canary == wrap_canary(self.key, self.wraps) && len == WRAP_BYTES {
                if self.pos + WRAP_BYTES > self.span.len() {
                    return Err(invalid("wrap marker past the end of the ring".into()));
                }
                self.span.zero(self.pos, WRAP_BYTES);
                self.head += (self.span.len() - self.pos) as u64;
                self.pos = 0;
                self.wraps += 1;
                continue;
            }
            if canary != expect
                || len < WRAP_BYTES
                || !len.is_multiple_of(8)
                || self.pos + len > self.span.len()
                || len > max
            {
                // Possibly a write still landing (NICs do not promise 8-byte atomicity):
                // give it the stall limit, then call it what it is.
                return self.not_yet(format!("bad message start {first:#018x} at ring offset {}", self.pos));
            }
            let tail = self.span.word(self.pos + len - 8).load(Ordering::Acquire);
            if (tail >> 32) as u32 != expect {
                return self.not_yet(format!("message at ring offset {} never completed", self.pos));
            }
            buf.clear();
            buf.resize(len, 0);
            self.span.copy_out(self.pos, buf);
            // Stale bytes must never look like a message again, wherever later boundaries fall.
            self.span.zero(self.pos, len);
            self.pos += len;
            self.head += len as u64;
            self.waiting_since = None;
            if self.pos + WRAP_BYTES > self.span.len() {
                return Err(invalid("a message left no room for the wrap marker".into()));
            }
            return Ok(true);
        }
    }

    fn not_yet(&mut self, what: String) -> io::Result<bool> {
        let since = *self.waiting_since.get_or_insert_with(Instant::now);
        if since.elapsed() > self.stall {
            return Err(io::Error::new(io::ErrorKind::InvalidData, what));
        }
        Ok(false)
    }
}

/// Where the writer puts the next message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Write a wrap marker (with this canary) here first.
    pub wrap_at: Option<(usize, u32)>,
    pub offset: usize,
}

/// The writing end's bookkeeping (the bytes are written by the carrier: CPU stores or an
/// RDMA WRITE).
pub(crate) struct RingWriter {
    size: usize,
    key: u32,
    pos: usize,
    tail: u64,
    wraps: u64,
}

impl RingWriter {
    pub fn new(size: usize, key: u32) -> Self {
        Self { size, key, pos: 0, tail: 0, wraps: 0 }
    }

    /// Bytes written so far, skipped tails included.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Largest message that ever fits.
    pub fn max_message(&self) -> usize {
        (self.size - WRAP_BYTES) / 2
    }

    /// Places a message of `len` bytes given the reader's `head` (untrusted: a head past
    /// what was written counts as "all consumed"); `None` when there is no room yet. Commits
    /// the placement.
    pub fn place(&mut self, len: usize, head: u64) -> Option<Placement> {
        debug_assert!(len.is_multiple_of(8) && len <= self.max_message());
        let head = head.min(self.tail);
        let empty = head == self.tail;
        let wrap = self.pos + len + WRAP_BYTES > self.size || (empty && self.pos > REWIND_AFTER);
        let skip = if wrap { self.size - self.pos } else { 0 };
        if self.tail + (skip + len) as u64 - head > self.size as u64 {
            return None;
        }
        let wrap_at = wrap.then(|| {
            let at = (self.pos, wrap_canary(self.key, self.wraps));
            self.wraps += 1;
            self.tail += skip as u64;
            self.pos = 0;
            at
        });
        let offset = self.pos;
        self.pos += len;
        self.tail += len as u64;
        Some(Placement { wrap_at, offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flock::message::{canary, wrap_marker, Builder, Entry, Header, KIND_REQUEST};

    fn msg(key: u32, n: u64, size: usize) -> Vec<u8> {
        let mut b = Builder::default();
        b.push(Entry { size: size as u32, seq: n as u32, ..Entry::default() }, &vec![n as u8; size]);
        b.finish(Header { canary: canary(key, n), kind: KIND_REQUEST, ..Header::default() }).to_vec()
    }

    fn put(span: &Span, offset: usize, bytes: &[u8]) {
        span.copy_in_after_first(offset, bytes);
        span.word(offset).store(u64::from_le_bytes(bytes[..8].try_into().unwrap()), Ordering::Release);
    }

    #[test]
    fn messages_wrap_and_never_overrun_the_reader() {
        let mut memory = vec![0u64; 4096 / 8];
        // SAFETY: the vector outlives the span and is 8-aligned.
        let span = unsafe { Span::new(memory.as_mut_ptr().cast(), 4096) };
        let key = 77;
        let mut writer = RingWriter::new(4096, key);
        let mut reader = RingReader::new(span, key, Duration::from_millis(10));
        let mut buf = Vec::new();
        let (mut sent, mut got) = (0u64, 0u64);
        for round in 0..500u64 {
            let size = (round as usize * 37) % 900;
            let m = msg(key, sent, size);
            match writer.place(m.len(), reader.head()) {
                Some(p) => {
                    if let Some((at, c)) = p.wrap_at {
                        put(&span, at, &wrap_marker(c));
                    }
                    put(&span, p.offset, &m);
                    sent += 1;
                }
                None => assert!(sent > got, "no room in an empty ring"),
            }
            if round % 3 != 0 {
                while reader.poll(&mut buf, canary(key, got), 4096).unwrap() {
                    let m = message::decode(&buf, Some(canary(key, got)), 4096).unwrap();
                    assert_eq!(m.entries().next().unwrap().0.seq, got as u32);
                    got += 1;
                }
            }
        }
        assert!(got > 100, "{got}");
    }

    /// After a lap with other boundaries, the reader's position lies over an older lap's
    /// payload; parked there past the stall limit (an idle lane), it still sees "nothing yet".
    #[test]
    fn an_idle_reader_over_an_older_lap_is_not_an_error() {
        let mut memory = vec![0u64; 4096 / 8];
        // SAFETY: the vector outlives the span and is 8-aligned.
        let span = unsafe { Span::new(memory.as_mut_ptr().cast(), 4096) };
        let key = 5;
        let mut writer = RingWriter::new(4096, key);
        let mut reader = RingReader::new(span, key, Duration::from_millis(5));
        let mut buf = Vec::new();
        let (mut sent, mut got) = (0u64, 0u64);
        // Lap 1: large messages with payload bytes 0x01..; lap 2 onwards: small ones, whose
        // boundaries fall inside lap 1's payloads.
        let msg = |n: u64, size: usize| {
            let mut b = Builder::default();
            b.push(Entry { size: size as u32, seq: n as u32, ..Entry::default() }, &vec![0xEE; size]);
            b.finish(Header { canary: canary(key, n), kind: KIND_REQUEST, ..Header::default() }).to_vec()
        };
        for size in [1200usize, 1200, 1200, 40, 40, 40, 40, 40, 40] {
            let m = msg(sent, size);
            let p = writer.place(m.len(), reader.head()).expect("room");
            if let Some((at, c)) = p.wrap_at {
                put(&span, at, &wrap_marker(c));
            }
            put(&span, p.offset, &m);
            sent += 1;
            while reader.poll(&mut buf, canary(key, got), 4096).unwrap() {
                got += 1;
            }
        }
        assert_eq!(got, sent);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!reader.poll(&mut buf, canary(key, got), 4096).unwrap(), "nothing was sent");
        // Still fine once the next message comes.
        let m = msg(sent, 8);
        let p = writer.place(m.len(), reader.head()).unwrap();
        if let Some((at, c)) = p.wrap_at {
            put(&span, at, &wrap_marker(c));
        }
        put(&span, p.offset, &m);
        assert!(reader.poll(&mut buf, canary(key, got), 4096).unwrap());
    }
}
