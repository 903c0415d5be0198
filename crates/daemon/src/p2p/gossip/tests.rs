//! The gossip on an in-memory network with a manual clock: no sockets, no sleeps;
//! time moves only when the test says.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::*;

const EPOCH_MS: u64 = 1_800_000_000_000;
const STEP: Duration = Duration::from_millis(10);

fn gossip_addr(i: usize) -> SocketAddr {
    format!("10.1.{}.{}:7946", i / 200, 10 + i % 200)
        .parse()
        .unwrap()
}

fn peer_name(i: usize) -> String {
    format!("10.1.{}.{}:7050", i / 200, 10 + i % 200)
}

fn config(i: usize) -> GossipConfig {
    GossipConfig {
        me: GossipId {
            peer: peer_name(i),
            gossip: gossip_addr(i),
            generation: 1,
        },
        probe_period: Duration::from_secs(1),
        probe_rtt: Duration::from_millis(333),
        suspect_after: Duration::from_secs(5),
        gossip_interval: Duration::from_millis(200),
        max_members: DEFAULT_MAX_MEMBERS,
        max_skew: Duration::from_secs(30),
    }
}

fn key() -> GossipKey {
    GossipKey::from_secret(b"the-cluster-token-0123456789")
}

/// N nodes on a network that delivers every datagram at once, to live nodes only.
struct Sim {
    clock: Arc<ManualClock>,
    nodes: Vec<Option<GossipNode>>,
    stats: Vec<Arc<P2pStats>>,
    at: HashMap<SocketAddr, usize>,
    /// Datagrams sent to an address no live node has.
    lost: u64,
}

impl Sim {
    fn new(n: usize) -> Sim {
        Sim::with(n, config)
    }

    fn with(n: usize, cfg: impl Fn(usize) -> GossipConfig) -> Sim {
        let clock = Arc::new(ManualClock::new(EPOCH_MS));
        let mut sim = Sim {
            clock: clock.clone(),
            nodes: Vec::new(),
            stats: Vec::new(),
            at: HashMap::new(),
            lost: 0,
        };
        for i in 0..n {
            let stats = Arc::new(P2pStats::default());
            let c = cfg(i);
            sim.at.insert(c.me.gossip, i);
            sim.nodes.push(Some(GossipNode::new(
                c,
                key(),
                clock.clone(),
                i as u64 + 1,
                stats.clone(),
            )));
            sim.stats.push(stats);
        }
        sim
    }

    fn node(&mut self, i: usize) -> &mut GossipNode {
        self.nodes[i].as_mut().unwrap()
    }

    /// Delivers every datagram in flight, and the answers, until none is left.
    fn deliver(&mut self) {
        loop {
            let mut flying = Vec::new();
            for n in self.nodes.iter_mut().flatten() {
                flying.extend(n.take_outbox());
            }
            if flying.is_empty() {
                return;
            }
            for (to, bytes) in flying {
                match self.at.get(&to).and_then(|i| self.nodes[*i].as_mut()) {
                    Some(n) => {
                        let _ = n.handle_datagram(&bytes);
                    }
                    None => self.lost += 1,
                }
            }
        }
    }

    fn step(&mut self) {
        self.clock.advance(STEP);
        for n in self.nodes.iter_mut().flatten() {
            n.handle_due_timers();
        }
        self.deliver();
    }

    /// Steps until `done` holds; the virtual time it took, or `None` past `limit`.
    fn until(&mut self, limit: Duration, done: impl Fn(&Sim) -> bool) -> Option<Duration> {
        let start = self.clock.now();
        while !done(self) {
            if self.clock.now() - start > limit {
                return None;
            }
            self.step();
        }
        Some(self.clock.now() - start)
    }

    fn members(&self, i: usize) -> Vec<String> {
        self.nodes[i]
            .as_ref()
            .unwrap()
            .members()
            .into_iter()
            .map(|p| p.0)
            .collect()
    }

