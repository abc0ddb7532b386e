//! The daemon's end of a shared area: takes requests from the submission ring, puts replies
//! in their slots and on the completion ring.
//!
//! Everything read from the area is untrusted (see the [module documentation](super)): each
//! word is read once, checked against the daemon's private state, and anything impossible is
//! a [`ProtocolError`] for the caller to detach the client with. Nothing here panics on any
//! content of the area, allocates more than one slot's payload per request, or waits.

use std::fs::File;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use racekv_transport::decode::DecodeError;
use racekv_transport::Region;

use super::area::{padded, slot, status, word, Geometry};
use crate::op::Request;

/// A request taken from the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    /// The slot holding the request; its reply goes back into the same slot.
    pub slot: u32,
    /// Echoed in the reply's slot header.
    pub request_id: u64,
    /// The client's CLOCK_MONOTONIC at submission, as it claims (for metrics only).
    pub submitted_ns: u64,
    /// The decoded request.
    pub request: Request,
    /// Encoded size, in bytes.
    pub bytes: usize,
}

/// A client broke the protocol; its attachment must close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The client's submission tail is behind the daemon's head or more than a ring ahead.
    #[error("submission tail {tail} is not within {slots} entries after the daemon's head {head}")]
    SubmissionIndex {
        /// The client's tail (submissions published, a wrapping count).
        tail: u64,
        /// The daemon's head (submissions taken).
        head: u64,
        /// Entries in the ring.
        slots: u32,
    },
    /// A submission names a slot that does not exist.
    #[error("a submission names slot {slot}, but there are {slots} slots")]
    SlotIndex {
        /// The slot named.
        slot: u64,
        /// Slots in the area.
        slots: u32,
    },
    /// A slot was submitted again before the daemon answered it.
    #[error("slot {slot} was submitted again while its request is still in flight")]
    SlotInFlight {
        /// The slot submitted twice.
        slot: u32,
    },
    /// A slot's length word claims more than a slot carries.
    #[error("slot {slot} claims a request of {len} bytes; a slot carries at most {max}")]
    Length {
        /// The slot.
        slot: u32,
        /// The length it claims, in bytes.
        len: u64,
        /// A slot's payload, in bytes.
        max: usize,
    },
    /// A slot's payload is not a request.
    #[error("slot {slot} holds an undecodable request: {error}")]
    Undecodable {
        /// The slot.
        slot: u32,
        /// Why it does not decode.
        error: DecodeError,
    },
    /// The client let the completion ring overflow: it reused a slot before consuming its
    /// completion.
    #[error(
        "completion ring overrun: the client consumed up to {head} but the daemon has produced {tail} \
         (a slot was reused before its completion was consumed)"
    )]
    CompletionOverrun {
        /// Completions the client consumed.
        head: u64,
        /// Completions the daemon published.
        tail: u64,
    },
}

impl ProtocolError {
    /// A short, fixed label (metrics).
    pub fn reason(&self) -> &'static str {
        match self {
            ProtocolError::SubmissionIndex { .. } => "submission_index",
            ProtocolError::SlotIndex { .. } => "slot_index",
            ProtocolError::SlotInFlight { .. } => "slot_in_flight",
            ProtocolError::Length { .. } => "length",
            ProtocolError::Undecodable { .. } => "undecodable",
            ProtocolError::CompletionOverrun { .. } => "completion_overrun",
        }
    }
}

struct Shared {
    region: Arc<Region>,
    geometry: Geometry,
    /// Which slots hold a request the daemon took and has not answered (private).
    busy: Box<[AtomicBool]>,
    /// Completions published (private; the area's copy is only ever written).
    cq_tail: Mutex<u64>,
}

impl Shared {
    fn load(&self, offset: u64) -> u64 {
        // Offsets come from the validated geometry, never from the area.
        self.region.load_u64(offset).expect("header and ring words lie inside the area")
    }

    fn store(&self, offset: u64, value: u64) {
        self.region.store_u64(offset, value).expect("header and ring words lie inside the area")
    }
}

/// The daemon's end of one client's area. One thread takes submissions (`&mut self`);
/// any number of threads complete them through [`Completer`]s.
pub struct DaemonRing {
    shared: Arc<Shared>,
    /// Submissions taken (private).
    sq_head: u64,
}

impl DaemonRing {
    /// Creates a memfd holding a fresh area of `geometry`, mapped; the file is what the
    /// client receives.
    pub fn create(geometry: Geometry, name: &str) -> std::io::Result<(Self, File)> {
        let file = racekv_transport::region::shared_memory_file(name, geometry.area_len(), false)?;
        let region = Region::map_file(&file, geometry.area_len())?;
        Ok((Self::over(Arc::new(region), geometry)?, file))
    }

