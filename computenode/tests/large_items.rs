//! Keys and values larger than one ring slot or one RPC, through all three modes of the
//! client library (embedded, attached, remote) against a real computenode (in-process) and
//! a real memnode; and hostile transfers in parts against the remote front end.

use std::time::{Duration, Instant};

use racekv_client::op::{ErrorKind, Reply, Request, MAX_KEY_BYTES, MAX_REMOTE_MESSAGE_BYTES, MAX_REQUEST_BYTES};
use racekv_client::{Client, ClientError, ExpiryChange, PutOptions};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::{ConnectOptions, Connection, Endpoint, TransportKind};

const PASSWORD: &str = "large-secret";
const OTHER_PASSWORD: &str = "other-secret";
/// An attached client's slot payload with the default options (64 KiB slots).
const ATTACH_SLOT_PAYLOAD_BYTES: usize = (64 << 10) - 32;

fn node(m: &TestMemnode, dir: &std::path::Path, idle_timeout_ms: u64) -> Computenode {
    let acl = dir.join("users.acl");
    std::fs::write(&acl, format!("user default on >{PASSWORD} ~* +@all\nuser other on >{OTHER_PASSWORD} ~* +@all\n"))
        .unwrap();
    Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        aclfile: Some(acl),
        redis_addr: None,
        metrics_addr: None,
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        staging_idle_timeout_ms: idle_timeout_ms,
        ..ComputenodeConfig::default()
    })
    .unwrap()
}

fn remote_addr(node: &Computenode) -> String {
    node.remote_endpoint().unwrap().trim_start_matches("tcp:").to_string()
}

/// A value of `len` bytes that differs from position to position (and by `seed`).
fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Every single-key operation on values from empty to 17 MiB, with keys past a slot, and
/// multi-key requests whose requests and replies take more than one message.
fn exercise_large(c: &Client) {
    let sizes = [0, ATTACH_SLOT_PAYLOAD_BYTES + 1, MAX_REMOTE_MESSAGE_BYTES + 1, 17 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let key = format!("large-{len}").into_bytes();
        let v = value(len, i as u8);
        c.put(&key, &v).unwrap();
        assert_eq!(c.get(&key).unwrap().as_deref(), Some(&v[..]), "{len} B");
        let item = c.get_item(&key).unwrap().expect("stored");
        assert_eq!((item.value.len(), item.expires_at_ms), (len, None));
        let w = value(len, i as u8 + 100);
        let old = c.put_opts(&key, &w, PutOptions { return_old: true, ..PutOptions::default() }).unwrap();
        assert_eq!(old.old.as_deref(), Some(&v[..]), "{len} B: the old value back");
        assert!(!c.compare_and_swap(&key, Some(b"not it"), Some(b"x")).unwrap());
        assert!(c.compare_and_swap(&key, Some(&w), Some(&v)).unwrap());
        assert_eq!(c.get(&key).unwrap().as_deref(), Some(&v[..]));
        let at_ms = racekv_client::now_unix_ms() + 3_600_000;
        assert!(c.expire(&key, ExpiryChange::At { at_ms, condition: racekv_client::ExpireCondition::ALWAYS }).unwrap());
        assert_eq!(c.get_item(&key).unwrap().unwrap().expires_at_ms, Some(at_ms));
        assert!(c.delete(&key).unwrap());
        assert_eq!(c.get(&key).unwrap(), None);
    }
    // A large value overwritten by a small one, and back.
    let big = value(17 << 20, 7);
    c.put(b"flip", &big).unwrap();
    c.put(b"flip", b"small").unwrap();
    assert_eq!(c.get(b"flip").unwrap().as_deref(), Some(&b"small"[..]));
    c.put(b"flip", &big).unwrap();
    assert_eq!(c.get(b"flip").unwrap().as_deref(), Some(&big[..]));
    assert!(c.delete(b"flip").unwrap());
    assert_eq!(c.get(b"missing").unwrap(), None);
    assert_eq!(c.get_item(b"missing").unwrap(), None);

    // Keys past a slot and of 1 MiB: stored once the table takes them, a typed error before.
    for len in [ATTACH_SLOT_PAYLOAD_BYTES + 1, 1 << 20] {
        let key = value(len, 3);
        if len <= MAX_KEY_BYTES {
            c.put(&key, b"long key").unwrap();
            assert_eq!(c.get(&key).unwrap().as_deref(), Some(&b"long key"[..]));
            assert!(c.delete(&key).unwrap());
            assert_eq!(c.get(&key).unwrap(), None);
        } else {
            let too_large = |e: ClientError| matches!(e, ClientError::TooLarge { max: MAX_KEY_BYTES, .. });
            assert!(too_large(c.put(&key, b"v").unwrap_err()), "{len} B key");
            assert!(too_large(c.get(&key).unwrap_err()), "{len} B key");
            assert!(too_large(c.delete(&key).unwrap_err()), "{len} B key");
        }
    }
    let err = c.put(b"k", &vec![0u8; racekv_client::op::MAX_VALUE_BYTES + 1]).unwrap_err();
    assert!(matches!(err, ClientError::TooLarge { .. }), "{err:?}");

    // Multi-key requests and replies past one message (three values of 3 MiB: 9 MiB).
    let keys: Vec<Vec<u8>> = (0..3).map(|i| format!("multi-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = (0..3).map(|i| value(3 << 20, 40 + i)).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().zip(&values).map(|(k, v)| (&k[..], &v[..])).collect();
    c.multi_put(&pairs).unwrap();
    let asked: Vec<&[u8]> = keys.iter().map(Vec::as_slice).chain([&b"missing"[..]]).collect();
    let got = c.multi_get(&asked).unwrap();
    assert_eq!(got.len(), 4);
    for (g, v) in got.iter().zip(&values) {
        assert_eq!(g.as_deref(), Some(&v[..]));
    }
    assert_eq!(got[3], None);
    for k in &keys {
        assert!(c.delete(k).unwrap());
    }
}

fn start_large() -> (TestMemnode, tempfile::TempDir, Computenode) {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 512 << 20, 64);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path(), 30_000);
    (m, dir, node)
}

