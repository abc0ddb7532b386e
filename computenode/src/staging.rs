//! The computenode's half of requests and replies in parts (the protocol is in
//! [`racekv_client::op`]'s module documentation): uploads being assembled from PART
//! requests, and replies too large for one message waiting for FETCH_PART. The attach and
//! remote front ends share one [`Staging`], so its byte budget bounds them together.
//!
//! Everything a peer sends is untrusted: a claimed total is checked against
//! [`MAX_REQUEST_BYTES`] and the per-owner budget but never allocated; buffers grow as
//! bytes arrive, each part's bytes reserved against the owner's and the global budget
//! first. Parts come in order, within their total. A transfer idle longer than
//! [`StagingOptions::idle_timeout`] is dropped by a sweeper thread, so a client that dies
//! mid-transfer leaks nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use racekv_client::op::{ErrorKind, Reply, Request, MAX_REQUEST_BYTES};

struct Metrics {
    staged_bytes: IntGauge,
    parts: IntCounterVec,
    dropped: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        staged_bytes: metric::gauge(
            "racekv_staging_bytes",
            "Bytes of uploads being assembled and of staged replies held",
        ),
        parts: metric::counter_vec(
            "racekv_staging_parts_total",
            "Parts of requests received (upload) and of staged replies sent (fetch)",
            &["direction"],
            &[&["upload", "fetch"]],
        ),
        dropped: metric::counter(
            "racekv_staging_stale_transfers_dropped_total",
            "Uploads and staged replies dropped because their client stopped touching them",
        ),
    }
});

/// Limits of a [`Staging`].
#[derive(Debug, Clone)]
pub struct StagingOptions {
    /// Bytes held by all uploads and staged replies together.
    pub budget_bytes: u64,
    /// Bytes held by one owner (an attached connection, a remote user). At least one
    /// maximal request ([`MAX_REQUEST_BYTES`]) for the largest items to get through.
    pub per_owner_bytes: u64,
    /// Uploads and staged replies of one owner at once.
    pub per_owner_transfers: usize,
    /// A transfer untouched this long is dropped.
    pub idle_timeout: Duration,
}

impl Default for StagingOptions {
    fn default() -> Self {
        Self {
            budget_bytes: 2 << 30,
            per_owner_bytes: 2 << 30,
            per_owner_transfers: 16,
            idle_timeout: Duration::from_secs(30),
        }
    }
}

/// Who a transfer belongs to: only its owner reaches it.
pub type Owner = str;

/// A refused part or fetch: the error reply's kind and message.
pub type Refusal = (ErrorKind, String);

struct Transfer {
    /// Uploads: the bytes received. Replies: the whole reply.
    bytes: Vec<u8>,
    /// Uploads: the claimed total. Replies: `bytes.len()`.
    total: u64,
    /// Replies: bytes fetched so far.
    fetched: u64,
}

struct Entry {
    transfer: Arc<Mutex<Transfer>>,
    /// Milliseconds since the staging's epoch, when a part last touched it.
    touched_ms: Arc<AtomicU64>,
    /// Bytes reserved for it against the budgets.
    charged: u64,
}

#[derive(Default)]
struct State {
    /// Keyed by owner and the client's id.
    uploads: HashMap<(String, u64), Entry>,
    /// Keyed by owner and the id the computenode gave.
    replies: HashMap<(String, u64), Entry>,
    /// Per owner: bytes charged, transfers held.
    owners: HashMap<String, (u64, usize)>,
    bytes: u64,
}

impl State {
    fn map(&mut self, upload: bool) -> &mut HashMap<(String, u64), Entry> {
        if upload {
            &mut self.uploads
        } else {
            &mut self.replies
        }
    }

