//! TLS on tcp connections to a region server: rustls with the ring provider, TLS 1.3 only.
//!
//! [`ServerTls`]: a certificate chain and key (PEM files), and optionally a CA that client
//! certificates must chain to ([`ClientAuth`]: no / optional / yes, as Redis names it).
//! [`ServerTls::reload`] re-reads the files: new connections get the new certificate, open
//! ones keep theirs, and a reload that fails keeps the old one. [`ClientTls`]: the CA to
//! trust, optionally our own certificate and key, and the name the server's certificate must
//! carry (default: the endpoint's host). The token handshake ([`crate::auth`]) runs inside
//! TLS: TLS protects the channel, the token authenticates the peer.
//!
//! [`TlsStream`] shares one rustls connection between clones of a socket, as the tcp client's
//! mux and lanes need (one thread reads while another writes). Nobody holds the connection's
//! lock while blocked on the socket: a reader reads ciphertext, then locks to decrypt; a
//! writer locks to encrypt, then sends the records holding only a send lock that keeps them
//! in order. Holding the connection across a blocking send would deadlock two peers that
//! both send more than the socket buffers hold (the reader could not drain its side).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use prometheus::IntCounterVec;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

use crate::stream::is_timeout;

/// Ciphertext read from the socket at a time: one whole TLS record (16 KiB of plaintext plus
/// header, padding and tag) fits. Also the most ciphertext a stream holds undecrypted.
const RAW_READ_BYTES: usize = 18 * 1024;

static RELOADS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_transport_tls_reloads_total",
        "Reloads of a region server's TLS certificate and key",
        &["result"],
        &[],
    )
});

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A failure of the TLS layer (as opposed to the socket), carried inside an `io::Error`.
#[derive(Debug)]
struct TlsError(String);

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TLS: {}", self.0)
    }
}

impl std::error::Error for TlsError {}

fn tls_error(e: impl fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, TlsError(e.to_string()))
}

/// True for errors of the TLS layer (bad certificate, alert, not TLS at all).
pub(crate) fn is_tls_error(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<TlsError>())
}

fn file_error(path: &Path, what: &str, e: impl fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{what} {}: {e}", path.display()))
}

fn read_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, "reading certificates from", e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, "reading certificates from", e))?;
    if certs.is_empty() {
        return Err(file_error(path, "reading certificates from", "no PEM certificate in it"));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_error(path, "reading a private key from", e))
}

fn read_roots(path: &Path) -> io::Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|e| file_error(path, "trusting a CA certificate from", e))?;
    }
    Ok(Arc::new(roots))
}

/// Whether a server asks clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAuth {
    /// No client certificates (the token alone authenticates clients).
    #[default]
    No,
    /// A client may present a certificate; one that does must chain to the CA.
    Optional,
    /// Every client must present a certificate that chains to the CA.
    Yes,
}

impl From<racekv_telemetry::tls::TlsAuthClients> for ClientAuth {
    fn from(value: racekv_telemetry::tls::TlsAuthClients) -> Self {
        use racekv_telemetry::tls::TlsAuthClients;
        match value {
            TlsAuthClients::No => ClientAuth::No,
            TlsAuthClients::Optional => ClientAuth::Optional,
            TlsAuthClients::Yes => ClientAuth::Yes,
        }
    }
}

impl std::str::FromStr for ClientAuth {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "no" => Ok(ClientAuth::No),
            "optional" => Ok(ClientAuth::Optional),
            "yes" => Ok(ClientAuth::Yes),
            other => Err(format!("client certificate check {other:?}: use no, optional or yes")),
        }
    }
}

/// Where a server's TLS material lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert_file: PathBuf,
    /// The leaf's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// CA certificates that client certificates must chain to (PEM); needed unless
    /// `auth_clients` is [`ClientAuth::No`].
    pub ca_file: Option<PathBuf>,
    /// Whether clients must present a certificate.
    pub auth_clients: ClientAuth,
}

