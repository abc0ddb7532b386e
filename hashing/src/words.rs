//! Reading and writing 8-byte words of the region over a connection: the superblock's
//! counters, list links, directory entries; and runs of bytes longer than one READ (value
//! and key extents).

use racekv_transport::{Batch, Connection, MAX_BATCH_OPS, MAX_OP_BYTES};

use crate::error::Error;

/// The little-endian word at the start of a READ's result.
pub(crate) fn read_word(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().expect("8-byte read"))
}

/// READs the words at `offsets` in one batch (reusing `b`).
pub(crate) fn read_words(conn: &dyn Connection, b: &mut Batch, offsets: &[u64]) -> Result<Vec<u64>, Error> {
    b.clear();
    let ids: Vec<_> = offsets.iter().map(|&o| b.read(o, 8)).collect();
    conn.execute(b)?;
    ids.into_iter().map(|id| Ok(read_word(b.read_result(id)?))).collect()
}

/// WRITEs (offset, value) words in order, as few batches as the batch limit allows (reusing
/// `b`). A caller that needs one word to land after others writes it in a later call.
pub(crate) fn write_words(conn: &dyn Connection, b: &mut Batch, words: &[(u64, u64)]) -> Result<(), Error> {
    for chunk in words.chunks(MAX_BATCH_OPS) {
        b.clear();
        for &(offset, value) in chunk {
            b.write(offset, &value.to_le_bytes());
        }
        conn.execute(b)?;
    }
    Ok(())
}

/// READs `len` bytes from `offset` on, appended to `out`, one [`MAX_OP_BYTES`] piece per
/// round trip (reusing `b`); returns the round trips it took.
pub(crate) fn read_bytes(
    conn: &dyn Connection,
    b: &mut Batch,
    offset: u64,
    len: u64,
    out: &mut Vec<u8>,
) -> Result<u64, Error> {
    out.reserve(len as usize);
    let mut at = 0;
    let mut round_trips = 0;
    while at < len {
        let n = MAX_OP_BYTES.min(len - at);
        b.clear();
        let read = b.read(offset + at, n as u32);
        conn.execute(b)?;
        round_trips += 1;
        out.extend_from_slice(b.read_result(read)?);
        at += n;
    }
    Ok(round_trips)
}
