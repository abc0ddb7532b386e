//! An in-process memnode for tests: a memfd region, formatted, served by a
//! [`RegionServer`] with the [`TableService`] over a real transport (or called directly).

use std::sync::Arc;
use std::time::Duration;

use racekv_transport::local::LocalConnection;
use racekv_transport::{ConnectOptions, Connection, Endpoint, Region, RegionServer, ServerOptions, TransportKind};

use crate::format::format;
use crate::heap::Heap;
use crate::layout::Layout;
use crate::service::{TableService, TableStats};
use crate::split::Splitter;
use crate::table::{Table, TableOptions};

const TOKEN: &str = "table-tests";

/// How the test's clients reach the memnode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Direct calls in this process (no sockets): fast, for property tests.
    Local,
    /// A real transport through a [`RegionServer`].
    Transport(TransportKind),
}

/// A memnode in this process for tests: a region, its table service, and a transport to reach it.
pub struct TestMemnode {
    region: Arc<Region>,
    layout: Layout,
    service: Arc<TableService>,
    server: Option<RegionServer>,
    endpoint: Option<Endpoint>,
    _dir: tempfile::TempDir,
}

impl TestMemnode {
    /// A memnode with a `region_len`-byte region and small subtables, so splits come early.
    pub fn start(via: Via, region_len: u64, groups_per_subtable: u32) -> Self {
        let file = racekv_transport::region::shared_memory_file("table-test", region_len, false).unwrap();
        let region = Arc::new(Region::map_file(&file, region_len).unwrap());
        let layout = Layout::for_region(region_len, groups_per_subtable, 64 << 10).unwrap();
        static NEXT_NODE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let node_id = NEXT_NODE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format(&LocalConnection::new(Arc::clone(&region), None), &layout, node_id).unwrap();
        let service = Arc::new(TableService::new(layout, node_id));
        let dir = tempfile::tempdir().unwrap();
        let (server, endpoint) = match via {
            Via::Local => {
                service.attach(Arc::new(LocalConnection::new(Arc::clone(&region), None)), 0);
                (None, None)
            }
            Via::Transport(kind) => {
                let listen = match kind {
                    TransportKind::Shm => Endpoint::Shm(dir.path().join("memnode.sock")),
                    TransportKind::Tcp => Endpoint::Tcp("127.0.0.1:0".into()),
                    TransportKind::Verbs => Endpoint::Verbs("127.0.0.1:0".into()),
                };
                let options = ServerOptions { token: TOKEN.into(), ..ServerOptions::default() };
                let server =
                    RegionServer::start(Arc::clone(&region), Some(file), service.clone(), options, &[listen]).unwrap();
                let endpoint = server.endpoints()[0].clone();
                service.attach(connect(&endpoint), server.instance());
                (Some(server), Some(endpoint))
            }
        };
        Self { region, layout, service, server, endpoint, _dir: dir }
    }

    /// Where the memnode listens (None for [`Via::Local`]).
    pub fn endpoint(&self) -> Option<&Endpoint> {
        self.endpoint.as_ref()
    }

    /// The token clients must present.
    pub const TOKEN: &'static str = TOKEN;

    /// A new client connection.
    pub fn connect(&self) -> Arc<dyn Connection> {
        match &self.endpoint {
            Some(endpoint) => connect(endpoint),
            None => Arc::new(LocalConnection::new(Arc::clone(&self.region), Some(self.service.clone()))),
        }
    }

    /// Opens the table with `options`.
    pub fn table(&self, options: TableOptions) -> Table {
        Table::open(self.connect(), options).unwrap()
    }

    /// The table's statistics.
    pub fn stats(&self) -> TableStats {
        self.service.stats().unwrap()
    }

    /// The region's layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Publishes the shortest grace period clients may wait, as the memnode daemon does
    /// before it serves (clients that open the table afterwards see it).
    pub fn publish_grace_period(&self, grace: Duration) {
        crate::format::publish_grace_period(&LocalConnection::new(Arc::clone(&self.region), None), grace).unwrap();
    }

    /// The memnode's active expiry, as a memnode daemon runs it (over the service's
    /// loopback connection).
    pub fn active_expiry(&self, options: crate::expiry::ExpiryOptions) -> crate::expiry::ActiveExpiry {
        self.service.active_expiry(options).expect("the service is attached")
    }

    /// Free heap bytes the memnode holds in runs shorter than a chunk.
    pub fn heap_fragment_bytes(&self) -> u64 {
        self.service.heap_fragment_bytes()
    }

    /// The memnode's value extents (live and retired bytes; releases the due ones).
    pub fn extents(&self) -> Arc<crate::extents::Extents> {
        self.service.extents().expect("the service is attached")
    }

