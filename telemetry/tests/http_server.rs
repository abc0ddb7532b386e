//! The metrics endpoint against hostile and sloppy peers, over real sockets on 127.0.0.1.
//!
//! No test depends on timing: waits have only generous upper bounds that turn a hang into a
//! failure, and limits that must expire in a test are set short through `HttpLimits`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use racekv_telemetry::{metric, render, HttpLimits, MetricsServer, ReadyFn, Routes, StatusFn};

/// Longest any read in these tests waits before the test fails (a hang, not a measurement).
const READ_BOUND: Duration = Duration::from_secs(20);

fn start() -> MetricsServer {
    MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap()
}

fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(READ_BOUND)).unwrap();
    stream
}

/// Reads until the server closes (EOF or reset). Panics if it neither answers nor closes.
fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("the server neither answered nor closed within {READ_BOUND:?}; got {out:?} so far")
            }
            Err(_) => return out, // reset: closed
        }
    }
}

/// Sends `raw` on a new connection (the server may close before taking it all) and returns
/// everything the server sent until it closed.
fn exchange(addr: SocketAddr, raw: &[u8]) -> String {
    let mut stream = connect(addr);
    let _ = stream.write_all(raw);
    String::from_utf8_lossy(&read_until_closed(&mut stream)).into_owned()
}