#[test]
fn large_keys_and_values_embedded_and_attached() {
    let (m, _dir, node) = start_large();
    let embedded =
        Client::builder().memnode(m.endpoint().unwrap().to_string()).token(TestMemnode::TOKEN).connect().unwrap();
    let socket = node.status().attach_socket.expect("the daemon serves its attach socket");
    let attached = Client::builder().attach(&socket).connect().unwrap();
    exercise_large(&embedded);
    exercise_large(&attached);
    // What one mode wrote, the other reads.
    let v = value(5 << 20, 9);
    attached.put(b"shared", &v).unwrap();
    assert_eq!(embedded.get(b"shared").unwrap().as_deref(), Some(&v[..]));
    // Nothing stays staged once the transfers are done.
    assert_eq!((node.staging().transfers(), node.staging().bytes()), (0, 0));
}

/// Remote mode on the same exercise, with the default timeout. (It once stalled for good:
/// requests slower than the FLOCK scheduler's queue delay got no credits ever again; the
/// scheduler now grants every idle lane one.)
#[test]
fn large_keys_and_values_remote() {
    let (_m, _dir, node) = start_large();
    let remote = Client::builder().remote(remote_addr(&node)).password(PASSWORD).connect().unwrap();
    exercise_large(&remote);
    assert_eq!((node.staging().transfers(), node.staging().bytes()), (0, 0));
}

/// A raw RPC connection to the remote front end as `user`.
fn raw(node: &Computenode, user: &str, password: &str) -> std::sync::Arc<dyn Connection> {
    let options = ConnectOptions::new(String::new(), Duration::from_secs(10)).with_user(user, password);
    racekv_transport::connect(&Endpoint::Tcp(remote_addr(node)), &options).unwrap()
}

fn call(conn: &dyn Connection, request: &Request) -> Reply {
    let mut bytes = Vec::new();
    request.encode(&mut bytes);
    Reply::decode(&conn.call(racekv_client::op::REMOTE_METHOD, &bytes).unwrap()).unwrap()
}

fn part(id: u64, total: usize, offset: usize, bytes: &[u8]) -> Request {
    Request::Part { id, total: total as u64, offset: offset as u64, bytes: bytes.to_vec() }
}

fn assert_refused(reply: Reply, kind: ErrorKind, words: &str) {
    match reply {
        Reply::Error(k, message) => {
            assert_eq!(k, kind, "{message}");
            assert!(message.contains(words), "{message:?} should say {words:?}");
        }
        other => panic!("expected a refusal saying {words:?}, got {other:?}"),
    }
}

