//! [`VerbsConnection`]: a [`Connection`] whose batches are RDMA work requests on an RC queue
//! pair and whose RPCs travel on FLOCK lanes, each its own RC queue pair writing into
//! registered rings (`crate::flock::verbs`), opened on the first call.
//!
//! A batch becomes a chain of linked work requests posted with one `ibv_post_send` (one
//! doorbell); only the last is signaled. On RC, requests execute at the responder in order
//! and complete in order, so the last one's successful completion means every op succeeded,
//! and an error completion (always generated, signaled or not) names the op that failed.
//! READs land in a registered staging buffer and are copied into the batch; CAS and FAA
//! results land in 8-byte slots of the same buffer; WRITEs up to the QP's inline limit are
//! copied into the work request itself, larger ones go through a registered write buffer.
//!
//! Sharing: many threads may use one connection. A mutex covers post and poll of a batch, so
//! batches from different threads run one after another (simple and correct; a per-thread
//! send queue or a FLOCK-style coalescer would overlap them). RPCs do not take that lock:
//! they go through the connection's FLOCK channel, whose lanes have queue pairs of their own.
//!
//! Failure: an error completion (remote access error, retry exceeded, flush, ...), a missing
//! completion within the connection's timeout, or the control channel closing makes the
//! connection unhealthy for good ([`Connection::is_healthy`] turns false) and every later
//! call fails at once; the caller (the computenode's pool) replaces it. A failed RPC lane
//! fails only the calls in flight on it; the channel opens new lanes once all have failed.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntCounterVec};

use super::error::VerbsError;
use super::local::{self, LocalDevice};
use super::memory::{Access, Buffer, MemoryRegion, ProtectionDomain};
use super::queue::{CompletionQueue, LocalSpan, QpCaps, QueuePair, RemotePath, SendList, SendPath, WorkCompletion};
use super::{random_psn, MAX_RD_ATOMIC, QP_RETRY_CNT, QP_RNR_RETRY, QP_TIMEOUT};
use crate::batch::{Batch, OpKind, MAX_BATCH_BYTES, MAX_BATCH_OPS};
use crate::error::TransportError;
use crate::flock::verbs::open_verbs_lane;
use crate::flock::{Channel, FlockOptions};
use crate::mux::error_frame;
use crate::wire::{self, Kind, QpInfo, VerbsAccept};
use crate::{ConnectOptions, Connection, TransportKind};

/// Send queue depth: a whole batch is posted at once and fully completed before the next.
const SEND_QUEUE_DEPTH: u32 = MAX_BATCH_OPS as u32;
/// Room for a completion per work request (errors and flushes complete even unsignaled), twice.
const CQ_ENTRIES: u32 = 2 * MAX_BATCH_OPS as u32;
/// Inline sizes to ask for, best first; the device may grant less or refuse (then we try the
/// next). Writes up to the granted size skip the staging copy and the NIC's DMA read.
const INLINE_WISHES: [u32; 3] = [256, 64, 0];
/// One 8-byte result slot per op index for CAS and FAA, at the start of the read buffer.
const ATOMIC_AREA: usize = MAX_BATCH_OPS * 8;
/// Staging buffers start this big and double (re-registered) as batches need, up to
/// [`MAX_BATCH_BYTES`]; a pool of idle connections thus pins little memory.
const INITIAL_STAGING: usize = 64 << 10;
/// Busy polls before a waiting thread starts yielding the CPU between polls.
const SPIN_POLLS: u32 = 64;

struct Metrics {
    batches: IntCounter,
    batch_seconds: Histogram,
    rpcs: IntCounter,
    completion_errors: IntCounterVec,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        batches: metric::counter("racekv_transport_verbs_batches_total", "Batches posted on verbs queue pairs"),
        batch_seconds: metric::latency_histogram(
            "racekv_transport_verbs_batch_seconds",
            "Post to last completion of one verbs batch",
        ),
        rpcs: metric::counter("racekv_transport_verbs_rpcs_total", "RPCs called on verbs connections (FLOCK lanes)"),
        completion_errors: metric::counter_vec(
            "racekv_transport_verbs_completion_errors_total",
            "Work completions with an error status",
            &["status"],
            &[],
        ),
    }
});

