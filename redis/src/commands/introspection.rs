//! Introspection that tools read: INFO, CLIENT LIST/INFO/KILL/NO-EVICT/NO-TOUCH/PAUSE/UNPAUSE,
//! CONFIG GET/SET/RESETSTAT, SLOWLOG, LATENCY, COMMAND GETKEYS/DOCS, MEMORY USAGE, OBJECT,
//! TIME, LOLWUT; and the per-command accounting behind them ([`Client::account`]).
//!
//! Replies have Redis 7's shapes in both protocols: `INFO`, `CLIENT INFO` and `CLIENT LIST`
//! are verbatim text, `CONFIG GET`, `COMMAND DOCS` and `LCS IDX` maps.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use super::{acl_id, admin, catalog, fail, lookup, unsupported_subcommand, Client, CmdResult, Failure, COMMANDS};
use crate::acl::{CommandId, DEFAULT_USER};
use crate::clients::{ClientHandle, MAX_CLIENT_PAUSE};
use crate::info::{self, InfoSource, Outcome, REDIS_COMPAT_VERSION};
use crate::metrics::METRICS;
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::settings::{self, Value, PARAMETERS};
use crate::slowlog::{logged_args, SlowEntry};
use crate::store::StoreError;

/// What `account` learns from a command's reply besides its outcome.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watch {
    Nothing,
    /// GET: a bulk reply is a hit, nil a miss.
    Get,
    /// MGET: per element.
    Mget,
    /// EXISTS: the count is the hits, the other keys misses.
    Exists,
    /// CLIENT, HELLO, AUTH, ACL: may change the name, library, user or protocol that
    /// `CLIENT LIST` shows.
    Identity,
}

/// Per table entry, what its reply tells `account`.
static WATCH: LazyLock<Vec<Watch>> = LazyLock::new(|| {
    COMMANDS
        .iter()
        .map(|c| match c.name {
            "get" => Watch::Get,
            "mget" => Watch::Mget,
            "exists" => Watch::Exists,
            "client" | "hello" | "auth" | "acl" => Watch::Identity,
            _ => Watch::Nothing,
        })
        .collect()
});

impl Client {
    /// Accounts for one command (entry `index` of the table, or past its end for an unknown
    /// command) that `started` and took `elapsed`: commandstats, errorstats, keyspace hits
    /// and misses of GET/MGET/EXISTS, the connection's last command, the slow log and the
    /// latency monitor. A few relaxed atomics unless the command was slow or failed.
    pub(super) fn account(
        &mut self,
        index: usize,
        cmd: &Command,
        reply: &Reply,
        outcome: Outcome,
        started: Instant,
        elapsed: Duration,
    ) {
        if let Reply::Error(message) = reply {
            self.stats.error_reply(message);
        }
        let Some(spec) = COMMANDS.get(index) else { return };
        let (CommandId(id), _) = acl_id(index, spec, cmd);
        let micros = elapsed.as_micros() as u64;
        if self.tally.command_stat(id, micros, outcome) {
            self.publish_tally();
        }
        self.handle.touch(self.stats.clients.epoch(), started, id);
        if outcome == Outcome::Rejected {
            return;
        }
        match WATCH[index] {
            Watch::Nothing => {}
            Watch::Get => match reply {
                Reply::Bulk(_) => self.tally.lookup(true),
                Reply::Nil => self.tally.lookup(false),
                _ => {}
            },
            Watch::Mget => {
                if let Reply::Array(values) = reply {
                    for value in values {
                        self.tally.lookup(!matches!(value, Reply::Nil));
                    }
                }
            }
            Watch::Exists => {
                if let Reply::Integer(found) = reply {
                    let looked_up = cmd.len() - 1;
                    for i in 0..looked_up {
                        self.tally.lookup((i as i64) < *found);
                    }
                }
            }
            Watch::Identity => self.sync_identity(),
        }
        let slower_than = self.stats.settings.slowlog_slower_than_us();
        if slower_than >= 0 && micros >= slower_than as u64 {
            METRICS.slow_commands.inc();
            let (peer, name) = {
                let meta = self.handle.meta();
                (meta.addr.map(|a| a.to_string()).unwrap_or_default(), meta.name.clone().unwrap_or_default())
            };
            self.stats.slowlog.push(self.stats.settings.slowlog_max_len(), micros, logged_args(cmd), peer, name);
        }
        let threshold_ms = self.stats.settings.latency_threshold_ms();
        let ms = elapsed.as_millis() as u64;
        if threshold_ms > 0 && ms >= threshold_ms {
            self.stats.latency.add(if spec.has_flag("fast") { "fast-command" } else { "command" }, ms);
        }
    }

    /// Copies what `CLIENT LIST` shows of this connection into its registry entry.
    fn sync_identity(&self) {
        let mut meta = self.handle.meta();
        meta.name.clone_from(&self.name);
        meta.lib_name.clone_from(&self.lib_name);
        meta.lib_ver.clone_from(&self.lib_ver);
        meta.user = self.user().unwrap_or(DEFAULT_USER).to_string();
        meta.resp = self.protocol.version();
    }

    /// Tells the registry where the connection is (for `CLIENT LIST` and `CLIENT KILL ADDR`).
    pub(crate) fn set_connection(
        &self,
        addr: Option<std::net::SocketAddr>,
        laddr: Option<std::net::SocketAddr>,
        fd: i64,
    ) {
        let mut meta = self.handle.meta();
        meta.addr = addr;
        meta.laddr = laddr;
        meta.fd = fd;
    }

    /// Whether `CLIENT KILL` chose this connection: its server closes it.
    pub fn killed(&self) -> bool {
        self.handle.killed()
    }

    /// Until when `cmd` must wait for a `CLIENT PAUSE` (`None`: it may run now).
    pub(crate) fn pause_holds(&self, cmd: &Command) -> Option<Instant> {
        self.stats.clients.pause.holds(self.id, || {
            cmd.get(0).and_then(lookup).is_some_and(|(_, spec)| {
                // EXEC writes what its queue writes (Redis pauses it as a write then).
                spec.has_flag("write") || (spec.name == "exec" && self.multi_writes())
            })
        })
    }

    /// Keeps a command a pause holds, to run first when the connection is served again
    /// (`first`: it was not held before, so it starts counting as held).
    pub(crate) fn postpone(&mut self, cmd: Command, first: bool) {
        debug_assert!(self.postponed.is_none());
        if first {
            self.stats.clients.pause.set_held(true);
        }
        self.postponed = Some(cmd);
    }

    /// The command a pause held, if any; it counts as held until [`Client::resume`] or
    /// another [`Client::postpone`].
    pub(crate) fn take_postponed(&mut self) -> Option<Command> {
        self.postponed.take()
    }

    /// The held command taken by [`Client::take_postponed`] runs now.
    pub(crate) fn resume(&mut self) {
        self.stats.clients.pause.set_held(false);
    }

    /// Waits (a connection thread) until `deadline` or until the pause changes.
    pub(crate) fn wait_for_pause(&self, deadline: Instant) {
        self.stats.clients.pause.wait(deadline);
    }
}

/// The storage as `INFO` asks it.
struct Storage<'a>(&'a mut Client);

impl InfoSource for Storage<'_> {
    fn storage_lines(&mut self) -> Result<String, StoreError> {
        self.0.store()?.info()
    }

    fn key_count(&mut self) -> Result<u64, StoreError> {
        self.0.store()?.len()
    }

    fn keys_with_expiry(&mut self) -> Result<u64, StoreError> {
        // The table keeps no count of keys with a TTL (it would cost every expiring write
        // another FAA on a shared word); INFO keyspace says `expires=0` (README: differences).
        Ok(0)
    }
}

/// `INFO [section ...]`: verbatim text (`txt`) in RESP3, a bulk string in RESP2.
pub(super) fn info(c: &mut Client, cmd: &Command) -> CmdResult {
    let sections: Vec<&[u8]> = cmd.args().skip(1).collect();
    let stats = Arc::clone(&c.stats);
    let catalog = catalog();
    let names = |id: u16| catalog.entry(CommandId(id)).name.clone();
    let text = info::render(&stats, &sections, &names, &mut Storage(c))?;
    Ok(Reply::Verbatim("txt", text.into_bytes()))
}

