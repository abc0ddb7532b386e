//! What can go wrong for an application.

use std::time::Duration;

use racekv_hashing::Error as TableError;

/// Why an operation failed, the same in attached and embedded mode.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The key was empty (the table stores no empty keys).
    #[error("keys must not be empty")]
    EmptyKey,
    /// The key or value exceeds the table's limit (all three in bytes; `max` is the limit exceeded).
    #[error("key of {key} B and value of {value} B are too large: this path carries at most {max} B per item")]
    TooLarge {
        /// Length of the key, in bytes.
        key: usize,
        /// Length of the value, in bytes.
        value: usize,
        /// The limit the item exceeds, in bytes (the key's or the value's).
        max: usize,
    },
    /// The memnode (or the computenode) cannot be reached now; the operation may or may not
    /// have been applied. Worth a retry.
    #[error("memnode {endpoint} is unavailable: {reason}")]
    Unavailable {
        /// The memnode, or the computenode's socket, that failed.
        endpoint: String,
        /// What failed, as the transport said it.
        reason: String,
    },
    /// The operation did not finish in time; it may or may not have been applied. Worth a retry.
    #[error("operation on memnode {endpoint} timed out after {after:?}")]
    Timeout {
        /// The endpoint that did not answer.
        endpoint: String,
        /// How long the client waited.
        after: Duration,
    },
    /// The memnode's region has no room for the item (heap or table full).
    #[error("memnode {endpoint} is out of space: {reason}")]
    OutOfSpace {
        /// The memnode that is full.
        endpoint: String,
        /// Which of its limits was reached.
        reason: String,
    },
    /// The client's settings are unusable (no memnodes, a bad endpoint or TLS setting).
    #[error("bad configuration: {0}")]
    Config(String),
    /// The computenode's work queue is full and it refused the request. Worth a retry.
    #[error("the computenode is overloaded: {0}")]
    Overloaded(String),
    /// The user the client authenticated as may not do this (Redis' NOPERM).
    #[error("not allowed: {0}")]
    Denied(String),
    /// The other side broke the protocol (a bad frame or reply); the connection is unusable.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A transaction kept meeting others' writes to what it read (or their locks) and gave
    /// up; nothing of it was applied. Worth a retry.
    #[error("transaction conflict: {0}")]
    Conflict(String),
    /// A memnode serves a newer cluster map than the operation was routed by (issue 17), and
    /// no map that new reached this side in time; the operation may or may not have been
    /// applied there. Worth a retry.
    #[error("{}", map_changed(endpoint, *routed, *current, *fenced))]
    MapChanged {
        /// The memnode that refused.
        endpoint: String,
        /// The epoch the operation was routed by.
        routed: u64,
        /// The epoch the memnode serves (fenced: the one waited for).
        current: u64,
        /// The memnode had fenced itself (its etcd lease may have lapsed): a map newer
        /// than any this side had was needed.
        fenced: bool,
    },
    /// etcd has not vouched for the cluster map this process routes by for longer than its
    /// map lease (`MapSource::with_lease`): cut off from etcd, it could miss a failover, so
    /// it serves nothing until etcd answers again. Nothing was applied. Worth a retry.
    #[error(
        "etcd last confirmed this process's cluster map {}ms ago, past its {}ms map lease: it may route by an \
         old map, so it serves nothing until etcd answers",
        since.as_millis(),
        lease.as_millis()
    )]
    MapUnconfirmed {
        /// How long ago etcd last vouched for the map.
        since: Duration,
        /// The map lease.
        lease: Duration,
    },
    /// Any other failure of the table on a memnode (a corrupt region, a bug).
    #[error("memnode {endpoint}: {reason}")]
    Internal {
        /// The memnode whose table failed.
        endpoint: String,
        /// The table's error.
        reason: String,
    },
}

impl ClientError {
    /// The table's refusal of a key of `key` bytes with a value of `value` bytes, naming the
    /// limit exceeded (`racekv_hashing::layout`'s, whatever their integer types).
    pub fn too_large(key: usize, value: usize) -> Self {
        let max_key = racekv_hashing::layout::MAX_KEY_BYTES as u128 as usize;
        let max_value = racekv_hashing::layout::MAX_VALUE_BYTES as u128 as usize;
        ClientError::TooLarge { key, value, max: if key > max_key { max_key } else { max_value } }
    }

    /// Maps a table error from the memnode `endpoint` to what applications see.
    pub fn from_table(endpoint: &str, e: TableError, timeout: Duration) -> Self {
        let endpoint = endpoint.to_string();
        match e {
            TableError::EmptyKey => ClientError::EmptyKey,
            TableError::TooLarge { key, value } => ClientError::too_large(key, value),
            TableError::Timeout { .. } => ClientError::Timeout { endpoint, after: timeout },
            TableError::OutOfMemory(reason) | TableError::TableFull(reason) => {
                ClientError::OutOfSpace { endpoint, reason }
            }
            // Also a memnode restart under a write (after its block was in a slot): like a
            // lost connection, the write may have been applied.
            TableError::Transport(t) if t.is_transient() => {
                ClientError::Unavailable { endpoint, reason: t.to_string() }
            }
            // A memnode that restarted and is still reopening its region: nothing ran.
            TableError::NotReady(reason) => ClientError::Unavailable { endpoint, reason },
            other => ClientError::Internal { endpoint, reason: other.to_string() },
        }
    }

    /// True when the same call may succeed later (the memnode restarted, a timeout).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ClientError::Unavailable { .. }
                | ClientError::Timeout { .. }
                | ClientError::Overloaded(_)
                | ClientError::Conflict(_)
                | ClientError::MapChanged { .. }
                | ClientError::MapUnconfirmed { .. }
        )
    }
}

fn map_changed(endpoint: &str, routed: u64, current: u64, fenced: bool) -> String {
    if fenced {
        format!(
            "memnode {endpoint} is fenced (its etcd lease may have lapsed) and no cluster map newer than epoch \
             {routed}, the one this was routed by, came in time"
        )
    } else {
        format!("memnode {endpoint} serves cluster map epoch {current}, newer than epoch {routed} this was routed by")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use racekv_transport::TransportError;

    #[test]
    fn a_memnode_restart_under_a_write_is_worth_a_retry() {
        let restarted = TableError::Transport(TransportError::InstanceChanged { expected: 1, found: 2 });
        let e = ClientError::from_table("m", restarted, Duration::from_secs(1));
        assert!(matches!(e, ClientError::Unavailable { .. }) && e.is_transient(), "{e}");
        let refused = TableError::Transport(TransportError::Protocol("garbage".into()));
        assert!(!ClientError::from_table("m", refused, Duration::from_secs(1)).is_transient());
    }
}
