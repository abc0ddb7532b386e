//! The RESP driver: drives any server that speaks the Redis protocol (racekv's front end,
//! redis-server, valkey-server) the same way. Each of `threads` threads owns `connections`
//! blocking TCP connections; each connection carries `pipeline` operations at a time. A
//! round writes every connection's batch (one command per busy slot), then reads every
//! connection's replies in order; a finished operation's slot takes the next operation for
//! the following round, and a read-modify-write (GET, then SET) or a scan that needs
//! another SCAN call keeps its slot for another round. Commands are encoded into one
//! reusable buffer per connection (the value's bytes are encoded once); replies are parsed
//! in place from a read buffer, checking each reply's type against its command, and every
//! length the server sends is bounded before it is used.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::generator::{key_name, push_decimal};
use super::workload::{share, Chooser, Distribution, KeySpace, Measured, Next, Op, Workload};

/// The longest reply line (a simple string, an error, an integer, a length header).
const MAX_LINE_BYTES: usize = 4096;
/// The longest bulk string a reply may carry here (values are at most a few KiB; keys short).
pub const MAX_BULK_BYTES: usize = 1 << 20;
/// The most elements a reply array may claim (a SCAN page).
const MAX_ARRAY_ITEMS: usize = 100_000;
/// How deeply arrays may nest in a reply this driver does not expect (skipped).
const MAX_DEPTH: u32 = 4;

/// How a server's SCAN cursors are laid out, to start each scan somewhere at random.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursors {
    /// Redis and Valkey: a hash table index in reverse binary; any number is a valid
    /// cursor (the server masks it to its table's size).
    Redis,
    /// racekv: a reverse-binary position in the hash space (`POSITION_BITS`) above a slot
    /// index (`SLOT_INDEX_BITS`); the memnode's index (0: one memnode) above both.
    Racekv,
}

impl Cursors {
    /// A cursor at a random place of the key space, from `random`.
    pub fn random_start(self, random: u64) -> u64 {
        use racekv_hashing::scan::{POSITION_BITS, SLOT_INDEX_BITS};
        match self {
            Self::Redis => random >> 32,
            Self::Racekv => (random & ((1 << POSITION_BITS) - 1)) << SLOT_INDEX_BITS,
        }
    }
}

/// How the driver runs (the same for every server of a run).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Client threads.
    pub threads: usize,
    /// Connections per thread.
    pub connections: usize,
    /// Operations in flight per connection.
    pub pipeline: usize,
}

/// One run of a workload against one server.
pub struct Run<'a> {
    /// The server's port on 127.0.0.1.
    pub port: u16,
    /// Its cursor layout.
    pub cursors: Cursors,
    /// Its keys.
    pub space: &'a KeySpace,
    /// The workload.
    pub workload: Workload,
    /// Its key choice.
    pub distribution: Distribution,
    /// Operations, all threads together.
    pub ops: u64,
    /// Value bytes.
    pub value_size: usize,
    /// Seeds the threads' choices.
    pub seed: u64,
}

/// Runs it; returns what was measured and the wall time in seconds.
pub fn run(run: &Run<'_>, shape: Shape, bar: &indicatif::ProgressBar) -> anyhow::Result<(Measured, f64)> {
    let value = value_bytes(run.value_size, run.seed);
    let started = Instant::now();
    let results: Vec<anyhow::Result<Measured>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..shape.threads)
            .map(|t| {
                let value = &value;
                s.spawn(move || thread(run, shape, t, value, bar))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a driver thread panicked")).collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut total = Measured::new();
    for r in results {
        total.merge(&r?);
    }
    Ok((total, seconds))
}

/// A value of `size` bytes (printable, varied).
pub fn value_bytes(size: usize, seed: u64) -> Vec<u8> {
    (0..size).map(|i| b'a' + ((i as u64).wrapping_mul(31).wrapping_add(seed) % 26) as u8).collect()
}

/// One operation in a pipeline slot.
#[derive(Clone, Copy)]
struct Slot {
    next: Next,
    /// When its first command was sent.
    started: Instant,
    /// Its second command's turn (the SET of a read-modify-write), or a scan's next call.
    stage: u32,
    /// A scan's cursor and the keys it has so far.
    cursor: u64,
    scanned: u64,
}

/// What a slot's current command expects back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// A bulk string or nil (GET).
    Bulk,
    /// `+OK` (SET).
    Ok,
    /// A SCAN page.
    Page,
}

