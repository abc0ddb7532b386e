//! The racekv get/put library.
//!
//! A [`Client`] runs get/put/delete (and the rest) on racekv's RACE tables, in one of two
//! modes, with the same methods and the same typed errors ([`ClientError`]) in both:
//!
//! * **Attached** (the default): the process hands its operations to the local computenode
//!   daemon through a shared-memory ring ([`attach`]); the daemon's workers run them over
//!   connections it set up in advance, so a process gets going in microseconds and holds no
//!   memnode connections of its own. [`ClientBuilder::connect`] with no memnodes attaches to
//!   the daemon's [`default_attach_socket`]; [`ClientBuilder::attach`] names another socket.
//! * **Embedded**: the process is its own compute worker, with its own connections to every
//!   memnode ([`ClientBuilder::memnode`]). Keys are spread over the memnodes by consistent
//!   hashing of their node ids, and each operation is a few one-sided round trips on the
//!   table of the memnode that owns the key.
//!
//! A client is cheap to clone and safe to share between threads; in attached mode many
//! threads' requests are in flight on the ring at once.
//!
//! Limits are the table's in every mode: keys up to [`op::MAX_KEY_BYTES`], values up to
//! [`op::MAX_VALUE_BYTES`] (512 MiB); more is [`ClientError::TooLarge`]. Attached and
//! remote clients send a request larger than a ring slot or an RPC in parts, and fetch a
//! reply that large in parts (see [`op`]).
//!
//! Attached mode, to the computenode `racekv up` started on this host:
//!
//! ```no_run
//! # fn main() -> Result<(), racekv_client::ClientError> {
//! let client = racekv_client::Client::builder().connect()?; // $XDG_RUNTIME_DIR/racekv/computenode.sock
//! client.put(b"greeting", b"hello")?;
//! assert_eq!(client.get(b"greeting")?.as_deref(), Some(&b"hello"[..]));
//! # Ok(()) }
//! ```
//!
//! Attached mode, to a daemon's socket named explicitly:
//!
//! ```no_run
//! # fn main() -> Result<(), racekv_client::ClientError> {
//! use std::time::Duration;
//! let client = racekv_client::Client::builder()
//!     .attach("/run/racekv/computenode.sock")
//!     .timeout(Duration::from_millis(500))
//!     .connect()?;
//! assert_eq!(client.mode(), racekv_client::Mode::Attached);
//! let values = client.multi_get(&[b"a", b"b"])?;
//! # Ok(()) }
//! ```
//!
//! Embedded mode, straight to the memnodes:
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

#![forbid(unsafe_code)]

pub mod attach;
mod attached;
mod catchup;
mod channel;
mod embedded;
mod error;
pub mod expiry;
mod in_order;
pub mod map_fence;
pub mod map_follower;
pub mod map_routing;
mod moves;
pub mod op;
mod optimistic;
mod parts;
pub mod placement;
mod remote;
mod replicated;
mod resolve;
pub mod ring;
mod seed;
pub mod session;
mod snapshot;
mod snapshot_write;
pub mod txn;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use racekv_hashing::{ScanLimits, TableOptions, TableStats};
use racekv_transport::ConnectOptions;

pub use catchup::{CatchUp, CatchUpSource};
pub use error::ClientError;
pub use expiry::{ExpireCondition, ExpiryChange, Ttl};
pub use moves::Purged;
pub use racekv_hashing::{Expiry, Item, PutMode, PutOptions, PutOutcome, PutResult, MAX_KV_BYTES};
pub use session::{Session, Shards};

/// Settings for [`Client`]; start from [`Client::builder`].
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    remote: Option<String>,
    memnodes: Vec<String>,
    /// etcd endpoints and cluster name: embedded mode over the cluster map's memnodes.
    etcd: Option<(Vec<String>, String)>,
    map_lease: Duration,
    token: String,
    timeout: Duration,
    connections_per_memnode: usize,
    grace_period: Duration,
    attach: Option<PathBuf>,
    attach_spin: Duration,
    tls_ca: Option<PathBuf>,
    tls_client_cert: Option<(PathBuf, PathBuf)>,
    tls_server_name: Option<String>,
    user: Option<String>,
    password: Option<String>,
    borrow: bool,
}

