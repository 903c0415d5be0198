//! Property test of the whole format stack: random file trees (every entry kind, long
//! names, xattrs, hard links, whiteouts across layers) → tar → gzip at several levels and
//! member layouts → ferry index (encoded and decoded again, windows inline or split into
//! a windows blob) → every file read at random offsets through the merged view equals the
//! original.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use ferry_index::entry::EntryKind;
use ferry_index::ferryidx::LayerIndex;
use ferry_index::indexer::{index_gzip, index_tar};
use ferry_index::inflated::InflatedSpans;
use ferry_index::merged::MergedImage;
use ferry_index::reader::{LayerFormat, LayerReader};
use ferry_index::source::{CountingSource, MemSource, RangeSource};
use ferry_index::windows::BlobWindows;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Node {
    File(Vec<u8>),
    Symlink(String),
    Dir,
    Fifo,
    Char(u32, u32),
    Whiteout,
}

#[derive(Debug, Clone)]
struct Layer {
    nodes: BTreeMap<String, Node>,
    hardlinks: Vec<(String, String)>,
    opaque: Vec<String>,
    xattr: Option<(String, Vec<u8>)>,
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z]{1,8}",
        "[a-z]{90,130}", // around the 100-byte ustar name limit
    ]
}

fn content() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2000),
        (1usize..300_000, any::<u8>())
            .prop_map(|(n, seed)| (0..n).map(|i| ((i / 7) as u8).wrapping_add(seed)).collect()),
        (1usize..200_000).prop_map(|n| {
            // Incompressible but deterministic bytes.
            let mut x: u32 = n as u32 | 1;
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect()
        }),
    ]
}

fn node() -> impl Strategy<Value = Node> {
    prop_oneof![
        6 => content().prop_map(Node::File),
        1 => "[a-z/.]{1,20}".prop_map(Node::Symlink),
        1 => Just(Node::Dir),
        1 => Just(Node::Fifo),
        1 => (0u32..300, 0u32..300).prop_map(|(a, b)| Node::Char(a, b)),
    ]
}

fn layer(upper: bool) -> impl Strategy<Value = Layer> {
    (
        prop::collection::btree_map(
            (
                prop::sample::select(vec!["", "d1/", "d2/", "d1/sub/"]),
                name(),
            )
                .prop_map(|(d, n)| format!("{d}{n}")),
            node(),
            1..12,
        ),
        any::<bool>(),
        prop::option::of((
            "user\\.[a-z]{1,6}",
            prop::collection::vec(any::<u8>(), 0..20),
        )),
        prop::collection::vec(name(), 0..3),
    )
        .prop_map(move |(mut nodes, opaque, xattr, wh)| {
            let mut hardlinks = Vec::new();
            if let Some(first_file) = nodes
                .iter()
                .find(|(_, n)| matches!(n, Node::File(_)))
                .map(|(k, _)| k.clone())
            {
                hardlinks.push((format!("{first_file}.link"), first_file));
            }
            let mut opaque_dirs = Vec::new();
            if upper {
                for w in wh {
                    nodes.insert(format!("d1/{w}"), Node::Whiteout);
                }
                if opaque {
                    opaque_dirs.push("d2".to_string());
                }
            }
            Layer {
                nodes,
                hardlinks,
                opaque: opaque_dirs,
                xattr,
            }
        })
}

fn header(kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(0o644);
    h.set_mtime(1_700_000_000);
    h
}

