//! RESP2 requests: an incremental parser over untrusted bytes, and the client-side encoders.
//!
//! Clients send either arrays of bulk strings (`*2\r\n$3\r\nGET\r\n$1\r\nk\r\n`, what every
//! client library and redis-benchmark send) or inline commands (`GET k\r\n`, what telnet and
//! hand-written `redis-cli --pipe` input send). [`Parser`] accepts bytes in arbitrary chunks and
//! yields complete [`Command`]s; how the bytes were split never changes what it yields.
//!
//! Every byte is untrusted. The parser never allocates what the peer merely claims: a length
//! header only sets how many bytes to wait for, and memory grows only as bytes really arrive.
//! Each input that could make it hold unbounded memory or CPU has an explicit limit in
//! [`Limits`]; breaking one, like any malformed input, is a [`ProtocolError`], after which the
//! parser is poisoned (the server answers `-ERR Protocol error: ...` and closes that connection).
//!
//! Deviation from Redis, on purpose: every limit is checked on the content, never on how much
//! happens to be buffered, so the outcome is the same however the input is split (Redis accepts
//! an over-long inline line if it arrives in one read).

use std::fmt;

use super::inline;

/// Longest count line (`*<n>\r\n` or `$<n>\r\n`) accepted, CRLF included: a sign and 19
/// digits fit with room to spare, and a peer cannot make us scan further for a CR.
pub const MAX_COUNT_LINE_BYTES: usize = 32;

/// What one argument costs in [`Command`] beyond its bytes (its end offset).
pub const ARG_OVERHEAD_BYTES: usize = std::mem::size_of::<usize>();

/// Limits on what one connection may make the parser hold. All sizes in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest bulk string (one argument). Redis allows 512 MiB; racekv values are a few KiB
    /// (the RACE table's KV blocks), so 1 MiB leaves room for any real value and protects memory.
    pub max_bulk_bytes: usize,
    /// Most arguments in one array command (Redis: 1024 * 1024 for unauthenticated peers is
    /// far lower; we keep Redis' general bound, memory is bounded by `max_command_bytes`).
    pub max_array_len: usize,
    /// Longest inline command line: the bytes before its `\n`, a `\r` included (Redis: 64 KiB).
    pub max_inline_bytes: usize,
    /// Most memory one command may occupy once parsed: its argument bytes plus
    /// [`ARG_OVERHEAD_BYTES`] per argument (vector growth may add up to as much again).
    /// Checked as each argument header arrives. Default 4 MiB: an MSET of about 250 values
    /// of 16 KiB, far beyond what a table of small values needs in one command.
    pub max_command_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_bulk_bytes: 1 << 20, max_array_len: 1 << 20, max_inline_bytes: 64 << 10, max_command_bytes: 4 << 20 }
    }
}

impl Limits {
    /// Upper bound on [`Parser::buffered_bytes`] for a caller that feeds at most
    /// `feed_chunk_bytes` at a time and takes every complete command before feeding again:
    /// the partial command, plus the largest unit the parser waits for whole (a bulk string
    /// with its CRLF, an inline line, a count line), plus one chunk.
    pub fn max_buffered_bytes(&self, feed_chunk_bytes: usize) -> usize {
        let largest_unit = (self.max_bulk_bytes + 2).max(self.max_inline_bytes + 1).max(MAX_COUNT_LINE_BYTES);
        self.max_command_bytes + largest_unit + feed_chunk_bytes
    }
}

