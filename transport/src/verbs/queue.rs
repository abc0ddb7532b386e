//! Completion queues (optionally with a completion channel to sleep on), RC queue pairs
//! (INIT -> RTR -> RTS), linked send lists, receive work requests and polling.

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::os::raw::{c_int, c_uint};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys as sys;

use super::device::Context;
use super::error::VerbsError;
use super::memory::{Access, ProtectionDomain};

/// Completions fetched per `ibv_poll_cq` call.
pub(crate) const POLL_BATCH: usize = 16;

/// A completion queue.
pub(crate) struct CompletionQueue {
    raw: NonNull<sys::ibv_cq>,
    ctx: Arc<Context>,
    /// Where its events arrive once armed ([`Self::arm`]); destroyed after the CQ.
    channel: Option<Arc<CompletionChannel>>,
}

// SAFETY: libibverbs allows polling a CQ from any thread (providers lock internally); the
// owners of our CQs poll under their own lock anyway.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

/// How one work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub vendor_err: u32,
    /// An `ibv_wc_opcode` (valid only for successful completions).
    pub opcode: u32,
    /// The immediate value of an incoming RDMA WRITE with immediate, in host order.
    pub imm: Option<u32>,
}

impl WorkCompletion {
    /// A successful receive completion raised by the peer's RDMA WRITE with immediate.
    pub fn is_write_with_imm(&self) -> bool {
        self.status.is_success() && self.opcode == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
    }
}

/// An `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WcStatus(pub u32);

impl WcStatus {
    pub fn is_success(self) -> bool {
        self.0 == sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The C enum's name, e.g. `IBV_WC_REM_ACCESS_ERR`.
    pub fn name(self) -> &'static str {
        use sys::ibv_wc_status::*;
        match self.0 {
            IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
            IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
            IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
            IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
            IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
            IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
            IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
            IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
            IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
            IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
            IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
            IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
            IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
            IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
            IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
            IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
            IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
            IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
            IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
            IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
            IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
            IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
            _ => "IBV_WC_(unknown)",
        }
    }

    /// libibverbs' description, e.g. "remote access error".
    pub fn description(self) -> String {
        // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
        unsafe {
            let text = sys::ibv_wc_status_str(self.0);
            if text.is_null() {
                return "unknown".into();
            }
            CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.description())
    }
}

impl CompletionQueue {
    /// A CQ with room for at least `entries` completions.
    pub fn new(ctx: &Arc<Context>, entries: u32) -> Result<Arc<Self>, VerbsError> {
        let entries = entries.min(ctx.caps().max_cqe).max(1);
        // SAFETY: an open context; no completion channel (we poll), vector 0.
        let raw = unsafe { sys::ibv_create_cq(ctx.raw(), entries as c_int, ptr::null_mut(), ptr::null_mut(), 0) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_create_cq", ctx.name()))?;
        Ok(Arc::new(Self { raw, ctx: Arc::clone(ctx), channel: None }))
    }

    /// A CQ whose completions, once [armed](Self::arm), raise an event on its own new
    /// completion channel, so a thread can sleep until the next completion
    /// ([`Self::wait_event`]) instead of polling.
    pub fn with_channel(ctx: &Arc<Context>, entries: u32) -> Result<Arc<Self>, VerbsError> {
        let channel = CompletionChannel::new(ctx)?;
        let entries = entries.min(ctx.caps().max_cqe).max(1);
        // SAFETY: an open context and a live channel of the same context (kept alive by the
        // Arc we store, and destroyed only after this CQ); no user context, vector 0.
        let raw = unsafe { sys::ibv_create_cq(ctx.raw(), entries as c_int, ptr::null_mut(), channel.raw.as_ptr(), 0) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_create_cq", ctx.name()))?;
        Ok(Arc::new(Self { raw, ctx: Arc::clone(ctx), channel: Some(channel) }))
    }

    /// Requests an event on the completion channel for the next completion (any kind). One
    /// event per arming: arm, poll once more (a completion that landed before arming raises
    /// no event), then [`Self::wait_event`].
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: a live CQ; ibv_req_notify_cq only arms it.
        let ret = unsafe { sys::ibv_req_notify_cq(self.raw.as_ptr(), 0) };
        if ret != 0 {
            return Err(VerbsError::call("ibv_req_notify_cq", self.ctx.name(), ret));
        }
        Ok(())
    }

    /// Sleeps until the armed CQ raises an event or `timeout` passes; true if an event came
    /// (it is consumed and acknowledged). Without a channel it just returns false.
    pub fn wait_event(&self, timeout: Duration) -> Result<bool, VerbsError> {
        let Some(channel) = &self.channel else {
            return Ok(false);
        };
        let mut fds = [libc::pollfd { fd: channel.fd(), events: libc::POLLIN, revents: 0 }];
        let millis = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX).max(1);
        // SAFETY: one valid pollfd; poll only writes its revents.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, millis) };
        if n <= 0 {
            return Ok(false); // timeout, or EINTR: the caller polls again either way
        }
        let mut cq: *mut sys::ibv_cq = ptr::null_mut();
        let mut context: *mut std::ffi::c_void = ptr::null_mut();
        // SAFETY: a live channel whose fd is non-blocking (set in CompletionChannel::new), so
        // this returns at once; on success it stores the CQ the event is for.
        let ret = unsafe { sys::ibv_get_cq_event(channel.raw.as_ptr(), &mut cq, &mut context) };
        if ret != 0 {
            return Ok(false); // EAGAIN: someone else took it, or a spurious wake-up
        }
        // Each channel serves exactly one CQ (this one), so `cq` is us.
        debug_assert_eq!(cq, self.raw.as_ptr());
        // SAFETY: acknowledging the one event we just took on our own CQ (ibv_destroy_cq
        // waits for every taken event to be acknowledged).
        unsafe { sys::ibv_ack_cq_events(self.raw.as_ptr(), 1 as c_uint) };
        Ok(true)
    }

