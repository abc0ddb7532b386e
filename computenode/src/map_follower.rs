//! The computenode's side of the cluster map (issue 17): with `etcd_endpoints`, the start
//! reads the cluster's map (`racekv_client::map_follower`), connects to every memnode it
//! lists and routes each key to its partition's primary; a watcher then installs every
//! newer map as it is written (connecting first to memnodes it adds), counted in
//! `racekv_computenode_cluster_maps_total`.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use anyhow::Context;
use prometheus::IntCounterVec;
use racekv_client::map_follower::{MapFollower, MapSource};

use crate::cluster::{Cluster, Routing};
use crate::config::ComputenodeConfig;

static MAPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_computenode_cluster_maps_total",
        "Cluster maps received from etcd, by outcome (installed, refused: not applicable here, error: unreadable)",
        &["outcome"],
        &[&["installed", "refused", "error"]],
    )
});

/// The cluster map, if the configuration names etcd (None: it does not). Waits up to
/// `etcd_map_wait_ms` for a first map.
pub(crate) fn fetch(config: &ComputenodeConfig) -> anyhow::Result<Option<MapSource>> {
    LazyLock::force(&MAPS); // its series show (as 0) on every computenode's dashboard
    if config.etcd_endpoints.is_empty() {
        return Ok(None);
    }
    let wait = Duration::from_millis(config.etcd_map_wait_ms);
    let source = racekv_client::map_follower::fetch(&config.etcd_endpoints, &config.cluster, wait)
        .with_context(|| format!("reading cluster {}'s map from etcd (etcd_map_wait_ms)", config.cluster))?;
    Ok(Some(source.with_lease(Duration::from_millis(config.map_lease_ms))))
}

/// The routing of `source`'s map over its memnodes (in the map's order).
pub(crate) fn routing(source: &MapSource) -> Routing {
    Routing::Map {
        epoch: source.map().epoch,
        replicas: source.map().replicas,
        snapshot_writes: source.map().snapshot_writes,
        node_ids: source.node_ids(),
        replica_sets: source.replica_sets(),
    }
}

/// Watches for newer maps and installs them into `cluster`.
pub(crate) fn follow(source: MapSource, cluster: &Arc<Cluster>) -> anyhow::Result<MapFollower> {
    let (weak, adder) = (Arc::downgrade(cluster), Arc::downgrade(cluster));
    let add = move |router: &racekv_client::map_routing::Router, info: &racekv_coord::MemnodeInfo| {
        adder.upgrade().ok_or_else(|| "the computenode is stopping".to_string())?.add_memnode(router, info)
    };
    let follower = source.follow(Arc::downgrade(cluster.router()), add, move |outcome| {
        MAPS.with_label_values(&[outcome.name()]).inc();
        if let Some(cluster) = weak.upgrade() {
            cluster.note_map_installed();
        }
    })?;
    Ok(follower)
}
