//! The computenode daemon: sets up the cluster once (pools, metadata, ready sessions),
//! runs the workers and their autoscaler, and serves the front ends.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use racekv_client::op::Request;
use racekv_telemetry::{HttpLimits, MetricsServer, ReadyFn, Routes, StatusFn};
use serde::Serialize;

use crate::cluster::{Attached, Cluster};
use crate::config::ComputenodeConfig;
use crate::eviction::Eviction;
use crate::queue::{Overloaded, ReplyFn, Submit, WorkQueue};
use crate::store::ClusterStore;
use crate::workers::Workers;
use racekv_redis::{RedisServer, ServerOptions, TlsPort};
use racekv_transport::ServerTls;

/// What `/status` and INFO report.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// Each memnode, in configured order.
    pub memnodes: Vec<MemnodeStatus>,
    /// The epoch of the cluster map keys are routed by (None: a fixed ring, no etcd).
    pub map_epoch: Option<u64>,
    /// Worker threads running now.
    pub workers: usize,
    /// Requests waiting in the work queue.
    pub queue_depth: usize,
    /// Pre-initialized sessions ready for attach.
    pub ready_sessions: usize,
    /// The Redis front end's address (None: off).
    pub redis_addr: Option<String>,
    /// The Redis TLS port's address (None: off).
    pub redis_tls_addr: Option<String>,
    /// Redis connections open now (None: the front end is off).
    pub redis_clients: Option<usize>,
    /// The remote front end's address (None: off).
    pub remote_addr: Option<String>,
    /// The attach socket's path (None: off).
    pub attach_socket: Option<String>,
    /// Processes attached now (None: the attach front end is off).
    pub attached_clients: Option<usize>,
}

/// One memnode in a [`Status`].
#[derive(Debug, Clone, Serialize)]
pub struct MemnodeStatus {
    /// Its endpoint.
    pub endpoint: String,
    /// Its persistent node id.
    pub node_id: u64,
    /// Connections in its pool.
    pub connections: usize,
    /// Of those, the ones that work now.
    pub healthy_connections: usize,
    /// Heap chunks fetched ahead, ready for new sessions.
    pub prefetched_chunks: usize,
    /// Size of its region, in bytes.
    pub region_bytes: u64,
    /// Estimated live data, as cache mode measures it against `maxmemory` (0 while no
    /// limit is set).
    pub used_bytes: u64,
    /// Its `maxmemory` in bytes (0: none; a share resolved against its region).
    pub maxmemory_bytes: u64,
}

struct Parts {
    cluster: Arc<Cluster>,
    /// Cache mode (`maxmemory`).
    eviction: Arc<Eviction>,
    queue: Arc<WorkQueue>,
    workers: parking_lot::Mutex<Workers>,
    redis: parking_lot::Mutex<Option<RedisServer>>,
    remote: parking_lot::Mutex<Option<racekv_transport::RegionServer>>,
    attach: parking_lot::Mutex<Option<crate::attach::AttachServer>>,
    /// The front ends' TLS (shared by the Redis TLS port and the remote front end).
    tls: Option<ServerTls>,
    /// The attach and remote front ends' requests and replies in parts.
    staging: Arc<crate::staging::Staging>,
}

impl Parts {
    fn status(&self) -> Status {
        // Each lock once: parking_lot mutexes are not reentrant.
        let redis = self.redis.lock();
        let attach = self.attach.lock();
        Status {
            memnodes: self
                .cluster
                .memnodes()
                .iter()
                .enumerate()
                .map(|(i, m)| MemnodeStatus {
                    endpoint: m.label.clone(),
                    node_id: m.node_id,
                    connections: m.pool.size(),
                    healthy_connections: m.pool.healthy(),
                    prefetched_chunks: m.chunks.ready(),
                    region_bytes: m.layout.region_len,
                    used_bytes: self.eviction.used_bytes(i),
                    maxmemory_bytes: self.eviction.limit_bytes(i),
                })
                .collect(),
            map_epoch: self.cluster.map_epoch(),
            workers: self.workers.lock().live(),
            queue_depth: self.queue.depth(),
            ready_sessions: self.cluster.ready_sessions(),
            redis_addr: redis.as_ref().map(|r| r.local_addr().to_string()),
            redis_tls_addr: redis.as_ref().and_then(|r| r.tls_addr()).map(|a| a.to_string()),
            redis_clients: redis.as_ref().map(|r| r.stats().connected_clients()),
            remote_addr: self.remote.lock().as_ref().map(|r| r.endpoints()[0].to_string()),
            attach_socket: attach.as_ref().map(|a| a.socket_path().display().to_string()),
            attached_clients: attach.as_ref().map(|a| a.attached_clients()),
        }
    }

