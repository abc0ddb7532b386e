//! A transaction's per-memnode steps (`table::txn`) on a real table: locks others wait for,
//! and locks left by a coordinator that died, across a memnode restart's reclaim, settled
//! either way with nothing lost or reused under them.

use std::time::Duration;

use racekv_hashing::format::read_node_id;
use racekv_hashing::layout::TxnMark;
use racekv_hashing::table::txn::{RecordLinks, TxnState, TXN_LEASE_MS};
use racekv_hashing::testing::{Fault, FaultyConnection, TestMemnode, Via};
use racekv_hashing::{Error, TableOptions};

const MIB: u64 = 1 << 20;

fn big(seed: u8) -> Vec<u8> {
    (0..40_000u32).map(|i| (i as u8).wrapping_add(seed)).collect()
}

/// Locks `k-small` (present), `k-big` (present, a value in an extent) and `k-new` (absent)
/// in one transaction, then "dies": nothing settled, nothing freed.
fn die_holding_locks(memnode: &TestMemnode, options: TableOptions, deadline_ms: u64) -> TxnMark {
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    let record_offset = c.txn_record(deadline_ms, &RecordLinks::Home(Vec::new())).unwrap();
    let node = read_node_id(&*memnode.connect()).unwrap();
    let base = TxnMark::of_record(node, record_offset, 0, deadline_ms);
    for (key, value) in [(&b"k-small"[..], &b"new"[..]), (b"k-big", &big(9)[..]), (b"k-new", b"fresh")] {
        let word = c.read_versioned(key).unwrap().1.word;
        let lock = c.txn_lock(key, Some(value), None, TxnMark { old_word: word, ..base }).unwrap();
        assert!(lock.is_some(), "locking {key:?}");
    }
    c.flush().unwrap();
    std::mem::forget(c);
    std::mem::forget(table);
    base
}

/// What an operation meeting one of the locks does: waits out the lease, then names it.
fn locked(result: Result<Option<Vec<u8>>, Error>) -> (Vec<u8>, u64, TxnMark) {
    match result {
        Err(Error::Locked { key, word, mark }) => (key, word, mark),
        other => panic!("expected a lock past its lease, got {other:?}"),
    }
}

fn settle_all(memnode: &TestMemnode, options: TableOptions, decide: TxnState) {
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    for key in [&b"k-small"[..], b"k-big", b"k-new"] {
        let (k, word, mark) = locked(c.get(key));
        assert_eq!(k, key);
        let state = match c.txn_state(mark.record().unwrap().1).unwrap() {
            Some(TxnState::Pending { deadline_ms }) => {
                c.txn_decide(mark.record().unwrap().1, deadline_ms, decide).unwrap().unwrap()
            }
            Some(decided) => decided,
            None => panic!("the record was lost"),
        };
        assert_eq!(state, decide);
        assert!(c.txn_settle(key, word, &mark, state == TxnState::Committed, 0).unwrap());
        // Settled once: a second settle finds nothing.
        assert!(!c.txn_settle(key, word, &mark, state == TxnState::Committed, 0).unwrap());
    }
}

fn fill(memnode: &TestMemnode, options: TableOptions) {
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    for i in 0..6000 {
        c.put(format!("filler-{i}").as_bytes(), &[i as u8; 300]).unwrap();
    }
    c.put(b"filler-big", &big(1)).unwrap();
}

