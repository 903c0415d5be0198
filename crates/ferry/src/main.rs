//! # ferry — the one binary
//!
//! Wires the crates together and owns what a user touches: the command line, logging,
//! progress bars and error messages that say what to do next. Library crates return typed
//! errors; this binary adds context with `anyhow`. It must not hold format or protocol
//! logic of its own: that belongs in the crates.

mod cmd;
mod out;
mod progress;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// ferry: start containers before their image is downloaded.
///
/// Images are named as skopeo names them: `oci:DIR[:TAG]` for an OCI image layout on
/// disk, `HOST[:PORT]/REPO[:TAG|@DIGEST]` for a registry.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info`, `ferry=debug`.
    #[arg(long, global = true, env = "FERRY_LOG", default_value = "warn")]
    log: String,
    /// Emit logs as JSON lines.
    #[arg(long, global = true)]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Index every gzip (and plain tar) layer of an image so it can be read lazily;
    /// stores the indexes beside the image as an OCI artifact referring to it.
    Index(cmd::index::Args),
    /// Write one file of an image's merged root filesystem to stdout, reading only what
    /// the index says it needs.
    Cat(cmd::cat::Args),
    /// Convert an image's layers to another format (eStargz or zstd:chunked).
    Convert(cmd::convert::Args),
    /// Pack a directory into a single-layer image that is lazy-loadable from birth.
    Pack(cmd::pack::Args),
    /// Show an image's layers, their formats, index presence and file counts.
    Inspect(cmd::inspect::Args),
    /// The main job end to end on an embedded default: pack a directory of this machine
    /// into an image, index it, read files from it lazily and report the bytes read.
    Demo(cmd::demo::Args),
    /// Copy an image, with its ferry index artifacts, between registries and OCI layouts.
    Copy(cmd::copy::Args),
    /// Run or maintain an OCI registry (and pull-through cache).
    Registry(cmd::registry::Args),
    /// Mount an image's root filesystem (or one layer) lazily over FUSE.
    Mount(cmd::mount::Args),
    /// Unmount a ferry mount.
    Umount(cmd::mount::UmountArgs),
    /// Inspect and maintain the node's chunk store; export it to a directory, import one.
    Store(cmd::store::Args),
    /// Fill the node's store with images' hot sets (startup trace, else eStargz
    /// prioritized files) or, with --full, all of them; through the daemon if one runs.
    Prewarm(cmd::prewarm::Args),
    /// Serve containerd's Snapshots API (a proxy snapshotter plugin) on a unix socket.
    Snapshotter(cmd::snapshotter::Args),
    /// Run the node daemon: the chunk store, every lazy mount, the containerd
    /// snapshotter, a control socket for `ferry mount`/`ferry status`, and metrics.
    Daemon(cmd::daemon::Args),
    /// Show what the node daemon serves: per mounted layer, bytes fetched of the total,
    /// cache hits, fetch errors, and whether prefetch and background fill are done.
    Status(cmd::status::Args),
    /// Put an image into containerd with its layers prepared through ferry (lazily when
    /// indexed, eStargz or zstd:chunked, else a parallel download-and-unpack); like
    /// `ctr-remote image rpull`.
    Pull(cmd::pull::Args),
    /// Record which files a workload reads at startup, and publish the trace so every
    /// node prefetches exactly that.
    Trace(cmd::trace::Args),
    /// Measurements driven by the scripts under bench/.
    Bench(cmd::bench::Args),
    /// Simulate a fleet starting one image, with ferry's peer scheduling or without:
    /// time until every container started (p50/p99/max) and registry egress.
    Sim(cmd::sim::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log, cli.log_json);
    let result = match cli.command {
        Command::Index(a) => cmd::index::run(a),
        Command::Cat(a) => cmd::cat::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Pack(a) => cmd::pack::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Registry(a) => cmd::registry::run(a),
        Command::Mount(a) => cmd::mount::run(a),
        Command::Umount(a) => cmd::mount::run_umount(a),
        Command::Store(a) => cmd::store::run(a),
        Command::Prewarm(a) => cmd::prewarm::run(a),
        Command::Snapshotter(a) => cmd::snapshotter::run(a),
        Command::Daemon(a) => cmd::daemon::run(a),
        Command::Status(a) => cmd::status::run(a),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Sim(a) => cmd::sim::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // `ferry … | head`: the reader has what it wanted.
        Err(e) if out::is_stdout_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
