//! A mapped memory region with bounds-checked, word-atomic access.
//!
//! This is the only module of the transport crate that touches raw memory. Everything above
//! it (the shm backend, the tcp software NIC, memnode setup) goes through its safe methods.
//!
//! Why atomics for plain reads and writes: other threads and other processes CAS slots of the
//! region while we copy buckets out of it. A plain `memcpy` racing a CAS is a data race (UB in
//! the Rust memory model); relaxed 8-byte atomic loads and stores compile to ordinary moves on
//! x86-64 and are race-free. Every access is a whole aligned 8-byte word; unaligned edges of a
//! write are merged with a CAS loop so neighbouring bytes are never clobbered. Fences give the
//! usual publish/observe pairing: a write ends with nothing pending before its stores
//! (`Release` fence first) and a read is followed by an `Acquire` fence.

use std::fs::File;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::batch::{check_op, Batch, Op, OpKind};
use crate::error::OpError;

#[cfg(not(target_endian = "little"))]
compile_error!("racekv stores little-endian words in regions and on the wire");

/// Regions are sized in whole pages.
pub const REGION_ALIGN_BYTES: u64 = 4096;

/// A mapping plus its length; the mapping lives as long as the region.
pub struct Region {
    map: MmapRaw,
    len: u64,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len).finish()
    }
}

