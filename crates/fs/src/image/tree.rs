//! The filesystem layer: an image's file tables as an inode tree.
//!
//! Built once at mount time from either the merged view of every layer (whiteouts and
//! opaque directories already applied by `ferry_index::merged`) or from one layer alone,
//! presented the way overlayfs expects a lower layer: `.wh.NAME` becomes a character
//! device 0/0 named `NAME`, and a directory holding `.wh..wh..opq` carries the
//! `trusted.overlay.opaque=y` xattr. Hard links share one inode. Directories missing from
//! a tar (members whose parents were never listed) are made up with mode 0755.
//!
//! The tree is immutable after building, so lookups need no locks; children are sorted
//! by name, which makes lookup a binary search and a directory offset a plain index.

use std::collections::{BTreeMap, HashMap};

use ferry_index::entry::{OPAQUE_MARKER, WHITEOUT_PREFIX};
use ferry_index::merged::{Location, MergedImage};
use ferry_index::{Entry, EntryKind};

/// Inode number; the root is [`ROOT_INO`], inode `n` is `nodes[n - 1]`.
pub type Ino = u64;

/// The root directory's inode number (FUSE's).
pub const ROOT_INO: Ino = 1;

/// The xattr overlayfs reads to treat a lower directory as opaque.
pub const OVERLAY_OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Most hard-link hops followed to find a link's data (a chain of links to links).
const MAX_LINK_HOPS: usize = 32;

/// What kind of object an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// Directory.
    Dir,
    /// Regular file.
    File,
    /// Symbolic link.
    Symlink,
    /// Character device (also overlayfs whiteouts, 0/0).
    Char,
    /// Block device.
    Block,
    /// Named pipe.
    Fifo,
}

/// One inode.
#[derive(Debug, Clone)]
pub struct Node {
    /// Parent directory (the root is its own parent).
    pub parent: Ino,
    /// Object kind.
    pub kind: NodeKind,
    /// Permission bits and setuid/setgid/sticky.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Size in bytes (regular files: data; symlinks: target length).
    pub size: u64,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Nanoseconds part of the modification time.
    pub mtime_nsec: u32,
    /// Device numbers (major, minor) of device nodes.
    pub rdev: (u32, u32),
    /// Names referring to this inode (directories: 2 + subdirectories).
    pub nlink: u32,
    /// Symlink target.
    pub link_target: String,
    /// Extended attributes, sorted by name.
    pub xattrs: Vec<(String, Vec<u8>)>,
    /// Where a regular file's data is: layer and entry of the layer's file table.
    pub data: Option<Location>,
    /// Directory entries, sorted by name bytes.
    pub children: Vec<(String, Ino)>,
}

impl Node {
    fn dir(parent: Ino) -> Node {
        Node {
            parent,
            kind: NodeKind::Dir,
            mode: 0o755,
            uid: 0,
            gid: 0,
            size: 0,
            mtime: 0,
            mtime_nsec: 0,
            rdev: (0, 0),
            nlink: 2,
            link_target: String::new(),
            xattrs: Vec::new(),
            data: None,
            children: Vec::new(),
        }
    }

    fn from_entry(parent: Ino, e: &Entry) -> Node {
        let kind = match e.kind {
            EntryKind::Dir => NodeKind::Dir,
            EntryKind::File | EntryKind::Hardlink => NodeKind::File,
            EntryKind::Symlink => NodeKind::Symlink,
            EntryKind::Char => NodeKind::Char,
            EntryKind::Block => NodeKind::Block,
            EntryKind::Fifo => NodeKind::Fifo,
        };
        Node {
            parent,
            kind,
            mode: e.mode & 0o7777,
            uid: e.uid,
            gid: e.gid,
            size: match kind {
                NodeKind::File => e.size,
                NodeKind::Symlink => e.link_target.len() as u64,
                _ => 0,
            },
            mtime: e.mtime,
            mtime_nsec: e.mtime_nsec.min(999_999_999),
            rdev: (e.dev_major, e.dev_minor),
            nlink: if kind == NodeKind::Dir { 2 } else { 1 },
            link_target: if kind == NodeKind::Symlink {
                e.link_target.clone()
            } else {
                String::new()
            },
            xattrs: e
                .xattrs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            data: None,
            children: Vec::new(),
        }
    }

