//! The shm backend: the region is a shared mapping on this host.
//!
//! Connecting runs the token handshake over the server's Unix socket; its last reply
//! (HelloOk) carries the region's file descriptor, which we map. From then on every op is a CPU load, store or atomic on the
//! mapping (no system call, no server involvement). The socket stays open as a liveness
//! signal: a watcher thread notices when the server closes it, and from then on `execute`
//! fails with `ConnectionLost` instead of writing into an orphaned region. RPCs travel on
//! FLOCK lanes over shared-memory rings ([`crate::flock`]), opened on the first call.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;

use prometheus::local::LocalIntCounter;
use prometheus::IntCounter;

use crate::batch::Batch;
use crate::error::TransportError;
use crate::flock::shm::open_shm_lane;
use crate::flock::{Channel, FlockOptions};
use crate::mux::error_frame;
use crate::net::{dial_unix, read_frame_with_fd, watch_peer};
use crate::region::Region;
use crate::stream::POLL_INTERVAL;
use crate::wire::{self, Kind};
use crate::{ConnectOptions, Connection, TransportKind};

static BATCHES: LazyLock<IntCounter> = LazyLock::new(|| {
    racekv_telemetry::metric::counter("racekv_transport_shm_batches_total", "Batches executed on shared mappings")
});

thread_local! {
    /// Counting each batch on a shared atomic would bounce one cache line between every
    /// worker thread; count per thread and publish every 1024 batches (and at thread exit).
    static LOCAL_BATCHES: RefCell<(LocalIntCounter, u32)> = RefCell::new((BATCHES.local(), 0));
}

fn count_batch() {
    LOCAL_BATCHES.with(|cell| {
        let mut local = cell.borrow_mut();
        local.0.inc();
        local.1 += 1;
        if local.1 >= 1024 {
            local.0.flush();
            local.1 = 0;
        }
    });
}

/// A connection over a shared mapping. Any number of threads may share it.
pub struct ShmConnection {
    region: Region,
    rpc: Channel,
    hello: wire::HelloOk,
    lost: Arc<AtomicBool>,
    control: UnixStream,
    watcher: Option<JoinHandle<()>>,
}

impl ShmConnection {
    /// Connects to the region server's Unix socket at `path`, authenticates and maps the region.
    pub fn connect(path: &Path, options: &ConnectOptions) -> Result<Self, TransportError> {
        Self::connect_with(path, options, &FlockOptions::default())
    }

    /// [`Self::connect`] with explicit settings for the RPC channel.
    pub fn connect_with(path: &Path, options: &ConnectOptions, rpc: &FlockOptions) -> Result<Self, TransportError> {
        let (stream, region_file, hello) = Self::dial(path, options)?;
        let (lane_path, lane_options) = (path.to_path_buf(), options.clone());
        let open = move |sender, lanes: usize| {
            (0..lanes).map(|lane| open_shm_lane(&lane_path, &lane_options, sender, lane as u16)).collect()
        };
        let endpoint = format!("shm:{}", path.display());
        let channel = Channel::new(rpc.clone(), options.timeout, endpoint.clone(), Box::new(open));
        Self::assemble(stream, &region_file, hello, &endpoint, channel)
    }

    /// Authenticates on the region server's socket at `path`: the control socket, the
    /// region's file and the server's hello.
    pub(crate) fn dial(
        path: &Path,
        options: &ConnectOptions,
    ) -> Result<(UnixStream, File, wire::HelloOk), TransportError> {
        let endpoint = format!("shm:{}", path.display());
        let fail = |reason: String| TransportError::Connect { endpoint: endpoint.clone(), reason };
        let mut stream = dial_unix(path, options.timeout, &fail)?;
        crate::auth::connect(&mut stream, &options.token, options.user.as_deref(), options.timeout, &endpoint)?;

        // The descriptor rides on the first bytes of the reply.
        let mut body = Vec::new();
        let (header, region_fd) = read_frame_with_fd(&mut stream, &mut body, options.timeout, "during hello", &fail)?;
        let hello = match header.kind {
            Kind::HelloOk => wire::decode_hello_ok(&body).map_err(|e| TransportError::Protocol(e.to_string()))?,
            Kind::Error => return Err(error_frame(&body, &endpoint)),
            other => return Err(TransportError::Protocol(format!("{endpoint} answered hello with {other:?}"))),
        };
        match region_fd {
            Some(fd) if hello.flags & wire::HELLO_FLAG_REGION_FD != 0 => Ok((stream, File::from(fd), hello)),
            _ => Err(fail("the server did not pass its region (is it a tcp-only server?)".into())),
        }
    }

    /// A connection from an authenticated control socket, the region's file, the server's
    /// hello and an RPC channel: maps the region and watches the socket.
    pub(crate) fn assemble(
        stream: UnixStream,
        region_file: &File,
        hello: wire::HelloOk,
        endpoint: &str,
        rpc: Channel,
    ) -> Result<Self, TransportError> {
        let fail = |reason: String| TransportError::Connect { endpoint: endpoint.to_string(), reason };
        let region =
            Region::map_file(region_file, hello.region_len).map_err(|e| fail(format!("mapping the region: {e}")))?;
        stream.set_read_timeout(Some(POLL_INTERVAL)).map_err(|e| fail(e.to_string()))?;
        let lost = Arc::new(AtomicBool::new(false));
        let watch = stream.try_clone().map_err(|e| fail(e.to_string()))?;
        let watcher_lost = Arc::clone(&lost);
        let watcher = std::thread::Builder::new()
            .name("shm-liveness".into())
            .spawn(move || watch_peer(&watch, &watcher_lost))
            .map_err(|e| fail(e.to_string()))?;
        Ok(Self { region, rpc, hello, lost, control: stream, watcher: Some(watcher) })
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
    }
}

impl Connection for ShmConnection {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(TransportError::ConnectionLost {
                reason: "the region server closed its control socket".into(),
                maybe_executed: false,
            });
        }
        batch.validate(self.hello.region_len, self.hello.instance)?;
        self.region.apply(batch);
        count_batch();
        batch.first_failure()
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, TransportError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(TransportError::ConnectionLost {
                reason: "the region server closed its control socket".into(),
                maybe_executed: false,
            });
        }
        self.rpc.call(method, request)
    }

    fn abort(&self, reason: &str) {
        // Batches here never wait on the server; its RPCs do.
        self.rpc.abort(reason);
    }

    fn region_len(&self) -> u64 {
        self.hello.region_len
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn instance(&self) -> u64 {
        self.hello.instance
    }

    fn is_healthy(&self) -> bool {
        !self.lost.load(Ordering::Acquire)
    }
}
