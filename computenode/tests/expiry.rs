//! Expiry through a real computenode over a real memnode: the Redis front end's expiry
//! script against the RACE table, compared with a real redis-server (the script and its
//! client are the Redis front end's own, `redis/tests/common/expiry_script.rs`).
//!
//! redis-server must be installed (Debian package redis-server); RACEKV_SKIP_REDIS_TOOLS=1
//! skips the test where it is not. The reference server runs on 127.0.0.1 with persistence
//! off and is stopped by its pid when the test ends.

mod common;
#[path = "../../redis/tests/common/expiry_script.rs"]
mod expiry_script;

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

/// A real redis-server on a free loopback port, persistence off; killed (by its pid) on drop.
struct RealRedis {
    child: Child,
    port: u16,
}

impl RealRedis {
    fn start() -> Option<Self> {
        let bin = std::path::Path::new("/usr/bin/redis-server");
        if !bin.exists() {
            if std::env::var("RACEKV_SKIP_REDIS_TOOLS").as_deref() == Ok("1") {
                eprintln!("skipping: redis-server not installed and RACEKV_SKIP_REDIS_TOOLS=1");
                return None;
            }
            panic!("redis-server not found: `apt-get install redis-server`, or set RACEKV_SKIP_REDIS_TOOLS=1 to skip");
        }
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

#[test]
fn the_table_answers_the_expiry_script_as_redis_does() {
    let Some(real) = RealRedis::start() else { return };
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 16);
    let node = common::redis_only(&[&m], |_| {});
    let (mismatches, ours) = expiry_script::compare(node.redis_addr().unwrap().port(), real.port);
    assert!(
        mismatches.is_empty(),
        "{} replies differ from redis-server's:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    assert!(ours.len() > 150);
}
