//! The command layer: a table of supported commands and a per-connection [`Client`] that
//! executes parsed [`Command`]s against its storage session and returns [`Reply`]s.
//!
//! It does no I/O of its own, so it is unit tested directly against `MemStore`.
//! Command names are case-insensitive; arity and error messages follow Redis 7.0 so that
//! clients (and people) see familiar errors.

mod access;
mod admin;
mod expiry;
mod introspection;
mod keys;
mod keyspace;
mod multikey;
mod strings;
mod tally;
mod transactions;

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use super::clients::ClientHandle;
use super::info::{Outcome, ServerStats};
use super::metrics::{CommandMetrics, METRICS};
use super::reply::{Output, Protocol, Reply};
use super::resp::Command;
use super::store::{KvSession, KvStore, StoreError};
use super::txn_session::TxnSession;
use crate::acl::{Acl, AuthFailure, Catalog, Categories, CommandId, Denial, KeyAccess, User};
use racekv_telemetry::ratelimit::{limited_warn, RateLimit};

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

/// Where a command's keys are (Redis' first key, last key (negative: from the end), step)
/// and how it touches them, for `COMMAND` and ACL key patterns.
#[derive(Clone, Copy)]
pub(crate) struct Keys {
    pub first: i32,
    pub last: i32,
    pub step: i32,
    pub access: KeyAccess,
}

/// One entry of the command table; also what `COMMAND` reports.
pub(crate) struct CommandSpec {
    /// Lower case, as Redis reports names.
    pub name: &'static str,
    /// Redis convention: `n > 0` exactly n arguments (name included), `n < 0` at least -n.
    pub arity: i32,
    pub flags: &'static [&'static str],
    /// ACL categories (Redis 7's for the command).
    pub categories: Categories,
    pub keys: Keys,
    /// For a container (`CONFIG`, `CLIENT`, ...), the subcommands ACL rules can name.
    pub subcommands: &'static [Subcommand],
    /// For a command whose key access depends on its arguments (Redis' `VARIABLE_FLAGS`):
    /// the access of this invocation.
    pub variable_access: Option<fn(&Command) -> KeyAccess>,
    handler: Handler,
}

/// A subcommand of a container command, as ACL rules and `COMMAND INFO` see it.
pub(crate) struct Subcommand {
    /// Lower case, without the container (`get` for `config|get`).
    pub name: &'static str,
    pub arity: i32,
    pub categories: Categories,
}

/// Redis' arity rule: `n > 0` exactly n arguments (name included), `n < 0` at least -n.
fn arity_ok(arity: i32, argc: usize) -> bool {
    let (argc, arity) = (argc as i64, i64::from(arity));
    if arity >= 0 {
        argc == arity
    } else {
        argc >= -arity
    }
}

impl CommandSpec {
    fn arity_ok(&self, argc: usize) -> bool {
        arity_ok(self.arity, argc)
    }

    /// The keys of `cmd` (an invocation of this command), with their argument positions.
    fn keys_of<'c>(&self, cmd: &'c Command) -> impl Iterator<Item = (usize, &'c [u8], KeyAccess)> + 'c {
        let Keys { first, last, step, access } = self.keys;
        let access = self.variable_access.map_or(access, |of| of(cmd));
        let argc = cmd.len() as i64;
        let last = if last < 0 { argc + i64::from(last) } else { i64::from(last).min(argc - 1) };
        let (first, step) = (i64::from(first), i64::from(step.max(1)));
        // A command without keys has first = 0: an empty range.
        let positions = (first.max(1)..=if first > 0 { last } else { 0 }).step_by(step as usize);
        positions.map(move |i| (i as usize, cmd.arg(i as usize), access))
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.flags.contains(&flag)
    }
}

const fn spec(
    name: &'static str,
    arity: i32,
    flags: &'static [&'static str],
    categories: Categories,
    keys: Keys,
    handler: Handler,
) -> CommandSpec {
    CommandSpec { name, arity, flags, categories, keys, subcommands: &[], variable_access: None, handler }
}

/// `spec` whose key access depends on its arguments (`of` says which).
const fn variable_access(spec: CommandSpec, of: fn(&Command) -> KeyAccess) -> CommandSpec {
    CommandSpec { variable_access: Some(of), ..spec }
}

