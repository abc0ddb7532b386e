//! Commands on keys: GET, SETNX, DEL, EXISTS, MGET, INCR and friends, DBSIZE (SET, with
//! its expiry options, is in `expiry.rs`; MSET in `multikey.rs`). INCR and friends keep
//! the key's expiry: the store's compare-and-swap keeps it.

use super::{fail, Client, CmdResult, Failure};
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::store::PutMode;

/// Compare-and-swap attempts an increment makes before giving up under contention. Each
/// attempt costs a read and a CAS; 64 losses in a row means a hot key under heavy writes,
/// where an error the client can retry beats an unbounded loop.
pub(crate) const MAX_INCR_ATTEMPTS: usize = 64;

const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";

pub(super) fn get(c: &mut Client, cmd: &Command) -> CmdResult {
    Ok(c.store()?.get(cmd.arg(1))?.map_or(Reply::Nil, Reply::Bulk))
}

pub(super) fn setnx(c: &mut Client, cmd: &Command) -> CmdResult {
    let applied = c.store()?.put(cmd.arg(1), cmd.arg(2), PutMode::InsertOnly)?;
    Ok(Reply::Integer(i64::from(applied)))
}

/// Deletes keys one by one; a key named twice counts once, as in Redis.
pub(super) fn del(c: &mut Client, cmd: &Command) -> CmdResult {
    let mut deleted = 0;
    for key in cmd.args().skip(1) {
        if c.store()?.delete(key)? {
            deleted += 1;
        }
    }
    Ok(Reply::Integer(deleted))
}

/// Counts present keys; a key named twice counts twice, as in Redis.
pub(super) fn exists(c: &mut Client, cmd: &Command) -> CmdResult {
    let keys: Vec<&[u8]> = cmd.args().skip(1).collect();
    let values = c.store()?.get_in_order(&keys)?;
    Ok(Reply::Integer(values.iter().filter(|v| v.is_some()).count() as i64))
}

pub(super) fn mget(c: &mut Client, cmd: &Command) -> CmdResult {
    let keys: Vec<&[u8]> = cmd.args().skip(1).collect();
    let values = c.store()?.get_in_order(&keys)?;
    if values.len() != keys.len() {
        return Err(fail(format!("ERR storage returned {} values for {} keys", values.len(), keys.len())));
    }
    Ok(Reply::Array(values.into_iter().map(|v| v.map_or(Reply::Nil, Reply::Bulk)).collect()))
}

pub(super) fn incr(c: &mut Client, cmd: &Command) -> CmdResult {
    add(c, "INCR", cmd.arg(1), 1)
}

pub(super) fn decr(c: &mut Client, cmd: &Command) -> CmdResult {
    add(c, "DECR", cmd.arg(1), -1)
}

pub(super) fn incrby(c: &mut Client, cmd: &Command) -> CmdResult {
    let delta = parse_i64(cmd.arg(2)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    add(c, "INCRBY", cmd.arg(1), delta)
}

pub(super) fn decrby(c: &mut Client, cmd: &Command) -> CmdResult {
    let decrement = parse_i64(cmd.arg(2)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    let delta = decrement.checked_neg().ok_or_else(|| fail("ERR decrement would overflow"))?;
    add(c, "DECRBY", cmd.arg(1), delta)
}

/// Adds `delta` to the integer stored at `key` (absent = 0) with a read and a
/// compare-and-swap, retried while another writer gets in between.
///
/// Errors as in Redis: a stored value that is not a canonical 64-bit integer (or is out of
/// range) gives `value is not an integer or out of range`; a result past the 64-bit range
/// gives `increment or decrement would overflow`, and nothing is written.
fn add(c: &mut Client, name: &str, key: &[u8], delta: i64) -> CmdResult {
    for _ in 0..MAX_INCR_ATTEMPTS {
        let current = c.store()?.get(key)?;
        let value = match &current {
            None => 0,
            Some(bytes) => parse_i64(bytes).ok_or_else(|| fail(NOT_AN_INTEGER))?,
        };
        let next = value.checked_add(delta).ok_or_else(|| fail("ERR increment or decrement would overflow"))?;
        if c.store()?.compare_and_swap(key, current.as_deref(), next.to_string().as_bytes())? {
            return Ok(Reply::Integer(next));
        }
    }
    Err(Failure::Reply(
        format!("TRYAGAIN {name} lost {MAX_INCR_ATTEMPTS} compare-and-swap races on one key; retry").into(),
    ))
}

pub(super) fn dbsize(c: &mut Client, _cmd: &Command) -> CmdResult {
    let keys = c.store()?.len()?;
    Ok(Reply::Integer(i64::try_from(keys).unwrap_or(i64::MAX)))
}
