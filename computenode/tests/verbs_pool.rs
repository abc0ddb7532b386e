//! The computenode's pool over verbs (runs in the Soft-RoCE VM, ops/vm): a queue pair that
//! goes to the error state fails only what was on it, is replaced in the background, and
//! the pool keeps serving meanwhile.
#![cfg(feature = "rdma")]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use racekv_client::ClientError;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::{TransportError, TransportKind};

#[test]
fn a_broken_queue_pair_is_replaced_while_the_pool_keeps_serving() {
    let m = TestMemnode::start(Via::Transport(TransportKind::Verbs), 64 << 20, 64);
    let node = Computenode::start(ComputenodeConfig {
        memnodes: vec![m.endpoint().unwrap().to_string()],
        token: TestMemnode::TOKEN.into(),
        connections_per_memnode: 4,
        redis_addr: None,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        upgrade_ops_per_sec: 0,
        ..ComputenodeConfig::default()
    })
    .unwrap();
    let pool = std::sync::Arc::clone(&node.cluster().memnodes()[0].pool);
    assert_eq!(pool.healthy(), 4);
    let stop = AtomicBool::new(false);
    let (done, lost) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for w in 0..4u32 {
            let (node, stop, done, lost) = (&node, &stop, &done, &lost);
            s.spawn(move || {
                let mut session = node.attach();
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("w{w}-{}", i % 64);
                    match session.put(key.as_bytes(), &i.to_le_bytes()).and_then(|_| session.get(key.as_bytes())) {
                        Ok(_) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        // Operations that were on the broken queue pair fail, clearly.
                        Err(e @ (ClientError::Unavailable { .. } | ClientError::Timeout { .. })) => {
                            assert!(e.to_string().contains("connection"), "unclear error: {e}");
                            lost.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("unexpected error: {e}"),
                    }
                    i += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        let before = done.load(Ordering::Relaxed);
        // An access outside the memory region: the NIC moves the queue pair to the error state.
        match pool.inject_fault(0) {
            Err(TransportError::ConnectionLost { reason, .. }) => {
                assert!(
                    reason.contains("REM_ACCESS_ERR") || reason.contains("remote access"),
                    "unclear reason: {reason}"
                )
            }
            other => panic!("an access outside the region must break the queue pair, got {other:?}"),
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while pool.healthy() < 4 {
            assert!(Instant::now() < deadline, "the broken queue pair was never replaced");
            std::thread::sleep(Duration::from_millis(10));
        }
        let replaced_at = done.load(Ordering::Relaxed);
        assert!(replaced_at > before, "the pool stopped serving while a queue pair was broken");
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        assert!(done.load(Ordering::Relaxed) > replaced_at, "the pool did not keep serving after the replacement");
    });
    eprintln!(
        "operations: {} done, {} failed with the broken queue pair",
        done.load(Ordering::Relaxed),
        lost.load(Ordering::Relaxed)
    );
}
