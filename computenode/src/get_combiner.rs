//! Pipelined GET runs of many Redis connections read together (flat combining).
//!
//! Over tcp a connection thread's run of pipelined GETs costs about five round trips
//! (`Session::get_in_order`), each waking a memnode thread and the connection's own. With
//! fifty connections on a few cores those wake-ups, not the reads, are the work, and fifty
//! threads each on its own round trips crowd the cores. So at most a few threads read at a
//! time (two per core); a run arriving while they all do waits, and the thread whose turn
//! ends hands it to the first run waiting, whose thread reads every run then waiting (up
//! to [`MAX_GATHERED_KEYS`] keys) as one run on its own session, in about the round trips
//! of one, and hands each connection its values. A waiting thread wakes once.
//!
//! One run made of several connections' runs, read in order, reads every connection's keys
//! in its own order, each after the one before it, and all of them after the connection
//! asked and before it is answered: what the connection's own read promises (the values
//! consecutive GETs would return). What reads a gathered run is
//! [`Session::get_in_order_grouped`], which takes each memnode's keys in one read or gives
//! up; where it gives up (an absent key off the last memnode, a stale witness) or fails,
//! every connection reads its own run again, so none pays for another's run read a run at
//! a time, and each gets its own errors. Where gathered reads keep giving up (a cache
//! whose GETs often miss), gathering pauses for a while ([`PAUSE_RUNS`]) rather than make
//! every run wait for a read it will do again.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::{Condvar, Mutex};
use prometheus::{Histogram, IntCounter, IntCounterVec};
use racekv_client::{ClientError, Session};
use racekv_telemetry::metric;

use crate::cluster::WorkerShards;

/// The most keys one gathered run holds (a run is at most a pipeline's GETs, so the waiting
/// runs beyond it wait for the next reader).
pub const MAX_GATHERED_KEYS: usize = 128;

/// Gathered reads in flight at once, per core: on 2 cores over tcp, 1 in flight left a third
/// of the CPU idle (every run waited for one thread's round trips) and 8 brought back the
/// crowd of threads each on its own round trips; 4 did best (docs/benchmarks.md).
const READERS_PER_CORE: usize = 2;

/// Gathered reads that gave up in a row before gathering pauses...
const GIVE_UPS_BEFORE_PAUSE: u32 = 4;

/// ...for this many runs, each read on its own (then a gathered read is tried again).
pub const PAUSE_RUNS: u32 = 1024;

/// Values of keys, in the keys' order (None: absent).
type Values = Vec<Option<Vec<u8>>>;

struct Metrics {
    /// Gathered runs read, by outcome.
    reads: IntCounterVec,
    /// Connections' runs per gathered read.
    runs_per_read: Histogram,
    /// Runs read on their own while gathering paused.
    paused_runs: IntCounter,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    reads: metric::counter_vec(
        "racekv_computenode_gathered_get_reads_total",
        "Reads of pipelined GET runs gathered from several Redis connections, by outcome: read, \
         or each connection read its own run again (not_grouped: absent keys or a stale witness; failed)",
        &["outcome"],
        &[&["read", "not_grouped", "failed"]],
    ),
    runs_per_read: metric::histogram(
        "racekv_computenode_gathered_get_runs",
        "Redis connections' GET runs per gathered read",
        &[2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0],
    ),
    paused_runs: metric::counter(
        "racekv_computenode_gathered_get_paused_runs_total",
        "GET runs read on their own because gathered reads kept giving up (absent keys)",
    ),
});

/// Where the Redis connections' GET runs meet (one per computenode).
pub struct GetCombiner {
    inbox: Mutex<Inbox>,
    max_readers: usize,
    /// Gathered reads that gave up since the last one that did not.
    give_ups_in_a_row: AtomicU32,
    /// Runs still to read on their own before gathering resumes.
    paused_runs_left: AtomicU32,
    /// Runs read on their own while paused, ever.
    paused_runs: AtomicU64,
}

impl Default for GetCombiner {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_readers(READERS_PER_CORE * cores)
    }
}

#[derive(Default)]
struct Inbox {
    /// Threads whose turn it is (reading their run, gathered or alone); at `max_readers`
    /// the runs arriving wait in `waiting` for a turn to end.
    readers: usize,
    waiting: VecDeque<Arc<Waiter>>,
}

/// A connection's run waiting for the reader.
struct Waiter {
    /// The run's keys, back to back, and where each ends.
    key_bytes: Vec<u8>,
    key_ends: Vec<usize>,
    turn: Mutex<Turn>,
    changed: Condvar,
}

enum Turn {
    Waiting,
    /// This thread reads next: the ones still waiting and itself.
    Read,
    /// Read by another thread: the values, or None to read its own run.
    Done(Option<Values>),
}

impl Waiter {
    fn new(keys: &[&[u8]]) -> Self {
        let mut key_bytes = Vec::with_capacity(keys.iter().map(|k| k.len()).sum());
        let mut key_ends = Vec::with_capacity(keys.len());
        for key in keys {
            key_bytes.extend_from_slice(key);
            key_ends.push(key_bytes.len());
        }
        Self { key_bytes, key_ends, turn: Mutex::new(Turn::Waiting), changed: Condvar::new() }
    }

    fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.key_ends.iter().copied());
        starts.zip(&self.key_ends).map(|(start, &end)| &self.key_bytes[start..end])
    }

    fn set(&self, turn: Turn) {
        *self.turn.lock() = turn;
        self.changed.notify_one();
    }

    /// Blocks until this run is read or it is this thread's turn to read.
    fn wait(&self) -> Turn {
        let mut turn = self.turn.lock();
        while matches!(*turn, Turn::Waiting) {
            self.changed.wait(&mut turn);
        }
        std::mem::replace(&mut *turn, Turn::Waiting)
    }
}

