//! The memnodes a computenode serves, set up once at daemon start: per memnode a pool of
//! connections, its metadata, one shared directory cache and prefetched chunks. Workers get
//! [`Session`]s over virtual connections; a few are kept pre-initialized so that
//! [`Cluster::attach`] is a pop from a lock-free queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use parking_lot::{Condvar, Mutex};
use prometheus::{Histogram, IntCounter, IntGauge};
use racekv_client::map_routing::{Router, SessionRouting};
use racekv_client::{ClientError, Session, Shards};
use racekv_hashing::{Layout, Table, TableClient, TableOptions};
use racekv_transport::{ConnectOptions, Connection, Endpoint};

use crate::chunks::PrefetchingChunks;
use crate::pool::{Pool, UpgradePolicy, Upgrader, VirtualConnection};

struct Metrics {
    attach_seconds: Histogram,
    attaches: IntCounter,
    cold_attaches: IntCounter,
    map_epoch: IntGauge,
    map_lease_refusals: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        attach_seconds: metric::latency_histogram(
            "racekv_computenode_attach_seconds",
            "Time to hand a worker a session",
        ),
        attaches: metric::counter("racekv_computenode_attaches_total", "Sessions handed to workers"),
        cold_attaches: metric::counter(
            "racekv_computenode_cold_attaches_total",
            "Attaches that found no pre-initialized session and built one",
        ),
        map_epoch: metric::gauge(
            "racekv_computenode_map_epoch",
            "Epoch of the cluster map keys are routed by (0: a fixed ring, no coordinator)",
        ),
        map_lease_refusals: metric::counter(
            "racekv_computenode_map_lease_refusals_total",
            "Commands refused because etcd had not confirmed the cluster map within map_lease_ms",
        ),
    }
});

/// What the cluster needs to know.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The memnodes' endpoints (`shm:/path`, `tcp:host:port`, `verbs:host:port`).
    pub memnodes: Vec<String>,
    /// Token, timeout and TLS of every connection to a memnode.
    pub connect: ConnectOptions,
    /// Connections set up to each memnode at start (the pool virtual connections share).
    pub connections_per_memnode: usize,
    /// The table clients' grace period for freed blocks and their operation timeout.
    pub table: TableOptions,
    /// When a busy virtual connection gets a dedicated connection of its own.
    pub upgrade: UpgradePolicy,
    /// Pre-initialized sessions kept ready for attach.
    pub ready_sessions: usize,
    /// Chunks kept prefetched per memnode.
    pub prefetch_chunks: usize,
    /// How keys are routed to the memnodes.
    pub routing: Routing,
}

/// How a cluster routes keys to its memnodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Routing {
    /// A fixed consistent-hashing ring over the memnodes' node ids (no coordinator).
    #[default]
    Ring,
    /// By a cluster map (issue 17): the memnodes must have the node ids the map gives them,
    /// and each partition is served by its primary.
    Map {
        /// The map's epoch.
        epoch: u64,
        /// The map's replication factor R.
        replicas: u8,
        /// Replicated writes go by the snapshot protocol (the map's flag).
        snapshot_writes: bool,
        /// The node id the map gives each of [`ClusterOptions::memnodes`], in order.
        node_ids: Vec<u64>,
        /// Per partition, its replica set's node ids (the primary first).
        replica_sets: Vec<Vec<u64>>,
    },
}

/// One memnode, as the daemon holds it.
pub struct Memnode {
    /// Its endpoint, as errors and metrics name it.
    pub label: String,
    /// Its persistent node id (where keys hash to on the ring).
    pub node_id: u64,
    /// Its region's layout, read at start.
    pub layout: Layout,
    /// The connections to it that workers' virtual connections share.
    pub pool: Arc<Pool>,
    /// Its table, shared by every session of the daemon.
    pub table: Table,
    /// Its heap chunks, prefetched.
    pub chunks: Arc<PrefetchingChunks>,
}

