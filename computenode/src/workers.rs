//! Worker threads that drain the work queue, and the autoscaler that adds workers within
//! milliseconds when the queue backs up and lets them retire when idle.
//!
//! A new worker is useful at once because it attaches a pre-initialized session (see
//! `cluster.rs`); it opens no connection of its own.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use parking_lot::Mutex;
use prometheus::{Histogram, IntCounterVec, IntGauge};

use crate::cluster::Cluster;
use crate::eviction::Eviction;
use crate::queue::WorkQueue;

/// When to add and retire workers.
#[derive(Debug, Clone, Copy)]
pub struct ScaleOptions {
    /// Workers that run even when idle.
    pub min_workers: usize,
    /// Most workers there may be.
    pub max_workers: usize,
    /// Add workers when this many requests wait...
    pub scale_up_depth: usize,
    /// ...or when the last request waited this long for a worker.
    pub scale_up_wait: Duration,
    /// A worker idle this long retires (while more than `min_workers` remain).
    pub idle_retire: Duration,
    /// How often the autoscaler looks.
    pub tick: Duration,
}

struct Metrics {
    workers: IntGauge,
    scale_events: IntCounterVec,
    requests: IntCounterVec,
    service_seconds: Histogram,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    Metrics {
        workers: metric::gauge("racekv_computenode_workers", "Worker threads draining the queue"),
        scale_events: metric::counter_vec(
            "racekv_computenode_scale_events_total",
            "Workers added or retired",
            &["direction"],
            &[&["up", "down"]],
        ),
        requests: metric::counter_vec(
            "racekv_computenode_requests_total",
            "Queued requests served by workers",
            &["result"],
            &[&["ok", "error"]],
        ),
        service_seconds: metric::latency_histogram(
            "racekv_computenode_service_seconds",
            "Time a worker spent on one queued request",
        ),
    }
});

struct Shared {
    queue: Arc<WorkQueue>,
    cluster: Arc<Cluster>,
    /// Cache mode: the requests' writes evict as the Redis front end's do.
    eviction: Arc<Eviction>,
    options: ScaleOptions,
    live: AtomicUsize,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The worker pool and its autoscaler.
pub struct Workers {
    shared: Arc<Shared>,
    autoscaler: Option<JoinHandle<()>>,
}

impl Workers {
    /// Starts `min_workers` workers on `queue` and the autoscaler that adds and retires more;
    /// their writes are kept under `maxmemory` by `eviction`.
    pub fn start(
        queue: Arc<WorkQueue>,
        cluster: Arc<Cluster>,
        eviction: Arc<Eviction>,
        options: ScaleOptions,
    ) -> std::io::Result<Self> {
        LazyLock::force(&METRICS);
        assert!(options.min_workers <= options.max_workers && options.max_workers >= 1);
        let shared = Arc::new(Shared {
            queue,
            cluster,
            eviction,
            options,
            live: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        for _ in 0..options.min_workers {
            spawn_worker(&shared)?;
        }
        let scaler = Arc::clone(&shared);
        let autoscaler = std::thread::Builder::new().name("autoscaler".into()).spawn(move || autoscale(&scaler))?;
        Ok(Self { shared, autoscaler: Some(autoscaler) })
    }

    /// Workers alive now.
    pub fn live(&self) -> usize {
        self.shared.live.load(Ordering::Relaxed)
    }

    /// Stops the autoscaler and every worker, and waits for them.
    pub fn shutdown(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.queue.wake_sleeper();
        if let Some(h) = self.autoscaler.take() {
            let _ = h.join();
        }
        let threads: Vec<_> = std::mem::take(&mut *self.shared.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts one worker if below the maximum. Returns whether it did.
fn spawn_worker(shared: &Arc<Shared>) -> std::io::Result<bool> {
    let admitted = shared
        .live
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < shared.options.max_workers).then_some(n + 1));
    if admitted.is_err() {
        return Ok(false);
    }
    METRICS.workers.inc();
    let worker = Arc::clone(shared);
    racekv_transport::listen::spawn_tracked(&shared.threads, "worker".into(), move || work(&worker))
        .map(|()| true)
        .inspect_err(|_| {
            shared.live.fetch_sub(1, Ordering::AcqRel);
            METRICS.workers.dec();
        })
}

fn work(shared: &Shared) {
    let mut session = shared.cluster.attach();
    let mut idle_since = Instant::now();
    loop {
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        match shared.queue.next(shared.options.idle_retire.min(Duration::from_millis(100))) {
            Ok(job) => {
                let started = Instant::now();
                let reply = crate::execute::execute(&shared.eviction, &mut session, &job.request);
                let result = if matches!(reply, racekv_client::op::Reply::Error(..)) { "error" } else { "ok" };
                METRICS.requests.with_label_values(&[result]).inc();
                (job.reply)(reply);
                METRICS.service_seconds.observe(started.elapsed().as_secs_f64());
                idle_since = Instant::now();
                if shared.queue.depth() == 0 {
                    // Going idle: publish item-count changes now, not with the next job.
                    if let Err(e) = session.publish_counts() {
                        tracing::debug!("publishing a worker's item count failed: {e}");
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if idle_since.elapsed() < shared.options.idle_retire {
                    continue;
                }
                let retired = shared.live.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n > shared.options.min_workers).then_some(n - 1)
                });
                if retired.is_ok() {
                    METRICS.workers.dec();
                    METRICS.scale_events.with_label_values(&["down"]).inc();
                    return;
                }
                idle_since = Instant::now();
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    shared.live.fetch_sub(1, Ordering::AcqRel);
    METRICS.workers.dec();
}

/// Empty-queue ticks after which the autoscaler sleeps until the next submit.
const QUIET_TICKS_BEFORE_SLEEP: u32 = 40;
/// Longest such sleep (a safety net; submits wake it).
const MAX_IDLE_SLEEP: Duration = Duration::from_secs(1);

fn autoscale(shared: &Arc<Shared>) {
    let mut quiet_ticks = 0;
    while !shared.stopping.load(Ordering::Acquire) {
        if quiet_ticks >= QUIET_TICKS_BEFORE_SLEEP {
            // Idle: no ticking (thousands of wake-ups a second) until work arrives.
            // Still quiet after it (a timeout): straight back to sleep.
            shared.queue.wait_for_work(MAX_IDLE_SLEEP);
        } else {
            std::thread::sleep(shared.options.tick);
        }
        let depth = shared.queue.depth();
        quiet_ticks = if depth == 0 { quiet_ticks + 1 } else { 0 };
        let backed_up = depth >= shared.options.scale_up_depth
            || (depth > 0 && shared.queue.last_wait() >= shared.options.scale_up_wait);
        if !backed_up {
            continue;
        }
        let wanted = (depth / shared.options.scale_up_depth.max(1)).max(1);
        for _ in 0..wanted {
            match spawn_worker(shared) {
                Ok(true) => METRICS.scale_events.with_label_values(&["up"]).inc(),
                Ok(false) => break,
                Err(e) => {
                    tracing::error!("cannot start a worker: {e}");
                    break;
                }
            }
        }
    }
}
