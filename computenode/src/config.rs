//! The computenode's configuration: defaults < TOML file < `RACEKV_COMPUTENODE_*`
//! environment variables < command-line flags.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use racekv_telemetry::tls::{check_server_settings, TlsAuthClients};
use racekv_transport::{ClientTls, Endpoint, ServerTlsFiles, TransportKind};
use serde::{Deserialize, Serialize};

use crate::cluster::ClusterOptions;
use crate::pool::UpgradePolicy;
use crate::workers::ScaleOptions;
use racekv_redis::acl::{Acl, AclOptions};
use racekv_redis::maxmemory::{Limit, Maxmemory, MaxmemoryPolicy, DEFAULT_SAMPLES, MAX_SAMPLES};
use racekv_redis::server::{DEFAULT_POLL_SPIN, MAX_POLL_SPIN};
use racekv_redis::IoModel;

/// The `redis_io` setting (see [`ComputenodeConfig::redis_io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RedisIo {
    /// Event loops when every memnode is on shm, threads otherwise.
    Auto,
    /// A blocking thread per connection.
    Threads,
    /// A few event loops, each serving many connections.
    EventLoop,
}

/// The settings `--print-config` masks.
pub const SECRET_KEYS: &[&str] = &["token", "requirepass"];

/// The memnodes' token when none is configured: fine on loopback, refused elsewhere.
pub const DEV_TOKEN: &str = "racekv-dev-token";

/// Most event loops `redis_event_loops` may ask for.
pub const MAX_REDIS_EVENT_LOOPS: usize = 64;

