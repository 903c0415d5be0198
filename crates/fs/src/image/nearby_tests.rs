//! Tests of fetching what belongs with a miss, over an in-memory backend that logs every
//! range asked of it and a real chunk store: a directory's small files come with its
//! first miss (nearest first, within the budget and the directory's subtree, never big
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
use crate::backend::{ImageSource, LayerSpec};
use crate::device::FetchConfig;
use crate::device::tests::{indexed_gzip_layer, noise, open_store};
use crate::image::{MountedImage, View};
use crate::stats::GuessBytes;

#[derive(Default)]
struct LogBackend {
    blob: Vec<u8>,
    log: Mutex<Vec<Range<u64>>>,
    /// Reads touching these ranges fail (a registry that cannot serve them).
    failing: Mutex<Vec<Range<u64>>>,
}

impl RangeSource for LogBackend {
    fn len(&self) -> u64 {
        self.blob.len() as u64
    }

    fn read_range(&self, range: Range<u64>) -> std::io::Result<Vec<u8>> {
        self.log.lock().unwrap().push(range.clone());
        let failing = self.failing.lock().unwrap();
        if failing
            .iter()
            .any(|f| f.start < range.end && range.start < f.end)
        {
            return Err(std::io::Error::other(
                "the test's registry fails this range",
            ));
        }
        drop(failing);
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
/// `app/sub/s0` (24 KiB, in a sibling directory of `pkg`), `pad` (200 KiB), `other/x`
/// (24 KiB, outside it), `lib.so` (600 KiB), then a package with compiled modules:
/// `app/lib/__pycache__/c0`, `c1` and `app/lib/deep/__pycache__/d0` (24 KiB each);
/// spans of 64 KiB, no readahead.
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
    files.push(("app/lib/__pycache__/c0".into(), noise(24 << 10, 40)));
    files.push(("app/lib/__pycache__/c1".into(), noise(24 << 10, 41)));
    files.push(("app/lib/deep/__pycache__/d0".into(), noise(24 << 10, 42)));
    rig_of(&files, whole_file_bytes, nearby_bytes)
}

/// A rig over a layer of `files` (in that order); spans of 64 KiB, no readahead.
fn rig_of(files: &[(String, Vec<u8>)], whole_file_bytes: u64, nearby_bytes: u64) -> Rig {
    rig_with(files, whole_file_bytes, nearby_bytes, true)
}

/// [`rig_of`], its index with the ELF files' libraries `ferry index` records or, when
/// not `recorded`, without (as an index older than format 3).
fn rig_with(
    files: &[(String, Vec<u8>)],
    whole_file_bytes: u64,
    nearby_bytes: u64,
    recorded: bool,
) -> Rig {
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect();
    let (blob, mut index) = indexed_gzip_layer(&named);
    if !recorded {
        index.libraries.clear();
    }
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

    /// What a read of `path` would ask for, with the mount at `spent`.
    fn plan(&self, path: &str, offset: u64, len: u64, spent: Spent) -> Asks {
        self.plan_in(&self.image.nearby_layers(), path, offset, len, spent)
    }

    /// What a read at `offset` of `path` that returned `head` asks for as its loader's
    /// segments, with the mount at `spent`.
    fn loader(&self, path: &str, offset: u64, head: &[u8], spent: Spent) -> Vec<Range<u64>> {
        let ino = self.image.tree.resolve(path).unwrap();
        let node = self.image.tree.get(ino).unwrap();
        let read = Read {
            ino,
            node,
            offset,
            len: head.len() as u64,
        };
        self.image
            .nearby
            .plan_loader(&self.image.nearby_layers(), &read, head, spent)
    }

    /// [`Rig::plan`] with the layers looking like `layers`.
    fn plan_in(
        &self,
        layers: &dyn Layers,
        path: &str,
        offset: u64,
        len: u64,
        spent: Spent,
    ) -> Asks {
        let ino = self.image.tree.resolve(path).unwrap();
        let node = self.image.tree.get(ino).unwrap();
        let read = Read {
            ino,
            node,
            offset,
            len,
        };
        self.image.nearby.plan(layers, &read, spent)
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
fn neighbours_are_the_directorys_own_or_a_compiled_modules_package() {
    // A miss in app/sub brings nothing of its sibling app/pkg (the parent's subtree
    // would have brought all of it).
    let rig = rig(0, 4 << 20);
    rig.read("app/sub/s0", 0, 100);
    for i in 0..8 {
        assert!(
            rig.missing(&format!("app/pkg/m{i}")),
            "app/pkg/m{i}, of a sibling directory, came along"
        );
    }
    let rig = self::rig(0, 4 << 20);
    rig.read("app/lib/__pycache__/c0", 0, 100);
    assert!(!rig.missing("app/lib/__pycache__/c1"));
    assert!(
        !rig.missing("app/lib/deep/__pycache__/d0"),
        "a subpackage's compiled module did not come with its package"
    );
    assert!(
        rig.missing("app/pkg/m0"),
        "another package's file came along"
    );
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
fn guesses_count_by_kind_until_a_read_uses_them() {
    let rig = rig(0, 4 << 20);
    rig.read("app/pkg/m3", 0, 100);
    let s = rig.image.stats.snapshot();
    assert!(s.bytes_guessed > 0, "{s:?}");
    assert_eq!(s.bytes_guessed_used, 0, "{s:?}");
    // Readahead and whole files are off: every guess is a neighbour.
    assert_eq!(s.guesses.neighbours.fetched, s.bytes_guessed, "{s:?}");
    assert_eq!(s.guesses.rest, GuessBytes::default(), "{s:?}");
    // A neighbour that came is read: its spans were worth it.
    rig.read("app/pkg/m0", 0, 100);
    let t = rig.image.stats.snapshot();
    assert!(t.bytes_guessed_used > 0, "{t:?}");
    assert_eq!(t.guesses.neighbours.used, t.bytes_guessed_used, "{t:?}");
    assert_eq!(t.bytes_guessed, s.bytes_guessed, "a hit is no new guess");
    assert!(t.bytes_guessed_used <= t.bytes_guessed);
}

#[test]
fn a_files_rest_is_a_guess_of_its_own_kind() {
    let rig = rig(1 << 20, 0);
    rig.read("lib.so", 0, 4096);
    let s = rig.image.stats.snapshot();
    assert!(s.guesses.rest.fetched > 0, "{s:?}");
    assert_eq!(s.guesses.neighbours, GuessBytes::default(), "{s:?}");
    // The read's own span was used at once; a fault at the far end uses another.
    let used = s.guesses.rest.used;
    assert!(used > 0 && used < s.guesses.rest.fetched, "{s:?}");
    rig.read("lib.so", 590 << 10, 4096);
    let t = rig.image.stats.snapshot();
    assert!(t.guesses.rest.used > used, "{t:?}");
    assert_eq!(t.guesses.rest.fetched, s.guesses.rest.fetched, "{t:?}");
}

#[test]
fn a_mount_whose_guesses_go_unread_stops_guessing() {
    let nearby = Nearby::new(&FetchConfig::default());
    // Its first guesses always may, up to the floor.
    assert!(nearby.within_budget(0, 0));
    assert!(nearby.within_budget(GUESS_FLOOR, 0));
    assert!(!nearby.within_budget(GUESS_FLOOR + 1, 0));
    // Beyond the floor: unused guesses up to 2/5 of what the reads were served.
    assert!(nearby.within_budget(40 << 20, 100 << 20));
    assert!(!nearby.within_budget((40 << 20) + 1, 100 << 20));
    // Whole files: unused rests up to the larger floor, then half of what was served.
    assert!(nearby.within_rest_budget(WHOLE_FILE_FLOOR, 0));
    assert!(!nearby.within_rest_budget(WHOLE_FILE_FLOOR + 1, 0));
    assert!(nearby.within_rest_budget(50 << 20, 100 << 20));
    assert!(!nearby.within_rest_budget((50 << 20) + 1, 100 << 20));

    let rig = rig(1 << 20, 4 << 20);
    let over = Spent {
        fetched: 10 << 20,
        served: 1 << 20,
        rest_unused: 0,
        neighbours_unused: GUESS_FLOOR + 1,
    };
    let asks = rig.plan("app/pkg/m3", 0, 100, over);
    assert!(asks.neighbours.is_empty(), "{asks:?}");
    // Its own file (within its own bound) still comes whole.
    assert!(asks.whole.is_some(), "{asks:?}");
}

#[test]
fn unread_rests_of_files_do_not_hold_back_neighbours() {
    let rig = rig(1 << 20, 4 << 20);
    let spent = |rest_unused: u64, neighbours_unused: u64| Spent {
        // Far more fetched than served, as at a start's first reads: no bound on that.
        fetched: 100 << 20,
        served: 1 << 20,
        rest_unused,
        neighbours_unused,
    };
    // Rests unused past their floor: no file whole, but its neighbours still.
    let asks = rig.plan("app/pkg/m3", 0, 100, spent(WHOLE_FILE_FLOOR + 1, 0));
    assert!(asks.whole.is_none(), "{asks:?}");
    assert!(!asks.neighbours.is_empty(), "{asks:?}");
    // Within both: the file, and its neighbours without the file's own ranges.
    let asks = rig.plan("app/lib/__pycache__/c0", 0, 100, spent(0, 0));
    let whole = asks.whole.clone().unwrap();
    assert!(!asks.neighbours.is_empty(), "{asks:?}");
    assert!(
        asks.neighbours
            .iter()
            .all(|r| r.end <= whole.start || r.start >= whole.end),
        "{asks:?}"
    );
    // Past both: nothing, and the file may still ask later.
    let asks = rig.plan(
        "app/pkg/m0",
        0,
        100,
        spent(WHOLE_FILE_FLOOR + 1, GUESS_FLOOR + 1),
    );
    assert_eq!(asks, Asks::default());
    assert!(rig.plan("app/pkg/m0", 0, 100, spent(0, 0)).whole.is_some());
}

#[test]
fn a_files_first_miss_fetches_it_whole_in_the_reads_own_request() {
    let rig = rig(1 << 20, 0);
    let before = rig.calls();
    rig.read("lib.so", 0, 4096);
    let after_first = rig.calls();
    // The file's spans in one request and their windows in one more (no readahead here).
    assert!(
        after_first - before <= 2,
        "{:?}",
        &rig.backend.log.lock().unwrap()[before..]
    );
    assert!(!rig.missing("lib.so"));
    // Faults anywhere in it later need nothing from the network, windows included.
    for off in [100u64 << 10, 300 << 10, 590 << 10] {
        let data = rig.read("lib.so", off, 4096);
        assert_eq!(data, noise(600 << 10, 5)[off as usize..off as usize + 4096]);
    }
    assert_eq!(rig.calls(), after_first);
    assert_eq!(rig.image.stats.snapshot().read_waits, 1);
}

/// The rig's layers, with every range reported as being fetched by someone else: neither
/// missing (no new fetch would start for it) nor local (a read of it waits).
struct AllInFlight<'a>(MountLayers<'a>);

impl Layers for AllInFlight<'_> {
    fn ranges(&self, loc: Location, off: u64, len: u64) -> Vec<Range<u64>> {
        self.0.ranges(loc, off, len)
    }
    fn entry(&self, layer: usize, idx: usize) -> Option<&Entry> {
        self.0.entry(layer, idx)
    }
    fn missing(&self, _layer: usize, _range: &Range<u64>) -> bool {
        false
    }
    fn local(&self, _layer: usize, _range: &Range<u64>) -> bool {
        false
    }
}

#[test]
fn a_read_that_joins_another_fetch_still_asks_for_its_whole_file() {
    let rig = rig(1 << 20, 4 << 20);
    let in_flight = AllInFlight(rig.image.nearby_layers());
    // Its first span is on its way as a neighbour's: the read waits for it, so the
    // file comes whole in that wait instead of a round trip per later fault.
    let asks = rig.plan_in(&in_flight, "lib.so", 0, 4096, Spent::default());
    assert!(asks.whole.is_some(), "{asks:?}");
    // A read of local bytes asks for nothing, though its file has not asked yet: m6
    // came as m5's neighbour.
    rig.read("app/pkg/m5", 0, 100);
    assert!(!rig.missing("app/pkg/m6"));
    assert_eq!(
        rig.plan("app/pkg/m6", 0, 100, Spent::default()),
        Asks::default()
    );
}

/// A 64-bit little-endian ELF header whose loadable segments are `(flags, offset,
/// filesz)`.
fn elf_head(segments: &[(u32, u64, u64)]) -> Vec<u8> {
    let phdrs: Vec<(u32, u32, u64, u64)> = segments
        .iter()
        .map(|&(flags, offset, filesz)| (1, flags, offset, filesz))
        .collect();
    crate::image::elf::test_header(&phdrs)
}

#[test]
fn a_large_librarys_header_asks_for_its_loader_segments_but_not_its_code() {
    // lib.so (600 KiB) is over this rig's whole-file size: it never comes whole.
    let rig = rig(256 << 10, 0);
    let ino = rig.image.tree.resolve("lib.so").unwrap();
    let node = rig.image.tree.get(ino).unwrap();
    let loc = node.data.unwrap();
    let layer = &rig.image.image.layers()[loc.layer];
    let head = elf_head(&[
        (4, 0, 64 << 10),
        (5, 64 << 10, 416 << 10),
        (6, 480 << 10, 120 << 10),
    ]);
    let asked = rig.loader("lib.so", 0, &head, Spent::default());
    let covers = |r: &Range<u64>| asked.iter().any(|a| a.start <= r.start && r.end <= a.end);
    for r in layer
        .ranges_for(loc.entry, 0, 64 << 10)
        .iter()
        .chain(&layer.ranges_for(loc.entry, 480 << 10, 120 << 10))
    {
        assert!(covers(r), "{r:?} not in {asked:?}");
    }
    // The middle of the code segment is left to its page faults.
    let code = layer.ranges_for(loc.entry, 230 << 10, 4 << 10);
    assert!(code.iter().all(|r| !covers(r)), "{code:?} in {asked:?}");
    // Once per file.
    assert!(rig.loader("lib.so", 0, &head, Spent::default()).is_empty());
}

#[test]
fn only_a_large_files_elf_header_at_its_start_within_budget_asks() {
    let rig = rig(64 << 10, 0);
    let head = elf_head(&[(6, 0, 600 << 10)]);
    let ask =
        |path: &str, offset: u64, head: &[u8], spent: Spent| rig.loader(path, offset, head, spent);
    // A small file comes whole instead; a read elsewhere is no header; text is no ELF;
    // unused rests past their budget stop it; a hostile header asks for nothing.
    assert!(ask("app/pkg/m0", 0, &head, Spent::default()).is_empty());
    assert!(ask("lib.so", 4096, &head, Spent::default()).is_empty());
    assert!(ask("lib.so", 0, b"#!/bin/sh\n", Spent::default()).is_empty());
    let over = Spent {
        rest_unused: WHOLE_FILE_FLOOR + 1,
        ..Spent::default()
    };
    assert!(ask("lib.so", 0, &head, over).is_empty());
    assert!(ask("lib.so", 0, &head[..70], Spent::default()).is_empty());
    // None of those used the file's one ask.
    assert!(!ask("lib.so", 0, &head, Spent::default()).is_empty());
    assert!(ask("lib.so", 0, &head, Spent::default()).is_empty());
}

#[test]
fn a_packages_init_names_its_subpackages_inits_but_not_its_tests() {
    let init = "__pycache__/__init__.cpython-311.pyc";
    assert_eq!(package_init_suffix(&format!("p/{init}"), "p"), Some(init));
    assert_eq!(
        package_init_suffix("p/__init__.py", "p"),
        Some("__init__.py")
    );
    assert_eq!(package_init_suffix("p/__pycache__/m.pyc", "p"), None);
    assert_eq!(package_init_suffix("__init__.py", ""), None);
    assert!(subpackage_init(&format!("p/a/{init}"), "p", init));
    assert!(subpackage_init(&format!("p/a/b/{init}"), "p", init));
    assert!(!subpackage_init(&format!("p/{init}"), "p", init), "its own");
    assert!(!subpackage_init(&format!("p/tests/{init}"), "p", init));
    assert!(!subpackage_init(&format!("p/a/tests/b/{init}"), "p", init));
    assert!(!subpackage_init(
        "p/a/__pycache__/__init__.cpython-312.pyc",
        "p",
        init
    ));
    assert!(!subpackage_init(&format!("q/a/{init}"), "p", init));
    assert!(!subpackage_init(&format!("pp/a/{init}"), "p", init));
}

#[test]
fn a_packages_first_miss_brings_its_subpackages_inits_beyond_the_nearest_files() {
    let init = "__pycache__/__init__.cpython-311.pyc";
    let mut files: Vec<(String, Vec<u8>)> = vec![(format!("pkg/{init}"), noise(8 << 10, 1))];
    for i in 0..12 {
        files.push((format!("pkg/__pycache__/m{i}.pyc"), noise(24 << 10, 10 + i)));
    }
    files.push((format!("pkg/core/{init}"), noise(8 << 10, 2)));
    for i in 0..12 {
        files.push((
            format!("pkg/core/__pycache__/c{i}.pyc"),
            noise(24 << 10, 30 + i),
        ));
    }
    files.push((format!("pkg/core/deep/{init}"), noise(8 << 10, 3)));
    files.push((
        "pkg/core/deep/__pycache__/d.pyc".into(),
        noise(200 << 10, 4),
    ));
    files.push((format!("pkg/tests/{init}"), noise(8 << 10, 5)));
    files.push(("pkg/tests/__pycache__/t.pyc".into(), noise(200 << 10, 6)));
    files.push((format!("other/{init}"), noise(8 << 10, 7)));
    // Neighbours get about three spans (of 64 KiB): only the nearest modules.
    let rig = rig_of(&files, 0, 200 << 10);
    rig.read(&format!("pkg/{init}"), 0, 100);
    assert!(!rig.missing(&format!("pkg/core/{init}")));
    assert!(!rig.missing(&format!("pkg/core/deep/{init}")));
    assert!(
        rig.missing(&format!("pkg/tests/{init}")),
        "a test package came"
    );
    assert!(rig.missing(&format!("other/{init}")));
    assert!(
        rig.missing("pkg/core/__pycache__/c6.pyc"),
        "the subpackage's modules came too: the neighbours' budget did not hold"
    );
    // Neighbours past their budget: the inits still come, as guesses of a file's rest
    // (within that budget instead).
    let rig = rig_of(&files, 0, 200 << 10);
    let spent = Spent {
        neighbours_unused: u64::MAX / 2,
        ..Spent::default()
    };
    let asks = rig.plan(&format!("pkg/{init}"), 0, 100, spent);
    assert!(
        asks.neighbours.is_empty() && !asks.inits.is_empty(),
        "{asks:?}"
    );
    let spent = Spent {
        rest_unused: u64::MAX / 2,
        ..Spent::default()
    };
    let asks = rig.plan(&format!("pkg/{init}"), 0, 100, spent);
    assert!(asks.inits.is_empty(), "{asks:?}");
    // A module that is not an `__init__` asks for no subpackage's.
    let rig = rig_of(&files, 0, 200 << 10);
    rig.read("pkg/__pycache__/m11.pyc", 0, 100);
    assert!(rig.missing(&format!("pkg/core/deep/{init}")));
}

/// An ELF file of `len` bytes (noise after its headers) naming `interp` and `needed`.
fn elf(interp: Option<&str>, needed: &[&str], len: usize, seed: u64) -> Vec<u8> {
    let mut f = noise(len, seed);
    let head = crate::image::elf::test_program(interp, needed, len as u64);
    f[..head.len()].copy_from_slice(&head);
    f
}

/// prog → interpreter + libfoo (in the multiarch dir) → libbar (in /usr/lib); libbaz
/// is named by nothing. 100 KiB each, 300 KiB of padding between them.
fn program_and_libraries() -> Vec<(String, Vec<u8>)> {
    vec![
        (
            "usr/bin/prog".into(),
            elf(Some("/lib64/ld.so"), &["libfoo.so.1"], 100 << 10, 1),
        ),
        ("pad0".into(), noise(300 << 10, 2)),
        ("lib64/ld.so".into(), elf(None, &[], 100 << 10, 3)),
        ("pad1".into(), noise(300 << 10, 4)),
        (
            "usr/lib/x86_64-linux-gnu/libfoo.so.1".into(),
            elf(None, &["libbar.so", "libmissing.so"], 100 << 10, 5),
        ),
        ("pad2".into(), noise(300 << 10, 6)),
        ("usr/lib/libbar.so".into(), elf(None, &[], 100 << 10, 7)),
        ("pad3".into(), noise(300 << 10, 8)),
        ("usr/lib/libbaz.so".into(), elf(None, &[], 100 << 10, 9)),
    ]
}

#[test]
fn a_programs_libraries_are_followed_through_the_image_and_fetched() {
    for recorded in [true, false] {
        let rig = rig_with(&program_and_libraries(), 8 << 20, 0, recorded);
        // The program's own read: it came whole, as a first read does.
        rig.read("usr/bin/prog", 0, 4096);
        assert!(rig.missing("usr/lib/libbar.so"));
        let ino = rig.image.tree.resolve("usr/bin/prog").unwrap();
        let loc = rig.image.tree.get(ino).unwrap().data.unwrap();
        rig.image.follow_libraries(loc);
        assert!(wait_idle(Duration::from_secs(30)));
        for lib in [
            "lib64/ld.so",
            "usr/lib/x86_64-linux-gnu/libfoo.so.1",
            "usr/lib/libbar.so",
        ] {
            assert!(!rig.missing(lib), "{lib} was not fetched");
        }
        assert!(
            rig.missing("usr/lib/libbaz.so"),
            "a library nobody names came"
        );
        let stats = rig.image.stats.snapshot();
        assert_eq!(stats.read_waits, 1, "only the program's own read waited");
        assert!(stats.guesses.rest.fetched > 0, "{stats:?}");
        // Once per file: following again fetches nothing.
        let calls = rig.calls();
        rig.image.follow_libraries(loc);
        assert!(wait_idle(Duration::from_secs(30)));
        assert_eq!(rig.calls(), calls);
    }
}

#[test]
fn recorded_libraries_follow_a_chain_without_reading_each_link() {
    // libfoo cannot be fetched: its own `.dynamic` cannot name libbar. The names
    // `ferry index` recorded still can, so libbar comes all the same: a chain's links
    // are asked for together, not each after the one before has landed.
    for recorded in [true, false] {
        let rig = rig_with(&program_and_libraries(), 8 << 20, 0, recorded);
        let prog = rig.image.tree.resolve("usr/bin/prog").unwrap();
        let prog = rig.image.tree.get(prog).unwrap().data.unwrap();
        let layer = &rig.image.image.layers()[prog.layer];
        let names = layer.recorded_libraries(prog.entry);
        if recorded {
            let deps = names
                .flatten()
                .expect("the program's libraries were recorded");
            assert_eq!(deps.interpreter.as_deref(), Some("/lib64/ld.so"));
            assert_eq!(deps.needed, vec!["libfoo.so.1"]);
        } else {
            assert_eq!(names, None, "an index without records says nothing");
        }
        let foo = rig
            .image
            .tree
            .resolve("usr/lib/x86_64-linux-gnu/libfoo.so.1");
        let foo = rig.image.tree.get(foo.unwrap()).unwrap();
        let foo_loc = foo.data.unwrap();
        *rig.backend.failing.lock().unwrap() = layer.ranges_for(foo_loc.entry, 0, foo.size);
        // The program's first read landed; its libraries are followed.
        rig.read("usr/bin/prog", 0, 4096);
        rig.image.follow_libraries(prog);
        assert!(wait_idle(Duration::from_secs(30)));
        assert!(rig.missing("usr/lib/x86_64-linux-gnu/libfoo.so.1"));
        assert!(!rig.missing("lib64/ld.so"), "the interpreter did not come");
        assert_eq!(
            rig.missing("usr/lib/libbar.so"),
            !recorded,
            "recorded {recorded}: libbar comes exactly when the index names it"
        );
        assert!(
            rig.missing("usr/lib/libbaz.so"),
            "a library nobody names came"
        );
    }
}

#[test]
fn an_interpreters_start_and_its_command_lines_imports_are_fetched_before_it_reads_them() {
    // The interpreter's binary; what every start of it imports (encodings and the two
    // modules it loads, sitecustomize); what `-c 'import pandas'` imports; and modules
    // nothing names.
    let pyc = |name: &str| format!("__pycache__/{name}.cpython-311.pyc");
    let lib = "usr/lib/python3.11";
    let dist = "usr/lib/python3/dist-packages";
    let mut files: Vec<(String, Vec<u8>)> =
        vec![("usr/bin/python3.11".into(), noise(100 << 10, 1))];
    let wanted = [
        format!("{lib}/encodings/{}", pyc("__init__")),
        format!("{lib}/encodings/{}", pyc("aliases")),
        format!("{lib}/encodings/{}", pyc("utf_8")),
        format!("{lib}/{}", pyc("sitecustomize")),
        format!("{dist}/pandas/{}", pyc("__init__")),
    ];
    let unwanted = [
        format!("{lib}/encodings/{}", pyc("cp1252")),
        format!("{lib}/{}", pyc("os")),
        format!("{dist}/numpy/{}", pyc("__init__")),
    ];
    for (i, f) in wanted.iter().chain(&unwanted).enumerate() {
        files.push((format!("pad{i}"), noise(300 << 10, 100 + i as u64)));
        files.push((f.clone(), noise(20 << 10, 10 + i as u64)));
    }
    files.push((format!("{lib}/encodings/__init__.py"), noise(100, 50)));
    files.push((format!("{dist}/pandas/__init__.py"), noise(100, 51)));
    files.push((format!("{dist}/numpy/__init__.py"), noise(100, 52)));
    let rig = rig_of(&files, 8 << 20, 0);
    let ino = rig.image.tree.resolve("usr/bin/python3.11").unwrap();
    let loc = rig.image.tree.get(ino).unwrap().data.unwrap();
    // The exec's read of the binary landed (no process to ask: pid 0).
    rig.image.follow_interpreter(loc, "/usr/bin/python3.11", 0);
    assert!(wait_idle(Duration::from_secs(30)));
    for f in &wanted[..4] {
        assert!(!rig.missing(f), "{f}: an interpreter's start imports it");
    }
    assert!(rig.missing(&wanted[4]), "no command line was read");
    // Its command line, once the exec is done.
    let module = crate::image::imports::Module::interpreter("/usr/bin/python3.11", None).unwrap();
    let line = crate::image::interpreter::command_line(&[
        "python3".into(),
        "-c".into(),
        "import pandas; print(pandas.__version__)".into(),
    ])
    .unwrap();
    crate::image::interpreter::follow_command_line(
        &Arc::downgrade(&rig.image),
        &module,
        "/usr/bin/python3.11",
        line,
    );
    assert!(wait_idle(Duration::from_secs(30)));
    assert!(
        !rig.missing(&wanted[4]),
        "pandas is what the command imports"
    );
    for f in &unwanted {
        assert!(rig.missing(f), "{f}: nothing imports it");
    }
    let stats = rig.image.stats.snapshot();
    assert_eq!(stats.read_waits, 0, "no read waited: all of it went ahead");
    assert!(stats.guesses.rest.fetched > 0, "{stats:?}");
    // Once per binary per mount.
    let calls = rig.calls();
    rig.image.follow_interpreter(loc, "/usr/bin/python3.11", 0);
    assert!(wait_idle(Duration::from_secs(30)));
    assert_eq!(rig.calls(), calls);
}

/// A layer of `files` as the daemon gives a mount: descriptor, index, logging backend.
fn layer_of(files: &[(&str, Vec<u8>)]) -> (LayerSpec, Arc<LogBackend>, String) {
    let (blob, index) = indexed_gzip_layer(files);
    let backend = Arc::new(LogBackend {
        blob: blob.clone(),
        ..Default::default()
    });
    let digest = ferry_oci::sha256_digest(&blob);
    let d = descriptor(LAYER_TAR_GZIP, digest.clone(), blob.len() as u64, &[]);
    let spec = LayerSpec::new(d, Some(Arc::new(index)), backend.clone());
    (spec, backend, digest.to_string())
}

#[test]
fn a_layer_mounts_program_follows_its_libraries_into_the_layer_below() {
    // containerd mounts each layer on its own: the program is in the upper layer, its
    // library in the lower one, which this mount shows nothing of.
    let elf = |needed: &[&str], len: usize, seed: u64| {
        let mut f = noise(len, seed);
        let head = crate::image::elf::test_program(None, needed, len as u64);
        f[..head.len()].copy_from_slice(&head);
        f
    };
    let lower = [
        ("usr/lib/x86_64-linux-gnu/libc.so.6", elf(&[], 100 << 10, 1)),
        ("pad", noise(300 << 10, 2)),
        (
            "usr/lib/x86_64-linux-gnu/libunused.so",
            elf(&[], 100 << 10, 3),
        ),
    ];
    let upper = [("usr/bin/prog", elf(&["libc.so.6"], 100 << 10, 4))];
    let config = FetchConfig {
        readahead_bytes: 0,
        whole_file_bytes: 8 << 20,
        nearby_bytes: 0,
        ..FetchConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path());
    let mount = |view_upper: bool| {
        let (l0, b0, d0) = layer_of(&lower);
        let (l1, b1, d1) = layer_of(&upper);
        let source = ImageSource {
            manifest_digest: "sha256:test".into(),
            layers: vec![l0, l1],
        };
        let view = View::Layer(if view_upper { d1 } else { d0 });
        let image =
            Arc::new(MountedImage::new(source, Some(store.clone()), config, &view).unwrap());
        (image, b0, b1)
    };
    let (image, lower_backend, upper_backend) = mount(true);
    assert!(
        image
            .tree
            .resolve("usr/lib/x86_64-linux-gnu/libc.so.6")
            .is_none(),
        "the layer mount shows only its own layer"
    );
    let ino = image.tree.resolve("usr/bin/prog").unwrap();
    let loc = image.tree.get(ino).unwrap().data.unwrap();
    image.follow_libraries(loc);
    assert!(wait_idle(Duration::from_secs(30)));
    let missing = |path: &str| {
        let at = image.image.lookup(path, true).unwrap();
        let layer = &image.image.layers()[at.layer];
        let size = layer.entries()[at.entry].size;
        let source = image.layer_source(at.layer).unwrap();
        layer
            .ranges_for(at.entry, 0, size)
            .into_iter()
            .any(|r| source.range_missing(r))
    };
    assert!(
        !missing("usr/lib/x86_64-linux-gnu/libc.so.6"),
        "the library below was not fetched"
    );
    assert!(missing("usr/lib/x86_64-linux-gnu/libunused.so"));
    assert!(!lower_backend.log.lock().unwrap().is_empty());
    // The lower layer's own mount finds the library in the shared store, and both
    // mounts of the stack share one merged table.
    let (below, below_backend, _) = mount(false);
    assert!(Arc::ptr_eq(
        below.image.shared_table(),
        image.image.shared_table()
    ));
    let at = below
        .image
        .lookup("usr/lib/x86_64-linux-gnu/libc.so.6", true)
        .unwrap();
    let source = below.layer_source(at.layer).unwrap();
    let size = below.image.layers()[at.layer].entries()[at.entry].size;
    assert!(
        below.image.layers()[at.layer]
            .ranges_for(at.entry, 0, size)
            .into_iter()
            .all(|r| !source.range_missing(r))
    );
    assert!(below_backend.log.lock().unwrap().is_empty());
    // The mount's size is its own layer's.
    assert_eq!(
        image.stats.snapshot().bytes_total,
        upper_backend.blob.len() as u64
    );
}
