//! The verbs carrier: a lane is its own RC queue pair, and each side's ring is registered
//! memory that the other side fills with RDMA WRITEs (feature `rdma`).
//!
//! Setup. The sender opens a TCP connection to the region server's `verbs:` listener (the
//! token handshake, then FlockOpen), as a tcp lane does. Before dialling it creates the lane's queue pair
//! (INIT, receives posted) and registers its response ring; FlockOpen's verbs part carries
//! the QP (number, PSN, LID, GID, MTU) and the ring (address, rkey, length). The server does
//! the same for the request ring, brings its QP to RTS against the sender's and answers
//! FlockAccept with its own verbs part; the sender then brings its QP to RTS. The TCP
//! connection stays open, carrying nothing: both sides watch it to notice the other going
//! away (a dead peer's QP would only show up on the next send, as a retry error).
//!
//! Registered memory per side and lane ([`ring_bytes`] + one control page, then a staging
//! buffer that starts at 256 KiB and grows only for large messages):
//!
//! ```text
//! ring (ring_len bytes, [`super::ring`] layout) | control page: head u64 LE @0 | mailbox @64
//! ```
//!
//! The reader stores its head (bytes consumed) at control+0 after every message; the peer
//! may RDMA READ it. The mailbox is where credit WRITEs land (their 8 bytes mean nothing:
//! the immediate value says it all). The ring is sized for two maximal messages (about
//! 8 MiB), as on shm; unlike a memfd page, registered memory is pinned, so every lane pins
//! that much on each side.
//!
//! Write path. A message is one RDMA WRITE with immediate into the peer's ring at the offset
//! [`RingWriter`] picks (a wrap marker, when one is due, is a plain WRITE linked before it:
//! one `ibv_post_send`, one doorbell). Messages up to the QP's inline limit (a single small
//! request or response) are copied into the work request itself; larger ones are copied
//! into the staging buffer first, whose bytes are reused only after a completion covers the
//! WRITE that read them. The immediate value is the lane's doorbell: each message raises one
//! receive completion at the peer, which is what wakes a sleeping reader (below).
//!
//! Selective signaling: one work request in [`SIGNAL_EVERY`] asks for a completion; on RC,
//! completions arrive in order, so a signaled one retires every earlier request (and frees
//! their staging bytes). Before waiting for room (in the peer's ring, the staging buffer or
//! the send queue) the writer makes sure the last request it posted is covered by a signaled
//! one, by posting a signaled RDMA READ of the peer's head word if need be; errors complete
//! whether signaled or not, and fail the lane.
//!
//! Flow control: the writer may only overwrite ring bytes the reader has consumed. The
//! reader's head rides back on what it sends anyway: the region server's head on every
//! response (as on shm), the sender's on every request (the header's `ack`). When a writer
//! finds no room with the head it knows, it RDMA READs the reader's head word (no work for
//! the reader's CPU) and tries again, until its stall limit.
//!
//! Credits: renewals (sender to server) and grants or refusals (server to sender) are RDMA
//! WRITEs with immediate into the peer's mailbox, never ring messages, so credit traffic
//! does not queue behind requests in the ring: the immediate carries a tag and the values
//! (renewal: coalescing degree x16 and request rate in thousands per second, saturated at
//! 15 and 14 bits; grant: the credits, 0 = refused). The receiver's scheduler answers a
//! renewal as soon as its completion arrives.
//!
//! Idle wait: the reader polls its ring for the canaries (like shm) and the receive
//! completion queue for credit messages; after [`SPIN_POLLS`] empty polls it arms the
//! completion queue (`ibv_req_notify_cq`), looks once more (a completion that landed before
//! arming raises no event), and sleeps on the completion channel's descriptor for up to
//! [`SLEEP`]. Every message and credit raises a completion, so no wake-up is lost and an
//! idle lane burns no core.
//!
//! Untrusted input: everything in our ring and every immediate value comes from the peer.
//! The ring reader and [`super::message::decode`] check canaries, lengths, counts and sizes;
//! an unknown immediate, a receive completion without one (a SEND), a credit message going
//! the wrong way, or a work-request error closes this lane only. Remote addresses and keys
//! the peer gives us are only ever used as targets of our WRITEs and READs, which its own
//! NIC checks against its own memory registration.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{IntCounter, IntCounterVec};

use super::message::{self, MAX_MESSAGE_BYTES};
use super::receiver::{Received, ServerCarrier};
use super::ring::{ring_bytes_for, RingReader, RingWriter, Span};
use super::scheduler::SenderStats;
use super::sender::LaneSetup;
use super::ClientCarrier;
use crate::error::TransportError;
use crate::verbs::local::{self, LocalDevice};
use crate::verbs::memory::{Access, Buffer, MemoryRegion, ProtectionDomain};
use crate::verbs::queue::{
    CompletionQueue, LocalSpan, QpCaps, QueuePair, RemotePath, SendList, SendPath, WorkCompletion, POLL_BATCH,
};
use crate::verbs::{random_psn, VerbsError, QP_RETRY_CNT, QP_RNR_RETRY, QP_TIMEOUT};
use crate::wire::{self, FlockVerbs, QpInfo};
use crate::ConnectOptions;

