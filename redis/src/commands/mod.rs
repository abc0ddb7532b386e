//! The command layer: a table of supported commands and a per-connection [`Client`] that
//! executes parsed [`Command`]s against its storage session and returns [`Reply`]s.
//!
//! It does no I/O of its own, so it is unit tested directly against `MemStore`.
//! Command names are case-insensitive; arity and error messages follow Redis 7.0 so that
//! clients (and people) see familiar errors.

mod admin;
mod keys;

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use super::info::ServerStats;
use super::metrics::{CommandMetrics, METRICS};
use super::reply::Reply;
use super::resp::Command;
use super::store::{KvSession, StoreError};

/// Why a command failed: a storage error (counted by kind) or a ready error reply.
pub(crate) enum Failure {
    Store(StoreError),
    Reply(Cow<'static, str>),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Store(e)
    }
}

/// An error reply; `message` starts with its code (`ERR ...`).
pub(crate) fn fail(message: impl Into<Cow<'static, str>>) -> Failure {
    Failure::Reply(message.into())
}

pub(crate) type CmdResult = Result<Reply, Failure>;

type Handler = fn(&mut Client, &Command) -> CmdResult;

/// One entry of the command table; also what `COMMAND` reports.
pub(crate) struct CommandSpec {
    /// Lower case, as Redis reports names.
    pub name: &'static str,
    /// Redis convention: `n > 0` exactly n arguments (name included), `n < 0` at least -n.
    pub arity: i32,
    pub flags: &'static [&'static str],
    pub first_key: i32,
    pub last_key: i32,
    pub key_step: i32,
    handler: Handler,
}

impl CommandSpec {
    fn arity_ok(&self, argc: usize) -> bool {
        let argc = argc as i64;
        let arity = i64::from(self.arity);
        if arity >= 0 {
            argc == arity
        } else {
            argc >= -arity
        }
    }
}

const fn spec(
    name: &'static str,
    arity: i32,
    flags: &'static [&'static str],
    keys: (i32, i32, i32),
    handler: Handler,
) -> CommandSpec {
    CommandSpec { name, arity, flags, first_key: keys.0, last_key: keys.1, key_step: keys.2, handler }
}

const NO_KEYS: (i32, i32, i32) = (0, 0, 0);
const ONE_KEY: (i32, i32, i32) = (1, 1, 1);
const ALL_KEYS: (i32, i32, i32) = (1, -1, 1);

/// Every command racekv answers. Anything else gets Redis' "unknown command" error.
pub(crate) static COMMANDS: &[CommandSpec] = &[
    spec("get", 2, &["readonly", "fast"], ONE_KEY, keys::get),
    spec("set", -3, &["write", "denyoom"], ONE_KEY, keys::set),
    spec("setnx", 3, &["write", "denyoom", "fast"], ONE_KEY, keys::setnx),
    spec("del", -2, &["write"], ALL_KEYS, keys::del),
    spec("exists", -2, &["readonly", "fast"], ALL_KEYS, keys::exists),
    spec("mget", -2, &["readonly", "fast"], ALL_KEYS, keys::mget),
    spec("mset", -3, &["write", "denyoom"], (1, -1, 2), keys::mset),
    spec("incr", 2, &["write", "denyoom", "fast"], ONE_KEY, keys::incr),
    spec("decr", 2, &["write", "denyoom", "fast"], ONE_KEY, keys::decr),
    spec("incrby", 3, &["write", "denyoom", "fast"], ONE_KEY, keys::incrby),
    spec("decrby", 3, &["write", "denyoom", "fast"], ONE_KEY, keys::decrby),
    spec("dbsize", 1, &["readonly", "fast"], NO_KEYS, keys::dbsize),
    spec("ping", -1, &["fast"], NO_KEYS, admin::ping),
    spec("echo", 2, &["fast"], NO_KEYS, admin::echo),
    spec("info", -1, &["loading", "stale"], NO_KEYS, admin::info),
    spec("command", -1, &["loading", "stale"], NO_KEYS, admin::command),
    spec("client", -2, &["loading", "stale"], NO_KEYS, admin::client),
    spec("config", -2, &["admin", "loading", "stale"], NO_KEYS, admin::config),
    spec("hello", -1, &["fast", "loading", "stale", "no-auth"], NO_KEYS, admin::hello),
    spec("select", 2, &["loading", "stale", "fast"], NO_KEYS, admin::select),
    spec("quit", -1, &["fast", "loading", "stale", "no-auth"], NO_KEYS, admin::quit),
];