/// SET writes its key, and reads it too with `GET` (Redis' key spec: OW, or RW with GET).
fn set_key_access(cmd: &Command) -> KeyAccess {
    if cmd.args().skip(3).any(|a| a.eq_ignore_ascii_case(b"GET")) {
        KeyAccess::ReadWrite
    } else {
        KeyAccess::Write
    }
}

const fn container(
    name: &'static str,
    arity: i32,
    flags: &'static [&'static str],
    subcommands: &'static [Subcommand],
    handler: Handler,
) -> CommandSpec {
    CommandSpec { name, arity, flags, categories: SLOW, keys: NO_KEYS, subcommands, variable_access: None, handler }
}

/// A container whose subcommands take a key at argument 2 (`MEMORY USAGE key`, `OBJECT
/// ENCODING key`): ACL key patterns and `COMMAND GETKEYS` see it.
const fn container_with_key(
    name: &'static str,
    arity: i32,
    flags: &'static [&'static str],
    categories: Categories,
    subcommands: &'static [Subcommand],
    handler: Handler,
) -> CommandSpec {
    CommandSpec {
        name,
        arity,
        flags,
        categories,
        keys: key_spec(2, 2, 1, KeyAccess::Read),
        subcommands,
        variable_access: None,
        handler,
    }
}

const fn sub(name: &'static str, arity: i32, categories: Categories) -> Subcommand {
    Subcommand { name, arity, categories }
}

const fn key_spec(first: i32, last: i32, step: i32, access: KeyAccess) -> Keys {
    Keys { first, last, step, access }
}

const NO_KEYS: Keys = key_spec(0, 0, 0, KeyAccess::Read);
const READS_ONE: Keys = key_spec(1, 1, 1, KeyAccess::Read);
const WRITES_ONE: Keys = key_spec(1, 1, 1, KeyAccess::Write);
const UPDATES_ONE: Keys = key_spec(1, 1, 1, KeyAccess::ReadWrite);
const READS_ALL: Keys = key_spec(1, -1, 1, KeyAccess::Read);
const WRITES_ALL: Keys = key_spec(1, -1, 1, KeyAccess::Write);

const READ_STRING_FAST: Categories = Categories::READ.and(Categories::STRING).and(Categories::FAST);
const WRITE_STRING_FAST: Categories = Categories::WRITE.and(Categories::STRING).and(Categories::FAST);
const WRITE_STRING_SLOW: Categories = Categories::WRITE.and(Categories::STRING).and(Categories::SLOW);
const WRITE_KEYSPACE_FAST: Categories = Categories::KEYSPACE.and(Categories::WRITE).and(Categories::FAST);
const READ_KEYSPACE_FAST: Categories = Categories::KEYSPACE.and(Categories::READ).and(Categories::FAST);
const CONNECTION_FAST: Categories = Categories::FAST.and(Categories::CONNECTION);
const CONNECTION_SLOW: Categories = Categories::SLOW.and(Categories::CONNECTION);
const ADMIN: Categories = Categories::ADMIN.and(Categories::SLOW).and(Categories::DANGEROUS);
const SLOW: Categories = Categories::SLOW;
const READ_STRING_SLOW: Categories = Categories::READ.and(Categories::STRING).and(Categories::SLOW);
const ADMIN_CONNECTION: Categories = ADMIN.and(Categories::CONNECTION);
const KEYSPACE_READ_SLOW: Categories = Categories::KEYSPACE.and(Categories::READ).and(SLOW);
const KEYSPACE_READ_FAST: Categories = Categories::KEYSPACE.and(Categories::READ).and(Categories::FAST);
const KEYSPACE_WRITE_SLOW: Categories = Categories::KEYSPACE.and(Categories::WRITE).and(SLOW);
const KEYSPACE_WRITE_FAST: Categories = Categories::KEYSPACE.and(Categories::WRITE).and(Categories::FAST);
const FLUSHES: Categories = KEYSPACE_WRITE_SLOW.and(Categories::DANGEROUS);
const WRITES_TWO: Keys = key_spec(1, 2, 1, KeyAccess::Write);
const TRANSACTION_FAST: Categories = Categories::TRANSACTION.and(Categories::FAST);
const TRANSACTION_SLOW: Categories = Categories::TRANSACTION.and(SLOW);
const TXN_FLAGS: &[&str] = &["noscript", "loading", "stale", "fast", "allow_busy"];

