//! The attach front end: processes on this host attach over a Unix socket and get a
//! shared-memory request ring (the protocol is [`racekv_client::attach`]); their requests go
//! to the daemon's work queue through [`Submit`], and the replies come back on the ring.
//! This is how the client library reaches a local computenode by default.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use racekv_computenode::attach::{AttachOptions, AttachServer};
//! # use racekv_computenode::queue::{Submit, WorkQueue};
//! let queue: Arc<dyn Submit> = Arc::new(WorkQueue::new(4096)); // drained by the daemon's workers
//! let socket = racekv_client::default_attach_socket();
//! let mut server = AttachServer::start(&socket, queue, AttachOptions::default())?;
//! // ... `racekv_client::Client::builder().connect()` in any process of this user now attaches.
//! server.shutdown();
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! # Who may attach
//!
//! Two checks, both at the handshake:
//!
//! * **The peer's uid** (SO_PEERCRED, set by the kernel, unforgeable): by default only the
//!   daemon's own effective uid, and root ([`AllowedUids::SameUser`]). The socket file is
//!   then created mode 0600 (and its directory 0700 when the server creates it), so other
//!   users cannot even connect. [`AllowedUids::Listed`] or [`AllowedUids::Any`] open it up
//!   (mode 0666; the uid check still applies to `Listed`).
//! * **A user** ([`AttachOptions::auth`], optional): the ACL of the Redis port. A client may
//!   name a user and a password (`ClientBuilder::user`, `password`; the socket is the
//!   kernel's, so the password goes as it is, as with Redis' AUTH) and is then that user,
//!   or refused; one that names none is `default` when its uid is trusted
//!   ([`AttachAuth::trust_uid`]: the daemon's own or root) or when `default` needs no
//!   password, else refused. Every request is then checked against the user's permissions
//!   as the Redis command it amounts to ([`crate::access`]); a denied one is answered
//!   `Denied` (the client sees `ClientError::Denied`).
//!
//! # Resources and limits
//!
//! One thread per attached client (it takes requests off the ring and submits them; workers
//! write the replies). At most [`AttachOptions::max_clients`] clients, attached or in their
//! handshake; more are refused with a "too many clients" frame (the client sees
//! `ClientError::Overloaded`). Each client gets `slots x slot_bytes` of shared memory (a
//! memfd, touched lazily) and two eventfds, and may have at most `slots` requests in flight,
//! whose worst-case replies together stay within [`AttachOptions::reply_budget_bytes`]: a
//! request that would exceed it waits in the ring until replies free budget. When `submit`
//! refuses (the queue is full) the request is answered at once with an `Overloaded` error
//! reply (the client sees `ClientError::Overloaded`).
//!
//! A request larger than a slot arrives in parts, and a reply larger than a slot is staged
//! and fetched in parts ([`crate::staging`]; the protocol is in [`racekv_client::op`]): the
//! poller answers parts and fetches itself, and submits the assembled request like any
//! other (budgeted, checked against the user's ACL). A connection's transfers are its own,
//! and are dropped when it detaches.
//!
//! # Hostile clients
//!
//! The shared area is untrusted: see [`racekv_client::attach`] for how every word is
//! checked. A protocol error (impossible index, length or request; a slot reused while in
//! flight; a completion ring overrun; bytes on the socket after the handshake) detaches that
//! client: it gets a goodbye frame with the reason, the reason is logged and counted in
//! `racekv_attach_protocol_errors_total{reason}`, and its memory is released once the
//! requests it had in flight finish. A client that dies (its socket closes) is detached the
//! same way. Other clients are not affected.
//!
//! # Lent connections
//!
//! A client may ask, in its hello, to borrow connections to the memnodes
//! ([`racekv_client::attach::lending`]): with a [`Lender`] configured
//! ([`AttachOptions::lender`]) and its policy allowing it, the daemon dials each memnode,
//! authenticates, opens an RPC lane and sends the descriptors (one LENT frame per
//! memnode); the client then runs key operations itself. Otherwise it sends NOT_LENT with
//! the reason and the client uses the ring. About once a second the client's thread asks
//! the lender whether the lending is still allowed; when it no longer is (the user's ACL
//! changed, `maxmemory` was set), it raises the area's revoked word and the client goes
//! back to the ring. `racekv_attach_lendings_total{outcome}`,
//! `racekv_attach_lendings_revoked_total`.
//!
//! # Metrics
//!
//! `racekv_attach_clients`, `racekv_attach_attaches_total`, `racekv_attach_refused_total{reason}`,
//! `racekv_attach_detaches_total{reason}`, `racekv_attach_requests_total{result}`,
//! `racekv_attach_requests_in_flight`, `racekv_attach_ring_wait_seconds` (client's submission
//! to the daemon's pickup, by the client's clock stamp), `racekv_attach_request_duration_seconds`
//! (pickup to reply written), `racekv_attach_protocol_errors_total{reason}`.

