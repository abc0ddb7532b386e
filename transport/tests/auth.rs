//! The token handshake against real servers and clients, on tcp and Unix sockets: wrong
//! tokens either way, a recorded handshake replayed, frames before the handshake, and peers
//! of the previous wire version.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use racekv_transport::auth::{self, client_proof};
use racekv_transport::shm::ShmConnection;
use racekv_transport::tcp::TcpConnection;
use racekv_transport::wire::{self, error_code, Kind, HEADER_BYTES, NONCE_BYTES};
use racekv_transport::{
    Batch, ConnectOptions, Connection, Endpoint, NoRpc, Region, RegionServer, ServerOptions, TransportError,
};

const TOKEN: &str = "the-right-token";
const REGION: u64 = 64 * 1024;
const TIMEOUT: Duration = Duration::from_secs(5);

struct Served {
    _server: RegionServer,
    region: Arc<Region>,
    tcp: String,
    unix: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn serve(token: &str) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let file = racekv_transport::region::shared_memory_file("auth-test", REGION, false).unwrap();
    let region = Arc::new(Region::map_file(&file, REGION).unwrap());
    let options = ServerOptions { token: token.into(), io_timeout: Duration::from_secs(2), ..Default::default() };
    let listen = [Endpoint::Tcp("127.0.0.1:0".into()), Endpoint::Shm(dir.path().join("region.sock"))];
    let server = RegionServer::start(Arc::clone(&region), Some(file), Arc::new(NoRpc), options, &listen).unwrap();
    let Endpoint::Tcp(tcp) = server.endpoints()[0].clone() else { unreachable!() };
    Served { _server: server, region, tcp, unix: dir.path().join("region.sock"), _dir: dir }
}

/// Reads frames until the peer closes; returns (kind, body) of each.
fn frames_until_close(stream: &mut impl Read) -> Vec<(Kind, Vec<u8>)> {
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    let mut frames = Vec::new();
    let mut at = 0;
    while all.len() >= at + HEADER_BYTES {
        let h = wire::decode_header(all[at..at + HEADER_BYTES].try_into().unwrap()).unwrap();
        let end = at + HEADER_BYTES + h.body_len as usize;
        frames.push((h.kind, all[at + HEADER_BYTES..end].to_vec()));
        at = end;
    }
    frames
}

/// Splits recorded bytes into whole frames: (kind, the frame's bytes).
fn split_frames(bytes: &[u8]) -> Vec<(Kind, Vec<u8>)> {
    let mut frames = Vec::new();
    let mut at = 0;
    while bytes.len() >= at + HEADER_BYTES {
        let h = wire::decode_header(bytes[at..at + HEADER_BYTES].try_into().unwrap()).unwrap();
        let end = at + HEADER_BYTES + h.body_len as usize;
        frames.push((h.kind, bytes[at..end].to_vec()));
        at = end;
    }
    frames
}

fn read_one_frame(stream: &mut impl Read) -> (Kind, Vec<u8>) {
    let mut header = [0u8; HEADER_BYTES];
    stream.read_exact(&mut header).unwrap();
    let h = wire::decode_header(&header).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    stream.read_exact(&mut body).unwrap();
    (h.kind, body)
}

fn error_code_of(frame: &(Kind, Vec<u8>)) -> u16 {
    assert_eq!(frame.0, Kind::Error, "expected an Error frame");
    wire::decode_error(&frame.1).unwrap().0
}

/// A client that ignores the server's proof and answers with a proof made from `token`:
/// what the server must refuse when `token` is wrong. Returns the server's next frame.
fn handshake_ignoring_the_server<S: Read + Write>(stream: &mut S, token: &str) -> (Kind, Vec<u8>) {
    let client_nonce = [5u8; NONCE_BYTES];
    let mut out = Vec::new();
    wire::encode_hello(&mut out, &client_nonce, None);
    stream.write_all(&out).unwrap();
    let (kind, body) = read_one_frame(stream);
    assert_eq!(kind, Kind::Challenge);
    let challenge = wire::decode_challenge(&body).unwrap();
    out.clear();
    wire::encode_proof(&mut out, &client_proof(token.as_bytes(), &client_nonce, &challenge.server_nonce));
    stream.write_all(&out).unwrap();
    read_one_frame(stream)
}

fn unix(path: &std::path::Path) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s
}

fn tcp(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s
}

