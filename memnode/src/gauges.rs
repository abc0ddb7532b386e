//! The memnode's gauges, one series per memnode (label `memnode`, its node id): `racekv up`
//! runs several memnodes in one process, and a shared gauge would show whichever wrote last.

use std::sync::LazyLock;

use prometheus::{Gauge, GaugeVec, IntGauge, IntGaugeVec};

/// The label every memnode series carries.
pub(crate) const MEMNODE_LABEL: &str = "memnode";

/// One family per gauge, registered once per process.
struct Families {
    region_bytes: IntGaugeVec,
    heap_used_bytes: IntGaugeVec,
    heap_free_bytes: IntGaugeVec,
    heap_fragment_bytes: IntGaugeVec,
    items: IntGaugeVec,
    slots: IntGaugeVec,
    load_factor: GaugeVec,
    global_depth: IntGaugeVec,
    subtables: IntGaugeVec,
    chunks: IntGaugeVec,
    connections: IntGaugeVec,
    last_sync_seconds: GaugeVec,
    reclaim_seconds: GaugeVec,
    reclaimed_bytes: IntGaugeVec,
    map_epoch: IntGaugeVec,
    fenced: IntGaugeVec,
}

static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    use racekv_telemetry::metric::{float_gauge_vec, gauge_vec};
    let l = &[MEMNODE_LABEL];
    Families {
        region_bytes: gauge_vec("racekv_memnode_region_bytes", "Size of the region", l),
        heap_used_bytes: gauge_vec("racekv_memnode_heap_used_bytes", "Heap bytes allocated (subtables and KV chunks)", l),
        heap_free_bytes: gauge_vec(
            "racekv_memnode_heap_free_bytes",
            "Heap bytes clients gave back, waiting to be handed out again",
            l,
        ),
        heap_fragment_bytes: gauge_vec(
            "racekv_memnode_heap_fragment_bytes",
            "Of the free heap bytes, those in runs shorter than a chunk: reusable once the space beside them is freed",
            l,
        ),
        items: gauge_vec("racekv_memnode_items", "Keys stored", l),
        slots: gauge_vec("racekv_memnode_slots", "Slots in all subtables", l),
        load_factor: float_gauge_vec("racekv_memnode_load_factor_ratio", "Keys per slot", l),
        global_depth: gauge_vec("racekv_memnode_global_depth", "Directory global depth", l),
        subtables: gauge_vec("racekv_memnode_subtables", "Subtables allocated", l),
        chunks: gauge_vec("racekv_memnode_chunks", "KV chunks handed to clients", l),
        connections: gauge_vec("racekv_memnode_connections", "Open client connections", l),
        last_sync_seconds: float_gauge_vec(
            "racekv_memnode_last_sync_duration_seconds",
            "Duration of the last msync of the data file",
            l,
        ),
        reclaim_seconds: float_gauge_vec(
            "racekv_memnode_start_reclaim_duration_seconds",
            "How long this start took to find the heap space nothing references",
            l,
        ),
        reclaimed_bytes: gauge_vec(
            "racekv_memnode_start_reclaimed_bytes",
            "Heap bytes this start found free (free list, fragments and a lowered heap top), leaks of crashed processes included",
            l,
        ),
        map_epoch: gauge_vec(
            "racekv_memnode_map_epoch",
            "The cluster map epoch the memnode serves by (0: no etcd); clients routed by an older map route again",
            l,
        ),
        fenced: gauge_vec(
            "racekv_memnode_fenced",
            "1 while the memnode fences itself (its etcd lease may have lapsed): clients wait for a newer map",
            l,
        ),
    }
});

