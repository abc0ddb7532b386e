//! `racekv up --replicas R`: a coordinated cluster on this machine (issue 17, item 5): a
//! local etcd, each memnode its own child process, and a computenode in this process
//! routing by the cluster map. A memnode that dies is started again on its data file (what
//! it acknowledged is there), so `kill -9` of one shows the cluster heal. The state of the
//! children (pids, states, restarts, partitions) is written to `up.json` in the runtime
//! directory, where `racekv status` finds it.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_coord::etcd::Etcd;
use racekv_coord::local_etcd::{self, LocalEtcd, LocalEtcdConfig};
use racekv_coord::map::DEFAULT_PARTITIONS_PER_MEMNODE;
use racekv_coord::ClusterMap;
use serde::{Deserialize, Serialize};

/// The cluster's name in the local etcd.
const CLUSTER: &str = racekv_coord::keys::DEFAULT_CLUSTER_NAME;
/// The state file `racekv status` reads, in the runtime directory.
pub const STATE_FILE: &str = "up.json";
/// How long a memnode child may take to print READY, and etcd to answer.
const START_WAIT: Duration = Duration::from_secs(30);
/// How long to wait for every memnode to register in etcd.
const REGISTER_WAIT: Duration = Duration::from_secs(30);
/// How often the supervisor looks at its children.
const SUPERVISE_INTERVAL: Duration = Duration::from_millis(100);
/// A memnode that dies this soon after its start, [`MAX_QUICK_DEATHS`] times in a row, is
/// left down (its log says why) instead of restarted forever. Quick deaths have transient
/// causes too (etcd itself restarting), so the supervisor backs off and tries for a while.
const QUICK_DEATH: Duration = Duration::from_secs(5);
const MAX_QUICK_DEATHS: u32 = 30;
/// Before the n-th quick restart in a row, the supervisor waits n times this, at most
/// [`MAX_RESTART_BACKOFF`].
const RESTART_BACKOFF: Duration = Duration::from_millis(200);
const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(2);
/// How long a stopping memnode gets after SIGTERM before SIGKILL.
const STOP_WAIT: Duration = Duration::from_secs(10);
/// The memnodes' etcd lease: a memnode silent this long is failed over (with replicas).
const MEMNODE_LEASE_MS: u64 = 1_000;
/// How often failover looks at the registrations.
const FAILOVER_CHECK: Duration = Duration::from_millis(200);
/// Most keys a rejoin copies per second (room for the workload on one machine).
const HEAL_KEYS_PER_SECOND: u64 = 50_000;
/// How long partitions stay short of R before the other memnodes take copies (the
/// supervisor usually has the lost one back well before).
const RE_REPLICATE_AFTER: Duration = Duration::from_secs(60);
/// How often the supervisor reads the cluster map (for `up.json`).
const MAP_READ_INTERVAL: Duration = Duration::from_secs(1);

/// What `racekv up --replicas` was asked for.
pub struct Settings {
    pub memnodes: usize,
    pub replicas: u8,
    pub region_bytes: u64,
    pub data_dir: Option<PathBuf>,
    pub base_port: u16,
    pub etcd_port: u16,
    pub redis_port: u16,
    pub remote_port: u16,
    pub max_workers: usize,
    pub metrics_addr: Option<SocketAddr>,
    pub token: String,
    /// The runtime directory: memnode sockets, the computenode's attach socket, `up.json`.
    pub run_dir: PathBuf,
    /// Memnodes listen on tcp only (no shm socket: every client reaches them over tcp).
    pub tcp_only: bool,
}

/// One memnode child as the state file shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemnodeState {
    pub index: usize,
    pub pid: u32,
    /// `running`, `restarting`, or `failed` (died at start too often; see its log).
    pub state: String,
    pub restarts: u32,
    pub endpoints: Vec<String>,
    pub metrics: Option<String>,
    /// Partitions it is the primary of in the cluster map.
    pub primary_partitions: usize,
    /// Partitions it holds a copy of without being their primary.
    #[serde(default)]
    pub backup_partitions: usize,
    pub log: PathBuf,
}