fn expect_of(slot: &Slot) -> Expect {
    match (slot.next.op, slot.stage) {
        (Op::Read, _) | (Op::ReadModifyWrite, 0) => Expect::Bulk,
        (Op::Update | Op::Insert | Op::ReadModifyWrite, _) => Expect::Ok,
        (Op::Scan, _) => Expect::Page,
    }
}

struct Connection {
    stream: TcpStream,
    reader: Reader,
    slots: Vec<Option<Slot>>,
    out: Vec<u8>,
}

fn thread(
    run: &Run<'_>,
    shape: Shape,
    index: usize,
    value: &[u8],
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<Measured> {
    let mut quota = share(run.ops, shape.threads, index);
    let mut chooser = Chooser::new(
        run.workload,
        run.distribution,
        run.space,
        run.ops,
        run.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index as u64),
    );
    let mut connections = Vec::with_capacity(shape.connections);
    for _ in 0..shape.connections {
        let stream = TcpStream::connect(("127.0.0.1", run.port))?;
        stream.set_nodelay(true)?;
        let reader = Reader::new(stream.try_clone()?);
        connections.push(Connection { stream, reader, slots: vec![None; shape.pipeline], out: Vec::new() });
    }
    let mut measured = Measured::new();
    let mut key = Vec::with_capacity(32);
    let set_tail = set_tail(value);
    loop {
        // Fill the free slots and write every connection's batch.
        let mut busy = 0;
        for c in &mut connections {
            c.out.clear();
            let now = Instant::now();
            for slot in &mut c.slots {
                if slot.is_none() && quota > 0 {
                    quota -= 1;
                    let next = chooser.next(run.space);
                    let cursor = run.cursors.random_start(chooser.random());
                    *slot = Some(Slot { next, started: now, stage: 0, cursor, scanned: 0 });
                }
                if let Some(slot) = slot {
                    encode(slot, &mut key, &set_tail, &mut c.out);
                    busy += 1;
                }
            }
            c.stream.write_all(&c.out)?;
        }
        if busy == 0 {
            break;
        }
        // Read every reply, in order.
        let mut done = 0u64;
        for c in &mut connections {
            for slot in &mut c.slots {
                let Some(s) = slot else { continue };
                let reply = c.reader.reply(expect_of(s))?;
                if finish(s, reply, run.space, &mut measured) {
                    *slot = None;
                    done += 1;
                }
            }
        }
        bar.inc(done);
    }
    Ok(measured)
}

/// A parsed reply, as far as the driver needs it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    /// What the command answers with when it worked (a SCAN page: its cursor and keys).
    Expected { cursor: u64, keys: u64 },
    /// A GET's nil.
    Nil,
    /// An error reply, with its text.
    Error(String),
    /// Any other type.
    Unexpected,
}

/// Takes `reply` for the slot's current command; returns whether the operation is done.
fn finish(slot: &mut Slot, reply: Reply, space: &KeySpace, measured: &mut Measured) -> bool {
    if slot.next.op == Op::Insert && !matches!(reply, Reply::Expected { .. }) {
        space.insert_done(slot.next.key); // failed: passed over, its error counted below
    }
    match reply {
        Reply::Error(text) => measured.error(|| text),
        Reply::Unexpected => measured.unexpected += 1,
        Reply::Nil => measured.not_found += 1,
        Reply::Expected { cursor, keys } => match slot.next.op {
            Op::Insert => space.insert_done(slot.next.key),
            Op::ReadModifyWrite if slot.stage == 0 => {
                slot.stage = 1;
                return false;
            }
            Op::Scan => {
                measured.scan_calls += 1;
                slot.scanned += keys;
                slot.cursor = cursor;
                if slot.scanned < u64::from(slot.next.scan_length) && cursor != 0 {
                    slot.stage += 1;
                    return false;
                }
                measured.scan_keys += slot.scanned;
            }
            _ => {}
        },
    }
    measured.record(slot.next.op, slot.started.elapsed().as_nanos() as u64);
    true
}

