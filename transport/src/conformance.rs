//! The conformance suite every backend must pass (shm, tcp, and verbs in the Soft-RoCE VM).
//!
//! The verbs fixture (feature `rdma`) needs an RDMA device: without one its tests fail with
//! the "no RDMA device found" error, on purpose, rather than pass without testing anything.
//! Run them in the VM (`ops/vm/run-cargo-tests.sh`).
//!
//! A backend provides a [`Fixture`]: something that serves a fresh zeroed region with the
//! [`TestRpc`] service and hands out connections to it. [`conformance_suite!`] then expands
//! to one `#[test]` per case, so a failure names the backend and the case.
//!
//! The cases: data round trips (aligned and not), ordering within a batch, CAS and FAA
//! semantics, CAS/FAA atomicity under contention from many threads (also a CAS spin lock
//! guarding a READ-modify-WRITE counter), bounds/alignment/length errors that reject the batch
//! whole without harming the connection, large reads, many threads sharing one connection,
//! RPC round trips and errors, and connection loss failing fast.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::error::{OpError, RpcStatus, TransportError};
use crate::{Batch, Connection, Outcome, MAX_BATCH_OPS, MAX_OP_BYTES};

/// A backend under test.
pub trait Fixture: Sync {
    /// Serves a fresh, zeroed region of `region_len` bytes with [`TestRpc`] as its service.
    fn serve(&self, region_len: u64) -> Box<dyn Served>;
}

/// A served region.
pub trait Served: Send + Sync {
    /// A new connection to the region.
    fn connect(&self) -> Arc<dyn Connection>;
    /// Stops the serving side abruptly (as if its process died).
    fn kill(&mut self);
}

/// RPC methods of the test service.
pub mod rpc {
    /// Returns the request unchanged.
    pub const ECHO: u16 = 1;
    /// Always fails with `RpcStatus::FAILED` and the request as message.
    pub const FAIL: u16 = 2;
    /// Sleeps 20 ms, then echoes.
    pub const SLOW_ECHO: u16 = 3;
}

/// The RPC service fixtures serve.
pub struct TestRpc;

impl crate::RpcService for TestRpc {
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        match method {
            rpc::ECHO => Ok(request.to_vec()),
            rpc::FAIL => Err(RpcStatus::new(RpcStatus::FAILED, String::from_utf8_lossy(request))),
            rpc::SLOW_ECHO => {
                std::thread::sleep(Duration::from_millis(20));
                Ok(request.to_vec())
            }
            other => Err(RpcStatus::new(RpcStatus::UNKNOWN_METHOD, format!("no method {other}"))),
        }
    }
}

const REGION: u64 = 1 << 20;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

/// A READ returns what a WRITE put there, at assorted offsets and lengths.
pub fn data_round_trips(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    assert_eq!(conn.region_len(), REGION);
    for (offset, len) in [(0u64, 8usize), (8, 1), (13, 5), (100, 1000), (4093, 7), (REGION - 3, 3), (64, 4096)] {
        let data = pattern(offset, len);
        let mut b = Batch::new();
        b.write(offset, &data);
        conn.execute(&mut b).unwrap();
        let mut b = Batch::new();
        let r = b.read(offset, len as u32);
        conn.execute(&mut b).unwrap();
        assert_eq!(b.read_result(r).unwrap(), &data[..], "offset {offset} len {len}");
    }
    // Unaligned writes leave their neighbours alone.
    let mut b = Batch::new();
    b.write(2048, &[0xAA; 16]);
    b.write(2051, &[0x11, 0x22]);
    let r = b.read(2048, 16);
    conn.execute(&mut b).unwrap();
    let mut expect = [0xAAu8; 16];
    expect[3] = 0x11;
    expect[4] = 0x22;
    assert_eq!(b.read_result(r).unwrap(), &expect);
}

