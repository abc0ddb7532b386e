//! Commands that write several keys at once, atomically on the store's commit
//! ([`KvSession::commit`]): MSET, MSETNX, RENAME, RENAMENX, COPY.
//!
//! Each reads the keys its answer depends on with their versions, decides, and commits
//! those versions with its writes: when another writer got in between, it starts over (at
//! most [`MAX_INCR_ATTEMPTS`] times, then `-TRYAGAIN`); so does MSET, whose blind writes
//! lose only to a transaction holding one of its keys. Inside MULTI the store they see is
//! the transaction's, and their writes join its commit.

use super::keys::MAX_INCR_ATTEMPTS;
use super::transactions::backoff;
use super::{arity_error, fail, Client, CmdResult, Failure};
use crate::metrics::METRICS;
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::store::{Item, KeyVersion, KvSession, TxnWrite};

/// What a multi-key command decided from what it read.
struct Plan<T> {
    /// The keys the decision rests on, with the versions read.
    reads: Vec<(Vec<u8>, KeyVersion)>,
    /// Keys to write (None: delete).
    writes: Vec<(Vec<u8>, Option<Item>)>,
    answer: T,
}

/// Runs `attempt` until it answers (Some), backing off between attempts, at most
/// [`MAX_INCR_ATTEMPTS`] times (then `-TRYAGAIN`): None means its commit lost to another
/// writer.
fn with_retries<T>(name: &'static str, mut attempt: impl FnMut() -> Result<Option<T>, Failure>) -> Result<T, Failure> {
    for n in 0..MAX_INCR_ATTEMPTS as u32 {
        if n > 0 {
            METRICS.multi_key_retries.with_label_values(&[name]).inc();
            backoff(n - 1);
        }
        if let Some(answer) = attempt()? {
            return Ok(answer);
        }
    }
    Err(fail(format!("TRYAGAIN {} lost {MAX_INCR_ATTEMPTS} commits to other writers; retry", name.to_uppercase())))
}

/// Plans with `plan` and commits, again while another writer changes what it read. A plan
/// that writes nothing and rests on one read is answered without a commit (that read is
/// its moment); one resting on several is committed (with no writes) so that they were
/// all true at once.
fn commit_loop<T>(
    c: &mut Client,
    name: &'static str,
    mut plan: impl FnMut(&mut dyn KvSession) -> Result<Plan<T>, Failure>,
) -> Result<T, Failure> {
    with_retries(name, || {
        let store = c.store()?;
        let Plan { reads, writes, answer } = plan(store)?;
        if writes.is_empty() && reads.len() <= 1 {
            return Ok(Some(answer));
        }
        let reads: Vec<(&[u8], KeyVersion)> = reads.iter().map(|(k, v)| (k.as_slice(), *v)).collect();
        let writes: Vec<TxnWrite<'_>> = writes
            .iter()
            .map(|(key, item)| TxnWrite {
                key,
                value: item.as_ref().map(|i| i.value.as_slice()),
                expires_at_ms: item.as_ref().and_then(|i| i.expires_at_ms),
            })
            .collect();
        Ok(store.commit(&reads, &writes)?.then_some(answer))
    })
}

/// The pairs of `MSET`/`MSETNX key value [key value ...]`.
fn pairs(cmd: &Command) -> Vec<(&[u8], &[u8])> {
    let args: Vec<&[u8]> = cmd.args().skip(1).collect();
    args.chunks_exact(2).map(|pair| (pair[0], pair[1])).collect()
}

/// `MSET key value [key value ...]`: every pair at once (a later pair of the same key
/// wins); each key loses its expiry, as a SET.
pub(super) fn mset(c: &mut Client, cmd: &Command) -> CmdResult {
    if cmd.len().is_multiple_of(2) {
        return Ok(arity_error("mset"));
    }
    let writes: Vec<TxnWrite<'_>> =
        pairs(cmd).into_iter().map(|(key, value)| TxnWrite { key, value: Some(value), expires_at_ms: None }).collect();
    // No reads, but the commit still loses when another transaction holds one of its keys
    // (a concurrent MSET of the same key, from another event loop or computenode).
    with_retries("mset", || Ok(c.store()?.commit(&[], &writes)?.then(Reply::ok)))
}

