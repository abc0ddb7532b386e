//! Cache mode: keeps each memnode's used memory under `maxmemory` by evicting keys the
//! policy allows, sampled as Redis samples (ARCHITECTURE.md, "Cache mode").
//!
//! "Used memory" of a memnode is an estimate of its live data: its subtables plus its item
//! count times the mean heap bytes of an item (from this computenode's writes). A refresher
//! reads every memnode's statistics (one STATS RPC each) every [`REFRESH`] while a limit is
//! set, and sleeps with no timeout while none is (an idle computenode wakes for nothing; the
//! first write that sees a limit wakes it). Between refreshes this computenode adds what it
//! writes and takes off what it evicts. So a write costs no round trip while under the
//! limit, and the GET path nothing at all.
//!
//! Over the limit, a write first evicts: it samples `maxmemory-samples` neighbouring keys
//! of the memnode's table (one scan step, then one read per sampled key), picks the victim
//! by policy, and deletes it by compare-and-swap against the value it read (a key
//! rewritten meanwhile is not evicted).
//!
//! The LRU and LFU policies score each sampled key from its block's access word (how long
//! unread, or 255 less its decayed counter: `racekv_hashing::access`), which reads keep up
//! to date while the tables' tracking is on: this sets it from the policy whenever a limit
//! is set. As Redis does, the best candidates of past samplings wait in a pool per memnode
//! ([`POOL_SIZE`]), so each eviction picks from more than one sample's keys; the pick is
//! read again before its delete, and goes back to the pool if it was read meanwhile. At most [`MAX_VICTIMS_PER_WRITE`] victims and
//! [`SAMPLE_TRIES`] (volatile policies: [`VOLATILE_SAMPLE_TRIES`]) samplings each: nothing
//! loops unbounded. When nothing could be evicted the write fails ([`WriteError::OverLimit`]:
//! Redis' OOM reply, the library's `OutOfSpace`).
//!
//! Every front end's writes come through [`Eviction::write`]: the Redis store's, and the
//! attach and remote front ends' requests ([`crate::execute`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use parking_lot::Mutex;
use racekv_client::{ClientError, Session, Shards};
use racekv_hashing::access::{Access, Tracking};
use racekv_hashing::layout::item_heap_bytes;
use racekv_hashing::Table;
use racekv_redis::maxmemory::{count_evicted, Maxmemory, MaxmemoryPolicy};

use crate::cluster::{Cluster, WorkerShards};

/// How often the memnodes' statistics are read while a limit is set.
pub const REFRESH: Duration = Duration::from_millis(100);
/// Most keys one write evicts before it goes ahead (or, having evicted none, fails).
pub const MAX_VICTIMS_PER_WRITE: usize = 16;
/// Samplings per victim before giving up on finding one under an `allkeys-*` policy (a
/// sampled key can vanish, or change before its delete).
pub const SAMPLE_TRIES: usize = 4;
/// The same under a `volatile-*` policy, which samples all keys but may evict only those
/// with an expiry: with a quarter of the keys volatile, 16 samplings of 5 keys all miss
/// them about once in 10^10 writes.
pub const VOLATILE_SAMPLE_TRIES: usize = 16;
/// Weight of a new write in the mean item size (1/16).
const MEAN_SHIFT: u32 = 4;
/// Candidates kept per memnode for the LRU and LFU policies (Redis' `EVPOOL_SIZE`).
pub const POOL_SIZE: usize = 16;

/// A key that may be evicted, and how good a victim it looked when sampled.
#[derive(Debug)]
struct Candidate {
    key: Vec<u8>,
    score: u64,
}

/// What eviction keeps per memnode.
struct Tracked {
    /// Estimated bytes of live data.
    used: AtomicU64,
    /// Bytes of one subtable.
    subtable_bytes: u64,
    /// Its endpoint, for errors.
    label: String,
    /// Its region's bytes (a limit may be a share of it).
    region_bytes: u64,
    /// Its table, whose reads' tracking follows the policy.
    table: Table,
    /// The LRU and LFU policies' best candidates, best last.
    pool: Mutex<Vec<Candidate>>,
}

impl Tracked {
    fn of(m: &crate::cluster::Memnode) -> Self {
        Self {
            used: AtomicU64::new(0),
            subtable_bytes: m.layout.subtable_bytes(),
            label: m.label.clone(),
            region_bytes: m.layout.region_len,
            table: m.table.clone(),
            pool: Mutex::new(Vec::with_capacity(POOL_SIZE + 1)),
        }
    }
}

