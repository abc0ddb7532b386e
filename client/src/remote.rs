//! Remote mode: requests go to a computenode on another host as RPCs ([`REMOTE_METHOD`]),
//! over FLOCK: threads of this process share its connection, and requests that meet in
//! flight travel coalesced in one message. A request or reply larger than one RPC travels
//! in parts ([`crate::parts`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use racekv_hashing::{Item, PutMode, PutOptions, PutResult};
use racekv_transport::{ConnectOptions, Connection, Endpoint, TransportError};

use crate::error::ClientError;
use crate::op::{
    ErrorKind, MemnodeStats, Reply, Request, MAX_KEY_BYTES, MAX_MULTI, MAX_REMOTE_MESSAGE_BYTES, MAX_SCAN_REPLY_BYTES,
    MAX_VALUE_BYTES, REMOTE_METHOD,
};
use crate::parts::{check_item, too_large};

// A SCAN page and its header fit one RPC reply.
const _: () = assert!(
    (MAX_SCAN_REPLY_BYTES as usize) + 4 + 8 + 4 + racekv_hashing::MAX_KV_BYTES < racekv_transport::wire::MAX_RPC_BYTES
);
use crate::expiry::ExpiryChange;

/// Reconnect attempts are at least this far apart.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(100);
/// Request bytes per RPC (the transport's RPC payload limit, with room for framing).
const MAX_REQUEST_BYTES: usize = MAX_REMOTE_MESSAGE_BYTES;

pub(crate) struct Remote {
    endpoint: Endpoint,
    label: String,
    connect: ConnectOptions,
    conn: RwLock<Arc<dyn Connection>>,
    last_attempt: Mutex<Instant>,
}

