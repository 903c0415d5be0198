//! The layer unpacker on temp dirs: overlayfs whiteouts and opaque dirs, hard links,
//! symlinks, devices, modes, ownership, mtimes, xattrs, later entries replacing earlier
//! ones, the diff id, compression, and refusal (not panic) of traversal, symlink escapes,
//! bad hard links, limits and garbage. Whiteouts, opaque xattrs and chown need root; the
//! tests that need it say so and return early without it.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use ferry_oci::media::LayerCompression;
use ferry_pull::unpack::{OPAQUE_XATTR, UnpackError, UnpackLimits, unpack_layer};
use sha2::Digest as _;

use crate::common::{Raw, file, raw, tar_of};

fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn unpack(tar: &[u8], dest: &Path) -> Result<ferry_pull::unpack::UnpackStats, UnpackError> {
    unpack_layer(tar, LayerCompression::None, dest, &UnpackLimits::default())
}

#[test]
fn files_dirs_symlinks_hardlinks_modes_and_mtimes() {
    let dest = tempfile::tempdir().unwrap();
    let tar = tar_of(&[
        Raw {
            mode: 0o750,
            mtime: 1_500_000_000,
            ..raw("./", tar::EntryType::Directory)
        },
        Raw {
            mode: 0o700,
            mtime: 1_400_000_000,
            ..raw("./etc/", tar::EntryType::Directory)
        },
        Raw {
            mode: 0o4755,
            ..file("./etc/tool", b"#!/bin/sh\n")
        },
        Raw {
            link: Some("../etc/tool"),
            ..raw("etc/link", tar::EntryType::Symlink)
        },
        Raw {
            link: Some("/etc/tool"),
            ..raw("etc/abs-link", tar::EntryType::Symlink)
        },
        Raw {
            link: Some("./etc/tool"),
            ..raw("usr/bin/hard", tar::EntryType::Link)
        },
        file("replaced", b"old"),
        file("replaced", b"new"),
        raw("fifo", tar::EntryType::Fifo),
    ]);
    let stats = unpack(&tar, dest.path()).unwrap();
    let d = dest.path();
    assert_eq!(stats.entries, 9);
    assert_eq!(stats.file_bytes, 10 + 3 + 3);
    assert_eq!(
        stats.diff_id,
        format!("sha256:{}", hex::encode(sha2::Sha256::digest(&tar)))
    );
    assert_eq!(std::fs::read(d.join("etc/tool")).unwrap(), b"#!/bin/sh\n");
    let tool = std::fs::metadata(d.join("etc/tool")).unwrap();
    assert_eq!(tool.permissions().mode() & 0o7777, 0o4755);
    assert_eq!(tool.mtime(), 1_600_000_000);
    assert_eq!(tool.nlink(), 2, "hard link shares the inode");
    assert_eq!(
        std::fs::metadata(d.join("usr/bin/hard")).unwrap().ino(),
        tool.ino()
    );
    assert_eq!(
        std::fs::read_link(d.join("etc/link")).unwrap(),
        Path::new("../etc/tool")
    );
    assert_eq!(
        std::fs::read_link(d.join("etc/abs-link")).unwrap(),
        Path::new("/etc/tool")
    );
    let etc = std::fs::metadata(d.join("etc")).unwrap();
    assert_eq!(etc.permissions().mode() & 0o7777, 0o700);
    assert_eq!(
        etc.mtime(),
        1_400_000_000,
        "dir mtime set after its children"
    );
    let root = std::fs::metadata(d).unwrap();
    assert_eq!(
        root.permissions().mode() & 0o7777,
        0o750,
        "./ applies to the layer root"
    );
    assert_eq!(std::fs::read(d.join("replaced")).unwrap(), b"new");
    assert!(
        std::fs::metadata(d.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert_eq!(
        std::fs::metadata(d.join("usr/bin"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755,
        "missing parents are made 0755"
    );
}

#[test]
fn ownership_whiteouts_and_opaque_dirs() {
    if !is_root() {
        eprintln!("skipped: whiteouts, trusted xattrs and chown need root");
        return;
    }
    let dest = tempfile::tempdir().unwrap();
    let tar = tar_of(&[
        Raw {
            uid: 1234,
            ..file("owned", b"x")
        },
        raw("gone/", tar::EntryType::Directory),
        raw("gone/.wh..wh..opq", tar::EntryType::Regular),
        raw("dir/.wh.deleted", tar::EntryType::Regular),
        raw(".wh.top", tar::EntryType::Regular),
        raw("dir/.wh..wh.plnk", tar::EntryType::Regular),
        Raw {
            mode: 0o600,
            ..raw("null", tar::EntryType::Char)
        },
    ]);
    unpack(&tar, dest.path()).unwrap();
    let d = dest.path();
    let owned = std::fs::metadata(d.join("owned")).unwrap();
    assert_eq!((owned.uid(), owned.gid()), (1234, 1234));
    for w in ["dir/deleted", "top"] {
        let m = std::fs::symlink_metadata(d.join(w)).unwrap();
        assert!(m.file_type().is_char_device(), "{w} is a whiteout device");
        assert_eq!(m.rdev(), 0, "{w} is 0/0");
    }
    assert!(!d.join("dir/.wh.deleted").exists());
    assert!(!d.join("dir/.wh..wh.plnk").exists());
    assert!(!d.join("dir/plnk").exists());
    let mut value = [0u8; 8];
    let path = std::ffi::CString::new(d.join("gone").to_str().unwrap()).unwrap();
    let name = std::ffi::CString::new(OPAQUE_XATTR).unwrap();
    // SAFETY: valid C strings and buffer.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), 8) };
    assert_eq!(n, 1);
    assert_eq!(value[0], b'y');
    assert!(!d.join("gone/.wh..wh..opq").exists());
    assert!(
        std::fs::symlink_metadata(d.join("null"))
            .unwrap()
            .file_type()
            .is_char_device()
    );
}

#[test]
fn pax_xattrs_are_applied() {
    let dest = tempfile::tempdir().unwrap();
    let mut builder = tar::Builder::new(Vec::new());
    builder
        .append_pax_extensions([("SCHILY.xattr.user.ferry", b"hello".as_slice())])
        .unwrap();
    let mut h = tar::Header::new_ustar();
    h.set_path("attr.txt").unwrap();
    h.set_size(2);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    builder.append(&h, &b"hi"[..]).unwrap();
    let tar = builder.into_inner().unwrap();
    unpack(&tar, dest.path()).unwrap();
    let path = std::ffi::CString::new(dest.path().join("attr.txt").to_str().unwrap()).unwrap();
    let name = std::ffi::CString::new("user.ferry").unwrap();
    let mut value = [0u8; 16];
    // SAFETY: valid C strings and buffer.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), 16) };
    if n < 0 {
        // Some filesystems (old tmpfs) refuse user xattrs; the unpack would have failed.
        panic!("xattr missing: {}", std::io::Error::last_os_error());
    }
    assert_eq!(&value[..n as usize], b"hello");
}

/// The layer is refused (by the tar walker, or by the unpacker's own checks on disk)
/// with an error containing `needle`, and nothing is written outside the destination.
fn assert_refused(entries: &[Raw<'_>], needle: &str) {
    let outer = tempfile::tempdir().unwrap();
    let dest = outer.path().join("layer");
    std::fs::create_dir(&dest).unwrap();
    let err = unpack(&tar_of(entries), &dest).unwrap_err();
    assert!(
        matches!(err, UnpackError::Unsafe { .. } | UnpackError::Tar(_)),
        "{err}"
    );
    assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
    let outside: Vec<_> = std::fs::read_dir(outer.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        outside,
        vec![std::ffi::OsString::from("layer")],
        "nothing written outside"
    );
}

#[test]
fn traversal_and_escapes_are_refused() {
    assert_refused(&[file("../evil", b"x")], "escapes");
    assert_refused(&[file("a/../../evil", b"x")], "escapes");
    // a symlink to the outside, then a write through it
    assert_refused(
        &[
            Raw {
                link: Some(".."),
                ..raw("up", tar::EntryType::Symlink)
            },
            file("up/evil", b"x"),
        ],
        "non-directory",
    );
    assert_refused(
        &[Raw {
            link: Some("../outside"),
            ..raw("hard", tar::EntryType::Link)
        }],
        "escapes",
    );
    assert_refused(
        &[
            Raw {
                link: Some(".."),
                ..raw("up", tar::EntryType::Symlink)
            },
            Raw {
                link: Some("up/layer"),
                ..raw("hard", tar::EntryType::Link)
            },
        ],
        "regular file",
    );
    assert_refused(
        &[Raw {
            link: Some("missing"),
            ..raw("hard", tar::EntryType::Link)
        }],
        "does not name an earlier",
    );
    assert_refused(
        &[file("file", b"x"), file("file/child", b"x")],
        "non-directory",
    );
    assert_refused(&[raw("dir/.wh...", tar::EntryType::Regular)], "whiteout");
}

/// An absolute path names the same place relative to the layer root (as Docker and
/// containerd read it, and as the lazy tree shows it): nothing lands outside.
#[test]
fn absolute_paths_are_relative_to_the_layer() {
    let outer = tempfile::tempdir().unwrap();
    let dest = outer.path().join("layer");
    std::fs::create_dir(&dest).unwrap();
    unpack(&tar_of(&[file("/etc/abs", b"x")]), &dest).unwrap();
    assert_eq!(std::fs::read(dest.join("etc/abs")).unwrap(), b"x");
    let outside: Vec<_> = std::fs::read_dir(outer.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(outside, vec![std::ffi::OsString::from("layer")]);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dest = tempfile::tempdir().unwrap();
    // garbage header
    let garbage = vec![0x5au8; 2048];
    assert!(matches!(
        unpack(&garbage, dest.path()),
        Err(UnpackError::Tar(_))
    ));
    // truncated file content
    let mut tar = tar_of(&[file("big", &[7u8; 2000])]);
    tar.truncate(1024);
    assert!(unpack(&tar, tempfile::tempdir().unwrap().path()).is_err());
    // bad gzip
    let err = unpack_layer(
        &b"not gzip at all"[..],
        LayerCompression::Gzip,
        dest.path(),
        &UnpackLimits::default(),
    );
    assert!(err.is_err());
    // limits
    let tar = tar_of(&[file("a", b"1"), file("b", b"2"), file("c", b"3")]);
    let small = UnpackLimits {
        max_entries: 2,
        max_file_bytes: 100,
    };
    let err = unpack_layer(
        &tar[..],
        LayerCompression::None,
        tempfile::tempdir().unwrap().path(),
        &small,
    )
    .unwrap_err();
    // The entry count is the walker's bound, the one the lazy index has too.
    assert!(matches!(err, UnpackError::Tar(_)), "{err}");
    assert!(err.to_string().contains("more than 2 entries"), "{err}");
    let tiny = UnpackLimits {
        max_entries: 100,
        max_file_bytes: 2,
    };
    let err = unpack_layer(
        &tar[..],
        LayerCompression::None,
        tempfile::tempdir().unwrap().path(),
        &tiny,
    )
    .unwrap_err();
    assert!(matches!(err, UnpackError::Limit(_)), "{err}");
}

#[test]
fn gzip_and_zstd_layers_unpack_and_hash_the_uncompressed_stream() {
    use std::io::Write;
    let tar = tar_of(&[file("hello.txt", b"hello")]);
    let want = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&tar)));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&tar).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::encode_all(&tar[..], 3).unwrap();
    for (compression, blob) in [(LayerCompression::Gzip, gz), (LayerCompression::Zstd, zst)] {
        let dest = tempfile::tempdir().unwrap();
        let stats = unpack_layer(
            &blob[..],
            compression,
            dest.path(),
            &UnpackLimits::default(),
        )
        .unwrap();
        assert_eq!(stats.diff_id, want, "{compression:?}");
        assert_eq!(
            std::fs::read(dest.path().join("hello.txt")).unwrap(),
            b"hello"
        );
    }
}

#[test]
fn a_directory_replaced_by_a_symlink_is_refused_and_its_chmod_not_redirected() {
    let outer = tempfile::tempdir().unwrap();
    let outside = outer.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dest = outer.path().join("layer");
    std::fs::create_dir(&dest).unwrap();
    let target = outside.to_str().unwrap().to_owned();
    let tar = tar_of(&[
        Raw {
            mode: 0o700,
            ..raw("etc/", tar::EntryType::Directory)
        },
        Raw {
            mode: 0o700,
            ..raw("etc/sub/", tar::EntryType::Directory)
        },
        Raw {
            link: Some(&target),
            ..raw("etc", tar::EntryType::Symlink)
        },
    ]);
    let err = unpack(&tar, &dest).unwrap_err();
    assert!(err.to_string().contains("replaces a directory"), "{err}");
    let mode = std::fs::metadata(&outside).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o755, "the symlink's target kept its mode");
}

/// GNU tar and Docker write sub-second mtimes in a PAX `mtime` record; containerd's
/// overlayfs unpack keeps them, and a staged layer must look the same. A malformed one
/// is refused, as the lazy index refuses it.
#[test]
fn pax_mtimes_keep_their_nanoseconds_and_bad_ones_are_refused() {
    let dest = tempfile::tempdir().unwrap();
    let mut builder = tar::Builder::new(Vec::new());
    let mut add = |name: &str, pax: Option<&[u8]>| {
        if let Some(value) = pax {
            builder.append_pax_extensions([("mtime", value)]).unwrap();
        }
        let mut h = tar::Header::new_ustar();
        h.set_path(name).unwrap();
        h.set_size(1);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h.set_cksum();
        builder.append(&h, &b"x"[..]).unwrap();
    };
    add("precise", Some(b"1700000000.123456789".as_slice()));
    add("short", Some(b"1700000001.5".as_slice()));
    add("long", Some(b"1700000002.1234567891234".as_slice()));
    add("whole", Some(b"1700000003".as_slice()));
    add("plain", None);
    let tar = builder.into_inner().unwrap();
    unpack(&tar, dest.path()).unwrap();
    let mtime = |name: &str| {
        let m = std::fs::metadata(dest.path().join(name)).unwrap();
        (m.mtime(), m.mtime_nsec())
    };
    assert_eq!(mtime("precise"), (1_700_000_000, 123_456_789));
    assert_eq!(mtime("short"), (1_700_000_001, 500_000_000));
    assert_eq!(mtime("long"), (1_700_000_002, 123_456_789));
    assert_eq!(mtime("whole"), (1_700_000_003, 0));
    assert_eq!(mtime("plain"), (1_600_000_000, 0));

    let mut builder = tar::Builder::new(Vec::new());
    builder
        .append_pax_extensions([("mtime", b"-12.x".as_slice())])
        .unwrap();
    let mut h = tar::Header::new_ustar();
    h.set_path("garbage").unwrap();
    h.set_size(0);
    h.set_cksum();
    builder.append(&h, &b""[..]).unwrap();
    let err = unpack(
        &builder.into_inner().unwrap(),
        tempfile::tempdir().unwrap().path(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("PAX mtime"), "{err}");
}
