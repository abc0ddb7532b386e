//! The verbs backend: one-sided READ, WRITE, CAS and FAA over RDMA reliable-connected queue
//! pairs, through rdma-sys (feature `rdma`).
//!
//! Layers, bottom up. The FFI calls of the backend live in the first three modules, each
//! behind a small safe type (modelled on rust-ibverbs, with `Arc` parents instead of
//! lifetimes so that objects can sit in long-lived server state). The only other `unsafe`
//! is the callers of `queue::QueuePair::post_send`, an `unsafe fn` because the NIC reads
//! the posted buffers after it returns: `client` and `crate::flock::verbs`. Each of these
//! modules opts in to `unsafe_code` by name; the crate denies it everywhere else.
//! * `device`: device list, open context, port and GID queries ([`devices`]);
//! * `memory`: protection domain, memory regions over memory that cannot move or be freed
//!   while registered, staging buffers;
//! * `queue`: completion queue, RC queue pair (INIT -> RTR -> RTS -> ERR), a linked list of
//!   send work requests posted with one `ibv_post_send`, polling;
//! * `local`: the process's device, PD and port/GID choice (shared by all connections);
//! * `host`: the region server's side (one MR over the whole region, one QP per client);
//! * `client`: [`VerbsConnection`].
//!
//! Connection setup: the client opens a TCP control channel to the server's `verbs:` endpoint,
//! runs the token handshake (no TLS: the one-sided traffic itself is not encrypted), then
//! exchanges QP number, PSN, LID, GID and MTU with the server
//! (which adds the region's rkey, base address and length); the frames are in [`crate::wire`].
//! After that the control channel carries nothing: it is watched to notice the server going
//! away. RPC travels on FLOCK lanes, each its own queue pair writing into registered rings
//! (`crate::flock::verbs`, built from the `queue`, `memory` and `local` layers here).
//!
//! Without an RDMA device, connecting and serving fail with [`VerbsError::NoDevice`], whose
//! message names the alternatives (shm, tcp, Soft-RoCE). Tests of this backend run in the
//! Soft-RoCE VM of `ops/vm/`.

#[allow(unsafe_code)] // posts send lists (`queue::QueuePair::post_send`)
mod client;
#[allow(unsafe_code)] // rdma-sys FFI
mod device;
mod error;
mod host;
// The FLOCK verbs carrier (`crate::flock::verbs`) builds its lanes from these.
pub(crate) mod local;
#[allow(unsafe_code)] // rdma-sys FFI; `PinnedMemory`, an unsafe trait
pub(crate) mod memory;
#[allow(unsafe_code)] // rdma-sys FFI
pub(crate) mod queue;

use std::hash::{BuildHasher, Hasher};

pub use client::VerbsConnection;
pub use device::{devices, DeviceInfo, GidInfo, PortInfo};
pub use error::{VerbsError, NO_DEVICE_HINT};
pub(crate) use host::{ServerQp, VerbsHost};

/// Local ACK timeout exponent: a try waits 4.096 us * 2^14 = 67 ms for an ACK.
pub(crate) const QP_TIMEOUT: u8 = 14;
/// Transport retries before a work request fails with IBV_WC_RETRY_EXC_ERR (about 0.5 s in
/// all with [`QP_TIMEOUT`]): the time it takes to notice a dead peer from the data path.
pub(crate) const QP_RETRY_CNT: u8 = 7;
/// Receiver-not-ready retries (7 = forever per the spec): a FLOCK lane's WRITE with
/// immediate that finds no receive posted waits for the peer to post more; other QPs never
/// consume receives.
pub(crate) const QP_RNR_RETRY: u8 = 7;
/// Most RDMA READ/atomic requests in flight per QP in either direction (further ones queue
/// in the NIC; they do not fail). Capped by the device's limits.
const MAX_RD_ATOMIC: u8 = 16;

/// A random 24-bit packet sequence number.
pub(crate) fn random_psn() -> u32 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0),
    );
    (hasher.finish() & 0x00FF_FFFF) as u32
}
