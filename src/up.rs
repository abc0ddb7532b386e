//! `racekv up`: a local cluster in this process, until Ctrl-C (with `--replicas`, a
//! coordinated one of child processes: [`crate::up_cluster`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_memnode::bytes::parse_bytes;
use racekv_memnode::{Memnode, MemnodeConfig};

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Number of memnodes.
    #[arg(long, default_value_t = 1)]
    memnodes: usize,
    /// Copies of each partition (1 to 5, at most --memnodes). Given, the cluster is
    /// coordinated: a local etcd holds the cluster map, each memnode runs as its own child
    /// process (started again on its data file if it dies), a memnode silent past its 1 s
    /// lease is failed over (R > 1), and `racekv status` shows their pids. Needs the `etcd`
    /// build and Debian's etcd-server.
    #[arg(long)]
    replicas: Option<u8>,
    /// The local etcd's client port (`--replicas`); the next port is its peer port.
    #[arg(long, default_value_t = 7379)]
    etcd_port: u16,
    /// Region size of each memnode, e.g. 1GiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_bytes)]
    region_bytes: u64,
    /// Keep each memnode's region in <DIR>/memnode-<i>.region, so the data outlives `up`.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// First tcp port; memnode i listens on base + i.
    #[arg(long, default_value_t = 7400)]
    base_port: u16,
    /// Port of the Redis front end.
    #[arg(long, default_value_t = 6380)]
    redis_port: u16,
    /// Port of the remote-client front end (`racekv_client` in remote mode).
    #[arg(long, default_value_t = 7410)]
    remote_port: u16,
    /// Most worker threads the computenode may scale to.
    #[arg(long, default_value_t = 64)]
    max_workers: usize,
    /// Prometheus /metrics and JSON /status (`none` to turn it off).
    #[arg(long, default_value = "127.0.0.1:9400")]
    metrics_addr: String,
    /// The computenode reaches the memnodes over loopback tcp, as across hosts, instead of
    /// shared memory (a stopped memnode then stops answering one-sided operations too).
    #[arg(long)]
    tcp_only: bool,
    /// The memnodes' shared secret.
    #[arg(long, env = "RACEKV_TOKEN", default_value = racekv_memnode::config::DEV_TOKEN, hide_env_values = true)]
    token: String,
}

/// This user's directory for racekv's sockets: where the computenode's attach socket
/// lives by default (so local clients find it), and the memnodes' sockets beside it.
pub fn runtime_dir() -> PathBuf {
    racekv_client::default_attach_socket().parent().map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!((1..=64).contains(&args.memnodes), "--memnodes must be within 1..=64");
    let run_dir = runtime_dir();
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    if let Some(dir) = &args.data_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let metrics_addr: Option<SocketAddr> = match args.metrics_addr.as_str() {
        "none" => None,
        a => Some(a.parse().context("--metrics-addr")?),
    };
    if let Some(replicas) = args.replicas {
        return crate::up_cluster::run(crate::up_cluster::Settings {
            memnodes: args.memnodes,
            replicas,
            region_bytes: args.region_bytes,
            data_dir: args.data_dir,
            base_port: args.base_port,
            etcd_port: args.etcd_port,
            redis_port: args.redis_port,
            remote_port: args.remote_port,
            max_workers: args.max_workers,
            metrics_addr,
            token: args.token,
            run_dir,
            tcp_only: args.tcp_only,
        });
    }
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])?;
    let mut memnodes = Vec::new();
    for i in 0..args.memnodes {
        let cfg = MemnodeConfig {
            region_bytes: args.region_bytes,
            data_file: args.data_dir.as_ref().map(|d| d.join(format!("memnode-{i}.region"))),
            listen_shm: Some(run_dir.join(format!("memnode-{i}.sock"))),
            listen_tcp: Some(format!("127.0.0.1:{}", args.base_port + i as u16)),
            // One process, one registry: the computenode serves everyone's metrics.
            metrics_addr: None,
            token: args.token.clone(),
            ..MemnodeConfig::default()
        };
        memnodes.push(Memnode::start(cfg).with_context(|| format!("starting memnode {i}"))?);
    }
    let shm: Vec<String> = memnodes.iter().map(|m| m.endpoints()[0].to_string()).collect();
    let tcp: Vec<String> = memnodes.iter().map(|m| m.endpoints()[1].to_string()).collect();
    let computenode = Computenode::start(ComputenodeConfig {
        memnodes: if args.tcp_only { tcp.clone() } else { shm },
        token: args.token.clone(),
        redis_addr: Some(format!("127.0.0.1:{}", args.redis_port)),
        remote_addr: Some(format!("127.0.0.1:{}", args.remote_port)),
        max_workers: args.max_workers,
        metrics_addr,
        ..ComputenodeConfig::default()
    })
    .context("starting the computenode")?;
    println!("racekv is up: {} memnode(s) of {} each, 1 computenode", memnodes.len(), human(args.region_bytes));
    for (i, m) in memnodes.iter().enumerate() {
        let eps: Vec<String> = m.endpoints().iter().map(|e| e.to_string()).collect();
        println!("  memnode {i}:   {}", eps.join("  "));
    }
    let redis = computenode.redis_addr().expect("configured");
    println!(
        "  computenode: Redis protocol on {redis}, {} worker(s) autoscaled up to {}",
        computenode.status().workers,
        args.max_workers
    );
    let status = computenode.status();
    if let Some(socket) = &status.attach_socket {
        println!("  attach:      {socket}   (local processes: the client library's default)");
    }
    if let Some(remote) = computenode.remote_endpoint() {
        println!("  remote:      {remote}   (clients on other hosts: racekv --remote)");
    }
    if let Some(addr) = computenode.metrics_addr() {
        println!("  metrics:     http://{addr}/metrics   status: http://{addr}/status");
    }
    if let Some(dir) = &args.data_dir {
        println!("  data:        {} (kept after Ctrl-C)", dir.display());
    }
    println!();
    println!("try, from another shell:");
    println!("  redis-cli -p {} set greeting hello", redis.port());
    println!("  redis-cli -p {} get greeting", redis.port());
    println!("  racekv get greeting        (attaches to this computenode)");
    println!("  RACEKV_MEMNODES={} racekv get greeting   (embedded: own connections)", tcp.join(","));
    println!("Ctrl-C stops the cluster.");
    let signal = signals.forever().next();
    println!("stopping (signal {signal:?})");
    computenode.shutdown();
    for m in memnodes {
        m.shutdown()?;
    }
    println!("stopped cleanly");
    Ok(())
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}
