//! Prometheus metrics for the registry, served at `/metrics`.
//!
//! One [`Metrics`] value is shared (cheap `Clone`, `Arc` inside) by the HTTP layer and the
//! pull-through cache. The hot path touches only atomics and a read-locked label lookup
//! with labels built from `&'static str`/integers, so recording costs no allocation.
//!
//! Layers per minute (the fleet cold-start figure) is
//! `rate(ferry_registry_layer_requests_total[1m]) * 60`; the cache hit ratio is
//! `hits / (hits + misses)` of `ferry_registry_cache_{hits,misses}_total`.

use std::borrow::Cow;
use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// What a request was, for labelling. A closed set so the label cardinality is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// `GET /v2/` (version check).
    Base,
    /// Manifest GET/HEAD.
    ManifestPull,
    /// Manifest PUT.
    ManifestPush,
    /// Manifest DELETE.
    ManifestDelete,
    /// Blob GET/HEAD (a layer request).
    BlobPull,
    /// Blob DELETE.
    BlobDelete,
    /// Upload start, chunk, finish, status, cancel, mount.
    Upload,
    /// `tags/list`.
    Tags,
    /// `_catalog`.
    Catalog,
    /// Referrers API.
    Referrers,
    /// Token endpoint.
    Token,
    /// `/metrics` itself.
    Metrics,
    /// Anything else (404s, unsupported methods).
    Other,
}

impl RouteKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Base => "base",
            RouteKind::ManifestPull => "manifest_pull",
            RouteKind::ManifestPush => "manifest_push",
            RouteKind::ManifestDelete => "manifest_delete",
            RouteKind::BlobPull => "blob_pull",
            RouteKind::BlobDelete => "blob_delete",
            RouteKind::Upload => "upload",
            RouteKind::Tags => "tags",
            RouteKind::Catalog => "catalog",
            RouteKind::Referrers => "referrers",
            RouteKind::Token => "token",
            RouteKind::Metrics => "metrics",
            RouteKind::Other => "other",
        }
    }
}

