//! The same command script against racekv (over the MemStore test double) and a real
//! redis-server (started here on a free loopback port with `--save ""`, stopped by its
//! pid), replies compared byte for byte. Where a reply legitimately differs (ids, times,
//! versions, racekv's limits) only its shape is compared; INFO and CLIENT LIST are compared
//! by field names. Replies were checked against redis-server 7.0.15 (Debian's).

mod common;
#[path = "support/reply.rs"]
mod reply;

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};

use racekv_redis::ServerOptions;
use reply::{Conn, Resp};

/// A redis-server child, stopped (by its own pid) when dropped.
struct RedisServer {
    child: Child,
    port: u16,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis_server() -> Option<RedisServer> {
    let bin = common::redis_tool("redis-server")?;
    let port = racekv_coord::testing::free_port();
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--dir", dir.path().to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server");
    let server = RedisServer { child, port };
    common::eventually("redis-server answers PING", || {
        Conn::connect(port).is_ok_and(|mut c| c.call(&["PING"]) == Resp::Simple("PONG".into()))
    });
    // The directory may go once the server runs: nothing is saved.
    drop(dir);
    Some(server)
}

/// How two replies must agree.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Compare {
    /// Byte for byte.
    Exact,
    /// The same types and lengths, any values (ids, times, versions).
    Shape,
}

use Compare::{Exact, Shape};

