//! Failover (issue 17, item 3): the next map when memnodes of the current one are down.
//!
//! A memnode is down when its registration is gone (its lease expired: it stopped keeping
//! it alive). Each replica set loses its down members; when the primary is among them,
//! the first live replica becomes primary. That replica has every acknowledged write of
//! the partition (a write is acknowledged only once it is on every replica), and a write
//! still in flight there is a lock its readers resolve (`client/src/txn.rs`). A partition
//! whose replicas are all down keeps its set: nothing can serve it until one returns.
//!
//! Down memnodes stay listed in the map (so one that comes back can be caught up and added
//! again, and processes keep their connections to it); they just hold no partition.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::etcd::Etcd;
use crate::{ClusterMap, CoordError};

/// How often a waiting checker looks at its stop flag (a drop waits at most this).
const STOP_POLL: Duration = Duration::from_millis(100);

/// What failover did, for Prometheus.
struct Metrics {
    failovers: prometheus::IntCounter,
    down: prometheus::IntGauge,
    under_replicated: prometheus::IntGauge,
    unavailable: prometheus::IntGauge,
    errors: prometheus::IntCounter,
    checks: prometheus::Histogram,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    failovers: racekv_telemetry::metric::counter(
        "racekv_cluster_failovers_total",
        "Cluster maps written to take down memnodes out of their replica sets",
    ),
    down: racekv_telemetry::metric::gauge(
        "racekv_cluster_memnodes_down",
        "Memnodes listed in the cluster map whose registration is gone, failed over or not (as the last check saw)",
    ),
    under_replicated: racekv_telemetry::metric::gauge(
        "racekv_cluster_partitions_under_replicated",
        "Partitions with fewer live replicas than the map's replication factor R (as the last check saw)",
    ),
    unavailable: racekv_telemetry::metric::gauge(
        "racekv_cluster_partitions_unavailable",
        "Partitions with no live replica: their keys cannot be read or written (as the last check saw)",
    ),
    errors: racekv_telemetry::metric::counter(
        "racekv_cluster_failover_errors_total",
        "Failover checks that could not read or write etcd",
    ),
    checks: racekv_telemetry::metric::latency_histogram(
        "racekv_cluster_failover_check_seconds",
        "Time of one failover check (read the registrations and the map, write a new map if needed)",
    ),
});

/// Registers failover's series now, so a scrape shows them before the first check.
pub fn register_metrics() {
    LazyLock::force(&METRICS);
}

/// The map without the memnodes `down` in any replica set, one epoch later; None when
/// nothing changes (none of them holds a partition that has another replica).
pub fn without(map: &ClusterMap, down: &BTreeSet<u64>) -> Option<ClusterMap> {
    let mut next = map.clone();
    let mut changed = false;
    for set in &mut next.partitions {
        if set.iter().any(|id| down.contains(id)) && set.iter().any(|id| !down.contains(id)) {
            set.retain(|id| !down.contains(id));
            changed = true;
        }
    }
    // A down memnode stops joining (it catches up again once it is back).
    for joining in &mut next.joining {
        let before = joining.len();
        joining.retain(|id| !down.contains(id));
        changed |= joining.len() != before;
    }
    if !changed {
        return None;
    }
    next.normalize_joining();
    next.epoch += 1;
    debug_assert!(next.check().is_ok(), "a map without some replicas is still a valid map");
    Some(next)
}

/// The memnodes of `map` that hold or join a partition and are not among `live`
/// (registered now).
pub fn down_members(map: &ClusterMap, live: &BTreeSet<u64>) -> BTreeSet<u64> {
    map.partitions.iter().chain(&map.joining).flatten().filter(|id| !live.contains(id)).copied().collect()
}

/// Partitions of `map` with fewer than R replicas among `live` (registered now).
pub fn under_replicated(map: &ClusterMap, live: &BTreeSet<u64>) -> usize {
    let wanted = usize::from(map.replicas);
    map.partitions.iter().filter(|set| set.iter().filter(|id| live.contains(id)).count() < wanted).count()
}

/// Partitions of `map` none of whose replicas is among `live` (registered now).
pub fn unavailable(map: &ClusterMap, live: &BTreeSet<u64>) -> usize {
    map.partitions.iter().filter(|set| !set.iter().any(|id| live.contains(id))).count()
}

