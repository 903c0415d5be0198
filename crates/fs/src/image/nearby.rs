//! Fetching what a start reads next from what it reads now, for an image without a
//! trace (readahead along the stream, [`crate::device::readahead`], covers what *follows* a miss;
//! this covers what belongs with it):
//!
//! * the first read of a file that misses brings the **whole file** when the file is at
//!   most [`FetchConfig::whole_file_bytes`], as that read's own request: a program that
//!   opens a module or a library reads nearly all of it, the loader by page faults at
//!   scattered offsets (nine misses in one 4.7 MB `libcrypto` at a pandas start), and
//!   each of those would wait a round trip. Fetched on the pool instead, the faults came
//!   before it and waited anyway. Its rest is a guess all the same (a loader faults in
//!   only part of a library), bounded by its own budget ([`Nearby::within_rest_budget`]:
//!   a program that opens many files and reads a header of each soon stops pulling them
//!   whole);
//! * the first miss in a directory brings the **small files around it** (each at most
//!   [`MAX_NEARBY_FILE`]) in the directory's subtree (a `__pycache__`'s package),
//!   nearest in the stream first, up to [`FetchConfig::nearby_bytes`] compressed: a
//!   package's modules, and its subpackages', are imported together but not in the
//!   order the tar holds them, so
//!   the miss can be anywhere among them (readahead only covers what follows it). These
//!   go out on a small process-wide pool of fetch threads, in parallel with the read,
//!   through the same single flight, verification and store as every fetch
//!   ([`LayerSource::warm_range`]), without the file's own ranges.
//!
//! Each file and directory asks once per mount; only reads that miss ask, so a start
//! served from its trace's prefetch adds nothing. Each kind of guess has its own budget,
//! in the bytes its guesses fetched that no read has used yet ([`crate::stats::Guess`]):
//! neighbours stop while theirs exceed 2/5 of what the reads were served, or 4 MiB
//! ([`Nearby::within_budget`]); whole files while their unused rests exceed half of it,
//! or 16 MiB. (One budget for both let the unfaulted pages of a start's libraries hold
//! back every neighbour for most of a pandas start.)
//!
//! The first read of a package's `__init__` also brings its subpackages' `__init__`s
//! ([`Asks::inits`]), as rests: an import opens them next, and the neighbours' budget is
//! often spent on a start's earlier directories by then.
//!
//! Planning ([`Nearby::plan`]) is pure. The pool runs fetches, and tasks that plan from
//! bytes already landed ([`crate::image::needed`]: the libraries a loader opens), the
//! urgent ones ([`Urgency::Now`]) before the guesses. This module must not read file
//! data or keep any.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferry_index::entry::{Entry, EntryKind};
use ferry_index::merged::{Location, MergedImage};
use parking_lot::{Condvar, Mutex};

use crate::device::{FetchConfig, LayerSource};
use crate::image::tree::{Ino, Node};
use crate::ranges::{merge_ranges, subtract_ranges};
use crate::stats::{Guess, MountStats};

