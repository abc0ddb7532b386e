//! The computenode in-process against a real memnode on tcp (one test on shm): autoscaling,
//! overload, hybrid upgrade, attach.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use racekv_client::op::{ErrorKind, Reply, Request};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::queue::Submit;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_hashing::PutMode;
use racekv_transport::TransportKind;

fn memnode() -> TestMemnode {
    TestMemnode::start(Via::Transport(TransportKind::Tcp), 64 << 20, 64)
}

fn config(m: &TestMemnode) -> ComputenodeConfig {
    ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        redis_addr: None,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ..ComputenodeConfig::default()
    }
}

fn wait_until(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn workers_scale_up_under_load_and_retire_when_idle() {
    let m = memnode();
    let node = Computenode::start(ComputenodeConfig {
        min_workers: 1,
        max_workers: 8,
        scale_up_queue_depth: 4,
        scale_up_wait_us: 200,
        worker_idle_ms: 300,
        ..config(&m)
    })
    .unwrap();
    assert_eq!(node.status().workers, 1);
    // Idle long enough that the autoscaler stops ticking and sleeps: the burst must wake it.
    std::thread::sleep(Duration::from_millis(100));
    let (tx, rx) = mpsc::channel::<(u32, Reply)>();
    let peak = AtomicUsize::new(1);
    std::thread::scope(|s| {
        for p in 0..4u32 {
            let (node, tx) = (&node, tx.clone());
            s.spawn(move || {
                for i in 0..1_500u32 {
                    let id = p * 1_000_000 + i;
                    let key = format!("k{id}").into_bytes();
                    let tx = tx.clone();
                    let request = Request::Put { key: key.clone(), value: key, mode: PutMode::Upsert };
                    node.submit(request, Box::new(move |reply| tx.send((id, reply)).unwrap())).unwrap();
                }
            });
        }
        drop(tx);
        s.spawn(|| {
            let until = Instant::now() + Duration::from_secs(5);
            while Instant::now() < until && peak.load(Ordering::Relaxed) < 2 {
                peak.fetch_max(node.status().workers, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(200));
            }
        });
    });
    let mut seen = HashSet::new();
    for (id, reply) in rx {
        assert_eq!(reply, Reply::Done(true), "request {id}");
        assert!(seen.insert(id), "request {id} answered twice");
    }
    assert_eq!(seen.len(), 6_000, "every request answered exactly once");
    assert!(peak.load(Ordering::Relaxed) >= 2, "the autoscaler never added a worker");
    wait_until("idle workers retire to the minimum", Duration::from_secs(10), || node.status().workers == 1);
    // The writes landed.
    let mut s = node.attach();
    for id in [0u32, 1_000_499, 3_001_499] {
        let key = format!("k{id}");
        assert_eq!(s.get(key.as_bytes()).unwrap().as_deref(), Some(key.as_bytes()));
    }
}

#[test]
fn a_full_queue_refuses_instead_of_growing() {
    let m = memnode();
    let node = Arc::new(
        Computenode::start(ComputenodeConfig { min_workers: 1, max_workers: 1, queue_capacity: 8, ..config(&m) })
            .unwrap(),
    );
    let (tx, rx) = mpsc::channel::<u32>();
    let mut refused = 0;
    let mut accepted = 0;
    for i in 0..5_000u32 {
        let tx = tx.clone();
        let request = Request::MultiGet((0..64).map(|k| format!("missing-{i}-{k}").into_bytes()).collect());
        match node.submit(request, Box::new(move |_| tx.send(i).unwrap())) {
            Ok(()) => accepted += 1,
            Err(e) => {
                assert!(e.queued <= 8, "{e}");
                refused += 1;
            }
        }
    }
    drop(tx);
    let answered: HashSet<u32> = rx.iter().collect();
    assert!(refused > 0, "a queue of 8 took 5000 slow requests without refusing");
    assert_eq!(answered.len(), accepted, "accepted requests must each get one reply");
    // The front end's answer to a refusal is a typed overload error.
    assert_eq!(
        Reply::from_error(&racekv_client::ClientError::Overloaded("x".into())).clone(),
        Reply::Error(ErrorKind::Overloaded, "the computenode is overloaded: x".into())
    );
}

#[test]
fn a_hot_worker_is_upgraded_to_a_dedicated_connection_without_failing_an_operation() {
    let m = memnode();
    let node = Computenode::start(ComputenodeConfig { upgrade_ops_per_sec: 100, ..config(&m) }).unwrap();
    let mut s = node.attach();
    s.put(b"hot", b"1").unwrap();
    assert_eq!(s.shards().dedicated(), 0);
    let mut ops = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.shards().dedicated() == 0 {
        assert!(Instant::now() < deadline, "no upgrade after {ops} operations");
        assert_eq!(s.get(b"hot").unwrap().as_deref(), Some(&b"1"[..]), "operation {ops} failed during the upgrade");
        ops += 1;
    }
    for i in 0..200 {
        s.put(b"hot", format!("{i}").as_bytes()).unwrap();
    }
    assert_eq!(s.get(b"hot").unwrap().as_deref(), Some(&b"199"[..]));
    // Giving the session back drops the dedicated connection.
    drop(s);
    let s = node.attach();
    assert_eq!(s.shards().dedicated(), 0);
}

#[test]
fn a_hot_worker_on_shm_stays_on_the_pool() {
    // A dedicated shm connection would spare nothing (no lock or socket is shared) and cost
    // two threads and a fresh mapping of the region.
    let m = TestMemnode::start(Via::Transport(TransportKind::Shm), 64 << 20, 64);
    let node = Computenode::start(ComputenodeConfig { upgrade_ops_per_sec: 100, ..config(&m) }).unwrap();
    let mut s = node.attach();
    s.put(b"hot", b"1").unwrap();
    for _ in 0..20_000 {
        assert_eq!(s.get(b"hot").unwrap().as_deref(), Some(&b"1"[..]));
    }
    // Time for the background upgrader, had anything asked it.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.get(b"hot").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(s.shards().dedicated(), 0, "a shm virtual connection was upgraded");
}

#[test]
fn attach_hands_out_ready_sessions() {
    let m = memnode();
    let node = Computenode::start(ComputenodeConfig { ready_sessions: 4, ..config(&m) }).unwrap();
    wait_until("sessions are pre-initialized", Duration::from_secs(5), || node.status().ready_sessions == 4);
    let held: Vec<_> = (0..3).map(|_| node.attach()).collect();
    // The refiller tops the ready queue up again while those three are in use.
    wait_until("the ready queue is refilled", Duration::from_secs(5), || node.status().ready_sessions == 4);
    drop(held);
    let mut s = node.attach();
    s.put(b"a", b"b").unwrap();
    assert_eq!(s.len().unwrap(), 1);
}

#[test]
fn a_stopping_daemon_gives_its_heap_space_back() {
    // Prefetched chunks, the ready sessions' chunks, and the blocks its workers freed: a
    // daemon restarted after deleting its keys used to leave all of it allocated for good.
    let m = memnode();
    let before = m.kv_heap_used_bytes();
    for round in 0..3 {
        let node = Computenode::start(config(&m)).unwrap();
        let mut s = node.attach();
        for i in 0..500u32 {
            let key = format!("r{round}k{i}");
            s.put(key.as_bytes(), &[1u8; 900]).unwrap();
            s.put(key.as_bytes(), &[2u8; 900]).unwrap();
        }
        for i in 0..500u32 {
            assert!(s.delete(format!("r{round}k{i}").as_bytes()).unwrap());
        }
        drop(s);
        node.shutdown();
        assert_eq!(m.kv_heap_used_bytes(), before, "round {round}: the stopped daemon kept heap space");
    }
}