/// Why the input is not a valid RESP2 request stream. Displayed without the
/// `Protocol error: ` prefix; messages follow Redis' where Redis has one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The array count is not a decimal integer, or is negative (other than -1).
    #[error("invalid multibulk length")]
    InvalidMultibulkLength,
    /// The array count exceeds [`Limits::max_array_len`].
    #[error("invalid multibulk length {len}: more than {max} arguments")]
    MultibulkTooLong { len: u64, max: usize },
    /// The bulk length is not a decimal integer, or is negative.
    #[error("invalid bulk length")]
    InvalidBulkLength,
    /// The bulk length exceeds [`Limits::max_bulk_bytes`].
    #[error("invalid bulk length {len}: more than {max} bytes")]
    BulkTooLong { len: u64, max: usize },
    /// Inside an array, an element is not a bulk string.
    #[error("expected '$', got '{}'", Printable(*.0))]
    ExpectedBulk(u8),
    /// No CRLF within [`MAX_COUNT_LINE_BYTES`] after `*`.
    #[error("too big mbulk count string")]
    MultibulkCountTooLong,
    /// No CRLF within [`MAX_COUNT_LINE_BYTES`] after `$`.
    #[error("too big bulk count string")]
    BulkCountTooLong,
    /// A count line has a CR not followed by LF.
    #[error("expected '\\n' after '\\r' in a count line")]
    MissingLineFeed,
    /// The bytes after a bulk string's data are not CRLF.
    #[error("expected CRLF after {len} bytes of bulk data")]
    MissingBulkTerminator { len: usize },
    /// An inline line longer than [`Limits::max_inline_bytes`].
    #[error("too big inline request")]
    InlineTooLong,
    /// An inline line with an unterminated quote, or a closing quote not followed by a space.
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
    /// The command would occupy more than [`Limits::max_command_bytes`].
    #[error("command larger than {max} bytes")]
    CommandTooLarge { max: usize },
}

impl ProtocolError {
    /// Stable short name, for metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            ProtocolError::InvalidMultibulkLength => "invalid_multibulk_length",
            ProtocolError::MultibulkTooLong { .. } => "multibulk_too_long",
            ProtocolError::InvalidBulkLength => "invalid_bulk_length",
            ProtocolError::BulkTooLong { .. } => "bulk_too_long",
            ProtocolError::ExpectedBulk(_) => "expected_bulk",
            ProtocolError::MultibulkCountTooLong | ProtocolError::BulkCountTooLong => "count_line_too_long",
            ProtocolError::MissingLineFeed => "missing_line_feed",
            ProtocolError::MissingBulkTerminator { .. } => "missing_bulk_terminator",
            ProtocolError::InlineTooLong => "inline_too_long",
            ProtocolError::UnbalancedQuotes => "unbalanced_quotes",
            ProtocolError::CommandTooLarge { .. } => "command_too_large",
        }
    }
}

/// Shows a byte as a character when printable, as `\xHH` otherwise (so error replies stay
/// one clean line).
struct Printable(u8);

impl fmt::Display for Printable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_ascii_graphic() || self.0 == b' ' {
            write!(f, "{}", self.0 as char)
        } else {
            write!(f, "\\x{:02x}", self.0)
        }
    }
}

/// One request: its arguments (the command name first), stored contiguously so a command
/// costs two allocations however many arguments it has.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Command {
    data: Vec<u8>,
    /// End offset of each argument in `data`.
    ends: Vec<usize>,
}

impl Command {
    /// A command with no arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A command made of `args` (for tests and clients).
    pub fn from_args<I, A>(args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: AsRef<[u8]>,
    {
        let mut cmd = Self::new();
        for arg in args {
            cmd.push(arg.as_ref());
        }
        cmd
    }

    /// Appends one argument.
    pub fn push(&mut self, arg: &[u8]) {
        self.data.extend_from_slice(arg);
        self.ends.push(self.data.len());
    }

    /// Number of arguments, the name included.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is no argument at all.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Argument `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.data[start..end])
    }

    /// Argument `i`. Panics past the end, like slice indexing.
    pub fn arg(&self, i: usize) -> &[u8] {
        self.get(i).unwrap_or_else(|| panic!("argument {i} of a {}-argument command", self.len()))
    }

    /// Every argument, in order.
    pub fn args(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        (0..self.len()).map(|i| self.arg(i))
    }

    /// The memory this command is charged for against [`Limits::max_command_bytes`].
    pub fn charged_bytes(&self) -> usize {
        self.data.len() + self.ends.len() * ARG_OVERHEAD_BYTES
    }

    fn clear(&mut self) {
        self.data.clear();
        self.ends.clear();
    }
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.args().map(String::from_utf8_lossy)).finish()
    }
}

