//! Large values (up to `proto-max-bulk-len`, 512 MiB) through real TCP connections: byte-exact
//! round trips on each io model and over TLS, values trickling in, claims that never come,
//! Redis' refusal past `proto-max-bulk-len`, and the query buffer budget shared by all
//! connections (a connection past it is refused while the others keep working).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use racekv_redis::{IoModel, RedisServer, ServerOptions, TlsPort};
use racekv_transport::test_pki::TestPki;
use racekv_transport::{ClientAuth, ServerTls};

const WAIT: Duration = Duration::from_secs(10);

/// A value whose every byte depends on its position and `seed` (so a shifted or repeated
/// piece shows).
fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ seed).collect()
}

fn set_header(key: &str, len: usize) -> Vec<u8> {
    format!("*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${len}\r\n", key.len()).into_bytes()
}

fn connect(server: &RedisServer) -> TcpStream {
    let stream = common::raw(server);
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    stream
}

/// Reads one reply line (through CRLF).
fn read_line(stream: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8];
    while !line.ends_with(b"\r\n") {
        stream.read_exact(&mut byte).unwrap();
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

fn set(stream: &mut TcpStream, key: &str, value: &[u8]) {
    stream.write_all(&set_header(key, value.len())).unwrap();
    stream.write_all(value).unwrap();
    stream.write_all(b"\r\n").unwrap();
    assert_eq!(read_line(stream), "+OK\r\n", "SET {key}");
}

fn get(stream: &mut TcpStream, key: &str) -> Vec<u8> {
    stream.write_all(format!("GET {key}\r\n").as_bytes()).unwrap();
    let header = read_line(stream);
    let len: usize = header.strip_prefix('$').and_then(|h| h.trim_end().parse().ok()).expect(&header);
    let mut body = vec![0u8; len + 2];
    stream.read_exact(&mut body).unwrap();
    assert_eq!(&body[len..], b"\r\n");
    body.truncate(len);
    body
}

fn options(io: IoModel) -> ServerOptions {
    ServerOptions { io, ..ServerOptions::default() }
}

#[test]
fn values_of_1_20_and_100_mib_round_trip_byte_exact_on_each_io_model() {
    for io in [IoModel::ThreadPerConnection, IoModel::EventLoop { threads: 1 }] {
        let server = RedisServer::start("127.0.0.1:0", Arc::new(racekv_redis::MemStore::new()), options(io)).unwrap();
        let mut stream = connect(&server);
        for (mib, seed) in [(1usize, 1u8), (20, 2), (100, 3)] {
            let v = value(mib << 20, seed);
            let key = format!("big{mib}");
            set(&mut stream, &key, &v);
            assert!(get(&mut stream, &key) == v, "{io:?}: {mib} MiB value differs");
        }
        // Pipelined behind a large reply, small commands keep their order.
        stream.write_all(b"GET big1\r\nPING\r\n").unwrap();
        let header = read_line(&mut stream);
        assert_eq!(header, format!("${}\r\n", 1 << 20));
        let mut body = vec![0u8; (1 << 20) + 2];
        stream.read_exact(&mut body).unwrap();
        assert_eq!(read_line(&mut stream), "+PONG\r\n");
        common::eventually("executed commands give their budget back", || server.query_budget().used() == 0);
    }
}

#[test]
fn a_value_sent_in_pieces_with_pauses_arrives_whole() {
    let (server, store) = common::start(ServerOptions::default());
    let mut stream = connect(&server);
    stream.set_nodelay(true).unwrap();
    let v = value(3 << 20, 9);
    let mut wire = set_header("slow", v.len());
    wire.extend_from_slice(&v);
    wire.extend_from_slice(b"\r\n");
    let mut sent = 0;
    for (i, size) in [1usize, 2, 3, 5, 17, 1000, 65_536, 4096, 1 << 20, 7, 300_000].iter().cycle().enumerate() {
        let end = (sent + size).min(wire.len());
        stream.write_all(&wire[sent..end]).unwrap();
        sent = end;
        if sent == wire.len() {
            break;
        }
        if i % 3 == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert_eq!(read_line(&mut stream), "+OK\r\n");
    assert!(store.peek(b"slow") == Some(v.clone()));
    assert!(get(&mut stream, "slow") == v);
}

/// A peer claiming a 512 MiB value and sending a few bytes holds about nothing: the buffer
/// grows with what arrives, and closing gives it back.
#[test]
fn a_claimed_512_mib_value_costs_only_what_arrives() {
    let (server, store) = common::start(ServerOptions::default());
    let mut claim = connect(&server);
    claim.write_all(&set_header("claimed", 512 << 20)).unwrap();
    claim.write_all(b"only a few bytes").unwrap();
    common::eventually("the claim is being received", || server.query_budget().used() > 0);
    std::thread::sleep(Duration::from_millis(100));
    assert!(server.query_budget().used() <= 64 << 10, "{} bytes held", server.query_budget().used());
    // Others are served meanwhile.
    let mut other = connect(&server);
    set(&mut other, "small", b"v");
    drop(claim);
    common::eventually("the closed claim gives its bytes back", || server.query_budget().used() == 0);
    assert_eq!(store.peek(b"claimed"), None);
    common::eventually("the claim's connection is released", || server.stats().connected_clients() == 1);
}

#[test]
fn a_bulk_past_proto_max_bulk_len_is_refused_with_redis_words_and_closed() {
    let (server, store) = common::start(ServerOptions::default());
    let mut stream = connect(&server);
    let (reply, closed) = common::exchange(&mut stream, &set_header("k", (512 << 20) + 1), true, WAIT);
    assert_eq!(String::from_utf8_lossy(&reply), "-ERR Protocol error: invalid bulk length\r\n");
    assert!(closed);
    assert_eq!(store.peek(b"k"), None);
    let mut other = connect(&server);
    other.write_all(b"PING\r\n").unwrap();
    assert_eq!(read_line(&mut other), "+PONG\r\n");
    let mut redis = redis::Client::open(format!("redis://{}/", server.local_addr())).unwrap().get_connection().unwrap();
    let limits: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("proto-max-bulk-len")
        .arg("client-query-buffer-limit")
        .query(&mut redis)
        .unwrap();
    assert_eq!(limits, ["proto-max-bulk-len", "536870912", "client-query-buffer-limit", "1073741824"]);
}

/// Two connections under an 8 MiB budget: the one whose value cannot fit beside the other's
/// is refused and closed; the first completes; everyone else keeps working.
#[test]
fn the_query_buffer_budget_refuses_the_connection_that_would_exceed_it() {
    let budget = 8 << 20;
    let (server, store) = common::start(ServerOptions { query_buffer_budget: budget, ..ServerOptions::default() });
    let refusals = || metric("racekv_redis_query_buffer_budget_refusals_total");
    let refused_before = refusals();
    let v = value(6_000_000, 5);
    let mut first = connect(&server);
    first.write_all(&set_header("first", v.len())).unwrap();
    first.write_all(&v[..5_000_000]).unwrap();
    common::eventually("the first value is mostly received", || server.query_budget().used() >= 5_000_000);

    let mut second = connect(&server);
    let (reply, closed) = common::exchange(&mut second, &set_header("second", v.len()), true, WAIT);
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("-ERR query buffer budget exhausted"), "{reply}");
    assert!(reply.contains("8388608 bytes (query-buffer-budget)"), "{reply}");
    assert!(closed);
    assert!(refusals() > refused_before);

    let mut bystander = connect(&server);
    set(&mut bystander, "small", b"still served");

    first.write_all(&v[5_000_000..]).unwrap();
    first.write_all(b"\r\n").unwrap();
    assert_eq!(read_line(&mut first), "+OK\r\n");
    assert!(store.peek(b"first") == Some(v.clone()));
    assert_eq!(store.peek(b"second"), None);
    common::eventually("the budget is given back", || server.query_budget().used() == 0);

    // Room again; INFO and CONFIG show the budget, and CONFIG SET changes it.
    set(&mut bystander, "second", &v);
    let mut redis = redis::Client::open(format!("redis://{}/", server.local_addr())).unwrap().get_connection().unwrap();
    let info: String = redis::cmd("INFO").arg("memory").query(&mut redis).unwrap();
    assert!(info.contains("racekv_query_buffer_budget:8388608\r\n"), "{info}");
    assert!(info.contains("racekv_query_buffer_bytes:"), "{info}");
    let () = redis::cmd("CONFIG").arg("SET").arg("query-buffer-budget").arg("1mb").query(&mut redis).unwrap();
    let shown: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("query-buffer-budget").query(&mut redis).unwrap();
    assert_eq!(shown, ["query-buffer-budget", "1048576"]);
    stream_refused(&server, &set_header("third", 2 << 20));
}

/// `CONFIG SET client-query-buffer-limit` applies to connections already open.
#[test]
fn client_query_buffer_limit_is_settable() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut stream = connect(&server);
    set(&mut stream, "k", &value(3 << 20, 1));
    stream.write_all(b"CONFIG SET client-query-buffer-limit 2mb\r\n").unwrap();
    assert_eq!(read_line(&mut stream), "+OK\r\n");
    let (reply, closed) = common::exchange(&mut stream, &set_header("k", 3 << 20), true, WAIT);
    assert_eq!(String::from_utf8_lossy(&reply), "-ERR Protocol error: command larger than 2097152 bytes\r\n");
    assert!(closed);
}

