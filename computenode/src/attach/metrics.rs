//! Prometheus metrics of the attach front end, registered once on the default registry.
//! Label values are fixed strings.

use std::sync::LazyLock;

use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge};
use racekv_telemetry::metric::{counter, counter_vec, gauge, latency_histogram};

pub(crate) struct Metrics {
    pub clients: IntGauge,
    pub attaches: IntCounter,
    pub refused: IntCounterVec,
    pub detaches: IntCounterVec,
    pub requests: IntCounterVec,
    pub in_flight: IntGauge,
    pub ring_wait_seconds: Histogram,
    pub request_seconds: Histogram,
    pub protocol_errors: IntCounterVec,
    pub lendings: IntCounterVec,
    pub revoked: IntCounter,
}

pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    clients: gauge("racekv_attach_clients", "Processes attached to this computenode now"),
    attaches: counter("racekv_attach_attaches_total", "Attachments accepted"),
    refused: counter_vec(
        "racekv_attach_refused_total",
        "Attach attempts refused, by reason (too_many_clients, uid, token, bad_hello, unavailable)",
        &["reason"],
        &[],
    ),
    detaches: counter_vec(
        "racekv_attach_detaches_total",
        "Attachments ended, by reason (closed: the client went away; protocol_error; shutdown)",
        &["reason"],
        &[],
    ),
    requests: counter_vec(
        "racekv_attach_requests_total",
        "Requests taken from attached clients' rings, by result (ok, error, overloaded)",
        &["result"],
        &[],
    ),
    in_flight: gauge("racekv_attach_requests_in_flight", "Requests taken from rings and not answered yet"),
    ring_wait_seconds: latency_histogram(
        "racekv_attach_ring_wait_seconds",
        "Time from a client's submission to the daemon taking the request off its ring",
    ),
    request_seconds: latency_histogram(
        "racekv_attach_request_duration_seconds",
        "Time from taking a request off a ring to its reply written back (queueing and execution)",
    ),
    protocol_errors: counter_vec(
        "racekv_attach_protocol_errors_total",
        "Attached clients detached for breaking the ring protocol, by reason",
        &["reason"],
        &[],
    ),
    lendings: counter_vec(
        "racekv_attach_lendings_total",
        "Clients that asked to borrow memnode connections, by outcome (lent, refused: policy, failed: dialing)",
        &["outcome"],
        &[&["lent", "refused", "failed"]],
    ),
    revoked: counter("racekv_attach_lendings_revoked_total", "Lendings taken back (the policy stopped allowing them)"),
});