/// The compute node's settings: defaults, then the TOML file, then `RACEKV_COMPUTENODE_*`
/// variables, then flags.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComputenodeConfig {
    /// Memnode endpoints (`shm:/path`, `tcp:host:port`, `verbs:host:port`). Replaced by
    /// the cluster map's memnodes when `etcd_endpoints` is set.
    pub memnodes: Vec<String>,
    /// etcd endpoints (`http://host:port`): with them the memnodes and the routing of keys
    /// come from cluster `cluster`'s map, followed as it changes (issue 17); empty: the
    /// fixed ring over `memnodes`.
    pub etcd_endpoints: Vec<String>,
    /// The cluster's name in etcd (lowercase letters, digits, `-`).
    pub cluster: String,
    /// How long a start waits for the cluster's first map (`racekv cluster init`).
    pub etcd_map_wait_ms: u64,
    /// With etcd: commands fail (retryably) while etcd has not confirmed the cluster map
    /// for this long, since a computenode cut off from etcd may miss a failover (0: never).
    /// Keep it under two thirds of the memnodes' `etcd_lease_ms`.
    pub map_lease_ms: u64,
    /// The memnodes' shared secret.
    pub token: String,
    /// Pre-initialized connections per memnode (the pool virtual connections share).
    pub connections_per_memnode: usize,
    /// Longest wait for connecting and for any one operation.
    pub op_timeout_ms: u64,
    /// How long freed KV blocks wait before reuse (a memnode's `grace_period_ms`, if
    /// longer, wins).
    pub grace_period_ms: u64,
    /// Sessions kept pre-initialized for attach.
    pub ready_sessions: usize,
    /// Heap chunks kept prefetched per memnode.
    pub prefetch_chunks: usize,
    /// A virtual connection above this many operations per second gets a dedicated
    /// connection in the background (0 never upgrades).
    pub upgrade_ops_per_sec: u64,
    /// Workers that run even when idle.
    pub min_workers: usize,
    /// Most workers the autoscaler adds.
    pub max_workers: usize,
    /// Add workers when this many requests wait...
    pub scale_up_queue_depth: usize,
    /// ...or when a request waited this long.
    pub scale_up_wait_us: u64,
    /// Idle workers above the minimum retire after this long.
    pub worker_idle_ms: u64,
    /// Requests the work queue holds before refusing (overload).
    pub queue_capacity: usize,
    /// Redis (RESP2) front end address; unset turns it off.
    pub redis_addr: Option<String>,
    /// The `default` user's password (Redis' `requirepass`) for the Redis and remote front
    /// ends and the attach socket. Unset: no password (see `protected_mode`). Better kept
    /// in a file: `requirepass_file = "/path"` reads it from there (one line), so it sits in
    /// neither argv nor the environment.
    pub requirepass: Option<String>,
    /// Redis' `aclfile`: users, passwords (hashed) and permissions, read at start and by
    /// `ACL LOAD`, written by `ACL SAVE`.
    pub aclfile: Option<PathBuf>,
    /// Redis' protected mode: while the default user has no password, the front ends serve
    /// only loopback clients.
    pub protected_mode: bool,
    /// A Redis port that speaks only TLS (Redis' `tls-port`), beside `redis_addr`; needs
    /// `tls_cert_file` and `tls_key_file`.
    pub redis_tls_addr: Option<String>,
    /// TLS certificate chain (PEM, leaf first) of the front ends: the Redis TLS port, and the
    /// remote front end, which then speaks only TLS. Re-read with the key and CA on SIGHUP
    /// (new connections get the new certificate; a failed reload keeps the old one).
    pub tls_cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM).
    pub tls_key_file: Option<PathBuf>,
    /// CA (PEM) that client certificates must chain to.
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificates on the front ends' TLS: `no`, `optional` or `yes`.
    pub tls_auth_clients: TlsAuthClients,
    /// CA (PEM) to trust for memnodes that speak TLS (`tcp:` endpoints); unset: plain tcp.
    pub memnode_tls_ca_file: Option<PathBuf>,
    /// This computenode's certificate and key for memnodes that require client certificates.
    pub memnode_tls_cert_file: Option<PathBuf>,
    /// The private key (PEM) of `memnode_tls_cert_file`.
    pub memnode_tls_key_file: Option<PathBuf>,
    /// The name the memnodes' certificates carry (default: each endpoint's host).
    pub memnode_tls_server_name: Option<String>,
    /// Redis connections served at once; more are refused (Redis' `maxclients`).
    pub redis_max_clients: usize,
    /// How the Redis front end serves its connections: `threads` (a blocking thread per
    /// connection), `event_loop` (a few event loops, each serving many connections inline,
    /// as redis-server does), or `auto`: event loops when every memnode is on shm (a
    /// storage call is a few memory accesses), threads otherwise (a storage call waits for
    /// the network, and would hold up every other client of its loop).
    pub redis_io: RedisIo,
    /// Event loops for `redis_io = event_loop` (0: one per two cores, at least two where
    /// there are two cores; 1 to 8).
    pub redis_event_loops: usize,
    /// How long an event loop that just served something keeps polling before it sleeps
    /// (at most 1000; 0 sleeps at once): a request arriving meanwhile costs its client no
    /// wake-up of a sleeping thread, for at most this much CPU per busy spell.
    pub redis_poll_spin_us: u64,
    /// With a thread per connection (`redis_io`), a connection's run of pipelined GETs
    /// that arrives while another connection's is being read waits, and the next reader
    /// reads every waiting run as one (`get_combiner.rs`): over tcp a few round trips and
    /// wake-ups for many connections' runs instead of a few for each. Off: each connection
    /// reads its own.
    pub redis_gather_gets: bool,
    /// host:port for remote clients (the request/reply model over RPC); unset turns it off.
    /// They authenticate with `token`.
    pub remote_addr: Option<String>,
    /// Unix socket where local processes attach (a shared-memory ring each; only this
    /// user's processes and root may). Default: where clients look for it,
    /// `racekv_client::default_attach_socket()`. Unset turns it off.
    pub attach_socket: Option<PathBuf>,
    /// A process attaching without credentials, as the daemon's own user or root, is the
    /// `default` user without its password. Off: it must give a user and password
    /// (`ClientBuilder::user`, `password`) unless the default user needs none.
    pub attach_trust_uid: bool,
    /// Lend attached clients that ask for them (`ClientBuilder::borrow_connections`)
    /// connections to the memnodes, so they run key operations themselves, when their user
    /// may do everything, no maxmemory is set and the memnodes are shm ones on a fixed ring
    /// (see `lending.rs`). Off: every attached client goes through the ring.
    pub attach_lend: bool,
    /// Bytes the attach and remote front ends hold, in all, for requests and replies too
    /// large for one ring slot or RPC while they travel in parts (past it, such a request
    /// gets an `Overloaded` error). Each client or user may hold as much (at least one
    /// maximal request, about 1 GiB, must fit for the largest items to get through).
    pub staging_budget_bytes: u64,
    /// A request or reply in parts that its client leaves untouched this long is dropped.
    pub staging_idle_timeout_ms: u64,
    /// Prometheus `/metrics` and JSON `/status`; unset turns it off.
    pub metrics_addr: Option<SocketAddr>,
    /// Cache mode: bytes of live data each memnode may hold (0: no limit), in bytes or
    /// with Redis' units (`"100mb"`, `"1gb"`), or a share of each memnode's region
    /// (`"50%"`). See ARCHITECTURE.md, "Cache mode", for what counts. `CONFIG SET
    /// maxmemory` changes it at run time.
    #[serde(deserialize_with = "limit_as_set", serialize_with = "show_limit")]
    pub maxmemory: Limit,
    /// What a write over `maxmemory` does: `noeviction` (fails with OOM), `allkeys-random`,
    /// `volatile-random` or `volatile-ttl` (evict). The LRU and LFU policies are not
    /// supported yet and refused.
    #[serde(deserialize_with = "policy_name")]
    pub maxmemory_policy: String,
    /// Keys sampled to pick each victim (1 to 64; Redis' default 5).
    pub maxmemory_samples: u32,
}