    /// Every live node lists every other live node, and no one else.
    fn converged(&self) -> bool {
        let live: Vec<usize> = (0..self.nodes.len())
            .filter(|i| self.nodes[*i].is_some())
            .collect();
        live.iter().all(|&i| {
            let mut want: Vec<String> = live
                .iter()
                .filter(|&&j| j != i)
                .map(|&j| peer_name(j))
                .collect();
            want.sort();
            self.members(i) == want
        })
    }

    /// Node i joins through node `seed` only.
    fn join_through(&mut self, i: usize, seed: usize) {
        let to = gossip_addr(seed);
        self.node(i).announce(to);
        self.deliver();
    }

    fn bytes_out(&self) -> u64 {
        self.stats
            .iter()
            .map(|s| s.gossip.bytes_out.load(Ordering::Relaxed))
            .sum()
    }
}

/// Node i is given one seed: the node before it (a chain, the worst case for a
/// single seed each), node 0 the last one.
fn start_chain(sim: &mut Sim) {
    let n = sim.nodes.len();
    for i in 0..n {
        sim.join_through(i, (i + n - 1) % n);
    }
}

#[test]
fn nodes_given_one_seed_each_converge_to_the_full_membership() {
    let mut sim = Sim::new(8);
    assert!(sim.members(0).is_empty(), "no one before a join");
    start_chain(&mut sim);
    let took = sim.until(Duration::from_secs(60), Sim::converged);
    assert!(took.is_some(), "8 nodes did not converge in 60 s of gossip");
    // Once converged it stays so.
    for _ in 0..500 {
        sim.step();
    }
    assert!(sim.converged());
    let dropped: u64 = sim
        .stats
        .iter()
        .map(|s| {
            s.gossip.dropped_unauthenticated.load(Ordering::Relaxed)
                + s.gossip.dropped_malformed.load(Ordering::Relaxed)
                + s.gossip.dropped_replayed.load(Ordering::Relaxed)
        })
        .sum();
    assert_eq!(dropped, 0, "honest traffic is never dropped");
}

#[test]
fn a_dead_node_is_removed_after_the_suspicion_period_and_not_before() {
    let mut sim = Sim::new(6);
    start_chain(&mut sim);
    sim.until(Duration::from_secs(60), Sim::converged).unwrap();
    let dead = 3;
    sim.nodes[dead] = None;
    let gone = |s: &Sim| {
        (0..s.nodes.len())
            .filter(|i| s.nodes[*i].is_some())
            .all(|i| !s.members(i).contains(&peer_name(dead)))
    };
    let suspect_after = config(0).suspect_after;
    // Every survivor still lists it for the suspicion period at least: a member is
    // suspected first, and has that long to answer.
    let early = sim.until(suspect_after, |s| {
        (0..s.nodes.len())
            .filter(|i| s.nodes[*i].is_some())
            .any(|i| !s.members(i).contains(&peer_name(dead)))
    });
    assert_eq!(early, None, "removed before the suspicion period ended");
    // Then it goes: a probe period or two to be suspected, the suspicion, and the
    // news spreading.
    let took = sim.until(Duration::from_secs(30), gone);
    assert!(took.is_some(), "the dead node was never removed");
    assert!(sim.converged(), "the survivors agree");
    assert!(sim.lost > 0, "datagrams went to the dead node");
}

#[test]
fn a_restarted_node_comes_back_under_a_new_generation() {
    let mut sim = Sim::new(4);
    start_chain(&mut sim);
    sim.until(Duration::from_secs(60), Sim::converged).unwrap();
    sim.nodes[2] = None;
    sim.until(Duration::from_secs(60), |s| {
        !s.members(0).contains(&peer_name(2))
    })
    .unwrap();
    let mut c = config(2);
    c.me.generation = 2;
    let stats = Arc::new(P2pStats::default());
    sim.nodes[2] = Some(GossipNode::new(c, key(), sim.clock.clone(), 99, stats));
    sim.join_through(2, 0);
    assert!(
        sim.until(Duration::from_secs(60), Sim::converged).is_some(),
        "the restarted node was not admitted again"
    );
}

