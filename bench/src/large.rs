//! `racekv bench large`: SET and GET of large values (1 MiB to 100 MiB) through racekv's
//! Redis front end against a real redis-server, one connection each, in the same run, in
//! alternating rounds (the machine is shared and noisy: compare the ratios). Throughput is
//! value bytes moved per second of whole requests (sent, answered, read back and checked).
//! Writes a PNG of MB/s by value size.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::plot::{drawn, line_chart_with, Series};
use crate::redis::RedisServer;
use crate::report::{progress, Environment};

/// The largest value this bench moves (Redis' default `proto-max-bulk-len`).
const MAX_VALUE_BYTES: usize = 512 << 20;
/// Value bytes one size's round moves per server and operation, at least (at most 64 ops).
const BYTES_PER_ROUND: usize = 256 << 20;

/// Settings of `racekv bench large`.
#[derive(Debug, Clone, Args)]
pub struct LargeArgs {
    /// Value sizes in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10, 100])]
    pub sizes_mib: Vec<usize>,
    /// Alternating rounds per size.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Where the PNG goes.
    #[arg(long, default_value = "large-values.png")]
    pub plot: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One server's figures for one size.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Mean over the rounds, in 10^6 bytes per second.
    pub set_mb_per_sec: f64,
    /// Mean over the rounds, in 10^6 bytes per second.
    pub get_mb_per_sec: f64,
    /// Each round's (SET, GET) MB/s.
    pub rounds: Vec<(f64, f64)>,
}

/// One value size's figures, both servers.
#[derive(Debug, Clone, Serialize)]
pub struct SizeReport {
    /// Value bytes.
    pub value_bytes: usize,
    /// SETs (then GETs) per round.
    pub ops_per_round: usize,
    /// redis-server's throughput.
    pub redis_server: Throughput,
    /// racekv's throughput (through its Redis front end).
    pub racekv: Throughput,
    /// racekv / redis-server.
    pub set_ratio: f64,
    /// racekv / redis-server, GETs.
    pub get_ratio: f64,
}

/// What `racekv bench large` measured.
#[derive(Debug, Clone, Serialize)]
pub struct LargeReport {
    /// The benchmark's name, `large`.
    pub bench: &'static str,
    /// `redis-server --version`.
    pub redis_server_version: String,
    /// One entry per value size.
    pub sizes: Vec<SizeReport>,
    /// Where the plot went (None when it could not be drawn).
    pub plot: Option<String>,
    /// Where and when it ran.
    pub environment: Environment,
}

/// One connection speaking just enough RESP for SET and GET of one key.
struct Conn {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Conn {
    fn open(port: u16) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_nodelay(true)?;
        Ok(Self { writer: stream.try_clone()?, reader: BufReader::with_capacity(1 << 20, stream) })
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut buf = Vec::new();
        self.reader.by_ref().take(1024).read_until(b'\n', &mut buf)?;
        anyhow::ensure!(buf.ends_with(b"\r\n"), "a reply line without CRLF (or too long): {buf:?}");
        buf.truncate(buf.len() - 2);
        Ok(String::from_utf8(buf)?)
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
        let head = format!("*3\r\n$3\r\nSET\r\n${}\r\n", key.len());
        self.writer.write_all(head.as_bytes())?;
        self.writer.write_all(key)?;
        self.writer.write_all(format!("\r\n${}\r\n", value.len()).as_bytes())?;
        self.writer.write_all(value)?;
        self.writer.write_all(b"\r\n")?;
        let reply = self.line()?;
        anyhow::ensure!(reply == "+OK", "SET of {} B answered {reply:?}", value.len());
        Ok(())
    }

    /// GETs `key` into `out` (resized to the value).
    fn get(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<()> {
        let head = format!("*2\r\n$3\r\nGET\r\n${}\r\n", key.len());
        self.writer.write_all(head.as_bytes())?;
        self.writer.write_all(key)?;
        self.writer.write_all(b"\r\n")?;
        let header = self.line()?;
        let n: usize = header
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("GET answered {header:?}"))?;
        anyhow::ensure!(n <= MAX_VALUE_BYTES, "a value of {n} B claimed");
        out.resize(n + 2, 0);
        self.reader.read_exact(out)?;
        anyhow::ensure!(out.ends_with(b"\r\n"), "a bulk string without CRLF");
        out.truncate(n);
        Ok(())
    }
}

