//! The FLOCK message: many requests (or responses) coalesced into one write.
//!
//! ```text
//! header  (32 B): canary u32 | len u32 | count u16 | kind u8 | flags u8 | credits u32 |
//!                 ack u64 | degree_x16 u16 | rate_krps u16 | zero u32
//! entries (16 B each, `count` of them):
//!                 size u32 | thread u16 | rpc u16 | seq u32 | status u16 | zero u16
//! data:           the entries' payloads back to back, in entry order, then zero padding to 8 B
//! trailer  (8 B): zero u32 | canary u32        (the canary is the message's last 4 bytes)
//! ```
//!
//! All integers are little-endian; `len` is the whole message (header to trailer) and a
//! multiple of 8. The canary is derived from the lane's key and the message's number on the
//! lane ([`canary`]), so a receiver polling a ring knows which value to expect: a header
//! canary that matches says a message has started to arrive, a matching trailing canary says
//! it arrived whole (an RDMA WRITE, and a store into shared memory published with release
//! order, lands its last bytes last), and a stale message left over from an earlier trip
//! around the ring never matches.
//!
//! `kind` is request, response or wrap (ring carriers: "continue at offset 0"). In a request,
//! flag [`FLAG_RENEW`] asks for credits and `degree_x16`/`rate_krps` report the sender's
//! coalescing degree (x16) and request rate (thousands per second) to the scheduler; `ack` is
//! the sender's own response-ring head on verbs (how the region server, which writes
//! responses into that ring, learns what it may overwrite), 0 elsewhere. In a response, flag
//! [`FLAG_GRANT`] carries the scheduler's answer in `credits` (0 = refused: the lane is
//! inactive until a later renewal is granted), and `ack` is the receiver's ring head (bytes
//! of the request ring consumed), which is how a ring writer on the other side learns what it
//! may overwrite. (On verbs, renewals and grants travel as RDMA WRITEs with immediate beside
//! the messages instead of as these flags: `flock/verbs.rs`.) Request entries have status 0;
//! a response entry's status is 0 for success or an [`crate::RpcStatus`] code with a UTF-8
//! message as its data.
//!
//! Every byte comes from the peer and is untrusted: [`decode`] checks canaries, length,
//! count, sizes, reserved bytes and limits before anything acts on the message, and never
//! panics (fuzzed: `fuzz/fuzz_targets/flock_messages.rs`; property-tested below).

use crate::decode::{DecodeError, Reader};

/// Bytes of a message header.
pub const HEADER_BYTES: usize = 32;
/// Bytes of one entry (a request's or response's metadata).
pub const ENTRY_BYTES: usize = 16;
/// Bytes of the trailer (zero word, then the canary).
pub const TRAILER_BYTES: usize = 8;
/// Most requests coalesced into one message.
pub const MAX_ENTRIES: usize = 1024;
/// Largest message: one maximal RPC payload plus framing, or many small ones.
pub const MAX_MESSAGE_BYTES: usize = crate::wire::MAX_RPC_BYTES + 64 * 1024;

/// [`Header::kind`]: the message carries requests.
pub const KIND_REQUEST: u8 = 1;
/// [`Header::kind`]: the message carries responses.
pub const KIND_RESPONSE: u8 = 2;
/// Ring carriers: nothing more fits before the end of the ring; the next message is at 0.
pub const KIND_WRAP: u8 = 3;

/// Request: the sender asks for credits (and reports its statistics).
pub const FLAG_RENEW: u8 = 1;
/// Response: `credits` holds the scheduler's answer to a renewal.
pub const FLAG_GRANT: u8 = 2;
const KNOWN_FLAGS: u8 = FLAG_RENEW | FLAG_GRANT;

/// The canary of message number `number` on a lane whose key is `lane_key` (never zero, so
/// zeroed ring memory never looks like a message).
pub fn canary(lane_key: u32, number: u64) -> u32 {
    let mixed = xxhash_rust::xxh3::xxh3_64(&[lane_key.to_le_bytes(), (number as u32).to_le_bytes()].concat());
    (mixed as u32) | 1
}

/// The fixed part of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    /// The message's canary ([`canary`]); the trailer repeats it.
    pub canary: u32,
    /// Bytes of the whole message, trailer included (a multiple of 8).
    pub len: u32,
    /// Entries in the message.
    pub count: u16,
    /// [`KIND_REQUEST`], [`KIND_RESPONSE`] or [`KIND_WRAP`].
    pub kind: u8,
    /// [`FLAG_RENEW`], [`FLAG_GRANT`].
    pub flags: u8,
    /// Credits asked for (renewal) or granted (grant).
    pub credits: u32,
    /// The writer's own ring head (bytes of the peer's messages it consumed), 0 where unused; see the module doc.
    pub ack: u64,
    /// Requests: the sender's coalescing degree (requests per message) times 16.
    pub degree_x16: u16,
    /// Requests: the sender's request rate in thousands per second.
    pub rate_krps: u16,
}

