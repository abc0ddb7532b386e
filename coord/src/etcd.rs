//! The cluster's state in etcd (`keys.rs` has the layout), through the `etcd-client`
//! crate, behind a blocking API: the daemons are threads, not async tasks, so [`Etcd`] owns
//! a small tokio runtime (one worker) that runs the calls, the lease keep-alives and the
//! watches.
//!
//! * [`Etcd::register`]: a memnode's registration, under a lease of its own that a
//!   background task keeps alive. If etcd loses the lease (it was down longer than the
//!   TTL, or restarted without its data), the task grants a new one and registers again,
//!   so a live memnode is listed again within a TTL of etcd coming back. Dropping the
//!   [`Registration`] revokes the lease: the memnode leaves the list at once.
//! * [`Etcd::map`] and [`Etcd::put_map`]: the map and its revision; a write succeeds only
//!   if the map is still at the revision the writer read (or absent, for the first map),
//!   so concurrent writers agree on one sequence of maps.
//! * [`Etcd::watch_map`]: every later map, in order, through a channel; a broken watch is
//!   started again from the next revision (and reports a compacted gap by reading the
//!   current map).
//!
//! Every call is bounded by the timeout given at connect. Everything read is checked
//! (`map.rs`) before it is returned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};

use crate::map::{ClusterMap, MemnodeInfo, MAX_MEMNODES};
use crate::{CoordError, KeySpace};

pub use crate::DEFAULT_ETCD_TIMEOUT as DEFAULT_TIMEOUT;
/// Shortest lease accepted (etcd's own minimum is about this).
pub const MIN_LEASE: Duration = Duration::from_secs(1);
/// Most mover claims counted ([`Etcd::movers`]): any is enough to wait.
pub const MAX_MOVERS: usize = 64;
/// How long a broken keep-alive or watch waits before it tries again.
const RETRY: Duration = Duration::from_millis(200);
/// Least time a lease's local deadline keeps before etcd's own expiry (`lease_deadline`).
const LEASE_MARGIN_MIN: Duration = Duration::from_millis(100);

/// A connection to a cluster's state in etcd.
pub struct Etcd {
    runtime: Arc<tokio::runtime::Runtime>,
    client: Client,
    keys: KeySpace,
    endpoints: String,
    timeout: Duration,
}

/// A memnode's registration: kept alive while this lives, revoked when it is dropped.
pub struct Registration {
    /// When the lease may lapse in etcd, by this process's clock ([`Registration::deadline`]).
    deadline: Arc<Mutex<Instant>>,
    stop: Arc<AtomicBool>,
    stopped: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    runtime: Arc<tokio::runtime::Runtime>,
}

/// Wakes its owner when the memnodes' registrations change ([`Etcd::watch_registrations`]).
pub struct RegistrationWatch {
    changes: mpsc::Receiver<()>,
    stop: Arc<AtomicBool>,
}

/// The maps after a revision, as etcd sends them ([`Etcd::watch_map`]).
pub struct MapWatch {
    maps: mpsc::Receiver<Result<(ClusterMap, i64), CoordError>>,
    stop: Arc<AtomicBool>,
}

impl Etcd {
    /// Connects to etcd at `endpoints` (`http://host:port`, or `host:port`) for cluster
    /// `cluster`; every call waits at most `timeout`.
    pub fn connect(endpoints: &[String], cluster: &str, timeout: Duration) -> Result<Self, CoordError> {
        let keys = KeySpace::new(cluster)?;
        if endpoints.is_empty() {
            return Err(CoordError::Config("no etcd endpoints".into()));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd")
            .enable_all()
            .build()
            .map_err(|e| CoordError::Config(format!("starting the etcd client's runtime: {e}")))?;
        let label = endpoints.join(",");
        let options = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let client = runtime
            .block_on(async { tokio::time::timeout(timeout, Client::connect(endpoints, Some(options))).await })
            .map_err(|_| etcd_error(&label, format!("no answer within {timeout:?}")))?
            .map_err(|e| etcd_error(&label, e))?;
        Ok(Self { runtime: Arc::new(runtime), client, keys, endpoints: label, timeout })
    }

    /// The cluster's keys.
    pub fn keys(&self) -> &KeySpace {
        &self.keys
    }

    /// Runs `call` on the runtime, bounded by the timeout.
    fn run<T, F>(&self, call: impl FnOnce(Client) -> F) -> Result<T, CoordError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let future = call(self.client.clone());
        self.runtime
            .block_on(async { tokio::time::timeout(self.timeout, future).await })
            .map_err(|_| etcd_error(&self.endpoints, format!("no answer within {:?}", self.timeout)))?
            .map_err(|e| etcd_error(&self.endpoints, e))
    }

