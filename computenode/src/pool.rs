//! Pre-initialized connections to one memnode, and the virtual connections workers use.
//!
//! The daemon opens K physical connections per memnode when it starts (the expensive part:
//! connect, authenticate, and on verbs create and connect a queue pair). A worker never
//! opens one: it gets a [`VirtualConnection`], a handle multiplexed over the pool: creating
//! one costs no system call and no network round trip (KRCORE's virtual QP).
//!
//! Hybrid upgrade (KRCORE): a virtual connection whose operation rate stays above a
//! threshold asks for a dedicated connection; a background thread builds it and switches the
//! handle over. Operations in flight finish on the connection they started on; none fails.
//! Not on shm, where there is nothing to spare (see [`VirtualConnection::new`]).
//!
//! Spreading: a handle keeps to one pool connection (its home) while nobody else has an
//! operation in flight there; when someone does, it tries one other connection and moves
//! there if that one is free. Busy workers thus end up on connections of their own, however
//! their sessions were handed out, and idle handles (an idle Redis client, a parked worker)
//! weigh nothing. Over tcp this matters: a connection is one server thread, and two busy
//! workers sharing one did 20 K GETs/s against 58 K on two (2 cores). Not on shm, where a
//! connection is a mapping any number of threads use at once.
//!
//! Failure: a physical connection that fails is replaced in the background while the pool
//! keeps serving from the others; the operation that saw the failure reports it (it may have
//! executed, so it is not retried blindly).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Instant;

use crossbeam_channel::Sender;
use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use racekv_transport::{Batch, ConnectOptions, Connection, Endpoint, Started, TransportError, TransportKind};

struct Metrics {
    physical: IntGauge,
    virtual_live: IntGauge,
    dedicated: IntGauge,
    upgrades: IntCounter,
    contended: IntCounter,
    moves: IntCounter,
    replacements: IntCounterVec,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        physical: metric::gauge("racekv_computenode_pool_connections", "Physical connections in the pools"),
        virtual_live: metric::gauge("racekv_computenode_virtual_connections", "Virtual connections handed to workers"),
        dedicated: metric::gauge(
            "racekv_computenode_dedicated_connections",
            "Virtual connections upgraded to a dedicated physical connection",
        ),
        upgrades: metric::counter(
            "racekv_computenode_upgrades_total",
            "Virtual connections upgraded to dedicated ones",
        ),
        contended: metric::counter(
            "racekv_computenode_pool_contended_operations_total",
            "Operations whose pool connection had another worker's operation in flight (many: the pool is too small)",
        ),
        moves: metric::counter(
            "racekv_computenode_virtual_connection_moves_total",
            "Virtual connections moved to a pool connection nobody else was using at the time",
        ),
        replacements: metric::counter_vec(
            "racekv_computenode_connection_replacements_total",
            "Failed pool connections replaced (result ok, failed: a try that failed, abandoned: the \
             endpoint serves another table now, so the slot stays closed)",
            &["result"],
            &[],
        ),
    }
});

/// The physical connections to one memnode.
pub struct Pool {
    endpoint: Endpoint,
    connect: ConnectOptions,
    slots: Vec<RwLock<Arc<dyn Connection>>>,
    /// Each slot's replacements so far: a handle's cached connection of a slot stands while
    /// the count is the one it was cached at (see [`VirtualConnection::run`]).
    generations: Vec<CachePadded<AtomicU64>>,
    /// Slots being replaced (so one failure starts one replacement).
    replacing: Vec<AtomicBool>,
    /// Operations in flight on each slot through virtual connections (padded: each busy
    /// worker's slot stays in its own core's cache).
    in_flight: Vec<CachePadded<AtomicUsize>>,
    /// Whether busy workers sharing a connection slow each other down: over tcp a connection
    /// is one server thread, over verbs one queue pair. Not over shm, where a connection is a
    /// mapping any number of threads use at once without a lock. Where it does not, handles
    /// neither spread over the slots nor get upgraded (see the module doc).
    sharing_costs: bool,
    /// Operations that found their handle's home busy, and moves to a free slot.
    contended: AtomicU64,
    moves: AtomicU64,
    next: AtomicUsize,
    region_len: u64,
    kind: TransportKind,
    /// The node id of the table behind the endpoint, once known ([`Pool::expect_node_id`]):
    /// a replacement connection must reach the same table.
    node_id: std::sync::OnceLock<u64>,
    /// A dial found another table at the endpoint (the memnode came back empty, its data
    /// file lost, and the map lists it as a new memnode): this one's never comes back
    /// there, so replacements stop trying.
    superseded: AtomicBool,
    /// The dedicated connections handed out (upgrades), for [`Pool::abort_all`].
    dedicated: Mutex<Vec<std::sync::Weak<dyn Connection>>>,
}

