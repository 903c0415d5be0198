//! Prometheus metrics at `[metrics] addr` `/metrics`, built from the mounts' and the
//! store's live counters at scrape time (so series vanish with their mounts). It only
//! reads counters; it must not keep state of its own that could drift from them.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::cri::{CriProxy, CriStatus};
use crate::error::{Error, Result};
use crate::mounts::MountBackend;

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of every per-mount series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MountLabels {
    mountpoint: String,
    image: String,
    layer: String,
}

/// Labels of the layers-not-lazy counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Labels of the per-mount series split by kind of guess ([`ferry_fs::Guess`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuessLabels {
    mountpoint: String,
    image: String,
    layer: String,
    guess: &'static str,
}

type Counters = Family<MountLabels, Counter<u64>>;
type GuessCounters = Family<GuessLabels, Counter<u64>>;
type Gauges = Family<MountLabels, Gauge<i64>>;

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A gauge set to `v` (saturating), for a value read from a snapshot.
fn gauge(v: u64) -> Gauge<i64> {
    let g = Gauge::<i64>::default();
    g.set(gauge_value(v));
    g
}

/// A counter at `v`, for a total read from a snapshot.
fn counter(v: u64) -> Counter<u64> {
    let c = Counter::<u64>::default();
    c.inc_by(v);
    c
}

