//! The command layer against `MemStore` (and a contended-store double for INCR).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::keys::MAX_INCR_ATTEMPTS;
use super::*;
use crate::memstore::MemStore;
use crate::store::{KvStore, PutMode, StoreErrorKind};

fn client_over(store: &MemStore) -> Client {
    Client::new(7, Arc::new(store.clone()), Arc::new(ServerStats::new(6379, 100, None)), open_acl())
}

/// A store that hands out one prepared session.
struct Prepared(parking_lot::Mutex<Option<Box<dyn KvSession>>>);

impl Prepared {
    fn store(session: impl KvSession + 'static) -> Arc<dyn KvStore> {
        Arc::new(Self(parking_lot::Mutex::new(Some(Box::new(session)))))
    }
}

impl KvStore for Prepared {
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
        self.0.lock().take().ok_or_else(|| StoreError::new(StoreErrorKind::Other, "one session only"))
    }
}

fn open_acl() -> Arc<Acl> {
    Arc::new(Acl::open(catalog()))
}

fn run(c: &mut Client, args: &[&str]) -> Reply {
    c.execute(&Command::from_args(args))
}

fn bulk(s: &str) -> Reply {
    Reply::bulk_str(s)
}

fn err(s: &str) -> Reply {
    Reply::Error(s.to_string().into())
}

#[test]
fn get_set_del_round_trip_with_case_insensitive_names() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["GET", "k"]), Reply::Nil);
    assert_eq!(run(&mut c, &["set", "k", "v"]), Reply::ok());
    assert_eq!(run(&mut c, &["gEt", "k"]), bulk("v"));
    assert_eq!(store.peek(b"k"), Some(b"v".to_vec()));
    assert_eq!(run(&mut c, &["DEL", "k", "k", "missing"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["GET", "k"]), Reply::Nil);
}

#[test]
fn set_honours_nx_and_xx() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["SET", "k", "1", "XX"]), Reply::Nil);
    assert_eq!(store.peek(b"k"), None);
    assert_eq!(run(&mut c, &["SET", "k", "1", "nx"]), Reply::ok());
    assert_eq!(run(&mut c, &["SET", "k", "2", "NX"]), Reply::Nil);
    assert_eq!(run(&mut c, &["SET", "k", "3", "XX"]), Reply::ok());
    assert_eq!(store.peek(b"k"), Some(b"3".to_vec()));
    assert_eq!(run(&mut c, &["SETNX", "k", "4"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["SETNX", "j", "4"]), Reply::Integer(1));
}

#[test]
fn set_refuses_unknown_and_conflicting_options() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    for args in [
        &["SET", "k", "v", "NX", "XX"][..],
        &["SET", "k", "v", "BOGUS"],
        &["SET", "k", "v", "EX"],
        &["SET", "k", "v", "EX", "10", "PX", "10"],
        &["SET", "k", "v", "EX", "10", "KEEPTTL"],
        &["SET", "k", "v", "KEEPTTL", "PXAT", "10"],
        &["SET", "k", "v", "PERSIST"],
    ] {
        assert_eq!(run(&mut c, args), err("ERR syntax error"), "{args:?}");
    }
    for (args, command) in [
        (&["SET", "k", "v", "EX", "0"][..], "set"),
        (&["SET", "k", "v", "PX", "-5"], "set"),
        (&["SET", "k", "v", "EX", "9223372036854776"], "set"),
        (&["SET", "k", "v", "PX", "9223372036854775807"], "set"),
        (&["SETEX", "k", "0", "v"], "setex"),
        (&["PSETEX", "k", "-1", "v"], "psetex"),
    ] {
        assert_eq!(run(&mut c, args), err(&format!("ERR invalid expire time in '{command}' command")), "{args:?}");
    }
    assert_eq!(run(&mut c, &["SET", "k", "v", "EX", "ten"]), err("ERR value is not an integer or out of range"));
    // The syntax is judged before the time.
    assert_eq!(run(&mut c, &["SET", "k", "v", "EX", "0", "BOGUS"]), err("ERR syntax error"));
    assert_eq!(store.peek(b"k"), None, "a refused SET must not write");
    // The same option twice: the last one counts.
    assert_eq!(run(&mut c, &["SET", "k", "v", "EX", "10", "EX", "100", "NX", "NX"]), Reply::ok());
    // More options than the parser keeps on its stack: the same rules.
    let many = ["SET", "k2", "v", "xx", "Xx", "XX", "xX", "XX", "XX", "XX", "XX", "XX", "px", "5000"];
    assert_eq!(run(&mut c, &many), Reply::Nil, "XX on a missing key");
    assert_eq!(run(&mut c, &[&many[..12], &["BOGUS"]].concat()), err("ERR syntax error"));
    let expiry = store.peek_expiry(b"k").unwrap();
    let now = racekv_telemetry::clock::now_unix_ms();
    assert!(expiry > now + 90_000 && expiry <= now + 100_000, "{expiry} against {now}");
}

