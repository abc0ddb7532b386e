//! Heap chunks fetched before anyone needs them, so a freshly attached worker's first write
//! does not wait for an allocation RPC (part of what makes attach cheap).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use racekv_hashing::alloc::{Chunk, ChunkSource, Fragments};
use racekv_hashing::table::RpcChunkSource;
use racekv_hashing::Error;
use racekv_transport::Connection;

struct State {
    ready: VecDeque<Chunk>,
    stopping: bool,
}

/// A memnode's heap chunks, a few kept fetched ahead by a background thread; hands them to
/// the table's allocators as a [`ChunkSource`].
pub struct PrefetchingChunks {
    rpc: RpcChunkSource,
    target: usize,
    chunk_bytes: u64,
    state: Mutex<State>,
    wanted: Condvar,
}

impl PrefetchingChunks {
    /// Keeps `target` chunks of `chunk_bytes` ready, fetched over `conn` by a background thread.
    pub fn start(conn: Arc<dyn Connection>, target: usize, chunk_bytes: u64) -> std::io::Result<Arc<Self>> {
        let me = Arc::new(Self {
            rpc: RpcChunkSource::new(conn),
            target,
            chunk_bytes,
            state: Mutex::new(State { ready: VecDeque::new(), stopping: false }),
            wanted: Condvar::new(),
        });
        if target > 0 {
            let weak = Arc::downgrade(&me);
            std::thread::Builder::new().name("chunk-prefetch".into()).spawn(move || refill(weak))?;
        }
        Ok(me)
    }

    /// Chunks ready now.
    pub fn ready(&self) -> usize {
        self.state.lock().ready.len()
    }

    /// Stops prefetching and gives the chunks in hand back to the memnode (a daemon that
    /// stops may never drop this: sessions and the table hold it).
    pub fn stop(&self) {
        let ready: Vec<_> = {
            let mut st = self.state.lock();
            st.stopping = true;
            st.ready.drain(..).collect()
        };
        self.wanted.notify_all();
        give_back(&self.rpc, ready);
    }
}

/// Hands unused chunks back (those of a memnode run that is gone are refused: its
/// successor reclaimed them).
fn give_back(rpc: &RpcChunkSource, chunks: impl IntoIterator<Item = Chunk>) {
    for chunk in chunks {
        rpc.give_back(chunk.instance, &[(chunk.offset, chunk.bytes)]);
    }
}

/// The first wait after a failed prefetch; each failure in a row doubles it, up to
/// [`MAX_PREFETCH_BACKOFF`] (a memnode down for long, or gone, is not asked 5 times a
/// second for as long as the computenode runs).
const PREFETCH_BACKOFF: std::time::Duration = std::time::Duration::from_millis(200);
const MAX_PREFETCH_BACKOFF: std::time::Duration = std::time::Duration::from_secs(10);

fn refill(weak: std::sync::Weak<PrefetchingChunks>) {
    let mut backoff = PREFETCH_BACKOFF;
    let log = racekv_telemetry::ratelimit::RateLimit::new(10_000);
    loop {
        let Some(me) = weak.upgrade() else { return };
        {
            let mut st = me.state.lock();
            while st.ready.len() >= me.target && !st.stopping {
                me.wanted.wait_for(&mut st, std::time::Duration::from_secs(1));
                if Arc::strong_count(&me) == 1 {
                    return; // nobody else holds the source anymore
                }
            }
            if st.stopping {
                return;
            }
        }
        match me.rpc.chunk(me.chunk_bytes) {
            Ok(chunk) => {
                me.state.lock().ready.push_back(chunk);
                backoff = PREFETCH_BACKOFF;
            }
            Err(e) => {
                racekv_telemetry::ratelimit::limited_warn(&log, || {
                    format!("prefetching a chunk failed: {e}; trying again in {backoff:?}")
                });
                drop(me);
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_PREFETCH_BACKOFF);
            }
        }
    }
}

impl ChunkSource for PrefetchingChunks {
    fn chunk(&self, preferred: u64) -> Result<Chunk, Error> {
        let popped = self.state.lock().ready.pop_front();
        self.wanted.notify_one();
        match popped {
            Some(chunk) => Ok(chunk),
            None => self.rpc.chunk(preferred),
        }
    }

    fn give_back(&self, instance: u64, ranges: &[(u64, u64)]) {
        self.rpc.give_back(instance, ranges);
    }

    fn fragments(&self, most_bytes: u64) -> Option<Fragments> {
        self.rpc.fragments(most_bytes)
    }

    fn forget(&self, instance: u64) {
        let mut st = self.state.lock();
        let before = st.ready.len();
        st.ready.retain(|c| c.instance != instance);
        if st.ready.len() < before {
            tracing::debug!(
                dropped = before - st.ready.len(),
                "dropped prefetched chunks of a memnode run that is gone"
            );
            self.wanted.notify_one();
        }
    }
}

impl Drop for PrefetchingChunks {
    fn drop(&mut self) {
        let ready: Vec<_> = self.state.get_mut().ready.drain(..).collect();
        give_back(&self.rpc, ready);
    }
}
