//! Introspection over real connections (each io model: `RACEKV_TEST_REDIS_IO=event_loop`
//! reruns them on event loops): CLIENT KILL closes its target, CLIENT PAUSE holds writes
//! until UNPAUSE, CONFIG SET applies to the server, and redis-cli reads INFO (`--stat`, and
//! every section's `field:value` lines).

mod common;
#[path = "support/reply.rs"]
mod reply;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use racekv_redis::ServerOptions;
use reply::{Conn, Resp};

fn connect(server: &racekv_redis::RedisServer) -> Conn {
    Conn::connect(server.local_addr().port()).expect("connect")
}

fn id_of(conn: &mut Conn) -> i64 {
    match conn.call(&["CLIENT", "ID"]) {
        Resp::Int(id) => id,
        other => panic!("CLIENT ID: {other:?}"),
    }
}

/// `field:value` of an INFO text.
fn info_field(text: &str, field: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).map(|v| v.trim_end().to_string())
}

#[test]
fn client_kill_closes_the_target_connection() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut target = connect(&server);
    let mut other = connect(&server);
    let mut admin = connect(&server);
    let target_id = id_of(&mut target);
    assert_eq!(other.call(&["PING"]), Resp::Simple("PONG".into()));
    let list = admin.call(&["CLIENT", "LIST"]).text();
    assert_eq!(list.lines().count(), 3, "{list}");
    assert!(list.contains(&format!("id={target_id} ")), "{list}");
    assert_eq!(admin.call(&["CLIENT", "KILL", "ID", &target_id.to_string()]), Resp::Int(1));
    assert!(target.closed(), "the killed connection must be closed by the server");
    // Only the target: the others still work, and the list no longer has it.
    assert_eq!(other.call(&["PING"]), Resp::Simple("PONG".into()));
    common::eventually("the killed connection leaves CLIENT LIST", || {
        admin.call(&["CLIENT", "LIST"]).text().lines().count() == 2
    });
    common::eventually("the killed connection is released", || server.stats().connected_clients() == 2);
    // Killing itself: the reply first, then the close.
    let admin_id = id_of(&mut admin).to_string();
    assert_eq!(admin.call(&["CLIENT", "KILL", "ID", &admin_id, "SKIPME", "no"]), Resp::Int(1));
    assert!(admin.closed());
    assert_eq!(other.call(&["PING"]), Resp::Simple("PONG".into()));
}

#[test]
fn client_pause_holds_writes_until_unpause() {
    let (server, store) = common::start(ServerOptions::default());
    let mut admin = connect(&server);
    let mut writer = connect(&server);
    let writer_id = id_of(&mut writer).to_string();
    assert_eq!(admin.call(&["CLIENT", "PAUSE", "600000", "WRITE"]), Resp::Simple("OK".into()));
    // Reads still run; the write is held.
    assert_eq!(writer.call(&["GET", "k"]), Resp::Null);
    writer.send(&[b"SET", b"k", b"v"]).unwrap();
    common::eventually("the SET is held", || {
        info_field(&admin.call(&["INFO", "clients"]).text(), "blocked_clients").as_deref() == Some("1")
    });
    assert_eq!(store.peek(b"k"), None, "a held write has not run");
    // The pausing connection itself is not held.
    assert_eq!(admin.call(&["SET", "mine", "1"]), Resp::Simple("OK".into()));
    assert_eq!(admin.call(&["CLIENT", "UNPAUSE"]), Resp::Simple("OK".into()));
    assert_eq!(writer.reply().unwrap(), Resp::Simple("OK".into()));
    assert_eq!(store.peek(b"k"), Some(b"v".to_vec()));
    assert_eq!(info_field(&admin.call(&["INFO", "clients"]).text(), "blocked_clients").as_deref(), Some("0"));
    // A held connection can still be killed.
    assert_eq!(admin.call(&["CLIENT", "PAUSE", "600000"]), Resp::Simple("OK".into()));
    writer.send(&[b"GET", b"k"]).unwrap();
    common::eventually("the GET is held", || {
        info_field(&admin.call(&["INFO", "clients"]).text(), "blocked_clients").as_deref() == Some("1")
    });
    assert_eq!(admin.call(&["CLIENT", "KILL", "ID", &writer_id]), Resp::Int(1));
    assert!(writer.closed());
    common::eventually("the killed client no longer counts as held", || {
        info_field(&admin.call(&["INFO", "clients"]).text(), "blocked_clients").as_deref() == Some("0")
    });
    assert_eq!(admin.call(&["CLIENT", "UNPAUSE"]), Resp::Simple("OK".into()));
}

#[test]
fn config_set_applies_to_the_running_server() {
    let (server, _store) = common::start(ServerOptions::default());
    let mut admin = connect(&server);
    assert_eq!(admin.call(&["CONFIG", "SET", "maxclients", "1"]), Resp::Simple("OK".into()));
    let mut refused = common::raw(&server);
    let (bytes, closed) = common::exchange(&mut refused, b"PING\r\n", true, std::time::Duration::from_secs(5));
    assert_eq!(String::from_utf8_lossy(&bytes), "-ERR max number of clients reached\r\n");
    assert!(closed);
    assert_eq!(admin.call(&["CONFIG", "SET", "maxclients", "100", "timeout", "1"]), Resp::Simple("OK".into()));
    // A connection that says nothing is closed after the new idle timeout (well within the
    // read timeout of `closed`).
    let mut idle = connect(&server);
    assert!(idle.closed(), "an idle connection outlived CONFIG SET timeout 1");
    // (`admin` was idle as long: a new connection turns the timeout off.)
    let mut admin = connect(&server);
    assert_eq!(admin.call(&["CONFIG", "SET", "timeout", "0"]), Resp::Simple("OK".into()));
    assert_eq!(admin.call(&["PING"]), Resp::Simple("PONG".into()));
}

