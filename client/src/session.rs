//! A session: one thread's way to run operations on a cluster of memnodes. It routes each
//! key to its memnode (consistent hashing) and runs the table protocol there.
//!
//! Where the per-memnode table clients come from is the [`Shards`] implementation's
//! business: the embedded client opens its own connections; a computenode worker borrows
//! virtual connections from its daemon's pre-initialized pool.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use racekv_hashing::scan::TABLE_CURSOR_BITS;
use racekv_hashing::{
    ExpiryUpdate, Item, PutMode, PutOptions, PutOutcome, PutResult, ScanLimits, TableClient, TableCursor, TableStats,
};
use racekv_transport::overlap;

use crate::error::ClientError;
use crate::expiry::{ExpiryChange, Ttl};
use crate::map_fence::MapChange;
use crate::op::{MemnodeStats, Reply, Request, MAX_MULTI};
use crate::optimistic::{Version, Write};

/// Bits of a session's scan cursor above the table cursor: which memnode, in the order of
/// their node ids.
pub const MEMNODE_CURSOR_BITS: u32 = 64 - TABLE_CURSOR_BITS;
/// Memnodes a scan cursor can name.
pub const MAX_SCAN_MEMNODES: usize = 1 << MEMNODE_CURSOR_BITS;

/// Times one operation resolves an expired transaction's lock and runs again before its
/// error is returned (each resolution settles one lock for good).
const MAX_LOCK_RESOLUTIONS: u32 = 8;

pub use crate::seed::random_seed;

/// The memnodes a session can reach.
pub trait Shards: Send {
    /// Which memnode holds `key`.
    fn route(&self, key: &[u8]) -> usize;
    /// The memnodes that hold copies of `key` besides [`Shards::route`]'s (its partition's
    /// other replicas; none on a ring or at R = 1). Writes go to all of them.
    fn backups(&self, key: &[u8]) -> &[u16] {
        let _ = key;
        &[]
    }
    /// Whether writes of `key` go through its primary's lock, as one-key transactions
    /// (`replicated.rs`), rather than as plain upserts on the primary: whenever it has
    /// backups, and wherever a memnode may join its partition (see
    /// `PartitionTable::locks_writes`).
    fn locks_writes(&self, key: &[u8]) -> bool {
        !self.backups(key).is_empty()
    }
    /// Whether those writes go by the snapshot protocol (`snapshot_write.rs`) rather than
    /// as one-key transactions: only once every process of the cluster reads its marks.
    fn snapshot_writes(&self) -> bool {
        false
    }
    /// The share of memnode `shard`'s items that counting keys counts, (numerator,
    /// denominator): all of them but with replicas (each key is on several memnodes).
    fn item_share(&self, shard: usize) -> (u64, u64) {
        let _ = shard;
        (1, 1)
    }
    /// Whether memnode `shard` holds any partition (false once failed over: its
    /// transaction records no longer decide anything; see [`Session::resolve_lock`]).
    fn serves(&self, shard: usize) -> bool {
        let _ = shard;
        true
    }
    /// How many memnodes there are (shards are `0..count`).
    fn count(&self) -> usize;
    /// A name for memnode `shard` in errors.
    fn label(&self, shard: usize) -> &str;
    /// Memnode `shard`'s persistent node id (scans visit memnodes in the order of their ids,
    /// so a cursor means the same to every session of the same memnodes).
    fn node_id(&self, shard: usize) -> u64;
    /// The timeout errors report.
    fn timeout(&self) -> Duration;
    /// The table client for `shard` (implementations may connect or reconnect here).
    fn client(&mut self, shard: usize) -> Result<&mut TableClient, ClientError>;
    /// The table clients of `shards` (distinct), in that order, for operations that run on
    /// several memnodes at once ([`Session::on_all`]).
    fn clients(&mut self, shards: &[usize]) -> Result<Vec<&mut TableClient>, ClientError>;
    /// An operation on `shard` failed in a way a new connection may fix.
    fn on_transient_failure(&mut self, shard: usize) {
        let _ = shard;
    }
    /// Routes by the newest cluster map this side has from now on (called before an
    /// operation routes its keys; no-op on a fixed ring).
    fn refresh_routing(&mut self) {}
    /// When a memnode reported serving a newer map than the one routed by, or being
    /// fenced (`map_fence`). None on a fixed ring.
    fn map_changed(&self) -> Option<MapChange> {
        None
    }
    /// When the map routed by has outlived its lease unconfirmed by etcd: (since when, the
    /// lease) (`Router::unconfirmed`). None on a fixed ring.
    fn map_unconfirmed(&self) -> Option<(Duration, Duration)> {
        None
    }
    /// Waits (bounded by the timeout) for a map at least as new as `epoch` and routes by
    /// it. False when none came.
    fn await_map(&mut self, epoch: u64) -> bool {
        let _ = epoch;
        false
    }
}