/// Send queue depth of a lane's QP.
const SEND_QUEUE_DEPTH: u32 = 256;
/// Receives kept posted (each message or credit the peer sends consumes one).
const RECV_QUEUE_DEPTH: u32 = 256;
/// Receives are re-posted once this many have been consumed.
const RECV_REFILL: u32 = 64;
/// One send work request in this many is signaled.
pub(crate) const SIGNAL_EVERY: u64 = 16;
/// Inline sizes to ask for, best first (the device may refuse; then we try the next).
const INLINE_WISHES: [u32; 3] = [256, 64, 0];
/// The page after each ring: the reader's head word, then the credit mailbox.
const CONTROL_BYTES: usize = 4096;
const HEAD_WORD: usize = 0;
const MAILBOX: usize = 64;
/// Staging buffers start this big and grow (re-registered, when idle) for large messages.
const INITIAL_STAGING: usize = 256 << 10;
/// Empty polls of ring and completion queue before sleeping on the completion channel.
pub(crate) const SPIN_POLLS: u32 = 200;
/// Longest sleep on the completion channel (then the caller checks liveness and deadlines).
pub(crate) const SLEEP: Duration = Duration::from_millis(5);
/// Messages taken between looks at the receive completion queue on a busy lane (so posted
/// receives never run out while the ring alone keeps the reader busy).
const DRAIN_EVERY: u32 = 32;

/// Bytes of each ring (either direction): two maximal messages, as on shm.
pub(crate) fn ring_bytes() -> usize {
    ring_bytes_for(MAX_MESSAGE_BYTES)
}

struct Metrics {
    work_requests: IntCounterVec,
    head_reads: IntCounter,
    sleeps: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        work_requests: metric::counter_vec(
            "racekv_flock_verbs_work_requests_total",
            "Send work requests posted on FLOCK verbs lanes, by kind and whether signaled",
            &["kind", "signaled"],
            &[&["message", "wrap", "credit", "head_read"], &["yes", "no"]],
        ),
        head_reads: metric::counter(
            "racekv_flock_verbs_head_reads_total",
            "RDMA READs of a peer's ring head (no room with the head it acknowledged, or a fence)",
        ),
        sleeps: metric::counter(
            "racekv_flock_verbs_sleeps_total",
            "Times a FLOCK verbs reader slept on its completion channel",
        ),
    }
});

// ---- immediate values ----

const TAG_SHIFT: u32 = 29;
const VALUE_MASK: u32 = (1 << TAG_SHIFT) - 1;
const TAG_MESSAGE: u32 = 1;
const TAG_RENEW: u32 = 2;
const TAG_GRANT: u32 = 3;
const MAX_DEGREE_X16: u16 = (1 << 15) - 1;
const MAX_RATE_KRPS: u16 = (1 << 14) - 1;

/// What an RDMA WRITE with immediate on a lane means: tag (3 bits) | value (29 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Imm {
    /// A message landed in the ring (the doorbell); the value is its number's low 29 bits.
    Message(u32),
    /// Sender to server: more credits, please (statistics saturate at 15 and 14 bits).
    Renew { degree_x16: u16, rate_krps: u16 },
    /// Server to sender: the scheduler's answer (0 = refused).
    Grant(u32),
}

pub(crate) fn encode_imm(imm: Imm) -> u32 {
    let (tag, value) = match imm {
        Imm::Message(n) => (TAG_MESSAGE, n & VALUE_MASK),
        Imm::Renew { degree_x16, rate_krps } => {
            let degree = u32::from(degree_x16.min(MAX_DEGREE_X16));
            let rate = u32::from(rate_krps.min(MAX_RATE_KRPS));
            (TAG_RENEW, degree | rate << 15)
        }
        Imm::Grant(credits) => (TAG_GRANT, credits.min(VALUE_MASK)),
    };
    tag << TAG_SHIFT | value
}

/// Decodes an immediate value from the peer (untrusted: an unknown tag is an error).
pub(crate) fn decode_imm(word: u32) -> Result<Imm, String> {
    let value = word & VALUE_MASK;
    match word >> TAG_SHIFT {
        TAG_MESSAGE => Ok(Imm::Message(value)),
        TAG_RENEW => Ok(Imm::Renew { degree_x16: (value & 0x7FFF) as u16, rate_krps: (value >> 15) as u16 }),
        TAG_GRANT => Ok(Imm::Grant(value)),
        tag => Err(format!("immediate value {word:#010x} has unknown tag {tag}")),
    }
}

// ---- lane resources ----