#[test]
fn forged_oversized_stale_replayed_and_malformed_datagrams_are_dropped() {
    let mut sim = Sim::new(2);
    sim.join_through(1, 0);
    sim.until(Duration::from_secs(10), Sim::converged).unwrap();
    let now = sim.clock.unix_ms();

    // A stranger without the token: its announcement, and a copy of a real payload
    // under its own key, are refused; it never becomes a member.
    let mut stranger = GossipNode::new(
        config(7),
        GossipKey::from_secret(b"another-token-0123456789"),
        sim.clock.clone(),
        7,
        Arc::new(P2pStats::default()),
    );
    stranger.announce(gossip_addr(0));
    let (to, forged) = stranger.take_outbox().pop().unwrap();
    assert_eq!(to, gossip_addr(0));
    assert_eq!(
        sim.node(0).handle_datagram(&forged),
        Err(Dropped::Unauthenticated)
    );
    // A real datagram with one bit flipped: the tag no longer matches.
    sim.node(1).announce(gossip_addr(0));
    let (_, mut real) = sim.node(1).take_outbox().pop().unwrap();
    let last = real.len() - 40;
    real[last] ^= 1;
    assert_eq!(
        sim.node(0).handle_datagram(&real),
        Err(Dropped::Unauthenticated)
    );
    // Garbage, empty, and a truncated datagram.
    for junk in [
        &b""[..],
        &b"FYG1"[..],
        &[0u8; 100][..],
        &forged[..forged.len() - 1],
    ] {
        assert_eq!(
            sim.node(0).handle_datagram(junk),
            Err(Dropped::Unauthenticated)
        );
    }
    // Too large: dropped before the tag is even computed.
    let big = vec![0u8; MAX_DATAGRAM + 1];
    assert_eq!(sim.node(0).handle_datagram(&big), Err(Dropped::Oversized));
    // Authenticated but garbage inside.
    let junk = wire::seal(&key(), now, 1, b"\x05hello");
    assert_eq!(sim.node(0).handle_datagram(&junk), Err(Dropped::Malformed));
    // Authenticated, well formed, but stamped a minute ago or ahead.
    sim.node(1).announce(gossip_addr(0));
    let (_, fresh) = sim.node(1).take_outbox().pop().unwrap();
    let payload = wire::open(&key(), &fresh).unwrap().payload.to_vec();
    for at in [now - 60_000, now + 60_000] {
        let stale = wire::seal(&key(), at, 2, &payload);
        assert_eq!(sim.node(0).handle_datagram(&stale), Err(Dropped::Stale));
    }
    // The fresh one is taken once; the same bytes again are a replay.
    assert_eq!(sim.node(0).handle_datagram(&fresh), Ok(()));
    assert_eq!(sim.node(0).handle_datagram(&fresh), Err(Dropped::Replayed));

    let g = &sim.stats[0].gossip;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    assert_eq!(get(&g.dropped_unauthenticated), 6);
    assert_eq!(get(&g.dropped_oversized), 1);
    assert_eq!(get(&g.dropped_malformed), 1);
    assert_eq!(get(&g.dropped_stale), 2);
    assert_eq!(get(&g.dropped_replayed), 1);
    sim.deliver();
    for _ in 0..300 {
        sim.step();
    }
    assert_eq!(sim.members(0), [peer_name(1)], "the stranger never got in");
}

#[test]
fn the_membership_is_capped() {
    // Node 0 takes at most 3 members; 6 others try to join through it.
    let mut sim = Sim::with(7, |i| {
        let mut c = config(i);
        if i == 0 {
            c.max_members = 3;
        }
        c
    });
    for i in 1..7 {
        sim.join_through(i, 0);
    }
    for _ in 0..1000 {
        sim.step();
    }
    assert!(sim.members(0).len() <= 3, "{:?}", sim.members(0));
    assert!(
        sim.stats[0]
            .gossip
            .dropped_member_cap
            .load(Ordering::Relaxed)
            > 0
    );
}

