//! The challenge-response that opens every connection to a region server: each side proves it
//! knows a key without sending it (frames and proof layout in [`crate::wire`]).
//!
//! ```text
//! client -> server  Hello     { client_nonce, protocol, user }
//! server -> client  Challenge { server_nonce, server_proofs = [HMAC(key, "racekv v2 server" | cn | sn), ...] }
//! client -> server  Proof     { client_proof = HMAC(key, "racekv v2 client" | cn | sn) }
//! server -> client  HelloOk   (or Error AUTH, then close)
//! ```
//!
//! The key is a shared token (memnodes: no user) or, for a named user, the SHA-256 of one of
//! its passwords ([`password_key`]; what an ACL keeps). The server's [`Credentials`] say which
//! keys a user may hold: it proves each (a user may have several passwords; the client checks
//! the proof of its own), and accepts a client proof made with any. A user that needs no
//! password gets no proofs and any client proof. The server's proof for an unknown user is
//! made with a random key, so a name's existence shows only as a failed proof either way.
//!
//! Both nonces are fresh per connection, so a proof recorded on one connection is worthless
//! on another; the labels keep a server's proof from passing as a client's. The client checks
//! the server's proof before it answers, so a server without the token (an impostor, or one
//! configured with another token) is told apart from a refusal and gets no proof and no
//! writes. Proofs are checked with [`Mac::verify_slice`] (constant time).
//!
//! [`ServerHandshake`] and [`ClientHandshake`] are the state machines without I/O (the fuzz
//! target drives them); [`accept`] and [`connect`] run them on a blocking stream. A failed
//! handshake is counted in `racekv_transport_auth_failures_total{listener,reason}` and logged
//! at most once per [`WARN_INTERVAL`], never with the token, a nonce or a proof.

use std::io::{self, Read, Write};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use hmac::{Hmac, KeyInit, Mac};
use prometheus::IntCounterVec;
use racekv_telemetry::ratelimit::RateLimit;
use sha2::Sha256;

use crate::error::TransportError;
use crate::stream::is_timeout;
use crate::wire::{self, error_code, Header, Kind, HEADER_BYTES, NONCE_BYTES, PROOF_BYTES};

const SERVER_LABEL: &[u8] = b"racekv v2 server";
const CLIENT_LABEL: &[u8] = b"racekv v2 client";
/// Largest frame body either side reads during the handshake: an Error frame with its
/// longest message (Hello, Challenge and Proof are smaller). A peer that has not proved the
/// token cannot make us buffer more.
const MAX_HANDSHAKE_BODY_BYTES: usize =
    max(8 + wire::MAX_ERROR_MESSAGE_BYTES, max(wire::MAX_HELLO_BYTES, wire::MAX_CHALLENGE_BYTES));

const fn max(a: usize, b: usize) -> usize {
    if a > b {
        a
    } else {
        b
    }
}
/// At most one warning line per this interval for failed handshakes (the counter has them all).
pub const WARN_INTERVAL: Duration = Duration::from_secs(10);

/// Why a handshake failed. [`AuthFailure::reason`] is its (bounded) metric label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthFailure {
    /// The peer's proof does not match the token.
    BadProof,
    /// A frame the handshake does not allow at this point (a batch before Proof, say).
    UnexpectedFrame(Kind),
    /// A frame that does not decode.
    Malformed(String),
    /// The peer speaks another wire version.
    Version(u8),
    /// The handshake did not finish within its time limit.
    Timeout,
    /// The TLS layer failed (no or untrusted certificate, not TLS at all, ...).
    Tls(String),
    /// The peer closed the connection during the handshake.
    Closed,
    /// The socket failed.
    Io(String),
}

