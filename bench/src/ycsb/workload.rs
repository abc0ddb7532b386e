//! YCSB's core workloads (operation mixes and key choice), per-thread operation choosers,
//! and what each driver measures of the operations it ran.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use clap::ValueEnum;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::generator::{ScrambledZipfian, SkewedLatest};

/// The longest scan (YCSB's `maxscanlength`; lengths are uniform in 1..=this).
pub const MAX_SCAN_LENGTH: u32 = 100;

/// One of YCSB's core workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize)]
pub enum Workload {
    /// Update heavy: 50% reads, 50% updates.
    #[value(name = "a")]
    A,
    /// Read mostly: 95% reads, 5% updates.
    #[value(name = "b")]
    B,
    /// Read only.
    #[value(name = "c")]
    C,
    /// Read latest: 95% reads of mostly recent keys, 5% inserts.
    #[value(name = "d")]
    D,
    /// Short ranges: 95% scans of 1-100 keys, 5% inserts.
    #[value(name = "e")]
    E,
    /// Read-modify-write: 50% reads, 50% read-then-write of the same key.
    #[value(name = "f")]
    F,
    /// The load phase: inserts of keys 0, 1, 2, ... (not one of the run workloads).
    #[value(skip)]
    Load,
}

/// How a workload's keys are chosen (workload D always reads by the latest distribution).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// YCSB's scrambled zipfian, constant 0.99.
    Zipfian,
    /// Every loaded key equally likely.
    Uniform,
}

/// An operation of a workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// GET of an existing key.
    Read,
    /// SET of an existing key.
    Update,
    /// SET of a new key.
    Insert,
    /// SCAN of 1-100 keys.
    Scan,
    /// GET, then SET of the same key (timed from the GET's send to the SET's reply).
    ReadModifyWrite,
}

/// Every operation, in the order [`Op::index`] gives.
pub const OPS: [Op; 5] = [Op::Read, Op::Update, Op::Insert, Op::Scan, Op::ReadModifyWrite];

impl Op {
    /// Its position in [`OPS`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Workload {
    /// The operation mix: (operation, proportion), proportions adding up to 1.
    pub fn mix(self) -> &'static [(Op, f64)] {
        match self {
            Self::A => &[(Op::Read, 0.5), (Op::Update, 0.5)],
            Self::B => &[(Op::Read, 0.95), (Op::Update, 0.05)],
            Self::C => &[(Op::Read, 1.0)],
            Self::D => &[(Op::Read, 0.95), (Op::Insert, 0.05)],
            Self::E => &[(Op::Scan, 0.95), (Op::Insert, 0.05)],
            Self::F => &[(Op::Read, 0.5), (Op::ReadModifyWrite, 0.5)],
            Self::Load => &[(Op::Insert, 1.0)],
        }
    }

    /// The fraction of operations that insert.
    pub fn insert_fraction(self) -> f64 {
        self.mix().iter().filter(|(op, _)| *op == Op::Insert).map(|(_, p)| p).sum()
    }

    /// Its name as in the report (`A` .. `F`, `load`).
    pub fn name(self) -> &'static str {
        match self {
            Self::A => "A",
            Self::B => "B",
            Self::C => "C",
            Self::D => "D",
            Self::E => "E",
            Self::F => "F",
            Self::Load => "load",
        }
    }
}

/// Most inserts that may be in flight past the oldest unfinished one ([`KeySpace`]'s
/// window; the drivers keep at most threads x connections x pipeline in flight).
const ACK_WINDOW: u64 = 1 << 16;

/// The keys of one store: those loaded, and those inserted since, by every driver that
/// writes to it (YCSB's insert key sequence and its acknowledged counter).
#[derive(Debug)]
pub struct KeySpace {
    /// Keys loaded: key numbers `0..records`.
    records: u64,
    /// Inserts handed out: the next insert is key number `records + issued`.
    issued: AtomicU64,
    /// Inserts `0..acked` (counted from `records`) all finished. Reads choose among
    /// `0..records + acked`, so never a key whose insert is still in flight: a read that
    /// finds no key is then the store's fault, not the driver's.
    acked: AtomicU64,
    /// Finished inserts past `acked`, by insert number modulo [`ACK_WINDOW`].
    finished: Box<[AtomicBool]>,
    /// Held by whoever moves `acked` up over the finished inserts.
    advancing: Mutex<()>,
}

impl KeySpace {
    /// `records` keys loaded, none inserted since.
    pub fn new(records: u64) -> Self {
        Self {
            records,
            issued: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            finished: (0..ACK_WINDOW).map(|_| AtomicBool::new(false)).collect(),
            advancing: Mutex::new(()),
        }
    }

    /// Keys that exist now (loaded, and inserted with every insert before them finished).
    pub fn len(&self) -> u64 {
        self.records + self.acked.load(Ordering::Acquire)
    }