#[test]
fn set_with_expiry_keepttl_and_get() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    let later = racekv_telemetry::clock::now_unix_ms() + 3_600_000;
    assert_eq!(run(&mut c, &["SET", "k", "1", "PXAT", &later.to_string()]), Reply::ok());
    assert_eq!(store.peek_expiry(b"k"), Some(later));
    assert_eq!(run(&mut c, &["PEXPIRETIME", "k"]), Reply::Integer(later as i64));
    assert_eq!(run(&mut c, &["EXPIRETIME", "k"]), Reply::Integer((later as i64 + 500) / 1000));
    // KEEPTTL keeps it, a plain SET clears it, GET returns the old value either way.
    assert_eq!(run(&mut c, &["SET", "k", "2", "KEEPTTL", "GET"]), bulk("1"));
    assert_eq!(store.peek_expiry(b"k"), Some(later));
    assert_eq!(run(&mut c, &["SET", "k", "3", "GET"]), bulk("2"));
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(-1));
    // NX GET on a present key: the value, nothing written.
    assert_eq!(run(&mut c, &["SET", "k", "4", "NX", "GET"]), bulk("3"));
    assert_eq!(store.peek(b"k"), Some(b"3".to_vec()));
    assert_eq!(run(&mut c, &["SET", "new", "4", "XX", "GET"]), Reply::Nil);
    assert_eq!(store.peek(b"new"), None);
    // INCR keeps the TTL.
    assert_eq!(run(&mut c, &["SET", "n", "1", "PXAT", &later.to_string()]), Reply::ok());
    assert_eq!(run(&mut c, &["INCRBY", "n", "41"]), Reply::Integer(42));
    assert_eq!(store.peek_expiry(b"n"), Some(later));
    // A time already past writes a key nobody sees.
    assert_eq!(run(&mut c, &["SET", "gone", "x", "PXAT", "1"]), Reply::ok());
    assert_eq!(run(&mut c, &["GET", "gone"]), Reply::Nil);
    assert_eq!(run(&mut c, &["EXISTS", "gone"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["SET", "gone", "y", "NX", "EX", "100"]), Reply::ok(), "expired counts as absent");
    assert_eq!(run(&mut c, &["SETEX", "s", "100", "v"]), Reply::ok());
    assert_eq!(run(&mut c, &["TTL", "s"]), Reply::Integer(100));
    assert_eq!(run(&mut c, &["PSETEX", "p", "100000", "v"]), Reply::ok());
    assert!(matches!(run(&mut c, &["PTTL", "p"]), Reply::Integer(t) if (99_000..=100_000).contains(&t)));
}