fn verbs_io(e: VerbsError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The peer's ring, as its FlockVerbs part describes it.
#[derive(Debug, Clone, Copy)]
struct Remote {
    addr: u64,
    rkey: u32,
    len: u64,
}

impl Remote {
    fn head_word(&self) -> u64 {
        self.addr + self.len + HEAD_WORD as u64
    }

    fn mailbox(&self) -> u64 {
        self.addr + self.len + MAILBOX as u64
    }
}

/// Checks the peer's description of its end of a lane.
fn check_peer(peer: &FlockVerbs) -> Result<(), String> {
    if peer.ring_len != ring_bytes() as u64 {
        return Err(format!("a verbs lane ring of {} bytes, expected {}", peer.ring_len, ring_bytes()));
    }
    if !peer.ring_addr.is_multiple_of(8) || peer.ring_addr.checked_add(peer.ring_len + CONTROL_BYTES as u64).is_none() {
        return Err(format!("a verbs lane ring at {:#x} (unaligned or overflowing)", peer.ring_addr));
    }
    Ok(())
}

/// A lane's QP and registered memory, before the peer is known.
struct Resources {
    device: Arc<LocalDevice>,
    qp: QueuePair,
    send_cq: Arc<CompletionQueue>,
    recv_cq: Arc<CompletionQueue>,
    ring: MemoryRegion<Buffer>,
    staging: MemoryRegion<Buffer>,
    scratch: MemoryRegion<Buffer>,
    psn: u32,
}

impl Resources {
    /// Creates the QP (to INIT, receives posted), the ring and the staging buffers.
    fn create(device: &Arc<LocalDevice>) -> Result<Self, VerbsError> {
        let ctx = device.ctx();
        let caps = ctx.caps();
        if caps.max_qp_wr < SEND_QUEUE_DEPTH.max(RECV_QUEUE_DEPTH) {
            return Err(VerbsError::Unsupported(format!(
                "{} allows {} WRs per queue, a FLOCK lane needs {}",
                device.name(),
                caps.max_qp_wr,
                SEND_QUEUE_DEPTH.max(RECV_QUEUE_DEPTH)
            )));
        }
        let send_cq = CompletionQueue::new(ctx, SEND_QUEUE_DEPTH + 16)?;
        let recv_cq = CompletionQueue::with_channel(ctx, RECV_QUEUE_DEPTH + 16)?;
        let mut last_error = None;
        let mut qp = None;
        for inline in INLINE_WISHES {
            let wish = QpCaps { max_send_wr: SEND_QUEUE_DEPTH, max_recv_wr: RECV_QUEUE_DEPTH, max_inline_data: inline };
            match QueuePair::create_rc_split(&device.pd, &send_cq, &recv_cq, wish) {
                Ok(q) => {
                    qp = Some(q);
                    break;
                }
                Err(e) => last_error = Some(e),
            }
        }
        let qp = qp.ok_or_else(|| last_error.expect("at least one attempt"))?;
        qp.to_init(device.port.port, Access::REMOTE_WRITE | Access::REMOTE_READ)?;
        qp.post_empty_recvs(qp.caps().max_recv_wr.min(RECV_QUEUE_DEPTH) as usize, 0)?;
        let ring = MemoryRegion::register(
            &device.pd,
            Buffer::new(ring_bytes() + CONTROL_BYTES)?,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )?;
        let staging = MemoryRegion::register(&device.pd, Buffer::new(INITIAL_STAGING)?, Access::LOCAL_WRITE)?;
        let scratch = MemoryRegion::register(&device.pd, Buffer::new(4096)?, Access::LOCAL_WRITE)?;
        Ok(Self { device: Arc::clone(device), qp, send_cq, recv_cq, ring, staging, scratch, psn: random_psn() })
    }

    /// Our end, for FlockOpen / FlockAccept.
    fn describe(&self) -> FlockVerbs {
        let port = self.device.port;
        FlockVerbs {
            qp: QpInfo {
                qpn: self.qp.qpn(),
                psn: self.psn,
                lid: port.lid,
                mtu: port.mtu as u8,
                rd_atomic: 1,
                gid: port.gid,
            },
            ring_addr: self.ring.addr(),
            ring_rkey: self.ring.rkey(),
            ring_len: ring_bytes() as u64,
        }
    }

    /// Connects the QP to the peer's (INIT -> RTR -> RTS).
    fn connect(&self, peer: &FlockVerbs) -> Result<(), VerbsError> {
        let port = self.device.port;
        self.qp.to_rtr(&RemotePath {
            port: port.port,
            dest_qpn: peer.qp.qpn,
            rq_psn: peer.qp.psn,
            dlid: peer.qp.lid,
            dgid: peer.qp.gid,
            sgid_index: port.gid_index,
            global: port.roce || peer.qp.lid == 0,
            mtu: port.mtu.min(u32::from(peer.qp.mtu)),
            max_dest_rd_atomic: 1, // the peer READs only our head word, one at a time
        })?;
        self.qp.to_rts(&SendPath {
            sq_psn: self.psn,
            max_rd_atomic: 1,
            timeout: QP_TIMEOUT,
            retry_cnt: QP_RETRY_CNT,
            rnr_retry: QP_RNR_RETRY,
        })
    }

    /// Splits into the QP and the two halves, keyed for the lane.
    fn split(self, peer: &FlockVerbs, key: u32, stall: Duration) -> (QueuePair, Tx, Rx) {
        let max_inline = self.qp.caps().max_inline_data;
        let depth = u64::from(self.qp.caps().max_send_wr.clamp(4, SEND_QUEUE_DEPTH));
        let recv_depth = self.qp.caps().max_recv_wr.min(RECV_QUEUE_DEPTH);
        let remote = Remote { addr: peer.ring_addr, rkey: peer.ring_rkey, len: peer.ring_len };
        let tx = Tx {
            cq: self.send_cq,
            pd: Arc::clone(&self.device.pd),
            staging: Staging { pos: 0, tail: 0, released: 0, committed: 0, mr: self.staging },
            scratch: self.scratch,
            list: SendList::default(),
            completions: Vec::with_capacity(POLL_BATCH),
            writer: RingWriter::new(peer.ring_len as usize, key),
            remote,
            head: 0,
            max_inline,
            depth,
            posted: 0,
            retired: 0,
            last_signaled: 0,
            releases: VecDeque::new(),
            head_read: None,
            messages: 0,
            failed: None,
            stall,
        };
        let base = self.ring.addr() as *mut u8;
        // SAFETY: the ring MR owns a page-aligned anonymous mapping of ring_bytes() +
        // CONTROL_BYTES bytes that stays mapped while the MR lives; the Rx holds the MR next to
        // the spans, and the spans are used only through the Rx.
        let (span, control) =
            unsafe { (Span::new(base, ring_bytes()), Span::new(base.add(ring_bytes()), CONTROL_BYTES)) };
        let rx = Rx {
            cq: self.recv_cq,
            reader: RingReader::new(span, key, stall),
            control,
            _ring: self.ring,
            outstanding: recv_depth,
            depth: recv_depth,
            taken: 0,
            completions: Vec::with_capacity(POLL_BATCH),
            events: VecDeque::new(),
        };
        (self.qp, tx, rx)
    }
}

/// A staging buffer used as a byte ring: bytes are released when a completion covers the
/// WRITE that read them.
struct Staging {
    mr: MemoryRegion<Buffer>,
    pos: usize,
    /// Bytes handed out so far (skipped tails included).
    tail: u64,
    /// Bytes whose WRITEs have completed.
    released: u64,
    /// Bytes that posted work requests read (staged bytes of a message being built are
    /// past it until its list is posted).
    committed: u64,
}

impl Staging {
    fn alloc(&mut self, len: usize) -> Option<usize> {
        let size = self.mr.len();
        if self.released == self.tail {
            self.pos = 0; // idle: start over at the front
        }
        let skip = if self.pos + len > size { size - self.pos } else { 0 };
        if self.tail + (skip + len) as u64 - self.released > size as u64 {
            return None;
        }
        if skip > 0 {
            self.tail += skip as u64;
            self.pos = 0;
        }
        let at = self.pos;
        self.pos += len;
        self.tail += len as u64;
        Some(at)
    }
}

/// The writing half: our send queue, the staging buffer, and the peer's ring.
struct Tx {
    cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
    staging: Staging,
    /// Where RDMA READs of the peer's head word land.
    scratch: MemoryRegion<Buffer>,
    list: SendList,
    completions: Vec<WorkCompletion>,
    writer: RingWriter,
    remote: Remote,
    /// The peer's ring head as far as we know (acknowledged, or read).
    head: u64,
    max_inline: u32,
    depth: u64,
    /// Work requests posted so far; each one's wr_id is its number (from 1).
    posted: u64,
    /// Every work request up to this number has completed.
    retired: u64,
    last_signaled: u64,
    /// (signaled work request, staging tail when it was posted).
    releases: VecDeque<(u64, u64)>,
    /// The number of a head READ in flight.
    head_read: Option<u64>,
    messages: u64,
    failed: Option<String>,
    stall: Duration,
}

impl Tx {
    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some(reason) => Err(io::Error::new(io::ErrorKind::ConnectionAborted, reason.clone())),
            None => Ok(()),
        }
    }

    fn fail(&mut self, qp: &QueuePair, reason: String) -> io::Error {
        let _ = qp.to_error();
        let reason = self.failed.get_or_insert(reason).clone();
        io::Error::new(io::ErrorKind::ConnectionAborted, reason)
    }

    /// Takes the send completions that are ready: retires work requests, releases staging
    /// bytes, picks up a head READ's result. An error completion fails the lane.
    fn reap(&mut self, qp: &QueuePair) -> io::Result<()> {
        self.check()?;
        loop {
            self.completions.clear();
            let n = match self.cq.poll(&mut self.completions) {
                Ok(n) => n,
                Err(e) => return Err(self.fail(qp, e.to_string())),
            };
            for i in 0..n {
                let wc = self.completions[i];
                if !wc.status.is_success() {
                    return Err(self.fail(
                        qp,
                        format!(
                            "send work request {} completed with {} (vendor error {:#x}); the lane's queue pair is in the error state",
                            wc.wr_id, wc.status, wc.vendor_err
                        ),
                    ));
                }
                self.retired = self.retired.max(wc.wr_id);
                if self.head_read.is_some_and(|r| r <= self.retired) {
                    self.head_read = None;
                    let mut word = [0u8; 8];
                    self.scratch.copy_out(0, &mut word);
                    // Untrusted: never past what we wrote.
                    self.head = self.head.max(u64::from_le_bytes(word).min(self.writer.tail()));
                }
            }
            while let Some(&(wr, tail)) = self.releases.front() {
                if wr > self.retired {
                    break;
                }
                self.staging.released = tail;
                self.releases.pop_front();
            }
            if n < POLL_BATCH {
                return Ok(());
            }
        }
    }

    fn next_wr(&self) -> u64 {
        self.posted + self.list.len() as u64 + 1
    }

    /// Posts `self.list` with one doorbell, signaling its last request when a multiple of
    /// [`SIGNAL_EVERY`] falls in it (or `force`). `commits` says the list reads everything
    /// staged so far (a message or credit list; not a fence posted while one is being built).
    fn submit(&mut self, qp: &QueuePair, kinds: &[&'static str], force: bool, commits: bool) -> io::Result<()> {
        debug_assert!(!self.list.is_empty());
        let n = self.list.len() as u64;
        let last = self.posted + n;
        let signal = force || last / SIGNAL_EVERY > self.posted / SIGNAL_EVERY;
        if signal {
            self.list.signal_last();
        }
        // SAFETY: non-inline entries point into `self.staging` or `self.scratch`, registered in
        // this QP's PD; the staging bytes are not handed out again, and the scratch word not
        // read, before a completion covers the request (`reap` and `releases`), and the
        // buffers are not deregistered before that or before the QP is in the error state
        // (`grow` waits for every request to retire; the lane owners put the QP in ERR and
        // destroy it before dropping the buffers). Inline entries point at the caller's
        // message, alive for this call.
        let posted = unsafe { qp.post_send(&mut self.list) };
        self.list.clear();
        if let Err(e) = posted {
            return Err(self.fail(
                qp,
                format!("ibv_post_send refused work request {}: {}", self.posted + e.first_failed as u64 + 1, e.source),
            ));
        }
        for (i, &kind) in kinds.iter().enumerate() {
            let signaled = signal && i + 1 == kinds.len();
            METRICS.work_requests.with_label_values(&[kind, if signaled { "yes" } else { "no" }]).inc();
        }
        self.posted = last;
        if commits {
            self.staging.committed = self.staging.tail;
        }
        if signal {
            self.last_signaled = last;
            self.releases.push_back((last, self.staging.committed));
        }
        Ok(())
    }

    /// Posts a signaled RDMA READ of the peer's head word (unless one is in flight): it
    /// refreshes our idea of the peer's head, and its completion retires everything posted
    /// before it.
    fn read_head(&mut self, qp: &QueuePair) -> io::Result<()> {
        if self.head_read.is_some() {
            return Ok(());
        }
        let wr = self.next_wr();
        let scratch = LocalSpan { addr: self.scratch.addr(), len: 8, lkey: self.scratch.lkey() };
        self.list.read(wr, scratch, self.remote.head_word(), self.remote.rkey);
        self.submit(qp, &["head_read"], true, false)?;
        self.head_read = Some(wr);
        METRICS.head_reads.inc();
        Ok(())
    }

    /// Makes sure a signaled request covers the last one posted (so waiting for
    /// completions cannot wait forever).
    fn fence(&mut self, qp: &QueuePair) -> io::Result<()> {
        if self.last_signaled < self.posted {
            self.read_head(qp)?;
        }
        Ok(())
    }

    /// Polls completions once, then backs off a little; fails past `deadline`.
    fn wait_a_little(&mut self, qp: &QueuePair, spins: &mut u32, deadline: Instant, what: &str) -> io::Result<()> {
        self.reap(qp)?;
        if Instant::now() >= deadline {
            return Err(self.fail(qp, format!("{what} for {} ms", self.stall.as_millis())));
        }
        *spins += 1;
        if *spins < 64 {
            std::hint::spin_loop();
        } else if *spins < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Waits until `slots` more work requests fit in the send queue (one kept for a fence).
    fn sq_room(&mut self, qp: &QueuePair, slots: u64, deadline: Instant) -> io::Result<()> {
        let mut spins = 0;
        loop {
            self.reap(qp)?;
            if self.posted - self.retired + slots < self.depth {
                return Ok(());
            }
            self.fence(qp)?;
            self.wait_a_little(qp, &mut spins, deadline, "no send-queue room")?;
        }
    }

    /// Copies `bytes` into the staging buffer, waiting for earlier WRITEs to release room.
    /// A buffer of two messages plus a page always has room for one message and a wrap
    /// marker staged next to it (before either is posted).
    fn stage(&mut self, qp: &QueuePair, bytes: &[u8], deadline: Instant) -> io::Result<LocalSpan> {
        if bytes.len() > (self.staging.mr.len() - 4096) / 2 {
            self.grow(qp, bytes.len(), deadline)?;
        }
        let mut spins = 0;
        loop {
            if let Some(at) = self.staging.alloc(bytes.len()) {
                self.staging.mr.copy_in(at, bytes);
                return Ok(LocalSpan {
                    addr: self.staging.mr.addr() + at as u64,
                    len: bytes.len() as u32,
                    lkey: self.staging.mr.lkey(),
                });
            }
            self.sq_room(qp, 1, deadline)?;
            self.fence(qp)?;
            self.wait_a_little(qp, &mut spins, deadline, "no staging room")?;
        }
    }

    /// Replaces the staging buffer by one that holds two messages of `len` bytes and a page,
    /// once no work request is in flight (none can still read the old one).
    fn grow(&mut self, qp: &QueuePair, len: usize, deadline: Instant) -> io::Result<()> {
        let mut spins = 0;
        while self.retired < self.posted {
            self.sq_room(qp, 1, deadline)?;
            self.fence(qp)?;
            self.wait_a_little(qp, &mut spins, deadline, "work requests did not complete")?;
        }
        let size = (2 * len + 4096).next_multiple_of(4096);
        let mr = Buffer::new(size)
            .and_then(|b| MemoryRegion::register(&self.pd, b, Access::LOCAL_WRITE))
            .map_err(|e| self.fail(qp, format!("cannot grow the staging buffer to {size} bytes: {e}")))?;
        self.staging = Staging { mr, pos: 0, tail: 0, released: 0, committed: 0 };
        self.releases.clear();
        Ok(())
    }

    /// One message into the peer's ring: waits for room, then posts (a wrap marker and) one
    /// RDMA WRITE with immediate.
    fn send(&mut self, qp: &QueuePair, message: &[u8], acked: u64) -> io::Result<()> {
        let deadline = Instant::now() + self.stall;
        self.reap(qp)?;
        self.head = self.head.max(acked.min(self.writer.tail()));
        let mut spins = 0;
        let placement = loop {
            if let Some(p) = self.writer.place(message.len(), self.head) {
                break p;
            }
            // No room with the head we know: read the peer's, wait for the answer.
            self.sq_room(qp, 1, deadline)?;
            self.read_head(qp)?;
            self.wait_a_little(qp, &mut spins, deadline, "the peer did not make room in its ring")?;
        };
        let inline = message.len() <= self.max_inline as usize;
        let marker = placement.wrap_at.map(|(at, canary)| (at, message::wrap_marker(canary)));
        // The message first: staging it may replace the staging buffer (see `grow`).
        let staged = if inline { None } else { Some(self.stage(qp, message, deadline)?) };
        let staged_marker = match &marker {
            Some((_, bytes)) if bytes.len() > self.max_inline as usize => Some(self.stage(qp, bytes, deadline)?),
            _ => None,
        };
        self.sq_room(qp, 2, deadline)?;
        let mut kinds = Vec::with_capacity(2);
        if let Some((at, bytes)) = &marker {
            let wr = self.next_wr();
            let local =
                staged_marker.unwrap_or(LocalSpan { addr: bytes.as_ptr() as u64, len: bytes.len() as u32, lkey: 0 });
            self.list.write(wr, local, self.remote.addr + *at as u64, self.remote.rkey, staged_marker.is_none());
            kinds.push("wrap");
        }
        let wr = self.next_wr();
        let local = staged.unwrap_or(LocalSpan { addr: message.as_ptr() as u64, len: message.len() as u32, lkey: 0 });
        let imm = encode_imm(Imm::Message(self.messages as u32));
        let at = self.remote.addr + placement.offset as u64;
        self.list.write_with_imm(wr, local, at, self.remote.rkey, staged.is_none(), imm);
        kinds.push("message");
        self.messages += 1;
        self.submit(qp, &kinds, false, true)
    }

    /// A credit message: an RDMA WRITE with immediate into the peer's mailbox.
    fn credit(&mut self, qp: &QueuePair, imm: Imm) -> io::Result<()> {
        self.post_imm(qp, encode_imm(imm))
    }

    /// An RDMA WRITE with immediate value `word` (8 bytes) into the peer's mailbox.
    fn post_imm(&mut self, qp: &QueuePair, word: u32) -> io::Result<()> {
        let deadline = Instant::now() + self.stall;
        self.reap(qp)?;
        let bytes = u64::from(word).to_le_bytes();
        let staged = if self.max_inline < 8 { Some(self.stage(qp, &bytes, deadline)?) } else { None };
        self.sq_room(qp, 1, deadline)?;
        let wr = self.next_wr();
        let local = staged.unwrap_or(LocalSpan { addr: bytes.as_ptr() as u64, len: 8, lkey: 0 });
        self.list.write_with_imm(wr, local, self.remote.mailbox(), self.remote.rkey, staged.is_none(), word);
        self.submit(qp, &["credit"], false, true)
    }
}

/// What one look at the reading half found.
enum Got {
    Message,
    Credit(Imm),
    Idle,
}

/// The reading half: our ring and the receive completion queue.
struct Rx {
    cq: Arc<CompletionQueue>,
    reader: RingReader,
    control: Span,
    /// Keeps the ring and control page registered and mapped (the spans point into it).
    _ring: MemoryRegion<Buffer>,
    /// Receives posted and not yet consumed.
    outstanding: u32,
    depth: u32,
    /// Messages taken since the completion queue was last drained.
    taken: u32,
    completions: Vec<WorkCompletion>,
    events: VecDeque<Imm>,
}

impl Rx {
    fn head(&self) -> u64 {
        self.reader.head()
    }

    fn take_message(&mut self, qp: &QueuePair, buf: &mut Vec<u8>, expect: u32) -> io::Result<bool> {
        if !self.reader.poll(buf, expect, MAX_MESSAGE_BYTES)? {
            return Ok(false);
        }
        self.control.word(HEAD_WORD).store(self.reader.head().to_le(), Ordering::Release);
        self.taken += 1;
        if self.taken >= DRAIN_EVERY {
            self.drain(qp)?;
        }
        Ok(true)
    }

    /// Takes the receive completions that are ready (doorbells and credit messages) and
    /// re-posts receives. Anything but a WRITE with a known immediate fails the lane.
    fn drain(&mut self, qp: &QueuePair) -> io::Result<()> {
        self.taken = 0;
        loop {
            self.completions.clear();
            let n = self.cq.poll(&mut self.completions).map_err(verbs_io)?;
            for wc in &self.completions {
                self.outstanding = self.outstanding.saturating_sub(1);
                if !wc.status.is_success() {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!(
                            "a receive completed with {} (vendor error {:#x}): the lane's queue pair is in the error state",
                            wc.status, wc.vendor_err
                        ),
                    ));
                }
                if !wc.is_write_with_imm() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "the peer sent a receive completion of opcode {} (only WRITE with immediate is allowed)",
                            wc.opcode
                        ),
                    ));
                }
                let imm = wc
                    .imm
                    .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a WRITE with immediate without one"))?;
                match decode_imm(imm).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))? {
                    Imm::Message(_) => {}
                    credit => self.events.push_back(credit),
                }
            }
            if n < POLL_BATCH {
                break;
            }
        }
        if self.depth - self.outstanding >= RECV_REFILL.min(self.depth) {
            qp.post_empty_recvs((self.depth - self.outstanding) as usize, 0).map_err(verbs_io)?;
            self.outstanding = self.depth;
        }
        Ok(())
    }

    fn look(&mut self, qp: &QueuePair, buf: &mut Vec<u8>, expect: u32) -> io::Result<Option<Got>> {
        if let Some(credit) = self.events.pop_front() {
            return Ok(Some(Got::Credit(credit)));
        }
        if self.take_message(qp, buf, expect)? {
            return Ok(Some(Got::Message));
        }
        Ok(None)
    }

    /// About one poll interval: spins on the ring and the completion queue, then sleeps on
    /// the completion channel for up to [`SLEEP`].
    fn wait(&mut self, qp: &QueuePair, buf: &mut Vec<u8>, expect: u32) -> io::Result<Got> {
        for i in 0..SPIN_POLLS {
            if let Some(got) = self.look(qp, buf, expect)? {
                return Ok(got);
            }
            if i % 8 == 7 {
                self.drain(qp)?;
            }
            std::hint::spin_loop();
        }
        self.drain(qp)?;
        self.cq.arm().map_err(verbs_io)?;
        // A completion that landed before arming raised no event: look once more.
        self.drain(qp)?;
        if let Some(got) = self.look(qp, buf, expect)? {
            return Ok(got);
        }
        METRICS.sleeps.inc();
        self.cq.wait_event(SLEEP).map_err(verbs_io)?;
        self.drain(qp)?;
        Ok(self.look(qp, buf, expect)?.unwrap_or(Got::Idle))
    }
}

