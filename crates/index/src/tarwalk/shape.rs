//! The shape rules of one layer: which orders of entries the walker refuses because
//! their meaning would depend on how an extractor applies them.
//!
//! A layer is read two ways: `ferry pull` writes it to disk entry by entry, and a lazy
//! mount builds its tree from the whole file table (later entries of a path win). Those
//! agree for every layer these rules accept, so the rules live here, in the one tar reader
//! both use, and not in either consumer. Refused, each naming the entry:
//!
//! * an entry beneath a path this layer made a non-directory (a symlink, file, device),
//!   so nothing is written through a link or into a file;
//! * a non-directory replacing a directory of this layer (listed, or implied by an earlier
//!   entry beneath it): an extractor drops the directory's children, a table does not;
//! * an entry replacing the target of an earlier hard link (the link would keep the old
//!   inode on disk and follow the new entry in a table);
//! * a hard link to itself, or to anything but an earlier regular file (or hard link to
//!   one): a symlink, device, whiteout or opaque marker has no data to share;
//! * a whiteout of nothing (`.wh.`, `.wh..`, `.wh...`), a whiteout of a path this layer
//!   also adds (before or after), and any entry beneath a whiteout or beneath a component
//!   named `.wh.*` (what the entry would mean then is up to the extractor).
//!
//! Memory: one keyed 64-bit hash and a byte per distinct path (and parent) of the stream.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};

use crate::entry::{Entry, EntryKind, OPAQUE_MARKER, WHITEOUT_PREFIX};

/// What a path of this layer currently is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// A directory, listed or implied by an entry beneath it.
    Dir,
    /// A regular file or a hard link to one: something a hard link may name.
    File,
    /// A symlink, device or FIFO.
    Other,
}

/// The paths of a stream seen so far, keyed by hashes (keyed per walker, so a stream
/// cannot craft collisions).
#[derive(Debug, Default)]
pub(super) struct Shape {
    hasher: RandomState,
    paths: HashMap<u64, Seen>,
    /// Paths this layer's whiteouts remove.
    whiteouts: HashSet<u64>,
    /// Paths named by a hard link of this layer.
    link_targets: HashSet<u64>,
}

/// The proper ancestors of a normalized path, nearest last (`a`, `a/b` for `a/b/c`).
fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/').map(move |(i, _)| &path[..i])
}

impl Shape {
    fn key(&self, path: &str) -> u64 {
        self.hasher.hash_one(path)
    }