/// Where the parser is within the request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Between commands.
    Idle,
    /// Inside an array: `remaining` more bulk strings to read, starting with a `$` line.
    Header { remaining: usize },
    /// Inside an array: a `$len` line was read; waiting for `len` bytes and CRLF.
    Bulk { remaining: usize, len: usize },
}

/// Buffers beyond this capacity are given back once empty, so one large command does not pin
/// memory for the rest of a connection's life.
const RETAINED_BUFFER_BYTES: usize = 64 << 10;
/// Executed commands kept for reuse ([`Parser::recycle`]), so a steady stream of small
/// commands allocates nothing; only small ones are kept (at most about 13 KiB per parser).
const SPARE_COMMANDS: usize = 32;
const SPARE_COMMAND_DATA_BYTES: usize = 256;
const SPARE_COMMAND_ARGS: usize = 8;

/// Incremental RESP2 request parser for one connection.
///
/// Usage: [`Parser::feed`] the bytes read from the socket, then call [`Parser::next_command`]
/// until it returns `Ok(None)` (need more bytes). After an error it keeps returning that error.
pub struct Parser {
    limits: Limits,
    /// Received bytes; `buf[pos..]` is not consumed yet.
    buf: Vec<u8>,
    pos: usize,
    state: State,
    /// The array command being assembled.
    partial: Command,
    /// Cleared commands for the next ones to reuse.
    spare: Vec<Command>,
    /// How many bytes after `pos` are known to hold no `\n` (an inline line still arriving),
    /// so a line trickling in byte by byte is scanned once, not once per byte.
    inline_scanned: usize,
    failed: Option<ProtocolError>,
}

impl Parser {
    /// A parser enforcing `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            buf: Vec::new(),
            pos: 0,
            state: State::Idle,
            partial: Command::new(),
            spare: Vec::new(),
            inline_scanned: 0,
            failed: None,
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Appends bytes received from the peer (dropped once the parser has failed).
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        if self.pos > 0 {
            // Move the unconsumed tail to the front. In the steady state the tail is a fraction
            // of one command; while a long bulk string arrives `pos` stays 0 and nothing moves.
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        if self.buf.is_empty() && self.buf.capacity() > RETAINED_BUFFER_BYTES {
            self.buf = Vec::new();
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held for the peer: unconsumed input plus the partial command.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len() - self.pos + self.partial.charged_bytes()
    }

    /// Whether the parser holds part of a command (so a peer closing now cut a request short).
    pub fn has_partial_command(&self) -> bool {
        self.state != State::Idle || self.pos < self.buf.len()
    }

    /// The next complete command, `Ok(None)` when more bytes are needed.
    ///
    /// Empty commands (`*0`, `*-1`, blank inline lines) are skipped, as Redis does.
    pub fn next_command(&mut self) -> Result<Option<Command>, ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.step();
        if let Err(e) = &result {
            self.failed = Some(e.clone());
            self.partial = Command::new();
            self.spare = Vec::new();
            self.buf = Vec::new();
            self.pos = 0;
        }
        result
    }