// ---- the sender's end ----

/// A sender's lane over RDMA.
pub(crate) struct VerbsLane {
    // Dropped first: once the QP is destroyed the NIC no longer touches the buffers below.
    qp: QueuePair,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    /// The server's request-ring head, as responses acknowledge it.
    acked: AtomicU64,
    /// Our response-ring head (for the `ack` of our requests).
    head: AtomicU64,
    /// Credits granted (or refused: 0) since the sender last looked.
    grant: Mutex<Option<u32>>,
    socket: TcpStream,
    max_message: usize,
}

impl ClientCarrier for VerbsLane {
    fn send(&self, message: &[u8]) -> io::Result<()> {
        let acked = self.acked.load(Ordering::Acquire);
        self.tx.lock().send(&self.qp, message, acked)
    }

    fn recv(&self, buf: &mut Vec<u8>, expect: u32) -> io::Result<bool> {
        let mut rx = self.rx.lock();
        match rx.wait(&self.qp, buf, expect)? {
            Got::Message => {
                self.head.store(rx.head(), Ordering::Release);
                Ok(true)
            }
            Got::Credit(Imm::Grant(credits)) => {
                let mut grant = self.grant.lock();
                *grant = Some(grant.unwrap_or(0).saturating_add(credits));
                Ok(false)
            }
            Got::Credit(other) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the region server sent {other:?} (only grants go that way)"),
            )),
            Got::Idle => {
                if crate::net::hung_up(self.socket.as_fd()) {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the region server closed the lane"));
                }
                // Nobody may be sending: surface a failed WRITE here.
                if let Some(mut tx) = self.tx.try_lock() {
                    tx.reap(&self.qp)?;
                }
                Ok(false)
            }
        }
    }

    fn acked(&self, head: u64) {
        self.acked.fetch_max(head, Ordering::AcqRel);
    }

    fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    fn max_message(&self) -> usize {
        self.max_message
    }

    fn shutdown(&self) {
        let _ = self.qp.to_error();
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }

    fn credit_channel(&self) -> bool {
        true
    }

    fn renew(&self, degree_x16: u16, rate_krps: u16) -> io::Result<()> {
        self.tx.lock().credit(&self.qp, Imm::Renew { degree_x16, rate_krps })
    }

    fn take_grant(&self) -> Option<u32> {
        self.grant.lock().take()
    }

    fn inject_fault(&self) {
        let _ = self.qp.to_error();
    }
}