/// One computenode's eviction state: the limits and each memnode's used-memory estimate.
pub struct Eviction {
    limits: Arc<Maxmemory>,
    /// Per memnode (by shard), append-only: a cluster map may add memnodes, taken on here
    /// when first seen ([`Eviction::memnode`]).
    memnodes: boxcar::Vec<Tracked>,
    /// The cluster whose memnodes these are; held while one is appended.
    cluster: std::sync::Weak<Cluster>,
    adding: Mutex<()>,
    /// The tracking last set on the tables (encoded).
    tracking: AtomicU64,
    /// Mean heap bytes of an item this computenode wrote (0: none written yet).
    mean_item: AtomicU64,
    /// How long a freed block waits before reuse: a write that found the region full
    /// waits this long after evicting, then tries once more.
    grace: Duration,
    stopping: AtomicBool,
    /// The refresher is parked with no timeout (no limit was set when it last looked).
    refresher_idle: AtomicBool,
    refresher: Mutex<Option<JoinHandle<()>>>,
    /// The refresher, to unpark.
    refresher_thread: OnceLock<Thread>,
}

/// Why a write in cache mode failed.
#[derive(Debug)]
pub enum WriteError {
    /// Its memnode is over `maxmemory` and nothing could be evicted (Redis' OOM).
    OverLimit {
        /// The memnode's endpoint.
        memnode: String,
    },
    /// The store's error.
    Client(ClientError),
}

impl WriteError {
    /// As the library reports it: over the limit is its memnode's `OutOfSpace`.
    pub fn into_client_error(self) -> ClientError {
        match self {
            Self::OverLimit { memnode } => {
                ClientError::OutOfSpace { endpoint: memnode, reason: OVER_LIMIT_REASON.into() }
            }
            Self::Client(e) => e,
        }
    }
}

/// The reason of an `OutOfSpace` from a write over `maxmemory` (Redis' OOM message).
pub const OVER_LIMIT_REASON: &str = "command not allowed when used memory > 'maxmemory'";

impl From<ClientError> for WriteError {
    fn from(e: ClientError) -> Self {
        Self::Client(e)
    }
}

impl Eviction {
    /// Eviction over `cluster`'s memnodes under `limits`; starts the refresher.
    pub fn start(cluster: &Arc<Cluster>, limits: Arc<Maxmemory>, grace: Duration) -> std::io::Result<Arc<Self>> {
        racekv_redis::maxmemory::register_metrics();
        let eviction = Arc::new(Self {
            limits,
            memnodes: boxcar::Vec::new(),
            cluster: Arc::downgrade(cluster),
            adding: Mutex::new(()),
            tracking: AtomicU64::new(Tracking::Off.encode()),
            mean_item: AtomicU64::new(0),
            grace,
            stopping: AtomicBool::new(false),
            refresher_idle: AtomicBool::new(false),
            refresher: Mutex::new(None),
            refresher_thread: OnceLock::new(),
        });
        eviction.take_new_memnodes();
        eviction.sync_tracking();
        let (weak_cluster, weak_self) = (Arc::downgrade(cluster), Arc::downgrade(&eviction));
        let handle = std::thread::Builder::new()
            .name("maxmemory-refresh".into())
            .spawn(move || refresh_loop(weak_cluster, weak_self))?;
        let _ = eviction.refresher_thread.set(handle.thread().clone());
        *eviction.refresher.lock() = Some(handle);
        Ok(eviction)
    }

