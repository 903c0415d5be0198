//! `ferry store ls|du|gc|verify|export|import|plan`: inspect and maintain the node's
//! chunk store offline, move it to and from a volume as a verified store image, and
//! work out whether baking one pays (`plan`, arithmetic only: it opens no store).
//!
//! The store itself lives in `ferry_store`; this file only picks its location, opens it
//! without changing its bound, and prints. The store is opened exclusively, so these
//! commands refuse to run while the daemon has it open (the daemon's status shows the
//! same numbers live).

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use ferry_store::{OwnerInfo, Store, StoreConfig, StoreOptions};

use super::human;
use crate::out::outln;

/// Arguments of `ferry store`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Store directory; default: $FERRY_STORE, else /var/lib/ferry/store for root, else
    /// $XDG_CACHE_HOME/ferry/store.
    #[arg(long, value_name = "PATH", global = true)]
    store: Option<PathBuf>,
    /// A read-only seed store under it (a `ferry store export` directory, as the
    /// daemon's `[store] seed`): checked at open, shown by `du`, hashed by `verify`;
    /// never written (ls, gc and export see only the live store).
    #[arg(long, value_name = "PATH", global = true)]
    seed: Option<PathBuf>,
    #[command(subcommand)]
    command: StoreCommand,
}

#[derive(Debug, clap::Subcommand)]
enum StoreCommand {
    /// List entries, least recently used (next to be evicted) first.
    Ls {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show bytes and entries stored against the bound.
    Du {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Evict least recently used unpinned entries down to a size, and remove image
    /// metadata (manifests, configs, indexes) that no image record lists any more and
    /// that was written over an hour ago.
    Gc {
        /// Target size (e.g. 0, 500M, 20G; K/M/G/T are powers of 1024). Default: the
        /// store's bound.
        #[arg(long, value_name = "BYTES", value_parser = ferry_oci::units::parse_size)]
        to: Option<u64>,
        /// Also release every persisted pin first (for a node whose mounts are gone).
        #[arg(long)]
        release_pins: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash every entry, drop the ones that do not match their key, and report them;
    /// with --seed, also hash every seed object and report the bad ones (never changed).
    Verify {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Copy every entry and the records of the images it holds into DEST (a new or empty
    /// directory) with a versioned manifest (`ferry-store.json`), ready for a volume.
    Export {
        /// Destination directory.
        dest: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Bring a store export into this store: every object is hashed in staging and
    /// only when all match are they added (a bad one refuses the whole import).
    Import {
        /// An export directory (`ferry store export`).
        src: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Work out which way a fleet's nodes should get an image: a full pull, a lazy pull,
    /// a lazy pull prewarmed at boot, or a store baked into a volume snapshot (`ferry
    /// store export`, `[store] seed`). Prints each way's wait per start and monthly cost,
    /// the cheapest, and from how many starts a month baking pays. Defaults are ferry's
    /// own figures and list prices; put in yours (docs/node-cache.md, "Choosing").
    Plan(PlanArgs),
}

/// Inputs of `ferry store plan` (sizes: 800M, 1G; rates: 100M or 100M/s, bytes per
/// second; prices in any one currency).
#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// The image's compressed size (what a pull downloads).
    #[arg(long, value_name = "SIZE", value_parser = ferry_oci::units::parse_nonzero_size)]
    image: u64,
    /// Its unpacked size. Default: 2.5 × --image (gzip on a typical image).
    #[arg(long, value_name = "SIZE", value_parser = ferry_oci::units::parse_size)]
    unpacked: Option<u64>,
    /// Bytes a start reads (`ferry trace show` of the image's trace). Default: 5 % of
    /// --unpacked (the pandas start of docs/benchmarks.md reads 59 MB of 1.1 GB).
    #[arg(long, value_name = "SIZE", value_parser = ferry_oci::units::parse_size)]
    hot: Option<u64>,
    /// Download throughput from the registry to a node.
    #[arg(long, value_name = "RATE", default_value = "100M/s", value_parser = parse_rate)]
    link: u64,
    /// Unpack throughput to the node's disk (uncompressed bytes).
    #[arg(long, value_name = "RATE", default_value = "200M/s", value_parser = parse_rate)]
    write: u64,
    /// First-read throughput of a volume restored from a snapshot with ferry's
    /// trace-ordered read-ahead (a restored volume fetches each block on first touch).
    #[arg(long, value_name = "RATE", default_value = "100M/s", value_parser = parse_rate)]
    volume_read: u64,
    /// One round trip to the registry.
    #[arg(long, value_name = "DURATION", default_value = "1ms", value_parser = ferry_oci::units::parse_duration)]
    rtt: std::time::Duration,
    /// Round trips a lazy start without a trace waits for, per MiB read (pandas start
    /// from Debian's registry: ~45 for 59 MB).
    #[arg(long, value_name = "N", default_value_t = 0.8)]
    waits_per_mib: f64,
    /// Starts of the image on fresh nodes per month.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    starts: u64,
    /// Price of a node-hour.
    #[arg(long, value_name = "PRICE", default_value_t = 1.0)]
    node_price: f64,
    /// Price of a GB from the registry to a node (0 within a region).
    #[arg(long, value_name = "PRICE", default_value_t = 0.0)]
    egress_price: f64,
    /// Price of a GB-month of volume.
    #[arg(long, value_name = "PRICE", default_value_t = 0.08)]
    volume_price: f64,
    /// Price of a GB-month of snapshot.
    #[arg(long, value_name = "PRICE", default_value_t = 0.05)]
    snapshot_price: f64,
    /// Hours a node and its volume live.
    #[arg(long, value_name = "HOURS", default_value_t = 24.0)]
    node_hours: f64,
    /// Snapshots kept at once (versions baked and still in use).
    #[arg(long, value_name = "N", default_value_t = 4)]
    versions: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A rate in bytes per second: a size, optionally followed by `/s`.
fn parse_rate(text: &str) -> Result<u64, String> {
    let size = text.trim().strip_suffix("/s").unwrap_or(text);
    ferry_oci::units::parse_nonzero_size(size).map_err(|e| format!("{e} (a rate: 100M/s)"))
}

fn non_negative(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        bail!("--{name} {v}: must be a number, zero or more")
    }
}

fn plan(a: PlanArgs) -> Result<()> {
    let unpacked = a
        .unpacked
        .unwrap_or_else(|| a.image.saturating_mul(5) / 2)
        .max(a.image);
    let inputs = super::store_plan::Inputs {
        image_bytes: a.image,
        unpacked_bytes: unpacked,
        hot_bytes: a.hot.unwrap_or(unpacked / 20),
        link_bytes_per_s: a.link,
        write_bytes_per_s: a.write,
        volume_read_bytes_per_s: a.volume_read,
        rtt_s: a.rtt.as_secs_f64(),
        waits_per_mib: non_negative("waits-per-mib", a.waits_per_mib)?,
        starts_per_month: a.starts,
        node_price_per_hour: non_negative("node-price", a.node_price)?,
        egress_price_per_gb: non_negative("egress-price", a.egress_price)?,
        volume_price_per_gb_month: non_negative("volume-price", a.volume_price)?,
        snapshot_price_per_gb_month: non_negative("snapshot-price", a.snapshot_price)?,
        node_hours: non_negative("node-hours", a.node_hours)?,
        versions_kept: a.versions,
    };
    let plan = inputs.plan();
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        outln!(
            "image {} ({} unpacked), a start reads {}; link {}/s, rtt {:.0} ms; {} starts a month",
            human(inputs.image_bytes),
            human(inputs.unpacked_bytes),
            human(inputs.hot_bytes),
            human(inputs.link_bytes_per_s),
            inputs.rtt_s * 1e3,
            inputs.starts_per_month
        );
        outln!("{}", plan.table().trim_end());
    }
    Ok(())
}

/// Runs `ferry store`.
pub fn run(args: Args) -> Result<()> {
    let command = match args.command {
        // arithmetic only: no store to open (and none to lock)
        StoreCommand::Plan(a) => return plan(a),
        other => other,
    };
    let path = match args.store {
        Some(p) => p,
        None => StoreConfig::default().resolve_path(),
    };
    let options = StoreOptions {
        // Keep the bound the daemon configured; maintenance never shrinks the store.
        max_bytes: None,
        flush_interval: None,
        seed: args.seed,
        ..StoreOptions::default()
    };
    let store = Store::open_with(&path, options)
        .with_context(|| format!("opening the chunk store at {}", path.display()))?;
    let opened = store.open_report();
    if opened.removed_temp_files + opened.dropped_entries + opened.adopted_files > 0
        || opened.metadata_rebuilt
    {
        eprintln!(
            "ferry: store repaired at open: {} temp files removed, {} damaged entries dropped, {} files adopted{}",
            opened.removed_temp_files,
            opened.dropped_entries,
            opened.adopted_files,
            if opened.metadata_rebuilt {
                ", metadata rebuilt"
            } else {
                ""
            }
        );
    }
    match command {
        StoreCommand::Ls { json } => ls(&store, json)?,
        StoreCommand::Du { json } => du(&store, json)?,
        StoreCommand::Gc {
            to,
            release_pins,
            json,
        } => gc(&store, to, release_pins, json)?,
        StoreCommand::Verify { json } => verify(&store, json)?,
        StoreCommand::Export { dest, json } => export(&store, &dest, json)?,
        StoreCommand::Import { src, json } => import(&store, &src, json)?,
        StoreCommand::Plan(a) => plan(a)?,
    }
    store.close().context("closing the chunk store")
}

/// An export's or import's report as JSON, with the seconds it took.
fn print_report(report: &impl serde::Serialize, secs: f64) -> Result<()> {
    let mut doc = serde_json::to_value(report)?;
    doc["seconds"] = serde_json::json!(secs);
    outln!("{}", serde_json::to_string_pretty(&doc)?);
    Ok(())
}

fn export(store: &Store, dest: &std::path::Path, json: bool) -> Result<()> {
    let started = std::time::Instant::now();
    let r = store
        .export(dest)
        .with_context(|| format!("exporting the store to {}", dest.display()))?;
    let secs = started.elapsed().as_secs_f64();
    if json {
        return print_report(&r, secs);
    }
    outln!(
        "exported {} objects ({}) and {} image records to {} in {secs:.1}s ({}/s){}",
        r.objects,
        human(r.bytes),
        r.images,
        r.dest.display(),
        human((r.bytes as f64 / secs.max(1e-3)) as u64),
        if r.skipped > 0 {
            format!("; {} entries evicted meanwhile were left out", r.skipped)
        } else {
            String::new()
        }
    );
    Ok(())
}

fn import(store: &Store, src: &std::path::Path, json: bool) -> Result<()> {
    let started = std::time::Instant::now();
    let r = store
        .import(src)
        .with_context(|| format!("importing the store export {}", src.display()))?;
    let secs = started.elapsed().as_secs_f64();
    if json {
        return print_report(&r, secs);
    }
    outln!(
        "imported {} objects ({}) verified, {} ({}) already present, {} image records, in {secs:.1}s",
        r.imported,
        human(r.imported_bytes),
        r.present,
        human(r.present_bytes),
        r.images
    );
    for image in store.images() {
        outln!(
            "  {}  {}  ({})",
            image.reference,
            image.manifest_digest,
            image.coverage
        );
    }
    Ok(())
}

fn ls(store: &Store, json: bool) -> Result<()> {
    let entries = store.list();
    if json {
        outln!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    let now = now_ms();
    outln!("{:<71}  {:>10}  {:>12}  PINS", "KEY", "SIZE", "LAST ACCESS");
    for e in &entries {
        outln!(
            "{:<71}  {:>10}  {:>12}  {}",
            e.key.to_string(),
            human(e.size),
            age(now, e.last_access_ms),
            e.pins
        );
    }
    Ok(())
}

fn du(store: &Store, json: bool) -> Result<()> {
    let s = store.stats();
    let owners = store.owners();
    if json {
        let doc = serde_json::json!({
            "path": store.root(),
            "entries": s.entries,
            "bytes": s.bytes,
            "max_bytes": s.max_bytes,
            "pinned_bytes": s.pinned_bytes,
            "pinned_entries": s.pinned_entries,
            "pin_owners": s.pin_owners,
            "owners": owners,
            "seed": store.seed_stats(),
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    let percent = if s.max_bytes == 0 {
        0.0
    } else {
        s.bytes as f64 * 100.0 / s.max_bytes as f64
    };
    outln!("store    {}", store.root().display());
    outln!(
        "used     {} of {} ({percent:.1}%)",
        human(s.bytes),
        human(s.max_bytes)
    );
    outln!("entries  {}", s.entries);
    outln!(
        "pinned   {} in {} entries, by {} owners",
        human(s.pinned_bytes),
        s.pinned_entries,
        s.pin_owners
    );
    if let Some(seed) = store.seed_stats() {
        outln!(
            "seed     {} (read-only): {} objects, {}, {} image records",
            seed.path.display(),
            seed.objects,
            human(seed.bytes),
            seed.images
        );
    }
    if !owners.is_empty() {
        print!("{}", owners_table(&owners));
    }
    Ok(())
}

/// One line per pin owner: stored bytes it pins, keys, and whether it is a mount of a
/// previous daemon not re-registered yet (its pins lapse after the grace period).
fn owners_table(owners: &[OwnerInfo]) -> String {
    let mut out = format!("\n{:>10}  {:>7}  {:<8}  OWNER\n", "PINNED", "KEYS", "STATE");
    for o in owners {
        out.push_str(&format!(
            "{:>10}  {:>7}  {:<8}  {}\n",
            human(o.bytes),
            o.keys,
            if o.restored { "restored" } else { "live" },
            o.owner
        ));
    }
    out
}

fn gc(store: &Store, to: Option<u64>, release_pins: bool, json: bool) -> Result<()> {
    let mut released = 0;
    if release_pins {
        for owner in store.owners() {
            released += store
                .unpin_owner(&owner.owner)
                .with_context(|| format!("releasing the pins of {}", owner.owner))?;
        }
    }
    let target = to.unwrap_or(store.max_bytes());
    let r = store.gc_to(target)?;
    let swept = store
        .sweep_metadata(ferry_store::METADATA_GRACE)
        .context("removing image metadata no record lists")?;
    if json {
        let doc = serde_json::json!({
            "target_bytes": target,
            "released_pins": released,
            "removed_metadata_blobs": swept,
            "evicted_entries": r.evicted_entries,
            "freed_bytes": r.freed_bytes,
            "bytes": r.bytes,
            "pinned_bytes": r.pinned_bytes,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    if release_pins {
        outln!("released {released} pins");
    }
    outln!(
        "evicted {} entries ({}); {} stored, {} of it pinned",
        r.evicted_entries,
        human(r.freed_bytes),
        human(r.bytes),
        human(r.pinned_bytes)
    );
    if swept > 0 {
        outln!("removed {swept} image metadata blobs no image record lists");
    }
    if r.bytes > target {
        outln!(
            "note: still above the target of {}: the rest is pinned (see --release-pins)",
            human(target)
        );
    }
    Ok(())
}

fn verify(store: &Store, json: bool) -> Result<()> {
    let r = store.verify_all()?;
    let seed = store.verify_seed();
    if json {
        if let Some(seed) = &seed {
            let mut doc = serde_json::to_value(&r)?;
            doc["seed"] = serde_json::to_value(seed)?;
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            outln!("{}", serde_json::to_string_pretty(&r)?);
        }
    } else {
        outln!(
            "{} entries good ({} hashed), {} dropped",
            r.good_entries,
            human(r.checked_bytes),
            r.dropped.len()
        );
        for k in &r.dropped {
            outln!("dropped {k}");
        }
    }
    if let Some(seed) = &seed
        && !json
    {
        outln!(
            "seed: {} objects good ({} hashed), {} bad",
            seed.good_entries,
            human(seed.checked_bytes),
            seed.dropped.len()
        );
        for k in &seed.dropped {
            outln!("bad seed object {k}");
        }
    }
    if !r.dropped.is_empty() {
        bail!(
            "{} damaged entries were dropped (they will be fetched again)",
            r.dropped.len()
        );
    }
    if let Some(seed) = seed
        && !seed.dropped.is_empty()
    {
        bail!(
            "{} seed objects are missing or damaged (a daemon fetches them instead; bake the \
             seed again to repair it: it is never written)",
            seed.dropped.len()
        );
    }
    Ok(())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// "5m ago" style age of a timestamp; "unknown" for 0.
fn age(now_ms: u64, then_ms: u64) -> String {
    if then_ms == 0 {
        return "unknown".into();
    }
    let secs = Duration::from_millis(now_ms.saturating_sub(then_ms)).as_secs();
    match secs {
        0..60 => format!("{secs}s ago"),
        60..3600 => format!("{}m ago", secs / 60),
        3600..86400 => format!("{}h ago", secs / 3600),
        _ => format!("{}d ago", secs / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_show_their_pinned_bytes() {
        let owners = [
            OwnerInfo {
                owner: "mount:/a".into(),
                keys: 3,
                bytes: 3 << 20,
                restored: false,
            },
            OwnerInfo {
                owner: "mount:/b".into(),
                keys: 1,
                bytes: 0,
                restored: true,
            },
        ];
        let table = owners_table(&owners);
        // Columns are separated by at least two spaces (sizes hold one).
        let lines: Vec<Vec<&str>> = table
            .lines()
            .skip(1)
            .map(|l| {
                l.split("  ")
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .collect()
            })
            .collect();
        assert_eq!(lines[0], ["PINNED", "KEYS", "STATE", "OWNER"]);
        assert_eq!(lines[1], ["3.0 MiB", "3", "live", "mount:/a"]);
        assert_eq!(lines[2], ["0 B", "1", "restored", "mount:/b"]);
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn ages_read_naturally() {
        assert_eq!(age(10_000, 0), "unknown");
        assert_eq!(age(70_000, 10_000), "1m ago");
        assert_eq!(age(10_000, 20_000), "0s ago");
        assert_eq!(age(3 * 86_400_000, 1), "2d ago");
    }
}