/// One memnode's series; dropping it removes them (a stopped memnode leaves no stale value).
pub(crate) struct Gauges {
    label: String,
    pub(crate) region_bytes: IntGauge,
    pub(crate) heap_used_bytes: IntGauge,
    pub(crate) heap_free_bytes: IntGauge,
    pub(crate) heap_fragment_bytes: IntGauge,
    pub(crate) items: IntGauge,
    pub(crate) slots: IntGauge,
    pub(crate) load_factor: Gauge,
    pub(crate) global_depth: IntGauge,
    pub(crate) subtables: IntGauge,
    pub(crate) chunks: IntGauge,
    pub(crate) connections: IntGauge,
    pub(crate) last_sync_seconds: Gauge,
    pub(crate) reclaim_seconds: Gauge,
    pub(crate) reclaimed_bytes: IntGauge,
    pub(crate) map_epoch: IntGauge,
    pub(crate) fenced: IntGauge,
}

impl Gauges {
    /// The series of the memnode `node_id` (created at 0).
    pub(crate) fn of(node_id: u64) -> Self {
        assert!(node_id != 0, "node ids are non-zero");
        let f = &*FAMILIES;
        let label = node_id.to_string();
        let v = &[label.as_str()];
        Self {
            region_bytes: f.region_bytes.with_label_values(v),
            heap_used_bytes: f.heap_used_bytes.with_label_values(v),
            heap_free_bytes: f.heap_free_bytes.with_label_values(v),
            heap_fragment_bytes: f.heap_fragment_bytes.with_label_values(v),
            items: f.items.with_label_values(v),
            slots: f.slots.with_label_values(v),
            load_factor: f.load_factor.with_label_values(v),
            global_depth: f.global_depth.with_label_values(v),
            subtables: f.subtables.with_label_values(v),
            chunks: f.chunks.with_label_values(v),
            connections: f.connections.with_label_values(v),
            last_sync_seconds: f.last_sync_seconds.with_label_values(v),
            reclaim_seconds: f.reclaim_seconds.with_label_values(v),
            reclaimed_bytes: f.reclaimed_bytes.with_label_values(v),
            map_epoch: f.map_epoch.with_label_values(v),
            fenced: f.fenced.with_label_values(v),
            label,
        }
    }
}

impl Drop for Gauges {
    fn drop(&mut self) {
        let f = &*FAMILIES;
        let v = &[self.label.as_str()];
        // Err only when already removed (another memnode with the same id stopped).
        let _ = f.region_bytes.remove_label_values(v);
        let _ = f.heap_used_bytes.remove_label_values(v);
        let _ = f.heap_free_bytes.remove_label_values(v);
        let _ = f.heap_fragment_bytes.remove_label_values(v);
        let _ = f.items.remove_label_values(v);
        let _ = f.slots.remove_label_values(v);
        let _ = f.load_factor.remove_label_values(v);
        let _ = f.global_depth.remove_label_values(v);
        let _ = f.subtables.remove_label_values(v);
        let _ = f.chunks.remove_label_values(v);
        let _ = f.connections.remove_label_values(v);
        let _ = f.last_sync_seconds.remove_label_values(v);
        let _ = f.reclaim_seconds.remove_label_values(v);
        let _ = f.reclaimed_bytes.remove_label_values(v);
        let _ = f.map_epoch.remove_label_values(v);
        let _ = f.fenced.remove_label_values(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str) -> Vec<String> {
        racekv_telemetry::render().lines().filter(|l| l.starts_with(name)).map(str::to_string).collect()
    }

    #[test]
    fn each_memnode_has_its_own_series_until_it_stops() {
        let a = Gauges::of(11);
        let b = Gauges::of(22);
        a.items.set(5);
        b.items.set(7);
        let items = series("racekv_memnode_items{");
        assert!(items.contains(&r#"racekv_memnode_items{memnode="11"} 5"#.to_string()), "{items:?}");
        assert!(items.contains(&r#"racekv_memnode_items{memnode="22"} 7"#.to_string()), "{items:?}");
        drop(a);
        let items = series("racekv_memnode_items{");
        assert!(!items.iter().any(|l| l.contains(r#"memnode="11""#)), "{items:?}");
        assert!(items.contains(&r#"racekv_memnode_items{memnode="22"} 7"#.to_string()), "{items:?}");
    }
}
