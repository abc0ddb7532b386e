//! Formatting a fresh region and reading back a formatted one.

use std::time::Duration;

use racekv_transport::{Batch, Connection, TransportError};

use crate::error::Error;
use crate::layout::{sb, BucketHeader, DirEntry, Layout, SUPERBLOCK_BYTES};
use crate::words::read_word;

/// Whether the region behind `conn` holds a racekv superblock (any version).
pub fn is_formatted(conn: &dyn Connection) -> Result<bool, Error> {
    let mut b = Batch::new();
    let magic = b.read(sb::MAGIC, 8);
    conn.execute(&mut b)?;
    Ok(read_word(b.read_result(magic)?) != 0)
}

/// Reads and checks the layout of a formatted region.
pub fn read_layout(conn: &dyn Connection) -> Result<Layout, Error> {
    let mut b = Batch::new();
    let r = b.read(0, SUPERBLOCK_BYTES as u32);
    conn.execute(&mut b)?;
    let layout = Layout::decode(b.read_result(r)?).map_err(Error::Layout)?;
    if layout.region_len != conn.region_len() {
        return Err(Error::Corrupt(format!(
            "the superblock describes a region of {} B but the region is {} B (was --region-bytes changed? it cannot change after formatting)",
            layout.region_len,
            conn.region_len()
        )));
    }
    Ok(layout)
}

/// Brings a region of an upgradable earlier format version up to this build's
/// (`layout::UPGRADABLE_FORMAT_VERSIONS`): its superblock's layout is written again with
/// [`crate::layout::FORMAT_VERSION`], after which builds of the old version refuse the
/// region. Returns the version it was (None: it already was this build's). For the memnode,
/// at start, before it serves. The 64 bytes go in one WRITE: a SIGKILL cannot tear them; a
/// power loss mid-write can, and the start after it then refuses the superblock as corrupt.
pub fn upgrade(conn: &dyn Connection) -> Result<Option<u32>, Error> {
    let mut b = Batch::new();
    let r = b.read(0, 64);
    conn.execute(&mut b)?;
    let (layout, version) = Layout::decode_any(b.read_result(r)?).map_err(Error::Layout)?;
    if version == crate::layout::FORMAT_VERSION {
        return Ok(None);
    }
    b.clear();
    b.write(0, &layout.encode());
    conn.execute(&mut b)?;
    assert_eq!(read_layout(conn)?, layout, "an upgraded superblock reads back as the same layout");
    Ok(Some(version))
}

/// Reads the node id a formatted region was given.
pub fn read_node_id(conn: &dyn Connection) -> Result<u64, Error> {
    Ok(crate::words::read_words(conn, &mut Batch::new(), &[sb::NODE_ID])?[0])
}

/// The grace period the region's memnode published for its clients (`sb::GRACE_PERIOD_US`),
/// or None where none was.
pub fn read_grace_period(conn: &dyn Connection) -> Result<Option<Duration>, Error> {
    let us = crate::words::read_words(conn, &mut Batch::new(), &[sb::GRACE_PERIOD_US])?[0];
    Ok((us != 0).then(|| Duration::from_micros(us)))
}

/// Publishes the shortest grace period clients of this region may use (the memnode, at
/// start, before it serves). Under 1 us is published as 1 us (0 reads as "none published").
pub fn publish_grace_period(conn: &dyn Connection, grace: Duration) -> Result<(), Error> {
    let us = u64::try_from(grace.as_micros()).unwrap_or(u64::MAX).max(1);
    crate::words::write_words(conn, &mut Batch::new(), &[(sb::GRACE_PERIOD_US, us)])
}

/// The cluster map epoch the region's memnode serves by (`sb::MAP_EPOCH` without its fence
/// bit; 0: none).
pub fn read_map_epoch(conn: &dyn Connection) -> Result<u64, Error> {
    Ok(MapWord::decode(read_map_word(conn)?).epoch)
}

/// The map epoch word as stored (epoch and fence bit: [`MapWord::decode`]).
pub fn read_map_word(conn: &dyn Connection) -> Result<u64, Error> {
    Ok(crate::words::read_words(conn, &mut Batch::new(), &[sb::MAP_EPOCH])?[0])
}

/// The `sb::MAP_EPOCH` word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapWord {
    /// The newest map epoch the memnode serves by.
    pub epoch: u64,
    /// The memnode fenced itself: its lease may have lapsed, so it may have been failed
    /// over by a map it has not seen; nothing read from it stands until it clears this.
    pub fenced: bool,
}

impl MapWord {
    /// Splits a stored word.
    pub fn decode(word: u64) -> Self {
        Self { epoch: word & !sb::MAP_FENCED, fenced: word & sb::MAP_FENCED != 0 }
    }

