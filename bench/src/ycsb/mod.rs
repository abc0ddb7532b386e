//! `racekv bench ycsb`: YCSB's core workloads A-F against racekv's native library (attached
//! to the computenode), racekv through its Redis front end, redis-server and valkey-server,
//! in the same run, alternating driver by driver for each workload (the machine is shared
//! and noisy: compare within a run).
//!
//! * Keys are YCSB's (`user` and the FNV hash of the key number), chosen by YCSB's scrambled
//!   zipfian (constant 0.99) or uniformly; workload D reads by YCSB's latest distribution.
//!   A load phase first inserts every record into each store (the three servers, through
//!   the RESP driver; the native driver reads racekv's).
//! * The three servers are driven by one RESP driver ([`resp`]) with the same threads,
//!   connections and pipeline depth; the native driver ([`native`]) runs as many threads
//!   as asked (`--native-threads`, default `--threads`), each with batches of as many
//!   operations as the pipeline depth (`--native-batch`; 1: one synchronous call at a time).
//!   Driver `native` borrows the computenode's connections (`borrow_connections`: its
//!   operations run one-sided in the driver's process); `native-ring` sends every
//!   operation through the attach ring, for comparison.
//! * Workload E: a hash store has no key order, so a "short range scan" here is `SCAN
//!   cursor COUNT n` from a random place of the server's cursor space (racekv's or Redis'
//!   layout), repeated with the returned cursor until it has n keys (1-100, uniform) or the
//!   walk ends. It measures reading n keys (not values) of an unordered walk; the report
//!   gives keys and SCAN calls per scan for each driver. E runs a tenth of `--ops` by
//!   default (`--scan-ops`): each of its operations reads about 50 keys.
//! * Updates and inserts are SETs (upserts) of the whole value; a read-modify-write (F) is
//!   a GET and then, once it answered, a SET of the same key, timed as one operation.

pub mod generator;
pub mod native;
pub mod resp;
pub mod workload;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::idle::IdleWaits;
use crate::plot::{bar_chart, drawn, line_grid, BarSeries, Panel, Series};
use crate::redis::RedisServer;
use crate::report::{progress, Environment};
use crate::valkey::{ValkeyArgs, ValkeyInfo};
use resp::{Cursors, Run, Shape};
use workload::{Distribution, KeySpace, Measured, Workload, OPS};

/// Settings of `racekv bench ycsb`.
#[derive(Debug, Clone, Args)]
pub struct YcsbArgs {
    /// Workloads, run in this order (YCSB's advice: D and E, which insert, last).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "a,b,c,f,d,e")]
    pub workloads: Vec<Workload>,
    /// Records loaded into each store before the runs.
    #[arg(long, default_value_t = 1_000_000)]
    pub records: u64,
    /// Operations per run (one workload, one driver).
    #[arg(long, default_value_t = 500_000)]
    pub ops: u64,
    /// Operations per run of workload E (default: a tenth of --ops).
    #[arg(long)]
    pub scan_ops: Option<u64>,
    /// Value sizes in bytes, comma-separated (each loads the stores anew).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    pub value_size: Vec<usize>,
    /// Key distributions, comma-separated: zipfian, uniform.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "zipfian")]
    pub distribution: Vec<Distribution>,
    /// RESP pipeline depths, comma-separated (operations in flight per connection).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    pub pipeline: Vec<usize>,
    /// RESP driver threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// RESP connections per thread.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Native driver threads, each attached on its own (default: --threads).
    #[arg(long)]
    pub native_threads: Option<usize>,
    /// Operations each native thread sends as one batch (a multi_get and a multi_put),
    /// as a RESP pipeline keeps that many in flight; 1: one synchronous call at a time
    /// (default: the run's pipeline depth).
    #[arg(long)]
    pub native_batch: Option<usize>,
    /// Drivers, comma-separated, run in this order for each workload.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "native,native-ring,racekv,redis,valkey")]
    pub drivers: Vec<Driver>,
    /// Alternating rounds of every driver per workload.
    #[arg(long, default_value_t = 1)]
    pub rounds: u32,
    /// valkey-server.
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    /// A smoke test: 20,000 records and 20,000 operations per run (overrides --records and
    /// --ops).
    #[arg(long)]
    pub quick: bool,
    /// Write the plots (throughput per workload, latency CDFs) into this folder.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    /// Seeds the key choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The longest wait before a run for every server to be idle (see `idle.rs`); 0: none.
    #[arg(long, default_value_t = 30_000)]
    pub max_idle_wait_ms: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Who runs the operations against which store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize)]
