//! Replies and their encoding in RESP2 or RESP3 (what the connection chose with `HELLO`).
//!
//! A reply is built once, in its richest type (a map, a double, a verbatim string); the
//! encoder writes it in the connection's protocol, with RESP2's fallbacks as Redis 7 has
//! them: a map is a flat array of keys and values, a set an array, a double a bulk string,
//! a boolean an integer, a verbatim string a bulk string, a push frame an array.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};

/// The protocol a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// RESP2, every connection's protocol until HELLO 3.
    #[default]
    Resp2,
    /// RESP3, after HELLO 3.
    Resp3,
}

impl Protocol {
    /// The number `HELLO` takes and reports.
    pub fn version(self) -> i64 {
        match self {
            Protocol::Resp2 => 2,
            Protocol::Resp3 => 3,
        }
    }
}

/// One reply to a client.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `+OK`: a one-line status.
    Status(Cow<'static, str>),
    /// `-ERR ...`: starts with an upper-case error code (`ERR`, `OOM`, `TRYAGAIN`, ...).
    Error(Cow<'static, str>),
    /// `:42`.
    Integer(i64),
    /// `$3\r\nfoo`: binary-safe bytes.
    Bulk(Vec<u8>),
    /// The null reply (a missing key): `$-1` in RESP2, `_` in RESP3.
    Nil,
    /// The null array (EXEC aborted by WATCH): `*-1` in RESP2, `_` in RESP3.
    NilArray,
    /// `*2 ...`.
    Array(Vec<Reply>),
    /// Key-value pairs: `%` in RESP3, a flat array in RESP2.
    Map(Vec<(Reply, Reply)>),
    /// Unordered distinct items: `~` in RESP3, an array in RESP2.
    Set(Vec<Reply>),
    /// `,1.5` in RESP3, a bulk string in RESP2.
    Double(f64),
    /// `#t` / `#f` in RESP3, `:1` / `:0` in RESP2.
    Boolean(bool),
    /// Text with a format (`txt`, `mkd`): `=` in RESP3, a bulk string in RESP2.
    Verbatim(&'static str, Vec<u8>),
    /// Out-of-band data: `>` in RESP3, an array in RESP2.
    Push(Vec<Reply>),
}

impl Reply {
    /// `+OK`.
    pub fn ok() -> Self {
        Reply::Status(Cow::Borrowed("OK"))
    }

    /// An error reply; `message` starts with its code, e.g. `"ERR syntax error"`.
    pub fn error(message: impl Into<Cow<'static, str>>) -> Self {
        Reply::Error(message.into())
    }

    /// A bulk reply from text.
    pub fn bulk_str(text: &str) -> Self {
        Reply::Bulk(text.as_bytes().to_vec())
    }

    /// A map from text keys.
    pub fn map<'a>(pairs: impl IntoIterator<Item = (&'a str, Reply)>) -> Self {
        Reply::Map(pairs.into_iter().map(|(k, v)| (Reply::bulk_str(k), v)).collect())
    }

    /// Whether this is an error reply (for metrics).
    pub fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }

    /// Appends the encoding in `protocol` to `out`.
    pub fn encode(&self, out: &mut Vec<u8>, protocol: Protocol) {
        let resp3 = protocol == Protocol::Resp3;
        match self {
            Reply::Status(text) => line(out, b'+', text),
            Reply::Error(text) => line(out, b'-', text),
            Reply::Integer(n) => header(out, b':', *n),
            Reply::Bulk(bytes) => bulk(out, b'$', bytes),
            Reply::Nil if resp3 => out.extend_from_slice(b"_\r\n"),
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::NilArray if resp3 => out.extend_from_slice(b"_\r\n"),
            Reply::NilArray => out.extend_from_slice(b"*-1\r\n"),
            Reply::Array(items) => aggregate(out, b'*', items, protocol),
            Reply::Set(items) => aggregate(out, if resp3 { b'~' } else { b'*' }, items, protocol),
            Reply::Push(items) => aggregate(out, if resp3 { b'>' } else { b'*' }, items, protocol),
            Reply::Map(pairs) => {
                if resp3 {
                    header(out, b'%', pairs.len() as i64);
                } else {
                    header(out, b'*', 2 * pairs.len() as i64);
                }
                for (key, value) in pairs {
                    key.encode(out, protocol);
                    value.encode(out, protocol);
                }
            }
            Reply::Double(x) => {
                let text = format_double(*x);
                if resp3 {
                    line(out, b',', &text);
                } else {
                    bulk(out, b'$', text.as_bytes());
                }
            }
            Reply::Boolean(b) if resp3 => out.extend_from_slice(if *b { b"#t\r\n" } else { b"#f\r\n" }),
            Reply::Boolean(b) => header(out, b':', i64::from(*b)),
            Reply::Verbatim(format, text) if resp3 => {
                debug_assert_eq!(format.len(), 3, "verbatim formats are three letters");
                header(out, b'=', (format.len() + 1 + text.len()) as i64);
                out.extend_from_slice(format.as_bytes());
                out.push(b':');
                out.extend_from_slice(text);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Verbatim(_, text) => bulk(out, b'$', text),
        }
    }
}