    /// Registers memnode `info` under a lease of `ttl`, kept alive in the background (see
    /// the module's comment).
    pub fn register(&self, info: &MemnodeInfo, ttl: Duration) -> Result<Registration, CoordError> {
        info.check()?;
        self.hold(self.keys.memnode(info.node_id), info.encode(), ttl)
    }

    /// Says that a command moving partitions runs (`membership.rs`), under a lease of `ttl`
    /// kept alive in the background, until the [`Registration`] is dropped (revoked) or the
    /// process dies (it lapses): a healer calls off the moves of a mover that is gone.
    /// `who` names it (host and pid) for people reading etcd.
    pub fn claim_mover(&self, who: &str, ttl: Duration) -> Result<Registration, CoordError> {
        // Several may run at once, each under a key of its own.
        let id = racekv_telemetry::random::random_u64();
        self.hold(self.keys.mover(id), who.as_bytes().to_vec(), ttl)
    }

    /// How many commands moving partitions hold a claim now (live leases), at most
    /// [`MAX_MOVERS`] counted.
    pub fn movers(&self) -> Result<usize, CoordError> {
        let prefix = self.keys.movers();
        let options = GetOptions::new().with_prefix().with_count_only().with_limit(MAX_MOVERS as i64);
        let resp = self.run(|mut c| async move { c.get(prefix, Some(options)).await })?;
        Ok(usize::try_from(resp.count()).unwrap_or(usize::MAX).min(MAX_MOVERS))
    }

    /// Puts `value` at `key` under a lease of `ttl` that a background task keeps alive (and
    /// puts again under a new lease should etcd lose it); revoked when the registration drops.
    fn hold(&self, key: String, value: Vec<u8>, ttl: Duration) -> Result<Registration, CoordError> {
        let ttl_s = i64::try_from(ttl.max(MIN_LEASE).as_secs()).unwrap_or(i64::MAX);
        let sent = Instant::now();
        let lease = self.run(|mut c| {
            let (key, value) = (key.clone(), value.clone());
            async move { grant_and_put(&mut c, &key, &value, ttl_s).await }
        })?;
        let deadline = Arc::new(Mutex::new(lease_deadline(sent, ttl_s)));
        let stop = Arc::new(AtomicBool::new(false));
        let (stopped, on_stop) = tokio::sync::oneshot::channel();
        let held = Held { key, value, ttl_s, deadline: Arc::clone(&deadline) };
        let task = self.runtime.spawn(keep_registered(self.client.clone(), held, lease, Arc::clone(&stop), on_stop));
        Ok(Registration {
            deadline,
            stop,
            stopped: Some(stopped),
            task: Some(task),
            runtime: Arc::clone(&self.runtime),
        })
    }

    /// The memnodes registered now (live leases), by node id.
    pub fn memnodes(&self) -> Result<Vec<MemnodeInfo>, CoordError> {
        let prefix = self.keys.memnodes();
        let options = GetOptions::new().with_prefix().with_limit(MAX_MEMNODES as i64 + 1);
        let resp = self.run(|mut c| async move { c.get(prefix, Some(options)).await })?;
        let mut out = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            out.push(MemnodeInfo::decode(kv.value())?);
        }
        if out.len() > MAX_MEMNODES {
            return Err(CoordError::BadMap(format!("more than {MAX_MEMNODES} memnodes registered")));
        }
        out.sort_by_key(|m| m.node_id);
        Ok(out)
    }

    /// The map and its revision (etcd's `mod_revision`), or None before the first map.
    pub fn map(&self) -> Result<Option<(ClusterMap, i64)>, CoordError> {
        let key = self.keys.map();
        let resp = self.run(|mut c| async move { c.get(key, None).await })?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) => Ok(Some((ClusterMap::decode(kv.value())?, kv.mod_revision()))),
        }
    }

    /// Writes `map` if the stored map is still at revision `expected` (None: if there is
    /// none yet). Returns the new revision, or None when another writer came first (read
    /// the map again). The map must be valid and its epoch above the one it replaces (the
    /// caller read it).
    pub fn put_map(&self, map: &ClusterMap, expected: Option<i64>) -> Result<Option<i64>, CoordError> {
        map.check()?;
        let (key, value) = (self.keys.map(), map.encode());
        let compare = match expected {
            Some(revision) => Compare::mod_revision(key.clone(), CompareOp::Equal, revision),
            None => Compare::create_revision(key.clone(), CompareOp::Equal, 0),
        };
        let txn = Txn::new().when([compare]).and_then([TxnOp::put(key, value, None)]);
        let resp = self.run(|mut c| async move { c.txn(txn).await })?;
        if !resp.succeeded() {
            return Ok(None);
        }
        Ok(Some(resp.header().map_or(0, |h| h.revision())))
    }

    /// Every map written after revision `after`, in order (see the module's comment). The
    /// watch ends when the [`MapWatch`] is dropped.
    pub fn watch_map(&self, after: i64) -> MapWatch {
        let (send, maps) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        self.runtime.spawn(forward_maps(
            self.client.clone(),
            self.keys.map(),
            after,
            send,
            Arc::clone(&stop),
            self.endpoints.clone(),
        ));
        MapWatch { maps, stop }
    }

    /// A watch that wakes on every change to the memnodes' registrations (a lease expiring
    /// deletes one: failover learns of it at once rather than at its next poll). It ends
    /// when the [`RegistrationWatch`] is dropped.
    pub fn watch_registrations(&self) -> RegistrationWatch {
        let (send, changes) = mpsc::sync_channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        self.runtime.spawn(forward_registration_changes(
            self.client.clone(),
            self.keys.memnodes(),
            send,
            Arc::clone(&stop),
        ));
        RegistrationWatch { changes, stop }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // Background tasks hold clones of the client; the runtime goes with the last Arc.
        tracing::debug!(endpoints = %self.endpoints, "etcd client closed");
    }
}

