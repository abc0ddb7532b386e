//! Client side of a frame stream shared by many threads.
//!
//! Requests carry ids, so several threads can have requests in flight on one connection.
//! There is no reader thread: a waiting thread takes the reader lock and reads responses,
//! handing each to its owner, until its own arrives; then it passes the role on. A lone
//! thread therefore reads its own response directly, with no wake-up in between.
//!
//! Both directions batch what concurrency offers: a sender that finds another writing
//! queues its frame for that writer's next write, and the reader takes every answer the
//! socket holds in one read (and delivers all those buffered before it hands the role on).

use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::TransportError;
use crate::stream::{read_frame, starts_with_whole_frame, FrameRead, READ_BUFFER_BYTES};
use crate::wire::{self, Kind};

/// How long a waiter sleeps before it looks at the reader role again on its own, in case a
/// hand-off was missed (a backstop; hand-offs normally wake it at once).
const WAIT_SLICE: Duration = Duration::from_millis(10);

enum State {
    Waiting,
    Done(Kind, Vec<u8>),
    Failed(String),
}

struct Waiter {
    state: Mutex<State>,
    ready: Condvar,
}

/// A request sent and not yet answered ([`Mux::send`], [`Mux::wait`]).
pub(crate) struct Ticket {
    id: u64,
    waiter: Arc<Waiter>,
    deadline: Instant,
}

/// Frames waiting to be written, and whether a sender is writing.
struct Outbox {
    queued: Vec<u8>,
    /// The buffer last written, kept for the next swap (no allocation per write).
    spare: Vec<u8>,
    writing: bool,
}

/// A shared request/response stream.
pub(crate) struct Mux<S> {
    outbox: Mutex<Outbox>,
    /// Taken only by the sender whose turn it is to write (`Outbox::writing`).
    writer: Mutex<S>,
    reader: Mutex<(BufReader<S>, Vec<u8>)>,
    pending: Mutex<HashMap<u64, Arc<Waiter>>>,
    next_id: AtomicU64,
    broken: AtomicBool,
    broken_reason: Mutex<String>,
    timeout: Duration,
    peer: String,
}

