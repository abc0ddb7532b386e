//! `racekv cluster ...`: the coordinated cluster's state in etcd (issue 17): `status` lists
//! the memnodes registered and the map, `init` writes a cluster's first map from the
//! memnodes registered, `manage` runs the failover checker as a daemon, `rejoin`,
//! `add-memnode`, `remove-memnode`, `set-replicas` and `balance` change the map and copy
//! keys. Needs the
//! `etcd` build.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use racekv_coord::etcd::{Etcd, DEFAULT_TIMEOUT};
use racekv_coord::map::DEFAULT_PARTITIONS_PER_MEMNODE;
use racekv_coord::{ClusterMap, MemnodeInfo};
use serde::Serialize;

/// How to reach the cluster's state.
#[derive(Debug, Clone, Args)]
pub struct EtcdTarget {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "RACEKV_ETCD", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd: Vec<String>,
    /// The cluster's name in etcd.
    #[arg(long, env = "RACEKV_CLUSTER", default_value = racekv_coord::keys::DEFAULT_CLUSTER_NAME)]
    cluster: String,
}

/// `racekv cluster` subcommands.
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// The memnodes registered (live leases) and the cluster map.
    Status {
        #[command(flatten)]
        target: EtcdTarget,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the cluster's first map from the memnodes registered now.
    Init {
        #[command(flatten)]
        target: EtcdTarget,
        /// The replication factor R (1 to 5).
        #[arg(long, default_value_t = 1)]
        replicas: u8,
        /// Partitions per memnode.
        #[arg(long, default_value_t = DEFAULT_PARTITIONS_PER_MEMNODE)]
        partitions_per_memnode: usize,
        /// Wait (up to `--wait-s`) until this many memnodes are registered (a deployment's
        /// init job starting beside its memnodes).
        #[arg(long, default_value_t = 1)]
        wait_memnodes: usize,
        /// How long to wait for `--wait-memnodes`.
        #[arg(long, default_value_t = 0)]
        wait_s: u64,
        /// A map already there is success, not an error (an init job run again).
        #[arg(long)]
        if_absent: bool,
    },
    /// Run the failover checker until SIGTERM or SIGINT: a memnode whose lease lapses
    /// leaves its replica sets (`racekv up --replicas` runs one itself). Several may run:
    /// they write the map by compare-and-swap.
    Manage {
        #[command(flatten)]
        target: EtcdTarget,
        /// Prometheus metrics (`/metrics`, `/healthz`) on this address; `none` for none.
        #[arg(long, default_value = "127.0.0.1:9402")]
        metrics_addr: String,
        /// Milliseconds between checks (a fraction of the memnodes' lease: the map changes
        /// within lease + this after a memnode stops).
        #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=60_000))]
        check_interval_ms: u64,
        /// Also restore R: a memnode registered again after failover rejoins the
        /// partitions short of replicas at once, caught up from their primaries; after
        /// `--re-replicate-after-s`, memnodes holding other partitions join them too.
        #[arg(long)]
        heal: bool,
        /// Seconds partitions stay short of R before the healer copies them onto memnodes
        /// that hold other partitions (rather than waiting for the lost one).
        #[arg(long, default_value_t = 60)]
        re_replicate_after_s: u64,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Make a registered memnode a replica of every partition short of R (a memnode back
    /// after failover, with its old data file or an empty one): joins them, copies their
    /// keys from the primaries, then becomes their replica. Shows progress.
    Rejoin {
        #[command(flatten)]
        target: EtcdTarget,
        /// The memnode's node id (as `racekv cluster status` shows it: 0x...).
        node_id: String,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Add a registered memnode to the map and move partitions to it until the memnodes
    /// hold about as many each (copied from their primaries while clients go on; every
    /// client connects to it as it installs the map that lists it), then spread primaries.
    /// Shows progress.
    AddMemnode {
        #[command(flatten)]
        target: EtcdTarget,
        /// The memnode's node id (as `racekv cluster status` shows it: 0x...).
        node_id: String,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Drain a memnode and take it out of the map: each partition it holds is copied to
    /// the live memnode holding fewest, which takes its place (primary where it was).
    /// Clients keep reading and writing; stop the memnode once this returns. Shows progress.
    RemoveMemnode {
        #[command(flatten)]
        target: EtcdTarget,
        /// The memnode's node id (as `racekv cluster status` shows it: 0x...).
        node_id: String,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Change the replication factor R (1 to 5): lowering it drops each partition's last
    /// backups and removes their copies; raising it copies partitions onto live memnodes
    /// until each has R. Shows progress.
    SetReplicas {
        #[command(flatten)]
        target: EtcdTarget,
        /// The new R.
        replicas: u8,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Give up the partitions no live memnode holds (every replica lost: a double failure
    /// at R = 2): live memnodes take them over empty, so their keys are lost and can be
    /// written again. Without --accept-loss, only says which partitions would be.
    RecoverLost {
        #[command(flatten)]
        target: EtcdTarget,
        /// Do it: the keys of those partitions are gone for good.
        #[arg(long)]
        accept_loss: bool,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// How replicated single-key writes go: `on`, by the snapshot protocol (every replica's
    /// steps together, about 5 round trips; new clusters start with it), or `off`, as
    /// one-key transactions (about 9 + R - 1). Turn it on in a cluster started by an older
    /// build only once every memnode, computenode and client runs this build or newer.
    SetSnapshotWrites {
        #[command(flatten)]
        target: EtcdTarget,
        /// on or off.
        #[arg(required = true, action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
        on: bool,
        #[command(flatten)]
        copy: CopyArgs,
    },
    /// Spread primaries over each partition's replicas (after failovers the survivors are
    /// primary of everything; a memnode back rejoins as a backup). Nothing is copied.
    Balance {
        #[command(flatten)]
        target: EtcdTarget,
        #[command(flatten)]
        copy: CopyArgs,
    },
}

/// A spinner that shows each phase and the keys handled in it.
struct Spinner(indicatif::ProgressBar);

impl Spinner {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new_spinner().with_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg}: {pos} keys ({per_sec})")
                .expect("a valid template"),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        Self(bar)
    }
}

impl crate::membership::Progress for Spinner {
    fn phase(&mut self, what: &str) {
        self.0.set_position(0);
        self.0.set_message(what.to_string());
    }

    fn keys(&mut self, n: u64) {
        self.0.inc(n);
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// How a command that copies keys reaches the memnodes and how fast it copies.
#[derive(Debug, Args)]
pub struct CopyArgs {
    /// The memnodes' shared secret (the copy runs as an embedded client).
    #[arg(long, env = "RACEKV_TOKEN", default_value = "racekv-dev-token", hide_env_values = true)]
    token: String,
    /// A file holding the token (read at start; overrides `--token`): a mounted secret.
    #[arg(long, env = "RACEKV_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    /// Most keys copied per second (0: no cap), so the copy leaves room for the workload.
    #[arg(long, default_value_t = 50_000)]
    max_keys_per_second: u64,
}

impl CopyArgs {
    /// The token: the file's content when one is given (bounded, one trailing newline
    /// dropped, as the daemons read their `token_file`).
    fn token(&self) -> anyhow::Result<String> {
        match &self.token_file {
            None => Ok(self.token.clone()),
            Some(path) => racekv_telemetry::secret::read_secret_file("--token-file", path),
        }
    }

    /// An embedded client routing by the cluster's map.
    fn client(&self, target: &EtcdTarget) -> anyhow::Result<racekv_client::Client> {
        Self::connect(target, &self.token()?)
    }

    fn connect(target: &EtcdTarget, token: &str) -> anyhow::Result<racekv_client::Client> {
        Ok(racekv_client::Client::builder()
            .etcd(target.etcd.clone(), target.cluster.clone())
            .token(token)
            .timeout(Duration::from_secs(10))
            .connect()?)
    }
}

/// One memnode as `status` shows it.
#[derive(Debug, Serialize)]
struct MemnodeStatus {
    node_id: String,
    endpoints: Vec<String>,
    region_bytes: u64,
    /// Its lease is live.
    registered: bool,
    /// In the map.
    mapped: bool,
    primary_partitions: usize,
    replica_partitions: usize,
    /// Partitions it is catching up on (a rejoin or a move).
    joining_partitions: usize,
}

/// What `status` shows.
#[derive(Debug, Serialize)]
struct ClusterStatus {
    cluster: String,
    epoch: Option<u64>,
    replicas: Option<u8>,
    partitions: usize,
    memnodes: Vec<MemnodeStatus>,
}

/// Runs a `racekv cluster` command.
pub fn run(command: ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Status { target, json } => {
            let status = status(&target)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(&status);
            }
            Ok(())
        }
        ClusterCommand::Init { target, replicas, partitions_per_memnode, wait_memnodes, wait_s, if_absent } => {
            let etcd = connect(&target)?;
            let deadline = std::time::Instant::now() + Duration::from_secs(wait_s);
            while wait_s > 0 && etcd.map()?.is_none() && etcd.memnodes()?.len() < wait_memnodes {
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "fewer than {wait_memnodes} memnodes registered in cluster {} after {wait_s} s",
                    target.cluster
                );
                std::thread::sleep(Duration::from_millis(500));
            }
            if let (true, Some((map, _))) = (if_absent, etcd.map()?) {
                println!("cluster {}: a map is there already (epoch {}): nothing written", target.cluster, map.epoch);
                return Ok(());
            }
            let map = init(&etcd, &target, replicas, partitions_per_memnode)?;
            println!(
                "cluster {}: map epoch {} written: {} memnodes, {} partitions, {} replica(s) each",
                target.cluster,
                map.epoch,
                map.memnodes.len(),
                map.partitions.len(),
                map.partitions.first().map_or(0, Vec::len)
            );
            Ok(())
        }
        ClusterCommand::Manage { target, metrics_addr, check_interval_ms, heal, re_replicate_after_s, copy } => {
            let policy = crate::healer::HealPolicy {
                max_keys_per_second: copy.max_keys_per_second,
                re_replicate_after: Duration::from_secs(re_replicate_after_s),
            };
            let token = copy.token()?;
            let healing = heal.then_some((token.as_str(), policy));
            manage(&target, &metrics_addr, Duration::from_millis(check_interval_ms), healing)
        }
        ClusterCommand::Rejoin { target, node_id, copy } => {
            let node = parse_node_id(&node_id)?;
            let etcd = connect(&target)?;
            let client = copy.client(&target)?;
            let mut rate = crate::rejoin::KeyRate::new(copy.max_keys_per_second);
            let done = {
                let mut spinner = Spinner::new();
                crate::membership::Progress::phase(&mut spinner, &format!("rejoining {node:#x}"));
                crate::rejoin::rejoin(&etcd, &client, node, &mut rate, &mut |n| spinner.0.inc(n))?
            };
            println!(
                "memnode {node:#018x}: replica of {} more partitions ({} keys copied, {} stale keys removed)",
                done.partitions, done.synced, done.removed
            );
            Ok(())
        }
        ClusterCommand::AddMemnode { target, node_id, copy } => {
            let node = parse_node_id(&node_id)?;
            let (etcd, client) = (connect(&target)?, copy.client(&target)?);
            let mut rate = crate::rejoin::KeyRate::new(copy.max_keys_per_second);
            let done = crate::membership::add_memnode(&etcd, &client, node, &mut rate, &mut Spinner::new())?;
            println!(
                "memnode {node:#018x}: in the map ({} partitions moved to the memnodes holding fewest, {} keys copied)",
                done.moved, done.synced
            );
            Ok(())
        }
        ClusterCommand::RemoveMemnode { target, node_id, copy } => {
            let node = parse_node_id(&node_id)?;
            let (etcd, client) = (connect(&target)?, copy.client(&target)?);
            let mut rate = crate::rejoin::KeyRate::new(copy.max_keys_per_second);
            let done = crate::membership::remove_memnode(&etcd, &client, node, &mut rate, &mut Spinner::new())?;
            println!(
                "memnode {node:#018x}: removed from the map ({} partitions moved, {} keys copied); stop it now",
                done.moved, done.synced
            );
            Ok(())
        }
        ClusterCommand::SetReplicas { target, replicas, copy } => {
            let (etcd, client) = (connect(&target)?, copy.client(&target)?);
            let mut rate = crate::rejoin::KeyRate::new(copy.max_keys_per_second);
            let done = crate::membership::set_replicas(&etcd, &client, replicas, &mut rate, &mut Spinner::new())?;
            let what = if replicas < done.from { "stale copies removed" } else { "keys copied" };
            println!("cluster {}: R = {replicas} (was {}); {} {what}", target.cluster, done.from, done.keys);
            Ok(())
        }
        ClusterCommand::RecoverLost { target, accept_loss, copy } => {
            let etcd = connect(&target)?;
            if !accept_loss {
                let (map, _) = etcd.map()?.context("the cluster has no map yet (`racekv cluster init`)")?;
                let live: std::collections::BTreeSet<u64> = etcd.memnodes()?.iter().map(|m| m.node_id).collect();
                let lost = racekv_coord::failover::unavailable(&map, &live);
                anyhow::ensure!(lost == 0, "{lost} partitions have no live replica; bring one of their memnodes back on its data file, or run this with --accept-loss to serve them empty (their keys are lost)");
                println!("cluster {}: every partition has a live replica; nothing to recover", target.cluster);
                return Ok(());
            }
            let token = copy.token()?;
            let direct = |info: &racekv_coord::MemnodeInfo| -> anyhow::Result<racekv_client::Client> {
                let endpoint = racekv_client::map_follower::choose_endpoint(info)?;
                Ok(racekv_client::Client::builder()
                    .memnode(endpoint)
                    .token(&token)
                    .timeout(Duration::from_secs(10))
                    .connect()?)
            };
            match crate::membership::recover_lost(&etcd, &direct, &mut Spinner::new())? {
                Some((map, lost)) => println!(
                    "cluster {}: {} partitions given to live memnodes, empty (map epoch {}): their keys are lost",
                    target.cluster,
                    lost.len(),
                    map.epoch
                ),
                None => println!("cluster {}: every partition has a live replica; nothing to recover", target.cluster),
            }
            Ok(())
        }
        ClusterCommand::SetSnapshotWrites { target, on, copy } => {
            let (etcd, client) = (connect(&target)?, copy.client(&target)?);
            let how = if on { "by the snapshot protocol" } else { "as one-key transactions" };
            match crate::membership::set_snapshot_writes(&etcd, &client, on)? {
                Some(epoch) => println!("cluster {}: replicated writes go {how} (map epoch {epoch})", target.cluster),
                None => println!("cluster {}: replicated writes already go {how}", target.cluster),
            }
            Ok(())
        }
        ClusterCommand::Balance { target, copy } => {
            let (etcd, client) = (connect(&target)?, copy.client(&target)?);
            match crate::membership::balance(&etcd, &client)? {
                Some(epoch) => println!("cluster {}: primaries spread (map epoch {epoch})", target.cluster),
                None => println!("cluster {}: primaries already spread", target.cluster),
            }
            Ok(())
        }
    }
}

/// A node id as `status` prints it (`0x...`) or in decimal.
fn parse_node_id(text: &str) -> anyhow::Result<u64> {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.with_context(|| format!("{text:?} is not a node id (0x... as `racekv cluster status` shows, or decimal)"))
}

/// Runs the failover checker (and its metrics endpoint) until SIGTERM or SIGINT; with
/// `heal`, also rejoins memnodes that come back.
fn manage(
    target: &EtcdTarget,
    metrics_addr: &str,
    period: Duration,
    heal: Option<(&str, crate::healer::HealPolicy)>,
) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
    let etcd = connect(target)?;
    racekv_coord::failover::register_metrics();
    crate::healer::register_metrics();
    let metrics = match metrics_addr {
        "none" => None,
        addr => {
            let addr = addr.parse().with_context(|| format!("--metrics-addr {addr:?} is not host:port"))?;
            Some(racekv_telemetry::MetricsServer::start(addr)?)
        }
    };
    let failover = racekv_coord::failover::Failover::start(etcd, period)?;
    let healer = match heal {
        Some((token, policy)) => {
            let (copy_target, token) = (target.clone(), token.to_string());
            let client = move || CopyArgs::connect(&copy_target, &token);
            Some(crate::healer::Healer::start(connect(target)?, client, policy)?)
        }
        None => None,
    };
    let served = metrics.as_ref().map_or_else(|| "none".to_string(), |m| m.addr().to_string());
    println!(
        "READY cluster={} metrics={served} check_interval_ms={} heal={}",
        target.cluster,
        period.as_millis(),
        healer.is_some()
    );
    let signal = signals.forever().next();
    drop(healer);
    drop(failover);
    // A log line, not stdout: whoever read READY may have closed the pipe since.
    tracing::info!(?signal, "failover checker stopped");
    Ok(())
}

fn status(target: &EtcdTarget) -> anyhow::Result<ClusterStatus> {
    let (registered, map) = read(&connect(target)?)?;
    let mut rows: Vec<MemnodeStatus> = Vec::new();
    let mapped: &[MemnodeInfo] = map.as_ref().map_or(&[], |m| &m.memnodes);
    let mut all: Vec<&MemnodeInfo> = registered.iter().chain(mapped).collect();
    all.sort_by_key(|m| m.node_id);
    all.dedup_by_key(|m| m.node_id);
    for m in all {
        let sets = map.as_ref().map_or(&[][..], |m| &m.partitions[..]);
        rows.push(MemnodeStatus {
            node_id: format!("{:#018x}", m.node_id),
            endpoints: m.endpoints.clone(),
            region_bytes: m.region_bytes,
            registered: registered.iter().any(|r| r.node_id == m.node_id),
            mapped: mapped.iter().any(|r| r.node_id == m.node_id),
            primary_partitions: sets.iter().filter(|s| s.first() == Some(&m.node_id)).count(),
            replica_partitions: sets.iter().filter(|s| s.iter().skip(1).any(|id| *id == m.node_id)).count(),
            joining_partitions: map
                .as_ref()
                .map_or(0, |map| map.joining.iter().filter(|j| j.contains(&m.node_id)).count()),
        });
    }
    Ok(ClusterStatus {
        cluster: target.cluster.clone(),
        epoch: map.as_ref().map(|m| m.epoch),
        replicas: map.as_ref().map(|m| m.replicas),
        partitions: map.as_ref().map_or(0, |m| m.partitions.len()),
        memnodes: rows,
    })
}

fn print_status(s: &ClusterStatus) {
    match (s.epoch, s.replicas) {
        (Some(epoch), Some(r)) => {
            println!("cluster {}: map epoch {epoch}, R = {r}, {} partitions", s.cluster, s.partitions)
        }
        _ => println!("cluster {}: no map yet (`racekv cluster init`)", s.cluster),
    }
    println!(
        "{:<20} {:<10} {:<7} {:>8} {:>8} {:>8}  ENDPOINTS",
        "MEMNODE", "STATE", "MAPPED", "PRIMARY", "REPLICA", "JOINING"
    );
    for m in &s.memnodes {
        let state = if m.registered { "up" } else { "no lease" };
        let mapped = if m.mapped { "yes" } else { "no" };
        println!(
            "{:<20} {:<10} {:<7} {:>8} {:>8} {:>8}  {}",
            m.node_id,
            state,
            mapped,
            m.primary_partitions,
            m.replica_partitions,
            m.joining_partitions,
            m.endpoints.join(",")
        );
    }
}

fn init(etcd: &Etcd, target: &EtcdTarget, replicas: u8, per: usize) -> anyhow::Result<ClusterMap> {
    let (registered, map) = read(etcd)?;
    if let Some(map) = map {
        anyhow::bail!("cluster {} already has a map (epoch {}): nothing written", target.cluster, map.epoch);
    }
    anyhow::ensure!(
        !registered.is_empty(),
        "no memnode is registered in cluster {} (start memnodes with --etcd)",
        target.cluster
    );
    let map = ClusterMap::initial(registered, replicas, per)?;
    match etcd.put_map(&map, None)? {
        Some(_) => Ok(map),
        None => anyhow::bail!("another writer put the first map meanwhile: nothing written"),
    }
}

fn connect(target: &EtcdTarget) -> anyhow::Result<Etcd> {
    Ok(Etcd::connect(&target.etcd, &target.cluster, DEFAULT_TIMEOUT)?)
}

/// The memnodes registered and the map.
fn read(etcd: &Etcd) -> anyhow::Result<(Vec<MemnodeInfo>, Option<ClusterMap>)> {
    Ok((etcd.memnodes()?, etcd.map()?.map(|(map, _)| map)))
}
