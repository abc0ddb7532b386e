//! The request channel of the attached and remote modes: one `op.rs` request to a
//! computenode and its reply ([`Channel`]), and the library's requests written once on top
//! of it. What differs between the modes (ring slots and pipelining; RPCs and chunking)
//! stays in `attached.rs` and `remote.rs`, behind the trait.

use std::path::Path;

use racekv_hashing::{Item, PutMode, PutOptions, PutResult};

use crate::error::ClientError;
use crate::expiry::ExpiryChange;
use crate::op::{
    ErrorKind, MemnodeStats, Reply, Request, MAX_KEY_BYTES, MAX_MULTI, MAX_REQUEST_BYTES, MAX_SCAN_REPLY_BYTES,
    MAX_VALUE_BYTES,
};
use crate::optimistic::{last_write_per_key, Coordinator, Version, Write, MAX_TXN_WRITES};
use crate::parts::{check_item, too_large};
use crate::Mode;

/// Takes each reply of [`Channel::call_many`], with the batch items it answers.
pub(crate) type Take<'a> = dyn FnMut(&[usize], Reply) -> Result<(), ClientError> + 'a;

/// A computenode that answers requests.
pub(crate) trait Channel: Send + Sync {
    /// Attached or remote.
    fn mode(&self) -> Mode;

    /// Names the computenode in errors and stats (`attach:/path`, `tcp:host:port`).
    fn label(&self) -> &str;

    /// One request and its reply (in parts when either outgrows one message).
    fn call(&self, request: &Request) -> Result<Reply, ClientError>;

    /// A batch's items, in requests that fit the channel; each reply goes to `take` with
    /// the items it answers. The first error wins.
    fn call_many(&self, batch: &Batch<'_>, take: &mut Take<'_>) -> Result<(), ClientError>;

    /// The error an error reply stands for.
    fn error_reply(&self, kind: ErrorKind, message: String) -> ClientError {
        Reply::into_error(kind, message, self.label())
    }

    /// The most key bytes a SCAN page may carry.
    fn scan_page_bytes(&self) -> Result<u32, ClientError> {
        Ok(MAX_SCAN_REPLY_BYTES)
    }

    /// The daemon's socket, in attached mode.
    fn attach_socket(&self) -> Option<&Path> {
        None
    }
}

/// The items of a multi-key request.
pub(crate) enum Batch<'a> {
    Get(&'a [&'a [u8]]),
    Put(&'a [(&'a [u8], &'a [u8])]),
}

impl Batch<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Batch::Get(keys) => keys.len(),
            Batch::Put(pairs) => pairs.len(),
        }
    }

    /// Item `i`'s encoded bytes in a request.
    pub(crate) fn item_bytes(&self, i: usize) -> usize {
        match self {
            Batch::Get(keys) => 4 + keys[i].len(),
            Batch::Put(pairs) => 8 + pairs[i].0.len() + pairs[i].1.len(),
        }
    }

    /// The request for `items`.
    pub(crate) fn request(&self, items: &[usize]) -> Request {
        match self {
            Batch::Get(keys) => Request::MultiGet(items.iter().map(|&i| keys[i].to_vec()).collect()),
            Batch::Put(pairs) => {
                Request::MultiPut(items.iter().map(|&i| (pairs[i].0.to_vec(), pairs[i].1.to_vec())).collect())
            }
        }
    }
}

/// A key too long for the table: refused as the table would (embedded mode), unsent.
fn check_key(key: &[u8]) -> Result<(), ClientError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(too_large(key.len(), 0));
    }
    Ok(())
}

impl dyn Channel {
    fn unexpected(&self, reply: Reply) -> ClientError {
        match reply {
            Reply::Error(kind, message) => self.error_reply(kind, message),
            other => ClientError::Protocol(format!("{} answered with an unexpected {other:?}", self.label())),
        }
    }

