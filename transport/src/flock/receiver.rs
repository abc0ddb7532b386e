//! The receiver: one loop per lane, in the region server.
//!
//! It takes the lane's next message (the carrier polls its ring or reads its stream), checks
//! it whole (both canaries, lengths, count, sizes; see [`super::message::decode`]), checks
//! that the sender stayed within the credits it was granted, dispatches each request to the
//! [`RpcService`] in order, and coalesces the responses the same way: one message (more only
//! when the responses outgrow the message limit), with the ring head acknowledged and, when
//! the request asked for it, the scheduler's grant. Anything wrong with a message closes
//! this lane only.

use std::io;
use std::time::Instant;

use super::message::{self, canary, Builder, Entry, Header, FLAG_GRANT, FLAG_RENEW, KIND_REQUEST, KIND_RESPONSE};
use super::metrics::METRICS;
use super::scheduler::{LaneId, Scheduler, SenderStats};
use super::service::{record_rpc, RpcService};

/// What one attempt to receive produced.
pub(crate) enum Received {
    Message,
    /// A credit renewal on the carrier's credit channel (verbs), with the sender's statistics.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    Renewal(SenderStats),
    /// Nothing within the carrier's poll interval.
    Idle,
    /// The peer closed the lane.
    Closed,
}

/// The receiver's end of a lane.
pub(crate) trait ServerCarrier {
    /// Fills `buf` with exactly the next message, whose canary must be `expect`.
    fn recv(&mut self, buf: &mut Vec<u8>, expect: u32) -> io::Result<Received>;
    /// Writes one whole message to the sender.
    fn send(&mut self, message: &[u8]) -> io::Result<()>;
    /// Bytes of the request ring consumed so far (0 for stream carriers).
    fn head(&self) -> u64 {
        0
    }
    /// The sender's response-ring head, as a request acknowledged it (verbs).
    fn acked(&mut self, _head: u64) {}
    /// Answers a [`Received::Renewal`] on the credit channel (carriers that have one).
    fn grant(&mut self, _credits: u32) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "this carrier grants credits in response headers"))
    }
    /// Largest message either way.
    fn max_message(&self) -> usize {
        message::MAX_MESSAGE_BYTES
    }
}

/// A lane as the region server set it up.
pub(crate) struct LaneContext<'a> {
    pub rpc: &'a dyn RpcService,
    /// Who the lane's connection authenticated as.
    pub caller: &'a crate::auth::Caller,
    pub scheduler: &'a Scheduler,
    pub lane: LaneId,
    pub key: u32,
    pub initial_credits: u32,
    pub stopping: &'a crate::stop::StopSignal,
}

/// Serves the lane until it closes. Returns the metric reason when it ends badly.
pub(crate) fn serve_lane(carrier: &mut dyn ServerCarrier, cx: &LaneContext<'_>) -> Result<(), &'static str> {
    let mut allowed = u64::from(cx.initial_credits);
    let mut used = 0u64;
    let (mut rx, mut tx) = (0u64, 0u64);
    let mut buf = Vec::with_capacity(4096);
    let mut builder = Builder::default();
    let max = carrier.max_message();
    loop {
        if cx.stopping.is_stopped() {
            return Ok(());
        }
        let expect = canary(cx.key, rx);
        match carrier.recv(&mut buf, expect) {
            Ok(Received::Message) => {}
            Ok(Received::Renewal(stats)) => {
                // Out of band: answered at once, not behind queued requests.
                assert!(used <= allowed, "lane used {used} of {allowed} credits and went on");
                let g = cx.scheduler.renew(cx.lane, stats, allowed - used);
                assert!(g <= cx.scheduler.options().credits, "granted {g} credits at once");
                allowed += u64::from(g);
                debug_assert_eq!(cx.scheduler.lane_account(cx.lane).map(|a| a.0), Some(allowed), "grants out of step");
                carrier.grant(g).map_err(|_| "io")?;
                continue;
            }
            Ok(Received::Idle) => continue,
            Ok(Received::Closed) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => return fail("malformed", &e.to_string()),
            Err(_) => return Err("io"),
        }
        rx += 1;
        let m = match message::decode(&buf, Some(expect), max) {
            Ok(m) if m.header.kind == KIND_REQUEST => m,
            Ok(m) => return fail("malformed", &format!("a sender may not send kind {}", m.header.kind)),
            Err(e) => return fail("malformed", &e.to_string()),
        };
        carrier.acked(m.header.ack);
        let count = m.count() as u64;
        used += count;
        if used > allowed {
            return fail("credits", &format!("sent {used} requests on {allowed} credits"));
        }
        METRICS.messages.with_label_values(&["received"]).inc();
        METRICS.requests.with_label_values(&["received"]).inc_by(count);

        let started = Instant::now();
        builder.clear();
        let mut first = true;
        let mut grant = None;
        if m.header.flags & FLAG_RENEW != 0 {
            let stats = SenderStats {
                degree: f64::from(m.header.degree_x16) / 16.0,
                rate: f64::from(m.header.rate_krps) * 1000.0,
            };
            let g = cx.scheduler.renew(cx.lane, stats, allowed - used);
            assert!(g <= cx.scheduler.options().credits, "granted {g} credits at once");
            allowed += u64::from(g);
            grant = Some(g);
        }
        for (entry, data) in m.entries() {
            let method_started = Instant::now();
            let name = cx.rpc.method_name(entry.rpc);
            let result = cx.rpc.call_as(cx.caller, entry.rpc, data);
            let ok = result.is_ok();
            record_rpc(name, ok, method_started.elapsed());
            let fits = |len: usize| len <= crate::wire::MAX_RPC_BYTES && message::message_len(1, len) <= max;
            let (status, payload) = match &result {
                Ok(response) if fits(response.len()) => (0, &response[..]),
                Ok(_) => (crate::RpcStatus::FAILED, &b"response exceeds the rpc size limit of this lane"[..]),
                Err(status) => (status.code.max(1), status.message.as_bytes()),
            };
            if builder.count() > 0 && builder.len_with(payload.len()) > max {
                // The responses outgrew one message: send what we have, go on in the next.
                let header = response_header(cx.key, tx, carrier.head(), first.then_some(grant).flatten());
                carrier.send(builder.finish(header)).map_err(|_| "io")?;
                tx += 1;
                first = false;
                builder.clear();
            }
            builder.push(
                Entry { size: payload.len() as u32, thread: entry.thread, rpc: entry.rpc, seq: entry.seq, status },
                payload,
            );
        }
        cx.scheduler.answered(cx.lane, count, started.elapsed());
        // Paired with the scheduler's books: what this lane was granted (initial credits and
        // every grant) and what it answered are what the scheduler recorded. Debug only: it
        // takes the scheduler's lock once more per message.
        debug_assert_eq!(cx.scheduler.lane_account(cx.lane), Some((allowed, used)), "credits out of step");
        let header = response_header(cx.key, tx, carrier.head(), first.then_some(grant).flatten());
        carrier.send(builder.finish(header)).map_err(|_| "io")?;
        tx += 1;
    }
}

fn response_header(key: u32, number: u64, ack: u64, grant: Option<u32>) -> Header {
    Header {
        canary: canary(key, number),
        kind: KIND_RESPONSE,
        flags: if grant.is_some() { FLAG_GRANT } else { 0 },
        credits: grant.unwrap_or(0),
        ack,
        ..Header::default()
    }
}

fn fail(reason: &'static str, detail: &str) -> Result<(), &'static str> {
    tracing::debug!("flock lane closed ({reason}): {detail}");
    METRICS.lane_errors.with_label_values(&[reason]).inc();
    Err(reason)
}
