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

#[test]
fn registry_trace_is_published_as_a_referrer_and_found_again() {
    use ferry_registry::server::Config;
    use ferry_registry::server::listener::Server;
    let rt = RangeRuntime::new().unwrap();
    let h = rt.handle();
    let config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        storage: ferry_registry::storage::StorageConfig::Memory,
        ..Config::default()
    };
    let server = h.block_on(Server::bind(&config)).unwrap();
    let addr = server.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = h.spawn(server.run(async {
        let _ = stop_rx.await;
    }));
    let client = Client::new(ClientConfig::default()).unwrap();
    let repo = Repo::new(addr.to_string(), "lib/app");
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
    let (subject, _) = ferry_fs::image::registry_manifest(&client, &repo, "v1", &rt).unwrap();
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
    let found = ferry_fs::image::find_trace(&image, &digest, &client, &rt).unwrap();
    assert_eq!(found, Some(sample()));
    let _ = stop_tx.send(());
    let _ = h.block_on(task);
}
