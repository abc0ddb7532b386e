//! What a mover does on memnodes besides catching one up (`catchup.rs`; issue 17, item 4):
//! raise a memnode's epoch word before a map takes a primary role from it
//! ([`Session::raise_served_epoch`]), and remove the copies a memnode keeps of partitions
//! it no longer holds ([`Session::purge`]).
//!
//! Why a purge never removes a copy the map wants: the memnode is out of those keys' write
//! sets, so only writers routing by an older map still write them there, and nobody reads
//! them. If a newer map makes it join the partition again, a copy written for that join
//! (by its catch-up, which waits for the memnode to serve the map, or by a writer routing
//! by it) and then removed by the purge is noticed: the purge reads the memnode's epoch
//! word after each removal, finds it newer, syncs that key again under the newer map and
//! stops. A writer by the newer map that wrote before the memnode served it wrote before
//! the catch-up began, and the catch-up copies the key again.

use crate::error::ClientError;
use crate::session::{Session, Shards};

/// What a purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Stale copies removed.
    pub removed: u64,
    /// Whether the map changed under the purge: it stopped early (plan it again by the
    /// newer map and purge again).
    pub interrupted: bool,
}

impl<S: Shards> Session<S> {
    /// Raises memnode `node`'s map epoch word to `epoch` (unless it is newer) and returns
    /// its value after. A mover does this, for every memnode of a partition whose primary
    /// its next map changes, before writing that map: from then on a reader still routing
    /// by the older map finds the word newer and reads again by the new one, and a commit
    /// whose lock saw it aborts (`txn.rs`).
    pub fn raise_served_epoch(&mut self, node: u64, epoch: u64) -> Result<u64, ClientError> {
        let shard = self.shard_for(node)?;
        self.on(shard, |c| c.raise_map_epoch(epoch))
    }

    /// Removes from memnode `node` the keys `stale` picks (those of partitions it is in no
    /// write set of, by the map of epoch `epoch`, which it must serve: waited for, bounded by
    /// the timeout). `progress` hears of each key looked at.
    pub fn purge(
        &mut self,
        epoch: u64,
        node: u64,
        stale: &dyn Fn(&[u8]) -> bool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Purged, ClientError> {
        if !self.shards_mut().await_map(epoch) {
            return Err(ClientError::Config(format!("no cluster map of epoch {epoch} or newer came to route by")));
        }
        let shard = self.shard_for(node)?;
        self.await_served_epoch(shard, epoch)?;
        let mut done = Purged::default();
        if self.on(shard, |c| c.map_epoch())? > epoch {
            done.interrupted = true;
            return Ok(done);
        }
        let walked = self.each_key(shard, stale, |s, key| {
            if done.interrupted {
                return Ok(());
            }
            progress(1);
            if s.on(shard, |c| c.delete(key))? {
                done.removed += 1;
            }
            // Read after the removal: an epoch still `epoch` proves the removal ran before
            // `node` served any newer map (so before any copy made for a join in it).
            let served = s.on(shard, |c| c.map_epoch())?;
            if served > epoch {
                if !s.shards_mut().await_map(served) {
                    let endpoint = s.shards().label(shard).to_string();
                    return Err(ClientError::MapChanged { endpoint, routed: epoch, current: served, fenced: false });
                }
                s.sync_key(key)?;
                done.interrupted = true;
            }
            Ok(())
        });
        walked?;
        self.publish_counts()?;
        Ok(done)
    }
}