    /// Removes an entry (when it is still `transfer`) and gives back what it held.
    fn remove(&mut self, upload: bool, key: &(String, u64), transfer: Option<&Arc<Mutex<Transfer>>>) -> bool {
        let map = self.map(upload);
        if transfer.is_some_and(|t| map.get(key).is_none_or(|e| !Arc::ptr_eq(&e.transfer, t))) {
            return false;
        }
        let Some(entry) = map.remove(key) else { return false };
        self.release(&key.0, entry.charged, 1);
        true
    }

    fn release(&mut self, owner: &str, bytes: u64, transfers: usize) {
        self.bytes -= bytes;
        METRICS.staged_bytes.sub(bytes as i64);
        if let Some(usage) = self.owners.get_mut(owner) {
            usage.0 -= bytes;
            usage.1 -= transfers;
            if *usage == (0, 0) {
                self.owners.remove(owner);
            }
        }
    }

    /// Reserves `bytes` (and `transfers` new transfers) for `owner`, or says which budget
    /// they would exceed.
    fn charge(&mut self, options: &StagingOptions, owner: &str, bytes: u64, transfers: usize) -> Result<(), Refusal> {
        let usage = self.owners.get(owner).copied().unwrap_or((0, 0));
        if usage.1 + transfers > options.per_owner_transfers {
            return Err(overloaded(format!(
                "{} transfers in parts are in progress for this client, the most allowed",
                usage.1
            )));
        }
        if usage.0 + bytes > options.per_owner_bytes {
            return Err(overloaded(format!(
                "{bytes} more bytes in parts would exceed this client's staging budget of {} bytes ({} held)",
                options.per_owner_bytes, usage.0
            )));
        }
        if self.bytes + bytes > options.budget_bytes {
            return Err(overloaded(format!(
                "{bytes} more bytes in parts would exceed the computenode's staging budget of {} bytes",
                options.budget_bytes
            )));
        }
        let usage = self.owners.entry(owner.to_string()).or_default();
        usage.0 += bytes;
        usage.1 += transfers;
        self.bytes += bytes;
        METRICS.staged_bytes.add(bytes as i64);
        Ok(())
    }
}

fn overloaded(message: String) -> Refusal {
    (ErrorKind::Overloaded, message)
}

fn bad(message: String) -> Refusal {
    (ErrorKind::BadRequest, message)
}

/// Uploads and staged replies of a computenode's front ends.
pub struct Staging {
    options: StagingOptions,
    epoch: Instant,
    state: Mutex<State>,
    next_reply_id: AtomicU64,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging").field("options", &self.options).field("bytes", &self.bytes()).finish()
    }
}

/// How a PART request went.
#[derive(Debug)]
pub enum PartOutcome {
    /// More parts are due; this many bytes arrived so far.
    Received(u64),
    /// The last part: the assembled request (not itself a part or a fetch).
    Complete(Request),
}

