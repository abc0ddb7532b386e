//! The racekv memory node: one region holding a RACE table, served to compute nodes.
//!
//! [`Memnode::start`] maps the region (a data file, so a restart reopens the table, or an
//! anonymous memfd), formats it or reopens it (finishing a split a crash interrupted),
//! serves it on the configured transports, and answers the table's RPCs (metadata, chunk
//! allocation, split, stats) through a loopback connection of the transport clients use.
//!
//! A thread runs the active expiry (`racekv_hashing::expiry`): it samples slots through the
//! same loopback connection, removes expired items nobody reads and frees their blocks.
//!
//! Every client proves the token when it connects (`racekv_transport::auth`); the tcp
//! listener speaks only TLS when a certificate is configured, re-read by
//! [`Memnode::reload_tls`] (the daemon calls it on SIGHUP).
//!
//! Durability: a write is in the region once its batch completes. With a data file that
//! means the kernel's page cache: it survives the memnode process dying (even SIGKILL) and
//! reaches the disk within `sync_interval_ms` (msync) or at a clean shutdown. It does not
//! survive a machine crash inside that interval.

#![forbid(unsafe_code)]

pub mod bytes;
pub mod config;
mod gauges;
mod registry;

use std::fs::{File, OpenOptions};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use racekv_hashing::expiry::ExpiryOptions;
use racekv_hashing::format::{format, is_formatted, publish_grace_period, read_layout, read_node_id};
use racekv_hashing::heap::Heap;
use racekv_hashing::reclaim::{reclaim, Reclaimed};
use racekv_hashing::split::Splitter;
use racekv_hashing::{Layout, TableService, TableStats};
use racekv_telemetry::MetricsServer;

use crate::gauges::Gauges;
use racekv_transport::local::LocalConnection;
use racekv_transport::{ConnectOptions, Connection, Endpoint, Region, RegionServer, ServerOptions, ServerTls};

pub use config::MemnodeConfig;

/// What this start's reclaim of unreferenced heap space did (a reopened region only).
#[derive(Debug, Clone)]
pub struct StartReclaim {
    /// How long the reclaim took.
    pub duration: Duration,
    /// Its findings, without the fragment list (handed to the heap).
    pub reclaimed: Reclaimed,
}

/// A running memnode.
pub struct Memnode {
    config: MemnodeConfig,
    region: Arc<Region>,
    layout: Layout,
    service: Arc<TableService>,
    server: Option<RegionServer>,
    metrics: Option<MetricsServer>,
    stopping: Arc<AtomicBool>,
    housekeeping: Option<JoinHandle<()>>,
    expiry: Option<JoinHandle<()>>,
    start_reclaim: Option<StartReclaim>,
    /// This memnode's series (label `memnode`), removed when it is dropped.
    gauges: Arc<Gauges>,
    /// Its registration in etcd (with `etcd_endpoints`), revoked first at stop.
    registration: Option<registry::Registered>,
    /// Holds the exclusive lock on the data file while we run.
    _lock: Option<nix::fcntl::Flock<File>>,
}

/// Opens (or creates) the data file, or makes an anonymous memfd region.
fn open_region(cfg: &MemnodeConfig) -> anyhow::Result<(File, Option<nix::fcntl::Flock<File>>)> {
    let Some(path) = &cfg.data_file else {
        let file = racekv_transport::region::shared_memory_file("racekv-region", cfg.region_bytes, cfg.huge_pages)?;
        return Ok((file, None));
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("opening the data file {}", path.display()))?;
    // The lock goes on a description of its own: shm clients map `file` (its descriptor is
    // passed to them), and a mapping keeps its open file description alive, lock and all,
    // so a lock on `file` outlived a crashed memnode for as long as any client kept its
    // mapping (a computenode's pool keeps a lost connection until it can reconnect, so the
    // memnode could never come back).
    let lock_file = OpenOptions::new().read(true).open(path).with_context(|| format!("opening {}", path.display()))?;
    let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| anyhow::anyhow!("{} is in use by another memnode ({e})", path.display()))?;
    let len = file.metadata()?.len();
    if len == 0 {
        file.set_len(cfg.region_bytes)
            .with_context(|| format!("sizing {} to {} bytes", path.display(), cfg.region_bytes))?;
    } else if len != cfg.region_bytes {
        bail!(
            "{} holds a region of {len} bytes but region_bytes is {}; a region cannot be resized (use region_bytes = {len})",
            path.display(),
            cfg.region_bytes
        );
    }
    Ok((file, Some(lock)))
}

