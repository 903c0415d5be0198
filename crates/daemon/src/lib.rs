//! # ferry-daemon: the node daemon
//!
//! (Being written.) One long-running process per node owns the chunk store, every lazy
//! mount, the containerd snapshotter, fetch scheduling, a control socket for `ferry
//! mount`/`ferry status`, and Prometheus metrics.
