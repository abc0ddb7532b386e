//! The sender: a connection handle that many threads share, over one or more lanes.
//!
//! A call takes a credit on the lane its thread is mapped to ([`super::mapping`]), queues in
//! that lane's MCS queue ([`super::combine`]) and either leads (collects everyone queued
//! behind it into one message, sends it with one write, hands leadership on) or is taken by
//! a leader. Then it waits for its response. There is no receiving thread: a waiting caller
//! takes the lane's reader role, reads response messages and delivers every response in
//! them to its caller (waking it), until its own arrives; then it hands the role to one other
//! waiter. A lone thread thus sends and reads its own messages with no wake-up in between.
//!
//! Credits: each lane holds what the receiver granted. After using half of a grant the next
//! message carries a renewal request; the grant (or refusal) comes back on a response. (A
//! carrier with a credit channel, verbs, sends the renewal beside that message and delivers
//! the grant to whoever reads the lane.) A
//! refused lane is inactive: the mapping moves its threads to the active lanes, and callers
//! that find no credit anywhere ask again with back-off until their timeout, then fail with
//! [`RpcStatus::OVERLOADED`]: the request was never sent, so it cannot have executed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::combine::{Joined, Leader, Node, Queue};
use super::mapping::Mapping;
use super::message::{self, canary, Builder, Entry, Header, ENTRY_BYTES, FLAG_GRANT, FLAG_RENEW, KIND_REQUEST};
use super::metrics::METRICS;
use super::{ClientCarrier, FlockOptions};
use crate::error::{RpcStatus, TransportError};

/// Longest a waiter sleeps before looking at the reader role again on its own (a backstop:
/// hand-offs wake it at once).
const WAIT_SLICE: Duration = Duration::from_millis(2);
/// How long a caller without credits reads or sleeps before looking again.
const CREDIT_SLICE: Duration = Duration::from_millis(1);
const MAX_BACKOFF: Duration = Duration::from_millis(50);
/// Most messages one leader sends before handing leadership on.
const LEAD_ROUNDS: usize = 8;

/// What one lane's setup produced.
pub(crate) struct LaneSetup {
    pub carrier: Box<dyn ClientCarrier>,
    /// Canary key the receiver chose for this lane.
    pub key: u32,
    /// Initial credits (0: the lane starts inactive).
    pub credits: u32,
    /// Credits per grant (C), for renewing after half.
    pub batch: u32,
}

enum Outcome {
    Response(u16, Vec<u8>),
    Failed(String),
}

struct Waiter {
    done: AtomicBool,
    /// Its request is out and its caller waits in `await_response` (where it takes the
    /// reader role when woken), so a hand-off to it is never lost.
    ready: AtomicBool,
    result: Mutex<Option<Outcome>>,
    seq: AtomicU32,
    slot: u16,
    thread: Thread,
}

