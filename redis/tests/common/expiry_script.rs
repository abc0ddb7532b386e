//! The expiry script the Redis front end's tests run against racekv and a real
//! redis-server, and the RESP2 client they run it with. Shared by path with the
//! computenode's tests, which run it through the RACE table (so it uses nothing else of
//! `common`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use racekv_redis::{resp, Command as RespCommand};

/// A RESP2 reply as read off the wire (errors keep their exact text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wire {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Wire>>),
}

/// One connection speaking RESP2.
pub struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Conn {
    pub fn open(port: u16) -> Self {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Self { reader: BufReader::new(stream.try_clone().unwrap()), writer: stream }
    }

    pub fn call(&mut self, args: &[&str]) -> Wire {
        let mut out = Vec::new();
        resp::encode_command(&RespCommand::from_args(args), &mut out);
        self.writer.write_all(&out).unwrap();
        self.read()
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        assert!(line.ends_with("\r\n"), "a reply line without CRLF: {line:?}");
        line.truncate(line.len() - 2);
        line
    }

    fn read(&mut self) -> Wire {
        let line = self.line();
        let (kind, rest) = line.split_at(1);
        match kind {
            "+" => Wire::Simple(rest.into()),
            "-" => Wire::Error(rest.into()),
            ":" => Wire::Int(rest.parse().unwrap()),
            "$" => match rest.parse::<i64>().unwrap() {
                -1 => Wire::Bulk(None),
                n => {
                    let mut bytes = vec![0u8; n as usize + 2];
                    std::io::Read::read_exact(&mut self.reader, &mut bytes).unwrap();
                    bytes.truncate(n as usize);
                    Wire::Bulk(Some(bytes))
                }
            },
            "*" => match rest.parse::<i64>().unwrap() {
                -1 => Wire::Array(None),
                n => Wire::Array(Some((0..n).map(|_| self.read()).collect())),
            },
            other => panic!("unexpected reply type {other:?} in {line:?}"),
        }
    }
}

