//! Faults under load (issue 17, item 6): `racekv up --memnodes 3` clusters (a local etcd,
//! memnode processes started again on their data files, a computenode routing by the map),
//! with R = 1 and with R = 2 (where a memnode silent past its lease is failed over), while
//! client threads run a recorded workload of SETs and GETs through the Redis port. A seeded
//! injector SIGKILLs memnodes, stops them (SIGSTOP, then SIGCONT: a memnode that stops
//! answering and comes back; with R = 2 sometimes past its lease, so it is failed over and
//! rejoins) and SIGKILLs etcd; with R = 2 every tenth fault deletes a memnode's data file
//! and kills it (permanent loss: it comes back empty and is filled from its peers; the next
//! fault waits until it is, as R = 2 survives one loss at a time). At the end every key is
//! read once more, and each key's history must be linearizable (a register; a SET that
//! failed may or may not have happened) with every acknowledged write in it.
//!
//! A third run partitions memnodes from the network (iptables; root needed) at R = 2 over
//! tcp.
//!
//! `RACEKV_FAULTS` (default 50 with R = 1, 30 with R = 2, 20 partitioning) faults;
//! `RACEKV_FAULT_SEED` replays a run (the seed is printed). `ops/test.sh` runs them all; by
//! hand:
//!
//! ```sh
//! cargo build -p racekv -p racekv-memnode --features racekv/etcd,racekv-memnode/etcd
//! cargo test --features etcd --test faults -- --nocapture
//! ```
#![cfg(feature = "etcd")]

mod common;
#[allow(dead_code)]
#[path = "../client/tests/shared/linearizability.rs"]
mod linearizability;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{alive, free_ports, memnode_pids, signal, Children, Up};
use linearizability::{check, Event, Model, Verdict};
use rand::{Rng, SeedableRng};

const KEYS: u64 = 256;
const CLIENTS: usize = 4;

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

fn connect(port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).ok()?;
    let con = client.get_connection_with_timeout(Duration::from_secs(2)).ok()?;
    con.set_read_timeout(Some(Duration::from_secs(15))).ok()?;
    Some(con)
}

fn client_loop(port: u16, id: u64, seed: u64, stop: &AtomicBool, next_value: &AtomicU64, history: &Mutex<History>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (id << 40));
    let mut con = None;
    while !stop.load(Ordering::Acquire) {
        let Some(c) = con.as_mut() else {
            con = connect(port);
            if con.is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
            continue;
        };
        let key = rng.random_range(0..KEYS);
        let name = format!("fault-key-{key}");
        let call = Instant::now();
        if rng.random_bool(0.5) {
            let value = next_value.fetch_add(1, Ordering::Relaxed);
            let result: redis::RedisResult<()> = redis::cmd("SET").arg(&name).arg(format!("v{value}")).query(c);
            let ret = Instant::now();
            let mut h = history.lock().unwrap();
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
                    let seen = seen.map(|s| s.trim_start_matches('v').parse::<u64>().expect("a value the test wrote"));
                    history.lock().unwrap().done.entry(key).or_default().push(Event {
                        call,
                        ret,
                        op: RegisterOp::Read(seen),
                    });
                }
                // A failed read tells nothing.
                Err(_) => con = None,
            }
        }
    }
}

