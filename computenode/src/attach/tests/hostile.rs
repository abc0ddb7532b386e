//! Hostile clients: hand-made attachments that write garbage into their shared area, break
//! the handshake, stop half-way or vanish. Each is detached (with a goodbye naming the
//! reason, and counted); the daemon and a well-behaved client carry on.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use racekv_client::attach::area::{slot, word};
use racekv_client::attach::handshake::{refusal, FRAME_HEADER_BYTES};
use racekv_client::attach::{ClientRing, Doorbell, Frame, Geometry, Hello};
use racekv_client::op::Request;
use racekv_transport::Region;

use super::super::AttachOptions;
use super::{metric, wait_for, Harness};

/// A client speaking the protocol by hand.
struct Raw {
    stream: UnixStream,
    region: Arc<Region>,
    geometry: Geometry,
    to_daemon: Doorbell,
    _from_daemon: Doorbell,
}

fn read_frame(stream: &mut UnixStream) -> (Frame, Vec<OwnedFd>) {
    let mut header = [0u8; FRAME_HEADER_BYTES];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < header.len() {
        let (n, more) = racekv_transport::fdpass::recv_with_fds(stream, &mut header[got..], 3).unwrap();
        assert!(n > 0, "closed before a frame");
        got += n;
        fds.extend(more);
    }
    let (_, _, len) = Frame::decode_header(&header).unwrap();
    let mut frame = header.to_vec();
    frame.resize(FRAME_HEADER_BYTES + len, 0);
    stream.read_exact(&mut frame[FRAME_HEADER_BYTES..]).unwrap();
    (Frame::decode(&frame).unwrap(), fds)
}

impl Raw {
    fn attach(socket: &Path) -> Self {
        let mut stream = UnixStream::connect(socket).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let hello = Hello { pid: 1, user: None, password: None, borrow: false };
        stream.write_all(&hello.encode()).unwrap();
        let (frame, fds) = read_frame(&mut stream);
        let Frame::Accepted(accepted) = frame else { panic!("not accepted: {frame:?}") };
        let [memfd, to_daemon, from_daemon]: [OwnedFd; 3] = fds.try_into().unwrap();
        let region = Region::map_file(&std::fs::File::from(memfd), accepted.geometry.area_len()).unwrap();
        Self {
            stream,
            region: Arc::new(region),
            geometry: accepted.geometry,
            to_daemon: Doorbell::from_fd(to_daemon),
            _from_daemon: Doorbell::from_fd(from_daemon),
        }
    }

    fn ring(&self) -> ClientRing {
        ClientRing::over(Arc::clone(&self.region), self.geometry).unwrap()
    }

    /// Writes a word anywhere in the area and wakes the daemon.
    fn poke(&self, offset: u64, value: u64) {
        self.region.store_u64(offset, value).unwrap();
        self.to_daemon.ring();
    }

    /// Writes `payload` into `slot` as a request and publishes it.
    fn send(&self, ring: &ClientRing, slot: u32, payload: &[u8]) {
        ring.write_request(slot, u64::from(slot) + 1, 0, payload);
        ring.submit(slot);
        self.to_daemon.ring();
    }

    /// Reads until the daemon closes the socket; returns its goodbye reason.
    fn goodbye(&mut self) -> String {
        let mut said = Vec::new();
        self.stream.read_to_end(&mut said).expect("the daemon closes the attachment");
        match Frame::decode(&said) {
            Ok(Frame::Goodbye { reason, .. }) => reason,
            other => panic!("expected a goodbye, got {other:?} from {said:?}"),
        }
    }

    /// Whether the daemon has said goodbye or closed (peeking: the goodbye stays unread).
    fn is_closed(&self) -> bool {
        use nix::sys::socket::{recv, MsgFlags};
        use std::os::fd::AsRawFd;
        let mut buf = [0u8; 1];
        !matches!(
            recv(self.stream.as_raw_fd(), &mut buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT),
            Err(nix::errno::Errno::EAGAIN)
        )
    }
}

fn encoded(request: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    request.encode(&mut out);
    out
}

