//! The memnode's side of etcd (issue 17): with `etcd_endpoints` set, the memnode takes the
//! epoch of the cluster's map before it serves (the region's map epoch word, which clients
//! routing by a map read after every batch: `racekv_client::map_fence`), raises it as newer
//! maps are written, and lists itself (node id, endpoints, region size) under
//! `/racekv/<cluster>/memnodes/` with a lease it keeps alive (`racekv_coord::etcd`), once it
//! serves; it revokes the lease first when it stops, so the list holds memnodes that serve
//! (and, after a crash, ones that did until at most `etcd_lease_ms` ago).
//!
//! **The fence.** A memnode cut off from etcd cannot see the map that fails it over, and
//! one-sided reads never ask its CPU, so clients still routing by the old map (cut off
//! too, or not told yet) would read its stale values after the new primary acknowledged
//! newer writes. So when its lease's local deadline passes (the last renewal's send time
//! plus the TTL, less a margin: before etcd can expire it), the memnode sets its word's
//! fence bit: nothing read from it stands by any map a client has, and clients wait for a
//! newer one (`racekv_client::map_fence`). Registered again, it reads the map: one that
//! still lists it gets a new epoch (the same map, written by CAS: no failover took it, so
//! what it holds is current) and the word that epoch, unfenced; one that no longer lists it
//! needs nothing (no client routes to it by that map; a rejoin makes a newer one). While
//! etcd itself is down for longer than a lease every memnode fences: the price of never
//! serving a stale read (the cluster is CP).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus::IntCounter;
use racekv_coord::etcd::{Etcd, Registration, DEFAULT_TIMEOUT};
use racekv_coord::ClusterMap;
use racekv_hashing::format::{
    fence_map_epoch, raise_map_epoch, read_map_word, set_map_epoch, unfence_map_epoch, MapWord,
};
use racekv_transport::local::LocalConnection;
use racekv_transport::region::Region;

use crate::config::MemnodeConfig;
use crate::gauges::Gauges;

/// How often the map watcher looks for a stop request (and, fenced, tries to clear it).
const POLL: Duration = Duration::from_millis(200);
/// Shortest wait between two turns of the map watcher.
const MIN_WAIT: Duration = Duration::from_millis(1);

static FENCES: LazyLock<IntCounter> = LazyLock::new(|| {
    racekv_telemetry::metric::counter(
        "racekv_memnode_fences_total",
        "Times a memnode fenced itself when its etcd lease's local deadline passed unrenewed",
    )
});

/// etcd, connected before the memnode serves.
pub(crate) struct Coordinator {
    etcd: Etcd,
    /// The map's revision when the start read it (0: no map yet).
    revision: i64,
}

/// A live registration and the map watcher, which holds it (dropped: the watcher stops, the
/// lease is revoked).
pub(crate) struct Registered {
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
}

/// Connects to etcd if the configuration names it (None: it does not), and sets the
/// region's map epoch word to the epoch of the cluster's map (0 without etcd or a map: a
/// word left by an earlier cluster must not make clients of this one wait for its maps). A
/// build without the etcd client refuses (`CoordError::NotBuilt`).
pub(crate) fn connect(
    config: &MemnodeConfig,
    region: &Arc<Region>,
    gauges: &Gauges,
) -> anyhow::Result<Option<Coordinator>> {
    LazyLock::force(&FENCES); // exported at 0 from the start, etcd or not
    let local = LocalConnection::new(Arc::clone(region), None);
    if config.etcd_endpoints.is_empty() {
        set_map_epoch(&local, 0).context("clearing the map epoch")?;
        return Ok(None);
    }
    let etcd = Etcd::connect(&config.etcd_endpoints, &config.cluster, DEFAULT_TIMEOUT).context("connecting to etcd")?;
    let (epoch, revision) = match etcd.map().context("reading the cluster map")? {
        Some((map, revision)) => (map.epoch, revision),
        None => (0, 0),
    };
    set_map_epoch(&local, epoch).context("setting the map epoch")?;
    gauges.map_epoch.set(epoch as i64);
    Ok(Some(Coordinator { etcd, revision }))
}

impl Coordinator {
    /// Registers the memnode (it serves now) and starts raising its map epoch word as newer
    /// maps are written.
    pub(crate) fn register(
        self,
        config: &MemnodeConfig,
        node_id: u64,
        endpoints: Vec<String>,
        region: &Arc<Region>,
        gauges: &Arc<Gauges>,
    ) -> anyhow::Result<Registered> {
        if let Some(e) = endpoints.iter().find(|e| is_unspecified(e)) {
            tracing::warn!(
                endpoint = %e,
                "registering an unspecified address: computenodes on other hosts cannot reach it (set advertise_endpoints)"
            );
        }
        let info = racekv_coord::MemnodeInfo { node_id, endpoints, region_bytes: region.len() };
        let lease = Duration::from_millis(config.etcd_lease_ms);
        let registration = self.etcd.register(&info, lease).context("registering in etcd")?;
        tracing::info!(
            cluster = %config.cluster,
            node_id = format_args!("{:#018x}", info.node_id),
            lease_ms = config.etcd_lease_ms,
            "registered in etcd"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let local = LocalConnection::new(Arc::clone(region), None);
        let follower = Follower { etcd: self.etcd, registration, node_id, local, gauges: Arc::clone(gauges) };
        let (flag, revision) = (Arc::clone(&stop), self.revision);
        let watcher = std::thread::Builder::new()
            .name("map-epoch".into())
            .spawn(move || follower.follow(revision, &flag))
            .context("starting the map watcher")?;
        Ok(Registered { stop, watcher: Some(watcher) })
    }
}

/// `tcp:0.0.0.0:7400`, `verbs:[::]:7500`: listening everywhere, reachable nowhere by name.
fn is_unspecified(endpoint: &str) -> bool {
    let host = endpoint.split_once(':').map_or("", |(_, rest)| rest.rsplit_once(':').map_or(rest, |(host, _)| host));
    host.trim_matches(|c| c == '[' || c == ']').parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified())
}

