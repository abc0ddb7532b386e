//! The shm carrier: a pair of rings in shared memory, with futex doorbells.
//!
//! On FlockOpen over the region server's Unix socket, the server creates a memfd:
//!
//! ```text
//! page 0: request ring head u64 @0 | tail u64 @8 | doorbell u32 @64 | reader asleep u32 @68
//!         response ring head u64 @128 | tail u64 @136 | doorbell u32 @192 | reader asleep u32 @196
//!         closed u32 @256 (either side sets it when it leaves)
//! then:   request ring (client writes, server reads) | response ring (server writes, client reads)
//! ```
//!
//! and passes it with FlockAccept (SCM_RIGHTS). A message is copied into the peer's ring and
//! published by storing its first word last, with release order ([`super::ring`]); the
//! writer knows what it may overwrite from the head word the reader keeps in page 0. A
//! reader with nothing to read spins briefly, then announces that it sleeps and waits on the
//! doorbell futex (a shared, not private, futex: the word lives in the memfd); a writer bumps
//! the doorbell after publishing and issues a wake only if the reader announced sleep. So a
//! busy lane makes no system call at all, and an idle one costs one wake-up per message. The
//! Unix socket carries nothing more; both sides watch it to notice the other going away.
//! The rings are sized for two maximal messages; memfd pages are allocated on first touch
//! and the writer starts over at offset 0 whenever the ring is empty, so an idle lane keeps
//! only a few pages resident.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use super::message::{self, MAX_MESSAGE_BYTES};
use super::receiver::{Received, ServerCarrier};
use super::ring::{ring_bytes_for, RingReader, RingWriter, Span};
use super::ClientCarrier;
use crate::net::hung_up;

const CONTROL_BYTES: usize = 4096;
/// Where one direction's words sit in the control page: the reader's head (its tail word,
/// bytes written so far, at `head + TAIL`), the doorbell, and the reader's sleeping flag.
#[derive(Clone, Copy)]
struct Direction {
    head: usize,
    bell: usize,
    asleep: usize,
}
const REQUESTS: Direction = Direction { head: 0, bell: 64, asleep: 68 };
const RESPONSES: Direction = Direction { head: 128, bell: 192, asleep: 196 };
/// Tail words (bytes written so far): only for the ring-occupancy metric.
const TAIL: usize = 8;
const CLOSED: usize = 256;
/// Polls of an empty ring before sleeping on the doorbell.
const SPIN_POLLS: u32 = 200;
/// Longest doorbell sleep (then the caller checks liveness, deadlines and shutdown).
const SLEEP: Duration = Duration::from_millis(5);
/// Longest doorbell sleep of a server lane that has been idle a while: a doorbell still
/// wakes it at once, so this bounds only how late it notices a crashed client or shutdown
/// (idle lanes woke 200 times a second each at [`SLEEP`]).
const IDLE_SLEEP: Duration = Duration::from_millis(50);

/// A server lane's doorbell sleep after `idle` empty sleeps in a row: doubling from
/// [`SLEEP`] up to [`IDLE_SLEEP`].
fn server_sleep(idle: u32) -> Duration {
    SLEEP.saturating_mul(1 << idle.min(8)).min(IDLE_SLEEP)
}
/// How long a writer waits for ring room before giving up on the lane.
const ROOM_WAIT: Duration = Duration::from_secs(10);

fn ring_bytes() -> usize {
    ring_bytes_for(MAX_MESSAGE_BYTES)
}

/// A shared futex wait on `word` while it holds `value`, at most `timeout`.
fn futex_wait(word: &AtomicU32, value: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as i64 };
    // SAFETY: `word` is a valid, aligned u32 in mapped shared memory; FUTEX_WAIT only reads
    // it. A spurious or interrupted return is harmless (callers loop).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            value,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above; FUTEX_WAKE does not touch the word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// The shared mapping and the spans inside it.
struct Shared {
    _map: MmapRaw,
    control: Span,
    requests: Span,
    responses: Span,
}

