//! A discrete-event simulation of a fleet starting one image, driven by the same
//! scheduling code a daemon would call ([`Schedule`], [`PieceTree`]).
//!
//! **The model.** N nodes start M containers each, all at time 0. Each node needs the
//! image's working set, cut into pieces of the layer blobs; the containers of a node
//! share what it fetched (one chunk store per node). A node's NIC is full duplex: an
//! uplink and a downlink of the NIC's bandwidth, each a FIFO that a transfer holds for
//! `bytes / bandwidth`. The registry is
//! one uplink of its own bandwidth, every request paying its latency first. Each link
//! is a FIFO of its own, and a transfer ends when both its ends have carried it: no
//! joint reservation, so no idle gaps a real link would not have either. With peers,
//! a node fetches a piece from its parent in the piece's tree while the parent is still
//! receiving it (in-progress forwarding): it can begin once the parent has verified the
//! first span, and cannot finish before the parent has the last span plus that span's
//! transfer. A node whose parent dies notices after the peer timeout and asks the
//! tree's fallbacks (lower ranks with a free slot), then the registry. A container is
//! started once its node holds the whole working set and a start slot has spent the
//! start cost on it (runtime overhead plus the process's own work; `start_parallelism`
//! containers of a node at once).
//!
//! **Not modelled**: TCP dynamics (slow start, loss), the registry's CPU, request
//! headers and manifests, switch and rack limits, lazy reads overlapping the start
//! (everything is fetched before the start cost, which is conservative), a piece
//! served by a node that turns out corrupt (same path as a death: a fallback after
//! verification fails), and fair sharing among concurrent transfers (a FIFO finishes
//! the first request early and the last one as late as sharing would).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::error::{Error, Result, invalid};
use crate::membership::{Membership, PeerId};
use crate::piece::PieceId;
use crate::schedule::{PieceTree, Schedule, Source, Topology};

/// What the simulated fleet and network look like.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Nodes starting the image.
    pub nodes: usize,
    /// Containers each node starts.
    pub containers_per_node: usize,
    /// Each node's NIC, per direction, in bytes per second.
    pub nic_bytes_per_s: f64,
    /// The registry's egress bandwidth, bytes per second.
    pub registry_bytes_per_s: f64,
    /// Time from a registry request to its first byte, seconds.
    pub registry_latency_s: f64,
    /// Time from a peer request to its first byte, seconds.
    pub peer_latency_s: f64,
    /// Bytes of a piece (the unit of scheduling).
    pub piece_bytes: u64,
    /// Bytes of a span (the unit of verification, so of forwarding while arriving).
    pub span_bytes: u64,
    /// Bytes each node must hold before its containers start.
    pub working_set_bytes: u64,
    /// Layer blobs the working set is spread over (round robin, piece by piece).
    pub blobs: usize,
    /// A container's start once its data is local, seconds.
    pub start_cost_s: f64,
    /// Containers of one node that start at once.
    pub start_parallelism: usize,
    /// The peer schedule; `None` fetches everything from the registry.
    pub schedule: Option<Schedule>,
    /// Fallback candidates a node asks before going to the registry.
    pub fallback_limit: usize,
    /// Fraction of nodes that die, each at a uniform time in `[0, die_within_s]`.
    pub dead_fraction: f64,
    /// See `dead_fraction`.
    pub die_within_s: f64,
    /// How long a node waits on a silent parent before asking another source.
    pub peer_timeout_s: f64,
    /// Seed of the choice of dying nodes and their times.
    pub seed: u64,
}

impl Default for SimConfig {
    /// DADI's published setting (1,000 nodes × 10 containers, 1 GbE-class NICs, one
    /// registry, ~15 MB of the image read by a start) with ferry's piece and span sizes.
    fn default() -> SimConfig {
        SimConfig {
            nodes: 1000,
            containers_per_node: 10,
            nic_bytes_per_s: 1e9 / 8.0,
            registry_bytes_per_s: 10e9 / 8.0,
            registry_latency_s: 0.010,
            peer_latency_s: 0.0005,
            piece_bytes: 1 << 20,
            span_bytes: 256 << 10,
            working_set_bytes: 15 << 20,
            blobs: 4,
            start_cost_s: 0.25,
            start_parallelism: 4,
            schedule: Some(Schedule {
                topology: Topology::PieceHrw,
                roots: 2,
                fanout: 4,
            }),
            fallback_limit: 8,
            dead_fraction: 0.0,
            die_within_s: 0.2,
            peer_timeout_s: 0.5,
            seed: 1,
        }
    }
}

