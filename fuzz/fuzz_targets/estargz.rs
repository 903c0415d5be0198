//! Fuzzes the eStargz reader (and, through round trips, the writer).
//!
//! The first input byte picks a mode:
//!
//! * `0`: the rest is a whole blob: footer parsing, `EstargzLayer::open`, `ranges_for`
//!   and `read_at` of the first entries must never panic, and what they return must be
//!   consistent (ranges inside the blob, reads clamped exactly at the end of the file).
//! * `1`: the rest is `[n: u16 LE][n bytes of file data][TOC JSON]`; the data becomes up
//!   to four stored gzip members and the JSON a well-formed TOC member plus footer, so the
//!   fuzzer works on the TOC checks (offsets, chunks, inner offsets, digests) directly.
//! * `2`: the rest is a tar stream; when the strict tar walker accepts it, it is converted
//!   to eStargz and read back, and every file must read back as its tar bytes.
#![no_main]

use std::io::{Cursor, Read};

use ferry_index::estargz::{EstargzLayer, EstargzOptions, convert, footer_bytes, parse_footer};
use ferry_index::source::{MemSource, RangeSource};
use ferry_index::tarwalk::TarWalker;
use ferry_index::{Entry, EntryKind};
use libfuzzer_sys::fuzz_target;

#[path = "common/toc_reads.rs"]
mod toc_reads;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            check_blob(rest, None);
        }
        1 => {
            if let Some(blob) = wrap_toc(rest) {
                check_blob(&blob, None);
            }
        }
        _ => round_trip(rest, mode),
    }
});

/// Opens `blob` and exercises every read path on its first entries.
fn check_blob(blob: &[u8], toc_digest: Option<&str>) -> Option<EstargzLayer> {
    let tail = &blob[blob.len().saturating_sub(51)..];
    let footer = parse_footer(tail);
    let source = MemSource(blob.to_vec());
    let layer = EstargzLayer::open(&source, toc_digest).ok()?;
    let off = footer.ok()?;
    assert_eq!(layer.toc_offset(), off);
    assert!(layer.toc_offset() < blob.len() as u64);
    toc_reads::exercise_reads(&layer, &source);
    Some(layer)
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A gzip member holding `data` in stored deflate blocks.
fn stored_gzip(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let mut blocks: Vec<&[u8]> = data.chunks(65_535).collect();
    if blocks.is_empty() {
        blocks.push(&[]);
    }
    let last = blocks.len() - 1;
    for (i, b) in blocks.iter().enumerate() {
        out.push(u8::from(i == last));
        let len = b.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(b);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

fn octal(field: &mut [u8], v: u64) {
    let n = field.len() - 1;
    let s = format!("{v:0n$o}");
    field[..n].copy_from_slice(&s.as_bytes()[s.len() - n..]);
}

/// A ustar header for a regular file.
fn ustar(name: &str, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], 0o644);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0);
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    octal(&mut h[148..155], sum);
    h[155] = 0;
    h
}

/// Mode 1: data members + a TOC member made from the fuzzer's JSON + the footer.
fn wrap_toc(rest: &[u8]) -> Option<Vec<u8>> {
    let (n, rest) = rest.split_first_chunk::<2>()?;
    let n = usize::from(u16::from_le_bytes(*n)).min(rest.len());
    let (payload, json) = rest.split_at(n);
    let mut blob = Vec::new();
    let parts = 1 + payload.len() / 512;
    for piece in payload.chunks(payload.len().div_ceil(parts.min(4)).max(1)) {
        blob.extend_from_slice(&stored_gzip(piece));
    }
    let toc_offset = blob.len() as u64;
    let mut toc = ustar("stargz.index.json", json.len() as u64).to_vec();
    toc.extend_from_slice(json);
    toc.resize(toc.len().div_ceil(512) * 512 + 1024, 0);
    blob.extend_from_slice(&stored_gzip(&toc));
    blob.extend_from_slice(&footer_bytes(toc_offset));
    Some(blob)
}

/// Mode 2: tar -> eStargz -> read back.
fn round_trip(tar: &[u8], mode: u8) {
    // Only tars the walker accepts whole.
    let mut expected: Vec<(Entry, Vec<u8>)> = Vec::new();
    let mut w = TarWalker::new(tar);
    loop {
        match w.next_entry() {
            Ok(Some(e)) => {
                let mut d = Vec::new();
                if w.read_to_end(&mut d).is_err() {
                    return;
                }
                expected.push((e, d));
            }
            Ok(None) => break,
            Err(_) => return,
        }
    }
    let opts = EstargzOptions {
        chunk_size: [1, 7, 512, 4096][usize::from(mode >> 2) % 4],
        level: u32::from(mode >> 4) % 13,
        priority: Vec::new(),
    };
    let mut open = || Ok(Box::new(Cursor::new(tar.to_vec())) as Box<dyn Read + Send>);
    let mut blob = Vec::new();
    let out =
        convert(&mut open, &mut blob, &opts).expect("convert rejected a tar the walker accepts");
    let layer = check_blob(&blob, Some(&out.toc_digest)).expect("cannot open a converted blob");
    let source = MemSource(blob);
    assert_eq!(source.len(), out.size);
    let kept: Vec<&(Entry, Vec<u8>)> = expected
        .iter()
        .filter(|(e, _)| {
            !matches!(
                e.path.as_str(),
                "stargz.index.json" | ".prefetch.landmark" | ".no.prefetch.landmark"
            )
        })
        .collect();
    assert_eq!(layer.entries().len(), kept.len());
    for (idx, (got, (want, data))) in layer.entries().iter().zip(kept).enumerate() {
        assert_eq!(got.path, want.path);
        assert_eq!(got.kind, want.kind);
        if want.kind == EntryKind::File {
            let mut buf = vec![0u8; data.len() + 1];
            let n = layer.read_at(&source, idx, 0, &mut buf).expect("read back");
            assert_eq!(&buf[..n], &data[..]);
        }
    }
}
