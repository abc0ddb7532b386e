//! Errors of table operations.

use racekv_transport::decode::DecodeError;
use racekv_transport::{OpError, TransportError};

use crate::layout::{MAX_KEY_BYTES, MAX_VALUE_BYTES};

/// Why a table operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection to the memnode failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// One operation of a batch failed (out of bounds, misaligned, too long).
    #[error("one-sided operation failed: {0}")]
    Op(#[from] OpError),
    /// The key is empty.
    #[error("keys must not be empty")]
    EmptyKey,
    /// The key or the value is longer than the table takes.
    #[error("key of {key} B or value of {value} B too large: keys take at most {MAX_KEY_BYTES} B, values {MAX_VALUE_BYTES} B")]
    TooLarge {
        /// Key length in bytes.
        key: usize,
        /// Value length in bytes.
        value: usize,
    },
    /// The memnode has no heap space left for the write.
    #[error("the memnode is out of memory: {0}")]
    OutOfMemory(String),
    /// The directory is at its maximum depth and the subtable cannot split.
    #[error("the table cannot grow further: {0}")]
    TableFull(String),
    /// A wait (on a lock, a split, a memnode) lasted past its limit.
    #[error("gave up after {waited_ms} ms: {what}")]
    Timeout {
        /// How long it waited, in milliseconds.
        waited_ms: u64,
        /// What it waited for.
        what: &'static str,
    },
    /// What was read from the region cannot be a valid table structure.
    #[error("the table looks corrupt: {0}")]
    Corrupt(String),
    /// The memnode answered an RPC with an error.
    #[error("the memnode refused: {0}")]
    Remote(String),
    /// The memnode is up but not serving the table yet (it is still starting: reopening its
    /// region, reclaiming space); retry shortly.
    #[error("the memnode is not serving yet: {0}")]
    NotReady(String),
    /// Heap space came from an earlier run of the memnode, which reclaimed it when it started.
    #[error("the memnode restarted since: {0}")]
    StaleInstance(String),
    /// A write that holds `key` (a transaction's, or a replicated write's) outlived its
    /// lease: whoever has the connections to the memnodes that decide it resolves it
    /// (`table::txn`) and tries again.
    #[error("a write holding the key outlived its lease ({})", mark.owner)]
    Locked {
        /// The key held.
        key: Vec<u8>,
        /// The locked slot word met.
        word: u64,
        /// What its intent block says of the transaction.
        mark: crate::layout::TxnMark,
    },
    /// The region's layout is invalid (the error says `bad region layout`,
    /// [`crate::layout::BAD_LAYOUT`]).
    #[error(transparent)]
    Layout(DecodeError),
}

impl Error {
    /// True for failures that a retry on a fresh connection may fix.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Transport(e) => e.is_transient(),
            Error::Timeout { .. } | Error::StaleInstance(_) | Error::NotReady(_) => true,
            _ => false,
        }
    }
}