impl Pool {
    /// Opens `size` connections to `endpoint`.
    pub fn connect(endpoint: Endpoint, connect: ConnectOptions, size: usize) -> Result<Arc<Self>, TransportError> {
        LazyLock::force(&METRICS);
        let size = size.max(1);
        let mut slots = Vec::with_capacity(size);
        for _ in 0..size {
            slots.push(RwLock::new(racekv_transport::connect(&endpoint, &connect)?));
        }
        let first = slots[0].read().clone();
        METRICS.physical.add(size as i64);
        Ok(Arc::new(Self {
            endpoint,
            connect,
            replacing: (0..size).map(|_| AtomicBool::new(false)).collect(),
            generations: (0..size).map(|_| CachePadded::new(AtomicU64::new(0))).collect(),
            in_flight: (0..size).map(|_| CachePadded::new(AtomicUsize::new(0))).collect(),
            sharing_costs: first.kind() != TransportKind::Shm,
            contended: AtomicU64::new(0),
            moves: AtomicU64::new(0),
            slots,
            next: AtomicUsize::new(0),
            region_len: first.region_len(),
            kind: first.kind(),
            node_id: std::sync::OnceLock::new(),
            superseded: AtomicBool::new(false),
            dedicated: Mutex::new(Vec::new()),
        }))
    }

    /// Fails what waits on any connection to this memnode, shared or dedicated, at once
    /// ([`Connection::abort`]): the cluster map dropped it from every replica set. The
    /// shared ones are replaced at once, in the background, as after any failure.
    pub fn abort_all(self: &Arc<Self>, reason: &str) {
        for (i, slot) in self.slots.iter().enumerate() {
            slot.read().abort(reason);
            // Replaced now, not on next use: a memnode drained (not down) may be written to
            // again by a later map (added back), and finds its connections whole.
            self.report_broken(i);
        }
        let mut dedicated = self.dedicated.lock();
        dedicated.retain(|weak| weak.upgrade().inspect(|conn| conn.abort(reason)).is_some());
    }

    /// From now on a new connection (a replacement, an upgrade) must reach the table with
    /// node id `id`: a memnode back empty at this endpoint (its data file lost) has another
    /// one, and mixing the two would lose writes and read keys as absent.
    pub fn expect_node_id(&self, id: u64) {
        let set = *self.node_id.get_or_init(|| id);
        assert_eq!(set, id, "a pool's node id is set once");
    }

    /// A new connection to the endpoint, checked to reach the expected table.
    fn dial(&self) -> Result<Arc<dyn Connection>, TransportError> {
        let conn = racekv_transport::connect(&self.endpoint, &self.connect)?;
        let Some(&expected) = self.node_id.get() else { return Ok(conn) };
        let found = racekv_hashing::format::read_node_id(&*conn).map_err(|e| match e {
            racekv_hashing::Error::Transport(e) => e,
            other => TransportError::Protocol(format!("reading the node id: {other}")),
        })?;
        self.superseded.store(found != expected, Ordering::Release);
        if found != expected {
            return Err(TransportError::Protocol(format!(
                "{} now serves node id {found:#x}, not {expected:#x} (a new table: its data file was lost or \
                 replaced); refusing to mix them",
                self.endpoint
            )));
        }
        Ok(conn)
    }

