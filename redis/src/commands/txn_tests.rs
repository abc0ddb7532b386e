//! MULTI/EXEC/WATCH and the atomic multi-key commands against `MemStore`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::transactions::{MAX_EXEC_ATTEMPTS, MAX_QUEUED_COMMANDS};
use super::*;
use crate::memstore::MemStore;
use crate::store::{ExpiryUpdate, Item, KeyVersion, PutMode, PutOptions, PutResult, StoreErrorKind, TxnWrite};

fn stats() -> Arc<ServerStats> {
    Arc::new(ServerStats::new(6379, 100, None))
}

fn client_over(store: &MemStore) -> Client {
    Client::new(7, Arc::new(store.clone()), stats(), Arc::new(Acl::open(catalog())))
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

fn queued() -> Reply {
    Reply::Status("QUEUED".into())
}

const EXECABORT: &str = "EXECABORT Transaction discarded because of previous errors.";

#[test]
fn exec_runs_the_queue_and_later_commands_see_earlier_writes() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["MULTI"]), Reply::ok());
    for args in [
        &["SET", "n", "1"][..],
        &["INCR", "n"],
        &["APPEND", "n", "x"],
        &["SET", "s", "a", "NX", "GET"],
        &["SET", "s", "b", "NX", "GET"],
        &["GETDEL", "s"],
        &["EXISTS", "s", "n"],
        &["MGET", "n", "s"],
        &["GET", "n"],
    ] {
        assert_eq!(run(&mut c, args), queued(), "{args:?}");
    }
    assert_eq!(store.peek(b"n"), None, "nothing runs before EXEC");
    let reply = run(&mut c, &["EXEC"]);
    assert_eq!(
        reply,
        Reply::Array(vec![
            Reply::ok(),
            Reply::Integer(2),
            Reply::Integer(2),
            Reply::Nil,
            bulk("a"),
            bulk("a"),
            Reply::Integer(1),
            Reply::Array(vec![bulk("2x"), Reply::Nil]),
            bulk("2x"),
        ])
    );
    assert_eq!((store.peek(b"n"), store.peek(b"s")), (Some(b"2x".to_vec()), None));
    assert_eq!(run(&mut c, &["EXEC"]), err("ERR EXEC without MULTI"), "EXEC ends the transaction");
    assert_eq!(run(&mut c, &["MULTI"]), Reply::ok());
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![]), "an empty transaction");
}

#[test]
fn expiry_commands_inside_exec_see_the_buffered_key() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["MULTI"]);
    for args in [
        &["SET", "k", "v", "EX", "100"][..],
        &["TTL", "k"],
        &["SET", "k", "w", "KEEPTTL"],
        &["TTL", "k"],
        &["PERSIST", "k"],
        &["TTL", "k"],
        &["PEXPIRE", "k", "-1"],
        &["GET", "k"],
    ] {
        assert_eq!(run(&mut c, args), queued());
    }
    let reply = run(&mut c, &["EXEC"]);
    let expected = [Reply::ok(), Reply::Integer(100), Reply::ok(), Reply::Integer(100), Reply::Integer(1)];
    let Reply::Array(replies) = reply else { panic!("{reply:?}") };
    assert_eq!(&replies[..5], &expected);
    assert_eq!(&replies[5..], &[Reply::Integer(-1), Reply::Integer(1), Reply::Nil]);
    assert_eq!(store.peek(b"k"), None);
}

#[test]
fn errors_while_queuing_abort_the_transaction() {
    let store = MemStore::new();
    let acl = Arc::new(Acl::open(catalog()));
    let mut admin = Client::new(1, Arc::new(store.clone()), stats(), Arc::clone(&acl));
    let setuser = ["ACL", "SETUSER", "bob", "on", ">pw", "~*", "+@all", "-del"];
    assert_eq!(run(&mut admin, &setuser), Reply::ok());
    for bad in [&["NOSUCH", "x"][..], &["GET"], &["SET", "k"], &["DEL", "a"]] {
        let mut c = Client::new(2, Arc::new(store.clone()), stats(), Arc::clone(&acl));
        assert_eq!(run(&mut c, &["AUTH", "bob", "pw"]), Reply::ok());
        assert_eq!(run(&mut c, &["MULTI"]), Reply::ok());
        assert_eq!(run(&mut c, &["SET", "a", "1"]), queued());
        assert!(run(&mut c, bad).is_error(), "{bad:?} must fail at once");
        assert_eq!(run(&mut c, &["SET", "b", "1"]), queued(), "queuing goes on");
        assert_eq!(run(&mut c, &["EXEC"]), err(EXECABORT), "{bad:?}");
        assert_eq!(store.peek(b"a"), None);
        assert_eq!(run(&mut c, &["EXEC"]), err("ERR EXEC without MULTI"));
    }
}

