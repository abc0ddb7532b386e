//! Where everything lives in a memnode's region, and how each word is encoded.
//!
//! ```text
//! region: | superblock (4 KiB) | directory (2^max_global_depth x 8 B, reserved) | heap ... |
//! heap:   subtables (allocated by the memnode on split) and KV chunks (handed to clients)
//! subtable: groups of 3 buckets [main0 | overflow | main1], 192 B per group
//! bucket (64 B): header {local depth u32 | suffix u32} + 7 slots of 8 B
//! slot (8 B):  fingerprint 8 | length 8 (64 B units) | tag 6 | indirect 1 | locked 1 | block offset / 64 40
//! directory entry (8 B): lock 1 | unused 7 | local depth 8 | subtable offset 48
//! KV block: key_len u16 | flags u16 | value_len u32 | checksum u64 | [access u64] | [expires_at_ms u64] | key |
//!           value | pad to 64 B
//! indirect block: the same, flag INDIRECT, and in place of the value an extent descriptor:
//!                 extent offset u64 | value_len u64 | value checksum u64
//! long-key block: an indirect block, flag LONG_KEY, and in place of the key a key descriptor:
//!                 key extent offset u64 | key_len u64 | key checksum u64 | key digest u128
//! intent block: any of those, flag TXN, its value (or descriptor) after a transaction mark:
//!                 record node u64 | record offset u64 (bit 0: tombstone) | old slot word u64 |
//!                 lease deadline ms u64
//! extent: the value's bytes, contiguous, 64 B aligned, allocated by the memnode
//! ```
//!
//! A value too large for a block (more than [`MAX_KV_BYTES`] with its key) lives in an
//! extent, and the block (the slot's target, swung by one CAS as any other) holds where.
//! An extent is written once, before the CAS that publishes it, and freed only after the
//! block that points to it is retired and a grace period has passed, so a reader that
//! checked the block and then the value's checksum has the value as it was published. The
//! slot word's `indirect` bit says the block is one (reclaim and expiry need not read every
//! block to find extents); it was the top bit of the block offset, which no region below
//! 2^47 B (128 TiB) sets.
//!
//! A key too long for a block (over [`MAX_INLINE_KEY_BYTES`]) lives in an extent of its
//! own, the value always in another: the block keeps the key's length, its checksum and
//! its xxh3-128 digest (what the key's hash is derived from, so a split or a scan places
//! the block without reading the key; `KeyHash::from_digest`). A lookup whose key has that
//! length and digest reads the key extent and compares bytes: a digest is not proof.
//!
//! A block's `flags` were an always-zero field before expiry existed: a block with no flag
//! set decodes exactly as those did, so regions written by earlier builds stay readable.
//! [`BLOCK_FLAG_EXPIRES`] says an absolute expiry time (Unix milliseconds, [`crate::clock`])
//! follows the header; the checksum covers it (the flags are in its seed, the time in its
//! input), and the block's size counts it.
//!
//! [`BLOCK_FLAG_ACCESS`] says the block has an access word ([`crate::access`]: when the key
//! was last read, and how often) right after the header, 8-byte aligned so readers can
//! CAS it. It is the one part of a block that changes after publication, so the checksum
//! does not cover it (it covers everything after it); every block this build writes has
//! one, blocks of earlier builds have none and decode as before.
//!
//! A combined bucket is a main bucket plus its overflow neighbour, contiguous, so one READ of
//! 128 B fetches 14 slots. Every key has two combined buckets (4 buckets, 28 slots).

use racekv_transport::decode::{DecodeError, Reader};

use crate::access::Access;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes of the superblock at the start of the region.
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// Bytes of a bucket: one header word and its slots, one cache line.
pub const BUCKET_BYTES: u64 = 64;
/// Slots in a bucket (8-byte words after the header).
pub const SLOTS_PER_BUCKET: usize = 7;
/// Buckets in a group: two main buckets sharing one overflow bucket.
pub const BUCKETS_PER_GROUP: u64 = 3;
/// Bytes of a bucket group.
pub const GROUP_BYTES: u64 = BUCKET_BYTES * BUCKETS_PER_GROUP;
/// Bytes of a combined bucket (a main bucket and the overflow beside it), read as one.
pub const COMBINED_BUCKET_BYTES: u64 = 2 * BUCKET_BYTES;
/// KV blocks are sized in 64 B units; a slot's length field holds 1..=255 units.
pub const BLOCK_UNIT_BYTES: u64 = 64;
/// Largest block length in 64-byte units (the slot's 8-bit length field).
pub const MAX_BLOCK_UNITS: u64 = 255;
/// Bytes of a KV block's header (lengths, flags, checksum).
pub const BLOCK_HEADER_BYTES: usize = 16;
/// Bytes of a block's access word ([`BLOCK_FLAG_ACCESS`]).
pub const BLOCK_ACCESS_BYTES: usize = 8;
/// Where a block's access word is, from the block's start (8-byte aligned, as CAS needs).
pub const ACCESS_WORD_OFFSET: u64 = BLOCK_HEADER_BYTES as u64;
/// Block flag: an `expires_at_ms u64` follows the header.
pub const BLOCK_FLAG_EXPIRES: u16 = 1;
/// Block flag: the value is in an extent; the block holds its [`Extent`] descriptor.
pub const BLOCK_FLAG_INDIRECT: u16 = 2;
/// Block flag (with [`BLOCK_FLAG_INDIRECT`]): the key is in an extent too; the block holds
/// its [`LongKey`] descriptor in place of the key.
pub const BLOCK_FLAG_LONG_KEY: u16 = 4;
/// Block flag: a transaction wrote the block; a [`TxnMark`] precedes its value (`txn.rs`).
pub const BLOCK_FLAG_TXN: u16 = 8;
/// Block flag: an access word ([`crate::access::Access`]) follows the header, outside the
/// checksum. Every block this build writes has it.
pub const BLOCK_FLAG_ACCESS: u16 = 16;
/// Flags this build understands; a block with any other bit set is not a valid block.
const BLOCK_KNOWN_FLAGS: u16 =
    BLOCK_FLAG_EXPIRES | BLOCK_FLAG_INDIRECT | BLOCK_FLAG_LONG_KEY | BLOCK_FLAG_TXN | BLOCK_FLAG_ACCESS;
/// Bytes of a transaction mark (before an intent block's value).
pub const TXN_MARK_BYTES: usize = 32;
/// Bytes of an extent descriptor (the inline "value" of an indirect block).
pub const EXTENT_DESCRIPTOR_BYTES: usize = 24;
/// Bytes of a long key's descriptor (the inline "key" of a long-key block).
pub const LONG_KEY_DESCRIPTOR_BYTES: usize = EXTENT_DESCRIPTOR_BYTES + 16;
/// Largest value the format can describe (Redis' `proto-max-bulk-len` ceiling, 512 MiB).
pub const MAX_VALUE_BYTES: u64 = 512 << 20;
/// Largest key (Redis' limit too): longer than [`MAX_INLINE_KEY_BYTES`], it is in an extent.
pub const MAX_KEY_BYTES: usize = 512 << 20;
/// Longest key a block holds itself (beside an extent descriptor and an expiry).
pub const MAX_INLINE_KEY_BYTES: usize = MAX_KV_BYTES - BLOCK_EXPIRY_BYTES - EXTENT_DESCRIPTOR_BYTES;
/// Bytes an expiry time adds to a block.
pub const BLOCK_EXPIRY_BYTES: usize = 8;
/// Largest key + value that fits a block (without an expiry; one takes 8 more bytes).
pub const MAX_KV_BYTES: usize = (MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES) as usize - BLOCK_HEADER_BYTES - BLOCK_ACCESS_BYTES;
/// Directory depth limit (a 2^30-entry directory is 8 GiB).
pub const MAX_GLOBAL_DEPTH_LIMIT: u32 = 30;

/// First word of a formatted region ("RACEKV\0\x01").
pub const MAGIC: u64 = u64::from_le_bytes(*b"RACEKV\0\x01");
/// Version of the region format this build writes and reads. 2: blocks carry an access
/// word ([`BLOCK_FLAG_ACCESS`]), which builds of version 1 would take for damage.
pub const FORMAT_VERSION: u32 = 2;
/// Earlier versions whose regions this build reads once their superblock says
/// [`FORMAT_VERSION`] (`format::upgrade`): version 1's blocks are valid blocks of version 2.
pub const UPGRADABLE_FORMAT_VERSIONS: &[u32] = &[1];

