//! The software NIC against hostile or broken peers: each bad frame costs only its own
//! connection; the server keeps serving everyone else and the region is untouched.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use racekv_transport::tcp::TcpConnection;
use racekv_transport::wire::{self, Kind, HEADER_BYTES};
use racekv_transport::{
    Batch, ConnectOptions, Connection, Endpoint, NoRpc, OpError, Region, RegionServer, ServerOptions, TransportError,
};

const TOKEN: &str = "hostile-test";
const REGION: u64 = 64 * 1024;

fn server() -> (RegionServer, String, Arc<Region>) {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let options = ServerOptions { token: TOKEN.into(), io_timeout: Duration::from_millis(500), ..Default::default() };
    let server = RegionServer::start(
        Arc::clone(&region),
        None,
        Arc::new(NoRpc),
        options,
        &[Endpoint::Tcp("127.0.0.1:0".into())],
    )
    .unwrap();
    let Endpoint::Tcp(addr) = server.endpoints()[0].clone() else { unreachable!() };
    (server, addr, region)
}

fn good_client(addr: &str) -> TcpConnection {
    TcpConnection::connect(addr, &ConnectOptions::new(TOKEN, Duration::from_secs(2))).unwrap()
}

fn raw(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s
}

/// Reads until the server closes; returns the kind of the first frame it sent, if any.
fn response_kind(stream: &mut TcpStream) -> Option<Kind> {
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    if all.len() < HEADER_BYTES {
        return None;
    }
    wire::decode_header(all[..HEADER_BYTES].try_into().unwrap()).ok().map(|h| h.kind)
}

fn hello_frame() -> Vec<u8> {
    let mut out = Vec::new();
    wire::encode_hello(&mut out, &[7; wire::NONCE_BYTES], None);
    out
}

/// A raw connection that passed the handshake and read HelloOk.
fn authenticated_raw(addr: &str) -> TcpStream {
    let mut s = raw(addr);
    racekv_transport::auth::connect(&mut s, TOKEN, None, Duration::from_secs(2), addr).unwrap();
    let mut ok = vec![0u8; HEADER_BYTES + 24];
    s.read_exact(&mut ok).unwrap();
    assert_eq!(wire::decode_header(ok[..HEADER_BYTES].try_into().unwrap()).unwrap().kind, Kind::HelloOk);
    s
}

fn assert_still_serving(addr: &str, region: &Region) {
    let client = good_client(addr);
    let mut b = Batch::new();
    b.write(8, b"survived");
    let r = b.read(8, 8);
    client.execute(&mut b).unwrap();
    assert_eq!(b.read_result(r).unwrap(), b"survived");
    let mut check = [0u8; 8];
    region.read(8, &mut check).unwrap();
    assert_eq!(&check, b"survived");
}

#[test]
fn garbage_gets_an_error_and_a_close() {
    let (_server, addr, region) = server();
    let mut s = raw(&addr);
    s.write_all(&[0x5A; 100]).unwrap();
    assert_eq!(response_kind(&mut s), Some(Kind::Error));
    assert_still_serving(&addr, &region);
}

#[test]
fn oversized_body_claim_is_refused_without_allocating() {
    let (_server, addr, region) = server();
    let mut s = authenticated_raw(&addr);
    let mut frame = Vec::new();
    wire::put_header(&mut frame, Kind::Batch, 1, 0);
    frame[16..20].copy_from_slice(&(1u32 << 31).to_le_bytes());
    s.write_all(&frame).unwrap();
    assert_eq!(response_kind(&mut s), Some(Kind::Error));
    // Before the handshake even a legal batch size is too much to buffer.
    let mut s = raw(&addr);
    frame.clear();
    wire::put_header(&mut frame, Kind::Hello, 0, 0);
    frame[16..20].copy_from_slice(&(1u32 << 20).to_le_bytes());
    s.write_all(&frame).unwrap();
    assert_eq!(response_kind(&mut s), Some(Kind::Error));
    assert_still_serving(&addr, &region);
}

#[test]
fn half_frame_then_silence_times_out_only_that_connection() {
    let (_server, addr, region) = server();
    let mut s = raw(&addr);
    let frame = hello_frame();
    s.write_all(&frame[..10]).unwrap();
    // The rest never comes; meanwhile others are served.
    assert_still_serving(&addr, &region);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest); // the server gives up after its I/O timeout and closes
    assert_still_serving(&addr, &region);
}

#[test]
fn wrong_token_is_refused() {
    let (_server, addr, region) = server();
    // Both sides check: a real client with another token finds the server cannot prove its
    // token and stops there.
    let err = TcpConnection::connect(&addr, &ConnectOptions::new("guess", Duration::from_secs(2)));
    assert!(matches!(err, Err(TransportError::ServerNotAuthenticated { .. })), "{:?}", err.err());
    assert_still_serving(&addr, &region);
}