    /// Ready for traffic: every memnode has a healthy connection (each key lives on one
    /// memnode, so a computenode cut off from any of them answers errors for its keys).
    fn ready(&self) -> Result<(), String> {
        let cut_off: Vec<String> = self
            .cluster
            .memnodes()
            .iter()
            .filter(|m| m.pool.healthy_after_repair() == 0)
            .map(|m| format!("{} (0 of {} connections healthy)", m.label, m.pool.size()))
            .collect();
        if cut_off.is_empty() {
            Ok(())
        } else {
            Err(format!("no healthy connection to memnode {}", cut_off.join(", ")))
        }
    }

    fn info_lines(&self) -> String {
        let s = self.status();
        let mut out = format!(
            "racekv_memnodes:{}\r\nracekv_workers:{}\r\nracekv_queue_depth:{}\r\nracekv_ready_sessions:{}\r\n",
            s.memnodes.len(),
            s.workers,
            s.queue_depth,
            s.ready_sessions
        );
        for (i, m) in s.memnodes.iter().enumerate() {
            out.push_str(&format!(
                "racekv_memnode{i}:endpoint={},connections={},healthy={},region_bytes={},used_bytes={},maxmemory={}\r\n",
                m.endpoint, m.connections, m.healthy_connections, m.region_bytes, m.used_bytes, m.maxmemory_bytes
            ));
        }
        out
    }
}

/// A running computenode.
pub struct Computenode {
    parts: Arc<Parts>,
    metrics: Option<MetricsServer>,
    map_follower: Option<racekv_client::map_follower::MapFollower>,
}

impl Computenode {
    /// Connects to the memnodes, starts the workers and the configured front ends, and
    /// serves /metrics if asked.
    pub fn start(mut config: ComputenodeConfig) -> anyhow::Result<Self> {
        // With etcd the cluster map names the memnodes (and how keys route to them).
        let map = crate::map_follower::fetch(&config)?;
        if let Some(map) = &map {
            config.memnodes = map.endpoints()?;
        }
        config.validate()?;
        let acl = Arc::new(config.acl().context("loading the users (requirepass, aclfile)")?);
        let tls = match config.tls_files() {
            Some(files) => Some(ServerTls::load(files).context("loading the front ends' TLS files")?),
            None => None,
        };
        let mut cluster_options = config.cluster_options()?;
        if let Some(map) = &map {
            cluster_options.routing = crate::map_follower::routing(map);
        }
        let cluster = Cluster::connect(cluster_options).context("connecting to the memnodes")?;
        let map_follower = map.map(|m| crate::map_follower::follow(m, &cluster)).transpose()?;
        let maxmemory = Arc::new(config.maxmemory());
        let grace = Duration::from_millis(config.grace_period_ms);
        let eviction =
            Eviction::start(&cluster, Arc::clone(&maxmemory), grace).context("starting the maxmemory refresher")?;
        let queue = Arc::new(WorkQueue::new(config.queue_capacity));
        let workers =
            Workers::start(Arc::clone(&queue), Arc::clone(&cluster), Arc::clone(&eviction), config.scale_options())
                .context("starting workers")?;
        // One budget for both front ends' requests and replies in parts.
        let staging = crate::staging::Staging::start(config.staging_options());
        let parts = Arc::new(Parts {
            staging: Arc::clone(&staging),
            cluster: Arc::clone(&cluster),
            eviction: Arc::clone(&eviction),
            queue,
            workers: parking_lot::Mutex::new(workers),
            redis: parking_lot::Mutex::new(None),
            remote: parking_lot::Mutex::new(None),
            attach: parking_lot::Mutex::new(None),
            tls: tls.clone(),
        });
        if let Some(path) = &config.attach_socket {
            let submit: Arc<dyn Submit> = parts.queue.clone();
            let auth = crate::attach::AttachAuth { acl: Arc::clone(&acl), trust_uid: config.attach_trust_uid };
            let lender = config.attach_lend.then(|| {
                let lender = crate::lending::PoolLender::new(
                    Arc::clone(&cluster),
                    Arc::clone(&eviction),
                    Some(Arc::clone(&acl)),
                );
                Arc::new(lender) as Arc<dyn crate::attach::Lender>
            });
            let options = crate::attach::AttachOptions {
                auth: Some(auth),
                lender,
                staging: Some(Arc::clone(&staging)),
                ..crate::attach::AttachOptions::default()
            };
            let server = crate::attach::AttachServer::start(path, submit, options)
                .with_context(|| format!("starting the attach socket {}", path.display()))?;
            *parts.attach.lock() = Some(server);
        }
        if let Some(addr) = &config.remote_addr {
            let server = crate::remote::serve(
                Arc::clone(&cluster),
                Arc::clone(&eviction),
                addr,
                Arc::clone(&acl),
                tls.clone(),
                staging,
            )
            .with_context(|| format!("starting the remote front end on {addr}"))?;
            *parts.remote.lock() = Some(server);
        }
        if let Some(addr) = &config.redis_addr {
            let weak = Arc::downgrade(&parts);
            let info = Arc::new(move || weak.upgrade().map(|p| p.info_lines()).unwrap_or_default());
            let mut store = ClusterStore::new(Arc::clone(&cluster), info, Arc::clone(&eviction));
            if config.redis_gathers_gets() {
                store = store.gathering_gets();
            }
            let store = Arc::new(store);
            let options = ServerOptions {
                max_clients: config.redis_max_clients,
                io: config.redis_io_model(),
                poll_spin: Duration::from_micros(config.redis_poll_spin_us),
                acl: Arc::clone(&acl),
                protected_mode: config.protected_mode,
                maxmemory: Arc::clone(&maxmemory),
                tls: match (&config.redis_tls_addr, &tls) {
                    (Some(addr), Some(tls)) => Some(TlsPort { addr: addr.clone(), tls: tls.clone() }),
                    _ => None,
                },
                ..ServerOptions::default()
            };
            let server = RedisServer::start(addr.as_str(), store, options)
                .with_context(|| format!("starting the Redis front end on {addr}"))?;
            *parts.redis.lock() = Some(server);
        }
        let metrics = match config.metrics_addr {
            Some(addr) => {
                let weak = Arc::downgrade(&parts);
                let status: StatusFn = Arc::new(move || {
                    weak.upgrade()
                        .map(|p| serde_json::to_string(&p.status()).expect("status serializes"))
                        .unwrap_or_default()
                });
                let weak = Arc::downgrade(&parts);
                let ready: ReadyFn =
                    Arc::new(move || weak.upgrade().map_or_else(|| Err("shutting down".to_string()), |p| p.ready()));
                let routes = Routes { status: Some(status), ready: Some(ready) };
                Some(MetricsServer::start_with_routes(addr, routes, HttpLimits::default())?)
            }
            None => None,
        };
        Ok(Self { parts, metrics, map_follower })
    }