impl Staging {
    /// A staging with its sweeper thread (which ends once the staging is dropped).
    pub fn start(options: StagingOptions) -> Arc<Self> {
        LazyLock::force(&METRICS);
        let staging = Arc::new(Self {
            options,
            epoch: Instant::now(),
            state: Mutex::new(State::default()),
            next_reply_id: AtomicU64::new(1),
        });
        let weak: Weak<Self> = Arc::downgrade(&staging);
        let every = (staging.options.idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("staging-sweep".into()).spawn(move || loop {
            std::thread::sleep(every);
            match weak.upgrade() {
                Some(staging) => staging.sweep(),
                None => return,
            }
        });
        if let Err(e) = spawned {
            tracing::error!(
                "starting the staging sweeper failed ({e}); idle transfers are dropped only by their owners"
            );
        }
        staging
    }

    /// Its limits.
    pub fn options(&self) -> &StagingOptions {
        &self.options
    }

    /// Bytes held now.
    pub fn bytes(&self) -> u64 {
        self.state.lock().bytes
    }

    /// Uploads and staged replies held now.
    pub fn transfers(&self) -> usize {
        let state = self.state.lock();
        state.uploads.len() + state.replies.len()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Takes one PART request of `owner`.
    pub fn part(&self, owner: &Owner, id: u64, total: u64, offset: u64, bytes: &[u8]) -> Result<PartOutcome, Refusal> {
        METRICS.parts.with_label_values(&["upload"]).inc();
        let key = (owner.to_string(), id);
        let len = bytes.len() as u64;
        if total > MAX_REQUEST_BYTES as u64 {
            return Err(bad(format!(
                "an upload of {total} bytes exceeds the largest request, {MAX_REQUEST_BYTES} bytes"
            )));
        }
        if bytes.is_empty() {
            return Err(bad(format!("an empty part of upload {id}")));
        }
        let (transfer, touched) = {
            let mut state = self.state.lock();
            match state.uploads.get(&key) {
                Some(entry) if offset != 0 => (Arc::clone(&entry.transfer), Arc::clone(&entry.touched_ms)),
                Some(_) => {
                    state.remove(true, &key, None);
                    return Err(bad(format!("upload {id} was started again while in progress; both are dropped")));
                }
                None if offset != 0 => {
                    return Err(bad(format!(
                        "a part at offset {offset} of upload {id}, which is unknown (uploads start at 0; an idle \
                         one is dropped after {:?})",
                        self.options.idle_timeout
                    )));
                }
                None => {
                    if total > self.options.per_owner_bytes {
                        return Err(overloaded(format!(
                            "an upload of {total} bytes exceeds this client's staging budget of {} bytes",
                            self.options.per_owner_bytes
                        )));
                    }
                    state.charge(&self.options, owner, 0, 1)?;
                    let transfer = Arc::new(Mutex::new(Transfer { bytes: Vec::new(), total, fetched: 0 }));
                    let touched = Arc::new(AtomicU64::new(self.now_ms()));
                    let entry = Entry { transfer: Arc::clone(&transfer), touched_ms: Arc::clone(&touched), charged: 0 };
                    state.uploads.insert(key.clone(), entry);
                    (transfer, touched)
                }
            }
        };
        // The transfer's own lock serializes its parts; copying happens outside the global lock.
        let mut upload = transfer.lock();
        let received = upload.bytes.len() as u64;
        let refused = if upload.total != total {
            Some(format!("a part of upload {id} claims a total of {total} bytes, its first said {}", upload.total))
        } else if offset != received {
            Some(format!("a part of upload {id} at offset {offset}, expected {received} (parts come in order)"))
        } else if offset + len > total {
            Some(format!("a part of upload {id} ends at {} bytes, past its total of {total}", offset + len))
        } else {
            None
        };
        if let Some(message) = refused {
            self.state.lock().remove(true, &key, Some(&transfer));
            return Err(bad(format!("{message}; the upload is dropped")));
        }
        {
            let mut state = self.state.lock();
            if !state.uploads.get(&key).is_some_and(|e| Arc::ptr_eq(&e.transfer, &transfer)) {
                return Err(bad(format!("upload {id} was dropped (idle longer than {:?})", self.options.idle_timeout)));
            }
            if let Err(refusal) = state.charge(&self.options, owner, len, 0) {
                state.remove(true, &key, Some(&transfer));
                return Err(refusal);
            }
            state.uploads.get_mut(&key).expect("checked above").charged += len;
        }
        upload.bytes.extend_from_slice(bytes);
        touched.store(self.now_ms(), Ordering::Relaxed);
        if offset + len < total {
            return Ok(PartOutcome::Received(offset + len));
        }
        let assembled = std::mem::take(&mut upload.bytes);
        drop(upload);
        self.state.lock().remove(true, &key, Some(&transfer));
        match Request::decode(&assembled) {
            Ok(Request::Part { .. } | Request::FetchPart { .. }) => {
                Err(bad(format!("upload {id} holds a transfer request, not an operation")))
            }
            Ok(request) => Ok(PartOutcome::Complete(request)),
            Err(e) => Err(bad(format!("upload {id}: {e}"))),
        }
    }

    /// Keeps `reply` (an encoded reply too large for one message) for `owner`; the answer
    /// to send instead is [`Reply::Staged`].
    pub fn stage_reply(&self, owner: &Owner, reply: Vec<u8>) -> Result<Reply, Refusal> {
        let total = reply.len() as u64;
        let mut state = self.state.lock();
        state
            .charge(&self.options, owner, total, 1)
            .map_err(|(kind, message)| (kind, format!("a reply of {total} bytes cannot be staged: {message}")))?;
        let id = self.next_reply_id.fetch_add(1, Ordering::Relaxed);
        let transfer = Arc::new(Mutex::new(Transfer { bytes: reply, total, fetched: 0 }));
        let touched_ms = Arc::new(AtomicU64::new(self.now_ms()));
        state.replies.insert((owner.to_string(), id), Entry { transfer, touched_ms, charged: total });
        Ok(Reply::Staged { id, total })
    }

    /// Answers a FETCH_PART of `owner`: up to `max_len` bytes (and at most
    /// `max_message_bytes` with the reply's framing) of staged reply `id` from `offset` on,
    /// which must be where the last fetch ended. The fetch that reaches the end frees it.
    pub fn fetch(
        &self,
        owner: &Owner,
        id: u64,
        offset: u64,
        max_len: u32,
        max_message_bytes: usize,
    ) -> Result<Reply, Refusal> {
        METRICS.parts.with_label_values(&["fetch"]).inc();
        let key = (owner.to_string(), id);
        let max_len =
            (max_len as usize).min(max_message_bytes.saturating_sub(racekv_client::op::PART_REPLY_OVERHEAD_BYTES));
        if max_len == 0 {
            return Err(bad(format!("a fetch of staged reply {id} asks for no bytes")));
        }
        let (transfer, touched) = match self.state.lock().replies.get(&key) {
            Some(entry) => (Arc::clone(&entry.transfer), Arc::clone(&entry.touched_ms)),
            None => {
                return Err(bad(format!(
                    "no staged reply {id} for this client (fetched already, or idle longer than {:?})",
                    self.options.idle_timeout
                )))
            }
        };
        let mut reply = transfer.lock();
        if offset != reply.fetched {
            let fetched = reply.fetched;
            drop(reply);
            self.state.lock().remove(false, &key, Some(&transfer));
            return Err(bad(format!(
                "a fetch of staged reply {id} at offset {offset}, expected {fetched} (fetches come in order); the \
                 reply is dropped"
            )));
        }
        let start = offset as usize;
        let end = (start + max_len).min(reply.bytes.len());
        let part = reply.bytes[start..end].to_vec();
        reply.fetched = end as u64;
        touched.store(self.now_ms(), Ordering::Relaxed);
        if reply.fetched == reply.total {
            drop(reply);
            self.state.lock().remove(false, &key, Some(&transfer));
        }
        Ok(Reply::Part(part))
    }

    /// Drops every transfer of `owner` (its connection closed).
    pub fn forget(&self, owner: &Owner) {
        let mut state = self.state.lock();
        for upload in [true, false] {
            let keys: Vec<(String, u64)> = state.map(upload).keys().filter(|k| k.0 == owner).cloned().collect();
            for key in keys {
                state.remove(upload, &key, None);
            }
        }
    }

    /// Drops the transfers idle longer than the timeout.
    pub fn sweep(&self) {
        let now = self.now_ms();
        let timeout = self.options.idle_timeout.as_millis() as u64;
        let mut state = self.state.lock();
        for upload in [true, false] {
            let stale: Vec<(String, u64)> = state
                .map(upload)
                .iter()
                .filter(|(_, e)| now.saturating_sub(e.touched_ms.load(Ordering::Relaxed)) > timeout)
                .map(|(k, _)| k.clone())
                .collect();
            for key in stale {
                if state.remove(upload, &key, None) {
                    METRICS.dropped.inc();
                    tracing::debug!(owner = %key.0, id = key.1, upload, "dropped an idle transfer in parts");
                }
            }
        }
    }
}

/// Answers a PART or FETCH_PART request of `owner`, or passes any other request on: the
/// front ends' common step before checking and running a request. `Err` is the reply to
/// send at once (an acknowledgement, a fetched part, or a refusal).
pub fn assemble(
    staging: &Staging,
    owner: &Owner,
    request: Request,
    max_message_bytes: usize,
) -> Result<Request, Reply> {
    let refused = |(kind, message): Refusal| Reply::Error(kind, message);
    match request {
        Request::Part { id, total, offset, bytes } => match staging.part(owner, id, total, offset, &bytes) {
            Ok(PartOutcome::Received(n)) => Err(Reply::Count(n)),
            Ok(PartOutcome::Complete(request)) => Ok(request),
            Err(refusal) => Err(refused(refusal)),
        },
        Request::FetchPart { id, offset, max_len } => {
            Err(staging.fetch(owner, id, offset, max_len, max_message_bytes).unwrap_or_else(refused))
        }
        other => Ok(other),
    }
}

/// The bytes to send for an encoded reply: as they are when they fit `max_message_bytes`,
/// else staged for `owner` (and the STAGED reply, or a refusal, sent instead).
pub fn fit_reply(staging: &Staging, owner: &Owner, encoded: Vec<u8>, max_message_bytes: usize) -> Vec<u8> {
    if encoded.len() <= max_message_bytes {
        return encoded;
    }
    let reply = staging.stage_reply(owner, encoded).unwrap_or_else(|(kind, message)| Reply::Error(kind, message));
    let mut out = Vec::new();
    reply.encode(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use racekv_hashing::PutMode;

    fn small() -> StagingOptions {
        StagingOptions {
            budget_bytes: 1 << 20,
            per_owner_bytes: 600 << 10,
            per_owner_transfers: 4,
            idle_timeout: Duration::from_secs(60),
        }
    }

    fn encoded(request: &Request) -> Vec<u8> {
        let mut out = Vec::new();
        request.encode(&mut out);
        out
    }

    /// Sends `bytes` as parts of `per` bytes; the outcome of the last.
    fn upload(s: &Staging, owner: &str, id: u64, bytes: &[u8], per: usize) -> Result<PartOutcome, Refusal> {
        let mut last = None;
        for r in racekv_client::op::part_ranges(bytes.len(), per) {
            last = Some(s.part(owner, id, bytes.len() as u64, r.start as u64, &bytes[r])?);
        }
        Ok(last.expect("at least one part"))
    }

    proptest! {
        #[test]
        fn any_request_in_parts_is_assembled_exactly(key in proptest::collection::vec(any::<u8>(), 1..300),
                                                     value in proptest::collection::vec(any::<u8>(), 0..3000),
                                                     per in 1usize..700, id in any::<u64>()) {
            let s = Staging::start(small());
            let request = Request::Put { key, value, mode: PutMode::Upsert };
            match upload(&s, "o", id, &encoded(&request), per).unwrap() {
                PartOutcome::Complete(got) => prop_assert_eq!(got, request),
                other => prop_assert!(false, "{other:?}"),
            }
            prop_assert_eq!((s.bytes(), s.transfers()), (0, 0));
        }
    }

    #[test]
    fn hostile_parts_are_refused_and_free_what_they_held() {
        let s = Staging::start(small());
        let bytes = encoded(&Request::Put { key: b"k".to_vec(), value: vec![1; 1000], mode: PutMode::Upsert });
        let total = bytes.len() as u64;
        // Out of order: the upload is dropped.
        s.part("a", 1, total, 0, &bytes[..100]).unwrap();
        let (kind, message) = s.part("a", 1, total, 200, &bytes[200..300]).unwrap_err();
        assert_eq!(kind, ErrorKind::BadRequest);
        assert!(message.contains("expected 100"), "{message}");
        assert_eq!((s.bytes(), s.transfers()), (0, 0));
        // Over the largest request; past its total; an unknown upload; an unknown fetch.
        assert!(s.part("a", 2, MAX_REQUEST_BYTES as u64 + 1, 0, b"x").unwrap_err().1.contains("largest request"));
        s.part("a", 3, 10, 0, &[0; 8]).unwrap();
        assert!(s.part("a", 3, 10, 8, &[0; 8]).unwrap_err().1.contains("past its total"));
        assert!(s.part("a", 4, total, 100, &bytes[100..200]).unwrap_err().1.contains("unknown"));
        assert!(s.fetch("a", 99, 0, 100, 1 << 20).unwrap_err().1.contains("no staged reply"));
        assert_eq!((s.bytes(), s.transfers()), (0, 0));
        // The same id from two owners: two uploads.
        s.part("a", 5, total, 0, &bytes[..500]).unwrap();
        s.part("b", 5, total, 0, &bytes[..700]).unwrap();
        assert!(matches!(s.part("a", 5, total, 500, &bytes[500..]).unwrap(), PartOutcome::Complete(_)));
        assert!(matches!(s.part("b", 5, total, 700, &bytes[700..]).unwrap(), PartOutcome::Complete(_)));
        // A request in parts that is itself a part.
        let nested = encoded(&Request::Part { id: 1, total: 1, offset: 0, bytes: vec![0] });
        assert!(upload(&s, "a", 6, &nested, 10).unwrap_err().1.contains("transfer request"));
        assert_eq!((s.bytes(), s.transfers()), (0, 0));
    }

    #[test]
    fn budgets_bound_each_owner_and_the_whole() {
        let s = Staging::start(small());
        // Per owner: a claimed total over its budget is refused before anything arrives.
        assert_eq!(s.part("a", 1, 700 << 10, 0, b"x").unwrap_err().0, ErrorKind::Overloaded);
        // Staged replies count too, and are fetched in order, the last fetch freeing them.
        let Reply::Staged { id, total } = s.stage_reply("a", vec![7; 500 << 10]).unwrap() else { panic!() };
        assert_eq!(total, 500 << 10);
        assert_eq!(s.stage_reply("a", vec![0; 200 << 10]).unwrap_err().0, ErrorKind::Overloaded, "per owner");
        let Reply::Staged { .. } = s.stage_reply("b", vec![0; 500 << 10]).unwrap() else { panic!() };
        assert_eq!(s.stage_reply("c", vec![0; 100 << 10]).unwrap_err().0, ErrorKind::Overloaded, "in all");
        assert!(s.fetch("b", id, 0, 10, 1 << 20).is_err(), "another owner's reply");
        let mut got = Vec::new();
        while (got.len() as u64) < total {
            let Reply::Part(part) = s.fetch("a", id, got.len() as u64, u32::MAX, 64 << 10).unwrap() else { panic!() };
            assert!(part.len() <= (64 << 10) - 8);
            got.extend(part);
        }
        assert_eq!(got, vec![7; 500 << 10]);
        assert_eq!(s.bytes(), 500 << 10, "only b's reply is left");
        s.forget("b");
        assert_eq!((s.bytes(), s.transfers()), (0, 0));
        // Transfers per owner.
        for id in 0..4 {
            s.part("a", id, 10, 0, b"x").unwrap();
        }
        assert_eq!(s.part("a", 9, 10, 0, b"x").unwrap_err().0, ErrorKind::Overloaded);
    }

    #[test]
    fn idle_transfers_are_swept() {
        let s = Staging::start(StagingOptions { idle_timeout: Duration::from_millis(50), ..small() });
        s.part("a", 1, 10, 0, b"xx").unwrap();
        s.stage_reply("a", vec![1; 100]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.transfers() > 0 {
            assert!(Instant::now() < deadline, "never swept");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(s.bytes(), 0);
        assert!(s.part("a", 1, 10, 2, b"xx").unwrap_err().1.contains("unknown"));
    }
}