/// The table a start found in the region or wrote into it.
struct Opened {
    layout: Layout,
    node_id: u64,
    /// What the reclaim of a reopened region found (None: a new table, or the reclaim failed).
    start_reclaim: Option<StartReclaim>,
}

/// Reopens the table in the region (finishing a split the last run left in progress and
/// reclaiming the heap space nothing references), or formats a new one. Nobody is connected yet.
fn format_or_reopen(region: &Arc<Region>, config: &MemnodeConfig) -> anyhow::Result<Opened> {
    let local = LocalConnection::new(Arc::clone(region), None);
    if !is_formatted(&local)? {
        let layout = Layout::for_region(config.region_bytes, config.groups_per_subtable, config.chunk_bytes)?;
        let node_id = config.node_id.unwrap_or_else(random_node_id);
        format(&local, &layout, node_id)?;
        tracing::info!(
            region_bytes = layout.region_len,
            max_global_depth = layout.max_global_depth,
            node_id,
            "formatted a new table"
        );
        return Ok(Opened { layout, node_id, start_reclaim: None });
    }
    if let Some(version) = racekv_hashing::format::upgrade(&local)? {
        tracing::warn!(
            from = version,
            to = racekv_hashing::layout::FORMAT_VERSION,
            "upgraded the region's format version (builds of the old version now refuse this data file)"
        );
    }
    let layout = read_layout(&local)?;
    let local: Arc<dyn Connection> = Arc::new(local);
    let splitter = Splitter::new(Arc::clone(&local), layout, Arc::new(Heap::new(Arc::clone(&local), layout)));
    if splitter.recover()? {
        tracing::warn!("finished a split that the previous run left in progress");
    }
    let start_reclaim = reclaim_at_start(&*local, &layout, Duration::from_millis(config.reopen_fence_ms));
    let node_id = read_node_id(&*local)?;
    tracing::info!(region_bytes = layout.region_len, node_id, "reopened an existing table");
    Ok(Opened { layout, node_id, start_reclaim })
}

/// The endpoints to listen on, one per configured transport (creating the shm socket's
/// directory).
fn listen_endpoints(config: &MemnodeConfig) -> anyhow::Result<Vec<Endpoint>> {
    let mut listen = Vec::new();
    if let Some(p) = &config.listen_shm {
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        listen.push(Endpoint::Shm(p.clone()));
    }
    if let Some(a) = &config.listen_tcp {
        listen.push(Endpoint::Tcp(a.clone()));
    }
    if let Some(a) = &config.listen_verbs {
        listen.push(Endpoint::Verbs(a.clone()));
    }
    Ok(listen)
}

/// The region server's options: token, TLS (loaded here when configured), connection limits
/// and the FLOCK scheduler's.
fn server_options(config: &MemnodeConfig) -> anyhow::Result<ServerOptions> {
    let tls = match config.tls_files() {
        Some(files) => {
            let tls = ServerTls::load(files).context("loading the TLS certificate and key")?;
            let f = tls.files();
            tracing::info!(cert = %f.cert_file.display(), client_certificates = ?f.auth_clients, "the tcp listener speaks TLS");
            Some(tls)
        }
        None => None,
    };
    Ok(ServerOptions {
        token: config.token.clone(),
        credentials: None,
        tls,
        max_connections: config.max_connections,
        io_timeout: Duration::from_millis(config.io_timeout_ms),
        flock: racekv_transport::flock::SchedulerOptions {
            credits: config.rpc_credits,
            max_active: config.rpc_max_active_lanes,
            max_outstanding: config.rpc_max_outstanding,
            max_queue_delay: Duration::from_millis(config.rpc_max_queue_delay_ms),
        },
    })
}

