//! `racekv bench attach`: how long a worker waits for a usable session.
//!
//! * attach: [`Computenode::attach`], which hands out a pre-initialized session over
//!   virtual connections (KRCORE's virtual QP);
//! * fresh: what a worker pays on its own on the same transport: connect and authenticate,
//!   fetch the metadata, load the directory (an embedded-mode client), then one GET so the
//!   session is proven usable.
//!
//! Both are followed by the same first GET in the attach case too, reported separately.

use std::time::Instant;

use clap::Args;
use hdrhistogram::Histogram;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::report::{progress, Environment};

/// Settings of `racekv bench attach`.
#[derive(Debug, Clone, Args)]
pub struct AttachArgs {
    /// Transport between the computenode and its memnode: shm, tcp (or verbs).
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Attaches to time.
    #[arg(long, default_value_t = 20_000)]
    pub attaches: u32,
    /// Fresh bootstraps to time.
    #[arg(long, default_value_t = 200)]
    pub fresh: u32,
    /// Connections a fresh worker opens (as the daemon's pool has per memnode).
    #[arg(long, default_value_t = 1)]
    pub fresh_connections: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What `racekv bench attach` measured (times in microseconds).
#[derive(Debug, Clone, Serialize)]
pub struct AttachReport {
    /// The benchmark's name, `attach`.
    pub bench: &'static str,
    /// Transport between the computenode and its memnode.
    pub transport: String,
    /// Attaches timed.
    pub attaches: u32,
    /// Median attach.
    pub attach_p50_us: f64,
    /// 99th percentile attach.
    pub attach_p99_us: f64,
    /// Attach plus the first GET.
    pub attach_then_get_p50_us: f64,
    /// 99th percentile of attach plus the first GET.
    pub attach_then_get_p99_us: f64,
    /// Fresh bootstraps timed.
    pub fresh: u32,
    /// Median fresh bootstrap (own connections, then the first GET).
    pub fresh_p50_us: f64,
    /// 99th percentile fresh bootstrap.
    pub fresh_p99_us: f64,
    /// fresh p50 / attach-then-get p50.
    pub speedup_p50: f64,
    /// Where and when it ran.
    pub environment: Environment,
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Runs the benchmark.
pub fn run(args: &AttachArgs) -> anyhow::Result<AttachReport> {
    let memnode = BenchMemnode::start(args.transport, 256 << 20, 256, None, "bench-attach", false)?;
    let endpoint = memnode.endpoint().to_string();
    let node = Computenode::start(ComputenodeConfig {
        memnodes: vec![endpoint.clone()],
        token: "bench-attach".into(),
        redis_addr: None,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ready_sessions: 64,
        ..ComputenodeConfig::default()
    })?;
    {
        let mut s = node.attach();
        s.put(b"bench-key", b"value")?;
    }
    std::thread::sleep(std::time::Duration::from_millis(200)); // let the ready queue fill

    let mut attach = Histogram::<u64>::new(3)?;
    let mut attach_get = Histogram::<u64>::new(3)?;
    let bar = progress(u64::from(args.attaches), "attach");
    for i in 0..args.attaches {
        let started = Instant::now();
        let mut s = node.attach();
        attach.record(started.elapsed().as_nanos() as u64)?;
        let found = s.get(b"bench-key")?.is_some();
        attach_get.record(started.elapsed().as_nanos() as u64)?;
        anyhow::ensure!(found, "the attached session could not read");
        drop(s);
        if i % 1024 == 0 {
            bar.set_position(u64::from(i));
        }
    }
    bar.finish_and_clear();

    let mut fresh = Histogram::<u64>::new(3)?;
    let bar = progress(u64::from(args.fresh), "fresh");
    for _ in 0..args.fresh {
        let started = Instant::now();
        let client = racekv_client::Client::builder()
            .memnode(&endpoint)
            .token("bench-attach")
            .connections_per_memnode(args.fresh_connections)
            .connect()?;
        anyhow::ensure!(client.get(b"bench-key")?.is_some(), "the fresh client could not read");
        fresh.record(started.elapsed().as_nanos() as u64)?;
        drop(client);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(AttachReport {
        bench: "attach",
        transport: args.transport.to_string(),
        attaches: args.attaches,
        attach_p50_us: us(&attach, 0.5),
        attach_p99_us: us(&attach, 0.99),
        attach_then_get_p50_us: us(&attach_get, 0.5),
        attach_then_get_p99_us: us(&attach_get, 0.99),
        fresh: args.fresh,
        fresh_p50_us: us(&fresh, 0.5),
        fresh_p99_us: us(&fresh, 0.99),
        speedup_p50: us(&fresh, 0.5) / us(&attach_get, 0.5).max(1e-9),
        environment: Environment::capture(),
    })
}
