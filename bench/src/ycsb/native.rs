//! The native driver: racekv's Rust library attached to the computenode (its shared-memory
//! ring), each of `threads` threads with its own attachment. With a batch of 1, one
//! operation at a time (the library's calls are synchronous); with a batch of n, the next
//! n operations go as one `multi_get` and one `multi_put` (the library's batched calls,
//! which travel pipelined through the ring), the way a RESP pipeline of n keeps n in
//! flight. A batch ends early at a key it already holds (so no operation is reordered
//! around another of the same key) and at a scan (run alone); each operation's latency is
//! its batch's.

use std::path::Path;
use std::time::Instant;

use racekv_client::Client;

use super::resp::Run;
use super::resp::{value_bytes, Cursors};
use super::workload::{share, Chooser, Measured, Op, OPS};

/// Runs `run` with `threads` attached clients on `socket`; returns what was measured and the
/// wall time in seconds (`run.port` is not used).
pub fn run(
    socket: &Path,
    borrow: bool,
    run: &Run<'_>,
    threads: usize,
    batch: usize,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<(Measured, f64)> {
    anyhow::ensure!(batch >= 1, "a native batch holds at least one operation");
    let value = value_bytes(run.value_size, run.seed);
    let clients: Vec<Client> = (0..threads)
        .map(|_| Client::builder().attach(socket).borrow_connections(borrow).connect())
        .collect::<Result<_, _>>()?;
    anyhow::ensure!(
        clients.iter().all(|c| c.is_direct() == borrow),
        "the computenode did not lend connections (see its log and racekv_attach_lendings_total)"
    );
    let started = Instant::now();
    let results: Vec<Measured> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(t, client)| {
                let value = &value;
                s.spawn(move || match batch {
                    1 => thread(client, run, threads, t, value, bar),
                    _ => batched_thread(client, run, threads, t, batch, value, bar),
                })
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

/// Thread `index`'s share of the operations and its chooser (seeded by the index, so every
/// batch size draws the same operations).
fn thread_share(run: &Run<'_>, threads: usize, index: usize) -> (u64, Chooser) {
    let ops = share(run.ops, threads, index);
    let seed = run.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(index as u64);
    (ops, Chooser::new(run.workload, run.distribution, run.space, run.ops, seed))
}

fn thread(
    client: &Client,
    run: &Run<'_>,
    threads: usize,
    index: usize,
    value: &[u8],
    bar: &indicatif::ProgressBar,
) -> Measured {
    let (ops, mut chooser) = thread_share(run, threads, index);
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
            Op::Insert => {
                let result = client.put(&key, value);
                run.space.insert_done(next.key);
                result
            }
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

/// One thread's share of the operations, `batch` at a time.
fn batched_thread(
    client: &Client,
    run: &Run<'_>,
    threads: usize,
    index: usize,
    batch: usize,
    value: &[u8],
    bar: &indicatif::ProgressBar,
) -> Measured {
    let (ops, mut chooser) = thread_share(run, threads, index);
    let mut measured = Measured::new();
    let mut pending = Pending::with_capacity(batch);
    let mut key = Vec::with_capacity(32);
    let (mut done, mut reported) = (0u64, 0u64);
    while done < ops {
        let next = chooser.next(run.space);
        let start_cursor = Cursors::Racekv.random_start(chooser.random()); // drawn as `thread` does
        super::generator::key_name(next.key, &mut key);
        if next.op == Op::Scan {
            done += flush(client, run, value, &mut pending, &mut measured);
            let started = Instant::now();
            let result = scan(client, start_cursor, u64::from(next.scan_length), &mut measured);
            measured.record(Op::Scan, started.elapsed().as_nanos() as u64);
            if let Err(e) = result {
                measured.error(|| e.to_string());
            }
            done += 1;
        } else {
            if pending.holds(&key) {
                done += flush(client, run, value, &mut pending, &mut measured);
            }
            pending.push(next.op, next.key, &key);
            if pending.len() == batch || done + pending.len() as u64 == ops {
                done += flush(client, run, value, &mut pending, &mut measured);
            }
        }
        if done - reported >= 256 || done == ops {
            bar.inc(done - reported);
            reported = done;
        }
    }
    measured
}

/// The operations of the batch being gathered, their key names side by side in one buffer
/// (the driver allocates nothing per operation).
struct Pending {
    /// Each operation, its key's number, and where its key's name is in `names`.
    ops: Vec<(Op, u64, std::ops::Range<usize>)>,
    names: Vec<u8>,
}

impl Pending {
    fn with_capacity(batch: usize) -> Self {
        Self { ops: Vec::with_capacity(batch), names: Vec::with_capacity(batch * 32) }
    }

    fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether an operation of the key named `name` is pending.
    fn holds(&self, name: &[u8]) -> bool {
        self.ops.iter().any(|(_, _, at)| &self.names[at.clone()] == name)
    }

    fn push(&mut self, op: Op, key: u64, name: &[u8]) {
        let at = self.names.len();
        self.names.extend_from_slice(name);
        self.ops.push((op, key, at..self.names.len()));
    }

    /// The key names of the operations `wanted` picks, in order.
    fn names(&self, wanted: impl Fn(Op) -> bool) -> impl Iterator<Item = &[u8]> {
        self.ops.iter().filter(move |(op, _, _)| wanted(*op)).map(|(_, _, at)| &self.names[at.clone()])
    }

    fn clear(&mut self) {
        self.ops.clear();
        self.names.clear();
    }
}

/// Runs the batch: its reads (and the reads of its read-modify-writes) as one `multi_get`,
/// then its writes as one `multi_put`. Returns how many operations it ran.
fn flush(client: &Client, run: &Run<'_>, value: &[u8], pending: &mut Pending, measured: &mut Measured) -> u64 {
    if pending.len() == 0 {
        return 0;
    }
    let started = Instant::now();
    let reads: Vec<&[u8]> = pending.names(|op| matches!(op, Op::Read | Op::ReadModifyWrite)).collect();
    let writes: Vec<(&[u8], &[u8])> = pending
        .names(|op| matches!(op, Op::Update | Op::Insert | Op::ReadModifyWrite))
        .map(|name| (name, value))
        .collect();
    let mut result = Ok(());
    if !reads.is_empty() {
        result = client.multi_get(&reads).map(|values| {
            measured.not_found += values.iter().filter(|v| v.is_none()).count() as u64;
        });
    }
    if result.is_ok() && !writes.is_empty() {
        result = client.multi_put(&writes);
    }
    let ns = started.elapsed().as_nanos() as u64;
    let mut of_kind = [0u64; OPS.len()];
    for &(op, key, _) in &pending.ops {
        of_kind[op.index()] += 1;
        if op == Op::Insert {
            run.space.insert_done(key);
        }
        if let Err(e) = &result {
            measured.error(|| e.to_string());
        }
    }
    for op in OPS.into_iter().filter(|op| of_kind[op.index()] > 0) {
        measured.record_n(op, ns, of_kind[op.index()]);
    }
    let n = pending.len() as u64;
    pending.clear();
    n
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
