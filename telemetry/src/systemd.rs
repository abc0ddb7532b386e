//! Telling a service manager how a daemon is doing (systemd's `Type=notify`): `READY=1` once
//! it serves, `STOPPING=1` when it begins to stop. Outside systemd (`NOTIFY_SOCKET` unset)
//! these do nothing.

/// Says the daemon is ready, with `status` as the line `systemctl status` shows.
pub fn notify_ready(status: &str) {
    send(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(status)]);
}

/// Says the daemon is stopping.
pub fn notify_stopping() {
    send(&[sd_notify::NotifyState::Stopping]);
}

fn send(states: &[sd_notify::NotifyState<'_>]) {
    // Keep NOTIFY_SOCKET: children (none today) are not the service's main process anyway,
    // and systemd ignores them unless NotifyAccess=all.
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!("telling the service manager our state failed: {e}");
    }
}
