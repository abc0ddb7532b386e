//! Sender-side mapping of threads to active lanes by median request size.
//!
//! Each thread gets a slot in its sender (its thread id on the wire) and keeps the sizes of
//! its last [`HISTORY`] requests; their median is published in the slot. Every so often one
//! thread re-sorts the live slots by median and cuts the sorted list into as many contiguous
//! groups as there are active lanes, smallest medians on the first active lane: threads
//! that send large requests share lanes with each other, so a 1 MiB request never sits in
//! the same message (or ring) ahead of a 64-byte one. With equal sizes the groups are equal
//! in number of threads, which spreads load evenly.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// Slots per sender (thread ids 0..MAX_SLOTS); further threads share slots.
pub const MAX_SLOTS: usize = 1024;
/// Request sizes each thread remembers.
const HISTORY: usize = 16;
/// Calls (over all threads) between re-mappings.
const REMAP_EVERY: u64 = 512;
const FREE: u32 = u32::MAX;

pub(crate) struct Mapping {
    /// Median request size per slot; `FREE` when nobody holds it.
    medians: Vec<AtomicU32>,
    /// Lane index per slot.
    lanes: Vec<AtomicU16>,
    free: Mutex<Vec<u16>>,
    calls: AtomicU64,
    /// Bit i set: lane i is active (as of the last re-mapping input).
    active: AtomicU64,
    remap: Mutex<Vec<(u32, u16)>>,
    id: u64,
}

struct Held {
    mapping: Weak<Mapping>,
    id: u64,
    slot: u16,
    sizes: [u32; HISTORY],
    filled: usize,
    next: usize,
}

/// Returns slots to their senders when the thread exits.
struct Registry(Vec<Held>);

impl Drop for Registry {
    fn drop(&mut self) {
        for held in self.0.drain(..) {
            if let Some(mapping) = held.mapping.upgrade() {
                mapping.release(held.slot);
            }
        }
    }
}

thread_local! {
    static HELD: RefCell<Registry> = const { RefCell::new(Registry(Vec::new())) };
}

impl Mapping {
    pub fn new(id: u64, lanes: usize) -> Arc<Self> {
        assert!((1..=64).contains(&lanes));
        Arc::new(Self {
            medians: (0..MAX_SLOTS).map(|_| AtomicU32::new(FREE)).collect(),
            lanes: (0..MAX_SLOTS).map(|s| AtomicU16::new((s % lanes) as u16)).collect(),
            free: Mutex::new((0..MAX_SLOTS as u16).rev().collect()),
            calls: AtomicU64::new(0),
            active: AtomicU64::new(if lanes == 64 { u64::MAX } else { (1u64 << lanes) - 1 }),
            remap: Mutex::new(Vec::with_capacity(MAX_SLOTS)),
            id,
        })
    }

    fn release(&self, slot: u16) {
        self.medians[slot as usize].store(FREE, Ordering::Relaxed);
        self.free.lock().push(slot);
    }

    /// Records a request of `size` bytes by the calling thread; returns its slot and lane.
    pub fn on_call(self: &Arc<Self>, size: usize) -> (u16, usize) {
        let size = size.min(u32::MAX as usize - 1) as u32;
        let slot = HELD.with(|held| {
            let mut held = held.borrow_mut();
            let index = match held.0.iter().position(|h| h.id == self.id) {
                Some(i) => i,
                None => {
                    held.0.retain(|h| h.mapping.strong_count() > 0);
                    let slot = self.free.lock().pop().unwrap_or((self.id % MAX_SLOTS as u64) as u16);
                    held.0.push(Held {
                        mapping: Arc::downgrade(self),
                        id: self.id,
                        slot,
                        sizes: [0; HISTORY],
                        filled: 0,
                        next: 0,
                    });
                    held.0.len() - 1
                }
            };
            let h = &mut held.0[index];
            h.sizes[h.next] = size;
            h.next = (h.next + 1) % HISTORY;
            h.filled = (h.filled + 1).min(HISTORY);
            let mut sorted = [0u32; HISTORY];
            sorted[..h.filled].copy_from_slice(&h.sizes[..h.filled]);
            sorted[..h.filled].sort_unstable();
            self.medians[h.slot as usize].store(sorted[h.filled / 2], Ordering::Relaxed);
            h.slot
        });
        if self.calls.fetch_add(1, Ordering::Relaxed).is_multiple_of(REMAP_EVERY) {
            self.remap();
        }
        (slot, self.lanes[slot as usize].load(Ordering::Relaxed) as usize)
    }

    /// Tells the mapping which lanes are active now; re-maps at once when that changed.
    pub fn set_active(&self, active: u64) {
        if self.active.swap(active, Ordering::AcqRel) != active {
            self.remap();
        }
    }

    /// Re-sorts live slots by median and assigns contiguous groups to the active lanes.
    pub fn remap(&self) {
        let Some(mut order) = self.remap.try_lock() else {
            return; // someone else is at it
        };
        let active = self.active.load(Ordering::Acquire);
        let lanes: Vec<u16> = (0..64u16).filter(|i| active & (1 << i) != 0).collect();
        if lanes.is_empty() {
            return;
        }
        order.clear();
        for (slot, median) in self.medians.iter().enumerate() {
            let m = median.load(Ordering::Relaxed);
            if m != FREE {
                order.push((m, slot as u16));
            }
        }
        order.sort_unstable();
        let n = order.len().max(1);
        for (rank, &(_, slot)) in order.iter().enumerate() {
            let lane = lanes[rank * lanes.len() / n];
            self.lanes[slot as usize].store(lane, Ordering::Relaxed);
        }
    }

    /// The lane currently assigned to `slot`.
    #[cfg(test)]
    pub fn lane_of(&self, slot: u16) -> usize {
        self.lanes[slot as usize].load(Ordering::Relaxed) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_and_small_requests_get_different_lanes() {
        let mapping = Mapping::new(7, 2);
        let barrier = std::sync::Barrier::new(8);
        let lanes: Vec<(usize, usize)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|t| {
                    let (mapping, barrier) = (&mapping, &barrier);
                    s.spawn(move || {
                        let size = if t % 2 == 0 { 64 } else { 1 << 20 };
                        let mut slot = 0;
                        for _ in 0..HISTORY {
                            slot = mapping.on_call(size).0;
                        }
                        barrier.wait();
                        if t == 0 {
                            mapping.remap();
                        }
                        barrier.wait();
                        (size, mapping.lane_of(slot))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (size, lane) in lanes {
            assert_eq!(lane, usize::from(size > 64), "size {size} on lane {lane}");
        }
        // Only lane 1 active: everyone (here, this thread) moves there.
        let (slot, _) = mapping.on_call(64);
        mapping.set_active(0b10);
        assert_eq!(mapping.lane_of(slot), 1);
        assert_eq!(mapping.on_call(64).1, 1);
    }
}