/// The ops of one batch take effect in order.
pub fn ordering_within_a_batch(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    let mut b = Batch::new();
    b.write(64, &5u64.to_le_bytes());
    let r1 = b.read(64, 8);
    let c1 = b.cas(64, 5, 9);
    let r2 = b.read(64, 8);
    let c2 = b.cas(64, 5, 11); // fails: the word is 9 now
    let a = b.faa(64, 100);
    let r3 = b.read(64, 8);
    b.write(72, &[1, 2, 3]);
    let r4 = b.read(70, 6);
    conn.execute(&mut b).unwrap();
    assert_eq!(b.read_result(r1).unwrap(), &5u64.to_le_bytes());
    assert_eq!(b.result(c1).unwrap(), 5);
    assert!(b.cas_succeeded(c1).unwrap());
    assert_eq!(b.read_result(r2).unwrap(), &9u64.to_le_bytes());
    assert_eq!(b.result(c2).unwrap(), 9);
    assert!(!b.cas_succeeded(c2).unwrap());
    assert_eq!(b.result(a).unwrap(), 9);
    assert_eq!(b.read_result(r3).unwrap(), &109u64.to_le_bytes());
    assert_eq!(b.read_result(r4).unwrap(), &[0, 0, 1, 2, 3, 0]);
    // Every op got its own completion.
    assert!(b.ops().iter().all(|op| matches!(op.outcome, Outcome::Done(_))));
}

/// FAA wraps around at 2^64.
pub fn faa_wraps(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    let mut b = Batch::new();
    b.write(0, &u64::MAX.to_le_bytes());
    let a = b.faa(0, 2);
    let r = b.read(0, 8);
    conn.execute(&mut b).unwrap();
    assert_eq!(b.result(a).unwrap(), u64::MAX);
    assert_eq!(b.read_result(r).unwrap(), &1u64.to_le_bytes());
}

const THREADS: usize = 8;

/// Runs `body(thread, connection)` on [`THREADS`] threads, each with its own connection,
/// started together.
fn on_threads(served: &dyn Served, body: impl Fn(usize, &dyn Connection) + Sync) {
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let conn = served.connect();
            let (barrier, body) = (&barrier, &body);
            s.spawn(move || {
                barrier.wait();
                body(t, &*conn);
            });
        }
    });
}

fn read_u64(conn: &dyn Connection, offset: u64) -> u64 {
    let mut b = Batch::new();
    let r = b.read(offset, 8);
    conn.execute(&mut b).unwrap();
    u64::from_le_bytes(b.read_result(r).unwrap().try_into().unwrap())
}

/// Concurrent CAS increments from many threads lose no update.
pub fn cas_is_atomic_under_contention(f: &dyn Fixture) {
    let served = f.serve(REGION);
    const PER_THREAD: u64 = 300;
    on_threads(&*served, |_, conn| {
        let mut done = 0;
        let mut guess = 0;
        while done < PER_THREAD {
            let mut b = Batch::new();
            let c = b.cas(128, guess, guess + 1);
            conn.execute(&mut b).unwrap();
            let old = b.result(c).unwrap();
            if old == guess {
                done += 1;
                guess += 1;
            } else {
                guess = old;
            }
        }
    });
    assert_eq!(read_u64(&*served.connect(), 128), THREADS as u64 * PER_THREAD);
}

/// Concurrent FAAs from many threads lose no update.
pub fn faa_is_atomic_under_contention(f: &dyn Fixture) {
    let served = f.serve(REGION);
    const PER_THREAD: u64 = 500;
    on_threads(&*served, |t, conn| {
        let mut seen = Vec::with_capacity(PER_THREAD as usize);
        for _ in 0..PER_THREAD {
            let mut b = Batch::new();
            let a = b.faa(256, 1);
            conn.execute(&mut b).unwrap();
            seen.push(b.result(a).unwrap());
        }
        // Each FAA saw a distinct old value, increasing within one thread.
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "thread {t} saw non-increasing values");
    });
    assert_eq!(read_u64(&*served.connect(), 256), THREADS as u64 * PER_THREAD);
}

