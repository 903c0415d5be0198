//! # ferry-registry — everything that speaks the OCI distribution protocol
//!
//! Owns both ends of the wire:
//!
//! - [`client`]: how every other ferry piece talks to registries — reference resolution,
//!   bearer/basic auth challenges, credentials from `~/.docker/config.json`, token refresh,
//!   mirrors with fallback, retries with backoff, HTTP Range reads, parallel chunked
//!   downloads, and a [`ferry_index::RangeSource`] over a remote blob.
//! - [`server`]: `ferry registry serve`, a complete OCI distribution v1.1 registry on
//!   axum, with [`storage`] backends (crash-safe filesystem, S3-compatible object store,
//!   in-memory for tests), [`auth`] (Docker token protocol with signed JWTs, htpasswd
//!   bcrypt users, per-repository rules) and a pull-through [`cache`] in front of any
//!   upstream registry that fetches each missing object once and streams it to every
//!   waiter as it arrives.
//! - [`loadtest`]: `ferry bench registry`, which replays a fleet's node-startup flow.
//!
//! It must not know about layer formats, filesystems or containerd: it moves bytes and
//! documents, verified by digest, and nothing else. Input from the network is bounded and
//! validated before it is trusted; nothing here panics on what a peer sends.

pub mod auth;
pub mod cache;
#[doc(hidden)]
pub mod fuzz_api;
pub mod server;
pub mod storage;

/// What printed configurations and `Debug` output show in place of a secret.
pub const REDACTED: &str = "<redacted>";
