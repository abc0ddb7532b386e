//! Attached clients doing everything a client does; timeouts, overload, limits, restarts.

use std::time::{Duration, Instant};

use racekv_client::{Client, ClientError, Mode, MAX_KV_BYTES};

use super::super::{AllowedUids, AttachOptions, AttachServer};
use super::{metric, wait_for, Harness};

/// A result reduced to what both modes must agree on: the value, or the error's kind.
fn outcome<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match r {
        Ok(v) => format!("ok {v:?}"),
        Err(e) => format!("err {:?}", std::mem::discriminant(&e)),
    }
}

#[test]
fn every_client_method_works_attached_on_the_same_table_as_embedded() {
    let h = Harness::start();
    let c = h.client();
    let embedded = h.embedded();
    assert_eq!(c.mode(), Mode::Attached);
    assert_eq!(c.attach_socket(), Some(h.socket.as_path()));
    assert_eq!(embedded.mode(), Mode::Embedded);
    assert!(c.is_empty().unwrap());

    c.put(b"alpha", b"1").unwrap();
    assert_eq!(c.get(b"alpha").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(embedded.get(b"alpha").unwrap().as_deref(), Some(&b"1"[..]), "the same table");
    assert!(!c.insert(b"alpha", b"2").unwrap());
    assert!(c.insert(b"beta", b"2").unwrap());
    assert!(c.update(b"beta", b"3").unwrap());
    assert!(!c.update(b"gamma", b"3").unwrap());
    assert!(c.compare_and_swap(b"beta", Some(b"3"), Some(b"4")).unwrap());
    assert!(!c.compare_and_swap(b"beta", Some(b"3"), Some(b"5")).unwrap());
    assert!(c.compare_and_swap(b"gamma", None, Some(b"g")).unwrap());
    assert!(c.compare_and_swap(b"gamma", Some(b"g"), None).unwrap());
    assert_eq!(c.get(b"gamma").unwrap(), None);
    assert!(c.delete(b"beta").unwrap());
    assert!(!c.delete(b"beta").unwrap());
    assert_eq!(c.get(b"beta").unwrap(), None);

    // Many keys: several chunks, pipelined.
    let keys: Vec<Vec<u8>> = (0..3000u32).map(|i| format!("key-{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> =
        (0..3000u32).map(|i| format!("value-{i}-{}", "x".repeat(i as usize % 200)).into_bytes()).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
    c.multi_put(&pairs).unwrap();
    let mut asked: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    asked.push(b"missing");
    let got = c.multi_get(&asked).unwrap();
    assert_eq!(got.len(), 3001);
    for (i, v) in got.iter().take(3000).enumerate() {
        assert_eq!(v.as_deref(), Some(values[i].as_slice()), "key {i}");
    }
    assert_eq!(got[3000], None);
    // Item counts trail by the last operation of each worker's session.
    let n = c.len().unwrap();
    assert!((2999..=3001).contains(&n), "alpha and the 3000: {n}");

    // Replies larger than a slot: the client splits the request and asks again.
    let big = vec![7u8; 12_000];
    let big_keys: Vec<Vec<u8>> = (0..40u32).map(|i| format!("big-{i}").into_bytes()).collect();
    for k in &big_keys {
        c.put(k, &big).unwrap();
    }
    let asked: Vec<&[u8]> = big_keys.iter().map(Vec::as_slice).collect();
    assert!(c.multi_get(&asked).unwrap().iter().all(|v| v.as_deref() == Some(big.as_slice())));

    // The largest block value fits; larger ones go to an extent, and past a ring slot they
    // travel in parts (requests) and are staged and fetched in parts (replies).
    let max = vec![1u8; MAX_KV_BYTES - 3];
    c.put(b"max", &max).unwrap();
    assert_eq!(c.get(b"max").unwrap(), Some(max));
    for value_len in [MAX_KV_BYTES - 2, 40_000, 100_000] {
        let value: Vec<u8> = (0..value_len).map(|i| i as u8).collect();
        c.put(b"max", &value).unwrap();
        assert_eq!(c.get(b"max").unwrap().as_deref(), Some(&value[..]));
        assert_eq!(embedded.get(b"max").unwrap().as_deref(), Some(&value[..]));
    }
    let value = vec![3u8; 100_000];
    embedded.put(b"max", &value).unwrap();
    assert_eq!(c.get(b"max").unwrap().as_deref(), Some(&value[..]), "written embedded, read attached");
    let over = vec![0u8; racekv_client::op::MAX_VALUE_BYTES + 1];
    assert!(matches!(c.put(b"max", &over), Err(ClientError::TooLarge { key: 3, .. })));
    assert!(matches!(c.put(b"", b"v"), Err(ClientError::EmptyKey)));
    assert_eq!(outcome(c.get(b"")), outcome(embedded.get(b"")));
    assert_eq!(outcome(c.delete(b"")), outcome(embedded.delete(b"")));
    let long_key = vec![1u8; 100_000];
    assert_eq!(outcome(c.get(&long_key)), outcome(embedded.get(&long_key)));
    assert!(!c.compare_and_swap(b"alpha", Some(&vec![0u8; 70_000]), Some(b"x")).unwrap());

    let stats = c.stats();
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].0, h.memnode.endpoint().unwrap().to_string());
    assert!(stats[0].1.as_ref().unwrap().items >= 3000);
    assert_eq!(c.memnodes(), embedded.memnodes());
}

#[test]
fn threads_share_one_attached_client() {
    let h = Harness::start();
    let c = h.client();
    std::thread::scope(|s| {
        for t in 0..8 {
            let c = c.clone();
            s.spawn(move || {
                for i in 0..100 {
                    let key = format!("t{t}-{i}");
                    c.put(key.as_bytes(), key.as_bytes()).unwrap();
                    assert_eq!(c.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
                }
            });
        }
    });
    let n = c.len().unwrap();
    assert!((798..=800).contains(&n), "{n}");
}

#[test]
fn a_request_without_a_reply_times_out_and_its_slot_comes_back_later() {
    let options = AttachOptions { slots: 4, slot_bytes: 40 << 10, ..AttachOptions::default() };
    let mut h = Harness::with(64, 0, options);
    let c = h.client_with_timeout(Duration::from_millis(150));
    // No workers: nobody answers. More timeouts than slots: each abandons its slot...
    for _ in 0..4 {
        let started = Instant::now();
        let err = c.get(b"k").unwrap_err();
        assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(140));
        assert!(err.is_transient());
    }
    // ...so with every slot abandoned, a fifth call finds none free and times out too.
    assert!(matches!(c.get(b"k"), Err(ClientError::Timeout { .. })));
    // Once the daemon answers, the abandoned slots come back.
    h.start_workers(1);
    wait_for(Duration::from_secs(10), || c.put(b"k", b"v").is_ok()).expect("slots came back");
    for i in 0..20 {
        c.put(format!("k{i}").as_bytes(), b"v").unwrap();
    }
}

#[test]
fn a_full_queue_answers_overloaded_not_a_hang() {
    let mut h = Harness::with(1, 0, AttachOptions::default());
    let c = h.client_with_timeout(Duration::from_secs(10));
    let before = metric("racekv_attach_requests_total{result=\"overloaded\"}");
    let blocked = {
        let c = c.clone();
        std::thread::spawn(move || c.put(b"first", b"1"))
    };
    // The first request fills the one-place queue (no workers); the next is refused.
    wait_for(Duration::from_secs(5), || h.queue.depth() == 1).expect("the first request is queued");
    let started = Instant::now();
    let err = c.get(b"second").unwrap_err();
    assert!(matches!(err, ClientError::Overloaded(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "refused at once");
    assert!(metric("racekv_attach_requests_total{result=\"overloaded\"}") > before);
    h.start_workers(1);
    blocked.join().unwrap().unwrap();
    assert_eq!(c.get(b"first").unwrap().as_deref(), Some(&b"1"[..]));
}

#[test]
fn clients_beyond_the_limit_are_refused_as_overloaded() {
    let h = Harness::with(64, 1, AttachOptions { max_clients: 2, ..AttachOptions::default() });
    let a = h.client();
    let b = h.client();
    h.wait_attached(2);
    let err = Client::builder().attach(&h.socket).connect().err().unwrap();
    assert!(matches!(err, ClientError::Overloaded(ref m) if m.contains("maximum of 2")), "{err:?}");
    drop(a);
    h.wait_attached(1);
    let c = h.client();
    c.put(b"k", b"v").unwrap();
    assert_eq!(b.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
}

#[test]
fn dropped_clients_detach_and_clients_survive_a_daemon_restart() {
    let mut h = Harness::start();
    let before = metric("racekv_attach_detaches_total{reason=\"closed\"}");
    let c = h.client();
    c.put(b"k", b"v").unwrap();
    h.wait_attached(1);
    drop(c);
    h.wait_attached(0);
    assert!(metric("racekv_attach_detaches_total{reason=\"closed\"}") > before);

    let c = h.client();
    c.put(b"k", b"v2").unwrap();
    h.server.shutdown();
    assert!(!h.socket.exists(), "the socket file is removed");
    let err = c.get(b"k").unwrap_err();
    assert!(matches!(&err, ClientError::Unavailable { reason, .. } if reason.contains("shutting down")), "{err:?}");
    assert!(err.is_transient());
    // A new daemon on the same socket: the client attaches again by itself.
    h.server = AttachServer::start(&h.socket, std::sync::Arc::clone(&h.queue) as _, AttachOptions::default()).unwrap();
    wait_for(Duration::from_secs(5), || c.get(b"k").is_ok()).expect("re-attached");
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v2"[..]));
}

#[test]
fn a_live_socket_is_not_taken_over_and_a_stale_one_is() {
    let h = Harness::start();
    let err =
        AttachServer::start(&h.socket, std::sync::Arc::clone(&h.queue) as _, AttachOptions::default()).err().unwrap();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    let stale = h._dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let server = AttachServer::start(&stale, std::sync::Arc::clone(&h.queue) as _, AttachOptions::default()).unwrap();
    Client::builder().attach(&stale).connect().unwrap().put(b"k", b"v").unwrap();
    drop(server);
}

fn with_users(trust_uid: bool) -> Harness {
    let options = racekv_redis::acl::AclOptions { requirepass: Some("s3cret".into()), file: None };
    let acl = std::sync::Arc::new(racekv_redis::acl::Acl::new(racekv_redis::commands::catalog(), options).unwrap());
    acl.set_user(b"reader", &[b"on", b">reader-pw", b"+@read", b"~*"]).unwrap();
    let auth = crate::attach::AttachAuth { acl, trust_uid };
    Harness::with(64, 1, AttachOptions { auth: Some(auth), ..AttachOptions::default() })
}

#[test]
fn attaching_takes_the_acl_users_credentials() {
    let h = with_users(false);
    let before = metric("racekv_attach_refused_total{reason=\"credentials\"}");
    let refused = |b: racekv_client::ClientBuilder| b.attach(&h.socket).connect().err().unwrap();
    for attempt in [Client::builder(), Client::builder().password("wrong"), Client::builder().user("reader")] {
        let err = refused(attempt);
        assert!(matches!(&err, ClientError::Denied(_)), "{err:?}");
    }
    assert!(metric("racekv_attach_refused_total{reason=\"credentials\"}") >= before + 3.0);
    let admin = Client::builder().attach(&h.socket).password("s3cret").connect().unwrap();
    admin.put(b"k", b"v").unwrap();
    let reader = Client::builder().attach(&h.socket).user("reader").password("reader-pw").connect().unwrap();
    assert_eq!(reader.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    let denied = reader.put(b"k", b"w").unwrap_err();
    assert!(matches!(&denied, ClientError::Denied(m) if m.contains("NOPERM")), "{denied:?}");
    assert!(matches!(reader.delete(b"k"), Err(ClientError::Denied(_))));
    assert_eq!(admin.get(b"k").unwrap().as_deref(), Some(&b"v"[..]), "the denied writes did nothing");
}

#[test]
fn a_trusted_uid_attaches_as_default_without_credentials() {
    let h = with_users(true);
    let c = Client::builder().attach(&h.socket).connect().unwrap();
    c.put(b"k", b"v").unwrap();
    // Credentials, when given, still have to be right.
    assert!(Client::builder().attach(&h.socket).password("wrong").connect().is_err());
}

#[test]
fn the_socket_is_private_to_the_user_by_default() {
    use std::os::unix::fs::PermissionsExt;
    let h = Harness::start();
    let mode = std::fs::metadata(&h.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let dir_mode = std::fs::metadata(h.socket.parent().unwrap()).unwrap().permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700);
    let open = Harness::with(64, 1, AttachOptions { allowed_uids: AllowedUids::Any, ..AttachOptions::default() });
    assert_eq!(std::fs::metadata(&open.socket).unwrap().permissions().mode() & 0o777, 0o666);
}

#[test]
fn uid_policy() {
    use super::super::server::uid_allowed;
    assert!(uid_allowed(1000, 1000, &AllowedUids::SameUser));
    assert!(uid_allowed(0, 1000, &AllowedUids::SameUser), "root");
    assert!(!uid_allowed(1001, 1000, &AllowedUids::SameUser));
    assert!(uid_allowed(1001, 1000, &AllowedUids::Listed(vec![1001])));
    assert!(!uid_allowed(1002, 1000, &AllowedUids::Listed(vec![1001])));
    assert!(uid_allowed(1002, 1000, &AllowedUids::Any));
}

#[test]
fn bad_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let queue = std::sync::Arc::new(crate::queue::WorkQueue::new(1));
    for options in [
        AttachOptions { slot_bytes: 4096, ..AttachOptions::default() },
        AttachOptions { slots: 0, ..AttachOptions::default() },
        AttachOptions { reply_budget_bytes: 1000, ..AttachOptions::default() },
        AttachOptions { max_clients: 0, ..AttachOptions::default() },
    ] {
        let err = AttachServer::start(dir.path().join("s.sock"), queue.clone() as _, options).err().unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    }
}

#[test]
fn metrics_are_exported() {
    let h = Harness::start();
    let c = h.client();
    c.put(b"k", b"v").unwrap();
    c.get(b"k").unwrap();
    let text = racekv_telemetry::render();
    for name in [
        "racekv_attach_clients",
        "racekv_attach_attaches_total",
        "racekv_attach_requests_total{result=\"ok\"}",
        "racekv_attach_ring_wait_seconds_bucket{le=\"0.000001\"}",
        "racekv_attach_request_duration_seconds_bucket",
        "racekv_attach_requests_in_flight",
    ] {
        assert!(text.contains(name), "{name} missing");
    }
    assert!(metric("racekv_attach_attaches_total") >= 1.0);
}
