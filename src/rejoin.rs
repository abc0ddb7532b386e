//! Restoring R (issue 17): a registered memnode joins the partitions short of replicas, is
//! caught up on each from its primary, and becomes its replica. `racekv cluster rejoin`
//! runs it once; `racekv up --replicas` and `racekv cluster manage --heal` run it for each
//! memnode that comes back. The map changes are `racekv_coord::rejoin`'s; the copying is
//! the client's `catchup.rs` (which says why no write is missed).

use std::time::{Duration, Instant};

use anyhow::Context;
use racekv_client::{CatchUpSource, Client};
use racekv_coord::etcd::Etcd;
use racekv_coord::rejoin::{finish_joining, joined_by, start_joining};
use racekv_coord::ClusterMap;

/// What one rejoin did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rejoined {
    /// Partitions the memnode became a replica of.
    pub partitions: usize,
    /// Keys copied to it (and to the other replicas, unchanged).
    pub synced: u64,
    /// Stale keys removed from it.
    pub removed: u64,
}

/// Caps the keys a catch-up handles per second (re-replication runs beside the workload).
pub struct KeyRate {
    per_second: u64,
    started: Instant,
    handled: u64,
}

impl KeyRate {
    /// At most `per_second` keys a second (0: no cap).
    pub fn new(per_second: u64) -> Self {
        Self { per_second, started: Instant::now(), handled: 0 }
    }

    /// Counts `n` keys handled, sleeping as long as the cap asks.
    fn handled(&mut self, n: u64) {
        self.handled += n;
        if self.per_second == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.handled as f64 / self.per_second as f64);
        if let Some(ahead) = due.checked_sub(self.started.elapsed()) {
            std::thread::sleep(ahead);
        }
    }
}

/// Makes memnode `node` a replica of every partition short of R that it does not hold:
/// joins them (one map), catches it up on each from its primary through `client` (an
/// embedded client of the cluster), then makes it their replica (one map). Partitions whose
/// primary changed during the catch-up stay joining: call again. `on_keys` hears of every
/// key handled.
pub fn rejoin(
    etcd: &Etcd,
    client: &Client,
    node: u64,
    rate: &mut KeyRate,
    on_keys: &mut dyn FnMut(u64),
) -> anyhow::Result<Rejoined> {
    let registered = etcd.memnodes()?;
    let info = registered
        .iter()
        .find(|m| m.node_id == node)
        .with_context(|| format!("memnode {node:#x} is not registered (is it running with --etcd?)"))?;
    let joining = loop {
        let (map, revision) = etcd.map()?.context("the cluster has no map yet (`racekv cluster init`)")?;
        // Every client reaches the map's memnodes at the endpoints it lists: a memnode
        // new to the map, or back at other endpoints, needs live membership (not built).
        let listed = map.memnode(node).with_context(|| {
            format!("memnode {node:#x} is not in the cluster map (adding memnodes is not built yet)")
        })?;
        anyhow::ensure!(
            listed.endpoints == info.endpoints,
            "memnode {node:#x} registered at {:?}, the map lists it at {:?}: start it at the map's endpoints",
            info.endpoints,
            listed.endpoints
        );
        let Some(next) = start_joining(&map, node) else { break map };
        if etcd.put_map(&next, Some(revision))?.is_some() {
            tracing::info!(node = format_args!("{node:#x}"), epoch = next.epoch, "joining partitions");
            break next;
        }
    };
    let partitions = joined_by(&joining, node);
    // One walk per primary, over the joined partitions it is primary of.
    let mut by_primary: std::collections::BTreeMap<u64, Vec<usize>> = std::collections::BTreeMap::new();
    for &p in &partitions {
        by_primary.entry(joining.replicas_of(p)[0]).or_default().push(p);
    }
    let map = &joining;
    let filters: Vec<_> = by_primary
        .iter()
        .map(|(&primary, parts)| {
            (primary, move |key: &[u8]| parts.contains(&map.partition_of(racekv_client::ring::key_hash(key))))
        })
        .collect();
    let sources: Vec<CatchUpSource<'_>> =
        filters.iter().map(|(primary, belongs)| CatchUpSource { primary: *primary, belongs }).collect();
    let copied = client
        .catch_up(joining.epoch, node, &sources, &mut |n| {
            rate.handled(n);
            on_keys(n);
        })
        .with_context(|| format!("catching memnode {node:#x} up on {} partitions", partitions.len()))?;
    let mut done = Rejoined { partitions: 0, synced: copied.synced, removed: copied.removed };
    let caught_up: Vec<(usize, u64)> =
        by_primary.iter().flat_map(|(&primary, parts)| parts.iter().map(move |&p| (p, primary))).collect();
    loop {
        let (map, revision) = etcd.map()?.context("the cluster map is gone")?;
        // Only where the primary is the one copied from (a failover meanwhile promoted
        // another replica, which has writes this copy may not: the next call copies again).
        let ready: Vec<usize> =
            caught_up.iter().filter(|&&(p, from)| primary_of(&map, p) == Some(from)).map(|&(p, _)| p).collect();
        let Some(next) = finish_joining(&map, node, &ready) else { return Ok(done) };
        if etcd.put_map(&next, Some(revision))?.is_some() {
            done.partitions = joined_by(&map, node).iter().filter(|p| ready.contains(p)).count();
            tracing::info!(
                node = format_args!("{node:#x}"),
                epoch = next.epoch,
                partitions = done.partitions,
                "rejoined"
            );
            return Ok(done);
        }
    }
}