/// The metrics text (OpenMetrics) for the current state of `backend` and of the CRI
/// proxy, when it runs.
pub fn render(backend: &dyn MountBackend, cri: Option<&CriStatus>) -> Result<String> {
    let mut registry = Registry::with_prefix("ferry");
    let fetched = Counters::default();
    let total = Gauges::default();
    let hits = Counters::default();
    let misses = Counters::default();
    let errors = Counters::default();
    let requests = Counters::default();
    let requests_joined = Counters::default();
    let prefetched = Counters::default();
    let filled = Counters::default();
    let read_waits = Counters::default();
    let readahead = Counters::default();
    let nearby = Counters::default();
    let guessed = GuessCounters::default();
    let guessed_used = GuessCounters::default();
    let prefetch_done = Gauges::default();
    let fill_done = Gauges::default();
    for m in backend.list() {
        let labels = MountLabels {
            mountpoint: m.info.mountpoint.display().to_string(),
            image: m.info.image.clone(),
            layer: m.info.layer.clone().unwrap_or_default(),
        };
        let s = m.stats;
        fetched.get_or_create(&labels).inc_by(s.bytes_fetched);
        total.get_or_create(&labels).set(gauge_value(s.bytes_total));
        hits.get_or_create(&labels).inc_by(s.cache_hits);
        misses.get_or_create(&labels).inc_by(s.cache_misses);
        errors.get_or_create(&labels).inc_by(s.fetch_errors);
        requests.get_or_create(&labels).inc_by(s.requests);
        requests_joined
            .get_or_create(&labels)
            .inc_by(s.requests_joined);
        prefetched.get_or_create(&labels).inc_by(s.bytes_prefetched);
        filled.get_or_create(&labels).inc_by(s.bytes_filled);
        read_waits.get_or_create(&labels).inc_by(s.read_waits);
        readahead.get_or_create(&labels).inc_by(s.bytes_readahead);
        nearby.get_or_create(&labels).inc_by(s.bytes_nearby);
        for kind in ferry_fs::Guess::ALL {
            let by_kind = GuessLabels {
                mountpoint: labels.mountpoint.clone(),
                image: labels.image.clone(),
                layer: labels.layer.clone(),
                guess: kind.name(),
            };
            let bytes = s.guesses.of(kind);
            guessed.get_or_create(&by_kind).inc_by(bytes.fetched);
            guessed_used.get_or_create(&by_kind).inc_by(bytes.used);
        }
        prefetch_done
            .get_or_create(&labels)
            .set(i64::from(s.prefetch_done));
        fill_done.get_or_create(&labels).set(i64::from(s.fill_done));
    }
    registry.register(
        "mount_fetched_bytes",
        "Compressed bytes fetched from the registry or layout for the mount",
        fetched,
    );
    registry.register(
        "mount_total_bytes",
        "Compressed bytes of the mount's layers (a full pull)",
        total,
    );
    registry.register(
        "mount_cache_hits",
        "Spans served from the chunk store without a fetch",
        hits,
    );
    registry.register("mount_cache_misses", "Spans that had to be fetched", misses);
    registry.register(
        "mount_fetch_errors",
        "Fetches that failed, timed out or did not verify",
        errors,
    );
    registry.register("mount_requests", "Backend requests made", requests);
    registry.register(
        "mount_requests_joined",
        "Fetches that went out in another fetch's request to the same blob",
        requests_joined,
    );
    registry.register(
        "mount_prefetched_bytes",
        "Compressed bytes fetched by prefetch",
        prefetched,
    );
    registry.register(
        "mount_filled_bytes",
        "Compressed bytes fetched by background fill",
        filled,
    );
    registry.register(
        "mount_read_waits",
        "Reads that waited for the network (the start's critical path in round trips)",
        read_waits,
    );
    registry.register(
        "mount_readahead_bytes",
        "Compressed bytes fetched by readahead along a layer's stream",
        readahead,
    );
    registry.register(
        "mount_nearby_bytes",
        "Compressed bytes fetched at a miss as the rest of its file and the small files beside it",
        nearby,
    );
    registry.register(
        "mount_guessed_bytes",
        "Compressed bytes of spans fetched as guesses, by kind (readahead, a file's rest, its neighbours)",
        guessed,
    );
    registry.register(
        "mount_guessed_used_bytes",
        "Of the guessed bytes, those of spans a read has used since, by kind",
        guessed_used,
    );
    registry.register(
        "mount_prefetch_done",
        "1 once prefetch has finished",
        prefetch_done,
    );
    registry.register(
        "mount_fill_done",
        "1 once every byte of the mount's layers is local",
        fill_done,
    );
    registry.register(
        "mounts",
        "Live lazy mounts",
        gauge(backend.list().len() as u64),
    );
    if let Some(p) = backend.p2p_status() {
        let series: [(&str, &str, u64); 12] = [
            (
                "p2p_served_bytes",
                "Layer bytes served to peers",
                p.bytes_served,
            ),
            (
                "p2p_from_peers_bytes",
                "Verified layer bytes fetched from peers",
                p.bytes_from_peers,
            ),
            (
                "p2p_from_origin_bytes",
                "Layer bytes peer-routed layers fetched from the registry (as roots or after falling back)",
                p.bytes_from_origin,
            ),
            (
                "p2p_windows_served_bytes",
                "Windows blob bytes (gzip inflate windows) served to peers",
                p.windows_bytes_served,
            ),
            (
                "p2p_windows_from_peers_bytes",
                "Verified windows blob bytes fetched from peers",
                p.windows_bytes_from_peers,
            ),
            (
                "p2p_windows_from_origin_bytes",
                "Windows blob bytes peer-routed layers fetched from the registry",
                p.windows_bytes_from_origin,
            ),
            (
                "p2p_refused_unauthenticated",
                "Peer requests refused without a valid cluster token (401)",
                p.refused_unauthenticated,
            ),
            (
                "p2p_refused_forbidden",
                "Peer requests refused for want of pull rights (403)",
                p.refused_forbidden,
            ),
            (
                "p2p_refused_busy",
                "Peer requests refused at the concurrency bound (503)",
                p.refused_busy,
            ),
            (
                "p2p_peer_failures",
                "Requests to peers that timed out, failed or served bytes that did not verify",
                p.peer_failures,
            ),
            (
                "p2p_peer_corrupt",
                "Answers from peers whose bytes did not verify",
                p.peer_corrupt,
            ),
            (
                "p2p_fallbacks_to_origin",
                "Reads that went to the registry after no peer served them",
                p.fallbacks_to_origin,
            ),
        ];
        for (name, help, value) in series {
            registry.register(name, help, counter(value));
        }
        if let Some(t) = &p.tls {
            let tls: [(&str, &str, u64); 3] = [
                (
                    "p2p_tls_handshake_failures",
                    "Peer server TLS handshakes that failed or timed out",
                    t.handshake_failures,
                ),
                (
                    "p2p_tls_reloads",
                    "Times the peer TLS files changed and were taken into use",
                    t.reloads,
                ),
                (
                    "p2p_tls_reload_failures",
                    "Changes of the peer TLS files refused (the files in use stayed)",
                    t.reload_failures,
                ),
            ];
            for (name, help, value) in tls {
                registry.register(name, help, counter(value));
            }
        }
        registry.register(
            "p2p_members",
            "Members the next read is scheduled with (this daemon included), from every source",
            gauge(p.members.len() as u64),
        );
        let g = &p.gossip;
        registry.register(
            "p2p_gossip_members",
            "Live members known through gossip (this daemon not counted)",
            gauge(g.members),
        );
        let gossip: [(&str, &str, u64); 4] = [
            (
                "p2p_gossip_datagrams_in",
                "Gossip datagrams received",
                g.datagrams_in,
            ),
            (
                "p2p_gossip_datagrams_out",
                "Gossip datagrams sent",
                g.datagrams_out,
            ),
            ("p2p_gossip_in_bytes", "Gossip bytes received", g.bytes_in),
            ("p2p_gossip_out_bytes", "Gossip bytes sent", g.bytes_out),
        ];
        for (name, help, value) in gossip {
            registry.register(name, help, counter(value));
        }
        let dropped = Family::<Vec<(String, String)>, Counter<u64>>::default();
        for (reason, n) in [
            ("oversized", g.dropped_oversized),
            ("unauthenticated", g.dropped_unauthenticated),
            ("stale", g.dropped_stale),
            ("replayed", g.dropped_replayed),
            ("malformed", g.dropped_malformed),
            ("member_cap", g.dropped_member_cap),
            ("refused", g.dropped_refused),
        ] {
            dropped
                .get_or_create(&vec![("reason".to_owned(), reason.to_owned())])
                .inc_by(n);
        }
        registry.register(
            "p2p_gossip_dropped",
            "Gossip datagrams dropped, by reason",
            dropped,
        );
    }
    if let Some(log) = backend.fallbacks() {
        let totals = log.totals();
        let not_lazy = Family::<ReasonLabels, Counter<u64>>::default();
        // Every reason, zero or not, so a rate over it never starts from a missing series.
        for reason in ferry_snapshotter::NotLazyReason::ALL {
            not_lazy
                .get_or_create(&ReasonLabels {
                    reason: reason.name(),
                })
                .inc_by(totals.get(&reason).copied().unwrap_or(0));
        }
        registry.register(
            "not_lazy_layers",
            "Layers the snapshotter did not serve lazily (downloaded and unpacked the ordinary way), by reason",
            not_lazy,
        );
    }
    if let Some(store) = backend.store_status() {
        registry.register(
            "store_bytes",
            "Bytes in the chunk store",
            gauge(store.bytes),
        );
        registry.register(
            "store_max_bytes",
            "The chunk store's bound",
            gauge(store.max_bytes),
        );
        registry.register(
            "store_entries",
            "Entries in the chunk store",
            gauge(store.entries),
        );
        if let Some(seed) = &store.seed {
            registry.register(
                "store_seed_objects",
                "Objects in the read-only seed store",
                gauge(seed.objects),
            );
            registry.register(
                "store_seed_bytes",
                "Bytes of the objects in the read-only seed store",
                gauge(seed.bytes),
            );
            registry.register(
                "store_seed_hits",
                "Reads the live store could not serve and the seed store did",
                counter(seed.hits),
            );
            registry.register(
                "store_seed_served_bytes",
                "Bytes of the seed objects served",
                counter(seed.bytes_served),
            );
            registry.register(
                "store_seed_misses",
                "Reads that reached the seed store and were not served (absent or bad)",
                counter(seed.misses),
            );
            registry.register(
                "store_seed_corrupt",
                "Seed objects found missing, damaged or unreadable (served as misses, fetched)",
                counter(seed.corrupt),
            );
            registry.register(
                "store_seed_verified",
                "Seed objects hashed against their key and found good",
                counter(seed.verified),
            );
        }
    }
    if let Some(files) = backend.file_cache_status() {
        registry.register(
            "file_cache_files",
            "Files in the file cache",
            gauge(files.files),
        );
        registry.register(
            "file_cache_bytes",
            "Bytes in the file cache",
            gauge(files.bytes),
        );
        registry.register(
            "file_cache_passthrough_opens",
            "Opens served by FUSE passthrough from the file cache",
            counter(files.passthrough_opens),
        );
        registry.register(
            "file_pack_files",
            "Small files in the small-file pack",
            gauge(files.pack_files),
        );
        registry.register(
            "file_pack_bytes",
            "Bytes in the small-file pack",
            gauge(files.pack_bytes),
        );
        registry.register(
            "file_pack_reads",
            "Reads served from the small-file pack",
            counter(files.pack_hits),
        );
    }
    if let Some(c) = cri {
        registry.register(
            "cri_forwarded_calls",
            "CRI calls the image-service proxy forwarded to the container runtime",
            counter(c.forwarded),
        );
        registry.register(
            "cri_credentials_kept",
            "PullImage calls whose credentials the proxy kept for lazy reads",
            counter(c.credentials_kept),
        );
        registry.register(
            "cri_runtime_unreachable",
            "CRI calls answered UNAVAILABLE because the container runtime could not be reached",
            counter(c.runtime_unreachable),
        );
        registry.register(
            "cri_repositories_with_credentials",
            "Repositories the daemon holds pull credentials for (in memory)",
            gauge(c.repositories_with_credentials as u64),
        );
    }
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .map_err(|e| Error::Control(format!("encoding metrics: {e}")))?;
    Ok(out)
}

