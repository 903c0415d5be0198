//! The file-table entry shared by every layer format (tar, ferry index, eStargz).
//!
//! An [`Entry`] is what a tar header (plus its PAX/GNU extensions) says about one
//! member of a layer, normalized: paths are relative to the layer root, never absolute,
//! never containing `..`, without a leading `./` or trailing `/`. Whiteouts are kept as
//! the plain entries the tar had (`dir/.wh.name`, `dir/.wh..wh..opq`); [`Entry::whiteout`]
//! classifies them, and the merged view applies them.

use std::collections::BTreeMap;

/// What kind of filesystem object an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum EntryKind {
    /// A regular file; its bytes live at [`Entry::offset`] in the uncompressed tar.
    #[default]
    File,
    /// A directory.
    Dir,
    /// A symbolic link to [`Entry::link_target`].
    Symlink,
    /// A hard link to the earlier entry named by [`Entry::link_target`].
    Hardlink,
    /// A character device.
    Char,
    /// A block device.
    Block,
    /// A named pipe.
    Fifo,
}

impl EntryKind {
    /// Stable one-byte code used by the ferry index format.
    pub fn code(self) -> u8 {
        match self {
            EntryKind::File => 0,
            EntryKind::Dir => 1,
            EntryKind::Symlink => 2,
            EntryKind::Hardlink => 3,
            EntryKind::Char => 4,
            EntryKind::Block => 5,
            EntryKind::Fifo => 6,
        }
    }

    /// Inverse of [`EntryKind::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => EntryKind::File,
            1 => EntryKind::Dir,
            2 => EntryKind::Symlink,
            3 => EntryKind::Hardlink,
            4 => EntryKind::Char,
            5 => EntryKind::Block,
            6 => EntryKind::Fifo,
            _ => return None,
        })
    }
}

/// One member of a layer, normalized.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Entry {
    /// Path relative to the layer root: no leading `/` or `./`, no trailing `/`, no `..`
    /// component. The root directory itself is the empty string.
    pub path: String,
    /// Object kind.
    pub kind: EntryKind,
    /// Permission bits and setuid/setgid/sticky (the low 12 bits of the tar mode).
    pub mode: u32,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Owner user name (may be empty).
    pub uname: String,
    /// Owner group name (may be empty).
    pub gname: String,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Sub-second part of the modification time (PAX high-precision times), 0..1e9.
    pub mtime_nsec: u32,
    /// Size of the file's data in bytes (0 for everything but regular files).
    pub size: u64,
    /// Offset of the file's data in the uncompressed tar stream (regular files only).
    pub offset: u64,
    /// Offset of this member's first header block in the uncompressed tar stream.
    pub header_offset: u64,
    /// Symlink target, or for hard links the normalized path of the linked entry.
    pub link_target: String,
    /// Device major number (char/block devices).
    pub dev_major: u32,
    /// Device minor number (char/block devices).
    pub dev_minor: u32,
    /// Extended attributes (PAX `SCHILY.xattr.*`), sorted by name.
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// How an entry takes part in OCI whiteout semantics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whiteout<'a> {
    /// Not a whiteout.
    None,
    /// `dir/.wh.name`: hides `dir/name` (and everything below it) of lower layers.
    Remove(String),
    /// `dir/.wh..wh..opq`: hides every lower-layer child of `dir` (the parent, `""` for root).
    Opaque(&'a str),
}

/// Prefix of an OCI whiteout file name.
pub const WHITEOUT_PREFIX: &str = ".wh.";
/// Name of an OCI opaque-directory marker.
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";

impl Entry {
    /// The last path component.
    pub fn name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }

    /// The parent directory's path (`""` for top-level entries and the root).
    pub fn parent(&self) -> &str {
        match self.path.rfind('/') {
            Some(i) => &self.path[..i],
            None => "",
        }
    }

    /// Classifies this entry as an OCI whiteout.
    pub fn whiteout(&self) -> Whiteout<'_> {
        let name = self.name();
        if name == OPAQUE_MARKER {
            Whiteout::Opaque(self.parent())
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            let parent = self.parent();
            if parent.is_empty() {
                Whiteout::Remove(hidden.to_string())
            } else {
                Whiteout::Remove(format!("{parent}/{hidden}"))
            }
        } else {
            Whiteout::None
        }
    }

    /// True for regular files.
    pub fn is_file(&self) -> bool {
        self.kind == EntryKind::File
    }
}

/// An entry of `kind` at `path` with every other field zero, for the crate's tests.
#[cfg(test)]
pub(crate) fn test_entry(path: &str, kind: EntryKind) -> Entry {
    Entry {
        path: path.into(),
        kind,
        ..Default::default()
    }
}

/// True for a path in the normalized form every [`Entry`] has: relative, no empty, `.`
/// or `..` components, no leading or trailing `/`. The root is `""`.
pub fn is_clean_path(p: &str) -> bool {
    p.is_empty() || p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}
