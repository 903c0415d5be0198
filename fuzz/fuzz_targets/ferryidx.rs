//! Fuzzes the ferry index decoder: arbitrary bytes must decode or fail cleanly, never
//! panic or allocate what a count claims. Inputs whose trailer checksum is wrong are
//! re-signed half of the time so the structural checks behind it are reached.
#![no_main]

use ferry_index::ferryidx::LayerIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = LayerIndex::decode(data);
    if data.len() > 112 && data[0] & 1 == 1 {
        let mut body = data.to_vec();
        body[..8].copy_from_slice(b"FERRYIDX");
        body[8] = 1;
        body[9] = 0;
        let n = body.len();
        let sum = ferry_index::ferryidx::checksum(&body[..n - 32]);
        body[n - 32..].copy_from_slice(&sum);
        if let Ok(index) = LayerIndex::decode(&body) {
            // Whatever decodes must encode again to something that decodes the same.
            let again = index.encode().expect("a decoded index encodes");
            assert_eq!(LayerIndex::decode(&again).expect("re-encoded index decodes"), index);
        }
    }
});
