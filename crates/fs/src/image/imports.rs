//! Following a Python program's imports ahead of its interpreter, for an image without
//! a trace: when the first read of a compiled module (`__pycache__/NAME.cpython-3XY.pyc`)
//! waited, the imports its module-level code runs ([`crate::image::pyc::imports`]) are
//! resolved in the image as CPython's path finder would resolve them, and each module
//! found — its package `__init__`s, the module, and the names of a `from … import` that
//! are submodules — is fetched whole on the pool of [`crate::image::nearby`] (one
//! request per importing module and layer), read once, kept in the small-file pack
//! where the interpreter's read finds it ([`crate::filepack`]), and followed in turn.
//!
//! Why: an interpreter imports a package's modules one after another, each found only
//! once the module before it runs, so every first read of a module waited a round trip:
//! most of the sixty-odd waits of a pandas + numpy + scipy start without a trace. Their
//! neighbours in the directory ([`crate::image::nearby`]) are a guess that a budget
//! must stop; the imports a module runs are what the interpreter reads next for certain.
//!
//! Resolution, per import: a relative one from the importing module's package; an
//! absolute one from the first of the interpreter's search directories where its top
//! package is — the tree the importing module is in (the directory above its top
//! package), the standard library of its version under the same prefix and under
//! `/usr` and `/usr/local` with `lib-dynload`, then `site-packages` and Debian's
//! `dist-packages`. For each module: an extension module (`.cpython-3XY-*.so`,
//! `.abi3.so`, `.so`), else the compiled source in `__pycache__`, else the source. An
//! extension module goes to [`crate::image::needed`], whose loader follows its
//! libraries.
//!
//! The guesses are files' rests ([`Guess::Rest`]), within the same budget
//! ([`crate::image::nearby::Nearby::within_rest_budget`]); each module is followed once per
//! mount, at most [`crate::image::nearby::MAX_MODULES`]. It reads modules only from
//! bytes it has made local first and keeps no file data itself. (Without the pack, a
//! module read ahead to parse it was inflated a second time by the interpreter's read
//! once the inflated-span cache had let it go: 211 MB inflated instead of 117 MB.)

use std::sync::{Arc, Weak};

use ferry_index::entry::EntryKind;
use ferry_index::merged::Location;

use crate::image::MountedImage;
use crate::image::pyc::Import;

/// Largest compiled module read for its imports (the largest of numpy, pandas and scipy
/// are about 1 MB).
pub const MAX_PYC_BYTES: u64 = 4 << 20;

/// The machine triplet of an extension module's suffix
/// (`.cpython-311-x86_64-linux-gnu.so`): the node's, which runs the image.
const TRIPLET: &str = if cfg!(target_arch = "aarch64") {
    "aarch64-linux-gnu"
} else if cfg!(target_arch = "powerpc64") {
    "powerpc64le-linux-gnu"
} else if cfg!(target_arch = "s390x") {
    "s390x-linux-gnu"
} else if cfg!(target_arch = "riscv64") {
    "riscv64-linux-gnu"
} else {
    "x86_64-linux-gnu"
};

/// Where a compiled module sits, as its path tells: what its imports resolve against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Module {
    /// The cache tag of its interpreter (`cpython-311`).
    tag: String,
    /// `3.11`.
    version: String,
    /// The directory of the package it is in (its own directory, for an `__init__`).
    package_dir: String,
    /// The directories absolute imports search, in order.
    roots: Vec<String>,
}

impl Module {
    /// The module compiled to `path` (absolute, `…/__pycache__/NAME.cpython-3XY.pyc`),
    /// with `is_package_dir(dir)`: whether a directory holds an `__init__.py` (to find
    /// the tree it is in). `None` for any other path.
    pub(crate) fn of(path: &str, is_package_dir: &dyn Fn(&str) -> bool) -> Option<Module> {
        let (cache_dir, file) = path.rsplit_once('/')?;
        let (dir, cache) = cache_dir.rsplit_once('/')?;
        if cache != "__pycache__" {
            return None;
        }
        let stem = file.strip_suffix(".pyc")?;
        let (_, tag) = stem.rsplit_once('.')?;
        let digits = tag.strip_prefix("cpython-3")?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let version = format!("3.{digits}");
        let dir = if dir.is_empty() { "/" } else { dir };
        // The tree the module is in: the directory above its top package.
        let mut top = dir.to_string();
        while top != "/" && is_package_dir(&top) {
            top = parent(&top).to_string();
        }
        let roots = search_roots(&top, dir, &version);
        Some(Module {
            tag: tag.to_string(),
            version,
            package_dir: dir.to_string(),
            roots,
        })
    }

