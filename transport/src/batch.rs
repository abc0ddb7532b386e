//! A batch of one-sided operations that travels as one unit and completes op by op.
//!
//! Build it with [`Batch::read`], [`Batch::write`], [`Batch::cas`] and [`Batch::faa`], hand it
//! to [`crate::Transport::execute`], then read each op's outcome through its handle. A batch is
//! reusable: [`Batch::clear`] keeps its buffers, so the hot path does not allocate.
//!
//! Ordering: ops execute in the order they were added; each sees the effects of the ones
//! before it. If an op fails, every later op is reported [`OpError::NotExecuted`].

use crate::error::{OpError, TransportError};

/// At most this many ops in one batch (a NIC send queue is bounded too).
pub const MAX_BATCH_OPS: usize = 256;
/// At most this many bytes in one read or write.
pub const MAX_OP_BYTES: u64 = 16 << 20;
/// At most this many bytes read, and this many written, by one batch.
pub const MAX_BATCH_BYTES: u64 = 16 << 20;

/// The four one-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    /// Read bytes from the region.
    Read = 1,
    /// Write bytes into the region.
    Write = 2,
    /// 8-byte compare-and-swap; completes with the old value.
    Cas = 3,
    /// 8-byte fetch-and-add (wrapping); completes with the old value.
    Faa = 4,
}

impl OpKind {
    /// The op kind with wire code `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(OpKind::Read),
            2 => Some(OpKind::Write),
            3 => Some(OpKind::Cas),
            4 => Some(OpKind::Faa),
            _ => None,
        }
    }
}

/// The state of one op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Not executed yet.
    Pending,
    /// Done; for CAS and FAA the value is the old word, otherwise 0.
    Done(u64),
    /// Failed; the batch's later ops were not executed.
    Failed(OpError),
}

/// One op as a transport sees it.
#[derive(Debug, Clone, Copy)]
pub struct Op {
    /// What the op does.
    pub kind: OpKind,
    /// Region offset it acts on.
    pub offset: u64,
    /// Bytes for READ and WRITE; 8 for CAS and FAA.
    pub len: u32,
    /// READ: where its bytes start in the batch's read buffer; WRITE: in its write buffer.
    buf_at: u32,
    /// CAS: expected value; FAA: addend.
    pub arg0: u64,
    /// CAS: new value.
    pub arg1: u64,
    /// Its state.
    pub outcome: Outcome,
}

/// Handle to a READ's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadId(u32);
/// Handle to a WRITE, CAS or FAA result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpId(u32);