/// Raises the word as maps come, and fences (and clears the fence of) the memnode by its
/// lease (the module's comment).
struct Follower {
    etcd: Etcd,
    registration: Registration,
    node_id: u64,
    local: LocalConnection,
    gauges: Arc<Gauges>,
}

impl Follower {
    fn follow(self, revision: i64, stop: &AtomicBool) {
        let watch = self.etcd.watch_map(revision);
        // Fenced, or the fence cleared and the new epoch's map not yet written.
        let mut pending = false;
        while !stop.load(Ordering::Relaxed) {
            let deadline = self.registration.deadline();
            let now = Instant::now();
            if now >= deadline {
                // Whatever the last clearing left (its map may not be written yet).
                pending |= self.fence();
            } else if pending {
                pending = !self.unfence();
            }
            // Awake at the deadline, not up to a POLL after it (and never spinning should a
            // fence fail).
            let wait = if pending { POLL } else { deadline.saturating_duration_since(now).clamp(MIN_WAIT, POLL) };
            match watch.next(wait) {
                None => {}
                Some(Ok((map, _))) => match raise_map_epoch(&self.local, map.epoch) {
                    Ok(now) => {
                        self.gauges.map_epoch.set(now as i64);
                        tracing::info!(epoch = map.epoch, "serving by a new cluster map");
                    }
                    Err(e) => tracing::error!(epoch = map.epoch, "could not raise the map epoch: {e}"),
                },
                Some(Err(e)) => tracing::warn!("an unreadable cluster map in etcd: {e}"),
            }
        }
    }

    /// Sets the fence bit (counted and told once per fence); whether it is set.
    fn fence(&self) -> bool {
        if read_map_word(&self.local).is_ok_and(|w| MapWord::decode(w).fenced) {
            return true;
        }
        match fence_map_epoch(&self.local) {
            Ok(word) => {
                FENCES.inc();
                self.gauges.fenced.set(1);
                tracing::warn!(
                    epoch = word.epoch,
                    "the etcd lease was not renewed in time: fenced (clients wait for a newer map) until registered again"
                );
                true
            }
            Err(e) => {
                tracing::error!("could not fence the memnode: {e}");
                false
            }
        }
    }

    /// Registered again: clears the fence by the map in etcd (the module's comment); whether
    /// all is done (false: etcd did not answer, or another map came first; tried again).
    fn unfence(&self) -> bool {
        let (map, revision) = match self.etcd.map() {
            Ok(Some(found)) => found,
            Ok(None) => return self.clear_fence(0), // no map: no client routes by one
            Err(e) => {
                tracing::debug!("fenced, registered again, but the map could not be read: {e}");
                return false;
            }
        };
        let word = match read_map_word(&self.local) {
            Ok(word) => MapWord::decode(word),
            Err(e) => {
                tracing::error!("could not read the map epoch word: {e}");
                return false;
            }
        };
        // Down memnodes stay listed (failover only empties their replica sets).
        let holds = map.write_sets().iter().any(|set| set.contains(&self.node_id));
        if !holds {
            return self.clear_fence(map.epoch);
        }
        // Clients must route by a map newer than any they have; the word's epoch may be
        // above the map's already (a mover raised it before writing its map, or an earlier
        // try cleared the fence but lost the race to write the map).
        let epoch = if word.fenced { (map.epoch + 1).max(word.epoch) } else { word.epoch };
        if epoch <= map.epoch {
            return self.clear_fence(map.epoch);
        }
        // The word first: a client that reads it waits for this epoch, which comes from
        // this memnode or from whoever wrote a map first (a failover there routes it away).
        if !self.clear_fence(epoch) {
            return false;
        }
        match self.etcd.put_map(&ClusterMap { epoch, ..map }, Some(revision)) {
            Ok(Some(_)) => {
                tracing::info!(epoch, "registered again: the same map under a new epoch, for the fence's readers");
                true
            }
            Ok(None) => false, // another map came first: read it next time
            Err(e) => {
                tracing::debug!("the fence is cleared, but the map could not be written (tried again): {e}");
                false
            }
        }
    }

    /// Clears the fence bit, raising the epoch to at least `epoch`; whether it did.
    fn clear_fence(&self, epoch: u64) -> bool {
        match unfence_map_epoch(&self.local, epoch) {
            Ok(after) => {
                if self.gauges.fenced.get() != 0 {
                    tracing::info!(epoch = after.epoch, "registered again: the fence is cleared");
                }
                self.gauges.fenced.set(0);
                self.gauges.map_epoch.set(after.epoch as i64);
                true
            }
            Err(e) => {
                tracing::error!("could not clear the fence: {e}");
                false
            }
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join(); // it looks at the flag every POLL
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn unspecified_addresses_are_told_apart() {
        for e in ["tcp:0.0.0.0:7400", "verbs:[::]:7500", "tcp:[::]:1"] {
            assert!(super::is_unspecified(e), "{e}");
        }
        for e in ["tcp:127.0.0.1:7400", "tcp:10.0.0.5:7400", "shm:/run/racekv/m.sock", "tcp:memnode-0:7400"] {
            assert!(!super::is_unspecified(e), "{e}");
        }
    }
}
