//! The racekv compute node: the per-host daemon that runs workers over pre-initialized
//! connections to the memory nodes, and the front ends applications talk to.
//!
//! * [`pool`]: K connections per memnode set up at start; [`pool::VirtualConnection`]s
//!   multiplexed over them, upgraded to dedicated connections for hot workers (KRCORE).
//! * [`cluster`]: the memnodes, their shared directory caches and prefetched chunks
//!   ([`chunks`]), and pre-initialized sessions: [`cluster::Cluster::attach`] is a pop.
//! * [`queue`] and [`workers`]: the bounded work queue front ends submit to, and worker
//!   threads added by an autoscaler when it backs up.
//! * [`store`]: the Redis front end's storage (attached sessions; the front end itself is
//!   the `racekv-redis` crate), kept under `maxmemory` by [`eviction`] (cache mode, as are
//!   the attach and remote front ends' requests: [`execute`]);
//!   [`remote`]: the request/reply model over FLOCK RPC for clients on other hosts.
//! * [`access`]: what each ACL user may do through the remote and attach front ends.
//! * [`staging`]: requests and replies too large for one ring slot or RPC, in parts.
//! * [`daemon`]: [`Computenode`], which ties it together; `racekv-computenode` runs it.

#![forbid(unsafe_code)]

pub mod access;
pub mod attach;
pub mod chunks;
pub mod cluster;
pub mod config;
pub mod daemon;
pub mod eviction;
pub mod execute;
pub mod get_combiner;
pub mod lending;
mod map_follower;
pub mod pool;
pub mod queue;
pub mod remote;
pub mod staging;
pub mod store;
pub mod store_error;
pub mod workers;

pub use daemon::Computenode;
