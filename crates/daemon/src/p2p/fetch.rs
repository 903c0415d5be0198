//! The fetch side: peers before the registry, under a lazy layer's device.
//!
//! A [`PeerRangeSource`] wraps a layer's registry source. For a range made of whole
//! spans of the layer's index it asks, within one deadline (`peer_timeout`) for all of
//! them, the parent of the piece the range starts in ([`ferry_p2p::PieceTree`]), then
//! the piece's fallbacks, then gives up and reads the registry. Bytes from a peer are
//! checked span by span against the index before they are handed up (and the device
//! checks them once more before storing); a peer that timed out, failed, or served
//! bytes that did not verify is skipped for `penalty`. A root of the piece, and a range
//! that is not whole spans (nothing to verify it against), go to the registry directly.
//!
//! The windows blob of a layer's version-2 index (its inflate windows, fetched by Range
//! beside the layer: [`RangeSource::sibling`]) goes the same way through a
//! [`PeerRangeSource`] of its own, its windows as the spans, each checked against the
//! SHA-256 the index names for it; the device's fallback for windows that do not verify
//! stays the registry's windows blob.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use ferry_index::source::RangeSource;
use ferry_oci::Digest;
use ferry_p2p::{Membership, PeerId, PieceId, Schedule, Source, Topology};
use ferry_registry_client::{Client, Repo, parse_content_range};
use ferry_store::ChunkKey;
use parking_lot::{Mutex, RwLock};

use super::auth::ClusterToken;
use super::catalog::SpanTable;
use super::{P2pStats, REGISTRY_AUTHORIZATION};

/// Why a peer did not serve a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// It does not hold (all of) the range: ask elsewhere, no fault of the peer.
    #[error("the peer does not hold the range")]
    NotHeld,
    /// It is at its bound (503).
    #[error("the peer is busy")]
    Busy,
    /// It refused us (401: our cluster token; 403: our pull right).
    #[error("the peer refused the request ({0})")]
    Refused(u16),
    /// Transport error, unexpected status or a malformed answer.
    #[error("{0}")]
    Failed(String),
}

/// One range of one blob, as asked of a peer.
#[derive(Debug, Clone)]
pub struct PeerRequest<'a> {
    /// The repository (and registry) the caller reads the blob for.
    pub repo: &'a Repo,
    /// The blob.
    pub blob: &'a Digest,
    /// The bytes.
    pub range: Range<u64>,
    /// The caller's `Authorization` value for the registry itself (`None`: anonymous).
    pub registry_authorization: Option<&'a str>,
}

/// How a range is asked of a peer.
#[async_trait]
pub trait PeerTransport: Send + Sync + fmt::Debug {
    /// The bytes of `req.range` from `peer` (exactly that many, unverified).
    async fn fetch(&self, peer: &PeerId, req: &PeerRequest<'_>) -> Result<Vec<u8>, PeerError>;
}

/// The credential a daemon forwards to a peer for a repository.
#[async_trait]
pub trait OriginCredentials: Send + Sync + fmt::Debug {
    /// The `Authorization` value for pulling `repo` from its registry (`None`:
    /// anonymous).
    async fn pull_authorization(&self, repo: &Repo) -> Result<Option<String>, String>;
}

#[async_trait]
impl OriginCredentials for Client {
    async fn pull_authorization(&self, repo: &Repo) -> Result<Option<String>, String> {
        Client::pull_authorization(self, repo)
            .await
            .map_err(|e| e.to_string())
    }
}

/// [`PeerTransport`] over HTTP or HTTPS: the peer server's registry-style blob reads.
#[derive(Clone)]
pub struct HttpPeers {
    http: reqwest::Client,
    token: ClusterToken,
    scheme: &'static str,
}

impl fmt::Debug for HttpPeers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HttpPeers")
    }
}

