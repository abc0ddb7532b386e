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
//! failed may or may not have happened) with every acknowledged write in it
//! (`workload/mod.rs`). Network partitions, with memnodes in namespaces: `partitions.rs`.
//!
//! `RACEKV_FAULTS` (default 50 with R = 1, 30 with R = 2) faults;
//! `RACEKV_FAULT_SEED` replays a run (the seed is printed). `ops/test.sh` runs them all; by
//! hand:
//!
//! ```sh
//! cargo build -p racekv -p racekv-memnode --features racekv/etcd,racekv-memnode/etcd
//! cargo test --features etcd --test faults -- --nocapture
//! ```
#![cfg(feature = "etcd")]

mod common;
mod workload;

use std::time::{Duration, Instant};

use common::{alive, free_ports, memnode_pids, signal, Children, Up};
use rand::{Rng, SeedableRng};
use workload::{etcd, print_copies, wait_whole, Workload};

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

/// `faults` (or `RACEKV_FAULTS`) faults against `racekv up --replicas <replicas>`.
fn run_faults(replicas: &str, faults: usize) {
    let faults: usize = std::env::var("RACEKV_FAULTS").ok().and_then(|v| v.parse().ok()).unwrap_or(faults);
    let seed: u64 = std::env::var("RACEKV_FAULT_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(rand::random);
    println!(
        "R = {replicas}: fault seed {seed} (RACEKV_FAULT_SEED={seed} replays the injector's choices), {faults} faults"
    );
    let etcd_port = free_ports(2);
    let etcd_port_text = etcd_port.to_string();
    let args = ["--memnodes", "3", "--replicas", replicas, "--etcd-port", &etcd_port_text, "--region-bytes", "64MiB"];
    let up = Up::start(&args);
    let mut guard = Children::of(&up.local_cluster());

    let workload = Workload::new(up.redis, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut log: Vec<String> = Vec::new();
    let started = workload.started;
    println!(
        "R = {replicas}: the faults begin at {:?} (the times below count from then)",
        std::time::SystemTime::now()
    );
    std::thread::scope(|s| {
        // However the injector ends (a failed check panics), the clients stop.
        let _stop = workload.run_clients(s);
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
            let kind = if replicas != "1" && n % 10 == 5 { 12 } else { rng.random_range(0..kinds) };
            match kind {
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
        workload.stop();
    });
    println!("faults: {}", log.join("; "));

    let token = racekv_memnode::config::DEV_TOKEN;
    workload.check(&format!("seed {seed}; {}", log.join("; ")), |key| print_copies(etcd_port, token, key));
    let (clean, rest) = up.stop();
    assert!(clean, "racekv up did not stop cleanly: {rest}");
}
