//! `racekv bench spike`: KRCORE's load-spike experiment. One worker runs GETs; at the
//! trigger, N-1 more workers start at once; throughput is sampled every 100 us from before
//! the trigger to the plateau. Two runs:
//!
//! * virtualized: each new worker attaches a pre-initialized session from the computenode
//!   (virtual connections over the daemon's pool);
//! * fresh: each new worker does what a new process must: connect, authenticate, fetch the
//!   metadata and the directory, and get a heap chunk, on the same transport.
//!
//! Bootstrap time = trigger to the first moment throughput reaches 90% of its plateau (as a
//! 2 ms average: single noisy samples neither reach nor miss it). The machine is shared and
//! noisy, so the modes alternate over several trials and each reports its median. Each new
//! worker's times to running, to bootstrap done and to its first completed GET are reported
//! as well (per worker, free of the sampling's noise).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::plot::{drawn, line_chart, Series};
use crate::report::Environment;

/// Settings of `racekv bench spike`.
#[derive(Debug, Clone, Args)]
pub struct SpikeArgs {
    /// Transport to the memnode: shm, tcp (or verbs).
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// Workers running before the trigger.
    #[arg(long, default_value_t = 1)]
    pub workers_before: usize,
    /// Workers running after it.
    #[arg(long, default_value_t = 24)]
    pub workers_after: usize,
    /// Keys loaded; the workers GET them at random.
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Milliseconds sampled before the trigger.
    #[arg(long, default_value_t = 100)]
    pub before_ms: u64,
    /// Milliseconds sampled after the trigger.
    #[arg(long, default_value_t = 1_500)]
    pub after_ms: u64,
    /// Sampling interval.
    #[arg(long, default_value_t = 100)]
    pub sample_us: u64,
    /// Connections the computenode pre-initializes to the memnode (0: one per worker after
    /// the spike, as a daemon sized for its host would hold; KRCORE's pool is likewise
    /// created before any worker needs it).
    #[arg(long, default_value_t = 0)]
    pub pool_connections: usize,
    /// Trials per mode (alternating); medians are reported.
    #[arg(long, default_value_t = 5)]
    pub trials: u32,
    /// Where the throughput plot goes.
    #[arg(long, default_value = "bench-results/spike.png")]
    pub plot: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One trial of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct SpikeRun {
    /// `virtualized` (workers attach to the computenode's pool) or `fresh` (they connect themselves).
    pub mode: &'static str,
    /// Trigger to throughput at 90% of its plateau (as a 2 ms average), in milliseconds.
    pub bootstrap_ms: f64,
    /// Throughput after the spike: median of the second half of the samples, in operations per second.
    pub plateau_ops_per_sec: f64,
    /// Throughput before the trigger, in operations per second.
    pub before_ops_per_sec: f64,
    /// From the trigger to each new worker's thread running again: median and slowest.
    pub woke_p50_ms: f64,
    /// Slowest of those, in milliseconds.
    pub woke_max_ms: f64,
    /// From the trigger to each new worker's bootstrap done (attached, or connected with a
    /// heap chunk): median and slowest.
    pub ready_p50_ms: f64,
    /// Slowest of those, in milliseconds.
    pub ready_max_ms: f64,
    /// From the trigger to each new worker's first completed GET: median and slowest.
    pub first_op_p50_ms: f64,
    /// Slowest of those, in milliseconds.
    pub first_op_max_ms: f64,
    /// Virtualized runs: GETs that found their pool connection busy with another worker's,
    /// and handles that moved to a free connection (see the computenode's pool).
    pub pool_contended_ops: u64,
    /// Handles moved to a free connection.
    pub pool_moves: u64,
    /// The sample interval the rates were taken over, in microseconds: `--sample-us`,
    /// widened until the median sample after the trigger holds [`MIN_GETS_PER_SAMPLE`] GETs.
    pub sample_us: u64,
    /// (ms since trigger, ops/s), one per sample.
    #[serde(skip)]
    pub series: Vec<(f64, f64)>,
}

/// What `racekv bench spike` measured.
#[derive(Debug, Clone, Serialize)]
pub struct SpikeReport {
    /// The benchmark's name, `spike`.
    pub bench: &'static str,
    /// Transport to the memnode.
    pub transport: String,
    /// Workers before the trigger.
    pub workers_before: usize,
    /// Workers after it.
    pub workers_after: usize,
    /// Connections in the computenode's pool.
    pub pool_connections: usize,
    /// Sampling interval asked for, in microseconds (each run reports the one its rates
    /// were taken over, widened where samples this short held too few GETs).
    pub sample_us: u64,
    /// The widest interval a run's rates were taken over, in microseconds.
    pub effective_sample_us: u64,
    /// Trials per mode.
    pub trials: u32,
    /// Medians over the trials.
    pub virtualized_bootstrap_ms: f64,
    /// Median bootstrap of fresh workers, in milliseconds.
    pub fresh_bootstrap_ms: f64,
    /// 1 - virtualized / fresh.
    pub bootstrap_reduction: f64,
    /// Trigger to the slowest new worker's bootstrap done, and to its first GET.
    pub virtualized_ready_max_ms: f64,
    /// Median, fresh workers, of the slowest one's bootstrap, in milliseconds.
    pub fresh_ready_max_ms: f64,
    /// Median, virtualized workers, of the slowest one's first GET, in milliseconds.
    pub virtualized_first_op_max_ms: f64,
    /// Median, fresh workers, of the slowest one's first GET, in milliseconds.
    pub fresh_first_op_max_ms: f64,
    /// Every trial of both modes.
    pub runs: Vec<SpikeRun>,
    /// Where the plot went (None when it could not be drawn).
    pub plot: Option<String>,
    /// Where and when it ran.
    pub environment: Environment,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Virtualized,
    Fresh,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Virtualized => "virtualized",
            Mode::Fresh => "fresh",
        }
    }
}

