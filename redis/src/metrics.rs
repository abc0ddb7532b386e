//! Prometheus metrics of the Redis front end, registered once on the default registry.
//!
//! Label values are bounded: commands are the names in the command table plus `unknown`,
//! reasons are static strings, error codes the first [`crate::info::MAX_ERROR_CODES`] seen.

use std::sync::LazyLock;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge};
use racekv_telemetry::metric::{counter, counter_vec, gauge, latency_histogram_vec};

pub(crate) struct Metrics {
    pub connected_clients: IntGauge,
    pub connections: IntCounter,
    pub connections_rejected: IntCounterVec,
    pub connections_closed: IntCounterVec,
    pub commands: IntCounterVec,
    pub command_seconds: HistogramVec,
    pub protocol_errors: IntCounterVec,
    pub store_errors: IntCounterVec,
    pub error_replies: IntCounterVec,
    pub received_bytes: IntCounter,
    pub sent_bytes: IntCounter,
    pub event_loop_sleeps: IntCounter,
    pub auth_failures: IntCounter,
    pub acl_denied: IntCounterVec,
    pub cross_protocol: IntCounter,
    pub tls_handshake_failures: IntCounter,
    pub cas_retries: IntCounterVec,
    pub keyspace_lookups: IntCounterVec,
    pub slow_commands: IntCounter,
    pub paused_commands: IntCounter,
    pub config_changes: IntCounterVec,
    pub query_buffer_bytes: IntGauge,
    pub query_buffer_budget: IntGauge,
    pub query_buffer_refusals: IntCounter,
    pub transactions: IntCounter,
    pub transactions_watch_aborted: IntCounter,
    pub transaction_reruns: IntCounter,
    pub transactions_execabort: IntCounter,
    pub multi_key_retries: IntCounterVec,
}

pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    Metrics {
    connected_clients: gauge("racekv_redis_connected_clients", "Redis client connections open now"),
    connections: counter("racekv_redis_connections_total", "Redis client connections accepted"),
    connections_rejected: counter_vec(
        "racekv_redis_connections_rejected_total",
        "Redis client connections refused",
        &["reason"],
        &[],
    ),
    connections_closed: counter_vec(
        "racekv_redis_connections_closed_total",
        "Redis client connections closed, by why",
        &["reason"],
        &[],
    ),
    commands: counter_vec(
        "racekv_redis_commands_total",
        "Redis commands executed, by command and result (ok, error)",
        &["command", "result"],
        &[],
    ),
    command_seconds: latency_histogram_vec(
        "racekv_redis_command_duration_seconds",
        "Time to execute one Redis command, storage included",
        &["command"],
    ),
    protocol_errors: counter_vec(
        "racekv_redis_protocol_errors_total",
        "Malformed Redis requests (each closes its connection)",
        &["reason"],
        &[],
    ),
    store_errors: counter_vec(
        "racekv_redis_store_errors_total",
        "Storage errors returned to Redis clients, by kind",
        &["kind"],
        &[],
    ),
    error_replies: counter_vec(
        "racekv_redis_error_replies_total",
        "Error replies sent to Redis clients, by code (the reply's first word, as INFO errorstats)",
        &["code"],
        &[],
    ),
    received_bytes: counter("racekv_redis_received_bytes_total", "Bytes received from Redis clients"),
    sent_bytes: counter("racekv_redis_sent_bytes_total", "Bytes sent to Redis clients"),
    event_loop_sleeps: counter(
        "racekv_redis_event_loop_sleeps_total",
        "Times an event loop found nothing to do after its spin and blocked (each costs its next request a wake-up)",
    ),
    auth_failures: counter(
        "racekv_redis_auth_failures_total",
        "AUTH (or HELLO AUTH) attempts with a wrong user or password",
    ),
    acl_denied: counter_vec(
        "racekv_redis_acl_denied_total",
        "Commands refused by access control, by why (noauth, command, key)",
        &["reason"],
        &[],
    ),
    cross_protocol: counter(
        "racekv_redis_cross_protocol_total",
        "Connections closed for sending POST or Host: as a command (HTTP sent to the Redis port)",
    ),
    tls_handshake_failures: counter(
        "racekv_redis_tls_handshake_failures_total",
        "Connections to the TLS port whose handshake failed (wrong certificate, plaintext, timeout)",
    ),
    cas_retries: counter_vec(
        "racekv_redis_cas_retries_total",
        "Compare-and-swaps a read-modify-write string command lost to another writer and retried, by command",
        &["command"],
        &[],
    ),
    keyspace_lookups: counter_vec(
        "racekv_redis_keyspace_lookups_total",
        "Keys looked up by reading commands (GET, MGET, EXISTS, GETRANGE, ...), by result (hit, miss): INFO's keyspace_hits/misses",
        &["result"],
        &[],
    ),
    slow_commands: counter(
        "racekv_redis_slow_commands_total",
        "Commands that took at least slowlog-log-slower-than (each is added to SLOWLOG)",
    ),
    paused_commands: counter(
        "racekv_redis_paused_commands_total",
        "Commands that waited for a CLIENT PAUSE to end before they ran",
    ),
    config_changes: counter_vec(
        "racekv_redis_config_changes_total",
        "Settings changed at run time by CONFIG SET, by parameter",
        &["parameter"],
        &[],
    ),
    query_buffer_bytes: gauge(
        "racekv_redis_query_buffer_bytes",
        "Bytes partly received (or executing) large commands hold, charged to the query buffer budget",
    ),
    query_buffer_budget: gauge(
        "racekv_redis_query_buffer_budget_bytes",
        "The query buffer budget: the most bytes large commands of all clients may hold together (0: unlimited)",
    ),
    query_buffer_refusals: counter(
        "racekv_redis_query_buffer_budget_refusals_total",
        "Connections closed because their command would have taken the query buffer budget past its limit",
    ),
    transactions: counter(
        "racekv_redis_transactions_total",
        "MULTI/EXEC transactions committed (their queued commands applied atomically)",
    ),
    transactions_watch_aborted: counter(
        "racekv_redis_transactions_watch_aborted_total",
        "EXECs answered with a null array because a WATCHed key changed (nothing applied)",
    ),
    transaction_reruns: counter(
        "racekv_redis_transaction_reruns_total",
        "Times EXEC ran its queue again because a key it read changed before its commit",
    ),
    transactions_execabort: counter(
        "racekv_redis_transactions_execabort_total",
        "EXECs refused with EXECABORT because a command failed while queued",
    ),
    multi_key_retries: counter_vec(
        "racekv_redis_multi_key_retries_total",
        "Commits of a multi-key command (MSET, MSETNX, RENAME, RENAMENX, COPY) that lost to another writer and were retried, by command",
        &["command"],
        &[],
    ),
}
});

/// The series of one command, looked up once instead of per call.
pub(crate) struct CommandMetrics {
    pub ok: IntCounter,
    pub error: IntCounter,
    pub seconds: Histogram,
}

impl CommandMetrics {
    pub fn new(command: &str) -> Self {
        Self {
            ok: METRICS.commands.with_label_values(&[command, "ok"]),
            error: METRICS.commands.with_label_values(&[command, "error"]),
            seconds: METRICS.command_seconds.with_label_values(&[command]),
        }
    }
}