fn assert_serving(served: &Served) {
    let options = ConnectOptions::new(TOKEN, TIMEOUT);
    let tcp = TcpConnection::connect(&served.tcp, &options).unwrap();
    let shm = ShmConnection::connect(&served.unix, &options).unwrap();
    for conn in [&tcp as &dyn Connection, &shm] {
        let mut b = Batch::new();
        let r = b.read(0, 8);
        conn.execute(&mut b).unwrap();
        assert_eq!(b.read_result(r).unwrap(), [0; 8], "the region was written by someone unauthenticated");
    }
}

#[test]
fn a_client_proof_from_the_wrong_token_is_refused_on_tcp_and_unix() {
    let served = serve(TOKEN);
    let before = auth::failures("tcp", "bad_proof") + auth::failures("unix", "bad_proof");
    let mut s = tcp(&served.tcp);
    assert_eq!(error_code_of(&handshake_ignoring_the_server(&mut s, "wrong")), error_code::AUTH);
    assert!(frames_until_close(&mut s).is_empty(), "only the refusal, no HelloOk");
    let mut s = unix(&served.unix);
    assert_eq!(error_code_of(&handshake_ignoring_the_server(&mut s, "wrong")), error_code::AUTH);
    assert!(frames_until_close(&mut s).is_empty(), "only the refusal, no HelloOk (nor the region's descriptor)");
    assert!(auth::failures("tcp", "bad_proof") + auth::failures("unix", "bad_proof") >= before + 2);
    // The same path with the right token gets in: the refusal was about the proof.
    assert_eq!(handshake_ignoring_the_server(&mut tcp(&served.tcp), TOKEN).0, Kind::HelloOk);
    assert_serving(&served);
}

#[test]
fn a_client_detects_a_server_with_another_token_on_tcp_and_unix() {
    let served = serve("another-token");
    let options = ConnectOptions::new(TOKEN, TIMEOUT);
    let tcp_err = TcpConnection::connect(&served.tcp, &options).err().expect("connected to an impostor");
    assert!(matches!(tcp_err, TransportError::ServerNotAuthenticated { .. }), "{tcp_err:?}");
    let shm_err = ShmConnection::connect(&served.unix, &options).err().expect("connected to an impostor");
    assert!(matches!(shm_err, TransportError::ServerNotAuthenticated { .. }), "{shm_err:?}");
    assert!(tcp_err.to_string().contains("could not prove"), "{tcp_err}");
}

#[test]
fn a_client_sends_nothing_after_hello_to_a_server_without_the_token() {
    // A fake server that answers Hello with a Challenge it cannot prove, then records.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let (kind, _) = read_one_frame(&mut s);
        assert_eq!(kind, Kind::Hello);
        let mut out = Vec::new();
        wire::encode_challenge(
            &mut out,
            &wire::Challenge { server_nonce: [1; NONCE_BYTES], server_proofs: vec![[2; wire::PROOF_BYTES]] },
        );
        s.write_all(&out).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let err = TcpConnection::connect(&addr, &ConnectOptions::new(TOKEN, TIMEOUT)).err().unwrap();
    assert!(matches!(err, TransportError::ServerNotAuthenticated { .. }), "{err:?}");
    assert!(fake.join().unwrap().is_empty(), "the client sent its proof to a server that proved nothing");
}

/// Forwards one connection from a client to `upstream`, recording what the client sent.
fn recording_proxy(upstream: String) -> (String, Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&recorded);
    let proxy = std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(upstream).unwrap();
        let (mut client_reader, mut server_writer) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let upward = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match client_reader.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if server_writer.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = server_writer.shutdown(std::net::Shutdown::Write);
        });
        let _ = std::io::copy(&mut server, &mut client);
        let _ = client.shutdown(std::net::Shutdown::Both);
        upward.join().unwrap();
    });
    (addr, recorded, proxy)
}