/// Every command racekv answers. Anything else gets Redis' "unknown command" error.
pub(crate) static COMMANDS: &[CommandSpec] = &[
    spec("get", 2, &["readonly", "fast"], READ_STRING_FAST, READS_ONE, keys::get),
    variable_access(spec("set", -3, &["write", "denyoom"], WRITE_STRING_SLOW, WRITES_ONE, expiry::set), set_key_access),
    spec("setex", 4, &["write", "denyoom"], WRITE_STRING_SLOW, WRITES_ONE, expiry::setex),
    spec("psetex", 4, &["write", "denyoom"], WRITE_STRING_SLOW, WRITES_ONE, expiry::psetex),
    spec("getex", -2, &["write", "fast"], WRITE_STRING_FAST, UPDATES_ONE, expiry::getex),
    spec("expire", -3, &["write", "fast"], WRITE_KEYSPACE_FAST, WRITES_ONE, expiry::expire),
    spec("pexpire", -3, &["write", "fast"], WRITE_KEYSPACE_FAST, WRITES_ONE, expiry::pexpire),
    spec("expireat", -3, &["write", "fast"], WRITE_KEYSPACE_FAST, WRITES_ONE, expiry::expireat),
    spec("pexpireat", -3, &["write", "fast"], WRITE_KEYSPACE_FAST, WRITES_ONE, expiry::pexpireat),
    spec("persist", 2, &["write", "fast"], WRITE_KEYSPACE_FAST, WRITES_ONE, expiry::persist),
    spec("ttl", 2, &["readonly", "fast"], READ_KEYSPACE_FAST, READS_ONE, expiry::ttl),
    spec("pttl", 2, &["readonly", "fast"], READ_KEYSPACE_FAST, READS_ONE, expiry::pttl),
    spec("expiretime", 2, &["readonly", "fast"], READ_KEYSPACE_FAST, READS_ONE, expiry::expiretime),
    spec("pexpiretime", 2, &["readonly", "fast"], READ_KEYSPACE_FAST, READS_ONE, expiry::pexpiretime),
    spec("setnx", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, WRITES_ONE, keys::setnx),
    spec("del", -2, &["write"], Categories::KEYSPACE.and(Categories::WRITE).and(SLOW), WRITES_ALL, keys::del),
    spec(
        "exists",
        -2,
        &["readonly", "fast"],
        Categories::KEYSPACE.and(Categories::READ).and(Categories::FAST),
        READS_ALL,
        keys::exists,
    ),
    spec("mget", -2, &["readonly", "fast"], READ_STRING_FAST, READS_ALL, keys::mget),
    spec("mset", -3, &["write", "denyoom"], WRITE_STRING_SLOW, key_spec(1, -1, 2, KeyAccess::Write), multikey::mset),
    spec("incr", 2, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, keys::incr),
    spec("decr", 2, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, keys::decr),
    spec("incrby", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, keys::incrby),
    spec("decrby", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, keys::decrby),
    spec("append", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, WRITES_ONE, strings::append),
    spec("strlen", 2, &["readonly", "fast"], READ_STRING_FAST, READS_ONE, strings::strlen),
    spec("getrange", 4, &["readonly"], READ_STRING_SLOW, READS_ONE, strings::getrange),
    spec("substr", 4, &["readonly"], READ_STRING_SLOW, READS_ONE, strings::getrange),
    spec("setrange", 4, &["write", "denyoom"], WRITE_STRING_SLOW, WRITES_ONE, strings::setrange),
    spec("getdel", 2, &["write", "fast"], WRITE_STRING_FAST, UPDATES_ONE, strings::getdel),
    spec("getset", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, strings::getset),
    spec(
        "msetnx",
        -3,
        &["write", "denyoom"],
        WRITE_STRING_SLOW,
        key_spec(1, -1, 2, KeyAccess::Write),
        multikey::msetnx,
    ),
    spec("incrbyfloat", 3, &["write", "denyoom", "fast"], WRITE_STRING_FAST, UPDATES_ONE, strings::incrbyfloat),
    spec("lcs", -3, &["readonly"], READ_STRING_SLOW, key_spec(1, 2, 1, KeyAccess::Read), strings::lcs),
    spec(
        "dbsize",
        1,
        &["readonly", "fast"],
        Categories::KEYSPACE.and(Categories::READ).and(Categories::FAST),
        NO_KEYS,
        keys::dbsize,
    ),
    // The keyspace as a whole (keyspace.rs); flags and categories as Redis 7 reports them.
    spec("scan", -2, &["readonly"], KEYSPACE_READ_SLOW, NO_KEYS, keyspace::scan),
    spec("keys", 2, &["readonly"], KEYSPACE_READ_SLOW.and(Categories::DANGEROUS), NO_KEYS, keyspace::keys),
    spec("randomkey", 1, &["readonly"], KEYSPACE_READ_SLOW, NO_KEYS, keyspace::randomkey),
    spec("type", 2, &["readonly", "fast"], KEYSPACE_READ_FAST, READS_ONE, keyspace::type_of),
    spec("touch", -2, &["readonly", "fast"], KEYSPACE_READ_FAST, READS_ALL, keyspace::touch),
    spec("unlink", -2, &["write", "fast"], KEYSPACE_WRITE_FAST, WRITES_ALL, keyspace::unlink),
    spec("flushdb", -1, &["write"], FLUSHES, NO_KEYS, keyspace::flush),
    spec("flushall", -1, &["write"], FLUSHES, NO_KEYS, keyspace::flush),
    spec("rename", 3, &["write"], KEYSPACE_WRITE_SLOW, WRITES_TWO, multikey::rename),
    spec("renamenx", 3, &["write", "fast"], KEYSPACE_WRITE_FAST, WRITES_TWO, multikey::renamenx),
    spec("copy", -3, &["write", "denyoom"], KEYSPACE_WRITE_SLOW, WRITES_TWO, multikey::copy),
    spec("ping", -1, &["fast"], CONNECTION_FAST, NO_KEYS, admin::ping),
    spec("echo", 2, &["fast"], CONNECTION_FAST, NO_KEYS, admin::echo),
    spec("info", -1, &["loading", "stale"], SLOW.and(Categories::DANGEROUS), NO_KEYS, introspection::info),
    container(
        "command",
        -1,
        &["loading", "stale"],
        &[
            sub("count", 2, CONNECTION_SLOW),
            sub("docs", -2, CONNECTION_SLOW),
            sub("getkeys", -4, CONNECTION_SLOW),
            sub("help", 2, CONNECTION_SLOW),
            sub("info", -2, CONNECTION_SLOW),
            sub("list", -2, CONNECTION_SLOW),
        ],
        introspection::command,
    ),
    container(
        "client",
        -2,
        &["loading", "stale"],
        &[
            sub("id", 2, CONNECTION_SLOW),
            sub("getname", 2, CONNECTION_SLOW),
            sub("setname", 3, CONNECTION_SLOW),
            sub("setinfo", 4, CONNECTION_SLOW),
            sub("help", 2, CONNECTION_SLOW),
            sub("info", 2, CONNECTION_SLOW),
            sub("kill", -3, ADMIN_CONNECTION),
            sub("list", -2, ADMIN_CONNECTION),
            sub("no-evict", 3, ADMIN_CONNECTION),
            sub("no-touch", 3, CONNECTION_SLOW),
            sub("pause", -3, ADMIN_CONNECTION),
            sub("unpause", 2, ADMIN_CONNECTION),
        ],
        introspection::client,
    ),
    container(
        "config",
        -2,
        &["admin", "loading", "stale"],
        &[
            sub("get", -3, ADMIN),
            sub("help", 2, SLOW),
            sub("resetstat", 2, ADMIN),
            sub("rewrite", 2, ADMIN),
            sub("set", -4, ADMIN),
        ],
        introspection::config,
    ),
    container(
        "slowlog",
        -2,
        &["admin", "loading", "stale"],
        &[sub("get", -2, ADMIN), sub("help", 2, SLOW), sub("len", 2, ADMIN), sub("reset", 2, ADMIN)],
        introspection::slowlog,
    ),
    container(
        "latency",
        -2,
        &["admin", "loading", "stale"],
        &[sub("help", 2, SLOW), sub("history", 3, ADMIN), sub("latest", 2, ADMIN), sub("reset", -2, ADMIN)],
        introspection::latency,
    ),
    container_with_key(
        "memory",
        -2,
        &["readonly"],
        SLOW,
        &[sub("help", 2, SLOW), sub("usage", -3, Categories::READ.and(SLOW))],
        introspection::memory,
    ),
    container_with_key(
        "object",
        -2,
        &["readonly"],
        SLOW,
        &[
            sub("encoding", 3, KEYSPACE_READ_SLOW),
            sub("freq", 3, KEYSPACE_READ_SLOW),
            sub("help", 2, Categories::KEYSPACE.and(SLOW)),
            sub("idletime", 3, KEYSPACE_READ_SLOW),
            sub("refcount", 3, KEYSPACE_READ_SLOW),
        ],
        introspection::object,
    ),
    spec("time", 1, &["loading", "stale", "fast"], Categories::FAST, NO_KEYS, introspection::time),
    spec("lolwut", -1, &["readonly", "fast"], Categories::READ.and(Categories::FAST), NO_KEYS, introspection::lolwut),
    spec("hello", -1, &["fast", "loading", "stale", "no-auth"], CONNECTION_FAST, NO_KEYS, admin::hello),
    spec("auth", -2, &["fast", "loading", "stale", "no-auth"], CONNECTION_FAST, NO_KEYS, access::auth),
    container(
        "acl",
        -2,
        &["loading", "stale"],
        &[
            sub("cat", -2, SLOW),
            sub("deluser", -3, ADMIN),
            sub("dryrun", -4, ADMIN),
            sub("genpass", -2, SLOW),
            sub("getuser", 3, ADMIN),
            sub("list", 2, ADMIN),
            sub("load", 2, ADMIN),
            sub("save", 2, ADMIN),
            sub("setuser", -3, ADMIN),
            sub("users", 2, ADMIN),
            sub("whoami", 2, SLOW),
        ],
        access::acl,
    ),
    spec("select", 2, &["loading", "stale", "fast"], CONNECTION_FAST, NO_KEYS, admin::select),
    spec("quit", -1, &["fast", "loading", "stale", "no-auth"], CONNECTION_FAST, NO_KEYS, admin::quit),
    // Transactions (transactions.rs); flags and categories as Redis 7 reports them.
    spec("multi", 1, TXN_FLAGS, TRANSACTION_FAST, NO_KEYS, transactions::multi),
    spec("exec", 1, &["noscript", "loading", "stale", "skip_slowlog"], TRANSACTION_SLOW, NO_KEYS, transactions::exec),
    spec("discard", 1, TXN_FLAGS, TRANSACTION_FAST, NO_KEYS, transactions::discard),
    spec("watch", -2, TXN_FLAGS, TRANSACTION_FAST, READS_ALL, transactions::watch),
    spec("unwatch", 1, TXN_FLAGS, TRANSACTION_FAST, NO_KEYS, transactions::unwatch),
];