/// The registered local buffers of a connection.
struct Staging {
    pd: Arc<ProtectionDomain>,
    /// `[0, ATOMIC_AREA)`: CAS/FAA results by op index; then READ data in op order.
    reads: MemoryRegion<Buffer>,
    /// Payloads of WRITEs too large to inline, in op order.
    writes: MemoryRegion<Buffer>,
}

impl Staging {
    fn new(pd: &Arc<ProtectionDomain>) -> Result<Self, VerbsError> {
        Ok(Self {
            pd: Arc::clone(pd),
            reads: Self::buffer(pd, ATOMIC_AREA + INITIAL_STAGING)?,
            writes: Self::buffer(pd, INITIAL_STAGING)?,
        })
    }

    fn buffer(pd: &Arc<ProtectionDomain>, len: usize) -> Result<MemoryRegion<Buffer>, VerbsError> {
        MemoryRegion::register(pd, Buffer::new(len)?, Access::LOCAL_WRITE)
    }

    /// Grows the buffers to hold `read_bytes` of READ data and `write_bytes` of staged WRITE
    /// data. Only called with no work request in flight.
    fn ensure(&mut self, read_bytes: usize, write_bytes: usize) -> Result<(), VerbsError> {
        if self.reads.len() < ATOMIC_AREA + read_bytes {
            self.reads = Self::buffer(&self.pd, ATOMIC_AREA + read_bytes.next_power_of_two().max(INITIAL_STAGING))?;
        }
        if self.writes.len() < write_bytes {
            self.writes = Self::buffer(&self.pd, write_bytes.next_power_of_two().max(INITIAL_STAGING))?;
        }
        Ok(())
    }
}

/// Everything a batch touches, behind one lock.
struct DataPath {
    // Fields drop in order: the QP is destroyed before the staging buffers are deregistered.
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    staging: Staging,
    list: SendList,
    completions: Vec<WorkCompletion>,
}

/// Where the region lives on the server's NIC.
#[derive(Debug, Clone, Copy)]
struct RemoteRegion {
    base_addr: u64,
    rkey: u32,
    len: u64,
}

/// How a posted batch ended.
enum Waited {
    AllDone,
    /// Op `index` completed with an error; the QP is in the error state.
    Failed {
        index: usize,
        completion: WorkCompletion,
    },
    TimedOut,
    /// `ibv_poll_cq` itself failed.
    PollFailed(String),
}

/// A verbs connection; many threads may share it (see the module docs).
pub struct VerbsConnection {
    data: Mutex<DataPath>,
    healthy: AtomicBool,
    failure: Mutex<Option<String>>,
    control_lost: Arc<AtomicBool>,
    rpc: Channel,
    control: TcpStream,
    watcher: Option<JoinHandle<()>>,
    hello: wire::HelloOk,
    remote: RemoteRegion,
    max_inline: u32,
    timeout: Duration,
    endpoint: String,
    _device: Arc<LocalDevice>,
}

impl VerbsConnection {
    /// Connects to the region server's `verbs:` endpoint at `addr` (`host:port` of its
    /// control channel): hello, QP exchange, both QPs to RTS.
    pub fn connect(addr: &str, options: &ConnectOptions) -> Result<Self, TransportError> {
        Self::connect_with(addr, options, &FlockOptions::default())
    }