impl Drop for VerbsLane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A dialled lane before a sender takes it: QP, halves, the TCP connection and the answer.
struct Dialled {
    qp: QueuePair,
    tx: Tx,
    rx: Rx,
    stream: TcpStream,
    accept: wire::FlockAccept,
}

/// Sets up our end of a lane, opens its TCP connection (hello, FlockOpen with our QP and
/// ring), and connects to the server's end from its FlockAccept.
fn dial(addr: &str, options: &ConnectOptions, sender: u64, lane: u16) -> Result<Dialled, TransportError> {
    use std::io::Write;
    let peer = format!("verbs:{addr}");
    let fail = |reason: String| TransportError::Connect { endpoint: peer.clone(), reason };
    let device = local::shared().map_err(|e| fail(e.to_string()))?;
    let resources =
        Resources::create(&device).map_err(|e| fail(format!("setting up an rpc lane's queue pair: {e}")))?;
    let (mut stream, _) = crate::net::dial_plain(addr, &peer, options)?;
    let mut out = Vec::new();
    let open = wire::FlockOpen { sender, lane, verbs: Some(resources.describe()) };
    wire::encode_flock_open(&mut out, &open);
    stream.write_all(&out).map_err(|e| fail(e.to_string()))?;
    let accept = crate::net::await_accept(&mut stream, options.timeout, &peer)?;
    let theirs = accept.verbs.ok_or_else(|| {
        TransportError::Protocol(format!("{peer} accepted an rpc lane without its queue pair and ring"))
    })?;
    check_peer(&theirs).map_err(|e| TransportError::Protocol(format!("{peer}: {e}")))?;
    resources.connect(&theirs).map_err(|e| fail(format!("connecting an rpc lane's queue pair: {e}")))?;
    let (qp, tx, rx) = resources.split(&theirs, accept.key, options.timeout);
    Ok(Dialled { qp, tx, rx, stream, accept })
}