#[test]
fn runtime_errors_are_elements_and_the_rest_applies() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["SET", "text", "abc"]);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "text"]);
    run(&mut c, &["SET", "b", "1"]);
    run(&mut c, &["SET", "c", "1", "EX", "0"]);
    run(&mut c, &["INCRBY", "b", "x"]);
    assert_eq!(
        run(&mut c, &["EXEC"]),
        Reply::Array(vec![
            err("ERR value is not an integer or out of range"),
            Reply::ok(),
            err("ERR invalid expire time in 'set' command"),
            err("ERR value is not an integer or out of range"),
        ])
    );
    assert_eq!(store.peek(b"b"), Some(b"1".to_vec()));
}

#[test]
fn exec_discard_multi_and_watch_out_of_place() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["EXEC"]), err("ERR EXEC without MULTI"));
    assert_eq!(run(&mut c, &["DISCARD"]), err("ERR DISCARD without MULTI"));
    assert_eq!(run(&mut c, &["MULTI"]), Reply::ok());
    assert_eq!(run(&mut c, &["MULTI"]), err("ERR MULTI calls can not be nested"));
    assert_eq!(run(&mut c, &["WATCH", "a"]), err("ERR WATCH inside MULTI is not allowed"));
    assert_eq!(run(&mut c, &["SET", "a", "1"]), queued());
    // Neither error flags the transaction (as in Redis).
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::ok()]));
    run(&mut c, &["MULTI"]);
    run(&mut c, &["SET", "a", "2"]);
    assert_eq!(run(&mut c, &["DISCARD"]), Reply::ok());
    assert_eq!(store.peek(b"a"), Some(b"1".to_vec()), "DISCARD drops the queue");
    assert_eq!(run(&mut c, &["DISCARD"]), err("ERR DISCARD without MULTI"));
}

#[test]
fn a_watched_key_written_by_another_connection_aborts_exec() {
    let store = MemStore::new();
    let (mut c, mut other) = (client_over(&store), client_over(&store));
    run(&mut c, &["SET", "w", "1"]);
    assert_eq!(run(&mut c, &["WATCH", "w", "absent"]), Reply::ok());
    assert_eq!(run(&mut other, &["SET", "w", "1"]), Reply::ok(), "the same value still changes it");
    run(&mut c, &["MULTI"]);
    run(&mut c, &["SET", "x", "1"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::NilArray);
    assert_eq!(store.peek(b"x"), None);
    // EXEC dropped the watches: the next transaction applies.
    run(&mut c, &["MULTI"]);
    run(&mut c, &["SET", "x", "1"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::ok()]));
    // A key absent when watched and created since counts too; so does one's own write.
    run(&mut c, &["WATCH", "new"]);
    run(&mut other, &["SET", "new", "v"]);
    run(&mut c, &["MULTI"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::NilArray);
    run(&mut c, &["WATCH", "w"]);
    run(&mut c, &["SET", "w", "mine"]);
    run(&mut c, &["MULTI"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::NilArray);
}

#[test]
fn an_unchanged_watch_lets_exec_apply_and_unwatch_or_discard_forget() {
    let store = MemStore::new();
    let (mut c, mut other) = (client_over(&store), client_over(&store));
    run(&mut c, &["WATCH", "a", "a", "b"]);
    run(&mut other, &["SET", "unrelated", "1"]);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "a"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::Integer(1)]));
    run(&mut c, &["WATCH", "a"]);
    run(&mut other, &["SET", "a", "5"]);
    assert_eq!(run(&mut c, &["UNWATCH"]), Reply::ok());
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "a"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::Integer(6)]));
    run(&mut c, &["WATCH", "a"]);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["DISCARD"]);
    run(&mut other, &["SET", "a", "0"]);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "a"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::Integer(1)]), "DISCARD unwatched");
}

#[test]
fn a_watched_key_that_expires_counts_as_changed() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["SET", "e", "v", "PX", "40"]);
    run(&mut c, &["WATCH", "e"]);
    std::thread::sleep(Duration::from_millis(80));
    run(&mut c, &["MULTI"]);
    run(&mut c, &["SET", "x", "1"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::NilArray);
    assert_eq!(store.peek(b"x"), None);
}

