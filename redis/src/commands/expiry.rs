//! Commands that set, change and read keys' expiry: SET (with its options), SETEX, PSETEX,
//! GETEX, EXPIRE, PEXPIRE, EXPIREAT, PEXPIREAT, TTL, PTTL, EXPIRETIME, PEXPIRETIME, PERSIST.
//!
//! Semantics and error texts are Redis 7.2's (t_string.c, expire.c): options parse before
//! numbers are judged; relative times are added to the clock with overflow checks; EXPIRE
//! with a time not after now deletes the key (and answers 1); SET with a time already past
//! writes a key no read sees. Times are absolute Unix milliseconds on this host's clock
//! (`racekv_telemetry::clock`); the store keeps them with the key, so every computenode
//! agrees when a key expires.

use racekv_telemetry::clock::now_unix_ms;

use super::{fail, Client, CmdResult, Failure};
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::store::{Expiry, ExpiryUpdate, PutMode, PutOptions};

const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";
const SYNTAX_ERROR: &str = "ERR syntax error";

/// Redis' `ERR invalid expire time in '<command>' command`.
fn invalid_expire_time(command: &str) -> Failure {
    fail(format!("ERR invalid expire time in '{command}' command"))
}

/// How an expire argument counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TimeArg {
    /// EX: seconds from now.
    Ex,
    /// PX: milliseconds from now.
    Px,
    /// EXAT: Unix seconds.
    ExAt,
    /// PXAT: Unix milliseconds.
    PxAt,
}

impl TimeArg {
    fn of(option: &[u8]) -> Option<Self> {
        // Compared in place: SET ... PX is hot, and an uppercased copy is an allocation.
        [(&b"EX"[..], TimeArg::Ex), (b"PX", TimeArg::Px), (b"EXAT", TimeArg::ExAt), (b"PXAT", TimeArg::PxAt)]
            .into_iter()
            .find(|(name, _)| option.eq_ignore_ascii_case(name))
            .map(|(_, t)| t)
    }

    fn is_absolute(self) -> bool {
        matches!(self, TimeArg::ExAt | TimeArg::PxAt)
    }

    /// The absolute expiry (Unix ms) `arg` stands for, judged as Redis'
    /// `getExpireMillisecondsOrReply`: a positive integer, not overflowing once in
    /// milliseconds and (for EX and PX) once added to now.
    fn resolve(self, arg: &[u8], command: &str, now_ms: u64) -> Result<u64, Failure> {
        let value = parse_i64(arg).ok_or_else(|| fail(NOT_AN_INTEGER))?;
        let seconds = matches!(self, TimeArg::Ex | TimeArg::ExAt);
        if value <= 0 || (seconds && value > i64::MAX / 1000) {
            return Err(invalid_expire_time(command));
        }
        let ms = if seconds { value * 1000 } else { value };
        let at = if self.is_absolute() { Some(ms) } else { ms.checked_add(now_ms as i64) };
        at.map(|at| at as u64).ok_or_else(|| invalid_expire_time(command))
    }
}

/// The options SET and GETEX share (Redis' `parseExtendedStringArgumentsOrReply`).
#[derive(Debug, Default)]
struct StringOptions<'c> {
    nx: bool,
    xx: bool,
    get: bool,
    keepttl: bool,
    persist: bool,
    time: Option<(TimeArg, &'c [u8])>,
}

/// Which command's options are being parsed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Parsing {
    Set,
    GetEx,
}

/// Parses `args` as Redis does: each option may repeat, a conflicting one is a syntax
/// error, a time option takes the next argument.
fn parse_options<'c>(args: &[&'c [u8]], parsing: Parsing) -> Result<StringOptions<'c>, Failure> {
    let mut o = StringOptions::default();
    let set = parsing == Parsing::Set;
    let mut i = 0;
    while i < args.len() {
        let option = args[i];
        let is = |word: &[u8]| option.eq_ignore_ascii_case(word);
        let next = args.get(i + 1).copied();
        let timed = o.time.map(|(t, _)| t);
        match () {
            _ if is(b"NX") && set && !o.xx => o.nx = true,
            _ if is(b"XX") && set && !o.nx => o.xx = true,
            _ if is(b"GET") && set => o.get = true,
            _ if is(b"KEEPTTL") && set && !o.persist && timed.is_none() => o.keepttl = true,
            _ if is(b"PERSIST") && !set && !o.keepttl && timed.is_none() => o.persist = true,
            _ => match (TimeArg::of(option), next) {
                // The same time option again replaces it; another one conflicts.
                (Some(t), Some(value)) if !o.keepttl && !o.persist && timed.is_none_or(|had| had == t) => {
                    o.time = Some((t, value));
                    i += 1;
                }
                _ => return Err(fail(SYNTAX_ERROR)),
            },
        }
        i += 1;
    }
    Ok(o)
}