/// The state file: what `racekv up --replicas` runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterState {
    /// The `racekv up` process.
    pub pid: u32,
    pub etcd: String,
    pub etcd_pid: u32,
    pub cluster: String,
    pub replicas: u8,
    pub map_epoch: u64,
    pub data_dir: PathBuf,
    pub memnodes: Vec<MemnodeState>,
}

/// A memnode child process.
struct MemnodeChild {
    index: usize,
    child: Child,
    started: Instant,
    quick_deaths: u32,
    state: MemnodeState,
}

/// Everything the supervisor watches.
struct Children {
    etcd: LocalEtcd,
    memnodes: Vec<MemnodeChild>,
    state: ClusterState,
}

/// Runs the cluster until SIGINT or SIGTERM.
pub fn run(s: Settings) -> anyhow::Result<()> {
    anyhow::ensure!((1..=64).contains(&s.memnodes), "--memnodes must be within 1..=64");
    anyhow::ensure!(
        (1..=racekv_coord::map::MAX_REPLICAS).contains(&s.replicas),
        "--replicas must be within 1..={}",
        racekv_coord::map::MAX_REPLICAS
    );
    anyhow::ensure!(
        usize::from(s.replicas) <= s.memnodes,
        "--replicas {} needs at least as many --memnodes (each replica of a partition is on another memnode)",
        s.replicas
    );
    racekv_coord::check_settings(CLUSTER)?;
    anyhow::ensure!(
        local_etcd::installed(),
        "racekv up --replicas starts a local etcd, and no `{}` is on PATH: install it \
         (`apt-get install etcd-server` on Debian), or run `racekv up` without --replicas for a \
         fixed ring of in-process memnodes",
        local_etcd::ETCD_PROGRAM
    );
    let memnode_program = sibling_program("racekv-memnode")?;
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])?;

    // A data directory of the user's survives; otherwise a temporary one, removed at the end.
    let temporary = match &s.data_dir {
        Some(_) => None,
        None => Some(tempfile::Builder::new().prefix("racekv-up-").tempdir().context("creating a data directory")?),
    };
    let data_dir = s.data_dir.clone().unwrap_or_else(|| temporary.as_ref().expect("made").path().to_path_buf());
    let logs = data_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    std::fs::create_dir_all(&s.run_dir).with_context(|| format!("creating {}", s.run_dir.display()))?;

    let etcd = LocalEtcd::start(
        LocalEtcdConfig {
            data_dir: data_dir.join("etcd"),
            client_port: s.etcd_port,
            also_listen_on: Vec::new(),
            peer_port: s.etcd_port.checked_add(1).context("--etcd-port must leave room for the peer port")?,
            log_file: Some(logs.join("etcd.log")),
        },
        START_WAIT,
    )
    .context("starting the local etcd")?;
    let endpoint = etcd.endpoint();

    let mut memnodes = Vec::with_capacity(s.memnodes);
    for index in 0..s.memnodes {
        let child = start_memnode(&memnode_program, &s, &data_dir, &endpoint, index, 0)
            .with_context(|| format!("starting memnode {index}"))?;
        memnodes.push(child);
    }
    let map = first_map(&endpoint, s.memnodes, s.replicas)?;
    let state = ClusterState {
        pid: std::process::id(),
        etcd: endpoint.clone(),
        etcd_pid: etcd.pid(),
        cluster: CLUSTER.into(),
        replicas: map.replicas,
        map_epoch: map.epoch,
        data_dir: data_dir.clone(),
        memnodes: Vec::new(),
    };
    let children = Arc::new(Mutex::new(Children { etcd, memnodes, state }));
    {
        let mut c = lock(&children);
        count_partitions(&mut c, &map);
        write_state(&s.run_dir, &mut c);
    }

    let computenode = Computenode::start(ComputenodeConfig {
        etcd_endpoints: vec![endpoint.clone()],
        cluster: CLUSTER.into(),
        token: s.token.clone(),
        redis_addr: Some(format!("127.0.0.1:{}", s.redis_port)),
        remote_addr: Some(format!("127.0.0.1:{}", s.remote_port)),
        max_workers: s.max_workers,
        metrics_addr: s.metrics_addr,
        // Half the memnodes' lease: cut off from etcd, it stops before a memnode cut off
        // with it could be failed over.
        map_lease_ms: MEMNODE_LEASE_MS / 2,
        ..ComputenodeConfig::default()
    })
    .context("starting the computenode")?;

    // With replicas, a memnode whose lease lapses (stopped, or dead and not back within
    // its lease) leaves its replica sets: its partitions go on on their other replicas.
    // And a memnode back (restarted on its data file, or resumed) rejoins them, caught up.
    let (failover, healer) = if s.replicas > 1 {
        let etcd = || Etcd::connect(std::slice::from_ref(&endpoint), CLUSTER, racekv_coord::DEFAULT_ETCD_TIMEOUT);
        let (endpoints, token) = (vec![endpoint.clone()], s.token.clone());
        let client = move || {
            Ok(racekv_client::Client::builder()
                .etcd(endpoints.clone(), CLUSTER)
                .token(token.clone())
                .timeout(Duration::from_secs(10))
                .connect()?)
        };
        let policy = crate::healer::HealPolicy {
            max_keys_per_second: HEAL_KEYS_PER_SECOND,
            re_replicate_after: RE_REPLICATE_AFTER,
        };
        (
            Some(racekv_coord::failover::Failover::start(etcd()?, FAILOVER_CHECK)?),
            Some(crate::healer::Healer::start(etcd()?, client, policy)?),
        )
    } else {
        (None, None)
    };
    let stopping = Arc::new(AtomicBool::new(false));
    let supervisor = {
        let (children, stopping) = (Arc::clone(&children), Arc::clone(&stopping));
        let (program, settings_dir, run_dir) = (memnode_program.clone(), data_dir.clone(), s.run_dir.clone());
        let spawn_settings = SpawnSettings::from(&s);
        std::thread::Builder::new().name("up-supervisor".into()).spawn(move || {
            supervise(&children, &stopping, &program, &spawn_settings, &settings_dir, &run_dir);
        })?
    };

    print_banner(&s, &lock(&children).state, &computenode);
    let signal = signals.forever().next();
    println!("stopping (signal {signal:?})");
    stopping.store(true, Ordering::Release);
    let _ = supervisor.join();
    // Before the memnodes stop: their leases lapsing now is no failure to act on.
    drop(healer);
    drop(failover);
    computenode.shutdown();
    let mut c = lock(&children);
    for m in &mut c.memnodes {
        racekv_telemetry::child::stop(&mut m.child, STOP_WAIT);
    }
    c.etcd.stop();
    let _ = std::fs::remove_file(s.run_dir.join(STATE_FILE));
    drop(c);
    drop(temporary);
    println!("stopped cleanly");
    Ok(())
}

