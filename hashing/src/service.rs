//! The memnode's RPC methods over the table: metadata, chunk allocation, split, statistics.
//! A pure handler: the memnode daemon owns the sockets and threads.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use racekv_transport::{Batch, Connection, RpcService, RpcStatus};

use crate::alloc::Chunk;
use crate::error::Error;
use crate::extents::Extents;
use crate::heap::{Heap, HeapUsage};
use crate::layout::{sb, Layout};
use crate::rpc::{self, method, status, Metadata, SplitRequest};
use crate::split::{SplitOutcome, Splitter};
use crate::words::read_word;

/// The shortest wait before a retired extent is reused, whatever the published grace
/// period: a large value takes a while to read.
const DEFAULT_EXTENT_GRACE: Duration = Duration::from_millis(100);

/// Statistics of one memnode's table.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct TableStats {
    /// The region's layout.
    pub layout: Layout,
    /// Current global depth of the directory.
    pub global_depth: u32,
    /// Keys stored (clients maintain it with FAA; it trails operations in flight).
    pub items: u64,
    /// Slots in all subtables.
    pub slots: u64,
    /// Items over slots.
    pub load_factor: f64,
    /// What the heap holds.
    pub heap: HeapUsage,
}

struct Ready {
    conn: Arc<dyn Connection>,
    heap: Arc<Heap>,
    splitter: Splitter,
    extents: Arc<Extents>,
    /// The server instance clients reach this run through (see [`crate::alloc::Chunk`]).
    instance: u64,
}

/// Serves the table's RPCs once [`TableService::attach`] gave it a loopback connection.
pub struct TableService {
    layout: Layout,
    node_id: u64,
    ready: OnceLock<Ready>,
}

impl TableService {
    /// The table service of the region with `layout`, for the memnode `node_id`.
    pub fn new(layout: Layout, node_id: u64) -> Self {
        crate::split::register_metrics();
        crate::expiry::register_metrics();
        crate::extents::register_metrics();
        Self { layout, node_id, ready: OnceLock::new() }
    }

    /// Gives the service the connection it uses for its own region work: a loopback of the
    /// transport clients use (see design.md, "Atomicity on real NICs"), and the server
    /// instance clients connect to (the run that heap space it hands out belongs to).
    pub fn attach(&self, conn: Arc<dyn Connection>, instance: u64) {
        let heap = Arc::new(Heap::new(Arc::clone(&conn), self.layout));
        if let Err(e) = heap.publish_fragment_bytes() {
            tracing::warn!("could not zero the fragment count in the superblock: {e}");
        }
        let splitter = Splitter::new(Arc::clone(&conn), self.layout, Arc::clone(&heap));
        // Retired extents wait as long as clients wait before reusing a block.
        let grace = crate::format::read_grace_period(&*conn).ok().flatten().unwrap_or(DEFAULT_EXTENT_GRACE);
        let extents = Arc::new(Extents::new(Arc::clone(&heap), grace.max(DEFAULT_EXTENT_GRACE), self.node_id));
        let _ = self.ready.set(Ready { conn, heap, splitter, extents, instance });
    }

    fn ready(&self) -> Result<&Ready, RpcStatus> {
        self.ready.get().ok_or_else(|| RpcStatus::new(status::NOT_READY, "the memnode is still starting"))
    }

    /// The table's statistics, read from the region.
    pub fn stats(&self) -> Result<TableStats, Error> {
        let ready = self.ready.get().ok_or_else(|| Error::NotReady("the memnode is still starting".into()))?;
        table_stats(&*ready.conn, &self.layout, &ready.heap)
    }

    /// Of the heap's free bytes, those in runs too short to hand out yet (see `heap.rs`).
    pub fn heap_fragment_bytes(&self) -> u64 {
        self.ready.get().map_or(0, |r| r.heap.fragment_bytes())
    }

    /// The active expiry over the service's loopback connection and heap (None before
    /// [`Self::attach`]). The memnode runs one.
    pub fn active_expiry(&self, options: crate::expiry::ExpiryOptions) -> Option<crate::expiry::ActiveExpiry> {
        let ready = self.ready.get()?;
        Some(crate::expiry::ActiveExpiry::new(
            Arc::clone(&ready.conn),
            self.layout,
            Arc::clone(&ready.heap),
            Arc::clone(&ready.extents),
            options,
        ))
    }

    /// The value extents (None before [`Self::attach`]): the memnode's expiry retires
    /// extents through it, and its loop gives retired ones back ([`Extents::release`]).
    pub fn extents(&self) -> Option<Arc<Extents>> {
        self.ready.get().map(|r| Arc::clone(&r.extents))
    }

    /// Takes in the live extents found at start (after [`Self::attach`]).
    pub fn seed_extents(&self, live: &[(u64, u64)]) -> Result<(), Error> {
        match self.ready.get() {
            Some(r) => {
                r.extents.seed(live);
                Ok(())
            }
            None => Err(Error::Remote("the service is not attached".into())),
        }
    }

