//! racekv's coordination (issue 17): the cluster map ([`map`]) and its home in etcd
//! ([`etcd`], with the `etcd` feature): memnodes register under a lease, the map is
//! written by compare-and-swap on its revision and watched. etcd is the coordinator, a
//! real, proven one; racekv keeps no consensus of its own.
//!
//! Without etcd everything runs as before (a fixed ring of memnodes): this crate is only
//! used by daemons given `--etcd` (config key `etcd_endpoints`).

#![deny(unsafe_code)]

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(not(feature = "etcd"))]
#[path = "etcd_absent.rs"]
pub mod etcd;
pub mod failover;
pub mod keys;
pub mod local_etcd;
pub mod map;
pub mod membership;
pub mod rejoin;
#[cfg(feature = "testing")]
pub mod testing;

pub use keys::KeySpace;
pub use map::{ClusterMap, MemnodeInfo};

/// How long a daemon's or the CLI's etcd calls wait: a start fails rather than hang.
pub const DEFAULT_ETCD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Checks a daemon's etcd settings before it starts: the cluster's name is a valid one, and
/// this build has the etcd client.
pub fn check_settings(cluster: &str) -> Result<(), CoordError> {
    KeySpace::new(cluster)?;
    if cfg!(feature = "etcd") {
        Ok(())
    } else {
        Err(CoordError::NotBuilt)
    }
}

/// What went wrong talking to the coordinator or reading what it holds.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// etcd could not be reached or refused the request (after the timeout).
    #[error("etcd at {endpoints}: {reason}")]
    Etcd {
        /// The endpoints tried.
        endpoints: String,
        /// What happened.
        reason: String,
    },
    /// A map or registration in etcd is malformed (damaged, or written by something else).
    #[error("bad cluster map: {0}")]
    BadMap(String),
    /// A setting is wrong (endpoints, cluster name).
    #[error("{0}")]
    Config(String),
    /// This build has no etcd client.
    #[error(
        "this build has no etcd support: rebuild with `--features etcd` (it needs protoc, Debian's protobuf-compiler)"
    )]
    NotBuilt,
}