#[test]
fn expire_family_follows_redis() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["EXPIRE", "missing", "10"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["TTL", "missing"]), Reply::Integer(-2));
    assert_eq!(run(&mut c, &["PERSIST", "missing"]), Reply::Integer(0));
    run(&mut c, &["SET", "k", "v"]);
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(-1));
    assert_eq!(run(&mut c, &["PTTL", "k"]), Reply::Integer(-1));
    assert_eq!(run(&mut c, &["EXPIRETIME", "k"]), Reply::Integer(-1));
    assert_eq!(run(&mut c, &["PERSIST", "k"]), Reply::Integer(0));
    // Conditions.
    assert_eq!(run(&mut c, &["EXPIRE", "k", "100", "XX"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "100", "GT"]), Reply::Integer(0), "no TTL is infinite");
    assert_eq!(run(&mut c, &["EXPIRE", "k", "100", "nx"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "200", "NX"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "50", "GT"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "200", "GT", "XX"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(200));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "300", "LT"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["PEXPIRE", "k", "150000", "LT"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(150));
    assert_eq!(run(&mut c, &["PERSIST", "k"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "5", "LT"]), Reply::Integer(1), "LT applies to a key without TTL");
    assert_eq!(run(&mut c, &["EXPIRE", "k", "5", "LT", "XX"]), Reply::Integer(0));
    // Absolute times; a past one deletes and answers 1.
    let at = racekv_telemetry::clock::now_unix_ms() / 1000 + 1000;
    assert_eq!(run(&mut c, &["EXPIREAT", "k", &at.to_string()]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["EXPIRETIME", "k"]), Reply::Integer(at as i64));
    assert_eq!(run(&mut c, &["PEXPIREAT", "k", "1000"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["EXISTS", "k"]), Reply::Integer(0));
    run(&mut c, &["SET", "k", "v"]);
    assert_eq!(run(&mut c, &["EXPIRE", "k", "-1"]), Reply::Integer(1));
    assert_eq!(store.peek(b"k"), None);
    run(&mut c, &["SET", "k", "v"]);
    assert_eq!(run(&mut c, &["EXPIRE", "k", "0", "GT"]), Reply::Integer(0), "a failed condition deletes nothing");
    assert_eq!(store.peek(b"k"), Some(b"v".to_vec()));
    // Errors: options first, then the number, then its range.
    assert_eq!(run(&mut c, &["EXPIRE", "k", "x", "bogus"]), err("ERR Unsupported option bogus"));
    for flags in [&["NX", "XX"][..], &["NX", "GT"], &["LT", "NX"]] {
        let mut args = vec!["EXPIRE", "k", "10"];
        args.extend_from_slice(flags);
        assert_eq!(
            run(&mut c, &args),
            err("ERR NX and XX, GT or LT options at the same time are not compatible"),
            "{flags:?}"
        );
    }
    assert_eq!(
        run(&mut c, &["EXPIRE", "k", "10", "GT", "LT"]),
        err("ERR GT and LT options at the same time are not compatible")
    );
    assert_eq!(run(&mut c, &["EXPIRE", "k", "ten"]), err("ERR value is not an integer or out of range"));
    assert_eq!(run(&mut c, &["EXPIRE", "k", "9223372036854776"]), err("ERR invalid expire time in 'expire' command"));
    assert_eq!(
        run(&mut c, &["PEXPIRE", "k", "9223372036854775807"]),
        err("ERR invalid expire time in 'pexpire' command")
    );
    assert_eq!(
        run(&mut c, &["EXPIREAT", "k", "-9223372036854776"]),
        err("ERR invalid expire time in 'expireat' command")
    );
    assert_eq!(run(&mut c, &["PEXPIREAT", "k", "9223372036854775807"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["EXPIRE", "k"]), err("ERR wrong number of arguments for 'expire' command"));
}

#[test]
fn getex_changes_the_expiry_as_it_reads() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["GETEX", "missing", "EX", "-1"]), Reply::Nil, "a missing key answers before the time");
    assert_eq!(run(&mut c, &["GETEX", "missing", "KEEPTTL"]), err("ERR syntax error"));
    run(&mut c, &["SET", "k", "v"]);
    assert_eq!(run(&mut c, &["GETEX", "k"]), bulk("v"));
    assert_eq!(run(&mut c, &["GETEX", "k", "EX", "100"]), bulk("v"));
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(100));
    assert_eq!(run(&mut c, &["GETEX", "k", "PERSIST"]), bulk("v"));
    assert_eq!(run(&mut c, &["TTL", "k"]), Reply::Integer(-1));
    assert_eq!(run(&mut c, &["GETEX", "k", "EX", "0"]), err("ERR invalid expire time in 'getex' command"));
    assert_eq!(run(&mut c, &["GETEX", "k", "EX", "1", "PERSIST"]), err("ERR syntax error"));
    for option in ["NX", "XX", "GET", "KEEPTTL"] {
        assert_eq!(run(&mut c, &["GETEX", "k", option]), err("ERR syntax error"), "{option}");
    }
    assert_eq!(run(&mut c, &["GETEX", "k", "PXAT", "1"]), bulk("v"), "a past time: the value, then gone");
    assert_eq!(run(&mut c, &["GET", "k"]), Reply::Nil);
}

