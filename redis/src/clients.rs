//! A server's connections as `CLIENT LIST`, `CLIENT KILL` and `CLIENT PAUSE` see them.
//!
//! Every [`Client`](crate::Client) registers a [`ClientHandle`] for its lifetime. What
//! changes per command (the last command and when it ran) is two relaxed atomic stores; what
//! changes rarely (name, library, user, protocol, address) sits behind a lock that only
//! identity commands and `CLIENT LIST` take. Killing a connection sets its flag and asks the
//! server to close it ([`Registry::set_closer`]): a connection thread's socket is shut down,
//! an event loop is woken to drop it.
//!
//! `CLIENT PAUSE` is a deadline every command checks with one atomic load while no pause is
//! on; paused commands wait (a connection thread on a condition variable, an event loop's
//! connection is set aside and looked at again every tick) until the deadline or `CLIENT
//! UNPAUSE`, whichever comes first.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The longest `CLIENT PAUSE` racekv accepts: a pause holds connections' commands (and, in
/// the thread-per-connection model, their threads) until it ends.
pub const MAX_CLIENT_PAUSE: Duration = Duration::from_secs(3600);

/// What a connection is, for `CLIENT LIST`; changes rarely.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClientMeta {
    pub addr: Option<SocketAddr>,
    pub laddr: Option<SocketAddr>,
    /// The socket's descriptor (-1: none, e.g. a client made in a test).
    pub fd: i64,
    pub name: Option<Vec<u8>>,
    pub lib_name: Option<Vec<u8>>,
    pub lib_ver: Option<Vec<u8>>,
    /// The authenticated user; `default` before AUTH, as Redis shows it.
    pub user: String,
    pub resp: i64,
    pub no_evict: bool,
    pub no_touch: bool,
}

/// One connection in the registry.
#[derive(Debug)]
pub(crate) struct ClientHandle {
    pub id: u64,
    created: Instant,
    /// Milliseconds since the registry's epoch at the last command.
    last_active_ms: AtomicU64,
    /// The last command's catalog id plus one (0: none yet).
    last_command: AtomicU32,
    killed: AtomicBool,
    /// Commands queued since MULTI (-1: not in a transaction), and their bytes.
    multi: AtomicI64,
    multi_mem: AtomicU64,
    meta: Mutex<ClientMeta>,
}

impl ClientHandle {
    /// Notes a command (`command_id`: its catalog id) that ran at `at`.
    pub fn touch(&self, epoch: Instant, at: Instant, command_id: u16) {
        let ms = at.saturating_duration_since(epoch).as_millis() as u64;
        self.last_active_ms.store(ms, Ordering::Relaxed);
        self.last_command.store(u32::from(command_id) + 1, Ordering::Relaxed);
    }

    /// The last command's catalog id.
    pub fn last_command(&self) -> Option<u16> {
        self.last_command.load(Ordering::Relaxed).checked_sub(1).map(|id| id as u16)
    }

    /// Seconds since the connection was accepted, and since its last command.
    pub fn age_and_idle(&self, epoch: Instant, now: Instant) -> (u64, u64) {
        let age = now.saturating_duration_since(self.created);
        let active = epoch + Duration::from_millis(self.last_active_ms.load(Ordering::Relaxed));
        let idle = if self.last_command().is_some() { now.saturating_duration_since(active) } else { age };
        (age.as_secs(), idle.as_secs())
    }

    /// Whether `CLIENT KILL` chose this connection.
    pub fn killed(&self) -> bool {
        self.killed.load(Ordering::Acquire)
    }

    /// Notes the transaction state: `Some((commands, bytes))` queued since MULTI, `None`
    /// outside one.
    pub fn set_multi(&self, queued: Option<(usize, usize)>) {
        let (count, bytes) = queued.map_or((-1, 0), |(n, b)| (n as i64, b as u64));
        self.multi.store(count, Ordering::Relaxed);
        self.multi_mem.store(bytes, Ordering::Relaxed);
    }

    /// Commands queued since MULTI (-1: not in a transaction) and their bytes.
    pub fn multi(&self) -> (i64, u64) {
        (self.multi.load(Ordering::Relaxed), self.multi_mem.load(Ordering::Relaxed))
    }

    pub fn meta(&self) -> parking_lot::MutexGuard<'_, ClientMeta> {
        self.meta.lock()
    }
}