fn primary_of(map: &ClusterMap, partition: usize) -> Option<u64> {
    map.partitions.get(partition).and_then(|set| set.first().copied())
}

/// The memnode to rejoin next, if any: registered at the endpoints the map lists it at,
/// with some partition short of R that it neither holds nor joins (or some it joins); the
/// one holding the fewest partitions first (a memnode back after failover holds none).
/// Memnodes that hold partitions already count only when `survivors_too` (re-replication
/// onto the memnodes left, rather than waiting for the lost one to come back).
pub fn next_candidate(map: &ClusterMap, registered: &[racekv_coord::MemnodeInfo], survivors_too: bool) -> Option<u64> {
    let held = |id: u64| map.partitions.iter().filter(|set| set.contains(&id)).count();
    registered
        .iter()
        .filter(|m| map.memnode(m.node_id).is_some_and(|listed| listed.endpoints == m.endpoints))
        .filter(|m| survivors_too || held(m.node_id) == 0)
        .filter(|m| start_joining(map, m.node_id).is_some() || !joined_by(map, m.node_id).is_empty())
        .min_by_key(|m| (held(m.node_id), m.node_id))
        .map(|m| m.node_id)
}

/// What healing did, for Prometheus.
struct Metrics {
    rejoins: prometheus::IntCounter,
    keys: prometheus::IntCounter,
    errors: prometheus::IntCounter,
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
    if map.partitions.iter().all(|set| set.len() >= usize::from(map.replicas)) {
        *short_since = None;
        return Ok(());
    }
    let survivors_too = short_since.get_or_insert_with(Instant::now).elapsed() >= policy.re_replicate_after;
    let Some(node) = next_candidate(&map, &etcd.memnodes()?, survivors_too) else { return Ok(()) };
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use racekv_coord::failover::without;
    use racekv_coord::MemnodeInfo;

    use super::*;

    fn info(node_id: u64) -> MemnodeInfo {
        MemnodeInfo { node_id, endpoints: vec![format!("tcp:127.0.0.1:{}", 7000 + node_id)], region_bytes: 1 << 20 }
    }

    #[test]
    fn a_memnode_back_rejoins_first_and_survivors_only_when_allowed() {
        let whole = ClusterMap::initial((1..=3).map(info).collect(), 2, 4).unwrap();
        assert_eq!(next_candidate(&whole, &[info(1), info(2), info(3)], true), None, "nothing is short");
        let degraded = without(&whole, &BTreeSet::from([3])).unwrap();
        // 3 is back: it goes first, survivors or not.
        for survivors_too in [false, true] {
            assert_eq!(next_candidate(&degraded, &[info(1), info(2), info(3)], survivors_too), Some(3));
        }
        // 3 is still away: only when re-replicating onto the others.
        assert_eq!(next_candidate(&degraded, &[info(1), info(2)], false), None);
        assert_eq!(next_candidate(&degraded, &[info(1), info(2)], true), Some(1));
        // Back at another address: not until it is where the map says.
        let moved = MemnodeInfo { endpoints: vec!["tcp:127.0.0.1:9".into()], ..info(3) };
        assert_eq!(next_candidate(&degraded, &[info(1), info(2), moved], false), None);
    }

    #[test]
    fn the_key_rate_caps_keys_per_second() {
        let mut rate = KeyRate::new(1_000);
        let started = Instant::now();
        rate.handled(100);
        // A lower bound only (sleeps last at least as long as asked).
        assert!(started.elapsed() >= Duration::from_millis(100), "100 keys at 1000/s take 100 ms");
    }
}