impl SimConfig {
    fn check(&self) -> Result<()> {
        let positive = |name, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(invalid(name, format!("{v} (must be a positive number)")))
            }
        };
        let non_negative = |name, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(invalid(name, format!("{v} (must be 0 or more)")))
            }
        };
        for (name, v) in [
            ("nodes", self.nodes),
            ("containers-per-node", self.containers_per_node),
            ("blobs", self.blobs),
            ("start-parallelism", self.start_parallelism),
        ] {
            if v == 0 {
                return Err(invalid(name, "must be at least 1"));
            }
        }
        if self.nodes > u32::MAX as usize / 2 {
            return Err(invalid("nodes", "too many"));
        }
        for (name, v) in [
            ("piece-size", self.piece_bytes),
            ("span-size", self.span_bytes),
            ("working-set", self.working_set_bytes),
        ] {
            if v == 0 {
                return Err(invalid(name, "must be at least 1 byte"));
            }
        }
        if self.working_set_bytes.div_ceil(self.piece_bytes) > 1 << 20 {
            return Err(invalid("piece-size", "over a million pieces per node"));
        }
        // One state (about 64 bytes) per node and piece: refuse runs that would need
        // gigabytes rather than discover it by running out of memory.
        let states =
            (self.nodes as u64).saturating_mul(self.working_set_bytes.div_ceil(self.piece_bytes));
        if states > MAX_STATES {
            return Err(invalid(
                "nodes",
                format!(
                    "{states} node × piece states (at most {MAX_STATES}; use larger pieces or fewer nodes)"
                ),
            ));
        }
        positive("nic", self.nic_bytes_per_s)?;
        positive("registry bandwidth", self.registry_bytes_per_s)?;
        non_negative("registry-latency", self.registry_latency_s)?;
        non_negative("peer-latency", self.peer_latency_s)?;
        non_negative("start-cost", self.start_cost_s)?;
        non_negative("die-within", self.die_within_s)?;
        non_negative("peer-timeout", self.peer_timeout_s)?;
        if !(0.0..1.0).contains(&self.dead_fraction) {
            return Err(invalid("dead-fraction", "must be in [0, 1)"));
        }
        Ok(())
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// `piece-hrw`, `blob-tree`, or `none` (no peers).
    pub topology: &'static str,
    /// Nodes simulated.
    pub nodes: usize,
    /// Containers on nodes that stayed up (those of dead nodes are not counted).
    pub containers: usize,
    /// Nodes that died.
    pub nodes_died: usize,
    /// Seconds until the last container started.
    pub all_started_s: f64,
    /// Median container start, seconds.
    pub p50_started_s: f64,
    /// 99th percentile container start, seconds.
    pub p99_started_s: f64,
    /// Seconds until the last live node held the working set.
    pub all_data_s: f64,
    /// Bytes the registry sent.
    pub registry_egress_bytes: u64,
    /// Bytes nodes received from peers.
    pub peer_bytes: u64,
    /// Bytes each node needs (the image's working set).
    pub working_set_bytes: u64,
    /// Pieces of the working set.
    pub pieces: usize,
    /// Most registry fetches of any one piece.
    pub max_registry_fetches_per_piece: u32,
    /// Most children any node served one piece to at once.
    pub max_children_per_piece: usize,
    /// Most bytes any node uploaded to peers.
    pub max_node_upload_bytes: u64,
    /// Fetches moved to another peer after a parent died.
    pub peer_fallbacks: u64,
    /// Fetches moved to the registry after a parent died.
    pub origin_fallbacks: u64,
}

/// Runs one simulation.
pub fn run(config: &SimConfig) -> Result<SimReport> {
    config.check()?;
    Sim::new(config).run()
}

const ORIGIN: u32 = u32::MAX;

/// Node × piece states a run may hold (about 2 GB).
const MAX_STATES: u64 = 32 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Asked its source, which has not begun receiving the piece yet.
    Waiting,
    /// Its transfer is scheduled or running.
    Receiving,
    /// Its own bytes arrived; the source still misses the last of them.
    BytesIn,
    Done,
}

