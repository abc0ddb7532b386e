//! `racekv bench scan`: walking every key with SCAN through racekv's Redis front end
//! against a real redis-server holding the same keys, same COUNT, one connection each, in
//! the same run, in alternating rounds (the machine is shared and noisy: compare the
//! ratio). Keys per second is distinct keys over the walk's time; racekv may return a key
//! twice (a split moves it after it was returned), and the report counts those.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::redis::{load, RedisServer};
use crate::report::{progress, Environment};

/// The longest RESP line or bulk string a reply may carry here (keys are short).
const MAX_REPLY_ITEM_BYTES: usize = 1 << 20;
/// The most keys one SCAN page may claim (COUNT is at most this here).
const MAX_PAGE_KEYS: usize = 1 << 20;

/// Settings of `racekv bench scan`.
#[derive(Debug, Clone, Args)]
pub struct ScanArgs {
    /// Keys loaded into both servers (key:000000000000 .., as redis-benchmark's -r).
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// SCAN's COUNT, for both servers.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=MAX_PAGE_KEYS as u64))]
    pub count: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 16)]
    pub value_size: usize,
    /// Alternating rounds (one whole walk of each server per round).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One whole walk.
#[derive(Debug, Clone, Serialize)]
pub struct Walk {
    /// Seconds the walk took.
    pub seconds: f64,
    /// SCAN calls.
    pub calls: u64,
    /// Keys returned, repeats included.
    pub returned: u64,
    /// Distinct keys returned.
    pub distinct: u64,
    /// Distinct keys per second.
    pub keys_per_sec: f64,
}

/// What `racekv bench scan` measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScanReport {
    /// The benchmark's name, `scan`.
    pub bench: &'static str,
    /// Keys loaded into both servers.
    pub keys: u64,
    /// SCAN's COUNT.
    pub count: u64,
    /// Value bytes.
    pub value_size: usize,
    /// `redis-server --version`.
    pub redis_server_version: String,
    /// redis-server's walks, one per round.
    pub redis_server: Vec<Walk>,
    /// racekv's walks, one per round.
    pub racekv: Vec<Walk>,
    /// redis-server's mean distinct keys per second.
    pub redis_server_keys_per_sec: f64,
    /// racekv's mean distinct keys per second.
    pub racekv_keys_per_sec: f64,
    /// Mean racekv / mean redis-server.
    pub ratio: f64,
    /// Where and when it ran.
    pub environment: Environment,
}

/// Reads one RESP line (without CRLF), bounded.
fn line(reader: &mut impl BufRead) -> anyhow::Result<String> {
    let mut buf = Vec::new();
    reader.by_ref().take(MAX_REPLY_ITEM_BYTES as u64 + 2).read_until(b'\n', &mut buf)?;
    anyhow::ensure!(buf.ends_with(b"\r\n"), "a reply line without CRLF (or too long)");
    buf.truncate(buf.len() - 2);
    Ok(String::from_utf8(buf)?)
}

/// A header line `<prefix><n>`, with `n` at most `max`.
fn header(reader: &mut impl BufRead, prefix: char, max: usize) -> anyhow::Result<usize> {
    let text = line(reader)?;
    let n = text.strip_prefix(prefix).with_context(|| format!("expected {prefix}, got {text:?}"))?;
    let n: usize = n.parse().with_context(|| format!("bad length in {text:?}"))?;
    anyhow::ensure!(n <= max, "{text:?} exceeds {max}");
    Ok(n)
}

fn bulk(reader: &mut impl BufRead) -> anyhow::Result<Vec<u8>> {
    let n = header(reader, '$', MAX_REPLY_ITEM_BYTES)?;
    let mut buf = vec![0; n + 2];
    reader.read_exact(&mut buf)?;
    anyhow::ensure!(buf.ends_with(b"\r\n"), "a bulk string without CRLF");
    buf.truncate(n);
    Ok(buf)
}

/// Walks every key of the server on `port` with `SCAN cursor COUNT count`.
fn walk(port: u16, count: u64, expected: u64, what: &str) -> anyhow::Result<Walk> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::with_capacity(1 << 16, stream);
    let mut seen: HashSet<u64> = HashSet::with_capacity(expected as usize);
    let (mut calls, mut returned) = (0u64, 0u64);
    let bar = progress(expected, what);
    let mut cursor = b"0".to_vec();
    let count = count.to_string();
    let started = Instant::now();
    loop {
        let mut request = format!("*4\r\n$4\r\nSCAN\r\n${}\r\n", cursor.len()).into_bytes();
        request.extend_from_slice(&cursor);
        request.extend_from_slice(format!("\r\n$5\r\nCOUNT\r\n${}\r\n{count}\r\n", count.len()).as_bytes());
        writer.write_all(&request)?;
        anyhow::ensure!(header(&mut reader, '*', 2)? == 2, "SCAN answered an array of other than 2");
        cursor = bulk(&mut reader)?;
        let n = header(&mut reader, '*', MAX_PAGE_KEYS)?;
        for _ in 0..n {
            seen.insert(xxhash_rust::xxh3::xxh3_64(&bulk(&mut reader)?));
        }
        calls += 1;
        returned += n as u64;
        bar.set_position(seen.len() as u64);
        if cursor == b"0" {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let distinct = seen.len() as u64;
    anyhow::ensure!(distinct == expected, "{what}: the walk found {distinct} of {expected} keys");
    Ok(Walk { seconds, calls, returned, distinct, keys_per_sec: distinct as f64 / seconds })
}

/// Runs the benchmark (needs redis-server on the PATH).
pub fn run(args: &ScanArgs) -> anyhow::Result<ScanReport> {
    let redis = RedisServer::start()?;
    let (redis_port, version) = (redis.port, redis.version.clone());

    // racekv: a memnode and a computenode in this process, on shm (as `bench redis`).
    let region = (args.keys * 256 + (256 << 20)).div_ceil(2 << 20) << 21;
    let memnode = BenchMemnode::start(TransportKind::Shm, region, 256, None, "bench-scan", false)?;
    let config = ComputenodeConfig {
        memnodes: vec![memnode.endpoint().to_string()],
        token: "bench-scan".into(),
        redis_addr: Some("127.0.0.1:0".into()),
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ..ComputenodeConfig::default()
    };
    config.validate()?;
    let node = Computenode::start(config)?;
    let racekv_port = node.redis_addr().context("redis front end")?.port();

    let value = vec![b'x'; args.value_size];
    load(redis_port, args.keys, &value, None)?;
    load(racekv_port, args.keys, &value, None)?;

    let (mut theirs, mut ours) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds.max(1) {
        theirs.push(walk(redis_port, args.count, args.keys, "redis-server")?);
        ours.push(walk(racekv_port, args.count, args.keys, "racekv")?);
    }
    let mean = |v: &[Walk]| v.iter().map(|w| w.keys_per_sec).sum::<f64>() / v.len() as f64;
    let (redis_server_keys_per_sec, racekv_keys_per_sec) = (mean(&theirs), mean(&ours));
    redis.shutdown();
    Ok(ScanReport {
        bench: "scan",
        keys: args.keys,
        count: args.count,
        value_size: args.value_size,
        redis_server_version: version,
        redis_server: theirs,
        racekv: ours,
        redis_server_keys_per_sec,
        racekv_keys_per_sec,
        ratio: racekv_keys_per_sec / redis_server_keys_per_sec,
        environment: Environment::capture(),
    })
}
