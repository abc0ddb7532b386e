//! A key's canonical copy as it stands, locked or not: what a resolver of a replicated
//! single-key write's intent (`client/src/snapshot.rs`) compares and copies. Unlike every
//! other read, it does not wait for a lock: the lock is what it looks at.

use super::{Attempts, Item, TableClient};
use crate::error::Error;
use crate::layout::{decode_block, Slot, TxnMark};

/// A key's canonical copy ([`TableClient::held_copy`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldCopy {
    /// Its slot word; a locked one names an intent.
    pub word: u64,
    /// Its block's mark: an intent's, or a settled intent's (the block keeps it).
    pub mark: Option<TxnMark>,
    /// Its block's item; for an intent, what the write puts (an empty value for a delete).
    pub item: Item,
    /// For a locked copy, the mark of the copy its lock replaced (kept from reuse while the
    /// lock stands); None when there was none or it had no mark.
    pub replaced_mark: Option<TxnMark>,
}

impl HeldCopy {
    /// Whether an intent holds the slot.
    pub fn locked(&self) -> bool {
        Slot::decode(self.word).is_some_and(|s| s.locked)
    }
}

impl TableClient {
    /// `key`'s canonical copy now (None: absent), with its block's item and mark, locked
    /// or not, expired or not.
    pub fn held_copy(&mut self, key: &[u8]) -> Result<Option<HeldCopy>, Error> {
        Self::check_key(key)?;
        let mut attempts = Attempts::new(self.shared.options.op_timeout);
        loop {
            let mut value = Vec::new();
            let Some(copy) = self.canonical_copy(key, Some(&mut value), true, &mut attempts)? else {
                return Ok(None);
            };
            let item = Item { value, expires_at_ms: copy.expires_at_ms };
            if !copy.locked() {
                return Ok(Some(HeldCopy { word: copy.word, mark: copy.txn, item, replaced_mark: None }));
            }
            let Some(mark) = copy.txn else {
                attempts.retry("a block kept changing under a read")?; // reused under the read
                continue;
            };
            let replaced_mark = match Slot::decode(mark.old_word) {
                Some(old) => self.mark_at(&old)?,
                None => None,
            };
            // The replaced block is kept only while the lock stands: read after it, it was
            // the one the lock replaced if the lock still stands.
            if !self.still_holds(copy.slot, copy.word)? {
                attempts.retry("a lock kept changing under a read")?;
                continue;
            }
            return Ok(Some(HeldCopy { word: copy.word, mark: Some(mark), item, replaced_mark }));
        }
    }

    /// The mark in the block `slot` names, if the block is one that fits the slot.
    fn mark_at(&mut self, slot: &Slot) -> Result<Option<TxnMark>, Error> {
        self.batch.clear();
        let read = self.batch.read(slot.block, slot.block_bytes() as u32);
        self.execute()?;
        Ok(decode_block(self.batch.read_result(read)?).filter(|b| slot.fits_block(b)).and_then(|b| b.txn))
    }
}