/// Per-request (or per-response) metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    /// Bytes of the payload.
    pub size: u32,
    /// The calling thread's slot on the connection.
    pub thread: u16,
    /// The RPC method.
    pub rpc: u16,
    /// The request's sequence number in its thread (a response echoes it).
    pub seq: u32,
    /// Response status (0: success); always 0 in a request.
    pub status: u16,
}

/// What a refused message's errors say it is ([`DecodeError::what`]); the lane it came on
/// is closed.
pub const BAD_MESSAGE: &str = "bad flock message";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(BAD_MESSAGE, msg)
}

/// An entry's metadata and its reserved bytes (the caller judges those: [`decode`] refuses
/// them unless zero, [`Message::entries`] reads entries `decode` checked).
fn read_entry(r: &mut Reader<'_>) -> Result<(Entry, [u8; 2]), DecodeError> {
    let entry = Entry { size: r.u32()?, thread: r.u16()?, rpc: r.u16()?, seq: r.u32()?, status: r.u16()? };
    Ok((entry, r.array()?))
}

fn padded(len: usize) -> usize {
    len.next_multiple_of(8)
}

/// Bytes of a message holding `count` entries with `data` payload bytes in all.
pub fn message_len(count: usize, data: usize) -> usize {
    HEADER_BYTES + count * ENTRY_BYTES + padded(data) + TRAILER_BYTES
}

/// Reads just the header (for carriers that must learn `len` before the rest arrives).
/// Checks what can be checked without the body: canary (when `expect` is given), kind,
/// flags, reserved bytes and the length bounds.
pub fn decode_header(bytes: &[u8], expect: Option<u32>, max_len: usize) -> Result<Header, DecodeError> {
    let mut r = Reader::new(BAD_MESSAGE, bytes.get(..HEADER_BYTES).ok_or_else(|| bad("short header"))?);
    let h = Header {
        canary: r.u32()?,
        len: r.u32()?,
        count: r.u16()?,
        kind: r.u8()?,
        flags: r.u8()?,
        credits: r.u32()?,
        ack: r.u64()?,
        degree_x16: r.u16()?,
        rate_krps: r.u16()?,
    };
    r.zeros(4).map_err(|_| bad("reserved header bytes are not zero"))?;
    if h.canary == 0 {
        return Err(bad("zero canary"));
    }
    if let Some(want) = expect {
        if h.canary != want {
            return Err(bad(format!("header canary {:#010x}, expected {want:#010x}", h.canary)));
        }
    }
    if !matches!(h.kind, KIND_REQUEST | KIND_RESPONSE | KIND_WRAP) {
        return Err(bad(format!("unknown kind {}", h.kind)));
    }
    if h.flags & !KNOWN_FLAGS != 0 {
        return Err(bad(format!("unknown flags {:#x}", h.flags)));
    }
    let len = h.len as usize;
    if len < HEADER_BYTES + TRAILER_BYTES || !len.is_multiple_of(8) || len > max_len.min(MAX_MESSAGE_BYTES) {
        return Err(bad(format!("length {len} is not a multiple of 8 within {}..={max_len}", HEADER_BYTES + 8)));
    }
    if h.count as usize > MAX_ENTRIES {
        return Err(bad(format!("{} entries; at most {MAX_ENTRIES}", h.count)));
    }
    if HEADER_BYTES + h.count as usize * ENTRY_BYTES + TRAILER_BYTES > len {
        return Err(bad(format!("{} entries do not fit in {len} bytes", h.count)));
    }
    if h.kind == KIND_WRAP && (h.count != 0 || len != HEADER_BYTES + TRAILER_BYTES) {
        return Err(bad("a wrap marker carries nothing"));
    }
    Ok(h)
}

/// A decoded, fully checked message; borrowing the bytes it came in.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// The message's header.
    pub header: Header,
    bytes: &'a [u8],
}