pub enum Driver {
    /// racekv's Rust library attached to the computenode, on connections it lends
    /// (`borrow_connections`: key operations run in the driver's process).
    #[value(name = "native")]
    #[serde(rename = "racekv-native")]
    Native,
    /// racekv's Rust library attached to the computenode, every operation through its ring.
    #[value(name = "native-ring")]
    #[serde(rename = "racekv-native-ring")]
    NativeRing,
    /// racekv's Redis front end, through the RESP driver.
    #[value(name = "racekv")]
    #[serde(rename = "racekv-resp")]
    Racekv,
    /// redis-server, through the RESP driver.
    #[value(name = "redis")]
    #[serde(rename = "redis-server")]
    Redis,
    /// valkey-server (io-threads: the cores), through the RESP driver.
    #[value(name = "valkey")]
    #[serde(rename = "valkey-server")]
    Valkey,
}

impl Driver {
    /// racekv's own library, not a RESP client.
    pub fn is_native(self) -> bool {
        matches!(self, Self::Native | Self::NativeRing)
    }

    /// Its name in the report and the plots.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "racekv-native",
            Self::NativeRing => "racekv-native-ring",
            Self::Racekv => "racekv-resp",
            Self::Redis => "redis-server",
            Self::Valkey => "valkey-server",
        }
    }
}

/// Latency of one operation kind in one run (microseconds).
#[derive(Debug, Clone, Serialize)]
pub struct OpLatency {
    /// The operation.
    pub op: workload::Op,
    /// How many ran.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Slowest.
    pub max_us: f64,
}

/// One run: one workload, one driver, one configuration.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// Value size, key distribution and pipeline depth.
    #[serde(flatten)]
    pub config: Config,
    /// The workload.
    pub workload: Workload,
    /// The round (from 0).
    pub round: u32,
    /// The driver.
    pub driver: Driver,
    /// Operations in flight at most (threads x connections x pipeline; native: threads x batch).
    pub in_flight: usize,
    /// Operations completed.
    pub ops: u64,
    /// Wall time.
    pub seconds: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// Error replies (native: library errors).
    pub errors: u64,
    /// Replies of a type the command does not answer with.
    pub unexpected_replies: u64,
    /// Reads that found no value (an insert still in flight can be chosen, rarely).
    pub not_found: u64,
    /// The first error's text.
    pub first_error: Option<String>,
    /// Workload E: keys returned per scan.
    pub keys_per_scan: Option<f64>,
    /// Workload E: SCAN calls per scan.
    pub calls_per_scan: Option<f64>,
    /// Latency of each operation kind that ran.
    pub latency: Vec<OpLatency>,
}

/// One store's load phase.
#[derive(Debug, Clone, Serialize)]
pub struct LoadResult {
    /// Value bytes.
    pub value_size: usize,
    /// The store (racekv is loaded once through its front end and read by both its drivers).
    pub store: Driver,
    /// Records inserted.
    pub records: u64,
    /// Wall time.
    pub seconds: f64,
    /// Inserts per second.
    pub ops_per_sec: f64,
    /// Error replies.
    pub errors: u64,
}

/// One driver's mean throughput for one workload and configuration.
#[derive(Debug, Clone, Serialize)]
pub struct DriverRate {
    /// The driver.
    pub driver: Driver,
    /// Mean operations per second over the rounds.
    pub ops_per_sec: f64,
    /// Over redis-server's, same workload and configuration.
    pub ratio_to_redis: Option<f64>,
}

