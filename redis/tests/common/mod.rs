//! Helpers shared by the Redis front end's integration tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use racekv_redis::{MemStore, RedisServer, ServerOptions};

pub mod expiry_script;

/// A server over a fresh `MemStore` (the test double) on 127.0.0.1, port chosen by the OS.
pub fn start(mut options: ServerOptions) -> (RedisServer, MemStore) {
    // The same suites run on each io model: ops/test.sh runs them again with this set.
    if std::env::var("RACEKV_TEST_REDIS_IO").as_deref() == Ok("event_loop") {
        options.io = racekv_redis::IoModel::EventLoop { threads: 2 };
    }
    let store = MemStore::new();
    let server = RedisServer::start("127.0.0.1:0", Arc::new(store.clone()), options).expect("start redis server");
    (server, store)
}

/// Path of a redis-tools binary. Missing tools fail the test (they are installed on the
/// project's machines) unless RACEKV_SKIP_REDIS_TOOLS=1 says to skip them explicitly.
pub fn redis_tool(name: &str) -> Option<PathBuf> {
    let path = PathBuf::from("/usr/bin").join(name);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("RACEKV_SKIP_REDIS_TOOLS").as_deref() == Ok("1") {
        eprintln!("skipping: {name} not installed and RACEKV_SKIP_REDIS_TOOLS=1");
        return None;
    }
    panic!("{name} not found: `apt-get install redis-tools`, or set RACEKV_SKIP_REDIS_TOOLS=1 to skip");
}

/// A raw connection with a read timeout, for speaking bytes directly.
pub fn raw(server: &RedisServer) -> TcpStream {
    let stream = TcpStream::connect(server.local_addr()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    stream
}

/// Sends `bytes` (ignoring a write cut short by the server closing), half-closes unless
/// `keep_open`, and reads until the server closes or `timeout` passes. Returns what was read
/// and whether the server closed.
pub fn exchange(stream: &mut TcpStream, bytes: &[u8], keep_open: bool, timeout: Duration) -> (Vec<u8>, bool) {
    let _ = stream.write_all(bytes);
    if !keep_open {
        let _ = stream.shutdown(Shutdown::Write);
    }
    read_until_close(stream, timeout)
}

/// Reads until EOF (returns true) or until `timeout` (returns false).
pub fn read_until_close(stream: &mut TcpStream, timeout: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (got, false);
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return (got, false)
            }
            // A reset also ends the connection.
            Err(_) => return (got, true),
        }
    }
}

/// Reads exactly `len` bytes (panics on EOF or timeout).
pub fn read_exact(stream: &mut TcpStream, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf).unwrap();
    buf
}

/// Polls `cond` for up to 5 s.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs redis-cli with `args` against `port` (stdin from `input`), returns stdout; fails the
/// test if redis-cli exits with an error.
pub fn cli(bin: &Path, port: u16, args: &[&str], input: &[u8]) -> String {
    let out = cli_output(bin, port, args, input);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "redis-cli {args:?} failed: {stdout} {}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Runs redis-cli with `args` against `port` (stdin from `input`), whatever its outcome.
pub fn cli_output(bin: &Path, port: u16, args: &[&str], input: &[u8]) -> std::process::Output {
    let mut child = Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .env_remove("REDISCLI_AUTH")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn redis-cli");
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// A real redis-server on a free loopback port, persistence off; killed (by its pid) on drop.
pub struct RealRedis {
    child: std::process::Child,
    pub port: u16,
}

impl RealRedis {
    pub fn start() -> Option<Self> {
        let bin = redis_tool("redis-server")?;
        let port = racekv_coord::testing::free_port();
        let child = Command::new(bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Self { child, port })
    }
}

impl Drop for RealRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
