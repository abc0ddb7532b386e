//! Fuzzes the FLOCK message decoder (every byte of a coalesced message comes from the peer)
//! and the lane handshake frames.
//!
//! Beyond "no panic": a message that decodes is canonical (re-encoding its header and
//! entries gives back exactly the input), its entries' sizes add up to its data, and it
//! decodes only with the canary it carries.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_transport::flock::message::{self, Builder, Header, MAX_MESSAGE_BYTES};
use racekv_transport::wire;

fuzz_target!(|data: &[u8]| {
    let expect = data.get(..4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    for guess in [None, expect, Some(message::canary(1, 0))] {
        let Ok(m) = message::decode(data, guess, MAX_MESSAGE_BYTES) else { continue };
        assert!(m.count() <= message::MAX_ENTRIES);
        let mut b = Builder::default();
        let mut total = 0usize;
        for (entry, payload) in m.entries() {
            assert_eq!(entry.size as usize, payload.len());
            total += payload.len();
            b.push(entry, payload);
        }
        assert_eq!(message::message_len(m.count(), total), data.len());
        let again = b.finish(Header { len: 0, count: 0, ..m.header });
        assert_eq!(again, data, "a decoded message re-encodes to other bytes");
        let wrong = m.header.canary ^ 0x8000_0000;
        assert!(message::decode(data, Some(wrong), MAX_MESSAGE_BYTES).is_err());
    }
    if let Ok(h) = message::decode_header(data, None, MAX_MESSAGE_BYTES) {
        assert!(h.len as usize <= MAX_MESSAGE_BYTES && h.len % 8 == 0);
    }
    let _ = wire::decode_flock_open(data);
    let _ = wire::decode_flock_accept(data);
});