#[test]
fn resp3_answers_an_aborted_exec_with_null() {
    let store = MemStore::new();
    let (mut c, mut other) = (client_over(&store), client_over(&store));
    assert!(matches!(run(&mut c, &["HELLO", "3"]), Reply::Map(_)));
    run(&mut c, &["WATCH", "k"]);
    run(&mut other, &["SET", "k", "1"]);
    run(&mut c, &["MULTI"]);
    let reply = run(&mut c, &["EXEC"]);
    let mut out = Vec::new();
    reply.encode(&mut out, c.protocol());
    assert_eq!(out, b"_\r\n");
    reply.encode(&mut out, Protocol::Resp2);
    assert_eq!(out, b"_\r\n*-1\r\n");
}

#[test]
fn the_queue_is_bounded_and_overflow_aborts() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["MULTI"]);
    let ping = Command::from_args(["PING"]);
    for _ in 0..MAX_QUEUED_COMMANDS {
        assert_eq!(c.execute(&ping), queued());
    }
    let Reply::Error(e) = c.execute(&ping) else { panic!("the queue took one command too many") };
    assert!(e.starts_with("ERR transaction too large"), "{e}");
    assert_eq!(run(&mut c, &["EXEC"]), err(EXECABORT));
}

#[test]
fn client_list_shows_the_transaction() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    let list = |c: &mut Client| match run(c, &["CLIENT", "LIST"]) {
        Reply::Verbatim(_, text) | Reply::Bulk(text) => String::from_utf8(text).unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(list(&mut c).contains(" flags=N "), "{}", list(&mut c));
    assert!(list(&mut c).contains(" multi=-1 "));
    run(&mut c, &["MULTI"]);
    run(&mut c, &["SET", "a", "1"]);
    run(&mut c, &["SET", "b", "2"]);
    // CLIENT LIST is queued too: ask from the same connection after EXEC, and from another.
    let mut other = Client::new(8, Arc::new(store.clone()), Arc::clone(&c.stats), Arc::new(Acl::open(catalog())));
    let text = list(&mut other);
    let line = text.lines().find(|l| l.starts_with("id=7 ")).expect("client 7 listed");
    assert!(line.contains(" flags=x ") && line.contains(" multi=2 "), "{line}");
    run(&mut c, &["EXEC"]);
    let text = list(&mut other);
    let line = text.lines().find(|l| l.starts_with("id=7 ")).unwrap();
    assert!(line.contains(" flags=N ") && line.contains(" multi=-1 ") && line.contains(" multi-mem=0 "), "{line}");
}

#[test]
fn info_counts_watching_clients_and_keys() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    let info = |c: &mut Client| match run(c, &["INFO", "clients"]) {
        Reply::Verbatim(_, text) | Reply::Bulk(text) => String::from_utf8(text).unwrap(),
        other => panic!("{other:?}"),
    };
    run(&mut c, &["WATCH", "a", "b", "a"]);
    let text = info(&mut c);
    assert!(text.contains("watching_clients:1\r\n") && text.contains("total_watched_keys:2\r\n"), "{text}");
    run(&mut c, &["UNWATCH"]);
    let text = info(&mut c);
    assert!(text.contains("watching_clients:0\r\n") && text.contains("total_watched_keys:0\r\n"), "{text}");
    run(&mut c, &["WATCH", "a"]);
    let stats = Arc::clone(&c.stats);
    drop(c);
    let mut other = Client::new(9, Arc::new(store), stats, Arc::new(Acl::open(catalog())));
    assert!(info(&mut other).contains("total_watched_keys:0\r\n"), "a closed connection drops its watches");
}

/// A session whose commits with reads fail (another writer got in) while `losses` lasts.
struct Conflicting {
    inner: MemStore,
    losses: Arc<AtomicUsize>,
}

