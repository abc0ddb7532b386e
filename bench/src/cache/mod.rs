//! `racekv bench cache`: racekv in cache mode against redis-server, same limit, same
//! policy, same run, through the same RESP driver ([`driver`]).
//!
//! * The workload is a cache's: read a key chosen by a zipfian (0.99) over `--keys`; on a
//!   miss, SET it. `maxmemory` is a share (`--maxmemory-share`, 10%) of the dataset's bytes
//!   (keys and values), in bytes, on both servers; under a `volatile-*` policy every SET
//!   carries an expiry (`--ttl-secs`, a day: nothing expires during the run).
//! * For each round and policy, each server is emptied (FLUSHALL), set up, warmed
//!   (`--warmup-ops`) and measured (`--ops`); the servers alternate. A policy racekv refuses
//!   (CONFIG SET answers an error: LRU and LFU until they exist) is reported as skipped for
//!   racekv and still run on redis-server, so the targets are on record.
//! * GET throughput in cache mode vs without: racekv holds every key (filled once), and
//!   read-only zipfian GETs run with `maxmemory` set above the data (`--get-policy`: every
//!   GET hits, nothing is evicted: what cache mode costs a GET) and with no limit,
//!   alternating (`--get-runs`, ABBA). Target: at least [`GET_RATIO_TARGET`].

pub mod admin;
pub mod driver;

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::plot::{bar_chart, drawn, BarSeries};
use crate::redis::RedisServer;
use crate::report::{progress, Environment};
use crate::ycsb::resp::value_bytes;
use driver::{Counts, Phase, Run, ZIPF_THETA};

/// Cache mode's GETs at this share of plain GETs' throughput, at least.
pub const GET_RATIO_TARGET: f64 = 0.95;
/// The GET comparison's limit, over the dataset's bytes: above it, so nothing is evicted.
const NO_PRESSURE_LIMIT: u64 = 4;

/// Settings of `racekv bench cache`.
#[derive(Debug, Clone, Args)]
pub struct CacheArgs {
    /// Keys in the dataset.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 1000)]
    pub value_size: usize,
    /// maxmemory over the dataset's bytes (keys and values).
    #[arg(long, default_value_t = 0.10)]
    pub maxmemory_share: f64,
    /// Eviction policies, comma-separated, in this order (racekv skips those it refuses).
    #[arg(long, value_delimiter = ',', default_value = "allkeys-random,volatile-ttl,allkeys-lru,allkeys-lfu")]
    pub policies: Vec<String>,
    /// Operations that warm each cache before it is measured.
    #[arg(long, default_value_t = 200_000)]
    pub warmup_ops: u64,
    /// Measured operations per run (one policy, one server).
    #[arg(long, default_value_t = 500_000)]
    pub ops: u64,
    /// GETs per run of the GET throughput comparison.
    #[arg(long, default_value_t = 500_000)]
    pub get_ops: u64,
    /// Runs of the GET throughput comparison, alternating cache mode and no limit (ABBA).
    #[arg(long, default_value_t = 4)]
    pub get_runs: u32,
    /// The policy of the GET throughput comparison's cache mode.
    #[arg(long, default_value = "allkeys-random")]
    pub get_policy: String,
    /// The SETs' expiry under volatile policies, in seconds.
    #[arg(long, default_value_t = 86_400)]
    pub ttl_secs: u64,
    /// Driver threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Connections per thread (one operation in flight each).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Alternating rounds of every policy on both servers.
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// Write the hit-ratio plot into this folder.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
    /// Seeds the key choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Which server a run measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Server {
    /// racekv's Redis front end.
    #[serde(rename = "racekv-resp")]
    Racekv,
    /// redis-server.
    #[serde(rename = "redis-server")]
    Redis,
}

impl Server {
    /// Its name in the report and the plot.
    pub fn name(self) -> &'static str {
        match self {
            Self::Racekv => "racekv-resp",
            Self::Redis => "redis-server",
        }
    }
}

/// One measured run of the read-through workload: one policy, one server, one round.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRun {
    /// The policy.
    pub policy: String,
    /// The server.
    pub server: Server,
    /// The round (from 0).
    pub round: u32,
    /// Operations measured (a GET, and a SET after a miss).
    pub ops: u64,
    /// Wall time.
    pub seconds: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// Hits over GETs.
    pub hit_ratio: f64,
    /// GETs that hit.
    pub hits: u64,
    /// GETs that missed (each followed by a SET).
    pub misses: u64,
    /// Error replies (OOM included).
    pub errors: u64,
    /// Replies of another type than the command's.
    pub unexpected_replies: u64,
    /// The first error's text.
    pub first_error: Option<String>,
    /// Keys the server evicted during the measured phase (INFO's evicted_keys).
    pub evicted_keys: Option<u64>,
}

