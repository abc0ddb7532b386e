//! The native driver: racekv's Rust library attached to the computenode (its shared-memory
//! ring), each of `threads` threads with its own attachment, one operation at a time (the
//! library's calls are synchronous).

use std::path::Path;
use std::time::Instant;

use racekv_client::Client;

use super::resp::Run;
use super::resp::{value_bytes, Cursors};
use super::workload::{share, Chooser, Measured, Op};

/// Runs `run` with `threads` attached clients on `socket`; returns what was measured and the
/// wall time in seconds (`run.port` is not used).
pub fn run(
    socket: &Path,
    run: &Run<'_>,
    threads: usize,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<(Measured, f64)> {
    let value = value_bytes(run.value_size, run.seed);
    let clients: Vec<Client> =
        (0..threads).map(|_| Client::builder().attach(socket).connect()).collect::<Result<_, _>>()?;
    let started = Instant::now();
    let results: Vec<Measured> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(t, client)| {
                let value = &value;
                s.spawn(move || thread(client, run, threads, t, value, bar))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a driver thread panicked")).collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let mut total = Measured::new();
    for r in &results {
        total.merge(r);
    }
    Ok((total, seconds))
}

fn thread(
    client: &Client,
    run: &Run<'_>,
    threads: usize,
    index: usize,
    value: &[u8],
    bar: &indicatif::ProgressBar,
) -> Measured {
    let ops = share(run.ops, threads, index);
    let seed = run.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index as u64);
    let mut chooser = Chooser::new(run.workload, run.distribution, run.space, run.ops, seed);
    let mut measured = Measured::new();
    let mut key = Vec::with_capacity(32);
    for i in 0..ops {
        let next = chooser.next(run.space);
        let start_cursor = Cursors::Racekv.random_start(chooser.random());
        super::generator::key_name(next.key, &mut key);
        let started = Instant::now();
        let result = match next.op {
            Op::Read => client.get(&key).map(|v| measured.not_found += u64::from(v.is_none())),
            Op::Update => client.put(&key, value),
            Op::Insert => client.put(&key, value).map(|()| run.space.ack_insert()),
            Op::ReadModifyWrite => client
                .get(&key)
                .map(|v| measured.not_found += u64::from(v.is_none()))
                .and_then(|()| client.put(&key, value)),
            Op::Scan => scan(client, start_cursor, u64::from(next.scan_length), &mut measured),
        };
        measured.record(next.op, started.elapsed().as_nanos() as u64);
        if let Err(e) = result {
            measured.error(|| e.to_string());
        }
        if i % 256 == 255 {
            bar.inc(256);
        }
    }
    bar.inc(ops % 256);
    measured
}

/// A scan of `length` keys from `cursor`: SCAN calls until it has them or the walk ends.
fn scan(
    client: &Client,
    mut cursor: u64,
    length: u64,
    measured: &mut Measured,
) -> Result<(), racekv_client::ClientError> {
    let mut scanned = 0;
    loop {
        let (next, keys) = client.scan(cursor, (length - scanned) as usize)?;
        measured.scan_calls += 1;
        scanned += keys.len() as u64;
        cursor = next;
        if scanned >= length || cursor == 0 {
            measured.scan_keys += scanned;
            return Ok(());
        }
    }
}