/// One workload and configuration, every driver.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Value size, key distribution and pipeline depth.
    #[serde(flatten)]
    pub config: Config,
    /// The workload.
    pub workload: Workload,
    /// Every driver's throughput.
    pub drivers: Vec<DriverRate>,
}

/// What `racekv bench ycsb` measured.
#[derive(Debug, Clone, Serialize)]
pub struct YcsbReport {
    /// The benchmark's name, `ycsb`.
    pub bench: &'static str,
    /// Records loaded into each store.
    pub records: u64,
    /// Operations per run.
    pub ops: u64,
    /// Operations per run of workload E.
    pub scan_ops: u64,
    /// RESP driver threads.
    pub threads: usize,
    /// RESP connections per thread.
    pub connections_per_thread: usize,
    /// Native driver threads.
    pub native_threads: usize,
    /// Alternating rounds.
    pub rounds: u32,
    /// The drivers that ran.
    pub drivers: Vec<Driver>,
    /// `redis-server --version`.
    pub redis_server_version: Option<String>,
    /// valkey-server.
    pub valkey_server: ValkeyInfo,
    /// How racekv's front end served its connections.
    pub racekv_io: String,
    /// The load phases.
    pub loads: Vec<LoadResult>,
    /// Every run.
    pub results: Vec<RunResult>,
    /// Mean throughput per workload and configuration, with ratios to redis-server.
    pub summary: Vec<Summary>,
    /// The plots written.
    pub plots: Vec<String>,
    /// The waits, before each run, until every server was idle (see `idle.rs`).
    pub idle_waits: IdleWaits,
    /// Where and when it ran.
    pub environment: Environment,
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn latencies(m: &Measured) -> Vec<OpLatency> {
    OPS.iter()
        .zip(&m.latency)
        .filter(|(_, h)| !h.is_empty())
        .map(|(&op, h)| OpLatency {
            op,
            count: h.len(),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h, 0.5),
            p99_us: us(h, 0.99),
            p999_us: us(h, 0.999),
            max_us: h.max() as f64 / 1000.0,
        })
        .collect()
}

/// A store the drivers run against, started for one value size.
struct Store {
    driver: Driver,
    port: u16,
    cursors: Cursors,
}

/// The racekv cluster of one value size: a memnode and a computenode in this process, on
/// shm, with the Redis front end and the attach socket.
struct Racekv {
    node: Computenode,
    /// How its front end serves connections.
    io: String,
    socket: PathBuf,
    _memnode: BenchMemnode,
    _dir: tempfile::TempDir,
}

impl Racekv {
    fn start(keys: u64, value_size: usize) -> anyhow::Result<Self> {
        // Blocks of value, key and header, room for what updates leave to the grace period,
        // and the table.
        let region = ((keys * (value_size as u64 + 192)) * 3 / 2 + (512 << 20)).div_ceil(2 << 20) << 21;
        let memnode = BenchMemnode::start(TransportKind::Shm, region, 256, None, "bench-ycsb", false)?;
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("attach.sock");
        let config = ComputenodeConfig {
            memnodes: vec![memnode.endpoint().to_string()],
            token: "bench-ycsb".into(),
            redis_addr: Some("127.0.0.1:0".into()),
            remote_addr: None,
            attach_socket: Some(socket.clone()),
            metrics_addr: None,
            ..ComputenodeConfig::default()
        };
        config.validate()?;
        let io = format!("{:?}", config.redis_io_model());
        let node = Computenode::start(config)?;
        Ok(Self { node, io, socket, _memnode: memnode, _dir: dir })
    }
}

/// What a run's workload ran with besides its driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Config {
    /// Value bytes.
    pub value_size: usize,
    /// Key distribution (workload D reads by the latest distribution whatever this says).
    pub distribution: Distribution,
    /// RESP pipeline depth (the native driver's batch, unless `--native-batch` says otherwise).
    pub pipeline: usize,
}

