//! A real computenode (over a real memnode) with a password and TLS on its front ends: the
//! Redis plain and TLS ports and the remote front end, then a certificate reload.

use std::time::Duration;

use racekv_client::{Client, ClientError};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::test_pki::TestPki;
use racekv_transport::TransportKind;

#[test]
fn password_and_tls_on_the_redis_and_remote_front_ends() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let pki = TestPki::new("computenode");
    let dir = tempfile::tempdir().unwrap();
    let node = Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        requirepass: Some("s3cret".into()),
        redis_addr: Some("127.0.0.1:0".into()),
        redis_tls_addr: Some("127.0.0.1:0".into()),
        tls_cert_file: Some(pki.path("server.pem")),
        tls_key_file: Some(pki.path("server.key")),
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.path().join("computenode.sock")),
        metrics_addr: None,
        ..ComputenodeConfig::default()
    })
    .unwrap();

    // Redis, plain port: nothing without the password.
    let plain = format!("redis://{}/", node.redis_addr().unwrap());
    let mut con = redis::Client::open(plain.as_str()).unwrap().get_connection().unwrap();
    let e = redis::cmd("SET").arg("k").arg("v").query::<()>(&mut con).unwrap_err();
    assert_eq!(e.code(), Some("NOAUTH"), "{e}");
    // Redis, TLS port, with the password: a write that lands in the table.
    let tls_url = format!("rediss://:s3cret@localhost:{}/", node.redis_tls_addr().unwrap().port());
    let certs =
        redis::TlsCertificates { client_tls: None, root_cert: Some(std::fs::read(pki.path("ca.pem")).unwrap()) };
    let mut con = redis::Client::build_with_tls(tls_url, certs).unwrap().get_connection().unwrap();
    let _: () = redis::cmd("SET").arg("k").arg("over tls").query(&mut con).unwrap();
    let authed = format!("redis://:s3cret@{}/", node.redis_addr().unwrap());
    let mut con = redis::Client::open(authed.as_str()).unwrap().get_connection().unwrap();
    let value: String = redis::cmd("GET").arg("k").query(&mut con).unwrap();
    assert_eq!(value, "over tls");

    // The remote front end speaks only TLS now.
    let remote = node.remote_endpoint().unwrap();
    let remote = remote.trim_start_matches("tcp:");
    let client = Client::builder()
        .remote(remote)
        .password("s3cret")
        .tls_ca(pki.path("ca.pem"))
        .tls_server_name("localhost")
        .timeout(Duration::from_secs(5))
        .connect()
        .unwrap();
    assert_eq!(client.get(b"k").unwrap().as_deref(), Some(&b"over tls"[..]));
    let plaintext = Client::builder().remote(remote).password("s3cret").timeout(Duration::from_secs(2)).connect();
    assert!(plaintext.is_err(), "a plaintext client is refused by a TLS front end");

    // An ACL user made on the Redis port is a remote user too, with the same permissions.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "reader", "on", ">reader-pw", "%R~k*", "+get", "+mget"])
        .query(&mut con)
        .unwrap();
    let reader = |password: &str| {
        Client::builder()
            .remote(remote)
            .user("reader")
            .password(password)
            .tls_ca(pki.path("ca.pem"))
            .tls_server_name("localhost")
            .connect()
    };
    let client = reader("reader-pw").unwrap();
    assert_eq!(client.get(b"k").unwrap().as_deref(), Some(&b"over tls"[..]));
    let denied = client.put(b"k", b"overwritten").unwrap_err();
    assert!(matches!(&denied, ClientError::Denied(m) if m.contains("NOPERM")), "{denied}");
    assert!(matches!(client.get(b"other"), Err(ClientError::Denied(_))), "a key outside the user's patterns");
    assert!(matches!(client.multi_get(&[b"k", b"x"]), Err(ClientError::Denied(_))));
    assert!(reader("wrong").is_err(), "a wrong password");
    let _: () = redis::cmd("ACL").arg(&["DELUSER", "reader"]).query(&mut con).unwrap();
    assert!(matches!(client.get(b"k"), Err(ClientError::Denied(_))), "a deleted user's connection may do nothing");

    assert!(node.reload_tls().unwrap(), "SIGHUP's reload reads the files again");
    let mut again = redis::Client::open(authed.as_str()).unwrap().get_connection().unwrap();
    let value: String = redis::cmd("GET").arg("k").query(&mut again).unwrap();
    assert_eq!(value, "over tls");
}
