//! # ferry-fs: the lazy filesystem
//!
//! Presents an image (all layers merged, or one layer the way overlayfs expects it) as a
//! read-only FUSE filesystem as soon as its index is known, and fetches file bytes on
//! first touch. Layered like the read path in `docs/architecture.md`, each layer testable
//! without root, a network or a kernel mount:
//!
//! * transport ([`fuse`]): fuser, multi-threaded, kernel caching on (the image never
//!   changes), read-only;
//! * filesystem ([`tree`]): the inode tree built from the index's file tables;
//! * device ([`device`]): file reads become the compressed spans the index names,
//!   fetched once however many threads want them, merged when adjacent, verified
//!   against the index's digests, bounded in time, with readahead along the layer's
//!   stream ([`readahead`]: a miss fetches the window after it in the same request, a
//!   reader catching up with a window starts the next one in the background) and, at a
//!   miss, the rest of the file and the small files beside it ([`nearby`]), and for a
//!   large library the segments its loader will fault in, read off its ELF header
//!   ([`elf`]);
//! * cache: verified spans go into the node chunk store (`ferry-store`) and are read
//!   from it first;
//! * backend ([`image`]): layer bytes from an OCI layout or a registry (HTTP Range
//!   through [`range_source::HttpRangeSource`] over `ferry-registry-client`).
//!
//! It must not parse layer formats (that is `ferry-index`; the only file contents it
//! parses are ELF program headers, to guess reads, never to serve them) or keep per-mount copies of
//! data (the chunk store is node-wide; the only bytes held in memory are the process's
//! small, idle-released cache of inflated spans, [`image::inflated_spans`]).

pub mod device;
pub mod elf;
pub mod error;
pub mod filecache;
pub mod fuse;
pub mod image;
mod localfiles;
pub mod nearby;
pub mod range_source;
mod readahead;
pub mod stats;
pub mod trace;
pub mod tree;
pub mod warm;

pub use device::{FetchConfig, FillWork, LayerSource};
pub use error::{Error, Result};
pub use filecache::{FileCache, FileCacheConfig, FileCacheSnapshot, FileKey};
pub use fuse::{
    FerryFs, MountOptions, block_stop_signals, is_mounted, mount, mount_foreground, unmount,
};
pub use image::{
    ImageSource, LayerSpec, MountedImage, View, configure_inflated_spans, find_trace,
    inflated_spans, registry_manifest, release_idle_inflated_spans,
};
pub use range_source::HttpRangeSource;
pub use stats::{Guess, GuessBytes, Guesses, MountStats, StatsSnapshot};
pub use trace::{Trace, TraceRead};
pub use tree::{InodeTree, Node, NodeKind, ROOT_INO};
pub use warm::{WarmConfig, WarmHandle};
