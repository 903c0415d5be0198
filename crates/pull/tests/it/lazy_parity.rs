//! One layer, two readers: what `ferry pull` unpacks to disk and what a lazy mount shows
//! (the single-layer inode tree over the layer read whole, and over a gzip ferry index)
//! must be the same tree, or the same refusal. Each case is a hostile or odd tar; the
//! test compares every path's kind, mode, owner, mtime, device numbers, link target, data,
//! xattrs and hard link group. Whiteouts, device nodes and `trusted.*` xattrs need root;
//! without it the test fails rather than passing on less.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use ferry_fs::image::tree::{InodeTree, NodeKind, ROOT_INO};
use ferry_index::merged::MergedImage;
use ferry_index::reader::{LayerFormat, LayerReader};
use ferry_index::source::MemSource;
use ferry_oci::media::LayerCompression;
use ferry_pull::unpack::{UnpackError, UnpackLimits, unpack_layer};

use crate::common::{Raw, file, raw, tar_of};

/// What one path of a layer looks like, in either reader.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Item {
    kind: &'static str,
    /// Permission bits (0 for symlinks: Linux has no symlink modes).
    mode: u32,
    owner: (u32, u32),
    mtime: (i64, u32),
    rdev: (u32, u32),
    link: String,
    data: Vec<u8>,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// The first path (in path order) of this file's hard link group, when not itself.
    same_inode_as: Option<String>,
}

/// A layer's tree by path (`""` is the root), or the refusal's message.
type Outcome = Result<BTreeMap<String, Item>, String>;

fn unpacked(tar: &[u8]) -> Outcome {
    let dest = tempfile::tempdir().unwrap();
    match unpack_layer(
        tar,
        LayerCompression::None,
        dest.path(),
        &UnpackLimits::default(),
    ) {
        Ok(_) => Ok(disk_tree(dest.path())),
        // The walker's error is what the lazy path reports; others are the unpacker's own.
        Err(UnpackError::Tar(e)) => Err(e.to_string()),
        Err(e) => Err(format!("unpacker: {e}")),
    }
}

fn disk_tree(root: &Path) -> BTreeMap<String, Item> {
    let mut out = BTreeMap::new();
    let mut inodes: BTreeMap<(u64, u64), String> = BTreeMap::new();
    let mut stack = vec![String::new()];
    let mut paths = Vec::new();
    while let Some(rel) = stack.pop() {
        let full = root.join(&rel);
        let meta = std::fs::symlink_metadata(&full).unwrap();
        if meta.is_dir() {
            for child in std::fs::read_dir(&full).unwrap() {
                let name = child.unwrap().file_name().into_string().unwrap();
                stack.push(if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                });
            }
        }
        paths.push(rel);
    }
    paths.sort();
    for rel in paths {
        let full = root.join(&rel);
        let meta = std::fs::symlink_metadata(&full).unwrap();
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_file() {
            "file"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_char_device() {
            "char"
        } else if ft.is_block_device() {
            "block"
        } else {
            "fifo"
        };
        let same_inode_as = if ft.is_file() {
            let first = inodes
                .entry((meta.dev(), meta.ino()))
                .or_insert_with(|| rel.clone());
            (*first != rel).then(|| first.clone())
        } else {
            None
        };
        let rdev = meta.rdev();
        out.insert(
            rel.clone(),
            Item {
                kind,
                mode: if ft.is_symlink() {
                    0
                } else {
                    meta.mode() & 0o7777
                },
                owner: (meta.uid(), meta.gid()),
                mtime: (meta.mtime(), meta.mtime_nsec() as u32),
                rdev: (libc::major(rdev), libc::minor(rdev)),
                link: if ft.is_symlink() {
                    std::fs::read_link(&full)
                        .unwrap()
                        .into_os_string()
                        .into_string()
                        .unwrap()
                } else {
                    String::new()
                },
                data: if ft.is_file() {
                    std::fs::read(&full).unwrap()
                } else {
                    Vec::new()
                },
                xattrs: xattr::list(&full)
                    .unwrap()
                    .map(|n| {
                        let v = xattr::get(&full, &n).unwrap().unwrap_or_default();
                        (n.into_string().unwrap(), v)
                    })
                    .collect(),
                same_inode_as,
            },
        );
    }
    out
}

/// The lazy mount's view: the layer read whole (an unindexed layer), and through a
/// ferry index of its gzip form; the two must agree with each other too.
fn lazy(tar: &[u8]) -> Outcome {
    let whole = LayerReader::whole(Arc::new(MemSource(tar.to_vec())), LayerCompression::None)
        .map_err(|e| e.to_string())
        .map(lazy_tree);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(tar).unwrap();
    let gz = gz.finish().unwrap();
    let indexed = ferry_index::indexer::index_gzip(&gz[..], 1 << 16, None)
        .map_err(|e| e.to_string())
        .map(|index| {
            lazy_tree(LayerReader::new(
                LayerFormat::Indexed(Arc::new(index)),
                Arc::new(MemSource(gz.clone())),
            ))
        });
    assert_eq!(whole, indexed, "whole and indexed lazy reads disagree");
    whole
}