impl<'a> Message<'a> {
    /// The entries with their payloads, in order (already checked by [`decode`]).
    pub fn entries(&self) -> impl Iterator<Item = (Entry, &'a [u8])> + 'a {
        let count = self.header.count as usize;
        let (entries, data) = self.bytes[HEADER_BYTES..].split_at(count * ENTRY_BYTES);
        let (mut entries, mut data) = (Reader::new(BAD_MESSAGE, entries), Reader::new(BAD_MESSAGE, data));
        (0..count).map(move |_| {
            let (entry, _) = read_entry(&mut entries).expect("decode checked the entries");
            (entry, data.take(entry.size as usize).expect("decode checked the sizes"))
        })
    }

    /// Entries in the message.
    pub fn count(&self) -> usize {
        self.header.count as usize
    }
}

/// Checks a whole message: `bytes` must be exactly one message, with canary `expect` (when
/// given) in header and trailer, consistent sizes, zero reserved bytes and padding, and
/// request entries with status 0.
pub fn decode(bytes: &[u8], expect: Option<u32>, max_len: usize) -> Result<Message<'_>, DecodeError> {
    let header = decode_header(bytes, expect, max_len)?;
    let len = header.len as usize;
    if bytes.len() != len {
        return Err(bad(format!("message says {len} bytes, got {}", bytes.len())));
    }
    let mut trailer = Reader::new(BAD_MESSAGE, &bytes[len - TRAILER_BYTES..]);
    trailer.zeros(4).map_err(|_| bad("reserved trailer bytes are not zero"))?;
    let tail = trailer.u32()?;
    if tail != header.canary {
        return Err(bad(format!("trailing canary {tail:#010x} does not match {:#010x}", header.canary)));
    }
    let count = header.count as usize;
    let mut entries = Reader::new(BAD_MESSAGE, &bytes[HEADER_BYTES..HEADER_BYTES + count * ENTRY_BYTES]);
    let mut data = 0usize;
    for i in 0..count {
        let (Entry { size, status, .. }, reserved) = read_entry(&mut entries)?;
        let size = size as usize;
        if reserved != [0; 2] {
            return Err(bad(format!("entry {i}: reserved bytes are not zero")));
        }
        if header.kind == KIND_REQUEST && status != 0 {
            return Err(bad(format!("request entry {i} has status {status}")));
        }
        if size > crate::wire::MAX_RPC_BYTES {
            return Err(bad(format!("entry {i} of {size} bytes exceeds {}", crate::wire::MAX_RPC_BYTES)));
        }
        data = data.checked_add(size).ok_or_else(|| bad("sizes overflow"))?;
    }
    let data_start = HEADER_BYTES + count * ENTRY_BYTES;
    let room = len - TRAILER_BYTES - data_start;
    if data > room || padded(data) != room {
        return Err(bad(format!("entries hold {data} bytes of data, the message has room for {room}")));
    }
    if bytes[data_start + data..len - TRAILER_BYTES].iter().any(|&b| b != 0) {
        return Err(bad("padding is not zero"));
    }
    Ok(Message { header, bytes })
}

/// Builds messages; reuses its buffers.
#[derive(Debug, Default)]
pub struct Builder {
    entries: Vec<Entry>,
    data: Vec<u8>,
    out: Vec<u8>,
}

impl Builder {
    /// Forgets the entries pushed so far.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.data.clear();
    }

    /// Adds an entry with its payload.
    pub fn push(&mut self, entry: Entry, payload: &[u8]) {
        debug_assert_eq!(entry.size as usize, payload.len());
        self.entries.push(Entry { size: payload.len() as u32, ..entry });
        self.data.extend_from_slice(payload);
    }

    /// Entries pushed so far.
    pub fn count(&self) -> usize {
        self.entries.len()
    }

    /// Bytes the message would take with one more entry of `payload` bytes.
    pub fn len_with(&self, payload: usize) -> usize {
        message_len(self.entries.len() + 1, self.data.len() + payload)
    }

    /// Encodes the message (`header.len` and `count` are filled in) and returns it.
    pub fn finish(&mut self, header: Header) -> &[u8] {
        let len = message_len(self.entries.len(), self.data.len());
        let out = &mut self.out;
        out.clear();
        out.reserve(len);
        out.extend_from_slice(&header.canary.to_le_bytes());
        out.extend_from_slice(&(len as u32).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        out.push(header.kind);
        out.push(header.flags);
        out.extend_from_slice(&header.credits.to_le_bytes());
        out.extend_from_slice(&header.ack.to_le_bytes());
        out.extend_from_slice(&header.degree_x16.to_le_bytes());
        out.extend_from_slice(&header.rate_krps.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        for e in &self.entries {
            out.extend_from_slice(&e.size.to_le_bytes());
            out.extend_from_slice(&e.thread.to_le_bytes());
            out.extend_from_slice(&e.rpc.to_le_bytes());
            out.extend_from_slice(&e.seq.to_le_bytes());
            out.extend_from_slice(&e.status.to_le_bytes());
            out.extend_from_slice(&[0; 2]);
        }
        out.extend_from_slice(&self.data);
        out.resize(len - TRAILER_BYTES, 0);
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&header.canary.to_le_bytes());
        debug_assert_eq!(out.len(), len);
        out
    }
}