    /// Appends the completions that are ready (at most [`POLL_BATCH`]) to `out`; returns how
    /// many. Never blocks.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        let mut wcs = MaybeUninit::<[sys::ibv_wc; POLL_BATCH]>::uninit();
        // SAFETY: a live CQ and room for POLL_BATCH ibv_wc entries; the provider fills the
        // first `n` of them.
        let n = unsafe { sys::ibv_poll_cq(self.raw.as_ptr(), POLL_BATCH as c_int, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(VerbsError::call("ibv_poll_cq", self.ctx.name(), n));
        }
        let n = n as usize;
        for i in 0..n {
            // SAFETY: entry i < n was written by ibv_poll_cq; we read only POD fields.
            let wc = unsafe { &*wcs.as_ptr().cast::<sys::ibv_wc>().add(i) };
            let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            // SAFETY: with IBV_WC_WITH_IMM set the union holds the immediate (network order);
            // both union members are plain u32s anyway.
            let imm = with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
            out.push(WorkCompletion {
                wr_id: wc.wr_id,
                status: WcStatus(wc.status),
                vendor_err: wc.vendor_err,
                opcode: wc.opcode,
                imm,
            });
        }
        Ok(n)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc to it, so none is left; destroyed once.
        let ret = unsafe { sys::ibv_destroy_cq(self.raw.as_ptr()) };
        if ret != 0 {
            tracing::warn!("ibv_destroy_cq on {} failed: {}", self.ctx.name(), std::io::Error::from_raw_os_error(ret));
        }
    }
}

/// A completion channel: the file descriptor a CQ's events arrive on.
pub(crate) struct CompletionChannel {
    raw: NonNull<sys::ibv_comp_channel>,
    ctx: Arc<Context>,
}

// SAFETY: the channel is only passed to libibverbs calls (thread-safe) and its fd to poll.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: an open context; the result is ours until ibv_destroy_comp_channel.
        let raw = unsafe { sys::ibv_create_comp_channel(ctx.raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_create_comp_channel", ctx.name()))?;
        let channel = Arc::new(Self { raw, ctx: Arc::clone(ctx) });
        let fd = channel.fd();
        // SAFETY: fcntl on the channel's own open descriptor; only its status flags change.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(VerbsError::call("fcntl(O_NONBLOCK) on a completion channel", ctx.name(), -1));
        }
        Ok(channel)
    }

    fn fd(&self) -> c_int {
        // SAFETY: a live channel; its fd is fixed at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: the CQs using this channel hold an Arc to it, so they are gone; destroyed once.
        let ret = unsafe { sys::ibv_destroy_comp_channel(self.raw.as_ptr()) };
        if ret != 0 {
            tracing::warn!(
                "ibv_destroy_comp_channel on {} failed: {}",
                self.ctx.name(),
                std::io::Error::from_raw_os_error(ret)
            );
        }
    }
}

/// Send/receive queue sizes of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_inline_data: u32,
}

/// Where the other end of an RC queue pair is, and how to reach it (for INIT -> RTR).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemotePath {
    pub port: u8,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub dlid: u16,
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    /// Use a GRH (always on RoCE).
    pub global: bool,
    /// `ibv_mtu` code.
    pub mtu: u32,
    /// Incoming READ/atomic requests this end may have in flight (responder resources).
    pub max_dest_rd_atomic: u8,
}

