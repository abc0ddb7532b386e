//! Connections' pipelined GET runs read together (`get_combiner.rs`), over real tcp
//! memnodes: every run gets its own keys' values whatever it was read with; runs keep the
//! order of consecutive GETs while a writer races them; a run that cannot be read gathered
//! (absent keys) or whose gathered read fails (a memnode gone) is read on its own, so a
//! connection whose keys are all on a live memnode never sees another's error.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use racekv_client::session::Shards;
use racekv_computenode::cluster::Cluster;
use racekv_computenode::get_combiner::{GetCombiner, MAX_GATHERED_KEYS};
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_telemetry::metric::counter_total;
use racekv_transport::TransportKind;

const READS_METRIC: &str = "racekv_computenode_gathered_get_reads_total";

fn memnodes(n: usize) -> Vec<TestMemnode> {
    (0..n).map(|_| TestMemnode::start(Via::Transport(TransportKind::Tcp), 32 << 20, 32)).collect()
}

fn cluster(memnodes: &[&TestMemnode]) -> Arc<Cluster> {
    let config = common::redis_only_config(memnodes, |_| {});
    Cluster::connect(config.cluster_options().unwrap()).unwrap()
}

/// `n` tcp memnodes, a cluster over them, and `count` key names `{prefix}-{i}`.
fn setup(n: usize, prefix: &str, count: usize) -> (Vec<TestMemnode>, Arc<Cluster>, Vec<Vec<u8>>) {
    let nodes = memnodes(n);
    let cluster = cluster(&nodes.iter().collect::<Vec<_>>());
    let names = (0..count).map(|i| format!("{prefix}-{i}").into_bytes()).collect();
    (nodes, cluster, names)
}

/// A small xorshift, so the runs differ between threads without a dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn every_run_gets_its_own_values_gathered_or_not() {
    const KEYS: usize = 300;
    const THREADS: usize = 12;
    const RUNS: usize = 150;
    let (_nodes, cluster, names) = setup(3, "gathered", KEYS);
    {
        let mut s = cluster.attach();
        for (i, n) in names.iter().enumerate() {
            // Every fifth key stays absent: runs holding one cannot be read gathered.
            if !i.is_multiple_of(5) {
                s.put(n, format!("value-{i}").as_bytes()).unwrap();
            }
        }
    }
    let expected = |i: usize| (!i.is_multiple_of(5)).then(|| format!("value-{i}").into_bytes());
    let combiner = GetCombiner::default();
    let reads_before = counter_total(READS_METRIC);
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (cluster, combiner, names, start) = (&cluster, &combiner, &names, &start);
            scope.spawn(move || {
                let mut session = cluster.attach();
                let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1);
                start.wait();
                for run in 0..RUNS {
                    // Most runs only present keys (so they can be gathered), some not.
                    let len = 1 + (next(&mut rng) % 16) as usize;
                    let with_absent = run % 7 == 0;
                    let picks: Vec<usize> = (0..len)
                        .map(|_| loop {
                            let i = (next(&mut rng) % KEYS as u64) as usize;
                            if with_absent || !i.is_multiple_of(5) {
                                break i;
                            }
                        })
                        .collect();
                    let keys: Vec<&[u8]> = picks.iter().map(|&i| &names[i][..]).collect();
                    let values = combiner.get_in_order(&mut session, &keys).unwrap();
                    let want: Vec<_> = picks.iter().map(|&i| expected(i)).collect();
                    assert_eq!(values, want, "thread {t} run {run}: keys {picks:?}");
                }
            });
        }
    });
    let gathered = counter_total(READS_METRIC) - reads_before;
    assert!(gathered > 0, "{THREADS} threads reading at once never read a gathered run");
    // A run longer than a gathered read can hold is read on its own.
    let long: Vec<&[u8]> = names.iter().map(|n| &n[..]).take(MAX_GATHERED_KEYS + 1).collect();
    let values = combiner.get_in_order(&mut cluster.attach(), &long).unwrap();
    assert_eq!(values, (0..long.len()).map(expected).collect::<Vec<_>>());
}

