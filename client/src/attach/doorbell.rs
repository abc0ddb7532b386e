//! Doorbells: eventfds that wake the other side of a ring, and waiting on them.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// A non-blocking eventfd: `ring` adds to its counter, `drain` resets it, and it polls
/// readable while the counter is non-zero.
#[derive(Debug)]
pub struct Doorbell(OwnedFd);

impl Doorbell {
    /// A fresh doorbell (the daemon makes a pair per attachment and passes them on).
    pub fn new() -> io::Result<Self> {
        let fd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).map_err(io::Error::from)?;
        Ok(Self(OwnedFd::from(fd)))
    }

    /// A doorbell received from the daemon.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self(fd)
    }

    /// Wakes whoever waits on the doorbell.
    pub fn ring(&self) {
        // EAGAIN means the counter is about to overflow: it is certainly non-zero, so the
        // waiter wakes anyway. Other errors (a closed peer) leave nobody to wake.
        let _ = nix::unistd::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Resets the counter (after waking).
    pub fn drain(&self) {
        let mut buf = [0u8; 8];
        loop {
            match nix::unistd::read(&self.0, &mut buf) {
                Err(Errno::EINTR) => continue,
                _ => return,
            }
        }
    }

    /// A descriptor to pass to the other side.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.0.try_clone()
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Waits until one of `fds` is readable (or hung up, or in error), at most `timeout` (None:
/// forever). Returns which are ready; all false on timeout.
pub fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    // POLLRDHUP (a peer's shutdown of its writing half) has no name in nix; it matters for
    // the sockets waited on here.
    let events = PollFlags::POLLIN | PollFlags::from_bits_retain(libc::POLLRDHUP);
    let mut polled: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::new(*fd, events)).collect();
    let timeout = match timeout {
        None => PollTimeout::NONE,
        // Round up, so a short wait does not become a busy loop of zero-timeout polls.
        Some(t) => {
            PollTimeout::try_from(t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX)
        }
    };
    match poll(&mut polled, timeout) {
        Ok(_) => Ok(polled.iter().map(|p| p.any().unwrap_or(true)).collect()),
        Err(Errno::EINTR) => Ok(vec![false; fds.len()]),
        Err(e) => Err(io::Error::from(e)),
    }
}
