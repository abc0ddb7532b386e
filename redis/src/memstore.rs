//! `MemStore`: a TEST DOUBLE of [`KvStore`], a `Mutex<HashMap>`.
//!
//! It exists only so the protocol layer (parser, commands, server) can be tested without the
//! RACE table; it is compiled for this crate's unit tests and, through the `test-support`
//! feature, for its integration tests and examples. It has none of racekv's properties
//! (no memory nodes, no one-sided operations, one global lock) and must not be deployed.
//!
//! It honours expiry as the storage contract says (`store.rs`): an expired key is absent
//! to every call and is dropped when a call meets it; DBSIZE counts the ones not met yet.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use racekv_telemetry::clock::now_unix_ms;

use super::store::{
    Expiry, ExpiryUpdate, Item, KeyVersion, KvSession, KvStore, PutMode, PutOptions, PutResult, StoreError,
    StoreErrorKind, TxnWrite, SCAN_PAGE_MAX_KEYS,
};

/// A stored value, its expiry (absolute Unix milliseconds) and its version word.
type Entry = (Vec<u8>, Option<u64>, u64);

/// Version words, unique across every store of the process (0 is left for absent keys).
static NEXT_WORD: AtomicU64 = AtomicU64::new(1);

/// An entry holding `value` until `expiry`, with a version word no write had before.
fn entry(value: Vec<u8>, expiry: Option<u64>) -> Entry {
    (value, expiry, NEXT_WORD.fetch_add(1, Ordering::Relaxed))
}

/// In-memory test double of the storage trait. Cloning shares the same map.
#[derive(Clone, Default)]
pub struct MemStore {
    map: Arc<Mutex<HashMap<Vec<u8>, Entry>>>,
    max_value_bytes: Option<usize>,
}

impl MemStore {
    /// An empty store without size limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that refuses values longer than `max_value_bytes`, to exercise the
    /// front end's error mapping the way the RACE table's block size limit will.
    pub fn with_max_value_bytes(max_value_bytes: usize) -> Self {
        Self { max_value_bytes: Some(max_value_bytes), ..Self::default() }
    }

    /// A copy of the live value of `key`, for assertions.
    pub fn peek(&self, key: &[u8]) -> Option<Vec<u8>> {
        live(&mut self.map.lock(), key).map(|(v, _, _)| v.clone())
    }

    /// The expiry of `key` (None: absent, or no expiry), for assertions.
    pub fn peek_expiry(&self, key: &[u8]) -> Option<u64> {
        live(&mut self.map.lock(), key).and_then(|(_, e, _)| *e)
    }
}

/// The entry of `key` if it has not expired; an expired one is dropped (lazy expiry).
fn live<'m>(map: &'m mut HashMap<Vec<u8>, Entry>, key: &[u8]) -> Option<&'m mut Entry> {
    if map.get(key).is_some_and(|(_, e, _)| e.is_some_and(|at| now_unix_ms() > at)) {
        map.remove(key);
    }
    map.get_mut(key)
}

impl KvStore for MemStore {
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
        Ok(Box::new(self.clone()))
    }
}

impl MemStore {
    fn check_value(&self, value: &[u8]) -> Result<(), StoreError> {
        match self.max_value_bytes {
            Some(max) if value.len() > max => {
                Err(StoreError::new(StoreErrorKind::ValueTooLarge, format!("{} bytes, limit {max}", value.len())))
            }
            _ => Ok(()),
        }
    }
}