/// Neighbouring keys RANDOMKEY samples on a memnode with replicas (it keeps those the
/// memnode is primary of).
const RANDOM_KEY_SAMPLE: usize = 16;

/// Most times one operation routes again after memnodes reported newer maps.
const MAX_MAP_REFRESHES: u32 = 8;

/// Whether an operation may run again when the keys it reached moved ([`Session::under_map`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Redo {
    /// It may: reads, and writes whose second run gives the same result.
    Yes,
    /// It may not (a transaction's commit): the caller hears of the move.
    No,
}

/// The items of `items` at `indices` (distinct, in range), in that order: several table
/// clients borrowed at once ([`Shards::clients`]).
pub fn pick_mut<'a, T>(items: &'a mut [T], indices: &[usize]) -> Vec<&'a mut T> {
    let mut slots: Vec<Option<&'a mut T>> = items.iter_mut().map(Some).collect();
    indices.iter().map(|&i| slots[i].take().expect("distinct indices in range")).collect()
}

/// Runs operations over some [`Shards`].
pub struct Session<S: Shards> {
    shards: S,
}

impl<S: Shards> Session<S> {
    /// A session over `shards`.
    pub fn new(shards: S) -> Self {
        Self { shards }
    }

    /// The memnodes it runs on.
    pub fn shards(&self) -> &S {
        &self.shards
    }

    /// The memnodes it runs on, to reconnect or reconfigure them.
    pub fn shards_mut(&mut self) -> &mut S {
        &mut self.shards
    }

