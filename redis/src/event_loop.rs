//! Event loops for [`IoModel::EventLoop`](super::options::IoModel): each loop thread owns its
//! connections (socket, parser, replies not yet written, storage session) and serves
//! whichever are ready, executing their commands inline, as redis-server does. A client that
//! keeps one request outstanding then costs no wake-up of a sleeping thread per request:
//! the loop is already awake, serving the others.
//!
//! Sockets are edge-triggered (mio): a connection is served until its socket would block,
//! or for [`MAX_READS_PER_TURN`] reads, after which it goes to the back of the line so one
//! busy client cannot starve its loop's others. Backpressure: while a connection's replies
//! are not all written, its input is not read (the parser holds at most what was read).
//! Limits and endings match the thread-per-connection model: `max_clients` at accept,
//! `idle_timeout`, `write_timeout`, the parser's limits, error reply then linger.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use parking_lot::Mutex;

use super::commands::Client;
use super::metrics::METRICS;
use super::reply::Output;
use super::resp::Parser;
use super::serving::{
    feed, new_client, new_parser, release, run_commands, Serving, Step, LINGER, LINGER_MAX_BYTES, READ_CHUNK_BYTES,
};

/// Reads one connection gets before the loop turns to the others.
const MAX_READS_PER_TURN: usize = 16;
/// Longest a loop with connections sleeps before it looks at their timeouts.
const TICK: Duration = Duration::from_millis(50);
/// Longest a loop with no connections sleeps: adoption and shutdown wake it, so this only
/// bounds what a failed wake-up could cost.
const IDLE_TICK: Duration = Duration::from_secs(1);
const WAKE: Token = Token(usize::MAX);
const EVENTS_PER_POLL: usize = 256;

/// One event loop as the accepting thread sees it.
pub(crate) struct Loop {
    poll: Mutex<Option<Poll>>,
    registry: Registry,
    waker: Waker,
    /// Connections accepted for this loop, not yet taken in.
    inbox: Mutex<Vec<(u64, std::net::TcpStream, SocketAddr)>>,
    /// `CLIENT KILL` marked one of this loop's connections: look for it at the next turn.
    kills: AtomicBool,
}

impl Loop {
    pub fn new(_index: usize) -> io::Result<Self> {
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let waker = Waker::new(poll.registry(), WAKE)?;
        Ok(Self {
            poll: Mutex::new(Some(poll)),
            registry,
            waker,
            inbox: Mutex::new(Vec::new()),
            kills: AtomicBool::new(false),
        })
    }

    /// Hands an admitted connection to this loop. Errors only before the loop owns it.
    pub fn adopt(&self, id: u64, stream: std::net::TcpStream, peer: SocketAddr) -> io::Result<()> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        self.inbox.lock().push((id, stream, peer));
        self.wake();
        Ok(())
    }

    /// A connection of this loop was marked killed: the loop drops it at its next turn.
    pub fn kill_requested(&self) {
        self.kills.store(true, Ordering::Release);
        self.wake();
    }

    /// Makes the loop look at its inbox and the shutdown flag now.
    pub fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::warn!("redis front end: cannot wake an event loop (it looks again within {IDLE_TICK:?}): {e}");
        }
    }

    /// Releases connections accepted but never taken in (at shutdown).
    pub fn release_inbox(&self, shared: &Serving) {
        for (id, stream, _) in self.inbox.lock().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
            release(shared, id, "shutdown");
        }
    }
}

