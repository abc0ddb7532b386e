//! Hostile input over raw TCP: each bad connection gets an error (or is closed) on its own,
//! while well-behaved clients connected at the same time keep working.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use racekv_redis::{Limits, RedisServer, ServerOptions};
use redis::cmd;

const WAIT: Duration = Duration::from_secs(10);

/// Sends `payload` on a fresh connection (half-closing after it unless `keep_open`) and
/// returns the reply text and whether the server closed the connection.
fn attack(server: &RedisServer, payload: &[u8], keep_open: bool) -> (String, bool) {
    let mut stream = common::raw(server);
    let (reply, closed) = common::exchange(&mut stream, payload, keep_open, WAIT);
    (String::from_utf8_lossy(&reply).into_owned(), closed)
}

fn protocol_error(message: &str) -> String {
    format!("-ERR Protocol error: {message}\r\n")
}

/// A client that keeps incrementing a counter on its own thread until stopped.
struct Bystander {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Bystander {
    fn start(server: &RedisServer) -> Self {
        let client = redis::Client::open(format!("redis://{}/", server.local_addr())).unwrap();
        let mut con = client.get_connection().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut done = 0u64;
            // Bounded: stops when told, or after 200k increments at most.
            while !stopping.load(Ordering::Relaxed) && done < 200_000 {
                let n: u64 = cmd("INCR").arg("bystander").query(&mut con).expect("bystander INCR");
                done += 1;
                assert_eq!(n, done);
            }
            done
        });
        Self { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("bystander failed")
    }
}

#[test]
fn hostile_connections_fail_alone() {
    let (server, store) = common::start(ServerOptions::default());
    // Connected before the attacks, used synchronously after each one.
    let mut good = redis::Client::open(format!("redis://{}/", server.local_addr())).unwrap().get_connection().unwrap();
    let bystander = Bystander::start(&server);
    let mut check = |label: &str| {
        cmd("SET").arg("good").arg(label).query::<()>(&mut good).unwrap();
        assert_eq!(cmd("GET").arg("good").query::<String>(&mut good).unwrap(), label);
    };

    let closing_cases: Vec<(&str, Vec<u8>, String)> = vec![
        ("negative array length", b"*-5\r\n".to_vec(), protocol_error("invalid multibulk length")),
        (
            "array length 2^40",
            b"*1099511627776\r\n".to_vec(),
            protocol_error("invalid multibulk length 1099511627776: more than 1048576 arguments"),
        ),
        ("array length not a number", b"*\x01\xfe garbage\r\n".to_vec(), protocol_error("invalid multibulk length")),
        ("huge bulk length", b"*1\r\n$999999999999\r\n".to_vec(), protocol_error("invalid bulk length")),
        ("negative bulk length", b"*1\r\n$-3\r\n".to_vec(), protocol_error("invalid bulk length")),
        ("not a bulk string", b"*1\r\n:1\r\n".to_vec(), protocol_error("expected '$', got ':'")),
        (
            "bad CRLF after bulk data",
            b"*1\r\n$4\r\nPINGxx".to_vec(),
            protocol_error("expected CRLF after 4 bytes of bulk data"),
        ),
        ("CR without LF", b"*1\rX".to_vec(), protocol_error("expected '\\n' after '\\r' in a count line")),
        ("unbalanced quotes", b"SET \"k v\r\n".to_vec(), protocol_error("unbalanced quotes in request")),
        (
            "count line without end",
            [b"*".as_slice(), &[b'9'; 100]].concat(),
            protocol_error("too big mbulk count string"),
        ),
        ("inline line of 1 MiB without newline", vec![b'a'; 1 << 20], protocol_error("too big inline request")),
        (
            "good commands first, then garbage",
            b"PING\r\n*1\r\n$4\r\nECHO\r\n*-5\r\nPING\r\n".to_vec(),
            format!(
                "+PONG\r\n-ERR wrong number of arguments for 'echo' command\r\n{}",
                protocol_error("invalid multibulk length")
            ),
        ),
    ];
    for (label, payload, expected) in &closing_cases {
        let (reply, closed) = attack(&server, payload, true);
        assert_eq!(&reply, expected, "{label}");
        assert!(closed, "{label}: connection left open");
        check(label);
    }
    assert_eq!(server.stats().protocol_errors(), closing_cases.len() as u64);

    // A half frame, then the client goes away: nothing to answer, the server just cleans up.
    let (reply, closed) = attack(&server, b"*2\r\n$3\r\nGET\r\n$5\r\nab", false);
    assert!(reply.is_empty() && closed, "{reply:?}");
    check("half frame");

    // A claimed 1 MiB argument that never arrives: the server waits without allocating it
    // and without disturbing anyone.
    let mut stalled = common::raw(&server);
    let (reply, closed) =
        common::exchange(&mut stalled, b"*1048576\r\n$1048576\r\nxyz", true, Duration::from_millis(300));
    assert!(reply.is_empty() && !closed);
    check("stalled claim");
    drop(stalled);

    // Pseudo-random bytes: whatever they parse as, every reply is an error.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let noise: Vec<u8> = (0..8192)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect();
    let (reply, _closed) = attack(&server, &noise, false);
    assert!(reply.split_terminator("\r\n").all(|line| line.starts_with("-ERR")), "{reply:?}");
    check("noise");

    let increments = bystander.finish();
    assert!(increments > 0);
    assert_eq!(store.peek(b"bystander"), Some(increments.to_string().into_bytes()));
    common::eventually("hostile connections are released", || server.stats().connected_clients() == 1);
}

