//! MULTI, EXEC, DISCARD, WATCH, UNWATCH, as Redis 7 defines them (multi.c), on the
//! store's optimistic commit.
//!
//! MULTI queues the commands that follow (each answered `+QUEUED`); one that fails while
//! queued (unknown, wrong arity, denied, past the queue's limits) is answered with its error
//! and makes EXEC answer `-EXECABORT`. WATCH records each key's version. EXEC runs the queue
//! on a [`TxnSession`] (reads once, writes buffered) and commits its reads, the watched
//! versions and its writes in one [`KvSession::commit`](crate::store::KvSession::commit):
//! when a watched key changed EXEC answers a null array and nothing is applied; when only
//! another read changed, the whole queue runs again (at most [`MAX_EXEC_ATTEMPTS`] times).
//! A re-run counts its commands again in the command metrics and stats, and repeats what
//! they do outside the key space (CONFIG SET, CLIENT SETNAME, ...).

use std::collections::BTreeMap;
use std::time::Duration;

use racekv_telemetry::clock::now_unix_ms;

use super::{fail, Client, CmdResult, CommandSpec, Failure};
use crate::metrics::METRICS;
use crate::reply::Reply;
use crate::resp::Command;
use crate::store::{KeyVersion, KvSession, StoreError};
use crate::txn_session::TxnSession;

/// The most commands one transaction may queue; one more is refused and the transaction
/// aborted (Redis has no limit: this bounds a connection's memory).
pub(crate) const MAX_QUEUED_COMMANDS: usize = 100_000;
/// The most bytes (as [`Command::charged_bytes`] counts them) the queued commands of one
/// transaction may hold.
pub(crate) const MAX_QUEUED_BYTES: usize = 64 << 20;
/// The most keys one connection may WATCH at a time.
pub(crate) const MAX_WATCHED_KEYS: usize = 100_000;
/// The most bytes of keys one connection may WATCH at a time (each key counting its length
/// plus 16).
pub(crate) const MAX_WATCHED_BYTES: usize = 16 << 20;
const WATCHED_KEY_OVERHEAD: usize = 16;
/// How many times EXEC runs its queue when other writers keep changing what it read
/// before it answers `-TRYAGAIN`.
pub(crate) const MAX_EXEC_ATTEMPTS: u32 = 8;
/// The first pause between two runs of a queue; it doubles each time (with jitter), up to
/// [`MAX_RERUN_BACKOFF`]. Short: an event loop's other connections wait meanwhile.
const FIRST_RERUN_BACKOFF: Duration = Duration::from_micros(20);
const MAX_RERUN_BACKOFF: Duration = Duration::from_millis(2);

const EXECABORT: &str = "EXECABORT Transaction discarded because of previous errors.";

/// A connection's open transaction (between MULTI and EXEC/DISCARD).
#[derive(Default)]
pub(crate) struct Queue {
    commands: Vec<Command>,
    bytes: usize,
    /// A command failed while queued: EXEC answers EXECABORT.
    dirty: bool,
    /// A queued command writes (CLIENT PAUSE WRITE holds EXEC then).
    writes: bool,
}

/// A connection's WATCHed keys and their versions when watched.
#[derive(Default)]
pub(crate) struct Watched {
    keys: BTreeMap<Vec<u8>, KeyVersion>,
    bytes: usize,
}

/// Whether a command runs at once inside MULTI instead of being queued (Redis'
/// `processCommand`: EXEC, DISCARD, MULTI, WATCH, QUIT; racekv has no RESET).
pub(super) fn runs_in_multi(name: &str) -> bool {
    matches!(name, "exec" | "discard" | "multi" | "watch" | "quit")
}

/// The pause before run `attempt` + 1 of a queue (or of a multi-key command's commit).
pub(super) fn backoff(attempt: u32) {
    let base = FIRST_RERUN_BACKOFF.saturating_mul(1 << attempt.min(16)).min(MAX_RERUN_BACKOFF);
    let jitter = rand::random_range(0..=base.as_micros() as u64 / 2);
    std::thread::sleep(base + Duration::from_micros(jitter));
}

impl Client {
    /// Whether the connection is between MULTI and EXEC/DISCARD.
    pub(super) fn in_multi(&self) -> bool {
        self.multi.is_some()
    }

    /// Whether the open transaction queued a write.
    pub(super) fn multi_writes(&self) -> bool {
        self.multi.as_ref().is_some_and(|q| q.writes)
    }

    /// A command failed while queued: EXEC will answer EXECABORT.
    pub(super) fn flag_transaction(&mut self) {
        if let Some(queue) = &mut self.multi {
            queue.dirty = true;
        }
    }

    /// Queues `cmd` (already checked: known, arity, allowed) for EXEC; the reply is
    /// `+QUEUED`, or an error past the queue's limits (which aborts the transaction).
    pub(super) fn queue_in_multi(&mut self, spec: &CommandSpec, cmd: &Command) -> Reply {
        let queue = self.multi.as_mut().expect("in MULTI");
        if queue.dirty {
            // Redis keeps nothing of a transaction that will abort anyway.
            return Reply::Status("QUEUED".into());
        }
        let bytes = cmd.charged_bytes();
        if queue.commands.len() >= MAX_QUEUED_COMMANDS || queue.bytes + bytes > MAX_QUEUED_BYTES {
            queue.dirty = true;
            queue.commands = Vec::new();
            queue.bytes = 0;
            self.handle.set_multi(Some((0, 0)));
            return Reply::error(format!(
                "ERR transaction too large: at most {MAX_QUEUED_COMMANDS} commands and {MAX_QUEUED_BYTES} bytes \
                 may be queued; the transaction is discarded at EXEC"
            ));
        }
        queue.commands.push(cmd.clone());
        queue.bytes += bytes;
        queue.writes |= spec.has_flag("write");
        self.handle.set_multi(Some((queue.commands.len(), queue.bytes)));
        Reply::Status("QUEUED".into())
    }

