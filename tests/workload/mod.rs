//! The recorded workload of the fault tests (`faults.rs`, `partitions.rs`) and its check:
//! client threads SET and GET a few keys through a cluster's Redis port, recording every
//! operation's call and return; at the end every key is read once more, and each key's
//! history must be linearizable (a register; a SET that failed may or may not have
//! happened) with every acknowledged write in it.
#![allow(dead_code)]

#[path = "../../client/tests/shared/linearizability.rs"]
mod linearizability;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use linearizability::{check, Event, Model, Verdict};
use rand::{Rng, SeedableRng};

/// Keys the clients write and read.
pub const KEYS: u64 = 256;
/// Client threads.
pub const CLIENTS: usize = 4;

/// One key's value as a register: the id of the SET that wrote it.
struct Register;

#[derive(Debug, Clone, Copy)]
enum RegisterOp {
    Write(u64),
    Read(Option<u64>),
}

impl Model for Register {
    type State = Option<u64>;
    type Op = RegisterOp;

    fn init(&self) -> Option<u64> {
        None
    }

    fn step(&self, state: &Option<u64>, op: &RegisterOp) -> Option<Option<u64>> {
        match *op {
            RegisterOp::Write(v) => Some(Some(v)),
            RegisterOp::Read(seen) => (seen == *state).then_some(*state),
        }
    }
}

/// What the clients did: per key, its operations; writes that failed are kept apart
/// (their outcome is unknown).
#[derive(Default)]
struct History {
    done: HashMap<u64, Vec<Event<RegisterOp>>>,
    failed_writes: HashMap<u64, Vec<(Instant, u64)>>,
    /// Why each failed write failed, by value.
    errors: HashMap<u64, String>,
    acknowledged: u64,
    failed: u64,
}

/// The clients of one run: start them with [`Workload::run_clients`] inside a thread
/// scope, check with [`Workload::check`] after.
pub struct Workload {
    redis_port: u16,
    seed: u64,
    stop: AtomicBool,
    next_value: AtomicU64,
    history: Mutex<History>,
    /// When the faults began (times printed count from then).
    pub started: Instant,
}

impl Workload {
    /// A workload against the Redis port `redis_port`, its keys and values drawn from `seed`.
    pub fn new(redis_port: u16, seed: u64) -> Self {
        Self {
            redis_port,
            seed,
            stop: AtomicBool::new(false),
            next_value: AtomicU64::new(1),
            history: Mutex::default(),
            started: Instant::now(),
        }
    }

    /// Spawns the client threads in `scope`; they run until [`Workload::stop`] or until
    /// the returned guard is dropped (a failed check panicking, too).
    pub fn run_clients<'s, 'e: 's>(&'e self, scope: &'s std::thread::Scope<'s, 'e>) -> StopOnDrop<'e> {
        for id in 0..CLIENTS as u64 {
            scope.spawn(move || self.client_loop(id));
        }
        StopOnDrop(&self.stop)
    }

    /// Stops the clients.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    fn client_loop(&self, id: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed ^ (id << 40));
        let mut con = None;
        while !self.stop.load(Ordering::Acquire) {
            let Some(c) = con.as_mut() else {
                con = connect(self.redis_port);
                if con.is_none() {
                    std::thread::sleep(Duration::from_millis(50));
                }
                continue;
            };
            let key = rng.random_range(0..KEYS);
            let name = key_name(key);
            let call = Instant::now();
            if rng.random_bool(0.5) {
                let value = self.next_value.fetch_add(1, Ordering::Relaxed);
                let result: redis::RedisResult<()> = redis::cmd("SET").arg(&name).arg(format!("v{value}")).query(c);
                let ret = Instant::now();
                let mut h = self.history.lock().unwrap();
                match result {
                    Ok(()) => {
                        h.acknowledged += 1;
                        h.done.entry(key).or_default().push(Event { call, ret, op: RegisterOp::Write(value) });
                    }
                    Err(e) => {
                        h.failed += 1;
                        h.failed_writes.entry(key).or_default().push((call, value));
                        h.errors.insert(value, e.to_string());
                        con = None;
                    }
                }
            } else {
                let result: redis::RedisResult<Option<String>> = redis::cmd("GET").arg(&name).query(c);
                let ret = Instant::now();
                match result {
                    Ok(seen) => {
                        let op = RegisterOp::Read(seen.map(|s| parse_value(&s)));
                        self.history.lock().unwrap().done.entry(key).or_default().push(Event { call, ret, op });
                    }
                    // A failed read tells nothing.
                    Err(_) => con = None,
                }
            }
        }
    }

    /// Reads every key once more (each until it answers), then checks each key's history;
    /// `show_copies(key)` prints what the replicas hold of a key that is not linearizable.
    /// `context` (the seed, the faults) goes into a failure's message.
    pub fn check(self, context: &str, show_copies: impl Fn(&str)) {
        let mut h = self.history.into_inner().unwrap();
        let mut con = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        for key in 0..KEYS {
            loop {
                assert!(Instant::now() < deadline, "the final reads did not succeed");
                let Some(c) = con.as_mut() else {
                    con = connect(self.redis_port);
                    continue;
                };
                let call = Instant::now();
                match redis::cmd("GET").arg(key_name(key)).query::<Option<String>>(c) {
                    Ok(seen) => {
                        let op = RegisterOp::Read(seen.map(|s| parse_value(&s)));
                        h.done.entry(key).or_default().push(Event { call, ret: Instant::now(), op });
                        break;
                    }
                    Err(_) => con = None,
                }
            }
        }
        println!(
            "{} acknowledged writes, {} failed writes, {} operations recorded",
            h.acknowledged,
            h.failed,
            h.done.values().map(Vec::len).sum::<usize>()
        );
        assert!(h.acknowledged > 100, "the clients made too little progress to test anything");

        // A failed write whose value some read saw happened at some point after its call:
        // it enters the history with no return (it may come anywhere after its call). One
        // that no read saw is left out: placing it after everything explains it.
        let far = Instant::now() + Duration::from_secs(3600);
        let errors = std::mem::take(&mut h.errors);
        for (key, writes) in h.failed_writes {
            let events = h.done.entry(key).or_default();
            let seen: HashSet<u64> = events
                .iter()
                .filter_map(|e| match e.op {
                    RegisterOp::Read(Some(v)) => Some(v),
                    _ => None,
                })
                .collect();
            for (call, value) in writes {
                if seen.contains(&value) {
                    events.push(Event { call, ret: far, op: RegisterOp::Write(value) });
                }
            }
        }
        let checking = Instant::now();
        for (key, events) in &h.done {
            let verdict = check(&Register, events);
            if let Verdict::Violation { placed } = verdict {
                print_around(events, placed, self.started, &errors);
                show_copies(&key_name(*key));
            }
            assert_eq!(verdict, Verdict::Linearizable, "key {key}: {} operations ({context})", events.len());
        }
        println!("checked {} keys in {:.1} s", h.done.len(), checking.elapsed().as_secs_f64());
    }
}

