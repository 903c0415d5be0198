//! Tests of fetching what belongs with a miss, over an in-memory backend that logs every
//! range asked of it and a real chunk store: a directory's small files come with its
//! first miss (nearest first, within the budget and the parent's subtree, never big
//! files),
//! a file's rest comes with its first miss (only when it is small enough), reads that do
//! not miss ask nothing, each directory asks once, and off is off.
#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_index::source::{MemSource, RangeSource};
use ferry_oci::layout::descriptor;
use ferry_oci::media::LAYER_TAR_GZIP;

use super::*;
use crate::device::FetchConfig;
use crate::device::tests::{indexed_gzip_layer, noise, open_store};
use crate::image::{ImageSource, LayerSpec, MountedImage, View};

#[derive(Default)]
struct LogBackend {
    blob: Vec<u8>,
    log: Mutex<Vec<Range<u64>>>,
}

impl RangeSource for LogBackend {
    fn len(&self) -> u64 {
        self.blob.len() as u64
    }

    fn read_range(&self, range: Range<u64>) -> std::io::Result<Vec<u8>> {
        self.log.lock().unwrap().push(range.clone());
        MemSource(self.blob.clone()).read_range(range)
    }
}

struct Rig {
    image: Arc<MountedImage>,
    backend: Arc<LogBackend>,
    _dir: tempfile::TempDir,
}

