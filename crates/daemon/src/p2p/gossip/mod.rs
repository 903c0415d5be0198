//! Membership by gossip (`[p2p] gossip = true`): SWIM through the `foca` crate, over
//! UDP, every datagram authenticated with an HMAC-SHA256 keyed from the cluster token.
//!
//! * [`wire`]: the envelope (magic, timestamp, nonce, payload, tag) and foca's codec;
//!   everything from the network is decoded there, bounded, and fuzzed.
//! * [`GossipNode`]: foca and the checks around it, with no socket and no clock of its
//!   own: datagrams in ([`GossipNode::handle_datagram`]), datagrams out
//!   ([`GossipNode::take_outbox`]), timers against a [`Clock`]. A datagram is dropped,
//!   and counted by reason, when it is too large, not authenticated, older or newer
//!   than `max_skew`, seen before, malformed, or would take the membership past
//!   `max_members`.
//! * [`run`]: the node on a [`DatagramSocket`] (UDP in the daemon, an in-memory
//!   network in the tests), announcing to the seeds while it knows no member, handing
//!   each membership change to [`MemberSources`].
//!
//! Gossip only says whom to ask: a member found this way is asked like any other, with
//! the cluster token, pull rights checked by the server, bytes verified by digest.

pub mod wire;

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use ferry_p2p::PeerId;
use foca::{Foca, NoCustomBroadcast, Notification, Runtime, Timer};
use parking_lot::Mutex;
use rand010::rngs::StdRng;
use rand010::{Rng as _, SeedableRng as _};

use super::P2pStats;
use super::dns::Resolve;
use super::fetch::PeerFetcher;
pub use wire::{GossipId, GossipKey, MAX_DATAGRAM, WireError};

/// Default bound on the members gossip may know (alive, suspect and down together).
pub const DEFAULT_MAX_MEMBERS: usize = 10_000;
/// Longest a seed's name may take to resolve.
const SEED_RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one datagram may take to send.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// Once in, the seeds are asked again every this many `announce_every`s.
const REANNOUNCE_FACTOR: u32 = 5;
/// Most datagrams remembered against replays (authenticated ones only).
const MAX_SEEN: usize = 65_536;

/// The time, for the gossip's timers and its datagrams' stamps.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Monotonic time since some start.
    fn now(&self) -> Duration;
    /// Milliseconds since the Unix epoch (the stamp of a datagram).
    fn unix_ms(&self) -> u64;
    /// Resolves once [`Clock::now`] has reached `at`.
    fn sleep_until(&self, at: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
}

/// The system's clocks.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            start: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
    fn unix_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
    fn sleep_until(&self, at: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        Box::pin(tokio::time::sleep(at.saturating_sub(self.now())))
    }
}

/// A clock that moves only when told (tests, the fuzz target, the measurement).
#[derive(Debug)]
pub struct ManualClock {
    ms: tokio::sync::watch::Sender<u64>,
    epoch_ms: u64,
}