    fn step(&mut self) -> Result<Option<Command>, ProtocolError> {
        loop {
            let rest = &self.buf[self.pos..];
            match self.state {
                State::Idle => {
                    let Some(&first) = rest.first() else {
                        return Ok(None);
                    };
                    if first != b'*' {
                        match self.inline()? {
                            Some(cmd) if cmd.is_empty() => continue,
                            other => return Ok(other),
                        }
                    }
                    let Some((line, used)) = count_line(rest, ProtocolError::MultibulkCountTooLong)? else {
                        return Ok(None);
                    };
                    let count = parse_i64(line).ok_or(ProtocolError::InvalidMultibulkLength)?;
                    self.pos += used;
                    match count {
                        // An empty or null array carries no command; Redis skips it too.
                        -1 | 0 => continue,
                        n if n < 0 => return Err(ProtocolError::InvalidMultibulkLength),
                        n if n as u64 > self.limits.max_array_len as u64 => {
                            return Err(ProtocolError::MultibulkTooLong {
                                len: n as u64,
                                max: self.limits.max_array_len,
                            });
                        }
                        n => {
                            self.partial.clear();
                            self.state = State::Header { remaining: n as usize };
                        }
                    }
                }
                State::Header { remaining } => {
                    let Some(&first) = rest.first() else {
                        return Ok(None);
                    };
                    if first != b'$' {
                        return Err(ProtocolError::ExpectedBulk(first));
                    }
                    let Some((line, used)) = count_line(rest, ProtocolError::BulkCountTooLong)? else {
                        return Ok(None);
                    };
                    let len = parse_i64(line).ok_or(ProtocolError::InvalidBulkLength)?;
                    if len < 0 {
                        return Err(ProtocolError::InvalidBulkLength);
                    }
                    if len as u64 > self.limits.max_bulk_bytes as u64 {
                        return Err(ProtocolError::BulkTooLong { len: len as u64, max: self.limits.max_bulk_bytes });
                    }
                    let len = len as usize;
                    // Checked before the data arrives, so an oversized command is refused
                    // before it is buffered (and at the same point however it is split).
                    if self.partial.charged_bytes() + len + ARG_OVERHEAD_BYTES > self.limits.max_command_bytes {
                        return Err(ProtocolError::CommandTooLarge { max: self.limits.max_command_bytes });
                    }
                    self.pos += used;
                    self.state = State::Bulk { remaining, len };
                }
                State::Bulk { remaining, len } => {
                    if rest.len() < len + 2 {
                        return Ok(None);
                    }
                    if &rest[len..len + 2] != b"\r\n" {
                        return Err(ProtocolError::MissingBulkTerminator { len });
                    }
                    self.partial.push(&rest[..len]);
                    self.pos += len + 2;
                    if remaining == 1 {
                        self.state = State::Idle;
                        let next = self.spare.pop().unwrap_or_default();
                        return Ok(Some(std::mem::replace(&mut self.partial, next)));
                    }
                    self.state = State::Header { remaining: remaining - 1 };
                }
            }
        }
    }

    /// Takes back an executed command, to reuse its buffers for a later one (small ones, up
    /// to [`SPARE_COMMANDS`]; others are dropped).
    pub fn recycle(&mut self, mut cmd: Command) {
        if self.spare.len() < SPARE_COMMANDS
            && cmd.data.capacity() <= SPARE_COMMAND_DATA_BYTES
            && cmd.ends.capacity() <= SPARE_COMMAND_ARGS
        {
            cmd.clear();
            self.spare.push(cmd);
        }
    }

    /// Parses one inline line at `pos`; an empty command for a blank line.
    fn inline(&mut self) -> Result<Option<Command>, ProtocolError> {
        let rest = &self.buf[self.pos..];
        let window = &rest[..rest.len().min(self.limits.max_inline_bytes + 1)];
        let start = self.inline_scanned.min(window.len());
        let Some(newline) = window[start..].iter().position(|&b| b == b'\n').map(|i| start + i) else {
            if rest.len() > self.limits.max_inline_bytes {
                return Err(ProtocolError::InlineTooLong);
            }
            self.inline_scanned = window.len();
            return Ok(None);
        };
        self.inline_scanned = 0;
        let mut line = &rest[..newline];
        if let Some(stripped) = line.strip_suffix(b"\r") {
            line = stripped;
        }
        let cmd = inline::split_args(line, self.limits.max_command_bytes)?;
        self.pos += newline + 1;
        Ok(Some(cmd))
    }
}

/// Finds the CRLF ending a count line that starts at `rest[0]` (`*` or `$`). Returns the
/// digits and the bytes used including CRLF, or `None` when the line is not complete yet.
fn count_line(rest: &[u8], too_long: ProtocolError) -> Result<Option<(&[u8], usize)>, ProtocolError> {
    let window = &rest[..rest.len().min(MAX_COUNT_LINE_BYTES)];
    match window.iter().position(|&b| b == b'\r') {
        // Decided on the content alone (where the CR is), never on how much has arrived.
        Some(cr) if cr + 2 > MAX_COUNT_LINE_BYTES => Err(too_long),
        Some(cr) => match rest.get(cr + 1) {
            None => Ok(None),
            Some(b'\n') => Ok(Some((&rest[1..cr], cr + 2))),
            Some(_) => Err(ProtocolError::MissingLineFeed),
        },
        None if rest.len() >= MAX_COUNT_LINE_BYTES => Err(too_long),
        None => Ok(None),
    }
}