/// The shape of a reply: its types and lengths, with every scalar blanked.
fn shape(reply: &Resp) -> Resp {
    match reply {
        Resp::Simple(_) => Resp::Simple(String::new()),
        Resp::Error(_) => Resp::Error(String::new()),
        Resp::Int(_) => Resp::Int(0),
        Resp::Bulk(_) => Resp::Bulk(Vec::new()),
        Resp::Double(_) => Resp::Double(String::new()),
        Resp::Verbatim(format, _) => Resp::Verbatim(format.clone(), Vec::new()),
        Resp::Array(items) => Resp::Array(items.iter().map(shape).collect()),
        Resp::Set(items) => Resp::Set(items.iter().map(shape).collect()),
        Resp::Push(items) => Resp::Push(items.iter().map(shape).collect()),
        // Map keys are names: kept.
        Resp::Map(pairs) => Resp::Map(pairs.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
        other => other.clone(),
    }
}

/// Runs `script` on both connections and collects every disagreement.
fn compare(script: &[(Compare, &[&str])], racekv: &mut Conn, redis: &mut Conn, differences: &mut Vec<String>) {
    for (how, args) in script {
        let (ours, theirs) = (racekv.call(args), redis.call(args));
        let (a, b) = match how {
            Exact => (ours.clone(), theirs.clone()),
            Shape => (shape(&ours), shape(&theirs)),
        };
        if a != b {
            differences.push(format!("{args:?}\n  racekv: {ours:?}\n  redis:  {theirs:?}"));
        }
    }
}

const FLOAT_MAX: &str = "1.7976931348623157e308";

/// The script both servers run (in RESP2, then its tail again in RESP3). Keys are distinct
/// per case since racekv has no FLUSHALL here.
fn script() -> Vec<(Compare, Vec<String>)> {
    let mut s: Vec<(Compare, Vec<String>)> = Vec::new();
    let mut add = |how: Compare, line: &str| s.push((how, line.split(' ').map(str::to_string).collect()));
    // How long a command takes must not change any reply below.
    add(Exact, "CONFIG SET slowlog-log-slower-than -1");
    // LCS.
    for line in [
        "SET s1 ohmytext",
        "SET s2 mynewtext",
        "LCS s1 s2",
        "LCS s1 s2 LEN",
        "LCS s1 s2 IDX",
        "LCS s1 s2 IDX MINMATCHLEN 4",
        "LCS s1 s2 IDX WITHMATCHLEN",
        "LCS s1 s2 idx minmatchlen 2 withmatchlen",
        "LCS s1 s2 MINMATCHLEN -5 IDX",
        "LCS s1 nokey",
        "LCS nokey1 nokey2 IDX",
        "LCS s1 s2 IDX LEN",
        "LCS s1 s2 MINMATCHLEN x",
        "LCS s1 s2 MINMATCHLEN",
        "LCS s1 s2 FOO",
        "LCS s1",
        "SET l1 abcbdab",
        "SET l2 bdcaba",
        "LCS l1 l2",
        "LCS l2 l1",
        "LCS l1 l2 IDX WITHMATCHLEN",
        "SET l3 aaaaaaaaaabbbbbbbbbbaaaaaaaaaa",
        "SET l4 bbbbbaaaaabbbbbaaaaabbbbb",
        "LCS l3 l4",
        "LCS l3 l4 IDX MINMATCHLEN 3 WITHMATCHLEN",
    ] {
        add(Exact, line);
    }
    // APPEND, STRLEN, GETRANGE, SUBSTR.
    for line in [
        "APPEND a1 Hello",
        "APPEND a1 _World",
        "GET a1",
        "STRLEN a1",
        "STRLEN nokey",
        "APPEND a1",
        "GETRANGE a1 0 3",
        "GETRANGE a1 -3 -1",
        "GETRANGE a1 0 -1",
        "GETRANGE a1 10 100",
        "GETRANGE a1 5 3",
        "GETRANGE a1 -1 -5",
        "GETRANGE a1 -100 1",
        "GETRANGE a1 0 0",
        "GETRANGE a1 11 11",
        "GETRANGE nokey 0 -1",
        "GETRANGE a1 a 1",
        "GETRANGE a1 0 1.5",
        "GETRANGE a1 9223372036854775807 -9223372036854775808",
        "GETRANGE a1 -9223372036854775808 9223372036854775807",
        "GETRANGE a1 0 9223372036854775808",
        "SUBSTR a1 1 3",
        "SUBSTR a1 1",
        "SET n1 12345",
        "GETRANGE n1 1 -2",
        "STRLEN n1",
        "APPEND n1 6",
        "GET n1",
    ] {
        add(Exact, line);
    }
    // SETRANGE, GETDEL, GETSET, MSETNX.
    for line in [
        "SETRANGE r1 0 ",
        "EXISTS r1",
        "SETRANGE r1 3 ab",
        "GET r1",
        "SETRANGE r1 -1 x",
        "SETRANGE r1 x x",
        "SETRANGE r1 600000000 x",
        "SETRANGE r1 9223372036854775807 x",
        "SETRANGE r1 1 ",
        "SETRANGE r1 1 Z",
        "GET r1",
        "SETRANGE r2 0 hello",
        "SETRANGE r2 2 LL",
        "GET r2",
        "GETDEL g1",
        "SET g1 v",
        "GETDEL g1",
        "EXISTS g1",
        "GETDEL g1 g2",
        "GETSET g2 a",
        "GETSET g2 b",
        "GET g2",
        "MSETNX m1 a",
        "MSETNX m1 b",
        "GET m1",
        "MSETNX m2 a m2 b",
        "GET m2",
        "MSETNX m3 a m4",
        "MSETNX",
    ] {
        add(Exact, line);
    }
    // INCRBYFLOAT: redis-server's long double arithmetic and formatting.
    for line in [
        "SET f1 10.50",
        "INCRBYFLOAT f1 0.1",
        "INCRBYFLOAT f1 -5",
        "INCRBYFLOAT f2 0.1",
        "INCRBYFLOAT f2 0.2",
        "INCRBYFLOAT f3 1e20",
        "INCRBYFLOAT f4 -1e-20",
        "INCRBYFLOAT f5 0x1p-2",
        "INCRBYFLOAT f6 0.000003814697265625",
        "INCRBYFLOAT f7 5.0e3",
        "INCRBYFLOAT f7 2.0e2",
        "INCRBYFLOAT f8 1.5e300",
        "INCRBYFLOAT f9 3e4931",
        "INCRBYFLOAT f9 3e4931",
        "INCRBYFLOAT f9 1e4932",
        "INCRBYFLOAT f10 inf",
        "INCRBYFLOAT f10 -infinity",
        "INCRBYFLOAT f10 nan",
        "INCRBYFLOAT f10 abc",
        "INCRBYFLOAT f10 1e-5000",
        "INCRBYFLOAT f10 1e5000",
        "INCRBYFLOAT f10 1e",
        "INCRBYFLOAT f10 0x",
        "INCRBYFLOAT f10 1.2.3",
        "EXISTS f10",
        "INCRBYFLOAT f11 1e-4940",
        "SET f13 abc",
        "INCRBYFLOAT f13 1",
        "INCRBYFLOAT f14 -0",
        "INCRBYFLOAT f15 +.5",
        "INCRBYFLOAT f15 5.",
        "INCRBYFLOAT f17 0x1.8p3",
        "INCRBYFLOAT f18 18446744073709551617",
        "INCRBYFLOAT f18 18446744073709551619",
        "INCRBYFLOAT f19 0.999999999999999999",
        "INCRBYFLOAT f20 -1234567.891e-3",
        "INCRBYFLOAT f20 3.14159265358979323846264338327950288",
        "INCRBYFLOAT f20 1e-17",
        "INCRBYFLOAT f21 123456789012345678901234567890",
        "INCRBYFLOAT f21 0.5",
        "SET f22 9223372036854775807",
        "INCRBYFLOAT f22 1",
        "INCRBYFLOAT f22",
    ] {
        add(Exact, line);
    }
    add(Exact, &format!("INCRBYFLOAT f12 {FLOAT_MAX}"));
    add(Exact, &format!("INCRBYFLOAT f12 {FLOAT_MAX}"));
    for _ in 0..10 {
        add(Exact, "INCRBYFLOAT f23 1.1");
    }
    for _ in 0..10 {
        add(Exact, "INCRBYFLOAT f24 -0.3");
    }
    // Introspection.
    for line in [
        "COMMAND GETKEYS GET k",
        "COMMAND GETKEYS MSET a 1 b 2",
        "COMMAND GETKEYS LCS x y IDX",
        "COMMAND GETKEYS PING x",
        "COMMAND GETKEYS NOSUCH x",
        "COMMAND GETKEYS GET a b",
        "COMMAND GETKEYS GET",
        "COMMAND GETKEYS MEMORY USAGE k",
        "COMMAND FOO",
        "CONFIG GET maxmemory",
        "CONFIG GET maxmemory-policy",
        "CONFIG GET appendonly",
        "CONFIG GET save",
        "CONFIG GET timeout",
        "CONFIG GET slowlog-max-len",
        "CONFIG GET slowlog-log-slower-than",
        "CONFIG GET latency-monitor-threshold",
        "CONFIG GET protected-mode",
        "CONFIG GET requirepass",
        "CONFIG GET nosuchparameter",
        "CONFIG SET foo bar",
        "CONFIG SET databases 3",
        "CONFIG SET maxclients x",
        "CONFIG SET protected-mode maybe",
        "CONFIG SET timeout 1 timeout 2",
        "CONFIG SET timeout",
        "CONFIG SET slowlog-max-len 64",
        "CONFIG GET slowlog-max-len",
        "CONFIG SET slowlog-max-len 128",
        "CONFIG FOO",
        "CONFIG RESETSTAT",
        "CLIENT FOO",
        "CLIENT KILL ID 0",
        "CLIENT KILL ID x",
        "CLIENT KILL TYPE foo",
        "CLIENT KILL USER nosuch",
        "CLIENT KILL 1.2.3.4:5",
        "CLIENT KILL ID 999999",
        "CLIENT KILL ID 1 SKIPME",
        "CLIENT KILL SKIPME maybe",
        "CLIENT KILL TYPE master",
        "CLIENT PAUSE -1",
        "CLIENT PAUSE 10 foo",
        "CLIENT PAUSE x",
        "CLIENT PAUSE 1 WRITE",
        "CLIENT UNPAUSE",
        "CLIENT NO-EVICT maybe",
        "CLIENT NO-EVICT on",
        "CLIENT NO-EVICT off",
        "CLIENT LIST TYPE foo",
        "CLIENT LIST ID x",
        "CLIENT LIST ID -5 999999",
        "CLIENT LIST TYPE pubsub",
        "CLIENT LIST TYPE replica",
        "CLIENT SETNAME differ",
        "CLIENT GETNAME",
        "SLOWLOG GET -2",
        "SLOWLOG GET x",
        "SLOWLOG FOO",
        "SLOWLOG RESET",
        "SLOWLOG LEN",
        "SLOWLOG GET",
        "LATENCY LATEST",
        "LATENCY RESET",
        "LATENCY HISTORY command",
        "MEMORY USAGE nokey",
        "MEMORY USAGE nokey SAMPLES",
        "MEMORY USAGE nokey SAMPLES x",
        "MEMORY FOO",
        "OBJECT ENCODING nokey",
        "SET oi 12345",
        "OBJECT ENCODING oi",
        "SET oe hello",
        "OBJECT ENCODING oe",
        "SET or xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
        "OBJECT ENCODING or",
        "OBJECT FREQ oe",
        "OBJECT FOO oe",
        "OBJECT REFCOUNT nokey",
        "INFO nosuchsection",
        "FOO bar",
    ] {
        add(Exact, line);
    }
    for line in ["TIME", "CLIENT ID", "CLIENT INFO", "CLIENT LIST", "INFO", "INFO server", "LOLWUT", "MEMORY USAGE oe"]
    {
        add(Shape, line);
    }
    s
}

/// The part of the script that RESP3 changes (maps, verbatim text).
fn resp3_script() -> Vec<(Compare, Vec<String>)> {
    let mut s: Vec<(Compare, Vec<String>)> = Vec::new();
    let mut add = |how: Compare, line: &str| s.push((how, line.split(' ').map(str::to_string).collect()));
    for line in
        ["SET r3a ohmytext", "SET r3b mynewtext", "LCS r3a r3b IDX WITHMATCHLEN", "CONFIG GET timeout", "GET nokey"]
    {
        add(Exact, line);
    }
    for line in ["HELLO 3", "CLIENT INFO", "CLIENT LIST", "INFO", "LOLWUT", "TIME"] {
        add(Shape, line);
    }
    s
}

fn run_script(script: &[(Compare, Vec<String>)], racekv: &mut Conn, redis: &mut Conn, differences: &mut Vec<String>) {
    let lines: Vec<(Compare, Vec<&str>)> =
        script.iter().map(|(how, args)| (*how, args.iter().map(String::as_str).collect())).collect();
    let borrowed: Vec<(Compare, &[&str])> = lines.iter().map(|(how, args)| (*how, args.as_slice())).collect();
    compare(&borrowed, racekv, redis, differences);
}

#[test]
fn racekv_answers_as_redis_server_does() {
    let Some(redis) = start_redis_server() else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let mut ours = Conn::connect(server.local_addr().port()).unwrap();
    let mut theirs = Conn::connect(redis.port).unwrap();
    let mut differences = Vec::new();
    run_script(&script(), &mut ours, &mut theirs, &mut differences);
    slow_log_entries(&mut ours, &mut theirs, &mut differences);
    run_script(&resp3_script(), &mut ours, &mut theirs, &mut differences);
    assert!(differences.is_empty(), "{} difference(s):\n{}", differences.len(), differences.join("\n"));
}

/// A slow log entry: the same shape and arguments (its id, time, duration and address
/// differ).
fn slow_log_entries(racekv: &mut Conn, redis: &mut Conn, differences: &mut Vec<String>) {
    let mut entries = Vec::new();
    for conn in [racekv, redis] {
        conn.call(&["CONFIG", "SET", "slowlog-log-slower-than", "0"]);
        conn.call(&["SLOWLOG", "RESET"]);
        conn.call(&["SET", "slow", "value"]);
        let entry = conn.call(&["SLOWLOG", "GET", "1"]);
        // Back to logging nothing, so no later reply depends on how long a command took.
        conn.call(&["CONFIG", "SET", "slowlog-log-slower-than", "-1"]);
        conn.call(&["SLOWLOG", "RESET"]);
        entries.push(entry);
    }
    let args = |entry: &Resp| match entry {
        Resp::Array(entries) => match &entries[..] {
            [Resp::Array(fields)] => fields.get(3).cloned(),
            _ => None,
        },
        _ => None,
    };
    if shape(&entries[0]) != shape(&entries[1]) || args(&entries[0]) != args(&entries[1]) {
        differences.push(format!("SLOWLOG GET 1\n  racekv: {:?}\n  redis:  {:?}", entries[0], entries[1]));
    }
}

/// Field names of `INFO everything`, `section.field`.
fn info_fields(conn: &mut Conn) -> BTreeSet<String> {
    let text = conn.call(&["INFO", "everything"]).text();
    let mut section = String::new();
    let mut fields = BTreeSet::new();
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        if let Some(name) = line.strip_prefix("# ") {
            section = name.to_ascii_lowercase();
        } else if let Some((field, _)) = line.split_once(':') {
            // Per-command and per-error fields are compared by their prefix only.
            let field = ["cmdstat_", "errorstat_", "db"].iter().find(|p| field.starts_with(*p)).map_or(field, |p| p);
            fields.insert(format!("{section}.{field}"));
        }
    }
    fields
}

