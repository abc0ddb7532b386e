//! One request ([`Command`]: its arguments, stored compactly) and the server-wide budget its
//! partly received bytes are charged to ([`QueryBudget`]). Below both the parser and the
//! inline-line splitter, which build commands; the parser fills their fields directly.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::metrics::METRICS;

/// What one argument costs in [`Command`] beyond its bytes (its end offset).
pub const ARG_OVERHEAD_BYTES: usize = std::mem::size_of::<usize>();

/// The bytes every connection's partly received commands may hold together, beyond each
/// one's [`UNCHARGED_BYTES`](crate::resp::UNCHARGED_BYTES): taken as their buffers grow (what really arrived, never a
/// claimed length), given back when the command has executed or the connection closes.
/// A parser that would go past it fails with [`ProtocolError::QueryBufferBudget`](crate::protocol_error::ProtocolError::QueryBufferBudget).
#[derive(Debug)]
pub struct QueryBudget {
    /// 0: unlimited.
    limit: AtomicUsize,
    used: AtomicUsize,
}

impl QueryBudget {
    /// A budget of `limit` bytes (0: unlimited).
    pub fn new(limit: usize) -> Arc<Self> {
        METRICS.query_buffer_budget.set(limit as i64);
        Arc::new(Self { limit: AtomicUsize::new(limit), used: AtomicUsize::new(0) })
    }

    /// The budget in bytes (0: unlimited).
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Changes the budget; bytes already held stay held (a lower budget refuses new growth).
    pub fn set_limit(&self, limit: usize) {
        METRICS.query_buffer_budget.set(limit as i64);
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether `bytes` more would fit now (a hint: others may take them first).
    pub(crate) fn fits(&self, bytes: usize) -> bool {
        let limit = self.limit();
        limit == 0 || self.used().saturating_add(bytes) <= limit
    }

    pub(crate) fn try_take(&self, bytes: usize) -> bool {
        let taken = self.used.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |used| {
            let limit = self.limit();
            let after = used.checked_add(bytes)?;
            (limit == 0 || after <= limit).then_some(after)
        });
        if taken.is_ok() {
            METRICS.query_buffer_bytes.add(bytes as i64);
        }
        taken.is_ok()
    }

    pub(crate) fn give(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        METRICS.query_buffer_bytes.sub(bytes as i64);
    }
}

/// Bytes taken from a [`QueryBudget`], given back when dropped.
#[derive(Default)]
pub(crate) struct Charge {
    budget: Option<Arc<QueryBudget>>,
    pub(crate) bytes: usize,
}

impl Charge {
    /// Makes the charge `target` bytes; false (and unchanged) when the budget refuses.
    pub(crate) fn set(&mut self, budget: &Arc<QueryBudget>, target: usize) -> bool {
        if target > self.bytes {
            if !budget.try_take(target - self.bytes) {
                return false;
            }
        } else if target < self.bytes {
            budget.give(self.bytes - target);
        }
        self.bytes = target;
        if self.budget.is_none() && target > 0 {
            self.budget = Some(Arc::clone(budget));
        }
        true
    }

    /// Moves `bytes` of this charge into a new one.
    pub(crate) fn split(&mut self, bytes: usize) -> Charge {
        let bytes = bytes.min(self.bytes);
        if bytes == 0 {
            return Charge::default();
        }
        self.bytes -= bytes;
        Charge { budget: self.budget.clone(), bytes }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let (Some(budget), true) = (&self.budget, self.bytes > 0) {
            budget.give(self.bytes);
        }
    }
}

/// One request: its arguments (the command name first). Small arguments are stored
/// contiguously, so a command of small arguments costs two allocations however many it has;
/// a large one ([`BIG_ARG_BYTES`](crate::resp::BIG_ARG_BYTES) or more) keeps the buffer it was received into.
#[derive(Default)]
pub struct Command {
    pub(crate) data: Vec<u8>,
    /// End offset of each argument in `data` (a large argument takes an empty range there).
    pub(crate) ends: Vec<usize>,
    /// Large arguments by index, ascending.
    pub(crate) big: Vec<(usize, Vec<u8>)>,
    pub(crate) big_bytes: usize,
    /// What this command holds of its server's [`QueryBudget`], given back when it is dropped
    /// or recycled (after it has executed).
    pub(crate) charge: Charge,
}

impl Command {
    /// A command with no arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A command made of `args` (for tests and clients).
    pub fn from_args<I, A>(args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: AsRef<[u8]>,
    {
        let mut cmd = Self::new();
        for arg in args {
            cmd.push(arg.as_ref());
        }
        cmd
    }

    /// Appends one argument.
    pub fn push(&mut self, arg: &[u8]) {
        self.data.extend_from_slice(arg);
        self.ends.push(self.data.len());
    }

    /// Appends one argument, keeping its buffer (no copy).
    pub fn push_owned(&mut self, arg: Vec<u8>) {
        self.big_bytes += arg.len();
        self.big.push((self.ends.len(), arg));
        self.ends.push(self.data.len());
    }

    /// Number of arguments, the name included.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there is no argument at all.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Argument `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let end = *self.ends.get(i)?;
        if !self.big.is_empty() {
            if let Ok(k) = self.big.binary_search_by_key(&i, |(j, _)| *j) {
                return Some(&self.big[k].1);
            }
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.data[start..end])
    }

    /// Argument `i`. Panics past the end, like slice indexing.
    pub fn arg(&self, i: usize) -> &[u8] {
        self.get(i).unwrap_or_else(|| panic!("argument {i} of a {}-argument command", self.len()))
    }

    /// Every argument, in order.
    pub fn args(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        (0..self.len()).map(|i| self.arg(i))
    }

    /// The memory this command is charged for against [`Limits::max_command_bytes`](crate::resp::Limits::max_command_bytes).
    pub fn charged_bytes(&self) -> usize {
        self.data.len() + self.big_bytes + self.ends.len() * ARG_OVERHEAD_BYTES
    }

    /// Bytes of its buffers not held by large arguments (what [`Parser`](crate::resp::Parser) charges beyond its
    /// allowance).
    pub(crate) fn small_capacity(&self) -> usize {
        self.data.capacity() + self.ends.capacity() * ARG_OVERHEAD_BYTES
    }

    pub(crate) fn clear(&mut self) {
        self.data.clear();
        self.ends.clear();
        self.big.clear();
        self.big_bytes = 0;
        self.charge = Charge::default();
    }
}

/// A copy holds no budget (only the parser's own commands are charged).
impl Clone for Command {
    fn clone(&self) -> Self {
        Self {
            data: self.data.clone(),
            ends: self.ends.clone(),
            big: self.big.clone(),
            big_bytes: self.big_bytes,
            charge: Charge::default(),
        }
    }
}

/// Equal arguments, however they are stored.
impl PartialEq for Command {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.args().zip(other.args()).all(|(a, b)| a == b)
    }
}

impl Eq for Command {}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.args().map(String::from_utf8_lossy)).finish()
    }
}
