//! Tests across the lazy filesystem and ferry's own registry: ferry-fs depends on the
//! registry client only, so what needs a real registry server in-process lives here,
//! in the one crate that depends on both.
#![allow(clippy::unwrap_used)]

use ferry_fs::{Trace, TraceRead};
use ferry_oci::media::OCI_MANIFEST;
use ferry_registry_client::{Client, ClientConfig, RangeRuntime, Repo};

fn read(path: &str, offset: u64, len: u64) -> TraceRead {
    TraceRead {
        path: path.into(),
        offset,
        len,
    }
}

fn sample() -> Trace {
    Trace {
        reads: vec![read("/bin/sh", 0, 4096), read("/etc/passwd", 0, 100)],
    }
}

/// ferry's registry with in-memory storage on 127.0.0.1, served on `rt`.
struct Registry {
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Registry {
    fn start(rt: &RangeRuntime) -> Registry {
        use ferry_registry::server::Config;
        use ferry_registry::server::listener::Server;
        let config = Config {
            addr: "127.0.0.1:0".parse().unwrap(),
            storage: ferry_registry::storage::StorageConfig::Memory,
            ..Config::default()
        };
        let h = rt.handle();
        let server = h.block_on(Server::bind(&config)).unwrap();
        let addr = server.local_addr().unwrap();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = h.spawn(async move {
            let _ = server
                .run(async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        Registry { addr, stop, task }
    }

    fn stop(self, rt: &RangeRuntime) {
        let _ = self.stop.send(());
        let _ = rt.handle().block_on(self.task);
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// Pushes `bytes` as a blob of `repo`; returns its digest.
fn push_blob(rt: &RangeRuntime, client: &Client, repo: &Repo, bytes: &[u8]) -> String {
    let digest = ferry_oci::sha256_digest(bytes).to_string();
    let owned = bytes.to_vec();
    let body = Box::pin(futures_util::stream::once(async { Ok(owned.into()) }));
    rt.handle()
        .block_on(client.push_blob(repo, &digest, bytes.len() as u64, body))
        .unwrap();
    digest
}

#[test]
fn range_source_reads_from_plain_threads() {
    use ferry_fs::backend::range_source::HttpRangeSource;
    use ferry_index::source::RangeSource;
    let rt = RangeRuntime::new().unwrap();
    let registry = Registry::start(&rt);
    let client = Client::new(ClientConfig::default()).unwrap();
    let repo = Repo::parse(registry.addr.to_string(), "team/app").unwrap();
    let data = pattern(100_000);
    let d = push_blob(&rt, &client, &repo, &data);
    let src = HttpRangeSource::open(client.clone(), repo.clone(), &d, &rt).unwrap();
    assert_eq!(src.len(), 100_000);
    assert_eq!(src.read_range(10..20).unwrap(), &data[10..20]);
    let ranges = vec![0..5, 100..1_100, 50_000..99_999, 99_999..100_000];
    let got = src.read_ranges(&ranges).unwrap();
    for (rg, bytes) in ranges.iter().zip(&got) {
        assert_eq!(bytes.as_slice(), &data[rg.start as usize..rg.end as usize]);
    }
    assert!(src.read_range(99_990..100_001).is_err());
    // A sibling blob of the same repository (how a layer reaches its index's windows).
    let other = pattern(3_000);
    let od = push_blob(&rt, &client, &repo, &other);
    let sib = src.sibling(&od, 3_000).unwrap();
    assert_eq!(sib.len(), 3_000);
    assert_eq!(sib.read_range(100..200).unwrap(), &other[100..200]);
    assert!(src.sibling("sha256:nothex", 1).is_none());
    // From inside an async task it refuses instead of blocking a worker.
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = src.clone();
    rt.handle().spawn(async move {
        let _ = tx.send(s2.read_range(0..1).is_err());
    });
    assert!(rx.recv().unwrap());
    registry.stop(&rt);
}

#[test]
fn registry_trace_is_published_as_a_referrer_and_found_again() {
    let rt = RangeRuntime::new().unwrap();
    let h = rt.handle();
    let registry = Registry::start(&rt);
    let addr = registry.addr;
    let client = Client::new(ClientConfig::default()).unwrap();
    let repo = Repo::parse(addr.to_string(), "lib/app").unwrap();
    // An image manifest to refer to (its blobs need not exist for this test).
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                   "digest": ferry_oci::sha256_digest(b"{}").to_string(), "size": 2},
        "layers": [],
    });
    let bytes = serde_json::to_vec(&manifest).unwrap();
    h.block_on(async {
        let d = ferry_oci::sha256_digest(b"{}").to_string();
        let body = Box::pin(futures_util::stream::once(async {
            Ok(b"{}".to_vec().into())
        }));
        client.push_blob(&repo, &d, 2, body).await.unwrap();
        client
            .put_manifest(&repo, "v1", OCI_MANIFEST, bytes.clone().into())
            .await
            .unwrap();
    });
    let (subject, _) = ferry_fs::backend::registry_manifest(&client, &repo, "v1", &rt).unwrap();
    assert_eq!(subject.size(), bytes.len() as u64);
    let digest = subject.digest().to_string();
    assert_eq!(
        ferry_fs::trace::find_registry_trace(&client, &repo, &digest, &rt).unwrap(),
        None
    );
    h.block_on(ferry_fs::trace::publish_registry_trace(
        &client,
        &repo,
        &subject,
        &sample(),
    ))
    .unwrap();
    assert_eq!(
        ferry_fs::trace::find_registry_trace(&client, &repo, &digest, &rt).unwrap(),
        Some(sample())
    );
    let image = format!("{addr}/lib/app:v1");
    let found = ferry_fs::backend::find_trace(&image, &digest, &client, &rt).unwrap();
    assert_eq!(found, Some(sample()));
    registry.stop(&rt);
}

/// The lazy filesystem's manifest lookup takes this machine's platform from an index and
/// never falls back to the first entry (that would mount another architecture): an
/// index without it is an error naming what it has.
#[test]
fn registry_manifest_chooses_this_platform_or_names_what_the_index_has() {
    use ferry_oci::media::OCI_INDEX;
    let rt = RangeRuntime::new().unwrap();
    let h = rt.handle();
    let registry = Registry::start(&rt);
    let client = Client::new(ClientConfig::default()).unwrap();
    let repo = Repo::parse(registry.addr.to_string(), "lib/multi").unwrap();
    let host = ferry_oci::Platform::host();
    let other = if host.architecture() == "s390x" {
        "riscv64"
    } else {
        "s390x"
    };
    // One manifest per platform, told apart by an annotation; their blobs need not exist.
    let push = |name: &str| {
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                       "digest": ferry_oci::sha256_digest(b"{}").to_string(), "size": 2},
            "layers": [],
            "annotations": {"which": name},
        });
        let bytes = serde_json::to_vec(&manifest).unwrap();
        let digest = ferry_oci::sha256_digest(&bytes).to_string();
        h.block_on(client.put_manifest(&repo, &digest, OCI_MANIFEST, bytes.clone().into()))
            .unwrap();
        (digest, bytes.len())
    };
    let d = ferry_oci::sha256_digest(b"{}").to_string();
    let body = Box::pin(futures_util::stream::once(async {
        Ok(b"{}".to_vec().into())
    }));
    h.block_on(client.push_blob(&repo, &d, 2, body)).unwrap();
    let (other_digest, other_size) = push("other");
    let (host_digest, host_size) = push("host");
    let entry = |digest: &str, size: usize, arch: &str, variant: Option<&str>| {
        let mut p = serde_json::json!({"os": "linux", "architecture": arch});
        if let Some(v) = variant {
            p["variant"] = serde_json::json!(v);
        }
        serde_json::json!({"mediaType": OCI_MANIFEST, "digest": digest, "size": size, "platform": p})
    };
    let put_index = |tag: &str, entries: Vec<serde_json::Value>| {
        let index =
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries});
        h.block_on(client.put_manifest(
            &repo,
            tag,
            OCI_INDEX,
            serde_json::to_vec(&index).unwrap().into(),
        ))
        .unwrap();
    };
    // The other platform first: a first-entry fallback would pick it.
    put_index(
        "both",
        vec![
            entry(&other_digest, other_size, other, None),
            entry(&host_digest, host_size, host.architecture(), host.variant()),
        ],
    );
    put_index(
        "foreign",
        vec![entry(&other_digest, other_size, other, None)],
    );
    let (chosen, _) = ferry_fs::backend::registry_manifest(&client, &repo, "both", &rt).unwrap();
    assert_eq!(chosen.digest().to_string(), host_digest);
    let err = ferry_fs::backend::registry_manifest(&client, &repo, "foreign", &rt)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&format!(
            "no manifest for {host} in the index; it has linux/{other}"
        )),
        "{err}"
    );
    registry.stop(&rt);
}