    /// Runs `op` on memnode `shard`. A key held by a transaction past its lease is resolved
    /// here (this layer reaches the record's memnode; `racekv_hashing::table::txn`), and `op`
    /// runs again.
    pub(crate) fn on<R>(
        &mut self,
        shard: usize,
        mut op: impl FnMut(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        let mut resolved = 0;
        loop {
            let result = op(self.shards.client(shard)?);
            match result {
                Err(racekv_hashing::Error::Locked { key, word, mark }) if resolved < MAX_LOCK_RESOLUTIONS => {
                    resolved += 1;
                    self.resolve_lock(shard, &key, word, &mark)?;
                }
                result => return result.map_err(|e| self.table_error(shard, e)),
            }
        }
    }

    /// Runs `op` on each of `shards` (distinct; `op` gets the client and the shard's place in
    /// `shards`), their round trips overlapping ([`overlap::run_all`]). Each shard's result
    /// is what [`Self::on`] would give: a lock past its lease is resolved, and that shard's
    /// `op` runs again, alone.
    pub(crate) fn on_all<R>(
        &mut self,
        shards: &[usize],
        op: impl AsyncFn(&mut TableClient, usize) -> Result<R, racekv_hashing::Error>,
    ) -> Result<Vec<Result<R, ClientError>>, ClientError> {
        type Running<'a, R> = Pin<Box<dyn Future<Output = Result<R, racekv_hashing::Error>> + 'a>>;
        let results = {
            let clients = self.shards.clients(shards)?;
            let mut running: Vec<Running<'_, R>> =
                clients.into_iter().enumerate().map(|(i, c)| Box::pin(op(c, i)) as Running<'_, R>).collect();
            overlap::run_all(&mut running)
        };
        let mut outcomes = Vec::with_capacity(shards.len());
        for (i, (result, &shard)) in results.into_iter().zip(shards).enumerate() {
            outcomes.push(match result {
                Err(racekv_hashing::Error::Locked { key, word, mark }) => self
                    .resolve_lock(shard, &key, word, &mark)
                    .and_then(|()| self.on(shard, |c| overlap::block_on(op(c, i)))),
                result => result.map_err(|e| self.table_error(shard, e)),
            });
        }
        Ok(outcomes)
    }

    /// The client error for table error `e` on `shard` (a transient one also tells the shards).
    pub(crate) fn table_error(&mut self, shard: usize, e: racekv_hashing::Error) -> ClientError {
        let transient = e.is_transient();
        let err = ClientError::from_table(self.shards.label(shard), e, self.shards.timeout());
        if transient {
            self.shards.on_transient_failure(shard);
        }
        err
    }

    /// The shard whose memnode has node id `node_id`.
    pub(crate) fn shard_of_node(&self, node_id: u64) -> Option<usize> {
        (0..self.shards.count()).find(|&s| self.shards.node_id(s) == node_id)
    }

    /// Which memnode holds `key`.
    pub(crate) fn route(&self, key: &[u8]) -> usize {
        self.shards.route(key)
    }

    /// Runs read `op` on `key`'s memnode (running it twice changes nothing). A connection
    /// found lost (its memnode restarted since this session last used it) is replaced and
    /// the read runs once more, so one stale connection does not fail a reader.
    fn read_key<R>(
        &mut self,
        key: &[u8],
        mut op: impl FnMut(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        match self.on_key(key, &mut op) {
            Err(ClientError::Unavailable { .. }) => self.on_key(key, op),
            result => result,
        }
    }

    pub(crate) fn on_key<R>(
        &mut self,
        key: &[u8],
        mut op: impl FnMut(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        self.under_map(std::iter::once(key), Redo::Yes, |s| {
            let shard = s.shards.route(key);
            s.on(shard, &mut op)
        })
    }

    /// Runs `op`, which routes `keys`, by one cluster map (the newest this side has). When
    /// a memnode it reached served a newer map (`map_fence`), waits for that map: the result
    /// stands if the map still routes every key where `op` found it; otherwise `op` runs
    /// again by the new map (`Redo::Yes`, for operations that may run twice) or the caller
    /// learns it may have been applied where the keys no longer live (`ClientError::MapChanged`).
    pub(crate) fn under_map<'k, R>(
        &mut self,
        keys: impl Iterator<Item = &'k [u8]> + Clone,
        redo: Redo,
        mut op: impl FnMut(&mut Self) -> Result<R, ClientError>,
    ) -> Result<R, ClientError> {
        self.shards.refresh_routing();
        if let Some((since, lease)) = self.shards.map_unconfirmed() {
            return Err(ClientError::MapUnconfirmed { since, lease });
        }
        let mut refreshes = 0;
        loop {
            let result = op(self);
            let Some(MapChange { routed, current, fenced }) = self.shards.map_changed() else { return result };
            // Where `op` went (routing changes only in refresh_routing and await_map); the
            // keys are walked only here, so the common case allocates nothing.
            let went: Vec<usize> = keys.clone().map(|k| self.shards.route(k)).collect();
            let endpoint = went.first().map_or(String::new(), |&s| self.shards.label(s).to_string());
            let moved = ClientError::MapChanged { endpoint, routed, current, fenced };
            if refreshes == MAX_MAP_REFRESHES || !self.shards.await_map(current) {
                return Err(moved);
            }
            // A fenced memnode's answer stands by no map, even one that still routes there.
            if !fenced && keys.clone().zip(&went).all(|(k, &shard)| self.shards.route(k) == shard) {
                return result;
            }
            if redo == Redo::No {
                return Err(moved);
            }
            refreshes += 1;
        }
    }

    /// The value of `key`, if any.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.read_key(key, |c| c.get(key))
    }

    /// Puts the value of `key` into `out`; returns whether it exists (no allocation when
    /// `out` is large enough).
    pub fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, ClientError> {
        self.read_key(key, |c| c.get_into(key, out))
    }

    /// Sets `key` as `mode` allows; returns whether it did.
    pub fn put_with(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, ClientError> {
        if self.replicated(key) {
            let options = PutOptions { mode, ..PutOptions::default() };
            return self.put_replicated(key, value, options).map(|r| r.outcome != PutOutcome::NotApplied);
        }
        self.write_unreplicated(key, |c| c.put_with(key, value, mode)).map(|o| o != PutOutcome::NotApplied)
    }

    /// Sets `key` to `value`, replacing any previous value.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.put_with(key, value, PutMode::Upsert).map(|_| ())
    }

    /// Sets `key` to `value` as `options` say (mode, expiry, the old value back).
    pub fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, ClientError> {
        if self.replicated(key) {
            return self.put_replicated(key, value, options);
        }
        self.write_unreplicated(key, |c| c.put_opts(key, value, options))
    }

    /// The value and expiry of `key`, if it exists.
    pub fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, ClientError> {
        self.read_key(key, |c| c.get_item(key))
    }

    /// The value, expiry and access word of `key` (`TableClient::peek_item`), read without
    /// recording the read: cache mode's eviction samples keys this way.
    pub fn peek_item(
        &mut self,
        key: &[u8],
    ) -> Result<Option<(Item, Option<racekv_hashing::access::Access>)>, ClientError> {
        self.on_key(key, |c| c.peek_item(key))
    }

    /// What `key`'s expiry is.
    pub fn ttl(&mut self, key: &[u8]) -> Result<Ttl, ClientError> {
        self.get_item(key).map(|item| Ttl::of(item.as_ref()))
    }

    /// Changes `key`'s expiry as `decide` says given its current one (see
    /// `TableClient::update_expiry`): the item as it was, and whether it changed; None
    /// for an absent key.
    pub fn update_expiry(
        &mut self,
        key: &[u8],
        mut decide: impl FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Item, bool)>, ClientError> {
        if self.replicated(key) {
            return self.update_expiry_replicated(key, &mut decide);
        }
        self.write_unreplicated(key, |c| c.update_expiry(key, &mut decide))
    }

    /// Applies `change` to `key`'s expiry (judged by this host's clock); returns whether it
    /// applied (false: no such key, or its condition did not hold).
    pub fn expire(&mut self, key: &[u8], change: ExpiryChange) -> Result<bool, ClientError> {
        let now = racekv_hashing::clock::now_unix_ms();
        let changed = self.update_expiry(key, |current| change.decide(current, now))?;
        Ok(changed.is_some_and(|(_, changed)| changed))
    }

    /// Removes `key`; returns whether it had a value.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, ClientError> {
        if self.replicated(key) {
            return self.delete_replicated(key);
        }
        self.write_unreplicated(key, |c| c.delete(key))
    }

    /// Sets `key` to `new` (None removes it) if its value is `expected` (None: absent).
    pub fn compare_and_swap(
        &mut self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        if self.replicated(key) {
            return self.compare_and_swap_replicated(key, expected, new);
        }
        self.write_unreplicated(key, |c| c.compare_and_swap(key, expected, new))
    }

    /// Values of many keys; each memnode's share goes out in batches.
    pub fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        self.under_map(keys.iter().copied(), Redo::Yes, |s| {
            let mut out = vec![None; keys.len()];
            for (shard, indices) in s.group(keys.iter().copied()) {
                let subset: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                let values = s.on(shard, |c| c.get_many(&subset))?;
                for (i, v) in indices.into_iter().zip(values) {
                    out[i] = v;
                }
            }
            Ok(out)
        })
    }