/// A double as Redis writes it: `inf`, `-inf`, `nan`, else the shortest text that reads
/// back as the same number.
pub fn format_double(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{x}")
    }
}

fn header(out: &mut Vec<u8>, prefix: u8, n: i64) {
    out.push(prefix);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn bulk(out: &mut Vec<u8>, prefix: u8, bytes: &[u8]) {
    header(out, prefix, bytes.len() as i64);
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

fn aggregate(out: &mut Vec<u8>, prefix: u8, items: &[Reply], protocol: Protocol) {
    header(out, prefix, items.len() as i64);
    for item in items {
        item.encode(out, protocol);
    }
}

/// A one-line reply; CR and LF become spaces (as Redis does for errors) so that text taken
/// from a client (an unknown command's name) cannot break the framing.
fn line(out: &mut Vec<u8>, prefix: u8, text: &str) {
    out.push(prefix);
    out.extend(text.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
    out.extend_from_slice(b"\r\n");
}

/// Bulk replies at least this long are queued as their own buffer, not copied.
pub const LARGE_REPLY_BYTES: usize = 64 << 10;

/// Most buffers handed to one vectored write.
const MAX_WRITE_SLICES: usize = 16;

/// Replies waiting to be written to a connection, in order: small ones gathered into one
/// buffer, while a large bulk value ([`LARGE_REPLY_BYTES`] or more, e.g. a big GET) keeps
/// the buffer the store returned it in (moved, never copied), so a 512 MiB value costs
/// 512 MiB here, not twice that. Written with vectored writes.
#[derive(Debug, Default)]
pub struct Output {
    /// Pieces to write before `tail`.
    queue: VecDeque<Vec<u8>>,
    /// Bytes in `queue`.
    queued: usize,
    /// Small replies gathered after the queued pieces.
    tail: Vec<u8>,
    /// Bytes already written of the first piece (the queue's front, else `tail`).
    written: usize,
}

impl Output {
    /// An empty output whose small-reply buffer starts with `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Self { tail: Vec::with_capacity(capacity), ..Self::default() }
    }

    /// Bytes not written yet.
    pub fn len(&self) -> usize {
        self.queued + self.tail.len() - self.written
    }

    /// Whether everything was written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `reply` encoded in `protocol`; a large bulk value is moved in, not copied.
    pub fn push(&mut self, reply: Reply, protocol: Protocol) {
        match reply {
            Reply::Bulk(value) if value.len() >= LARGE_REPLY_BYTES => {
                header(&mut self.tail, b'$', value.len() as i64);
                self.queued += self.tail.len() + value.len();
                self.queue.push_back(std::mem::take(&mut self.tail));
                self.queue.push_back(value);
                self.tail.extend_from_slice(b"\r\n");
            }
            other => other.encode(&mut self.tail, protocol),
        }
    }

    /// The buffer small replies are appended to (for [`Reply::encode`]).
    pub fn bytes(&mut self) -> &mut Vec<u8> {
        &mut self.tail
    }

    /// One (vectored) write of what is pending; returns the bytes written.
    pub fn write_to<W: Write + ?Sized>(&mut self, w: &mut W) -> io::Result<usize> {
        let n = if self.queue.is_empty() {
            w.write(&self.tail[self.written..])?
        } else {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(MAX_WRITE_SLICES);
            let pieces = self.queue.iter().map(Vec::as_slice).chain(std::iter::once(self.tail.as_slice()));
            for (i, piece) in pieces.take(MAX_WRITE_SLICES).enumerate() {
                slices.push(IoSlice::new(if i == 0 { &piece[self.written..] } else { piece }));
            }
            w.write_vectored(&slices)?
        };
        self.advance(n);
        Ok(n)
    }

    /// Writes everything pending (a blocking writer); returns the bytes written.
    pub fn write_all_to<W: Write + ?Sized>(&mut self, w: &mut W) -> io::Result<usize> {
        let mut total = 0;
        while !self.is_empty() {
            match self.write_to(w) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => total += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// Everything pending, as one buffer (tests).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut all = Vec::with_capacity(self.len());
        for (i, piece) in self.queue.iter().chain(std::iter::once(&self.tail)).enumerate() {
            all.extend_from_slice(if i == 0 { &piece[self.written..] } else { piece });
        }
        all
    }

    /// Drops everything pending.
    pub fn clear(&mut self) {
        self.queue.clear();
        self.queued = 0;
        self.tail.clear();
        self.written = 0;
    }

    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.queue.front() else {
                self.written += n;
                break;
            };
            let left = front.len() - self.written;
            if n < left {
                self.written += n;
                break;
            }
            n -= left;
            self.queued -= front.len();
            self.queue.pop_front();
            self.written = 0;
        }
        if self.queue.is_empty() && self.written == self.tail.len() {
            // Keeps the small-reply buffer's capacity for the next replies.
            self.tail.clear();
            self.written = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(reply: &Reply, protocol: Protocol) -> String {
        let mut out = Vec::new();
        reply.encode(&mut out, protocol);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn encodes_every_kind_in_resp2() {
        let two = |r: &Reply| encoded(r, Protocol::Resp2);
        assert_eq!(two(&Reply::ok()), "+OK\r\n");
        assert_eq!(two(&Reply::error("ERR bad\r\nthing")), "-ERR bad  thing\r\n");
        assert_eq!(two(&Reply::Integer(-3)), ":-3\r\n");
        assert_eq!(two(&Reply::bulk_str("a\r\nb")), "$4\r\na\r\nb\r\n");
        assert_eq!(two(&Reply::Nil), "$-1\r\n");
        assert_eq!(two(&Reply::NilArray), "*-1\r\n");
        assert_eq!(
            two(&Reply::Array(vec![Reply::Integer(1), Reply::Nil, Reply::Array(vec![])])),
            "*3\r\n:1\r\n$-1\r\n*0\r\n"
        );
        assert_eq!(two(&Reply::map([("a", Reply::Integer(1))])), "*2\r\n$1\r\na\r\n:1\r\n");
        assert_eq!(two(&Reply::Set(vec![Reply::bulk_str("x")])), "*1\r\n$1\r\nx\r\n");
        assert_eq!(two(&Reply::Double(1.5)), "$3\r\n1.5\r\n");
        assert_eq!(two(&Reply::Boolean(true)), ":1\r\n");
        assert_eq!(two(&Reply::Verbatim("txt", b"hi".to_vec())), "$2\r\nhi\r\n");
        assert_eq!(two(&Reply::Push(vec![Reply::Integer(1)])), "*1\r\n:1\r\n");
    }

    #[test]
    fn encodes_every_kind_in_resp3() {
        let three = |r: &Reply| encoded(r, Protocol::Resp3);
        assert_eq!(three(&Reply::Nil), "_\r\n");
        assert_eq!(three(&Reply::NilArray), "_\r\n");
        assert_eq!(three(&Reply::map([("a", Reply::Nil)])), "%1\r\n$1\r\na\r\n_\r\n");
        assert_eq!(three(&Reply::Set(vec![Reply::Integer(2)])), "~1\r\n:2\r\n");
        assert_eq!(three(&Reply::Double(-0.25)), ",-0.25\r\n");
        assert_eq!(three(&Reply::Double(f64::INFINITY)), ",inf\r\n");
        assert_eq!(three(&Reply::Double(f64::NAN)), ",nan\r\n");
        assert_eq!(three(&Reply::Boolean(false)), "#f\r\n");
        assert_eq!(three(&Reply::Verbatim("txt", b"hi".to_vec())), "=6\r\ntxt:hi\r\n");
        assert_eq!(three(&Reply::Push(vec![Reply::bulk_str("m")])), ">1\r\n$1\r\nm\r\n");
        assert_eq!(three(&Reply::Array(vec![Reply::Nil])), "*1\r\n_\r\n");
    }

    /// Takes at most `max` bytes per write, and every fourth call would block.
    struct Trickle {
        got: Vec<u8>,
        max: usize,
        calls: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls.is_multiple_of(4) {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.max);
            self.got.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A large bulk is queued as the very buffer it came in; what is written, in pieces of
    /// any size, is byte for byte what encoding every reply in order gives.
    #[test]
    fn large_bulks_are_queued_not_copied_and_written_in_order() {
        let big: Vec<u8> = (0..LARGE_REPLY_BYTES * 3).map(|i| i as u8).collect();
        let replies = vec![
            Reply::ok(),
            Reply::Bulk(big.clone()),
            Reply::Integer(7),
            Reply::Bulk(big[..LARGE_REPLY_BYTES].to_vec()),
            Reply::Bulk(big[..LARGE_REPLY_BYTES].to_vec()),
            Reply::Nil,
        ];
        let mut want = Vec::new();
        for r in &replies {
            r.encode(&mut want, Protocol::Resp2);
        }
        for max in [1, 7, 4096, usize::MAX] {
            let mut out = Output::with_capacity(64);
            let mut pending = replies.clone().into_iter();
            out.push(pending.next().unwrap(), Protocol::Resp2);
            let big_reply = pending.next().unwrap();
            let Reply::Bulk(ref value) = big_reply else { unreachable!() };
            let at = value.as_ptr();
            out.push(big_reply, Protocol::Resp2);
            assert!(out.queue.iter().any(|piece| piece.as_ptr() == at), "the value was copied");
            let mut sink = Trickle { got: Vec::new(), max, calls: 0 };
            // Half written, then the rest of the replies arrive behind it.
            while sink.got.len() < 100_000 {
                let _ = out.write_to(&mut sink);
            }
            for r in pending {
                out.push(r, Protocol::Resp2);
            }
            assert_eq!(out.len(), want.len() - sink.got.len());
            while !out.is_empty() {
                let _ = out.write_to(&mut sink);
            }
            assert!(sink.got == want, "max {max}: written bytes differ");
            assert!(out.queue.is_empty() && out.tail.is_empty() && out.written == 0);
        }
    }
}
