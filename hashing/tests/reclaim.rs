//! The memnode's start-time reclaim on a real table: after processes leak everything they
//! held, it frees what no slot references, and the space it hands out again never holds a
//! live block (every value stays intact while new clients fill that space).

use std::collections::HashMap;
use std::time::Duration;

use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::TableOptions;

const MIB: u64 = 1 << 20;

fn value(round: usize, i: usize) -> Vec<u8> {
    // 10 B to about 1.6 KiB: blocks of 1 to 26 units, so the holes come in many sizes.
    let len = 10 + (i * 37 + round * 101) % 1600;
    (0..len).map(|j| (i + j + round) as u8).collect()
}

#[test]
fn reclaim_frees_what_nothing_references_and_never_a_live_block() {
    let memnode = TestMemnode::start(Via::Local, 64 * MIB, 8); // small subtables: many splits
    let options = TableOptions { grace_period: Duration::ZERO, ..TableOptions::default() };
    let mut expected: HashMap<String, Vec<u8>> = HashMap::new();
    // Three processes that write, overwrite and delete, then crash (hold on to everything).
    for round in 0..3 {
        let table = memnode.table(options);
        let mut c = table.client(memnode.connect());
        for i in 0..3000 {
            let key = format!("k{}", (i * 7 + round) % 2000);
            let v = value(round, i);
            c.put(key.as_bytes(), &v).unwrap();
            expected.insert(key, v);
        }
        for i in (round..2000).step_by(5) {
            let key = format!("k{i}");
            assert_eq!(c.delete(key.as_bytes()).unwrap(), expected.remove(&key).is_some());
        }
        c.flush().unwrap();
        std::mem::forget(c);
        std::mem::forget(table);
    }
    let before = memnode.stats().heap;
    let reclaimed = memnode.reclaim_as_if_restarted();
    let after = memnode.stats().heap;
    let live_bytes: u64 =
        expected.iter().map(|(k, v)| racekv_hashing::layout::block_units(k.len(), v.len()).unwrap() as u64 * 64).sum();
    let subtable_bytes = after.subtables * memnode.layout().subtable_bytes();
    assert_eq!(reclaimed.live_blocks, expected.len() as u64, "{reclaimed:?}");
    assert_eq!(reclaimed.live_bytes, live_bytes + subtable_bytes, "{reclaimed:?}");
    assert_eq!(after.heap_used_bytes, live_bytes + subtable_bytes, "{before:?} -> {after:?}");
    assert!(before.heap_used_bytes > after.heap_used_bytes + 3 * 1000 * 64, "{before:?} -> {after:?}");

    // New clients fill the reclaimed space (and more); nothing that was live changes.
    let table = memnode.table(options);
    let mut c = table.client(memnode.connect());
    for i in 0..4000 {
        let key = format!("n{i}");
        let v = value(7, i);
        c.put(key.as_bytes(), &v).unwrap();
        expected.insert(key, v);
    }
    c.flush().unwrap();
    for (key, v) in &expected {
        assert_eq!(c.get(key.as_bytes()).unwrap().as_deref(), Some(&v[..]), "{key}");
    }
    let items = scan(&*memnode.connect(), &memnode.layout());
    assert_eq!(items.len(), expected.len(), "duplicates or leftovers in the table");
    // Every reclaimed byte (free list and fragments) was handed out again.
    let refilled = memnode.stats().heap;
    assert!(after.heap_free_bytes > 1 << 20, "{after:?}");
    assert_eq!(refilled.heap_free_bytes, 0, "{after:?} -> {refilled:?}");
}
