//! Errors of table operations.

use racekv_transport::{OpError, TransportError};

use crate::layout::{LayoutError, MAX_KEY_BYTES, MAX_VALUE_BYTES};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("one-sided operation failed: {0}")]
    Op(#[from] OpError),
    #[error("keys must not be empty")]
    EmptyKey,
    #[error("key of {key} B or value of {value} B too large: keys take at most {MAX_KEY_BYTES} B, values {MAX_VALUE_BYTES} B")]
    TooLarge { key: usize, value: usize },
    #[error("the memnode is out of memory: {0}")]
    OutOfMemory(String),
    #[error("the table cannot grow further: {0}")]
    TableFull(String),
    #[error("gave up after {waited_ms} ms: {what}")]
    Timeout { waited_ms: u64, what: &'static str },
    #[error("the table looks corrupt: {0}")]
    Corrupt(String),
    #[error("the memnode refused: {0}")]
    Remote(String),
    #[error("the memnode restarted since: {0}")]
    StaleInstance(String),
    #[error("bad region layout: {0}")]
    Layout(#[from] LayoutError),
}

impl Error {
    /// True for failures that a retry on a fresh connection may fix.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Transport(e) => e.is_transient(),
            Error::Timeout { .. } | Error::StaleInstance(_) => true,
            _ => false,
        }
    }
}