    /// Stops the refresher (before the cluster stops: it holds a session while it reads).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.wake_refresher();
        if let Some(handle) = self.refresher.lock().take() {
            let _ = handle.join();
        }
    }

    fn wake_refresher(&self) {
        if let Some(thread) = self.refresher_thread.get() {
            thread.unpark();
        }
    }

    /// Takes on the cluster's memnodes it does not track yet (at start, and those a cluster
    /// map added since): their tables get the current tracking, and a limit that is a
    /// share of a region counts the smallest region.
    fn take_new_memnodes(&self) {
        let Some(cluster) = self.cluster.upgrade() else { return };
        let _adding = self.adding.lock();
        let known = self.memnodes.count();
        for m in cluster.memnodes().into_iter().skip(known) {
            m.table.set_tracking(Tracking::decode(self.tracking.load(Ordering::Relaxed)));
            self.memnodes.push(Tracked::of(m));
        }
        if self.memnodes.count() > known {
            let smallest = self.memnodes.iter().map(|(_, m)| m.region_bytes).min().unwrap_or(0);
            self.limits.set_region_bytes(smallest);
        }
    }

    /// What it keeps for memnode `shard` (taking on memnodes added since it last looked).
    fn memnode(&self, shard: usize) -> &Tracked {
        if shard >= self.memnodes.count() {
            self.take_new_memnodes();
        }
        &self.memnodes[shard]
    }

    /// Memnode `shard`'s estimated used memory (0 while no limit is set).
    pub fn used_bytes(&self, shard: usize) -> u64 {
        self.memnode(shard).used.load(Ordering::Relaxed)
    }

    /// Memnode `shard`'s limit in bytes (0: none).
    pub fn limit_bytes(&self, shard: usize) -> u64 {
        self.limits.limit().bytes_of(self.memnode(shard).region_bytes)
    }

    /// The limits this enforces.
    pub fn limits(&self) -> &Arc<Maxmemory> {
        &self.limits
    }

    /// What reads should record, as the settings are now: recency or frequency under an
    /// LRU or LFU policy with a limit set, nothing otherwise.
    pub fn wanted_tracking(&self) -> Tracking {
        let policy = self.limits.policy();
        match self.limits.limit().is_set() {
            true if policy.lru() => Tracking::Lru,
            true if policy.lfu() => Tracking::Lfu {
                log_factor: self.limits.lfu_log_factor(),
                decay_minutes: self.limits.lfu_decay_minutes(),
            },
            _ => Tracking::Off,
        }
    }

    /// Sets the tables' tracking to [`Self::wanted_tracking`] if it changed (one atomic
    /// load when it did not): at start, on every write over a limit and every refresh.
    fn sync_tracking(&self) {
        let wanted = self.wanted_tracking().encode();
        // A load first: every write over a limit comes here, and a swap would make all
        // workers write one cache line.
        if self.tracking.load(Ordering::Relaxed) != wanted && self.tracking.swap(wanted, Ordering::Relaxed) != wanted {
            let wanted = Tracking::decode(wanted);
            let _adding = self.adding.lock(); // a memnode taken on meanwhile gets `wanted` too
            self.memnodes.iter().for_each(|(_, m)| m.table.set_tracking(wanted));
            tracing::info!(?wanted, "reads' access tracking follows maxmemory-policy");
        }
    }

    /// Sets every memnode's estimate from its statistics.
    fn refresh(&self, session: &mut Session<WorkerShards>) {
        let mean = self.mean_item.load(Ordering::Relaxed);
        for (shard, (label, stats)) in session.stats().into_iter().enumerate() {
            match stats {
                Ok(s) => {
                    let m = self.memnode(shard);
                    let index = s.heap.subtables * m.subtable_bytes;
                    // Before this computenode wrote anything, the heap's footprint stands in.
                    let data = if mean == 0 { s.heap.heap_used_bytes.saturating_sub(index) } else { s.items * mean };
                    m.used.store(index + data, Ordering::Relaxed);
                }
                Err(e) => tracing::debug!(memnode = %label, "maxmemory: reading the statistics failed: {e}"),
            }
        }
    }

    /// Runs `write` of `key`, a new item of `bytes` of heap, in cache mode: room made
    /// first, and once more if the region turns out full.
    pub fn write<R>(
        &self,
        session: &mut Session<WorkerShards>,
        key: &[u8],
        bytes: u64,
        write: impl FnMut(&mut Session<WorkerShards>) -> Result<R, ClientError>,
    ) -> Result<R, WriteError> {
        self.make_room(session, key, bytes)?;
        self.retry_when_full(session, key, write)
    }

    fn over_limit(&self, shard: usize) -> WriteError {
        WriteError::OverLimit { memnode: self.memnode(shard).label.clone() }
    }

    /// Makes room for a write of `key` taking `bytes` of heap: evicts while its memnode is
    /// over the limit (see the module's comment). Errors: over the limit and nothing may
    /// be evicted; the store's errors. Single writes use [`Self::write`]; a transaction
    /// makes room for each of its writes before it commits.
    pub fn make_room(&self, session: &mut Session<WorkerShards>, key: &[u8], bytes: u64) -> Result<(), WriteError> {
        let setting = self.limits.limit();
        if !setting.is_set() {
            return Ok(());
        }
        // A limit set since the refresher went to sleep (CONFIG SET): wake it. Should the
        // refresher park just after this load, the next write wakes it.
        if self.refresher_idle.load(Ordering::Relaxed) && self.refresher_idle.swap(false, Ordering::AcqRel) {
            self.wake_refresher();
        }
        self.sync_tracking();
        let mean = self.mean_item.load(Ordering::Relaxed);
        let next = if mean == 0 { bytes } else { mean - (mean >> MEAN_SHIFT) + (bytes >> MEAN_SHIFT) };
        self.mean_item.store(next.max(1), Ordering::Relaxed);
        let shard = session.shards().route(key);
        let limit = setting.bytes_of(self.memnode(shard).region_bytes);
        let used = &self.memnode(shard).used;
        if used.load(Ordering::Relaxed) + bytes > limit {
            let policy = self.limits.policy();
            if policy == MaxmemoryPolicy::NoEviction || self.evict(session, shard, policy, limit, bytes)? == 0 {
                return Err(self.over_limit(shard));
            }
        }
        used.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Runs `write`; when the region is full and the policy may evict, evicts, waits for
    /// freed blocks to become reusable, and runs it once more.
    fn retry_when_full<R>(
        &self,
        session: &mut Session<WorkerShards>,
        key: &[u8],
        mut write: impl FnMut(&mut Session<WorkerShards>) -> Result<R, ClientError>,
    ) -> Result<R, WriteError> {
        match write(session) {
            Err(ClientError::OutOfSpace { .. }) if self.limits.policy() != MaxmemoryPolicy::NoEviction => {
                let shard = session.shards().route(key);
                let wanted = self.mean_item.load(Ordering::Relaxed).max(1) * MAX_VICTIMS_PER_WRITE as u64;
                if self.evict(session, shard, self.limits.policy(), 0, wanted)? == 0 {
                    return Err(self.over_limit(shard));
                }
                std::thread::sleep(self.grace + Duration::from_millis(1));
                Ok(write(session)?)
            }
            other => Ok(other?),
        }
    }

    /// Evicts from memnode `shard` until `bytes` more fit under `limit` (0: until that many
    /// bytes were freed), at most [`MAX_VICTIMS_PER_WRITE`] keys; returns how many.
    fn evict(
        &self,
        session: &mut Session<WorkerShards>,
        shard: usize,
        policy: MaxmemoryPolicy,
        limit: u64,
        bytes: u64,
    ) -> Result<u64, ClientError> {
        let used = &self.memnode(shard).used;
        let (mut victims, mut freed) = (0u64, 0u64);
        while (victims as usize) < MAX_VICTIMS_PER_WRITE {
            let Some(victim_bytes) = self.evict_one(session, shard, policy)? else { break };
            victims += 1;
            freed += victim_bytes;
            let _ = used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(victim_bytes)));
            let done = if limit == 0 { freed >= bytes } else { used.load(Ordering::Relaxed) + bytes <= limit };
            if done {
                break;
            }
        }
        count_evicted(victims);
        Ok(victims)
    }

    /// Samples memnode `shard`'s keys and deletes the policy's pick; returns its heap bytes,
    /// or None when no sampling found one.
    fn evict_one(
        &self,
        session: &mut Session<WorkerShards>,
        shard: usize,
        policy: MaxmemoryPolicy,
    ) -> Result<Option<u64>, ClientError> {
        debug_assert_ne!(policy, MaxmemoryPolicy::NoEviction);
        let tries = if policy.volatile_only() { VOLATILE_SAMPLE_TRIES } else { SAMPLE_TRIES };
        if policy.lru() || policy.lfu() {
            return self.evict_from_pool(session, shard, policy, tries);
        }
        let samples = self.limits.samples() as usize;
        for _ in 0..tries {
            let seed = racekv_client::session::random_seed();
            let keys = session.random_keys_on(shard, seed, samples)?;
            if keys.is_empty() {
                return Ok(None); // an empty table
            }
            let mut pick: Option<(Vec<u8>, racekv_hashing::Item)> = None;
            for key in keys {
                let Some(item) = session.get_item(&key)? else { continue };
                let better = match (policy, item.expires_at_ms) {
                    (MaxmemoryPolicy::AllkeysRandom, _) | (MaxmemoryPolicy::VolatileRandom, Some(_)) => true,
                    (MaxmemoryPolicy::VolatileTtl, Some(at)) => {
                        pick.as_ref().is_none_or(|(_, p)| p.expires_at_ms.is_some_and(|best| at < best))
                    }
                    _ => false,
                };
                if better {
                    pick = Some((key, item));
                    if policy != MaxmemoryPolicy::VolatileTtl {
                        break; // random: the first eligible one will do
                    }
                }
            }
            let Some((key, item)) = pick else { continue };
            assert!(
                !policy.volatile_only() || item.expires_at_ms.is_some(),
                "a volatile policy picked a persistent key"
            );
            // Against the value read: a key rewritten since is not evicted.
            if session.compare_and_swap(&key, Some(&item.value), None)? {
                let bytes = item_heap_bytes(key.len(), item.value.len(), item.expires_at_ms.is_some()).unwrap_or(0);
                return Ok(Some(bytes));
            }
        }
        Ok(None)
    }
}

