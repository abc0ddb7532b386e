//! Deterministic replays of races between a split and its clients:
//! - the one the probe's header re-reads exist for: a reader loads a bucket's header, a split
//!   then moves the bucket's key away, and the reader loads the slots afterwards. (A bucket
//!   READ is not atomic: word by word on shm, anything goes over a network.) The reader must
//!   not conclude the key is absent.
//! - the one split.rs invariant 7 exists for: a slot swung and its old block reused between
//!   the splitter's slot and block reads, in its bucket round and then again in its one-slot
//!   path. The splitter must not move (or keep) the key by another key's hash.

mod common;

use std::sync::{Arc, Mutex};

use common::{read_word, BeforeRead, Hook, TornReads};

use racekv_hashing::hash::KeyHash;
use racekv_hashing::heap::Heap;
use racekv_hashing::layout::{encode_block, Slot};
use racekv_hashing::rpc::SplitRequest;
use racekv_hashing::split::Splitter;
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{Table, TableOptions};
use racekv_transport::{Batch, Connection};

/// A memnode whose table holds 400 keys in its one subtable (returned), not split yet.
fn one_subtable_of_keys() -> (TestMemnode, u64) {
    let memnode = TestMemnode::start(Via::Local, 32 << 20, 64);
    let table = memnode.table(TableOptions::default());
    let mut writer = table.client(memnode.connect());
    for i in 0..400 {
        writer.put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes()).unwrap();
    }
    writer.flush().unwrap();
    assert_eq!(table.directory().global_depth(), 0, "no split yet");
    let subtable = table.directory().lookup(0).entry.subtable;
    (memnode, subtable)
}

/// Buckets the splitter handles per round (split.rs `BUCKETS_PER_ROUND`).
const BUCKETS_PER_ROUND: u64 = 16;

#[test]
fn a_split_between_a_buckets_header_and_its_slots_does_not_hide_the_key() {
    let (memnode, subtable) = one_subtable_of_keys();
    let layout = memnode.layout();
    let groups = layout.groups_per_subtable;
    let index_of = |offset: u64| (offset - subtable) / 64;
    // The worst case: the key sits in the second bucket of a combined bucket that the first
    // round of the split handles (it moves: directory hash bit 0 set), and every other bucket
    // of the key is handled in later rounds. A reader whose READ of that bucket is torn
    // after its header, with the first round run in the tear, loads all four headers old.
    let items = scan(&*memnode.connect(), &layout);
    let victim = items
        .iter()
        .find(|it| {
            let hash = KeyHash::of(&it.key, groups);
            let cbs = hash.combined_buckets(subtable, groups);
            let bucket = it.slot & !63;
            let Some(mine) = cbs.iter().position(|cb| cb.bucket(1) == bucket) else { return false };
            let other = &cbs[1 - mine];
            hash.dir & 1 == 1
                && index_of(bucket) < BUCKETS_PER_ROUND
                && index_of(cbs[mine].bucket(0)) < BUCKETS_PER_ROUND
                && (mine == 1 || index_of(other.bucket(0)) >= BUCKETS_PER_ROUND)
        })
        .expect("a key in the worst-case position among 400");
    let key = victim.key.clone();
    let hash = KeyHash::of(&key, groups);

    // The tear runs the split's first round only (as a crash would leave it); another
    // thread finishes the split shortly after, as a restarted memnode would.
    let splitter = Arc::new(memnode.local_splitter());
    let request = SplitRequest { dir_hash: hash.dir, observed_depth: 0, observed_subtable: subtable };
    let finisher = Arc::clone(&splitter);
    let hook: Hook = Box::new(move || {
        splitter.split_then_crash(&request, 1).unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(finisher.recover().unwrap());
        });
    });
    let torn: Arc<dyn Connection> = Arc::new(TornReads {
        inner: memnode.connect(),
        split_at: (victim.slot & !63) + 8,
        hook: Mutex::new(Some(hook)),
    });
    let reader_table = Table::open(Arc::clone(&torn), TableOptions::default()).unwrap();
    let mut reader = reader_table.client(torn);
    assert_eq!(
        reader.get(&key).unwrap().as_deref(),
        Some(victim.value.as_slice()),
        "the reader missed {} moved by a split between its header and slot loads",
        String::from_utf8_lossy(&key)
    );
    assert!(reader.stats().stale_directory >= 1, "the reader should have noticed the split");
}