    /// Sets many keys (not atomic across keys: a failure leaves the earlier ones set).
    pub fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        if pairs.iter().any(|(k, _)| self.replicated(k)) {
            return pairs.iter().try_for_each(|(k, v)| self.put(k, v));
        }
        let keys = pairs.iter().map(|(k, _)| *k);
        self.under_map(keys.clone(), Redo::Yes, |s| {
            for (shard, indices) in s.group(keys.clone()) {
                s.on(shard, |c| {
                    for &i in &indices {
                        c.put(pairs[i].0, pairs[i].1)?;
                    }
                    Ok(())
                })?;
            }
            Ok(())
        })?;
        // As `write_unreplicated`, for each key.
        keys.into_iter().try_for_each(|k| if self.replicated(k) { self.sync_key(k) } else { Ok(()) })
    }

    /// A write of `key` on its primary alone, a plain one (the map's R is 1). When the map it
    /// finished under gives the key other replicas (R raised, a memnode joining its
    /// partition, `catchup.rs`), the key is copied to them before the write is
    /// acknowledged (a writer failing between the two leaves the joiner without it).
    fn write_unreplicated<R>(
        &mut self,
        key: &[u8],
        op: impl FnMut(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        let result = self.on_key(key, op)?;
        if self.replicated(key) {
            self.sync_key(key)?;
        }
        Ok(result)
    }

    /// Each memnode's statistics (this session's pending item counts sent first).
    pub fn stats(&mut self) -> Vec<(String, Result<TableStats, ClientError>)> {
        (0..self.shards.count()).map(|s| (self.shards.label(s).to_string(), self.on(s, |c| c.table_stats()))).collect()
    }

    /// Keys on all memnodes (each counted once: with replicas, each memnode's items
    /// weighted by [`Shards::item_share`]).
    pub fn len(&mut self) -> Result<u64, ClientError> {
        let mut items = Vec::with_capacity(self.shards.count());
        // A memnode that counts for nothing (holding no partition: failed over, or gone
        // from the map and perhaps stopped) is not asked.
        self.shards.refresh_routing();
        let counted: Vec<usize> = (0..self.shards.count()).filter(|&s| self.shards.item_share(s).0 > 0).collect();
        for shard in counted {
            items.push((shard, self.on(shard, |c| c.table_stats())?.items));
        }
        Ok(self.weighted(items))
    }

    /// The keys `items` (per shard) stand for, each memnode's weighted by its item share.
    fn weighted(&self, items: Vec<(usize, u64)>) -> u64 {
        let keys: u128 = items
            .into_iter()
            .map(|(shard, n)| {
                let (num, den) = self.shards.item_share(shard);
                u128::from(n) * u128::from(num) * 1_000_000 / u128::from(den.max(1))
            })
            .sum();
        u64::try_from(keys.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    /// Whether [`Session::len`] is zero.
    pub fn is_empty(&mut self) -> Result<bool, ClientError> {
        self.len().map(|n| n == 0)
    }

    /// About `limits.count` keys from `cursor` on (0 starts a walk), and where the next call
    /// starts (0: the walk is over). A key present from a walk's first call to its last is
    /// returned at least once, however the tables split meanwhile (`racekv_hashing::scan`);
    /// some may come twice. The cursor is `memnode << 55 | table cursor`, memnodes in the
    /// order of their node ids (this process's memnodes; one holding no partition, failed
    /// over or removed from the map, is passed over without asking it). A cursor naming no
    /// memnode ends the walk. Each page holds keys of one memnode. Limit: the guarantee
    /// holds while no partition moves; a walk overlapping a failover, a rejoin's primary
    /// change or a move (`racekv cluster add-memnode`/`remove-memnode`, which also shifts
    /// this order when a memnode is added) may miss or repeat keys that moved.
    pub fn scan(&mut self, cursor: u64, limits: ScanLimits) -> Result<(u64, Vec<Vec<u8>>), ClientError> {
        let order = self.scan_order()?;
        let mut memnode = (cursor >> TABLE_CURSOR_BITS) as usize;
        let mut table_cursor = TableCursor::decode(cursor);
        let started = Instant::now();
        while memnode < order.len() {
            if !self.shards.serves(order[memnode]) {
                memnode += 1;
                table_cursor = TableCursor::START;
                continue;
            }
            let mut page = self.on(order[memnode], |c| c.scan(table_cursor, limits))?;
            if self.shards.item_share(order[memnode]) != (1, 1) {
                // Each key once: from its primary, not from its copies on other replicas.
                page.keys.retain(|key| self.shards.route(key) == order[memnode]);
            }
            if let Some(next) = page.next {
                let encoded = (memnode as u64) << TABLE_CURSOR_BITS | next.encode();
                if encoded == 0 {
                    // A first step that met a split returns the cursor unmoved, and cursor 0
                    // would end the walk: try again until the split is done.
                    assert!(page.keys.is_empty(), "keys returned without moving the cursor");
                    if started.elapsed() >= self.shards.timeout() {
                        let endpoint = self.shards.label(order[memnode]).to_string();
                        return Err(ClientError::Timeout { endpoint, after: self.shards.timeout() });
                    }
                    continue;
                }
                return Ok((encoded, page.keys));
            }
            memnode += 1;
            table_cursor = TableCursor::START;
            // Pages stay within one memnode, so their limits hold as they are.
            if !page.keys.is_empty() {
                let next = if memnode < order.len() { (memnode as u64) << TABLE_CURSOR_BITS } else { 0 };
                return Ok((next, page.keys));
            }
        }
        Ok((0, Vec::new()))
    }

    /// Shard indices in the order of their node ids.
    fn scan_order(&self) -> Result<Vec<usize>, ClientError> {
        let mut order: Vec<usize> = (0..self.shards.count()).collect();
        if order.len() > MAX_SCAN_MEMNODES {
            return Err(ClientError::Config(format!(
                "a scan cursor names at most {MAX_SCAN_MEMNODES} memnodes, not {}",
                order.len()
            )));
        }
        order.sort_by_key(|&s| self.shards.node_id(s));
        Ok(order)
    }

    /// Up to `most` neighbouring keys of memnode `shard`'s table, from a point `seed` picks
    /// (`TableClient::random_keys`): cache mode's eviction samples.
    pub fn random_keys_on(&mut self, shard: usize, seed: u64, most: usize) -> Result<Vec<Vec<u8>>, ClientError> {
        self.on(shard, |c| c.random_keys(seed, most))
    }

    /// A key picked at random (None when there are none): a memnode in proportion to its
    /// item count (with replicas, the share of them it is primary of), then a key of its
    /// table (`TableClient::random_key`; with replicas, one of those it is primary of, so a
    /// failed-over memnode's stale keys never come up); one at random from `seed`.
    pub fn random_key(&mut self, seed: u64) -> Result<Option<Vec<u8>>, ClientError> {
        let mut items = Vec::with_capacity(self.shards.count());
        for s in 0..self.shards.count() {
            let n = self.on(s, |c| c.table_stats())?.items;
            let (num, den) = self.shards.item_share(s);
            items.push(u64::try_from(u128::from(n) * u128::from(num) / u128::from(den.max(1))).unwrap_or(u64::MAX));
        }
        let total: u64 = items.iter().sum();
        let mut first = (seed as usize) % items.len().max(1);
        if total > 0 {
            let mut pick = seed % total;
            for (shard, &n) in items.iter().enumerate() {
                if pick < n {
                    first = shard;
                    break;
                }
                pick -= n;
            }
        }
        // Counts trail writes in flight: a memnode that turns out empty passes to the next.
        for i in 0..self.shards.count() {
            let shard = (first + i) % self.shards.count();
            let key = match self.shards.item_share(shard) {
                (1, 1) => self.on(shard, |c| c.random_key(seed.rotate_left(17)))?,
                (0, _) => None,
                _ => {
                    let mut keys = self.on(shard, |c| c.random_keys(seed.rotate_left(17), RANDOM_KEY_SAMPLE))?;
                    keys.retain(|key| self.shards.route(key) == shard);
                    let pick = (seed >> 40) as usize % keys.len().max(1);
                    (pick < keys.len()).then(|| keys.swap_remove(pick))
                }
            };
            if key.is_some() {
                return Ok(key);
            }
        }
        Ok(None)
    }

    /// Deletes every key on every memnode; returns how many it removed. Not atomic: a key
    /// written meanwhile may survive (`TableClient::delete_all`).
    pub fn delete_all(&mut self) -> Result<u64, ClientError> {
        let mut removed = Vec::with_capacity(self.shards.count());
        // A memnode holding nothing counts for nothing (and may be gone); its stale copies
        // go when it joins partitions again (`catchup.rs`).
        let serving: Vec<usize> = (0..self.shards.count()).filter(|&s| self.shards.serves(s)).collect();
        for s in serving {
            removed.push((s, self.on(s, |c| c.delete_all())?));
        }
        Ok(self.weighted(removed))
    }

    /// Publishes pending item-count changes (a round trip per memnode that has one, nothing
    /// otherwise): for sessions going idle, so counts do not wait for their next operation.
    pub fn publish_counts(&mut self) -> Result<(), ClientError> {
        for s in 0..self.shards.count() {
            self.on(s, |c| c.publish_count())?;
        }
        Ok(())
    }

    /// Gets ready to write without waiting: a heap chunk from every memnode now (one RPC
    /// each, none for a memnode whose chunk is already in hand), so no first write pays
    /// for an allocation RPC.
    pub fn prepare(&mut self) -> Result<(), ClientError> {
        let serving: Vec<usize> = (0..self.shards.count()).filter(|&s| self.shards.serves(s)).collect();
        for s in serving {
            self.on(s, |c| c.prepare())?;
        }
        Ok(())
    }

    /// Sends pending item-count changes.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        for s in 0..self.shards.count() {
            self.on(s, |c| c.flush())?;
        }
        Ok(())
    }

    pub(crate) fn group<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> Vec<(usize, Vec<usize>)> {
        group_routes(keys.map(|key| self.shards.route(key)))
    }

    /// Runs an encoded request (from a ring or a socket) and says how it went.
    pub fn execute(&mut self, request: &Request) -> Reply {
        let result = match request {
            Request::Get(key) => self.get(key).map(Reply::Value),
            Request::Put { key, value, mode } => self.put_with(key, value, *mode).map(Reply::Done),
            Request::Delete(key) => self.delete(key).map(Reply::Done),
            Request::CompareAndSwap { key, expected, new } => {
                self.compare_and_swap(key, expected.as_deref(), new.as_deref()).map(Reply::Done)
            }
            Request::MultiGet(keys) => {
                let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                self.multi_get(&keys).map(Reply::Values)
            }
            Request::MultiPut(pairs) => {
                let pairs: Vec<(&[u8], &[u8])> = pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
                self.multi_put(&pairs).map(|()| Reply::Ok)
            }
            Request::Len => self.len().map(Reply::Count),
            Request::PutOpts { key, value, options } => self.put_opts(key, value, *options).map(Reply::Put),
            Request::GetItem(key) => self.get_item(key).map(Reply::Item),
            Request::Expire { key, change } => self.expire(key, *change).map(Reply::Done),
            Request::Stats => Ok(Reply::Stats(
                self.stats()
                    .into_iter()
                    .map(|(endpoint, stats)| MemnodeStats {
                        endpoint,
                        stats: stats.map_err(|e| match Reply::from_error(&e) {
                            Reply::Error(kind, message) => (kind, message),
                            _ => unreachable!("from_error gives an error reply"),
                        }),
                    })
                    .collect(),
            )),
            Request::Scan { cursor, count, max_bytes } => {
                let max_bytes = (*max_bytes).min(crate::op::MAX_SCAN_REPLY_BYTES) as usize;
                let limits = ScanLimits::new(*count as usize, MAX_MULTI, max_bytes);
                self.scan(*cursor, limits).map(|(cursor, keys)| Reply::Keys { cursor, keys })
            }
            Request::RandomKey => self.random_key(random_seed()).map(Reply::Value),
            Request::DeleteAll => self.delete_all().map(Reply::Count),
            Request::ReadVersioned(key) => {
                self.read_versioned(key).map(|(item, version)| Reply::Versioned { item, version })
            }
            Request::Commit { reads, writes } => {
                let reads: Vec<(&[u8], Version)> = reads.iter().map(|(k, v)| (k.as_slice(), *v)).collect();
                let writes: Vec<Write<'_>> = writes
                    .iter()
                    .map(|(key, value, expires_at_ms)| Write {
                        key,
                        value: value.as_deref(),
                        expires_at_ms: *expires_at_ms,
                    })
                    .collect();
                self.commit(&reads, &writes).map(Reply::Done)
            }
            // Transfers are the front end's business: it assembles a request before it runs.
            Request::Part { .. } | Request::FetchPart { .. } => {
                Err(ClientError::Protocol("a request in parts reached a session unassembled".into()))
            }
        };
        result.unwrap_or_else(|e| Reply::from_error(&e))
    }
}

/// Indices of keys by memnode (`routes`: each key's memnode), memnodes in first-seen order.
pub(crate) fn group_routes(routes: impl Iterator<Item = usize>) -> Vec<(usize, Vec<usize>)> {
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, shard) in routes.enumerate() {
        match groups.iter_mut().find(|(s, _)| *s == shard) {
            Some((_, v)) => v.push(i),
            None => groups.push((shard, vec![i])),
        }
    }
    groups
}
