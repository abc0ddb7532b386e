//! Messages on the attach socket: the client's hello, then the daemon's frames (accepted,
//! refused, goodbye). Fixed sizes and explicit bounds: a decoder never allocates more than
//! [`MAX_FRAME_BODY`] bytes, whatever it is fed.
//!
//! ```text
//! hello : magic "RKVA" | version u16 | flags u16 (0) | token digest [16] | pid u32 | reserved u32   (32 B)
//! frame : magic "RKVF" | kind u8 | code u8 | body length u16 | body
//!   ACCEPTED : attachment id u64 | slots u32 | slot bytes u32 | area length u64 |
//!              max multi-get keys u32 | reserved u32          (32 B; memfd + 2 eventfds attached)
//!   REFUSED  : UTF-8 reason (code: [`refusal`])
//!   GOODBYE  : UTF-8 reason (code: [`goodbye`]), sent before the daemon closes an attachment
//! ```

use super::area::{Geometry, VERSION};

pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"RKVA");
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"RKVF");
pub const HELLO_BYTES: usize = 32;
pub const FRAME_HEADER_BYTES: usize = 8;
/// Longest frame body (reasons are cut to fit).
pub const MAX_FRAME_BODY: usize = 1024;
pub const ACCEPTED_BODY_BYTES: usize = 32;
/// Token digests: as the memnodes' (`racekv_transport::wire::token_digest`).
pub const TOKEN_BYTES: usize = 16;

/// Frame kinds.
pub mod kind {
    pub const ACCEPTED: u8 = 1;
    pub const REFUSED: u8 = 2;
    pub const GOODBYE: u8 = 3;
}

/// Why an attach was refused.
pub mod refusal {
    /// The daemon serves its maximum number of attached clients.
    pub const TOO_MANY_CLIENTS: u8 = 1;
    /// Wrong token, or the peer's uid is not allowed.
    pub const NOT_ALLOWED: u8 = 2;
    /// A malformed hello or an unsupported version.
    pub const BAD_HELLO: u8 = 3;
    /// The daemon is stopping, or could not set the attachment up.
    pub const UNAVAILABLE: u8 = 4;
}

/// Why the daemon closed an attachment.
pub mod goodbye {
    pub const PROTOCOL_ERROR: u8 = 1;
    pub const SHUTDOWN: u8 = 2;
}

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed attach message: {0}")]
pub struct HandshakeError(pub String);

fn bad(msg: impl Into<String>) -> HandshakeError {
    HandshakeError(msg.into())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// What a client says first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub token: [u8; TOKEN_BYTES],
    pub pid: u32,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&(VERSION as u16).to_le_bytes());
        out[8..24].copy_from_slice(&self.token);
        out[24..28].copy_from_slice(&self.pid.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, HandshakeError> {
        if bytes.len() != HELLO_BYTES {
            return Err(bad(format!("hello of {} bytes, expected {HELLO_BYTES}", bytes.len())));
        }
        if u32_at(bytes, 0) != HELLO_MAGIC {
            return Err(bad("not an attach hello (bad magic)"));
        }
        let version = u16_at(bytes, 4);
        if u64::from(version) != VERSION {
            return Err(bad(format!("attach protocol version {version}; this daemon speaks {VERSION}")));
        }
        if u16_at(bytes, 6) != 0 || u32_at(bytes, 28) != 0 {
            return Err(bad("reserved hello fields are not zero"));
        }
        Ok(Self { token: bytes[8..24].try_into().expect("16 bytes"), pid: u32_at(bytes, 24) })
    }
}

/// What the daemon grants an attached client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub attachment_id: u64,
    pub geometry: Geometry,
    /// Keys one multi-get may carry (the daemon's reply budget).
    pub max_multi_keys: u32,
}

impl Accepted {
    fn encode_body(&self) -> [u8; ACCEPTED_BODY_BYTES] {
        let mut out = [0u8; ACCEPTED_BODY_BYTES];
        out[0..8].copy_from_slice(&self.attachment_id.to_le_bytes());
        out[8..12].copy_from_slice(&self.geometry.slots().to_le_bytes());
        out[12..16].copy_from_slice(&self.geometry.slot_bytes().to_le_bytes());
        out[16..24].copy_from_slice(&self.geometry.area_len().to_le_bytes());
        out[24..28].copy_from_slice(&self.max_multi_keys.to_le_bytes());
        out
    }

    fn decode_body(body: &[u8]) -> Result<Self, HandshakeError> {
        if body.len() != ACCEPTED_BODY_BYTES {
            return Err(bad(format!("accepted body of {} bytes", body.len())));
        }
        let geometry = Geometry::new(u32_at(body, 8), u32_at(body, 12)).map_err(|e| bad(e.to_string()))?;
        if u64_at(body, 16) != geometry.area_len() {
            return Err(bad(format!(
                "area length {} does not match the geometry's {}",
                u64_at(body, 16),
                geometry.area_len()
            )));
        }
        Ok(Self { attachment_id: u64_at(body, 0), geometry, max_multi_keys: u32_at(body, 24).max(1) })
    }
}

/// A message from the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Accepted(Accepted),
    Refused { code: u8, reason: String },
    Goodbye { code: u8, reason: String },
}

impl Frame {
    pub fn encode(&self) -> Vec<u8> {
        let (kind, code, body): (u8, u8, Vec<u8>) = match self {
            Frame::Accepted(a) => (kind::ACCEPTED, 0, a.encode_body().to_vec()),
            Frame::Refused { code, reason } => (kind::REFUSED, *code, cut(reason)),
            Frame::Goodbye { code, reason } => (kind::GOODBYE, *code, cut(reason)),
        };
        let mut out = Vec::with_capacity(FRAME_HEADER_BYTES + body.len());
        out.extend_from_slice(&FRAME_MAGIC.to_le_bytes());
        out.push(kind);
        out.push(code);
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Parses a frame header: (kind, code, body length).
    pub fn decode_header(header: &[u8]) -> Result<(u8, u8, usize), HandshakeError> {
        if header.len() != FRAME_HEADER_BYTES {
            return Err(bad(format!("frame header of {} bytes", header.len())));
        }
        if u32_at(header, 0) != FRAME_MAGIC {
            return Err(bad("not an attach frame (bad magic)"));
        }
        let len = u16_at(header, 6) as usize;
        if len > MAX_FRAME_BODY {
            return Err(bad(format!("frame body of {len} bytes exceeds {MAX_FRAME_BODY}")));
        }
        Ok((header[4], header[5], len))
    }

    /// Parses a whole frame (header and exactly its body).
    pub fn decode(bytes: &[u8]) -> Result<Self, HandshakeError> {
        if bytes.len() < FRAME_HEADER_BYTES {
            return Err(bad(format!("frame of {} bytes", bytes.len())));
        }
        let (kind, code, len) = Self::decode_header(&bytes[..FRAME_HEADER_BYTES])?;
        let body = &bytes[FRAME_HEADER_BYTES..];
        if body.len() != len {
            return Err(bad(format!("frame body of {} bytes, header says {len}", body.len())));
        }
        match kind {
            kind::ACCEPTED => Accepted::decode_body(body).map(Frame::Accepted),
            kind::REFUSED => Ok(Frame::Refused { code, reason: String::from_utf8_lossy(body).into_owned() }),
            kind::GOODBYE => Ok(Frame::Goodbye { code, reason: String::from_utf8_lossy(body).into_owned() }),
            other => Err(bad(format!("unknown frame kind {other}"))),
        }
    }
}

fn cut(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_FRAME_BODY);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.as_bytes()[..end].to_vec()
}