#[test]
fn oversized_commands_are_refused_before_they_are_buffered() {
    let limits = Limits { max_command_bytes: 1024, ..Limits::default() };
    let (server, store) = common::start(ServerOptions { limits, ..ServerOptions::default() });
    let (reply, closed) = attack(&server, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2000\r\n", true);
    assert_eq!(reply, protocol_error("command larger than 1024 bytes"));
    assert!(closed);
    assert_eq!(store.peek(b"k"), None);
}

#[test]
fn pipelined_commands_get_all_replies_in_order() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut stream = common::raw(&server);
    let mut batch = Vec::new();
    let mut expected = Vec::new();
    for i in 0..1000 {
        batch.extend_from_slice(format!("SET k{i} {i}\r\n").as_bytes());
        batch.extend_from_slice(format!("*2\r\n$3\r\nGET\r\n${}\r\nk{i}\r\n", format!("k{i}").len()).as_bytes());
        expected.extend_from_slice(format!("+OK\r\n${}\r\n{i}\r\n", i.to_string().len()).as_bytes());
    }
    let (reply, closed) = common::exchange(&mut stream, &batch, false, WAIT);
    assert!(closed);
    assert_eq!(String::from_utf8_lossy(&reply), String::from_utf8_lossy(&expected));
}

/// Runs of pipelined GETs are looked up together; their replies keep their places among
/// other commands, malformed GETs, and runs longer than one lookup takes.
#[test]
fn runs_of_pipelined_gets_answer_in_place() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut stream = common::raw(&server);
    let (mut batch, mut expected) = (Vec::new(), Vec::new());
    for round in 0..5 {
        batch.extend_from_slice(format!("SET a {round}\r\n").as_bytes());
        expected.extend_from_slice(b"+OK\r\n");
        for i in 0..(37 * round + 1) {
            if i % 29 == 28 {
                batch.extend_from_slice(b"GET\r\n");
                expected.extend_from_slice(b"-ERR wrong number of arguments for 'get' command\r\n");
            }
            if i % 2 == 0 {
                batch.extend_from_slice(b"GET a\r\n");
                expected.extend_from_slice(format!("$1\r\n{round}\r\n").as_bytes());
            } else {
                batch.extend_from_slice(b"get missing\r\n");
                expected.extend_from_slice(b"$-1\r\n");
            }
        }
    }
    batch.extend_from_slice(b"QUIT\r\n");
    expected.extend_from_slice(b"+OK\r\n");
    let (reply, closed) = common::exchange(&mut stream, &batch, false, WAIT);
    assert!(closed);
    assert_eq!(String::from_utf8_lossy(&reply), String::from_utf8_lossy(&expected));
}

#[test]
fn commands_split_across_many_small_writes_are_reassembled() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut stream = common::raw(&server);
    stream.set_nodelay(true).unwrap();
    let input = b"*3\r\n$3\r\nSET\r\n$3\r\nkey\r\n$5\r\nva\r\nl\r\nGET key\r\n*1\r\n$4\r\nPING\r\n";
    for piece in input.chunks(3) {
        use std::io::Write;
        stream.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let expected = b"+OK\r\n$5\r\nva\r\nl\r\n+PONG\r\n";
    assert_eq!(common::read_exact(&mut stream, expected.len()), expected);
}

#[test]
fn quit_answers_then_closes() {
    let (server, _store) = common::start(ServerOptions::default());
    let (reply, closed) = attack(&server, b"PING\r\nQUIT\r\nPING\r\n", true);
    assert_eq!(reply, "+PONG\r\n+OK\r\n");
    assert!(closed);
}
