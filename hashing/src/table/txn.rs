//! A multi-key transaction's steps on one memnode; the coordinator that runs them across
//! memnodes, and the protocol's argument, are in `client/src/txn.rs`.
//!
//! * A **record** (a block on the memnode of the first key written, the *home*) holds the
//!   transaction's state and its lease, [`TxnState`] (one CAS of it is the commit point),
//!   and [`RecordLinks`]: the *participant records* on every other memnode it locks keys on.
//!   A participant record (64 B) names the home record; locks name the record on their own
//!   memnode, so each memnode's start reclaim keeps what its own locks need.
//! * A **lock** swings a key's canonical slot, by CAS from the word the transaction read, to
//!   a *locked* word naming an **intent block**: the new value (or a tombstone), and a
//!   [`TxnMark`] saying where the record is, what the slot held before, and when the lease
//!   ends. The block the lock replaced is not retired: an abort puts its word back. (A
//!   replicated single-key write locks and settles with the same steps; its mark names no
//!   record: `client/src/snapshot.rs`.)
//! * **Settling** swings a locked word to its outcome: the same block unlocked (commit), 0
//!   (a committed delete), or the old word (abort), and retires what lost.
//!
//! Everyone else treats a locked slot as in flux: reads and writes wait for it (bounded by
//! the lease); past the lease they fail with [`Error::Locked`], and the session layer,
//! which can reach the record's memnode, resolves it and retries.

use super::{Attempts, BlockState, Cond, Expiry, NewBlock, PutOutcome, Reading, Step, TableClient, Verified};
use crate::error::Error;
use crate::hash::KeyHash;
use crate::layout::{stored_block_checksum, Slot, TxnMark, BLOCK_UNIT_BYTES};
use crate::probe::ProbeReads;
use crate::table::{Item, KeyCopy};
use racekv_transport::overlap;

/// How long a transaction may hold its locks before anyone may abort it, in ms. Far above
/// a commit's few round trips; a reader never waits longer than this for a lock.
pub const TXN_LEASE_MS: u64 = 1_000;
/// How far past a lease a lock must be before a reader acts on it, in ms: hosts' clocks
/// differ (the same allowance the memnode's expiry sweep makes).
pub const TXN_LEASE_SLACK_MS: u64 = crate::clock::MAX_CLOCK_SKEW_MS;

/// Locks settled by someone other than their coordinator, by outcome.
static RESOLUTIONS: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_txn_lock_resolutions_total",
        "Locks of transactions that outlived their lease, settled by another client, by outcome",
        &["outcome"],
        &[&["committed", "aborted"]],
    )
});

/// Locks that went in at the slot their version was read from and had to go back (the key
/// moved or gained a copy below since the read: `lock_in_place`).
static LOCKS_TAKEN_BACK: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(|| {
    racekv_telemetry::metric::counter(
        "racekv_txn_locks_in_place_taken_back_total",
        "Locks placed at the slot their version was read from that went back: the key had moved since the read",
    )
});

/// Counts a lock settled past its lease by someone other than its coordinator.
pub fn count_resolution(committed: bool) {
    RESOLUTIONS.with_label_values(&[if committed { "committed" } else { "aborted" }]).inc();
}

const STATE_SHIFT: u32 = 62;
const DEADLINE_MASK: u64 = (1 << STATE_SHIFT) - 1;

/// A transaction's state, as its record's word holds it (state 2 | deadline ms 62).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnState {
    /// Locks may be held; the coordinator may still commit until the deadline (Unix ms).
    Pending {
        /// The lease's end.
        deadline_ms: u64,
    },
    /// Decided: every intent is the key's value.
    Committed,
    /// Decided: every intent is void, the old words stand.
    Aborted,
}

impl TxnState {
    /// The record word.
    pub fn encode(self) -> u64 {
        match self {
            TxnState::Pending { deadline_ms } => {
                assert!(deadline_ms <= DEADLINE_MASK, "deadline {deadline_ms} past the record word");
                (1 << STATE_SHIFT) | deadline_ms
            }
            TxnState::Committed => 2 << STATE_SHIFT,
            TxnState::Aborted => 3 << STATE_SHIFT,
        }
    }

