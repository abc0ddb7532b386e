//! Settling a lock whose transaction outlived its lease (its coordinator died or stalled),
//! as the transaction was decided; the protocol is in `txn.rs`.
//!
//! The decision is the home record's while the home memnode holds partitions. Before any
//! lock of a decided transaction is settled by a resolver, the decision is copied into
//! every participant record, in the home record's order (the coordinator of a replicated
//! transaction does the same before it settles anything). So the participant records hold
//! a prefix of copies: some first ones decided, the rest pending. When the home memnode is
//! failed over (it holds no partition: `Shards::serves`), the first participant record
//! still served decides: its decision if it has one, else aborted (a pending one there
//! means no copy went further, so no lock was settled as committed and nothing was
//! acknowledged); and that decision is copied into the ones after it before the lock is
//! settled. Every resolver finds the same first record, so they all settle alike.
//!
//! A replicated single-key write's lock names no record (a snapshot mark): the key's
//! primary decides it instead (`snapshot.rs`).

use racekv_hashing::layout::{MarkOwner, TxnMark};
use racekv_hashing::table::txn::{RecordLinks, TxnRecord, TxnState};

use crate::error::ClientError;
use crate::session::{Session, Shards};

impl<S: Shards> Session<S> {
    /// Settles a lock on `key` (memnode `shard`) whose transaction outlived its lease (see
    /// the module's comment). The lock names the record on its own memnode: the home
    /// record, or a participant record that names the home's and those listed before it.
    pub(crate) fn resolve_lock(
        &mut self,
        shard: usize,
        key: &[u8],
        word: u64,
        mark: &TxnMark,
    ) -> Result<(), ClientError> {
        let (record_node, record_offset) = match mark.owner {
            MarkOwner::Record { node, offset } => (node, offset),
            MarkOwner::Snapshot { write_id } => return self.resolve_snapshot_lock(shard, key, word, mark, write_id),
        };
        let at = self.shard_named(shard, record_node)?;
        let Some(record) = self.on(at, |c| c.txn_read_record(record_offset))? else {
            // Not this transaction's record any more: its coordinator settled every lock
            // before freeing it, so the slot has moved on; the operation reads it again.
            return Ok(());
        };
        let decided = match (record.state, &record.links) {
            (TxnState::Pending { deadline_ms }, _) if deadline_ms != mark.deadline_ms => return Ok(()),
            (TxnState::Pending { .. }, RecordLinks::Home(participants)) => {
                // Read just now: pending with this lock's deadline, so abort it at once.
                let Some(decided) = self.decide(at, record_offset, mark.deadline_ms)? else { return Ok(()) };
                let home = (record_node, record_offset);
                self.copy_decision(shard, home, participants, mark.deadline_ms, decided)?;
                decided
            }
            (state, RecordLinks::Home(participants)) => {
                let home = (record_node, record_offset);
                self.copy_decision(shard, home, participants, mark.deadline_ms, state)?;
                state
            }
            (TxnState::Pending { .. }, &RecordLinks::Participant { home_node, home_offset, ref before }) => {
                let own = (record_node, record_offset);
                match self.decide_as_participant(shard, own, mark.deadline_ms, (home_node, home_offset), before)? {
                    Some(decided) => decided,
                    None => return Ok(()),
                }
            }
            (state, RecordLinks::Participant { .. }) => state,
        };
        let committed = decided == TxnState::Committed;
        racekv_hashing::table::txn::count_resolution(committed);
        self.on(shard, |c| c.txn_settle(key, word, mark, committed, 0))?;
        Ok(())
    }