/// Per-command series, in table order, then one for unknown commands.
static COMMAND_METRICS: LazyLock<Vec<CommandMetrics>> = LazyLock::new(|| {
    COMMANDS.iter().map(|c| CommandMetrics::new(c.name)).chain([CommandMetrics::new("unknown")]).collect()
});

static GET_INDEX: LazyLock<usize> = LazyLock::new(|| lookup(b"get").expect("GET is in the table").0);

/// The table entry for `name` (case-insensitive) and its index.
pub(crate) fn lookup(name: &[u8]) -> Option<(usize, &'static CommandSpec)> {
    COMMANDS.iter().enumerate().find(|(_, c)| c.name.as_bytes().eq_ignore_ascii_case(name))
}

/// The state of one client connection: its storage session and what the client set.
pub struct Client {
    id: u64,
    store: Box<dyn KvSession>,
    stats: Arc<ServerStats>,
    name: Option<Vec<u8>>,
    /// What the client library announced with `CLIENT SETINFO`.
    lib_name: Option<Vec<u8>>,
    lib_ver: Option<Vec<u8>>,
    closing: bool,
    /// Pipelined GETs waiting to run together ([`Client::queue_get`]).
    queued_gets: Vec<Command>,
}

impl Client {
    /// A client numbered `id` (unique per server, as `CLIENT ID` reports) over `store`.
    pub fn new(id: u64, store: Box<dyn KvSession>, stats: Arc<ServerStats>) -> Self {
        Self { id, store, stats, name: None, lib_name: None, lib_ver: None, closing: false, queued_gets: Vec::new() }
    }

    /// The number `CLIENT ID` reports.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The name set by `CLIENT SETNAME` or `HELLO ... SETNAME`.
    pub fn name(&self) -> Option<&[u8]> {
        self.name.as_deref()
    }

    /// The client library's name and version, as announced by `CLIENT SETINFO`.
    pub fn library(&self) -> (Option<&[u8]>, Option<&[u8]>) {
        (self.lib_name.as_deref(), self.lib_ver.as_deref())
    }

    /// Whether the connection should close once the replies so far are written (`QUIT`).
    /// Everything sent so far is answered: let the storage do deferred work.
    pub fn idle(&mut self) {
        self.store.idle();
    }

    pub fn wants_close(&self) -> bool {
        self.closing
    }

    /// Whether `cmd` is a well-formed `GET key` (what [`Client::execute_gets`] takes).
    pub fn is_get(cmd: &Command) -> bool {
        let get = &COMMANDS[*GET_INDEX];
        get.arity_ok(cmd.len()) && cmd.get(0).is_some_and(|name| name.eq_ignore_ascii_case(get.name.as_bytes()))
    }

    /// Adds a GET ([`Client::is_get`]) to the run waiting to execute; returns the run's
    /// length. [`Client::run_queued_gets`] executes it.
    pub fn queue_get(&mut self, cmd: Command) -> usize {
        debug_assert!(Self::is_get(&cmd));
        self.queued_gets.push(cmd);
        self.queued_gets.len()
    }

    /// Executes the queued GETs together ([`Client::execute_gets`]), then hands their
    /// commands to `recycle` (the parser reuses their buffers).
    pub fn run_queued_gets(&mut self, out: &mut Vec<u8>, mut recycle: impl FnMut(Command)) {
        if self.queued_gets.is_empty() {
            return;
        }
        let mut run = std::mem::take(&mut self.queued_gets);
        self.execute_gets(&run, out);
        run.drain(..).for_each(&mut recycle);
        self.queued_gets = run;
    }