impl Config {
    fn label(self) -> String {
        let dist = match self.distribution {
            Distribution::Zipfian => "zipfian",
            Distribution::Uniform => "uniform",
        };
        format!("{dist}-{}B-p{}", self.value_size, self.pipeline)
    }
}

/// Runs the benchmark (needs redis-server on the PATH for the redis driver).
pub fn run(args: &YcsbArgs) -> anyhow::Result<YcsbReport> {
    let (records, ops) = if args.quick { (20_000, 20_000) } else { (args.records, args.ops) };
    let scan_ops = args.scan_ops.unwrap_or(ops / 10).max(1);
    anyhow::ensure!(records > 0 && ops > 0, "--records and --ops must be at least 1");
    anyhow::ensure!(args.threads > 0 && args.connections > 0, "--threads and --connections must be at least 1");
    anyhow::ensure!(args.pipeline.iter().all(|&p| p > 0), "a pipeline depth must be at least 1");
    let native_threads = args.native_threads.unwrap_or(args.threads).max(1);

    let mut drivers = args.drivers.clone();
    let (mut valkey, valkey_binary) = args.valkey.locate(drivers.contains(&Driver::Valkey))?;
    if valkey_binary.is_none() {
        drivers.retain(|&d| d != Driver::Valkey);
    }

    // Keys the stores may hold by the end: the records and every insert of every run.
    let inserts_per_store: u64 = args
        .workloads
        .iter()
        .map(|&w| {
            let n = if w == Workload::E { scan_ops } else { ops };
            (n as f64 * w.insert_fraction()).ceil() as u64
        })
        .sum::<u64>()
        * 2
        * (args.distribution.len() * args.pipeline.len()) as u64
        * u64::from(args.rounds.max(1));

    let mut loads = Vec::new();
    let mut results = Vec::new();
    let mut histograms: HashMap<(Config, Workload, Driver), Histogram<u64>> = HashMap::new();
    let mut redis_version = None;
    let mut racekv_io = String::new();
    let mut idle_waits = IdleWaits::default();
    for &value_size in &args.value_size {
        let racekv = Racekv::start(records + inserts_per_store, value_size)?;
        racekv_io.clone_from(&racekv.io);
        let racekv_port = racekv.node.redis_addr().context("redis front end")?.port();
        let redis = if drivers.contains(&Driver::Redis) { Some(RedisServer::start()?) } else { None };
        let valkey_server = match &valkey_binary {
            Some(path) => Some(RedisServer::start_binary(path, &args.valkey.server_flags())?),
            None => None,
        };
        redis_version = redis.as_ref().map(|r| r.version.clone()).or(redis_version);
        valkey.version = valkey_server.as_ref().map(|v| v.version.clone()).or(valkey.version);
        let mut stores = Vec::new();
        if drivers.iter().any(|&d| matches!(d, Driver::Native | Driver::NativeRing | Driver::Racekv)) {
            stores.push(Store { driver: Driver::Racekv, port: racekv_port, cursors: Cursors::Racekv });
        }
        for (driver, server) in [(Driver::Redis, &redis), (Driver::Valkey, &valkey_server)] {
            if let Some(server) = server {
                stores.push(Store { driver, port: server.port, cursors: Cursors::Redis });
            }
        }

        // Each run waits for every server to be idle (valkey-server polls a core for seconds
        // after a run).
        let pids = RedisServer::idle_wait_pids(&[redis.as_ref(), valkey_server.as_ref()]);

        // The load phase: every store, through the RESP driver.
        let mut spaces = HashMap::new();
        for store in &stores {
            let fresh = KeySpace::new(0);
            let load = Run {
                port: store.port,
                cursors: store.cursors,
                space: &fresh,
                workload: Workload::Load,
                distribution: Distribution::Uniform,
                ops: records,
                value_size,
                seed: args.seed,
            };
            let bar = progress(records, &format!("load {}", store.driver.name()));
            let shape = Shape { threads: args.threads, connections: args.connections, pipeline: 16 };
            let (m, seconds) = resp::run(&load, shape, &bar)?;
            bar.finish_and_clear();
            anyhow::ensure!(m.errors == 0 && m.unexpected == 0, "loading {}: {:?}", store.driver.name(), m.first_error);
            loads.push(LoadResult {
                value_size,
                store: store.driver,
                records,
                seconds,
                ops_per_sec: records as f64 / seconds,
                errors: m.errors,
            });
            spaces.insert(store.driver, KeySpace::new(records));
        }

        for &distribution in &args.distribution {
            for &pipeline in &args.pipeline {
                let config = Config { value_size, distribution, pipeline };
                for &workload in &args.workloads {
                    let n = if workload == Workload::E { scan_ops } else { ops };
                    for round in 0..args.rounds.max(1) {
                        for &driver in &drivers {
                            let store_driver = if driver.is_native() { Driver::Racekv } else { driver };
                            let store = stores.iter().find(|s| s.driver == store_driver).expect("started above");
                            let space = &spaces[&store_driver];
                            let run = Run {
                                port: store.port,
                                cursors: store.cursors,
                                space,
                                workload,
                                distribution,
                                ops: n,
                                value_size,
                                seed: args.seed ^ (u64::from(round) << 32),
                            };
                            idle_waits.wait(&pids, std::time::Duration::from_millis(args.max_idle_wait_ms));
                            let bar = progress(n, &format!("{} {}", workload.name(), driver.name()));
                            let shape = Shape { threads: args.threads, connections: args.connections, pipeline };
                            let ((m, seconds), in_flight) = if driver.is_native() {
                                let batch = args.native_batch.unwrap_or(pipeline).max(1);
                                let borrow = driver == Driver::Native;
                                (
                                    native::run(&racekv.socket, borrow, &run, native_threads, batch, &bar)?,
                                    native_threads * batch,
                                )
                            } else {
                                (resp::run(&run, shape, &bar)?, args.threads * args.connections * pipeline)
                            };
                            bar.finish_and_clear();
                            histograms
                                .entry((config, workload, driver))
                                .or_insert_with(|| Histogram::new_from(&m.all))
                                .add(&m.all)
                                .expect("same bounds");
                            let scans = m.latency[workload::Op::Scan.index()].len();
                            results.push(RunResult {
                                config,
                                workload,
                                round,
                                driver,
                                in_flight,
                                ops: m.ops(),
                                seconds,
                                ops_per_sec: m.ops() as f64 / seconds,
                                errors: m.errors,
                                unexpected_replies: m.unexpected,
                                not_found: m.not_found,
                                first_error: m.first_error.clone(),
                                keys_per_scan: (scans > 0).then(|| m.scan_keys as f64 / scans as f64),
                                calls_per_scan: (scans > 0).then(|| m.scan_calls as f64 / scans as f64),
                                latency: latencies(&m),
                            });
                        }
                    }
                }
            }
        }
        if let Some(r) = &redis {
            r.shutdown();
        }
        if let Some(v) = &valkey_server {
            v.shutdown();
        }
    }

    let summary = summarize(&results);
    let mut plots = Vec::new();
    if let Some(dir) = &args.plot_dir {
        plots = plot(dir, &summary, &histograms, &drivers, &args.workloads);
    }
    Ok(YcsbReport {
        bench: "ycsb",
        records,
        ops,
        scan_ops,
        threads: args.threads,
        connections_per_thread: args.connections,
        native_threads,
        rounds: args.rounds.max(1),
        drivers,
        redis_server_version: redis_version,
        valkey_server: valkey,
        racekv_io,
        loads,
        results,
        summary,
        plots,
        idle_waits,
        environment: Environment::capture(),
    })
}

