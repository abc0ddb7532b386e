//! Metrics every racekv process exports, whatever it runs: the standard `process_*` set
//! and the build it is.

/// Registers, once per process, the standard `process_*` metrics (CPU seconds, resident
/// and virtual memory, open file descriptors, start time) and `racekv_build_info{version}`
/// (always 1: joins a version to every series of the instance).
pub fn register_process_metrics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The default registry carries the process collector itself (the `process` feature).
        let info =
            crate::metric::gauge_vec("racekv_build_info", "The racekv build this process runs (value 1)", &["version"]);
        info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    });
}