/// An integer, or a string with Redis' memory units or a share (`"50%"`).
fn limit_as_set<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Limit, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(0) => Ok(Limit::None),
        Size::Bytes(n) => Ok(Limit::Bytes(n)),
        Size::Text(t) => Limit::parse(&t).map_err(serde::de::Error::custom),
    }
}

/// Bytes as a number, a share as text: what the file would say.
fn show_limit<S: serde::Serializer>(limit: &Limit, s: S) -> Result<S::Ok, S::Error> {
    match limit {
        Limit::None => s.serialize_u64(0),
        Limit::Bytes(n) => s.serialize_u64(*n),
        Limit::Share(_) => s.serialize_str(&limit.to_string()),
    }
}

/// A policy name racekv implements.
fn policy_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let name = String::deserialize(d)?;
    MaxmemoryPolicy::parse(&name).map(|p| p.name().to_string()).map_err(serde::de::Error::custom)
}

/// As `--print-config` shows it: secrets masked, so a config in a log line leaks none.
impl std::fmt::Debug for ComputenodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = racekv_telemetry::secret::redacted_toml(self, SECRET_KEYS).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

impl Default for ComputenodeConfig {
    fn default() -> Self {
        Self {
            memnodes: vec!["tcp:127.0.0.1:7400".into()],
            etcd_endpoints: Vec::new(),
            cluster: racekv_coord::keys::DEFAULT_CLUSTER_NAME.into(),
            etcd_map_wait_ms: 30_000,
            map_lease_ms: racekv_client::map_follower::DEFAULT_MAP_LEASE.as_millis() as u64,
            token: DEV_TOKEN.into(),
            connections_per_memnode: 4,
            op_timeout_ms: 5_000,
            grace_period_ms: 10,
            ready_sessions: 16,
            prefetch_chunks: 4,
            upgrade_ops_per_sec: 20_000,
            min_workers: 1,
            max_workers: 64,
            scale_up_queue_depth: 8,
            scale_up_wait_us: 500,
            worker_idle_ms: 2_000,
            queue_capacity: 65_536,
            redis_addr: Some("127.0.0.1:6380".into()),
            requirepass: None,
            aclfile: None,
            protected_mode: true,
            redis_tls_addr: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            tls_auth_clients: TlsAuthClients::No,
            memnode_tls_ca_file: None,
            memnode_tls_cert_file: None,
            memnode_tls_key_file: None,
            memnode_tls_server_name: None,
            redis_max_clients: 1024,
            redis_io: RedisIo::Auto,
            redis_event_loops: 0,
            redis_poll_spin_us: DEFAULT_POLL_SPIN.as_micros() as u64,
            redis_gather_gets: true,
            remote_addr: Some("127.0.0.1:7410".into()),
            attach_socket: Some(racekv_client::default_attach_socket()),
            attach_trust_uid: true,
            attach_lend: true,
            staging_budget_bytes: crate::staging::StagingOptions::default().budget_bytes,
            staging_idle_timeout_ms: crate::staging::StagingOptions::default().idle_timeout.as_millis() as u64,
            metrics_addr: Some("127.0.0.1:9401".parse().expect("static address")),
            maxmemory: Limit::None,
            maxmemory_policy: MaxmemoryPolicy::NoEviction.name().into(),
            maxmemory_samples: DEFAULT_SAMPLES,
        }
    }
}

