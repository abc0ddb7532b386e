//! A stop flag that threads blocked in `poll` wake up for, so an idle listener can wait with
//! no timeout instead of waking every few milliseconds to look at a flag.
//!
//! It is one end of a socket pair: [`StopSignal::stop`] shuts the other end down, and from
//! then on this end polls readable (end of file) for every waiter, for good.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// How long an acceptor waits after a failed accept (e.g. out of descriptors) before it
/// tries again: the listener stays readable meanwhile, so without a pause it would spin.
const ACCEPT_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The stop flag and its socket pair (see the module doc).
pub struct StopSignal {
    stopped: AtomicBool,
    /// Polled by waiters; readable once `sender` is shut down.
    receiver: UnixStream,
    sender: UnixStream,
}

/// What [`StopSignal::wait_readable`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// The watched descriptor is readable.
    Readable,
    /// The stop flag was raised.
    Stopped,
}

impl StopSignal {
    /// A signal not raised yet.
    pub fn new() -> io::Result<Self> {
        let (receiver, sender) = UnixStream::pair()?;
        Ok(Self { stopped: AtomicBool::new(false), receiver, sender })
    }

    /// Raises the flag and wakes every waiter, now and later. Idempotent.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        let _ = self.sender.shutdown(std::net::Shutdown::Both);
    }

    /// Whether [`StopSignal::stop`] was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Blocks until `fd` is readable (or hung up: the caller's read says which) or the
    /// signal stops. Stop wins when both are ready.
    pub fn wait_readable(&self, fd: BorrowedFd<'_>) -> io::Result<Woken> {
        loop {
            if self.is_stopped() {
                return Ok(Woken::Stopped);
            }
            let mut fds = [PollFd::new(fd, PollFlags::POLLIN), PollFd::new(self.receiver.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
            if self.is_stopped() || fds[1].any().unwrap_or(false) {
                return Ok(Woken::Stopped);
            }
            if fds[0].any().unwrap_or(false) {
                return Ok(Woken::Readable);
            }
        }
    }

    /// Accepts connections from `listener` (with `accept`) and hands each to `admit`, until
    /// the signal stops. A failed accept is logged and retried after a pause; a failed poll
    /// ends the loop. `server` names the server in logs.
    pub fn accept_until_stopped<L: AsFd, S>(
        &self,
        server: &str,
        listener: &L,
        accept: impl Fn(&L) -> io::Result<S>,
        mut admit: impl FnMut(S),
    ) {
        loop {
            match self.wait_readable(listener.as_fd()) {
                Ok(Woken::Readable) => {}
                Ok(Woken::Stopped) => return,
                Err(e) => {
                    tracing::error!("{server}: poll on the listener failed, no longer accepting: {e}");
                    return;
                }
            }
            match accept(listener) {
                Ok(stream) => admit(stream),
                Err(e) => {
                    tracing::warn!("{server}: accept failed: {e}");
                    std::thread::sleep(ACCEPT_RETRY_PAUSE);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_waiter_wakes_for_data_and_for_stop() {
        let stop = Arc::new(StopSignal::new().unwrap());
        let (mut tx, rx) = UnixStream::pair().unwrap();
        tx.write_all(b"x").unwrap();
        assert_eq!(stop.wait_readable(rx.as_fd()).unwrap(), Woken::Readable);

        let (_tx, idle) = UnixStream::pair().unwrap();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let (stop, idle) = (Arc::clone(&stop), idle.try_clone().unwrap());
                std::thread::spawn(move || stop.wait_readable(idle.as_fd()).unwrap())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        stop.stop();
        for waiter in waiters {
            assert_eq!(waiter.join().unwrap(), Woken::Stopped);
        }
        // And for good: a later waiter returns at once, even with data waiting.
        assert_eq!(stop.wait_readable(rx.as_fd()).unwrap(), Woken::Stopped);
        stop.stop();
        assert!(stop.is_stopped());
    }
}
