//! The frame format spoken over tcp and Unix sockets (one-sided batches, RPC, hello), and on
//! the verbs backend's control channel (hello, the queue-pair exchange) and lane handshakes.
//!
//! Every frame is a 24-byte header followed by `body_len` bytes. All integers are
//! little-endian. Every field read from the network is checked here, before anything acts on
//! it; a malformed frame is a [`DecodeError`] and costs the sender its connection, nothing more.
//!
//! ```text
//! header: magic u32 | version u8 | kind u8 | flags u16 | request_id u64 | body_len u32 | zero u32
//! Hello        : client_nonce[32] | protocol u32 | user_len u16 | zero u16 | user[user_len]
//!                (client -> server, first frame; user_len 0: no user, the shared token)
//! Challenge    : server_nonce[32] | proof_count u16 | zero[6] | proof_count x server_proof[32]
//! Proof        : client_proof[32]                                (client -> server)
//! HelloOk      : region_len u64 | instance u64 | flags u32 | zero u32
//! Batch        : op_count u16 | zero[6] | op_count x {kind u8 | zero[3] | len u32 |
//!                offset u64 | arg0 u64 | arg1 u64} | write payloads, in op order
//! BatchResult  : op_count u16 | zero[6] | op_count x {status u8 | zero[7] | value u64} |
//!                bytes of every successful READ, in op order
//! RpcRequest   : method u16 | zero[6] | payload
//! RpcResponse  : status u16 | zero[6] | payload (a UTF-8 message when status != 0)
//! Error        : code u16 | zero[6] | UTF-8 message
//! VerbsConnect : QpInfo                                  (client -> server, verbs only)
//! VerbsAccept  : QpInfo | rkey u32 | zero u32 | base_addr u64 | region_len u64
//! QpInfo       : qpn u32 | psn u32 | lid u16 | mtu u8 | rd_atomic u8 | zero u32 | gid[16]
//! FlockOpen    : sender u64 | lane u16 | zero[6] | [FlockVerbs]
//! FlockAccept  : key u32 | credits u32 | batch u32 | zero u32 | ring_bytes u64 | [FlockVerbs]
//! FlockVerbs   : QpInfo | ring_addr u64 | ring_rkey u32 | zero u32 | ring_len u64   (verbs only)
//! ```
//!
//! Every connection, on every listener (tcp, the Unix socket of shm, the verbs control
//! channel, each FLOCK lane), starts with a challenge-response on the shared token
//! ([`crate::auth`]): Hello -> Challenge -> Proof -> HelloOk. Nonces are 32 random bytes,
//! fresh per connection on each side; proofs are HMAC-SHA256 keyed by the token over
//! `label | client_nonce | server_nonce`, with the label `racekv v2 server` for the server's
//! proof and `racekv v2 client` for the client's. The client checks the server's proof before
//! it answers (a server that does not know the token gets nothing), the server checks the
//! client's in constant time and answers HelloOk, or an Error (code AUTH) and closes. The
//! token never travels and a recorded exchange proves nothing on another connection. Any
//! other frame before HelloOk closes the connection; after it, frames carry no credentials.
//! On a tcp listener with a certificate all of this runs inside TLS ([`crate::tls`]).
//!
//! The header's version is 2 since this handshake (version 1 sent a token digest in every
//! frame). A peer of another version is refused with an Error frame that says so; to an
//! older peer that frame goes out in the peer's own header version, so it can read it.
//!
//! FlockOpen turns a fresh connection (after HelloOk) into one lane of a FLOCK sender
//! ([`crate::flock`]): the server answers FlockAccept with the lane's canary key, its initial
//! credits and the credits per grant; on a Unix socket the shared-memory rings' descriptor
//! rides on the reply, on verbs both sides add their queue pair and ring. From then on the
//! connection carries only FLOCK messages (tcp), or nothing but liveness (shm, verbs).
//! In FlockVerbs, `ring_addr`/`ring_rkey` name registered memory of `ring_len` ring bytes
//! followed by a 4 KiB control page (the reader's head, u64 LE, at +0, which the peer may
//! RDMA READ; a credit mailbox at +64): the peer RDMA WRITEs messages into the ring and
//! credit messages into the mailbox, and ring_len must be the size both sides expect.
//!
//! The verbs control channel is a TCP connection to a `verbs:` listener: the handshake as on
//! tcp, then exactly one VerbsConnect. The server creates an RC queue pair for the client,
//! brings it to RTS against the client's QpInfo and answers VerbsAccept with its own QpInfo
//! plus the rkey, base address and length of the region's single memory region; the client
//! then brings its queue pair to RTS. From then on one-sided ops travel on the queue pair and
//! the control channel carries no batches (a Batch frame there is refused; RPC uses FLOCK
//! lanes, though the legacy RpcRequest frame is still answered). In QpInfo, `qpn`
//! and `psn` are 24-bit, `mtu` is an `ibv_mtu` code (1 = 256 B .. 5 = 4096 B), `lid` is 0 on
//! RoCE, `gid` is the sender's GID in network order and `rd_atomic` is the number of
//! outstanding RDMA READ/atomic requests the sender can handle: the client's wanted initiator
//! depth in VerbsConnect, the server's responder resources in VerbsAccept (the client never
//! goes above it).

use crate::batch::{Batch, OpKind, Outcome, MAX_BATCH_BYTES, MAX_BATCH_OPS, MAX_OP_BYTES};
use crate::decode::{DecodeError, Reader};
use crate::error::OpError;