impl Waiter {
    fn finish(&self, outcome: Outcome) {
        *self.result.lock() = Some(outcome);
        self.done.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A request as the leader sees it.
struct Item {
    method: u16,
    payload: *const [u8],
    waiter: Arc<Waiter>,
}

// SAFETY: `payload` points into the caller's request, which outlives the queue's hold on the
// node (the caller is blocked in `Queue::join` until the leader is done with it).
unsafe impl Send for Item {}

impl Item {
    fn payload(&self) -> &[u8] {
        // SAFETY: see the Send impl.
        unsafe { &*self.payload }
    }
}

struct SendSide {
    builder: Builder,
    /// Messages sent on this lane (canary numbers).
    number: u64,
    seq: u32,
    degree_x16: u32,
    window_started: Instant,
    window_requests: u64,
}

struct ReadSide {
    buf: Vec<u8>,
    number: u64,
}

struct Refusal {
    next_try: Instant,
    backoff: Duration,
}

struct Lane {
    index: usize,
    key: u32,
    batch: u32,
    carrier: Box<dyn ClientCarrier>,
    queue: Queue<Item>,
    send: Mutex<SendSide>,
    reader: Mutex<ReadSide>,
    pending: Mutex<HashMap<u32, Arc<Waiter>>>,
    /// Sequence numbers issued so far (for bounds-checking the ones that come back).
    issued: AtomicU32,
    credits: AtomicI64,
    used: AtomicU32,
    renew_wanted: AtomicBool,
    renewing: AtomicBool,
    active: AtomicBool,
    refusal: Mutex<Refusal>,
    credit_changed: Condvar,
    broken: AtomicBool,
    reason: Mutex<String>,
}

/// One sender (connection handle) to one receiver.
pub(crate) struct Sender {
    lanes: Vec<Lane>,
    mapping: Arc<Mapping>,
    options: FlockOptions,
    timeout: Duration,
    peer: String,
}

impl Sender {
    pub fn new(id: u64, setups: Vec<LaneSetup>, options: FlockOptions, timeout: Duration, peer: String) -> Self {
        assert!(!setups.is_empty() && setups.len() <= 64);
        let now = Instant::now();
        let lanes: Vec<Lane> = setups
            .into_iter()
            .enumerate()
            .map(|(index, s)| Lane {
                index,
                key: s.key,
                batch: s.batch.max(2),
                carrier: s.carrier,
                queue: Queue::default(),
                send: Mutex::new(SendSide {
                    builder: Builder::default(),
                    number: 0,
                    seq: 0,
                    degree_x16: 16,
                    window_started: now,
                    window_requests: 0,
                }),
                reader: Mutex::new(ReadSide { buf: Vec::with_capacity(4096), number: 0 }),
                pending: Mutex::new(HashMap::new()),
                issued: AtomicU32::new(0),
                credits: AtomicI64::new(i64::from(s.credits)),
                used: AtomicU32::new(0),
                renew_wanted: AtomicBool::new(false),
                renewing: AtomicBool::new(false),
                active: AtomicBool::new(s.credits > 0),
                refusal: Mutex::new(Refusal { next_try: now, backoff: Duration::from_millis(1) }),
                credit_changed: Condvar::new(),
                broken: AtomicBool::new(false),
                reason: Mutex::new(String::new()),
            })
            .collect();
        let mapping = Mapping::new(id, lanes.len());
        let sender = Self { lanes, mapping, options, timeout, peer };
        sender.mapping.set_active(sender.active_mask());
        sender
    }

    fn active_mask(&self) -> u64 {
        let usable = |l: &&Lane| !l.broken.load(Ordering::Acquire);
        let active: u64 = self
            .lanes
            .iter()
            .filter(usable)
            .filter(|l| l.active.load(Ordering::Acquire))
            .fold(0, |m, l| m | (1 << l.index));
        if active != 0 {
            return active;
        }
        // No lane is active: keep threads on every usable lane (they wait for credits there).
        self.lanes.iter().filter(usable).fold(0, |m, l| m | (1 << l.index))
    }

    /// True once every lane has failed; the owner should replace the sender.
    pub fn is_broken(&self) -> bool {
        self.lanes.iter().all(|l| l.broken.load(Ordering::Acquire))
    }

    /// Lanes currently active (granted credits).
    pub fn active_lanes(&self) -> usize {
        self.lanes.iter().filter(|l| l.active.load(Ordering::Acquire) && !l.broken.load(Ordering::Acquire)).count()
    }

    /// One RPC.
    pub fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        let limit = self.lanes[0].carrier.max_message();
        if message::message_len(1, request.len()) > limit {
            return Err(TransportError::InvalidBatch(format!(
                "rpc request of {} B does not fit this transport's rpc messages of {limit} B",
                request.len()
            )));
        }
        let started = Instant::now();
        let deadline = started + self.timeout;
        let (slot, mapped) = self.mapping.on_call(request.len());
        let lane = self.acquire(mapped, method, deadline)?;
        let waiter = Arc::new(Waiter {
            done: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            result: Mutex::new(None),
            seq: AtomicU32::new(0),
            slot,
            thread: std::thread::current(),
        });
        let node = Node::new(Item { method, payload: request as *const [u8], waiter: Arc::clone(&waiter) });
        if let Joined::Leader(leader) = lane.queue.join(&node, |item| item.waiter.done.load(Ordering::Acquire)) {
            self.lead(lane, leader);
        }
        let outcome = self.await_response(lane, &waiter, deadline);
        METRICS.call_seconds.observe(started.elapsed().as_secs_f64());
        match outcome? {
            Outcome::Response(0, data) => Ok(data),
            Outcome::Response(code, data) => {
                Err(TransportError::Rpc { method, status: RpcStatus::new(code, String::from_utf8_lossy(&data)) })
            }
            Outcome::Failed(reason) => Err(TransportError::ConnectionLost { reason, maybe_executed: true }),
        }
    }

    /// Picks a usable lane, preferring `mapped`, then any active one.
    fn choose(&self, mapped: usize) -> Result<&Lane, TransportError> {
        let usable = |l: &Lane| !l.broken.load(Ordering::Acquire);
        let mapped = &self.lanes[mapped.min(self.lanes.len() - 1)];
        if usable(mapped) && mapped.active.load(Ordering::Acquire) {
            return Ok(mapped);
        }
        if let Some(l) = self.lanes.iter().find(|l| usable(l) && l.active.load(Ordering::Acquire)) {
            return Ok(l);
        }
        if usable(mapped) {
            return Ok(mapped);
        }
        self.lanes.iter().find(|l| usable(l)).ok_or_else(|| TransportError::ConnectionLost {
            reason: format!("{}: every flock lane failed: {}", self.peer, self.lanes[0].reason.lock()),
            maybe_executed: false,
        })
    }

    /// Takes a credit, waiting (and asking for more) as long as the deadline allows.
    fn acquire(&self, mapped: usize, method: u16, deadline: Instant) -> Result<&Lane, TransportError> {
        self.probe_refused();
        loop {
            let lane = self.choose(mapped)?;
            if self.take_credit(lane) {
                return Ok(lane);
            }
            let now = Instant::now();
            if now >= deadline {
                METRICS.overloaded.inc();
                return Err(TransportError::Rpc {
                    method,
                    status: RpcStatus::new(
                        RpcStatus::OVERLOADED,
                        format!(
                            "{} granted no credits within {} ms (overloaded); the request was not sent",
                            self.peer,
                            self.timeout.as_millis()
                        ),
                    ),
                });
            }
            if !lane.renewing.load(Ordering::Acquire) && now >= lane.refusal.lock().next_try {
                self.send_renewal(lane);
            }
            // The grant comes back on a response: read if nobody else is reading.
            if let Some(reader) = lane.reader.try_lock() {
                self.read(lane, reader, None, (now + CREDIT_SLICE).min(deadline));
                continue;
            }
            let mut refusal = lane.refusal.lock();
            if lane.credits.load(Ordering::Acquire) <= 0 && !lane.broken.load(Ordering::Acquire) {
                lane.credit_changed.wait_for(&mut refusal, CREDIT_SLICE);
            }
        }
    }

    /// Asks again for one lane the receiver refused, once its back-off has passed, and reads
    /// the answer. Senders renew only lanes they use and the mapping keeps threads off
    /// refused lanes, so without this a lane refused once (at a moment of overload, or while
    /// other senders held the active slots) would stay refused for the sender's lifetime.
    /// Only while another lane is active: with none, every caller asks in `acquire`.
    fn probe_refused(&self) {
        if self.active_lanes() == 0 {
            return;
        }
        let idle = |l: &&Lane| !l.active.load(Ordering::Acquire) && !l.broken.load(Ordering::Acquire);
        let Some(lane) = self.lanes.iter().find(idle) else { return };
        let now = Instant::now();
        {
            let mut refusal = lane.refusal.lock();
            if now < refusal.next_try {
                return;
            }
            // One probe per back-off period; a refusal doubles it, a grant resets it.
            refusal.next_try = now + refusal.backoff;
        }
        let Some(reader) = lane.reader.try_lock() else { return };
        if !lane.renewing.load(Ordering::Acquire) {
            METRICS.probes.inc();
            self.send_renewal(lane);
        }
        // Nobody else reads a lane no thread is mapped to: collect the answer here.
        self.read(lane, reader, None, now + CREDIT_SLICE);
    }

    fn take_credit(&self, lane: &Lane) -> bool {
        let mut have = lane.credits.load(Ordering::Acquire);
        while have > 0 {
            match lane.credits.compare_exchange_weak(have, have - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    debug_assert!(have > 0, "took a credit from a lane holding {have}");
                    if lane.used.fetch_add(1, Ordering::Relaxed) + 1 >= lane.batch / 2 {
                        lane.renew_wanted.store(true, Ordering::Release);
                    }
                    return true;
                }
                Err(now) => have = now,
            }
        }
        false
    }