impl Eviction {
    /// Evicts the best victim under an LRU or LFU policy: samples memnode `shard`'s keys
    /// (up to `tries` times) into its pool, then deletes the pool's best, read again first (gone: the next; read
    /// since it was sampled: back in the pool at its new score, unless still the best).
    /// Returns the victim's heap bytes, or None when no sampling found one.
    fn evict_from_pool(
        &self,
        session: &mut Session<WorkerShards>,
        shard: usize,
        policy: MaxmemoryPolicy,
        tries: usize,
    ) -> Result<Option<u64>, ClientError> {
        let tracking = self.wanted_tracking();
        for _ in 0..tries {
            let now_ms = racekv_client::now_unix_ms();
            let seed = racekv_client::session::random_seed();
            let keys = session.random_keys_on(shard, seed, self.limits.samples() as usize)?;
            for key in keys {
                let Some((item, access)) = session.peek_item(&key)? else { continue };
                if !policy.volatile_only() || item.expires_at_ms.is_some() {
                    let score = Access::eviction_score(access, tracking, now_ms);
                    self.offer(shard, Candidate { key, score });
                }
            }
            for _ in 0..POOL_SIZE {
                let Some(best) = self.memnode(shard).pool.lock().pop() else { break };
                let Some((item, access)) = session.peek_item(&best.key)? else { continue };
                if policy.volatile_only() && item.expires_at_ms.is_none() {
                    continue; // persisted since it was sampled
                }
                let score = Access::eviction_score(access, tracking, now_ms);
                if score < best.score && self.offer(shard, Candidate { key: best.key.clone(), score }) {
                    continue; // read since: another candidate is better now
                }
                self.memnode(shard).pool.lock().retain(|c| c.key != best.key);
                // Against the value read: a key rewritten since is not evicted.
                if session.compare_and_swap(&best.key, Some(&item.value), None)? {
                    let expires = item.expires_at_ms.is_some();
                    return Ok(Some(item_heap_bytes(best.key.len(), item.value.len(), expires).unwrap_or(0)));
                }
            }
        }
        Ok(None)
    }

