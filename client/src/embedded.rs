//! Embedded mode: this process is its own compute worker, with its own connections to every
//! memnode. Sessions (one table client per memnode each) are pooled and lent per call.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use racekv_hashing::rpc;
use racekv_hashing::{Table, TableClient, TableOptions};
use racekv_transport::{ConnectOptions, Connection, Endpoint};

use crate::attach::lending::LentMemnode;
use crate::error::ClientError;
use crate::map_fence::MapChange;
use crate::map_follower::{MapFollower, MapSource};
use crate::map_routing::{Router, SessionRouting};
use crate::session::{Session, Shards};

/// Reconnect attempts to one memnode are at least this far apart.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(100);

/// The live state of one memnode: its table and connections; replaced on reconnect.
struct Live {
    table: Table,
    conns: Vec<Arc<dyn Connection>>,
    generation: u64,
}

/// Where a memnode's connections come from, and so how they are replaced.
enum Source {
    /// Dialed by this process: dialed again after a failure.
    Dial { endpoint: Endpoint, connect: ConnectOptions, connections: usize },
    /// Lent by the computenode this process is attached to: after a failure the client
    /// stops using lent connections (`failed`) and goes back through the daemon.
    Lent { failed: Arc<AtomicBool> },
}

pub(crate) struct Memnode {
    source: Source,
    label: String,
    node_id: u64,
    table_options: TableOptions,
    live: RwLock<Live>,
    next_conn: AtomicUsize,
    last_reconnect: Mutex<Option<Instant>>,
}

fn open_live(
    endpoint: &Endpoint,
    label: &str,
    connect: &ConnectOptions,
    table_options: TableOptions,
    n: usize,
    generation: u64,
) -> Result<(Live, u64), ClientError> {
    let unavailable = |reason: String| ClientError::Unavailable { endpoint: label.to_string(), reason };
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(racekv_transport::connect(endpoint, connect).map_err(|e| unavailable(e.to_string()))?);
    }
    let meta = rpc::metadata(&*conns[0]).map_err(|e| ClientError::from_table(label, e, connect.timeout))?;
    let table = open_table(&conns[0], meta.layout, label, table_options)?;
    Ok((Live { table, conns, generation }, meta.node_id))
}

/// The memnode's table over `conn`, whose RPCs also hand out its chunks.
fn open_table(
    conn: &Arc<dyn Connection>,
    layout: racekv_hashing::Layout,
    label: &str,
    table_options: TableOptions,
) -> Result<Table, ClientError> {
    let chunks = Arc::new(racekv_hashing::table::RpcChunkSource::new(Arc::clone(conn)));
    Table::open_with(&**conn, layout, chunks, table_options)
        .map_err(|e| ClientError::from_table(label, e, table_options.op_timeout))
}

impl Memnode {
    fn connect(
        endpoint: Endpoint,
        connect: ConnectOptions,
        table_options: TableOptions,
        connections: usize,
    ) -> Result<Self, ClientError> {
        let label = endpoint.to_string();
        let (live, node_id) = open_live(&endpoint, &label, &connect, table_options, connections, 0)?;
        Ok(Self {
            source: Source::Dial { endpoint, connect, connections },
            label,
            node_id,
            table_options,
            live: RwLock::new(live),
            next_conn: AtomicUsize::new(0),
            last_reconnect: Mutex::new(None),
        })
    }

    fn table_client(&self, routing: &SessionRouting) -> (u64, TableClient) {
        let live = self.live.read();
        let conn = &live.conns[self.next_conn.fetch_add(1, Ordering::Relaxed) % live.conns.len()];
        (live.generation, live.table.client(routing.connection(Arc::clone(conn))))
    }

    fn generation(&self) -> u64 {
        self.live.read().generation
    }

    /// A memnode on a connection the attached computenode lent; `failed` is raised when it
    /// fails.
    fn lent(lent: LentMemnode, table_options: TableOptions, failed: Arc<AtomicBool>) -> Result<Self, ClientError> {
        let label = lent.conn.endpoint().to_string();
        let unavailable = |reason: String| ClientError::Unavailable { endpoint: label.clone(), reason };
        let conn: Arc<dyn Connection> =
            Arc::new(lent.conn.into_connection(table_options.op_timeout).map_err(|e| unavailable(e.to_string()))?);
        let table = open_table(&conn, lent.layout, &label, table_options)?;
        Ok(Self {
            source: Source::Lent { failed },
            node_id: lent.node_id,
            table_options,
            live: RwLock::new(Live { table, conns: vec![conn], generation: 0 }),
            next_conn: AtomicUsize::new(0),
            last_reconnect: Mutex::new(None),
            label,
        })
    }