    /// A session over pre-initialized virtual connections, for a worker thread of this
    /// process (KRCORE's attach).
    pub fn attach(&self) -> Attached {
        self.parts.cluster.attach()
    }

    /// Where front ends hand requests to the workers.
    pub fn submitter(&self) -> Arc<dyn Submit> {
        self.parts.queue.clone()
    }

    /// Requests and replies in parts being transferred through the attach and remote front ends.
    pub fn staging(&self) -> &Arc<crate::staging::Staging> {
        &self.parts.staging
    }

    /// The memnodes and the ready sessions.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.parts.cluster
    }

    /// What `/status` and INFO report, now.
    pub fn status(&self) -> Status {
        self.parts.status()
    }

    /// The Redis front end's address, if it runs.
    pub fn redis_addr(&self) -> Option<SocketAddr> {
        self.parts.redis.lock().as_ref().map(|r| r.local_addr())
    }

    /// Where its /metrics server listens, if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr())
    }

    /// The Redis TLS port's address, if it runs.
    pub fn redis_tls_addr(&self) -> Option<SocketAddr> {
        self.parts.redis.lock().as_ref().and_then(|r| r.tls_addr())
    }

    /// Re-reads the front ends' TLS files (SIGHUP): new connections use them. Ok(false):
    /// no TLS configured. On error the previous certificate stays in use.
    pub fn reload_tls(&self) -> anyhow::Result<bool> {
        match &self.parts.tls {
            Some(tls) => tls.reload().map(|()| true).context("reloading the front ends' TLS files"),
            None => Ok(false),
        }
    }

    /// The remote front end's endpoint (`tcp:host:port`), if it runs.
    pub fn remote_endpoint(&self) -> Option<String> {
        self.parts.remote.lock().as_ref().map(|r| r.endpoints()[0].to_string())
    }

    /// One machine-readable line for supervisors and tests.
    pub fn ready_line(&self) -> String {
        serde_json::json!({
            "redis": self.redis_addr().map(|a| a.to_string()),
            "redis_tls": self.redis_tls_addr().map(|a| a.to_string()),
            "remote": self.remote_endpoint(),
            "attach": self.parts.attach.lock().as_ref().map(|a| a.socket_path().display().to_string()),
            "metrics": self.metrics_addr().map(|a| a.to_string()),
            "memnodes": self.parts.cluster.memnodes().iter().map(|m| m.label.clone()).collect::<Vec<_>>(),
            "pid": std::process::id(),
        })
        .to_string()
    }

    /// Stops the front ends, then the workers, then the cluster.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Submit for Computenode {
    fn submit(&self, request: Request, reply: ReplyFn) -> Result<(), Overloaded> {
        self.parts.queue.submit(request, reply)
    }
}

impl Drop for Computenode {
    fn drop(&mut self) {
        self.map_follower.take();
        if let Some(mut redis) = self.parts.redis.lock().take() {
            redis.shutdown();
        }
        self.parts.remote.lock().take();
        if let Some(mut attach) = self.parts.attach.lock().take() {
            attach.shutdown();
        }
        self.parts.workers.lock().shutdown();
        self.parts.eviction.stop();
        self.parts.cluster.stop();
        self.metrics.take();
    }
}
