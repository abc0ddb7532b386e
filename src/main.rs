//! `racekv`: run a local cluster, read and write keys, inspect a cluster, run benchmarks.

#![forbid(unsafe_code)]

mod cluster;
mod doctor;
mod healer;
mod membership;
mod rejoin;
mod up;
mod up_cluster;

use std::io::Write;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use racekv_bench::{
    attach, cache, churn, coldstart, large, loadfactor, ops, reclaim, redis, rpc, scan, spike, txn, ycsb,
};
use racekv_client::Client;

/// racekv: a disaggregated key-value store (RACE hashing over one-sided operations).
#[derive(Debug, Parser)]
#[command(name = "racekv", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a local cluster on this machine and keep it running until Ctrl-C.
    Up(up::UpArgs),
    /// Print the value of a key.
    Get {
        key: String,
        #[command(flatten)]
        target: Target,
    },
    /// Set a key to a value.
    Put {
        key: String,
        value: String,
        /// Make the key expire this many milliseconds from now (as Redis' `SET ... PX`).
        #[arg(long)]
        ttl_ms: Option<u64>,
        #[command(flatten)]
        target: Target,
    },
    /// Delete a key.
    Del {
        key: String,
        #[command(flatten)]
        target: Target,
    },
    /// Show each memnode's capacity, use and load factor, and the computenode's workers and
    /// connections.
    Status {
        #[command(flatten)]
        target: Target,
        /// The computenode's metrics addresses to try, first answer wins (its JSON /status),
        /// or `none`. The defaults: a computenode daemon's, then `racekv up`'s.
        #[arg(
            long,
            env = "RACEKV_STATUS_FROM",
            value_delimiter = ',',
            default_value = "127.0.0.1:9401,127.0.0.1:9400"
        )]
        computenode: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The coordinated cluster's state in etcd (the `etcd` build).
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(Bench),
    /// Check this host for RDMA devices, ports and GIDs, the memlock limit and huge pages.
    Doctor,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Table operations: throughput, latency, round trips, CAS retries.
    Ops(ops::OpsArgs),
    /// Load factor of one subtable at its first split.
    Loadfactor(loadfactor::LoadFactorArgs),
    /// Heap bytes before and after many updates of a fixed key set.
    Churn(churn::ChurnArgs),
    /// Attach latency vs a worker building its own connections.
    Attach(attach::AttachArgs),
    /// KRCORE's load spike: bootstrap of N-1 new workers, virtualized vs fresh (writes a PNG).
    Spike(spike::SpikeArgs),
    /// GETs through the Redis front end vs a real redis-server, same redis-benchmark flags.
    Redis(redis::RedisArgs),
    /// SCAN of every key through the Redis front end vs a real redis-server, same COUNT.
    Scan(scan::ScanArgs),
    /// SET/GET of 1-100 MiB values through the Redis front end vs a real redis-server (MB/s, PNG).
    Large(large::LargeArgs),
    /// RPC: per-thread, lock-shared and FLOCK-coalescing connections; writes a PNG plot.
    Rpc(rpc::RpcArgs),
    /// A new process's start to its first completed GET: attached vs embedded.
    Coldstart(coldstart::ColdstartArgs),
    /// A memnode start's reclaim of the heap space nothing references, after a crash.
    Reclaim(reclaim::ReclaimArgs),
    /// YCSB workloads A-F: racekv native and through RESP vs redis-server and valkey-server.
    Ycsb(ycsb::YcsbArgs),
    /// 2-key transactions vs two single-key operations (round trips), and under contention.
    Txn(txn::TxnArgs),
    /// Cache mode: hit ratio per eviction policy vs redis-server, and GET throughput with and without a limit.
    Cache(cache::CacheArgs),
}