/// Byte offsets of superblock words. The first 64 B are the immutable layout (with its own
/// checksum); the rest are words the memnode updates.
pub mod sb {
    /// The region's magic word ([`super::MAGIC`]).
    pub const MAGIC: u64 = 0;
    /// The format version ([`super::FORMAT_VERSION`]).
    pub const VERSION: u64 = 8;
    /// The region's length in bytes.
    pub const REGION_LEN: u64 = 16;
    /// Region offset of the directory.
    pub const DIRECTORY_OFFSET: u64 = 24;
    /// Maximum global depth (low u32) and bucket groups per subtable (high u32).
    pub const DEPTHS: u64 = 32; // max_global_depth u32 | groups_per_subtable u32
    /// Region offset of the heap.
    pub const HEAP_OFFSET: u64 = 40;
    /// Bytes per KV chunk handed to a client.
    pub const CHUNK_BYTES: u64 = 48;
    /// Checksum of the layout words before it.
    pub const LAYOUT_CHECKSUM: u64 = 56;
    /// Current global depth (written by the memnode only, after the entries it covers).
    pub const GLOBAL_DEPTH: u64 = 64;
    /// Next free heap byte (memnode only).
    pub const HEAP_TOP: u64 = 72;
    /// Split journal: state (0 idle, 1 in progress), then the split's parameters.
    pub const SPLIT_STATE: u64 = 80;
    /// Split journal: the subtable being split.
    pub const SPLIT_OLD: u64 = 88;
    /// Split journal: the subtable receiving half of its keys.
    pub const SPLIT_NEW: u64 = 96;
    /// Split journal: the local depth after the split.
    pub const SPLIT_DEPTH: u64 = 104;
    /// Split journal: the directory suffix of the subtable being split.
    pub const SPLIT_SUFFIX: u64 = 112;
    /// Number of keys, maintained by clients with FAA (may lag in-flight operations).
    pub const ITEM_COUNT: u64 = 120;
    /// Subtables allocated so far (memnode only).
    pub const SUBTABLES: u64 = 128;
    /// Chunks handed out so far (memnode only).
    pub const CHUNKS: u64 = 136;
    /// Head of the free-chunk list (memnode only; 0 = empty). A free chunk's first word
    /// holds the next free chunk's offset.
    pub const FREE_CHUNKS: u64 = 144;
    /// Random at format time: a memnode's stable identity (clients place keys by it).
    pub const NODE_ID: u64 = 152;
    /// Bytes on the free-chunk list (memnode only).
    pub const FREE_BYTES: u64 = 160;
    /// Bytes the memnode holds as fragments (memnode only; kept in its memory, so zeroed
    /// when it starts). Clients read it to skip asking for fragments when there are none.
    pub const FRAGMENT_BYTES: u64 = 168;
    /// Unused since a memnode's start reclaims all free space (`reclaim.rs`); earlier
    /// builds wrote a list of fragments here at a clean stop. Zeroed at start.
    pub const FRAGMENT_LIST: u64 = 176;
    /// The shortest grace period (microseconds) any client of this region may wait before
    /// reusing a freed block: written by the memnode at each start (`grace_period_ms`), 0
    /// where no memnode published one (regions of earlier builds, test memnodes). Clients
    /// wait at least this long, and readers check again any read that may have taken longer
    /// (`stall.rs`).
    pub const GRACE_PERIOD_US: u64 = 184;
    /// The newest cluster map epoch this memnode serves by (issue 17; 0: no map). Raised,
    /// never lowered while a map lasts; clients routing by a map read it after the other
    /// ops of each batch and refuse their result when it is newer than the epoch they
    /// routed by (`racekv_client::map_fence`). Set from etcd at each start of a memnode
    /// given etcd (0 without). Its top bit ([`MAP_FENCED`]) says the memnode fenced itself
    /// (its etcd lease may have lapsed): no result read from it stands by any map a client
    /// has; raises keep the bit, only the memnode clears it (`format::unfence_map_epoch`).
    pub const MAP_EPOCH: u64 = 192;
    /// The fence bit of the [`MAP_EPOCH`] word (epochs stay below it).
    pub const MAP_FENCED: u64 = 1 << 63;
    /// Bytes of the immutable layout at the start of the superblock (its words up to the checksum).
    pub const LAYOUT_BYTES: usize = 56;

    /// Every word, in order (the compile-time checks below walk it).
    pub(super) const WORDS: [u64; 25] = [
        MAGIC,
        VERSION,
        REGION_LEN,
        DIRECTORY_OFFSET,
        DEPTHS,
        HEAP_OFFSET,
        CHUNK_BYTES,
        LAYOUT_CHECKSUM,
        GLOBAL_DEPTH,
        HEAP_TOP,
        SPLIT_STATE,
        SPLIT_OLD,
        SPLIT_NEW,
        SPLIT_DEPTH,
        SPLIT_SUFFIX,
        ITEM_COUNT,
        SUBTABLES,
        CHUNKS,
        FREE_CHUNKS,
        NODE_ID,
        FREE_BYTES,
        FRAGMENT_BYTES,
        FRAGMENT_LIST,
        GRACE_PERIOD_US,
        MAP_EPOCH,
    ];
}

// ---- compile-time checks of the layout constants and their relations ----

// Superblock words: 8 B aligned, in order without overlap, all inside the superblock; the
// immutable layout is the first 64 B (its checksum last), the words the memnode updates
// follow it. `Layout::encode`/`decode` use these offsets as literals: pinned here.
const _: () = {
    let mut i = 0;
    while i < sb::WORDS.len() {
        assert!(sb::WORDS[i].is_multiple_of(8), "a superblock word is not 8 B aligned");
        assert!(sb::WORDS[i] + 8 <= SUPERBLOCK_BYTES, "a superblock word lies past the superblock");
        assert!(i == 0 || sb::WORDS[i - 1] + 8 <= sb::WORDS[i], "superblock words out of order or overlapping");
        i += 1;
    }
};
const _: () = assert!(sb::MAGIC == 0 && sb::VERSION == 8 && sb::REGION_LEN == 16 && sb::DIRECTORY_OFFSET == 24);
const _: () = assert!(sb::DEPTHS == 32 && sb::HEAP_OFFSET == 40 && sb::CHUNK_BYTES == 48);
const _: () = assert!(sb::LAYOUT_CHECKSUM == sb::LAYOUT_BYTES as u64 && sb::LAYOUT_CHECKSUM + 8 == 64);
const _: () = assert!(sb::GLOBAL_DEPTH >= 64, "memnode words overlap the checksummed layout");
// The split journal: the state word apart from its parameters (written first, state last).
const _: () = assert!(sb::SPLIT_STATE + 8 <= sb::SPLIT_OLD && sb::SPLIT_SUFFIX + 8 <= sb::ITEM_COUNT);
// The heap starts 4 KiB aligned after the superblock and the directory.
const _: () = assert!(SUPERBLOCK_BYTES.is_multiple_of(4096));

// Geometry: a bucket is its header word and its slots; a group three buckets
// [main0 | overflow | main1]; a combined bucket two; a key's two combined buckets 28 slots.
const _: () = assert!(BUCKET_BYTES == 8 + SLOTS_PER_BUCKET as u64 * 8);
const _: () = assert!(BUCKETS_PER_GROUP == 3 && GROUP_BYTES == 3 * BUCKET_BYTES);
const _: () = assert!(COMBINED_BUCKET_BYTES == 2 * BUCKET_BYTES && 4 * SLOTS_PER_BUCKET == 28);

// Blocks: sizes in 64 B units (a slot keeps offset / 64), at most what the slot's 8-bit
// length field holds; the header's key length is a u16, its value length a u32.
const _: () = assert!(BLOCK_UNIT_BYTES == 1 << 6 && BUCKET_BYTES.is_multiple_of(BLOCK_UNIT_BYTES));
const _: () = assert!(MAX_BLOCK_UNITS >= 1 && MAX_BLOCK_UNITS <= u8::MAX as u64);
const _: () = assert!(BLOCK_HEADER_BYTES == 16 && BLOCK_EXPIRY_BYTES == 8 && BLOCK_ACCESS_BYTES == 8);
const _: () =
    assert!(BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES + MAX_KV_BYTES == (MAX_BLOCK_UNITS * BLOCK_UNIT_BYTES) as usize);
const _: () = assert!(MAX_KV_BYTES <= u16::MAX as usize && MAX_KV_BYTES <= u32::MAX as usize);
const _: () = assert!(BLOCK_PEEK_BYTES == BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES + BLOCK_EXPIRY_BYTES);
// The access word, CAS'd by readers: 8-byte aligned in every (64 B aligned) block.
const _: () = assert!(ACCESS_WORD_OFFSET == BLOCK_HEADER_BYTES as u64 && ACCESS_WORD_OFFSET.is_multiple_of(8));
// An inline key fits beside an extent descriptor and an expiry; so does a long key's
// descriptor (`TableClient::new_block`: "descriptors fit a block").
const _: () = assert!(MAX_INLINE_KEY_BYTES + EXTENT_DESCRIPTOR_BYTES + BLOCK_EXPIRY_BYTES == MAX_KV_BYTES);
const _: () = assert!(LONG_KEY_DESCRIPTOR_BYTES + EXTENT_DESCRIPTOR_BYTES + BLOCK_EXPIRY_BYTES <= MAX_KV_BYTES);
const _: () = assert!(LONG_KEY_DESCRIPTOR_BYTES < MAX_INLINE_KEY_BYTES && MAX_INLINE_KEY_BYTES < MAX_KEY_BYTES);
// Descriptors: offset, length, checksum (u64 each); a long key's adds its u128 digest.
const _: () = assert!(EXTENT_DESCRIPTOR_BYTES == 3 * 8 && LONG_KEY_DESCRIPTOR_BYTES == EXTENT_DESCRIPTOR_BYTES + 16);
const _: () = assert!(MAX_VALUE_BYTES > MAX_KV_BYTES as u64 && MAX_VALUE_BYTES < REGION_LIMIT_BYTES);
// Flags: distinct single bits, all known.
const _: () = assert!(
    BLOCK_FLAG_EXPIRES.is_power_of_two()
        && BLOCK_FLAG_INDIRECT.is_power_of_two()
        && BLOCK_FLAG_LONG_KEY.is_power_of_two()
        && BLOCK_FLAG_TXN.is_power_of_two()
        && BLOCK_FLAG_ACCESS.is_power_of_two()
        && BLOCK_KNOWN_FLAGS.count_ones() == 5
);
// The directory: 2^limit entries of 8 B fit a region; the entry's 8-bit depth field holds
// the limit; a bucket header's u32 suffix holds `limit` bits.
const _: () = assert!(MAX_GLOBAL_DEPTH_LIMIT <= 0xFF && MAX_GLOBAL_DEPTH_LIMIT <= 32);
const _: () = assert!(SUPERBLOCK_BYTES + (8u64 << MAX_GLOBAL_DEPTH_LIMIT) < REGION_LIMIT_BYTES);

/// Regions are smaller than this (`Layout::check`): a slot's block field and a directory
/// entry's subtable field address any offset below it.
const REGION_LIMIT_BYTES: u64 = 1 << 46;

/// The immutable shape of a region, fixed when the memnode formats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Layout {
    /// The region's length in bytes.
    pub region_len: u64,
    /// Region offset of the directory.
    pub directory_offset: u64,
    /// Largest global depth the directory has room for.
    pub max_global_depth: u32,
    /// Power of two.
    pub groups_per_subtable: u32,
    /// Region offset of the heap (after the directory).
    pub heap_offset: u64,
    /// Bytes per KV chunk handed to a client.
    pub chunk_bytes: u64,
}

/// What the errors of a layout that cannot be used say they are about
/// ([`DecodeError::what`]).
pub const BAD_LAYOUT: &str = "bad region layout";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(BAD_LAYOUT, msg)
}