/// The ACL ids of the table: per command, its id and its subcommands' ids in order.
struct Ids {
    catalog: Arc<Catalog>,
    commands: Vec<(CommandId, Vec<CommandId>)>,
}

static IDS: LazyLock<Ids> = LazyLock::new(|| {
    let mut catalog = Catalog::new();
    let commands = COMMANDS
        .iter()
        .map(|c| {
            let id = catalog.add(c.name, c.categories, None);
            (id, c.subcommands.iter().map(|s| catalog.add(s.name, s.categories, Some(id))).collect())
        })
        .collect();
    Ids { catalog: Arc::new(catalog), commands }
});

/// Every command and subcommand of the table, for ACL rules ([`Acl::new`]).
pub fn catalog() -> Arc<Catalog> {
    Arc::clone(&IDS.catalog)
}

/// The ACL id `cmd` runs as, and its subcommand when it names a known one (else the id is
/// the command's).
fn acl_id(index: usize, spec: &CommandSpec, cmd: &Command) -> (CommandId, Option<&'static Subcommand>) {
    let (id, subs) = &IDS.commands[index];
    let found = cmd
        .get(1)
        .and_then(|name| COMMANDS[index].subcommands.iter().position(|s| s.name.as_bytes().eq_ignore_ascii_case(name)));
    debug_assert!(std::ptr::eq(spec, &COMMANDS[index]));
    match found {
        Some(i) => (subs[i], Some(&COMMANDS[index].subcommands[i])),
        None => (*id, None),
    }
}