#[test]
fn exists_counts_duplicates_and_mget_mset_work() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["MSET", "a", "1", "b", "2"]), Reply::ok());
    assert_eq!(run(&mut c, &["EXISTS", "a", "a", "zz", "b"]), Reply::Integer(3));
    assert_eq!(run(&mut c, &["MGET", "a", "zz", "b"]), Reply::Array(vec![bulk("1"), Reply::Nil, bulk("2")]));
    assert_eq!(run(&mut c, &["MSET", "a", "1", "b"]), err("ERR wrong number of arguments for 'mset' command"));
    assert_eq!(run(&mut c, &["DBSIZE"]), Reply::Integer(2));
}

#[test]
fn increments_follow_redis_semantics() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["INCR", "n"]), Reply::Integer(1));
    assert_eq!(run(&mut c, &["INCRBY", "n", "41"]), Reply::Integer(42));
    assert_eq!(run(&mut c, &["DECR", "n"]), Reply::Integer(41));
    assert_eq!(run(&mut c, &["DECRBY", "n", "-9"]), Reply::Integer(50));
    assert_eq!(store.peek(b"n"), Some(b"50".to_vec()));

    let not_integer = err("ERR value is not an integer or out of range");
    assert_eq!(run(&mut c, &["INCRBY", "n", "1.5"]), not_integer);
    assert_eq!(run(&mut c, &["SET", "s", "abc"]), Reply::ok());
    assert_eq!(run(&mut c, &["INCR", "s"]), not_integer);
    assert_eq!(run(&mut c, &["SET", "s", " 1"]), Reply::ok());
    assert_eq!(run(&mut c, &["INCR", "s"]), not_integer);
    assert_eq!(run(&mut c, &["SET", "big", "9223372036854775808"]), Reply::ok());
    assert_eq!(run(&mut c, &["INCR", "big"]), not_integer);

    assert_eq!(run(&mut c, &["SET", "max", &i64::MAX.to_string()]), Reply::ok());
    assert_eq!(run(&mut c, &["INCR", "max"]), err("ERR increment or decrement would overflow"));
    assert_eq!(store.peek(b"max"), Some(i64::MAX.to_string().into_bytes()), "overflow must not write");
    assert_eq!(run(&mut c, &["DECRBY", "n", &i64::MIN.to_string()]), err("ERR decrement would overflow"));
    assert_eq!(run(&mut c, &["SET", "min", &i64::MIN.to_string()]), Reply::ok());
    assert_eq!(run(&mut c, &["DECR", "min"]), err("ERR increment or decrement would overflow"));
}

