//! String commands beyond GET and SET: APPEND, STRLEN, GETRANGE, SUBSTR, SETRANGE, GETDEL,
//! GETSET, INCRBYFLOAT, LCS (MSETNX is in `multikey.rs`), with Redis 7's replies, edge
//! cases and error texts.
//!
//! Writes are read-compute-compare-and-swap, retried while another writer gets in between
//! (at most [`MAX_INCR_ATTEMPTS`] times, then `-TRYAGAIN`), so each is atomic on its key, as
//! INCR is. A result longer than `proto-max-bulk-len` is refused before it is built (Redis'
//! check, and what bounds the memory a client's offset can make us allocate); a result the
//! store cannot hold (racekv's values are a few KiB) is refused by the store, and that
//! answer keeps Redis' wording.

use super::keys::MAX_INCR_ATTEMPTS;
use super::{fail, Client, CmdResult, Failure};
use crate::float80;
use crate::metrics::METRICS;
use crate::reply::Reply;
use crate::resp::{parse_i64, Command};
use crate::store::{PutMode, StoreError, StoreErrorKind};

const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";
const TOO_LONG: &str = "ERR string exceeds maximum allowed size (proto-max-bulk-len)";

/// Most cells (length of one string times the other's) an LCS computes. Redis allocates a
/// table of (m+1)(n+1) 32-bit cells and fails when malloc does; racekv keeps one bit per
/// cell (8 MiB at this limit) and two rows of lengths, and refuses beyond it, which also
/// bounds the time (about 0.1 s of CPU): two strings of 8 KiB each.
pub(crate) const MAX_LCS_CELLS: u64 = 1 << 26;

/// What a read-modify-write does with the key once it has seen the current value.
enum Write {
    /// Replace (or create) the value, if it is still what was read.
    Put(Vec<u8>),
    /// Remove the key, if its value is still what was read.
    Delete,
    /// Nothing to write: the answer depends on the read alone.
    Keep,
}

/// Reads `key`, lets `step` decide what to write and what to answer, and writes by
/// compare-and-swap; when another writer changed the key in between, starts over (at most
/// [`MAX_INCR_ATTEMPTS`] times, then `-TRYAGAIN`). `step` may run several times and must not
/// have effects of its own.
fn read_modify_write<T>(
    c: &mut Client,
    name: &'static str,
    key: &[u8],
    mut step: impl FnMut(Option<&[u8]>) -> Result<(Write, T), Failure>,
) -> Result<T, Failure> {
    for _ in 0..MAX_INCR_ATTEMPTS {
        let current = c.store()?.get(key)?;
        let (write, answer) = step(current.as_deref())?;
        let done = match write {
            Write::Keep => true,
            Write::Put(new) => c.store()?.compare_and_swap(key, current.as_deref(), &new)?,
            Write::Delete => match &current {
                None => true,
                Some(old) => c.store()?.compare_and_delete(key, old)?,
            },
        };
        if done {
            return Ok(answer);
        }
        METRICS.cas_retries.with_label_values(&[name]).inc();
    }
    Err(fail(format!("TRYAGAIN {name} lost {MAX_INCR_ATTEMPTS} compare-and-swap races on one key; retry")))
}

/// A value the store refused as too large, in the words Redis uses for a string past its
/// limit (the store's detail kept); other failures as they are.
fn string_too_long(failure: Failure) -> Failure {
    match failure {
        Failure::Store(e @ StoreError { kind: StoreErrorKind::ValueTooLarge, .. }) => {
            METRICS.store_errors.with_label_values(&[e.kind.as_str()]).inc();
            fail(format!("ERR string exceeds maximum allowed size (racekv's store: {})", e.message))
        }
        other => other,
    }
}

/// Redis' `checkStringLength`: would a string of `size + append` bytes pass
/// `proto-max-bulk-len`?
fn check_length(c: &Client, size: usize, append: usize) -> Result<(), Failure> {
    match size.checked_add(append) {
        Some(total) if total <= c.stats.proto_max_bulk_len() => Ok(()),
        _ => Err(fail(TOO_LONG)),
    }
}

/// `APPEND key value`: the length after appending; creates the key if absent.
pub(super) fn append(c: &mut Client, cmd: &Command) -> CmdResult {
    let (key, suffix) = (cmd.arg(1), cmd.arg(2));
    let max = c.stats.proto_max_bulk_len();
    let len = read_modify_write(c, "append", key, |current| {
        let Some(current) = current else {
            return Ok((Write::Put(suffix.to_vec()), suffix.len()));
        };
        if current.len().checked_add(suffix.len()).is_none_or(|total| total > max) {
            return Err(fail(TOO_LONG));
        }
        let mut value = Vec::with_capacity(current.len() + suffix.len());
        value.extend_from_slice(current);
        value.extend_from_slice(suffix);
        let len = value.len();
        Ok((Write::Put(value), len))
    })
    .map_err(string_too_long)?;
    Ok(Reply::Integer(len as i64))
}