/// Largest file (uncompressed) fetched as a neighbour of a miss in its directory.
pub const MAX_NEARBY_FILE: u64 = 1 << 20;
/// A mount guesses a miss's neighbours only while the guesses no read has used yet
/// ([`MountStats::guessed_unused`]) are at most NUM/DEN of the bytes its reads were
/// served, or [`GUESS_FLOOR`]: guessing costs what it fetches that the start never
/// reads, and a start may move at most 1.5x what it reads (issue 16), of which about
/// 0.85-1.0x is the spans its reads need. Guesses that the start reads free the bound
/// again, so a start that reads what comes keeps guessing and one whose reads are
/// scattered (a numpy import) soon stops. (The bound used to be on all fetched bytes
/// against served ones; the spans a start's first reads need are 1.5-2.5x what they
/// serve, so it held every guess back for the first half of a pandas start.)
pub const SPECULATION_NUM: u64 = 2;
/// See [`SPECULATION_NUM`].
pub const SPECULATION_DEN: u64 = 5;
/// Unused guesses a mount may always have: one directory's neighbours
/// ([`crate::device::DEFAULT_NEARBY_BYTES`]). (Added to the share of what was served
/// instead, the bound let a pandas start guess 15 MB of neighbours, half of them
/// unused, for one wait fewer.)
pub const GUESS_FLOOR: u64 = 4 << 20;
/// A mount fetches the files its reads start on whole while the rests of such files that
/// no read has used yet are at most NUM/DEN of the bytes its reads were served, or
/// [`WHOLE_FILE_FLOOR`]: looser than the neighbours' budget (the file is being read), but
/// a program that opens thousands of files and reads a header of each stops pulling them
/// whole.
pub const WHOLE_FILE_NUM: u64 = 1;
/// See [`WHOLE_FILE_NUM`].
pub const WHOLE_FILE_DEN: u64 = 2;
/// Unused rests a mount may always have. A start's first reads are a shell, the loader
/// and a dozen libraries and the interpreter, each read in a few pages at first: the
/// bound used to be 3x fetched per byte served, which that phase exceeds at once, so
/// the interpreter and libc came in ten and four round trips instead of one each.
pub const WHOLE_FILE_FLOOR: u64 = 16 << 20;
/// Entries looked at, at most, around a miss for its neighbours.
const MAX_NEARBY_SCAN: usize = 20_000;
/// Threads of the process-wide pool that fetches nearby files.
const POOL_THREADS: usize = 4;
/// Fetches queued for the pool at most; beyond it a hint is dropped (the reads fetch
/// what they need themselves).
const POOL_QUEUE: usize = 4096;

/// One mount's record of what has asked already.
#[derive(Debug, Default)]
pub(crate) struct Nearby {
    whole_file_bytes: u64,
    nearby_bytes: u64,
    seen: Mutex<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    /// Files whose data was asked for whole.
    files: HashSet<Ino>,
    /// Directories whose small files were asked for.
    dirs: HashSet<Ino>,
    /// Directories whose `__init__`'s read asked for its subpackages' ([`Asks::inits`]).
    packages: HashSet<Ino>,
    /// Large ELF files whose loader segments were asked for.
    loaders: HashSet<Ino>,
    /// Programs and libraries (layer, entry) whose dependencies were followed
    /// ([`crate::image::needed`]).
    libraries: HashSet<(usize, usize)>,
    /// Python modules (layer, entry) whose imports were followed
    /// ([`crate::image::imports`]).
    modules: HashSet<(usize, usize)>,
    /// Interpreter binaries (layer, entry) whose start was followed
    /// ([`crate::image::interpreter`]).
    interpreters: HashSet<(usize, usize)>,
    /// The search directory each top-level Python name was found in (or not), by
    /// `imports::Module::roots_key`: a start imports `os` and `numpy` from hundreds of
    /// modules, and each search looks up a dozen paths per directory.
    roots: HashMap<String, Option<String>>,
}

/// Programs and libraries a mount follows the dependencies of, at most (a pandas start
/// loads about sixty).
pub const MAX_LIBRARIES: usize = 512;

/// Python modules a mount follows the imports of, at most (a pandas + scipy import runs
/// about 1,100).
pub const MAX_MODULES: usize = 8192;

/// What a mount has spent when a read asks ([`Nearby::plan`]), from its counters.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Spent {
    /// Compressed bytes fetched.
    pub fetched: u64,
    /// Bytes served to reads.
    pub served: u64,
    /// Compressed bytes fetched as files' rests that no read has used yet.
    pub rest_unused: u64,
    /// Compressed bytes fetched as neighbours that no read has used yet.
    pub neighbours_unused: u64,
}

impl Spent {
    pub(crate) fn of(stats: &MountStats) -> Spent {
        use std::sync::atomic::Ordering::Relaxed;
        Spent {
            fetched: stats.bytes_fetched.load(Relaxed),
            served: stats.bytes_served.load(Relaxed),
            rest_unused: stats.guessed_unused(Guess::Rest),
            neighbours_unused: stats.guessed_unused(Guess::Neighbours),
        }
    }
}

