//! Fuzzes the RESP2 request parser with untrusted bytes.
//!
//! The first input byte picks the feed chunk size (1..=64) and the limits (default, or tiny
//! ones that make every limit reachable); the rest is the byte stream. Checked, beyond "no
//! panic, no hang, no huge allocation":
//! * splitting the stream into chunks yields exactly what feeding it whole yields;
//! * the parser never holds more than `Limits::max_buffered_bytes` for the chunk size;
//! * every parsed command re-encodes (as an array and inline) to bytes that parse back to it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_redis::resp::{encode_command, encode_inline};
use racekv_redis::{Command, Limits, Parser, ProtocolError};

const TINY: Limits = Limits { max_bulk_bytes: 16, max_array_len: 4, max_inline_bytes: 32, max_command_bytes: 96 };

fn parse(limits: Limits, input: &[u8], chunk: usize) -> (Vec<Command>, Option<ProtocolError>) {
    let mut parser = Parser::new(limits);
    let mut commands = Vec::new();
    for piece in input.chunks(chunk) {
        parser.feed(piece);
        assert!(parser.buffered_bytes() <= limits.max_buffered_bytes(chunk));
        loop {
            match parser.next_command() {
                Ok(Some(cmd)) => commands.push(cmd),
                Ok(None) => break,
                Err(e) => return (commands, Some(e)),
            }
        }
        assert!(parser.buffered_bytes() <= limits.max_buffered_bytes(chunk));
    }
    (commands, None)
}

fn reparse(bytes: &[u8]) -> Vec<Command> {
    // Generous limits: the inline form escapes bytes and may outgrow the original limits.
    let roomy = Limits { max_inline_bytes: bytes.len() + 1, max_command_bytes: usize::MAX / 2, ..Limits::default() };
    let (commands, error) = parse(roomy, bytes, bytes.len().max(1));
    assert_eq!(error, None);
    commands
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, input)) = data.split_first() else { return };
    let chunk = usize::from(control & 0x3f) + 1;
    let limits = if control & 0x40 != 0 { TINY } else { Limits::default() };

    let whole = parse(limits, input, input.len().max(1));
    let split = parse(limits, input, chunk);
    assert_eq!(whole, split, "chunking changed the outcome");

    for cmd in &whole.0 {
        assert!(!cmd.is_empty());
        let mut array = Vec::new();
        encode_command(cmd, &mut array);
        assert_eq!(reparse(&array), [cmd.clone()]);
        let mut inline = Vec::new();
        encode_inline(cmd, &mut inline);
        assert_eq!(reparse(&inline), [cmd.clone()]);
    }
});