    /// Gives the heap the short free runs found at start (after [`Self::attach`]).
    pub fn seed_fragments(&self, saved: &[(u64, u64)]) -> Result<(), Error> {
        match self.ready.get() {
            Some(r) => r.heap.seed_fragments(saved),
            None => Err(Error::Remote("the service is not attached".into())),
        }
    }
}

/// Reads the statistics through `conn`.
pub fn table_stats(conn: &dyn Connection, layout: &Layout, heap: &Heap) -> Result<TableStats, Error> {
    let mut b = Batch::new();
    let gd = b.read(sb::GLOBAL_DEPTH, 8);
    let items = b.read(sb::ITEM_COUNT, 8);
    conn.execute(&mut b)?;
    let heap = heap.usage()?;
    let slots = heap.subtables * layout.slots_per_subtable();
    // The count is a sum of signed deltas; a momentary negative reads as a huge u64.
    let items = read_word(b.read_result(items)?);
    let items = if items > u64::MAX / 2 { 0 } else { items };
    Ok(TableStats {
        layout: *layout,
        global_depth: read_word(b.read_result(gd)?) as u32,
        items,
        slots,
        load_factor: if slots == 0 { 0.0 } else { items as f64 / slots as f64 },
        heap,
    })
}

/// Parses the STATS reply.
pub fn decode_stats(bytes: &[u8]) -> Option<TableStats> {
    serde_json::from_slice(bytes).ok()
}

fn failure(e: Error) -> RpcStatus {
    match e {
        Error::OutOfMemory(m) => RpcStatus::new(status::OUT_OF_MEMORY, m),
        Error::TableFull(m) => RpcStatus::new(status::TABLE_FULL, m),
        Error::StaleInstance(m) => RpcStatus::new(status::STALE_INSTANCE, m),
        Error::NotReady(m) => RpcStatus::new(status::NOT_READY, m),
        other => RpcStatus::new(RpcStatus::FAILED, other.to_string()),
    }
}

impl RpcService for TableService {
    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, RpcStatus> {
        match method {
            method::METADATA => Ok(Metadata { layout: self.layout, node_id: self.node_id }.encode()),
            method::ALLOC_CHUNK => {
                let preferred = rpc::decode_chunk_request(request).map_err(rpc::bad_request)?;
                let ready = self.ready()?;
                let (offset, bytes) =
                    ready.heap.alloc_chunk(preferred.unwrap_or(self.layout.chunk_bytes)).map_err(failure)?;
                Ok(rpc::encode_chunk(&Chunk { offset, bytes, instance: ready.instance }))
            }
            method::TAKE_FRAGMENTS => {
                let most = rpc::decode_fragments_request(request).map_err(rpc::bad_request)?;
                let ready = self.ready()?;
                Ok(rpc::encode_ranges(ready.instance, &ready.heap.take_fragments(most).map_err(failure)?))
            }
            method::RETURN_RANGES => {
                let (instance, ranges) = rpc::decode_ranges(request).map_err(rpc::bad_request)?;
                let ready = self.ready()?;
                if instance != ready.instance {
                    // Handed out by an earlier run: this run's start reclaimed what of it
                    // was free, and may have handed it out again.
                    return Err(failure(Error::StaleInstance(format!(
                        "{} ranges handed out by run {instance:#x}; this is run {:#x}, which reclaimed them at its start",
                        ranges.len(),
                        ready.instance
                    ))));
                }
                ready.heap.return_ranges(&ranges).map_err(failure)?;
                Ok(Vec::new())
            }
            method::ALLOC_EXTENT => {
                let [value_len] = rpc::decode_words::<1>(request).map_err(rpc::bad_request)?;
                let ready = self.ready()?;
                let offset = ready.extents.alloc(value_len).map_err(failure)?;
                Ok(rpc::encode_words(&[ready.instance, offset]))
            }
            method::RETIRE_EXTENT => {
                let [instance, offset, value_len] = rpc::decode_words::<3>(request).map_err(rpc::bad_request)?;
                let ready = self.ready()?;
                if instance != ready.instance {
                    return Err(failure(Error::StaleInstance(format!(
                        "extent at {offset} handed out by run {instance:#x}; this is run {:#x}",
                        ready.instance
                    ))));
                }
                ready.extents.retire(offset, value_len).map_err(failure)?;
                Ok(Vec::new())
            }
            method::SPLIT => {
                let req = SplitRequest::decode(request).map_err(rpc::bad_request)?;
                match self.ready()?.splitter.split(&req).map_err(failure)? {
                    SplitOutcome::AlreadyDone => Ok(vec![0]),
                    SplitOutcome::Split { .. } => Ok(vec![1]),
                }
            }
            method::STATS => {
                let stats = self.stats().map_err(failure)?;
                Ok(serde_json::to_vec(&stats).expect("stats serialize"))
            }
            other => Err(RpcStatus::new(RpcStatus::UNKNOWN_METHOD, format!("the memnode has no rpc method {other}"))),
        }
    }

    fn method_name(&self, method: u16) -> &'static str {
        rpc::method_name(method)
    }
}