/// What a read asks for besides its own bytes ([`Nearby::plan`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Asks {
    /// The compressed extent of the read's whole file: fetched as the read's own request
    /// ([`LayerSource::fetch_for_read`]), before the read.
    pub whole: Option<Range<u64>>,
    /// For the first read of a package's `__init__`, sorted disjoint compressed ranges
    /// of its subpackages' ([`subpackage_init`]), without the file's own: fetched on the
    /// pool as guesses of a file's rest (an import opens them whole, and a budget of
    /// neighbours spent on a start's earlier directories held them back), before the
    /// neighbours.
    pub inits: Vec<Range<u64>>,
    /// Sorted disjoint compressed ranges of small files around it, without the file's
    /// own: fetched on the pool ([`submit`]), in parallel with the read.
    pub neighbours: Vec<Range<u64>>,
}

/// One read, as [`Nearby::plan`] sees it.
pub(crate) struct Read<'a> {
    pub ino: Ino,
    pub node: &'a Node,
    pub offset: u64,
    pub len: u64,
}

/// What the layers look like to the planner: compressed ranges of file bytes, and which
/// are missing (neither local nor being fetched). The mount's layers, or a test's.
pub(crate) trait Layers {
    /// The compressed ranges holding `[off, off + len)` of entry `loc`.
    fn ranges(&self, loc: Location, off: u64, len: u64) -> Vec<Range<u64>>;
    /// Entry `idx` of layer `layer`'s file table (in stream order).
    fn entry(&self, layer: usize, idx: usize) -> Option<&Entry>;
    /// Whether some of `range` of layer `layer` is missing.
    fn missing(&self, layer: usize, range: &Range<u64>) -> bool;
    /// Whether all of `range` of layer `layer` is local (not missing, not being fetched).
    fn local(&self, layer: usize, range: &Range<u64>) -> bool;
}

impl Nearby {
    pub(crate) fn new(config: &FetchConfig) -> Nearby {
        Nearby {
            whole_file_bytes: config.whole_file_bytes,
            nearby_bytes: config.nearby_bytes,
            seen: Mutex::default(),
        }
    }

    /// Whether a mount whose unused neighbours are `unused` compressed bytes, having
    /// served `served` bytes to reads, may still guess neighbours ([`SPECULATION_NUM`],
    /// [`GUESS_FLOOR`]).
    pub(crate) fn within_budget(&self, unused: u64, served: u64) -> bool {
        unused <= share(served, SPECULATION_NUM, SPECULATION_DEN).max(GUESS_FLOOR)
    }

    /// Whether a mount whose unused rests of files are `unused` compressed bytes, having
    /// served `served` bytes to reads, may still fetch the files its reads start on whole
    /// ([`WHOLE_FILE_NUM`], [`WHOLE_FILE_FLOOR`]).
    pub(crate) fn within_rest_budget(&self, unused: u64, served: u64) -> bool {
        unused <= share(served, WHOLE_FILE_NUM, WHOLE_FILE_DEN).max(WHOLE_FILE_FLOOR)
    }

