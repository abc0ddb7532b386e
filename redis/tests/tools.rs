//! The Redis front end (over the MemStore test double) driven by the real redis-cli and
//! redis-benchmark (Debian package redis-tools).

mod common;

use std::process::{Command, Stdio};

use common::cli;

use racekv_redis::{resp, Command as RespCommand, ServerOptions};

#[test]
fn redis_cli_runs_string_commands() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, store) = common::start(ServerOptions::default());
    let port = server.local_addr().port();
    let run = |args: &[&str]| cli(&bin, port, args, b"");
    assert_eq!(run(&["SET", "greeting", "hello world"]), "OK\n");
    assert_eq!(run(&["GET", "greeting"]), "hello world\n");
    assert_eq!(store.peek(b"greeting"), Some(b"hello world".to_vec()));
    assert_eq!(run(&["get", "missing"]), "\n");
    assert_eq!(run(&["INCR", "hits"]), "1\n");
    assert_eq!(run(&["INCRBY", "hits", "10"]), "11\n");
    assert_eq!(run(&["MSET", "a", "1", "b", "2"]), "OK\n");
    assert_eq!(run(&["MGET", "a", "missing", "b"]), "1\n\n2\n");
    assert_eq!(run(&["DEL", "a", "b", "missing"]), "2\n");
    assert_eq!(run(&["DBSIZE"]), "2\n");
    assert!(run(&["INCR", "greeting"]).starts_with("ERR value is not an integer or out of range"));
    assert_eq!(run(&["FLUSHALL"]), "OK\n");
    assert_eq!(run(&["DBSIZE"]), "0\n");
    assert!(run(&["RENAME", "a", "b"]).starts_with("ERR no such key"));
    assert!(run(&["INFO"]).contains("redis_version:7.2.0\r\nracekv_version:"));
}

#[test]
fn redis_cli_scan_walks_every_key() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let port = server.local_addr().port();
    let mut script = Vec::new();
    for i in 0..500 {
        resp::encode_command(&RespCommand::from_args(["SET", &format!("k:{i}"), "v"]), &mut script);
    }
    assert!(cli(&bin, port, &["--pipe"], &script).contains("errors: 0, replies: 500"));
    let sorted = |text: String| {
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines.sort();
        lines
    };
    let mut all: Vec<String> = (0..500).map(|i| format!("k:{i}")).collect();
    all.sort();
    assert_eq!(sorted(cli(&bin, port, &["--scan"], b"")), all);
    let units: Vec<String> = all.iter().filter(|k| k.len() == 3).cloned().collect();
    assert_eq!(sorted(cli(&bin, port, &["--scan", "--pattern", "k:?"], b"")), units);
}

#[test]
fn redis_cli_reads_commands_from_stdin() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let script = b"SET k 5\nINCRBY k 37\nGET k\nSET \"quoted key\" \"a b\"\nGET \"quoted key\"\nPING\n";
    let out = cli(&bin, server.local_addr().port(), &[], script);
    assert_eq!(out, "OK\n42\n42\nOK\na b\nPONG\n");
}

#[test]
fn redis_cli_pipe_mode_sends_a_pipelined_batch() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, store) = common::start(ServerOptions::default());
    let mut input = Vec::new();
    for i in 0..2000 {
        resp::encode_command(&RespCommand::from_args(["SET", &format!("k{i}"), &format!("v{i}")]), &mut input);
    }
    // redis-cli --pipe also passes hand-written inline commands through.
    input.extend_from_slice(b"INCRBY counter 5\r\nINCRBY counter 5\r\n");
    let out = cli(&bin, server.local_addr().port(), &["--pipe"], &input);
    assert!(out.contains("errors: 0, replies: 2002"), "{out}");
    assert_eq!(store.peek(b"k1999"), Some(b"v1999".to_vec()));
    assert_eq!(store.peek(b"counter"), Some(b"10".to_vec()));
}

#[test]
fn redis_benchmark_completes_without_errors() {
    let Some(bin) = common::redis_tool("redis-benchmark") else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let out = Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &server.local_addr().port().to_string()])
        .args(["-t", "get,set", "-n", "20000", "-q"])
        .stdin(Stdio::null())
        .output()
        .expect("run redis-benchmark");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let finals: Vec<&str> = text.split(['\r', '\n']).filter(|l| l.contains("requests per second")).collect();
    assert!(finals.iter().any(|l| l.starts_with("SET:")) && finals.iter().any(|l| l.starts_with("GET:")), "{text}");
    assert!(!text.to_ascii_lowercase().contains("error") && !text.contains("WARN"), "{text}");
    // Every request reached the command layer (plus redis-benchmark's own CONFIG GETs).
    assert!(server.stats().total_commands_processed() >= 40_000, "{}", server.stats().total_commands_processed());
    assert_eq!(server.stats().protocol_errors(), 0);
}
