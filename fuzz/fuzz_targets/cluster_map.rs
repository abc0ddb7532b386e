//! Fuzzes what the coordinator reads back from etcd: the cluster map and memnode
//! registrations (JSON anyone with access to etcd could have written).
//!
//! Beyond "no panic": a map that decodes passes its own check, re-encodes to bytes that
//! decode to the same map, and routes every key hash to a replica set of memnodes it lists.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_coord::{ClusterMap, MemnodeInfo};

fuzz_target!(|data: &[u8]| {
    if let Ok(map) = ClusterMap::decode(data) {
        map.check().unwrap();
        assert_eq!(ClusterMap::decode(&map.encode()).unwrap(), map);
        let hash = data.iter().fold(0u64, |h, &b| h.rotate_left(5) ^ u64::from(b));
        let set = map.replicas_of(map.partition_of(hash));
        assert!(!set.is_empty() && set.iter().all(|id| map.memnode(*id).is_some()));
    }
    if let Ok(info) = MemnodeInfo::decode(data) {
        assert_eq!(MemnodeInfo::decode(&info.encode()).unwrap(), info);
    }
});
