//! The remote front end: clients on other hosts send [`Request`]s as RPCs (over FLOCK, so
//! concurrent requests from one client process travel coalesced) and get [`Reply`]s.
//!
//! A request runs on an attached session borrowed for the call, on the receiving thread:
//! the lane's receiver is the worker, so a coalesced message costs no extra thread hop.

use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use prometheus::{IntCounterVec, Opts};
use racekv_client::op::{Reply, Request, REMOTE_METHOD};
use racekv_transport::{Endpoint, RegionServer, RpcService, RpcStatus, ServerOptions, ServerTls};

use crate::cluster::{Attached, Cluster};

static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = racekv_telemetry::register(
        IntCounterVec::new(Opts::new("racekv_remote_requests_total", "Requests from remote clients"), &["result"])
            .unwrap(),
    );
    for r in ["ok", "error", "bad_request"] {
        c.with_label_values(&[r]);
    }
    c
});

struct KvService {
    cluster: Arc<Cluster>,
    /// Sessions between calls (one per concurrently serving thread at most).
    idle: Mutex<Vec<Attached>>,
}

impl RpcService for KvService {
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        if method != REMOTE_METHOD {
            return Err(RpcStatus::new(
                RpcStatus::UNKNOWN_METHOD,
                format!("a computenode answers method {REMOTE_METHOD}, not {method}"),
            ));
        }
        let request = Request::decode(request).map_err(|e| {
            REQUESTS.with_label_values(&["bad_request"]).inc();
            RpcStatus::new(RpcStatus::BAD_REQUEST, e.to_string())
        })?;
        let mut session = self.idle.lock().pop().unwrap_or_else(|| self.cluster.attach());
        let reply = session.execute(&request);
        if let Err(e) = session.publish_counts() {
            tracing::debug!("publishing a remote session's item count failed: {e}");
        }
        self.idle.lock().push(session);
        REQUESTS.with_label_values(&[if matches!(reply, Reply::Error(..)) { "error" } else { "ok" }]).inc();
        let mut out = Vec::new();
        reply.encode(&mut out);
        Ok(out)
    }

    fn method_name(&self, method: u16) -> &'static str {
        if method == REMOTE_METHOD {
            "kv"
        } else {
            "unknown"
        }
    }
}

/// Serves remote clients on `addr` (tcp), authenticated by `token`; with `tls`, only over TLS.
pub fn serve(cluster: Arc<Cluster>, addr: &str, token: &str, tls: Option<ServerTls>) -> std::io::Result<RegionServer> {
    LazyLock::force(&REQUESTS);
    let service = Arc::new(KvService { cluster, idle: Mutex::new(Vec::new()) });
    RegionServer::serve_rpc(
        service,
        ServerOptions { token: token.into(), tls, ..ServerOptions::default() },
        &[Endpoint::Tcp(addr.into())],
    )
}