impl ManualClock {
    /// At `epoch_ms` on the wall clock, 0 on the monotonic one.
    pub fn new(epoch_ms: u64) -> ManualClock {
        ManualClock {
            ms: tokio::sync::watch::Sender::new(0),
            epoch_ms,
        }
    }
    /// Moves both clocks on by `d` (waking the sleeps that are due).
    pub fn advance(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.ms.send_modify(|now| *now = now.saturating_add(ms));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_millis(*self.ms.borrow())
    }
    fn unix_ms(&self) -> u64 {
        self.epoch_ms.saturating_add(*self.ms.borrow())
    }
    fn sleep_until(&self, at: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + 'static>> {
        let mut rx = self.ms.subscribe();
        let at = u64::try_from(at.as_millis()).unwrap_or(u64::MAX);
        Box::pin(async move {
            if rx.wait_for(|now| *now >= at).await.is_err() {
                // The clock is gone: nothing will ever be due.
                std::future::pending::<()>().await;
            }
        })
    }
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Dropped {
    #[error("larger than the bound")]
    Oversized,
    #[error("not authenticated with the cluster's key")]
    Unauthenticated,
    #[error("stamped too far from now")]
    Stale,
    #[error("seen before")]
    Replayed,
    #[error("malformed")]
    Malformed,
    #[error("would take the membership past its bound")]
    MemberCap,
    #[error("refused by the protocol")]
    Refused,
}

/// The gossip's counters (part of [`P2pStats`]).
#[derive(Debug, Default)]
pub struct GossipStats {
    pub members: AtomicU64,
    pub datagrams_in: AtomicU64,
    pub datagrams_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub dropped_oversized: AtomicU64,
    pub dropped_unauthenticated: AtomicU64,
    pub dropped_stale: AtomicU64,
    pub dropped_replayed: AtomicU64,
    pub dropped_malformed: AtomicU64,
    pub dropped_member_cap: AtomicU64,
    pub dropped_refused: AtomicU64,
}

impl GossipStats {
    fn drop_counter(&self, why: Dropped) -> &AtomicU64 {
        match why {
            Dropped::Oversized => &self.dropped_oversized,
            Dropped::Unauthenticated => &self.dropped_unauthenticated,
            Dropped::Stale => &self.dropped_stale,
            Dropped::Replayed => &self.dropped_replayed,
            Dropped::Malformed => &self.dropped_malformed,
            Dropped::MemberCap => &self.dropped_member_cap,
            Dropped::Refused => &self.dropped_refused,
        }
    }
}

/// The gossip's settings (from `[p2p]`).
#[derive(Debug, Clone)]
pub struct GossipConfig {
    /// This daemon: its peer-server name, its gossip address, its generation.
    pub me: GossipId,
    /// How often a random member is probed.
    pub probe_period: Duration,
    /// How long a probe waits for its answer before asking others to probe.
    pub probe_rtt: Duration,
    /// How long a suspected member has to refute before it is declared down.
    pub suspect_after: Duration,
    /// How often updates are sent to a few random members besides the probes.
    pub gossip_interval: Duration,
    /// Most members known at once.
    pub max_members: usize,
    /// Datagrams stamped further than this from now are dropped.
    pub max_skew: Duration,
}

impl GossipConfig {
    fn foca(&self) -> foca::Config {
        let mut c = foca::Config::simple();
        c.probe_period = self.probe_period;
        c.probe_rtt = self.probe_rtt;
        c.suspect_to_down_after = self.suspect_after;
        c.max_packet_size =
            std::num::NonZeroUsize::new(wire::MAX_PAYLOAD).unwrap_or(std::num::NonZeroUsize::MIN);
        c.notify_down_members = true;
        // Forget down members after an hour; a restarted daemon comes back under a
        // new generation anyway.
        c.remove_down_after = Some(Duration::from_secs(3600));
        c.periodic_gossip = Some(foca::PeriodicParams {
            frequency: self.gossip_interval,
            num_members: std::num::NonZeroUsize::new(3).unwrap_or(std::num::NonZeroUsize::MIN),
        });
        c.periodic_announce = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(30),
            num_members: std::num::NonZeroUsize::MIN,
        });
        c.periodic_announce_to_down_members = Some(foca::PeriodicParams {
            frequency: Duration::from_secs(60),
            num_members: std::num::NonZeroUsize::MIN,
        });
        c
    }
}

type Timers = BTreeMap<(Duration, u64), Timer<GossipId>>;

/// foca's view of the world, for one call.
struct Rt<'a> {
    now: Duration,
    seq: &'a mut u64,
    timers: &'a mut Timers,
    sends: &'a mut Vec<(GossipId, Vec<u8>)>,
    changed: &'a mut bool,
}

impl Runtime<GossipId> for Rt<'_> {
    fn notify(&mut self, n: Notification<'_, GossipId>) {
        match n {
            Notification::MemberUp(id) => {
                tracing::info!(peer = %id.peer, gossip = %id.gossip, "p2p gossip: member up");
                *self.changed = true;
            }
            Notification::MemberDown(id) => {
                tracing::info!(peer = %id.peer, gossip = %id.gossip, "p2p gossip: member down");
                *self.changed = true;
            }
            Notification::Rename(..) | Notification::Rejoin(_) | Notification::Idle => {
                *self.changed = true;
            }
            Notification::Defunct => {
                tracing::warn!("p2p gossip: this daemon was declared down");
                *self.changed = true;
            }
            _ => {}
        }
    }
    fn send_to(&mut self, to: GossipId, data: &[u8]) {
        self.sends.push((to, data.to_vec()));
    }
    fn submit_after(&mut self, event: Timer<GossipId>, after: Duration) {
        *self.seq += 1;
        self.timers.insert((self.now + after, *self.seq), event);
    }
}

