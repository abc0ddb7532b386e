//! Fuzzes what the table reads back from a region or receives by RPC: KV blocks, the
//! superblock layout, slot and directory words, and the memnode's RPC messages.
//!
//! Beyond "no panic": a block that decodes has lengths inside the bytes read and (when it
//! fits a block) re-encodes to the same bytes; a layout that decodes passes its own
//! consistency check and re-encodes to the same bytes; a block's head agrees with it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use racekv_hashing::layout::{
    block_units_for, decode_block, encode_any_block, peek_block_head, BucketHeader, DirEntry, Layout, Slot, MAX_GLOBAL_DEPTH_LIMIT, MAX_VALUE_BYTES,
};
use racekv_hashing::rpc::{
    decode_chunk, decode_chunk_request, decode_fragments_request, decode_ranges, decode_words, encode_chunk, encode_ranges, encode_words,
    Metadata, SplitRequest,
};

fuzz_target!(|data: &[u8]| {
    if let Some(block) = decode_block(data) {
        // A long key's block holds its descriptor in place of the key; any other, the key.
        assert!(!block.key.is_empty() || block.long_key.is_some());
        let header = 16 + block.access.map_or(0, |_| 8) + block.expires_at_ms.map_or(0, |_| 8);
        let (key_len, inline) = (block.inline_key_len(), block.inline_value_len());
        assert!(header + key_len + inline <= data.len());
        // An indirect block's descriptor stays within the format's limits.
        if let Some(extent) = block.extent {
            assert!(block.value.is_empty() && extent.value_len <= MAX_VALUE_BYTES && extent.offset % 64 == 0);
        }
        // An intent's mark names a 64 B aligned record past the superblock, or is a
        // replicated write's.
        if let Some((_, offset)) = block.txn.and_then(|mark| mark.record()) {
            assert!(offset % 64 == 0 && offset != 0);
        }
        // It re-encodes to the same bytes (up to the padding and the access word's reserved
        // byte, which decoding ignores), if it is a block this build writes (one with an
        // access word) small enough to be a block at all (the bytes read may be longer).
        if let (Some(access), Some(_)) = (block.access, block_units_for(key_len, inline, block.expires_at_ms.is_some())) {
            let mut again = Vec::new();
            encode_any_block(
                &mut again,
                block.key,
                block.value,
                block.extent.as_ref(),
                block.long_key.as_ref(),
                block.expires_at_ms,
                block.txn.as_ref(),
                access,
            );
            let used = header + key_len + inline;
            let mut read = data[..used].to_vec();
            read[16 + 7] = 0;
            assert_eq!(&again[..used], &read[..]);
        }
    }
    // A head (read short of the value) claims only the key bytes it reached, and agrees with
    // the whole block wherever both decode.
    if let Some(head) = peek_block_head(data) {
        assert!(head.key.is_none_or(|key| key.len() == head.key_len && key.len() < data.len()));
        if let Some(block) = decode_block(data).filter(|b| b.extent.is_none()) {
            assert_eq!(head.key, Some(block.key));
            assert_eq!((head.expires_at_ms, head.txn, head.access), (block.expires_at_ms, block.txn, block.access));
            assert_eq!(Some(head.units), block.units());
        }
    }
    if let Ok(layout) = Layout::decode(data) {
        layout.check().unwrap();
        assert_eq!(&layout.encode()[..], &data[..64]);
    }
    for word in data.chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())) {
        if let Some(slot) = Slot::decode(word) {
            assert!(slot.units >= 1 && slot.block % 64 == 0);
        }
        // Any word decodes; only depths a table can have are encodable (and `is_valid`
        // rejects the others before a client acts on them).
        let entry = DirEntry::decode(word);
        if entry.local_depth <= MAX_GLOBAL_DEPTH_LIMIT {
            assert_eq!(DirEntry::decode(entry.encode()), entry);
        }
        let _ = BucketHeader::decode(word).admits(word.rotate_left(17));
    }
    if let Ok(req) = SplitRequest::decode(data) {
        assert_eq!(&req.encode()[..], data);
    }
    if let Ok((instance, ranges)) = decode_ranges(data) {
        assert_eq!(encode_ranges(instance, &ranges), data);
    }
    if let Ok(chunk) = decode_chunk(data) {
        assert_eq!(encode_chunk(&chunk), data);
    }
    let _ = decode_chunk_request(data);
    if let Ok(words) = decode_words::<3>(data) {
        assert_eq!(encode_words(&words), data);
    }
    if let Ok(most) = decode_fragments_request(data) {
        assert_eq!(&most.to_le_bytes()[..], data);
    }
    let _ = Metadata::decode(data);
});