/// SETs then GETs `ops` values of `value`'s size on `port`: (SET MB/s, GET MB/s).
fn round(port: u16, value: &mut [u8], ops: usize, what: &str) -> anyhow::Result<(f64, f64)> {
    let mut conn = Conn::open(port)?;
    let bar = progress(2 * ops as u64, what);
    let key = b"bench:large";
    let started = Instant::now();
    for i in 0..ops {
        value[0] = i as u8; // each SET a different value
        conn.set(key, value)?;
        bar.inc(1);
    }
    let set_seconds = started.elapsed().as_secs_f64();
    let mut out = Vec::new();
    let started = Instant::now();
    for _ in 0..ops {
        conn.get(key, &mut out)?;
        bar.inc(1);
    }
    let get_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    value[0] = (ops - 1) as u8;
    anyhow::ensure!(out == value, "{what}: GET returned {} B that differ from the last SET", out.len());
    let megabytes = (ops * value.len()) as f64 / 1e6;
    Ok((megabytes / set_seconds, megabytes / get_seconds))
}

fn throughput(rounds: Vec<(f64, f64)>) -> Throughput {
    let n = rounds.len() as f64;
    Throughput {
        set_mb_per_sec: rounds.iter().map(|r| r.0).sum::<f64>() / n,
        get_mb_per_sec: rounds.iter().map(|r| r.1).sum::<f64>() / n,
        rounds,
    }
}

/// Runs the benchmark.
pub fn run(args: &LargeArgs) -> anyhow::Result<LargeReport> {
    let largest = args.sizes_mib.iter().max().copied().unwrap_or(1) << 20;
    anyhow::ensure!(largest <= MAX_VALUE_BYTES, "values go up to {} MiB", MAX_VALUE_BYTES >> 20);
    let redis = RedisServer::start()?;
    let (redis_port, version) = (redis.port, redis.version.clone());

    // racekv: a memnode and a computenode in this process, on shm (as `bench redis`), with
    // room for the largest value three times over (one live, the retired ones in grace).
    let region = ((3 * largest + (256 << 20)) as u64).div_ceil(2 << 20) << 21;
    let memnode = BenchMemnode::start(TransportKind::Shm, region, 256, None, "bench-large", false)?;
    let config = ComputenodeConfig {
        memnodes: vec![memnode.endpoint().to_string()],
        token: "bench-large".into(),
        redis_addr: Some("127.0.0.1:0".into()),
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ..ComputenodeConfig::default()
    };
    config.validate()?;
    let node = Computenode::start(config)?;
    let racekv_port = node.redis_addr().context("redis front end")?.port();

    let mut sizes = Vec::new();
    for &mib in &args.sizes_mib {
        let bytes = mib << 20;
        let mut value: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
        let ops = (BYTES_PER_ROUND / bytes.max(1)).clamp(3, 64);
        let (mut theirs, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..args.rounds.max(1) {
            theirs.push(round(redis_port, &mut value, ops, &format!("redis-server {mib} MiB"))?);
            ours.push(round(racekv_port, &mut value, ops, &format!("racekv {mib} MiB"))?);
        }
        let (theirs, ours) = (throughput(theirs), throughput(ours));
        sizes.push(SizeReport {
            value_bytes: bytes,
            ops_per_round: ops,
            set_ratio: ours.set_mb_per_sec / theirs.set_mb_per_sec,
            get_ratio: ours.get_mb_per_sec / theirs.get_mb_per_sec,
            redis_server: theirs,
            racekv: ours,
        });
    }
    redis.shutdown();

    let line = |name: &str, pick: &dyn Fn(&SizeReport) -> f64| Series {
        name: name.into(),
        points: sizes.iter().map(|s| ((s.value_bytes as f64 / (1 << 20) as f64).log2(), pick(s))).collect(),
    };
    let series = [
        line("redis-server SET", &|s| s.redis_server.set_mb_per_sec),
        line("racekv SET", &|s| s.racekv.set_mb_per_sec),
        line("redis-server GET", &|s| s.redis_server.get_mb_per_sec),
        line("racekv GET", &|s| s.racekv.get_mb_per_sec),
    ];
    let label = |x: &f64| match x.exp2() {
        v if v >= 10.0 => format!("{v:.0} MiB"),
        v => format!("{v:.1} MiB"),
    };
    let plot = drawn(
        &args.plot,
        line_chart_with(
            &args.plot,
            "Large values: SET and GET throughput",
            "value size",
            "MB/s",
            &series,
            Some(&label),
        ),
    );
    Ok(LargeReport { bench: "large", redis_server_version: version, sizes, plot, environment: Environment::capture() })
}