    /// None for a word no record holds (a record freed and reused under a slow reader).
    pub fn decode(word: u64) -> Option<Self> {
        match word >> STATE_SHIFT {
            1 => Some(TxnState::Pending { deadline_ms: word & DEADLINE_MASK }),
            2 if word & DEADLINE_MASK == 0 => Some(TxnState::Committed),
            3 if word & DEADLINE_MASK == 0 => Some(TxnState::Aborted),
            _ => None,
        }
    }
}

/// The most participant records a home record lists (memnodes besides the home that one
/// transaction locks keys on): what a block of [`crate::layout::MAX_BLOCK_UNITS`] holds.
pub const MAX_TXN_PARTICIPANTS: usize =
    ((crate::layout::MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES) as usize - RECORD_HEADER_BYTES) / RECORD_LINK_BYTES;
const RECORD_HEADER_BYTES: usize = 16;
const RECORD_LINK_BYTES: usize = 16;
const KIND_HOME: u64 = 1;
const KIND_PARTICIPANT: u64 = 2;

/// Where the rest of a transaction is, as its record on one memnode says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordLinks {
    /// The home record (the commit point): the participant records, (node id, offset).
    /// A resolver that settles a lock on the home memnode first copies the decision into
    /// each of them, so the home's locks (which keep this record through restarts) are
    /// never settled while another memnode's lock still needs the decision.
    Home(Vec<(u64, u64)>),
    /// A participant record: where the home record is, and the participant records before
    /// this one in the home's list (replication: with the home's memnode failed over, the
    /// first of them still served decides).
    Participant {
        /// The home memnode's node id.
        home_node: u64,
        /// The home record's offset there.
        home_offset: u64,
        /// The participant records listed before this one, in order: (node id, offset).
        before: Vec<(u64, u64)>,
    },
}

impl RecordLinks {
    /// The record's size in blocks units.
    pub fn units(&self) -> u8 {
        let links = match self {
            RecordLinks::Home(participants) => participants.len(),
            RecordLinks::Participant { before, .. } => 1 + before.len(),
        };
        assert!(links <= MAX_TXN_PARTICIPANTS, "{links} participants past {MAX_TXN_PARTICIPANTS}");
        let bytes = (RECORD_HEADER_BYTES + links * RECORD_LINK_BYTES) as u64;
        u8::try_from(bytes.div_ceil(BLOCK_UNIT_BYTES).max(1)).expect("within MAX_BLOCK_UNITS")
    }

    /// The record's bytes: the state word, a header word (kind 8 | links 16 | units 8),
    /// the links.
    fn encode(&self, state: TxnState) -> Vec<u8> {
        let units = self.units();
        let mut out = vec![0u8; usize::from(units) * BLOCK_UNIT_BYTES as usize];
        let (kind, links) = match self {
            RecordLinks::Home(participants) => (KIND_HOME, participants.clone()),
            RecordLinks::Participant { home_node, home_offset, before } => {
                (KIND_PARTICIPANT, std::iter::once((*home_node, *home_offset)).chain(before.iter().copied()).collect())
            }
        };
        let header = kind | (links.len() as u64) << 8 | u64::from(units) << 24;
        out[..8].copy_from_slice(&state.encode().to_le_bytes());
        out[8..16].copy_from_slice(&header.to_le_bytes());
        for (i, (node, offset)) in links.into_iter().enumerate() {
            let at = RECORD_HEADER_BYTES + i * RECORD_LINK_BYTES;
            out[at..at + 8].copy_from_slice(&node.to_le_bytes());
            out[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
        }
        out
    }
}

/// A record's size in units from its header word (None: not a record's header).
pub fn record_units(header: u64) -> Option<u8> {
    let (kind, links, units) = (header & 0xff, (header >> 8) & 0xffff, (header >> 24) & 0xff);
    let expected = match kind {
        KIND_HOME if links as usize <= MAX_TXN_PARTICIPANTS => RecordLinks::Home(vec![(0, 0); links as usize]).units(),
        KIND_PARTICIPANT if links >= 1 && links as usize <= MAX_TXN_PARTICIPANTS => {
            RecordLinks::Home(vec![(0, 0); links as usize]).units()
        }
        _ => return None,
    };
    (header >> 32 == 0 && units == u64::from(expected)).then_some(expected)
}

/// A record as read: its state and links. None from [`decode_record`]: not a record (freed
/// and reused under a slow reader).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnRecord {
    /// The transaction's state.
    pub state: TxnState,
    /// Where the rest of it is.
    pub links: RecordLinks,
}

