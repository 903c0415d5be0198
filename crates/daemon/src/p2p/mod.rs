//! Peer-to-peer: the daemon serves the verified spans of its lazy layers to the other
//! daemons of its cluster, and fetches from them before the registry.
//!
//! * [`server`]: `HEAD`/`GET /v2/<name>/blobs/<digest>?ns=<registry>` with `Range`, a
//!   registry's own semantics, answered only from spans present and verified in the
//!   node's chunk store ([`BlobCatalog`] maps a layer blob's ranges to its spans, and a
//!   version-2 index's windows blob's ranges to its inflate windows); a range not
//!   wholly held is a 404, so the caller goes elsewhere.
//! * [`auth`]: two layers. The cluster token (`Authorization: Bearer`, compared in
//!   constant time) says the caller is a daemon of this cluster; the registry credential
//!   it forwards (`X-Ferry-Registry-Authorization`) says it may pull the repository it
//!   names, proven by asking the registry ([`auth::PullRights`]) and cached briefly.
//! * [`fetch`]: a [`fetch::PeerRangeSource`] under a lazy layer's device asks the
//!   piece's parent in its [`ferry_p2p::PieceTree`], then its fallbacks, then the
//!   registry, within one peer deadline; it checks every span against the layer index
//!   before handing bytes up (the device checks them again), and skips a peer that timed
//!   out or served bad bytes for a while. The layer's windows blob is routed the same
//!   way, its windows checked against their digests in the index.
//! * [`tls`]: TLS between peers from a cluster CA, optionally mutual; the token is still
//!   required.
//! * [`dns`]: membership from DNS (a headless service), re-resolved periodically.
//! * [`gossip`]: membership by gossip (SWIM through `foca`, authenticated datagrams),
//!   merged with the static list and DNS ([`gossip::MemberSources`]).
//!
//! `docs/p2p.md` has the design, the threat model and the configuration.

pub mod auth;
pub mod catalog;
pub mod dns;
pub mod fetch;
pub mod gossip;
pub mod server;
#[cfg(test)]
mod tests;
pub mod tls;
#[cfg(test)]
pub(crate) mod tls_tests;

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub use catalog::{BlobCatalog, BlobKind, SpanTable};

/// The header a peer forwards its registry `Authorization` value in.
pub const REGISTRY_AUTHORIZATION: &str = "x-ferry-registry-authorization";
/// Longest forwarded credential accepted (a registry token is a few KiB at most).
pub const MAX_CREDENTIAL_LEN: usize = 16 << 10;

/// The node's peer counters, shared by the server and every peer-routed layer. Byte
/// counts are kept apart by [`BlobKind`]: `bytes_*` are layer bytes, `windows_bytes_*`
/// bytes of windows blobs.
#[derive(Debug, Default)]
pub struct P2pStats {
    /// Layer bytes served to peers.
    pub bytes_served: AtomicU64,
    /// Layer bytes fetched from peers (verified).
    pub bytes_from_peers: AtomicU64,
    /// Layer bytes fetched from the registry by peer-routed layers (as roots or after
    /// falling back).
    pub bytes_from_origin: AtomicU64,
    /// Windows blob bytes served to peers.
    pub windows_bytes_served: AtomicU64,
    /// Windows blob bytes fetched from peers (verified).
    pub windows_bytes_from_peers: AtomicU64,
    /// Windows blob bytes fetched from the registry by peer-routed layers.
    pub windows_bytes_from_origin: AtomicU64,
    /// Requests refused for want of a valid cluster token (401).
    pub refused_unauthenticated: AtomicU64,
    /// Requests refused for want of pull rights (403).
    pub refused_forbidden: AtomicU64,
    /// Requests refused because the server was at its bound (503).
    pub refused_busy: AtomicU64,
    /// Peer requests that failed: timeout, transport, bad status, bytes that did not
    /// verify (a peer that merely did not hold the range is not counted).
    pub peer_failures: AtomicU64,
    /// Of those, answers whose bytes did not verify.
    pub peer_corrupt: AtomicU64,
    /// Reads of non-roots that went to the registry after no peer could serve them.
    pub fallbacks_to_origin: AtomicU64,
    /// The gossip's counters (zero without gossip).
    pub gossip: gossip::GossipStats,
    /// The TLS counters, when peers talk TLS.
    pub tls: std::sync::OnceLock<std::sync::Arc<tls::TlsCounters>>,
}

