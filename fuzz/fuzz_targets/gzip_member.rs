//! Fuzzes the gzip side of the ferry index: arbitrary bytes must never panic the member
//! header parser, the indexer or `extract`, and whatever the indexer accepts must be
//! self-consistent (spans inside the blob, every checkpoint restarting to the same bytes
//! the indexer produced). Span digests are checked by the unit tests.
#![no_main]

use std::io::Read;

use ferry_index::ferryidx::Checkpoint;
use ferry_index::zran::{GzipIndexer, HeaderParse, extract, parse_member_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_member_header(data) {
        Ok(HeaderParse::Complete(len)) => assert!(len >= 10 && len <= data.len()),
        Ok(HeaderParse::Incomplete) | Err(_) => {}
    }

    // Raw deflate from a default checkpoint.
    let mut out = [0u8; 512];
    let _ = extract(
        &Checkpoint::default(),
        data,
        (data.len() % 7) as u64,
        &mut out,
    );

    // Index with a small span, reading in odd-sized pieces.
    let span = 1 + (data.len() as u64 % 3000);
    let mut ix = GzipIndexer::new(data, span);
    let mut produced = Vec::new();
    let mut buf = vec![0u8; 1 + data.len() % 70_000];
    let ok = loop {
        match ix.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => produced.extend_from_slice(&buf[..n]),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
                break false;
            }
        }
    };
    let res = ix.finish();
    assert_eq!(ok, res.is_ok());
    let Ok(idx) = res else { return };

    assert_eq!(idx.uncompressed_size, produced.len() as u64);
    assert_eq!(idx.compressed_size, data.len() as u64);
    assert_eq!(idx.checkpoints.len(), idx.span_digests.len());
    for (i, cp) in idx.checkpoints.iter().enumerate() {
        let start = cp.start_byte() as usize;
        let (end, out_end) = match idx.checkpoints.get(i + 1) {
            Some(n) => (n.in_offset as usize, n.out_offset),
            None => (data.len(), idx.uncompressed_size),
        };
        assert!(start <= end && end <= data.len());
        let mut span_out = vec![0u8; (out_end - cp.out_offset) as usize];
        extract(cp, &data[start..end], 0, &mut span_out)
            .expect("a checkpoint of an accepted blob restarts");
        assert!(span_out[..] == produced[cp.out_offset as usize..out_end as usize]);
    }
});