    /// [`Self::connect`] with explicit settings for the RPC channel (its lanes are opened
    /// on the first call, each a TCP connection to the same listener plus a queue pair).
    pub fn connect_with(addr: &str, options: &ConnectOptions, rpc: &FlockOptions) -> Result<Self, TransportError> {
        let endpoint = format!("verbs:{addr}");
        let fail = |reason: String| TransportError::Connect { endpoint: endpoint.clone(), reason };
        let verbs = |e: VerbsError| TransportError::Connect { endpoint: endpoint.clone(), reason: e.to_string() };

        // Local resources first: without a device there is no point in dialling.
        let device = local::shared().map_err(verbs)?;
        let caps = device.ctx().caps();
        if caps.max_qp_wr < SEND_QUEUE_DEPTH {
            return Err(fail(format!(
                "{} allows {} WRs per queue, a batch needs {SEND_QUEUE_DEPTH}",
                device.name(),
                caps.max_qp_wr
            )));
        }
        let cq = CompletionQueue::new(device.ctx(), CQ_ENTRIES).map_err(verbs)?;
        let qp = create_qp(&device, &cq).map_err(verbs)?;
        qp.to_init(device.port.port, Access::NONE).map_err(verbs)?;
        let staging = Staging::new(&device.pd).map_err(verbs)?;

        // Control channel: hello, then the QP exchange.
        let (mut stream, hello) = crate::net::dial_plain(addr, &endpoint, options)?;

        let port = device.port;
        let psn = random_psn();
        let initiator_depth = caps.max_qp_init_rd_atom.clamp(1, u32::from(MAX_RD_ATOMIC)) as u8;
        let mine = QpInfo {
            qpn: qp.qpn(),
            psn,
            lid: port.lid,
            mtu: port.mtu as u8,
            rd_atomic: initiator_depth,
            gid: port.gid,
        };
        let accept = exchange(&mut stream, &mine, options.timeout, &endpoint)?;
        if accept.region_len != hello.region_len {
            return Err(TransportError::Protocol(format!(
                "{endpoint}: hello says the region has {} bytes, the QP exchange says {}",
                hello.region_len, accept.region_len
            )));
        }
        qp.to_rtr(&RemotePath {
            port: port.port,
            dest_qpn: accept.qp.qpn,
            rq_psn: accept.qp.psn,
            dlid: accept.qp.lid,
            dgid: accept.qp.gid,
            sgid_index: port.gid_index,
            global: port.roce || accept.qp.lid == 0,
            mtu: port.mtu.min(u32::from(accept.qp.mtu)),
            max_dest_rd_atomic: 1, // nobody reads from or CASes the client
        })
        .map_err(verbs)?;
        qp.to_rts(&SendPath {
            sq_psn: psn,
            max_rd_atomic: initiator_depth.min(accept.qp.rd_atomic),
            timeout: QP_TIMEOUT,
            retry_cnt: QP_RETRY_CNT,
            rnr_retry: QP_RNR_RETRY,
        })
        .map_err(verbs)?;

        let control_lost = Arc::new(AtomicBool::new(false));
        let watch = stream.try_clone().map_err(|e| fail(e.to_string()))?;
        let watcher_lost = Arc::clone(&control_lost);
        let watcher = std::thread::Builder::new()
            .name("verbs-liveness".into())
            .spawn(move || crate::net::watch_peer(&watch, &watcher_lost))
            .map_err(|e| fail(e.to_string()))?;
        let max_inline = qp.caps().max_inline_data;
        let (lane_addr, lane_options) = (addr.to_string(), options.clone());
        let open = move |sender, lanes: usize| {
            (0..lanes).map(|lane| open_verbs_lane(&lane_addr, &lane_options, sender, lane as u16)).collect()
        };
        Ok(Self {
            data: Mutex::new(DataPath {
                qp,
                cq,
                staging,
                list: SendList::default(),
                completions: Vec::with_capacity(CQ_ENTRIES as usize),
            }),
            healthy: AtomicBool::new(true),
            failure: Mutex::new(None),
            control_lost,
            rpc: Channel::new(rpc.clone(), options.timeout, endpoint.clone(), Box::new(open)),
            control: stream,
            watcher: Some(watcher),
            hello,
            remote: RemoteRegion { base_addr: accept.base_addr, rkey: accept.rkey, len: accept.region_len },
            max_inline,
            timeout: options.timeout,
            endpoint,
            _device: device,
        })
    }

