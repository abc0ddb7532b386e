//! A single etcd server as a child process on loopback: `racekv up --replicas` runs one for
//! a cluster on one machine, and tests run one each. Its own data directory and ports,
//! healthy before it is handed out, stopped by pid (SIGTERM, then SIGKILL).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::etcd::Etcd;
use crate::CoordError;

/// The program started: Debian's `etcd-server` package installs it as `/usr/bin/etcd`.
pub const ETCD_PROGRAM: &str = "etcd";

/// How long [`LocalEtcd::stop`] waits after SIGTERM before it sends SIGKILL.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Where and how one etcd server runs.
#[derive(Debug, Clone)]
pub struct LocalEtcdConfig {
    /// Its data directory (created by etcd; reused on a restart, so the map survives).
    pub data_dir: PathBuf,
    /// Loopback port for clients.
    pub client_port: u16,
    /// Addresses besides loopback it serves clients on, at `client_port` (a test's
    /// network namespaces reach it on their links' addresses); usually none.
    pub also_listen_on: Vec<std::net::IpAddr>,
    /// Loopback port for peers (a one-member cluster still listens on one).
    pub peer_port: u16,
    /// Where its output goes (`None`: discarded).
    pub log_file: Option<PathBuf>,
}

/// A running etcd child process.
pub struct LocalEtcd {
    config: LocalEtcdConfig,
    child: Child,
}

/// Whether `etcd` can be found on `PATH`.
pub fn installed() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(ETCD_PROGRAM).is_file()))
}

impl LocalEtcd {
    /// Starts etcd and waits (up to `wait`) until it answers.
    pub fn start(config: LocalEtcdConfig, wait: Duration) -> Result<Self, CoordError> {
        let child = spawn(&config)?;
        let etcd = Self { config, child };
        etcd.wait_healthy(wait)?;
        Ok(etcd)
    }

    /// Its client endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.config.client_port)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its data directory.
    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    /// Whether the process has exited (reaps it if so).
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits (up to `wait`) until it answers a read of the map.
    pub fn wait_healthy(&self, wait: Duration) -> Result<(), CoordError> {
        let deadline = Instant::now() + wait;
        let endpoints = [self.endpoint()];
        loop {
            let attempt = Etcd::connect(&endpoints, "probe", Duration::from_secs(1)).and_then(|etcd| etcd.map());
            match attempt {
                Ok(_) => return Ok(()),
                Err(CoordError::NotBuilt) => return Err(CoordError::NotBuilt),
                Err(e) if Instant::now() >= deadline => {
                    return Err(CoordError::Etcd {
                        endpoints: self.endpoint(),
                        reason: format!(
                            "the etcd started here (pid {}) did not answer within {wait:?}: {e}",
                            self.pid()
                        ),
                    })
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// SIGKILL, then a new process on the same data and ports, healthy within `wait`.
    pub fn restart(&mut self, wait: Duration) -> Result<(), CoordError> {
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait();
        self.child = spawn(&self.config)?;
        self.wait_healthy(wait)
    }

    /// SIGKILL: it stays down until [`Self::restart`].
    pub fn kill(&mut self) {
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM, and SIGKILL if it has not exited after a few seconds.
    pub fn stop(&mut self) {
        racekv_telemetry::child::stop(&mut self.child, STOP_WAIT);
    }

    fn signal(&self, signal: Signal) {
        racekv_telemetry::child::signal(&self.child, signal);
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn(config: &LocalEtcdConfig) -> Result<Child, CoordError> {
    let client = format!("http://127.0.0.1:{}", config.client_port);
    let mut listen = vec![client.clone()];
    listen
        .extend(config.also_listen_on.iter().map(|ip| format!("http://{}", SocketAddr::new(*ip, config.client_port))));
    let peer = format!("http://127.0.0.1:{}", config.peer_port);
    let (stdout, stderr) = match &config.log_file {
        Some(path) => {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| CoordError::Config(format!("opening {}: {e}", path.display())))?;
            let copy = log.try_clone().map_err(|e| CoordError::Config(e.to_string()))?;
            (Stdio::from(log), Stdio::from(copy))
        }
        None => (Stdio::null(), Stdio::null()),
    };
    Command::new(ETCD_PROGRAM)
        .args(["--name", "racekv", "--data-dir"])
        .arg(&config.data_dir)
        .args(["--listen-client-urls", &listen.join(","), "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("racekv={peer}"), "--log-level", "error"])
        // etcd raises every lease to 1.5 election timeouts, rounded up to whole seconds: 2 s
        // with its default 1 s timeout, so a memnode's 1 s lease would lapse after 2 s.
        // One member on loopback: a 500 ms election timeout (50 ms heartbeats) honours 1 s.
        .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|e| {
            CoordError::Config(format!(
                "starting `{ETCD_PROGRAM}`: {e} (install it: `apt-get install etcd-server` on Debian)"
            ))
        })
}