/// A `HELP` reply: the lines as status replies, as Redis sends them.
fn help(lines: &[&'static str]) -> CmdResult {
    Ok(Reply::Array(lines.iter().map(|l| Reply::Status((*l).into())).collect()))
}

fn upper(arg: &[u8]) -> Vec<u8> {
    arg.to_ascii_uppercase()
}

// ---- CLIENT ----

/// `CLIENT LIST|INFO|KILL|NO-EVICT|NO-TOUCH|PAUSE|UNPAUSE|HELP`; the others
/// (`ID|GETNAME|SETNAME|SETINFO`) are [`admin::client`]'s.
pub(super) fn client(c: &mut Client, cmd: &Command) -> CmdResult {
    // As in Redis, a connection's `cmd=` is the command it runs now: this one.
    if let Some((index, spec)) = lookup(b"client") {
        let (CommandId(id), _) = acl_id(index, spec, cmd);
        c.handle.touch(c.stats.clients.epoch(), Instant::now(), id);
    }
    match upper(cmd.arg(1)).as_slice() {
        b"LIST" => client_list(c, cmd),
        b"INFO" => Ok(Reply::Verbatim("txt", client_line(c, &c.handle).into_bytes())),
        b"KILL" => client_kill(c, cmd),
        b"NO-EVICT" => client_flag(c, cmd, |meta, on| meta.no_evict = on),
        b"NO-TOUCH" => client_flag(c, cmd, |meta, on| meta.no_touch = on),
        b"PAUSE" => client_pause(c, cmd),
        b"UNPAUSE" => {
            c.stats.clients.pause.stop();
            Ok(Reply::ok())
        }
        b"HELP" => help(&[
            "CLIENT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "GETNAME",
            "    Return the name of the current connection.",
            "ID",
            "    Return the ID of the current connection.",
            "INFO",
            "    Return information about the current client connection.",
            "KILL <ip:port>",
            "    Kill connection made from <ip:port>.",
            "KILL <option> <value> [<option> <value> [...]]",
            "    Kill connections. Options are: ID <client-id>, TYPE normal|master|replica|pubsub,",
            "    USER <username>, ADDR <ip:port>, LADDR <ip:port>, SKIPME (YES|NO).",
            "LIST [options ...]",
            "    Return information about client connections. Options: TYPE (NORMAL|MASTER|REPLICA|PUBSUB),",
            "    ID id [id ...].",
            "NO-EVICT (ON|OFF)",
            "    Accepted and shown in CLIENT LIST; racekv never evicts clients.",
            "NO-TOUCH (ON|OFF)",
            "    Accepted and shown in CLIENT LIST; this connection's reads still update access data.",
            "PAUSE <timeout> [WRITE|ALL]",
            "    Suspend other clients' commands (or only writes) for <timeout> milliseconds.",
            "SETINFO <LIB-NAME|LIB-VER> <value>",
            "    Set the client library name or version.",
            "SETNAME <name>",
            "    Assign the name <name> to the current connection.",
            "UNPAUSE",
            "    Stop the current client pause, resuming traffic.",
            "HELP",
            "    Print this help.",
        ]),
        _ => admin::client(c, cmd),
    }
}

/// One `CLIENT LIST` line, Redis 7.2's fields in Redis' order. racekv does not track
/// buffers per connection: their fields are 0.
fn client_line(c: &Client, handle: &ClientHandle) -> String {
    let now = Instant::now();
    let (age, idle) = handle.age_and_idle(c.stats.clients.epoch(), now);
    let meta = handle.meta().clone();
    let text = |bytes: &Option<Vec<u8>>| bytes.as_deref().map(String::from_utf8_lossy).unwrap_or_default().into_owned();
    let addr = |a: Option<std::net::SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
    let (multi, multi_mem) = handle.multi();
    let mut flags = String::new();
    if multi >= 0 {
        flags.push('x');
    }
    if meta.no_evict {
        flags.push('e');
    }
    if meta.no_touch {
        flags.push('T');
    }
    if flags.is_empty() {
        flags.push('N');
    }
    let command =
        handle.last_command().map_or_else(|| "NULL".to_string(), |id| catalog().entry(CommandId(id)).name.clone());
    format!(
        "id={} addr={} laddr={} fd={} name={} age={age} idle={idle} flags={flags} db=0 sub=0 psub=0 ssub=0 multi={multi} \
         qbuf=0 qbuf-free=0 argv-mem=0 multi-mem={multi_mem} rbs=0 rbp=0 obl=0 oll=0 omem=0 tot-mem=0 events=r cmd={command} \
         user={} redir=-1 resp={} lib-name={} lib-ver={}\n",
        handle.id,
        addr(meta.addr),
        addr(meta.laddr),
        meta.fd,
        text(&meta.name),
        meta.user,
        meta.resp,
        text(&meta.lib_name),
        text(&meta.lib_ver),
    )
}

/// Redis' client types: racekv's connections are all `normal`. `Err` for an unknown name.
fn is_normal_type(name: &[u8]) -> Result<bool, Failure> {
    match name.to_ascii_lowercase().as_slice() {
        b"normal" => Ok(true),
        b"master" | b"slave" | b"replica" | b"pubsub" => Ok(false),
        _ => Err(fail(format!("ERR Unknown client type '{}'", String::from_utf8_lossy(name)))),
    }
}

/// `CLIENT LIST [TYPE type | ID id [id ...]]`.
fn client_list(c: &mut Client, cmd: &Command) -> CmdResult {
    let mut ids: Option<Vec<i64>> = None;
    let mut any = true;
    match (cmd.len(), cmd.get(2).map(upper).as_deref()) {
        (2, _) => {}
        (4, Some(b"TYPE")) => any = is_normal_type(cmd.arg(3))?,
        (n, Some(b"ID")) if n > 3 => {
            // Any integer is an id (one that names no connection matches none), as in Redis.
            let parsed: Option<Vec<i64>> = cmd.args().skip(3).map(parse_i64).collect();
            ids = Some(parsed.ok_or_else(|| fail("ERR Invalid client ID"))?);
        }
        _ => return Err(fail("ERR syntax error")),
    }
    let mut text = String::new();
    if any {
        for handle in c.stats.clients.all() {
            if ids.as_ref().is_none_or(|ids| ids.iter().any(|&id| id as u64 == handle.id)) {
                text.push_str(&client_line(c, &handle));
            }
        }
    }
    Ok(Reply::Verbatim("txt", text.into_bytes()))
}

/// What `CLIENT KILL` picks.
#[derive(Default)]
struct KillFilter {
    id: Option<u64>,
    normal: Option<bool>,
    user: Option<String>,
    addr: Option<Vec<u8>>,
    laddr: Option<Vec<u8>>,
    skip_me: bool,
}

impl KillFilter {
    fn matches(&self, handle: &ClientHandle) -> bool {
        let meta = handle.meta();
        let text = |a: Option<std::net::SocketAddr>| a.map(|a| a.to_string().into_bytes());
        self.id.is_none_or(|id| id == handle.id)
            && self.normal != Some(false)
            && self.user.as_ref().is_none_or(|u| *u == meta.user)
            && self.addr.as_ref().is_none_or(|a| Some(a) == text(meta.addr).as_ref())
            && self.laddr.as_ref().is_none_or(|a| Some(a) == text(meta.laddr).as_ref())
    }
}

/// `CLIENT KILL addr:port` (OK, or an error when none) or `CLIENT KILL filter value ...`
/// (how many were killed; the caller is skipped unless `SKIPME no`). A killed connection is
/// closed now (the caller's own, after this reply).
fn client_kill(c: &mut Client, cmd: &Command) -> CmdResult {
    let old_style = cmd.len() == 3;
    let mut filter = KillFilter { skip_me: !old_style, ..KillFilter::default() };
    if old_style {
        filter.addr = Some(cmd.arg(2).to_vec());
    } else {
        if !cmd.len().is_multiple_of(2) {
            return Err(fail("ERR syntax error"));
        }
        for pair in (2..cmd.len()).step_by(2) {
            let value = cmd.arg(pair + 1);
            match upper(cmd.arg(pair)).as_slice() {
                b"ID" => {
                    let id = parse_i64(value).filter(|&id| id > 0);
                    filter.id = Some(id.ok_or_else(|| fail("ERR client-id should be greater than 0"))? as u64);
                }
                b"TYPE" => filter.normal = Some(is_normal_type(value)?),
                b"USER" => {
                    let name = std::str::from_utf8(value).ok().filter(|n| c.acl.user(n).is_some());
                    let name =
                        name.ok_or_else(|| fail(format!("ERR No such user '{}'", String::from_utf8_lossy(value))))?;
                    filter.user = Some(name.to_string());
                }
                b"ADDR" => filter.addr = Some(value.to_vec()),
                b"LADDR" => filter.laddr = Some(value.to_vec()),
                b"SKIPME" => match upper(value).as_slice() {
                    b"YES" => filter.skip_me = true,
                    b"NO" => filter.skip_me = false,
                    _ => return Err(fail("ERR syntax error")),
                },
                _ => return Err(fail("ERR syntax error")),
            }
        }
    }
    let mut killed = 0;
    for handle in c.stats.clients.all() {
        if !filter.matches(&handle) {
            continue;
        }
        if handle.id == c.id {
            if filter.skip_me {
                continue;
            }
            c.stats.clients.kill(&handle, false);
            c.closing = true;
        } else {
            c.stats.clients.kill(&handle, true);
        }
        killed += 1;
    }
    if killed > 0 {
        tracing::info!("redis client {} killed {killed} connection(s) with CLIENT KILL", c.id);
    }
    match (old_style, killed) {
        (true, 0) => Err(fail("ERR No such client")),
        (true, _) => Ok(Reply::ok()),
        (false, n) => Ok(Reply::Integer(n)),
    }
}

/// `CLIENT NO-EVICT|NO-TOUCH ON|OFF`: remembered and shown; racekv neither evicts clients
/// nor keeps access times, so neither changes anything else.
fn client_flag(c: &mut Client, cmd: &Command, set: fn(&mut crate::clients::ClientMeta, bool)) -> CmdResult {
    let on = match upper(cmd.arg(2)).as_slice() {
        b"ON" => true,
        b"OFF" => false,
        _ => return Err(fail("ERR syntax error")),
    };
    set(&mut c.handle.meta(), on);
    Ok(Reply::ok())
}

/// `CLIENT PAUSE timeout [WRITE|ALL]`: other connections' commands (all, or those that
/// write) wait until the timeout (at most [`MAX_CLIENT_PAUSE`]) or `CLIENT UNPAUSE`. The
/// pausing connection itself is not held (so it can unpause).
fn client_pause(c: &mut Client, cmd: &Command) -> CmdResult {
    let all = match cmd.len() {
        3 => true,
        4 => match upper(cmd.arg(3)).as_slice() {
            b"WRITE" => false,
            b"ALL" => true,
            _ => return Err(fail("ERR CLIENT PAUSE mode must be WRITE or ALL")),
        },
        _ => return Err(fail("ERR syntax error")),
    };
    let ms = parse_i64(cmd.arg(2)).ok_or_else(|| fail("ERR timeout is not an integer or out of range"))?;
    if ms < 0 {
        return Err(fail("ERR timeout is negative"));
    }
    let duration = Duration::from_millis(ms as u64);
    if duration > MAX_CLIENT_PAUSE {
        return Err(fail(format!(
            "ERR racekv pauses clients for at most {} milliseconds",
            MAX_CLIENT_PAUSE.as_millis()
        )));
    }
    c.stats.clients.pause.start(duration, all, c.id);
    tracing::info!("redis client {} paused {} commands for {ms} ms", c.id, if all { "all" } else { "write" });
    Ok(Reply::ok())
}

// ---- CONFIG ----

/// `CONFIG GET|SET|RESETSTAT|REWRITE|HELP`.
pub(super) fn config(c: &mut Client, cmd: &Command) -> CmdResult {
    match upper(cmd.arg(1)).as_slice() {
        b"GET" => Ok(config_get(c, cmd)),
        b"SET" => config_set(c, cmd),
        b"RESETSTAT" => {
            c.stats.reset();
            Ok(Reply::ok())
        }
        // racekv's configuration is the computenode's file, which it does not rewrite.
        b"REWRITE" => Err(fail("ERR The server is running without a config file")),
        b"HELP" => help(&[
            "CONFIG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "GET <pattern>",
            "    Return parameters matching the glob-like <pattern> and their values.",
            "SET <directive> <value>",
            "    Set the configuration <directive> to <value>.",
            "RESETSTAT",
            "    Reset statistics reported by the INFO command.",
            "REWRITE",
            "    Not available: racekv's configuration is the computenode's file.",
            "HELP",
            "    Print this help.",
        ]),
        _ => Err(unsupported_subcommand("CONFIG", cmd.arg(1))),
    }
}

/// The value `CONFIG GET` shows for `name`.
fn config_value(c: &Client, name: &str) -> String {
    let settings = &c.stats.settings;
    let yes_no = |on: bool| if on { "yes" } else { "no" }.to_string();
    match name {
        "maxclients" => settings.max_clients().to_string(),
        "timeout" => settings.idle_timeout().map_or(0, |t| t.as_secs().max(1)).to_string(),
        "databases" => "1".into(),
        // No RDB snapshots or AOF: durability is the memory nodes' business.
        "save" => String::new(),
        "appendonly" => "no".into(),
        "slowlog-log-slower-than" => settings.slowlog_slower_than_us().to_string(),
        "slowlog-max-len" => settings.slowlog_max_len().to_string(),
        "latency-monitor-threshold" => settings.latency_threshold_ms().to_string(),
        // Redis shows the password; racekv only says whether there is one.
        "requirepass" => if c.acl.is_open() { "" } else { "(set; racekv does not show it)" }.into(),
        "protected-mode" => yes_no(settings.protected_mode()),
        "proto-max-bulk-len" => settings.proto_max_bulk_len().to_string(),
        "client-query-buffer-limit" => settings.client_query_buffer_limit().to_string(),
        "query-buffer-budget" => settings.query_budget().limit().to_string(),
        "maxmemory" => settings.maxmemory().limit().to_string(),
        "maxmemory-policy" => settings.maxmemory().policy().name().into(),
        "maxmemory-samples" => settings.maxmemory().samples().to_string(),
        "lfu-log-factor" => settings.maxmemory().lfu_log_factor().to_string(),
        "lfu-decay-time" => settings.maxmemory().lfu_decay_minutes().to_string(),
        "port" => c.stats.tcp_port().to_string(),
        "cluster-enabled" => "no".into(),
        _ => String::new(),
    }
}

/// `CONFIG GET pattern [pattern ...]`: a map in RESP3, pairs in RESP2.
fn config_get(c: &Client, cmd: &Command) -> Reply {
    let matching = PARAMETERS
        .iter()
        .filter(|p| cmd.args().skip(2).any(|pattern| crate::glob::glob_match(pattern, p.name.as_bytes(), true)));
    Reply::map(matching.map(|p| (p.name, Reply::Bulk(config_value(c, p.name).into_bytes()))))
}

/// `CONFIG SET parameter value [parameter value ...]`: every pair is checked before any is
/// applied, so a bad one changes nothing (as in Redis 7).
fn config_set(c: &mut Client, cmd: &Command) -> CmdResult {
    if cmd.len() < 4 || !cmd.len().is_multiple_of(2) {
        return Ok(super::arity_error("config|set"));
    }
    let mut changes: Vec<(&'static settings::Parameter, Value)> = Vec::new();
    for pair in (2..cmd.len()).step_by(2) {
        let name = cmd.arg(pair);
        let Some(p) = settings::parameter(name) else {
            return Err(fail(format!(
                "ERR Unknown option or number of arguments for CONFIG SET - '{}'",
                String::from_utf8_lossy(name)
            )));
        };
        let failed = |reason: &str| {
            fail(format!("ERR CONFIG SET failed (possibly related to argument '{}') - {reason}", p.name))
        };
        if changes.iter().any(|(q, _)| std::ptr::eq(*q, p)) {
            return Err(failed("duplicate parameter"));
        }
        let value = settings::validate(p, cmd.arg(pair + 1)).map_err(|reason| failed(&reason))?;
        changes.push((p, value));
    }
    for (p, value) in changes {
        match (p.name, &value) {
            ("requirepass", Value::Text(password)) => {
                let mut rule = b">".to_vec();
                rule.extend_from_slice(password);
                let rules: [&[u8]; 2] = [b"resetpass", if password.is_empty() { b"nopass" } else { &rule }];
                c.acl.set_user(DEFAULT_USER.as_bytes(), &rules).map_err(|e| {
                    fail(format!("ERR CONFIG SET failed (possibly related to argument 'requirepass') - {e}"))
                })?;
            }
            (name, value) => {
                c.stats.settings.apply(name, value);
                if name == "slowlog-max-len" {
                    c.stats.slowlog.trim(c.stats.settings.slowlog_max_len());
                }
            }
        }
        METRICS.config_changes.with_label_values(&[p.name]).inc();
        if p.name == "requirepass" {
            tracing::info!("redis client {} changed requirepass with CONFIG SET", c.id);
        } else {
            tracing::info!("redis client {} set {} to {}", c.id, p.name, config_value(c, p.name));
        }
    }
    Ok(Reply::ok())
}

// ---- COMMAND ----

/// `COMMAND GETKEYS|DOCS|HELP`; the others (`COUNT|INFO|LIST`, none) are [`admin::command`]'s.
pub(super) fn command(c: &mut Client, cmd: &Command) -> CmdResult {
    match cmd.get(1).map(upper).as_deref() {
        Some(b"GETKEYS") => getkeys(cmd),
        Some(b"DOCS") => Ok(docs(cmd)),
        Some(b"HELP") => help(&[
            "COMMAND <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "(no subcommand)",
            "    Return details about all commands.",
            "COUNT",
            "    Return the total number of commands.",
            "DOCS [<command-name> ...]",
            "    Return documentary information about commands (all when none is named).",
            "GETKEYS <full-command>",
            "    Return the keys from a full command.",
            "INFO [<command-name> ...]",
            "    Return details about the named commands (all when none is named).",
            "LIST",
            "    Return a list of all commands.",
            "HELP",
            "    Print this help.",
        ]),
        _ => admin::command(c, cmd),
    }
}

/// `COMMAND GETKEYS command [arg ...]`: the keys of a command line, from the table's key
/// positions.
fn getkeys(cmd: &Command) -> CmdResult {
    let tried = Command::from_args(cmd.args().skip(2));
    let Some((_, spec)) = lookup(tried.arg(0)) else {
        return Err(fail("ERR Invalid command specified"));
    };
    if !spec.arity_ok(tried.len()) {
        return Err(fail("ERR Invalid number of arguments specified for command"));
    }
    let keys: Vec<Reply> = spec.keys_of(&tried).map(|(_, key, _)| Reply::Bulk(key.to_vec())).collect();
    if keys.is_empty() {
        return Err(fail("ERR The command has no key arguments"));
    }
    Ok(Reply::Array(keys))
}

/// Redis' documentation of a command: summary, since, group, complexity.
struct Doc {
    name: &'static str,
    summary: &'static str,
    since: &'static str,
    group: &'static str,
    complexity: &'static str,
}

const fn doc(
    name: &'static str,
    summary: &'static str,
    since: &'static str,
    group: &'static str,
    complexity: &'static str,
) -> Doc {
    Doc { name, summary, since, group, complexity }
}

/// What `COMMAND DOCS` says of the commands it knows (Redis' texts).
static DOCS: &[Doc] = &[
    doc("get", "Returns the string value of a key.", "1.0.0", "string", "O(1)"),
    doc("set", "Sets the string value of a key, ignoring its type.", "1.0.0", "string", "O(1)"),
    doc("setnx", "Set the string value of a key only when the key doesn't exist.", "1.0.0", "string", "O(1)"),
    doc("del", "Deletes one or more keys.", "1.0.0", "generic", "O(N) where N is the number of keys"),
    doc(
        "exists",
        "Determines whether one or more keys exist.",
        "1.0.0",
        "generic",
        "O(N) where N is the number of keys",
    ),
    doc(
        "mget",
        "Atomically returns the string values of one or more keys.",
        "1.0.0",
        "string",
        "O(N) where N is the number of keys",
    ),
    doc(
        "mset",
        "Atomically creates or modifies the string values of one or more keys.",
        "1.0.1",
        "string",
        "O(N) where N is the number of keys",
    ),
    doc(
        "msetnx",
        "Atomically modifies the string values of one or more keys only when all keys don't exist.",
        "1.0.1",
        "string",
        "O(N) where N is the number of keys",
    ),
    doc("incr", "Increments the integer value of a key by one.", "1.0.0", "string", "O(1)"),
    doc("decr", "Decrements the integer value of a key by one.", "1.0.0", "string", "O(1)"),
    doc("incrby", "Increments the integer value of a key by a number.", "1.0.0", "string", "O(1)"),
    doc("decrby", "Decrements a number from the integer value of a key.", "1.0.0", "string", "O(1)"),
    doc("incrbyfloat", "Increment the floating point value of a key by a number.", "2.6.0", "string", "O(1)"),
    doc(
        "append",
        "Appends a string to the value of a key. Creates the key if it doesn't exist.",
        "2.0.0",
        "string",
        "O(1)",
    ),
    doc("strlen", "Returns the length of a string value.", "2.2.0", "string", "O(1)"),
    doc(
        "getrange",
        "Returns a substring of the string stored at a key.",
        "2.4.0",
        "string",
        "O(N) where N is the length of the returned string",
    ),
    doc(
        "substr",
        "Returns a substring from a string value.",
        "1.0.0",
        "string",
        "O(N) where N is the length of the returned string",
    ),
    doc(
        "setrange",
        "Overwrites a part of a string value with another by an offset. Creates the key if it doesn't exist.",
        "2.2.0",
        "string",
        "O(1)",
    ),
    doc("getdel", "Returns the string value of a key after deleting the key.", "6.2.0", "string", "O(1)"),
    doc(
        "getset",
        "Returns the previous string value of a key after setting it to a new value.",
        "1.0.0",
        "string",
        "O(1)",
    ),
    doc(
        "lcs",
        "Finds the longest common substring.",
        "7.0.0",
        "string",
        "O(N*M) where N and M are the lengths of s1 and s2",
    ),
    doc("dbsize", "Returns the number of keys in the database.", "1.0.0", "server", "O(1)"),
    doc("ping", "Returns the server's liveliness response.", "1.0.0", "connection", "O(1)"),
    doc("echo", "Returns the given string.", "1.0.0", "connection", "O(1)"),
    doc("info", "Returns information and statistics about the server.", "1.0.0", "server", "O(1)"),
    doc(
        "command",
        "Returns detailed information about all commands.",
        "2.8.13",
        "server",
        "O(N) where N is the total number of Redis commands",
    ),
    doc("client", "A container for client connection commands.", "2.4.0", "connection", "Depends on subcommand."),
    doc("config", "A container for server configuration commands.", "2.0.0", "server", "Depends on subcommand."),
    doc("hello", "Handshakes with the Redis server.", "6.0.0", "connection", "O(1)"),
    doc(
        "auth",
        "Authenticates the connection.",
        "1.0.0",
        "connection",
        "O(N) where N is the number of passwords defined for the user",
    ),
    doc("acl", "A container for Access List Control commands.", "6.0.0", "server", "Depends on subcommand."),
    doc("select", "Changes the selected database.", "1.0.0", "connection", "O(1)"),
    doc("quit", "Closes the connection.", "1.0.0", "connection", "O(1)"),
    doc("slowlog", "A container for slow log commands.", "2.2.12", "server", "Depends on subcommand."),
    doc("latency", "A container for latency diagnostics commands.", "2.8.13", "server", "Depends on subcommand."),
    doc("memory", "A container for memory diagnostics commands.", "4.0.0", "server", "Depends on subcommand."),
    doc("object", "A container for object introspection commands.", "2.2.3", "generic", "Depends on subcommand."),
    doc("time", "Returns the server time.", "2.6.0", "server", "O(1)"),
    doc("lolwut", "Displays computer art and the Redis version", "5.0.0", "server", ""),
];

/// `COMMAND DOCS [name ...]`: a map of command name to its documentation (all commands
/// when none is named; unknown names are left out). Commands without an entry in [`DOCS`]
/// get their group from their categories.
fn docs(cmd: &Command) -> Reply {
    let named: Vec<&'static super::CommandSpec> = if cmd.len() > 2 {
        cmd.args().skip(2).filter_map(|name| lookup(name).map(|(_, spec)| spec)).collect()
    } else {
        COMMANDS.iter().collect()
    };
    Reply::Map(
        named
            .into_iter()
            .map(|spec| {
                let found = DOCS.iter().find(|d| d.name == spec.name);
                let group = found.map_or_else(|| group_of(spec), |d| d.group);
                let mut fields = vec![
                    ("summary", Reply::bulk_str(found.map_or("", |d| d.summary))),
                    ("since", Reply::bulk_str(found.map_or("", |d| d.since))),
                    ("group", Reply::bulk_str(group)),
                ];
                if let Some(d) = found.filter(|d| !d.complexity.is_empty()) {
                    fields.push(("complexity", Reply::bulk_str(d.complexity)));
                }
                (Reply::bulk_str(spec.name), Reply::map(fields))
            })
            .collect(),
    )
}

/// A command's documentation group from its ACL categories.
fn group_of(spec: &super::CommandSpec) -> &'static str {
    use crate::acl::Categories;
    let c = spec.categories;
    if c.contains(Categories::STRING) {
        "string"
    } else if c.contains(Categories::KEYSPACE) {
        "generic"
    } else if c.contains(Categories::CONNECTION) {
        "connection"
    } else {
        "server"
    }
}