/// Where a computenode daemon listens for attaching processes unless told otherwise:
/// `$XDG_RUNTIME_DIR/racekv/computenode.sock`, or `/tmp/racekv-$UID/computenode.sock` when
/// `XDG_RUNTIME_DIR` is unset (or not an absolute path).
pub fn default_attach_socket() -> PathBuf {
    default_attach_socket_for(std::env::var_os("XDG_RUNTIME_DIR").as_deref(), nix::unistd::geteuid().as_raw())
}

fn default_attach_socket_for(runtime_dir: Option<&std::ffi::OsStr>, uid: u32) -> PathBuf {
    match runtime_dir.map(std::path::Path::new) {
        Some(dir) if dir.is_absolute() => dir.join("racekv").join("computenode.sock"),
        _ => PathBuf::from(format!("/tmp/racekv-{uid}")).join("computenode.sock"),
    }
}

/// How a [`Client`] reaches the tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Through the local computenode daemon's shared-memory ring.
    Attached,
    /// With its own connections to the memnodes.
    Embedded,
    /// Through a computenode on another host, by RPC.
    Remote,
}

/// How long an attached client's waiting thread polls the ring before it sleeps, unless
/// [`ClientBuilder::attach_spin`] says otherwise: 50 µs on hosts with more than two CPUs,
/// else none (on one or two CPUs a spinning client takes the core the daemon needs to
/// produce its reply: on a loaded 2-CPU host a GET's median round trip was about 84 µs with
/// both sides spinning, 14-66 µs with neither).
pub fn default_attach_spin() -> Duration {
    if std::thread::available_parallelism().is_ok_and(|n| n.get() > 2) {
        Duration::from_micros(50)
    } else {
        Duration::ZERO
    }
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            remote: None,
            attach: None,
            attach_spin: default_attach_spin(),
            memnodes: Vec::new(),
            etcd: None,
            map_lease: map_follower::DEFAULT_MAP_LEASE,
            token: "racekv-dev-token".into(),
            timeout: Duration::from_secs(5),
            connections_per_memnode: 4,
            grace_period: TableOptions::default().grace_period,
            tls_ca: None,
            tls_client_cert: None,
            tls_server_name: None,
            user: None,
            password: None,
            borrow: false,
        }
    }
}

impl ClientBuilder {
    /// Attached mode through the computenode daemon listening on `socket` (instead of
    /// [`default_attach_socket`]). Not combinable with [`ClientBuilder::memnode`].
    pub fn attach(mut self, socket: impl Into<PathBuf>) -> Self {
        self.attach = Some(socket.into());
        self
    }

    /// Remote mode through the computenode at `addr` (`host:port` of its remote front end,
    /// e.g. `127.0.0.1:7410`). Not combinable with memnodes or an attach socket.
    pub fn remote(mut self, addr: impl Into<String>) -> Self {
        self.remote = Some(addr.into());
        self
    }

    /// Attached mode: how long a thread waiting for its reply polls the ring before it
    /// sleeps (lower latency for more CPU; zero sleeps at once). Default:
    /// [`default_attach_spin`].
    pub fn attach_spin(mut self, spin: Duration) -> Self {
        self.attach_spin = spin;
        self
    }

    /// Embedded mode over the memnodes of cluster `cluster`'s map in etcd at `endpoints`
    /// (`http://host:port`): keys route to their partitions' primaries, and newer maps are
    /// followed (issue 17; a build with the `etcd` feature). Waits up to the timeout for a
    /// first map. Not combinable with [`ClientBuilder::memnode`].
    pub fn etcd<I: IntoIterator<Item = S>, S: Into<String>>(
        mut self,
        endpoints: I,
        cluster: impl Into<String>,
    ) -> Self {
        self.etcd = Some((endpoints.into_iter().map(Into::into).collect(), cluster.into()));
        self
    }

    /// With [`ClientBuilder::etcd`]: operations fail (`ClientError::MapUnconfirmed`, worth
    /// a retry) while etcd has not vouched for the map for this long (zero: never), since a
    /// process cut off from etcd may miss a failover (`MapSource::with_lease`). Default
    /// [`map_follower::DEFAULT_MAP_LEASE`], under two thirds of the memnodes' default lease.
    pub fn map_lease(mut self, lease: Duration) -> Self {
        self.map_lease = lease;
        self
    }