/// `MSETNX key value [key value ...]`: every pair if no key exists, else nothing.
pub(super) fn msetnx(c: &mut Client, cmd: &Command) -> CmdResult {
    if cmd.len().is_multiple_of(2) {
        return Ok(arity_error("msetnx"));
    }
    let pairs = pairs(cmd);
    let mut keys: Vec<&[u8]> = pairs.iter().map(|(k, _)| *k).collect();
    keys.sort_unstable();
    keys.dedup();
    let set = commit_loop(c, "msetnx", |store| {
        let mut reads = Vec::with_capacity(keys.len());
        for key in &keys {
            let (item, version) = store.read_versioned(key)?;
            if item.is_some() {
                return Ok(Plan { reads: vec![(key.to_vec(), version)], writes: vec![], answer: false });
            }
            reads.push((key.to_vec(), version));
        }
        let writes =
            pairs.iter().map(|(k, v)| (k.to_vec(), Some(Item { value: v.to_vec(), expires_at_ms: None }))).collect();
        Ok(Plan { reads, writes, answer: true })
    })?;
    Ok(Reply::Integer(i64::from(set)))
}

/// `RENAME key newkey`.
pub(super) fn rename(c: &mut Client, cmd: &Command) -> CmdResult {
    rename_generic(c, cmd, false)
}

/// `RENAMENX key newkey`.
pub(super) fn renamenx(c: &mut Client, cmd: &Command) -> CmdResult {
    rename_generic(c, cmd, true)
}

/// Redis' `renameGenericCommand`: the value and its expiry move to `newkey` (replacing
/// it, or with `nx` only if it is absent); a missing key is an error, even onto itself.
fn rename_generic(c: &mut Client, cmd: &Command, nx: bool) -> CmdResult {
    let (src, dst) = (cmd.arg(1), cmd.arg(2));
    let name = if nx { "renamenx" } else { "rename" };
    let renamed = commit_loop(c, name, |store| {
        let (item, src_version) = store.read_versioned(src)?;
        let Some(item) = item else { return Err(fail("ERR no such key")) };
        let mut reads = vec![(src.to_vec(), src_version)];
        if src == dst {
            return Ok(Plan { reads, writes: vec![], answer: !nx });
        }
        if nx {
            let (present, dst_version) = store.read_versioned(dst)?;
            reads.push((dst.to_vec(), dst_version));
            if present.is_some() {
                return Ok(Plan { reads, writes: vec![], answer: false });
            }
        }
        Ok(Plan { reads, writes: vec![(src.to_vec(), None), (dst.to_vec(), Some(item))], answer: true })
    })?;
    Ok(if nx { Reply::Integer(i64::from(renamed)) } else { Reply::ok() })
}

/// `COPY source destination [DB destination-db] [REPLACE]`: 1 when copied (value and
/// expiry), 0 when the source is missing or the destination exists without REPLACE.
/// racekv has one database: any DB but 0 is out of range, as SELECT says.
pub(super) fn copy(c: &mut Client, cmd: &Command) -> CmdResult {
    let (src, dst) = (cmd.arg(1), cmd.arg(2));
    let mut replace = false;
    let mut i = 3;
    while i < cmd.len() {
        let option = cmd.arg(i);
        if option.eq_ignore_ascii_case(b"replace") {
            replace = true;
        } else if option.eq_ignore_ascii_case(b"db") && i + 1 < cmd.len() {
            match parse_i64(cmd.arg(i + 1)).filter(|db| i32::try_from(*db).is_ok()) {
                Some(0) => {}
                Some(_) => return Err(fail("ERR DB index is out of range")),
                None => return Err(fail("ERR value is not an integer or out of range")),
            }
            i += 1;
        } else {
            return Err(fail("ERR syntax error"));
        }
        i += 1;
    }
    if src == dst {
        return Err(fail("ERR source and destination objects are the same"));
    }
    let copied = commit_loop(c, "copy", |store| {
        let (item, src_version) = store.read_versioned(src)?;
        let mut reads = vec![(src.to_vec(), src_version)];
        let Some(item) = item else { return Ok(Plan { reads, writes: vec![], answer: false }) };
        if !replace {
            let (present, dst_version) = store.read_versioned(dst)?;
            reads.push((dst.to_vec(), dst_version));
            if present.is_some() {
                return Ok(Plan { reads, writes: vec![], answer: false });
            }
        }
        Ok(Plan { reads, writes: vec![(dst.to_vec(), Some(item))], answer: true })
    })?;
    Ok(Reply::Integer(i64::from(copied)))
}