/// Which cluster to talk to, and how: attached to the local computenode (the default),
/// embedded (`--memnode`: this process connects to the memnodes itself) or remote
/// (`--remote`: a computenode on another host).
#[derive(Debug, Args)]
struct Target {
    /// Embedded mode: memnode endpoints (comma-separated): shm:/path, tcp:host:port or verbs:host:port.
    #[arg(long = "memnode", env = "RACEKV_MEMNODES", value_delimiter = ',')]
    memnodes: Vec<String>,
    /// Attached mode through this computenode socket (default: the local daemon's).
    #[arg(long, env = "RACEKV_ATTACH")]
    attach: Option<std::path::PathBuf>,
    /// Remote mode through a computenode's remote front end (host:port).
    #[arg(long, env = "RACEKV_REMOTE")]
    remote: Option<String>,
    /// The memnodes' shared secret (embedded mode).
    #[arg(long, env = "RACEKV_TOKEN", default_value = "racekv-dev-token", hide_env_values = true)]
    token: String,
    /// Attached and remote modes: the computenode's user (its ACL's; default `default`).
    #[arg(long, env = "RACEKV_USER")]
    user: Option<String>,
    /// Attached and remote modes: the user's password (prefer RACEKV_PASSWORD: flags show
    /// in `ps`).
    #[arg(long, env = "RACEKV_PASSWORD", hide_env_values = true)]
    password: Option<String>,
}

impl Target {
    fn client(&self) -> anyhow::Result<Client> {
        let mut builder = Client::builder().token(self.token.clone());
        if let Some(user) = &self.user {
            builder = builder.user(user.clone());
        }
        if let Some(password) = &self.password {
            builder = builder.password(password.clone());
        }
        let target = if let Some(remote) = &self.remote {
            builder = builder.remote(remote.clone());
            format!("the computenode at {remote}")
        } else if !self.memnodes.is_empty() {
            builder = builder.memnodes(self.memnodes.iter().cloned());
            self.memnodes.join(", ")
        } else {
            let socket = self.attach.clone().unwrap_or_else(racekv_client::default_attach_socket);
            builder = builder.attach(&socket);
            format!("the computenode at {}", socket.display())
        };
        builder.connect().with_context(|| format!("connecting to {target} (is `racekv up` running?)"))
    }
}

fn print<T: serde::Serialize + std::fmt::Debug>(report: &T, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    racekv_telemetry::init_logging();
    match Cli::parse().command {
        Command::Up(args) => up::run(args),
        Command::Doctor => doctor::run(),
        Command::Cluster(command) => cluster::run(command),
        Command::Get { key, target } => match target.client()?.get(key.as_bytes())? {
            Some(value) => {
                if std::env::var_os(coldstart::FIRST_OP_ENV).is_some() {
                    eprintln!("{}{}", coldstart::FIRST_OP_PREFIX, racekv_client::attach::monotonic_ns());
                }
                std::io::stdout().write_all(&value)?;
                println!();
                Ok(())
            }
            None => {
                eprintln!("(not found)");
                std::process::exit(1);
            }
        },
        Command::Put { key, value, ttl_ms, target } => {
            let client = target.client()?;
            match ttl_ms {
                Some(ms) => client.put_ex(key.as_bytes(), value.as_bytes(), std::time::Duration::from_millis(ms))?,
                None => client.put(key.as_bytes(), value.as_bytes())?,
            }
            println!("OK");
            Ok(())
        }
        Command::Del { key, target } => {
            let existed = target.client()?.delete(key.as_bytes())?;
            println!("{}", if existed { "deleted" } else { "(not found)" });
            Ok(())
        }
        Command::Status { target, json, computenode } => status(&target.client()?, &computenode, json),
        Command::Bench(Bench::Ops(args)) => print(&ops::run(&args)?, args.json),
        Command::Bench(Bench::Loadfactor(args)) => print(&loadfactor::run(&args)?, args.json),
        Command::Bench(Bench::Churn(args)) => print(&churn::run(&args)?, args.json),
        Command::Bench(Bench::Attach(args)) => print(&attach::run(&args)?, args.json),
        Command::Bench(Bench::Spike(args)) => print(&spike::run(&args)?, args.json),
        Command::Bench(Bench::Redis(args)) => print(&redis::run(&args)?, args.json),
        Command::Bench(Bench::Scan(args)) => print(&scan::run(&args)?, args.json),
        Command::Bench(Bench::Large(args)) => print(&large::run(&args)?, args.json),
        Command::Bench(Bench::Rpc(args)) => print(&rpc::run(&args)?, args.json),
        Command::Bench(Bench::Coldstart(args)) => print(&coldstart::run(&args)?, args.json),
        Command::Bench(Bench::Reclaim(args)) => print(&reclaim::run(&args)?, args.json),
        Command::Bench(Bench::Ycsb(args)) => print(&ycsb::run(&args)?, args.json),
        Command::Bench(Bench::Txn(args)) => print(&txn::run(&args)?, args.json),
        Command::Bench(Bench::Cache(args)) => print(&cache::run(&args)?, args.json),
    }
}