impl Remote {
    pub(crate) fn connect(addr: &str, connect: ConnectOptions) -> Result<Self, ClientError> {
        let endpoint: Endpoint = if addr.contains(':') && !addr.starts_with("tcp:") && !addr.starts_with("shm:") {
            Endpoint::Tcp(addr.to_string())
        } else {
            addr.parse().map_err(ClientError::Config)?
        };
        let label = endpoint.to_string();
        let conn = racekv_transport::connect(&endpoint, &connect)
            .map_err(|e| ClientError::Unavailable { endpoint: label.clone(), reason: e.to_string() })?;
        Ok(Self { endpoint, label, connect, conn: RwLock::new(conn), last_attempt: Mutex::new(Instant::now()) })
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    fn failed(&self, e: TransportError) -> ClientError {
        match e {
            TransportError::Timeout { .. } => {
                ClientError::Timeout { endpoint: self.label.clone(), after: self.connect.timeout }
            }
            TransportError::Rpc { status, .. } if status.code == racekv_transport::RpcStatus::OVERLOADED => {
                ClientError::Overloaded(status.message)
            }
            e if e.is_connection_failure() => {
                ClientError::Unavailable { endpoint: self.label.clone(), reason: e.to_string() }
            }
            e => ClientError::Protocol(format!("{}: {e}", self.label)),
        }
    }

    /// The connection, replaced (rate-limited) once it is known broken.
    fn connection(&self) -> Arc<dyn Connection> {
        let conn = Arc::clone(&self.conn.read());
        if conn.is_healthy() {
            return conn;
        }
        if let Some(mut last) = self.last_attempt.try_lock() {
            if last.elapsed() >= RECONNECT_BACKOFF {
                *last = Instant::now();
                match racekv_transport::connect(&self.endpoint, &self.connect) {
                    Ok(fresh) => {
                        *self.conn.write() = Arc::clone(&fresh);
                        return fresh;
                    }
                    Err(e) => tracing::warn!(computenode = %self.label, "reconnect failed: {e}"),
                }
            }
        }
        conn
    }

    /// One request: in one RPC when it fits, else in parts (all on one connection: the
    /// computenode keys a transfer by the user and its id, so any of its sessions serves it).
    fn call(&self, request: &Request) -> Result<Reply, ClientError> {
        let mut bytes = Vec::new();
        request.encode(&mut bytes);
        let conn = self.connection();
        crate::parts::call(MAX_REQUEST_BYTES, &bytes, &mut |message| {
            let reply = conn.call(REMOTE_METHOD, message).map_err(|e| self.failed(e))?;
            Reply::decode(&reply).map_err(|e| ClientError::Protocol(format!("reply from {}: {e}", self.label)))
        })
    }

    /// [`Remote::unexpected`], with the table's TooLarge as the typed error for this item.
    fn unexpected_for(&self, reply: Reply, key: usize, value: usize) -> ClientError {
        match reply {
            Reply::Error(ErrorKind::TooLarge, _) => too_large(key, value),
            other => self.unexpected(other),
        }
    }

    fn unexpected(&self, reply: Reply) -> ClientError {
        match reply {
            Reply::Error(kind, message) => Reply::into_error(kind, message, &self.label),
            other => ClientError::Protocol(format!("{} answered with an unexpected {other:?}", self.label)),
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        if key.len() > MAX_KEY_BYTES {
            // As the table says (embedded mode), without sending it.
            return Err(too_large(key.len(), 0));
        }
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
        if key.len() > MAX_KEY_BYTES {
            return Err(too_large(key.len(), 0));
        }
        self.call(&Request::GetItem(key.to_vec()))?.item().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn expire(&self, key: &[u8], change: ExpiryChange) -> Result<bool, ClientError> {
        if key.len() > MAX_KEY_BYTES {
            return Err(too_large(key.len(), 0));
        }
        self.call(&Request::Expire { key: key.to_vec(), change })?.done().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        if key.len() > MAX_KEY_BYTES {
            return Err(too_large(key.len(), 0));
        }
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
        // A page fits an RPC reply with room to spare (1 MiB against 4 MiB).
        let request = Request::Scan { cursor, count, max_bytes: MAX_SCAN_REPLY_BYTES };
        self.call(&request)?.keys().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn random_key(&self) -> Result<Option<Vec<u8>>, ClientError> {
        self.call(&Request::RandomKey)?.value().map_err(|r| self.unexpected(r))
    }

    pub(crate) fn delete_all(&self) -> Result<u64, ClientError> {
        self.call(&Request::DeleteAll)?.count().map_err(|r| self.unexpected(r))
    }

    /// Values of many keys, in requests of at most [`MAX_MULTI`] keys and the RPC size limit
    /// (a longer key goes alone, in parts; a reply past one RPC is fetched in parts).
    pub(crate) fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        if let Some(k) = keys.iter().find(|k| k.len() > MAX_KEY_BYTES) {
            return Err(too_large(k.len(), 0));
        }
        let mut out = Vec::with_capacity(keys.len());
        for chunk in chunks(keys.len(), |i| 4 + keys[i].len()) {
            match self.call(&Request::MultiGet(keys[chunk.clone()].iter().map(|k| k.to_vec()).collect()))? {
                Reply::Values(values) if values.len() == chunk.len() => out.extend(values),
                other => return Err(self.unexpected(other)),
            }
        }
        Ok(out)
    }

    pub(crate) fn multi_put(&self, pairs: &[(&[u8], &[u8])]) -> Result<(), ClientError> {
        for (k, v) in pairs {
            check_item(k, v.len())?;
        }
        for chunk in chunks(pairs.len(), |i| 8 + pairs[i].0.len() + pairs[i].1.len()) {
            let request = Request::MultiPut(pairs[chunk].iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect());
            match self.call(&request)? {
                Reply::Ok => {}
                other => return Err(self.unexpected(other)),
            }
        }
        Ok(())
    }
}

/// Splits `0..n` into runs of at most [`MAX_MULTI`] items whose `size`s fit a request.
fn chunks(n: usize, size: impl Fn(usize) -> usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for i in 0..n {
        let s = size(i);
        if i > start && (i - start == MAX_MULTI || bytes + s > MAX_REQUEST_BYTES - 16) {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += s;
    }
    if start < n {
        out.push(start..n);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunks_respect_both_limits() {
        let c = super::chunks(10_000, |_| 10);
        assert!(c.iter().all(|r| r.len() <= super::MAX_MULTI));
        assert_eq!(c.iter().map(|r| r.len()).sum::<usize>(), 10_000);
        let big = super::chunks(5, |_| super::MAX_REQUEST_BYTES / 2);
        assert_eq!(big.len(), 5, "{big:?}");
        assert!(super::chunks(0, |_| 1).is_empty());
    }
}
