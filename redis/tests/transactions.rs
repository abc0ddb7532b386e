//! MULTI/EXEC/WATCH and the atomic multi-key commands over real RESP on TCP, against the
//! front end over MemStore and, with the same steps, against a real redis-server: every
//! reply must match byte for byte (pipelines included, so reply order too). Two
//! connections take turns, so a WATCH conflict comes from another client's write.
//!
//! redis-server must be installed (Debian package redis-server); RACEKV_SKIP_REDIS_TOOLS=1
//! skips the comparison where it is not (the racekv half still runs).

mod common;
#[path = "support/reply.rs"]
mod reply;

use std::io::{Cursor, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use racekv_redis::ServerOptions;

/// Which connection a step uses.
#[derive(Clone, Copy)]
enum Who {
    A,
    B,
}

/// The steps: each sends its commands in one write (a pipeline) and reads their replies.
fn script() -> Vec<(Who, Vec<&'static str>)> {
    use Who::{A, B};
    vec![
        (A, vec!["SET t:a 1", "MULTI", "GET t:a", "INCR t:a", "GET t:a", "EXEC", "GET t:a"]),
        (A, vec!["MULTI", "MULTI", "WATCH t:a", "SET t:b 1", "EXEC"]),
        (A, vec!["EXEC", "DISCARD", "UNWATCH"]),
        (A, vec!["MULTI", "SET t:c 1", "NOSUCHCMD x", "GET", "EXEC", "GET t:c"]),
        (A, vec!["MULTI", "SET t:d x", "INCR t:d", "APPEND t:d y", "SET t:d z NX GET", "EXEC"]),
        (A, vec!["WATCH t:w", "GET t:w"]),
        (B, vec!["SET t:w 1"]),
        (A, vec!["MULTI", "SET t:e 1", "EXEC", "GET t:e"]),
        (A, vec!["WATCH t:w", "UNWATCH"]),
        (B, vec!["SET t:w 2"]),
        (A, vec!["MULTI", "SET t:e 1", "EXEC"]),
        (A, vec!["WATCH t:w", "MULTI", "DISCARD"]),
        (B, vec!["SET t:w 3"]),
        (A, vec!["MULTI", "GET t:w", "EXEC"]),
        (A, vec!["WATCH t:x", "GET t:x"]),
        (B, vec!["GET t:x", "SET t:unrelated 1"]),
        (A, vec!["MULTI", "SET t:x 1", "EXEC"]),
        (A, vec!["RENAME t:none t:y", "RENAMENX t:none t:y", "SET t:r 1", "RENAME t:r t:r", "RENAMENX t:r t:r"]),
        (A, vec!["RENAME t:r t:s", "GET t:s", "RENAMENX t:s t:a", "RENAMENX t:s t:n", "GET t:n"]),
        (A, vec!["COPY t:n t:n", "COPY t:n t:o", "COPY t:n t:o", "COPY t:a t:o REPLACE", "GET t:o"]),
        (A, vec!["COPY t:none t:p", "COPY t:a t:o DB 0 REPLACE", "COPY t:a t:o DB x", "COPY t:a t:o BOGUS"]),
        (A, vec!["MSETNX t:m1 1 t:m2 2", "MSETNX t:m2 x t:m3 3", "MGET t:m1 t:m2 t:m3", "MSET t:m1 a t:m1 b"]),
        (A, vec!["GET t:m1", "MULTI", "MSET t:m4 1 t:m5 2", "RENAME t:m4 t:m6", "MGET t:m4 t:m5 t:m6", "EXEC"]),
        (A, vec!["HELLO 3", "WATCH t:w"]),
        (B, vec!["SET t:w 4"]),
        (A, vec!["MULTI", "EXEC", "MULTI", "PING", "EXEC"]),
    ]
}

fn encode(line: &str) -> Vec<u8> {
    let args: Vec<&str> = line.split(' ').collect();
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        out.extend_from_slice(format!("${}\r\n{arg}\r\n", arg.len()).as_bytes());
    }
    out
}

/// Whether `bytes` hold `n` complete replies.
fn complete(bytes: &[u8], n: usize) -> bool {
    let mut cursor = Cursor::new(bytes);
    (0..n).all(|_| reply::read(&mut cursor).is_ok())
}

/// Sends `lines` in one write and returns the bytes of their replies.
fn step(stream: &mut TcpStream, lines: &[&str]) -> Vec<u8> {
    let request: Vec<u8> = lines.iter().flat_map(|l| encode(l)).collect();
    stream.write_all(&request).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !complete(&got, lines.len()) {
        assert!(Instant::now() < deadline, "no complete replies to {lines:?}: {:?}", String::from_utf8_lossy(&got));
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "closed during {lines:?}");
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// Every step's reply bytes on the server at `port`.
fn run_script(port: u16) -> Vec<Vec<u8>> {
    let connect = || {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let (mut a, mut b) = (connect(), connect());
    script().iter().map(|(who, lines)| step(if matches!(who, Who::A) { &mut a } else { &mut b }, lines)).collect()
}

#[test]
fn transactions_answer_as_redis_does_byte_for_byte() {
    let (server, store) = common::start(ServerOptions::default());
    let ours = run_script(server.local_addr().port());
    // What matters most, checked on racekv whether or not redis-server is here.
    let text = |i: usize| String::from_utf8_lossy(&ours[i]).into_owned();
    assert_eq!(
        text(0),
        "+OK\r\n+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*3\r\n$1\r\n1\r\n:2\r\n$1\r\n2\r\n$1\r\n2\r\n",
        "a pipeline around MULTI/EXEC keeps its replies in order"
    );
    assert!(text(3).contains("-EXECABORT Transaction discarded because of previous errors.\r\n$-1\r\n"));
    assert_eq!(text(7), "+OK\r\n+QUEUED\r\n*-1\r\n$-1\r\n", "a WATCH conflict from another connection");
    assert!(text(25).starts_with("+OK\r\n_\r\n"), "RESP3's null for an aborted EXEC: {}", text(25));
    assert_eq!(store.peek(b"t:e"), Some(b"1".to_vec()));
    assert_eq!(store.peek(b"t:x"), Some(b"1".to_vec()), "reads by others do not break a WATCH");

    let Some(real) = common::RealRedis::start() else { return };
    let theirs = run_script(real.port);
    let mut differences = Vec::new();
    for (i, ((_, lines), (a, b))) in script().iter().zip(ours.iter().zip(&theirs)).enumerate() {
        // HELLO's map names the server and its version: only its shape could match.
        if lines[0].starts_with("HELLO") {
            continue;
        }
        if a != b {
            differences.push(format!(
                "step {i} {lines:?}\n  racekv: {:?}\n  redis:  {:?}",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(b)
            ));
        }
    }
    assert!(differences.is_empty(), "replies differ from redis-server's:\n{}", differences.join("\n"));
}