/// The script: every expiry command, its options, their errors and edge cases. `{later_s}`
/// and `{later_ms}` stand for an absolute time an hour ahead (the same for both servers).
pub const SCRIPT: &[&[&str]] = &[
    // SET and its options.
    &["SET", "k", "v"],
    &["TTL", "k"],
    &["SET", "k", "v", "EX", "100"],
    &["TTL", "k"],
    &["PTTL", "k"],
    &["SET", "k", "v2", "KEEPTTL", "GET"],
    &["TTL", "k"],
    &["SET", "k", "v3", "GET"],
    &["TTL", "k"],
    &["SET", "k", "x", "NX"],
    &["SET", "k", "v4", "XX"],
    &["SET", "k2", "v", "XX"],
    &["SET", "k2", "v", "NX", "GET"],
    &["SET", "k2", "x", "NX", "GET"],
    &["SET", "k2", "y", "XX", "GET", "PX", "50000"],
    &["PTTL", "k2"],
    &["SET", "k", "v", "GET", "GET"],
    &["SET", "k", "v", "EX", "10", "EX", "20"],
    &["TTL", "k"],
    &["SET", "k", "v", "ex", "10", "px", "10"],
    &["SET", "k", "v", "KEEPTTL", "EX", "10"],
    &["SET", "k", "v", "EXAT", "10", "KEEPTTL"],
    &["SET", "k", "v", "EX"],
    &["SET", "k", "v", "NX", "XX"],
    &["SET", "k", "v", "XX", "NX"],
    &["SET", "k", "v", "PERSIST"],
    &["SET", "k", "v", "BOGUS"],
    &["SET", "k", "v", "EX", "0"],
    &["SET", "k", "v", "EX", "-1"],
    &["SET", "k", "v", "PX", "0"],
    &["SET", "k", "v", "EX", "abc"],
    &["SET", "k", "v", "EX", "0", "BOGUS"],
    &["SET", "k", "v", "EX", "9223372036854776"],
    &["SET", "k", "v", "EXAT", "9223372036854776"],
    &["SET", "k", "v", "PX", "9223372036854775807"],
    &["SET", "k", "v", "PXAT", "9223372036854775807"],
    &["PEXPIRETIME", "k"],
    &["SET", "k", "v", "EXAT", "{later_s}"],
    &["EXPIRETIME", "k"],
    &["SET", "k", "v", "PXAT", "{later_ms}"],
    &["PEXPIRETIME", "k"],
    &["SET", "gone", "v", "PXAT", "1"],
    &["GET", "gone"],
    &["EXISTS", "gone"],
    &["SET", "gone", "v", "PXAT", "1"],
    &["DEL", "gone"],
    &["SET", "gone", "v", "EXAT", "1"],
    &["SETNX", "gone", "w"],
    &["GET", "gone"],
    &["SET", "gone", "v", "PXAT", "1"],
    &["SET", "gone", "w", "XX"],
    &["SET", "gone", "w", "NX", "GET"],
    // SETEX, PSETEX.
    &["SETEX", "s", "100", "v"],
    &["TTL", "s"],
    &["SETEX", "s", "0", "v"],
    &["SETEX", "s", "-10", "v"],
    &["SETEX", "s", "abc", "v"],
    &["SETEX", "s", "10"],
    &["SETEX", "s", "9223372036854776", "v"],
    &["PSETEX", "s", "100000", "v"],
    &["PTTL", "s"],
    &["PSETEX", "s", "0", "v"],
    &["PSETEX", "s", "9223372036854775807", "v"],
    // GETEX.
    &["GETEX", "missing"],
    &["GETEX", "missing", "EX", "-1"],
    &["GETEX", "missing", "EX", "abc"],
    &["GETEX", "missing", "KEEPTTL"],
    &["SET", "g", "v"],
    &["GETEX", "g"],
    &["TTL", "g"],
    &["GETEX", "g", "EX", "200"],
    &["TTL", "g"],
    &["GETEX", "g", "PX", "300000"],
    &["PTTL", "g"],
    &["GETEX", "g", "EXAT", "{later_s}"],
    &["EXPIRETIME", "g"],
    &["GETEX", "g", "PXAT", "{later_ms}"],
    &["PEXPIRETIME", "g"],
    &["GETEX", "g", "persist"],
    &["TTL", "g"],
    &["GETEX", "g", "PERSIST"],
    &["GETEX", "g", "EX", "0"],
    &["GETEX", "g", "EX", "abc"],
    &["GETEX", "g", "EX", "10", "PERSIST"],
    &["GETEX", "g", "PERSIST", "EX", "10"],
    &["GETEX", "g", "EX", "10", "PX", "10"],
    &["GETEX", "g", "KEEPTTL"],
    &["GETEX", "g", "NX"],
    &["GETEX", "g", "GET"],
    &["GETEX", "g", "EX"],
    &["GETEX", "g", "PXAT", "1"],
    &["GET", "g"],
    &["EXISTS", "g"],
    &["GETEX"],
    // EXPIRE and friends.
    &["EXPIRE", "missing", "10"],
    &["EXPIRE", "missing", "10", "NX", "XX"],
    &["SET", "e", "v"],
    &["EXPIRE", "e", "100", "XX"],
    &["EXPIRE", "e", "100", "GT"],
    &["EXPIRE", "e", "100", "NX"],
    &["EXPIRE", "e", "200", "NX"],
    &["EXPIRE", "e", "50", "GT"],
    &["EXPIRE", "e", "200", "GT"],
    &["TTL", "e"],
    &["EXPIRE", "e", "300", "LT"],
    &["EXPIRE", "e", "150", "lt"],
    &["TTL", "e"],
    &["EXPIRE", "e", "150", "LT", "XX"],
    &["EXPIRE", "e", "100", "XX", "LT"],
    &["EXPIRE", "e", "200", "XX", "GT"],
    &["EXPIRE", "e", "10", "NX", "XX"],
    &["EXPIRE", "e", "10", "XX", "NX"],
    &["EXPIRE", "e", "10", "NX", "GT"],
    &["EXPIRE", "e", "10", "LT", "NX"],
    &["EXPIRE", "e", "10", "GT", "LT"],
    &["EXPIRE", "e", "10", "foo"],
    &["EXPIRE", "e", "10", "Foo", "NX", "XX"],
    &["EXPIRE", "e", "abc"],
    &["EXPIRE", "e", "abc", "foo"],
    &["EXPIRE", "e", "9223372036854776"],
    &["EXPIRE", "e", "-9223372036854776"],
    &["EXPIRE", "e", "9223372036854775"],
    &["PEXPIRE", "e", "9223372036854775807"],
    &["EXPIREAT", "e", "9223372036854776"],
    &["EXPIREAT", "e", "9223372036854775"],
    &["PEXPIRETIME", "e"],
    &["PEXPIREAT", "e", "{later_ms}"],
    &["PEXPIRETIME", "e"],
    &["EXPIREAT", "e", "{later_s}"],
    &["EXPIRETIME", "e"],
    &["PEXPIRE", "e", "100000"],
    &["PTTL", "e"],
    &["PERSIST", "e"],
    &["PERSIST", "e"],
    &["TTL", "e"],
    &["EXPIRE", "e", "0", "GT"],
    &["EXISTS", "e"],
    &["EXPIRE", "e", "-1"],
    &["EXISTS", "e"],
    &["SET", "e", "v"],
    &["PEXPIREAT", "e", "1"],
    &["GET", "e"],
    &["SET", "e", "v"],
    &["EXPIREAT", "e", "0"],
    &["TTL", "e"],
    &["SET", "e", "v"],
    &["EXPIRE", "e", "0", "LT"],
    &["PTTL", "e"],
    &["EXPIRETIME", "e"],
    &["PEXPIRETIME", "e"],
    &["PERSIST", "missing"],
    &["EXPIRE", "e"],
    &["PEXPIRE"],
    &["EXPIREAT", "e"],
    &["PEXPIREAT", "e"],
    &["TTL"],
    &["TTL", "a", "b"],
    &["PTTL"],
    &["EXPIRETIME"],
    &["PEXPIRETIME", "a", "b"],
    &["PERSIST"],
    &["PERSIST", "a", "b"],
    // Writes that keep or clear a TTL.
    &["SET", "n", "1", "EX", "100"],
    &["INCR", "n"],
    &["TTL", "n"],
    &["INCRBY", "n", "5"],
    &["DECR", "n"],
    &["DECRBY", "n", "2"],
    &["TTL", "n"],
    &["GET", "n"],
    &["SET", "m", "v", "EX", "100"],
    &["MSET", "m", "w"],
    &["TTL", "m"],
    &["SET", "m", "v", "EX", "100"],
    &["SET", "m", "w"],
    &["TTL", "m"],
    &["SET", "m", "v", "EX", "100"],
    &["SETNX", "m", "w"],
    &["TTL", "m"],
    &["SET", "m", "v", "EX", "100"],
    &["DEL", "m"],
    &["TTL", "m"],
];

