//! The memnode's registration in etcd (issue 17): with `etcd_endpoints` set, the memnode
//! lists itself (node id, endpoints, region size) under `/racekv/<cluster>/memnodes/` with a
//! lease it keeps alive (`racekv_coord::etcd`), once it serves; it revokes the lease first
//! when it stops, so the list holds memnodes that serve (and, after a crash, ones that did
//! until at most `etcd_lease_ms` ago).

use std::time::Duration;

use anyhow::Context;
use racekv_coord::etcd::{Etcd, DEFAULT_TIMEOUT};

use crate::config::MemnodeConfig;

/// A live registration (dropped: revoked).
pub(crate) struct Registered {
    _registration: racekv_coord::etcd::Registration,
}

/// Registers the memnode if the configuration names etcd (None: it does not). A build
/// without the etcd client refuses (`CoordError::NotBuilt`).
pub(crate) fn register(
    config: &MemnodeConfig,
    node_id: u64,
    endpoints: Vec<String>,
    region_bytes: u64,
) -> anyhow::Result<Option<Registered>> {
    if config.etcd_endpoints.is_empty() {
        return Ok(None);
    }
    let info = racekv_coord::MemnodeInfo { node_id, endpoints, region_bytes };
    let etcd = Etcd::connect(&config.etcd_endpoints, &config.cluster, DEFAULT_TIMEOUT).context("connecting to etcd")?;
    let lease = Duration::from_millis(config.etcd_lease_ms);
    let registration = etcd.register(&info, lease).context("registering in etcd")?;
    tracing::info!(
        cluster = %config.cluster,
        node_id = format_args!("{:#018x}", info.node_id),
        lease_ms = config.etcd_lease_ms,
        "registered in etcd"
    );
    Ok(Some(Registered { _registration: registration }))
}
