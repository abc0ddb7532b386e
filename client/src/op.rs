//! Key-value requests and replies as they travel between an application and a computenode
//! (the shared-memory ring of attached processes, and the remote mode), with a compact
//! little-endian encoding. Decoding treats every byte as untrusted: lengths are checked
//! against the input and against explicit limits before anything is allocated.
//!
//! ```text
//! request : kind u8 | mode u8 | count u16 | then per kind:
//!   GET/DEL     : key (u32 len + bytes)
//!   PUT         : key, value                           (mode: 0 upsert, 1 insert, 2 update)
//!   CAS         : key, expected (u8 present + bytes), new (u8 present + bytes)
//!   MGET        : count x key
//!   MPUT        : count x (key, value)
//!   LEN, STATS  : -
//!   SCAN        : cursor u64 | keys wanted u32 (1..=MAX_MULTI) | reply bytes u32 (1..=MAX_SCAN_REPLY_BYTES)
//!   RANDOMKEY   : -
//!   DELETE_ALL  : -
//!   PUT_OPTS    : key, value, expiry u8 (0 never, 1 at + u64 Unix ms, 2 keep), return old u8 (0/1)
//!                 (mode as PUT's)
//!   GET_ITEM    : key
//!   EXPIRE      : key, change u8 (0 at: condition u8 (bits NX XX GT LT) + u64 Unix ms; 1 persist)
//!   PART        : upload id u64 | total u64 | offset u64 | bytes (u32 len + bytes)
//!   FETCH_PART  : staged id u64 | offset u64 | max bytes u32
//!   READ_VERSIONED : key
//!   COMMIT      : writes u16 (0..=MAX_MULTI) | count x read | writes x write   (count: the reads)
//!                 read: key, word u64, expiry (u8 present + u64 Unix ms)
//!                 write: key, value (u8 present + bytes; absent: delete), expiry (u8 present + u64)
//! reply   : status u8 (0 ok, else an ErrorKind) | kind u8 | count u16 | then:
//!   VALUE       : u8 present + bytes       DONE : u8 (0/1)      COUNT : u64
//!   VALUES      : count x (u8 present + bytes)                  OK    : -
//!   KEYS        : cursor u64 | count x key (SCAN; RANDOMKEY answers VALUE, DELETE_ALL COUNT)
//!   PUT         : outcome u8 (0 inserted, 1 updated, 2 not applied), old value (u8 present + bytes)
//!   ITEM        : u8 present, then value bytes and expiry (u8 present + u64 Unix ms)
//!   STATS       : count x (endpoint bytes, u8 0 + stats bytes | u8 ErrorKind + message bytes)
//!                 stats: layout [64] | global depth u32 | items u64 | slots u64 | load factor f64 |
//!                        heap capacity, used, free, subtables, chunks u64
//!   STAGED      : staged id u64 | total u64
//!   PART        : bytes (u32 len + bytes)
//!   VERSIONED   : word u64 | expiry (u8 present + u64) | item as ITEM   (READ_VERSIONED)
//!   error       : UTF-8 message
//! ```
//!
//! # Requests and replies in parts
//!
//! One message (a ring slot of an attached client, an RPC of a remote one) carries at most a
//! few MiB, while a key may take up to [`MAX_KEY_BYTES`] and a value [`MAX_VALUE_BYTES`].
//! A request whose encoding fits one message goes as it is (one round trip, no extra copy).
//! A larger one is encoded as usual and sent as PART requests: a random upload id, the
//! total length, and consecutive byte ranges from offset 0 (see [`part_ranges`]). The
//! computenode answers each part but the last with COUNT (bytes received so far); the last
//! part makes it decode and run the assembled request (checked against the user's ACL like
//! a direct one), and its answer is that request's reply. A reply that does not fit one
//! message is kept by the computenode, which answers STAGED { id, total }; the client then
//! asks FETCH_PART { id, offset, max } from offset 0 on, in order, and gets PART replies;
//! the fetch that reaches the total frees it.
//!
//! The computenode keys uploads and staged replies by their owner (an attached connection;
//! a remote user) and id, refuses a total above [`MAX_REQUEST_BYTES`], parts out of order
//! or past the total, and bounds what it keeps per owner and in all (a byte budget);
//! transfers idle too long are dropped. Buffers grow as bytes arrive, never by a claimed
//! length.

use racekv_hashing::{Expiry, Item, PutMode, PutOptions, PutOutcome, PutResult, TableStats};
use racekv_transport::decode::{DecodeError, Reader};

use crate::error::ClientError;
use crate::expiry::{ExpireCondition, ExpiryChange};
use crate::optimistic::Version;

/// The RPC method a computenode's remote front end answers: the request/reply of this module.
pub const REMOTE_METHOD: u16 = 0x4B56;

/// The table's key limit in bytes (`racekv_hashing::layout::MAX_KEY_BYTES`, whatever its
/// integer type).
pub const MAX_KEY_BYTES: usize = racekv_hashing::layout::MAX_KEY_BYTES as u128 as usize;
/// The table's value limit in bytes (`racekv_hashing::layout::MAX_VALUE_BYTES`).
pub const MAX_VALUE_BYTES: usize = racekv_hashing::layout::MAX_VALUE_BYTES as u128 as usize;
/// Bytes a key or value may claim at most: the table's limits (a decoder checks each length
/// against the bytes actually present before copying them).
pub const MAX_FIELD_BYTES: usize = if MAX_KEY_BYTES > MAX_VALUE_BYTES { MAX_KEY_BYTES } else { MAX_VALUE_BYTES };
// Field lengths travel as u32.
const _: () = assert!(MAX_FIELD_BYTES <= u32::MAX as usize);
/// Keys in one MGET or MPUT.
pub const MAX_MULTI: usize = 4096;
/// Bytes of one message carried at once: the largest ring slot's payload.
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;
/// Bytes of a request's header (kind, mode, count).
pub const REQUEST_HEADER_BYTES: usize = 4;
/// Bytes of the largest request a client sends (in parts): a compare-and-swap of a maximal
/// key with a maximal expected and new value. A multi-key request in parts carries one item;
/// a transaction's COMMIT carries all its reads and writes, and must fit this (the client
/// refuses a larger one with `ClientError::TooLarge`).
pub const MAX_REQUEST_BYTES: usize = REQUEST_HEADER_BYTES + 4 + MAX_KEY_BYTES + 2 * (1 + 4 + MAX_VALUE_BYTES);
/// Bytes a PART request takes besides its data.
pub const PART_REQUEST_OVERHEAD_BYTES: usize = REQUEST_HEADER_BYTES + 8 + 8 + 8 + 4;
/// Bytes a PART reply takes besides its data.
pub const PART_REPLY_OVERHEAD_BYTES: usize = 4 + 4;
/// Bytes of one remote request or reply message (an RPC payload, less room for framing).
pub const MAX_REMOTE_MESSAGE_BYTES: usize = racekv_transport::wire::MAX_RPC_BYTES - 64;
/// Bytes of keys one SCAN reply may carry (each key counting its length plus
/// `racekv_hashing::scan::SCAN_KEY_OVERHEAD_BYTES`); a single longer key still comes alone.
pub const MAX_SCAN_REPLY_BYTES: u32 = 1 << 20;
/// Bytes of a SCAN reply besides its keys: the header and the cursor.
pub const SCAN_REPLY_HEADER_BYTES: usize = 4 + 8;