impl Shared {
    fn map(file: &File, ring: usize) -> io::Result<Self> {
        let total = CONTROL_BYTES + 2 * ring;
        if file.metadata()?.len() != total as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "flock rings of an unexpected size"));
        }
        let map = MmapOptions::new().len(total).map_raw(file)?;
        let base = map.as_mut_ptr();
        // SAFETY: the mapping is page-aligned, `total` long and kept alive in `_map`.
        let (control, requests, responses) = unsafe {
            (
                Span::new(base, CONTROL_BYTES),
                Span::new(base.add(CONTROL_BYTES), ring),
                Span::new(base.add(CONTROL_BYTES + ring), ring),
            )
        };
        Ok(Self { _map: map, control, requests, responses })
    }

    fn closed(&self) -> bool {
        self.control.word32(CLOSED).load(Ordering::Acquire) != 0
    }

    fn close(&self) {
        self.control.word32(CLOSED).store(1, Ordering::Release);
        for bell in [REQUESTS.bell, RESPONSES.bell] {
            self.control.word32(bell).fetch_add(1, Ordering::SeqCst);
            futex_wake(self.control.word32(bell));
        }
    }
}

/// Publishes `message` into `ring`, waiting for room (the reader's head is in `control`).
fn write(shared: &Shared, writer: &mut RingWriter, ring: &Span, dir: &Direction, message: &[u8]) -> io::Result<()> {
    let Direction { head, bell, asleep } = *dir;
    let started = std::time::Instant::now();
    let placement = loop {
        let h = shared.control.word(head).load(Ordering::Acquire);
        if let Some(p) = writer.place(message.len(), h) {
            break p;
        }
        if shared.closed() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the lane"));
        }
        if started.elapsed() > ROOM_WAIT {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stopped reading its ring"));
        }
        std::thread::yield_now();
    };
    if let Some((at, canary)) = placement.wrap_at {
        let marker = message::wrap_marker(canary);
        ring.copy_in_after_first(at, &marker);
        ring.word(at).store(u64::from_le_bytes(marker[..8].try_into().expect("8 bytes")), Ordering::Release);
    }
    ring.copy_in_after_first(placement.offset, message);
    ring.word(placement.offset).store(u64::from_le_bytes(message[..8].try_into().expect("8 bytes")), Ordering::Release);
    shared.control.word(head + TAIL).store(writer.tail(), Ordering::Relaxed);
    // Doorbell: bump, then wake only a reader that said it sleeps (SeqCst pairs with its
    // announcement; see `wait`).
    shared.control.word32(bell).fetch_add(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if shared.control.word32(asleep).load(Ordering::SeqCst) != 0 {
        futex_wake(shared.control.word32(bell));
    }
    Ok(())
}

/// Polls `reader` for a message, spinning then sleeping on the doorbell for up to `sleep`.
fn read(
    shared: &Shared,
    reader: &mut RingReader,
    dir: &Direction,
    buf: &mut Vec<u8>,
    expect: u32,
    sleep: Duration,
) -> io::Result<bool> {
    let Direction { head, bell, asleep } = *dir;
    for _ in 0..SPIN_POLLS {
        if reader.poll(buf, expect, MAX_MESSAGE_BYTES)? {
            shared.control.word(head).store(reader.head(), Ordering::Release);
            return Ok(true);
        }
        std::hint::spin_loop();
    }
    if shared.closed() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the lane"));
    }
    let flag = shared.control.word32(asleep);
    flag.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    let seen = shared.control.word32(bell).load(Ordering::SeqCst);
    if !reader.has_data() {
        futex_wait(shared.control.word32(bell), seen, sleep);
    }
    flag.store(0, Ordering::SeqCst);
    let got = reader.poll(buf, expect, MAX_MESSAGE_BYTES)?;
    if got {
        shared.control.word(head).store(reader.head(), Ordering::Release);
    }
    Ok(got)
}

/// The receiver's end, in the region server.
pub(crate) struct ServerRings {
    shared: Shared,
    reader: RingReader,
    writer: RingWriter,
    socket: Option<OwnedFd>,
    key: u32,
    /// Empty doorbell sleeps in a row (see [`server_sleep`]).
    idle: u32,
}