    /// The fetches a read asks for besides its own, all in the read's layer. Nothing
    /// unless the read misses and its file or its directory has not asked yet (checked
    /// first: most reads stop there). `spent` is what the mount has fetched, served and
    /// guessed so far: the neighbours are asked within [`Self::within_budget`], the
    /// read's own file whole within the looser [`Self::within_rest_budget`].
    pub(crate) fn plan(&self, layers: &dyn Layers, read: &Read<'_>, spent: Spent) -> Asks {
        let none = Asks::default();
        let Some(loc) = read.node.data else {
            return none;
        };
        let served = spent.served;
        let guess = self.within_budget(spent.neighbours_unused, served);
        let rest = self.within_rest_budget(spent.rest_unused, served);
        let package = self.nearby_bytes > 0
            && rest
            && layers
                .entry(loc.layer, loc.entry)
                .is_some_and(|e| is_package_init(&e.path));
        let (whole, dir, package) = {
            let seen = self.seen.lock();
            (
                self.whole_file_bytes > 0
                    && read.node.size <= self.whole_file_bytes
                    && rest
                    && !seen.files.contains(&read.ino),
                guess && self.nearby_bytes > 0 && !seen.dirs.contains(&read.node.parent),
                package && !seen.packages.contains(&read.node.parent),
            )
        };
        if !whole && !dir && !package {
            return none;
        }
        // A read that will wait asks: for its own spans missing, or in flight as some
        // other fetch's (a neighbour's, a readahead's), which brings only those spans; a
        // file whose first read joined one used to come in a round trip per later fault.
        let own = layers.ranges(loc, read.offset, read.len);
        if own.iter().all(|r| layers.local(loc.layer, r)) {
            return none;
        }
        let mut seen = self.seen.lock();
        let whole = whole && seen.files.insert(read.ino);
        let dir = dir && seen.dirs.insert(read.node.parent);
        let package = package && seen.packages.insert(read.node.parent);
        drop(seen);
        let file = if whole {
            layers.ranges(loc, 0, read.node.size)
        } else {
            own
        };
        let (inits, neighbours) = if dir || package {
            let (inits, neighbours) = self.neighbours(layers, loc, dir, package);
            let file = merge_ranges(file.clone());
            let inits = subtract_ranges(&merge_ranges(inits), &file);
            let neighbours =
                subtract_ranges(&subtract_ranges(&merge_ranges(neighbours), &file), &inits);
            let missing = |v: Vec<Range<u64>>| -> Vec<Range<u64>> {
                v.into_iter()
                    .filter(|r| layers.missing(loc.layer, r))
                    .collect()
            };
            (missing(inits), missing(neighbours))
        } else {
            (Vec::new(), Vec::new())
        };
        // A file is one stretch of its layer's stream: its ranges' hull.
        let whole = whole
            .then(|| {
                let start = file.iter().map(|r| r.start).min()?;
                let end = file.iter().map(|r| r.end).max()?;
                Some(start..end)
            })
            .flatten();
        Asks {
            whole,
            inits,
            neighbours,
        }
    }

    /// Whether file `at` (layer, entry) has not had its dependencies followed yet, and
    /// may (marks it: once per file per mount, at most [`MAX_LIBRARIES`]).
    pub(crate) fn first_library(&self, at: (usize, usize)) -> bool {
        if self.whole_file_bytes == 0 {
            return false;
        }
        let mut seen = self.seen.lock();
        seen.libraries.len() < MAX_LIBRARIES && seen.libraries.insert(at)
    }

    /// The search directory of a top-level Python name, found once per mount by `find`
    /// (at most [`MAX_MODULES`] names kept).
    pub(crate) fn cached_root(
        &self,
        key: String,
        find: impl FnOnce() -> Option<String>,
    ) -> Option<String> {
        if let Some(found) = self.seen.lock().roots.get(&key) {
            return found.clone();
        }
        let found = find();
        let mut seen = self.seen.lock();
        if seen.roots.len() < MAX_MODULES {
            seen.roots.insert(key, found.clone());
        }
        found
    }

    /// Whether Python module `at` (layer, entry) has not had its imports followed yet,
    /// and may (marks it: once per module per mount, at most [`MAX_MODULES`]).
    pub(crate) fn first_module(&self, at: (usize, usize)) -> bool {
        if self.whole_file_bytes == 0 {
            return false;
        }
        let mut seen = self.seen.lock();
        seen.modules.len() < MAX_MODULES && seen.modules.insert(at)
    }

