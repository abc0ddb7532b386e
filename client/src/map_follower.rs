//! Following the cluster map in etcd (issue 17), for computenodes and embedded clients: a
//! start reads the map (waiting for `racekv cluster init` if there is none yet) and picks an
//! endpoint per memnode; a watcher thread then installs every newer map into a [`Router`],
//! and reads etcd at once when a session asks (a memnode served a newer map than installed).
//!
//! A later map that lists a memnode this process has no connection to (`racekv cluster
//! add-memnode`) is installed only once the owner's `connect` hook connected to it: the
//! hook appends it to the owner's memnodes and to the router's shards.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use racekv_coord::etcd::{Etcd, DEFAULT_TIMEOUT};
use racekv_coord::{ClusterMap, MemnodeInfo};
use racekv_transport::Endpoint;

use crate::error::ClientError;
use crate::map_routing::Router;

/// How often a start looks for the first map, and the watcher for a stop request and for
/// sessions wanting the map read (the watch itself delivers maps at once).
const POLL: Duration = Duration::from_millis(200);
/// The map lease of embedded clients and computenodes unless told otherwise: half the
/// memnodes' default etcd lease (3 s), under the two thirds [`MapSource::with_lease`] asks.
pub const DEFAULT_MAP_LEASE: Duration = Duration::from_millis(1_500);
/// Shortest time between two reads renewing the map lease.
const MIN_CONFIRM_PERIOD: Duration = Duration::from_millis(20);

/// What became of a map the watcher received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Routed by from now on.
    Installed,
    /// Not applicable here (older, or naming a memnode this process is not connected to).
    Refused,
    /// Unreadable.
    Error,
}

impl Outcome {
    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Installed => "installed",
            Outcome::Refused => "refused",
            Outcome::Error => "error",
        }
    }
}

/// The cluster map a start read, and where it came from.
pub struct MapSource {
    etcd: Etcd,
    map: ClusterMap,
    revision: i64,
    /// When the read that returned it was sent (the map lease counts from then).
    read_at: Instant,
    /// The map lease its follower keeps ([`MapSource::with_lease`]; None: none).
    lease: Option<Duration>,
}

/// Installs newer maps in the background; stops when dropped.
pub struct MapFollower {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn coordinator(e: impl std::fmt::Display) -> ClientError {
    ClientError::Config(format!("the cluster map: {e}"))
}

/// Reads cluster `cluster`'s map from etcd at `endpoints`, waiting up to `wait` for a first.
pub fn fetch(endpoints: &[String], cluster: &str, wait: Duration) -> Result<MapSource, ClientError> {
    let etcd = Etcd::connect(endpoints, cluster, DEFAULT_TIMEOUT).map_err(coordinator)?;
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        let read_at = Instant::now();
        if let Some((map, revision)) = etcd.map().map_err(coordinator)? {
            tracing::info!(cluster, epoch = map.epoch, partitions = map.partitions.len(), "routing by the cluster map");
            return Ok(MapSource { etcd, map, revision, read_at, lease: None });
        }
        if Instant::now() >= deadline {
            return Err(ClientError::Config(format!(
                "cluster {cluster} has no map after {} ms: run `racekv cluster init` once its memnodes are registered",
                wait.as_millis()
            )));
        }
        if !said {
            tracing::info!(cluster, "waiting for the cluster's first map (`racekv cluster init`)");
            said = true;
        }
        std::thread::sleep(POLL);
    }
}

