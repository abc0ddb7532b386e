//! The memnode's configuration: defaults, then a TOML file, then `RACEKV_MEMNODE_*`
//! environment variables, then command-line flags (each layer overrides the one before).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use racekv_telemetry::tls::check_server_settings;
pub use racekv_telemetry::tls::TlsAuthClients;
use racekv_transport::ServerTlsFiles;
use serde::{Deserialize, Serialize};

use crate::bytes::serde_bytes;

/// Everything a memnode needs to run.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemnodeConfig {
    /// Size of the region (the table, its directory and all KV data).
    #[serde(with = "serde_bytes")]
    pub region_bytes: u64,
    /// Back the region with this file so a restart reopens the table. Without it the region
    /// is anonymous shared memory and lives as long as the process.
    pub data_file: Option<PathBuf>,
    /// Back an anonymous region with huge pages (needs vm.nr_hugepages reserved).
    pub huge_pages: bool,
    /// Unix socket for same-host clients (the shm transport).
    pub listen_shm: Option<PathBuf>,
    /// host:port for the tcp transport (the software NIC).
    pub listen_tcp: Option<String>,
    /// host:port of the verbs control channel (needs an RDMA device and the `rdma` build).
    pub listen_verbs: Option<String>,
    /// Shared secret every client must prove it knows when it connects (challenge-response:
    /// the token itself never travels).
    pub token: String,
    /// TLS certificate chain (PEM, leaf first) for `listen_tcp`. With it and `tls_key_file`
    /// the tcp listener speaks only TLS (the token handshake then runs inside it). Re-read,
    /// with the key and CA, on SIGHUP: new connections get the new certificate; a reload that
    /// fails keeps the old one. Not used by shm (same host) or verbs.
    pub tls_cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub tls_key_file: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates must chain to (when
    /// `tls_auth_clients` is `optional` or `yes`).
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificates: `no` (the token alone), `optional` (checked against
    /// `tls_ca_file` when presented) or `yes` (required).
    pub tls_auth_clients: TlsAuthClients,
    /// Where to serve Prometheus metrics (`/metrics`); unset disables it.
    pub metrics_addr: Option<SocketAddr>,
    /// This memnode's identity for key placement, fixed when the region is formatted
    /// (random if unset). Only needed to re-create a node with a known id.
    pub node_id: Option<u64>,
    /// Bucket groups per subtable (power of two; 3 buckets of 7 slots each).
    pub groups_per_subtable: u32,
    /// Bytes per KV chunk handed to a client.
    #[serde(with = "serde_bytes")]
    pub chunk_bytes: u64,
    /// Most client connections served at once; more are refused.
    pub max_connections: usize,
    /// A connection that stalls mid-frame this long is closed.
    pub io_timeout_ms: u64,
    /// How often a data file is flushed to disk (msync); 0 leaves it to the kernel.
    pub sync_interval_ms: u64,
    /// After reopening a data file, wait this long before reclaiming free space and
    /// serving. shm clients of the previous run map the file and stop writing only once they
    /// notice that run died (at once, unless a thread stalls between its check and its
    /// store); a write landing after the reclaim could hit space handed out again.
    pub reopen_fence_ms: u64,
    /// The shortest time any client waits before reusing a block it freed (published in the
    /// region at start; a client configured shorter waits this long). A read that may have
    /// taken longer than this checks its slot again, so this is a trade of heap held in
    /// grace (about write rate x grace) against how often slow reads cost a round trip.
    pub grace_period_ms: u64,
    /// Share of one core (percent) the active expiry may spend per cycle finding expired
    /// items nobody reads and freeing their memory (`racekv_hashing::expiry`; cycles run up
    /// to 10 a second while items with an expiry are around). 0 turns it off: expired items
    /// then go only when a client meets them.
    pub active_expiry_cpu_percent: u32,
    /// RPC (FLOCK) credits per grant: how many requests a client lane may send before it
    /// must renew (it renews after using half).
    pub rpc_credits: u32,
    /// Most active RPC lanes over all clients (FLOCK's MAX_AQP); shared out in proportion
    /// to each client's coalescing degree and request rate, at least one per client.
    pub rpc_max_active_lanes: usize,
    /// Most RPC requests granted but not yet answered, over all clients.
    pub rpc_max_outstanding: u64,
    /// etcd endpoints (`http://host:port`): with them the memnode registers itself in the
    /// cluster `cluster` under a lease (issue 17); empty: no coordinator (a fixed ring).
    pub etcd_endpoints: Vec<String>,
    /// The cluster's name in etcd (lowercase letters, digits, `-`).
    pub cluster: String,
    /// The registration's lease: a memnode that stops renewing it (dead, or cut off from
    /// etcd) leaves the cluster's list this long after.
    pub etcd_lease_ms: u64,
    /// The endpoints registered in etcd, where computenodes reach this memnode (empty: the
    /// ones it listens on). Set them when it listens on an unspecified address (`0.0.0.0`,
    /// `[::]`) or behind an address translation: `tcp:10.0.0.5:7400`.
    pub advertise_endpoints: Vec<String>,
    /// Longest backlog a lane is granted at the measured service time; beyond it credits
    /// are refused (overload) and clients wait, then fail with a clear error.
    pub rpc_max_queue_delay_ms: u64,
}

/// The settings `--print-config` masks.
pub const SECRET_KEYS: &[&str] = &["token"];

/// The token used when none is configured: fine on loopback, refused elsewhere.
pub const DEV_TOKEN: &str = "racekv-dev-token";

/// As `--print-config` shows it: secrets masked, so a config in a log line leaks none.
impl std::fmt::Debug for MemnodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = racekv_telemetry::secret::redacted_toml(self, SECRET_KEYS).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

impl Default for MemnodeConfig {
    fn default() -> Self {
        Self {
            region_bytes: 1 << 30,
            data_file: None,
            huge_pages: false,
            listen_shm: None,
            listen_tcp: Some("127.0.0.1:7400".into()),
            listen_verbs: None,
            token: DEV_TOKEN.into(),
            tls_cert_file: None,
            tls_key_file: None,
            tls_ca_file: None,
            tls_auth_clients: TlsAuthClients::No,
            metrics_addr: Some("127.0.0.1:9400".parse().expect("static address")),
            node_id: None,
            groups_per_subtable: 256,
            chunk_bytes: 1 << 20,
            max_connections: 1024,
            io_timeout_ms: 10_000,
            sync_interval_ms: 1_000,
            reopen_fence_ms: 1_000,
            grace_period_ms: 10,
            active_expiry_cpu_percent: 25,
            rpc_credits: 32,
            rpc_max_active_lanes: 256,
            rpc_max_outstanding: 256 * 48,
            rpc_max_queue_delay_ms: 100,
            etcd_endpoints: Vec::new(),
            cluster: racekv_coord::keys::DEFAULT_CLUSTER_NAME.into(),
            etcd_lease_ms: 3_000,
            advertise_endpoints: Vec::new(),
        }
    }
}

impl MemnodeConfig {
    /// Loads defaults, then `file` (if given), then `RACEKV_MEMNODE_*` variables.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        racekv_telemetry::load_config(file, "RACEKV_MEMNODE")
    }

    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.listen_shm.is_some() || self.listen_tcp.is_some() || self.listen_verbs.is_some(),
            "no listener configured: set listen_shm, listen_tcp or listen_verbs"
        );
        anyhow::ensure!(
            self.region_bytes.is_multiple_of(4096),
            "region_bytes ({}) must be a multiple of 4096",
            self.region_bytes
        );
        anyhow::ensure!(!self.token.is_empty(), "token must not be empty");
        anyhow::ensure!(self.max_connections > 0, "max_connections must be at least 1");
        anyhow::ensure!(self.reopen_fence_ms <= 60_000, "reopen_fence_ms must be at most 60000 (one minute)");
        anyhow::ensure!((1..=60_000).contains(&self.grace_period_ms), "grace_period_ms must be within 1..=60000");
        anyhow::ensure!(self.active_expiry_cpu_percent <= 100, "active_expiry_cpu_percent must be within 0..=100");
        anyhow::ensure!((2..=65536).contains(&self.rpc_credits), "rpc_credits must be within 2..=65536");
        anyhow::ensure!(self.rpc_max_active_lanes > 0, "rpc_max_active_lanes must be at least 1");
        anyhow::ensure!(self.rpc_max_outstanding > 0, "rpc_max_outstanding must be at least 1");
        if !self.etcd_endpoints.is_empty() {
            anyhow::ensure!(
                (1_000..=600_000).contains(&self.etcd_lease_ms),
                "etcd_lease_ms must be within 1000..=600000"
            );
            racekv_coord::check_settings(&self.cluster)?;
        }
        anyhow::ensure!(
            self.advertise_endpoints.len() <= racekv_coord::map::MAX_ENDPOINTS,
            "advertise_endpoints lists at most {} endpoints",
            racekv_coord::map::MAX_ENDPOINTS
        );
        for e in &self.advertise_endpoints {
            e.parse::<racekv_transport::Endpoint>()
                .map_err(|reason| anyhow::anyhow!("advertise_endpoints: {e}: {reason}"))?;
        }
        anyhow::ensure!(
            !(self.huge_pages && self.data_file.is_some()),
            "huge_pages applies to anonymous regions; a data_file region uses the page cache"
        );
        anyhow::ensure!(
            !self.huge_pages || self.region_bytes.is_multiple_of(HUGE_PAGE_BYTES),
            "with huge_pages, region_bytes ({}) must be a multiple of the huge page size ({HUGE_PAGE_BYTES} bytes)",
            self.region_bytes
        );
        let tls = check_server_settings(
            self.tls_cert_file.as_deref(),
            self.tls_key_file.as_deref(),
            self.tls_ca_file.as_deref(),
            self.tls_auth_clients,
        )?;
        anyhow::ensure!(
            !tls || self.listen_tcp.is_some(),
            "TLS applies to listen_tcp, which is not set (shm stays on the host, verbs has no TLS)"
        );
        // TLS protects the channel; the token still authenticates, so the rule stands.
        let exposed = |addr: &Option<String>| addr.as_deref().is_some_and(|a| !is_loopback(a));
        if self.token == DEV_TOKEN && (exposed(&self.listen_tcp) || exposed(&self.listen_verbs)) {
            anyhow::bail!("refusing to listen beyond loopback with the built-in development token: set `token` (or RACEKV_MEMNODE_TOKEN)");
        }
        Ok(())
    }

    /// The tcp listener's TLS files, when TLS is configured.
    pub fn tls_files(&self) -> Option<ServerTlsFiles> {
        Some(ServerTlsFiles {
            cert_file: self.tls_cert_file.clone()?,
            key_file: self.tls_key_file.clone()?,
            ca_file: self.tls_ca_file.clone(),
            auth_clients: self.tls_auth_clients.into(),
        })
    }
}

