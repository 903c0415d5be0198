//! # ferry-registry — ferry's OCI distribution registry
//!
//! Owns the server end of the wire, `ferry registry serve`:
//!
//! - [`server`]: a complete OCI distribution v1.1 registry on axum (routes, Range reads,
//!   uploads, referrers, the `ferry-traces` endpoint for nodes that may only pull,
//!   listener with TLS and connection limits, Prometheus metrics);
//! - [`storage`] backends behind the `Storage` trait (crash-safe filesystem,
//!   S3-compatible object store, in-memory for tests) and their garbage collector;
//! - [`auth`]: the Docker token protocol with signed JWTs, htpasswd bcrypt users,
//!   per-repository rules, login throttling;
//! - a pull-through [`cache`] in front of any upstream registry that fetches each
//!   missing object once and streams it to every waiter as it arrives. It reaches the
//!   upstream through `ferry-registry-client`, the one client crate.
//!
//! It must not know about layer formats, filesystems or containerd: it stores and serves
//! bytes and documents, verified by digest, and nothing else. Nothing but the `ferry`
//! binary may depend on it: whoever only talks to registries depends on the client
//! crate, so it does not compile a server. Input from the network is bounded and
//! validated before it is trusted; nothing here panics on what a peer sends.

pub mod auth;
pub mod cache;
#[doc(hidden)]
pub mod fuzz_api;
pub mod server;
pub mod storage;

/// What printed configurations and `Debug` output show in place of a secret.
pub const REDACTED: &str = "<redacted>";
