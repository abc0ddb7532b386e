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
    pub fn handled(&mut self, n: u64) {
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
    let (copied, caught_up) = copy_partitions(client, &joining, node, &partitions, rate, on_keys)?;
    let mut done = Rejoined { partitions: 0, synced: copied.synced, removed: copied.removed };
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

/// Threads a catch-up copies with, each on its own share of the partitions: a key's copy is
/// a replicated write of several round trips one after another, so over a network one
/// thread mostly waits.
pub const COPY_THREADS: usize = 4;

/// Catches memnode `node` up on `partitions`, which it joins in `map` (the map naming it
/// joining them, written already), on [`COPY_THREADS`] threads, each walking every primary
/// of its share of the partitions once. Returns what was copied and, per partition, the
/// primary it was copied from (a partition whose primary has changed since must be copied
/// again before `node` becomes its replica: the new primary may have writes the old one
/// had not). `rate` caps all threads together.
pub fn copy_partitions(
    client: &Client,
    map: &ClusterMap,
    node: u64,
    partitions: &[usize],
    rate: &mut KeyRate,
    on_keys: &mut dyn FnMut(u64),
) -> anyhow::Result<(racekv_client::CatchUp, Vec<(usize, u64)>)> {
    let shares: Vec<Vec<usize>> = (0..COPY_THREADS.min(partitions.len()))
        .map(|i| partitions.iter().copied().skip(i).step_by(COPY_THREADS).collect())
        .collect();
    let results = std::thread::scope(|scope| {
        // A bounded channel: a thread's next key waits while the cap holds this one back.
        let (handled, counts) = std::sync::mpsc::sync_channel::<u64>(COPY_THREADS);
        let threads: Vec<_> = shares
            .iter()
            .map(|share| {
                let handled = handled.clone();
                scope.spawn(move || {
                    copy_share(client, map, node, share, &mut |n| {
                        let _ = handled.send(n);
                    })
                })
            })
            .collect();
        drop(handled);
        for n in counts {
            rate.handled(n);
            on_keys(n);
        }
        threads.into_iter().map(|t| t.join().expect("a catch-up thread panicked")).collect::<Vec<_>>()
    });
    let mut copied = racekv_client::CatchUp::default();
    let mut from = Vec::with_capacity(partitions.len());
    for result in results {
        let (counts, share_from) =
            result.with_context(|| format!("catching memnode {node:#x} up on {} partitions", partitions.len()))?;
        copied.synced += counts.synced;
        copied.removed += counts.removed;
        from.extend(share_from);
    }
    Ok((copied, from))
}

/// [`copy_partitions`] of one thread's share: one walk per primary over the partitions of
/// `share` it serves.
fn copy_share(
    client: &Client,
    map: &ClusterMap,
    node: u64,
    share: &[usize],
    on_keys: &mut dyn FnMut(u64),
) -> Result<(racekv_client::CatchUp, Vec<(usize, u64)>), racekv_client::ClientError> {
    let mut by_primary: std::collections::BTreeMap<u64, Vec<usize>> = std::collections::BTreeMap::new();
    for &p in share {
        by_primary.entry(map.replicas_of(p)[0]).or_default().push(p);
    }
    let filters: Vec<_> = by_primary
        .iter()
        .map(|(&primary, parts)| {
            (primary, move |key: &[u8]| parts.contains(&map.partition_of(racekv_client::ring::key_hash(key))))
        })
        .collect();
    let sources: Vec<CatchUpSource<'_>> =
        filters.iter().map(|(primary, belongs)| CatchUpSource { primary: *primary, belongs }).collect();
    let copied = client.catch_up(map.epoch, node, &sources, on_keys)?;
    let from = by_primary.iter().flat_map(|(&primary, parts)| parts.iter().map(move |&p| (p, primary))).collect();
    Ok((copied, from))
}

/// The primary of `partition` in `map`.
pub fn primary_of(map: &ClusterMap, partition: usize) -> Option<u64> {
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