/// A reusable batch of ops.
#[derive(Debug, Default)]
pub struct Batch {
    ops: Vec<Op>,
    write_bytes: Vec<u8>,
    /// READ buffers: the first `read_len` bytes belong to this batch's READs; the rest is
    /// left over from before [`Batch::clear`], kept so that READs reuse it without zeroing
    /// it again (a 16 KiB memset per batch of 1 KiB GETs). A READ's bytes are seen only once
    /// it is done, and a transport completes a READ only after writing all of its bytes.
    read_bytes: Vec<u8>,
    read_len: usize,
    /// Run only on a connection to this server instance (kept across [`Batch::clear`]).
    required_instance: Option<u64>,
    /// The server instance of the connection that last validated this batch.
    executed_instance: u64,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.ops.clear();
        self.write_bytes.clear();
        self.read_len = 0;
    }

    /// Makes every later execution of this batch fail with
    /// [`TransportError::InstanceChanged`], before anything is sent, unless the connection
    /// reaches server instance `instance` (None: any). A client writing into heap space a
    /// memnode run handed out requires that run: a restarted memnode reclaims space nobody
    /// references, so the old run's space may be someone else's now. Kept across `clear`.
    pub fn require_instance(&mut self, instance: Option<u64>) {
        self.required_instance = instance;
    }

    /// The server instance of the connection this batch last passed validation on (what a
    /// successful CAS's effect belongs to).
    pub fn executed_instance(&self) -> u64 {
        self.executed_instance
    }

    /// Ops in the batch.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the batch holds no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Drops every op from index `len` on, with their buffer bytes (ops are appended with
    /// buffers in order, so the first dropped READ and WRITE mark where those end).
    pub fn truncate(&mut self, len: usize) {
        let Some(dropped) = self.ops.get(len..) else { return };
        if let Some(op) = dropped.iter().find(|op| op.kind == OpKind::Read) {
            self.read_len = op.buf_at as usize;
        }
        if let Some(op) = dropped.iter().find(|op| op.kind == OpKind::Write) {
            self.write_bytes.truncate(op.buf_at as usize);
        }
        self.ops.truncate(len);
    }

    fn push(&mut self, op: Op) -> u32 {
        let index = u32::try_from(self.ops.len()).expect("batch index fits u32");
        self.ops.push(op);
        index
    }

    /// READ `len` bytes at `offset`.
    pub fn read(&mut self, offset: u64, len: u32) -> ReadId {
        let buf_at = u32::try_from(self.read_len).unwrap_or(u32::MAX);
        self.read_len = self.read_len.saturating_add(len as usize);
        if self.read_bytes.len() < self.read_len {
            self.read_bytes.resize(self.read_len, 0);
        }
        ReadId(self.push(Op { kind: OpKind::Read, offset, len, buf_at, arg0: 0, arg1: 0, outcome: Outcome::Pending }))
    }

    /// WRITE `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> OpId {
        let buf_at = u32::try_from(self.write_bytes.len()).unwrap_or(u32::MAX);
        self.write_bytes.extend_from_slice(data);
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        OpId(self.push(Op { kind: OpKind::Write, offset, len, buf_at, arg0: 0, arg1: 0, outcome: Outcome::Pending }))
    }

    /// CAS the 8-byte word at `offset` from `expected` to `new`.
    pub fn cas(&mut self, offset: u64, expected: u64, new: u64) -> OpId {
        OpId(self.push(Op {
            kind: OpKind::Cas,
            offset,
            len: 8,
            buf_at: 0,
            arg0: expected,
            arg1: new,
            outcome: Outcome::Pending,
        }))
    }

    /// Add `addend` (wrapping) to the 8-byte word at `offset`.
    pub fn faa(&mut self, offset: u64, addend: u64) -> OpId {
        OpId(self.push(Op {
            kind: OpKind::Faa,
            offset,
            len: 8,
            buf_at: 0,
            arg0: addend,
            arg1: 0,
            outcome: Outcome::Pending,
        }))
    }

    /// The READ at op `index` of the batch (None: no op there, or another kind): for a
    /// wrapper that appended one and finds it again once the batch executed.
    pub fn read_at(&self, index: usize) -> Option<ReadId> {
        let op = self.ops.get(index)?;
        (op.kind == OpKind::Read).then_some(ReadId(index as u32))
    }

    /// The bytes a READ returned.
    pub fn read_result(&self, id: ReadId) -> Result<&[u8], OpError> {
        let op = &self.ops[id.0 as usize];
        debug_assert_eq!(op.kind, OpKind::Read);
        match op.outcome {
            Outcome::Done(_) => Ok(&self.read_bytes[op.buf_at as usize..][..op.len as usize]),
            Outcome::Failed(e) => Err(e),
            Outcome::Pending => Err(OpError::NotExecuted),
        }
    }

    /// The old word a CAS or FAA saw (0 for a WRITE).
    pub fn result(&self, id: OpId) -> Result<u64, OpError> {
        match self.ops[id.0 as usize].outcome {
            Outcome::Done(v) => Ok(v),
            Outcome::Failed(e) => Err(e),
            Outcome::Pending => Err(OpError::NotExecuted),
        }
    }

    /// Whether a CAS swapped (its old value equals what it expected).
    pub fn cas_succeeded(&self, id: OpId) -> Result<bool, OpError> {
        let op = &self.ops[id.0 as usize];
        debug_assert_eq!(op.kind, OpKind::Cas);
        self.result(id).map(|old| old == op.arg0)
    }

    // ---- for transports ----

    /// All ops, in order.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The payload of WRITE op `index`.
    pub fn write_payload(&self, index: usize) -> &[u8] {
        let op = &self.ops[index];
        debug_assert_eq!(op.kind, OpKind::Write);
        &self.write_bytes[op.buf_at as usize..][..op.len as usize]
    }

    /// Where READ op `index` must put its bytes.
    pub fn read_target(&mut self, index: usize) -> &mut [u8] {
        let op = self.ops[index];
        debug_assert_eq!(op.kind, OpKind::Read);
        &mut self.read_bytes[op.buf_at as usize..][..op.len as usize]
    }

    /// The bytes READ op `index` holds (what it returned, once done).
    pub fn read_bytes_of(&self, index: usize) -> &[u8] {
        let op = &self.ops[index];
        debug_assert_eq!(op.kind, OpKind::Read);
        &self.read_bytes[op.buf_at as usize..][..op.len as usize]
    }

    /// Records op `index` as failed, leaving the other ops as they are.
    pub fn set_failed(&mut self, index: usize, error: OpError) {
        self.ops[index].outcome = Outcome::Failed(error);
    }

    /// Records op `index` as done with `value`.
    pub fn complete(&mut self, index: usize, value: u64) {
        self.ops[index].outcome = Outcome::Done(value);
    }

    /// Records op `index` as failed and every later op as not executed.
    pub fn fail_from(&mut self, index: usize, error: OpError) {
        self.ops[index].outcome = Outcome::Failed(error);
        for op in &mut self.ops[index + 1..] {
            op.outcome = Outcome::Failed(OpError::NotExecuted);
        }
    }

    /// Marks every op pending again (before re-sending).
    pub fn reset_outcomes(&mut self) {
        for op in &mut self.ops {
            op.outcome = Outcome::Pending;
        }
    }

    /// Total bytes this batch reads and writes.
    pub fn byte_totals(&self) -> (u64, u64) {
        (self.read_len as u64, self.write_bytes.len() as u64)
    }

    /// Checks the batch against the transport limits and `region_len` before anything is
    /// sent. A batch with an invalid op is rejected whole: that op is marked failed, every
    /// other op not executed, and nothing reaches the region. (A remote side that receives an
    /// invalid op anyway, from a client that skipped this, executes up to it, like a NIC.)
    /// `instance` is the server instance the connection reaches (see
    /// [`Batch::require_instance`]).
    pub fn validate(&mut self, region_len: u64, instance: u64) -> Result<(), TransportError> {
        if let Some(expected) = self.required_instance.filter(|&e| e != instance) {
            return Err(TransportError::InstanceChanged { expected, found: instance });
        }
        if self.ops.is_empty() {
            return Err(TransportError::InvalidBatch("empty batch".into()));
        }
        if self.ops.len() > MAX_BATCH_OPS {
            return Err(TransportError::InvalidBatch(format!(
                "{} ops exceed the limit of {MAX_BATCH_OPS}",
                self.ops.len()
            )));
        }
        let (read, written) = self.byte_totals();
        if read > MAX_BATCH_BYTES || written > MAX_BATCH_BYTES {
            return Err(TransportError::InvalidBatch(format!(
                "batch reads {read} B and writes {written} B; the limit is {MAX_BATCH_BYTES} B each"
            )));
        }
        for index in 0..self.ops.len() {
            let op = self.ops[index];
            if let Err(error) = check_op(op.kind, op.offset, u64::from(op.len), region_len) {
                for other in &mut self.ops {
                    other.outcome = Outcome::Failed(OpError::NotExecuted);
                }
                self.ops[index].outcome = Outcome::Failed(error);
                return Err(TransportError::Op { index, error });
            }
        }
        self.executed_instance = instance;
        Ok(())
    }

    /// Turns the first failed op into an error (call after execution).
    pub fn first_failure(&self) -> Result<(), TransportError> {
        match self.ops.iter().position(|op| matches!(op.outcome, Outcome::Failed(_))) {
            None => Ok(()),
            Some(index) => match self.ops[index].outcome {
                Outcome::Failed(error) => Err(TransportError::Op { index, error }),
                _ => unreachable!(),
            },
        }
    }
}

