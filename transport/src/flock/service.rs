//! The service that answers RPCs at the receiving end of a lane, and the metrics of what it
//! served.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{HistogramVec, IntCounterVec};

use crate::auth::Caller;
use crate::error::RpcStatus;

/// Answers RPCs arriving on a region server's connections.
pub trait RpcService: Send + Sync + 'static {
    /// Handles one request. Errors go back to the caller as an [`RpcStatus`].
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus>;
    /// Handles one request from a connection that authenticated as `caller`. The default
    /// serves everyone alike (every caller of a memnode holds the same token); a service
    /// whose callers are users checks what each may do.
    fn call_as(&self, caller: &Caller, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        let _ = caller;
        self.call(method, request)
    }
    /// A metric label for `method`.
    fn method_name(&self, method: u16) -> &'static str {
        let _ = method;
        "unknown"
    }
}

/// An [`RpcService`] that knows no methods (a bare region server).
pub struct NoRpc;

impl RpcService for NoRpc {
    fn call(&self, method: u16, _request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        Err(RpcStatus::new(RpcStatus::UNKNOWN_METHOD, format!("no rpc method {method} on this server")))
    }
}

/// Counts one RPC served (by FLOCK's receiver or the region server's legacy RpcRequest frame).
pub(crate) fn record_rpc(name: &'static str, ok: bool, took: Duration) {
    METRICS.seconds.with_label_values(&[name]).observe(took.as_secs_f64());
    METRICS.requests.with_label_values(&[name, if ok { "ok" } else { "error" }]).inc();
}

struct Metrics {
    requests: IntCounterVec,
    seconds: HistogramVec,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        requests: metric::counter_vec("racekv_rpc_server_requests_total", "RPCs served", &["method", "status"], &[]),
        seconds: metric::latency_histogram_vec("racekv_rpc_server_seconds", "Time to serve one RPC", &["method"]),
    }
});