impl MapSource {
    /// Its follower keeps a map lease of `lease` (zero: none): see [`MapSource::follow`].
    /// A process that has not heard from etcd for a lease may miss a failover, so its
    /// sessions refuse to route by the map until etcd answers again
    /// (`ClientError::MapUnconfirmed`). Keep it under two thirds of the memnodes' etcd
    /// lease: a memnode and this process cut off together, the memnode is failed over no
    /// sooner than that after this process last heard from etcd.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = (!lease.is_zero()).then_some(lease);
        self
    }

    /// The map read.
    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// The endpoint to reach each memnode of the map by, in the map's order.
    pub fn endpoints(&self) -> Result<Vec<String>, ClientError> {
        self.map.memnodes.iter().map(choose_endpoint).collect()
    }

    /// The node id of each memnode of the map, in the map's order.
    pub fn node_ids(&self) -> Vec<u64> {
        self.map.memnodes.iter().map(|m| m.node_id).collect()
    }

    /// Per partition, the node ids its writes go to: its replica set (the primary first),
    /// then the memnodes joining it (written to like backups, never read from).
    pub fn replica_sets(&self) -> Vec<Vec<u64>> {
        self.map.write_sets()
    }

    /// Watches for newer maps and installs them into `router`, telling `outcome` of each.
    /// A map listing a memnode the router has no shard for is installed after `connect`
    /// connected to it (and made it the router's next shard, [`Router::add_memnode`]); if
    /// that fails for a memnode the map writes to, the map is refused (and read again when
    /// a session asks for it). With a lease ([`MapSource::with_lease`]), etcd is also read
    /// every quarter of it, and each answer that the installed map is the newest renews
    /// the router's map lease ([`Router::confirm`]): sessions stop when it lapses.
    pub fn follow(
        self,
        router: Weak<Router>,
        connect: impl Fn(&Router, &MemnodeInfo) -> Result<(), String> + Send + 'static,
        outcome: impl Fn(Outcome) + Send + 'static,
    ) -> Result<MapFollower, ClientError> {
        let lease = self.lease;
        if let (Some(lease), Some(router)) = (lease, router.upgrade()) {
            confirm_if_current(&router, Some(lease), Some((self.read_at, self.map.epoch)));
            // Connecting to the memnodes may have outlasted the start's read: read again,
            // or the first operations could find the lease lapsed.
            let sent = Instant::now();
            if let Ok(Some((map, _))) = self.etcd.map() {
                confirm_if_current(&router, Some(lease), Some((sent, map.epoch)));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("map-follower".into())
            .spawn(move || watch(self, router, flag, connect, outcome))
            .map_err(|e| ClientError::Config(format!("starting the cluster map's watcher: {e}")))?;
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

fn watch(
    source: MapSource,
    router: Weak<Router>,
    stop: Arc<AtomicBool>,
    connect: impl Fn(&Router, &MemnodeInfo) -> Result<(), String>,
    outcome: impl Fn(Outcome),
) {
    let (watch, lease) = (source.etcd.watch_map(source.revision), source.lease);
    let period = lease.map(|l| (l / 4).max(MIN_CONFIRM_PERIOD));
    let mut next_confirm = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let wait = period.map_or(POLL, |_| next_confirm.saturating_duration_since(Instant::now()).min(POLL));
        let next = watch.next(wait);
        let Some(router) = router.upgrade() else { return };
        let due = period.is_some_and(|_| Instant::now() >= next_confirm);
        // A read of etcd that, once its map is installed, vouches for the routing.
        let mut vouching = None;
        let next = match next {
            Some(next) => next,
            // A memnode serves a newer map than installed, or the lease wants renewing:
            // read it rather than wait for the watch (which may be broken or behind).
            None if due || router.take_wanted() => {
                let sent = Instant::now();
                if let Some(period) = period.filter(|_| due) {
                    next_confirm = sent + period;
                }
                match source.etcd.map() {
                    Ok(Some((map, revision))) => {
                        vouching = Some((sent, map.epoch));
                        match Some(map.epoch) > router.epoch() {
                            true => Ok((map, revision)),
                            false => {
                                confirm_if_current(&router, lease, vouching);
                                continue;
                            }
                        }
                    }
                    Ok(None) => continue,
                    // Unreachable, as a while ago (the watch reports unreadable maps; a
                    // lapsing lease shows in the refusals): no warning several times a second.
                    Err(e) => {
                        tracing::debug!("reading the cluster map from etcd failed: {e}");
                        continue;
                    }
                }
            }
            None => continue,
        };
        outcome(match next {
            Ok((map, _revision)) => match connect_new(&router, &map, &connect)
                .and_then(|()| router.install(map.epoch, map.replicas, map.snapshot_writes, &map.write_sets()))
            {
                Ok(()) => {
                    tracing::info!(epoch = map.epoch, partitions = map.partitions.len(), "installed a new cluster map");
                    Outcome::Installed
                }
                Err(reason) => {
                    tracing::warn!(epoch = map.epoch, "kept the current routing: {reason}");
                    Outcome::Refused
                }
            },
            Err(e) => {
                tracing::warn!("an unreadable cluster map in etcd: {e}");
                Outcome::Error
            }
        });
        confirm_if_current(&router, lease, vouching);
    }
}

/// Renews the router's map lease when etcd's answer (sent then, of that epoch) is the map
/// it routes by.
fn confirm_if_current(router: &Router, lease: Option<Duration>, answer: Option<(Instant, u64)>) {
    if let (Some(lease), Some((sent, epoch))) = (lease, answer) {
        if router.epoch() == Some(epoch) {
            router.confirm(sent, lease);
        }
    }
}

/// Connects (through `dial`) to each memnode a map lists, by `endpoints` and `node_ids` (in
/// the map's order). One the map writes nothing to (`write_sets`: failed over or drained;
/// down, or back empty under a new id) is left out when it cannot be reached or answers with
/// another node id: a later map that writes to it has it connected then (`follow`'s hook).
/// Returns those connected, in order, and the node id the map gives each (one that
/// answered with another is kept when written to, for [`Router::map`] to refuse).
pub fn connect_listed<M>(
    endpoints: &[String],
    node_ids: &[u64],
    write_sets: &[Vec<u64>],
    dial: impl Fn(&str) -> Result<M, ClientError>,
    node_id: impl Fn(&M) -> u64,
) -> Result<(Vec<M>, Vec<u64>), ClientError> {
    assert_eq!(endpoints.len(), node_ids.len(), "an endpoint per listed memnode");
    let written: std::collections::BTreeSet<u64> = write_sets.iter().flatten().copied().collect();
    let (mut connected, mut mapped) = (Vec::with_capacity(endpoints.len()), Vec::with_capacity(endpoints.len()));
    for (endpoint, id) in endpoints.iter().zip(node_ids) {
        match dial(endpoint) {
            Ok(m) if node_id(&m) == *id || written.contains(id) => {
                connected.push(m);
                mapped.push(*id);
            }
            Err(e) if written.contains(id) => return Err(e),
            other => tracing::warn!(
                node = format_args!("{id:#x}"),
                "memnode {endpoint}, which the map writes nothing to, left unconnected: {}",
                other.map_or_else(|e| e.to_string(), |m| format!("it has node id {:#x}", node_id(&m)))
            ),
        }
    }
    Ok((connected, mapped))
}

/// The endpoint this process reaches `memnode` by: its shared-memory socket when that is
/// on this host, else verbs in a build with them, else tcp.
pub fn choose_endpoint(memnode: &MemnodeInfo) -> Result<String, ClientError> {
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
        .ok_or_else(|| {
            ClientError::Config(format!(
                "memnode {:#x} lists no endpoint this process can use: {:?}",
                memnode.node_id, memnode.endpoints
            ))
        })
}

/// Connects (through `connect`) every memnode `map` lists that `router` has no shard for.
/// An error only for one the map writes to (one holding nothing can wait for a later map).
fn connect_new(
    router: &Router,
    map: &ClusterMap,
    connect: &impl Fn(&Router, &MemnodeInfo) -> Result<(), String>,
) -> Result<(), String> {
    let written: std::collections::BTreeSet<u64> = map.write_sets().into_iter().flatten().collect();
    for m in map.memnodes.iter().filter(|m| router.shard_of(m.node_id).is_none()) {
        match connect(router, m) {
            Ok(()) => tracing::info!(node = format_args!("{:#x}", m.node_id), "connected to a memnode the map added"),
            Err(e) if written.contains(&m.node_id) => {
                return Err(format!(
                    "connecting to memnode {:#x}, which map epoch {} writes to: {e}",
                    m.node_id, map.epoch
                ))
            }
            Err(e) => {
                tracing::warn!(node = format_args!("{:#x}", m.node_id), "connecting to a memnode the map added: {e}")
            }
        }
    }
    Ok(())
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
        assert!(e.contains("no endpoint this process can use"), "{e}");
    }
}