/// First four bytes of every frame header ("RKV1").
pub const MAGIC: u32 = u32::from_le_bytes(*b"RKV1");
/// Header version this build speaks.
pub const VERSION: u8 = 2;
/// Bytes of a frame header: magic, version, kind, request id, body length.
pub const HEADER_BYTES: usize = 24;
/// Bytes of each side's handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a handshake proof (an HMAC-SHA256 tag).
pub const PROOF_BYTES: usize = 32;
const OP_BYTES: usize = 32;
const RESULT_BYTES: usize = 16;
const BATCH_PREFIX: usize = 8;
/// Longest message an Error frame carries.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;
/// Largest RPC payload either way.
pub const MAX_RPC_BYTES: usize = 4 << 20;
/// Largest body of any frame: a full batch of ops plus its payload.
pub const MAX_BODY_BYTES: usize = BATCH_PREFIX + MAX_BATCH_OPS * OP_BYTES + MAX_BATCH_BYTES as usize;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client: opens the handshake with its nonce and the user it authenticates as.
    Hello = 1,
    /// Server: the region's length, its instance and flags; the connection is ready.
    HelloOk = 2,
    /// Client: a batch of one-sided ops.
    Batch = 3,
    /// Server: the outcome of each op of a batch, with the data READs returned.
    BatchResult = 4,
    /// Client: an RPC request (method and payload).
    RpcRequest = 5,
    /// Server: an RPC response (status and payload).
    RpcResponse = 6,
    /// A refusal: a code ([`error_code`]) and a message.
    Error = 7,
    /// Client: its queue pair, to connect the verbs backend.
    VerbsConnect = 8,
    /// Server: its queue pair and the region's memory region.
    VerbsAccept = 9,
    /// Client: opens a FLOCK lane.
    FlockOpen = 10,
    /// Server: the lane's key, credits and carrier.
    FlockAccept = 11,
    /// Server: its nonce and proofs of the key the client holds.
    Challenge = 12,
    /// Client: its proof of the key.
    Proof = 13,
}

impl Kind {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Kind::Hello,
            2 => Kind::HelloOk,
            3 => Kind::Batch,
            4 => Kind::BatchResult,
            5 => Kind::RpcRequest,
            6 => Kind::RpcResponse,
            7 => Kind::Error,
            8 => Kind::VerbsConnect,
            9 => Kind::VerbsAccept,
            10 => Kind::FlockOpen,
            11 => Kind::FlockAccept,
            12 => Kind::Challenge,
            13 => Kind::Proof,
            _ => return None,
        })
    }
}

/// Error frame codes.
pub mod error_code {
    /// The frame did not decode.
    pub const MALFORMED: u16 = 1;
    /// The handshake failed: wrong token, password or user.
    pub const AUTH: u16 = 2;
    /// The server is at its connection limit.
    pub const TOO_MANY_CONNECTIONS: u16 = 3;
    /// The server does not offer what the client asked for.
    pub const UNSUPPORTED: u16 = 4;
    /// The server could not set up the client's queue pair (verbs).
    pub const SETUP_FAILED: u16 = 5;
}

/// What a frame's errors say they are about ([`DecodeError::what`]); the memnode's RPC
/// payloads, which travel in frames, say the same.
pub const MALFORMED_FRAME: &str = "malformed frame";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(MALFORMED_FRAME, msg)
}

fn reader(bytes: &[u8]) -> Reader<'_> {
    Reader::new(MALFORMED_FRAME, bytes)
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// Pairs a response with its request (0 where there is none).
    pub request_id: u64,
    /// Bytes of the body after the header.
    pub body_len: u32,
}

/// Appends a header for a body of `body_len` bytes.
pub fn put_header(out: &mut Vec<u8>, kind: Kind, request_id: u64, body_len: usize) {
    put_header_version(out, VERSION, kind, request_id, body_len);
}

fn put_header_version(out: &mut Vec<u8>, version: u8, kind: Kind, request_id: u64, body_len: usize) {
    debug_assert!(body_len <= MAX_BODY_BYTES);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(version);
    out.push(kind as u8);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
}

/// Decodes and checks a header.
pub fn decode_header(bytes: &[u8; HEADER_BYTES]) -> Result<Header, DecodeError> {
    let mut r = reader(bytes);
    if r.u32()? != MAGIC {
        return Err(bad("bad magic (not a racekv peer?)"));
    }
    let version = r.u8()?;
    if version != VERSION {
        return Err(bad(format!("the peer speaks racekv wire version {version}, this build speaks {VERSION}")));
    }
    let kind = r.u8()?;
    let kind = Kind::from_code(kind).ok_or_else(|| bad(format!("unknown frame kind {kind}")))?;
    r.zeros(2)?;
    let request_id = r.u64()?;
    let body_len = r.u32()?;
    r.zeros(4)?;
    if body_len as usize > MAX_BODY_BYTES {
        return Err(bad(format!("body of {body_len} bytes exceeds the limit of {MAX_BODY_BYTES}")));
    }
    Ok(Header { kind, request_id, body_len })
}

/// The version of a header with our magic (whatever its version); None for anything else.
pub fn header_version(bytes: &[u8; HEADER_BYTES]) -> Option<u8> {
    (bytes[..4] == MAGIC.to_le_bytes()).then_some(bytes[4])
}

// ---- hello ----