impl Region {
    /// Maps `len` bytes of `file` shared (a data file, a /dev/shm file or a memfd).
    /// The file must already be at least `len` bytes long.
    pub fn map_file(file: &File, len: u64) -> std::io::Result<Self> {
        Self::check_len(len)?;
        let file_len = file.metadata()?.len();
        if file_len < len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("region file is {file_len} bytes, shorter than the {len} bytes to map"),
            ));
        }
        let map = MmapOptions::new().len(len as usize).map_raw(file)?;
        Ok(Self { map, len })
    }

    /// Maps `len` bytes of private anonymous memory (tests, and single-process use).
    pub fn anonymous(len: u64) -> std::io::Result<Self> {
        Self::check_len(len)?;
        let map = MmapOptions::new().len(len as usize).map_anon()?;
        Ok(Self { map: MmapRaw::from(map), len })
    }

    fn check_len(len: u64) -> std::io::Result<()> {
        if len == 0 || !len.is_multiple_of(REGION_ALIGN_BYTES) || usize::try_from(len).is_err() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("region length {len} must be a non-zero multiple of {REGION_ALIGN_BYTES}"),
            ));
        }
        Ok(())
    }

    /// The region's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The base address, for registering the region with a NIC. Never dereferenced here.
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The word containing byte `offset`.
    ///
    /// Callers guarantee `offset & !7 < self.len` (it holds after `check_op` succeeded for an
    /// access covering `offset`, because `len` is a multiple of 8).
    fn word(&self, offset: u64) -> &AtomicU64 {
        let aligned = offset & !7;
        assert!(aligned + 8 <= self.len, "word access past the region end");
        // SAFETY: `aligned + 8 <= len` keeps the word inside the mapping, which stays mapped
        // while `self` lives (the returned reference borrows `self`). The base is page-aligned
        // and `aligned` is a multiple of 8, so the pointer is aligned for AtomicU64. We never
        // create `&`/`&mut` references to the bytes themselves, and every access (in this and
        // in other processes mapping the same file) is an 8-byte atomic, so shared `&AtomicU64`
        // references are sound.
        unsafe { &*(self.map.as_mut_ptr().add(aligned as usize) as *const AtomicU64) }
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), OpError> {
        check_op(OpKind::Read, offset, buf.len() as u64, self.len)?;
        if offset.is_multiple_of(8) && buf.len().is_multiple_of(8) {
            // The common case (buckets, blocks, directory): whole words, a fixed-size copy
            // each, so a read stays a short run of independent loads the CPU can overlap.
            for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
                chunk.copy_from_slice(&self.word(offset + i as u64 * 8).load(Ordering::Relaxed).to_le_bytes());
            }
            fence(Ordering::Acquire);
            return Ok(());
        }
        let mut pos = offset;
        let mut out = 0usize;
        while out < buf.len() {
            let word = self.word(pos).load(Ordering::Relaxed).to_le_bytes();
            let skip = (pos & 7) as usize;
            let take = (8 - skip).min(buf.len() - out);
            buf[out..out + take].copy_from_slice(&word[skip..skip + take]);
            out += take;
            pos += take as u64;
        }
        fence(Ordering::Acquire);
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), OpError> {
        check_op(OpKind::Write, offset, data.len() as u64, self.len)?;
        fence(Ordering::Release);
        let mut pos = offset;
        let mut taken = 0usize;
        while taken < data.len() {
            let skip = (pos & 7) as usize;
            let take = (8 - skip).min(data.len() - taken);
            let word = self.word(pos);
            if take == 8 {
                let bytes: [u8; 8] = data[taken..taken + 8].try_into().expect("8 bytes");
                word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
            } else {
                // A partial word: merge our bytes without clobbering the neighbours'.
                let mut current = word.load(Ordering::Relaxed);
                loop {
                    let mut bytes = current.to_le_bytes();
                    bytes[skip..skip + take].copy_from_slice(&data[taken..taken + take]);
                    match word.compare_exchange_weak(
                        current,
                        u64::from_le_bytes(bytes),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break,
                        Err(seen) => current = seen,
                    }
                }
            }
            taken += take;
            pos += take as u64;
        }
        Ok(())
    }

    /// Compare-and-swap of the aligned word at `offset`; returns the old value.
    pub fn compare_and_swap(&self, offset: u64, expected: u64, new: u64) -> Result<u64, OpError> {
        check_op(OpKind::Cas, offset, 8, self.len)?;
        Ok(match self.word(offset).compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(old) | Err(old) => old,
        })
    }

    /// Wrapping fetch-and-add of the aligned word at `offset`; returns the old value.
    pub fn fetch_add(&self, offset: u64, addend: u64) -> Result<u64, OpError> {
        check_op(OpKind::Faa, offset, 8, self.len)?;
        Ok(self.word(offset).fetch_add(addend, Ordering::SeqCst))
    }

    /// Atomic load of the aligned word at `offset`.
    pub fn load_u64(&self, offset: u64) -> Result<u64, OpError> {
        check_op(OpKind::Cas, offset, 8, self.len)?;
        Ok(self.word(offset).load(Ordering::Acquire))
    }

    /// Atomic store to the aligned word at `offset`.
    pub fn store_u64(&self, offset: u64, value: u64) -> Result<(), OpError> {
        check_op(OpKind::Cas, offset, 8, self.len)?;
        self.word(offset).store(value, Ordering::Release);
        Ok(())
    }

    /// Executes every op of `batch` in order against this region. The first failing op
    /// fails, and the rest are not executed (as a NIC flushes a broken queue).
    pub fn apply(&self, batch: &mut Batch) {
        self.prefetch_first_lines(batch);
        for index in 0..batch.len() {
            let op = batch.ops()[index];
            // The next op's other lines come in while this one copies (its first are here).
            if let Some(next) = batch.ops().get(index + 1) {
                self.prefetch_op(next, PREFETCH_LINES_PER_OP, MAX_PREFETCHED_LINES);
            }
            let outcome = match op.kind {
                OpKind::Read => self.read(op.offset, batch.read_target(index)).map(|()| 0),
                OpKind::Write => self.write(op.offset, batch.write_payload(index)).map(|()| 0),
                OpKind::Cas => self.compare_and_swap(op.offset, op.arg0, op.arg1),
                OpKind::Faa => self.fetch_add(op.offset, op.arg0),
            };
            match outcome {
                Ok(value) => batch.complete(index, value),
                Err(error) => {
                    batch.fail_from(index, error);
                    return;
                }
            }
        }
    }

    /// Asks the CPU for the first cache lines of every READ and WRITE of the batch (up to a
    /// bound), before any copying: every op's misses are then in flight together, as a NIC
    /// would fetch them, instead of one op's at a time behind the copy loop. Prefetches,
    /// unlike loads, retire without waiting for their line, so a long batch's misses
    /// overlap (1 KiB values: 1.4x YCSB C over shm, docs/benchmarks.md). The rest of an
    /// op's lines are asked for while the op before it copies (`apply`).
    fn prefetch_first_lines(&self, batch: &Batch) {
        // A valid batch has at most MAX_BATCH_OPS ops, so this stays within
        // MAX_PREFETCHED_LINES (asserted at compile time below).
        for op in batch.ops() {
            self.prefetch_op(op, 0, PREFETCH_LINES_PER_OP);
        }
    }

    /// Prefetches at most `most` of `op`'s lines, from its line `skip` on (a READ's for
    /// reading, a WRITE's for writing; nothing for atomics or an op out of bounds).
    fn prefetch_op(&self, op: &Op, skip: u64, most: u64) {
        if (op.offset & 63) + u64::from(op.len) <= 64 * skip {
            // Nothing past line `skip` (headers, slots, small blocks): the common case.
            return;
        }
        let write = match op.kind {
            OpKind::Read => false,
            OpKind::Write => true,
            OpKind::Cas | OpKind::Faa => return,
        };
        if check_op(op.kind, op.offset, u64::from(op.len), self.len).is_err() {
            return;
        }
        let mut line = (op.offset & !63) + 64 * skip;
        let end = (op.offset + u64::from(op.len)).min(line.saturating_add(64 * most));
        while line < end {
            // The word at `line` is inside the region: lines are 64-byte aligned and the
            // op's first byte is at or after `line`, its last before `end` <= len.
            prefetch_line(self.word(line.max(op.offset & !7)), write);
            line += 64;
        }
    }

    /// Flushes a file-backed mapping to its file (msync). A no-op cost for memfd and anonymous.
    pub fn flush(&self) -> std::io::Result<()> {
        self.map.flush()
    }
}