/// Runs the benchmark.
pub fn run(args: &SpikeArgs) -> anyhow::Result<SpikeReport> {
    anyhow::ensure!(
        args.workers_after > args.workers_before && args.workers_before >= 1,
        "need workers_after > workers_before >= 1"
    );
    let memnode = BenchMemnode::start(args.transport, 512 << 20, 256, None, "bench-spike", false)?;
    let endpoint = memnode.endpoint().to_string();
    let node = Arc::new(Computenode::start(ComputenodeConfig {
        memnodes: vec![endpoint.clone()],
        token: "bench-spike".into(),
        redis_addr: None,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ready_sessions: args.workers_after + 4,
        connections_per_memnode: pool_connections(args),
        // No upgrades during the experiment: every worker stays on the pre-initialized pool.
        upgrade_ops_per_sec: 0,
        ..ComputenodeConfig::default()
    })?);
    {
        let mut s = node.attach();
        for k in 0..args.keys {
            s.put(&k.to_be_bytes(), &[7u8; 64])?;
        }
    }
    std::thread::sleep(Duration::from_millis(300)); // ready sessions refilled
    let mut runs = Vec::new();
    for _ in 0..args.trials.max(1) {
        for mode in [Mode::Virtualized, Mode::Fresh] {
            runs.push(spike(args, mode, &node, &endpoint)?);
            std::thread::sleep(Duration::from_millis(300)); // ready sessions refilled, sockets settled
        }
    }
    let median = |mode: &str, f: &dyn Fn(&SpikeRun) -> f64| {
        let mut v: Vec<f64> = runs.iter().filter(|r| r.mode == mode).map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (v, f) = (median("virtualized", &|r| r.bootstrap_ms), median("fresh", &|r| r.bootstrap_ms));
    // Plot the trial closest to each mode's median.
    let typical = |mode: &str, m: f64| {
        runs.iter()
            .filter(|r| r.mode == mode)
            .min_by(|a, b| (a.bootstrap_ms - m).abs().total_cmp(&(b.bootstrap_ms - m).abs()))
            .expect("a trial")
    };
    let shown = [typical("virtualized", v), typical("fresh", f)];
    let plotted = line_chart(
        &args.plot,
        &format!(
            "racekv load spike: {} -> {} workers over {} (throughput every {} us)",
            args.workers_before,
            args.workers_after,
            args.transport,
            shown.iter().map(|r| r.sample_us).max().unwrap_or(args.sample_us)
        ),
        "ms since the trigger",
        "GET ops/s",
        &shown
            .iter()
            .map(|r| Series {
                name: format!("{} (bootstrap {:.2} ms)", r.mode, r.bootstrap_ms),
                points: r.series.clone(),
            })
            .collect::<Vec<_>>(),
    );
    let plot = drawn(&args.plot, plotted);
    Ok(SpikeReport {
        bench: "spike",
        transport: args.transport.to_string(),
        workers_before: args.workers_before,
        workers_after: args.workers_after,
        pool_connections: pool_connections(args),
        sample_us: args.sample_us,
        effective_sample_us: runs.iter().map(|r| r.sample_us).max().unwrap_or(args.sample_us),
        trials: args.trials.max(1),
        virtualized_bootstrap_ms: v,
        fresh_bootstrap_ms: f,
        bootstrap_reduction: 1.0 - v / f,
        virtualized_ready_max_ms: median("virtualized", &|r| r.ready_max_ms),
        fresh_ready_max_ms: median("fresh", &|r| r.ready_max_ms),
        virtualized_first_op_max_ms: median("virtualized", &|r| r.first_op_max_ms),
        fresh_first_op_max_ms: median("fresh", &|r| r.first_op_max_ms),
        runs,
        plot,
        environment: Environment::capture(),
    })
}

fn pool_connections(args: &SpikeArgs) -> usize {
    if args.pool_connections == 0 {
        args.workers_after
    } else {
        args.pool_connections
    }
}

/// A new worker's moments after the trigger.
#[derive(Clone, Copy)]
struct Start {
    /// Its thread ran again.
    woke: Instant,
    /// Bootstrap done: a session attached, or connected with a chunk in hand.
    ready: Instant,
    /// Its first GET completed.
    first_get: Instant,
}

/// Bootstraps, then runs GETs until stopped; says when each step was done.
fn worker(
    mode: Mode,
    node: &Computenode,
    endpoint: &str,
    keys: u64,
    ops: &AtomicU64,
    stop: &AtomicBool,
    seed: u64,
) -> anyhow::Result<Start> {
    let woke = Instant::now();
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut pending = 0;
    let mut work = |get: &mut dyn FnMut(&[u8]) -> anyhow::Result<()>| -> anyhow::Result<Instant> {
        let mut first: Option<Instant> = None;
        while !stop.load(Ordering::Relaxed) {
            get(&rng.random_range(0..keys).to_be_bytes())?;
            first.get_or_insert_with(Instant::now);
            pending += 1;
            if pending == 8 {
                ops.fetch_add(8, Ordering::Relaxed);
                pending = 0;
            }
        }
        first.ok_or_else(|| anyhow::anyhow!("the worker never completed a GET"))
    };
    let (ready, first_get) = match mode {
        Mode::Virtualized => {
            // The ready session holds its virtual connections and a heap chunk already.
            let mut s = node.attach();
            let ready = Instant::now();
            (ready, work(&mut |k| s.get(k).map(|_| ()).map_err(Into::into))?)
        }
        Mode::Fresh => {
            // What a new process must do: connect, authenticate, fetch the metadata and the
            // directory (connect), and get a heap chunk (prepare).
            let client = racekv_client::Client::builder()
                .memnode(endpoint)
                .token("bench-spike")
                .connections_per_memnode(1)
                .connect()?;
            client.prepare()?;
            let ready = Instant::now();
            (ready, work(&mut |k| client.get(k).map(|_| ()).map_err(Into::into))?)
        }
    };
    Ok(Start { woke, ready, first_get })
}

fn spike(args: &SpikeArgs, mode: Mode, node: &Arc<Computenode>, endpoint: &str) -> anyhow::Result<SpikeRun> {
    let pool = &node.cluster().memnodes()[0].pool;
    let (contended_before, moves_before) = pool.contention();
    let ops = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // The trigger: a flag, and each new thread unparked directly. (A Barrier wakes its
    // waiters through one mutex, one after another: a convoy that delayed the last of 23
    // workers by hundreds of microseconds in both modes.)
    let go = Arc::new(AtomicBool::new(false));
    let spawn = |i: usize, gated: bool| {
        let (ops, stop, go, node, endpoint, keys) =
            (Arc::clone(&ops), Arc::clone(&stop), Arc::clone(&go), Arc::clone(node), endpoint.to_string(), args.keys);
        std::thread::spawn(move || {
            while gated && !go.load(Ordering::Acquire) {
                std::thread::park();
            }
            worker(mode, &node, &endpoint, keys, &ops, &stop, i as u64)
        })
    };
    let mut handles: Vec<_> = (0..args.workers_before).map(|i| spawn(i, false)).collect();
    // The new workers' threads exist and are parked before the trigger.
    handles.extend((args.workers_before..args.workers_after).map(|i| spawn(i, true)));
    std::thread::sleep(Duration::from_millis(50));
    let mut samples: Vec<(Instant, u64)> = Vec::new();
    let interval = Duration::from_micros(args.sample_us);
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(args.before_ms) {
        samples.push((Instant::now(), ops.load(Ordering::Relaxed)));
        std::thread::sleep(interval);
    }
    let trigger = Instant::now();
    go.store(true, Ordering::Release);
    for h in &handles[args.workers_before..] {
        h.thread().unpark();
    }
    while trigger.elapsed() < Duration::from_millis(args.after_ms) {
        samples.push((Instant::now(), ops.load(Ordering::Relaxed)));
        std::thread::sleep(interval);
    }
    stop.store(true, Ordering::Relaxed);
    // Rates from samples too short to hold a GET each say nothing: widen them (on 2 cores a
    // 100 us sample after the trigger often sees none, the workers outnumbering the cores).
    let per_bin = samples_per_bin(&samples, trigger);
    let samples: Vec<(Instant, u64)> = samples.iter().step_by(per_bin).copied().collect();
    let sample_us = args.sample_us * per_bin as u64;
    let since = |t: Instant| t.saturating_duration_since(trigger).as_secs_f64() * 1e3;
    let (mut woke, mut ready, mut first_ops) = (Vec::new(), Vec::new(), Vec::new());
    for (i, h) in handles.into_iter().enumerate() {
        let start = h.join().expect("worker thread")?;
        if i >= args.workers_before {
            woke.push(since(start.woke));
            ready.push(since(start.ready));
            first_ops.push(since(start.first_get));
        }
    }
    let (woke, ready, first_ops) = (sorted(woke), sorted(ready), sorted(first_ops));
    let (contended_after, moves_after) = pool.contention();
    // Throughput per sample interval, stamped at the interval's end.
    let rates: Vec<(f64, f64)> = samples
        .windows(2)
        .map(|w| {
            let dt = w[1].0.duration_since(w[0].0).as_secs_f64();
            let t = if w[1].0 >= trigger {
                w[1].0.duration_since(trigger).as_secs_f64()
            } else {
                -trigger.duration_since(w[1].0).as_secs_f64()
            };
            (t * 1e3, (w[1].1 - w[0].1) as f64 / dt)
        })
        .collect();
    let per_ms = (1000 / sample_us.max(1)).max(1) as usize;
    let after: Vec<(f64, f64)> = rates.iter().copied().filter(|p| p.0 >= 0.0).collect();
    let mut tail: Vec<f64> = after[after.len() / 2..].iter().map(|p| p.1).collect();
    tail.sort_by(|a, b| a.total_cmp(b));
    let plateau = tail[tail.len() / 2];
    anyhow::ensure!(
        plateau > 0.0,
        "{} run: most {} us samples after the trigger saw no completed GET (the plateau's median is 0 ops/s) \
         even widened to the whole run's quarter",
        mode.name(),
        sample_us
    );
    // The first moment from which the next 2 ms average at least 90% of the plateau.
    let hold = (2 * per_ms).min(after.len());
    let bootstrap_ms = (0..after.len().saturating_sub(hold))
        .find(|&i| after[i..i + hold].iter().map(|p| p.1).sum::<f64>() / hold as f64 >= 0.9 * plateau)
        .map(|i| after[i].0 - sample_us as f64 / 1e3)
        .unwrap_or(f64::NAN)
        .max(0.0);
    let before: Vec<f64> = rates.iter().filter(|p| p.0 < 0.0).map(|p| p.1).collect();
    // For the plot: a 1 ms moving average.
    let smoothed = rates
        .iter()
        .enumerate()
        .map(|(i, &(t, _))| {
            let window = &rates[i.saturating_sub(per_ms - 1)..=i];
            (t, window.iter().map(|w| w.1).sum::<f64>() / window.len() as f64)
        })
        .collect();
    Ok(SpikeRun {
        mode: mode.name(),
        sample_us,
        bootstrap_ms,
        plateau_ops_per_sec: plateau,
        before_ops_per_sec: before.iter().sum::<f64>() / before.len().max(1) as f64,
        woke_p50_ms: p50(&woke),
        woke_max_ms: max(&woke),
        ready_p50_ms: p50(&ready),
        ready_max_ms: max(&ready),
        first_op_p50_ms: p50(&first_ops),
        first_op_max_ms: max(&first_ops),
        pool_contended_ops: contended_after - contended_before,
        pool_moves: moves_after - moves_before,
        series: smoothed,
    })
}

/// Completed GETs the median sample after the trigger should hold for rates to mean something.
pub const MIN_GETS_PER_SAMPLE: u64 = 8;

/// Raw samples per sample the rates are taken over: the fewest (a power of two, leaving at
/// least 4 samples after the trigger) whose median count of completed GETs after the
/// trigger reaches [`MIN_GETS_PER_SAMPLE`].
fn samples_per_bin(samples: &[(Instant, u64)], trigger: Instant) -> usize {
    let after: Vec<u64> = samples.iter().filter(|s| s.0 >= trigger).map(|s| s.1).collect();
    let mut per_bin = 1;
    while per_bin * 8 <= after.len() {
        let mut counts: Vec<u64> = after.windows(per_bin + 1).step_by(per_bin).map(|w| w[per_bin] - w[0]).collect();
        counts.sort_unstable();
        if counts[counts.len() / 2] >= MIN_GETS_PER_SAMPLE {
            break;
        }
        per_bin *= 2;
    }
    per_bin
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn p50(sorted: &[f64]) -> f64 {
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

fn max(sorted: &[f64]) -> f64 {
    sorted.last().copied().unwrap_or(f64::NAN)
}
