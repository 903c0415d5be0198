#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::Arc;

use flatbuffers::FlatBufferBuilder;
use flate2::write::GzEncoder;
use proptest::prelude::*;

use super::zinfo::{ZINFO_CHECKPOINT_LEN, ZINFO_HEADER_LEN, encode_gzip_zinfo};
use super::*;
use crate::entry::{Entry, EntryKind};
use crate::reader::{LayerFormat, LayerReader};
use crate::source::MemSource;

const SPAN: u64 = 16 << 10;
const DIGEST: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

/// Deterministic bytes that compress a little (so deflate makes many blocks).
fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b"abcdefghijklmnop"[(x % 16) as usize] ^ ((x >> 20) as u8 & 0x40)
        })
        .collect()
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(1000);
    h.set_gid(1001);
    h.set_username("user").unwrap();
    h.set_groupname("group").unwrap();
    h.set_mtime(1_700_000_000);
    h.set_size(size);
    h
}

/// A small layer: a dir, files (one spanning many spans), a symlink, a hard link, a
/// whiteout and a file with an xattr and a sub-second mtime (PAX records).
fn build_tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let empty: &[u8] = &[];
    b.append_data(
        &mut header(tar::EntryType::Directory, 0o755, 0),
        "d/",
        empty,
    )
    .unwrap();
    for (i, len) in [0usize, 1, 511, 512, 4096, 40_000].into_iter().enumerate() {
        let d = data(i as u64, len);
        let mut h = header(tar::EntryType::Regular, 0o644, len as u64);
        b.append_data(&mut h, format!("d/f{i}"), &d[..]).unwrap();
    }
    let big = data(99, 300_000);
    let mut h = header(tar::EntryType::Regular, 0o755, big.len() as u64);
    b.append_data(&mut h, "d/big", &big[..]).unwrap();
    let mut h = header(tar::EntryType::Symlink, 0o777, 0);
    b.append_link(&mut h, "d/link", "big").unwrap();
    let mut h = header(tar::EntryType::Link, 0o755, 0);
    b.append_link(&mut h, "d/hard", "d/big").unwrap();
    b.append_data(
        &mut header(tar::EntryType::Regular, 0, 0),
        "d/.wh.gone",
        empty,
    )
    .unwrap();
    let mut pax = Vec::new();
    for (k, v) in [("SCHILY.xattr.user.k", "v1"), ("mtime", "1700000000.25")] {
        let rec = format!(" {k}={v}\n");
        // The length field counts itself.
        let mut len = rec.len() + 1;
        while len.to_string().len() + rec.len() != len {
            len = len.to_string().len() + rec.len();
        }
        let line = format!("{len}{rec}");
        pax.extend_from_slice(line.as_bytes());
    }
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::XHeader);
    h.set_size(pax.len() as u64);
    h.set_path("PaxHeaders/x").unwrap();
    h.set_mode(0o644);
    h.set_cksum();
    b.append(&h, &pax[..]).unwrap();
    let d = data(7, 20_000);
    let mut h = header(tar::EntryType::Regular, 0o600, d.len() as u64);
    b.append_data(&mut h, "d/attr", &d[..]).unwrap();
    b.into_inner().unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn layer_digest(blob: &[u8]) -> String {
    ferry_oci::digest::sha256_digest(blob).to_string()
}

/// Every file read through the crate's reader equals the tar's content; the file table
/// equals the tar walker's.
fn check_reads(blob: &[u8], tar: &[u8]) -> crate::ferryidx::LayerIndex {
    let z = write_ztoc(blob, SPAN, "ferry test").unwrap();
    let ztoc = parse_ztoc(&z).unwrap();
    assert_eq!(ztoc.version, ZTOC_VERSION);
    assert_eq!(ztoc.build_tool_identifier, "ferry test");
    assert_eq!(ztoc.compressed_archive_size, blob.len() as u64);
    let index = ztoc
        .to_layer_index(&layer_digest(blob), blob.len() as u64)
        .unwrap();
    let expected = crate::tarwalk::walk_all(tar);
    let got: Vec<&Entry> = index.entries.iter().collect();
    assert_eq!(got, expected.iter().map(|(e, _)| e).collect::<Vec<_>>());
    let reader = LayerReader::new(
        LayerFormat::Indexed(Arc::new(index.clone())),
        Arc::new(MemSource(blob.to_vec())),
    );
    for (i, (e, d)) in expected.iter().enumerate() {
        if e.kind != EntryKind::File {
            continue;
        }
        let mut buf = vec![0u8; d.len()];
        let n = reader.read_at(i, 0, &mut buf).unwrap();
        assert_eq!(n, d.len(), "{}", e.path);
        assert_eq!(&buf, d, "{}", e.path);
        // A read from the middle starts at a later checkpoint.
        if d.len() > 2 {
            let mid = d.len() / 2;
            let mut part = vec![0u8; d.len() - mid];
            reader.read_at(i, mid as u64, &mut part).unwrap();
            assert_eq!(&part[..], &d[mid..], "{}", e.path);
        }
    }
    index
}