    /// The child named `name`.
    pub fn child(&self, name: &str) -> Option<Ino> {
        self.children
            .binary_search_by(|(n, _)| n.as_bytes().cmp(name.as_bytes()))
            .ok()
            .map(|i| self.children[i].1)
    }

    /// The value of xattr `name`.
    pub fn xattr(&self, name: &str) -> Option<&[u8]> {
        self.xattrs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

/// How an item of the tree being built is presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presentation {
    /// As the entry says.
    Entry,
    /// An overlayfs whiteout: character device 0/0.
    Whiteout,
}

/// The immutable inode tree of a mount.
#[derive(Debug, Clone)]
pub struct InodeTree {
    nodes: Vec<Node>,
}

impl InodeTree {
    /// True when some node carries an xattr (the image's own, or an opaque marker).
    pub fn has_xattrs(&self) -> bool {
        self.nodes.iter().any(|n| !n.xattrs.is_empty())
    }

    /// The merged root filesystem of `image` (all layers, whiteouts applied).
    pub fn merged(image: &MergedImage) -> InodeTree {
        let mut b = Builder::new();
        for (path, loc) in image.table() {
            let Some(entry) = image.entry(*loc) else {
                continue;
            };
            let data = || image.data_location(*loc).ok();
            b.add(path, entry, Presentation::Entry, data, |l| image.entry(l));
        }
        b.finish()
    }

    /// One layer alone (`layer` is its index in `image`), presented as an overlayfs
    /// lower layer: whiteouts as 0/0 character devices, opaque markers as the
    /// `trusted.overlay.opaque` xattr of their directory.
    pub fn single_layer(image: &MergedImage, layer: usize) -> Option<InodeTree> {
        let reader = image.layers().get(layer)?;
        let entries = reader.entries();
        // Tar semantics: a later member of the same path replaces an earlier one.
        let mut by_path: BTreeMap<&str, usize> = BTreeMap::new();
        let mut opaque: Vec<&str> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if e.name() == OPAQUE_MARKER {
                opaque.push(e.parent());
                continue;
            }
            by_path.insert(e.path.as_str(), i);
        }
        let entry_at = |l: Location| {
            if l.layer == layer {
                entries.get(l.entry)
            } else {
                None
            }
        };
        let data_of = |idx: usize| -> Option<Location> {
            let mut idx = idx;
            for _ in 0..MAX_LINK_HOPS {
                let e = entries.get(idx)?;
                match e.kind {
                    EntryKind::File => return Some(Location { layer, entry: idx }),
                    EntryKind::Hardlink => idx = *by_path.get(e.link_target.as_str())?,
                    _ => return None,
                }
            }
            None
        };
        let mut b = Builder::new();
        // Whiteouts are shown under the name they hide; a real entry of that name in the
        // same layer wins (a layer cannot both remove and add a path).
        let mut items: BTreeMap<String, (usize, Presentation)> = BTreeMap::new();
        for (path, idx) in &by_path {
            let e = &entries[*idx];
            match e.name().strip_prefix(WHITEOUT_PREFIX) {
                Some(hidden) if !hidden.is_empty() => {
                    let shown = match e.parent() {
                        "" => hidden.to_string(),
                        p => format!("{p}/{hidden}"),
                    };
                    if !by_path.contains_key(shown.as_str()) {
                        items.insert(shown, (*idx, Presentation::Whiteout));
                    }
                }
                _ => {
                    items.insert((*path).to_string(), (*idx, Presentation::Entry));
                }
            }
        }
        for (path, (idx, how)) in &items {
            b.add(path, &entries[*idx], *how, || data_of(*idx), entry_at);
        }
        for dir in opaque {
            b.mark_opaque(dir);
        }
        Some(b.finish())
    }

    /// The node of inode `ino`.
    pub fn get(&self, ino: Ino) -> Option<&Node> {
        let i = usize::try_from(ino.checked_sub(1)?).ok()?;
        self.nodes.get(i)
    }

    /// Number of inodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the tree has no inode (never: the root always exists).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Looks `name` up in directory `parent`.
    pub fn lookup(&self, parent: Ino, name: &str) -> Option<Ino> {
        let dir = self.get(parent)?;
        if dir.kind != NodeKind::Dir {
            return None;
        }
        match name {
            "." => Some(parent),
            ".." => Some(dir.parent),
            _ => dir.child(name),
        }
    }

