//! # ferry-snapshotter — containerd's snapshotter, backed by ferry
//!
//! containerd asks a snapshotter for the filesystems containers run on. This crate
//! answers containerd's Snapshots gRPC API (as a proxy plugin on a unix socket): writable
//! snapshots are overlayfs upper/work directories, committed layers are plain directories
//! or lazy mounts made through the [`remote::RemoteLayers`] hook, and metadata lives in
//! one redb file so it survives restarts and crashes.
//!
//! - [`snapshotter::Snapshotter`]: the lifecycle (Prepare, View, Mounts, Commit, Remove,
//!   Stat, Update, Usage, Walk, Cleanup) over directories and metadata, synchronous.
//! - [`service::SnapshotService`]: the gRPC service (namespaces from request metadata).
//! - [`server`]: unix-socket serving with clean shutdown, and the config file.
//! - [`remote`]: the lazy-layer hook, label names, a no-op and an in-memory implementation.
//!
//! It must not know layer formats or fetch bytes: lazy layers come from whoever
//! implements the hook (the daemon, over ferry-fs), staged layers from `ferry pull`.

pub mod error;
pub mod filter;
pub mod meta;
pub mod remote;
pub mod server;
pub mod service;
pub mod snapshotter;
pub mod usage;

pub use error::{Error, Result};
pub use remote::{
    LayerLabels, NoRemoteLayers, NotLazy, NotLazyReason, RemoteError, RemoteLayers, RemoteMount,
};
pub use snapshotter::{Info, Mount, Snapshotter};

/// Code generated from the hand-written service description in `build.rs`: the server
/// trait and router for `containerd.services.snapshots.v1.Snapshots`.
#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod proto {
    /// `google.protobuf.Empty`, which prost maps to `()`.
    pub type Empty = ();
    include!(concat!(
        env!("OUT_DIR"),
        "/containerd.services.snapshots.v1.Snapshots.rs"
    ));
}
