//! Deterministic replays of a reader stalled between its bucket and block reads for longer
//! than the grace period. Meanwhile the key is written again (same value, new block), its
//! old block waits out the grace period and is reused for a newer write of the same key, a
//! compare-and-swap that then loses and never swings a slot to it. The reader must not
//! return that value, nobody ever wrote it, nor let it decide a compare-and-swap
//! (`stall.rs`: a read that may have outlasted the grace period reads its slot again).
//! Also: the memnode's published grace period is the shortest any client waits.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{read_bytes, read_word, BeforeRead, Hook};
use racekv_hashing::layout::{decode_block, Slot};
use racekv_hashing::testing::{scan, TestMemnode, Via};
use racekv_hashing::{TableClient, TableOptions};
use racekv_transport::TransportKind;

const GRACE: Duration = Duration::from_millis(20);
const KEY: &[u8] = b"stalled";

fn options() -> TableOptions {
    TableOptions { grace_period: GRACE, op_timeout: Duration::from_secs(10) }
}

fn vias() -> Vec<Via> {
    let mut vias = vec![Via::Local, Via::Transport(TransportKind::Shm), Via::Transport(TransportKind::Tcp)];
    if cfg!(feature = "rdma") {
        vias.push(Via::Transport(TransportKind::Verbs));
    }
    vias
}

/// How a stalled reader looks the key up.
#[derive(Debug, Clone, Copy)]
enum Lookup {
    Get,
    GetMany,
    GetManyInOrder,
    /// A compare-and-swap from "v1" (the value all along) to "v9".
    CompareAndSwap,
}

impl Lookup {
    fn run(self, reader: &mut TableClient) -> Option<Vec<u8>> {
        let keys: [&[u8]; 2] = [b"another key", KEY];
        match self {
            Lookup::Get => reader.get(KEY).unwrap(),
            Lookup::GetMany => reader.get_many(&keys).unwrap().pop().unwrap(),
            Lookup::GetManyInOrder => reader.get_many_in_order(&keys).unwrap().pop().unwrap(),
            Lookup::CompareAndSwap => {
                let swapped = reader.compare_and_swap(KEY, Some(b"v1"), Some(b"v9")).unwrap();
                Some(if swapped { b"v9".to_vec() } else { b"refused".to_vec() })
            }
        }
    }
}

/// The reader reads the key's slot (value "v1"); before its block READ goes out, a writer
/// writes "v1" again, waits out the grace period, and loses a compare-and-swap whose new
/// block ("v3", never in a slot) reuses the block the reader is about to read. Returns what
/// the reader found (for a compare-and-swap, the value it set or "refused"), and how many
/// reads it checked again.
fn replay(via: Via, lookup: Lookup) -> (Option<Vec<u8>>, u64) {
    let memnode = TestMemnode::start(via, 16 << 20, 16);
    let table = memnode.table(options());
    let mut writer = table.client(memnode.connect());
    writer.put(b"another key", b"some value").unwrap();
    writer.put(KEY, b"v1").unwrap();
    let conn = memnode.connect();
    let layout = memnode.layout();
    let slot = scan(&*conn, &layout).into_iter().find(|it| it.key == KEY).unwrap().slot;
    let v1 = Slot::decode(read_word(&*conn, slot)).expect("the key's slot");

    let reused = Arc::clone(&conn);
    let stall: Hook = Box::new(move || {
        writer.put(KEY, b"v1").unwrap();
        std::thread::sleep(GRACE * 2);
        assert!(!writer.compare_and_swap(KEY, Some(b"not the value"), Some(b"v3")).unwrap());
        // The scene holds only if the lost write's block is the one the reader will read.
        let block = read_bytes(&*reused, v1.block, v1.block_bytes() as u32);
        assert_eq!(decode_block(&block), Some((KEY, &b"v3"[..])), "the allocator did not reuse the block");
    });
    let hooked = BeforeRead::new(memnode.connect(), vec![(v1.block, stall)]);
    let mut reader = table.client(hooked.clone());
    let found = lookup.run(&mut reader);
    assert!(hooked.all_ran(), "{via:?} {lookup:?}: the reader never read the key's old block");
    (found, reader.stats().stalled_reads)
}

#[test]
fn a_stalled_reader_does_not_return_a_value_nobody_wrote() {
    for via in vias() {
        for (lookup, expected) in [
            (Lookup::Get, "v1"),
            (Lookup::GetMany, "v1"),
            (Lookup::GetManyInOrder, "v1"),
            (Lookup::CompareAndSwap, "v9"),
        ] {
            let (found, stalled) = replay(via, lookup);
            assert_eq!(
                found.as_deref().map(String::from_utf8_lossy),
                Some(expected.into()),
                "{via:?} {lookup:?}: a stalled reader went by a value nobody wrote"
            );
            assert!(stalled >= 1, "{via:?} {lookup:?}: the stall went unnoticed");
        }
    }
}

#[test]
fn the_memnodes_grace_period_is_the_shortest_a_client_waits() {
    let memnode = TestMemnode::start(Via::Local, 16 << 20, 16);
    let own = |ms| TableOptions { grace_period: Duration::from_millis(ms), ..TableOptions::default() };
    assert_eq!(memnode.table(own(1)).grace_period(), Duration::from_millis(1), "none published: a client's own");
    memnode.publish_grace_period(Duration::from_millis(300));
    assert_eq!(memnode.table(own(1000)).grace_period(), Duration::from_secs(1), "a longer own grace period stands");
    let table = memnode.table(own(0));
    assert_eq!(table.grace_period(), Duration::from_millis(300));

    // And the allocator waits it: a block freed now is not reused at once.
    let conn = memnode.connect();
    let mut c = table.client(Arc::clone(&conn));
    c.put(b"k", b"v1").unwrap();
    let slot = scan(&*conn, &memnode.layout()).into_iter().find(|it| it.key == b"k").unwrap().slot;
    let first = Slot::decode(read_word(&*conn, slot)).unwrap().block;
    let block = |c: &mut TableClient, value: &[u8]| {
        c.put(b"k", value).unwrap();
        Slot::decode(read_word(&*conn, slot)).unwrap().block
    };
    let second = block(&mut c, b"v2");
    let third = block(&mut c, b"v3");
    assert!(third != first && third != second, "a freed block was reused within the memnode's grace period");
    std::thread::sleep(Duration::from_millis(400));
    let fourth = block(&mut c, b"v4");
    assert!(fourth == first || fourth == second, "freed blocks are reused once the grace period is over");
}