    /// Resolves an absolute or root-relative path without following symlinks.
    pub fn resolve(&self, path: &str) -> Option<Ino> {
        path.split('/')
            .filter(|c| !c.is_empty())
            .try_fold(ROOT_INO, |ino, c| self.lookup(ino, c))
    }

    /// The absolute path of inode `ino` (`/` for the root). A hard-linked file is named
    /// by the first link found walking up from its parent; `None` for an unknown inode.
    /// Cost: one scan of each ancestor's children, so callers that ask often should
    /// cache (the trace recorder asks once per file).
    pub fn path_of(&self, ino: Ino) -> Option<String> {
        let mut names: Vec<&str> = Vec::new();
        let mut cur = ino;
        // A well-formed tree is at most `len` deep; the bound guards a cycle.
        for _ in 0..=self.nodes.len() {
            if cur == ROOT_INO {
                names.reverse();
                return Some(format!("/{}", names.join("/")));
            }
            let node = self.get(cur)?;
            let parent = self.get(node.parent)?;
            let (name, _) = parent.children.iter().find(|(_, c)| *c == cur)?;
            names.push(name);
            cur = node.parent;
        }
        None
    }

    /// Directory listing from `offset`: `.` and `..` are offsets 0 and 1, child `i` is
    /// offset `i + 2`. Each item carries the offset of the item after it, the cookie the
    /// kernel hands back to continue.
    pub fn readdir(&self, dir: Ino, offset: u64) -> Option<DirIter<'_>> {
        let node = self.get(dir)?;
        if node.kind != NodeKind::Dir {
            return None;
        }
        Some(DirIter {
            ino: dir,
            node,
            pos: offset,
        })
    }
}

/// One directory item as [`InodeTree::readdir`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirItem<'a> {
    /// The inode.
    pub ino: Ino,
    /// Offset of the next item.
    pub next_offset: u64,
    /// The name.
    pub name: &'a str,
}

/// Iterator over a directory from an offset.
#[derive(Debug)]
pub struct DirIter<'a> {
    ino: Ino,
    node: &'a Node,
    pos: u64,
}

impl<'a> Iterator for DirIter<'a> {
    type Item = DirItem<'a>;

    fn next(&mut self) -> Option<DirItem<'a>> {
        let (ino, name) = match self.pos {
            0 => (self.ino, "."),
            1 => (self.node.parent, ".."),
            p => {
                let i = usize::try_from(p - 2).ok()?;
                let (name, ino) = self.node.children.get(i)?;
                (*ino, name.as_str())
            }
        };
        self.pos += 1;
        Some(DirItem {
            ino,
            next_offset: self.pos,
            name,
        })
    }
}

struct Builder {
    nodes: Vec<Node>,
    dirs: HashMap<String, Ino>,
    /// Data location → inode of the regular file holding it (hard links share it).
    files: HashMap<(usize, usize), Ino>,
}

impl Builder {
    fn new() -> Builder {
        let mut dirs = HashMap::new();
        dirs.insert(String::new(), ROOT_INO);
        Builder {
            nodes: vec![Node::dir(ROOT_INO)],
            dirs,
            files: HashMap::new(),
        }
    }

    fn push(&mut self, node: Node) -> Ino {
        self.nodes.push(node);
        self.nodes.len() as Ino
    }

    fn node_mut(&mut self, ino: Ino) -> &mut Node {
        let i = (ino - 1) as usize;
        &mut self.nodes[i]
    }

    /// The directory at `path`, made up (with its missing ancestors) when absent.
    /// `None` when something that is not a directory is in the way.
    fn dir_at(&mut self, path: &str) -> Option<Ino> {
        if let Some(ino) = self.dirs.get(path) {
            return Some(*ino);
        }
        let (parent_path, name) = match path.rfind('/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => ("", path),
        };
        let parent = self.dir_at(parent_path)?;
        if self.nodes[(parent - 1) as usize].child(name).is_some() {
            return None;
        }
        let ino = self.push(Node::dir(parent));
        self.link(parent, name, ino);
        self.dirs.insert(path.to_string(), ino);
        Some(ino)
    }

    fn link(&mut self, parent: Ino, name: &str, ino: Ino) {
        let dir = self.node_mut(parent);
        match dir
            .children
            .binary_search_by(|(n, _)| n.as_bytes().cmp(name.as_bytes()))
        {
            Ok(i) => dir.children[i].1 = ino,
            Err(i) => dir.children.insert(i, (name.to_string(), ino)),
        }
    }

