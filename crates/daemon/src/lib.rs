//! # ferry-daemon: the node daemon
//!
//! One long-running process per node ([`Daemon::run`]) owns the chunk store (opened
//! once, exclusively, with the read-only seed store of `[store] seed` under it if one is
//! configured), every lazy mount ([`MountManager`]), containerd's snapshotter
//! with lazy layers ([`LazyLayers`]), a control socket for `ferry mount` / `ferry
//! umount` / `ferry status` ([`control`]) and Prometheus metrics ([`metrics`]).
//!
//! ## Restarts and running containers
//!
//! When the daemon stops (SIGTERM/SIGINT) it unmounts the mounts made through the
//! control API. The snapshotter's lazy layers are deliberately *not* unmounted, since
//! overlayfs mounts of running containers use them as lower layers.
//!
//! With an fd holder ([`fdstore`], on by default: `[fuse] keep_connections`) a copy of
//! every mount's `/dev/fuse` descriptor lives in a small separate process, so the FUSE
//! connections survive the daemon's exit or crash. The next start resumes each kept
//! connection whose mount is still there ([`MountManager::resume_kept`]) before the
//! snapshotter restores its layers: running containers go on reading, including data
//! not cached yet (reads made meanwhile wait; requests the dead daemon took are resent
//! by the kernel, Linux 6.9+).
//!
//! Without a holder the connections end with the process: reads that reach those
//! layers fail (`ENOTCONN`/`EIO`) — pages the kernel already cached keep being served,
//! nothing else. The snapshotter's restore then detaches each dead mount and mounts the
//! layer again at the same directory, so new containers work, but containers that were
//! already running must be restarted.
//!
//! Lazy layers of registry images are resolved through [`indexes`]: the round trips of
//! one image (manifest, index artifact, every layer's index blob) are made at once at
//! its first layer's Prepare and shared by the Prepares that follow.
//!
//! Startup traces ([`autotrace`]): an image with no trace records one during its first
//! start here and shares it (referrer push, ferry's registry endpoint, the node store);
//! a mount looks its trace up in the background and warms up once it has the answer
//! and its image's pull has mounted its other lazy layers and committed its unpacked
//! ones ([`settle`], bounded),
//! so prefetch does not slow the pull the container waits for.
//!
//! Peers (`[p2p]`, off by default, [`p2p`]): the daemon serves the verified spans of its
//! lazy registry layers to the other daemons of its cluster, to those that prove they
//! may pull the repository, and reads those layers from peers before the registry.
//!
//! It must not parse layer formats, registry documents or tar itself: it wires ferry-fs,
//! ferry-index, the registry client, the store and the snapshotter together.
//!
//! Threads: FUSE callbacks run on fuser's threads and do their own blocking I/O through
//! the registry client's runtime; mount and unmount calls block and run on blocking
//! threads, never on the async workers that serve the sockets.

pub mod autotrace;
pub mod config;
pub mod control;
pub mod cri;
pub mod daemon;
pub mod error;
pub mod fallback;
pub mod fdstore;
pub mod heap;
pub mod indexes;
pub mod memory;
pub mod metrics;
pub mod mounts;
pub mod p2p;
pub mod remote;
pub mod settle;

pub use config::DaemonConfig;
pub use control::{ControlClient, DaemonInfo, Health, StatusReport, UnmountRequest};
pub use daemon::{Daemon, stop_signal};
pub use error::{Error, Result};
pub use memory::MemoryBackend;
pub use mounts::{
    DeadMount, KeptMount, LayerKind, MountBackend, MountInfo, MountManager, MountOrigin,
    MountRequest, MountStatus, PeerWiring, PrewarmEvent, PrewarmOutcome, PrewarmRequest,
    ResumeReport, StoreStatus,
};
pub use remote::LazyLayers;
