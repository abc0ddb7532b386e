//! Tests of the attach front end with real components: a [`TestMemnode`] serving a RACE table
//! over shm, a [`WorkQueue`] drained by test worker threads that run each request through a
//! [`Session`] on that table, the [`AttachServer`], and attached [`Client`]s (and hostile
//! hand-made ones, and other processes).

mod basic;
mod hostile;
mod latency;
mod process;
mod stress;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use racekv_client::{Client, ClientError, Session, Shards};
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_hashing::{TableClient, TableOptions};
use racekv_transport::TransportKind;

use super::{AttachOptions, AttachServer};
use crate::queue::WorkQueue;

/// One memnode, reached through one table client.
pub(super) struct OneShard {
    label: String,
    client: TableClient,
}

impl Shards for OneShard {
    fn route(&self, _key: &[u8]) -> usize {
        0
    }
    fn count(&self) -> usize {
        1
    }
    fn label(&self, _shard: usize) -> &str {
        &self.label
    }
    fn node_id(&self, _shard: usize) -> u64 {
        0
    }
    fn timeout(&self) -> Duration {
        Duration::from_secs(10)
    }
    fn client(&mut self, _shard: usize) -> Result<&mut TableClient, ClientError> {
        Ok(&mut self.client)
    }
    fn clients(&mut self, shards: &[usize]) -> Result<Vec<&mut TableClient>, ClientError> {
        Ok(racekv_client::session::pick_mut(std::slice::from_mut(&mut self.client), shards))
    }
}

/// Worker threads draining the queue; stopped and joined on drop.
pub(super) struct Workers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// `n` workers; `spin` makes them poll the queue instead of parking (latency runs).
    pub(super) fn start(queue: &Arc<WorkQueue>, memnode: &TestMemnode, n: usize, spin: bool) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let table = memnode.table(TableOptions::default());
        let label = memnode.endpoint().map_or("local".into(), ToString::to_string);
        let threads = (0..n)
            .map(|i| {
                let mut session =
                    Session::new(OneShard { label: label.clone(), client: table.client(memnode.connect()) });
                let queue = Arc::clone(queue);
                let stop = Arc::clone(&stop);
                std::thread::Builder::new()
                    .name(format!("test-worker-{i}"))
                    .spawn(move || {
                        let wait = if spin { Duration::ZERO } else { Duration::from_millis(20) };
                        while !stop.load(Ordering::Acquire) {
                            match queue.next(wait) {
                                Ok(job) => {
                                    let reply = session.execute(&job.request);
                                    (job.reply)(reply);
                                }
                                Err(_) if spin => std::hint::spin_loop(),
                                Err(_) => {}
                            }
                        }
                    })
                    .unwrap()
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A memnode, a queue with workers, and an attach server in a temporary directory.
pub(super) struct Harness {
    // Dropped in this order: the server first (clients get their goodbyes), then the workers.
    pub server: AttachServer,
    pub workers: Option<Workers>,
    pub queue: Arc<WorkQueue>,
    pub memnode: TestMemnode,
    pub socket: PathBuf,
    pub _dir: tempfile::TempDir,
}

impl Harness {
    pub(super) fn start() -> Self {
        Self::with(1024, 2, AttachOptions::default())
    }

    pub(super) fn with(queue_capacity: usize, workers: usize, options: AttachOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("racekv").join("computenode.sock");
        Self::at(socket, dir, queue_capacity, workers, options)
    }

    pub(super) fn at(
        socket: PathBuf,
        dir: tempfile::TempDir,
        queue_capacity: usize,
        workers: usize,
        options: AttachOptions,
    ) -> Self {
        let memnode = TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 4);
        let queue = Arc::new(WorkQueue::new(queue_capacity));
        let workers = (workers > 0).then(|| Workers::start(&queue, &memnode, workers, false));
        let server = AttachServer::start(&socket, Arc::clone(&queue) as _, options).unwrap();
        Self { server, workers, queue, memnode, socket, _dir: dir }
    }

    pub(super) fn start_workers(&mut self, n: usize) {
        self.workers = Some(Workers::start(&self.queue, &self.memnode, n, false));
    }

    /// An attached client with a 5 s timeout.
    pub(super) fn client(&self) -> Client {
        self.client_with_timeout(Duration::from_secs(5))
    }

    pub(super) fn client_with_timeout(&self, timeout: Duration) -> Client {
        Client::builder().attach(&self.socket).timeout(timeout).connect().unwrap()
    }

    /// An embedded client on the same memnode.
    pub(super) fn embedded(&self) -> Client {
        Client::builder()
            .memnode(self.memnode.endpoint().unwrap().to_string())
            .token(TestMemnode::TOKEN)
            .connect()
            .unwrap()
    }

    /// Waits until `attached_clients()` is `n`.
    pub(super) fn wait_attached(&self, n: usize) {
        wait_for(Duration::from_secs(10), || self.server.attached_clients() == n)
            .unwrap_or_else(|| panic!("{} clients attached, expected {n}", self.server.attached_clients()));
    }
}

/// Polls `cond` until it holds or `within` passes.
pub(super) fn wait_for(within: Duration, mut cond: impl FnMut() -> bool) -> Option<()> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond().then_some(())
}

/// The value of a counter (with its labels, as rendered) in the default registry.
pub(super) fn metric(series: &str) -> f64 {
    racekv_telemetry::render()
        .lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0.0)
}
