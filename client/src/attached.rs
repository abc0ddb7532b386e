//! Attached mode: this process hands its operations to the local computenode daemon through
//! a shared-memory ring (the [`crate::attach`] protocol); the daemon's workers run them on
//! their pre-initialized connections.
//!
//! Any number of threads share one attachment: each call takes a free slot, writes its
//! request, publishes it and waits for its own completion. Waiting needs no helper thread:
//! a waiting thread spins on the completion tail for a short while; past that, one waiter at
//! a time sleeps on the client's doorbell and the others on a condition variable; whoever
//! notices completions marks them done for their owners and wakes everybody. A watcher
//! thread blocks on the control socket and fails all calls once the daemon goes away (with
//! the daemon's goodbye reason when it sent one). The next call then attaches again, so
//! clients survive a daemon restart.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::attach::area::status;
use crate::attach::handshake::{kind, refusal, FRAME_HEADER_BYTES, MAX_FRAME_BODY};
use crate::attach::lending::{LentMemnode, MAX_LENT_DESCRIPTORS};
use crate::attach::{doorbell, monotonic_ns, Accepted, ClientRing, Doorbell, Frame, Hello};
use crate::channel::{Batch, Channel, Take};
use crate::error::ClientError;
use crate::op::{ErrorKind, Reply, Request, MAX_MULTI};
use crate::Mode;

/// A multi-key request's bytes before its items (its kind and count).
const REQUEST_HEADER_BYTES: usize = 4;
/// Re-attach attempts are at least this far apart.
const REATTACH_BACKOFF: Duration = Duration::from_millis(100);
/// The longest a sleeping waiter sleeps before looking around again (a safety net: wake-ups
/// do not depend on it).
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Why nothing could be attached at `path`.
fn no_daemon(path: &Path, label: &str, e: &std::io::Error) -> ClientError {
    ClientError::Unavailable {
        endpoint: label.to_string(),
        reason: format!(
            "no computenode listens on {} ({e}); start one (`racekv up`), pass the socket of a running one \
             with `.attach(path)`, or use embedded mode with `.memnode(endpoint)`",
            path.display()
        ),
    }
}

/// An attached client: the socket path, and the current attachment (replaced when the
/// daemon went away).
pub(crate) struct Attached {
    path: PathBuf,
    label: String,
    /// Who to attach as (re-sent when attaching again).
    hello: Hello,
    timeout: Duration,
    spin: Duration,
    current: Mutex<Arc<Attachment>>,
    last_attempt: Mutex<Instant>,
}

impl Attached {
    /// Attaches to the daemon listening on `path`, as `user` with `password` when given.
    pub(crate) fn connect(
        path: PathBuf,
        user: Option<String>,
        password: Option<String>,
        timeout: Duration,
        spin: Duration,
        borrow: bool,
    ) -> Result<Self, ClientError> {
        let label = format!("attach:{}", path.display());
        let too_long = |what: &str, max: usize| ClientError::Config(format!("a {what} longer than {max} bytes"));
        if user.as_ref().is_some_and(|u| u.len() > crate::attach::handshake::MAX_USER_BYTES) {
            return Err(too_long("user name", crate::attach::handshake::MAX_USER_BYTES));
        }
        if password.as_ref().is_some_and(|p| p.len() > crate::attach::handshake::MAX_PASSWORD_BYTES) {
            return Err(too_long("password", crate::attach::handshake::MAX_PASSWORD_BYTES));
        }
        let hello = Hello { pid: std::process::id(), user, password: password.map(String::into_bytes), borrow };
        let attachment = Attachment::connect(&path, &label, &hello, timeout, spin)?;
        Ok(Self {
            path,
            label,
            hello,
            timeout,
            spin,
            current: Mutex::new(attachment),
            last_attempt: Mutex::new(Instant::now()),
        })
    }

    /// What the daemon lent at attach time (once; later calls get None), and a watch on
    /// whether it took it back.
    pub(crate) fn take_lending(&self) -> Option<(Result<Vec<LentMemnode>, String>, LendingWatch)> {
        let current = Arc::clone(&self.current.lock());
        let lending = current.lending.lock().take()?;
        Some((lending, LendingWatch { inner: Arc::clone(&current.inner) }))
    }

