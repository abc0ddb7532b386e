//! The Redis protocol (RESP2) front end: lets redis-cli, redis-benchmark and any Redis client
//! library use racekv.
//!
//! Layers, each usable and tested on its own:
//! * [`store`]: the storage trait ([`KvStore`] hands out one [`KvSession`] per connection).
//!   The front end is generic over it; the RACE table implementation comes from elsewhere.
//! * [`resp`]: incremental parser of untrusted request bytes with explicit [`Limits`], and
//!   encoders; [`reply`]: replies.
//! * [`commands`]: the command table and the per-connection [`Client`] executing commands.
//! * [`server`]: TCP listener, a thread per connection or a few event loops
//!   (`event_loop`), pipelining, limits, shutdown; both I/O models run a connection's
//!   commands the same way (`serving`), under the server's [`options`].
//! * [`info`]: per-server counters and `INFO` text; prometheus metrics are `racekv_redis_*`.
//!   Beside it: the connection registry and `CLIENT PAUSE` (`clients`), run-time settings
//!   (`settings`, `CONFIG SET`), the slow log and latency monitor (`slowlog`), and
//!   INCRBYFLOAT's extended-precision arithmetic (`float80`), and cache mode's settings and
//!   counters ([`maxmemory`]).
//!
//! ```no_run
//! # #[cfg(feature = "test-support")] {
//! use std::sync::Arc;
//! use racekv_redis::{MemStore, RedisServer, ServerOptions};
//! let server = RedisServer::start("127.0.0.1:0", Arc::new(MemStore::new()), ServerOptions::default()).unwrap();
//! println!("redis-cli -p {}", server.local_addr().port());
//! # }
//! ```

#![forbid(unsafe_code)]

pub mod acl;
mod clients;
mod command;
pub mod commands;
mod conn;
mod event_loop;
mod float80;
pub mod glob;
pub mod info;
mod inline;
pub mod maxmemory;
#[cfg(any(test, feature = "test-support"))]
mod memstore;
mod metrics;
pub mod options;
mod protocol_error;
pub mod reply;
pub mod resp;
pub mod server;
mod serving;
mod settings;
mod slowlog;
pub mod store;
mod tls;
mod txn_session;

pub use commands::Client;
pub use info::ServerStats;
#[cfg(any(test, feature = "test-support"))]
pub use memstore::MemStore;
pub use options::{IoModel, ServerOptions, TlsPort};
pub use reply::{Output, Protocol, Reply};
pub use resp::{Command, Limits, Parser, ProtocolError, QueryBudget};
pub use server::RedisServer;
pub use store::{
    Expiry, ExpiryUpdate, Item, KeyAccess, KeyVersion, KvSession, KvStore, PutMode, PutOptions, PutResult, StoreError,
    StoreErrorKind, TxnWrite,
};
