//! Fuzzes the ferry index decoder, every version: arbitrary bytes must decode or fail
//! cleanly, never panic or allocate what a count claims. Inputs whose trailer checksum is
//! wrong are re-signed half of the time (as version 1, 2 or 3, by the first byte) so the
//! structural checks behind it, and version 3's library records, are reached.
//!
//! Asserted for whatever decodes: decode → encode → decode gives the same index; the
//! window references of a version-2 index lie back to back and fill its windows blob;
//! splitting a version-1 index's windows out gives a version-2 index that round trips and
//! a windows blob whose pieces hash to their references.
#![no_main]

use ferry_index::ferryidx::LayerIndex;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest as _, Sha256};

fn check(index: &LayerIndex) {
    let again = index.encode().expect("a decoded index encodes");
    assert_eq!(
        LayerIndex::decode(&again).expect("re-encoded index decodes"),
        *index
    );
    let mut end = 0u64;
    for cp in &index.checkpoints {
        if let Some(w) = &cp.window {
            assert_eq!(w.offset, end, "windows back to back");
            assert!(w.len > 0);
            end += u64::from(w.len);
        }
    }
    assert_eq!(end, index.windows.as_ref().map_or(0, |w| w.size));
    if index.windows.is_none() {
        let mut split = index.clone();
        let blob = split.split_windows();
        assert_eq!(
            blob.len() as u64,
            split.windows.as_ref().map_or(0, |w| w.size)
        );
        for cp in &split.checkpoints {
            assert!(cp.window_deflate.is_empty());
            if let Some(w) = &cp.window {
                let piece = &blob[w.offset as usize..(w.offset + u64::from(w.len)) as usize];
                assert_eq!(<[u8; 32]>::from(Sha256::digest(piece)), w.sha256);
            }
        }
        let bytes = split.encode().expect("a split index encodes");
        assert_eq!(
            LayerIndex::decode(&bytes).expect("split index decodes"),
            split
        );
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = LayerIndex::decode(data) {
        check(&index);
    }
    if data.len() > 152 && data[0] & 1 == 1 {
        let mut body = data.to_vec();
        body[..8].copy_from_slice(b"FERRYIDX");
        body[8] = 1 + (data[0] >> 1) % 3;
        body[9] = 0;
        let n = body.len();
        let sum = ferry_index::ferryidx::checksum(&body[..n - 32]);
        body[n - 32..].copy_from_slice(&sum);
        if let Ok(index) = LayerIndex::decode(&body) {
            check(&index);
        }
    }
});