impl AuthFailure {
    /// The failure's short name, as a metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthFailure::BadProof => "bad_proof",
            AuthFailure::UnexpectedFrame(_) => "unexpected_frame",
            AuthFailure::Malformed(_) => "malformed",
            AuthFailure::Version(_) => "version",
            AuthFailure::Timeout => "timeout",
            AuthFailure::Tls(_) => "tls",
            AuthFailure::Closed => "closed",
            AuthFailure::Io(_) => "io",
        }
    }

    /// Every [`Self::reason`], for exporting the series at zero.
    pub const REASONS: [&'static str; 8] =
        ["bad_proof", "unexpected_frame", "malformed", "version", "timeout", "tls", "closed", "io"];

    /// What may be logged about it (never secrets: the variants hold none).
    fn detail(&self) -> String {
        match self {
            AuthFailure::UnexpectedFrame(kind) => format!("{kind:?} before the handshake finished"),
            AuthFailure::Malformed(m) | AuthFailure::Tls(m) | AuthFailure::Io(m) => m.clone(),
            AuthFailure::Version(v) => format!("wire version {v}"),
            AuthFailure::BadProof | AuthFailure::Timeout | AuthFailure::Closed => String::new(),
        }
    }

    /// The Error frame that tells the peer why, if it can still read one.
    pub fn refusal(&self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        match self {
            AuthFailure::BadProof => wire::encode_error(&mut out, 0, error_code::AUTH, "authentication failed"),
            AuthFailure::UnexpectedFrame(kind) => wire::encode_error(
                &mut out,
                0,
                error_code::AUTH,
                &format!("authenticate first (Hello, then Proof); got {kind:?}"),
            ),
            AuthFailure::Malformed(m) => wire::encode_error(&mut out, 0, error_code::MALFORMED, m),
            AuthFailure::Timeout => {
                wire::encode_error(&mut out, 0, error_code::MALFORMED, "no handshake within the I/O timeout")
            }
            AuthFailure::Version(v) => wire::encode_error_version(
                &mut out,
                (*v).min(wire::VERSION),
                0,
                error_code::UNSUPPORTED,
                &format!(
                    "this server speaks racekv wire version {}, the client version {v}: upgrade the older side",
                    wire::VERSION
                ),
            ),
            // TLS sent its own alert; the others have nobody left to tell.
            AuthFailure::Tls(_) | AuthFailure::Closed | AuthFailure::Io(_) => return None,
        }
        Some(out)
    }
}

/// The keys a client naming a user (or none) may prove it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keys {
    /// Any of these (a token; a user's password keys).
    Keyed(Vec<Vec<u8>>),
    /// None needed: the user has no password (Redis' `nopass`).
    Open,
    /// No such user (or not allowed in): nothing authenticates.
    Unknown,
}

/// Who may connect to a server, and with which keys.
pub trait Credentials: Send + Sync + std::fmt::Debug {
    /// The keys of `user` (`None`: a client that names no user).
    fn keys(&self, user: Option<&str>) -> Keys;
}

/// A shared token: clients name no user (memnodes).
#[derive(Clone)]
pub struct Token(pub Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl Credentials for Token {
    fn keys(&self, user: Option<&str>) -> Keys {
        match user {
            None => Keys::Keyed(vec![self.0.clone()]),
            Some(_) => Keys::Unknown,
        }
    }
}

/// The key a password gives: its SHA-256, as an ACL keeps it.
pub fn password_key(password: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    Sha256::digest(password).to_vec()
}

/// Who a connection authenticated as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caller {
    /// The user it named; `None`: the shared token (or a connection inside the process).
    pub user: Option<String>,
}

/// A fresh nonce from the operating system's random source.
pub fn nonce() -> io::Result<[u8; NONCE_BYTES]> {
    let mut bytes = [0u8; NONCE_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| io::Error::other(format!("no random source for a nonce: {e}")))?;
    Ok(bytes)
}

fn keyed(
    token: &[u8],
    label: &[u8],
    client_nonce: &[u8; NONCE_BYTES],
    server_nonce: &[u8; NONCE_BYTES],
) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(token).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac
}

/// The server's proof for a pair of nonces.
pub fn server_proof(
    token: &[u8],
    client_nonce: &[u8; NONCE_BYTES],
    server_nonce: &[u8; NONCE_BYTES],
) -> [u8; PROOF_BYTES] {
    keyed(token, SERVER_LABEL, client_nonce, server_nonce).finalize().into_bytes().into()
}

/// The client's proof for a pair of nonces.
pub fn client_proof(
    token: &[u8],
    client_nonce: &[u8; NONCE_BYTES],
    server_nonce: &[u8; NONCE_BYTES],
) -> [u8; PROOF_BYTES] {
    keyed(token, CLIENT_LABEL, client_nonce, server_nonce).finalize().into_bytes().into()
}