    /// The interpreter whose binary is `binary` (`PREFIX/bin/python3.X`, absolute), as
    /// the program it runs sees it: absolute imports search `first` (a script's
    /// directory) before the interpreter's own directories. `None` for any other path.
    pub(crate) fn interpreter(binary: &str, first: Option<&str>) -> Option<Module> {
        let (bin_dir, name) = binary.rsplit_once('/')?;
        let digits = name.strip_prefix("python3.")?;
        if digits.is_empty() || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let version = format!("3.{digits}");
        let stdlib = join(parent(bin_dir), &format!("lib/python{version}"));
        let top = first.map_or_else(|| stdlib.clone(), str::to_string);
        let roots = search_roots(&top, &stdlib, &version);
        Some(Module {
            tag: format!("cpython-3{digits}"),
            version,
            package_dir: top,
            roots,
        })
    }

    /// The interpreter's minor version (11 for 3.11).
    pub(crate) fn minor(&self) -> u32 {
        self.version
            .strip_prefix("3.")
            .and_then(|m| m.parse().ok())
            .unwrap_or(0)
    }

    /// For import `imp`, the modules it loads, each as the paths it may be at in the
    /// order the interpreter tries them (given `exists(dir)`, whether a directory is in
    /// the image): the packages on the way, the module, and the `from` names as
    /// submodules.
    pub(crate) fn candidates(
        &self,
        imp: &Import,
        root_of: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<Vec<String>> {
        let parts: Vec<&str> = imp.module.split('.').filter(|p| !p.is_empty()).collect();
        if parts.iter().any(|p| !is_identifier(p)) {
            return Vec::new();
        }
        let (base, chain): (String, Vec<&str>) = if imp.level > 0 {
            let mut base = self.package_dir.clone();
            for _ in 1..imp.level {
                if base == "/" {
                    return Vec::new();
                }
                base = parent(&base).to_string();
            }
            (base, parts)
        } else {
            let Some(first) = parts.first() else {
                return Vec::new();
            };
            let Some(root) = root_of(first) else {
                return Vec::new();
            };
            (root, parts)
        };
        let mut out = Vec::new();
        let mut dir = base;
        for part in &chain {
            out.push(self.module_files(&dir, part));
            dir = join(&dir, part);
        }
        for name in &imp.names {
            if is_identifier(name) {
                out.push(self.module_files(&dir, name));
            }
        }
        out
    }

    /// The first of the search directories that has top-level module or package
    /// `first` (given `exists(path)`).
    pub(crate) fn find_root(&self, first: &str, exists: &dyn Fn(&str) -> bool) -> Option<String> {
        self.roots
            .iter()
            .find(|r| {
                exists(&join(r, first)) || self.module_files(r, first).iter().any(|p| exists(p))
            })
            .cloned()
    }

    /// What [`Self::find_root`] depends on besides the name: a key for caching it.
    pub(crate) fn roots_key(&self, first: &str) -> String {
        format!("{}|{}|{first}", self.roots[0], self.version)
    }

    /// The files module `name` in directory `dir` may be, in the interpreter's order:
    /// extension modules, then the compiled and plain source of a package, then of a
    /// module.
    fn module_files(&self, dir: &str, name: &str) -> Vec<String> {
        let mut files = Vec::new();
        let digits = self.tag.trim_start_matches("cpython-");
        files.push(format!(
            "{}/{name}.cpython-{digits}-{TRIPLET}.so",
            trim(dir)
        ));
        files.push(format!("{}/{name}.abi3.so", trim(dir)));
        files.push(format!("{}/{name}.so", trim(dir)));
        let pkg = join(dir, name);
        files.push(format!(
            "{}/__pycache__/__init__.{}.pyc",
            trim(&pkg),
            self.tag
        ));
        files.push(format!("{}/__init__.py", trim(&pkg)));
        files.push(format!("{}/__pycache__/{name}.{}.pyc", trim(dir), self.tag));
        files.push(format!("{}/{name}.py", trim(dir)));
        files
    }

    /// The interpreter version (`3.11`).
    #[cfg(test)]
    fn version(&self) -> &str {
        &self.version
    }
}

/// The directories an interpreter of `version` searches for absolute imports, in its
/// order, for a module in directory `dir` whose tree is `top`: the tree, the standard
/// library under `dir`'s own prefix (a venv's or /opt's interpreter) and then the
/// system's, with `lib-dynload`, then `site-packages` and Debian's `dist-packages`.
fn search_roots(top: &str, dir: &str, version: &str) -> Vec<String> {
    let mut roots: Vec<String> = Vec::new();
    let mut add = |d: String| {
        if !roots.contains(&d) {
            roots.push(d);
        }
    };
    add(top.to_string());
    let lib = format!("/lib/python{version}");
    let mut prefixes: Vec<String> = Vec::new();
    if let Some(i) = dir
        .find(&format!("{lib}/"))
        .or_else(|| dir.ends_with(&lib).then(|| dir.len() - lib.len()))
    {
        prefixes.push(dir[..i].to_string());
    }
    for p in ["/usr", "/usr/local"] {
        if !prefixes.iter().any(|q| q == p) {
            prefixes.push(p.to_string());
        }
    }
    for p in &prefixes {
        add(format!("{p}{lib}"));
        add(format!("{p}{lib}/lib-dynload"));
    }
    for p in &prefixes {
        add(format!("{p}{lib}/site-packages"));
        add(format!("{p}{lib}/dist-packages"));
    }
    add("/usr/lib/python3/dist-packages".to_string());
    roots
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars().all(|c| c == '_' || c.is_alphanumeric())
}

fn trim(dir: &str) -> &str {
    dir.trim_end_matches('/')
}

fn join(dir: &str, name: &str) -> String {
    format!("{}/{name}", trim(dir))
}

fn parent(dir: &str) -> &str {
    match dir.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((p, _)) => p,
    }
}

