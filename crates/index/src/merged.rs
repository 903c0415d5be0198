//! The merged root filesystem of an image: its layers stacked, whiteouts applied.
//!
//! Layers are applied lowest first, following the OCI image spec's changeset rules:
//! `dir/.wh.name` removes `dir/name` and everything below it from the layers beneath;
//! `dir/.wh..wh..opq` hides every lower child of `dir`; an entry that is not a directory
//! replaces whatever was at its path and hides any lower directory contents there.
//! Lookups resolve symlinks the way a process chrooted into the image would see them.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use crate::entry::{Entry, EntryKind, Whiteout};
use crate::error::{Error, Result};
use crate::reader::LayerReader;

/// Where a merged path's entry lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Layer index, 0 = lowest.
    pub layer: usize,
    /// Entry index within that layer's file table.
    pub entry: usize,
}

/// Most symlinks followed in one lookup (Linux's limit).
const MAX_SYMLINKS: usize = 40;

/// Computes the merged path table of several layers' file tables (lowest first).
pub fn merge_tables<'a>(
    layers: impl IntoIterator<Item = &'a [Entry]>,
) -> BTreeMap<String, Location> {
    let mut map: BTreeMap<String, Location> = BTreeMap::new();
    for (layer, entries) in layers.into_iter().enumerate() {
        // Whiteouts in a layer act on the layers beneath only, so apply them first.
        for e in entries {
            match e.whiteout() {
                Whiteout::None => {}
                Whiteout::Remove(target) => {
                    map.remove(&target);
                    remove_descendants(&mut map, &target);
                }
                Whiteout::Opaque(dir) => remove_descendants(&mut map, dir),
            }
        }
        for (i, e) in entries.iter().enumerate() {
            if e.whiteout() != Whiteout::None {
                continue;
            }
            if e.kind != EntryKind::Dir && map.get(&e.path).is_some_and(|prev| prev.layer < layer) {
                remove_descendants(&mut map, &e.path);
            }
            map.insert(e.path.clone(), Location { layer, entry: i });
        }
    }
    map
}

fn remove_descendants(map: &mut BTreeMap<String, Location>, dir: &str) {
    if dir.is_empty() {
        map.retain(|k, _| k.is_empty());
        return;
    }
    let lo = format!("{dir}/");
    let hi = format!("{dir}0"); // '0' is the byte after '/'
    let doomed: Vec<String> = map.range(lo..hi).map(|(k, _)| k.clone()).collect();
    for k in doomed {
        map.remove(&k);
    }
}

/// An image's layers and their merged view.
#[derive(Debug, Clone)]
pub struct MergedImage {
    layers: Vec<LayerReader>,
    table: Arc<BTreeMap<String, Location>>,
}

impl MergedImage {
    /// Stacks `layers` (lowest first).
    pub fn new(layers: Vec<LayerReader>) -> Self {
        let table = merge_tables(layers.iter().map(|l| l.entries()));
        MergedImage {
            layers,
            table: Arc::new(table),
        }
    }

    /// Stacks `layers` (lowest first) over `table`, their merged table as
    /// [`merge_tables`] made it (shared with other views of the same stack).
    pub fn with_table(layers: Vec<LayerReader>, table: Arc<BTreeMap<String, Location>>) -> Self {
        MergedImage { layers, table }
    }

    /// The merged path table, shared.
    pub fn shared_table(&self) -> &Arc<BTreeMap<String, Location>> {
        &self.table
    }

    /// The layers, lowest first.
    pub fn layers(&self) -> &[LayerReader] {
        &self.layers
    }

    /// The merged path table.
    pub fn table(&self) -> &BTreeMap<String, Location> {
        &self.table
    }

    /// The entry at a location.
    pub fn entry(&self, loc: Location) -> Option<&Entry> {
        self.layers.get(loc.layer)?.entries().get(loc.entry)
    }

    /// Looks a path up as a process in the image would: absolute or relative to the root,
    /// following symlinks (also in the last component when `follow` is set).
    pub fn lookup(&self, path: &str, follow: bool) -> Result<Location> {
        let mut budget = MAX_SYMLINKS;
        self.resolve(path, follow, &mut budget)
    }

