//! Fuzzes the decoders of the client library's requests and replies (`racekv_client::op`),
//! which the computenode applies to bytes from attached processes' rings and from remote
//! clients' RPCs, transfers in parts included. Beyond "no panic, no huge allocation": what
//! decodes re-encodes to something that decodes to the same request or reply (error
//! replies aside: their message is cut to a bound when encoded).
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_client::op::{Reply, Request};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = Request::decode(data) {
        let mut again = Vec::new();
        request.encode(&mut again);
        assert_eq!(Request::decode(&again).unwrap(), request);
    }
    if let Ok(reply) = Reply::decode(data).map_err(drop).and_then(|r| match r {
        Reply::Error(..) => Err(()),
        other => Ok(other),
    }) {
        let mut again = Vec::new();
        reply.encode(&mut again);
        assert_eq!(Reply::decode(&again).unwrap(), reply);
    }
});
