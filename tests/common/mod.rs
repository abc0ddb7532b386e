//! A `racekv up` child process for the CLI's integration tests: free ports, a private
//! runtime directory, the banner awaited, killed if the test fails half-way.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};

/// A loopback port free now, below the ephemeral range ([`free_ports`]): one the OS picks
/// (`bind(0)`) is an ephemeral one, which an outgoing connection may take before the
/// server binds it, or a readiness probe connect to itself on (CI saw a control
/// redis-server "ready" that reset the first command).
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports free now, below Linux's ephemeral range
/// (32768 and up), so no outgoing connection takes one while a process restarts on it.
pub fn free_ports(n: u16) -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // Spread over 20000..32000 by pid, then walk: tests of one binary do not collide.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let start = 20_000 + (std::process::id() % 1000) as u16 * 12;
    loop {
        let base = start + NEXT.fetch_add(n, Ordering::Relaxed) % 12_000;
        if base.checked_add(n).is_some_and(|end| end < 32_000)
            && (base..base + n).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        {
            return base;
        }
    }
}

/// A running `racekv up`.
pub struct Up {
    pub child: Child,
    pub lines: Lines<BufReader<ChildStdout>>,
    pub banner: String,
    pub redis: u16,
    pub memnode: u16,
    pub metrics: u16,
    pub remote: u16,
    /// XDG_RUNTIME_DIR of the cluster: its attach socket and memnode sockets live there.
    pub dir: tempfile::TempDir,
}

impl Up {
    /// Starts `racekv up` with a 64 MiB region (unless `extra` names one) and `extra` arguments; returns once it printed
    /// its banner.
    pub fn start(extra: &[&str]) -> Self {
        let (redis, memnode, metrics, remote) = (free_port(), free_ports(8), free_port(), free_port());
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(["up", "--redis-port", &redis.to_string()])
            .args(if extra.contains(&"--region-bytes") { &[][..] } else { &["--region-bytes", "64MiB"][..] })
            .args(["--base-port", &memnode.to_string(), "--remote-port", &remote.to_string()])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
            .args(extra)
            .env("XDG_RUNTIME_DIR", dir.path())
            .env("RACEKV_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut banner = String::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            banner.push_str(&line);
            banner.push('\n');
            if line.contains("Ctrl-C stops the cluster") {
                break;
            }
        }
        assert!(banner.contains("Ctrl-C stops the cluster"), "racekv up did not start: {banner}");
        Self { child, lines, banner, redis, memnode, metrics, remote, dir }
    }

    /// The attach socket's path.
    pub fn attach_socket(&self) -> std::path::PathBuf {
        self.dir.path().join("racekv/computenode.sock")
    }

    /// `racekv <args>` against this cluster, attached (with `XDG_RUNTIME_DIR` set): success,
    /// stdout trimmed, stderr.
    pub fn racekv(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(args)
            .env("XDG_RUNTIME_DIR", self.dir.path())
            .env_remove("RACEKV_MEMNODES")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    /// `racekv status --json`'s `local_cluster`: what `racekv up --replicas` runs (pids,
    /// states, restarts, partitions), or null.
    pub fn local_cluster(&self) -> serde_json::Value {
        let metrics = format!("127.0.0.1:{}", self.metrics);
        let (ok, out, err) = self.racekv(&["status", "--json", "--computenode", &metrics]);
        assert!(ok, "racekv status: {err}");
        let status: serde_json::Value = serde_json::from_str(&out).unwrap();
        status["local_cluster"].clone()
    }

    /// redis-cli against this cluster's Redis port: stdout trimmed.
    pub fn redis_cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(self.redis.to_string())
            .args(args)
            .output()
            .expect("redis-cli (redis-tools) is installed");
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// The process's resident memory in KiB (`VmRSS`).
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }

    /// Ctrl-C, then what it printed after the banner and whether it exited cleanly.
    pub fn stop(mut self) -> (bool, String) {
        Command::new("kill").args(["-INT", &self.child.id().to_string()]).status().unwrap();
        let rest: String = self.lines.by_ref().map_while(Result::ok).collect::<Vec<_>>().join("\n");
        let status = self.child.wait().unwrap();
        (status.success(), rest)
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The memnode pids of a `local_cluster` document.
pub fn memnode_pids(cluster: &serde_json::Value) -> Vec<u64> {
    cluster["memnodes"].as_array().unwrap().iter().map(|m| m["pid"].as_u64().unwrap()).collect()
}

/// Whether `pid` runs (exists and is not a zombie).
pub fn alive(pid: u64) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
}

/// Sends `signal` (`KILL`, `STOP`, `CONT`, ...) to `pid`; whether it was delivered.
pub fn signal(pid: u64, signal: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The children of a `racekv up --replicas`, killed if the test fails half-way (SIGKILL of
/// `up` itself, which the `Up` guard sends, would leave them running).
pub struct Children(pub Vec<u64>);

impl Children {
    /// The children `cluster` (a `local_cluster` document) names.
    pub fn of(cluster: &serde_json::Value) -> Self {
        let mut pids = memnode_pids(cluster);
        pids.push(cluster["etcd_pid"].as_u64().unwrap());
        Self(pids)
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for &pid in &self.0 {
            signal(pid, "CONT");
            signal(pid, "KILL");
        }
    }
}