/// One node's state for one piece.
#[derive(Debug, Clone)]
struct Slot {
    phase: Phase,
    source: u32,
    /// Bumped at every new source, so events of an abandoned transfer are ignored.
    generation: u32,
    /// When this node began receiving the piece (bytes flowing), if it did.
    begun_at: Option<f64>,
    /// The nodes fetching this piece from this one (live or not; checked when used).
    children: Vec<u32>,
    /// How many of them are live and not yet done with another source.
    serving: u32,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Begin {
        node: u32,
        piece: u32,
        generation: u32,
    },
    BytesEnd {
        node: u32,
        piece: u32,
        generation: u32,
    },
    Death {
        node: u32,
    },
    Retry {
        node: u32,
        piece: u32,
        generation: u32,
    },
}

#[derive(Debug)]
struct Queued {
    at: f64,
    seq: u64,
    event: Event,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        // Same-time events in the order they were queued, so runs are reproducible.
        self.at.total_cmp(&other.at).then(self.seq.cmp(&other.seq))
    }
}

struct Sim<'a> {
    config: &'a SimConfig,
    pieces: Vec<u64>,
    trees: Vec<PieceTree>,
    slots: Vec<Slot>,
    queue: BinaryHeap<Reverse<Queued>>,
    seq: u64,
    up_free: Vec<f64>,
    down_free: Vec<f64>,
    registry_free: f64,
    dead: Vec<bool>,
    missing: Vec<u32>,
    data_ready: Vec<Option<f64>>,
    uploaded: Vec<u64>,
    registry_fetches: Vec<u32>,
    registry_egress: u64,
    peer_bytes: u64,
    max_serving: u32,
    peer_fallbacks: u64,
    origin_fallbacks: u64,
}