fn decode_record(bytes: &[u8]) -> Option<TxnRecord> {
    let word = |at: usize| bytes.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let state = TxnState::decode(word(0)?)?;
    let header = word(8)?;
    record_units(header)?;
    let links = (header >> 8) & 0xffff;
    let mut pairs = Vec::with_capacity(links as usize);
    for i in 0..links as usize {
        let at = RECORD_HEADER_BYTES + i * RECORD_LINK_BYTES;
        let (node, offset) = (word(at)?, word(at + 8)?);
        if !offset.is_multiple_of(BLOCK_UNIT_BYTES) {
            return None;
        }
        pairs.push((node, offset));
    }
    let links = match header & 0xff {
        KIND_HOME => RecordLinks::Home(pairs),
        _ => RecordLinks::Participant { home_node: pairs[0].0, home_offset: pairs[0].1, before: pairs[1..].to_vec() },
    };
    Some(TxnRecord { state, links })
}

/// A lock a transaction holds on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lock {
    /// The locked word now in the key's slot.
    pub word: u64,
    /// The slot it went into (a hint for settling: a split may have moved it since).
    pub slot: u64,
    /// The word it replaced (0: none). It differs from the mark's old word only when the
    /// key had an expired copy the transaction read as absent.
    pub replaced: u64,
    /// The checksum of the block it replaced (0: none), read once the lock held it.
    pub replaced_checksum: u64,
}

/// A key's version as a transaction reads it: its canonical slot word and the checksum of
/// the block that word names (both 0: absent). The word alone can recur: a block is reused
/// after the grace period, and a write into it may get the same word (the slot's tag has
/// 6 bits), so a version held longer than that is checked by both. The same word and
/// checksum again means the same content again, which a serializable check may accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SlotVersion {
    /// The canonical slot word (0: absent).
    pub word: u64,
    /// The checksum of its block (0: absent).
    pub checksum: u64,
    /// Where the word stood when it was also the lowest slot with the key's fingerprint
    /// (None: it was not, or the key was absent): a lock from this version
    /// ([`TableClient::txn_lock_at_overlapped`]) can go straight there. A hint, not part of
    /// the version (splits move words).
    pub slot: Option<u64>,
}

impl SlotVersion {
    fn of(copy: &KeyCopy) -> Self {
        Self { word: copy.word, checksum: copy.checksum, slot: None }
    }
}