    /// [`Self::unexpected`], with the table's TooLarge as the typed error for this item.
    fn unexpected_for(&self, reply: Reply, key: usize, value: usize) -> ClientError {
        match reply {
            Reply::Error(ErrorKind::TooLarge, _) => too_large(key, value),
            other => self.unexpected(other),
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        check_key(key)?;
        self.call(&Request::Get(key.to_vec()))?.value().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn put_with(&self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, ClientError> {
        check_item(key, value.len())?;
        self.call(&Request::Put { key: key.to_vec(), value: value.to_vec(), mode })?
            .done()
            .map_err(|r| self.unexpected_for(r, key.len(), value.len()))
    }

    pub(crate) fn put_opts(&self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, ClientError> {
        check_item(key, value.len())?;
        self.call(&Request::PutOpts { key: key.to_vec(), value: value.to_vec(), options })?
            .put_result()
            .map_err(|r| self.unexpected_for(r, key.len(), value.len()))
    }

    pub(crate) fn get_item(&self, key: &[u8]) -> Result<Option<Item>, ClientError> {
        check_key(key)?;
        self.call(&Request::GetItem(key.to_vec()))?.item().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn expire(&self, key: &[u8], change: ExpiryChange) -> Result<bool, ClientError> {
        check_key(key)?;
        self.call(&Request::Expire { key: key.to_vec(), change })?.done().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        check_key(key)?;
        self.call(&Request::Delete(key.to_vec()))?.done().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn compare_and_swap(
        &self,
        key: &[u8],
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, ClientError> {
        let new_len = new.map_or(0, <[u8]>::len);
        check_item(key, new_len)?;
        if expected.is_some_and(|e| e.len() > MAX_VALUE_BYTES) {
            // No stored value is this long: it matches nothing.
            return Ok(false);
        }
        let request = Request::CompareAndSwap {
            key: key.to_vec(),
            expected: expected.map(<[u8]>::to_vec),
            new: new.map(<[u8]>::to_vec),
        };
        self.call(&request)?.done().map_err(|r| self.unexpected_for(r, key.len(), new_len))
    }

    pub(crate) fn len(&self) -> Result<u64, ClientError> {
        self.call(&Request::Len)?.count().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn stats(&self) -> Result<Vec<MemnodeStats>, ClientError> {
        self.call(&Request::Stats)?.stats().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn scan(&self, cursor: u64, count: u32) -> Result<(u64, Vec<Vec<u8>>), ClientError> {
        let request = Request::Scan { cursor, count, max_bytes: self.scan_page_bytes()? };
        self.call(&request)?.keys().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn random_key(&self) -> Result<Option<Vec<u8>>, ClientError> {
        self.call(&Request::RandomKey)?.value().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn delete_all(&self) -> Result<u64, ClientError> {
        self.call(&Request::DeleteAll)?.count().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        if let Some(k) = keys.iter().find(|k| k.len() > MAX_KEY_BYTES) {
            return Err(too_large(k.len(), 0));
        }
        let mut out = vec![None; keys.len()];
        self.call_many(&Batch::Get(keys), &mut |items, reply| match reply {
            Reply::Values(values) if values.len() == items.len() => {
                for (&i, v) in items.iter().zip(values) {
                    out[i] = v;
                }
                Ok(())
            }
            other => Err(self.unexpected(other)),
        })?;
        Ok(out)
    }

    /// A transaction's read of `key` (`Session::read_versioned`, in the computenode).
    pub(crate) fn read_versioned(&self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        check_key(key)?;
        self.call(&Request::ReadVersioned(key.to_vec()))?.versioned().map_err(|r| self.unexpected(r))
    }

    /// A transaction's commit (`Session::commit`, in the computenode): one request, sent in
    /// parts when it outgrows a message. At most [`MAX_MULTI`] keys read and as many
    /// written (one write per key: the last), and [`MAX_REQUEST_BYTES`] in all; more is
    /// [`ClientError::TooLarge`] (`max` the limit exceeded), and nothing is sent.
    pub(crate) fn commit(&self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        let writes = last_write_per_key(writes);
        if reads.is_empty() && writes.is_empty() {
            return Ok(true); // nothing to check or apply (as `Session::commit` finds)
        }
        for w in &writes {
            check_item(w.key, w.value.map_or(0, <[u8]>::len))?;
        }
        for (count, max) in [(reads.len(), MAX_MULTI), (writes.len(), MAX_TXN_WRITES.min(MAX_MULTI))] {
            if count > max {
                return Err(ClientError::TooLarge { key: 0, value: count, max });
            }
        }
        let bytes = crate::op::commit_request_bytes(reads, &writes);
        if bytes > MAX_REQUEST_BYTES {
            return Err(ClientError::TooLarge { key: 0, value: bytes, max: MAX_REQUEST_BYTES });
        }
        let request = Request::Commit {
            reads: reads.iter().map(|(k, v)| (k.to_vec(), *v)).collect(),
            writes: writes.iter().map(|w| (w.key.to_vec(), w.value.map(<[u8]>::to_vec), w.expires_at_ms)).collect(),
        };
        self.call(&request)?.done().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn multi_put(&self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        for (k, v) in pairs {
            check_item(k, v.len())?;
        }
        self.call_many(&Batch::Put(pairs), &mut |items, reply| match (reply, items) {
            (Reply::Ok, _) => Ok(()),
            // A pair sent alone: the table's TooLarge is about it.
            (other, &[i]) => Err(self.unexpected_for(other, pairs[i].0.len(), pairs[i].1.len())),
            (other, _) => Err(self.unexpected(other)),
        })
    }
}

/// A transaction through a computenode: its reads and its commit are requests.
impl Coordinator for &(dyn Channel + 'static) {
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, Version), ClientError> {
        (**self).read_versioned(key)
    }

    fn commit(&mut self, reads: &[(&[u8], Version)], writes: &[Write<'_>]) -> Result<bool, ClientError> {
        (**self).commit(reads, writes)
    }
}
