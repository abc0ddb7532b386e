//! One attached client after its handshake: a thread takes requests off its ring and submits
//! them; reply callbacks (on worker threads) write the replies back.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use racekv_client::attach::handshake::goodbye;
use racekv_client::attach::{doorbell, monotonic_ns, reply_bound, Completer, DaemonRing, Doorbell, Frame, Submission};
use racekv_client::op::{ErrorKind, Reply};

use crate::staging::{self, Staging};

use super::metrics::METRICS;
use super::SharedSubmit;
use racekv_redis::acl::Acl;

/// The poller looks at its socket and flags at least this often even if nothing wakes it.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Why an attachment ends.
#[derive(Debug, Clone)]
pub(crate) enum Ending {
    /// The client closed its socket (exited, crashed, dropped its client).
    Closed,
    /// The client broke the protocol.
    ProtocolError { reason: &'static str, message: String },
    /// The server is shutting down.
    Shutdown,
}

/// What the poller and the reply callbacks share.
pub(crate) struct Conn {
    pub peer: String,
    /// The ACL user it attached as (None: the server checks no users).
    pub user: Option<String>,
    /// Requests and replies larger than a slot, in parts: this connection's transfers.
    staging: Arc<Staging>,
    /// Who its transfers belong to (this attachment alone).
    owner: String,
    completer: Completer,
    /// Wakes the client (it waits on it).
    to_client: Doorbell,
    /// Wakes this connection's poller: the client rings it after submitting, and we ring it
    /// ourselves to make the poller look at `ending` or at freed budget.
    to_poller: Doorbell,
    ending: Mutex<Option<Ending>>,
    ended: AtomicBool,
    /// Worst-case reply bytes of the requests in flight.
    in_flight_bytes: AtomicU64,
    /// The poller waits for budget.
    blocked: AtomicBool,
}

impl Conn {
    pub(crate) fn new(
        peer: String,
        user: Option<String>,
        (staging, owner): (Arc<Staging>, String),
        completer: Completer,
        to_client: Doorbell,
        to_poller: Doorbell,
    ) -> Self {
        Self {
            peer,
            user,
            staging,
            owner,
            completer,
            to_client,
            to_poller,
            ending: Mutex::new(None),
            ended: AtomicBool::new(false),
            in_flight_bytes: AtomicU64::new(0),
            blocked: AtomicBool::new(false),
        }
    }

    pub(crate) fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Ends the attachment (the first reason wins) and wakes its poller.
    pub(crate) fn end(&self, ending: Ending) {
        {
            let mut slot = self.ending.lock();
            if slot.is_none() {
                *slot = Some(ending);
            }
        }
        self.ended.store(true, Ordering::Release);
        self.to_poller.ring();
    }

    /// Writes one request's reply back (from a worker thread, or from the poller when
    /// `submit` refused) and frees its budget.
    fn complete(&self, slot: u32, request_id: u64, cost: u64, taken: Instant, reply: Reply) {
        let result = match &reply {
            Reply::Error(ErrorKind::Overloaded, _) => "overloaded",
            Reply::Error(..) => "error",
            _ => "ok",
        };
        METRICS.requests.with_label_values(&[result]).inc();
        METRICS.in_flight.dec();
        if !self.is_ended() {
            let mut bytes = Vec::new();
            reply.encode(&mut bytes);
            let bytes = staging::fit_reply(&self.staging, &self.owner, bytes, self.payload_bytes());
            match self.completer.complete(slot, request_id, &bytes) {
                Ok(true) => self.to_client.ring(),
                Ok(false) => {}
                Err(e) => self.end(Ending::ProtocolError { reason: e.reason(), message: e.to_string() }),
            }
        }
        METRICS.request_seconds.observe(taken.elapsed().as_secs_f64());
        self.in_flight_bytes.fetch_sub(cost, Ordering::SeqCst);
        if self.blocked.load(Ordering::SeqCst) {
            self.to_poller.ring();
        }
    }

    fn payload_bytes(&self) -> usize {
        self.completer.geometry().payload_bytes()
    }

