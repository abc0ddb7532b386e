//! Test helpers: free loopback ports (below the ephemeral range), and a real etcd (Debian's
//! `etcd-server`): a [`LocalEtcd`] in a temporary directory on such ports; a failure to
//! start panics.

use std::net::TcpListener;
use std::time::Duration;

use crate::local_etcd::{LocalEtcd, LocalEtcdConfig};

/// How long a test's etcd may take to answer.
const START_WAIT: Duration = Duration::from_secs(30);

/// An etcd server of its own, stopped when dropped.
pub struct EtcdServer {
    etcd: LocalEtcd,
    _dir: tempfile::TempDir,
}

/// A loopback port free now, below Linux's ephemeral range (32768 and up): a port `bind(0)`
/// gives is an ephemeral one, which an outgoing connection may take while etcd starts, or
/// while it is down between a kill and its restart on the same ports.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Spread over 20000..32000 by pid, then walk: ports of one process never repeat. Half
    // the range away from where the CLI tests' `free_ports` (tests/common) walk from.
    static NEXT: AtomicU16 = AtomicU16::new(6_000);
    let start = 20_000 + (std::process::id() % 1000) as u16 * 12;
    loop {
        let port = start + NEXT.fetch_add(1, Ordering::Relaxed) % 12_000;
        if port < 32_000 && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

impl EtcdServer {
    /// Starts one and waits until it answers.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = LocalEtcdConfig {
            data_dir: dir.path().join("data"),
            client_port: free_port(),
            also_listen_on: Vec::new(),
            peer_port: free_port(),
            log_file: None,
        };
        let etcd =
            LocalEtcd::start(config, START_WAIT).expect("etcd (Debian's etcd-server) starts: ops/install-packages.sh");
        Self { etcd, _dir: dir }
    }

    /// Its client endpoint.
    pub fn endpoint(&self) -> Vec<String> {
        vec![self.etcd.endpoint()]
    }

    /// SIGKILL, then a new process on the same data and ports.
    pub fn restart(&mut self) {
        self.etcd.restart(START_WAIT).expect("etcd restarts");
    }

    /// SIGKILL (it stays down until [`Self::restart`]).
    pub fn kill(&mut self) {
        self.etcd.kill();
    }
}