/// What serving a connection for a turn came to.
enum Turn {
    /// Its socket would block: wait for its next event.
    Wait,
    /// It has more to do: serve it again after the others.
    Again,
    /// `CLIENT PAUSE` holds its next command: look again at the next tick (or wake-up).
    Paused,
    Close(&'static str),
}

struct Conn {
    id: u64,
    peer: SocketAddr,
    stream: TcpStream,
    client: Client,
    parser: Parser,
    out: Output,
    /// Since when `out` has waited for the socket to take any of it (as a connection
    /// thread's send timeout: a large reply making progress never times out).
    blocked_since: Option<Instant>,
    last_input: Instant,
    /// Input since the storage was last told the client is idle.
    fed: bool,
    /// The peer's end is closed (or failed): read until the socket says so, even after a
    /// short read, since that end comes with no edge of its own if it was already queued.
    peer_done: bool,
    /// Why the connection ends once `out` is written; then it lingers until `linger_until`.
    ending: Option<&'static str>,
    linger_until: Option<Instant>,
    discarded: usize,
}

/// The loop thread: serves the connections of `this`, loop `index`, until the server stops.
pub(crate) fn run(shared: &Serving, this: &Loop, index: usize) {
    let Some(mut poll) = this.poll.lock().take() else {
        tracing::error!("redis front end: event loop {index} started twice");
        return;
    };
    let mut events = Events::with_capacity(EVENTS_PER_POLL);
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut again: VecDeque<usize> = VecDeque::new();
    let mut paused: Vec<usize> = Vec::new();
    let mut chunk = vec![0u8; READ_CHUNK_BYTES];
    let mut last_sweep = Instant::now();
    // Whether the last turn served anything (then the loop spins before it sleeps).
    let mut served = false;
    while !shared.stopping.is_stopped() {
        let timeout = match (again.is_empty(), conns.is_empty()) {
            (false, _) => Duration::ZERO,
            (true, false) => TICK,
            (true, true) => IDLE_TICK,
        };
        // A paused connection is looked at again every tick (UNPAUSE also wakes the loop).
        let spin = if served { shared.options.poll_spin } else { Duration::ZERO };
        if let Err(e) = poll_events(&mut poll, &mut events, spin, timeout) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("redis front end: event loop {index} cannot poll, closing its clients: {e}");
            break;
        }
        let mut ready: Vec<usize> = std::mem::take(&mut again).into();
        ready.append(&mut paused);
        if this.kills.swap(false, Ordering::AcqRel) {
            let killed: Vec<usize> = conns.iter().filter(|(_, c)| c.client.killed()).map(|(&t, _)| t).collect();
            for token in killed {
                ready.retain(|&t| t != token);
                close(shared, this, conns.remove(&token).expect("a killed connection"), "killed");
            }
        }
        for event in &events {
            if event.token() == WAKE {
                take_in(shared, this, &mut conns, &mut ready);
            } else {
                if event.is_read_closed() || event.is_error() {
                    if let Some(conn) = conns.get_mut(&event.token().0) {
                        conn.peer_done = true;
                    }
                }
                ready.push(event.token().0);
            }
        }
        if ready.is_empty() {
            // A missed wake-up costs at most one (idle) tick.
            take_in(shared, this, &mut conns, &mut ready);
        }
        ready.sort_unstable();
        ready.dedup();
        served = !ready.is_empty();
        for token in ready {
            let Some(conn) = conns.get_mut(&token) else { continue };
            match serve(shared, conn, &mut chunk) {
                Turn::Wait => {}
                Turn::Again => again.push_back(token),
                Turn::Paused => paused.push(token),
                Turn::Close(reason) => close(shared, this, conns.remove(&token).expect("a served connection"), reason),
            }
        }
        if last_sweep.elapsed() >= TICK {
            last_sweep = Instant::now();
            let expired: Vec<(usize, &'static str)> =
                conns.iter().filter_map(|(&t, c)| expired(shared, c, last_sweep).map(|r| (t, r))).collect();
            for (token, reason) in expired {
                again.retain(|&t| t != token);
                close(shared, this, conns.remove(&token).expect("a swept connection"), reason);
            }
        }
    }
    for (_, conn) in conns.drain() {
        close(shared, this, conn, "shutdown");
    }
    this.release_inbox(shared);
}

/// Polls for events: without sleeping for up to `spin` (a loop that was just busy), then
/// sleeping for up to `timeout`.
fn poll_events(poll: &mut Poll, events: &mut Events, spin: Duration, timeout: Duration) -> io::Result<()> {
    if !spin.is_zero() && !timeout.is_zero() {
        let until = Instant::now() + spin;
        loop {
            poll.poll(events, Some(Duration::ZERO))?;
            if !events.is_empty() || Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        if !events.is_empty() {
            return Ok(());
        }
    }
    if !timeout.is_zero() {
        METRICS.event_loop_sleeps.inc();
    }
    poll.poll(events, Some(timeout))
}

fn take_in(shared: &Serving, this: &Loop, conns: &mut HashMap<usize, Conn>, ready: &mut Vec<usize>) {
    let adopted: Vec<_> = this.inbox.lock().drain(..).collect();
    for (id, stream, peer) in adopted {
        let mut stream = TcpStream::from_std(stream);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
        let client = new_client(shared, id, Some(peer), stream.local_addr().ok(), i64::from(fd));
        let token = Token(id as usize);
        if let Err(e) = this.registry.register(&mut stream, token, Interest::READABLE | Interest::WRITABLE) {
            tracing::warn!("redis front end: cannot poll client {id} ({peer}): {e}");
            release(shared, id, "io_error");
            continue;
        }
        let now = Instant::now();
        conns.insert(
            token.0,
            Conn {
                id,
                peer,
                stream,
                client,
                parser: new_parser(shared),
                out: Output::with_capacity(READ_CHUNK_BYTES),
                blocked_since: None,
                last_input: now,
                fed: false,
                peer_done: false,
                ending: None,
                linger_until: None,
                discarded: 0,
            },
        );
        // Input may have arrived before the registration: look now.
        ready.push(token.0);
    }
}

fn close(shared: &Serving, this: &Loop, mut conn: Conn, reason: &'static str) {
    let _ = this.registry.deregister(&mut conn.stream);
    tracing::debug!("redis client {} ({}) closed: {reason}", conn.id, conn.peer);
    release(shared, conn.id, reason);
}

/// The reason to close `conn` for a timeout, if one passed.
fn expired(shared: &Serving, conn: &Conn, now: Instant) -> Option<&'static str> {
    if let Some(until) = conn.linger_until {
        return (now >= until).then_some(conn.ending.unwrap_or("shutdown"));
    }
    if conn.blocked_since.is_some_and(|since| now.duration_since(since) >= shared.options.write_timeout) {
        return Some("io_error");
    }
    let idle = shared.stats.idle_timeout().filter(|t| !t.is_zero())?;
    (conn.out.is_empty() && now.duration_since(conn.last_input) >= idle).then_some("idle_timeout")
}

/// Writes what `conn` has pending. Ok(true): all of it.
fn flush(shared: &Serving, conn: &mut Conn) -> io::Result<bool> {
    while !conn.out.is_empty() {
        match conn.out.write_to(&mut conn.stream) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                conn.blocked_since = None;
                METRICS.sent_bytes.inc_by(n as u64);
                shared.stats.add_io(0, n as u64);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                conn.blocked_since.get_or_insert_with(Instant::now);
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
    }
    conn.blocked_since = None;
    Ok(true)
}

/// Serves `conn` for one turn: writes pending replies, executes buffered commands, reads.
fn serve(shared: &Serving, conn: &mut Conn, chunk: &mut [u8]) -> Turn {
    let mut reads = 0;
    // A read shorter than asked emptied the socket (epoll(7): for stream sockets that is as
    // good as EAGAIN), and new input makes a new edge: no read just to hear EAGAIN. Not so
    // for the peer's FIN when it came with the data: its event said so (`peer_done`).
    let mut drained = false;
    loop {
        // Execute what is buffered, then write the replies before reading more.
        let step = match conn.ending {
            Some(_) => Step::NeedInput,
            None => run_commands(shared, &mut conn.client, &mut conn.parser, &mut conn.out),
        };
        if let Step::End(reason) = step {
            conn.ending = Some(reason);
        }
        let held = matches!(step, Step::Paused(_));
        match flush(shared, conn) {
            Ok(true) => {}
            Ok(false) => return Turn::Wait, // the socket's writable event resumes us
            Err(_) => return Turn::Close("io_error"),
        }
        if conn.ending.is_some() {
            return linger(conn, chunk);
        }
        if held {
            // Read nothing more until the pause lets the held command run.
            return Turn::Paused;
        }
        if let Step::Flush = step {
            continue; // more commands may be buffered
        }
        if conn.fed && !conn.parser.has_partial_command() {
            conn.fed = false;
            conn.client.idle();
        }
        if drained && !conn.peer_done {
            return Turn::Wait;
        }
        if reads == MAX_READS_PER_TURN {
            return Turn::Again;
        }
        match conn.stream.read(chunk) {
            Ok(0) if conn.parser.has_partial_command() => return Turn::Close("peer_closed_mid_command"),
            Ok(0) => return Turn::Close("peer_closed"),
            Ok(n) => {
                reads += 1;
                METRICS.received_bytes.inc_by(n as u64);
                shared.stats.add_io(n as u64, 0);
                feed(shared, &mut conn.parser, &chunk[..n]);
                conn.last_input = Instant::now();
                conn.fed = true;
                drained = n < chunk.len();
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Turn::Wait,
            Err(_) => return Turn::Close("io_error"),
        }
    }
}

/// After the last reply: half-close, then discard input until the peer closes, for at most
/// [`LINGER`] and [`LINGER_MAX_BYTES`] (a close with unread input would send a reset that can
/// destroy the reply before the client reads it).
fn linger(conn: &mut Conn, chunk: &mut [u8]) -> Turn {
    let reason = conn.ending.expect("lingering after an ending");
    if conn.linger_until.is_none() {
        let _ = conn.stream.shutdown(Shutdown::Write);
        conn.linger_until = Some(Instant::now() + LINGER);
    }
    loop {
        if conn.discarded >= LINGER_MAX_BYTES {
            return Turn::Close(reason);
        }
        match conn.stream.read(chunk) {
            Ok(0) => return Turn::Close(reason),
            Ok(n) => conn.discarded += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Turn::Wait, // the sweep ends it
            Err(_) => return Turn::Close(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event that comes during the spin, or after it while the loop sleeps, is delivered;
    /// a spin with nothing to find ends in a sleep, not in a loop that never blocks.
    #[test]
    fn polling_delivers_events_that_come_during_or_after_the_spin() {
        for (spin, wake_after) in [
            (Duration::from_millis(200), Duration::from_millis(5)),
            (Duration::ZERO, Duration::from_millis(5)),
            (Duration::from_micros(20), Duration::from_millis(300)),
        ] {
            let mut poll = Poll::new().unwrap();
            let waker = std::sync::Arc::new(Waker::new(poll.registry(), WAKE).unwrap());
            let mut events = Events::with_capacity(8);
            let sleeps = METRICS.event_loop_sleeps.get();
            let waking = {
                let waker = std::sync::Arc::clone(&waker);
                std::thread::spawn(move || {
                    std::thread::sleep(wake_after);
                    waker.wake().unwrap();
                })
            };
            poll_events(&mut poll, &mut events, spin, Duration::from_secs(10)).unwrap();
            assert!(events.iter().any(|e| e.token() == WAKE), "spin {spin:?}, wake after {wake_after:?}: no event");
            if spin < wake_after {
                assert!(METRICS.event_loop_sleeps.get() > sleeps, "spin {spin:?} never slept");
            }
            waking.join().unwrap();
        }
    }
}