impl EncodeLabelValue for RouteKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    route: RouteKind,
    status: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RouteLabels {
    route: RouteKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CacheLabels {
    kind: Cow<'static, str>,
}

/// Cache kinds known up front, so recording them does not allocate.
const KNOWN_CACHE_KINDS: &[&str] = &[
    "manifest",
    "blob",
    "tag",
    "tags",
    "referrers",
    "token",
    "link",
    "blob_size",
    "memory",
    "disk",
    "memory_link",
    "memory_tag",
    "memory_manifest",
    "memory_blob",
];

fn cache_labels(kind: &str) -> CacheLabels {
    let kind = match KNOWN_CACHE_KINDS.iter().find(|k| **k == kind) {
        Some(k) => Cow::Borrowed(*k),
        None => Cow::Owned(kind.to_owned()),
    };
    CacheLabels { kind }
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<RouteLabels, Histogram, fn() -> Histogram>,
    bytes_sent: Family<RouteLabels, Counter>,
    bytes_received: Counter,
    layer_requests: Counter,
    cache_hits: Family<CacheLabels, Counter>,
    cache_misses: Family<CacheLabels, Counter>,
    upstream_fetches: Counter,
    upstream_bytes: Counter,
    upstream_errors: Counter,
    uploads_in_progress: Gauge,
}

/// Registry metrics; cheap to clone.
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~26 s, doubling.
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

impl Metrics {
    /// A fresh set of metrics in its own Prometheus registry (prefix `ferry_registry`).
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ferry_registry");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency: Family<RouteLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let bytes_sent = Family::<RouteLabels, Counter>::default();
        let bytes_received = Counter::default();
        let layer_requests = Counter::default();
        let cache_hits = Family::<CacheLabels, Counter>::default();
        let cache_misses = Family::<CacheLabels, Counter>::default();
        let upstream_fetches = Counter::default();
        let upstream_bytes = Counter::default();
        let upstream_errors = Counter::default();
        let uploads_in_progress = Gauge::default();

        registry.register(
            "requests",
            "HTTP requests by route kind and status",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from request to response headers, by route kind",
            latency.clone(),
        );
        registry.register(
            "response_bytes",
            "Body bytes sent to clients, by route kind",
            bytes_sent.clone(),
        );
        registry.register(
            "request_bytes",
            "Body bytes received from clients (uploads, manifests)",
            bytes_received.clone(),
        );
        registry.register(
            "layer_requests",
            "Blob GET/HEAD requests (layers per minute = rate * 60)",
            layer_requests.clone(),
        );
        registry.register("cache_hits", "Cache hits by kind", cache_hits.clone());
        registry.register("cache_misses", "Cache misses by kind", cache_misses.clone());
        registry.register(
            "upstream_fetches",
            "Objects fetched from the upstream registry",
            upstream_fetches.clone(),
        );
        registry.register(
            "upstream_bytes",
            "Bytes fetched from the upstream registry",
            upstream_bytes.clone(),
        );
        registry.register(
            "upstream_errors",
            "Failed upstream requests",
            upstream_errors.clone(),
        );
        registry.register(
            "uploads_in_progress",
            "Blob upload sessions started and not yet finished or cancelled in this process",
            uploads_in_progress.clone(),
        );
        Metrics {
            inner: Arc::new(Inner {
                registry,
                requests,
                latency,
                bytes_sent,
                bytes_received,
                layer_requests,
                cache_hits,
                cache_misses,
                upstream_fetches,
                upstream_bytes,
                upstream_errors,
                uploads_in_progress,
            }),
        }
    }

    /// A cache (of `kind`: "manifest", "blob", "token", ...) answered without upstream.
    pub fn cache_hit(&self, kind: &str) {
        self.inner
            .cache_hits
            .get_or_create(&cache_labels(kind))
            .inc();
    }

    /// A cache (of `kind`) did not have the object.
    pub fn cache_miss(&self, kind: &str) {
        self.inner
            .cache_misses
            .get_or_create(&cache_labels(kind))
            .inc();
    }

    /// One object fetched from upstream, `bytes` long.
    pub fn upstream_fetch(&self, bytes: u64) {
        self.inner.upstream_fetches.inc();
        self.inner.upstream_bytes.inc_by(bytes);
    }

    /// Bytes arriving from upstream for an object already counted by [`Self::upstream_fetch`]
    /// (streamed fetches report their size as it arrives).
    pub fn upstream_bytes(&self, bytes: u64) {
        self.inner.upstream_bytes.inc_by(bytes);
    }

    /// An upstream request failed (transport error, 429, 5xx).
    pub fn upstream_error(&self) {
        self.inner.upstream_errors.inc();
    }

    /// A request finished with `status` after `seconds`.
    pub fn request(&self, route: RouteKind, status: u16, seconds: f64) {
        self.inner
            .requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
        self.inner
            .latency
            .get_or_create(&RouteLabels { route })
            .observe(seconds);
        if route == RouteKind::BlobPull {
            self.inner.layer_requests.inc();
        }
    }

    /// `bytes` of response body sent for a `route` request.
    pub fn bytes_sent(&self, route: RouteKind, bytes: u64) {
        self.inner
            .bytes_sent
            .get_or_create(&RouteLabels { route })
            .inc_by(bytes);
    }

    /// A counter handle for bytes sent on `route`, for streamed bodies that add as they go.
    pub fn bytes_sent_counter(&self, route: RouteKind) -> Counter {
        self.inner
            .bytes_sent
            .get_or_create_owned(&RouteLabels { route })
    }

    /// `bytes` of request body received.
    pub fn bytes_received(&self, bytes: u64) {
        self.inner.bytes_received.inc_by(bytes);
    }

    /// An upload session started.
    pub fn upload_started(&self) {
        self.inner.uploads_in_progress.inc();
    }

    /// An upload session ended (finished, cancelled or failed).
    pub fn upload_ended(&self) {
        self.inner.uploads_in_progress.dec();
    }

    /// Total layer (blob GET/HEAD) requests so far.
    pub fn layer_requests(&self) -> u64 {
        self.inner.layer_requests.get()
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        // Writing into a String cannot fail; an Err here would only mean a metric's own
        // encoder failed, and a partial page is still the most useful answer.
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry)
        {
            tracing::warn!(%err, "encoding metrics");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_encodes() {
        let m = Metrics::new();
        m.request(RouteKind::BlobPull, 200, 0.001);
        m.request(RouteKind::BlobPull, 206, 0.002);
        m.request(RouteKind::ManifestPull, 404, 0.003);
        m.cache_hit("manifest");
        m.cache_hit("manifest");
        m.cache_miss("something-new");
        m.upstream_fetch(1234);
        m.upstream_error();
        m.upload_started();
        m.bytes_sent(RouteKind::BlobPull, 10);
        m.bytes_sent_counter(RouteKind::BlobPull).inc_by(5);
        assert_eq!(m.layer_requests(), 2);
        let text = m.encode();
        assert!(
            text.contains("ferry_registry_requests_total{route=\"blob_pull\",status=\"206\"} 1")
        );
        assert!(text.contains("ferry_registry_layer_requests_total 2"));
        assert!(text.contains("ferry_registry_cache_hits_total{kind=\"manifest\"} 2"));
        assert!(text.contains("ferry_registry_cache_misses_total{kind=\"something-new\"} 1"));
        assert!(text.contains("ferry_registry_upstream_bytes_total 1234"));
        assert!(text.contains("ferry_registry_upstream_errors_total 1"));
        assert!(text.contains("ferry_registry_uploads_in_progress 1"));
        assert!(text.contains("ferry_registry_response_bytes_total{route=\"blob_pull\"} 15"));
        assert!(
            text.contains(
                "ferry_registry_request_duration_seconds_count{route=\"manifest_pull\"} 1"
            )
        );
    }
}