/// Handshake protocol version a Hello carries.
pub const PROTOCOL: u32 = 1;

/// Longest user name a Hello may carry.
pub const MAX_USER_BYTES: usize = 256;
/// Most proofs a Challenge may carry (one per password of a user; one for a token).
pub const MAX_PROOFS: usize = 64;
/// Largest Hello body.
pub const MAX_HELLO_BYTES: usize = NONCE_BYTES + 8 + MAX_USER_BYTES;
/// Largest Challenge body.
pub const MAX_CHALLENGE_BYTES: usize = NONCE_BYTES + 8 + MAX_PROOFS * PROOF_BYTES;

/// Hello: the client's nonce opens the handshake; `user` names who it authenticates as
/// (`None`: the shared token).
pub fn encode_hello(out: &mut Vec<u8>, client_nonce: &[u8; NONCE_BYTES], user: Option<&str>) {
    let user = user.unwrap_or("").as_bytes();
    assert!(user.len() <= MAX_USER_BYTES, "user names are checked before a hello is built");
    put_header(out, Kind::Hello, 0, NONCE_BYTES + 8 + user.len());
    out.extend_from_slice(client_nonce);
    out.extend_from_slice(&PROTOCOL.to_le_bytes());
    out.extend_from_slice(&(user.len() as u16).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(user);
}

/// Returns the client's nonce and the user it names.
pub fn decode_hello(body: &[u8]) -> Result<([u8; NONCE_BYTES], Option<&str>), DecodeError> {
    let mut r = reader(body);
    let nonce = r.array()?;
    let protocol = r.u32()?;
    if protocol != PROTOCOL {
        return Err(bad(format!("protocol {protocol}, expected {PROTOCOL}")));
    }
    let user_len = usize::from(r.u16()?);
    r.zeros(2)?;
    if user_len > MAX_USER_BYTES {
        return Err(bad(format!("a user name of {user_len} bytes (at most {MAX_USER_BYTES})")));
    }
    let user = r.take(user_len)?;
    r.finish()?;
    let user = std::str::from_utf8(user).map_err(|_| bad("a user name that is not UTF-8"))?;
    Ok((nonce, (!user.is_empty()).then_some(user)))
}

/// The server's half of the handshake: its nonce and its proofs that it knows the key the
/// client holds: one for a token, one per password of a user (the client checks whichever
/// is its own), none for a user that needs no password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The server's nonce.
    pub server_nonce: [u8; NONCE_BYTES],
    /// HMAC-SHA256 proofs, one per key the client may hold.
    pub server_proofs: Vec<[u8; PROOF_BYTES]>,
}

/// Challenge: the server's nonce and proofs.
pub fn encode_challenge(out: &mut Vec<u8>, challenge: &Challenge) {
    let count = challenge.server_proofs.len();
    assert!(count <= MAX_PROOFS, "a challenge carries at most {MAX_PROOFS} proofs");
    put_header(out, Kind::Challenge, 0, NONCE_BYTES + 8 + count * PROOF_BYTES);
    out.extend_from_slice(&challenge.server_nonce);
    out.extend_from_slice(&(count as u16).to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    for proof in &challenge.server_proofs {
        out.extend_from_slice(proof);
    }
}

/// Reads a Challenge body.
pub fn decode_challenge(body: &[u8]) -> Result<Challenge, DecodeError> {
    let mut r = reader(body);
    let server_nonce = r.array()?;
    let count = usize::from(r.u16()?);
    r.zeros(6)?;
    if count > MAX_PROOFS {
        return Err(bad(format!("a challenge with {count} proofs (at most {MAX_PROOFS})")));
    }
    let server_proofs = (0..count).map(|_| r.array()).collect::<Result<_, _>>()?;
    r.finish()?;
    Ok(Challenge { server_nonce, server_proofs })
}

/// Proof: the client's proof that it knows the token.
pub fn encode_proof(out: &mut Vec<u8>, client_proof: &[u8; PROOF_BYTES]) {
    put_header(out, Kind::Proof, 0, PROOF_BYTES);
    out.extend_from_slice(client_proof);
}

/// Reads a Proof body.
pub fn decode_proof(body: &[u8]) -> Result<[u8; PROOF_BYTES], DecodeError> {
    let mut r = reader(body);
    let proof = r.array()?;
    r.finish()?;
    Ok(proof)
}

/// What a server says about its region in reply to hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloOk {
    /// The region's length in bytes.
    pub region_len: u64,
    /// Random per server start: a changed instance means the server restarted.
    pub instance: u64,
    /// Bit 0: the region's file descriptor rides along (SCM_RIGHTS, Unix sockets only).
    pub flags: u32,
}

/// [`HelloOk::flags`]: the region's file descriptor rides along.
pub const HELLO_FLAG_REGION_FD: u32 = 1;

