//! The healer (issue 17): a thread in `racekv cluster manage --heal` and `racekv up
//! --replicas` that restores R. A memnode back after failover rejoins the partitions it
//! left at once (`rejoin.rs`); after `re_replicate_after`, memnodes holding other
//! partitions take copies of partitions still short. Once every partition has R replicas
//! and their memnodes are live, it spreads primaries again (`membership::balance`). A memnode
//! that lost its data file comes back under a new id: once the old one is failed over, the
//! new one is listed in its stead (`membership::replace_lost`) and rejoins like the others.
//! Moves a mover left under way (it died midway: its claim in etcd lapsed) are called off
//! (`membership::call_off_abandoned_moves`).

use std::time::{Duration, Instant};

use racekv_client::Client;
use racekv_coord::etcd::Etcd;

use crate::rejoin::{next_candidate, rejoin, KeyRate};

/// What healing did, for Prometheus.
struct Metrics {
    rejoins: prometheus::IntCounter,
    keys: prometheus::IntCounter,
    errors: prometheus::IntCounter,
    replacements: prometheus::IntCounter,
    moves_called_off: prometheus::IntCounter,
}

static METRICS: std::sync::LazyLock<Metrics> = std::sync::LazyLock::new(|| Metrics {
    rejoins: racekv_telemetry::metric::counter(
        "racekv_cluster_rejoins_total",
        "Rejoins finished: a memnode made replica of the partitions short of R it was caught up on",
    ),
    keys: racekv_telemetry::metric::counter(
        "racekv_cluster_rejoin_keys_total",
        "Keys a rejoin copied to a joining memnode or checked on it",
    ),
    errors: racekv_telemetry::metric::counter(
        "racekv_cluster_rejoin_errors_total",
        "Rejoins that failed (retried on the next round)",
    ),
    replacements: racekv_telemetry::metric::counter(
        "racekv_cluster_memnode_replacements_total",
        "Memnodes back empty at a failed-over memnode's address, listed in its stead",
    ),
    moves_called_off: racekv_telemetry::metric::counter(
        "racekv_cluster_moves_called_off_total",
        "Partition moves a mover left under way (it died or failed midway, its claim in etcd gone), called off",
    ),
});

/// Registers healing's series now, so a scrape shows them before the first rejoin.
pub fn register_metrics() {
    std::sync::LazyLock::force(&METRICS);
}

/// How often the healer looks for memnodes to rejoin.
const HEAL_PERIOD: Duration = Duration::from_secs(1);

/// How the healer copies and when it re-replicates onto memnodes left.
#[derive(Debug, Clone, Copy)]
pub struct HealPolicy {
    /// Most keys copied per second (0: no cap).
    pub max_keys_per_second: u64,
    /// How long partitions stay short of R before memnodes that hold others join them (a
    /// memnode back after failover, holding none, rejoins at once).
    pub re_replicate_after: Duration,
}

/// A thread that rejoins memnodes ([`next_candidate`]), one at a time, until dropped.
/// Dropping it stops it between rejoins (a rejoin in progress is left to the process's
/// exit; the memnode stays joining, and the next healer finishes it).
pub struct Healer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Healer {
    /// Starts healing the cluster of `etcd` as `policy` says, copying through a client
    /// `connect` makes for each rejoin (the cluster may have no map yet when it starts).
    pub fn start(
        etcd: Etcd,
        connect: impl Fn() -> anyhow::Result<Client> + Send + 'static,
        policy: HealPolicy,
    ) -> std::io::Result<Self> {
        use std::sync::atomic::Ordering;
        register_metrics();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        std::thread::Builder::new().name("healer".into()).spawn(move || {
            let log = racekv_telemetry::ratelimit::RateLimit::new(10_000);
            let mut short_since = None;
            while !flag.load(Ordering::Relaxed) {
                if let Err(e) = heal_once(&etcd, &connect, policy, &mut short_since) {
                    METRICS.errors.inc();
                    racekv_telemetry::ratelimit::limited_warn(&log, || format!("rejoin failed (retrying): {e:#}"));
                }
                std::thread::sleep(HEAL_PERIOD);
            }
        })?;
        Ok(Self { stop })
    }
}

impl Drop for Healer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One round: rejoins the next candidate, if any. `short_since` is when partitions were
/// last seen whole (None: they are).
fn heal_once(
    etcd: &Etcd,
    connect: &dyn Fn() -> anyhow::Result<Client>,
    policy: HealPolicy,
    short_since: &mut Option<Instant>,
) -> anyhow::Result<()> {
    let Some((map, _)) = etcd.map()? else { return Ok(()) };
    if !racekv_coord::membership::moves_under_way(&map).is_empty() && etcd.movers()? == 0 {
        let mut rate = KeyRate::new(policy.max_keys_per_second);
        let called_off = crate::membership::call_off_abandoned_moves(etcd, &connect()?, &mut rate, &mut Logged)?;
        if called_off > 0 {
            METRICS.moves_called_off.inc_by(called_off as u64);
            tracing::warn!(
                moves = called_off,
                "called off partition moves whose mover is gone (its claim lapsed): run the command again"
            );
        }
        return Ok(());
    }
    let registered = etcd.memnodes()?;
    if racekv_coord::membership::replacement(&map, &registered).is_some() {
        if let Some((old, new)) = crate::membership::replace_lost(etcd, &connect()?)? {
            METRICS.replacements.inc();
            tracing::warn!(
                old = format_args!("{old:#x}"),
                new = format_args!("{new:#x}"),
                "a memnode came back empty (its data file lost) at a failed-over memnode's address: \
                 listed in its stead, to be filled from the other replicas"
            );
        }
        return Ok(());
    }
    if map.partitions.iter().all(|set| set.len() >= usize::from(map.replicas)) {
        *short_since = None;
        // Whole again: a memnode back from failover is a backup everywhere until its share
        // of primaries is given back (once every memnode holding partitions is live).
        if racekv_coord::membership::balance_primaries(&map).is_some() {
            let live: Vec<u64> = registered.iter().map(|m| m.node_id).collect();
            if map.partitions.iter().flatten().all(|id| live.contains(id)) {
                if let Some(epoch) = crate::membership::balance(etcd, &connect()?)? {
                    tracing::info!(epoch, "primaries spread over the replicas again");
                }
            }
        }
        return Ok(());
    }
    let survivors_too = short_since.get_or_insert_with(Instant::now).elapsed() >= policy.re_replicate_after;
    let Some(node) = next_candidate(&map, &registered, survivors_too) else { return Ok(()) };
    // A client of this round's memnodes (a long-lived one could miss a reconnection).
    let client = connect()?;
    let mut rate = KeyRate::new(policy.max_keys_per_second);
    let done = rejoin(etcd, &client, node, &mut rate, &mut |n| METRICS.keys.inc_by(n))?;
    if done.partitions > 0 {
        METRICS.rejoins.inc();
        tracing::warn!(
            node = format_args!("{node:#x}"),
            partitions = done.partitions,
            synced = done.synced,
            removed = done.removed,
            "healed: a memnode is a replica of partitions that were short of R"
        );
    }
    Ok(())
}

/// Progress of the healer's own membership steps: phases logged.
struct Logged;

impl crate::membership::Progress for Logged {
    fn phase(&mut self, what: &str) {
        tracing::info!("healer: {what}");
    }

    fn keys(&mut self, _n: u64) {}
}