/// A session whose compare-and-swap loses `losses` times (another writer got in between),
/// and whose first `failing_lookups` batched lookups fail as an unreachable memnode's
/// would, before behaving like `MemStore`.
struct Contended {
    inner: MemStore,
    losses: usize,
    cas_calls: Arc<AtomicUsize>,
    failing_lookups: usize,
}

impl KvSession for Contended {
    fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(key)
    }
    fn put(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, StoreError> {
        self.inner.put(key, value, mode)
    }
    fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
        self.inner.delete(key)
    }
    fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError> {
        let calls = self.cas_calls.fetch_add(1, Ordering::SeqCst);
        if calls < self.losses {
            // The competing writer adds 10 between our read and our CAS.
            let current = self.inner.get(key)?.map_or(0, |v| String::from_utf8(v).unwrap().parse::<i64>().unwrap());
            self.inner.put(key, (current + 10).to_string().as_bytes(), PutMode::Upsert)?;
        }
        self.inner.compare_and_swap(key, expected, new)
    }
    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        if self.failing_lookups > 0 {
            self.failing_lookups -= 1;
            return Err(StoreError::new(StoreErrorKind::Unavailable, "memnode 0"));
        }
        self.inner.get_in_order(keys)
    }
    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
        self.inner.multi_put(pairs)
    }
    fn put_opts(
        &mut self,
        key: &[u8],
        value: &[u8],
        options: crate::store::PutOptions,
    ) -> Result<crate::store::PutResult, StoreError> {
        self.inner.put_opts(key, value, options)
    }
    fn get_item(&mut self, key: &[u8]) -> Result<Option<crate::store::Item>, StoreError> {
        self.inner.get_item(key)
    }
    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> crate::store::ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
        self.inner.update_expiry(key, decide)
    }
    fn len(&mut self) -> Result<u64, StoreError> {
        self.inner.len()
    }
    fn info(&mut self) -> Result<String, StoreError> {
        self.inner.info()
    }
    fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        self.inner.scan(cursor, count)
    }
    fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.random_key()
    }
    fn flush(&mut self) -> Result<u64, StoreError> {
        self.inner.flush()
    }
}

fn contended_client(losses: usize) -> (Client, MemStore, Arc<AtomicUsize>) {
    let inner = MemStore::new();
    let cas_calls = Arc::new(AtomicUsize::new(0));
    let session = Contended { inner: inner.clone(), losses, cas_calls: Arc::clone(&cas_calls), failing_lookups: 0 };
    let client = Client::new(1, Prepared::store(session), Arc::new(ServerStats::new(1, 1, None)), open_acl());
    (client, inner, cas_calls)
}

/// A failed lookup of a GET run costs the run's first GET only (it met the failure, as a
/// lone GET would have); the others are looked up again, not answered with its error.
#[test]
fn a_failed_get_run_fails_only_its_first_get() {
    let inner = MemStore::new();
    let session = Contended { inner: inner.clone(), losses: 0, cas_calls: Arc::default(), failing_lookups: 2 };
    let mut c = Client::new(1, Prepared::store(session), Arc::new(ServerStats::new(1, 1, None)), open_acl());
    assert_eq!(run(&mut c, &["SET", "a", "1"]), Reply::ok());
    let gets: Vec<Command> = ["a", "b", "a"].iter().map(|k| Command::from_args(["GET", k])).collect();
    let mut out = crate::reply::Output::default();
    c.execute_gets(&gets, &mut out);
    let out = out.to_vec();
    // Two failed lookups: [a b a] fails (GET a gets it), [b a] fails (GET b), [a] succeeds.
    let unavailable = Reply::Error(StoreError::new(StoreErrorKind::Unavailable, "memnode 0").to_resp_error().into());
    let mut want = Vec::new();
    for reply in [unavailable.clone(), unavailable, Reply::Bulk(b"1".to_vec())] {
        reply.encode(&mut want, Protocol::Resp2);
    }
    assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&want));
}