/// Writes a layer as a tar stream; parents are written as directories.
fn write_tar(l: &Layer) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for d in ["d1", "d2", "d1/sub"] {
        let mut h = header(tar::EntryType::Directory, 0);
        h.set_mode(0o755);
        b.append_data(&mut h, d, std::io::empty()).expect("dir");
    }
    for d in &l.opaque {
        let mut h = header(tar::EntryType::Regular, 0);
        b.append_data(&mut h, format!("{d}/.wh..wh..opq"), std::io::empty())
            .expect("opq");
    }
    for (path, n) in &l.nodes {
        match n {
            Node::File(data) => {
                if let Some((k, v)) = &l.xattr {
                    let key = format!("SCHILY.xattr.{k}");
                    b.append_pax_extensions([(key.as_str(), v.as_slice())])
                        .expect("pax");
                }
                let mut h = header(tar::EntryType::Regular, data.len() as u64);
                b.append_data(&mut h, path, &data[..]).expect("file");
            }
            Node::Symlink(t) => {
                let mut h = header(tar::EntryType::Symlink, 0);
                b.append_link(&mut h, path, t).expect("symlink");
            }
            Node::Dir => {
                let mut h = header(tar::EntryType::Directory, 0);
                b.append_data(&mut h, path, std::io::empty()).expect("dir");
            }
            Node::Fifo => {
                let mut h = header(tar::EntryType::Fifo, 0);
                b.append_data(&mut h, path, std::io::empty()).expect("fifo");
            }
            Node::Char(ma, mi) => {
                let mut h = header(tar::EntryType::Char, 0);
                h.set_device_major(*ma).expect("major");
                h.set_device_minor(*mi).expect("minor");
                b.append_data(&mut h, path, std::io::empty()).expect("char");
            }
            Node::Whiteout => {
                let (dir, base) = path.rsplit_once('/').unwrap_or(("", path));
                let wh = if dir.is_empty() {
                    format!(".wh.{base}")
                } else {
                    format!("{dir}/.wh.{base}")
                };
                let mut h = header(tar::EntryType::Regular, 0);
                b.append_data(&mut h, wh, std::io::empty())
                    .expect("whiteout");
            }
        }
    }
    for (link, target) in &l.hardlinks {
        let mut h = header(tar::EntryType::Link, 0);
        b.append_link(&mut h, link, target).expect("hardlink");
    }
    b.into_inner().expect("tar")
}

/// gzip with a level and a member layout: one member, or a new member every `cut` bytes.
fn gzip(data: &[u8], level: u32, cut: Option<usize>) -> Vec<u8> {
    let mut out = Vec::new();
    let pieces: Vec<&[u8]> = match cut {
        Some(c) => data.chunks(c.max(1)).collect(),
        None => vec![data],
    };
    for p in pieces {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
        e.write_all(p).expect("gzip");
        out.extend(e.finish().expect("gzip"));
    }
    out
}