    /// Heap bytes allocated for KV data: everything handed out except subtables (which
    /// splits add and nobody gives back).
    pub fn kv_heap_used_bytes(&self) -> u64 {
        let heap = self.stats().heap;
        heap.heap_used_bytes - heap.subtables * self.layout.subtable_bytes()
    }

    /// A splitter working directly on the region (for crash tests: the "restarted memnode").
    pub fn local_splitter(&self) -> Splitter {
        let conn: Arc<dyn Connection> = Arc::new(LocalConnection::new(Arc::clone(&self.region), None));
        Splitter::new(Arc::clone(&conn), self.layout, Arc::new(Heap::new(conn, self.layout)))
    }

    /// What a memnode start does to the heap ([`crate::reclaim`]), on this running one:
    /// call it only while no client holds heap space (tests leak theirs with `mem::forget`).
    pub fn reclaim_as_if_restarted(&self) -> crate::reclaim::Reclaimed {
        let conn = LocalConnection::new(Arc::clone(&self.region), None);
        let reclaimed = crate::reclaim::reclaim(&conn, &self.layout).unwrap();
        self.service.seed_fragments(&reclaimed.fragments).unwrap();
        self.service.seed_extents(&reclaimed.extents).unwrap();
        reclaimed
    }

    /// Stops serving (clients see their connections fail).
    pub fn stop(&mut self) {
        self.server.take();
    }
}

fn connect(endpoint: &Endpoint) -> Arc<dyn Connection> {
    racekv_transport::connect(endpoint, &ConnectOptions::new(TOKEN, Duration::from_secs(10))).unwrap()
}

/// One key found by [`scan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedItem {
    /// The key's bytes.
    pub key: Vec<u8>,
    /// The value's bytes.
    pub value: Vec<u8>,
    /// The expiry in its block (expired items included: this reads the region as it is).
    pub expires_at_ms: Option<u64>,
    /// Region offset of the slot that points to it.
    pub slot: u64,
    /// Whether its bucket's header admits the key (false: a misplaced entry).
    pub admitted: bool,
}

/// Reads every used slot of every subtable the directory reaches (for whole-table checks:
/// duplicates, lost or resurrected keys). Not for use while writers run.
pub fn scan(conn: &dyn Connection, layout: &Layout) -> Vec<ScannedItem> {
    use crate::hash::KeyHash;
    use crate::layout::{decode_block, parse_bucket, sb, slot_offset, DirEntry, Slot, BUCKET_BYTES};
    use crate::words::{read_bytes, read_word};
    use racekv_transport::Batch;

    let mut b = Batch::new();
    let gd = b.read(sb::GLOBAL_DEPTH, 8);
    conn.execute(&mut b).unwrap();
    let gd = read_word(b.read_result(gd).unwrap()) as u32;
    b.clear();
    let dir = b.read(layout.dir_entry_offset(0), 8 << gd);
    conn.execute(&mut b).unwrap();
    let mut subtables: Vec<u64> =
        b.read_result(dir).unwrap().chunks_exact(8).map(|w| DirEntry::decode(read_word(w)).subtable).collect();
    subtables.sort_unstable();
    subtables.dedup();
    let mut items = Vec::new();
    for subtable in subtables {
        b.clear();
        let r = b.read(subtable, layout.subtable_bytes() as u32);
        conn.execute(&mut b).unwrap();
        let image = b.read_result(r).unwrap().to_vec();
        for (i, bucket) in image.chunks_exact(BUCKET_BYTES as usize).enumerate() {
            let (header, slots) = parse_bucket(bucket);
            for (j, &word) in slots.iter().enumerate() {
                let Some(slot) = Slot::decode(word) else {
                    continue;
                };
                b.clear();
                let r = b.read(slot.block, slot.block_bytes() as u32);
                conn.execute(&mut b).unwrap();
                let block = decode_block(b.read_result(r).unwrap()).expect("every slot points to a valid block");
                let dir = KeyHash::from_digest(block.key_digest(), layout.groups_per_subtable).dir;
                let (mut key, expires_at_ms, extent, long_key) =
                    (block.key.to_vec(), block.expires_at_ms, block.extent, block.long_key);
                let mut value = block.value.to_vec();
                if let Some(extent) = extent {
                    read_bytes(conn, &mut b, extent.offset, extent.value_len, &mut value).unwrap();
                }
                if let Some(long_key) = long_key {
                    key.clear();
                    read_bytes(conn, &mut b, long_key.extent.offset, long_key.extent.value_len, &mut key).unwrap();
                }
                items.push(ScannedItem {
                    key,
                    value,
                    expires_at_ms,
                    slot: slot_offset(subtable + i as u64 * BUCKET_BYTES, j),
                    admitted: header.admits(dir),
                });
            }
        }
    }
    items
}

pub mod model;