impl MountedImage {
    /// After the compiled module at `loc` was read whole (`data`): its imports are
    /// followed on the pool (once per module).
    pub(crate) fn follow_imports(self: &Arc<Self>, loc: Location, data: &[u8]) {
        let whole = self
            .image
            .entry(loc)
            .is_some_and(|e| e.size == data.len() as u64 && e.path.ends_with(".pyc"));
        if !whole || !self.nearby.first_module((loc.layer, loc.entry)) {
            return;
        }
        let image = Arc::downgrade(self);
        let data = data.to_vec();
        crate::image::nearby::submit_task(Box::new(move || follow(&image, loc, data)));
    }

    /// Whether `path` is a directory of the image, by its table entry: one map lookup
    /// (a module's imports ask a few hundred; resolving each component by component,
    /// as [`Self::regular_file`] does, took a second of CPU over a pandas start).
    /// Through a symlinked directory it is not found: a guess missed, nothing more.
    fn is_dir(&self, path: &str) -> bool {
        self.image
            .table()
            .get(path.trim_matches('/'))
            .and_then(|at| self.image.entry(*at))
            .is_some_and(|e| e.kind == EntryKind::Dir)
    }

    /// The regular file at `path`, by its table entry ([`Self::is_dir`]); a link is
    /// followed the slow way.
    fn module_file(&self, path: &str) -> Option<Location> {
        let at = *self.image.table().get(path.trim_start_matches('/'))?;
        let entry = self.image.entry(at)?;
        match entry.kind {
            EntryKind::File if entry.size > 0 => Some(at),
            EntryKind::Hardlink | EntryKind::Symlink => self.regular_file(path),
            _ => None,
        }
    }
}

/// Follows the module at `loc`, whose bytes are `data`: resolves its imports, fetches
/// the modules they load that no follow has claimed yet (one request per layer, within
/// the budget of files' rests), and then reads each compiled one whole, keeps it in the
/// small-file pack (so the interpreter's read is a `pread`, not a second inflation) and
/// follows it in turn on the pool.
fn follow(image: &Weak<MountedImage>, loc: Location, data: Vec<u8>) {
    let Some(image) = image.upgrade() else {
        return;
    };
    let Some(entry) = image.image.entry(loc) else {
        return;
    };
    let path = format!("/{}", entry.path.trim_start_matches('/'));
    let imports = match crate::image::pyc::imports(&data) {
        Ok(i) => i,
        Err(e) => {
            tracing::debug!(path, error = %e, "no imports read from a compiled module");
            return;
        }
    };
    drop(data);
    let is_package_dir = |d: &str| {
        image
            .module_file(&format!("{}/__init__.py", trim(d)))
            .is_some()
    };
    let Some(module) = Module::of(&path, &is_package_dir) else {
        return;
    };
    follow_resolved(&image, &module, &imports, &path);
}

