//! A `racekv up` child process for the CLI's integration tests: free ports, a private
//! runtime directory, the banner awaited, killed if the test fails half-way.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};

/// A port the OS says is free now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
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
        let (redis, memnode, metrics, remote) = (free_port(), free_port(), free_port(), free_port());
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