    /// Answers a request at once, on the poller (parts, fetches, refusals before a worker).
    fn answer(&self, slot: u32, request_id: u64, reply: Reply) {
        METRICS.in_flight.inc();
        self.complete(slot, request_id, 0, Instant::now(), reply);
    }
}

/// How a connection's requests are served.
pub(crate) struct Serving<'a> {
    pub submit: SharedSubmit,
    /// The most reply bytes its requests in flight may need.
    pub budget: u64,
    /// How long to poll the ring after a request before sleeping.
    pub spin: Duration,
    /// Checks every request against the connection's user (None: no user checks).
    pub acl: Option<&'a Acl>,
    /// What lent this client connections, and the user it lent them to: asked now and then
    /// whether the lending still stands.
    pub lending: Option<(std::sync::Arc<dyn super::Lender>, Option<String>)>,
}

/// How often a client's thread asks whether its lending still stands.
const LENDING_CHECK: Duration = Duration::from_secs(1);

/// Runs the client's ring until the attachment ends, then says goodbye (when it is the
/// daemon that ends it) and closes the socket.
pub(crate) fn run(
    conn: Arc<Conn>,
    mut ring: DaemonRing,
    mut stream: UnixStream,
    serving: Serving<'_>,
    stopping: &AtomicBool,
) -> Ending {
    let mut pending: Option<Submission> = None;
    let mut last_request = Instant::now();
    let mut lending = serving.lending.clone();
    let mut lending_checked = Instant::now();
    let _ = stream.set_nonblocking(true);
    loop {
        if let Some((lender, user)) = &lending {
            if lending_checked.elapsed() >= LENDING_CHECK {
                lending_checked = Instant::now();
                if !lender.still_allowed(user.as_deref()) {
                    ring.revoke_lending();
                    METRICS.revoked.inc();
                    tracing::info!(peer = %conn.peer, "took back the connections lent to this client");
                    lending = None;
                }
            }
        }
        if stopping.load(Ordering::Acquire) {
            conn.end(Ending::Shutdown);
        }
        if conn.is_ended() {
            break;
        }
        let progressed = take_requests(&conn, &mut ring, &mut pending, &serving);
        if conn.is_ended() {
            break;
        }
        let blocked = pending.is_some();
        if progressed {
            last_request = Instant::now();
            continue;
        }
        // Spin a little after real requests (not after spurious wake-ups: ringing our
        // doorbell must not buy a client our CPU).
        if !blocked && last_request.elapsed() < serving.spin {
            if !ring.has_submissions() {
                std::hint::spin_loop();
            }
            continue;
        }
        sleep_until_woken(&conn, &mut ring, &mut stream, blocked, stopping);
    }
    say_goodbye(&conn, stream)
}

/// Takes what the client published (up to one ring's worth), as far as the budget allows:
/// answers parts, fetches and refusals at once and submits the rest. A request the budget
/// cannot take yet is left in `pending`. True if any request was answered or submitted.
fn take_requests(
    conn: &Arc<Conn>,
    ring: &mut DaemonRing,
    pending: &mut Option<Submission>,
    serving: &Serving<'_>,
) -> bool {
    let budget = serving.budget;
    let mut progressed = false;
    for _ in 0..ring.geometry().slots() {
        let mut sub = match pending.take() {
            Some(sub) => sub,
            None => match ring.take() {
                Ok(Some(sub)) => sub,
                Ok(None) => break,
                Err(e) => {
                    conn.end(Ending::ProtocolError { reason: e.reason(), message: e.to_string() });
                    break;
                }
            },
        };
        // Parts and fetches are answered here; a last part becomes its whole request.
        let request = std::mem::replace(&mut sub.request, racekv_client::op::Request::Len);
        match staging::assemble(&conn.staging, &conn.owner, request, conn.payload_bytes()) {
            Ok(request) => sub.request = request,
            Err(reply) => {
                progressed = true;
                conn.answer(sub.slot, sub.request_id, reply);
                continue;
            }
        }
        let cost = reply_bound(&sub.request);
        if cost > budget {
            conn.end(Ending::ProtocolError {
                reason: "over_budget",
                message: format!(
                    "a request whose reply may take {cost} bytes exceeds the reply budget of {budget} bytes \
                     (the handshake said how many keys a multi-get may carry)"
                ),
            });
            break;
        }
        if !reserve_budget(conn, cost, budget) {
            *pending = Some(sub);
            break;
        }
        progressed = true;
        dispatch(conn, sub, cost, serving);
    }
    progressed
}