impl Layout {
    /// Chooses a layout for a region of `region_len` bytes: the directory is reserved large
    /// enough to address every subtable the heap could hold.
    pub fn for_region(region_len: u64, groups_per_subtable: u32, chunk_bytes: u64) -> Result<Self, DecodeError> {
        if !groups_per_subtable.is_power_of_two() || !(4..=1 << 20).contains(&groups_per_subtable) {
            return Err(bad(format!(
                "groups per subtable must be a power of two in 4..=2^20, not {groups_per_subtable}"
            )));
        }
        if chunk_bytes < 4096 || !chunk_bytes.is_multiple_of(4096) {
            return Err(bad(format!("chunk size must be a multiple of 4096 B, not {chunk_bytes}")));
        }
        let subtable_bytes = u64::from(groups_per_subtable) * GROUP_BYTES;
        let mut max_global_depth = 0u32;
        loop {
            let dir_bytes = round_up(8u64 << max_global_depth, 4096);
            let heap = region_len.saturating_sub(SUPERBLOCK_BYTES + dir_bytes);
            if (heap / subtable_bytes) <= (1u64 << max_global_depth) || max_global_depth == MAX_GLOBAL_DEPTH_LIMIT {
                break;
            }
            max_global_depth += 1;
        }
        let heap_offset = SUPERBLOCK_BYTES + round_up(8u64 << max_global_depth, 4096);
        let layout = Self {
            region_len,
            directory_offset: SUPERBLOCK_BYTES,
            max_global_depth,
            groups_per_subtable,
            heap_offset,
            chunk_bytes,
        };
        layout.check()?;
        Ok(layout)
    }

    /// Checks internal consistency (also of layouts read back from a region).
    pub fn check(&self) -> Result<(), DecodeError> {
        let fail = |m: String| Err(bad(m));
        if !self.region_len.is_multiple_of(4096) || self.region_len >= REGION_LIMIT_BYTES {
            return fail(format!("region length {} is not a multiple of 4096 below 2^47", self.region_len));
        }
        if self.directory_offset != SUPERBLOCK_BYTES {
            return fail(format!("directory at {}, expected {SUPERBLOCK_BYTES}", self.directory_offset));
        }
        if self.max_global_depth > MAX_GLOBAL_DEPTH_LIMIT {
            return fail(format!("max global depth {} exceeds {MAX_GLOBAL_DEPTH_LIMIT}", self.max_global_depth));
        }
        if !self.groups_per_subtable.is_power_of_two() {
            return fail(format!("groups per subtable {} is not a power of two", self.groups_per_subtable));
        }
        let dir_end = self.directory_offset + (8u64 << self.max_global_depth);
        if self.heap_offset < dir_end || !self.heap_offset.is_multiple_of(4096) {
            return fail(format!(
                "heap offset {} overlaps the directory (ends {dir_end}) or is unaligned",
                self.heap_offset
            ));
        }
        if self.heap_offset + self.subtable_bytes() + self.chunk_bytes > self.region_len {
            return fail(format!(
                "region of {} B is too small: it needs room for the directory, one subtable ({} B) and one chunk ({} B) after {} B",
                self.region_len,
                self.subtable_bytes(),
                self.chunk_bytes,
                self.heap_offset
            ));
        }
        Ok(())
    }

    /// Bytes of one subtable.
    pub fn subtable_bytes(&self) -> u64 {
        u64::from(self.groups_per_subtable) * GROUP_BYTES
    }

    /// Buckets in one subtable.
    pub fn buckets_per_subtable(&self) -> u64 {
        u64::from(self.groups_per_subtable) * BUCKETS_PER_GROUP
    }

    /// Slots in one subtable.
    pub fn slots_per_subtable(&self) -> u64 {
        self.buckets_per_subtable() * SLOTS_PER_BUCKET as u64
    }

    /// Region offset of directory entry `index`.
    pub fn dir_entry_offset(&self, index: u64) -> u64 {
        debug_assert!(index < 1 << self.max_global_depth);
        self.directory_offset + index * 8
    }

    /// Serializes the immutable part of the superblock (with its checksum).
    pub fn encode(&self) -> [u8; 64] {
        let mut out = [0u8; 64];
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[16..24].copy_from_slice(&self.region_len.to_le_bytes());
        out[24..32].copy_from_slice(&self.directory_offset.to_le_bytes());
        out[32..36].copy_from_slice(&self.max_global_depth.to_le_bytes());
        out[36..40].copy_from_slice(&self.groups_per_subtable.to_le_bytes());
        out[40..48].copy_from_slice(&self.heap_offset.to_le_bytes());
        out[48..56].copy_from_slice(&self.chunk_bytes.to_le_bytes());
        let checksum = xxh3_64_with_seed(&out[..sb::LAYOUT_BYTES], 0x5B);
        out[56..64].copy_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Parses and checks the immutable part of a superblock read from a region, of this
    /// build's [`FORMAT_VERSION`].
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        match Self::decode_any(bytes)? {
            (layout, FORMAT_VERSION) => Ok(layout),
            (_, version) => Err(bad(format!("region format version {version}, this build reads {FORMAT_VERSION}"))),
        }
    }

    /// [`Self::decode`] for a superblock of this version or an upgradable one
    /// ([`UPGRADABLE_FORMAT_VERSIONS`]); returns the version too.
    pub fn decode_any(bytes: &[u8]) -> Result<(Self, u32), DecodeError> {
        if bytes.len() < 64 {
            return Err(bad("superblock shorter than 64 bytes"));
        }
        let mut r = Reader::new(BAD_LAYOUT, &bytes[..64]);
        if r.u64()? != MAGIC {
            return Err(bad("no racekv superblock (bad magic): not a racekv region, or never formatted"));
        }
        let version = r.u32()?;
        if version != FORMAT_VERSION && !UPGRADABLE_FORMAT_VERSIONS.contains(&version) {
            return Err(bad(format!("region format version {version}, this build reads {FORMAT_VERSION}")));
        }
        r.take(4)?; // bytes 12..16: unused, and never checked
        let (region_len, directory_offset) = (r.u64()?, r.u64()?);
        let (max_global_depth, groups_per_subtable) = (r.u32()?, r.u32()?);
        let (heap_offset, chunk_bytes) = (r.u64()?, r.u64()?);
        if xxh3_64_with_seed(&bytes[..sb::LAYOUT_BYTES], 0x5B) != r.u64()? {
            return Err(bad("superblock layout checksum mismatch (corrupt region?)"));
        }
        let layout =
            Self { region_len, directory_offset, max_global_depth, groups_per_subtable, heap_offset, chunk_bytes };
        layout.check()?;
        Ok((layout, version))
    }
}

/// `value` rounded up to a multiple of `to`.
pub fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// Mask of the low `depth` bits.
pub fn depth_mask(depth: u32) -> u64 {
    if depth >= 64 {
        u64::MAX
    } else {
        (1u64 << depth) - 1
    }
}

// ---- directory entries ----

const OFFSET_BITS: u64 = (1 << 48) - 1;
const LOCK_BIT: u64 = 1 << 63;
const DEPTH_BITS: u64 = 0xFF << 48;
// lock 1 | unused 7 | local depth 8 | subtable offset 48: disjoint, and the offset field
// addresses the whole region.
const _: () = assert!(OFFSET_BITS & DEPTH_BITS == 0 && (OFFSET_BITS | DEPTH_BITS) & LOCK_BIT == 0);
const _: () = assert!(REGION_LIMIT_BYTES - 1 <= OFFSET_BITS);

/// A directory entry: which subtable serves a suffix, at what local depth, and whether a
/// split of it is in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry {
    /// Region offset of the subtable.
    pub subtable: u64,
    /// Directory-hash bits the subtable's keys share.
    pub local_depth: u32,
    /// A split of the subtable is in progress.
    pub locked: bool,
}

impl DirEntry {
    /// The entry as its directory word.
    pub fn encode(&self) -> u64 {
        assert_eq!(self.subtable & !OFFSET_BITS, 0, "subtable {:#x} past the entry's offset field", self.subtable);
        assert!(self.local_depth <= MAX_GLOBAL_DEPTH_LIMIT, "local depth {} past the limit", self.local_depth);
        let word = self.subtable | (u64::from(self.local_depth) << 48) | if self.locked { LOCK_BIT } else { 0 };
        debug_assert_eq!(Self::decode(word), *self, "a directory entry does not decode to what was encoded");
        word
    }

    /// The entry a directory word holds.
    pub fn decode(word: u64) -> Self {
        Self { subtable: word & OFFSET_BITS, local_depth: ((word >> 48) & 0xFF) as u32, locked: word & LOCK_BIT != 0 }
    }

    /// Whether the word can be a published entry of a table with `layout`.
    pub fn is_valid(&self, layout: &Layout) -> bool {
        self.subtable >= layout.heap_offset
            && self.subtable + layout.subtable_bytes() <= layout.region_len
            && self.subtable.is_multiple_of(BUCKET_BYTES)
            && self.local_depth <= layout.max_global_depth
    }
}

// ---- bucket headers ----

/// Every bucket says which keys it holds: those whose directory hash ends in `suffix` at
/// `local_depth` bits. Clients compare it with the key to detect a stale directory cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketHeader {
    /// Directory-hash bits the bucket's keys share.
    pub local_depth: u32,
    /// Those bits' value.
    pub suffix: u32,
}

impl BucketHeader {
    /// The header word. Only for headers this process derives (format, split): a header
    /// read back may hold anything, and [`Self::admits`] refuses what no writer produces.
    pub fn encode(&self) -> u64 {
        assert!(
            self.local_depth <= MAX_GLOBAL_DEPTH_LIMIT && u64::from(self.suffix) <= depth_mask(self.local_depth),
            "bucket header suffix {:#x} has bits past its local depth {}",
            self.suffix,
            self.local_depth
        );
        u64::from(self.local_depth) | (u64::from(self.suffix) << 32)
    }

    /// The header a word holds.
    pub fn decode(word: u64) -> Self {
        Self { local_depth: word as u32, suffix: (word >> 32) as u32 }
    }

    /// Whether a key with directory hash `dir_hash` belongs in this bucket.
    pub fn admits(&self, dir_hash: u64) -> bool {
        self.local_depth <= MAX_GLOBAL_DEPTH_LIMIT
            && (dir_hash & depth_mask(self.local_depth)) == u64::from(self.suffix)
    }
}

// ---- slots ----