impl TableClient {
    /// The item under `key` and its version. A key a transaction holds is waited for
    /// (bounded by its lease). An expired item is absent, and is removed on the way.
    pub fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, SlotVersion), Error> {
        overlap::block_on(self.read_versioned_overlapped(key))
    }

    /// [`Self::read_versioned`] as an operation [`overlap::run_all`] can drive beside others
    /// (on other memnodes: their round trips overlap).
    pub async fn read_versioned_overlapped(&mut self, key: &[u8]) -> Result<(Option<Item>, SlotVersion), Error> {
        let sample = self.begin();
        let mut value = Vec::new();
        let result = self.search(key, &mut value, true).await.map(|copy| match copy {
            Some(copy) => {
                let lowest = self.lowest_candidate().map(|(slot, _)| slot);
                let slot = (lowest == Some(copy.slot)).then_some(copy.slot);
                (
                    Some(Item { value, expires_at_ms: copy.expires_at_ms }),
                    SlotVersion { slot, ..SlotVersion::of(&copy) },
                )
            }
            None => (None, SlotVersion::default()),
        });
        self.end(0, sample, result, |(item, _)| item.is_some())
    }

    /// Allocates a transaction record, pending until `deadline_ms`, linked as `links` says,
    /// and returns its region offset. No round trip: the record is written in the first
    /// batch of this client's next [`Self::txn_lock`], before that lock's CAS, so no lock
    /// can name a record that is not there. One that no lock follows is freed unwritten
    /// ([`Self::txn_free_record`]). [`Self::txn_relink_record`] changes the links until then.
    pub fn txn_record(&mut self, deadline_ms: u64, links: &RecordLinks) -> Result<u64, Error> {
        if let Some((stale, bytes)) = &self.staged_record {
            // A commit that failed before its first lock went out: never written.
            let units = u8::try_from(bytes.len() as u64 / BLOCK_UNIT_BYTES).expect("a record's units");
            self.txn_free_record(*stale, units);
        }
        std::sync::LazyLock::force(&RESOLUTIONS); // exported from the first transaction on
        let offset = self.alloc.alloc(links.units())?;
        let run = self.alloc.instance().expect("an allocated record belongs to a run");
        self.staged_record = Some((offset, links.encode(TxnState::Pending { deadline_ms })));
        self.record_run = Some((offset, run));
        Ok(offset)
    }

    /// Replaces the links of the record staged at `offset` (same size): a home record is
    /// allocated before its participants, which name it.
    pub fn txn_relink_record(&mut self, offset: u64, deadline_ms: u64, links: &RecordLinks) {
        let bytes = links.encode(TxnState::Pending { deadline_ms });
        match &mut self.staged_record {
            Some((staged, old)) if *staged == offset && old.len() == bytes.len() => *old = bytes,
            other => panic!("relinking {offset:#x} ({} B), staged: {other:?}", bytes.len()),
        }
    }

    /// The record at `offset`, its state and links (None: not a record any more).
    pub fn txn_read_record(&mut self, offset: u64) -> Result<Option<TxnRecord>, Error> {
        self.count_round_trip();
        let mut bytes = Vec::new();
        crate::words::read_bytes(&*self.conn, &mut self.batch, offset, BLOCK_UNIT_BYTES, &mut bytes)?;
        let header = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let units = record_units(header).unwrap_or(1);
        if units > 1 {
            self.count_round_trip();
            let rest = (u64::from(units) - 1) * BLOCK_UNIT_BYTES;
            crate::words::read_bytes(&*self.conn, &mut self.batch, offset + BLOCK_UNIT_BYTES, rest, &mut bytes)?;
        }
        Ok(decode_record(&bytes))
    }

    /// The state in the record at `offset` (None: not a record any more).
    pub fn txn_state(&mut self, offset: u64) -> Result<Option<TxnState>, Error> {
        self.count_round_trip();
        let word = crate::words::read_words(&*self.conn, &mut self.batch, &[offset])?[0];
        Ok(TxnState::decode(word))
    }

    /// Decides the pending transaction whose record is at `offset`: CAS from pending (with
    /// `deadline_ms`) to `to`. Returns the state the record holds afterwards (another
    /// decision may have come first).
    pub fn txn_decide(&mut self, offset: u64, deadline_ms: u64, to: TxnState) -> Result<Option<TxnState>, Error> {
        assert!(!matches!(to, TxnState::Pending { .. }), "deciding to stay pending");
        let from = TxnState::Pending { deadline_ms }.encode();
        self.batch.clear();
        let cas = self.batch.cas(offset, from, to.encode());
        self.execute()?;
        if self.batch.cas_succeeded(cas)? {
            return Ok(Some(to));
        }
        self.txn_state(offset)
    }

    /// Retires a record of `units` once no slot names it any more (the coordinator settled
    /// them all).
    pub fn txn_free_record(&mut self, offset: u64, units: u8) {
        if self.staged_record.as_ref().is_some_and(|(staged, _)| *staged == offset) {
            self.staged_record = None; // never written
        }
        let run = match self.record_run.take() {
            Some((record, run)) if record == offset => run,
            other => {
                self.record_run = other;
                self.batch.executed_instance()
            }
        };
        self.alloc.retire(offset, units, run);
    }

    /// Whether the lock being written names this client's record (so lives on its memnode).
    pub(super) fn locks_local_record(&self) -> bool {
        let named = self.intent.and_then(|m| m.record()).map(|(_, offset)| offset);
        named.is_some_and(|offset| self.record_run.is_some_and(|(record, _)| record == offset))
    }

    /// Refuses a lock naming this memnode's record in space of another run than the
    /// record's: the memnode restarted since the record was allocated, and its start's
    /// reclaim may have freed the record (no lock named it yet), so no lock may name it
    /// now. The transaction aborts instead (`block` of `units` goes back).
    pub(super) fn check_record_run(&mut self, block: u64, units: u8) -> Result<(), Error> {
        let (Some((_, expected)), true) = (self.record_run, self.locks_local_record()) else { return Ok(()) };
        let found = self.alloc.instance().expect("an allocated block belongs to a run");
        if found == expected {
            return Ok(());
        }
        self.alloc.release_unpublished(block, units, found);
        Err(Error::Transport(racekv_transport::TransportError::InstanceChanged { expected, found }))
    }

    /// Locks `key` for a transaction: writes an intent of `value` (None: a delete) expiring
    /// at `expires_at_ms`, marked with `mark` (whose `old_word` is the version the
    /// transaction read: 0 for absent), and swings the key's slot to it if it still holds
    /// that version and no one else holds it. None when it does not (a conflict: nothing
    /// changed).
    pub fn txn_lock(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        expires_at_ms: Option<u64>,
        mark: TxnMark,
    ) -> Result<Option<Lock>, Error> {
        overlap::block_on(self.txn_lock_overlapped(key, value, expires_at_ms, mark))
    }

    /// [`Self::txn_lock`] as an operation [`overlap::run_all`] can drive beside others.
    pub async fn txn_lock_overlapped(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        expires_at_ms: Option<u64>,
        mark: TxnMark,
    ) -> Result<Option<Lock>, Error> {
        self.txn_lock_at_overlapped(key, value, expires_at_ms, mark, None).await
    }

    /// [`Self::txn_lock_overlapped`] from a version read at `at` ([`SlotVersion::slot`] of
    /// the version whose word is `mark.old_word`): the intent goes in with the lock's CAS,
    /// one round trip where the general path takes two (a probe, then the CAS), unless
    /// the key moved since.
    pub async fn txn_lock_at_overlapped(
        &mut self,
        key: &[u8],
        value: Option<&[u8]>,
        expires_at_ms: Option<u64>,
        mark: TxnMark,
        at: Option<u64>,
    ) -> Result<Option<Lock>, Error> {
        assert!(
            mark.old_word == 0 || Slot::decode(mark.old_word).is_some_and(|s| !s.locked),
            "locking from word {:#x}",
            mark.old_word
        );
        std::sync::LazyLock::force(&LOCKS_TAKEN_BACK); // exported from the first lock on
        let sample = self.begin();
        let cond = match mark.old_word {
            0 => Cond::Absent,
            word => Cond::Word(word),
        };
        let mark = TxnMark { tombstone: value.is_none(), ..mark };
        let expiry = if value.is_some() { Expiry::from_ms(expires_at_ms) } else { Expiry::Never };
        self.intent = Some(mark);
        self.lock_at = at.filter(|_| mark.old_word != 0);
        let result = self.mutate(key, Some(value.unwrap_or_default()), expiry, cond).await;
        self.intent = None;
        self.lock_at = None;
        let result = result.map(|outcome| {
            (outcome != PutOutcome::NotApplied).then_some(Lock {
                word: self.last_word,
                slot: self.placed_at,
                replaced: self.replaced,
                replaced_checksum: self.replaced_checksum,
            })
        });
        self.end(OP_LOCK, sample, result, Option::is_some)
    }

    /// A lock's first try from a version read at `at` (`lock_at`): the intent block, the
    /// CAS from `expected` there, the replaced block's header and then the key's buckets go
    /// in one batch. The buckets, read after the CAS, must still admit the key and show the
    /// lock at its lowest fingerprint match: what the general path's probe checks before
    /// its CAS, here checked once the CAS took (a split, or a copy inserted below since the
    /// read, takes the lock back, and the write starts again in a fresh block, by the general
    /// path). None: the CAS failed; the general path goes on with the block written.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn lock_in_place(
        &mut self,
        key: &[u8],
        hash: &KeyHash,
        at: u64,
        expected: u64,
        new: &NewBlock,
        state: &mut BlockState,
        attempts: &mut Attempts,
    ) -> Result<Option<Step>, Error> {
        let intent = self.intent.expect("a lock in place writes an intent");
        assert_eq!(intent.old_word, expected, "a lock's expected word is its mark's old word");
        let entry = self.entry(hash, attempts)?;
        self.batch.clear();
        self.queue_new_block(new);
        self.queue_count();
        let swing = self.batch.cas(at, expected, new.word);
        let old = Slot::decode(expected).expect("a lock from a used slot");
        let header = self.batch.read(old.block, BLOCK_UNIT_BYTES as u32);
        let cbs = hash.combined_buckets(entry.entry.subtable, self.shared.layout.groups_per_subtable);
        let reads = ProbeReads::queue(&mut self.batch, cbs);
        self.execute_publishing(true, state).await?;
        if !self.batch.cas_succeeded(swing)? {
            self.stats.cas_failures += 1;
            self.metrics.cas_failures.inc();
            return Ok(None);
        }
        state.advance(BlockState::InSlot);
        let header = self.batch.read_result(header)?;
        let replaced_checksum = stored_block_checksum(header).expect("a block unit holds a header");
        let probe = reads.parse(&self.batch)?;
        probe.candidates(hash.fingerprint, &mut self.cands);
        if probe.admits(hash.dir) && self.lowest_candidate() == Some((at, new.word)) {
            self.replaced = expected;
            self.placed_at = at;
            self.replaced_checksum = replaced_checksum;
            return Ok(Some(Step::Done(PutOutcome::Updated)));
        }
        LOCKS_TAKEN_BACK.inc();
        self.batch.clear();
        let back = self.batch.cas(at, new.word, expected);
        self.execute_overlapped().await?;
        if self.batch.cas_succeeded(back)? {
            state.advance(BlockState::VisibleNotInSlot);
        } else {
            // A split moved the lock since: settled where it went, the intent retired there.
            self.settle_loop(key, new.word, &intent, false, 0)?;
            state.advance(BlockState::RetiredByOther);
        }
        Ok(Some(Step::FreshBlock))
    }

    /// The version of `key` now, without reading its value (absent or expired: 0). A
    /// locked word is returned as it is (never a version a transaction read). For
    /// validating a read set.
    pub fn txn_version(&mut self, key: &[u8]) -> Result<SlotVersion, Error> {
        Self::check_key(key)?;
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        Ok(match self.canonical_copy(key, None, false, &mut attempts)? {
            Some(c) if c.locked() || !c.expired() => SlotVersion::of(&c),
            _ => SlotVersion::default(),
        })
    }

    /// `key`'s canonical copy, locked or not, expired or not (None: absent, the absence
    /// checked), its value into `value_out` as [`Self::verify`] reads it.
    pub(super) fn canonical_copy(
        &mut self,
        key: &[u8],
        mut value_out: Option<&mut Vec<u8>>,
        read_large: bool,
        attempts: &mut Attempts,
    ) -> Result<Option<KeyCopy>, Error> {
        let hash = self.hash(key);
        loop {
            let subtable = overlap::block_on(self.read_candidates(&hash, attempts))?;
            if self.cands.is_empty() {
                return Ok(None);
            }
            match overlap::block_on(self.verify(key, value_out.as_deref_mut(), read_large, Reading::Whole))? {
                Verified::Torn => attempts.retry("a block kept changing under a read")?,
                Verified::Done => match self.copies.first().copied() {
                    Some(c) => return Ok(Some(c)),
                    None if self.others_unchanged(&hash, subtable)? => return Ok(None),
                    None => attempts.retry("the key's buckets kept changing")?,
                },
            }
        }
    }

    /// Settles the lock `locked` on `key` (its intent marked `mark`) as its transaction was
    /// decided (`committed`):
    /// swings it to the intent's block unlocked (or to 0 for a committed delete), or back to
    /// the mark's old word, and retires the block that lost. Returns whether this call
    /// swung it (false: it was settled already, by the coordinator or by another reader).
    ///
    /// `also_retire`: a word the lock replaced that is not the mark's old word (an expired
    /// copy), retired either way; only the coordinator knows one.
    pub fn txn_settle(
        &mut self,
        key: &[u8],
        locked: u64,
        mark: &TxnMark,
        committed: bool,
        also_retire: u64,
    ) -> Result<bool, Error> {
        let sample = self.begin();
        let result = self.settle_loop(key, locked, mark, committed, also_retire);
        self.end(OP_SETTLE, sample, result, |&swung| swung)
    }

    fn settle_loop(
        &mut self,
        key: &[u8],
        locked: u64,
        mark: &TxnMark,
        committed: bool,
        also_retire: u64,
    ) -> Result<bool, Error> {
        Self::check_key(key)?;
        let hash = self.hash(key);
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        loop {
            overlap::block_on(self.read_candidates(&hash, &mut attempts))?;
            // Only the slot holding this very word matters: no block read is needed to
            // know it (the word names the block, and a word does not come back).
            let Some(&(at, _)) = self.cands.iter().find(|&&(_, word)| word == locked) else {
                return Ok(false);
            };
            let target = settled_word(locked, mark, committed);
            self.batch.clear();
            if target == 0 {
                self.count_delta -= 1;
            }
            self.queue_count();
            let cas = self.batch.cas(at, locked, target);
            self.execute()?;
            if !self.batch.cas_succeeded(cas)? {
                if target == 0 {
                    self.count_delta += 1;
                }
                attempts.retry("a locked slot changed under its settling")?;
                continue;
            }
            self.retire_losers(locked, mark, committed, also_retire);
            return Ok(true);
        }
    }

    /// Settles the locks this coordinator placed on this memnode, as decided (`committed`),
    /// in one batch of CASes at the slots they went into; one that a split moved since is
    /// found by its key ([`Self::txn_settle`]). Returns how many this call swung.
    pub fn txn_settle_placed(&mut self, locks: &[(&[u8], Lock, TxnMark)], committed: bool) -> Result<usize, Error> {
        overlap::block_on(self.txn_settle_placed_overlapped(locks, committed))
    }

    /// [`Self::txn_settle_placed`] as an operation [`overlap::run_all`] can drive beside
    /// others.
    pub async fn txn_settle_placed_overlapped(
        &mut self,
        locks: &[(&[u8], Lock, TxnMark)],
        committed: bool,
    ) -> Result<usize, Error> {
        let sample = self.begin();
        let result = self.settle_placed(locks, committed).await;
        self.end(OP_SETTLE, sample, result, |_| true)
    }

    async fn settle_placed(&mut self, locks: &[(&[u8], Lock, TxnMark)], committed: bool) -> Result<usize, Error> {
        let mut swung = 0;
        for group in locks.chunks(racekv_transport::MAX_BATCH_OPS - 1) {
            self.batch.clear();
            let mut emptied = 0;
            let cases: Vec<_> = group
                .iter()
                .map(|(_, lock, mark)| {
                    let target = settled_word(lock.word, mark, committed);
                    emptied += i64::from(target == 0);
                    self.batch.cas(lock.slot, lock.word, target)
                })
                .collect();
            self.count_delta -= emptied;
            self.queue_count();
            self.execute_overlapped().await?;
            let succeeded: Vec<bool> =
                cases.into_iter().map(|cas| self.batch.cas_succeeded(cas)).collect::<Result<_, _>>()?;
            for ((key, lock, mark), succeeded) in group.iter().zip(succeeded) {
                if succeeded {
                    self.retire_losers(lock.word, mark, committed, lock.replaced);
                    swung += 1;
                } else {
                    if settled_word(lock.word, mark, committed) == 0 {
                        self.count_delta += 1;
                    }
                    swung += usize::from(self.settle_loop(key, lock.word, mark, committed, lock.replaced)?);
                }
            }
        }
        Ok(swung)
    }

    /// Retires what a settled lock's outcome left unreachable: the old block (committed) or
    /// the intent (aborted; a committed delete too), and `also_retire` (see `txn_settle`).
    fn retire_losers(&mut self, locked: u64, mark: &TxnMark, committed: bool, also_retire: u64) {
        let instance = self.batch.executed_instance();
        let mut losers = [0u64; 3];
        if committed {
            losers[0] = mark.old_word;
            if mark.tombstone {
                losers[1] = locked;
            }
        } else {
            losers[0] = locked;
        }
        if also_retire != mark.old_word {
            losers[2] = also_retire;
        }
        for word in losers.into_iter().filter(|&w| w != 0) {
            let lost = Slot::decode(word).expect("a used slot");
            self.retire_slot(&lost, instance);
        }
    }

    /// Waits while `held` (the key's canonical copy, locked) is held by a transaction
    /// within its lease; past it, fails with [`Error::Locked`] for the session to resolve.
    pub(super) fn wait_for_lock(&mut self, key: &[u8], held: &KeyCopy, attempts: &mut Attempts) -> Result<(), Error> {
        let Some(mark) = held.txn else {
            // A locked word whose block is no intent: the block was reused under the read.
            return attempts.retry("a block kept changing under a read");
        };
        let now = crate::clock::now_unix_ms();
        if now > mark.deadline_ms.saturating_add(TXN_LEASE_SLACK_MS) {
            return Err(Error::Locked { key: key.to_vec(), word: held.word, mark });
        }
        self.stats.lock_waits += 1;
        attempts.retry("a transaction held the key past the operation timeout")
    }
}

