//! RESP2 replies and their encoding.

use std::borrow::Cow;

/// One reply to a client, in RESP2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`: a one-line status.
    Status(Cow<'static, str>),
    /// `-ERR ...`: starts with an upper-case error code (`ERR`, `OOM`, `TRYAGAIN`, ...).
    Error(Cow<'static, str>),
    /// `:42`.
    Integer(i64),
    /// `$3\r\nfoo`: binary-safe bytes.
    Bulk(Vec<u8>),
    /// `$-1`: the null bulk string (missing key).
    Nil,
    /// `*2 ...`.
    Array(Vec<Reply>),
}

impl Reply {
    /// `+OK`.
    pub fn ok() -> Self {
        Reply::Status(Cow::Borrowed("OK"))
    }

    /// An error reply; `message` starts with its code, e.g. `"ERR syntax error"`.
    pub fn error(message: impl Into<Cow<'static, str>>) -> Self {
        Reply::Error(message.into())
    }

    /// A bulk reply from text.
    pub fn bulk_str(text: &str) -> Self {
        Reply::Bulk(text.as_bytes().to_vec())
    }

    /// Whether this is an error reply (for metrics).
    pub fn is_error(&self) -> bool {
        matches!(self, Reply::Error(_))
    }

    /// Appends the RESP2 encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Status(text) => line(out, b'+', text),
            Reply::Error(text) => line(out, b'-', text),
            Reply::Integer(n) => {
                out.push(b':');
                out.extend_from_slice(n.to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Reply::Bulk(bytes) => {
                out.push(b'$');
                out.extend_from_slice(bytes.len().to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(bytes);
                out.extend_from_slice(b"\r\n");
            }
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::Array(items) => {
                out.push(b'*');
                out.extend_from_slice(items.len().to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                for item in items {
                    item.encode(out);
                }
            }
        }
    }
}

/// A one-line reply; CR and LF become spaces (as Redis does for errors) so that text taken
/// from a client (an unknown command's name) cannot break the framing.
fn line(out: &mut Vec<u8>, prefix: u8, text: &str) {
    out.push(prefix);
    out.extend(text.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(reply: &Reply) -> String {
        let mut out = Vec::new();
        reply.encode(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn encodes_every_kind() {
        assert_eq!(encoded(&Reply::ok()), "+OK\r\n");
        assert_eq!(encoded(&Reply::error("ERR bad\r\nthing")), "-ERR bad  thing\r\n");
        assert_eq!(encoded(&Reply::Integer(-3)), ":-3\r\n");
        assert_eq!(encoded(&Reply::bulk_str("a\r\nb")), "$4\r\na\r\nb\r\n");
        assert_eq!(encoded(&Reply::Nil), "$-1\r\n");
        assert_eq!(
            encoded(&Reply::Array(vec![Reply::Integer(1), Reply::Nil, Reply::Array(vec![])])),
            "*3\r\n:1\r\n$-1\r\n*0\r\n"
        );
    }
}
