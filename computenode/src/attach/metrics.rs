//! Prometheus metrics of the attach front end, registered once on the default registry.
//! Label values are fixed strings.

use std::sync::LazyLock;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};
use racekv_telemetry::{register, LATENCY_BUCKETS_SECONDS};

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
}

fn counter_vec(name: &str, help: &str, label: &str) -> IntCounterVec {
    register(IntCounterVec::new(Opts::new(name, help), &[label]).unwrap())
}

fn histogram(name: &str, help: &str) -> Histogram {
    register(Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS_SECONDS.to_vec())).unwrap())
}

pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    clients: register(IntGauge::new("racekv_attach_clients", "Processes attached to this computenode now").unwrap()),
    attaches: register(IntCounter::new("racekv_attach_attaches_total", "Attachments accepted").unwrap()),
    refused: counter_vec(
        "racekv_attach_refused_total",
        "Attach attempts refused, by reason (too_many_clients, uid, token, bad_hello, unavailable)",
        "reason",
    ),
    detaches: counter_vec(
        "racekv_attach_detaches_total",
        "Attachments ended, by reason (closed: the client went away; protocol_error; shutdown)",
        "reason",
    ),
    requests: counter_vec(
        "racekv_attach_requests_total",
        "Requests taken from attached clients' rings, by result (ok, error, overloaded)",
        "result",
    ),
    in_flight: register(
        IntGauge::new("racekv_attach_requests_in_flight", "Requests taken from rings and not answered yet").unwrap(),
    ),
    ring_wait_seconds: histogram(
        "racekv_attach_ring_wait_seconds",
        "Time from a client's submission to the daemon taking the request off its ring",
    ),
    request_seconds: histogram(
        "racekv_attach_request_duration_seconds",
        "Time from taking a request off a ring to its reply written back (queueing and execution)",
    ),
    protocol_errors: counter_vec(
        "racekv_attach_protocol_errors_total",
        "Attached clients detached for breaking the ring protocol, by reason",
        "reason",
    ),
});