impl HttpPeers {
    /// Peers asked with `token`, connections (the TLS handshake included) given up
    /// after `connect_timeout`; over HTTPS with `tls` (the cluster CA as the only roots,
    /// and our certificate for servers that ask), plain HTTP without.
    pub fn new(
        token: ClusterToken,
        connect_timeout: Duration,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<HttpPeers, String> {
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("ferry-p2p/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(connect_timeout)
            // A peer never redirects; following one would carry our credentials away.
            .redirect(reqwest::redirect::Policy::none());
        let scheme = match tls {
            Some(config) => {
                builder = builder.use_preconfigured_tls(config).https_only(true);
                "https"
            }
            None => "http",
        };
        let http = builder.build().map_err(|e| e.to_string())?;
        Ok(HttpPeers {
            http,
            token,
            scheme,
        })
    }
}

#[async_trait]
impl PeerTransport for HttpPeers {
    async fn fetch(&self, peer: &PeerId, req: &PeerRequest<'_>) -> Result<Vec<u8>, PeerError> {
        let failed = |what: String| PeerError::Failed(format!("peer {peer}: {what}"));
        let len = req.range.end - req.range.start;
        if len == 0 {
            return Ok(Vec::new());
        }
        let url = format!(
            "{}://{peer}/v2/{}/blobs/{}?ns={}",
            self.scheme, req.repo.repository, req.blob, req.repo.registry
        );
        let mut r = self
            .http
            .get(url)
            .header("authorization", self.token.header_value())
            .header(
                "range",
                format!("bytes={}-{}", req.range.start, req.range.end - 1),
            );
        if let Some(a) = req.registry_authorization {
            r = r.header(REGISTRY_AUTHORIZATION, a);
        }
        let mut resp = r.send().await.map_err(|e| failed(e.to_string()))?;
        match resp.status().as_u16() {
            206 => {}
            404 | 416 => return Err(PeerError::NotHeld),
            503 => return Err(PeerError::Busy),
            s @ (401 | 403) => return Err(PeerError::Refused(s)),
            s => return Err(failed(format!("status {s}"))),
        }
        let content_range = resp
            .headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_content_range);
        if content_range.map(|(a, b, _)| a..b + 1) != Some(req.range.clone()) {
            return Err(failed("answered another range".into()));
        }
        // Bounded by the range asked for, whatever the peer sends.
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        while let Some(chunk) = resp.chunk().await.map_err(|e| failed(e.to_string()))? {
            if (out.len() + chunk.len()) as u64 > len {
                return Err(failed("sent more than the range".into()));
            }
            out.extend_from_slice(&chunk);
        }
        if out.len() as u64 != len {
            return Err(failed("sent less than the range".into()));
        }
        Ok(out)
    }
}

/// The fetch side's settings (from `[p2p]`).
#[derive(Debug, Clone)]
pub struct FetcherConfig {
    /// This daemon's name in the membership.
    pub self_name: String,
    /// The other daemons.
    pub peers: Vec<String>,
    /// R.
    pub roots: usize,
    /// F.
    pub fan_out: usize,
    /// Members asked after the parent.
    pub fallbacks: usize,
    /// The unit members are ranked by.
    pub piece_size: u64,
    /// Longest a read waits on peers altogether.
    pub peer_timeout: Duration,
    /// How long a failed peer is skipped.
    pub penalty: Duration,
}

/// The membership as it is now, this daemon's place in it included.
#[derive(Debug)]
struct View {
    me: usize,
    me_id: PeerId,
    membership: Membership,
}

impl View {
    fn new(me_id: PeerId, others: impl IntoIterator<Item = PeerId>) -> View {
        let membership = Membership::new(others.into_iter().chain(std::iter::once(me_id.clone())));
        let me = membership.index_of(&me_id).unwrap_or_default();
        View {
            me,
            me_id,
            membership,
        }
    }
}

/// Whom to ask for a piece, and the asking; shared by every peer-routed layer. The
/// membership can change while it runs ([`PeerFetcher::set_members`]: DNS).
pub struct PeerFetcher {
    view: RwLock<Arc<View>>,
    schedule: Schedule,
    config: FetcherConfig,
    transport: Arc<dyn PeerTransport>,
    credentials: Arc<dyn OriginCredentials>,
    /// Member → skipped until; only members are kept, so it is bounded by the
    /// membership.
    penalties: Mutex<HashMap<PeerId, Instant>>,
    stats: Arc<P2pStats>,
    handle: tokio::runtime::Handle,
}

impl fmt::Debug for PeerFetcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let view = self.view();
        f.debug_struct("PeerFetcher")
            .field("me", &view.me_id)
            .field("members", &view.membership.len())
            .finish()
    }
}

