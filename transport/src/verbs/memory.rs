//! Protection domains, memory regions and the local buffers the NIC reads from and writes to.
//!
//! A [`MemoryRegion`] owns (or shares ownership of) the memory it registers, so the memory
//! cannot be unmapped while the NIC may still access it: the region is deregistered in Drop,
//! before its memory field is dropped.

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use rdma_sys as sys;

use super::device::Context;
use super::error::VerbsError;
use crate::region::Region;

/// A protection domain; MRs and QPs made in it hold an `Arc` to it.
pub(crate) struct ProtectionDomain {
    raw: NonNull<sys::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: an ibv_pd is only passed to libibverbs calls, which are thread-safe for control
// objects; the type exposes no data-path state.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: `ctx` is an open context that outlives the PD (we hold an Arc to it).
        let raw = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::null("ibv_alloc_pd", ctx.name()))?;
        Ok(Arc::new(Self { raw, ctx }))
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(super) fn raw(&self) -> *mut sys::ibv_pd {
        self.raw.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: every MR and QP in this PD holds an Arc to it, so none is left; freed once.
        let ret = unsafe { sys::ibv_dealloc_pd(self.raw()) };
        if ret != 0 {
            tracing::warn!("ibv_dealloc_pd on {} failed: {}", self.ctx.name(), std::io::Error::from_raw_os_error(ret));
        }
    }
}

/// Access rights of a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Access(u32);

impl Access {
    pub const LOCAL_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    pub const REMOTE_READ: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    pub const REMOTE_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    pub const REMOTE_ATOMIC: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0);
    pub const NONE: Access = Access(0);

    pub fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
}

/// Memory that stays mapped, readable and writable at one address for as long as a value of
/// the implementing type lives.
///
/// # Safety
/// `base()..base() + len()` must be such memory, and moving the value must not move it.
pub(crate) unsafe trait PinnedMemory: Send + Sync + 'static {
    fn base(&self) -> *mut u8;
    fn len(&self) -> usize;
}

// SAFETY: a Region is one mapping made at construction and unmapped only when the last Arc
// drops; the Arc keeps it alive and moving the Arc does not move the mapping.
unsafe impl PinnedMemory for Arc<Region> {
    fn base(&self) -> *mut u8 {
        self.base_ptr()
    }
    fn len(&self) -> usize {
        usize::try_from(Region::len(self)).expect("a mapped region fits usize")
    }
}

/// Anonymous page-aligned memory for a connection's staging buffers.
pub(crate) struct Buffer(MmapRaw);

impl Buffer {
    pub fn new(len: usize) -> Result<Self, VerbsError> {
        let map = MmapOptions::new().len(len.max(1)).map_anon().map_err(|e| VerbsError::Call {
            call: "mmap (staging buffer)",
            device: "-".into(),
            source: e,
        })?;
        Ok(Self(MmapRaw::from(map)))
    }
}

// SAFETY: the anonymous mapping lives (at a fixed address) until the MmapRaw drops.
unsafe impl PinnedMemory for Buffer {
    fn base(&self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Registered memory: `memory` cannot be freed before the registration is gone. Once
/// `ibv_dereg_mr` has returned, the NIC no longer touches the memory (in-flight requests on it
/// fail), so dropping is safe whatever queue pairs still exist; if deregistration fails the
/// memory is leaked rather than freed under the NIC.
pub(crate) struct MemoryRegion<M: PinnedMemory> {
    raw: NonNull<sys::ibv_mr>,
    lkey: u32,
    rkey: u32,
    memory: ManuallyDrop<M>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the ibv_mr is immutable after registration (we only read the keys we copied out),
// and `M: Send + Sync`.
unsafe impl<M: PinnedMemory> Send for MemoryRegion<M> {}
// SAFETY: as above.
unsafe impl<M: PinnedMemory> Sync for MemoryRegion<M> {}

impl<M: PinnedMemory> MemoryRegion<M> {
    /// Registers all of `memory` with `access`.
    pub fn register(pd: &Arc<ProtectionDomain>, memory: M, access: Access) -> Result<Self, VerbsError> {
        // SAFETY: PinnedMemory guarantees base..base+len is mapped memory that outlives the
        // registration (it is moved into the returned value, which deregisters before
        // dropping it). The PD is alive (we keep an Arc).
        let raw = unsafe { sys::ibv_reg_mr(pd.raw(), memory.base().cast(), memory.len(), access.bits() as i32) };
        let raw = NonNull::new(raw).ok_or_else(|| {
            let mut e = VerbsError::null("ibv_reg_mr", pd.context().name());
            if let VerbsError::Call { source, .. } = &e {
                if matches!(source.raw_os_error(), Some(libc::ENOMEM) | Some(libc::EPERM)) {
                    e = VerbsError::Unsupported(format!(
                        "{e}; registering {} bytes pins them: raise the locked-memory limit (`ulimit -l unlimited`, or LimitMEMLOCK=infinity for systemd)",
                        memory.len()
                    ));
                }
            }
            e
        })?;
        // SAFETY: a successful ibv_reg_mr returns a valid ibv_mr; the keys never change.
        let (lkey, rkey) = unsafe { ((*raw.as_ptr()).lkey, (*raw.as_ptr()).rkey) };
        Ok(Self { raw, lkey, rkey, memory: ManuallyDrop::new(memory), pd: Arc::clone(pd) })
    }

    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Address of the first byte, as work requests name it.
    pub fn addr(&self) -> u64 {
        self.memory.base() as u64
    }

    pub fn len(&self) -> usize {
        self.memory.len()
    }
}

impl MemoryRegion<Buffer> {
    /// Copies `dst.len()` bytes from `offset` out of the buffer.
    ///
    /// Call only while no work request that targets these bytes is in flight (the
    /// connection's data-path lock and completion protocol ensure it). Only raw-pointer copies
    /// touch the buffer; no Rust reference to its bytes is ever made.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset.checked_add(dst.len()).is_some_and(|end| end <= self.len()), "staging read out of bounds");
        // SAFETY: bounds checked above; `dst` is a distinct Rust allocation, so they do not
        // overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.memory.base().add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies `src` into the buffer at `offset` (same rule as [`Self::copy_out`]).
    pub fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(offset.checked_add(src.len()).is_some_and(|end| end <= self.len()), "staging write out of bounds");
        // SAFETY: bounds checked above; `src` is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.memory.base().add(offset), src.len()) }
    }
}

impl<M: PinnedMemory> Drop for MemoryRegion<M> {
    fn drop(&mut self) {
        // SAFETY: the MR is deregistered exactly once, here.
        let ret = unsafe { sys::ibv_dereg_mr(self.raw.as_ptr()) };
        if ret != 0 {
            // The NIC may still write into it: leak the memory rather than free it.
            tracing::warn!(
                "ibv_dereg_mr on {} failed: {}",
                self.pd.context().name(),
                std::io::Error::from_raw_os_error(ret)
            );
            return;
        }
        // SAFETY: dropped exactly once, after deregistration; never used again.
        unsafe { ManuallyDrop::drop(&mut self.memory) }
    }
}