/// All memnodes, and the ready sessions.
pub struct Cluster {
    /// Append-only: a cluster map may add memnodes ([`Cluster::add_memnode`]); shard `i`
    /// is `memnodes[i]` for good.
    memnodes: boxcar::Vec<Memnode>,
    /// Held while a memnode is appended to `memnodes` and the router's shards.
    adding: Mutex<()>,
    router: Arc<Router>,
    options: ClusterOptions,
    upgrader: Upgrader,
    ready: ArrayQueue<Session<WorkerShards>>,
    refill_wanted: (Mutex<()>, Condvar),
    /// Held by the refiller while it builds and queues a session, so [`Cluster::stop`]
    /// finds every session in the queue.
    building: Mutex<()>,
    stopping: AtomicBool,
    /// Per shard, whether the map routed by last time writes to it: a memnode a newer map
    /// drops from every replica set has what waits on it failed at once
    /// ([`Cluster::note_map_installed`]).
    served: Mutex<Vec<bool>>,
}

impl Cluster {
    /// Connects to every memnode: the expensive setup done once, at daemon start.
    pub fn connect(options: ClusterOptions) -> Result<Arc<Self>, ClientError> {
        LazyLock::force(&METRICS);
        if options.memnodes.is_empty() {
            return Err(ClientError::Config("the computenode needs at least one memnode".into()));
        }
        let upgrader = Upgrader::start().map_err(|e| ClientError::Config(format!("starting the upgrader: {e}")))?;
        let memnodes = boxcar::Vec::with_capacity(options.memnodes.len());
        // With a map: the node id it gives each memnode connected, in its order.
        let mut mapped = Vec::new();
        match &options.routing {
            Routing::Ring => {
                for text in &options.memnodes {
                    memnodes.push(open_memnode(text, &options, &upgrader)?);
                }
            }
            Routing::Map { node_ids, replica_sets, .. } => {
                let listed;
                (listed, mapped) = racekv_client::map_follower::connect_listed(
                    &options.memnodes,
                    node_ids,
                    replica_sets,
                    |text| open_memnode(text, &options, &upgrader),
                    |m: &Memnode| m.node_id,
                )?;
                for m in listed {
                    memnodes.push(m);
                }
            }
        }
        let ids: Vec<u64> = memnodes.iter().map(|(_, m)| m.node_id).collect();
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(ClientError::Config(format!("{} is listed twice (node id {id})", memnodes[i].label)));
            }
        }
        let router = match &options.routing {
            Routing::Ring => Router::ring(&ids),
            Routing::Map { epoch, replicas, snapshot_writes, replica_sets, .. } => {
                Router::map(*epoch, *replicas, *snapshot_writes, replica_sets, &ids, &mapped, |i| {
                    memnodes[i].label.clone()
                })
                .map_err(ClientError::Config)?
            }
        };
        METRICS.map_epoch.set(router.epoch().unwrap_or(0) as i64);
        let cluster = Arc::new(Self {
            router: Arc::new(router),
            memnodes,
            adding: Mutex::new(()),
            served: Mutex::new(Vec::new()),
            ready: ArrayQueue::new(options.ready_sessions.max(1)),
            options,
            upgrader,
            refill_wanted: (Mutex::new(()), Condvar::new()),
            building: Mutex::new(()),
            stopping: AtomicBool::new(false),
        });
        cluster.note_map_installed(); // which memnodes the first map writes to
        for _ in 0..cluster.options.ready_sessions {
            let _ = cluster.ready.push(cluster.build_session());
        }
        let weak = Arc::downgrade(&cluster);
        std::thread::Builder::new()
            .name("session-refill".into())
            .spawn(move || refill(weak))
            .map_err(|e| ClientError::Config(format!("starting the session refiller: {e}")))?;
        Ok(cluster)
    }

    /// Token, timeout and TLS of the daemon's connections to the memnodes.
    pub fn connect_options(&self) -> &ConnectOptions {
        &self.options.connect
    }

    /// Every memnode, in the order of their shards (the ring's, or the map's then those
    /// later maps added).
    pub fn memnodes(&self) -> Vec<&Memnode> {
        self.memnodes.iter().map(|(_, m)| m).collect()
    }

    /// Connects to memnode `info` that a newer cluster map lists and makes it the router's
    /// next shard (the map follower's hook; sessions build their client for it when they
    /// first use it). Refused when it answers with another node id.
    pub fn add_memnode(&self, router: &Router, info: &racekv_coord::MemnodeInfo) -> Result<(), String> {
        let endpoint = racekv_client::map_follower::choose_endpoint(info).map_err(|e| e.to_string())?;
        let memnode = open_memnode(&endpoint, &self.options, &self.upgrader).map_err(|e| e.to_string())?;
        if memnode.node_id != info.node_id {
            return Err(format!(
                "{} has node id {:#x}, the map says {:#x}",
                memnode.label, memnode.node_id, info.node_id
            ));
        }
        let _adding = self.adding.lock();
        let shard = self.memnodes.push(memnode);
        assert_eq!(router.add_memnode(info.node_id)?, shard, "a memnode's shard is its index in both");
        Ok(())
    }

    /// The epoch of the cluster map keys are routed by (None: a fixed ring).
    pub fn map_epoch(&self) -> Option<u64> {
        self.router.epoch()
    }

    /// How this cluster's sessions route keys (the map follower installs newer maps here).
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Publishes the epoch routed by (after the map follower installed one).
    pub fn note_map_installed(&self) {
        METRICS.map_epoch.set(self.router.epoch().unwrap_or(0) as i64);
        // A memnode the map no longer writes to was failed over (or drained): commands
        // waiting on its connections fail now (clients retry them by the new map) instead of
        // at their timeout; on tcp a stopped memnode would hold them that long.
        let routing = self.router.session();
        let mut served = self.served.lock();
        for (shard, memnode) in self.memnodes.iter() {
            let now = routing.serves(shard);
            if served.get(shard) == Some(&true) && !now {
                tracing::warn!(memnode = %memnode.label, "the cluster map writes nothing to it now: failing what waits on it");
                memnode.pool.abort_all("the cluster map dropped this memnode from every replica set");
            }
            if shard >= served.len() {
                served.resize(shard + 1, false);
            }
            served[shard] = now;
        }
    }

    /// A new session over new virtual connections (allocates; the refiller calls it).
    fn build_session(self: &Arc<Self>) -> Session<WorkerShards> {
        // Routing by a map: every batch also reads the memnode's map epoch (`map_fence`).
        let mut shards = WorkerShards {
            cluster: Arc::clone(self),
            clients: Vec::new(),
            vconns: Vec::new(),
            routing: self.router.session(),
        };
        shards.connect_up_to(self.memnodes.count());
        for (c, (_, m)) in shards.clients.iter_mut().zip(self.memnodes.iter()) {
            // Everything pre-initialized, down to the first heap chunk.
            if let Err(e) = c.prepare() {
                tracing::warn!(memnode = %m.label, "could not fetch a chunk for a ready session: {e}");
            }
        }
        Session::new(shards)
    }

    /// A session for a worker: a pre-initialized one when available (no system call, no
    /// round trip, no allocation), else built on the spot.
    pub fn attach(self: &Arc<Self>) -> Attached {
        let started = Instant::now();
        let session = match self.ready.pop() {
            Some(s) => s,
            None => {
                METRICS.cold_attaches.inc();
                self.build_session()
            }
        };
        // Wake the refiller only when the queue runs low: a wake-up is a system call, and
        // attach must not make one.
        if self.ready.len() < self.options.ready_sessions / 2 {
            self.refill_wanted.1.notify_one();
        }
        METRICS.attaches.inc();
        METRICS.attach_seconds.observe(started.elapsed().as_secs_f64());
        Attached { session: Some(session), cluster: Arc::clone(self) }
    }

    /// Sessions ready for attach now.
    pub fn ready_sessions(&self) -> usize {
        self.ready.len()
    }

    /// How long an operation on a memnode may take before it fails.
    pub fn timeout(&self) -> Duration {
        self.options.connect.timeout
    }

    /// Stops refilling and gives the memnodes back the heap space this daemon holds and no
    /// longer needs: prefetched chunks, the ready sessions' chunks, and whatever departed
    /// sessions left free (merged into runs; see `FreePool::drain_all`). Call it after the
    /// workers and front ends stopped: a session still attached keeps its space.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.refill_wanted.1.notify_all();
        drop(self.building.lock()); // a session being built is queued by now
        while let Some(session) = self.ready.pop() {
            drop(session); // its allocators hand their chunks to the table's pool
        }
        for (_, m) in self.memnodes.iter() {
            m.chunks.stop();
            let drained = m.table.give_back_free_memory();
            tracing::info!(
                memnode = %m.label,
                given_back_bytes = drained.given_bytes,
                lost_bytes = drained.lost_bytes,
                "gave free heap space back"
            );
        }
    }
}

