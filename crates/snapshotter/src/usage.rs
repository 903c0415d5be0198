//! Disk usage of a snapshot directory, as `Usage` reports it: real disk use (allocated
//! blocks, not apparent sizes) and inode count, hard links counted once. The walk stays
//! on the directory's own filesystem so it never descends into a lazy (FUSE) mount.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Space a snapshot takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Bytes allocated on disk.
    pub size: u64,
    /// Inodes (files, directories, links…), each hard-linked inode once.
    pub inodes: u64,
}

/// Walks `root` (not following symlinks, not crossing into other filesystems).
/// A missing `root` counts as empty; entries vanishing during the walk are skipped.
pub fn disk_usage(root: &Path) -> Result<Usage> {
    let top = match std::fs::symlink_metadata(root) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Usage::default()),
        Err(e) => return Err(Error::io("stat", root, e)),
    };
    let device = top.dev();
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut usage = Usage::default();
    let mut count = |meta: &std::fs::Metadata, usage: &mut Usage| {
        if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
            return;
        }
        usage.size = usage.size.saturating_add(meta.blocks().saturating_mul(512));
        usage.inodes = usage.inodes.saturating_add(1);
    };
    count(&top, &mut usage);
    if !top.is_dir() {
        return Ok(usage);
    }
    let mut pending: Vec<PathBuf> = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io("read dir", &dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("read dir", &dir, e))?;
            let path = entry.path();
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("stat", &path, e)),
            };
            if meta.dev() != device {
                continue;
            }
            count(&meta, &mut usage);
            if meta.is_dir() {
                pending.push(path);
            }
        }
    }
    Ok(usage)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn counts_hard_links_once_and_real_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("fs");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/a"), vec![7u8; 64 * 1024]).unwrap();
        std::fs::hard_link(root.join("sub/a"), root.join("b")).unwrap();
        std::os::unix::fs::symlink("sub/a", root.join("link")).unwrap();
        let usage = disk_usage(&root).unwrap();
        // fs, sub, a (= b), link
        assert_eq!(usage.inodes, 4);
        let file_blocks = std::fs::metadata(root.join("sub/a")).unwrap().blocks() * 512;
        assert!(usage.size >= file_blocks);
        assert!(
            usage.size < 2 * file_blocks,
            "hard link counted twice: {usage:?}"
        );
    }

    #[test]
    fn missing_dir_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            disk_usage(&dir.path().join("nope")).unwrap(),
            Usage::default()
        );
    }
}
