//! Serves the Redis front end over `MemStore` (the in-memory TEST DOUBLE, not racekv's
//! table), for trying redis-cli or redis-benchmark by hand:
//!
//! ```text
//! cargo run -p racekv-redis --features test-support --example redis_memstore -- 127.0.0.1:6380
//! redis-benchmark -p 6380 -t get,set -n 20000 -q
//! ```
//! Stops on Ctrl-C (or after `RACEKV_EXAMPLE_SECONDS` seconds when set).

use std::sync::Arc;
use std::time::Duration;

use racekv_redis::{MemStore, RedisServer, ServerOptions};

fn main() -> std::io::Result<()> {
    racekv_telemetry::init_logging();
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:6380".into());
    let server = RedisServer::start(addr.as_str(), Arc::new(MemStore::new()), ServerOptions::default())?;
    println!("serving MemStore (test double) on {}", server.local_addr());
    match std::env::var("RACEKV_EXAMPLE_SECONDS").ok().and_then(|s| s.parse().ok()) {
        Some(seconds) => std::thread::sleep(Duration::from_secs(seconds)),
        None => loop {
            std::thread::park();
        },
    }
    Ok(())
}