const SLOT_POINTER_BITS: u32 = 42;
const SLOT_TAG_BITS: u32 = 6;
/// The top bit of the pointer field: the block is an indirect one.
const SLOT_INDIRECT_BIT: u64 = 1 << (SLOT_POINTER_BITS - 1);
/// The next bit: a transaction holds the slot (its block is an intent, `txn.rs`). It was
/// the top bit of the block offset, which no region below 2^46 B (64 TiB) sets, so slots
/// written by earlier builds read as unlocked.
const SLOT_LOCKED_BIT: u64 = SLOT_INDIRECT_BIT >> 1;
const SLOT_BLOCK_MASK: u64 = SLOT_LOCKED_BIT - 1;
// fingerprint 8 | length 8 | tag 6 | pointer 42 (indirect 1 | locked 1 | block / 64 40) =
// 64 bits; the block field addresses every 64 B unit of a region (below 2^46 B); the length
// field holds every block size.
const _: () = assert!(8 + 8 + SLOT_TAG_BITS + SLOT_POINTER_BITS == 64);
const _: () = assert!((SLOT_BLOCK_MASK + 1) * BLOCK_UNIT_BYTES == REGION_LIMIT_BYTES);
const _: () = assert!(MAX_BLOCK_UNITS <= 0xFF);

/// A slot, the unit of CAS. All zero is empty; a used slot always has length >= 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// The key's fingerprint (8 bits of its digest).
    pub fingerprint: u8,
    /// Block length in 64 B units (1..=255).
    pub units: u8,
    /// Bumped per write by the writer: a block reused at the same address still gives a
    /// different slot word, so a delayed CAS cannot succeed against it (ABA).
    pub tag: u8,
    /// Region offset of the KV block (64 B aligned).
    pub block: u64,
    /// The block is an indirect one (its value is in an extent).
    pub indirect: bool,
    /// A transaction holds the slot: the block is its intent ([`TxnMark`]), and the key's
    /// value is decided by the transaction's record.
    pub locked: bool,
}

impl Slot {
    /// The slot word. Paired with [`Self::decode`]: a word this writes decodes to the same
    /// slot (the tag cut to its 6 bits), never to None.
    pub fn encode(&self) -> u64 {
        assert!(self.units >= 1, "a used slot has a length (block at {:#x})", self.block);
        assert_eq!(self.block % BLOCK_UNIT_BYTES, 0, "block {:#x} is not 64 B aligned", self.block);
        assert!(self.block >> 6 <= SLOT_BLOCK_MASK, "block {:#x} past the slot's pointer field", self.block);
        let word = (u64::from(self.fingerprint) << 56)
            | (u64::from(self.units) << 48)
            | (u64::from(self.tag & ((1 << SLOT_TAG_BITS) - 1)) << SLOT_POINTER_BITS)
            | if self.indirect { SLOT_INDIRECT_BIT } else { 0 }
            | if self.locked { SLOT_LOCKED_BIT } else { 0 }
            | (self.block >> 6);
        debug_assert_eq!(
            Self::decode(word),
            Some(Slot { tag: self.tag & ((1 << SLOT_TAG_BITS) - 1), ..*self }),
            "slot word {word:#x} does not decode to the slot encoded"
        );
        word
    }

    /// None for an empty slot (or one with a zero length, which no writer produces).
    pub fn decode(word: u64) -> Option<Self> {
        let units = ((word >> 48) & 0xFF) as u8;
        if word == 0 || units == 0 {
            return None;
        }
        Some(Self {
            fingerprint: (word >> 56) as u8,
            units,
            tag: ((word >> SLOT_POINTER_BITS) & ((1 << SLOT_TAG_BITS) - 1)) as u8,
            block: (word & SLOT_BLOCK_MASK) << 6,
            indirect: word & SLOT_INDIRECT_BIT != 0,
            locked: word & SLOT_LOCKED_BIT != 0,
        })
    }

    /// The same slot, locked or not (the word of an intent and of its committed value).
    pub fn with_locked(&self, locked: bool) -> Self {
        Self { locked, ..*self }
    }

    /// Whether `block` could be the one this word was written for: the writer put the key's
    /// fingerprint and the block's size in it. A block that does not fit was reused since
    /// the word was read (a freed block can hold any key).
    pub fn fits_block(&self, block: &Block<'_>) -> bool {
        self.indirect == block.extent.is_some()
            && block.units() == Some(self.units)
            && digest_fingerprint(block.key_digest()) == self.fingerprint
    }

    /// Whether `head` (a direct block's, [`peek_block_head`]) can be the block this slot
    /// word was written for: [`Self::fits_block`] as far as the bytes read tell (a key past
    /// them leaves its fingerprint unchecked).
    pub fn fits_head(&self, head: &BlockHead<'_>) -> bool {
        !self.indirect
            && head.units == self.units
            && head.key.is_none_or(|key| digest_fingerprint(key_digest(key)) == self.fingerprint)
    }

    /// The block's length in bytes.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.units) * BLOCK_UNIT_BYTES
    }
}

// ---- KV blocks ----

/// The digest a key's hash derives from (`KeyHash::from_digest`): xxh3-128 of its bytes.
pub fn key_digest(key: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(key)
}

/// The slot fingerprint of a key with this digest (`KeyHash` keeps it too).
pub fn digest_fingerprint(digest: u128) -> u8 {
    ((digest as u64) >> 56) as u8
}

/// A KV block read back from the region and checked ([`decode_block`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block<'a> {
    /// The key, for a block that holds it; empty for a long-key block (see `long_key`), so
    /// comparing it with a key (never empty) cannot match one.
    pub key: &'a [u8],
    /// The value, for a direct block; empty for an indirect one (see `extent`).
    pub value: &'a [u8],
    /// When the item expires: absolute Unix time in milliseconds; None: never.
    pub expires_at_ms: Option<u64>,
    /// Where the value is, for an indirect block.
    pub extent: Option<Extent>,
    /// Where the key is, for a long-key block.
    pub long_key: Option<LongKey>,
    /// The transaction that wrote it, for an intent block.
    pub txn: Option<TxnMark>,
    /// Its access word as read (None: a block of an earlier build, which has none).
    pub access: Option<Access>,
    /// Its checksum (of everything but the access word): with the slot word that names the
    /// block, it tells one write from another that reused the block with the same word.
    pub checksum: u64,
}

/// What an intent block says of the write that locked its slot ([`BLOCK_FLAG_TXN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnMark {
    /// Who decides whether the write stands.
    pub owner: MarkOwner,
    /// The slot word the intent replaced (0: the key was absent): what an abort restores.
    pub old_word: u64,
    /// When the write's lease ends (Unix ms): past it, anyone may settle it.
    pub deadline_ms: u64,
    /// The write deletes the key: committing empties the slot.
    pub tombstone: bool,
}

/// Who decides an intent's fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkOwner {
    /// A transaction: its record says whether it committed.
    Record {
        /// Node id of the memnode holding the record.
        node: u64,
        /// Region offset of the record there (64 B aligned, never 0: the superblock).
        offset: u64,
    },
    /// A replicated single-key write (`docs/design/replication-fast-path.md`): the key's
    /// primary decides. Each replica's intent carries the same id; a backup's intent stands
    /// when the primary's copy (or the copy the primary's lock replaced) carries it too.
    Snapshot {
        /// Random, one per write.
        write_id: u64,
    },
}

impl std::fmt::Display for MarkOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MarkOwner::Record { node, offset } => {
                write!(f, "a transaction, record at {offset:#x} on memnode {node:#x}")
            }
            MarkOwner::Snapshot { write_id } => write!(f, "a replicated write, id {write_id:#x}"),
        }
    }
}

/// The offset word's low bits: bit 0 says tombstone, bit 1 snapshot (whose offset is 0).
const MARK_TOMBSTONE_BIT: u64 = 1;
const MARK_SNAPSHOT_BIT: u64 = 2;

impl TxnMark {
    /// A transaction's mark, naming its record at `offset` on memnode `node`.
    pub fn of_record(node: u64, offset: u64, old_word: u64, deadline_ms: u64) -> Self {
        Self { owner: MarkOwner::Record { node, offset }, old_word, deadline_ms, tombstone: false }
    }

    /// A replicated single-key write's mark.
    pub fn of_snapshot(write_id: u64, old_word: u64, deadline_ms: u64) -> Self {
        Self { owner: MarkOwner::Snapshot { write_id }, old_word, deadline_ms, tombstone: false }
    }

    /// The transaction record's (node, offset), for a transaction's mark.
    pub fn record(&self) -> Option<(u64, u64)> {
        match self.owner {
            MarkOwner::Record { node, offset } => Some((node, offset)),
            MarkOwner::Snapshot { .. } => None,
        }
    }

    /// The write's id, for a replicated single-key write's mark.
    pub fn write_id(&self) -> Option<u64> {
        match self.owner {
            MarkOwner::Snapshot { write_id } => Some(write_id),
            MarkOwner::Record { .. } => None,
        }
    }

    fn encode(&self) -> [u8; TXN_MARK_BYTES] {
        let (first, low) = match self.owner {
            MarkOwner::Record { node, offset } => {
                assert!(offset.is_multiple_of(BLOCK_UNIT_BYTES) && offset != 0, "record at {offset:#x}");
                (node, offset)
            }
            MarkOwner::Snapshot { write_id } => (write_id, MARK_SNAPSHOT_BIT),
        };
        let tombstone = if self.tombstone { MARK_TOMBSTONE_BIT } else { 0 };
        let mut out = [0u8; TXN_MARK_BYTES];
        out[0..8].copy_from_slice(&first.to_le_bytes());
        out[8..16].copy_from_slice(&(low | tombstone).to_le_bytes());
        out[16..24].copy_from_slice(&self.old_word.to_le_bytes());
        out[24..32].copy_from_slice(&self.deadline_ms.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        if bytes.len() < TXN_MARK_BYTES {
            return None;
        }
        let (offset, low) = (word(8) & !(BLOCK_UNIT_BYTES - 1), word(8) & (BLOCK_UNIT_BYTES - 1));
        let owner = match (low & !MARK_TOMBSTONE_BIT, offset) {
            (0, 0) => return None, // no record at offset 0
            (0, offset) => MarkOwner::Record { node: word(0), offset },
            (MARK_SNAPSHOT_BIT, 0) => MarkOwner::Snapshot { write_id: word(0) },
            _ => return None,
        };
        Some(Self { owner, old_word: word(16), deadline_ms: word(24), tombstone: low & MARK_TOMBSTONE_BIT != 0 })
    }
}

/// Where a long key lives ([`BLOCK_FLAG_LONG_KEY`]): its extent (whose checksum covers the
/// key's bytes) and the digest its hash derives from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongKey {
    /// The key's bytes: `value_len` is the key's length.
    pub extent: Extent,
    /// The key's xxh3-128 digest.
    pub digest: u128,
}

