//! `racekv-computenode`: runs a compute node until SIGTERM or SIGINT; SIGHUP reloads the
//! front ends' TLS certificate.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;

/// A racekv compute node: pre-initialized connections to the memnodes, autoscaled workers,
/// and the front ends (Redis protocol, local attach).
///
/// Settings come from defaults, then --config (TOML), then RACEKV_COMPUTENODE_<KEY>
/// variables, then these flags. Front-end flags take `none` to turn one off.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Memnode endpoints, comma-separated (shm:/path, tcp:host:port, verbs:host:port).
    #[arg(long, value_delimiter = ',')]
    memnodes: Option<Vec<String>>,
    /// etcd endpoints, comma-separated (`http://host:port`): take the memnodes and the
    /// routing of keys from the cluster map (builds with the `etcd` feature).
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// The cluster's name in etcd.
    #[arg(long)]
    cluster: Option<String>,
    /// The memnodes' shared secret (prefer `token_file` in the config, or
    /// RACEKV_COMPUTENODE_TOKEN_FILE: flags show in `ps`).
    #[arg(long)]
    token: Option<String>,
    /// Redis front end address, or `none`.
    #[arg(long)]
    redis_addr: Option<String>,
    /// Unix socket local processes attach to, or `none`.
    #[arg(long)]
    attach_socket: Option<String>,
    /// Remote-client address (request/reply over RPC), or `none`.
    #[arg(long)]
    remote_addr: Option<String>,
    /// Prometheus /metrics and JSON /status address, or `none`.
    #[arg(long)]
    metrics_addr: Option<String>,
    #[arg(long)]
    connections_per_memnode: Option<usize>,
    #[arg(long)]
    min_workers: Option<usize>,
    #[arg(long)]
    max_workers: Option<usize>,
    /// Cache mode: bytes of live data per memnode (`100mb`, `1gb`; 0: no limit), or a
    /// share of each memnode's region (`50%`).
    #[arg(long)]
    maxmemory: Option<String>,
    /// noeviction, allkeys-random, volatile-random or volatile-ttl (LRU/LFU: not yet).
    #[arg(long)]
    maxmemory_policy: Option<String>,
    /// Keys sampled per evicted key (1 to 64).
    #[arg(long)]
    maxmemory_samples: Option<u32>,
    /// Print the effective configuration as TOML (secrets shown as ***) and exit.
    #[arg(long)]
    print_config: bool,
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, env = "RACEKV_LOG_FORMAT", default_value = "text")]
    log_format: racekv_telemetry::LogFormat,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    racekv_telemetry::init_logging_as(args.log_format);
    let mut cfg = ComputenodeConfig::load(args.config.as_deref())?;
    if let Some(v) = args.memnodes {
        cfg.memnodes = v;
    }
    if let Some(v) = args.etcd {
        cfg.etcd_endpoints = v;
    }
    if let Some(v) = args.cluster {
        cfg.cluster = v;
    }
    if let Some(v) = args.token {
        cfg.token = v;
    }
    if let Some(v) = args.redis_addr {
        cfg.redis_addr = (v != "none").then_some(v);
    }
    if let Some(v) = args.attach_socket {
        cfg.attach_socket = (v != "none").then(|| PathBuf::from(v));
    }
    if let Some(v) = args.remote_addr {
        cfg.remote_addr = (v != "none").then_some(v);
    }
    if let Some(v) = args.metrics_addr {
        cfg.metrics_addr = if v == "none" { None } else { Some(v.parse::<SocketAddr>().context("--metrics-addr")?) };
    }
    if let Some(v) = args.connections_per_memnode {
        cfg.connections_per_memnode = v;
    }
    if let Some(v) = args.min_workers {
        cfg.min_workers = v;
    }
    if let Some(v) = args.max_workers {
        cfg.max_workers = v;
    }
    if let Some(v) = args.maxmemory {
        cfg.maxmemory = racekv_redis::maxmemory::Limit::parse(&v).map_err(anyhow::Error::msg).context("--maxmemory")?;
    }
    if let Some(v) = args.maxmemory_policy {
        cfg.maxmemory_policy = racekv_redis::maxmemory::MaxmemoryPolicy::parse(&v)
            .map_err(anyhow::Error::msg)
            .context("--maxmemory-policy")?
            .name()
            .into();
    }
    if let Some(v) = args.maxmemory_samples {
        cfg.maxmemory_samples = v;
    }
    if args.print_config {
        print!("{}", racekv_telemetry::secret::redacted_toml(&cfg, racekv_computenode::config::SECRET_KEYS)?);
        return Ok(());
    }
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let node = Computenode::start(cfg)?;
    tracing::info!("computenode ready: {}", node.ready_line());
    println!("READY {}", node.ready_line());
    racekv_telemetry::systemd::notify_ready(&node.ready_line());
    // SIGHUP re-reads the TLS files; anything else stops.
    let signal = signals.forever().find(|&signal| {
        if signal != SIGHUP {
            return true;
        }
        match node.reload_tls() {
            Ok(true) => {}
            Ok(false) => tracing::info!("SIGHUP: no TLS certificate configured, nothing to reload"),
            Err(e) => tracing::error!("{e:#}"),
        }
        false
    });
    tracing::info!(?signal, "shutting down");
    racekv_telemetry::systemd::notify_stopping();
    node.shutdown();
    tracing::info!("computenode stopped cleanly");
    Ok(())
}
