//! The memnode's value extents: heap space for values too large for a block.
//!
//! A client writing a large value asks for an extent by RPC, writes the value there, then
//! publishes an indirect block that points to it (`layout.rs`). Whoever swings that block's
//! slot word away (an overwrite, a delete, lazy or active expiry, FLUSHALL) retires the
//! extent by RPC, or in-process for the memnode's own sweep. A retired extent waits out the
//! grace period here, as a retired block waits in its client's queue (a reader that found
//! the block may still be reading the value), then goes back to the heap.
//!
//! The memnode keeps the extents it handed out in memory and accepts a retire only for
//! exactly one of them, so a client's mistake cannot free a range twice or free a range
//! that is not an extent. After a restart the start's reclaim finds the live ones again
//! (the indirect blocks their slots point to) and [`Extents::seed`] takes them in.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use crate::error::Error;
use crate::heap::Heap;
use crate::layout::{extent_bytes, MAX_VALUE_BYTES};

/// Retired extents waiting out the grace period, at most; past it a retire is refused
/// (the client logs it; the extent is reclaimed at the next start), so a flood of retires
/// cannot grow the memnode's memory.
pub const MAX_PENDING_EXTENTS: usize = 1 << 20;

/// The extent metrics' families; each memnode has its own series (label `memnode`, its
/// node id), since `racekv up` runs several in one process.
struct Families {
    live_bytes: IntGaugeVec,
    live: IntGaugeVec,
    pending_bytes: IntGaugeVec,
    allocated: IntCounterVec,
    retired: IntCounterVec,
    refused: IntCounterVec,
}

static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    use racekv_telemetry::metric;
    let l = &["memnode"];
    Families {
        live_bytes: metric::gauge_vec("racekv_memnode_extent_bytes", "Heap bytes in live value extents", l),
        live: metric::gauge_vec("racekv_memnode_extents", "Live value extents", l),
        pending_bytes: metric::gauge_vec(
            "racekv_memnode_extent_pending_bytes",
            "Bytes of retired extents waiting out the grace period",
            l,
        ),
        allocated: metric::counter_vec("racekv_memnode_extents_allocated_total", "Value extents handed out", l, &[]),
        retired: metric::counter_vec("racekv_memnode_extents_retired_total", "Value extents retired", l, &[]),
        refused: metric::counter_vec(
            "racekv_memnode_extent_retires_refused_total",
            "Extent retires refused (not a live extent, or too many pending)",
            l,
            &[],
        ),
    }
});

/// One memnode's extent series; dropping it removes them.
struct Metrics {
    label: String,
    live_bytes: IntGauge,
    live: IntGauge,
    pending_bytes: IntGauge,
    allocated: IntCounter,
    retired: IntCounter,
    refused: IntCounter,
}

impl Metrics {
    fn of(node_id: u64) -> Self {
        let f = &*FAMILIES;
        let label = node_id.to_string();
        let v = &[label.as_str()];
        Self {
            live_bytes: f.live_bytes.with_label_values(v),
            live: f.live.with_label_values(v),
            pending_bytes: f.pending_bytes.with_label_values(v),
            allocated: f.allocated.with_label_values(v),
            retired: f.retired.with_label_values(v),
            refused: f.refused.with_label_values(v),
            label,
        }
    }
}

impl Drop for Metrics {
    fn drop(&mut self) {
        let f = &*FAMILIES;
        let v = &[self.label.as_str()];
        // Err only when already removed (two services of one node id in a process).
        let _ = f.live_bytes.remove_label_values(v);
        let _ = f.live.remove_label_values(v);
        let _ = f.pending_bytes.remove_label_values(v);
        let _ = f.allocated.remove_label_values(v);
        let _ = f.retired.remove_label_values(v);
        let _ = f.refused.remove_label_values(v);
    }
}

/// Registers the extent metrics' families (each memnode's series appear, at zero, when its
/// [`Extents`] is made).
pub fn register_metrics() {
    LazyLock::force(&FAMILIES);
}

#[derive(Default)]
struct State {
    /// offset -> bytes of every extent handed out and not retired.
    live: BTreeMap<u64, u64>,
    live_bytes: u64,
    /// (retired at, offset, bytes), oldest first.
    pending: VecDeque<(Instant, u64, u64)>,
    pending_bytes: u64,
}

/// See the module doc.
pub struct Extents {
    heap: Arc<Heap>,
    grace: Duration,
    state: Mutex<State>,
    metrics: Metrics,
}

impl Extents {
    /// Value extents on `heap` of the memnode `node_id`, freed `grace` after they are retired.
    pub fn new(heap: Arc<Heap>, grace: Duration, node_id: u64) -> Self {
        Self { heap, grace, state: Mutex::new(State::default()), metrics: Metrics::of(node_id) }
    }