/// Closes a connection by id: set by the server, which knows how it serves it.
type Closer = Box<dyn Fn(u64) + Send + Sync>;

/// Every connection of a server, and its pause.
pub(crate) struct Registry {
    epoch: Instant,
    clients: Mutex<BTreeMap<u64, Arc<ClientHandle>>>,
    closer: OnceLock<Closer>,
    pub pause: Pause,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("clients", &self.clients.lock().len()).finish()
    }
}

impl Registry {
    pub fn new(epoch: Instant) -> Self {
        Self { epoch, clients: Mutex::new(BTreeMap::new()), closer: OnceLock::new(), pause: Pause::new(epoch) }
    }

    /// The instant command times are counted from.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Registers a new connection numbered `id`.
    pub fn register(&self, id: u64) -> Arc<ClientHandle> {
        let now = Instant::now();
        let handle = Arc::new(ClientHandle {
            id,
            created: now,
            last_active_ms: AtomicU64::new(now.saturating_duration_since(self.epoch).as_millis() as u64),
            last_command: AtomicU32::new(0),
            killed: AtomicBool::new(false),
            multi: AtomicI64::new(-1),
            multi_mem: AtomicU64::new(0),
            meta: Mutex::new(ClientMeta {
                fd: -1,
                user: crate::acl::DEFAULT_USER.into(),
                resp: 2,
                ..ClientMeta::default()
            }),
        });
        self.clients.lock().insert(id, Arc::clone(&handle));
        handle
    }

    /// Removes `handle` (if it is still the one registered under its id).
    pub fn unregister(&self, handle: &Arc<ClientHandle>) {
        let mut clients = self.clients.lock();
        if clients.get(&handle.id).is_some_and(|h| Arc::ptr_eq(h, handle)) {
            clients.remove(&handle.id);
        }
    }

    /// Every registered connection, by id.
    pub fn all(&self) -> Vec<Arc<ClientHandle>> {
        self.clients.lock().values().cloned().collect()
    }

    /// Connections registered now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.clients.lock().len()
    }

    /// How the server closes a connection; the first call wins.
    pub fn set_closer(&self, closer: impl Fn(u64) + Send + Sync + 'static) {
        let _ = self.closer.set(Box::new(closer));
    }

    /// Marks `handle` killed and has the server close its connection. A connection killing
    /// itself is closed by its own server loop after the reply instead.
    pub fn kill(&self, handle: &ClientHandle, closer_too: bool) {
        handle.killed.store(true, Ordering::Release);
        if closer_too {
            if let Some(close) = self.closer.get() {
                close(handle.id);
            }
        }
        // A connection thread waiting out a pause must notice.
        self.pause.wake_all();
    }
}

/// `CLIENT PAUSE` state.
pub(crate) struct Pause {
    epoch: Instant,
    /// Milliseconds since the epoch the pause ends at; 0: no pause.
    until_ms: AtomicU64,
    /// Pause every command (ALL), not only writes (WRITE).
    all: AtomicBool,
    /// The connection that paused (its own commands are not held).
    by: AtomicU64,
    /// Commands held now (`INFO`'s `blocked_clients`: a connection holds at most one).
    held: AtomicUsize,
    lock: Mutex<()>,
    changed: Condvar,
    /// Wakes the event loops when the pause ends early.
    wakers: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
}

impl Pause {
    fn new(epoch: Instant) -> Self {
        Self {
            epoch,
            until_ms: AtomicU64::new(0),
            all: AtomicBool::new(false),
            by: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            lock: Mutex::new(()),
            changed: Condvar::new(),
            wakers: Mutex::new(Vec::new()),
        }
    }

    /// Pauses for `duration` (writes only unless `all`), by client `by`. A pause already on
    /// keeps the later end and the stricter mode, as Redis does.
    pub fn start(&self, duration: Duration, all: bool, by: u64) {
        let _guard = self.lock.lock();
        let end = (Instant::now() + duration).saturating_duration_since(self.epoch).as_millis() as u64;
        let current = self.until_ms.load(Ordering::Acquire);
        let active = current != 0 && self.deadline(current) > Instant::now();
        let all = all || (active && self.all.load(Ordering::Relaxed));
        self.all.store(all, Ordering::Relaxed);
        self.by.store(by, Ordering::Relaxed);
        self.until_ms.store(if active { end.max(current) } else { end }.max(1), Ordering::Release);
    }