// ---- SLOWLOG, LATENCY ----

/// Entries `SLOWLOG GET` answers without a count (Redis' default).
const SLOWLOG_DEFAULT_COUNT: usize = 10;

fn slow_entry(e: SlowEntry) -> Reply {
    Reply::Array(vec![
        Reply::Integer(e.id as i64),
        Reply::Integer(e.unix_time as i64),
        Reply::Integer(e.micros as i64),
        Reply::Array(e.args.into_iter().map(Reply::Bulk).collect()),
        Reply::Bulk(e.peer.into_bytes()),
        Reply::Bulk(e.name),
    ])
}

/// `SLOWLOG GET [count]|LEN|RESET|HELP`.
pub(super) fn slowlog(c: &mut Client, cmd: &Command) -> CmdResult {
    let log = &c.stats.slowlog;
    match upper(cmd.arg(1)).as_slice() {
        b"GET" => {
            let count = match cmd.get(2) {
                None => Some(SLOWLOG_DEFAULT_COUNT),
                Some(arg) => match parse_i64(arg) {
                    Some(-1) => None,
                    Some(n) if n >= 0 => Some(n as usize),
                    _ => return Err(fail("ERR count should be greater than or equal to -1")),
                },
            };
            Ok(Reply::Array(log.newest(count).into_iter().map(slow_entry).collect()))
        }
        b"LEN" => Ok(Reply::Integer(log.len() as i64)),
        b"RESET" => {
            log.reset();
            Ok(Reply::ok())
        }
        b"HELP" => help(&[
            "SLOWLOG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "GET [<count>]",
            "    Return top <count> entries from the slowlog (default: 10, -1 mean all).",
            "    Entries are made of:",
            "    id, timestamp, time in microseconds, arguments array, client IP and port,",
            "    client name",
            "LEN",
            "    Return the length of the slowlog.",
            "RESET",
            "    Reset the slowlog.",
            "HELP",
            "    Print this help.",
        ]),
        _ => Err(unsupported_subcommand("SLOWLOG", cmd.arg(1))),
    }
}