/// One policy over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    /// The policy.
    pub policy: String,
    /// racekv's mean hit ratio (None: skipped).
    pub racekv_hit_ratio: Option<f64>,
    /// Why racekv did not run it.
    pub racekv_skipped: Option<String>,
    /// redis-server's mean hit ratio.
    pub redis_hit_ratio: Option<f64>,
    /// racekv's mean operations per second.
    pub racekv_ops_per_sec: Option<f64>,
    /// redis-server's mean operations per second.
    pub redis_ops_per_sec: Option<f64>,
}

/// racekv's GET throughput in cache mode and without, on the same data.
#[derive(Debug, Clone, Serialize)]
pub struct GetThroughput {
    /// Cache mode's policy.
    pub policy: String,
    /// Cache mode's limit (above the data: no eviction).
    pub maxmemory_bytes: u64,
    /// Each round's GETs per second in cache mode.
    pub cache_mode_ops_per_sec: Vec<f64>,
    /// Each round's GETs per second with no limit.
    pub no_limit_ops_per_sec: Vec<f64>,
    /// Mean cache mode over mean no limit.
    pub ratio: f64,
    /// [`GET_RATIO_TARGET`].
    pub target: f64,
    /// Hits over GETs in the comparison (1: every key was there).
    pub hit_ratio: f64,
    /// Error replies.
    pub errors: u64,
}