#[test]
fn roundtrip_reads_every_file() {
    let tar = build_tar();
    let blob = gzip(&tar);
    let index = check_reads(&blob, &tar);
    assert!(index.checkpoints.len() > 5, "{}", index.checkpoints.len());
    let ztoc = parse_ztoc(&write_ztoc(&blob, SPAN, "t").unwrap()).unwrap();
    assert_eq!(
        ztoc.compression.max_span_id as usize + 1,
        index.checkpoints.len()
    );
    // SOCI's checkpoint 0 follows the gzip header (10 bytes for flate2's).
    assert_eq!(index.checkpoints[0].in_offset, 10);
    assert!(!index.checkpoints[0].member_start);
    let attr = index.entries.iter().find(|e| e.path == "d/attr").unwrap();
    assert_eq!(
        attr.xattrs.get("user.k").map(Vec::as_slice),
        Some(&b"v1"[..])
    );
    assert_eq!((attr.mtime, attr.mtime_nsec), (1_700_000_000, 250_000_000));
    let hard = index.entries.iter().find(|e| e.path == "d/hard").unwrap();
    assert_eq!(
        (hard.kind, hard.link_target.as_str()),
        (EntryKind::Hardlink, "d/big")
    );
    let pax = &ztoc.entries.iter().find(|e| e.name == "d/attr").unwrap();
    assert_eq!(
        pax.pax_records,
        vec![("SCHILY.xattr.user.k".into(), b"v1".to_vec())]
    );
    assert_eq!(pax.mod_time, "2023-11-14T22:13:20.25Z");
}

#[test]
fn multi_member_layer_reads() {
    let tar = build_tar();
    let cut = tar.len() / 3;
    let mut blob = gzip(&tar[..cut]);
    blob.extend(gzip(&tar[cut..]));
    let index = check_reads(&blob, &tar);
    assert!(index.checkpoints.iter().all(|c| !c.member_start));
}

#[test]
fn corrupted_span_is_refused() {
    let tar = build_tar();
    let mut blob = gzip(&tar);
    let z = write_ztoc(&blob, SPAN, "t").unwrap();
    let index = parse_ztoc(&z)
        .unwrap()
        .to_layer_index(&layer_digest(&blob), blob.len() as u64)
        .unwrap();
    let big = index
        .entries
        .iter()
        .position(|e| e.path == "d/big")
        .unwrap();
    let span = index.span_for(index.entries[big].offset + 1000).unwrap();
    let range = index.span_range(span).unwrap();
    blob[(range.start + range.end) as usize / 2] ^= 0x55;
    let reader = LayerReader::new(
        LayerFormat::Indexed(Arc::new(index)),
        Arc::new(MemSource(blob)),
    );
    let mut buf = vec![0u8; 100];
    let err = reader.read_at(big, 1000, &mut buf).unwrap_err();
    assert!(matches!(err, crate::Error::DigestMismatch { .. }), "{err}");
}

fn valid() -> (Vec<u8>, Vec<u8>) {
    let blob = gzip(&build_tar());
    let z = write_ztoc(&blob, SPAN, "t").unwrap();
    (blob, z)
}

fn soci_message<T>(r: crate::Result<T>) -> String {
    match r {
        Err(crate::Error::Soci(m)) => m,
        Err(other) => panic!("expected a SOCI error, got {other}"),
        Ok(_) => panic!("expected a SOCI error, got a value"),
    }
}

#[test]
fn truncated_buffers_are_refused() {
    let (_, z) = valid();
    // The flatbuffer's tail may be padding, so only cuts into its data must fail.
    for len in [0, 1, 3, 4, 8, 64, z.len() / 2] {
        let m = soci_message(parse_ztoc(&z[..len]));
        assert!(!m.is_empty());
    }
}

#[test]
fn vtable_offset_out_of_bounds() {
    let (_, mut z) = valid();
    let root = u32::from_le_bytes(z[0..4].try_into().unwrap()) as usize;
    z[root..root + 4].copy_from_slice(&(i32::MIN + 7).to_le_bytes());
    let m = soci_message(parse_ztoc(&z));
    assert!(m.contains("not a valid zTOC flatbuffer"), "{m}");
    // A root offset past the end.
    let (_, mut z) = valid();
    let len = z.len() as u32;
    z[0..4].copy_from_slice(&(len + 4).to_le_bytes());
    soci_message(parse_ztoc(&z));
}