    /// Whether the start of interpreter binary `at` (layer, entry) has not been followed
    /// yet, and may (marks it: once per binary per mount).
    pub(crate) fn first_interpreter(&self, at: (usize, usize)) -> bool {
        if self.whole_file_bytes == 0 {
            return false;
        }
        let mut seen = self.seen.lock();
        seen.interpreters.len() < MAX_LIBRARIES && seen.interpreters.insert(at)
    }

    /// Whether a first read's header may ask for more once it lands (the loader's
    /// segments, the libraries): while whole files are on.
    pub(crate) fn follows_headers(&self) -> bool {
        self.whole_file_bytes > 0
    }

    /// The bound of a file fetched whole ([`FetchConfig::whole_file_bytes`]).
    pub(crate) fn whole_file_bytes(&self) -> u64 {
        self.whole_file_bytes
    }

    /// Whether a file of `size` bytes may ask for its loader's segments
    /// ([`Self::plan_loader`]): one too large to come whole, while whole files are on.
    pub(crate) fn may_ask_loader(&self, size: u64) -> bool {
        self.whole_file_bytes > 0 && size > self.whole_file_bytes
    }

    /// For a read at the start of a file too large to come whole that shows an ELF
    /// header (`head`: the bytes it read), the missing compressed ranges of what the
    /// loader will fault in as it maps and relocates it: the file's segments that are
    /// not code ([`crate::image::elf::loader_ranges`]). A 36 MB BLAS library took nine round
    /// trips at a numpy import, five of them in those segments. They are its rest, a
    /// guess within [`Self::within_rest_budget`]; once per file per mount.
    pub(crate) fn plan_loader(
        &self,
        layers: &dyn Layers,
        read: &Read<'_>,
        head: &[u8],
        spent: Spent,
    ) -> Vec<Range<u64>> {
        let Some(loc) = read.node.data else {
            return Vec::new();
        };
        if read.offset != 0
            || !self.may_ask_loader(read.node.size)
            || !self.within_rest_budget(spent.rest_unused, spent.served)
        {
            return Vec::new();
        }
        // Parsed before it counts as the file's ask: a short first read (a `file` probe
        // of 64 bytes) does not use up the loader's.
        let segments = match crate::image::elf::loader_ranges(head, read.node.size) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "an ELF header without usable segments");
                return Vec::new();
            }
        };
        let first = {
            let mut seen = self.seen.lock();
            seen.loaders.insert(read.ino)
        };
        if !first {
            return Vec::new();
        }
        self.loader_segments(layers, loc, segments)
    }

    /// The missing compressed ranges of `segments` (a large file's loader ranges,
    /// [`crate::image::elf::loader_ranges`]) of the file at `loc`: at most a whole file's worth,
    /// smallest segments first (the data segment and the tables the loader relocates with
    /// before the bulk of read-only data).
    pub(crate) fn loader_segments(
        &self,
        layers: &dyn Layers,
        loc: Location,
        mut segments: Vec<Range<u64>>,
    ) -> Vec<Range<u64>> {
        segments.sort_by_key(|s| s.end - s.start);
        let mut left = self.whole_file_bytes;
        let mut ranges = Vec::new();
        for s in segments {
            let len = (s.end - s.start).min(left);
            if len == 0 {
                break;
            }
            left -= len;
            ranges.extend(layers.ranges(loc, s.start, len));
        }
        merge_ranges(ranges)
            .into_iter()
            .filter(|r| layers.missing(loc.layer, r))
            .collect()
    }

    /// The small files around the read's in its layer's stream, nearest first, inside
    /// its [`neighbourhood`] (a directory and its subdirectories, a compiled module's
    /// package), whose missing ranges fit in [`Self::nearby_bytes`].
    /// A tar is written depth first, so that subtree is one stretch of the stream: the
    /// walk goes outward from the read's entry and stops on each side where the stretch
    /// ends, or after [`MAX_NEARBY_SCAN`] entries.
    fn neighbours(
        &self,
        layers: &dyn Layers,
        loc: Location,
        near: bool,
        packages: bool,
    ) -> (Vec<Range<u64>>, Vec<Range<u64>>) {
        let layer = loc.layer;
        let Some(entry) = layers.entry(layer, loc.entry) else {
            return (Vec::new(), Vec::new());
        };
        let scope = neighbourhood(&entry.path);
        let inside = |e: &Entry| {
            scope.is_empty()
                || (e.path.len() > scope.len()
                    && e.path.starts_with(scope)
                    && e.path.as_bytes()[scope.len()] == b'/')
        };
        let wanted =
            |e: &Entry| e.kind == EntryKind::File && e.size > 0 && e.size <= MAX_NEARBY_FILE;
        // A package's `__init__` read first: its subpackages' come next, wherever they
        // lie in the subtree ([`subpackage_init`]); up to as many bytes again, nearest first.
        let init_suffix = packages
            .then(|| package_init_suffix(&entry.path, scope))
            .flatten();
        let mut init_bytes = 0u64;
        let mut inits = Vec::new();
        let here = entry.offset;
        let (mut down, mut up) = (loc.entry, loc.entry + 1);
        let (mut down_open, mut up_open) = (true, true);
        let mut scanned = 0usize;
        let mut counted: HashSet<(u64, u64)> = HashSet::new();
        let mut bytes = 0u64;
        let mut out = Vec::new();
        while (down_open || up_open) && scanned < MAX_NEARBY_SCAN {
            scanned += 1;
            // The nearer side in the stream goes next.
            let below = down_open.then(|| down.checked_sub(1)).flatten();
            let below = below.and_then(|i| layers.entry(layer, i).map(|e| (i, e)));
            let above = up_open
                .then(|| layers.entry(layer, up).map(|e| (up, e)))
                .flatten();
            let (i, e) = match (below, above) {
                (Some(b), Some(a)) => {
                    if here.saturating_sub(b.1.offset) <= a.1.offset.saturating_sub(here) {
                        b
                    } else {
                        a
                    }
                }
                (Some(b), None) => {
                    up_open = false;
                    b
                }
                (None, Some(a)) => {
                    down_open = false;
                    a
                }
                (None, None) => break,
            };
            let downward = i < loc.entry;
            if !inside(e) {
                if downward {
                    down_open = false;
                } else {
                    up_open = false;
                }
                continue;
            }
            if downward {
                down = i;
            } else {
                up = i + 1;
            }
            if !wanted(e) {
                continue;
            }
            let ranges: Vec<Range<u64>> = layers
                .ranges(Location { layer, entry: i }, 0, e.size)
                .into_iter()
                .filter(|r| !counted.contains(&(r.start, r.end)) && layers.missing(layer, r))
                .collect();
            let add: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            let init = init_suffix.is_some_and(|suffix| subpackage_init(&e.path, scope, suffix));
            if !init && !near {
                continue;
            }
            let (spent, into) = if init {
                (&mut init_bytes, &mut inits)
            } else {
                (&mut bytes, &mut out)
            };
            if *spent + add > self.nearby_bytes {
                continue; // a smaller one further out may still fit
            }
            *spent += add;
            for r in ranges {
                counted.insert((r.start, r.end));
                into.push(r);
            }
        }
        (inits, out)
    }
}

