//! The memnode's RPC methods and their messages (little-endian, fixed-size, checked).

use racekv_transport::decode::{DecodeError, Reader};
use racekv_transport::wire::MALFORMED_FRAME;
use racekv_transport::{Connection, RpcStatus, TransportError};

use crate::alloc::Chunk;
use crate::error::Error;
use crate::layout::Layout;

/// Method ids.
pub mod method {
    /// -> the 64-byte encoded [`crate::layout::Layout`], then the node id (u64).
    pub const METADATA: u16 = 1;
    /// (preferred bytes u64, optional) -> a heap chunk (offset u64, bytes u64) and the
    /// server instance it belongs to (u64; see [`crate::alloc::Chunk`]).
    pub const ALLOC_CHUNK: u16 = 2;
    /// (dir_hash u64, observed depth u32, zero u32, observed subtable u64) -> outcome u8.
    pub const SPLIT: u16 = 3;
    /// -> JSON [`crate::service::TableStats`].
    pub const STATS: u16 = 4;
    /// (instance u64, count x (offset u64, bytes u64)) -> (): free ranges a client gives
    /// back, handed out by that server instance (refused if it is not the one serving).
    pub const RETURN_RANGES: u16 = 5;
    /// (most bytes u64) -> (instance u64, count x (offset u64, bytes u64)): free runs
    /// shorter than a chunk the memnode holds, for a client to use as free blocks.
    pub const TAKE_FRAGMENTS: u16 = 6;
    /// (value_len u64) -> (instance u64, offset u64): an extent for a large value
    /// (`crate::extents`), space of that server instance.
    pub const ALLOC_EXTENT: u16 = 7;
    /// (instance u64, offset u64, value_len u64) -> (): retires an extent whose block was
    /// swung away; freed after the grace period.
    pub const RETIRE_EXTENT: u16 = 8;
}

/// Status codes beyond the transport's generic ones.
pub mod status {
    /// The memnode's heap is full.
    pub const OUT_OF_MEMORY: u16 = 100;
    /// The directory is at its maximum depth.
    pub const TABLE_FULL: u16 = 101;
    /// The memnode is not serving the table yet (it is still starting).
    pub const NOT_READY: u16 = 102;
    /// Ranges given back were handed out by an earlier run of the memnode (which reclaimed
    /// them when it started).
    pub const STALE_INSTANCE: u16 = 103;
}

/// A method's name, for logs and metrics.
pub fn method_name(method: u16) -> &'static str {
    match method {
        method::METADATA => "metadata",
        method::ALLOC_CHUNK => "alloc_chunk",
        method::SPLIT => "split",
        method::STATS => "stats",
        method::RETURN_RANGES => "return_ranges",
        method::TAKE_FRAGMENTS => "take_fragments",
        method::ALLOC_EXTENT => "alloc_extent",
        method::RETIRE_EXTENT => "retire_extent",
        _ => "unknown",
    }
}

/// Maps a memnode RPC failure to the table's error.
pub fn map_error(e: TransportError) -> Error {
    match e {
        TransportError::Rpc { status, .. } => match status.code {
            status::OUT_OF_MEMORY => Error::OutOfMemory(status.message),
            status::TABLE_FULL => Error::TableFull(status.message),
            status::STALE_INSTANCE => Error::StaleInstance(status.message),
            status::NOT_READY => Error::NotReady(status.message),
            _ => Error::Remote(status.to_string()),
        },
        other => Error::Transport(other),
    }
}

/// A bad-request status for a request that did not decode.
pub fn bad_request(e: DecodeError) -> RpcStatus {
    RpcStatus::new(RpcStatus::BAD_REQUEST, e.to_string())
}

/// What a memnode says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metadata {
    /// The region's layout.
    pub layout: Layout,
    /// The memnode's stable identity (random at format time).
    pub node_id: u64,
}

impl Metadata {
    /// The METADATA reply: the layout's 64 bytes, then the node id.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.layout.encode().to_vec();
        out.extend_from_slice(&self.node_id.to_le_bytes());
        out
    }

    /// Reads a METADATA reply.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        if bytes.len() != 72 {
            return Err(Error::Remote(format!("metadata of {} bytes, expected 72", bytes.len())));
        }
        let layout = Layout::decode(&bytes[..64]).map_err(Error::Layout)?;
        let node_id = u64::from_le_bytes(bytes[64..72].try_into().expect("8 bytes"));
        Ok(Self { layout, node_id })
    }
}

/// Asks the memnode for its layout and identity.
pub fn metadata(conn: &dyn Connection) -> Result<Metadata, Error> {
    let reply = conn.call(method::METADATA, &[]).map_err(map_error)?;
    Metadata::decode(&reply)
}

/// A split request: the key's directory hash and what the client saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitRequest {
    /// The key's directory hash.
    pub dir_hash: u64,
    /// The subtable's local depth as the client saw it.
    pub observed_depth: u32,
    /// Region offset of the subtable the client found full.
    pub observed_subtable: u64,
}

