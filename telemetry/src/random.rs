//! Random ids (server instances, FLOCK senders and lane keys, mover claims in etcd): one
//! function, so every crate draws them the same way.

use std::fs::File;
use std::io::Read;

/// A random u64 from /dev/urandom; from the clock and the pid when it cannot be read.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    if File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_err() {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        return xxhash_rust::xxh3::xxh3_64(&nanos.to_le_bytes()) ^ u64::from(std::process::id());
    }
    u64::from_le_bytes(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_differ() {
        let ids: std::collections::BTreeSet<u64> = (0..64).map(|_| super::random_u64()).collect();
        assert_eq!(ids.len(), 64);
    }
}
