//! Inline commands: splitting a typed line into arguments exactly as Redis' `sdssplitargs`
//! does (whitespace separation, `"..."` with C-like escapes, `'...'`), and the reverse.

use super::command::{Command, ARG_OVERHEAD_BYTES};
use super::protocol_error::ProtocolError;

fn is_space(b: u8) -> bool {
    // C isspace(): space, \t, \n, \v, \f, \r.
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

fn hex_value(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Splits one inline line (without its line ending) into a command; empty when the line is
/// blank. A command charged more than `max_command_bytes` is refused.
pub(crate) fn split_args(line: &[u8], max_command_bytes: usize) -> Result<Command, ProtocolError> {
    let mut cmd = Command::new();
    let mut arg = Vec::new();
    let mut i = 0;
    loop {
        while i < line.len() && is_space(line[i]) {
            i += 1;
        }
        if i == line.len() {
            return Ok(cmd);
        }
        arg.clear();
        let mut in_double = false;
        let mut in_single = false;
        loop {
            let c = line.get(i).copied();
            if in_double {
                match c {
                    None => return Err(ProtocolError::UnbalancedQuotes),
                    Some(b'\\') if line.get(i + 1) == Some(&b'x') => {
                        match (line.get(i + 2).and_then(|&b| hex_value(b)), line.get(i + 3).and_then(|&b| hex_value(b)))
                        {
                            (Some(hi), Some(lo)) => {
                                arg.push(hi * 16 + lo);
                                i += 3;
                            }
                            // Not a valid \xHH: Redis keeps the escaped character, `x`.
                            _ => {
                                arg.push(b'x');
                                i += 1;
                            }
                        }
                    }
                    Some(b'\\') if i + 1 < line.len() => {
                        i += 1;
                        arg.push(match line[i] {
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'b' => 0x08,
                            b'a' => 0x07,
                            other => other,
                        });
                    }
                    Some(b'"') => {
                        // The closing quote must be followed by a space or the end.
                        if line.get(i + 1).is_some_and(|&b| !is_space(b)) {
                            return Err(ProtocolError::UnbalancedQuotes);
                        }
                        i += 1;
                        break;
                    }
                    Some(other) => arg.push(other),
                }
            } else if in_single {
                match c {
                    None => return Err(ProtocolError::UnbalancedQuotes),
                    Some(b'\\') if line.get(i + 1) == Some(&b'\'') => {
                        i += 1;
                        arg.push(b'\'');
                    }
                    Some(b'\'') => {
                        if line.get(i + 1).is_some_and(|&b| !is_space(b)) {
                            return Err(ProtocolError::UnbalancedQuotes);
                        }
                        i += 1;
                        break;
                    }
                    Some(other) => arg.push(other),
                }
            } else {
                match c {
                    None | Some(b' ' | b'\n' | b'\r' | b'\t') => break,
                    // C stops at NUL; we are binary safe and treat it as a separator, consumed
                    // here because the skip loop above does not take it for a space.
                    Some(0) => {
                        i += 1;
                        break;
                    }
                    Some(b'"') => in_double = true,
                    Some(b'\'') => in_single = true,
                    Some(other) => arg.push(other),
                }
            }
            i += 1;
        }
        if cmd.charged_bytes() + arg.len() + ARG_OVERHEAD_BYTES > max_command_bytes {
            return Err(ProtocolError::CommandTooLarge { max: max_command_bytes });
        }
        cmd.push(&arg);
    }
}

/// Appends `cmd` as one inline line: each argument double-quoted, with `\\`, `\"` and
/// non-printable bytes escaped (`\xHH`), so [`split_args`] gives back exactly the same bytes.
pub(crate) fn encode(cmd: &Command, out: &mut Vec<u8>) {
    for (n, arg) in cmd.args().enumerate() {
        if n > 0 {
            out.push(b' ');
        }
        out.push(b'"');
        for &b in arg {
            match b {
                b'\\' | b'"' => out.extend_from_slice(&[b'\\', b]),
                0x20..=0x7e => out.push(b),
                _ => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            }
        }
        out.push(b'"');
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(line: &str) -> Result<Vec<String>, ProtocolError> {
        split_args(line.as_bytes(), usize::MAX)
            .map(|cmd| cmd.args().map(|a| String::from_utf8_lossy(a).into_owned()).collect())
    }

    #[test]
    fn splits_like_sdssplitargs() {
        assert_eq!(split("  set  k v ").unwrap(), ["set", "k", "v"]);
        assert_eq!(split(r#"set k "a b\n\x41\"""#).unwrap(), ["set", "k", "a b\nA\""]);
        assert_eq!(split(r"set k 'it\'s'").unwrap(), ["set", "k", "it's"]);
        assert_eq!(split(r#"echo """#).unwrap(), ["echo", ""]);
        assert_eq!(split(r#"echo "\xZZ""#).unwrap(), ["echo", "xZZ"]);
        assert_eq!(split(r#"echo ab"c d""#).unwrap(), ["echo", "abc d"]);
        assert_eq!(split("a\0b\0\0").unwrap(), ["a", "b", ""]);
        assert!(split("").unwrap().is_empty());
        assert!(split(" \t ").unwrap().is_empty());
    }

    #[test]
    fn unbalanced_quotes_are_refused() {
        for line in [r#"get "k"#, r#"get "k"x"#, "get 'k", "get 'k'x", r#"get "k\"#] {
            assert_eq!(split(line), Err(ProtocolError::UnbalancedQuotes), "{line}");
        }
    }

    #[test]
    fn oversized_inline_commands_are_refused() {
        assert_eq!(split_args(b"set k v", 3 + 1 + 1 + 3 * ARG_OVERHEAD_BYTES).map(|c| c.len()), Ok(3));
        assert!(split_args(b"set k vv", 3 + 1 + 1 + 3 * ARG_OVERHEAD_BYTES).is_err());
    }
}
