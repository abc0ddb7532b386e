//! The remote front end: clients on other hosts send [`Request`]s as RPCs (over FLOCK, so
//! concurrent requests from one client process travel coalesced) and get [`Reply`]s.
//!
//! Clients are the ACL's users, as on the Redis front end: a connection proves one of its
//! user's passwords in the transport's handshake ([`racekv_transport::auth`], keyed by the
//! password's SHA-256, which is what the ACL keeps), and each request is checked against the
//! user's permissions as the Redis command it amounts to (GET, SET, SETNX, DEL, MGET, MSET,
//! DBSIZE, INFO). A client that names no user is `default`.
//!
//! A request runs on an attached session borrowed for the call, on the receiving thread:
//! the lane's receiver is the worker, so a coalesced message costs no extra thread hop.
//!
//! A request or reply larger than one RPC travels in parts ([`crate::staging`]; the
//! protocol is in [`racekv_client::op`]). Transfers are keyed by the caller's user and the
//! transfer's id, not by connection or session: any session may serve any part. The
//! assembled request is checked against the ACL like a direct one.

use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use prometheus::IntCounterVec;
use racekv_client::op::{ErrorKind, Reply, Request, MAX_REMOTE_MESSAGE_BYTES, REMOTE_METHOD};
use racekv_redis::acl::{Acl, DEFAULT_USER};
use racekv_transport::{
    Caller, Credentials, Endpoint, Keys, RegionServer, RpcService, RpcStatus, ServerOptions, ServerTls,
};

use crate::cluster::{Attached, Cluster};
use crate::eviction::Eviction;
use crate::staging::{self, Staging};

static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_remote_requests_total",
        "Requests from remote clients",
        &["result"],
        &[&["ok", "error", "bad_request", "denied"]],
    )
});

struct KvService {
    cluster: Arc<Cluster>,
    /// Cache mode: writes evict as the Redis front end's do.
    eviction: Arc<Eviction>,
    acl: Arc<Acl>,
    staging: Arc<Staging>,
    /// Sessions between calls (one per concurrently serving thread at most).
    idle: Mutex<Vec<Attached>>,
}

/// The ACL's users as the transport's handshake sees them: a user's keys are its password
/// hashes; a user without a password (`nopass`) needs none; a disabled user gets nothing.
#[derive(Debug)]
struct AclCredentials(Arc<Acl>);

impl Credentials for AclCredentials {
    fn keys(&self, user: Option<&str>) -> Keys {
        match self.0.user(user.unwrap_or(DEFAULT_USER)) {
            Some(u) if u.enabled() && u.nopass() => Keys::Open,
            Some(u) if u.enabled() => Keys::Keyed(u.password_keys()),
            _ => Keys::Unknown,
        }
    }
}

impl RpcService for KvService {
    /// Only through [`RpcService::call_as`]: every remote connection authenticated as a user.
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        self.call_as(&Caller::default(), method, request)
    }

    fn call_as(&self, caller: &Caller, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
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
        let user = caller.user.as_deref().unwrap_or(DEFAULT_USER);
        let owner = format!("user/{user}");
        let request = match staging::assemble(&self.staging, &owner, request, MAX_REMOTE_MESSAGE_BYTES) {
            Ok(request) => request,
            Err(reply) => {
                let mut out = Vec::new();
                reply.encode(&mut out);
                return Ok(out);
            }
        };
        if let Err(message) = crate::access::check(&self.acl, user, &request) {
            REQUESTS.with_label_values(&["denied"]).inc();
            let mut out = Vec::new();
            Reply::Error(ErrorKind::Denied, message).encode(&mut out);
            return Ok(out);
        }
        let mut session = self.idle.lock().pop().unwrap_or_else(|| self.cluster.attach());
        let reply = crate::execute::execute(&self.eviction, &mut session, &request);
        if let Err(e) = session.publish_counts() {
            tracing::debug!("publishing a remote session's item count failed: {e}");
        }
        self.idle.lock().push(session);
        REQUESTS.with_label_values(&[if matches!(reply, Reply::Error(..)) { "error" } else { "ok" }]).inc();
        let mut out = Vec::new();
        reply.encode(&mut out);
        Ok(staging::fit_reply(&self.staging, &owner, out, MAX_REMOTE_MESSAGE_BYTES))
    }

    fn method_name(&self, method: u16) -> &'static str {
        if method == REMOTE_METHOD {
            "kv"
        } else {
            "unknown"
        }
    }
}

/// Serves remote clients on `addr` (tcp), the users of `acl`; with `tls`, only over TLS.
/// Requests and replies larger than an RPC are assembled and kept in `staging`; writes
/// are kept under `maxmemory` by `eviction`.
pub fn serve(
    cluster: Arc<Cluster>,
    eviction: Arc<Eviction>,
    addr: &str,
    acl: Arc<Acl>,
    tls: Option<ServerTls>,
    staging: Arc<Staging>,
) -> std::io::Result<RegionServer> {
    LazyLock::force(&REQUESTS);
    let credentials = Arc::new(AclCredentials(Arc::clone(&acl)));
    let service = Arc::new(KvService { cluster, eviction, acl, staging, idle: Mutex::new(Vec::new()) });
    RegionServer::serve_rpc(
        service,
        ServerOptions { credentials: Some(credentials), tls, ..ServerOptions::default() },
        &[Endpoint::Tcp(addr.into())],
    )
}
