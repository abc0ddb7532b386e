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
//!
//! Large values (up to `proto-max-bulk-len`, 512 MiB as in Redis) are never held twice: a
//! bulk string of at least [`BIG_ARG_BYTES`] is received straight into a buffer of its own,
//! grown as its bytes arrive (never from the claimed length), and that buffer becomes the
//! argument of the [`Command`] (no copy). What partly received commands hold beyond a small
//! per-connection allowance is charged to a server-wide [`QueryBudget`], so many clients
//! sending large values at once cannot exhaust memory.

use std::sync::Arc;

use super::command::Charge;
pub use super::command::{Command, QueryBudget, ARG_OVERHEAD_BYTES};
use super::inline;
pub use super::protocol_error::ProtocolError;

/// Longest count line (`*<n>\r\n` or `$<n>\r\n`) accepted, CRLF included: a sign and 19
/// digits fit with room to spare, and a peer cannot make us scan further for a CR.
pub const MAX_COUNT_LINE_BYTES: usize = 32;

/// Limits on what one connection may make the parser hold. All sizes in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest bulk string (one argument): Redis' `proto-max-bulk-len`, 512 MiB by default
    /// as in Redis. Longer ones get Redis' `Protocol error: invalid bulk length`.
    pub max_bulk_bytes: usize,
    /// Most arguments in one array command (Redis: 1024 * 1024 for unauthenticated peers is
    /// far lower; we keep Redis' general bound, memory is bounded by `max_command_bytes`).
    pub max_array_len: usize,
    /// Longest inline command line: the bytes before its `\n`, a `\r` included (Redis: 64 KiB).
    pub max_inline_bytes: usize,
    /// Most memory one command may occupy once parsed: its argument bytes plus
    /// [`ARG_OVERHEAD_BYTES`] per argument (vector growth may add up to as much again).
    /// Checked as each argument header arrives. This is Redis' `client-query-buffer-limit`
    /// (a client past it is closed), 1 GiB by default as in Redis: a full-size bulk plus its
    /// key and other arguments. Memory across connections is bounded by the [`QueryBudget`].
    pub max_command_bytes: usize,
}

/// Redis' default `proto-max-bulk-len`.
pub const DEFAULT_MAX_BULK_BYTES: usize = 512 << 20;
/// Redis' default `client-query-buffer-limit`.
pub const DEFAULT_MAX_COMMAND_BYTES: usize = 1 << 30;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_bulk_bytes: DEFAULT_MAX_BULK_BYTES,
            max_array_len: 1 << 20,
            max_inline_bytes: 64 << 10,
            max_command_bytes: DEFAULT_MAX_COMMAND_BYTES,
        }
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

/// Bulk strings at least this long are received into a buffer of their own (Redis' 32 KiB
/// `PROTO_MBULK_BIG_ARG`); shorter ones are gathered with the rest of their command.
pub const BIG_ARG_BYTES: usize = 32 << 10;

/// Bytes of its buffers a parser holds without charging the [`QueryBudget`]: the read buffer,
/// an inline line, small commands. Only large commands are charged, and a connection that
/// holds little never touches the shared counter.
pub const UNCHARGED_BYTES: usize = 256 << 10;

/// A large argument's buffer grows by at least this much at a time (then doubles, never
/// past the claimed length), so a claim costs at most this until its bytes come.
const MIN_BIG_ARG_GROWTH: usize = 64 << 10;

/// Where the parser is within the request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Between commands.
    Idle,
    /// Inside an array: `remaining` more bulk strings to read, starting with a `$` line.
    Header { remaining: usize },
    /// Inside an array: a `$len` line was read; waiting for `len` bytes and CRLF.
    Bulk { remaining: usize, len: usize },
    /// As `Bulk`, for a large argument: its bytes go to `Parser::big_arg` as they arrive.
    BigBulk { remaining: usize, len: usize },
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
    /// The large argument being received (`State::BigBulk`).
    big_arg: Vec<u8>,
    /// Bulk strings at least this long are large ([`BIG_ARG_BYTES`]).
    big_arg_bytes: usize,
    /// Cleared commands for the next ones to reuse.
    spare: Vec<Command>,
    /// How many bytes after `pos` are known to hold no `\n` (an inline line still arriving),
    /// so a line trickling in byte by byte is scanned once, not once per byte.
    inline_scanned: usize,
    failed: Option<ProtocolError>,
    budget: Option<Arc<QueryBudget>>,
    /// What this parser holds of `budget`: [`Parser::held`] after every call.
    charge: Charge,
}

