//! Messages on the attach socket: the client's hello, then the daemon's frames (accepted,
//! refused, goodbye). Fixed sizes and explicit bounds: a decoder never allocates more than
//! [`MAX_FRAME_BODY`] bytes, whatever it is fed.
//!
//! ```text
//! hello : magic "RKVA" | version u16 | flags u16 | user_len u16 | password_len u16 |
//!         zero [12] | pid u32 | reserved u32   (32 B), then user | password
//!         (the computenode's ACL user and password; length 0: none given)
//! frame : magic "RKVF" | kind u8 | code u8 | body length u16 | body
//!   ACCEPTED : attachment id u64 | slots u32 | slot bytes u32 | area length u64 |
//!              max multi-get keys u32 | reserved u32          (32 B; memfd + 2 eventfds attached)
//!   REFUSED  : UTF-8 reason (code: [`refusal`])
//!   GOODBYE  : UTF-8 reason (code: [`goodbye`]), sent before the daemon closes an attachment
//!   LENT     : one memnode's lent connection ([`super::lending`]; its descriptors attached)
//!   NOT_LENT : UTF-8 reason the daemon lends no connections to this client
//! ```
//!
//! Hello flags: bit 0 ([`HELLO_FLAG_BORROW`]) asks the daemon to lend connections to its
//! memnodes; after ACCEPTED it then sends one LENT frame per memnode, or one NOT_LENT.

use racekv_transport::decode::{DecodeError, Reader};

use super::area::{Geometry, VERSION};

/// `"RKVA"`, the first word of a client's hello.
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"RKVA");
/// `"RKVF"`, the first word of every daemon frame.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"RKVF");
/// The fixed part of a hello; the credentials follow it.
pub const HELLO_BYTES: usize = 32;
/// Longest user name in a hello.
pub const MAX_USER_BYTES: usize = 256;
/// Longest password in a hello.
pub const MAX_PASSWORD_BYTES: usize = 1024;
/// Hello flag: lend me connections to the memnodes (after ACCEPTED: LENT frames or NOT_LENT).
pub const HELLO_FLAG_BORROW: u16 = 1;
/// A frame's header: magic, kind, code, body length.
pub const FRAME_HEADER_BYTES: usize = 8;
/// Longest frame body (reasons are cut to fit).
pub const MAX_FRAME_BODY: usize = 1024;
/// The body of an ACCEPTED frame.
pub const ACCEPTED_BODY_BYTES: usize = 32;

/// Frame kinds.
pub mod kind {
    /// The daemon took the client; the body is an [`Accepted`](super::Accepted).
    pub const ACCEPTED: u8 = 1;
    /// The daemon turned the client away; the code is a [`refusal`](super::refusal).
    pub const REFUSED: u8 = 2;
    /// The daemon is closing the attachment; the code is a [`goodbye`](super::goodbye).
    pub const GOODBYE: u8 = 3;
    /// One memnode's lent connection ([`super::super::lending`]).
    pub const LENT: u8 = 4;
    /// The daemon lends no connections to this client; the body says why.
    pub const NOT_LENT: u8 = 5;
}

/// Why an attach was refused.
pub mod refusal {
    /// The daemon serves its maximum number of attached clients.
    pub const TOO_MANY_CLIENTS: u8 = 1;
    /// Wrong user or password, or the peer's uid is not allowed.
    pub const NOT_ALLOWED: u8 = 2;
    /// A malformed hello or an unsupported version.
    pub const BAD_HELLO: u8 = 3;
    /// The daemon is stopping, or could not set the attachment up.
    pub const UNAVAILABLE: u8 = 4;
}

/// Why the daemon closed an attachment.
pub mod goodbye {
    /// The client broke the ring protocol (the reason says how).
    pub const PROTOCOL_ERROR: u8 = 1;
    /// The computenode is shutting down.
    pub const SHUTDOWN: u8 = 2;
}

/// What the errors of a malformed hello or frame say it is ([`DecodeError::what`]).
pub const MALFORMED_ATTACH: &str = "malformed attach message";

