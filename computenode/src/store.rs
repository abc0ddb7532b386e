//! The Redis front end's storage: each client connection attaches a session (pre-initialized
//! virtual connections, so a new connection costs microseconds) and runs its commands on it
//! directly, on the connection's own thread.
//!
//! Expiry is the table's (`racekv_hashing::table`): the expiry time lives in the item's
//! block, expired items are absent to every call, and `update_expiry` is the table's
//! read-then-CAS rewrite.

use std::sync::Arc;

use racekv_client::{ClientError, Session};
use racekv_hashing::layout::item_heap_bytes;
use racekv_hashing::{Expiry as TableExpiry, ExpiryUpdate as TableExpiryUpdate, PutMode as TablePutMode, ScanLimits};

use crate::cluster::{Attached, Cluster, WorkerShards};
use crate::eviction::Eviction;
use crate::get_combiner::GetCombiner;
use crate::store_error::{store_error, write_error};
use racekv_redis::store::{SCAN_PAGE_MAX_BYTES, SCAN_PAGE_MAX_KEYS};
use racekv_redis::{
    Expiry, ExpiryUpdate, Item, KeyAccess, KeyVersion, KvSession, KvStore, PutMode, PutOptions, PutResult, StoreError,
    TxnWrite,
};

/// A key's slot word in its bucket (`MEMORY USAGE` counts it with the block).
const SLOT_BYTES: u64 = 8;

/// Extra INFO lines (the daemon's view: memnodes, workers, connections).
pub type InfoFn = Arc<dyn Fn() -> String + Send + Sync>;

/// The Redis front end's [`KvStore`] over the daemon's cluster: a session per connection.
pub struct ClusterStore {
    cluster: Arc<Cluster>,
    info: InfoFn,
    eviction: Arc<Eviction>,
    gather_gets: Option<Arc<GetCombiner>>,
}

impl ClusterStore {
    /// A store over `cluster`, adding `info`'s lines to INFO, its writes kept under
    /// `maxmemory` by `eviction`.
    pub fn new(cluster: Arc<Cluster>, info: InfoFn, eviction: Arc<Eviction>) -> Self {
        Self { cluster, info, eviction, gather_gets: None }
    }

    /// Reads the connections' pipelined GET runs together ([`GetCombiner`]).
    pub fn gathering_gets(mut self) -> Self {
        self.gather_gets = Some(Arc::new(GetCombiner::default()));
        self
    }
}

impl KvStore for ClusterStore {
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
        Ok(Box::new(RedisSession {
            session: self.cluster.attach(),
            info: Arc::clone(&self.info),
            eviction: Arc::clone(&self.eviction),
            gather_gets: self.gather_gets.clone(),
        }))
    }
}

struct RedisSession {
    session: Attached,
    info: InfoFn,
    eviction: Arc<Eviction>,
    gather_gets: Option<Arc<GetCombiner>>,
}

fn mode(m: PutMode) -> TablePutMode {
    match m {
        PutMode::Upsert => TablePutMode::Upsert,
        PutMode::InsertOnly => TablePutMode::InsertOnly,
        PutMode::UpdateOnly => TablePutMode::UpdateOnly,
    }
}

fn expiry(e: Expiry) -> TableExpiry {
    match e {
        Expiry::Never => TableExpiry::Never,
        Expiry::At(at) => TableExpiry::At(at),
        Expiry::Keep => TableExpiry::Keep,
    }
}

fn expiry_update(u: ExpiryUpdate) -> TableExpiryUpdate {
    match u {
        ExpiryUpdate::Unchanged => TableExpiryUpdate::Unchanged,
        ExpiryUpdate::Set(at) => TableExpiryUpdate::Set(at),
        ExpiryUpdate::Delete => TableExpiryUpdate::Delete,
    }
}

impl RedisSession {
    fn s(&mut self) -> &mut Session<WorkerShards> {
        &mut self.session
    }

    /// Runs `write` of `key` (a new block of `value_len`) in cache mode: room made first,
    /// and once more if the region turns out full.
    fn write<R>(
        &mut self,
        key: &[u8],
        value_len: usize,
        expires: bool,
        write: impl FnMut(&mut Session<WorkerShards>) -> Result<R, ClientError>,
    ) -> Result<R, StoreError> {
        let bytes = item_heap_bytes(key.len(), value_len, expires).unwrap_or(0);
        self.eviction.write(&mut self.session, key, bytes, write).map_err(write_error)
    }
}

