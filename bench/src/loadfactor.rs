//! `racekv bench loadfactor`: fill a table that starts as one subtable with random keys until
//! the first insert that finds all four of its buckets full (the first split); report how
//! full the subtable was. RACE's two choices of combined buckets are what keep this high.

use clap::Args;
use racekv_hashing::TableOptions;
use racekv_transport::TransportKind;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::report::{progress, Environment};

/// Settings of `racekv bench loadfactor`.
#[derive(Debug, Clone, Args)]
pub struct LoadFactorArgs {
    /// Independent fills (fresh table and key sequence each).
    #[arg(long, default_value_t = 5)]
    pub trials: u32,
    /// Bucket groups per subtable (the default memnode setting is 256).
    #[arg(long, default_value_t = 256)]
    pub groups_per_subtable: u32,
    /// Value bytes.
    #[arg(long, default_value_t = 8)]
    pub value_size: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench loadfactor` measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadFactorReport {
    /// The benchmark's name, `loadfactor`.
    pub bench: &'static str,
    /// Bucket groups per subtable.
    pub groups_per_subtable: u32,
    /// Slots per subtable.
    pub slots_per_subtable: u64,
    /// Fills run.
    pub trials: u32,
    /// Mean over trials.
    pub load_factor_at_first_split: f64,
    /// Lowest load factor at the first split.
    pub min_load_factor: f64,
    /// Highest load factor at the first split.
    pub max_load_factor: f64,
    /// Each trial's load factor at the first split.
    pub per_trial: Vec<f64>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// Runs the benchmark.
pub fn run(args: &LoadFactorArgs) -> anyhow::Result<LoadFactorReport> {
    anyhow::ensure!(args.trials >= 1, "at least one trial");
    let mut per_trial = Vec::new();
    let mut slots = 0;
    let bar = progress(u64::from(args.trials), "trials");
    for trial in 0..args.trials {
        let memnode =
            BenchMemnode::start(TransportKind::Shm, 64 << 20, args.groups_per_subtable, None, "loadfactor", false)?;
        let (table, conn) = memnode.table(TableOptions::default())?;
        slots = table.layout().slots_per_subtable();
        let mut c = table.client(conn);
        let mut rng = SmallRng::seed_from_u64(0x10AD + u64::from(trial));
        let value = vec![1u8; args.value_size];
        let mut stored = 0u64;
        loop {
            let key: [u8; 16] = rng.random();
            let splits_before = c.stats().split_requests;
            c.put(&key, &value)?;
            if c.stats().split_requests > splits_before {
                break; // this insert needed a split; it is not counted
            }
            stored += 1;
            anyhow::ensure!(stored <= slots, "stored more keys than one subtable has slots: the table split silently");
        }
        per_trial.push(stored as f64 / slots as f64);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let mean = per_trial.iter().sum::<f64>() / per_trial.len() as f64;
    Ok(LoadFactorReport {
        bench: "loadfactor",
        groups_per_subtable: args.groups_per_subtable,
        slots_per_subtable: slots,
        trials: args.trials,
        load_factor_at_first_split: mean,
        min_load_factor: per_trial.iter().copied().fold(f64::INFINITY, f64::min),
        max_load_factor: per_trial.iter().copied().fold(0.0, f64::max),
        per_trial,
        environment: Environment::capture(),
    })
}
