//! The settings `CONFIG GET` shows and `CONFIG SET` changes while the server runs.
//!
//! Each is an atomic the code that uses it loads where it needs it (admission, the idle
//! sweep, the slow log), so a change applies to every connection at its next use, without
//! locks on the command path. Parameters that describe racekv in Redis terms but cannot
//! change (`databases`, `save`, `proto-max-bulk-len`, ...) are read-only: `CONFIG SET`
//! answers Redis' "can't set immutable config".

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::maxmemory::{parse_memory, Limit, Maxmemory, MaxmemoryPolicy, MAX_LFU_SETTING, MAX_SAMPLES};
use crate::resp::QueryBudget;
use crate::slowlog::MAX_SLOWLOG_LEN;

/// Largest `maxclients` `CONFIG SET` accepts (each connection may hold a thread and a few
/// MiB of buffers).
pub const MAX_MAX_CLIENTS: u64 = 1_000_000;
/// Largest `timeout` (seconds) `CONFIG SET` accepts: Redis' `INT_MAX`.
pub const MAX_TIMEOUT_SECS: u64 = i32::MAX as u64;

/// Redis' defaults for the slow log.
const DEFAULT_SLOWLOG_SLOWER_THAN_US: i64 = 10_000;
const DEFAULT_SLOWLOG_MAX_LEN: usize = 128;

/// The run-time settings of one server.
#[derive(Debug)]
pub(crate) struct Settings {
    max_clients: AtomicUsize,
    /// Milliseconds; 0: never.
    idle_timeout_ms: AtomicU64,
    /// Microseconds; negative: the slow log is off.
    slowlog_slower_than_us: AtomicI64,
    slowlog_max_len: AtomicUsize,
    /// Milliseconds; 0: the latency monitor is off.
    latency_threshold_ms: AtomicU64,
    protected_mode: AtomicBool,
    proto_max_bulk_len: AtomicUsize,
    /// Bytes; the parsers' `max_command_bytes`.
    client_query_buffer_limit: AtomicUsize,
    /// Shared by every connection's parser; its limit is `query-buffer-budget`.
    query_budget: Arc<QueryBudget>,
    /// Cache mode's settings, shared with whoever enforces them.
    maxmemory: Arc<Maxmemory>,
}

impl Settings {
    pub fn new(max_clients: usize, idle_timeout: Option<Duration>) -> Self {
        Self {
            max_clients: AtomicUsize::new(max_clients),
            idle_timeout_ms: AtomicU64::new(idle_timeout.map_or(0, |t| (t.as_millis() as u64).max(1))),
            slowlog_slower_than_us: AtomicI64::new(DEFAULT_SLOWLOG_SLOWER_THAN_US),
            slowlog_max_len: AtomicUsize::new(DEFAULT_SLOWLOG_MAX_LEN),
            latency_threshold_ms: AtomicU64::new(0),
            protected_mode: AtomicBool::new(true),
            proto_max_bulk_len: AtomicUsize::new(crate::resp::Limits::default().max_bulk_bytes),
            client_query_buffer_limit: AtomicUsize::new(crate::resp::Limits::default().max_command_bytes),
            query_budget: QueryBudget::new(0),
            maxmemory: Arc::default(),
        }
    }

    pub fn max_clients(&self) -> usize {
        self.max_clients.load(Ordering::Relaxed)
    }