#[test]
fn hostile_transfers_in_parts_get_clear_errors_and_the_computenode_keeps_serving() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 16);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path(), 300);
    let a = raw(&node, "default", PASSWORD);
    let b = raw(&node, "other", OTHER_PASSWORD);
    let mut request = Vec::new();
    Request::Put { key: b"parts".to_vec(), value: value(10_000, 1), mode: racekv_client::PutMode::Upsert }
        .encode(&mut request);
    let total = request.len();

    // Out of order, past the total, over the largest request, a fetch of an unknown id.
    assert_eq!(call(&*a, &part(1, total, 0, &request[..100])), Reply::Count(100));
    assert_refused(call(&*a, &part(1, total, 200, &request[200..300])), ErrorKind::BadRequest, "expected 100");
    assert_refused(call(&*a, &part(1, total, 100, &request[100..200])), ErrorKind::BadRequest, "unknown");
    assert_eq!(call(&*a, &part(2, 10, 0, &request[..8])), Reply::Count(8));
    assert_refused(call(&*a, &part(2, 10, 8, &request[8..16])), ErrorKind::BadRequest, "past its total");
    assert_refused(call(&*a, &part(3, MAX_REQUEST_BYTES + 1, 0, b"x")), ErrorKind::BadRequest, "largest request");
    let fetch = Request::FetchPart { id: 12345, offset: 0, max_len: 1 << 20 };
    assert_refused(call(&*a, &fetch), ErrorKind::BadRequest, "no staged reply");
    // A request in parts that decodes to garbage.
    assert_eq!(call(&*a, &part(4, 8, 0, &[0xFF; 4])), Reply::Count(4));
    assert_refused(call(&*a, &part(4, 8, 4, &[0xFF; 4])), ErrorKind::BadRequest, "upload 4");

    // The same id from two users, interleaved: two separate uploads, both complete.
    let mut other = Vec::new();
    Request::Put { key: b"parts-b".to_vec(), value: value(10_000, 2), mode: racekv_client::PutMode::Upsert }
        .encode(&mut other);
    let half = total / 2;
    assert_eq!(call(&*a, &part(7, total, 0, &request[..half])), Reply::Count(half as u64));
    assert_eq!(call(&*b, &part(7, other.len(), 0, &other[..half])), Reply::Count(half as u64));
    assert_eq!(call(&*a, &part(7, total, half, &request[half..])), Reply::Done(true));
    assert_eq!(call(&*b, &part(7, other.len(), half, &other[half..])), Reply::Done(true));
    // A staged reply is its owner's alone.
    let value_bytes = value(MAX_REMOTE_MESSAGE_BYTES, 3);
    let client = Client::builder().remote(remote_addr(&node)).password(PASSWORD).connect().unwrap();
    client.put(b"huge", &value_bytes).unwrap();
    let Reply::Staged { id, total: staged } = call(&*a, &Request::Get(b"huge".to_vec())) else { panic!("not staged") };
    assert!(staged as usize > MAX_REMOTE_MESSAGE_BYTES);
    assert_refused(
        call(&*b, &Request::FetchPart { id, offset: 0, max_len: 1 << 20 }),
        ErrorKind::BadRequest,
        "no staged",
    );
    let Reply::Part(first) = call(&*a, &Request::FetchPart { id, offset: 0, max_len: 1 << 20 }) else { panic!() };
    assert_eq!(first.len(), 1 << 20);

    // Stale transfers (that staged reply, and an upload left half-way) are swept.
    assert_eq!(call(&*a, &part(9, total, 0, &request[..100])), Reply::Count(100));
    let deadline = Instant::now() + Duration::from_secs(60);
    while node.staging().transfers() > 0 {
        assert!(Instant::now() < deadline, "idle transfers were never dropped");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.staging().bytes(), 0);
    assert_refused(call(&*a, &part(9, total, 100, &request[100..])), ErrorKind::BadRequest, "unknown");

    // Still serving: both raw connections and a client, small and large.
    assert_eq!(call(&*b, &Request::Get(b"parts".to_vec())), Reply::Value(Some(value(10_000, 1))));
    assert_eq!(call(&*a, &Request::Get(b"parts-b".to_vec())), Reply::Value(Some(value(10_000, 2))));
    assert_eq!(client.get(b"huge").unwrap().as_deref(), Some(&value_bytes[..]));
}