/// Most cache lines prefetched at once: before a batch copies (every op's first lines),
/// and ahead of one op (64 KiB, within any L2): past that, early lines would be pushed out
/// before the copy reaches them.
const MAX_PREFETCHED_LINES: u64 = 1024;

/// Lines of every op prefetched before a batch copies (its first ones). Each software
/// prefetch holds one of the core's few fill buffers until its line arrives, so asking for
/// all 17 lines of 16 1 KiB blocks at once mostly waited for buffers; the first four start
/// every op's misses together, and the rest of an op's come while the op before it copies
/// (YCSB C native 1.11x against every line up front, docs/benchmarks.md).
const PREFETCH_LINES_PER_OP: u64 = 4;

// A valid batch's first lines fit the bound (`prefetch_first_lines` counts nothing).
const _: () = assert!(PREFETCH_LINES_PER_OP * crate::batch::MAX_BATCH_OPS as u64 <= MAX_PREFETCHED_LINES);

/// Asks the CPU to bring `word`'s cache line into L2 (`write`: for writing), without
/// waiting for it.
#[cfg(target_arch = "x86_64")]
fn prefetch_line(word: &AtomicU64, write: bool) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T1};
    let at = word.as_ptr() as *const i8;
    // SAFETY: `_mm_prefetch` needs SSE, which every x86-64 target has; a prefetch is a hint
    // that never faults nor changes memory, and `at` points into the live mapping.
    unsafe {
        if write {
            _mm_prefetch::<_MM_HINT_ET0>(at)
        } else {
            _mm_prefetch::<_MM_HINT_T1>(at)
        }
    }
}

/// Elsewhere: a load, whose miss is then in flight too (a write's line as well).
#[cfg(not(target_arch = "x86_64"))]
fn prefetch_line(word: &AtomicU64, _write: bool) {
    std::hint::black_box(word.load(Ordering::Relaxed));
}

