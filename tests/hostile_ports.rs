//! Every listening port of a running cluster under hostile input: the Redis front end, the
//! remote front end, the memnode's tcp port, the metrics endpoint and the attach socket each
//! get random bytes, truncated frames, huge length claims (up to 2^63), deep nesting, 1 MiB
//! lines, HTTP on binary ports and binary on HTTP ports, and 500 idle connections at once.
//! Afterwards the cluster must still answer a known key through every front end, and its
//! resident memory must not have grown past [`RSS_GROWTH_BOUND_KIB`].

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::Up;
use rand::{Rng, SeedableRng};

/// How much the cluster's resident memory may grow over the whole attack. Every connection
/// is bounded (Redis: ~5 MiB of input buffers at worst, while it is open; memnode and remote
/// frames: 4 MiB; HTTP: 16 KiB), and they are closed by the end, so what remains is
/// allocator slack and thread stacks touched while 500 connections were open (measured:
/// +7 MiB of a 24 MiB start).
const RSS_GROWTH_BOUND_KIB: u64 = 64 * 1024;
/// Idle connections held open per port at once.
const IDLE_CONNECTIONS: usize = 500;
/// How long a hostile connection is given to be answered or closed.
const REPLY_WAIT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug)]
enum Port {
    Tcp(&'static str, u16),
    Attach,
}

/// The attack payloads, each sent on a fresh connection to every port.
fn payloads(seed: u64) -> Vec<(&'static str, Vec<u8>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let random: Vec<u8> = (0..64 << 10).map(|_| rng.random()).collect();
    let mut wire_max = Vec::new();
    wire_max.extend_from_slice(b"RKV1");
    wire_max.extend_from_slice(&[1, 1, 0, 0]);
    wire_max.extend_from_slice(&0u64.to_le_bytes());
    wire_max.extend_from_slice(&u32::MAX.to_le_bytes());
    wire_max.extend_from_slice(&0u32.to_le_bytes());
    let mut wire_truncated = wire_max[..20].to_vec();
    wire_truncated.extend_from_slice(&64u32.to_le_bytes());
    wire_truncated.extend_from_slice(&[0, 0, 0, 0, 1, 2, 3]);
    vec![
        ("random bytes", random),
        ("resp array of 2^63-1", b"*9223372036854775807\r\n".to_vec()),
        ("resp bulk of 2^63-1", b"*1\r\n$9223372036854775807\r\n".to_vec()),
        ("resp negative length", b"*1\r\n$-9223372036854775808\r\n".to_vec()),
        ("resp nesting 100k deep", b"*1\r\n".repeat(100_000)),
        ("resp truncated", b"*3\r\n$3\r\nSET\r\n$1".to_vec()),
        ("1 MiB line", [vec![b'A'; 1 << 20], b"\r\n".to_vec()].concat()),
        ("1 MiB of zeros", vec![0u8; 1 << 20]),
        (
            "http huge content-length",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 9223372036854775807\r\n\r\n".to_vec(),
        ),
        ("http post", b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\nSET pwned 1\r\n".to_vec()),
        (
            "http chunked",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n".to_vec(),
        ),
        ("wire frame claiming 4 GiB", wire_max),
        ("wire frame truncated", wire_truncated),
        ("attach hello garbage", [b"RKVA".to_vec(), vec![0xff; 28]].concat()),
        ("tls client hello", vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]),
    ]
}

/// Connects to `port` as a plain byte stream.
fn connect(up: &Up, port: Port) -> Option<Box<dyn ReadWrite>> {
    match port {
        Port::Tcp(_, p) => TcpStream::connect(("127.0.0.1", p)).ok().map(|s| {
            s.set_read_timeout(Some(REPLY_WAIT)).unwrap();
            s.set_write_timeout(Some(REPLY_WAIT)).unwrap();
            Box::new(s) as Box<dyn ReadWrite>
        }),
        Port::Attach => UnixStream::connect(up.attach_socket()).ok().map(|s| {
            s.set_read_timeout(Some(REPLY_WAIT)).unwrap();
            s.set_write_timeout(Some(REPLY_WAIT)).unwrap();
            Box::new(s) as Box<dyn ReadWrite>
        }),
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Sends `payload` and reads whatever comes back until close or timeout (bounded).
fn attack(up: &Up, port: Port, payload: &[u8]) {
    let Some(mut stream) = connect(up, port) else {
        panic!("{port:?} refused a connection before the attack");
    };
    // A server may close mid-payload; that is a fine answer.
    let _ = stream.write_all(payload);
    let mut sink = [0u8; 64 << 10];
    let mut total = 0usize;
    while let Ok(n) = stream.read(&mut sink) {
        if n == 0 || total > 16 << 20 {
            break;
        }
        total += n;
    }
}

fn known_key_everywhere(up: &Up, when: &str) {
    assert_eq!(up.redis_cli(&["get", "canary"]), "alive", "Redis front end, {when}");
    let (ok, value, err) = up.racekv(&["get", "canary"]);
    assert!(ok && value == "alive", "attach socket, {when}: {value} {err}");
    let (ok, value, err) = up.racekv(&["get", "canary", "--remote", &format!("127.0.0.1:{}", up.remote)]);
    assert!(ok && value == "alive", "remote front end, {when}: {value} {err}");
    let (ok, value, err) = up.racekv(&["get", "canary", "--memnode", &format!("tcp:127.0.0.1:{}", up.memnode)]);
    assert!(ok && value == "alive", "memnode tcp, {when}: {value} {err}");
    assert!(metrics_page(up).is_some_and(|p| p.contains("racekv_redis_connected_clients")), "metrics, {when}");
}

fn metrics_page(up: &Up) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", up.metrics)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut page = String::new();
    s.read_to_string(&mut page).ok()?;
    page.starts_with("HTTP/1.1 200").then_some(page)
}

/// Lets the process have many descriptors (the idle connections are both ours and its).
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    assert!(soft >= 4 * IDLE_CONNECTIONS as u64, "need {} descriptors, have {soft}", 4 * IDLE_CONNECTIONS);
}

#[test]
fn every_port_survives_hostile_input_and_keeps_serving() {
    raise_fd_limit();
    let seed: u64 = std::env::var("RACEKV_HOSTILE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("hostile input seed {seed} (replay: RACEKV_HOSTILE_SEED={seed})");
    let up = Up::start(&[]);
    assert_eq!(up.redis_cli(&["set", "canary", "alive"]), "OK");
    known_key_everywhere(&up, "before");
    let rss_before = up.rss_kib();
    let ports = [
        Port::Tcp("redis", up.redis),
        Port::Tcp("remote", up.remote),
        Port::Tcp("memnode", up.memnode),
        Port::Tcp("metrics", up.metrics),
        Port::Attach,
    ];

    for (name, payload) in payloads(seed) {
        for port in ports {
            let started = Instant::now();
            attack(&up, port, &payload);
            assert!(started.elapsed() < Duration::from_secs(30), "{name} on {port:?} hung");
        }
    }
    assert_eq!(up.redis_cli(&["get", "pwned"]), "", "an HTTP POST executed a command");
    known_key_everywhere(&up, "after the payloads");

    for port in ports {
        // Slowloris: each connection sends one byte and then nothing.
        let idle: Vec<Box<dyn ReadWrite>> = (0..IDLE_CONNECTIONS)
            .filter_map(|_| {
                let mut s = connect(&up, port)?;
                let _ = s.write_all(b"*");
                Some(s)
            })
            .collect();
        assert!(idle.len() >= IDLE_CONNECTIONS / 2, "{port:?} accepted only {} connections", idle.len());
        // The front ends keep serving while they are open (the metrics endpoint caps its
        // connections and times idle ones out, so a scraper gets in within seconds).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let served = match port {
                Port::Tcp("metrics", _) => metrics_page(&up).is_some(),
                _ => up.redis_cli(&["get", "canary"]) == "alive",
            };
            if served {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{port:?} stopped serving with {IDLE_CONNECTIONS} idle connections open"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(idle);
    }
    known_key_everywhere(&up, "after the idle connections");

    let rss_after = up.rss_kib();
    eprintln!("RSS before {rss_before} KiB, after {rss_after} KiB");
    assert!(
        rss_after <= rss_before + RSS_GROWTH_BOUND_KIB,
        "resident memory grew from {rss_before} KiB to {rss_after} KiB (bound: +{RSS_GROWTH_BOUND_KIB} KiB)"
    );
    let (clean, rest) = up.stop();
    assert!(clean && rest.contains("stopped cleanly"), "{rest}");
}