    pub fn idle_timeout(&self) -> Option<Duration> {
        match self.idle_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub fn slowlog_slower_than_us(&self) -> i64 {
        self.slowlog_slower_than_us.load(Ordering::Relaxed)
    }

    pub fn slowlog_max_len(&self) -> usize {
        self.slowlog_max_len.load(Ordering::Relaxed)
    }

    pub fn latency_threshold_ms(&self) -> u64 {
        self.latency_threshold_ms.load(Ordering::Relaxed)
    }

    pub fn protected_mode(&self) -> bool {
        self.protected_mode.load(Ordering::Relaxed)
    }

    pub fn set_protected_mode(&self, on: bool) {
        self.protected_mode.store(on, Ordering::Relaxed);
    }

    /// The longest argument the parser takes, and so the longest string a command builds.
    pub fn proto_max_bulk_len(&self) -> usize {
        self.proto_max_bulk_len.load(Ordering::Relaxed)
    }

    pub fn set_proto_max_bulk_len(&self, bytes: usize) {
        self.proto_max_bulk_len.store(bytes, Ordering::Relaxed);
    }

    /// The most one command may hold (the parsers' `max_command_bytes`), read at each feed.
    pub fn client_query_buffer_limit(&self) -> usize {
        self.client_query_buffer_limit.load(Ordering::Relaxed)
    }

    pub fn set_client_query_buffer_limit(&self, bytes: usize) {
        self.client_query_buffer_limit.store(bytes, Ordering::Relaxed);
    }

    /// Cache mode's settings (`maxmemory*`).
    pub fn maxmemory(&self) -> &Arc<Maxmemory> {
        &self.maxmemory
    }

    /// Shares `maxmemory` with its enforcer (at server start).
    pub fn set_maxmemory(&mut self, maxmemory: Arc<Maxmemory>) {
        self.maxmemory = maxmemory;
    }

    /// The server-wide budget of partly received large commands (`query-buffer-budget`).
    pub fn query_budget(&self) -> &Arc<QueryBudget> {
        &self.query_budget
    }
}

/// What kind of value a parameter takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An integer within bounds.
    Integer { min: i64, max: i64 },
    /// Bytes within bounds, with Redis' units (`1mb`, `512k`, `1gb`: k = 1000, kb = 1024).
    Memory { min: i64, max: i64 },
    /// `yes` or `no`.
    Bool,
    /// Any text.
    Text,
    /// A `maxmemory-policy` name.
    Policy,
    /// `maxmemory`: bytes with Redis' units, or a share of each memnode's region (`50%`).
    Limit,
    /// Not settable at run time.
    Immutable,
}

/// One parameter of `CONFIG GET/SET`.
pub(crate) struct Parameter {
    pub name: &'static str,
    pub kind: Kind,
}

const fn param(name: &'static str, kind: Kind) -> Parameter {
    Parameter { name, kind }
}

/// Every parameter racekv knows, in `CONFIG GET`'s order.
pub(crate) static PARAMETERS: &[Parameter] = &[
    param("maxclients", Kind::Integer { min: 1, max: MAX_MAX_CLIENTS as i64 }),
    param("timeout", Kind::Integer { min: 0, max: MAX_TIMEOUT_SECS as i64 }),
    param("databases", Kind::Immutable),
    param("save", Kind::Immutable),
    param("appendonly", Kind::Immutable),
    param("slowlog-log-slower-than", Kind::Integer { min: -1, max: i64::MAX }),
    param("slowlog-max-len", Kind::Integer { min: 0, max: MAX_SLOWLOG_LEN as i64 }),
    param("latency-monitor-threshold", Kind::Integer { min: 0, max: i64::MAX }),
    param("requirepass", Kind::Text),
    param("protected-mode", Kind::Bool),
    param("proto-max-bulk-len", Kind::Immutable),
    // Redis' bounds: at least 1 MiB.
    param("client-query-buffer-limit", Kind::Memory { min: 1 << 20, max: i64::MAX }),
    // racekv's own: the budget every connection's large commands share (0: unlimited).
    param("query-buffer-budget", Kind::Memory { min: 0, max: i64::MAX }),
    param("maxmemory", Kind::Limit),
    param("maxmemory-policy", Kind::Policy),
    param("maxmemory-samples", Kind::Integer { min: 1, max: MAX_SAMPLES as i64 }),
    param("lfu-log-factor", Kind::Integer { min: 0, max: MAX_LFU_SETTING as i64 }),
    param("lfu-decay-time", Kind::Integer { min: 0, max: MAX_LFU_SETTING as i64 }),
    param("port", Kind::Immutable),
    param("cluster-enabled", Kind::Immutable),
];