/// A CAS spin lock around a READ, then WRITE, of a counter: only atomic CAS plus ordering
/// within batches keeps the count exact.
pub fn cas_lock_protects_read_modify_write(f: &dyn Fixture) {
    let served = f.serve(REGION);
    const PER_THREAD: u64 = 100;
    const LOCK: u64 = 512;
    const COUNTER: u64 = 520;
    on_threads(&*served, |t, conn| {
        let me = t as u64 + 1;
        for _ in 0..PER_THREAD {
            loop {
                let mut b = Batch::new();
                let c = b.cas(LOCK, 0, me);
                let r = b.read(COUNTER, 8);
                conn.execute(&mut b).unwrap();
                if b.cas_succeeded(c).unwrap() {
                    let value = u64::from_le_bytes(b.read_result(r).unwrap().try_into().unwrap());
                    let mut b = Batch::new();
                    b.write(COUNTER, &(value + 1).to_le_bytes());
                    let unlock = b.cas(LOCK, me, 0);
                    conn.execute(&mut b).unwrap();
                    assert!(b.cas_succeeded(unlock).unwrap(), "lock stolen from thread {t}");
                    break;
                }
                std::thread::yield_now();
            }
        }
    });
    assert_eq!(read_u64(&*served.connect(), COUNTER), THREADS as u64 * PER_THREAD);
}

/// A bad op fails with its own error, and only the ops after it go unexecuted.
pub fn bad_ops_fail_alone(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    /// Adds one bad op to a batch; says whether an error is the expected one.
    type Case = (Box<dyn Fn(&mut Batch)>, fn(&OpError) -> bool);
    let cases: Vec<Case> = vec![
        (
            Box::new(|b| {
                b.read(REGION - 4, 8);
            }),
            |e| matches!(e, OpError::OutOfBounds { .. }),
        ),
        (
            Box::new(|b| {
                b.write(REGION, &[1]);
            }),
            |e| matches!(e, OpError::OutOfBounds { .. }),
        ),
        (
            Box::new(|b| {
                b.read(u64::MAX - 2, 8);
            }),
            |e| matches!(e, OpError::OutOfBounds { .. }),
        ),
        (
            Box::new(|b| {
                b.cas(12, 0, 1);
            }),
            |e| matches!(e, OpError::Misaligned { .. }),
        ),
        (
            Box::new(|b| {
                b.faa(REGION, 1);
            }),
            |e| matches!(e, OpError::OutOfBounds { .. }),
        ),
        (
            Box::new(|b| {
                b.faa(3, 1);
            }),
            |e| matches!(e, OpError::Misaligned { .. }),
        ),
        (
            Box::new(|b| {
                b.read(0, 0);
            }),
            |e| matches!(e, OpError::BadLength { .. }),
        ),
    ];
    for (i, (bad, is_expected)) in cases.iter().enumerate() {
        let mut b = Batch::new();
        let before = b.write(1024, &(i as u64 + 1).to_le_bytes());
        bad(&mut b);
        let after = b.faa(1024, 1000);
        match conn.execute(&mut b) {
            Err(TransportError::Op { index: 1, error }) => {
                assert!(is_expected(&error), "case {i}: {error}")
            }
            other => panic!("case {i}: expected op 1 to fail, got {other:?}"),
        }
        // A batch with an invalid op is rejected whole: neither neighbour ran.
        assert_eq!(b.result(before), Err(OpError::NotExecuted), "case {i}");
        assert_eq!(b.result(after), Err(OpError::NotExecuted), "case {i}");
        assert_eq!(read_u64(&*conn, 1024), 0, "case {i}: part of a rejected batch reached the region");
        assert!(conn.is_healthy(), "case {i}: connection unhealthy after a bad op");
    }
}

/// Batches over the op-count and byte limits are refused before anything is sent.
pub fn batch_limits_are_enforced(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    let mut b = Batch::new();
    assert!(matches!(conn.execute(&mut b), Err(TransportError::InvalidBatch(_))), "empty batch");
    for _ in 0..=MAX_BATCH_OPS {
        b.faa(0, 1);
    }
    assert!(matches!(conn.execute(&mut b), Err(TransportError::InvalidBatch(_))), "too many ops");
    b.clear();
    for i in 0..MAX_BATCH_OPS {
        b.faa(0, i as u64);
    }
    conn.execute(&mut b).unwrap();
    assert!(conn.is_healthy());
}

