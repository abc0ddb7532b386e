//! FLOCK under stress: many threads on shared connections, a deliberately slow handler that
//! overloads the server, and hostile lanes. Every request is answered exactly once, in the
//! thread that sent it, with its own response; an overloaded server refuses credits rather
//! than queueing, and a request refused that way never executes.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use racekv_transport::flock::message::{canary, Builder, Entry, Header, KIND_REQUEST};
use racekv_transport::flock::{FlockOptions, SchedulerOptions};
use racekv_transport::wire::{self, Kind, HEADER_BYTES};
use racekv_transport::{
    ConnectOptions, Connection, Endpoint, Region, RegionServer, RpcService, RpcStatus, ServerOptions, TransportError,
};

const TOKEN: &str = "flock-test";

/// Echoes `id | payload` reversed, after `delay`; counts executions per request id (the
/// first 8 bytes of the request).
struct Counting {
    delay: Duration,
    executed: Mutex<HashMap<u64, u32>>,
}

impl RpcService for Counting {
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        if request.len() < 8 {
            return Err(RpcStatus::new(RpcStatus::BAD_REQUEST, "short"));
        }
        let id = u64::from_le_bytes(request[..8].try_into().unwrap());
        *self.executed.lock().unwrap().entry(id).or_default() += 1;
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if method == 2 {
            return Err(RpcStatus::new(RpcStatus::FAILED, format!("refused {id}")));
        }
        let mut out = request.to_vec();
        out.reverse();
        Ok(out)
    }
}

struct Served {
    server: RegionServer,
    service: Arc<Counting>,
    _dir: tempfile::TempDir,
}

fn serve(kind: &str, delay: Duration, flock: SchedulerOptions) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let file = racekv_transport::region::shared_memory_file("flock-test", 1 << 20, false).unwrap();
    let region = Arc::new(Region::map_file(&file, 1 << 20).unwrap());
    let listen = match kind {
        "shm" => Endpoint::Shm(dir.path().join("s.sock")),
        _ => Endpoint::Tcp("127.0.0.1:0".into()),
    };
    let service = Arc::new(Counting { delay, executed: Mutex::new(HashMap::new()) });
    let options = ServerOptions { token: TOKEN.into(), flock, ..ServerOptions::default() };
    let server = RegionServer::start(region, Some(file), service.clone(), options, &[listen]).unwrap();
    Served { server, service, _dir: dir }
}

fn connect(served: &Served, lanes: usize, timeout: Duration) -> Arc<dyn Connection> {
    let options = ConnectOptions { token: TOKEN.into(), timeout };
    racekv_transport::connect_with(&served.server.endpoints()[0], &options, &FlockOptions { lanes, max_coalesce: 64 })
        .unwrap()
}

fn request(id: u64, len: usize) -> Vec<u8> {
    let mut r = id.to_le_bytes().to_vec();
    r.extend((0..len).map(|i| (id as usize * 31 + i) as u8));
    r
}

fn every_request_answered_once_in_its_own_thread(kind: &str) {
    let served = serve(kind, Duration::ZERO, SchedulerOptions::default());
    let conns: Vec<_> = (0..2).map(|_| connect(&served, 2, Duration::from_secs(20))).collect();
    const THREADS: u64 = 32;
    const PER_THREAD: u64 = 300;
    let barrier = Barrier::new(THREADS as usize);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (conn, barrier) = (&conns[t as usize % 2], &barrier);
            s.spawn(move || {
                barrier.wait();
                for i in 0..PER_THREAD {
                    let id = t << 32 | i;
                    // Mostly small requests, some large, so the size mapping moves threads.
                    let len = if t % 8 == 7 { 20_000 + (i as usize % 7) * 1000 } else { (i as usize * 13) % 300 };
                    let req = request(id, len);
                    if i % 50 == 49 {
                        match conn.call(2, &req) {
                            Err(TransportError::Rpc { status, .. }) => {
                                assert_eq!(status.message, format!("refused {id}"))
                            }
                            other => panic!("expected the handler's error, got {other:?}"),
                        }
                        continue;
                    }
                    let mut want = req.clone();
                    want.reverse();
                    assert_eq!(conn.call(1, &req).unwrap(), want, "thread {t} call {i} got someone else's answer");
                }
            });
        }
    });
    let executed = served.service.executed.lock().unwrap();
    assert_eq!(executed.len() as u64, THREADS * PER_THREAD, "a request was lost");
    assert!(executed.values().all(|&n| n == 1), "a request executed twice");
}

#[test]
fn tcp_every_request_answered_once_in_its_own_thread() {
    every_request_answered_once_in_its_own_thread("tcp");
}

#[test]
fn shm_every_request_answered_once_in_its_own_thread() {
    every_request_answered_once_in_its_own_thread("shm");
}