/// Runs the script on `conn`, with the placeholders filled in.
pub fn run_script(conn: &mut Conn, later_s: u64) -> Vec<(String, Wire)> {
    let (later_s, later_ms) = (later_s.to_string(), (later_s * 1000).to_string());
    SCRIPT
        .iter()
        .map(|args| {
            let args: Vec<&str> = args
                .iter()
                .map(|a| match *a {
                    "{later_s}" => later_s.as_str(),
                    "{later_ms}" => later_ms.as_str(),
                    a => a,
                })
                .collect();
            (args.join(" "), conn.call(&args))
        })
        .collect()
}

/// Whether two replies to `command` agree: exactly, except the time left TTL and PTTL
/// report (seconds may differ by one, milliseconds by a second's worth).
pub fn agree(command: &str, ours: &Wire, theirs: &Wire) -> bool {
    let name = command.split(' ').next().unwrap_or("").to_ascii_uppercase();
    match (ours, theirs) {
        (Wire::Int(a), Wire::Int(b)) if name == "TTL" && *a >= 0 && *b >= 0 => a.abs_diff(*b) <= 1,
        (Wire::Int(a), Wire::Int(b)) if name == "PTTL" && *a >= 0 && *b >= 0 => a.abs_diff(*b) <= 1000,
        _ => ours == theirs,
    }
}

/// Runs the script against racekv on `ours` and redis-server on `theirs`; returns the
/// replies that differ, described, and racekv's replies.
pub fn compare(ours: u16, theirs: u16) -> (Vec<String>, Vec<(String, Wire)>) {
    let later_s = racekv_telemetry::clock::now_unix_ms() / 1000 + 3600;
    let ours = run_script(&mut Conn::open(ours), later_s);
    let theirs = run_script(&mut Conn::open(theirs), later_s);
    let mismatches = ours
        .iter()
        .zip(&theirs)
        .filter(|((command, a), (_, b))| !agree(command, a, b))
        .map(|((command, a), (_, b))| format!("{command}\n    racekv: {a:?}\n    redis:  {b:?}"))
        .collect();
    (mismatches, ours)
}
