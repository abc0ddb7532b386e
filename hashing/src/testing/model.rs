//! A model-based check of the table, in the manner of redb's `fuzz_redb`: sequences of
//! operations (gets, puts of every mode and expiry, deletes, compare-and-swaps, expiry
//! updates, FLUSHALL) run on a few clients of a small-subtable table, so splits happen
//! during the run, and every result is compared with a `HashMap` model.
//!
//! Faults: each step may have its client's [`FaultyConnection`] lose one request. An
//! operation that then fails may or may not have taken effect (the lost request, or an
//! earlier one of the same operation, may have swung a slot), so its key is read at once on
//! a clean connection and must hold either its old or its new state, which the model then
//! takes. One whose very first request was lost before it ran must have had no effect.
//! An operation that succeeds despite a fault (a lost request it could do without) must
//! give the exact result.
//!
//! Whole-table checks ([`Driver::check`]): every model key reads back exactly; a raw scan of
//! the region finds each key once, the live ones exactly the model's; and the memnode's
//! live extent bytes are exactly the extents the table references (expired items still in
//! place included), or, when faults were injected, at most the extents of the values the
//! faulted operations touched more (a lost retire leaks its extent until the next start).
//!
//! Steps come from bytes ([`decode`], for cargo-fuzz) or from proptest strategies (the
//! crate's `tests/model.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{scan, Fault, FaultyConnection, TestMemnode, Via};
use crate::layout::{block_units_for, extent_bytes, MAX_INLINE_KEY_BYTES, MAX_KV_BYTES};
use crate::{
    Error, Expiry, ExpiryUpdate, PutMode, PutOptions, PutOutcome, PutResult, Table, TableClient, TableOptions,
};
use racekv_transport::{Connection, TransportError};

/// A key's state: its value and expiry (None: never), or None for absent (or expired).
pub type State = Option<(Vec<u8>, Option<u64>)>;

/// The model: each present key's value and expiry.
pub type Model = HashMap<Vec<u8>, (Vec<u8>, Option<u64>)>;

/// The region of a model run: sparse, so its size costs only what the values touch.
pub const REGION_BYTES: u64 = 256 << 20;

/// A value a step writes; its bytes come from `seed`, so values of one length differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueSpec {
    /// Inline in its block.
    Small {
        /// Length in bytes.
        len: u16,
        /// Varies the bytes.
        seed: u8,
    },
    /// `delta` bytes from the largest value a block holds for its key without an expiry:
    /// either side of the extent threshold (with an expiry, 8 bytes less fit).
    Edge {
        /// Bytes more (or, negative, fewer) than the largest inline value.
        delta: i8,
        /// Varies the bytes.
        seed: u8,
    },
    /// In an extent.
    Large {
        /// Length in bytes.
        len: u32,
        /// Varies the bytes.
        seed: u8,
    },
}

impl ValueSpec {
    /// Its length as a value of `key`.
    pub fn len(self, key: &[u8]) -> usize {
        match self {
            ValueSpec::Small { len, .. } => usize::from(len),
            ValueSpec::Edge { delta, .. } => (MAX_KV_BYTES - key.len()).saturating_add_signed(isize::from(delta)),
            ValueSpec::Large { len, .. } => len as usize,
        }
    }

    /// Its bytes as a value of `key`: [`ValueSpec::len`] of them, derived from the seed.
    pub fn bytes(self, key: &[u8]) -> Vec<u8> {
        let (ValueSpec::Small { seed, .. } | ValueSpec::Edge { seed, .. } | ValueSpec::Large { seed, .. }) = self;
        (0..self.len(key))
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).rotate_left(u32::from(seed % 7)))
            .collect()
    }
}

/// An expiry time relative to the run's start: long past, or an hour or more ahead (so no
/// item expires during a run, and none is near its expiry when read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Long before the run started (the item is expired when written).
    Past,
    /// An hour and this many seconds after the run started.
    Future(u8),
}

/// The expiry a put writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpirySpec {
    /// The key never expires.
    Never,
    /// The key expires at that time.
    At(When),
    /// The key keeps the expiry it has (`KEEPTTL`).
    Keep,
}

/// What a compare-and-swap expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The key's value per the model (so it applies).
    Current,
    /// The key is absent.
    Absent,
    /// The key holds this value (which is not the current one, so it does not apply).
    Other(ValueSpec),
}