mod connection;
mod metrics;
mod server;

use std::time::Duration;

pub use server::AttachServer;

use crate::queue::Submit;

/// Which peers' uids may attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedUids {
    /// The daemon's own effective uid, and root.
    SameUser,
    /// These uids, the daemon's own, and root.
    Listed(Vec<u32>),
    /// Anyone who can reach the socket.
    Any,
}

/// Who attached clients are, and what they may do.
#[derive(Debug, Clone)]
pub struct AttachAuth {
    /// The users, their passwords and what each may do (shared with the Redis front end).
    pub acl: std::sync::Arc<racekv_redis::acl::Acl>,
    /// A client that gives no credentials and runs as the daemon's uid (or root) is the
    /// `default` user without a password.
    pub trust_uid: bool,
}

/// Limits and policy of an [`AttachServer`].
#[derive(Debug, Clone)]
pub struct AttachOptions {
    /// Clients attached or in their handshake at once.
    pub max_clients: usize,
    /// Ring slots per client: the most requests one client has in flight.
    pub slots: u32,
    /// Bytes per slot: the largest request or reply carried at once (at least
    /// `racekv_client::attach::area::MIN_SERVING_SLOT_BYTES`, so every single-key request
    /// and reply fits; larger multi-key replies make the client split its request).
    pub slot_bytes: u32,
    /// Per client, the most bytes the replies of its requests in flight could take (by
    /// [`racekv_client::attach::reply_bound`]). Bounds the daemon's memory per client, and
    /// the keys of one multi-get.
    pub reply_budget_bytes: u64,
    /// Users and permissions (None: no user checks: whoever passes the uid check may do
    /// anything).
    pub auth: Option<AttachAuth>,
    /// Which peer uids may attach at all (checked before the hello).
    pub allowed_uids: AllowedUids,
    /// A client must complete its hello within this.
    pub handshake_timeout: Duration,
    /// Where requests and replies larger than a slot are assembled and kept (share the
    /// daemon's, so one budget bounds every front end; None: one of its own, with the
    /// default limits).
    pub staging: Option<std::sync::Arc<crate::staging::Staging>>,
    /// Lends clients that ask for it connections to the memnodes (None: it lends none).
    pub lender: Option<std::sync::Arc<dyn Lender>>,
    /// How long a client's thread polls its ring after the last request before sleeping.
    /// Default 20 µs on hosts with more than two CPUs, else none (there it would take the
    /// core a worker needs).
    pub spin: Duration,
}

impl Default for AttachOptions {
    fn default() -> Self {
        Self {
            max_clients: 256,
            slots: 64,
            slot_bytes: 64 << 10,
            reply_budget_bytes: 16 << 20,
            auth: None,
            staging: None,
            lender: None,
            allowed_uids: AllowedUids::SameUser,
            handshake_timeout: Duration::from_secs(2),
            spin: if std::thread::available_parallelism().is_ok_and(|n| n.get() > 2) {
                Duration::from_micros(20)
            } else {
                Duration::ZERO
            },
        }
    }
}

/// Lends attached clients connections to the memnodes.
pub trait Lender: Send + Sync + std::fmt::Debug {
    /// One connection per memnode, in the daemon's order, for a client attached as `user`
    /// (None: the server checks no users), or why not.
    fn lend(&self, user: Option<&str>) -> Result<Vec<racekv_client::attach::lending::LentMemnode>, Refused>;
    /// Whether a lending to `user` may still be used.
    fn still_allowed(&self, user: Option<&str>) -> bool;
}

/// Why a [`Lender`] lent nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Its policy says no (the reason says which rule).
    Policy(String),
    /// It tried and failed (dialing a memnode).
    Failed(String),
}

/// What a connection's thread needs from the server.
pub(crate) type SharedSubmit = std::sync::Arc<dyn Submit>;

#[cfg(test)]
mod tests;