/// `$<len>\r\n<value>\r\n`: the end of every SET.
fn set_tail(value: &[u8]) -> Vec<u8> {
    let mut tail = format!("${}\r\n", value.len()).into_bytes();
    tail.extend_from_slice(value);
    tail.extend_from_slice(b"\r\n");
    tail
}

pub(crate) fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    push_decimal(out, bytes.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Appends the slot's current command to `out`.
fn encode(slot: &Slot, key: &mut Vec<u8>, set_tail: &[u8], out: &mut Vec<u8>) {
    key_name(slot.next.key, key);
    match expect_of(slot) {
        Expect::Bulk => {
            out.extend_from_slice(b"*2\r\n$3\r\nGET\r\n");
            push_bulk(out, key);
        }
        Expect::Ok => {
            out.extend_from_slice(b"*3\r\n$3\r\nSET\r\n");
            push_bulk(out, key);
            out.extend_from_slice(set_tail);
        }
        Expect::Page => {
            let mut number = Vec::with_capacity(20);
            out.extend_from_slice(b"*4\r\n$4\r\nSCAN\r\n");
            push_decimal(&mut number, slot.cursor);
            push_bulk(out, &number);
            out.extend_from_slice(b"$5\r\nCOUNT\r\n");
            number.clear();
            push_decimal(
                &mut number,
                u64::from(slot.next.scan_length) - slot.scanned.min(u64::from(slot.next.scan_length) - 1),
            );
            push_bulk(out, &number);
        }
    }
}

/// Encodes one command (for the load's and the tests' few commands).
pub fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![b'*'];
    push_decimal(&mut out, args.len() as u64);
    out.extend_from_slice(b"\r\n");
    for arg in args {
        push_bulk(&mut out, arg);
    }
    out
}

/// A buffered reader of replies from an untrusted server.
pub struct Reader {
    stream: Box<dyn Read + Send>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Reader {
    /// Reads from `stream`.
    pub fn new(stream: impl Read + Send + 'static) -> Self {
        Self { stream: Box::new(stream), buf: vec![0; 1 << 16], start: 0, end: 0 }
    }

    /// Reads more into the buffer; at least one byte.
    fn fill(&mut self) -> anyhow::Result<()> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let n = self.stream.read(&mut self.buf[self.end..])?;
        anyhow::ensure!(n > 0, "the server closed the connection");
        self.end += n;
        Ok(())
    }

    /// One line without its CRLF, at most [`MAX_LINE_BYTES`]; returned as a range of
    /// `buf`, consumed.
    fn line(&mut self) -> anyhow::Result<std::ops::Range<usize>> {
        let mut searched = 0;
        loop {
            let window = &self.buf[self.start + searched..self.end];
            if let Some(i) = window.windows(2).position(|w| w == b"\r\n") {
                let range = self.start..self.start + searched + i;
                self.start = range.end + 2;
                return Ok(range);
            }
            searched = (self.end - self.start).saturating_sub(1);
            anyhow::ensure!(searched <= MAX_LINE_BYTES, "a reply line longer than {MAX_LINE_BYTES} bytes");
            self.fill()?;
        }
    }

    /// A header line `<type><integer>` whose integer is -1 (returned as None) or at most `max`.
    fn length(&mut self, line: std::ops::Range<usize>, max: usize) -> anyhow::Result<Option<usize>> {
        let text = &self.buf[line.start + 1..line.end];
        if text == b"-1" {
            return Ok(None);
        }
        anyhow::ensure!(
            !text.is_empty() && text.len() <= 10 && text.iter().all(u8::is_ascii_digit),
            "a bad length {:?}",
            String::from_utf8_lossy(text)
        );
        let n: usize = std::str::from_utf8(text)?.parse()?;
        anyhow::ensure!(n <= max, "a length of {n} (at most {max} here)");
        Ok(Some(n))
    }