/// The connection the table service works on the region through: a loopback of the
/// clients' transport (verbs first, then shm, then whatever listens).
fn connect_loopback(
    server: &RegionServer,
    region: &Arc<Region>,
    config: &MemnodeConfig,
) -> anyhow::Result<Arc<dyn Connection>> {
    let loopback_endpoint = server
        .endpoints()
        .iter()
        .find(|e| matches!(e, Endpoint::Verbs(_)))
        .or_else(|| server.endpoints().iter().find(|e| matches!(e, Endpoint::Shm(_))))
        .or_else(|| server.endpoints().first())
        .expect("at least one listener")
        .clone();
    if matches!(loopback_endpoint, Endpoint::Tcp(_)) && server.tls().is_some() {
        // A TLS-only tcp listener would need a client certificate and CA for ourselves;
        // the software NIC applies batches with the same CPU atomics as this.
        return Ok(Arc::new(LocalConnection::new(Arc::clone(region), None)));
    }
    racekv_transport::connect(&loopback_endpoint, &ConnectOptions::new(config.token.clone(), Duration::from_secs(30)))
        .with_context(|| format!("connecting the loopback to {loopback_endpoint}"))
}

impl Memnode {
    /// Maps, formats or reopens the region and serves it as `config` says.
    pub fn start(config: MemnodeConfig) -> anyhow::Result<Self> {
        config.validate()?;
        if config.listen_verbs.is_some() && (config.listen_shm.is_some() || config.listen_tcp.is_some()) {
            bail!("verbs cannot share a region with shm or tcp clients: NIC atomics are atomic only against other NIC atomics (design.md); configure verbs alone");
        }
        let (file, lock) = open_region(&config)?;
        let region = Arc::new(Region::map_file(&file, config.region_bytes).context("mapping the region")?);

        // Format or reopen, before anyone can connect.
        let Opened { layout, node_id, mut start_reclaim } = format_or_reopen(&region, &config)?;
        let gauges = Arc::new(Gauges::of(node_id));
        gauges.region_bytes.set(config.region_bytes as i64);
        if let Some(found) = &start_reclaim {
            gauges.reclaim_seconds.set(found.duration.as_secs_f64());
            gauges.reclaimed_bytes.set(found.reclaimed.free_bytes() as i64);
        }
        let (found_fragments, found_extents) = match &mut start_reclaim {
            Some(found) => {
                (std::mem::take(&mut found.reclaimed.fragments), std::mem::take(&mut found.reclaimed.extents))
            }
            None => (Vec::new(), Vec::new()),
        };

        // Before anyone connects: the map epoch clients must route by (etcd's; 0 without).
        let coordinator = registry::connect(&config, &region, &gauges)?;
        // Before anyone connects: every client of this run waits at least this long.
        publish_grace_period(
            &LocalConnection::new(Arc::clone(&region), None),
            Duration::from_millis(config.grace_period_ms),
        )
        .context("publishing the grace period")?;
        let service = Arc::new(TableService::new(layout, node_id));
        let server = RegionServer::start(
            Arc::clone(&region),
            Some(file),
            service.clone(),
            server_options(&config)?,
            &listen_endpoints(&config)?,
        )
        .context("starting the region server")?;

        service.attach(connect_loopback(&server, &region, &config)?, server.instance());
        // The live extents, so retiring them works (without a reclaim, retires of extents
        // from an earlier run are refused and the next start's reclaim frees them).
        service.seed_extents(&found_extents).context("taking in the live value extents found at start")?;
        if !found_fragments.is_empty() {
            service.seed_fragments(&found_fragments).context("keeping the short free runs found at start")?;
        }

        let metrics = match config.metrics_addr {
            Some(addr) => Some(MetricsServer::start(addr)?),
            None => None,
        };
        let stopping = Arc::new(AtomicBool::new(false));
        let mut memnode = Self {
            config,
            region,
            layout,
            service,
            server: Some(server),
            metrics,
            stopping,
            housekeeping: None,
            expiry: None,
            start_reclaim,
            gauges,
            registration: None,
            _lock: lock,
        };
        memnode.housekeeping = Some(memnode.spawn_housekeeping()?);
        memnode.expiry = memnode.spawn_expiry()?;
        // Last: registered means serving.
        let endpoints = match memnode.config.advertise_endpoints.as_slice() {
            [] => memnode.endpoints().iter().map(|e| e.to_string()).collect(),
            advertised => advertised.to_vec(),
        };
        memnode.registration = coordinator
            .map(|c| c.register(&memnode.config, node_id, endpoints, &memnode.region, &memnode.gauges))
            .transpose()?;
        Ok(memnode)
    }

