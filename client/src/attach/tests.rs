//! Ring protocol tests: both ends over one anonymous region, honest and hostile.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use racekv_hashing::PutMode;
use racekv_transport::Region;

use super::area::{slot, status, word, Geometry};
use super::handshake::{goodbye, refusal, HELLO_BYTES};
use super::*;
use crate::op::{Reply, Request};

fn rings(slots: u32, slot_bytes: u32) -> (DaemonRing, ClientRing, Arc<Region>) {
    let geometry = Geometry::new(slots, slot_bytes).unwrap();
    let region = Arc::new(Region::anonymous(geometry.area_len()).unwrap());
    let daemon = DaemonRing::over(Arc::clone(&region), geometry).unwrap();
    let client = ClientRing::over(Arc::clone(&region), geometry).unwrap();
    (daemon, client, region)
}

fn encoded(request: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    request.encode(&mut out);
    out
}

fn encoded_reply(reply: &Reply) -> Vec<u8> {
    let mut out = Vec::new();
    reply.encode(&mut out);
    out
}

/// Everything the client has completed, in completion order.
fn reap(client: &ClientRing, head: &mut u64) -> Vec<u32> {
    let tail = client.completion_tail();
    let mut slots = Vec::new();
    while *head != tail {
        slots.push(client.completion(*head).unwrap());
        *head += 1;
    }
    client.consumed(*head);
    slots
}

#[test]
fn geometry_is_validated_and_laid_out_in_pages() {
    assert!(Geometry::new(0, 1024).is_err());
    assert!(Geometry::new(area::MAX_SLOTS + 1, 1024).is_err());
    assert!(Geometry::new(4, 60).is_err());
    assert!(Geometry::new(4, 1028).is_err());
    assert!(Geometry::new(4096, area::MAX_SLOT_BYTES).is_err(), "over the area limit");
    let g = Geometry::new(64, 64 << 10).unwrap();
    assert_eq!(g.area_len() % 4096, 0);
    assert!(g.cq_offset() >= g.sq_offset() + 64 * 8);
    assert!(g.slot(0) >= g.cq_offset() + 64 * 8);
    assert!(g.slot(63) + u64::from(g.slot_bytes()) <= g.area_len());
    assert_eq!(g.payload_bytes(), (64 << 10) - 32);
}

#[test]
fn a_client_refuses_an_area_of_another_geometry() {
    let geometry = Geometry::new(4, 256).unwrap();
    let region = Arc::new(Region::anonymous(geometry.area_len()).unwrap());
    DaemonRing::over(Arc::clone(&region), geometry).unwrap();
    assert!(ClientRing::over(Arc::clone(&region), Geometry::new(8, 256).unwrap()).is_err());
    region.store_u64(word::MAGIC, 7).unwrap();
    assert!(ClientRing::over(region, geometry).is_err());
}

#[test]
fn one_request_and_its_reply() {
    let (mut daemon, client, _) = rings(4, 256);
    assert_eq!(daemon.take().unwrap(), None);
    let request = Request::Put { key: b"k".to_vec(), value: b"v".to_vec(), mode: PutMode::InsertOnly };
    client.write_request(2, 77, 123, &encoded(&request));
    assert!(!client.submit(2), "the daemon is awake");
    let sub = daemon.take().unwrap().unwrap();
    assert_eq!((sub.slot, sub.request_id, sub.submitted_ns, &sub.request), (2, 77, 123, &request));
    assert_eq!(daemon.take().unwrap(), None);
    client.set_sleeping(true);
    assert!(daemon.completer().complete(2, 77, &encoded_reply(&Reply::Done(true))).unwrap(), "client sleeps");
    client.set_sleeping(false);
    let mut head = 0;
    assert_eq!(reap(&client, &mut head), vec![2]);
    let mut out = Vec::new();
    let reply = client.read_reply(2, &mut out).unwrap();
    assert_eq!(reply, SlotReply { request_id: 77, status: status::REPLY, len: out.len() });
    assert_eq!(Reply::decode(&out).unwrap(), Reply::Done(true));
}

