//! Real client libraries with their default settings, doing what applications do (a cache
//! with TTLs, a session store, a rate limiter with INCR + EXPIRE in a pipeline, bulk
//! MGET/MSET, SCAN iteration, binary keys and values), against a running `racekv up` and, in
//! the same test, against a real redis-server as the control: redis-py, node-redis and
//! ioredis (ops/clients/compat.*), the `redis` crate (here) and redis-cli's tools. A scenario
//! that passes on redis-server and fails on racekv fails the test.
//!
//! The Python and Node.js libraries are installed by ops/install-packages.sh into
//! ops/clients; without them the test fails, unless RACEKV_SKIP_CLIENT_LIBS=1 says to skip.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, Up};
use redis::Commands;

fn clients_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/clients")
}

/// A redis-server on a free port, no persistence, stopped on drop.
struct RedisServer {
    child: Child,
    port: u16,
}

impl RedisServer {
    fn start() -> Self {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (Debian package redis-server) is installed");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { child, port }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The interpreter for `script` when its libraries are installed (None: skip, if allowed).
fn runner(script: &str) -> Option<PathBuf> {
    let dir = clients_dir();
    let (bin, marker) = if script.ends_with(".py") {
        (dir.join(".venv/bin/python"), dir.join(".venv/bin/python"))
    } else {
        (PathBuf::from("node"), dir.join("node_modules/ioredis"))
    };
    if marker.exists() {
        return Some(bin);
    }
    if std::env::var("RACEKV_SKIP_CLIENT_LIBS").as_deref() == Ok("1") {
        eprintln!("skipping {script}: client libraries not installed and RACEKV_SKIP_CLIENT_LIBS=1");
        return None;
    }
    panic!("{} missing: run ops/install-packages.sh (or RACEKV_SKIP_CLIENT_LIBS=1)", marker.display());
}

/// Runs `script` against `port`: its PASS/FAIL lines.
fn run_script(bin: &Path, script: &str, port: u16) -> Vec<String> {
    let out = Command::new(bin)
        .arg(clients_dir().join(script))
        .arg(port.to_string())
        .current_dir(clients_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<String> =
        stdout.lines().filter(|l| l.starts_with("PASS ") || l.starts_with("FAIL ")).map(String::from).collect();
    assert!(!lines.is_empty(), "{script} ran nothing: {stdout} {}", String::from_utf8_lossy(&out.stderr));
    lines
}

/// Every scenario that passes on the control must pass on racekv.
fn compare(script: &str, racekv: &[String], control: &[String]) {
    for line in control.iter().filter(|l| l.starts_with("PASS ")) {
        let name = &line["PASS ".len()..];
        let ours = racekv.iter().find(|l| l[5..].starts_with(name)).cloned().unwrap_or_default();
        assert!(ours.starts_with("PASS "), "{script}: {name} passes on redis-server but not on racekv: {ours}");
    }
    assert!(control.iter().all(|l| l.starts_with("PASS ")), "{script}: the control itself failed: {control:?}");
}

fn library_scenarios(script: &str) {
    let Some(bin) = runner(script) else { return };
    // Room for the 100 MiB values (the region is memory only as it is touched).
    let up = Up::start(&["--region-bytes", "512MiB"]);
    let control = RedisServer::start();
    let theirs = run_script(&bin, script, control.port);
    let ours = run_script(&bin, script, up.redis);
    compare(script, &ours, &theirs);
}

#[test]
fn redis_py_scenarios() {
    library_scenarios("compat.py");
}

#[test]
fn node_redis_and_ioredis_scenarios() {
    library_scenarios("compat.mjs");
}

/// The same application patterns with the `redis` crate (RESP3), on both servers.
fn redis_rs_scenarios(port: u16) -> redis::RedisResult<()> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/?protocol=resp3"))?;
    let mut con = client.get_connection()?;
    let k = |name: &str| format!("compat:rs:{name}");
    let _: () = redis::cmd("SET").arg(k("cache")).arg("v").arg("EX").arg(60).query(&mut con)?;
    let ttl: i64 = redis::cmd("TTL").arg(k("cache")).query(&mut con)?;
    assert!(ttl > 0 && ttl <= 60, "ttl {ttl}");
    let (count, _): (i64, bool) = redis::pipe().incr(k("rate"), 1).expire(k("rate"), 60).query(&mut con)?;
    assert_eq!(count, 1);
    let pairs: Vec<(String, String)> = (0..200).map(|i| (k(&format!("bulk:{i}")), format!("value-{i}"))).collect();
    let _: () = redis::cmd("MSET").arg(&pairs).query(&mut con)?;
    let keys: Vec<&String> = pairs.iter().map(|(key, _)| key).collect();
    let values: Vec<String> = redis::cmd("MGET").arg(&keys).query(&mut con)?;
    assert_eq!(values, pairs.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>());
    let mut seen = con.scan_match::<_, String>(k("bulk:*"))?.collect::<Result<Vec<String>, _>>()?;
    seen.sort();
    let mut want: Vec<String> = keys.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(seen, want);
    let binary: Vec<u8> = (0..=255).collect();
    let _: () = redis::cmd("SET").arg(&binary[..]).arg(&binary[..]).query(&mut con)?;
    let got: Vec<u8> = redis::cmd("GET").arg(&binary[..]).query(&mut con)?;
    assert_eq!(got, binary);
    for size in [1usize << 20, 100 << 20] {
        let value: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let _: () = redis::cmd("SET").arg(k("large")).arg(&value[..]).query(&mut con)?;
        let got: Vec<u8> = redis::cmd("GET").arg(k("large")).query(&mut con)?;
        assert!(got == value, "{size} B came back as {} B", got.len());
    }
    let _: () = redis::cmd("DEL").arg(k("large")).query(&mut con)?;
    Ok(())
}

#[test]
fn redis_rs_scenarios_on_both_servers() {
    let up = Up::start(&["--region-bytes", "512MiB"]);
    let control = RedisServer::start();
    redis_rs_scenarios(control.port).expect("the control");
    redis_rs_scenarios(up.redis).expect("racekv");
}

#[test]
fn redis_cli_tools_on_both_servers() {
    let up = Up::start(&[]);
    let control = RedisServer::start();
    for port in [control.port, up.redis] {
        let cli = |args: &[&str]| {
            let out = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().unwrap();
            assert!(out.status.success(), "redis-cli {args:?} on {port}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        for i in 0..50 {
            cli(&["SET", &format!("tools:{i}"), &"x".repeat(i + 1)]);
        }
        let mut scanned: Vec<String> = cli(&["--scan", "--pattern", "tools:*"]).lines().map(String::from).collect();
        scanned.sort();
        assert_eq!(scanned.len(), 50, "port {port}");
        let big = cli(&["--bigkeys"]);
        assert!(big.contains("tools:49") && big.contains("50 bytes"), "port {port}: {big}");
        let mem = cli(&["--memkeys"]);
        // Sizes by MEMORY USAGE round to allocator classes, so the biggest is not always tools:49.
        assert!(mem.contains("Biggest string found") && mem.contains("50 strings"), "port {port}: {mem}");
        let stat = Command::new("timeout")
            .args(["2", "stdbuf", "-oL", "redis-cli", "-p", &port.to_string(), "--stat"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&stat.stdout).contains("keys"), "port {port}");
        let bench = Command::new("redis-benchmark")
            .args(["-p", &port.to_string(), "-t", "set,get,incr,mset", "-n", "2000", "-q"])
            .output()
            .unwrap();
        assert!(bench.status.success(), "redis-benchmark on {port}");
    }
}

/// The README's Python and Node.js snippets, run as they are written (only the port changes).
#[test]
fn the_readme_snippets_run() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let block = |lang: &str| {
        let start = readme.find(&format!("```{lang}\n")).unwrap_or_else(|| panic!("no {lang} block")) + lang.len() + 4;
        readme[start..start + readme[start..].find("```").unwrap()].to_string()
    };
    let up = Up::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    for (lang, file) in [("python", "snippet.py"), ("js", "snippet.mjs")] {
        let script = if lang == "python" { "compat.py" } else { "compat.mjs" };
        let Some(bin) = runner(script) else { return };
        let code = block(lang).replace("6380", &up.redis.to_string());
        // Node resolves packages next to the script: run it from ops/clients.
        let path = if lang == "js" {
            clients_dir().join(format!(".readme-{}.mjs", std::process::id()))
        } else {
            dir.path().join(file)
        };
        std::fs::write(&path, code).unwrap();
        let out = Command::new(&bin).arg(&path).current_dir(clients_dir()).output().unwrap();
        if lang == "js" {
            let _ = std::fs::remove_file(&path);
        }
        assert!(
            out.status.success(),
            "{lang} snippet: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
