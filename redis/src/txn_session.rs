//! [`TxnSession`]: a [`KvSession`] that runs a transaction's commands optimistically over
//! another session, for EXEC (and nothing else that needs it).
//!
//! Every key the commands read is read from the store once, with its version
//! ([`KvSession::read_versioned`]), and kept: later reads of it see the same item, so the
//! commands see one snapshot (provided the commit succeeds). Writes go into a buffer that
//! later reads of the key see (deletes and expiries included); nothing reaches the store
//! until [`TxnSession::commit`] hands the read set and the buffer to [`KvSession::commit`],
//! which applies them all or, when a read key changed meanwhile, none (EXEC then runs the
//! commands again).
//!
//! What cannot be part of a snapshot goes straight to the inner session, at once and not
//! atomically with the rest: `len` (DBSIZE), `scan` (SCAN, KEYS), `random_key`, `flush`
//! (FLUSHALL) and `info`. They do not see the buffered writes, and a re-run of the
//! transaction runs them again.

use std::collections::BTreeMap;
use std::ops::DerefMut;

use racekv_telemetry::clock::now_unix_ms;

use crate::store::{
    Expiry, ExpiryUpdate, Item, KeyVersion, KvSession, PutMode, PutOptions, PutResult, StoreError, TxnWrite,
};

/// The top bit marks the version words [`TxnSession::read_versioned`] gives a key written in
/// the transaction (the store never sees them).
const BUFFERED_WORD: u64 = 1 << 63;

/// A key's last write in the transaction (None: deleted) and that write's number.
struct Buffered {
    item: Option<Item>,
    seq: u64,
}

/// A transaction's view of a store: reads once, writes into a buffer, then commits.
pub struct TxnSession<S> {
    inner: S,
    /// Each key read from the store: what it held then and its version.
    reads: BTreeMap<Vec<u8>, (Option<Item>, KeyVersion)>,
    /// Each key written: its last write.
    writes: BTreeMap<Vec<u8>, Buffered>,
    /// Writes so far (numbers the buffered versions).
    seq: u64,
}

/// Whether `item` is live at `now_ms` (a key is live through its expiry millisecond).
fn live(item: &Option<Item>, now_ms: u64) -> Option<&Item> {
    item.as_ref().filter(|i| i.expires_at_ms.is_none_or(|at| now_ms <= at))
}

impl<S: DerefMut<Target = dyn KvSession> + Send> TxnSession<S> {
    /// A transaction over `inner` with nothing read or written yet.
    pub fn new(inner: S) -> Self {
        Self { inner, reads: BTreeMap::new(), writes: BTreeMap::new(), seq: 0 }
    }

    /// The inner session back (whatever was buffered is dropped).
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Commits the reads and writes so far with `extra_reads` (WATCHed keys) also checked:
    /// false when one of them changed, and nothing is written. A key in `extra_reads` that
    /// the transaction read with another version fails at once.
    pub fn commit(&mut self, extra_reads: &[(Vec<u8>, KeyVersion)]) -> Result<bool, StoreError> {
        let mut reads: Vec<(&[u8], KeyVersion)> = self.reads.iter().map(|(k, (_, v))| (k.as_slice(), *v)).collect();
        for (key, version) in extra_reads {
            match self.reads.get(key) {
                Some((_, read)) if read != version => return Ok(false),
                Some(_) => {}
                None => reads.push((key, *version)),
            }
        }
        let writes: Vec<TxnWrite<'_>> = self
            .writes
            .iter()
            .map(|(key, b)| TxnWrite {
                key,
                value: b.item.as_ref().map(|i| i.value.as_slice()),
                expires_at_ms: b.item.as_ref().and_then(|i| i.expires_at_ms),
            })
            .collect();
        self.inner.commit(&reads, &writes)
    }

    /// The key as the transaction sees it (its buffered write, else its first read), and
    /// its version as [`KvSession::read_versioned`] reports it here.
    fn current(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        let now = now_unix_ms();
        if let Some(b) = self.writes.get(key) {
            let item = live(&b.item, now).cloned();
            let version = KeyVersion {
                word: BUFFERED_WORD | b.seq,
                content: 0,
                expires_at_ms: item.as_ref().and_then(|i| i.expires_at_ms),
            };
            return Ok((item, version));
        }
        if !self.reads.contains_key(key) {
            let read = self.inner.read_versioned(key)?;
            self.reads.insert(key.to_vec(), read);
        }
        let (item, version) = &self.reads[key];
        Ok((live(item, now).cloned(), *version))
    }