    /// Runs the active expiry's cycles, asleep in between (None when it is turned off).
    fn spawn_expiry(&self) -> anyhow::Result<Option<JoinHandle<()>>> {
        if self.config.active_expiry_cpu_percent == 0 {
            return Ok(None);
        }
        let options = ExpiryOptions {
            cpu_percent: self.config.active_expiry_cpu_percent,
            grace: Duration::from_millis(self.config.grace_period_ms),
            ..ExpiryOptions::default()
        };
        let Some(mut expiry) = self.service.active_expiry(options) else {
            bail!("the table service has no loopback connection");
        };
        let stopping = Arc::clone(&self.stopping);
        Ok(Some(std::thread::Builder::new().name("memnode-expiry".into()).spawn(move || {
            /// After a failed cycle (the loopback lost, say), the next try waits this long.
            const AFTER_FAILURE: Duration = Duration::from_secs(1);
            while !stopping.load(Ordering::Acquire) {
                let next = match expiry.run_due() {
                    Ok(next) => next,
                    Err(e) => {
                        tracing::warn!("active expiry cycle failed: {e}");
                        AFTER_FAILURE
                    }
                };
                std::thread::park_timeout(next);
            }
            // Blocks still in grace go back too (a few milliseconds); else the next start's
            // reclaim finds them.
            if let Err(e) = expiry.drain() {
                tracing::debug!("giving back expired blocks at stop failed: {e}");
            }
        })?))
    }

    /// Refreshes the gauges every second and flushes a data file every `sync_interval_ms`,
    /// asleep in between.
    fn spawn_housekeeping(&self) -> anyhow::Result<JoinHandle<()>> {
        let (stopping, service, region, gauges) =
            (Arc::clone(&self.stopping), Arc::clone(&self.service), Arc::clone(&self.region), Arc::clone(&self.gauges));
        let sync_every = (self.config.data_file.is_some() && self.config.sync_interval_ms > 0)
            .then(|| Duration::from_millis(self.config.sync_interval_ms));
        let connections = self.server.as_ref().map(|s| s.connections_handle());
        Ok(std::thread::Builder::new().name("memnode-housekeeping".into()).spawn(move || {
            const STATS_EVERY: Duration = Duration::from_secs(1);
            let mut last_stats = Instant::now() - STATS_EVERY;
            let mut last_sync = Instant::now();
            while !stopping.load(Ordering::Acquire) {
                // Asleep until the next job is due (stop unparks it).
                let next =
                    sync_every.map_or(last_stats + STATS_EVERY, |e| (last_stats + STATS_EVERY).min(last_sync + e));
                std::thread::park_timeout(next.saturating_duration_since(Instant::now()));
                if stopping.load(Ordering::Acquire) {
                    break;
                }
                if last_stats.elapsed() >= STATS_EVERY {
                    last_stats = Instant::now();
                    if let Ok(stats) = service.stats() {
                        publish(&gauges, &stats);
                        gauges.heap_fragment_bytes.set(service.heap_fragment_bytes() as i64);
                    }
                    if let Some(c) = &connections {
                        gauges.connections.set(c() as i64);
                    }
                }
                if let Some(every) = sync_every {
                    if last_sync.elapsed() >= every {
                        last_sync = Instant::now();
                        if let Err(e) = region.flush() {
                            tracing::error!("flushing the data file failed: {e}");
                        }
                        gauges.last_sync_seconds.set(last_sync.elapsed().as_secs_f64());
                    }
                }
            }
        })?)
    }

