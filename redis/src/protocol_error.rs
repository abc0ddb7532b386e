//! Why a request stream is not valid RESP2 (what the parser and the inline-line splitter
//! refuse), and the text of the error reply.

use std::fmt;

/// Why the input is not a valid RESP2 request stream. Displayed without the
/// `Protocol error: ` prefix; messages follow Redis' where Redis has one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The array count is not a decimal integer, or is negative (other than -1).
    #[error("invalid multibulk length")]
    InvalidMultibulkLength,
    /// The array count exceeds [`Limits::max_array_len`](crate::resp::Limits::max_array_len).
    #[error("invalid multibulk length {len}: more than {max} arguments")]
    MultibulkTooLong {
        /// The count received.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The bulk length is not a decimal integer, or is negative.
    #[error("invalid bulk length")]
    InvalidBulkLength,
    /// The bulk length exceeds [`Limits::max_bulk_bytes`](crate::resp::Limits::max_bulk_bytes) (Redis' text, word for word).
    #[error("invalid bulk length")]
    BulkTooLong {
        /// The length received.
        len: u64,
        /// The limit, in bytes.
        max: usize,
    },
    /// Inside an array, an element is not a bulk string.
    #[error("expected '$', got '{}'", Printable(*.0))]
    ExpectedBulk(u8),
    /// No CRLF within [`MAX_COUNT_LINE_BYTES`](crate::resp::MAX_COUNT_LINE_BYTES) after `*`.
    #[error("too big mbulk count string")]
    MultibulkCountTooLong,
    /// No CRLF within [`MAX_COUNT_LINE_BYTES`](crate::resp::MAX_COUNT_LINE_BYTES) after `$`.
    #[error("too big bulk count string")]
    BulkCountTooLong,
    /// A count line has a CR not followed by LF.
    #[error("expected '\\n' after '\\r' in a count line")]
    MissingLineFeed,
    /// The bytes after a bulk string's data are not CRLF.
    #[error("expected CRLF after {len} bytes of bulk data")]
    MissingBulkTerminator {
        /// The bulk string's length in bytes.
        len: usize,
    },
    /// An inline line longer than [`Limits::max_inline_bytes`](crate::resp::Limits::max_inline_bytes).
    #[error("too big inline request")]
    InlineTooLong,
    /// An inline line with an unterminated quote, or a closing quote not followed by a space.
    #[error("unbalanced quotes in request")]
    UnbalancedQuotes,
    /// The command would occupy more than [`Limits::max_command_bytes`](crate::resp::Limits::max_command_bytes).
    #[error("command larger than {max} bytes")]
    CommandTooLarge {
        /// The limit, in bytes.
        max: usize,
    },
    /// Not malformed input: the server-wide [`QueryBudget`](crate::command::QueryBudget) (`limit` bytes) cannot take what
    /// this connection's partly received command needs next.
    #[error(
        "query buffer budget exhausted: partly received commands of all clients would hold more than \
         {limit} bytes (query-buffer-budget); try again later"
    )]
    QueryBufferBudget {
        /// The budget, in bytes.
        limit: usize,
    },
}

impl ProtocolError {
    /// Stable short name, for metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            ProtocolError::InvalidMultibulkLength => "invalid_multibulk_length",
            ProtocolError::MultibulkTooLong { .. } => "multibulk_too_long",
            ProtocolError::InvalidBulkLength => "invalid_bulk_length",
            ProtocolError::BulkTooLong { .. } => "bulk_too_long",
            ProtocolError::ExpectedBulk(_) => "expected_bulk",
            ProtocolError::MultibulkCountTooLong | ProtocolError::BulkCountTooLong => "count_line_too_long",
            ProtocolError::MissingLineFeed => "missing_line_feed",
            ProtocolError::MissingBulkTerminator { .. } => "missing_bulk_terminator",
            ProtocolError::InlineTooLong => "inline_too_long",
            ProtocolError::UnbalancedQuotes => "unbalanced_quotes",
            ProtocolError::CommandTooLarge { .. } => "command_too_large",
            ProtocolError::QueryBufferBudget { .. } => "query_buffer_budget",
        }
    }

    /// The error reply's text (without `-` and CRLF): `ERR Protocol error: ...` as Redis
    /// words it, or for the budget, which is no protocol error, `ERR query buffer budget ...`.
    pub fn reply_text(&self) -> String {
        match self {
            ProtocolError::QueryBufferBudget { .. } => format!("ERR {self}"),
            _ => format!("ERR Protocol error: {self}"),
        }
    }
}

/// Shows a byte as a character when printable, as `\xHH` otherwise (so error replies stay
/// one clean line).
struct Printable(u8);

impl fmt::Display for Printable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_ascii_graphic() || self.0 == b' ' {
            write!(f, "{}", self.0 as char)
        } else {
            write!(f, "\\x{:02x}", self.0)
        }
    }
}