/// One daemon's gossip, without sockets: datagrams in and out, timers due.
pub struct GossipNode {
    foca: Foca<GossipId, wire::WireCodec, StdRng, NoCustomBroadcast>,
    config: GossipConfig,
    key: GossipKey,
    clock: Arc<dyn Clock>,
    nonces: StdRng,
    timers: Timers,
    seq: u64,
    sends: Vec<(GossipId, Vec<u8>)>,
    outbox: Vec<(SocketAddr, Vec<u8>)>,
    seen: HashSet<[u8; 16]>,
    seen_order: VecDeque<([u8; 16], u64)>,
    known: HashSet<SocketAddr>,
    known_dirty: bool,
    changed: bool,
    stats: Arc<P2pStats>,
}

impl fmt::Debug for GossipNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GossipNode")
            .field("me", self.foca.identity())
            .field("members", &self.foca.num_members())
            .finish()
    }
}

impl GossipNode {
    /// A node that knows no one yet; `seed` seeds its randomness (probe order, nonces).
    pub fn new(
        config: GossipConfig,
        key: GossipKey,
        clock: Arc<dyn Clock>,
        seed: u64,
        stats: Arc<P2pStats>,
    ) -> GossipNode {
        let foca = Foca::new(
            config.me.clone(),
            config.foca(),
            StdRng::seed_from_u64(seed),
            wire::WireCodec,
        );
        GossipNode {
            foca,
            config,
            key,
            clock,
            nonces: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            timers: BTreeMap::new(),
            seq: 0,
            sends: Vec::new(),
            outbox: Vec::new(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
            known: HashSet::new(),
            known_dirty: false,
            changed: false,
            stats,
        }
    }

    /// This daemon's identity.
    pub fn me(&self) -> &GossipId {
        self.foca.identity()
    }

    fn rt(
        &mut self,
    ) -> (
        &mut Foca<GossipId, wire::WireCodec, StdRng, NoCustomBroadcast>,
        Rt<'_>,
    ) {
        let now = self.clock.now();
        (
            &mut self.foca,
            Rt {
                now,
                seq: &mut self.seq,
                timers: &mut self.timers,
                sends: &mut self.sends,
                changed: &mut self.changed,
            },
        )
    }

    fn seal_sends(&mut self) {
        for (to, data) in std::mem::take(&mut self.sends) {
            let sealed = wire::seal(
                &self.key,
                self.clock.unix_ms(),
                self.nonces.next_u64(),
                &data,
            );
            P2pStats::add(&self.stats.gossip.datagrams_out, 1);
            P2pStats::add(&self.stats.gossip.bytes_out, sealed.len() as u64);
            self.outbox.push((to.gossip, sealed));
        }
        self.known_dirty = true;
    }

    /// Asks the daemon gossiping at `to` to let this one in (a seed).
    pub fn announce(&mut self, to: SocketAddr) {
        if to == self.me().gossip {
            return;
        }
        // The receiver accepts an announcement addressed to its address whatever the
        // rest of the identity says; a seed is known by its address alone.
        let dst = GossipId {
            peer: "seed:0".into(),
            gossip: to,
            generation: 0,
        };
        let (foca, rt) = self.rt();
        if let Err(e) = foca.announce(dst, rt) {
            tracing::debug!(error = %e, %to, "p2p gossip: cannot announce");
        }
        self.seal_sends();
    }

    /// Tells the members this daemon is leaving (on the way out).
    pub fn leave(&mut self) {
        let (foca, rt) = self.rt();
        let _ = foca.leave_cluster(rt);
        self.seal_sends();
    }

    fn refresh_known(&mut self) {
        if self.known_dirty {
            self.known = self
                .foca
                .iter_membership_state()
                .map(|m| m.id().gossip)
                .collect();
            self.known_dirty = false;
        }
    }

    /// Checks `datagram` and hands it to foca; why it was dropped otherwise (counted).
    pub fn handle_datagram(&mut self, datagram: &[u8]) -> Result<(), Dropped> {
        P2pStats::add(&self.stats.gossip.datagrams_in, 1);
        P2pStats::add(&self.stats.gossip.bytes_in, datagram.len() as u64);
        let r = self.check_and_apply(datagram);
        if let Err(why) = r {
            P2pStats::add(self.stats.gossip.drop_counter(why), 1);
            tracing::debug!(reason = %why, "p2p gossip: datagram dropped");
        }
        r
    }

    fn check_and_apply(&mut self, datagram: &[u8]) -> Result<(), Dropped> {
        let opened = wire::open(&self.key, datagram).map_err(|e| match e {
            WireError::Oversized => Dropped::Oversized,
            _ => Dropped::Unauthenticated,
        })?;
        let now = self.clock.unix_ms();
        let skew = u64::try_from(self.config.max_skew.as_millis()).unwrap_or(u64::MAX);
        if opened.unix_ms.abs_diff(now) > skew {
            return Err(Dropped::Stale);
        }
        // Forget what is too old to be replayed (the stamp check refuses it), and the
        // oldest beyond the bound (only authenticated datagrams get here).
        while let Some((k, at)) = self.seen_order.front().copied() {
            if at.saturating_add(skew) < now || self.seen_order.len() >= MAX_SEEN {
                self.seen.remove(&k);
                self.seen_order.pop_front();
            } else {
                break;
            }
        }
        let mut k = [0u8; 16];
        k.copy_from_slice(&opened.tag[..16]);
        if !self.seen.insert(k) {
            return Err(Dropped::Replayed);
        }
        self.seen_order.push_back((k, opened.unix_ms));
        let payload = wire::decode_payload(opened.payload).map_err(|_| Dropped::Malformed)?;
        self.refresh_known();
        let me = self.me().gossip;
        let new: HashSet<SocketAddr> = payload
            .identities()
            .map(|id| id.gossip)
            .filter(|a| *a != me && !self.known.contains(a))
            .collect();
        if self.known.len() + new.len() > self.config.max_members {
            return Err(Dropped::MemberCap);
        }
        let (foca, rt) = self.rt();
        let r = foca.handle_data(opened.payload, rt);
        self.seal_sends();
        r.map_err(|e| {
            tracing::trace!(error = %e, "p2p gossip: foca refused a datagram");
            Dropped::Refused
        })
    }

    /// When the next timer is due (on [`Clock::now`]'s scale).
    pub fn next_timer(&self) -> Option<Duration> {
        self.timers.keys().next().map(|(at, _)| *at)
    }

    /// Runs the timers that are due.
    pub fn handle_due_timers(&mut self) {
        let now = self.clock.now();
        while let Some(entry) = self.timers.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let timer = entry.remove();
            let (foca, rt) = self.rt();
            if let Err(e) = foca.handle_timer(timer, rt) {
                tracing::trace!(error = %e, "p2p gossip: timer");
            }
        }
        self.seal_sends();
    }