    /// Whether no key exists yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key number of a new insert.
    pub fn next_insert(&self) -> u64 {
        self.records + self.issued.fetch_add(1, Ordering::Relaxed)
    }

    /// The insert of key number `key` (from [`Self::next_insert`]) finished: acknowledged,
    /// or failed (its error is counted; reads may then find it absent).
    pub fn insert_done(&self, key: u64) {
        let n = key.checked_sub(self.records).expect("an insert's key comes after the loaded ones");
        assert!(n < self.issued.load(Ordering::Relaxed), "insert {n} was never handed out");
        let acked = self.acked.load(Ordering::Acquire);
        debug_assert!(n >= acked, "insert {n} finished twice");
        if n < acked || n - acked >= ACK_WINDOW {
            // Past the window (an insert before it never finished: its run failed): left
            // uncounted, so reads stay below it, as they must.
            return;
        }
        self.finished[(n % ACK_WINDOW) as usize].store(true, Ordering::Release);
        // Whoever holds the lock moves `acked` up; a flag set meanwhile waits for the next
        // insert to finish (as YCSB's AcknowledgedCounterGenerator does).
        if let Ok(_advancing) = self.advancing.try_lock() {
            let mut acked = self.acked.load(Ordering::Acquire);
            while self.finished[(acked % ACK_WINDOW) as usize].swap(false, Ordering::AcqRel) {
                acked += 1;
            }
            self.acked.store(acked, Ordering::Release);
        }
    }
}

/// The next operation a client runs.
#[derive(Debug, Clone, Copy)]
pub struct Next {
    /// What it is.
    pub op: Op,
    /// Its key number (the scan's start is chosen by the driver: see the module doc of
    /// `ycsb`).
    pub key: u64,
    /// Keys a scan asks for.
    pub scan_length: u32,
}

enum KeyChooser {
    Zipfian(ScrambledZipfian),
    Uniform,
    Latest(SkewedLatest),
}

/// One client thread's operation stream for one workload run.
pub struct Chooser {
    workload: Workload,
    keys: KeyChooser,
    rng: SmallRng,
}

impl Chooser {
    /// For `workload` over `space`, choosing keys by `distribution`, expecting about
    /// `ops` operations in this run (the zipfian's range leaves room for the run's inserts
    /// as YCSB's does: twice those expected).
    pub fn new(workload: Workload, distribution: Distribution, space: &KeySpace, ops: u64, seed: u64) -> Self {
        let expected_new = (ops as f64 * workload.insert_fraction() * 2.0) as u64;
        let keys = match (workload, distribution) {
            (Workload::D, _) => KeyChooser::Latest(SkewedLatest::new(space.len())),
            (_, Distribution::Zipfian) => KeyChooser::Zipfian(ScrambledZipfian::new(space.len() + expected_new)),
            (_, Distribution::Uniform) => KeyChooser::Uniform,
        };
        Self { workload, keys, rng: SmallRng::seed_from_u64(seed) }
    }

    /// A random number for the driver's own choices (scan starts).
    pub fn random(&mut self) -> u64 {
        self.rng.random()
    }

    /// The next operation.
    pub fn next(&mut self, space: &KeySpace) -> Next {
        let mix = self.workload.mix();
        let mut p: f64 = self.rng.random();
        let mut op = mix[mix.len() - 1].0;
        for &(candidate, share) in mix {
            if p < share {
                op = candidate;
                break;
            }
            p -= share;
        }
        let key = if op == Op::Insert { space.next_insert() } else { self.existing_key(space) };
        let scan_length = if op == Op::Scan { self.rng.random_range(1..=MAX_SCAN_LENGTH) } else { 0 };
        Next { op, key, scan_length }
    }

    /// A key number that exists (YCSB's `nextKeynum`: draws past the last acknowledged
    /// insert are drawn again).
    fn existing_key(&mut self, space: &KeySpace) -> u64 {
        let existing = space.len().max(1);
        match &mut self.keys {
            KeyChooser::Uniform => self.rng.random_range(0..space.records.max(1)),
            KeyChooser::Latest(latest) => latest.next(existing, &mut self.rng),
            KeyChooser::Zipfian(zipfian) => loop {
                let k = zipfian.next(&mut self.rng);
                if k < existing {
                    break k;
                }
            },
        }
    }
}

/// What one client thread (or, merged, one run) measured.
pub struct Measured {
    /// Latency of each operation kind (nanoseconds), indexed by [`Op::index`].
    pub latency: Vec<Histogram<u64>>,
    /// Latency of every operation together.
    pub all: Histogram<u64>,
    /// Error replies (or errors of the library).
    pub errors: u64,
    /// Replies of a type the command does not answer with.
    pub unexpected: u64,
    /// Reads that found no value.
    pub not_found: u64,
    /// Keys the scans returned.
    pub scan_keys: u64,
    /// SCAN calls the scans made.
    pub scan_calls: u64,
    /// The first error's text.
    pub first_error: Option<String>,
}

