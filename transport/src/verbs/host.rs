//! The server side: the region registered once as one MR, and one RC queue pair per client.
//!
//! The server's CPU takes no part in data operations: a client's READ, WRITE, CAS and FAA are
//! executed by the NIC against the MR. The server only creates the client's queue pair and
//! keeps it until the client's control connection closes.

use std::sync::Arc;

use super::error::VerbsError;
use super::local::{self, LocalDevice};
use super::memory::{Access, MemoryRegion};
use super::queue::{CompletionQueue, QpCaps, QueuePair, RemotePath, SendPath};
use super::{random_psn, MAX_RD_ATOMIC, QP_RETRY_CNT, QP_RNR_RETRY, QP_TIMEOUT};
use crate::region::Region;
use crate::wire::{QpInfo, VerbsAccept};

/// Server QPs never post work requests and receive no SENDs, so their (shared) CQ never
/// fills; it exists because a QP needs one.
const SERVER_CQ_ENTRIES: u32 = 64;

/// The region, registered for remote access, and what accepting clients needs.
pub(crate) struct VerbsHost {
    mr: MemoryRegion<Arc<Region>>,
    cq: Arc<CompletionQueue>,
    device: Arc<LocalDevice>,
    /// Incoming READ/atomic requests each client QP may have in flight.
    responder_depth: u8,
}

/// A client's queue pair on the server; destroyed when dropped (the control connection ends).
pub(crate) struct ServerQp {
    _qp: QueuePair,
}

impl VerbsHost {
    /// Registers the whole region once, as one MR, for local write and remote read, write and
    /// atomic access.
    pub fn register(region: Arc<Region>) -> Result<Self, VerbsError> {
        let device = local::shared()?;
        let caps = device.ctx().caps();
        if caps.atomic_cap == 0 {
            return Err(VerbsError::Unsupported(format!(
                "RDMA device {} does not support atomics; racekv needs CAS and FAA",
                device.name()
            )));
        }
        if region.len() > caps.max_mr_size {
            return Err(VerbsError::Unsupported(format!(
                "region of {} bytes exceeds the largest MR of {} ({} bytes)",
                region.len(),
                device.name(),
                caps.max_mr_size
            )));
        }
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let mr = MemoryRegion::register(&device.pd, region, access)?;
        let cq = CompletionQueue::new(device.ctx(), SERVER_CQ_ENTRIES)?;
        let responder_depth = caps.max_qp_rd_atom.clamp(1, u32::from(MAX_RD_ATOMIC)) as u8;
        tracing::info!(device = device.name(), bytes = mr.len(), rkey = mr.rkey(), "verbs: region registered");
        Ok(Self { mr, cq, device, responder_depth })
    }

    /// The device (and protection domain) the region is registered with; FLOCK lanes on
    /// this server make their queue pairs and rings there.
    pub fn device(&self) -> &Arc<LocalDevice> {
        &self.device
    }

    /// Creates a QP for the client described by `client`, brings it to RTS and returns it
    /// with the answer for the client.
    pub fn accept(&self, client: &QpInfo) -> Result<(ServerQp, VerbsAccept), VerbsError> {
        let port = self.device.port;
        let qp = QueuePair::create_rc(
            &self.device.pd,
            &self.cq,
            QpCaps { max_send_wr: 1, max_recv_wr: 1, max_inline_data: 0 },
        )?;
        qp.to_init(port.port, Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)?;
        let mtu = port.mtu.min(u32::from(client.mtu));
        qp.to_rtr(&RemotePath {
            port: port.port,
            dest_qpn: client.qpn,
            rq_psn: client.psn,
            dlid: client.lid,
            dgid: client.gid,
            sgid_index: port.gid_index,
            global: port.roce || client.lid == 0,
            mtu,
            max_dest_rd_atomic: self.responder_depth,
        })?;
        let psn = random_psn();
        // The server never initiates, so an initiator depth of 1 is plenty.
        qp.to_rts(&SendPath {
            sq_psn: psn,
            max_rd_atomic: 1,
            timeout: QP_TIMEOUT,
            retry_cnt: QP_RETRY_CNT,
            rnr_retry: QP_RNR_RETRY,
        })?;
        let answer = VerbsAccept {
            qp: QpInfo {
                qpn: qp.qpn(),
                psn,
                lid: port.lid,
                mtu: mtu as u8,
                rd_atomic: self.responder_depth,
                gid: port.gid,
            },
            rkey: self.mr.rkey(),
            base_addr: self.mr.addr(),
            region_len: self.mr.len() as u64,
        };
        Ok((ServerQp { _qp: qp }, answer))
    }
}