fn refill(weak: std::sync::Weak<Cluster>) {
    loop {
        let Some(cluster) = weak.upgrade() else { return };
        if cluster.stopping.load(Ordering::Acquire) {
            return;
        }
        while cluster.ready.len() < cluster.options.ready_sessions {
            let _building = cluster.building.lock();
            if cluster.stopping.load(Ordering::Acquire) {
                return;
            }
            if cluster.ready.push(cluster.build_session()).is_err() {
                break;
            }
        }
        let (lock, cv) = &cluster.refill_wanted;
        let mut guard = lock.lock();
        cv.wait_for(&mut guard, Duration::from_millis(200));
    }
}

/// A worker's session; goes back to the ready queue when dropped (if there is room).
pub struct Attached {
    session: Option<Session<WorkerShards>>,
    cluster: Arc<Cluster>,
}

impl std::ops::Deref for Attached {
    type Target = Session<WorkerShards>;
    fn deref(&self) -> &Self::Target {
        self.session.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for Attached {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.session.as_mut().expect("present until drop")
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Some(mut session) = self.session.take() {
            // Leaving workers give up dedicated connections; the next one earns its own.
            session.shards_mut().downgrade();
            // Publish item-count changes the session still holds (one FAA, only if any),
            // so DBSIZE does not wait for this session's next user.
            if let Err(e) = session.flush() {
                tracing::debug!("flushing a returning session's item count failed: {e}");
            }
            let _ = self.cluster.ready.push(session);
        }
    }
}

/// A session's memnodes: one table client per memnode, over virtual connections.
pub struct WorkerShards {
    cluster: Arc<Cluster>,
    clients: Vec<TableClient>,
    vconns: Vec<Arc<VirtualConnection>>,
    routing: SessionRouting,
}

impl WorkerShards {
    /// Builds this session's virtual connection and table client for every memnode up to
    /// `count` it has none for yet (at the start, and for memnodes a map added since).
    fn connect_up_to(&mut self, count: usize) {
        let cluster = Arc::clone(&self.cluster);
        for shard in self.clients.len()..count {
            let m = &cluster.memnodes[shard];
            let vc = VirtualConnection::new(&m.pool, cluster.options.upgrade, &cluster.upgrader);
            let client = m.table.client(self.routing.connection(Arc::clone(&vc) as Arc<dyn Connection>));
            self.vconns.push(vc);
            self.clients.push(client);
        }
    }