/// The subtree whose small files are a miss's neighbours: the file's directory, with
/// its subdirectories; for a module compiled into a `__pycache__`, the package around
/// it (its modules and subpackages are imported together). The parent's subtree would
/// also take the directory's siblings: for `/usr/bin/dash` all of `/usr`, for
/// `/etc/ld.so.cache` everything, guesses a start rarely reads that held back the good
/// ones behind the budget for the first half of a pandas start.
fn neighbourhood(path: &str) -> &str {
    let dir = parent(path);
    if dir.rsplit('/').next() == Some("__pycache__") {
        parent(dir)
    } else {
        dir
    }
}

/// Whether `path` is a package's `__init__` module, source or compiled.
fn is_package_init(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|name| name.starts_with("__init__."))
}

/// For a package's `__init__` module at `path` (`pkg/__init__.py`, or compiled,
/// `pkg/__pycache__/__init__.cpython-311.pyc`) whose neighbourhood is `scope` (`pkg`): the
/// part of the path below it, which a subpackage's `__init__` shares.
fn package_init_suffix<'a>(path: &'a str, scope: &str) -> Option<&'a str> {
    let name = path.rsplit('/').next()?;
    if !name.starts_with("__init__.") || scope.is_empty() {
        return None;
    }
    path.strip_prefix(scope)?.strip_prefix('/')
}