impl PeerFetcher {
    /// A fetcher over `config`'s membership (this daemon included), asking peers through
    /// `transport` with the credentials of `credentials`, on `handle`.
    pub fn new(
        config: FetcherConfig,
        transport: Arc<dyn PeerTransport>,
        credentials: Arc<dyn OriginCredentials>,
        stats: Arc<P2pStats>,
        handle: tokio::runtime::Handle,
    ) -> Result<PeerFetcher, ferry_p2p::Error> {
        let schedule = Schedule::new(Topology::PieceHrw, config.roots, config.fan_out)?;
        let view = View::new(
            PeerId(config.self_name.clone()),
            config.peers.iter().map(|p| PeerId(p.clone())),
        );
        Ok(PeerFetcher {
            view: RwLock::new(Arc::new(view)),
            schedule,
            config,
            transport,
            credentials,
            penalties: Mutex::new(HashMap::new()),
            stats,
            handle,
        })
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<P2pStats> {
        &self.stats
    }

    fn view(&self) -> Arc<View> {
        self.view.read().clone()
    }

    /// Replaces the membership with `others` and this daemon, named `me` (`None`: as
    /// it was). Penalties of members that stay are kept; the rest are forgotten.
    pub fn set_members(&self, others: impl IntoIterator<Item = PeerId>, me: Option<PeerId>) {
        let me_id = me.unwrap_or_else(|| self.view().me_id.clone());
        let view = View::new(me_id, others);
        self.penalties
            .lock()
            .retain(|peer, _| view.membership.index_of(peer).is_some());
        *self.view.write() = Arc::new(view);
    }

    /// The members, this daemon included, in membership order.
    pub fn members(&self) -> Vec<PeerId> {
        let view = self.view();
        view.membership
            .members()
            .iter()
            .map(|m| m.id.clone())
            .collect()
    }

    /// This daemon's name in the membership.
    pub fn me(&self) -> PeerId {
        self.view().me_id.clone()
    }

    /// The members to ask, in order, for the piece of `blob` holding byte `offset`:
    /// empty when this daemon is one of the piece's roots (it reads the registry).
    pub fn candidates(&self, blob: &Digest, offset: u64) -> Vec<PeerId> {
        let view = self.view();
        let index = u32::try_from(offset / self.config.piece_size.max(1)).unwrap_or(u32::MAX);
        let tree = self
            .schedule
            .tree(&view.membership, &PieceId::new(blob.clone(), index));
        let parent = match tree.parent(view.me) {
            Source::Origin => return Vec::new(),
            Source::Peer(p) => p,
        };
        std::iter::once(parent)
            .chain(tree.fallbacks(view.me, self.config.fallbacks))
            .map(|m| view.membership.members()[m].id.clone())
            .collect()
    }

    fn penalised(&self, peer: &PeerId, now: Instant) -> bool {
        let mut p = self.penalties.lock();
        match p.get(peer) {
            Some(until) if now < *until => true,
            Some(_) => {
                p.remove(peer);
                false
            }
            None => false,
        }
    }

    fn penalise(&self, peer: &PeerId, why: &str) {
        tracing::info!(%peer, reason = why, penalty = ?self.config.penalty, "skipping a peer for a while");
        P2pStats::add(&self.stats.peer_failures, 1);
        if self.view().membership.index_of(peer).is_some() {
            self.penalties
                .lock()
                .insert(peer.clone(), Instant::now() + self.config.penalty);
        }
    }

    /// Whether `peer` is being skipped now.
    pub fn is_penalised(&self, peer: &PeerId) -> bool {
        self.penalised(peer, Instant::now())
    }

    /// `range` of `blob` (a layer or a windows blob, as `table` says) from a peer,
    /// verified against `table`; `None` when this daemon should read the registry
    /// instead (a root, a range that is not whole spans, or no peer served it within the
    /// deadline).
    pub async fn fetch(
        &self,
        repo: &Repo,
        blob: &Digest,
        table: &SpanTable,
        range: Range<u64>,
    ) -> Option<Vec<u8>> {
        let ks = table.exactly(&range)?;
        let candidates = self.candidates(blob, range.start);
        if candidates.is_empty() {
            return None;
        }
        let deadline = tokio::time::Instant::now() + self.config.peer_timeout;
        let got = tokio::time::timeout_at(deadline, async {
            // A credential we cannot get now is a registry round trip the read would wait
            // for anyway: then the registry it is.
            let authorization = self.credentials.pull_authorization(repo).await.ok()?;
            // A password is never handed to peers: a registry that takes Basic auth is
            // read directly (a bearer token is short-lived and scoped to one pull).
            if authorization
                .as_deref()
                .is_some_and(|a| !a.starts_with("Bearer "))
            {
                return None;
            }
            for peer in candidates {
                if self.penalised(&peer, Instant::now()) {
                    continue;
                }
                let req = PeerRequest {
                    repo,
                    blob,
                    range: range.clone(),
                    registry_authorization: authorization.as_deref(),
                };
                // Each attempt is bounded by what is left of the deadline: on expiry
                // the peer it was waiting on is penalised below.
                let answer =
                    tokio::time::timeout_at(deadline, self.transport.fetch(&peer, &req)).await;
                match answer {
                    Err(_) => {
                        self.penalise(&peer, "timed out");
                        return None;
                    }
                    Ok(Ok(bytes)) => {
                        if verify(table, ks.clone(), range.start, &bytes) {
                            return Some(bytes);
                        }
                        P2pStats::add(&self.stats.peer_corrupt, 1);
                        self.penalise(&peer, "served bytes that do not match the index");
                    }
                    Ok(Err(PeerError::NotHeld | PeerError::Busy)) => {}
                    Ok(Err(PeerError::Refused(403))) => {
                        tracing::debug!(%peer, %repo, "peer refused our pull right");
                    }
                    Ok(Err(e)) => self.penalise(&peer, &e.to_string()),
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        match got {
            Some(bytes) => {
                P2pStats::add(
                    self.stats.fetched_from_peers(table.kind()),
                    bytes.len() as u64,
                );
                Some(bytes)
            }
            None => {
                P2pStats::add(&self.stats.fallbacks_to_origin, 1);
                None
            }
        }
    }
}

/// Whether `bytes` (the range starting at `start`) are spans `ks` of `table`.
fn verify(table: &SpanTable, ks: Range<usize>, start: u64, bytes: &[u8]) -> bool {
    let mut expected = 0u64;
    for k in ks {
        let (r, key) = table.span(k);
        let (Ok(from), Ok(to)) = (
            usize::try_from(r.start - start),
            usize::try_from(r.end - start),
        ) else {
            return false;
        };
        let Some(piece) = bytes.get(from..to) else {
            return false;
        };
        if ChunkKey::of(piece) != *key {
            return false;
        }
        expected = r.end - start;
    }
    expected == bytes.len() as u64
}

/// A layer's (or its windows blob's) [`RangeSource`] that asks peers before its
/// registry source.
pub struct PeerRangeSource {
    origin: Arc<dyn RangeSource>,
    fetcher: Arc<PeerFetcher>,
    repo: Repo,
    blob: Digest,
    table: Arc<SpanTable>,
    /// The layer's windows blob and its windows, routed through peers too when the
    /// device asks for the blob as a sibling.
    windows: Option<(Digest, Arc<SpanTable>)>,
}

impl fmt::Debug for PeerRangeSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerRangeSource")
            .field("blob", &self.blob.to_string())
            .field("repo", &self.repo.to_string())
            .finish()
    }
}

impl PeerRangeSource {
    /// `origin` (the layer's registry source) behind `fetcher`'s peers; `table` is the
    /// layer index's spans, what peer bytes are checked against.
    pub fn new(
        origin: Arc<dyn RangeSource>,
        fetcher: Arc<PeerFetcher>,
        repo: Repo,
        blob: Digest,
        table: Arc<SpanTable>,
    ) -> PeerRangeSource {
        PeerRangeSource {
            origin,
            fetcher,
            repo,
            blob,
            table,
            windows: None,
        }
    }

    /// Routes the layer's windows blob `blob` (laid out as `table`, from
    /// [`SpanTable::of_windows`]) through the same peers when it is read as this
    /// source's sibling.
    pub fn with_windows(mut self, blob: Digest, table: Arc<SpanTable>) -> PeerRangeSource {
        self.windows = Some((blob, table));
        self
    }

    fn count_origin(&self, n: u64) {
        P2pStats::add(self.fetcher.stats.fetched_from_origin(self.table.kind()), n);
    }

    fn ask_peers(&self, range: &Range<u64>) -> io::Result<Option<Vec<u8>>> {
        if tokio::runtime::Handle::try_current().is_ok() {
            // Blocking here would stall a runtime worker; the registry source refuses
            // this too, with its own error.
            return Ok(None);
        }
        let (fetcher, repo, blob, table, range) = (
            self.fetcher.clone(),
            self.repo.clone(),
            self.blob.clone(),
            self.table.clone(),
            range.clone(),
        );
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.fetcher.handle.spawn(async move {
            let _ = tx.send(fetcher.fetch(&repo, &blob, &table, range).await);
        });
        rx.recv()
            .map_err(|_| io::Error::other("the peer runtime shut down before answering"))
    }
}

impl RangeSource for PeerRangeSource {
    fn len(&self) -> u64 {
        self.origin.len()
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        if range.start < range.end
            && let Some(bytes) = self.ask_peers(&range)?
        {
            return Ok(bytes);
        }
        let bytes = self.origin.read_range(range)?;
        self.count_origin(bytes.len() as u64);
        Ok(bytes)
    }

    /// Each range from a peer where one has it; the rest from the origin, in one
    /// request where it batches ranges.
    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(ranges.len());
        let mut missing = Vec::new();
        for range in ranges {
            let from_peer = if range.start < range.end {
                self.ask_peers(range)?
            } else {
                Some(Vec::new())
            };
            if from_peer.is_none() {
                missing.push(range.clone());
            }
            out.push(from_peer);
        }
        let mut fetched = self.origin.read_ranges(&missing)?.into_iter();
        out.into_iter()
            .map(|b| match b {
                Some(b) => Ok(b),
                None => {
                    let bytes = fetched
                        .next()
                        .ok_or_else(|| io::Error::other("a range went unanswered"))?;
                    self.count_origin(bytes.len() as u64);
                    Ok(bytes)
                }
            })
            .collect()
    }

    fn batches_ranges(&self) -> bool {
        self.origin.batches_ranges()
    }

    fn sibling(&self, digest: &str, size: u64) -> Option<Arc<dyn RangeSource>> {
        let origin = self.origin.sibling(digest, size)?;
        match &self.windows {
            Some((blob, table)) if blob.as_ref() == digest && table.size() == size => {
                Some(Arc::new(PeerRangeSource::new(
                    origin,
                    self.fetcher.clone(),
                    self.repo.clone(),
                    blob.clone(),
                    table.clone(),
                )))
            }
            // Any other blob beside the layer: nothing to verify a peer's bytes against.
            _ => Some(origin),
        }
    }
}