/// Reliability settings for RTR -> RTS.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendPath {
    pub sq_psn: u32,
    /// Outgoing READ/atomic requests in flight (initiator depth).
    pub max_rd_atomic: u8,
    /// Local ACK timeout exponent: 4.096 us * 2^timeout per try.
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
}

/// A reliable-connected queue pair.
pub(crate) struct QueuePair {
    raw: NonNull<sys::ibv_qp>,
    caps: QpCaps,
    device: String,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: libibverbs allows control verbs on a QP from any thread, and post_send is
// thread-safe in providers; our owners serialize posting anyway.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

fn mask(bits: &[sys::ibv_qp_attr_mask]) -> c_int {
    bits.iter().fold(0u32, |acc, m| acc | m.0) as c_int
}

impl QueuePair {
    /// Creates an RC QP whose send and receive completions go to `cq`. `caps` are wishes; the
    /// result's [`Self::caps`] are what the device granted (inline data may come back smaller).
    pub fn create_rc(pd: &Arc<ProtectionDomain>, cq: &Arc<CompletionQueue>, caps: QpCaps) -> Result<Self, VerbsError> {
        Self::create_rc_split(pd, cq, cq, caps)
    }

    /// [`Self::create_rc`] with send and receive completions on different CQs.
    pub fn create_rc_split(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        let ctx = pd.context();
        // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers, zero sizes).
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.raw.as_ptr();
        init.recv_cq = recv_cq.raw.as_ptr();
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0; // selective signaling: only WRs flagged SIGNALED complete on success
        init.cap.max_send_wr = caps.max_send_wr;
        init.cap.max_recv_wr = caps.max_recv_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = caps.max_inline_data;
        // SAFETY: a live PD and CQs (kept alive by the Arcs we store); `init` is fully set.
        let raw = unsafe { sys::ibv_create_qp(pd.raw(), &mut init) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_create_qp", ctx.name()))?;
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_inline_data: init.cap.max_inline_data.min(caps.max_inline_data),
        };
        Ok(Self {
            raw,
            caps: granted,
            device: ctx.name().to_string(),
            _send_cq: Arc::clone(send_cq),
            _recv_cq: Arc::clone(recv_cq),
            _pd: Arc::clone(pd),
        })
    }

    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: a live QP; qp_num is fixed at creation.
        unsafe { (*self.raw.as_ptr()).qp_num }
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        bits: &[sys::ibv_qp_attr_mask],
        what: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: a live QP and a fully initialized attribute struct; the mask names only
        // fields we set.
        let ret = unsafe { sys::ibv_modify_qp(self.raw.as_ptr(), attr, mask(bits)) };
        if ret != 0 {
            return Err(VerbsError::call(what, &self.device, ret));
        }
        Ok(())
    }

