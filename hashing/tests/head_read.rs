//! A plain upsert reads only the head of the key's current block (`Reading::Heads` in
//! `table.rs`): its key, expiry and mark, not its value. These check that it does, that
//! writes needing the old value still read it whole, and that a head read that may have
//! outlasted the grace period is not trusted.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{read_word, BeforeRead, Hook};
use racekv_hashing::layout::{block_head_bytes, Slot, BLOCK_UNIT_BYTES};
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{Expiry, PutMode, PutOptions, TableClient, TableOptions};
use racekv_transport::{Batch, Connection, OpKind, TransportError, TransportKind};

const GRACE: Duration = Duration::from_millis(20);
const KEY: &[u8] = b"head-read";

fn options() -> TableOptions {
    TableOptions { grace_period: GRACE, op_timeout: Duration::from_secs(10) }
}

fn vias() -> Vec<Via> {
    vec![Via::Local, Via::Transport(TransportKind::Shm), Via::Transport(TransportKind::Tcp)]
}

fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect()
}

/// Passes everything through, recording each READ as (offset, bytes).
struct RecordReads {
    inner: Arc<dyn Connection>,
    reads: Mutex<Vec<(u64, u32)>>,
}

impl RecordReads {
    fn new(inner: Arc<dyn Connection>) -> Arc<Self> {
        Arc::new(Self { inner, reads: Mutex::new(Vec::new()) })
    }

    /// The lengths of the READs at `offset` since the last call.
    fn take_reads_at(&self, offset: u64) -> Vec<u32> {
        let reads = std::mem::take(&mut *self.reads.lock().unwrap());
        reads.into_iter().filter(|&(at, _)| at == offset).map(|(_, len)| len).collect()
    }
}

impl Connection for RecordReads {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        let read = batch.ops().iter().filter(|op| op.kind == OpKind::Read).map(|op| (op.offset, op.len));
        self.reads.lock().unwrap().extend(read);
        self.inner.execute(batch)
    }

    pass_through!();
}

/// The key's slot word now, decoded.
fn current_slot(memnode: &TestMemnode) -> Slot {
    let conn = memnode.connect();
    let slot = scan(&*conn, &memnode.layout()).into_iter().find(|it| it.key == KEY).expect("the key").slot;
    Slot::decode(read_word(&*conn, slot)).expect("a used slot")
}

fn head_len() -> u32 {
    block_head_bytes(KEY.len(), false).next_multiple_of(BLOCK_UNIT_BYTES) as u32
}

#[test]
fn an_upsert_reads_the_head_of_a_large_block_and_a_write_needing_the_value_reads_it_whole() {
    for via in vias() {
        let memnode = TestMemnode::start(via, 16 << 20, 16);
        let table = memnode.table(options());
        let recorder = RecordReads::new(memnode.connect());
        let mut client: TableClient = table.client(recorder.clone());
        client.put(KEY, &value(1000, 1)).unwrap();
        let expect_read = |client: &mut TableClient, write: &dyn Fn(&mut TableClient), whole: bool| {
            let old = current_slot(&memnode);
            assert!(u64::from(head_len()) < old.block_bytes(), "a 1000 B item's block is longer than its head");
            recorder.take_reads_at(old.block);
            write(client);
            let want = if whole { old.block_bytes() as u32 } else { head_len() };
            assert_eq!(recorder.take_reads_at(old.block), vec![want], "{via:?}: the old block read");
        };
        // SET, and SET with a TTL: the head.
        expect_read(&mut client, &|c| assert!(c.put(KEY, &value(1000, 2)).is_ok()), false);
        let at = Expiry::At(racekv_hashing::clock::now_unix_ms() + 3_600_000);
        let ttl = PutOptions { expiry: at, ..PutOptions::default() };
        expect_read(&mut client, &|c| assert!(c.put_opts(KEY, &value(1000, 3), ttl).is_ok()), false);
        // Whole: SET ... GET (the old value), SET ... KEEPTTL (the expiry must be the read
        // block's, which a checksum vouches for), SET NX/XX, compare-and-swap.
        let get = PutOptions { return_old: true, ..PutOptions::default() };
        expect_read(
            &mut client,
            &|c| assert_eq!(c.put_opts(KEY, &value(1000, 4), get).unwrap().old, Some(value(1000, 3))),
            true,
        );
        let keep = PutOptions { expiry: Expiry::Keep, ..PutOptions::default() };
        expect_read(&mut client, &|c| assert!(c.put_opts(KEY, &value(1000, 5), keep).is_ok()), true);
        expect_read(&mut client, &|c| assert!(c.put_with(KEY, &value(1000, 6), PutMode::UpdateOnly).is_ok()), true);
        expect_read(
            &mut client,
            &|c| assert!(c.compare_and_swap(KEY, Some(&value(1000, 6)), Some(&value(1000, 7))).unwrap()),
            true,
        );
        assert_eq!(client.get(KEY).unwrap(), Some(value(1000, 7)), "{via:?}");
    }
}

