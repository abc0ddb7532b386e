//! `racekv bench rpc`: RPC throughput and latency with per-thread connections, one
//! lock-shared connection, and one FLOCK-coalescing connection, in the same run.
//!
//! The server is a region server in this process with one handler for every mode: it
//! answers each request with a response of the same size. The three modes:
//! * `per_thread`: every thread has its own connection (one lane), used by it alone: no
//!   sharing, nothing to coalesce (FLOCK's "no sharing" baseline);
//! * `locked`: one connection (one lane) shared through a mutex held across the whole call,
//!   so one request is in flight at a time;
//! * `coalescing`: one connection shared by every thread: a leader coalesces the requests
//!   that queue up while the previous message is in flight into one message.
//!
//! Reported per point: operations per second, p50/p99 latency of a call, and the measured
//! coalescing degree (requests per message sent, from the FLOCK counters). A PNG plot of
//! ops/s against threads, one line per mode, is written with plotters.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use racekv_transport::flock::FlockOptions;
use racekv_transport::{
    ConnectOptions, Connection, Endpoint, Region, RegionServer, RpcService, RpcStatus, ServerOptions, TransportKind,
};
use serde::Serialize;

use crate::plot::{drawn, line_chart_with, Series};
use crate::report::{progress, Environment};

/// How the measured threads share connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Mode {
    /// A connection per thread.
    PerThread,
    /// One connection behind a lock: one RPC at a time.
    Locked,
    /// One connection shared through FLOCK: concurrent RPCs are coalesced.
    Coalescing,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::PerThread => "per_thread",
            Mode::Locked => "locked",
            Mode::Coalescing => "coalescing",
        }
    }
}

/// Settings of `racekv bench rpc`.
#[derive(Debug, Clone, Args)]
pub struct RpcArgs {
    /// shm, tcp (or verbs in an `rdma` build with a device).
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// Thread counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub threads: Vec<usize>,
    /// Modes to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "per_thread,locked,coalescing")]
    pub modes: Vec<Mode>,
    /// Request and response size in bytes.
    #[arg(long, default_value_t = 64)]
    pub size: usize,
    /// Seconds measured per point (after a short warm-up).
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Lanes of the shared connection in `coalescing` mode (default: the product's,
    /// `FlockOptions::default().lanes`).
    #[arg(long, default_value_t = racekv_transport::flock::FlockOptions::default().lanes)]
    pub lanes: usize,
    /// Where to write the PNG plot.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Says where the numbers come from (e.g. "emulated (Soft-RoCE under TCG)"); shown in
    /// the plot's title and recorded in the JSON.
    #[arg(long)]
    pub label: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One mode at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// How the threads shared connections.
    pub mode: Mode,
    /// Threads calling.
    pub threads: usize,
    /// RPCs per second, all threads.
    pub ops_per_sec: f64,
    /// Median RPC latency, in microseconds.
    pub p50_us: f64,
    /// 99th percentile RPC latency, in microseconds.
    pub p99_us: f64,
    /// Requests per message sent (1.0 when nothing was coalesced).
    pub coalescing_degree: f64,
    /// Lanes the server's scheduler held active, of those open, midway through the
    /// measurement (the server runs in this process).
    pub active_lanes: i64,
    /// Lanes open at the server at that moment.
    pub open_lanes: i64,
}

/// What `racekv bench rpc` measured.
#[derive(Debug, Clone, Serialize)]
pub struct RpcReport {
    /// The benchmark's name, `rpc`.
    pub bench: &'static str,
    /// Transport of the RPCs.
    pub transport: String,
    /// Request and response bytes.
    pub size: usize,
    /// Seconds measured per point.
    pub seconds: f64,
    /// Lanes of the shared connection in `coalescing` mode.
    pub lanes: usize,
    /// Where the numbers come from (`--label`).
    pub label: Option<String>,
    /// One point per mode and thread count.
    pub results: Vec<Point>,
    /// Coalescing over per-thread throughput at each thread count measured in both.
    pub speedup_vs_per_thread: Vec<(usize, f64)>,
    /// Where the plot went (None: none asked for, or it could not be drawn).
    pub plot: Option<String>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// Answers every request with `size` bytes (the same handler for every mode).
struct Echo {
    size: usize,
}

impl RpcService for Echo {
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        if method != 1 {
            return Err(RpcStatus::new(RpcStatus::UNKNOWN_METHOD, "bench: method 1 only"));
        }
        let mut out = vec![0u8; self.size];
        let n = request.len().min(self.size);
        out[..n].copy_from_slice(&request[..n]);
        Ok(out)
    }
    fn method_name(&self, _method: u16) -> &'static str {
        "bench_echo"
    }
}