impl ServerTlsFiles {
    fn load(&self) -> io::Result<Arc<ServerConfig>> {
        let certs = read_certs(&self.cert_file)?;
        let key = read_key(&self.key_file)?;
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?;
        let builder = match (self.auth_clients, &self.ca_file) {
            (ClientAuth::No, _) => builder.with_no_client_auth(),
            (auth, Some(ca)) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(read_roots(ca)?, provider());
                let verifier = if auth == ClientAuth::Optional { verifier.allow_unauthenticated() } else { verifier };
                builder.with_client_cert_verifier(verifier.build().map_err(|e| file_error(ca, "using the CA", e))?)
            }
            (_, None) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "checking client certificates needs a CA file to check them against",
                ))
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| file_error(&self.key_file, "pairing the certificate with the key", e))?;
        // No resumption: every connection checks the current certificate in full.
        config.send_tls13_tickets = 0;
        Ok(Arc::new(config))
    }
}

/// A region server's TLS settings; clones share them, so a clone kept elsewhere (the
/// memnode's SIGHUP handler) reloads what the server uses.
#[derive(Clone)]
pub struct ServerTls {
    inner: Arc<ServerTlsInner>,
}

struct ServerTlsInner {
    files: ServerTlsFiles,
    config: RwLock<Arc<ServerConfig>>,
}

impl ServerTls {
    /// Reads the files (an error names the file and what was wrong).
    pub fn load(files: ServerTlsFiles) -> io::Result<Self> {
        let config = RwLock::new(files.load()?);
        for result in ["ok", "error"] {
            RELOADS.with_label_values(&[result]);
        }
        Ok(Self { inner: Arc::new(ServerTlsInner { files, config }) })
    }

    /// Reads the files again; new connections use what they hold from now on. On failure
    /// the previous certificate stays in use and the error is logged and returned.
    pub fn reload(&self) -> io::Result<()> {
        match self.inner.files.load() {
            Ok(config) => {
                *self.inner.config.write() = config;
                RELOADS.with_label_values(&["ok"]).inc();
                tracing::info!(cert = %self.inner.files.cert_file.display(), "reloaded the TLS certificate");
                Ok(())
            }
            Err(e) => {
                RELOADS.with_label_values(&["error"]).inc();
                tracing::error!("TLS reload failed, still serving the previous certificate: {e}");
                Err(e)
            }
        }
    }

    /// The files the configuration was loaded from.
    pub fn files(&self) -> &ServerTlsFiles {
        &self.inner.files
    }

    /// What a new connection uses now (other servers, the Redis front end's TLS port, take
    /// their rustls configuration from here so that one SIGHUP reloads them all).
    pub fn config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.inner.config.read())
    }
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls").field("files", &self.inner.files).finish()
    }
}

/// A client's TLS settings, read once from PEM files.
#[derive(Clone)]
pub struct ClientTls {
    roots: Arc<RootCertStore>,
    config: Arc<ClientConfig>,
    server_name: Option<String>,
    ca_file: PathBuf,
    cert_file: Option<PathBuf>,
}

impl ClientTls {
    /// Trusts the CA certificates in `ca_file` (PEM); presents no certificate of its own.
    pub fn new(ca_file: impl AsRef<Path>) -> io::Result<Self> {
        let ca_file = ca_file.as_ref().to_path_buf();
        let roots = read_roots(&ca_file)?;
        let config = Self::builder(&roots)?.with_no_client_auth();
        Ok(Self { roots, config: Arc::new(config), server_name: None, ca_file, cert_file: None })
    }

    /// Presents the certificate chain in `cert_file` with the key in `key_file` (mutual TLS).
    pub fn with_client_cert(mut self, cert_file: impl AsRef<Path>, key_file: impl AsRef<Path>) -> io::Result<Self> {
        let (cert_file, key_file) = (cert_file.as_ref(), key_file.as_ref());
        let config = Self::builder(&self.roots)?
            .with_client_auth_cert(read_certs(cert_file)?, read_key(key_file)?)
            .map_err(|e| file_error(key_file, "pairing the client certificate with the key", e))?;
        self.config = Arc::new(config);
        self.cert_file = Some(cert_file.to_path_buf());
        Ok(self)
    }

    /// The name the server's certificate must carry, instead of the endpoint's host.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    fn builder(
        roots: &Arc<RootCertStore>,
    ) -> io::Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>> {
        Ok(ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_error)?
            .with_root_certificates(Arc::clone(roots)))
    }
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// The host part of `host:port` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(host, _)| host).trim_start_matches('[').trim_end_matches(']')
}

struct State {
    conn: rustls::Connection,
    /// Ciphertext read but not yet given to rustls (at most [`RAW_READ_BYTES`]).
    pending: Vec<u8>,
}