/// TLS connections (a thread each) get the same limits and the same unbuffered replies.
#[test]
fn a_20_mib_value_round_trips_over_tls() {
    let pki = TestPki::new("redis-large-tls");
    let tls = ServerTls::load(pki.server_files(ClientAuth::No)).unwrap();
    let port = TlsPort { addr: "127.0.0.1:0".into(), tls };
    let (server, _store) = common::start(ServerOptions { tls: Some(port), ..ServerOptions::default() });
    let url = format!("rediss://localhost:{}/", server.tls_addr().unwrap().port());
    let ca = std::fs::read(pki.path("ca.pem")).unwrap();
    let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(ca) };
    let mut con = redis::Client::build_with_tls(url, certs).unwrap().get_connection().unwrap();
    let v = value(20 << 20, 7);
    let () = redis::cmd("SET").arg("tls-big").arg(&v).query(&mut con).unwrap();
    let back: Vec<u8> = redis::cmd("GET").arg("tls-big").query(&mut con).unwrap();
    assert!(back == v, "20 MiB over TLS differs");
}

/// A fresh connection sending `bytes` is refused by the budget.
fn stream_refused(server: &RedisServer, bytes: &[u8]) {
    let mut stream = connect(server);
    let (reply, closed) = common::exchange(&mut stream, bytes, true, WAIT);
    assert!(String::from_utf8_lossy(&reply).starts_with("-ERR query buffer budget exhausted"));
    assert!(closed);
}

/// A counter's value in the default Prometheus registry (0 before it is first counted).
fn metric(name: &str) -> u64 {
    prometheus::gather()
        .iter()
        .filter(|family| family.name() == name)
        .flat_map(|family| family.get_metric().iter().map(|m| m.get_counter().get_value() as u64))
        .sum()
}
