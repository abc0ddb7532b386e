//! The sockets a region server accepts (tcp, TLS over tcp, Unix, verbs control) behind one
//! trait, so its connection loop and FLOCK's lane set-up serve them alike.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::tls::{ServerTls, TcpLink, TlsStream};
use crate::wire;

/// A socket the server loop can serve.
pub(crate) trait ServerStream: Read + Write + AsFd + Send + 'static {
    fn listener(&self) -> &'static str;
    /// The peer, for logs.
    fn peer(&self) -> String;
    /// Turns the connection into TLS when `tls` is given and this listener uses it (tcp).
    fn start_tls(&mut self, tls: Option<&ServerTls>, deadline: Instant) -> io::Result<()> {
        let _ = (tls, deadline);
        Ok(())
    }
    fn try_clone_stream(&self) -> io::Result<Self>
    where
        Self: Sized;
    fn shutdown_both(&self);
    /// Sends `bytes` with `fd` attached (Unix sockets only).
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()>;
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()>;
}

impl ServerStream for TcpStream {
    fn listener(&self) -> &'static str {
        "tcp"
    }
    fn peer(&self) -> String {
        self.peer_addr().map_or_else(|_| "unknown".into(), |a| a.to_string())
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn send_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "file descriptors travel only over Unix sockets"))
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

impl ServerStream for TcpLink {
    fn listener(&self) -> &'static str {
        "tcp"
    }
    fn peer(&self) -> String {
        self.socket().peer()
    }
    fn start_tls(&mut self, tls: Option<&ServerTls>, deadline: Instant) -> io::Result<()> {
        if let (Some(tls), TcpLink::Plain(socket)) = (tls, &*self) {
            *self = TcpLink::Tls(TlsStream::server(socket.try_clone()?, tls, deadline)?);
        }
        Ok(())
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        self.shutdown();
    }
    fn send_with_fd(&mut self, _bytes: &[u8], _fd: BorrowedFd<'_>) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "file descriptors travel only over Unix sockets"))
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.socket().set_timeouts(read, write)
    }
}

impl ServerStream for UnixStream {
    fn listener(&self) -> &'static str {
        "unix"
    }
    fn peer(&self) -> String {
        "unix socket".into()
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        crate::fdpass::send_with_fd(self, bytes, fd)
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(read))?;
        self.set_write_timeout(Some(write))
    }
}

/// The control channel of a verbs client: a TCP stream that may carry the QP exchange and
/// RPC, but no batches.
#[cfg(feature = "rdma")]
pub(crate) struct VerbsControl(pub(crate) TcpStream);

#[cfg(feature = "rdma")]
impl Read for VerbsControl {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

#[cfg(feature = "rdma")]
impl Write for VerbsControl {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(feature = "rdma")]
impl AsFd for VerbsControl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(feature = "rdma")]
impl ServerStream for VerbsControl {
    fn listener(&self) -> &'static str {
        "verbs"
    }
    fn peer(&self) -> String {
        self.0.peer()
    }
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.0.try_clone().map(VerbsControl)
    }
    fn shutdown_both(&self) {
        self.0.shutdown_both();
    }
    fn send_with_fd(&mut self, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
        self.0.send_with_fd(bytes, fd)
    }
    fn set_timeouts(&self, read: Duration, write: Duration) -> io::Result<()> {
        self.0.set_timeouts(read, write)
    }
}

/// Refuses the connection with an error frame; returns the metric reason.
pub(crate) fn refuse<S: ServerStream, T>(
    stream: &mut S,
    out: &mut Vec<u8>,
    request_id: u64,
    code: u16,
    message: &str,
    reason: &'static str,
) -> Result<T, &'static str> {
    out.clear();
    wire::encode_error(out, request_id, code, message);
    let _ = stream.write_all(out);
    stream.shutdown_both();
    Err(reason)
}