/// The pipeline order through writes: a writer sets keys 0..N to version v in that order,
/// again and again; readers look the keys up in reverse order, in runs of 16 that other
/// threads' runs join, so once a run sees version v of key i, every key after it in the
/// run (written before it) must be at v or newer. And a thread never sees a key go back to
/// an older version than it saw before.
#[test]
fn gathered_runs_keep_the_order_of_consecutive_gets_while_a_writer_races() {
    const KEYS: usize = 48;
    const READERS: usize = 8;
    const RUNS: usize = 300;
    let (_nodes, cluster, names) = setup(3, "ordered", KEYS);
    {
        let mut s = cluster.attach();
        for n in &names {
            s.put(n, &0u64.to_le_bytes()).unwrap();
        }
    }
    let combiner = GetCombiner::default();
    let done = AtomicBool::new(false);
    let versions_written = AtomicU64::new(0);
    let reads_before = counter_total(READS_METRIC);
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut s = cluster.attach();
            let mut version = 1u64;
            while !done.load(Ordering::Relaxed) {
                for n in &names {
                    s.put(n, &version.to_le_bytes()).unwrap();
                }
                versions_written.store(version, Ordering::Relaxed);
                version += 1;
            }
        });
        let readers: Vec<_> = (0..READERS)
            .map(|t| {
                let (cluster, combiner, names) = (&cluster, &combiner, &names);
                scope.spawn(move || {
                    let mut session = cluster.attach();
                    let mut seen: HashMap<usize, u64> = HashMap::new();
                    for run in 0..RUNS {
                        // 16 consecutive keys, highest first, starting anywhere.
                        let top = 15 + (run * 7 + t * 5) % (KEYS - 15);
                        let picks: Vec<usize> = (top - 15..=top).rev().collect();
                        let keys: Vec<&[u8]> = picks.iter().map(|&i| &names[i][..]).collect();
                        let versions: Vec<u64> = combiner
                            .get_in_order(&mut session, &keys)
                            .unwrap()
                            .iter()
                            .map(|v| u64::from_le_bytes(v.as_deref().unwrap().try_into().unwrap()))
                            .collect();
                        assert!(
                            versions.windows(2).all(|w| w[0] <= w[1]),
                            "thread {t} run {run}: a later GET saw an older write than an earlier one: {versions:?}"
                        );
                        for (&i, &v) in picks.iter().zip(&versions) {
                            let before = seen.insert(i, v).unwrap_or(0);
                            assert!(v >= before, "thread {t}: key {i} went back from version {before} to {v}");
                        }
                    }
                })
            })
            .collect();
        let results: Vec<_> = readers.into_iter().map(|r| r.join()).collect();
        done.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        results.into_iter().for_each(|r| r.unwrap());
    });
    assert!(versions_written.load(Ordering::Relaxed) > 2, "the writer wrote during the reads");
    assert!(counter_total(READS_METRIC) > reads_before, "no run was read gathered");
}

/// Runs on a memnode that is gone fail; runs whose keys are all on the live memnode are
/// answered, even when a gathered read took them with the failing ones.
#[test]
fn a_failing_gathered_read_fails_only_the_runs_that_fail_alone() {
    const THREADS: usize = 8;
    const RUNS: usize = 60;
    let mut nodes = memnodes(2);
    let cluster = cluster(&nodes.iter().collect::<Vec<_>>());
    let (mut live, mut dead) = (Vec::new(), Vec::new());
    {
        let mut s = cluster.attach();
        let dead_shard = s.shards().route(b"gathered-probe");
        for i in 0..400 {
            let key = format!("split-{i}").into_bytes();
            s.put(&key, &key).unwrap();
            if s.shards().route(&key) == dead_shard {
                dead.push(key)
            } else {
                live.push(key)
            }
        }
        // Stop the memnode holding `dead`.
        let index = nodes
            .iter()
            .position(|m| Some(m.endpoint().unwrap().to_string().as_str()) == Some(s.shards().label(dead_shard)))
            .expect("the shard's memnode is one of ours");
        nodes[index].stop();
    }
    assert!(live.len() > 16 && dead.len() > 16);
    let combiner = GetCombiner::default();
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (cluster, combiner, live, dead, start) = (&cluster, &combiner, &live, &dead, &start);
            scope.spawn(move || {
                let mut session = cluster.attach();
                start.wait();
                for run in 0..RUNS {
                    // Even threads read only live keys, odd ones a dead key among them.
                    let mut keys: Vec<&[u8]> = (0..8).map(|j| &live[(run * 8 + j + t) % live.len()][..]).collect();
                    if t % 2 == 1 {
                        keys.insert(3, &dead[(run + t) % dead.len()]);
                    }
                    let read = combiner.get_in_order(&mut session, &keys);
                    if t % 2 == 1 {
                        assert!(read.is_err(), "thread {t} run {run}: a key on a stopped memnode was read");
                    } else {
                        let values = read.unwrap_or_else(|e| panic!("thread {t} run {run}: live keys failed: {e}"));
                        assert_eq!(values, keys.iter().map(|k| Some(k.to_vec())).collect::<Vec<_>>());
                    }
                }
            });
        }
    });
}

