//! The memnode's side of etcd (issue 17): with `etcd_endpoints` set, the memnode takes the
//! epoch of the cluster's map before it serves (the region's map epoch word, which clients
//! routing by a map read after every batch: `racekv_client::map_fence`), raises it as newer
//! maps are written, and lists itself (node id, endpoints, region size) under
//! `/racekv/<cluster>/memnodes/` with a lease it keeps alive (`racekv_coord::etcd`), once it
//! serves; it revokes the lease first when it stops, so the list holds memnodes that serve
//! (and, after a crash, ones that did until at most `etcd_lease_ms` ago).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use racekv_coord::etcd::{Etcd, DEFAULT_TIMEOUT};
use racekv_hashing::format::{raise_map_epoch, set_map_epoch};
use racekv_transport::local::LocalConnection;
use racekv_transport::region::Region;

use crate::config::MemnodeConfig;
use crate::gauges::Gauges;

/// How often the map watcher looks for a stop request.
const POLL: Duration = Duration::from_millis(200);

/// etcd, connected before the memnode serves.
pub(crate) struct Coordinator {
    etcd: Etcd,
    /// The map's revision when the start read it (0: no map yet).
    revision: i64,
}

/// A live registration and the map watcher (dropped: the watcher stops, the lease is revoked).
pub(crate) struct Registered {
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    _registration: racekv_coord::etcd::Registration,
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
        let (flag, region, gauges) = (Arc::clone(&stop), Arc::clone(region), Arc::clone(gauges));
        let watcher = std::thread::Builder::new()
            .name("map-epoch".into())
            .spawn(move || follow(self, &region, &gauges, &flag))
            .context("starting the map watcher")?;
        Ok(Registered { stop, watcher: Some(watcher), _registration: registration })
    }
}

/// `tcp:0.0.0.0:7400`, `verbs:[::]:7500`: listening everywhere, reachable nowhere by name.
fn is_unspecified(endpoint: &str) -> bool {
    let host = endpoint.split_once(':').map_or("", |(_, rest)| rest.rsplit_once(':').map_or(rest, |(host, _)| host));
    host.trim_matches(|c| c == '[' || c == ']').parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified())
}

fn follow(coordinator: Coordinator, region: &Arc<Region>, gauges: &Gauges, stop: &AtomicBool) {
    let local = LocalConnection::new(Arc::clone(region), None);
    let watch = coordinator.etcd.watch_map(coordinator.revision);
    while !stop.load(Ordering::Relaxed) {
        match watch.next(POLL) {
            None => {}
            Some(Ok((map, _))) => match raise_map_epoch(&local, map.epoch) {
                Ok(now) => {
                    gauges.map_epoch.set(now as i64);
                    tracing::info!(epoch = map.epoch, "serving by a new cluster map");
                }
                Err(e) => tracing::error!(epoch = map.epoch, "could not raise the map epoch: {e}"),
            },
            Some(Err(e)) => tracing::warn!("an unreadable cluster map in etcd: {e}"),
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