/// The expected merged view: path → file bytes (regular files only, hard links resolved).
fn expected(layers: &[Layer]) -> BTreeMap<String, Vec<u8>> {
    let mut all: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    for l in layers {
        for d in &l.opaque {
            all.retain(|k, _| !k.starts_with(&format!("{d}/")));
        }
        for (p, n) in &l.nodes {
            if let Node::Whiteout = n {
                all.retain(|k, _| k != p && !k.starts_with(&format!("{p}/")));
            }
        }
        for (p, n) in &l.nodes {
            match n {
                Node::Whiteout => {}
                Node::File(d) => {
                    all.retain(|k, _| !k.starts_with(&format!("{p}/")));
                    all.insert(p.clone(), Some(d.clone()));
                }
                Node::Dir => {
                    all.entry(p.clone()).or_insert(None);
                }
                _ => {
                    all.retain(|k, _| !k.starts_with(&format!("{p}/")));
                    all.insert(p.clone(), None);
                }
            }
        }
        for (link, target) in &l.hardlinks {
            if let Some(Node::File(d)) = l.nodes.get(target) {
                all.insert(link.clone(), Some(d.clone()));
            }
        }
    }
    all.into_iter()
        .filter_map(|(k, v)| v.map(|d| (k, d)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    #[test]
    fn every_file_reads_back_at_random_offsets(
        lower in layer(false),
        upper in layer(true),
        level in prop::sample::select(vec![0u32, 1, 6, 9]),
        cut in prop::option::of(1000usize..200_000),
        plain in any::<bool>(),
        span in prop::sample::select(vec![64u64 << 10, 256 << 10, 4 << 20]),
        probes in prop::collection::vec((any::<u64>(), 0usize..70_000), 8),
        split in any::<bool>(),
        inflated in prop::sample::select(vec![0usize, 300 << 10, 64 << 20]),
    ) {
        let layers = vec![lower, upper];
        // One cache for both layers (0: none), small enough at 300 KiB to evict.
        let cache = (inflated > 0).then(|| InflatedSpans::new(inflated));
        let mut readers = Vec::new();
        let mut counters = Vec::new();
        for l in &layers {
            let tar = write_tar(l);
            let (index, blob) = if plain {
                (index_tar(&tar[..], span, None).expect("index tar"), tar)
            } else {
                let gz = gzip(&tar, level, cut);
                (index_gzip(&gz[..], span, None).expect("index gzip"), gz)
            };
            let mut index = index;
            let windows = if split { index.split_windows() } else { Vec::new() };
            let decoded = LayerIndex::decode(&index.encode().expect("encode")).expect("decode");
            prop_assert_eq!(&decoded, &index);
            prop_assert_eq!(decoded.encode().expect("encode"), index.encode().expect("encode"));
            let src = Arc::new(CountingSource::new(MemSource(blob)));
            counters.push(src.clone());
            let has_windows = decoded.windows.is_some();
            let mut reader = LayerReader::new(LayerFormat::Indexed(Arc::new(decoded)), src as Arc<dyn RangeSource>);
            if has_windows {
                // Alternate local and fetched-alongside windows.
                reader = reader.with_windows(Arc::new(BlobWindows::new(Arc::new(MemSource(windows)), level % 2 == 0)));
            }
            if let Some(cache) = &cache {
                reader = reader.with_inflated_cache(cache.clone());
            }
            readers.push(reader);
        }
        let image = MergedImage::new(readers);
        let want = expected(&layers);
        for (path, data) in &want {
            let mut got = Vec::new();
            image.cat(path, &mut got).map_err(|e| TestCaseError::fail(format!("{path}: {e}")))?;
            prop_assert!(got == *data, "content of {} differs", path);
            let loc = image.data_location(image.lookup(path, false).expect("lookup")).expect("data");
            let layer = &image.layers()[loc.layer];
            for (off, len) in &probes {
                let off = if data.is_empty() { 0 } else { off % data.len() as u64 };
                let mut buf = vec![0u8; *len];
                let n = layer.read_at(loc.entry, off, &mut buf).expect("read_at");
                let end = (off as usize + len).min(data.len());
                prop_assert_eq!(&buf[..n], &data[off as usize..end]);
            }
        }
        // Every merged regular file exists in the expectation and vice versa.
        let merged_files: Vec<&String> = image
            .table()
            .iter()
            .filter(|(_, loc)| image.entry(**loc).is_some_and(|e| matches!(e.kind, EntryKind::File | EntryKind::Hardlink)))
            .map(|(p, _)| p)
            .collect();
        prop_assert_eq!(merged_files, want.keys().collect::<Vec<_>>());
    }
}

/// A 4 KiB read from a big indexed layer fetches at most the spans holding it.
#[test]
fn small_read_costs_at_most_one_span_plus_overlap() {
    let data: Vec<u8> = (0..8_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8 ^ (i / 1000) as u8)
        .collect();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(tar::EntryType::Regular, data.len() as u64);
    b.append_data(&mut h, "big", &data[..]).expect("file");
    let tar = b.into_inner().expect("tar");
    let gz = gzip(&tar, 6, None);
    let span = 1 << 20;
    let index = Arc::new(index_gzip(&gz[..], span, None).expect("index"));
    let max_span = (0..index.checkpoints.len())
        .filter_map(|i| index.span_range(i))
        .map(|r| r.end - r.start)
        .max()
        .unwrap_or(0);
    let src = Arc::new(CountingSource::new(MemSource(gz)));
    let reader = LayerReader::new(
        LayerFormat::Indexed(index),
        src.clone() as Arc<dyn RangeSource>,
    );
    for off in [0u64, 1_000_000, 4_194_300, 7_990_000] {
        let before = src.bytes_read();
        let mut buf = vec![0u8; 4096];
        let n = reader.read_at(0, off, &mut buf).expect("read");
        assert_eq!(&buf[..n], &data[off as usize..off as usize + n]);
        let cost = src.bytes_read() - before;
        assert!(
            cost <= 2 * max_span,
            "read at {off} cost {cost}, spans are at most {max_span}"
        );
    }
}

/// Reads inside a span another read inflated moments ago copy from the inflated-span
/// cache: no fetch, no inflate. Readers of one layer through indexes with other span
/// sizes share the cache and never see each other's spans; whole-file copies pass by it.
#[test]
fn reads_inside_a_recently_inflated_span_copy_from_the_cache() {
    let (data, gz, _, _) = split_layer();
    let index64 = index_gzip(&gz[..], 64 << 10, None).expect("index");
    let index256 = index_gzip(&gz[..], 256 << 10, None).expect("index");
    let cache = InflatedSpans::new(8 << 20);
    let src = Arc::new(CountingSource::new(MemSource(gz.clone())));
    let reader = LayerReader::new(
        LayerFormat::Indexed(Arc::new(index64)),
        src.clone() as Arc<dyn RangeSource>,
    )
    .with_inflated_cache(cache.clone());
    let other = LayerReader::new(
        LayerFormat::Indexed(Arc::new(index256)),
        Arc::new(MemSource(gz)) as Arc<dyn RangeSource>,
    )
    .with_inflated_cache(cache.clone());
    let read = |r: &LayerReader, off: usize, len: usize| {
        let mut buf = vec![0u8; len];
        let n = r.read_at(0, off as u64, &mut buf).expect("read");
        assert_eq!(&buf[..n], &data[off..off + n], "bytes at {off}");
    };
    read(&reader, 200_000, 4096);
    let (fetched, requests) = (src.bytes_read(), src.requests());
    assert_eq!(cache.stats().hits, 0);
    // Neighbours in the same 64 KiB span: copied, nothing fetched.
    read(&reader, 200_000 + 5000, 4096);
    read(&reader, 200_000 - 3000, 100);
    assert_eq!((src.bytes_read(), src.requests()), (fetched, requests));
    assert_eq!(cache.stats().hits, 2);
    // The other index numbers its spans differently: its reads are its own.
    for off in [0, 100_000, 200_000, 350_000, 599_000] {
        read(&other, off, 1000);
        read(&reader, off, 1000);
    }
    // A read across spans keeps every span it inflated; a whole-file copy passes by.
    read(&reader, 400_000, 200_000);
    let inserts = cache.stats().inserts;
    let mut all = Vec::new();
    reader.copy_file(0, &mut all).expect("copy");
    assert!(all == data);
    assert_eq!(cache.stats().inserts, inserts);
    assert!(cache.stats().bytes <= 8 << 20);
}

/// A read inside one span inflates it only as far as the read goes (and a step
/// beyond), not the whole span: later reads further in continue the same inflater with
/// no fetch, earlier ones copy, and a span read to its end is kept whole.
#[test]
fn a_span_is_inflated_only_as_far_as_reads_go() {
    let (data, gz, _, _) = split_layer();
    let index = index_gzip(&gz[..], 1 << 20, None).expect("index");
    assert_eq!(index.checkpoints.len(), 1, "one span holds the whole file");
    let cache = InflatedSpans::new(16 << 20);
    let src = Arc::new(CountingSource::new(MemSource(gz)));
    let reader = LayerReader::new(
        LayerFormat::Indexed(Arc::new(index)),
        src.clone() as Arc<dyn RangeSource>,
    )
    .with_inflated_cache(cache.clone());
    let read = |off: usize, len: usize| {
        let mut buf = vec![0u8; len];
        let n = reader.read_at(0, off as u64, &mut buf).expect("read");
        assert_eq!(&buf[..n], &data[off..off + n], "bytes at {off}");
    };
    // The file starts 512 bytes into the layer, after its tar header.
    read(10_000, 4096);
    let first = cache.stats().inflated_bytes;
    assert!(
        (512 + 14_096..=512 + 14_096 + (64 << 10)).contains(&first),
        "inflated {first} bytes for a read ending at byte {}",
        512 + 14_096
    );
    let (fetched, requests) = (src.bytes_read(), src.requests());
    read(300_000, 4096);
    let second = cache.stats().inflated_bytes;
    assert!(
        second <= 512 + 304_096 + (64 << 10),
        "continued to {second} bytes"
    );
    read(100, 100);
    read(299_000, 5000);
    assert_eq!(cache.stats().inflated_bytes, second, "earlier bytes copy");
    assert_eq!((src.bytes_read(), src.requests()), (fetched, requests));
    // To the end, in pieces of every size, then the whole file once more.
    let mut off = 0;
    for (i, len) in [1, 4095, 70_000, 3, 200_000, 12_345]
        .iter()
        .cycle()
        .enumerate()
    {
        if off >= data.len() {
            break;
        }
        let len = (*len).min(data.len() - off);
        read(off, len);
        off += len + i % 7;
    }
    read(0, data.len());
    let whole = 512 + data.len() as u64;
    let total = cache.stats().inflated_bytes;
    // Once, to the end of the tar (its padding and end blocks follow the file).
    assert!(
        total >= data.len() as u64 && total <= whole + 4096,
        "{total}"
    );
    assert_eq!((src.bytes_read(), src.requests()), (fetched, requests));
}

/// Layers without an index (zstd, gzip, plain tar) are read whole and serve the same
/// bytes, with whiteouts applied across them.
#[test]
fn unindexed_layers_of_every_compression_read_whole() {
    use ferry_oci::media::LayerCompression;
    let mut lower = Layer {
        nodes: BTreeMap::new(),
        hardlinks: vec![],
        opaque: vec![],
        xattr: None,
    };
    lower
        .nodes
        .insert("d1/a".into(), Node::File(b"alpha".to_vec()));
    lower
        .nodes
        .insert("d1/gone".into(), Node::File(b"old".to_vec()));
    let mut upper = Layer {
        nodes: BTreeMap::new(),
        hardlinks: vec![],
        opaque: vec![],
        xattr: None,
    };
    upper.nodes.insert("d1/gone".into(), Node::Whiteout);
    upper
        .nodes
        .insert("d2/b".into(), Node::File(vec![7u8; 100_000]));
    for compression in [
        LayerCompression::None,
        LayerCompression::Gzip,
        LayerCompression::Zstd,
    ] {
        let readers: Vec<LayerReader> = [&lower, &upper]
            .iter()
            .map(|l| {
                let tar = write_tar(l);
                let blob = match compression {
                    LayerCompression::None => tar,
                    LayerCompression::Gzip => gzip(&tar, 6, None),
                    LayerCompression::Zstd => zstd::encode_all(&tar[..], 3).expect("zstd"),
                };
                LayerReader::whole(Arc::new(MemSource(blob)), compression).expect("whole layer")
            })
            .collect();
        let image = MergedImage::new(readers);
        let mut got = Vec::new();
        image.cat("/d1/a", &mut got).expect("cat a");
        assert_eq!(got, b"alpha");
        got.clear();
        image.cat("d2/b", &mut got).expect("cat b");
        assert_eq!(got, vec![7u8; 100_000]);
        assert!(
            image.cat("d1/gone", &mut Vec::new()).is_err(),
            "{compression:?}: whiteout not applied"
        );
    }
}

/// A flipped byte in a fetched span is caught by the span digest: the read fails and
/// never returns wrong bytes.
#[test]
fn corrupted_span_fails_the_read() {
    let data: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(tar::EntryType::Regular, data.len() as u64);
    b.append_data(&mut h, "f", &data[..]).expect("file");
    let tar = b.into_inner().expect("tar");
    let mut gz = gzip(&tar, 6, None);
    let index = Arc::new(index_gzip(&gz[..], 64 << 10, None).expect("index"));
    let mid = gz.len() / 2;
    gz[mid] ^= 0x40;
    let reader = LayerReader::new(LayerFormat::Indexed(index), Arc::new(MemSource(gz)));
    let mut all = Vec::new();
    let err = reader
        .copy_file(0, &mut all)
        .expect_err("corruption must be detected");
    assert!(
        matches!(err, ferry_index::Error::DigestMismatch { .. }),
        "{err}"
    );
}

/// A gzip layer of one 600 KB file with 64 KiB spans, its index split into index +
/// windows blob.
fn split_layer() -> (Vec<u8>, Vec<u8>, LayerIndex, Vec<u8>) {
    let data: Vec<u8> = (0..600_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 25) as u8 ^ (i / 3000) as u8)
        .collect();
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(tar::EntryType::Regular, data.len() as u64);
    b.append_data(&mut h, "f", &data[..]).expect("file");
    let tar = b.into_inner().expect("tar");
    let gz = gzip(&tar, 6, None);
    let mut index = index_gzip(&gz[..], 64 << 10, None).expect("index");
    let windows = index.split_windows();
    assert!(index.windows.is_some() && !windows.is_empty());
    (data, gz, index, windows)
}

/// The windows blob is read only for the windows a read needs, and counted.
#[test]
fn split_index_reads_fetch_only_the_windows_they_need() {
    let (data, gz, index, windows) = split_layer();
    let index = Arc::new(LayerIndex::decode(&index.encode().expect("encode")).expect("decode"));
    let win_src = Arc::new(CountingSource::new(MemSource(windows)));
    let reader = LayerReader::new(LayerFormat::Indexed(index.clone()), Arc::new(MemSource(gz)))
        .with_windows(Arc::new(BlobWindows::new(win_src.clone(), false)));
    let mid = 300_000u64;
    let mut buf = vec![0u8; 4096];
    let n = reader.read_at(0, mid, &mut buf).expect("read");
    assert_eq!(&buf[..n], &data[mid as usize..mid as usize + n]);
    let k = index.span_for(512 + mid).expect("span");
    let want = index.window_ref(k).map_or(0, |w| u64::from(w.len));
    assert!(want > 0, "a mid-stream checkpoint has a window");
    assert_eq!(win_src.bytes_read(), want, "exactly the one window");
    assert_eq!(win_src.requests(), 1);
    let mut all = Vec::new();
    reader.copy_file(0, &mut all).expect("whole file");
    assert!(all == data);
}

/// A window that does not hash to its reference fails the read; a reader without a
/// windows source fails clearly; neither returns bytes.
#[test]
fn corrupt_or_missing_window_fails_the_read() {
    let (_, gz, index, mut windows) = split_layer();
    let index = Arc::new(index);
    let last = windows.len() - 1;
    windows[last] ^= 1;
    let reader = LayerReader::new(
        LayerFormat::Indexed(index.clone()),
        Arc::new(MemSource(gz.clone())),
    )
    .with_windows(Arc::new(BlobWindows::new(
        Arc::new(MemSource(windows)),
        true,
    )));
    let mut buf = vec![0u8; 100];
    let near_end = index.checkpoints.last().expect("checkpoints").out_offset + 10 - 512;
    let err = reader
        .read_at(0, near_end, &mut buf)
        .expect_err("corrupt window");
    assert!(err.to_string().contains("window"), "{err}");
    let bare = LayerReader::new(LayerFormat::Indexed(index), Arc::new(MemSource(gz)));
    let err = bare
        .read_at(0, near_end, &mut buf)
        .expect_err("no windows source");
    assert!(err.to_string().contains("windows blob"), "{err}");
}

/// A tar of `files` (path, bytes) as regular files.
fn tar_of(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = header(tar::EntryType::Regular, data.len() as u64);
        tar.append_data(&mut h, path, &data[..]).expect("file");
    }
    tar.into_inner().expect("tar")
}