impl SplitRequest {
    /// The request's 24 bytes.
    pub fn encode(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[0..8].copy_from_slice(&self.dir_hash.to_le_bytes());
        out[8..12].copy_from_slice(&self.observed_depth.to_le_bytes());
        out[16..24].copy_from_slice(&self.observed_subtable.to_le_bytes());
        out
    }

    /// Reads a split request.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(MALFORMED_FRAME, bytes);
        let dir_hash = r.u64()?;
        let observed_depth = r.u32()?;
        r.zeros(4)?;
        let observed_subtable = r.u64()?;
        r.finish()?;
        Ok(Self { dir_hash, observed_depth, observed_subtable })
    }
}

/// The ALLOC_CHUNK reply: offset, bytes and instance.
pub fn encode_chunk(chunk: &Chunk) -> Vec<u8> {
    [chunk.offset, chunk.bytes, chunk.instance].iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Reads an ALLOC_CHUNK reply.
pub fn decode_chunk(reply: &[u8]) -> Result<Chunk, DecodeError> {
    let mut r = Reader::new(MALFORMED_FRAME, reply);
    let chunk = Chunk { offset: r.u64()?, bytes: r.u64()?, instance: r.u64()? };
    r.finish()?;
    Ok(chunk)
}

/// Ranges per RETURN_RANGES call (and per TAKE_FRAGMENTS reply).
pub const MAX_RANGES_PER_CALL: usize = 4096;

/// A server instance, then (offset, bytes) ranges of heap space it handed out.
pub fn encode_ranges(instance: u64, ranges: &[(u64, u64)]) -> Vec<u8> {
    let words = ranges.iter().flat_map(|&(offset, bytes)| [offset, bytes]);
    std::iter::once(instance).chain(words).flat_map(|w| w.to_le_bytes()).collect()
}

/// Reads a server instance and its ranges ([`encode_ranges`]).
pub fn decode_ranges(bytes: &[u8]) -> Result<(u64, Vec<(u64, u64)>), DecodeError> {
    let count = bytes.len().saturating_sub(8) / 16;
    if bytes.len() < 8 || !(bytes.len() - 8).is_multiple_of(16) || count > MAX_RANGES_PER_CALL {
        return Err(DecodeError::new(
            MALFORMED_FRAME,
            format!("{} bytes is not an instance and a list of at most {MAX_RANGES_PER_CALL} ranges", bytes.len()),
        ));
    }
    let mut r = Reader::new(MALFORMED_FRAME, bytes);
    let instance = r.u64()?;
    let mut out = Vec::with_capacity(count);
    while r.remaining() > 0 {
        out.push((r.u64()?, r.u64()?));
    }
    Ok((instance, out))
}

/// A fixed number of little-endian words (the extent messages).
pub fn encode_words(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Exactly `N` little-endian words, or an error.
pub fn decode_words<const N: usize>(bytes: &[u8]) -> Result<[u64; N], DecodeError> {
    let mut r = Reader::new(MALFORMED_FRAME, bytes);
    let mut out = [0u64; N];
    for word in &mut out {
        *word = r.u64()?;
    }
    r.finish()?;
    Ok(out)
}

/// The byte budget in a TAKE_FRAGMENTS request.
pub fn decode_fragments_request(bytes: &[u8]) -> Result<u64, DecodeError> {
    let mut r = Reader::new(MALFORMED_FRAME, bytes);
    let most = r.u64()?;
    r.finish()?;
    Ok(most)
}

/// The preferred size in an ALLOC_CHUNK request (empty: the memnode's default).
pub fn decode_chunk_request(bytes: &[u8]) -> Result<Option<u64>, DecodeError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    let mut r = Reader::new(MALFORMED_FRAME, bytes);
    let preferred = r.u64()?;
    r.finish()?;
    Ok(Some(preferred))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn split_requests_round_trip(dir_hash in any::<u64>(), depth in any::<u32>(), subtable in any::<u64>()) {
            let r = SplitRequest { dir_hash, observed_depth: depth, observed_subtable: subtable };
            prop_assert_eq!(SplitRequest::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = SplitRequest::decode(&bytes);
            let _ = decode_chunk(&bytes);
            let _ = decode_ranges(&bytes);
            let _ = decode_fragments_request(&bytes);
            let _ = decode_chunk_request(&bytes);
            let _ = decode_words::<3>(&bytes);
        }

        #[test]
        fn ranges_round_trip(instance in any::<u64>(), ranges in proptest::collection::vec((any::<u64>(), any::<u64>()), 0..50)) {
            prop_assert_eq!(decode_ranges(&encode_ranges(instance, &ranges)).unwrap(), (instance, ranges));
        }

        #[test]
        fn words_round_trip(a in any::<u64>(), b in any::<u64>(), c in any::<u64>()) {
            prop_assert_eq!(decode_words::<3>(&encode_words(&[a, b, c])).unwrap(), [a, b, c]);
            prop_assert!(decode_words::<2>(&encode_words(&[a, b, c])).is_err());
        }

        #[test]
        fn chunks_round_trip(offset in any::<u64>(), bytes in any::<u64>(), instance in any::<u64>()) {
            let chunk = Chunk { offset, bytes, instance };
            prop_assert_eq!(decode_chunk(&encode_chunk(&chunk)).unwrap(), chunk);
        }
    }
}