/// 20 connections x 6 threads x 12 calls against a 40 ms handler with small credits: far more than the
/// server can serve within the callers' 1 s timeout. The scheduler refuses credits; callers
/// fail with OVERLOADED (never sent, never executed) or succeed (executed exactly once).
fn overload_refuses_credits_and_loses_nothing(kind: &str) {
    let flock = SchedulerOptions { credits: 4, max_queue_delay: Duration::from_millis(120), ..Default::default() };
    let served = serve(kind, Duration::from_millis(40), flock);
    let timeout = Duration::from_secs(1);
    let conns: Vec<_> = (0..20).map(|_| connect(&served, 1, timeout)).collect();
    let outcomes = Mutex::new(Vec::new());
    let barrier = Barrier::new(conns.len() * 6);
    let started = Instant::now();
    std::thread::scope(|s| {
        for (c, conn) in conns.iter().enumerate() {
            for t in 0..6u64 {
                let (outcomes, barrier) = (&outcomes, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    for i in 0..12u64 {
                        let id = (c as u64) << 40 | t << 20 | i;
                        let req = request(id, 16);
                        let result = conn.call(1, &req);
                        if let Ok(reply) = &result {
                            let mut want = req.clone();
                            want.reverse();
                            assert_eq!(reply, &want);
                        }
                        outcomes.lock().unwrap().push((id, result));
                    }
                });
            }
        }
    });
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(300)); // anything still queued would run now
    let executed = served.service.executed.lock().unwrap();
    let (mut ok, mut refused, mut late) = (0, 0, 0);
    for (id, result) in outcomes.lock().unwrap().iter() {
        let n = executed.get(id).copied().unwrap_or(0);
        match result {
            Ok(_) => {
                assert_eq!(n, 1, "answered request {id:#x} executed {n} times");
                ok += 1;
            }
            Err(TransportError::Rpc { status, .. }) if status.code == RpcStatus::OVERLOADED => {
                assert_eq!(n, 0, "request {id:#x} refused for lack of credits but executed");
                assert!(status.message.contains("not sent"), "{}", status.message);
                refused += 1;
            }
            // Sent after a long wait for credits, then out of time: it may have executed
            // (the caller is told so), but at most once.
            Err(TransportError::Timeout { .. }) => {
                assert!(n <= 1, "timed-out request {id:#x} executed {n} times");
                late += 1;
            }
            Err(other) => panic!("request {id:#x}: unexpected {other:?}"),
        }
    }
    assert!(executed.values().all(|&n| n == 1), "a request executed twice");
    assert!(executed.len() <= ok + late && executed.len() >= ok, "an unanswered request executed");
    assert!(ok > 0 && refused > 0, "{ok} answered, {refused} refused, {late} late in {took:?}: no overload");
}

#[test]
fn tcp_overload_refuses_credits_and_loses_nothing() {
    overload_refuses_credits_and_loses_nothing("tcp");
}

#[test]
fn shm_overload_refuses_credits_and_loses_nothing() {
    overload_refuses_credits_and_loses_nothing("shm");
}

/// Opens a raw tcp lane: returns the stream and (key, credits).
fn raw_lane(addr: &str) -> (TcpStream, u32, u32) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let token = wire::token_digest(TOKEN);
    let mut out = Vec::new();
    wire::encode_hello(&mut out, &token);
    wire::encode_flock_open(&mut out, &token, &wire::FlockOpen { sender: 99, lane: 0, verbs: None });
    s.write_all(&out).unwrap();
    let mut accept = None;
    for _ in 0..2 {
        let mut h = [0u8; HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let h = wire::decode_header(&h).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).unwrap();
        if h.kind == Kind::FlockAccept {
            accept = Some(wire::decode_flock_accept(&body).unwrap());
        }
    }
    let accept = accept.unwrap();
    (s, accept.key, accept.credits)
}

fn message(key: u32, number: u64, count: usize) -> Vec<u8> {
    let mut b = Builder::default();
    for i in 0..count {
        let req = request(i as u64 + 1000 * number, 4);
        b.push(Entry { size: req.len() as u32, thread: 0, rpc: 1, seq: i as u32, status: 0 }, &req);
    }
    b.finish(Header { canary: canary(key, number), kind: KIND_REQUEST, ..Header::default() }).to_vec()
}

/// The server closed the lane (cleanly, or with a reset because our bytes were unread).
fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
    }
}

#[test]
fn hostile_messages_close_only_their_lane() {
    let served = serve("tcp", Duration::ZERO, SchedulerOptions::default());
    let Endpoint::Tcp(addr) = served.server.endpoints()[0].clone() else { unreachable!() };
    let good = connect(&served, 1, Duration::from_secs(5));
    assert_eq!(good.call(1, &request(1, 3)).unwrap().len(), 11);

    // A well-formed message is answered.
    let (mut s, key, credits) = raw_lane(&addr);
    s.write_all(&message(key, 0, 2)).unwrap();
    let mut h = [0u8; 32];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u32::from_le_bytes(h[..4].try_into().unwrap()), canary(key, 0));

    type Make = Box<dyn Fn(u32) -> Vec<u8>>;
    let cases: Vec<(&str, Make)> = vec![
        ("wrong canary", Box::new(|key| message(key, 7, 1))),
        (
            "torn trailer",
            Box::new(|key| {
                let mut m = message(key, 0, 1);
                let n = m.len();
                m[n - 2] ^= 1;
                m
            }),
        ),
        (
            "oversized length",
            Box::new(|key| {
                let mut m = message(key, 0, 1);
                m[4..8].copy_from_slice(&(u32::MAX - 7).to_le_bytes());
                m
            }),
        ),
        ("more requests than credits", Box::new(move |key| message(key, 0, credits as usize + 1))),
        (
            "a response from the sender",
            Box::new(|key| {
                let mut m = message(key, 0, 1);
                m[10] = 2;
                m
            }),
        ),
        ("garbage", Box::new(|_| vec![0xA5; 200])),
    ];
    for (what, make) in cases {
        let (mut s, key, _) = raw_lane(&addr);
        let _ = s.write_all(&make(key));
        assert!(closed(&mut s), "{what}: the lane stayed open");
        // Everyone else is still served.
        assert_eq!(good.call(1, &request(2, 5)).unwrap().len(), 13, "{what}");
    }
    assert!(good.is_healthy());
}
