//! A minimal RESP2/RESP3 reply reader for tests that compare replies byte for byte (client
//! libraries normalize them: `+OK` and `$2 OK` look alike there).
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// One reply, as sent.
#[derive(Debug, Clone, PartialEq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Vec<u8>),
    /// `$-1`, `*-1` or RESP3 `_`.
    Null,
    Array(Vec<Resp>),
    Map(Vec<(Resp, Resp)>),
    Set(Vec<Resp>),
    Push(Vec<Resp>),
    Double(String),
    Bool(bool),
    Verbatim(String, Vec<u8>),
    BigNumber(String),
}

impl Resp {
    /// The text of a bulk, simple or verbatim reply.
    pub fn text(&self) -> String {
        match self {
            Resp::Bulk(b) | Resp::Verbatim(_, b) => String::from_utf8_lossy(b).into_owned(),
            Resp::Simple(s) | Resp::Error(s) => s.clone(),
            other => panic!("not text: {other:?}"),
        }
    }
}

/// Most bytes of one bulk string the reader accepts (test servers send small replies).
const MAX_BULK_BYTES: usize = 64 << 20;

fn line(r: &mut impl BufRead) -> io::Result<String> {
    let mut buf = Vec::new();
    r.read_until(b'\n', &mut buf)?;
    if !buf.ends_with(b"\r\n") {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("truncated line {buf:?}")));
    }
    buf.truncate(buf.len() - 2);
    String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn number(text: &str) -> io::Result<i64> {
    text.parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{text:?}: {e}")))
}

fn payload(r: &mut impl BufRead, len: i64) -> io::Result<Vec<u8>> {
    let len = usize::try_from(len).ok().filter(|&l| l <= MAX_BULK_BYTES).ok_or(io::ErrorKind::InvalidData)?;
    let mut buf = vec![0u8; len + 2];
    r.read_exact(&mut buf)?;
    buf.truncate(len);
    Ok(buf)
}

fn items(r: &mut impl BufRead, n: i64) -> io::Result<Vec<Resp>> {
    (0..n).map(|_| read(r)).collect()
}

/// Reads one reply.
pub fn read(r: &mut impl BufRead) -> io::Result<Resp> {
    let head = line(r)?;
    let (kind, rest) = head.split_at(1.min(head.len()));
    Ok(match kind {
        "+" => Resp::Simple(rest.into()),
        "-" => Resp::Error(rest.into()),
        ":" => Resp::Int(number(rest)?),
        "$" if rest == "-1" => Resp::Null,
        "$" => Resp::Bulk(payload(r, number(rest)?)?),
        "*" if rest == "-1" => Resp::Null,
        "*" => Resp::Array(items(r, number(rest)?)?),
        "~" => Resp::Set(items(r, number(rest)?)?),
        ">" => Resp::Push(items(r, number(rest)?)?),
        "%" => {
            let n = number(rest)?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((read(r)?, read(r)?));
            }
            Resp::Map(pairs)
        }
        "_" => Resp::Null,
        "," => Resp::Double(rest.into()),
        "#" => Resp::Bool(rest == "t"),
        "(" => Resp::BigNumber(rest.into()),
        "=" => {
            let body = payload(r, number(rest)?)?;
            let format = String::from_utf8_lossy(&body[..3.min(body.len())]).into_owned();
            Resp::Verbatim(format, body.get(4..).unwrap_or_default().to_vec())
        }
        other => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown reply type {other:?}"))),
    })
}

/// A connection that sends commands and reads their replies.
pub struct Conn {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Conn {
    pub fn connect(port: u16) -> io::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Self { writer: stream.try_clone()?, reader: BufReader::new(stream) })
    }

    /// Sends a command without reading its reply.
    pub fn send(&mut self, args: &[&[u8]]) -> io::Result<()> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&out)
    }

    /// Reads the next reply.
    pub fn reply(&mut self) -> io::Result<Resp> {
        read(&mut self.reader)
    }

    /// Sends a command and reads its reply.
    pub fn call(&mut self, args: &[&str]) -> Resp {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.send(&args).expect("send");
        self.reply().expect("reply")
    }

    /// Whether the server closed the connection (reads until EOF or an error, up to the
    /// read timeout).
    pub fn closed(&mut self) -> bool {
        let mut sink = [0u8; 1024];
        loop {
            match self.reader.read(&mut sink) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return false,
                Err(_) => return true,
            }
        }
    }
}
