//! LENT frames: a memnode connection the daemon lends an attached client (the client asked
//! with [`super::handshake::HELLO_FLAG_BORROW`]). The client then runs one-sided operations
//! itself, as an embedded client does, but on connections the daemon dialed and
//! authenticated (KRCORE's borrowed connections): no token in the client, no dial and
//! handshake per process, no daemon hop per operation.
//!
//! ```text
//! LENT body : index u16 | count u16 | reserved u32 (0) | node id u64 | layout [64] | lent connection
//! ```
//! (the lent connection: [`racekv_transport::lend`]; its descriptors ride on the frame).

use std::os::fd::{BorrowedFd, OwnedFd};

use racekv_hashing::Layout;
use racekv_transport::decode::{DecodeError, Reader};
use racekv_transport::lend::{LentShm, MAX_LENT_BYTES, MAX_LENT_LANES};

use super::handshake::{kind, FRAME_HEADER_BYTES, FRAME_MAGIC, MALFORMED_ATTACH, MAX_FRAME_BODY};

/// Most memnodes a daemon lends connections to (one LENT frame each).
pub const MAX_LENT_MEMNODES: usize = 1024;
/// The fixed part of a LENT body.
const FIXED_BYTES: usize = 2 + 2 + 4 + 8 + 64;
/// Most descriptors one LENT frame carries.
pub const MAX_LENT_DESCRIPTORS: usize = 2 + 2 * MAX_LENT_LANES;

const _: () = assert!(FIXED_BYTES + MAX_LENT_BYTES <= MAX_FRAME_BODY, "a LENT frame fits a frame body");

/// One memnode's lent connection, and what the client needs to open its table.
#[derive(Debug)]
pub struct LentMemnode {
    /// Its place in the daemon's list of memnodes (which the ring routes by).
    pub index: u16,
    /// How many memnodes the daemon lends connections to.
    pub count: u16,
    /// The memnode's node id.
    pub node_id: u64,
    /// Its table's layout.
    pub layout: Layout,
    /// The connection.
    pub conn: LentShm,
}

impl LentMemnode {
    /// The frame's bytes, and the descriptors to send with them.
    pub fn encode(&self) -> (Vec<u8>, Vec<BorrowedFd<'_>>) {
        let mut body = Vec::with_capacity(FIXED_BYTES + MAX_LENT_BYTES);
        body.extend_from_slice(&self.index.to_le_bytes());
        body.extend_from_slice(&self.count.to_le_bytes());
        body.extend_from_slice(&[0; 4]);
        body.extend_from_slice(&self.node_id.to_le_bytes());
        body.extend_from_slice(&self.layout.encode());
        self.conn.encode(&mut body);
        assert!(body.len() <= MAX_FRAME_BODY, "bounded by MAX_LENT_BYTES");
        let mut out = Vec::with_capacity(FRAME_HEADER_BYTES + body.len());
        out.extend_from_slice(&FRAME_MAGIC.to_le_bytes());
        out.push(kind::LENT);
        out.push(0);
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(&body);
        (out, self.conn.descriptors())
    }

    /// Parses a LENT frame's body, taking its descriptors from `fds`.
    pub fn decode(body: &[u8], fds: Vec<OwnedFd>) -> Result<Self, DecodeError> {
        let bad = |m: String| DecodeError::new(MALFORMED_ATTACH, m);
        let mut r = Reader::new(MALFORMED_ATTACH, body);
        let (index, count) = (r.u16()?, r.u16()?);
        r.zeros(4)?;
        if count == 0 || usize::from(count) > MAX_LENT_MEMNODES || index >= count {
            return Err(bad(format!("memnode {index} of {count} lent (at most {MAX_LENT_MEMNODES})")));
        }
        let node_id = r.u64()?;
        let layout = Layout::decode(r.take(64)?)?;
        let mut fds = fds.into_iter();
        let conn = LentShm::decode(&mut r, &mut fds)?;
        r.finish()?;
        if fds.next().is_some() {
            return Err(bad("more descriptors than the lent connection has".into()));
        }
        Ok(Self { index, count, node_id, layout, conn })
    }
}