    /// Checks `entry` against what the stream said before it and records it. The error is
    /// the reason, for the walker to wrap with the entry's name and offset.
    pub(super) fn admit(&mut self, entry: &Entry) -> Result<(), String> {
        for dir in ancestors(&entry.path) {
            let key = self.key(dir);
            let name = dir.rsplit('/').next().unwrap_or(dir);
            if name.starts_with(WHITEOUT_PREFIX) {
                return Err(format!("beneath {dir:?}, a whiteout name"));
            }
            if self.whiteouts.contains(&key) {
                return Err(format!("beneath {dir:?}, which this layer whites out"));
            }
            match self.paths.get(&key) {
                Some(Seen::Dir) => {}
                Some(_) => {
                    return Err(format!(
                        "beneath {dir:?}, which this layer made a non-directory"
                    ));
                }
                None => {
                    self.paths.insert(key, Seen::Dir);
                }
            }
        }
        let name = entry.name();
        if name == OPAQUE_MARKER {
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            if matches!(hidden, "" | "." | "..") {
                return Err("whiteout of nothing".into());
            }
            let target = match entry.parent() {
                "" => hidden.to_string(),
                parent => format!("{parent}/{hidden}"),
            };
            let key = self.key(&target);
            if self.paths.contains_key(&key) {
                return Err(format!("whites out {target:?}, which this layer also adds"));
            }
            self.whiteouts.insert(key);
            return Ok(());
        }
        let key = self.key(&entry.path);
        if self.whiteouts.contains(&key) {
            return Err("adds a path this layer also whites out".into());
        }
        if self.link_targets.contains(&key) {
            return Err("replaces the target of an earlier hard link".into());
        }
        let previous = self.paths.get(&key).copied();
        if previous == Some(Seen::Dir) && entry.kind != EntryKind::Dir {
            return Err(format!(
                "a {:?} replaces a directory of this layer",
                entry.kind
            ));
        }
        if entry.kind == EntryKind::Hardlink {
            let target = entry.link_target.as_str();
            if target == entry.path {
                return Err("hard link to itself".into());
            }
            let target_key = self.key(target);
            if self.paths.get(&target_key) != Some(&Seen::File) {
                return Err(format!(
                    "hard link target {target:?} does not name an earlier regular file"
                ));
            }
            self.link_targets.insert(target_key);
        }
        let seen = match entry.kind {
            EntryKind::Dir => Seen::Dir,
            EntryKind::File | EntryKind::Hardlink => Seen::File,
            EntryKind::Symlink | EntryKind::Char | EntryKind::Block | EntryKind::Fifo => {
                Seen::Other
            }
        };
        self.paths.insert(key, seen);
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::entry::test_entry as e;

    fn hard(path: &str, target: &str) -> Entry {
        let mut link = e(path, EntryKind::Hardlink);
        link.link_target = target.into();
        link
    }

    /// Admits `entries` in order; the index and reason of the first refusal.
    fn first_refusal(entries: &[Entry]) -> Option<(usize, String)> {
        let mut shape = Shape::default();
        entries
            .iter()
            .enumerate()
            .find_map(|(i, e)| shape.admit(e).err().map(|r| (i, r)))
    }

    #[test]
    fn ordinary_layers_are_admitted() {
        let layer = [
            e("", EntryKind::Dir),
            e("etc", EntryKind::Dir),
            e("etc/passwd", EntryKind::File),
            hard("etc/passwd-", "etc/passwd"),
            hard("etc/passwd--", "etc/passwd-"),
            e("usr/bin/sh", EntryKind::Symlink),
            e("usr/lib/.wh.old", EntryKind::File),
            e("var/.wh..wh..opq", EntryKind::File),
            e("var/cache", EntryKind::Dir),
            e("etc", EntryKind::Dir),    // a directory again: metadata only
            e("tmp/x", EntryKind::File), // a file again replaces it
            e("tmp/x", EntryKind::Symlink), // and so does a symlink
            e("tmp/x", EntryKind::Dir),  // and a directory
            e("tmp/x/y", EntryKind::File),
        ];
        assert_eq!(first_refusal(&layer), None);
    }

    #[test]
    fn order_dependent_layers_are_refused() {
        let cases: Vec<(Vec<Entry>, &str)> = vec![
            (
                vec![e("l", EntryKind::Symlink), e("l/f", EntryKind::File)],
                "made a non-directory",
            ),
            (
                vec![e("f", EntryKind::File), e("f/g", EntryKind::Dir)],
                "made a non-directory",
            ),
            (
                vec![e("d/x", EntryKind::File), e("d", EntryKind::File)],
                "replaces a directory",
            ),
            (
                vec![e("d", EntryKind::Dir), e("d", EntryKind::Symlink)],
                "replaces a directory",
            ),
            (
                vec![
                    e("f", EntryKind::File),
                    hard("h", "f"),
                    e("f", EntryKind::File),
                ],
                "target of an earlier hard link",
            ),
            (
                vec![e("f", EntryKind::File), hard("f", "f")],
                "hard link to itself",
            ),
            (
                vec![e("s", EntryKind::Symlink), hard("h", "s")],
                "does not name an earlier regular file",
            ),
            (
                vec![e("d/.wh.x", EntryKind::File), hard("h", "d/.wh.x")],
                "does not name an earlier regular file",
            ),
            (vec![hard("h", "later")], "does not name"),
            (vec![e("d/.wh.", EntryKind::File)], "whiteout of nothing"),
            (vec![e(".wh..", EntryKind::File)], "whiteout of nothing"),
            (
                vec![e("d/x", EntryKind::File), e("d/.wh.x", EntryKind::File)],
                "which this layer also adds",
            ),
            (
                vec![e("d/x/y", EntryKind::File), e("d/.wh.x", EntryKind::File)],
                "which this layer also adds",
            ),
            (
                vec![e("d/.wh.x", EntryKind::File), e("d/x", EntryKind::File)],
                "also whites out",
            ),
            (
                vec![e("d/.wh.x", EntryKind::File), e("d/x/y", EntryKind::File)],
                "which this layer whites out",
            ),
            (vec![e(".wh.d/y", EntryKind::File)], "a whiteout name"),
        ];
        for (layer, needle) in cases {
            let (at, reason) = first_refusal(&layer).unwrap_or_else(|| panic!("{layer:?}"));
            assert_eq!(at, layer.len() - 1, "{layer:?}: {reason}");
            assert!(reason.contains(needle), "{layer:?}: {reason}");
        }
    }
}
