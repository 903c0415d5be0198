//! Fuzzes the SOCI zTOC reader: arbitrary bytes must parse or fail cleanly, never panic
//! or allocate what a header claims. The same bytes are also tried as a gzip zinfo
//! (checkpoints) blob, so its length and count checks are reached without a flatbuffer
//! around them.
//!
//! Asserted for whatever converts into a ferry index: it passes the index's own
//! validation and round trips through the ferry index encoding when that encodes it; every span has a digest
//! and a non-empty compressed range inside the layer; every file's data lies inside the
//! uncompressed archive.
#![no_main]

use ferry_index::ferryidx::LayerIndex;
use ferry_index::soci::{parse_gzip_zinfo, parse_ztoc};
use libfuzzer_sys::fuzz_target;

const DIGEST: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

fuzz_target!(|data: &[u8]| {
    if let Ok(z) = parse_gzip_zinfo(data) {
        assert!(!z.checkpoints.is_empty());
        assert!(z.checkpoints.iter().all(|c| c.bits <= 7));
    }
    let Ok(ztoc) = parse_ztoc(data) else {
        return;
    };
    let Ok(index) = ztoc.to_layer_index(DIGEST, ztoc.compressed_archive_size) else {
        return;
    };
    index.validate().expect("a converted index is valid");
    assert_eq!(index.span_digests.len(), index.checkpoints.len());
    for i in 0..index.checkpoints.len() {
        let r = index.span_range(i).expect("every checkpoint has a span");
        assert!(r.start < r.end && r.end <= index.compressed_size);
    }
    for e in &index.entries {
        assert!(e.offset.checked_add(e.size).is_some_and(|end| end <= index.uncompressed_size));
    }
    // Encoding may refuse what the ferry format bounds tighter (name lengths); what it
    // writes must read back the same.
    if let Ok(bytes) = index.encode() {
        assert_eq!(LayerIndex::decode(&bytes).expect("an encoded index decodes"), index);
    }
});