    fn downgrade(&mut self) {
        self.vconns.iter().for_each(|vc| vc.downgrade());
    }

    /// How many of this session's virtual connections run on dedicated connections.
    pub fn dedicated(&self) -> usize {
        self.vconns.iter().filter(|vc| vc.is_dedicated()).count()
    }
}

impl Shards for WorkerShards {
    fn route(&self, key: &[u8]) -> usize {
        self.routing.route(&self.cluster.router, key)
    }

    fn backups(&self, key: &[u8]) -> &[u16] {
        self.routing.backups(key)
    }

    fn locks_writes(&self, key: &[u8]) -> bool {
        self.routing.locks_writes(key)
    }

    fn snapshot_writes(&self) -> bool {
        self.routing.snapshot_writes()
    }

    fn item_share(&self, shard: usize) -> (u64, u64) {
        self.routing.item_share(shard)
    }

    fn serves(&self, shard: usize) -> bool {
        self.routing.serves(shard)
    }

    fn refresh_routing(&mut self) {
        self.routing.refresh(&self.cluster.router);
    }

    fn map_unconfirmed(&self) -> Option<(Duration, Duration)> {
        let lapsed = self.cluster.router.unconfirmed();
        if lapsed.is_some() {
            METRICS.map_lease_refusals.inc();
        }
        lapsed
    }