    /// Ends the pause now.
    pub fn stop(&self) {
        {
            let _guard = self.lock.lock();
            self.until_ms.store(0, Ordering::Release);
        }
        self.wake_all();
    }

    fn deadline(&self, until_ms: u64) -> Instant {
        self.epoch + Duration::from_millis(until_ms)
    }

    /// Until when a command of client `id` (`write`: whether it has the `write` flag, asked
    /// only during a pause) must wait; `None`: it may run. One atomic load while no pause
    /// is on.
    pub fn holds(&self, id: u64, write: impl FnOnce() -> bool) -> Option<Instant> {
        let until = self.until_ms.load(Ordering::Acquire);
        if until == 0 {
            return None;
        }
        let deadline = self.deadline(until);
        if Instant::now() >= deadline || self.by.load(Ordering::Relaxed) == id {
            return None;
        }
        (self.all.load(Ordering::Relaxed) || write()).then_some(deadline)
    }

    /// Whether a pause is on now, and whether it holds every command.
    pub fn state(&self) -> Option<(Instant, bool)> {
        let until = self.until_ms.load(Ordering::Acquire);
        let deadline = self.deadline(until);
        (until != 0 && Instant::now() < deadline).then(|| (deadline, self.all.load(Ordering::Relaxed)))
    }

    /// Blocks the calling connection thread until `deadline`, or until the pause changes or a
    /// connection is killed (the caller looks again).
    pub fn wait(&self, deadline: Instant) {
        let mut guard = self.lock.lock();
        if self.until_ms.load(Ordering::Acquire) != 0 {
            self.changed.wait_until(&mut guard, deadline);
        }
    }

    /// Connections whose next command waits for the pause now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// A connection's command starts (`true`) or stops (`false`) waiting.
    pub fn set_held(&self, holding: bool) {
        if holding {
            self.held.fetch_add(1, Ordering::Relaxed);
        } else {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Registers an event loop's wake-up, called when the pause ends early.
    pub fn add_waker(&self, wake: impl Fn() + Send + Sync + 'static) {
        self.wakers.lock().push(Box::new(wake));
    }

    fn wake_all(&self) {
        {
            let _guard = self.lock.lock();
            self.changed.notify_all();
        }
        for wake in self.wakers.lock().iter() {
            wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_tracks_connections_and_their_last_command() {
        let epoch = Instant::now();
        let registry = Registry::new(epoch);
        let a = registry.register(1);
        let b = registry.register(2);
        assert_eq!(registry.all().iter().map(|h| h.id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(a.last_command(), None);
        a.touch(epoch, Instant::now(), 7);
        assert_eq!(a.last_command(), Some(7));
        registry.unregister(&b);
        assert_eq!(registry.len(), 1);
        // A stale handle does not remove a newer registration of the same id.
        let a2 = registry.register(1);
        registry.unregister(&a);
        assert_eq!(registry.len(), 1);
        registry.unregister(&a2);
        assert_eq!(registry.len(), 0);
    }

    #[test]
    fn kill_flags_and_asks_the_server_to_close() {
        let registry = Registry::new(Instant::now());
        let closed = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&closed);
        registry.set_closer(move |id| seen.lock().push(id));
        let a = registry.register(5);
        registry.kill(&a, true);
        assert!(a.killed());
        assert_eq!(*closed.lock(), [5]);
        let b = registry.register(6);
        registry.kill(&b, false);
        assert!(b.killed());
        assert_eq!(*closed.lock(), [5], "a connection killing itself closes on its own");
    }

    #[test]
    fn pause_holds_writes_or_everything_but_not_the_pauser() {
        let pause = Pause::new(Instant::now());
        assert_eq!(pause.holds(1, || true), None);
        pause.start(Duration::from_secs(60), false, 1);
        assert!(pause.holds(2, || true).is_some());
        assert_eq!(pause.holds(2, || false), None, "WRITE lets reads through");
        assert_eq!(pause.holds(1, || true), None, "the pausing connection is not held");
        pause.start(Duration::from_secs(1), true, 1);
        assert!(pause.holds(2, || false).is_some(), "ALL holds reads");
        let (deadline, all) = pause.state().unwrap();
        assert!(all && deadline > Instant::now() + Duration::from_secs(30), "the later end is kept");
        pause.stop();
        assert_eq!(pause.holds(2, || true), None);
        assert_eq!(pause.state(), None);
    }
}