/// `SET key value [NX|XX] [GET] [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL]`.
pub(super) fn set(c: &mut Client, cmd: &Command) -> CmdResult {
    // A handful of options, on the stack (this is the hot path); repeated ones (Redis
    // accepts `NX NX ...`) past that in a Vec.
    let mut buf: [&[u8]; 8] = [&[]; 8];
    let mut n = 0;
    for arg in cmd.args().skip(3).take(buf.len()) {
        buf[n] = arg;
        n += 1;
    }
    let o = if cmd.args().len() <= 3 + buf.len() {
        parse_options(&buf[..n], Parsing::Set)?
    } else {
        parse_options(&cmd.args().skip(3).collect::<Vec<_>>(), Parsing::Set)?
    };
    let expiry = match o.time {
        Some((t, arg)) => Expiry::At(t.resolve(arg, "set", now_unix_ms())?),
        None if o.keepttl => Expiry::Keep,
        None => Expiry::Never,
    };
    let mode = match (o.nx, o.xx) {
        (true, _) => PutMode::InsertOnly,
        (_, true) => PutMode::UpdateOnly,
        _ => PutMode::Upsert,
    };
    let result = c.store()?.put_opts(cmd.arg(1), cmd.arg(2), PutOptions { mode, expiry, get: o.get })?;
    Ok(match (o.get, result.applied) {
        (true, _) => result.old.map_or(Reply::Nil, Reply::Bulk),
        (false, true) => Reply::ok(),
        (false, false) => Reply::Nil,
    })
}

/// `SETEX key seconds value`, `PSETEX key milliseconds value`.
fn set_expiring(c: &mut Client, cmd: &Command, unit: TimeArg, command: &str) -> CmdResult {
    let at = unit.resolve(cmd.arg(2), command, now_unix_ms())?;
    let options = PutOptions { mode: PutMode::Upsert, expiry: Expiry::At(at), get: false };
    c.store()?.put_opts(cmd.arg(1), cmd.arg(3), options)?;
    Ok(Reply::ok())
}

pub(super) fn setex(c: &mut Client, cmd: &Command) -> CmdResult {
    set_expiring(c, cmd, TimeArg::Ex, "setex")
}

pub(super) fn psetex(c: &mut Client, cmd: &Command) -> CmdResult {
    set_expiring(c, cmd, TimeArg::Px, "psetex")
}

/// `GETEX key [EX s|PX ms|EXAT s|PXAT ms|PERSIST]`: the value, and its expiry changed in
/// the same atomic step. A missing key answers nil before the time is judged (as Redis).
pub(super) fn getex(c: &mut Client, cmd: &Command) -> CmdResult {
    let args: Vec<&[u8]> = cmd.args().skip(2).collect();
    let o = parse_options(&args, Parsing::GetEx)?;
    let key = cmd.arg(1);
    let now = now_unix_ms();
    let update = match o.time {
        Some((t, arg)) => match t.resolve(arg, "getex", now) {
            // An absolute time not after now deletes the key (a relative one is after now).
            Ok(at) if t.is_absolute() && at <= now => ExpiryUpdate::Delete,
            Ok(at) => ExpiryUpdate::Set(Some(at)),
            Err(e) => {
                return match c.store()?.get(key)? {
                    None => Ok(Reply::Nil),
                    Some(_) => Err(e),
                };
            }
        },
        None if o.persist => ExpiryUpdate::Set(None),
        None => return Ok(c.store()?.get(key)?.map_or(Reply::Nil, Reply::Bulk)),
    };
    let before = c.store()?.update_expiry(key, &mut |current| match update {
        // PERSIST changes nothing on a key without an expiry.
        ExpiryUpdate::Set(None) if current.is_none() => ExpiryUpdate::Unchanged,
        other => other,
    })?;
    Ok(before.map_or(Reply::Nil, |(value, _)| Reply::Bulk(value)))
}

/// EXPIRE's conditions (Redis' `parseExtendedExpireArgumentsOrReply`).
#[derive(Debug, Default, Clone, Copy)]
struct ExpireFlags {
    nx: bool,
    xx: bool,
    gt: bool,
    lt: bool,
}

