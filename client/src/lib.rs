//! The racekv get/put library.
//!
//! A [`Client`] reaches one or more memnodes, spreads keys over them by consistent hashing
//! of their node ids, and runs each operation as a few one-sided round trips on the RACE
//! table of the memnode that owns the key. It is cheap to clone and safe to share between
//! threads; each thread borrows a pooled table session per operation.
//!
//! This is the *embedded* mode: the process is its own compute worker, with its own
//! connections. (Attaching to a local computenode daemon, and a remote mode, come with the
//! compute tier.)
//!
//! ```no_run
//! # fn main() -> Result<(), racekv_client::ClientError> {
//! let client = racekv_client::Client::builder()
//!     .memnode("tcp:127.0.0.1:7400")
//!     .token("racekv-dev-token")
//!     .connect()?;
//! client.put(b"greeting", b"hello")?;
//! assert_eq!(client.get(b"greeting")?.as_deref(), Some(&b"hello"[..]));
//! assert!(client.delete(b"greeting")?);
//! # Ok(()) }
//! ```

mod error;
pub mod ring;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use racekv_hashing::rpc::{self, method};
use racekv_hashing::{PutMode, PutOutcome, Table, TableClient, TableOptions, TableStats};
use racekv_transport::{ConnectOptions, Connection, Endpoint};

pub use error::ClientError;
pub use racekv_hashing::MAX_KV_BYTES;
use ring::Ring;

/// Settings for [`Client`]; start from [`Client::builder`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    memnodes: Vec<String>,
    token: String,
    timeout: Duration,
    connections_per_memnode: usize,
    grace_period: Duration,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            memnodes: Vec::new(),
            token: "racekv-dev-token".into(),
            timeout: Duration::from_secs(5),
            connections_per_memnode: 4,
            grace_period: TableOptions::default().grace_period,
        }
    }
}

impl ClientBuilder {
    /// Adds a memnode endpoint: `shm:/path/to.sock`, `tcp:host:port` or `verbs:host:port`.
    pub fn memnode(mut self, endpoint: impl Into<String>) -> Self {
        self.memnodes.push(endpoint.into());
        self
    }

    /// Adds several memnode endpoints.
    pub fn memnodes<I: IntoIterator<Item = S>, S: Into<String>>(mut self, endpoints: I) -> Self {
        self.memnodes.extend(endpoints.into_iter().map(Into::into));
        self
    }

    /// The memnodes' shared secret.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = token.into();
        self
    }

    /// Longest wait for connecting and for any one operation.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connections opened to each memnode (operations are spread over them).
    pub fn connections_per_memnode(mut self, n: usize) -> Self {
        self.connections_per_memnode = n.max(1);
        self
    }

    /// How long freed KV blocks wait before reuse (see `racekv_hashing::alloc`).
    pub fn grace_period(mut self, grace: Duration) -> Self {
        self.grace_period = grace;
        self
    }

    /// Connects to every memnode and loads their directories.
    pub fn connect(self) -> Result<Client, ClientError> {
        if self.memnodes.is_empty() {
            return Err(ClientError::Config("no memnode endpoints given".into()));
        }
        let table_options = TableOptions { grace_period: self.grace_period, op_timeout: self.timeout };
        let connect = ConnectOptions { token: self.token.clone(), timeout: self.timeout };
        let mut shards = Vec::with_capacity(self.memnodes.len());
        for text in &self.memnodes {
            let endpoint: Endpoint = text.parse().map_err(ClientError::Config)?;
            shards.push(Shard::connect(endpoint, connect.clone(), table_options, self.connections_per_memnode)?);
        }
        let ids: Vec<u64> = shards.iter().map(|s| s.node_id).collect();
        for (i, id) in ids.iter().enumerate() {
            if ids[..i].contains(id) {
                return Err(ClientError::Config(format!(
                    "{} and another endpoint are the same memnode (node id {id}); list each memnode once",
                    shards[i].label
                )));
            }
        }
        Ok(Client { inner: Arc::new(Inner { ring: Ring::new(&ids), shards, timeout: self.timeout }) })
    }
}

/// The live state of one memnode: its table and connections; replaced on reconnect.
struct Live {
    table: Table,
    conns: Vec<Arc<dyn Connection>>,
    generation: u64,
}

struct Shard {
    endpoint: Endpoint,
    label: String,
    node_id: u64,
    connect: ConnectOptions,
    table_options: TableOptions,
    connections: usize,
    live: RwLock<Live>,
    idle: Mutex<Vec<(u64, TableClient)>>,
    next_conn: AtomicUsize,
    last_reconnect: Mutex<Option<Instant>>,
}

/// Reconnect attempts to one memnode are at least this far apart.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(100);

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
    let chunks = Arc::new(racekv_hashing::table::RpcChunkSource::new(Arc::clone(&conns[0])));
    let table = Table::open_with(&*conns[0], meta.layout, chunks, table_options)
        .map_err(|e| ClientError::from_table(label, e, connect.timeout))?;
    Ok((Live { table, conns, generation }, meta.node_id))
}

impl Shard {
    fn connect(
        endpoint: Endpoint,
        connect: ConnectOptions,
        table_options: TableOptions,
        connections: usize,
    ) -> Result<Self, ClientError> {
        let label = endpoint.to_string();
        let (live, node_id) = open_live(&endpoint, &label, &connect, table_options, connections, 0)?;
        Ok(Self {
            endpoint,
            label,
            node_id,
            connect,
            table_options,
            connections,
            live: RwLock::new(live),
            idle: Mutex::new(Vec::new()),
            next_conn: AtomicUsize::new(0),
            last_reconnect: Mutex::new(None),
        })
    }