    /// The decision for a lock whose own (participant) record is pending, copied into every
    /// participant record that needs it; None when the lock's transaction is gone (read the
    /// slot again).
    fn decide_as_participant(
        &mut self,
        shard: usize,
        own: (u64, u64),
        deadline_ms: u64,
        home: (u64, u64),
        before: &[(u64, u64)],
    ) -> Result<Option<TxnState>, ClientError> {
        let home_shard = self.shard_named(shard, home.0)?;
        if self.shards().serves(home_shard) {
            let Some(decided) = self.decide(home_shard, home.1, deadline_ms)? else {
                // The home record is gone: a resolver copied the decision here before
                // settling the home's locks, or every lock, this one included, was settled
                // meanwhile.
                return self.decided_at(own);
            };
            if let Some(TxnRecord { links: RecordLinks::Home(participants), .. }) =
                self.on(home_shard, |c| c.txn_read_record(home.1))?
            {
                self.copy_decision(shard, home, &participants, deadline_ms, decided)?;
            }
            return Ok(Some(decided));
        }
        // The home memnode was failed over: the first participant record still served
        // decides, and the ones after it, up to ours, get its decision.
        let chain: Vec<(u64, u64)> = before.iter().copied().chain(std::iter::once(own)).collect();
        let served = |s: &Self, node: u64| s.shard_of_node(node).is_some_and(|at| s.shards().serves(at));
        let first = chain.iter().position(|&(node, _)| served(self, node)).unwrap_or(chain.len() - 1);
        let (node, offset) = chain[first];
        let decider = self.shard_named(shard, node)?;
        let Some(decided) = self.decide(decider, offset, deadline_ms)? else {
            return self.decided_at(own);
        };
        self.copy_decision(shard, home, &chain[first + 1..], deadline_ms, decided)?;
        Ok(Some(decided))
    }

    /// The decided state of the record at `offset` on `shard` (pending until
    /// `deadline_ms`), aborting it if still pending; None when it is no record of that
    /// transaction.
    fn decide(&mut self, shard: usize, offset: u64, deadline_ms: u64) -> Result<Option<TxnState>, ClientError> {
        let state = match self.on(shard, |c| c.txn_state(offset))? {
            Some(TxnState::Pending { deadline_ms: d }) if d == deadline_ms => {
                self.on(shard, |c| c.txn_decide(offset, deadline_ms, TxnState::Aborted))?
            }
            other => other,
        };
        Ok(state.filter(|s| !matches!(s, TxnState::Pending { .. })))
    }

    /// The decision the record at (`node`, `offset`) holds, if any.
    fn decided_at(&mut self, (node, offset): (u64, u64)) -> Result<Option<TxnState>, ClientError> {
        let Some(at) = self.shard_of_node(node) else { return Ok(None) };
        Ok(self.on(at, |c| c.txn_state(offset))?.filter(|s| !matches!(s, TxnState::Pending { .. })))
    }

    /// Copies `decided` into the participant records `participants` (in order) of the home
    /// record at `home` still pending until `deadline_ms`: each read, checked to be a
    /// participant of that home with this deadline, then one CAS. A record freed since (by
    /// a coordinator that settled that memnode, or by its restart's reclaim with no lock
    /// left there) is left, and so is one on a memnode that was failed over.
    pub(crate) fn copy_decision(
        &mut self,
        shard: usize,
        home: (u64, u64),
        participants: &[(u64, u64)],
        deadline_ms: u64,
        decided: TxnState,
    ) -> Result<(), ClientError> {
        for &(node, offset) in participants {
            let at = self.shard_named(shard, node)?;
            if !self.shards().serves(at) {
                continue;
            }
            let record = self.on(at, |c| c.txn_read_record(offset))?;
            let ours = matches!(
                record,
                Some(TxnRecord {
                    state: TxnState::Pending { deadline_ms: d },
                    links: RecordLinks::Participant { home_node, home_offset, .. },
                }) if d == deadline_ms && (home_node, home_offset) == home
            );
            if ours {
                self.on(at, |c| c.txn_decide(offset, deadline_ms, decided))?;
            }
        }
        Ok(())
    }

    /// The shard of memnode `node`, named by a lock or record met on `shard`.
    fn shard_named(&self, shard: usize, node: u64) -> Result<usize, ClientError> {
        self.shard_of_node(node).ok_or_else(|| ClientError::Internal {
            endpoint: self.shards().label(shard).to_string(),
            reason: format!("a transaction's record is on memnode {node:#x}, which this session does not know"),
        })
    }
}