/// One operation; keys are indices into the run's key set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Read one key.
    Get(u16),
    /// Read several keys in one call.
    GetMany(Vec<u16>),
    /// Write a key.
    Put {
        /// The key's index.
        key: u16,
        /// The value written.
        value: ValueSpec,
        /// Whether the key must be absent, present, or either.
        mode: PutMode,
        /// The expiry written.
        expiry: ExpirySpec,
        /// Ask for the value the key had before.
        return_old: bool,
    },
    /// Delete one key.
    Delete(u16),
    /// Compare-and-swap one key's value.
    Cas {
        /// The key's index.
        key: u16,
        /// What the key must hold for the swap to apply.
        expected: Expect,
        /// The new value (None: delete the key).
        new: Option<ValueSpec>,
    },
    /// `update_expiry` to a time; a past one deletes (`ExpiryUpdate::Delete`) or, with
    /// `write_expired`, writes an expired item that stays in place until removed.
    ExpireAt {
        /// The key's index.
        key: u16,
        /// The new expiry time.
        when: When,
        /// With a past time, write an expired item rather than delete the key.
        write_expired: bool,
    },
    /// `update_expiry` to never.
    Persist(u16),
    /// `delete_all` (a per-key check only, where clients run concurrently).
    DeleteAll,
    /// A whole-table check (a per-key check only, where clients run concurrently).
    Check,
}

/// An operation, the client that runs it, and the fault its connection injects into it:
/// `(skip, fault)` lets `skip` requests of the operation through and loses the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Index of the client that runs it.
    pub client: u8,
    /// The operation.
    pub op: Op,
    /// The fault injected into it, if any: (requests let through, fault).
    pub fault: Option<(u8, Fault)>,
}

/// The table a run drives.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Where the table lives: in this process or behind a transport.
    pub via: Via,
    /// Clients running steps.
    pub clients: u8,
    /// Bucket groups per subtable (small, so that the table splits).
    pub groups_per_subtable: u32,
    /// Keys in the run's key set.
    pub keys: u16,
    /// A whole-table check after every this many steps (0: only at the end).
    pub check_every: usize,
}

/// Table options of model runs: a short grace period, so freed blocks are reused soon.
pub fn table_options() -> TableOptions {
    TableOptions { grace_period: Duration::from_millis(1), op_timeout: Duration::from_secs(5) }
}

/// Runs `steps` on a fresh memnode as `config` says, checking each against the model and
/// the whole table every `check_every` steps and at the end. Panics on any difference.
pub fn run(config: &Config, steps: &[Step]) {
    let memnode = TestMemnode::start(config.via, REGION_BYTES, config.groups_per_subtable);
    let table = memnode.table(table_options());
    let mut driver = Driver::new(&memnode, &table, "", config.keys, config.clients, false);
    for (i, step) in steps.iter().enumerate() {
        driver.apply(step);
        if config.check_every > 0 && (i + 1) % config.check_every == 0 {
            driver.check();
        }
    }
    driver.check();
}

