//! `racekv bench txn`: multi-key transactions (`racekv_client::txn`) against the single-key
//! operations they replace, on in-process memnodes, in the same run.
//!
//! * **Uncontended**, one thread: a 2-key transaction writing both keys (MSET's shape) vs
//!   two single SETs of the same keys; and a 2-key read-modify-write transaction (a
//!   transfer) vs two GETs and two SETs. Throughput and round trips per operation, from the
//!   table's round-trip counter.
//! * **Contended**: threads run transfers between two keys drawn zipf(`--zipf-theta`) from
//!   `--contended-keys` keys; commits per second and the abort rate (runs of a transaction's
//!   body that did not commit, over all runs).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use racekv_client::Client;
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::plot::{bar_chart, drawn, BarSeries};
use crate::report::{progress, Environment};

/// Settings of `racekv bench txn`.
#[derive(Debug, Clone, Args)]
pub struct TxnArgs {
    /// shm or tcp.
    #[arg(long, default_value = "tcp")]
    pub transport: TransportKind,
    /// In-process memnodes (keys spread over them: most 2-key transactions span two).
    #[arg(long, default_value_t = 2)]
    pub memnodes: usize,
    /// Operations of each uncontended kind.
    #[arg(long, default_value_t = 20_000)]
    pub ops: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// Threads of the contended run.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Keys of the contended run.
    #[arg(long, default_value_t = 1_000)]
    pub contended_keys: u64,
    /// Skew of the contended run's key choice.
    #[arg(long, default_value_t = 0.99)]
    pub zipf_theta: f64,
    /// Seconds of the contended run.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Where the PNG goes.
    #[arg(long, default_value = "docs/figures/txn.png")]
    pub plot: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One uncontended kind's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Uncontended {
    /// What ran.
    pub name: &'static str,
    /// Operations (transactions, or pairs of single-key operations) per second.
    pub ops_per_sec: f64,
    /// Round trips to memnodes per operation.
    pub round_trips_per_op: f64,
}