/// Counts `cost` reply bytes against the connection's budget; false (and the connection
/// marked blocked, so replies wake its poller) when they do not fit until replies free some.
fn reserve_budget(conn: &Conn, cost: u64, budget: u64) -> bool {
    if conn.in_flight_bytes.load(Ordering::SeqCst) + cost > budget {
        // Wait for replies to free budget; re-check after saying so, since a reply
        // may have freed it just before.
        conn.blocked.store(true, Ordering::SeqCst);
        if conn.in_flight_bytes.load(Ordering::SeqCst) + cost > budget {
            return false;
        }
    }
    conn.blocked.store(false, Ordering::SeqCst);
    conn.in_flight_bytes.fetch_add(cost, Ordering::SeqCst);
    true
}

/// Hands one whole request, its `cost` bytes of budget reserved, to the workers (or refuses
/// it: the user may not, or the queue is full); its reply comes back through `conn`.
fn dispatch(conn: &Arc<Conn>, sub: Submission, cost: u64, serving: &Serving<'_>) {
    let now_ns = monotonic_ns();
    if sub.submitted_ns != 0 && sub.submitted_ns <= now_ns && now_ns - sub.submitted_ns < 60_000_000_000 {
        METRICS.ring_wait_seconds.observe((now_ns - sub.submitted_ns) as f64 * 1e-9);
    }
    METRICS.in_flight.inc();
    let taken = Instant::now();
    let (slot, request_id) = (sub.slot, sub.request_id);
    if let (Some(acl), Some(user)) = (serving.acl, conn.user.as_deref()) {
        if let Err(message) = crate::access::check(acl, user, &sub.request) {
            conn.complete(slot, request_id, cost, taken, Reply::Error(ErrorKind::Denied, message));
            return;
        }
    }
    let replier = Arc::clone(conn);
    let reply = Box::new(move |reply: Reply| replier.complete(slot, request_id, cost, taken, reply));
    if let Err(overloaded) = serving.submit.submit(sub.request, reply) {
        conn.complete(slot, request_id, cost, taken, Reply::Error(ErrorKind::Overloaded, overloaded.to_string()));
    }
}

/// Sleeps until the client rings the poller's doorbell, the socket turns readable (checked
/// here), or `IDLE_CHECK` passes; `blocked`: it waits for budget, not for submissions.
fn sleep_until_woken(
    conn: &Conn,
    ring: &mut DaemonRing,
    stream: &mut UnixStream,
    blocked: bool,
    stopping: &AtomicBool,
) {
    ring.set_sleeping(true);
    if (blocked || !ring.has_submissions()) && !conn.is_ended() && !stopping.load(Ordering::Acquire) {
        let ready = doorbell::wait_readable(&[conn.to_poller.as_fd(), stream.as_fd()], Some(IDLE_CHECK))
            .unwrap_or_else(|_| vec![false, false]);
        if ready.get(1).copied().unwrap_or(false) && !stopping.load(Ordering::Acquire) {
            check_socket(conn, stream);
        }
    }
    ring.set_sleeping(false);
    conn.to_poller.drain();
}

/// The attachment has ended: tells the client why (unless it closed first), closes the
/// socket, drops its transfers in parts, and returns the reason.
fn say_goodbye(conn: &Conn, mut stream: UnixStream) -> Ending {
    let ending = conn.ending.lock().clone().unwrap_or(Ending::Closed);
    let farewell = match &ending {
        Ending::Closed => None,
        Ending::ProtocolError { message, .. } => {
            Some(Frame::Goodbye { code: goodbye::PROTOCOL_ERROR, reason: format!("protocol error: {message}") })
        }
        Ending::Shutdown => {
            Some(Frame::Goodbye { code: goodbye::SHUTDOWN, reason: "the computenode is shutting down".into() })
        }
    };
    if let Some(frame) = farewell {
        // Best effort: a frame this small fits the socket buffer of a live peer.
        let _ = stream.write_all(&frame.encode());
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    conn.staging.forget(&conn.owner);
    ending
}

/// The socket is readable: the client closed it (or died), or sent bytes it must not send.
fn check_socket(conn: &Conn, stream: &mut UnixStream) {
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => conn.end(Ending::Closed),
        Ok(n) => conn.end(Ending::ProtocolError {
            reason: "unexpected_bytes",
            message: format!("{n} unexpected bytes on the control socket after the handshake"),
        }),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {}
        Err(_) => conn.end(Ending::Closed),
    }
}