impl KvSession for Conflicting {
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
        self.inner.compare_and_swap(key, expected, new)
    }
    fn put_opts(&mut self, key: &[u8], value: &[u8], options: PutOptions) -> Result<PutResult, StoreError> {
        self.inner.put_opts(key, value, options)
    }
    fn get_item(&mut self, key: &[u8]) -> Result<Option<Item>, StoreError> {
        self.inner.get_item(key)
    }
    fn update_expiry(
        &mut self,
        key: &[u8],
        decide: &mut dyn FnMut(Option<u64>) -> ExpiryUpdate,
    ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
        self.inner.update_expiry(key, decide)
    }
    fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        self.inner.get_in_order(keys)
    }
    fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
        self.inner.multi_put(pairs)
    }
    fn len(&mut self) -> Result<u64, StoreError> {
        self.inner.len()
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
    fn info(&mut self) -> Result<String, StoreError> {
        self.inner.info()
    }
    fn read_versioned(&mut self, key: &[u8]) -> Result<(Option<Item>, KeyVersion), StoreError> {
        self.inner.read_versioned(key)
    }
    fn commit(&mut self, reads: &[(&[u8], KeyVersion)], writes: &[TxnWrite<'_>]) -> Result<bool, StoreError> {
        if !reads.is_empty() && self.losses.load(Ordering::SeqCst) > 0 {
            self.losses.fetch_sub(1, Ordering::SeqCst);
            return Ok(false);
        }
        self.inner.commit(reads, writes)
    }
}

struct OneSession(parking_lot::Mutex<Option<Box<dyn KvSession>>>);

impl KvStore for OneSession {
    fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
        self.0.lock().take().ok_or_else(|| StoreError::new(StoreErrorKind::Other, "one session only"))
    }
}

fn conflicting_client(store: &MemStore, losses: usize) -> (Client, Arc<AtomicUsize>) {
    let losses = Arc::new(AtomicUsize::new(losses));
    let session = Conflicting { inner: store.clone(), losses: Arc::clone(&losses) };
    let kv = Arc::new(OneSession(parking_lot::Mutex::new(Some(Box::new(session)))));
    (Client::new(1, kv, stats(), Arc::new(Acl::open(catalog()))), losses)
}

#[test]
fn a_conflict_on_an_unwatched_read_reruns_the_queue() {
    let store = MemStore::new();
    let (mut c, losses) = conflicting_client(&store, 2);
    run(&mut c, &["SET", "n", "10"]);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "n"]);
    run(&mut c, &["GET", "n"]);
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![Reply::Integer(11), bulk("11")]));
    assert_eq!(losses.load(Ordering::SeqCst), 0, "ran three times");
    assert_eq!(store.peek(b"n"), Some(b"11".to_vec()), "applied once");
}

#[test]
fn a_transaction_that_keeps_conflicting_answers_tryagain_and_applies_nothing() {
    let store = MemStore::new();
    let (mut c, _losses) = conflicting_client(&store, MAX_EXEC_ATTEMPTS as usize);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["INCR", "n"]);
    let Reply::Error(e) = run(&mut c, &["EXEC"]) else { panic!("EXEC must give up") };
    assert!(e.starts_with("TRYAGAIN the transaction kept conflicting"), "{e}");
    assert_eq!(store.peek(b"n"), None);
    // Nothing is left of the transaction.
    assert_eq!(run(&mut c, &["EXEC"]), err("ERR EXEC without MULTI"));
}

#[test]
fn rename_moves_the_value_and_its_ttl() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["RENAME", "nokey", "b"]), err("ERR no such key"));
    assert_eq!(run(&mut c, &["RENAME", "nokey", "nokey"]), err("ERR no such key"));
    run(&mut c, &["SET", "a", "1", "EX", "100"]);
    run(&mut c, &["SET", "b", "old"]);
    assert_eq!(run(&mut c, &["RENAME", "a", "a"]), Reply::ok());
    assert_eq!(run(&mut c, &["RENAMENX", "a", "a"]), Reply::Integer(0));
    let expiry = store.peek_expiry(b"a");
    assert!(expiry.is_some());
    assert_eq!(run(&mut c, &["RENAME", "a", "b"]), Reply::ok());
    assert_eq!((store.peek(b"a"), store.peek(b"b")), (None, Some(b"1".to_vec())));
    assert_eq!(store.peek_expiry(b"b"), expiry, "RENAME keeps the TTL");
    run(&mut c, &["SET", "c", "x"]);
    assert_eq!(run(&mut c, &["RENAMENX", "b", "c"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["RENAMENX", "b", "d"]), Reply::Integer(1));
    assert_eq!((store.peek(b"b"), store.peek(b"d")), (None, Some(b"1".to_vec())));
    assert_eq!(store.peek_expiry(b"d"), expiry);
}

