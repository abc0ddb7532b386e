//! FLOCK: RPC over connections shared by threads, with coalescing and credit scheduling
//! (after Monga et al., SOSP'21). Every [`crate::Connection::call`] goes through it.
//!
//! Pieces, in the order a request meets them:
//! * [`mapping`]: the calling thread's slot (its thread id on the wire) and the lane it is
//!   mapped to: threads are sorted by the median size of their recent requests and cut into
//!   one group per active lane, so large requests do not block small ones.
//! * credits ([`sender`]): a request needs one credit of its lane. Each lane starts with what
//!   the receiver grants at setup (C = 32 by default) and asks for more after using half.
//! * [`combine`]: an MCS-style queue per lane. The thread at its head is the leader: it
//!   coalesces everyone queued behind it into one [`message`] (header with length, count and
//!   canary; per request size, thread id, sequence and rpc id; data; trailing canary), sends
//!   it with one write, and passes leadership on.
//! * [`accept`]: the region server hands a connection that sent FlockOpen over; it gets a
//!   lane from the scheduler and is answered with the carrier its listener offers.
//! * the receiver ([`receiver`], run by the region server, one loop per lane) checks both
//!   canaries and every field, dispatches each request to the [`RpcService`] ([`service`]), and
//!   coalesces the responses into one message the same way; responses carry the receiver's
//!   ring head back, and the answer to a credit renewal.
//! * the [`scheduler`] (one per region server) grants or refuses credits: it caps the active
//!   lanes at MAX_AQP, shares them in proportion to each sender's reported coalescing degree
//!   and request rate, leaves dormant senders one, and refuses credits when granting would
//!   queue more than the server can serve in `max_queue_delay` (overload).
//! * back at the sender, a waiting caller holds the lane's reader role, delivers every
//!   response of a message to its caller and hands the role on ([`sender`]).
//!
//! How each transport carries FLOCK messages, and why:
//! * **tcp** ([`stream`]): a lane is a dedicated TCP connection to the region server; each
//!   message is one `write` on the stream, with TCP_NODELAY. The socket is the ring: TCP
//!   orders and flow-controls the bytes, so the acknowledged head is 0, and coalescing pays
//!   off as fewer system calls and wake-ups per request on both sides.
//! * **shm** ([`shm`]): a lane is a pair of rings in a memfd the server creates and passes
//!   over the Unix socket; a message is one copy into the peer's ring published with a
//!   release store, the receiver polls for the canaries and, when idle, sleeps on a futex in
//!   the shared page, so the only system call per message is the wake-up of a sleeping peer.
//!   The socket stays open only to notice the peer going away.
//! * **verbs** (`verbs`, feature `rdma`): a lane is its own RC queue pair between the sender
//!   and the region server, set up by FlockOpen/FlockAccept over a TCP connection to the
//!   `verbs:` listener, whose verbs parts exchange QPN, PSN, GID and MTU and each side's
//!   registered ring (address, rkey, length). A message is one RDMA WRITE with immediate
//!   into the receiver's ring (inline when small, else from a registered staging buffer);
//!   the receiver polls its ring for the canaries like the shm ring ([`ring`] serves both),
//!   and the immediate raises a receive completion that wakes a receiver sleeping on its
//!   completion channel, so an idle lane burns no core and no wake-up is lost. Credit
//!   renewals and grants are RDMA WRITEs with immediate beside the ring (the values ride
//!   in the immediate), so they never queue behind requests. One work request in 16 is
//!   signaled, plus a signaled RDMA READ of the peer's head word before waiting for room.
//!   The receiver's head rides back on responses, the sender's on requests; a writer out
//!   of room READs the peer's head word. The TCP connection stays open only to notice the
//!   peer leaving. Each ring is pinned (about 8 MiB per lane and side).
//!
//! Large requests: a message holds up to [`message::MAX_MESSAGE_BYTES`], enough for one
//! maximal RPC ([`crate::wire::MAX_RPC_BYTES`]); rings are sized for two such messages.
//! Coalescing stops at the carrier's message limit or [`FlockOptions::max_coalesce`].

pub(crate) mod accept;
#[allow(unsafe_code)] // raw pointers between the queued threads' nodes
pub(crate) mod combine;
pub(crate) mod mapping;
pub mod message;
mod metrics;
pub(crate) mod receiver;
#[allow(unsafe_code)] // `Span`: atomic words of a ring in shared or registered memory
pub(crate) mod ring;
pub mod scheduler;
#[allow(unsafe_code)] // a queued item borrows its caller's request
pub(crate) mod sender;
pub(crate) mod service;
#[allow(unsafe_code)] // futex wait/wake on a ring word; spans over the mapping
pub(crate) mod shm;
pub(crate) mod stream;
#[cfg(feature = "rdma")]
#[allow(unsafe_code)] // spans over registered rings; posting send lists
pub(crate) mod verbs;

#[cfg(feature = "rdma")]
#[doc(hidden)]
pub use verbs::RawVerbsLane;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub use scheduler::{Scheduler, SchedulerOptions, SenderStats};
pub use service::{NoRpc, RpcService};

use crate::error::TransportError;
use sender::{LaneSetup, Sender};