impl P2pStats {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The counter of bytes of a `kind` blob served to peers.
    pub(crate) fn served(&self, kind: BlobKind) -> &AtomicU64 {
        match kind {
            BlobKind::Layer => &self.bytes_served,
            BlobKind::Windows => &self.windows_bytes_served,
        }
    }

    /// The counter of bytes of a `kind` blob fetched from peers.
    pub(crate) fn fetched_from_peers(&self, kind: BlobKind) -> &AtomicU64 {
        match kind {
            BlobKind::Layer => &self.bytes_from_peers,
            BlobKind::Windows => &self.windows_bytes_from_peers,
        }
    }

    /// The counter of bytes of a `kind` blob fetched from the registry.
    pub(crate) fn fetched_from_origin(&self, kind: BlobKind) -> &AtomicU64 {
        match kind {
            BlobKind::Layer => &self.bytes_from_origin,
            BlobKind::Windows => &self.windows_bytes_from_origin,
        }
    }

    /// A copy of the counters.
    pub fn snapshot(&self) -> P2pSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        P2pSnapshot {
            bytes_served: get(&self.bytes_served),
            bytes_from_peers: get(&self.bytes_from_peers),
            bytes_from_origin: get(&self.bytes_from_origin),
            windows_bytes_served: get(&self.windows_bytes_served),
            windows_bytes_from_peers: get(&self.windows_bytes_from_peers),
            windows_bytes_from_origin: get(&self.windows_bytes_from_origin),
            refused_unauthenticated: get(&self.refused_unauthenticated),
            refused_forbidden: get(&self.refused_forbidden),
            refused_busy: get(&self.refused_busy),
            peer_failures: get(&self.peer_failures),
            peer_corrupt: get(&self.peer_corrupt),
            fallbacks_to_origin: get(&self.fallbacks_to_origin),
            members: Vec::new(),
            tls: self.tls.get().map(|t| t.snapshot()),
            gossip: GossipSnapshot {
                members: get(&self.gossip.members),
                datagrams_in: get(&self.gossip.datagrams_in),
                datagrams_out: get(&self.gossip.datagrams_out),
                bytes_in: get(&self.gossip.bytes_in),
                bytes_out: get(&self.gossip.bytes_out),
                dropped_oversized: get(&self.gossip.dropped_oversized),
                dropped_unauthenticated: get(&self.gossip.dropped_unauthenticated),
                dropped_stale: get(&self.gossip.dropped_stale),
                dropped_replayed: get(&self.gossip.dropped_replayed),
                dropped_malformed: get(&self.gossip.dropped_malformed),
                dropped_member_cap: get(&self.gossip.dropped_member_cap),
                dropped_refused: get(&self.gossip.dropped_refused),
            },
        }
    }
}

/// [`P2pStats`] at one moment (`ferry status`, metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct P2pSnapshot {
    pub bytes_served: u64,
    pub bytes_from_peers: u64,
    pub bytes_from_origin: u64,
    /// Windows blob bytes (the other three are layer bytes); absent from older daemons.
    #[serde(default)]
    pub windows_bytes_served: u64,
    #[serde(default)]
    pub windows_bytes_from_peers: u64,
    #[serde(default)]
    pub windows_bytes_from_origin: u64,
    pub refused_unauthenticated: u64,
    pub refused_forbidden: u64,
    pub refused_busy: u64,
    pub peer_failures: u64,
    pub peer_corrupt: u64,
    pub fallbacks_to_origin: u64,
    /// The membership the next read is scheduled with (this daemon included), from
    /// every source; filled in by the daemon, not by [`P2pStats::snapshot`].
    #[serde(default)]
    pub members: Vec<String>,
    /// The gossip's figures (all zero without gossip).
    #[serde(default)]
    pub gossip: GossipSnapshot,
    /// TLS reloads and handshake failures, when peers talk TLS.
    #[serde(default)]
    pub tls: Option<tls::TlsSnapshot>,
}

/// [`gossip::GossipStats`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GossipSnapshot {
    /// Live members gossip knows (this daemon not counted).
    pub members: u64,
    pub datagrams_in: u64,
    pub datagrams_out: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Datagrams dropped, by reason.
    pub dropped_oversized: u64,
    pub dropped_unauthenticated: u64,
    pub dropped_stale: u64,
    pub dropped_replayed: u64,
    pub dropped_malformed: u64,
    pub dropped_member_cap: u64,
    pub dropped_refused: u64,
}
