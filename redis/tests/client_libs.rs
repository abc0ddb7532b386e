//! Real client libraries in Python (redis-py) and Node.js (node-redis, ioredis), with their
//! default settings, authenticating with a password and as an ACL user
//! (ops/clients/auth_check.*), over plain TCP and over TLS. The libraries are installed by ops/install-packages.sh into
//! ops/clients; without them the tests fail, unless RACEKV_SKIP_CLIENT_LIBS=1 says to skip.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use racekv_redis::acl::{Acl, AclOptions};
use racekv_redis::{ServerOptions, TlsPort};
use racekv_transport::test_pki::TestPki;
use racekv_transport::{ClientAuth, ServerTls};

const PASSWORD: &str = "admin secret";
const USER_PASSWORD: &str = "alice-secret";

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/clients")
}

/// The interpreter for `script`, if the libraries are installed.
fn runner(script: &str) -> Option<PathBuf> {
    let dir = clients_dir();
    let (bin, marker) = if script.ends_with(".py") {
        (dir.join(".venv/bin/python"), dir.join(".venv/bin/python"))
    } else {
        (PathBuf::from("node"), dir.join("node_modules/ioredis"))
    };
    if marker.exists() {
        return Some(bin);
    }
    if std::env::var("RACEKV_SKIP_CLIENT_LIBS").as_deref() == Ok("1") {
        eprintln!("skipping {script}: client libraries not installed and RACEKV_SKIP_CLIENT_LIBS=1");
        return None;
    }
    panic!("{} missing: run ops/install-packages.sh (or RACEKV_SKIP_CLIENT_LIBS=1)", marker.display());
}

fn server_with_users(tls: Option<&TestPki>) -> (racekv_redis::RedisServer, racekv_redis::MemStore) {
    let options = AclOptions { requirepass: Some(PASSWORD.into()), file: None };
    let acl = Arc::new(Acl::new(racekv_redis::commands::catalog(), options).unwrap());
    let rules: [&[u8]; 5] = [b"on", b">alice-secret", b"~cache:*", b"+@read", b"+@write"];
    acl.set_user(b"alice", &rules).unwrap();
    // Client libraries announce themselves and ask for the server's features on connect.
    acl.set_user(b"alice", &[b"+@connection", b"+client"]).unwrap();
    let tls = tls.map(|pki| TlsPort {
        addr: "127.0.0.1:0".into(),
        tls: ServerTls::load(pki.server_files(ClientAuth::No)).unwrap(),
    });
    common::start(ServerOptions { acl, tls, ..ServerOptions::default() })
}

fn run_check(script: &str, over_tls: bool) {
    let Some(bin) = runner(script) else { return };
    let pki = over_tls.then(|| TestPki::new("client-libs"));
    let (server, store) = server_with_users(pki.as_ref());
    let (port, ca) = match &pki {
        Some(pki) => (server.tls_addr().unwrap().port(), vec![pki.path("ca.pem").display().to_string()]),
        None => (server.local_addr().port(), vec![]),
    };
    let port = port.to_string();
    let out = Command::new(bin)
        .arg(clients_dir().join(script))
        .args([port.as_str(), PASSWORD, "alice", USER_PASSWORD])
        .args(&ca)
        .current_dir(clients_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "{script} failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(store.peek(b"secret"), None);
}

#[test]
fn redis_py_authenticates_with_a_password_and_as_an_acl_user() {
    run_check("auth_check.py", false);
}

#[test]
fn node_redis_and_ioredis_authenticate_with_a_password_and_as_an_acl_user() {
    run_check("auth_check.mjs", false);
}

#[test]
fn redis_py_authenticates_over_tls() {
    run_check("auth_check.py", true);
}

#[test]
fn node_redis_and_ioredis_authenticate_over_tls() {
    run_check("auth_check.mjs", true);
}