    /// The memnode these connections reach.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Connections in the pool, healthy or not.
    pub fn size(&self) -> usize {
        self.slots.len()
    }

    /// Healthy connections right now.
    pub fn healthy(&self) -> usize {
        self.slots.iter().filter(|s| s.read().is_healthy()).count()
    }

    /// Healthy connections right now, after starting the replacement of any broken one.
    /// Readiness probes call this: a pod taken out of a Service gets no traffic, so no
    /// operation would report its broken connections, and it would stay unready for good.
    pub fn healthy_after_repair(self: &Arc<Self>) -> usize {
        let mut healthy = 0;
        for slot in 0..self.slots.len() {
            let conn = Arc::clone(&self.slots[slot].read());
            if conn.check_healthy() {
                healthy += 1;
            } else {
                self.report_broken(slot);
            }
        }
        healthy
    }

    /// A slot for a new virtual connection (round robin).
    fn assign(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()
    }

    /// Operations in flight on each connection through virtual connections.
    pub fn in_flight(&self) -> Vec<usize> {
        self.in_flight.iter().map(|n| n.load(Ordering::Acquire)).collect()
    }

    /// Operations that found their virtual connection's home busy with another's operation,
    /// and how many of those moved to a free connection.
    pub fn contention(&self) -> (u64, u64) {
        (self.contended.load(Ordering::Relaxed), self.moves.load(Ordering::Relaxed))
    }

    /// Counts an operation on `slot` until the guard drops.
    fn enter(&self, slot: usize) -> InFlight<'_> {
        self.in_flight[slot].fetch_add(1, Ordering::AcqRel);
        InFlight { counter: &self.in_flight[slot] }
    }

    /// The connection of `slot`, or of the next healthy slot if it is broken.
    fn connection(&self, slot: usize) -> (usize, Arc<dyn Connection>) {
        let n = self.slots.len();
        for i in 0..n {
            let s = (slot + i) % n;
            let conn = self.slots[s].read();
            if conn.is_healthy() {
                return (s, Arc::clone(&conn));
            }
        }
        (slot, Arc::clone(&self.slots[slot].read()))
    }

    /// Starts replacing `slot` in the background (once).
    fn report_broken(self: &Arc<Self>, slot: usize) {
        if self.replacing[slot].swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("pool-repair".into()).spawn(move || {
            let mut delay = std::time::Duration::from_millis(10);
            // A memnode down is retried for as long as the pool lives (it may come back on
            // its data file): one line per 10 s, not one per try. One replaced by another
            // table at its endpoint never comes back there: given up (a later failure of
            // this slot, should its table return, tries again).
            let log = racekv_telemetry::ratelimit::RateLimit::new(10_000);
            loop {
                match pool.dial() {
                    Ok(conn) => {
                        *pool.slots[slot].write() = conn;
                        pool.generations[slot].fetch_add(1, Ordering::Release);
                        METRICS.replacements.with_label_values(&["ok"]).inc();
                        tracing::info!(memnode = %pool.endpoint, slot, "replaced a failed connection");
                        break;
                    }
                    Err(e) if pool.superseded.load(Ordering::Acquire) => {
                        METRICS.replacements.with_label_values(&["abandoned"]).inc();
                        tracing::info!(memnode = %pool.endpoint, slot, "not replacing a failed connection: {e}");
                        break;
                    }
                    Err(e) => {
                        METRICS.replacements.with_label_values(&["failed"]).inc();
                        racekv_telemetry::ratelimit::limited_warn(&log, || {
                            format!(
                                "{} slot {slot}: replacing a failed connection failed: {e}; retrying",
                                pool.endpoint
                            )
                        });
                        std::thread::sleep(delay);
                        delay = (delay * 2).min(std::time::Duration::from_secs(2));
                    }
                }
            }
            pool.replacing[slot].store(false, Ordering::Release);
        });
        if spawned.is_err() {
            self.replacing[slot].store(false, Ordering::Release);
        }
    }

    /// Sends an access outside the region on `slot`'s connection, unchecked, and replaces
    /// the connection if that broke it (on a NIC the queue pair goes to the error state).
    /// Fault injection for tests; returns what the access returned.
    #[doc(hidden)]
    pub fn inject_fault(self: &Arc<Self>, slot: usize) -> Result<(), TransportError> {
        let conn = Arc::clone(&self.slots[slot].read());
        let mut batch = Batch::new();
        batch.read(self.region_len, 8);
        let result = conn.execute_unchecked(&mut batch);
        if !conn.is_healthy() {
            self.report_broken(slot);
        }
        result
    }

    /// A new physical connection just for one worker (an upgrade).
    fn dedicated(&self) -> Result<Arc<dyn Connection>, TransportError> {
        let conn = self.dial()?;
        let mut dedicated = self.dedicated.lock();
        dedicated.retain(|weak| weak.strong_count() > 0);
        dedicated.push(Arc::downgrade(&conn));
        Ok(conn)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        METRICS.physical.sub(self.slots.len() as i64);
    }
}