struct Served {
    _server: RegionServer,
    endpoint: Endpoint,
    _dir: tempfile::TempDir,
}

const TOKEN: &str = "rpc-bench";

fn serve(transport: TransportKind, size: usize) -> anyhow::Result<Served> {
    let dir = tempfile::tempdir()?;
    let len = 1 << 20;
    let file = racekv_transport::region::shared_memory_file("rpc-bench", len, false)?;
    let region = Arc::new(Region::map_file(&file, len)?);
    let listen = match transport {
        TransportKind::Shm => Endpoint::Shm(dir.path().join("rpc.sock")),
        TransportKind::Tcp => Endpoint::Tcp("127.0.0.1:0".into()),
        TransportKind::Verbs => Endpoint::Verbs("127.0.0.1:0".into()),
    };
    let options = ServerOptions { token: TOKEN.into(), max_connections: 4096, ..ServerOptions::default() };
    let server = RegionServer::start(region, Some(file), Arc::new(Echo { size }), options, &[listen])
        .context("starting the rpc benchmark's server")?;
    let endpoint = server.endpoints()[0].clone();
    Ok(Served { _server: server, endpoint, _dir: dir })
}

fn connect(endpoint: &Endpoint, lanes: usize) -> anyhow::Result<Arc<dyn Connection>> {
    let options = ConnectOptions::new(TOKEN, Duration::from_secs(30));
    let conn = racekv_transport::connect_with(endpoint, &options, &FlockOptions { lanes, ..FlockOptions::default() })
        .with_context(|| format!("connecting to {endpoint}"))?;
    conn.call(1, b"warm-up").context("first call (opens the rpc lanes)")?;
    Ok(conn)
}