fn etcd_error(endpoints: &str, reason: impl std::fmt::Display) -> CoordError {
    CoordError::Etcd { endpoints: endpoints.to_string(), reason: reason.to_string() }
}

async fn grant_and_put(c: &mut Client, key: &str, value: &[u8], ttl_s: i64) -> Result<i64, etcd_client::Error> {
    let lease = c.lease_grant(ttl_s, None).await?.id();
    c.put(key, value, Some(PutOptions::new().with_lease(lease))).await?;
    Ok(lease)
}

/// When a lease of `ttl_s` seconds renewed by a request sent at `sent` may lapse, by this
/// process's clock: etcd counts the TTL from when it got the request, later; the margin
/// leaves room for clocks that run at slightly different rates and for waking up late.
fn lease_deadline(sent: Instant, ttl_s: i64) -> Instant {
    let ttl = Duration::from_secs(u64::try_from(ttl_s).unwrap_or(0));
    sent + ttl.saturating_sub((ttl / 10).max(LEASE_MARGIN_MIN))
}

/// What a registration keeps in etcd.
struct Held {
    key: String,
    value: Vec<u8>,
    ttl_s: i64,
    deadline: Arc<Mutex<Instant>>,
}

impl Held {
    fn renewed(&self, sent: Instant, ttl_s: i64) {
        let mut deadline = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        *deadline = (*deadline).max(lease_deadline(sent, ttl_s.min(self.ttl_s)));
    }
}

/// Keeps a registration's lease alive (a keep-alive every third of the TTL); grants a new
/// lease and registers again when etcd says the lease is gone; revokes it when told to stop.
/// Each success moves the registration's deadline on.
async fn keep_registered(
    mut c: Client,
    held: Held,
    mut lease: i64,
    stop: Arc<AtomicBool>,
    mut on_stop: tokio::sync::oneshot::Receiver<()>,
) {
    let (key, value, ttl_s) = (held.key.as_str(), held.value.as_slice(), held.ttl_s);
    let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(100));
    while !stop.load(Ordering::Relaxed) {
        let sent = Instant::now();
        // Bounded: a keep-alive etcd never answers (a partition) must not stop the retries.
        // A whole TTL: a slow answer is still an answer (its lease lives on).
        let renewal = tokio::time::timeout(Duration::from_secs(ttl_s.unsigned_abs()), async {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await.ok()?;
            keeper.keep_alive().await.ok()?;
            stream.message().await.ok()?.map(|r| r.ttl()).filter(|&ttl| ttl > 0)
        });
        let alive = match renewal.await {
            Ok(Some(ttl)) => {
                held.renewed(sent, ttl);
                true
            }
            _ => false,
        };
        if !alive {
            let sent = Instant::now();
            match grant_and_put(&mut c, key, value, ttl_s).await {
                Ok(new) => {
                    tracing::warn!(key, "etcd had lost this key's lease: put again under a new one");
                    held.renewed(sent, ttl_s);
                    lease = new;
                }
                Err(e) => tracing::debug!(key, "renewing the registration failed (retrying): {e}"),
            }
        }
        let wait = if alive { period } else { RETRY };
        if tokio::time::timeout(wait, &mut on_stop).await.is_ok() {
            break;
        }
    }
    if let Err(e) = c.lease_revoke(lease).await {
        tracing::debug!(key, "revoking the registration's lease failed (it expires by itself): {e}");
    }
}

/// What a watch's handler wants after a response.
enum Flow {
    /// The next response.
    Next,
    /// Watch again (after [`RETRY`]): what came is not usable as a continuation.
    Rewatch,
    /// End the watch: no one listens any more.
    Stop,
}