/// One failover check: reads the registrations and the map, and writes the map without
/// the down memnodes (compare-and-swap on the map's revision, so concurrent checkers write
/// one map). Returns the map written, if any.
pub fn check_once(etcd: &Etcd) -> Result<Option<ClusterMap>, CoordError> {
    let Some((map, revision)) = etcd.map()? else { return Ok(None) };
    let live: BTreeSet<u64> = etcd.memnodes()?.iter().map(|m| m.node_id).collect();
    let unregistered = map.memnodes.iter().filter(|m| !live.contains(&m.node_id)).count();
    METRICS.down.set(unregistered as i64);
    METRICS.under_replicated.set(under_replicated(&map, &live) as i64);
    METRICS.unavailable.set(unavailable(&map, &live) as i64);
    let down = down_members(&map, &live);
    let Some(next) = without(&map, &down) else { return Ok(None) };
    if etcd.put_map(&next, Some(revision))?.is_none() {
        return Ok(None); // another writer came first; the next check reads its map
    }
    METRICS.failovers.inc();
    tracing::warn!(epoch = next.epoch, down = ?down, "failover: down memnodes left their replica sets");
    Ok(Some(next))
}

/// A thread running [`check_once`] every period until dropped.
pub struct Failover {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Failover {
    /// Checks for down memnodes as soon as a registration ends (etcd deletes it when its
    /// lease expires: a watch wakes the checker), and every `period` besides (a fraction
    /// of the memnodes' lease: the bound should the watch break).
    pub fn start(etcd: Etcd, period: Duration) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("failover".into()).spawn(move || {
            let log = racekv_telemetry::ratelimit::RateLimit::new(10_000);
            let changes = etcd.watch_registrations();
            let mut due = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                if Instant::now() >= due {
                    let timer = METRICS.checks.start_timer();
                    let checked = check_once(&etcd);
                    timer.observe_duration();
                    if let Err(e) = checked {
                        METRICS.errors.inc();
                        racekv_telemetry::ratelimit::limited_warn(&log, || {
                            format!("failover could not check the cluster: {e}")
                        });
                    }
                    due = Instant::now() + period;
                }
                // A change: check at once. Else wake now and then for the stop flag.
                if changes.wait(STOP_POLL.min(due.saturating_duration_since(Instant::now()))) {
                    due = Instant::now();
                }
            }
        })?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for Failover {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::sample as map;
    use proptest::prelude::*;

    proptest! {
        /// After failover no live-servable partition names a down memnode, every partition
        /// keeps its surviving replicas in order (so the new primary is the first survivor),
        /// partitions with no survivor are left alone, the map stays valid, and the epoch
        /// grows by one exactly when something changed.
        #[test]
        fn down_memnodes_leave_every_replica_set_they_can(
            n in 1usize..8,
            replicas in 1u8..=5,
            down_mask in any::<u8>(),
        ) {
            let ids: Vec<u64> = (1..=n as u64).collect();
            let before = map(&ids, replicas);
            let down: BTreeSet<u64> = ids.iter().copied().filter(|&id| down_mask & (1 << (id - 1)) != 0).collect();
            let live: BTreeSet<u64> = ids.iter().copied().filter(|id| !down.contains(id)).collect();
            prop_assert_eq!(&down_members(&before, &live), &down.iter().copied().filter(|id| before.partitions.iter().flatten().any(|x| x == id)).collect::<BTreeSet<_>>());
            // Short of R: a set that lost a member, or one made smaller than R (fewer memnodes).
            let short = before
                .partitions
                .iter()
                .filter(|set| set.len() < usize::from(replicas) || set.iter().any(|id| down.contains(id)))
                .count();
            prop_assert_eq!(under_replicated(&before, &live), short);
            let dark = before.partitions.iter().filter(|set| set.iter().all(|id| down.contains(id))).count();
            prop_assert_eq!(unavailable(&before, &live), dark);
            match without(&before, &down) {
                None => prop_assert!(before.partitions.iter().all(|set| set.iter().all(|id| !down.contains(id)) || set.iter().all(|id| down.contains(id)))),
                Some(after) => {
                    prop_assert!(after.check().is_ok());
                    prop_assert_eq!(after.epoch, before.epoch + 1);
                    prop_assert_eq!(&after.memnodes, &before.memnodes);
                    for (old, new) in before.partitions.iter().zip(&after.partitions) {
                        let survivors: Vec<u64> = old.iter().copied().filter(|id| !down.contains(id)).collect();
                        if survivors.is_empty() {
                            prop_assert_eq!(new, old);
                        } else {
                            prop_assert_eq!(new, &survivors);
                        }
                    }
                    prop_assert!(without(&after, &down).is_none(), "failing over twice changes nothing more");
                    prop_assert_eq!(under_replicated(&after, &live), short, "failover does not restore R");
                }
            }
        }
    }

    #[test]
    fn the_next_replica_becomes_primary() {
        let before = map(&[1, 2, 3], 2);
        let first = before.partitions.iter().position(|set| set[0] == 1).unwrap();
        let after = without(&before, &BTreeSet::from([1])).unwrap();
        assert_eq!(after.partitions[first], vec![before.partitions[first][1]]);
        assert!(after.partitions.iter().flatten().all(|&id| id != 1));
    }
}
