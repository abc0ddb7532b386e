//! Errors of the transport layer: per-operation failures and whole-connection failures.

use std::fmt;

/// Why one operation of a batch did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// `offset + len` lies outside the region.
    #[error("access [{offset}, +{len}) is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Region offset of the access.
        offset: u64,
        /// Bytes accessed.
        len: u64,
        /// The region's length in bytes.
        region_len: u64,
    },
    /// CAS and FAA need an 8-byte aligned offset.
    #[error("atomic at offset {offset} is not 8-byte aligned")]
    Misaligned {
        /// The offset given.
        offset: u64,
    },
    /// A read or write longer than [`crate::MAX_OP_BYTES`], or a zero-length one.
    #[error("operation length {len} is not within 1..={max}")]
    BadLength {
        /// The length given.
        len: u64,
        /// The largest length allowed.
        max: u64,
    },
    /// An earlier op of the same batch failed; like a flushed work request on a NIC,
    /// this one was not executed.
    #[error("not executed: an earlier operation of the batch failed")]
    NotExecuted,
    /// The remote side reported a status code this build does not know.
    #[error("remote reported unknown operation status {0}")]
    Remote(u8),
}

impl OpError {
    /// Stable wire code (tcp frames carry it).
    pub fn code(&self) -> u8 {
        match self {
            OpError::OutOfBounds { .. } => 1,
            OpError::Misaligned { .. } => 2,
            OpError::BadLength { .. } => 3,
            OpError::NotExecuted => 4,
            OpError::Remote(code) => *code,
        }
    }
}

/// Why a whole batch (or an RPC) failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The batch ran, but op `index` failed (and every later op was not executed).
    #[error("operation {index} of the batch failed: {error}")]
    Op {
        /// Index of the op that failed.
        index: usize,
        /// Why it failed.
        error: OpError,
    },
    /// The connection is gone. When `maybe_executed` is true the request was sent and may
    /// have been carried out: the caller must re-read before retrying anything non-idempotent.
    #[error("connection lost ({reason}){}", if *.maybe_executed { "; the request may have executed" } else { "" })]
    ConnectionLost {
        /// What happened to it.
        reason: String,
        /// The request may have executed.
        maybe_executed: bool,
    },
    /// No answer within the connection's timeout; the request may have executed.
    #[error("timed out after {waited_ms} ms waiting for the remote side")]
    Timeout {
        /// How long it waited, in milliseconds.
        waited_ms: u64,
    },
    /// The peer refused our credentials.
    #[error("authentication refused by {peer}")]
    AuthRefused {
        /// The peer's address.
        peer: String,
    },
    /// The server could not prove it knows our key: a wrong token or password (the server
    /// has another), or an impostor. Nothing was sent to it.
    #[error(
        "{peer} could not prove it knows the token or password (a wrong one on either side, or an impostor); nothing was sent"
    )]
    ServerNotAuthenticated {
        /// The peer's address.
        peer: String,
    },
    /// The peer spoke something we cannot parse, or refused our request as malformed.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The batch violates a local limit before anything was sent.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// Setting the connection up failed.
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        /// The endpoint connected to.
        endpoint: String,
        /// Why it failed.
        reason: String,
    },
    /// The batch requires another server instance than the connection reaches (the memnode
    /// restarted since the space it writes was handed out): nothing was sent.
    #[error("the region server restarted (instance {expected:#x} is gone, {found:#x} serves now); nothing was sent")]
    InstanceChanged {
        /// The instance the batch requires.
        expected: u64,
        /// The instance that serves now.
        found: u64,
    },
    /// The remote service refused or failed an RPC.
    #[error("rpc {method} failed: {status}")]
    Rpc {
        /// The RPC method.
        method: u16,
        /// What the service reported.
        status: RpcStatus,
    },
}

impl TransportError {
    /// True when retrying on a new connection may succeed.
    pub fn is_connection_failure(&self) -> bool {
        matches!(self, TransportError::ConnectionLost { .. } | TransportError::Timeout { .. })
    }

    /// True when the same call may succeed later: a connection failure, or a server that
    /// restarted under the caller (which starts over with the new instance).
    pub fn is_transient(&self) -> bool {
        self.is_connection_failure() || matches!(self, TransportError::InstanceChanged { .. })
    }
}

/// An RPC failure reported by the service: a code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcStatus {
    /// The status code (the constants below, or a service's own).
    pub code: u16,
    /// What went wrong, for people.
    pub message: String,
}

impl RpcStatus {
    /// Unknown method.
    pub const UNKNOWN_METHOD: u16 = 1;
    /// The request body could not be decoded.
    pub const BAD_REQUEST: u16 = 2;
    /// The service could not do it (out of memory, directory full, ...).
    pub const FAILED: u16 = 3;
    /// The service is overloaded and refused the request; retry later.
    pub const OVERLOADED: u16 = 4;

    /// A status with `code` and `message`.
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

impl fmt::Display for RpcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "code {}: {}", self.code, self.message)
    }
}

impl std::error::Error for RpcStatus {}