#[test]
fn the_wire_format_round_trips_and_refuses_what_it_cannot_be() {
    use foca::{Header, Member, Message, State};
    let id = |i: usize| GossipId {
        peer: peer_name(i),
        gossip: gossip_addr(i),
        generation: i as u64,
    };
    let v6 = GossipId {
        peer: "[fd00::1]:7050".into(),
        gossip: "[fd00::1]:7946".parse().unwrap(),
        generation: u64::MAX,
    };
    let p = wire::Payload {
        header: Header {
            src: id(1),
            src_incarnation: 7,
            dst: v6.clone(),
            message: Message::PingReq {
                target: id(3),
                probe_number: 9,
            },
        },
        updates: vec![
            Member::new(id(4), 1, State::Alive),
            Member::new(v6, 2, State::Suspect),
            Member::new(id(5), 3, State::Down),
        ],
    };
    let bytes = wire::encode_payload(&p).unwrap();
    assert_eq!(wire::decode_payload(&bytes).unwrap(), p);
    // Every prefix is refused, never a panic, but the one that is the header alone.
    let header_only = wire::encode_payload(&wire::Payload {
        header: p.header.clone(),
        updates: vec![],
    })
    .unwrap();
    for cut in 0..bytes.len() {
        let r = wire::decode_payload(&bytes[..cut]);
        assert_eq!(r.is_ok(), cut == header_only.len(), "cut at {cut}");
    }
    // A count claiming 65,535 members in a few bytes allocates nothing for them.
    let mut lying = wire::encode_payload(&wire::Payload {
        header: p.header.clone(),
        updates: vec![],
    })
    .unwrap();
    lying.extend_from_slice(&[0xff, 0xff]);
    assert!(wire::decode_payload(&lying).is_err());
    // Names that would be more than a host in a URL are refused.
    for bad in ["evil.example/x:1", "a@b:1", "no-port", "a b:1", ""] {
        assert!(!wire::valid_peer_name(bad), "{bad}");
    }
    let mut evil = p.clone();
    evil.updates[0] = Member::new(
        GossipId {
            peer: "x@evil:1".into(),
            gossip: gossip_addr(9),
            generation: 0,
        },
        0,
        State::Alive,
    );
    let bytes = wire::encode_payload(&evil).unwrap();
    assert!(wire::decode_payload(&bytes).is_err());
}

/// The figures in docs/p2p.md: convergence after a start (one seed each, a chain),
/// after a death, and the bytes each node sends per second once converged. Virtual
/// time, so the figures are the protocol's, not this machine's.
#[test]
#[ignore = "measurement: cargo test -p ferry-daemon --release gossip::tests::measure -- --ignored --nocapture"]
fn measure() {
    for n in [4usize, 16, 64, 256] {
        let mut sim = Sim::new(n);
        start_chain(&mut sim);
        let start = sim.until(Duration::from_secs(600), Sim::converged).unwrap();
        // Steady state: 60 s of gossip.
        let before = sim.bytes_out();
        let t0 = sim.clock.now();
        for _ in 0..6000 {
            sim.step();
        }
        let secs = (sim.clock.now() - t0).as_secs_f64();
        let per_node = (sim.bytes_out() - before) as f64 / secs / n as f64;
        sim.nodes[n / 2] = None;
        let death = sim.until(Duration::from_secs(600), Sim::converged).unwrap();
        println!(
            "n={n} start={:.2}s death={:.2}s bytes/node/s={per_node:.0}",
            start.as_secs_f64(),
            death.as_secs_f64()
        );
    }
}

mod driven {
    //! [`run`] itself, on an in-memory socket, with a manual clock: the test moves it
    //! 10 ms at a time and lets every task run until it waits again.
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use ferry_p2p::PeerId;
    use ferry_registry_client::Repo;
    use parking_lot::Mutex;
    use tokio::sync::{mpsc, oneshot};

    use super::{EPOCH_MS, config, gossip_addr, key, peer_name};
    use crate::p2p::P2pStats;
    use crate::p2p::dns::Resolve;
    use crate::p2p::fetch::{
        FetcherConfig, OriginCredentials, PeerError, PeerFetcher, PeerRequest, PeerTransport,
    };
    use crate::p2p::gossip::{
        Clock, DatagramSocket, Driver, GossipNode, ManualClock, MemberSources, run,
    };

    #[derive(Debug, Default)]
    struct MemNet {
        boxes: Mutex<HashMap<SocketAddr, mpsc::UnboundedSender<Vec<u8>>>>,
    }