impl LongKey {
    /// The descriptor for `key` stored at `offset`.
    pub fn of(offset: u64, key: &[u8]) -> Self {
        Self { extent: Extent::of(offset, key), digest: key_digest(key) }
    }

    /// Whether `key` (of digest `digest`) may be this one: only reading the extent tells.
    pub fn may_be(&self, key: &[u8], digest: u128) -> bool {
        self.extent.value_len == key.len() as u64 && self.digest == digest
    }

    fn encode(&self) -> [u8; LONG_KEY_DESCRIPTOR_BYTES] {
        let mut out = [0u8; LONG_KEY_DESCRIPTOR_BYTES];
        out[..EXTENT_DESCRIPTOR_BYTES].copy_from_slice(&self.extent.encode());
        out[EXTENT_DESCRIPTOR_BYTES..].copy_from_slice(&self.digest.to_le_bytes());
        out
    }

    /// None unless well formed, and long enough that a block could not hold it.
    fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != LONG_KEY_DESCRIPTOR_BYTES {
            return None;
        }
        let extent = Extent::decode(&bytes[..EXTENT_DESCRIPTOR_BYTES])?;
        let digest = u128::from_le_bytes(bytes[EXTENT_DESCRIPTOR_BYTES..].try_into().ok()?);
        let long = extent.value_len > MAX_INLINE_KEY_BYTES as u64 && extent.value_len <= MAX_KEY_BYTES as u64;
        long.then_some(Self { extent, digest })
    }
}

/// Where an indirect block's value lives, and its checksum (a reader checks the bytes it
/// read from the extent against it: an extent freed and reused under a slow read fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Region offset (64 B aligned).
    pub offset: u64,
    /// Length in bytes of the value (or the long key) the extent holds.
    pub value_len: u64,
    /// Checksum of those bytes.
    pub checksum: u64,
}

impl Extent {
    /// The extent for `value` at `offset`.
    pub fn of(offset: u64, value: &[u8]) -> Self {
        Self { offset, value_len: value.len() as u64, checksum: value_checksum(value) }
    }

    /// Bytes the extent occupies in the heap (the value rounded up to 64 B units).
    pub fn bytes(&self) -> u64 {
        extent_bytes(self.value_len)
    }

    /// What [`Self::decode`] checks of a descriptor, asserted of one about to be written.
    fn assert_decodable(&self) {
        assert!(
            self.offset.is_multiple_of(BLOCK_UNIT_BYTES)
                && self.value_len <= MAX_VALUE_BYTES
                && self.offset.checked_add(self.bytes()).is_some(),
            "extent descriptor ({:#x}, {} B) would not decode",
            self.offset,
            self.value_len
        );
    }

    fn encode(&self) -> [u8; EXTENT_DESCRIPTOR_BYTES] {
        let mut out = [0u8; EXTENT_DESCRIPTOR_BYTES];
        out[0..8].copy_from_slice(&self.offset.to_le_bytes());
        out[8..16].copy_from_slice(&self.value_len.to_le_bytes());
        out[16..24].copy_from_slice(&self.checksum.to_le_bytes());
        out
    }

    /// None unless the descriptor is well formed (aligned, a size the format allows).
    fn decode(bytes: &[u8]) -> Option<Self> {
        let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        if bytes.len() != EXTENT_DESCRIPTOR_BYTES {
            return None;
        }
        let extent = Self { offset: word(0), value_len: word(8), checksum: word(16) };
        let sane = extent.offset.is_multiple_of(BLOCK_UNIT_BYTES)
            && extent.value_len <= MAX_VALUE_BYTES
            && extent.offset.checked_add(extent.bytes()).is_some();
        sane.then_some(extent)
    }
}

/// Heap bytes an item of these sizes takes: its block, and its extent if the value is in
/// one. None past the format's limits.
pub fn item_heap_bytes(key_len: usize, value_len: usize, expires: bool) -> Option<u64> {
    if let Some(units) = block_units_for(key_len, value_len, expires) {
        return Some(u64::from(units) * BLOCK_UNIT_BYTES);
    }
    if key_len > MAX_KEY_BYTES || value_len as u64 > MAX_VALUE_BYTES {
        return None;
    }
    if key_len > MAX_INLINE_KEY_BYTES {
        let units = block_units_for(LONG_KEY_DESCRIPTOR_BYTES, EXTENT_DESCRIPTOR_BYTES, expires)?;
        let extents = extent_bytes(key_len as u64) + extent_bytes(value_len as u64);
        return Some(u64::from(units) * BLOCK_UNIT_BYTES + extents);
    }
    let units = block_units_for(key_len, EXTENT_DESCRIPTOR_BYTES, expires)?;
    Some(u64::from(units) * BLOCK_UNIT_BYTES + extent_bytes(value_len as u64))
}

/// Heap bytes an extent for a value of `value_len` bytes takes.
pub fn extent_bytes(value_len: u64) -> u64 {
    round_up(value_len.max(1), BLOCK_UNIT_BYTES)
}

/// The checksum an extent's descriptor keeps for its value.
pub fn value_checksum(value: &[u8]) -> u64 {
    // XXH3 with seed 0 is XXH3 unseeded (what earlier builds stored).
    xxh3_seeded(0, value)
}

impl Block<'_> {
    /// Bytes of the key field: the key, or the descriptor of a long key.
    pub fn inline_key_len(&self) -> usize {
        if self.long_key.is_some() {
            LONG_KEY_DESCRIPTOR_BYTES
        } else {
            self.key.len()
        }
    }

    /// The digest of the block's key (`KeyHash::from_digest` derives its hash from it).
    pub fn key_digest(&self) -> u128 {
        self.long_key.map_or_else(|| key_digest(self.key), |long| long.digest)
    }

    /// The extents the block's item occupies: its value's, then its key's.
    pub fn extents(&self) -> impl Iterator<Item = Extent> {
        self.extent.into_iter().chain(self.long_key.map(|long| long.extent))
    }

    /// Bytes after the key: the value, or the extent descriptor of an indirect block (and
    /// an intent's mark before either).
    pub fn inline_value_len(&self) -> usize {
        let mark = if self.txn.is_some() { TXN_MARK_BYTES } else { 0 };
        mark + if self.extent.is_some() { EXTENT_DESCRIPTOR_BYTES } else { self.value.len() }
    }

    /// Its length in 64 B units, from what it holds.
    pub fn units(&self) -> Option<u8> {
        units_of(self.inline_key_len(), self.inline_value_len(), self.expires_at_ms.is_some(), self.access.is_some())
    }

    /// Whether the item's expiry time has passed at `now_ms` (Redis: a key lives through
    /// its expiry millisecond and is gone after it).
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_some_and(|at| now_ms > at)
    }
}

/// Bytes at the start of a block that say its sizes and expiry ([`peek_block_header`]).
pub const BLOCK_PEEK_BYTES: usize = BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES + BLOCK_EXPIRY_BYTES;

/// The checksum a block's header holds, **unverified** (None: fewer than a header's bytes).
/// For a block that cannot change under the read (one a lock holds, `table.rs`), where it
/// names the write; [`decode_block`] checks it against the contents.
pub fn stored_block_checksum(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(8..BLOCK_HEADER_BYTES)?.try_into().ok()?))
}

/// What the first [`BLOCK_PEEK_BYTES`] of a block say, **unverified** (the checksum covers
/// the whole block): the block's units and its expiry. Only for decisions that a CAS on the
/// slot word that pointed there validates (the memnode's expiry sweep): while the slot holds
/// that word, its block is complete and immutable, so these bytes are its own; once it does
/// not, the CAS fails. None when the bytes cannot be a block header (unknown flags, a zero
/// key length, sizes past a block).
pub fn peek_block_header(bytes: &[u8]) -> Option<(u8, Option<u64>)> {
    let (key_len, flags, value_len) = parse_len_word(read_word(bytes, 0)?)?;
    let expires = flags & BLOCK_FLAG_EXPIRES != 0;
    let units = units_of(key_len, value_len, expires, flags & BLOCK_FLAG_ACCESS != 0)?;
    Some((units, read_expiry(bytes, flags)?))
}

/// A direct block's first bytes as [`peek_block_head`] reads them: all that a write
/// replacing its item needs (no value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHead<'a> {
    /// Its length in 64 B units, from the lengths its header gives.
    pub units: u8,
    /// Its key, when the bytes read hold all of it (None: a key longer than they reach).
    pub key: Option<&'a [u8]>,
    /// Its key's length.
    pub key_len: usize,
    /// When the item expires (None: never).
    pub expires_at_ms: Option<u64>,
    /// The transaction that wrote it, for an intent block whose mark the bytes read reach
    /// (None also when they stop short of it).
    pub txn: Option<TxnMark>,
    /// Its access word as read (None: a block of an earlier build).
    pub access: Option<Access>,
    /// The checksum its header holds (not checked against anything).
    pub checksum: u64,
}

/// Bytes to read at a block's start for [`peek_block_head`] to see a key of `key_len`
/// bytes, and the intent mark after it when `mark`: the header, access word, expiry, key
/// and mark.
pub fn block_head_bytes(key_len: usize, mark: bool) -> u64 {
    (BLOCK_PEEK_BYTES + key_len + if mark { TXN_MARK_BYTES } else { 0 }) as u64
}

/// What the first bytes of a **direct** block say of its item, **unverified** (the
/// checksum covers the whole block, and only its head was read). As for
/// [`peek_block_header`], only for decisions a CAS on the slot word that pointed there
/// validates, or for bytes read within the grace period of the read of that word (the
/// block cannot be reused before, and was complete before its word was published). None
/// when the bytes cannot be a direct block's head: unknown flags, an indirect or long-key
/// block, sizes past a block, or an intent's mark that the bytes reach but that does not
/// decode.
pub fn peek_block_head(bytes: &[u8]) -> Option<BlockHead<'_>> {
    let (key_len, flags, value_len) = parse_len_word(read_word(bytes, 0)?)?;
    if flags & (BLOCK_FLAG_INDIRECT | BLOCK_FLAG_LONG_KEY) != 0 {
        return None;
    }
    let expires = flags & BLOCK_FLAG_EXPIRES != 0;
    let access = flags & BLOCK_FLAG_ACCESS != 0;
    let units = units_of(key_len, value_len, expires, access)?;
    let body = covered_from(flags) + if expires { BLOCK_EXPIRY_BYTES } else { 0 };
    let key = bytes.get(body..body + key_len);
    let mark = bytes.get(body + key_len..body + key_len + TXN_MARK_BYTES).filter(|_| key.is_some());
    let txn = match (flags & BLOCK_FLAG_TXN != 0, mark) {
        (true, Some(mark)) => Some(TxnMark::decode(mark)?),
        _ => None,
    };
    Some(BlockHead {
        units,
        key,
        key_len,
        expires_at_ms: read_expiry(bytes, flags)?,
        txn,
        access: match access {
            true => Some(Access::decode(read_word(bytes, BLOCK_HEADER_BYTES)?)),
            false => None,
        },
        checksum: stored_block_checksum(bytes)?,
    })
}

