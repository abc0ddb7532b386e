//! Fuzzes the frame decoders the region server and clients apply to network bytes.
//!
//! The input is a header followed by a body. Beyond "no panic, no huge allocation": a batch
//! body that decodes re-encodes to a frame that decodes to the same ops, and a batch result
//! decodes only against a batch of the matching shape.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_transport::wire::{self, Kind, HEADER_BYTES};
use racekv_transport::Batch;

fuzz_target!(|data: &[u8]| {
    if data.len() >= HEADER_BYTES {
        let header: &[u8; HEADER_BYTES] = data[..HEADER_BYTES].try_into().unwrap();
        if let Ok(h) = wire::decode_header(header) {
            assert!(h.body_len as usize <= wire::MAX_BODY_BYTES);
            let _ = matches!(h.kind, Kind::Batch);
        }
    }
    let body = data.get(HEADER_BYTES.min(data.len())..).unwrap_or_default();
    for bytes in [data, body] {
        let mut batch = Batch::new();
        if wire::decode_batch(bytes, &mut batch).is_ok() {
            assert!(!batch.is_empty() && batch.len() <= racekv_transport::MAX_BATCH_OPS);
            let mut frame = Vec::new();
            wire::encode_batch(&mut frame, 7, &batch);
            let mut again = Batch::new();
            wire::decode_batch(&frame[HEADER_BYTES..], &mut again).unwrap();
            assert_eq!(again.len(), batch.len());
            for (a, b) in batch.ops().iter().zip(again.ops()) {
                assert_eq!((a.kind, a.offset, a.len, a.arg0, a.arg1), (b.kind, b.offset, b.len, b.arg0, b.arg1));
            }
            for i in 0..batch.len() {
                if batch.ops()[i].kind == racekv_transport::OpKind::Write {
                    assert_eq!(batch.write_payload(i), again.write_payload(i));
                }
            }
        }
        let mut sent = Batch::new();
        sent.read(0, 16);
        sent.cas(8, 1, 2);
        sent.write(64, b"abc");
        let _ = wire::decode_batch_result(bytes, &mut sent, 1 << 20);
        let _ = wire::decode_hello(bytes);
        let _ = wire::decode_challenge(bytes);
        let _ = wire::decode_proof(bytes);
        let _ = wire::decode_hello_ok(bytes);
        let _ = wire::decode_rpc_request(bytes);
        let _ = wire::decode_rpc_response(bytes);
        let _ = wire::decode_error(bytes);
    }
});