/// What redis-cli prints for `INFO everything`, as section -> field -> value.
fn parse_info(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut sections = BTreeMap::new();
    let mut current = String::new();
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        if let Some(name) = line.strip_prefix("# ") {
            current = name.to_ascii_lowercase();
            sections.entry(current.clone()).or_insert_with(BTreeMap::new);
        } else if !line.is_empty() {
            let (key, value) = line.split_once(':').unwrap_or_else(|| panic!("not key:value: {line:?}"));
            assert!(!current.is_empty(), "a field before any section: {line}");
            sections.get_mut(&current).unwrap().insert(key.to_string(), value.to_string());
        }
    }
    sections
}

#[test]
fn redis_cli_reads_every_info_section() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let port = server.local_addr().port();
    common::cli(&bin, port, &["MSET", "a", "1", "b", "2", "c", "3"], b"");
    common::cli(&bin, port, &["GET", "a"], b"");
    common::cli(&bin, port, &["GET", "missing"], b"");
    let info = parse_info(&common::cli(&bin, port, &["INFO", "everything"], b""));
    let sections: Vec<&str> = info.keys().map(String::as_str).collect();
    for wanted in [
        "server",
        "clients",
        "memory",
        "persistence",
        "stats",
        "replication",
        "cpu",
        "modules",
        "commandstats",
        "errorstats",
        "cluster",
        "keyspace",
        "storage",
    ] {
        assert!(sections.contains(&wanted), "no {wanted} in {sections:?}");
    }
    let field = |section: &str, name: &str| info[section].get(name).unwrap_or_else(|| panic!("no {section}.{name}"));
    assert_eq!(field("server", "redis_version"), "7.2.0");
    assert_eq!(field("server", "tcp_port"), &port.to_string());
    for (section, name) in [
        ("memory", "used_memory"),
        ("memory", "maxmemory"),
        ("clients", "connected_clients"),
        ("clients", "blocked_clients"),
        ("stats", "total_commands_processed"),
        ("stats", "instantaneous_ops_per_sec"),
        ("stats", "total_connections_received"),
        ("persistence", "rdb_last_save_time"),
    ] {
        field(section, name).parse::<u64>().unwrap_or_else(|e| panic!("{section}.{name}: {e}"));
    }
    field("cpu", "used_cpu_user").parse::<f64>().unwrap();
    assert_eq!(field("keyspace", "db0"), "keys=3,expires=0,avg_ttl=0");
    assert_eq!(field("stats", "keyspace_hits"), "1");
    assert_eq!(field("stats", "keyspace_misses"), "1");
    assert!(field("commandstats", "cmdstat_get").starts_with("calls=2,usec="), "{:?}", info["commandstats"]);
    assert_eq!(field("replication", "role"), "master");
}

/// Stops a child process (by its own pid) when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `redis-cli --stat` polls INFO each interval and prints a row of keys, memory, clients,
/// requests and connections: its rows must show racekv's numbers (no parse failures).
#[test]
fn redis_cli_stat_shows_the_server() {
    let Some(bin) = common::redis_tool("redis-cli") else {
        return;
    };
    let (server, _store) = common::start(ServerOptions::default());
    let port = server.local_addr().port();
    common::cli(&bin, port, &["MSET", "a", "1", "b", "2", "c", "3", "d", "4"], b"");
    let child = Command::new(&bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "--stat", "-i", "0.1"])
        .env_remove("REDISCLI_AUTH")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn redis-cli --stat");
    let mut child = Reaped(child);
    let stdout = BufReader::new(child.0.stdout.take().unwrap());
    let mut rows = Vec::new();
    for line in stdout.lines() {
        let line = line.expect("redis-cli output");
        let columns: Vec<&str> = line.split_whitespace().collect();
        // Data rows start with the key count; headers with dashes or words.
        if columns.first().is_some_and(|c| c.parse::<u64>().is_ok()) {
            rows.push(columns.iter().map(|c| c.to_string()).collect::<Vec<_>>());
            if rows.len() == 3 {
                break;
            }
        }
    }
    drop(child);
    assert_eq!(rows.len(), 3, "redis-cli --stat printed no rows");
    for row in &rows {
        // keys mem clients blocked requests (+delta) connections
        assert_eq!(row[0], "4", "{row:?}");
        assert!(row[1].ends_with('M') || row[1].ends_with('K') || row[1].ends_with('G'), "memory column {row:?}");
        assert!(row[2].parse::<u64>().unwrap() >= 1, "{row:?}");
        assert_eq!(row[3], "0", "{row:?}");
        row[4].parse::<u64>().unwrap_or_else(|e| panic!("requests column {row:?}: {e}"));
    }
}
