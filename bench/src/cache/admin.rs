//! The few administrative commands the cache benchmark sends between runs: FLUSHALL,
//! CONFIG SET, and one number out of INFO.

use std::io::{Read, Write};
use std::net::TcpStream;

use crate::ycsb::resp::{command, Expect, Reader, Reply};

/// The longest INFO reply read (a few KiB in practice).
const MAX_INFO_BYTES: usize = 1 << 20;

/// Sends `args`; Ok(Err(text)) when the server answered an error (a refused setting).
pub fn ok(port: u16, args: &[&[u8]]) -> anyhow::Result<Result<(), String>> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = Reader::new(stream.try_clone()?);
    stream.write_all(&command(args))?;
    match reader.reply(Expect::Ok)? {
        Reply::Expected { .. } => Ok(Ok(())),
        Reply::Error(text) => Ok(Err(text)),
        other => anyhow::bail!("{:?} answered {other:?}", String::from_utf8_lossy(args[0])),
    }
}

/// `CONFIG SET maxmemory <bytes> maxmemory-policy <policy>`; Ok(Err(why)) when refused.
pub fn set_limit(port: u16, bytes: u64, policy: &str) -> anyhow::Result<Result<(), String>> {
    let bytes = bytes.to_string();
    ok(port, &[b"CONFIG", b"SET", b"maxmemory", bytes.as_bytes(), b"maxmemory-policy", policy.as_bytes()])
}

/// Empties the server.
pub fn flushall(port: u16) -> anyhow::Result<()> {
    ok(port, &[b"FLUSHALL"])?.map_err(|e| anyhow::anyhow!("FLUSHALL: {e}"))
}

/// `field` of `INFO section` as a number (None: the server has no such field).
pub fn info_number(port: u16, section: &str, field: &str) -> anyhow::Result<Option<u64>> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.write_all(&command(&[b"INFO", section.as_bytes()]))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    // `$<len>\r\n<text>\r\n`: read until the header's length has arrived.
    loop {
        let n = stream.read(&mut chunk)?;
        anyhow::ensure!(n > 0, "the server closed the connection during INFO");
        buf.extend_from_slice(&chunk[..n]);
        anyhow::ensure!(buf.len() <= MAX_INFO_BYTES + 32, "an INFO reply over {MAX_INFO_BYTES} bytes");
        let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else { continue };
        anyhow::ensure!(buf[0] == b'$', "INFO answered {:?}", String::from_utf8_lossy(&buf[..end]));
        let len: usize = std::str::from_utf8(&buf[1..end])?.parse()?;
        anyhow::ensure!(len <= MAX_INFO_BYTES, "an INFO reply of {len} bytes");
        if buf.len() >= end + 2 + len {
            let text = String::from_utf8_lossy(&buf[end + 2..end + 2 + len]).into_owned();
            let prefix = format!("{field}:");
            return Ok(text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.trim().parse().ok()));
        }
    }
}