impl State {
    /// Plaintext into `buf`: Some(n) (0 at the end of the stream), or None when rustls needs
    /// more ciphertext than is pending.
    fn take_plaintext(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        loop {
            match self.conn.reader().read(buf) {
                Ok(n) => return Ok(Some(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // Closed without close_notify: our frames carry their length, so a cut
                // shows up as a short frame; a cut between frames is a plain close.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Some(0)),
                Err(e) => return Err(e),
            }
            if self.pending.is_empty() {
                return Ok(None);
            }
            let used = self.conn.read_tls(&mut &self.pending[..]).map_err(tls_error)?;
            self.pending.drain(..used);
            self.conn.process_new_packets().map_err(tls_error)?;
            if used == 0 {
                return Ok(Some(0)); // rustls takes nothing more after close_notify
            }
        }
    }
}

/// One TLS connection over a TCP socket, shareable by clones (see the module doc).
pub(crate) struct TlsStream {
    state: Arc<Mutex<State>>,
    /// Held while records go out, so they leave in order; the scratch buffer they leave from.
    send: Arc<Mutex<Vec<u8>>>,
    socket: TcpStream,
}

impl TlsStream {
    fn new(socket: TcpStream, conn: rustls::Connection) -> Self {
        let state = State { conn, pending: Vec::with_capacity(RAW_READ_BYTES) };
        Self { state: Arc::new(Mutex::new(state)), send: Arc::new(Mutex::new(Vec::new())), socket }
    }

    /// Connects TLS over `socket` to the server at `addr` (`host:port`) and finishes the
    /// handshake by `deadline`.
    pub(crate) fn client(socket: TcpStream, tls: &ClientTls, addr: &str, deadline: Instant) -> io::Result<Self> {
        let name = tls.server_name.as_deref().unwrap_or_else(|| host_of(addr)).to_string();
        let name = ServerName::try_from(name)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name: {e}")))?;
        let conn = ClientConnection::new(Arc::clone(&tls.config), name).map_err(tls_error)?;
        let stream = Self::new(socket, rustls::Connection::Client(conn));
        stream.handshake(deadline)?;
        Ok(stream)
    }

    /// Accepts TLS on `socket` with the server's current certificate, by `deadline`. A
    /// peer that closes before sending anything is an `UnexpectedEof` error.
    pub(crate) fn server(socket: TcpStream, tls: &ServerTls, deadline: Instant) -> io::Result<Self> {
        let conn = ServerConnection::new(tls.config()).map_err(tls_error)?;
        let stream = Self::new(socket, rustls::Connection::Server(conn));
        stream.handshake(deadline)?;
        Ok(stream)
    }

    fn handshake(&self, deadline: Instant) -> io::Result<()> {
        let mut raw = vec![0u8; RAW_READ_BYTES];
        let mut received = false;
        loop {
            self.send_all(&mut self.send.lock())?;
            if !self.state.lock().conn.is_handshaking() {
                return Ok(());
            }
            let n = match (&self.socket).read(&mut raw) {
                Ok(0) if !received => {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before the TLS handshake"))
                }
                Ok(0) => return Err(tls_error("the peer closed the connection during the handshake")),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if is_timeout(&e) => {
                    if Instant::now() >= deadline {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "the TLS handshake timed out"));
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            received = true;
            let mut state = self.state.lock();
            state.pending.extend_from_slice(&raw[..n]);
            // Feed what rustls takes now; anything after the handshake stays pending.
            while state.conn.is_handshaking() && !state.pending.is_empty() {
                let State { conn, pending } = &mut *state;
                let used = conn.read_tls(&mut &pending[..]).map_err(tls_error)?;
                pending.drain(..used);
                if let Err(e) = conn.process_new_packets() {
                    drop(state);
                    let _ = self.send_all(&mut self.send.lock()); // the alert, best effort
                    return Err(tls_error(e));
                }
                if used == 0 {
                    return Err(tls_error("the peer ended the session during the handshake"));
                }
            }
        }
    }

    /// Sends everything rustls has queued, holding the send lock (`scratch` is its buffer).
    fn send_all(&self, scratch: &mut Vec<u8>) -> io::Result<()> {
        loop {
            scratch.clear();
            {
                let mut state = self.state.lock();
                while state.conn.wants_write() {
                    state.conn.write_tls(scratch)?;
                }
            }
            if scratch.is_empty() {
                return Ok(());
            }
            (&self.socket).write_all(scratch)?;
        }
    }

    /// Sends what a reader queued (alerts, key updates) unless a writer is sending: the
    /// writer looks again once it is done.
    fn send_queued(&self) -> io::Result<()> {
        loop {
            if !self.state.lock().conn.wants_write() {
                return Ok(());
            }
            let Some(mut scratch) = self.send.try_lock() else { return Ok(()) };
            self.send_all(&mut scratch)?;
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        Ok(Self { state: Arc::clone(&self.state), send: Arc::clone(&self.send), socket: self.socket.try_clone()? })
    }
}

impl Read for &TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut raw = [0u8; RAW_READ_BYTES];
        loop {
            let taken = self.state.lock().take_plaintext(buf);
            let _ = self.send_queued();
            if let Some(n) = taken? {
                return Ok(n);
            }
            // Nothing pending: wait for ciphertext without holding the connection.
            let n = (&self.socket).read(&mut raw)?;
            let mut state = self.state.lock();
            if n == 0 {
                state.conn.read_tls(&mut io::empty()).map_err(tls_error)?; // tells rustls of the end
            } else {
                state.pending.extend_from_slice(&raw[..n]);
            }
        }
    }
}

impl Write for &TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut scratch = self.send.lock();
        // Takes what fits rustls's send buffer (64 KiB); write_all comes back for the rest.
        let n = self.state.lock().conn.writer().write(buf)?;
        self.send_all(&mut scratch)?;
        drop(scratch);
        self.send_queued()?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send_all(&mut self.send.lock())
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}

/// A tcp connection to or from a region server, with or without TLS.
pub(crate) enum TcpLink {
    Plain(TcpStream),
    Tls(TlsStream),
}

impl TcpLink {
    /// Another handle on the same connection (for a second thread).
    pub(crate) fn try_clone(&self) -> io::Result<Self> {
        match self {
            TcpLink::Plain(s) => s.try_clone().map(TcpLink::Plain),
            TcpLink::Tls(s) => s.try_clone().map(TcpLink::Tls),
        }
    }

