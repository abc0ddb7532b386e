//! Fuzzes the token handshake: the server's side fed arbitrary frames (and a whole
//! connection's bytes through `auth::accept`), and the client's parsing of a Challenge.
//!
//! The first byte picks the mode: raw bytes, or a correct exchange with the rest of the
//! input XORed over it (so mutations of a valid proof get explored). Beyond "no panic": a
//! server authenticates only when the Proof it was fed is the HMAC for the nonces of that
//! exchange, an unmutated exchange authenticates, and the client accepts a Challenge only
//! when its proof is the server's HMAC for its nonces.
#![no_main]

use std::io::{Read, Write};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use racekv_transport::auth::{self, ClientHandshake, ServerHandshake, Token};
use racekv_transport::wire::{self, Kind, HEADER_BYTES, NONCE_BYTES};

const TOKEN: &[u8] = b"fuzz-token";
const CLIENT_NONCE: [u8; NONCE_BYTES] = [0xC1; NONCE_BYTES];
const SERVER_NONCE: [u8; NONCE_BYTES] = [0x5E; NONCE_BYTES];

/// One connection's bytes in, whatever the handshake writes out; EOF after the input.
struct Wire<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}

impl Read for Wire<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        assert!(self.output.len() + buf.len() <= 1 << 16, "the handshake wrote more than it ever should");
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Splits bytes into frames as a reader would see them (a short last frame keeps what is there).
fn frames(mut bytes: &[u8]) -> Vec<(Kind, &[u8])> {
    let mut out = Vec::new();
    while bytes.len() >= HEADER_BYTES {
        let Ok(h) = wire::decode_header(bytes[..HEADER_BYTES].try_into().unwrap()) else { break };
        let end = (HEADER_BYTES + h.body_len as usize).min(bytes.len());
        out.push((h.kind, &bytes[HEADER_BYTES..end]));
        bytes = &bytes[end..];
    }
    out
}

fn xor_over(base: &mut [u8], noise: &[u8]) {
    for (b, n) in base.iter_mut().zip(noise) {
        *b ^= n;
    }
}

/// Feeds frames to a server handshake; true when it authenticated. Checks the verdict.
fn serve(input: &[u8]) -> bool {
    let token = Token(TOKEN.to_vec());
    let mut server = ServerHandshake::new(&token, SERVER_NONCE);
    let mut client_nonce = None;
    for (kind, body) in frames(input) {
        let mut out = Vec::new();
        match server.on_frame(kind, body, &mut out) {
            Ok(None) => {
                let (nonce, user) = wire::decode_hello(body).expect("a Hello the server took decodes");
                client_nonce = Some(nonce);
                let challenge = wire::decode_challenge(&out[HEADER_BYTES..]).expect("the server's Challenge decodes");
                let expected = auth::server_proof(TOKEN, &nonce, &SERVER_NONCE);
                if user.is_none() {
                    assert_eq!(challenge.server_proofs, [expected]);
                } else {
                    assert!(!challenge.server_proofs.contains(&expected), "a user was offered the token's proof");
                }
            }
            Ok(Some(caller)) => {
                assert_eq!(caller.user, None, "a token server authenticated a user");
                let proof = wire::decode_proof(body).expect("a Proof that authenticated decodes");
                let nonce = client_nonce.expect("authenticated without a Hello");
                assert_eq!(proof, auth::client_proof(TOKEN, &nonce, &SERVER_NONCE), "a wrong proof authenticated");
                let mut out = Vec::new();
                assert!(server.on_frame(kind, body, &mut out).is_err(), "a finished handshake took more");
                return true;
            }
            Err(_) => {
                assert!(server.on_frame(kind, body, &mut Vec::new()).is_err(), "a failed handshake went on");
                return false;
            }
        }
    }
    false
}

/// The client's check of a Challenge body; true when it answered with a Proof.
fn check_challenge(body: &[u8]) -> bool {
    let client = ClientHandshake::new(TOKEN, None, CLIENT_NONCE);
    let mut out = Vec::new();
    let accepted = client.on_challenge(body, &mut out).is_ok();
    if accepted {
        let challenge = wire::decode_challenge(body).unwrap();
        let expected = auth::server_proof(TOKEN, &CLIENT_NONCE, &challenge.server_nonce);
        assert!(challenge.server_proofs.contains(&expected), "the client accepted a server that proved nothing");
        let proof = wire::decode_proof(&out[HEADER_BYTES..]).unwrap();
        assert_eq!(proof, auth::client_proof(TOKEN, &CLIENT_NONCE, &challenge.server_nonce));
    } else {
        assert!(out.is_empty(), "the client answered a Challenge it refused");
    }
    accepted
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode % 2 == 0 {
        serve(rest);
        check_challenge(rest);
        // A whole connection through the blocking paths (random nonces: nothing passes).
        let mut stream = Wire { input: rest, output: Vec::new() };
        let verdict = auth::accept(&mut stream, &Token(TOKEN.to_vec()), Duration::from_secs(1));
        assert!(!matches!(verdict, Ok(auth::Accepted::Authenticated(_))));
        let mut stream = Wire { input: rest, output: Vec::new() };
        assert!(auth::connect(&mut stream, "fuzz-token", None, Duration::from_secs(1), "fuzz").is_err());
        return;
    }
    // A correct exchange, mutated.
    let mut exchange = Vec::new();
    wire::encode_hello(&mut exchange, &CLIENT_NONCE, None);
    wire::encode_proof(&mut exchange, &auth::client_proof(TOKEN, &CLIENT_NONCE, &SERVER_NONCE));
    let pristine = exchange.clone();
    xor_over(&mut exchange, rest);
    let authenticated = serve(&exchange);
    if exchange == pristine {
        assert!(authenticated, "the correct proof was refused");
    }
    let mut challenge = Vec::new();
    let server_proof = auth::server_proof(TOKEN, &CLIENT_NONCE, &SERVER_NONCE);
    wire::encode_challenge(&mut challenge, &wire::Challenge { server_nonce: SERVER_NONCE, server_proofs: vec![server_proof] });
    let mut body = challenge[HEADER_BYTES..].to_vec();
    xor_over(&mut body, rest);
    let accepted = check_challenge(&body);
    if body == challenge[HEADER_BYTES..] {
        assert!(accepted, "the client refused a correct Challenge");
    }
});
