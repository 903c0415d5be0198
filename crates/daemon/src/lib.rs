//! # ferry-daemon: the node daemon
//!
//! One long-running process per node ([`Daemon::run`]) owns the chunk store (opened
//! once, exclusively), every lazy mount ([`MountManager`]), containerd's snapshotter
//! with lazy layers ([`LazyLayers`]), a control socket for `ferry mount` / `ferry
//! umount` / `ferry status` ([`control`]) and Prometheus metrics ([`metrics`]).
//!
//! ## Restarts and running containers
//!
//! When the daemon stops (SIGTERM/SIGINT) it unmounts the mounts made through the
//! control API. The snapshotter's lazy layers are deliberately *not* unmounted, since
//! overlayfs mounts of running containers use them as lower layers. But their FUSE
//! connections end with the process: from then on, reads that reach those layers fail
//! (`ENOTCONN`/`EIO`) — pages the kernel already cached keep being served, nothing else.
//! On the next start the snapshotter's restore detaches each dead mount and mounts the
//! layer again at the same directory, so new containers (and new overlay mounts) work.
//! Containers that were already running keep their overlay mounts pointing at the dead
//! FUSE superblocks and do not recover: they must be restarted. Surviving a daemon
//! restart would need the `/dev/fuse` descriptors handed over to the new process (e.g.
//! through systemd's file descriptor store); that is not implemented.
//!
//! Threads: FUSE callbacks run on fuser's threads and do their own blocking I/O through
//! the registry client's runtime; mount and unmount calls block and run on blocking
//! threads, never on the async workers that serve the sockets.

pub mod config;
pub mod control;
pub mod daemon;
pub mod error;
pub mod memory;
pub mod metrics;
pub mod mounts;
pub mod remote;

pub use config::DaemonConfig;
pub use control::{ControlClient, DaemonInfo, Health, StatusReport, UnmountRequest};
pub use daemon::{Daemon, stop_signal};
pub use error::{Error, Result};
pub use memory::MemoryBackend;
pub use mounts::{
    LayerKind, MountBackend, MountInfo, MountManager, MountOrigin, MountRequest, MountStatus,
    StoreStatus,
};
pub use remote::LazyLayers;
