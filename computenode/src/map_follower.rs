//! The computenode's side of the cluster map (issue 17): with `etcd_endpoints`, the start
//! reads the cluster's map (waiting for `racekv cluster init` if there is none yet), connects
//! to every memnode it lists and routes each key to its partition's primary; a watcher thread
//! then installs every newer map as it is written, while sessions keep routing.
//!
//! Not built yet: connecting memnodes that a later map adds (such a map is refused, counted
//! and logged; the old routing stays), replicas, and the epoch check on the memnodes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus::IntCounterVec;
use racekv_coord::etcd::{Etcd, DEFAULT_TIMEOUT};
use racekv_coord::{ClusterMap, MemnodeInfo};
use racekv_transport::Endpoint;

use crate::cluster::{Cluster, Routing};
use crate::config::ComputenodeConfig;

/// How often a start looks for the first map, and the watcher for a stop request and for
/// sessions wanting the map read (the watch itself delivers maps at once).
const POLL: Duration = Duration::from_millis(200);

static MAPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_computenode_cluster_maps_total",
        "Cluster maps received from etcd, by outcome (installed, refused: not applicable here, error: unreadable)",
        &["outcome"],
        &[&["installed", "refused", "error"]],
    )
});

/// The cluster map a start read, and where it came from.
pub(crate) struct MapSource {
    etcd: Etcd,
    map: ClusterMap,
    revision: i64,
}

/// Installs newer maps in the background; stops when dropped.
pub(crate) struct MapFollower {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The cluster map, if the configuration names etcd (None: it does not). Waits up to
/// `etcd_map_wait_ms` for a first map.
pub(crate) fn fetch(config: &ComputenodeConfig) -> anyhow::Result<Option<MapSource>> {
    LazyLock::force(&MAPS); // its series show (as 0) on every computenode's dashboard
    if config.etcd_endpoints.is_empty() {
        return Ok(None);
    }
    let etcd = Etcd::connect(&config.etcd_endpoints, &config.cluster, DEFAULT_TIMEOUT).context("connecting to etcd")?;
    let deadline = Instant::now() + Duration::from_millis(config.etcd_map_wait_ms);
    let mut said = false;
    loop {
        if let Some((map, revision)) = etcd.map().context("reading the cluster map")? {
            tracing::info!(cluster = %config.cluster, epoch = map.epoch, partitions = map.partitions.len(), "routing by the cluster map");
            return Ok(Some(MapSource { etcd, map, revision }));
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "cluster {} has no map after {} ms (etcd_map_wait_ms): run `racekv cluster init` once its memnodes are registered",
            config.cluster,
            config.etcd_map_wait_ms
        );
        if !said {
            tracing::info!(cluster = %config.cluster, "waiting for the cluster's first map (`racekv cluster init`)");
            said = true;
        }
        std::thread::sleep(POLL);
    }
}

impl MapSource {
    /// The endpoint to reach each memnode of the map by, in the map's order.
    pub(crate) fn endpoints(&self) -> anyhow::Result<Vec<String>> {
        self.map.memnodes.iter().map(choose_endpoint).collect()
    }

    /// The routing of the map over [`Self::endpoints`].
    pub(crate) fn routing(&self) -> Routing {
        Routing::Map {
            epoch: self.map.epoch,
            node_ids: self.map.memnodes.iter().map(|m| m.node_id).collect(),
            primaries: primaries(&self.map),
        }
    }

    /// Watches for newer maps and installs them into `cluster`.
    pub(crate) fn follow(self, cluster: &Arc<Cluster>) -> anyhow::Result<MapFollower> {
        let stop = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(cluster);
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("map-follower".into())
            .spawn(move || watch(self, weak, flag))
            .context("starting the cluster map's watcher")?;
        Ok(MapFollower { stop, thread: Some(thread) })
    }
}

impl Drop for MapFollower {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join(); // it looks at the flag every POLL
        }
    }
}

fn watch(source: MapSource, cluster: Weak<Cluster>, stop: Arc<AtomicBool>) {
    let watch = source.etcd.watch_map(source.revision);
    while !stop.load(Ordering::Relaxed) {
        let next = watch.next(POLL);
        let Some(cluster) = cluster.upgrade() else { return };
        let next = match next {
            Some(next) => next,
            // A memnode serves a newer map than installed: read it rather than wait for
            // the watch (which may be broken or behind).
            None if cluster.map_wanted() => match source.etcd.map() {
                Ok(Some((map, revision))) if Some(map.epoch) > cluster.map_epoch() => Ok((map, revision)),
                Ok(_) => continue,
                Err(e) => Err(e),
            },
            None => continue,
        };
        let outcome = match next {
            Ok((map, _revision)) => match cluster.install_map(map.epoch, &primaries(&map)) {
                Ok(()) => {
                    tracing::info!(epoch = map.epoch, partitions = map.partitions.len(), "installed a new cluster map");
                    "installed"
                }
                Err(reason) => {
                    tracing::warn!(epoch = map.epoch, "kept the current routing: {reason}");
                    "refused"
                }
            },
            Err(e) => {
                tracing::warn!("an unreadable cluster map in etcd: {e}");
                "error"
            }
        };
        MAPS.with_label_values(&[outcome]).inc();
    }
}

fn primaries(map: &ClusterMap) -> Vec<u64> {
    map.partitions.iter().map(|set| set[0]).collect()
}

/// The endpoint this computenode reaches `memnode` by: its shared-memory socket when that
/// is on this host, else verbs in a build with them, else tcp.
fn choose_endpoint(memnode: &MemnodeInfo) -> anyhow::Result<String> {
    let rank = |e: &Endpoint| match e {
        Endpoint::Shm(path) if path.exists() => Some(0),
        Endpoint::Verbs(_) if cfg!(feature = "rdma") => Some(1),
        Endpoint::Tcp(_) => Some(2),
        _ => None,
    };
    memnode
        .endpoints
        .iter()
        .filter_map(|text| text.parse::<Endpoint>().ok().and_then(|e| rank(&e).map(|r| (r, text))))
        .min_by_key(|(r, _)| *r)
        .map(|(_, text)| text.clone())
        .with_context(|| {
            format!(
                "memnode {:#x} lists no endpoint this computenode can use: {:?}",
                memnode.node_id, memnode.endpoints
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memnode(endpoints: &[&str]) -> MemnodeInfo {
        MemnodeInfo { node_id: 7, endpoints: endpoints.iter().map(|e| e.to_string()).collect(), region_bytes: 1 << 20 }
    }

    #[test]
    fn a_local_shm_socket_wins_then_verbs_then_tcp() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("m.sock");
        std::fs::write(&socket, b"").unwrap();
        let shm = format!("shm:{}", socket.display());
        let tcp = "tcp:127.0.0.1:7400";
        assert_eq!(choose_endpoint(&memnode(&[tcp, &shm])).unwrap(), shm);
        assert_eq!(choose_endpoint(&memnode(&[tcp, "shm:/nonexistent/racekv.sock"])).unwrap(), tcp);
        let verbs = "verbs:127.0.0.1:7401";
        let want = if cfg!(feature = "rdma") { verbs } else { tcp };
        assert_eq!(choose_endpoint(&memnode(&[tcp, verbs])).unwrap(), want);
        let e = choose_endpoint(&memnode(&["shm:/nonexistent/racekv.sock", "bogus"])).unwrap_err().to_string();
        assert!(e.contains("no endpoint this computenode can use"), "{e}");
    }
}