    fn add<'e>(
        &mut self,
        path: &str,
        entry: &'e Entry,
        how: Presentation,
        data: impl FnOnce() -> Option<Location>,
        entry_at: impl Fn(Location) -> Option<&'e Entry>,
    ) {
        if path.is_empty() {
            // The root: keep inode 1, take the entry's metadata.
            if entry.kind == EntryKind::Dir {
                let children = std::mem::take(&mut self.nodes[0].children);
                let mut root = Node::from_entry(ROOT_INO, entry);
                root.children = children;
                self.nodes[0] = root;
            }
            return;
        }
        let (parent_path, name) = match path.rfind('/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => ("", path),
        };
        let Some(parent) = self.dir_at(parent_path) else {
            tracing::warn!(path, "parent is not a directory; entry skipped");
            return;
        };
        let ino = match (how, entry.kind) {
            (Presentation::Whiteout, _) => {
                let mut n = Node::from_entry(parent, entry);
                n.kind = NodeKind::Char;
                n.size = 0;
                n.rdev = (0, 0);
                n.mode &= 0o7777;
                n.xattrs.clear();
                self.push(n)
            }
            (_, EntryKind::Dir) => {
                if let Some(existing) = self.dirs.get(path).copied() {
                    // Made up earlier for a child listed before its directory.
                    let children = std::mem::take(&mut self.node_mut(existing).children);
                    let mut n = Node::from_entry(parent, entry);
                    n.children = children;
                    *self.node_mut(existing) = n;
                    return;
                }
                let ino = self.push(Node::from_entry(parent, entry));
                self.dirs.insert(path.to_string(), ino);
                ino
            }
            (_, EntryKind::File | EntryKind::Hardlink) => {
                let Some(at) = data() else {
                    tracing::warn!(path, target = %entry.link_target, "hard link to a missing file; skipped");
                    return;
                };
                if let Some(ino) = self.files.get(&(at.layer, at.entry)).copied() {
                    self.node_mut(ino).nlink += 1;
                    ino
                } else {
                    let holder = entry_at(at).unwrap_or(entry);
                    let mut n = Node::from_entry(parent, holder);
                    n.kind = NodeKind::File;
                    n.size = holder.size;
                    n.data = Some(at);
                    let ino = self.push(n);
                    self.files.insert((at.layer, at.entry), ino);
                    ino
                }
            }
            _ => self.push(Node::from_entry(parent, entry)),
        };
        self.link(parent, name, ino);
    }

    fn mark_opaque(&mut self, dir: &str) {
        if let Some(ino) = self.dir_at(dir) {
            let node = self.node_mut(ino);
            node.xattrs.retain(|(n, _)| n != OVERLAY_OPAQUE_XATTR);
            node.xattrs
                .push((OVERLAY_OPAQUE_XATTR.to_string(), b"y".to_vec()));
            node.xattrs.sort();
        }
    }

    fn finish(mut self) -> InodeTree {
        // Directory link counts: 2 + subdirectories.
        let mut subdirs = vec![0u32; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if n.kind == NodeKind::Dir && i != 0 {
                subdirs[(n.parent - 1) as usize] += 1;
            }
        }
        for (n, extra) in self.nodes.iter_mut().zip(subdirs) {
            if n.kind == NodeKind::Dir {
                n.nlink = 2 + extra;
            }
        }
        InodeTree { nodes: self.nodes }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use ferry_index::reader::{LayerFormat, LayerReader};
    use ferry_index::source::MemSource;

    use super::*;

    fn e(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.into(),
            kind,
            mode: if kind == EntryKind::Dir { 0o755 } else { 0o644 },
            ..Default::default()
        }
    }

    fn file(path: &str, size: u64) -> Entry {
        Entry {
            size,
            ..e(path, EntryKind::File)
        }
    }

    fn link(path: &str, kind: EntryKind, target: &str) -> Entry {
        Entry {
            link_target: target.into(),
            ..e(path, kind)
        }
    }

    fn layer(entries: Vec<Entry>) -> LayerReader {
        LayerReader::new(
            LayerFormat::Whole {
                tar: Arc::new(Vec::new()),
                entries: Arc::new(entries),
            },
            Arc::new(MemSource(Vec::new())),
        )
    }

    fn names(tree: &InodeTree, dir: &str) -> Vec<String> {
        let ino = tree.resolve(dir).unwrap();
        tree.readdir(ino, 2)
            .unwrap()
            .map(|i| i.name.to_string())
            .collect()
    }

    #[test]
    fn merged_tree_has_metadata_links_and_made_up_parents() {
        let mut dev = e("dev/null", EntryKind::Char);
        dev.dev_major = 1;
        dev.dev_minor = 3;
        let mut xf = file("etc/cap", 3);
        xf.xattrs
            .insert("security.capability".into(), vec![1, 2, 3]);
        xf.uid = 1000;
        xf.gid = 100;
        xf.mtime = 1_700_000_000;
        xf.mode = 0o4755;
        let l0 = layer(vec![
            e("", EntryKind::Dir),
            e("etc", EntryKind::Dir),
            xf,
            file("usr/bin/a", 10), // usr and usr/bin never listed
            link("bin/b", EntryKind::Hardlink, "usr/bin/a"), // sorts before its target
            link("etc/link", EntryKind::Symlink, "../usr/bin/a"),
            dev,
            e("run/fifo", EntryKind::Fifo),
        ]);
        let image = MergedImage::new(vec![l0]);
        let tree = InodeTree::merged(&image);

        let a = tree.resolve("usr/bin/a").unwrap();
        let b = tree.resolve("bin/b").unwrap();
        assert_eq!(a, b, "hard links share one inode");
        let node = tree.get(a).unwrap();
        assert_eq!(node.nlink, 2);
        assert_eq!(node.size, 10);
        assert_eq!(node.data, Some(Location { layer: 0, entry: 3 }));

        let usr = tree.get(tree.resolve("usr").unwrap()).unwrap();
        assert_eq!((usr.kind, usr.mode, usr.nlink), (NodeKind::Dir, 0o755, 3));
        let root = tree.get(ROOT_INO).unwrap();
        assert_eq!(root.nlink, 2 + 5, "etc usr bin dev run");

        let cap = tree.get(tree.resolve("etc/cap").unwrap()).unwrap();
        assert_eq!(
            (cap.uid, cap.gid, cap.mode, cap.mtime),
            (1000, 100, 0o4755, 1_700_000_000)
        );
        assert_eq!(cap.xattr("security.capability"), Some(&[1u8, 2, 3][..]));

        let l = tree.get(tree.resolve("etc/link").unwrap()).unwrap();
        assert_eq!(
            (l.kind, l.link_target.as_str(), l.size),
            (NodeKind::Symlink, "../usr/bin/a", 12)
        );
        let null = tree.get(tree.resolve("dev/null").unwrap()).unwrap();
        assert_eq!((null.kind, null.rdev), (NodeKind::Char, (1, 3)));
        let fifo = tree.get(tree.resolve("run/fifo").unwrap()).unwrap();
        assert_eq!(fifo.kind, NodeKind::Fifo);

        assert_eq!(tree.lookup(a, ".."), None, "files have no entries");
        let bin = tree.resolve("usr/bin").unwrap();
        assert_eq!(tree.lookup(bin, ".."), tree.resolve("usr"));
    }

    #[test]
    fn merged_tree_applies_whiteouts_and_opaque_dirs() {
        let l0 = layer(vec![
            e("a", EntryKind::Dir),
            file("a/x", 1),
            file("a/y", 1),
            e("b", EntryKind::Dir),
            file("b/old", 1),
        ]);
        let l1 = layer(vec![
            file("a/.wh.x", 0),
            e("b", EntryKind::Dir),
            file("b/.wh..wh..opq", 0),
            file("b/new", 2),
        ]);
        let tree = InodeTree::merged(&MergedImage::new(vec![l0, l1]));
        assert_eq!(names(&tree, "a"), vec!["y"]);
        assert_eq!(names(&tree, "b"), vec!["new"]);
        let b = tree.get(tree.resolve("b").unwrap()).unwrap();
        assert!(
            b.xattrs.is_empty(),
            "the merged view shows no overlay xattrs"
        );
        assert!(!tree.has_xattrs(), "no entry has any");
    }

    #[test]
    fn single_layer_presents_whiteouts_for_overlayfs() {
        let l0 = layer(vec![e("a", EntryKind::Dir), file("a/x", 1)]);
        let l1 = layer(vec![
            e("a", EntryKind::Dir),
            file("a/.wh.x", 0),
            e("b", EntryKind::Dir),
            file("b/.wh..wh..opq", 0),
            file("b/new", 2),
            file(".wh.gone", 0),
        ]);
        let image = MergedImage::new(vec![l0, l1]);
        let tree = InodeTree::single_layer(&image, 1).unwrap();
        assert_eq!(names(&tree, ""), vec!["a", "b", "gone"]);
        assert_eq!(names(&tree, "a"), vec!["x"]);
        for p in ["a/x", "gone"] {
            let wh = tree.get(tree.resolve(p).unwrap()).unwrap();
            assert_eq!(
                (wh.kind, wh.rdev, wh.size),
                (NodeKind::Char, (0, 0), 0),
                "{p}"
            );
        }
        assert_eq!(
            names(&tree, "b"),
            vec!["new"],
            "the opaque marker is not listed"
        );
        let b = tree.get(tree.resolve("b").unwrap()).unwrap();
        assert_eq!(b.xattr(OVERLAY_OPAQUE_XATTR), Some(&b"y"[..]));
        let a = tree.get(tree.resolve("a").unwrap()).unwrap();
        assert_eq!(a.xattr(OVERLAY_OPAQUE_XATTR), None);
        assert!(tree.has_xattrs(), "the opaque marker is an xattr");
        let lower = InodeTree::single_layer(&image, 0).unwrap();
        assert!(!lower.has_xattrs(), "a layer without xattrs or opaque dirs");
        assert!(InodeTree::single_layer(&image, 2).is_none());
    }

    #[test]
    fn single_layer_hard_links_and_replaced_members() {
        let l0 = layer(vec![
            file("f", 1),
            file("f", 7), // a later member of the same path wins
            link("g", EntryKind::Hardlink, "f"),
            link("h", EntryKind::Hardlink, "missing"),
        ]);
        let image = MergedImage::new(vec![l0]);
        let tree = InodeTree::single_layer(&image, 0).unwrap();
        let f = tree.resolve("f").unwrap();
        assert_eq!(tree.resolve("g"), Some(f));
        let node = tree.get(f).unwrap();
        assert_eq!((node.size, node.nlink), (7, 2));
        assert_eq!(node.data, Some(Location { layer: 0, entry: 1 }));
        assert_eq!(tree.resolve("h"), None, "a link to nothing is left out");
    }

    #[test]
    fn readdir_offsets_page_through_a_large_directory() {
        let mut entries = vec![e("big", EntryKind::Dir)];
        let mut expected: Vec<String> = (0..10_000).map(|i| format!("f{i:05}")).collect();
        // Listed out of order; the tree sorts.
        for name in expected.iter().rev() {
            entries.push(file(&format!("big/{name}"), 0));
        }
        expected.sort();
        let tree = InodeTree::merged(&MergedImage::new(vec![layer(entries)]));
        let big = tree.resolve("big").unwrap();

        let mut seen = Vec::new();
        let mut offset = 0;
        loop {
            let page: Vec<DirItem<'_>> = tree.readdir(big, offset).unwrap().take(97).collect();
            let Some(last) = page.last() else { break };
            offset = last.next_offset;
            seen.extend(page.iter().map(|i| (i.name.to_string(), i.ino)));
        }
        assert_eq!(seen.len(), 10_002);
        assert_eq!(seen[0], (".".to_string(), big));
        assert_eq!(seen[1], ("..".to_string(), ROOT_INO));
        let listed: Vec<String> = seen[2..].iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(listed, expected);
        for (name, ino) in &seen[2..] {
            assert_eq!(tree.lookup(big, name), Some(*ino));
        }
        // Resuming from any cookie gives the item after it.
        let item = tree.readdir(big, 5000).unwrap().next().unwrap();
        assert_eq!(item.name, expected[4998]);
        assert_eq!(item.next_offset, 5001);
        assert!(tree.readdir(big, 10_002).unwrap().next().is_none());
        assert!(tree.readdir(big, u64::MAX).unwrap().next().is_none());
    }

    #[test]
    fn entries_under_a_file_are_skipped() {
        let l0 = layer(vec![file("x", 1), file("x/y", 1)]);
        let tree = InodeTree::merged(&MergedImage::new(vec![l0]));
        assert_eq!(tree.resolve("x/y"), None);
        assert!(tree.readdir(tree.resolve("x").unwrap(), 0).is_none());
    }
}