/// What an application asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The value of a key (a VALUE reply).
    Get(Vec<u8>),
    /// Writes a value (a DONE reply: whether `mode` let it apply).
    Put {
        /// The key.
        key: Vec<u8>,
        /// The new value.
        value: Vec<u8>,
        /// Upsert, insert only, or update only.
        mode: PutMode,
    },
    /// Removes a key (a DONE reply: whether it existed).
    Delete(Vec<u8>),
    /// Sets `key` to `new` if its value is `expected` (a DONE reply: whether it swapped).
    CompareAndSwap {
        /// The key.
        key: Vec<u8>,
        /// The value the key must hold (None: it must be absent).
        expected: Option<Vec<u8>>,
        /// The value to set (None: remove the key).
        new: Option<Vec<u8>>,
    },
    /// The values of many keys, in order (a VALUES reply).
    MultiGet(Vec<Vec<u8>>),
    /// Writes many keys (an OK reply).
    MultiPut(Vec<(Vec<u8>, Vec<u8>)>),
    /// The number of keys on every memnode (a COUNT reply).
    Len,
    /// Each memnode's endpoint and table statistics.
    Stats,
    /// About `count` keys from `cursor` on (0 starts a walk), in a reply of at most
    /// `max_bytes` bytes of keys (`Session::scan`).
    Scan {
        /// Where the walk goes on (0: from the start).
        cursor: u64,
        /// Keys wanted, about.
        count: u32,
        /// Bytes of keys the reply may carry at most.
        max_bytes: u32,
    },
    /// One key, picked at random (a VALUE reply: the key, or none when there are none).
    RandomKey,
    /// Deletes every key on every memnode (a COUNT reply: how many).
    DeleteAll,
    /// A put with a mode, an expiry, and optionally the old value back.
    PutOpts {
        /// The key.
        key: Vec<u8>,
        /// The new value.
        value: Vec<u8>,
        /// Mode, expiry, and whether to return the old value.
        options: PutOptions,
    },
    /// The value and expiry of a key.
    GetItem(Vec<u8>),
    /// A change of a key's expiry (answered `Done`: whether it applied).
    Expire {
        /// The key.
        key: Vec<u8>,
        /// The change, with its condition.
        change: ExpiryChange,
    },
    /// Bytes `offset..offset + bytes.len()` of a request of `total` bytes sent in parts
    /// (answered COUNT of bytes received, or, for the last part, the request's reply).
    Part {
        /// The upload's id (random, chosen by the client).
        id: u64,
        /// The whole request's length, in bytes.
        total: u64,
        /// Where this part's bytes start in the request.
        offset: u64,
        /// This part's bytes.
        bytes: Vec<u8>,
    },
    /// Up to `max_len` bytes of a staged reply from `offset` on (answered PART).
    FetchPart {
        /// The staged reply's id, from the STAGED reply.
        id: u64,
        /// Where the wanted bytes start in the reply.
        offset: u64,
        /// Bytes wanted at most.
        max_len: u32,
    },
    /// A transaction's read of a key: its item and version (`Session::read_versioned`;
    /// answered VERSIONED).
    ReadVersioned(Vec<u8>),
    /// A transaction's commit (`Session::commit`): `writes` apply atomically if every key
    /// of `reads` still has its version (answered DONE: whether they applied). At most
    /// [`MAX_MULTI`] reads and [`MAX_MULTI`] writes.
    Commit {
        /// The keys read and the versions they had.
        reads: Vec<(Vec<u8>, Version)>,
        /// The writes, in order.
        writes: Vec<TxnWrite>,
    },
}

/// One write of a [`Request::Commit`]: key, new value (None: delete), expiry (absolute Unix
/// ms; None: never).
pub type TxnWrite = (Vec<u8>, Option<Vec<u8>>, Option<u64>);

/// What comes back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// GET.
    Value(Option<Vec<u8>>),
    /// PUT (applied?), DEL (existed?), CAS (swapped?).
    Done(bool),
    /// MGET.
    Values(Vec<Option<Vec<u8>>>),
    /// LEN.
    Count(u64),
    /// MPUT.
    Ok,
    /// STATS.
    Stats(Vec<MemnodeStats>),
    /// SCAN: where the next call starts (0: the walk is over) and the keys.
    Keys {
        /// Where the next call starts (0: the walk is over).
        cursor: u64,
        /// The keys found.
        keys: Vec<Vec<u8>>,
    },
    /// PUT_OPTS.
    Put(PutResult),
    /// GET_ITEM.
    Item(Option<Item>),
    /// The reply took more than one message: the computenode keeps its `total` bytes under
    /// `id` for FETCH_PART.
    Staged {
        /// The id to fetch it by.
        id: u64,
        /// The reply's length, in bytes.
        total: u64,
    },
    /// FETCH_PART's bytes.
    Part(Vec<u8>),
    /// READ_VERSIONED: the key's item (None: absent or expired) and its version.
    Versioned {
        /// The item read.
        item: Option<Item>,
        /// Its version, for the commit's check.
        version: Version,
    },
    /// The request failed: its kind and a message.
    Error(ErrorKind, String),
}

/// One memnode's statistics as a computenode reports them.
#[derive(Debug, Clone)]
pub struct MemnodeStats {
    /// The memnode, as the computenode reaches it.
    pub endpoint: String,
    /// Its table's statistics, or why they could not be read.
    pub stats: Result<TableStats, (ErrorKind, String)>,
}

impl PartialEq for MemnodeStats {
    fn eq(&self, other: &Self) -> bool {
        let same = |a: &TableStats, b: &TableStats| {
            a.layout == b.layout
                && a.global_depth == b.global_depth
                && a.items == b.items
                && a.slots == b.slots
                && a.load_factor.to_bits() == b.load_factor.to_bits()
                && a.heap == b.heap
        };
        self.endpoint == other.endpoint
            && match (&self.stats, &other.stats) {
                (Ok(a), Ok(b)) => same(a, b),
                (Err(a), Err(b)) => a == b,
                _ => false,
            }
    }
}

impl Eq for MemnodeStats {}

/// Error kinds on the wire (stable codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorKind {
    /// [`ClientError::EmptyKey`].
    EmptyKey = 1,
    /// [`ClientError::TooLarge`].
    TooLarge = 2,
    /// [`ClientError::Unavailable`]: a memnode cannot be reached.
    Unavailable = 3,
    /// [`ClientError::Timeout`].
    Timeout = 4,
    /// [`ClientError::OutOfSpace`].
    OutOfSpace = 5,
    /// [`ClientError::Protocol`] or [`ClientError::Config`]: a malformed or unusable request.
    BadRequest = 6,
    /// [`ClientError::Internal`], and anything else that failed in the computenode.
    Internal = 7,
    /// [`ClientError::Overloaded`]: the computenode's queue is full.
    Overloaded = 8,
    /// The user may not run this operation or touch this key (Redis' NOPERM).
    Denied = 9,
    /// [`ClientError::Conflict`]: a transaction kept conflicting; nothing applied.
    Conflict = 10,
}