#[test]
fn increment_retries_lost_races_without_losing_the_other_writes() {
    let (mut c, store, cas_calls) = contended_client(3);
    assert_eq!(run(&mut c, &["INCR", "n"]), Reply::Integer(31));
    assert_eq!(cas_calls.load(Ordering::SeqCst), 4);
    assert_eq!(store.peek(b"n"), Some(b"31".to_vec()));
}

#[test]
fn increment_gives_up_after_a_bounded_number_of_lost_races() {
    let (mut c, _store, cas_calls) = contended_client(usize::MAX);
    let reply = run(&mut c, &["INCRBY", "n", "5"]);
    assert_eq!(
        reply,
        err(&format!("TRYAGAIN INCRBY lost {MAX_INCR_ATTEMPTS} compare-and-swap races on one key; retry"))
    );
    assert_eq!(cas_calls.load(Ordering::SeqCst), MAX_INCR_ATTEMPTS);
}

#[test]
fn store_errors_become_resp_errors() {
    let store = MemStore::with_max_value_bytes(4);
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["SET", "k", "12345"]), err("ERR value too large: 5 bytes, limit 4"));
    assert_eq!(run(&mut c, &["MSET", "a", "1", "b", "12345"]), err("ERR value too large: 5 bytes, limit 4"));
    assert_eq!(store.peek(b"k"), None);
    assert!(StoreError::new(StoreErrorKind::Timeout, "x").to_resp_error().starts_with("TRYAGAIN"));
}

#[test]
fn arity_errors_use_redis_wording() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["GET"]), err("ERR wrong number of arguments for 'get' command"));
    assert_eq!(run(&mut c, &["get", "a", "b"]), err("ERR wrong number of arguments for 'get' command"));
    assert_eq!(run(&mut c, &["SET", "k"]), err("ERR wrong number of arguments for 'set' command"));
    assert_eq!(run(&mut c, &["PING", "a", "b"]), err("ERR wrong number of arguments for 'ping' command"));
    assert_eq!(run(&mut c, &["DEL"]), err("ERR wrong number of arguments for 'del' command"));
}

#[test]
fn unknown_commands_are_reported_exactly_like_redis() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["FOO"]), err("ERR unknown command 'FOO', with args beginning with: "));
    assert_eq!(
        run(&mut c, &["lpush", "l", "x"]),
        err("ERR unknown command 'lpush', with args beginning with: 'l' 'x' ")
    );
    // Arguments are cut at 128 bytes in total, as Redis does.
    let long = "a".repeat(200);
    let Reply::Error(text) = run(&mut c, &["FOO", &long, "next"]) else { panic!("not an error") };
    assert_eq!(text, format!("ERR unknown command 'FOO', with args beginning with: '{}' ", "a".repeat(128)));
}