fn get(addr: SocketAddr, target: &str) -> String {
    exchange(addr, format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
}

fn assert_serving(addr: SocketAddr) {
    let response = get(addr, "/healthz");
    assert!(response.starts_with("HTTP/1.1 200") && response.ends_with("\r\n\r\nok\n"), "{response}");
}

/// The value of a sample line `name{labels} value` in `render()`, 0 if absent.
fn sample(series: &str) -> u64 {
    render()
        .lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn metrics_healthz_and_query_strings() {
    let counter = metric::counter("http_server_test_total", "test");
    counter.inc_by(5);
    let server = start();
    for target in ["/metrics", "/metrics?x=1", "/metrics?"] {
        let response = get(server.addr(), target);
        assert!(response.starts_with("HTTP/1.1 200"), "{target}: {response}");
        assert!(response.contains("content-type: text/plain; version=0.0.4"), "{target}: {response}");
        assert!(response.contains("\nhttp_server_test_total 5\n"), "{target}: {response}");
    }
    let response = get(server.addr(), "/healthz?probe=1");
    assert!(response.ends_with("\r\n\r\nok\n"), "{response}");
    // HTTP/1.0 without keep-alive: the server closes after the answer.
    let response = exchange(server.addr(), b"GET /metrics HTTP/1.0\r\n\r\n");
    assert!(response.starts_with("HTTP/1.") && response.contains(" 200 OK\r\n"), "{response}");
    assert!(response.contains("http_server_test_total 5"), "{response}");
}

#[test]
fn a_metrics_page_larger_than_the_buffers_arrives_whole() {
    let many = metric::counter_vec("http_server_big_total", "big", &["n"], &[]);
    for n in 0..4000 {
        many.with_label_values(&[&format!("{n:05}")]).inc();
    }
    let server = start();
    let response = get(server.addr(), "/metrics");
    let (head, body) = response.split_once("\r\n\r\n").expect("a complete head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.len() > 8 * racekv_telemetry::MAX_HEADER_BYTES, "{} bytes", body.len());
    assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
    assert!(body.contains("http_server_big_total{n=\"03999\"} 1\n"));
}

#[test]
fn unknown_paths_are_404_and_never_become_labels() {
    let server = start();
    let response = get(server.addr(), "/no-such-page-7f3a");
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    let response = get(server.addr(), "/status");
    assert!(response.starts_with("HTTP/1.1 404"), "no status function, no /status: {response}");
    let text = render();
    assert!(!text.contains("no-such-page"), "{text}");
    assert!(sample(r#"racekv_http_requests_total{code="404",path="other"}"#) >= 2, "{text}");
}

#[test]
fn status_is_served_as_json() {
    let status: StatusFn = Arc::new(|| "{\"ok\":true}".to_string());
    let server = MetricsServer::start_with_status("127.0.0.1:0".parse().unwrap(), Some(status)).unwrap();
    let response = get(server.addr(), "/status?verbose");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("content-type: application/json"), "{response}");
    assert!(response.ends_with("\r\n\r\n{\"ok\":true}"), "{response}");
}

#[test]
fn readyz_follows_the_ready_function() {
    // Without one, the endpoint serving means ready.
    let server = start();
    assert!(get(server.addr(), "/readyz").starts_with("HTTP/1.1 200"));
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = Arc::clone(&ready);
    let ready_fn: ReadyFn = Arc::new(move || {
        if flag.load(std::sync::atomic::Ordering::Relaxed) {
            Ok(())
        } else {
            Err(format!("memnode x unreachable {}", "é".repeat(5000)))
        }
    });
    let routes = Routes { status: None, ready: Some(ready_fn) };
    let server =
        MetricsServer::start_with_routes("127.0.0.1:0".parse().unwrap(), routes, HttpLimits::default()).unwrap();
    let response = get(server.addr(), "/readyz?probe");
    assert!(response.starts_with("HTTP/1.1 200") && response.ends_with("\r\n\r\nready\n"), "{response}");
    ready.store(false, std::sync::atomic::Ordering::Relaxed);
    let response = get(server.addr(), "/readyz");
    assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    let body = response.split_once("\r\n\r\n").unwrap().1;
    // The reason, cut to a bound on a character boundary.
    assert!(body.starts_with("not ready: memnode x unreachable"), "{body}");
    assert!(body.len() <= 4096 + "not ready: \n".len(), "{}", body.len());
    // Liveness is not readiness.
    assert!(get(server.addr(), "/healthz").starts_with("HTTP/1.1 200"));
    assert!(sample(r#"racekv_http_requests_total{code="503",path="/readyz"}"#) >= 1, "{}", render());
}

#[test]
fn head_answers_without_a_body_and_keeps_the_connection() {
    let server = start();
    // Two requests on one connection: if HEAD sent a body, the second answer would not
    // start right after the first one's headers.
    let response = exchange(
        server.addr(),
        b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let (first, second) = response.split_once("\r\n\r\n").expect("a complete first answer");
    assert!(first.starts_with("HTTP/1.1 200") && first.contains("content-type: text/plain"), "{response}");
    assert!(second.starts_with("HTTP/1.1 200") && second.ends_with("\r\n\r\nok\n"), "{response}");
    assert!(!response.contains("# HELP"), "HEAD must not carry the metrics: {response}");
}

#[test]
fn other_methods_are_405() {
    let server = start();
    for raw in [
        &b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"[..],
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        b"DELETE /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ] {
        let response = exchange(server.addr(), raw);
        assert!(response.starts_with("HTTP/1.1 405"), "{response}");
        assert!(response.contains("allow: GET, HEAD"), "{response}");
    }
    assert_serving(server.addr());
}

#[test]
fn huge_content_length_claims_get_413_and_the_server_keeps_serving() {
    let server = start();
    let before = sample(r#"racekv_http_connections_refused_total{reason="body"}"#);
    for (method, length) in [("GET", "99999999999999"), ("GET", "68719476736"), ("POST", "68719476736"), ("GET", "1")] {
        // Keep-alive requested: the server must close anyway, after its answer.
        let raw = format!("{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\nabc");
        let response = exchange(server.addr(), raw.as_bytes());
        assert!(response.starts_with("HTTP/1.1 413"), "{method} {length}: {response}");
        assert!(!response.contains("# HELP"), "{response}");
        assert_serving(server.addr());
    }
    let after = sample(r#"racekv_http_connections_refused_total{reason="body"}"#);
    assert!(after >= before + 4, "{before} -> {after}");
}

#[test]
fn chunked_bodies_are_refused() {
    let server = start();
    for raw in [
        &b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffff\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    ] {
        let response = exchange(server.addr(), raw);
        assert!(response.starts_with("HTTP/1.1 413") || response.starts_with("HTTP/1.1 400"), "{response}");
        assert!(!response.contains("# HELP") && !response.contains("\r\n\r\nok\n"), "{response}");
        assert_serving(server.addr());
    }
}

#[test]
fn oversized_heads_are_refused_and_the_server_keeps_serving() {
    let server = start();
    let mib = 1 << 20;
    let long_line = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(mib));
    let mut long_headers = String::from("GET /metrics HTTP/1.1\r\nHost: x\r\n");
    while long_headers.len() < mib {
        long_headers.push_str(&format!("X-Filler-{}: {}\r\n", long_headers.len(), "b".repeat(1000)));
    }
    long_headers.push_str("\r\n");
    let one_long_header = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "c".repeat(mib));
    let many_headers = format!("GET /metrics HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(racekv_telemetry::MAX_HEADERS + 1));
    for raw in [long_line, long_headers, one_long_header, many_headers] {
        let response = exchange(server.addr(), raw.as_bytes());
        // 431 (over the head limit) or a close: never an answer, never an echo of the input.
        let shown: String = response.chars().take(300).collect();
        assert!(response.is_empty() || response.starts_with("HTTP/1.1 431"), "{shown}");
        assert!(response.len() < 1024, "{shown}");
        assert_serving(server.addr());
    }
}

#[test]
fn random_bytes_get_400_or_a_close() {
    let server = start();
    // A fixed xorshift stream: reproducible garbage.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for round in 0..32 {
        let len = 1 + (next() % 4096) as usize;
        let garbage: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        let response = exchange(server.addr(), &garbage);
        assert!(
            response.is_empty() || response.starts_with("HTTP/1.1 400") || response.starts_with("HTTP/1.1 431"),
            "round {round}: {response}"
        );
    }
    assert_serving(server.addr());
}

#[test]
fn idle_and_slowloris_connections_do_not_lock_out_a_scraper() {
    let limits = HttpLimits {
        max_connections: 8,
        header_read_timeout_ms: 200,
        connection_lifetime_ms: 2_000,
        ..HttpLimits::default()
    };
    let server = MetricsServer::start_with_options("127.0.0.1:0".parse().unwrap(), None, limits).unwrap();
    let refused_before = sample(r#"racekv_http_connections_refused_total{reason="too_many_connections"}"#);
    let timeouts_before = sample(r#"racekv_http_connections_refused_total{reason="timeout"}"#);
    let mut held: Vec<TcpStream> = (0..200)
        .map(|i| {
            let mut stream = connect(server.addr());
            if i % 2 == 0 {
                let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ");
            }
            stream
        })
        .collect();
    // Every held connection ends: refused at once (over the cap) or timed out.
    for stream in &mut held {
        let answer = read_until_closed(stream);
        let answer = String::from_utf8_lossy(&answer);
        assert!(!answer.contains(" 200 "), "{answer}");
    }
    // Then a scraper gets through. It retries because held connections' slots free up only
    // as the server notices them closed; the bound only turns a lock-out into a failure.
    let mut attempts = 0;
    loop {
        let response = get(server.addr(), "/metrics");
        if response.starts_with("HTTP/1.1 200") {
            assert!(response.contains("racekv_http_connections"), "{response}");
            break;
        }
        attempts += 1;
        assert!(attempts < 400, "no scrape got through: {response}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let refused = sample(r#"racekv_http_connections_refused_total{reason="too_many_connections"}"#);
    let timeouts = sample(r#"racekv_http_connections_refused_total{reason="timeout"}"#);
    assert!(refused > refused_before, "200 connections against a cap of 8 must be refused: {refused}");
    assert!(timeouts > timeouts_before, "held half-headers must time out: {timeouts}");
}

#[test]
fn dropping_the_server_returns_with_connections_open() {
    // Limits far longer than the test's bound: drop must not wait for any of them.
    let limits =
        HttpLimits { header_read_timeout_ms: 3_600_000, connection_lifetime_ms: 3_600_000, ..HttpLimits::default() };
    let server = MetricsServer::start_with_options("127.0.0.1:0".parse().unwrap(), None, limits).unwrap();
    let addr = server.addr();
    let idle = connect(addr);
    let mut half = connect(addr);
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").unwrap();
    // A keep-alive client that got its answer and stays.
    let mut kept = connect(addr);
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut first = [0u8; 17];
    kept.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200 OK\r\n");

    let (done, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(server);
        done.send(()).unwrap();
    });
    dropped.recv_timeout(Duration::from_secs(60)).expect("dropping the server hung on open connections");
    for mut stream in [idle, half] {
        assert!(read_until_closed(&mut stream).is_empty());
    }
    let rest = read_until_closed(&mut kept);
    assert!(String::from_utf8_lossy(&rest).ends_with("\r\n\r\nok\n"), "{rest:?}");
}

#[test]
fn limits_are_validated() {
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    for limits in [
        HttpLimits { max_header_bytes: 4096, ..HttpLimits::default() },
        HttpLimits { max_connections: 0, ..HttpLimits::default() },
        HttpLimits { header_read_timeout_ms: 0, ..HttpLimits::default() },
    ] {
        assert!(MetricsServer::start_with_options(addr, None, limits).is_err(), "{limits:?}");
    }
}

#[test]
fn fuzz_entry_point_serves_and_stays_bounded() {
    let out = racekv_telemetry::serve_bytes_for_fuzzing(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let out = String::from_utf8_lossy(&out);
    assert!(out.starts_with("HTTP/1.1 200") && out.ends_with("ok\n"), "{out}");
    let out = racekv_telemetry::serve_bytes_for_fuzzing(b"GET /status HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\n\r\n");
    let out = String::from_utf8_lossy(&out);
    assert!(out.contains("{\"fuzz\":true}") && out.contains("HTTP/1.1 404"), "{out}");
    let out = racekv_telemetry::serve_bytes_for_fuzzing(b"GET / HTTP/1.1\r\nContent-Length: 99999999999999\r\n\r\n");
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 413"));
    assert!(racekv_telemetry::serve_bytes_for_fuzzing(&[0xff; 100]).len() < 1024);
}
