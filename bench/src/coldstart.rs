//! `racekv bench coldstart`: a new process's start to its first completed GET.
//!
//! The benchmark runs a memnode (shm) and a computenode in this process, then starts
//! `racekv get` as a child again and again, alternating the two ways a process can reach
//! the cluster:
//!
//! * attached: through the computenode's Unix socket and shared-memory ring (no connection
//!   of its own, no metadata fetch: KRCORE's point);
//! * embedded: the process connects to the memnode itself, authenticates, fetches the
//!   metadata and the directory.
//!
//! Time runs from just before `spawn` to the child's own CLOCK_MONOTONIC stamp taken when
//! its GET returned (printed on stderr when [`FIRST_OP_ENV`] is set), so process exit is
//! not counted; both modes pay the same exec, dynamic linking and argument parsing.

use std::process::{Command, Stdio};

use anyhow::Context;
use clap::Args;
use hdrhistogram::Histogram;
use racekv_client::attach::monotonic_ns;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::report::{progress, Environment};

/// When set, `racekv get` prints `racekv-first-op-ns <CLOCK_MONOTONIC ns>` on stderr once
/// its GET has completed.
pub const FIRST_OP_ENV: &str = "RACEKV_REPORT_FIRST_OP";
/// The stderr line prefix that carries the stamp.
pub const FIRST_OP_PREFIX: &str = "racekv-first-op-ns ";

const TOKEN: &str = "bench-coldstart";
const KEY: &str = "coldstart-key";

/// Settings of `racekv bench coldstart`.
#[derive(Debug, Clone, Args)]
pub struct ColdstartArgs {
    /// Processes to start in each mode (alternating).
    #[arg(long, default_value_t = 100)]
    pub runs: u32,
    /// The `racekv` binary to start (default: this one).
    #[arg(long)]
    pub binary: Option<std::path::PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench coldstart` measured (times in milliseconds).
#[derive(Debug, Clone, Serialize)]
pub struct ColdstartReport {
    /// The benchmark's name, `coldstart`.
    pub bench: &'static str,
    /// Processes started in each mode.
    pub runs: u32,
    /// Median start-to-first-GET of an attached process.
    pub attached_ms: f64,
    /// 99th percentile start-to-first-GET of an attached process.
    pub attached_p99_ms: f64,
    /// Median start-to-first-GET of an embedded process.
    pub embedded_ms: f64,
    /// 99th percentile start-to-first-GET of an embedded process.
    pub embedded_p99_ms: f64,
    /// embedded / attached, medians.
    pub speedup: f64,
    /// Where and when it ran.
    pub environment: Environment,
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1e6
}

/// Runs the benchmark.
pub fn run(args: &ColdstartArgs) -> anyhow::Result<ColdstartReport> {
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    let binary = match &args.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().context("finding the racekv binary")?,
    };
    let memnode = BenchMemnode::start(TransportKind::Shm, 64 << 20, 64, None, TOKEN, false)?;
    let endpoint = memnode.endpoint().to_string();
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("attach.sock");
    let node = Computenode::start(ComputenodeConfig {
        memnodes: vec![endpoint.clone()],
        token: TOKEN.into(),
        redis_addr: None,
        remote_addr: None,
        attach_socket: Some(socket.clone()),
        metrics_addr: None,
        ..ComputenodeConfig::default()
    })?;
    node.attach().put(KEY.as_bytes(), b"value")?;

    let attached = ["--attach".to_string(), socket.display().to_string()];
    let embedded = ["--memnode".to_string(), endpoint];
    // One untimed run each: page cache and the daemon's first attach off the books.
    first_get_ns(&binary, &attached)?;
    first_get_ns(&binary, &embedded)?;

    let mut attached_ns = Histogram::<u64>::new(3)?;
    let mut embedded_ns = Histogram::<u64>::new(3)?;
    let bar = progress(u64::from(args.runs), "coldstart");
    for _ in 0..args.runs {
        attached_ns.record(first_get_ns(&binary, &attached)?)?;
        embedded_ns.record(first_get_ns(&binary, &embedded)?)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(node);
    Ok(ColdstartReport {
        bench: "coldstart",
        runs: args.runs,
        attached_ms: ms(&attached_ns, 0.5),
        attached_p99_ms: ms(&attached_ns, 0.99),
        embedded_ms: ms(&embedded_ns, 0.5),
        embedded_p99_ms: ms(&embedded_ns, 0.99),
        speedup: ms(&embedded_ns, 0.5) / ms(&attached_ns, 0.5).max(1e-9),
        environment: Environment::capture(),
    })
}

/// Starts `binary get KEY <target>` and returns the nanoseconds from just before the spawn
/// to the child's stamp after its GET completed.
fn first_get_ns(binary: &std::path::Path, target: &[String]) -> anyhow::Result<u64> {
    let mut command = Command::new(binary);
    command
        .args(["get", KEY])
        .args(target)
        .args(["--token", TOKEN])
        .env(FIRST_OP_ENV, "1")
        .env_remove("RACEKV_MEMNODES")
        .env_remove("RACEKV_ATTACH")
        .env_remove("RACEKV_REMOTE")
        .env("RACEKV_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = monotonic_ns();
    let output = command.output().with_context(|| format!("starting {}", binary.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(output.status.success(), "`racekv get` {target:?} failed ({}): {stderr}", output.status);
    anyhow::ensure!(output.stdout.starts_with(b"value"), "`racekv get` {target:?} read the wrong value");
    let stamp: u64 = stderr
        .lines()
        .find_map(|l| l.strip_prefix(FIRST_OP_PREFIX))
        .with_context(|| format!("the child printed no first-op stamp: {stderr}"))?
        .trim()
        .parse()
        .context("an unreadable first-op stamp")?;
    anyhow::ensure!(stamp >= started, "the child's stamp precedes its start");
    Ok(stamp - started)
}
