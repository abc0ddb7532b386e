//! A connection to a region in this very process: ops run on the mapping directly and RPCs
//! call the service directly. For a memnode's own work before it serves (formatting, crash
//! recovery) and for tests that need no sockets. It is not a remote transport: never use it
//! beside NIC atomics (see design.md, "Atomicity on real NICs").

use std::sync::Arc;

use crate::batch::Batch;
use crate::error::TransportError;
use crate::flock::RpcService;
use crate::region::Region;
use crate::{Connection, TransportKind};

/// A connection to a region in this process (see the module doc).
pub struct LocalConnection {
    region: Arc<Region>,
    service: Option<Arc<dyn RpcService>>,
}

impl LocalConnection {
    /// A connection to `region`, answering RPCs with `service` (None: it has no RPC service).
    pub fn new(region: Arc<Region>, service: Option<Arc<dyn RpcService>>) -> Self {
        Self { region, service }
    }
}

impl Connection for LocalConnection {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        batch.validate(self.region.len(), self.instance())?;
        self.region.apply(batch);
        batch.first_failure()
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        let service = self
            .service
            .as_ref()
            .ok_or_else(|| TransportError::Protocol("no rpc service on a local connection".into()))?;
        service.call(method, request).map_err(|status| TransportError::Rpc { method, status })
    }

    fn region_len(&self) -> u64 {
        self.region.len()
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn instance(&self) -> u64 {
        0
    }

    fn is_healthy(&self) -> bool {
        true
    }
}