impl ErrorKind {
    /// The kind a wire code stands for (None: an unknown code).
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => ErrorKind::EmptyKey,
            2 => ErrorKind::TooLarge,
            3 => ErrorKind::Unavailable,
            4 => ErrorKind::Timeout,
            5 => ErrorKind::OutOfSpace,
            6 => ErrorKind::BadRequest,
            7 => ErrorKind::Internal,
            8 => ErrorKind::Overloaded,
            9 => ErrorKind::Denied,
            10 => ErrorKind::Conflict,
            _ => return None,
        })
    }
}

impl Reply {
    /// The reply for a failed operation.
    pub fn from_error(e: &ClientError) -> Self {
        let kind = match e {
            ClientError::EmptyKey => ErrorKind::EmptyKey,
            ClientError::TooLarge { .. } => ErrorKind::TooLarge,
            // Remote clients see a map change like any memnode they may retry.
            ClientError::Unavailable { .. } | ClientError::MapChanged { .. } | ClientError::MapUnconfirmed { .. } => {
                ErrorKind::Unavailable
            }
            ClientError::Timeout { .. } => ErrorKind::Timeout,
            ClientError::OutOfSpace { .. } => ErrorKind::OutOfSpace,
            ClientError::Overloaded(_) => ErrorKind::Overloaded,
            ClientError::Denied(_) => ErrorKind::Denied,
            ClientError::Config(_) | ClientError::Protocol(_) => ErrorKind::BadRequest,
            ClientError::Internal { .. } => ErrorKind::Internal,
            ClientError::Conflict(_) => ErrorKind::Conflict,
        };
        Reply::Error(kind, e.to_string())
    }

    /// GET's value, or the reply itself when it is anything else (for the caller's error).
    pub fn value(self) -> Result<Option<Vec<u8>>, Reply> {
        match self {
            Reply::Value(v) => Ok(v),
            other => Err(other),
        }
    }

    /// PUT's, DEL's or CAS's outcome, or the reply itself when it is anything else.
    pub fn done(self) -> Result<bool, Reply> {
        match self {
            Reply::Done(b) => Ok(b),
            other => Err(other),
        }
    }

    /// PUT_OPTS's result, or the reply itself when it is anything else.
    pub fn put_result(self) -> Result<PutResult, Reply> {
        match self {
            Reply::Put(r) => Ok(r),
            other => Err(other),
        }
    }

    /// GET_ITEM's item, or the reply itself when it is anything else.
    pub fn item(self) -> Result<Option<Item>, Reply> {
        match self {
            Reply::Item(i) => Ok(i),
            other => Err(other),
        }
    }

    /// READ_VERSIONED's item and version, or the reply itself when it is anything else.
    pub fn versioned(self) -> Result<(Option<Item>, Version), Reply> {
        match self {
            Reply::Versioned { item, version } => Ok((item, version)),
            other => Err(other),
        }
    }

    /// LEN's count, or the reply itself when it is anything else.
    pub fn count(self) -> Result<u64, Reply> {
        match self {
            Reply::Count(n) => Ok(n),
            other => Err(other),
        }
    }

    /// STATS' entries, or the reply itself when it is anything else.
    pub fn stats(self) -> Result<Vec<MemnodeStats>, Reply> {
        match self {
            Reply::Stats(entries) => Ok(entries),
            other => Err(other),
        }
    }

    /// SCAN's cursor and keys, or the reply itself when it is anything else.
    pub fn keys(self) -> Result<(u64, Vec<Vec<u8>>), Reply> {
        match self {
            Reply::Keys { cursor, keys } => Ok((cursor, keys)),
            other => Err(other),
        }
    }

    /// Turns an error reply back into a typed error (`at` names who answered).
    pub fn into_error(kind: ErrorKind, message: String, at: &str) -> ClientError {
        let endpoint = at.to_string();
        match kind {
            ErrorKind::EmptyKey => ClientError::EmptyKey,
            ErrorKind::TooLarge => ClientError::Internal { endpoint, reason: message },
            ErrorKind::Unavailable => ClientError::Unavailable { endpoint, reason: message },
            ErrorKind::Timeout => ClientError::Timeout { endpoint, after: std::time::Duration::ZERO },
            ErrorKind::OutOfSpace => ClientError::OutOfSpace { endpoint, reason: message },
            ErrorKind::Overloaded => ClientError::Overloaded(message),
            ErrorKind::Denied => ClientError::Denied(message),
            ErrorKind::BadRequest => ClientError::Protocol(message),
            ErrorKind::Internal => ClientError::Internal { endpoint, reason: message },
            ErrorKind::Conflict => ClientError::Conflict(message),
        }
    }
}

/// What a request's or reply's errors say it is ([`DecodeError::what`]).
pub const MALFORMED_MESSAGE: &str = "malformed message";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(MALFORMED_MESSAGE, msg)
}

/// The fields of this encoding, on top of the shared reader.
trait Fields {
    fn field(&mut self) -> Result<Vec<u8>, DecodeError>;
    fn optional(&mut self) -> Result<Option<Vec<u8>>, DecodeError>;
    fn boolean(&mut self) -> Result<bool, DecodeError>;
    fn optional_u64(&mut self) -> Result<Option<u64>, DecodeError>;
    fn version(&mut self) -> Result<Version, DecodeError>;
    fn item(&mut self) -> Result<Option<Item>, DecodeError>;
    fn memnode_stats(&mut self) -> Result<MemnodeStats, DecodeError>;
}

impl Fields for Reader<'_> {
    fn field(&mut self) -> Result<Vec<u8>, DecodeError> {
        Ok(self.bytes_u32(MAX_FIELD_BYTES)?.to_vec())
    }
    fn optional(&mut self) -> Result<Option<Vec<u8>>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.field().map(Some),
            other => Err(bad(format!("presence byte {other}"))),
        }
    }
    fn boolean(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(bad(format!("boolean {other}"))),
        }
    }
    fn optional_u64(&mut self) -> Result<Option<u64>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => self.u64().map(Some),
            other => Err(bad(format!("presence byte {other}"))),
        }
    }
    fn version(&mut self) -> Result<Version, DecodeError> {
        Ok(Version { word: self.u64()?, checksum: self.u64()?, expires_at_ms: self.optional_u64()? })
    }
    fn item(&mut self) -> Result<Option<Item>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(Item { value: self.field()?, expires_at_ms: self.optional_u64()? })),
            other => Err(bad(format!("presence byte {other}"))),
        }
    }
    fn memnode_stats(&mut self) -> Result<MemnodeStats, DecodeError> {
        let endpoint = String::from_utf8(self.field()?).map_err(|_| bad("endpoint is not UTF-8"))?;
        let status = self.u8()?;
        let body = self.field()?;
        let stats = if status == 0 {
            Ok(decode_stats(&body)?)
        } else {
            let kind = ErrorKind::from_code(status).ok_or_else(|| bad(format!("error status {status}")))?;
            Err((kind, String::from_utf8_lossy(&body).into_owned()))
        };
        Ok(MemnodeStats { endpoint, stats })
    }
}

