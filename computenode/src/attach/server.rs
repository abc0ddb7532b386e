//! The attach server: the Unix socket, the handshake, a thread per attached client.

use std::collections::HashMap;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;
use racekv_client::attach::area::MIN_SERVING_SLOT_BYTES;
use racekv_client::attach::handshake::{refusal, HELLO_BYTES};
use racekv_client::attach::{
    doorbell, Accepted, DaemonRing, Doorbell, Frame, Geometry, Hello, STATS_REPLY_BOUND, VALUE_REPLY_BOUND,
};

use super::connection::{self, Conn, Ending};
use super::metrics::METRICS;
use super::{AllowedUids, AttachAuth, AttachOptions, Refused, SharedSubmit};
use racekv_redis::acl::DEFAULT_USER;

/// A refused handshake: the frame's code, the metric's reason, and the message.
struct Refusal {
    code: u8,
    reason: &'static str,
    message: String,
}

fn refuse(code: u8, reason: &'static str, message: impl Into<String>) -> Refusal {
    Refusal { code, reason, message: message.into() }
}

/// A connection's socket handle, and its state once attached.
type Open = (UnixStream, Option<Arc<Conn>>);

struct Shared {
    submit: SharedSubmit,
    staging: Arc<crate::staging::Staging>,
    options: AttachOptions,
    geometry: Geometry,
    max_multi_keys: u32,
    own_uid: u32,
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Every connection, in its handshake or attached: a handle on its socket (to unblock a
    /// handshake at shutdown) and, once attached, its state (to wake its thread).
    open: Mutex<HashMap<u64, Open>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A running attach front end; stops on [`AttachServer::shutdown`] or drop, detaching every
/// client (they get a goodbye frame) and removing the socket file.
pub struct AttachServer {
    shared: Arc<Shared>,
    path: PathBuf,
    wake: Arc<Doorbell>,
    acceptor: Option<JoinHandle<()>>,
}

impl AttachServer {
    /// Listens on `socket_path` and hands attached clients' requests to `submit`.
    ///
    /// Creates the socket's directory if missing (mode 0700 for [`AllowedUids::SameUser`],
    /// else 0755). A stale socket file (nothing listening) is replaced; a live one is an
    /// `AddrInUse` error.
    pub fn start(socket_path: impl AsRef<Path>, submit: SharedSubmit, options: AttachOptions) -> io::Result<Self> {
        let path = socket_path.as_ref().to_path_buf();
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if options.slot_bytes < MIN_SERVING_SLOT_BYTES {
            return Err(invalid(format!(
                "slot_bytes {} is below {MIN_SERVING_SLOT_BYTES}: single-key requests must fit a slot",
                options.slot_bytes
            )));
        }
        let geometry = Geometry::new(options.slots, options.slot_bytes).map_err(|e| invalid(e.to_string()))?;
        let least_budget = (4 + VALUE_REPLY_BOUND).max(STATS_REPLY_BOUND);
        if options.reply_budget_bytes < least_budget {
            return Err(invalid(format!(
                "reply_budget_bytes {} is below {least_budget} (one GET's or STATS' reply)",
                options.reply_budget_bytes
            )));
        }
        if options.max_clients == 0 {
            return Err(invalid("max_clients must be at least 1".into()));
        }
        let max_multi_keys =
            ((options.reply_budget_bytes - 4) / VALUE_REPLY_BOUND).min(racekv_client::op::MAX_MULTI as u64) as u32;
        let listener = bind(&path, &options.allowed_uids)?;
        listener.set_nonblocking(true)?;
        let staging = options.staging.clone().unwrap_or_else(|| crate::staging::Staging::start(Default::default()));
        let shared = Arc::new(Shared {
            submit,
            staging,
            geometry,
            max_multi_keys,
            own_uid: nix::unistd::geteuid().as_raw(),
            options,
            stopping: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            open: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        // Registered now, so a scrape shows them before the first client.
        std::sync::LazyLock::force(&METRICS);
        let wake = Arc::new(Doorbell::new()?);
        let accepting = Arc::clone(&shared);
        let accept_wake = Arc::clone(&wake);
        let acceptor = std::thread::Builder::new()
            .name("attach-accept".into())
            .spawn(move || accept_loop(&accepting, &listener, &accept_wake))?;
        tracing::info!(socket = %path.display(), "attach front end listening");
        Ok(Self { shared, path, wake, acceptor: Some(acceptor) })
    }

    /// The socket's path.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Clients attached now (handshakes in progress not counted).
    pub fn attached_clients(&self) -> usize {
        self.shared.open.lock().values().filter(|(_, conn)| conn.is_some()).count()
    }

    /// Stops accepting, detaches every client (each gets a goodbye frame), waits for their
    /// threads and removes the socket file. Requests already submitted still run; their
    /// replies are dropped.
    pub fn shutdown(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.wake.ring();
        let _ = acceptor.join();
        for (stream, conn) in self.shared.open.lock().values() {
            match conn {
                Some(conn) => conn.end(Ending::Shutdown),
                // In its handshake: unblock its read.
                None => {
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        let threads = std::mem::take(&mut *self.shared.threads.lock());
        for thread in threads {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
        tracing::info!(socket = %self.path.display(), "attach front end stopped");
    }
}

impl Drop for AttachServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn bind(path: &Path, allowed: &AllowedUids) -> io::Result<UnixListener> {
    let private = *allowed == AllowedUids::SameUser;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new().recursive(true).mode(if private { 0o700 } else { 0o755 }).create(dir)?;
        }
    }
    let listener = racekv_transport::listen::bind_unix(path, "another computenode")?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(if private { 0o600 } else { 0o666 }))?;
    Ok(listener)
}

fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener, wake: &Doorbell) {
    loop {
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        if doorbell::wait_readable(&[listener.as_fd(), wake.as_fd()], None).is_err() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if shared.stopping.load(Ordering::Acquire) {
            return;
        }
        loop {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: back off rather than spin.
                    tracing::warn!("attach accept failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    break;
                }
            };
            admit(shared, stream);
        }
    }
}

fn admit(shared: &Arc<Shared>, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let handle = match stream.try_clone() {
        Ok(handle) => handle,
        Err(e) => {
            tracing::warn!("attach: cannot clone a client socket: {e}");
            return;
        }
    };
    {
        let mut open = shared.open.lock();
        if open.len() >= shared.options.max_clients {
            drop(open);
            METRICS.refused.with_label_values(&["too_many_clients"]).inc();
            send_refusal(
                stream,
                refuse(
                    refusal::TOO_MANY_CLIENTS,
                    "too_many_clients",
                    format!("this computenode serves its maximum of {} attached clients", shared.options.max_clients),
                ),
            );
            return;
        }
        open.insert(id, (handle, None));
    }
    let serving = Arc::clone(shared);
    let spawned = racekv_transport::listen::spawn_tracked(&shared.threads, format!("attach-{id}"), move || {
        serve(&serving, id, stream);
        serving.open.lock().remove(&id);
    });
    if let Err(e) = spawned {
        tracing::warn!("attach: cannot start a client thread: {e}");
        shared.open.lock().remove(&id);
    }
}

fn send_refusal(mut stream: UnixStream, refusal: Refusal) {
    use std::io::Write;
    let _ = stream.set_write_timeout(Some(std::time::Duration::from_millis(100)));
    let _ = stream.write_all(&Frame::Refused { code: refusal.code, reason: refusal.message }.encode());
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Everything one connection's thread does: handshake, then the ring until it ends.
fn serve(shared: &Arc<Shared>, id: u64, mut stream: UnixStream) {
    let attached = match handshake(shared, id, &mut stream) {
        Ok(attached) => attached,
        Err(refusal) => {
            METRICS.refused.with_label_values(&[refusal.reason]).inc();
            tracing::info!(client = id, "attach refused: {}", refusal.message);
            send_refusal(stream, refusal);
            return;
        }
    };
    let (conn, ring, lent) = attached;
    if let Some(entry) = shared.open.lock().get_mut(&id) {
        entry.1 = Some(Arc::clone(&conn));
    }
    METRICS.attaches.inc();
    METRICS.clients.inc();
    tracing::debug!(client = id, peer = %conn.peer, "client attached");
    let acl = shared.options.auth.as_ref().map(|a| &*a.acl);
    let ending = connection::run(
        Arc::clone(&conn),
        ring,
        stream,
        connection::Serving {
            submit: Arc::clone(&shared.submit),
            budget: shared.options.reply_budget_bytes,
            spin: shared.options.spin,
            acl,
            lending: lent.then(|| shared.options.lender.clone().map(|l| (l, conn.user.clone()))).flatten(),
        },
        &shared.stopping,
    );
    METRICS.clients.dec();
    match &ending {
        Ending::Closed => {
            METRICS.detaches.with_label_values(&["closed"]).inc();
            tracing::debug!(client = id, peer = %conn.peer, "client detached (it closed its socket)");
        }
        Ending::Shutdown => {
            METRICS.detaches.with_label_values(&["shutdown"]).inc();
        }
        Ending::ProtocolError { reason, message } => {
            METRICS.detaches.with_label_values(&["protocol_error"]).inc();
            METRICS.protocol_errors.with_label_values(&[reason]).inc();
            tracing::warn!(client = id, peer = %conn.peer, reason, "client detached for a protocol error: {message}");
        }
    }
}

/// Whether a peer with `uid` may attach to a daemon running as `own_uid`.
pub(super) fn uid_allowed(uid: u32, own_uid: u32, policy: &AllowedUids) -> bool {
    uid == 0
        || uid == own_uid
        || match policy {
            AllowedUids::SameUser => false,
            AllowedUids::Listed(uids) => uids.contains(&uid),
            AllowedUids::Any => true,
        }
}

/// Who a client attaching with `hello` is: the user it authenticated as, or, giving no
/// credentials, `default` when its uid is trusted (`own`) or `default` needs no password.
fn attaching_user(auth: &AttachAuth, hello: &Hello, own: bool) -> Result<String, Refusal> {
    let not_allowed = |m: &str| refuse(refusal::NOT_ALLOWED, "credentials", m);
    match (&hello.user, &hello.password) {
        (user, Some(password)) => match auth.acl.authenticate(user.as_deref().map(str::as_bytes), password) {
            Ok(user) => Ok(user.name().to_string()),
            Err(_) => Err(not_allowed("invalid username-password pair or user is disabled")),
        },
        (Some(_), None) => Err(not_allowed("a user needs its password")),
        (None, None) if (own && auth.trust_uid) || auth.acl.is_open() => Ok(DEFAULT_USER.to_string()),
        (None, None) => Err(not_allowed("authentication required: give a user and password")),
    }
}

/// The handshake: the client's attachment, its ring, and whether it was lent connections.
fn handshake(shared: &Shared, id: u64, stream: &mut UnixStream) -> Result<(Arc<Conn>, DaemonRing, bool), Refusal> {
    let unavailable =
        |e: io::Error| refuse(refusal::UNAVAILABLE, "unavailable", format!("setting up the ring failed: {e}"));
    let creds = nix::sys::socket::getsockopt(&*stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| refuse(refusal::UNAVAILABLE, "unavailable", format!("reading the peer's credentials: {e}")))?;
    let peer = format!("pid {} uid {}", creds.pid(), creds.uid());
    let uid = creds.uid();
    if !uid_allowed(uid, shared.own_uid, &shared.options.allowed_uids) {
        return Err(refuse(refusal::NOT_ALLOWED, "uid", format!("uid {uid} may not attach to this computenode")));
    }
    stream.set_read_timeout(Some(shared.options.handshake_timeout)).map_err(unavailable)?;
    stream.set_write_timeout(Some(shared.options.handshake_timeout)).map_err(unavailable)?;
    let read_error = |e: io::Error| {
        let why = if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            format!("no hello within {:?}", shared.options.handshake_timeout)
        } else {
            format!("reading the hello: {e}")
        };
        refuse(refusal::BAD_HELLO, "bad_hello", why)
    };
    let bad_hello = |e: racekv_transport::decode::DecodeError| refuse(refusal::BAD_HELLO, "bad_hello", e.to_string());
    let mut hello = vec![0u8; HELLO_BYTES];
    stream.read_exact(&mut hello).map_err(read_error)?;
    // Bounded by the decoder: at most a user name and a password.
    let credentials = Hello::credentials_len(&hello).map_err(bad_hello)?;
    hello.resize(HELLO_BYTES + credentials, 0);
    stream.read_exact(&mut hello[HELLO_BYTES..]).map_err(read_error)?;
    let hello = Hello::decode(&hello).map_err(bad_hello)?;
    let user = match &shared.options.auth {
        Some(auth) => Some(attaching_user(auth, &hello, uid == 0 || uid == shared.own_uid)?),
        None => None,
    };
    if shared.stopping.load(Ordering::Acquire) {
        return Err(refuse(refusal::UNAVAILABLE, "unavailable", "the computenode is shutting down"));
    }
    let (ring, memfd) = DaemonRing::create(shared.geometry, "racekv-attach").map_err(unavailable)?;
    let to_daemon = Doorbell::new().map_err(unavailable)?;
    let to_client = Doorbell::new().map_err(unavailable)?;
    let fds: [OwnedFd; 3] = [
        OwnedFd::from(memfd),
        to_daemon.try_clone_fd().map_err(unavailable)?,
        to_client.try_clone_fd().map_err(unavailable)?,
    ];
    let accepted = Accepted { attachment_id: id, geometry: shared.geometry, max_multi_keys: shared.max_multi_keys };
    let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    racekv_transport::fdpass::send_with_fds(stream, &Frame::Accepted(accepted).encode(), &borrowed)
        .map_err(unavailable)?;
    // Our copies of what the client holds now close here; the client's stay open.
    drop(fds);
    let lent = hello.borrow && lend(shared, stream, user.as_deref()).map_err(unavailable)?;
    let peer = format!("{peer} (says pid {})", hello.pid);
    let transfers = (Arc::clone(&shared.staging), format!("attach/{id}"));
    let conn = Arc::new(Conn::new(peer, user, transfers, ring.completer(), to_client, to_daemon));
    Ok((conn, ring, lent))
}

/// Answers a client that asked to borrow connections: LENT frames, or NOT_LENT with why.
/// Whether it lent them.
fn lend(shared: &Shared, stream: &mut UnixStream, user: Option<&str>) -> io::Result<bool> {
    use std::io::Write;
    let outcome = match &shared.options.lender {
        Some(lender) => lender.lend(user),
        None => Err(Refused::Policy("this computenode lends no connections (attach_lend = false)".into())),
    };
    let reason = match outcome {
        Ok(lent) => {
            // Counted before the client can see the frames, so that a client that holds its
            // connections finds them counted.
            METRICS.lendings.with_label_values(&["lent"]).inc();
            for memnode in &lent {
                let (frame, fds) = memnode.encode();
                racekv_transport::fdpass::send_with_fds(stream, &frame, &fds)?;
            }
            return Ok(true);
        }
        Err(Refused::Policy(reason)) => {
            METRICS.lendings.with_label_values(&["refused"]).inc();
            reason
        }
        Err(Refused::Failed(reason)) => {
            METRICS.lendings.with_label_values(&["failed"]).inc();
            tracing::warn!("lending connections failed: {reason}");
            reason
        }
    };
    stream.write_all(&Frame::NotLent { reason }.encode())?;
    Ok(false)
}