/// Parses a canonical decimal `i64` the way Redis' `string2ll` does: an optional `-`, digits,
/// no leading zeros, no `+`, no spaces, no overflow. `None` otherwise.
pub fn parse_i64(bytes: &[u8]) -> Option<i64> {
    let (negative, digits) = match bytes.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, bytes),
    };
    match digits {
        [] => return None,
        [b'0'] if !negative => return Some(0),
        [b'0', ..] => return None,
        _ => {}
    }
    // Accumulate negatively so i64::MIN parses without overflow.
    let mut value: i64 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_sub(i64::from(b - b'0'))?;
    }
    if negative {
        Some(value)
    } else {
        value.checked_neg()
    }
}

/// Appends `cmd` as an array of bulk strings (what client libraries send).
pub fn encode_command(cmd: &Command, out: &mut Vec<u8>) {
    out.push(b'*');
    out.extend_from_slice(cmd.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for arg in cmd.args() {
        out.push(b'$');
        out.extend_from_slice(arg.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// Appends `cmd` as an inline line, every argument double-quoted and escaped so that any
/// bytes survive (what a person would type into telnet, made unambiguous).
pub fn encode_inline(cmd: &Command, out: &mut Vec<u8>) {
    inline::encode(cmd, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every command parsed, each handed back to the parser for reuse as a server does.
    fn parse_all(limits: Limits, chunks: &[&[u8]]) -> (Vec<Command>, Option<ProtocolError>) {
        let mut parser = Parser::new(limits);
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk);
            loop {
                match parser.next_command() {
                    Ok(Some(cmd)) => {
                        out.push(cmd.clone());
                        parser.recycle(cmd);
                    }
                    Ok(None) => break,
                    Err(e) => return (out, Some(e)),
                }
            }
        }
        (out, None)
    }

    fn parse_one(input: &[u8]) -> Result<Option<Command>, ProtocolError> {
        let mut parser = Parser::new(Limits::default());
        parser.feed(input);
        parser.next_command()
    }

    fn cmd(args: &[&str]) -> Command {
        Command::from_args(args)
    }

    #[test]
    fn parses_arrays_and_inline_commands() {
        assert_eq!(parse_one(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"), Ok(Some(cmd(&["GET", "k"]))));
        assert_eq!(parse_one(b"*1\r\n$0\r\n\r\n"), Ok(Some(cmd(&[""]))));
        assert_eq!(parse_one(b"SET k  \"a b\"\r\n"), Ok(Some(cmd(&["SET", "k", "a b"]))));
        assert_eq!(parse_one(b"PING\n"), Ok(Some(cmd(&["PING"]))));
        assert_eq!(parse_one(b"*2\r\n$3\r\nGET\r\n$1\r\n"), Ok(None));
    }

    #[test]
    fn skips_empty_commands_like_redis() {
        let (cmds, err) = parse_all(Limits::default(), &[b"*0\r\n*-1\r\n\r\n   \r\n*1\r\n$4\r\nPING\r\n"]);
        assert_eq!(err, None);
        assert_eq!(cmds, vec![cmd(&["PING"])]);
    }

    #[test]
    fn binary_data_passes_through_bulk_strings() {
        let mut value = vec![0u8, b'\r', b'\n', 0xff, b'*', b'$'];
        value.extend_from_slice(b"\r\n");
        let c = Command::from_args([b"SET".as_slice(), b"k", &value]);
        let mut wire = Vec::new();
        encode_command(&c, &mut wire);
        assert_eq!(parse_one(&wire), Ok(Some(c)));
    }

    #[test]
    fn malformed_counts_are_errors_with_redis_messages() {
        let cases: &[(&[u8], ProtocolError)] = &[
            (b"*-5\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*abc\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*+1\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*01\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*99999999999999999999\r\n", ProtocolError::InvalidMultibulkLength),
            (b"*1099511627776\r\n", ProtocolError::MultibulkTooLong { len: 1 << 40, max: 1 << 20 }),
            (b"*1\r\n$-1\r\n", ProtocolError::InvalidBulkLength),
            (b"*1\r\n$x\r\n", ProtocolError::InvalidBulkLength),
            (b"*1\r\n$999999999999\r\n", ProtocolError::BulkTooLong { len: 999_999_999_999, max: 1 << 20 }),
            (b"*1\r\n:5\r\n", ProtocolError::ExpectedBulk(b':')),
            (b"*1\r\n$1\r\nab\r\n", ProtocolError::MissingBulkTerminator { len: 1 }),
            (b"*1\rX", ProtocolError::MissingLineFeed),
            (b"GET \"k\r\n", ProtocolError::UnbalancedQuotes),
            (b"GET \"k\"x\r\n", ProtocolError::UnbalancedQuotes),
        ];
        for (input, expected) in cases {
            assert_eq!(parse_one(input).as_ref(), Err(expected), "input {:?}", String::from_utf8_lossy(input));
        }
        assert_eq!(ProtocolError::ExpectedBulk(0).to_string(), "expected '$', got '\\x00'");
        assert_eq!(ProtocolError::InvalidBulkLength.to_string(), "invalid bulk length");
    }

    #[test]
    fn count_lines_are_bounded_without_waiting_for_crlf() {
        let long = [b"*".as_slice(), &[b'1'; MAX_COUNT_LINE_BYTES]].concat();
        assert_eq!(parse_one(&long), Err(ProtocolError::MultibulkCountTooLong));
        let long = [b"*1\r\n$".as_slice(), &[b'1'; MAX_COUNT_LINE_BYTES]].concat();
        assert_eq!(parse_one(&long), Err(ProtocolError::BulkCountTooLong));
        // Shorter than the bound: just incomplete.
        assert_eq!(parse_one(b"*1\r\n$1234"), Ok(None));
    }

    #[test]
    fn inline_lines_are_bounded_by_content_not_by_buffering() {
        let limits = Limits { max_inline_bytes: 16, ..Limits::default() };
        let line = [b"ECHO ".as_slice(), &[b'a'; 10], b"\r\n"].concat(); // 16 bytes (CR included) + LF
        assert_eq!(parse_all(limits, &[&line]).0.len(), 1);
        let line = [b"ECHO ".as_slice(), &[b'a'; 12], b"\n"].concat(); // 17 bytes
        assert_eq!(parse_all(limits, &[&line]).1, Some(ProtocolError::InlineTooLong));
        // Without a newline, refused as soon as the bound is passed.
        assert_eq!(parse_all(limits, &[&[b'x'; 17]]).1, Some(ProtocolError::InlineTooLong));
        assert_eq!(parse_all(limits, &[&[b'x'; 16]]), (vec![], None));
    }

    #[test]
    fn command_size_is_checked_before_the_data_arrives() {
        let limits = Limits { max_command_bytes: 100, ..Limits::default() };
        // 3 args: 3 + 8, 50 + 8, then a 40-byte header: 69 + 48 > 100.
        let head = b"*3\r\n$3\r\nSET\r\n$50\r\n";
        let mut input = head.to_vec();
        input.extend_from_slice(&[b'k'; 50]);
        input.extend_from_slice(b"\r\n$40\r\n");
        assert_eq!(parse_all(limits, &[&input]).1, Some(ProtocolError::CommandTooLarge { max: 100 }));
    }

    #[test]
    fn errors_are_sticky() {
        let mut parser = Parser::new(Limits::default());
        parser.feed(b"*x\r\n*1\r\n$4\r\nPING\r\n");
        assert!(parser.next_command().is_err());
        assert!(parser.next_command().is_err());
    }

    #[test]
    fn a_claimed_length_allocates_nothing() {
        let mut parser = Parser::new(Limits::default());
        parser.feed(b"*1048576\r\n$1048576\r\n");
        assert_eq!(parser.next_command(), Ok(None));
        assert!(parser.buffered_bytes() < 64, "{}", parser.buffered_bytes());
        assert!(parser.has_partial_command());
    }

    #[test]
    fn parse_i64_is_strict() {
        assert_eq!(parse_i64(b"0"), Some(0));
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        for bad in [&b"9223372036854775808"[..], b"-", b"", b"-0", b"007", b" 1", b"1 ", b"+1", b"1e3"] {
            assert_eq!(parse_i64(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    fn arb_command() -> impl Strategy<Value = Command> {
        proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..8).prop_map(Command::from_args)
    }

    /// Cuts `bytes` at the given fractions (sorted, deduplicated).
    fn split_at_points<'a>(bytes: &'a [u8], points: &[usize]) -> Vec<&'a [u8]> {
        let mut cuts: Vec<usize> = points.iter().map(|p| p % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            chunks.push(&bytes[start..cut]);
            start = cut;
        }
        chunks
    }

    proptest! {
        #[test]
        fn array_encoding_round_trips(cmds in proptest::collection::vec(arb_command(), 1..8)) {
            let mut wire = Vec::new();
            for c in &cmds {
                encode_command(c, &mut wire);
            }
            prop_assert_eq!(parse_all(Limits::default(), &[&wire]), (cmds, None));
        }

        #[test]
        fn inline_encoding_round_trips(cmds in proptest::collection::vec(arb_command(), 1..8)) {
            let mut wire = Vec::new();
            for c in &cmds {
                encode_inline(c, &mut wire);
            }
            prop_assert_eq!(parse_all(Limits::default(), &[&wire]), (cmds, None));
        }

        /// Feeding the same bytes in arbitrary chunks yields the same commands.
        #[test]
        fn split_points_do_not_matter(
            cmds in proptest::collection::vec((arb_command(), any::<bool>()), 1..8),
            points in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut wire = Vec::new();
            for (c, inline) in &cmds {
                if *inline { encode_inline(c, &mut wire) } else { encode_command(c, &mut wire) }
            }
            let chunks = split_at_points(&wire, &points);
            let expected: Vec<Command> = cmds.into_iter().map(|(c, _)| c).collect();
            prop_assert_eq!(parse_all(Limits::default(), &chunks), (expected, None));
        }

        /// Arbitrary bytes never panic, and split points never change the outcome, even
        /// with small limits that make every limit reachable.
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(
                prop_oneof![any::<u8>(), Just(b'\r'), Just(b'\n'), Just(b'*'), Just(b'$'), Just(b'"'), b'0'..=b'9'],
                0..300,
            ),
            points in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let limits = Limits { max_bulk_bytes: 20, max_array_len: 5, max_inline_bytes: 24, max_command_bytes: 64 };
            let whole = parse_all(limits, &[&bytes]);
            let chunks = split_at_points(&bytes, &points);
            let split = parse_all(limits, &chunks);
            prop_assert_eq!(&whole.0, &split.0);
            // The chunked run may stop earlier only by finding the same error sooner.
            prop_assert_eq!(&whole.1, &split.1);
        }

        /// With whole commands drained after each feed, memory stays under the documented bound.
        #[test]
        fn buffered_bytes_stay_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..2000), chunk in 1usize..64) {
            let limits = Limits { max_bulk_bytes: 40, max_array_len: 8, max_inline_bytes: 50, max_command_bytes: 120 };
            let mut parser = Parser::new(limits);
            for piece in bytes.chunks(chunk) {
                parser.feed(piece);
                prop_assert!(parser.buffered_bytes() <= limits.max_buffered_bytes(chunk));
                let failed = loop {
                    match parser.next_command() {
                        Ok(Some(_)) => {}
                        Ok(None) => break false,
                        Err(_) => break true,
                    }
                };
                prop_assert!(parser.buffered_bytes() <= limits.max_buffered_bytes(chunk));
                if failed {
                    prop_assert_eq!(parser.buffered_bytes(), 0);
                    break;
                }
            }
        }
    }
}
