//! `ferry pull` tells a layer the snapshotter mounted lazily from one that was already
//! there, though both answer its Prepare with AlreadyExists: the real snapshotter
//! (ferry-snapshotter's gRPC service on a unix socket, with the in-memory lazy layers)
//! in place of containerd, whose Snapshots API it speaks.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use ferry_pull::containerd::Containerd;
use ferry_snapshotter::remote::{
    LABEL_FERRY_IMAGE_REF, LABEL_FERRY_LAYER_DIGEST, LABEL_TARGET, MemoryRemoteLayers,
};
use ferry_snapshotter::{Snapshotter, server};

const NS: &str = "ferry-test";
const SN: &str = "ferry";

fn labels(target: &str, layer: &str) -> HashMap<String, String> {
    [
        (LABEL_TARGET, target),
        (LABEL_FERRY_IMAGE_REF, "reg.local/app:v1"),
        (LABEL_FERRY_LAYER_DIGEST, layer),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_snapshot_committed_from_a_lazy_mount_counts_as_lazy() {
    let dir = tempfile::tempdir().unwrap();
    let remote = Arc::new(MemoryRemoteLayers::new());
    remote.add_layer(
        "sha256:lazy",
        vec![(PathBuf::from("bin/app"), b"app".to_vec())],
    );
    let snap = Arc::new(Snapshotter::open(&dir.path().join("root"), remote).unwrap());
    // A layer unpacked the ordinary way before (by another pull): committed, not lazy.
    snap.prepare(NS, "unpack", "", labels("chain-present", "sha256:plain"))
        .unwrap();
    snap.commit(NS, "chain-present", "unpack", HashMap::new())
        .unwrap();
    let socket = dir.path().join("snap.sock");
    let listener = server::bind(&socket).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = {
        let (snap, socket) = (snap.clone(), socket.clone());
        tokio::spawn(async move {
            server::serve(snap, listener, &socket, async {
                let _ = stopped.await;
            })
            .await
        })
    };

    let cd = Containerd::connect(&socket, NS).await.unwrap();
    // Both answer AlreadyExists…
    assert!(
        cd.prepare(SN, "probe-0", "", labels("chain-lazy", "sha256:lazy"))
            .await
            .unwrap()
    );
    assert!(
        cd.prepare(SN, "probe-1", "", labels("chain-present", "sha256:plain"))
            .await
            .unwrap()
    );
    // …but only one was mounted lazily.
    assert!(cd.snapshot_is_lazy(SN, "chain-lazy").await.unwrap());
    assert!(!cd.snapshot_is_lazy(SN, "chain-present").await.unwrap());
    assert!(!cd.snapshot_is_lazy(SN, "no-such-chain").await.unwrap());

    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
}
