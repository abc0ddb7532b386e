//! A region server with no region: RPC only, for request/response services between tiers
//! (a computenode's remote clients). It runs the region server's connection loop on a
//! placeholder region that no one-sided batch may reach.

use std::io;
use std::sync::Arc;

use crate::flock::RpcService;
use crate::region::{Region, REGION_ALIGN_BYTES};
use crate::server::{RegionServer, ServerOptions};
use crate::Endpoint;

impl RegionServer {
    /// Serves only RPCs (FLOCK lanes and RPC frames), on tcp endpoints, with no region: for
    /// request/response services between tiers, such as a computenode's remote clients.
    /// One-sided batches are refused; hello reports a region of 0 bytes.
    pub fn serve_rpc(rpc: Arc<dyn RpcService>, options: ServerOptions, listen: &[Endpoint]) -> io::Result<Self> {
        if let Some(other) = listen.iter().find(|e| !matches!(e, Endpoint::Tcp(_))) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("an RPC-only server listens on tcp endpoints, not {other}"),
            ));
        }
        let placeholder = Arc::new(Region::anonymous(REGION_ALIGN_BYTES)?);
        Self::start_inner(placeholder, None, rpc, options, listen, true)
    }
}