    /// Embedded mode: adds a memnode endpoint: `shm:/path/to.sock`, `tcp:host:port` or
    /// `verbs:host:port`.
    pub fn memnode(mut self, endpoint: impl Into<String>) -> Self {
        self.memnodes.push(endpoint.into());
        self
    }

    /// Adds several memnode endpoints.
    pub fn memnodes<I: IntoIterator<Item = S>, S: Into<String>>(mut self, endpoints: I) -> Self {
        self.memnodes.extend(endpoints.into_iter().map(Into::into));
        self
    }

    /// The memnodes' shared secret (embedded mode).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = token.into();
        self
    }

    /// Attached and remote modes: the computenode's user to authenticate as (its ACL's, as
    /// on its Redis port; default `default`).
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// Attached and remote modes: the user's password (remote: proved in the handshake,
    /// never sent; attached: sent over the local socket, as Redis' AUTH). A user without a
    /// password (`nopass`) needs none, nor does a process the daemon trusts by its uid.
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Longest wait for connecting and for any one operation (attached mode: for the
    /// daemon's reply; a call without a reply in time fails with [`ClientError::Timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Embedded mode: connections opened to each memnode (operations are spread over them).
    pub fn connections_per_memnode(mut self, n: usize) -> Self {
        self.connections_per_memnode = n.max(1);
        self
    }

    /// Embedded mode: how long freed KV blocks wait before reuse (see `racekv_hashing::alloc`);
    /// a memnode's longer published grace period wins.
    pub fn grace_period(mut self, grace: Duration) -> Self {
        self.grace_period = grace;
        self
    }

    /// TLS on tcp connections (to memnodes in embedded mode, to a remote computenode): trust
    /// the CA certificates in `ca_file` (PEM). A memnode whose tcp listener has a certificate
    /// speaks only TLS. Not for attached mode (the local daemon's socket).
    pub fn tls_ca(mut self, ca_file: impl Into<PathBuf>) -> Self {
        self.tls_ca = Some(ca_file.into());
        self
    }

    /// With [`ClientBuilder::tls_ca`]: present this certificate chain and key (PEM) to
    /// servers that check client certificates.
    pub fn tls_client_cert(mut self, cert_file: impl Into<PathBuf>, key_file: impl Into<PathBuf>) -> Self {
        self.tls_client_cert = Some((cert_file.into(), key_file.into()));
        self
    }

    /// With [`ClientBuilder::tls_ca`]: the name servers' certificates must carry, instead
    /// of each endpoint's host.
    pub fn tls_server_name(mut self, name: impl Into<String>) -> Self {
        self.tls_server_name = Some(name.into());
        self
    }

    /// Token, timeout and TLS for connections to memnodes or a remote computenode.
    fn connect_options(&self) -> Result<ConnectOptions, ClientError> {
        let mut options = ConnectOptions::new(self.token.clone(), self.timeout);
        let tls_error = |e: std::io::Error| ClientError::Config(format!("TLS settings: {e}"));
        match (&self.tls_ca, &self.tls_client_cert, &self.tls_server_name) {
            (None, None, None) => {}
            (None, _, _) => {
                return Err(ClientError::Config("a TLS client certificate or server name needs tls_ca".into()))
            }
            (Some(ca), cert, name) => {
                let mut tls = racekv_transport::ClientTls::new(ca).map_err(tls_error)?;
                if let Some((cert, key)) = cert {
                    tls = tls.with_client_cert(cert, key).map_err(tls_error)?;
                }
                if let Some(name) = name {
                    tls = tls.with_server_name(name.clone());
                }
                options.tls = Some(tls);
            }
        }
        Ok(options)
    }

    /// Attached mode: asks the daemon to lend this process connections to its memnodes
    /// (KRCORE's borrowed connections). When it does, key operations run one-sided from
    /// this process, as in embedded mode, with no hop through the daemon and without the
    /// memnodes' token; statistics and everything else still go through the daemon. The
    /// daemon lends only to users allowed every command on every key, when it is not in
    /// cache mode (`maxmemory`) and routes by a fixed ring of shm memnodes; it takes the
    /// connections back when that changes, and a lent connection that fails is not used
    /// again: either way operations go through its ring from then on. Off by default.
    pub fn borrow_connections(mut self, borrow: bool) -> Self {
        self.borrow = borrow;
        self
    }

    /// Connects: embedded mode when memnodes were given (connects to each and loads their
    /// directories), attached mode otherwise (to [`ClientBuilder::attach`]'s socket, or to
    /// [`default_attach_socket`]). When no daemon listens there, fails with
    /// [`ClientError::Unavailable`] naming the path and the alternatives.
    pub fn connect(self) -> Result<Client, ClientError> {
        if let Some(addr) = &self.remote {
            if !self.memnodes.is_empty() || self.attach.is_some() || self.etcd.is_some() {
                return Err(ClientError::Config(
                    "a remote computenode and memnodes, etcd or an attach socket were given; choose one".into(),
                ));
            }
            // A remote computenode knows users, not the memnodes' token.
            let user = self.user.clone().unwrap_or_else(|| "default".into());
            let options = self.connect_options()?.with_user(user, self.password.clone().unwrap_or_default());
            let remote = remote::Remote::connect(addr, options)?;
            return Ok(Client { backend: Backend::Channel(Arc::new(remote)) });
        }
        if let Some((endpoints, cluster)) = &self.etcd {
            if !self.memnodes.is_empty() || self.attach.is_some() {
                return Err(ClientError::Config(
                    "etcd (the cluster map names the memnodes) and memnodes or an attach socket were given; choose one"
                        .into(),
                ));
            }
            let map = map_follower::fetch(endpoints, cluster, self.timeout)?.with_lease(self.map_lease);
            let table_options = TableOptions { grace_period: self.grace_period, op_timeout: self.timeout };
            let connect = self.connect_options()?;
            let cluster =
                embedded::Cluster::connect(&[], Some(map), connect, table_options, self.connections_per_memnode)?;
            return Ok(Client { backend: Backend::Embedded(cluster) });
        }
        if !self.memnodes.is_empty() {
            if let Some(path) = &self.attach {
                return Err(ClientError::Config(format!(
                    "both memnodes (embedded mode) and an attach socket ({}) were given; choose one",
                    path.display()
                )));
            }
            let table_options = TableOptions { grace_period: self.grace_period, op_timeout: self.timeout };
            let connect = self.connect_options()?;
            let cluster =
                embedded::Cluster::connect(&self.memnodes, None, connect, table_options, self.connections_per_memnode)?;
            return Ok(Client { backend: Backend::Embedded(cluster) });
        }
        if self.tls_ca.is_some() || self.tls_client_cert.is_some() || self.tls_server_name.is_some() {
            return Err(ClientError::Config(
                "TLS settings apply to memnodes or a remote computenode, not to the local daemon's socket".into(),
            ));
        }
        let path = self.attach.unwrap_or_else(default_attach_socket);
        let table_options = TableOptions { grace_period: self.grace_period, op_timeout: self.timeout };
        let attached =
            attached::Attached::connect(path, self.user, self.password, self.timeout, self.attach_spin, self.borrow)?;
        let lending = attached.take_lending();
        let attached: Arc<dyn channel::Channel> = Arc::new(attached);
        if let Some((lending, watch)) = lending {
            match lending.and_then(|lent| {
                let failed = Arc::new(AtomicBool::new(false));
                let cluster = embedded::Cluster::from_lent(lent, table_options, Arc::clone(&failed));
                cluster.map(|cluster| (cluster, failed)).map_err(|e| format!("could not use them: {e}"))
            }) {
                Ok((cluster, failed)) => {
                    let direct = Direct { cluster, attached, failed, watch };
                    return Ok(Client { backend: Backend::Direct(Arc::new(direct)) });
                }
                Err(reason) => tracing::info!("no lent connections ({reason}): operations go through the computenode"),
            }
        }
        Ok(Client { backend: Backend::Channel(attached) })
    }
}