/// A READ of the largest op length returns every byte.
pub fn large_reads(f: &dyn Fixture) {
    let len = 16u64 << 20;
    let served = f.serve(len + (1 << 20));
    let conn = served.connect();
    let data = pattern(99, 1 << 20);
    for chunk in 0..16u64 {
        let mut b = Batch::new();
        b.write(chunk << 20, &data);
        conn.execute(&mut b).unwrap();
    }
    let mut b = Batch::new();
    let big = b.read(0, MAX_OP_BYTES as u32);
    conn.execute(&mut b).unwrap();
    let got = b.read_result(big).unwrap();
    assert_eq!(got.len(), MAX_OP_BYTES as usize);
    for chunk in got.chunks(1 << 20) {
        assert_eq!(chunk, &data[..]);
    }
    // Many mid-sized reads in one batch, up to the byte limit.
    let mut b = Batch::new();
    let ids: Vec<_> = (0..64).map(|i| b.read(i * 4096, 256 * 1024)).collect();
    conn.execute(&mut b).unwrap();
    for (i, id) in ids.into_iter().enumerate() {
        let start = (i * 4096) % (1 << 20);
        let got = b.read_result(id).unwrap();
        assert_eq!(got[0], data[start], "read {i}");
    }
}

/// Threads sharing one connection each see their own results.
pub fn threads_share_one_connection(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (conn, barrier) = (&conn, &barrier);
            s.spawn(move || {
                barrier.wait();
                for round in 0..200u64 {
                    let offset = 4096 + t as u64 * 4096;
                    let data = pattern(round * 100 + t as u64, 48);
                    let mut b = Batch::new();
                    b.write(offset, &data);
                    let r = b.read(offset, 48);
                    let c = b.faa(8, 1);
                    conn.execute(&mut b).unwrap();
                    assert_eq!(b.read_result(r).unwrap(), &data[..], "thread {t} round {round} got another's bytes");
                    b.result(c).unwrap();
                    if round % 50 == 0 {
                        let reply = conn.call(rpc::ECHO, &data).unwrap();
                        assert_eq!(reply, data);
                    }
                }
            });
        }
    });
    assert_eq!(read_u64(&*conn, 8), THREADS as u64 * 200);
}

/// Batches started on several connections before any is finished ([`crate::execute_all`])
/// each complete with their own results, in order; a batch refused by its connection's
/// checks fails alone.
pub fn batches_on_several_connections_travel_together(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conns: Vec<Arc<dyn Connection>> = (0..3).map(|_| served.connect()).collect();
    for round in 0..50u64 {
        let data: Vec<Vec<u8>> = (0..conns.len() as u64).map(|c| pattern(round * 10 + c, 40)).collect();
        let mut batches: Vec<Batch> = data
            .iter()
            .enumerate()
            .map(|(c, bytes)| {
                let mut b = Batch::new();
                b.write(4096 * (c as u64 + 1), bytes);
                b.faa(8, 1);
                b
            })
            .collect();
        let mut work: Vec<(&dyn Connection, &mut Batch)> = conns.iter().map(|c| &**c).zip(batches.iter_mut()).collect();
        for result in crate::execute_all(&mut work) {
            result.unwrap();
        }
        let mut reads: Vec<Batch> = (0..conns.len()).map(|_| Batch::new()).collect();
        let handles: Vec<_> = reads.iter_mut().enumerate().map(|(c, b)| b.read(4096 * (c as u64 + 1), 40)).collect();
        let mut work: Vec<(&dyn Connection, &mut Batch)> = conns.iter().map(|c| &**c).zip(reads.iter_mut()).collect();
        // One more, refused locally: out of the region.
        let mut bad = Batch::new();
        bad.read(REGION, 8);
        work.insert(1, (&*conns[1], &mut bad));
        let results = crate::execute_all(&mut work);
        assert!(results[1].is_err(), "a read past the region's end was accepted");
        for (i, result) in results.into_iter().enumerate().filter(|&(i, _)| i != 1) {
            result.unwrap_or_else(|e| panic!("batch {i} of round {round}: {e}"));
        }
        for (c, (b, h)) in reads.iter().zip(&handles).enumerate() {
            assert_eq!(b.read_result(*h).unwrap(), &data[c][..], "connection {c} round {round}");
        }
    }
    assert_eq!(read_u64(&*conns[0], 8), 50 * conns.len() as u64, "every FAA applied once");
}

