//! Process plumbing shared by every racekv daemon: observability and configuration.
//!
//! * [`LATENCY_BUCKETS_SECONDS`]: histogram buckets from 1 µs to 1 s, because one-sided
//!   operations live in the microsecond range and the Prometheus defaults start at 5 ms.
//! * [`MetricsServer`]: serves the process-wide default registry on `/metrics`, `/healthz`,
//!   and optionally a JSON `/status`, within the limits of [`http`].
//! * [`ratelimit`]: warnings a peer can trigger at will, written at most once per period.
//! * [`clock`]: the wall clock expiry times are kept in (Unix milliseconds).
//! * [`init_logging_as`]: `tracing` to stderr, filtered by `RACEKV_LOG` (or `RUST_LOG`), as
//!   text (colour only on a terminal) or JSON lines.
//! * [`systemd`]: readiness for `Type=notify` units.
//! * [`child`]: stopping a child process (SIGTERM, a wait, SIGKILL).
//! * [`load_config`]: defaults < TOML file < environment variables, into a serde struct;
//!   secrets may come from files (`X_file`), and [`secret`] prints configs with them masked.
//!
//! Components register their metrics once, in a `LazyLock`, on the default registry (with
//! [`metric`]'s constructors); several components in one process (tests, `racekv up`)
//! therefore share and sum their series.

#![forbid(unsafe_code)]

pub mod child;
pub mod clock;
pub mod http;
mod logging;
pub mod metric;
mod process;
pub mod random;
pub mod ratelimit;
pub mod secret;
pub mod systemd;
pub mod tls;

use anyhow::Context;
use prometheus::{Encoder, TextEncoder};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use logging::{init_logging, init_logging_as, LogFormat};
pub use process::register_process_metrics;

#[doc(hidden)]
pub use http::{serve_bytes_for_fuzzing, FUZZ_MAX_OUTPUT_BYTES};
pub use http::{
    HttpLimits, MetricsServer, ReadyFn, Routes, StatusFn, CONNECTION_LIFETIME_MS, HEADER_READ_TIMEOUT_MS,
    MAX_CONNECTIONS, MAX_HEADERS, MAX_HEADER_BYTES, REFUSED_WARN_INTERVAL_MS,
};

/// Histogram buckets for latencies, in seconds: 1 µs .. 1 s, roughly 1-2-5 per decade.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    1e-6, 2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3,
    200e-3, 500e-3, 1.0,
];

/// Histogram buckets for sizes, in bytes: 8 B .. 16 MiB, powers of 4.
pub const SIZE_BUCKETS_BYTES: &[f64] =
    &[8.0, 32.0, 128.0, 512.0, 2048.0, 8192.0, 32768.0, 131072.0, 524288.0, 2097152.0, 8388608.0, 16777216.0];

/// Histogram buckets for small counts (batch sizes, coalescing degrees): 1 .. 256.
pub const COUNT_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Renders the default registry in the Prometheus text format.
pub fn render() -> String {
    let families = prometheus::gather();
    let mut out = Vec::with_capacity(16 * 1024);
    TextEncoder::new().encode(&families, &mut out).expect("text encoding of gathered metrics cannot fail");
    String::from_utf8(out).expect("prometheus text format is UTF-8")
}

/// Loads a configuration: `T::default()`, then `file` (TOML) if given, then environment
/// variables `<PREFIX>_<FIELD>` (nested fields joined by `__`). A list setting (one whose
/// default is a list) takes comma-separated items from the environment (`a,b`; empty: no
/// items). Unknown keys are errors when `T` denies them (`#[serde(deny_unknown_fields)]`).
/// A text setting `X` may instead be given as `X_file`, a file holding the value (see
/// [`secret`]).
pub fn load_config<T: Serialize + DeserializeOwned + Default>(
    file: Option<&std::path::Path>,
    env_prefix: &str,
) -> anyhow::Result<T> {
    use config::Source;
    let context = || match file {
        Some(p) => format!("reading the configuration from {} and {env_prefix}_*", p.display()),
        None => format!("reading the configuration from {env_prefix}_*"),
    };
    let defaults = config::Config::try_from(&T::default()).with_context(context)?;
    // Found through TOML, which keeps empty lists (the config crate drops them).
    let lists = match toml::Value::try_from(T::default()).with_context(context)? {
        toml::Value::Table(tree) => list_keys(&tree, ""),
        _ => Vec::new(),
    };
    let user_layers = |builder: config::ConfigBuilder<config::builder::DefaultState>| {
        let builder = match file {
            Some(path) => builder.add_source(config::File::from(path).format(config::FileFormat::Toml).required(true)),
            None => builder,
        };
        let mut env =
            config::Environment::with_prefix(env_prefix).prefix_separator("_").separator("__").try_parsing(true);
        env = env.list_separator(",");
        for key in &lists {
            env = env.with_list_parse_key(key);
        }
        // Without list keys, `list_separator` would split every value: keep text as text.
        if lists.is_empty() {
            env = env.with_list_parse_key("");
        }
        builder.add_source(env).add_source(empty_lists_from_env(env_prefix, &lists))
    };
    let load = || -> anyhow::Result<T> {
        let merged = user_layers(config::Config::builder().add_source(defaults.clone())).build()?;
        // The file and environment alone: which keys the operator set (for `X_file`).
        let user = user_layers(config::Config::builder()).build()?;
        let mut tree = merged.collect()?;
        secret::resolve_files(&defaults.collect()?, &user.collect()?, &mut tree, "")?;
        Ok(config::Value::new(None, config::ValueKind::Table(tree)).try_deserialize()?)
    };
    load().with_context(context)
}