    fn reconnect(&self, failed_generation: u64) {
        let (endpoint, connect, connections) = match &self.source {
            Source::Dial { endpoint, connect, connections } => (endpoint, connect, *connections),
            Source::Lent { failed } => {
                if !failed.swap(true, Ordering::AcqRel) {
                    tracing::warn!(memnode = %self.label, "a lent connection failed: back to the computenode's ring");
                }
                return;
            }
        };
        {
            let mut last = self.last_reconnect.lock();
            if last.is_some_and(|t| t.elapsed() < RECONNECT_BACKOFF) || self.generation() != failed_generation {
                return;
            }
            *last = Some(Instant::now());
        }
        match open_live(endpoint, &self.label, connect, self.table_options, connections, failed_generation + 1) {
            Ok((live, node_id)) if node_id == self.node_id => {
                *self.live.write() = live;
                tracing::info!(memnode = %self.label, "reconnected");
            }
            Ok((_, node_id)) => tracing::error!(
                memnode = %self.label,
                "the memnode now has node id {node_id}, not {}: it holds a different table; refusing to mix them",
                self.node_id
            ),
            Err(e) => tracing::warn!(memnode = %self.label, "reconnect failed: {e}"),
        }
    }
}

/// All memnodes of an embedded client. Sessions share it.
pub(crate) struct Core {
    /// Append-only: a cluster map may add memnodes (the follower's thread connects them);
    /// shard `i` is `memnodes[i]` for good.
    memnodes: Arc<boxcar::Vec<Memnode>>,
    router: Arc<Router>,
    timeout: Duration,
    /// Installs newer cluster maps into `router` (with etcd); stops with the last session.
    _follower: Option<MapFollower>,
}

/// The memnodes and the idle sessions. Sessions hold the [`Core`], not this, so the last
/// `Client` to go drops the idle sessions (they send their pending item counts as they go).
pub(crate) struct Cluster {
    core: Arc<Core>,
    idle: Mutex<Vec<Session<EmbeddedShards>>>,
}