impl ComputenodeConfig {
    /// The limits of requests and replies in parts.
    pub fn staging_options(&self) -> crate::staging::StagingOptions {
        crate::staging::StagingOptions {
            budget_bytes: self.staging_budget_bytes,
            per_owner_bytes: self.staging_budget_bytes,
            idle_timeout: Duration::from_millis(self.staging_idle_timeout_ms.max(1)),
            ..Default::default()
        }
    }

    /// Loads defaults, then `file` (if given), then `RACEKV_COMPUTENODE_*` variables.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        racekv_telemetry::load_config(file, "RACEKV_COMPUTENODE")
    }

    /// Refuses settings that cannot work together (no memnodes, the dev token off loopback,
    /// out-of-range limits), naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.memnodes.is_empty(), "no memnodes configured");
        if !self.etcd_endpoints.is_empty() {
            anyhow::ensure!(self.etcd_map_wait_ms <= 3_600_000, "etcd_map_wait_ms must be at most 3600000");
            anyhow::ensure!(
                self.map_lease_ms == 0 || (100..=600_000).contains(&self.map_lease_ms),
                "map_lease_ms must be 0 (none) or within 100..=600000"
            );
            racekv_coord::check_settings(&self.cluster)?;
        }
        anyhow::ensure!(!self.token.is_empty(), "token must not be empty");
        if self.token == DEV_TOKEN {
            let remote = self
                .memnodes
                .iter()
                .find(|m| m.split_once(':').is_some_and(|(scheme, addr)| scheme != "shm" && !is_loopback(addr)));
            if let Some(memnode) = remote {
                anyhow::bail!(
                    "refusing to reach {memnode} with the built-in development token: set `token` (token_file, \
                     RACEKV_COMPUTENODE_TOKEN_FILE)"
                );
            }
        }
        let tls = check_server_settings(
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
            self.tls_ca_file.as_deref(),
            self.tls_auth_clients,
        )?;
        anyhow::ensure!(tls || self.redis_tls_addr.is_none(), "redis_tls_addr needs tls_cert_file and tls_key_file");
        anyhow::ensure!(
            self.memnode_tls_cert_file.is_some() == self.memnode_tls_key_file.is_some(),
            "memnode_tls_cert_file and memnode_tls_key_file go together"
        );
        anyhow::ensure!(
            self.memnode_tls_ca_file.is_some()
                || (self.memnode_tls_cert_file.is_none() && self.memnode_tls_server_name.is_none()),
            "memnode TLS settings need memnode_tls_ca_file, the CA that signed the memnodes' certificates"
        );
        anyhow::ensure!(self.connections_per_memnode >= 1, "connections_per_memnode must be at least 1");
        anyhow::ensure!(
            self.min_workers <= self.max_workers && self.max_workers >= 1,
            "workers: need 1 <= max_workers and min_workers <= max_workers"
        );
        anyhow::ensure!(self.queue_capacity >= 1 && self.scale_up_queue_depth >= 1, "queue sizes must be at least 1");
        anyhow::ensure!(
            self.redis_event_loops <= MAX_REDIS_EVENT_LOOPS,
            "redis_event_loops must be at most {MAX_REDIS_EVENT_LOOPS}"
        );
        MaxmemoryPolicy::parse(&self.maxmemory_policy).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            (1..=MAX_SAMPLES).contains(&self.maxmemory_samples),
            "maxmemory_samples must be between 1 and {MAX_SAMPLES}"
        );
        anyhow::ensure!(
            Duration::from_micros(self.redis_poll_spin_us) <= MAX_POLL_SPIN,
            "redis_poll_spin_us must be at most {}",
            MAX_POLL_SPIN.as_micros()
        );
        Ok(())
    }

    /// The Redis front end's threading, with `auto` and a 0 loop count resolved.
    pub fn redis_io_model(&self) -> IoModel {
        let event_loop = match self.redis_io {
            RedisIo::Threads => false,
            RedisIo::EventLoop => true,
            RedisIo::Auto => {
                self.memnodes.iter().all(|m| m.parse::<Endpoint>().is_ok_and(|e| e.kind() == TransportKind::Shm))
            }
        };
        if !event_loop {
            return IoModel::ThreadPerConnection;
        }
        let threads = match self.redis_event_loops {
            0 => default_event_loops(std::thread::available_parallelism().map_or(1, |n| n.get())),
            n => n,
        };
        IoModel::EventLoop { threads }
    }

    /// Whether the Redis front end reads connections' GET runs together: asked for, a
    /// thread per connection, and no memnode listed on verbs (a NIC may service one
    /// batch's READs in any order, so there a run is read key by key and a gathered one
    /// would only queue every connection's keys behind one thread).
    pub fn redis_gathers_gets(&self) -> bool {
        self.redis_gather_gets
            && self.redis_io_model() == IoModel::ThreadPerConnection
            && self.memnodes.iter().all(|m| m.parse::<Endpoint>().is_ok_and(|e| e.kind().batch_reads_in_order()))
    }

    /// The front ends' TLS files, when TLS is configured.
    pub fn tls_files(&self) -> Option<ServerTlsFiles> {
        Some(ServerTlsFiles {
            cert_file: self.tls_cert_file.clone()?,
            key_file: self.tls_key_file.clone()?,
            ca_file: self.tls_ca_file.clone(),
            auth_clients: self.tls_auth_clients.into(),
        })
    }

    /// How to reach memnodes that speak TLS, when configured.
    pub fn memnode_tls(&self) -> anyhow::Result<Option<ClientTls>> {
        let Some(ca) = &self.memnode_tls_ca_file else { return Ok(None) };
        let mut tls = ClientTls::new(ca).with_context(|| format!("memnode_tls_ca_file {}", ca.display()))?;
        if let (Some(cert), Some(key)) = (&self.memnode_tls_cert_file, &self.memnode_tls_key_file) {
            tls = tls.with_client_cert(cert, key).context("memnode_tls_cert_file, memnode_tls_key_file")?;
        }
        if let Some(name) = &self.memnode_tls_server_name {
            tls = tls.with_server_name(name.clone());
        }
        Ok(Some(tls))
    }

    /// The users of the front ends: the ACL file's (if any), then `requirepass` for the
    /// default user. In protected mode, a remote front end beyond loopback needs them to
    /// have a password (the Redis port enforces protected mode per connection).
    pub fn acl(&self) -> anyhow::Result<Acl> {
        let options = AclOptions { requirepass: self.requirepass.clone(), file: self.aclfile.clone() };
        let acl = Acl::new(racekv_redis::commands::catalog(), options)?;
        if let Some(addr) = self.remote_addr.as_deref().filter(|a| self.protected_mode && !is_loopback(a)) {
            anyhow::ensure!(
                !acl.is_open(),
                "refusing to serve remote clients on {addr} while the default user has no password (protected \
                 mode): set requirepass (requirepass_file) or an aclfile, or protected_mode = false"
            );
        }
        Ok(acl)
    }

    /// The memnode side of these settings (reads the memnode TLS files).
    pub fn cluster_options(&self) -> anyhow::Result<ClusterOptions> {
        let timeout = Duration::from_millis(self.op_timeout_ms);
        let mut connect = racekv_transport::ConnectOptions::new(self.token.clone(), timeout);
        if let Some(tls) = self.memnode_tls()? {
            connect = connect.with_tls(tls);
        }
        Ok(ClusterOptions {
            memnodes: self.memnodes.clone(),
            connect,
            connections_per_memnode: self.connections_per_memnode,
            table: racekv_hashing::TableOptions {
                grace_period: Duration::from_millis(self.grace_period_ms),
                op_timeout: timeout,
            },
            upgrade: UpgradePolicy { ops_per_sec: self.upgrade_ops_per_sec, window_ops: 4096 },
            ready_sessions: self.ready_sessions,
            prefetch_chunks: self.prefetch_chunks,
            routing: crate::cluster::Routing::Ring,
        })
    }

    /// Cache mode's settings (validated: see [`Self::validate`]).
    pub fn maxmemory(&self) -> Maxmemory {
        let policy = MaxmemoryPolicy::parse(&self.maxmemory_policy).unwrap_or_default();
        Maxmemory::new(self.maxmemory, policy, self.maxmemory_samples)
    }

    /// The worker autoscaler's side of these settings.
    pub fn scale_options(&self) -> ScaleOptions {
        ScaleOptions {
            min_workers: self.min_workers,
            max_workers: self.max_workers,
            scale_up_depth: self.scale_up_queue_depth,
            scale_up_wait: Duration::from_micros(self.scale_up_wait_us),
            idle_retire: Duration::from_millis(self.worker_idle_ms),
            tick: Duration::from_micros(250),
        }
    }
}