/// What a lock's slot holds once settled: the intent unlocked (committed), 0 (a committed
/// delete), or the old word (aborted).
fn settled_word(locked: u64, mark: &TxnMark, committed: bool) -> u64 {
    let slot = Slot::decode(locked).filter(|s| s.locked).expect("settling a locked word");
    match (committed, mark.tombstone) {
        (true, false) => slot.with_locked(false).encode(),
        (true, true) => 0,
        (false, _) => mark.old_word,
    }
}

/// Index of the lock operation in the table's operation metrics.
pub(super) const OP_LOCK: usize = 9;
/// Index of the settle operation in the table's operation metrics.
pub(super) const OP_SETTLE: usize = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_words_round_trip_and_reject_garbage() {
        for state in [
            TxnState::Pending { deadline_ms: 0 },
            TxnState::Pending { deadline_ms: 1_800_000_000_000 },
            TxnState::Committed,
            TxnState::Aborted,
        ] {
            assert_eq!(TxnState::decode(state.encode()), Some(state));
        }
        assert_eq!(TxnState::decode(0), None);
        assert_eq!(TxnState::decode((2 << STATE_SHIFT) | 5), None);
    }

    #[test]
    fn record_sizes_grow_with_participants_up_to_one_block() {
        assert_eq!(RecordLinks::Home(Vec::new()).units(), 1);
        assert_eq!(RecordLinks::Home(vec![(1, 64); 3]).units(), 1);
        assert_eq!(RecordLinks::Home(vec![(1, 64); 4]).units(), 2);
        assert_eq!(RecordLinks::Participant { home_node: 1, home_offset: 64, before: Vec::new() }.units(), 1);
        assert_eq!(RecordLinks::Participant { home_node: 1, home_offset: 64, before: vec![(2, 64); 2] }.units(), 1);
        assert_eq!(RecordLinks::Participant { home_node: 1, home_offset: 64, before: vec![(2, 64); 3] }.units(), 2);
        let most = RecordLinks::Home(vec![(1, 64); MAX_TXN_PARTICIPANTS]);
        assert_eq!(u64::from(most.units()), crate::layout::MAX_BLOCK_UNITS);
    }

    #[test]
    fn a_header_of_no_record_has_no_size() {
        assert_eq!(record_units(0), None);
        let header = |kind: u64, links: u64, units: u64| kind | links << 8 | units << 24;
        assert_eq!(record_units(header(KIND_HOME, 4, 2)), Some(2));
        assert_eq!(record_units(header(KIND_HOME, 4, 3)), None, "units that do not match the links");
        assert_eq!(record_units(header(KIND_PARTICIPANT, 2, 1)), Some(1));
        assert_eq!(record_units(header(KIND_PARTICIPANT, 0, 1)), None, "a participant names its home");
        assert_eq!(record_units(header(KIND_PARTICIPANT, 4, 1)), None);
        assert_eq!(record_units(header(3, 0, 1)), None);
        assert_eq!(record_units(header(KIND_HOME, MAX_TXN_PARTICIPANTS as u64 + 1, 255)), None);
        assert_eq!(record_units(header(KIND_HOME, 0, 1) | 1 << 40), None);
    }

    proptest::proptest! {
        #[test]
        fn records_round_trip_with_their_links(
            participants in proptest::collection::vec((proptest::prelude::any::<u64>(), 0u64..1 << 40), 0..40),
            home in proptest::option::of((proptest::prelude::any::<u64>(), 0u64..1 << 40)),
            state in 0u8..3,
            deadline_ms in 0u64..1 << 45,
        ) {
            let aligned = |o: u64| o * BLOCK_UNIT_BYTES;
            let links = match home {
                Some((home_node, offset)) => RecordLinks::Participant {
                    home_node,
                    home_offset: aligned(offset),
                    before: participants.iter().take(MAX_TXN_PARTICIPANTS - 1).map(|&(n, o)| (n, aligned(o))).collect(),
                },
                None => RecordLinks::Home(participants.iter().map(|&(n, o)| (n, aligned(o))).collect()),
            };
            let state = [TxnState::Pending { deadline_ms }, TxnState::Committed, TxnState::Aborted][state as usize];
            let bytes = links.encode(state);
            proptest::prop_assert_eq!(bytes.len() as u64, u64::from(links.units()) * BLOCK_UNIT_BYTES);
            proptest::prop_assert_eq!(decode_record(&bytes), Some(TxnRecord { state, links: links.clone() }));
            // Cut short (a reader that trusted a wrong size), it is no record.
            if bytes.len() > BLOCK_UNIT_BYTES as usize {
                proptest::prop_assert_eq!(decode_record(&bytes[..BLOCK_UNIT_BYTES as usize]), None);
            }
        }

        #[test]
        fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let _ = decode_record(&bytes);
        }
    }
}
