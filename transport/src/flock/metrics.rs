//! FLOCK's Prometheus series (`racekv_flock_*`, base units, microsecond latency buckets).

use std::sync::LazyLock;

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};

pub(crate) struct Metrics {
    /// Requests per message, as senders coalesce them.
    pub degree: Histogram,
    /// Messages and requests, by direction (`sent` by senders, `received` by receivers).
    pub messages: IntCounterVec,
    pub requests: IntCounterVec,
    pub credits_granted: IntCounter,
    /// Renewals the scheduler refused (credits withheld: overload, or over the active cap).
    pub renewals_refused: IntCounter,
    /// Calls that gave up waiting for credits (never sent).
    pub overloaded: IntCounter,
    /// Renewals senders sent for lanes the receiver had refused (see `Sender::probe_refused`).
    pub probes: IntCounter,
    /// Lanes the receivers' schedulers count as active.
    pub active: IntGauge,
    /// Lanes open at the receivers.
    pub lanes: IntGauge,
    /// Bytes of a receiver's request ring still unread when it takes a message.
    pub ring_occupancy: Histogram,
    /// Sender-side call latency.
    pub call_seconds: Histogram,
    /// Lanes closed for a bad message or I/O error, by reason.
    pub lane_errors: IntCounterVec,
}

pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    use racekv_telemetry::{metric, COUNT_BUCKETS, SIZE_BUCKETS_BYTES};
    const DIRECTIONS: &[&str] = &["sent", "received"];
    Metrics {
        degree: metric::histogram(
            "racekv_flock_coalescing_degree",
            "Requests coalesced into one FLOCK message",
            COUNT_BUCKETS,
        ),
        messages: metric::counter_vec("racekv_flock_messages_total", "FLOCK messages", &["direction"], &[DIRECTIONS]),
        requests: metric::counter_vec(
            "racekv_flock_requests_total",
            "RPC requests carried in FLOCK messages",
            &["direction"],
            &[DIRECTIONS],
        ),
        credits_granted: metric::counter(
            "racekv_flock_credits_granted_total",
            "Credits granted by receivers' schedulers",
        ),
        renewals_refused: metric::counter(
            "racekv_flock_credit_refusals_total",
            "Credit renewals refused by receivers' schedulers",
        ),
        overloaded: metric::counter(
            "racekv_flock_overloaded_calls_total",
            "Calls that gave up waiting for credits (the request was never sent)",
        ),
        probes: metric::counter(
            "racekv_flock_refused_lane_probes_total",
            "Credit renewals senders sent again for lanes the receiver had refused",
        ),
        active: metric::gauge("racekv_flock_active_connections", "FLOCK lanes the scheduler holds active"),
        lanes: metric::gauge("racekv_flock_connections", "FLOCK lanes open at this receiver"),
        ring_occupancy: metric::histogram(
            "racekv_flock_ring_occupancy_bytes",
            "Unread bytes in a receiver's request ring when it takes a message",
            SIZE_BUCKETS_BYTES,
        ),
        call_seconds: metric::latency_histogram(
            "racekv_flock_call_seconds",
            "One RPC through FLOCK, as the caller sees it",
        ),
        lane_errors: metric::counter_vec(
            "racekv_flock_lane_errors_total",
            "FLOCK lanes closed for an error",
            &["reason"],
            &[],
        ),
    }
});
