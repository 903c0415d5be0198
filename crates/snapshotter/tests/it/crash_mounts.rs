//! What a crash leaves mounted under the snapshotter's root, and what reopening does with
//! it: a mount on an active snapshot (a remote layer's Prepare that died between its mount
//! and its commit) is detached; a committed remote layer's mount is left to `restore`.
//! Needs real mounts (tmpfs stands in for the FUSE layer): without the privilege to
//! mount, the test says so and returns.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_snapshotter::remote::{
    LABEL_CRI_IMAGE_REF, LABEL_CRI_LAYER_DIGEST, LABEL_TARGET, MemoryRemoteLayers,
};
use ferry_snapshotter::{Error, Snapshotter};

const NS: &str = "ferry-test";

fn fs_dir(root: &Path, id: u64) -> PathBuf {
    std::fs::canonicalize(root)
        .unwrap()
        .join("snapshots")
        .join(id.to_string())
        .join("fs")
}

/// Mounts a tmpfs on `dir`; false when this process may not mount.
fn mount_tmpfs(dir: &Path) -> bool {
    let target = CString::new(dir.as_os_str().as_bytes()).unwrap();
    let tmpfs = CString::new("tmpfs").unwrap();
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call;
    // data may be null for tmpfs.
    let rc = unsafe {
        libc::mount(
            tmpfs.as_ptr(),
            target.as_ptr(),
            tmpfs.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    rc == 0
}

fn unmount(dir: &Path) {
    let target = CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: target is a valid NUL-terminated string that outlives the call.
    unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
}

fn is_mount_point(dir: &Path) -> bool {
    let want = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| mp == want)
}

#[test]
fn reopening_detaches_what_a_crash_left_on_active_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let remote = Arc::new(MemoryRemoteLayers::new());
    remote.add_layer(
        "sha256:lazy",
        vec![(PathBuf::from("bin/app"), b"app".to_vec())],
    );
    {
        let snap = Snapshotter::open(root, remote.clone()).unwrap();
        // id 1: a committed remote layer.
        let labels: HashMap<String, String> = [
            (LABEL_TARGET, "chain1"),
            (LABEL_CRI_IMAGE_REF, "registry.test/app:1"),
            (LABEL_CRI_LAYER_DIGEST, "sha256:lazy"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert!(matches!(
            snap.prepare(NS, "extract chain1", "", labels),
            Err(Error::AlreadyExists { .. })
        ));
        // id 2: an active snapshot, as a Prepare that crashed before its commit leaves it.
        snap.prepare(NS, "extract chain2", "chain1", HashMap::new())
            .unwrap();
    }
    let (remote_dir, active_dir) = (fs_dir(root, 1), fs_dir(root, 2));
    if !mount_tmpfs(&active_dir) {
        eprintln!(
            "skipped: cannot mount here ({})",
            std::io::Error::last_os_error()
        );
        return;
    }
    assert!(mount_tmpfs(&remote_dir));
    assert!(is_mount_point(&active_dir) && is_mount_point(&remote_dir));

    let snap = Snapshotter::open(root, remote.clone()).unwrap();
    let active_left = is_mount_point(&active_dir);
    let remote_kept = is_mount_point(&remote_dir);
    unmount(&remote_dir);
    unmount(&active_dir);
    assert!(
        !active_left,
        "the active snapshot's leftover mount was not detached"
    );
    assert!(remote_kept, "a remote layer's mount is restore's business");
    assert_eq!(remote.restored(), vec!["sha256:lazy".to_owned()]);
    // The active snapshot is usable (and removable) as before.
    assert_eq!(std::fs::read_dir(&active_dir).unwrap().count(), 0);
    snap.remove(NS, "extract chain2").unwrap();
    assert!(!active_dir.exists());
}