fn bad(msg: impl Into<String>) -> DecodeError {
    DecodeError::new(MALFORMED_ATTACH, msg)
}

fn reader(bytes: &[u8]) -> Reader<'_> {
    Reader::new(MALFORMED_ATTACH, bytes)
}

/// What a hello's fixed part says, checked: the credentials' lengths and the pid.
struct HelloHead {
    user_len: usize,
    password_len: usize,
    pid: u32,
    borrow: bool,
}

impl HelloHead {
    fn decode(head: &[u8]) -> Result<Self, DecodeError> {
        if head.len() != HELLO_BYTES {
            return Err(bad(format!("hello of {} bytes, expected {HELLO_BYTES}", head.len())));
        }
        let mut r = reader(head);
        if r.u32()? != HELLO_MAGIC {
            return Err(bad("not an attach hello (bad magic)"));
        }
        let version = r.u16()?;
        if u64::from(version) != VERSION {
            return Err(bad(format!("attach protocol version {version}; this daemon speaks {VERSION}")));
        }
        let flags = r.u16()?;
        let (user_len, password_len) = (usize::from(r.u16()?), usize::from(r.u16()?));
        let zero = r.array::<12>()?;
        let (pid, reserved) = (r.u32()?, r.u32()?);
        if flags & !HELLO_FLAG_BORROW != 0 || zero != [0; 12] || reserved != 0 {
            return Err(bad("reserved hello fields are not zero"));
        }
        if user_len > MAX_USER_BYTES || password_len > MAX_PASSWORD_BYTES {
            return Err(bad(format!(
                "credentials of {user_len} + {password_len} bytes (at most {MAX_USER_BYTES} + {MAX_PASSWORD_BYTES})"
            )));
        }
        Ok(Self { user_len, password_len, pid, borrow: flags & HELLO_FLAG_BORROW != 0 })
    }
}

/// What a client says first: who it is. Over a Unix socket (the kernel's, on this host), so
/// the password travels as it is, as with Redis' AUTH; a user that gives none relies on the
/// daemon trusting its uid, or on an open default user.
#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    /// The client's process id, as it says (the daemon logs it beside the kernel's).
    pub pid: u32,
    /// The ACL user (`None`: `default`).
    pub user: Option<String>,
    /// The user's password (`None`: none given).
    pub password: Option<Vec<u8>>,
    /// Asks the daemon to lend connections to its memnodes ([`HELLO_FLAG_BORROW`]).
    pub borrow: bool,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let password = self.password.as_ref().map(|_| "***");
        f.debug_struct("Hello")
            .field("pid", &self.pid)
            .field("user", &self.user)
            .field("password", &password)
            .field("borrow", &self.borrow)
            .finish()
    }
}

impl Hello {
    /// The hello's bytes: the fixed part, then user and password.
    pub fn encode(&self) -> Vec<u8> {
        let user = self.user.as_deref().unwrap_or("").as_bytes();
        let password = self.password.as_deref().unwrap_or(b"");
        assert!(user.len() <= MAX_USER_BYTES && password.len() <= MAX_PASSWORD_BYTES, "checked by the builder");
        let mut out = vec![0u8; HELLO_BYTES];
        out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&(VERSION as u16).to_le_bytes());
        let flags = if self.borrow { HELLO_FLAG_BORROW } else { 0 };
        out[6..8].copy_from_slice(&flags.to_le_bytes());
        out[8..10].copy_from_slice(&(user.len() as u16).to_le_bytes());
        out[10..12].copy_from_slice(&(password.len() as u16).to_le_bytes());
        out[24..28].copy_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(user);
        out.extend_from_slice(password);
        out
    }

    /// How many credential bytes follow the fixed part `head` (checked against the limits).
    pub fn credentials_len(head: &[u8]) -> Result<usize, DecodeError> {
        HelloHead::decode(head).map(|h| h.user_len + h.password_len)
    }

    /// A whole hello: the fixed part and exactly its credentials.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let head = bytes.get(..HELLO_BYTES).ok_or_else(|| bad(format!("hello of {} bytes", bytes.len())))?;
        let head = HelloHead::decode(head)?;
        let whole = HELLO_BYTES + head.user_len + head.password_len;
        if bytes.len() != whole {
            return Err(bad(format!("hello of {} bytes, its header says {whole}", bytes.len())));
        }
        let mut r = reader(&bytes[HELLO_BYTES..]);
        let user = r.take(head.user_len)?;
        let password = r.rest();
        let user = std::str::from_utf8(user).map_err(|_| bad("a user name that is not UTF-8"))?;
        Ok(Self {
            pid: head.pid,
            user: (!user.is_empty()).then(|| user.to_string()),
            password: (!password.is_empty()).then(|| password.to_vec()),
            borrow: head.borrow,
        })
    }
}