#[test]
fn batch_before_the_handshake_is_refused() {
    let (_server, addr, region) = server();
    let mut b = Batch::new();
    b.write(0, b"sneaky!!");
    let mut batch = Vec::new();
    wire::encode_batch(&mut batch, 1, &b);
    // First frame, and between Hello and Proof.
    for prefix in [Vec::new(), hello_frame()] {
        let mut s = raw(&addr);
        s.write_all(&prefix).unwrap();
        s.write_all(&batch).unwrap();
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        let last = last_frame(&all);
        assert_eq!(last.0, Kind::Error);
        assert_eq!(wire::decode_error(&last.1).unwrap().0, wire::error_code::AUTH);
    }
    let mut check = [0u8; 8];
    region.read(0, &mut check).unwrap();
    assert_eq!(check, [0; 8], "an unauthenticated write reached the region");
    assert_still_serving(&addr, &region);
}

/// Every whole frame in `bytes`, in order: kind, request id, body.
fn frames(bytes: &[u8]) -> Vec<(Kind, u64, Vec<u8>)> {
    let mut at = 0;
    let mut all = Vec::new();
    while bytes.len() >= at + HEADER_BYTES {
        let h = wire::decode_header(bytes[at..at + HEADER_BYTES].try_into().unwrap()).unwrap();
        let end = at + HEADER_BYTES + h.body_len as usize;
        all.push((h.kind, h.request_id, bytes[at + HEADER_BYTES..end].to_vec()));
        at = end;
    }
    assert_eq!(at, bytes.len(), "a torn frame at the end");
    all
}

/// The last whole frame in `bytes`: its kind and body.
fn last_frame(bytes: &[u8]) -> (Kind, Vec<u8>) {
    let (kind, _, body) = frames(bytes).pop().expect("at least one frame");
    (kind, body)
}

#[test]
fn truncated_batch_bodies_are_refused() {
    let (_server, addr, region) = server();
    let mut b = Batch::new();
    b.write(0, &[9; 64]);
    b.cas(64, 0, 1);
    let mut frame = Vec::new();
    wire::encode_batch(&mut frame, 7, &b);
    // Claim fewer body bytes than the ops need: the body decodes short.
    let body_len = (frame.len() - HEADER_BYTES - 10) as u32;
    frame[16..20].copy_from_slice(&body_len.to_le_bytes());
    frame.truncate(frame.len() - 10);
    let mut s = authenticated_raw(&addr);
    s.write_all(&frame).unwrap();
    assert_eq!(response_kind(&mut s), Some(Kind::Error));
    let mut check = [0u8; 8];
    region.read(64, &mut check).unwrap();
    assert_eq!(check, [0; 8]);
    assert_still_serving(&addr, &region);
}

#[test]
fn the_server_checks_bounds_itself() {
    let (_server, addr, region) = server();
    let client = good_client(&addr);
    let mut b = Batch::new();
    b.write(0, b"first op");
    b.read(REGION - 4, 8);
    b.faa(16, 5);
    // Skip the client-side checks: the server must catch it.
    match client.execute_unchecked(&mut b) {
        Err(TransportError::Op { index: 1, error: OpError::OutOfBounds { .. } }) => {}
        other => panic!("expected an out-of-bounds failure at op 1, got {other:?}"),
    }
    let mut b2 = Batch::new();
    b2.cas(13, 0, 1);
    assert!(matches!(
        client.execute_unchecked(&mut b2),
        Err(TransportError::Op { index: 0, error: OpError::Misaligned { .. } })
    ));
    assert!(client.is_healthy());
    let mut word = [0u8; 8];
    region.read(16, &mut word).unwrap();
    assert_eq!(word, [0; 8], "an op after the failing one ran");
    assert_still_serving(&addr, &region);
}

#[test]
fn connection_limit_refuses_extra_clients() {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let options = ServerOptions { token: TOKEN.into(), max_connections: 2, ..Default::default() };
    let server =
        RegionServer::start(region, None, Arc::new(NoRpc), options, &[Endpoint::Tcp("127.0.0.1:0".into())]).unwrap();
    let Endpoint::Tcp(addr) = server.endpoints()[0].clone() else { unreachable!() };
    let _a = good_client(&addr);
    let _b = good_client(&addr);
    std::thread::sleep(Duration::from_millis(50));
    let third = TcpConnection::connect(&addr, &ConnectOptions::new(TOKEN, Duration::from_secs(2)));
    assert!(third.is_err(), "a third connection was accepted over the limit of 2");
}