/// An operation in flight on a pool slot.
struct InFlight<'a> {
    counter: &'a AtomicUsize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let before = self.counter.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "a pool slot's in-flight count went below zero");
    }
}

/// When a virtual connection asks for a dedicated one.
#[derive(Debug, Clone, Copy)]
pub struct UpgradePolicy {
    /// Operations per second above which a handle is upgraded (0 disables upgrades).
    pub ops_per_sec: u64,
    /// The rate is measured over this many operations.
    pub window_ops: u64,
}

/// Builds dedicated connections off the hot path, one request at a time.
#[derive(Clone)]
pub struct Upgrader {
    tx: Sender<Weak<VirtualConnection>>,
}

impl Upgrader {
    /// Starts the thread that builds the dedicated connections.
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Weak<VirtualConnection>>();
        std::thread::Builder::new().name("vconn-upgrader".into()).spawn(move || {
            for weak in rx {
                let Some(vc) = weak.upgrade() else { continue };
                match vc.pool.dedicated() {
                    Ok(conn) => {
                        vc.dedicated.set(conn);
                        METRICS.upgrades.inc();
                        METRICS.dedicated.inc();
                        tracing::debug!(memnode = %vc.pool.endpoint, "upgraded a virtual connection");
                    }
                    Err(e) => {
                        tracing::warn!(memnode = %vc.pool.endpoint, "upgrade failed, staying on the pool: {e}");
                        vc.upgrade_asked.store(false, Ordering::Release);
                    }
                }
            }
        })?;
        Ok(Self { tx })
    }
}

/// A worker's handle on a memnode, multiplexed over the pool (or, once upgraded, on a
/// dedicated connection).
pub struct VirtualConnection {
    pool: Arc<Pool>,
    /// The pool slot this handle uses while nobody else is busy there (see the module doc).
    home: AtomicUsize,
    /// Which other slot to try next when home is busy (cycles through all of them).
    probes: AtomicUsize,
    dedicated: Dedicated,
    /// The pool connection of the last operation, kept so that the next one on the same slot
    /// takes neither the slot's lock nor a reference to the connection: both are lines every
    /// handle of the pool writes, and two event loops on two cores bounced them on every
    /// operation (4% of a loop's time in pipelined SETs on shm).
    cached: Mutex<Option<CachedConnection>>,
    policy: UpgradePolicy,
    upgrader: Upgrader,
    upgrade_asked: AtomicBool,
    ops: AtomicU64,
    window_started: Mutex<Instant>,
    me: Weak<VirtualConnection>,
}