/// A block's key length, flags and stored value length (mark included), from its first
/// word; None when they cannot be a block's (unknown flags, no key).
fn parse_len_word(len_word: u64) -> Option<(usize, u16, usize)> {
    let key_len = (len_word & 0xFFFF) as usize;
    let flags = ((len_word >> 16) & 0xFFFF) as u16;
    let value_len = (len_word >> 32) as usize;
    (key_len != 0 && flags & !BLOCK_KNOWN_FLAGS == 0).then_some((key_len, flags, value_len))
}

/// The expiry a block with `flags` keeps (Some(None): none); None when it lies past `bytes`.
fn read_expiry(bytes: &[u8], flags: u16) -> Option<Option<u64>> {
    match flags & BLOCK_FLAG_EXPIRES != 0 {
        true => Some(Some(read_word(bytes, covered_from(flags))?)),
        false => Some(None),
    }
}

/// The little-endian word at `at`, if `bytes` reach past it.
fn read_word(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Units needed for a block holding `key_len + value_len` bytes and no expiry, or None if
/// too large.
pub fn block_units(key_len: usize, value_len: usize) -> Option<u8> {
    block_units_for(key_len, value_len, false)
}

/// Units needed for a block this build writes (with its access word) holding `key_len +
/// value_len` bytes, with an expiry time when `expires`, or None if too large.
pub fn block_units_for(key_len: usize, value_len: usize, expires: bool) -> Option<u8> {
    units_of(key_len, value_len, expires, true)
}

/// Units of a block holding these, with an access word when `access` (earlier builds'
/// blocks have none).
fn units_of(key_len: usize, value_len: usize, expires: bool, access: bool) -> Option<u8> {
    let header =
        BLOCK_HEADER_BYTES + if expires { BLOCK_EXPIRY_BYTES } else { 0 } + if access { BLOCK_ACCESS_BYTES } else { 0 };
    let bytes = header.checked_add(key_len)?.checked_add(value_len)? as u64;
    let units = bytes.div_ceil(BLOCK_UNIT_BYTES);
    (units <= MAX_BLOCK_UNITS).then_some(units as u8)
}

/// Where the part of a block with these flags that its checksum covers starts (its expiry,
/// if any, then key and value): after the header and the access word, if it has one.
fn covered_from(flags: u16) -> usize {
    BLOCK_HEADER_BYTES + if flags & BLOCK_FLAG_ACCESS != 0 { BLOCK_ACCESS_BYTES } else { 0 }
}

fn block_checksum(len_word: u64, covered: &[u8]) -> u64 {
    xxh3_seeded(len_word, covered)
}

/// XXH3-64 of `bytes` with `seed`, for every checksum of data a read brings (blocks, large
/// values). Both crates compute the same function; twox-hash picks AVX2 at run time for
/// inputs past 240 bytes (a 1 KiB value in about 36 ns against 55 ns for xxhash-rust, whose
/// SIMD is chosen at compile time: SSE2 in a portable build), and xxhash-rust is the
/// quicker of the two on short inputs.
fn xxh3_seeded(seed: u64, bytes: &[u8]) -> u64 {
    const XXH3_MID_SIZE_MAX: usize = 240;
    match bytes.len() {
        0..=XXH3_MID_SIZE_MAX => xxh3_64_with_seed(bytes, seed),
        _ => twox_hash::XxHash3_64::oneshot_with_seed(seed, bytes),
    }
}

/// Writes a KV block for `key` and `value`, expiring at `expires_at_ms` (None: never), into
/// `out` (cleared first, padded to 64 B units), with a zero access word (never read).
/// Returns its units.
pub fn encode_block(out: &mut Vec<u8>, key: &[u8], value: &[u8], expires_at_ms: Option<u64>) -> u8 {
    encode_block_with(out, key, value, expires_at_ms, 0, None, Access::default())
}

/// Writes any of the blocks above ([`encode_block`], [`encode_indirect_block`],
/// [`encode_long_key_block`] as `extent` and `long_key` say), as an intent block of `txn`
/// when it is some, with `access` as its access word. Returns its units.
#[allow(clippy::too_many_arguments)] // a block's every field, named
pub fn encode_any_block(
    out: &mut Vec<u8>,
    key: &[u8],
    value: &[u8],
    extent: Option<&Extent>,
    long_key: Option<&LongKey>,
    expires_at_ms: Option<u64>,
    txn: Option<&TxnMark>,
    access: Access,
) -> u8 {
    match (long_key, extent) {
        (Some(long_key), Some(extent)) => {
            assert!(long_key.extent.value_len > MAX_INLINE_KEY_BYTES as u64, "a short key stays in its block");
            assert!(long_key.extent.value_len <= MAX_KEY_BYTES as u64, "a key of {} B", long_key.extent.value_len);
            long_key.extent.assert_decodable();
            extent.assert_decodable();
            let flags = BLOCK_FLAG_INDIRECT | BLOCK_FLAG_LONG_KEY;
            encode_block_with(out, &long_key.encode(), &extent.encode(), expires_at_ms, flags, txn, access)
        }
        (None, Some(extent)) => {
            assert!(key.len() <= MAX_INLINE_KEY_BYTES, "a long key goes in an extent");
            extent.assert_decodable();
            encode_block_with(out, key, &extent.encode(), expires_at_ms, BLOCK_FLAG_INDIRECT, txn, access)
        }
        (None, None) => encode_block_with(out, key, value, expires_at_ms, 0, txn, access),
        (Some(_), None) => panic!("a long key without an extent"),
    }
}

/// Writes an indirect block for `key` whose value is in `extent` (see [`encode_block`]).
pub fn encode_indirect_block(out: &mut Vec<u8>, key: &[u8], extent: &Extent, expires_at_ms: Option<u64>) -> u8 {
    encode_any_block(out, key, &[], Some(extent), None, expires_at_ms, None, Access::default())
}

/// Writes a long-key block: the key is in `long_key`'s extent, the value in `extent`.
pub fn encode_long_key_block(out: &mut Vec<u8>, long_key: &LongKey, extent: &Extent, expires_at_ms: Option<u64>) -> u8 {
    encode_any_block(out, &[], &[], Some(extent), Some(long_key), expires_at_ms, None, Access::default())
}

fn encode_block_with(
    out: &mut Vec<u8>,
    key: &[u8],
    value: &[u8],
    expires_at_ms: Option<u64>,
    flags: u16,
    txn: Option<&TxnMark>,
    access: Access,
) -> u8 {
    let mark_len = if txn.is_some() { TXN_MARK_BYTES } else { 0 };
    let stored_value_len = value.len() + mark_len;
    let units = block_units_for(key.len(), stored_value_len, expires_at_ms.is_some()).expect("caller checked the size");
    assert!(!key.is_empty() && key.len() <= u16::MAX as usize, "a block's key of {} B", key.len());
    // What `decode_block` requires of a block, asserted where one is written.
    assert!(units >= 1 && u64::from(units) <= MAX_BLOCK_UNITS, "a block of {units} units");
    assert_eq!(
        flags & !(BLOCK_FLAG_INDIRECT | BLOCK_FLAG_LONG_KEY),
        0,
        "block flags {flags:#x}: expiry and txn are ours"
    );
    assert!(flags & BLOCK_FLAG_LONG_KEY == 0 || flags & BLOCK_FLAG_INDIRECT != 0, "a long key without an extent");
    out.clear();
    let flags = flags
        | BLOCK_FLAG_ACCESS
        | if expires_at_ms.is_some() { BLOCK_FLAG_EXPIRES } else { 0 }
        | if txn.is_some() { BLOCK_FLAG_TXN } else { 0 };
    let len_word = (key.len() as u64) | (u64::from(flags) << 16) | ((stored_value_len as u64) << 32);
    out.extend_from_slice(&len_word.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]);
    out.extend_from_slice(&access.encode().to_le_bytes());
    if let Some(at) = expires_at_ms {
        out.extend_from_slice(&at.to_le_bytes());
    }
    out.extend_from_slice(key);
    if let Some(txn) = txn {
        out.extend_from_slice(&txn.encode());
    }
    out.extend_from_slice(value);
    let checksum = block_checksum(len_word, &out[BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES..]);
    out[8..16].copy_from_slice(&checksum.to_le_bytes());
    out.resize(units as usize * BLOCK_UNIT_BYTES as usize, 0);
    // Paired with the read side: the block decodes to what was written. Debug only: it
    // checksums the block a second time.
    debug_assert!(
        decode_block(out).is_some_and(|b| {
            let key_ok = b.long_key.map_or(b.key == key, |long| long.encode()[..] == *key);
            let value_ok = b.extent.map_or(b.value == value, |extent| extent.encode()[..] == *value);
            key_ok
                && value_ok
                && b.expires_at_ms == expires_at_ms
                && b.extent.is_some() == (flags & BLOCK_FLAG_INDIRECT != 0)
                && b.long_key.is_some() == (flags & BLOCK_FLAG_LONG_KEY != 0)
                && b.txn.as_ref() == txn
                && b.access == Some(access)
        }),
        "an encoded block ({} B key, {} B value, flags {flags:#x}) does not decode to itself",
        key.len(),
        value.len()
    );
    units
}