/// What `racekv bench txn` measured.
#[derive(Debug, Clone, Serialize)]
pub struct TxnReport {
    /// The benchmark's name, `txn`.
    pub bench: &'static str,
    /// Transport to the memnodes.
    pub transport: String,
    /// Memnodes.
    pub memnodes: usize,
    /// Value bytes.
    pub value_size: usize,
    /// The uncontended kinds, in pairs (a transaction, then what it replaces).
    pub uncontended: Vec<Uncontended>,
    /// Round trips of a 2-key write transaction over those of two SETs.
    pub write_round_trip_ratio: f64,
    /// Round trips of a transfer transaction over those of two GETs and two SETs.
    pub transfer_round_trip_ratio: f64,
    /// Contended run: threads.
    pub threads: usize,
    /// Contended run: keys.
    pub contended_keys: u64,
    /// Contended run: zipf skew.
    pub zipf_theta: f64,
    /// Contended run: committed transfers per second.
    pub contended_commits_per_sec: f64,
    /// Contended run: body runs that did not commit, over all runs.
    pub contended_abort_rate: f64,
    /// Contended run: transfers that gave up (conflicted every attempt).
    pub contended_gave_up: u64,
    /// The PNG written (None: no font, see `plot::drawn`).
    pub plot: Option<String>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// The table's round trips so far in this process (its counters publish every few hundred
/// operations per client: runs of thousands make the error small).
fn round_trips() -> u64 {
    racekv_telemetry::metric::counter_total("racekv_table_round_trips_total")
}

fn key(i: u64) -> Vec<u8> {
    format!("txn-{i:08}").into_bytes()
}

fn number(value: Option<Vec<u8>>) -> i64 {
    value.and_then(|v| String::from_utf8(v).ok()?.parse().ok()).unwrap_or(0)
}

/// Runs `op` `n` times (`i` = 0..n); returns (ops/s, round trips per op).
fn measure(name: &'static str, n: u64, mut op: impl FnMut(u64) -> anyhow::Result<()>) -> anyhow::Result<Uncontended> {
    let bar = progress(n, name);
    let before = round_trips();
    let started = Instant::now();
    for i in 0..n {
        op(i)?;
        if i % 1024 == 0 {
            bar.set_position(i);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let trips = round_trips().saturating_sub(before);
    Ok(Uncontended { name, ops_per_sec: n as f64 / seconds, round_trips_per_op: trips as f64 / n as f64 })
}

/// Runs the benchmark.
pub fn run(args: &TxnArgs) -> anyhow::Result<TxnReport> {
    anyhow::ensure!(args.memnodes >= 1 && args.ops >= 1 && args.threads >= 1, "memnodes, ops and threads >= 1");
    anyhow::ensure!(args.contended_keys >= 2, "the contended run needs two keys at least");
    let token = "racekv-bench-token";
    let memnodes: Vec<BenchMemnode> = (0..args.memnodes)
        .map(|_| BenchMemnode::start(args.transport, 512 << 20, 256, None, token, false))
        .collect::<anyhow::Result<_>>()?;
    let connect = || {
        Client::builder()
            .memnodes(memnodes.iter().map(|m| m.endpoint().to_string()))
            .token(token)
            .timeout(Duration::from_secs(10))
            .connect()
    };
    let client = connect()?;
    let value = vec![b'v'; args.value_size];
    let n = args.ops;
    // Keys exist first: every kind then updates, as a steady workload does.
    for i in 0..2 * n {
        client.put(&key(i), &value)?;
    }
    let mset = measure("2-key write transaction", n, |i| {
        client.transaction(|tx| {
            tx.put(&key(2 * i), &value);
            tx.put(&key(2 * i + 1), &value);
            Ok(())
        })?;
        Ok(())
    })?;
    let sets = measure("two SETs", n, |i| {
        client.put(&key(2 * i), &value)?;
        client.put(&key(2 * i + 1), &value)?;
        Ok(())
    })?;
    for i in 0..2 * n {
        client.put(&key(i), b"100")?;
    }
    let transfer = measure("transfer transaction", n, |i| {
        client.transaction(|tx| {
            let a = number(tx.get(&key(2 * i))?);
            let b = number(tx.get(&key(2 * i + 1))?);
            tx.put(&key(2 * i), (a - 1).to_string().as_bytes());
            tx.put(&key(2 * i + 1), (b + 1).to_string().as_bytes());
            Ok(())
        })?;
        Ok(())
    })?;
    let plain = measure("two GETs, two SETs", n, |i| {
        let a = number(client.get(&key(2 * i))?);
        let b = number(client.get(&key(2 * i + 1))?);
        client.put(&key(2 * i), (a + 1).to_string().as_bytes())?;
        client.put(&key(2 * i + 1), (b - 1).to_string().as_bytes())?;
        Ok(())
    })?;

    // Contended: transfers among few keys, zipf-skewed.
    for i in 0..args.contended_keys {
        client.put(&key(i), b"1000")?;
    }
    let stop = AtomicBool::new(false);
    let (commits, runs, gave_up) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let zipf = Zipf::new(args.contended_keys as f64, args.zipf_theta)?;
    let started = Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let (stop, commits, runs, gave_up, client) = (&stop, &commits, &runs, &gave_up, connect());
                s.spawn(move || -> anyhow::Result<()> {
                    let client = client?;
                    let mut rng = SmallRng::seed_from_u64(t as u64 + 1);
                    while !stop.load(Ordering::Relaxed) {
                        let a = zipf.sample(&mut rng) as u64 - 1;
                        let mut b = zipf.sample(&mut rng) as u64 - 1;
                        if a == b {
                            b = (a + 1 + rng.random_range(0..args.contended_keys - 1)) % args.contended_keys;
                        }
                        let result = client.transaction(|tx| {
                            runs.fetch_add(1, Ordering::Relaxed);
                            let x = number(tx.get(&key(a))?);
                            let y = number(tx.get(&key(b))?);
                            tx.put(&key(a), (x - 1).to_string().as_bytes());
                            tx.put(&key(b), (y + 1).to_string().as_bytes());
                            Ok(())
                        });
                        match result {
                            Ok(()) => commits.fetch_add(1, Ordering::Relaxed),
                            Err(racekv_client::ClientError::Conflict(_)) => gave_up.fetch_add(1, Ordering::Relaxed),
                            Err(e) => return Err(e.into()),
                        };
                    }
                    Ok(())
                })
            })
            .collect();
        let bar = progress((args.seconds * 10.0) as u64, "contended transfers");
        while started.elapsed().as_secs_f64() < args.seconds {
            std::thread::sleep(Duration::from_millis(100));
            bar.inc(1);
        }
        bar.finish_and_clear();
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.join().expect("a contended thread")?;
        }
        Ok(())
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let total: i64 = (0..args.contended_keys).map(|i| client.get(&key(i)).map(number)).sum::<Result<i64, _>>()?;
    anyhow::ensure!(total == 1000 * args.contended_keys as i64, "the contended transfers lost money: {total}");
    let (commits, runs) = (commits.load(Ordering::Relaxed), runs.load(Ordering::Relaxed));

    let uncontended = vec![mset, sets, transfer, plain];
    let plot = drawn(
        &args.plot,
        bar_chart(
            &args.plot,
            &format!("2-key transactions vs single-key operations ({}, {} memnodes)", args.transport, args.memnodes),
            "round trips per operation",
            &uncontended.iter().map(|u| u.name.to_string()).collect::<Vec<_>>(),
            &[BarSeries {
                name: "round trips".into(),
                values: uncontended.iter().map(|u| u.round_trips_per_op).collect(),
            }],
        ),
    );
    Ok(TxnReport {
        bench: "txn",
        transport: args.transport.to_string(),
        memnodes: args.memnodes,
        value_size: args.value_size,
        write_round_trip_ratio: uncontended[0].round_trips_per_op / uncontended[1].round_trips_per_op,
        transfer_round_trip_ratio: uncontended[2].round_trips_per_op / uncontended[3].round_trips_per_op,
        uncontended,
        threads: args.threads,
        contended_keys: args.contended_keys,
        zipf_theta: args.zipf_theta,
        contended_commits_per_sec: commits as f64 / seconds,
        contended_abort_rate: if runs == 0 { 0.0 } else { (runs - commits) as f64 / runs as f64 },
        contended_gave_up: gave_up.load(Ordering::Relaxed),
        plot,
        environment: Environment::capture(),
    })
}