#[test]
fn indexing_records_each_elf_files_libraries_and_nothing_else() {
    use ferry_index::elf::test_program;
    let program = {
        let mut f = test_program(Some("/lib64/ld.so"), &["libfoo.so.1", "libc.so.6"], 300_000);
        f.resize(300_000, 7);
        f
    };
    let library = test_program(None, &["libbar.so"], 4096);
    // A static file: ELF, no interpreter, no `.dynamic` names.
    let static_file = test_program(None, &[], 4096);
    // ELF magic, then garbage: data, not an error.
    let mut garbage = b"\x7fELF".to_vec();
    garbage.resize(5000, 0xff);
    let mut truncated_headers = library.clone();
    truncated_headers.truncate(70);
    let files = [
        ("etc/motd", b"hello\n".to_vec()),
        ("usr/bin/prog", program),
        ("usr/lib/libfoo.so.1", library),
        ("usr/bin/static", static_file),
        ("data/garbage", garbage),
        ("data/short", truncated_headers),
    ];
    let tar = tar_of(&files);
    for index in [
        index_gzip(&gzip(&tar, 6, None)[..], 64 << 10, None).expect("gzip index"),
        index_tar(&tar[..], 64 << 10, None).expect("tar index"),
    ] {
        let recorded: Vec<(&str, &ferry_index::elf::Dependencies)> = index
            .libraries
            .iter()
            .map(|l| (index.entries[l.entry as usize].path.as_str(), &l.deps))
            .collect();
        assert_eq!(recorded.len(), 2, "{recorded:?}");
        assert_eq!(recorded[0].0, "usr/bin/prog");
        assert_eq!(recorded[0].1.interpreter.as_deref(), Some("/lib64/ld.so"));
        assert_eq!(recorded[0].1.needed, vec!["libfoo.so.1", "libc.so.6"]);
        assert_eq!((recorded[0].1.machine, recorded[0].1.wide), (62, true));
        assert_eq!(recorded[1].0, "usr/lib/libfoo.so.1");
        assert_eq!(recorded[1].1.needed, vec!["libbar.so"]);
        // The records survive the encoding.
        let mut split = index.clone();
        split.split_windows();
        let back = LayerIndex::decode(&split.encode().expect("encode")).expect("decode");
        assert_eq!(back.libraries, index.libraries);
        let n = index.entries.len();
        assert_eq!(n, files.len(), "every file is in the table");
    }
}
