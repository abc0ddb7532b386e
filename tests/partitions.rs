//! Network partitions under load (issue 17, item 6), with each memnode in a network
//! namespace of its own: a veth pair links namespace `i` (the memnode at 10.X.i.2:7400) to
//! this one (10.X.i.1), where etcd (on loopback and on each link's address), the
//! computenode (in this process, its Redis port on loopback), `racekv cluster manage
//! --heal` and the client threads run. A memnode is cut off by iptables rules inside its
//! namespace, on its link only:
//! - whole: nothing in or out, for 0.2 to 1.2 s (requests to it stall, then resume) or 2.5
//!   to 3.5 s (its 1 s lease lapses: failed over while it still runs, with stale beliefs,
//!   then healed and rejoined);
//! - from etcd only, for 2.5 to 3.5 s: its lease lapses while its clients still reach it
//!   (the map's epoch must fence it);
//! - from its clients only, for 0.2 to 1.2 s: it keeps its lease;
//!
//! among SIGKILLs (the test starts it again in its namespace on its data file, as a
//! supervisor would) and SIGSTOPs. R = 2 over tcp. The clients' recorded history must be
//! linearizable with every acknowledged write in it (`workload/mod.rs`).
//!
//! Needs root (namespaces, veth, iptables). `RACEKV_FAULTS` (default 20) faults;
//! `RACEKV_FAULT_SEED` replays a run (the seed is printed). By hand:
//!
//! ```sh
//! cargo build -p racekv -p racekv-memnode --features racekv/etcd,racekv-memnode/etcd
//! cargo test --features etcd --test partitions -- --nocapture
//! ```
#![cfg(feature = "etcd")]

mod common;
mod workload;

use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_ports, signal};
use racekv_coord::local_etcd::{LocalEtcd, LocalEtcdConfig};
use rand::{Rng, SeedableRng};
use workload::{print_copies, wait_whole, Workload};

const MEMNODES: usize = 3;
/// Each memnode's tcp port, in its own namespace.
const MEMNODE_PORT: u16 = 7400;
const TOKEN: &str = "partition test token";
/// The memnodes' etcd lease (as `racekv up` sets it): a memnode cut off from etcd this
/// long is failed over.
const LEASE_MS: u64 = 1_000;
const REGION_BYTES: u64 = 64 << 20;
/// How long a process may take to print READY, or the cluster to form.
const START_WAIT: Duration = Duration::from_secs(30);