/// Attaches a well-behaved client and a raw one, lets `misbehave` loose with the raw one,
/// and checks the raw one is detached for `reason` (its goodbye containing `text`) while
/// the good one keeps working.
fn detached_for(h: &Harness, reason: &str, text: &str, misbehave: impl FnOnce(&Raw)) {
    let good = h.client();
    good.put(b"good", b"1").unwrap();
    let series = format!("racekv_attach_protocol_errors_total{{reason=\"{reason}\"}}");
    let before = metric(&series);
    let mut raw = Raw::attach(&h.socket);
    h.wait_attached(2);
    misbehave(&raw);
    let bye = raw.goodbye();
    assert!(bye.contains(text), "goodbye {bye:?} lacks {text:?}");
    h.wait_attached(1);
    assert!(metric(&series) > before, "{series} not counted");
    for i in 0..20 {
        good.put(format!("good-{i}").as_bytes(), b"2").unwrap();
        assert_eq!(good.get(format!("good-{i}").as_bytes()).unwrap().as_deref(), Some(&b"2"[..]));
    }
}

#[test]
fn a_submission_tail_out_of_range_detaches() {
    let h = Harness::start();
    detached_for(&h, "submission_index", "submission tail", |raw| raw.poke(word::SQ_TAIL, 1 << 40));
}

#[test]
fn a_slot_index_out_of_range_detaches() {
    let h = Harness::start();
    detached_for(&h, "slot_index", "names slot 4096", |raw| {
        raw.region.store_u64(raw.geometry.sq_entry(0), 4096).unwrap();
        raw.poke(word::SQ_TAIL, 1);
    });
}

#[test]
fn a_huge_length_detaches_without_allocating() {
    let h = Harness::start();
    detached_for(&h, "length", "claims a request of", |raw| {
        let ring = raw.ring();
        ring.write_request(0, 1, 0, &encoded(&Request::Len));
        raw.region.store_u64(raw.geometry.slot(0) + slot::LENGTH, u64::MAX - 3).unwrap();
        ring.submit(0);
        raw.to_daemon.ring();
    });
}

#[test]
fn garbage_request_bytes_detach() {
    let h = Harness::start();
    detached_for(&h, "undecodable", "undecodable", |raw| raw.send(&raw.ring(), 0, &[0xAB; 100]));
}

#[test]
fn a_request_torn_by_a_client_that_stopped_writing_detaches() {
    let h = Harness::start();
    detached_for(&h, "undecodable", "undecodable", |raw| {
        let ring = raw.ring();
        let whole =
            encoded(&Request::Put { key: b"k".to_vec(), value: vec![1; 500], mode: racekv_hashing::PutMode::Upsert });
        // Published with a length that cuts the value short (a client that stopped
        // half-way through writing): the value's length field claims more than there is.
        ring.write_request(0, 1, 0, &whole);
        raw.region.store_u64(raw.geometry.slot(0) + slot::LENGTH, 40).unwrap();
        ring.submit(0);
        raw.to_daemon.ring();
    });
}

#[test]
fn a_slot_submitted_twice_detaches() {
    // No workers: the first submission stays in flight.
    let mut h = Harness::with(64, 0, AttachOptions::default());
    let mut raw = Raw::attach(&h.socket);
    let before = metric("racekv_attach_protocol_errors_total{reason=\"slot_in_flight\"}");
    let ring = raw.ring();
    ring.write_request(3, 1, 0, &encoded(&Request::Len));
    ring.submit(3);
    ring.submit(3);
    raw.to_daemon.ring();
    assert!(raw.goodbye().contains("submitted again"));
    h.wait_attached(0);
    assert!(metric("racekv_attach_protocol_errors_total{reason=\"slot_in_flight\"}") > before);
    // The request it had in flight still runs, into a detached ring.
    h.start_workers(1);
    let good = h.client();
    good.put(b"k", b"v").unwrap();
    assert_eq!(h.queue.depth(), 0);
}