    /// Renewal statistics for the header: (degree x16, rate in thousands per second).
    fn stats(send: &mut SendSide) -> (u16, u16) {
        let elapsed = send.window_started.elapsed().as_secs_f64().max(1e-6);
        let krps = send.window_requests as f64 / elapsed / 1000.0;
        send.window_started = Instant::now();
        send.window_requests = 0;
        (send.degree_x16.min(u32::from(u16::MAX)) as u16, krps.ceil().min(f64::from(u16::MAX)) as u16)
    }

    /// Sends a message with no requests that asks for credits (or, on a carrier with a
    /// credit channel, just the renewal).
    fn send_renewal(&self, lane: &Lane) {
        if lane.renewing.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut send = lane.send.lock();
        let send = &mut *send;
        send.builder.clear();
        let (degree_x16, rate_krps) = Self::stats(send);
        if lane.carrier.credit_channel() {
            if let Err(e) = lane.carrier.renew(degree_x16, rate_krps) {
                self.break_lane(lane, format!("sending a credit renewal failed: {e}"), "io");
            }
            return;
        }
        let header = Header {
            canary: canary(lane.key, send.number),
            kind: KIND_REQUEST,
            flags: FLAG_RENEW,
            degree_x16,
            rate_krps,
            ..Header::default()
        };
        let result = lane.carrier.send(send.builder.finish(header));
        send.number += 1;
        if let Err(e) = result {
            self.break_lane(lane, format!("sending a credit renewal failed: {e}"), "io");
        }
    }

