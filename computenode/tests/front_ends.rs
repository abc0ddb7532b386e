//! The client library's attached and remote modes against a real computenode (in-process)
//! and a real memnode: every operation, many threads, and clear errors.

use std::time::Duration;

#[path = "../../client/tests/shared/expiry.rs"]
mod expiry_exercise;

use expiry_exercise::exercise_expiry;
use racekv_client::{Client, ClientError, Mode};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

fn node(m: &TestMemnode, dir: &std::path::Path) -> Computenode {
    Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        requirepass: Some(PASSWORD.into()),
        redis_addr: None,
        metrics_addr: None,
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        ..ComputenodeConfig::default()
    })
    .unwrap()
}

const PASSWORD: &str = "remote secret";

fn exercise(client: &Client) {
    client.put(b"a", b"1").unwrap();
    assert_eq!(client.get(b"a").unwrap().as_deref(), Some(&b"1"[..]));
    assert!(!client.insert(b"a", b"x").unwrap());
    assert!(client.update(b"a", b"2").unwrap());
    assert!(client.compare_and_swap(b"a", Some(b"2"), Some(b"3")).unwrap());
    assert!(!client.compare_and_swap(b"a", Some(b"2"), Some(b"4")).unwrap());
    assert!(client.delete(b"a").unwrap());
    assert_eq!(client.get(b"a").unwrap(), None);
    assert!(matches!(client.put(b"big", &vec![0u8; 20_000]), Err(ClientError::TooLarge { .. })));
    let pairs: Vec<(Vec<u8>, Vec<u8>)> =
        (0..5_000u32).map(|i| (format!("m{i}").into_bytes(), i.to_le_bytes().to_vec())).collect();
    let refs: Vec<(&[u8], &[u8])> = pairs.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    client.multi_put(&refs).unwrap();
    let keys: Vec<&[u8]> = pairs.iter().map(|(k, _)| &k[..]).chain([&b"missing"[..]]).collect();
    let values = client.multi_get(&keys).unwrap();
    assert_eq!(values.len(), 5_001);
    assert!(values[..5_000].iter().zip(&pairs).all(|(v, (_, want))| v.as_ref() == Some(want)));
    assert_eq!(values[5_000], None);
    std::thread::scope(|s| {
        for t in 0..8 {
            s.spawn(move || {
                for i in 0..300 {
                    let key = format!("t{t}-{i}");
                    client.put(key.as_bytes(), key.as_bytes()).unwrap();
                    assert_eq!(client.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
                }
            });
        }
    });
    assert_eq!(client.len().unwrap(), 5_000 + 8 * 300);
    assert_eq!(client.memnodes().len(), 1);
}

#[test]
fn remote_mode_runs_every_operation() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path());
    let addr = node.remote_endpoint().unwrap();
    let remote = addr.trim_start_matches("tcp:");
    let client = Client::builder().remote(remote).password(PASSWORD).connect().unwrap();
    assert_eq!(client.mode(), Mode::Remote);
    exercise(&client);
    exercise_expiry(&client);
    // A wrong password, the memnodes' token, or no password: refused with a clear error.
    for attempt in
        [Client::builder().password("wrong"), Client::builder().password(TestMemnode::TOKEN), Client::builder()]
    {
        let err = attempt.remote(remote).connect().err().unwrap();
        assert!(err.to_string().contains("could not prove it knows the token or password"), "{err}");
    }
    // The computenode going away is a retryable error, not a hang.
    drop(node);
    let err = (0..50).find_map(|_| {
        std::thread::sleep(Duration::from_millis(20));
        client.get(b"m1").err()
    });
    assert!(err.expect("calls kept succeeding after the computenode stopped").is_transient());
}

#[test]
fn attached_mode_reaches_the_daemons_socket() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let dir = tempfile::tempdir().unwrap();
    let node = node(&m, dir.path());
    let socket = node.status().attach_socket.expect("the daemon serves its attach socket");
    let client = Client::builder().attach(&socket).connect().unwrap();
    assert_eq!(client.mode(), Mode::Attached);
    exercise(&client);
    exercise_expiry(&client);
    assert_eq!(node.status().attached_clients, Some(1));
}