    /// The datagrams to send, with their destinations.
    pub fn take_outbox(&mut self) -> Vec<(SocketAddr, Vec<u8>)> {
        std::mem::take(&mut self.outbox)
    }

    /// Whether the members changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The live members (alive or suspected), this daemon left out, by peer-server name,
    /// sorted.
    pub fn members(&self) -> Vec<PeerId> {
        let mut out: Vec<PeerId> = self
            .foca
            .iter_members()
            .filter(|m| m.id().peer != self.me().peer)
            .map(|m| PeerId(m.id().peer.clone()))
            .collect();
        out.sort();
        out.dedup();
        out.truncate(self.config.max_members);
        out
    }

    /// Whether it knows no live member.
    pub fn is_alone(&self) -> bool {
        self.foca.num_members() == 0
    }
}

/// Sends and receives datagrams.
#[async_trait]
pub trait DatagramSocket: Send + Sync + fmt::Debug {
    /// The next datagram into `buf`; its length (a longer one is cut at `buf`'s).
    async fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// `bytes` to `to`.
    async fn send(&self, to: SocketAddr, bytes: &[u8]) -> std::io::Result<()>;
}

#[async_trait]
impl DatagramSocket for tokio::net::UdpSocket {
    async fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        Ok(self.recv_from(buf).await?.0)
    }
    async fn send(&self, to: SocketAddr, bytes: &[u8]) -> std::io::Result<()> {
        self.send_to(bytes, to).await.map(|_| ())
    }
}

/// The membership every source contributes to, handed to the fetcher whole on each
/// change: the static list, the DNS members, the gossip members.
#[derive(Debug)]
pub struct MemberSources {
    fetcher: Arc<PeerFetcher>,
    statics: Vec<PeerId>,
    parts: Mutex<SourceParts>,
}

#[derive(Debug, Default)]
struct SourceParts {
    dns: Vec<PeerId>,
    dns_me: Option<PeerId>,
    gossip: Vec<PeerId>,
}

impl MemberSources {
    /// Over `fetcher`, with the static `peers`.
    pub fn new(fetcher: Arc<PeerFetcher>, peers: &[String]) -> MemberSources {
        MemberSources {
            fetcher,
            statics: peers.iter().map(|p| PeerId(p.clone())).collect(),
            parts: Mutex::new(SourceParts::default()),
        }
    }