/// What a memnode child is started with (the settings a restart needs again).
#[derive(Clone)]
struct SpawnSettings {
    region_bytes: u64,
    base_port: u16,
    token: String,
    run_dir: PathBuf,
    tcp_only: bool,
}

impl From<&Settings> for SpawnSettings {
    fn from(s: &Settings) -> Self {
        Self {
            region_bytes: s.region_bytes,
            base_port: s.base_port,
            token: s.token.clone(),
            run_dir: s.run_dir.clone(),
            tcp_only: s.tcp_only,
        }
    }
}

/// A program installed beside this one (cargo builds the workspace's binaries together).
fn sibling_program(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("locating the racekv binary")?;
    let path = me.with_file_name(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found beside {}: build the whole workspace (`cargo build --features etcd`)",
        name,
        me.display()
    );
    Ok(path)
}

fn start_memnode(
    program: &Path,
    s: impl Into<SpawnSettings>,
    data_dir: &Path,
    etcd: &str,
    index: usize,
    restarts: u32,
) -> anyhow::Result<MemnodeChild> {
    let s: SpawnSettings = s.into();
    let log_path = data_dir.join("logs").join(format!("memnode-{index}.log"));
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
    let port = s.base_port.checked_add(u16::try_from(index)?).context("memnode port past 65535")?;
    let mut child = Command::new(program)
        .arg("--region-bytes")
        .arg(s.region_bytes.to_string())
        .arg("--data-file")
        .arg(data_dir.join(format!("memnode-{index}.region")))
        .args(match s.tcp_only {
            true => vec![],
            false => vec!["--listen-shm".into(), s.run_dir.join(format!("memnode-{index}.sock")).into_os_string()],
        })
        .args(["--listen-tcp", &format!("127.0.0.1:{port}"), "--metrics-addr", "127.0.0.1:0"])
        .args(["--etcd", etcd, "--cluster", CLUSTER])
        .env("RACEKV_MEMNODE_TOKEN", &s.token)
        .env("RACEKV_MEMNODE_ETCD_LEASE_MS", MEMNODE_LEASE_MS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log.try_clone()?))
        .spawn()
        .with_context(|| format!("running {}", program.display()))?;
    // READY comes on stdout; everything after it goes to the log.
    let stdout = child.stdout.take().expect("piped");
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::Builder::new().name(format!("memnode-{index}-out")).spawn(move || {
        let mut log = log;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            match line.strip_prefix("READY ") {
                Some(json) => {
                    let _ = ready_tx.send(json.to_string());
                }
                None => {
                    let _ = writeln!(log, "{line}");
                }
            }
        }
    })?;
    let ready = match ready_rx.recv_timeout(START_WAIT) {
        Ok(json) => json,
        Err(_) => {
            racekv_telemetry::child::stop(&mut child, STOP_WAIT);
            anyhow::bail!("it did not print READY within {START_WAIT:?}; its log: {}", log_tail(&log_path));
        }
    };
    let ready: serde_json::Value = serde_json::from_str(&ready).context("its READY line")?;
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect()
    };
    let state = MemnodeState {
        index,
        pid: child.id(),
        state: "running".into(),
        restarts,
        endpoints: strings(&ready["endpoints"]),
        metrics: ready["metrics"].as_str().map(String::from),
        primary_partitions: 0,
        backup_partitions: 0,
        log: log_path,
    };
    Ok(MemnodeChild { index, child, started: Instant::now(), quick_deaths: 0, state })
}