#[test]
fn reusing_slots_without_consuming_replies_overruns_and_detaches() {
    let h = Harness::with(64, 2, AttachOptions { slots: 4, slot_bytes: 40 << 10, ..AttachOptions::default() });
    detached_for(&h, "completion_overrun", "completion ring overrun", |raw| {
        let ring = raw.ring();
        for i in 0..5u64 {
            raw.send(&ring, 0, &encoded(&Request::Len));
            let answered = wait_for(Duration::from_secs(5), || ring.completion_tail() > i || raw.is_closed());
            if answered.is_none() || raw.is_closed() {
                break;
            }
        }
    });
}

#[test]
fn bytes_on_the_control_socket_detach() {
    let h = Harness::start();
    detached_for(&h, "unexpected_bytes", "unexpected bytes", |raw| (&raw.stream).write_all(b"hello?").unwrap());
}

#[test]
fn a_request_over_the_reply_budget_detaches() {
    let h = Harness::start();
    detached_for(&h, "over_budget", "reply budget", |raw| {
        let keys = (0..2000u32).map(|i| i.to_le_bytes().to_vec()).collect();
        raw.send(&raw.ring(), 0, &encoded(&Request::MultiGet(keys)));
    });
}

#[test]
fn silent_and_garbled_hellos_are_refused() {
    let options = AttachOptions { handshake_timeout: Duration::from_millis(200), ..AttachOptions::default() };
    let h = Harness::with(64, 1, options);
    let before = metric("racekv_attach_refused_total{reason=\"bad_hello\"}");
    let mut silent = UnixStream::connect(&h.socket).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let (frame, _) = read_frame(&mut silent);
    assert!(
        matches!(&frame, Frame::Refused { code: refusal::BAD_HELLO, reason } if reason.contains("no hello")),
        "{frame:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let mut garbled = UnixStream::connect(&h.socket).unwrap();
    garbled.write_all(&[0x5A; 32]).unwrap();
    let (frame, _) = read_frame(&mut garbled);
    assert!(
        matches!(&frame, Frame::Refused { code: refusal::BAD_HELLO, reason } if reason.contains("magic")),
        "{frame:?}"
    );
    assert!(metric("racekv_attach_refused_total{reason=\"bad_hello\"}") >= before + 2.0);
    h.client().put(b"k", b"v").unwrap();
}

#[test]
fn clients_that_stop_mid_request_or_vanish_are_freed() {
    let mut h = Harness::with(64, 0, AttachOptions::default());
    // One writes half a request and never publishes it; one leaves requests in flight (no
    // workers yet) and never reads replies; then both vanish.
    let half = Raw::attach(&h.socket);
    let whole = encoded(&Request::Get(b"key".to_vec()));
    half.ring().write_request(0, 1, 0, &whole[..6]);
    let stuck = Raw::attach(&h.socket);
    let ring = stuck.ring();
    for s in 0..4 {
        stuck.send(
            &ring,
            s,
            &encoded(&Request::Put {
                key: vec![s as u8 + 1],
                value: b"v".to_vec(),
                mode: racekv_hashing::PutMode::Upsert,
            }),
        );
    }
    wait_for(Duration::from_secs(5), || h.queue.depth() == 4).expect("four requests queued");
    h.wait_attached(2);
    drop(half);
    drop(stuck);
    h.wait_attached(0);
    // Their requests still run; the replies go nowhere.
    h.start_workers(2);
    wait_for(Duration::from_secs(5), || h.queue.depth() == 0).expect("queue drained");
    let good = h.client();
    assert_eq!(good.get(&[1]).unwrap().as_deref(), Some(&b"v"[..]));
}

/// xorshift64*, for reproducible garbage.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn random_scribbling_never_hurts_the_daemon() {
    let h = Harness::with(256, 2, AttachOptions { slots: 8, slot_bytes: 40 << 10, ..AttachOptions::default() });
    let good = h.client();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut detached = 0;
    for round in 0..30 {
        let raw = Raw::attach(&h.socket);
        let ring = raw.ring();
        let len = raw.geometry.area_len();
        let control = [word::SQ_TAIL, word::CQ_HEAD, word::CLIENT_SLEEPING, word::DAEMON_SLEEPING, word::SQ_HEAD];
        for i in 0..200u32 {
            let value = match rng.next() % 4 {
                0 => rng.next(),
                1 => rng.next() % 16,
                2 => u64::MAX - rng.next() % 4,
                _ => rng.next() % 100_000,
            };
            let offset = match rng.next() % 4 {
                0 => control[(rng.next() % control.len() as u64) as usize],
                1 => raw.geometry.sq_entry(rng.next()),
                2 => raw.geometry.slot((rng.next() % 8) as u32) + (rng.next() % 6) * 8,
                _ => (rng.next() % (len / 8)) * 8,
            };
            raw.poke(offset, value);
            if i % 7 == 0 {
                raw.send(&ring, (rng.next() % 8) as u32, &encoded(&Request::Get(vec![round as u8, i as u8])));
            }
            if i % 16 == 0 && raw.is_closed() {
                break;
            }
        }
        // The daemon's thread may lag behind a fast scribbler: give it a moment.
        if wait_for(Duration::from_millis(500), || raw.is_closed()).is_some() {
            detached += 1;
        }
        drop(raw);
        good.put(format!("round-{round}").as_bytes(), b"ok").unwrap();
        h.wait_attached(1);
    }
    assert!(detached > 0, "garbage got some client detached");
    for round in 0..30 {
        assert_eq!(good.get(format!("round-{round}").as_bytes()).unwrap().as_deref(), Some(&b"ok"[..]));
    }
}