/// A block read back from the region, checked: flags known, lengths in bounds and the
/// checksum matching. None if the bytes are not a whole, valid block (torn, reused, or
/// garbage), in which case the reader must re-read.
pub fn decode_block(bytes: &[u8]) -> Option<Block<'_>> {
    if bytes.len() < BLOCK_HEADER_BYTES {
        return None;
    }
    let len_word = read_word(bytes, 0)?;
    let (key_len, flags, value_len) = parse_len_word(len_word)?;
    let expires = flags & BLOCK_FLAG_EXPIRES != 0;
    let covered = covered_from(flags);
    let body = covered + if expires { BLOCK_EXPIRY_BYTES } else { 0 };
    let end = body.checked_add(key_len)?.checked_add(value_len)?;
    if end > bytes.len() {
        return None;
    }
    let checksum = stored_block_checksum(bytes)?;
    if block_checksum(len_word, &bytes[covered..end]) != checksum {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let access = (flags & BLOCK_FLAG_ACCESS != 0).then(|| Access::decode(word(BLOCK_HEADER_BYTES)));
    let expires_at_ms = expires.then(|| word(covered));
    let (key, mut value) = (&bytes[body..body + key_len], &bytes[body + key_len..end]);
    let txn = match flags & BLOCK_FLAG_TXN != 0 {
        true => {
            let mark = TxnMark::decode(value)?;
            value = &value[TXN_MARK_BYTES..];
            Some(mark)
        }
        false => None,
    };
    let indirect = flags & BLOCK_FLAG_INDIRECT != 0;
    if flags & BLOCK_FLAG_LONG_KEY != 0 {
        // A long key always comes with its value in an extent.
        let long_key = Some(LongKey::decode(key).filter(|_| indirect)?);
        let extent = Some(Extent::decode(value)?);
        return Some(Block { key: &[], value: &[], expires_at_ms, extent, long_key, txn, access, checksum });
    }
    if indirect {
        let extent = Some(Extent::decode(value)?);
        return Some(Block { key, value: &[], expires_at_ms, extent, long_key: None, txn, access, checksum });
    }
    Some(Block { key, value, expires_at_ms, extent: None, long_key: None, txn, access, checksum })
}

// ---- subtable geometry ----

/// One of a key's two combined buckets: its region offset and which of its two buckets is
/// the main one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CombinedBucket {
    /// Offset of the first of its two (contiguous) buckets.
    pub offset: u64,
    /// 0: [main | overflow]; 1: [overflow | main].
    pub side: u8,
}

impl CombinedBucket {
    /// Offset of bucket `i` (0 or 1) of this combined bucket.
    pub fn bucket(&self, i: usize) -> u64 {
        debug_assert!(i < 2);
        self.offset + i as u64 * BUCKET_BYTES
    }

    /// Index (0 or 1) of the main bucket within the combined bucket.
    pub fn main_index(&self) -> usize {
        self.side as usize
    }
}

/// Combined bucket (`group`, `side`) of the subtable at `subtable`.
pub fn combined_bucket(subtable: u64, groups: u32, group: u64, side: u8) -> CombinedBucket {
    debug_assert!(group < u64::from(groups) && side < 2);
    CombinedBucket { offset: subtable + group * GROUP_BYTES + u64::from(side) * BUCKET_BYTES, side }
}

/// Offset of slot `slot` in the bucket at `bucket`.
pub fn slot_offset(bucket: u64, slot: usize) -> u64 {
    debug_assert!(slot < SLOTS_PER_BUCKET);
    bucket + 8 + slot as u64 * 8
}