/// The splitter reads a bucket's slots, then (next round trip) the blocks they point at to
/// learn each key's hash. Between the two, a client's update can swing a slot (its CAS was
/// sent before the bucket was claimed) and, once the grace period is over, the old block can
/// hold another key. The splitter must not judge the slot by that other key: if it did, a
/// key that moves would stay behind, under a header that no longer admits it, and vanish.
#[test]
fn a_block_reused_between_the_splitters_slot_and_block_reads_does_not_misjudge_the_key() {
    let (memnode, subtable) = one_subtable_of_keys();
    let layout = memnode.layout();
    let groups = layout.groups_per_subtable;
    let items = scan(&*memnode.connect(), &layout);
    // A key that moves (directory hash bit 0 set), and a key that stays, to reuse its blocks.
    let victim = items.iter().find(|it| KeyHash::of(&it.key, groups).dir & 1 == 1).expect("a key that moves").clone();
    let stayer = (0..).map(|i| format!("x{i}").into_bytes()).find(|k| KeyHash::of(k, groups).dir & 1 == 0).unwrap();
    let conn = memnode.connect();
    let first = Slot::decode(read_word(&*conn, victim.slot)).expect("a used slot");
    // Space for the two late updates' blocks, which nobody else will hand out.
    let (spare, _) = Heap::new(Arc::clone(&conn), layout).alloc_chunk(0).unwrap();
    // The first update lands between the bucket round's slot and block reads; the second
    // between the one-slot path's (the slot changed, so the splitter looks at it alone).
    let updated = Slot { units: encode_block(&mut Vec::new(), &victim.key, b"updated", None), block: spare, ..first };
    let updates = [(first, spare, &b"updated"[..]), (updated, spare + 64 * 4, &b"updated again"[..])];

    let hooks: Vec<(u64, Hook)> = updates
        .iter()
        .enumerate()
        .map(|(n, &(from, to, value))| {
            let (conn, key, stayer, slot) = (Arc::clone(&conn), victim.key.clone(), stayer.clone(), victim.slot);
            let hook: Hook = Box::new(move || {
                // A late update swings the slot to a new block; then, the grace period over,
                // its old block holds a key that stays.
                let from_word = Slot { tag: first.tag.wrapping_add(n as u8), ..from }.encode();
                let mut block = Vec::new();
                let units = encode_block(&mut block, &key, value, None);
                let to_word = Slot { units, tag: first.tag.wrapping_add(n as u8 + 1), block: to, ..first }.encode();
                let mut b = Batch::new();
                b.write(to, &block);
                let cas = b.cas(slot, from_word, to_word);
                conn.execute(&mut b).unwrap();
                assert!(b.cas_succeeded(cas).unwrap(), "late update {n}");
                encode_block(&mut block, &stayer, b"s", None);
                assert!(block.len() as u64 <= from.block_bytes());
                b.clear();
                b.write(from.block, &block);
                conn.execute(&mut b).unwrap();
            });
            (from.block, hook)
        })
        .collect();
    let hooked = BeforeRead::new(conn, hooks);
    let splitter_conn: Arc<dyn Connection> = hooked.clone();
    let splitter = Splitter::new(Arc::clone(&splitter_conn), layout, Arc::new(Heap::new(splitter_conn, layout)));
    let request =
        SplitRequest { dir_hash: KeyHash::of(&victim.key, groups).dir, observed_depth: 0, observed_subtable: subtable };
    splitter.split(&request).unwrap();
    assert!(hooked.all_ran(), "the late update ran");

    let reader_table = memnode.table(TableOptions::default());
    let mut reader = reader_table.client(memnode.connect());
    assert_eq!(
        reader.get(&victim.key).unwrap().as_deref(),
        Some(&b"updated again"[..]),
        "{} was left behind by the split",
        String::from_utf8_lossy(&victim.key)
    );
    let copies: Vec<_> = scan(&*memnode.connect(), &layout).into_iter().filter(|it| it.key == victim.key).collect();
    assert_eq!(copies.len(), 1, "one copy of the key: {copies:?}");
    assert!(copies[0].admitted, "the copy is where readers look: {copies:?}");
}