impl<S: Read + Write> Mux<S> {
    /// `write_half` and `read_half` are two handles of the same socket (`try_clone`); the
    /// read half must have a read timeout of [`crate::stream::POLL_INTERVAL`].
    pub(crate) fn new(write_half: S, read_half: S, timeout: Duration, peer: String) -> Self {
        Self {
            outbox: Mutex::new(Outbox {
                queued: Vec::with_capacity(4096),
                spare: Vec::with_capacity(4096),
                writing: false,
            }),
            writer: Mutex::new(write_half),
            reader: Mutex::new((BufReader::with_capacity(READ_BUFFER_BYTES, read_half), Vec::with_capacity(4096))),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            broken: AtomicBool::new(false),
            broken_reason: Mutex::new(String::new()),
            timeout,
            peer,
        }
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn lost(&self, maybe_executed: bool) -> TransportError {
        TransportError::ConnectionLost { reason: self.broken_reason.lock().clone(), maybe_executed }
    }

    /// Marks the connection broken and fails every pending request.
    pub(crate) fn break_with(&self, reason: String) {
        {
            let mut slot = self.broken_reason.lock();
            if slot.is_empty() {
                *slot = format!("{}: {reason}", self.peer);
            }
        }
        self.broken.store(true, Ordering::Release);
        let waiters: Vec<_> = self.pending.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiters {
            let mut state = waiter.state.lock();
            if matches!(*state, State::Waiting) {
                *state = State::Failed(reason.clone());
            }
            waiter.ready.notify_all();
        }
    }

    /// Sends the frame `encode` writes (given the request id); [`Mux::wait`] takes its
    /// response. Every ticket must be waited for (its waiter stays registered until its
    /// answer comes or the connection breaks). When another sender is writing, the frame
    /// goes out with that sender's next write and this returns at once.
    pub(crate) fn send(&self, encode: impl FnOnce(&mut Vec<u8>, u64)) -> Result<Ticket, TransportError> {
        if self.is_broken() {
            return Err(self.lost(false));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let waiter = Arc::new(Waiter { state: Mutex::new(State::Waiting), ready: Condvar::new() });
        self.pending.lock().insert(id, Arc::clone(&waiter));
        // A break that drained `pending` before the insert is seen here (it sets the flag
        // first), so no waiter is left that nobody will answer or fail.
        if self.is_broken() {
            self.pending.lock().remove(&id);
            return Err(self.lost(false));
        }
        let ticket = Ticket { id, waiter, deadline: Instant::now() + self.timeout };
        let mut outbox = self.outbox.lock();
        encode(&mut outbox.queued, id);
        if outbox.writing {
            return Ok(ticket);
        }
        outbox.writing = true;
        let mut stream = self.writer.lock();
        loop {
            let mut frames = std::mem::take(&mut outbox.spare);
            std::mem::swap(&mut frames, &mut outbox.queued);
            drop(outbox);
            let written = stream.write_all(&frames).and_then(|()| stream.flush());
            frames.clear();
            outbox = self.outbox.lock();
            outbox.spare = frames;
            if let Err(e) = written {
                // Frames queued meanwhile are dropped: the break fails their waiters.
                outbox.queued.clear();
                outbox.writing = false;
                drop((outbox, stream));
                self.break_with(format!("write failed: {e}"));
                return Err(self.lost(true));
            }
            if outbox.queued.is_empty() {
                outbox.writing = false;
                return Ok(ticket);
            }
        }
    }

    /// Waits for the response to `ticket`'s request (reading for every waiter while the
    /// reader role is free). Returns its kind and body; an Error frame becomes a
    /// [`TransportError`].
    pub(crate) fn wait(&self, ticket: Ticket) -> Result<(Kind, Vec<u8>), TransportError> {
        let Ticket { id, waiter, deadline } = ticket;
        loop {
            let mut state = waiter.state.lock();
            match std::mem::replace(&mut *state, State::Waiting) {
                State::Done(Kind::Error, body) => return Err(error_frame(&body, &self.peer)),
                State::Done(kind, body) => return Ok((kind, body)),
                State::Failed(reason) => {
                    return Err(TransportError::ConnectionLost {
                        reason: format!("{}: {reason}", self.peer),
                        maybe_executed: true,
                    })
                }
                State::Waiting => {}
            }
            if self.is_broken() {
                // Failed by the break unless it came after it (then never answered).
                drop(state);
                self.pending.lock().remove(&id);
                return Err(self.lost(true));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                self.pending.lock().remove(&id);
                // It may have been woken to read for the others.
                self.hand_off();
                return Err(TransportError::Timeout { waited_ms: self.timeout.as_millis() as u64 });
            }
            if let Some(reader) = self.reader.try_lock() {
                drop(state);
                self.lead(reader, &waiter, deadline);
                continue;
            }
            // Holding our state lock across the failed try_lock and into the wait means a
            // leader's hand-off (which locks our state to notify) cannot slip in between.
            let slice = (deadline - now).min(WAIT_SLICE);
            waiter.ready.wait_for(&mut state, slice);
        }
    }

    /// Reads frames and delivers them until `own` is answered, the deadline passes or the
    /// stream breaks; then hands the reader role to another waiter.
    fn lead(&self, mut reader: MutexGuard<'_, (BufReader<S>, Vec<u8>)>, own: &Arc<Waiter>, deadline: Instant) {
        loop {
            if !matches!(*own.state.lock(), State::Waiting) || Instant::now() >= deadline || self.is_broken() {
                break;
            }
            if !self.read_one(&mut reader) {
                break;
            }
        }
        // Answers already buffered go to their owners now: handing them to the next leader
        // would cost a wake-up each.
        while !self.is_broken() && starts_with_whole_frame(reader.0.buffer()) {
            self.read_one(&mut reader);
        }
        drop(reader);
        self.hand_off();
    }

    /// Notices a peer that hung up while nobody was waiting for an answer (an idle
    /// connection is otherwise only found broken by its next request): takes the reader
    /// role if it is free, reads for at most one poll interval, and delivers what came.
    pub(crate) fn poll_hang_up(&self) {
        if self.is_broken() {
            return;
        }
        let Some(mut reader) = self.reader.try_lock() else {
            return; // a leader is reading: it will see a hang-up itself
        };
        self.read_one(&mut reader);
        drop(reader);
        self.hand_off();
    }

    /// Reads one frame (or one poll interval of nothing) and delivers it; false once the
    /// stream is broken.
    fn read_one(&self, reader: &mut (BufReader<S>, Vec<u8>)) -> bool {
        let (stream, body) = reader;
        match read_frame(stream, body, self.timeout) {
            Ok(FrameRead::Idle) => true,
            Ok(FrameRead::Closed) => {
                self.break_with("peer closed the connection".into());
                false
            }
            Ok(FrameRead::Frame(header)) => {
                let body = std::mem::take(body);
                if header.kind == Kind::Error && header.request_id == 0 {
                    let (_, message) = wire::decode_error(&body).unwrap_or((0, "unreadable error frame".into()));
                    self.break_with(format!("peer closed the connection: {message}"));
                    return false;
                }
                // None: its requester gave up (timeout); the late answer is dropped.
                if let Some(waiter) = self.pending.lock().remove(&header.request_id) {
                    *waiter.state.lock() = State::Done(header.kind, body);
                    waiter.ready.notify_all();
                }
                true
            }
            Err(e) => {
                self.break_with(format!("read failed: {e}"));
                false
            }
        }
    }

    /// Wakes one waiter still waiting for its answer, which takes the reader role (its loop
    /// finds the reader free). One, not all: with many threads on one connection, waking
    /// every waiter after each leader's turn had all but one of them wake, lose the race for
    /// the reader and sleep again, on every round trip. A waiter that leaves without taking
    /// the role (its deadline passed) hands off again; should a wake-up still be missed, the
    /// others look again within [`WAIT_SLICE`].
    fn hand_off(&self) {
        let waiters: Vec<_> = self.pending.lock().values().cloned().collect();
        for waiter in waiters {
            let state = waiter.state.lock();
            if matches!(*state, State::Waiting) {
                waiter.ready.notify_all();
                return;
            }
        }
    }
}

/// Turns an Error frame into the matching transport error.
pub(crate) fn error_frame(body: &[u8], peer: &str) -> TransportError {
    match wire::decode_error(body) {
        Ok((wire::error_code::AUTH, _)) => TransportError::AuthRefused { peer: peer.to_string() },
        Ok((_, message)) => TransportError::Protocol(format!("{peer} refused the request: {message}")),
        Err(e) => TransportError::Protocol(format!("{peer} sent an unreadable error frame: {e}")),
    }
}