#[test]
fn replicated_clients_stay_linearizable_through_network_partitions() {
    let faults: usize = std::env::var("RACEKV_FAULTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let seed: u64 = std::env::var("RACEKV_FAULT_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(rand::random);
    println!(
        "partitions: fault seed {seed} (RACEKV_FAULT_SEED={seed} replays the injector's choices), {faults} faults"
    );
    let net = Network::create(MEMNODES);
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(&net, dir.path());
    let etcd_port = cluster.etcd_port;

    let workload = Workload::new(cluster.redis_port, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut log: Vec<String> = Vec::new();
    let started = workload.started;
    println!("partitions: the faults begin at {:?} (the times below count from then)", std::time::SystemTime::now());
    std::thread::scope(|s| {
        // However the injector ends (a failed check panics), the clients stop.
        let _stop = workload.run_clients(s);
        std::thread::sleep(Duration::from_millis(300));
        for n in 0..faults {
            log.push(format!("{:.1}s", started.elapsed().as_secs_f64()));
            std::thread::sleep(Duration::from_millis(rng.random_range(100..400)));
            let victim = rng.random_range(0..MEMNODES);
            let (short, long) = (rng.random_range(200..1_200), rng.random_range(2_500..3_500));
            match rng.random_range(0..10) {
                kind @ 0..=3 => {
                    let pause = if kind < 2 { short } else { long };
                    log.push(format!("{n}: memnode {victim} cut off for {pause} ms"));
                    let _cut = net.cut(victim, Cut::Whole);
                    std::thread::sleep(Duration::from_millis(pause));
                }
                4 => {
                    log.push(format!("{n}: memnode {victim} cut off from etcd for {long} ms"));
                    let _cut = net.cut(victim, Cut::FromEtcd(etcd_port));
                    std::thread::sleep(Duration::from_millis(long));
                }
                5 => {
                    log.push(format!("{n}: memnode {victim} cut off from its clients for {short} ms"));
                    let _cut = net.cut(victim, Cut::FromClients);
                    std::thread::sleep(Duration::from_millis(short));
                }
                6..=8 => {
                    let down = rng.random_range(0..500);
                    log.push(format!("{n}: SIGKILL memnode {victim}, started again after {down} ms"));
                    cluster.kill_memnode(victim);
                    std::thread::sleep(Duration::from_millis(down));
                    cluster.start_memnode(&net, victim);
                }
                _ => {
                    log.push(format!("{n}: SIGSTOP memnode {victim} for {short} ms"));
                    cluster.pause_memnode(victim, Duration::from_millis(short));
                }
            }
        }
        // Healed whole: every memnode failed over rejoined, R restored.
        wait_whole(etcd_port, &log);
        // Let the clients run on a healed cluster for a moment, then stop them.
        std::thread::sleep(Duration::from_millis(500));
        workload.stop();
    });
    println!("faults: {}", log.join("; "));
    let epoch = workload::etcd(etcd_port).and_then(|e| e.map()).ok().flatten().map(|(map, _)| map.epoch);
    println!("map epoch at the end: {epoch:?} (failovers and rejoins each move it on)");
    workload.check(&format!("seed {seed}; {}", log.join("; ")), |key| print_copies(etcd_port, TOKEN, key));
    cluster.stop();
}

/// The namespaces and links of a run, removed when dropped (a failed test too).
struct Network {
    /// Per memnode: its namespace, the link's end in it, the end here.
    links: Vec<(String, String, String)>,
    /// The second octet of the 10.X.i.0/24 subnets.
    octet: u8,
}

/// What a cut blocks, on the memnode's link, inside its namespace.
enum Cut {
    /// Every packet, both ways.
    Whole,
    /// Its connections to etcd (on this port): its lease lapses, clients still reach it.
    FromEtcd(u16),
    /// Its clients' connections: it keeps its lease.
    FromClients,
}

impl Network {
    /// `n` namespaces, each linked to this one by a veth pair (names and subnet from this
    /// process's id, so concurrent runs do not collide).
    fn create(n: usize) -> Self {
        let tag = std::process::id() % 100_000;
        let octet = 200 + (tag % 50) as u8;
        let links = (0..n)
            .map(|i| (format!("racekv-part-{tag}-{i}"), format!("rkp{tag}n{i}"), format!("rkp{tag}h{i}")))
            .collect();
        let net = Self { links, octet };
        for (i, (ns, inside, here)) in net.links.iter().enumerate() {
            // Left over from a killed run with this process id: gone first.
            remove_link_and_namespace(here, ns);
            let (here_ip, inside_ip) = (net.host_ip(i).to_string(), net.memnode_ip(i).to_string());
            ip(&["netns", "add", ns]);
            ip(&["link", "add", here, "type", "veth", "peer", "name", inside]);
            ip(&["link", "set", inside, "netns", ns]);
            ip(&["addr", "add", &format!("{here_ip}/24"), "dev", here]);
            ip(&["link", "set", here, "up"]);
            ip(&["-n", ns, "addr", "add", &format!("{inside_ip}/24"), "dev", inside]);
            ip(&["-n", ns, "link", "set", inside, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// This namespace's address on memnode `i`'s link.
    fn host_ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, i as u8, 1)
    }

    /// Memnode `i`'s address, in its namespace.
    fn memnode_ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, i as u8, 2)
    }

    fn namespace(&self, i: usize) -> &str {
        &self.links[i].0
    }

    /// Cuts memnode `i` off as `cut` says, until the returned rules are dropped.
    fn cut(&self, i: usize, cut: Cut) -> Rules {
        let link = self.links[i].1.clone();
        let (input, output): (Vec<String>, Vec<String>) = match cut {
            Cut::Whole => (vec![], vec![]),
            Cut::FromEtcd(port) => (tcp_port("--sport", port), tcp_port("--dport", port)),
            Cut::FromClients => (tcp_port("--dport", MEMNODE_PORT), tcp_port("--sport", MEMNODE_PORT)),
        };
        let rule = |chain: &str, side: &str, filter: Vec<String>| {
            let mut rule: Vec<String> = vec![chain.into(), side.into(), link.clone()];
            rule.extend(filter);
            rule.extend(["-j".into(), "DROP".into()]);
            rule
        };
        let rules = vec![rule("INPUT", "-i", input), rule("OUTPUT", "-o", output)];
        let rules = Rules { namespace: self.namespace(i).to_string(), rules };
        for r in &rules.rules {
            assert!(rules.iptables("-I", r), "iptables -I {r:?} in {} failed (iptables needed)", rules.namespace);
        }
        rules
    }
}

fn tcp_port(side: &str, port: u16) -> Vec<String> {
    vec!["-p".into(), "tcp".into(), side.into(), port.to_string()]
}

impl Drop for Network {
    fn drop(&mut self) {
        for (ns, _, here) in &self.links {
            remove_link_and_namespace(here, ns);
        }
    }
}

/// Deletes veth `here` (its peer goes with it) and namespace `ns`, if they exist.
fn remove_link_and_namespace(here: &str, ns: &str) {
    let _ = Command::new("ip").args(["link", "del", here]).stderr(Stdio::null()).status();
    let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
}

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status();
    assert!(status.is_ok_and(|s| s.success()), "ip {args:?} failed (root and iproute2 needed)");
}

/// iptables rules in a namespace, deleted when dropped.
struct Rules {
    namespace: String,
    rules: Vec<Vec<String>>,
}

impl Rules {
    /// Whether `iptables <action> <rule>` in the namespace succeeded.
    fn iptables(&self, action: &str, rule: &[String]) -> bool {
        let status =
            Command::new("ip").args(["netns", "exec", &self.namespace, "iptables", "-w", action]).args(rule).status();
        status.is_ok_and(|s| s.success())
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        for rule in &self.rules {
            // No assertion: this runs while a failed test unwinds too (and the namespace
            // goes with the test anyway).
            let _ = self.iptables("-D", rule);
        }
    }
}

/// etcd, the memnodes (each in its namespace), the healer, and a computenode in this
/// process; every child killed when dropped.
struct Cluster {
    /// Stops as it drops.
    _etcd: LocalEtcd,
    etcd_port: u16,
    memnodes: Vec<Option<Child>>,
    manager: Child,
    computenode: Option<racekv_computenode::Computenode>,
    redis_port: u16,
    dir: PathBuf,
}

impl Cluster {
    fn start(net: &Network, dir: &Path) -> Self {
        let (etcd_port, redis_port) = (free_ports(2), free_ports(1));
        let etcd = start_etcd(net, dir, etcd_port);
        let manager = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(["cluster", "manage", "--heal", "--metrics-addr", "none", "--etcd", &local_url(etcd_port)])
            .env("RACEKV_TOKEN", TOKEN)
            .env("RACEKV_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(dir, "manager"))
            .spawn()
            .expect("racekv cluster manage");
        let mut cluster = Self {
            _etcd: etcd,
            etcd_port,
            memnodes: (0..net.links.len()).map(|_| None).collect(),
            manager,
            computenode: None,
            redis_port,
            dir: dir.to_path_buf(),
        };
        for i in 0..net.links.len() {
            cluster.start_memnode(net, i);
        }
        let init = Command::new(env!("CARGO_BIN_EXE_racekv"))
            .args(["cluster", "init", "--replicas", "2", "--etcd", &local_url(etcd_port)])
            .args(["--wait-memnodes", &net.links.len().to_string(), "--wait-s", "30"])
            .status()
            .expect("racekv cluster init");
        assert!(init.success(), "racekv cluster init failed");
        let config = racekv_computenode::config::ComputenodeConfig {
            etcd_endpoints: vec![local_url(etcd_port)],
            token: TOKEN.into(),
            redis_addr: Some(format!("127.0.0.1:{redis_port}")),
            remote_addr: None,
            attach_socket: None,
            metrics_addr: None,
            map_lease_ms: LEASE_MS / 2, // as `racekv up` sets it
            ..Default::default()
        };
        cluster.computenode = Some(racekv_computenode::Computenode::start(config).expect("the computenode starts"));
        cluster
    }

    /// Starts memnode `i` in its namespace on its data file (again, after a kill) and waits
    /// for its READY line.
    fn start_memnode(&mut self, net: &Network, i: usize) {
        assert!(self.memnodes[i].is_none(), "memnode {i} runs already");
        let program = Path::new(env!("CARGO_BIN_EXE_racekv")).with_file_name("racekv-memnode");
        assert!(program.is_file(), "{} not built: cargo build -p racekv-memnode --features etcd", program.display());
        let mut child = Command::new("ip")
            .args(["netns", "exec", net.namespace(i)])
            .arg(&program)
            .args(["--region-bytes", &REGION_BYTES.to_string()])
            .arg("--data-file")
            .arg(self.dir.join(format!("memnode-{i}.region")))
            .args(["--listen-shm", "none", "--listen-tcp", &format!("{}:{MEMNODE_PORT}", net.memnode_ip(i))])
            .args(["--metrics-addr", "none"])
            .args(["--etcd", &format!("http://{}:{}", net.host_ip(i), self.etcd_port)])
            .env("RACEKV_MEMNODE_TOKEN", TOKEN)
            .env("RACEKV_MEMNODE_ETCD_LEASE_MS", LEASE_MS.to_string())
            .env("RACEKV_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file(&self.dir, &format!("memnode-{i}")))
            .spawn()
            .expect("ip netns exec racekv-memnode");
        // `ip netns exec` execs the program: the child's pid is the memnode's.
        let stdout = child.stdout.take().expect("piped");
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("READY ") {
                    let _ = ready_tx.send(());
                }
            }
        });
        let ready = ready_rx.recv_timeout(START_WAIT);
        self.memnodes[i] = Some(child);
        assert!(
            ready.is_ok(),
            "memnode {i} did not print READY within {START_WAIT:?}: {}",
            self.log(&format!("memnode-{i}"))
        );
    }

    fn kill_memnode(&mut self, i: usize) {
        let mut child = self.memnodes[i].take().expect("memnode runs");
        let _ = child.kill();
        let _ = child.wait();
    }

    fn pause_memnode(&self, i: usize, pause: Duration) {
        let pid = self.memnodes[i].as_ref().expect("memnode runs").id().into();
        signal(pid, "STOP");
        std::thread::sleep(pause);
        signal(pid, "CONT");
    }

    /// The last lines of a child's log.
    fn log(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Stops the computenode, then every child (SIGTERM): each must exit cleanly.
    fn stop(mut self) {
        self.computenode.take().expect("the computenode runs").shutdown();
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in self.memnodes.iter_mut().flatten().chain([&mut self.manager]) {
            signal(child.id().into(), "TERM");
            let status = loop {
                match child.try_wait().expect("waitpid") {
                    Some(status) => break status,
                    None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    None => panic!("pid {} did not stop within 10 s of SIGTERM", child.id()),
                }
            };
            assert!(status.success(), "pid {} stopped with {status}", child.id());
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        drop(self.computenode.take());
        // etcd stops as it drops.
        for child in self.memnodes.iter_mut().flatten().chain([&mut self.manager]) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// etcd on loopback and on each link's address here (the memnodes reach it there), once
/// it answers.
fn start_etcd(net: &Network, dir: &Path, port: u16) -> LocalEtcd {
    let config = LocalEtcdConfig {
        data_dir: dir.join("etcd"),
        client_port: port,
        also_listen_on: (0..net.links.len()).map(|i| net.host_ip(i).into()).collect(),
        peer_port: port + 1,
        log_file: Some(dir.join("etcd.log")),
    };
    LocalEtcd::start(config, START_WAIT).expect("etcd (Debian's etcd-server: ops/install-packages.sh) starts")
}

fn local_url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

fn log_file(dir: &Path, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{name}.log"))).unwrap()
}
