//! A value readers borrow without locks and a writer replaces whole, with the old value
//! freed once no reader can still see it (crossbeam-epoch). The only `unsafe` of the crate.

use std::sync::atomic::Ordering;

use crossbeam_epoch::{self as epoch, Atomic, Owned};

pub struct EpochCell<T: Send + Sync> {
    current: Atomic<T>,
}

impl<T: Send + Sync> EpochCell<T> {
    pub fn new(value: T) -> Self {
        Self { current: Atomic::new(value) }
    }

    /// Runs `f` on the current value.
    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        let guard = epoch::pin();
        let shared = self.current.load(Ordering::Acquire, &guard);
        // SAFETY: `current` is never null (built with a value and only ever swapped for one),
        // and the pinned guard keeps the pointee alive until `f` returns: a replaced value
        // is destroyed only after every guard that could have loaded it is dropped.
        f(unsafe { shared.deref() })
    }

    /// Installs `value`; the previous one is dropped when no reader holds it anymore.
    pub fn replace(&self, value: T) {
        let guard = epoch::pin();
        let old = self.current.swap(Owned::new(value), Ordering::AcqRel, &guard);
        // SAFETY: after the swap no new reader can load `old`; readers that already did are
        // pinned, and deferred destruction waits for them.
        unsafe { guard.defer_destroy(old) };
    }
}

impl<T: Send + Sync> Drop for EpochCell<T> {
    fn drop(&mut self) {
        // SAFETY: `&mut self` means no reader can hold a reference into the cell, so taking
        // ownership of the current value without a guard is sound.
        unsafe {
            let current = self.current.load(Ordering::Relaxed, epoch::unprotected());
            drop(current.into_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn readers_see_whole_values_while_a_writer_replaces_them() {
        let cell = Arc::new(EpochCell::new(vec![0u64; 64]));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let cell = Arc::clone(&cell);
                s.spawn(move || {
                    for _ in 0..20_000 {
                        cell.read(|v| assert!(v.iter().all(|&x| x == v[0]), "torn value"));
                    }
                });
            }
            for i in 1..2_000u64 {
                cell.replace(vec![i; 64]);
            }
        });
        cell.read(|v| assert_eq!(v[0], 1_999));
    }
}
