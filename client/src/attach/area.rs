//! Layout of the shared area: the header page, the two rings of slot indices, the slots.
//! See the [module documentation](super) for the picture.

use racekv_transport::decode::DecodeError;
use racekv_transport::Region;

/// `"RKVRING1"`, the first word of an attach area.
pub const MAGIC: u64 = u64::from_le_bytes(*b"RKVRING1");
/// Version of the area layout and of the handshake.
pub const VERSION: u64 = 2;
/// The header page.
pub const HEADER_BYTES: u64 = 4096;
/// Each slot starts with request id, length/status, submission time, reserved.
pub const SLOT_HEADER_BYTES: u64 = 32;
/// Slots (requests in flight) per attachment at most.
pub const MAX_SLOTS: u32 = 4096;
/// Smallest slot the protocol accepts (the daemon insists on more: see `MIN_SERVING_SLOT_BYTES`).
pub const MIN_SLOT_BYTES: u32 = 64;
/// Largest slot: a maximal `op.rs` message plus the slot header.
pub const MAX_SLOT_BYTES: u32 = (crate::op::MAX_MESSAGE_BYTES as u32) + SLOT_HEADER_BYTES as u32;
/// Largest area.
pub const MAX_AREA_BYTES: u64 = 1 << 30;
/// Smallest slot a daemon serves with: every single-key request and reply fits (a
/// compare-and-swap carries a key, an expected and a new value: about 2 x MAX_KV_BYTES).
pub const MIN_SERVING_SLOT_BYTES: u32 = 36 << 10;

/// Byte offsets of the header's words.
pub mod word {
    /// [`super::MAGIC`].
    pub const MAGIC: u64 = 0;
    /// [`super::VERSION`].
    pub const VERSION: u64 = 8;
    /// The number of slots.
    pub const SLOTS: u64 = 16;
    /// The size of each slot, in bytes, header included.
    pub const SLOT_BYTES: u64 = 24;
    /// The area's length, in bytes.
    pub const AREA_LEN: u64 = 32;
    /// Daemon: non-zero once it takes back the connections it lent this client (the
    /// client then sends everything through the ring; [`super::super::lending`]).
    pub const LENDING_REVOKED: u64 = 64;
    /// Client: submissions published (wrapping count).
    pub const SQ_TAIL: u64 = 128;
    /// Daemon: submissions taken.
    pub const SQ_HEAD: u64 = 192;
    /// Daemon: non-zero while it sleeps on its doorbell.
    pub const DAEMON_SLEEPING: u64 = 256;
    /// Daemon: completions published.
    pub const CQ_TAIL: u64 = 320;
    /// Client: completions consumed.
    pub const CQ_HEAD: u64 = 384;
    /// Client: non-zero while one of its threads sleeps on its doorbell.
    pub const CLIENT_SLEEPING: u64 = 448;
}

/// Offsets within a slot.
pub mod slot {
    /// The request's id, echoed in its reply.
    pub const REQUEST_ID: u64 = 0;
    /// Requests: the payload length (the whole word). Replies: length in the low 32 bits,
    /// [`super::status`] in the high 32 bits.
    pub const LENGTH: u64 = 8;
    /// Requests: CLOCK_MONOTONIC ns at submission (metrics only).
    pub const SUBMITTED_NS: u64 = 16;
    /// The request or reply bytes, after the slot header.
    pub const PAYLOAD: u64 = super::SLOT_HEADER_BYTES;
}

/// What a completed slot holds.
pub mod status {
    /// The payload is the encoded reply.
    pub const REPLY: u32 = 0;
    /// The reply did not fit; the length field says how many bytes it needed.
    pub const REPLY_TOO_LARGE: u32 = 1;
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// What the errors of an invalid geometry say they are about ([`DecodeError::what`]).
pub const BAD_GEOMETRY: &str = "bad ring geometry";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(BAD_GEOMETRY, msg)
}

/// How many slots, and how large: fixed when the daemon creates the area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    slots: u32,
    slot_bytes: u32,
}