#[test]
fn an_abandoned_transaction_aborts_after_its_lease_and_its_old_values_survive_a_restart() {
    let memnode = TestMemnode::start(Via::Local, 64 * MIB, 8);
    let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
    {
        let table = memnode.table(options);
        let mut c = table.client(memnode.connect());
        c.put(b"k-small", b"old").unwrap();
        c.put(b"k-big", &big(3)).unwrap();
    }
    let deadline = racekv_hashing::clock::now_unix_ms() + 200;
    die_holding_locks(&memnode, options, deadline);
    // The memnode restarts: its reclaim must keep the intents, the blocks they replaced
    // (with the big value's extent) and the record; new writes then reuse what it freed.
    memnode.reclaim_as_if_restarted();
    fill(&memnode, options);
    settle_all(&memnode, options, TxnState::Aborted);
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    assert_eq!(c.get(b"k-small").unwrap().as_deref(), Some(&b"old"[..]));
    assert_eq!(c.get(b"k-big").unwrap(), Some(big(3)));
    assert_eq!(c.get(b"k-new").unwrap(), None);
    assert_eq!(c.get(b"filler-big").unwrap(), Some(big(1)));
    c.flush().unwrap();
    assert_eq!(memnode.stats().items, 2 + 6001, "the aborted insert is not counted");
}

#[test]
fn a_committed_transaction_whose_coordinator_died_rolls_forward() {
    let memnode = TestMemnode::start(Via::Local, 64 * MIB, 8);
    let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
    {
        let table = memnode.table(options);
        let mut c = table.client(memnode.connect());
        c.put(b"k-small", b"old").unwrap();
        c.put(b"k-big", &big(3)).unwrap();
    }
    let deadline = racekv_hashing::clock::now_unix_ms() + 200;
    let mark = die_holding_locks(&memnode, options, deadline);
    {
        // It had decided before it died.
        let table = memnode.table(options);
        let mut c = table.client(memnode.connect());
        let decided = c.txn_decide(mark.record().unwrap().1, deadline, TxnState::Committed).unwrap();
        assert_eq!(decided, Some(TxnState::Committed));
    }
    memnode.reclaim_as_if_restarted();
    fill(&memnode, options);
    settle_all(&memnode, options, TxnState::Committed);
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    assert_eq!(c.get(b"k-small").unwrap().as_deref(), Some(&b"new"[..]));
    assert_eq!(c.get(b"k-big").unwrap(), Some(big(9)));
    assert_eq!(c.get(b"k-new").unwrap().as_deref(), Some(&b"fresh"[..]));
    c.flush().unwrap();
    assert_eq!(memnode.stats().items, 3 + 6001);
}

#[test]
fn others_wait_for_a_lock_within_its_lease_and_a_second_lock_fails_at_once() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let options = TableOptions::default();
    let table = memnode.table(options);
    let mut holder = table.client(memnode.connect());
    let mut other = table.client(memnode.connect());
    holder.put(b"k", b"v0").unwrap();
    let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
    let record_offset = holder.txn_record(deadline_ms, &RecordLinks::Home(Vec::new())).unwrap();
    let node = read_node_id(&*memnode.connect()).unwrap();
    let word = holder.read_versioned(b"k").unwrap().1.word;
    let mark = TxnMark::of_record(node, record_offset, word, deadline_ms);
    let lock = holder.txn_lock(b"k", Some(b"v1"), None, mark).unwrap().expect("uncontended lock");
    // Another transaction's lock on the same key fails without waiting.
    let seen = other.txn_version(b"k").unwrap().word;
    assert_eq!(seen, lock.word, "the version is the locked word");
    let theirs = TxnMark { old_word: word, ..mark };
    assert_eq!(other.txn_lock(b"k", Some(b"v2"), None, theirs).unwrap(), None);
    // A plain read waits until the holder settles (here: commits after 50 ms).
    let reader = std::thread::spawn({
        let table = table.clone();
        let conn = memnode.connect();
        move || table.client(conn).get(b"k").unwrap()
    });
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(holder.txn_decide(record_offset, deadline_ms, TxnState::Committed).unwrap(), Some(TxnState::Committed));
    assert!(holder.txn_settle(b"k", lock.word, &mark, true, lock.replaced).unwrap());
    holder.txn_free_record(record_offset, 1);
    assert_eq!(reader.join().unwrap().as_deref(), Some(&b"v1"[..]));
    assert!(other.stats().lock_waits == 0 && other.get(b"k").unwrap().as_deref() == Some(&b"v1"[..]));
}

