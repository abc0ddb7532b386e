//! `racekv bench churn`: load K keys, update them N times at random, and compare the heap
//! the memnode has handed out before and after. Freed blocks return to their clients' free
//! lists after the grace period, so a steady update load must stop asking for memory.
//!
//! With `--ttl-ms`, the expiring variant: N writes of fresh keys that expire `ttl_ms` after
//! they are written and are never read. Only the memnode's active expiry can give their
//! memory back, so the heap stays bounded only if it keeps up: the report compares the
//! heap's peak (KV bytes: heap used less subtables) with what the live keys need (keys
//! written within the last TTL, times their block size) and with its own steady state
//! (the mean over the run's second half), and the heap once everything has expired.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use racekv_hashing::TableOptions;
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cluster::{load_keys, BenchMemnode};
use crate::report::{progress, Environment};

/// Settings of `racekv bench churn`.
#[derive(Debug, Clone, Args)]
pub struct ChurnArgs {
    /// Updates to run after loading the keys.
    #[arg(long, default_value_t = 10_000_000)]
    pub updates: u64,
    /// Keys loaded and then updated at random.
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// Threads running updates.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Transport to the memnode: shm, tcp (or verbs).
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Grace period before freed blocks are reused.
    #[arg(long, default_value_t = 10)]
    pub grace_ms: u64,
    /// The expiring variant: write `updates` fresh keys that expire this many milliseconds
    /// after they are written, never read (`keys` is then unused).
    #[arg(long)]
    pub ttl_ms: Option<u64>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench churn` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    /// The benchmark's name, `churn`.
    pub bench: &'static str,
    /// Transport to the memnode.
    pub transport: String,
    /// Keys loaded.
    pub keys: u64,
    /// Updates run.
    pub updates: u64,
    /// Value bytes.
    pub value_size: usize,
    /// Threads that ran updates.
    pub threads: usize,
    /// Grace period before freed blocks were reused, in milliseconds.
    pub grace_ms: u64,
    /// Heap handed out (subtables + KV chunks) after loading the keys.
    pub heap_bytes_start: u64,
    /// ... and after all the updates.
    pub heap_bytes_end: u64,
    /// End over start; for the expiring variant, its peak over what the live keys need
    /// (`expiring.peak_to_live_ratio`: it starts from an empty heap).
    pub heap_growth_ratio: f64,
    /// Updates per second over the run.
    pub updates_per_sec: f64,
    /// The expiring variant's findings (`--ttl-ms`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expiring: Option<ExpiringReport>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// What the expiring variant measured (bytes are KV heap: heap used less subtables).
#[derive(Debug, Clone, Serialize)]
pub struct ExpiringReport {
    /// Keys' time to live, in milliseconds.
    pub ttl_ms: u64,
    /// Heap samples taken (every [`SAMPLE_EVERY`]).
    pub samples: usize,
    /// Largest heap sample, in bytes.
    pub heap_peak_bytes: u64,
    /// Mean heap over the second half of the run.
    pub heap_steady_bytes: u64,
    /// Keys written within the last TTL, times their block size: mean over the second half.
    pub live_steady_bytes: u64,
    /// Peak against what the live keys need: the 2x target.
    pub peak_to_live_ratio: f64,
    /// Peak over the steady heap.
    pub peak_to_steady_ratio: f64,
    /// Heap once every key has expired and the active expiry had time to find them.
    pub heap_after_expiry_bytes: u64,
    /// Expired items the memnode removed (and none was read, so none lazily).
    pub expired_active: u64,
}

/// How often the expiring variant samples the heap.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(50);
/// After the last write, how long the expiring variant waits past the TTL (and the
/// tolerated skew) for the active expiry to find the last keys.
const SETTLE_AFTER_EXPIRY: Duration = Duration::from_secs(3);

/// Runs the benchmark.
pub fn run(args: &ChurnArgs) -> anyhow::Result<ChurnReport> {
    anyhow::ensure!(args.keys >= 1 && args.threads >= 1, "keys and threads must be at least 1");
    if let Some(ttl_ms) = args.ttl_ms {
        return run_expiring(args, ttl_ms);
    }
    let memnode = BenchMemnode::start(
        args.transport,
        (args.keys * 512 + (256 << 20)).div_ceil(1 << 20) << 20,
        256,
        None,
        "churn",
        false,
    )?;
    let options = TableOptions { grace_period: Duration::from_millis(args.grace_ms), ..TableOptions::default() };
    let (table, _) = memnode.table(options)?;
    let value = vec![7u8; args.value_size];
    load_keys(&mut table.client(memnode.connect()?), args.keys, &value)?;
    let start = memnode.stats()?.heap.heap_used_bytes;
    let done = AtomicU64::new(0);
    let bar = progress(args.updates, "updating");
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (table, memnode, done, bar, value) = (&table, &memnode, &done, &bar, &value);
                s.spawn(move || -> anyhow::Result<()> {
                    let mut c = table.client(memnode.connect()?);
                    let mut rng = SmallRng::seed_from_u64(0xC4u64 + t as u64);
                    let mut v = value.clone();
                    let share =
                        args.updates / args.threads as u64 + u64::from((t as u64) < args.updates % args.threads as u64);
                    for i in 0..share {
                        v[0] = i as u8;
                        c.put(&rng.random_range(0..args.keys).to_be_bytes(), &v)?;
                        if i % 8192 == 0 {
                            bar.set_position(done.fetch_add(8192, Ordering::Relaxed));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("update thread")?;
        }
        Ok(())
    })?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let end = memnode.stats()?.heap.heap_used_bytes;
    Ok(ChurnReport {
        bench: "churn",
        transport: args.transport.to_string(),
        keys: args.keys,
        updates: args.updates,
        value_size: args.value_size,
        threads: args.threads,
        grace_ms: args.grace_ms,
        heap_bytes_start: start,
        heap_bytes_end: end,
        heap_growth_ratio: end as f64 / start as f64,
        updates_per_sec: args.updates as f64 / seconds,
        expiring: None,
        environment: Environment::capture(),
    })
}

/// KV heap bytes: heap used less subtables (which splits add and nobody gives back).
fn kv_heap_bytes(stats: &racekv_hashing::TableStats) -> u64 {
    stats.heap.heap_used_bytes.saturating_sub(stats.heap.subtables * stats.layout.subtable_bytes())
}

/// The expiring variant (`--ttl-ms`): see the module doc.
fn run_expiring(args: &ChurnArgs, ttl_ms: u64) -> anyhow::Result<ChurnReport> {
    anyhow::ensure!(ttl_ms >= 1, "ttl_ms must be at least 1");
    // Room for the live keys at a generous write rate, and for the sweep falling behind.
    let region = (args.updates.min(4_000_000) * 256 + (512 << 20)).div_ceil(1 << 20) << 20;
    let memnode = BenchMemnode::start(args.transport, region, 256, None, "churn", false)?;
    let options = TableOptions { grace_period: Duration::from_millis(args.grace_ms), ..TableOptions::default() };
    let (table, stats_conn) = memnode.table(options)?;
    let stats = || -> anyhow::Result<racekv_hashing::TableStats> {
        let reply = stats_conn.call(racekv_hashing::rpc::method::STATS, &[])?;
        racekv_hashing::service::decode_stats(&reply).ok_or_else(|| anyhow::anyhow!("unreadable stats"))
    };
    let start = kv_heap_bytes(&stats()?);
    let expired_before = active_expired();
    let value = vec![7u8; args.value_size];
    let block_bytes = u64::from(
        racekv_hashing::layout::block_units_for(8, args.value_size, true)
            .ok_or_else(|| anyhow::anyhow!("a value of {} bytes does not fit a block", args.value_size))?,
    ) * racekv_hashing::layout::BLOCK_UNIT_BYTES;
    let written = AtomicU64::new(0);
    let writing = std::sync::atomic::AtomicBool::new(true);
    let bar = progress(args.updates, "writing keys that expire");
    let started = Instant::now();
    // (time, keys written by then, KV heap bytes)
    let mut samples: Vec<(Instant, u64, u64)> = Vec::new();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (table, memnode, written, bar, value) = (&table, &memnode, &written, &bar, &value);
                s.spawn(move || -> anyhow::Result<()> {
                    let mut c = table.client(memnode.connect()?);
                    let share =
                        args.updates / args.threads as u64 + u64::from((t as u64) < args.updates % args.threads as u64);
                    for i in 0..share {
                        let key = ((t as u64) << 48 | i).to_be_bytes();
                        let expires_at = racekv_hashing::clock::now_unix_ms() + ttl_ms;
                        let options = racekv_hashing::PutOptions {
                            expiry: racekv_hashing::Expiry::At(expires_at),
                            ..Default::default()
                        };
                        c.put_opts(&key, value, options)?;
                        if i % 1024 == 1023 {
                            bar.set_position(written.fetch_add(1024, Ordering::Relaxed) + 1024);
                        }
                    }
                    written.fetch_add(share % 1024, Ordering::Relaxed);
                    Ok(())
                })
            })
            .collect();
        let sampler = s.spawn(|| -> anyhow::Result<Vec<(Instant, u64, u64)>> {
            let mut samples = Vec::new();
            while writing.load(Ordering::Relaxed) {
                samples.push((Instant::now(), written.load(Ordering::Relaxed), kv_heap_bytes(&stats()?)));
                std::thread::sleep(SAMPLE_EVERY);
            }
            Ok(samples)
        });
        let mut result = Ok(());
        for h in handles {
            if let Err(e) = h.join().expect("writer thread") {
                result = Err(e);
            }
        }
        writing.store(false, Ordering::Relaxed);
        samples = sampler.join().expect("sampler thread")?;
        result
    })?;
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let end = kv_heap_bytes(&stats()?);
    // Everything has expired once the TTL (and the skew the memnode waits out) passed.
    let settle = Duration::from_millis(ttl_ms + racekv_hashing::clock::MAX_CLOCK_SKEW_MS) + SETTLE_AFTER_EXPIRY;
    std::thread::sleep(settle);
    let after = kv_heap_bytes(&stats()?);

    // Live keys at each sample: those written within the TTL before it.
    let ttl = Duration::from_millis(ttl_ms);
    let live_at = |i: usize| -> u64 {
        let (at, written, _) = samples[i];
        let before = samples[..=i].iter().rev().find(|(t, ..)| at.duration_since(*t) >= ttl).map_or(0, |s| s.1);
        (written - before) * block_bytes
    };
    let half = samples.len() / 2;
    let second_half = half..samples.len();
    let mean = |f: &dyn Fn(usize) -> u64| {
        let n = second_half.len().max(1) as u64;
        second_half.clone().map(f).sum::<u64>() / n
    };
    let heap_steady = mean(&|i| samples[i].2);
    let live_steady = mean(&live_at);
    let heap_peak = samples.iter().map(|s| s.2).chain([end]).max().unwrap_or(end);
    Ok(ChurnReport {
        bench: "churn-expiring",
        transport: args.transport.to_string(),
        keys: 0,
        updates: args.updates,
        value_size: args.value_size,
        threads: args.threads,
        grace_ms: args.grace_ms,
        heap_bytes_start: start,
        heap_bytes_end: end,
        heap_growth_ratio: heap_peak as f64 / live_steady.max(1) as f64,
        updates_per_sec: args.updates as f64 / seconds,
        expiring: Some(ExpiringReport {
            ttl_ms,
            samples: samples.len(),
            heap_peak_bytes: heap_peak,
            heap_steady_bytes: heap_steady,
            live_steady_bytes: live_steady,
            peak_to_live_ratio: heap_peak as f64 / live_steady.max(1) as f64,
            peak_to_steady_ratio: heap_peak as f64 / heap_steady.max(1) as f64,
            heap_after_expiry_bytes: after,
            expired_active: active_expired() - expired_before,
        }),
        environment: Environment::capture(),
    })
}

/// The memnode's count of expired items it removed (the benchmark runs it in-process, so
/// its counter is this process's).
fn active_expired() -> u64 {
    racekv_telemetry::render()
        .lines()
        .find_map(|l| l.strip_prefix("racekv_table_expired_total{how=\"active\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}
