//! Membership from DNS (`[p2p] peers_dns = "name:port"`): every A/AAAA record of the
//! name, at that port, is a member — a Kubernetes headless service lists the ready pods
//! of a DaemonSet this way. Re-resolved every `peers_dns_refresh` and merged with the
//! static `peers`.
//!
//! * This daemon is recognised and left out of the peers: the address equal to its
//!   `self_name`, or an address of one of its interfaces at its listening port. When
//!   `self_name` is not set, the address DNS gives it becomes its name in the
//!   membership, so that it ranks itself as the others rank it.
//! * A failed resolution keeps the last good membership (a DNS outage must not turn
//!   the fleet into a registry stampede), with one warning until it resolves again.
//! * At most [`MAX_DNS_MEMBERS`] members are taken, the first in address order, so
//!   every daemon keeps the same ones.
//!
//! Resolution goes through [`Resolve`] ([`SystemResolver`]: the system resolver, as
//! every other name the daemon looks up), so tests use an in-memory one.

use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_p2p::PeerId;

use super::gossip::MemberSources;

/// Most members taken from DNS; more are dropped (with a warning).
pub const MAX_DNS_MEMBERS: usize = 4096;
/// Longest one resolution may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Looks a name up.
#[async_trait]
pub trait Resolve: Send + Sync + fmt::Debug {
    /// The addresses of `host`, each at `port`.
    async fn resolve(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>>;
}

/// The system resolver (`getaddrinfo`, through tokio's `lookup_host`): what
/// `/etc/resolv.conf` and the pod's DNS policy say.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

#[async_trait]
impl Resolve for SystemResolver {
    async fn resolve(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        Ok(tokio::net::lookup_host((host, port)).await?.collect())
    }
}

/// Why `peers_dns` cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("p2p.peers_dns: {0:?} is not name:port")]
pub struct DnsTargetError(pub String);

/// What a refresh found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// The members (or this daemon's name) changed.
    Changed,
    /// The same as before.
    Unchanged,
    /// The name did not resolve; the last good members are kept.
    Failed,
}

/// The DNS side of the membership: the last good answer, this daemon left out.
#[derive(Debug)]
pub struct DnsMembership {
    resolver: Arc<dyn Resolve>,
    host: String,
    port: u16,
    self_name: Option<String>,
    listen: SocketAddr,
    local: Vec<IpAddr>,
    timeout: Duration,
    members: Vec<PeerId>,
    me: Option<PeerId>,
    resolved_once: bool,
    failing: bool,
    warnings: u64,
}