#[test]
fn a_memnode_restart_under_the_first_lock_aborts_instead_of_naming_a_lost_record() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
    let table = memnode.table(options);
    let faulty = std::sync::Arc::new(FaultyConnection::new(memnode.connect()));
    let mut c = table.client(faulty.clone());
    c.put(b"k", b"old").unwrap();
    let node = read_node_id(&*memnode.connect()).unwrap();
    let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
    let record_offset = c.txn_record(deadline_ms, &RecordLinks::Home(Vec::new())).unwrap();
    let word = c.read_versioned(b"k").unwrap().1.word;
    // The first lock's first batch carries the record: the memnode "restarts" under it, so
    // the record is lost with that run. The write would start over in the new run; a lock
    // naming the record must not.
    faulty.schedule(0, Fault::Restarted);
    let mark = TxnMark::of_record(node, record_offset, word, deadline_ms);
    match c.txn_lock(b"k", Some(b"new"), None, mark) {
        Err(Error::Transport(racekv_transport::TransportError::InstanceChanged { .. })) => {}
        other => panic!("a lock over a lost record: {other:?}"),
    }
    assert_eq!(faulty.injected(), 1);
    // Nothing was locked: the key reads (and writes) at once.
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"old"[..]));
    assert_eq!(c.txn_version(b"k").unwrap().word, word);
    // The session goes on: the next transaction's record and lock work (the unwritten
    // record is dropped, not left staged).
    let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
    let record_offset = c.txn_record(deadline_ms, &RecordLinks::Home(Vec::new())).unwrap();
    let mark = TxnMark::of_record(node, record_offset, word, deadline_ms);
    let lock = c.txn_lock(b"k", Some(b"new"), None, mark).unwrap().expect("no one else holds k");
    assert_eq!(c.txn_state(record_offset).unwrap(), Some(TxnState::Pending { deadline_ms }));
    assert_eq!(c.txn_decide(record_offset, deadline_ms, TxnState::Committed).unwrap(), Some(TxnState::Committed));
    assert!(c.txn_settle(b"k", lock.word, &mark, true, lock.replaced).unwrap());
    c.txn_free_record(record_offset, 1);
    assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"new"[..]));
}

#[test]
fn a_restart_keeps_a_home_record_of_several_units_while_a_lock_names_it() {
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
    let node = read_node_id(&*memnode.connect()).unwrap();
    let deadline_ms = racekv_hashing::clock::now_unix_ms() + TXN_LEASE_MS;
    let links = RecordLinks::Home((0..20u64).map(|i| (1000 + i, 64 * (i + 1))).collect());
    assert!(links.units() > 1);
    {
        let table = memnode.table(options);
        let mut c = table.client(memnode.connect());
        let record_offset = c.txn_record(deadline_ms, &links).unwrap();
        let mark = TxnMark::of_record(node, record_offset, 0, deadline_ms);
        assert!(c.txn_lock(b"k", Some(b"v"), None, mark).unwrap().is_some());
        c.flush().unwrap();
        std::mem::forget(c);
        std::mem::forget(table);
    }
    memnode.reclaim_as_if_restarted();
    // Space of every small size is handed out again: none of it may be the record's.
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    for i in 0..3000usize {
        c.put(format!("filler-{i}").as_bytes(), &vec![3u8; (i * 7) % 1500]).unwrap();
    }
    let (_, word, mark) = locked(c.get(b"k"));
    let record = c.txn_read_record(mark.record().unwrap().1).unwrap().expect("the record survived");
    assert_eq!(record.state, TxnState::Pending { deadline_ms });
    assert_eq!(record.links, links);
    assert_eq!(
        c.txn_decide(mark.record().unwrap().1, deadline_ms, TxnState::Aborted).unwrap(),
        Some(TxnState::Aborted)
    );
    assert!(c.txn_settle(b"k", word, &mark, false, 0).unwrap());
    assert_eq!(c.get(b"k").unwrap(), None);
}
