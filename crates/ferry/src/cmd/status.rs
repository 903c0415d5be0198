//! `ferry status`: what the node daemon serves, per mount — bytes fetched of the total,
//! cache hits, fetch errors, prefetch and fill progress. It only asks the daemon
//! (`GET /v1/status`) and formats the answer.

use std::path::PathBuf;
use std::time::Duration;

use crate::out::outln;
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
        outln!("{}", serde_json::to_string_pretty(&report)?);
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
    if let Some(s) = &d.cri_socket {
        out.push_str(&format!(", CRI {}", s.display()));
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
        if let Some(seed) = &s.seed {
            out.push_str(&format!(
                "seed store: {} (read-only; {} objects, {}; {} hits, {} served, {} verified, {} corrupt)\n",
                seed.path.display(),
                seed.objects,
                human(seed.bytes),
                seed.hits,
                human(seed.bytes_served),
                seed.verified,
                seed.corrupt
            ));
        }
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
            "peers: layers {} from peers, {} from the registry, {} served; windows {} from peers, {} from the registry, {} served; refused {} (401) {} (403) {} (503); {} peer failures ({} corrupt), {} fallbacks to the registry\n",
            human(p.bytes_from_peers),
            human(p.bytes_from_origin),
            human(p.bytes_served),
            human(p.windows_bytes_from_peers),
            human(p.windows_bytes_from_origin),
            human(p.windows_bytes_served),
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
        if let Some(t) = &p.tls {
            out.push_str(&format!(
                "peer TLS: {} handshakes failed; files reloaded {} times, {} changes refused (see the log)\n",
                t.handshake_failures, t.reloads, t.reload_failures
            ));
        }
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
    if let Some(c) = &report.cri {
        out.push_str(&format!(
            "CRI proxy: {} calls forwarded to {}, {} unreachable; credentials kept from {} pulls, held for {} repositories (in memory: after a restart, until the kubelet pulls again)\n",
            c.forwarded,
            c.runtime_socket.display(),
            c.runtime_unreachable,
            c.credentials_kept,
            c.repositories_with_credentials
        ));
    }
    mounts_table(report, &mut out);
    if let Some(not_lazy) = &report.not_lazy {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        out.push_str(&not_lazy_section(not_lazy, now));
    }
    out
}

/// Columns padded to their widest cell, the last one unpadded.
fn aligned<const N: usize>(rows: Vec<[String; N]>, out: &mut String) {
    let widths: Vec<usize> = (0..N)
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
}

/// How long ago `then` was, coarsely.
fn ago(now: u64, then: u64) -> String {
    let s = now.saturating_sub(then);
    match s {
        0..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        _ => format!("{}h ago", s / 3600),
    }
}

/// The images whose layers took containerd's ordinary path, with why and what to do.
fn not_lazy_section(status: &ferry_daemon::fallback::NotLazyStatus, now: u64) -> String {
    let mut out = String::new();
    if status.images.is_empty() {
        out.push_str("not lazy: none (every layer prepared through the snapshotter was lazy)\n");
        return out;
    }
    out.push_str(&format!(
        "not lazy: {} image(s) whose layers were downloaded and unpacked the ordinary way, newest first{}\n",
        status.images.len(),
        if status.images_dropped > 0 {
            format!(" ({} older ones dropped)", status.images_dropped)
        } else {
            String::new()
        }
    ));
    let mut rows: Vec<[String; 5]> =
        vec![["IMAGE", "LAYERS", "REASON", "LAST", "DETAIL"].map(str::to_owned)];
    for image in &status.images {
        let name = image
            .image
            .as_deref()
            .map_or_else(|| "(not named in the labels)".to_owned(), short_image);
        let others = image.reasons.keys().filter(|r| **r != image.reason).count();
        let reason = if others > 0 {
            format!("{} (+{others} more)", image.reason)
        } else {
            image.reason.to_string()
        };
        rows.push([
            name,
            image.layers.to_string(),
            reason,
            ago(now, image.last_seen),
            image.detail.clone(),
        ]);
    }
    aligned(rows, &mut out);
    // The advice once per distinct hint, not once per image.
    let mut hints: Vec<(String, &str)> = Vec::new();
    for image in &status.images {
        if !hints.iter().any(|(_, h)| *h == image.hint) {
            hints.push((image.reason.to_string(), &image.hint));
        }
    }
    for (reason, hint) in hints {
        out.push_str(&format!("  {reason}: {hint}\n"));
    }
    out
}

fn mounts_table(report: &StatusReport, out: &mut String) {
    if report.mounts.is_empty() {
        out.push_str("no mounts\n");
        return;
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
    aligned(rows, out);
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

    #[test]
    fn the_not_lazy_section_names_image_reason_and_advice() {
        use ferry_daemon::fallback::FallbackLog;
        use ferry_snapshotter::{NotLazy, NotLazyReason};

        let log = FallbackLog::new();
        assert!(not_lazy_section(&log.status(), 0).starts_with("not lazy: none"));
        let no_index = NotLazy::new(NotLazyReason::NoIndex, "no ferry index");
        log.declined(Some("reg/plain:v1"), None, Some("sha256:a"), &no_index);
        log.declined(Some("reg/plain:v1"), None, Some("sha256:b"), &no_index);
        log.declined(Some("reg/other:v1"), None, Some("sha256:c"), &no_index);
        let refused = NotLazy::new(NotLazyReason::Unauthorized, "401");
        log.declined(Some("reg/private:v1"), None, Some("sha256:d"), &refused);
        let status = log.status();
        let now = status.images[0].last_seen + 3;
        let text = not_lazy_section(&status, now);
        assert!(text.contains("not lazy: 3 image(s)"), "{text}");
        let plain = text
            .lines()
            .find(|l| l.starts_with("reg/plain:v1"))
            .unwrap();
        let cells: Vec<&str> = plain.split_whitespace().collect();
        assert_eq!(&cells[..4], ["reg/plain:v1", "2", "no-index", "3s"]);
        // One line of advice per distinct hint.
        assert_eq!(text.matches("index it with").count(), 1, "{text}");
        assert!(text.contains("credentials for reg/private"), "{text}");
        assert_eq!(ago(7300, 100), "2h ago");
    }
}