    /// Puts `candidate` in memnode `shard`'s pool (replacing the same key's entry) if the
    /// pool has room or it beats the worst there. Returns whether it is now not the best.
    fn offer(&self, shard: usize, candidate: Candidate) -> bool {
        let mut pool = self.memnode(shard).pool.lock();
        pool.retain(|c| c.key != candidate.key);
        if pool.len() == POOL_SIZE && pool.first().is_some_and(|worst| worst.score >= candidate.score) {
            return true;
        }
        let mut at = pool.partition_point(|c| c.score <= candidate.score);
        pool.insert(at, candidate);
        if pool.len() > POOL_SIZE {
            pool.remove(0); // the worst: the candidate beat it, so it was not at 0
            at -= 1;
        }
        assert!(pool.len() <= POOL_SIZE && pool.is_sorted_by_key(|c| c.score), "the pool keeps its order and size");
        at + 1 < pool.len()
    }
}

fn refresh_loop(cluster: Weak<Cluster>, eviction: Weak<Eviction>) {
    loop {
        let limited = {
            let (Some(cluster), Some(eviction)) = (cluster.upgrade(), eviction.upgrade()) else { return };
            if eviction.stopping.load(Ordering::Acquire) {
                return;
            }
            let limited = eviction.limits.limit().is_set();
            eviction.refresher_idle.store(!limited, Ordering::Relaxed);
            eviction.sync_tracking();
            if limited {
                let mut session = cluster.attach();
                eviction.refresh(&mut session);
            }
            limited
        };
        // No strong reference held while asleep: dropping the last one ends the loop.
        if limited {
            std::thread::park_timeout(REFRESH);
        } else {
            std::thread::park();
        }
    }
}

impl Drop for Eviction {
    /// Without [`Eviction::stop`]: the refresher finds its reference dead when woken, and
    /// returns.
    fn drop(&mut self) {
        self.wake_refresher();
    }
}