/// Whether `addr` (`host:port`) is on loopback only: a loopback IP or `localhost`.
fn is_loopback(addr: &str) -> bool {
    match addr.parse::<SocketAddr>() {
        Ok(a) => a.ip().is_loopback(),
        Err(_) => addr.rsplit_once(':').is_some_and(|(host, _)| host == "localhost"),
    }
}

/// Event loops by default on `cores` cores: one per two cores (the rest serve clients and
/// workers), but two from two cores on: on 2 cores one loop left a pipelined SET load a
/// quarter idle between its wake-ups (docs/benchmarks.md, "Two event loops on two cores").
fn default_event_loops(cores: usize) -> usize {
    (cores / 2).max(cores.min(2)).clamp(1, 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_parses_and_validates() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/config/computenode.toml");
        let cfg = ComputenodeConfig::load(Some(&example)).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.memnodes, ["shm:/run/racekv/memnode.sock"]);
        assert_eq!(cfg.attach_socket.as_deref(), Some(Path::new("/run/racekv/computenode.sock")));
    }

    #[test]
    fn default_event_loops_are_one_per_two_cores_and_two_from_two_cores() {
        let loops: Vec<usize> = [1, 2, 3, 4, 6, 16, 64].into_iter().map(default_event_loops).collect();
        assert_eq!(loops, vec![1, 2, 2, 2, 3, 8, 8]);
    }

    #[test]
    fn redis_io_auto_picks_event_loops_only_over_shm() {
        let mut cfg = ComputenodeConfig { memnodes: vec!["shm:/a".into(), "shm:/b".into()], ..Default::default() };
        assert!(matches!(cfg.redis_io_model(), IoModel::EventLoop { threads } if (1..=8).contains(&threads)));
        cfg.memnodes.push("tcp:127.0.0.1:1".into());
        assert_eq!(cfg.redis_io_model(), IoModel::ThreadPerConnection);
        cfg.redis_io = RedisIo::EventLoop;
        cfg.redis_event_loops = 3;
        assert_eq!(cfg.redis_io_model(), IoModel::EventLoop { threads: 3 });
        cfg.redis_io = RedisIo::Threads;
        assert_eq!(cfg.redis_io_model(), IoModel::ThreadPerConnection);
        cfg.redis_event_loops = MAX_REDIS_EVENT_LOOPS + 1;
        assert!(cfg.validate().is_err());
        cfg.redis_event_loops = 0;
        cfg.redis_poll_spin_us = 1_000;
        cfg.validate().unwrap();
        cfg.redis_poll_spin_us = 1_001;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn redis_io_is_spelled_in_snake_case() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("computenode.toml");
        std::fs::write(&file, "redis_io = \"event_loop\"\nredis_event_loops = 2\n").unwrap();
        let cfg = ComputenodeConfig::load(Some(&file)).unwrap();
        assert_eq!(cfg.redis_io_model(), IoModel::EventLoop { threads: 2 });
        std::fs::write(&file, "redis_io = \"epoll\"\n").unwrap();
        assert!(ComputenodeConfig::load(Some(&file)).is_err());
    }

    #[test]
    fn remote_clients_beyond_loopback_need_a_password_and_secrets_are_masked() {
        let mut cfg = ComputenodeConfig { memnodes: vec!["tcp:10.0.0.9:7400".into()], ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("development token"));
        cfg.memnodes = vec!["tcp:127.0.0.1:7400".into(), "shm:/run/racekv/m.sock".into()];
        cfg.validate().unwrap();
        cfg.remote_addr = Some("0.0.0.0:7410".into());
        assert!(cfg.acl().unwrap_err().to_string().contains("protected mode"));
        cfg.remote_addr = Some("localhost:7410".into());
        cfg.acl().unwrap();
        cfg.remote_addr = Some("10.0.0.5:7410".into());
        cfg.token = "a real secret".into();
        cfg.requirepass = Some("redis secret".into());
        cfg.validate().unwrap();
        cfg.acl().unwrap();
        let printed = racekv_telemetry::secret::redacted_toml(&cfg, SECRET_KEYS).unwrap();
        assert_eq!(format!("{cfg:?}"), printed, "Debug masks them too");
        assert!(!printed.contains("a real secret") && !printed.contains("redis secret"), "{printed}");
        assert!(printed.contains("token = \"***\"") && printed.contains("requirepass = \"***\""), "{printed}");
        let parsed: ComputenodeConfig = toml::from_str(&printed).unwrap();
        assert_eq!(parsed.remote_addr, cfg.remote_addr);
    }

    #[test]
    fn requirepass_can_come_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("pass");
        std::fs::write(&secret, "from a file\n").unwrap();
        let file = dir.path().join("computenode.toml");
        std::fs::write(&file, format!("requirepass_file = {:?}\n", secret.display().to_string())).unwrap();
        let cfg = ComputenodeConfig::load(Some(&file)).unwrap();
        assert_eq!(cfg.requirepass.as_deref(), Some("from a file"));
        let acl = cfg.acl().unwrap();
        assert!(acl.authenticate(None, b"from a file").is_ok() && !acl.is_open());
    }

    #[test]
    fn maxmemory_takes_redis_sizes_and_every_redis_policy() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("computenode.toml");
        std::fs::write(&file, "maxmemory = \"100mb\"\nmaxmemory_policy = \"volatile-ttl\"\n").unwrap();
        let cfg = ComputenodeConfig::load(Some(&file)).unwrap();
        cfg.validate().unwrap();
        let m = cfg.maxmemory();
        assert_eq!((m.bytes(), m.policy(), m.samples()), (100 << 20, MaxmemoryPolicy::VolatileTtl, 5));
        std::fs::write(&file, "maxmemory = 4096\n").unwrap();
        assert_eq!(ComputenodeConfig::load(Some(&file)).unwrap().maxmemory().bytes(), 4096);
        std::fs::write(&file, "maxmemory = \"12.5%\"\n").unwrap();
        let cfg = ComputenodeConfig::load(Some(&file)).unwrap();
        assert_eq!(cfg.maxmemory().limit(), Limit::Share(1_250));
        assert!(format!("{cfg:?}").contains("maxmemory = \"12.5%\""), "--print-config shows the share as set");
        for (policy, want) in
            [("allkeys-lru", MaxmemoryPolicy::AllkeysLru), ("volatile-lfu", MaxmemoryPolicy::VolatileLfu)]
        {
            std::fs::write(&file, format!("maxmemory_policy = \"{policy}\"\n")).unwrap();
            let cfg = ComputenodeConfig::load(Some(&file)).unwrap();
            cfg.validate().unwrap();
            assert_eq!(cfg.maxmemory().policy(), want);
        }
        for bad in ["maxmemory_policy = \"sometimes\"", "maxmemory = \"lots\"", "maxmemory = \"120%\""] {
            std::fs::write(&file, format!("{bad}\n")).unwrap();
            let err = ComputenodeConfig::load(Some(&file)).and_then(|cfg| cfg.validate().map(|()| cfg));
            assert!(err.is_err(), "{bad}");
        }
        let cfg = ComputenodeConfig { maxmemory_samples: 65, ..Default::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("maxmemory_samples"));
    }

    #[test]
    fn unknown_keys_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("computenode.toml");
        std::fs::write(&file, "max_worker = 5\n").unwrap();
        assert!(ComputenodeConfig::load(Some(&file)).is_err());
    }

    /// The cluster map's settings: read from a file, the cluster name and the wait checked,
    /// and a build without the etcd client says how to get one.
    #[test]
    fn etcd_settings_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("computenode.toml");
        std::fs::write(&file, "etcd_endpoints = [\"http://127.0.0.1:2379\"]\ncluster = \"prod\"\n").unwrap();
        let mut cfg = ComputenodeConfig::load(Some(&file)).unwrap();
        assert_eq!((cfg.etcd_endpoints.len(), cfg.cluster.as_str()), (1, "prod"));
        let built = cfg!(feature = "etcd");
        match cfg.validate() {
            Ok(()) => assert!(built, "validated without the etcd client"),
            Err(e) => assert!(!built && e.to_string().contains("--features etcd"), "{e}"),
        }
        cfg.cluster = "Not A Name".into();
        assert!(cfg.validate().unwrap_err().to_string().contains("cluster name"));
        cfg.cluster = "prod".into();
        cfg.etcd_map_wait_ms = 4_000_000;
        assert!(cfg.validate().unwrap_err().to_string().contains("etcd_map_wait_ms"));
        cfg.etcd_map_wait_ms = 1_000;
        cfg.map_lease_ms = 10;
        assert!(cfg.validate().unwrap_err().to_string().contains("map_lease_ms"));
    }
}