    fn zeroed_attr() -> sys::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain data; all-zero is valid.
        unsafe { std::mem::zeroed() }
    }

    /// RESET -> INIT on `port`, allowing `access` from the remote side.
    pub fn to_init(&self, port: u8, access: Access) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = access.bits();
        self.modify(
            &mut attr,
            &[m::IBV_QP_STATE, m::IBV_QP_PKEY_INDEX, m::IBV_QP_PORT, m::IBV_QP_ACCESS_FLAGS],
            "ibv_modify_qp(INIT)",
        )
    }

    /// INIT -> RTR: connect to the remote QP.
    pub fn to_rtr(&self, path: &RemotePath) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path.mtu;
        attr.dest_qp_num = path.dest_qpn;
        attr.rq_psn = path.rq_psn;
        attr.max_dest_rd_atomic = path.max_dest_rd_atomic;
        // 0.64 ms: how long a peer waits before retrying a WRITE with immediate (or SEND) that
        // found no receive posted; FLOCK lanes keep receives posted, other QPs expect none.
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = path.dlid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = path.port;
        if path.global {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = sys::ibv_gid { raw: path.dgid };
            attr.ah_attr.grh.sgid_index = path.sgid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = 0;
            attr.ah_attr.grh.flow_label = 0;
        }
        self.modify(
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_AV,
                m::IBV_QP_PATH_MTU,
                m::IBV_QP_DEST_QPN,
                m::IBV_QP_RQ_PSN,
                m::IBV_QP_MAX_DEST_RD_ATOMIC,
                m::IBV_QP_MIN_RNR_TIMER,
            ],
            "ibv_modify_qp(RTR)",
        )
    }

    /// RTR -> RTS: ready to send.
    pub fn to_rts(&self, path: &SendPath) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = path.sq_psn;
        attr.max_rd_atomic = path.max_rd_atomic;
        attr.timeout = path.timeout;
        attr.retry_cnt = path.retry_cnt;
        attr.rnr_retry = path.rnr_retry;
        self.modify(
            &mut attr,
            &[
                m::IBV_QP_STATE,
                m::IBV_QP_SQ_PSN,
                m::IBV_QP_MAX_QP_RD_ATOMIC,
                m::IBV_QP_TIMEOUT,
                m::IBV_QP_RETRY_CNT,
                m::IBV_QP_RNR_RETRY,
            ],
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to ERR: every outstanding work request is flushed and the NIC stops
    /// touching the buffers they name.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut attr = Self::zeroed_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut attr, &[sys::ibv_qp_attr_mask::IBV_QP_STATE], "ibv_modify_qp(ERR)")
    }

    /// Posts `count` receive work requests without buffers, each with `wr_id`. They are
    /// consumed by the peer's RDMA WRITEs with immediate (which place their data where the
    /// WRITE says, not in a receive buffer) and complete with the immediate value.
    pub fn post_empty_recvs(&self, count: usize, wr_id: u64) -> Result<(), VerbsError> {
        if count == 0 {
            return Ok(());
        }
        // SAFETY: all-zero is a valid ibv_recv_wr (no next, no scatter/gather entries).
        let mut wrs: Vec<sys::ibv_recv_wr> = (0..count).map(|_| unsafe { std::mem::zeroed() }).collect();
        let base = wrs.as_mut_ptr();
        for i in 0..count {
            // SAFETY: i < count == wrs.len(); the links stay inside the vector, which is not
            // resized before the call below returns.
            unsafe {
                let wr = base.add(i);
                (*wr).wr_id = wr_id;
                (*wr).num_sge = 0;
                (*wr).next = if i + 1 < count { base.add(i + 1) } else { ptr::null_mut() };
            }
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: a live QP and a null-terminated chain of WRs without buffers (nothing for the
        // NIC to access later); libibverbs copies the WRs before returning.
        let ret = unsafe { sys::ibv_post_recv(self.raw.as_ptr(), base, &mut bad) };
        if ret != 0 {
            return Err(VerbsError::call("ibv_post_recv", &self.device, ret));
        }
        Ok(())
    }

    /// Posts every work request of `list` with one `ibv_post_send` (one doorbell).
    ///
    /// # Safety
    /// Every non-inline scatter/gather entry of `list` must lie in memory registered in this
    /// QP's PD that stays registered, and that the CPU neither reads nor writes, until the
    /// request completes (or the QP is destroyed or moved to ERR and drained). Inline entries
    /// need only be valid for the duration of this call.
    pub unsafe fn post_send(&self, list: &mut SendList) -> Result<(), PostError> {
        let head = list.link();
        if head.is_null() {
            return Ok(());
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: `head` starts a null-terminated chain of WRs in `list`, whose sg_list
        // pointers point into `list.sges`; both stay put during the call (we hold `&mut list`).
        // The memory they describe is the caller's obligation (see above).
        let ret = unsafe { sys::ibv_post_send(self.raw.as_ptr(), head, &mut bad) };
        if ret == 0 {
            return Ok(());
        }
        let first_failed = if bad.is_null() {
            0
        } else {
            // SAFETY: on failure `bad` points at the first WR of the chain that was not posted,
            // an element of `list.wrs`.
            unsafe { bad.offset_from(list.wrs.as_ptr()) }.max(0) as usize
        };
        Err(PostError { first_failed, source: std::io::Error::from_raw_os_error(ret) })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed exactly once. After this the NIC no longer processes its WRs.
        let ret = unsafe { sys::ibv_destroy_qp(self.raw.as_ptr()) };
        if ret != 0 {
            tracing::warn!("ibv_destroy_qp on {} failed: {}", self.device, std::io::Error::from_raw_os_error(ret));
        }
    }
}

/// `ibv_post_send` refused part of a list: requests before `first_failed` were posted.
#[derive(Debug)]
pub(crate) struct PostError {
    pub first_failed: usize,
    pub source: std::io::Error,
}

/// Local memory a work request reads from or writes to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalSpan {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// A reusable list of send work requests, linked (`next`, `sg_list`) only when posted, so
/// pushing may reallocate freely. Clearing keeps the allocations.
#[derive(Default)]
pub(crate) struct SendList {
    wrs: Vec<sys::ibv_send_wr>,
    sges: Vec<sys::ibv_sge>,
}

// SAFETY: the raw pointers inside the WRs are only links into this list's own vectors (set
// by `link` right before posting) or addresses that are never dereferenced by Rust code.
unsafe impl Send for SendList {}

impl SendList {
    pub fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
    }

    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    fn push(&mut self, wr_id: u64, opcode: u32, local: LocalSpan, flags: u32, remote: sys::wr_t) {
        // SAFETY: ibv_send_wr is plain C data (pointers, integers, unions of those); all-zero
        // is a valid value.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.opcode = opcode;
        wr.send_flags = flags;
        // A zero-length transfer has no scatter/gather entry.
        wr.num_sge = c_int::from(local.len > 0);
        wr.wr = remote;
        self.wrs.push(wr);
        self.sges.push(sys::ibv_sge { addr: local.addr, length: local.len, lkey: local.lkey });
    }

    /// RDMA READ of `local.len` bytes at `remote_addr` into `local`.
    pub fn read(&mut self, wr_id: u64, local: LocalSpan, remote_addr: u64, rkey: u32) {
        let remote = sys::wr_t { rdma: sys::rdma_t { remote_addr, rkey } };
        self.push(wr_id, sys::ibv_wr_opcode::IBV_WR_RDMA_READ, local, 0, remote);
    }

    /// RDMA WRITE of `local` to `remote_addr`; `inline` copies the bytes at post time.
    pub fn write(&mut self, wr_id: u64, local: LocalSpan, remote_addr: u64, rkey: u32, inline: bool) {
        let remote = sys::wr_t { rdma: sys::rdma_t { remote_addr, rkey } };
        let flags = if inline { sys::ibv_send_flags::IBV_SEND_INLINE.0 } else { 0 };
        self.push(wr_id, sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, local, flags, remote);
    }

    /// RDMA WRITE with immediate: like [`Self::write`], and the peer gets a receive
    /// completion carrying `imm` (consuming one of its posted receives). `local.len` may be 0
    /// (a doorbell or credit message with no data).
    pub fn write_with_imm(
        &mut self,
        wr_id: u64,
        local: LocalSpan,
        remote_addr: u64,
        rkey: u32,
        inline: bool,
        imm: u32,
    ) {
        let remote = sys::wr_t { rdma: sys::rdma_t { remote_addr, rkey } };
        let flags = if inline { sys::ibv_send_flags::IBV_SEND_INLINE.0 } else { 0 };
        self.push(wr_id, sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, local, flags, remote);
        let wr = self.wrs.last_mut().expect("just pushed");
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    }

    /// 8-byte compare-and-swap; the old value lands in `local` (8 bytes).
    pub fn compare_and_swap(
        &mut self,
        wr_id: u64,
        local: LocalSpan,
        remote_addr: u64,
        rkey: u32,
        expected: u64,
        new: u64,
    ) {
        let remote = sys::wr_t { atomic: sys::atomic_t { remote_addr, compare_add: expected, swap: new, rkey } };
        self.push(wr_id, sys::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP, local, 0, remote);
    }

    /// 8-byte fetch-and-add; the old value lands in `local` (8 bytes).
    pub fn fetch_and_add(&mut self, wr_id: u64, local: LocalSpan, remote_addr: u64, rkey: u32, addend: u64) {
        let remote = sys::wr_t { atomic: sys::atomic_t { remote_addr, compare_add: addend, swap: 0, rkey } };
        self.push(wr_id, sys::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD, local, 0, remote);
    }

    /// Requests a completion for the last WR (selective signaling: on RC, completions arrive
    /// in order, so the last one's completion means all earlier ones succeeded).
    pub fn signal_last(&mut self) {
        if let Some(last) = self.wrs.last_mut() {
            last.send_flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
    }

    /// Links the WRs into a chain and each to its SGE; returns the head (null when empty).
    fn link(&mut self) -> *mut sys::ibv_send_wr {
        let n = self.wrs.len();
        if n == 0 {
            return ptr::null_mut();
        }
        // One raw pointer per vector, derived once, so the links all share its provenance.
        let sges = self.sges.as_mut_ptr();
        let wrs = self.wrs.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n == wrs.len() == sges.len() (push adds one of each), so every
            // pointer formed is in bounds; the vectors are not resized until the next push,
            // after posting.
            unsafe {
                let wr = wrs.add(i);
                (*wr).sg_list = sges.add(i);
                (*wr).next = if i + 1 < n { wrs.add(i + 1) } else { ptr::null_mut() };
            }
        }
        wrs
    }
}
