//! Commands on the keyspace as a whole: SCAN, KEYS, RANDOMKEY, TYPE, TOUCH, UNLINK,
//! FLUSHDB/FLUSHALL (RENAME, RENAMENX and COPY are in `multikey.rs`).
//!
//! SCAN is the store's walk ([`KvSession::scan`](crate::store::KvSession::scan)): a key
//! present for the whole walk is returned at least once, however the table splits. MATCH
//! and TYPE filter each page after it is read, as Redis does, so a page may come back empty
//! before the walk ends. racekv holds strings only: `TYPE string` keeps every key, any other
//! type none.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{fail, Client, CmdResult};
use crate::glob::Pattern;
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::store::SCAN_PAGE_MAX_KEYS;

/// SCAN's COUNT when none is given (Redis' default).
const DEFAULT_SCAN_COUNT: usize = 10;
/// Keys KEYS asks the store for per page.
const KEYS_PAGE_COUNT: usize = 1_000;
/// The most bytes of matching keys KEYS answers with (each key counting its length plus 16
/// for its RESP framing and bookkeeping). Redis has no limit; racekv would rather refuse
/// than run out of memory building the reply: SCAN with MATCH walks any keyspace.
pub(crate) const KEYS_MAX_REPLY_BYTES: usize = 64 << 20;
/// What each key KEYS returns counts against [`KEYS_MAX_REPLY_BYTES`] besides its bytes.
const KEYS_PER_KEY_BYTES: usize = 16;
/// How long KEYS waits for a walk that stopped moving (a split that never finishes: its
/// memnode died mid-way and is not back) before it gives up.
const KEYS_STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// SCAN's cursor, as Redis 7.0 reads it (C's `strtoul`): decimal digits with an optional
/// sign (`-n` wraps around, as it does in C), no leading white space, nothing after the
/// digits, no overflow; the empty string is 0.
fn parse_cursor(arg: &[u8]) -> Option<u64> {
    if arg.is_empty() {
        return Some(0);
    }
    let (negative, digits) = match arg[0] {
        b'+' => (false, &arg[1..]),
        b'-' => (true, &arg[1..]),
        _ => (false, arg),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value = digits.iter().try_fold(0u64, |v, &d| v.checked_mul(10)?.checked_add(u64::from(d - b'0')))?;
    Some(if negative { value.wrapping_neg() } else { value })
}

/// `SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]`, with Redis' errors.
pub(super) fn scan(c: &mut Client, cmd: &Command) -> CmdResult {
    let cursor = parse_cursor(cmd.arg(1)).ok_or_else(|| fail("ERR invalid cursor"))?;
    let mut count = DEFAULT_SCAN_COUNT;
    let mut pattern: Option<Pattern> = None;
    let mut only_strings = true;
    let mut i = 2;
    while i < cmd.len() {
        let option = cmd.arg(i).to_ascii_lowercase();
        if i + 1 >= cmd.len() {
            return Err(fail("ERR syntax error"));
        }
        let value = cmd.arg(i + 1);
        match option.as_slice() {
            b"count" => {
                let n = parse_i64(value).ok_or_else(|| fail("ERR value is not an integer or out of range"))?;
                if n < 1 {
                    return Err(fail("ERR syntax error"));
                }
                count = usize::try_from(n).unwrap_or(usize::MAX).min(SCAN_PAGE_MAX_KEYS);
            }
            b"match" => pattern = Some(Pattern::new(value, false)).filter(|p| !p.matches_all()),
            // Redis 7.0 answers an unknown type name with no keys, as any type but string.
            b"type" => only_strings = value.eq_ignore_ascii_case(b"string"),
            _ => return Err(fail("ERR syntax error")),
        }
        i += 2;
    }
    let (next, keys) = c.store()?.scan(cursor, count)?;
    let keys = keys
        .into_iter()
        .filter(|k| only_strings && pattern.as_ref().is_none_or(|p| p.matches(k)))
        .map(Reply::Bulk)
        .collect();
    Ok(Reply::Array(vec![Reply::Bulk(next.to_string().into_bytes()), Reply::Array(keys)]))
}

/// `KEYS pattern`: a whole walk, each key once, refused past [`KEYS_MAX_REPLY_BYTES`].
pub(super) fn keys(c: &mut Client, cmd: &Command) -> CmdResult {
    keys_within(c, cmd.arg(1), KEYS_MAX_REPLY_BYTES)
}

fn keys_within(c: &mut Client, pattern: &[u8], max_bytes: usize) -> CmdResult {
    let pattern = Pattern::new(pattern, false);
    let mut found: HashSet<Vec<u8>> = HashSet::new();
    let mut bytes = 0usize;
    let mut cursor = 0u64;
    let mut stuck_since: Option<Instant> = None;
    loop {
        let (next, page) = c.store()?.scan(cursor, KEYS_PAGE_COUNT)?;
        for key in page {
            if pattern.matches(&key) && !found.contains(&key) {
                bytes += key.len() + KEYS_PER_KEY_BYTES;
                if bytes > max_bytes {
                    return Err(fail(format!(
                        "ERR KEYS would return more than {max_bytes} bytes of keys; use SCAN with MATCH"
                    )));
                }
                found.insert(key);
            }
        }
        if next == 0 {
            break;
        }
        if next == cursor {
            let since = *stuck_since.get_or_insert_with(Instant::now);
            if since.elapsed() > KEYS_STALL_TIMEOUT {
                return Err(fail("TRYAGAIN KEYS met a table split that did not finish; retry"));
            }
        } else {
            stuck_since = None;
        }
        cursor = next;
    }
    Ok(Reply::Array(found.into_iter().map(Reply::Bulk).collect()))
}

pub(super) fn randomkey(c: &mut Client, _cmd: &Command) -> CmdResult {
    Ok(c.store()?.random_key()?.map_or(Reply::Nil, Reply::Bulk))
}

/// `TYPE key`: every racekv key is a string.
pub(super) fn type_of(c: &mut Client, cmd: &Command) -> CmdResult {
    let present = c.store()?.get_in_order(&[cmd.arg(1)])?.first().is_some_and(Option::is_some);
    Ok(Reply::Status(if present { "string" } else { "none" }.into()))
}

/// `TOUCH key...`: how many of the keys exist; a key named twice counts twice, as in
/// Redis. The keys are read, and reads record themselves under an LRU or LFU policy.
pub(super) fn touch(c: &mut Client, cmd: &Command) -> CmdResult {
    super::keys::exists(c, cmd)
}

/// `UNLINK key...`: DEL (a delete is one CAS here; there is nothing to free later).
pub(super) fn unlink(c: &mut Client, cmd: &Command) -> CmdResult {
    super::keys::del(c, cmd)
}

/// `FLUSHALL [ASYNC|SYNC]`, `FLUSHDB [ASYNC|SYNC]` (racekv has one database): deletes
/// every key on every memnode before answering, either way.
pub(super) fn flush(c: &mut Client, cmd: &Command) -> CmdResult {
    match cmd.get(1) {
        None => {}
        Some(mode) if cmd.len() == 2 && (mode.eq_ignore_ascii_case(b"sync") || mode.eq_ignore_ascii_case(b"async")) => {
        }
        Some(_) => return Err(fail("ERR syntax error")),
    }
    c.store()?.flush()?;
    Ok(Reply::ok())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Arc;

    use super::{keys_within, parse_cursor};
    use crate::acl::Acl;
    use crate::commands::{catalog, Client};
    use crate::info::ServerStats;
    use crate::memstore::MemStore;
    use crate::reply::Reply;
    use crate::resp::Command;

    fn client_over(store: &MemStore) -> Client {
        client_with(store, &Arc::new(Acl::open(catalog())))
    }

    fn client_with(store: &MemStore, acl: &Arc<Acl>) -> Client {
        Client::new(7, Arc::new(store.clone()), Arc::new(ServerStats::new(6379, 100, None)), Arc::clone(acl))
    }

    fn run(c: &mut Client, args: &[&str]) -> Reply {
        c.execute(&Command::from_args(args))
    }

    fn err(s: &str) -> Reply {
        Reply::Error(s.to_string().into())
    }

    /// The keys of a whole SCAN walk with `options` after the cursor.
    fn walk(c: &mut Client, options: &[&str]) -> Vec<String> {
        let mut cursor = "0".to_string();
        let mut keys = Vec::new();
        for _ in 0..10_000 {
            let mut args = vec!["SCAN", cursor.as_str()];
            args.extend_from_slice(options);
            let Reply::Array(reply) = run(c, &args) else { panic!("SCAN {options:?} answered no array") };
            let [Reply::Bulk(next), Reply::Array(page)] = &reply[..] else { panic!("SCAN replied {reply:?}") };
            for key in page {
                let Reply::Bulk(key) = key else { panic!("a key that is not a bulk string: {key:?}") };
                keys.push(String::from_utf8(key.clone()).unwrap());
            }
            cursor = String::from_utf8(next.clone()).unwrap();
            if cursor == "0" {
                return keys;
            }
        }
        panic!("the walk did not end");
    }

    fn set_keys(c: &mut Client, n: usize) -> HashSet<String> {
        (0..n)
            .map(|i| {
                let key = format!("key:{i}");
                assert_eq!(run(c, &["SET", &key, "v"]), Reply::ok());
                key
            })
            .collect()
    }

    #[test]
    fn cursors_parse_as_redis_7_0_reads_them() {
        assert_eq!(parse_cursor(b"0"), Some(0));
        assert_eq!(parse_cursor(b""), Some(0));
        assert_eq!(parse_cursor(b"01"), Some(1));
        assert_eq!(parse_cursor(b"+1"), Some(1));
        assert_eq!(parse_cursor(b"-1"), Some(u64::MAX));
        assert_eq!(parse_cursor(b"18446744073709551615"), Some(u64::MAX));
        for bad in [&b"18446744073709551616"[..], b" 1", b"1 ", b"1.0", b"abc", b"+", b"-", b"0x10", b"1e3"] {
            assert_eq!(parse_cursor(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn scan_walks_every_key_with_match_count_and_type() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        let all = set_keys(&mut c, 250);
        for count in ["1", "7", "1000"] {
            let got = walk(&mut c, &["COUNT", count]);
            assert_eq!(got.iter().cloned().collect::<HashSet<_>>(), all, "COUNT {count}");
        }
        let ones: HashSet<String> = all.iter().filter(|k| k.starts_with("key:1")).cloned().collect();
        let got: HashSet<String> = walk(&mut c, &["MATCH", "key:1*", "COUNT", "20"]).into_iter().collect();
        assert_eq!(got, ones);
        // Options repeat and override; names and TYPE values ignore case.
        let got: HashSet<String> =
            walk(&mut c, &["match", "nothing", "MATCH", "key:1*", "type", "STRING"]).into_iter().collect();
        assert_eq!(got, ones);
        assert!(walk(&mut c, &["TYPE", "list"]).is_empty());
        assert!(walk(&mut c, &["TYPE", "no-such-type"]).is_empty());
        // A cursor from nowhere is still a cursor.
        assert!(matches!(run(&mut c, &["SCAN", "18446744073709551615"]), Reply::Array(_)));
    }

    #[test]
    fn scan_errors_are_redis_errors() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["SCAN", "abc"]), err("ERR invalid cursor"));
        assert_eq!(run(&mut c, &["SCAN", "18446744073709551616"]), err("ERR invalid cursor"));
        assert_eq!(run(&mut c, &["SCAN", "0", "COUNT", "0"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["SCAN", "0", "COUNT", "-1"]), err("ERR syntax error"));
        let not_integer = err("ERR value is not an integer or out of range");
        assert_eq!(run(&mut c, &["SCAN", "0", "COUNT", "abc"]), not_integer);
        assert_eq!(run(&mut c, &["SCAN", "0", "COUNT", "99999999999999999999"]), not_integer);
        assert_eq!(run(&mut c, &["SCAN", "0", "COUNT"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["SCAN", "0", "MATCH"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["SCAN", "0", "BOGUS", "x"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["SCAN"]), err("ERR wrong number of arguments for 'scan' command"));
    }

    #[test]
    fn keys_answers_each_match_once_within_its_limit() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        let all = set_keys(&mut c, 300);
        let Reply::Array(keys) = run(&mut c, &["KEYS", "*"]) else { panic!("KEYS answered no array") };
        let got: HashSet<String> = keys
            .iter()
            .map(|k| match k {
                Reply::Bulk(b) => String::from_utf8(b.clone()).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!((got.len(), &got), (keys.len(), &all));
        assert!(matches!(run(&mut c, &["KEYS", "key:29?"]), Reply::Array(k) if k.len() == 10));
        assert_eq!(run(&mut c, &["KEYS", "none*"]), Reply::Array(vec![]));
        // 300 keys of 5-7 bytes, each counting 16 more: over 4000 bytes, under 8000.
        assert!(matches!(keys_within(&mut c, b"*", 8_000), Ok(Reply::Array(k)) if k.len() == 300));
        let Err(super::super::Failure::Reply(message)) = keys_within(&mut c, b"*", 4_000) else {
            panic!("KEYS past its limit must fail")
        };
        assert_eq!(message, "ERR KEYS would return more than 4000 bytes of keys; use SCAN with MATCH");
    }

    #[test]
    fn randomkey_type_touch_unlink_and_flushes() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["RANDOMKEY"]), Reply::Nil);
        let all = set_keys(&mut c, 20);
        for _ in 0..20 {
            let Reply::Bulk(key) = run(&mut c, &["RANDOMKEY"]) else { panic!("RANDOMKEY found nothing") };
            assert!(all.contains(&String::from_utf8(key).unwrap()));
        }
        assert_eq!(run(&mut c, &["TYPE", "key:1"]), Reply::Status("string".into()));
        assert_eq!(run(&mut c, &["TYPE", "nosuch"]), Reply::Status("none".into()));
        assert_eq!(run(&mut c, &["TOUCH", "key:1", "key:1", "key:2", "nosuch"]), Reply::Integer(3));
        assert_eq!(run(&mut c, &["UNLINK", "key:1", "key:1", "nosuch"]), Reply::Integer(1));
        assert_eq!(run(&mut c, &["DBSIZE"]), Reply::Integer(19));
        for bad in [&["FLUSHALL", "LAZY"][..], &["FLUSHALL", "ASYNC", "SYNC"], &["FLUSHDB", "x"]] {
            assert_eq!(run(&mut c, bad), err("ERR syntax error"), "{bad:?}");
        }
        assert_eq!(run(&mut c, &["DBSIZE"]), Reply::Integer(19), "a refused flush must not delete");
        assert_eq!(run(&mut c, &["FLUSHDB", "sync"]), Reply::ok());
        assert_eq!(run(&mut c, &["DBSIZE"]), Reply::Integer(0));
        set_keys(&mut c, 3);
        assert_eq!(run(&mut c, &["FLUSHALL", "ASYNC"]), Reply::ok());
        assert_eq!(run(&mut c, &["DBSIZE"]), Reply::Integer(0));
        set_keys(&mut c, 3);
        assert_eq!(run(&mut c, &["FLUSHALL"]), Reply::ok());
        assert_eq!(run(&mut c, &["RANDOMKEY"]), Reply::Nil);
        assert_eq!(run(&mut c, &["GET", "key:0"]), Reply::Nil);
    }

    #[test]
    fn acl_categories_gate_the_keyspace_commands() {
        let store = MemStore::new();
        let acl = Arc::new(Acl::open(catalog()));
        let mut admin = client_with(&store, &acl);
        set_keys(&mut admin, 5);
        let setuser = ["ACL", "SETUSER", "reader", "on", ">pw", "~*", "+@read", "-@dangerous"];
        assert_eq!(run(&mut admin, &setuser), Reply::ok());
        let mut c = client_with(&store, &acl);
        assert_eq!(run(&mut c, &["AUTH", "reader", "pw"]), Reply::ok());
        assert_eq!(walk(&mut c, &[]).len(), 5);
        assert!(matches!(run(&mut c, &["RANDOMKEY"]), Reply::Bulk(_)));
        assert_eq!(run(&mut c, &["TYPE", "key:0"]), Reply::Status("string".into()));
        for denied in ["KEYS", "FLUSHALL", "FLUSHDB", "UNLINK"] {
            let args: Vec<&str> = if denied == "KEYS" || denied == "UNLINK" { vec![denied, "*"] } else { vec![denied] };
            let reply = run(&mut c, &args);
            assert!(
                matches!(&reply, Reply::Error(e) if e.starts_with("NOPERM")),
                "{denied} by a reader without @dangerous: {reply:?}"
            );
        }
        assert_eq!(run(&mut admin, &["DBSIZE"]), Reply::Integer(5));
    }
}