/// Splits a 64 B bucket image into its header and slot words.
pub fn parse_bucket(bytes: &[u8]) -> (BucketHeader, [u64; SLOTS_PER_BUCKET]) {
    debug_assert_eq!(bytes.len(), BUCKET_BYTES as usize);
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let header = BucketHeader::decode(word(0));
    let mut slots = [0u64; SLOTS_PER_BUCKET];
    for (i, s) in slots.iter_mut().enumerate() {
        *s = word(i + 1);
    }
    (header, slots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_round_trips_and_rejects_corruption() {
        let layout = Layout::for_region(64 << 20, 256, 1 << 20).unwrap();
        assert!(layout.max_global_depth >= 10, "{layout:?}");
        let bytes = layout.encode();
        assert_eq!(Layout::decode(&bytes).unwrap(), layout);
        let mut bad = bytes;
        bad[20] ^= 1;
        assert!(Layout::decode(&bad).is_err());
        assert!(Layout::decode(&[0u8; 64]).is_err());
        assert!(Layout::for_region(16 << 10, 256, 1 << 20).is_err(), "too small a region must be refused");
    }

    #[test]
    fn directory_covers_the_whole_heap() {
        for region in [1u64 << 20, 64 << 20, 1 << 30] {
            let l = Layout::for_region(region, 64, 64 << 10).unwrap();
            let subtables = (l.region_len - l.heap_offset) / l.subtable_bytes();
            assert!(subtables <= 1 << l.max_global_depth, "{l:?}");
        }
    }

    proptest! {
        /// Blocks written by either implementation must check under the other: the
        /// checksum is stored, so both must be the XXH3 of the format (and of earlier builds).
        #[test]
        fn block_checksum_is_xxh3_at_every_length(bytes in proptest::collection::vec(any::<u8>(), 0..4200), seed in any::<u64>()) {
            prop_assert_eq!(xxh3_seeded(seed, &bytes), xxh3_64_with_seed(&bytes, seed));
            prop_assert_eq!(twox_hash::XxHash3_64::oneshot_with_seed(seed, &bytes), xxh3_64_with_seed(&bytes, seed));
            prop_assert_eq!(value_checksum(&bytes), xxhash_rust::xxh3::xxh3_64(&bytes));
        }

        #[test]
        fn slots_round_trip(fp in any::<u8>(), units in 1u8.., tag in 0u8..64, block in (0u64..(1 << 40)).prop_map(|b| b << 6), indirect in any::<bool>(), locked in any::<bool>()) {
            let s = Slot { fingerprint: fp, units, tag, block, indirect, locked };
            prop_assert_eq!(Slot::decode(s.encode()), Some(s));
            prop_assert_ne!(s.encode(), 0);
            prop_assert_eq!(Slot::decode(s.with_locked(!locked).encode()).map(|d| d.locked), Some(!locked));
        }

        #[test]
        fn intent_blocks_round_trip(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
            expires_at_ms in proptest::option::of(any::<u64>()),
            indirect in any::<bool>(),
            owner_word in any::<u64>(),
            record_offset in (1u64..(1 << 40)).prop_map(|o| o << 6),
            snapshot in any::<bool>(),
            old_word in any::<u64>(),
            deadline_ms in any::<u64>(),
            tombstone in any::<bool>(),
        ) {
            let owner = match snapshot {
                true => MarkOwner::Snapshot { write_id: owner_word },
                false => MarkOwner::Record { node: owner_word, offset: record_offset },
            };
            let mark = TxnMark { owner, old_word, deadline_ms, tombstone };
            let extent = Extent::of(4096, &value);
            let mut out = Vec::new();
            let access = Access::decode(old_word);
            let units = encode_any_block(&mut out, &key, &value, indirect.then_some(&extent), None, expires_at_ms, Some(&mark), access);
            let block = decode_block(&out).expect("an intent block decodes");
            prop_assert_eq!(block.txn, Some(mark));
            prop_assert_eq!(block.access, Some(access));
            prop_assert_eq!(block.key, &key[..]);
            if indirect {
                prop_assert_eq!(block.extent, Some(extent));
            } else {
                prop_assert_eq!(block.value, &value[..]);
            }
            prop_assert_eq!(block.expires_at_ms, expires_at_ms);
            let slot = Slot { fingerprint: digest_fingerprint(key_digest(&key)), units, tag: 3, block: 64, indirect, locked: true };
            prop_assert!(slot.fits_block(&block), "the intent fits its slot");
        }

        #[test]
        fn indirect_blocks_round_trip(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            offset in (0u64..(1 << 40)).prop_map(|o| o << 6),
            value_len in 0..=MAX_VALUE_BYTES,
            checksum in any::<u64>(),
            expires_at_ms in proptest::option::of(any::<u64>()),
        ) {
            let extent = Extent { offset, value_len, checksum };
            let mut out = Vec::new();
            let units = encode_indirect_block(&mut out, &key, &extent, expires_at_ms);
            let block = decode_block(&out).unwrap();
            prop_assert_eq!(block, Block { key: &key, value: &[], expires_at_ms, extent: Some(extent), long_key: None, txn: None, access: Some(Access::default()), checksum: stored_block_checksum(&out).unwrap() });
            let slot = Slot { fingerprint: digest_fingerprint(key_digest(&key)), units, tag: 1, block: 64, indirect: true, locked: false };
            prop_assert!(slot.fits_block(&block));
            let direct = Slot { indirect: false, ..slot };
            prop_assert!(!direct.fits_block(&block));
        }

        #[test]
        fn long_key_blocks_round_trip(
            key_len in (MAX_INLINE_KEY_BYTES + 1)..(MAX_INLINE_KEY_BYTES + 3000),
            fill in any::<u8>(),
            offsets in ((0u64..(1 << 40)).prop_map(|o| o << 6), (0u64..(1 << 40)).prop_map(|o| o << 6)),
            value_len in 0..=MAX_VALUE_BYTES,
            expires_at_ms in proptest::option::of(any::<u64>()),
            flip in any::<usize>(),
        ) {
            let key = vec![fill; key_len];
            let long_key = LongKey::of(offsets.0, &key);
            let extent = Extent { offset: offsets.1, value_len, checksum: 7 };
            let mut out = Vec::new();
            let units = encode_long_key_block(&mut out, &long_key, &extent, expires_at_ms);
            let block = decode_block(&out).unwrap();
            let want = Block { key: &[], value: &[], expires_at_ms, extent: Some(extent), long_key: Some(long_key), txn: None, access: Some(Access::default()), checksum: stored_block_checksum(&out).unwrap() };
            prop_assert_eq!(block, want);
            prop_assert_eq!(block.key_digest(), key_digest(&key));
            prop_assert!(long_key.may_be(&key, key_digest(&key)));
            prop_assert!(!long_key.may_be(&key[1..], key_digest(&key[1..])));
            prop_assert_eq!(block.extents().collect::<Vec<_>>(), vec![extent, long_key.extent]);
            let slot = Slot { fingerprint: digest_fingerprint(key_digest(&key)), units, tag: 1, block: 64, indirect: true, locked: false };
            prop_assert!(slot.fits_block(&block));
            prop_assert_eq!(peek_block_header(&out), Some((units, expires_at_ms)));
            let used = BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES + expires_at_ms.map_or(0, |_| BLOCK_EXPIRY_BYTES) + LONG_KEY_DESCRIPTOR_BYTES + EXTENT_DESCRIPTOR_BYTES;
            out[checked_byte(flip, used)] ^= 0x10;
            prop_assert!(decode_block(&out).is_none());
        }

        #[test]
        fn dir_entries_round_trip(subtable in (0u64..(1 << 42)).prop_map(|b| b << 6), depth in 0u32..=30, locked in any::<bool>()) {
            let e = DirEntry { subtable, local_depth: depth, locked };
            prop_assert_eq!(DirEntry::decode(e.encode()), e);
        }

        #[test]
        fn blocks_round_trip_and_detect_damage(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
            expires_at_ms in proptest::option::of(any::<u64>()),
            flip in any::<usize>(),
        ) {
            let mut out = Vec::new();
            let units = encode_block(&mut out, &key, &value, expires_at_ms);
            prop_assert_eq!(out.len(), units as usize * 64);
            prop_assert_eq!(Some(units), block_units_for(key.len(), value.len(), expires_at_ms.is_some()));
            let block = decode_block(&out).unwrap();
            prop_assert_eq!(block, Block { key: &key, value: &value, expires_at_ms, extent: None, long_key: None, txn: None, access: Some(Access::default()), checksum: stored_block_checksum(&out).unwrap() });
            let used = BLOCK_HEADER_BYTES + BLOCK_ACCESS_BYTES + expires_at_ms.map_or(0, |_| BLOCK_EXPIRY_BYTES) + key.len() + value.len();
            let at = checked_byte(flip, used);
            out[at] ^= 0x40;
            prop_assert!(decode_block(&out).is_none(), "a flipped bit at {} went unnoticed", at);
        }

        /// A direct block's head, read as far as `block_head_bytes` says, tells what the
        /// whole block does of everything but the value; read shorter, it never claims a
        /// key it did not reach.
        #[test]
        fn a_blocks_head_says_what_the_whole_block_does(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
            expires_at_ms in proptest::option::of(any::<u64>()),
            marked in any::<bool>(),
            (node, record, old_word, deadline_ms) in (any::<u64>(), 1u64..(1 << 30), any::<u64>(), any::<u64>()),
            cut in any::<usize>(),
        ) {
            let txn = marked.then(|| TxnMark::of_record(node, record << 6, old_word, deadline_ms));
            let mut out = Vec::new();
            let units = encode_any_block(&mut out, &key, &value, None, None, expires_at_ms, txn.as_ref(), Access::default());
            let whole = decode_block(&out).unwrap();
            let n = (block_head_bytes(key.len(), marked) as usize).min(out.len());
            let head = peek_block_head(&out[..n]).unwrap();
            let want = BlockHead { units, key: Some(&key), key_len: key.len(), expires_at_ms, txn: whole.txn, access: whole.access, checksum: whole.checksum };
            prop_assert_eq!(head, want);
            let short = cut % (n + 1);
            if let Some(head) = peek_block_head(&out[..short]) {
                prop_assert_eq!(head.units, units);
                let key_end = BLOCK_PEEK_BYTES - if expires_at_ms.is_some() { 0 } else { BLOCK_EXPIRY_BYTES } + key.len();
                prop_assert_eq!(head.key.is_some(), short >= key_end);
                prop_assert!(head.txn.is_none() || short >= key_end + TXN_MARK_BYTES);
            }
        }

        /// The access word is the one part of a block readers may change: any word there
        /// leaves the block valid, and the same block to its slot.
        #[test]
        fn the_access_word_changes_nothing_else(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
            expires_at_ms in proptest::option::of(any::<u64>()),
            word in any::<u64>(),
        ) {
            let mut out = Vec::new();
            let units = encode_block(&mut out, &key, &value, expires_at_ms);
            let at = ACCESS_WORD_OFFSET as usize;
            out[at..at + 8].copy_from_slice(&word.to_le_bytes());
            let block = decode_block(&out).expect("still a block");
            prop_assert_eq!(block.access, Some(Access::decode(word)));
            prop_assert_eq!((block.key, block.value, block.expires_at_ms), (&key[..], &value[..], expires_at_ms));
            prop_assert_eq!(block.units(), Some(units));
            prop_assert_eq!(peek_block_header(&out[..BLOCK_PEEK_BYTES]), Some((units, expires_at_ms)));
        }

        /// Blocks as builds before expiry wrote them (a zero where the flags are now)
        /// decode as blocks without an expiry, and with no access word.
        #[test]
        fn blocks_of_earlier_builds_still_decode(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            // The encoding of earlier builds, spelled out: lengths, checksum seeded with
            // the length word over key and value, padding.
            let len_word = (key.len() as u64) | ((value.len() as u64) << 32);
            let mut old = len_word.to_le_bytes().to_vec();
            let body: Vec<u8> = key.iter().chain(&value).copied().collect();
            old.extend_from_slice(&xxh3_64_with_seed(&body, len_word).to_le_bytes());
            old.extend_from_slice(&body);
            old.resize(old.len().div_ceil(64) * 64, 0);
            let decoded = decode_block(&old);
            prop_assert_eq!(decoded, Some(Block { key: &key, value: &value, expires_at_ms: None, extent: None, long_key: None, txn: None, access: None, checksum: stored_block_checksum(&old).unwrap() }));
            let units = old.len() / 64;
            prop_assert_eq!(decoded.and_then(|b| b.units()), Some(units as u8), "it still fits its slot");
            prop_assert_eq!(peek_block_header(&old), Some((units as u8, None)));
        }

        /// The peek agrees with the full decode on every block.
        #[test]
        fn a_peek_sees_what_the_block_says(
            key in proptest::collection::vec(any::<u8>(), 1..100),
            value in proptest::collection::vec(any::<u8>(), 0..300),
            expires_at_ms in proptest::option::of(any::<u64>()),
        ) {
            let mut out = Vec::new();
            let units = encode_block(&mut out, &key, &value, expires_at_ms);
            prop_assert_eq!(peek_block_header(&out[..BLOCK_PEEK_BYTES]), Some((units, expires_at_ms)));
        }

        #[test]
        fn decode_block_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = peek_block_header(&bytes);
            let _ = peek_block_head(&bytes);
            let _ = decode_block(&bytes);
            let _ = Layout::decode(&bytes);
        }
    }

    /// A byte of a block's first `used` that its checksum covers (all but the access word).
    fn checked_byte(pick: usize, used: usize) -> usize {
        let at = pick % (used - BLOCK_ACCESS_BYTES);
        if at < ACCESS_WORD_OFFSET as usize {
            at
        } else {
            at + BLOCK_ACCESS_BYTES
        }
    }

    #[test]
    fn size_limits() {
        assert_eq!(block_units(1, 0), Some(1));
        assert_eq!(block_units(8, 32), Some(1), "header and access word: 24 bytes");
        assert_eq!(block_units(8, 33), Some(2));
        assert!(block_units(1, MAX_KV_BYTES - 1).is_some());
        assert!(block_units(1, MAX_KV_BYTES).is_none());
        assert_eq!(block_units_for(8, 32, true), Some(2), "an expiry takes 8 bytes");
        assert_eq!(block_units_for(8, 24, true), Some(1));
        assert!(block_units_for(1, MAX_KV_BYTES - 1 - BLOCK_EXPIRY_BYTES, true).is_some());
        assert!(block_units_for(1, MAX_KV_BYTES - BLOCK_EXPIRY_BYTES, true).is_none());
    }

    #[test]
    fn marks_are_a_records_or_a_snapshot_writes_and_nothing_else() {
        let mark_bytes = |first: u64, second: u64| {
            let mut out = [0u8; TXN_MARK_BYTES];
            out[0..8].copy_from_slice(&first.to_le_bytes());
            out[8..16].copy_from_slice(&second.to_le_bytes());
            out[16..24].copy_from_slice(&5u64.to_le_bytes());
            out[24..32].copy_from_slice(&9u64.to_le_bytes());
            out
        };
        // A transaction's mark as every earlier build wrote it: node, offset | tombstone.
        let record = TxnMark::decode(&mark_bytes(7, 4096 | 1)).unwrap();
        assert_eq!(record, TxnMark { tombstone: true, ..TxnMark::of_record(7, 4096, 5, 9) });
        assert_eq!(record.encode(), mark_bytes(7, 4096 | 1));
        let snapshot = TxnMark::decode(&mark_bytes(0xabc, 2)).unwrap();
        assert_eq!(snapshot, TxnMark::of_snapshot(0xabc, 5, 9));
        assert_eq!((snapshot.record(), snapshot.write_id()), (None, Some(0xabc)));
        assert_eq!(TxnMark::decode(&mark_bytes(0xabc, 3)).map(|m| m.tombstone), Some(true));
        // No record at offset 0; a snapshot write names no offset; unknown low bits.
        for second in [0, 1, 4096 | 2, 4096 | 3, 4, 4096 | 8, 63] {
            assert_eq!(TxnMark::decode(&mark_bytes(7, second)), None, "offset word {second:#x}");
        }
        assert_eq!(TxnMark::decode(&mark_bytes(7, 4096)[..TXN_MARK_BYTES - 1]), None);
    }

    #[test]
    fn unknown_flags_are_not_a_block() {
        // Well formed but for a flag this build does not know (its checksum is right).
        let len_word = 1u64 | (0x20 << 16) | (1 << 32);
        let mut out = len_word.to_le_bytes().to_vec();
        out.extend_from_slice(&xxh3_64_with_seed(b"kv", len_word).to_le_bytes());
        out.extend_from_slice(b"kv");
        out.resize(64, 0);
        assert_eq!(decode_block(&out), None);
        // The same with no flag is a block.
        let len_word = 1u64 | (1 << 32);
        out[..8].copy_from_slice(&len_word.to_le_bytes());
        out[8..16].copy_from_slice(&xxh3_64_with_seed(b"kv", len_word).to_le_bytes());
        assert_eq!(
            decode_block(&out),
            Some(Block {
                key: b"k",
                value: b"v",
                expires_at_ms: None,
                extent: None,
                long_key: None,
                txn: None,
                access: None,
                checksum: stored_block_checksum(&out).unwrap()
            })
        );
    }

    #[test]
    fn an_item_lives_through_its_expiry_millisecond() {
        let block = Block {
            key: b"k",
            value: b"v",
            expires_at_ms: Some(1000),
            extent: None,
            long_key: None,
            txn: None,
            access: None,
            checksum: 0,
        };
        assert!(!block.expired_at(999) && !block.expired_at(1000) && block.expired_at(1001));
        assert!(!Block { expires_at_ms: None, ..block }.expired_at(u64::MAX));
    }
}