    /// The largest WRITE sent inline (copied into the work request) on this connection.
    pub fn max_inline_data(&self) -> u32 {
        self.max_inline
    }

    /// FLOCK lanes of this connection that hold credits (0 before the first call).
    pub fn active_rpc_lanes(&self) -> usize {
        self.rpc.active_lanes()
    }

    /// Fault injection for tests: moves the queue pair of RPC lane `lane` to the error
    /// state, as a NIC or path failure would, without telling the channel. Calls in flight
    /// on that lane fail; once every lane has failed, the next call opens new ones.
    #[doc(hidden)]
    pub fn break_rpc_lane(&self, lane: usize) {
        self.rpc.inject_fault(lane);
    }

    /// Posts `batch` without the region checks of [`Batch::validate`] (the batch-size limits
    /// still apply), so tests can make the NIC itself refuse an access. An access outside the
    /// region ends in `IBV_WC_REM_ACCESS_ERR` and an unhealthy connection.
    #[doc(hidden)]
    pub fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        let count = batch.len();
        if count == 0 || count > MAX_BATCH_OPS {
            return Err(TransportError::InvalidBatch(format!("{count} ops; a batch has 1..={MAX_BATCH_OPS}")));
        }
        let (read_bytes, written) = batch.byte_totals();
        if read_bytes > MAX_BATCH_BYTES || written > MAX_BATCH_BYTES {
            return Err(TransportError::InvalidBatch(format!(
                "batch reads {read_bytes} B and writes {written} B; the limit is {MAX_BATCH_BYTES} B each"
            )));
        }
        self.check_usable()?;
        let started = Instant::now();
        let mut guard = self.data.lock();
        // Another thread may have broken the connection while we waited for the lock.
        self.check_usable()?;
        let data = &mut *guard;
        batch.reset_outcomes();

        let staged_writes: usize = batch
            .ops()
            .iter()
            .filter(|op| op.kind == OpKind::Write && op.len > self.max_inline)
            .map(|op| op.len as usize)
            .sum();
        if let Err(e) = data.staging.ensure(read_bytes as usize, staged_writes) {
            return Err(self.fail_connection(format!("cannot grow the staging buffers: {e}"), false));
        }
        self.build(batch, data);