/// `STRLEN key`: 0 for a missing key.
pub(super) fn strlen(c: &mut Client, cmd: &Command) -> CmdResult {
    let value = c.store()?.get(cmd.arg(1))?;
    c.stats.keyspace_lookup(value.is_some());
    Ok(Reply::Integer(value.map_or(0, |v| v.len() as i64)))
}

/// `GETRANGE key start end` (and its old name `SUBSTR`): inclusive, negative indexes count
/// from the end, out-of-range indexes are clamped; an empty string when nothing is left
/// (or the key is missing).
pub(super) fn getrange(c: &mut Client, cmd: &Command) -> CmdResult {
    let start = parse_i64(cmd.arg(2)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    let end = parse_i64(cmd.arg(3)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    let value = c.store()?.get(cmd.arg(1))?;
    c.stats.keyspace_lookup(value.is_some());
    let value = value.unwrap_or_default();
    Ok(Reply::Bulk(value.get(byte_range(value.len(), start, end)).unwrap_or_default().to_vec()))
}

/// Redis' `getrangeCommand` index rules, as a byte range of a string of `len` bytes.
fn byte_range(len: usize, start: i64, end: i64) -> std::ops::Range<usize> {
    let len = len as i64;
    if start < 0 && end < 0 && start > end {
        return 0..0;
    }
    let start = if start < 0 { len + start } else { start }.max(0);
    let end = if end < 0 { len + end } else { end }.max(0).min(len - 1);
    if start > end || len == 0 {
        return 0..0;
    }
    start as usize..end as usize + 1
}

/// `SETRANGE key offset value`: overwrites from `offset`, padding with zero bytes; the new
/// length. An empty `value` writes nothing (and creates no key).
pub(super) fn setrange(c: &mut Client, cmd: &Command) -> CmdResult {
    let offset = parse_i64(cmd.arg(2)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
    let offset = usize::try_from(offset).map_err(|_| fail("ERR offset is out of range"))?;
    let (key, patch) = (cmd.arg(1), cmd.arg(3));
    if !patch.is_empty() {
        check_length(c, offset, patch.len())?;
    }
    let len = read_modify_write(c, "setrange", key, |current| {
        if patch.is_empty() {
            return Ok((Write::Keep, current.map_or(0, <[u8]>::len)));
        }
        let current = current.unwrap_or_default();
        // Checked above: offset + patch.len() is at most proto-max-bulk-len.
        let mut value = current.to_vec();
        let end = offset + patch.len();
        if value.len() < end {
            value.resize(end, 0);
        }
        value[offset..end].copy_from_slice(patch);
        let len = value.len();
        Ok((Write::Put(value), len))
    })
    .map_err(string_too_long)?;
    Ok(Reply::Integer(len as i64))
}

/// `GETDEL key`: the value, and the key is gone (atomically: the delete is conditional on
/// the value read).
pub(super) fn getdel(c: &mut Client, cmd: &Command) -> CmdResult {
    let key = cmd.arg(1);
    let old = read_modify_write(c, "getdel", key, |current| {
        Ok(match current {
            None => (Write::Keep, None),
            Some(value) => (Write::Delete, Some(value.to_vec())),
        })
    })?;
    c.stats.keyspace_lookup(old.is_some());
    Ok(old.map_or(Reply::Nil, Reply::Bulk))
}

/// `GETSET key value`: sets the value, answers the previous one (nil if none).
pub(super) fn getset(c: &mut Client, cmd: &Command) -> CmdResult {
    // SET key value GET: one atomic write that returns the old value and, as a SET, clears
    // any expiry the key had.
    let options = crate::store::PutOptions { mode: PutMode::Upsert, expiry: crate::store::Expiry::Never, get: true };
    let old = c.store()?.put_opts(cmd.arg(1), cmd.arg(2), options)?.old;
    c.stats.keyspace_lookup(old.is_some());
    Ok(old.map_or(Reply::Nil, Reply::Bulk))
}

/// `INCRBYFLOAT key increment`: adds in x87 extended precision and stores the sum as Redis
/// prints it ([`float80`]); the reply is the new text.
pub(super) fn incrbyfloat(c: &mut Client, cmd: &Command) -> CmdResult {
    let (key, increment) = (cmd.arg(1), cmd.arg(2));
    let text = read_modify_write(c, "incrbyfloat", key, |current| {
        let text = float80::increment(current, increment).map_err(fail)?;
        Ok((Write::Put(text.clone().into_bytes()), text))
    })?;
    Ok(Reply::Bulk(text.into_bytes()))
}

/// What LCS answers.
struct LcsOptions {
    len: bool,
    idx: bool,
    with_match_len: bool,
    min_match_len: u64,
}

fn lcs_options(cmd: &Command) -> Result<LcsOptions, Failure> {
    let mut options = LcsOptions { len: false, idx: false, with_match_len: false, min_match_len: 0 };
    let mut i = 3;
    while i < cmd.len() {
        let option = cmd.arg(i).to_ascii_uppercase();
        match option.as_slice() {
            b"IDX" => options.idx = true,
            b"LEN" => options.len = true,
            b"WITHMATCHLEN" => options.with_match_len = true,
            b"MINMATCHLEN" if i + 1 < cmd.len() => {
                let n = parse_i64(cmd.arg(i + 1)).ok_or_else(|| fail(NOT_AN_INTEGER))?;
                options.min_match_len = n.max(0) as u64;
                i += 1;
            }
            _ => return Err(fail("ERR syntax error")),
        }
        i += 1;
    }
    if options.idx && options.len {
        return Err(fail("ERR If you want both the length and indexes, please just use IDX."));
    }
    Ok(options)
}

/// `LCS key1 key2 [LEN] [IDX] [MINMATCHLEN n] [WITHMATCHLEN]`: the longest common
/// subsequence of two strings (missing keys are empty), its length, or the matching ranges,
/// exactly as Redis' dynamic programming and walk back choose them. Refused past
/// [`MAX_LCS_CELLS`].
pub(super) fn lcs(c: &mut Client, cmd: &Command) -> CmdResult {
    let options = lcs_options(cmd)?;
    let values = c.store()?.get_in_order(&[cmd.arg(1), cmd.arg(2)])?;
    let [a, b]: [Option<Vec<u8>>; 2] =
        values.try_into().map_err(|v: Vec<_>| fail(format!("ERR storage returned {} values for 2 keys", v.len())))?;
    c.stats.keyspace_lookup(a.is_some());
    c.stats.keyspace_lookup(b.is_some());
    let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
    let cells = a.len() as u64 * b.len() as u64;
    if cells > MAX_LCS_CELLS {
        return Err(fail(format!(
            "ERR LCS of strings of {} and {} bytes needs {cells} cells, more than racekv's limit of {MAX_LCS_CELLS}",
            a.len(),
            b.len()
        )));
    }
    Ok(lcs_reply(&a, &b, &options))
}

/// One bit per cell of the table: whether LCS(i-1, j) > LCS(i, j-1), which is all the walk
/// back needs besides the strings themselves.
struct Directions {
    bits: Vec<u64>,
    width: usize,
}

impl Directions {
    fn new(rows: usize, width: usize) -> Self {
        Self { bits: vec![0; (rows * width).div_ceil(64)], width }
    }

    fn set(&mut self, i: usize, j: usize) {
        let n = (i - 1) * self.width + (j - 1);
        self.bits[n / 64] |= 1 << (n % 64);
    }

    fn up(&self, i: usize, j: usize) -> bool {
        let n = (i - 1) * self.width + (j - 1);
        self.bits[n / 64] >> (n % 64) & 1 == 1
    }
}

/// Redis' `lcsCommand` after the lookups, on strings within [`MAX_LCS_CELLS`].
fn lcs_reply(a: &[u8], b: &[u8], options: &LcsOptions) -> Reply {
    let compute_lcs = options.idx || !options.len;
    let mut directions = compute_lcs.then(|| Directions::new(a.len(), b.len()));
    let mut previous = vec![0u32; b.len() + 1];
    let mut row = vec![0u32; b.len() + 1];
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            row[j] = if a[i - 1] == b[j - 1] {
                previous[j - 1] + 1
            } else {
                let (up, left) = (previous[j], row[j - 1]);
                if up > left {
                    if let Some(d) = &mut directions {
                        d.set(i, j);
                    }
                }
                up.max(left)
            };
        }
        std::mem::swap(&mut previous, &mut row);
    }
    let total = previous[b.len()];
    let Some(directions) = directions else {
        return Reply::Integer(i64::from(total));
    };

    // The walk back from the end, emitting matching ranges as they close (Redis' order).
    let mut result = vec![0u8; total as usize];
    let mut idx = total as usize;
    let mut matches = Vec::new();
    let (mut i, mut j) = (a.len(), b.len());
    // `a_start == a.len()` means no range is open.
    let (mut a_start, mut a_end, mut b_start, mut b_end) = (a.len(), 0, 0, 0);
    while i > 0 && j > 0 {
        let mut emit = false;
        if a[i - 1] == b[j - 1] {
            result[idx - 1] = a[i - 1];
            if a_start == a.len() {
                (a_start, a_end, b_start, b_end) = (i - 1, i - 1, j - 1, j - 1);
            } else if a_start == i && b_start == j {
                a_start -= 1;
                b_start -= 1;
            } else {
                emit = true;
            }
            if a_start == 0 || b_start == 0 {
                emit = true;
            }
            idx -= 1;
            i -= 1;
            j -= 1;
        } else {
            if directions.up(i, j) {
                i -= 1;
            } else {
                j -= 1;
            }
            if a_start != a.len() {
                emit = true;
            }
        }
        if emit {
            let match_len = (a_end - a_start + 1) as u64;
            if options.idx && (options.min_match_len == 0 || match_len >= options.min_match_len) {
                let range = |from: usize, to: usize| Reply::Array(vec![int(from), int(to)]);
                let mut entry = vec![range(a_start, a_end), range(b_start, b_end)];
                if options.with_match_len {
                    entry.push(Reply::Integer(match_len as i64));
                }
                matches.push(Reply::Array(entry));
            }
            a_start = a.len();
        }
    }
    if options.idx {
        Reply::map([("matches", Reply::Array(matches)), ("len", Reply::Integer(i64::from(total)))])
    } else {
        Reply::Bulk(result)
    }
}

fn int(n: usize) -> Reply {
    Reply::Integer(n as i64)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::acl::Acl;
    use crate::commands::catalog;
    use crate::info::ServerStats;
    use crate::memstore::MemStore;
    use crate::store::{KvSession, KvStore};

    fn client_over(store: &MemStore) -> Client {
        let stats = Arc::new(ServerStats::new(6379, 100, None));
        Client::new(7, Arc::new(store.clone()), stats, Arc::new(Acl::open(catalog())))
    }

    fn run(c: &mut Client, args: &[&str]) -> Reply {
        c.execute(&Command::from_args(args))
    }

    fn run_bytes(c: &mut Client, args: &[&[u8]]) -> Reply {
        c.execute(&Command::from_args(args))
    }

    fn bulk(s: &str) -> Reply {
        Reply::bulk_str(s)
    }

    fn err(s: &str) -> Reply {
        Reply::Error(s.to_string().into())
    }

    const NOT_INT: &str = "ERR value is not an integer or out of range";

    #[test]
    fn append_and_strlen() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["STRLEN", "k"]), Reply::Integer(0));
        assert_eq!(run(&mut c, &["APPEND", "k", "Hello"]), Reply::Integer(5));
        assert_eq!(run(&mut c, &["append", "k", " World"]), Reply::Integer(11));
        assert_eq!(store.peek(b"k"), Some(b"Hello World".to_vec()));
        assert_eq!(run(&mut c, &["STRLEN", "k"]), Reply::Integer(11));
        assert_eq!(run(&mut c, &["APPEND", "e", ""]), Reply::Integer(0));
        assert_eq!(store.peek(b"e"), Some(Vec::new()), "APPEND of nothing still creates the key, as in Redis");
        assert_eq!(run(&mut c, &["APPEND", "k"]), err("ERR wrong number of arguments for 'append' command"));
    }

    #[test]
    fn strings_past_proto_max_bulk_len_or_the_store_limit_are_refused() {
        let store = MemStore::with_max_value_bytes(8);
        let mut c = client_over(&store);
        c.stats.settings.set_proto_max_bulk_len(16);
        assert_eq!(run(&mut c, &["APPEND", "k", "12345678"]), Reply::Integer(8));
        // 8 + 9 > 16: Redis' own check, before anything is built.
        assert_eq!(run(&mut c, &["APPEND", "k", "123456789"]), err(TOO_LONG));
        // 8 + 1 <= 16 but the store holds 8 bytes: Redis' words, the store's detail.
        assert_eq!(
            run(&mut c, &["APPEND", "k", "x"]),
            err("ERR string exceeds maximum allowed size (racekv's store: 9 bytes, limit 8)")
        );
        assert_eq!(store.peek(b"k"), Some(b"12345678".to_vec()), "a refused APPEND writes nothing");
        assert_eq!(run(&mut c, &["SETRANGE", "k", "16", "x"]), err(TOO_LONG));
        assert_eq!(run(&mut c, &["SETRANGE", "k", "9223372036854775807", "x"]), err(TOO_LONG));
        assert_eq!(
            run(&mut c, &["SETRANGE", "k", "8", "x"]),
            err("ERR string exceeds maximum allowed size (racekv's store: 9 bytes, limit 8)")
        );
        assert_eq!(run(&mut c, &["SETRANGE", "k", "15", ""]), Reply::Integer(8), "nothing to write: no check");
    }

    #[test]
    fn getrange_clamps_and_counts_from_the_end() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["SET", "k", "This is a string"]), Reply::ok());
        assert_eq!(run(&mut c, &["GETRANGE", "k", "0", "3"]), bulk("This"));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "-3", "-1"]), bulk("ing"));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "0", "-1"]), bulk("This is a string"));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "10", "100"]), bulk("string"));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "5", "3"]), bulk(""));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "-1", "-5"]), bulk(""));
        assert_eq!(run(&mut c, &["SUBSTR", "k", "-100", "1"]), bulk("Th"));
        assert_eq!(run(&mut c, &["GETRANGE", "missing", "0", "-1"]), bulk(""));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "a", "1"]), err(NOT_INT));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "0", "1.5"]), err(NOT_INT));
        assert_eq!(run(&mut c, &["GETRANGE", "k", "0"]), err("ERR wrong number of arguments for 'getrange' command"));
    }

    #[test]
    fn setrange_pads_with_zero_bytes() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["SETRANGE", "k", "0", ""]), Reply::Integer(0));
        assert_eq!(store.peek(b"k"), None, "an empty SETRANGE creates no key");
        assert_eq!(run(&mut c, &["SETRANGE", "k", "3", "ab"]), Reply::Integer(5));
        assert_eq!(store.peek(b"k"), Some(b"\0\0\0ab".to_vec()));
        assert_eq!(run(&mut c, &["SET", "h", "Hello World"]), Reply::ok());
        assert_eq!(run(&mut c, &["SETRANGE", "h", "6", "Redis"]), Reply::Integer(11));
        assert_eq!(store.peek(b"h"), Some(b"Hello Redis".to_vec()));
        assert_eq!(run(&mut c, &["SETRANGE", "h", "0", ""]), Reply::Integer(11));
        assert_eq!(run(&mut c, &["SETRANGE", "h", "-1", "x"]), err("ERR offset is out of range"));
        assert_eq!(run(&mut c, &["SETRANGE", "h", "x", "x"]), err(NOT_INT));
    }

    #[test]
    fn getdel_getset_and_msetnx() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["GETDEL", "k"]), Reply::Nil);
        assert_eq!(run(&mut c, &["GETSET", "k", "1"]), Reply::Nil);
        assert_eq!(run(&mut c, &["GETSET", "k", "2"]), bulk("1"));
        assert_eq!(run(&mut c, &["GETDEL", "k"]), bulk("2"));
        assert_eq!(store.peek(b"k"), None);
        assert_eq!(run(&mut c, &["MSETNX", "n", "a"]), Reply::Integer(1));
        assert_eq!(run(&mut c, &["MSETNX", "n", "b"]), Reply::Integer(0));
        assert_eq!(run(&mut c, &["MSETNX", "m", "a", "m", "b"]), Reply::Integer(1));
        assert_eq!(store.peek(b"m"), Some(b"b".to_vec()), "the last value of a key wins, as in Redis");
        assert_eq!(run(&mut c, &["MSETNX", "x", "1", "y", "2"]), Reply::Integer(1));
        assert_eq!(run(&mut c, &["MSETNX", "y", "3", "z", "4"]), Reply::Integer(0));
        assert_eq!((store.peek(b"y"), store.peek(b"z")), (Some(b"2".to_vec()), None), "all or nothing");
        assert_eq!(run(&mut c, &["MSETNX", "x", "1", "y"]), err("ERR wrong number of arguments for 'msetnx' command"));
    }

    #[test]
    fn incrbyfloat_writes_redis_text() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        assert_eq!(run(&mut c, &["SET", "f", "10.50"]), Reply::ok());
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "f", "0.1"]), bulk("10.6"));
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "f", "-5"]), bulk("5.6"));
        assert_eq!(run(&mut c, &["SET", "e", "5.0e3"]), Reply::ok());
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "e", "2.0e2"]), bulk("5200"));
        assert_eq!(store.peek(b"e"), Some(b"5200".to_vec()));
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "new", "3"]), bulk("3"));
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "f", "x"]), err("ERR value is not a valid float"));
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "f", "inf"]), err("ERR increment would produce NaN or Infinity"));
        assert_eq!(run(&mut c, &["SET", "s", "abc"]), Reply::ok());
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "s", "1"]), err("ERR value is not a valid float"));
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "missing", "x"]), err("ERR value is not a valid float"));
        assert_eq!(store.peek(b"missing"), None, "a refused increment writes nothing");
        assert_eq!(store.peek(b"f"), Some(b"5.6".to_vec()));
    }

    #[test]
    fn lcs_options_errors_and_limit() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        run(&mut c, &["MSET", "a", "ohmytext", "b", "mynewtext"]);
        assert_eq!(run(&mut c, &["LCS", "a", "b"]), bulk("mytext"));
        assert_eq!(run(&mut c, &["lcs", "a", "b", "len"]), Reply::Integer(6));
        assert_eq!(run(&mut c, &["LCS", "a", "missing"]), bulk(""));
        let pair = |x: i64, y: i64| Reply::Array(vec![Reply::Integer(x), Reply::Integer(y)]);
        assert_eq!(
            run(&mut c, &["LCS", "a", "b", "IDX", "MINMATCHLEN", "4", "WITHMATCHLEN"]),
            Reply::map([
                ("matches", Reply::Array(vec![Reply::Array(vec![pair(4, 7), pair(5, 8), Reply::Integer(4)])])),
                ("len", Reply::Integer(6)),
            ])
        );
        assert_eq!(
            run(&mut c, &["LCS", "a", "b", "IDX", "LEN"]),
            err("ERR If you want both the length and indexes, please just use IDX.")
        );
        assert_eq!(run(&mut c, &["LCS", "a", "b", "MINMATCHLEN"]), err("ERR syntax error"));
        assert_eq!(run(&mut c, &["LCS", "a", "b", "MINMATCHLEN", "x"]), err(NOT_INT));
        assert_eq!(run(&mut c, &["LCS", "a", "b", "FOO"]), err("ERR syntax error"));
        let side = 1 << 13;
        let (x, y) = (vec![b'x'; side], vec![b'y'; side + 1]);
        assert_eq!(run_bytes(&mut c, &[b"SET", b"x", &x]), Reply::ok());
        assert_eq!(run_bytes(&mut c, &[b"SET", b"y", &y]), Reply::ok());
        assert_eq!(
            run(&mut c, &["LCS", "x", "y", "LEN"]),
            err("ERR LCS of strings of 8192 and 8193 bytes needs 67117056 cells, more than racekv's limit of 67108864")
        );
    }

    /// A session whose compare-and-swaps (and compare-and-deletes) first lose `losses` times:
    /// another writer appends `!` between our read and our write.
    struct Racing {
        inner: MemStore,
        losses: Arc<AtomicUsize>,
    }

    impl Racing {
        fn interfere(&mut self, key: &[u8]) -> Result<(), StoreError> {
            if self.losses.load(Ordering::SeqCst) > 0 {
                self.losses.fetch_sub(1, Ordering::SeqCst);
                let mut value = self.inner.get(key)?.unwrap_or_default();
                value.push(b'!');
                self.inner.put(key, &value, PutMode::Upsert)?;
            }
            Ok(())
        }
    }

    impl KvSession for Racing {
        fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.get(key)
        }
        fn put(&mut self, key: &[u8], value: &[u8], mode: PutMode) -> Result<bool, StoreError> {
            self.inner.put(key, value, mode)
        }
        fn delete(&mut self, key: &[u8]) -> Result<bool, StoreError> {
            self.inner.delete(key)
        }
        fn compare_and_swap(&mut self, key: &[u8], expected: Option<&[u8]>, new: &[u8]) -> Result<bool, StoreError> {
            self.interfere(key)?;
            self.inner.compare_and_swap(key, expected, new)
        }
        fn compare_and_delete(&mut self, key: &[u8], expected: &[u8]) -> Result<bool, StoreError> {
            self.interfere(key)?;
            self.inner.compare_and_delete(key, expected)
        }
        fn get_in_order(&mut self, keys: &[&[u8]]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
            self.inner.get_in_order(keys)
        }
        fn multi_put(&mut self, pairs: &[(&[u8], &[u8])]) -> Result<(), StoreError> {
            self.inner.multi_put(pairs)
        }
        fn len(&mut self) -> Result<u64, StoreError> {
            self.inner.len()
        }
        fn scan(&mut self, cursor: u64, count: usize) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
            self.inner.scan(cursor, count)
        }
        fn random_key(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.random_key()
        }
        fn flush(&mut self) -> Result<u64, StoreError> {
            self.inner.flush()
        }
        fn put_opts(
            &mut self,
            key: &[u8],
            value: &[u8],
            options: crate::store::PutOptions,
        ) -> Result<crate::store::PutResult, StoreError> {
            self.inner.put_opts(key, value, options)
        }
        fn get_item(&mut self, key: &[u8]) -> Result<Option<crate::store::Item>, StoreError> {
            self.inner.get_item(key)
        }
        fn update_expiry(
            &mut self,
            key: &[u8],
            decide: &mut dyn FnMut(Option<u64>) -> crate::store::ExpiryUpdate,
        ) -> Result<Option<(Vec<u8>, bool)>, StoreError> {
            self.inner.update_expiry(key, decide)
        }
        fn info(&mut self) -> Result<String, StoreError> {
            self.inner.info()
        }
    }

    struct OneSession(parking_lot::Mutex<Option<Racing>>);

    impl KvStore for OneSession {
        fn session(&self) -> Result<Box<dyn KvSession>, StoreError> {
            Ok(Box::new(self.0.lock().take().expect("one session")))
        }
    }

    fn racing_client(losses: usize) -> (Client, MemStore, Arc<AtomicUsize>) {
        let inner = MemStore::new();
        let left = Arc::new(AtomicUsize::new(losses));
        let session = Racing { inner: inner.clone(), losses: Arc::clone(&left) };
        let store = Arc::new(OneSession(parking_lot::Mutex::new(Some(session))));
        let stats = Arc::new(ServerStats::new(1, 1, None));
        (Client::new(1, store, stats, Arc::new(Acl::open(catalog()))), inner, left)
    }

    /// Each write sees another writer's value and retries on it, so nothing is lost: the
    /// other writer's `!` is in the result, and GETDEL answers the value it deleted.
    #[test]
    fn writes_retry_lost_races_without_losing_other_writes() {
        let (mut c, mut store, left) = racing_client(2);
        store.put(b"k", b"a", PutMode::Upsert).unwrap();
        assert_eq!(run(&mut c, &["APPEND", "k", "b"]), Reply::Integer(4));
        assert_eq!(store.peek(b"k"), Some(b"a!!b".to_vec()));
        left.store(1, Ordering::SeqCst);
        assert_eq!(run(&mut c, &["GETDEL", "k"]), bulk("a!!b!"));
        assert_eq!(store.peek(b"k"), None);
        left.store(1, Ordering::SeqCst);
        store.put(b"f", b"1", PutMode::Upsert).unwrap();
        // "1!" is not a float: the retry reads it and refuses, as Redis would have.
        assert_eq!(run(&mut c, &["INCRBYFLOAT", "f", "1"]), err("ERR value is not a valid float"));
    }

    #[test]
    fn writes_give_up_after_a_bounded_number_of_lost_races() {
        let (mut c, mut store, left) = racing_client(usize::MAX);
        store.put(b"k", b"a", PutMode::Upsert).unwrap();
        assert_eq!(
            run(&mut c, &["SETRANGE", "k", "0", "b"]),
            err(&format!("TRYAGAIN setrange lost {MAX_INCR_ATTEMPTS} compare-and-swap races on one key; retry"))
        );
        assert_eq!(usize::MAX - left.load(Ordering::SeqCst), MAX_INCR_ATTEMPTS);
    }

    #[test]
    fn reads_count_keyspace_hits_and_misses() {
        let store = MemStore::new();
        let mut c = client_over(&store);
        run(&mut c, &["SET", "k", "v"]);
        for args in [&["GET", "k"][..], &["GET", "nope"], &["MGET", "k", "nope", "k"], &["EXISTS", "k", "nope"]] {
            run(&mut c, args);
        }
        for args in [&["STRLEN", "k"][..], &["GETRANGE", "nope", "0", "1"], &["LCS", "k", "nope"]] {
            run(&mut c, args);
        }
        assert_eq!(c.stats.keyspace_hits_and_misses(), (6, 5));
    }

    #[test]
    fn ranges_follow_redis_index_rules() {
        let cases: [(usize, i64, i64, std::ops::Range<usize>); 12] = [
            (10, 0, -1, 0..10),
            (10, 0, 3, 0..4),
            (10, -3, -1, 7..10),
            (10, 5, 100, 5..10),
            (10, -100, 2, 0..3),
            (10, 4, 2, 0..0),
            (10, -1, -3, 0..0),
            (10, 10, 20, 0..0),
            (0, 0, -1, 0..0),
            (0, 0, 0, 0..0),
            (10, i64::MIN, i64::MAX, 0..10),
            (10, -11, -11, 0..1),
        ];
        for (len, start, end, want) in cases {
            assert_eq!(byte_range(len, start, end), want, "len {len} [{start}, {end}]");
        }
    }

    /// Redis' `lcsCommand` as written (a full table of lengths), the oracle for the
    /// one-bit-per-cell version.
    fn redis_lcs(a: &[u8], b: &[u8], options: &LcsOptions) -> Reply {
        let width = b.len() + 1;
        let mut dp = vec![0u32; (a.len() + 1) * width];
        for i in 1..=a.len() {
            for j in 1..=b.len() {
                dp[i * width + j] = if a[i - 1] == b[j - 1] {
                    dp[(i - 1) * width + j - 1] + 1
                } else {
                    dp[(i - 1) * width + j].max(dp[i * width + j - 1])
                };
            }
        }
        let total = dp[a.len() * width + b.len()];
        if options.len && !options.idx {
            return Reply::Integer(i64::from(total));
        }
        let mut result = vec![0u8; total as usize];
        let mut idx = total as usize;
        let mut matches = Vec::new();
        let (mut i, mut j) = (a.len(), b.len());
        let (mut a_start, mut a_end, mut b_start, mut b_end) = (a.len(), 0, 0, 0);
        while i > 0 && j > 0 {
            let mut emit = false;
            if a[i - 1] == b[j - 1] {
                result[idx - 1] = a[i - 1];
                if a_start == a.len() {
                    (a_start, a_end, b_start, b_end) = (i - 1, i - 1, j - 1, j - 1);
                } else if a_start == i && b_start == j {
                    a_start -= 1;
                    b_start -= 1;
                } else {
                    emit = true;
                }
                if a_start == 0 || b_start == 0 {
                    emit = true;
                }
                idx -= 1;
                i -= 1;
                j -= 1;
            } else {
                if dp[(i - 1) * width + j] > dp[i * width + j - 1] {
                    i -= 1;
                } else {
                    j -= 1;
                }
                if a_start != a.len() {
                    emit = true;
                }
            }
            if emit {
                let len = (a_end - a_start + 1) as u64;
                if options.idx && (options.min_match_len == 0 || len >= options.min_match_len) {
                    let range = |x: usize, y: usize| Reply::Array(vec![int(x), int(y)]);
                    let mut entry = vec![range(a_start, a_end), range(b_start, b_end)];
                    if options.with_match_len {
                        entry.push(Reply::Integer(len as i64));
                    }
                    matches.push(Reply::Array(entry));
                }
                a_start = a.len();
            }
        }
        if options.idx {
            Reply::map([("matches", Reply::Array(matches)), ("len", Reply::Integer(i64::from(total)))])
        } else {
            Reply::Bulk(result)
        }
    }

    proptest::proptest! {
        #[test]
        fn lcs_matches_redis_full_table(
            a in proptest::collection::vec(b'a'..b'e', 0..40),
            b in proptest::collection::vec(b'a'..b'e', 0..40),
            len in proptest::prelude::any::<bool>(),
            idx in proptest::prelude::any::<bool>(),
            with_match_len in proptest::prelude::any::<bool>(),
            min_match_len in 0u64..4,
        ) {
            let options = LcsOptions { len: len && !idx, idx, with_match_len, min_match_len };
            proptest::prop_assert_eq!(lcs_reply(&a, &b, &options), redis_lcs(&a, &b, &options));
        }
    }

    #[test]
    fn lcs_walks_back_as_redis_does() {
        let all = LcsOptions { len: false, idx: true, with_match_len: true, min_match_len: 0 };
        let Reply::Map(fields) = lcs_reply(b"ohmytext", b"mynewtext", &all) else { panic!("not a map") };
        let pair = |a: i64, b: i64| Reply::Array(vec![Reply::Integer(a), Reply::Integer(b)]);
        assert_eq!(
            fields[0].1,
            Reply::Array(vec![
                Reply::Array(vec![pair(4, 7), pair(5, 8), Reply::Integer(4)]),
                Reply::Array(vec![pair(2, 3), pair(0, 1), Reply::Integer(2)]),
            ])
        );
        assert_eq!(fields[1], (Reply::bulk_str("len"), Reply::Integer(6)));
        let plain = LcsOptions { len: false, idx: false, with_match_len: false, min_match_len: 0 };
        assert_eq!(lcs_reply(b"ohmytext", b"mynewtext", &plain), Reply::bulk_str("mytext"));
        assert_eq!(lcs_reply(b"", b"abc", &plain), Reply::bulk_str(""));
        let len = LcsOptions { len: true, ..plain };
        assert_eq!(lcs_reply(b"abcbdab", b"bdcaba", &len), Reply::Integer(4));
    }
}