    /// The fetcher the membership goes to.
    pub fn fetcher(&self) -> &Arc<PeerFetcher> {
        &self.fetcher
    }

    fn apply(&self, parts: &SourceParts) {
        self.fetcher.set_members(
            self.statics
                .iter()
                .chain(&parts.dns)
                .chain(&parts.gossip)
                .cloned(),
            parts.dns_me.clone(),
        );
    }

    /// The DNS members now, and this daemon's name as DNS gives it.
    pub fn set_dns(&self, members: &[PeerId], me: Option<PeerId>) {
        let mut parts = self.parts.lock();
        parts.dns = members.to_vec();
        parts.dns_me = me;
        self.apply(&parts);
    }

    /// The gossip members now.
    pub fn set_gossip(&self, members: Vec<PeerId>) {
        let mut parts = self.parts.lock();
        parts.gossip = members;
        self.apply(&parts);
    }
}

/// What [`run`] drives a node with.
#[derive(Debug)]
pub struct Driver {
    /// The gossip's socket.
    pub socket: Arc<dyn DatagramSocket>,
    /// `host:port` (or `ip:port`) of daemons to announce to while alone.
    pub seeds: Vec<String>,
    /// Resolves seed names.
    pub resolver: Arc<dyn Resolve>,
    /// The node's clock.
    pub clock: Arc<dyn Clock>,
    /// Where membership changes go.
    pub sources: Arc<MemberSources>,
    /// How often the seeds are asked again while no member is known.
    pub announce_every: Duration,
}

/// Runs `node` until `stop`: announces to every seed every `announce_every` while it
/// knows no member, every 5 × `announce_every` once it does (so groups that formed
/// apart join up); hands each membership change to the sources. On the way out it
/// tells the members it leaves.
pub async fn run(mut node: GossipNode, d: Driver, stop: impl Future<Output = ()>) {
    tokio::pin!(stop);
    let mut buf = vec![0u8; MAX_DATAGRAM + 1];
    let mut next_announce = d.clock.now();
    let stats = d.sources.fetcher().stats().clone();
    loop {
        let now = d.clock.now();
        if now >= next_announce {
            // While alone, the seeds are asked often; once in, now and then as well: daemons
            // that start together can each find a different seed first and form groups
            // that know nothing of each other, which only a seed can join up.
            let alone = node.is_alone();
            for seed in resolve_seeds(&d.seeds, d.resolver.as_ref()).await {
                node.announce(seed);
            }
            next_announce = d.clock.now()
                + if alone {
                    d.announce_every
                } else {
                    d.announce_every * REANNOUNCE_FACTOR
                };
        }
        flush(&mut node, d.socket.as_ref()).await;
        if node.take_changed() {
            let members = node.members();
            stats
                .gossip
                .members
                .store(members.len() as u64, Ordering::Relaxed);
            d.sources.set_gossip(members);
        }
        let mut wake = next_announce;
        if let Some(t) = node.next_timer() {
            wake = wake.min(t);
        }
        tokio::select! {
            _ = &mut stop => {
                node.leave();
                flush(&mut node, d.socket.as_ref()).await;
                return;
            }
            got = d.socket.recv(&mut buf) => match got {
                Ok(n) => {
                    let _ = node.handle_datagram(&buf[..n]);
                }
                Err(e) => tracing::debug!(error = %e, "p2p gossip: receive failed"),
            },
            _ = d.clock.sleep_until(wake) => {}
        }
        node.handle_due_timers();
    }
}

async fn flush(node: &mut GossipNode, socket: &dyn DatagramSocket) {
    for (to, bytes) in node.take_outbox() {
        match tokio::time::timeout(SEND_TIMEOUT, socket.send(to, &bytes)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, %to, "p2p gossip: send failed"),
            Err(_) => tracing::debug!(%to, "p2p gossip: send timed out"),
        }
    }
}

async fn resolve_seeds(seeds: &[String], resolver: &dyn Resolve) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for seed in seeds {
        if let Ok(a) = seed.parse::<SocketAddr>() {
            out.push(a);
            continue;
        }
        let Some((host, port)) = seed.rsplit_once(':') else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        match tokio::time::timeout(SEED_RESOLVE_TIMEOUT, resolver.resolve(host, port)).await {
            Ok(Ok(addrs)) => out.extend(addrs),
            Ok(Err(e)) => tracing::debug!(seed, error = %e, "p2p gossip: seed does not resolve"),
            Err(_) => tracing::debug!(seed, "p2p gossip: seed resolution timed out"),
        }
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
