//! The racekv compute node: the per-host daemon that runs workers over pre-initialized
//! connections to the memory nodes, and the front ends applications talk to.
//!
//! * [`queue`]: where front ends (attached processes, remote clients) submit requests.
//! * [`redis`]: the Redis (RESP2) front end, written against a storage trait.

pub mod queue;
pub mod redis;
