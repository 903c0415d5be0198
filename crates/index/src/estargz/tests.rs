#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::io::{Cursor, Read};
use std::path::Path;

use flate2::read::{GzDecoder, MultiGzDecoder};
use sha2::{Digest as _, Sha256};

use super::footer::footer_bytes;
use super::toc::sha256_string;
use super::writer::{gzip, pax_record, push_header};
use super::*;
use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::source::{CountingSource, MemSource};
use crate::tarwalk::TarWalker;

// ---------------------------------------------------------------------------------------
// Test inputs

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        if self.below(2) == 0 {
            (0..n).map(|_| self.next() as u8).collect()
        } else {
            let words: [&[u8]; 5] = [
                b"lorem ",
                b"ipsum ",
                b"\x00\x01\x02",
                b"dolor\n",
                b"sit amet ",
            ];
            let mut v = Vec::with_capacity(n + 16);
            while v.len() < n {
                v.extend_from_slice(words[self.below(5) as usize]);
                if self.below(16) == 0 {
                    v.push(self.next() as u8);
                }
            }
            v.truncate(n);
            v
        }
    }
}

#[derive(Debug, Clone)]
enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    Hardlink(String),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

#[derive(Debug, Clone)]
struct TNode {
    path: String,
    node: Node,
    mode: u32,
    uid: u64,
    mtime: u64,
    nsec: Option<u32>,
    xattrs: Vec<(String, Vec<u8>)>,
}

impl TNode {
    fn new(path: &str, node: Node) -> Self {
        TNode {
            path: path.to_string(),
            node,
            mode: 0o644,
            uid: 0,
            mtime: 1_600_000_000,
            nsec: None,
            xattrs: Vec::new(),
        }
    }
}

