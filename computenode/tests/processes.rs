//! A real memnode process and a real computenode process, driven through the Redis front end
//! by the real redis-cli and by a standard Redis client library (the `redis` crate).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "processes-token";

/// A binary of another package in this workspace (cargo builds every member's binaries
/// for `cargo test --workspace`).
fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` (or `cargo test --workspace`)",
        path.display()
    );
    path
}

struct Proc {
    child: Child,
    ready: serde_json::Value,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(binary: &Path, args: &[String], env: &[(&str, &str)]) -> Proc {
    let mut cmd = Command::new(binary);
    cmd.args(args).stdout(Stdio::piped()).env("RACEKV_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("READY ") => {
                return Proc { child, ready: serde_json::from_str(&line["READY ".len()..]).unwrap() };
            }
            Some(Ok(_)) => {}
            _ => panic!("{} exited before it was ready: {:?}", binary.display(), child.wait()),
        }
    }
}

fn memnode(dir: &Path, data_file: bool) -> Proc {
    let mut args = vec![
        "--listen-shm".to_string(),
        dir.join("m.sock").display().to_string(),
        "--listen-tcp".into(),
        "127.0.0.1:0".into(),
        "--metrics-addr".into(),
        "none".into(),
        "--region-bytes".into(),
        "64MiB".into(),
        "--groups-per-subtable".into(),
        "16".into(),
    ];
    if data_file {
        args.extend(["--data-file".to_string(), dir.join("region.dat").display().to_string()]);
    }
    spawn(&workspace_binary("racekv-memnode"), &args, &[("RACEKV_MEMNODE_TOKEN", TOKEN)])
}

fn computenode(memnodes: &str) -> Proc {
    let args = vec![
        "--memnodes".to_string(),
        memnodes.into(),
        "--redis-addr".into(),
        "127.0.0.1:0".into(),
        "--remote-addr".into(),
        "127.0.0.1:0".into(),
        "--attach-socket".into(),
        "none".into(),
        "--metrics-addr".into(),
        "127.0.0.1:0".into(),
    ];
    spawn(Path::new(env!("CARGO_BIN_EXE_racekv-computenode")), &args, &[("RACEKV_COMPUTENODE_TOKEN", TOKEN)])
}

/// redis-cli's output, exactly (one line per reply; a nil is an empty line).
fn redis_cli_raw(port: &str, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port)
        .args(args)
        .output()
        .expect("redis-cli (Debian package redis-tools) is installed");
    assert!(out.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn redis_cli(port: &str, args: &[&str]) -> String {
    redis_cli_raw(port, args).trim_end().to_string()
}

fn redis_port(c: &Proc) -> String {
    c.ready["redis"].as_str().unwrap().rsplit(':').next().unwrap().to_string()
}

#[test]
fn redis_cli_and_a_client_library_work_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let m = memnode(dir.path(), false);
    let shm = m.ready["endpoints"][0].as_str().unwrap().to_string();
    let c = computenode(&shm);
    let port = redis_port(&c);
    assert_eq!(redis_cli(&port, &["set", "a", "b"]), "OK");
    assert_eq!(redis_cli(&port, &["get", "a"]), "b");
    assert_eq!(redis_cli(&port, &["set", "a", "c", "NX"]), "");
    assert_eq!(redis_cli(&port, &["incr", "n"]), "1");
    assert_eq!(redis_cli(&port, &["incrby", "n", "41"]), "42");
    assert_eq!(redis_cli(&port, &["mset", "x", "1", "y", "2"]), "OK");
    assert_eq!(redis_cli_raw(&port, &["mget", "x", "y", "nope"]), "1\n2\n\n");
    assert_eq!(redis_cli(&port, &["del", "x", "nope"]), "1");
    assert_eq!(redis_cli(&port, &["exists", "y", "x"]), "1");
    assert_eq!(redis_cli(&port, &["dbsize"]), "3");
    assert!(redis_cli(&port, &["info"]).contains("racekv_memnodes:1"));
    // A value past a block's limit lives in an extent.
    assert_eq!(redis_cli(&port, &["set", "k", &"v".repeat(20_000)]), "OK");
    assert_eq!(redis_cli(&port, &["strlen", "k"]), "20000");
    assert_eq!(redis_cli(&port, &["get", "k"]), "v".repeat(20_000));
    // String commands on the table: compare-and-swap writes, GETDEL's compare-and-delete,
    // MEMORY USAGE's block size, the store's value limit in Redis' words.
    assert_eq!(redis_cli(&port, &["append", "s", "abc"]), "3");
    assert_eq!(redis_cli(&port, &["append", "s", "def"]), "6");
    assert_eq!(redis_cli(&port, &["getrange", "s", "1", "-2"]), "bcde");
    // A 16 B block header + 1 B key + 6 B value fit one 64 B unit; the slot is 8 B more.
    assert_eq!(redis_cli(&port, &["memory", "usage", "s"]), "72");
    assert_eq!(redis_cli(&port, &["getdel", "s"]), "abcdef");
    assert_eq!(redis_cli(&port, &["exists", "s"]), "0");
    assert_eq!(redis_cli(&port, &["incrbyfloat", "f", "10.50"]), "10.5");
    assert_eq!(redis_cli(&port, &["incrbyfloat", "f", "0.1"]), "10.6");
    assert_eq!(redis_cli(&port, &["setrange", "big", "20000", "x"]), "20001");
    // A large value's block (header, key, extent descriptor: one unit), its extent, its slot.
    assert_eq!(redis_cli(&port, &["memory", "usage", "big"]), (64 + 20_032 + 8).to_string());
    assert!(redis_cli(&port, &["setrange", "big", "536870912", "x"]).contains("string exceeds maximum allowed size"));
    assert!(redis_cli(&port, &["info", "keyspace"]).contains("db0:keys="));
    assert!(redis_cli(&port, &["client", "list"]).contains("cmd=client|list"));

    // A standard client library, with concurrent connections and pipelining.
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let client = &client;
            s.spawn(move || {
                let mut con = client.get_connection().unwrap();
                for i in 0..200 {
                    let key = format!("lib-{t}-{i}");
                    let _: () = redis::cmd("SET").arg(&key).arg(i).query(&mut con).unwrap();
                }
                let mut pipe = redis::pipe();
                for i in 0..200 {
                    pipe.cmd("GET").arg(format!("lib-{t}-{i}"));
                }
                let values: Vec<i64> = pipe.query(&mut con).unwrap();
                assert_eq!(values, (0..200).collect::<Vec<_>>());
                for _ in 0..50 {
                    let _: i64 = redis::cmd("INCR").arg("shared-counter").query(&mut con).unwrap();
                }
            });
        }
    });
    let mut con = client.get_connection().unwrap();
    let counter: i64 = redis::cmd("GET").arg("shared-counter").query(&mut con).unwrap();
    assert_eq!(counter, 200, "INCR by compare-and-swap lost updates");

    // /status reports the daemon.
    let status = http_get(c.ready["metrics"].as_str().unwrap(), "/status");
    let status: serde_json::Value = serde_json::from_str(status.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(status["memnodes"][0]["healthy_connections"], 4);
    assert!(status["workers"].as_u64().unwrap() >= 1);
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

#[test]
fn bad_resp_input_costs_only_its_connection() {
    let dir = tempfile::tempdir().unwrap();
    let m = memnode(dir.path(), false);
    let c = computenode(m.ready["endpoints"][1].as_str().unwrap());
    let port = redis_port(&c);
    let addr = format!("127.0.0.1:{port}");
    let mut good = TcpStream::connect(&addr).unwrap();
    good.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for junk in [
        &b"*2\r\n$3\r\nGET\r\n$999999999999\r\n"[..],
        b"*-5\r\n",
        b"\x00\xff garbage \r\n\r\n*1\r\n$x\r\n",
        b"*1\r\n$4\r\nPI",
    ] {
        let mut bad = TcpStream::connect(&addr).unwrap();
        bad.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        bad.write_all(junk).unwrap();
        let _ = bad.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let _ = bad.read_to_end(&mut reply);
        if !junk.ends_with(b"PI") {
            assert!(
                reply.starts_with(b"-ERR"),
                "junk {:?} got {:?}",
                String::from_utf8_lossy(junk),
                String::from_utf8_lossy(&reply)
            );
        }
        good.write_all(b"*3\r\n$3\r\nSET\r\n$4\r\nsafe\r\n$2\r\nok\r\n").unwrap();
        let mut buf = [0u8; 5];
        good.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"+OK\r\n");
    }
    assert_eq!(redis_cli(&port, &["get", "safe"]), "ok");
}

#[test]
fn the_pool_recovers_after_the_memnode_restarts_over_tcp() {
    the_pool_recovers_after_the_memnode_restarts(1);
}

/// Over shm the computenode keeps the region mapped while it waits: the restart must not
/// find the data file locked by that mapping.
#[test]
fn the_pool_recovers_after_the_memnode_restarts_over_shm() {
    the_pool_recovers_after_the_memnode_restarts(0);
}

/// Polls `/readyz` until it answers `code` (20 s at most).
fn await_readyz(metrics: &str, code: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let response = http_get(metrics, "/readyz");
        if response.starts_with(&format!("HTTP/1.0 {code}")) {
            if code != "200" {
                assert!(response.contains("not ready: no healthy connection to memnode"), "{response}");
            }
            return;
        }
        assert!(Instant::now() < deadline, "/readyz never answered {code}: {response}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Writes `keys` keys of `tag` with a client library, pipelined, and reads them back.
fn write_and_read_back(port: &str, tag: &str, keys: usize) {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut con = client.get_connection().unwrap();
    let value = |i: usize| format!("{tag}-{i}-").repeat(1 + i % 40);
    let mut pipe = redis::pipe();
    for i in 0..keys {
        pipe.cmd("SET").arg(format!("{tag}{i}")).arg(value(i)).ignore();
    }
    let _: () = pipe.query(&mut con).unwrap();
    let mut pipe = redis::pipe();
    for i in 0..keys {
        pipe.cmd("GET").arg(format!("{tag}{i}"));
    }
    let values: Vec<String> = pipe.query(&mut con).unwrap();
    for (i, got) in values.iter().enumerate() {
        assert_eq!(got, &value(i), "{tag}{i}");
    }
}

/// Starts the memnode of `dir` again on its socket, tcp port `port` and data file `file`.
fn restart_memnode(dir: &Path, port: &str, file: &str) -> Proc {
    let mut args = vec![
        "--data-file".to_string(),
        dir.join(file).display().to_string(),
        "--listen-shm".into(),
        dir.join("m.sock").display().to_string(),
        "--listen-tcp".into(),
        format!("127.0.0.1:{port}"),
        "--metrics-addr".into(),
        "none".into(),
        "--region-bytes".into(),
        "64MiB".into(),
    ];
    args.extend(["--groups-per-subtable".to_string(), "16".into()]);
    spawn(&workspace_binary("racekv-memnode"), &args, &[("RACEKV_MEMNODE_TOKEN", TOKEN)])
}

/// A memnode back at the same address with an empty data file (a disk lost) is another
/// table: the computenode's pool must not reconnect to it as the old one (it would read
/// every key as absent and write where nobody reads), so commands keep failing.
#[test]
fn the_pool_refuses_a_memnode_back_empty_at_the_same_address() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = memnode(dir.path(), true);
    let tcp = m.ready["endpoints"][1].as_str().unwrap().to_string();
    let port_of_memnode = tcp.rsplit(':').next().unwrap().to_string();
    let c = computenode(&tcp);
    let port = redis_port(&c);
    assert_eq!(redis_cli(&port, &["set", "survivor", "yes"]), "OK");
    let _ = m.child.kill();
    let _ = m.child.wait();
    let _m2 = restart_memnode(dir.path(), &port_of_memnode, "another-region.dat");
    // Long enough for the pool's repairs (10 ms backoff, doubling) to reach the new one.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let got = redis_cli(&port, &["get", "survivor"]);
        assert!(got.starts_with("TRYAGAIN") || got.starts_with("ERR"), "read from another table: {got:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let set = redis_cli(&port, &["set", "lost", "write"]);
    assert!(set.starts_with("TRYAGAIN") || set.starts_with("ERR"), "wrote to another table: {set:?}");
    // Its pool gives up on a slot whose endpoint serves another table (the old one never
    // comes back there) rather than dialing it every 2 s for as long as it lives.
    let metrics = c.ready["metrics"].as_str().unwrap().to_string();
    let page = http_get(&metrics, "/metrics");
    let abandoned = page
        .lines()
        .find_map(|l| l.strip_prefix("racekv_computenode_connection_replacements_total{result=\"abandoned\"} "))
        .map_or(0, |v| v.trim().parse::<u64>().unwrap());
    assert!(abandoned > 0, "no replacement was abandoned:\n{page}");
}

/// `endpoint`: which of the memnode's endpoints the computenode uses (0 shm, 1 tcp).
fn the_pool_recovers_after_the_memnode_restarts(endpoint: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = memnode(dir.path(), true);
    let tcp = m.ready["endpoints"][1].as_str().unwrap().to_string();
    let port_of_memnode = tcp.rsplit(':').next().unwrap().to_string();
    let c = computenode(m.ready["endpoints"][endpoint].as_str().unwrap());
    let port = redis_port(&c);
    assert_eq!(redis_cli(&port, &["set", "survivor", "yes"]), "OK");
    // The daemon's pool now holds chunks and free blocks of this run of the memnode.
    write_and_read_back(&port, "before", 2000);
    let metrics = c.ready["metrics"].as_str().unwrap().to_string();
    assert!(http_get(&metrics, "/readyz").starts_with("HTTP/1.0 200"));
    let _ = m.child.kill();
    let _ = m.child.wait();
    // Unready with no traffic at all (so a Service routes around it), live all along.
    await_readyz(&metrics, "503");
    assert!(http_get(&metrics, "/healthz").starts_with("HTTP/1.0 200"));
    // While it is down, commands fail with a retryable error instead of hanging.
    let down = redis_cli(&port, &["get", "survivor"]);
    assert!(down.starts_with("TRYAGAIN") || down.starts_with("ERR"), "{down}");
    // The same memnode comes back on the same socket, port and data file.
    let _m2 = restart_memnode(dir.path(), &port_of_memnode, "region.dat");
    // Ready again with no traffic: the probe itself starts the repair of the connections.
    await_readyz(&metrics, "200");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = redis_cli(&port, &["get", "survivor"]);
        if got == "yes" {
            break;
        }
        assert!(Instant::now() < deadline, "the computenode never recovered (last reply {got:?})");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(redis_cli(&port, &["set", "after", "restart"]), "OK");
    assert_eq!(redis_cli(&port, &["get", "after"]), "restart");
    // The restart reclaimed what the old run's space held free; the daemon writes in new
    // space only, and nothing written before is overwritten.
    write_and_read_back(&port, "later", 3000);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut con = client.get_connection().unwrap();
    for i in 0..2000 {
        let got: String = redis::cmd("GET").arg(format!("before{i}")).query(&mut con).unwrap();
        assert_eq!(got, format!("before-{i}-").repeat(1 + i % 40), "before{i}");
    }
}

/// Every setting can come from the environment, lists too (comma-separated); the CLI's own
/// variables do not disturb the daemon; `--print-config` prints TOML that, as a config
/// file, gives the same configuration.
#[test]
fn settings_come_from_the_environment_and_print_as_toml_that_loads_back() {
    let bin = env!("CARGO_BIN_EXE_racekv-computenode");
    let out = Command::new(bin)
        .arg("--print-config")
        .env("RACEKV_COMPUTENODE_MEMNODES", "tcp:10.0.0.1:7400,tcp:10.0.0.2:7400")
        .env("RACEKV_COMPUTENODE_MAX_WORKERS", "7")
        .env("RACEKV_COMPUTENODE_MAXMEMORY", "50%")
        .env("RACEKV_STATUS_FROM", "127.0.0.1:1,127.0.0.1:2")
        .env("RACEKV_MEMNODES", "tcp:127.0.0.1:1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    let parsed: toml::Table = printed.parse().expect("valid TOML");
    let memnodes = toml::Value::Array(vec!["tcp:10.0.0.1:7400".into(), "tcp:10.0.0.2:7400".into()]);
    assert_eq!(parsed["memnodes"], memnodes);
    assert_eq!(parsed["max_workers"].as_integer(), Some(7));
    assert_eq!(parsed["maxmemory"].as_str(), Some("50%"), "a share prints as set");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("computenode.toml");
    std::fs::write(&file, &printed).unwrap();
    let again = Command::new(bin).arg("--print-config").arg("--config").arg(&file).output().unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(String::from_utf8(again.stdout).unwrap(), printed);
    // The flag over the environment, bytes with Redis' units.
    let flag = Command::new(bin)
        .args(["--print-config", "--maxmemory", "2mb"])
        .env("RACEKV_COMPUTENODE_MAXMEMORY", "50%")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&flag.stdout).contains("maxmemory = 2097152\n"), "{flag:?}");
    // An unknown setting stops the daemon with a clear error, naming it.
    let out = Command::new(bin).arg("--print-config").env("RACEKV_COMPUTENODE_NO_SUCH", "1").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such"), "{}", String::from_utf8_lossy(&out.stderr));
}
