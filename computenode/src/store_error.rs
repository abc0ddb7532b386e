//! How a client error reaches Redis clients: the [`StoreError`] (and so the reply code)
//! of each [`ClientError`].

use racekv_client::ClientError;
use racekv_redis::{StoreError, StoreErrorKind};

/// The Redis front end's error for a client error.
pub fn store_error(e: ClientError) -> StoreError {
    let kind = match &e {
        ClientError::TooLarge { .. } => StoreErrorKind::ValueTooLarge,
        ClientError::OutOfSpace { .. } => StoreErrorKind::Full,
        ClientError::Unavailable { .. } | ClientError::Overloaded(_) | ClientError::Conflict(_) => {
            StoreErrorKind::Unavailable
        }
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