/// Whether `path` is the `__init__` of a subpackage of `scope` (at any depth) with the
/// same `suffix` as the one read ([`package_init_suffix`]), outside test packages (which
/// an import of the package does not load).
fn subpackage_init(path: &str, scope: &str, suffix: &str) -> bool {
    let Some(dirs) = path
        .strip_prefix(scope)
        .and_then(|p| p.strip_prefix('/'))
        .and_then(|p| p.strip_suffix(suffix))
        .and_then(|p| p.strip_suffix('/'))
    else {
        return false;
    };
    !dirs.is_empty()
        && dirs
            .split('/')
            .all(|d| !d.is_empty() && !matches!(d, "tests" | "test" | "testing" | "__pycache__"))
}

/// `num/den` of `bytes` (unbounded for `den` 0).
fn share(bytes: u64, num: u64, den: u64) -> u64 {
    bytes
        .saturating_mul(num)
        .checked_div(den)
        .unwrap_or(u64::MAX)
}

/// `path` without its last component (`""` at the top).
fn parent(path: &str) -> &str {
    path.rfind('/').map_or("", |i| &path[..i])
}

/// The mount's layers as the planner sees them.
pub(crate) struct MountLayers<'a> {
    pub image: &'a MergedImage,
    pub sources: &'a [Option<Arc<LayerSource>>],
}

impl Layers for MountLayers<'_> {
    fn ranges(&self, loc: Location, off: u64, len: u64) -> Vec<Range<u64>> {
        self.image
            .layers()
            .get(loc.layer)
            .map(|l| l.ranges_for(loc.entry, off, len))
            .unwrap_or_default()
    }

    fn entry(&self, layer: usize, idx: usize) -> Option<&Entry> {
        self.image.layers().get(layer)?.entries().get(idx)
    }

    fn missing(&self, layer: usize, range: &Range<u64>) -> bool {
        self.sources
            .get(layer)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.range_missing(range.clone()))
    }

    fn local(&self, layer: usize, range: &Range<u64>) -> bool {
        self.sources
            .get(layer)
            .and_then(Option::as_ref)
            .is_none_or(|s| s.range_local(range.clone()))
    }
}

/// Work for the pool: a fetch, or a task that plans and submits more
/// ([`crate::image::needed`]).
enum Job {
    Fetch {
        source: Weak<LayerSource>,
        range: Range<u64>,
        guess: Guess,
        stats: Weak<MountStats>,
    },
    Task(Box<dyn FnOnce() + Send>),
}

/// How soon a job of the pool should run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Urgency {
    /// What a program will read next for certain (the libraries its loader opens, their
    /// loader segments): ahead of everything queued later.
    Now,
    /// A guess that may go unread (a miss's neighbours).
    Later,
}

#[derive(Default)]
struct Queues {
    now: VecDeque<Job>,
    later: VecDeque<Job>,
    /// Jobs queued or running, for [`wait_idle`].
    pending: usize,
}

struct Pool {
    queues: Mutex<Queues>,
    /// Signalled when a job is queued.
    ready: Condvar,
    /// Signalled when no job is queued or running.
    idle: Condvar,
}

impl Pool {
    /// One job fewer queued or running.
    fn done(&self) {
        let mut q = self.queues.lock();
        q.pending = q.pending.saturating_sub(1);
        if q.pending == 0 {
            self.idle.notify_all();
        }
    }

