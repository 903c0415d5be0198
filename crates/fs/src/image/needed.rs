//! Following a program's shared libraries ahead of its loader, for an image without a
//! trace: when the first read of a file shows an ELF header and waited, its
//! `PT_INTERP` and `DT_NEEDED` names ([`crate::image::elf::dependencies`]) are resolved in the
//! image as the loader would (its `DT_RUNPATH`/`DT_RPATH` with `$ORIGIN`, then the
//! multiarch and standard library directories, symlinks followed), and each library
//! found is fetched (whole when it is at most [`FetchConfig::whole_file_bytes`], else its
//! head and its loader segments) and followed in turn, on the pool of
//! [`crate::image::nearby`], in parallel.
//!
//! Why: the loader opens a program's libraries one after another, and each first read
//! of one waited a round trip of its own: 17 of the 79 waits of a pandas start, from
//! `ld-linux` and `libc` to `libopenblas` → `libgfortran` → `libquadmath`. Resolved
//! from the image's own files, the whole chain travels at once.
//!
//! An index written by `ferry index` since format 3 holds each ELF file's names
//! ([`ferry_index::ferryidx::Library`]): then a file's libraries are resolved and handed
//! to the pool before its own bytes arrive, so the chain costs one round trip, not one
//! per link. Otherwise they are read from the fetched file.
//!
//! The guesses are files' rests ([`Guess::Rest`]), within the same budget
//! ([`crate::image::nearby::Nearby::within_rest_budget`]); each file is followed once per mount,
//! at most [`crate::image::nearby::MAX_LIBRARIES`], [`MAX_DEPTH`] deep. It reads only ELF
//! headers, `.dynamic` and names, from bytes it has made local first (so it never counts
//! as a read that waited), and keeps nothing. A library in another layer of the image is
//! found through the merged table and fetched through this mount's source for that
//! layer (the store is shared, so the layer's own mount finds it local; its guess is
//! counted against this mount's budget).

use std::ops::Range;
use std::sync::{Arc, Weak};

use ferry_index::merged::Location;

use crate::image::MountedImage;
use crate::image::elf::Dependencies;
use crate::stats::{Guess, MountStats};

/// Bytes at a file's start read for its program headers (a linker puts them in the
/// first page).
const HEAD_BYTES: u64 = 16 << 10;
/// Libraries followed from a program, at most this many links deep.
pub const MAX_DEPTH: u8 = 8;

/// The Debian multiarch directory name of ELF machine `machine` (`e_machine`), where
/// Debian and Ubuntu keep its libraries.
fn multiarch(machine: u16, wide: bool) -> Option<&'static str> {
    Some(match (machine, wide) {
        (62, true) => "x86_64-linux-gnu",
        (183, true) => "aarch64-linux-gnu",
        (3, false) => "i386-linux-gnu",
        (40, false) => "arm-linux-gnueabihf",
        (243, true) => "riscv64-linux-gnu",
        (21, true) => "powerpc64le-linux-gnu",
        (22, true) => "s390x-linux-gnu",
        _ => return None,
    })
}