/// Failed AUTH attempts are logged at most this often.
static AUTH_FAILURE_LOG: RateLimit = RateLimit::per_minute();

/// Per-command series, in table order, then one for unknown commands.
static COMMAND_METRICS: LazyLock<Vec<CommandMetrics>> = LazyLock::new(|| {
    COMMANDS.iter().map(|c| CommandMetrics::new(c.name)).chain([CommandMetrics::new("unknown")]).collect()
});

static GET_INDEX: LazyLock<usize> = LazyLock::new(|| lookup(b"get").expect("GET is in the table").0);
static SET_INDEX: LazyLock<usize> = LazyLock::new(|| lookup(b"set").expect("SET is in the table").0);

/// The table entry for `name` (case-insensitive) and its index.
pub(crate) fn lookup(name: &[u8]) -> Option<(usize, &'static CommandSpec)> {
    COMMANDS.iter().enumerate().find(|(_, c)| c.name.as_bytes().eq_ignore_ascii_case(name))
}

/// The state of one client connection: its storage session, who it is, what it set.
pub struct Client {
    id: u64,
    /// Where the storage session comes from.
    kv: Arc<dyn KvStore>,
    /// The storage session, taken at the first command that needs storage: an idle or
    /// unauthenticated connection holds none (a session holds heap space in the memnodes).
    session: Option<Box<dyn KvSession>>,
    stats: Arc<ServerStats>,
    acl: Arc<Acl>,
    /// Who the connection is; `None` until it authenticates (the default user has a
    /// password).
    user: Option<Arc<User>>,
    /// The ACL generation `user` was looked up at.
    acl_generation: u64,
    /// `user` was deleted: every command is refused until the connection closes.
    user_deleted: bool,
    name: Option<Vec<u8>>,
    /// What the client library announced with `CLIENT SETINFO`.
    lib_name: Option<Vec<u8>>,
    lib_ver: Option<Vec<u8>>,
    /// RESP2 until `HELLO 3`.
    protocol: Protocol,
    closing: bool,
    /// Pipelined GETs waiting to run together ([`Client::queue_get`]).
    queued_gets: Vec<Command>,
    /// Figures of the commands run since the last publish (see `tally.rs`).
    tally: tally::Tally,
    /// This connection in the server's registry (`CLIENT LIST`, `CLIENT KILL`).
    handle: Arc<ClientHandle>,
    /// A command held by `CLIENT PAUSE`, run first once the pause ends.
    postponed: Option<Command>,
    /// The commands queued since MULTI; `None` outside a transaction.
    multi: Option<transactions::Queue>,
    /// The keys WATCHed and their versions then.
    watched: transactions::Watched,
    /// While EXEC runs its queue: the transaction's view of the store, which
    /// [`Client::store`] hands out instead of the session (that it holds).
    txn: Option<TxnSession<Box<dyn KvSession>>>,
}