#[test]
fn a_sleeping_daemon_is_rung_and_an_oversized_reply_says_how_large() {
    let (mut daemon, client, _) = rings(2, 64);
    daemon.set_sleeping(true);
    client.write_request(0, 1, 0, &encoded(&Request::Get(b"key".to_vec())));
    assert!(client.submit(0), "the daemon said it sleeps");
    assert!(daemon.has_submissions());
    daemon.set_sleeping(false);
    let sub = daemon.take().unwrap().unwrap();
    let big = encoded_reply(&Reply::Value(Some(vec![7; 100])));
    assert!(!daemon.completer().complete(sub.slot, sub.request_id, &big).unwrap());
    let mut head = 0;
    assert_eq!(reap(&client, &mut head), vec![0]);
    let mut out = vec![1, 2, 3];
    let reply = client.read_reply(0, &mut out).unwrap();
    assert_eq!((reply.status, reply.len), (status::REPLY_TOO_LARGE, big.len()));
    assert!(out.is_empty());
}

#[test]
fn a_full_ring_cycles_many_times_around() {
    let slots = 3u32;
    let (mut daemon, client, _) = rings(slots, 128);
    let completer = daemon.completer();
    let mut head = 0;
    let mut out = Vec::new();
    for round in 0..100u64 {
        for s in 0..slots {
            let id = round * 10 + u64::from(s);
            client.write_request(s, id, 0, &encoded(&Request::Get(id.to_le_bytes().to_vec())));
            client.submit(s);
        }
        // Full: every slot is in flight; a fourth submission of any of them is an error
        // (tested in the hostile tests). Answer in reverse order.
        let subs: Vec<Submission> = (0..slots).map(|_| daemon.take().unwrap().unwrap()).collect();
        assert_eq!(daemon.take().unwrap(), None);
        for sub in subs.iter().rev() {
            let Request::Get(key) = &sub.request else { panic!() };
            completer.complete(sub.slot, sub.request_id, &encoded_reply(&Reply::Value(Some(key.clone())))).unwrap();
        }
        let done = reap(&client, &mut head);
        assert_eq!(done, vec![2, 1, 0]);
        for s in done {
            let reply = client.read_reply(s, &mut out).unwrap();
            assert_eq!(reply.request_id, round * 10 + u64::from(s));
            assert_eq!(Reply::decode(&out).unwrap(), Reply::Value(Some(reply.request_id.to_le_bytes().to_vec())));
        }
    }
    assert_eq!(head, 300);
}