/// Sends `request` in slot 0 and waits for its reply (one request at a time).
fn ask(raw: &Raw, ring: &ClientRing, request: &Request) -> racekv_client::op::Reply {
    let before = ring.completion_tail();
    raw.send(ring, 0, &encoded(request));
    let deadline = Instant::now() + Duration::from_secs(30);
    while ring.completion_tail() == before {
        assert!(Instant::now() < deadline, "no reply");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(ring.completion(before).unwrap(), 0);
    ring.consumed(before + 1);
    let mut payload = Vec::new();
    let reply = ring.read_reply(0, &mut payload).unwrap();
    assert_eq!(reply.status, racekv_client::attach::area::status::REPLY);
    racekv_client::op::Reply::decode(&payload).unwrap()
}

#[test]
fn hostile_parts_get_error_replies_and_the_attachment_stays() {
    use racekv_client::op::{ErrorKind, Reply, MAX_REQUEST_BYTES};
    let h = Harness::start();
    let raw = Raw::attach(&h.socket);
    let ring = raw.ring();
    let part = |id: u64, total: usize, offset: usize, bytes: &[u8]| Request::Part {
        id,
        total: total as u64,
        offset: offset as u64,
        bytes: bytes.to_vec(),
    };
    let refused = |reply: Reply, words: &str| match reply {
        Reply::Error(ErrorKind::BadRequest, message) => assert!(message.contains(words), "{message}"),
        other => panic!("expected a refusal saying {words:?}, got {other:?}"),
    };
    let put =
        encoded(&Request::Put { key: b"p".to_vec(), value: vec![9; 1000], mode: racekv_hashing::PutMode::Upsert });
    assert_eq!(ask(&raw, &ring, &part(1, put.len(), 0, &put[..10])), Reply::Count(10));
    refused(ask(&raw, &ring, &part(1, put.len(), 20, &put[20..30])), "expected 10");
    refused(ask(&raw, &ring, &part(2, MAX_REQUEST_BYTES + 1, 0, b"x")), "largest request");
    assert_eq!(ask(&raw, &ring, &part(3, 4, 0, b"ab")), Reply::Count(2));
    refused(ask(&raw, &ring, &part(3, 4, 2, b"cde")), "past its total");
    refused(ask(&raw, &ring, &Request::FetchPart { id: 77, offset: 0, max_len: 100 }), "no staged reply");
    // A well-formed upload runs, and the attachment is still there.
    assert_eq!(ask(&raw, &ring, &part(4, put.len(), 0, &put[..500])), Reply::Count(500));
    assert_eq!(ask(&raw, &ring, &part(4, put.len(), 500, &put[500..])), Reply::Done(true));
    assert_eq!(ask(&raw, &ring, &Request::Get(b"p".to_vec())), Reply::Value(Some(vec![9; 1000])));
    assert!(!raw.is_closed());
    assert_eq!(h.client().get(b"p").unwrap(), Some(vec![9; 1000]));
}
