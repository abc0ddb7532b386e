//! How a client error reaches Redis clients: the [`StoreError`] (and so the reply code)
//! of each [`ClientError`], and of a write cache mode refused.

use racekv_client::ClientError;
use racekv_redis::{StoreError, StoreErrorKind};

use crate::eviction::WriteError;

/// The Redis front end's error for a write in cache mode: over the limit is Redis'
/// `-OOM command not allowed when used memory > 'maxmemory'.`
pub fn write_error(e: WriteError) -> StoreError {
    match e {
        WriteError::OverLimit { .. } => StoreError::new(StoreErrorKind::OverMaxmemory, ""),
        WriteError::Client(e) => store_error(e),
    }
}

/// The Redis front end's error for a client error.
pub fn store_error(e: ClientError) -> StoreError {
    let kind = match &e {
        ClientError::TooLarge { .. } => StoreErrorKind::ValueTooLarge,
        ClientError::OutOfSpace { .. } => StoreErrorKind::Full,
        ClientError::Unavailable { .. }
        | ClientError::Overloaded(_)
        | ClientError::Conflict(_)
        | ClientError::MapChanged { .. }
        | ClientError::MapUnconfirmed { .. } => StoreErrorKind::Unavailable,
        ClientError::Timeout { .. } => StoreErrorKind::Timeout,
        ClientError::EmptyKey => {
            return StoreError::new(StoreErrorKind::Other, "racekv keys cannot be empty");
        }
        ClientError::Config(_) | ClientError::Protocol(_) | ClientError::Internal { .. } | ClientError::Denied(_) => {
            StoreErrorKind::Other
        }
    };
    StoreError::new(kind, e.to_string())
}
