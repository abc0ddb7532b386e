//! Remote mode: requests go to a computenode on another host as RPCs ([`REMOTE_METHOD`]),
//! over FLOCK: threads of this process share its connection, and requests that meet in
//! flight travel coalesced in one message. A request or reply larger than one RPC travels
//! in parts ([`crate::parts`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use racekv_transport::{ConnectOptions, Connection, Endpoint, TransportError};

use crate::channel::{Batch, Channel, Take};
use crate::error::ClientError;
use crate::op::{Reply, Request, MAX_MULTI, MAX_REMOTE_MESSAGE_BYTES, MAX_SCAN_REPLY_BYTES, REMOTE_METHOD};
use crate::Mode;

// A SCAN page and its header fit one RPC reply.
const _: () = assert!(
    (MAX_SCAN_REPLY_BYTES as usize) + 4 + 8 + 4 + racekv_hashing::MAX_KV_BYTES < racekv_transport::wire::MAX_RPC_BYTES
);

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
}

impl Channel for Remote {
    fn mode(&self) -> Mode {
        Mode::Remote
    }

    fn label(&self) -> &str {
        &self.label
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

    /// In requests of at most [`MAX_MULTI`] items and the RPC size limit, one after the
    /// other (a longer item goes alone, in parts; a reply past one RPC is fetched in parts).
    fn call_many(&self, batch: &Batch<'_>, take: &mut Take<'_>) -> Result<(), ClientError> {
        for chunk in chunks(batch.len(), |i| batch.item_bytes(i)) {
            let items: Vec<usize> = chunk.collect();
            take(&items, self.call(&batch.request(&items))?)?;
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