impl VirtualConnection {
    /// A new handle: no system call, no network round trip. Where sharing a connection costs
    /// nothing (shm) it is never upgraded: a dedicated connection would spare nothing, and
    /// would cost two threads and a new mapping whose pages fault in all over again.
    pub fn new(pool: &Arc<Pool>, policy: UpgradePolicy, upgrader: &Upgrader) -> Arc<Self> {
        let policy = if !pool.sharing_costs { UpgradePolicy { ops_per_sec: 0, ..policy } } else { policy };
        METRICS.virtual_live.inc();
        let home = pool.assign();
        Arc::new_cyclic(|me| Self {
            home: AtomicUsize::new(home),
            probes: AtomicUsize::new(home),
            pool: Arc::clone(pool),
            dedicated: Dedicated::default(),
            cached: Mutex::new(None),
            policy,
            upgrader: upgrader.clone(),
            upgrade_asked: AtomicBool::new(false),
            ops: AtomicU64::new(0),
            window_started: Mutex::new(Instant::now()),
            me: me.clone(),
        })
    }

    /// Whether this handle runs on its own connection now.
    pub fn is_dedicated(&self) -> bool {
        self.dedicated.present()
    }

    /// Drops a dedicated connection (the handle goes back to the shared pool).
    pub fn downgrade(&self) {
        if self.dedicated.take().is_some() {
            METRICS.dedicated.dec();
        }
        self.upgrade_asked.store(false, Ordering::Release);
        *self.window_started.lock() = Instant::now();
        self.ops.store(0, Ordering::Relaxed);
    }

    /// The pool slot this handle uses now (it moves; see the module doc).
    pub fn home(&self) -> usize {
        self.home.load(Ordering::Relaxed)
    }

    /// Home, unless someone else has an operation in flight there and one other slot
    /// (the next in this handle's cycle) has none: then that slot becomes home. Two loads
    /// at most; an idle pool costs one.
    fn route(&self) -> usize {
        let home = self.home.load(Ordering::Relaxed);
        let n = self.pool.slots.len();
        let busy = |slot: usize| self.pool.in_flight[slot].load(Ordering::Acquire) > 0;
        if !self.pool.sharing_costs || !busy(home) {
            return home;
        }
        self.pool.contended.fetch_add(1, Ordering::Relaxed);
        METRICS.contended.inc();
        if n == 1 {
            return home;
        }
        let step = 1 + self.probes.fetch_add(1, Ordering::Relaxed) % (n - 1);
        let other = (home + step) % n;
        if busy(other) {
            return home;
        }
        self.home.store(other, Ordering::Relaxed);
        self.pool.moves.fetch_add(1, Ordering::Relaxed);
        METRICS.moves.inc();
        other
    }

    /// Runs `op` on the connection this handle uses now, counted in flight on its pool slot
    /// where that matters, then reports a broken connection and counts the operation.
    fn run<T>(&self, op: impl FnOnce(&dyn Connection) -> Result<T, TransportError>) -> Result<T, TransportError> {
        if !self.dedicated.present() {
            // One thread at a time uses a session's handle; another one at the same time
            // (none does today) takes the uncached path below.
            if let Some(mut cached) = self.cached.try_lock() {
                let slot = self.route();
                let generation = self.pool.generations[slot].load(Ordering::Acquire);
                let stands = cached
                    .as_ref()
                    .is_some_and(|c| c.slot == slot && c.generation == generation && c.conn.is_healthy());
                if !stands {
                    // The generation was read first: a replacement racing this read leaves
                    // a newer count behind it, so the next operation looks again.
                    let (used, conn) = self.pool.connection(slot);
                    *cached = (used == slot).then_some(CachedConnection { slot, generation, conn });
                }
                if let Some(c) = cached.as_ref() {
                    return self.run_on(Some(slot), &*c.conn, op);
                }
            }
        }
        let (slot, conn) = self.current();
        self.run_on(slot, &*conn, op)
    }

    /// Runs `op` on `conn` (of pool slot `slot`; None: the dedicated connection), counted in
    /// flight on the slot where that matters, then reports a broken connection and counts
    /// the operation.
    fn run_on<T>(
        &self,
        slot: Option<usize>,
        conn: &dyn Connection,
        op: impl FnOnce(&dyn Connection) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        let in_flight = slot.filter(|_| self.pool.sharing_costs).map(|s| self.pool.enter(s));
        let result = op(conn);
        drop(in_flight);
        self.after(slot, matches!(&result, Err(e) if e.is_connection_failure()));
        result
    }