impl KvSession for MemStore {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(live(&mut self.map.lock(), key).map(|(v, _, _)| v.clone()))
    }

    fn put(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, StoreError> {
        let options = PutOptions { mode, expiry: Expiry::Never, get: false };
        self.put_opts(key, value, options).map(|r| r.applied)
    }

    fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        let mut map = self.map.lock();
        let present = live(&mut map, key).is_some();
        map.remove(key);
        Ok(present)
    }

    fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError> {
        self.check_value(new)?;
        let mut map = self.map.lock();
        let current = live(&mut map, key);
        if current.as_ref().map(|(v, _, _)| v.as_slice()) != expected {
            return Ok(false);
        }
        let expiry = current.and_then(|(_, e, _)| *e);
        map.insert(key.to_vec(), entry(new.to_vec(), expiry));
        Ok(true)
    }

    fn compare_and_delete(&mut self, key: &[u8], expected: &[u8]) -> Result<bool, StoreError> {
        let mut map = self.map.lock();
        if live(&mut map, key).map(|(value, _, _)| value.as_slice()) != Some(expected) {
            return Ok(false);
        }
        map.remove(key);
        Ok(true)
    }

    fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, StoreError> {
        self.check_value(value)?;
        let mut map = self.map.lock();
        let current = live(&mut map, key).cloned();
        let apply = match options.mode {
            PutMode::Upsert => true,
            PutMode::InsertOnly => current.is_none(),
            PutMode::UpdateOnly => current.is_some(),
        };
        if apply {
            let expiry = match options.expiry {
                Expiry::Never => None,
                Expiry::At(at) => Some(at),
                Expiry::Keep => current.as_ref().and_then(|(_, e, _)| *e),
            };
            map.insert(key.to_vec(), entry(value.to_vec(), expiry));
        }
        Ok(PutResult { applied: apply, old: if options.get { current.map(|(v, _, _)| v) } else { None } })
    }

    fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError> {
        Ok(live(&mut self.map.lock(), key).map(|(value, e, _)| Item { value: value.clone(), expires_at_ms: *e }))
    }

    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
        let mut map = self.map.lock();
        let Some((value, expiry, word)) = live(&mut map, key) else { return Ok(None) };
        let before = value.clone();
        let changed = match decide(*expiry) {
            ExpiryUpdate::Unchanged => false,
            ExpiryUpdate::Set(at) => {
                *expiry = at;
                *word = NEXT_WORD.fetch_add(1, Ordering::Relaxed);
                true
            }
            ExpiryUpdate::Delete => {
                map.remove(key);
                true
            }
        };
        Ok(Some((before, changed)))
    }

    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let mut map = self.map.lock();
        Ok(keys.iter().map(|k| live(&mut map, k).map(|(v, _, _)| v.clone())).collect())
    }

    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
        for (_, value) in pairs {
            self.check_value(value)?;
        }
        let mut map = self.map.lock();
        for (key, value) in pairs {
            map.insert(key.to_vec(), entry(value.to_vec(), None));
        }
        Ok(())
    }

    fn len(&mut self) -> Result<u64, StoreError> {
        Ok(self.map.lock().len() as u64)
    }

    fn info(&mut self) -> Result<String, StoreError> {
        Ok("storage_backend:memstore-test-double\n".to_string())
    }

    /// Keys in the order of a fixed hash; the cursor is the hash to resume at (keys of equal
    /// hashes go in one page), so a key present throughout is returned whatever else is
    /// added or removed, as the contract asks.
    fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let map = self.map.lock();
        let mut ahead: Vec<(u64, &Vec<u8>)> =
            map.keys().map(|k| (position(k), k)).filter(|&(h, _)| h >= cursor).collect();
        ahead.sort_unstable();
        let count = count.clamp(1, SCAN_PAGE_MAX_KEYS);
        let mut page = Vec::new();
        for (i, &(h, key)) in ahead.iter().enumerate() {
            if page.len() >= count && h != ahead[i - 1].0 {
                return Ok((h, page));
            }
            page.push(key.clone());
        }
        Ok((0, page))
    }

    fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        let map = self.map.lock();
        if map.is_empty() {
            return Ok(None);
        }
        Ok(map.keys().nth(rand::random_range(0..map.len())).cloned())
    }

    fn flush(&mut self) -> Result<u64, StoreError> {
        let mut map = self.map.lock();
        let n = map.len() as u64;
        map.clear();
        Ok(n)
    }

    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        Ok(match live(&mut self.map.lock(), key) {
            None => (None, KeyVersion::ABSENT),
            Some((value, e, word)) => (
                Some(Item { value: value.clone(), expires_at_ms: *e }),
                KeyVersion { word: *word, content: 0, expires_at_ms: *e },
            ),
        })
    }

    /// Under the one lock: every read still has its version (an expired key reads as
    /// absent, so one that expired since it was read fails its check), then every write.
    fn commit(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> Result<bool, StoreError> {
        for write in writes {
            if let Some(value) = write.value {
                self.check_value(value)?;
            }
        }
        let mut map = self.map.lock();
        for (key, read) in reads {
            let now = live(&mut map, key).map_or(KeyVersion::ABSENT, |(_, e, word)| KeyVersion {
                word: *word,
                content: 0,
                expires_at_ms: *e,
            });
            if now != *read {
                return Ok(false);
            }
        }
        for write in writes {
            match write.value {
                Some(value) => map.insert(write.key.to_vec(), entry(value.to_vec(), write.expires_at_ms)),
                None => map.remove(write.key),
            };
        }
        Ok(true)
    }
}

/// A key's place in [`MemStore`]'s scan order: a hash that is the same in every process
/// (SipHash with fixed keys), never 0 so that 0 can end a walk.
fn position(key: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    key.hash(&mut h);
    h.finish().max(1)
}
