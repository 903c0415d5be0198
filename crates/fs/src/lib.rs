//! # ferry-fs: the lazy filesystem
//!
//! Presents an image (all layers merged, or one layer the way overlayfs expects it) as a
//! read-only FUSE filesystem as soon as its index is known, and fetches file bytes on
//! first touch. Its folders follow the read path in `docs/architecture.md`, top to
//! bottom; a module imports only from the layers below it, and each layer is testable
//! without root, a network or a kernel mount:
//!
//! * transport ([`fuse`]): fuser, multi-threaded, kernel caching on (the image never
//!   changes), read-only; fully local files handed to the kernel by FUSE passthrough
//!   from the decompressed file cache ([`filecache`]), small files a start read before
//!   served with `pread` from the small-file pack beside it ([`filepack`]);
//! * mounted image ([`image`]): the layers wired through device and cache, their merged
//!   table and the inode tree a mount shows ([`image::tree`]), the reads a recording
//!   notes ([`image::recorder`]), and what a read that misses tells of the reads to
//!   come: the rest of the file and the small files beside it ([`image::nearby`]), and
//!   for a large library the segments its loader will fault in, read off its ELF header
//!   ([`image::elf`]), and for a program or library the libraries its loader will open
//!   next (`image::needed`), and for a compiled Python module the modules it imports,
//!   read off its bytecode ([`image::pyc`], `image::imports`) and kept in the
//!   small-file pack, and for a Python interpreter's binary, as it is `exec`ed, the
//!   modules every start of it imports and those its command line names (the reading
//!   process's `/proc/PID/cmdline`, `image::interpreter`);
//! * device ([`device`]): file reads become the compressed spans the index names,
//!   fetched once however many threads want them, merged when adjacent, a busy
//!   layer's queued fetches joined into one multi-range request, verified
//!   against the index's digests, bounded in time, with readahead along the layer's
//!   stream (a miss fetches the window after it in the same request, a reader catching
//!   up with a window starts the next one in the background);
//! * cache: verified spans go into the node chunk store (`ferry-store`) and are read
//!   from it first;
//! * backend ([`backend`]): an image's manifest, ferry indexes and layer bytes from an
//!   OCI layout or a registry (HTTP Range through
//!   [`backend::range_source::HttpRangeSource`] over `ferry-registry-client`), and its
//!   published startup trace ([`trace`]: the format and its home as an artifact).
//!
//! Beside the read path, [`warm`] gets ahead of it (a trace's prefetch, background
//! fill) through the same device sources; [`stats`] and [`error`] are shared by all.
//!
//! It must not parse layer formats (that is `ferry-index`; the only file contents it
//! parses are ELF headers and dynamic sections, compiled Python modules' bytecode and
//! the import lines of a Python command line or script, bounded, to guess reads, never
//! to serve them) or keep per-mount copies of
//! data (the chunk store is node-wide; the only bytes held in memory are the process's
//! small, idle-released cache of inflated spans, [`image::inflated_spans`]).

pub mod backend;
pub mod device;
pub mod error;
pub mod filecache;
pub mod filepack;
pub mod fuse;
pub mod image;
mod localfiles;
mod ranges;
pub mod stats;
pub mod trace;
pub mod warm;

pub use backend::range_source::HttpRangeSource;
pub use backend::{ImageSource, LayerSpec, find_trace, registry_manifest};
pub use device::{FetchConfig, FillWork, LayerSource};
pub use error::{Error, Result};
pub use filecache::{FileCache, FileCacheConfig, FileCacheSnapshot, FileKey};
pub use fuse::{
    FerryFs, MountOptions, block_stop_signals, is_mounted, mount, mount_foreground, unmount,
};
pub use image::recorder::Recorder;
pub use image::tree::{InodeTree, Node, NodeKind, ROOT_INO};
pub use image::{
    MountedImage, View, configure_inflated_spans, inflated_spans, release_idle_inflated_spans,
};
pub use stats::{Guess, GuessBytes, Guesses, MountStats, StatsSnapshot};
pub use trace::{Trace, TraceRead};
pub use warm::{WarmConfig, WarmHandle};
