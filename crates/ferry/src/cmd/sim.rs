//! `ferry sim` — a fleet starting one image, simulated with ferry-p2p's scheduling
//! code. This file only maps flags onto `ferry_p2p::sim` and prints its report.

use std::time::Duration;

use anyhow::{Context, Result};
use ferry_oci::units::{parse_duration, parse_nonzero_size};
use ferry_p2p::sim::{SimConfig, SimReport, run as simulate};
use ferry_p2p::{Schedule, Topology};

use super::human;
use crate::out::outln;

/// Arguments of `ferry sim`. The defaults are DADI's published setting (USENIX ATC
/// '20: 10,000 containers on 1,000 nodes with 1 GbE-class NICs and one registry, a
/// start reading about 15 MB of an 894 MB image) with ferry's span size.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example: ferry sim --nodes 1000 --containers-per-node 10 --json \
    (add --no-p2p for the same fleet without peers). docs/p2p.md says what is modelled."
)]
pub struct Args {
    /// Nodes starting the image at once.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Containers each node starts (they share the node's fetched pieces).
    #[arg(long, default_value_t = 10)]
    pub containers_per_node: usize,
    /// Each node's NIC, Gbit/s per direction.
    #[arg(long, default_value_t = 1.0)]
    pub nic_gbps: f64,
    /// The registry's egress bandwidth, Gbit/s (one registry server on a 10 GbE link).
    #[arg(long, default_value_t = 10.0)]
    pub registry_gbps: f64,
    /// Time from a registry request to its first byte.
    #[arg(long, default_value = "10ms", value_parser = parse_duration)]
    pub registry_latency: Duration,
    /// Time from a peer request to its first byte (same data centre).
    #[arg(long, default_value = "0.5ms", value_parser = parse_duration)]
    pub peer_latency: Duration,
    /// Bytes each node reads before its containers have started: the image's
    /// working set, index included.
    #[arg(long, default_value = "15M", value_parser = parse_nonzero_size)]
    pub working_set: u64,
    /// Layer blobs the working set is spread over.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// The unit of scheduling: a node fetches each piece from one source.
    #[arg(long, default_value = "1M", value_parser = parse_nonzero_size)]
    pub piece_size: u64,
    /// The unit of verification (ferry's span), so the granularity at which a piece is
    /// forwarded while it arrives.
    #[arg(long, default_value = "256K", value_parser = parse_nonzero_size)]
    pub span_size: u64,
    /// A container's start once its data is local: runtime overhead and the process's
    /// own work (ferry's warm start minus the chroot floor was 0.16-0.46 s in
    /// docs/benchmarks.md; 0.25 s is taken).
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    pub start_cost: Duration,
    /// Containers one node starts at once (the runtime's concurrency on a small VM).
    #[arg(long, default_value_t = 4)]
    pub start_parallelism: usize,
    /// Fetch everything from the registry, no peers.
    #[arg(long)]
    pub no_p2p: bool,
    /// `piece-hrw` (each piece its own rendezvous-hash tree) or `blob-tree` (one tree
    /// per blob, DADI's shape).
    #[arg(long, default_value = "piece-hrw", value_parser = parse_topology)]
    pub topology: Topology,
    /// Nodes that fetch each piece (or blob) from the registry.
    #[arg(long, default_value_t = 2)]
    pub roots: usize,
    /// Children a node serves one piece to at most.
    #[arg(long, default_value_t = 4)]
    pub fanout: usize,
    /// Peers a node asks after its parent failed, before the registry.
    #[arg(long, default_value_t = 8)]
    pub fallbacks: usize,
    /// Fraction of nodes that die during the start (their containers are not counted).
    #[arg(long, default_value_t = 0.0)]
    pub dead_fraction: f64,
    /// Dying nodes die at a uniform time in [0, this].
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub die_within: Duration,
    /// How long a node waits on a silent parent before asking another source.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub peer_timeout: Duration,
    /// Seed of which nodes die and when.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn parse_topology(s: &str) -> Result<Topology, String> {
    Topology::parse(s).map_err(|e| e.to_string())
}

pub fn run(args: Args) -> Result<()> {
    let schedule = if args.no_p2p {
        None
    } else {
        Some(Schedule::new(args.topology, args.roots, args.fanout).context("peer schedule")?)
    };
    let gbps = |g: f64| g * 1e9 / 8.0;
    let config = SimConfig {
        nodes: args.nodes,
        containers_per_node: args.containers_per_node,
        nic_bytes_per_s: gbps(args.nic_gbps),
        registry_bytes_per_s: gbps(args.registry_gbps),
        registry_latency_s: args.registry_latency.as_secs_f64(),
        peer_latency_s: args.peer_latency.as_secs_f64(),
        piece_bytes: args.piece_size,
        span_bytes: args.span_size,
        working_set_bytes: args.working_set,
        blobs: args.layers,
        start_cost_s: args.start_cost.as_secs_f64(),
        start_parallelism: args.start_parallelism,
        schedule,
        fallback_limit: args.fallbacks,
        dead_fraction: args.dead_fraction,
        die_within_s: args.die_within.as_secs_f64(),
        peer_timeout_s: args.peer_timeout.as_secs_f64(),
        seed: args.seed,
    };
    let report = simulate(&config).context("simulating the fleet")?;
    if args.json {
        outln!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&args, &report)?;
    }
    Ok(())
}

fn print_table(args: &Args, r: &SimReport) -> Result<()> {
    let ws = r.working_set_bytes.max(1) as f64;
    outln!(
        "{} nodes × {} containers, topology {}{}",
        r.nodes,
        args.containers_per_node,
        r.topology,
        if args.no_p2p {
            String::new()
        } else {
            format!(" (roots {}, fan-out {})", args.roots, args.fanout)
        }
    );
    let rows: [(&str, String); 11] = [
        ("containers started", format!("{}", r.containers)),
        ("nodes died", format!("{}", r.nodes_died)),
        ("all started", format!("{:.3} s", r.all_started_s)),
        ("p50 started", format!("{:.3} s", r.p50_started_s)),
        ("p99 started", format!("{:.3} s", r.p99_started_s)),
        ("all data local", format!("{:.3} s", r.all_data_s)),
        ("working set", human(r.working_set_bytes)),
        (
            "registry egress",
            format!(
                "{} ({:.2}× the working set)",
                human(r.registry_egress_bytes),
                r.registry_egress_bytes as f64 / ws
            ),
        ),
        ("bytes from peers", human(r.peer_bytes)),
        ("most uploaded by a node", human(r.max_node_upload_bytes)),
        (
            "fallbacks (peer / registry)",
            format!("{} / {}", r.peer_fallbacks, r.origin_fallbacks),
        ),
    ];
    for (name, value) in rows {
        outln!("  {name:<28} {value}");
    }
    Ok(())
}