#[test]
fn an_upsert_whose_head_read_outlasts_the_grace_period_reads_the_blocks_whole() {
    for via in vias() {
        let memnode = TestMemnode::start(via, 16 << 20, 16);
        let table = memnode.table(options());
        let mut writer = table.client(memnode.connect());
        writer.put(KEY, &value(1000, 1)).unwrap();
        let old = current_slot(&memnode);
        // Nothing changes while the upsert is held up before reading the block's head.
        let stall: Hook = Box::new(|| std::thread::sleep(GRACE * 2));
        let recorder = RecordReads::new(BeforeRead::new(memnode.connect(), vec![(old.block, stall)]));
        let mut client = table.client(recorder.clone());
        let before = client.stats();
        client.put(KEY, &value(1000, 2)).unwrap();
        let after = client.stats();
        assert_eq!(after.stalled_reads - before.stalled_reads, 1, "{via:?}: the stall went unnoticed");
        assert_eq!(
            recorder.take_reads_at(old.block),
            vec![head_len(), old.block_bytes() as u32],
            "{via:?}: the head, then (the stall) the whole block"
        );
        assert_eq!(client.get(KEY).unwrap(), Some(value(1000, 2)), "{via:?}");
        assert_eq!(scan(&*memnode.connect(), &memnode.layout()).iter().filter(|it| it.key == KEY).count(), 1);
    }
}

/// Threads upsert 1 KiB values of a few hot keys (heads read) while others swap them
/// (whole blocks read), with a 1 ms grace period so freed blocks come back at once. At the
/// end each key is in one slot and holds a value some write wrote, and every successful
/// compare-and-swap started from a value written before it.
#[test]
fn hot_keys_under_upserts_and_swaps_end_whole() {
    const KEYS: usize = 4;
    const THREADS: usize = 6;
    const OPS: usize = 2000;
    // The setup's writes, as a writer no thread is.
    const SETUP: usize = 1000;
    for via in [Via::Local, Via::Transport(TransportKind::Shm)] {
        let memnode = TestMemnode::start(via, 64 << 20, 16);
        let table =
            memnode.table(TableOptions { grace_period: Duration::from_millis(1), op_timeout: Duration::from_secs(30) });
        let key = |k: usize| format!("hot-{k}").into_bytes();
        // A value names its writer and sequence number in its first bytes.
        let tagged = |thread: usize, i: usize| {
            let mut v = value(1024, thread.wrapping_mul(31).wrapping_add(i) as u8);
            v[..16].copy_from_slice(&[(thread as u64).to_le_bytes(), (i as u64).to_le_bytes()].concat());
            v
        };
        let mut setup = table.client(memnode.connect());
        for k in 0..KEYS {
            setup.put(&key(k), &tagged(SETUP, k)).unwrap();
        }
        let written = Mutex::new(std::collections::HashSet::new());
        for k in 0..KEYS {
            written.lock().unwrap().insert(tagged(SETUP, k));
        }
        std::thread::scope(|s| {
            for thread in 0..THREADS {
                let (table, memnode, written) = (&table, &memnode, &written);
                s.spawn(move || {
                    let mut client = table.client(memnode.connect());
                    for i in 0..OPS {
                        let k = key((thread + i) % KEYS);
                        let new = tagged(thread, i);
                        written.lock().unwrap().insert(new.clone());
                        if thread % 3 == 0 {
                            let Some(current) = client.get(&k).unwrap() else { panic!("{via:?}: a hot key vanished") };
                            assert!(written.lock().unwrap().contains(&current), "{via:?}: a value nobody wrote");
                            client.compare_and_swap(&k, Some(&current), Some(&new)).unwrap();
                        } else {
                            client.put(&k, &new).unwrap();
                        }
                    }
                });
            }
        });
        let items = scan(&*memnode.connect(), &memnode.layout());
        for k in 0..KEYS {
            let copies: Vec<_> = items.iter().filter(|it| it.key == key(k)).collect();
            assert_eq!(copies.len(), 1, "{via:?}: key {k} in {} slots", copies.len());
            assert!(written.lock().unwrap().contains(&copies[0].value), "{via:?}: key {k} holds a value nobody wrote");
        }
    }
}