    /// An extent for a value of `value_len` bytes: its offset.
    pub fn alloc(&self, value_len: u64) -> Result<u64, Error> {
        if value_len > MAX_VALUE_BYTES {
            return Err(Error::Remote(format!("a value of {value_len} B exceeds the limit of {MAX_VALUE_BYTES} B")));
        }
        let bytes = extent_bytes(value_len);
        let mut state = self.state.lock();
        self.release_due(&mut state, Instant::now())?;
        let offset = self.heap.alloc_extent(bytes)?;
        let clash = state.live.range(..offset + bytes).next_back().is_some_and(|(&o, &b)| o + b > offset);
        assert!(!clash, "the heap handed out [{offset}, +{bytes}) over a live extent");
        state.live.insert(offset, bytes);
        state.live_bytes += bytes;
        self.metrics.allocated.inc();
        self.publish(&state);
        Ok(offset)
    }

    /// Retires the live extent at `offset` of `value_len` bytes: freed after the grace period.
    pub fn retire(&self, offset: u64, value_len: u64) -> Result<(), Error> {
        let bytes = extent_bytes(value_len);
        let mut state = self.state.lock();
        let now = Instant::now();
        self.release_due(&mut state, now)?;
        if state.live.get(&offset) != Some(&bytes) || state.pending.len() >= MAX_PENDING_EXTENTS {
            self.metrics.refused.inc();
            return Err(Error::Remote(format!("({offset}, {bytes} B) is not a live extent of this memnode")));
        }
        state.live.remove(&offset);
        state.live_bytes -= bytes;
        state.pending.push_back((now, offset, bytes));
        state.pending_bytes += bytes;
        self.metrics.retired.inc();
        self.publish(&state);
        Ok(())
    }

    /// Gives back the retired extents whose grace period is over (the memnode also calls it
    /// from its background loop, so nothing waits for the next extent RPC).
    pub fn release(&self) -> Result<(), Error> {
        let mut state = self.state.lock();
        self.release_due(&mut state, Instant::now())
    }

    fn release_due(&self, state: &mut State, now: Instant) -> Result<(), Error> {
        let mut due = Vec::new();
        while let Some(&(at, offset, bytes)) = state.pending.front() {
            if now < at + self.grace || due.len() == crate::rpc::MAX_RANGES_PER_CALL {
                break;
            }
            state.pending.pop_front();
            state.pending_bytes -= bytes;
            // Released only after its grace, and never while live again.
            assert!(now >= at + self.grace, "extent at {offset:#x} released inside its grace period");
            debug_assert!(!state.live.contains_key(&offset), "extent at {offset:#x} released while live");
            due.push((offset, bytes));
        }
        if !due.is_empty() {
            self.heap.return_ranges(&due)?;
            self.publish(state);
        }
        Ok(())
    }

    /// Takes in the live extents a start's reclaim found (offset, bytes).
    pub fn seed(&self, live: &[(u64, u64)]) {
        let mut state = self.state.lock();
        for &(offset, bytes) in live {
            // Found twice (two slots naming one block): counted once, with its last size.
            let before = state.live.insert(offset, bytes).unwrap_or(0);
            state.live_bytes = state.live_bytes - before + bytes;
        }
        self.publish(&state);
    }

    /// Bytes in live extents.
    pub fn live_bytes(&self) -> u64 {
        self.state.lock().live_bytes
    }

    /// Bytes of retired extents still in their grace period.
    pub fn pending_bytes(&self) -> u64 {
        self.state.lock().pending_bytes
    }

    fn publish(&self, state: &State) {
        state.check();
        self.metrics.live_bytes.set(state.live_bytes as i64);
        self.metrics.live.set(state.live.len() as i64);
        self.metrics.pending_bytes.set(state.pending_bytes as i64);
    }
}

impl State {
    /// The byte counts are what the live map and the grace queue hold (a walk over both:
    /// debug builds only; the empty-means-zero half is O(1)).
    fn check(&self) {
        assert!(
            self.live.is_empty() == (self.live_bytes == 0) && self.pending.is_empty() == (self.pending_bytes == 0),
            "extent counts out of step: {} live ({} B), {} pending ({} B)",
            self.live.len(),
            self.live_bytes,
            self.pending.len(),
            self.pending_bytes
        );
        debug_assert_eq!(self.live_bytes, self.live.values().sum::<u64>(), "live extent bytes");
        debug_assert_eq!(self.pending_bytes, self.pending.iter().map(|p| p.2).sum::<u64>(), "pending extent bytes");
    }
}