/// The server's side, one frame at a time.
pub struct ServerHandshake<'a> {
    credentials: &'a dyn Credentials,
    server_nonce: [u8; NONCE_BYTES],
    /// After Hello: the client's nonce, the user it named, and the keys that user may prove.
    hello: Option<([u8; NONCE_BYTES], Option<String>, Keys)>,
    done: bool,
}

impl<'a> ServerHandshake<'a> {
    /// The server's side of a handshake, checking proofs against `credentials`, with its nonce `server_nonce`.
    pub fn new(credentials: &'a dyn Credentials, server_nonce: [u8; NONCE_BYTES]) -> Self {
        Self { credentials, server_nonce, hello: None, done: false }
    }

    /// Takes the client's next frame. Hello: appends the Challenge to `out` and returns
    /// `None`. Proof: returns who the client is when its proof matches a key of the user it
    /// named. Anything else, or anything once a step failed or finished, is an error.
    pub fn on_frame(&mut self, kind: Kind, body: &[u8], out: &mut Vec<u8>) -> Result<Option<Caller>, AuthFailure> {
        if self.done {
            return Err(AuthFailure::UnexpectedFrame(kind));
        }
        let result = self.step(kind, body, out);
        self.done = !matches!(result, Ok(None));
        result
    }

    fn step(&mut self, kind: Kind, body: &[u8], out: &mut Vec<u8>) -> Result<Option<Caller>, AuthFailure> {
        let malformed = |e: crate::decode::DecodeError| AuthFailure::Malformed(e.to_string());
        match (kind, &self.hello) {
            (Kind::Hello, None) => {
                let (client_nonce, user) = wire::decode_hello(body).map_err(malformed)?;
                let keys = match self.credentials.keys(user) {
                    Keys::Keyed(keys) if keys.len() > wire::MAX_PROOFS => {
                        Keys::Keyed(keys[..wire::MAX_PROOFS].to_vec())
                    }
                    keys => keys,
                };
                let server_proofs = match &keys {
                    Keys::Keyed(keys) => {
                        keys.iter().map(|k| server_proof(k, &client_nonce, &self.server_nonce)).collect()
                    }
                    Keys::Open => Vec::new(),
                    // A proof nobody can check, so an unknown name looks like a wrong password.
                    Keys::Unknown => {
                        vec![server_proof(&nonce().unwrap_or_default(), &client_nonce, &self.server_nonce)]
                    }
                };
                wire::encode_challenge(out, &wire::Challenge { server_nonce: self.server_nonce, server_proofs });
                self.hello = Some((client_nonce, user.map(String::from), keys));
                Ok(None)
            }
            (Kind::Proof, Some((client_nonce, user, keys))) => {
                let proof = wire::decode_proof(body).map_err(malformed)?;
                let accepted = match keys {
                    Keys::Open => true,
                    Keys::Unknown => false,
                    // Check every key, so timing does not tell which matched.
                    Keys::Keyed(keys) => keys.iter().fold(false, |found, key| {
                        keyed(key, CLIENT_LABEL, client_nonce, &self.server_nonce).verify_slice(&proof).is_ok() | found
                    }),
                };
                if accepted {
                    Ok(Some(Caller { user: user.clone() }))
                } else {
                    Err(AuthFailure::BadProof)
                }
            }
            (kind, _) => Err(AuthFailure::UnexpectedFrame(kind)),
        }
    }
}

/// The client's side.
pub struct ClientHandshake<'a> {
    key: Vec<u8>,
    user: Option<&'a str>,
    client_nonce: [u8; NONCE_BYTES],
}

impl<'a> ClientHandshake<'a> {
    /// A client holding `secret`: the shared token, or, when it names `user`, that user's
    /// password.
    pub fn new(secret: &[u8], user: Option<&'a str>, client_nonce: [u8; NONCE_BYTES]) -> Self {
        let key = if user.is_some() { password_key(secret) } else { secret.to_vec() };
        Self { key, user, client_nonce }
    }

    /// Appends Hello to `out`.
    pub fn hello(&self, out: &mut Vec<u8>) {
        wire::encode_hello(out, &self.client_nonce, self.user);
    }

