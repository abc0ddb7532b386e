//! The client's end of a shared area: writes requests into its free slots, publishes them,
//! reads completions and replies. Which slots are free, and who waits for what, is the
//! caller's business (the attached backend); this is only the area's protocol.
//!
//! The client trusts its daemon, but still checks what it reads (indices, lengths), so a
//! daemon bug surfaces as an error rather than a panic.

use std::fs::File;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use racekv_transport::Region;

use super::area::{padded, slot, word, Geometry};

/// A completed slot's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotReply {
    /// The id the request was submitted with.
    pub request_id: u64,
    /// [`super::area::status`].
    pub status: u32,
    /// Bytes of the reply (for `REPLY_TOO_LARGE`: bytes it needed).
    pub len: usize,
}

/// The client's end of an area; share it between threads.
pub struct ClientRing {
    region: Arc<Region>,
    geometry: Geometry,
    /// Submissions published (the client is the only writer of `sq_tail`).
    sq_tail: Mutex<u64>,
}

impl ClientRing {
    /// Maps the area the daemon passed, and checks its header against `geometry`.
    pub fn map(file: &File, geometry: Geometry) -> Result<Self, String> {
        let region = Region::map_file(file, geometry.area_len()).map_err(|e| format!("mapping the ring: {e}"))?;
        Self::over(Arc::new(region), geometry)
    }

    /// The client's end of an area already laid out over `region` (tests).
    pub fn over(region: Arc<Region>, geometry: Geometry) -> Result<Self, String> {
        geometry.check_header(&region).map_err(|e| e.to_string())?;
        let sq_tail = region.load_u64(word::SQ_TAIL).map_err(|e| e.to_string())?;
        Ok(Self { region, geometry, sq_tail: Mutex::new(sq_tail) })
    }

    /// The area's slot count and size.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn load(&self, offset: u64) -> u64 {
        self.region.load_u64(offset).expect("header and ring words lie inside the area")
    }

    fn store(&self, offset: u64, value: u64) {
        self.region.store_u64(offset, value).expect("header and ring words lie inside the area")
    }

    /// Writes a request into `slot` (which the caller owns). `payload` must fit a slot.
    pub fn write_request(&self, index: u32, request_id: u64, submitted_ns: u64, payload: &[u8]) {
        assert!(index < self.geometry.slots(), "slot {index} out of range");
        assert!(payload.len() <= self.geometry.payload_bytes(), "request larger than a slot");
        let base = self.geometry.slot(index);
        self.store(base + slot::REQUEST_ID, request_id);
        self.store(base + slot::LENGTH, payload.len() as u64);
        self.store(base + slot::SUBMITTED_NS, submitted_ns);
        if !payload.is_empty() {
            let mut words = Vec::with_capacity(padded(payload.len()));
            words.extend_from_slice(payload);
            words.resize(padded(payload.len()), 0);
            self.region.write(base + slot::PAYLOAD, &words).expect("a slot's payload lies inside the area");
        }
    }

    /// Publishes `slot` (written by [`ClientRing::write_request`]) on the submission ring.
    /// Returns whether the daemon is sleeping (then ring its doorbell).
    pub fn submit(&self, index: u32) -> bool {
        {
            let mut tail = self.sq_tail.lock();
            self.store(self.geometry.sq_entry(*tail), u64::from(index));
            *tail = tail.wrapping_add(1);
            self.store(word::SQ_TAIL, *tail);
        }
        fence(Ordering::SeqCst);
        self.load(word::DAEMON_SLEEPING) != 0
    }

    /// Whether the daemon took back the connections it lent (it never gives them back).
    pub fn lending_revoked(&self) -> bool {
        self.load(word::LENDING_REVOKED) != 0
    }

    /// Completions published so far (a running count).
    pub fn completion_tail(&self) -> u64 {
        self.load(word::CQ_TAIL)
    }

    /// The slot of completion number `index`.
    pub fn completion(&self, index: u64) -> Result<u32, String> {
        let entry = self.load(self.geometry.cq_entry(index));
        if entry >= u64::from(self.geometry.slots()) {
            return Err(format!("completion {index} names slot {entry} of {}", self.geometry.slots()));
        }
        Ok(entry as u32)
    }

    /// Says completions up to `head` were consumed.
    pub fn consumed(&self, head: u64) {
        self.store(word::CQ_HEAD, head);
    }

    /// Says a thread is about to sleep on the client's doorbell. After setting it, check
    /// [`ClientRing::completion_tail`] once more before sleeping.
    pub fn set_sleeping(&self, sleeping: bool) {
        self.store(word::CLIENT_SLEEPING, u64::from(sleeping));
        fence(Ordering::SeqCst);
    }

    /// Reads a completed slot's header, and its reply into `out` (cleared first).
    pub fn read_reply(&self, index: u32, out: &mut Vec<u8>) -> Result<SlotReply, String> {
        assert!(index < self.geometry.slots(), "slot {index} out of range");
        let base = self.geometry.slot(index);
        let request_id = self.load(base + slot::REQUEST_ID);
        let length = self.load(base + slot::LENGTH);
        let reply = SlotReply { request_id, status: (length >> 32) as u32, len: (length & 0xFFFF_FFFF) as usize };
        out.clear();
        if reply.status == super::area::status::REPLY {
            if reply.len > self.geometry.payload_bytes() {
                return Err(format!("slot {index} claims a reply of {} bytes", reply.len));
            }
            if reply.len > 0 {
                out.resize(padded(reply.len), 0);
                self.region.read(base + slot::PAYLOAD, out).expect("a slot's payload lies inside the area");
                out.truncate(reply.len);
            }
        }
        Ok(reply)
    }
}
