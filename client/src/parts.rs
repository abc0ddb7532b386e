//! The client's half of requests and replies in parts (the protocol is in [`crate::op`]'s
//! module documentation): over any one-message call (a ring slot, an RPC), a request too
//! large for one message goes as PART requests, and a STAGED reply is fetched with
//! FETCH_PART. The attached and remote backends both use it.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::ClientError;
use crate::op::{self, Reply, MAX_KEY_BYTES, MAX_VALUE_BYTES, PART_REPLY_OVERHEAD_BYTES, PART_REQUEST_OVERHEAD_BYTES};

/// Sends one encoded message and decodes its reply.
pub(crate) type Send<'a> = dyn FnMut(&[u8]) -> Result<Reply, ClientError> + 'a;

/// A fresh upload id: random per process (the std hasher's random keys), and distinct
/// within it; the computenode keys uploads by their owner and this id.
fn upload_id() -> u64 {
    static STATE: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    STATE.get_or_init(Default::default).hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Runs the encoded `request` through `send`, whose messages carry at most `message_bytes`:
/// in one message when it fits (no extra round trip or copy), else in parts; a staged reply
/// is fetched in parts. Error replies come back as replies, for the caller to map.
pub(crate) fn call(message_bytes: usize, request: &[u8], send: &mut Send<'_>) -> Result<Reply, ClientError> {
    let reply = if request.len() <= message_bytes { send(request)? } else { upload(message_bytes, request, send)? };
    match reply {
        Reply::Staged { id, total } => fetch(message_bytes, id, total, send),
        other => Ok(other),
    }
}

/// Sends `request` as PART requests; returns the last one's reply (the request's).
fn upload(message_bytes: usize, request: &[u8], send: &mut Send<'_>) -> Result<Reply, ClientError> {
    let per_part = message_bytes
        .checked_sub(PART_REQUEST_OVERHEAD_BYTES)
        .filter(|&n| n > 0)
        .ok_or_else(|| ClientError::Protocol(format!("messages of {message_bytes} bytes cannot carry a part")))?;
    let id = upload_id();
    let total = request.len();
    let mut message = Vec::with_capacity(message_bytes);
    for range in op::part_ranges(total, per_part) {
        message.clear();
        op::encode_part(id, total as u64, range.start as u64, &request[range.clone()], &mut message);
        let reply = send(&message)?;
        if range.end == total {
            return Ok(reply);
        }
        match reply {
            Reply::Count(received) if received == range.end as u64 => {}
            // An error (budget, a dropped upload) ends it; the caller maps it.
            Reply::Error(..) => return Ok(reply),
            other => {
                return Err(ClientError::Protocol(format!(
                    "the computenode acknowledged part {}..{} of upload {id:#x} with {other:?}",
                    range.start, range.end
                )))
            }
        }
    }
    unreachable!("a request is never empty: the last part returned")
}

/// Fetches the staged reply `id` of `total` bytes and decodes it.
pub(crate) fn fetch(message_bytes: usize, id: u64, total: u64, send: &mut Send<'_>) -> Result<Reply, ClientError> {
    let max_len = message_bytes.saturating_sub(PART_REPLY_OVERHEAD_BYTES).min(u32::MAX as usize) as u32;
    if max_len == 0 {
        return Err(ClientError::Protocol(format!("messages of {message_bytes} bytes cannot carry a part")));
    }
    // Grows as parts arrive (the total is the computenode's word, and may be large).
    let mut bytes = Vec::new();
    while (bytes.len() as u64) < total {
        match send_fetch(id, bytes.len() as u64, max_len, send)? {
            Reply::Part(part) if !part.is_empty() && bytes.len() as u64 + part.len() as u64 <= total => {
                bytes.extend_from_slice(&part)
            }
            Reply::Error(kind, message) => return Ok(Reply::Error(kind, message)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "fetching staged reply {id} at {} of {total} bytes: the computenode answered {other:?}",
                    bytes.len()
                )))
            }
        }
    }
    match Reply::decode(&bytes) {
        Ok(Reply::Staged { .. }) => Err(ClientError::Protocol("a staged reply was itself staged".into())),
        Ok(reply) => Ok(reply),
        Err(e) => Err(ClientError::Protocol(format!("staged reply from the computenode: {e}"))),
    }
}

fn send_fetch(id: u64, offset: u64, max_len: u32, send: &mut Send<'_>) -> Result<Reply, ClientError> {
    let mut message = Vec::with_capacity(op::REQUEST_HEADER_BYTES + 20);
    op::Request::FetchPart { id, offset, max_len }.encode(&mut message);
    send(&message)
}

/// Refuses an empty key, and a key or value over the table's limits, before sending them.
pub(crate) fn check_item(key: &[u8], value_len: usize) -> Result<(), ClientError> {
    if key.is_empty() {
        return Err(ClientError::EmptyKey);
    }
    if key.len() > MAX_KEY_BYTES || value_len > MAX_VALUE_BYTES {
        return Err(too_large(key.len(), value_len));
    }
    Ok(())
}

/// The table's TooLarge, naming the limit that was exceeded.
pub(crate) fn too_large(key: usize, value: usize) -> ClientError {
    ClientError::too_large(key, value)
}