impl KvSession for RedisSession {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.s().get(key).map_err(store_error)
    }

    fn put(&mut self, key: &[u8], value: &[u8], m: PutMode) -> Result<bool, StoreError> {
        self.write(key, value.len(), false, |s| s.put_with(key, value, mode(m)))
    }

    fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        self.s().delete(key).map_err(store_error)
    }

    fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError> {
        self.write(key, new.len(), false, |s| s.compare_and_swap(key, expected, Some(new)))
    }

    fn compare_and_delete(&mut self, key: &[u8], expected: &[u8]) -> Result<bool, StoreError> {
        self.s().compare_and_swap(key, Some(expected), None).map_err(store_error)
    }

    /// The value's KV block (header, key, value, padded to 64 B units; for a large value
    /// the block saying where, and the extent holding it) plus its 8 B slot in the index:
    /// what the key costs the memnode.
    fn memory_usage(&mut self, key: &[u8]) -> Result<Option<u64>, StoreError> {
        let Some(item) = self.get_item(key)? else {
            return Ok(None);
        };
        let bytes = item_heap_bytes(key.len(), item.value.len(), item.expires_at_ms.is_some()).unwrap_or(0);
        Ok(Some(bytes + SLOT_BYTES))
    }

    fn put_opts(&mut self, key: &[u8], value: &[u8], o: PutOptions) -> Result<PutResult, StoreError> {
        let options = racekv_hashing::PutOptions { mode: mode(o.mode), expiry: expiry(o.expiry), return_old: o.get };
        let expires = matches!(o.expiry, Expiry::At(_));
        let result = self.write(key, value.len(), expires, |s| s.put_opts(key, value, options))?;
        Ok(PutResult { applied: result.outcome != racekv_hashing::PutOutcome::NotApplied, old: result.old })
    }

    fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError> {
        let item = self.s().get_item(key).map_err(store_error)?;
        Ok(item.map(|i| Item { value: i.value, expires_at_ms: i.expires_at_ms }))
    }

    fn access(&mut self, key: &[u8]) -> Result<Option<Option<KeyAccess>>, StoreError> {
        let Some((_, access)) = self.s().peek_item(key).map_err(store_error)? else { return Ok(None) };
        let (now_ms, decay_minutes) = (racekv_client::now_unix_ms(), self.eviction.limits().lfu_decay_minutes());
        Ok(Some(
            access
                .map(|a| KeyAccess { idle_s: a.idle_s(now_ms), lfu_counter: a.decayed_counter(now_ms, decay_minutes) }),
        ))
    }

    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
        let before = self.s().update_expiry(key, |current| expiry_update(decide(current))).map_err(store_error)?;
        Ok(before.map(|(item, changed)| (item.value, changed)))
    }

    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        match &self.gather_gets {
            Some(combiner) => combiner.get_in_order(&mut self.session, keys),
            None => self.s().get_in_order(keys),
        }
        .map_err(store_error)
    }

    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
        if !self.eviction.limits().limit().is_set() {
            return self.s().multi_put(pairs).map_err(store_error);
        }
        // Cache mode: room made key by key (not atomic either way).
        for &(key, value) in pairs {
            self.write(key, value.len(), false, |s| s.put(key, value))?;
        }
        Ok(())
    }

    /// The memnodes' item counters: every insert and delete adds its +1 or -1 in the batch
    /// of its CAS, before it is acknowledged, and this session's own pending changes are
    /// sent first; so with no write in flight the sum is the number of keys. (Other
    /// sessions' clean-ups of racing duplicate inserts publish when they go idle.)
    fn len(&mut self) -> Result<u64, StoreError> {
        self.s().len().map_err(store_error)
    }

    fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let limits = ScanLimits::new(count.min(SCAN_PAGE_MAX_KEYS), SCAN_PAGE_MAX_KEYS, SCAN_PAGE_MAX_BYTES);
        self.s().scan(cursor, limits).map_err(store_error)
    }

    fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        self.s().random_key(racekv_client::session::random_seed()).map_err(store_error)
    }

    fn flush(&mut self) -> Result<u64, StoreError> {
        self.s().delete_all().map_err(store_error)
    }

    fn info(&mut self) -> Result<String, StoreError> {
        Ok((self.info)())
    }

    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        let (item, v) = self.s().read_versioned(key).map_err(store_error)?;
        let item = item.map(|i| Item { value: i.value, expires_at_ms: i.expires_at_ms });
        Ok((item, KeyVersion { word: v.word, content: v.checksum, expires_at_ms: v.expires_at_ms }))
    }

    /// The table's atomic commit (`racekv_client::txn`). In cache mode, room for the new
    /// items is made first (eviction deletes other keys, never the transaction's own reads:
    /// a read key evicted meanwhile is a change and the commit reports it).
    fn commit(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> Result<bool, StoreError> {
        if self.eviction.limits().limit().is_set() {
            for w in writes {
                if let Some(value) = w.value {
                    let bytes = item_heap_bytes(w.key.len(), value.len(), w.expires_at_ms.is_some()).unwrap_or(0);
                    self.eviction.make_room(&mut self.session, w.key, bytes).map_err(write_error)?;
                }
            }
        }
        let reads: Vec<(&[u8], racekv_client::txn::Version)> = reads
            .iter()
            .map(|&(k, v)| {
                (k, racekv_client::txn::Version { word: v.word, checksum: v.content, expires_at_ms: v.expires_at_ms })
            })
            .collect();
        let writes: Vec<racekv_client::txn::Write<'_>> = writes
            .iter()
            .map(|w| racekv_client::txn::Write { key: w.key, value: w.value, expires_at_ms: w.expires_at_ms })
            .collect();
        self.s().commit(&reads, &writes).map_err(store_error)
    }

    fn idle(&mut self) {
        if let Err(e) = self.s().publish_counts() {
            tracing::debug!("publishing an idle Redis session's item count failed: {e}");
        }
    }
}
