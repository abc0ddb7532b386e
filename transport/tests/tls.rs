//! TLS on the tcp listener, with certificates made up per test: untrusted servers, missing
//! or foreign client certificates, server names, plaintext peers, certificate reload, and
//! heavy traffic both ways on one connection. (The conformance suite runs over TLS too.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use racekv_transport::conformance::{rpc, TestRpc};
use racekv_transport::tcp::TcpConnection;
use racekv_transport::test_pki::{TestCa, TestPki};
use racekv_transport::{
    auth, Batch, ClientAuth, ClientTls, ConnectOptions, Connection, Endpoint, Region, RegionServer, ServerOptions,
    ServerTls, TransportError,
};

const TOKEN: &str = "tls-test-token";
const REGION: u64 = 64 << 20;
const TIMEOUT: Duration = Duration::from_secs(5);

fn serve(tls: ServerTls) -> (RegionServer, String) {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let options = ServerOptions { token: TOKEN.into(), tls: Some(tls), ..Default::default() };
    let server =
        RegionServer::start(region, None, Arc::new(TestRpc), options, &[Endpoint::Tcp("127.0.0.1:0".into())]).unwrap();
    let Endpoint::Tcp(addr) = server.endpoints()[0].clone() else { unreachable!() };
    (server, addr)
}

fn connect(addr: &str, tls: Option<ClientTls>) -> Result<TcpConnection, TransportError> {
    TcpConnection::connect(addr, &ConnectOptions { tls, ..ConnectOptions::new(TOKEN, TIMEOUT) })
}

fn round_trip(conn: &dyn Connection) {
    let mut b = Batch::new();
    b.write(64, b"over tls");
    let r = b.read(64, 8);
    conn.execute(&mut b).unwrap();
    assert_eq!(b.read_result(r).unwrap(), b"over tls");
    assert_eq!(conn.call(rpc::ECHO, b"lane over tls").unwrap(), b"lane over tls");
}

fn connect_error(result: Result<TcpConnection, TransportError>) -> String {
    match result {
        Ok(_) => panic!("connected where it must not"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_server_from_another_ca_is_refused() {
    let pki = TestPki::new("server CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::No)).unwrap());
    let other = TestPki::new("some other CA");
    let before = auth::failures("tcp", "tls");
    let message = connect_error(connect(&addr, Some(other.client())));
    assert!(message.contains("certificate"), "{message}");
    round_trip(&connect(&addr, Some(pki.client())).unwrap());
    assert!(auth::failures("tcp", "tls") > before, "the server counts the failed handshake");
}

#[test]
fn a_required_client_certificate_must_be_there_and_trusted() {
    let pki = TestPki::new("required CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::Yes)).unwrap());
    let message = connect_error(connect(&addr, Some(pki.client())));
    assert!(message.contains("CertificateRequired"), "{message}");
    // A client certificate from another CA, with this CA trusted for the server.
    let other = TestPki::new("foreign client CA");
    let foreign = pki.client().with_client_cert(other.path("client.pem"), other.path("client.key")).unwrap();
    let message = connect_error(connect(&addr, Some(foreign)));
    assert!(message.contains("UnknownCA"), "{message}");
    round_trip(&connect(&addr, Some(pki.mutual_client())).unwrap());
}

#[test]
fn an_optional_client_certificate_may_be_missing_but_not_foreign() {
    let pki = TestPki::new("optional CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::Optional)).unwrap());
    round_trip(&connect(&addr, Some(pki.client())).unwrap());
    round_trip(&connect(&addr, Some(pki.mutual_client())).unwrap());
    let other = TestPki::new("foreign client CA");
    let foreign = pki.client().with_client_cert(other.path("client.pem"), other.path("client.key")).unwrap();
    assert!(connect(&addr, Some(foreign)).is_err());
}

#[test]
fn the_server_name_is_checked() {
    let pki = TestPki::new("name CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::No)).unwrap());
    let message = connect_error(connect(&addr, Some(pki.client().with_server_name("db.example"))));
    assert!(message.contains("certificate"), "{message}");
    // The certificate names localhost: asking for it by that name works on the IP as well.
    round_trip(&connect(&addr, Some(pki.client().with_server_name("localhost"))).unwrap());
    let port = addr.rsplit_once(':').unwrap().1;
    round_trip(&connect(&format!("localhost:{port}"), Some(pki.client())).unwrap());
}

#[test]
fn plaintext_peers_are_refused_and_the_server_keeps_serving() {
    let pki = TestPki::new("plaintext CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::No)).unwrap());
    let message = connect_error(connect(&addr, None));
    assert!(message.contains("TLS"), "{message}");
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(TIMEOUT)).unwrap();
    raw.write_all(&[0x5A; 300]).unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer); // an alert, then the close
    round_trip(&connect(&addr, Some(pki.client())).unwrap());
}

#[test]
fn a_tls_client_to_a_plaintext_server_fails_cleanly() {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let options = ServerOptions { token: TOKEN.into(), ..Default::default() };
    let server =
        RegionServer::start(region, None, Arc::new(TestRpc), options, &[Endpoint::Tcp("127.0.0.1:0".into())]).unwrap();
    let Endpoint::Tcp(addr) = server.endpoints()[0].clone() else { unreachable!() };
    let pki = TestPki::new("unused CA");
    assert!(connect(&addr, Some(pki.client())).is_err());
    round_trip(&connect(&addr, None).unwrap());
}

#[test]
fn reload_serves_the_new_certificate_to_new_connections_only() {
    let pki = TestPki::new("first CA");
    let tls = ServerTls::load(pki.server_files(ClientAuth::No)).unwrap();
    let (server, addr) = serve(tls);
    let old = connect(&addr, Some(pki.client())).unwrap();
    round_trip(&old);

    // A broken file: the reload fails and the first certificate stays.
    std::fs::write(pki.path("server.pem"), "not a certificate").unwrap();
    assert!(server.tls().unwrap().reload().is_err());
    round_trip(&connect(&addr, Some(pki.client())).unwrap());

    // A certificate from a second CA in the same files.
    let second = TestCa::new("second CA");
    second.write_leaf(&["localhost", "127.0.0.1"], &pki.path("server.pem"), &pki.path("server.key"));
    let second_ca = second.write_cert(&pki.path("second-ca.pem"));
    server.tls().unwrap().reload().unwrap();
    round_trip(&connect(&addr, Some(ClientTls::new(&second_ca).unwrap())).unwrap());
    assert!(connect(&addr, Some(pki.client())).is_err(), "a new connection still got the first certificate");
    round_trip(&old);
}

/// Both sides send more than the socket buffers hold at once, from several threads: a TLS
/// stream that held its connection's lock across a blocking send would deadlock here.
#[test]
fn heavy_traffic_both_ways_on_one_connection() {
    let pki = TestPki::new("traffic CA");
    let (_server, addr) = serve(ServerTls::load(pki.server_files(ClientAuth::No)).unwrap());
    let conn = connect(&addr, Some(pki.client())).unwrap();
    const BYTES: u32 = 4 << 20;
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let conn = &conn;
            s.spawn(move || {
                let offset = u64::from(t) * u64::from(BYTES);
                let data = vec![t.wrapping_mul(37).wrapping_add(1); BYTES as usize];
                for _ in 0..2 {
                    let mut b = Batch::new();
                    b.write(offset, &data);
                    let r = b.read(offset, BYTES);
                    conn.execute(&mut b).unwrap();
                    assert!(b.read_result(r).unwrap() == &data[..]);
                }
            });
        }
    });
    assert!(conn.is_healthy());
}
