//! The cache driver: `threads` threads, each with `connections` blocking RESP connections,
//! one operation in flight per connection. An operation reads a key chosen by a zipfian
//! and, on a miss, SETs it (what an application in front of a database does with a cache);
//! a read-only phase only GETs. A round writes every connection's command, then reads
//! every reply; a miss keeps its connection for the SET's round.

use std::io::Write;
use std::net::TcpStream;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use crate::ycsb::generator::{key_name, push_decimal, Zipfian};
use crate::ycsb::resp::{push_bulk, Expect, Reader, Reply};
use crate::ycsb::workload::share;

/// Redis' zipfian constant for the key choice (YCSB's).
pub const ZIPF_THETA: f64 = 0.99;

/// What one phase does with a miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// GET, and SET on a miss (`ttl_secs`: with `EX`, so volatile policies may evict it).
    ReadThrough {
        /// The SETs' expiry (None: none).
        ttl_secs: Option<u64>,
    },
    /// GET only.
    ReadOnly,
    /// SET every key once, in order (a warm cache with no evictions).
    Fill,
}

/// One phase against one server.
pub struct Run {
    /// The server's port on 127.0.0.1.
    pub port: u16,
    /// Keys `0..keys`.
    pub keys: u64,
    /// Operations, all threads together (Fill: ignored, every key once).
    pub ops: u64,
    /// The value SETs write.
    pub value: Vec<u8>,
    /// What it does.
    pub phase: Phase,
    /// Threads and connections per thread.
    pub threads: usize,
    /// Connections per thread.
    pub connections: usize,
    /// Seeds the threads' choices.
    pub seed: u64,
}

/// What a phase counted.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// GETs that found their key.
    pub hits: u64,
    /// GETs that found none.
    pub misses: u64,
    /// SETs answered OK.
    pub sets: u64,
    /// Error replies.
    pub errors: u64,
    /// Replies of another type than the command's.
    pub unexpected: u64,
    /// The first error's text.
    pub first_error: Option<String>,
}

impl Counts {
    fn merge(&mut self, other: Counts) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.sets += other.sets;
        self.errors += other.errors;
        self.unexpected += other.unexpected;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    /// Hits over GETs.
    pub fn hit_ratio(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// Runs it; returns the counts and the wall time in seconds.
pub fn run(run: &Run, bar: &indicatif::ProgressBar) -> anyhow::Result<(Counts, f64)> {
    let started = Instant::now();
    let zipf = Zipfian::new(run.keys, ZIPF_THETA);
    let results: Vec<anyhow::Result<Counts>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..run.threads)
            .map(|t| {
                let zipf = zipf.clone();
                s.spawn(move || thread(run, t, zipf, bar))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a driver thread panicked")).collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut total = Counts::default();
    for r in results {
        total.merge(r?);
    }
    Ok((total, seconds))
}

/// A connection's operation in flight: its key, and whether its SET is next.
struct Conn {
    stream: TcpStream,
    reader: Reader,
    key: Option<(u64, bool)>,
}

fn thread(run: &Run, index: usize, mut zipf: Zipfian, bar: &indicatif::ProgressBar) -> anyhow::Result<Counts> {
    let mut rng = SmallRng::seed_from_u64(run.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index as u64));
    // Fill: this thread's share of the keys, in order.
    let (mut next_fill, mut quota) = match run.phase {
        Phase::Fill => {
            let before: u64 = (0..index).map(|i| share(run.keys, run.threads, i)).sum();
            (before, share(run.keys, run.threads, index))
        }
        _ => (0, share(run.ops, run.threads, index)),
    };
    let mut conns = Vec::with_capacity(run.connections);
    for _ in 0..run.connections {
        let stream = TcpStream::connect(("127.0.0.1", run.port))?;
        stream.set_nodelay(true)?;
        let reader = Reader::new(stream.try_clone()?);
        conns.push(Conn { stream, reader, key: None });
    }
    let mut counts = Counts::default();
    let (mut out, mut name) = (Vec::new(), Vec::with_capacity(32));
    loop {
        let mut busy = false;
        for c in &mut conns {
            if c.key.is_none() && quota > 0 {
                quota -= 1;
                c.key = Some(match run.phase {
                    Phase::Fill => {
                        next_fill += 1;
                        (next_fill - 1, true)
                    }
                    _ => (zipf.next(&mut rng), false),
                });
            }
            let Some((key, set)) = c.key else { continue };
            busy = true;
            out.clear();
            key_name(key, &mut name);
            if set {
                encode_set(&mut out, &name, &run.value, run.phase);
            } else {
                out.extend_from_slice(b"*2\r\n$3\r\nGET\r\n");
                push_bulk(&mut out, &name);
            }
            c.stream.write_all(&out)?;
        }
        if !busy {
            break;
        }
        let mut done = 0;
        for c in &mut conns {
            let Some((key, set)) = c.key else { continue };
            let reply = c.reader.reply(if set { Expect::Ok } else { Expect::Bulk })?;
            c.key = None;
            match reply {
                Reply::Error(text) => {
                    counts.errors += 1;
                    counts.first_error.get_or_insert(text);
                }
                Reply::Unexpected => counts.unexpected += 1,
                Reply::Expected { .. } if set => counts.sets += 1,
                Reply::Expected { .. } => counts.hits += 1,
                Reply::Nil => {
                    counts.misses += 1;
                    if matches!(run.phase, Phase::ReadThrough { .. }) {
                        c.key = Some((key, true));
                        continue;
                    }
                }
            }
            done += 1;
        }
        bar.inc(done);
    }
    Ok(counts)
}

/// `SET key value [EX ttl]`.
fn encode_set(out: &mut Vec<u8>, key: &[u8], value: &[u8], phase: Phase) {
    let ttl = match phase {
        Phase::ReadThrough { ttl_secs } => ttl_secs,
        _ => None,
    };
    out.extend_from_slice(if ttl.is_some() { b"*5\r\n$3\r\nSET\r\n" } else { b"*3\r\n$3\r\nSET\r\n" });
    push_bulk(out, key);
    push_bulk(out, value);
    if let Some(secs) = ttl {
        out.extend_from_slice(b"$2\r\nEX\r\n");
        let mut number = Vec::with_capacity(20);
        push_decimal(&mut number, secs);
        push_bulk(out, &number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_carry_their_expiry_only_when_asked() {
        let mut out = Vec::new();
        encode_set(&mut out, b"k", b"v", Phase::ReadThrough { ttl_secs: Some(60) });
        assert_eq!(out, b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nEX\r\n$2\r\n60\r\n");
        out.clear();
        encode_set(&mut out, b"k", b"v", Phase::Fill);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n");
    }
}