    /// The stored form.
    pub fn encode(self) -> u64 {
        assert!(self.epoch < sb::MAP_FENCED, "map epoch {} reaches the fence bit", self.epoch);
        self.epoch | if self.fenced { sb::MAP_FENCED } else { 0 }
    }
}

/// Sets the map epoch outright, not fenced: a memnode at start, before it serves, to the
/// epoch of the cluster's map in etcd (lower than the word's when the cluster was made anew).
pub fn set_map_epoch(conn: &dyn Connection, epoch: u64) -> Result<(), Error> {
    let word = MapWord { epoch, fenced: false }.encode();
    crate::words::write_words(conn, &mut Batch::new(), &[(sb::MAP_EPOCH, word)])
}

/// Raises the map epoch to `epoch` unless it is already there or higher (by CAS, so
/// concurrent raisers never lower it), keeping the fence bit as it is; returns the epoch
/// after.
pub fn raise_map_epoch(conn: &dyn Connection, epoch: u64) -> Result<u64, Error> {
    update_map_word(conn, |now| (now.epoch < epoch).then_some(MapWord { epoch, fenced: now.fenced })).map(|w| w.epoch)
}

/// Sets the fence bit (the memnode, when its etcd lease's local deadline passed); the word
/// after.
pub fn fence_map_epoch(conn: &dyn Connection) -> Result<MapWord, Error> {
    update_map_word(conn, |now| (!now.fenced).then_some(MapWord { fenced: true, ..now }))
}

/// Clears the fence bit, raising the epoch to at least `epoch` (the memnode, registered
/// again, by the map it then read); the word after.
pub fn unfence_map_epoch(conn: &dyn Connection, epoch: u64) -> Result<MapWord, Error> {
    update_map_word(conn, |now| {
        let after = MapWord { epoch: now.epoch.max(epoch), fenced: false };
        (after != now).then_some(after)
    })
}

/// Applies `change` to the word by CAS until it holds or wants nothing (None); the word after.
fn update_map_word(conn: &dyn Connection, change: impl Fn(MapWord) -> Option<MapWord>) -> Result<MapWord, Error> {
    let mut b = Batch::new();
    let mut current = read_map_word(conn)?;
    while let Some(next) = change(MapWord::decode(current)) {
        b.clear();
        let cas = b.cas(sb::MAP_EPOCH, current, next.encode());
        conn.execute(&mut b)?;
        let seen = b.result(cas).map_err(|e| Error::Transport(TransportError::Op { index: 0, error: e }))?;
        current = if seen == current { next.encode() } else { seen };
    }
    Ok(MapWord::decode(current))
}

/// Formats an empty region: superblock, one subtable at depth 0, and its directory entry.
/// The magic and layout are written last, so a crash mid-way leaves an unformatted region.
/// `node_id` names this memnode for key placement; it must be unique in a cluster.
pub fn format(conn: &dyn Connection, layout: &Layout, node_id: u64) -> Result<(), Error> {
    layout.check().map_err(Error::Layout)?;
    if layout.region_len != conn.region_len() {
        return Err(Error::Corrupt(format!(
            "layout for {} B on a region of {} B",
            layout.region_len,
            conn.region_len()
        )));
    }
    let first = layout.heap_offset;
    let mut b = Batch::new();
    // The subtable's bucket headers are (depth 0, suffix 0): all zero, like fresh memory;
    // write them anyway so formatting does not depend on the region being zeroed.
    let header = BucketHeader { local_depth: 0, suffix: 0 }.encode().to_le_bytes();
    for bucket in 0..layout.buckets_per_subtable() {
        b.write(first + bucket * 64, &header);
        if b.len() == racekv_transport::MAX_BATCH_OPS {
            conn.execute(&mut b)?;
            b.clear();
        }
    }
    let entry = DirEntry { subtable: first, local_depth: 0, locked: false };
    b.write(layout.dir_entry_offset(0), &entry.encode().to_le_bytes());
    for (offset, value) in [
        (sb::GLOBAL_DEPTH, 0),
        (sb::HEAP_TOP, first + layout.subtable_bytes()),
        (sb::SPLIT_STATE, 0),
        (sb::ITEM_COUNT, 0),
        (sb::SUBTABLES, 1),
        (sb::CHUNKS, 0),
        (sb::FREE_CHUNKS, 0),
        (sb::NODE_ID, node_id),
        (sb::FREE_BYTES, 0),
    ] {
        b.write(offset, &u64::to_le_bytes(value));
    }
    conn.execute(&mut b)?;
    b.clear();
    b.write(0, &layout.encode());
    conn.execute(&mut b)?;
    Ok(())
}
