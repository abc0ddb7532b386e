//! Stopping a child process the way every racekv supervisor does: ask, wait, then force.

use std::process::Child;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How often a stopping child is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Sends `signal` to `child`, a process this one spawned.
pub fn signal(child: &Child, signal: Signal) {
    // Our own child, not yet reaped: its pid cannot name another process.
    let _ = kill(Pid::from_raw(child.id() as i32), signal);
}

/// SIGTERM, then SIGKILL if `child` has not exited within `wait`; reaps it either way.
pub fn stop(child: &mut Child, wait: Duration) {
    signal(child, Signal::SIGTERM);
    let deadline = Instant::now() + wait;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    let _ = child.kill();
    let _ = child.wait();
}