    fn current(&self) -> (Option<usize>, Arc<dyn Connection>) {
        if let Some(conn) = self.dedicated.get().filter(|c| c.is_healthy()) {
            return (None, conn);
        }
        let (slot, conn) = self.pool.connection(self.route());
        (Some(slot), conn)
    }

    fn after(&self, slot: Option<usize>, failed: bool) {
        if failed {
            match slot {
                Some(slot) => self.pool.report_broken(slot),
                None => {
                    // The dedicated connection broke: fall back to the pool.
                    if self.dedicated.take().is_some() {
                        METRICS.dedicated.dec();
                    }
                }
            }
        }
        if self.policy.ops_per_sec == 0 || self.upgrade_asked.load(Ordering::Relaxed) {
            return;
        }
        let n = self.ops.fetch_add(1, Ordering::Relaxed) + 1;
        if !n.is_multiple_of(self.policy.window_ops.max(1)) {
            return;
        }
        let mut started = self.window_started.lock();
        let elapsed = started.elapsed();
        *started = Instant::now();
        let rate = self.policy.window_ops as f64 / elapsed.as_secs_f64().max(1e-9);
        if rate >= self.policy.ops_per_sec as f64 && !self.upgrade_asked.swap(true, Ordering::AcqRel) {
            let _ = self.upgrader.tx.send(self.me.clone());
        }
    }
}

/// A handle's dedicated connection, if it was upgraded. `present` mirrors the lock's
/// content so that the hot path of a handle never upgraded (every one on shm) reads one
/// flag, not a lock shared with the upgrader (two atomic writes per round trip).
#[derive(Default)]
struct Dedicated {
    conn: RwLock<Option<Arc<dyn Connection>>>,
    present: AtomicBool,
}

impl Dedicated {
    /// Whether there is one: written under the lock as its content changes, so a reader
    /// that races a change sees the state just before it or just after (false: it uses the
    /// pool, as one a moment earlier would have).
    fn present(&self) -> bool {
        self.present.load(Ordering::Acquire)
    }

    fn get(&self) -> Option<Arc<dyn Connection>> {
        if !self.present() {
            return None;
        }
        self.conn.read().clone()
    }

    fn set(&self, conn: Arc<dyn Connection>) {
        let mut slot = self.conn.write();
        *slot = Some(conn);
        self.present.store(true, Ordering::Release);
    }

    fn take(&self) -> Option<Arc<dyn Connection>> {
        let mut slot = self.conn.write();
        let taken = slot.take();
        self.present.store(false, Ordering::Release);
        taken
    }
}

/// A pool slot's connection as a handle last used it (see [`VirtualConnection::run`]).
struct CachedConnection {
    slot: usize,
    /// The slot's replacement count when it was cached.
    generation: u64,
    conn: Arc<dyn Connection>,
}

impl Drop for VirtualConnection {
    fn drop(&mut self) {
        METRICS.virtual_live.dec();
        if self.dedicated.take().is_some() {
            METRICS.dedicated.dec();
        }
    }
}