/// The first computenode `/status` document one of `addrs` answers with (a memnode's, which
/// has no workers, does not count), and where.
fn find_computenode(addrs: &[String]) -> Option<(String, serde_json::Value)> {
    addrs.iter().find_map(|addr| {
        let status = computenode_status(addr).filter(|s| s.get("workers").is_some())?;
        Some((addr.clone(), status))
    })
}

/// The `/status` document at `addr`, if it answers.
fn computenode_status(addr: &str) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    if addr == "none" {
        return None;
    }
    let addr: std::net::SocketAddr = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /status HTTP/1.0\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    serde_json::from_str(text.split("\r\n\r\n").nth(1)?).ok()
}

fn status(client: &Client, computenode: &[String], json: bool) -> anyhow::Result<()> {
    let stats = client.stats();
    let found = find_computenode(computenode);
    let node = found.as_ref().map(|(_, status)| status.clone());
    let local = up_cluster::local_cluster(&up::runtime_dir());
    if json {
        let memnodes: Vec<_> = stats
            .iter()
            .map(|(ep, s)| match s {
                Ok(s) => serde_json::json!({"memnode": ep, "stats": s}),
                Err(e) => serde_json::json!({"memnode": ep, "error": e.to_string()}),
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"memnodes": memnodes, "computenode": node, "local_cluster": local})
            )?
        );
        return Ok(());
    }
    println!("{:<34} {:>12} {:>12} {:>10} {:>8} {:>6}", "MEMNODE", "REGION", "HEAP USED", "KEYS", "LOAD", "DEPTH");
    for (endpoint, s) in stats {
        match s {
            Ok(s) => println!(
                "{:<34} {:>12} {:>12} {:>10} {:>7.1}% {:>6}",
                endpoint,
                human(s.layout.region_len),
                human(s.heap.heap_used_bytes),
                s.items,
                s.load_factor * 100.0,
                s.global_depth
            ),
            Err(e) => println!("{endpoint:<34} unavailable: {e}"),
        }
    }
    match found {
        Some((addr, n)) => {
            println!();
            println!(
                "computenode at {addr}: {} worker(s), queue depth {}, {} ready session(s), Redis on {} ({} client(s))",
                n["workers"],
                n["queue_depth"],
                n["ready_sessions"],
                n["redis_addr"].as_str().unwrap_or("-"),
                n["redis_clients"]
            );
            for m in n["memnodes"].as_array().into_iter().flatten() {
                println!(
                    "  -> {:<30} {}/{} connections healthy, {} chunk(s) prefetched",
                    m["endpoint"].as_str().unwrap_or("?"),
                    m["healthy_connections"],
                    m["connections"],
                    m["prefetched_chunks"]
                );
            }
        }
        None => println!(
            "\ncomputenode: no status at {} (not running, or elsewhere: --computenode ADDR)",
            computenode.join(" or ")
        ),
    }
    if let Some(local) = &local {
        up_cluster::print_local_cluster(local);
    }
    Ok(())
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every environment variable a command of the CLI reads, with the command's path.
    fn env_vars(command: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
        for arg in command.get_arguments() {
            if let Some(env) = arg.get_env() {
                out.push((format!("{path} --{}", arg.get_id()), env.to_string_lossy().into_owned()));
            }
        }
        for sub in command.get_subcommands() {
            env_vars(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    /// The daemons read every `RACEKV_MEMNODE_*` / `RACEKV_COMPUTENODE_*` variable as a
    /// setting and refuse unknown ones: a CLI variable under those prefixes would stop them.
    #[test]
    fn no_cli_variable_is_under_a_daemon_prefix() {
        let mut vars = Vec::new();
        env_vars(&super::Cli::command(), "racekv", &mut vars);
        assert!(vars.len() >= 5, "{vars:?}");
        for (arg, var) in vars {
            for prefix in ["RACEKV_MEMNODE_", "RACEKV_COMPUTENODE_"] {
                assert!(!var.starts_with(prefix), "{arg} reads {var}, under the daemons' prefix {prefix}");
            }
        }
    }
}