impl DnsMembership {
    /// Members from `target` (`name:port`) through `resolver`. This daemon is the
    /// address `self_name` names (when set), or one of `local` (its interfaces'
    /// addresses) or `listen`'s own address, at `listen`'s port.
    pub fn new(
        resolver: Arc<dyn Resolve>,
        target: &str,
        self_name: Option<String>,
        listen: SocketAddr,
        local: Vec<IpAddr>,
    ) -> Result<DnsMembership, DnsTargetError> {
        let bad = || DnsTargetError(target.to_owned());
        let (host, port) = target.rsplit_once(':').ok_or_else(bad)?;
        let port = port.parse::<u16>().map_err(|_| bad())?;
        // `[::1]:7050` names an address: resolving it gives it back.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad());
        }
        Ok(DnsMembership {
            resolver,
            host: host.to_owned(),
            port,
            self_name,
            listen,
            local,
            timeout: RESOLVE_TIMEOUT,
            members: Vec::new(),
            me: None,
            resolved_once: false,
            failing: false,
            warnings: 0,
        })
    }

    /// With another resolution timeout (tests).
    pub fn with_timeout(mut self, timeout: Duration) -> DnsMembership {
        self.timeout = timeout;
        self
    }

    /// The members of the last good answer, this daemon left out, in address order.
    pub fn members(&self) -> &[PeerId] {
        &self.members
    }

    /// The name DNS gives this daemon, when `self_name` is not set and DNS lists one of
    /// its addresses.
    pub fn me(&self) -> Option<&PeerId> {
        self.me.as_ref()
    }

    /// How many warnings resolution failures have logged (one per run of failures).
    pub fn warnings(&self) -> u64 {
        self.warnings
    }

    fn is_me(&self, addr: &SocketAddr, name: &str) -> bool {
        if self.self_name.as_deref() == Some(name) {
            return true;
        }
        addr.port() == self.listen.port()
            && (self.local.contains(&addr.ip())
                || (!self.listen.ip().is_unspecified() && self.listen.ip() == addr.ip()))
    }

    /// Resolves the name once and takes the answer as the members.
    pub async fn refresh(&mut self) -> Refresh {
        let answer =
            tokio::time::timeout(self.timeout, self.resolver.resolve(&self.host, self.port)).await;
        let addrs = match answer {
            Ok(Ok(addrs)) => addrs,
            Ok(Err(e)) => return self.failed(&e.to_string()),
            Err(_) => return self.failed("timed out"),
        };
        if self.failing {
            tracing::info!(name = %self.host, "p2p.peers_dns resolves again");
            self.failing = false;
        }
        let mut me = None;
        let mut members: Vec<PeerId> = Vec::with_capacity(addrs.len().min(MAX_DNS_MEMBERS));
        for addr in addrs {
            // A mapped IPv4 address is the IPv4 one: one node, one name.
            let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
            let name = addr.to_string();
            if self.is_me(&addr, &name) {
                me.get_or_insert(PeerId(name));
            } else {
                members.push(PeerId(name));
            }
        }
        members.sort();
        members.dedup();
        if members.len() > MAX_DNS_MEMBERS {
            tracing::warn!(
                name = %self.host,
                answered = members.len(),
                kept = MAX_DNS_MEMBERS,
                "p2p.peers_dns lists more members than the bound; the first in address order are kept"
            );
            members.truncate(MAX_DNS_MEMBERS);
        }
        if self.self_name.is_some() {
            me = None;
        }
        let changed = !self.resolved_once || members != self.members || me != self.me;
        if changed {
            tracing::info!(
                name = %self.host,
                members = members.len(),
                me = ?me.as_ref().map(|m| &m.0),
                "p2p membership from DNS"
            );
        }
        self.resolved_once = true;
        self.members = members;
        self.me = me;
        if changed {
            Refresh::Changed
        } else {
            Refresh::Unchanged
        }
    }

    fn failed(&mut self, why: &str) -> Refresh {
        if !self.failing {
            self.failing = true;
            self.warnings += 1;
            tracing::warn!(
                name = %self.host,
                error = why,
                kept = self.members.len(),
                "p2p.peers_dns does not resolve; keeping the last members until it does"
            );
        }
        Refresh::Failed
    }
}

/// Hands the DNS members (and this daemon's name as DNS gives it) to `sources`.
pub fn apply(sources: &MemberSources, dns: &DnsMembership) {
    sources.set_dns(dns.members(), dns.me().cloned());
}

/// Re-resolves every `every` until `stop` resolves, handing each change to `sources`.
pub async fn run(
    mut dns: DnsMembership,
    sources: Arc<MemberSources>,
    every: Duration,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(every) => {}
        }
        if dns.refresh().await == Refresh::Changed {
            apply(&sources, &dns);
        }
    }
}