    fn resolve(&self, path: &str, follow_last: bool, budget: &mut usize) -> Result<Location> {
        let mut stack: Vec<String> = Vec::new();
        let components: Vec<&str> = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        let mut loc = None;
        for (i, comp) in components.iter().enumerate() {
            if *comp == ".." {
                stack.pop();
                loc = None;
                continue;
            }
            stack.push((*comp).to_string());
            let cur = stack.join("/");
            let last = i + 1 == components.len();
            let found = match self.table.get(&cur) {
                Some(found) => *found,
                // A directory a tar names only as its files' parent (no entry of its own).
                None if !last && self.implies_dir(&cur) => {
                    loc = None;
                    continue;
                }
                None => return Err(Error::NotFound(format!("/{cur}"))),
            };
            let entry = self
                .entry(found)
                .ok_or_else(|| Error::NotFound(format!("/{cur}")))?;
            if entry.kind == EntryKind::Symlink && (!last || follow_last) {
                if *budget == 0 {
                    return Err(Error::NotAFile {
                        path: path.to_string(),
                        reason: "too many levels of symbolic links".into(),
                    });
                }
                *budget -= 1;
                stack.pop();
                let base = if entry.link_target.starts_with('/') {
                    String::new()
                } else {
                    stack.join("/")
                };
                let rest: Vec<&str> = components[i + 1..].to_vec();
                let target = format!("{base}/{}/{}", entry.link_target, rest.join("/"));
                return self.resolve(&target, follow_last, budget);
            }
            loc = Some(found);
        }
        match loc {
            Some(l) => Ok(l),
            None if stack.is_empty() => self
                .table
                .get("")
                .copied()
                .ok_or_else(|| Error::NotFound("/".into())),
            None => self
                .table
                .get(&stack.join("/"))
                .copied()
                .ok_or_else(|| Error::NotFound(format!("/{}", stack.join("/")))),
        }
    }

    /// Whether some path of the table lies under `dir` (a directory without an entry).
    fn implies_dir(&self, dir: &str) -> bool {
        let prefix = format!("{dir}/");
        self.table
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&prefix))
    }

    /// Resolves a hard link to the entry holding the data (same layer first, then the
    /// merged view).
    pub fn data_location(&self, loc: Location) -> Result<Location> {
        let entry = self
            .entry(loc)
            .ok_or_else(|| Error::NotFound(format!("entry {loc:?}")))?;
        if entry.kind != EntryKind::Hardlink {
            return Ok(loc);
        }
        let layer = &self.layers[loc.layer];
        if let Some(i) = layer
            .entries()
            .iter()
            .position(|e| e.path == entry.link_target && e.kind == EntryKind::File)
        {
            return Ok(Location {
                layer: loc.layer,
                entry: i,
            });
        }
        self.table
            .get(&entry.link_target)
            .copied()
            .filter(|l| self.entry(*l).is_some_and(|e| e.kind == EntryKind::File))
            .ok_or_else(|| Error::NotAFile {
                path: entry.path.clone(),
                reason: format!("hard link to missing {}", entry.link_target),
            })
    }

    /// Writes the file at `path` (symlinks followed) to `out`; returns its size.
    pub fn cat(&self, path: &str, out: &mut dyn Write) -> Result<u64> {
        let loc = self.data_location(self.lookup(path, true)?)?;
        let entry = self
            .entry(loc)
            .ok_or_else(|| Error::NotFound(path.to_string()))?;
        if entry.kind != EntryKind::File {
            return Err(Error::NotAFile {
                path: path.to_string(),
                reason: format!("is a {:?}, not a regular file", entry.kind),
            });
        }
        self.layers[loc.layer].copy_file(loc.entry, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::test_entry as e;

    #[test]
    fn whiteouts_and_opaque_dirs_apply_to_lower_layers_only() {
        let l0 = [
            e("a", EntryKind::Dir),
            e("a/x", EntryKind::File),
            e("a/y", EntryKind::File),
            e("b", EntryKind::Dir),
            e("b/z", EntryKind::File),
            e("c", EntryKind::File),
            e("d", EntryKind::Dir),
            e("d/deep", EntryKind::File),
        ];
        let l1 = [
            e("a/.wh.x", EntryKind::File),
            e("b/.wh..wh..opq", EntryKind::File),
            e("b/new", EntryKind::File),
            e(".wh.c", EntryKind::File),
            e("d", EntryKind::File), // a file replacing a directory hides its contents
        ];
        let m = merge_tables([&l0[..], &l1[..]]);
        let keys: Vec<&str> = m.keys().map(|s| s.as_str()).collect();
        assert_eq!(keys, vec!["a", "a/y", "b", "b/new", "d"]);
        assert_eq!(m["d"], Location { layer: 1, entry: 4 });
        assert_eq!(m["b"], Location { layer: 0, entry: 3 });
    }

    #[test]
    fn opaque_marker_keeps_same_layer_children() {
        let l0 = [e("b", EntryKind::Dir), e("b/old", EntryKind::File)];
        let l1 = [
            e("b", EntryKind::Dir),
            e("b/mine", EntryKind::File),
            e("b/.wh..wh..opq", EntryKind::File),
        ];
        let m = merge_tables([&l0[..], &l1[..]]);
        assert!(m.contains_key("b/mine"));
        assert!(!m.contains_key("b/old"));
    }

    #[test]
    fn prefix_siblings_survive_whiteouts() {
        let l0 = [
            e("lib", EntryKind::Dir),
            e("lib/x", EntryKind::File),
            e("lib64", EntryKind::Dir),
            e("lib-old", EntryKind::File),
        ];
        let l1 = [e(".wh.lib", EntryKind::File)];
        let m = merge_tables([&l0[..], &l1[..]]);
        let keys: Vec<&str> = m.keys().map(|s| s.as_str()).collect();
        assert_eq!(keys, vec!["lib-old", "lib64"]);
    }
}
