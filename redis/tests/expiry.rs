//! Expiry commands against the front end (over the MemStore test double) and, with the same
//! script, against a real redis-server: every reply must match, byte for byte, except the
//! time left that TTL and PTTL report (the two servers run each command a moment apart).
//!
//! redis-server must be installed (Debian package redis-server); RACEKV_SKIP_REDIS_TOOLS=1
//! skips the comparison where it is not. The reference server runs on 127.0.0.1 with
//! persistence off and is stopped by its pid when the test ends.

mod common;

use common::expiry_script::{compare, Conn, Wire};
use common::RealRedis;
use racekv_redis::ServerOptions;

#[test]
fn expiry_commands_answer_as_redis_does() {
    let Some(real) = RealRedis::start() else { return };
    let (server, _store) = common::start(ServerOptions::default());
    let (mismatches, ours) = compare(server.local_addr().port(), real.port);
    assert!(
        mismatches.is_empty(),
        "{} replies differ from redis-server's:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    // The script itself exercised what it should: errors and successes of each kind.
    let count = |pred: &dyn Fn(&Wire) -> bool| ours.iter().filter(|(_, w)| pred(w)).count();
    assert!(count(&|w| matches!(w, Wire::Error(e) if e.contains("invalid expire time"))) >= 10);
    assert!(count(&|w| matches!(w, Wire::Error(e) if e == "ERR syntax error")) >= 10);
    assert!(count(&|w| *w == Wire::Int(-2)) >= 3 && count(&|w| *w == Wire::Int(-1)) >= 3);
}

/// Key permissions follow Redis' key specs: SET writes (and reads too with GET), TTL
/// reads, EXPIRE and PERSIST write (their spec is RW UPDATE, not ACCESS: they do not read
/// the value), GETEX reads and writes.
#[test]
fn expiry_commands_need_the_key_permissions_redis_asks_for() {
    let Some(real) = RealRedis::start() else { return };
    let (server, _store) = common::start(ServerOptions::default());
    for port in [server.local_addr().port(), real.port] {
        let mut admin = Conn::open(port);
        assert_eq!(
            admin.call(&["ACL", "SETUSER", "writer", "on", "nopass", "+@all", "%W~*"]),
            Wire::Simple("OK".into())
        );
        assert_eq!(admin.call(&["SET", "k", "v", "EX", "100"]), Wire::Simple("OK".into()));
        let mut writer = Conn::open(port);
        assert_eq!(writer.call(&["AUTH", "writer", "any"]), Wire::Simple("OK".into()));
        let allowed = [&["SET", "k", "v"][..], &["SETEX", "k", "10", "v"], &["PSETEX", "k", "10000", "v"]];
        for args in allowed {
            assert_eq!(writer.call(args), Wire::Simple("OK".into()), "port {port}: {args:?}");
        }
        for args in [&["EXPIRE", "k", "100"][..], &["PEXPIRE", "k", "100000"], &["PERSIST", "k"]] {
            assert_eq!(writer.call(args), Wire::Int(1), "port {port}: {args:?}");
        }
        for args in [&["EXPIREAT", "k", "10"][..], &["PEXPIREAT", "k", "10"]] {
            assert_eq!(writer.call(args), Wire::Int(1), "port {port}: {args:?} (deletes)");
            assert_eq!(writer.call(&["SET", "k", "v"]), Wire::Simple("OK".into()));
        }
        for args in [
            &["SET", "k", "v", "GET"][..],
            &["TTL", "k"],
            &["PTTL", "k"],
            &["EXPIRETIME", "k"],
            &["PEXPIRETIME", "k"],
            &["GETEX", "k"],
            &["GET", "k"],
        ] {
            // Redis 7.0 and 7.2 word the denial differently; the code is the same.
            let reply = writer.call(args);
            assert!(matches!(&reply, Wire::Error(e) if e.starts_with("NOPERM")), "port {port}: {args:?}: {reply:?}");
        }
    }
}
