//! Reads record themselves in the access words of the blocks they read, when cache mode
//! tracks recency or frequency ([`Table::set_tracking`](super::Table::set_tracking); the
//! word's meaning is in `access.rs`): one batch of CAS after the read, only for words that
//! change, none at all while tracking is off.
//!
//! The CAS expects the word the read saw, at the block the read trusted, and goes out only
//! while the read's probe is surely within the grace period (`stall.rs`), so the block was
//! not freed and reused under it: it lands on that block. (Should it still arrive after a
//! reuse, it changes 8 bytes only if they hold exactly the word expected; ARCHITECTURE.md,
//! "Cache mode", weighs that case.) A lost update (two
//! readers racing, or a failed batch) costs the policy one sample's precision, never a
//! value: the checksum does not cover the word. [`TableClient::peek_item`] reads without
//! recording (eviction's sampling must not make its candidates look used).

use std::sync::LazyLock;

use prometheus::IntCounter;

use super::{Item, TableClient};
use crate::access::{Access, Tracking};
use crate::error::Error;
use crate::layout::{Slot, ACCESS_WORD_OFFSET};
use crate::stall::Stamp;

pub(super) static UPDATES: LazyLock<IntCounter> = LazyLock::new(|| {
    racekv_telemetry::metric::counter(
        "racekv_table_access_updates_total",
        "Access words (cache mode's LRU and LFU metadata) that reads wrote to blocks by CAS",
    )
});

impl TableClient {
    /// The value, expiry and access word of `key` (None: an earlier build's block), read
    /// without recording the read.
    pub fn peek_item(&mut self, key: &[u8]) -> Result<Option<(Item, Option<Access>)>, Error> {
        let mut value = Vec::new();
        let found = self.search_now(key, &mut value, false)?;
        Ok(found.map(|c| (Item { value, expires_at_ms: c.expires_at_ms }, c.access)))
    }

    /// Records reads of the blocks named by `copies` (slot word, access word as read), as
    /// the table's tracking says, if the reads began (`probe_sent`) surely within the grace
    /// period: the blocks cannot have been reused before the CAS goes out. Best effort: a
    /// failure is logged, the read stands.
    pub(super) fn touch(&mut self, copies: impl IntoIterator<Item = (u64, Option<Access>)>, probe_sent: Stamp) {
        let tracking = self.shared.tracking();
        if tracking == Tracking::Off || !self.shared.stall.surely_within(probe_sent) {
            return;
        }
        let now_ms = crate::clock::now_unix_ms();
        self.batch.clear();
        for (word, access) in copies {
            // An earlier build's block has no word to record in.
            let (Some(slot), Some(old)) = (Slot::decode(word), access) else { continue };
            let new = old.touched(tracking, now_ms, self.uniform());
            if new != old {
                self.batch.cas(slot.block + ACCESS_WORD_OFFSET, old.encode(), new.encode());
            }
        }
        if self.batch.is_empty() {
            return;
        }
        let updates = self.batch.len() as u64;
        match self.execute() {
            Ok(()) => UPDATES.inc_by(updates),
            Err(e) => tracing::debug!("recording {updates} reads in access words failed: {e}"),
        }
    }

    /// A uniform draw in [0, 1) (xorshift: the LFU counter's coin, no need to be good).
    fn uniform(&mut self) -> f64 {
        let mut x = self.coin;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.coin = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}
