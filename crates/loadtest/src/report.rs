//! What a load test counts while it runs ([`Stats`], shared by every virtual node) and what
//! it reports afterwards ([`Report`]: the table and the `--json` document carry the same
//! fields). Counting is lock-free on the success path; only errors take a mutex, and a
//! run where errors dominate is already telling its story.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

use super::histogram::{AtomicHistogram, Histogram};
use super::{LayerMode, LoadTestConfig};

/// The requests a starting node makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// `GET /v2/` (auth discovery; 401 is the expected answer with auth on).
    Ping,
    /// Token request to the challenge's realm.
    Token,
    /// Manifest (or index, then platform manifest) GET.
    Manifest,
    /// Config blob GET.
    Config,
    /// Layer `HEAD`.
    LayerHead,
    /// Layer `GET` (ranged by default).
    LayerGet,
    /// The request to where a blob GET redirected.
    RedirectTarget,
}

impl RequestKind {
    /// Every kind, in table order.
    pub const ALL: [RequestKind; 7] = [
        RequestKind::Ping,
        RequestKind::Token,
        RequestKind::Manifest,
        RequestKind::Config,
        RequestKind::LayerHead,
        RequestKind::LayerGet,
        RequestKind::RedirectTarget,
    ];

    /// Name used in the table and JSON.
    pub fn name(self) -> &'static str {
        match self {
            RequestKind::Ping => "ping",
            RequestKind::Token => "token",
            RequestKind::Manifest => "manifest",
            RequestKind::Config => "config",
            RequestKind::LayerHead => "layer_head",
            RequestKind::LayerGet => "layer_get",
            RequestKind::RedirectTarget => "redirect_target",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why a request did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum ErrorClass {
    /// The response had an unexpected status.
    Status(u16),
    /// The TCP connection or HTTP handshake failed.
    Connect,
    /// The connection broke mid-request.
    Io,
    /// No complete answer within the request timeout.
    Timeout,
    /// A body we must read (manifest, token) exceeded its bound.
    BodyTooLarge,
    /// A redirect without a usable `Location` or to a host not allowed.
    BadRedirect,
    /// Auth could not be satisfied (no credentials, unusable challenge, token missing).
    Auth,
}

impl ErrorClass {
    fn name(self) -> String {
        match self {
            ErrorClass::Status(s) => format!("status {s}"),
            ErrorClass::Connect => "connect".into(),
            ErrorClass::Io => "io".into(),
            ErrorClass::Timeout => "timeout".into(),
            ErrorClass::BodyTooLarge => "body too large".into(),
            ErrorClass::BadRedirect => "bad redirect".into(),
            ErrorClass::Auth => "auth".into(),
        }
    }
}

#[derive(Debug, Default)]
struct KindStats {
    latency: AtomicHistogram,
    ok: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
}

/// Counters every virtual node records into.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    kinds: [KindStats; RequestKind::ALL.len()],
    errors: Mutex<BTreeMap<(RequestKind, ErrorClass), u64>>,
    /// Layer requests that succeeded (in redirect mode: including the redirect target).
    pub layers_ok: AtomicU64,
    /// Node starts whose every request succeeded.
    pub starts_ok: AtomicU64,
    /// TCP connections opened (whole run, warmup included).
    pub connects: AtomicU64,
    /// Tokens fetched (whole run, warmup included).
    pub token_fetches: AtomicU64,
    /// Tokens fetched again after a 401 (whole run).
    pub token_refreshes: AtomicU64,
}

impl Stats {
    /// A response arrived (any status) after `latency`; `ok` says whether it was expected.
    pub fn response(
        &self,
        kind: RequestKind,
        latency: Duration,
        bytes: u64,
        error: Option<ErrorClass>,
    ) {
        let k = &self.kinds[kind.index()];
        k.latency
            .record(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
        k.bytes.fetch_add(bytes, Ordering::Relaxed);
        match error {
            None => {
                k.ok.fetch_add(1, Ordering::Relaxed);
            }
            Some(e) => self.failure(kind, e),
        }
    }

    /// A request failed without a usable response (or with an unexpected one).
    pub fn failure(&self, kind: RequestKind, error: ErrorClass) {
        self.kinds[kind.index()]
            .failed
            .fetch_add(1, Ordering::Relaxed);
        let mut errors = match self.errors.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        *errors.entry((kind, error)).or_insert(0) += 1;
    }

    /// The report of a run that measured for `measured`.
    pub fn report(
        &self,
        cfg: &LoadTestConfig,
        layers_per_start: usize,
        measured: Duration,
    ) -> Report {
        let secs = measured.as_secs_f64().max(1e-9);
        let mut overall = Histogram::default();
        let mut kinds = Vec::new();
        let mut requests_total = 0;
        let mut errors_total = 0;
        for kind in RequestKind::ALL {
            let k = &self.kinds[kind.index()];
            let latency = k.latency.snapshot();
            let ok = k.ok.load(Ordering::Relaxed);
            let failed = k.failed.load(Ordering::Relaxed);
            let requests = ok + failed;
            requests_total += requests;
            errors_total += failed;
            overall.merge(&latency);
            if requests == 0 && latency.count() == 0 {
                continue;
            }
            kinds.push(KindReport::new(
                kind.name(),
                requests,
                ok,
                failed,
                k.bytes.load(Ordering::Relaxed),
                secs,
                &latency,
            ));
        }
        let errors = match self.errors.lock() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let layers_ok = self.layers_ok.load(Ordering::Relaxed);
        let starts_ok = self.starts_ok.load(Ordering::Relaxed);
        Report {
            target: format!("{}/{}:{}", cfg.registry, cfg.repository, cfg.reference)
                .replace(":sha256:", "@sha256:"),
            connections: cfg.connections,
            duration_s: secs,
            warmup_s: cfg.warmup.as_secs_f64(),
            layer_mode: cfg.layer_mode,
            range_bytes: match cfg.layer_mode {
                LayerMode::Head => None,
                _ => cfg.range_bytes,
            },
            layers_per_start,
            lpm: layers_ok as f64 * 60.0 / secs,
            layer_requests_ok: layers_ok,
            node_starts_ok: starts_ok,
            node_starts_per_s: starts_ok as f64 / secs,
            requests: requests_total,
            requests_per_s: requests_total as f64 / secs,
            errors_total,
            overall: KindReport::new(
                "all",
                requests_total,
                requests_total - errors_total,
                errors_total,
                self.kinds
                    .iter()
                    .map(|k| k.bytes.load(Ordering::Relaxed))
                    .sum(),
                secs,
                &overall,
            ),
            kinds,
            errors: errors
                .into_iter()
                .map(|((kind, e), count)| ErrorReport {
                    kind: kind.name().to_string(),
                    error: e.name(),
                    status: match e {
                        ErrorClass::Status(s) => Some(s),
                        _ => None,
                    },
                    count,
                })
                .collect(),
            connects: self.connects.load(Ordering::Relaxed),
            token_fetches: self.token_fetches.load(Ordering::Relaxed),
            token_refreshes: self.token_refreshes.load(Ordering::Relaxed),
        }
    }
}

/// Result of a load test (printed as a table by `Display`, or as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `registry/repository:reference`.
    pub target: String,
    /// Virtual nodes.
    pub connections: usize,
    /// Length of the measured window, seconds.
    pub duration_s: f64,
    /// Warmup before it, seconds.
    pub warmup_s: f64,
    /// How layers were requested.
    pub layer_mode: LayerMode,
    /// Bytes asked per layer GET (`None`: whole blobs, or HEAD).
    pub range_bytes: Option<u64>,
    /// Layer requests per node start (layers in the image).
    pub layers_per_start: usize,
    /// Successful layer requests per minute.
    pub lpm: f64,
    /// Successful layer requests in the window.
    pub layer_requests_ok: u64,
    /// Node starts in the window whose every request succeeded.
    pub node_starts_ok: u64,
    /// Those per second.
    pub node_starts_per_s: f64,
    /// Requests of every kind completed in the window (ok + errors).
    pub requests: u64,
    /// Those per second.
    pub requests_per_s: f64,
    /// Requests in the window that failed.
    pub errors_total: u64,
    /// Every kind together.
    pub overall: KindReport,
    /// Per request kind (kinds with no requests left out).
    pub kinds: Vec<KindReport>,
    /// Failures by kind and cause.
    pub errors: Vec<ErrorReport>,
    /// TCP connections opened over the whole run (warmup included).
    pub connects: u64,
    /// Tokens fetched over the whole run.
    pub token_fetches: u64,
    /// Tokens fetched again after a 401.
    pub token_refreshes: u64,
}

/// Numbers for one request kind.
#[derive(Debug, Clone, Serialize)]
pub struct KindReport {
    /// Kind name (`manifest`, `layer_get`, … or `all`).
    pub kind: String,
    /// Completed requests (ok + errors).
    pub requests: u64,
    /// Those with the expected answer.
    pub ok: u64,
    /// Those without.
    pub errors: u64,
    /// Requests per second.
    pub requests_per_s: f64,
    /// Body bytes received.
    pub bytes: u64,
    /// Latency percentiles of responses (any status), milliseconds.
    pub p50_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Slowest, milliseconds.
    pub max_ms: f64,
    /// Mean, milliseconds.
    pub mean_ms: f64,
}

impl KindReport {
    fn new(
        kind: &str,
        requests: u64,
        ok: u64,
        errors: u64,
        bytes: u64,
        secs: f64,
        latency: &Histogram,
    ) -> Self {
        let ms = |us: u64| us as f64 / 1000.0;
        KindReport {
            kind: kind.to_string(),
            requests,
            ok,
            errors,
            requests_per_s: requests as f64 / secs,
            bytes,
            p50_ms: ms(latency.value_at_quantile(0.50)),
            p99_ms: ms(latency.value_at_quantile(0.99)),
            max_ms: ms(latency.max()),
            mean_ms: latency.mean() / 1000.0,
        }
    }
}

/// How many requests of one kind failed one way.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorReport {
    /// Request kind.
    pub kind: String,
    /// `status 500`, `timeout`, `connect`, `io`, …
    pub error: String,
    /// The HTTP status, when the failure was one.
    pub status: Option<u16>,
    /// Occurrences in the window.
    pub count: u64,
}