#[test]
fn copy_follows_redis() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    assert_eq!(run(&mut c, &["COPY", "nokey", "b"]), Reply::Integer(0));
    run(&mut c, &["SET", "a", "1", "EX", "100"]);
    assert_eq!(run(&mut c, &["COPY", "a", "a"]), err("ERR source and destination objects are the same"));
    assert_eq!(run(&mut c, &["COPY", "a", "b"]), Reply::Integer(1));
    assert_eq!(store.peek_expiry(b"b"), store.peek_expiry(b"a"), "COPY keeps the TTL");
    run(&mut c, &["SET", "a", "2"]);
    assert_eq!(run(&mut c, &["COPY", "a", "b"]), Reply::Integer(0));
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB", "0", "replace"]), Reply::Integer(1));
    assert_eq!((store.peek(b"b"), store.peek_expiry(b"b")), (Some(b"2".to_vec()), None));
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB", "1"]), err("ERR DB index is out of range"));
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB", "-1"]), err("ERR DB index is out of range"));
    let not_integer = err("ERR value is not an integer or out of range");
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB", "x"]), not_integer);
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB", "4294967296"]), not_integer);
    assert_eq!(run(&mut c, &["COPY", "a", "b", "DB"]), err("ERR syntax error"));
    assert_eq!(run(&mut c, &["COPY", "a", "b", "BOGUS"]), err("ERR syntax error"));
    assert_eq!(run(&mut c, &["COPY", "a"]), err("ERR wrong number of arguments for 'copy' command"));
}

#[test]
fn mset_msetnx_and_rename_inside_multi_join_its_commit() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["MULTI"]);
    run(&mut c, &["MSET", "a", "1", "b", "2", "a", "3"]);
    run(&mut c, &["MSETNX", "b", "x", "c", "y"]);
    run(&mut c, &["MSETNX", "c", "x", "d", "y"]);
    run(&mut c, &["RENAME", "a", "e"]);
    run(&mut c, &["COPY", "e", "f"]);
    run(&mut c, &["MGET", "a", "b", "c", "d", "e", "f"]);
    let got = run(&mut c, &["EXEC"]);
    let mget = Reply::Array(vec![Reply::Nil, bulk("2"), bulk("x"), bulk("y"), bulk("3"), bulk("3")]);
    assert_eq!(
        got,
        Reply::Array(vec![Reply::ok(), Reply::Integer(0), Reply::Integer(1), Reply::ok(), Reply::Integer(1), mget])
    );
    assert_eq!(store.peek(b"f"), Some(b"3".to_vec()));
}

#[test]
fn pipelined_gets_inside_multi_are_queued_in_order() {
    let store = MemStore::new();
    let mut c = client_over(&store);
    run(&mut c, &["SET", "g", "1"]);
    run(&mut c, &["MULTI"]);
    let get = Command::from_args(["GET", "g"]);
    assert!(!c.may_batch_get(&get), "a GET in MULTI is queued, not batched");
    assert_eq!(c.execute(&get), queued());
    run(&mut c, &["SET", "g", "2"]);
    assert_eq!(c.execute(&get), queued());
    assert_eq!(run(&mut c, &["EXEC"]), Reply::Array(vec![bulk("1"), Reply::ok(), bulk("2")]));
    assert!(c.may_batch_get(&get));
}

/// One step of a bank's client: every step keeps the sum of the accounts (an absent
/// account holds 0).
#[derive(Debug, Clone)]
enum Step {
    /// MULTI; DECRBY from; INCRBY to; EXEC.
    Transfer(usize, usize, i64),
    /// WATCH both; read; MULTI; MSET both; EXEC (nil when either changed).
    WatchedMset(usize, usize, i64),
    /// WATCH from; read; MULTI; DEL from; INCRBY to (from's balance); EXEC.
    Close(usize, usize),
    /// MULTI; MGET every account; EXEC: the sum must be the bank's.
    Audit,
}

const ACCOUNTS: usize = 5;
const OPENING: i64 = 100;

fn account(i: usize) -> String {
    format!("acct:{i}")
}

fn balance(reply: &Reply) -> i64 {
    match reply {
        Reply::Nil => 0,
        Reply::Bulk(b) => std::str::from_utf8(b).unwrap().parse().unwrap(),
        other => panic!("not a balance: {other:?}"),
    }
}