#[derive(Clone)]
enum Backend {
    Embedded(Arc<embedded::Cluster>),
    /// Attached or remote: requests to a computenode.
    Channel(Arc<dyn channel::Channel>),
    /// Attached, on connections the computenode lent.
    Direct(Arc<Direct>),
}

/// An attached client running key operations on lent connections while it may.
struct Direct {
    cluster: Arc<embedded::Cluster>,
    attached: Arc<dyn channel::Channel>,
    /// A lent connection failed.
    failed: Arc<AtomicBool>,
    watch: attached::LendingWatch,
}

impl Direct {
    fn usable(&self) -> bool {
        !self.failed.load(Ordering::Relaxed) && !self.watch.revoked()
    }
}

/// Where one call goes.
enum Path<'a> {
    Embedded(&'a Arc<embedded::Cluster>),
    Channel(&'a Arc<dyn channel::Channel>),
}

/// A handle on a racekv cluster; clone it freely.
#[derive(Clone)]
pub struct Client {
    backend: Backend,
}

impl Client {
    /// Settings for a new client: attached to the local computenode unless told otherwise.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// Attached or embedded.
    pub fn mode(&self) -> Mode {
        match &self.backend {
            Backend::Embedded(_) => Mode::Embedded,
            Backend::Channel(c) => c.mode(),
            Backend::Direct(_) => Mode::Attached,
        }
    }

    /// The daemon's socket, in attached mode.
    pub fn attach_socket(&self) -> Option<&std::path::Path> {
        match &self.backend {
            Backend::Embedded(_) => None,
            Backend::Channel(c) => c.attach_socket(),
            Backend::Direct(d) => d.attached.attach_socket(),
        }
    }

    /// Whether key operations run on connections the computenode lent
    /// ([`ClientBuilder::borrow_connections`]) now.
    pub fn is_direct(&self) -> bool {
        matches!(&self.backend, Backend::Direct(d) if d.usable())
    }

    fn path(&self) -> Path<'_> {
        match &self.backend {
            Backend::Embedded(c) => Path::Embedded(c),
            Backend::Channel(c) => Path::Channel(c),
            Backend::Direct(d) if d.usable() => Path::Embedded(&d.cluster),
            Backend::Direct(d) => Path::Channel(&d.attached),
        }
    }

    /// The value of `key`, if any.
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.get(key)),
            Path::Channel(c) => c.get(key),
        }
    }

    /// Sets `key` to `value`, replacing any previous value.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.put(key, value)),
            Path::Channel(c) => c.put_with(key, value, PutMode::Upsert).map(|_| ()),
        }
    }

    /// Sets `key` to `value` only if it has no value; returns whether it did.
    pub fn insert(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.put_with(key, value, PutMode::InsertOnly)),
            Path::Channel(c) => c.put_with(key, value, PutMode::InsertOnly),
        }
    }

    /// Replaces the value of `key` only if it has one; returns whether it did.
    pub fn update(&self, key: &[u8], value: &[u8]) -> Result<bool, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.put_with(key, value, PutMode::UpdateOnly)),
            Path::Channel(c) => c.put_with(key, value, PutMode::UpdateOnly),
        }
    }

    /// Sets `key` to `value` as `options` say: its mode (an expired key counts as absent),
    /// its expiry (absolute Unix milliseconds, none, or the key's current one), and
    /// whether to return the value it had.
    ///
    /// ```no_run
    /// use racekv_client::{Expiry, PutMode, PutOptions};
    /// # let client = racekv_client::Client::builder().connect()?;
    /// let in_a_minute = racekv_client::now_unix_ms() + 60_000;
    /// let options = PutOptions { mode: PutMode::InsertOnly, expiry: Expiry::At(in_a_minute), return_old: false };
    /// let applied = client.put_opts(b"lock:job-7", b"worker-3", options)?.outcome != racekv_client::PutOutcome::NotApplied;
    /// # Ok::<(), racekv_client::ClientError>(())
    /// ```
    pub fn put_opts(&self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.put_opts(key, value, options)),
            Path::Channel(c) => c.put_opts(key, value, options),
        }
    }

    /// Sets `key` to `value`, expiring `ttl` from now (by this host's clock).
    pub fn put_ex(&self, key: &[u8], value: &[u8], ttl: Duration) -> Result<(), ClientError> {
        let options = PutOptions { expiry: Expiry::At(expires_in(ttl)), ..PutOptions::default() };
        self.put_opts(key, value, options).map(|_| ())
    }

    /// The value and expiry of `key`, if it exists.
    pub fn get_item(&self, key: &[u8]) -> Result<Option<Item>, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.get_item(key)),
            Path::Channel(c) => c.get_item(key),
        }
    }

    /// What `key`'s expiry is: missing, none, or an absolute Unix time in milliseconds.
    pub fn ttl(&self, key: &[u8]) -> Result<Ttl, ClientError> {
        self.get_item(key).map(|item| Ttl::of(item.as_ref()))
    }

    /// Changes `key`'s expiry (a time not after now removes the key, as Redis' EXPIRE
    /// does); returns whether it applied (false: no such key, or the condition failed).
    pub fn expire(&self, key: &[u8], change: ExpiryChange) -> Result<bool, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.expire(key, change)),
            Path::Channel(c) => c.expire(key, change),
        }
    }

    /// Makes `key` expire `ttl` from now; returns whether it exists.
    pub fn expire_in(&self, key: &[u8], ttl: Duration) -> Result<bool, ClientError> {
        self.expire(key, ExpiryChange::At { at_ms: expires_in(ttl), condition: ExpireCondition::ALWAYS })
    }

    /// Removes `key`'s expiry; returns whether it had one.
    pub fn persist(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.expire(key, ExpiryChange::Persist)
    }

    /// Removes `key`; returns whether it had a value.
    pub fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.delete(key)),
            Path::Channel(c) => c.delete(key),
        }
    }

    /// Atomically sets `key` to `new` (None removes it) if its value is `expected` (None:
    /// absent). Returns whether it did.
    pub fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.compare_and_swap(key, expected, new)),
            Path::Channel(c) => c.compare_and_swap(key, expected, new),
        }
    }

    /// Values of many keys; the lookups to each memnode travel in batches.
    pub fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.multi_get(keys)),
            Path::Channel(c) => c.multi_get(keys),
        }
    }

    /// Runs `body` as a transaction (`txn`): its reads see one snapshot, its writes apply
    /// atomically across memnodes when it returns `Ok`, or not at all; on a conflict it runs
    /// again (so it should have no other effects), at least [`txn::MAX_TXN_ATTEMPTS`] times
    /// and until [`txn::TXN_CONFLICT_BUDGET`] has passed, then fails with a conflict.
    /// Serializable. In every mode: an attached or remote client reads each key once through
    /// its computenode and sends the buffered writes in one commit request, which the
    /// computenode's session runs (the same protocol as embedded mode, and the Redis front
    /// end's MULTI/EXEC); there the ACL checks the reads as GET and the commit as EXEC of its
    /// keys (with SET or DEL for its writes). Through a computenode a transaction reads and
    /// writes at most [`op::MAX_MULTI`] keys each, in a commit of at most
    /// [`op::MAX_REQUEST_BYTES`] ([`ClientError::TooLarge`] past either).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), racekv_client::ClientError> {
    /// # let client = racekv_client::Client::builder().memnode("tcp:127.0.0.1:7400").connect()?;
    /// // Move 10 from a to b.
    /// client.transaction(|tx| {
    ///     let a: i64 = tx.get(b"a")?.map_or(0, |v| String::from_utf8_lossy(&v).parse().unwrap_or(0));
    ///     let b: i64 = tx.get(b"b")?.map_or(0, |v| String::from_utf8_lossy(&v).parse().unwrap_or(0));
    ///     tx.put(b"a", (a - 10).to_string().as_bytes());
    ///     tx.put(b"b", (b + 10).to_string().as_bytes());
    ///     Ok(())
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn transaction<T>(
        &self,
        body: impl FnMut(&mut dyn txn::Transaction) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.transaction(body)),
            Path::Channel(c) => optimistic::run(&mut &**c, body),
        }
    }

    /// Sets many keys. Not atomic across keys (a failure leaves the earlier keys set).
    pub fn multi_put(&self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.multi_put(pairs)),
            Path::Channel(c) => c.multi_put(pairs),
        }
    }

    /// Each memnode's endpoint and table statistics (an RPC to each). Item-count changes
    /// that idle sessions still hold are sent first, so a quiescent client counts exactly.
    /// Attached mode: as the daemon sees them (one entry naming the socket if the daemon
    /// cannot be asked).
    pub fn stats(&self) -> Vec<(String, Result<TableStats, ClientError>)> {
        let (label, entries) = match self.path() {
            Path::Embedded(c) => {
                c.flush_idle();
                return c.with(|s| s.stats());
            }
            Path::Channel(c) => (c.label().to_string(), c.stats()),
        };
        match entries {
            Ok(entries) => entries
                .into_iter()
                .map(|m| {
                    let stats = m.stats.map_err(|(kind, message)| op::Reply::into_error(kind, message, &m.endpoint));
                    (m.endpoint, stats)
                })
                .collect(),
            Err(e) => vec![(label, Err(e))],
        }
    }

    /// Endpoints of the memnodes (attached and remote modes: the daemon's, asked each time;
    /// empty if it cannot be asked).
    pub fn memnodes(&self) -> Vec<String> {
        let entries = match self.path() {
            Path::Embedded(c) => return c.labels(),
            Path::Channel(c) => c.stats(),
        };
        match entries {
            Ok(entries) => entries.into_iter().map(|m| m.endpoint).collect(),
            Err(e) => {
                tracing::warn!("asking the computenode for its memnodes failed: {e}");
                Vec::new()
            }
        }
    }

    /// About `count` keys (at least 1, at most [`op::MAX_MULTI`]) from `cursor` on, and the
    /// cursor to continue from: Redis' SCAN. Start with 0; the walk is over when the cursor
    /// comes back 0. A key present from the walk's first call to its last is returned at
    /// least once, however the tables split meanwhile; some may come twice, and a call may
    /// return none and still not be the last (a split in progress). Pages carry at most
    /// [`op::MAX_SCAN_REPLY_BYTES`] of keys (attached: what a ring slot holds). Cursors
    /// are the same in every mode and every session of the same memnodes
    /// ([`Session::scan`] has their format).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), racekv_client::ClientError> {
    /// let client = racekv_client::Client::builder().connect()?;
    /// let mut cursor = 0;
    /// loop {
    ///     let (next, keys) = client.scan(cursor, 1000)?;
    ///     for key in keys {
    ///         println!("{}", String::from_utf8_lossy(&key));
    ///     }
    ///     if next == 0 {
    ///         break;
    ///     }
    ///     cursor = next;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn scan(&self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), ClientError> {
        let count = count.clamp(1, op::MAX_MULTI);
        match self.path() {
            Path::Embedded(c) => {
                c.with(|s| s.scan(cursor, ScanLimits::new(count, op::MAX_MULTI, op::MAX_SCAN_REPLY_BYTES as usize)))
            }
            Path::Channel(c) => c.scan(cursor, count as u32),
        }
    }

    /// A key picked at random, or None when there are none (Redis' RANDOMKEY; not uniform:
    /// keys after empty stretches of a table come up more often).
    pub fn random_key(&self) -> Result<Option<Vec<u8>>, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.random_key(session::random_seed())),
            Path::Channel(c) => c.random_key(),
        }
    }

    /// Deletes every key on every memnode (Redis' FLUSHALL); returns how many it removed.
    /// Not atomic: a key written while it runs may survive it.
    pub fn delete_all(&self) -> Result<u64, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.delete_all()),
            Path::Channel(c) => c.delete_all(),
        }
    }

    /// Copies `key`'s item on its primary (or its absence) to every memnode its writes go
    /// to ([`Session::sync_key`]). Embedded mode.
    pub fn sync_key(&self, key: &[u8]) -> Result<(), ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.sync_key(key)),
            Path::Channel(_) => Err(embedded_only("sync_key")),
        }
    }

    /// Catches memnode `joiner` up on the keys each source picks from its primary
    /// ([`Session::catch_up`]; `catchup.rs`). Embedded mode, routing by cluster map `epoch`
    /// (which names `joiner` as joining those partitions) or newer.
    pub fn catch_up(
        &self,
        epoch: u64,
        joiner: u64,
        sources: &[CatchUpSource<'_>],
        progress: &mut dyn FnMut(u64),
    ) -> Result<CatchUp, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.catch_up(epoch, joiner, sources, progress)),
            Path::Channel(_) => Err(embedded_only("catch_up")),
        }
    }

    /// Raises memnode `node`'s map epoch word to `epoch` ([`Session::raise_served_epoch`]).
    /// Embedded mode.
    pub fn raise_served_epoch(&self, node: u64, epoch: u64) -> Result<u64, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.raise_served_epoch(node, epoch)),
            Path::Channel(_) => Err(embedded_only("raise_served_epoch")),
        }
    }

    /// Removes memnode `node`'s copies of keys `stale` picks ([`Session::purge`]). Embedded
    /// mode, routing by cluster map `epoch` or newer.
    pub fn purge(
        &self,
        epoch: u64,
        node: u64,
        stale: &dyn Fn(&[u8]) -> bool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Purged, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.purge(epoch, node, stale, progress)),
            Path::Channel(_) => Err(embedded_only("purge")),
        }
    }

    /// Number of keys on all memnodes (their item counters, each key counted once with
    /// replicas, as DBSIZE counts; they trail operations in flight).
    pub fn len(&self) -> Result<u64, ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.len()),
            Path::Channel(c) => c.len(),
        }
    }

    /// Whether [`Client::len`] is zero.
    pub fn is_empty(&self) -> Result<bool, ClientError> {
        self.len().map(|n| n == 0)
    }

    /// Gets ready to write without waiting: an embedded client fetches a heap chunk from
    /// every memnode now, so its first write makes no allocation RPC (call it at start-up,
    /// off the latency-sensitive path). Attached and remote clients have nothing to do: the
    /// daemon's sessions hold their chunks already.
    ///
    /// ```no_run
    /// let client = racekv_client::Client::builder().memnode("tcp:10.0.0.5:7400").connect()?;
    /// client.prepare()?;
    /// client.put(b"user:1", b"ada")?; // no allocation round trip here
    /// # Ok::<(), racekv_client::ClientError>(())
    /// ```
    pub fn prepare(&self) -> Result<(), ClientError> {
        match self.path() {
            Path::Embedded(c) => c.with(|s| s.prepare()),
            Path::Channel(_) => Ok(()),
        }
    }
}