/// `1234567` → `1,234,567`.
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let range = match self.range_bytes {
            Some(r) if self.layer_mode != LayerMode::Head => format!(", range {r} B"),
            None if self.layer_mode != LayerMode::Head => ", whole blobs".to_string(),
            _ => String::new(),
        };
        writeln!(
            f,
            "{}: {} connections, {:.1} s measured after {:.1} s warmup, layers {}{range}, {} layers per start",
            self.target,
            self.connections,
            self.duration_s,
            self.warmup_s,
            self.layer_mode,
            self.layers_per_start
        )?;
        writeln!(
            f,
            "LPM {}  (node starts/s {}, requests/s {}, errors {}, p99 {:.2} ms)",
            thousands(self.lpm),
            thousands(self.node_starts_per_s),
            thousands(self.requests_per_s),
            self.errors_total,
            self.overall.p99_ms
        )?;
        writeln!(
            f,
            "{:<16} {:>10} {:>9} {:>8} {:>9} {:>9} {:>9}",
            "kind", "requests", "req/s", "errors", "p50 ms", "p99 ms", "max ms"
        )?;
        for k in self.kinds.iter().chain(std::iter::once(&self.overall)) {
            writeln!(
                f,
                "{:<16} {:>10} {:>9.0} {:>8} {:>9.2} {:>9.2} {:>9.2}",
                k.kind, k.requests, k.requests_per_s, k.errors, k.p50_ms, k.p99_ms, k.max_ms
            )?;
        }
        if !self.errors.is_empty() {
            writeln!(f, "errors:")?;
            for e in &self.errors {
                writeln!(f, "  {:<16} {:<16} {}", e.kind, e.error, e.count)?;
            }
        }
        write!(
            f,
            "connections opened {}, tokens fetched {} (refreshed {}) over the whole run",
            self.connects, self.token_fetches, self.token_refreshes
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }

    #[test]
    fn report_counts_errors_by_kind_and_status() {
        let stats = Stats::default();
        let ms = Duration::from_millis(1);
        stats.response(RequestKind::Manifest, ms, 100, None);
        stats.response(RequestKind::LayerGet, ms, 10, None);
        stats.response(RequestKind::LayerGet, ms, 0, Some(ErrorClass::Status(500)));
        stats.failure(RequestKind::LayerGet, ErrorClass::Timeout);
        stats.layers_ok.fetch_add(1, Ordering::Relaxed);
        let cfg = LoadTestConfig {
            repository: "a/b".into(),
            ..LoadTestConfig::default()
        };
        let r = stats.report(&cfg, 2, Duration::from_secs(2));
        assert_eq!(r.requests, 4);
        assert_eq!(r.errors_total, 2);
        assert!((r.lpm - 30.0).abs() < 1e-9);
        let layer = r.kinds.iter().find(|k| k.kind == "layer_get").unwrap();
        assert_eq!((layer.requests, layer.ok, layer.errors), (3, 1, 2));
        assert_eq!(r.errors.len(), 2);
        assert_eq!(r.errors[0].status, Some(500));
        assert_eq!(r.errors[1].error, "timeout");
        assert!(
            r.kinds.iter().all(|k| k.kind != "ping"),
            "empty kinds left out"
        );
        let text = r.to_string();
        assert!(text.contains("LPM 30"), "{text}");
        assert!(text.contains("status 500"), "{text}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["layer_mode"], "get");
        assert_eq!(json["errors"][0]["count"], 1);
    }
}
