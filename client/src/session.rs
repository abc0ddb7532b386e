//! A session: one thread's way to run operations on a cluster of memnodes. It routes each
//! key to its memnode (consistent hashing) and runs the table protocol there.
//!
//! Where the per-memnode table clients come from is the [`Shards`] implementation's
//! business: the embedded client opens its own connections; a computenode worker borrows
//! virtual connections from its daemon's pre-initialized pool.

use std::time::Duration;

use racekv_hashing::{ExpiryUpdate, Item, PutMode, PutOptions, PutOutcome, PutResult, TableClient, TableStats};

use crate::error::ClientError;
use crate::expiry::{ExpiryChange, Ttl};
use crate::op::{MemnodeStats, Reply, Request};

/// The memnodes a session can reach.
pub trait Shards: Send {
    /// Which memnode holds `key`.
    fn route(&self, key: &[u8]) -> usize;
    fn count(&self) -> usize;
    /// A name for memnode `shard` in errors.
    fn label(&self, shard: usize) -> &str;
    /// The timeout errors report.
    fn timeout(&self) -> Duration;
    /// The table client for `shard` (implementations may connect or reconnect here).
    fn client(&mut self, shard: usize) -> Result<&mut TableClient, ClientError>;
    /// An operation on `shard` failed in a way a new connection may fix.
    fn on_transient_failure(&mut self, shard: usize) {
        let _ = shard;
    }
}

/// Runs operations over some [`Shards`].
pub struct Session<S: Shards> {
    shards: S,
}

impl<S: Shards> Session<S> {
    pub fn new(shards: S) -> Self {
        Self { shards }
    }

    pub fn shards(&self) -> &S {
        &self.shards
    }

    pub fn shards_mut(&mut self) -> &mut S {
        &mut self.shards
    }

    fn on<R>(
        &mut self,
        shard: usize,
        op: impl FnOnce(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        let result = op(self.shards.client(shard)?);
        result.map_err(|e| {
            let transient = e.is_transient();
            let err = ClientError::from_table(self.shards.label(shard), e, self.shards.timeout());
            if transient {
                self.shards.on_transient_failure(shard);
            }
            err
        })
    }

    fn on_key<R>(
        &mut self,
        key: &[u8],
        op: impl FnOnce(&mut TableClient) -> Result<R, racekv_hashing::Error>,
    ) -> Result<R, ClientError> {
        let shard = self.shards.route(key);
        self.on(shard, op)
    }

    /// The value of `key`, if any.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        self.on_key(key, |c| c.get(key))
    }

    /// Puts the value of `key` into `out`; returns whether it exists (no allocation when
    /// `out` is large enough).
    pub fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> Result<bool, ClientError> {
        self.on_key(key, |c| c.get_into(key, out))
    }

    /// Sets `key` as `mode` allows; returns whether it did.
    pub fn put_with(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, ClientError> {
        self.on_key(key, |c| c.put_with(key, value, mode)).map(|o| o != PutOutcome::NotApplied)
    }

    /// Sets `key` to `value`, replacing any previous value.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), ClientError> {
        self.put_with(key, value, PutMode::Upsert).map(|_| ())
    }

    /// Sets `key` to `value` as `options` say (mode, expiry, the old value back).
    pub fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, ClientError> {
        self.on_key(key, |c| c.put_opts(key, value, options))
    }

    /// The value and expiry of `key`, if it exists.
    pub fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, ClientError> {
        self.on_key(key, |c| c.get_item(key))
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
        decide: impl FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Item, bool)>, ClientError> {
        self.on_key(key, |c| c.update_expiry(key, decide))
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
        self.on_key(key, |c| c.delete(key))
    }

    /// Sets `key` to `new` (None removes it) if its value is `expected` (None: absent).
    pub fn compare_and_swap(
        &mut self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        self.on_key(key, |c| c.compare_and_swap(key, expected, new))
    }

    /// Values of many keys; each memnode's share goes out in batches.
    pub fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        let mut out = vec![None; keys.len()];
        for (shard, indices) in self.group(keys.iter().copied()) {
            let subset: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
            let values = self.on(shard, |c| c.get_many(&subset))?;
            for (i, v) in indices.into_iter().zip(values) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// Values of `keys` as consecutive [`Session::get`]s would return them: each key is read
    /// after every key before it (see `TableClient::get_many_in_order`); consecutive keys of
    /// one memnode travel together.
    pub fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut start = 0;
        while start < keys.len() {
            let shard = self.shards.route(keys[start]);
            let end = (start + 1..keys.len()).find(|&i| self.shards.route(keys[i]) != shard).unwrap_or(keys.len());
            out.extend(self.on(shard, |c| c.get_many_in_order(&keys[start..end]))?);
            start = end;
        }
        Ok(out)
    }

    /// Sets many keys (not atomic across keys: a failure leaves the earlier ones set).
    pub fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        for (shard, indices) in self.group(pairs.iter().map(|(k, _)| *k)) {
            self.on(shard, |c| {
                for &i in &indices {
                    c.put(pairs[i].0, pairs[i].1)?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Each memnode's statistics (this session's pending item counts sent first).
    pub fn stats(&mut self) -> Vec<(String, Result<TableStats, ClientError>)> {
        (0..self.shards.count()).map(|s| (self.shards.label(s).to_string(), self.on(s, |c| c.table_stats()))).collect()
    }

    /// Keys on all memnodes.
    pub fn len(&mut self) -> Result<u64, ClientError> {
        self.stats().into_iter().map(|(_, s)| s.map(|s| s.items)).sum()
    }

    /// Whether [`Session::len`] is zero.
    pub fn is_empty(&mut self) -> Result<bool, ClientError> {
        self.len().map(|n| n == 0)
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
        for s in 0..self.shards.count() {
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

    fn group<'a>(&self, keys: impl Iterator<Item = &'a [u8]>) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let shard = self.shards.route(key);
            match groups.iter_mut().find(|(s, _)| *s == shard) {
                Some((_, v)) => v.push(i),
                None => groups.push((shard, vec![i])),
            }
        }
        groups
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
        };
        result.unwrap_or_else(|e| Reply::from_error(&e))
    }
}