fn build_tar(nodes: &[TNode]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for n in nodes {
        let mut pax = Vec::new();
        for (k, v) in &n.xattrs {
            pax_record(&mut pax, &format!("SCHILY.xattr.{k}"), v);
        }
        if let Some(nsec) = n.nsec {
            pax_record(
                &mut pax,
                "mtime",
                format!("{}.{nsec:09}", n.mtime).as_bytes(),
            );
        }
        if !pax.is_empty() {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(tar::EntryType::XHeader);
            h.set_size(pax.len() as u64);
            h.set_path("PaxHeaders/x").unwrap();
            h.set_mode(0o644);
            h.set_cksum();
            b.append(&h, &pax[..]).unwrap();
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(n.mode);
        h.set_uid(n.uid);
        h.set_gid(n.uid + 1);
        h.set_username(&format!("user{}", n.uid)).unwrap();
        h.set_groupname(&format!("group{}", n.uid + 1)).unwrap();
        h.set_mtime(n.mtime);
        h.set_size(0);
        let empty: &[u8] = &[];
        match &n.node {
            Node::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                b.append_data(&mut h, &n.path, empty).unwrap();
            }
            Node::File(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                b.append_data(&mut h, &n.path, &d[..]).unwrap();
            }
            Node::Symlink(t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                b.append_link(&mut h, &n.path, t).unwrap();
            }
            Node::Hardlink(t) => {
                h.set_entry_type(tar::EntryType::Link);
                b.append_link(&mut h, &n.path, t).unwrap();
            }
            Node::Char(ma, mi) | Node::Block(ma, mi) => {
                let t = if matches!(n.node, Node::Char(..)) {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                };
                h.set_entry_type(t);
                h.set_device_major(*ma).unwrap();
                h.set_device_minor(*mi).unwrap();
                b.append_data(&mut h, &n.path, empty).unwrap();
            }
            Node::Fifo => {
                h.set_entry_type(tar::EntryType::Fifo);
                b.append_data(&mut h, &n.path, empty).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// A random tree: every kind of entry, files of many sizes around `chunk`, long names,
/// xattrs, sub-second times.
fn random_tree(seed: u64, n: usize, chunk: u64) -> Vec<TNode> {
    let mut rng = Rng(seed);
    let mut nodes = vec![TNode {
        mode: 0o755,
        ..TNode::new(".", Node::Dir)
    }];
    let mut dirs = vec![String::new()];
    let mut files: Vec<String> = Vec::new();
    let sizes = [
        0,
        1,
        2,
        511,
        512,
        513,
        4095,
        chunk - 1,
        chunk,
        chunk + 1,
        3 * chunk + 7,
        2 * chunk,
    ];
    for i in 0..n {
        let parent = dirs[rng.below(dirs.len() as u64) as usize].clone();
        let name = match rng.below(12) {
            0 => format!("long{i}_{}", "L".repeat(90 + rng.below(150) as usize)),
            1 => format!("ünï{i} spa ce"),
            _ => format!("e{i}"),
        };
        let path = if parent.is_empty() {
            name
        } else {
            format!("{parent}/{name}")
        };
        let kind = rng.below(20);
        let node = match kind {
            0..=3 => Node::Dir,
            4..=11 => {
                let size = if rng.below(3) == 0 {
                    rng.below(5 * chunk + 3)
                } else {
                    sizes[rng.below(sizes.len() as u64) as usize]
                };
                Node::File(rng.bytes(size as usize))
            }
            12 | 13 => {
                let t = if rng.below(3) == 0 {
                    format!("../{}", "t".repeat(150))
                } else {
                    format!("target{i}")
                };
                Node::Symlink(t)
            }
            14 | 15 if !files.is_empty() => {
                Node::Hardlink(files[rng.below(files.len() as u64) as usize].clone())
            }
            16 => Node::Char(rng.below(300) as u32, rng.below(300) as u32),
            17 => Node::Block(rng.below(300) as u32, rng.below(300) as u32),
            _ => Node::Fifo,
        };
        let mut t = TNode::new(&path, node);
        t.uid = [0, 1000, 65534][rng.below(3) as usize];
        t.mode = match t.node {
            Node::Dir => [0o755, 0o1777, 0o700][rng.below(3) as usize],
            _ => [0o644, 0o755, 0o4755, 0o600][rng.below(4) as usize],
        };
        t.mtime = 1_000_000_000 + rng.below(600_000_000);
        if rng.below(4) == 0 {
            t.nsec = Some(rng.below(1_000_000_000) as u32);
        }
        if rng.below(5) == 0 && matches!(t.node, Node::File(_) | Node::Dir) {
            for j in 0..1 + rng.below(3) {
                let len = rng.below(40) as usize;
                t.xattrs.push((format!("user.k{j}"), rng.bytes(len)));
            }
        }
        match t.node {
            Node::Dir => dirs.push(path.clone()),
            Node::File(_) => files.push(path.clone()),
            _ => {}
        }
        nodes.push(t);
    }
    nodes
}

fn opener(tar: &[u8]) -> impl FnMut() -> Result<Box<dyn Read + Send>> + '_ {
    move || Ok(Box::new(Cursor::new(tar.to_vec())) as Box<dyn Read + Send>)
}

fn convert_bytes(tar: &[u8], opts: &EstargzOptions) -> (Vec<u8>, EstargzOutput) {
    let mut open = opener(tar);
    let mut blob = Vec::new();
    let out = convert(&mut open, &mut blob, opts).unwrap();
    (blob, out)
}

/// What the TOC keeps of an entry: no offsets, times rounded to the second like stargz.
fn toc_view(e: &Entry) -> Entry {
    let mut e = e.clone();
    e.offset = 0;
    e.header_offset = 0;
    if e.mtime != 0 && e.mtime_nsec >= 500_000_000 {
        e.mtime += 1;
    }
    e.mtime_nsec = 0;
    e
}

fn no_offsets(e: &Entry) -> Entry {
    Entry {
        offset: 0,
        header_offset: 0,
        ..e.clone()
    }
}

/// Everything a converted blob must satisfy, given the input entries in expected output
/// order.
fn check_blob(
    blob: &[u8],
    out: &EstargzOutput,
    expected: &[(Entry, Vec<u8>)],
    landmark: &str,
) -> EstargzLayer {
    assert_eq!(out.size, blob.len() as u64);
    assert_eq!(out.digest, sha256_string(&Sha256::digest(blob).into()));
    // The blob is one gzip stream of a tar that the strict walker accepts.
    let mut tar = Vec::new();
    MultiGzDecoder::new(blob).read_to_end(&mut tar).unwrap();
    assert_eq!(out.uncompressed_size, tar.len() as u64);
    assert_eq!(out.diff_id, sha256_string(&Sha256::digest(&tar).into()));
    let written = crate::tarwalk::walk_all(&tar);
    let n = written.len();
    assert!(n >= 2);
    assert_eq!(written[n - 1].0.path, TOC_TAR_NAME);
    let landmark_at = written
        .iter()
        .position(|(e, _)| e.path == landmark)
        .unwrap();
    assert_eq!(written[landmark_at].1, vec![LANDMARK_CONTENTS]);
    let body: Vec<(Entry, Vec<u8>)> = written[..n - 1]
        .iter()
        .filter(|(e, _)| e.path != landmark)
        .map(|(e, d)| (no_offsets(e), d.clone()))
        .collect();
    let want: Vec<(Entry, Vec<u8>)> = expected
        .iter()
        .map(|(e, d)| (no_offsets(e), d.clone()))
        .collect();
    assert_eq!(body.len(), want.len());
    for (got, want) in body.iter().zip(&want) {
        assert_eq!(got, want);
    }

    // The TOC agrees with the tar.
    let source = MemSource(blob.to_vec());
    let layer = EstargzLayer::open(&source, Some(&out.toc_digest)).unwrap();
    assert_eq!(layer.toc_digest(), out.toc_digest);
    let entries = layer.entries();
    assert_eq!(entries.len(), expected.len());
    for (got, (want, _)) in entries.iter().zip(expected) {
        assert_eq!(got, &toc_view(want));
    }
    layer
}

/// Reads every file whole and at random ranges through `read_at` and checks the bytes
/// and the fetched ranges.
fn check_reads(layer: &EstargzLayer, blob: &[u8], expected: &[(Entry, Vec<u8>)], seed: u64) {
    let by_path: HashMap<&str, &Vec<u8>> = expected
        .iter()
        .filter(|(e, _)| e.kind == EntryKind::File)
        .map(|(e, d)| (e.path.as_str(), d))
        .collect();
    let source = CountingSource::new(MemSource(blob.to_vec()));
    let mut rng = Rng(seed);
    for (idx, e) in layer.entries().iter().enumerate() {
        let data: &[u8] = match e.kind {
            EntryKind::File => by_path[e.path.as_str()],
            EntryKind::Hardlink => by_path[e.link_target.as_str()],
            _ => {
                let mut buf = [0u8; 4];
                assert!(matches!(
                    layer.read_at(&source, idx, 0, &mut buf),
                    Err(Error::NotAFile { .. })
                ));
                assert!(layer.ranges_for(idx, 0, 10).is_empty());
                continue;
            }
        };
        let mut whole = vec![0u8; data.len() + 10];
        let n = layer.read_at(&source, idx, 0, &mut whole).unwrap();
        assert_eq!(&whole[..n], data, "{}", e.path);
        for _ in 0..8 {
            let off = rng.below(data.len() as u64 + 3);
            let len = rng.below(data.len() as u64 + 3 - off) as usize;
            let mut buf = vec![0u8; len];
            let before = source.bytes_read();
            let n = layer.read_at(&source, idx, off, &mut buf).unwrap();
            let end = (off as usize + len).min(data.len());
            let want = if (off as usize) < data.len() {
                &data[off as usize..end]
            } else {
                &[][..]
            };
            assert_eq!(&buf[..n], want, "{} at {off}+{len}", e.path);
            let ranges = layer.ranges_for(idx, off, len as u64);
            let fetched: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            assert_eq!(
                source.bytes_read() - before,
                fetched,
                "{} at {off}+{len}",
                e.path
            );
            for r in &ranges {
                assert!(r.start < r.end && r.end <= layer.toc_offset());
            }
        }
    }
}

fn system_tar_check(blob: &[u8], expected: &[(Entry, Vec<u8>)]) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("layer.tar.gz");
    std::fs::write(&file, blob).unwrap();
    let list = std::process::Command::new("tar")
        .arg("-tzvf")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        list.status.success(),
        "tar -tzvf: {}",
        String::from_utf8_lossy(&list.stderr)
    );
    assert!(
        list.stderr.is_empty(),
        "tar -tzvf: {}",
        String::from_utf8_lossy(&list.stderr)
    );
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let x = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&file)
        .arg("-C")
        .arg(&root)
        .arg("--xattrs")
        .arg("--xattrs-include=*")
        .output()
        .unwrap();
    assert!(
        x.status.success(),
        "tar -xzf: {}",
        String::from_utf8_lossy(&x.stderr)
    );
    let mut last: BTreeMap<&str, &(Entry, Vec<u8>)> = BTreeMap::new();
    for item in expected {
        last.insert(item.0.path.as_str(), item);
    }
    for (path, (e, data)) in last {
        let p = root.join(path);
        let meta = std::fs::symlink_metadata(&p).unwrap_or_else(|err| panic!("{path}: {err}"));
        match e.kind {
            EntryKind::File => assert_eq!(&std::fs::read(&p).unwrap(), data, "{path}"),
            EntryKind::Dir => assert!(meta.is_dir()),
            EntryKind::Symlink => {
                assert_eq!(std::fs::read_link(&p).unwrap(), Path::new(&e.link_target))
            }
            EntryKind::Hardlink => {
                use std::os::unix::fs::MetadataExt as _;
                let t = std::fs::symlink_metadata(root.join(&e.link_target)).unwrap();
                assert_eq!(meta.ino(), t.ino(), "{path}");
            }
            EntryKind::Char | EntryKind::Block | EntryKind::Fifo => {
                use std::os::unix::fs::FileTypeExt as _;
                let ft = meta.file_type();
                assert!(
                    ft.is_char_device() || ft.is_block_device() || ft.is_fifo(),
                    "{path}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Round trips

#[test]
fn round_trip_random_trees() {
    for (seed, chunk, level) in [
        (1u64, 1000u64, 6u32),
        (2, 4096, 1),
        (3, 777, 9),
        (4, 64 << 10, 12),
        (5, 1, 0),
    ] {
        let n = match chunk {
            1 => 30,
            c if c > 10_000 => 40,
            _ => 120,
        };
        let nodes = random_tree(seed, n, chunk.max(16));
        let tar = build_tar(&nodes);
        let expected = crate::tarwalk::walk_all(&tar);
        let opts = EstargzOptions {
            chunk_size: chunk,
            level,
            priority: Vec::new(),
        };
        let (blob, out) = convert_bytes(&tar, &opts);
        let layer = check_blob(&blob, &out, &expected, NO_PREFETCH_LANDMARK);
        assert!(layer.prefetch_paths().is_none());
        check_reads(&layer, &blob, &expected, seed);
        if seed <= 2 {
            system_tar_check(&blob, &expected);
        }
        // Deterministic.
        let (again, out2) = convert_bytes(&tar, &opts);
        assert!(again == blob, "seed {seed}: output differs between runs");
        assert_eq!(out, out2);
    }
}

#[test]
fn members_start_at_chunks() {
    let nodes = random_tree(11, 60, 3000);
    let tar = build_tar(&nodes);
    let (blob, out) = convert_bytes(
        &tar,
        &EstargzOptions {
            chunk_size: 3000,
            ..EstargzOptions::default()
        },
    );
    let layer = EstargzLayer::open(&MemSource(blob.clone()), Some(&out.toc_digest)).unwrap();
    let expected = crate::tarwalk::walk_all(&tar);
    let by_path: HashMap<&str, &Vec<u8>> =
        expected.iter().map(|(e, d)| (e.path.as_str(), d)).collect();
    // Every chunk is at the start of its own member: inflating one member from its
    // offset gives the chunk's bytes first.
    let mut seen = 0;
    for (idx, e) in layer.entries().iter().enumerate() {
        if e.kind != EntryKind::File || e.size == 0 {
            continue;
        }
        let data = by_path[e.path.as_str()];
        let mut off = 0u64;
        while off < e.size {
            let r = layer.ranges_for(idx, off, 1);
            assert_eq!(r.len(), 1);
            let mut member = Vec::new();
            GzDecoder::new(&blob[r[0].start as usize..])
                .read_to_end(&mut member)
                .unwrap();
            let n = (e.size - off).min(3000) as usize;
            assert_eq!(&member[..n], &data[off as usize..off as usize + n]);
            off += 3000;
            seen += 1;
        }
    }
    assert!(seen > 20);
}

#[test]
fn priority_order_and_landmark() {
    let file = |p: &str, d: &[u8]| TNode::new(p, Node::File(d.to_vec()));
    let nodes = vec![
        TNode::new(".", Node::Dir),
        TNode::new("a", Node::Dir),
        TNode::new("a/b", Node::Dir),
        file("a/b/f1", b"one"),
        file("a/b/f2", &[7u8; 5000]),
        TNode::new("y", Node::Dir),
        file("y/target", b"hard"),
        TNode::new("x", Node::Dir),
        TNode::new("x/hl", Node::Hardlink("y/target".into())),
        TNode::new("x/sym", Node::Symlink("../a/b/f1".into())),
        file("z", b"last"),
        file("a/b/f3", b"three"),
    ];
    let tar = build_tar(&nodes);
    let input = crate::tarwalk::walk_all(&tar);
    let get = |p: &str| input.iter().find(|(e, _)| e.path == p).unwrap().clone();
    let opts = EstargzOptions {
        chunk_size: 1024,
        level: 6,
        priority: vec![
            "a/b/f2".into(),
            "/x/hl".into(),
            "missing/file".into(),
            "./a/b/f1".into(),
        ],
    };
    let mut opens = 0;
    let mut open = || {
        opens += 1;
        Ok(Box::new(Cursor::new(tar.clone())) as Box<dyn Read + Send>)
    };
    let mut blob = Vec::new();
    let out = convert(&mut open, &mut blob, &opts).unwrap();
    // First pass, a pass for the hard link's target, the main pass.
    assert_eq!(opens, 3);
    let first = [
        "", "a", "a/b", "a/b/f2", "x", "y", "y/target", "x/hl", "a/b/f1",
    ];
    let rest = ["x/sym", "z", "a/b/f3"];
    let expected: Vec<(Entry, Vec<u8>)> = first.iter().chain(&rest).map(|p| get(p)).collect();
    let layer = check_blob(&blob, &out, &expected, PREFETCH_LANDMARK);
    assert_eq!(
        layer.prefetch_paths().unwrap(),
        &[
            "a/b/f2".to_string(),
            "y/target".to_string(),
            "a/b/f1".to_string()
        ]
    );
    let range = layer.prefetch_range().unwrap();
    assert!(range.end > 0 && range.end < layer.toc_offset());
    // The prioritized files' data lies inside the prefetch range.
    for p in ["a/b/f2", "a/b/f1"] {
        let idx = layer.entries().iter().position(|e| e.path == p).unwrap();
        for r in layer.ranges_for(idx, 0, u64::MAX) {
            assert!(r.end <= range.end, "{p}");
        }
    }
    check_reads(&layer, &blob, &expected, 9);
    system_tar_check(&blob, &expected);
}

#[test]
fn priority_on_random_tree() {
    let nodes = random_tree(21, 150, 2000);
    let tar = build_tar(&nodes);
    let input = crate::tarwalk::walk_all(&tar);
    let files: Vec<String> = input
        .iter()
        .filter(|(e, _)| e.kind != EntryKind::Dir)
        .map(|(e, _)| e.path.clone())
        .collect();
    let priority: Vec<String> = files.iter().rev().step_by(3).cloned().collect();
    let opts = EstargzOptions {
        chunk_size: 2000,
        level: 6,
        priority: priority.clone(),
    };
    let (blob, out) = convert_bytes(&tar, &opts);
    let layer = EstargzLayer::open(&MemSource(blob.clone()), Some(&out.toc_digest)).unwrap();
    // Same set of entries, prioritized ones first in the requested order.
    let mut got: Vec<&str> = layer.entries().iter().map(|e| e.path.as_str()).collect();
    let pos = |p: &str| got.iter().position(|g| *g == p).unwrap();
    // Hard link targets are pulled in front of their links, so only the others keep the
    // requested order exactly; all of them come before the rest.
    let link_targets: Vec<&str> = input
        .iter()
        .filter(|(e, _)| e.kind == EntryKind::Hardlink && priority.contains(&e.path))
        .map(|(e, _)| e.link_target.as_str())
        .collect();
    let mut last = 0;
    for p in priority
        .iter()
        .filter(|p| !link_targets.contains(&p.as_str()))
    {
        let at = pos(p);
        assert!(at >= last, "{p} out of order");
        last = at;
    }
    let mut tar_out = Vec::new();
    MultiGzDecoder::new(&blob[..])
        .read_to_end(&mut tar_out)
        .unwrap();
    let n_first = crate::tarwalk::walk_all(&tar_out)
        .iter()
        .position(|(e, _)| e.path == PREFETCH_LANDMARK)
        .unwrap();
    for p in &priority {
        assert!(pos(p) < n_first, "{p} after the landmark");
    }
    let picked = layer.prefetch_paths().unwrap();
    assert!(picked.iter().all(|p| pos(p) < n_first));
    let mut want: Vec<&str> = input.iter().map(|(e, _)| e.path.as_str()).collect();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want);
    let input_map: Vec<(Entry, Vec<u8>)> = input.clone();
    check_reads(&layer, &blob, &input_map, 4);
    system_tar_check(&blob, &input);
}

#[test]
fn reserved_input_entries_are_dropped() {
    let nodes = vec![
        TNode::new(".no.prefetch.landmark", Node::File(vec![0xf])),
        TNode::new("stargz.index.json", Node::File(b"{}".to_vec())),
        TNode::new("keep", Node::File(b"data".to_vec())),
    ];
    let tar = build_tar(&nodes);
    let (blob, out) = convert_bytes(&tar, &EstargzOptions::default());
    let input = crate::tarwalk::walk_all(&tar);
    let layer = check_blob(&blob, &out, &input[2..], NO_PREFETCH_LANDMARK);
    assert_eq!(layer.entries().len(), 1);
}

#[test]
fn bad_options_and_bad_input() {
    let tar = build_tar(&[TNode::new("f", Node::File(b"x".to_vec()))]);
    for opts in [
        EstargzOptions {
            chunk_size: 0,
            ..EstargzOptions::default()
        },
        EstargzOptions {
            level: 13,
            ..EstargzOptions::default()
        },
    ] {
        let mut open = opener(&tar);
        assert!(convert(&mut open, Vec::new(), &opts).is_err());
    }
    // Truncated input tar.
    for cut in [100, 600, tar.len() - 1024] {
        let mut open = opener(&tar[..cut]);
        assert!(
            convert(&mut open, Vec::new(), &EstargzOptions::default()).is_err(),
            "cut {cut}"
        );
    }
    // A failing writer.
    struct Fail;
    impl std::io::Write for Fail {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("disk full"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let big = build_tar(&random_tree(5, 80, 100_000));
    let mut open = opener(&big);
    assert!(convert(&mut open, Fail, &EstargzOptions::default()).is_err());
}

// ---------------------------------------------------------------------------------------
// Footer

fn legacy_footer(toc_offset: u64) -> Vec<u8> {
    let mut f = vec![0x1f, 0x8b, 8, 4, 0, 0, 0, 0, 0, 255, 22, 0];
    f.extend_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
    f.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    f.extend_from_slice(&[0; 8]);
    assert_eq!(f.len() as u64, LEGACY_FOOTER_SIZE);
    f
}

#[test]
fn footer_parse() {
    for off in [0u64, 1, 0x1234_5678, u64::MAX] {
        let f = footer_bytes(off);
        assert_eq!(parse_footer(&f).unwrap(), off);
        let mut longer = vec![9u8; 30];
        longer.extend_from_slice(&f);
        assert_eq!(parse_footer(&longer).unwrap(), off);
        assert_eq!(parse_footer(&legacy_footer(off)).unwrap(), off);
        // The footer is a valid, empty gzip member.
        let mut out = Vec::new();
        GzDecoder::new(&f[..]).read_to_end(&mut out).unwrap();
        assert!(out.is_empty());
    }
    assert!(parse_footer(&[]).is_err());
    assert!(parse_footer(&footer_bytes(5)[..46]).is_err());
    for i in [0usize, 1, 2, 3, 10, 12, 13, 14, 16, 33, 37] {
        let mut f = footer_bytes(77);
        f[i] ^= 0x40;
        assert!(parse_footer(&f).is_err(), "byte {i}");
    }
    let mut f = footer_bytes(77);
    f[20] = b'g';
    assert!(parse_footer(&f).is_err());
}

// ---------------------------------------------------------------------------------------
// Tampering and bounds

/// Entries with their data.
type Expected = Vec<(Entry, Vec<u8>)>;

fn small_blob() -> (Vec<u8>, EstargzOutput, Expected) {
    let nodes = random_tree(31, 25, 700);
    let tar = build_tar(&nodes);
    let (blob, out) = convert_bytes(
        &tar,
        &EstargzOptions {
            chunk_size: 700,
            ..EstargzOptions::default()
        },
    );
    (blob, out, crate::tarwalk::walk_all(&tar))
}

/// The TOC JSON of a blob.
fn toc_json(blob: &[u8]) -> serde_json::Value {
    let off = parse_footer(&blob[blob.len() - 51..]).unwrap() as usize;
    let mut ar = tar::Archive::new(GzDecoder::new(&blob[off..]));
    let mut entry = ar.entries().unwrap().next().unwrap().unwrap();
    let mut json = Vec::new();
    entry.read_to_end(&mut json).unwrap();
    serde_json::from_slice(&json).unwrap()
}

/// Replaces the TOC of a blob with `toc` (data members kept).
fn with_toc(blob: &[u8], toc: &serde_json::Value) -> Vec<u8> {
    let off = parse_footer(&blob[blob.len() - 51..]).unwrap() as usize;
    let json = serde_json::to_vec(toc).unwrap();
    let e = Entry {
        path: TOC_TAR_NAME.into(),
        size: json.len() as u64,
        mode: 0o644,
        ..Entry::default()
    };
    let mut t = Vec::new();
    push_header(&mut t, &e, TOC_TAR_NAME).unwrap();
    t.extend_from_slice(&json);
    t.resize(t.len().div_ceil(512) * 512 + 1024, 0);
    let mut out = blob[..off].to_vec();
    out.extend_from_slice(&gzip(6, &t).unwrap());
    out.extend_from_slice(&footer_bytes(off as u64));
    out
}

fn open_err(blob: Vec<u8>) -> Error {
    match EstargzLayer::open(&MemSource(blob), None) {
        Ok(_) => panic!("opened a bad blob"),
        Err(e) => e,
    }
}

#[test]
fn toc_digest_checked() {
    let (blob, out, _) = small_blob();
    let zero = format!("sha256:{}", "0".repeat(64));
    assert!(matches!(
        EstargzLayer::open(&MemSource(blob.clone()), Some(&zero)),
        Err(Error::DigestMismatch { .. })
    ));
    assert!(matches!(
        EstargzLayer::open(&MemSource(blob.clone()), Some("md5:abc")),
        Err(Error::Estargz(_))
    ));
    let layer = EstargzLayer::open(&MemSource(blob.clone()), None).unwrap();
    assert_eq!(layer.toc_digest(), out.toc_digest);
    // The right digest in uppercase hex is not a digest (ferry-oci's one rule).
    let upper = format!(
        "sha256:{}",
        out.toc_digest["sha256:".len()..].to_ascii_uppercase()
    );
    assert!(matches!(
        EstargzLayer::open(&MemSource(blob.clone()), Some(&upper)),
        Err(Error::Estargz(_))
    ));
    // A re-encoded TOC has another digest.
    let other = with_toc(&blob, &toc_json(&blob));
    assert!(matches!(
        EstargzLayer::open(&MemSource(other), Some(&out.toc_digest)),
        Err(Error::DigestMismatch { .. })
    ));
}

#[test]
fn uppercase_chunk_digest_refused() {
    let (blob, _, _) = small_blob();
    let mut toc = toc_json(&blob);
    let entries = toc["entries"].as_array_mut().unwrap();
    let victim = entries
        .iter()
        .position(|e| e["chunkDigest"].as_str().is_some_and(|d| !d.is_empty()))
        .unwrap();
    let upper = entries[victim]["chunkDigest"]
        .as_str()
        .unwrap()
        .replace("sha256:", "")
        .to_ascii_uppercase();
    entries[victim]["chunkDigest"] = format!("sha256:{upper}").into();
    match EstargzLayer::open(&MemSource(with_toc(&blob, &toc)), None) {
        Err(Error::Estargz(m)) => assert!(m.contains("chunkDigest"), "{m}"),
        other => panic!("expected the TOC refused, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn chunk_digest_mismatch_detected() {
    let (blob, _, expected) = small_blob();
    let mut toc = toc_json(&blob);
    let entries = toc["entries"].as_array_mut().unwrap();
    let victim = entries
        .iter()
        .position(|e| {
            e["type"] == "reg"
                && e["size"].as_u64().unwrap_or(0) > 0
                && e["name"] != NO_PREFETCH_LANDMARK
        })
        .unwrap();
    let name = entries[victim]["name"].as_str().unwrap().to_string();
    entries[victim]["chunkDigest"] =
        sha256_string(&Sha256::digest(b"something else").into()).into();
    let bad = with_toc(&blob, &toc);
    let source = MemSource(bad);
    let layer = EstargzLayer::open(&source, None).unwrap();
    let idx = layer
        .entries()
        .iter()
        .position(|e| e.path == name.trim_end_matches('/'))
        .unwrap();
    let mut buf = vec![0u8; 10];
    match layer.read_at(&source, idx, 0, &mut buf) {
        Err(Error::DigestMismatch { what, .. }) => {
            assert!(what.contains(&layer.entries()[idx].path))
        }
        other => panic!("expected a digest mismatch, got {other:?}"),
    }
    // Every other file still reads fine.
    let _ = expected;
}

#[test]
fn corrupted_members_never_serve_wrong_bytes() {
    let (blob, out, expected) = small_blob();
    let layer = EstargzLayer::open(&MemSource(blob.clone()), Some(&out.toc_digest)).unwrap();
    let data: HashMap<&str, &Vec<u8>> =
        expected.iter().map(|(e, d)| (e.path.as_str(), d)).collect();
    let toc_off = layer.toc_offset() as usize;
    let step = (toc_off / 150).max(1);
    let mut errors = 0;
    for pos in (0..toc_off).step_by(step) {
        let mut bad = blob.clone();
        bad[pos] ^= 0x5a;
        let source = MemSource(bad);
        for (idx, e) in layer.entries().iter().enumerate() {
            let want: &[u8] = match e.kind {
                EntryKind::File => data[e.path.as_str()],
                EntryKind::Hardlink => data[e.link_target.as_str()],
                _ => continue,
            };
            let mut buf = vec![0u8; want.len()];
            match layer.read_at(&source, idx, 0, &mut buf) {
                Ok(n) => assert_eq!(&buf[..n], want, "corruption at {pos} served for {}", e.path),
                Err(_) => errors += 1,
            }
        }
    }
    assert!(errors > 0);
}

#[test]
fn truncated_and_garbage_blobs_fail() {
    let (blob, _, _) = small_blob();
    let len = blob.len();
    let mut cuts: Vec<usize> = vec![0, 1, 10, 46, 47, 50, 51, 52, len / 2];
    cuts.extend(len - 300..len);
    for cut in cuts {
        assert!(
            EstargzLayer::open(&MemSource(blob[..cut].to_vec()), None).is_err(),
            "cut {cut}"
        );
    }
    let mut rng = Rng(5);
    for n in [0usize, 47, 51, 100, 5000] {
        let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        assert!(EstargzLayer::open(&MemSource(junk), None).is_err());
    }
    // Footer pointing outside the blob or at the footer itself.
    for off in [
        u64::MAX,
        len as u64,
        len as u64 - 51,
        (len - 51) as u64 + 10,
    ] {
        let mut bad = blob[..len - 51].to_vec();
        bad.extend_from_slice(&footer_bytes(off));
        assert!(matches!(open_err(bad), Error::Estargz(_)), "offset {off}");
    }
    // Footer pointing at a data member instead of the TOC.
    let mut bad = blob[..len - 51].to_vec();
    bad.extend_from_slice(&footer_bytes(0));
    assert!(EstargzLayer::open(&MemSource(bad), None).is_err());
}

#[test]
fn legacy_footer_blob_opens() {
    let (blob, out, expected) = small_blob();
    let off = parse_footer(&blob[blob.len() - 51..]).unwrap();
    let mut legacy = blob[..blob.len() - 51].to_vec();
    legacy.extend_from_slice(&legacy_footer(off));
    let layer = EstargzLayer::open(&MemSource(legacy.clone()), Some(&out.toc_digest)).unwrap();
    check_reads(&layer, &legacy, &expected, 3);
}

#[test]
fn invalid_tocs_are_refused() {
    let (blob, _, _) = small_blob();
    let toc = toc_json(&blob);
    let toc_off = parse_footer(&blob[blob.len() - 51..]).unwrap();
    let first_reg = |t: &serde_json::Value| {
        t["entries"]
            .as_array()
            .unwrap()
            .iter()
            .position(|e| {
                e["type"] == "reg"
                    && e["size"].as_u64().unwrap_or(0) > 0
                    && e["name"] != NO_PREFETCH_LANDMARK
            })
            .unwrap()
    };
    let chunked = |t: &serde_json::Value| {
        t["entries"]
            .as_array()
            .unwrap()
            .iter()
            .position(|e| e["type"] == "chunk")
            .unwrap()
    };
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("version", Box::new(|t| t["version"] = 2.into())),
        (
            "offset past the TOC",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["offset"] = (toc_off + 10).into();
            }),
        ),
        (
            "negative offset",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["offset"] = (-5).into();
            }),
        ),
        (
            "negative size",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["size"] = (-1).into();
            }),
        ),
        (
            "chunkSize past the end",
            Box::new(move |t| {
                let i = first_reg(t);
                let size = t["entries"][i]["size"].as_u64().unwrap();
                t["entries"][i]["chunkSize"] = (size + 1).into();
            }),
        ),
        (
            "missing chunk",
            Box::new(move |t| {
                let i = chunked(t);
                t["entries"].as_array_mut().unwrap().remove(i);
            }),
        ),
        (
            "wrong chunkOffset",
            Box::new(move |t| {
                let i = chunked(t);
                t["entries"][i]["chunkOffset"] = 1.into();
            }),
        ),
        (
            "chunk first",
            Box::new(move |t| {
                let i = chunked(t);
                let c = t["entries"][i].clone();
                t["entries"].as_array_mut().unwrap().insert(0, c);
            }),
        ),
        (
            "no digest",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["chunkDigest"] = serde_json::Value::Null;
                t["entries"][i]["digest"] = serde_json::Value::Null;
            }),
        ),
        (
            "bad digest",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["chunkDigest"] = "sha256:xyz".into();
            }),
        ),
        (
            "dotdot",
            Box::new(move |t| {
                let i = first_reg(t);
                t["entries"][i]["name"] = "a/../../etc/passwd".into();
            }),
        ),
        (
            "unknown type",
            Box::new(move |t| t["entries"][1]["type"] = "socket".into()),
        ),
        (
            "dangling hardlink",
            Box::new(move |t| {
                let e =
                    serde_json::json!({"name": "hl", "type": "hardlink", "linkName": "no/such"});
                t["entries"].as_array_mut().unwrap().push(e);
            }),
        ),
        (
            "uid",
            Box::new(move |t| t["entries"][1]["uid"] = (1u64 << 40).into()),
        ),
        (
            "entries not an array",
            Box::new(move |t| t["entries"] = 5.into()),
        ),
        (
            "non-root root",
            Box::new(move |t| {
                let e = serde_json::json!({"name": "./", "type": "reg"});
                t["entries"].as_array_mut().unwrap().push(e);
            }),
        ),
    ];
    assert!(EstargzLayer::open(&MemSource(with_toc(&blob, &toc)), None).is_ok());
    for (what, edit) in edits {
        let mut t = toc.clone();
        edit(&mut t);
        match open_err(with_toc(&blob, &t)) {
            Error::Estargz(msg) => assert!(!msg.is_empty(), "{what}"),
            other => panic!("{what}: unexpected error {other}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Hand-made blobs: members shared through innerOffset, legacy digests

fn header(name: &str, size: u64) -> Vec<u8> {
    let e = Entry {
        path: name.into(),
        size,
        mode: 0o644,
        ..Entry::default()
    };
    let mut h = Vec::new();
    push_header(&mut h, &e, name).unwrap();
    h
}

fn padded(data: &[u8]) -> Vec<u8> {
    let mut v = data.to_vec();
    v.resize(data.len().div_ceil(512) * 512, 0);
    v
}

fn digest_of(data: &[u8]) -> String {
    sha256_string(&Sha256::digest(data).into())
}

/// Members (uncompressed) + a TOC built by `toc(offsets)` -> blob.
fn assemble(members: &[Vec<u8>], toc: impl Fn(&[u64]) -> serde_json::Value) -> Vec<u8> {
    let mut blob = Vec::new();
    let mut offsets = Vec::new();
    for m in members {
        offsets.push(blob.len() as u64);
        blob.extend_from_slice(&gzip(6, m).unwrap());
    }
    let json = serde_json::to_vec(&toc(&offsets)).unwrap();
    let mut t = header(TOC_TAR_NAME, json.len() as u64);
    t.extend_from_slice(&padded(&json));
    t.resize(t.len() + 1024, 0);
    let toc_off = blob.len() as u64;
    blob.extend_from_slice(&gzip(6, &t).unwrap());
    blob.extend_from_slice(&footer_bytes(toc_off));
    blob
}

#[test]
fn inner_offset_shared_members() {
    let (a, b, c) = (b"hello".to_vec(), b"abc".to_vec(), b"0123456789".to_vec());
    let m0 = header("a", 5);
    let mut m1 = padded(&a);
    m1.extend_from_slice(&header("b", 3));
    let inner_b = m1.len() as u64;
    m1.extend_from_slice(&padded(&b));
    m1.extend_from_slice(&header("c", 10));
    let m2 = padded(&c);
    let blob = assemble(&[m0, m1, m2], |o| {
        serde_json::json!({"version": 1, "entries": [
            {"name": "a", "type": "reg", "size": 5, "offset": o[1], "chunkDigest": digest_of(&a)},
            {"name": "b", "type": "reg", "size": 3, "offset": o[1], "innerOffset": inner_b, "digest": digest_of(&b)},
            {"name": "c", "type": "reg", "size": 10, "offset": o[2], "chunkSize": 4, "chunkDigest": digest_of(&c[..4])},
            {"name": "c", "type": "chunk", "offset": o[2], "innerOffset": 4, "chunkOffset": 4, "chunkDigest": digest_of(&c[4..])},
            {"name": "l", "type": "hardlink", "linkName": "c"},
        ]})
    });
    // The blob is still a plain tar.gz.
    let mut tar = Vec::new();
    MultiGzDecoder::new(&blob[..])
        .read_to_end(&mut tar)
        .unwrap();
    assert_eq!(crate::tarwalk::walk_all(&tar).len(), 4);
    let source = MemSource(blob);
    let layer = EstargzLayer::open(&source, None).unwrap();
    assert_eq!(layer.entries().len(), 4);
    assert_eq!(layer.ranges_for(0, 0, 5), layer.ranges_for(1, 0, 3));
    let mut buf = [0u8; 16];
    assert_eq!(layer.read_at(&source, 0, 0, &mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    assert_eq!(layer.read_at(&source, 1, 1, &mut buf).unwrap(), 2);
    assert_eq!(&buf[..2], b"bc");
    let mut six = [0u8; 6];
    assert_eq!(layer.read_at(&source, 2, 2, &mut six).unwrap(), 6);
    assert_eq!(&six, b"234567");
    assert_eq!(layer.read_at(&source, 3, 0, &mut buf).unwrap(), 10);
    assert_eq!(&buf[..10], b"0123456789");
    assert_eq!(layer.read_at(&source, 3, 10, &mut buf).unwrap(), 0);
    assert_eq!(layer.ranges_for(2, 0, 4), layer.ranges_for(2, 4, 6));
}

#[test]
fn stargz_style_toc_fields() {
    // Chunked file with the Go writer's habits: user names only when they change, dirs
    // with a trailing slash, a reg whose chunkSize equals its size, legacy "NumLink".
    let data: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    let m0 = {
        let mut m = header("./", 0);
        m.extend_from_slice(&header("bin/busybox", 3000));
        m
    };
    let m1 = padded(&data);
    let blob = assemble(&[m0, m1], |o| {
        serde_json::json!({"version": 1, "entries": [
            {"name": "./", "type": "dir", "mode": 16877, "uid": 0, "userName": "root", "NumLink": 0},
            {"name": "bin/", "type": "dir", "modtime": "2019-08-20T10:30:43Z", "mode": 16877, "uid": 0},
            {"name": "bin/busybox", "type": "reg", "size": 3000, "modtime": "2019-06-12T17:52:45Z",
             "mode": 33261, "offset": o[1], "chunkSize": 3000, "xattrs": {"user.a": "AAE="},
             "digest": digest_of(&data), "chunkDigest": digest_of(&data)},
        ]})
    });
    let source = MemSource(blob);
    let layer = EstargzLayer::open(&source, None).unwrap();
    let e = layer.entries();
    assert_eq!(e.len(), 3);
    assert_eq!((e[0].path.as_str(), e[0].kind), ("", EntryKind::Dir));
    assert_eq!(e[1].path, "bin");
    assert_eq!(e[1].uname, "root");
    assert_eq!(e[1].mode, 0o755);
    assert_eq!(e[1].mtime, 1_566_297_043);
    assert_eq!(e[2].mode, 0o755);
    assert_eq!(e[2].xattrs.get("user.a"), Some(&vec![0u8, 1]));
    let mut buf = vec![0u8; 3000];
    assert_eq!(layer.read_at(&source, 2, 0, &mut buf).unwrap(), 3000);
    assert_eq!(buf, data);
}

/// Checks a blob made by stargz-snapshotter's own writer: it opens with its TOC digest
/// annotation, every file reads back as the gzip stream has it, and, given the layer it
/// was made from, ferry's conversion of that layer describes exactly the same entries.
fn check_stargz_blob(blob: &[u8], toc: Option<&str>, source_tar: Option<&[u8]>) {
    let source = MemSource(blob.to_vec());
    let layer = EstargzLayer::open(&source, toc).unwrap();
    let mut tar = Vec::new();
    MultiGzDecoder::new(blob).read_to_end(&mut tar).unwrap();
    let want: HashMap<String, Vec<u8>> = crate::tarwalk::walk_all(&tar)
        .into_iter()
        .filter(|(e, _)| e.kind == EntryKind::File)
        .map(|(e, d)| (e.path, d))
        .collect();
    let mut files = 0;
    for (idx, e) in layer.entries().iter().enumerate() {
        let path = match e.kind {
            EntryKind::File => &e.path,
            EntryKind::Hardlink => &e.link_target,
            _ => continue,
        };
        let mut buf = vec![0u8; want[path].len() + 1];
        let n = layer.read_at(&source, idx, 0, &mut buf).unwrap();
        assert_eq!(&buf[..n], &want[path][..], "{}", e.path);
        files += 1;
    }
    assert!(files > 0);
    if let Some(src) = source_tar {
        let (ours, out) = convert_bytes(src, &EstargzOptions::default());
        let mine = EstargzLayer::open(&MemSource(ours), Some(&out.toc_digest)).unwrap();
        assert_eq!(mine.entries(), layer.entries());
        assert_eq!(mine.prefetch_paths(), layer.prefetch_paths());
        let expected = crate::tarwalk::walk_all(src);
        for (got, (want, _)) in layer.entries().iter().zip(&expected) {
            assert_eq!(got, &toc_view(want));
        }
    }
}

/// `testdata/ctr-remote-estargz.tar.gz` is `testdata/source-layer.tar.gz` converted by
/// `ctr-remote image optimize --no-optimize --oci` (stargz-snapshotter, default chunk
/// size and level); its descriptor carried these annotations.
#[test]
fn reads_ctr_remote_fixture() {
    const BLOB: &[u8] = include_bytes!("testdata/ctr-remote-estargz.tar.gz");
    const SOURCE: &[u8] = include_bytes!("testdata/source-layer.tar.gz");
    const TOC: &str = "sha256:c42aaa88c24f3e66072b7843d8bee61a347437214dcafbcfa346c082296a5137";
    const USIZE: u64 = 5_588_480;
    let mut tar = Vec::new();
    MultiGzDecoder::new(BLOB).read_to_end(&mut tar).unwrap();
    assert_eq!(tar.len() as u64, USIZE);
    let mut src = Vec::new();
    MultiGzDecoder::new(SOURCE).read_to_end(&mut src).unwrap();
    check_stargz_blob(BLOB, Some(TOC), Some(&src));
    let layer = EstargzLayer::open(&MemSource(BLOB.to_vec()), Some(TOC)).unwrap();
    let big = layer
        .entries()
        .iter()
        .position(|e| e.path == "big.txt")
        .unwrap();
    // Two chunks: a read across the 4 MiB boundary needs both members.
    assert_eq!(layer.ranges_for(big, (4 << 20) - 10, 20).len(), 1);
    assert!(layer.ranges_for(big, 0, 10)[0].end < layer.ranges_for(big, 4 << 20, 10)[0].end);
    let hard = layer
        .entries()
        .iter()
        .find(|e| e.path == "d/sub/hard")
        .unwrap();
    assert_eq!(
        (hard.kind, hard.link_target.as_str()),
        (EntryKind::Hardlink, "d/hello.txt")
    );
    let hello = layer
        .entries()
        .iter()
        .find(|e| e.path == "d/hello.txt")
        .unwrap();
    assert_eq!(hello.xattrs.get("user.comment"), Some(&b"v1".to_vec()));
}

/// Another stargz-made blob given through `FERRY_ESTARGZ_FIXTURE` (path),
/// `FERRY_ESTARGZ_FIXTURE_TOC` (its TOC digest annotation) and `FERRY_ESTARGZ_FIXTURE_SRC`
/// (the uncompressed layer it was made from), all optional but the first.
#[test]
fn reads_stargz_snapshotter_blob() {
    let Ok(path) = std::env::var("FERRY_ESTARGZ_FIXTURE") else {
        return;
    };
    let blob = std::fs::read(path).unwrap();
    let toc = std::env::var("FERRY_ESTARGZ_FIXTURE_TOC").ok();
    let src = std::env::var("FERRY_ESTARGZ_FIXTURE_SRC")
        .ok()
        .map(|p| std::fs::read(p).unwrap());
    check_stargz_blob(&blob, toc.as_deref(), src.as_deref());
}

/// Conversion speed on a real tar: `FERRY_ESTARGZ_BENCH_TAR=/path/layer.tar cargo test
/// --release -p ferry-index --lib estargz::tests::bench_convert -- --ignored --nocapture`
/// (`FERRY_ESTARGZ_BENCH_LEVEL` picks the gzip level).
#[test]
#[ignore]
fn bench_convert() {
    let Ok(path) = std::env::var("FERRY_ESTARGZ_BENCH_TAR") else {
        return;
    };
    let level = std::env::var("FERRY_ESTARGZ_BENCH_LEVEL")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(DEFAULT_LEVEL);
    let len = std::fs::metadata(&path).unwrap().len();
    let gz = path.ends_with(".gz") || !path.contains(".tar");
    let mut open = || {
        let f = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(&path)?);
        Ok(if gz {
            Box::new(MultiGzDecoder::new(f)) as Box<dyn Read + Send>
        } else {
            Box::new(f) as Box<dyn Read + Send>
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let out_path = std::env::var("FERRY_ESTARGZ_BENCH_OUT")
        .map_or_else(|_| dir.path().join("out.tar.gz"), std::path::PathBuf::from);
    let start = std::time::Instant::now();
    let out = convert(
        &mut open,
        std::fs::File::create(&out_path).unwrap(),
        &EstargzOptions {
            level,
            ..EstargzOptions::default()
        },
    )
    .unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "level {level}: {len} bytes -> {} bytes ({:.1}%) in {secs:.2}s: {:.1} MB/s",
        out.size,
        100.0 * out.size as f64 / len as f64,
        len as f64 / secs / 1e6
    );
    if std::env::var("FERRY_ESTARGZ_BENCH_NOREAD").is_ok() {
        return;
    }
    let source = crate::source::FileSource::open(&out_path).unwrap();
    let start = std::time::Instant::now();
    let layer = EstargzLayer::open(&source, Some(&out.toc_digest)).unwrap();
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (idx, e) in layer.entries().iter().enumerate() {
        if e.kind == EntryKind::File {
            let mut off = 0;
            while off < e.size {
                let n = layer.read_at(&source, idx, off, &mut buf).unwrap();
                off += n as u64;
                total += n as u64;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "read back {total} bytes of {} entries in {secs:.2}s: {:.1} MB/s",
        layer.entries().len(),
        total as f64 / secs / 1e6
    );
}

/// Single-thread costs of the pieces of a conversion (`FERRY_ESTARGZ_BENCH_TAR`).
#[test]
#[ignore]
fn bench_pieces() {
    let Ok(path) = std::env::var("FERRY_ESTARGZ_BENCH_TAR") else {
        return;
    };
    let data = std::fs::read(&path).unwrap();
    let data = &data[..data.len().min(64 << 20)];
    let mb = data.len() as f64 / 1e6;
    let t = std::time::Instant::now();
    let _ = Sha256::digest(data);
    println!("sha256: {:.0} MB/s", mb / t.elapsed().as_secs_f64());
    for level in [1, 4, 6] {
        let t = std::time::Instant::now();
        let mut out = 0;
        for c in data.chunks(4 << 20) {
            out += gzip(level, c).unwrap().len();
        }
        println!(
            "libdeflate {level}: {:.0} MB/s ({:.1}%)",
            mb / t.elapsed().as_secs_f64(),
            100.0 * out as f64 / data.len() as f64
        );
    }
    let gz = gzip(6, data).unwrap();
    let t = std::time::Instant::now();
    let mut v = Vec::new();
    GzDecoder::new(&gz[..]).read_to_end(&mut v).unwrap();
    println!(
        "inflate (flate2): {:.0} MB/s",
        mb / t.elapsed().as_secs_f64()
    );
    let t = std::time::Instant::now();
    let mut w = TarWalker::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
    let mut n = 0;
    let mut buf = vec![0u8; 1 << 20];
    while let Some(_e) = w.next_entry().unwrap() {
        loop {
            let k = w.read(&mut buf).unwrap();
            if k == 0 {
                break;
            }
            n += k;
        }
    }
    println!(
        "tarwalk read: {:.0} MB/s",
        n as f64 / 1e6 / t.elapsed().as_secs_f64()
    );
}

/// Writes the seed corpus of `fuzz/fuzz_targets/estargz.rs` into `FERRY_ESTARGZ_SEEDS`.
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let Ok(dir) = std::env::var("FERRY_ESTARGZ_SEEDS") else {
        return;
    };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).unwrap();
    let put = |name: &str, mode: u8, body: &[u8]| {
        let mut v = vec![mode];
        v.extend_from_slice(body);
        std::fs::write(dir.join(name), v).unwrap();
    };
    // Mode 0: whole blobs.
    let tiny = build_tar(&[
        TNode::new(".", Node::Dir),
        TNode::new("a", Node::Dir),
        TNode::new("a/f", Node::File(b"hello world\n".repeat(30))),
        TNode::new("a/l", Node::Hardlink("a/f".into())),
        TNode::new("s", Node::Symlink("a/f".into())),
        TNode::new("e", Node::File(Vec::new())),
    ]);
    let (blob, _) = convert_bytes(
        &tiny,
        &EstargzOptions {
            chunk_size: 100,
            ..EstargzOptions::default()
        },
    );
    put("blob-ferry", 0, &blob);
    let (blob, _) = convert_bytes(
        &tiny,
        &EstargzOptions {
            priority: vec!["s".into(), "a/l".into()],
            ..EstargzOptions::default()
        },
    );
    put("blob-ferry-priority", 0, &blob);
    put(
        "blob-ctr-remote",
        0,
        include_bytes!("testdata/ctr-remote-estargz.tar.gz"),
    );
    // Mode 1: data + TOC JSON (the layout `wrap_toc` in the fuzz target builds: up to four
    // stored members of about equal size, the first at offset 0).
    let stored = |n: u64| 10 + 5 * n.div_ceil(65_535).max(1) + n + 8;
    let payload: Vec<u8> = (0..1000u32).map(|i| (i % 97) as u8).collect();
    let m1 = stored(500);
    let json = serde_json::json!({"version": 1, "entries": [
        {"name": "d/", "type": "dir", "mode": 493, "userName": "root"},
        {"name": "d/a", "type": "reg", "size": 200, "offset": 0, "innerOffset": 100, "chunkDigest": digest_of(&payload[100..300])},
        {"name": "d/b", "type": "reg", "size": 1000, "offset": 0, "chunkSize": 500, "chunkDigest": digest_of(&payload[..500]), "modtime": "2020-01-01T00:00:00Z"},
        {"name": "d/b", "type": "chunk", "offset": m1, "chunkOffset": 500, "chunkDigest": digest_of(&payload[500..])},
        {"name": "d/h", "type": "hardlink", "linkName": "d/b"},
        {"name": "d/c", "type": "char", "devMajor": 1, "devMinor": 3, "xattrs": {"user.x": "AAE="}},
    ]});
    let mut body = (payload.len() as u16).to_le_bytes().to_vec();
    body.extend_from_slice(&payload);
    body.extend_from_slice(&serde_json::to_vec(&json).unwrap());
    put("toc-json", 1, &body);
    // Mode 2: tars to convert (chunk size 7 or 512, levels 1 and 6).
    put("tar-tiny", 2 | (1 << 2) | (1 << 4), &tiny);
    let odd = build_tar(
        &random_tree(77, 12, 600)
            .into_iter()
            .map(|mut n| {
                if let Node::File(d) = &mut n.node {
                    d.truncate(1500);
                }
                n
            })
            .collect::<Vec<_>>(),
    );
    put("tar-random", 2 | (2 << 2) | (6 << 4), &odd);
}

// ---------------------------------------------------------------------------------------
// zstd:chunked

fn zstd_chunked_bytes(tar: &[u8], chunk: u64) -> (Vec<u8>, zstd_chunked::ZstdChunkedOutput) {
    let mut blob = Vec::new();
    let opts = zstd_chunked::ZstdChunkedOptions {
        chunk_size: chunk,
        level: 3,
    };
    let out = zstd_chunked::convert(&mut Cursor::new(tar), &mut blob, &opts).unwrap();
    (blob, out)
}

#[test]
fn zstd_chunked_round_trip_random_trees() {
    for (seed, chunk) in [(11u64, 1000u64), (12, 4096), (13, 1), (14, 64 << 10)] {
        let n = if chunk == 1 { 30 } else { 100 };
        let nodes = random_tree(seed, n, chunk.max(16));
        let tar = build_tar(&nodes);
        let expected = crate::tarwalk::walk_all(&tar);
        let (blob, out) = zstd_chunked_bytes(&tar, chunk);
        assert_eq!(out.size, blob.len() as u64);
        assert_eq!(out.digest, sha256_string(&Sha256::digest(&blob).into()));
        // Any zstd reader sees the tar (the skippable frames are skipped), and the
        // strict walker reads the same entries and bytes from it.
        let plain = zstd::stream::decode_all(&blob[..]).unwrap();
        assert_eq!(out.diff_id, sha256_string(&Sha256::digest(&plain).into()));
        let written = crate::tarwalk::walk_all(&plain);
        assert_eq!(written.len(), expected.len());
        for ((got, gd), (want, wd)) in written.iter().zip(&expected) {
            assert_eq!(no_offsets(got), no_offsets(want));
            assert_eq!(gd, wd);
        }
        // Opened lazily, by the annotation's position and by the footer alone.
        let source = MemSource(blob.clone());
        let position = out.manifest_position.text();
        for pos in [Some(position.as_str()), None] {
            let layer =
                EstargzLayer::open_zstd_chunked(&source, &out.manifest_checksum, pos).unwrap();
            assert_eq!(layer.codec(), Codec::Zstd);
            assert_eq!(layer.format_name(), "zstd:chunked");
            assert_eq!(layer.toc_digest(), out.manifest_checksum);
            let entries = layer.entries();
            assert_eq!(entries.len(), expected.len());
            for (got, (want, _)) in entries.iter().zip(&expected) {
                assert_eq!(got, &toc_view(want));
            }
            check_reads(&layer, &blob, &expected, seed);
        }
    }
}

#[test]
fn zstd_chunked_reads_fetch_only_the_file_frames() {
    let big = Rng(7).bytes(50_000);
    let small = b"hello".to_vec();
    let nodes = vec![
        TNode {
            path: "a".into(),
            node: Node::File(big.clone()),
            mode: 0o644,
            uid: 0,
            mtime: 1,
            nsec: None,
            xattrs: Vec::new(),
        },
        TNode {
            path: "b".into(),
            node: Node::File(small.clone()),
            mode: 0o644,
            uid: 0,
            mtime: 1,
            nsec: None,
            xattrs: Vec::new(),
        },
    ];
    let tar = build_tar(&nodes);
    let (blob, out) = zstd_chunked_bytes(&tar, 8192);
    let source = CountingSource::new(MemSource(blob.clone()));
    let layer = EstargzLayer::open_zstd_chunked(&source, &out.manifest_checksum, None).unwrap();
    let b = layer.entries().iter().position(|e| e.path == "b").unwrap();
    let a = layer.entries().iter().position(|e| e.path == "a").unwrap();
    let before = source.bytes_read();
    let mut buf = [0u8; 16];
    assert_eq!(layer.read_at(&source, b, 0, &mut buf).unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
    // One frame of a few bytes, not the big file's frames before it.
    let fetched = source.bytes_read() - before;
    assert!(fetched < 100, "fetched {fetched} bytes for a 5-byte file");
    // A read inside the big file fetches the one chunk it touches.
    let before = source.bytes_read();
    let mut buf = vec![0u8; 100];
    layer.read_at(&source, a, 20_000, &mut buf).unwrap();
    assert_eq!(&buf[..], &big[20_000..20_100]);
    let fetched = source.bytes_read() - before;
    assert!(fetched < 8192 + 64, "fetched {fetched} bytes for one chunk");
}

#[test]
fn zstd_chunked_refuses_what_it_cannot_trust() {
    let nodes = random_tree(21, 40, 500);
    let tar = build_tar(&nodes);
    let (blob, out) = zstd_chunked_bytes(&tar, 500);
    let source = MemSource(blob.clone());
    // A checksum that is not the TOC's.
    let wrong = sha256_string(&Sha256::digest(b"another").into());
    assert!(matches!(
        EstargzLayer::open_zstd_chunked(&source, &wrong, None),
        Err(Error::DigestMismatch { .. })
    ));
    // Positions outside the blob, of another type, or not numbers.
    for pos in [
        format!("{}:10:10:1", blob.len()),
        "8:5:5:2".to_string(),
        "a:b:c:1".to_string(),
        "1:2".to_string(),
        format!("8:{}:10:1", u64::MAX),
    ] {
        assert!(
            EstargzLayer::open_zstd_chunked(&source, &out.manifest_checksum, Some(&pos)).is_err(),
            "{pos}"
        );
    }
    // No footer: a blob cut short.
    let cut = MemSource(blob[..blob.len() - 10].to_vec());
    assert!(EstargzLayer::open_zstd_chunked(&cut, &out.manifest_checksum, None).is_err());
    // A corrupted data byte is never served: every read fails or returns the truth.
    let expected = crate::tarwalk::walk_all(&tar);
    let files: Vec<&(Entry, Vec<u8>)> = expected
        .iter()
        .filter(|(e, d)| e.kind == EntryKind::File && !d.is_empty())
        .collect();
    let toc_start = out.manifest_position.offset as usize - 8;
    for at in (0..toc_start).step_by(97) {
        let mut bad = blob.clone();
        bad[at] ^= 0x5a;
        let source = MemSource(bad);
        let layer = EstargzLayer::open_zstd_chunked(&source, &out.manifest_checksum, None).unwrap();
        for (e, data) in &files {
            let idx = layer
                .entries()
                .iter()
                .position(|x| x.path == e.path)
                .unwrap();
            let mut buf = vec![0u8; data.len()];
            if let Ok(n) = layer.read_at(&source, idx, 0, &mut buf) {
                assert_eq!(&buf[..n], &data[..], "{} with byte {at} flipped", e.path);
            }
        }
    }
}

#[test]
fn zstd_chunked_footers_and_positions_parse() {
    let p = zstd_chunked::ManifestPosition {
        offset: 1234,
        length: 99,
        uncompressed: 4321,
    };
    assert_eq!(p.text(), "1234:99:4321:1");
    assert_eq!(zstd_chunked::ManifestPosition::parse(&p.text()).unwrap(), p);
    assert_eq!(
        zstd_chunked::ManifestPosition::parse("1234:99:4321").unwrap(),
        p
    );
    let footer = zstd_chunked::footer_bytes(&p);
    let mut tail = vec![7u8; 30];
    tail.extend_from_slice(&footer);
    assert_eq!(zstd_chunked::parse_footer(&tail).unwrap(), p);
    // The older 48-byte footer: four numbers and the magic.
    let mut old = Vec::new();
    old.extend_from_slice(&zstd_chunked::SKIPPABLE_MAGIC.to_le_bytes());
    old.extend_from_slice(&40u32.to_le_bytes());
    for v in [1234u64, 99, 4321, 1] {
        old.extend_from_slice(&v.to_le_bytes());
    }
    old.extend_from_slice(zstd_chunked::FOOTER_MAGIC);
    assert_eq!(zstd_chunked::parse_footer(&old).unwrap(), p);
    // Not a footer: wrong magic, wrong type, too short.
    let mut bad = footer;
    bad[70] ^= 1;
    assert!(zstd_chunked::parse_footer(&bad).is_err());
    let mut bad = footer;
    bad[32] = 2;
    assert!(zstd_chunked::parse_footer(&bad).is_err());
    assert!(zstd_chunked::parse_footer(&footer[..20]).is_err());
}

#[test]
fn zstd_chunked_batches_larger_than_one_flush_keep_offsets() {
    // More than one batch of frames (32 MiB): offsets set by later flushes must still
    // point at the right frames.
    let big: Vec<u8> = (0..36u32 << 20)
        .map(|i| (i % 251) as u8 ^ (i >> 20) as u8)
        .collect();
    let node = |path: &str, data: Vec<u8>| TNode {
        path: path.into(),
        node: Node::File(data),
        mode: 0o644,
        uid: 0,
        mtime: 1,
        nsec: None,
        xattrs: Vec::new(),
    };
    let tar = build_tar(&[node("big", big.clone()), node("after", b"tail".to_vec())]);
    let (blob, out) = zstd_chunked_bytes(&tar, 4 << 20);
    let source = MemSource(blob);
    let layer = EstargzLayer::open_zstd_chunked(&source, &out.manifest_checksum, None).unwrap();
    let idx = |p: &str| layer.entries().iter().position(|e| e.path == p).unwrap();
    let mut buf = vec![0u8; 1000];
    for off in [0u64, (4 << 20) - 10, 33 << 20, (36 << 20) - 1000] {
        let n = layer.read_at(&source, idx("big"), off, &mut buf).unwrap();
        assert_eq!(&buf[..n], &big[off as usize..off as usize + n], "at {off}");
    }
    let n = layer.read_at(&source, idx("after"), 0, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"tail");
}