    /// The current attachment, attaching again if the daemon went away.
    fn attachment(&self) -> Result<Arc<Attachment>, ClientError> {
        let current = Arc::clone(&self.current.lock());
        if !current.inner.is_broken() {
            return Ok(current);
        }
        // One thread re-attaches; the others fail fast meanwhile.
        let Some(mut last) = self.last_attempt.try_lock() else {
            return Err(current.inner.broken_error());
        };
        if last.elapsed() < REATTACH_BACKOFF {
            return Err(current.inner.broken_error());
        }
        *last = Instant::now();
        // Connections are lent once, with the first attachment.
        let hello = Hello { borrow: false, ..self.hello.clone() };
        let fresh = Attachment::connect(&self.path, &self.label, &hello, self.timeout, self.spin)?;
        tracing::info!(socket = %self.path.display(), "attached to the computenode again");
        *self.current.lock() = Arc::clone(&fresh);
        Ok(fresh)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// One message in one slot, and its decoded reply.
    fn send(&self, attachment: &Attachment, message: &[u8]) -> Result<Reply, ClientError> {
        let deadline = self.deadline();
        let ticket = attachment.start(message, deadline, true)?.expect("a blocking start gives a ticket");
        let (reply, payload) = attachment.finish(ticket, deadline)?;
        if reply.status != status::REPLY {
            return Err(ClientError::Protocol(format!(
                "the computenode's reply of {} bytes does not fit a ring slot of {}",
                reply.len,
                attachment.payload_bytes()
            )));
        }
        Reply::decode(&payload).map_err(|e| ClientError::Protocol(format!("reply from the computenode: {e}")))
    }

    /// Sends `chunks` (index lists) with up to half the ring in flight, hands each reply to
    /// `take`, splits chunks whose reply did not fit a slot. Staged replies are fetched once
    /// the pipeline has drained (fetching while holding slots could starve other threads).
    /// The first error wins; chunks already in flight are still waited for, so no slot is
    /// left behind.
    fn pipeline(
        &self,
        attachment: &Arc<Attachment>,
        chunks: Vec<Vec<usize>>,
        encode: impl Fn(&[usize]) -> Vec<u8>,
        take: &mut Take<'_>,
    ) -> Result<(), ClientError> {
        let deadline = self.deadline();
        let window = (attachment.accepted.geometry.slots() as usize / 2).max(1);
        let mut work: std::collections::VecDeque<Vec<usize>> = chunks.into();
        let mut flying: std::collections::VecDeque<(Vec<usize>, Ticket)> = std::collections::VecDeque::new();
        let mut staged: Vec<(Vec<usize>, u64, u64)> = Vec::new();
        let mut first_error: Option<ClientError> = None;
        loop {
            while first_error.is_none() && flying.len() < window {
                let Some(chunk) = work.pop_front() else { break };
                // Block for a slot only when we hold none ourselves (holding some while
                // waiting for more could starve everyone).
                match attachment.start(&encode(&chunk), deadline, flying.is_empty()) {
                    Ok(Some(ticket)) => flying.push_back((chunk, ticket)),
                    Ok(None) => {
                        work.push_front(chunk);
                        break;
                    }
                    Err(e) => first_error = Some(e),
                }
            }
            let Some((chunk, ticket)) = flying.pop_front() else { break };
            let outcome = attachment.finish(ticket, deadline).and_then(|(reply, payload)| {
                if reply.status == status::REPLY_TOO_LARGE {
                    if chunk.len() == 1 {
                        return Err(ClientError::Protocol(format!(
                            "a one-key reply of {} bytes does not fit a ring slot",
                            reply.len
                        )));
                    }
                    let parts = (reply.len.div_ceil(attachment.payload_bytes()) + 1).min(chunk.len());
                    let per = chunk.len().div_ceil(parts);
                    for part in chunk.chunks(per).rev() {
                        work.push_front(part.to_vec());
                    }
                    return Ok(());
                }
                match Reply::decode(&payload)
                    .map_err(|e| ClientError::Protocol(format!("reply from the computenode: {e}")))?
                {
                    Reply::Staged { id, total } => {
                        staged.push((chunk, id, total));
                        Ok(())
                    }
                    reply => take(&chunk, reply),
                }
            });
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        // Fetched even after an error, so the daemon frees them now.
        for (chunk, id, total) in staged {
            let outcome = crate::parts::fetch(attachment.payload_bytes(), id, total, &mut |message| {
                self.send(attachment, message)
            })
            .and_then(|reply| take(&chunk, reply));
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Channel for Attached {
    fn mode(&self) -> Mode {
        Mode::Attached
    }

    fn label(&self) -> &str {
        &self.label
    }

    /// Runs one request: in one slot when it fits (the fast path), else in parts; a reply
    /// too large for a slot is fetched in parts. All parts go through one attachment (the
    /// daemon keeps a transfer per attachment).
    fn call(&self, request: &Request) -> Result<Reply, ClientError> {
        let mut bytes = Vec::new();
        request.encode(&mut bytes);
        let attachment = self.attachment()?;
        crate::parts::call(attachment.payload_bytes(), &bytes, &mut |message| self.send(&attachment, message))
    }

    /// Chunks that fit a slot (and, for gets, the daemon's key limit) travel pipelined (a
    /// chunk whose reply outgrew its slot comes back staged, or is split and asked again);
    /// an item too large for a slot goes alone, in parts.
    fn call_many(&self, batch: &Batch<'_>, take: &mut Take<'_>) -> Result<(), ClientError> {
        let attachment = self.attachment()?;
        let payload = attachment.payload_bytes();
        let max_items = match batch {
            Batch::Get(_) => (attachment.accepted.max_multi_keys as usize).min(MAX_MULTI),
            Batch::Put(_) => MAX_MULTI,
        };
        let (fitting, alone): (Vec<usize>, Vec<usize>) =
            (0..batch.len()).partition(|&i| REQUEST_HEADER_BYTES + batch.item_bytes(i) <= payload);
        for i in alone {
            take(&[i], self.call(&batch.request(&[i]))?)?;
        }
        let chunks = pack(&fitting, |i| batch.item_bytes(i), REQUEST_HEADER_BYTES, payload, max_items);
        let encode = |items: &[usize]| {
            let mut bytes = Vec::new();
            batch.request(items).encode(&mut bytes);
            bytes
        };
        self.pipeline(&attachment, chunks, encode, take)
    }

    fn error_reply(&self, kind: ErrorKind, message: String) -> ClientError {
        match kind {
            ErrorKind::Timeout => ClientError::Timeout { endpoint: self.label.clone(), after: self.timeout },
            other => Reply::into_error(other, message, &self.label),
        }
    }

    /// Pages no larger than a ring slot holds (a key longer than that cannot come back:
    /// with slots under 16 KiB the daemon's answer does not fit, an error).
    fn scan_page_bytes(&self) -> Result<u32, ClientError> {
        let room = self.attachment()?.payload_bytes().saturating_sub(crate::op::SCAN_REPLY_HEADER_BYTES);
        Ok((room.min(crate::op::MAX_SCAN_REPLY_BYTES as usize) as u32).max(1))
    }

    fn attach_socket(&self) -> Option<&Path> {
        Some(&self.path)
    }
}

/// Groups `items` into chunks whose encoded size (`header` + the sum of `size`) fits `limit`
/// bytes and that hold at most `max_items`.
fn pack(
    items: &[usize],
    size: impl Fn(usize) -> usize,
    header: usize,
    limit: usize,
    max_items: usize,
) -> Vec<Vec<usize>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut bytes = header;
    for &i in items {
        let s = size(i);
        if !current.is_empty() && (bytes + s > limit || current.len() >= max_items) {
            chunks.push(std::mem::take(&mut current));
            bytes = header;
        }
        current.push(i);
        bytes += s;
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// A request in flight in a slot.
#[derive(Debug)]
struct Ticket {
    slot: u32,
    id: u64,
}

/// One attachment: the mapped ring, the doorbells, and the control socket.
struct Attachment {
    inner: Arc<Inner>,
    accepted: Accepted,
    control: UnixStream,
    watcher: Option<JoinHandle<()>>,
    /// What the daemon lent, when this attachment asked (taken once).
    lending: Mutex<Option<Result<Vec<LentMemnode>, String>>>,
}

/// Whether the daemon took back what it lent with an attachment.
pub(crate) struct LendingWatch {
    inner: Arc<Inner>,
}

impl LendingWatch {
    /// The daemon revoked the lending (or the attachment it came with broke).
    pub(crate) fn revoked(&self) -> bool {
        self.inner.ring.lending_revoked() || self.inner.is_broken()
    }
}

/// Why a frame could not be read off the control socket.
enum FrameError {
    Io(std::io::Error),
    Decode(racekv_transport::decode::DecodeError),
}

/// One frame (header and body) off the control socket, and the descriptors that rode on
/// its first bytes (at most `max_fds`; more are closed by the kernel's receive).
fn read_frame(stream: &UnixStream, max_fds: usize) -> Result<(Vec<u8>, Vec<OwnedFd>), FrameError> {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < header.len() {
        let room = max_fds.saturating_sub(fds.len()).max(1);
        let (n, more) =
            racekv_transport::fdpass::recv_with_fds(stream, &mut header[got..], room).map_err(FrameError::Io)?;
        if n == 0 {
            return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        got += n;
        fds.extend(more);
    }
    let (_, _, body_len) = Frame::decode_header(&header).map_err(FrameError::Decode)?;
    let mut frame = header.to_vec();
    frame.resize(FRAME_HEADER_BYTES + body_len, 0);
    (&*stream).read_exact(&mut frame[FRAME_HEADER_BYTES..]).map_err(FrameError::Io)?;
    Ok((frame, fds))
}

/// Reads the daemon's answer to a hello that asked to borrow connections: one LENT frame
/// per memnode, in order, or one NOT_LENT.
fn read_lending(
    stream: &UnixStream,
    label: &str,
    timeout: Duration,
) -> Result<Result<Vec<LentMemnode>, String>, ClientError> {
    let io_error = |e: std::io::Error| {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            ClientError::Timeout { endpoint: label.to_string(), after: timeout }
        } else {
            ClientError::Unavailable { endpoint: label.to_string(), reason: format!("reading lent connections: {e}") }
        }
    };
    let protocol = |e: racekv_transport::decode::DecodeError| ClientError::Protocol(e.to_string());
    let mut lent: Vec<LentMemnode> = Vec::new();
    loop {
        let (frame, fds) = read_frame(stream, MAX_LENT_DESCRIPTORS).map_err(|e| match e {
            FrameError::Io(e) => io_error(e),
            FrameError::Decode(e) => protocol(e),
        })?;
        let (frame_kind, _, _) = Frame::decode_header(&frame[..FRAME_HEADER_BYTES]).map_err(protocol)?;
        if frame_kind != kind::LENT {
            return match Frame::decode(&frame).map_err(protocol)? {
                Frame::NotLent { reason } => Ok(Err(reason)),
                other => Err(ClientError::Protocol(format!("expected lent connections, got {other:?}"))),
            };
        }
        let memnode = LentMemnode::decode(&frame[FRAME_HEADER_BYTES..], fds).map_err(protocol)?;
        if usize::from(memnode.index) != lent.len() || lent.first().is_some_and(|m| m.count != memnode.count) {
            return Err(ClientError::Protocol(format!(
                "lent memnode {} of {} out of order",
                memnode.index, memnode.count
            )));
        }
        let done = usize::from(memnode.index) + 1 == usize::from(memnode.count);
        lent.push(memnode);
        if done {
            return Ok(Ok(lent));
        }
    }
}

struct Reap {
    /// Completions consumed.
    head: u64,
    /// Slots whose caller gave up waiting; freed when their completion arrives.
    abandoned: Vec<bool>,
    /// Whether a thread sleeps on the doorbell.
    sleeper: bool,
}

struct Inner {
    ring: ClientRing,
    label: String,
    timeout: Duration,
    spin: Duration,
    to_daemon: Doorbell,
    from_daemon: Doorbell,
    free: Mutex<Vec<u32>>,
    free_cv: Condvar,
    reap: Mutex<Reap>,
    reap_cv: Condvar,
    /// Per slot: its completion arrived (set by whoever reaps, cleared by the owner).
    done: Box<[AtomicBool]>,
    /// `Reap::head`, readable without the lock.
    seen_tail: AtomicU64,
    broken: AtomicBool,
    broken_reason: Mutex<Option<String>>,
    next_id: AtomicU64,
}

impl Attachment {
    fn connect(
        path: &Path,
        label: &str,
        hello: &Hello,
        timeout: Duration,
        spin: Duration,
    ) -> Result<Arc<Self>, ClientError> {
        let io_error = |what: &str, e: std::io::Error| {
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                ClientError::Timeout { endpoint: label.to_string(), after: timeout }
            } else {
                ClientError::Unavailable { endpoint: label.to_string(), reason: format!("{what}: {e}") }
            }
        };
        let mut stream = UnixStream::connect(path).map_err(|e| no_daemon(path, label, &e))?;
        stream.set_read_timeout(Some(timeout)).map_err(|e| io_error("attaching", e))?;
        stream.set_write_timeout(Some(timeout)).map_err(|e| io_error("attaching", e))?;
        // A daemon that refuses at once (too many clients) may close before reading the
        // hello: then its refusal is still there to read, and says more than EPIPE.
        let sent = stream.write_all(&hello.encode());

        let protocol = |e: racekv_transport::decode::DecodeError| ClientError::Protocol(e.to_string());
        let (frame, fds) = match (read_frame(&stream, 3), sent) {
            (Ok(read), _) => read,
            (Err(FrameError::Decode(e)), _) => return Err(protocol(e)),
            (Err(_), Err(e)) => return Err(io_error("sending hello", e)),
            (Err(FrameError::Io(e)), Ok(())) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(ClientError::Unavailable {
                    endpoint: label.to_string(),
                    reason: "the computenode closed the socket during the handshake".into(),
                })
            }
            (Err(FrameError::Io(e)), Ok(())) => return Err(io_error("reading the daemon's answer", e)),
        };
        let accepted = match Frame::decode(&frame).map_err(protocol)? {
            Frame::Accepted(accepted) => accepted,
            Frame::Refused { code, reason } => {
                let reason = format!("the computenode at {} refused to attach: {reason}", path.display());
                return Err(match code {
                    refusal::TOO_MANY_CLIENTS => ClientError::Overloaded(reason),
                    refusal::NOT_ALLOWED => ClientError::Denied(reason),
                    refusal::BAD_HELLO => ClientError::Protocol(reason),
                    _ => ClientError::Unavailable { endpoint: label.to_string(), reason },
                });
            }
            Frame::Goodbye { reason, .. } | Frame::NotLent { reason } => {
                return Err(ClientError::Unavailable { endpoint: label.to_string(), reason });
            }
        };
        let [memfd, to_daemon, from_daemon]: [OwnedFd; 3] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            ClientError::Protocol(format!("the computenode passed {} descriptors, expected 3", fds.len()))
        })?;
        let ring = ClientRing::map(&File::from(memfd), accepted.geometry).map_err(ClientError::Protocol)?;
        let slots = accepted.geometry.slots();
        let inner = Arc::new(Inner {
            seen_tail: AtomicU64::new(ring.completion_tail()),
            reap: Mutex::new(Reap {
                head: ring.completion_tail(),
                abandoned: vec![false; slots as usize],
                sleeper: false,
            }),
            ring,
            label: label.to_string(),
            timeout,
            spin,
            to_daemon: Doorbell::from_fd(to_daemon),
            from_daemon: Doorbell::from_fd(from_daemon),
            free: Mutex::new((0..slots).rev().collect()),
            free_cv: Condvar::new(),
            reap_cv: Condvar::new(),
            done: (0..slots).map(|_| AtomicBool::new(false)).collect(),
            broken: AtomicBool::new(false),
            broken_reason: Mutex::new(None),
            next_id: AtomicU64::new(1),
        });
        let lending = if hello.borrow { Some(read_lending(&stream, label, timeout)?) } else { None };
        stream.set_read_timeout(None).map_err(|e| io_error("attaching", e))?;
        let watch = stream.try_clone().map_err(|e| io_error("attaching", e))?;
        let watched = Arc::clone(&inner);
        let watcher = std::thread::Builder::new()
            .name("racekv-attach-watch".into())
            .spawn(move || watch_daemon(watch, &watched))
            .map_err(|e| io_error("starting the watcher thread", e))?;
        tracing::debug!(socket = %path.display(), id = accepted.attachment_id, "attached to the computenode");
        Ok(Arc::new(Self { inner, accepted, control: stream, watcher: Some(watcher), lending: Mutex::new(lending) }))
    }

    fn payload_bytes(&self) -> usize {
        self.accepted.geometry.payload_bytes()
    }

    /// Takes a slot, writes `bytes` into it and publishes it. Without `block`, returns None
    /// at once when no slot is free.
    fn start(&self, bytes: &[u8], deadline: Instant, block: bool) -> Result<Option<Ticket>, ClientError> {
        let inner = &*self.inner;
        let slot = loop {
            if inner.is_broken() {
                return Err(inner.broken_error());
            }
            {
                let mut free = inner.free.lock();
                if let Some(slot) = free.pop() {
                    break slot;
                }
                if !block {
                    return Ok(None);
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(inner.timeout_error());
                }
                // Slots come back as their owners finish; abandoned ones when reaped.
                inner.free_cv.wait_for(&mut free, (deadline - now).min(Duration::from_millis(1)));
            }
            inner.reap();
        };
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        inner.ring.write_request(slot, id, monotonic_ns(), bytes);
        if inner.ring.submit(slot) {
            inner.to_daemon.ring();
        }
        Ok(Some(Ticket { slot, id }))
    }

    /// Waits for `ticket`'s reply and frees its slot. On a timeout or a lost daemon the
    /// slot is abandoned (freed when, if ever, its completion arrives).
    fn finish(&self, ticket: Ticket, deadline: Instant) -> Result<(crate::attach::SlotReply, Vec<u8>), ClientError> {
        let inner = &*self.inner;
        inner.wait(&ticket, deadline)?;
        let mut payload = Vec::new();
        let reply = inner.ring.read_reply(ticket.slot, &mut payload);
        inner.done[ticket.slot as usize].store(false, Ordering::Relaxed);
        inner.free.lock().push(ticket.slot);
        inner.free_cv.notify_one();
        let reply = reply.map_err(ClientError::Protocol)?;
        if reply.request_id != ticket.id {
            return Err(ClientError::Protocol(format!(
                "slot {} came back with request id {}, expected {}",
                ticket.slot, reply.request_id, ticket.id
            )));
        }
        Ok((reply, payload))
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
    }
}

impl Inner {
    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn broken_error(&self) -> ClientError {
        let reason = self.broken_reason.lock().clone().unwrap_or_else(|| "the attachment is closed".into());
        ClientError::Unavailable { endpoint: self.label.clone(), reason }
    }

    fn timeout_error(&self) -> ClientError {
        ClientError::Timeout { endpoint: self.label.clone(), after: self.timeout }
    }

    fn mark_broken(&self, reason: String) {
        {
            let mut slot = self.broken_reason.lock();
            if slot.is_none() {
                *slot = Some(reason);
            }
        }
        self.broken.store(true, Ordering::Release);
        // Wake everyone: the sleeper through its doorbell, the rest through the condvars.
        self.from_daemon.ring();
        self.reap_cv.notify_all();
        self.free_cv.notify_all();
    }

    /// Consumes the completions published so far: marks their slots done (or frees the
    /// abandoned ones) and wakes the waiters.
    fn reap(&self) {
        let slots = self.ring.geometry().slots();
        let mut freed = Vec::new();
        {
            let mut reap = self.reap.lock();
            let tail = self.ring.completion_tail();
            if tail == reap.head {
                return;
            }
            if tail.wrapping_sub(reap.head) > u64::from(slots) {
                drop(reap);
                self.mark_broken(format!("the computenode published an impossible completion tail {tail}"));
                return;
            }
            while reap.head != tail {
                match self.ring.completion(reap.head) {
                    Ok(slot) if reap.abandoned[slot as usize] => {
                        reap.abandoned[slot as usize] = false;
                        freed.push(slot);
                    }
                    Ok(slot) => self.done[slot as usize].store(true, Ordering::Release),
                    Err(e) => {
                        drop(reap);
                        self.mark_broken(e);
                        return;
                    }
                }
                reap.head = reap.head.wrapping_add(1);
            }
            self.ring.consumed(reap.head);
            self.seen_tail.store(reap.head, Ordering::Release);
        }
        self.reap_cv.notify_all();
        if !freed.is_empty() {
            self.free.lock().extend(freed);
            self.free_cv.notify_all();
        }
    }

    fn wait(&self, ticket: &Ticket, deadline: Instant) -> Result<(), ClientError> {
        let slot = ticket.slot as usize;
        let spin_until = Instant::now() + self.spin;
        loop {
            // Spin: watch our slot, the completion tail and the broken flag, lock-free.
            loop {
                if self.done[slot].load(Ordering::Acquire) {
                    return Ok(());
                }
                if self.ring.completion_tail() != self.seen_tail.load(Ordering::Acquire) {
                    self.reap();
                    continue;
                }
                if self.is_broken() || Instant::now() >= spin_until {
                    break;
                }
                std::hint::spin_loop();
            }
            let mut reap = self.reap.lock();
            if self.done[slot].load(Ordering::Acquire) {
                return Ok(());
            }
            let now = Instant::now();
            if self.is_broken() || now >= deadline {
                // Nobody will read this slot's reply: free it when (if) it completes.
                reap.abandoned[slot] = true;
                drop(reap);
                return Err(if self.is_broken() { self.broken_error() } else { self.timeout_error() });
            }
            if reap.sleeper {
                self.reap_cv.wait_until(&mut reap, deadline.min(now + MAX_SLEEP));
                continue;
            }
            reap.sleeper = true;
            drop(reap);
            self.ring.set_sleeping(true);
            // Sleep only if, with the flag up, nothing arrived since: not a completion the
            // daemon published (it would have seen no flag), nor ours reaped by another thread.
            if self.ring.completion_tail() == self.seen_tail.load(Ordering::Acquire)
                && !self.done[slot].load(Ordering::Acquire)
                && !self.is_broken()
            {
                let _ = doorbell::wait_readable(&[self.from_daemon.as_fd()], Some((deadline - now).min(MAX_SLEEP)));
            }
            self.ring.set_sleeping(false);
            self.from_daemon.drain();
            self.reap.lock().sleeper = false;
            self.reap();
            // Hand the sleeper's role on (reap notifies only when something completed).
            self.reap_cv.notify_all();
        }
    }
}

/// Blocks on the control socket until the daemon closes it (or we shut it down), then fails
/// the attachment with the daemon's goodbye reason, if it sent one.
fn watch_daemon(mut stream: UnixStream, inner: &Inner) {
    let mut said = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if said.len() < FRAME_HEADER_BYTES + MAX_FRAME_BODY {
                    said.extend_from_slice(&buf[..n]);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let reason = match Frame::decode(&said) {
        Ok(Frame::Goodbye { reason, .. }) => format!("the computenode closed the attachment: {reason}"),
        _ => "the computenode closed the attachment (it stopped, or restarted)".to_string(),
    };
    inner.mark_broken(reason);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_respects_bytes_and_counts() {
        let sizes = [10usize, 10, 30, 5, 5, 5, 40];
        let items: Vec<usize> = (0..sizes.len()).collect();
        let chunks = pack(&items, |i| sizes[i], 4, 44, 2);
        assert_eq!(chunks, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6]]);
        for chunk in &chunks {
            assert!(chunk.len() <= 2);
            assert!(chunk.len() == 1 || 4 + chunk.iter().map(|&i| sizes[i]).sum::<usize>() <= 44);
        }
        assert!(pack(&[], |_| 1, 4, 10, 3).is_empty());
    }

    #[test]
    fn a_missing_daemon_names_the_path_and_the_alternatives() {
        let dir = std::env::temp_dir().join(format!("racekv-no-daemon-{}", std::process::id()));
        let path = dir.join("computenode.sock");
        let err =
            Attached::connect(path.clone(), None, None, Duration::from_secs(1), Duration::ZERO, false).err().unwrap();
        let text = err.to_string();
        assert!(matches!(err, ClientError::Unavailable { .. }), "{err:?}");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("racekv up") && text.contains(".memnode("), "{text}");
    }
}