        // SAFETY: every non-inline SGE built by `build` points into `data.staging`, registered
        // in this QP's PD. Those buffers are not touched by the CPU and not reallocated until
        // the batch has completed: we hold the data-path lock until then, and if we return
        // early (error completion, timeout, post failure) the connection is marked failed
        // first, so no later batch ever reuses them, and the QP (moved to ERR) is destroyed
        // before them when the connection drops (DataPath field order). Inline SGEs point into
        // `batch`, which outlives this call.
        if let Err(e) = unsafe { data.qp.post_send(&mut data.list) } {
            let _ = data.qp.to_error();
            return Err(self.fail_connection(
                format!("ibv_post_send refused work request {}: {}", e.first_failed, e.source),
                e.first_failed > 0,
            ));
        }
        let outcome = self.wait(data, count, started);
        match outcome {
            Waited::AllDone => {
                self.collect(batch, data, count);
                METRICS.batches.inc();
                METRICS.batch_seconds.observe(started.elapsed().as_secs_f64());
                Ok(())
            }
            Waited::Failed { index, completion } => {
                // Ops before `index` completed (RC completes in order): their results stand.
                self.collect(batch, data, index);
                let _ = data.qp.to_error();
                METRICS.completion_errors.with_label_values(&[completion.status.name()]).inc();
                let op = batch.ops()[index];
                Err(self.fail_connection(
                    format!(
                        "op {index} of the batch ({:?} of {} B at offset {}) completed with {} (vendor error {:#x}); the queue pair is in the error state, open a new connection",
                        op.kind, op.len, op.offset, completion.status, completion.vendor_err
                    ),
                    true,
                ))
            }
            Waited::PollFailed(reason) => {
                let _ = data.qp.to_error();
                Err(self.fail_connection(reason, true))
            }
            Waited::TimedOut => {
                let _ = data.qp.to_error();
                self.fail_connection(format!("no completion within {} ms", self.timeout.as_millis()), true);
                Err(TransportError::Timeout { waited_ms: self.timeout.as_millis() as u64 })
            }
        }
    }

    /// Turns the batch into linked work requests in `data.list`, staging large WRITEs.
    fn build(&self, batch: &Batch, data: &mut DataPath) {
        let (reads, writes) = (&data.staging.reads, &data.staging.writes);
        let rkey = self.remote.rkey;
        let list = &mut data.list;
        list.clear();
        let mut read_at = ATOMIC_AREA;
        let mut write_at = 0usize;
        for (index, op) in batch.ops().iter().enumerate() {
            let wr_id = index as u64;
            // Unchecked batches may overflow: let the NIC refuse the address.
            let remote = self.remote.base_addr.wrapping_add(op.offset);
            let slot = LocalSpan { addr: reads.addr() + (index * 8) as u64, len: 8, lkey: reads.lkey() };
            match op.kind {
                OpKind::Read => {
                    list.read(
                        wr_id,
                        LocalSpan { addr: reads.addr() + read_at as u64, len: op.len, lkey: reads.lkey() },
                        remote,
                        rkey,
                    );
                    read_at += op.len as usize;
                }
                OpKind::Write => {
                    let payload = batch.write_payload(index);
                    if op.len <= self.max_inline {
                        list.write(
                            wr_id,
                            LocalSpan { addr: payload.as_ptr() as u64, len: op.len, lkey: 0 },
                            remote,
                            rkey,
                            true,
                        );
                    } else {
                        writes.copy_in(write_at, payload);
                        list.write(
                            wr_id,
                            LocalSpan { addr: writes.addr() + write_at as u64, len: op.len, lkey: writes.lkey() },
                            remote,
                            rkey,
                            false,
                        );
                        write_at += op.len as usize;
                    }
                }
                OpKind::Cas => list.compare_and_swap(wr_id, slot, remote, rkey, op.arg0, op.arg1),
                OpKind::Faa => list.fetch_and_add(wr_id, slot, remote, rkey, op.arg0),
            }
        }
        list.signal_last();
    }

    /// Polls until the last of `count` work requests completes, one fails, or time runs out.
    fn wait(&self, data: &mut DataPath, count: usize, started: Instant) -> Waited {
        let last = (count - 1) as u64;
        let deadline = started + self.timeout;
        let mut empty_polls = 0u32;
        loop {
            data.completions.clear();
            match data.cq.poll(&mut data.completions) {
                Ok(0) => {
                    if Instant::now() >= deadline {
                        return Waited::TimedOut;
                    }
                    empty_polls = empty_polls.saturating_add(1);
                    if empty_polls < SPIN_POLLS {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                    continue;
                }
                Ok(_) => {}
                Err(e) => return Waited::PollFailed(e.to_string()),
            }
            for wc in &data.completions {
                if !wc.status.is_success() {
                    // The first error completion is the op that failed; the QP is in the error
                    // state now and the NIC touches no buffer of a later request (they flush).
                    return Waited::Failed { index: (wc.wr_id as usize).min(count - 1), completion: *wc };
                }
                if wc.wr_id == last {
                    return Waited::AllDone;
                }
            }
        }
    }

    /// Copies results of ops `0..upto` out of the staging buffer into the batch.
    fn collect(&self, batch: &mut Batch, data: &DataPath, upto: usize) {
        let reads = &data.staging.reads;
        let mut read_at = ATOMIC_AREA;
        for index in 0..upto {
            let op = batch.ops()[index];
            match op.kind {
                OpKind::Read => {
                    reads.copy_out(read_at, batch.read_target(index));
                    read_at += op.len as usize;
                    batch.complete(index, 0);
                }
                OpKind::Write => batch.complete(index, 0),
                OpKind::Cas | OpKind::Faa => {
                    let mut word = [0u8; 8];
                    reads.copy_out(index * 8, &mut word);
                    // NICs in host-endian atomic mode (rxe always, mlx5 as the kernel sets it
                    // up) return the old value in host byte order.
                    batch.complete(index, u64::from_ne_bytes(word));
                }
            }
        }
    }

    /// Fails fast when the connection is known to be unusable.
    fn check_usable(&self) -> Result<(), TransportError> {
        if self.healthy.load(Ordering::Acquire) {
            if self.control_lost.load(Ordering::Acquire) {
                return Err(self.fail_connection("the region server closed the control channel".into(), false));
            }
            return Ok(());
        }
        let reason = self.failure.lock().clone().unwrap_or_default();
        Err(TransportError::ConnectionLost { reason, maybe_executed: false })
    }

    /// Marks the connection failed (the first reason sticks) and returns the error to report.
    fn fail_connection(&self, reason: String, maybe_executed: bool) -> TransportError {
        let reason = format!("{}: {reason}", self.endpoint);
        let mut slot = self.failure.lock();
        if slot.is_none() {
            tracing::warn!("{reason}");
            *slot = Some(reason.clone());
        }
        self.healthy.store(false, Ordering::Release);
        TransportError::ConnectionLost { reason, maybe_executed }
    }
}