/// The bounds, length and alignment rules for one op on a region of `region_len` bytes.
pub fn check_op(kind: OpKind, offset: u64, len: u64, region_len: u64) -> Result<(), OpError> {
    match kind {
        OpKind::Read | OpKind::Write => {
            if len == 0 || len > MAX_OP_BYTES {
                return Err(OpError::BadLength { len, max: MAX_OP_BYTES });
            }
        }
        OpKind::Cas | OpKind::Faa => {
            if !offset.is_multiple_of(8) {
                return Err(OpError::Misaligned { offset });
            }
            debug_assert_eq!(len, 8);
        }
    }
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(OpError::OutOfBounds { offset, len, region_len }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_drops_the_ops_and_their_bytes() {
        let mut b = Batch::new();
        let first = b.read(0, 8);
        b.write(8, &[1, 2, 3]);
        b.read(16, 8);
        b.write(24, &[4]);
        b.cas(32, 0, 1);
        b.truncate(2);
        assert_eq!((b.len(), b.read_len, b.write_bytes.len()), (2, 8, 3));
        b.truncate(5); // past the end: nothing
        assert_eq!(b.len(), 2);
        let again = b.read(40, 16);
        assert_eq!((b.read_len, again), (24, ReadId(2)));
        b.complete(0, 0);
        assert!(b.read_result(first).is_ok());
    }

    #[test]
    fn handles_address_their_own_bytes() {
        let mut b = Batch::new();
        let r1 = b.read(0, 3);
        let w = b.write(64, b"hello");
        let r2 = b.read(8, 2);
        b.read_target(0).copy_from_slice(b"abc");
        b.read_target(2).copy_from_slice(b"xy");
        b.complete(0, 0);
        b.complete(1, 0);
        b.complete(2, 0);
        assert_eq!(b.read_result(r1).unwrap(), b"abc");
        assert_eq!(b.read_result(r2).unwrap(), b"xy");
        assert_eq!(b.write_payload(1), b"hello");
        assert_eq!(b.result(w).unwrap(), 0);
    }

    #[test]
    fn a_cleared_batch_reuses_its_read_buffer() {
        let mut b = Batch::new();
        b.read(0, 8);
        b.read_target(0).copy_from_slice(b"abcdefgh");
        b.complete(0, 0);
        b.clear();
        assert_eq!(b.byte_totals(), (0, 0));
        let short = b.read(0, 3);
        let long = b.read(8, 9);
        assert_eq!(b.byte_totals(), (12, 0));
        assert_eq!(b.read_result(short), Err(OpError::NotExecuted));
        b.read_target(0).copy_from_slice(b"xyz");
        b.read_target(1).copy_from_slice(b"123456789");
        b.complete(0, 0);
        b.complete(1, 0);
        assert_eq!(b.read_result(short).unwrap(), b"xyz");
        assert_eq!(b.read_result(long).unwrap(), b"123456789");
    }

    #[test]
    fn failure_flushes_the_rest() {
        let mut b = Batch::new();
        b.read(0, 8);
        b.cas(3, 0, 1);
        let last = b.faa(8, 1);
        b.fail_from(1, OpError::Misaligned { offset: 3 });
        assert_eq!(b.result(last), Err(OpError::NotExecuted));
        assert!(matches!(b.first_failure(), Err(TransportError::Op { index: 1, .. })));
    }

    #[test]
    fn limits_are_checked() {
        assert!(check_op(OpKind::Read, 0, 0, 100).is_err());
        assert!(check_op(OpKind::Read, 96, 8, 100).is_err());
        assert!(check_op(OpKind::Read, u64::MAX, 8, u64::MAX).is_err());
        assert!(check_op(OpKind::Cas, 4, 8, 100).is_err());
        assert!(check_op(OpKind::Cas, 88, 8, 96).is_ok());
        let mut b = Batch::new();
        for _ in 0..=MAX_BATCH_OPS {
            b.faa(0, 1);
        }
        assert!(matches!(b.validate(64, 0), Err(TransportError::InvalidBatch(_))));
    }

    #[test]
    fn a_required_instance_is_checked_before_anything_else() {
        let mut b = Batch::new();
        b.cas(8, 0, 1);
        b.require_instance(Some(7));
        b.clear();
        b.cas(8, 0, 1);
        let err = b.validate(64, 9).unwrap_err();
        assert!(matches!(err, TransportError::InstanceChanged { expected: 7, found: 9 }), "{err}");
        b.validate(64, 7).unwrap();
        assert_eq!(b.executed_instance(), 7);
        b.require_instance(None);
        b.validate(64, 9).unwrap();
        assert_eq!(b.executed_instance(), 9);
    }
}