    /// Takes the body of the server's Challenge: when the server proved it knows our key,
    /// appends our Proof to `out`. A named user that needs no password gets no proof (the
    /// server cannot prove a key it does not have: TLS is what authenticates it then); a
    /// token client always insists on one.
    pub fn on_challenge(&self, body: &[u8], out: &mut Vec<u8>) -> Result<(), AuthFailure> {
        let challenge = wire::decode_challenge(body).map_err(|e| AuthFailure::Malformed(e.to_string()))?;
        let open_user = self.user.is_some() && challenge.server_proofs.is_empty();
        let proven = challenge.server_proofs.iter().fold(false, |found, proof| {
            keyed(&self.key, SERVER_LABEL, &self.client_nonce, &challenge.server_nonce).verify_slice(proof).is_ok()
                | found
        });
        if !(proven || open_user) {
            return Err(AuthFailure::BadProof);
        }
        wire::encode_proof(out, &client_proof(&self.key, &self.client_nonce, &challenge.server_nonce));
        Ok(())
    }
}

/// A frame read during the handshake, or the version a peer of another version speaks.
enum Got {
    Frame(Header),
    OtherVersion(u8),
}

/// Reads one handshake frame (body into `body`, at most [`MAX_HANDSHAKE_BODY_BYTES`]) by
/// `deadline`. `Closed` only when the peer closed before sending anything of it.
fn read_frame<R: Read>(r: &mut R, body: &mut Vec<u8>, deadline: Instant) -> Result<Got, AuthFailure> {
    let speaks_tls = || AuthFailure::Tls("the peer speaks TLS: set a CA to trust (ConnectOptions::tls)".into());
    let mut header = [0u8; HEADER_BYTES];
    match fill(r, &mut header, deadline, true) {
        Ok(()) => {}
        // A TLS alert is shorter than a header.
        Err(AuthFailure::Io(_)) if looks_like_tls(&header) => return Err(speaks_tls()),
        Err(e) => return Err(e),
    }
    let parsed = match wire::decode_header(&header) {
        Ok(h) => h,
        Err(e) => {
            return match wire::header_version(&header) {
                Some(v) if v != wire::VERSION => Ok(Got::OtherVersion(v)),
                _ if looks_like_tls(&header) => Err(speaks_tls()),
                _ => Err(AuthFailure::Malformed(e.to_string())),
            }
        }
    };
    let len = parsed.body_len as usize;
    if len > MAX_HANDSHAKE_BODY_BYTES {
        return Err(match parsed.kind {
            Kind::Hello | Kind::Challenge | Kind::Proof | Kind::Error => {
                AuthFailure::Malformed(format!("a {:?} frame of {len} bytes", parsed.kind))
            }
            // Not read: it has no business here at any size.
            other => AuthFailure::UnexpectedFrame(other),
        });
    }
    body.clear();
    body.resize(len, 0);
    fill(r, body, deadline, false)?;
    Ok(Got::Frame(parsed))
}

/// A TLS record header (handshake or alert, version 3.x) where a frame should start.
fn looks_like_tls(bytes: &[u8]) -> bool {
    matches!(bytes, [0x15 | 0x16, 0x03, ..])
}

fn fill<R: Read>(r: &mut R, buf: &mut [u8], deadline: Instant, frame_start: bool) -> Result<(), AuthFailure> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 && frame_start => return Err(AuthFailure::Closed),
            Ok(0) => return Err(AuthFailure::Io("closed mid-frame".into())),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                if Instant::now() >= deadline {
                    return Err(AuthFailure::Timeout);
                }
            }
            Err(e) if crate::tls::is_tls_error(&e) => return Err(AuthFailure::Tls(e.to_string())),
            Err(e) => return Err(AuthFailure::Io(e.to_string())),
        }
    }
    Ok(())
}

/// How a server-side handshake ended without failing.
#[derive(Debug, PartialEq, Eq)]
pub enum Accepted {
    /// The client proved a key: answer HelloOk.
    Authenticated(Caller),
    /// The peer closed before sending anything (a port probe): nothing to count.
    Gone,
}