impl<'a> Sim<'a> {
    fn new(config: &'a SimConfig) -> Sim<'a> {
        let n = config.nodes;
        let count = config.working_set_bytes.div_ceil(config.piece_bytes) as usize;
        let pieces: Vec<u64> = (0..count)
            .map(|i| {
                let start = i as u64 * config.piece_bytes;
                config.piece_bytes.min(config.working_set_bytes - start)
            })
            .collect();
        let trees = match config.schedule {
            None => Vec::new(),
            Some(schedule) => {
                let members = Membership::new((0..n).map(|i| PeerId(format!("node-{i:06}"))));
                let blobs: Vec<_> = (0..config.blobs)
                    .map(|b| ferry_oci::sha256_digest(format!("ferry-sim-layer-{b}").as_bytes()))
                    .collect();
                // Membership sorts by name; the zero-padded names keep index = node.
                (0..count)
                    .map(|i| {
                        let piece = PieceId::new(
                            blobs[i % config.blobs].clone(),
                            (i / config.blobs) as u32,
                        );
                        schedule.tree(&members, &piece)
                    })
                    .collect()
            }
        };
        Sim {
            config,
            slots: vec![
                Slot {
                    phase: Phase::Waiting,
                    source: ORIGIN,
                    generation: 0,
                    begun_at: None,
                    children: Vec::new(),
                    serving: 0,
                };
                n * count
            ],
            pieces,
            trees,
            queue: BinaryHeap::new(),
            seq: 0,
            up_free: vec![0.0; n],
            down_free: vec![0.0; n],
            registry_free: 0.0,
            dead: vec![false; n],
            missing: vec![count as u32; n],
            data_ready: vec![None; n],
            uploaded: vec![0; n],
            registry_fetches: vec![0; count],
            registry_egress: 0,
            peer_bytes: 0,
            max_serving: 0,
            peer_fallbacks: 0,
            origin_fallbacks: 0,
        }
    }

    fn slot(&mut self, node: u32, piece: u32) -> &mut Slot {
        &mut self.slots[node as usize * self.pieces.len() + piece as usize]
    }

    fn push(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at,
            seq: self.seq,
            event,
        }));
    }

    fn run(mut self) -> Result<SimReport> {
        let n = self.config.nodes as u32;
        let count = self.pieces.len() as u32;
        // Piece by piece across nodes, so the registry's FIFO interleaves nodes the way
        // a server sharing its link among concurrent requests would.
        for piece in 0..count {
            for node in 0..n {
                let parent = match self.trees.get(piece as usize) {
                    None => Source::Origin,
                    Some(tree) => tree.parent(node as usize),
                };
                match parent {
                    Source::Origin => {
                        self.slot(node, piece).source = ORIGIN;
                        self.start_transfer(0.0, node, piece);
                    }
                    Source::Peer(p) => self.attach(0.0, node, piece, p as u32),
                }
            }
        }
        self.schedule_deaths();
        while let Some(Reverse(Queued { at, event, .. })) = self.queue.pop() {
            match event {
                Event::Begin {
                    node,
                    piece,
                    generation,
                } => self.on_begin(at, node, piece, generation),
                Event::BytesEnd {
                    node,
                    piece,
                    generation,
                } => self.on_bytes_end(at, node, piece, generation),
                Event::Death { node } => self.on_death(at, node),
                Event::Retry {
                    node,
                    piece,
                    generation,
                } => self.on_retry(at, node, piece, generation),
            }
        }
        self.report()
    }

    fn schedule_deaths(&mut self) {
        let n = self.config.nodes;
        let k = (self.config.dead_fraction * n as f64).round() as usize;
        if k == 0 {
            return;
        }
        let mut rng = StdRng::seed_from_u64(self.config.seed);
        for node in rand::seq::index::sample(&mut rng, n, k.min(n)) {
            let at = rng.random::<f64>() * self.config.die_within_s;
            self.push(at, Event::Death { node: node as u32 });
        }
    }

    /// Makes `parent` the source of `node`'s `piece` (asked at `now`), starting the
    /// transfer if the parent's bytes already flow.
    fn attach(&mut self, now: f64, node: u32, piece: u32, parent: u32) {
        let s = self.slot(node, piece);
        s.source = parent;
        s.phase = Phase::Waiting;
        let p = self.slot(parent, piece);
        p.children.push(node);
        p.serving += 1;
        let (serving, begun) = (p.serving, p.begun_at);
        self.max_serving = self.max_serving.max(serving);
        if begun.is_some() {
            self.start_transfer(now, node, piece);
        }
    }

    /// Schedules `node`'s transfer of `piece` from its current source, asked at `now`
    /// (or, for a parent that began earlier, as soon as that parent's first span was in).
    fn start_transfer(&mut self, now: f64, node: u32, piece: u32) {
        let bytes = self.pieces[piece as usize];
        let nic = self.config.nic_bytes_per_s;
        let source = self.slot(node, piece).source;
        // Each link is a FIFO of its own: the transfer takes its turn on the sender's
        // uplink and on the receiver's downlink and ends when both have carried it.
        let (ready, up_free, up_bytes_per_s) = if source == ORIGIN {
            self.registry_egress += bytes;
            self.registry_fetches[piece as usize] += 1;
            (
                now + self.config.registry_latency_s,
                &mut self.registry_free,
                self.config.registry_bytes_per_s,
            )
        } else {
            let parent_began = self.slot(source, piece).begun_at.unwrap_or(now);
            let first_span = self.config.span_bytes.min(bytes) as f64 / nic;
            (
                now.max(parent_began + first_span) + self.config.peer_latency_s,
                &mut self.up_free[source as usize],
                nic,
            )
        };
        let up_start = ready.max(*up_free);
        *up_free = up_start + bytes as f64 / up_bytes_per_s;
        let up_end = *up_free;
        let down_free = &mut self.down_free[node as usize];
        let down_start = ready.max(*down_free);
        *down_free = down_start + bytes as f64 / nic;
        let (begin, end) = (up_start.max(down_start), up_end.max(*down_free));
        let slot = self.slot(node, piece);
        slot.phase = Phase::Receiving;
        let generation = slot.generation;
        self.push(
            begin,
            Event::Begin {
                node,
                piece,
                generation,
            },
        );
        self.push(
            end,
            Event::BytesEnd {
                node,
                piece,
                generation,
            },
        );
    }

    fn on_begin(&mut self, now: f64, node: u32, piece: u32, generation: u32) {
        if self.dead[node as usize] {
            return;
        }
        let slot = self.slot(node, piece);
        if slot.generation != generation || slot.begun_at.is_some() {
            return;
        }
        slot.begun_at = Some(now);
        let children = slot.children.clone();
        for child in children {
            let c = self.slot(child, piece);
            if c.source == node && c.phase == Phase::Waiting && !self.dead[child as usize] {
                self.start_transfer(now, child, piece);
            }
        }
    }

    fn on_bytes_end(&mut self, now: f64, node: u32, piece: u32, generation: u32) {
        if self.dead[node as usize] {
            return;
        }
        let slot = self.slot(node, piece);
        if slot.generation != generation || slot.phase != Phase::Receiving {
            return;
        }
        let source = slot.source;
        if source == ORIGIN
            || (!self.dead[source as usize] && self.slot(source, piece).phase == Phase::Done)
        {
            self.complete(now, node, piece);
        } else {
            self.slot(node, piece).phase = Phase::BytesIn;
        }
    }

    fn complete(&mut self, now: f64, node: u32, piece: u32) {
        let bytes = self.pieces[piece as usize];
        let slot = self.slot(node, piece);
        slot.phase = Phase::Done;
        let source = slot.source;
        if source != ORIGIN {
            self.peer_bytes += bytes;
            self.uploaded[source as usize] += bytes;
            let s = self.slot(source, piece);
            s.serving = s.serving.saturating_sub(1);
        }
        let n = node as usize;
        self.missing[n] -= 1;
        if self.missing[n] == 0 {
            self.data_ready[n] = Some(now);
        }
        // Children whose own bytes were in wait for the last span to follow.
        let tail = self.config.span_bytes.min(bytes) as f64 / self.config.nic_bytes_per_s;
        let children = self.slot(node, piece).children.clone();
        for child in children {
            if self.dead[child as usize] {
                continue;
            }
            let c = self.slot(child, piece);
            if c.source == node && c.phase == Phase::BytesIn {
                c.phase = Phase::Receiving;
                let generation = c.generation;
                self.push(
                    now + tail,
                    Event::BytesEnd {
                        node: child,
                        piece,
                        generation,
                    },
                );
            }
        }
    }

    fn on_death(&mut self, now: f64, node: u32) {
        self.dead[node as usize] = true;
        for piece in 0..self.pieces.len() as u32 {
            let slot = self.slot(node, piece);
            let (source, phase) = (slot.source, slot.phase);
            let children = slot.children.clone();
            if source != ORIGIN && phase != Phase::Done {
                let s = self.slot(source, piece);
                s.serving = s.serving.saturating_sub(1);
            }
            for child in children {
                if self.dead[child as usize] {
                    continue;
                }
                let c = self.slot(child, piece);
                if c.source == node && c.phase != Phase::Done {
                    let generation = c.generation;
                    self.push(
                        now + self.config.peer_timeout_s,
                        Event::Retry {
                            node: child,
                            piece,
                            generation,
                        },
                    );
                }
            }
        }
    }

    fn on_retry(&mut self, now: f64, node: u32, piece: u32, generation: u32) {
        if self.dead[node as usize] {
            return;
        }
        let slot = self.slot(node, piece);
        if slot.generation != generation || slot.phase == Phase::Done {
            return;
        }
        slot.generation += 1;
        slot.begun_at = None;
        let fanout = self.config.schedule.map_or(0, |s| s.fanout) as u32;
        let limit = self.config.fallback_limit;
        let count = self.pieces.len();
        let chosen = self.trees.get(piece as usize).and_then(|tree| {
            tree.fallbacks(node as usize, limit)
                .map(|c| c as u32)
                .find(|&c| {
                    !self.dead[c as usize]
                        && self.slots[c as usize * count + piece as usize].serving < fanout
                })
        });
        match chosen {
            Some(c) => {
                self.peer_fallbacks += 1;
                self.attach(now, node, piece, c);
            }
            None => {
                self.origin_fallbacks += 1;
                self.slot(node, piece).source = ORIGIN;
                self.start_transfer(now, node, piece);
            }
        }
    }

    fn report(self) -> Result<SimReport> {
        let c = self.config;
        let mut starts = Vec::with_capacity(c.nodes * c.containers_per_node);
        let mut all_data: f64 = 0.0;
        let mut died = 0;
        for node in 0..c.nodes {
            if self.dead[node] {
                died += 1;
                continue;
            }
            let Some(ready) = self.data_ready[node] else {
                return Err(Error::Stalled {
                    node,
                    missing: self.missing[node] as usize,
                });
            };
            all_data = all_data.max(ready);
            for k in 0..c.containers_per_node {
                let wave = (k / c.start_parallelism + 1) as f64;
                starts.push(ready + wave * c.start_cost_s);
            }
        }
        starts.sort_by(f64::total_cmp);
        let pct = |q: f64| -> f64 {
            if starts.is_empty() {
                return 0.0;
            }
            let i = ((q * starts.len() as f64).ceil() as usize).clamp(1, starts.len()) - 1;
            starts[i]
        };
        Ok(SimReport {
            topology: c.schedule.map_or("none", |s| s.topology.name()),
            nodes: c.nodes,
            containers: starts.len(),
            nodes_died: died,
            all_started_s: starts.last().copied().unwrap_or(0.0),
            p50_started_s: pct(0.50),
            p99_started_s: pct(0.99),
            all_data_s: all_data,
            registry_egress_bytes: self.registry_egress,
            peer_bytes: self.peer_bytes,
            working_set_bytes: c.working_set_bytes,
            pieces: self.pieces.len(),
            max_registry_fetches_per_piece: self
                .registry_fetches
                .iter()
                .copied()
                .max()
                .unwrap_or(0),
            max_children_per_piece: self.max_serving as usize,
            max_node_upload_bytes: self.uploaded.iter().copied().max().unwrap_or(0),
            peer_fallbacks: self.peer_fallbacks,
            origin_fallbacks: self.origin_fallbacks,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn small(nodes: usize) -> SimConfig {
        SimConfig {
            nodes,
            containers_per_node: 3,
            working_set_bytes: 5 << 20,
            ..SimConfig::default()
        }
    }

    fn with(topology: Topology, roots: usize, fanout: usize, c: SimConfig) -> SimConfig {
        SimConfig {
            schedule: Some(Schedule::new(topology, roots, fanout).unwrap()),
            ..c
        }
    }

    #[test]
    fn without_peers_every_node_fetches_the_working_set_from_the_registry() {
        let c = SimConfig {
            schedule: None,
            ..small(50)
        };
        let r = run(&c).unwrap();
        assert_eq!(r.topology, "none");
        assert_eq!(r.containers, 150);
        assert_eq!(r.registry_egress_bytes, 50 * c.working_set_bytes);
        assert_eq!(r.peer_bytes, 0);
        assert!(r.all_started_s >= r.p99_started_s && r.p99_started_s >= r.p50_started_s);
    }

    #[test]
    fn with_peers_each_piece_leaves_the_registry_at_most_roots_times() {
        for topology in [Topology::PieceHrw, Topology::BlobTree] {
            for (roots, fanout) in [(1, 2), (2, 4), (3, 8)] {
                let c = with(topology, roots, fanout, small(200));
                let r = run(&c).unwrap();
                assert_eq!(r.containers, 600);
                assert!(r.max_registry_fetches_per_piece <= roots as u32);
                assert_eq!(r.registry_egress_bytes, roots as u64 * c.working_set_bytes);
                assert_eq!(
                    r.registry_egress_bytes + r.peer_bytes,
                    200 * c.working_set_bytes
                );
                assert!(r.max_children_per_piece <= fanout, "{r:?}");
            }
        }
    }

    #[test]
    fn the_published_setting_runs_and_peers_beat_the_registry() {
        let p2p = run(&SimConfig::default()).unwrap();
        let origin = run(&SimConfig {
            schedule: None,
            ..SimConfig::default()
        })
        .unwrap();
        assert_eq!(p2p.containers, 10_000);
        assert!(p2p.registry_egress_bytes <= 2 * p2p.working_set_bytes);
        assert!(p2p.all_started_s < origin.all_started_s);
        assert_eq!(
            origin.registry_egress_bytes,
            1000 * origin.working_set_bytes
        );
    }

    #[test]
    fn dead_peers_do_not_stop_any_start() {
        for topology in [Topology::PieceHrw, Topology::BlobTree] {
            for seed in 0..5 {
                let c = SimConfig {
                    dead_fraction: 0.25,
                    seed,
                    ..with(topology, 2, 4, small(300))
                };
                let r = run(&c).unwrap();
                assert_eq!(r.nodes_died, 75);
                assert_eq!(r.containers, 225 * 3);
                assert!(r.peer_fallbacks + r.origin_fallbacks > 0);
                assert!(r.max_children_per_piece <= 4);
                // No start waits on a dead peer longer than a timeout per tree level.
                let healthy = run(&with(topology, 2, 4, small(300))).unwrap();
                assert!(r.all_started_s <= healthy.all_started_s + 6.0 * c.peer_timeout_s);
            }
        }
    }

    #[test]
    fn bad_parameters_are_refused() {
        for c in [
            SimConfig {
                nodes: 0,
                ..small(1)
            },
            SimConfig {
                piece_bytes: 0,
                ..small(1)
            },
            SimConfig {
                nic_bytes_per_s: 0.0,
                ..small(1)
            },
            SimConfig {
                dead_fraction: 1.0,
                ..small(1)
            },
            SimConfig {
                registry_latency_s: f64::NAN,
                ..small(1)
            },
            // 1,000,000 nodes × 1,280 pieces: over the state bound.
            SimConfig {
                nodes: 1_000_000,
                piece_bytes: 4096,
                ..small(1)
            },
        ] {
            assert!(matches!(run(&c), Err(Error::Invalid { .. })));
        }
    }

    #[test]
    fn no_run_beats_the_links() {
        // Every node must pull the working set through its own downlink, and without
        // peers the registry's uplink must carry it once per node.
        for nodes in [1, 16, 300] {
            for schedule in [None, SimConfig::default().schedule] {
                let c = SimConfig {
                    schedule,
                    ..small(nodes)
                };
                let r = run(&c).unwrap();
                let ws = c.working_set_bytes as f64;
                assert!(r.all_data_s >= ws / c.nic_bytes_per_s);
                if schedule.is_none() {
                    assert!(r.all_data_s >= nodes as f64 * ws / c.registry_bytes_per_s);
                }
                let waves = c.containers_per_node.div_ceil(c.start_parallelism) as f64;
                let expected = r.all_data_s + waves * c.start_cost_s;
                assert!((r.all_started_s - expected).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn forwarding_while_arriving_is_never_slower_than_store_and_forward() {
        for topology in [Topology::PieceHrw, Topology::BlobTree] {
            let base = with(topology, 2, 4, small(500));
            let whole = SimConfig {
                piece_bytes: 4 << 20,
                span_bytes: 4 << 20,
                ..base.clone()
            };
            let by_span = SimConfig {
                span_bytes: 256 << 10,
                ..whole.clone()
            };
            let (a, b) = (run(&whole).unwrap(), run(&by_span).unwrap());
            assert!(b.all_data_s < a.all_data_s, "{topology:?}: {b:?} vs {a:?}");
        }
    }

    #[test]
    fn same_seed_same_figures() {
        let c = SimConfig {
            dead_fraction: 0.1,
            ..small(100)
        };
        let (a, b) = (run(&c).unwrap(), run(&c).unwrap());
        assert_eq!(a.all_started_s, b.all_started_s);
        assert_eq!(a.registry_egress_bytes, b.registry_egress_bytes);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn small_random_fleets_always_finish(
            nodes in 1usize..60,
            containers in 1usize..4,
            roots in 1usize..4,
            fanout in 1usize..6,
            pieces in 1u64..12,
            piece_kib in 16u64..1024,
            blob_tree in any::<bool>(),
            dead in 0.0f64..0.5,
            seed in any::<u64>(),
        ) {
            let topology = if blob_tree { Topology::BlobTree } else { Topology::PieceHrw };
            let c = SimConfig {
                nodes,
                containers_per_node: containers,
                piece_bytes: piece_kib << 10,
                working_set_bytes: pieces * (piece_kib << 10) - 1,
                blobs: 3,
                dead_fraction: dead,
                seed,
                ..with(topology, roots, fanout, SimConfig::default())
            };
            let r = run(&c).unwrap();
            prop_assert_eq!(r.containers, (nodes - r.nodes_died) * containers);
            prop_assert!(r.max_children_per_piece <= fanout);
            if r.nodes_died == 0 {
                prop_assert!(r.max_registry_fetches_per_piece as usize <= roots);
                prop_assert_eq!(r.origin_fallbacks, 0);
            }
            prop_assert!(r.all_started_s.is_finite());
        }
    }
}