impl Client {
    /// A client numbered `id` (unique per server, as `CLIENT ID` reports) over `kv`,
    /// authenticated as `default` if that user needs no password.
    pub fn new(id: u64, kv: Arc<dyn KvStore>, stats: Arc<ServerStats>, acl: Arc<Acl>) -> Self {
        let acl_generation = acl.generation();
        let user = acl.initial_user();
        let handle = stats.clients.register(id);
        Self {
            id,
            kv,
            session: None,
            stats,
            acl,
            user,
            acl_generation,
            user_deleted: false,
            name: None,
            lib_name: None,
            lib_ver: None,
            protocol: Protocol::Resp2,
            closing: false,
            queued_gets: Vec::new(),
            tally: tally::Tally::default(),
            handle,
            postponed: None,
            multi: None,
            watched: transactions::Watched::default(),
            txn: None,
        }
    }

    /// The number `CLIENT ID` reports.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The name set by `CLIENT SETNAME` or `HELLO ... SETNAME`.
    pub fn name(&self) -> Option<&[u8]> {
        self.name.as_deref()
    }

    /// The protocol replies are encoded in.
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// The user the connection is authenticated as, if any.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref().map(User::name)
    }

    /// The client library's name and version, as announced by `CLIENT SETINFO`.
    pub fn library(&self) -> (Option<&[u8]>, Option<&[u8]>) {
        (self.lib_name.as_deref(), self.lib_ver.as_deref())
    }

    /// Everything sent so far is answered: let the storage do deferred work.
    pub fn idle(&mut self) {
        if let Some(session) = &mut self.session {
            session.idle();
        }
    }

    /// The storage session, taken now if this is the first command that needs one.
    fn store(&mut self) -> Result<&mut dyn KvSession, StoreError> {
        if let Some(txn) = &mut self.txn {
            return Ok(txn);
        }
        if self.session.is_none() {
            self.session = Some(self.kv.session()?);
        }
        Ok(self.session.as_deref_mut().expect("just set"))
    }

    /// Whether the connection should close once the replies so far are written (`QUIT`, or
    /// its user was deleted).
    pub fn wants_close(&self) -> bool {
        self.closing
    }

    /// Whether `cmd` is a well-formed `GET key` (what [`Client::execute_gets`] takes).
    pub fn is_get(cmd: &Command) -> bool {
        let get = &COMMANDS[*GET_INDEX];
        get.arity_ok(cmd.len()) && cmd.get(0).is_some_and(|name| name.eq_ignore_ascii_case(get.name.as_bytes()))
    }

    /// Whether `cmd` is a GET ([`Client::is_get`]) this connection may run, so it can join
    /// a run of GETs ([`Client::queue_get`]); a GET it may not run goes through
    /// [`Client::execute`], which answers why.
    pub fn may_batch_get(&mut self, cmd: &Command) -> bool {
        !self.in_multi() && Self::is_get(cmd) && self.authorize(*GET_INDEX, &COMMANDS[*GET_INDEX], cmd).is_ok()
    }

    /// Checks that the connection may run `cmd` (entry `index` of the table): authenticated
    /// (or a `no-auth` command), the command allowed, its keys allowed. The error is the
    /// reply.
    fn authorize(&mut self, index: usize, spec: &CommandSpec, cmd: &Command) -> Result<(), Reply> {
        if self.acl_generation != self.acl.generation() || self.user_deleted {
            self.refresh_user()?;
        }
        let Some(user) = &self.user else {
            if spec.has_flag("no-auth") {
                return Ok(());
            }
            METRICS.acl_denied.with_label_values(&["noauth"]).inc();
            return Err(Reply::error("NOAUTH Authentication required."));
        };
        let (id, subcommand) = acl_id(index, spec, cmd);
        if let Some(sub) = subcommand.filter(|s| !arity_ok(s.arity, cmd.len())) {
            return Err(arity_error(&format!("{}|{}", spec.name, sub.name)));
        }
        match user.check(id, spec.keys_of(cmd)) {
            Ok(()) => Ok(()),
            Err(Denial::Command) => {
                METRICS.acl_denied.with_label_values(&["command"]).inc();
                Err(Reply::error(format!(
                    "NOPERM User {} has no permissions to run the '{}' command",
                    user.name(),
                    self.acl.catalog().entry(id).name
                )))
            }
            Err(Denial::Key(_)) => {
                METRICS.acl_denied.with_label_values(&["key"]).inc();
                Err(Reply::error("NOPERM No permissions to access a key"))
            }
        }
    }

    /// Looks the connection's user up again after an ACL change; a deleted user's
    /// connection is closed (as Redis kills it).
    fn refresh_user(&mut self) -> Result<(), Reply> {
        self.acl_generation = self.acl.generation();
        if let Some(user) = &self.user {
            self.user = self.acl.user(user.name());
            self.user_deleted = self.user.is_none();
        }
        if self.user_deleted {
            self.closing = true;
            return Err(Reply::error("ERR the user of this connection was deleted; closing the connection"));
        }
        Ok(())
    }

    /// Authenticates the connection as `username` (`None`: `default`) with `password`.
    fn authenticate(&mut self, username: Option<&[u8]>, password: &[u8]) -> Result<(), Failure> {
        match self.acl.authenticate(username, password) {
            Ok(user) => {
                self.acl_generation = self.acl.generation();
                self.user = Some(user);
                Ok(())
            }
            Err(AuthFailure::NoDefaultPassword) => Err(fail(
                "ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?",
            )),
            Err(AuthFailure::WrongPass) => {
                METRICS.auth_failures.inc();
                limited_warn(&AUTH_FAILURE_LOG, || {
                    format!("redis client {}: failed authentication (further failures logged at most once a minute)", self.id)
                });
                Err(fail("WRONGPASS invalid username-password pair or user is disabled."))
            }
        }
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
    pub fn run_queued_gets(&mut self, out: &mut Output, mut recycle: impl FnMut(Command)) {
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
    pub fn execute_gets(&mut self, mut cmds: &[Command], out: &mut Output) {
        while !cmds.is_empty() {
            let started = Instant::now();
            let keys: Vec<&[u8]> = cmds.iter().map(|c| c.arg(1)).collect();
            let looked_up =
                self.store().and_then(|s| s.get_in_order(&keys)).map_err(Failure::from).and_then(|values| {
                    if values.len() == keys.len() {
                        Ok(values)
                    } else {
                        Err(fail(format!("ERR storage returned {} values for {} keys", values.len(), keys.len())))
                    }
                });
            match looked_up {
                Ok(values) => {
                    let each = started.elapsed() / cmds.len() as u32;
                    for (value, cmd) in values.into_iter().zip(cmds) {
                        let reply = value.map_or(Reply::Nil, Reply::Bulk);
                        self.record(*GET_INDEX, each.as_secs_f64(), &reply);
                        self.account(*GET_INDEX, cmd, &reply, Outcome::Ok, started, each);
                        out.push(reply, self.protocol);
                    }
                    return;
                }
                Err(failure) => {
                    let reply = reply_for(&COMMANDS[*GET_INDEX], Err(failure));
                    let elapsed = started.elapsed();
                    self.record(*GET_INDEX, elapsed.as_secs_f64(), &reply);
                    self.account(*GET_INDEX, &cmds[0], &reply, Outcome::Failed, started, elapsed);
                    out.push(reply, self.protocol);
                    cmds = &cmds[1..];
                }
            }
        }
    }

    /// Executes one command and returns its reply; records metrics and stats.
    pub fn execute(&mut self, cmd: &Command) -> Reply {
        self.execute_from(cmd, Instant::now()).0
    }

    /// [`Client::execute`] timed from `started` (a pipeline's commands chain: one's end is
    /// the next one's start, one clock read each); returns the reply and when it ended.
    pub fn execute_from(&mut self, cmd: &Command, started: Instant) -> (Reply, Instant) {
        let Some(name) = cmd.get(0) else {
            return (Reply::error("ERR empty command"), Instant::now());
        };
        let found = lookup(name);
        if !found.is_some_and(|(index, _)| index == *GET_INDEX || index == *SET_INDEX) {
            // What reads the shared figures (INFO) must count every command before it.
            self.publish_tally();
        }
        let (metrics_index, reply, outcome) = match found {
            None => (COMMANDS.len(), unknown_command(cmd), Outcome::Rejected),
            Some((index, spec)) if !spec.arity_ok(cmd.len()) => (index, arity_error(spec.name), Outcome::Rejected),
            Some((index, spec)) => match self.authorize(index, spec, cmd) {
                Ok(()) if self.in_multi() && !transactions::runs_in_multi(spec.name) => {
                    // Queued: it counts as a command when EXEC runs it.
                    let reply = self.queue_in_multi(spec, cmd);
                    let (CommandId(id), _) = acl_id(index, spec, cmd);
                    self.handle.touch(self.stats.clients.epoch(), started, id);
                    return (reply, Instant::now());
                }
                Ok(()) => {
                    let reply = reply_for(spec, (spec.handler)(self, cmd));
                    let outcome = if reply.is_error() { Outcome::Failed } else { Outcome::Ok };
                    (index, reply, outcome)
                }
                Err(denied) => (index, denied, Outcome::Rejected),
            },
        };
        if outcome == Outcome::Rejected {
            self.flag_transaction();
        }
        let ended = Instant::now();
        let elapsed = ended.saturating_duration_since(started);
        self.record(metrics_index, elapsed.as_secs_f64(), &reply);
        self.account(metrics_index, cmd, &reply, outcome, started, elapsed);
        (reply, ended)
    }

    /// Counts one executed command: its time, its outcome, the server's command total.
    fn record(&mut self, metrics_index: usize, seconds: f64, reply: &Reply) {
        self.tally.record(&COMMAND_METRICS, metrics_index, seconds, reply.is_error());
    }

    /// Adds the figures of the commands run since the last call to the server's (metrics,
    /// `INFO`): at the end of each pipeline, before any command but GET and SET runs, and
    /// when the connection closes.
    pub fn publish_tally(&mut self) {
        self.tally.publish(&self.stats, &COMMAND_METRICS);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.publish_tally();
        if self.postponed.is_some() {
            self.stats.clients.pause.set_held(false);
        }
        self.unwatch_all();
        self.stats.clients.unregister(&self.handle);
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

/// Redis' reply to a subcommand it does not have (racekv answers it for the ones it does
/// not support): `ERR unknown subcommand 'x'. Try CLIENT HELP.`
fn unsupported_subcommand(container: &str, sub: &[u8]) -> Failure {
    fail(format!("ERR unknown subcommand '{}'. Try {container} HELP.", truncated(&String::from_utf8_lossy(sub), 128)))
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod txn_tests;