impl Geometry {
    /// `slots` in 1..=[`MAX_SLOTS`]; `slot_bytes` a multiple of 8 in
    /// [`MIN_SLOT_BYTES`]..=[`MAX_SLOT_BYTES`]; the whole area at most [`MAX_AREA_BYTES`].
    pub fn new(slots: u32, slot_bytes: u32) -> Result<Self, DecodeError> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(bad(format!("{slots} slots; allowed 1..={MAX_SLOTS}")));
        }
        if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) || !slot_bytes.is_multiple_of(8) {
            return Err(bad(format!(
                "slots of {slot_bytes} bytes; allowed multiples of 8 in {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES}"
            )));
        }
        let geometry = Self { slots, slot_bytes };
        if geometry.area_len() > MAX_AREA_BYTES {
            return Err(bad(format!(
                "{slots} slots of {slot_bytes} bytes need {} bytes; at most {MAX_AREA_BYTES}",
                geometry.area_len()
            )));
        }
        Ok(geometry)
    }

    /// Number of slots: requests in flight at most.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Size of one slot, in bytes, its header included.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// Bytes of request or reply one slot carries.
    pub fn payload_bytes(&self) -> usize {
        (u64::from(self.slot_bytes) - SLOT_HEADER_BYTES) as usize
    }

    fn ring_bytes(&self) -> u64 {
        round_up(u64::from(self.slots) * 8, 64)
    }

    /// Where the submission ring starts (right after the header page).
    pub fn sq_offset(&self) -> u64 {
        HEADER_BYTES
    }

    /// Where the completion ring starts (after the submission ring).
    pub fn cq_offset(&self) -> u64 {
        HEADER_BYTES + self.ring_bytes()
    }

    fn slots_offset(&self) -> u64 {
        round_up(self.cq_offset() + self.ring_bytes(), 64)
    }

    /// The area's length: a whole number of pages.
    pub fn area_len(&self) -> u64 {
        round_up(self.slots_offset() + u64::from(self.slots) * u64::from(self.slot_bytes), 4096)
    }

    /// The submission ring entry for running index `index` (any u64: it wraps).
    pub fn sq_entry(&self, index: u64) -> u64 {
        self.sq_offset() + (index % u64::from(self.slots)) * 8
    }

    /// The completion ring entry for running index `index`.
    pub fn cq_entry(&self, index: u64) -> u64 {
        self.cq_offset() + (index % u64::from(self.slots)) * 8
    }

    /// Where slot `slot` starts. Callers check `slot < slots` first.
    pub fn slot(&self, slot: u32) -> u64 {
        debug_assert!(slot < self.slots);
        self.slots_offset() + u64::from(slot) * u64::from(self.slot_bytes)
    }

    /// Writes the header of a fresh area (daemon).
    pub fn write_header(&self, region: &Region) -> std::io::Result<()> {
        let words = [
            (word::MAGIC, MAGIC),
            (word::VERSION, VERSION),
            (word::SLOTS, u64::from(self.slots)),
            (word::SLOT_BYTES, u64::from(self.slot_bytes)),
            (word::AREA_LEN, self.area_len()),
        ];
        for (offset, value) in words {
            region.store_u64(offset, value).map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(())
    }

    /// Checks that `region` holds an area of this geometry (client, after mapping).
    pub fn check_header(&self, region: &Region) -> Result<(), DecodeError> {
        if region.len() < self.area_len() {
            return Err(bad(format!("area of {} bytes, expected {}", region.len(), self.area_len())));
        }
        let read = |offset| region.load_u64(offset).map_err(|e| bad(e.to_string()));
        let expected = [
            ("magic", word::MAGIC, MAGIC),
            ("version", word::VERSION, VERSION),
            ("slots", word::SLOTS, u64::from(self.slots)),
            ("slot bytes", word::SLOT_BYTES, u64::from(self.slot_bytes)),
            ("area length", word::AREA_LEN, self.area_len()),
        ];
        for (name, offset, value) in expected {
            let found = read(offset)?;
            if found != value {
                return Err(bad(format!("the area's {name} is {found:#x}, expected {value:#x}")));
            }
        }
        Ok(())
    }
}

/// Bytes rounded up to whole words (all slot writes are whole aligned words, so neither side
/// ever needs a read-modify-write on a word the other may be writing).
pub(crate) fn padded(len: usize) -> usize {
    len.div_ceil(8) * 8
}