/// Raises the flag when dropped.
pub struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn key_name(key: u64) -> String {
    format!("fault-key-{key}")
}

fn parse_value(text: &str) -> u64 {
    text.trim_start_matches('v').parse().expect("a value the test wrote")
}

fn connect(port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let con = client.get_connection_with_timeout(Duration::from_secs(2)).ok()?;
    con.set_read_timeout(Some(Duration::from_secs(15))).ok()?;
    Some(con)
}

/// The operations of a key that is not linearizable, by call time (seconds since the
/// faults began; a failed write has no return), around where the search got stuck.
fn print_around(events: &[Event<RegisterOp>], placed: usize, started: Instant, errors: &HashMap<u64, String>) {
    let mut sorted: Vec<&Event<RegisterOp>> = events.iter().collect();
    sorted.sort_by_key(|e| e.call);
    let at = |t: Instant| t.saturating_duration_since(started).as_secs_f64();
    let from = placed.saturating_sub(40);
    println!("operations {from}.. of {} by call time (the search placed {placed}):", sorted.len());
    for (i, e) in sorted.iter().enumerate().skip(from).take(80) {
        let ret = match e.op {
            RegisterOp::Write(v) if e.ret > Instant::now() => format!("(failed: {})", errors[&v]),
            _ => format!("{:.4}", at(e.ret)),
        };
        println!("  {i}: {:.4}..{ret} {:?}", at(e.call), e.op);
    }
}

/// The etcd of the cluster whose etcd listens on loopback port `etcd_port`, whichever way
/// it answers.
pub fn etcd(etcd_port: u16) -> Result<racekv_coord::etcd::Etcd, racekv_coord::CoordError> {
    let urls = [format!("http://127.0.0.1:{etcd_port}")];
    racekv_coord::etcd::Etcd::connect(&urls, racekv_coord::keys::DEFAULT_CLUSTER_NAME, Duration::from_secs(2))
}

/// Waits until every partition has R replicas, none joining, all registered: the state a
/// memnode's data can be lost in without losing any acknowledged write. `log` (the faults
/// so far) goes into a failure's message.
pub fn wait_whole(etcd_port: u16, log: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let whole =
            etcd(etcd_port).and_then(|etcd| Ok((etcd.map()?, etcd.memnodes()?))).is_ok_and(|(map, registered)| {
                map.is_some_and(|(map, _)| {
                    let live = |id: &u64| registered.iter().any(|m| m.node_id == *id);
                    map.partitions.iter().all(|set| set.len() == usize::from(map.replicas) && set.iter().all(live))
                        && map.write_sets() == map.partitions
                })
            });
        if whole {
            return;
        }
        if Instant::now() >= deadline {
            let state = etcd(etcd_port).and_then(|etcd| Ok((etcd.map()?, etcd.memnodes()?)));
            panic!("R was not restored within 60 s: {}; map and registrations: {state:?}", log.join("; "));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Prints what each memnode of the cluster map holds for `key` (read from its table
/// alone, with the memnodes' `token`), so a violation shows whether replicas differ.
pub fn print_copies(etcd_port: u16, token: &str, key: &str) {
    let Ok(Some((map, _))) = etcd(etcd_port).and_then(|e| e.map()) else { return };
    println!("{key} on each memnode of map epoch {} (partitions: {:?}):", map.epoch, map.partitions);
    for m in &map.memnodes {
        let read = racekv_client::ClientBuilder::default()
            .memnode(m.endpoints[0].clone())
            .token(token)
            .connect()
            .and_then(|c| c.get(key.as_bytes()));
        let shown = read.map(|v| v.map(|v| String::from_utf8_lossy(&v).into_owned()));
        println!("  {:#x} {}: {shown:?}", m.node_id, m.endpoints[0]);
    }
}