/// Mean throughput per (configuration, workload, driver), in the order they ran.
fn summarize(results: &[RunResult]) -> Vec<Summary> {
    let mut summary: Vec<Summary> = Vec::new();
    for r in results {
        let i = match summary.iter().position(|s| (s.config, s.workload) == (r.config, r.workload)) {
            Some(i) => i,
            None => {
                summary.push(Summary { config: r.config, workload: r.workload, drivers: Vec::new() });
                summary.len() - 1
            }
        };
        if !summary[i].drivers.iter().any(|d| d.driver == r.driver) {
            let runs: Vec<f64> = results
                .iter()
                .filter(|o| (o.config, o.workload, o.driver) == (r.config, r.workload, r.driver))
                .map(|o| o.ops_per_sec)
                .collect();
            let mean = runs.iter().sum::<f64>() / runs.len() as f64;
            summary[i].drivers.push(DriverRate { driver: r.driver, ops_per_sec: mean, ratio_to_redis: None });
        }
    }
    for s in &mut summary {
        let redis = s.drivers.iter().find(|d| d.driver == Driver::Redis).map(|d| d.ops_per_sec);
        for d in &mut s.drivers {
            d.ratio_to_redis = redis.map(|r| d.ops_per_sec / r);
        }
    }
    summary
}