/// Watches `key` (with the options `options` gives, asked anew at every start) until
/// `stop` is set or a handler says [`Flow::Stop`]: `handle` gets every response; after the
/// watch broke (or `handle` asked to watch again), `broke` is told (false: stop), and the
/// watch starts again after [`RETRY`]. `stop` is looked at at least every 5 RETRYs.
async fn keep_watching(
    mut c: Client,
    key: String,
    what: &str,
    stop: Arc<AtomicBool>,
    options: impl Fn() -> WatchOptions,
    mut handle: impl FnMut(&etcd_client::WatchResponse) -> Flow,
    mut broke: impl FnMut() -> bool,
) {
    while !stop.load(Ordering::Relaxed) {
        let mut stream = match c.watch(key.clone(), Some(options())).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!("watching {what} failed (retrying): {e}");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        loop {
            let message = tokio::time::timeout(RETRY * 5, stream.message()).await;
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match message {
                Err(_) => continue, // no news; look at `stop` again
                Ok(Ok(Some(resp))) => match handle(&resp) {
                    Flow::Next => {}
                    Flow::Rewatch => break,
                    Flow::Stop => return,
                },
                Ok(Ok(None)) | Ok(Err(_)) => break,
            }
        }
        if !broke() {
            return;
        }
        tracing::debug!("the watch of {what} broke; watching again");
        tokio::time::sleep(RETRY).await;
    }
}

/// Sends every map written after revision `after` to `send`, in order, until `stop` (or
/// the receiver is gone); a compacted gap is reported by the current map.
async fn forward_maps(
    c: Client,
    key: String,
    after: i64,
    send: mpsc::Sender<Result<(ClusterMap, i64), CoordError>>,
    stop: Arc<AtomicBool>,
    endpoints: String,
) {
    let after = std::sync::atomic::AtomicI64::new(after);
    let what = format!("the cluster map on {endpoints}");
    let options = || WatchOptions::new().with_start_revision(after.load(Ordering::Relaxed) + 1);
    let handle = |resp: &etcd_client::WatchResponse| {
        if resp.compact_revision() > 0 {
            // The revisions we missed are gone: report the current map instead.
            after.store(resp.compact_revision() - 1, Ordering::Relaxed);
            return Flow::Rewatch;
        }
        for event in resp.events() {
            let Some(kv) = event.kv().filter(|_| event.event_type() == EventType::Put) else { continue };
            after.store(kv.mod_revision(), Ordering::Relaxed);
            let item = ClusterMap::decode(kv.value()).map(|m| (m, kv.mod_revision()));
            if send.send(item).is_err() {
                return Flow::Stop;
            }
        }
        Flow::Next
    };
    keep_watching(c, key, &what, stop, options, handle, || true).await;
}

/// Pokes `send` at every change under `prefix`, and after each break of the watch (changes
/// may have been missed), until `stop` (or the receiver is gone). Pokes coalesce: one
/// waiting is enough.
async fn forward_registration_changes(c: Client, prefix: String, send: mpsc::SyncSender<()>, stop: Arc<AtomicBool>) {
    let poke = || !matches!(send.try_send(()), Err(mpsc::TrySendError::Disconnected(())));
    let handle = |resp: &etcd_client::WatchResponse| match resp.events().is_empty() || poke() {
        true => Flow::Next,
        false => Flow::Stop,
    };
    let options = || WatchOptions::new().with_prefix();
    keep_watching(c, prefix, "the registrations", stop, options, handle, poke).await;
}

impl Registration {
    /// When the lease may lapse in etcd (and a failover take the holder's place), by this
    /// process's clock, with a margin to spare; renewals move it on. A memnode past it
    /// fences itself (`racekv-memnode`'s registry).
    pub fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops keeping the lease alive without revoking it, as a crashed memnode would: the
    /// registration disappears when the lease expires (tests of lease expiry).
    pub fn abandon(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.stopped.take();
    }
}

impl Drop for Registration {
    /// Revokes the lease (bounded: the keep-alive task's revoke, joined for at most 5 s).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let (Some(stopped), Some(task)) = (self.stopped.take(), self.task.take()) {
            let _ = stopped.send(());
            let _ = self.runtime.block_on(async { tokio::time::timeout(Duration::from_secs(5), task).await });
        }
    }
}

impl MapWatch {
    /// The next map written, waiting at most `timeout` (None: none came).
    pub fn next(&self, timeout: Duration) -> Option<Result<(ClusterMap, i64), CoordError>> {
        self.maps.recv_timeout(timeout).ok()
    }
}

impl RegistrationWatch {
    /// Waits until the registrations change or `timeout` passes; whether they changed
    /// (or may have: the watch broke meanwhile).
    pub fn wait(&self, timeout: Duration) -> bool {
        self.changes.recv_timeout(timeout).is_ok()
    }
}

impl Drop for RegistrationWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Drop for MapWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
