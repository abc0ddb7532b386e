//! Where a cluster's state lives in etcd: everything under `/racekv/<cluster>/`, so one
//! etcd can serve several clusters.
//!
//! ```text
//! /racekv/<cluster>/memnodes/<node id, 16 hex digits>   MemnodeInfo JSON, under the memnode's lease
//! /racekv/<cluster>/map                                 ClusterMap JSON, written by compare-and-swap
//! /racekv/<cluster>/movers/<random id, 16 hex digits>   who moves partitions (host:pid), under its lease
//! ```

use crate::CoordError;

/// Longest cluster name.
pub const MAX_CLUSTER_NAME_BYTES: usize = 64;
/// The cluster name when none is configured.
pub const DEFAULT_CLUSTER_NAME: &str = "racekv";

/// The keys of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpace {
    prefix: String,
}

impl KeySpace {
    /// The keys of cluster `name` (lowercase letters, digits and `-`, at most
    /// [`MAX_CLUSTER_NAME_BYTES`]).
    pub fn new(name: &str) -> Result<Self, CoordError> {
        let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
        if name.is_empty() || name.len() > MAX_CLUSTER_NAME_BYTES || !name.bytes().all(ok) {
            return Err(CoordError::Config(format!(
                "cluster name {name:?}: 1 to {MAX_CLUSTER_NAME_BYTES} lowercase letters, digits or '-'"
            )));
        }
        Ok(Self { prefix: format!("/racekv/{name}/") })
    }

    /// The prefix of every memnode's registration.
    pub fn memnodes(&self) -> String {
        format!("{}memnodes/", self.prefix)
    }

    /// Memnode `node_id`'s registration.
    pub fn memnode(&self, node_id: u64) -> String {
        format!("{}memnodes/{node_id:016x}", self.prefix)
    }

    /// The prefix of the claims of commands moving partitions.
    pub fn movers(&self) -> String {
        format!("{}movers/", self.prefix)
    }

    /// A mover's claim.
    pub fn mover(&self, id: u64) -> String {
        format!("{}movers/{id:016x}", self.prefix)
    }

    /// The cluster map.
    pub fn map(&self) -> String {
        format!("{}map", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_keys_nest_under_the_cluster() {
        let k = KeySpace::new("prod-1").unwrap();
        assert_eq!(k.memnode(0xab), "/racekv/prod-1/memnodes/00000000000000ab");
        assert!(k.memnode(7).starts_with(&k.memnodes()));
        assert_eq!(k.map(), "/racekv/prod-1/map");
        assert_eq!(k.mover(0xcd), "/racekv/prod-1/movers/00000000000000cd");
        assert!(k.mover(1).starts_with(&k.movers()));
        for bad in ["", "Prod", "a/b", "a b", &"x".repeat(65)] {
            assert!(KeySpace::new(bad).is_err(), "{bad:?}");
        }
    }
}