/// The quantiles a latency CDF is drawn at.
fn cdf_quantiles() -> Vec<f64> {
    let mut q: Vec<f64> = (0..=98).map(|i| f64::from(i) / 100.0).collect();
    q.extend([0.99, 0.995, 0.999, 0.9995, 0.9999, 1.0]);
    q
}

/// Writes, for each configuration, a bar chart of throughput per workload and a grid of
/// latency CDFs (one chart per workload); returns where they went.
fn plot(
    dir: &Path,
    summary: &[Summary],
    histograms: &HashMap<(Config, Workload, Driver), Histogram<u64>>,
    drivers: &[Driver],
    workloads: &[Workload],
) -> Vec<String> {
    let mut configs: Vec<Config> = Vec::new();
    for s in summary {
        if !configs.contains(&s.config) {
            configs.push(s.config);
        }
    }
    let mut written = Vec::new();
    for config in configs {
        let label = config.label();
        let groups: Vec<String> = workloads.iter().map(|w| w.name().to_string()).collect();
        let series: Vec<BarSeries> = drivers
            .iter()
            .map(|&driver| BarSeries {
                name: driver.name().to_string(),
                values: workloads
                    .iter()
                    .map(|&w| {
                        summary
                            .iter()
                            .find(|s| (s.config, s.workload) == (config, w))
                            .and_then(|s| s.drivers.iter().find(|d| d.driver == driver))
                            .map_or(0.0, |d| d.ops_per_sec / 1000.0)
                    })
                    .collect(),
            })
            .collect();
        let path = dir.join(format!("ycsb-throughput-{label}.png"));
        let title = format!("YCSB throughput, {label} (RESP: pipeline {})", config.pipeline);
        written.extend(drawn(&path, bar_chart(&path, &title, "K operations/s", &groups, &series)));

        let panels: Vec<Panel> = workloads
            .iter()
            .map(|&w| Panel {
                title: format!("workload {}", w.name()),
                series: drivers
                    .iter()
                    .filter_map(|&driver| {
                        let h = histograms.get(&(config, w, driver))?;
                        let points = cdf_quantiles().into_iter().map(|q| ((us(h, q).max(0.01)).log10(), q)).collect();
                        Some(Series { name: driver.name().to_string(), points })
                    })
                    .collect(),
            })
            .collect();
        let path = dir.join(format!("ycsb-latency-{label}.png"));
        let title = format!("YCSB latency CDF, {label}");
        let format = |x: &f64| {
            let v = 10f64.powf(*x);
            if v >= 10.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        };
        let grid =
            line_grid(&path, &title, "latency (us, log scale)", "fraction of operations", &panels, 3, Some(&format));
        written.extend(drawn(&path, grid));
    }
    written
}