    /// Lays a fresh area of `geometry` over `region` (tests and fuzzing use anonymous
    /// memory; both ends then share the `Arc`).
    pub fn over(region: Arc<Region>, geometry: Geometry) -> std::io::Result<Self> {
        if region.len() < geometry.area_len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("region of {} bytes is smaller than the area's {}", region.len(), geometry.area_len()),
            ));
        }
        geometry.write_header(&region)?;
        let busy = (0..geometry.slots()).map(|_| AtomicBool::new(false)).collect();
        Ok(Self { shared: Arc::new(Shared { region, geometry, busy, cq_tail: Mutex::new(0) }), sq_head: 0 })
    }

    /// The area's slot count and size.
    pub fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// A handle for answering this ring's requests from other threads.
    pub fn completer(&self) -> Completer {
        Completer { shared: Arc::clone(&self.shared) }
    }

    /// Whether the client has published submissions not yet taken (or garbage: then
    /// [`DaemonRing::take`] says so).
    pub fn has_submissions(&self) -> bool {
        self.shared.load(word::SQ_TAIL) != self.sq_head
    }

    /// Says whether the daemon is about to sleep on its doorbell (the client rings it only
    /// then). After setting it, check [`DaemonRing::has_submissions`] once more before
    /// sleeping: the fence here pairs with the client's after it publishes.
    pub fn set_sleeping(&self, sleeping: bool) {
        self.shared.store(word::DAEMON_SLEEPING, u64::from(sleeping));
        fence(Ordering::SeqCst);
    }

    /// Takes the next submission, if the client published one. The slot is in flight from
    /// now until its reply is completed.
    pub fn take(&mut self) -> Result<Option<Submission>, ProtocolError> {
        let shared = &*self.shared;
        let geometry = shared.geometry;
        let slots = geometry.slots();
        let tail = shared.load(word::SQ_TAIL);
        if tail == self.sq_head {
            return Ok(None);
        }
        if tail.wrapping_sub(self.sq_head) > u64::from(slots) {
            return Err(ProtocolError::SubmissionIndex { tail, head: self.sq_head, slots });
        }
        let entry = shared.load(geometry.sq_entry(self.sq_head));
        if entry >= u64::from(slots) {
            return Err(ProtocolError::SlotIndex { slot: entry, slots });
        }
        let index = entry as u32;
        if shared.busy[index as usize].swap(true, Ordering::AcqRel) {
            return Err(ProtocolError::SlotInFlight { slot: index });
        }
        let base = geometry.slot(index);
        let request_id = shared.load(base + slot::REQUEST_ID);
        let len = shared.load(base + slot::LENGTH);
        let submitted_ns = shared.load(base + slot::SUBMITTED_NS);
        let max = geometry.payload_bytes();
        if len > max as u64 {
            return Err(ProtocolError::Length { slot: index, len, max });
        }
        // One copy out of the area, then only the private copy is looked at.
        let len = len as usize;
        let mut payload = vec![0u8; padded(len)];
        if len > 0 {
            shared.region.read(base + slot::PAYLOAD, &mut payload).expect("a slot's payload lies inside the area");
        }
        payload.truncate(len);
        let request = Request::decode(&payload).map_err(|error| ProtocolError::Undecodable { slot: index, error })?;
        self.sq_head = self.sq_head.wrapping_add(1);
        shared.store(word::SQ_HEAD, self.sq_head);
        Ok(Some(Submission { slot: index, request_id, submitted_ns, request, bytes: len }))
    }
}

/// Answers requests of one ring; clone it into each reply callback.
#[derive(Clone)]
pub struct Completer {
    shared: Arc<Shared>,
}

impl Completer {
    /// The area's slot count and size.
    pub fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// Writes `reply` (an encoded `op.rs` reply) into `slot` and publishes the completion. A
    /// reply longer than a slot is replaced by [`status::REPLY_TOO_LARGE`] with its length.
    /// Returns whether the client is sleeping (then ring its doorbell).
    ///
    /// `slot` must be one [`DaemonRing::take`] handed out and not completed since.
    pub fn complete(&self, slot: u32, request_id: u64, reply: &[u8]) -> Result<bool, ProtocolError> {
        let shared = &*self.shared;
        let geometry = shared.geometry;
        assert!(slot < geometry.slots(), "completing a slot the ring never handed out");
        let base = geometry.slot(slot);
        let mut tail = shared.cq_tail.lock();
        let head = shared.load(word::CQ_HEAD);
        // Also catches a head "ahead" of the tail: the difference wraps to a huge number.
        if tail.wrapping_sub(head) >= u64::from(geometry.slots()) {
            return Err(ProtocolError::CompletionOverrun { head, tail: *tail });
        }
        let fits = reply.len() <= geometry.payload_bytes();
        let (len, code) = if fits { (reply.len(), status::REPLY) } else { (reply.len(), status::REPLY_TOO_LARGE) };
        shared.store(base + slot::REQUEST_ID, request_id);
        shared.store(base + slot::LENGTH, (len as u64 & 0xFFFF_FFFF) | (u64::from(code) << 32));
        if fits && !reply.is_empty() {
            let mut words = Vec::with_capacity(padded(reply.len()));
            words.extend_from_slice(reply);
            words.resize(padded(reply.len()), 0);
            shared.region.write(base + slot::PAYLOAD, &words).expect("a slot's payload lies inside the area");
        }
        // Free the slot before the client can see the completion (and reuse the slot).
        shared.busy[slot as usize].store(false, Ordering::Release);
        shared.store(geometry.cq_entry(*tail), u64::from(slot));
        *tail = tail.wrapping_add(1);
        shared.store(word::CQ_TAIL, *tail);
        drop(tail);
        fence(Ordering::SeqCst);
        Ok(shared.load(word::CLIENT_SLEEPING) != 0)
    }
}

impl DaemonRing {
    /// Tells the client to stop using the connections lent to it (it checks before each
    /// operation it would run on them).
    pub fn revoke_lending(&self) {
        self.shared.store(word::LENDING_REVOKED, 1);
    }

    /// Whether [`Self::revoke_lending`] was called.
    pub fn lending_revoked(&self) -> bool {
        self.shared.load(word::LENDING_REVOKED) != 0
    }
}