#[test]
fn rpc_only_servers_answer_rpcs_and_refuse_batches() {
    use racekv_transport::conformance::{rpc, TestRpc};
    let options = ServerOptions { token: TOKEN.into(), ..Default::default() };
    let server =
        RegionServer::serve_rpc(Arc::new(TestRpc), options.clone(), &[Endpoint::Tcp("127.0.0.1:0".into())]).unwrap();
    let conn =
        racekv_transport::connect(&server.endpoints()[0], &ConnectOptions::new(TOKEN, Duration::from_secs(2))).unwrap();
    assert_eq!(conn.region_len(), 0);
    assert_eq!(conn.call(rpc::ECHO, b"hello").unwrap(), b"hello");
    let mut b = Batch::new();
    b.read(0, 8);
    assert!(conn.execute(&mut b).is_err(), "an RPC-only server has no region to read");
    // Only tcp endpoints make sense for it.
    let dir = tempfile::tempdir().unwrap();
    assert!(RegionServer::serve_rpc(Arc::new(TestRpc), options, &[Endpoint::Shm(dir.path().join("x.sock"))]).is_err());
}

#[test]
fn a_connection_that_never_says_hello_is_closed_after_the_io_timeout() {
    let (_server, addr, region) = server();
    let mut silent = raw(&addr);
    assert_eq!(response_kind(&mut silent), Some(Kind::Error), "refused with an error frame, then closed");
    assert_still_serving(&addr, &region);
}

/// Connection threads block in reads bounded only by the I/O timeout (no wake-ups while
/// idle); shutdown must not wait that out: it closes their sockets.
#[test]
fn shutdown_does_not_wait_for_idle_connections() {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let options = ServerOptions { token: TOKEN.into(), io_timeout: Duration::from_secs(600), ..Default::default() };
    let tcp = Endpoint::Tcp("127.0.0.1:0".into());
    let mut server = RegionServer::start(region, None, Arc::new(NoRpc), options, &[tcp]).unwrap();
    let Endpoint::Tcp(addr) = server.endpoints()[0].clone() else { unreachable!() };
    let idle_client = good_client(&addr);
    let _silent = raw(&addr);
    let mut half = raw(&addr);
    half.write_all(&hello_frame()[..10]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let (done, stopped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        server.shutdown();
        done.send(()).unwrap();
    });
    // A hang, not a speed limit: the connections' reads would wait 600 s.
    stopped.recv_timeout(Duration::from_secs(60)).expect("shutdown waited for idle connections");
    let mut b = Batch::new();
    b.read(0, 8);
    assert!(idle_client.execute(&mut b).is_err(), "the idle client's connection was closed");
}

#[test]
fn batches_sent_together_are_all_answered_in_order_before_a_bad_frame_is_refused() {
    let (_server, addr, region) = server();
    let mut s = authenticated_raw(&addr);
    // Ten batches in one write (the server reads them in one go and answers them together),
    // each adding to a counter, then a whole frame whose batch does not decode.
    let mut out = Vec::new();
    for id in 1..=10u64 {
        let mut b = Batch::new();
        b.faa(64, id);
        wire::encode_batch(&mut out, id, &b);
    }
    let mut bad = Batch::new();
    bad.faa(64, 1000);
    let start = out.len();
    wire::encode_batch(&mut out, 11, &bad);
    let body_len = (out.len() - start - HEADER_BYTES - 4) as u32;
    out[start + 16..start + 20].copy_from_slice(&body_len.to_le_bytes());
    out.truncate(out.len() - 4);
    s.write_all(&out).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let answers = frames(&all);
    assert_eq!(answers.len(), 11, "ten answers and a refusal: {answers:?}");
    let mut sum = 0;
    for (i, (kind, id, body)) in answers[..10].iter().enumerate() {
        assert_eq!((*kind, *id), (Kind::BatchResult, i as u64 + 1));
        let mut b = Batch::new();
        let faa = b.faa(64, 0);
        wire::decode_batch_result(body, &mut b, REGION).unwrap();
        // Each fetch-and-add saw all those before it, in the order sent.
        assert_eq!(b.result(faa).unwrap(), sum);
        sum += *id;
    }
    assert_eq!(answers[10].0, Kind::Error);
    let mut word = [0u8; 8];
    region.read(64, &mut word).unwrap();
    assert_eq!(u64::from_le_bytes(word), 55);
    assert_still_serving(&addr, &region);
}

#[test]
fn frames_sent_behind_a_flock_open_before_its_answer_are_refused() {
    let (_server, addr, region) = server();
    let mut s = authenticated_raw(&addr);
    let mut out = Vec::new();
    wire::encode_flock_open(&mut out, &wire::FlockOpen { sender: 1, lane: 0, verbs: None });
    let mut b = Batch::new();
    b.write(0, &[1; 8]);
    wire::encode_batch(&mut out, 2, &b);
    s.write_all(&out).unwrap();
    assert_eq!(response_kind(&mut s), Some(Kind::Error));
    let mut check = [0u8; 8];
    region.read(0, &mut check).unwrap();
    assert_eq!(check, [0; 8], "a batch behind the FlockOpen ran");
    assert_still_serving(&addr, &region);
}