const STATS_BYTES: usize = 64 + 4 + 8 * 8;

fn encode_stats(s: &TableStats) -> Vec<u8> {
    let mut out = Vec::with_capacity(STATS_BYTES);
    out.extend_from_slice(&s.layout.encode());
    out.extend_from_slice(&s.global_depth.to_le_bytes());
    for word in [
        s.items,
        s.slots,
        s.load_factor.to_bits(),
        s.heap.heap_capacity_bytes,
        s.heap.heap_used_bytes,
        s.heap.heap_free_bytes,
        s.heap.subtables,
        s.heap.chunks,
    ] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out
}

fn decode_stats(bytes: &[u8]) -> Result<TableStats, DecodeError> {
    if bytes.len() != STATS_BYTES {
        return Err(bad(format!("table stats of {} bytes, expected {STATS_BYTES}", bytes.len())));
    }
    let layout =
        racekv_hashing::Layout::decode(&bytes[..64]).map_err(|e| bad(format!("table stats: {}", e.message)))?;
    let mut r = Reader::new(MALFORMED_MESSAGE, &bytes[64..]);
    let global_depth = r.u32()?;
    let mut w = [0u64; 8];
    for word in &mut w {
        *word = r.u64()?;
    }
    Ok(TableStats {
        layout,
        global_depth,
        items: w[0],
        slots: w[1],
        load_factor: f64::from_bits(w[2]),
        heap: racekv_hashing::heap::HeapUsage {
            heap_capacity_bytes: w[3],
            heap_used_bytes: w[4],
            heap_free_bytes: w[5],
            subtables: w[6],
            chunks: w[7],
        },
    })
}

fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn put_optional(out: &mut Vec<u8>, bytes: Option<&[u8]>) {
    match bytes {
        None => out.push(0),
        Some(b) => {
            out.push(1);
            put_field(out, b);
        }
    }
}

const GET: u8 = 1;
const PUT: u8 = 2;
const DEL: u8 = 3;
const CAS: u8 = 4;
const MGET: u8 = 5;
const MPUT: u8 = 6;
const LEN: u8 = 7;
const STATS: u8 = 8;
const SCAN: u8 = 9;
const RANDOM_KEY: u8 = 10;
const DELETE_ALL: u8 = 11;
const PUT_OPTS: u8 = 12;
const GET_ITEM: u8 = 13;
const EXPIRE: u8 = 14;
const PART: u8 = 15;
const FETCH_PART: u8 = 16;
const READ_VERSIONED: u8 = 17;
// 18 was COMMIT before versions carried their block's checksum: a peer of an earlier build
// is refused (an unknown request), not misread.
const COMMIT: u8 = 19;

/// The fewest bytes a COMMIT's read takes (an empty key, no expiry): claimed counts are
/// checked against the bytes present before anything is decoded.
const COMMIT_READ_MIN_BYTES: usize = 4 + VERSION_MIN_BYTES;
/// The fewest bytes a COMMIT's write takes (an empty key, a delete, no expiry).
const COMMIT_WRITE_MIN_BYTES: usize = 4 + 1 + 1;