    /// Executes a run of pipelined `GET`s (each [`Client::is_get`]) with the replies
    /// consecutive `execute`s would give, appending them in order, but looked up together
    /// (on shm their memory misses overlap instead of queueing one behind another).
    /// Records metrics and stats as `execute` does. When the lookup fails, the run's first
    /// GET gets the error (as it would have met it first) and the rest are tried again.
    pub fn execute_gets(&mut self, mut cmds: &[Command], out: &mut Vec<u8>) {
        while !cmds.is_empty() {
            let started = Instant::now();
            let keys: Vec<&[u8]> = cmds.iter().map(|c| c.arg(1)).collect();
            let looked_up = self.store.get_in_order(&keys).map_err(Failure::from).and_then(|values| {
                if values.len() == keys.len() {
                    Ok(values)
                } else {
                    Err(fail(format!("ERR storage returned {} values for {} keys", values.len(), keys.len())))
                }
            });
            match looked_up {
                Ok(values) => {
                    let seconds = started.elapsed().as_secs_f64() / cmds.len() as f64;
                    for value in values {
                        let reply = value.map_or(Reply::Nil, Reply::Bulk);
                        self.record(*GET_INDEX, seconds, &reply);
                        reply.encode(out);
                    }
                    return;
                }
                Err(failure) => {
                    let reply = reply_for(&COMMANDS[*GET_INDEX], Err(failure));
                    self.record(*GET_INDEX, started.elapsed().as_secs_f64(), &reply);
                    reply.encode(out);
                    cmds = &cmds[1..];
                }
            }
        }
    }

    /// Executes one command and returns its reply; records metrics and stats.
    pub fn execute(&mut self, cmd: &Command) -> Reply {
        let started = Instant::now();
        let Some(name) = cmd.get(0) else {
            return Reply::error("ERR empty command");
        };
        let (metrics_index, reply) = match lookup(name) {
            None => (COMMANDS.len(), unknown_command(cmd)),
            Some((index, spec)) if !spec.arity_ok(cmd.len()) => (index, arity_error(spec.name)),
            Some((index, spec)) => (index, reply_for(spec, (spec.handler)(self, cmd))),
        };
        self.record(metrics_index, started.elapsed().as_secs_f64(), &reply);
        reply
    }

    /// Counts one executed command: its time, its outcome, the server's command total.
    fn record(&self, metrics_index: usize, seconds: f64, reply: &Reply) {
        let metrics = &COMMAND_METRICS[metrics_index];
        metrics.seconds.observe(seconds);
        if reply.is_error() { &metrics.error } else { &metrics.ok }.inc();
        self.stats.command_done();
    }
}

/// The reply to a handler's outcome; storage errors are counted by kind.
fn reply_for(spec: &CommandSpec, outcome: CmdResult) -> Reply {
    match outcome {
        Ok(reply) => reply,
        Err(Failure::Reply(message)) => Reply::Error(message),
        Err(Failure::Store(e)) => {
            tracing::debug!("redis: {} failed in storage: {e}", spec.name);
            METRICS.store_errors.with_label_values(&[e.kind.as_str()]).inc();
            Reply::Error(e.to_resp_error().into())
        }
    }
}

/// `ERR wrong number of arguments for 'get' command` (Redis 7 wording; `name` may be
/// `container|sub`).
pub(crate) fn arity_error(name: &str) -> Reply {
    Reply::Error(format!("ERR wrong number of arguments for '{name}' command").into())
}

/// At most `max` bytes of `text`, cut at a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Redis' reply to an unknown command, byte for byte: the name and up to 128 bytes of
/// quoted arguments, each followed by a space.
fn unknown_command(cmd: &Command) -> Reply {
    const MAX_BYTES: usize = 128;
    let name = String::from_utf8_lossy(cmd.arg(0));
    let mut args = String::new();
    for arg in cmd.args().skip(1) {
        if args.len() >= MAX_BYTES {
            break;
        }
        let room = MAX_BYTES - args.len();
        args.push('\'');
        args.push_str(truncated(&String::from_utf8_lossy(arg), room));
        args.push_str("' ");
    }
    Reply::Error(
        format!("ERR unknown command '{}', with args beginning with: {args}", truncated(&name, MAX_BYTES)).into(),
    )
}

/// `ERR <WHAT> subcommand 'X' is not supported by racekv`.
fn unsupported_subcommand(container: &str, sub: &[u8]) -> Failure {
    fail(format!(
        "ERR {container} subcommand '{}' is not supported by racekv",
        String::from_utf8_lossy(sub).to_ascii_uppercase()
    ))
}

#[cfg(test)]
mod tests;
