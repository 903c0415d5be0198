//! `ferry status`: what the node daemon serves, per mount — bytes fetched of the total,
//! cache hits, fetch errors, prefetch and fill progress. It only asks the daemon
//! (`GET /v1/status`) and formats the answer.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use ferry_daemon::{ControlClient, StatusReport};

/// Arguments of `ferry status`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the daemon's answer as JSON.
    #[arg(long)]
    json: bool,
    /// Control socket (default: the config's, else the per-user default).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Daemon config file (for its `[control] socket`).
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
}

/// Runs `ferry status`.
pub fn run(args: Args) -> Result<()> {
    let socket = match args.socket {
        Some(s) => s,
        None => super::daemon::load_config(args.config.as_deref())?.control_socket(),
    };
    let client = ControlClient::new(&socket).with_timeout(Duration::from_secs(30));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime
        .block_on(client.status())
        .with_context(|| format!("asking the daemon at {}", socket.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

/// `sha256:0123456789ab…` → `0123456789ab`.
fn short_digest(d: &str) -> String {
    let hex = d.split_once(':').map_or(d, |(_, h)| h);
    hex.chars().take(12).collect()
}

/// The image reference without a long digest.
fn short_image(image: &str) -> String {
    match image.split_once('@') {
        Some((name, digest)) => format!("{name}@{}", short_digest(digest)),
        None => image.to_owned(),
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn table(report: &StatusReport) -> String {
    let mut out = String::new();
    let d = &report.daemon;
    out.push_str(&format!(
        "daemon: pid {}, control {}",
        d.pid,
        d.control_socket.display()
    ));
    if let Some(s) = &d.snapshotter_socket {
        out.push_str(&format!(", snapshotter {}", s.display()));
    }
    if let Some(a) = &d.metrics_addr {
        out.push_str(&format!(", metrics http://{a}/metrics"));
    }
    if let Some(a) = &d.p2p_addr {
        out.push_str(&format!(", peers {a}"));
    }
    out.push('\n');
    for dead in &d.dead_mounts {
        match &dead.error {
            None => out.push_str(&format!(
                "cleaned at start: dead mount {} (connection ended; detached)\n",
                dead.mountpoint.display()
            )),
            Some(e) => out.push_str(&format!(
                "found at start: dead mount {} (connection ended; not detached: {e})\n",
                dead.mountpoint.display()
            )),
        }
    }
    if let Some(s) = &report.store {
        out.push_str(&format!(
            "store: {} ({} of {}, {} entries)\n",
            s.path.display(),
            human(s.bytes),
            human(s.max_bytes),
            s.entries
        ));
    }
    if let Some(c) = &report.file_cache {
        out.push_str(&format!(
            "file cache: {} files, {} ({} materializing), {} passthrough opens; small-file pack: {} files, {}, {} reads served\n",
            c.files,
            human(c.bytes),
            c.pending,
            c.passthrough_opens,
            c.pack_files,
            human(c.pack_bytes),
            c.pack_hits
        ));
    }
    if let Some(p) = &report.p2p {
        out.push_str(&format!(
            "peers: {} from peers, {} from the registry, {} served; refused {} (401) {} (403) {} (503); {} peer failures ({} corrupt), {} fallbacks to the registry\n",
            human(p.bytes_from_peers),
            human(p.bytes_from_origin),
            human(p.bytes_served),
            p.refused_unauthenticated,
            p.refused_forbidden,
            p.refused_busy,
            p.peer_failures,
            p.peer_corrupt,
            p.fallbacks_to_origin
        ));
        out.push_str(&format!(
            "members ({}): {}\n",
            p.members.len(),
            p.members.join(" ")
        ));
        let g = &p.gossip;
        if g.datagrams_in + g.datagrams_out > 0 {
            out.push_str(&format!(
                "gossip: {} members, {} datagrams in ({}), {} out ({}); dropped: {} oversized, {} unauthenticated, {} stale, {} replayed, {} malformed, {} over the member cap, {} refused\n",
                g.members,
                g.datagrams_in,
                human(g.bytes_in),
                g.datagrams_out,
                human(g.bytes_out),
                g.dropped_oversized,
                g.dropped_unauthenticated,
                g.dropped_stale,
                g.dropped_replayed,
                g.dropped_malformed,
                g.dropped_member_cap,
                g.dropped_refused
            ));
        }
    }
    if report.mounts.is_empty() {
        out.push_str("no mounts\n");
        return out;
    }
    let header = [
        "MOUNTPOINT",
        "IMAGE",
        "LAYER",
        "FETCHED/TOTAL",
        "HITS",
        "ERRORS",
        "PREFETCH",
        "FILL",
        "TRACE",
    ];
    let mut rows: Vec<[String; 9]> = vec![header.map(str::to_owned)];
    for m in &report.mounts {
        let s = &m.stats;
        let pct = if s.bytes_total == 0 {
            0.0
        } else {
            s.bytes_fetched as f64 * 100.0 / s.bytes_total as f64
        };
        rows.push([
            m.info.mountpoint.display().to_string(),
            short_image(&m.info.image),
            m.info
                .layer
                .as_deref()
                .map_or_else(|| "(merged)".to_owned(), short_digest),
            format!(
                "{} / {} ({pct:.1}%)",
                human(s.bytes_fetched),
                human(s.bytes_total)
            ),
            s.cache_hits.to_string(),
            s.fetch_errors.to_string(),
            yes_no(s.prefetch_done).to_owned(),
            yes_no(s.fill_done).to_owned(),
            trace_cell(m),
        ]);
    }
    let widths: Vec<usize> = (0..9)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The TRACE column: where the mount's startup trace came from, and whether it records.
fn trace_cell(m: &ferry_daemon::mounts::MountStatus) -> String {
    use ferry_daemon::autotrace::TraceSource;
    let source = m.trace.as_ref().map(|t| match t.source {
        TraceSource::Published => "published",
        TraceSource::Node => "node",
        TraceSource::PreviousVersion => "previous version",
    });
    match (source, m.recording) {
        (Some(s), true) => format!("{s}, recording"),
        (Some(s), false) => s.to_owned(),
        (None, true) => "recording".to_owned(),
        (None, false) => "-".to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn shortening_and_sizes() {
        let d = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(short_digest(&d), "abababababab");
        assert_eq!(
            short_image(&format!("reg/app:v1@{d}")),
            "reg/app:v1@abababababab"
        );
        assert_eq!(short_image("reg/app:v1"), "reg/app:v1");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
    }
}