/// Opens lane `lane` of sender `sender` to the region server's `verbs:` listener at `addr`.
pub(crate) fn open_verbs_lane(
    addr: &str,
    options: &ConnectOptions,
    sender: u64,
    lane: u16,
) -> Result<LaneSetup, TransportError> {
    let Dialled { qp, tx, rx, stream, accept } = dial(addr, options, sender, lane)?;
    let max_message = tx.writer.max_message().min(MAX_MESSAGE_BYTES);
    let carrier = VerbsLane {
        qp,
        tx: Mutex::new(tx),
        rx: Mutex::new(rx),
        acked: AtomicU64::new(0),
        head: AtomicU64::new(0),
        grant: Mutex::new(None),
        socket: stream,
        max_message,
    };
    Ok(LaneSetup { carrier: Box::new(carrier), key: accept.key, credits: accept.credits, batch: accept.batch })
}

/// Tests only: one verbs lane with no sender on top, to put arbitrary bytes into the
/// server's ring and arbitrary immediate values on its completion queue.
#[doc(hidden)]
pub struct RawVerbsLane {
    qp: QueuePair,
    tx: Tx,
    rx: Rx,
    stream: TcpStream,
    /// The lane's canary key and initial credits, from FlockAccept.
    pub key: u32,
    pub credits: u32,
    received: u64,
    buf: Vec<u8>,
}