impl ExpireFlags {
    fn parse(args: impl Iterator<Item = impl AsRef<[u8]>>) -> Result<Self, Failure> {
        let mut f = Self::default();
        for arg in args {
            let arg = arg.as_ref();
            match arg.to_ascii_uppercase().as_slice() {
                b"NX" => f.nx = true,
                b"XX" => f.xx = true,
                b"GT" => f.gt = true,
                b"LT" => f.lt = true,
                _ => return Err(fail(format!("ERR Unsupported option {}", String::from_utf8_lossy(arg)))),
            }
        }
        if f.nx && (f.xx || f.gt || f.lt) {
            return Err(fail("ERR NX and XX, GT or LT options at the same time are not compatible"));
        }
        if f.gt && f.lt {
            return Err(fail("ERR GT and LT options at the same time are not compatible"));
        }
        Ok(f)
    }

    /// Whether a key whose expiry is `current` (None: none, which counts as infinitely
    /// late) may get `when`.
    fn allow(&self, current: Option<u64>, when: i64) -> bool {
        let current = current.map(|c| i64::try_from(c).unwrap_or(i64::MAX));
        (!self.nx || current.is_none())
            && (!self.xx || current.is_some())
            && (!self.gt || current.is_some_and(|c| when > c))
            && (!self.lt || current.is_none_or(|c| when < c))
    }
}

/// EXPIRE, PEXPIRE, EXPIREAT, PEXPIREAT: `key time [NX|XX|GT|LT]`. `relative`: the time
/// counts from now; `seconds`: it is in seconds.
fn expire_generic(c: &mut Client, cmd: &Command, relative: bool, seconds: bool, command: &str) -> CmdResult {
    let flags = ExpireFlags::parse(cmd.args().skip(3))?;
    let mut when = parse_i64(cmd.arg(2)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    if seconds {
        when = when.checked_mul(1000).ok_or_else(|| invalid_expire_time(command))?;
    }
    let now = now_unix_ms();
    if relative {
        // Redis refuses only what would pass i64::MAX; a time below zero is merely past.
        when = when.checked_add(now as i64).ok_or_else(|| invalid_expire_time(command))?;
    }
    let changed = c.store()?.update_expiry(cmd.arg(1), &mut |current| {
        if !flags.allow(current, when) {
            ExpiryUpdate::Unchanged
        } else if when <= now as i64 {
            ExpiryUpdate::Delete
        } else {
            ExpiryUpdate::Set(Some(when as u64))
        }
    })?;
    Ok(Reply::Integer(i64::from(changed.is_some_and(|(_, changed)| changed))))
}

pub(super) fn expire(c: &mut Client, cmd: &Command) -> CmdResult {
    expire_generic(c, cmd, true, true, "expire")
}

pub(super) fn pexpire(c: &mut Client, cmd: &Command) -> CmdResult {
    expire_generic(c, cmd, true, false, "pexpire")
}

pub(super) fn expireat(c: &mut Client, cmd: &Command) -> CmdResult {
    expire_generic(c, cmd, false, true, "expireat")
}

pub(super) fn pexpireat(c: &mut Client, cmd: &Command) -> CmdResult {
    expire_generic(c, cmd, false, false, "pexpireat")
}

/// TTL, PTTL, EXPIRETIME, PEXPIRETIME: -2 for a missing key, -1 for one without an expiry;
/// else the time left (at least 0) or the absolute time, seconds rounded to nearest.
fn ttl_generic(c: &mut Client, cmd: &Command, ms: bool, absolute: bool) -> CmdResult {
    let Some(item) = c.store()?.get_item(cmd.arg(1))? else { return Ok(Reply::Integer(-2)) };
    let Some(at) = item.expires_at_ms else { return Ok(Reply::Integer(-1)) };
    let at = i64::try_from(at).unwrap_or(i64::MAX);
    let value = if absolute { at } else { at.saturating_sub(now_unix_ms() as i64).max(0) };
    Ok(Reply::Integer(if ms { value } else { value.saturating_add(500) / 1000 }))
}

pub(super) fn ttl(c: &mut Client, cmd: &Command) -> CmdResult {
    ttl_generic(c, cmd, false, false)
}

pub(super) fn pttl(c: &mut Client, cmd: &Command) -> CmdResult {
    ttl_generic(c, cmd, true, false)
}

pub(super) fn expiretime(c: &mut Client, cmd: &Command) -> CmdResult {
    ttl_generic(c, cmd, false, true)
}

pub(super) fn pexpiretime(c: &mut Client, cmd: &Command) -> CmdResult {
    ttl_generic(c, cmd, true, true)
}

/// `PERSIST key`: 1 when the key had an expiry and now has none.
pub(super) fn persist(c: &mut Client, cmd: &Command) -> CmdResult {
    let changed = c.store()?.update_expiry(cmd.arg(1), &mut |current| match current {
        Some(_) => ExpiryUpdate::Set(None),
        None => ExpiryUpdate::Unchanged,
    })?;
    Ok(Reply::Integer(i64::from(changed.is_some_and(|(_, changed)| changed))))
}