/// The dotted keys (as the environment source spells them: lower case) of every list in
/// `tree`, a configuration's defaults.
fn list_keys(tree: &toml::Table, prefix: &str) -> Vec<String> {
    let mut keys = Vec::new();
    for (name, value) in tree {
        let key = format!("{prefix}{}", name.to_lowercase());
        match value {
            toml::Value::Array(_) => keys.push(key),
            toml::Value::Table(inner) => keys.extend(list_keys(inner, &format!("{key}."))),
            _ => {}
        }
    }
    keys
}

/// List settings set to the empty string in the environment, as empty lists (the
/// environment source would make them a list of one empty item).
fn empty_lists_from_env(env_prefix: &str, lists: &[String]) -> config::Config {
    let mut builder = config::Config::builder();
    for key in lists {
        let var = format!("{env_prefix}_{}", key.replace('.', "__").to_uppercase());
        if std::env::var_os(&var).is_some_and(|v| v.is_empty()) {
            builder = builder.set_override(key.as_str(), Vec::<String>::new()).expect("a plain key");
        }
    }
    builder.build().expect("overrides only")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_strictly_increasing_and_start_in_microseconds() {
        assert!(LATENCY_BUCKETS_SECONDS.windows(2).all(|w| w[0] < w[1]));
        assert!(LATENCY_BUCKETS_SECONDS[0] <= 1e-6);
        assert!(SIZE_BUCKETS_BYTES.windows(2).all(|w| w[0] < w[1]));
        assert!(COUNT_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }

    #[derive(Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Inner {
        hosts: Vec<String>,
        port: u16,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Settings {
        memnodes: Vec<String>,
        name: String,
        inner: Inner,
    }

    impl Default for Settings {
        fn default() -> Self {
            Self { memnodes: vec!["tcp:127.0.0.1:7400".into()], name: "n".into(), inner: Inner::default() }
        }
    }

    /// Each test its own prefix: the environment is shared by the tests running at once.
    fn load_with(prefix: &str, vars: &[(&str, &str)]) -> anyhow::Result<Settings> {
        for (key, value) in vars {
            std::env::set_var(format!("{prefix}_{key}"), value);
        }
        let loaded = load_config::<Settings>(None, prefix);
        for (key, _) in vars {
            std::env::remove_var(format!("{prefix}_{key}"));
        }
        loaded
    }

    #[test]
    fn lists_come_from_the_environment_comma_separated() {
        let s = load_with("RACEKV_TLIST1", &[("MEMNODES", "tcp:10.0.0.1:7400,tcp:10.0.0.2:7400")]).unwrap();
        assert_eq!(s.memnodes, ["tcp:10.0.0.1:7400", "tcp:10.0.0.2:7400"]);
        let s = load_with("RACEKV_TLIST2", &[("MEMNODES", "tcp:10.0.0.1:7400")]).unwrap();
        assert_eq!(s.memnodes, ["tcp:10.0.0.1:7400"], "one item");
        let s = load_with("RACEKV_TLIST3", &[("MEMNODES", "")]).unwrap();
        assert!(s.memnodes.is_empty(), "empty: no items, not one empty one: {s:?}");
        // Text with a comma stays text; nested lists and numbers work.
        let s =
            load_with("RACEKV_TLIST4", &[("NAME", "a,b"), ("INNER__HOSTS", "h1,h2"), ("INNER__PORT", "7")]).unwrap();
        assert_eq!(s.name, "a,b");
        assert_eq!(s.inner, Inner { hosts: vec!["h1".into(), "h2".into()], port: 7 });
        let e = load_with("RACEKV_TLIST5", &[("STATUS", "x")]).unwrap_err();
        assert!(format!("{e:#}").contains("unknown field `status`"), "{e:#}");
    }

    #[test]
    fn metrics_endpoint_serves_registered_series() {
        let counter = metric::counter("telemetry_test_total", "test");
        counter.inc_by(3);
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let mut stream = std::net::TcpStream::connect(server.addr()).unwrap();
        use std::io::{Read, Write};
        stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        stream.read_to_string(&mut body).unwrap();
        assert!(body.contains("telemetry_test_total 3"), "{body}");
    }
}