/// Raises the flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Waits until every memnode runs (the supervisor started the killed ones again).
fn wait_running(up: &Up, guard: &mut Children) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let cluster = up.local_cluster();
        let pids = memnode_pids(&cluster);
        let running = cluster["memnodes"].as_array().unwrap().iter().all(|m| m["state"] == "running");
        if running && pids.iter().all(|&p| alive(p)) && alive(cluster["etcd_pid"].as_u64().unwrap()) {
            guard.0.extend(pids);
            guard.0.push(cluster["etcd_pid"].as_u64().unwrap());
            return cluster;
        }
        assert!(Instant::now() < deadline, "the cluster did not heal: {cluster}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until every partition has R replicas, none joining, all registered: the state a
/// memnode's data can be lost in without losing any acknowledged write.
fn wait_whole(etcd_port: u16, log: &[String]) {
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

/// The etcd of the cluster on `etcd_port`, whichever way it answers.
fn etcd(etcd_port: u16) -> Result<racekv_coord::etcd::Etcd, racekv_coord::CoordError> {
    let urls = [format!("http://127.0.0.1:{etcd_port}")];
    racekv_coord::etcd::Etcd::connect(&urls, racekv_coord::keys::DEFAULT_CLUSTER_NAME, Duration::from_secs(2))
}

/// The node id the cluster map lists at the endpoint containing `fragment`.
fn listed_at(etcd_port: u16, fragment: &str) -> u64 {
    let (map, _) = etcd(etcd_port).and_then(|e| e.map()).expect("etcd answers").expect("a cluster map");
    map.memnodes.iter().find(|m| m.endpoints.iter().any(|e| e.contains(fragment))).expect("listed").node_id
}

/// Waits until the cluster map no longer lists memnode `node` (lost, then replaced).
fn wait_unlisted(etcd_port: u16, node: u64, log: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !etcd(etcd_port).and_then(|e| e.map()).is_ok_and(|m| m.is_some_and(|(map, _)| map.memnode(node).is_none())) {
        assert!(Instant::now() < deadline, "lost memnode {node:#x} was not replaced within 60 s: {}", log.join("; "));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `racekv cluster set-replicas <r>` on the cluster of the etcd on `etcd_port`.
fn set_replicas(etcd_port: u16, r: &str) -> Result<(), String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_racekv"))
        .args(["cluster", "set-replicas", r, "--etcd", &format!("http://127.0.0.1:{etcd_port}")])
        .output()
        .map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(()),
        false => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            Err(stderr.lines().find(|l| l.starts_with("Error")).unwrap_or(stderr.trim()).to_string())
        }
    }
}

#[test]
fn clients_stay_linearizable_through_memnode_and_etcd_faults() {
    run_faults("1", 50);
}

/// With R = 2 a memnode stopped past its lease is failed over, then caught up and made a
/// replica again, so the runs go on through failovers and rejoins. (It found a SET shown on
/// the primary but never copied to a memnode joining its partition, lost at the primary's
/// failover: writes at R > 1 are one-key transactions now even on a partition down to its
/// primary, `PartitionTable::locks_writes`.)
#[test]
fn replicated_clients_stay_linearizable_through_faults_and_failovers() {
    run_faults("2", 30);
}

/// Network partitions at R = 2 over tcp (`racekv up --tcp-only`): a memnode cut off from
/// its clients and from etcd (`Partition`) for 0.2 to 1.2 s (requests to it stall, then
/// resume) or for 2.5 to 3.5 s (its lease lapses: failed over while it still runs, with
/// stale beliefs, then healed and rejoined), among SIGKILLs and SIGSTOPs.
#[test]
fn replicated_clients_stay_linearizable_through_network_partitions() {
    run_faults_with("2", 20, Faults::Partitions);
}

/// Which faults a run injects.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Faults {
    /// SIGKILL and SIGSTOP of memnodes, SIGKILL of etcd; with replicas also stops past the
    /// lease, changes of R and lost data files (over shared memory).
    Processes,
    /// Network partitions of memnodes, with SIGKILLs and SIGSTOPs (over tcp).
    Partitions,
}

/// `faults` (or `RACEKV_FAULTS`) faults against `racekv up --replicas <replicas>`.
fn run_faults(replicas: &str, faults: usize) {
    run_faults_with(replicas, faults, Faults::Processes);
}