/// Files `app/pkg/m0`…`m7` (24 KiB each), `app/pkg/big` (1.5 MiB, over the neighbour
/// limit), `app/pkg/z0`…`z3` (24 KiB each, far from `m*` in the stream, after `big`),
/// `app/sub/s0` (24 KiB, in the subtree of `pkg`'s parent), `pad` (200 KiB), `other/x`
/// (24 KiB, outside it) and `lib.so` (600 KiB); spans of 64 KiB, no readahead.
fn rig(whole_file_bytes: u64, nearby_bytes: u64) -> Rig {
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..8 {
        files.push((format!("app/pkg/m{i}"), noise(24 << 10, 10 + i)));
    }
    files.push(("app/pkg/big".into(), noise(1536 << 10, 3)));
    for i in 0..4 {
        files.push((format!("app/pkg/z{i}"), noise(24 << 10, 30 + i)));
    }
    files.push(("app/sub/s0".into(), noise(24 << 10, 7)));
    // Keeps other/x out of s0's last span (fetches are whole spans).
    files.push(("pad".into(), noise(200 << 10, 6)));
    files.push(("other/x".into(), noise(24 << 10, 4)));
    files.push(("lib.so".into(), noise(600 << 10, 5)));
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
    let (blob, index) = indexed_gzip_layer(&named);
    let backend = Arc::new(LogBackend {
        blob: blob.clone(),
        ..Default::default()
    });
    let d = descriptor(
        LAYER_TAR_GZIP,
        ferry_oci::sha256_digest(&blob),
        blob.len() as u64,
        &[],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = FetchConfig {
        readahead_bytes: 0,
        whole_file_bytes,
        nearby_bytes,
        ..FetchConfig::default()
    };
    let source = ImageSource {
        manifest_digest: "sha256:test".into(),
        layers: vec![LayerSpec::new(d, Some(Arc::new(index)), backend.clone())],
    };
    let image = Arc::new(
        MountedImage::new(source, Some(open_store(dir.path())), config, &View::Merged).unwrap(),
    );
    Rig {
        image,
        backend,
        _dir: dir,
    }
}

impl Rig {
    /// Reads `len` bytes at `offset` of `path` as the FUSE read path does (nearby files
    /// asked first), then waits for the nearby fetches to land.
    fn read(&self, path: &str, offset: u64, len: usize) -> Vec<u8> {
        let ino = self.image.tree.resolve(path).unwrap();
        let node = self.image.tree.get(ino).unwrap();
        let loc = node.data.unwrap();
        self.image.read_nearby(ino, node, offset, len as u64);
        let mut buf = vec![0u8; len];
        let n = self.image.image.layers()[loc.layer]
            .read_at(loc.entry, offset, &mut buf)
            .unwrap();
        buf.truncate(n);
        assert!(
            wait_idle(Duration::from_secs(30)),
            "nearby fetches never finished"
        );
        buf
    }

    /// Whether some of `path`'s data is still missing from the store.
    fn missing(&self, path: &str) -> bool {
        let ino = self.image.tree.resolve(path).unwrap();
        let node = self.image.tree.get(ino).unwrap();
        let loc = node.data.unwrap();
        let source = self.image.layer_source(loc.layer).unwrap();
        self.image.image.layers()[loc.layer]
            .ranges_for(loc.entry, 0, node.size)
            .into_iter()
            .any(|r| source.range_missing(r))
    }

    fn calls(&self) -> usize {
        self.backend.log.lock().unwrap().len()
    }

    fn nearby_bytes(&self) -> u64 {
        self.image.stats.snapshot().bytes_nearby
    }
}

#[test]
fn a_miss_brings_the_small_files_of_its_directory() {
    let rig = rig(0, 4 << 20);
    rig.read("app/pkg/m3", 0, 100);
    for i in 0..8 {
        assert!(
            !rig.missing(&format!("app/pkg/m{i}")),
            "app/pkg/m{i} was not fetched"
        );
    }
    for i in 0..4 {
        assert!(
            !rig.missing(&format!("app/pkg/z{i}")),
            "app/pkg/z{i} was not fetched"
        );
    }
    assert!(
        rig.missing("app/pkg/big"),
        "a file over the neighbour limit came along"
    );
    assert!(
        rig.missing("other/x"),
        "another directory's file came along"
    );
    assert!(rig.missing("lib.so"));
    assert!(rig.nearby_bytes() > 0);
    // Reading the neighbours now costs no request.
    let before = rig.calls();
    for i in 0..8 {
        assert_eq!(
            rig.read(&format!("app/pkg/m{i}"), 0, 24 << 10).len(),
            24 << 10
        );
    }
    assert_eq!(rig.calls(), before, "a neighbour was fetched again");
}

#[test]
fn the_budget_takes_the_nearest_neighbours_first() {
    // About three 24 KiB files' spans: the ones next to m3 in the stream, not z*.
    let rig = rig(0, 100 << 10);
    rig.read("app/pkg/m3", 0, 100);
    assert!(
        !rig.missing("app/pkg/m2") || !rig.missing("app/pkg/m4"),
        "neither stream neighbour of m3 was fetched"
    );
    for i in 0..4 {
        assert!(
            rig.missing(&format!("app/pkg/z{i}")),
            "app/pkg/z{i} (far) came within a small budget"
        );
    }
    let stats = rig.image.stats.snapshot();
    assert!(
        stats.bytes_nearby <= 100 << 10,
        "nearby fetched {} bytes, over its budget",
        stats.bytes_nearby
    );
}

#[test]
fn a_directory_asks_once() {
    let rig = rig(0, 100 << 10);
    rig.read("app/pkg/m3", 0, 100);
    let after_first = rig.nearby_bytes();
    // z0 is still missing (outside the budget); its miss is in the same directory.
    assert!(rig.missing("app/pkg/z0"));
    rig.read("app/pkg/z0", 0, 100);
    assert_eq!(
        rig.nearby_bytes(),
        after_first,
        "the directory asked a second time"
    );
    assert!(rig.missing("app/pkg/z3"));
}

#[test]
fn a_miss_brings_the_rest_of_a_small_enough_file() {
    let rig_fn = rig;
    let rig = rig(1 << 20, 0);
    rig.read("lib.so", 0, 4096);
    assert!(!rig.missing("lib.so"), "the rest of lib.so was not fetched");
    assert!(
        rig.missing("app/pkg/m0"),
        "nearby files came while they are off"
    );
    let before = rig.calls();
    let data = rig.read("lib.so", 300 << 10, 4096);
    assert_eq!(data, noise(600 << 10, 5)[300 << 10..(300 << 10) + 4096]);
    assert_eq!(rig.calls(), before);

    // Over the limit: only what the read needs.
    let small = rig_fn(512 << 10, 0);
    small.read("lib.so", 0, 4096);
    assert!(
        small.missing("lib.so"),
        "a file over whole_file_bytes was fetched whole"
    );
    assert_eq!(small.nearby_bytes(), 0);
}

#[test]
fn a_read_that_does_not_miss_asks_nothing() {
    let rig = rig(1 << 20, 4 << 20);
    // Make m3 local as a trace's prefetch would.
    let ino = rig.image.tree.resolve("app/pkg/m3").unwrap();
    let loc = rig.image.tree.get(ino).unwrap().data.unwrap();
    let source = rig.image.layer_source(0).unwrap().clone();
    for r in rig.image.image.layers()[0].ranges_for(loc.entry, 0, 24 << 10) {
        source.warm_range(r).unwrap();
    }
    rig.read("app/pkg/m3", 0, 100);
    assert_eq!(rig.nearby_bytes(), 0);
    assert!(rig.missing("app/pkg/m0") || rig.missing("app/pkg/m7"));
    assert!(rig.missing("app/pkg/z3"));
}

#[test]
fn off_is_off() {
    let rig = rig(0, 0);
    rig.read("app/pkg/m3", 0, 100);
    rig.read("lib.so", 0, 100);
    assert_eq!(rig.nearby_bytes(), 0);
    assert!(rig.missing("app/pkg/m0") && rig.missing("app/pkg/z0") && rig.missing("lib.so"));
}

#[test]
fn a_mount_that_fetched_much_more_than_it_read_stops_guessing() {
    let rig = rig(1 << 20, 100 << 10);
    assert!(rig.image.nearby.within_budget(0, 0));
    // Two directories' first misses, 200 bytes read: their guesses outgrow the reads.
    rig.read("app/pkg/m3", 0, 100);
    rig.read("other/x", 0, 100);
    let s = rig.image.stats.snapshot();
    assert!(s.bytes_nearby > 0);
    assert!(
        !rig.image
            .nearby
            .within_budget(s.bytes_fetched, s.bytes_served),
        "{s:?}"
    );
    // A file that would come whole: only the read's own bytes now.
    rig.read("lib.so", 0, 100);
    assert_eq!(rig.image.stats.snapshot().bytes_nearby, s.bytes_nearby);
    assert!(rig.missing("lib.so"));
    // Reads that used what was fetched raise the bound again.
    assert!(
        rig.image
            .nearby
            .within_budget(s.bytes_fetched, s.bytes_fetched)
    );
}
