//! The Redis front end's TLS port: redis-cli `--tls` and the `redis` crate over rustls, with
//! a password, with client certificates, a certificate reloaded without a restart, and
//! plaintext sent to the TLS port refused while the server keeps serving.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::cli_output;
use racekv_redis::acl::{Acl, AclOptions};
use racekv_redis::{RedisServer, ServerOptions, TlsPort};
use racekv_transport::test_pki::{TestCa, TestPki};
use racekv_transport::{ClientAuth, ServerTls};

fn tls_server(pki: &TestPki, auth_clients: ClientAuth, password: &str) -> (RedisServer, ServerTls) {
    let tls = ServerTls::load(pki.server_files(auth_clients)).unwrap();
    let options = AclOptions { requirepass: Some(password.into()), file: None };
    let acl = Arc::new(Acl::new(racekv_redis::commands::catalog(), options).unwrap());
    let port = TlsPort { addr: "127.0.0.1:0".into(), tls: tls.clone() };
    let (server, _store) = common::start(ServerOptions { acl, tls: Some(port), ..ServerOptions::default() });
    (server, tls)
}

/// redis-cli over TLS to `server`'s TLS port with `tls_args`, `args`; stdout and stderr.
fn tls_cli(bin: &std::path::Path, server: &RedisServer, tls_args: &[&str], args: &[&str]) -> (String, String) {
    let mut all = vec!["--tls", "-a", "pw", "--no-auth-warning"];
    all.extend_from_slice(tls_args);
    all.extend_from_slice(args);
    let out = cli_output(bin, server.tls_addr().unwrap().port(), &all, b"");
    (String::from_utf8_lossy(&out.stdout).trim().to_string(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn redis_cli_and_the_redis_crate_over_tls_with_a_password() {
    let Some(bin) = common::redis_tool("redis-cli") else { return };
    let pki = TestPki::new("redis-tls");
    let (server, _tls) = tls_server(&pki, ClientAuth::No, "pw");
    let ca = pki.path("ca.pem").display().to_string();
    assert_eq!(tls_cli(&bin, &server, &["--cacert", &ca], &["SET", "k", "over tls"]).0, "OK");
    assert_eq!(tls_cli(&bin, &server, &["--cacert", &ca], &["GET", "k"]).0, "over tls");

    // The redis crate (rustls), RESP3 and RESP2, trusting the test CA.
    for protocol in ["resp3", "resp2"] {
        let url = format!("rediss://:pw@localhost:{}/?protocol={protocol}", server.tls_addr().unwrap().port());
        let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(std::fs::read(&ca).unwrap()) };
        let client = redis::Client::build_with_tls(url, certs).unwrap();
        let mut con = client.get_connection().unwrap();
        let value: String = redis::cmd("GET").arg("k").query(&mut con).unwrap();
        assert_eq!(value, "over tls", "{protocol}");
    }

    // An ACL user over TLS: redis-cli and the redis crate.
    let setuser = ["ACL", "SETUSER", "alice", "on", ">alice-pw", "~k", "+get"];
    assert_eq!(tls_cli(&bin, &server, &["--cacert", &ca], &setuser).0, "OK");
    let as_alice = ["--cacert", ca.as_str(), "--user", "alice", "--pass", "alice-pw"];
    assert_eq!(tls_cli(&bin, &server, &as_alice, &["GET", "k"]).0, "over tls");
    assert!(tls_cli(&bin, &server, &as_alice, &["SET", "k", "x"]).0.starts_with("NOPERM"));
    let url = format!("rediss://alice:alice-pw@localhost:{}/", server.tls_addr().unwrap().port());
    let certs = redis::TlsCertificates { client_tls: None, root_cert: Some(std::fs::read(&ca).unwrap()) };
    let mut con = redis::Client::build_with_tls(url, certs).unwrap().get_connection().unwrap();
    let value: String = redis::cmd("GET").arg("k").query(&mut con).unwrap();
    assert_eq!(value, "over tls");

    // A CA that did not sign the server's certificate: refused.
    let other = TestCa::new("someone else");
    let other_ca = other.write_cert(&pki.path("other-ca.pem")).display().to_string();
    let (out, err) = tls_cli(&bin, &server, &["--cacert", &other_ca], &["GET", "k"]);
    assert!(out.is_empty() && err.contains("SSL"), "{out} {err}");

    // Plaintext to the TLS port: closed without a reply; both ports keep serving.
    let mut raw = std::net::TcpStream::connect(server.tls_addr().unwrap()).unwrap();
    let (reply, closed) = common::exchange(&mut raw, b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n", false, Duration::from_secs(5));
    assert!(closed && !String::from_utf8_lossy(&reply).contains("over tls"), "{reply:?}");
    assert_eq!(tls_cli(&bin, &server, &["--cacert", &ca], &["GET", "k"]).0, "over tls");
    let out = cli_output(&bin, server.local_addr().port(), &["-a", "pw", "--no-auth-warning", "GET", "k"], b"");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "over tls");
}

#[test]
fn client_certificates_when_required_and_a_reloaded_certificate() {
    let Some(bin) = common::redis_tool("redis-cli") else { return };
    let pki = TestPki::new("redis-mtls");
    let (server, tls) = tls_server(&pki, ClientAuth::Yes, "pw");
    let ca = pki.path("ca.pem").display().to_string();
    let cert = pki.path("client.pem").display().to_string();
    let key = pki.path("client.key").display().to_string();
    let mutual = ["--cacert", ca.as_str(), "--cert", cert.as_str(), "--key", key.as_str()];
    assert_eq!(tls_cli(&bin, &server, &mutual, &["PING"]).0, "PONG");
    let (out, _) = tls_cli(&bin, &server, &["--cacert", &ca], &["PING"]);
    assert_ne!(out, "PONG", "no client certificate, no service");

    // A new CA and server certificate on disk, then a reload: new connections are served
    // with it (clients trusting only the old CA are refused), no restart.
    let next = TestCa::new("rotated");
    next.write_cert(&pki.path("ca.pem"));
    next.write_leaf(&["localhost", "127.0.0.1"], &pki.path("server.pem"), &pki.path("server.key"));
    next.write_leaf(&["client"], &pki.path("client.pem"), &pki.path("client.key"));
    tls.reload().unwrap();
    assert_eq!(tls_cli(&bin, &server, &mutual, &["PING"]).0, "PONG", "the rotated CA and certificates");
    let old_ca = pki.ca.write_cert(&pki.path("old-ca.pem")).display().to_string();
    let (out, _) =
        tls_cli(&bin, &server, &["--cacert", &old_ca, "--cert", cert.as_str(), "--key", key.as_str()], &["PING"]);
    assert_ne!(out, "PONG", "the old CA no longer vouches for the server");
}