#[test]
fn connection_commands() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["PING"]), Reply::Status("PONG".into()));
    assert_eq!(run(&mut c, &["ping", "hi"]), bulk("hi"));
    assert_eq!(run(&mut c, &["ECHO", "x y"]), bulk("x y"));
    assert_eq!(run(&mut c, &["SELECT", "0"]), Reply::ok());
    assert_eq!(run(&mut c, &["SELECT", "1"]), err("ERR DB index is out of range"));
    assert_eq!(run(&mut c, &["SELECT", "x"]), err("ERR value is not an integer or out of range"));
    assert_eq!(run(&mut c, &["CLIENT", "GETNAME"]), Reply::Nil);
    assert_eq!(run(&mut c, &["CLIENT", "setname", "worker-1"]), Reply::ok());
    assert_eq!(run(&mut c, &["CLIENT", "GETNAME"]), bulk("worker-1"));
    assert_eq!(
        run(&mut c, &["CLIENT", "SETNAME", "a b"]),
        err("ERR Client names cannot contain spaces, newlines or special characters.")
    );
    assert_eq!(c.name(), Some(b"worker-1".as_slice()));
    assert_eq!(run(&mut c, &["CLIENT", "ID"]), Reply::Integer(7));
    assert_eq!(run(&mut c, &["CLIENT", "SETINFO", "lib-name", "redis-rs"]), Reply::ok());
    assert_eq!(run(&mut c, &["CLIENT", "SETINFO", "LIB-VER", "1.8.1"]), Reply::ok());
    assert_eq!(c.library(), (Some(b"redis-rs".as_slice()), Some(b"1.8.1".as_slice())));
    assert_eq!(run(&mut c, &["CLIENT", "SETINFO", "color", "x"]), err("ERR Unrecognized option 'color'"));
    assert_eq!(run(&mut c, &["CLIENT", "kill", "x"]), err("ERR No such client"));
    assert_eq!(run(&mut c, &["CLIENT", "tracking", "on"]), err("ERR unknown subcommand 'tracking'. Try CLIENT HELP."));
    assert_eq!(run(&mut c, &["CLIENT", "SETNAME"]), err("ERR wrong number of arguments for 'client|setname' command"));
    assert!(!c.wants_close());
    assert_eq!(run(&mut c, &["QUIT"]), Reply::ok());
    assert!(c.wants_close());
}

#[test]
fn hello_switches_between_resp2_and_resp3() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(c.protocol(), Protocol::Resp2);
    let Reply::Map(fields) = run(&mut c, &["HELLO", "2", "SETNAME", "app"]) else { panic!("not a map") };
    assert_eq!(fields[0], (bulk("server"), bulk("redis")));
    assert_eq!(fields[1], (bulk("version"), bulk("7.2.0")));
    assert_eq!(fields[2], (bulk("proto"), Reply::Integer(2)));
    assert_eq!(c.name(), Some(b"app".as_slice()));
    let Reply::Map(fields) = run(&mut c, &["HELLO", "3"]) else { panic!("not a map") };
    assert_eq!(fields[2], (bulk("proto"), Reply::Integer(3)));
    assert_eq!(c.protocol(), Protocol::Resp3);
    assert_eq!(run(&mut c, &["HELLO", "4"]), err("NOPROTO unsupported protocol version"));
    assert_eq!(c.protocol(), Protocol::Resp3, "a refused HELLO changes nothing");
    assert_eq!(run(&mut c, &["HELLO", "x"]), err("ERR Protocol version is not an integer or out of range"));
    assert!(matches!(run(&mut c, &["HELLO"]), Reply::Map(_)));
    assert_eq!(c.protocol(), Protocol::Resp3, "HELLO without a version keeps the protocol");
    run(&mut c, &["HELLO", "2"]);
    assert_eq!(c.protocol(), Protocol::Resp2);
}

#[test]
fn command_introspection_is_enough_for_redis_cli() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["COMMAND", "COUNT"]), Reply::Integer(COMMANDS.len() as i64));
    let Reply::Map(docs) = run(&mut c, &["COMMAND", "DOCS"]) else { panic!("not a map") };
    assert_eq!(docs.len(), COMMANDS.len());
    let Reply::Array(all) = run(&mut c, &["COMMAND"]) else { panic!("not an array") };
    assert_eq!(all.len(), COMMANDS.len());
    let Reply::Array(infos) = run(&mut c, &["command", "info", "GET", "nosuch"]) else { panic!("not an array") };
    assert_eq!(infos[1], Reply::Nil);
    let Reply::Array(get) = &infos[0] else { panic!("not an array") };
    assert_eq!(get[0..2], [bulk("get"), Reply::Integer(2)]);
    assert_eq!(
        run(&mut c, &["COMMAND", "GETKEYS", "x"]),
        err("ERR wrong number of arguments for 'command|getkeys' command")
    );
}