/// `LATENCY LATEST|HISTORY event|RESET [event ...]|HELP`. Events are `command` and
/// `fast-command` (commands that took at least `latency-monitor-threshold` ms); with the
/// threshold at 0 (the default) nothing is recorded and LATEST is empty.
pub(super) fn latency(c: &mut Client, cmd: &Command) -> CmdResult {
    let monitor = &c.stats.latency;
    let int = |n: u64| Reply::Integer(n as i64);
    match upper(cmd.arg(1)).as_slice() {
        b"LATEST" => Ok(Reply::Array(
            monitor
                .latest()
                .into_iter()
                .map(|(event, time, latest, max)| {
                    Reply::Array(vec![Reply::bulk_str(event), int(time), int(latest), int(max)])
                })
                .collect(),
        )),
        b"HISTORY" => Ok(Reply::Array(
            monitor.history(cmd.arg(2)).into_iter().map(|(time, ms)| Reply::Array(vec![int(time), int(ms)])).collect(),
        )),
        b"RESET" => {
            let events: Vec<&[u8]> = cmd.args().skip(2).collect();
            Ok(int(monitor.reset(&events) as u64))
        }
        b"HELP" => help(&[
            "LATENCY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "HISTORY <event>",
            "    Return time-latency samples for the <event> class.",
            "LATEST",
            "    Return the latest latency samples for all events.",
            "RESET [<event> ...]",
            "    Reset latency data of one or more <event> classes.",
            "    (default: reset all data for all event classes)",
            "HELP",
            "    Print this help.",
        ]),
        _ => Err(unsupported_subcommand("LATENCY", cmd.arg(1))),
    }
}