/// The encoded length of a [`Request::Commit`] of `reads` and `writes` (to check it against
/// [`MAX_REQUEST_BYTES`] before building it).
pub fn commit_request_bytes(reads: &[(&[u8], Version)], writes: &[crate::optimistic::Write<'_>]) -> usize {
    let u64_optional = |v: Option<u64>| if v.is_some() { 9 } else { 1 };
    let reads: usize = reads.iter().map(|(key, v)| 4 + key.len() + 16 + u64_optional(v.expires_at_ms)).sum();
    let writes: usize = writes
        .iter()
        .map(|w| 4 + w.key.len() + 1 + w.value.map_or(0, |v| 4 + v.len()) + u64_optional(w.expires_at_ms))
        .sum();
    REQUEST_HEADER_BYTES + 2 + reads + writes
}

/// Appends a PART request to `out` (without building a [`Request`]: the data is copied once).
pub fn encode_part(id: u64, total: u64, offset: u64, bytes: &[u8], out: &mut Vec<u8>) {
    out.reserve(PART_REQUEST_OVERHEAD_BYTES + bytes.len());
    out.extend_from_slice(&[PART, 0, 0, 0]);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&total.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    put_field(out, bytes);
}

/// The byte ranges a message of `total` bytes travels in, at most `max_part_bytes` each
/// (at least one byte each), in order.
pub fn part_ranges(total: usize, max_part_bytes: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = max_part_bytes.max(1);
    (0..total).step_by(step).map(move |start| start..(start + step).min(total))
}

fn mode_code(mode: PutMode) -> u8 {
    match mode {
        PutMode::Upsert => 0,
        PutMode::InsertOnly => 1,
        PutMode::UpdateOnly => 2,
    }
}

fn mode_of(code: u8) -> Result<PutMode, DecodeError> {
    match code {
        0 => Ok(PutMode::Upsert),
        1 => Ok(PutMode::InsertOnly),
        2 => Ok(PutMode::UpdateOnly),
        other => Err(bad(format!("put mode {other}"))),
    }
}

/// The fewest bytes an encoded [`Version`] takes (word, checksum, an absent expiry).
const VERSION_MIN_BYTES: usize = 8 + 8 + 1;

fn put_version(out: &mut Vec<u8>, version: &Version) {
    out.extend_from_slice(&version.word.to_le_bytes());
    out.extend_from_slice(&version.checksum.to_le_bytes());
    put_u64_optional(out, version.expires_at_ms);
}

fn put_u64_optional(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

fn put_item(out: &mut Vec<u8>, item: Option<&Item>) {
    match item {
        None => out.push(0),
        Some(item) => {
            out.push(1);
            put_field(out, &item.value);
            put_u64_optional(out, item.expires_at_ms);
        }
    }
}

impl Request {
    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (kind, mode, count) = match self {
            Request::Get(_) => (GET, 0, 0),
            Request::Put { mode, .. } => (PUT, mode_code(*mode), 0),
            Request::Delete(_) => (DEL, 0, 0),
            Request::CompareAndSwap { .. } => (CAS, 0, 0),
            Request::MultiGet(keys) => (MGET, 0, keys.len()),
            Request::MultiPut(pairs) => (MPUT, 0, pairs.len()),
            Request::Len => (LEN, 0, 0),
            Request::Stats => (STATS, 0, 0),
            Request::Scan { .. } => (SCAN, 0, 0),
            Request::RandomKey => (RANDOM_KEY, 0, 0),
            Request::DeleteAll => (DELETE_ALL, 0, 0),
            Request::PutOpts { options, .. } => (PUT_OPTS, mode_code(options.mode), 0),
            Request::GetItem(_) => (GET_ITEM, 0, 0),
            Request::Expire { .. } => (EXPIRE, 0, 0),
            Request::Part { id, total, offset, bytes } => return encode_part(*id, *total, *offset, bytes, out),
            Request::FetchPart { .. } => (FETCH_PART, 0, 0),
            Request::ReadVersioned(_) => (READ_VERSIONED, 0, 0),
            Request::Commit { reads, writes } => {
                assert!(writes.len() <= MAX_MULTI, "at most {MAX_MULTI} writes per commit");
                (COMMIT, 0, reads.len())
            }
        };
        assert!(count <= MAX_MULTI, "at most {MAX_MULTI} keys per multi-key request");
        out.push(kind);
        out.push(mode);
        out.extend_from_slice(&(count as u16).to_le_bytes());
        match self {
            Request::Get(key) | Request::Delete(key) | Request::GetItem(key) | Request::ReadVersioned(key) => {
                put_field(out, key)
            }
            Request::Put { key, value, .. } => {
                put_field(out, key);
                put_field(out, value);
            }
            Request::CompareAndSwap { key, expected, new } => {
                put_field(out, key);
                put_optional(out, expected.as_deref());
                put_optional(out, new.as_deref());
            }
            Request::MultiGet(keys) => keys.iter().for_each(|k| put_field(out, k)),
            Request::MultiPut(pairs) => pairs.iter().for_each(|(k, v)| {
                put_field(out, k);
                put_field(out, v);
            }),
            Request::Scan { cursor, count, max_bytes } => {
                out.extend_from_slice(&cursor.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
                out.extend_from_slice(&max_bytes.to_le_bytes());
            }
            Request::Len | Request::Stats | Request::RandomKey | Request::DeleteAll => {}
            Request::PutOpts { key, value, options } => {
                put_field(out, key);
                put_field(out, value);
                match options.expiry {
                    Expiry::Never => out.push(0),
                    Expiry::At(at) => {
                        out.push(1);
                        out.extend_from_slice(&at.to_le_bytes());
                    }
                    Expiry::Keep => out.push(2),
                }
                out.push(u8::from(options.return_old));
            }
            Request::Expire { key, change } => {
                put_field(out, key);
                match change {
                    ExpiryChange::At { at_ms, condition } => {
                        out.push(0);
                        out.push(condition.bits());
                        out.extend_from_slice(&at_ms.to_le_bytes());
                    }
                    ExpiryChange::Persist => out.push(1),
                }
            }
            Request::Part { .. } => unreachable!("encoded above"),
            Request::FetchPart { id, offset, max_len } => {
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&max_len.to_le_bytes());
            }
            Request::Commit { reads, writes } => {
                out.extend_from_slice(&(writes.len() as u16).to_le_bytes());
                for (key, version) in reads {
                    put_field(out, key);
                    put_version(out, version);
                }
                for (key, value, expires_at_ms) in writes {
                    put_field(out, key);
                    put_optional(out, value.as_deref());
                    put_u64_optional(out, *expires_at_ms);
                }
            }
        }
    }

    /// Parses a whole request, checking every length (see the module documentation).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() > MAX_REQUEST_BYTES {
            return Err(bad(format!("request of {} bytes exceeds {MAX_REQUEST_BYTES}", bytes.len())));
        }
        let mut r = Reader::new(MALFORMED_MESSAGE, bytes);
        let kind = r.u8()?;
        let mode = r.u8()?;
        let count = r.u16()? as usize;
        if count > MAX_MULTI {
            return Err(bad(format!("{count} keys exceed {MAX_MULTI}")));
        }
        if (mode != 0 && kind != PUT && kind != PUT_OPTS)
            || (count != 0 && kind != MGET && kind != MPUT && kind != COMMIT)
        {
            return Err(bad("mode or count set on a request that takes none"));
        }
        let request = match kind {
            GET => Request::Get(r.field()?),
            DEL => Request::Delete(r.field()?),
            PUT => Request::Put { key: r.field()?, value: r.field()?, mode: mode_of(mode)? },
            PUT_OPTS => {
                let (key, value) = (r.field()?, r.field()?);
                let expiry = match r.u8()? {
                    0 => Expiry::Never,
                    1 => Expiry::At(r.u64()?),
                    2 => Expiry::Keep,
                    other => return Err(bad(format!("expiry kind {other}"))),
                };
                let options = PutOptions { mode: mode_of(mode)?, expiry, return_old: r.boolean()? };
                Request::PutOpts { key, value, options }
            }
            GET_ITEM => Request::GetItem(r.field()?),
            EXPIRE => {
                let key = r.field()?;
                let change = match r.u8()? {
                    0 => {
                        let bits = r.u8()?;
                        let condition = ExpireCondition::from_bits(bits)
                            .ok_or_else(|| bad(format!("expire condition {bits:#x} (NX alone, GT or LT with XX)")))?;
                        ExpiryChange::At { at_ms: r.u64()?, condition }
                    }
                    1 => ExpiryChange::Persist,
                    other => return Err(bad(format!("expiry change {other}"))),
                };
                Request::Expire { key, change }
            }
            CAS => Request::CompareAndSwap { key: r.field()?, expected: r.optional()?, new: r.optional()? },
            MGET => Request::MultiGet((0..count).map(|_| r.field()).collect::<Result<_, _>>()?),
            MPUT => Request::MultiPut((0..count).map(|_| Ok((r.field()?, r.field()?))).collect::<Result<_, _>>()?),
            LEN => Request::Len,
            STATS => Request::Stats,
            SCAN => {
                let (cursor, count, max_bytes) = (r.u64()?, r.u32()?, r.u32()?);
                if count == 0 || count as usize > MAX_MULTI {
                    return Err(bad(format!("SCAN of {count} keys; allowed 1..={MAX_MULTI}")));
                }
                if max_bytes == 0 || max_bytes > MAX_SCAN_REPLY_BYTES {
                    return Err(bad(format!("SCAN reply of {max_bytes} bytes; allowed 1..={MAX_SCAN_REPLY_BYTES}")));
                }
                Request::Scan { cursor, count, max_bytes }
            }
            RANDOM_KEY => Request::RandomKey,
            DELETE_ALL => Request::DeleteAll,
            PART => Request::Part { id: r.u64()?, total: r.u64()?, offset: r.u64()?, bytes: r.field()? },
            FETCH_PART => Request::FetchPart { id: r.u64()?, offset: r.u64()?, max_len: r.u32()? },
            READ_VERSIONED => Request::ReadVersioned(r.field()?),
            COMMIT => {
                let writes = r.u16()? as usize;
                if writes > MAX_MULTI {
                    return Err(bad(format!("{writes} writes exceed {MAX_MULTI}")));
                }
                if count * COMMIT_READ_MIN_BYTES + writes * COMMIT_WRITE_MIN_BYTES > r.remaining() {
                    return Err(bad(format!(
                        "a commit of {count} reads and {writes} writes in {} bytes",
                        r.remaining()
                    )));
                }
                let reads = (0..count)
                    .map(|_| {
                        let key = r.field()?;
                        Ok((key, r.version()?))
                    })
                    .collect::<Result<_, DecodeError>>()?;
                let writes =
                    (0..writes)
                        .map(|_| Ok((r.field()?, r.optional()?, r.optional_u64()?)))
                        .collect::<Result<_, DecodeError>>()?;
                Request::Commit { reads, writes }
            }
            other => return Err(bad(format!("unknown request kind {other}"))),
        };
        r.finish()?;
        Ok(request)
    }
}

