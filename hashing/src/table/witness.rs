//! Lookups that can be checked later: a run of keys read on several memnodes keeps the
//! order of consecutive `get`s without reading each memnode's keys in order, one run at a
//! time (`Session::get_in_order` in racekv-client).
//!
//! [`TableClient::get_many_witnessed`] returns, with the values, the slot word each came
//! from. [`TableClient::witness_holds`] reads those slots again (one batch): if every word
//! is unchanged and the whole span, from the first bucket READ sent to the check's return,
//! was surely within the grace period (`stall.rs`), every value held throughout that span.
//! A slot cannot leave a word and come back to it unseen within the grace period: the word
//! names a block, a block unlinked from its slot is reused only after the grace period, and
//! a lock that is released without a write restores the word the value never left.
//!
//! Absent keys have no witness (a key inserted and deleted between the two reads leaves no
//! trace), nor do keys that took the single-key path: their memnode's values stand only
//! when read last.

use super::{RoundScratch, TableClient};
use crate::error::Error;
use crate::stall::Stamp;

/// Values of keys, in the keys' order (None: absent).
pub type Values = Vec<Option<Vec<u8>>>;

/// The slot words behind the values of one [`TableClient::get_many_witnessed`].
#[derive(Debug)]
pub struct Witness {
    sent: Stamp,
    slots: Vec<u64>,
    words: Vec<u64>,
    /// The earliest expiry among the values: past it, one of them no longer holds.
    earliest_expiry_ms: Option<u64>,
}

impl Witness {
    /// Adds the words behind one round's values; false (nothing added) unless every key of
    /// the round had a live value, settled by the round itself.
    fn record(&mut self, r: &RoundScratch, values: &[Option<Vec<u8>>]) -> bool {
        if values.iter().any(Option::is_none) {
            return false;
        }
        let before = self.slots.len();
        for &n in &r.settled {
            let (i, slot, word) = r.wanted[n];
            if !r.foreign[i] {
                self.slots.push(slot);
                self.words.push(word);
            }
        }
        // Each present key settled on exactly one copy (a second made it foreign).
        assert_eq!(self.slots.len() - before, values.len(), "a round's values and its settled copies disagree");
        self.earliest_expiry_ms = self.earliest_expiry_ms.into_iter().chain(r.earliest_expiry_ms).min();
        true
    }
}

impl TableClient {
    /// [`TableClient::get_many_in_order`], also returning the slot word behind each value
    /// when every key was present and read by the batched rounds (None otherwise: the
    /// values stand, but only as this memnode's own in-order read).
    pub fn get_many_witnessed(&mut self, keys: &[&[u8]]) -> Result<(Values, Option<Witness>), Error> {
        let mut witness = Some(Witness {
            sent: self.shared.stall.now(),
            slots: Vec::new(),
            words: Vec::new(),
            earliest_expiry_ms: None,
        });
        let values = self.read_in_order(keys, &mut witness)?;
        Ok((values, witness))
    }

    /// Whether every value `witness` stands for held from its read until now (module doc):
    /// its slots hold the same words, the whole span was surely within the grace period,
    /// and none of the values has expired since.
    pub fn witness_holds(&mut self, witness: &Witness) -> Result<bool, Error> {
        if witness.slots.is_empty() {
            return Ok(true);
        }
        let now = self.read_slot_words(&witness.slots)?;
        let unexpired = witness.earliest_expiry_ms.is_none_or(|at| crate::clock::now_unix_ms() <= at);
        Ok(now == witness.words && self.shared.stall.surely_within(witness.sent) && unexpired)
    }

    /// After a round of [`TableClient::read_in_order`]: adds its words to `witness`, or drops
    /// the witness when the round cannot be witnessed (`slow`: keys it left to the
    /// single-key path).
    pub(super) fn witness_round(
        witness: &mut Option<Witness>,
        r: &RoundScratch,
        values: &[Option<Vec<u8>>],
        slow: &[usize],
    ) {
        if let Some(w) = witness {
            if !slow.is_empty() || !w.record(r, values) {
                *witness = None;
            }
        }
    }
}