    /// The socket underneath (timeouts, addresses).
    pub(crate) fn socket(&self) -> &TcpStream {
        match self {
            TcpLink::Plain(s) => s,
            TcpLink::Tls(s) => &s.socket,
        }
    }

    /// Closes both directions at once (no close_notify: it could block on a stuck peer, and
    /// our frames carry their length, so the peer tells a cut frame from a close anyway).
    pub(crate) fn shutdown(&self) {
        let _ = self.socket().shutdown(Shutdown::Both);
    }
}

impl Read for &TcpLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            TcpLink::Plain(s) => (&*s).read(buf),
            TcpLink::Tls(s) => (&*s).read(buf),
        }
    }
}

impl Write for &TcpLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            TcpLink::Plain(s) => (&*s).write(buf),
            TcpLink::Tls(s) => (&*s).write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match *self {
            TcpLink::Plain(s) => (&*s).flush(),
            TcpLink::Tls(s) => (&*s).flush(),
        }
    }
}

impl Read for TcpLink {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for TcpLink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        (&*self).flush()
    }
}

impl AsFd for TcpLink {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket().as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_come_from_endpoints() {
        assert_eq!(host_of("db.example:7400"), "db.example");
        assert_eq!(host_of("127.0.0.1:1"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7400"), "::1");
    }

    #[test]
    fn client_auth_parses_the_redis_words() {
        assert_eq!("no".parse(), Ok(ClientAuth::No));
        assert_eq!("optional".parse(), Ok(ClientAuth::Optional));
        assert_eq!("yes".parse(), Ok(ClientAuth::Yes));
        assert!("true".parse::<ClientAuth>().is_err());
    }

    #[test]
    fn missing_or_garbage_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate").unwrap();
        let e = ClientTls::new(&garbage).unwrap_err();
        assert!(e.to_string().contains("garbage.pem") && e.to_string().contains("no PEM certificate"), "{e}");
        let e = ClientTls::new(dir.path().join("absent.pem")).unwrap_err();
        assert!(e.to_string().contains("absent.pem"), "{e}");
    }
}
