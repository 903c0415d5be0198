//! Fuzzes the zstd:chunked reader (and, through round trips, the writer).
//!
//! The first input byte picks a mode:
//!
//! * `0`: the rest is a whole blob. Its footer locates the TOC and the TOC's own hash is
//!   given as the checksum, so the fuzzer reaches the TOC parser and the reads:
//!   `open_zstd_chunked`, `ranges_for` and `read_at` of the first entries must never
//!   panic, and what they return must be consistent (ranges before the TOC, reads clamped
//!   exactly at the end of the file).
//! * `1`: the rest is `[n: u16 LE][n bytes of file data][TOC JSON]`; the data becomes up
//!   to four zstd frames and the JSON a compressed TOC in a skippable frame plus footer,
//!   so the fuzzer works on the TOC checks (offsets, end offsets, chunks, digests)
//!   directly.
//! * `2`: the rest is a tar stream; when the strict tar walker accepts it, it is converted
//!   to zstd:chunked and read back, and every file must read back as its tar bytes.
#![no_main]

use std::io::Cursor;

use ferry_index::estargz::EstargzLayer;
use ferry_index::estargz::zstd_chunked::{
    self, ManifestPosition, SKIPPABLE_MAGIC, ZstdChunkedOptions, footer_bytes, parse_footer,
};
use ferry_index::source::{MemSource, RangeSource};
use ferry_index::tarwalk::TarWalker;
use ferry_index::{Entry, EntryKind};
use libfuzzer_sys::fuzz_target;

#[path = "common/toc_reads.rs"]
mod toc_reads;
use sha2::{Digest, Sha256};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            check_blob(rest);
        }
        1 => {
            if let Some(blob) = wrap_toc(rest) {
                check_blob(&blob);
            }
        }
        _ => round_trip(rest, mode),
    }
});

fn sha256(b: &[u8]) -> String {
    let d = Sha256::digest(b);
    let hex: String = d.iter().map(|x| format!("{x:02x}")).collect();
    format!("sha256:{hex}")
}

/// Opens `blob` with the checksum of the TOC its footer points at, and exercises every
/// read path on its first entries.
fn check_blob(blob: &[u8]) -> Option<EstargzLayer> {
    let pos = parse_footer(&blob[blob.len().saturating_sub(72)..]).ok()?;
    let end = pos.offset.checked_add(pos.length)?;
    let toc = blob.get(usize::try_from(pos.offset).ok()?..usize::try_from(end).ok()?)?;
    let checksum = sha256(toc);
    let source = MemSource(blob.to_vec());
    // The annotation's way (position given) and the footer's must agree.
    let by_footer = EstargzLayer::open_zstd_chunked(&source, &checksum, None);
    let by_position = EstargzLayer::open_zstd_chunked(&source, &checksum, Some(&pos.text()));
    assert_eq!(by_footer.is_ok(), by_position.is_ok());
    let layer = by_footer.ok()?;
    assert!(layer.toc_offset() < blob.len() as u64);
    toc_reads::exercise_reads(&layer, &source);
    Some(layer)
}

/// Mode 1: data frames + a TOC made from the fuzzer's JSON + the footer.
fn wrap_toc(rest: &[u8]) -> Option<Vec<u8>> {
    let (n, rest) = rest.split_first_chunk::<2>()?;
    let n = usize::from(u16::from_le_bytes(*n)).min(rest.len());
    let (payload, json) = rest.split_at(n);
    let mut blob = Vec::new();
    let parts = 1 + payload.len() / 512;
    for piece in payload.chunks(payload.len().div_ceil(parts.min(4)).max(1)) {
        blob.extend_from_slice(&zstd::bulk::compress(piece, 1).ok()?);
    }
    let toc = zstd::bulk::compress(json, 1).ok()?;
    blob.extend_from_slice(&SKIPPABLE_MAGIC.to_le_bytes());
    blob.extend_from_slice(&(toc.len() as u32).to_le_bytes());
    let pos = ManifestPosition {
        offset: blob.len() as u64,
        length: toc.len() as u64,
        uncompressed: json.len() as u64,
    };
    blob.extend_from_slice(&toc);
    blob.extend_from_slice(&footer_bytes(&pos));
    Some(blob)
}

/// Mode 2: tar -> zstd:chunked -> read back.
fn round_trip(tar: &[u8], mode: u8) {
    // Only tars the walker accepts whole.
    let mut expected: Vec<(Entry, Vec<u8>)> = Vec::new();
    let mut w = TarWalker::new(tar);
    loop {
        match w.next_entry() {
            Ok(Some(e)) => {
                let mut d = Vec::new();
                if std::io::Read::read_to_end(&mut w, &mut d).is_err() {
                    return;
                }
                expected.push((e, d));
            }
            Ok(None) => break,
            Err(_) => return,
        }
    }
    let opts = ZstdChunkedOptions {
        chunk_size: [1, 7, 512, 4096][usize::from(mode >> 2) % 4],
        level: 1 + i32::from(mode >> 4) % 5,
    };
    let mut blob = Vec::new();
    let out = zstd_chunked::convert(&mut Cursor::new(tar), &mut blob, &opts)
        .expect("convert rejected a tar the walker accepts");
    let layer = check_blob(&blob).expect("cannot open a converted blob");
    assert_eq!(layer.toc_digest(), out.manifest_checksum);
    let source = MemSource(blob);
    assert_eq!(source.len(), out.size);
    assert_eq!(layer.entries().len(), expected.len());
    for (idx, (got, (want, data))) in layer.entries().iter().zip(&expected).enumerate() {
        assert_eq!(got.path, want.path);
        assert_eq!(got.kind, want.kind);
        if want.kind == EntryKind::File {
            let mut buf = vec![0u8; data.len() + 1];
            let n = layer.read_at(&source, idx, 0, &mut buf).expect("read back");
            assert_eq!(&buf[..n], &data[..]);
        }
    }
}