// ---- MEMORY, OBJECT ----

/// `MEMORY USAGE key [SAMPLES n]|HELP`: the bytes the key takes in storage (the store's
/// measure: in the RACE table its KV block and its slot), nil for a missing key.
pub(super) fn memory(c: &mut Client, cmd: &Command) -> CmdResult {
    match upper(cmd.arg(1)).as_slice() {
        b"USAGE" => {
            let mut i = 3;
            while i < cmd.len() {
                match upper(cmd.arg(i)).as_slice() {
                    b"SAMPLES" if i + 1 < cmd.len() => {
                        let samples = parse_i64(cmd.arg(i + 1))
                            .ok_or_else(|| fail("ERR value is not an integer or out of range"))?;
                        if samples < 0 {
                            return Err(fail("ERR syntax error"));
                        }
                        i += 2;
                    }
                    _ => return Err(fail("ERR syntax error")),
                }
            }
            let bytes = c.store()?.memory_usage(cmd.arg(2))?;
            c.stats.keyspace_lookup(bytes.is_some());
            Ok(bytes.map_or(Reply::Nil, |b| Reply::Integer(i64::try_from(b).unwrap_or(i64::MAX))))
        }
        b"HELP" => help(&[
            "MEMORY <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "USAGE <key> [SAMPLES <count>]",
            "    Return memory in bytes used by <key> in storage.",
            "HELP",
            "    Print this help.",
        ]),
        _ => Err(unsupported_subcommand("MEMORY", cmd.arg(1))),
    }
}

/// Redis' encoding of a string value set by SET: `int` for a canonical 64-bit integer of at
/// most 20 characters, `embstr` up to 44 bytes, `raw` beyond. (Redis makes APPEND and
/// SETRANGE results `raw` whatever their length; racekv stores bytes only and answers by
/// the value.)
fn encoding(value: &[u8]) -> &'static str {
    const EMBSTR_SIZE_LIMIT: usize = 44;
    if value.len() <= 20 && parse_i64(value).is_some() {
        "int"
    } else if value.len() <= EMBSTR_SIZE_LIMIT {
        "embstr"
    } else {
        "raw"
    }
}

/// `OBJECT ENCODING|FREQ|IDLETIME|REFCOUNT key|HELP`. FREQ and IDLETIME read the key's
/// access word (`KvSession::access`) and answer Redis' errors as Redis does: FREQ only
/// under an LFU policy, IDLETIME only under any other.
pub(super) fn object(c: &mut Client, cmd: &Command) -> CmdResult {
    let sub = upper(cmd.arg(1));
    if sub == b"HELP" {
        return help(&[
            "OBJECT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "ENCODING <key>",
            "    Return the kind of internal representation Redis would use for the value stored at <key>.",
            "FREQ <key>",
            "    Return the access frequency index of the key <key> (under an LFU maxmemory-policy).",
            "IDLETIME <key>",
            "    Return the idle time of the key <key> (seconds since it was last read, or written).",
            "REFCOUNT <key>",
            "    Return the number of references of the value associated with the specified key (1).",
            "HELP",
            "    Print this help.",
        ]);
    }
    if !matches!(sub.as_slice(), b"ENCODING" | b"FREQ" | b"IDLETIME" | b"REFCOUNT") {
        return Err(unsupported_subcommand("OBJECT", cmd.arg(1)));
    }
    if matches!(sub.as_slice(), b"FREQ" | b"IDLETIME") {
        return object_access(c, cmd, sub == b"FREQ");
    }
    let value = c.store()?.get(cmd.arg(2))?;
    c.stats.keyspace_lookup(value.is_some());
    let Some(value) = value else {
        return Ok(Reply::Nil);
    };
    match sub.as_slice() {
        b"ENCODING" => Ok(Reply::bulk_str(encoding(&value))),
        _ => Ok(Reply::Integer(1)), // REFCOUNT
    }
}

/// `OBJECT FREQ key` (`freq`) or `OBJECT IDLETIME key`.
fn object_access(c: &mut Client, cmd: &Command, freq: bool) -> CmdResult {
    let access = c.store()?.access(cmd.arg(2))?;
    c.stats.keyspace_lookup(access.is_some());
    let Some(access) = access else {
        return Ok(Reply::Nil);
    };
    let lfu = c.stats.settings.maxmemory().policy().lfu();
    match (freq, lfu, access) {
        (true, false, _) => Err(fail(
            "ERR An LFU maxmemory policy is not selected, access frequency not tracked. Please note that when \
             switching between policies at runtime LRU and LFU data will take some time to adjust.",
        )),
        (false, true, _) => Err(fail(
            "ERR An LRU maxmemory policy is not selected, access time not tracked. Please note that when \
             switching between policies at runtime LRU and LFU data will take some time to adjust.",
        )),
        (_, _, None) => Err(fail("ERR no access data is kept for this key (written by an earlier build)")),
        (true, true, Some(a)) => Ok(Reply::Integer(i64::from(a.lfu_counter))),
        (false, false, Some(a)) => Ok(Reply::Integer(a.idle_s.min(i64::MAX as u64) as i64)),
    }
}