    /// The next job, the urgent ones first; waits for one.
    fn next(&self) -> Job {
        let mut q = self.queues.lock();
        loop {
            if let Some(job) = q.now.pop_front().or_else(|| q.later.pop_front()) {
                return job;
            }
            self.ready.wait(&mut q);
        }
    }
}

static POOL: OnceLock<Option<Pool>> = OnceLock::new();

fn pool() -> Option<&'static Pool> {
    POOL.get_or_init(|| {
        let mut started = 0;
        for i in 0..POOL_THREADS {
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-nearby-{i}"))
                .spawn(work);
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "cannot start a nearby-file fetch thread"),
            }
        }
        (started > 0).then(|| Pool {
            queues: Mutex::default(),
            ready: Condvar::new(),
            idle: Condvar::new(),
        })
    })
    .as_ref()
}

fn work() {
    // The pool is set once its threads are spawned; they wait for it here.
    let pool = loop {
        match POOL.get() {
            Some(Some(pool)) => break pool,
            Some(None) => return,
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    loop {
        match pool.next() {
            Job::Fetch {
                source,
                range,
                guess,
                stats,
            } => fetch(&source, range, guess, &stats),
            Job::Task(task) => {
                // A task parses a stranger's bytes; whatever happens, the pool stays.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)).is_err() {
                    tracing::warn!("a nearby planning task panicked; skipped");
                }
            }
        }
        pool.done();
    }
}

fn fetch(source: &Weak<LayerSource>, range: Range<u64>, guess: Guess, stats: &Weak<MountStats>) {
    let Some(source) = source.upgrade() else {
        return;
    };
    match source.warm_guessed(range.clone(), guess) {
        Ok(n) => {
            if let Some(stats) = stats.upgrade() {
                MountStats::add(&stats.bytes_nearby, n);
            }
        }
        Err(e) => tracing::debug!(
            start = range.start,
            end = range.end,
            error = %e,
            "nearby fetch failed; the bytes are fetched when read"
        ),
    }
}

/// Queues `job` for the pool (dropped when [`POOL_QUEUE`] jobs wait already).
fn queue(pool: &Pool, job: Job, urgency: Urgency) {
    let mut q = pool.queues.lock();
    if q.now.len() + q.later.len() >= POOL_QUEUE {
        tracing::debug!("nearby-file queue full; hint dropped");
        return;
    }
    q.pending += 1;
    match urgency {
        Urgency::Now => q.now.push_back(job),
        Urgency::Later => q.later.push_back(job),
    }
    drop(q);
    pool.ready.notify_one();
}

/// Queues `task` for the pool, ahead of the guesses (dropped when it is full):
/// planning that reads what has landed and submits fetches of its own.
pub(crate) fn submit_task(task: Box<dyn FnOnce() + Send>) {
    if let Some(pool) = pool() {
        queue(pool, Job::Task(task), Urgency::Now);
    }
}

/// Queues `ranges` of `source`'s layer for the pool, as guesses of kind `guess`
/// (dropped when it is full).
pub(crate) fn submit(
    source: &Arc<LayerSource>,
    stats: &Arc<MountStats>,
    ranges: Vec<Range<u64>>,
    guess: Guess,
    urgency: Urgency,
) {
    if ranges.is_empty() {
        return;
    }
    let Some(pool) = pool() else { return };
    for range in ranges {
        let job = Job::Fetch {
            source: Arc::downgrade(source),
            range,
            guess,
            stats: Arc::downgrade(stats),
        };
        queue(pool, job, urgency);
    }
}

/// Waits until no nearby fetch is queued or running, at most `timeout`; whether that
/// happened. For tests and measurements that must see the fetches done.
pub fn wait_idle(timeout: Duration) -> bool {
    let Some(pool) = POOL.get().and_then(Option::as_ref) else {
        return true;
    };
    let deadline = Instant::now() + timeout;
    let mut q = pool.queues.lock();
    while q.pending > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        pool.idle.wait_for(&mut q, left);
    }
    true
}

#[cfg(test)]
#[path = "nearby_tests.rs"]
mod tests;