/// What the daemon grants an attached client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// The daemon's id for this attachment (in both sides' logs).
    pub attachment_id: u64,
    /// The shared area's slot count and size.
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

    fn decode_body(body: &[u8]) -> Result<Self, DecodeError> {
        if body.len() != ACCEPTED_BODY_BYTES {
            return Err(bad(format!("accepted body of {} bytes", body.len())));
        }
        let mut r = reader(body);
        let attachment_id = r.u64()?;
        let (slots, slot_bytes, area_len, max_multi_keys) = (r.u32()?, r.u32()?, r.u64()?, r.u32()?);
        // The last word is reserved; it has never been checked, so it stays unchecked.
        let geometry = Geometry::new(slots, slot_bytes).map_err(|e| bad(e.to_string()))?;
        if area_len != geometry.area_len() {
            return Err(bad(format!("area length {area_len} does not match the geometry's {}", geometry.area_len())));
        }
        Ok(Self { attachment_id, geometry, max_multi_keys: max_multi_keys.max(1) })
    }
}

/// A message from the daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// The client is attached; the area and doorbells come with the frame.
    Accepted(Accepted),
    /// The client is turned away.
    Refused {
        /// Why, for programs: a [`refusal`] code.
        code: u8,
        /// Why, for people.
        reason: String,
    },
    /// The daemon closes the attachment.
    Goodbye {
        /// Why, for programs: a [`goodbye`] code.
        code: u8,
        /// Why, for people.
        reason: String,
    },
    /// The daemon lends this client no connections (it asked with [`HELLO_FLAG_BORROW`]).
    NotLent {
        /// Why, for people.
        reason: String,
    },
}

impl Frame {
    /// The frame's bytes: header, then body (a reason cut to [`MAX_FRAME_BODY`]).
    pub fn encode(&self) -> Vec<u8> {
        let (kind, code, body): (u8, u8, Vec<u8>) = match self {
            Frame::Accepted(a) => (kind::ACCEPTED, 0, a.encode_body().to_vec()),
            Frame::Refused { code, reason } => (kind::REFUSED, *code, cut(reason)),
            Frame::Goodbye { code, reason } => (kind::GOODBYE, *code, cut(reason)),
            Frame::NotLent { reason } => (kind::NOT_LENT, 0, cut(reason)),
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
    pub fn decode_header(header: &[u8]) -> Result<(u8, u8, usize), DecodeError> {
        if header.len() != FRAME_HEADER_BYTES {
            return Err(bad(format!("frame header of {} bytes", header.len())));
        }
        let mut r = reader(header);
        if r.u32()? != FRAME_MAGIC {
            return Err(bad("not an attach frame (bad magic)"));
        }
        let (kind, code, len) = (r.u8()?, r.u8()?, usize::from(r.u16()?));
        if len > MAX_FRAME_BODY {
            return Err(bad(format!("frame body of {len} bytes exceeds {MAX_FRAME_BODY}")));
        }
        Ok((kind, code, len))
    }

    /// Parses a whole frame (header and exactly its body).
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
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
            kind::NOT_LENT => Ok(Frame::NotLent { reason: String::from_utf8_lossy(body).into_owned() }),
            kind::LENT => Err(bad("a LENT frame carries descriptors: read it with lending::LentMemnode::decode")),
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
