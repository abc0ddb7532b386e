//! The etcd API of a build without the `etcd` feature: connecting says how to get one, and
//! nothing else can be reached (no value of these types exists), so callers are written
//! once for both builds.

use std::convert::Infallible;
use std::time::Duration;

use crate::map::{ClusterMap, MemnodeInfo};
use crate::CoordError;

pub use crate::DEFAULT_ETCD_TIMEOUT as DEFAULT_TIMEOUT;

/// A connection to etcd, which this build cannot make.
pub struct Etcd(Infallible);

/// A registration, which this build cannot hold.
pub struct Registration(Infallible);

/// A watch of the map, which this build cannot hold.
pub struct MapWatch(Infallible);

impl MapWatch {
    /// Unreachable (no watch exists).
    pub fn next(&self, _timeout: Duration) -> Option<Result<(ClusterMap, i64), CoordError>> {
        match self.0 {}
    }
}

/// A watch of the registrations, which this build cannot hold.
pub struct RegistrationWatch(Infallible);

impl RegistrationWatch {
    /// Unreachable (no watch exists).
    pub fn wait(&self, _timeout: Duration) -> bool {
        match self.0 {}
    }
}

impl Registration {
    /// Unreachable (no registration exists).
    pub fn deadline(&self) -> std::time::Instant {
        match self.0 {}
    }
}

impl Etcd {
    /// Unreachable (no connection exists).
    pub fn watch_registrations(&self) -> RegistrationWatch {
        match self.0 {}
    }

    /// Refuses: this build has no etcd client.
    pub fn connect(_endpoints: &[String], _cluster: &str, _timeout: Duration) -> Result<Self, CoordError> {
        Err(CoordError::NotBuilt)
    }

    /// Unreachable (no connection exists).
    pub fn register(&self, _info: &MemnodeInfo, _ttl: Duration) -> Result<Registration, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn memnodes(&self) -> Result<Vec<MemnodeInfo>, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn claim_mover(&self, _who: &str, _ttl: Duration) -> Result<Registration, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn movers(&self) -> Result<usize, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn map(&self) -> Result<Option<(ClusterMap, i64)>, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn put_map(&self, _map: &ClusterMap, _expected: Option<i64>) -> Result<Option<i64>, CoordError> {
        match self.0 {}
    }

    /// Unreachable (no connection exists).
    pub fn watch_map(&self, _after: i64) -> MapWatch {
        match self.0 {}
    }
}
