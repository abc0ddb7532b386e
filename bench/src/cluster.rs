//! A memnode inside the benchmark process (or an external one), and connections to it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use racekv_hashing::{Table, TableOptions, TableStats};
use racekv_memnode::{Memnode, MemnodeConfig};
use racekv_transport::{ConnectOptions, Connection, Endpoint, TransportKind};

/// Where the benchmark's memnode is.
pub struct BenchMemnode {
    memnode: Option<Memnode>,
    endpoint: Endpoint,
    token: String,
    _dir: tempfile::TempDir,
}

impl BenchMemnode {
    /// Starts an in-process memnode serving `transport`, or uses `external` if given.
    pub fn start(
        transport: TransportKind,
        region_bytes: u64,
        groups_per_subtable: u32,
        external: Option<&str>,
        token: &str,
        huge_pages: bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        if let Some(endpoint) = external {
            let endpoint = endpoint.parse().map_err(anyhow::Error::msg)?;
            return Ok(Self { memnode: None, endpoint, token: token.into(), _dir: dir });
        }
        let mut cfg = MemnodeConfig {
            region_bytes,
            groups_per_subtable,
            metrics_addr: None,
            token: token.into(),
            listen_tcp: None,
            huge_pages,
            ..MemnodeConfig::default()
        };
        match transport {
            TransportKind::Shm => cfg.listen_shm = Some(dir.path().join("memnode.sock")),
            TransportKind::Tcp => cfg.listen_tcp = Some("127.0.0.1:0".into()),
            TransportKind::Verbs => cfg.listen_verbs = Some("127.0.0.1:0".into()),
        }
        let memnode = Memnode::start(cfg).context("starting the benchmark's memnode")?;
        let endpoint = memnode.endpoints()[0].clone();
        Ok(Self { memnode: Some(memnode), endpoint, token: token.into(), _dir: dir })
    }

    /// A new connection to the memnode.
    pub fn connect(&self) -> anyhow::Result<Arc<dyn Connection>> {
        let options = ConnectOptions::new(self.token.clone(), Duration::from_secs(30));
        racekv_transport::connect(&self.endpoint, &options).with_context(|| format!("connecting to {}", self.endpoint))
    }

    /// Opens the table on a new connection; returns both.
    pub fn table(&self, options: TableOptions) -> anyhow::Result<(Table, Arc<dyn Connection>)> {
        let conn = self.connect()?;
        Ok((Table::open(Arc::clone(&conn), options)?, conn))
    }

    /// Table statistics by RPC.
    pub fn stats(&self) -> anyhow::Result<TableStats> {
        let reply = self.connect()?.call(racekv_hashing::rpc::method::STATS, &[])?;
        racekv_hashing::service::decode_stats(&reply).context("unreadable stats")
    }

    /// The memnode's endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Whether the memnode runs in this process (rather than one named by `--memnode`).
    pub fn is_in_process(&self) -> bool {
        self.memnode.is_some()
    }
}

/// Puts keys 0..`keys` (big-endian u64s) with `value` through `c`, showing progress.
pub fn load_keys(c: &mut racekv_hashing::TableClient, keys: u64, value: &[u8]) -> anyhow::Result<()> {
    let bar = crate::report::progress(keys, "loading");
    for k in 0..keys {
        c.put(&k.to_be_bytes(), value)?;
        if k % 4096 == 0 {
            bar.set_position(k);
        }
    }
    bar.finish_and_clear();
    Ok(())
}