impl RawVerbsLane {
    /// Opens a lane (hello, FlockOpen with our QP and ring) to the `verbs:` listener at `addr`.
    pub fn open(addr: &str, options: &ConnectOptions) -> Result<Self, TransportError> {
        let Dialled { qp, tx, rx, stream, accept } = dial(addr, options, crate::net::random_u64(), 0)?;
        Ok(Self { qp, tx, rx, stream, key: accept.key, credits: accept.credits, received: 0, buf: Vec::new() })
    }

    /// Writes `bytes` (a multiple of 8, at most one maximal message) where the next message
    /// belongs in the server's ring, as one RDMA WRITE with immediate (doorbell).
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        assert!(bytes.len().is_multiple_of(8) && bytes.len() <= self.tx.writer.max_message());
        self.tx.send(&self.qp, bytes, u64::MAX)
    }

    /// Sends an RDMA WRITE with immediate value `imm` into the server's mailbox.
    pub fn write_imm(&mut self, imm: u32) -> io::Result<()> {
        self.tx.post_imm(&self.qp, imm)
    }

    /// A well-formed credit renewal.
    pub fn renew(&mut self) -> io::Result<()> {
        self.write_imm(encode_imm(Imm::Renew { degree_x16: 16, rate_krps: 1 }))
    }

    /// A grant, which only the server may send.
    pub fn grant_credits(&mut self, credits: u32) -> io::Result<()> {
        self.write_imm(encode_imm(Imm::Grant(credits)))
    }

    /// Waits up to `timeout` for the server's next message; grants that arrive meanwhile
    /// are returned as `Err(credits)` in the outer Ok.
    pub fn read(&mut self, timeout: Duration) -> io::Result<Option<Result<Vec<u8>, u32>>> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let expect = message::canary(self.key, self.received);
            match self.rx.wait(&self.qp, &mut self.buf, expect)? {
                Got::Message => {
                    self.received += 1;
                    return Ok(Some(Ok(self.buf.clone())));
                }
                Got::Credit(Imm::Grant(credits)) => return Ok(Some(Err(credits))),
                Got::Credit(other) => {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, format!("server sent {other:?}")))
                }
                Got::Idle => {}
            }
        }
        Ok(None)
    }

    /// True once the server has closed the lane (its end of the TCP connection), waiting up
    /// to `within`.
    pub fn closed_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if crate::net::hung_up(self.stream.as_fd()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for RawVerbsLane {
    fn drop(&mut self) {
        let _ = self.qp.to_error();
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

// ---- the region server's end ----

/// The receiver's end of a verbs lane, in the region server.
pub(crate) struct ServerLane {
    qp: QueuePair,
    tx: Tx,
    rx: Rx,
    /// The sender's response-ring head, as its requests acknowledge it.
    acked: u64,
    socket: Option<OwnedFd>,
    max_message: usize,
}

impl ServerLane {
    /// Creates the server's end for the sender described by `peer` and connects it; returns
    /// it with the description of ours (for FlockAccept).
    pub fn accept(
        device: &Arc<LocalDevice>,
        peer: &FlockVerbs,
        key: u32,
        stall: Duration,
    ) -> Result<(Self, FlockVerbs), String> {
        check_peer(peer)?;
        let resources = Resources::create(device).map_err(|e| e.to_string())?;
        resources.connect(peer).map_err(|e| e.to_string())?;
        let mine = resources.describe();
        let (qp, tx, rx) = resources.split(peer, key, stall);
        let max_message = tx.writer.max_message().min(MAX_MESSAGE_BYTES);
        Ok((Self { qp, tx, rx, acked: 0, socket: None, max_message }, mine))
    }

    /// Watches `socket` (the lane's TCP connection) to notice the sender leaving.
    pub fn watch(&mut self, socket: BorrowedFd<'_>) {
        self.socket = socket.try_clone_to_owned().ok();
    }
}

impl Drop for ServerLane {
    fn drop(&mut self) {
        let _ = self.qp.to_error();
    }
}

impl ServerCarrier for ServerLane {
    fn recv(&mut self, buf: &mut Vec<u8>, expect: u32) -> io::Result<Received> {
        match self.rx.wait(&self.qp, buf, expect)? {
            Got::Message => Ok(Received::Message),
            Got::Credit(Imm::Renew { degree_x16, rate_krps }) => Ok(Received::Renewal(SenderStats {
                degree: f64::from(degree_x16) / 16.0,
                rate: f64::from(rate_krps) * 1000.0,
            })),
            Got::Credit(other) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a sender sent {other:?} (only renewals go that way)"),
            )),
            Got::Idle => {
                if self.socket.as_ref().is_some_and(|s| crate::net::hung_up(s.as_fd())) {
                    return Ok(Received::Closed);
                }
                self.tx.reap(&self.qp)?;
                Ok(Received::Idle)
            }
        }
    }

    fn send(&mut self, message: &[u8]) -> io::Result<()> {
        self.tx.send(&self.qp, message, self.acked)
    }

    fn head(&self) -> u64 {
        self.rx.head()
    }

    fn acked(&mut self, head: u64) {
        self.acked = self.acked.max(head);
    }

    fn grant(&mut self, credits: u32) -> io::Result<()> {
        self.tx.credit(&self.qp, Imm::Grant(credits))
    }

    fn max_message(&self) -> usize {
        self.max_message
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn immediates_round_trip_and_saturate() {
        for imm in [
            Imm::Message(0),
            Imm::Message(VALUE_MASK),
            Imm::Renew { degree_x16: 16, rate_krps: 0 },
            Imm::Renew { degree_x16: MAX_DEGREE_X16, rate_krps: MAX_RATE_KRPS },
            Imm::Grant(0),
            Imm::Grant(32),
        ] {
            assert_eq!(decode_imm(encode_imm(imm)), Ok(imm));
        }
        assert_eq!(
            decode_imm(encode_imm(Imm::Renew { degree_x16: u16::MAX, rate_krps: u16::MAX })),
            Ok(Imm::Renew { degree_x16: MAX_DEGREE_X16, rate_krps: MAX_RATE_KRPS })
        );
        assert_eq!(decode_imm(encode_imm(Imm::Grant(u32::MAX))), Ok(Imm::Grant(VALUE_MASK)));
        assert!(decode_imm(0).is_err());
        assert!(decode_imm(7 << TAG_SHIFT).is_err());
    }

    proptest! {
        #[test]
        fn any_immediate_decodes_without_panicking(word in any::<u32>()) {
            if let Ok(imm) = decode_imm(word) {
                prop_assert_eq!(encode_imm(imm), word);
            }
        }
    }

    #[test]
    fn peers_with_odd_rings_are_refused() {
        let qp = QpInfo { qpn: 1, psn: 1, lid: 0, mtu: 3, rd_atomic: 1, gid: [0; 16] };
        let good = FlockVerbs { qp, ring_addr: 4096, ring_rkey: 1, ring_len: ring_bytes() as u64 };
        assert!(check_peer(&good).is_ok());
        assert!(check_peer(&FlockVerbs { ring_len: 4096, ..good }).is_err());
        assert!(check_peer(&FlockVerbs { ring_addr: 4097, ..good }).is_err());
        assert!(check_peer(&FlockVerbs { ring_addr: u64::MAX - 4095, ..good }).is_err());
    }
}
