//! Fuzzes several ranges in one request, both ends: the client's parser of a
//! `multipart/byteranges` answer (a registry's, a mirror's or a stranger's bytes) and
//! the server's parser of a `Range` header asking for several ranges. The client must
//! never panic or return bytes outside the answer, and the parts it slices must be the
//! bytes the answer's parts carry at the offsets their `Content-Range`s name; the
//! server's ranges must be 2 to MAX_RANGES, non-empty, in order, apart and inside the
//! blob, and a body it would write must read back exactly.
#![no_main]

use ferry_registry_client::byteranges::{
    MAX_RANGES, body_len, boundary, parse, parse_ranges, part_head, slices, tail,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First line: the content type's boundary; the rest: the answer's body.
    let (head, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let head = String::from_utf8_lossy(head);
    let content_type = format!("multipart/byteranges; boundary={head}");
    let b = boundary(&content_type).unwrap_or("B");
    if let Ok(parts) = parse(body, b) {
        assert!(parts.len() <= MAX_RANGES);
        for p in &parts {
            assert!(p.body.start <= p.body.end && p.body.end <= body.len());
        }
        // Ask for each part's first half: exactly those bytes come back.
        let asked: Vec<_> = parts
            .iter()
            .map(|p| p.start..p.start + ((p.body.end - p.body.start) / 2) as u64)
            .collect();
        if let Ok(got) = slices(&asked, &parts, body) {
            for (a, g) in asked.iter().zip(got) {
                assert_eq!(g.len() as u64, a.end - a.start);
            }
        }
    }

    // The server side: the input as a Range header over a blob of a size it names.
    let size = u64::from(data.first().copied().unwrap_or(0)) * 97 + 1;
    let text = String::from_utf8_lossy(data);
    if let Some(ranges) = parse_ranges(Some(&text), size) {
        assert!((2..=MAX_RANGES).contains(&ranges.len()), "{text:?}");
        for (i, r) in ranges.iter().enumerate() {
            assert!(r.start < r.end && r.end <= size, "{text:?}");
            assert!(i == 0 || ranges[i - 1].end < r.start, "{text:?}");
        }
        let blob: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let mut out = Vec::new();
        for r in &ranges {
            out.extend_from_slice(part_head("zz", r, size).as_bytes());
            out.extend_from_slice(&blob[r.start as usize..r.end as usize]);
        }
        out.extend_from_slice(tail("zz").as_bytes());
        assert_eq!(out.len() as u64, body_len("zz", &ranges, size));
        let parts = parse(&out, "zz").expect("a body the server writes parses");
        let got = slices(&ranges, &parts, &out).expect("every range is in it");
        for (r, g) in ranges.iter().zip(got) {
            assert_eq!(g, &blob[r.start as usize..r.end as usize]);
        }
    }
});
