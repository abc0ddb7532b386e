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

mod embedded;
mod error;
pub mod op;
pub mod ring;
pub mod session;

use std::sync::Arc;
use std::time::Duration;

use racekv_hashing::{PutMode, TableOptions, TableStats};
use racekv_transport::ConnectOptions;

pub use error::ClientError;
pub use racekv_hashing::MAX_KV_BYTES;
pub use session::{Session, Shards};

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

    /// Connects to every memnode and loads their directories (embedded mode).
    pub fn connect(self) -> Result<Client, ClientError> {
        let table_options = TableOptions { grace_period: self.grace_period, op_timeout: self.timeout };
        let connect = ConnectOptions { token: self.token.clone(), timeout: self.timeout };
        let cluster = embedded::Cluster::connect(&self.memnodes, connect, table_options, self.connections_per_memnode)?;
        Ok(Client { cluster })
    }
}

/// A handle on a racekv cluster; clone it freely.
#[derive(Clone)]
pub struct Client {
    cluster: Arc<embedded::Cluster>,
}

impl Client {
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The value of `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.cluster.with(|s| s.get(key))
    }

    /// Sets `key` to `value`, replacing any previous value.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.cluster.with(|s| s.put(key, value))
    }

    /// Sets `key` to `value` only if it has no value; returns whether it did.
    pub fn insert(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        self.cluster.with(|s| s.put_with(key, value, PutMode::InsertOnly))
    }

    /// Replaces the value of `key` only if it has one; returns whether it did.
    pub fn update(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        self.cluster.with(|s| s.put_with(key, value, PutMode::UpdateOnly))
    }

    /// Removes `key`; returns whether it had a value.
    pub fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.cluster.with(|s| s.delete(key))
    }

    /// Atomically sets `key` to `new` (None removes it) if its value is `expected` (None:
    /// absent). Returns whether it did.
    pub fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        self.cluster.with(|s| s.compare_and_swap(key, expected, new))
    }

    /// Values of many keys; the lookups to each memnode travel in batches.
    pub fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        self.cluster.with(|s| s.multi_get(keys))
    }

    /// Sets many keys. Not atomic across keys (a failure leaves the earlier keys set).
    pub fn multi_put(&self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        self.cluster.with(|s| s.multi_put(pairs))
    }

    /// Each memnode's endpoint and table statistics (an RPC to each). Item-count changes
    /// that idle sessions still hold are sent first, so a quiescent client counts exactly.
    pub fn stats(&self) -> Vec<(String, Result<TableStats, ClientError>)> {
        self.cluster.flush_idle();
        self.cluster.with(|s| s.stats())
    }

    /// Endpoints of the memnodes.
    pub fn memnodes(&self) -> Vec<String> {
        self.cluster.labels()
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