    #[derive(Debug)]
    struct MemSocket {
        at: SocketAddr,
        net: Arc<MemNet>,
        rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Vec<u8>>>,
    }

    impl MemNet {
        fn socket(self: &Arc<Self>, at: SocketAddr) -> MemSocket {
            let (tx, rx) = mpsc::unbounded_channel();
            self.boxes.lock().insert(at, tx);
            MemSocket {
                at,
                net: self.clone(),
                rx: tokio::sync::Mutex::new(rx),
            }
        }
        fn unplug(&self, at: &SocketAddr) {
            self.boxes.lock().remove(at);
        }
    }

    #[async_trait]
    impl DatagramSocket for MemSocket {
        async fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.rx.lock().await.recv().await {
                Some(d) => {
                    let n = d.len().min(buf.len());
                    buf[..n].copy_from_slice(&d[..n]);
                    Ok(n)
                }
                None => std::future::pending().await,
            }
        }
        async fn send(&self, to: SocketAddr, bytes: &[u8]) -> std::io::Result<()> {
            let boxes = self.net.boxes.lock();
            // Unplugged: nothing goes out either.
            if !boxes.contains_key(&self.at) {
                return Ok(());
            }
            if let Some(tx) = boxes.get(&to) {
                let _ = tx.send(bytes.to_vec());
            }
            Ok(())
        }
    }

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
    #[async_trait]
    impl Resolve for Nobody {
        async fn resolve(&self, _: &str, _: u16) -> std::io::Result<Vec<SocketAddr>> {
            Err(std::io::Error::other("no names here"))
        }
    }

    fn fetcher(i: usize, statics: &[String]) -> Arc<PeerFetcher> {
        Arc::new(
            PeerFetcher::new(
                FetcherConfig {
                    self_name: peer_name(i),
                    peers: statics.to_vec(),
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
            .unwrap(),
        )
    }

    fn names(f: &PeerFetcher) -> Vec<String> {
        f.members().into_iter().map(|p| p.0).collect()
    }

    /// 10 ms more, and every task run until it waits again (one thread: the tasks run
    /// in turn while this one yields).
    async fn step(clock: &ManualClock) {
        clock.advance(Duration::from_millis(10));
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_scheduling_membership_follows_the_gossip_live() {
        let net = Arc::new(MemNet::default());
        let manual = Arc::new(ManualClock::new(EPOCH_MS));
        let clock: Arc<dyn Clock> = manual.clone();
        let n = 4;
        let statics = vec!["static-1:7050".to_owned()];
        let mut fetchers = Vec::new();
        let mut stops = Vec::new();
        let mut tasks = Vec::new();
        for i in 0..n {
            let f = fetcher(i, &statics);
            let node = GossipNode::new(
                config(i),
                key(),
                clock.clone(),
                i as u64 + 1,
                f.stats().clone(),
            );
            let driver = Driver {
                socket: Arc::new(net.socket(gossip_addr(i))),
                // One seed each, the previous node's address (as text, as configured).
                seeds: vec![gossip_addr((i + n - 1) % n).to_string()],
                resolver: Arc::new(Nobody),
                clock: clock.clone(),
                sources: Arc::new(MemberSources::new(f.clone(), &statics)),
                announce_every: Duration::from_secs(2),
            };
            let (tx, rx) = oneshot::channel::<()>();
            tasks.push(tokio::spawn(run(node, driver, async {
                let _ = rx.await;
            })));
            stops.push(Some(tx));
            fetchers.push(f);
        }
        let all = |live: &[usize]| {
            let mut w: Vec<String> = live.iter().map(|&i| peer_name(i)).collect();
            w.push("static-1:7050".into());
            w.sort();
            w
        };
        let wait_for = |live: Vec<usize>, fetchers: Vec<Arc<PeerFetcher>>| {
            let manual = manual.clone();
            async move {
                // At most 60 s of the manual clock.
                for _ in 0..6000 {
                    if live.iter().all(|&i| names(&fetchers[i]) == all(&live)) {
                        return true;
                    }
                    step(&manual).await;
                }
                false
            }
        };
        assert!(
            wait_for(vec![0, 1, 2, 3], fetchers.clone()).await,
            "the fetchers did not all get the 4 members and the static one: {:?}",
            fetchers.iter().map(|f| names(f)).collect::<Vec<_>>()
        );
        assert_eq!(
            fetchers[0]
                .stats()
                .gossip
                .members
                .load(std::sync::atomic::Ordering::Relaxed),
            3
        );
        // A clean stop: node 3 says it leaves.
        stops[3].take().unwrap().send(()).unwrap();
        step(&manual).await;
        assert!(
            tasks.pop().unwrap().is_finished(),
            "run returns once stopped"
        );
        net.unplug(&gossip_addr(3));
        assert!(
            wait_for(vec![0, 1, 2], fetchers.clone()).await,
            "node 3 left but is still listed: {:?}",
            fetchers.iter().map(|f| names(f)).collect::<Vec<_>>()
        );
        // A crash: node 2's socket goes away without a word; the suspicion removes it.
        net.unplug(&gossip_addr(2));
        assert!(
            wait_for(vec![0, 1], fetchers.clone()).await,
            "node 2 died but is still listed: {:?}",
            fetchers.iter().map(|f| names(f)).collect::<Vec<_>>()
        );
        for s in stops.into_iter().flatten() {
            let _ = s.send(());
        }
    }

    #[tokio::test]
    async fn groups_that_formed_apart_join_up_through_a_seed() {
        // Nodes 2 and 3 start first; node 3's seeds are node 2 and node 0, which is not
        // up yet. Then 0 and 1 start, each other's only seed. Two groups, {2, 3} and
        // {0, 1}: only node 3 asking its seed 0 again (once in) joins them up.
        let net = Arc::new(MemNet::default());
        let manual = Arc::new(ManualClock::new(EPOCH_MS));
        let clock: Arc<dyn Clock> = manual.clone();
        let seeds: [Vec<usize>; 4] = [vec![1], vec![0], vec![3], vec![2, 0]];
        let mut fetchers = Vec::new();
        let mut stops = Vec::new();
        let spawn = |i: usize| {
            let f = fetcher(i, &[]);
            let node = GossipNode::new(
                config(i),
                key(),
                clock.clone(),
                i as u64 + 1,
                f.stats().clone(),
            );
            let driver = Driver {
                socket: Arc::new(net.socket(gossip_addr(i))),
                seeds: seeds[i]
                    .iter()
                    .map(|&j| gossip_addr(j).to_string())
                    .collect(),
                resolver: Arc::new(Nobody),
                clock: clock.clone(),
                sources: Arc::new(MemberSources::new(f.clone(), &[])),
                announce_every: Duration::from_secs(2),
            };
            let (tx, rx) = oneshot::channel::<()>();
            tokio::spawn(run(node, driver, async {
                let _ = rx.await;
            }));
            (f, tx)
        };
        let listed = |f: &PeerFetcher, want: &[usize]| {
            let mut w: Vec<String> = want.iter().map(|&i| peer_name(i)).collect();
            w.sort();
            names(f) == w
        };
        for i in [2, 3] {
            let (f, tx) = spawn(i);
            fetchers.push((i, f));
            stops.push(tx);
        }
        for _ in 0..300 {
            step(&manual).await;
        }
        for i in [0, 1] {
            let (f, tx) = spawn(i);
            fetchers.push((i, f));
            stops.push(tx);
        }
        for _ in 0..300 {
            step(&manual).await;
        }
        assert!(
            fetchers.iter().any(|(i, f)| *i == 0 && listed(f, &[0, 1])),
            "the two groups formed apart first"
        );
        let mut merged = false;
        for _ in 0..6000 {
            if fetchers.iter().all(|(_, f)| listed(f, &[0, 1, 2, 3])) {
                merged = true;
                break;
            }
            step(&manual).await;
        }
        assert!(
            merged,
            "the groups never joined: {:?}",
            fetchers.iter().map(|(_, f)| names(f)).collect::<Vec<_>>()
        );
        for s in stops {
            let _ = s.send(());
        }
    }
}