    /// As leader: coalesce, send one message; while more requests queued up behind it, send
    /// them too (up to [`LEAD_ROUNDS`] messages); then hand leadership on.
    fn lead(&self, lane: &Lane, mut leader: Leader<'_, Item>) {
        for round in 0.. {
            if let Err(e) = self.send_batch(lane, &mut leader) {
                self.break_lane(lane, format!("sending failed: {e}"), "io");
                leader.finish(true);
                return;
            }
            if round + 1 >= LEAD_ROUNDS || !leader.advance() {
                break;
            }
        }
        leader.finish(false);
    }

    /// Collects behind the first taken node and sends the batch as one message.
    fn send_batch(&self, lane: &Lane, leader: &mut Leader<'_, Item>) -> std::io::Result<()> {
        let max_bytes = lane.carrier.max_message();
        let first = leader.items().next().map_or(0, |i| i.payload().len());
        let mut bytes = message::message_len(1, first);
        let mut count = 1;
        let max_count = self.options.max_coalesce.clamp(1, message::MAX_ENTRIES);
        leader.collect(|item| {
            let more = bytes + ENTRY_BYTES + item.payload().len() + 8;
            if count < max_count && more <= max_bytes {
                count += 1;
                bytes = more;
                true
            } else {
                false
            }
        });
        let mut send = lane.send.lock();
        let send = &mut *send;
        send.builder.clear();
        {
            let mut pending = lane.pending.lock();
            for item in leader.items() {
                let seq = send.seq;
                send.seq = send.seq.wrapping_add(1);
                item.waiter.seq.store(seq, Ordering::Relaxed);
                pending.insert(seq, Arc::clone(&item.waiter));
                let payload = item.payload();
                send.builder.push(
                    Entry { size: payload.len() as u32, thread: item.waiter.slot, rpc: item.method, seq, status: 0 },
                    payload,
                );
            }
            lane.issued.store(send.seq, Ordering::Release);
        }
        let n = leader.len() as u32;
        send.degree_x16 = send.degree_x16 - send.degree_x16 / 8 + n * 2;
        send.window_requests += u64::from(n);
        let mut header = Header {
            canary: canary(lane.key, send.number),
            kind: KIND_REQUEST,
            ack: lane.carrier.head(),
            ..Header::default()
        };
        let mut renew_beside = None;
        if lane.renew_wanted.load(Ordering::Acquire)
            && lane.renewing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            lane.renew_wanted.store(false, Ordering::Release);
            lane.used.store(0, Ordering::Relaxed);
            let stats = Self::stats(send);
            if lane.carrier.credit_channel() {
                renew_beside = Some(stats);
            } else {
                (header.degree_x16, header.rate_krps) = stats;
                header.flags = FLAG_RENEW;
            }
        }
        let mut result = lane.carrier.send(send.builder.finish(header));
        send.number += 1;
        if let (Ok(()), Some((degree_x16, rate_krps))) = (&result, renew_beside) {
            result = lane.carrier.renew(degree_x16, rate_krps);
        }
        METRICS.degree.observe(f64::from(n));
        METRICS.messages.with_label_values(&["sent"]).inc();
        METRICS.requests.with_label_values(&["sent"]).inc_by(u64::from(n));
        result
    }

    fn await_response(&self, lane: &Lane, waiter: &Arc<Waiter>, deadline: Instant) -> Result<Outcome, TransportError> {
        waiter.ready.store(true, Ordering::Release);
        loop {
            if waiter.done.load(Ordering::Acquire) {
                return Ok(waiter.result.lock().take().expect("a finished waiter has its outcome"));
            }
            let now = Instant::now();
            if now >= deadline {
                let seq = waiter.seq.load(Ordering::Relaxed);
                if lane.pending.lock().remove(&seq).is_some() {
                    return Err(TransportError::Timeout { waited_ms: self.timeout.as_millis() as u64 });
                }
                continue; // delivered meanwhile
            }
            if let Some(reader) = lane.reader.try_lock() {
                self.read(lane, reader, Some(waiter), deadline);
                continue;
            }
            std::thread::park_timeout((deadline - now).min(WAIT_SLICE));
        }
    }

    /// Holds the reader role: reads and delivers messages until `own` is answered (or, for
    /// a caller waiting for credits, until one message arrived or `until`), then passes the
    /// role to one waiter.
    fn read(&self, lane: &Lane, mut reader: MutexGuard<'_, ReadSide>, own: Option<&Waiter>, until: Instant) {
        loop {
            if own.is_some_and(|w| w.done.load(Ordering::Acquire))
                || Instant::now() >= until
                || lane.broken.load(Ordering::Acquire)
            {
                break;
            }
            let r = &mut *reader;
            let received = lane.carrier.recv(&mut r.buf, canary(lane.key, r.number));
            if let Some(credits) = lane.carrier.take_grant() {
                self.on_grant(lane, credits);
            }
            match received {
                Ok(false) => {
                    if own.is_none() {
                        break;
                    }
                }
                Ok(true) => {
                    r.number += 1;
                    if let Err(reason) = self.deliver(lane, &r.buf, r.number - 1) {
                        self.break_lane(lane, reason, "malformed");
                        break;
                    }
                    if own.is_none() {
                        break;
                    }
                }
                Err(e) => {
                    let kind = if e.kind() == std::io::ErrorKind::InvalidData { "malformed" } else { "io" };
                    self.break_lane(lane, format!("receiving failed: {e}"), kind);
                    break;
                }
            }
        }
        drop(reader);
        // Hand the role on: wake one waiter that is ready to take it (one still queued
        // behind a leader could not), or else any.
        let next = {
            let pending = lane.pending.lock();
            let ready = pending.values().find(|w| w.ready.load(Ordering::Acquire));
            ready.or_else(|| pending.values().next()).map(|w| w.thread.clone())
        };
        if let Some(thread) = next {
            thread.unpark();
        }
    }

    fn deliver(&self, lane: &Lane, bytes: &[u8], number: u64) -> Result<(), String> {
        let m = message::decode(bytes, Some(canary(lane.key, number)), lane.carrier.max_message())
            .map_err(|e| e.to_string())?;
        if m.header.kind != message::KIND_RESPONSE {
            return Err(format!("expected a response, got kind {}", m.header.kind));
        }
        lane.carrier.acked(m.header.ack);
        let mut woken = Vec::with_capacity(m.count());
        {
            let issued = lane.issued.load(Ordering::Acquire);
            let mut pending = lane.pending.lock();
            for (entry, data) in m.entries() {
                match pending.remove(&entry.seq) {
                    Some(w) if w.slot == entry.thread => woken.push((w, entry.status, data)),
                    Some(w) => {
                        let seq = entry.seq;
                        pending.insert(seq, w);
                        return Err(format!("response {seq} names thread {}, not its caller's", entry.thread));
                    }
                    // Not pending: its caller timed out (a late answer), unless never issued.
                    None if issued.wrapping_sub(entry.seq).wrapping_sub(1) >= 1 << 31 => {
                        return Err(format!("response to request {} that was never sent", entry.seq));
                    }
                    None => {}
                }
            }
        }
        for (waiter, status, data) in woken {
            waiter.finish(Outcome::Response(status, data.to_vec()));
        }
        if m.header.flags & FLAG_GRANT != 0 {
            self.on_grant(lane, m.header.credits);
        }
        Ok(())
    }

    fn on_grant(&self, lane: &Lane, credits: u32) {
        {
            let mut refusal = lane.refusal.lock();
            if credits > 0 {
                let before = lane.credits.fetch_add(i64::from(credits), Ordering::AcqRel);
                // Only `take_credit` consumes, and only a credit that is there.
                assert!(before >= 0, "lane {} held {before} credits", lane.index);
                lane.active.store(true, Ordering::Release);
                refusal.backoff = Duration::from_millis(1);
            } else {
                lane.active.store(false, Ordering::Release);
                refusal.next_try = Instant::now() + refusal.backoff;
                refusal.backoff = (refusal.backoff * 2).min(MAX_BACKOFF);
            }
            lane.renewing.store(false, Ordering::Release);
        }
        lane.credit_changed.notify_all();
        self.mapping.set_active(self.active_mask());
    }

    /// Breaks every lane: each call waiting for its answer or for credits fails now with
    /// `reason` (it may have executed), and the sender is broken (its channel opens another
    /// for the next call). For a peer declared down ([`crate::Connection::abort`]).
    pub fn abort(&self, reason: &str) {
        for lane in &self.lanes {
            self.break_lane(lane, reason.to_string(), "aborted");
        }
    }

    /// Tests: breaks lane `index` underneath the sender ([`ClientCarrier::inject_fault`]).
    pub fn inject_fault(&self, index: usize) {
        if let Some(lane) = self.lanes.get(index) {
            lane.carrier.inject_fault();
        }
    }

    fn break_lane(&self, lane: &Lane, reason: String, kind: &'static str) {
        {
            let mut slot = lane.reason.lock();
            if slot.is_empty() {
                *slot = format!("{} lane {}: {reason}", self.peer, lane.index);
                tracing::debug!("{}", *slot);
                METRICS.lane_errors.with_label_values(&[kind]).inc();
            }
        }
        lane.broken.store(true, Ordering::Release);
        lane.carrier.shutdown();
        let reason = lane.reason.lock().clone();
        let waiters: Vec<_> = lane.pending.lock().drain().map(|(_, w)| w).collect();
        for w in waiters {
            w.finish(Outcome::Failed(reason.clone()));
        }
        {
            let _refusal = lane.refusal.lock();
            lane.credit_changed.notify_all();
        }
        self.mapping.set_active(self.active_mask());
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        for lane in &self.lanes {
            lane.carrier.shutdown();
        }
    }
}
