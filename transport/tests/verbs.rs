//! Verbs-only behaviour: real NIC errors, inline versus staged writes, the control channel's
//! rules, device listing. Needs an RDMA device (run in the Soft-RoCE VM:
//! `ops/vm/run-cargo-tests.sh`); without one every test here fails with "no RDMA device
//! found" rather than passing without testing anything. Compiled only with feature `rdma`.
#![cfg(feature = "rdma")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use racekv_transport::tcp::TcpConnection;
use racekv_transport::verbs::{self, VerbsConnection};
use racekv_transport::{
    Batch, ConnectOptions, Connection, Endpoint, NoRpc, Region, RegionServer, ServerOptions, TransportError,
};

const TOKEN: &str = "verbs-test";
const REGION: u64 = 1 << 20;

fn options() -> ConnectOptions {
    ConnectOptions::new(TOKEN, Duration::from_secs(10))
}

/// A region server with a verbs and a tcp endpoint; returns (server, verbs addr, tcp addr).
fn server() -> (RegionServer, String, String) {
    let region = Arc::new(Region::anonymous(REGION).unwrap());
    let listen = [Endpoint::Verbs("127.0.0.1:0".into()), Endpoint::Tcp("127.0.0.1:0".into())];
    let options = ServerOptions { token: TOKEN.into(), ..Default::default() };
    let server = RegionServer::start(region, None, Arc::new(NoRpc), options, &listen).unwrap_or_else(|e| panic!("{e}"));
    let (Endpoint::Verbs(verbs), Endpoint::Tcp(tcp)) = (server.endpoints()[0].clone(), server.endpoints()[1].clone())
    else {
        panic!("unexpected endpoints {:?}", server.endpoints())
    };
    (server, verbs, tcp)
}

fn connect(addr: &str) -> VerbsConnection {
    VerbsConnection::connect(addr, &options()).unwrap_or_else(|e| panic!("cannot connect to verbs:{addr}: {e}"))
}

fn read_u64(conn: &dyn Connection, offset: u64) -> u64 {
    let mut b = Batch::new();
    let r = b.read(offset, 8);
    conn.execute(&mut b).unwrap();
    u64::from_le_bytes(b.read_result(r).unwrap().try_into().unwrap())
}

#[test]
fn devices_lists_an_active_port_with_a_gid() {
    let devices = verbs::devices().unwrap();
    assert!(!devices.is_empty(), "no RDMA device found; {}", verbs::NO_DEVICE_HINT);
    for d in &devices {
        eprint!("{d}");
    }
    assert!(
        devices.iter().flat_map(|d| &d.ports).any(|p| p.active && !p.gids.is_empty() && p.mtu >= 256),
        "no active port with a GID: {devices:?}"
    );
}

/// An access outside the MR is refused by the NIC: the batch fails with a clear
/// ConnectionLost naming the work-completion status, ops before the bad one took effect, the
/// connection is unhealthy from then on (fast), and a new connection to the server works.
#[test]
fn remote_access_error_fails_the_connection_not_the_server() {
    let (server, addr, _) = server();
    let conn = connect(&addr);
    let mut b = Batch::new();
    b.write(64, &7u64.to_le_bytes());
    let before = b.faa(64, 1);
    b.read(REGION + 4096, 64); // past the end of the region and of its MR
    let after = b.faa(64, 100);
    let started = Instant::now();
    let error = conn.execute_unchecked(&mut b).expect_err("the NIC must refuse an access outside the MR");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    match &error {
        TransportError::ConnectionLost { reason, maybe_executed } => {
            assert!(reason.contains("IBV_WC_REM_ACCESS_ERR"), "reason does not name the status: {reason}");
            assert!(reason.contains("op 2"), "reason does not name the failed op: {reason}");
            assert!(*maybe_executed);
        }
        other => panic!("expected ConnectionLost, got {other:?}"),
    }
    assert!(error.is_connection_failure());
    assert_eq!(b.result(before), Ok(7), "ops before the failed one completed");
    assert!(b.result(after).is_err(), "ops after the failed one did not");
    assert!(!conn.is_healthy());

    // Later batches fail at once, with the original reason.
    let mut b = Batch::new();
    b.read(0, 8);
    let started = Instant::now();
    match conn.execute(&mut b) {
        Err(TransportError::ConnectionLost { reason, maybe_executed: false }) => {
            assert!(reason.contains("IBV_WC_REM_ACCESS_ERR"), "{reason}")
        }
        other => panic!("expected an immediate ConnectionLost, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_millis(100));

    // The server is fine: a new connection works and sees what the failed batch did first.
    let fresh = connect(&addr);
    assert!(fresh.is_healthy());
    assert_eq!(read_u64(&fresh, 64), 8, "the WRITE and FAA before the bad READ took effect");
    let mut b = Batch::new();
    let c = b.cas(64, 8, 9);
    fresh.execute(&mut b).unwrap();
    assert!(b.cas_succeeded(c).unwrap());
    drop(conn);
    drop(fresh);
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.connections() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.connections(), 0, "the server keeps closed clients' queue pairs");
}

/// Writes just under, at and over the inline limit (inline versus staged through the
/// registered write buffer) all land intact, in one batch and alone.
#[test]
fn writes_around_the_inline_limit() {
    let (_server, addr, _) = server();
    let conn = connect(&addr);
    let inline = conn.max_inline_data() as usize;
    eprintln!("max inline data: {inline} B");
    let sizes = [1, inline.saturating_sub(1).max(1), inline.max(1), inline + 1, 4096, 65 * 1024, 200 * 1024];
    let mut b = Batch::new();
    let mut at = 0u64;
    let mut expect = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|j| (j * 13 + i * 7 + 1) as u8).collect();
        b.write(at, &data);
        expect.push((at, data));
        at += len as u64;
    }
    conn.execute(&mut b).unwrap();
    for (offset, data) in &expect {
        let mut b = Batch::new();
        let r = b.read(*offset, data.len() as u32);
        conn.execute(&mut b).unwrap();
        assert!(b.read_result(r).unwrap() == &data[..], "write of {} B at {offset} did not land intact", data.len());
    }
}

/// The control channel of a verbs endpoint carries no batches, and a tcp endpoint does not
/// hand out queue pairs.
#[test]
fn endpoints_keep_to_their_roles() {
    let (_server, verbs_addr, tcp_addr) = server();
    let sneaky = TcpConnection::connect(&verbs_addr, &options()).expect("hello is the same on both");
    let mut b = Batch::new();
    b.read(0, 8);
    let error = sneaky.execute(&mut b).expect_err("a batch over the verbs control channel must be refused");
    assert!(error.to_string().contains("no batches"), "{error}");
    match VerbsConnection::connect(&tcp_addr, &options()) {
        Err(TransportError::Connect { reason, .. }) => {
            assert!(reason.contains("does not serve verbs"), "{reason}")
        }
        Err(other) => panic!("expected a Connect error, got {other:?}"),
        Ok(_) => panic!("a tcp endpoint handed out a queue pair"),
    }
    let bad_token = ConnectOptions { token: "wrong".into(), ..options() };
    assert!(matches!(
        VerbsConnection::connect(&verbs_addr, &bad_token),
        Err(TransportError::ServerNotAuthenticated { .. })
    ));
}