/// What `racekv bench cache` measured.
#[derive(Debug, Clone, Serialize)]
pub struct CacheReport {
    /// The benchmark's name, `cache`.
    pub bench: &'static str,
    /// Keys in the dataset.
    pub keys: u64,
    /// Value bytes.
    pub value_size: usize,
    /// Keys and values of the whole dataset.
    pub dataset_bytes: u64,
    /// The limit both servers ran with.
    pub maxmemory_bytes: u64,
    /// The zipfian constant.
    pub zipf_theta: f64,
    /// Warm-up operations per run.
    pub warmup_ops: u64,
    /// Measured operations per run.
    pub ops: u64,
    /// GETs per run of the GET comparison.
    pub get_ops: u64,
    /// Driver threads.
    pub threads: usize,
    /// Connections per thread.
    pub connections_per_thread: usize,
    /// Alternating rounds.
    pub rounds: u32,
    /// `redis-server --version`.
    pub redis_server_version: String,
    /// redis-server's used_memory when empty: its maxmemory counts it, racekv's does not.
    pub redis_empty_used_memory: Option<u64>,
    /// Every measured run.
    pub runs: Vec<PolicyRun>,
    /// Per policy, over the rounds.
    pub policies: Vec<PolicySummary>,
    /// racekv's GETs in cache mode vs without.
    pub get_throughput: GetThroughput,
    /// The plots written.
    pub plots: Vec<String>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// A memnode and a computenode in this process (shm), serving Redis only.
struct Racekv {
    node: Computenode,
    _memnode: BenchMemnode,
}

impl Racekv {
    fn start(dataset_bytes: u64, keys: u64) -> anyhow::Result<Self> {
        // Every key with its block header and slot, room for what FLUSHALL and evictions
        // leave to grace periods and sessions, and the table.
        let region = ((dataset_bytes + keys * 128) * 4 + (256 << 20)).div_ceil(2 << 20) << 21;
        let memnode = BenchMemnode::start(TransportKind::Shm, region, 256, None, "bench-cache", false)?;
        let config = ComputenodeConfig {
            memnodes: vec![memnode.endpoint().to_string()],
            token: "bench-cache".into(),
            redis_addr: Some("127.0.0.1:0".into()),
            remote_addr: None,
            attach_socket: None,
            metrics_addr: None,
            ..ComputenodeConfig::default()
        };
        let node = Computenode::start(config)?;
        Ok(Self { node, _memnode: memnode })
    }
}

/// Runs the benchmark (needs redis-server on the PATH).
pub fn run(args: &CacheArgs) -> anyhow::Result<CacheReport> {
    anyhow::ensure!(
        args.keys > 0 && args.ops > 0 && args.get_ops > 0,
        "--keys, --ops and --get-ops must be at least 1"
    );
    anyhow::ensure!(args.threads > 0 && args.connections > 0, "--threads and --connections must be at least 1");
    anyhow::ensure!(
        args.maxmemory_share > 0.0 && args.maxmemory_share < 1.0,
        "--maxmemory-share must be between 0 and 1"
    );
    let mut name = Vec::new();
    crate::ycsb::generator::key_name(args.keys - 1, &mut name);
    let dataset_bytes = args.keys * (name.len() + args.value_size) as u64;
    let maxmemory = (dataset_bytes as f64 * args.maxmemory_share) as u64;
    let value = value_bytes(args.value_size, args.seed);
    let racekv = Racekv::start(dataset_bytes, args.keys)?;
    let racekv_port = racekv.node.redis_addr().context("racekv's Redis front end")?.port();
    let redis = RedisServer::start()?;
    let redis_empty = admin::info_number(redis.port, "memory", "used_memory")?;
    let phase = |port, ops, phase, seed| Run {
        port,
        keys: args.keys,
        ops,
        value: value.clone(),
        phase,
        threads: args.threads,
        connections: args.connections,
        seed,
    };

    let mut runs = Vec::new();
    let mut skipped: Vec<(String, String)> = Vec::new();
    for round in 0..args.rounds.max(1) {
        for policy in &args.policies {
            let ttl_secs = policy.starts_with("volatile-").then_some(args.ttl_secs);
            for (server, port) in [(Server::Racekv, racekv_port), (Server::Redis, redis.port)] {
                admin::set_limit(port, 0, "noeviction")?.map_err(anyhow::Error::msg)?;
                admin::flushall(port)?;
                if let Err(why) = admin::set_limit(port, maxmemory, policy)? {
                    anyhow::ensure!(server == Server::Racekv, "redis-server refused {policy}: {why}");
                    if !skipped.iter().any(|(p, _)| p == policy) {
                        eprintln!("racekv skips {policy}: {why}");
                        skipped.push((policy.clone(), why));
                    }
                    continue;
                }
                let seed = args.seed ^ (u64::from(round) << 32);
                let what = format!("{policy} {}", server.name());
                let bar = progress(args.warmup_ops, &format!("warm {what}"));
                driver::run(&phase(port, args.warmup_ops, Phase::ReadThrough { ttl_secs }, !seed), &bar)?;
                bar.finish_and_clear();
                let evicted_before = admin::info_number(port, "stats", "evicted_keys")?;
                let bar = progress(args.ops, &what);
                let (counts, seconds) =
                    driver::run(&phase(port, args.ops, Phase::ReadThrough { ttl_secs }, seed), &bar)?;
                bar.finish_and_clear();
                let evicted_after = admin::info_number(port, "stats", "evicted_keys")?;
                runs.push(policy_run(policy, server, round, &counts, seconds, evicted_before, evicted_after));
            }
        }
    }
    let policies = summarize(&args.policies, &runs, &skipped);

    // GET throughput: every key in racekv, then read-only GETs with and without a limit.
    let no_pressure = dataset_bytes * NO_PRESSURE_LIMIT;
    admin::set_limit(racekv_port, 0, "noeviction")?.map_err(anyhow::Error::msg)?;
    admin::flushall(racekv_port)?;
    let bar = progress(args.keys, "fill racekv");
    driver::run(&phase(racekv_port, args.keys, Phase::Fill, args.seed), &bar)?;
    bar.finish_and_clear();
    let (mut cache_rates, mut plain_rates, mut gets) = (Vec::new(), Vec::new(), Counts::default());
    for run in 0..args.get_runs.max(2) {
        // A B B A: cache mode in runs 0 and 3 of every 4, so drift hits both alike.
        let cache_mode = matches!(run % 4, 0 | 3);
        let (bytes, policy) = if cache_mode { (no_pressure, args.get_policy.as_str()) } else { (0, "noeviction") };
        admin::set_limit(racekv_port, bytes, policy)?
            .map_err(|why| anyhow::anyhow!("racekv refused --get-policy {policy}: {why}"))?;
        let what = if cache_mode { "GET cache mode" } else { "GET no limit" };
        let bar = progress(args.get_ops, what);
        let seed = args.seed ^ (u64::from(run / 2) << 32);
        let (counts, seconds) = driver::run(&phase(racekv_port, args.get_ops, Phase::ReadOnly, seed), &bar)?;
        bar.finish_and_clear();
        let rate = (counts.hits + counts.misses) as f64 / seconds;
        if cache_mode { &mut cache_rates } else { &mut plain_rates }.push(rate);
        gets.hits += counts.hits;
        gets.misses += counts.misses;
        gets.errors += counts.errors;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let get_throughput = GetThroughput {
        policy: args.get_policy.clone(),
        maxmemory_bytes: no_pressure,
        ratio: mean(&cache_rates) / mean(&plain_rates),
        cache_mode_ops_per_sec: cache_rates,
        no_limit_ops_per_sec: plain_rates,
        target: GET_RATIO_TARGET,
        hit_ratio: gets.hit_ratio(),
        errors: gets.errors,
    };
    redis.shutdown();

    let mut plots = Vec::new();
    if let Some(dir) = &args.plot_dir {
        plots.extend(plot(dir, &policies, maxmemory, args));
    }
    Ok(CacheReport {
        bench: "cache",
        keys: args.keys,
        value_size: args.value_size,
        dataset_bytes,
        maxmemory_bytes: maxmemory,
        zipf_theta: ZIPF_THETA,
        warmup_ops: args.warmup_ops,
        ops: args.ops,
        get_ops: args.get_ops,
        threads: args.threads,
        connections_per_thread: args.connections,
        rounds: args.rounds.max(1),
        redis_server_version: redis.version.clone(),
        redis_empty_used_memory: redis_empty,
        runs,
        policies,
        get_throughput,
        plots,
        environment: Environment::capture(),
    })
}

fn policy_run(
    policy: &str,
    server: Server,
    round: u32,
    counts: &Counts,
    seconds: f64,
    evicted_before: Option<u64>,
    evicted_after: Option<u64>,
) -> PolicyRun {
    let ops = counts.hits + counts.misses;
    PolicyRun {
        policy: policy.to_string(),
        server,
        round,
        ops,
        seconds,
        ops_per_sec: ops as f64 / seconds,
        hit_ratio: counts.hit_ratio(),
        hits: counts.hits,
        misses: counts.misses,
        errors: counts.errors,
        unexpected_replies: counts.unexpected,
        first_error: counts.first_error.clone(),
        evicted_keys: evicted_after.zip(evicted_before).map(|(a, b)| a.saturating_sub(b)),
    }
}

/// Means over the rounds, per policy, in the order asked.
fn summarize(policies: &[String], runs: &[PolicyRun], skipped: &[(String, String)]) -> Vec<PolicySummary> {
    let mean = |policy: &str, server: Server, f: fn(&PolicyRun) -> f64| {
        let values: Vec<f64> = runs.iter().filter(|r| r.policy == policy && r.server == server).map(f).collect();
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    };
    policies
        .iter()
        .map(|p| PolicySummary {
            policy: p.clone(),
            racekv_hit_ratio: mean(p, Server::Racekv, |r| r.hit_ratio),
            racekv_skipped: skipped.iter().find(|(q, _)| q == p).map(|(_, why)| why.clone()),
            redis_hit_ratio: mean(p, Server::Redis, |r| r.hit_ratio),
            racekv_ops_per_sec: mean(p, Server::Racekv, |r| r.ops_per_sec),
            redis_ops_per_sec: mean(p, Server::Redis, |r| r.ops_per_sec),
        })
        .collect()
}

/// A bar chart of the hit ratio per policy and server; returns where it went.
fn plot(dir: &Path, policies: &[PolicySummary], maxmemory: u64, args: &CacheArgs) -> Option<String> {
    let groups: Vec<String> = policies.iter().map(|p| p.policy.clone()).collect();
    let series = [
        BarSeries {
            name: Server::Racekv.name().into(),
            values: policies.iter().map(|p| p.racekv_hit_ratio.unwrap_or(0.0) * 100.0).collect(),
        },
        BarSeries {
            name: Server::Redis.name().into(),
            values: policies.iter().map(|p| p.redis_hit_ratio.unwrap_or(0.0) * 100.0).collect(),
        },
    ];
    let path = dir.join("cache-hit-ratio.png");
    let title = format!(
        "Cache hit ratio, zipf {ZIPF_THETA}, {} keys x {} B, maxmemory {} MiB (0: not run)",
        args.keys,
        args.value_size,
        maxmemory >> 20
    );
    drawn(&path, bar_chart(&path, &title, "hit ratio (%)", &groups, &series))
}