fn lazy_tree(reader: LayerReader) -> BTreeMap<String, Item> {
    let image = MergedImage::new(vec![reader]);
    let tree = InodeTree::single_layer(&image, 0).unwrap();
    let mut out = BTreeMap::new();
    let mut inodes: BTreeMap<u64, String> = BTreeMap::new();
    let mut stack = vec![(String::new(), ROOT_INO)];
    let mut found = Vec::new();
    while let Some((rel, ino)) = stack.pop() {
        let node = tree.get(ino).unwrap();
        for (name, child) in &node.children {
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            stack.push((path, *child));
        }
        found.push((rel, ino));
    }
    found.sort();
    for (rel, ino) in found {
        let node = tree.get(ino).unwrap();
        let kind = match node.kind {
            NodeKind::Dir => "dir",
            NodeKind::File => "file",
            NodeKind::Symlink => "symlink",
            NodeKind::Char => "char",
            NodeKind::Block => "block",
            NodeKind::Fifo => "fifo",
        };
        let same_inode_as = if node.kind == NodeKind::File {
            let first = inodes.entry(ino).or_insert_with(|| rel.clone());
            (*first != rel).then(|| first.clone())
        } else {
            None
        };
        let data = match node.data {
            Some(at) => {
                let mut data = Vec::new();
                image.layers()[at.layer]
                    .copy_file(at.entry, &mut data)
                    .unwrap();
                data
            }
            None => Vec::new(),
        };
        out.insert(
            rel,
            Item {
                kind,
                mode: if node.kind == NodeKind::Symlink {
                    0
                } else {
                    node.mode
                },
                owner: (node.uid, node.gid),
                mtime: (node.mtime, node.mtime_nsec),
                rdev: node.rdev,
                link: node.link_target.clone(),
                data,
                xattrs: node.xattrs.iter().cloned().collect(),
                same_inode_as,
            },
        );
    }
    out
}

fn dir(path: &str) -> Raw<'_> {
    raw(path, tar::EntryType::Directory)
}

fn symlink<'a>(path: &'a str, target: &'a str) -> Raw<'a> {
    Raw {
        link: Some(target),
        ..raw(path, tar::EntryType::Symlink)
    }
}

fn hardlink<'a>(path: &'a str, target: &'a str) -> Raw<'a> {
    Raw {
        link: Some(target),
        ..raw(path, tar::EntryType::Link)
    }
}

/// A tar written by `tar::Builder`, for the extension headers (PAX, GNU long names).
fn built(f: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    f(&mut b);
    b.into_inner().unwrap()
}

fn header(kind: tar::EntryType, gnu: bool, size: u64) -> tar::Header {
    let mut h = if gnu {
        tar::Header::new_gnu()
    } else {
        tar::Header::new_ustar()
    };
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(if kind == tar::EntryType::Directory {
        0o755
    } else {
        0o640
    });
    h.set_uid(1000);
    h.set_gid(100);
    h.set_mtime(1_650_000_000);
    h
}