impl ServerRings {
    /// Creates the memfd and maps it; the key is set by [`Self::keyed`].
    pub fn create() -> io::Result<(File, Self)> {
        let ring = ring_bytes();
        let file = crate::region::shared_memory_file("racekv-flock", (CONTROL_BYTES + 2 * ring) as u64, false)?;
        let shared = Shared::map(&file, ring)?;
        let reader = RingReader::new(shared.requests, 0, Duration::from_secs(1));
        Ok((file, Self { reader, writer: RingWriter::new(ring, 0), shared, socket: None, key: 0, idle: 0 }))
    }

    pub fn ring_bytes(&self) -> u64 {
        self.shared.requests.len() as u64
    }

    /// Sets the lane's canary key (both rings' wrap markers derive from it).
    pub fn keyed(&mut self, key: u32, stall: Duration) {
        self.key = key;
        self.reader = RingReader::new(self.shared.requests, key, stall);
        self.writer = RingWriter::new(self.shared.responses.len(), key);
    }

    /// Watches `socket` (the lane's Unix connection) to notice the client leaving.
    pub fn watch(&mut self, socket: BorrowedFd<'_>) {
        self.socket = socket.try_clone_to_owned().ok();
    }
}

impl Drop for ServerRings {
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl ServerCarrier for ServerRings {
    fn recv(&mut self, buf: &mut Vec<u8>, expect: u32) -> io::Result<Received> {
        let tail = self.shared.control.word(REQUESTS.head + TAIL).load(Ordering::Relaxed);
        let sleep = server_sleep(self.idle);
        match read(&self.shared, &mut self.reader, &REQUESTS, buf, expect, sleep) {
            Ok(true) => {
                self.idle = 0;
                let unread = tail.saturating_sub(self.reader.head() - buf.len() as u64);
                super::metrics::METRICS.ring_occupancy.observe(unread as f64);
                Ok(Received::Message)
            }
            Ok(false) => {
                self.idle = self.idle.saturating_add(1);
                if self.socket.as_ref().is_some_and(|s| hung_up(s.as_fd())) {
                    return Ok(Received::Closed);
                }
                Ok(Received::Idle)
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(Received::Closed),
            Err(e) => Err(e),
        }
    }

    fn send(&mut self, message: &[u8]) -> io::Result<()> {
        let shared = &self.shared;
        write(shared, &mut self.writer, &shared.responses, &RESPONSES, message)
    }

    fn head(&self) -> u64 {
        self.reader.head()
    }

    fn max_message(&self) -> usize {
        self.writer.max_message().min(MAX_MESSAGE_BYTES)
    }
}

/// The sender's end.
pub(crate) struct ShmLane {
    shared: Shared,
    writer: Mutex<RingWriter>,
    reader: Mutex<RingReader>,
    socket: UnixStream,
}

impl ShmLane {
    pub fn new(file: File, socket: UnixStream, ring: u64, key: u32, stall: Duration) -> io::Result<Self> {
        let ring = usize::try_from(ring).ok().filter(|&r| r == ring_bytes()).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("flock rings of {ring} bytes, expected {}", ring_bytes()),
            )
        })?;
        let shared = Shared::map(&file, ring)?;
        Ok(Self {
            writer: Mutex::new(RingWriter::new(ring, key)),
            reader: Mutex::new(RingReader::new(shared.responses, key, stall)),
            shared,
            socket,
        })
    }
}

impl ClientCarrier for ShmLane {
    fn send(&self, message: &[u8]) -> io::Result<()> {
        let shared = &self.shared;
        write(shared, &mut self.writer.lock(), &shared.requests, &REQUESTS, message)
    }

    fn recv(&self, buf: &mut Vec<u8>, expect: u32) -> io::Result<bool> {
        let mut reader = self.reader.lock();
        let got = read(&self.shared, &mut reader, &RESPONSES, buf, expect, SLEEP)?;
        if !got && hung_up(self.socket.as_fd()) {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the region server closed the lane"));
        }
        Ok(got)
    }

    fn max_message(&self) -> usize {
        self.writer.lock().max_message().min(MAX_MESSAGE_BYTES)
    }