impl GetCombiner {
    /// A combiner letting at most `max_readers` threads read at once (at least 1).
    pub fn with_readers(max_readers: usize) -> Self {
        // Its series exist from the start, whether or not runs meet.
        LazyLock::force(&METRICS);
        Self {
            inbox: Mutex::new(Inbox::default()),
            max_readers: max_readers.max(1),
            give_ups_in_a_row: AtomicU32::new(0),
            paused_runs_left: AtomicU32::new(0),
            paused_runs: AtomicU64::new(0),
        }
    }

    /// Runs this combiner had read on their own while gathering paused.
    pub fn paused_runs(&self) -> u64 {
        self.paused_runs.load(Ordering::Relaxed)
    }

    /// Values of `keys` as consecutive GETs would return them, read together with other
    /// connections' runs that arrive meanwhile (module doc).
    pub fn get_in_order(&self, session: &mut Session<WorkerShards>, keys: &[&[u8]]) -> Result<Values, ClientError> {
        if keys.len() > MAX_GATHERED_KEYS {
            return session.get_in_order(keys);
        }
        let paused = self.paused_runs_left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if paused.is_ok() {
            METRICS.paused_runs.inc();
            self.paused_runs.fetch_add(1, Ordering::Relaxed);
            return session.get_in_order(keys);
        }
        let waiting = {
            let mut inbox = self.inbox.lock();
            if inbox.readers >= self.max_readers {
                let me = Arc::new(Waiter::new(keys));
                inbox.waiting.push_back(Arc::clone(&me));
                Some(me)
            } else {
                inbox.readers += 1;
                None
            }
        };
        if let Some(me) = waiting {
            match me.wait() {
                Turn::Done(Some(values)) => return Ok(values),
                Turn::Done(None) => return session.get_in_order(keys),
                Turn::Read => {}
                Turn::Waiting => unreachable!("wait returns once the turn changed"),
            }
        }
        self.read_gathered(session, keys)
    }

    /// This thread's turn: reads its run with every run waiting (as many as fit), hands
    /// them their values and the next turn to the first still waiting.
    fn read_gathered(&self, session: &mut Session<WorkerShards>, keys: &[&[u8]]) -> Result<Values, ClientError> {
        let mut handoff = Handoff { combiner: self, others: Vec::new() };
        {
            let mut inbox = self.inbox.lock();
            let mut gathered = keys.len();
            while let Some(next) = inbox.waiting.front() {
                if gathered + next.key_ends.len() > MAX_GATHERED_KEYS {
                    break;
                }
                gathered += next.key_ends.len();
                handoff.others.push(inbox.waiting.pop_front().expect("front exists"));
            }
        }
        if handoff.others.is_empty() {
            // Alone, but still this thread's turn: runs arriving meanwhile wait and are
            // read together next.
            let values = session.get_in_order(keys);
            drop(handoff);
            return values;
        }
        let mut all: Vec<&[u8]> = keys.to_vec();
        for other in &handoff.others {
            all.extend(other.keys());
        }
        METRICS.runs_per_read.observe((1 + handoff.others.len()) as f64);
        let read = session.get_in_order_grouped(&all);
        self.note_outcome(match &read {
            Ok(Some(_)) => Outcome::Read,
            Ok(None) => Outcome::NotGrouped,
            Err(_) => Outcome::Failed,
        });
        let Ok(Some(mut values)) = read else {
            drop(handoff); // each reads its own run again
            return session.get_in_order(keys);
        };
        assert_eq!(values.len(), all.len(), "a gathered read returned {} values for {} keys", values.len(), all.len());
        // Back to front: each waiter's values are the tail left after the ones behind it.
        for other in handoff.others.drain(..).rev() {
            let theirs = values.split_off(values.len() - other.key_ends.len());
            other.set(Turn::Done(Some(theirs)));
        }
        drop(handoff);
        Ok(values)
    }

    /// Counts `outcome`; pauses gathering after [`GIVE_UPS_BEFORE_PAUSE`] gathered reads in
    /// a row gave up.
    fn note_outcome(&self, outcome: Outcome) {
        let label = match outcome {
            Outcome::Read => "read",
            Outcome::NotGrouped => "not_grouped",
            Outcome::Failed => "failed",
        };
        METRICS.reads.with_label_values(&[label]).inc();
        match outcome {
            Outcome::Read => self.give_ups_in_a_row.store(0, Ordering::Relaxed),
            Outcome::NotGrouped => {
                if self.give_ups_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 >= GIVE_UPS_BEFORE_PAUSE {
                    self.give_ups_in_a_row.store(0, Ordering::Relaxed);
                    self.paused_runs_left.store(PAUSE_RUNS, Ordering::Relaxed);
                }
            }
            // A failure (a memnode unreachable) says nothing about how runs would gather.
            Outcome::Failed => {}
        }
    }
}

/// How a gathered read ended (the metric's `outcome`).
#[derive(Clone, Copy)]
enum Outcome {
    Read,
    /// `get_in_order_grouped` gave up: each run is read on its own.
    NotGrouped,
    /// It failed: each run is read on its own, for its own error.
    Failed,
}

/// Ends a turn, on every path (a panic included): the runs taken but not answered read
/// their own, and the next waiting run (if any) reads next.
struct Handoff<'a> {
    combiner: &'a GetCombiner,
    others: Vec<Arc<Waiter>>,
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        for other in self.others.drain(..) {
            other.set(Turn::Done(None));
        }
        let mut inbox = self.combiner.inbox.lock();
        match inbox.waiting.pop_front() {
            Some(next) => next.set(Turn::Read),
            None => inbox.readers -= 1,
        }
    }
}