    fn item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError> {
        Ok(self.current(key)?.0)
    }

    fn write(&mut self, key: &[u8], item: Option<Item>) {
        self.seq += 1;
        self.writes.insert(key.to_vec(), Buffered { item, seq: self.seq });
    }
}

impl<S: DerefMut<Target = dyn KvSession> + Send> KvSession for TxnSession<S> {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.item(key)?.map(|i| i.value))
    }

    fn put(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, StoreError> {
        let options = PutOptions { mode, expiry: Expiry::Never, get: false };
        Ok(self.put_opts(key, value, options)?.applied)
    }

    fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        let present = self.item(key)?.is_some();
        if present {
            self.write(key, None);
        }
        Ok(present)
    }

    fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError> {
        let current = self.item(key)?;
        if current.as_ref().map(|i| i.value.as_slice()) != expected {
            return Ok(false);
        }
        let expires_at_ms = current.and_then(|i| i.expires_at_ms);
        self.write(key, Some(Item { value: new.to_vec(), expires_at_ms }));
        Ok(true)
    }

    fn compare_and_delete(&mut self, key: &[u8], expected: &[u8]) -> Result<bool, StoreError> {
        if self.item(key)?.is_none_or(|i| i.value != expected) {
            return Ok(false);
        }
        self.write(key, None);
        Ok(true)
    }

    /// Key and value bytes only: the store's own overhead is not known before the commit.
    fn memory_usage(&mut self, key: &[u8]) -> Result<Option<u64>, StoreError> {
        Ok(self.item(key)?.map(|i| (key.len() + i.value.len()) as u64))
    }

    fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, StoreError> {
        let current = self.item(key)?;
        let applied = match options.mode {
            PutMode::Upsert => true,
            PutMode::InsertOnly => current.is_none(),
            PutMode::UpdateOnly => current.is_some(),
        };
        if applied {
            let expires_at_ms = match options.expiry {
                Expiry::Never => None,
                Expiry::At(at) => Some(at),
                Expiry::Keep => current.as_ref().and_then(|i| i.expires_at_ms),
            };
            self.write(key, Some(Item { value: value.to_vec(), expires_at_ms }));
        }
        let old = if options.get { current.map(|i| i.value) } else { None };
        Ok(PutResult { applied, old })
    }

    fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError> {
        self.item(key)
    }

    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
        let Some(item) = self.item(key)? else { return Ok(None) };
        let changed = match decide(item.expires_at_ms) {
            ExpiryUpdate::Unchanged => false,
            ExpiryUpdate::Set(at) => {
                self.write(key, Some(Item { value: item.value.clone(), expires_at_ms: at }));
                true
            }
            ExpiryUpdate::Delete => {
                self.write(key, None);
                true
            }
        };
        Ok(Some((item.value, changed)))
    }

    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        keys.iter().map(|key| self.get(key)).collect()
    }

    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
        for (key, value) in pairs {
            self.write(key, Some(Item { value: value.to_vec(), expires_at_ms: None }));
        }
        Ok(())
    }

    fn len(&mut self) -> Result<u64, StoreError> {
        self.inner.len()
    }

    fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        self.inner.scan(cursor, count)
    }

    fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.random_key()
    }

    fn flush(&mut self) -> Result<u64, StoreError> {
        self.inner.flush()
    }

    fn info(&mut self) -> Result<String, StoreError> {
        self.inner.info()
    }

    /// The transaction's view of the key; the version is the store's for a key only read,
    /// one of the transaction's own for a key it wrote.
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        self.current(key)
    }

    /// A commit within the transaction (MSET, RENAME, ... queued in it): checks the reads
    /// against the transaction's view and buffers the writes; the store sees them with the
    /// rest at [`TxnSession::commit`].
    fn commit(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> Result<bool, StoreError> {
        for (key, version) in reads {
            if self.current(key)?.1 != *version {
                return Ok(false);
            }
        }
        for w in writes {
            let item = w.value.map(|value| Item { value: value.to_vec(), expires_at_ms: w.expires_at_ms });
            self.write(w.key, item);
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memstore::MemStore;

    fn over(store: &MemStore) -> TxnSession<Box<dyn KvSession>> {
        TxnSession::new(Box::new(store.clone()))
    }

    #[test]
    fn writes_are_buffered_until_commit_and_reads_see_them() {
        let store = MemStore::new();
        store.clone().put(b"a", b"1", PutMode::Upsert).unwrap();
        let mut t = over(&store);
        assert!(t.compare_and_swap(b"a", Some(b"1"), b"2").unwrap());
        assert_eq!(t.get(b"a").unwrap(), Some(b"2".to_vec()));
        assert!(!t.put(b"a", b"x", PutMode::InsertOnly).unwrap());
        assert!(t.delete(b"a").unwrap());
        assert!(!t.delete(b"a").unwrap());
        assert!(t.put(b"a", b"3", PutMode::InsertOnly).unwrap());
        let r = t.put_opts(b"a", b"4", PutOptions { mode: PutMode::UpdateOnly, expiry: Expiry::Keep, get: true });
        assert_eq!(r.unwrap(), PutResult { applied: true, old: Some(b"3".to_vec()) });
        assert_eq!(store.peek(b"a"), Some(b"1".to_vec()), "nothing reaches the store before the commit");
        assert!(t.commit(&[]).unwrap());
        assert_eq!(store.peek(b"a"), Some(b"4".to_vec()));
    }

    #[test]
    fn a_read_key_changed_meanwhile_fails_the_commit_and_writes_nothing() {
        let store = MemStore::new();
        let mut t = over(&store);
        assert_eq!(t.get(b"a").unwrap(), None);
        t.multi_put(&[(b"b", b"1")]).unwrap();
        store.clone().put(b"a", b"other", PutMode::Upsert).unwrap();
        assert_eq!(t.get(b"a").unwrap(), None, "the first read is kept");
        assert!(!t.commit(&[]).unwrap());
        assert_eq!(store.peek(b"b"), None);
    }

    #[test]
    fn buffered_expiries_and_deletes_are_seen() {
        let store = MemStore::new();
        let mut t = over(&store);
        let past = PutOptions { mode: PutMode::Upsert, expiry: Expiry::At(1), get: false };
        assert!(t.put_opts(b"gone", b"v", past).unwrap().applied);
        assert_eq!(t.get(b"gone").unwrap(), None, "written already expired");
        t.put(b"k", b"v", PutMode::Upsert).unwrap();
        let far = now_unix_ms() + 60_000;
        assert_eq!(t.update_expiry(b"k", &mut |_| ExpiryUpdate::Set(Some(far))).unwrap(), Some((b"v".to_vec(), true)));
        assert_eq!(t.get_item(b"k").unwrap().unwrap().expires_at_ms, Some(far));
        assert!(t.compare_and_swap(b"k", Some(b"v"), b"w").unwrap());
        assert_eq!(t.get_item(b"k").unwrap().unwrap().expires_at_ms, Some(far), "a swap keeps the expiry");
        assert_eq!(t.update_expiry(b"k", &mut |_| ExpiryUpdate::Delete).unwrap(), Some((b"w".to_vec(), true)));
        assert_eq!(t.get_in_order(&[b"k", b"gone"]).unwrap(), vec![None, None]);
        assert!(t.commit(&[]).unwrap());
        assert_eq!(store.peek(b"k"), None);
    }

    #[test]
    fn inner_commits_check_against_the_transactions_view() {
        let store = MemStore::new();
        let mut t = over(&store);
        let (item, v) = t.read_versioned(b"a").unwrap();
        assert_eq!(item, None);
        let w = TxnWrite { key: b"a", value: Some(b"1"), expires_at_ms: None };
        assert!(t.commit_inner(&[(b"a", v)], &[w]));
        assert!(!t.commit_inner(&[(b"a", v)], &[w]), "the key was written since");
        assert_eq!(t.get(b"a").unwrap(), Some(b"1".to_vec()));
    }

    impl<S: DerefMut<Target = dyn KvSession> + Send> TxnSession<S> {
        fn commit_inner(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> bool {
            KvSession::commit(self, reads, writes).unwrap()
        }
    }
}