    fn session(&self) -> Result<(u64, TableClient), ClientError> {
        if let Some(session) = self.idle.lock().pop() {
            return Ok(session);
        }
        let live = self.live.read();
        let conn = &live.conns[self.next_conn.fetch_add(1, Ordering::Relaxed) % live.conns.len()];
        Ok((live.generation, live.table.client(Arc::clone(conn))))
    }

    /// Runs `op` on a pooled session; after a connection failure, reconnects (so the next
    /// call can succeed) and reports the failure.
    fn run<R>(&self, op: impl FnOnce(&mut TableClient) -> Result<R, racekv_hashing::Error>) -> Result<R, ClientError> {
        let (generation, mut session) = self.session()?;
        match op(&mut session) {
            Ok(r) => {
                if generation == self.live.read().generation {
                    self.idle.lock().push((generation, session));
                }
                Ok(r)
            }
            Err(e) => {
                let transient = e.is_transient();
                let err = ClientError::from_table(&self.label, e, self.connect.timeout);
                drop(session);
                if transient {
                    self.reconnect(generation);
                }
                Err(err)
            }
        }
    }

    fn reconnect(&self, failed_generation: u64) {
        {
            let mut last = self.last_reconnect.lock();
            if last.is_some_and(|t| t.elapsed() < RECONNECT_BACKOFF) || self.live.read().generation != failed_generation
            {
                return;
            }
            *last = Some(Instant::now());
        }
        match open_live(
            &self.endpoint,
            &self.label,
            &self.connect,
            self.table_options,
            self.connections,
            failed_generation + 1,
        ) {
            Ok((live, node_id)) if node_id == self.node_id => {
                *self.live.write() = live;
                self.idle.lock().clear();
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

struct Inner {
    shards: Vec<Shard>,
    ring: Ring,
    timeout: Duration,
}

/// A handle on a racekv cluster; clone it freely.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    fn shard(&self, key: &[u8]) -> &Shard {
        &self.inner.shards[self.inner.ring.shard(key)]
    }

    /// The value of `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.shard(key).run(|c| c.get(key))
    }

    /// Sets `key` to `value`, replacing any previous value.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.shard(key).run(|c| c.put(key, value)).map(|_| ())
    }

    /// Sets `key` to `value` only if it has no value; returns whether it did.
    pub fn insert(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        self.shard(key).run(|c| c.put_with(key, value, PutMode::InsertOnly)).map(|o| o == PutOutcome::Inserted)
    }

    /// Replaces the value of `key` only if it has one; returns whether it did.
    pub fn update(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        self.shard(key).run(|c| c.put_with(key, value, PutMode::UpdateOnly)).map(|o| o == PutOutcome::Updated)
    }

    /// Removes `key`; returns whether it had a value.
    pub fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.shard(key).run(|c| c.delete(key))
    }

    /// Atomically sets `key` to `new` (None removes it) if its value is `expected` (None:
    /// absent). Returns whether it did.
    pub fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        self.shard(key).run(|c| c.compare_and_swap(key, expected, new))
    }

    /// Values of many keys; the lookups to each memnode travel in batches.
    pub fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        let mut out = vec![None; keys.len()];
        for (shard, indices) in self.group(keys.iter().copied()) {
            let subset: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
            let values = self.inner.shards[shard].run(|c| c.get_many(&subset))?;
            for (i, v) in indices.into_iter().zip(values) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// Sets many keys. Each memnode's share runs on one session; it is not atomic across
    /// keys (a failure leaves the earlier keys set).
    pub fn multi_put(&self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        for (shard, indices) in self.group(pairs.iter().map(|(k, _)| *k)) {
            self.inner.shards[shard].run(|c| {
                for &i in &indices {
                    c.put(pairs[i].0, pairs[i].1)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    fn group<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let shard = self.inner.ring.shard(key);
            match groups.iter_mut().find(|(s, _)| *s == shard) {
                Some((_, v)) => v.push(i),
                None => groups.push((shard, vec![i])),
            }
        }
        groups
    }

    /// Each memnode's endpoint and table statistics (an RPC to each). Item-count changes
    /// that idle sessions still hold are sent first, so a quiescent client counts exactly.
    pub fn stats(&self) -> Vec<(String, Result<TableStats, ClientError>)> {
        self.inner
            .shards
            .iter()
            .map(|s| {
                for (_, session) in s.idle.lock().iter_mut() {
                    if let Err(e) = session.flush() {
                        tracing::warn!(memnode = %s.label, "flushing an item count failed: {e}");
                    }
                }
                let conn = Arc::clone(&s.live.read().conns[0]);
                let stats = conn
                    .call(method::STATS, &[])
                    .map_err(|e| ClientError::from_table(&s.label, rpc::map_error(e), self.inner.timeout))
                    .and_then(|bytes| {
                        racekv_hashing::service::decode_stats(&bytes).ok_or_else(|| ClientError::Internal {
                            endpoint: s.label.clone(),
                            reason: "unreadable stats".into(),
                        })
                    });
                (s.label.clone(), stats)
            })
            .collect()
    }

    /// Endpoints of the memnodes, in ring order.
    pub fn memnodes(&self) -> Vec<String> {
        self.inner.shards.iter().map(|s| s.label.clone()).collect()
    }

    /// Number of keys on all memnodes (their item counters; they trail operations in flight).
    pub fn len(&self) -> Result<u64, ClientError> {
        self.stats().into_iter().map(|(_, s)| s.map(|s| s.items)).sum()
    }

    /// Whether [`Client::len`] is zero.
    pub fn is_empty(&self) -> Result<bool, ClientError> {
        self.len().map(|n| n == 0)
    }
}
