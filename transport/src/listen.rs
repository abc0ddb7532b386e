//! What servers share (the region server, the computenode's attach and Redis front ends,
//! its workers): binding a Unix socket where a killed server left its file, and keeping the
//! handles of the threads they start per connection (or worker) for shutdown to join.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::thread::JoinHandle;

use parking_lot::Mutex;

/// Binds a Unix socket at `path`. A file already there is a socket left by a killed server
/// and is removed, unless something still answers on it: then AddrInUse, naming `who`
/// listens there (`"another computenode"`).
pub fn bind_unix(path: &Path, who: &str) -> io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} is in use: {who} listens there", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path)
}

/// Starts a thread named `name` running `f` and keeps its handle in `threads`, dropping
/// those of threads that finished (a long-lived server would otherwise hold one per
/// connection it ever served).
pub fn spawn_tracked(
    threads: &Mutex<Vec<JoinHandle<()>>>,
    name: String,
    f: impl FnOnce() + Send + 'static,
) -> io::Result<()> {
    let handle = std::thread::Builder::new().name(name).spawn(f)?;
    let mut threads = threads.lock();
    threads.retain(|t| !t.is_finished());
    threads.push(handle);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap()); // the file stays, nobody listens
        let live = bind_unix(&path, "another test").unwrap();
        let err = bind_unix(&path, "another test").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(err.to_string().contains("another test listens there"), "{err}");
        drop(live);
    }

    #[test]
    fn finished_threads_are_dropped() {
        let threads = Mutex::new(Vec::new());
        spawn_tracked(&threads, "t-0".into(), || {}).unwrap();
        while !threads.lock()[0].is_finished() {
            std::thread::yield_now();
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        spawn_tracked(&threads, "t-1".into(), move || {
            let _ = rx.recv();
        })
        .unwrap();
        assert_eq!(threads.lock().len(), 1);
        drop(tx);
        for t in threads.lock().drain(..) {
            t.join().unwrap();
        }
    }
}