const VALUE: u8 = 1;
const DONE: u8 = 2;
const VALUES: u8 = 3;
const COUNT: u8 = 4;
const OK: u8 = 5;
const STATS_REPLY: u8 = 6;
const KEYS: u8 = 7;
const PUT_REPLY: u8 = 8;
const ITEM: u8 = 9;
const STAGED: u8 = 10;
const PART_REPLY: u8 = 11;
// 12 was VERSIONED before versions carried their block's checksum (see COMMIT).
const VERSIONED: u8 = 13;

impl Reply {
    /// Appends the reply's encoding to `out` (an error's message cut to 4096 bytes).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Error(kind, message) => {
                out.push(*kind as u8);
                out.push(0);
                out.extend_from_slice(&0u16.to_le_bytes());
                out.extend_from_slice(&message.as_bytes()[..message.len().min(4096)]);
            }
            Reply::Value(v) => {
                out.extend_from_slice(&[0, VALUE, 0, 0]);
                put_optional(out, v.as_deref());
            }
            Reply::Done(b) => out.extend_from_slice(&[0, DONE, 0, 0, u8::from(*b)]),
            Reply::Values(values) => {
                assert!(values.len() <= MAX_MULTI);
                out.extend_from_slice(&[0, VALUES]);
                out.extend_from_slice(&(values.len() as u16).to_le_bytes());
                values.iter().for_each(|v| put_optional(out, v.as_deref()));
            }
            Reply::Count(n) => {
                out.extend_from_slice(&[0, COUNT, 0, 0]);
                out.extend_from_slice(&n.to_le_bytes());
            }
            Reply::Ok => out.extend_from_slice(&[0, OK, 0, 0]),
            Reply::Keys { cursor, keys } => {
                assert!(keys.len() <= MAX_MULTI);
                out.extend_from_slice(&[0, KEYS]);
                out.extend_from_slice(&(keys.len() as u16).to_le_bytes());
                out.extend_from_slice(&cursor.to_le_bytes());
                keys.iter().for_each(|k| put_field(out, k));
            }
            Reply::Put(result) => {
                let outcome = match result.outcome {
                    PutOutcome::Inserted => 0,
                    PutOutcome::Updated => 1,
                    PutOutcome::NotApplied => 2,
                };
                out.extend_from_slice(&[0, PUT_REPLY, 0, 0, outcome]);
                put_optional(out, result.old.as_deref());
            }
            Reply::Item(item) => {
                out.extend_from_slice(&[0, ITEM, 0, 0]);
                put_item(out, item.as_ref());
            }
            Reply::Versioned { item, version } => {
                out.extend_from_slice(&[0, VERSIONED, 0, 0]);
                put_version(out, version);
                put_item(out, item.as_ref());
            }
            Reply::Staged { id, total } => {
                out.extend_from_slice(&[0, STAGED, 0, 0]);
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&total.to_le_bytes());
            }
            Reply::Part(bytes) => {
                out.extend_from_slice(&[0, PART_REPLY, 0, 0]);
                put_field(out, bytes);
            }
            Reply::Stats(entries) => {
                assert!(entries.len() <= MAX_MULTI);
                out.extend_from_slice(&[0, STATS_REPLY]);
                out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                for entry in entries {
                    put_field(out, entry.endpoint.as_bytes());
                    match &entry.stats {
                        Ok(stats) => {
                            out.push(0);
                            put_field(out, &encode_stats(stats));
                        }
                        Err((kind, message)) => {
                            out.push(*kind as u8);
                            put_field(out, &message.as_bytes()[..message.len().min(4096)]);
                        }
                    }
                }
            }
        }
    }

    /// Decodes a reply of any size (a multi-get's may exceed [`MAX_REQUEST_BYTES`]; each
    /// field is checked against [`MAX_FIELD_BYTES`] and the bytes present).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(MALFORMED_MESSAGE, bytes);
        let status = r.u8()?;
        let kind = r.u8()?;
        let count = r.u16()? as usize;
        if status != 0 {
            let kind = ErrorKind::from_code(status).ok_or_else(|| bad(format!("error status {status}")))?;
            return Ok(Reply::Error(kind, String::from_utf8_lossy(r.rest()).into_owned()));
        }
        if count > MAX_MULTI || (count != 0 && kind != VALUES && kind != STATS_REPLY && kind != KEYS) {
            return Err(bad(format!("count {count} on reply kind {kind}")));
        }
        let reply = match kind {
            VALUE => Reply::Value(r.optional()?),
            DONE => Reply::Done(r.boolean()?),
            VALUES => Reply::Values((0..count).map(|_| r.optional()).collect::<Result<_, _>>()?),
            COUNT => Reply::Count(r.u64()?),
            OK => Reply::Ok,
            PUT_REPLY => {
                let outcome = match r.u8()? {
                    0 => PutOutcome::Inserted,
                    1 => PutOutcome::Updated,
                    2 => PutOutcome::NotApplied,
                    other => return Err(bad(format!("put outcome {other}"))),
                };
                Reply::Put(PutResult { outcome, old: r.optional()? })
            }
            ITEM => Reply::Item(r.item()?),
            VERSIONED => {
                let version = r.version()?;
                Reply::Versioned { item: r.item()?, version }
            }
            STATS_REPLY => Reply::Stats((0..count).map(|_| r.memnode_stats()).collect::<Result<_, _>>()?),
            KEYS => {
                let cursor = r.u64()?;
                Reply::Keys { cursor, keys: (0..count).map(|_| r.field()).collect::<Result<_, _>>()? }
            }
            STAGED => Reply::Staged { id: r.u64()?, total: r.u64()? },
            PART_REPLY => Reply::Part(r.field()?),
            other => return Err(bad(format!("unknown reply kind {other}"))),
        };
        r.finish()?;
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..40)
    }

    fn request() -> impl Strategy<Value = Request> {
        let mode = prop_oneof![Just(PutMode::Upsert), Just(PutMode::InsertOnly), Just(PutMode::UpdateOnly)];
        prop_oneof![
            bytes().prop_map(Request::Get),
            (bytes(), bytes(), mode).prop_map(|(key, value, mode)| Request::Put { key, value, mode }),
            bytes().prop_map(Request::Delete),
            (bytes(), proptest::option::of(bytes()), proptest::option::of(bytes()))
                .prop_map(|(key, expected, new)| Request::CompareAndSwap { key, expected, new }),
            proptest::collection::vec(bytes(), 0..10).prop_map(Request::MultiGet),
            proptest::collection::vec((bytes(), bytes()), 0..10).prop_map(Request::MultiPut),
            Just(Request::Len),
            Just(Request::Stats),
            (any::<u64>(), 1..=MAX_MULTI as u32, 1..=MAX_SCAN_REPLY_BYTES)
                .prop_map(|(cursor, count, max_bytes)| Request::Scan { cursor, count, max_bytes }),
            Just(Request::RandomKey),
            Just(Request::DeleteAll),
            (bytes(), bytes(), put_mode(), expiry(), any::<bool>()).prop_map(
                |(key, value, mode, expiry, return_old)| {
                    Request::PutOpts { key, value, options: PutOptions { mode, expiry, return_old } }
                }
            ),
            bytes().prop_map(Request::GetItem),
            (bytes(), change()).prop_map(|(key, change)| Request::Expire { key, change }),
            (any::<u64>(), any::<u64>(), any::<u64>(), bytes()).prop_map(|(id, total, offset, bytes)| Request::Part {
                id,
                total,
                offset,
                bytes
            }),
            (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(id, offset, max_len)| Request::FetchPart {
                id,
                offset,
                max_len
            }),
            bytes().prop_map(Request::ReadVersioned),
            (
                proptest::collection::vec((bytes(), version()), 0..6),
                proptest::collection::vec(
                    (bytes(), proptest::option::of(bytes()), proptest::option::of(any::<u64>())),
                    0..6
                )
            )
                .prop_map(|(reads, writes)| Request::Commit { reads, writes }),
        ]
    }

    fn version() -> impl Strategy<Value = Version> {
        (any::<u64>(), any::<u64>(), proptest::option::of(any::<u64>()))
            .prop_map(|(word, checksum, expires_at_ms)| Version { word, checksum, expires_at_ms })
    }

    fn item() -> impl Strategy<Value = Option<Item>> {
        proptest::option::of((bytes(), proptest::option::of(any::<u64>())))
            .prop_map(|item| item.map(|(value, expires_at_ms)| Item { value, expires_at_ms }))
    }

    fn put_mode() -> impl Strategy<Value = PutMode> {
        prop_oneof![Just(PutMode::Upsert), Just(PutMode::InsertOnly), Just(PutMode::UpdateOnly)]
    }

    fn expiry() -> impl Strategy<Value = Expiry> {
        prop_oneof![Just(Expiry::Never), any::<u64>().prop_map(Expiry::At), Just(Expiry::Keep)]
    }

    fn change() -> impl Strategy<Value = ExpiryChange> {
        let condition = (0u8..16).prop_filter_map("a valid combination", ExpireCondition::from_bits);
        prop_oneof![
            (any::<u64>(), condition).prop_map(|(at_ms, condition)| ExpiryChange::At { at_ms, condition }),
            Just(ExpiryChange::Persist),
        ]
    }

    fn reply() -> impl Strategy<Value = Reply> {
        prop_oneof![
            proptest::option::of(bytes()).prop_map(Reply::Value),
            any::<bool>().prop_map(Reply::Done),
            (
                prop_oneof![Just(PutOutcome::Inserted), Just(PutOutcome::Updated), Just(PutOutcome::NotApplied)],
                proptest::option::of(bytes())
            )
                .prop_map(|(outcome, old)| Reply::Put(PutResult { outcome, old })),
            item().prop_map(Reply::Item),
            (item(), version()).prop_map(|(item, version)| Reply::Versioned { item, version }),
            proptest::collection::vec(proptest::option::of(bytes()), 0..10).prop_map(Reply::Values),
            any::<u64>().prop_map(Reply::Count),
            Just(Reply::Ok),
            "[a-z ]{0,30}".prop_map(|m| Reply::Error(ErrorKind::Unavailable, m)),
            (any::<u64>(), any::<u64>()).prop_map(|(id, total)| Reply::Staged { id, total }),
            bytes().prop_map(Reply::Part),
            (any::<u64>(), proptest::collection::vec(bytes(), 0..10))
                .prop_map(|(cursor, keys)| Reply::Keys { cursor, keys }),
            proptest::collection::vec(("[a-z:0-9]{0,20}", any::<u64>(), proptest::option::of("[a-z ]{0,20}")), 0..4)
                .prop_map(|entries| Reply::Stats(
                    entries
                        .into_iter()
                        .map(|(endpoint, items, error)| MemnodeStats {
                            endpoint,
                            stats: match error {
                                Some(message) => Err((ErrorKind::Timeout, message)),
                                None => Ok(sample_stats(items)),
                            },
                        })
                        .collect()
                )),
        ]
    }

    fn sample_stats(items: u64) -> TableStats {
        TableStats {
            layout: racekv_hashing::layout::Layout::for_region(16 << 20, 4, 64 << 10).unwrap(),
            global_depth: 3,
            items,
            slots: 1 << 12,
            load_factor: items as f64 / 4096.0,
            heap: Default::default(),
        }
    }

    proptest! {
        #[test]
        fn requests_round_trip(req in request()) {
            let mut out = Vec::new();
            req.encode(&mut out);
            prop_assert_eq!(Request::decode(&out).unwrap(), req);
        }

        #[test]
        fn replies_round_trip(rep in reply()) {
            let mut out = Vec::new();
            rep.encode(&mut out);
            prop_assert_eq!(Reply::decode(&out).unwrap(), rep);
        }

        #[test]
        fn decoders_never_panic(junk in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let _ = Request::decode(&junk);
            let _ = Reply::decode(&junk);
        }

        /// Arbitrary bytes after a valid header of every kind (so decoding gets past it).
        #[test]
        fn decoders_never_panic_past_the_header(kind in 0u8..24, mode in 0u8..4, count in 0u16..8,
                                                 junk in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut bytes = vec![kind, mode];
            bytes.extend_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&junk);
            let _ = Request::decode(&bytes);
            bytes[0] = 0;
            bytes[1] = kind;
            let _ = Reply::decode(&bytes);
        }

        /// Any request, split into PART requests (each through its own encoding) and put
        /// back together, is the original.
        #[test]
        fn requests_in_parts_reassemble(req in request(), max_part in 1usize..64, id in any::<u64>()) {
            let mut whole = Vec::new();
            req.encode(&mut whole);
            let mut assembled = Vec::new();
            for range in part_ranges(whole.len(), max_part) {
                prop_assert!(!range.is_empty() && range.len() <= max_part);
                let mut msg = Vec::new();
                encode_part(id, whole.len() as u64, range.start as u64, &whole[range.clone()], &mut msg);
                prop_assert_eq!(msg.len(), PART_REQUEST_OVERHEAD_BYTES + range.len());
                match Request::decode(&msg).unwrap() {
                    Request::Part { id: got, total, offset, bytes } => {
                        prop_assert_eq!((got, total, offset as usize), (id, whole.len() as u64, assembled.len()));
                        assembled.extend_from_slice(&bytes);
                    }
                    other => prop_assert!(false, "{other:?}"),
                }
            }
            prop_assert_eq!(&assembled, &whole);
            prop_assert_eq!(Request::decode(&assembled).unwrap(), req);
        }

        /// Arbitrary bytes after a COMMIT's header and write count (small counts, so the
        /// decoder gets into the reads and writes).
        #[test]
        fn commit_decoding_never_panics(reads in 0u16..6, writes in 0u16..6,
                                        junk in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut bytes = vec![COMMIT, 0];
            bytes.extend_from_slice(&reads.to_le_bytes());
            bytes.extend_from_slice(&writes.to_le_bytes());
            bytes.extend_from_slice(&junk);
            let _ = Request::decode(&bytes);
        }

        /// What [`commit_request_bytes`] says a commit takes is its encoding's length.
        #[test]
        fn commit_lengths_are_exact(req in request()) {
            if let Request::Commit { reads, writes } = &req {
                let mut out = Vec::new();
                req.encode(&mut out);
                let reads: Vec<(&[u8], Version)> = reads.iter().map(|(k, v)| (k.as_slice(), *v)).collect();
                let writes: Vec<crate::optimistic::Write<'_>> = writes
                    .iter()
                    .map(|(k, v, at)| crate::optimistic::Write { key: k, value: v.as_deref(), expires_at_ms: *at })
                    .collect();
                prop_assert_eq!(commit_request_bytes(&reads, &writes), out.len());
            }
        }

        #[test]
        fn truncations_are_errors(req in request()) {
            let mut out = Vec::new();
            req.encode(&mut out);
            for cut in 0..out.len() {
                prop_assert!(Request::decode(&out[..cut]).is_err());
            }
        }
    }

    #[test]
    fn scan_requests_out_of_bounds_are_refused() {
        let encoded = |count: u32, max_bytes: u32| {
            let mut out = Vec::new();
            Request::Scan { cursor: 7, count, max_bytes }.encode(&mut out);
            out
        };
        assert!(Request::decode(&encoded(1, 1)).is_ok());
        assert!(Request::decode(&encoded(MAX_MULTI as u32, MAX_SCAN_REPLY_BYTES)).is_ok());
        for (count, max_bytes) in [(0, 100), (MAX_MULTI as u32 + 1, 100), (10, 0), (10, MAX_SCAN_REPLY_BYTES + 1)] {
            assert!(Request::decode(&encoded(count, max_bytes)).is_err(), "count {count}, {max_bytes} bytes");
        }
        // A KEYS reply claiming more keys than it carries, or more than MAX_MULTI.
        let mut reply = Vec::new();
        Reply::Keys { cursor: 1, keys: vec![b"a".to_vec()] }.encode(&mut reply);
        reply[2] = 2;
        assert!(Reply::decode(&reply).is_err());
        reply[2..4].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Reply::decode(&reply).is_err());
    }

    #[test]
    fn bad_expiry_fields_are_refused() {
        let encoded = |r: &Request| {
            let mut out = Vec::new();
            r.encode(&mut out);
            out
        };
        let change = ExpiryChange::At { at_ms: 5, condition: ExpireCondition::NX };
        let mut bytes = encoded(&Request::Expire { key: b"k".to_vec(), change });
        let bits = 4 + 4 + 1 + 1; // header, key, change kind: the condition byte
        assert_eq!(bytes[bits], 1);
        bytes[bits] = 0b0011; // NX with XX
        assert!(Request::decode(&bytes).unwrap_err().message.contains("expire condition"));
        bytes[bits] = 0x10;
        assert!(Request::decode(&bytes).is_err());
        let options = PutOptions { expiry: Expiry::Keep, ..PutOptions::default() };
        let mut bytes = encoded(&Request::PutOpts { key: b"k".to_vec(), value: b"v".to_vec(), options });
        let kind = 4 + 5 + 5;
        assert_eq!(bytes[kind], 2);
        bytes[kind] = 3;
        assert!(Request::decode(&bytes).unwrap_err().message.contains("expiry kind"));
        bytes[kind] = 2;
        *bytes.last_mut().unwrap() = 2; // return-old is a boolean
        assert!(Request::decode(&bytes).is_err());
        bytes[1] = 3; // put mode
        assert!(Request::decode(&bytes).is_err());
    }

    #[test]
    fn fields_may_take_the_tables_limits() {
        const { assert!(MAX_FIELD_BYTES >= MAX_KEY_BYTES && MAX_FIELD_BYTES >= MAX_VALUE_BYTES) };
        let mut msg = Vec::new();
        let value = vec![5u8; (8 << 20) + 1];
        Request::Put { key: b"k".to_vec(), value: value.clone(), mode: PutMode::Upsert }.encode(&mut msg);
        assert!(msg.len() > MAX_MESSAGE_BYTES);
        assert!(matches!(Request::decode(&msg).unwrap(), Request::Put { value: v, .. } if v == value));
        // A length past the limit is refused before anything is copied.
        let mut msg = vec![GET, 0, 0, 0];
        msg.extend_from_slice(&(MAX_FIELD_BYTES as u32 + 1).to_le_bytes());
        assert!(Request::decode(&msg).unwrap_err().message.contains("exceeds"));
    }

    #[test]
    fn commits_out_of_bounds_are_refused() {
        let encoded = |r: &Request| {
            let mut out = Vec::new();
            r.encode(&mut out);
            out
        };
        let read = (b"r".to_vec(), Version { word: 7, checksum: 8, expires_at_ms: Some(9) });
        let write = (b"w".to_vec(), Some(b"v".to_vec()), None);
        let commit = Request::Commit { reads: vec![read.clone(); 2], writes: vec![write.clone(); 3] };
        let bytes = encoded(&commit);
        assert_eq!(Request::decode(&bytes).unwrap(), commit);
        // Counts claiming more than the bytes carry, or more than MAX_MULTI, are refused
        // before anything is decoded.
        for (reads, writes) in
            [(3u16, 3u16), (2, 4), (MAX_MULTI as u16 + 1, 0), (0, MAX_MULTI as u16 + 1), (u16::MAX, u16::MAX)]
        {
            let mut bytes = bytes.clone();
            bytes[2..4].copy_from_slice(&reads.to_le_bytes());
            bytes[4..6].copy_from_slice(&writes.to_le_bytes());
            assert!(Request::decode(&bytes).is_err(), "{reads} reads, {writes} writes");
        }
        // A mode byte, bad presence bytes.
        let mut bad_mode = bytes.clone();
        bad_mode[1] = 1;
        assert!(Request::decode(&bad_mode).is_err());
        let value_presence = bytes.len() - 1 - (4 + 1) - 1; // the last write's: no expiry, then "v"
        assert_eq!(bytes[value_presence], 1);
        let mut bad_presence = bytes.clone();
        bad_presence[value_presence] = 2;
        assert!(Request::decode(&bad_presence).is_err());
        // A VERSIONED reply with a bad presence byte (the version's expiry, the item).
        let mut reply = Vec::new();
        Reply::Versioned { item: None, version: Version::ABSENT }.encode(&mut reply);
        assert_eq!(reply.len(), 4 + 8 + 8 + 1 + 1);
        for at in [20, 21] {
            let mut bad = reply.clone();
            bad[at] = 2;
            assert!(Reply::decode(&bad).is_err());
        }
    }

    #[test]
    fn huge_claimed_lengths_allocate_nothing() {
        let mut msg = vec![GET, 0, 0, 0];
        msg.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Request::decode(&msg).is_err());
        let mut msg = vec![MGET, 0];
        msg.extend_from_slice(&u16::MAX.to_le_bytes());
        assert!(Request::decode(&msg).is_err());
    }
}
