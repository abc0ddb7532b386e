//! `Client::transaction` through a computenode (in-process, over two real memnodes): attached
//! clients (the shared-memory ring) and a remote client (RPCs) run bank transfers while
//! another checks the total in read-only transactions, and a write between a body's read and
//! its commit makes the body run again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[path = "../../client/tests/shared/bank.rs"]
mod bank;

use bank::{account, number, splitmix, total, transfer, GROUP};
use racekv_client::{Client, ClientError, Mode};
use racekv_computenode::config::ComputenodeConfig;
use racekv_computenode::Computenode;
use racekv_hashing::testing::{TestMemnode, Via};
use racekv_transport::TransportKind;

const PASSWORD: &str = "remote secret";

/// Two memnodes with small subtables (so the workload splits them), and a computenode over
/// them serving an attach socket and a remote port.
fn cluster(dir: &std::path::Path) -> (Vec<TestMemnode>, Computenode) {
    let memnodes: Vec<TestMemnode> =
        (0..2).map(|_| TestMemnode::start(Via::Transport(TransportKind::Shm), 32 << 20, 4)).collect();
    let node = Computenode::start(ComputenodeConfig {
        memnodes: memnodes.iter().map(|m| m.endpoint().unwrap().to_string()).collect(),
        token: TestMemnode::TOKEN.into(),
        requirepass: Some(PASSWORD.into()),
        redis_addr: None,
        metrics_addr: None,
        remote_addr: Some("127.0.0.1:0".into()),
        attach_socket: Some(dir.join("computenode.sock")),
        ..ComputenodeConfig::default()
    })
    .unwrap();
    (memnodes, node)
}

fn attached(node: &Computenode) -> Client {
    let socket = node.status().attach_socket.expect("the daemon serves its attach socket");
    let client = Client::builder().attach(&socket).connect().unwrap();
    assert_eq!(client.mode(), Mode::Attached);
    client
}

fn remote(node: &Computenode) -> Client {
    let addr = node.remote_endpoint().unwrap();
    let client = Client::builder().remote(addr.trim_start_matches("tcp:")).password(PASSWORD).connect().unwrap();
    assert_eq!(client.mode(), Mode::Remote);
    client
}

#[test]
fn attached_and_remote_bank_transfers_keep_the_total_in_every_snapshot() {
    const ACCOUNTS: usize = 16;
    const INITIAL: i64 = 1_000;
    const RUN_FOR: Duration = Duration::from_millis(1_500);
    let dir = tempfile::tempdir().unwrap();
    let (memnodes, node) = cluster(dir.path());
    let setup = attached(&node);
    // The accounts open in one transaction (a commit of writes only, in one request).
    setup
        .transaction(|tx| {
            for i in 0..ACCOUNTS {
                tx.put(&account(i), INITIAL.to_string().as_bytes());
            }
            Ok(())
        })
        .unwrap();
    let expected = ACCOUNTS as i64 * INITIAL;
    assert_eq!(total(&setup, 0..ACCOUNTS).unwrap(), expected);
    assert!(memnodes.iter().all(|m| m.stats().items > 0), "the accounts span both memnodes");
    let stop = AtomicBool::new(false);
    let (transfers, conflicts, snapshots) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let starved = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        // Three attached clients and a remote one.
        let clients: Vec<Client> = (0..3).map(|_| attached(&node)).chain([remote(&node)]).collect();
        for (t, client) in clients.into_iter().enumerate() {
            let (stop, transfers, conflicts) = (&stop, &transfers, &conflicts);
            s.spawn(move || {
                let mut rng = t as u64 + 1;
                while !stop.load(Ordering::Relaxed) {
                    match transfer(&client, ACCOUNTS, splitmix(&mut rng)) {
                        Ok(()) => transfers.fetch_add(1, Ordering::Relaxed),
                        // Gave up after every attempt conflicted: nothing applied.
                        Err(ClientError::Conflict(_)) => conflicts.fetch_add(1, Ordering::Relaxed),
                        Err(e) => panic!("a transfer through a {:?} client failed: {e}", client.mode()),
                    };
                }
            });
        }
        // Snapshots of each group in turn, through an attached client and the remote one.
        // (One of all 16 accounts, 16 reads long, loses almost every validation to these
        // writers: optimistic reads are for short read sets.)
        for checker in [attached(&node), remote(&node)] {
            let (stop, snapshots, starved) = (&stop, &snapshots, &starved);
            s.spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let group = n % (ACCOUNTS / GROUP) * GROUP;
                    // A snapshot that gave up on conflicts read nothing that counts (as a
                    // transfer that gave up wrote nothing): counted, and tried again.
                    let sum = match total(&checker, group..group + GROUP) {
                        Err(ClientError::Conflict(_)) => {
                            starved.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        sum => sum.unwrap(),
                    };
                    assert_eq!(sum, GROUP as i64 * INITIAL, "a {:?} snapshot of group {group}", checker.mode());
                    snapshots.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            });
        }
        while started.elapsed() < RUN_FOR {
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, Ordering::Relaxed);
    });
    let (transfers, conflicts, snapshots) = (transfers.into_inner(), conflicts.into_inner(), snapshots.into_inner());
    let starved = starved.into_inner();
    assert!(transfers >= 20, "{transfers} transfers committed ({conflicts} gave up)");
    assert!(conflicts <= transfers / 10, "{conflicts} of {} transfers gave up", transfers + conflicts);
    assert!(snapshots >= 4, "{snapshots} snapshots");
    assert!(starved <= snapshots, "{starved} snapshots gave up, {snapshots} completed");
    // Quiet: the total in one snapshot and by plain reads, and nothing left locked (plain
    // writes go through).
    assert_eq!(total(&remote(&node), 0..ACCOUNTS).unwrap(), expected);
    let sum: i64 = (0..ACCOUNTS).map(|i| number(setup.get(&account(i)).unwrap())).sum();
    assert_eq!(sum, expected);
    for i in 0..ACCOUNTS {
        let value = setup.get(&account(i)).unwrap().unwrap();
        setup.put(&account(i), &value).unwrap();
    }
    assert_eq!(setup.len().unwrap(), ACCOUNTS as u64);
}