/// Creates an anonymous, shareable memory file of `len` bytes (a memfd), optionally on huge
/// pages. Mapping it gives a region that other processes can map once handed the descriptor.
pub fn shared_memory_file(name: &str, len: u64, huge_pages: bool) -> std::io::Result<File> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let mut flags = MFdFlags::MFD_CLOEXEC;
    if huge_pages {
        flags |= MFdFlags::MFD_HUGETLB;
    }
    let fd = memfd_create(name, flags).map_err(|e| {
        std::io::Error::other(
            if huge_pages {
                format!("memfd_create with huge pages failed ({e}); reserve huge pages (vm.nr_hugepages) or turn huge pages off")
            } else {
                format!("memfd_create failed: {e}")
            },
        )
    })?;
    let file = File::from(fd);
    file.set_len(len).map_err(|e| {
        if huge_pages {
            std::io::Error::new(
                e.kind(),
                format!("sizing a huge-page region to {len} bytes failed ({e}): the size must be a multiple of the huge page size"),
            )
        } else {
            e
        }
    })?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rejects_bad_lengths() {
        assert!(Region::anonymous(0).is_err());
        assert!(Region::anonymous(4095).is_err());
        assert!(Region::anonymous(4096).is_ok());
    }

    proptest! {
        /// Arbitrary writes followed by reads agree with a byte-array model, including
        /// unaligned edges.
        #[test]
        fn reads_and_writes_match_a_byte_model(
            writes in proptest::collection::vec((0u64..4096, proptest::collection::vec(any::<u8>(), 1..64)), 1..40),
            reads in proptest::collection::vec((0u64..4096, 1usize..200), 1..20),
        ) {
            let region = Region::anonymous(4096).unwrap();
            let mut model = vec![0u8; 4096];
            for (offset, data) in &writes {
                let result = region.write(*offset, data);
                if *offset as usize + data.len() <= 4096 {
                    prop_assert!(result.is_ok());
                    model[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
                } else {
                    prop_assert!(result.is_err());
                }
            }
            for (offset, len) in reads {
                let mut buf = vec![0u8; len];
                let result = region.read(offset, &mut buf);
                if offset as usize + len <= 4096 {
                    prop_assert!(result.is_ok());
                    prop_assert_eq!(&buf[..], &model[offset as usize..offset as usize + len]);
                } else {
                    prop_assert!(result.is_err());
                }
            }
        }
    }

    /// Bytes of the region `applied_batches_match_a_byte_model` runs on: 2048 lines, twice
    /// what a batch prefetches.
    const RANGE_BYTES: u64 = 128 << 10;

    proptest! {
        /// A batch of reads and writes covering more lines than are prefetched (and ops
        /// past the end) executes as the ops one by one would, up to its first failure.
        #[test]
        fn applied_batches_match_a_byte_model(
            ops in proptest::collection::vec(
                (any::<bool>(), 0u64..(RANGE_BYTES + 4096), 1usize..16384, any::<u8>()), 1..24),
        ) {
            let region = Region::anonymous(RANGE_BYTES).unwrap();
            let mut model = vec![0u8; RANGE_BYTES as usize];
            let mut batch = Batch::new();
            let mut reads = Vec::new();
            for &(write, offset, len, fill) in &ops {
                if write {
                    batch.write(offset, &vec![fill; len]);
                } else {
                    reads.push((batch.len(), batch.read(offset, len as u32)));
                }
            }
            region.apply(&mut batch);
            let failed = ops.iter().position(|&(_, offset, len, _)| offset + len as u64 > RANGE_BYTES);
            for (index, &(write, offset, len, fill)) in ops.iter().enumerate() {
                if failed.is_some_and(|f| index >= f) {
                    break;
                }
                let range = offset as usize..offset as usize + len;
                if write {
                    model[range].fill(fill);
                } else {
                    let (_, id) = reads.iter().find(|(i, _)| *i == index).unwrap();
                    prop_assert_eq!(batch.read_result(*id).unwrap(), &model[range]);
                }
            }
            if let Some(f) = failed {
                prop_assert!(batch.first_failure().is_err(), "op {} is out of range", f);
            }
        }
    }

    #[test]
    fn atomics_return_old_values() {
        let region = Region::anonymous(4096).unwrap();
        assert_eq!(region.compare_and_swap(8, 0, 5).unwrap(), 0);
        assert_eq!(region.compare_and_swap(8, 0, 7).unwrap(), 5);
        assert_eq!(region.fetch_add(8, 3).unwrap(), 5);
        assert_eq!(region.load_u64(8).unwrap(), 8);
        assert!(matches!(region.fetch_add(4, 1), Err(OpError::Misaligned { .. })));
        assert!(matches!(region.compare_and_swap(4096, 0, 1), Err(OpError::OutOfBounds { .. })));
    }
}
