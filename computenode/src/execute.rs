//! A library request (the attach and remote front ends') run on an attached session, its
//! writes kept under `maxmemory` by the same [`Eviction`] as the Redis front end's: one
//! policy, one set of counters, whatever the path.

use racekv_client::op::{Reply, Request};
use racekv_client::{ClientError, Session};
use racekv_hashing::layout::item_heap_bytes;
use racekv_hashing::Expiry;

use crate::cluster::WorkerShards;
use crate::eviction::Eviction;

/// Runs `request` on `session`; a write makes room first (cache mode). Over the limit with
/// nothing to evict, a write is answered `OutOfSpace` with Redis' OOM message.
pub fn execute(eviction: &Eviction, session: &mut Session<WorkerShards>, request: &Request) -> Reply {
    let result = match request {
        Request::Put { key, value, mode } => {
            write(eviction, session, key, value.len(), false, |s| s.put_with(key, value, *mode)).map(Reply::Done)
        }
        Request::CompareAndSwap { key, expected, new: Some(new) } => {
            write(eviction, session, key, new.len(), false, |s| s.compare_and_swap(key, expected.as_deref(), Some(new)))
                .map(Reply::Done)
        }
        Request::PutOpts { key, value, options } => {
            let expires = matches!(options.expiry, Expiry::At(_));
            write(eviction, session, key, value.len(), expires, |s| s.put_opts(key, value, *options)).map(Reply::Put)
        }
        // Cache mode: room made key by key (not atomic either way); else one batch per memnode.
        Request::MultiPut(pairs) if eviction.limits().limit().is_set() => pairs
            .iter()
            .try_for_each(|(key, value)| write(eviction, session, key, value.len(), false, |s| s.put(key, value)))
            .map(|()| Reply::Ok),
        _ => return session.execute(request),
    };
    result.unwrap_or_else(|e| Reply::from_error(&e))
}

fn write<R>(
    eviction: &Eviction,
    session: &mut Session<WorkerShards>,
    key: &[u8],
    value_len: usize,
    expires: bool,
    write: impl FnMut(&mut Session<WorkerShards>) -> Result<R, ClientError>,
) -> Result<R, ClientError> {
    let bytes = item_heap_bytes(key.len(), value_len, expires).unwrap_or(0);
    eviction.write(session, key, bytes, write).map_err(|e| e.into_client_error())
}
