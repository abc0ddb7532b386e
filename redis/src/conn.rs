//! The byte stream a connection thread serves a client over: plain TCP, or TLS over it.

use std::io::{Read, Write};
use std::net::TcpStream;

/// A client's connection as the thread-per-connection server uses it.
pub(crate) trait ClientConn: Read + Write {
    /// The TCP socket underneath (timeouts, half-close).
    fn tcp(&self) -> &TcpStream;

    /// Ends the session on our side before the half-close (TLS: close_notify).
    fn finish(&mut self) {}
}

impl ClientConn for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}