/// Under a locked slot the head read reaches the intent's mark, which a write that finds
/// the lock past its lease names; once the lock is settled (committed: the intent block
/// stays, unlocked, its mark in it) an upsert reads the head without the mark.
#[test]
fn an_upsert_meeting_a_lock_reads_its_mark() {
    use racekv_hashing::format::read_node_id;
    use racekv_hashing::layout::TxnMark;
    use racekv_hashing::table::txn::{RecordLinks, TxnState};
    use racekv_hashing::Error;

    for via in vias() {
        let memnode = TestMemnode::start(via, 16 << 20, 16);
        let table = memnode.table(options());
        let mut holder = table.client(memnode.connect());
        holder.put(KEY, &value(1000, 1)).unwrap();
        // A lease long past: a write meeting the lock fails at once, naming it.
        let deadline_ms = racekv_hashing::clock::now_unix_ms() - 600_000;
        let record = holder.txn_record(deadline_ms, &RecordLinks::Home(Vec::new())).unwrap();
        let node = read_node_id(&*memnode.connect()).unwrap();
        let word = holder.read_versioned(KEY).unwrap().1.word;
        let mark = TxnMark::of_record(node, record, word, deadline_ms);
        let lock = holder.txn_lock(KEY, Some(&value(1000, 2)), None, mark).unwrap().expect("an uncontended lock");
        let intent = current_slot(&memnode);
        assert!(intent.locked);
        let recorder = RecordReads::new(memnode.connect());
        let mut writer = table.client(recorder.clone());
        match writer.put(KEY, &value(1000, 3)) {
            Err(Error::Locked { mark: named, .. }) => assert_eq!(named, mark, "{via:?}"),
            other => panic!("{via:?}: expected the lock named, got {other:?}"),
        }
        let with_mark = block_head_bytes(KEY.len(), true).next_multiple_of(BLOCK_UNIT_BYTES) as u32;
        assert!(u64::from(with_mark) < intent.block_bytes());
        assert!(recorder.take_reads_at(intent.block).iter().all(|&len| len == with_mark), "{via:?}");
        assert_eq!(holder.txn_decide(record, deadline_ms, TxnState::Committed).unwrap(), Some(TxnState::Committed));
        assert!(holder.txn_settle(KEY, lock.word, &mark, true, lock.replaced).unwrap());
        let settled = current_slot(&memnode);
        assert_eq!((settled.block, settled.locked), (intent.block, false), "{via:?}: the intent, unlocked");
        writer.put(KEY, &value(1000, 4)).unwrap();
        assert_eq!(recorder.take_reads_at(intent.block), vec![head_len()], "{via:?}");
        assert_eq!(writer.get(KEY).unwrap(), Some(value(1000, 4)), "{via:?}");
    }
}