/// Now, as absolute Unix time in milliseconds: the clock expiry times are in.
pub use racekv_hashing::clock::now_unix_ms;

/// The error of an operation only embedded mode has (it needs the memnodes themselves).
fn embedded_only(what: &str) -> ClientError {
    ClientError::Config(format!("{what} needs embedded mode (this client goes through a computenode)"))
}

/// The absolute time `ttl` from now, in Unix milliseconds.
fn expires_in(ttl: Duration) -> u64 {
    now_unix_ms().saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn the_default_socket_lives_in_the_runtime_dir_or_a_per_user_tmp_dir() {
        assert_eq!(
            default_attach_socket_for(Some(OsStr::new("/run/user/1000")), 1000),
            PathBuf::from("/run/user/1000/racekv/computenode.sock")
        );
        assert_eq!(default_attach_socket_for(None, 42), PathBuf::from("/tmp/racekv-42/computenode.sock"));
        assert_eq!(
            default_attach_socket_for(Some(OsStr::new("relative")), 7),
            PathBuf::from("/tmp/racekv-7/computenode.sock")
        );
        assert!(default_attach_socket().ends_with("computenode.sock"));
    }

    #[test]
    fn tls_settings_reach_the_connect_options() {
        let pki = racekv_transport::test_pki::TestPki::new("client CA");
        assert!(Client::builder().connect_options().unwrap().tls.is_none());
        let options = Client::builder()
            .tls_ca(pki.path("ca.pem"))
            .tls_client_cert(pki.path("client.pem"), pki.path("client.key"))
            .tls_server_name("memnode.example")
            .connect_options()
            .unwrap();
        let tls = format!("{:?}", options.tls.expect("TLS settings"));
        assert!(tls.contains("client.pem") && tls.contains("memnode.example"), "{tls}");
        let missing = Client::builder().tls_ca(pki.path("absent.pem")).connect_options().err().unwrap();
        assert!(matches!(&missing, ClientError::Config(m) if m.contains("absent.pem")), "{missing:?}");
        let no_ca = Client::builder().tls_client_cert(pki.path("client.pem"), pki.path("client.key"));
        assert!(matches!(no_ca.connect_options(), Err(ClientError::Config(_))));
        let attached =
            Client::builder().attach("/nonexistent.sock").tls_ca(pki.path("ca.pem")).connect().err().unwrap();
        assert!(matches!(&attached, ClientError::Config(m) if m.contains("TLS")), "{attached:?}");
    }

    #[test]
    fn memnodes_and_an_attach_socket_do_not_mix() {
        let err = Client::builder().memnode("tcp:127.0.0.1:1").attach("/nonexistent.sock").connect().err().unwrap();
        assert!(matches!(err, ClientError::Config(_)), "{err:?}");
    }
}