/// Runs `step`; returns the sum an audit saw.
fn bank_step(c: &mut Client, step: &Step) -> Option<i64> {
    let exec = |c: &mut Client| match run(c, &["EXEC"]) {
        Reply::Error(e) if e.starts_with("TRYAGAIN") => None,
        Reply::NilArray => None,
        Reply::Array(replies) => {
            assert!(replies.iter().all(|r| !r.is_error()), "{replies:?}");
            Some(replies)
        }
        other => panic!("EXEC answered {other:?}"),
    };
    match *step {
        Step::Transfer(from, to, amount) => {
            run(c, &["MULTI"]);
            run(c, &["DECRBY", &account(from), &amount.to_string()]);
            run(c, &["INCRBY", &account(to), &amount.to_string()]);
            exec(c);
        }
        Step::WatchedMset(from, to, amount) if from != to => {
            let (a, b) = (account(from), account(to));
            run(c, &["WATCH", &a, &b]);
            let (x, y) = (balance(&run(c, &["GET", &a])), balance(&run(c, &["GET", &b])));
            run(c, &["MULTI"]);
            run(c, &["MSET", &a, &(x - amount).to_string(), &b, &(y + amount).to_string()]);
            exec(c);
        }
        Step::Close(from, to) if from != to => {
            let a = account(from);
            run(c, &["WATCH", &a]);
            let x = balance(&run(c, &["GET", &a]));
            run(c, &["MULTI"]);
            run(c, &["DEL", &a]);
            run(c, &["INCRBY", &account(to), &x.to_string()]);
            exec(c);
        }
        Step::Audit => {
            run(c, &["MULTI"]);
            let keys: Vec<String> = (0..ACCOUNTS).map(account).collect();
            let mut args = vec!["MGET"];
            args.extend(keys.iter().map(String::as_str));
            run(c, &args);
            let replies = exec(c)?;
            let Reply::Array(values) = &replies[0] else { panic!("{replies:?}") };
            return Some(values.iter().map(balance).sum());
        }
        _ => {}
    }
    None
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let i = 0..ACCOUNTS;
    prop_oneof![
        (i.clone(), i.clone(), 1..50i64).prop_map(|(a, b, n)| Step::Transfer(a, b, n)),
        (i.clone(), i.clone(), 1..50i64).prop_map(|(a, b, n)| Step::WatchedMset(a, b, n)),
        (i.clone(), i).prop_map(|(a, b)| Step::Close(a, b)),
        Just(Step::Audit),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Concurrent transactions over one store never let an EXEC-read snapshot see money
    /// appear or vanish.
    #[test]
    fn concurrent_transfers_keep_every_audited_sum(
        plans in proptest::collection::vec(proptest::collection::vec(step_strategy(), 1..40), 4)
    ) {
        let store = MemStore::new();
        let mut setup = client_over(&store);
        for i in 0..ACCOUNTS {
            run(&mut setup, &["SET", &account(i), &OPENING.to_string()]);
        }
        let total = OPENING * ACCOUNTS as i64;
        let audits: Vec<Vec<i64>> = std::thread::scope(|s| {
            let handles: Vec<_> = plans
                .iter()
                .map(|plan| {
                    let store = store.clone();
                    s.spawn(move || {
                        let mut c = client_over(&store);
                        plan.iter().filter_map(|step| bank_step(&mut c, step)).collect::<Vec<i64>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for sum in audits.into_iter().flatten() {
            prop_assert_eq!(sum, total);
        }
        let final_sum: i64 = (0..ACCOUNTS).map(|i| store.peek(account(i).as_bytes()).map_or(0, |v| {
            std::str::from_utf8(&v).unwrap().parse::<i64>().unwrap()
        })).sum();
        prop_assert_eq!(final_sum, total);
    }
}

#[test]
fn client_pause_write_holds_an_exec_that_writes() {
    let store = MemStore::new();
    let shared = stats();
    let client = |id| Client::new(id, Arc::new(store.clone()), Arc::clone(&shared), Arc::new(Acl::open(catalog())));
    let (mut pauser, mut reader, mut writer) = (client(1), client(2), client(3));
    run(&mut reader, &["MULTI"]);
    run(&mut reader, &["GET", "k"]);
    run(&mut writer, &["MULTI"]);
    run(&mut writer, &["SET", "k", "v"]);
    assert_eq!(run(&mut pauser, &["CLIENT", "PAUSE", "60000", "WRITE"]), Reply::ok());
    let exec = Command::from_args(["EXEC"]);
    assert!(reader.pause_holds(&exec).is_none(), "a read-only transaction runs");
    assert!(writer.pause_holds(&exec).is_some(), "one that writes waits");
    run(&mut pauser, &["CLIENT", "UNPAUSE"]);
}