/// Follows `imports`, run by `module` (`path`, for the log): fetches the modules they
/// load that no follow has claimed yet (one request per layer, within the budget of
/// files' rests), then reads each compiled one whole, keeps it in the small-file pack
/// and follows it in turn on the pool.
pub(crate) fn follow_resolved(
    image: &Arc<MountedImage>,
    module: &Module,
    imports: &[Import],
    path: &str,
) {
    let exists = |p: &str| image.is_dir(p) || image.module_file(p).is_some();
    // Compiled modules to parse once local, sources to fetch only, extension modules.
    let mut modules = Vec::new();
    let mut sources = Vec::new();
    let mut extensions = Vec::new();
    // Over budget, modules are left unclaimed: the interpreter's read of one follows it.
    let spent = crate::image::nearby::Spent::of(&image.stats);
    let within = image
        .nearby
        .within_rest_budget(spent.rest_unused, spent.served);
    for imp in imports {
        let root_of = |first: &str| {
            image
                .nearby
                .cached_root(module.roots_key(first), || module.find_root(first, &exists))
        };
        for files in module.candidates(imp, &root_of) {
            let Some((file, at)) = files
                .iter()
                .find_map(|f| image.module_file(f).map(|at| (f, at)))
            else {
                continue;
            };
            if file.ends_with(".so") {
                extensions.push(at);
            } else if within && image.nearby.first_module((at.layer, at.entry)) {
                if file.ends_with(".pyc") {
                    modules.push(at);
                } else {
                    sources.push(at);
                }
            }
        }
    }
    if modules.is_empty() && sources.is_empty() && extensions.is_empty() {
        return;
    }
    tracing::debug!(
        path,
        imports = imports.len(),
        modules = modules.len(),
        sources = sources.len(),
        extensions = extensions.len(),
        "nearby: imports followed"
    );
    for at in extensions {
        image.follow_library_fetched(at);
    }
    // The modules one module imports, in one request per layer (each file whole).
    let most = MAX_PYC_BYTES.min(image.nearby.whole_file_bytes());
    let size_of = |at: &Location| image.image.entry(*at).map_or(0, |e| e.size);
    modules.retain(|at| (1..=most).contains(&size_of(at)));
    sources.retain(|at| (1..=most).contains(&size_of(at)));
    let mut by_layer: Vec<(usize, Vec<std::ops::Range<u64>>)> = Vec::new();
    for at in modules.iter().chain(&sources) {
        let Some(layer) = image.image.layers().get(at.layer) else {
            continue;
        };
        let ranges = layer.ranges_for(at.entry, 0, size_of(at));
        match by_layer.iter_mut().find(|(l, _)| *l == at.layer) {
            Some((_, v)) => v.extend(ranges),
            None => by_layer.push((at.layer, ranges)),
        }
    }
    for (layer, ranges) in by_layer {
        if let Some(source) = image.layer_source(layer) {
            match source.warm_guessed_many(&ranges, crate::stats::Guess::Rest) {
                Ok(n) => crate::stats::MountStats::add(&image.stats.bytes_nearby, n),
                Err(e) => {
                    tracing::debug!(error = %e, "imported modules not fetched; read when needed");
                    return;
                }
            }
        }
    }
    // Local now: each compiled module is read once, kept where the interpreter's read
    // finds it, and parsed for its own imports; a source only kept.
    for at in sources {
        read_and_keep(image, at, size_of(&at));
    }
    for at in modules {
        let weak = Arc::downgrade(image);
        let size = size_of(&at);
        crate::image::nearby::submit_task(Box::new(move || {
            let Some(image) = weak.upgrade() else {
                return;
            };
            if let Some(data) = read_and_keep(&image, at, size) {
                follow(&weak, at, data);
            }
        }));
    }
}