/// Every INFO field racekv writes is one redis-server writes, in the same section (tools
/// look fields up by name), except racekv's own and Redis 7.2's newer ones.
#[test]
fn info_and_client_list_use_redis_field_names() {
    let Some(redis) = start_redis_server() else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let mut ours = Conn::connect(server.local_addr().port()).unwrap();
    let mut theirs = Conn::connect(redis.port).unwrap();
    for conn in [&mut ours, &mut theirs] {
        conn.call(&["SET", "k", "v"]);
        conn.call(&["GET", "k"]);
        conn.call(&["NOSUCH"]);
    }
    let (racekv_fields, redis_fields) = (info_fields(&mut ours), info_fields(&mut theirs));
    // racekv's own, and fields redis-server 7.0 does not have yet.
    let own: BTreeSet<&str> = [
        "server.racekv_version",
        "memory.racekv_query_buffer_bytes",
        "memory.racekv_query_buffer_budget",
        "stats.total_protocol_errors",
        "clients.total_blocking_keys",
        "clients.paused_actions",
        // Redis 7.4's.
        "clients.watching_clients",
        "clients.total_watched_keys",
    ]
    .into_iter()
    .collect();
    let extra: Vec<&String> = racekv_fields
        .iter()
        .filter(|f| !redis_fields.contains(*f) && !own.contains(f.as_str()) && !f.starts_with("storage."))
        .collect();
    assert!(extra.is_empty(), "INFO fields redis-server does not have: {extra:?}");
    for wanted in ["memory.used_memory", "stats.instantaneous_ops_per_sec", "keyspace.db", "commandstats.cmdstat_"] {
        assert!(racekv_fields.contains(wanted), "racekv's INFO lacks {wanted}");
    }
    let names = |conn: &mut Conn| -> Vec<String> {
        let line = conn.call(&["CLIENT", "INFO"]).text();
        line.trim_end().split(' ').map(|f| f.split_once('=').expect("key=value").0.to_string()).collect()
    };
    let (racekv_names, redis_names) = (names(&mut ours), names(&mut theirs));
    // Redis 7.2 adds lib-name and lib-ver at the end; the rest is 7.0's list, in order.
    assert_eq!(racekv_names[..racekv_names.len() - 2], redis_names[..], "CLIENT INFO fields");
    assert_eq!(racekv_names[racekv_names.len() - 2..], ["lib-name", "lib-ver"]);
}
