//! `racekv-memnode`: runs a memory node until SIGTERM or SIGINT; SIGHUP reloads its TLS
//! certificate.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use racekv_memnode::bytes::parse_bytes;
use racekv_memnode::{Memnode, MemnodeConfig};

/// A racekv memory node: one region with a RACE hash table, served over shm, tcp or verbs.
///
/// Settings come from defaults, then --config (TOML), then RACEKV_MEMNODE_<KEY> variables,
/// then these flags. Listener flags take `none` to turn a default listener off.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Region size, e.g. 1GiB (fixed once the region is formatted).
    #[arg(long, value_parser = parse_bytes)]
    region_bytes: Option<u64>,
    /// Back the region with this file; restarting on it reopens the table.
    #[arg(long)]
    data_file: Option<PathBuf>,
    /// Back an anonymous region with huge pages.
    #[arg(long)]
    huge_pages: bool,
    /// Unix socket for same-host (shm) clients, or `none`.
    #[arg(long)]
    listen_shm: Option<String>,
    /// host:port for tcp clients, or `none`.
    #[arg(long)]
    listen_tcp: Option<String>,
    /// host:port for the verbs control channel, or `none`.
    #[arg(long)]
    listen_verbs: Option<String>,
    /// Shared secret clients must prove they know (prefer `token_file` in the config, or
    /// RACEKV_MEMNODE_TOKEN_FILE: flags show in `ps`).
    #[arg(long)]
    token: Option<String>,
    /// Prometheus endpoint address, or `none`.
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Bucket groups per subtable (power of two).
    #[arg(long)]
    groups_per_subtable: Option<u32>,
    /// Bytes per KV chunk handed to clients, e.g. 1MiB.
    #[arg(long, value_parser = parse_bytes)]
    chunk_bytes: Option<u64>,
    /// etcd endpoints, comma-separated (`http://host:port`): register in the cluster's
    /// list under a lease (builds with the `etcd` feature).
    #[arg(long, value_delimiter = ',')]
    etcd: Option<Vec<String>>,
    /// The cluster's name in etcd.
    #[arg(long)]
    cluster: Option<String>,
    /// Endpoints to register in etcd, comma-separated (default: the ones it listens on).
    #[arg(long, value_delimiter = ',')]
    advertise: Option<Vec<String>>,
    /// Print the effective configuration as TOML (secrets shown as ***) and exit.
    #[arg(long)]
    print_config: bool,
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, env = "RACEKV_LOG_FORMAT", default_value = "text")]
    log_format: racekv_telemetry::LogFormat,
}

fn optional(value: Option<String>, current: &mut Option<String>) {
    if let Some(v) = value {
        *current = (v != "none" && !v.is_empty()).then_some(v);
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    racekv_telemetry::init_logging_as(args.log_format);
    let mut cfg = MemnodeConfig::load(args.config.as_deref())?;
    if let Some(v) = args.region_bytes {
        cfg.region_bytes = v;
    }
    if let Some(v) = args.data_file {
        cfg.data_file = Some(v);
    }
    cfg.huge_pages |= args.huge_pages;
    let mut shm = cfg.listen_shm.as_ref().map(|p| p.display().to_string());
    optional(args.listen_shm, &mut shm);
    cfg.listen_shm = shm.map(PathBuf::from);
    optional(args.listen_tcp, &mut cfg.listen_tcp);
    optional(args.listen_verbs, &mut cfg.listen_verbs);
    if let Some(v) = args.token {
        cfg.token = v;
    }
    if let Some(v) = args.metrics_addr {
        cfg.metrics_addr = if v == "none" { None } else { Some(v.parse::<SocketAddr>().context("--metrics-addr")?) };
    }
    if let Some(v) = args.groups_per_subtable {
        cfg.groups_per_subtable = v;
    }
    if let Some(v) = args.chunk_bytes {
        cfg.chunk_bytes = v;
    }
    if let Some(v) = args.etcd {
        cfg.etcd_endpoints = v;
    }
    if let Some(v) = args.cluster {
        cfg.cluster = v;
    }
    if let Some(v) = args.advertise {
        cfg.advertise_endpoints = v;
    }
    if args.print_config {
        print!("{}", racekv_telemetry::secret::redacted_toml(&cfg, racekv_memnode::config::SECRET_KEYS)?);
        return Ok(());
    }

    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let memnode = Memnode::start(cfg)?;
    tracing::info!("memnode ready: {}", memnode.ready_line());
    // For supervisors and tests: one machine-readable line on stdout.
    println!("READY {}", memnode.ready_line());
    racekv_telemetry::systemd::notify_ready(&memnode.ready_line());
    let signal = signals.forever().find(|&signal| {
        if signal != SIGHUP {
            return true;
        }
        match memnode.reload_tls() {
            Ok(true) => {}
            Ok(false) => tracing::info!("SIGHUP: no TLS certificate configured, nothing to reload"),
            Err(e) => tracing::error!("{e:#}"),
        }
        false
    });
    tracing::info!(?signal, "shutting down");
    racekv_telemetry::systemd::notify_stopping();
    memnode.shutdown()?;
    tracing::info!("memnode stopped cleanly");
    Ok(())
}