/// Through the Redis front end: over tcp memnodes it serves a thread per connection and
/// gathers their runs (`redis_gather_gets`, on by default); many clients pipelining GETs
/// (and a SET among them, which ends a run) each get their own keys' values.
#[test]
fn redis_clients_pipelining_gets_over_tcp_get_their_own_values() {
    const CLIENTS: usize = 16;
    const PIPELINES: usize = 60;
    let nodes = memnodes(2);
    let node = common::redis_only(&nodes.iter().collect::<Vec<_>>(), |_| {});
    let url = format!("redis://{}", node.redis_addr().unwrap());
    let mut setup = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
    for i in 0..200 {
        redis::cmd("SET").arg(format!("front-{i}")).arg(format!("v{i}")).exec(&mut setup).unwrap();
    }
    let reads_before = counter_total(READS_METRIC);
    let start = Barrier::new(CLIENTS);
    std::thread::scope(|scope| {
        for t in 0..CLIENTS {
            let (url, start) = (&url, &start);
            scope.spawn(move || {
                let mut con = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
                let own = format!("own-{t}");
                start.wait();
                for p in 0..PIPELINES {
                    let mut pipe = redis::pipe();
                    let picks: Vec<usize> = (0..16).map(|j| (t * 31 + p * 17 + j * 13) % 200).collect();
                    for (j, &i) in picks.iter().enumerate() {
                        if j == 8 {
                            pipe.cmd("SET").arg(&own).arg(p).ignore();
                            pipe.cmd("GET").arg(&own);
                        }
                        pipe.cmd("GET").arg(format!("front-{i}"));
                    }
                    let got: Vec<String> = pipe.query(&mut con).unwrap();
                    let mut want: Vec<String> = picks.iter().map(|i| format!("v{i}")).collect();
                    want.insert(8, p.to_string());
                    assert_eq!(got, want, "client {t} pipeline {p}");
                }
            });
        }
    });
    assert!(counter_total(READS_METRIC) > reads_before, "{CLIENTS} pipelining clients were never read together");
}

/// Runs that all hold absent keys on every memnode cannot be read gathered: after a few
/// gathered reads give up, runs are read on their own for a while (counted), with the
/// same values.
#[test]
fn gathering_pauses_while_gathered_reads_keep_giving_up() {
    const THREADS: usize = 8;
    const RUNS: usize = 200;
    let (_nodes, cluster, names) = setup(2, "sparse", 64);
    {
        let mut s = cluster.attach();
        for n in names.iter().step_by(2) {
            s.put(n, n).unwrap();
        }
    }
    // One combiner reader at a time, so runs queue and meet.
    let combiner = GetCombiner::with_readers(1);
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (cluster, combiner, names, start) = (&cluster, &combiner, &names, &start);
            scope.spawn(move || {
                let mut session = cluster.attach();
                start.wait();
                for run in 0..RUNS {
                    // Every other key is absent: each run has absent keys on both memnodes.
                    let picks: Vec<usize> = (0..16).map(|j| (run * 5 + t * 3 + j) % names.len()).collect();
                    let keys: Vec<&[u8]> = picks.iter().map(|&i| &names[i][..]).collect();
                    let values = combiner.get_in_order(&mut session, &keys).unwrap();
                    let want: Vec<_> = picks.iter().map(|&i| i.is_multiple_of(2).then(|| names[i].clone())).collect();
                    assert_eq!(values, want, "thread {t} run {run}");
                }
            });
        }
    });
    assert!(combiner.paused_runs() > 0, "gathered reads of runs with absent keys never paused gathering");
}
