//! Benchmarks behind `racekv bench <name>`. Each returns a serializable report; the CLI
//! prints it as one JSON object with `--json`.
//!
//! * [`ops`]: get/put throughput, latency, round trips and CAS retries per operation, with a
//!   same-run memory-latency baseline for shm (the limit a GET of three dependent misses
//!   can reach on this machine).
//! * [`loadfactor`]: how full one subtable gets before the first split.
//! * [`churn`]: heap bytes before and after many updates of a fixed key set.
//! * [`attach`]: a worker's wait for a session: attach vs building its own connections.
//! * [`spike`]: KRCORE's load spike: 1 -> N workers, throughput every 100 us (PNG plot).
//! * [`redis`]: GETs through the Redis front end vs a real redis-server, same flags, same run.
//! * [`scan`]: SCAN over every key through the Redis front end vs a real redis-server.
//! * [`rpc`]: RPC with per-thread, lock-shared and FLOCK-coalescing connections.
//! * [`coldstart`]: a new process's start to its first GET, attached vs embedded.
//! * [`reclaim`]: a memnode start's reclaim of unreferenced heap space vs one pass over it.
//! * [`txn`]: 2-key transactions vs the single-key operations they replace; contention.
//! * [`ycsb`]: YCSB's core workloads: racekv native and through RESP, redis-server, valkey-server.
//! * [`valkey`]: where valkey-server is, for the benchmarks that compare with it.
//! * [`cache`]: cache mode's hit ratio per eviction policy vs redis-server, and what it costs GETs.

#![forbid(unsafe_code)]

pub mod attach;
pub mod cache;
pub mod churn;
pub mod cluster;
pub mod coldstart;
pub mod idle;
pub mod large;
pub mod loadfactor;
pub mod membaseline;
pub mod ops;
pub mod plot;
pub mod reclaim;
pub mod redis;
pub mod report;
pub mod rpc;
pub mod scan;
pub mod spike;
pub mod txn;
pub mod valkey;
pub mod ycsb;