/// The huge page size `huge_pages` regions come in (x86-64 and arm64 default).
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;

fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_matches(|c| c == '[' || c == ']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_override_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memnode.toml");
        std::fs::write(&file, "region_bytes = \"64MiB\"\nlisten_tcp = \"127.0.0.1:7777\"\n").unwrap();
        let cfg = MemnodeConfig::load(Some(&file)).unwrap();
        assert_eq!(cfg.region_bytes, 64 << 20);
        assert_eq!(cfg.listen_tcp.as_deref(), Some("127.0.0.1:7777"));
        assert_eq!(cfg.chunk_bytes, 1 << 20, "untouched keys keep their defaults");
    }

    #[test]
    fn the_shipped_example_parses_and_validates_as_shipped() {
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/config/memnode.toml");
        let cfg = MemnodeConfig::load(Some(&example)).unwrap();
        assert_eq!(cfg.region_bytes, 16 << 30);
        assert_eq!(cfg.listen_tcp.as_deref(), Some("127.0.0.1:7400"), "loopback until a token is set");
        cfg.validate().unwrap();
    }

    #[test]
    fn unknown_keys_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memnode.toml");
        std::fs::write(&file, "region_byte = 5\n").unwrap();
        assert!(MemnodeConfig::load(Some(&file)).is_err());
    }

    #[test]
    fn tls_settings_load_and_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memnode.toml");
        std::fs::write(
            &file,
            "tls_cert_file = \"/etc/racekv/tls/memnode.pem\"\ntls_key_file = \"/etc/racekv/tls/memnode.key\"\ntls_ca_file = \"/etc/racekv/tls/ca.pem\"\ntls_auth_clients = \"yes\"\n",
        )
        .unwrap();
        let cfg = MemnodeConfig::load(Some(&file)).unwrap();
        cfg.validate().unwrap();
        let files = cfg.tls_files().unwrap();
        assert_eq!(files.cert_file, Path::new("/etc/racekv/tls/memnode.pem"));
        assert_eq!(files.auth_clients, racekv_transport::ClientAuth::Yes);
        assert_eq!(MemnodeConfig::default().tls_files(), None);

        let broken = |edit: fn(&mut MemnodeConfig)| {
            let mut cfg = cfg.clone();
            edit(&mut cfg);
            cfg.validate().unwrap_err().to_string()
        };
        assert!(broken(|c| c.tls_key_file = None).contains("go together"));
        assert!(broken(|c| c.tls_ca_file = None).contains("needs tls_ca_file"));
        assert!(broken(|c| c.listen_tcp = None).contains("listen_tcp"));
        assert!(broken(|c| {
            c.tls_cert_file = None;
            c.tls_key_file = None;
        })
        .contains("need TLS"));
        assert!(MemnodeConfig::load(None).unwrap().tls_auth_clients == TlsAuthClients::No);
        std::fs::write(&file, "tls_auth_clients = \"sometimes\"\n").unwrap();
        assert!(MemnodeConfig::load(Some(&file)).is_err());
    }

    #[test]
    fn dev_token_stays_on_loopback() {
        let mut cfg = MemnodeConfig::default();
        cfg.validate().unwrap();
        cfg.listen_tcp = Some("0.0.0.0:7400".into());
        assert!(cfg.validate().is_err());
        cfg.token = "a real secret".into();
        cfg.validate().unwrap();
        assert!(is_loopback("[::1]:5") && is_loopback("localhost:1") && !is_loopback("10.0.0.1:1"));
    }

    /// etcd endpoints come as a list from the environment too; the cluster name and lease
    /// are checked; a build without the etcd client says how to get one.
    #[test]
    fn etcd_settings_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memnode.toml");
        std::fs::write(&file, "etcd_endpoints = [\"http://127.0.0.1:2379\"]\ncluster = \"prod\"\n").unwrap();
        let mut cfg = MemnodeConfig::load(Some(&file)).unwrap();
        assert_eq!((cfg.etcd_endpoints.len(), cfg.cluster.as_str()), (1, "prod"));
        let built = cfg!(feature = "etcd");
        match cfg.validate() {
            Ok(()) => assert!(built, "validated without the etcd client"),
            Err(e) => assert!(!built && e.to_string().contains("--features etcd"), "{e}"),
        }
        cfg.cluster = "Not A Name".into();
        assert!(cfg.validate().unwrap_err().to_string().contains("cluster name"));
        cfg.cluster = "prod".into();
        cfg.etcd_lease_ms = 10;
        assert!(cfg.validate().unwrap_err().to_string().contains("etcd_lease_ms"));
    }
}