fn measure(args: &RpcArgs, endpoint: &Endpoint, mode: Mode, threads: usize) -> anyhow::Result<Point> {
    let shared = connect(endpoint, if mode == Mode::Coalescing { args.lanes } else { 1 })?;
    let conns: Vec<Arc<dyn Connection>> = match mode {
        Mode::PerThread => (0..threads).map(|_| connect(endpoint, 1)).collect::<anyhow::Result<_>>()?,
        _ => vec![shared; threads],
    };
    let lock = Mutex::new(());
    let stop = AtomicBool::new(false);
    let measuring = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let barrier = Barrier::new(threads + 1);
    let request = vec![0x5Au8; args.size];
    let warmup = Duration::from_millis(300);
    let (totals_before, totals_after, elapsed, hist, (active_lanes, open_lanes)) =
        std::thread::scope(|s| -> anyhow::Result<_> {
            let handles: Vec<_> = conns
                .iter()
                .map(|conn| {
                    let (lock, stop, measuring, ops, barrier, request) =
                        (&lock, &stop, &measuring, &ops, &barrier, &request);
                    s.spawn(move || -> anyhow::Result<Histogram<u64>> {
                        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
                        let mut mine = 0u64;
                        barrier.wait();
                        while !stop.load(Ordering::Relaxed) {
                            let started = Instant::now();
                            let reply = if mode == Mode::Locked {
                                let _held = lock.lock().expect("bench lock");
                                conn.call(1, request)?
                            } else {
                                conn.call(1, request)?
                            };
                            anyhow::ensure!(reply.len() == request.len() && reply[0] == request[0], "wrong reply");
                            if measuring.load(Ordering::Relaxed) {
                                hist.saturating_record(started.elapsed().as_micros().max(1) as u64);
                                mine += 1;
                            }
                        }
                        ops.fetch_add(mine, Ordering::Relaxed);
                        Ok(hist)
                    })
                })
                .collect();
            barrier.wait();
            std::thread::sleep(warmup);
            let before = racekv_transport::flock::sender_totals();
            measuring.store(true, Ordering::Relaxed);
            let started = Instant::now();
            std::thread::sleep(Duration::from_secs_f64(args.seconds / 2.0));
            let lanes = racekv_transport::flock::receiver_lanes();
            std::thread::sleep(Duration::from_secs_f64(args.seconds / 2.0));
            measuring.store(false, Ordering::Relaxed);
            let elapsed = started.elapsed();
            let after = racekv_transport::flock::sender_totals();
            stop.store(true, Ordering::Relaxed);
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            for h in handles {
                hist.add(h.join().expect("bench thread")?)?;
            }
            Ok((before, after, elapsed, hist, lanes))
        })?;
    let messages = totals_after.0 - totals_before.0;
    let requests = totals_after.1 - totals_before.1;
    Ok(Point {
        mode,
        threads,
        ops_per_sec: ops.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        p50_us: hist.value_at_quantile(0.5) as f64,
        p99_us: hist.value_at_quantile(0.99) as f64,
        coalescing_degree: if messages > 0 { requests as f64 / messages as f64 } else { 0.0 },
        active_lanes,
        open_lanes,
    })
}

/// Runs the benchmark.
pub fn run(args: &RpcArgs) -> anyhow::Result<RpcReport> {
    anyhow::ensure!(!args.threads.is_empty() && args.threads.iter().all(|&t| t >= 1), "threads must be at least 1");
    anyhow::ensure!(args.size >= 1 && args.seconds > 0.0, "size and seconds must be positive");
    let served = serve(args.transport, args.size)?;
    let bar = progress((args.threads.len() * args.modes.len()) as u64, "measuring");
    let mut results = Vec::new();
    for &threads in &args.threads {
        for &mode in &args.modes {
            results.push(measure(args, &served.endpoint, mode, threads)?);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let speedup_vs_per_thread = args
        .threads
        .iter()
        .filter_map(|&t| {
            let find = |m| results.iter().find(|p: &&Point| p.mode == m && p.threads == t);
            Some((t, find(Mode::Coalescing)?.ops_per_sec / find(Mode::PerThread)?.ops_per_sec))
        })
        .collect();
    let path = args.plot.clone().unwrap_or_else(|| PathBuf::from(format!("rpc-{}.png", args.transport)));
    let plot = drawn(&path, plot(&path, args, &results));
    Ok(RpcReport {
        bench: "rpc",
        transport: args.transport.to_string(),
        size: args.size,
        seconds: args.seconds,
        lanes: args.lanes,
        label: args.label.clone(),
        results,
        speedup_vs_per_thread,
        plot,
        environment: Environment::capture(),
    })
}

/// ops/s against threads (log2 axis), one line per mode.
fn plot(path: &Path, args: &RpcArgs, results: &[Point]) -> anyhow::Result<()> {
    let series: Vec<Series> = args
        .modes
        .iter()
        .map(|mode| Series {
            name: mode.label().to_string(),
            points: results
                .iter()
                .filter(|p| p.mode == *mode)
                .map(|p| ((p.threads as f64).log2(), p.ops_per_sec))
                .collect(),
        })
        .collect();
    let threads = |x: &f64| format!("{}", 2f64.powf(*x).round());
    let label = args.label.as_deref().map(|l| format!(", {l}")).unwrap_or_default();
    line_chart_with(
        path,
        &format!("racekv bench rpc: {} B over {}{label} (same run, same handler)", args.size, args.transport),
        "threads (log scale)",
        "ops/s",
        &series,
        Some(&threads),
    )
}
