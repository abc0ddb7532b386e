//! `racekv bench churn`: load K keys, update them N times at random, and compare the heap
//! the memnode has handed out before and after. Freed blocks return to their clients' free
//! lists after the grace period, so a steady update load must stop asking for memory.

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

#[derive(Debug, Clone, Args)]
pub struct ChurnArgs {
    #[arg(long, default_value_t = 10_000_000)]
    pub updates: u64,
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Grace period before freed blocks are reused.
    #[arg(long, default_value_t = 10)]
    pub grace_ms: u64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    pub bench: &'static str,
    pub transport: String,
    pub keys: u64,
    pub updates: u64,
    pub value_size: usize,
    pub threads: usize,
    pub grace_ms: u64,
    /// Heap handed out (subtables + KV chunks) after loading the keys.
    pub heap_bytes_start: u64,
    /// ... and after all the updates.
    pub heap_bytes_end: u64,
    pub heap_growth_ratio: f64,
    pub updates_per_sec: f64,
    pub environment: Environment,
}

pub fn run(args: &ChurnArgs) -> anyhow::Result<ChurnReport> {
    anyhow::ensure!(args.keys >= 1 && args.threads >= 1, "keys and threads must be at least 1");
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
        environment: Environment::capture(),
    })
}