impl Connection for VirtualConnection {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        self.run(|conn| conn.execute(batch))
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.run(|conn| conn.call(method, request))
    }

    // Overlapped batches (`racekv_transport::overlap`) go on the connection the handle uses
    // now, without the slot's in-flight count (a hint for spreading load, not a guard).
    fn start(&self, batch: &mut Batch) -> Started {
        let (slot, conn) = self.current();
        let started = conn.start(batch);
        Started::forwarded(conn, started, slot.map_or(u64::MAX, |s| s as u64))
    }

    fn finish(&self, started: Started, batch: &mut Batch) -> Result<(), TransportError> {
        let sent = started.into_forwarded().unwrap_or_else(|_| unreachable!("every start here forwards"));
        let result = sent.conn.finish(sent.inner, batch);
        let slot = usize::try_from(sent.note).ok().filter(|_| sent.note != u64::MAX);
        self.after(slot, matches!(&result, Err(e) if e.is_connection_failure()));
        result
    }

    fn region_len(&self) -> u64 {
        self.pool.region_len
    }

    fn kind(&self) -> TransportKind {
        self.pool.kind
    }

    fn instance(&self) -> u64 {
        self.current().1.instance()
    }

    fn is_healthy(&self) -> bool {
        self.pool.healthy() > 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};

    use racekv_hashing::testing::{TestMemnode, Via};
    use racekv_transport::{Batch, ConnectOptions, Connection, TransportKind};

    use super::{Dedicated, Pool, UpgradePolicy, Upgrader, VirtualConnection};

    const THREADS: usize = 4;
    const OPS: usize = 1_500;

    /// `THREADS` threads, each on a handle that starts on slot 0 of a pool of `size`, run
    /// `OPS` reads each at once. Returns the pool's (contended, moves) and the final homes.
    fn all_start_on_one_connection(m: &TestMemnode, size: usize) -> ((u64, u64), Vec<usize>) {
        let options = ConnectOptions { token: TestMemnode::TOKEN.into(), ..ConnectOptions::default() };
        let pool = Pool::connect(m.endpoint().unwrap().clone(), options, size).unwrap();
        let upgrader = Upgrader::start().unwrap();
        let no_upgrades = UpgradePolicy { ops_per_sec: 0, window_ops: 1 };
        // Round robin hands every size-th handle slot 0.
        let handles: Vec<_> = (0..THREADS * size)
            .map(|_| VirtualConnection::new(&pool, no_upgrades, &upgrader))
            .filter(|vc| vc.home() == 0)
            .collect();
        assert_eq!(handles.len(), THREADS);
        let start = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = handles
            .iter()
            .map(|vc| {
                let (vc, start) = (Arc::clone(vc), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    for _ in 0..OPS {
                        let mut batch = Batch::new();
                        batch.read(0, 64);
                        vc.execute(&mut batch).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(pool.in_flight(), vec![0; size], "in-flight counts after every operation returned");
        (pool.contention(), handles.iter().map(|vc| vc.home()).collect())
    }

    #[test]
    fn the_dedicated_flag_says_what_the_lock_holds() {
        let m = TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16);
        let options = ConnectOptions { token: TestMemnode::TOKEN.into(), ..ConnectOptions::default() };
        let pool = Pool::connect(m.endpoint().unwrap().clone(), options, 1).unwrap();
        let (_, conn) = pool.connection(0);
        let d = Dedicated::default();
        assert!(!d.present() && d.get().is_none());
        d.set(Arc::clone(&conn));
        assert!(d.present());
        assert!(d.get().is_some_and(|c| Arc::ptr_eq(&c, &conn)));
        assert!(d.take().is_some());
        assert!(!d.present() && d.get().is_none() && d.take().is_none());
    }

    #[test]
    fn busy_handles_that_start_on_one_connection_spread_over_the_pool() {
        let m = TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16);
        let total = (THREADS * OPS) as u64;
        // Control: with one connection every handle shares it, and the counter sees that.
        let ((shared, moves), _) = all_start_on_one_connection(&m, 1);
        assert_eq!(moves, 0);
        assert!(shared > total / 5, "{shared} of {total} operations found the lone connection busy");
        // A connection each: they move apart early and stop contending.
        let ((contended, moves), homes) = all_start_on_one_connection(&m, THREADS);
        assert!(moves >= (THREADS - 1) as u64, "only {moves} moves; homes {homes:?}");
        assert!(
            contended * 4 < shared,
            "{contended} of {total} operations contended with a connection each, {shared} with one"
        );
    }

    #[test]
    fn a_handle_moves_to_the_connection_that_replaced_its_cached_one() {
        let m = TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16);
        let options = ConnectOptions { token: TestMemnode::TOKEN.into(), ..ConnectOptions::default() };
        let pool = Pool::connect(m.endpoint().unwrap().clone(), options, 1).unwrap();
        let upgrader = Upgrader::start().unwrap();
        let vc = VirtualConnection::new(&pool, UpgradePolicy { ops_per_sec: 0, window_ops: 1 }, &upgrader);
        let read = |vc: &VirtualConnection| {
            let mut batch = Batch::new();
            batch.read(0, 64);
            vc.execute(&mut batch)
        };
        read(&vc).expect("a healthy pool");
        let cached = vc.cached.lock().as_ref().map(|c| Arc::as_ptr(&c.conn) as *const u8).expect("cached");
        pool.abort_all("test: the memnode left the map");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while read(&vc).is_err() {
            assert!(std::time::Instant::now() < deadline, "the handle never reached the replacement");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for _ in 0..10 {
            read(&vc).expect("the replacement serves every later operation");
        }
        assert!(pool.generations[0].load(std::sync::atomic::Ordering::Acquire) >= 1);
        let now = vc.cached.lock().as_ref().map(|c| Arc::as_ptr(&c.conn) as *const u8).expect("cached");
        assert_ne!(now, cached, "still on the aborted connection");
        assert!(pool.slots[0].read().is_healthy());
    }

    /// Batches sent together on handles of two pools (a replicated write's steps,
    /// `racekv_transport::overlap`) come back with their own results; a pool whose
    /// connections were aborted fails at most its own batch, and serves again once its
    /// connections are replaced.
    #[test]
    fn batches_sent_together_on_handles_of_several_pools_finish_on_their_own_connections() {
        let memnodes: Vec<TestMemnode> =
            (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 16 << 20, 16)).collect();
        let options = ConnectOptions { token: TestMemnode::TOKEN.into(), ..ConnectOptions::default() };
        let pools: Vec<Arc<Pool>> = memnodes
            .iter()
            .map(|m| Pool::connect(m.endpoint().unwrap().clone(), options.clone(), 2).unwrap())
            .collect();
        let upgrader = Upgrader::start().unwrap();
        let policy = UpgradePolicy { ops_per_sec: 0, window_ops: 1 };
        let handles: Vec<Arc<VirtualConnection>> =
            pools.iter().map(|p| VirtualConnection::new(p, policy, &upgrader)).collect();
        let round = |value: u8| {
            let mut batches: Vec<Batch> = (0..2).map(|_| Batch::new()).collect();
            let reads: Vec<_> = batches
                .iter_mut()
                .enumerate()
                .map(|(i, b)| {
                    b.write(4096, &[value + i as u8; 16]);
                    b.read(4096, 16)
                })
                .collect();
            let mut work: Vec<(&dyn Connection, &mut Batch)> =
                handles.iter().map(|h| &**h as &dyn Connection).zip(batches.iter_mut()).collect();
            let results = racekv_transport::execute_all(&mut work);
            let bytes: Vec<Option<Vec<u8>>> =
                batches.iter().zip(&reads).map(|(b, &r)| b.read_result(r).ok().map(<[u8]>::to_vec)).collect();
            (results, bytes)
        };
        for value in [10u8, 20, 30] {
            let (results, bytes) = round(value);
            for (i, (result, bytes)) in results.into_iter().zip(bytes).enumerate() {
                result.unwrap_or_else(|e| panic!("pool {i}: {e}"));
                assert_eq!(bytes, Some(vec![value + i as u8; 16]), "pool {i}");
            }
        }
        assert_eq!(pools[0].in_flight(), vec![0; 2]);
        let (results, _) = round(40);
        assert!(results[0].is_ok(), "the healthy pool's batch failed: {:?}", results[0]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let (results, bytes) = round(50);
            if results.iter().all(Result::is_ok) {
                assert_eq!(bytes, [Some(vec![50; 16]), Some(vec![51; 16])]);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the aborted pool never served again: {results:?}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