/// The addresses of this host's interfaces (empty when they cannot be listed).
pub fn local_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!(
            "cannot list this host's addresses; recognising it in DNS by self_name only"
        );
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|a| {
            let a = a.address?;
            if let Some(v4) = a.as_sockaddr_in() {
                return Some(IpAddr::V4(v4.ip()));
            }
            a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::VecDeque;
    use std::io;

    use parking_lot::Mutex;

    use super::*;

    /// Answers in order; `None` in the script hangs (past any timeout).
    #[derive(Debug, Default)]
    struct Scripted {
        answers: Mutex<VecDeque<Option<io::Result<Vec<SocketAddr>>>>>,
        asked: Mutex<Vec<(String, u16)>>,
    }

    impl Scripted {
        fn then(&self, answer: io::Result<Vec<&str>>) -> &Self {
            let answer = answer.map(|v| v.into_iter().map(|a| a.parse().unwrap()).collect());
            self.answers.lock().push_back(Some(answer));
            self
        }
        fn hang(&self) -> &Self {
            self.answers.lock().push_back(None);
            self
        }
    }

    #[async_trait]
    impl Resolve for Scripted {
        async fn resolve(&self, host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
            self.asked.lock().push((host.to_owned(), port));
            let next = self.answers.lock().pop_front();
            match next {
                Some(Some(answer)) => answer,
                Some(None) => std::future::pending().await,
                None => Err(io::Error::other("no more answers")),
            }
        }
    }

    fn nxdomain() -> io::Result<Vec<&'static str>> {
        Err(io::Error::new(io::ErrorKind::NotFound, "no such name"))
    }

    fn dns(r: &Arc<Scripted>, self_name: Option<&str>, local: &[&str]) -> DnsMembership {
        DnsMembership::new(
            r.clone(),
            "ferry-peers.kube-system.svc.cluster.local:7050",
            self_name.map(str::to_owned),
            "0.0.0.0:7050".parse().unwrap(),
            local.iter().map(|a| a.parse().unwrap()).collect(),
        )
        .unwrap()
    }

    fn names(d: &DnsMembership) -> Vec<&str> {
        d.members().iter().map(|p| p.0.as_str()).collect()
    }

    #[tokio::test]
    async fn members_follow_the_records_as_they_come_and_go() {
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["10.0.0.7:7050", "10.0.0.6:7050"]))
            .then(Ok(vec!["10.0.0.6:7050", "10.0.0.8:7050", "10.0.0.7:7050"]))
            .then(Ok(vec!["10.0.0.8:7050"]))
            .then(Ok(vec!["10.0.0.8:7050", "10.0.0.8:7050"]));
        let mut d = dns(&r, None, &[]);
        assert_eq!(d.refresh().await, Refresh::Changed);
        assert_eq!(names(&d), ["10.0.0.6:7050", "10.0.0.7:7050"], "sorted");
        assert_eq!(d.refresh().await, Refresh::Changed, "one added");
        assert_eq!(names(&d).len(), 3);
        assert_eq!(d.refresh().await, Refresh::Changed, "two removed");
        assert_eq!(names(&d), ["10.0.0.8:7050"]);
        assert_eq!(d.refresh().await, Refresh::Unchanged, "duplicates are one");
        assert_eq!(
            r.asked.lock()[0],
            ("ferry-peers.kube-system.svc.cluster.local".to_owned(), 7050)
        );
        assert_eq!(d.warnings(), 0);
    }

    #[tokio::test]
    async fn a_failed_resolution_keeps_the_last_members_and_warns_once() {
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["10.0.0.6:7050", "10.0.0.7:7050"]))
            .then(nxdomain())
            .hang()
            .then(nxdomain())
            .then(Ok(vec!["10.0.0.6:7050"]))
            .then(nxdomain());
        let mut d = dns(&r, None, &[]).with_timeout(Duration::from_millis(50));
        assert_eq!(d.refresh().await, Refresh::Changed);
        for _ in 0..3 {
            // An error, a timeout, an error: the same members, one warning.
            assert_eq!(d.refresh().await, Refresh::Failed);
            assert_eq!(names(&d), ["10.0.0.6:7050", "10.0.0.7:7050"]);
        }
        assert_eq!(d.warnings(), 1);
        assert_eq!(d.refresh().await, Refresh::Changed);
        assert_eq!(names(&d), ["10.0.0.6:7050"]);
        // A new run of failures warns again, once.
        assert_eq!(d.refresh().await, Refresh::Failed);
        assert_eq!(d.warnings(), 2);
        // Failing before any success: no members, and no panic.
        let r = Arc::new(Scripted::default());
        r.then(nxdomain());
        let mut d = dns(&r, None, &[]);
        assert_eq!(d.refresh().await, Refresh::Failed);
        assert!(d.members().is_empty());
    }

    #[tokio::test]
    async fn this_daemon_is_recognised_and_left_out() {
        // By an interface address at the listening port: its DNS address becomes its
        // name, the one the others rank it by.
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["10.0.0.5:7050", "10.0.0.6:7050", "10.0.0.5:7051"]));
        let mut d = dns(&r, None, &["127.0.0.1", "10.0.0.5"]);
        d.refresh().await;
        assert_eq!(
            names(&d),
            ["10.0.0.5:7051", "10.0.0.6:7050"],
            "other port: another daemon"
        );
        assert_eq!(d.me(), Some(&PeerId("10.0.0.5:7050".into())));
        // By self_name, which then stays its name.
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["10.0.0.5:7050", "10.0.0.6:7050"]));
        let mut d = dns(&r, Some("10.0.0.6:7050"), &[]);
        d.refresh().await;
        assert_eq!(names(&d), ["10.0.0.5:7050"]);
        assert_eq!(d.me(), None);
        // IPv6, and an IPv4-mapped address spelled as IPv4.
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["[fd00::5]:7050", "[::ffff:10.0.0.9]:7050"]));
        let mut d = dns(&r, None, &["fd00::5"]);
        d.refresh().await;
        assert_eq!(names(&d), ["10.0.0.9:7050"]);
        assert_eq!(d.me(), Some(&PeerId("[fd00::5]:7050".into())));
    }

    #[tokio::test]
    async fn the_membership_is_bounded_and_every_daemon_keeps_the_same_part() {
        let all: Vec<String> = (0..5000u32)
            .map(|i| format!("10.{}.{}.{}:7050", i >> 16, (i >> 8) & 255, i & 255))
            .collect();
        let mut reversed = all.clone();
        reversed.reverse();
        let mut kept = Vec::new();
        for answer in [&all, &reversed] {
            let r = Arc::new(Scripted::default());
            r.then(Ok(answer.iter().map(String::as_str).collect()));
            let mut d = dns(&r, None, &[]);
            d.refresh().await;
            assert_eq!(d.members().len(), MAX_DNS_MEMBERS);
            kept.push(d.members().to_vec());
        }
        assert_eq!(
            kept[0], kept[1],
            "the same members whatever the answer's order"
        );
    }

    #[test]
    fn a_target_must_be_name_and_port() {
        let r: Arc<dyn Resolve> = Arc::new(Scripted::default());
        let listen: SocketAddr = "0.0.0.0:7050".parse().unwrap();
        for bad in ["no-port", ":7050", "name:port", "name:70000"] {
            assert!(
                DnsMembership::new(r.clone(), bad, None, listen, vec![]).is_err(),
                "{bad}"
            );
        }
        assert!(DnsMembership::new(r, "[fd00::1]:7050", None, listen, vec![]).is_ok());
    }

    #[tokio::test]
    async fn the_fetcher_takes_static_and_dns_members_with_itself_once() {
        use crate::p2p::P2pStats;
        use crate::p2p::fetch::{
            FetcherConfig, OriginCredentials, PeerError, PeerFetcher, PeerRequest, PeerTransport,
        };
        use ferry_registry_client::Repo;

        #[derive(Debug)]
        struct Nobody;
        #[async_trait]
        impl PeerTransport for Nobody {
            async fn fetch(&self, _: &PeerId, _: &PeerRequest<'_>) -> Result<Vec<u8>, PeerError> {
                Err(PeerError::NotHeld)
            }
        }
        #[async_trait]
        impl OriginCredentials for Nobody {
            async fn pull_authorization(&self, _: &Repo) -> Result<Option<String>, String> {
                Ok(None)
            }
        }
        let fetcher = PeerFetcher::new(
            FetcherConfig {
                self_name: "0.0.0.0:7050".into(),
                peers: vec!["static-1:7050".into()],
                roots: 1,
                fan_out: 2,
                fallbacks: 1,
                piece_size: 1 << 20,
                peer_timeout: Duration::from_millis(100),
                penalty: Duration::from_secs(60),
            },
            Arc::new(Nobody),
            Arc::new(Nobody),
            Arc::new(P2pStats::default()),
            tokio::runtime::Handle::current(),
        )
        .unwrap();
        let r = Arc::new(Scripted::default());
        r.then(Ok(vec!["10.0.0.5:7050", "10.0.0.6:7050"]))
            .then(Ok(vec!["10.0.0.5:7050"]));
        let mut d = dns(&r, None, &["10.0.0.5"]);
        let fetcher = Arc::new(fetcher);
        let sources = MemberSources::new(fetcher.clone(), &["static-1:7050".to_owned()]);
        d.refresh().await;
        apply(&sources, &d);
        let names = |f: &PeerFetcher| f.members().into_iter().map(|p| p.0).collect::<Vec<_>>();
        assert_eq!(
            names(&fetcher),
            ["10.0.0.5:7050", "10.0.0.6:7050", "static-1:7050"]
        );
        assert_eq!(fetcher.me().0, "10.0.0.5:7050", "named as DNS names it");
        assert_eq!(
            fetcher
                .members()
                .iter()
                .filter(|m| **m == fetcher.me())
                .count(),
            1,
            "itself once"
        );
        d.refresh().await;
        apply(&sources, &d);
        assert_eq!(names(&fetcher), ["10.0.0.5:7050", "static-1:7050"]);
        // Gossip members join the union, and leave it, without touching the others.
        sources.set_gossip(vec![PeerId("10.0.0.9:7050".into())]);
        assert_eq!(
            names(&fetcher),
            ["10.0.0.5:7050", "10.0.0.9:7050", "static-1:7050"]
        );
        sources.set_gossip(vec![]);
        assert_eq!(names(&fetcher), ["10.0.0.5:7050", "static-1:7050"]);
    }
}
