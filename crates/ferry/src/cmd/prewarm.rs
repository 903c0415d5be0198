//! `ferry prewarm [--full] IMAGE...`: fill the node's chunk store (and file cache) with
//! images' hot sets — their startup trace, else their eStargz prioritized files — or,
//! with `--full`, all of them, before any container asks.
//!
//! Through the node daemon when one answers on the control socket (its store, single
//! flight and file cache do the work; progress comes back over the socket, and killing
//! this command stops it), else in this process against the store the daemon would use
//! (same config file and paths). Either way every verified span is kept as soon as it
//! lands, so a rerun fetches only what is missing and a second run fetches nothing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ferry_daemon::{ControlClient, MountManager, PrewarmEvent, PrewarmOutcome, PrewarmRequest};
use ferry_fs::warm::prewarm::PrewarmProgress;
use ferry_store::{Store, StoreOptions};
use indicatif::ProgressBar;

use super::human;
use crate::out::outln;

/// Arguments of `ferry prewarm`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Images: `oci:DIR[:TAG]` or `HOST[:PORT]/REPO[:TAG|@DIGEST]`.
    #[arg(required = true)]
    images: Vec<String>,
    /// Every layer whole, not only the hot set.
    #[arg(long)]
    full: bool,
    /// The daemon's control socket (default: the config's, else the per-user default).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Daemon config file: its control socket, and without a daemon its store, file
    /// cache, [fetch] and [registry] settings.
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Without a daemon: this store directory instead of the config's.
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Never go through a daemon (fail if one holds the store).
    #[arg(long)]
    no_daemon: bool,
    /// Print the outcome as JSON lines (one per image) on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `ferry prewarm`.
pub fn run(args: Args) -> Result<()> {
    let mut config = super::daemon::load_config(args.config.as_deref())?;
    if let Some(s) = &args.socket {
        config.control.socket = Some(s.clone());
    }
    if args.store.is_some() {
        config.store_path_flag = args.store.clone();
    }
    let socket = config.control_socket();
    let started = Instant::now();
    let runtime = super::current_thread_runtime()?;
    let daemon = !args.no_daemon
        && runtime
            .block_on(ControlClient::new(&socket).health())
            .is_ok();
    let mut outcomes = Vec::new();
    if daemon {
        if args.store.is_some() {
            eprintln!(
                "ferry: warning: --store ignored: the daemon on {} prewarms into its own store",
                socket.display()
            );
        }
        let client = ControlClient::new(&socket);
        for image in &args.images {
            let bar = Bar::new(image);
            let request = PrewarmRequest {
                image: image.clone(),
                full: args.full,
            };
            let outcome = runtime
                .block_on(client.prewarm(&request, |e| match e {
                    PrewarmEvent::Planned {
                        planned_bytes,
                        present_bytes,
                    } => bar.planned(*planned_bytes, *present_bytes),
                    PrewarmEvent::Fetched { bytes } => bar.fetched(*bytes),
                    _ => {}
                }))
                .with_context(|| {
                    format!(
                        "prewarming {image} through the daemon on {}",
                        socket.display()
                    )
                })?;
            bar.finish();
            outcomes.push(outcome);
        }
    } else {
        drop(runtime);
        let store_path = config.store_path();
        let store = Store::open_with(
            &store_path,
            StoreOptions {
                max_bytes: Some(config.store.max_bytes),
                seed: config.store.seed.clone(),
                ..StoreOptions::default()
            },
        )
        .with_context(|| {
            format!(
                "opening the chunk store at {} (if a ferry daemon uses it, give prewarm its \
                 --socket or --config so it goes through the daemon)",
                store_path.display()
            )
        })?;
        let store = Arc::new(store);
        let manager = MountManager::new(store.clone(), config.clone())
            .context("setting up the registry client and file cache")?;
        // A kill (or Ctrl-C) at any moment loses nothing: each span is in the store as
        // soon as it is verified, and the next open adopts it.
        for image in &args.images {
            let bar = Bar::new(image);
            let progress = Progress { bar: &bar };
            let outcome = manager
                .prewarm(
                    &PrewarmRequest {
                        image: image.clone(),
                        full: args.full,
                    },
                    &progress,
                )
                .with_context(|| format!("prewarming {image}"))?;
            bar.finish();
            let stopped = outcome.report.stopped;
            outcomes.push(outcome);
            if stopped {
                break;
            }
        }
        drop(manager);
        if let Ok(store) = Arc::try_unwrap(store) {
            store.close().context("closing the chunk store")?;
        }
    }
    report(&outcomes, args.json, started, daemon)?;
    if outcomes.iter().any(|o| o.report.stopped) {
        bail!("prewarm stopped before the end; run it again to fetch the rest");
    }
    if outcomes.iter().any(|o| o.report.failed > 0) {
        bail!("some ranges could not be fetched (see the log); run prewarm again");
    }
    Ok(())
}

fn report(outcomes: &[PrewarmOutcome], json: bool, started: Instant, daemon: bool) -> Result<()> {
    let mut fetched = 0;
    let mut present = 0;
    for o in outcomes {
        let r = &o.report;
        fetched += r.fetched_bytes;
        present += r.present_bytes;
        if json {
            outln!("{}", serde_json::to_string(o)?);
            continue;
        }
        let what = match (r.coverage.as_str(), &o.trace_source) {
            ("trace", Some(src)) => format!("hot set from its startup trace ({src})"),
            ("trace", None) => "hot set from its startup trace".to_string(),
            ("landmarks", _) => "hot set from its eStargz prioritized files (no trace)".into(),
            ("nothing", _) => {
                "nothing known to be hot (no trace, no eStargz landmarks; try --full)".into()
            }
            _ => "every layer".into(),
        };
        eprintln!(
            "{}: {what}: {} planned, {} already present, {} fetched in {:.1}s{}",
            o.image,
            human(r.planned_bytes),
            human(r.present_bytes),
            human(r.fetched_bytes),
            r.elapsed_ms as f64 / 1000.0,
            if r.fetched_bytes == 0 && !r.stopped {
                " (nothing to fetch: already warm)"
            } else {
                ""
            }
        );
    }
    eprintln!(
        "prewarm: {} fetched, {} already present, {:.1}s ({})",
        human(fetched),
        human(present),
        started.elapsed().as_secs_f64(),
        if daemon {
            "through the daemon"
        } else {
            "no daemon: this process"
        }
    );
    Ok(())
}

/// A byte bar for one image.
struct Bar(ProgressBar, #[allow(dead_code)] indicatif::MultiProgress);

impl Bar {
    fn new(image: &str) -> Bar {
        let multi = crate::progress::multi();
        let label: String = image
            .chars()
            .rev()
            .take(24)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let bar = crate::progress::bytes_bar(&multi, &label, 0);
        Bar(bar, multi)
    }
    fn planned(&self, planned: u64, present: u64) {
        self.0.set_length(planned);
        self.0.set_position(present.min(planned));
        self.0.reset_eta();
    }
    fn fetched(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        if let Some(len) = self.0.length() {
            self.0.set_position(len);
        }
        self.0.finish_and_clear();
    }
}

struct Progress<'a> {
    bar: &'a Bar,
}

impl PrewarmProgress for Progress<'_> {
    fn planned(&self, planned: u64, present: u64) {
        self.bar.planned(planned, present);
    }
    fn fetched(&self, bytes: u64) {
        self.bar.fetched(bytes);
    }
}