fn run_faults_with(replicas: &str, faults: usize, kinds_of: Faults) {
    let faults: usize = std::env::var("RACEKV_FAULTS").ok().and_then(|v| v.parse().ok()).unwrap_or(faults);
    let seed: u64 = std::env::var("RACEKV_FAULT_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(rand::random);
    println!(
        "R = {replicas}: fault seed {seed} (RACEKV_FAULT_SEED={seed} replays the injector's choices), {faults} faults"
    );
    let etcd_port = free_ports(2);
    let etcd_port_text = etcd_port.to_string();
    let mut args =
        vec!["--memnodes", "3", "--replicas", replicas, "--etcd-port", &etcd_port_text, "--region-bytes", "64MiB"];
    if kinds_of == Faults::Partitions {
        args.push("--tcp-only");
    }
    let up = Up::start(&args);
    let mut guard = Children::of(&up.local_cluster());

    let stop = AtomicBool::new(false);
    let next_value = AtomicU64::new(1);
    let history = Mutex::new(History::default());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut log: Vec<String> = Vec::new();
    let started = Instant::now();
    println!(
        "R = {replicas}: the faults begin at {:?} (the times below count from then)",
        std::time::SystemTime::now()
    );
    std::thread::scope(|s| {
        for id in 0..CLIENTS as u64 {
            let (stop, next_value, history) = (&stop, &next_value, &history);
            s.spawn(move || client_loop(up.redis, id, seed, stop, next_value, history));
        }
        // However the injector ends (a failed check panics), the clients stop.
        let _stop = StopOnDrop(&stop);
        std::thread::sleep(Duration::from_millis(300));
        for n in 0..faults {
            let cluster = wait_running(&up, &mut guard);
            log.push(format!("{:.1}s", started.elapsed().as_secs_f64()));
            std::thread::sleep(Duration::from_millis(rng.random_range(100..400)));
            let pids = memnode_pids(&cluster);
            let victim = rng.random_range(0..pids.len());
            // With replicas, one fault in twelve stops a memnode past its lease: it is failed
            // over, and once resumed, caught up and made a replica again while the clients
            // write; one in twelve raises R to 3 and lowers it back (every partition copied
            // to its third memnode, then those copies dropped and purged). A lost data file
            // waits for R whole first (R = 2 survives one loss at a time): the memnode is
            // started again empty under a new id, failed over, replaced by the new one in
            // the map and filled from the other replicas (the healer), under the workload.
            let kinds = if replicas == "1" { 10 } else { 12 };
            // With replicas, every tenth fault loses a memnode's data file for good (kind 12).
            let kind = match kinds_of {
                // Partitions (13 to 19, the first four short), two SIGKILLs, one SIGSTOP.
                Faults::Partitions => [13, 14, 15, 16, 17, 18, 19, 0, 0, 5][rng.random_range(0..10)],
                _ if replicas != "1" && n % 10 == 5 => 12,
                _ => rng.random_range(0..kinds),
            };
            match kind {
                13..=19 => {
                    let short = kind <= 16;
                    let pause = if short { rng.random_range(200..1_200) } else { rng.random_range(2_500..3_500) };
                    let memnode = &cluster["memnodes"][victim];
                    let cut = Partition::cut(pids[victim], tcp_port(memnode), etcd_port);
                    let etcd_cut = cut.rules.len() / 2 - 1;
                    log.push(format!("{n}: memnode {victim} partitioned for {pause} ms ({etcd_cut} etcd connections)"));
                    std::thread::sleep(Duration::from_millis(pause));
                    drop(cut);
                }
                12 => {
                    wait_whole(etcd_port, &log);
                    let data_dir = cluster["data_dir"].as_str().unwrap();
                    let file = std::path::Path::new(data_dir).join(format!("memnode-{victim}.region"));
                    let lost = listed_at(etcd_port, &format!("memnode-{victim}."));
                    log.push(format!("{n}: memnode {victim}'s data file deleted, SIGKILL (back empty, new id)"));
                    std::fs::remove_file(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
                    signal(pids[victim], "KILL");
                    // Healed whole before the next fault: R = 2 survives one loss at a
                    // time. Another memnode stopped past its lease before the lost one's
                    // lease ran out (etcd revokes leases lazily, and a restarted etcd
                    // renews all of them) would be failed over first, leaving partitions
                    // whose one listed replica is the lost memnode: two failures.
                    wait_running(&up, &mut guard);
                    wait_unlisted(etcd_port, lost, &log);
                    wait_whole(etcd_port, &log);
                }
                11 => {
                    let up_r = set_replicas(etcd_port, "3");
                    // Back may wait for a memnode down since an earlier fault to be failed over.
                    let mut back = set_replicas(etcd_port, replicas);
                    for _ in 0..60 {
                        if back.is_ok() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(500));
                        back = set_replicas(etcd_port, replicas);
                    }
                    log.push(format!("{n}: R to 3 ({up_r:?}) and back ({back:?})"));
                    assert!(back.is_ok(), "R could not be set back to {replicas}: {}", log.join("; "));
                }
                10 => {
                    let pause = rng.random_range(2_500..3_500);
                    log.push(format!("{n}: SIGSTOP memnode {victim} for {pause} ms (failover, then rejoin)"));
                    signal(pids[victim], "STOP");
                    std::thread::sleep(Duration::from_millis(pause));
                    signal(pids[victim], "CONT");
                }
                0..=4 => {
                    log.push(format!("{n}: SIGKILL memnode {victim}"));
                    signal(pids[victim], "KILL");
                }
                5..=7 => {
                    let pause = rng.random_range(200..1200);
                    log.push(format!("{n}: SIGSTOP memnode {victim} for {pause} ms"));
                    signal(pids[victim], "STOP");
                    std::thread::sleep(Duration::from_millis(pause));
                    signal(pids[victim], "CONT");
                }
                _ => {
                    log.push(format!("{n}: SIGKILL etcd"));
                    signal(cluster["etcd_pid"].as_u64().unwrap(), "KILL");
                }
            }
        }
        wait_running(&up, &mut guard);
        if replicas != "1" {
            // Healed whole: the last lost memnode replaced and filled, every rejoin done.
            wait_whole(etcd_port, &log);
        }
        // Let the clients run on a healed cluster for a moment, then stop them.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Release);
    });
    println!("faults: {}", log.join("; "));

    // Every key read once more, after the faults, each until it answers.
    let mut h = history.into_inner().unwrap();
    let mut con = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    for key in 0..KEYS {
        loop {
            assert!(Instant::now() < deadline, "the final reads did not succeed");
            let Some(c) = con.as_mut() else {
                con = connect(up.redis);
                continue;
            };
            let call = Instant::now();
            match redis::cmd("GET").arg(format!("fault-key-{key}")).query::<Option<String>>(c) {
                Ok(seen) => {
                    let seen = seen.map(|s| s.trim_start_matches('v').parse::<u64>().unwrap());
                    h.done.entry(key).or_default().push(Event {
                        call,
                        ret: Instant::now(),
                        op: RegisterOp::Read(seen),
                    });
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

    // A failed write whose value some read saw happened at some point after its call: it
    // enters the history with no return (it may come anywhere after its call). One that no
    // read saw is left out: placing it after everything explains it.
    let far = Instant::now() + Duration::from_secs(3600);
    let errors = std::mem::take(&mut h.errors);
    for (key, writes) in h.failed_writes {
        let events = h.done.entry(key).or_default();
        let seen: std::collections::HashSet<u64> = events
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
            print_around(events, placed, started, &errors);
            print_copies(etcd_port, &format!("fault-key-{key}"));
        }
        assert_eq!(
            verdict,
            Verdict::Linearizable,
            "key {key}: {} operations (seed {seed}; {})",
            events.len(),
            log.join("; ")
        );
    }
    println!("checked {} keys in {:.1} s", h.done.len(), checking.elapsed().as_secs_f64());
    let (clean, rest) = up.stop();
    assert!(clean, "racekv up did not stop cleanly: {rest}");
}

/// The port of a memnode's tcp endpoint (from `up.json`).
fn tcp_port(memnode: &serde_json::Value) -> u16 {
    let endpoints = memnode["endpoints"].as_array().expect("endpoints");
    let tcp = endpoints.iter().filter_map(|e| e.as_str()?.strip_prefix("tcp:")).next().expect("a tcp endpoint");
    tcp.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
}

/// A memnode cut off from the network while this lives: iptables drops every packet on
/// loopback to or from its tcp port (its clients' connections, new ones too) and to or
/// from the local ports of its connections to etcd (so its lease lapses). The process
/// runs on; its rules go when this is dropped (a failed test too).
struct Partition {
    rules: Vec<Vec<String>>,
}

impl Partition {
    fn cut(pid: u64, port: u16, etcd_port: u16) -> Self {
        let mut ports = vec![port];
        ports.extend(etcd_connections(pid, etcd_port));
        let mut rules = Vec::new();
        for port in ports {
            for side in ["--dport", "--sport"] {
                rules.push(["INPUT", "-p", "tcp", side, &port.to_string(), "-j", "DROP"].map(String::from).to_vec());
            }
        }
        for rule in &rules {
            iptables("-I", rule);
        }
        Self { rules }
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        for rule in &self.rules {
            iptables("-D", rule);
        }
    }
}

fn iptables(action: &str, rule: &[String]) {
    let status = std::process::Command::new("iptables").args(["-w", action]).args(rule).status();
    assert!(status.is_ok_and(|s| s.success()), "iptables {action} {rule:?} failed (root and iptables needed)");
}

/// The local ports of process `pid`'s established tcp connections to `etcd_port`.
fn etcd_connections(pid: u64, etcd_port: u16) -> Vec<u16> {
    let out = std::process::Command::new("ss").args(["-tnpH", "state", "established"]).output().expect("ss");
    let text = String::from_utf8_lossy(&out.stdout);
    let port_of = |address: &str| address.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    text.lines()
        .filter(|line| line.contains(&format!("pid={pid},")))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // Recv-Q Send-Q Local Peer Process (the state filter drops the State column).
            let (local, peer) = (port_of(fields.get(2)?)?, port_of(fields.get(3)?)?);
            (peer == etcd_port).then_some(local)
        })
        .collect()
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

/// What each memnode of the cluster map holds for `key` (read from its table alone), so a
/// violation shows whether replicas differ.
fn print_copies(etcd_port: u16, key: &str) {
    let Ok(Some((map, _))) = etcd(etcd_port).and_then(|e| e.map()) else { return };
    println!("{key} on each memnode of map epoch {} (partitions: {:?}):", map.epoch, map.partitions);
    for m in &map.memnodes {
        let read = racekv_client::ClientBuilder::default()
            .memnode(m.endpoints[0].clone())
            .connect()
            .and_then(|c| c.get(key.as_bytes()));
        let shown = read.map(|v| v.map(|v| String::from_utf8_lossy(&v).into_owned()));
        println!("  {:#x} {}: {shown:?}", m.node_id, m.endpoints[0]);
    }
}