#[test]
fn a_write_between_the_read_and_the_commit_makes_the_body_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_memnodes, node) = cluster(dir.path());
    let other = attached(&node);
    for client in [attached(&node), remote(&node)] {
        let mode = client.mode();
        other.put(b"x", b"1").unwrap();
        let mut runs = 0;
        let result = client
            .transaction(|tx| {
                runs += 1;
                let x = number(tx.get(b"x")?);
                if runs == 1 {
                    other.put(b"x", b"100").unwrap(); // another client's write, before the commit
                }
                tx.put(b"y", (x + 1).to_string().as_bytes());
                Ok(x)
            })
            .unwrap();
        assert_eq!((runs, result), (2, 100), "{mode:?}");
        assert_eq!(other.get(b"y").unwrap().as_deref(), Some(&b"101"[..]), "{mode:?}");
        // A key read as absent that appears meanwhile is a change too.
        other.delete(b"fresh").unwrap();
        let mut runs = 0;
        client
            .transaction(|tx| {
                runs += 1;
                let _ = tx.get(b"fresh")?;
                if runs == 1 {
                    other.put(b"fresh", b"!").unwrap();
                }
                tx.put(b"z", b"1");
                Ok(())
            })
            .unwrap();
        assert_eq!(runs, 2, "{mode:?}");
        // Reads see the transaction's own writes; deletes and expiries travel too; the last
        // write of a key wins.
        let soon = racekv_client::now_unix_ms() + 60_000;
        let seen = client
            .transaction(|tx| {
                tx.put(b"a", b"first");
                tx.put(b"a", b"last");
                tx.delete(b"y");
                tx.put_expiring(b"t", b"ttl", soon);
                Ok((tx.get(b"a")?, tx.get(b"y")?))
            })
            .unwrap();
        assert_eq!(seen, (Some(b"last".to_vec()), None), "{mode:?}");
        assert_eq!(other.get(b"a").unwrap().as_deref(), Some(&b"last"[..]), "{mode:?}");
        assert_eq!(other.get(b"y").unwrap(), None, "{mode:?}");
        assert_eq!(other.get_item(b"t").unwrap().and_then(|i| i.expires_at_ms), Some(soon), "{mode:?}");
        // A body's error aborts it: nothing applies.
        let err = client
            .transaction(|tx| -> Result<(), ClientError> {
                tx.put(b"a", b"never");
                Err(ClientError::Conflict("the body gave up".into()))
            })
            .unwrap_err();
        assert!(matches!(err, ClientError::Conflict(_)), "{err:?}");
        assert_eq!(other.get(b"a").unwrap().as_deref(), Some(&b"last"[..]), "{mode:?}");
    }
}

#[test]
fn large_transactions_travel_in_parts_and_those_over_the_limits_are_refused_before_sending() {
    let dir = tempfile::tempdir().unwrap();
    let (_memnodes, node) = cluster(dir.path());
    for client in [attached(&node), remote(&node)] {
        let mode = client.mode();
        // A commit larger than a ring slot or an RPC goes in parts; so does reading such a
        // value back (a staged VERSIONED reply).
        let big = vec![7u8; 9 << 20];
        client
            .transaction(|tx| {
                let _ = tx.get(b"big")?;
                tx.put(b"big", &big);
                tx.put(b"big-2", &big[..1 << 20]);
                Ok(())
            })
            .unwrap();
        let read = client.transaction(|tx| Ok((tx.get(b"big")?, tx.get(b"big-2")?))).unwrap();
        assert!(read.0.as_ref() == Some(&big) && read.1.as_deref() == Some(&big[..1 << 20]), "{mode:?}");
        assert!(client.delete(b"big").unwrap() && client.delete(b"big-2").unwrap());
        let too_many = racekv_client::op::MAX_MULTI + 1;
        let err = client
            .transaction(|tx| {
                for i in 0..too_many {
                    tx.put(format!("w{i}").as_bytes(), b"v");
                }
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(err, ClientError::TooLarge { value, .. } if value == too_many), "{mode:?}: {err:?}");
        assert_eq!(client.get(b"w0").unwrap(), None, "{mode:?}: nothing applied");
        let err = client
            .transaction(|tx| {
                tx.put(b"", b"v");
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(err, ClientError::EmptyKey), "{mode:?}: {err:?}");
    }
}