#[test]
fn a_recorded_client_session_replayed_on_a_new_connection_is_refused() {
    let served = serve(TOKEN);
    let (proxy_addr, recorded, proxy) = recording_proxy(served.tcp.clone());
    {
        let conn = TcpConnection::connect(&proxy_addr, &ConnectOptions::new(TOKEN, TIMEOUT)).unwrap();
        let mut b = Batch::new();
        b.write(0, b"recorded");
        conn.execute(&mut b).unwrap();
    }
    proxy.join().unwrap();
    let recorded = recorded.lock().unwrap().clone();
    served.region.write(0, &[0; 8]).unwrap();

    // The real client's Hello and Proof, frame by frame, on a new connection.
    let sent = split_frames(&recorded);
    assert_eq!(sent.iter().map(|f| f.0).collect::<Vec<_>>(), [Kind::Hello, Kind::Proof, Kind::Batch]);
    let mut replay = tcp(&served.tcp);
    replay.write_all(&sent[0].1).unwrap();
    assert_eq!(read_one_frame(&mut replay).0, Kind::Challenge);
    replay.write_all(&sent[1].1).unwrap();
    let replies = frames_until_close(&mut replay);
    assert_eq!(replies.len(), 1, "refused, and no HelloOk");
    assert_eq!(error_code_of(&replies[0]), error_code::AUTH);
    let mut word = [0u8; 8];
    served.region.read(0, &mut word).unwrap();
    assert_eq!(word, [0; 8], "the replayed batch reached the region");
    assert_serving(&served);
}

#[test]
fn frames_before_the_handshake_are_refused_on_tcp_and_unix() {
    let served = serve(TOKEN);
    let mut batch = Batch::new();
    batch.write(0, b"sneaky!!");
    let mut frames = Vec::new();
    let mut frame = Vec::new();
    wire::encode_batch(&mut frame, 1, &batch);
    frames.push(frame);
    let mut frame = Vec::new();
    wire::encode_rpc_request(&mut frame, 1, 1, b"x");
    frames.push(frame);
    let mut frame = Vec::new();
    wire::encode_flock_open(&mut frame, &wire::FlockOpen { sender: 1, lane: 0, verbs: None });
    frames.push(frame);
    let mut frame = Vec::new();
    wire::encode_proof(&mut frame, &[0; wire::PROOF_BYTES]);
    frames.push(frame);
    for frame in &frames {
        let mut s = tcp(&served.tcp);
        s.write_all(frame).unwrap();
        let replies = frames_until_close(&mut s);
        assert_eq!(replies.len(), 1);
        assert_eq!(error_code_of(&replies[0]), error_code::AUTH);
        let mut s = unix(&served.unix);
        s.write_all(frame).unwrap();
        let replies = frames_until_close(&mut s);
        assert_eq!(replies.len(), 1);
        assert_eq!(error_code_of(&replies[0]), error_code::AUTH);
    }
    assert_serving(&served);
}

/// A version 1 Hello: the header says version 1, the body carries a token digest.
fn version_1_hello() -> Vec<u8> {
    let mut frame = Vec::new();
    frame.extend_from_slice(&wire::MAGIC.to_le_bytes());
    frame.extend_from_slice(&[1, Kind::Hello as u8, 0, 0]);
    frame.extend_from_slice(&0u64.to_le_bytes());
    frame.extend_from_slice(&24u32.to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&[0xa5; 16]); // a token digest, as version 1 sent it
    frame.extend_from_slice(&1u32.to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame
}

#[test]
fn an_old_client_learns_the_versions_in_a_frame_it_can_read() {
    let served = serve(TOKEN);
    for mut stream in [Box::new(tcp(&served.tcp)) as Box<dyn ReadWrite>, Box::new(unix(&served.unix))] {
        stream.write_all(&version_1_hello()).unwrap();
        let mut all = Vec::new();
        let _ = stream.read_to_end(&mut all);
        assert!(all.len() > HEADER_BYTES, "no answer");
        assert_eq!(all[4], 1, "the refusal is in the old client's header version");
        let (code, message) = wire::decode_error(&all[HEADER_BYTES..]).unwrap();
        assert_eq!(code, error_code::UNSUPPORTED);
        assert!(message.contains("version 2") && message.contains("version 1"), "{message}");
    }
    assert_serving(&served);
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

#[test]
fn a_new_client_names_the_versions_of_an_old_server() {
    // What a version 1 server answers a version 2 hello with: an Error in its own version.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let old = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut frame = Vec::new();
        wire::encode_error_version(&mut frame, 1, 0, error_code::MALFORMED, "protocol version 2, expected 1");
        s.write_all(&frame).unwrap();
    });
    let err = TcpConnection::connect(&addr, &ConnectOptions::new(TOKEN, TIMEOUT)).err().unwrap();
    old.join().unwrap();
    match err {
        TransportError::Protocol(message) => {
            assert!(message.contains("version 1") && message.contains("speaks 2"), "{message}")
        }
        other => panic!("expected a protocol error naming the versions, got {other:?}"),
    }
}