    /// Forgets the WATCHed keys.
    pub(super) fn unwatch_all(&mut self) -> Watched {
        let watched = std::mem::take(&mut self.watched);
        self.stats.watching(watched.keys.len(), 0);
        watched
    }

    /// Leaves MULTI, dropping the queue.
    fn end_multi(&mut self) -> Option<Queue> {
        self.handle.set_multi(None);
        self.multi.take()
    }
}

/// `MULTI`.
pub(super) fn multi(c: &mut Client, _cmd: &Command) -> CmdResult {
    if c.in_multi() {
        return Err(fail("ERR MULTI calls can not be nested"));
    }
    c.multi = Some(Queue::default());
    c.handle.set_multi(Some((0, 0)));
    Ok(Reply::ok())
}

/// `DISCARD`.
pub(super) fn discard(c: &mut Client, _cmd: &Command) -> CmdResult {
    if c.end_multi().is_none() {
        return Err(fail("ERR DISCARD without MULTI"));
    }
    c.unwatch_all();
    Ok(Reply::ok())
}

/// `WATCH key [key ...]`: each key's version now (a key watched already keeps the first).
pub(super) fn watch(c: &mut Client, cmd: &Command) -> CmdResult {
    if c.in_multi() {
        return Err(fail("ERR WATCH inside MULTI is not allowed"));
    }
    let before = c.watched.keys.len();
    let mut watched = std::mem::take(&mut c.watched);
    let result = watch_keys(c, cmd, &mut watched);
    c.stats.watching(before, watched.keys.len());
    c.watched = watched;
    result
}

fn watch_keys(c: &mut Client, cmd: &Command, watched: &mut Watched) -> CmdResult {
    for key in cmd.args().skip(1) {
        if watched.keys.contains_key(key) {
            continue;
        }
        let bytes = key.len() + WATCHED_KEY_OVERHEAD;
        if watched.keys.len() >= MAX_WATCHED_KEYS || watched.bytes + bytes > MAX_WATCHED_BYTES {
            return Err(fail(format!(
                "ERR a connection may WATCH at most {MAX_WATCHED_KEYS} keys and {MAX_WATCHED_BYTES} bytes of keys"
            )));
        }
        let (_, version) = c.store()?.read_versioned(key)?;
        watched.keys.insert(key.to_vec(), version);
        watched.bytes += bytes;
    }
    Ok(Reply::ok())
}

/// `UNWATCH`.
pub(super) fn unwatch(c: &mut Client, _cmd: &Command) -> CmdResult {
    c.unwatch_all();
    Ok(Reply::ok())
}

/// Whether a watched key changed since it was watched: another version now (a key that
/// expired reads as absent, so it counts).
fn watch_broken(session: &mut dyn KvSession, watched: &[(Vec<u8>, KeyVersion)]) -> Result<bool, StoreError> {
    let now = now_unix_ms();
    for (key, version) in watched {
        if version.expires_at_ms.is_some_and(|at| now > at) || session.read_versioned(key)?.1 != *version {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `EXEC`.
pub(super) fn exec(c: &mut Client, _cmd: &Command) -> CmdResult {
    let Some(queue) = c.end_multi() else {
        return Err(fail("ERR EXEC without MULTI"));
    };
    let watched: Vec<(Vec<u8>, KeyVersion)> = c.unwatch_all().keys.into_iter().collect();
    if queue.dirty {
        METRICS.transactions_execabort.inc();
        return Err(fail(EXECABORT));
    }
    // A watched key that already changed: nothing runs (as in Redis, not even commands
    // outside the key space).
    if watch_broken(c.store()?, &watched)? {
        METRICS.transactions_watch_aborted.inc();
        return Ok(Reply::NilArray);
    }
    c.store()?;
    let session = c.session.take().expect("taken by store()");
    let (session, outcome) = run_queue(c, &queue.commands, &watched, session);
    c.session = Some(session);
    outcome
}

/// Runs `commands` on a [`TxnSession`] over `session` and commits, again while other
/// writers change what they read.
fn run_queue(
    c: &mut Client,
    commands: &[Command],
    watched: &[(Vec<u8>, KeyVersion)],
    mut session: Box<dyn KvSession>,
) -> (Box<dyn KvSession>, CmdResult) {
    for attempt in 0..MAX_EXEC_ATTEMPTS {
        if attempt > 0 {
            METRICS.transaction_reruns.inc();
            backoff(attempt - 1);
        }
        c.txn = Some(TxnSession::new(session));
        let replies: Vec<Reply> = commands.iter().map(|cmd| c.execute(cmd)).collect();
        let mut txn = c.txn.take().expect("set above");
        let committed = txn.commit(watched);
        session = txn.into_inner();
        match committed {
            Ok(true) => {
                METRICS.transactions.inc();
                return (session, Ok(Reply::Array(replies)));
            }
            Ok(false) => {}
            Err(e) => return (session, Err(e.into())),
        }
        match watch_broken(&mut *session, watched) {
            Ok(false) => {}
            Ok(true) => {
                METRICS.transactions_watch_aborted.inc();
                return (session, Ok(Reply::NilArray));
            }
            Err(e) => return (session, Err(e.into())),
        }
    }
    let tryagain = Failure::Reply(
        format!(
            "TRYAGAIN the transaction kept conflicting with other writers: its queue ran {MAX_EXEC_ATTEMPTS} times \
             and each time a key it read changed before its commit; nothing was applied"
        )
        .into(),
    );
    (session, Err(tryagain))
}