    fn shutdown(&self) {
        self.shared.close();
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for ShmLane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens lane `lane` of sender `sender` over the region server's Unix socket at `path`.
pub(crate) fn open_shm_lane(
    path: &std::path::Path,
    options: &crate::ConnectOptions,
    sender: u64,
    lane: u16,
) -> Result<super::sender::LaneSetup, crate::TransportError> {
    let (stream, rings, accept) = dial_shm_lane(path, options, sender, lane)?;
    lane_setup(stream, rings, &accept, options.timeout, &format!("shm:{}", path.display()))
}

/// The sender's end of a lane from its socket, its rings and the server's acceptance.
pub(crate) fn lane_setup(
    stream: UnixStream,
    rings: File,
    accept: &crate::wire::FlockAccept,
    timeout: Duration,
    peer: &str,
) -> Result<super::sender::LaneSetup, crate::TransportError> {
    let carrier = ShmLane::new(rings, stream, accept.ring_bytes, accept.key, timeout).map_err(|e| {
        crate::TransportError::Connect { endpoint: peer.to_string(), reason: format!("mapping the rpc rings: {e}") }
    })?;
    Ok(super::sender::LaneSetup {
        carrier: Box::new(carrier),
        key: accept.key,
        credits: accept.credits,
        batch: accept.batch,
    })
}

/// Authenticates on the region server's socket at `path` and opens lane `lane` of sender
/// `sender`: the lane's socket, its rings and what the server granted.
pub(crate) fn dial_shm_lane(
    path: &std::path::Path,
    options: &crate::ConnectOptions,
    sender: u64,
    lane: u16,
) -> Result<(UnixStream, File, crate::wire::FlockAccept), crate::TransportError> {
    use std::io::Write;

    use crate::net::{dial_unix, read_frame_with_fd};
    use crate::wire::{self, Kind};
    use crate::TransportError;
    let peer = format!("shm:{}", path.display());
    let fail = |reason: String| TransportError::Connect { endpoint: peer.clone(), reason };
    let mut stream = dial_unix(path, options.timeout, &fail)?;
    crate::auth::connect(&mut stream, &options.token, options.user.as_deref(), options.timeout, &peer)?;
    let mut out = Vec::new();
    wire::encode_flock_open(&mut out, &wire::FlockOpen { sender, lane, verbs: None });
    stream.write_all(&out).map_err(|e| fail(e.to_string()))?;
    // Two replies: HelloOk (with the region's descriptor, which we drop), then FlockAccept
    // with the rings' descriptor.
    let mut rings = None;
    let mut accept = None;
    for _ in 0..2 {
        let mut body = Vec::new();
        let (h, fd) = read_frame_with_fd(&mut stream, &mut body, options.timeout, "while opening an rpc lane", &fail)?;
        match h.kind {
            Kind::HelloOk => {}
            Kind::FlockAccept => {
                accept = Some(wire::decode_flock_accept(&body).map_err(|e| TransportError::Protocol(e.to_string()))?);
                rings = fd;
                break;
            }
            Kind::Error => return Err(crate::mux::error_frame(&body, &peer)),
            other => return Err(TransportError::Protocol(format!("{peer} answered FlockOpen with {other:?}"))),
        }
    }
    let (Some(accept), Some(rings)) = (accept, rings) else {
        return Err(fail("the server passed no rings for the rpc lane".into()));
    };
    Ok((stream, File::from(rings), accept))
}

#[cfg(test)]
mod tests {
    use super::{server_sleep, IDLE_SLEEP, SLEEP};

    #[test]
    fn an_idle_server_lane_sleeps_longer_up_to_the_cap() {
        assert_eq!(server_sleep(0), SLEEP);
        assert_eq!(server_sleep(1), SLEEP * 2);
        let schedule: Vec<_> = (0..64).map(server_sleep).collect();
        assert!(schedule.windows(2).all(|w| w[0] <= w[1]), "{schedule:?}");
        assert_eq!(*schedule.last().unwrap(), IDLE_SLEEP);
        assert_eq!(server_sleep(u32::MAX), IDLE_SLEEP);
    }
}