fn request() -> impl Strategy<Value = Request> {
    let bytes = || proptest::collection::vec(any::<u8>(), 0..90);
    prop_oneof![
        bytes().prop_map(Request::Get),
        (bytes(), bytes()).prop_map(|(key, value)| Request::Put { key, value, mode: PutMode::Upsert }),
        bytes().prop_map(Request::Delete),
        proptest::collection::vec(bytes(), 0..6).prop_map(Request::MultiGet),
        Just(Request::Len),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    /// The client submits a request into a free slot (if any, and if it fits).
    Submit(Request),
    /// The daemon takes everything submitted.
    Take,
    /// The daemon answers the pending request at this position (mod their number) with a
    /// reply of this many bytes of value.
    Answer(usize, usize),
    /// The client reaps completions.
    Reap,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => request().prop_map(Step::Submit),
        2 => Just(Step::Take),
        3 => (any::<usize>(), 0usize..300).prop_map(|(i, n)| Step::Answer(i, n)),
        2 => Just(Step::Reap),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Random interleavings of submissions, takes, answers (in any order) and reaps: the
    /// daemon sees exactly the client's requests in submission order, each reply reaches
    /// the slot and id it answers, oversized replies say so, indices wrap many times.
    #[test]
    fn random_sequences_keep_requests_and_replies_paired(
        slots in 1u32..6,
        slot_bytes in (8u32..40).prop_map(|w| w * 8),
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        let (mut daemon, client, _) = rings(slots, slot_bytes);
        let payload = daemon.geometry().payload_bytes();
        let completer = daemon.completer();
        let mut free: Vec<u32> = (0..slots).collect();
        let mut sent: VecDeque<(u32, u64, Request)> = VecDeque::new();
        let mut taken: Vec<Submission> = Vec::new();
        let mut expected_replies: std::collections::HashMap<u32, (u64, Vec<u8>)> = Default::default();
        let mut head = 0u64;
        let mut next_id = 1u64;
        let mut out = Vec::new();
        for step in steps {
            match step {
                Step::Submit(request) => {
                    let bytes = encoded(&request);
                    if bytes.len() > payload || free.is_empty() {
                        continue;
                    }
                    let s = free.pop().unwrap();
                    client.write_request(s, next_id, next_id * 3, &bytes);
                    client.submit(s);
                    sent.push_back((s, next_id, request));
                    next_id += 1;
                }
                Step::Take => {
                    while let Some(sub) = daemon.take().unwrap() {
                        let (s, id, request) = sent.pop_front().unwrap();
                        prop_assert_eq!((sub.slot, sub.request_id, sub.submitted_ns, &sub.request), (s, id, id * 3, &request));
                        taken.push(sub);
                    }
                    prop_assert!(sent.is_empty());
                }
                Step::Answer(i, n) => {
                    if taken.is_empty() {
                        continue;
                    }
                    let sub = taken.swap_remove(i % taken.len());
                    let reply = encoded_reply(&Reply::Value(Some(vec![sub.slot as u8; n])));
                    completer.complete(sub.slot, sub.request_id, &reply).unwrap();
                    expected_replies.insert(sub.slot, (sub.request_id, reply));
                }
                Step::Reap => {
                    for s in reap(&client, &mut head) {
                        let (id, bytes) = expected_replies.remove(&s).unwrap();
                        let reply = client.read_reply(s, &mut out).unwrap();
                        prop_assert_eq!(reply.request_id, id);
                        if bytes.len() <= payload {
                            prop_assert_eq!(reply.status, status::REPLY);
                            prop_assert_eq!(&out, &bytes);
                        } else {
                            prop_assert_eq!((reply.status, reply.len), (status::REPLY_TOO_LARGE, bytes.len()));
                        }
                        free.push(s);
                    }
                }
            }
        }
    }

    /// A hostile client scribbles arbitrary words anywhere in the area between honest
    /// steps: the daemon never panics, never hands out a request larger than a slot, and
    /// once it reports a protocol error the caller stops (as the server detaches).
    #[test]
    fn scribbling_clients_get_errors_never_panics(
        slots in 1u32..5,
        writes in proptest::collection::vec((any::<u16>(), any::<u64>(), 0u8..4), 1..60),
    ) {
        let (mut daemon, client, region) = rings(slots, 128);
        let completer = daemon.completer();
        let len = daemon.geometry().area_len();
        for (i, (offset, value, how)) in writes.into_iter().enumerate() {
            let offset = (u64::from(offset) * 8) % len;
            // Aim half the writes at the words that matter.
            let offset = match how {
                0 => [word::SQ_TAIL, word::CQ_HEAD, word::CLIENT_SLEEPING][i % 3],
                1 => daemon.geometry().sq_entry(value % 8),
                2 => daemon.geometry().slot((value % u64::from(slots)) as u32) + [slot::LENGTH, slot::PAYLOAD][i % 2],
                _ => offset,
            };
            region.store_u64(offset, value).unwrap();
            if i % 3 == 0 {
                let s = (i as u32) % slots;
                client.write_request(s, i as u64, 0, &encoded(&Request::Get(vec![1, 2, 3])));
                client.submit(s);
            }
            match daemon.take() {
                Ok(Some(sub)) => {
                    prop_assert!(sub.bytes <= daemon.geometry().payload_bytes());
                    if completer.complete(sub.slot, sub.request_id, &encoded_reply(&Reply::Ok)).is_err() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    prop_assert!(!e.reason().is_empty());
                    break;
                }
            }
        }
    }
}

/// A fresh ring pair for one hostile case.
fn hostile_setup() -> (DaemonRing, ClientRing, Arc<Region>) {
    rings(4, 256)
}

#[test]
fn a_tail_running_ahead_of_the_ring_is_an_error() {
    let (mut daemon, _, region) = hostile_setup();
    region.store_u64(word::SQ_TAIL, 5).unwrap();
    assert_eq!(daemon.take().unwrap_err().reason(), "submission_index");
    let (mut daemon, _, region) = hostile_setup();
    region.store_u64(word::SQ_TAIL, u64::MAX).unwrap();
    assert_eq!(daemon.take().unwrap_err().reason(), "submission_index");
}

#[test]
fn a_slot_index_out_of_range_is_an_error() {
    let (mut daemon, _, region) = hostile_setup();
    region.store_u64(daemon.geometry().sq_entry(0), 4).unwrap();
    region.store_u64(word::SQ_TAIL, 1).unwrap();
    assert!(matches!(daemon.take(), Err(ProtocolError::SlotIndex { slot: 4, slots: 4 })));
}

#[test]
fn a_slot_submitted_twice_is_an_error() {
    let (mut daemon, client, _) = hostile_setup();
    client.write_request(1, 1, 0, &encoded(&Request::Len));
    client.submit(1);
    client.submit(1);
    assert!(daemon.take().unwrap().is_some());
    assert_eq!(daemon.take().unwrap_err(), ProtocolError::SlotInFlight { slot: 1 });
}

#[test]
fn huge_and_garbage_lengths_are_errors_without_allocating() {
    for len in [229u64, 1 << 20, u64::MAX, 1 << 32] {
        let (mut daemon, client, region) = hostile_setup();
        client.write_request(0, 1, 0, &encoded(&Request::Len));
        region.store_u64(daemon.geometry().slot(0) + slot::LENGTH, len).unwrap();
        client.submit(0);
        assert_eq!(daemon.take().unwrap_err().reason(), "length", "length {len}");
    }
}

#[test]
fn garbage_and_torn_payloads_are_errors() {
    let (mut daemon, client, _) = hostile_setup();
    client.write_request(0, 1, 0, &[0xFF; 40]);
    client.submit(0);
    assert_eq!(daemon.take().unwrap_err().reason(), "undecodable");
    // A request cut short (as if the client stopped while writing it, then published).
    let (mut daemon, client, _) = hostile_setup();
    let whole = encoded(&Request::Put { key: b"key".to_vec(), value: vec![9; 50], mode: PutMode::Upsert });
    client.write_request(0, 1, 0, &whole[..20]);
    client.submit(0);
    assert_eq!(daemon.take().unwrap_err().reason(), "undecodable");
}

#[test]
fn an_unpublished_request_is_never_seen() {
    let (mut daemon, client, _) = hostile_setup();
    client.write_request(0, 1, 0, &encoded(&Request::Len));
    assert!(!daemon.has_submissions());
    assert_eq!(daemon.take().unwrap(), None);
}

#[test]
fn reusing_slots_without_consuming_completions_overruns_and_is_an_error() {
    let (mut daemon, client, region) = rings(2, 128);
    let completer = daemon.completer();
    let mut result = Ok(false);
    for i in 0..3u64 {
        client.write_request(0, i, 0, &encoded(&Request::Len));
        client.submit(0);
        let sub = daemon.take().unwrap().unwrap();
        result = completer.complete(sub.slot, sub.request_id, &encoded_reply(&Reply::Count(i)));
        if result.is_err() {
            break;
        }
    }
    assert_eq!(result.unwrap_err().reason(), "completion_overrun");
    assert_eq!(region.load_u64(word::CQ_TAIL).unwrap(), 2, "the overrunning completion was not published");
}

#[test]
fn a_completion_head_ahead_of_the_tail_is_an_overrun() {
    let (mut daemon, client, region) = rings(2, 128);
    client.write_request(0, 1, 0, &encoded(&Request::Len));
    client.submit(0);
    let sub = daemon.take().unwrap().unwrap();
    region.store_u64(word::CQ_HEAD, 9).unwrap();
    let err = daemon.completer().complete(sub.slot, sub.request_id, &encoded_reply(&Reply::Count(1))).unwrap_err();
    assert_eq!(err.reason(), "completion_overrun");
}

#[test]
fn reply_bounds_cover_their_replies() {
    let big = vec![0u8; racekv_hashing::MAX_KV_BYTES];
    let cases = [
        (Request::Get(b"k".to_vec()), Reply::Value(Some(big.clone()))),
        (Request::MultiGet(vec![b"a".to_vec(); 3]), Reply::Values(vec![Some(big.clone()); 3])),
        (Request::Delete(b"k".to_vec()), Reply::Done(true)),
        (Request::Len, Reply::Count(u64::MAX)),
        (Request::MultiPut(vec![]), Reply::Ok),
        (Request::Len, Reply::Error(crate::op::ErrorKind::Internal, "x".repeat(10_000))),
        (Request::RandomKey, Reply::Value(Some(big.clone()))),
        (Request::DeleteAll, Reply::Count(u64::MAX)),
        // A page of keys each counting length + 8 against max_bytes, and one key longer
        // than max_bytes alone.
        (
            Request::Scan { cursor: 0, count: 10, max_bytes: 1_000 },
            Reply::Keys { cursor: u64::MAX, keys: vec![vec![1; 17]; 40] },
        ),
        (Request::Scan { cursor: 0, count: 10, max_bytes: 1 }, Reply::Keys { cursor: 1, keys: vec![big.clone()] }),
    ];
    for (request, reply) in cases {
        assert!(encoded_reply(&reply).len() as u64 <= reply_bound(&request), "{request:?}");
    }
}

#[test]
fn hello_and_frames_round_trip() {
    for hello in [
        Hello { pid: 4242, user: None, password: None, borrow: true },
        Hello { pid: 7, user: Some("alice".into()), password: Some(b"pw".to_vec()), borrow: false },
        Hello { pid: 7, user: None, password: Some(vec![0xff; handshake::MAX_PASSWORD_BYTES]), borrow: false },
    ] {
        let bytes = hello.encode();
        assert_eq!(
            Hello::credentials_len(&bytes[..handshake::HELLO_BYTES]).unwrap(),
            bytes.len() - handshake::HELLO_BYTES
        );
        assert_eq!(Hello::decode(&bytes).unwrap(), hello);
        assert!(Hello::decode(&bytes[..bytes.len() - 1]).is_err() || bytes.len() == handshake::HELLO_BYTES);
    }
    let mut too_long = Hello { pid: 1, user: None, password: None, borrow: false }.encode();
    too_long[10..12].copy_from_slice(&(handshake::MAX_PASSWORD_BYTES as u16 + 1).to_le_bytes());
    assert!(Hello::credentials_len(&too_long).is_err(), "a password past the limit is refused before it is read");
    assert!(format!("{:?}", Hello { pid: 1, user: None, password: Some(b"secret".to_vec()), borrow: false })
        .contains("***"));
    let accepted = Accepted { attachment_id: 9, geometry: Geometry::new(64, 64 << 10).unwrap(), max_multi_keys: 1000 };
    for frame in [
        Frame::Accepted(accepted),
        Frame::Refused { code: refusal::TOO_MANY_CLIENTS, reason: "full".into() },
        Frame::Goodbye { code: goodbye::PROTOCOL_ERROR, reason: "é".repeat(2000) },
    ] {
        let bytes = frame.encode();
        let decoded = Frame::decode(&bytes).unwrap();
        match (&frame, &decoded) {
            (Frame::Goodbye { reason, .. }, Frame::Goodbye { reason: cut, .. }) => {
                assert!(reason.starts_with(cut.as_str()) && cut.len() <= handshake::MAX_FRAME_BODY);
            }
            _ => assert_eq!(decoded, frame),
        }
    }
    let mut bad = Hello { pid: 1, user: None, password: None, borrow: false }.encode();
    bad[4] = 9;
    assert!(matches!(Hello::decode(&bad), Err(e) if e.message.contains("version")));
    assert!(Hello::decode(&[0; HELLO_BYTES - 1]).is_err());
}

proptest! {
    #[test]
    fn handshake_decoders_never_panic(junk in proptest::collection::vec(any::<u8>(), 0..80)) {
        let _ = Hello::decode(&junk);
        let _ = Frame::decode(&junk);
        if junk.len() >= 8 {
            let _ = Frame::decode_header(&junk[..8]);
        }
    }
}

#[test]
fn doorbells_wake_and_time_out() {
    let bell = Doorbell::new().unwrap();
    let started = Instant::now();
    assert_eq!(doorbell::wait_readable(&[bell.as_fd()], Some(Duration::from_millis(20))).unwrap(), vec![false]);
    assert!(started.elapsed() >= Duration::from_millis(15));
    bell.ring();
    bell.ring();
    assert_eq!(doorbell::wait_readable(&[bell.as_fd()], Some(Duration::from_secs(5))).unwrap(), vec![true]);
    bell.drain();
    assert_eq!(doorbell::wait_readable(&[bell.as_fd()], Some(Duration::ZERO)).unwrap(), vec![false]);
    let other = Doorbell::from_fd(bell.try_clone_fd().unwrap());
    let waiter = std::thread::spawn(move || doorbell::wait_readable(&[other.as_fd()], None).unwrap());
    std::thread::sleep(Duration::from_millis(10));
    bell.ring();
    assert_eq!(waiter.join().unwrap(), vec![true]);
}

proptest! {
    /// A LENT body of any bytes, with no descriptors: an error, never a panic.
    #[test]
    fn lent_frames_of_junk_are_refused(junk in proptest::collection::vec(any::<u8>(), 0..900)) {
        prop_assert!(crate::attach::lending::LentMemnode::decode(&junk, Vec::new()).is_err());
    }
}