/// Runs the server's side on a fresh connection, within `limit`.
pub fn accept<S: Read + Write>(
    stream: &mut S,
    credentials: &dyn Credentials,
    limit: Duration,
) -> Result<Accepted, AuthFailure> {
    let deadline = Instant::now() + limit;
    let server_nonce = nonce().map_err(|e| AuthFailure::Io(e.to_string()))?;
    let mut handshake = ServerHandshake::new(credentials, server_nonce);
    let mut body = Vec::new();
    let mut out = Vec::new();
    let mut started = false;
    loop {
        let header = match read_frame(stream, &mut body, deadline) {
            Ok(Got::Frame(header)) => header,
            Ok(Got::OtherVersion(v)) => return Err(AuthFailure::Version(v)),
            Err(AuthFailure::Closed) if !started => return Ok(Accepted::Gone),
            Err(e) => return Err(e),
        };
        started = true;
        out.clear();
        if let Some(caller) = handshake.on_frame(header.kind, &body, &mut out)? {
            return Ok(Accepted::Authenticated(caller));
        }
        stream.write_all(&out).and_then(|()| stream.flush()).map_err(|e| AuthFailure::Io(e.to_string()))?;
    }
}

/// Runs the client's side on a fresh connection to `peer`, within `timeout`: returns once
/// the server proved our key and our Proof is sent (the server answers HelloOk next).
/// `secret` is the shared token, or `user`'s password when it names one.
pub fn connect<S: Read + Write>(
    stream: &mut S,
    secret: &str,
    user: Option<&str>,
    timeout: Duration,
    peer: &str,
) -> Result<(), TransportError> {
    let fail = |reason: String| TransportError::Connect { endpoint: peer.to_string(), reason };
    let deadline = Instant::now() + timeout;
    if user.is_some_and(|u| u.is_empty() || u.len() > wire::MAX_USER_BYTES) {
        return Err(fail(format!("a user name must have 1 to {} bytes", wire::MAX_USER_BYTES)));
    }
    let handshake = ClientHandshake::new(secret.as_bytes(), user, nonce().map_err(|e| fail(e.to_string()))?);
    let mut out = Vec::new();
    handshake.hello(&mut out);
    stream.write_all(&out).and_then(|()| stream.flush()).map_err(|e| fail(e.to_string()))?;
    let mut body = Vec::new();
    let header = match read_frame(stream, &mut body, deadline) {
        Ok(Got::Frame(header)) => header,
        Ok(Got::OtherVersion(v)) => {
            return Err(TransportError::Protocol(format!(
                "{peer} speaks racekv wire version {v}, this client speaks {}: upgrade the older side",
                wire::VERSION
            )))
        }
        Err(AuthFailure::Timeout) => return Err(TransportError::Timeout { waited_ms: timeout.as_millis() as u64 }),
        Err(AuthFailure::Closed) => return Err(fail("closed during the handshake".into())),
        Err(AuthFailure::Malformed(m)) => return Err(TransportError::Protocol(format!("{peer}: {m}"))),
        Err(e) => return Err(fail(e.detail())),
    };
    out.clear();
    match header.kind {
        Kind::Challenge => match handshake.on_challenge(&body, &mut out) {
            Ok(()) => {}
            Err(AuthFailure::BadProof) => return Err(TransportError::ServerNotAuthenticated { peer: peer.into() }),
            Err(e) => return Err(TransportError::Protocol(format!("{peer}: {}", e.detail()))),
        },
        Kind::Error => return Err(crate::mux::error_frame(&body, peer)),
        other => return Err(TransportError::Protocol(format!("{peer} answered hello with {other:?}"))),
    }
    stream.write_all(&out).and_then(|()| stream.flush()).map_err(|e| fail(e.to_string()))
}

static FAILURES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    racekv_telemetry::metric::counter_vec(
        "racekv_transport_auth_failures_total",
        "Connections closed because the peer failed the token handshake or TLS",
        &["listener", "reason"],
        &[],
    )
});

/// Exports every reason of `listener` at zero.
pub(crate) fn register_listener(listener: &'static str) {
    for reason in AuthFailure::REASONS {
        FAILURES.with_label_values(&[listener, reason]);
    }
}

