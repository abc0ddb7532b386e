//! `racekv bench ops`: table operations on one memnode, as many threads as asked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use racekv_hashing::TableOptions;
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::report::{progress, Environment};

/// How keys are picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dist {
    /// Every key equally likely.
    Uniform,
    /// Skewed: a few keys take most operations (see `--zipf-theta`).
    Zipf,
}

/// Settings of `racekv bench ops`.
#[derive(Debug, Clone, Args)]
pub struct OpsArgs {
    /// shm, tcp (or verbs in an `rdma` build with a device).
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Threads running operations, each with its own table client.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Keys loaded before the run.
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// Key bytes (keys are the big-endian index, zero-padded on the left).
    #[arg(long, default_value_t = 8)]
    pub key_size: usize,
    /// Value bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// Fraction of operations that are GETs (the rest are upserts).
    #[arg(long, default_value_t = 0.95)]
    pub get_ratio: f64,
    /// How keys are picked.
    #[arg(long, value_enum, default_value = "uniform")]
    pub dist: Dist,
    /// Skew of the zipf distribution.
    #[arg(long, default_value_t = 0.99)]
    pub zipf_theta: f64,
    /// Seconds measured.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Region size; by default sized from keys and value size.
    #[arg(long)]
    pub region_bytes: Option<u64>,
    /// Put the in-process memnode's region (and the memory baseline) on 2 MiB huge pages
    /// (needs vm.nr_hugepages reserved: the region size / 2 MiB, plus the baseline's 512 MiB).
    #[arg(long)]
    pub huge_pages: bool,
    /// Use this memnode instead of starting one in-process.
    #[arg(long)]
    pub memnode: Option<String>,
    /// Token of the memnode given with `--memnode`.
    #[arg(long, default_value = "racekv-dev-token")]
    pub token: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench ops` measured.
#[derive(Debug, Clone, Serialize)]
pub struct OpsReport {
    /// The benchmark's name, `ops`.
    pub bench: &'static str,
    /// Transport to the memnode.
    pub transport: String,
    /// Threads that ran operations.
    pub threads: usize,
    /// Keys loaded.
    pub keys: u64,
    /// Key bytes.
    pub key_size: usize,
    /// Value bytes.
    pub value_size: usize,
    /// Fraction of operations that were GETs.
    pub get_ratio: f64,
    /// How keys were picked.
    pub dist: Dist,
    /// Seconds measured.
    pub seconds: f64,
    /// Operations completed.
    pub ops: u64,
    /// Operations per second, all threads.
    pub ops_per_sec: f64,
    /// Latency percentiles over a 1-in-8 sample of operations.
    pub p50_us: f64,
    /// 99th percentile latency, in microseconds.
    pub p99_us: f64,
    /// 99.9th percentile latency, in microseconds.
    pub p999_us: f64,
    /// Round trips to the memnode per operation.
    pub round_trips_per_op: f64,
    /// Round trips per GET (None: no GET ran).
    pub get_round_trips_per_op: Option<f64>,
    /// Round trips per upsert (None: no upsert ran).
    pub put_round_trips_per_op: Option<f64>,
    /// CAS retries per operation.
    pub cas_retries_per_op: f64,
    /// shm only: one dependent cache miss on this machine, measured in this run.
    pub memory_dependent_miss_ns: Option<f64>,
    /// shm only: GETs per second per thread at three dependent misses each.
    pub memory_limit_ops_per_sec_per_thread: Option<f64>,
    /// shm only: measured per-thread throughput over that limit.
    pub ratio_to_memory_limit: Option<f64>,
    /// Whether the region was on huge pages.
    pub huge_pages: bool,
    /// Seconds loading the keys took.
    pub load_seconds: f64,
    /// Where and when it ran.
    pub environment: Environment,
}

fn key_of(index: u64, size: usize, out: &mut Vec<u8>) {
    out.clear();
    out.resize(size.saturating_sub(8), 0);
    out.extend_from_slice(&index.to_be_bytes()[8usize.saturating_sub(size)..]);
}

/// Spreads zipf ranks over the key space so hot keys are not neighbours.
fn scramble(rank: u64, keys: u64) -> u64 {
    xxhash_like(rank) % keys
}

fn xxhash_like(x: u64) -> u64 {
    // splitmix64 finalizer: cheap and well mixed
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Runs the benchmark.
pub fn run(args: &OpsArgs) -> anyhow::Result<OpsReport> {
    anyhow::ensure!(args.threads >= 1 && args.keys >= 1, "threads and keys must be at least 1");
    anyhow::ensure!((0.0..=1.0).contains(&args.get_ratio), "get ratio must be within 0..=1");
    anyhow::ensure!(args.key_size >= 1, "keys need at least one byte");
    let block = racekv_hashing::layout::block_units(args.key_size, args.value_size)
        .ok_or_else(|| anyhow::anyhow!("key + value exceed {} bytes", racekv_hashing::MAX_KV_BYTES))?
        as u64
        * 64;
    let region_bytes = args.region_bytes.unwrap_or_else(|| {
        let data = args.keys * block * 3 / 2 + args.keys * 64 / 2;
        (data + (256 << 20)).div_ceil(1 << 20) << 20
    });
    let memnode =
        BenchMemnode::start(args.transport, region_bytes, 256, args.memnode.as_deref(), &args.token, args.huge_pages)?;
    let (table, _) = memnode.table(TableOptions::default())?;

    // Load: threads take interleaved slices of the key space.
    let load_started = Instant::now();
    let bar = progress(args.keys, "loading");
    let loaded = AtomicU64::new(0);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (table, memnode, bar, loaded) = (&table, &memnode, &bar, &loaded);
                s.spawn(move || -> anyhow::Result<()> {
                    let mut c = table.client(memnode.connect()?);
                    let (mut key, value) = (Vec::new(), vec![0xABu8; args.value_size]);
                    let mut i = t as u64;
                    while i < args.keys {
                        key_of(i, args.key_size, &mut key);
                        c.put(&key, &value)?;
                        if loaded.fetch_add(1, Ordering::Relaxed) % 4096 == 0 {
                            bar.set_position(loaded.load(Ordering::Relaxed));
                        }
                        i += args.threads as u64;
                    }
                    c.flush()?;
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("loader thread")?;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let load_seconds = load_started.elapsed().as_secs_f64();

    // Measure.
    let stop = AtomicBool::new(false);
    let barrier = Barrier::new(args.threads + 1);
    let bar = progress((args.seconds * 10.0) as u64, "running");
    let per_thread = std::thread::scope(|s| -> anyhow::Result<Vec<ThreadResult>> {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (table, memnode, stop, barrier) = (&table, &memnode, &stop, &barrier);
                s.spawn(move || worker(t, args, table, memnode, stop, barrier))
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        while started.elapsed().as_secs_f64() < args.seconds {
            std::thread::sleep(Duration::from_millis(100));
            bar.set_position((started.elapsed().as_secs_f64() * 10.0) as u64);
        }
        stop.store(true, Ordering::Relaxed);
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    })?;
    bar.finish_and_clear();

    let mut hist = Histogram::<u64>::new(3)?;
    let (mut ops, mut trips, mut cas, mut elapsed) = (0u64, 0u64, 0u64, 0f64);
    let (mut gets, mut get_trips, mut puts, mut put_trips) = (0u64, 0u64, 0u64, 0u64);
    for r in &per_thread {
        hist.add(&r.hist)?;
        ops += r.ops;
        trips += r.trips;
        cas += r.cas_failures;
        gets += r.gets;
        get_trips += r.get_trips;
        puts += r.puts;
        put_trips += r.put_trips;
        elapsed = elapsed.max(r.seconds);
    }
    let ops_per_sec = ops as f64 / elapsed;
    let miss_ns = match args.transport {
        TransportKind::Shm => Some(crate::membaseline::dependent_miss_ns(512 << 20, 5_000_000, args.huge_pages)?),
        _ => None,
    };
    let limit = miss_ns.map(|ns| 1e9 / (3.0 * ns));
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    Ok(OpsReport {
        bench: "ops",
        transport: memnode.endpoint().kind().to_string(),
        threads: args.threads,
        keys: args.keys,
        key_size: args.key_size,
        value_size: args.value_size,
        get_ratio: args.get_ratio,
        dist: args.dist,
        seconds: elapsed,
        ops,
        ops_per_sec,
        p50_us: q(0.5),
        p99_us: q(0.99),
        p999_us: q(0.999),
        round_trips_per_op: trips as f64 / ops.max(1) as f64,
        get_round_trips_per_op: (gets > 0).then(|| get_trips as f64 / gets as f64),
        put_round_trips_per_op: (puts > 0).then(|| put_trips as f64 / puts as f64),
        cas_retries_per_op: cas as f64 / ops.max(1) as f64,
        memory_dependent_miss_ns: miss_ns,
        memory_limit_ops_per_sec_per_thread: limit,
        ratio_to_memory_limit: limit.map(|l| ops_per_sec / args.threads as f64 / l),
        huge_pages: args.huge_pages,
        load_seconds,
        environment: Environment::capture(),
    })
}

struct ThreadResult {
    hist: Histogram<u64>,
    ops: u64,
    trips: u64,
    cas_failures: u64,
    gets: u64,
    get_trips: u64,
    puts: u64,
    put_trips: u64,
    seconds: f64,
}

fn worker(
    t: usize,
    args: &OpsArgs,
    table: &racekv_hashing::Table,
    memnode: &BenchMemnode,
    stop: &AtomicBool,
    barrier: &Barrier,
) -> anyhow::Result<ThreadResult> {
    let mut c = table.client(memnode.connect()?);
    let mut rng = SmallRng::seed_from_u64(0xBE7C + t as u64);
    let zipf = Zipf::new(args.keys as f64, args.zipf_theta).map_err(|e| anyhow::anyhow!("zipf: {e}"))?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let (mut key, mut value, mut out) = (Vec::new(), vec![0u8; args.value_size], Vec::new());
    let mut r = ThreadResult {
        hist: Histogram::new(3)?,
        ops: 0,
        trips: 0,
        cas_failures: 0,
        gets: 0,
        get_trips: 0,
        puts: 0,
        put_trips: 0,
        seconds: 0.0,
    };
    let start_stats = c.stats();
    barrier.wait();
    let started = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // Check the clock rarely; do 64 operations per round.
        for _ in 0..64 {
            let index = match args.dist {
                Dist::Uniform => rng.random_range(0..args.keys),
                Dist::Zipf => scramble(zipf.sample(&mut rng) as u64 - 1, args.keys),
            };
            key_of(index, args.key_size, &mut key);
            let is_get = rng.random::<f64>() < args.get_ratio;
            let sample = (r.ops & 7 == 0).then(Instant::now);
            let before = c.stats().round_trips;
            if is_get {
                let found = c.get_into(&key, &mut out)?;
                debug_assert!(found);
                r.gets += 1;
                r.get_trips += c.stats().round_trips - before;
            } else {
                value[0] = value[0].wrapping_add(1);
                c.put(&key, &value)?;
                r.puts += 1;
                r.put_trips += c.stats().round_trips - before;
            }
            if let Some(at) = sample {
                hist.saturating_record(at.elapsed().as_nanos() as u64);
            }
            r.ops += 1;
        }
    }
    r.seconds = started.elapsed().as_secs_f64();
    let end = c.stats();
    r.trips = end.round_trips - start_stats.round_trips;
    r.cas_failures = end.cas_failures - start_stats.cas_failures;
    r.hist = hist;
    Ok(r)
}