/// Sender-side settings of a connection's RPC channel.
#[derive(Debug, Clone)]
pub struct FlockOptions {
    /// Lanes (connections to the receiver) per sender; the receiver's scheduler decides how
    /// many are active. At most 64.
    pub lanes: usize,
    /// Most requests a leader coalesces into one message.
    pub max_coalesce: usize,
}

impl Default for FlockOptions {
    fn default() -> Self {
        Self { lanes: 2, max_coalesce: 64 }
    }
}

/// The sender's end of a lane.
pub(crate) trait ClientCarrier: Send + Sync {
    /// Writes one whole message. One caller at a time (the lane's send lock).
    fn send(&self, message: &[u8]) -> io::Result<()>;
    /// Waits about one poll interval for the next message and fills `buf` with exactly it
    /// (its header canary must be `expect`); `Ok(false)` when nothing came. One caller at a
    /// time (the reader role).
    fn recv(&self, buf: &mut Vec<u8>, expect: u32) -> io::Result<bool>;
    /// The receiver's ring head, as a response acknowledged it.
    fn acked(&self, _head: u64) {}
    /// Our own ring's head, for carriers whose receiver learns it from the `ack` of requests
    /// (verbs); 0 elsewhere.
    fn head(&self) -> u64 {
        0
    }
    /// Largest message this carrier takes.
    fn max_message(&self) -> usize;
    /// Closes the lane and unblocks anyone in `recv` or `send`.
    fn shutdown(&self);
    /// True when credit renewals and grants travel beside the messages ([`Self::renew`],
    /// [`Self::take_grant`]) instead of in their headers (flags RENEW and GRANT).
    fn credit_channel(&self) -> bool {
        false
    }
    /// Asks for credits on the credit channel (under the lane's send lock).
    fn renew(&self, _degree_x16: u16, _rate_krps: u16) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this carrier renews credits in message headers"))
    }
    /// A grant (or refusal: 0) that arrived on the credit channel since the last call.
    fn take_grant(&self) -> Option<u32> {
        None
    }
    /// Tests: breaks the lane the way its transport can fail underneath (verbs: the queue
    /// pair goes to the error state), without telling the sender.
    fn inject_fault(&self) {}
}

type OpenLanes = dyn Fn(u64, usize) -> Result<Vec<LaneSetup>, TransportError> + Send + Sync;

/// A connection's RPC channel: a sender opened on first use (so connections that never
/// call cost nothing more), replaced when every lane of it has failed.
pub(crate) struct Channel {
    sender: Mutex<Option<Arc<Sender>>>,
    open: Box<OpenLanes>,
    options: FlockOptions,
    timeout: Duration,
    peer: String,
}

impl Channel {
    pub fn new(options: FlockOptions, timeout: Duration, peer: String, open: Box<OpenLanes>) -> Self {
        let options = FlockOptions { lanes: options.lanes.clamp(1, 64), max_coalesce: options.max_coalesce.max(1) };
        Self { sender: Mutex::new(None), open, options, timeout, peer }
    }

    fn sender(&self) -> Result<Arc<Sender>, TransportError> {
        let mut slot = self.sender.lock();
        if let Some(s) = slot.as_ref().filter(|s| !s.is_broken()) {
            return Ok(Arc::clone(s));
        }
        let id = crate::net::random_u64();
        let lanes = (self.open)(id, self.options.lanes).map_err(|e| match e {
            TransportError::Connect { endpoint, reason } => TransportError::ConnectionLost {
                reason: format!("cannot open an rpc lane to {endpoint}: {reason}"),
                maybe_executed: false,
            },
            other => other,
        })?;
        let sender = Arc::new(Sender::new(id, lanes, self.options.clone(), self.timeout, self.peer.clone()));
        *slot = Some(Arc::clone(&sender));
        Ok(sender)
    }

    pub fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        if request.len() > crate::wire::MAX_RPC_BYTES {
            return Err(TransportError::InvalidBatch(format!(
                "rpc request of {} B exceeds {} B",
                request.len(),
                crate::wire::MAX_RPC_BYTES
            )));
        }
        self.sender()?.call(method, request)
    }

    /// Fails every call waiting on the current sender's lanes now ([`Sender::abort`]); the
    /// next call opens new lanes.
    pub fn abort(&self, reason: &str) {
        if let Some(sender) = self.sender.lock().as_ref() {
            sender.abort(reason);
        }
    }

    /// Lanes of the current sender that hold credits (0 before the first call).
    pub fn active_lanes(&self) -> usize {
        self.sender.lock().as_ref().map_or(0, |s| s.active_lanes())
    }

    /// Tests: breaks lane `lane` of the current sender underneath it ([`ClientCarrier::inject_fault`]).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub fn inject_fault(&self, lane: usize) {
        if let Some(sender) = self.sender.lock().as_ref() {
            sender.inject_fault(lane);
        }
    }
}

/// Messages and requests this process's senders have sent so far (from the
/// `racekv_flock_*_total` counters): their ratio over an interval is the coalescing degree.
pub fn sender_totals() -> (u64, u64) {
    let m = &metrics::METRICS;
    (m.messages.with_label_values(&["sent"]).get(), m.requests.with_label_values(&["sent"]).get())
}

/// Lanes this process's receivers hold active, and lanes open at them (the
/// `racekv_flock_active_connections` and `racekv_flock_connections` gauges).
pub fn receiver_lanes() -> (i64, i64) {
    (metrics::METRICS.active.get(), metrics::METRICS.lanes.get())
}