    /// Re-reads the tcp listener's TLS certificate, key and CA; new connections use them,
    /// open ones keep theirs. On failure the previous certificate stays in use. Ok(false):
    /// no TLS is configured.
    pub fn reload_tls(&self) -> anyhow::Result<bool> {
        match self.server.as_ref().and_then(|s| s.tls()) {
            Some(tls) => {
                tls.reload().context("reloading the TLS certificate (still serving the previous one)")?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Where the memnode listens, one endpoint per transport.
    pub fn endpoints(&self) -> &[Endpoint] {
        self.server.as_ref().map_or(&[], |s| s.endpoints())
    }

    /// What this start's reclaim did (None: a new or memfd region, or the reclaim failed).
    pub fn start_reclaim(&self) -> Option<&StartReclaim> {
        self.start_reclaim.as_ref()
    }

    /// Where its /metrics server listens (None: not configured).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr())
    }

    /// The region's layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The table's statistics, read from the region.
    pub fn stats(&self) -> anyhow::Result<TableStats> {
        Ok(self.service.stats()?)
    }

    /// A one-line JSON description for whoever started us (endpoints, metrics address).
    pub fn ready_line(&self) -> String {
        serde_json::json!({
            "endpoints": self.endpoints().iter().map(|e| e.to_string()).collect::<Vec<_>>(),
            "metrics": self.metrics_addr().map(|a| a.to_string()),
            "region_bytes": self.layout.region_len,
            "pid": std::process::id(),
        })
        .to_string()
    }

    /// Stops serving, flushes the region to its file, and returns.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        // Out of the cluster's list before it stops answering.
        self.registration.take();
        self.stopping.store(true, Ordering::Release);
        // The expiry first: it gives back what it freed through the loopback connection.
        if let Some(h) = self.expiry.take() {
            h.thread().unpark();
            let _ = h.join();
        }
        if let Some(mut server) = self.server.take() {
            server.shutdown();
        }
        if let Some(h) = self.housekeeping.take() {
            h.thread().unpark();
            let _ = h.join();
        }
        self.metrics.take();
        if self.config.data_file.is_some() {
            self.region.flush().context("flushing the data file")?;
        }
        Ok(())
    }
}

impl Drop for Memnode {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!("memnode shutdown: {e:#}");
        }
    }
}

/// Frees the heap space nothing references, in a reopened region nobody is served yet.
/// Nobody holds heap space now (clients drop what they held from the last run), so
/// everything no slot references is free, crashed processes' space included. shm clients of
/// the last run write into the file directly: `fence` lets them notice it is gone first.
/// None if it failed: not knowing what is live, it frees nothing, and serving goes on.
fn reclaim_at_start(local: &dyn Connection, layout: &Layout, fence: Duration) -> Option<StartReclaim> {
    if !fence.is_zero() {
        tracing::info!(ms = fence.as_millis() as u64, "waiting for clients of the last run to notice it stopped");
        std::thread::sleep(fence);
    }
    let started = Instant::now();
    let reclaimed = match reclaim(local, layout) {
        Ok(reclaimed) => reclaimed,
        Err(e) => {
            tracing::error!("could not reclaim unreferenced heap space, serving without: {e}");
            return None;
        }
    };
    let duration = started.elapsed();
    tracing::info!(
        live_bytes = reclaimed.live_bytes,
        free_list_bytes = reclaimed.free_list_bytes,
        fragment_bytes = reclaimed.fragment_bytes,
        heap_top_lowered_bytes = reclaimed.heap_top_before - reclaimed.heap_top_after,
        ms = duration.as_millis() as u64,
        "reclaimed the heap space nothing references"
    );
    Some(StartReclaim { duration, reclaimed })
}

/// A random, non-zero node id (from the kernel's random source).
fn random_node_id() -> u64 {
    // Never 0 (no node); never the same for every memnode should /dev/urandom fail.
    racekv_telemetry::random::random_u64().max(1)
}

fn publish(g: &Gauges, stats: &TableStats) {
    g.heap_used_bytes.set(stats.heap.heap_used_bytes as i64);
    g.heap_free_bytes.set(stats.heap.heap_free_bytes as i64);
    g.items.set(stats.items as i64);
    g.slots.set(stats.slots as i64);
    g.load_factor.set(stats.load_factor);
    g.global_depth.set(i64::from(stats.global_depth));
    g.subtables.set(stats.heap.subtables as i64);
    g.chunks.set(stats.heap.chunks as i64);
}
