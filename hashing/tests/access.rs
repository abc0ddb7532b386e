//! Cache mode's access words over the real table: reads record themselves as the table's
//! tracking says (LRU: the second; LFU: Redis' counter), peeks and untracked reads write
//! nothing, and readers CASing access words under writers, deletes and splits never damage
//! a value.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use racekv_hashing::access::{Access, Tracking, LFU_INIT_VAL};
use racekv_hashing::clock::now_unix_ms;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_hashing::TableOptions;
use racekv_transport::TransportKind;

const MIB: u64 = 1 << 20;

fn options(grace_ms: u64) -> TableOptions {
    TableOptions { grace_period: Duration::from_millis(grace_ms), op_timeout: Duration::from_secs(30) }
}

/// Every read raises the counter by one: a log factor of 0 makes Redis' coin always land.
const COUNT_EVERY_READ: Tracking = Tracking::Lfu { log_factor: 0, decay_minutes: 0 };

fn counter(c: &mut racekv_hashing::TableClient, key: &[u8]) -> u8 {
    c.peek_item(key).unwrap().expect("present").1.expect("this build's blocks have access words").lfu_counter
}

fn reads_record_themselves_as_tracking_says(via: Via) {
    let memnode = TestMemnode::start(via, 16 * MIB, 16);
    // A long grace period: a read counts only if it surely beat it (`touch.rs`), and the
    // counts below are exact even on a slow emulated machine.
    let table = memnode.table(options(1_000));
    let mut c = table.client(memnode.connect());
    c.put(b"k", b"v").unwrap();
    c.put(b"other", b"w").unwrap();
    let (item, access) = c.peek_item(b"k").unwrap().unwrap();
    assert_eq!(item.value, b"v");
    let access = access.unwrap();
    assert_eq!(access.lfu_counter, LFU_INIT_VAL, "a new key starts at Redis' initial count");
    assert!(u64::from(access.last_read_s) * 1000 <= now_unix_ms(), "written now");

    // Off (the default): reads cost what they always did and write nothing.
    assert_eq!(table.tracking(), Tracking::Off);
    // A read that may have outlived the grace period (a slow machine: the Soft-RoCE VM)
    // checks its slot again, one round trip more (`stall.rs`); nothing else adds any here.
    let trips = |c: &racekv_hashing::TableClient| c.stats().round_trips - c.stats().stalled_reads;
    let before = trips(&c);
    for _ in 0..5 {
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    }
    assert_eq!(trips(&c) - before, 10, "two round trips a GET, no more");
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL);

    // LFU: each read counts (one CAS each), whichever way it reads; peeks do not.
    table.set_tracking(COUNT_EVERY_READ);
    for _ in 0..5 {
        assert_eq!(c.get(b"k").unwrap().as_deref(), Some(&b"v"[..]));
    }
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL + 5);
    assert_eq!(c.get_item(b"k").unwrap().unwrap().value, b"v");
    let values = c.get_many_in_order(&[&b"k"[..], b"other", b"absent"]).unwrap();
    assert_eq!(values, vec![Some(b"v".to_vec()), Some(b"w".to_vec()), None]);
    assert_eq!(c.get_many(&[&b"k"[..]]).unwrap(), vec![Some(b"v".to_vec())]);
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL + 5 + 1 + 1 + 1);
    assert_eq!(counter(&mut c, b"other"), LFU_INIT_VAL + 1);
    for _ in 0..3 {
        c.peek_item(b"k").unwrap();
    }
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL + 8, "peeks record nothing");
    // The same key twice in one batch: both reads CAS from the word they saw, one lands
    // (racing readers lose updates, by design).
    c.get_many_in_order(&[&b"k"[..], b"k"]).unwrap();
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL + 9);

    // A rewrite is a new block with a fresh word (Redis keeps the count; racekv does not).
    c.put(b"k", b"v2").unwrap();
    assert_eq!(counter(&mut c, b"k"), LFU_INIT_VAL);

    // LRU: a read in a later second stamps it; within the same second nothing is written.
    table.set_tracking(Tracking::Lru);
    let written = c.peek_item(b"other").unwrap().unwrap().1.unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let reading = now_unix_ms();
    assert_eq!(c.get(b"other").unwrap().as_deref(), Some(&b"w"[..]));
    let read = c.peek_item(b"other").unwrap().unwrap().1.unwrap();
    assert!(read.last_read_s > written.last_read_s, "{read:?} after {written:?}");
    assert!(u64::from(read.last_read_s) >= reading / 1000);
    assert_eq!(read.lfu_counter, written.lfu_counter, "LRU leaves the count alone");
    let (second, before) = (now_unix_ms() / 1000, trips(&c));
    c.get(b"other").unwrap();
    let (used, second_after) = (trips(&c) - before, now_unix_ms() / 1000);
    if second == u64::from(read.last_read_s) && second_after == second {
        assert_eq!(used, 2, "a read in the second already recorded writes nothing");
    }
}

#[test]
fn reads_record_themselves_as_tracking_says_local() {
    reads_record_themselves_as_tracking_says(Via::Local);
}

#[test]
fn reads_record_themselves_as_tracking_says_tcp() {
    reads_record_themselves_as_tracking_says(Via::Transport(TransportKind::Tcp));
}