/// Reads the `size` bytes of the file at `loc` whole, as background work (its spans
/// are local), and puts them in the small-file pack when the mount has one that takes
/// the file. `None` when the read failed or came short.
fn read_and_keep(image: &MountedImage, loc: Location, size: u64) -> Option<Vec<u8>> {
    let layer = image.image.layers().get(loc.layer)?;
    let mut data = vec![0u8; usize::try_from(size).ok()?];
    let n = crate::device::in_background(|| layer.read_at(loc.entry, 0, &mut data)).ok()?;
    if n as u64 != size {
        return None;
    }
    if let Some(files) = image.files.get()
        && size < files.config().min_file_bytes
        && !matches!(
            layer.format(),
            ferry_index::reader::LayerFormat::Whole { .. }
        )
        && let Some(pack) = files.pack()
        && let Some(key) = crate::localfiles::file_key(image, loc, size)
    {
        pack.put(&key, &data);
    }
    Some(data)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::image::pyc::tests::imp;

    const DIST: &str = "/usr/lib/python3/dist-packages";

    fn packages(d: &str) -> bool {
        d.starts_with(&format!("{DIST}/pandas"))
    }

    #[test]
    fn a_module_knows_its_package_tree_and_the_interpreter_s_directories() {
        let m = Module::of(
            &format!("{DIST}/pandas/core/__pycache__/frame.cpython-311.pyc"),
            &packages,
        )
        .unwrap();
        assert_eq!(m.version(), "3.11");
        assert_eq!(m.package_dir, format!("{DIST}/pandas/core"));
        assert_eq!(
            m.roots,
            vec![
                DIST.to_string(),
                "/usr/lib/python3.11".into(),
                "/usr/lib/python3.11/lib-dynload".into(),
                "/usr/local/lib/python3.11".into(),
                "/usr/local/lib/python3.11/lib-dynload".into(),
                "/usr/lib/python3.11/site-packages".into(),
                "/usr/lib/python3.11/dist-packages".into(),
                "/usr/local/lib/python3.11/site-packages".into(),
                "/usr/local/lib/python3.11/dist-packages".into(),
            ]
        );
        // a venv's interpreter: its own standard library first
        let v = Module::of(
            "/opt/venv/lib/python3.12/site-packages/app/__pycache__/__init__.cpython-312.pyc",
            &|d: &str| d.ends_with("/app"),
        )
        .unwrap();
        assert_eq!(v.roots[0], "/opt/venv/lib/python3.12/site-packages");
        assert_eq!(v.roots[1], "/opt/venv/lib/python3.12");
        assert_eq!(
            Module::of("/usr/lib/python3.11/os.py", &packages),
            None,
            "only compiled modules in __pycache__"
        );
        assert_eq!(Module::of("/x/__pycache__/m.pypy39.pyc", &packages), None);
    }

    impl Module {
        fn candidates_t(&self, imp: &Import, exists: &dyn Fn(&str) -> bool) -> Vec<Vec<String>> {
            self.candidates(imp, &|first: &str| self.find_root(first, exists))
        }
    }

    #[test]
    fn absolute_relative_and_from_imports_resolve_to_the_files_the_interpreter_tries() {
        let m = Module::of(
            &format!("{DIST}/pandas/core/__pycache__/frame.cpython-311.pyc"),
            &packages,
        )
        .unwrap();
        let exists = |p: &str| p == format!("{DIST}/numpy") || p == "/usr/lib/python3.11/os.py";
        // `import numpy.linalg`: numpy's __init__, then numpy.linalg, from dist-packages
        let c = m.candidates_t(&imp("numpy.linalg", 0, &[]), &exists);
        assert_eq!(c.len(), 2);
        assert!(c[0].contains(&format!(
            "{DIST}/numpy/__pycache__/__init__.cpython-311.pyc"
        )));
        assert!(c[1].contains(&format!("{DIST}/numpy/__pycache__/linalg.cpython-311.pyc")));
        assert!(c[1].contains(&format!(
            "{DIST}/numpy/linalg/__pycache__/__init__.cpython-311.pyc"
        )));
        assert_eq!(
            c[1][0],
            format!("{DIST}/numpy/linalg.cpython-311-{TRIPLET}.so"),
            "an extension module comes first"
        );
        // `import os`: the standard library, found by its file
        let c = m.candidates_t(&imp("os", 0, &[]), &exists);
        assert!(c[0].contains(&"/usr/lib/python3.11/__pycache__/os.cpython-311.pyc".to_string()));
        // `from .generic import NDFrame` inside pandas.core
        let c = m.candidates_t(&imp("generic", 1, &["NDFrame"]), &exists);
        assert!(c[0].contains(&format!(
            "{DIST}/pandas/core/__pycache__/generic.cpython-311.pyc"
        )));
        assert!(c[1].contains(&format!(
            "{DIST}/pandas/core/generic/__pycache__/NDFrame.cpython-311.pyc"
        )));
        // `from .. import util`: pandas' util
        let c = m.candidates_t(&imp("", 2, &["util"]), &exists);
        assert_eq!(c.len(), 1);
        assert!(c[0].contains(&format!("{DIST}/pandas/__pycache__/util.cpython-311.pyc")));
        // nothing found, or names no interpreter could import: nothing asked
        assert!(
            m.candidates_t(&imp("not_there", 0, &[]), &exists)
                .is_empty()
        );
        assert!(
            m.candidates_t(&imp("../../etc", 0, &[]), &exists)
                .is_empty()
        );
        assert!(m.candidates_t(&imp("x", 9, &[]), &exists).is_empty());
    }
}
