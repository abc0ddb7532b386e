//! A real etcd for tests (Debian's `etcd-server`): its own data directory and loopback
//! ports, healthy before it is handed out, stopped by pid when dropped.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::etcd::Etcd;

/// An etcd server of its own: a data directory, two loopback ports, a pid.
pub struct EtcdServer {
    child: Child,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
}

/// A loopback port free now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl EtcdServer {
    /// Starts one and waits until it answers.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (client_port, peer_port) = (free_port(), free_port());
        let child = spawn(dir.path(), client_port, peer_port);
        let server = Self { child, client_port, peer_port, dir };
        server.wait_healthy();
        server
    }

    /// Its client endpoint.
    pub fn endpoint(&self) -> Vec<String> {
        vec![format!("http://127.0.0.1:{}", self.client_port)]
    }

    /// Waits (up to 30 s) until it answers.
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(etcd) = Etcd::connect(&self.endpoint(), "probe", Duration::from_secs(1)) {
                if etcd.map().is_ok() {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("etcd on port {} never became healthy", self.client_port);
    }

    /// SIGKILL, then a new process on the same data and ports.
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(self.dir.path(), self.client_port, self.peer_port);
        self.wait_healthy();
    }

    /// SIGKILL (it stays down until [`Self::restart`]).
    pub fn kill(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

fn spawn(dir: &Path, client_port: u16, peer_port: u16) -> Child {
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    Command::new("etcd")
        .args(["--name", "racekv-test", "--data-dir"])
        .arg(dir.join("data"))
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("racekv-test={peer}"), "--log-level", "error"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd (Debian's etcd-server) is installed: ops/install-packages.sh")
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