/// Creates the client's QP, asking for as much inline data as the device grants.
fn create_qp(device: &LocalDevice, cq: &Arc<CompletionQueue>) -> Result<QueuePair, VerbsError> {
    let mut last_error = None;
    for inline in INLINE_WISHES {
        let caps = QpCaps { max_send_wr: SEND_QUEUE_DEPTH, max_recv_wr: 1, max_inline_data: inline };
        match QueuePair::create_rc(&device.pd, cq, caps) {
            Ok(qp) => return Ok(qp),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.expect("at least one attempt"))
}

/// Sends VerbsConnect and waits for VerbsAccept (blocking, bounded by `timeout`).
fn exchange(
    stream: &mut TcpStream,
    mine: &QpInfo,
    timeout: Duration,
    peer: &str,
) -> Result<VerbsAccept, TransportError> {
    let fail = |reason: String| TransportError::Connect { endpoint: peer.to_string(), reason };
    let mut out = Vec::new();
    wire::encode_verbs_connect(&mut out, mine);
    stream.write_all(&out).map_err(|e| fail(e.to_string()))?;
    // A server without a queue pair for us says so: a connect error, like a refused dial.
    let refused = |body: &[u8]| match wire::decode_error(body) {
        Ok((wire::error_code::SETUP_FAILED | wire::error_code::UNSUPPORTED, message)) => {
            fail(format!("the server could not set up a queue pair: {message}"))
        }
        _ => error_frame(body, peer),
    };
    let body = crate::net::await_frame(stream, Kind::VerbsAccept, timeout, peer, "the QP exchange", refused)?;
    wire::decode_verbs_accept(&body).map_err(|e| TransportError::Protocol(format!("{peer}: {e}")))
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
        // `data` drops next: QP, then CQ, then staging buffers.
    }
}

impl Connection for VerbsConnection {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        batch.validate(self.remote.len, self.hello.instance)?;
        self.execute_unchecked(batch)
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.check_usable()?;
        METRICS.rpcs.inc();
        self.rpc.call(method, request)
    }

    fn abort(&self, reason: &str) {
        // One-sided batches complete on the NIC without the server; its RPCs wait on it.
        self.rpc.abort(reason);
    }

    fn region_len(&self) -> u64 {
        self.remote.len
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn instance(&self) -> u64 {
        self.hello.instance
    }

    fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire) && !self.control_lost.load(Ordering::Acquire)
    }

    fn execute_unchecked(&self, batch: &mut Batch) -> Result<(), TransportError> {
        VerbsConnection::execute_unchecked(self, batch)
    }
}