/// A wrap marker (ring carriers).
pub fn wrap_marker(canary: u32) -> [u8; HEADER_BYTES + TRAILER_BYTES] {
    let mut b = Builder::default();
    let bytes = b.finish(Header { canary, kind: KIND_WRAP, ..Header::default() });
    bytes.try_into().expect("wrap marker size")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(canary_value: u32, payloads: &[Vec<u8>], kind: u8) -> Vec<u8> {
        let mut b = Builder::default();
        for (i, p) in payloads.iter().enumerate() {
            let status = if kind == KIND_RESPONSE { (i % 3) as u16 } else { 0 };
            b.push(Entry { size: p.len() as u32, thread: i as u16, rpc: 7, seq: 100 + i as u32, status }, p);
        }
        b.finish(Header { canary: canary_value, kind, flags: FLAG_RENEW, degree_x16: 40, ..Header::default() }).to_vec()
    }

    #[test]
    fn round_trips() {
        let payloads = vec![b"hello".to_vec(), vec![], vec![9; 64]];
        let c = canary(5, 17);
        let bytes = sample(c, &payloads, KIND_REQUEST);
        assert_eq!(bytes.len() % 8, 0);
        let m = decode(&bytes, Some(c), MAX_MESSAGE_BYTES).unwrap();
        assert_eq!(m.count(), 3);
        assert_eq!(m.header.flags, FLAG_RENEW);
        assert_eq!(m.header.degree_x16, 40);
        let got: Vec<_> = m.entries().collect();
        for (i, (e, data)) in got.iter().enumerate() {
            assert_eq!(*data, &payloads[i][..]);
            assert_eq!((e.thread, e.rpc, e.seq), (i as u16, 7, 100 + i as u32));
        }
    }

    #[test]
    fn checks_canaries_and_lengths() {
        let c = canary(1, 1);
        let bytes = sample(c, &[b"abc".to_vec()], KIND_REQUEST);
        assert!(decode(&bytes, Some(canary(1, 2)), MAX_MESSAGE_BYTES).is_err(), "wrong expected canary");
        let mut torn = bytes.clone();
        let n = torn.len();
        torn[n - 1] ^= 0x40;
        assert!(decode(&torn, Some(c), MAX_MESSAGE_BYTES).is_err(), "trailing canary");
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], Some(c), MAX_MESSAGE_BYTES).is_err(), "cut at {cut}");
        }
        assert!(decode(&bytes, Some(c), 40).is_err(), "over the receiver's limit");
        let mut status = bytes.clone();
        status[HEADER_BYTES + 12] = 1;
        assert!(decode(&status, Some(c), MAX_MESSAGE_BYTES).is_err(), "status in a request");
        let mut size = bytes.clone();
        size[HEADER_BYTES] = 200;
        assert!(decode(&size, Some(c), MAX_MESSAGE_BYTES).is_err(), "size beyond the data");
        let mut pad = bytes.clone();
        pad[HEADER_BYTES + ENTRY_BYTES + 4] = 1;
        assert!(decode(&pad, Some(c), MAX_MESSAGE_BYTES).is_err(), "dirty padding");
        let wrap = wrap_marker(c);
        assert_eq!(decode(&wrap, Some(c), MAX_MESSAGE_BYTES).unwrap().header.kind, KIND_WRAP);
        assert_ne!(canary(0, 0), 0);
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600), expect in any::<Option<u32>>()) {
            if let Ok(m) = decode(&bytes, expect, MAX_MESSAGE_BYTES) {
                let total: usize = m.entries().map(|(e, d)| { assert_eq!(e.size as usize, d.len()); d.len() }).sum();
                prop_assert!(total <= bytes.len());
            }
            let _ = decode_header(&bytes, expect, MAX_MESSAGE_BYTES);
        }

        /// Encoded messages decode to what was encoded, and any single flipped byte is either
        /// caught or decodes to a message that is still internally consistent.
        #[test]
        fn encodings_round_trip(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..20),
            key in any::<u32>(), number in any::<u64>(), flip in any::<(usize, u8)>(),
        ) {
            let c = canary(key, number);
            let bytes = sample(c, &payloads, KIND_RESPONSE);
            let m = decode(&bytes, Some(c), MAX_MESSAGE_BYTES).unwrap();
            prop_assert_eq!(m.count(), payloads.len());
            for ((e, d), p) in m.entries().zip(&payloads) {
                prop_assert_eq!(d, &p[..]);
                prop_assert_eq!(e.size as usize, p.len());
            }
            let mut broken = bytes.clone();
            let at = flip.0 % broken.len();
            broken[at] ^= flip.1.max(1);
            if let Ok(m) = decode(&broken, Some(c), MAX_MESSAGE_BYTES) {
                let total: usize = m.entries().map(|(_, d)| d.len()).sum();
                prop_assert!(message_len(m.count(), total) == broken.len());
            }
        }
    }
}
