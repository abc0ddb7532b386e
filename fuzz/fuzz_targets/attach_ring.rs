//! Fuzzes what the computenode's attach front end reads from an attached client: the shared
//! area (every word of which the client controls) and the handshake bytes.
//!
//! Ring mode (first byte even): the input picks a small geometry, then is a script of steps
//! a hostile client and the daemon interleave: arbitrary word writes anywhere in the area,
//! arbitrary request bytes into slots (published or not), submissions of any slot index,
//! the daemon taking requests and completing them with replies of any size. Checked, beyond
//! "no panic, no hang, no huge allocation": a request the daemon takes is at most a slot's
//! payload and re-encodes to exactly as many bytes; after the daemon reports a protocol
//! error, the script stops (the server detaches the client); a reply the client reads back
//! through the ring is what the daemon wrote, or says it was too large.
//!
//! Handshake mode (first byte odd): the rest is a hello and a daemon frame as decoded from a
//! socket; what decodes re-encodes to the same bytes. The frame's body is also read as a
//! LENT body with as many descriptors as its first byte says (0-15, /dev/null ones): it
//! decodes or fails, and never takes descriptors it was not given.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use racekv_client::attach::area::status;
use racekv_client::attach::{ClientRing, DaemonRing, Frame, Geometry, Hello, Submission};
use racekv_client::op::Reply;
use racekv_transport::Region;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u64(&mut self) -> Option<u64> {
        let bytes = self.0.get(..8)?;
        self.0 = &self.0[8..];
        Some(u64::from_le_bytes(bytes.try_into().unwrap()))
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
}

fn handshake(data: &[u8]) {
    // The fixed part, then as many credential bytes as it announces (bounded by the decoder).
    let head = &data[..data.len().min(32)];
    let hello_len = Hello::credentials_len(head).map_or(head.len(), |n| (32 + n).min(data.len()));
    let (hello, frame) = data.split_at(hello_len);
    if let Ok(h) = Hello::decode(hello) {
        assert_eq!(&h.encode()[..], hello);
    }
    if let Some((&count, body)) = frame.split_first() {
        let fds: Vec<std::os::fd::OwnedFd> =
            (0..count % 16).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
        let _ = racekv_client::attach::lending::LentMemnode::decode(body, fds);
    }
    if let Ok(f) = Frame::decode(frame) {
        let again = f.encode();
        assert_eq!(Frame::decode(&again).unwrap(), f);
        if let Frame::Accepted(_) = f {
            assert_eq!(again, frame);
        }
    }
}

fn ring(mut input: Input<'_>) -> Option<()> {
    let slots = u32::from(input.byte()? % 8) + 1;
    let slot_bytes = 64 + 8 * u32::from(input.byte()? % 64);
    let geometry = Geometry::new(slots, slot_bytes).unwrap();
    let region = Arc::new(Region::anonymous(geometry.area_len()).unwrap());
    let mut daemon = DaemonRing::over(Arc::clone(&region), geometry).unwrap();
    let completer = daemon.completer();
    let client = ClientRing::over(Arc::clone(&region), geometry).unwrap();
    let payload = geometry.payload_bytes();
    let mut taken: Vec<Submission> = Vec::new();
    let mut written: Vec<Option<Vec<u8>>> = vec![None; slots as usize];
    let mut scratch = Vec::new();
    for _ in 0..256 {
        match input.byte()? % 6 {
            0 => {
                // A hostile word anywhere.
                let offset = (input.u64()? % (geometry.area_len() / 8)) * 8;
                region.store_u64(offset, input.u64()?).unwrap();
            }
            1 => {
                // Request bytes into a slot, published or not.
                let slot = u32::from(input.byte()?) % slots;
                let len = usize::from(input.byte()?).min(payload);
                let publish = input.byte()? & 1 == 1;
                let bytes = input.bytes(len).to_vec();
                client.write_request(slot, u64::from(slot), 0, &bytes);
                if publish {
                    client.submit(slot);
                }
            }
            2 => {
                // A submission of any slot index (even one out of range).
                let offset = geometry.sq_entry(region.load_u64(0x80).unwrap());
                region.store_u64(offset, u64::from(input.byte()?)).unwrap();
                region.store_u64(0x80, region.load_u64(0x80).unwrap().wrapping_add(1)).unwrap();
            }
            3 => match daemon.take() {
                Ok(Some(sub)) => {
                    assert!(sub.bytes <= payload);
                    let mut again = Vec::new();
                    sub.request.encode(&mut again);
                    assert_eq!(again.len(), sub.bytes, "decoding is canonical");
                    taken.push(sub);
                }
                Ok(None) => {}
                Err(e) => {
                    assert!(!e.reason().is_empty());
                    return Some(());
                }
            },
            4 => {
                // Complete one taken request with a reply of any size.
                if taken.is_empty() {
                    continue;
                }
                let sub = taken.remove(usize::from(input.byte()?) % taken.len());
                let reply = Reply::Value(Some(vec![0x5A; usize::from(input.byte()?) * 4]));
                let mut bytes = Vec::new();
                reply.encode(&mut bytes);
                match completer.complete(sub.slot, sub.request_id, &bytes) {
                    Ok(_) => written[sub.slot as usize] = Some(bytes),
                    Err(e) => {
                        assert_eq!(e.reason(), "completion_overrun");
                        return Some(());
                    }
                }
            }
            _ => {
                // The client reads a slot's reply back (what the daemon wrote last, unless
                // the client scribbled over it since: then only "no panic").
                let slot = u32::from(input.byte()?) % slots;
                if let (Ok(reply), Some(bytes)) = (client.read_reply(slot, &mut scratch), &written[slot as usize]) {
                    if reply.status == status::REPLY && reply.len == bytes.len() && scratch == *bytes {
                        assert!(bytes.len() <= payload);
                    }
                    if reply.status == status::REPLY_TOO_LARGE && reply.len == bytes.len() {
                        assert!(scratch.is_empty());
                    }
                }
            }
        }
    }
    Some(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 1 == 1 {
        handshake(rest);
    } else {
        let _ = ring(Input(rest));
    }
});