    /// Skips `n` bytes and the CRLF after them.
    fn skip_bulk(&mut self, n: usize) -> anyhow::Result<()> {
        let mut left = n;
        while left > 0 {
            if self.start == self.end {
                self.fill()?;
            }
            let take = left.min(self.end - self.start);
            self.start += take;
            left -= take;
        }
        while self.end - self.start < 2 {
            self.fill()?;
        }
        anyhow::ensure!(self.buf[self.start..self.start + 2] == *b"\r\n", "a bulk string without its CRLF");
        self.start += 2;
        Ok(())
    }

    /// Reads a bulk string of at most 20 bytes into a number (a SCAN cursor).
    fn cursor(&mut self) -> anyhow::Result<u64> {
        let header = self.line()?;
        anyhow::ensure!(self.buf[header.start] == b'$', "a SCAN cursor that is not a bulk string");
        let n = self.length(header, 20)?.ok_or_else(|| anyhow::anyhow!("a nil SCAN cursor"))?;
        while self.end - self.start < n + 2 {
            self.fill()?;
        }
        let text = &self.buf[self.start..self.start + n];
        anyhow::ensure!(!text.is_empty() && text.iter().all(u8::is_ascii_digit), "a bad SCAN cursor");
        let cursor = std::str::from_utf8(text)?.parse()?;
        self.skip_bulk(n)?;
        Ok(cursor)
    }

    /// Skips one whole reply of any type (nested at most `depth` more levels).
    fn skip_reply(&mut self, depth: u32) -> anyhow::Result<()> {
        let line = self.line()?;
        match self.buf.get(line.start) {
            Some(b'+' | b'-' | b':') => Ok(()),
            Some(b'$') => match self.length(line, MAX_BULK_BYTES)? {
                Some(n) => self.skip_bulk(n),
                None => Ok(()),
            },
            Some(b'*') => {
                anyhow::ensure!(depth > 0, "a reply nested too deeply");
                for _ in 0..self.length(line, MAX_ARRAY_ITEMS)?.unwrap_or(0) {
                    self.skip_reply(depth - 1)?;
                }
                Ok(())
            }
            _ => anyhow::bail!("a reply of unknown type"),
        }
    }

    /// The next reply, for a command that expects `expect`.
    pub(crate) fn reply(&mut self, expect: Expect) -> anyhow::Result<Reply> {
        while self.start == self.end {
            self.fill()?;
        }
        let kind = self.buf[self.start];
        match (kind, expect) {
            (b'-', _) => {
                let line = self.line()?;
                Ok(Reply::Error(String::from_utf8_lossy(&self.buf[line.start + 1..line.end]).into_owned()))
            }
            (b'$', Expect::Bulk) => {
                let line = self.line()?;
                match self.length(line, MAX_BULK_BYTES)? {
                    Some(n) => {
                        self.skip_bulk(n)?;
                        Ok(Reply::Expected { cursor: 0, keys: 0 })
                    }
                    None => Ok(Reply::Nil),
                }
            }
            (b'+', Expect::Ok) => {
                let line = self.line()?;
                Ok(if &self.buf[line] == b"+OK" { Reply::Expected { cursor: 0, keys: 0 } } else { Reply::Unexpected })
            }
            (b'*', Expect::Page) => {
                let line = self.line()?;
                if self.length(line, 2)? != Some(2) {
                    return Ok(Reply::Unexpected);
                }
                let cursor = self.cursor()?;
                let line = self.line()?;
                anyhow::ensure!(self.buf[line.start] == b'*', "a SCAN page without its array of keys");
                let keys = self.length(line, MAX_ARRAY_ITEMS)?.unwrap_or(0);
                for _ in 0..keys {
                    let line = self.line()?;
                    anyhow::ensure!(self.buf[line.start] == b'$', "a SCAN key that is not a bulk string");
                    let n = self.length(line, MAX_BULK_BYTES)?.ok_or_else(|| anyhow::anyhow!("a nil key"))?;
                    self.skip_bulk(n)?;
                }
                Ok(Reply::Expected { cursor, keys: keys as u64 })
            }
            _ => {
                self.skip_reply(MAX_DEPTH)?;
                Ok(Reply::Unexpected)
            }
        }
    }
}

