//! Connection wrappers for this crate's deterministic race replays: they pass everything to
//! a real connection and run a hook at a chosen point, as if the caller were preempted there.

#![allow(dead_code)] // each test binary uses its own part

use std::sync::{Arc, Mutex};

use racekv_transport::{Batch, Connection, OpKind, TransportError};

pub type Hook = Box<dyn FnOnce() + Send>;

/// The `Connection` methods a wrapper passes straight to its `inner` connection.
#[macro_export]
macro_rules! pass_through {
    () => {
        fn call(&self, method: u16, request: &[u8]) -> Result<Vec<u8>, racekv_transport::TransportError> {
            self.inner.call(method, request)
        }
        fn region_len(&self) -> u64 {
            self.inner.region_len()
        }
        fn kind(&self) -> racekv_transport::TransportKind {
            self.inner.kind()
        }
        fn instance(&self) -> u64 {
            self.inner.instance()
        }
        fn is_healthy(&self) -> bool {
            self.inner.is_healthy()
        }
    };
}

/// Passes everything through to `inner`, but runs each hook once, before the first batch
/// that READs at its offset (as if the caller were preempted just before sending it), or
/// before the nth such batch.
pub struct BeforeRead {
    pub inner: Arc<dyn Connection>,
    /// (offset, matching batches still to let pass, hook)
    pub hooks: Mutex<Vec<(u64, usize, Hook)>>,
}

impl BeforeRead {
    pub fn new(inner: Arc<dyn Connection>, hooks: Vec<(u64, Hook)>) -> Arc<Self> {
        Self::nth(inner, hooks.into_iter().map(|(offset, hook)| (offset, 0, hook)).collect())
    }

    /// Each hook runs before the batch that is the (skip + 1)th to READ at its offset.
    pub fn nth(inner: Arc<dyn Connection>, hooks: Vec<(u64, usize, Hook)>) -> Arc<Self> {
        Arc::new(Self { inner, hooks: Mutex::new(hooks) })
    }

    /// Whether every hook ran.
    pub fn all_ran(&self) -> bool {
        self.hooks.lock().unwrap().is_empty()
    }
}

impl Connection for BeforeRead {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        let due: Vec<Hook> = {
            let mut hooks = self.hooks.lock().unwrap();
            let mut due = Vec::new();
            for (offset, skip, hook) in std::mem::take(&mut *hooks) {
                let reads_it = batch.ops().iter().any(|op| op.kind == OpKind::Read && op.offset == offset);
                match (reads_it, skip) {
                    (true, 0) => due.push(hook),
                    (true, skip) => hooks.push((offset, skip - 1, hook)),
                    (false, _) => hooks.push((offset, skip, hook)),
                }
            }
            due
        };
        due.into_iter().for_each(|hook| hook());
        self.inner.execute(batch)
    }

    pass_through!();
}

/// One READ of `len` bytes at `offset`.
pub fn read_bytes(conn: &dyn Connection, offset: u64, len: u32) -> Vec<u8> {
    let mut b = Batch::new();
    let r = b.read(offset, len);
    conn.execute(&mut b).unwrap();
    b.read_result(r).unwrap().to_vec()
}

/// The word at `offset`.
pub fn read_word(conn: &dyn Connection, offset: u64) -> u64 {
    u64::from_le_bytes(read_bytes(conn, offset, 8).try_into().unwrap())
}

fn op_error(error: racekv_transport::OpError) -> TransportError {
    TransportError::Op { index: 0, error }
}

/// Passes everything through to `inner`, except that the first READ covering `split_at`
/// is carried out in two parts, with `hook` run in between (as if the reader were
/// preempted right there).
pub struct TornReads {
    pub inner: Arc<dyn Connection>,
    pub split_at: u64,
    pub hook: Mutex<Option<Hook>>,
}

impl TornReads {
    fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, TransportError> {
        let mut b = Batch::new();
        let r = b.read(offset, len);
        self.inner.execute(&mut b)?;
        Ok(b.read_result(r).map_err(op_error)?.to_vec())
    }
}

impl Connection for TornReads {
    fn execute(&self, batch: &mut Batch) -> Result<(), TransportError> {
        let torn = batch.ops().iter().position(|op| {
            op.kind == OpKind::Read && (op.offset..op.offset + u64::from(op.len)).contains(&self.split_at)
        });
        let hook = match torn {
            Some(_) => self.hook.lock().unwrap().take(),
            None => None,
        };
        let (Some(index), Some(hook)) = (torn, hook) else {
            return self.inner.execute(batch);
        };
        let mut hook = Some(hook);
        // Ops before and after the torn read run as they are; the torn read runs in halves.
        for i in 0..batch.len() {
            let op = batch.ops()[i];
            if i == index {
                let first = (self.split_at - op.offset) as u32;
                let head = self.read(op.offset, first)?;
                (hook.take().expect("one torn read"))();
                let tail = self.read(self.split_at, op.len - first)?;
                let target = batch.read_target(i);
                target[..head.len()].copy_from_slice(&head);
                target[head.len()..].copy_from_slice(&tail);
                batch.complete(i, 0);
                continue;
            }
            let mut one = Batch::new();
            let value = match op.kind {
                OpKind::Read => {
                    let r = one.read(op.offset, op.len);
                    self.inner.execute(&mut one)?;
                    batch.read_target(i).copy_from_slice(one.read_result(r).map_err(op_error)?);
                    0
                }
                OpKind::Write => {
                    one.write(op.offset, batch.write_payload(i));
                    self.inner.execute(&mut one)?;
                    0
                }
                OpKind::Cas => {
                    let id = one.cas(op.offset, op.arg0, op.arg1);
                    self.inner.execute(&mut one)?;
                    one.result(id).map_err(op_error)?
                }
                OpKind::Faa => {
                    let id = one.faa(op.offset, op.arg0);
                    self.inner.execute(&mut one)?;
                    one.result(id).map_err(op_error)?
                }
            };
            batch.complete(i, value);
        }
        Ok(())
    }

    pass_through!();
}
