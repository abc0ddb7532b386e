//! `racekv bench reclaim`: how long a memnode's start takes to find the heap space nothing
//! references (`racekv_hashing::reclaim`), on a data file holding K keys after processes
//! that deleted some of them crashed without giving anything back. Baseline, same run: one
//! sequential pass over the same heap bytes (xxh3 of the mapped region), what reading
//! everything would cost; the reclaim reads only the subtables.

use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use racekv_hashing::TableOptions;
use racekv_memnode::{Memnode, MemnodeConfig};
use racekv_transport::{ConnectOptions, Connection, Endpoint};
use serde::Serialize;

use crate::cluster::load_keys;
use crate::report::Environment;

/// Settings of `racekv bench reclaim`.
#[derive(Debug, Clone, Args)]
pub struct ReclaimArgs {
    /// Keys written before the crash.
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// Of the keys, this share is deleted by the process that crashes (its blocks leak).
    #[arg(long, default_value_t = 0.5)]
    pub deleted_fraction: f64,
    /// Restarts timed.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench reclaim` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ReclaimReport {
    /// The benchmark's name, `reclaim`.
    pub bench: &'static str,
    /// Keys written.
    pub keys: u64,
    /// Value bytes.
    pub value_size: usize,
    /// Share of the keys deleted by the crashing process.
    pub deleted_fraction: f64,
    /// The region's length in bytes.
    pub region_bytes: u64,
    /// Heap below the top when the memnode restarted.
    pub heap_bytes: u64,
    /// Heap bytes the remaining keys' slots reference.
    pub live_bytes: u64,
    /// Heap handed out before the restart, and after it.
    pub heap_used_bytes_before: u64,
    /// Heap bytes handed out after the restart.
    pub heap_used_bytes_after: u64,
    /// Bytes the reclaim made free.
    pub reclaimed_free_bytes: u64,
    /// Medians over the rounds (restarts of the same data file; the figures above are the
    /// first one's).
    pub reclaim_ms: f64,
    /// Median memnode start (reclaim included), in milliseconds.
    pub start_ms: f64,
    /// Median time of one sequential pass (xxh3) over the same heap bytes, in milliseconds.
    pub heap_scan_ms: f64,
    /// Reclaim time over that pass.
    pub reclaim_over_scan: f64,
    /// Where and when it ran.
    pub environment: Environment,
}

fn connect(endpoint: &Endpoint) -> anyhow::Result<std::sync::Arc<dyn Connection>> {
    let options = ConnectOptions::new("reclaim", Duration::from_secs(30));
    racekv_transport::connect(endpoint, &options).with_context(|| format!("connecting to {endpoint}"))
}

fn heap_used_bytes(memnode: &Memnode) -> anyhow::Result<u64> {
    Ok(memnode.stats()?.heap.heap_used_bytes)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(args: &ReclaimArgs) -> anyhow::Result<ReclaimReport> {
    anyhow::ensure!(args.keys >= 1 && args.rounds >= 1, "keys and rounds must be at least 1");
    anyhow::ensure!((0.0..=1.0).contains(&args.deleted_fraction), "deleted_fraction is a share (0..=1)");
    let dir = tempfile::tempdir()?;
    let region_bytes = (args.keys * (args.value_size as u64 + 192) * 2 + (256 << 20)).div_ceil(1 << 20) << 20;
    let config = MemnodeConfig {
        region_bytes,
        data_file: Some(dir.path().join("region.dat")),
        listen_shm: Some(dir.path().join("memnode.sock")),
        listen_tcp: None,
        metrics_addr: None,
        token: "reclaim".into(),
        // The crashed loader's connection is idle: no stale writer to wait for, and the
        // start times below are the reclaim's and the rest of the start's only.
        reopen_fence_ms: 0,
        ..MemnodeConfig::default()
    };
    let memnode = Memnode::start(config.clone()).context("starting the memnode")?;
    {
        // The process that crashes: loads the keys, deletes a share, leaves with all it held.
        let conn = connect(&memnode.endpoints()[0])?;
        let table = ManuallyDrop::new(racekv_hashing::Table::open(conn.clone(), TableOptions::default())?);
        let mut c = ManuallyDrop::new(table.client(conn));
        load_keys(&mut c, args.keys, &vec![5u8; args.value_size])?;
        let deleted = (args.keys as f64 * args.deleted_fraction) as u64;
        for k in 0..deleted {
            c.delete(&k.to_be_bytes())?;
        }
        c.flush()?;
    }
    let used_before = heap_used_bytes(&memnode)?;
    memnode.shutdown()?;

    // The baseline reads the same file through a mapping of its own (same page cache).
    let file = std::fs::OpenOptions::new().read(true).write(true).open(dir.path().join("region.dat"))?;
    let region = racekv_transport::Region::map_file(&file, region_bytes)?;
    let (mut reclaim_ms, mut start_ms, mut scan_ms) = (Vec::new(), Vec::new(), Vec::new());
    let mut heap_offset = 0;
    let mut first = None;
    for _ in 0..args.rounds {
        let started = Instant::now();
        let memnode = Memnode::start(config.clone()).context("restarting the memnode")?;
        start_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let found = memnode.start_reclaim().context("the restart did not reclaim")?.clone();
        reclaim_ms.push(found.duration.as_secs_f64() * 1e3);
        scan_ms.push(scan_heap_ms(&region, memnode.layout().heap_offset, found.reclaimed.heap_top_before)?);
        heap_offset = memnode.layout().heap_offset;
        // The first start finds the leak; later ones find the same heap already tidy.
        if first.is_none() {
            first = Some((found, heap_used_bytes(&memnode)?));
        }
        memnode.shutdown()?;
    }
    let (found, used_after) = first.expect("at least one round");
    let (reclaim_ms, heap_scan_ms) = (median(reclaim_ms), median(scan_ms));
    Ok(ReclaimReport {
        bench: "reclaim",
        keys: args.keys,
        value_size: args.value_size,
        deleted_fraction: args.deleted_fraction,
        region_bytes,
        heap_bytes: found.reclaimed.heap_top_before - heap_offset,
        live_bytes: found.reclaimed.live_bytes,
        heap_used_bytes_before: used_before,
        heap_used_bytes_after: used_after,
        reclaimed_free_bytes: found.reclaimed.free_bytes(),
        reclaim_ms,
        start_ms: median(start_ms),
        heap_scan_ms,
        reclaim_over_scan: reclaim_ms / heap_scan_ms,
        environment: Environment::capture(),
    })
}

/// One sequential pass (xxh3, 16 MiB at a time) over the heap [start, top).
fn scan_heap_ms(region: &racekv_transport::Region, start: u64, top: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut buf = vec![0u8; 16 << 20];
    let mut hash = 0u64;
    let mut at = start;
    while at < top {
        let n = (top - at).min(buf.len() as u64) as usize;
        region.read(at, &mut buf[..n]).map_err(|e| anyhow::anyhow!("reading the heap: {e}"))?;
        hash ^= xxhash_rust::xxh3::xxh3_64(&buf[..n]);
        at += n as u64;
    }
    std::hint::black_box(hash);
    Ok(started.elapsed().as_secs_f64() * 1e3)
}