/// A fault [`FaultyConnection`] injects into one `execute` or `call`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails before forwarding: `ConnectionLost { maybe_executed: false }`, nothing ran.
    LostBefore,
    /// Forwards, then reports `ConnectionLost { maybe_executed: true }`: the request ran
    /// (or failed on its own), but the client cannot know.
    LostAfter,
    /// Fails before forwarding as if the memnode had restarted since the batch's space was
    /// handed out: `InstanceChanged` (a batch only; a call goes through).
    Restarted,
}

#[derive(Default)]
struct FaultState {
    /// Explicit faults, first come: (calls to let through first, fault).
    schedule: std::collections::VecDeque<(u32, Fault)>,
    /// Random faults after the schedule is used up: xorshift state and the chance per call
    /// in thousandths (0: none).
    rng: u64,
    per_mille: u32,
    calls: u64,
    injected: u64,
}

impl FaultState {
    fn next(&mut self) -> Option<Fault> {
        self.calls += 1;
        let fault = if let Some((skip, fault)) = self.schedule.front_mut() {
            if *skip > 0 {
                *skip -= 1;
                None
            } else {
                let fault = *fault;
                self.schedule.pop_front();
                Some(fault)
            }
        } else if self.per_mille > 0 {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let roll = (self.rng % 2000) as u32;
            (roll < 2 * self.per_mille).then_some(if roll.is_multiple_of(2) {
                Fault::LostBefore
            } else {
                Fault::LostAfter
            })
        } else {
            None
        };
        self.injected += u64::from(fault.is_some());
        fault
    }
}

/// A [`Connection`] that loses some `execute`s and `call`s, as a connection that breaks
/// would, on a schedule the test controls: explicit faults ([`Self::schedule`]), then
/// seeded random ones ([`Self::random`]). A lost request either did not run
/// ([`Fault::LostBefore`]) or ran and its answer was lost ([`Fault::LostAfter`]); either way
/// the connection stays usable, so a client's next operation goes through. Everything
/// else delegates to the wrapped connection.
pub struct FaultyConnection {
    inner: Arc<dyn Connection>,
    state: parking_lot::Mutex<FaultState>,
}

impl FaultyConnection {
    /// No faults until some are scheduled.
    pub fn new(inner: Arc<dyn Connection>) -> Self {
        Self { inner, state: parking_lot::Mutex::new(FaultState::default()) }
    }

    /// After the faults scheduled, each request fails with a chance of `per_mille`/1000,
    /// half of them before and half after forwarding, drawn from `seed` (0: no random faults).
    pub fn random(&self, seed: u64, per_mille: u32) {
        let mut state = self.state.lock();
        state.rng = seed | 1;
        state.per_mille = per_mille.min(1000);
    }

    /// Lets `skip` more requests through (after the faults already scheduled), then fails
    /// the next with `fault`.
    pub fn schedule(&self, skip: u32, fault: Fault) {
        self.state.lock().schedule.push_back((skip, fault));
    }

    /// Drops the faults scheduled and not yet injected, and stops random ones.
    pub fn clear(&self) {
        let mut state = self.state.lock();
        state.schedule.clear();
        state.per_mille = 0;
    }

    /// Requests (`execute`s and `call`s) seen so far.
    pub fn requests(&self) -> u64 {
        self.state.lock().calls
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.state.lock().injected
    }

    fn lost(maybe_executed: bool) -> racekv_transport::TransportError {
        racekv_transport::TransportError::ConnectionLost {
            reason: "injected by FaultyConnection".into(),
            maybe_executed,
        }
    }
}

impl Connection for FaultyConnection {
    fn execute(&self, batch: &mut racekv_transport::Batch) -> Result<(), racekv_transport::TransportError> {
        let fault = self.state.lock().next();
        match fault {
            None => self.inner.execute(batch),
            Some(Fault::LostBefore) => Err(Self::lost(false)),
            Some(Fault::LostAfter) => self.inner.execute(batch).and(Err(Self::lost(true))),
            Some(Fault::Restarted) => {
                let expected = self.inner.instance();
                Err(racekv_transport::TransportError::InstanceChanged { expected, found: expected.wrapping_add(1) })
            }
        }
    }

    fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, racekv_transport::TransportError> {
        let fault = self.state.lock().next();
        match fault {
            None => self.inner.call(method, request),
            Some(Fault::LostBefore) => Err(Self::lost(false)),
            Some(Fault::LostAfter) => self.inner.call(method, request).and(Err(Self::lost(true))),
            Some(Fault::Restarted) => self.inner.call(method, request),
        }
    }

    fn region_len(&self) -> u64 {
        self.inner.region_len()
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn instance(&self) -> u64 {
        self.inner.instance()
    }

    fn is_healthy(&self) -> bool {
        self.inner.is_healthy()
    }

    fn execute_unchecked(&self, batch: &mut racekv_transport::Batch) -> Result<(), racekv_transport::TransportError> {
        self.inner.execute_unchecked(batch)
    }
}