impl Measured {
    /// Nothing measured yet.
    pub fn new() -> Self {
        let histogram = || Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("static bounds");
        Self {
            latency: OPS.iter().map(|_| histogram()).collect(),
            all: histogram(),
            errors: 0,
            unexpected: 0,
            not_found: 0,
            scan_keys: 0,
            scan_calls: 0,
            first_error: None,
        }
    }

    /// One operation of `op` that took `ns`.
    pub fn record(&mut self, op: Op, ns: u64) {
        self.record_n(op, ns, 1);
    }

    /// `count` operations of `op` that each took `ns` nanoseconds (a batch's).
    pub fn record_n(&mut self, op: Op, ns: u64, count: u64) {
        let ns = ns.clamp(1, 60_000_000_000);
        self.latency[op.index()].record_n(ns, count).expect("within bounds");
        self.all.record_n(ns, count).expect("within bounds");
    }

    /// An error, with its text.
    pub fn error(&mut self, text: impl FnOnce() -> String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(text());
        }
    }

    /// Adds another's measurements.
    pub fn merge(&mut self, other: &Self) {
        for (mine, theirs) in self.latency.iter_mut().zip(&other.latency) {
            mine.add(theirs).expect("same bounds");
        }
        self.all.add(&other.all).expect("same bounds");
        self.errors += other.errors;
        self.unexpected += other.unexpected;
        self.not_found += other.not_found;
        self.scan_keys += other.scan_keys;
        self.scan_calls += other.scan_calls;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
    }

    /// Operations recorded.
    pub fn ops(&self) -> u64 {
        self.all.len()
    }
}

impl Default for Measured {
    fn default() -> Self {
        Self::new()
    }
}

/// Splits `total` operations over `parts` (the first ones take the remainder).
pub fn share(total: u64, parts: usize, index: usize) -> u64 {
    let parts = parts.max(1) as u64;
    total / parts + u64::from((index as u64) < total % parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_add_up_and_ops_come_in_proportion() {
        for w in [Workload::A, Workload::B, Workload::C, Workload::D, Workload::E, Workload::F, Workload::Load] {
            let total: f64 = w.mix().iter().map(|m| m.1).sum();
            assert!((total - 1.0).abs() < 1e-9, "{w:?}");
        }
        let space = KeySpace::new(1000);
        let mut c = Chooser::new(Workload::E, Distribution::Zipfian, &space, 10_000, 1);
        let mut scans = 0;
        for _ in 0..10_000 {
            let n = c.next(&space);
            match n.op {
                Op::Scan => {
                    scans += 1;
                    assert!((1..=MAX_SCAN_LENGTH).contains(&n.scan_length));
                    assert!(n.key < space.len(), "a scan started past the keys acknowledged");
                }
                Op::Insert => {
                    assert!(n.key >= 1000);
                    space.insert_done(n.key);
                }
                other => panic!("E ran {other:?}"),
            }
        }
        assert!((9300..9700).contains(&scans), "{scans} scans of 10000");
    }

    #[test]
    fn reads_never_choose_an_unacknowledged_insert() {
        let space = KeySpace::new(100);
        let mut c = Chooser::new(Workload::D, Distribution::Zipfian, &space, 1000, 2);
        for _ in 0..5_000 {
            let n = c.next(&space);
            if n.op == Op::Read {
                assert!(n.key < space.len());
            }
        }
        // Inserts were never acknowledged: reads stayed among the loaded keys.
        assert_eq!(space.len(), 100);
    }

    #[test]
    fn reads_choose_only_keys_whose_inserts_and_every_earlier_one_finished() {
        let space = KeySpace::new(10);
        let [a, b, c] = [space.next_insert(), space.next_insert(), space.next_insert()];
        assert_eq!([a, b, c], [10, 11, 12]);
        space.insert_done(b);
        assert_eq!(space.len(), 10, "insert 10 is still in flight");
        space.insert_done(a);
        assert_eq!(space.len(), 12);
        space.insert_done(c);
        assert_eq!(space.len(), 13);
    }

    #[test]
    fn inserts_finishing_out_of_order_on_many_threads_all_count() {
        let space = KeySpace::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let mut in_flight = Vec::new();
                    for i in 0..20_000u64 {
                        in_flight.push(space.next_insert());
                        if i % 8 == 7 {
                            in_flight.reverse();
                            in_flight.drain(..).for_each(|key| space.insert_done(key));
                        }
                    }
                    in_flight.into_iter().for_each(|key| space.insert_done(key));
                });
            }
        });
        // A flag set while another thread advanced waits for a later insert: one more
        // finishes them all.
        let last = space.next_insert();
        space.insert_done(last);
        assert_eq!(space.len(), 80_001);
    }

    #[test]
    fn shares_add_up() {
        assert_eq!((0..3).map(|i| share(10, 3, i)).collect::<Vec<_>>(), [4, 3, 3]);
        assert_eq!((0..4).map(|i| share(2, 4, i)).sum::<u64>(), 2);
    }
}
