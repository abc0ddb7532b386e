//! TLS on the Redis front end's TLS port (Redis' `tls-port`): rustls over a blocking TCP
//! socket, served by a connection thread like plain connections under the thread model.
//! The certificate, key, CA and client-certificate rule come from a
//! [`racekv_transport::ServerTls`], which reloads them on demand (the computenode's SIGHUP):
//! each new connection takes the configuration current at its accept.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use racekv_transport::ServerTls;
use rustls::{ServerConnection, StreamOwned};

use crate::conn::ClientConn;

/// Longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A client's TLS session over its TCP socket.
pub(crate) struct TlsConn(StreamOwned<ServerConnection, TcpStream>);

/// Runs the server side of the handshake on `tcp` (bounded by [`HANDSHAKE_TIMEOUT`]).
pub(crate) fn accept(tls: &ServerTls, tcp: TcpStream) -> io::Result<TlsConn> {
    let conn = ServerConnection::new(tls.config()).map_err(io::Error::other)?;
    tcp.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    tcp.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut stream = StreamOwned::new(conn, tcp);
    while stream.conn.is_handshaking() {
        let (read, written) = stream.conn.complete_io(&mut stream.sock)?;
        if read == 0 && written == 0 && stream.conn.is_handshaking() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(TlsConn(stream))
}

impl Read for TlsConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.0.read(buf) {
            // A client that closes without close_notify ends like a plain one: a command cut
            // in half is still noticed by the parser.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
            other => other,
        }
    }
}

impl Write for TlsConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl ClientConn for TlsConn {
    fn tcp(&self) -> &TcpStream {
        &self.0.sock
    }

    fn finish(&mut self) {
        self.0.conn.send_close_notify();
        let _ = self.0.flush();
    }
}
