//! Tests of trace recording.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use ferry_index::merged::MergedImage;
use ferry_index::reader::LayerReader;

use super::*;
use crate::image::tree::ROOT_INO;
use crate::trace::tests::read;

/// A merged tree over a whole (uncompressed tar) layer with `etc/a`, `usr/lib/b` and a
/// hard link `bin/h` to `usr/lib/b`.
fn tree() -> InodeTree {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, size) in [("etc/a", 10_000usize), ("usr/lib/b", 50_000)] {
        let mut h = tar::Header::new_ustar();
        h.set_size(size as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, path, &vec![7u8; size][..]).unwrap();
    }
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Link);
    h.set_size(0);
    h.set_cksum();
    tar.append_link(&mut h, "bin/h", "usr/lib/b").unwrap();
    let tar = tar.into_inner().unwrap();
    let source = Arc::new(ferry_index::source::MemSource(tar));
    let layer = LayerReader::whole(source, ferry_oci::media::LayerCompression::None).unwrap();
    InodeTree::merged(&MergedImage::new(vec![layer]))
}

#[test]
fn path_of_names_files_directories_and_the_root() {
    let t = tree();
    for p in ["/etc/a", "/usr/lib", "/etc", "/bin"] {
        let ino = t.resolve(p).unwrap();
        assert_eq!(t.path_of(ino).as_deref(), Some(p));
    }
    assert_eq!(t.path_of(ROOT_INO).as_deref(), Some("/"));
    assert_eq!(t.path_of(9999), None);
    // A hard link shares its target's inode; either name is the inode's path.
    let b = t.resolve("/usr/lib/b").unwrap();
    assert_eq!(t.resolve("/bin/h"), Some(b));
    let name = t.path_of(b).unwrap();
    assert!(name == "/bin/h" || name == "/usr/lib/b", "{name}");
    assert_eq!(t.resolve(&name), Some(b));
}

/// The kernel's readahead may read a file's start, then its end, then its middle: the
/// middle read bridges the two and the file is one read again, where it was first
/// touched.
#[test]
fn a_read_that_bridges_two_recorded_reads_joins_them() {
    let t = tree();
    let a = t.resolve("/etc/a").unwrap();
    let b = t.resolve("/usr/lib/b").unwrap();
    let rec = Recorder::default();
    rec.start();
    rec.note(0, &t, a, 0, 2000);
    rec.note(0, &t, b, 0, 100);
    rec.note(0, &t, a, 8000, 2000);
    rec.note(0, &t, a, 5000, 1000); // a third piece, apart from both
    let touches = rec.touches();
    rec.note(0, &t, a, 2000, 6000); // the middle: joins all three
    assert_eq!(rec.touches(), touches + 1);
    rec.note(0, &t, a, 100, 9000); // inside: nothing new
    assert_eq!(rec.touches(), touches + 1);
    rec.note(0, &t, b, 100, 100); // b still continues its own read
    let trace = rec.take();
    let bp = t.path_of(b).unwrap();
    assert_eq!(
        trace.reads,
        vec![read("/etc/a", 0, 10_000), read(&bp, 0, 200)]
    );
}

#[test]
fn recorder_coalesces_in_first_touch_order_and_ignores_rereads() {
    let t = tree();
    let a = t.resolve("/etc/a").unwrap();
    let b = t.resolve("/usr/lib/b").unwrap();
    let rec = Recorder::default();
    rec.note(0, &t, a, 0, 4096); // not recording: ignored
    rec.start();
    assert!(rec.is_recording());
    rec.note(0, &t, b, 0, 4096);
    rec.note(0, &t, a, 0, 4096);
    rec.note(0, &t, b, 4096, 4096); // continues b's last read
    rec.note(0, &t, b, 1000, 100); // inside what was recorded: not again
    rec.note(0, &t, a, 4096, 131_072); // continues a, clamped at a's 10 000 bytes
    rec.note(0, &t, b, 40_000, 4096); // a new piece of b
    rec.note(0, &t, b, 60_000, 4096); // past b's end: nothing
    rec.note(0, &t, b, 36_000, 4000); // just before b's second piece: widens it backwards
    rec.note(0, &t, ROOT_INO + 500, 0, 1); // unknown inode
    let trace = rec.take();
    assert!(!rec.is_recording());
    let bp = t.path_of(b).unwrap();
    assert_eq!(
        trace.reads,
        vec![
            read(&bp, 0, 8192),
            read("/etc/a", 0, 10_000),
            read(&bp, 36_000, 8096),
        ]
    );
    assert_eq!(trace.files(), 2);
    assert_eq!(trace.bytes(), 8192 + 10_000 + 8096);
    // Stopped: nothing more is recorded.
    rec.note(0, &t, a, 0, 10);
    assert!(rec.take().reads.is_empty());
}

#[test]
fn one_recorder_merges_the_reads_of_several_mounts_in_first_touch_order() {
    // Two layer mounts of one image: their trees number inodes alike, so the recorder
    // keys files by (view, inode) and keeps one global first-touch order.
    let lower = tree();
    let upper = tree();
    let a = lower.resolve("/etc/a").unwrap();
    let b = upper.resolve("/usr/lib/b").unwrap();
    let a_in_upper = upper.resolve("/etc/a").unwrap();
    assert_eq!(a, a_in_upper, "same inode numbers in both trees");
    let rec = Recorder::default();
    rec.start_passive();
    assert!(rec.is_recording());
    assert!(
        !rec.records_every_read(),
        "passive: the read path stays as it is"
    );
    assert_eq!(rec.touches(), 0);
    rec.note(1, &lower, a, 0, 4096);
    rec.note(2, &upper, b, 0, 4096);
    rec.note(2, &upper, a_in_upper, 8192, 100); // another mount's file with a's inode
    rec.note(1, &lower, a, 4096, 4096); // continues the lower mount's read of a
    rec.note(1, &lower, a, 0, 4096); // a re-read: no new touch
    assert_eq!(rec.touches(), 4);
    assert_eq!(rec.len(), 3);
    let bp = upper.path_of(b).unwrap();
    assert_eq!(
        rec.take().reads,
        vec![
            read("/etc/a", 0, 8192),
            read(&bp, 0, 4096),
            read("/etc/a", 8192, 100),
        ]
    );
    // The explicit mode asks the FUSE layer for every read.
    rec.start();
    assert!(rec.records_every_read());
    assert!(rec.is_empty(), "a restart discards what was recorded");
    rec.take();
    assert!(!rec.records_every_read());
}