/// HelloOk: the region's length, the instance and the flags.
pub fn encode_hello_ok(out: &mut Vec<u8>, ok: &HelloOk) {
    put_header(out, Kind::HelloOk, 0, 24);
    out.extend_from_slice(&ok.region_len.to_le_bytes());
    out.extend_from_slice(&ok.instance.to_le_bytes());
    out.extend_from_slice(&ok.flags.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
}

/// Reads a HelloOk body.
pub fn decode_hello_ok(body: &[u8]) -> Result<HelloOk, DecodeError> {
    let mut r = reader(body);
    let ok = HelloOk { region_len: r.u64()?, instance: r.u64()?, flags: r.u32()? };
    r.zeros(4)?;
    r.finish()?;
    Ok(ok)
}

// ---- batches ----

/// Encodes `batch` as a Batch frame.
pub fn encode_batch(out: &mut Vec<u8>, request_id: u64, batch: &Batch) {
    let (_, written) = batch.byte_totals();
    let body_len = BATCH_PREFIX + batch.len() * OP_BYTES + written as usize;
    out.reserve(HEADER_BYTES + body_len);
    put_header(out, Kind::Batch, request_id, body_len);
    out.extend_from_slice(&(batch.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    for op in batch.ops() {
        out.push(op.kind as u8);
        out.extend_from_slice(&[0u8; 3]);
        out.extend_from_slice(&op.len.to_le_bytes());
        out.extend_from_slice(&op.offset.to_le_bytes());
        out.extend_from_slice(&op.arg0.to_le_bytes());
        out.extend_from_slice(&op.arg1.to_le_bytes());
    }
    for (index, op) in batch.ops().iter().enumerate() {
        if op.kind == OpKind::Write {
            out.extend_from_slice(batch.write_payload(index));
        }
    }
}

/// Decodes a Batch frame body into `batch` (cleared first).
pub fn decode_batch(body: &[u8], batch: &mut Batch) -> Result<(), DecodeError> {
    batch.clear();
    let mut r = reader(body);
    let count = r.u16()? as usize;
    r.zeros(6)?;
    if count == 0 || count > MAX_BATCH_OPS {
        return Err(bad(format!("batch of {count} ops; allowed 1..={MAX_BATCH_OPS}")));
    }
    let mut ops = r.sub(count * OP_BYTES)?;
    let mut payload = reader(r.rest());
    let mut read_total = 0u64;
    for _ in 0..count {
        let code = ops.u8()?;
        ops.zeros(3)?;
        let len = ops.u32()?;
        let offset = ops.u64()?;
        let arg0 = ops.u64()?;
        let arg1 = ops.u64()?;
        let kind = OpKind::from_code(code).ok_or_else(|| bad(format!("unknown op kind {code}")))?;
        if u64::from(len) > MAX_OP_BYTES {
            return Err(bad(format!("op of {len} bytes exceeds {MAX_OP_BYTES}")));
        }
        match kind {
            OpKind::Read => {
                read_total += u64::from(len);
                if read_total > MAX_BATCH_BYTES {
                    return Err(bad(format!("batch reads more than {MAX_BATCH_BYTES} bytes")));
                }
                batch.read(offset, len);
            }
            OpKind::Write => {
                batch.write(offset, payload.take(len as usize)?);
            }
            OpKind::Cas | OpKind::Faa => {
                if len != 8 {
                    return Err(bad(format!("atomic of {len} bytes; atomics are 8 bytes")));
                }
                if kind == OpKind::Cas {
                    batch.cas(offset, arg0, arg1);
                } else {
                    if arg1 != 0 {
                        return Err(bad("FAA with a non-zero second argument"));
                    }
                    batch.faa(offset, arg0);
                }
            }
        }
    }
    payload.finish()?;
    Ok(())
}

/// Encodes the outcomes (and read bytes) of an executed batch as a BatchResult frame.
pub fn encode_batch_result(out: &mut Vec<u8>, request_id: u64, batch: &Batch) {
    let read_bytes: usize = batch
        .ops()
        .iter()
        .filter(|op| op.kind == OpKind::Read && matches!(op.outcome, Outcome::Done(_)))
        .map(|op| op.len as usize)
        .sum();
    let body_len = 8 + batch.len() * RESULT_BYTES + read_bytes;
    out.reserve(HEADER_BYTES + body_len);
    put_header(out, Kind::BatchResult, request_id, body_len);
    out.extend_from_slice(&(batch.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    for op in batch.ops() {
        let (status, value) = match op.outcome {
            Outcome::Done(v) => (0u8, v),
            Outcome::Failed(e) => (e.code(), 0),
            Outcome::Pending => (OpError::NotExecuted.code(), 0),
        };
        out.push(status);
        out.extend_from_slice(&[0u8; 7]);
        out.extend_from_slice(&value.to_le_bytes());
    }
    for (index, op) in batch.ops().iter().enumerate() {
        if op.kind == OpKind::Read && matches!(op.outcome, Outcome::Done(_)) {
            let start = out.len();
            out.resize(start + op.len as usize, 0);
            out[start..].copy_from_slice(batch.read_bytes_of(index));
        }
    }
}

/// Applies a BatchResult body to the batch that was sent. Failed ops map back to [`OpError`]s
/// with the details the client knows (offset, length, region size).
pub fn decode_batch_result(body: &[u8], batch: &mut Batch, region_len: u64) -> Result<(), DecodeError> {
    let mut r = reader(body);
    let count = r.u16()? as usize;
    r.zeros(6)?;
    if count != batch.len() {
        return Err(bad(format!("result for {count} ops, batch has {}", batch.len())));
    }
    let mut statuses = r.sub(count * RESULT_BYTES)?;
    let mut data = reader(r.rest());
    for index in 0..count {
        let status = statuses.u8()?;
        statuses.zeros(7)?;
        let value = statuses.u64()?;
        let op = batch.ops()[index];
        if status == 0 {
            if op.kind == OpKind::Read {
                let bytes = data.take(op.len as usize)?;
                batch.read_target(index).copy_from_slice(bytes);
            }
            batch.complete(index, value);
        } else {
            let error = match status {
                1 => OpError::OutOfBounds { offset: op.offset, len: u64::from(op.len), region_len },
                2 => OpError::Misaligned { offset: op.offset },
                3 => OpError::BadLength { len: u64::from(op.len), max: MAX_OP_BYTES },
                4 => OpError::NotExecuted,
                other => OpError::Remote(other),
            };
            // Keep per-op statuses exactly as reported (the server already flushed the rest).
            batch.set_failed(index, error);
        }
    }
    data.finish()
}

// ---- rpc and errors ----

/// RpcRequest: the method, then the payload.
pub fn encode_rpc_request(out: &mut Vec<u8>, request_id: u64, method: u16, payload: &[u8]) {
    put_header(out, Kind::RpcRequest, request_id, 8 + payload.len());
    out.extend_from_slice(&method.to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    out.extend_from_slice(payload);
}

/// Returns (method, payload).
pub fn decode_rpc_request(body: &[u8]) -> Result<(u16, &[u8]), DecodeError> {
    let mut r = reader(body);
    let method = r.u16()?;
    r.zeros(6)?;
    let payload = r.rest();
    if payload.len() > MAX_RPC_BYTES {
        return Err(bad(format!("rpc payload of {} bytes exceeds {MAX_RPC_BYTES}", payload.len())));
    }
    Ok((method, payload))
}

/// `status` 0 is success; otherwise `payload` is the error message.
pub fn encode_rpc_response(out: &mut Vec<u8>, request_id: u64, status: u16, payload: &[u8]) {
    let payload = &payload[..payload.len().min(MAX_RPC_BYTES)];
    put_header(out, Kind::RpcResponse, request_id, 8 + payload.len());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    out.extend_from_slice(payload);
}

/// Returns (status, payload).
pub fn decode_rpc_response(body: &[u8]) -> Result<(u16, &[u8]), DecodeError> {
    let mut r = reader(body);
    let status = r.u16()?;
    r.zeros(6)?;
    let payload = r.rest();
    if payload.len() > MAX_RPC_BYTES {
        return Err(bad("rpc response too large"));
    }
    Ok((status, payload))
}

/// Error: a code and a message, in this build's header version.
pub fn encode_error(out: &mut Vec<u8>, request_id: u64, code: u16, message: &str) {
    encode_error_version(out, VERSION, request_id, code, message);
}

/// An Error frame in header version `version`: how a peer of an older version learns why it
/// is refused (the Error frame's layout is the same in every version).
pub fn encode_error_version(out: &mut Vec<u8>, version: u8, request_id: u64, code: u16, message: &str) {
    let message = &message.as_bytes()[..message.len().min(MAX_ERROR_MESSAGE_BYTES)];
    put_header_version(out, version, Kind::Error, request_id, 8 + message.len());
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    out.extend_from_slice(message);
}

/// Returns (code, message).
pub fn decode_error(body: &[u8]) -> Result<(u16, String), DecodeError> {
    let mut r = reader(body);
    let code = r.u16()?;
    r.zeros(6)?;
    Ok((code, String::from_utf8_lossy(r.rest()).into_owned()))
}

// ---- verbs queue-pair exchange ----

const QP_INFO_BYTES: usize = 32;
/// Largest 24-bit value (QP numbers and packet sequence numbers are 24-bit).
const MAX_24BIT: u32 = (1 << 24) - 1;

/// One end of an RC queue pair, as the other end needs it to connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// The port's local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// An `ibv_mtu` code: 1 (256 B) ..= 5 (4096 B).
    pub mtu: u8,
    /// Outstanding RDMA READ/atomic requests: wanted initiator depth (client) or responder
    /// resources (server).
    pub rd_atomic: u8,
    /// The sender's GID, network byte order.
    pub gid: [u8; 16],
}

fn put_qp_info(out: &mut Vec<u8>, info: &QpInfo) {
    out.extend_from_slice(&info.qpn.to_le_bytes());
    out.extend_from_slice(&info.psn.to_le_bytes());
    out.extend_from_slice(&info.lid.to_le_bytes());
    out.push(info.mtu);
    out.push(info.rd_atomic);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&info.gid);
}

fn read_qp_info(r: &mut Reader<'_>) -> Result<QpInfo, DecodeError> {
    let info = QpInfo { qpn: r.u32()?, psn: r.u32()?, lid: r.u16()?, mtu: r.u8()?, rd_atomic: r.u8()?, gid: [0; 16] };
    r.zeros(4)?;
    let gid = r.array()?;
    if info.qpn > MAX_24BIT || info.psn > MAX_24BIT {
        return Err(bad(format!("qpn {:#x} or psn {:#x} exceeds 24 bits", info.qpn, info.psn)));
    }
    if !(1..=5).contains(&info.mtu) {
        return Err(bad(format!("mtu code {} is not 1..=5", info.mtu)));
    }
    if info.rd_atomic == 0 {
        return Err(bad("rd_atomic is 0"));
    }
    Ok(QpInfo { gid, ..info })
}

/// VerbsConnect: the client's queue pair.
pub fn encode_verbs_connect(out: &mut Vec<u8>, info: &QpInfo) {
    put_header(out, Kind::VerbsConnect, 0, QP_INFO_BYTES);
    put_qp_info(out, info);
}

/// Returns the client's queue pair.
pub fn decode_verbs_connect(body: &[u8]) -> Result<QpInfo, DecodeError> {
    let mut r = reader(body);
    let info = read_qp_info(&mut r)?;
    r.finish()?;
    Ok(info)
}

/// The server's answer to VerbsConnect: its queue pair and the region's memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerbsAccept {
    /// The server's queue pair.
    pub qp: QpInfo,
    /// Remote key of the region's memory region.
    pub rkey: u32,
    /// Virtual address of region offset 0 in the server's memory region.
    pub base_addr: u64,
    /// The region's length in bytes.
    pub region_len: u64,
}

/// VerbsAccept: the server's queue pair and the region's memory region.
pub fn encode_verbs_accept(out: &mut Vec<u8>, accept: &VerbsAccept) {
    put_header(out, Kind::VerbsAccept, 0, QP_INFO_BYTES + 24);
    put_qp_info(out, &accept.qp);
    out.extend_from_slice(&accept.rkey.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&accept.base_addr.to_le_bytes());
    out.extend_from_slice(&accept.region_len.to_le_bytes());
}

/// Reads a VerbsAccept body.
pub fn decode_verbs_accept(body: &[u8]) -> Result<VerbsAccept, DecodeError> {
    let mut r = reader(body);
    let qp = read_qp_info(&mut r)?;
    let rkey = r.u32()?;
    r.zeros(4)?;
    let accept = VerbsAccept { qp, rkey, base_addr: r.u64()?, region_len: r.u64()? };
    r.finish()?;
    if accept.base_addr.checked_add(accept.region_len).is_none() {
        return Err(bad("region end overflows the address space"));
    }
    Ok(accept)
}

// ---- flock lanes ----

/// The verbs part of a lane handshake: a queue pair and a ring the peer may RDMA WRITE into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlockVerbs {
    /// The sender's queue pair for the lane.
    pub qp: QpInfo,
    /// Virtual address of the ring the peer may write into.
    pub ring_addr: u64,
    /// Remote key of the ring's memory region.
    pub ring_rkey: u32,
    /// Bytes of the ring.
    pub ring_len: u64,
}

const FLOCK_VERBS_BYTES: usize = QP_INFO_BYTES + 24;

fn put_flock_verbs(out: &mut Vec<u8>, v: &FlockVerbs) {
    put_qp_info(out, &v.qp);
    out.extend_from_slice(&v.ring_addr.to_le_bytes());
    out.extend_from_slice(&v.ring_rkey.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&v.ring_len.to_le_bytes());
}

fn read_flock_verbs(r: &mut Reader<'_>) -> Result<Option<FlockVerbs>, DecodeError> {
    match r.remaining() {
        0 => Ok(None),
        FLOCK_VERBS_BYTES => {
            let qp = read_qp_info(r)?;
            let ring_addr = r.u64()?;
            let ring_rkey = r.u32()?;
            r.zeros(4)?;
            let ring_len = r.u64()?;
            if ring_addr.checked_add(ring_len).is_none() || ring_len == 0 || ring_len % 8 != 0 {
                return Err(bad(format!("bad ring of {ring_len} bytes at {ring_addr:#x}")));
            }
            Ok(Some(FlockVerbs { qp, ring_addr, ring_rkey, ring_len }))
        }
        n => Err(bad(format!("{n} bytes where a verbs lane description ({FLOCK_VERBS_BYTES}) or nothing belongs"))),
    }
}

/// A client's request to open a FLOCK lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlockOpen {
    /// The sender (connection handle) this lane belongs to; the scheduler groups by it.
    pub sender: u64,
    /// The lane's index within the sender's connection.
    pub lane: u16,
    /// The verbs carrier's details (None: the lane runs on the connection's stream).
    pub verbs: Option<FlockVerbs>,
}

/// FlockOpen: the sender, the lane and the verbs carrier if any.
pub fn encode_flock_open(out: &mut Vec<u8>, open: &FlockOpen) {
    let extra = if open.verbs.is_some() { FLOCK_VERBS_BYTES } else { 0 };
    put_header(out, Kind::FlockOpen, 0, 16 + extra);
    out.extend_from_slice(&open.sender.to_le_bytes());
    out.extend_from_slice(&open.lane.to_le_bytes());
    out.extend_from_slice(&[0u8; 6]);
    if let Some(v) = &open.verbs {
        put_flock_verbs(out, v);
    }
}

/// Reads a FlockOpen body.
pub fn decode_flock_open(body: &[u8]) -> Result<FlockOpen, DecodeError> {
    let mut r = reader(body);
    let sender = r.u64()?;
    let lane = r.u16()?;
    r.zeros(6)?;
    let verbs = read_flock_verbs(&mut r)?;
    r.finish()?;
    Ok(FlockOpen { sender, lane, verbs })
}

/// The server's answer: the lane's canary key and credits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlockAccept {
    /// The lane's key, from which each message's canary derives.
    pub key: u32,
    /// Initial credits (0: the lane starts inactive).
    pub credits: u32,
    /// Credits per grant (C).
    pub batch: u32,
    /// Bytes of each ring (shm, verbs); 0 on tcp.
    pub ring_bytes: u64,
    /// The server's verbs carrier for the lane (None: no verbs).
    pub verbs: Option<FlockVerbs>,
}