impl Parser {
    /// A parser enforcing `limits`, charging no budget.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            buf: Vec::new(),
            pos: 0,
            state: State::Idle,
            partial: Command::new(),
            big_arg: Vec::new(),
            big_arg_bytes: BIG_ARG_BYTES,
            spare: Vec::new(),
            inline_scanned: 0,
            failed: None,
            budget: None,
            charge: Charge::default(),
        }
    }

    /// A parser enforcing `limits` that charges what it holds beyond [`UNCHARGED_BYTES`] to
    /// `budget` (shared by a server's connections).
    pub fn with_budget(limits: Limits, budget: Arc<QueryBudget>) -> Self {
        Self { budget: Some(budget), ..Self::new(limits) }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Changes [`Limits::max_command_bytes`] (`CONFIG SET client-query-buffer-limit`); it
    /// applies from the next argument header on.
    pub fn set_max_command_bytes(&mut self, bytes: usize) {
        self.limits.max_command_bytes = bytes;
    }

    /// Makes bulk strings of at least `bytes` large (received into their own buffer); the
    /// default is [`BIG_ARG_BYTES`]. For tests and fuzzing: the outcome never depends on it.
    pub fn set_big_arg_bytes(&mut self, bytes: usize) {
        self.big_arg_bytes = bytes.max(1);
    }

    /// Appends bytes received from the peer (dropped once the parser has failed).
    pub fn feed(&mut self, mut bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        if let State::BigBulk { len, .. } = self.state {
            if self.pos == self.buf.len() {
                // Straight into the argument's own buffer: no copy through `buf`.
                let take = bytes.len().min(len - self.big_arg.len());
                if take > 0 {
                    if let Err(e) = self.grow_big_arg(take, len) {
                        self.fail(e);
                        return;
                    }
                    self.big_arg.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                }
            }
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
        if let Err(e) = self.account() {
            self.fail(e);
        }
    }

    /// Bytes held for the peer: unconsumed input plus the partial command.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len() - self.pos + self.partial.charged_bytes() + self.big_arg.len()
    }

    /// Bytes this parser holds charged to its budget now (0 without one).
    pub fn charged_bytes(&self) -> usize {
        self.charge.bytes
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
            self.fail(e.clone());
        }
        result
    }

    /// Stops for good: keeps `e`, drops every buffer and gives the budget back.
    fn fail(&mut self, e: ProtocolError) {
        self.failed = Some(e);
        self.partial = Command::new();
        self.spare = Vec::new();
        self.buf = Vec::new();
        self.big_arg = Vec::new();
        self.pos = 0;
        self.charge = Charge::default();
    }

    /// What the budget is charged for: buffers beyond the allowance, and large arguments.
    fn held(&self) -> usize {
        let small = self.buf.capacity() + self.partial.small_capacity();
        small.saturating_sub(UNCHARGED_BYTES) + self.partial.big_bytes + self.big_arg.capacity()
    }

    /// Brings the charge to [`Parser::held`].
    fn account(&mut self) -> Result<(), ProtocolError> {
        let target = self.held();
        match &self.budget {
            Some(budget) if target != self.charge.bytes => {
                if self.charge.set(budget, target) {
                    Ok(())
                } else {
                    Err(ProtocolError::QueryBufferBudget { limit: budget.limit() })
                }
            }
            _ => Ok(()),
        }
    }

    /// Makes room for `extra` more bytes of the large argument (of `len` bytes): the budget
    /// is charged before anything is allocated, and the buffer never outgrows `len`.
    fn grow_big_arg(&mut self, extra: usize, len: usize) -> Result<(), ProtocolError> {
        let need = self.big_arg.len() + extra;
        let cap = self.big_arg.capacity();
        if need <= cap {
            return Ok(());
        }
        let new_cap = need.max(cap.saturating_mul(2)).max(MIN_BIG_ARG_GROWTH).min(len);
        if let Some(budget) = &self.budget {
            let target = self.held() - cap + new_cap;
            if !self.charge.set(budget, target) {
                return Err(ProtocolError::QueryBufferBudget { limit: budget.limit() });
            }
        }
        self.big_arg.reserve_exact(new_cap - self.big_arg.len());
        Ok(())
    }

    /// An argument of the partial command is complete: the command, when it was the last
    /// one, carrying its share of the charge.
    fn argument_done(&mut self, remaining: usize) -> Result<Option<Command>, ProtocolError> {
        if remaining > 1 {
            self.state = State::Header { remaining: remaining - 1 };
            return self.account().map(|()| None);
        }
        self.state = State::Idle;
        let next = self.spare.pop().unwrap_or_default();
        let mut cmd = std::mem::replace(&mut self.partial, next);
        if self.budget.is_some() {
            let moved = self.charge.bytes.saturating_sub(self.held());
            cmd.charge = self.charge.split(moved);
            self.account()?;
        }
        Ok(Some(cmd))
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
                    if len >= self.big_arg_bytes {
                        // A value that cannot fit the budget now is refused before the client
                        // sends it (the charge itself is taken as its bytes arrive).
                        if let Some(budget) = self.budget.as_ref().filter(|b| !b.fits(len)) {
                            return Err(ProtocolError::QueryBufferBudget { limit: budget.limit() });
                        }
                        self.state = State::BigBulk { remaining, len };
                    } else {
                        self.state = State::Bulk { remaining, len };
                    }
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
                    match self.argument_done(remaining)? {
                        Some(cmd) => return Ok(Some(cmd)),
                        None => continue,
                    }
                }
                State::BigBulk { remaining, len } => {
                    let missing = len - self.big_arg.len();
                    if missing > 0 {
                        let take = rest.len().min(missing);
                        if take == 0 {
                            return Ok(None);
                        }
                        self.grow_big_arg(take, len)?;
                        self.big_arg.extend_from_slice(&self.buf[self.pos..self.pos + take]);
                        self.pos += take;
                        continue;
                    }
                    if rest.len() < 2 {
                        return Ok(None);
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err(ProtocolError::MissingBulkTerminator { len });
                    }
                    self.pos += 2;
                    let arg = std::mem::take(&mut self.big_arg);
                    self.partial.push_owned(arg);
                    match self.argument_done(remaining)? {
                        Some(cmd) => return Ok(Some(cmd)),
                        None => continue,
                    }
                }
            }
        }
    }

    /// Takes back an executed command, to reuse its buffers for a later one (small ones, up
    /// to [`SPARE_COMMANDS`]; others are dropped).
    pub fn recycle(&mut self, mut cmd: Command) {
        if self.spare.len() < SPARE_COMMANDS
            && cmd.big.is_empty()
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
        parse_with(Parser::new(limits), chunks)
    }

    /// As [`parse_all`], with a parser set up by the caller (budget, large-argument size).
    fn parse_with(mut parser: Parser, chunks: &[&[u8]]) -> (Vec<Command>, Option<ProtocolError>) {
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
            (
                b"*1\r\n$999999999999\r\n",
                ProtocolError::BulkTooLong { len: 999_999_999_999, max: DEFAULT_MAX_BULK_BYTES },
            ),
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

    fn set_command(key: &[u8], value: &[u8]) -> Vec<u8> {
        let mut wire = Vec::new();
        encode_command(&Command::from_args([b"SET".as_slice(), key, value]), &mut wire);
        wire
    }

    /// A large value is received into a buffer of its own, exactly its size, and that very
    /// buffer is the command's argument: no second copy, however the bytes come.
    #[test]
    fn large_arguments_are_received_once_into_their_own_buffer() {
        let value: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let wire = set_command(b"k", &value);
        let mut parser = Parser::new(Limits::default());
        let (body, crlf) = wire.split_at(wire.len() - 2);
        for piece in body.chunks(16 << 10) {
            parser.feed(piece);
            assert_eq!(parser.next_command(), Ok(None));
            assert!(parser.buf.capacity() <= 32 << 10, "bulk bytes piled up in the read buffer");
        }
        let received_at = parser.big_arg.as_ptr();
        assert_eq!(parser.big_arg.capacity(), value.len());
        parser.feed(crlf);
        let cmd = parser.next_command().unwrap().unwrap();
        assert_eq!(cmd, Command::from_args([b"SET".as_slice(), b"k", &value]));
        assert_eq!(cmd.arg(2).as_ptr(), received_at, "the argument was copied");
        assert_eq!(cmd.charged_bytes(), 3 + 1 + value.len() + 3 * ARG_OVERHEAD_BYTES);
    }

    #[test]
    fn a_claimed_512_mib_value_costs_only_what_arrives() {
        let budget = QueryBudget::new(1 << 30);
        let mut parser = Parser::with_budget(Limits::default(), Arc::clone(&budget));
        parser.feed(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$536870912\r\n0123456789");
        assert_eq!(parser.next_command(), Ok(None));
        assert!(parser.big_arg.capacity() <= MIN_BIG_ARG_GROWTH, "{}", parser.big_arg.capacity());
        assert!(budget.used() <= MIN_BIG_ARG_GROWTH, "{}", budget.used());
        assert_eq!(parser.charged_bytes(), budget.used());
        drop(parser);
        assert_eq!(budget.used(), 0, "a closed connection gives its bytes back");
    }

    #[test]
    fn the_budget_refuses_whoever_would_exceed_it_and_is_given_back() {
        let budget = QueryBudget::new(1 << 20);
        let new = || Parser::with_budget(Limits::default(), Arc::clone(&budget));
        // As a server feeds: one read at a time, each followed by parsing.
        let feed = |p: &mut Parser, bytes: &[u8]| {
            let mut last = Ok(None);
            for piece in bytes.chunks(16 << 10) {
                p.feed(piece);
                last = p.next_command();
                if !matches!(last, Ok(None)) {
                    break;
                }
            }
            last
        };
        let value = vec![b'v'; 900_000];
        let wire = set_command(b"a", &value);
        let mut a = new();
        assert_eq!(feed(&mut a, &wire[..100_000]), Ok(None));
        let held = budget.used();
        assert!((100_000..=200_000).contains(&held), "{held}");

        // Refused at its header: it cannot fit beside what A holds.
        let mut b = new();
        let refused = Err(ProtocolError::QueryBufferBudget { limit: 1 << 20 });
        assert_eq!(feed(&mut b, b"*3\r\n$3\r\nSET\r\n$1\r\nb\r\n$950000\r\n"), refused);
        assert!(refused.clone().unwrap_err().reply_text().starts_with("ERR query buffer budget exhausted"));
        assert_eq!(b.next_command(), refused, "sticky");
        assert_eq!(budget.used(), held);

        // Admitted at its header (it fit then); A completes, and its command holds its charge
        // until it has executed; C is refused as its buffer grows past the budget.
        let mut c = new();
        assert_eq!(feed(&mut c, b"*3\r\n$3\r\nSET\r\n$1\r\nc\r\n$800000\r\n"), Ok(None));
        let cmd = feed(&mut a, &wire[100_000..]).unwrap().unwrap();
        assert_eq!(cmd.arg(2), value.as_slice());
        assert_eq!(budget.used(), value.len());
        assert_eq!(a.charged_bytes(), 0);
        assert_eq!(feed(&mut c, &[b'c'; 300_000]), refused);
        assert_eq!(budget.used(), value.len(), "the refused connection gave its bytes back");

        a.recycle(cmd);
        assert_eq!(budget.used(), 0);
        let mut d = new();
        assert!(feed(&mut d, &set_command(b"d", &value)).unwrap().is_some(), "room again");
    }

    #[test]
    fn many_small_arguments_are_charged_beyond_the_allowance() {
        let budget = QueryBudget::new(UNCHARGED_BYTES);
        let mut parser = Parser::with_budget(Limits::default(), Arc::clone(&budget));
        let cmd = Command::from_args((0..200).map(|_| vec![b'x'; 10_000]));
        let mut wire = Vec::new();
        encode_command(&cmd, &mut wire);
        let mut result = Ok(None);
        for piece in wire.chunks(16 << 10) {
            parser.feed(piece);
            result = parser.next_command();
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(ProtocolError::QueryBufferBudget { limit: UNCHARGED_BYTES }));
        assert_eq!(budget.used(), 0);
        // Unlimited, the same command passes and is charged until dropped.
        budget.set_limit(0);
        let mut parser = Parser::with_budget(Limits::default(), Arc::clone(&budget));
        let (cmds, err) = {
            let mut out = Vec::new();
            for piece in wire.chunks(16 << 10) {
                parser.feed(piece);
                if let Some(c) = parser.next_command().unwrap() {
                    out.push(c);
                }
            }
            (out, None::<ProtocolError>)
        };
        assert_eq!((cmds.len(), err), (1, None));
        assert!(budget.used() > 0);
        drop(cmds);
        drop(parser);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn over_proto_max_bulk_len_is_redis_invalid_bulk_length() {
        let err = parse_one(b"*2\r\n$3\r\nSET\r\n$536870913\r\n").unwrap_err();
        assert_eq!(err, ProtocolError::BulkTooLong { len: (512 << 20) + 1, max: 512 << 20 });
        assert_eq!(err.reply_text(), "ERR Protocol error: invalid bulk length");
        let exactly = b"*2\r\n$3\r\nSET\r\n$536870912\r\n";
        assert_eq!(parse_one(exactly), Ok(None));
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

        /// Large arguments (any threshold, the budget charged) split anywhere come out
        /// whole, and every byte charged is given back once the commands are dropped.
        #[test]
        fn large_arguments_split_anywhere(
            cmds in proptest::collection::vec(
                proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..3000), 1..5)
                    .prop_map(Command::from_args),
                1..5,
            ),
            big in 1usize..2000,
            points in proptest::collection::vec(any::<usize>(), 0..40),
        ) {
            let mut wire = Vec::new();
            for c in &cmds {
                encode_command(c, &mut wire);
            }
            let chunks = split_at_points(&wire, &points);
            let budget = QueryBudget::new(0);
            let mut parser = Parser::with_budget(Limits::default(), Arc::clone(&budget));
            parser.set_big_arg_bytes(big);
            let (parsed, err) = parse_with(parser, &chunks);
            prop_assert_eq!(err, None);
            prop_assert_eq!(parsed, cmds);
            prop_assert_eq!(budget.used(), 0);
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
            // Nor does receiving arguments into buffers of their own, with a budget to charge.
            let budget = QueryBudget::new(0);
            let mut parser = Parser::with_budget(limits, Arc::clone(&budget));
            parser.set_big_arg_bytes(3);
            prop_assert_eq!(&parse_with(parser, &chunks), &whole);
            prop_assert_eq!(budget.used(), 0);
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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// A 3 MiB value split at arbitrary points (pieces from one byte to megabytes).
        #[test]
        fn a_multi_mib_value_split_anywhere(
            seed in any::<u8>(),
            points in proptest::collection::vec(any::<usize>(), 0..24),
        ) {
            let value: Vec<u8> = (0..3usize << 20).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let expected = Command::from_args([b"SET".as_slice(), b"key", &value]);
            let mut wire = Vec::new();
            encode_command(&expected, &mut wire);
            encode_command(&Command::from_args(["PING"]), &mut wire);
            let chunks = split_at_points(&wire, &points);
            let budget = QueryBudget::new(8 << 20);
            let (parsed, err) = parse_with(Parser::with_budget(Limits::default(), Arc::clone(&budget)), &chunks);
            prop_assert_eq!(err, None);
            prop_assert_eq!(parsed, vec![expected, Command::from_args(["PING"])]);
            prop_assert_eq!(budget.used(), 0);
        }
    }
}