impl Cluster {
    /// Connects to the memnodes `endpoints` names, or (with `map`) to those of the cluster
    /// map, routing by it and following it.
    pub(crate) fn connect(
        endpoints: &[String],
        map: Option<MapSource>,
        connect: ConnectOptions,
        table_options: TableOptions,
        connections: usize,
    ) -> Result<Arc<Self>, ClientError> {
        let memnodes = Arc::new(boxcar::Vec::with_capacity(endpoints.len()));
        // With a map: the node id it gives each memnode connected, in its order.
        let mut mapped = Vec::new();
        let dial = |text: &str| -> Result<Memnode, ClientError> {
            let endpoint: Endpoint = text.parse().map_err(ClientError::Config)?;
            Memnode::connect(endpoint, connect.clone(), table_options, connections)
        };
        match &map {
            None if endpoints.is_empty() => return Err(ClientError::Config("no memnode endpoints given".into())),
            None => {
                for text in endpoints {
                    memnodes.push(dial(text)?);
                }
            }
            Some(map) => {
                let listed;
                (listed, mapped) = crate::map_follower::connect_listed(
                    &map.endpoints()?,
                    &map.node_ids(),
                    &map.replica_sets(),
                    dial,
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
                return Err(ClientError::Config(format!(
                    "{} and another endpoint are the same memnode (node id {id}); list each memnode once",
                    memnodes[i].label
                )));
            }
        }
        let (router, follower) = match map {
            None => (Arc::new(Router::ring(&ids)), None),
            Some(map) => {
                let router = Router::map(
                    map.map().epoch,
                    map.map().replicas,
                    map.map().snapshot_writes,
                    &map.replica_sets(),
                    &ids,
                    &mapped,
                    |i| memnodes[i].label.clone(),
                );
                let router = Arc::new(router.map_err(ClientError::Config)?);
                let (added, connect) = (Arc::clone(&memnodes), connect.clone());
                let add = move |router: &Router, info: &racekv_coord::MemnodeInfo| {
                    let endpoint: Endpoint =
                        crate::map_follower::choose_endpoint(info).map_err(|e| e.to_string())?.parse()?;
                    let memnode = Memnode::connect(endpoint, connect.clone(), table_options, connections)
                        .map_err(|e| e.to_string())?;
                    if memnode.node_id != info.node_id {
                        return Err(format!(
                            "{} has node id {:#x}, the map says {:#x}",
                            memnode.label, memnode.node_id, info.node_id
                        ));
                    }
                    // Only this (the follower's) thread appends, so both get the same index.
                    let shard = added.push(memnode);
                    assert_eq!(router.add_memnode(info.node_id)?, shard, "a memnode's shard is its index in both");
                    Ok(())
                };
                let follower = map.follow(Arc::downgrade(&router), add, |_| {})?;
                (router, Some(follower))
            }
        };
        Ok(Self::assemble(Core { router, memnodes, timeout: connect.timeout, _follower: follower }))
    }

    fn assemble(core: Core) -> Arc<Self> {
        Arc::new(Self { core: Arc::new(core), idle: Mutex::new(Vec::new()) })
    }

    /// An embedded cluster over the connections the attached computenode lent (routed by
    /// the ring of their node ids, as the computenode routes); a failure raises `failed`.
    pub(crate) fn from_lent(
        lent: Vec<LentMemnode>,
        table_options: TableOptions,
        failed: Arc<AtomicBool>,
    ) -> Result<Arc<Self>, ClientError> {
        if lent.is_empty() {
            return Err(ClientError::Protocol("the computenode lent no memnode".into()));
        }
        let memnodes = Arc::new(boxcar::Vec::with_capacity(lent.len()));
        for memnode in lent {
            memnodes.push(Memnode::lent(memnode, table_options, Arc::clone(&failed))?);
        }
        let ids: Vec<u64> = memnodes.iter().map(|(_, m)| m.node_id).collect();
        let router = Arc::new(Router::ring(&ids));
        Ok(Self::assemble(Core { router, memnodes, timeout: table_options.op_timeout, _follower: None }))
    }

    /// Runs `f` on a pooled session.
    pub(crate) fn with<R>(self: &Arc<Self>, f: impl FnOnce(&mut Session<EmbeddedShards>) -> R) -> R {
        let mut session = self.idle.lock().pop().unwrap_or_else(|| {
            Session::new(EmbeddedShards {
                core: Arc::clone(&self.core),
                parts: (0..self.core.memnodes.count()).map(|_| None).collect(),
                routing: self.core.router.session(),
            })
        });
        let result = f(&mut session);
        self.idle.lock().push(session);
        result
    }

    /// Sends the pending item counts idle sessions hold (so a quiescent client counts exactly).
    pub(crate) fn flush_idle(&self) {
        for session in self.idle.lock().iter_mut() {
            if let Err(e) = session.flush() {
                tracing::warn!("flushing an item count failed: {e}");
            }
        }
    }

    pub(crate) fn labels(&self) -> Vec<String> {
        self.core.memnodes.iter().map(|(_, m)| m.label.clone()).collect()
    }
}

/// A session's view of the embedded cluster: its own table client per memnode, rebuilt
/// after the memnode's connections were replaced.
pub(crate) struct EmbeddedShards {
    core: Arc<Core>,
    parts: Vec<Option<(u64, TableClient)>>,
    routing: SessionRouting,
}

impl Shards for EmbeddedShards {
    fn route(&self, key: &[u8]) -> usize {
        self.routing.route(&self.core.router, key)
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
        self.routing.refresh(&self.core.router);
    }

    fn map_unconfirmed(&self) -> Option<(Duration, Duration)> {
        self.core.router.unconfirmed()
    }

    fn map_changed(&self) -> Option<MapChange> {
        self.routing.changed()
    }

    fn await_map(&mut self, epoch: u64) -> bool {
        self.routing.await_map(&self.core.router, epoch, self.core.timeout)
    }

    fn count(&self) -> usize {
        self.core.memnodes.count()
    }

    fn label(&self, shard: usize) -> &str {
        &self.core.memnodes[shard].label
    }

    fn node_id(&self, shard: usize) -> u64 {
        self.core.memnodes[shard].node_id
    }

    fn timeout(&self) -> Duration {
        self.core.timeout
    }

    fn client(&mut self, shard: usize) -> Result<&mut TableClient, ClientError> {
        let memnode = &self.core.memnodes[shard];
        if shard >= self.parts.len() {
            self.parts.resize_with(shard + 1, || None); // a memnode a newer map added
        }
        let current = memnode.generation();
        if self.parts[shard].as_ref().is_none_or(|(generation, _)| *generation != current) {
            self.parts[shard] = Some(memnode.table_client(&self.routing));
        }
        Ok(&mut self.parts[shard].as_mut().expect("just set").1)
    }

    fn clients(&mut self, shards: &[usize]) -> Result<Vec<&mut TableClient>, ClientError> {
        for &shard in shards {
            self.client(shard)?;
        }
        let parts = crate::session::pick_mut(&mut self.parts, shards);
        Ok(parts.into_iter().map(|part| &mut part.as_mut().expect("opened above").1).collect())
    }

    fn on_transient_failure(&mut self, shard: usize) {
        if let Some((generation, _)) = self.parts.get_mut(shard).and_then(Option::take) {
            self.core.memnodes[shard].reconnect(generation);
        }
    }
}