/// RPCs reach the service and return its replies and errors.
pub fn rpc_round_trips(f: &dyn Fixture) {
    let served = f.serve(REGION);
    let conn = served.connect();
    assert_eq!(conn.call(rpc::ECHO, b"ping").unwrap(), b"ping");
    assert_eq!(conn.call(rpc::ECHO, b"").unwrap(), b"");
    let big = pattern(5, 1 << 20);
    assert_eq!(conn.call(rpc::ECHO, &big).unwrap(), big);
    match conn.call(rpc::FAIL, b"nope") {
        Err(TransportError::Rpc { method, status }) => {
            assert_eq!(method, rpc::FAIL);
            assert_eq!(status.code, RpcStatus::FAILED);
            assert_eq!(status.message, "nope");
        }
        other => panic!("expected an rpc error, got {other:?}"),
    }
    assert!(matches!(conn.call(999, b""), Err(TransportError::Rpc { .. })));
    // Slow calls from several threads all get their own answers.
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let conn = &conn;
            s.spawn(move || assert_eq!(conn.call(rpc::SLOW_ECHO, &[t; 10]).unwrap(), vec![t; 10]));
        }
    });
    assert!(conn.is_healthy());
}

/// A connection whose server goes away fails fast with a connection error.
pub fn connection_loss_fails_fast(f: &dyn Fixture) {
    let mut served = f.serve(REGION);
    let conn = served.connect();
    let mut b = Batch::new();
    b.write(0, &[1; 8]);
    conn.execute(&mut b).unwrap();
    served.kill();
    let started = Instant::now();
    loop {
        let mut b = Batch::new();
        b.read(0, 8);
        match conn.execute(&mut b) {
            Err(e) if e.is_connection_failure() => break,
            Ok(()) if started.elapsed() < Duration::from_secs(2) => std::thread::sleep(Duration::from_millis(1)),
            other => panic!("after the server died, expected a connection failure, got {other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?} to notice", started.elapsed());
    assert!(!conn.is_healthy());
    assert!(conn.call(rpc::ECHO, b"x").unwrap_err().is_connection_failure());
}

/// Threads busy on one connection when its server dies each end with the connection lost:
/// none waits out its deadline (a Timeout) and none gets another's results before it.
pub fn connection_loss_under_many_threads_fails_each_request(f: &dyn Fixture) {
    let mut served = f.serve(REGION);
    let conn = served.connect();
    let done = std::sync::atomic::AtomicU64::new(0);
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (conn, done) = (&conn, &done);
            s.spawn(move || {
                for round in 0u64.. {
                    let offset = 4096 + t as u64 * 4096;
                    let data = pattern(round * 100 + t as u64, 40);
                    let mut b = Batch::new();
                    b.write(offset, &data);
                    let r = b.read(offset, 40);
                    match conn.execute(&mut b) {
                        Ok(()) => {
                            assert_eq!(b.read_result(r).unwrap(), &data[..], "thread {t} round {round}");
                            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(TransportError::ConnectionLost { .. }) => return,
                        // A NIC may only notice by a retry timeout; a stream's reader sees
                        // the close at once, and a waiter left to its deadline is a bug.
                        Err(TransportError::Timeout { .. }) if conn.kind() == crate::TransportKind::Verbs => return,
                        Err(e) => panic!("thread {t} round {round}: expected the connection lost, got {e:?}"),
                    }
                    assert!(Instant::now() < deadline, "thread {t}: requests kept succeeding after the server died");
                    if round % 64 == 0 {
                        std::thread::yield_now();
                    }
                }
            });
        }
        while done.load(std::sync::atomic::Ordering::Relaxed) < 200 * THREADS as u64 {
            std::thread::sleep(Duration::from_millis(1));
        }
        served.kill();
    });
    assert!(!conn.is_healthy());
}

/// Expands to one `#[test]` per conformance case for `$fixture` (an expression implementing
/// [`Fixture`], evaluated per test).
#[macro_export]
macro_rules! conformance_suite {
    ($fixture:expr) => {
        $crate::conformance_suite!(@cases $fixture;
            data_round_trips, ordering_within_a_batch, faa_wraps, cas_is_atomic_under_contention,
            faa_is_atomic_under_contention, cas_lock_protects_read_modify_write, bad_ops_fail_alone,
            batch_limits_are_enforced, large_reads, threads_share_one_connection,
            batches_on_several_connections_travel_together, rpc_round_trips, connection_loss_fails_fast,
            connection_loss_under_many_threads_fails_each_request);
    };
    (@cases $fixture:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::$case(&$fixture);
            }
        )*
    };
}