/// FlockAccept: the key, credits, ring size and verbs carrier.
pub fn encode_flock_accept(out: &mut Vec<u8>, accept: &FlockAccept) {
    let extra = if accept.verbs.is_some() { FLOCK_VERBS_BYTES } else { 0 };
    put_header(out, Kind::FlockAccept, 0, 24 + extra);
    out.extend_from_slice(&accept.key.to_le_bytes());
    out.extend_from_slice(&accept.credits.to_le_bytes());
    out.extend_from_slice(&accept.batch.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&accept.ring_bytes.to_le_bytes());
    if let Some(v) = &accept.verbs {
        put_flock_verbs(out, v);
    }
}

/// Reads a FlockAccept body.
pub fn decode_flock_accept(body: &[u8]) -> Result<FlockAccept, DecodeError> {
    let mut r = reader(body);
    let key = r.u32()?;
    let credits = r.u32()?;
    let batch = r.u32()?;
    r.zeros(4)?;
    let ring_bytes = r.u64()?;
    let verbs = read_flock_verbs(&mut r)?;
    r.finish()?;
    if !(2..=1 << 16).contains(&batch) || credits > 1 << 20 {
        return Err(bad(format!("credits {credits} / batch {batch} out of range")));
    }
    Ok(FlockAccept { key, credits, batch, ring_bytes, verbs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header_of(frame: &[u8]) -> Header {
        decode_header(frame[..HEADER_BYTES].try_into().unwrap()).unwrap()
    }

    #[test]
    fn batch_round_trips() {
        let mut b = Batch::new();
        b.read(64, 5);
        b.write(128, b"abc");
        b.cas(8, 1, 2);
        b.faa(16, 9);
        let mut frame = Vec::new();
        encode_batch(&mut frame, 42, &b);
        let h = header_of(&frame);
        assert_eq!((h.kind, h.request_id), (Kind::Batch, 42));
        let mut server = Batch::new();
        decode_batch(&frame[HEADER_BYTES..], &mut server).unwrap();
        assert_eq!(server.len(), 4);
        assert_eq!(server.write_payload(1), b"abc");
        // Execute on the server side and send results back.
        server.read_target(0).copy_from_slice(b"hello");
        server.complete(0, 0);
        server.complete(1, 0);
        server.complete(2, 1);
        server.fail_from(3, OpError::Misaligned { offset: 16 });
        let mut reply = Vec::new();
        encode_batch_result(&mut reply, 42, &server);
        decode_batch_result(&reply[HEADER_BYTES..], &mut b, 4096).unwrap();
        assert_eq!(b.ops()[0].outcome, Outcome::Done(0));
        assert_eq!(b.ops()[2].outcome, Outcome::Done(1));
        assert!(matches!(b.ops()[3].outcome, Outcome::Failed(OpError::Misaligned { .. })));
        assert_eq!(b.read_bytes_of(0), b"hello");
    }

    #[test]
    fn rejects_oversized_and_garbage_headers() {
        let mut frame = Vec::new();
        put_header(&mut frame, Kind::Batch, 1, 0);
        frame[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_header(frame[..24].try_into().unwrap()).is_err());
        assert!(decode_header(&[0xAB; 24]).is_err());
    }

    #[test]
    fn rejects_truncated_batches() {
        let mut b = Batch::new();
        b.write(0, &[7; 100]);
        let mut frame = Vec::new();
        encode_batch(&mut frame, 1, &b);
        let body = &frame[HEADER_BYTES..];
        let mut server = Batch::new();
        for cut in 0..body.len() {
            assert!(decode_batch(&body[..cut], &mut server).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn verbs_exchange_round_trips_and_checks_fields() {
        let info = QpInfo { qpn: 0x11, psn: 0xABCDEF, lid: 0, mtu: 3, rd_atomic: 16, gid: [7; 16] };
        let mut frame = Vec::new();
        encode_verbs_connect(&mut frame, &info);
        assert_eq!(header_of(&frame).kind, Kind::VerbsConnect);
        assert_eq!(decode_verbs_connect(&frame[HEADER_BYTES..]).unwrap(), info);
        let accept = VerbsAccept { qp: info, rkey: 0x1234, base_addr: 0x7f00_0000_0000, region_len: 1 << 20 };
        let mut frame = Vec::new();
        encode_verbs_accept(&mut frame, &accept);
        assert_eq!(header_of(&frame).kind, Kind::VerbsAccept);
        assert_eq!(decode_verbs_accept(&frame[HEADER_BYTES..]).unwrap(), accept);
        let bad_infos = [
            QpInfo { qpn: 1 << 24, ..info },
            QpInfo { psn: u32::MAX, ..info },
            QpInfo { mtu: 0, ..info },
            QpInfo { mtu: 6, ..info },
            QpInfo { rd_atomic: 0, ..info },
        ];
        for bad_info in bad_infos {
            let mut frame = Vec::new();
            encode_verbs_connect(&mut frame, &bad_info);
            assert!(decode_verbs_connect(&frame[HEADER_BYTES..]).is_err(), "{bad_info:?}");
        }
        let mut frame = Vec::new();
        encode_verbs_accept(&mut frame, &VerbsAccept { base_addr: u64::MAX, ..accept });
        assert!(decode_verbs_accept(&frame[HEADER_BYTES..]).is_err());
    }

    #[test]
    fn flock_handshake_round_trips() {
        let qp = QpInfo { qpn: 9, psn: 1, lid: 0, mtu: 3, rd_atomic: 1, gid: [1; 16] };
        let verbs = FlockVerbs { qp, ring_addr: 0x1000, ring_rkey: 7, ring_len: 1 << 20 };
        for v in [None, Some(verbs)] {
            let open = FlockOpen { sender: 42, lane: 3, verbs: v };
            let mut frame = Vec::new();
            encode_flock_open(&mut frame, &open);
            assert_eq!(header_of(&frame).kind, Kind::FlockOpen);
            assert_eq!(decode_flock_open(&frame[HEADER_BYTES..]).unwrap(), open);
            let accept = FlockAccept { key: 5, credits: 32, batch: 32, ring_bytes: 4096, verbs: v };
            let mut frame = Vec::new();
            encode_flock_accept(&mut frame, &accept);
            assert_eq!(decode_flock_accept(&frame[HEADER_BYTES..]).unwrap(), accept);
            for cut in (0..frame.len() - HEADER_BYTES).filter(|&cut| cut != 24) {
                assert!(decode_flock_accept(&frame[HEADER_BYTES..HEADER_BYTES + cut]).is_err(), "cut {cut}");
            }
        }
    }

    #[test]
    fn handshake_frames_round_trip_and_reject_every_other_length() {
        let nonce = [3u8; NONCE_BYTES];
        let mut frame = Vec::new();
        encode_hello(&mut frame, &nonce, Some("alice"));
        assert_eq!(header_of(&frame).kind, Kind::Hello);
        assert_eq!(decode_hello(&frame[HEADER_BYTES..]).unwrap(), (nonce, Some("alice")));
        let mut anonymous = Vec::new();
        encode_hello(&mut anonymous, &nonce, None);
        assert_eq!(decode_hello(&anonymous[HEADER_BYTES..]).unwrap(), (nonce, None));
        let mut too_long = anonymous[HEADER_BYTES..].to_vec();
        too_long[NONCE_BYTES + 4..NONCE_BYTES + 6].copy_from_slice(&(MAX_USER_BYTES as u16 + 1).to_le_bytes());
        too_long.extend(std::iter::repeat_n(b'a', MAX_USER_BYTES + 1));
        assert!(decode_hello(&too_long).is_err(), "a user name past the limit");
        let challenge =
            Challenge { server_nonce: [1; NONCE_BYTES], server_proofs: vec![[2; PROOF_BYTES], [4; PROOF_BYTES]] };
        let mut none = Vec::new();
        encode_challenge(&mut none, &Challenge { server_nonce: [1; NONCE_BYTES], server_proofs: vec![] });
        assert_eq!(decode_challenge(&none[HEADER_BYTES..]).unwrap().server_proofs, Vec::<[u8; PROOF_BYTES]>::new());
        let mut challenge_frame = Vec::new();
        encode_challenge(&mut challenge_frame, &challenge);
        assert_eq!(header_of(&challenge_frame).kind, Kind::Challenge);
        assert_eq!(decode_challenge(&challenge_frame[HEADER_BYTES..]).unwrap(), challenge);
        let mut proof_frame = Vec::new();
        encode_proof(&mut proof_frame, &[9; PROOF_BYTES]);
        assert_eq!(header_of(&proof_frame).kind, Kind::Proof);
        assert_eq!(decode_proof(&proof_frame[HEADER_BYTES..]).unwrap(), [9; PROOF_BYTES]);
        type Decodes = fn(&[u8]) -> bool;
        let cases: [(&Vec<u8>, Decodes); 3] = [
            (&frame, |b| decode_hello(b).is_ok()),
            (&challenge_frame, |b| decode_challenge(b).is_ok()),
            (&proof_frame, |b| decode_proof(b).is_ok()),
        ];
        for (frame, decodes) in cases {
            let body = &frame[HEADER_BYTES..];
            let mut longer = body.to_vec();
            longer.push(0);
            assert!(decodes(body) && !decodes(&body[..body.len() - 1]) && !decodes(&longer));
        }
    }

    #[test]
    fn other_versions_are_recognised_and_refused() {
        let mut frame = Vec::new();
        encode_error_version(&mut frame, 1, 0, error_code::UNSUPPORTED, "old");
        let header: &[u8; HEADER_BYTES] = frame[..HEADER_BYTES].try_into().unwrap();
        assert_eq!(header_version(header), Some(1));
        let e = decode_header(header).unwrap_err();
        assert!(e.message.contains("version 1") && e.message.contains("speaks 2"), "{e}");
        assert_eq!(header_version(&[0xAB; HEADER_BYTES]), None);
    }

    proptest! {
        /// No input makes a decoder panic; it either decodes or reports an error.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = Batch::new();
            let _ = decode_batch(&bytes, &mut b);
            let _ = decode_hello(&bytes);
            let _ = decode_challenge(&bytes);
            let _ = decode_proof(&bytes);
            let _ = decode_hello_ok(&bytes);
            let _ = decode_rpc_request(&bytes);
            let _ = decode_rpc_response(&bytes);
            let _ = decode_error(&bytes);
            let _ = decode_verbs_connect(&bytes);
            let _ = decode_verbs_accept(&bytes);
            let _ = decode_flock_open(&bytes);
            let _ = decode_flock_accept(&bytes);
            if bytes.len() >= HEADER_BYTES {
                let _ = decode_header(bytes[..HEADER_BYTES].try_into().unwrap());
            }
            let mut sent = Batch::new();
            sent.read(0, 4);
            sent.cas(8, 0, 1);
            let _ = decode_batch_result(&bytes, &mut sent, 4096);
        }
    }
}