/// The parameter named `name` (case-insensitive).
pub(crate) fn parameter(name: &[u8]) -> Option<&'static Parameter> {
    PARAMETERS.iter().find(|p| p.name.as_bytes().eq_ignore_ascii_case(name))
}

/// A validated new value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    Integer(i64),
    Bool(bool),
    Text(Vec<u8>),
    Policy(MaxmemoryPolicy),
    Limit(Limit),
}

/// Checks `raw` for `p`; the error is Redis' reason text (after "... argument 'x') - ").
pub(crate) fn validate(p: &Parameter, raw: &[u8]) -> Result<Value, String> {
    match p.kind {
        Kind::Immutable => Err("can't set immutable config".into()),
        Kind::Text => Ok(Value::Text(raw.to_vec())),
        Kind::Policy => MaxmemoryPolicy::parse(&String::from_utf8_lossy(raw)).map(Value::Policy),
        Kind::Limit => Limit::parse(&String::from_utf8_lossy(raw)).map(Value::Limit),
        Kind::Bool => match raw.to_ascii_lowercase().as_slice() {
            b"yes" => Ok(Value::Bool(true)),
            b"no" => Ok(Value::Bool(false)),
            _ => Err("argument must be 'yes' or 'no'".into()),
        },
        Kind::Integer { min, max } => {
            let n = crate::resp::parse_i64(raw).ok_or("argument couldn't be parsed into an integer")?;
            if n < min || n > max {
                return Err(format!("argument must be between {min} and {max} inclusive"));
            }
            Ok(Value::Integer(n))
        }
        Kind::Memory { min, max } => {
            let n = parse_memory(raw).ok_or("argument must be a memory value")?;
            if n < min || n > max {
                return Err(format!("argument must be between {min} and {max} inclusive"));
            }
            Ok(Value::Integer(n))
        }
    }
}

