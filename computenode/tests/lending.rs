//! Lent connections (KRCORE's borrowed connections): an attached client that asks runs key
//! operations itself on connections the computenode dialed for it, over two real shm
//! memnodes; what it writes, Redis reads and the other way round; the computenode's ring
//! carries none of them. The policy: a restricted user, `attach_lend = false` and a
//! maxmemory set are refused, and setting maxmemory later takes the lending back.

use std::time::{Duration, Instant};

use racekv_client::Client;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

/// The tests count on process-wide metrics: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn memnodes() -> Vec<TestMemnode> {
    (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64)).collect()
}

fn computenode(
    memnodes: &[TestMemnode],
    dir: &std::path::Path,
    tweak: impl FnOnce(&mut ComputenodeConfig),
) -> Computenode {
    let mut config = ComputenodeConfig {
        memnodes: memnodes.iter().map(|m| m.endpoint().unwrap().to_string()).collect(),
        token: TestMemnode::TOKEN.into(),
        redis_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        metrics_addr: None,
        remote_addr: None,
        ..ComputenodeConfig::default()
    };
    tweak(&mut config);
    Computenode::start(config).unwrap()
}

fn borrower(dir: &std::path::Path) -> Client {
    Client::builder().attach(dir.join("computenode.sock")).borrow_connections(true).connect().unwrap()
}

/// What the attach front end counted: (requests taken off rings, lendings by outcome).
fn counted(outcome: &str) -> (u64, u64) {
    let families = prometheus::gather();
    let value = |name: &str, label: Option<(&str, &str)>| -> u64 {
        families
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .filter(|m| label.is_none_or(|(k, v)| m.get_label().iter().any(|l| l.name() == k && l.value() == v)))
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    };
    (value("racekv_attach_requests_total", None), value("racekv_attach_lendings_total", Some(("outcome", outcome))))
}

#[test]
fn a_borrowing_client_runs_key_operations_itself() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let memnodes = memnodes();
    let dir = tempfile::tempdir().unwrap();
    let node = computenode(&memnodes, dir.path(), |_| {});
    let mut redis =
        redis::Client::open(format!("redis://{}/", node.redis_addr().unwrap())).unwrap().get_connection().unwrap();
    let (_, lent_before) = counted("lent");
    let client = borrower(dir.path());
    assert!(client.is_direct(), "the default user on shm memnodes is lent connections");
    assert_eq!(client.mode(), racekv_client::Mode::Attached);
    let (ring_before, lent_after) = counted("lent");
    assert_eq!(lent_after, lent_before + 1);

    for i in 0..500 {
        client.put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes()).unwrap();
    }
    let big = vec![7u8; 300 << 10];
    client.put(b"big", &big).unwrap();
    assert!(client.insert(b"k0", b"again").is_ok_and(|applied| !applied));
    assert!(client.delete(b"k1").unwrap());
    let _: () = redis::cmd("SET").arg("from-redis").arg("hello").query(&mut redis).unwrap();
    assert_eq!(client.get(b"from-redis").unwrap().as_deref(), Some(&b"hello"[..]));
    let keys: Vec<&[u8]> = vec![b"k2", b"k1", b"k499"];
    assert_eq!(client.multi_get(&keys).unwrap(), vec![Some(b"v2".to_vec()), None, Some(b"v499".to_vec())]);
    client
        .transaction(|tx| {
            let v = tx.get(b"k3")?.unwrap_or_default();
            tx.put(b"k3", &[v.as_slice(), b"+tx"].concat());
            Ok(())
        })
        .unwrap();
    let (ring_after, _) = counted("lent");
    assert_eq!(ring_after, ring_before, "key operations of a borrowing client never cross the ring");

    // Redis and a client on the ring see what the borrower wrote.
    for i in [0, 2, 250, 499] {
        let got: Option<String> = redis::cmd("GET").arg(format!("k{i}")).query(&mut redis).unwrap();
        assert_eq!(got.as_deref(), Some(format!("v{i}").as_str()));
    }
    let got: Option<String> = redis::cmd("GET").arg("k3").query(&mut redis).unwrap();
    assert_eq!(got.as_deref(), Some("v3+tx"));
    let ring_client = Client::builder().attach(dir.path().join("computenode.sock")).connect().unwrap();
    assert!(!ring_client.is_direct());
    assert_eq!(ring_client.get(b"big").unwrap().as_deref(), Some(&big[..]));
    assert_eq!(ring_client.get(b"k1").unwrap(), None);
    // Many threads share the lent connections.
    std::thread::scope(|s| {
        for t in 0..4 {
            let client = client.clone();
            s.spawn(move || {
                for i in 0..200 {
                    let key = format!("t{t}-{i}");
                    client.put(key.as_bytes(), key.as_bytes()).unwrap();
                    assert_eq!(client.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
                }
            });
        }
    });
    let dbsize: u64 = redis::cmd("DBSIZE").query(&mut redis).unwrap();
    assert_eq!(dbsize, 499 + 1 + 1 + 800, "500 keys less one deleted, big, from-redis, 4 x 200");
}

#[test]
fn lending_follows_the_policy_and_is_taken_back() {
    let _serial = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let memnodes = memnodes();
    let dir = tempfile::tempdir().unwrap();
    let node = computenode(&memnodes, dir.path(), |c| c.requirepass = Some("pw".into()));
    let mut redis =
        redis::Client::open(format!("redis://:pw@{}/", node.redis_addr().unwrap())).unwrap().get_connection().unwrap();
    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "app", "on", ">app-pw", "~app:*", "+@all"]).query(&mut redis).unwrap();
    let socket = dir.path().join("computenode.sock");
    let (_, refused_before) = counted("refused");
    let restricted =
        Client::builder().attach(&socket).user("app").password("app-pw").borrow_connections(true).connect().unwrap();
    assert!(!restricted.is_direct(), "a user limited to some keys is not lent raw connections");
    restricted.put(b"app:1", b"through the ring").unwrap();
    assert!(restricted.put(b"other", b"x").is_err(), "and its ACL still applies");
    assert_eq!(counted("refused").1, refused_before + 1);

    let full = Client::builder().attach(&socket).password("pw").borrow_connections(true).connect().unwrap();
    assert!(full.is_direct());
    assert_eq!(full.get(b"app:1").unwrap().as_deref(), Some(&b"through the ring"[..]));
    // Cache mode needs every write to pass the daemon: the lending is taken back.
    let _: () = redis::cmd("CONFIG").arg(&["SET", "maxmemory", "50mb"]).query(&mut redis).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while full.is_direct() {
        assert!(Instant::now() < deadline, "the lending was not taken back");
        std::thread::sleep(Duration::from_millis(50));
    }
    full.put(b"after", b"ring").unwrap();
    assert_eq!(full.get(b"after").unwrap().as_deref(), Some(&b"ring"[..]));
    let again = Client::builder().attach(&socket).password("pw").borrow_connections(true).connect().unwrap();
    assert!(!again.is_direct(), "nothing is lent while maxmemory is set");
    drop(node);

    let dir = tempfile::tempdir().unwrap();
    let _off = computenode(&memnodes, dir.path(), |c| c.attach_lend = false);
    assert!(!borrower(dir.path()).is_direct(), "attach_lend = false lends nothing");
}
