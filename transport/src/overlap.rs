//! Batches on several connections in flight together, from straight-line code.
//!
//! A write to R replicas is R operations, one per memnode, each a loop of batches that
//! depend on the answers before them. Written as `async fn`s that `.await` [`execute`] for
//! each batch, they are driven by [`run_all`] so that every operation's next batch is sent
//! before any operation waits for an answer: R replicas cost one round trip per step, not R.
//! [`block_on`] drives one operation alone, at the cost of [`Connection::execute`].
//!
//! No threads and no runtime: polling an operation runs it until it has sent its next batch
//! ([`Connection::start`]); polling it again waits for that batch's answer
//! ([`Connection::finish`], blocking) and runs on. So only futures whose every wait is an
//! [`execute`] may be driven here (anything else pending would be polled in a busy loop).

use std::cell::Cell;
use std::future::Future;
use std::ops::DerefMut;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};

use crate::{Batch, Connection, TransportError};

/// [`Connection::execute`] for an operation driven by [`block_on`] or [`run_all`]: sends
/// `batch`, yields to the driver (which sends the other operations' batches), then waits for
/// the answer.
pub async fn execute(conn: &dyn Connection, batch: &mut Batch) -> Result<(), TransportError> {
    if !OVERLAPPING.get() {
        // Alone ([`block_on`]): nothing to overlap with.
        return conn.execute(batch);
    }
    let started = conn.start(batch);
    if !started.is_done() {
        YieldOnce(false).await;
    }
    conn.finish(started, batch)
}

thread_local! {
    /// Whether this thread is in [`run_all`] (not in a [`block_on`] inside it).
    static OVERLAPPING: Cell<bool> = const { Cell::new(false) };
}

/// Sets [`OVERLAPPING`] until dropped, then restores what it was.
struct Overlapping(bool);

impl Overlapping {
    fn set(to: bool) -> Self {
        Self(OVERLAPPING.replace(to))
    }
}

impl Drop for Overlapping {
    fn drop(&mut self) {
        OVERLAPPING.set(self.0);
    }
}

/// Pending once, then ready: hands control back to the driver between a send and its wait.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        Poll::Pending
    }
}

/// Runs one operation to its end.
pub fn block_on<F: Future>(operation: F) -> F::Output {
    let _alone = Overlapping::set(false);
    let mut operation = pin!(operation);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = operation.as_mut().poll(&mut cx) {
            return output;
        }
    }
}

/// Runs every operation to its end, each one's batches in flight together with the
/// others'. Returns their outputs in order.
pub fn run_all<P>(operations: &mut [Pin<P>]) -> Vec<<P::Target as Future>::Output>
where
    P: DerefMut,
    P::Target: Future,
{
    let _together = Overlapping::set(true);
    let mut cx = Context::from_waker(Waker::noop());
    let mut outputs: Vec<Option<_>> = operations.iter().map(|_| None).collect();
    let mut running = operations.len();
    while running > 0 {
        for (operation, output) in operations.iter_mut().zip(&mut outputs) {
            if output.is_some() {
                continue;
            }
            if let Poll::Ready(done) = operation.as_mut().poll(&mut cx) {
                *output = Some(done);
                running -= 1;
            }
        }
    }
    outputs.into_iter().map(|o| o.expect("every operation ran to its end")).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::local::LocalConnection;
    use crate::region::Region;

    #[test]
    fn one_operation_runs_its_batches_in_order() {
        let conn = LocalConnection::new(Arc::new(Region::anonymous(4096).unwrap()), None);
        let result = block_on(async {
            let mut batch = Batch::new();
            batch.write(0, &7u64.to_le_bytes());
            execute(&conn, &mut batch).await?;
            let mut batch = Batch::new();
            let read = batch.read(0, 8);
            execute(&conn, &mut batch).await?;
            Ok::<_, TransportError>(u64::from_le_bytes(batch.read_result(read).unwrap().try_into().unwrap()))
        });
        assert_eq!(result.unwrap(), 7);
    }

    #[test]
    fn operations_on_several_regions_all_finish_with_their_own_results() {
        let conns: Vec<LocalConnection> =
            (0..3).map(|_| LocalConnection::new(Arc::new(Region::anonymous(4096).unwrap()), None)).collect();
        let ops: Vec<_> = conns
            .iter()
            .enumerate()
            .map(|(i, conn)| async move {
                // Operation i makes i + 1 dependent round trips: a counter incremented by CAS.
                for n in 0..=i as u64 {
                    let mut batch = Batch::new();
                    let cas = batch.cas(8, n, n + 1);
                    execute(conn, &mut batch).await?;
                    assert!(batch.cas_succeeded(cas).unwrap());
                }
                let mut batch = Batch::new();
                let read = batch.read(8, 8);
                execute(conn, &mut batch).await?;
                Ok::<_, TransportError>(u64::from_le_bytes(batch.read_result(read).unwrap().try_into().unwrap()))
            })
            .collect();
        let mut ops: Vec<_> = ops.into_iter().map(Box::pin).collect();
        let counts: Vec<u64> = run_all(&mut ops).into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(counts, [1, 2, 3]);
    }
}