/// The layers: a name and the tar bytes.
fn cases() -> Vec<(&'static str, Vec<u8>)> {
    let long_dir = "d".repeat(120);
    let long_name = format!("{long_dir}/{}", "f".repeat(150));
    let long_target = format!("../{}", "t".repeat(200));
    let mut truncated = tar_of(&[file("big", &[7u8; 3000])]);
    truncated.truncate(1024 + 512);
    let mut huge = tar_of(&[file("small", b"x")]);
    {
        // The header claims 8 GiB of data the stream does not have.
        let mut h = tar::Header::new_gnu();
        h.set_path("huge").unwrap();
        h.set_size(8 << 30);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        let at = huge.len() - 1024;
        huge.truncate(at);
        huge.extend_from_slice(h.as_bytes());
        huge.extend_from_slice(&[1u8; 4096]);
    }
    vec![
        ("traversal", tar_of(&[file("../evil", b"x")])),
        ("traversal inside", tar_of(&[file("a/../../evil", b"x")])),
        (
            "absolute path",
            tar_of(&[file("/etc/abs", b"x"), dir("/etc/")]),
        ),
        (
            "symlink then write through it",
            tar_of(&[symlink("up", ".."), file("up/evil", b"x")]),
        ),
        (
            "absolute symlink then write through it",
            tar_of(&[symlink("etc", "/etc"), file("etc/passwd", b"x")]),
        ),
        ("hard link outside", tar_of(&[hardlink("h", "../outside")])),
        (
            "hard link absolute",
            tar_of(&[hardlink("h", "/etc/passwd")]),
        ),
        (
            "hard link through a symlink",
            tar_of(&[symlink("up", ".."), hardlink("h", "up/layer")]),
        ),
        (
            "hard links",
            tar_of(&[file("a", b"data"), hardlink("b", "a"), hardlink("c/d", "b")]),
        ),
        (
            "hard link to a symlink",
            tar_of(&[symlink("s", "a"), hardlink("h", "s")]),
        ),
        (
            "pax long names, times and xattrs",
            built(|b| {
                b.append_pax_extensions([
                    ("path", long_name.as_bytes()),
                    ("mtime", b"1700000000.25".as_slice()),
                    ("SCHILY.xattr.user.k", b"v".as_slice()),
                    ("SCHILY.xattr.trusted.t", b"".as_slice()),
                ])
                .unwrap();
                let mut h = header(tar::EntryType::Regular, false, 3);
                h.set_path("short").unwrap();
                h.set_cksum();
                b.append(&h, &b"pax"[..]).unwrap();
                b.append_pax_extensions([("linkpath", long_target.as_bytes())])
                    .unwrap();
                let mut h = header(tar::EntryType::Symlink, false, 0);
                h.set_path("sym").unwrap();
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }),
        ),
        (
            "gnu long names",
            built(|b| {
                let mut h = header(tar::EntryType::Regular, true, 3);
                b.append_data(&mut h, &long_name, &b"gnu"[..]).unwrap();
                let mut h = header(tar::EntryType::Symlink, true, 0);
                b.append_link(&mut h, "lnk", &long_target).unwrap();
                let mut h = header(tar::EntryType::Directory, true, 0);
                b.append_data(&mut h, format!("{long_dir}/"), std::io::empty())
                    .unwrap();
            }),
        ),
        (
            "duplicate entries",
            tar_of(&[
                Raw {
                    mode: 0o700,
                    ..dir("d/")
                },
                file("d/x", b"first"),
                Raw {
                    mode: 0o750,
                    mtime: 1_700_000_000,
                    ..dir("d/")
                },
                file("d/x", b"second"),
                file("f", b"file"),
                symlink("f", "elsewhere"),
                symlink("g", "one"),
                dir("g/"),
                file("g/inside", b"in"),
            ]),
        ),
        (
            "file replaces a directory",
            tar_of(&[dir("d/"), file("d/x", b"x"), file("d", b"")]),
        ),
        (
            "hard link target replaced",
            tar_of(&[file("a", b"old"), hardlink("b", "a"), file("a", b"new")]),
        ),
        (
            "whiteouts and opaque dirs",
            tar_of(&[
                dir("keep/"),
                Raw {
                    mode: 0o600,
                    mtime: 1_234,
                    ..file("keep/.wh.gone", b"")
                },
                file("opaque/.wh..wh..opq", b""),
                file("opaque/new", b"n"),
                file(".wh..wh..opq", b""),
                file("deep/er/.wh.x", b""),
                file(".wh..wh.aufs", b""),
            ]),
        ),
        ("whiteout of nothing", tar_of(&[file("d/.wh.", b"")])),
        ("whiteout of dot-dot", tar_of(&[file("d/.wh...", b"")])),
        (
            "whiteout and add",
            tar_of(&[file("d/x", b""), file("d/.wh.x", b"")]),
        ),
        (
            "add beneath a whiteout",
            tar_of(&[file("d/.wh.x", b""), file("d/x/y", b"")]),
        ),
        ("truncated", truncated),
        ("huge size claimed", huge),
        ("no end marker", {
            let mut t = tar_of(&[file("a", b"x")]);
            t.truncate(t.len() - 1024);
            t
        }),
        ("garbage", vec![0x5a; 2048]),
        (
            "devices and fifos",
            built(|b| {
                let mut h = header(tar::EntryType::Char, false, 0);
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
                b.append_data(&mut h, "dev/null", std::io::empty()).unwrap();
                let mut h = header(tar::EntryType::Block, false, 0);
                h.set_device_major(8).unwrap();
                h.set_device_minor(1).unwrap();
                b.append_data(&mut h, "dev/sda1", std::io::empty()).unwrap();
                let mut h = header(tar::EntryType::Fifo, false, 0);
                b.append_data(&mut h, "run/fifo", std::io::empty()).unwrap();
            }),
        ),
        (
            "root entry",
            tar_of(&[
                Raw {
                    mode: 0o700,
                    mtime: 99,
                    ..dir("./")
                },
                file("a", b""),
            ]),
        ),
    ]
}

#[test]
fn unpacked_and_lazy_layers_are_the_same_tree_or_the_same_error() {
    // SAFETY: no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "whiteouts, devices and ownership need root; run this test as root"
    );
    let mut refused = 0;
    for (name, tar) in cases() {
        let (disk, lazy) = (unpacked(&tar), lazy(&tar));
        assert_eq!(
            disk, lazy,
            "{name}: the unpacked layer differs from the lazy one"
        );
        refused += usize::from(disk.is_err());
    }
    // Both outcomes are exercised: a table where everything is refused proves little.
    assert!(
        (8..cases().len() - 5).contains(&refused),
        "{refused} refused"
    );
}