#[test]
fn reads_record_themselves_as_tracking_says_shm() {
    reads_record_themselves_as_tracking_says(Via::Transport(TransportKind::Shm));
}

/// Readers CAS the access words of blocks that writers replace and delete all the while
/// (a 1 ms grace period, so freed blocks are reused at once, in other sizes), the table
/// splitting under them: every value read is one that was written for its key, and at the
/// end each key holds its last write.
#[test]
fn access_updates_under_writes_deletes_and_splits_never_damage_a_value() {
    const KEYS: u64 = 256;
    const READERS: usize = 4;
    const ROUNDS: u64 = 6_000;
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 4);
    let table = memnode.table(options(1));
    table.set_tracking(COUNT_EVERY_READ);
    let key = |k: u64| format!("key-{k}").into_bytes();
    // A value names its key and round, and its length varies, so blocks change size.
    let value = |k: u64, round: u64| format!("{k}:{round}:{}", "x".repeat((round % 7 * 40) as usize)).into_bytes();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let (mut c, stop) = (table.client(memnode.connect()), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut reads = 0u64;
                let mut n = r as u64;
                while !stop.load(Ordering::Relaxed) {
                    n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let k = (n >> 33) % KEYS;
                    if let Some(v) = c.get(&key(k)).unwrap() {
                        let text = String::from_utf8(v).expect("a value written by the test");
                        assert!(text.starts_with(&format!("{k}:")), "key {k} read {text:?}");
                        reads += 1;
                    }
                    if n.is_multiple_of(5) {
                        let batch: Vec<Vec<u8>> = (0..4).map(|i| key((k + i) % KEYS)).collect();
                        let refs: Vec<&[u8]> = batch.iter().map(Vec::as_slice).collect();
                        for (i, v) in c.get_many_in_order(&refs).unwrap().into_iter().enumerate() {
                            if let Some(v) = v {
                                let want = format!("{}:", (k + i as u64) % KEYS);
                                assert!(v.starts_with(want.as_bytes()), "batch read {:?}", String::from_utf8_lossy(&v));
                            }
                        }
                    }
                }
                reads
            })
        })
        .collect();
    let mut writer = table.client(memnode.connect());
    let mut last = vec![None; KEYS as usize];
    for round in 0..ROUNDS {
        let k = round.wrapping_mul(2654435761) % KEYS;
        if round.is_multiple_of(11) {
            writer.delete(&key(k)).unwrap();
            last[k as usize] = None;
        } else {
            writer.put(&key(k), &value(k, round)).unwrap();
            last[k as usize] = Some(value(k, round));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(reads > 0);
    for k in 0..KEYS {
        assert_eq!(writer.get(&key(k)).unwrap(), last[k as usize], "key {k}");
    }
    assert!(memnode.stats().heap.subtables > 1, "the table split under the readers");
    let counted = |a: Option<Access>| a.map_or(0, |a| a.lfu_counter);
    let total: u64 =
        (0..KEYS).filter_map(|k| writer.peek_item(&key(k)).unwrap()).map(|(_, a)| u64::from(counted(a))).sum();
    assert!(total > 0, "the reads were recorded");
}

/// Blocks with access words are format version 2: a version-1 region (whose blocks are all
/// valid version-2 blocks) is upgraded in place by rewriting its superblock, after which it
/// reads as this build's; versions this build does not know stay refused.
#[test]
fn a_version_1_region_is_upgraded_in_place_and_unknown_versions_are_refused() {
    use racekv_hashing::format::{read_layout, upgrade};
    use racekv_hashing::layout::{sb, FORMAT_VERSION};
    let memnode = TestMemnode::start(Via::Local, 16 * MIB, 16);
    let conn = memnode.connect();
    let mut c = memnode.table(options(10)).client(memnode.connect());
    c.put(b"kept", b"through the upgrade").unwrap();
    let layout = memnode.layout();
    let superblock_of = |version: u32| {
        let mut bytes = layout.encode();
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        let checksum = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[..sb::LAYOUT_BYTES], 0x5B);
        bytes[56..64].copy_from_slice(&checksum.to_le_bytes());
        bytes
    };
    let write = |bytes: &[u8; 64]| {
        let mut b = racekv_transport::Batch::new();
        b.write(0, bytes);
        conn.execute(&mut b).unwrap();
    };
    assert_eq!(FORMAT_VERSION, 2);
    write(&superblock_of(1));
    let refused = read_layout(&*conn).unwrap_err().to_string();
    assert!(refused.contains("region format version 1, this build reads 2"), "{refused}");
    assert_eq!(upgrade(&*conn).unwrap(), Some(1));
    assert_eq!(read_layout(&*conn).unwrap(), layout);
    assert_eq!(upgrade(&*conn).unwrap(), None, "once is enough");
    let mut c2 = memnode.table(options(10)).client(memnode.connect());
    assert_eq!(c2.get(b"kept").unwrap().as_deref(), Some(&b"through the upgrade"[..]));
    write(&superblock_of(3));
    assert!(upgrade(&*conn).unwrap_err().to_string().contains("region format version 3"));
    c.put(b"after", b"x").unwrap(); // the table's clients never read the superblock again
}