#[test]
fn config_get_answers_read_only_parameters() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(
        run(&mut c, &["CONFIG", "GET", "save", "APPENDONLY"]),
        Reply::map([("save", bulk("")), ("appendonly", bulk("no"))])
    );
    assert_eq!(run(&mut c, &["CONFIG", "GET", "maxc*"]), Reply::map([("maxclients", bulk("100"))]));
    assert_eq!(run(&mut c, &["CONFIG", "GET", "nosuch"]), Reply::Map(vec![]));
    assert_eq!(
        run(&mut c, &["CONFIG", "SET", "x", "y"]),
        err("ERR Unknown option or number of arguments for CONFIG SET - 'x'")
    );
}

#[test]
fn info_reports_server_stats_and_storage_lines() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["PING"]);
    let Reply::Verbatim("txt", text) = run(&mut c, &["INFO"]) else { panic!("not verbatim text") };
    let text = String::from_utf8(text).unwrap();
    assert!(
        text.contains(&format!("redis_version:7.2.0\r\nracekv_version:{}\r\n", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    // PING before, INFO itself is counted after it runs.
    assert!(text.contains("total_commands_processed:1\r\n"), "{text}");
    assert!(text.contains("# Storage\r\nstorage_backend:memstore-test-double\r\n"), "{text}");
    let Reply::Verbatim(_, text) = run(&mut c, &["INFO", "server"]) else { panic!("not verbatim text") };
    assert!(!String::from_utf8(text).unwrap().contains("# Storage"));
}

#[test]
fn every_command_is_counted_once() {
    let store = MemStore::new();
    let stats = Arc::new(ServerStats::new(1, 1, None));
    let mut c = Client::new(1, Arc::new(store.clone()), Arc::clone(&stats), open_acl());
    for args in [&["PING"][..], &["NOPE"], &["GET"], &["GET", "k"]] {
        run(&mut c, args);
    }
    // Commands wait in the connection's tally until its pipeline ends (run_commands
    // publishes it) or a command other than GET and SET runs (it publishes first): PING
    // is counted once NOPE runs.
    assert_eq!(stats.total_commands_processed(), 1);
    c.publish_tally();
    c.publish_tally();
    assert_eq!(stats.total_commands_processed(), 4);
    run(&mut c, &["SET", "k", "v"]);
    run(&mut c, &["PING"]);
    assert_eq!(stats.total_commands_processed(), 5, "PING published the SET before it");
    assert_eq!(c.execute(&Command::new()), err("ERR empty command"));
}

/// Counts the sessions it hands out.
struct Counting {
    inner: MemStore,
    sessions: AtomicUsize,
}

impl KvStore for Counting {
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
        self.sessions.fetch_add(1, Ordering::SeqCst);
        self.inner.session()
    }
}

/// A storage session holds heap space in the memnodes: a connection takes one only when a
/// command needs storage, so idle or unauthenticated connections hold none.
#[test]
fn a_connection_takes_its_storage_session_at_its_first_storage_command() {
    let store = Arc::new(Counting { inner: MemStore::new(), sessions: AtomicUsize::new(0) });
    let options = crate::acl::AclOptions { requirepass: Some("pw".into()), file: None };
    let acl = Arc::new(Acl::new(catalog(), options).unwrap());
    let mut c = Client::new(1, Arc::clone(&store) as Arc<dyn KvStore>, Arc::new(ServerStats::new(1, 1, None)), acl);
    assert_eq!(run(&mut c, &["GET", "k"]), err("NOAUTH Authentication required."));
    assert_eq!(run(&mut c, &["AUTH", "pw"]), Reply::ok());
    assert_eq!(run(&mut c, &["PING"]), Reply::Status("PONG".into()));
    c.idle();
    assert_eq!(store.sessions.load(Ordering::SeqCst), 0);
    assert_eq!(run(&mut c, &["GET", "k"]), Reply::Nil);
    assert_eq!(run(&mut c, &["SET", "k", "v"]), Reply::ok());
    assert_eq!(store.sessions.load(Ordering::SeqCst), 1, "one session, kept");
}
