//! Log output: `tracing` to stderr, filtered by `RACEKV_LOG` (or `RUST_LOG`), as plain text
//! (coloured only on a terminal, so files and journald get no escape codes) or as JSON
//! lines for log collectors.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines; ANSI colours only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!("unknown log format `{other}`: `text` or `json`")),
        }
    }
}

/// Sets up text logging once per process; later calls are no-ops.
pub fn init_logging() {
    init_logging_as(LogFormat::Text);
}

/// Sets up logging in `format` once per process; later calls are no-ops.
pub fn init_logging_as(format: LogFormat) {
    let filter = std::env::var("RACEKV_LOG")
        .ok()
        .map(EnvFilter::new)
        .unwrap_or_else(|| EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}