/// The position of the checkpoints vector's length field in a zTOC from [`valid`].
fn checkpoints_len_field(z: &[u8]) -> usize {
    let ztoc = parse_ztoc(z).unwrap();
    let head = &ztoc.compression.checkpoints[..ZINFO_HEADER_LEN + 17];
    z.windows(head.len()).position(|w| w == head).unwrap() - 4
}

#[test]
fn vector_longer_than_input() {
    let (_, mut z) = valid();
    let at = checkpoints_len_field(&z);
    z[at..at + 4].copy_from_slice(&(u32::MAX - 3).to_le_bytes());
    let m = soci_message(parse_ztoc(&z));
    assert!(m.contains("not a valid zTOC flatbuffer"), "{m}");
}

fn parsed() -> (Vec<u8>, Ztoc) {
    let (blob, z) = valid();
    (blob, parse_ztoc(&z).unwrap())
}

fn convert(blob: &[u8], z: &Ztoc) -> String {
    soci_message(z.to_layer_index(&layer_digest(blob), blob.len() as u64))
}

fn set_i64(blob: &mut [u8], at: usize, v: i64) {
    blob[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Offset of checkpoint `k`'s record in a version-2 zinfo blob.
fn record(k: usize) -> usize {
    ZINFO_HEADER_LEN + k * ZINFO_CHECKPOINT_LEN
}

#[test]
fn wrong_span_digest_count() {
    let (blob, mut z) = parsed();
    z.compression.span_digests.pop();
    assert!(convert(&blob, &z).contains("span digests for"));
    let (blob, mut z) = parsed();
    z.compression.max_span_id += 1;
    assert!(convert(&blob, &z).contains("max_span_id"));
}

#[test]
fn malformed_span_digest() {
    for bad in ["sha256:00", "md5:0000", &DIGEST.to_uppercase()] {
        let (blob, mut z) = parsed();
        z.compression.span_digests[1] = bad.to_string();
        assert!(convert(&blob, &z).contains("span digest 1"), "{bad}");
    }
}

#[test]
fn checkpoints_not_increasing() {
    let (blob, mut z) = parsed();
    let cps = &mut z.compression.checkpoints;
    let out1 = i64::from_le_bytes(cps[record(1) + 8..record(1) + 16].try_into().unwrap());
    set_i64(cps, record(2) + 8, out1);
    let m = convert(&blob, &z);
    assert!(
        m.contains("checkpoint 1") && m.contains("not before"),
        "{m}"
    );
    let (blob, mut z) = parsed();
    let cps = &mut z.compression.checkpoints;
    let in1 = i64::from_le_bytes(cps[record(1)..record(1) + 8].try_into().unwrap());
    set_i64(cps, record(2), in1 - 1);
    assert!(convert(&blob, &z).contains("non-empty span"));
}

#[test]
fn checkpoint_past_the_archive() {
    let (blob, mut z) = parsed();
    let last = z.compression.max_span_id as usize;
    set_i64(
        &mut z.compression.checkpoints,
        record(last),
        blob.len() as i64 + 10,
    );
    assert!(convert(&blob, &z).contains("inside the"));
    let (blob, mut z) = parsed();
    let size = z.uncompressed_archive_size as i64;
    set_i64(&mut z.compression.checkpoints, record(last) + 8, size);
    assert!(convert(&blob, &z).contains("end of the archive"));
    let (blob, mut z) = parsed();
    z.compressed_archive_size += 1;
    assert!(convert(&blob, &z).contains("not the layer's size"));
}

#[test]
fn huge_claimed_counts() {
    // 32785·131005 + 12 wraps to 31641 in 32-bit arithmetic; here it is just wrong.
    let mut blob = vec![0u8; 31_641];
    blob[0..4].copy_from_slice(&131_005i32.to_le_bytes());
    let m = soci_message(parse_gzip_zinfo(&blob));
    assert!(m.contains("fits neither"), "{m}");
    for count in [0i32, -1, i32::MAX] {
        let mut blob = vec![0u8; 12];
        blob[0..4].copy_from_slice(&count.to_le_bytes());
        soci_message(parse_gzip_zinfo(&blob));
    }
    soci_message(parse_gzip_zinfo(&[1, 0, 0]));
}

#[test]
fn zinfo_v1_and_v2() {
    let w = vec![7u8; 32 * 1024];
    let cps = [
        ZinfoCheckpoint {
            in_offset: 10,
            out_offset: 0,
            bits: 0,
            window: &[],
        },
        ZinfoCheckpoint {
            in_offset: 500,
            out_offset: 70_000,
            bits: 3,
            window: &w,
        },
    ];
    let v2 = encode_gzip_zinfo(4096, &cps).unwrap();
    let parsed = parse_gzip_zinfo(&v2).unwrap();
    assert!(!parsed.legacy_v1);
    assert_eq!(parsed.span_size, 4096);
    assert_eq!(parsed.checkpoints[1], cps[1]);
    assert_eq!(parsed.checkpoints[0].window, &[0u8; 32 * 1024][..]);
    // Version 1: the first record left out, the count unchanged.
    let mut v1 = v2[..ZINFO_HEADER_LEN].to_vec();
    v1.extend_from_slice(&v2[record(1)..]);
    let parsed = parse_gzip_zinfo(&v1).unwrap();
    assert!(parsed.legacy_v1);
    assert_eq!(parsed.checkpoints[0].in_offset, 10);
    assert_eq!(parsed.checkpoints[1], cps[1]);
    let mut bad = v2.clone();
    bad[record(1) + 16] = 8;
    assert!(soci_message(parse_gzip_zinfo(&bad)).contains("bit count 8"));
}

/// A hand-made zTOC with only a compression_info of the given algorithm.
fn with_algorithm(algorithm: i8) -> Vec<u8> {
    let mut fbb = FlatBufferBuilder::new();
    let cps = fbb.create_vector(
        &encode_gzip_zinfo(
            1,
            &[ZinfoCheckpoint {
                in_offset: 10,
                out_offset: 0,
                bits: 0,
                window: &[],
            }],
        )
        .unwrap(),
    );
    let d = fbb.create_string(DIGEST);
    let digests = fbb.create_vector(&[d]);
    let t = fbb.start_table();
    fbb.push_slot_always::<i8>(CI_ALGORITHM, algorithm);
    fbb.push_slot_always(CI_SPAN_DIGESTS, digests);
    fbb.push_slot_always(CI_CHECKPOINTS, cps);
    let info = fbb.end_table(t);
    let t = fbb.start_table();
    fbb.push_slot::<i64>(ZTOC_COMPRESSED_SIZE, 100, 0);
    fbb.push_slot::<i64>(ZTOC_UNCOMPRESSED_SIZE, 1024, 0);
    fbb.push_slot_always(ZTOC_COMPRESSION_INFO, info);
    let root = fbb.end_table(t);
    fbb.finish_minimal(root);
    fbb.finished_data().to_vec()
}

#[test]
fn unsupported_algorithms() {
    let m = soci_message(parse_ztoc(&with_algorithm(3)));
    assert!(m.contains("unknown compression_algorithm 3"), "{m}");
    let z = parse_ztoc(&with_algorithm(2)).unwrap();
    assert_eq!(z.compression.algorithm, ZtocCompression::Uncompressed);
    let m = soci_message(z.to_layer_index(DIGEST, 100));
    assert!(m.contains("uncompressed"), "{m}");
    // Gzip, with an empty TOC: a valid (if useless) zTOC.
    let z = parse_ztoc(&with_algorithm(1)).unwrap();
    let index = z.to_layer_index(DIGEST, 100).unwrap();
    assert_eq!(index.checkpoints.len(), 1);
    assert!(index.entries.is_empty());
}

#[test]
fn overlapping_entries_are_refused() {
    let (blob, mut z) = parsed();
    let i = z.entries.iter().position(|e| e.name == "d/f5").unwrap();
    z.entries[i].uncompressed_offset = z.entries[i - 1].uncompressed_offset;
    let m = convert(&blob, &z);
    assert!(m.contains("overlaps"), "{m}");
    let (blob, mut z) = parsed();
    let last = z.entries.len() - 1;
    z.entries[last].uncompressed_size = z.uncompressed_archive_size;
    assert!(convert(&blob, &z).contains("past the"));
    let (blob, mut z) = parsed();
    z.entries[0].name = "../escape".into();
    assert!(convert(&blob, &z).contains("\"..\""));
    let (blob, mut z) = parsed();
    z.entries[0].mod_time = "yesterday".into();
    assert!(convert(&blob, &z).contains("RFC 3339"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// No mutation of a valid zTOC panics: parse and convert return a value or an error.
    #[test]
    fn mutations_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let (blob, mut z) = VALID.clone();
        for (at, v) in flips {
            let i = at.index(z.len());
            z[i] = v;
        }
        if truncate {
            z.truncate(cut.index(z.len()));
        }
        if let Ok(ztoc) = parse_ztoc(&z) {
            let _ = ztoc.to_layer_index(DIGEST, blob.len() as u64);
        }
    }
}

static VALID: std::sync::LazyLock<(Vec<u8>, Vec<u8>)> = std::sync::LazyLock::new(valid);