    fn map_changed(&self) -> Option<racekv_client::map_fence::MapChange> {
        self.routing.changed()
    }

    fn await_map(&mut self, epoch: u64) -> bool {
        self.routing.await_map(&self.cluster.router, epoch, self.cluster.options.connect.timeout)
    }

    fn count(&self) -> usize {
        self.cluster.memnodes.count()
    }

    fn label(&self, shard: usize) -> &str {
        &self.cluster.memnodes[shard].label
    }

    fn node_id(&self, shard: usize) -> u64 {
        self.cluster.memnodes[shard].node_id
    }

    fn timeout(&self) -> Duration {
        self.cluster.options.connect.timeout
    }

    fn client(&mut self, shard: usize) -> Result<&mut TableClient, ClientError> {
        if shard >= self.clients.len() {
            self.connect_up_to(shard + 1);
        }
        Ok(&mut self.clients[shard])
    }

    fn clients(&mut self, shards: &[usize]) -> Result<Vec<&mut TableClient>, ClientError> {
        if let Some(&last) = shards.iter().max() {
            self.client(last)?;
        }
        Ok(racekv_client::session::pick_mut(&mut self.clients, shards))
    }
}

/// Connects to the memnode at `text`: its connection pool, metadata, prefetched chunks and
/// table (the expensive setup, once per memnode).
fn open_memnode(text: &str, options: &ClusterOptions, upgrader: &Upgrader) -> Result<Memnode, ClientError> {
    let endpoint: Endpoint = text.parse().map_err(ClientError::Config)?;
    let label = endpoint.to_string();
    let unavailable = |e: String| ClientError::Unavailable { endpoint: label.clone(), reason: e };
    let pool = Pool::connect(endpoint, options.connect.clone(), options.connections_per_memnode)
        .map_err(|e| unavailable(e.to_string()))?;
    // The daemon's own metadata and chunk traffic rides the pool like everyone's.
    let control: Arc<dyn Connection> =
        VirtualConnection::new(&pool, UpgradePolicy { ops_per_sec: 0, window_ops: 1 }, upgrader);
    let meta = racekv_hashing::rpc::metadata(&*control)
        .map_err(|e| ClientError::from_table(&label, e, options.connect.timeout))?;
    pool.expect_node_id(meta.node_id);
    let chunks = PrefetchingChunks::start(Arc::clone(&control), options.prefetch_chunks, meta.layout.chunk_bytes)
        .map_err(|e| unavailable(e.to_string()))?;
    let table = Table::open_with(&*control, meta.layout, chunks.clone(), options.table)
        .map_err(|e| ClientError::from_table(&label, e, options.connect.timeout))?;
    Ok(Memnode { label, node_id: meta.node_id, layout: meta.layout, pool, table, chunks })
}