impl Settings {
    /// Applies a validated integer or boolean (`requirepass` is the ACL's, not here).
    pub fn apply(&self, name: &str, value: &Value) {
        match (name, value) {
            ("maxclients", Value::Integer(n)) => self.max_clients.store(*n as usize, Ordering::Relaxed),
            ("timeout", Value::Integer(secs)) => self.idle_timeout_ms.store(*secs as u64 * 1000, Ordering::Relaxed),
            ("slowlog-log-slower-than", Value::Integer(us)) => {
                self.slowlog_slower_than_us.store(*us, Ordering::Relaxed)
            }
            ("slowlog-max-len", Value::Integer(n)) => self.slowlog_max_len.store(*n as usize, Ordering::Relaxed),
            ("latency-monitor-threshold", Value::Integer(ms)) => {
                self.latency_threshold_ms.store(*ms as u64, Ordering::Relaxed)
            }
            ("protected-mode", Value::Bool(on)) => self.set_protected_mode(*on),
            ("client-query-buffer-limit", Value::Integer(n)) => self.set_client_query_buffer_limit(*n as usize),
            ("query-buffer-budget", Value::Integer(n)) => self.query_budget.set_limit(*n as usize),
            ("maxmemory", Value::Limit(limit)) => self.maxmemory.set_limit(*limit),
            ("maxmemory-policy", Value::Policy(p)) => self.maxmemory.set_policy(*p),
            ("maxmemory-samples", Value::Integer(n)) => self.maxmemory.set_samples(*n as u32),
            ("lfu-log-factor", Value::Integer(n)) => self.maxmemory.set_lfu_log_factor(*n as u32),
            ("lfu-decay-time", Value::Integer(n)) => self.maxmemory.set_lfu_decay_minutes(*n as u32),
            _ => debug_assert!(false, "no setting {name} = {value:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_validated_with_redis_reasons() {
        let max = parameter(b"MAXCLIENTS").unwrap();
        assert_eq!(validate(max, b"10"), Ok(Value::Integer(10)));
        assert_eq!(validate(max, b"x"), Err("argument couldn't be parsed into an integer".into()));
        assert_eq!(validate(max, b"0"), Err("argument must be between 1 and 1000000 inclusive".into()));
        let protected = parameter(b"protected-mode").unwrap();
        assert_eq!(validate(protected, b"YES"), Ok(Value::Bool(true)));
        assert_eq!(validate(protected, b"maybe"), Err("argument must be 'yes' or 'no'".into()));
        assert_eq!(validate(parameter(b"databases").unwrap(), b"3"), Err("can't set immutable config".into()));
        assert!(parameter(b"nosuch").is_none());
    }

    #[test]
    fn applied_values_are_what_the_server_reads() {
        let settings = Settings::new(10, None);
        settings.apply("timeout", &Value::Integer(5));
        assert_eq!(settings.idle_timeout(), Some(Duration::from_secs(5)));
        settings.apply("timeout", &Value::Integer(0));
        assert_eq!(settings.idle_timeout(), None);
        settings.apply("maxclients", &Value::Integer(3));
        assert_eq!(settings.max_clients(), 3);
        settings.apply("protected-mode", &Value::Bool(false));
        assert!(!settings.protected_mode());
        settings.apply("client-query-buffer-limit", &Value::Integer(2 << 20));
        assert_eq!(settings.client_query_buffer_limit(), 2 << 20);
        settings.apply("query-buffer-budget", &Value::Integer(5));
        assert_eq!(settings.query_budget().limit(), 5);
        let policy = validate(parameter(b"maxmemory-policy").unwrap(), b"volatile-ttl").unwrap();
        settings.apply("maxmemory-policy", &policy);
        settings.apply("maxmemory", &validate(parameter(b"maxmemory").unwrap(), b"100mb").unwrap());
        settings.apply("maxmemory-samples", &Value::Integer(7));
        let m = settings.maxmemory();
        assert_eq!((m.bytes(), m.policy(), m.samples()), (100 << 20, MaxmemoryPolicy::VolatileTtl, 7));
        settings.apply("maxmemory", &validate(parameter(b"maxmemory").unwrap(), b"25%").unwrap());
        assert_eq!(settings.maxmemory().limit(), Limit::Share(2_500));
        assert!(validate(parameter(b"maxmemory").unwrap(), b"150%").is_err());
        let lru = validate(parameter(b"maxmemory-policy").unwrap(), b"allkeys-lru").unwrap();
        settings.apply("maxmemory-policy", &lru);
        assert_eq!(settings.maxmemory().policy(), MaxmemoryPolicy::AllkeysLru);
        assert!(validate(parameter(b"maxmemory-policy").unwrap(), b"sometimes-lru").is_err());
        settings.apply("lfu-log-factor", &validate(parameter(b"lfu-log-factor").unwrap(), b"100").unwrap());
        settings.apply("lfu-decay-time", &validate(parameter(b"lfu-decay-time").unwrap(), b"0").unwrap());
        assert_eq!((settings.maxmemory().lfu_log_factor(), settings.maxmemory().lfu_decay_minutes()), (100, 0));
        assert!(validate(parameter(b"lfu-log-factor").unwrap(), b"-1").is_err());
        assert!(validate(parameter(b"maxmemory-samples").unwrap(), b"65").is_err());
    }

    #[test]
    fn memory_values_take_redis_units() {
        let limit = parameter(b"client-query-buffer-limit").unwrap();
        assert_eq!(validate(limit, b"1gb"), Ok(Value::Integer(1 << 30)));
        assert_eq!(validate(limit, b"2MB"), Ok(Value::Integer(2 << 20)));
        assert_eq!(validate(limit, b"5000000"), Ok(Value::Integer(5_000_000)));
        assert_eq!(validate(limit, b"2m"), Ok(Value::Integer(2_000_000)));
        assert_eq!(
            validate(limit, b"1kb"),
            Err(format!("argument must be between {} and {} inclusive", 1 << 20, i64::MAX))
        );
        assert_eq!(validate(limit, b"1xb"), Err("argument must be a memory value".into()));
        assert_eq!(validate(limit, b"-1"), Err("argument must be a memory value".into()));
        assert_eq!(validate(parameter(b"query-buffer-budget").unwrap(), b"0"), Ok(Value::Integer(0)));
    }
}