/// The directories the loader searches for `deps`'s libraries of a file in directory
/// `origin` (absolute), in its order: the file's run path (`$ORIGIN` replaced; entries
/// naming other variables, or relative, are left out), then the multiarch, `lib64` and
/// plain library directories of `/` and `/usr`, and `/usr/local/lib`. (The loader's
/// cache, `/etc/ld.so.cache`, only names files in such directories on the distributions
/// that ship one.)
pub(crate) fn search_dirs(deps: &Dependencies, origin: &str) -> Vec<String> {
    let mut dirs: Vec<String> = Vec::new();
    for d in &deps.search {
        let d = d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin);
        if d.starts_with('/') && !d.contains('$') && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    let mut standard = Vec::new();
    if let Some(triplet) = multiarch(deps.machine, deps.wide) {
        standard.push(format!("/lib/{triplet}"));
        standard.push(format!("/usr/lib/{triplet}"));
    }
    if deps.wide {
        standard.push("/lib64".into());
        standard.push("/usr/lib64".into());
    }
    for d in ["/lib", "/usr/lib", "/usr/local/lib"] {
        standard.push(d.into());
    }
    for d in standard {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

/// For each of `deps`'s libraries (its interpreter first), the paths it may be at, in
/// the loader's order.
pub(crate) fn candidates(deps: &Dependencies, origin: &str) -> Vec<Vec<String>> {
    let dirs = search_dirs(deps, origin);
    let mut out: Vec<Vec<String>> = Vec::new();
    if let Some(interp) = &deps.interpreter {
        out.push(vec![interp.clone()]);
    }
    for name in &deps.needed {
        out.push(dirs.iter().map(|d| format!("{d}/{name}")).collect());
    }
    out
}

impl MountedImage {
    /// After the first read of the file at `loc` waited and showed an ELF header: its
    /// libraries are followed on the pool (once per file).
    pub(crate) fn follow_libraries(self: &Arc<Self>, loc: Location) {
        if !self.nearby.first_library((loc.layer, loc.entry)) {
            return;
        }
        let image = Arc::downgrade(self);
        crate::image::nearby::submit_task(Box::new(move || follow(&image, loc, 0, false)));
    }

    /// An extension module an import loads ([`crate::image::imports`]): fetched and its
    /// libraries followed, on the pool (once per file).
    pub(super) fn follow_library_fetched(self: &Arc<Self>, loc: Location) {
        if !self.nearby.first_library((loc.layer, loc.entry)) {
            return;
        }
        let image = Arc::downgrade(self);
        crate::image::nearby::submit_task(Box::new(move || follow(&image, loc, 1, true)));
    }

    /// The file at `path` in the image, a regular file (symlinks and hard links
    /// followed).
    pub(super) fn regular_file(&self, path: &str) -> Option<Location> {
        let at = self.image.lookup(path, true).ok()?;
        let at = self.image.data_location(at).ok()?;
        let entry = self.image.entry(at)?;
        (entry.kind == ferry_index::entry::EntryKind::File && entry.size > 0).then_some(at)
    }

    /// Makes `[off, off + len)` of the file at `loc` local, as a guess of a file's rest.
    pub(super) fn make_local(&self, loc: Location, off: u64, len: u64) {
        let (Some(source), Some(layer)) = (
            self.layer_source(loc.layer),
            self.image.layers().get(loc.layer),
        ) else {
            return;
        };
        for r in layer.ranges_for(loc.entry, off, len) {
            fetch_guess(source, &self.stats, r);
        }
    }
}

fn fetch_guess(source: &crate::device::LayerSource, stats: &MountStats, r: Range<u64>) {
    if !source.range_missing(r.clone()) {
        return;
    }
    match source.warm_guessed(r, Guess::Rest) {
        Ok(n) => MountStats::add(&stats.bytes_nearby, n),
        Err(e) => tracing::debug!(error = %e, "library fetch failed; read when needed"),
    }
}

/// Follows the file at `loc`: fetches it first unless it is the file whose read asked
/// (`fetch_own`), then its libraries, each as a task of its own.
///
/// When the layer's index recorded the file's libraries, they are resolved and handed
/// to the pool before the file's own bytes are fetched, so a whole chain (`libopenblas`
/// → `libgfortran` → `libquadmath`) is asked for at once; otherwise they are read from
/// the file, one link after the other.
fn follow(image: &Weak<MountedImage>, loc: Location, depth: u8, fetch_own: bool) {
    let Some(image) = image.upgrade() else {
        return;
    };
    let Some(entry) = image.image.entry(loc) else {
        return;
    };
    let (size, path) = (entry.size, entry.path.clone());
    let Some(layer) = image.image.layers().get(loc.layer) else {
        return;
    };
    if fetch_own {
        let spent = crate::image::nearby::Spent::of(&image.stats);
        if !image
            .nearby
            .within_rest_budget(spent.rest_unused, spent.served)
        {
            tracing::debug!(path, "nearby: library not followed, over the guess budget");
            return;
        }
    }
    if let Some(recorded) = layer.recorded_libraries(loc.entry) {
        if let Some(deps) = recorded {
            follow_dependencies(&image, deps, &path, depth, true);
        }
        if fetch_own {
            fetch_library(&image, loc, size);
        }
        return;
    }
    let head = if fetch_own {
        fetch_library(&image, loc, size)
    } else {
        read_head(&image, loc, size)
    };
    let Some(head) = head.filter(|h| h.starts_with(b"\x7fELF")) else {
        return;
    };
    let mut read = |off: u64, len: usize| -> Option<Vec<u8>> {
        let len = (len as u64).min(size.saturating_sub(off));
        image.make_local(loc, off, len);
        let mut buf = vec![0u8; len as usize];
        let n = layer.read_at(loc.entry, off, &mut buf).ok()?;
        buf.truncate(n);
        Some(buf)
    };
    match crate::image::elf::dependencies(&head, size, &mut read) {
        Ok(deps) => follow_dependencies(&image, &deps, &path, depth, false),
        Err(e) => tracing::debug!(path, error = %e, "no dependencies read from an ELF file"),
    }
}

/// The first bytes of the file at `loc` (its program headers), read from what is local
/// or fetched; `None` when they cannot be had.
fn read_head(image: &MountedImage, loc: Location, size: u64) -> Option<Vec<u8>> {
    let layer = image.image.layers().get(loc.layer)?;
    let mut head = vec![0u8; HEAD_BYTES.min(size) as usize];
    let n = layer.read_at(loc.entry, 0, &mut head).ok()?;
    head.truncate(n);
    Some(head)
}

/// Fetches a library the loader will map: whole when it is small, else its head and
/// (on the pool) the segments the loader touches. Returns its head.
fn fetch_library(image: &MountedImage, loc: Location, size: u64) -> Option<Vec<u8>> {
    let whole = image.nearby.whole_file_bytes();
    if size <= whole {
        image.make_local(loc, 0, size);
        return read_head(image, loc, size);
    }
    image.make_local(loc, 0, HEAD_BYTES.min(size));
    let head = read_head(image, loc, size)?;
    if let Ok(segments) = crate::image::elf::loader_ranges(&head, size)
        && let Some(source) = image.layer_source(loc.layer)
    {
        let ranges = image
            .nearby
            .loader_segments(&image.nearby_layers(), loc, segments);
        crate::image::nearby::submit(
            source,
            &image.stats,
            ranges,
            Guess::Rest,
            crate::image::nearby::Urgency::Now,
        );
    }
    Some(head)
}

/// Resolves `deps` of the file at `path` in the image and hands each library found,
/// not followed before in this mount, to the pool (`recorded`: the names came from the
/// index, for the debug line).
fn follow_dependencies(
    image: &Arc<MountedImage>,
    deps: &Dependencies,
    path: &str,
    depth: u8,
    recorded: bool,
) {
    if depth >= MAX_DEPTH {
        return;
    }
    let origin = format!("/{}", path.rsplit_once('/').map_or("", |(dir, _)| dir));
    let origin = origin.trim_end_matches('/');
    let mut followed = Vec::new();
    // Names only for the debug line: which libraries this follow claimed, which an
    // earlier follow in this mount had, which the image does not hold where looked.
    let (mut before, mut unresolved) = (Vec::new(), Vec::new());
    let name = |paths: &[String]| {
        paths
            .first()
            .and_then(|p| p.rsplit('/').next())
            .map(str::to_owned)
    };
    for paths in candidates(deps, if origin.is_empty() { "/" } else { origin }) {
        let Some(found) = paths.iter().find_map(|p| image.regular_file(p)) else {
            unresolved.extend(name(&paths));
            continue;
        };
        if image.nearby.first_library((found.layer, found.entry)) {
            followed.push(found);
        } else {
            before.extend(name(&paths));
        }
    }
    tracing::debug!(
        path,
        libraries = followed.len(),
        ?before,
        ?unresolved,
        depth,
        recorded,
        "nearby: libraries followed"
    );
    for found in followed {
        let weak = Arc::downgrade(image);
        crate::image::nearby::submit_task(Box::new(move || follow(&weak, found, depth + 1, true)));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn deps(search: &[&str]) -> Dependencies {
        Dependencies {
            interpreter: Some("/lib64/ld-linux-x86-64.so.2".into()),
            needed: vec!["libm.so.6".into(), "libc.so.6".into()],
            search: search.iter().map(|s| s.to_string()).collect(),
            machine: 62,
            wide: true,
        }
    }

    #[test]
    fn the_run_path_comes_first_with_origin_replaced_then_the_standard_dirs() {
        let d = deps(&["$ORIGIN/../lib", "${ORIGIN}/x", "$LIB/y", "rel", "/opt/z"]);
        assert_eq!(
            search_dirs(&d, "/app/bin"),
            vec![
                "/app/bin/../lib",
                "/app/bin/x",
                "/opt/z",
                "/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu",
                "/lib64",
                "/usr/lib64",
                "/lib",
                "/usr/lib",
                "/usr/local/lib",
            ]
        );
    }

    #[test]
    fn a_32_bit_arm_file_searches_its_own_multiarch_dir_and_no_lib64() {
        let d = Dependencies {
            machine: 40,
            wide: false,
            ..Dependencies::default()
        };
        assert_eq!(
            search_dirs(&d, "/"),
            vec![
                "/lib/arm-linux-gnueabihf",
                "/usr/lib/arm-linux-gnueabihf",
                "/lib",
                "/usr/lib",
                "/usr/local/lib"
            ]
        );
    }

    #[test]
    fn candidates_name_the_interpreter_then_each_library_in_every_dir() {
        let c = candidates(&deps(&[]), "/usr/bin");
        assert_eq!(c.len(), 3);
        assert_eq!(c[0], vec!["/lib64/ld-linux-x86-64.so.2"]);
        assert_eq!(c[1][0], "/lib/x86_64-linux-gnu/libm.so.6");
        assert_eq!(c[2][1], "/usr/lib/x86_64-linux-gnu/libc.so.6");
    }
}