/// Runs one sequence per thread, each thread with its own client and its own keys, all at
/// once on one table; then checks the whole table against the union of their models.
pub fn run_concurrent(via: Via, groups_per_subtable: u32, keys: u16, sequences: &[Vec<Step>]) {
    let memnode = TestMemnode::start(via, REGION_BYTES, groups_per_subtable);
    let table = memnode.table(table_options());
    let results: Vec<(Model, u64, bool)> = std::thread::scope(|s| {
        let threads: Vec<_> = sequences
            .iter()
            .enumerate()
            .map(|(t, steps)| {
                let (memnode, table) = (&memnode, &table);
                s.spawn(move || {
                    let mut driver = Driver::new(memnode, table, &format!("t{t}/"), keys, 1, true);
                    for step in steps {
                        driver.apply(step);
                    }
                    driver.check_keys();
                    (driver.model, driver.leak_budget, driver.faulted)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("a thread's sequence failed")).collect()
    });
    let mut model = HashMap::new();
    let (mut budget, mut faulted) = (0, false);
    for (m, b, f) in results {
        model.extend(m);
        budget += b;
        faulted |= f;
    }
    let mut oracle = table.client(memnode.connect());
    check_table(&memnode, &mut oracle, &model, faulted.then_some(budget));
}

/// Runs steps on some clients of one table and keeps the model of their keys.
pub struct Driver<'a> {
    memnode: &'a TestMemnode,
    clients: Vec<(TableClient, Arc<FaultyConnection>)>,
    /// Reads on a connection that loses nothing: resolving uncertain keys, checks.
    oracle: TableClient,
    /// What the keys should hold.
    pub model: Model,
    /// Extent bytes of expired large items a write may have left in place, by key: a
    /// faulted operation on the key may leak them (see `leak_budget`).
    ghosts: HashMap<Vec<u8>, u64>,
    prefix: String,
    keys: u16,
    /// Other drivers run on the table at the same time (no whole-table steps).
    concurrent: bool,
    started_ms: u64,
    /// Extent bytes faulted operations may have leaked: those of every value they touched.
    pub leak_budget: u64,
    /// Whether any fault was injected (no leaks are allowed otherwise).
    pub faulted: bool,
    steps: usize,
}

impl<'a> Driver<'a> {
    /// A driver of `keys` keys named with `prefix` on `table` (served by `memnode`) through `clients` clients;
    /// `concurrent` when other drivers share the table.
    pub fn new(
        memnode: &'a TestMemnode,
        table: &Table,
        prefix: &str,
        keys: u16,
        clients: u8,
        concurrent: bool,
    ) -> Self {
        let clients = (0..clients.max(1))
            .map(|_| {
                let conn = Arc::new(FaultyConnection::new(memnode.connect()));
                (table.client(Arc::clone(&conn) as Arc<dyn Connection>), conn)
            })
            .collect();
        Self {
            memnode,
            clients,
            oracle: table.client(memnode.connect()),
            model: HashMap::new(),
            ghosts: HashMap::new(),
            prefix: prefix.into(),
            keys: keys.max(1),
            concurrent,
            started_ms: crate::clock::now_unix_ms(),
            leak_budget: 0,
            faulted: false,
            steps: 0,
        }
    }

    /// Key `i` (of `keys`): lengths vary a little, so the extent threshold moves with them,
    /// and one in 8 is about as long as a block holds, either side of the long-key threshold
    /// (small values fit a block with it; larger ones put it in an extent of its own).
    pub fn key(&self, i: u16) -> Vec<u8> {
        let i = i % self.keys;
        let pad = match i % 8 {
            0 | 4 => usize::from(i % 23),
            5 => MAX_INLINE_KEY_BYTES - 24 + usize::from(i % 48),
            _ => 0,
        };
        format!("{}key:{i}{}", self.prefix, ".".repeat(pad)).into_bytes()
    }

    fn time(&self, when: When) -> u64 {
        match when {
            When::Past => self.started_ms - 60_000,
            When::Future(n) => self.started_ms + 3_600_000 + u64::from(n) * 1000,
        }
    }

    fn state(&self, key: &[u8]) -> State {
        self.model.get(key).cloned()
    }

    fn set_state(&mut self, key: &[u8], state: State) {
        match state {
            Some(s) => self.model.insert(key.to_vec(), s),
            None => self.model.remove(key),
        };
    }

    /// Runs one step and checks it against the model.
    pub fn apply(&mut self, step: &Step) {
        self.steps += 1;
        let at = self.steps;
        let ctx = format!("step {at} ({step:?}) of {}", self.prefix);
        let c = usize::from(step.client) % self.clients.len();
        let conn = Arc::clone(&self.clients[c].1);
        conn.clear();
        if let Some((skip, fault)) = step.fault {
            conn.schedule(u32::from(skip), fault);
        }
        let injected = conn.injected();
        // Keys the operation touches, their states before, and the states it leads to.
        let (touched, result) = self.run_op(c, &step.op, &ctx);
        let faulted = conn.injected() > injected;
        conn.clear();
        if faulted {
            // A lost request may leak the extent of a value the operation swung away (a lost
            // retire), or of the one it wrote (a lost answer to the allocation, or a write
            // that may be in its slot), whether or not the write applied.
            self.faulted = true;
            let written = match &step.op {
                Op::Put { key, value, .. } | Op::Cas { key, new: Some(value), .. } => {
                    let key = self.key(*key);
                    large_extent(&key, value.len(&key))
                }
                _ => 0,
            };
            self.leak_budget += written;
            for (key, old, new) in &touched {
                let ghost = self.ghosts.get(key).copied().unwrap_or(0);
                self.leak_budget += self.extent_of(key, old) + self.extent_of(key, new) + ghost;
            }
        }
        let lost_first = step.fault == Some((0, Fault::LostBefore));
        match result {
            Ok(()) => {
                for (key, old, new) in touched {
                    self.note_ghost(&key, &old, &new, &step.op);
                    self.set_state(&key, new);
                }
            }
            Err(e) => {
                assert!(faulted, "{ctx}: failed with no fault injected: {e}");
                let injected = matches!(&e, Error::Transport(TransportError::ConnectionLost { reason, .. }) if reason.contains("FaultyConnection"));
                assert!(injected, "{ctx}: failed with another error than the fault injected: {e}");
                // Whatever the operation got done before it failed: old or new, per key.
                for (key, old, new) in touched {
                    let found = self.read(&key, &ctx);
                    if lost_first {
                        assert_eq!(found, old, "{ctx}: its first request was lost before it ran, yet {key:?} changed");
                    } else {
                        assert!(
                            found == old || found == new,
                            "{ctx}: {key:?} is neither its old state {} nor its new {} but {}",
                            show(&old),
                            show(&new),
                            show(&found)
                        );
                    }
                    if found == new {
                        self.note_ghost(&key, &old, &new, &step.op);
                    }
                    self.set_state(&key, found);
                }
            }
        }
    }

    /// Remembers an expired large item a write left in place.
    fn note_ghost(&mut self, key: &[u8], old: &State, new: &State, op: &Op) {
        let expired_write = match op {
            Op::Put { value, expiry: ExpirySpec::At(When::Past), .. } => Some(value.bytes(key).len()),
            Op::ExpireAt { when: When::Past, write_expired: true, .. } => old.as_ref().map(|(v, _)| v.len()),
            _ => None,
        };
        if let (Some(len), None) = (expired_write, new) {
            *self.ghosts.entry(key.to_vec()).or_default() += large_extent(key, len);
        }
    }

    /// The extent bytes of a state's value, if large (either way its expiry may go).
    fn extent_of(&self, key: &[u8], state: &State) -> u64 {
        state.as_ref().map_or(0, |(value, _)| large_extent(key, value.len()))
    }

    /// The key as a clean connection reads it.
    fn read(&mut self, key: &[u8], ctx: &str) -> State {
        match self.oracle.get_item(key) {
            Ok(item) => item.map(|i| (i.value, i.expires_at_ms)),
            Err(e) => panic!("{ctx}: reading {key:?} back failed: {e}"),
        }
    }

    /// Runs `op` on client `c`: the keys it touches (old and new state each) and whether it
    /// succeeded (its result checked against the model).
    #[allow(clippy::type_complexity)]
    fn run_op(&mut self, c: usize, op: &Op, ctx: &str) -> (Vec<(Vec<u8>, State, State)>, Result<(), Error>) {
        match op {
            Op::Get(i) => {
                let key = self.key(*i);
                let old = self.state(&key);
                let client = &mut self.clients[c].0;
                let result = client.get_item(&key).map(|got| {
                    let got = got.map(|i| (i.value, i.expires_at_ms));
                    assert!(got == old, "{ctx}: get found {}, the model has {}", show(&got), show(&old));
                });
                (vec![(key, old.clone(), old)], result)
            }
            Op::GetMany(is) => {
                let keys: Vec<Vec<u8>> = is.iter().map(|&i| self.key(i)).collect();
                let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                let client = &mut self.clients[c].0;
                let result = client.get_many(&refs).map(|got| {
                    for (key, got) in keys.iter().zip(got) {
                        let want = self.model.get(key).map(|(v, _)| v);
                        assert!(
                            got.as_ref() == want,
                            "{ctx}: get_many found {:?} for {key:?}, the model has {:?}",
                            got.map(|v| v.len()),
                            want.map(|v| v.len())
                        );
                    }
                });
                (
                    keys.into_iter()
                        .map(|k| {
                            let s = self.state(&k);
                            (k, s.clone(), s)
                        })
                        .collect(),
                    result,
                )
            }
            &Op::Put { key, value, mode, expiry, return_old } => {
                let key = self.key(key);
                let old = self.state(&key);
                let expires_at = match expiry {
                    ExpirySpec::Never => Expiry::Never,
                    ExpirySpec::At(when) => Expiry::At(self.time(when)),
                    ExpirySpec::Keep => Expiry::Keep,
                };
                let value = value.bytes(&key);
                let applies = match mode {
                    PutMode::Upsert => true,
                    PutMode::InsertOnly => old.is_none(),
                    PutMode::UpdateOnly => old.is_some(),
                };
                let outcome = match (applies, &old) {
                    (false, _) => PutOutcome::NotApplied,
                    (true, None) => PutOutcome::Inserted,
                    (true, Some(_)) => PutOutcome::Updated,
                };
                let new = if !applies {
                    old.clone()
                } else {
                    match expires_at {
                        Expiry::Never => Some((value.clone(), None)),
                        Expiry::At(at) if at < self.started_ms => None,
                        Expiry::At(at) => Some((value.clone(), Some(at))),
                        Expiry::Keep => Some((value.clone(), old.as_ref().and_then(|(_, e)| *e))),
                    }
                };
                let client = &mut self.clients[c].0;
                let options = PutOptions { mode, expiry: expires_at, return_old };
                let result = client.put_opts(&key, &value, options).map(|got| {
                    let want = PutResult { outcome, old: old.as_ref().filter(|_| return_old).map(|(v, _)| v.clone()) };
                    assert!(
                        got == want,
                        "{ctx}: put gave {:?} (old {:?} B), the model says {:?} (old {:?} B)",
                        got.outcome,
                        got.old.as_ref().map(Vec::len),
                        want.outcome,
                        want.old.as_ref().map(Vec::len)
                    );
                });
                (vec![(key, old, new)], result)
            }
            Op::Delete(i) => {
                let key = self.key(*i);
                let old = self.state(&key);
                let client = &mut self.clients[c].0;
                let result = client.delete(&key).map(|got| assert_eq!(got, old.is_some(), "{ctx}: delete's result"));
                (vec![(key, old, None)], result)
            }
            &Op::Cas { key, expected, new } => {
                let key = self.key(key);
                let old = self.state(&key);
                let expected = match expected {
                    Expect::Current => old.as_ref().map(|(v, _)| v.clone()),
                    Expect::Absent => None,
                    Expect::Other(spec) => Some(spec.bytes(&key)),
                };
                let new_value = new.map(|spec| spec.bytes(&key));
                let swaps = old.as_ref().map(|(v, _)| v) == expected.as_ref();
                let new = if swaps {
                    new_value.clone().map(|v| (v, old.as_ref().and_then(|(_, e)| *e)))
                } else {
                    old.clone()
                };
                let client = &mut self.clients[c].0;
                let result = client
                    .compare_and_swap(&key, expected.as_deref(), new_value.as_deref())
                    .map(|got| assert_eq!(got, swaps, "{ctx}: compare_and_swap's result"));
                (vec![(key, old, new)], result)
            }
            &Op::ExpireAt { key, when, write_expired } => {
                let key = self.key(key);
                let old = self.state(&key);
                let at = self.time(when);
                let new = match (&old, when) {
                    (None, _) | (_, When::Past) => None,
                    (Some((v, _)), When::Future(_)) => Some((v.clone(), Some(at))),
                };
                let update = if when == When::Past && !write_expired {
                    ExpiryUpdate::Delete
                } else {
                    ExpiryUpdate::Set(Some(at))
                };
                let client = &mut self.clients[c].0;
                let result = client.update_expiry(&key, |_| update).map(|got| {
                    let got = got.map(|(i, changed)| ((i.value, i.expires_at_ms), changed));
                    assert!(
                        got == old.clone().map(|o| (o, true)),
                        "{ctx}: update_expiry's result {:?}",
                        got.map(|((v, e), ch)| (v.len(), e, ch))
                    );
                });
                (vec![(key, old, new)], result)
            }
            Op::Persist(i) => {
                let key = self.key(*i);
                let old = self.state(&key);
                let new = old.as_ref().map(|(v, _)| (v.clone(), None));
                let client = &mut self.clients[c].0;
                let result = client.update_expiry(&key, |_| ExpiryUpdate::Set(None)).map(|got| {
                    let got = got.map(|(i, changed)| ((i.value, i.expires_at_ms), changed));
                    assert!(
                        got == old.clone().map(|o| (o, true)),
                        "{ctx}: persist's result {:?}",
                        got.map(|((v, e), ch)| (v.len(), e, ch))
                    );
                });
                (vec![(key, old, new)], result)
            }
            Op::DeleteAll if !self.concurrent => {
                let live = self.model.len() as u64;
                let result = self.clients[c].0.delete_all().map(|removed| {
                    assert!(removed >= live, "{ctx}: delete_all emptied {removed} slots, the model has {live} keys");
                });
                // Expired large items still in place (ghosts) are swung away too: a lost
                // answer may leak their extents as well.
                let mut keys: Vec<Vec<u8>> = self.model.keys().chain(self.ghosts.keys()).cloned().collect();
                keys.sort();
                keys.dedup();
                (
                    keys.into_iter()
                        .map(|k| {
                            let s = self.state(&k);
                            (k, s, None)
                        })
                        .collect(),
                    result,
                )
            }
            Op::Check if !self.concurrent => {
                self.check();
                (Vec::new(), Ok(()))
            }
            Op::DeleteAll | Op::Check => {
                self.check_keys();
                (Vec::new(), Ok(()))
            }
        }
    }

    /// Every key of the model reads back exactly, on a clean connection.
    pub fn check_keys(&mut self) {
        let mut keys: Vec<_> = self.model.keys().cloned().collect();
        keys.sort();
        for key in keys {
            let found = self.read(&key, "check");
            let want = self.state(&key);
            assert!(found == want, "check: {key:?} reads {}, the model has {}", show(&found), show(&want));
        }
    }

    /// The whole-table check (not while other drivers run on the table).
    pub fn check(&mut self) {
        assert!(!self.concurrent, "a whole-table check while other clients write");
        check_table(self.memnode, &mut self.oracle, &self.model, self.faulted.then_some(self.leak_budget));
    }
}

/// Checks the table against `model` (see the module doc). `leak_budget`: None where no
/// fault was injected (live extents must be exactly those referenced), else how many
/// extent bytes faulted operations may have leaked.
pub fn check_table(memnode: &TestMemnode, oracle: &mut TableClient, model: &Model, leak_budget: Option<u64>) {
    let mut keys: Vec<_> = model.keys().collect();
    keys.sort();
    for key in keys {
        let found = oracle.get_item(key).unwrap().map(|i| (i.value, i.expires_at_ms));
        let want = model.get(key).cloned();
        assert!(found == want, "check: {key:?} reads {}, the model has {}", show(&found), show(&want));
    }
    let conn = memnode.connect();
    let items = scan(&*conn, &memnode.layout());
    let now = crate::clock::now_unix_ms();
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    let mut referenced = 0;
    let mut live = 0;
    for item in &items {
        assert!(item.admitted, "check: {:?} sits in a bucket that does not admit it", item.key);
        *seen.entry(&item.key[..]).or_default() += 1;
        referenced += extents_of(item.key.len(), item.value.len(), item.expires_at_ms.is_some());
        if item.expires_at_ms.is_some_and(|at| at < now) {
            assert!(!model.contains_key(&item.key), "check: {:?} is in the model but expired in the table", item.key);
            continue;
        }
        live += 1;
        let want = model.get(&item.key);
        let found = (item.value.clone(), item.expires_at_ms);
        assert!(
            want == Some(&found),
            "check: the scan found {:?} as {}, the model has {}",
            item.key,
            show(&Some(found.clone())),
            show(&want.cloned())
        );
    }
    if let Some((key, n)) = seen.iter().find(|(_, &n)| n > 1) {
        panic!("check: the scan found {n} copies of {key:?}");
    }
    assert_eq!(live, model.len(), "check: the scan found {live} live keys, the model has {}", model.len());
    let extents = memnode.extents().live_bytes();
    match leak_budget {
        None => assert_eq!(extents, referenced, "check: live extent bytes vs those the table references"),
        Some(budget) => assert!(
            (referenced..=referenced + budget).contains(&extents),
            "check: {extents} live extent bytes, the table references {referenced}, faults may have leaked {budget}"
        ),
    }
}

/// The extent bytes of a value of `len` bytes for `key`, if it is large with an expiry
/// (8 bytes less fit a block then: an upper bound for either way).
fn large_extent(key: &[u8], len: usize) -> u64 {
    extents_of(key.len(), len, true)
}

/// The extent bytes of an item too large for a block: its value's, and a long key's.
fn extents_of(key_len: usize, value_len: usize, expires: bool) -> u64 {
    if block_units_for(key_len, value_len, expires).is_some() {
        return 0;
    }
    let key = if key_len > MAX_INLINE_KEY_BYTES { extent_bytes(key_len as u64) } else { 0 };
    extent_bytes(value_len as u64) + key
}

/// A state, short: value length and a few bytes, expiry.
fn show(state: &State) -> String {
    match state {
        None => "absent".into(),
        Some((v, e)) => format!("{} B {:02x?}.. expiring {e:?}", v.len(), &v[..v.len().min(6)]),
    }
}

/// Reads bytes for [`decode`]: zeros once they run out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        b
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    fn value(&mut self) -> ValueSpec {
        let kind = self.u8() % 32;
        let seed = self.u8();
        match kind {
            0..=21 => ValueSpec::Small { len: u16::from(self.u8()) * 2, seed },
            22..=25 => ValueSpec::Edge { delta: (self.u8() % 5) as i8 - 2, seed },
            26..=30 => ValueSpec::Large { len: 16_305 + u32::from(self.u16()) * 3, seed },
            _ => ValueSpec::Large { len: (1 << 20) + u32::from(self.u16()) * 16, seed },
        }
    }

    fn when(&mut self) -> When {
        match self.u8() {
            0..=63 => When::Past,
            n => When::Future(n),
        }
    }
}

/// Most steps one input runs (fuzzing wants many short runs).
pub const MAX_STEPS: usize = 512;

/// A run from fuzzer bytes: the table's shape from the first three, then steps until the
/// bytes run out. Every input decodes to something.
pub fn decode(data: &[u8]) -> (Config, Vec<Step>) {
    let mut r = Bytes(data);
    let config = Config {
        via: Via::Local,
        clients: 1 + r.u8() % 3,
        groups_per_subtable: 4 << (r.u8() % 2),
        keys: 32 + u16::from(r.u8()),
        check_every: 64,
    };
    let mut steps = Vec::new();
    while !r.0.is_empty() && steps.len() < MAX_STEPS {
        let tag = r.u8();
        let client = (tag >> 4) & 3;
        let fault = match tag >> 6 {
            2 => Some((r.u8() % 8, Fault::LostBefore)),
            3 => Some((r.u8() % 8, Fault::LostAfter)),
            _ => None,
        };
        let op = match tag & 15 {
            0 | 1 => Op::Get(r.u16()),
            2 => Op::GetMany((0..1 + r.u8() % 8).map(|_| r.u16()).collect()),
            n @ 3..=9 => {
                let key = r.u16();
                let value = r.value();
                let (mode, expiry) = match n {
                    5 => (PutMode::InsertOnly, ExpirySpec::Never),
                    6 => (PutMode::UpdateOnly, ExpirySpec::Never),
                    7 => (PutMode::Upsert, ExpirySpec::At(r.when())),
                    8 => (PutMode::Upsert, ExpirySpec::Keep),
                    _ => (PutMode::Upsert, ExpirySpec::Never),
                };
                Op::Put { key, value, mode, expiry, return_old: n == 9 || r.u8() % 8 == 0 }
            }
            10 => Op::Delete(r.u16()),
            11 | 12 => {
                let key = r.u16();
                let expected = match r.u8() % 4 {
                    0 | 1 => Expect::Current,
                    2 => Expect::Absent,
                    _ => Expect::Other(r.value()),
                };
                let new = (r.u8() % 4 != 0).then(|| r.value());
                Op::Cas { key, expected, new }
            }
            13 => Op::ExpireAt { key: r.u16(), when: r.when(), write_expired: r.u8() % 2 == 0 },
            14 => Op::Persist(r.u16()),
            _ => match r.u8() {
                0..=15 => Op::DeleteAll,
                _ => Op::Check,
            },
        };
        steps.push(Step { client, op, fault });
    }
    (config, steps)
}