type MetricsState = (Arc<dyn MountBackend>, Option<Arc<CriProxy>>);

async fn metrics(State((backend, cri)): State<MetricsState>) -> Response {
    let rendered = tokio::task::spawn_blocking(move || {
        let cri = cri.map(|c| c.status());
        render(backend.as_ref(), cri.as_ref())
    })
    .await;
    match rendered {
        Ok(Ok(text)) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Serves `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    backend: Arc<dyn MountBackend>,
    cri: Option<Arc<CriProxy>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state((backend, cri));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| Error::io("serving metrics", e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::memory::MemoryBackend;
    use crate::mounts::{LayerKind, MountOrigin, MountRequest};

    #[test]
    fn per_mount_series_carry_the_counters() {
        let backend = MemoryBackend::new();
        backend.add_image(
            "reg/app:v1",
            "sha256:m",
            &[("sha256:l", LayerKind::FerryIndex)],
        );
        backend
            .mount(
                &MountRequest {
                    image: "reg/app:v1".into(),
                    mountpoint: "/mnt/x".into(),
                    layer: Some("sha256:l".into()),
                },
                MountOrigin::Control,
            )
            .unwrap();
        backend.set_stats(
            Path::new("/mnt/x"),
            ferry_fs::StatsSnapshot {
                bytes_total: 1000,
                bytes_fetched: 123,
                cache_hits: 4,
                fetch_errors: 2,
                prefetch_done: true,
                guesses: ferry_fs::Guesses {
                    rest: ferry_fs::GuessBytes {
                        fetched: 70,
                        used: 50,
                    },
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        let text = render(&backend, None).unwrap();
        let labels = r#"{mountpoint="/mnt/x",image="reg/app:v1",layer="sha256:l"}"#;
        for line in [
            format!("ferry_mount_fetched_bytes_total{labels} 123"),
            format!("ferry_mount_total_bytes{labels} 1000"),
            format!("ferry_mount_cache_hits_total{labels} 4"),
            format!("ferry_mount_fetch_errors_total{labels} 2"),
            format!("ferry_mount_prefetch_done{labels} 1"),
            format!("ferry_mount_fill_done{labels} 0"),
            "ferry_mounts 1".to_owned(),
            r#"ferry_mount_guessed_bytes_total{mountpoint="/mnt/x",image="reg/app:v1",layer="sha256:l",guess="rest"} 70"#.to_owned(),
            r#"ferry_mount_guessed_used_bytes_total{mountpoint="/mnt/x",image="reg/app:v1",layer="sha256:l",guess="rest"} 50"#.to_owned(),
            r#"ferry_mount_guessed_bytes_total{mountpoint="/mnt/x",image="reg/app:v1",layer="sha256:l",guess="neighbours"} 0"#.to_owned(),
        ] {
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        backend.unmount(Path::new("/mnt/x")).unwrap();
        let text = render(&backend, None).unwrap();
        assert!(!text.contains("/mnt/x"));
        assert!(text.contains("ferry_mounts 0"));
    }

    #[test]
    fn the_seed_store_is_reported_only_when_there_is_one() {
        let backend = MemoryBackend::new();
        let mut store = crate::mounts::StoreStatus {
            path: "/var/lib/ferry/store".into(),
            entries: 2,
            bytes: 300,
            max_bytes: 1000,
            seed: None,
        };
        backend.set_store(Some(store.clone()));
        let text = render(&backend, None).unwrap();
        assert!(text.contains("ferry_store_entries 2"), "{text}");
        assert!(!text.contains("ferry_store_seed_"), "{text}");
        store.seed = Some(ferry_store::SeedStats {
            path: "/vol/seed".into(),
            objects: 40,
            bytes: 4000,
            images: 1,
            hits: 7,
            bytes_served: 700,
            misses: 3,
            corrupt: 1,
            verified: 6,
        });
        backend.set_store(Some(store));
        let text = render(&backend, None).unwrap();
        for line in [
            "ferry_store_seed_objects 40",
            "ferry_store_seed_bytes 4000",
            "ferry_store_seed_hits_total 7",
            "ferry_store_seed_served_bytes_total 700",
            "ferry_store_seed_misses_total 3",
            "ferry_store_seed_corrupt_total 1",
            "ferry_store_seed_verified_total 6",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn cri_proxy_counters_are_exported_when_it_runs() {
        let backend = MemoryBackend::new();
        assert!(!render(&backend, None).unwrap().contains("ferry_cri_"));
        let status = CriStatus {
            runtime_socket: "/run/containerd/containerd.sock".into(),
            forwarded: 12,
            credentials_kept: 3,
            runtime_unreachable: 1,
            repositories_with_credentials: 2,
        };
        let text = render(&backend, Some(&status)).unwrap();
        for line in [
            "ferry_cri_forwarded_calls_total 12",
            "ferry_cri_credentials_kept_total 3",
            "ferry_cri_runtime_unreachable_total 1",
            "ferry_cri_repositories_with_credentials 2",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn layers_not_served_lazily_are_counted_by_reason() {
        use ferry_snapshotter::{NotLazy, NotLazyReason};

        let backend = MemoryBackend::new();
        let text = render(&backend, None).unwrap();
        assert!(
            text.contains(r#"ferry_not_lazy_layers_total{reason="no-index"} 0"#),
            "{text}"
        );
        let log = backend.fallbacks().unwrap();
        for (image, reason) in [
            ("r/a:1", NotLazyReason::NoIndex),
            ("r/b:1", NotLazyReason::NoIndex),
            ("r/c:1", NotLazyReason::Unauthorized),
        ] {
            log.declined(
                Some(image),
                None,
                Some("sha256:l"),
                &NotLazy::new(reason, "x"),
            );
        }
        let text = render(&backend, None).unwrap();
        for line in [
            r#"ferry_not_lazy_layers_total{reason="no-index"} 2"#,
            r#"ferry_not_lazy_layers_total{reason="unauthorized"} 1"#,
            r#"ferry_not_lazy_layers_total{reason="unreachable"} 0"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