// ---- TIME, LOLWUT ----

/// `TIME`: seconds and microseconds since the Unix epoch, as two bulk strings.
pub(super) fn time(_c: &mut Client, _cmd: &Command) -> CmdResult {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Ok(Reply::Array(vec![
        Reply::Bulk(now.as_secs().to_string().into_bytes()),
        Reply::Bulk(now.subsec_micros().to_string().into_bytes()),
    ]))
}

/// `LOLWUT [VERSION v]`: no art, the version line Redis ends with.
pub(super) fn lolwut(_c: &mut Client, _cmd: &Command) -> CmdResult {
    let text = format!("Redis ver. {REDIS_COMPAT_VERSION} (racekv {})\n", env!("CARGO_PKG_VERSION"));
    Ok(Reply::Verbatim("txt", text.into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acl::Acl;
    use crate::info::ServerStats;
    use crate::memstore::MemStore;
    use crate::reply::Protocol;
    use crate::store::{KvSession, KvStore};

    /// Clients of one server (shared stats, store and ACL).
    struct Server {
        store: MemStore,
        stats: Arc<ServerStats>,
        acl: Arc<Acl>,
    }

    impl Server {
        fn new() -> Self {
            Self {
                store: MemStore::new(),
                stats: Arc::new(ServerStats::new(6379, 100, None)),
                acl: Arc::new(Acl::open(catalog())),
            }
        }

        fn client(&self, id: u64) -> Client {
            let c = Client::new(id, Arc::new(self.store.clone()), Arc::clone(&self.stats), Arc::clone(&self.acl));
            let addr = format!("127.0.0.1:{}", 50000 + id).parse().ok();
            c.set_connection(addr, "127.0.0.1:6379".parse().ok(), 10 + id as i64);
            c
        }
    }

    fn run(c: &mut Client, args: &[&str]) -> Reply {
        c.execute(&Command::from_args(args))
    }

    fn err(s: &str) -> Reply {
        Reply::Error(s.to_string().into())
    }

    fn text(reply: Reply) -> String {
        match reply {
            Reply::Verbatim("txt", bytes) | Reply::Bulk(bytes) => String::from_utf8(bytes).unwrap(),
            other => panic!("not text: {other:?}"),
        }
    }

    /// `key=value` fields of a CLIENT LIST line.
    fn fields(line: &str) -> Vec<(String, String)> {
        line.trim_end()
            .split(' ')
            .map(|f| {
                let (k, v) = f.split_once('=').unwrap_or_else(|| panic!("no = in {f:?}"));
                (k.to_string(), v.to_string())
            })
            .collect()
    }

    fn field(line: &str, name: &str) -> String {
        fields(line).into_iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no {name} in {line}")).1
    }

    #[test]
    fn client_list_and_info_show_every_connection_in_redis_format() {
        let server = Server::new();
        let mut a = server.client(1);
        let mut b = server.client(2);
        assert_eq!(run(&mut a, &["CLIENT", "SETNAME", "alpha"]), Reply::ok());
        assert_eq!(run(&mut a, &["CLIENT", "SETINFO", "lib-name", "redis-rs"]), Reply::ok());
        run(&mut b, &["HELLO", "3"]);
        run(&mut b, &["GET", "k"]);
        let list = text(run(&mut a, &["CLIENT", "LIST"]));
        let lines: Vec<&str> = list.lines().collect();
        assert_eq!(lines.len(), 2, "{list}");
        let names: Vec<String> = fields(lines[0]).into_iter().map(|(k, _)| k).collect();
        assert_eq!(
            names.join(" "),
            "id addr laddr fd name age idle flags db sub psub ssub multi qbuf qbuf-free argv-mem multi-mem rbs rbp \
             obl oll omem tot-mem events cmd user redir resp lib-name lib-ver"
        );
        assert_eq!(field(lines[0], "id"), "1");
        assert_eq!(field(lines[0], "addr"), "127.0.0.1:50001");
        assert_eq!(field(lines[0], "name"), "alpha");
        assert_eq!(field(lines[0], "lib-name"), "redis-rs");
        assert_eq!(field(lines[0], "cmd"), "client|list");
        assert_eq!(field(lines[0], "user"), "default");
        assert_eq!(field(lines[1], "cmd"), "get");
        assert_eq!(field(lines[1], "resp"), "3");
        assert!(list.ends_with('\n'));
        let info = text(run(&mut b, &["CLIENT", "INFO"]));
        assert_eq!(field(&info, "id"), "2");
        assert_eq!(field(&info, "cmd"), "client|info");
        let only_b = text(run(&mut a, &["CLIENT", "LIST", "ID", "2", "99"]));
        assert_eq!(only_b.lines().count(), 1);
        assert_eq!(field(&only_b, "id"), "2");
        assert_eq!(text(run(&mut a, &["CLIENT", "LIST", "TYPE", "pubsub"])), "");
        assert_eq!(text(run(&mut a, &["CLIENT", "LIST", "TYPE", "normal"])).lines().count(), 2);
        assert_eq!(run(&mut a, &["CLIENT", "LIST", "TYPE", "x"]), err("ERR Unknown client type 'x'"));
        assert_eq!(text(run(&mut a, &["CLIENT", "LIST", "ID", "0", "-5"])), "");
        assert_eq!(run(&mut a, &["CLIENT", "LIST", "ID", "1", "x"]), err("ERR Invalid client ID"));
        assert_eq!(run(&mut a, &["CLIENT", "LIST", "FOO"]), err("ERR syntax error"));
        assert_eq!(
            run(&mut a, &["CLIENT", "INFO", "x"]),
            err("ERR wrong number of arguments for 'client|info' command")
        );
        assert_eq!(run(&mut a, &["CLIENT", "NO-EVICT", "on"]), Reply::ok());
        assert_eq!(run(&mut a, &["CLIENT", "NO-TOUCH", "on"]), Reply::ok());
        assert_eq!(field(&text(run(&mut a, &["CLIENT", "INFO"])), "flags"), "eT");
        assert_eq!(run(&mut a, &["CLIENT", "NO-EVICT", "maybe"]), err("ERR syntax error"));
        drop(b);
        assert_eq!(text(run(&mut a, &["CLIENT", "LIST"])).lines().count(), 1, "a closed connection leaves the list");
        // RESP3: verbatim text, as Redis sends it.
        let mut out = Vec::new();
        run(&mut a, &["CLIENT", "INFO"]).encode(&mut out, Protocol::Resp3);
        assert!(out.starts_with(b"=") && out[1..].windows(4).any(|w| w == b"txt:"));
    }

    #[test]
    fn client_kill_filters_and_closes() {
        let server = Server::new();
        let mut a = server.client(1);
        let b = server.client(2);
        let c = server.client(3);
        assert_eq!(run(&mut a, &["CLIENT", "KILL", "ID", "2"]), Reply::Integer(1));
        assert!(b.killed() && !c.killed() && !a.killed());
        assert_eq!(run(&mut a, &["CLIENT", "KILL", "127.0.0.1:50003"]), Reply::ok());
        assert!(c.killed());
        assert_eq!(run(&mut a, &["CLIENT", "KILL", "1.2.3.4:5"]), err("ERR No such client"));
        // SKIPME yes (the default) spares the caller; SKIPME no kills it after its reply.
        assert_eq!(run(&mut a, &["CLIENT", "KILL", "USER", "default", "ID", "1"]), Reply::Integer(0));
        assert!(!a.wants_close());
        assert_eq!(run(&mut a, &["CLIENT", "KILL", "ADDR", "127.0.0.1:50001", "SKIPME", "no"]), Reply::Integer(1));
        assert!(a.wants_close() && a.killed());
        let mut d = server.client(4);
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "ID", "0"]), err("ERR client-id should be greater than 0"));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "TYPE", "foo"]), err("ERR Unknown client type 'foo'"));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "TYPE", "master"]), Reply::Integer(0));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "USER", "nosuch"]), err("ERR No such user 'nosuch'"));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "ID", "1", "SKIPME"]), err("ERR syntax error"));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "SKIPME", "maybe"]), err("ERR syntax error"));
        assert_eq!(run(&mut d, &["CLIENT", "KILL", "LADDR", "127.0.0.1:6379"]), Reply::Integer(3));
    }

    #[test]
    fn client_pause_holds_other_clients_until_unpause() {
        let server = Server::new();
        let mut a = server.client(1);
        let b = server.client(2);
        let set = Command::from_args(["SET", "k", "v"]);
        let get = Command::from_args(["GET", "k"]);
        assert_eq!(run(&mut a, &["CLIENT", "PAUSE", "60000", "WRITE"]), Reply::ok());
        assert!(b.pause_holds(&set).is_some());
        assert!(b.pause_holds(&get).is_none(), "WRITE lets reads through");
        assert!(a.pause_holds(&set).is_none(), "the pausing client is not held");
        assert_eq!(run(&mut a, &["CLIENT", "PAUSE", "60000"]), Reply::ok());
        assert!(b.pause_holds(&get).is_some(), "ALL (the default) holds reads");
        assert_eq!(run(&mut a, &["CLIENT", "UNPAUSE"]), Reply::ok());
        assert!(b.pause_holds(&set).is_none());
        assert_eq!(run(&mut a, &["CLIENT", "PAUSE", "-1"]), err("ERR timeout is negative"));
        assert_eq!(run(&mut a, &["CLIENT", "PAUSE", "x"]), err("ERR timeout is not an integer or out of range"));
        assert_eq!(run(&mut a, &["CLIENT", "PAUSE", "10", "foo"]), err("ERR CLIENT PAUSE mode must be WRITE or ALL"));
        assert_eq!(
            run(&mut a, &["CLIENT", "PAUSE", "3600001"]),
            err("ERR racekv pauses clients for at most 3600000 milliseconds")
        );
        assert!(b.pause_holds(&set).is_none(), "a refused pause pauses nothing");
    }

    #[test]
    fn config_set_changes_settings_all_or_nothing() {
        let server = Server::new();
        let mut c = server.client(1);
        let get = |c: &mut Client, name: &str| run(c, &["CONFIG", "GET", name]);
        assert_eq!(run(&mut c, &["CONFIG", "SET", "maxclients", "7", "timeout", "30"]), Reply::ok());
        assert_eq!(server.stats.max_clients(), 7);
        assert_eq!(server.stats.idle_timeout(), Some(Duration::from_secs(30)));
        assert_eq!(get(&mut c, "timeout"), Reply::map([("timeout", Reply::bulk_str("30"))]));
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "maxclients", "8", "protected-mode", "maybe"]),
            err("ERR CONFIG SET failed (possibly related to argument 'protected-mode') - argument must be 'yes' or 'no'")
        );
        assert_eq!(server.stats.max_clients(), 7, "a bad pair changes nothing");
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "timeout", "1", "TIMEOUT", "2"]),
            err("ERR CONFIG SET failed (possibly related to argument 'timeout') - duplicate parameter")
        );
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "databases", "2"]),
            err("ERR CONFIG SET failed (possibly related to argument 'databases') - can't set immutable config")
        );
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "maxclients", "0"]),
            err("ERR CONFIG SET failed (possibly related to argument 'maxclients') - argument must be between 1 and 1000000 inclusive")
        );
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "timeout"]),
            err("ERR wrong number of arguments for 'config|set' command")
        );
        assert_eq!(run(&mut c, &["CONFIG", "SET", "protected-mode", "no"]), Reply::ok());
        assert!(!server.stats.settings.protected_mode());
        assert_eq!(get(&mut c, "protected-mode"), Reply::map([("protected-mode", Reply::bulk_str("no"))]));
        assert_eq!(run(&mut c, &["CONFIG", "REWRITE"]), err("ERR The server is running without a config file"));
        assert_eq!(run(&mut c, &["CONFIG", "FOO"]), err("ERR unknown subcommand 'FOO'. Try CONFIG HELP."));
        let Reply::Map(all) = get(&mut c, "*") else { panic!("not a map") };
        assert_eq!(all.len(), PARAMETERS.len());
    }

    #[test]
    fn config_set_requirepass_sets_the_default_users_password() {
        let server = Server::new();
        let mut admin = server.client(1);
        assert_eq!(
            run(&mut admin, &["CONFIG", "GET", "requirepass"]),
            Reply::map([("requirepass", Reply::bulk_str(""))])
        );
        assert_eq!(run(&mut admin, &["CONFIG", "SET", "requirepass", "s3cret"]), Reply::ok());
        let Reply::Map(shown) = run(&mut admin, &["CONFIG", "GET", "requirepass"]) else { panic!("not a map") };
        assert!(!shown[0].1.eq(&Reply::bulk_str("s3cret")) && !shown[0].1.eq(&Reply::bulk_str("")));
        let mut fresh = server.client(2);
        assert_eq!(run(&mut fresh, &["GET", "k"]), err("NOAUTH Authentication required."));
        assert_eq!(run(&mut fresh, &["AUTH", "s3cret"]), Reply::ok());
        assert_eq!(run(&mut admin, &["CONFIG", "SET", "requirepass", ""]), Reply::ok());
        let mut open = server.client(3);
        assert_eq!(run(&mut open, &["GET", "k"]), Reply::Nil, "an empty requirepass means nopass");
    }

    #[test]
    fn slowlog_records_bounded_entries() {
        let server = Server::new();
        let mut c = server.client(1);
        assert_eq!(run(&mut c, &["SLOWLOG", "LEN"]), Reply::Integer(0));
        // Every command takes at least 0 µs: all are logged from now on.
        assert_eq!(
            run(&mut c, &["CONFIG", "SET", "slowlog-log-slower-than", "0", "slowlog-max-len", "3"]),
            Reply::ok()
        );
        run(&mut c, &["SET", "k", "v"]);
        run(&mut c, &["AUTH", "secret"]);
        let Reply::Array(entries) = run(&mut c, &["SLOWLOG", "GET", "2"]) else { panic!("not an array") };
        assert_eq!(entries.len(), 2);
        let Reply::Array(auth) = &entries[0] else { panic!("not an entry") };
        assert_eq!(auth.len(), 6);
        assert_eq!(auth[3], Reply::Array(vec![Reply::bulk_str("AUTH"), Reply::bulk_str("(redacted)")]));
        assert_eq!(auth[4], Reply::bulk_str("127.0.0.1:50001"));
        for _ in 0..5 {
            run(&mut c, &["PING"]);
        }
        assert_eq!(run(&mut c, &["SLOWLOG", "LEN"]), Reply::Integer(3), "slowlog-max-len bounds it");
        let Reply::Array(all) = run(&mut c, &["SLOWLOG", "GET", "-1"]) else { panic!("not an array") };
        assert_eq!(all.len(), 3);
        assert_eq!(run(&mut c, &["SLOWLOG", "GET", "-2"]), err("ERR count should be greater than or equal to -1"));
        assert_eq!(run(&mut c, &["CONFIG", "SET", "slowlog-log-slower-than", "-1"]), Reply::ok());
        assert_eq!(run(&mut c, &["SLOWLOG", "RESET"]), Reply::ok());
        run(&mut c, &["PING"]);
        assert_eq!(run(&mut c, &["SLOWLOG", "LEN"]), Reply::Integer(0), "a negative threshold logs nothing");
    }

    /// A store whose reads take at least `delay`.
    struct Slow(MemStore, Duration);

    impl KvStore for Slow {
        fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
            Ok(Box::new(SlowSession(self.0.clone(), self.1)))
        }
    }

    struct SlowSession(MemStore, Duration);

    impl KvSession for SlowSession {
        fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            std::thread::sleep(self.1);
            self.0.get(key)
        }
        fn put(&mut self, k: &[u8], v: &[u8], m: crate::store::PutMode) -> Result<bool, StoreError> {
            self.0.put(k, v, m)
        }
        fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
            self.0.delete(key)
        }
        fn compare_and_swap(&mut self, k: &[u8], e: Option<&[u8]>, n: &[u8]) -> Result<bool, StoreError> {
            self.0.compare_and_swap(k, e, n)
        }
        fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
            self.0.get_in_order(keys)
        }
        fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
            self.0.multi_put(pairs)
        }
        fn len(&mut self) -> Result<u64, StoreError> {
            self.0.len()
        }
        fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
            self.0.scan(cursor, count)
        }
        fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
            self.0.random_key()
        }
        fn flush(&mut self) -> Result<u64, StoreError> {
            self.0.flush()
        }
        fn put_opts(
            &mut self,
            key: &[u8],
            value: &[u8],
            options: crate::store::PutOptions,
        ) -> Result<crate::store::PutResult, StoreError> {
            self.0.put_opts(key, value, options)
        }
        fn get_item(&mut self, key: &[u8]) -> Result<Option<crate::store::Item>, StoreError> {
            self.0.get_item(key)
        }
        fn update_expiry(
            &mut self,
            key: &[u8],
            decide: &mut dyn FnMut(Option<u64>) -> crate::store::ExpiryUpdate,
        ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
            self.0.update_expiry(key, decide)
        }
        fn info(&mut self) -> Result<String, StoreError> {
            self.0.info()
        }
    }

    #[test]
    fn latency_monitor_records_commands_past_its_threshold() {
        let stats = Arc::new(ServerStats::new(1, 1, None));
        let store = Arc::new(Slow(MemStore::new(), Duration::from_millis(3)));
        let mut c = Client::new(1, store, stats, Arc::new(Acl::open(catalog())));
        assert_eq!(run(&mut c, &["LATENCY", "LATEST"]), Reply::Array(vec![]), "off by default");
        run(&mut c, &["GET", "k"]);
        assert_eq!(run(&mut c, &["LATENCY", "LATEST"]), Reply::Array(vec![]));
        // A GET sleeps 3 ms in the store: at least the 2 ms threshold, whatever the machine.
        assert_eq!(run(&mut c, &["CONFIG", "SET", "latency-monitor-threshold", "2"]), Reply::ok());
        run(&mut c, &["GET", "k"]);
        let Reply::Array(events) = run(&mut c, &["LATENCY", "LATEST"]) else { panic!("not an array") };
        assert_eq!(events.len(), 1);
        let Reply::Array(event) = &events[0] else { panic!("not an event") };
        assert_eq!(event[0], Reply::bulk_str("fast-command"));
        assert!(matches!(event[2], Reply::Integer(ms) if ms >= 3), "{event:?}");
        let Reply::Array(history) = run(&mut c, &["LATENCY", "HISTORY", "fast-command"]) else {
            panic!("not an array")
        };
        assert_eq!(history.len(), 1);
        assert_eq!(run(&mut c, &["LATENCY", "RESET"]), Reply::Integer(1));
        assert_eq!(run(&mut c, &["LATENCY", "LATEST"]), Reply::Array(vec![]));
    }

    #[test]
    fn command_getkeys_docs_and_unknown_subcommands() {
        let server = Server::new();
        let mut c = server.client(1);
        let keys = |names: &[&str]| Reply::Array(names.iter().map(|n| Reply::bulk_str(n)).collect());
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "GET", "k"]), keys(&["k"]));
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "mset", "a", "1", "b", "2"]), keys(&["a", "b"]));
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "LCS", "x", "y", "IDX"]), keys(&["x", "y"]));
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "MEMORY", "USAGE", "m"]), keys(&["m"]));
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "PING", "x"]), err("ERR The command has no key arguments"));
        assert_eq!(run(&mut c, &["COMMAND", "GETKEYS", "NOSUCH", "x"]), err("ERR Invalid command specified"));
        assert_eq!(
            run(&mut c, &["COMMAND", "GETKEYS", "GET", "a", "b"]),
            err("ERR Invalid number of arguments specified for command")
        );
        let Reply::Map(docs) = run(&mut c, &["COMMAND", "DOCS", "incrbyfloat", "nosuch"]) else { panic!("not a map") };
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].0, Reply::bulk_str("incrbyfloat"));
        let Reply::Map(fields) = &docs[0].1 else { panic!("not a map") };
        assert_eq!(
            fields[0],
            (Reply::bulk_str("summary"), Reply::bulk_str("Increment the floating point value of a key by a number."))
        );
        assert_eq!(run(&mut c, &["COMMAND", "FOO"]), err("ERR unknown subcommand 'FOO'. Try COMMAND HELP."));
        assert_eq!(run(&mut c, &["SLOWLOG", "FOO"]), err("ERR unknown subcommand 'FOO'. Try SLOWLOG HELP."));
        assert_eq!(run(&mut c, &["LATENCY", "DOCTOR"]), err("ERR unknown subcommand 'DOCTOR'. Try LATENCY HELP."));
        assert_eq!(run(&mut c, &["MEMORY", "STATS"]), err("ERR unknown subcommand 'STATS'. Try MEMORY HELP."));
        for container in ["CLIENT", "CONFIG", "COMMAND", "SLOWLOG", "LATENCY", "MEMORY", "OBJECT"] {
            let Reply::Array(lines) = run(&mut c, &[container, "HELP"]) else { panic!("{container} HELP") };
            assert!(lines.len() > 2, "{container}");
        }
    }

    #[test]
    fn memory_usage_object_and_time() {
        let server = Server::new();
        let mut c = server.client(1);
        run(&mut c, &["MSET", "n", "12345", "s", "hello", "big", &"x".repeat(45)]);
        // MemStore's measure: key and value bytes.
        assert_eq!(run(&mut c, &["MEMORY", "USAGE", "s"]), Reply::Integer(6));
        assert_eq!(run(&mut c, &["MEMORY", "USAGE", "s", "SAMPLES", "5"]), Reply::Integer(6));
        assert_eq!(run(&mut c, &["MEMORY", "USAGE", "missing"]), Reply::Nil);
        assert_eq!(run(&mut c, &["MEMORY", "USAGE", "s", "SAMPLES"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["MEMORY", "USAGE", "s", "SAMPLES", "-1"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["OBJECT", "ENCODING", "n"]), Reply::bulk_str("int"));
        assert_eq!(run(&mut c, &["OBJECT", "ENCODING", "s"]), Reply::bulk_str("embstr"));
        assert_eq!(run(&mut c, &["OBJECT", "ENCODING", "big"]), Reply::bulk_str("raw"));
        assert_eq!(run(&mut c, &["OBJECT", "ENCODING", "missing"]), Reply::Nil);
        assert_eq!(run(&mut c, &["OBJECT", "REFCOUNT", "s"]), Reply::Integer(1));
        let Reply::Error(freq) = run(&mut c, &["OBJECT", "FREQ", "s"]) else { panic!("FREQ answered") };
        assert!(freq.starts_with("ERR An LFU maxmemory policy is not selected"), "{freq}");
        assert!(run(&mut c, &["OBJECT", "IDLETIME", "s"]).is_error());
        assert_eq!(run(&mut c, &["OBJECT", "IDLETIME", "missing"]), Reply::Nil);
        let Reply::Array(time) = run(&mut c, &["TIME"]) else { panic!("not an array") };
        let parts: Vec<u64> = time.iter().map(|t| text(t.clone()).parse().unwrap()).collect();
        assert!(parts[0] > 1_600_000_000 && parts[1] < 1_000_000, "{parts:?}");
        assert!(text(run(&mut c, &["LOLWUT"])).starts_with("Redis ver. 7.2.0"));
    }

    #[test]
    fn info_reports_keyspace_commandstats_errorstats_and_resets() {
        let server = Server::new();
        let mut c = server.client(1);
        run(&mut c, &["MSET", "a", "1", "b", "2"]);
        run(&mut c, &["GET", "a"]);
        run(&mut c, &["GET", "zz"]);
        run(&mut c, &["GET"]);
        run(&mut c, &["INCR", "zz", "x"]);
        run(&mut c, &["NOSUCH"]);
        run(&mut c, &["INCRBYFLOAT", "a", "x"]);
        let info = text(run(&mut c, &["INFO", "everything"]));
        for needle in [
            "# Keyspace\r\ndb0:keys=2,expires=0,avg_ttl=0\r\n",
            "keyspace_hits:1\r\nkeyspace_misses:1\r\n",
            "cmdstat_get:calls=2,",
            "rejected_calls=1,failed_calls=0\r\n",
            "cmdstat_incrbyfloat:calls=1,",
            "failed_calls=1\r\n",
            "errorstat_ERR:count=4\r\n",
            "total_error_replies:4\r\n",
            "# Storage\r\nstorage_backend:memstore-test-double\r\n",
        ] {
            assert!(info.contains(needle), "{needle:?} not in {info}");
        }
        assert_eq!(run(&mut c, &["CONFIG", "RESETSTAT"]), Reply::ok());
        let info = text(run(&mut c, &["INFO", "stats", "commandstats", "errorstats"]));
        assert!(info.contains("keyspace_hits:0\r\n") && info.contains("total_error_replies:0\r\n"), "{info}");
        assert!(!info.contains("cmdstat_get"), "{info}");
        assert!(info.contains("cmdstat_config|resetstat:calls=1,"), "RESETSTAT itself is counted after: {info}");
    }

    #[test]
    fn encodings_follow_redis_rules_for_set_values() {
        assert_eq!(encoding(b"12345"), "int");
        assert_eq!(encoding(b"-9223372036854775808"), "int");
        assert_eq!(encoding(b"012"), "embstr");
        assert_eq!(encoding(b"99999999999999999999"), "embstr", "past i64");
        assert_eq!(encoding(&[b'x'; 44]), "embstr");
        assert_eq!(encoding(&[b'x'; 45]), "raw");
    }
}