static WARNINGS: RateLimit = RateLimit::new(WARN_INTERVAL.as_millis() as u64);

/// Counts a failed handshake and logs it, at most once per [`WARN_INTERVAL`].
pub(crate) fn record_failure(listener: &'static str, peer: &str, failure: &AuthFailure) {
    FAILURES.with_label_values(&[listener, failure.reason()]).inc();
    if let Some(suppressed) = WARNINGS.admit() {
        tracing::warn!(
            listener,
            peer,
            reason = failure.reason(),
            detail = %failure.detail(),
            suppressed,
            "region server: closed a connection that failed to authenticate"
        );
    }
}

/// Failed handshakes counted so far for `listener` and `reason` (tests, dashboards).
pub fn failures(listener: &str, reason: &str) -> u64 {
    FAILURES.with_label_values(&[listener, reason]).get()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &[u8] = b"secret";

    fn body(frame: &[u8]) -> &[u8] {
        &frame[HEADER_BYTES..]
    }

    fn token(t: &[u8]) -> Token {
        Token(t.to_vec())
    }

    /// Users for the tests: alice has two passwords, bob none (nopass).
    #[derive(Debug)]
    struct Users;

    impl Credentials for Users {
        fn keys(&self, user: Option<&str>) -> Keys {
            match user {
                Some("alice") => Keys::Keyed(vec![password_key(b"pw1"), password_key(b"pw2")]),
                Some("bob") => Keys::Open,
                _ => Keys::Unknown,
            }
        }
    }

    type Verdicts = (Result<(), AuthFailure>, Result<Option<Caller>, AuthFailure>);

    /// Runs a client and a server handshake against each other: the client's and the
    /// server's verdicts.
    fn exchange(secret: &[u8], user: Option<&str>, server: &dyn Credentials) -> Verdicts {
        let client = ClientHandshake::new(secret, user, [1; NONCE_BYTES]);
        let mut server = ServerHandshake::new(server, [2; NONCE_BYTES]);
        let (mut hello, mut challenge, mut proof) = (Vec::new(), Vec::new(), Vec::new());
        client.hello(&mut hello);
        assert_eq!(server.on_frame(Kind::Hello, body(&hello), &mut challenge), Ok(None));
        let checked = client.on_challenge(body(&challenge), &mut proof);
        if checked.is_err() {
            return (checked, Ok(None));
        }
        (checked, server.on_frame(Kind::Proof, body(&proof), &mut Vec::new()))
    }

    fn caller(user: Option<&str>) -> Result<Option<Caller>, AuthFailure> {
        Ok(Some(Caller { user: user.map(String::from) }))
    }

    #[test]
    fn matching_tokens_authenticate_both_ways() {
        assert_eq!(exchange(TOKEN, None, &token(TOKEN)), (Ok(()), caller(None)));
        assert_eq!(exchange(b"", None, &token(b"")), (Ok(()), caller(None)), "an empty token still works (tests, dev)");
    }

    #[test]
    fn the_client_detects_a_server_without_the_token() {
        assert_eq!(exchange(TOKEN, None, &token(b"other")).0, Err(AuthFailure::BadProof));
        assert_eq!(exchange(TOKEN, None, &Users).0, Err(AuthFailure::BadProof), "no token on a users' server");
    }

    #[test]
    fn users_prove_any_of_their_passwords() {
        assert_eq!(exchange(b"pw1", Some("alice"), &Users), (Ok(()), caller(Some("alice"))));
        assert_eq!(exchange(b"pw2", Some("alice"), &Users), (Ok(()), caller(Some("alice"))));
        assert_eq!(exchange(b"nope", Some("alice"), &Users).0, Err(AuthFailure::BadProof), "a wrong password");
        assert_eq!(exchange(b"pw1", Some("carol"), &Users).0, Err(AuthFailure::BadProof), "an unknown user");
        assert_eq!(exchange(b"pw1", Some("alice"), &token(TOKEN)).0, Err(AuthFailure::BadProof), "a token server");
        assert_eq!(exchange(b"anything", Some("bob"), &Users), (Ok(()), caller(Some("bob"))), "nopass");
    }

    #[test]
    fn a_client_proof_made_without_the_key_is_refused() {
        // The server's proofs for alice, then a client proof made with a wrong password.
        let mut server = ServerHandshake::new(&Users, [2; NONCE_BYTES]);
        let mut hello = Vec::new();
        ClientHandshake::new(b"x", Some("alice"), [1; NONCE_BYTES]).hello(&mut hello);
        server.on_frame(Kind::Hello, body(&hello), &mut Vec::new()).unwrap();
        let mut proof = Vec::new();
        wire::encode_proof(&mut proof, &client_proof(&password_key(b"guess"), &[1; NONCE_BYTES], &[2; NONCE_BYTES]));
        assert_eq!(server.on_frame(Kind::Proof, body(&proof), &mut Vec::new()), Err(AuthFailure::BadProof));
    }

    #[test]
    fn a_wrong_or_replayed_client_proof_is_refused() {
        let server_token = token(TOKEN);
        // A proof for other nonces (a recording) does not pass.
        let mut server = ServerHandshake::new(&server_token, [2; NONCE_BYTES]);
        let mut hello = Vec::new();
        ClientHandshake::new(TOKEN, None, [1; NONCE_BYTES]).hello(&mut hello);
        server.on_frame(Kind::Hello, body(&hello), &mut Vec::new()).unwrap();
        let mut replayed = Vec::new();
        wire::encode_proof(&mut replayed, &client_proof(TOKEN, &[1; NONCE_BYTES], &[3; NONCE_BYTES]));
        assert_eq!(server.on_frame(Kind::Proof, body(&replayed), &mut Vec::new()), Err(AuthFailure::BadProof));
        // The server's own proof, reflected, is not a client proof either.
        let mut server = ServerHandshake::new(&server_token, [2; NONCE_BYTES]);
        server.on_frame(Kind::Hello, body(&hello), &mut Vec::new()).unwrap();
        let mut reflected = Vec::new();
        wire::encode_proof(&mut reflected, &server_proof(TOKEN, &[1; NONCE_BYTES], &[2; NONCE_BYTES]));
        assert_eq!(server.on_frame(Kind::Proof, body(&reflected), &mut Vec::new()), Err(AuthFailure::BadProof));
        // Nothing more once it failed.
        let mut good = Vec::new();
        wire::encode_proof(&mut good, &client_proof(TOKEN, &[1; NONCE_BYTES], &[2; NONCE_BYTES]));
        assert_eq!(
            server.on_frame(Kind::Proof, body(&good), &mut Vec::new()),
            Err(AuthFailure::UnexpectedFrame(Kind::Proof))
        );
    }

    #[test]
    fn a_token_client_insists_on_a_proof() {
        // A server that offers no proof (as for a user without a password) does not fool a
        // token client into sending its batches.
        let client = ClientHandshake::new(TOKEN, None, [1; NONCE_BYTES]);
        let mut challenge = Vec::new();
        wire::encode_challenge(
            &mut challenge,
            &wire::Challenge { server_nonce: [2; NONCE_BYTES], server_proofs: vec![] },
        );
        assert_eq!(client.on_challenge(body(&challenge), &mut Vec::new()), Err(AuthFailure::BadProof));
    }

    #[test]
    fn frames_out_of_order_are_refused() {
        let server_token = token(TOKEN);
        let mut server = ServerHandshake::new(&server_token, [2; NONCE_BYTES]);
        assert_eq!(server.on_frame(Kind::Batch, &[], &mut Vec::new()), Err(AuthFailure::UnexpectedFrame(Kind::Batch)));
        let mut server = ServerHandshake::new(&server_token, [2; NONCE_BYTES]);
        assert_eq!(
            server.on_frame(Kind::Proof, &[0; 32], &mut Vec::new()),
            Err(AuthFailure::UnexpectedFrame(Kind::Proof))
        );
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn refusals_for_old_peers_use_their_header_version() {
        let frame = AuthFailure::Version(1).refusal().unwrap();
        assert_eq!(frame[4], 1);
        let message = String::from_utf8_lossy(&frame[HEADER_BYTES + 8..]).into_owned();
        assert!(message.contains("version 2") && message.contains("version 1"), "{message}");
        assert_eq!(AuthFailure::Version(9).refusal().unwrap()[4], wire::VERSION);
    }
}