/// Fixtures for the backends served by [`crate::RegionServer`].
pub mod fixtures {
    use super::*;
    use crate::{ConnectOptions, Endpoint, Region, RegionServer, ServerOptions};

    /// shm, tcp (optionally TLS) or verbs, served by a [`RegionServer`] over a memfd region.
    pub struct ServerFixture {
        kind: crate::TransportKind,
        tls: bool,
    }

    /// shm, served by a region server.
    pub const SHM: ServerFixture = ServerFixture { kind: crate::TransportKind::Shm, tls: false };
    /// tcp without TLS, served by a region server.
    pub const TCP: ServerFixture = ServerFixture { kind: crate::TransportKind::Tcp, tls: false };
    /// tcp inside mutual TLS, with certificates made up per region (feature `test-pki`).
    #[cfg(feature = "test-pki")]
    pub const TCP_TLS: ServerFixture = ServerFixture { kind: crate::TransportKind::Tcp, tls: true };
    /// Needs an RDMA device (Soft-RoCE will do); fails loudly without one.
    #[cfg(feature = "rdma")]
    pub const VERBS: ServerFixture = ServerFixture { kind: crate::TransportKind::Verbs, tls: false };

    const TOKEN: &str = "conformance-token";

    struct ServedRegion {
        server: Option<RegionServer>,
        endpoint: Endpoint,
        tls: Option<crate::ClientTls>,
        _dir: Option<tempfile::TempDir>,
    }

    /// Server and client TLS settings for a fresh made-up CA, and the directory of its files.
    #[cfg(feature = "test-pki")]
    fn tls_pair() -> (crate::ServerTls, crate::ClientTls, tempfile::TempDir) {
        let pki = crate::test_pki::TestPki::new("conformance CA");
        let server = crate::ServerTls::load(pki.server_files(crate::ClientAuth::Yes)).expect("test certificates");
        (server, pki.mutual_client(), pki.dir)
    }

    #[cfg(not(feature = "test-pki"))]
    fn tls_pair() -> (crate::ServerTls, crate::ClientTls, tempfile::TempDir) {
        unreachable!("TLS fixtures exist only with feature test-pki")
    }

    impl Fixture for ServerFixture {
        fn serve(&self, region_len: u64) -> Box<dyn Served> {
            let file = crate::region::shared_memory_file("conformance", region_len, false).unwrap();
            let region = Arc::new(Region::map_file(&file, region_len).unwrap());
            let (listen, dir) = match self.kind {
                crate::TransportKind::Shm => {
                    let dir = tempfile::tempdir().unwrap();
                    (Endpoint::Shm(dir.path().join("region.sock")), Some(dir))
                }
                crate::TransportKind::Tcp => (Endpoint::Tcp("127.0.0.1:0".into()), None),
                crate::TransportKind::Verbs => (Endpoint::Verbs("127.0.0.1:0".into()), None),
            };
            let mut options = ServerOptions { token: TOKEN.into(), ..ServerOptions::default() };
            let (mut tls, mut dir) = (None, dir);
            if self.tls {
                let (server_tls, client_tls, pki_dir) = tls_pair();
                options.tls = Some(server_tls);
                (tls, dir) = (Some(client_tls), Some(pki_dir));
            }
            let server =
                RegionServer::start(region, Some(file), Arc::new(TestRpc), options, std::slice::from_ref(&listen))
                    .unwrap_or_else(|e| panic!("fixture cannot serve {listen}: {e}"));
            let endpoint = server.endpoints()[0].clone();
            Box::new(ServedRegion { server: Some(server), endpoint, tls, _dir: dir })
        }
    }

    impl Served for ServedRegion {
        fn connect(&self) -> Arc<dyn Connection> {
            // 30 s: under the emulated Soft-RoCE VM a 16 MiB request over tcp has taken
            // over 5 s (on the host well under one); no case here waits out a timeout.
            let options =
                ConnectOptions { tls: self.tls.clone(), ..ConnectOptions::new(TOKEN, Duration::from_secs(30)) };
            crate::connect(&self.endpoint, &options)
                .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.endpoint))
        }

        fn kill(&mut self) {
            self.server.take();
        }
    }
}