/// Writes every command of `commands` on one connection to `port` and checks each answered
/// `+OK` (setup commands such as CONFIG SET).
pub fn expect_ok(port: u16, commands: &[Vec<u8>]) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = Reader::new(stream.try_clone()?);
    stream.write_all(&commands.concat())?;
    for _ in commands {
        let reply = reader.reply(Expect::Ok)?;
        anyhow::ensure!(matches!(reply, Reply::Expected { .. }), "a setup command answered {reply:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(bytes: &[u8]) -> Reader {
        Reader::new(std::io::Cursor::new(bytes.to_vec()))
    }

    #[test]
    fn replies_are_checked_against_their_command() {
        let mut r =
            reader(b"$3\r\nabc\r\n$-1\r\n+OK\r\n-ERR nope\r\n:5\r\n*2\r\n$2\r\n17\r\n*2\r\n$1\r\na\r\n$2\r\nbc\r\n");
        assert_eq!(r.reply(Expect::Bulk).unwrap(), Reply::Expected { cursor: 0, keys: 0 });
        assert_eq!(r.reply(Expect::Bulk).unwrap(), Reply::Nil);
        assert_eq!(r.reply(Expect::Ok).unwrap(), Reply::Expected { cursor: 0, keys: 0 });
        assert_eq!(r.reply(Expect::Ok).unwrap(), Reply::Error("ERR nope".into()));
        assert_eq!(r.reply(Expect::Bulk).unwrap(), Reply::Unexpected);
        assert_eq!(r.reply(Expect::Page).unwrap(), Reply::Expected { cursor: 17, keys: 2 });
        assert!(r.reply(Expect::Bulk).is_err(), "the stream is over");
    }

    #[test]
    fn an_unexpected_reply_is_skipped_whole() {
        let mut r = reader(b"*2\r\n$1\r\nx\r\n*1\r\n:1\r\n+OK\r\n");
        assert_eq!(r.reply(Expect::Bulk).unwrap(), Reply::Unexpected);
        assert_eq!(r.reply(Expect::Ok).unwrap(), Reply::Expected { cursor: 0, keys: 0 });
    }

    #[test]
    fn lengths_are_bounded_before_anything_is_read() {
        for bad in [
            &b"$99999999999\r\n"[..],
            b"$2097152\r\n",
            b"$-2\r\n",
            b"$abc\r\n",
            b"*100001\r\n",
            b"*3\r\n",
            b"$3\r\nabcd\r\n",
            b"%1\r\n",
        ] {
            let expect = if bad[0] == b'*' { Expect::Page } else { Expect::Bulk };
            let result = reader(bad).reply(expect);
            assert!(result.is_err() || result.as_ref().is_ok_and(|r| *r == Reply::Unexpected), "{bad:?}: {result:?}");
        }
        // A line that never ends stops at the bound, not at memory's end.
        let endless = vec![b'+'; MAX_LINE_BYTES * 4];
        assert!(reader(&endless).reply(Expect::Ok).is_err());
    }

    #[test]
    fn commands_are_resp_arrays() {
        assert_eq!(command(&[b"GET", b"k"]), b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
        let slot = Slot {
            next: Next { op: Op::Scan, key: 0, scan_length: 10 },
            started: Instant::now(),
            stage: 0,
            cursor: 42,
            scanned: 3,
        };
        let mut out = Vec::new();
        encode(&slot, &mut Vec::new(), b"", &mut out);
        assert_eq!(out, b"*4\r\n$4\r\nSCAN\r\n$2\r\n42\r\n$5\r\nCOUNT\r\n$1\r\n7\r\n");
    }
}