/// The cluster's map: the one in etcd (a reused data directory), or a first one written
/// once all `memnodes` registered.
fn first_map(endpoint: &str, memnodes: usize, replicas: u8) -> anyhow::Result<ClusterMap> {
    let etcd = Etcd::connect(&[endpoint.to_string()], CLUSTER, racekv_coord::DEFAULT_ETCD_TIMEOUT)?;
    let deadline = Instant::now() + REGISTER_WAIT;
    loop {
        if let Some((map, _)) = etcd.map()? {
            anyhow::ensure!(
                map.memnodes.len() == memnodes,
                "the data directory's cluster has {} memnodes, not {memnodes}: use another --data-dir \
                 (moving partitions to new memnodes is not built yet)",
                map.memnodes.len()
            );
            return Ok(map);
        }
        let registered = etcd.memnodes()?;
        if registered.len() >= memnodes {
            let map = ClusterMap::initial(registered, replicas, DEFAULT_PARTITIONS_PER_MEMNODE)?;
            if etcd.put_map(&map, None)?.is_some() {
                return Ok(map);
            }
            continue;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} of {memnodes} memnodes registered in etcd within {REGISTER_WAIT:?}",
            registered.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Each memnode's partitions (as primary, as backup), matched by its endpoints, and the
/// map's epoch.
fn count_partitions(c: &mut Children, map: &ClusterMap) {
    c.state.map_epoch = map.epoch;
    for m in &mut c.memnodes {
        let node = map.memnodes.iter().find(|info| info.endpoints.iter().any(|e| m.state.endpoints.contains(e)));
        let Some(id) = node.map(|n| n.node_id) else { continue };
        m.state.primary_partitions = map.partitions.iter().filter(|set| set.first() == Some(&id)).count();
        m.state.backup_partitions = map.partitions.iter().filter(|set| set[1..].contains(&id)).count();
    }
}

fn write_state(run_dir: &Path, c: &mut Children) {
    c.state.etcd_pid = c.etcd.pid();
    c.state.memnodes = c.memnodes.iter().map(|m| m.state.clone()).collect();
    let path = run_dir.join(STATE_FILE);
    let temp = run_dir.join(format!("{STATE_FILE}.tmp"));
    let written = serde_json::to_vec_pretty(&c.state)
        .map_err(std::io::Error::other)
        .and_then(|bytes| std::fs::write(&temp, bytes))
        .and_then(|()| std::fs::rename(&temp, &path));
    if let Err(e) = written {
        tracing::warn!("writing {}: {e}", path.display());
    }
}

/// Restarts what dies: etcd on its data, a memnode on its data file.
fn supervise(
    children: &Mutex<Children>,
    stopping: &AtomicBool,
    program: &Path,
    s: &SpawnSettings,
    data_dir: &Path,
    run_dir: &Path,
) {
    let etcd_endpoint = lock(children).state.etcd.clone();
    let etcd = Etcd::connect(&[etcd_endpoint], CLUSTER, racekv_coord::DEFAULT_ETCD_TIMEOUT).ok();
    let mut map_read = Instant::now();
    while !stopping.load(Ordering::Acquire) {
        std::thread::sleep(SUPERVISE_INTERVAL);
        let map = match &etcd {
            Some(etcd) if map_read.elapsed() >= MAP_READ_INTERVAL => {
                map_read = Instant::now();
                etcd.map().ok().flatten().map(|(map, _)| map)
            }
            _ => None,
        };
        let mut c = lock(children);
        let mut changed = false;
        if let Some(map) = map.filter(|m| m.epoch != c.state.map_epoch) {
            println!("cluster map epoch {}: {}", map.epoch, describe_sets(&map, &c));
            count_partitions(&mut c, &map);
            changed = true;
        }
        if c.etcd.exited() {
            println!("etcd (pid {}) exited; starting it again on its data", c.etcd.pid());
            if let Err(e) = c.etcd.restart(START_WAIT) {
                println!("etcd did not come back: {e}");
            }
            changed = true;
        }
        let endpoint = c.state.etcd.clone();
        for m in &mut c.memnodes {
            if m.state.state == "failed" {
                continue;
            }
            let Ok(Some(status)) = m.child.try_wait() else { continue };
            changed = true;
            let quick = m.started.elapsed() < QUICK_DEATH;
            m.quick_deaths = if quick { m.quick_deaths + 1 } else { 0 };
            if m.quick_deaths >= MAX_QUICK_DEATHS {
                m.state.state = "failed".into();
                println!(
                    "memnode {} (pid {}) exited ({status}) {} times right after starting; left down. Its log: {}",
                    m.index,
                    m.state.pid,
                    m.quick_deaths,
                    m.state.log.display()
                );
                continue;
            }
            println!("memnode {} (pid {}) exited ({status}); starting it again on its data file", m.index, m.state.pid);
            // Dying right after a start (a port still taken, say): back off a little more each time.
            std::thread::sleep((RESTART_BACKOFF * m.quick_deaths).min(MAX_RESTART_BACKOFF));
            match start_memnode(program, s.clone(), data_dir, &endpoint, m.index, m.state.restarts + 1) {
                Ok(mut fresh) => {
                    fresh.quick_deaths = m.quick_deaths;
                    fresh.state.primary_partitions = m.state.primary_partitions;
                    println!("memnode {} is back (pid {})", m.index, fresh.state.pid);
                    *m = fresh;
                }
                Err(e) => {
                    println!("memnode {} did not start again: {e:#}", m.index);
                    m.state.state = "restarting".into();
                    m.started = Instant::now();
                }
            }
        }
        if changed {
            write_state(run_dir, &mut c);
        }
    }
}

/// Which memnodes hold no partition in `map` (failed over), for the supervisor's log.
fn describe_sets(map: &ClusterMap, c: &Children) -> String {
    let out: Vec<String> = c
        .memnodes
        .iter()
        .filter(|m| {
            let node = map.memnodes.iter().find(|info| info.endpoints.iter().any(|e| m.state.endpoints.contains(e)));
            node.is_some_and(|n| !map.partitions.iter().flatten().any(|&id| id == n.node_id))
        })
        .map(|m| format!("memnode {}", m.index))
        .collect();
    match out.is_empty() {
        true => "every memnode holds partitions".into(),
        false => {
            format!(
                "{} failed over, out of every replica set (the healer makes it a replica again once it is back)",
                out.join(", ")
            )
        }
    }
}

fn lock(children: &Mutex<Children>) -> std::sync::MutexGuard<'_, Children> {
    children.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The last lines of a log, for an error message.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

fn print_banner(s: &Settings, state: &ClusterState, computenode: &Computenode) {
    println!(
        "racekv is up: {} memnode process(es), R = {}, cluster map epoch {} in a local etcd",
        state.memnodes.len(),
        state.replicas,
        state.map_epoch
    );
    println!("  etcd:        {} (pid {})", state.etcd, state.etcd_pid);
    for m in &state.memnodes {
        println!(
            "  memnode {}:   pid {:<8} {} partitions ({} more as a backup)   {}",
            m.index,
            m.pid,
            m.primary_partitions,
            m.backup_partitions,
            m.endpoints.join("  ")
        );
    }
    let redis = computenode.redis_addr().expect("configured");
    println!("  computenode: Redis protocol on {redis}, in this process (pid {})", std::process::id());
    if let Some(socket) = &computenode.status().attach_socket {
        println!("  attach:      {socket}");
    }
    if let Some(addr) = computenode.metrics_addr() {
        println!("  metrics:     http://{addr}/metrics   status: http://{addr}/status");
    }
    let kept = if s.data_dir.is_some() { "kept after Ctrl-C" } else { "removed at Ctrl-C" };
    println!("  data, logs:  {} ({kept})", state.data_dir.display());
    println!();
    println!("try, from another shell:");
    println!("  redis-cli -p {} set greeting hello", redis.port());
    println!("  racekv status              (each memnode's pid, state and partitions)");
    println!("  kill -9 <a memnode's pid>  (it is started again on its data file; nothing acknowledged is lost)");
    if state.replicas > 1 {
        println!(
            "  kill -STOP <a memnode's pid>  (silent past its {MEMNODE_LEASE_MS} ms lease, it is failed over: \
             its partitions go on on their other replicas)"
        );
    }
    println!("Ctrl-C stops the cluster.");
}

/// The local cluster `racekv up --replicas` runs, if its state file in `run_dir` names a
/// live process.
pub fn local_cluster(run_dir: &Path) -> Option<ClusterState> {
    let bytes = std::fs::read(run_dir.join(STATE_FILE)).ok()?;
    let state: ClusterState = serde_json::from_slice(&bytes).ok()?;
    let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(state.pid as i32), None).is_ok();
    alive.then_some(state)
}

/// `racekv status`'s lines for a local cluster.
pub fn print_local_cluster(state: &ClusterState) {
    println!();
    println!(
        "local cluster (racekv up, pid {}): etcd {} (pid {}), cluster {}, R = {}, map epoch {}",
        state.pid, state.etcd, state.etcd_pid, state.cluster, state.replicas, state.map_epoch
    );
    println!(
        "  {:<8} {:<8} {:<13} {:>8} {:>8} {:>8}  ENDPOINTS",
        "MEMNODE", "PID", "STATE", "RESTARTS", "PRIMARY", "BACKUP"
    );
    for m in &state.memnodes {
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(m.pid as i32), None).is_ok();
        let out_of_map = state.replicas > 1 && m.primary_partitions + m.backup_partitions == 0;
        let shown = match (m.state.as_str(), alive, out_of_map) {
            ("running", false, _) => "down",
            ("running", true, true) => "failed-over",
            (state, _, _) => state,
        };
        println!(
            "  {:<8} {:<8} {:<13} {:>8} {:>8} {:>8}  {}",
            m.index,
            m.pid,
            shown,
            m.restarts,
            m.primary_partitions,
            m.backup_partitions,
            m.endpoints.join(" ")
        );
    }
}
