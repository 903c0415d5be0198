//! The Snapshots gRPC service driven through its trait (no root, no containerd): the
//! lifecycle, mount strings, errors and their codes, filters, labels, namespaces,
//! restarts, the remote-snapshot AlreadyExists protocol and Cleanup; plus one round trip
//! over a real unix socket with containerd's own client stubs.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use containerd_client::services::v1::snapshots::{
    self as pb, CleanupRequest, CommitSnapshotRequest, ListSnapshotsRequest, MountsRequest,
    PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest, UpdateSnapshotRequest,
    UsageRequest, ViewSnapshotRequest,
};
use containerd_client::types::Mount as PbMount;
use ferry_snapshotter::proto::snapshots_server::Snapshots;
use ferry_snapshotter::remote::{
    LABEL_CRI_IMAGE_LAYERS, LABEL_CRI_IMAGE_REF, LABEL_CRI_LAYER_DIGEST, LABEL_FERRY_LAYER_DIGEST,
    LABEL_FERRY_REMOTE, LABEL_TARGET, MemoryRemoteLayers,
};
use ferry_snapshotter::service::SnapshotService;
use ferry_snapshotter::{NoRemoteLayers, RemoteLayers, Snapshotter};
use tokio_stream::StreamExt;
use tonic::{Code, Request, Status};

const NS: &str = "ferry-test";

fn req<T>(ns: &str, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("containerd-namespace", ns.parse().unwrap());
    r
}

fn open(root: &Path, remote: Arc<dyn RemoteLayers>) -> SnapshotService {
    SnapshotService::new(Arc::new(Snapshotter::open(root, remote).unwrap()))
}

fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn fs(root: &Path, id: u64) -> String {
    root.join("snapshots")
        .join(id.to_string())
        .join("fs")
        .display()
        .to_string()
}

fn work(root: &Path, id: u64) -> String {
    root.join("snapshots")
        .join(id.to_string())
        .join("work")
        .display()
        .to_string()
}

fn mount(fs_type: &str, source: &str, options: &[String]) -> PbMount {
    PbMount {
        r#type: fs_type.to_owned(),
        source: source.to_owned(),
        target: String::new(),
        options: options.to_vec(),
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

async fn prepare(
    svc: &SnapshotService,
    ns: &str,
    key: &str,
    parent: &str,
    l: HashMap<String, String>,
) -> Result<Vec<PbMount>, Status> {
    let r = PrepareSnapshotRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
        parent: parent.into(),
        labels: l,
    };
    Ok(svc.prepare(req(ns, r)).await?.into_inner().mounts)
}

async fn view(
    svc: &SnapshotService,
    ns: &str,
    key: &str,
    parent: &str,
) -> Result<Vec<PbMount>, Status> {
    let r = ViewSnapshotRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
        parent: parent.into(),
        labels: HashMap::new(),
    };
    Ok(svc.view(req(ns, r)).await?.into_inner().mounts)
}

async fn commit(svc: &SnapshotService, ns: &str, name: &str, key: &str) -> Result<(), Status> {
    let r = CommitSnapshotRequest {
        snapshotter: "ferry".into(),
        name: name.into(),
        key: key.into(),
        labels: labels(&[("committed-by", "test")]),
    };
    svc.commit(req(ns, r)).await.map(|_| ())
}

async fn remove(svc: &SnapshotService, ns: &str, key: &str) -> Result<(), Status> {
    let r = RemoveSnapshotRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
    };
    svc.remove(req(ns, r)).await.map(|_| ())
}

async fn stat(svc: &SnapshotService, ns: &str, key: &str) -> Result<pb::Info, Status> {
    let r = StatSnapshotRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
    };
    Ok(svc.stat(req(ns, r)).await?.into_inner().info.unwrap())
}

async fn mounts(svc: &SnapshotService, ns: &str, key: &str) -> Result<Vec<PbMount>, Status> {
    let r = MountsRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
    };
    Ok(svc.mounts(req(ns, r)).await?.into_inner().mounts)
}

async fn list(svc: &SnapshotService, ns: &str, filters: &[&str]) -> Result<Vec<String>, Status> {
    let r = ListSnapshotsRequest {
        snapshotter: "ferry".into(),
        filters: strings(filters),
    };
    let mut stream = svc.list(req(ns, r)).await?.into_inner();
    let mut names = Vec::new();
    while let Some(batch) = stream.next().await {
        names.extend(batch?.info.into_iter().map(|i| i.name));
    }
    names.sort();
    Ok(names)
}

async fn usage(svc: &SnapshotService, ns: &str, key: &str) -> Result<(i64, i64), Status> {
    let r = UsageRequest {
        snapshotter: "ferry".into(),
        key: key.into(),
    };
    let u = svc.usage(req(ns, r)).await?.into_inner();
    Ok((u.size, u.inodes))
}

fn code<T: std::fmt::Debug>(r: Result<T, Status>) -> Code {
    r.unwrap_err().code()
}

#[tokio::test]
async fn lifecycle_mounts_and_parent_chain() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let svc = open(root, Arc::new(NoRemoteLayers));

    // A first layer: active, no parent → a writable bind mount of its own dir.
    let m = prepare(&svc, NS, "extract-1", "", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        m,
        vec![mount("bind", &fs(root, 1), &strings(&["rw", "rbind"]))]
    );
    std::fs::write(Path::new(&fs(root, 1)).join("base.txt"), b"base").unwrap();
    commit(&svc, NS, "layer1", "extract-1").await.unwrap();
    assert_eq!(code(stat(&svc, NS, "extract-1").await), Code::NotFound);
    let info = stat(&svc, NS, "layer1").await.unwrap();
    assert_eq!(info.kind, pb::Kind::Committed as i32);
    assert_eq!(info.parent, "");
    assert_eq!(info.labels, labels(&[("committed-by", "test")]));

    // Second layer on top: overlay with upper/work and one lowerdir.
    let m = prepare(&svc, NS, "extract-2", "layer1", HashMap::new())
        .await
        .unwrap();
    let want = mount(
        "overlay",
        "overlay",
        &[
            format!("workdir={}", work(root, 2)),
            format!("upperdir={}", fs(root, 2)),
            format!("lowerdir={}", fs(root, 1)),
        ],
    );
    assert_eq!(m, vec![want.clone()]);
    assert_eq!(mounts(&svc, NS, "extract-2").await.unwrap(), vec![want]);
    commit(&svc, NS, "layer2", "extract-2").await.unwrap();
    assert_eq!(stat(&svc, NS, "layer2").await.unwrap().parent, "layer1");

    // A container on top of both: lowerdirs newest first.
    let m = prepare(&svc, NS, "container", "layer2", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        m,
        vec![mount(
            "overlay",
            "overlay",
            &[
                format!("workdir={}", work(root, 3)),
                format!("upperdir={}", fs(root, 3)),
                format!("lowerdir={}:{}", fs(root, 2), fs(root, 1)),
            ],
        )]
    );
    assert_eq!(
        stat(&svc, NS, "container").await.unwrap().kind,
        pb::Kind::Active as i32
    );

    // Views: several layers → read-only overlay; one layer → ro bind; none → ro bind of
    // its own empty dir. Binds of views say nosuid,nodev (a remount to ro keeps them).
    let m = view(&svc, NS, "view-2", "layer2").await.unwrap();
    assert_eq!(
        m,
        vec![mount(
            "overlay",
            "overlay",
            &[format!("lowerdir={}:{}", fs(root, 2), fs(root, 1))]
        )]
    );
    let m = view(&svc, NS, "view-1", "layer1").await.unwrap();
    assert_eq!(
        m,
        vec![mount(
            "bind",
            &fs(root, 1),
            &strings(&["ro", "rbind", "nosuid", "nodev"])
        )]
    );
    let m = view(&svc, NS, "view-0", "").await.unwrap();
    assert_eq!(
        m,
        vec![mount(
            "bind",
            &fs(root, 6),
            &strings(&["ro", "rbind", "nosuid", "nodev"])
        )]
    );
    assert_eq!(
        stat(&svc, NS, "view-0").await.unwrap().kind,
        pb::Kind::View as i32
    );

    // Committed snapshots have no mounts; parents cannot be removed.
    assert_eq!(
        code(mounts(&svc, NS, "layer1").await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(remove(&svc, NS, "layer1").await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(remove(&svc, NS, "layer2").await),
        Code::FailedPrecondition
    );

    // Tear down top-down; directories go with their snapshots.
    for key in ["container", "view-2", "view-1", "view-0", "layer2"] {
        remove(&svc, NS, key).await.unwrap();
    }
    assert!(!Path::new(&fs(root, 3)).exists());
    assert!(Path::new(&fs(root, 1)).join("base.txt").exists());
    remove(&svc, NS, "layer1").await.unwrap();
    assert!(!root.join("snapshots/1").exists());
    assert_eq!(list(&svc, NS, &[]).await.unwrap(), Vec::<String>::new());
    assert_eq!(code(remove(&svc, NS, "layer1").await), Code::NotFound);
}

#[tokio::test]
async fn errors_have_containerd_codes() {
    let dir = tempfile::tempdir().unwrap();
    let svc = open(dir.path(), Arc::new(NoRemoteLayers));
    prepare(&svc, NS, "a", "", HashMap::new()).await.unwrap();
    assert_eq!(
        code(prepare(&svc, NS, "a", "", HashMap::new()).await),
        Code::AlreadyExists
    );
    assert_eq!(
        code(prepare(&svc, NS, "", "", HashMap::new()).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(prepare(&svc, NS, "b", "missing", HashMap::new()).await),
        Code::NotFound
    );
    // Parents must be committed.
    assert_eq!(
        code(prepare(&svc, NS, "b", "a", HashMap::new()).await),
        Code::InvalidArgument
    );
    assert_eq!(code(stat(&svc, NS, "nope").await), Code::NotFound);
    assert_eq!(code(mounts(&svc, NS, "nope").await), Code::NotFound);
    assert_eq!(code(usage(&svc, NS, "nope").await), Code::NotFound);
    assert_eq!(code(commit(&svc, NS, "x", "nope").await), Code::NotFound);
    commit(&svc, NS, "layer", "a").await.unwrap();
    prepare(&svc, NS, "c", "layer", HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        code(commit(&svc, NS, "layer", "c").await),
        Code::AlreadyExists
    );
    view(&svc, NS, "v", "layer").await.unwrap();
    assert_eq!(
        code(commit(&svc, NS, "v-committed", "v").await),
        Code::FailedPrecondition
    );
    // A label over 4 KiB, a bad namespace.
    let big = labels(&[("k", &"v".repeat(5000))]);
    assert_eq!(
        code(prepare(&svc, NS, "big", "", big).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(prepare(&svc, "bad..ns", "z", "", HashMap::new()).await),
        Code::InvalidArgument
    );
    // Nothing half-made was left behind by the refusals.
    assert_eq!(
        list(&svc, NS, &[]).await.unwrap(),
        strings(&["c", "layer", "v"])
    );
}

#[tokio::test]
async fn walk_filters() {
    let dir = tempfile::tempdir().unwrap();
    let svc = open(dir.path(), Arc::new(NoRemoteLayers));
    prepare(
        &svc,
        NS,
        "a",
        "",
        labels(&[("containerd.io/gc.root", "yes")]),
    )
    .await
    .unwrap();
    commit(&svc, NS, "base", "a").await.unwrap();
    prepare(&svc, NS, "ctr", "base", labels(&[("team", "infra")]))
        .await
        .unwrap();
    view(&svc, NS, "ro", "base").await.unwrap();

    assert_eq!(
        list(&svc, NS, &[]).await.unwrap(),
        strings(&["base", "ctr", "ro"])
    );
    assert_eq!(
        list(&svc, NS, &["kind==committed"]).await.unwrap(),
        strings(&["base"])
    );
    assert_eq!(
        list(&svc, NS, &["kind==active"]).await.unwrap(),
        strings(&["ctr"])
    );
    assert_eq!(
        list(&svc, NS, &["parent==base"]).await.unwrap(),
        strings(&["ctr", "ro"])
    );
    assert_eq!(
        list(&svc, NS, &["name==ro"]).await.unwrap(),
        strings(&["ro"])
    );
    assert_eq!(
        list(&svc, NS, &["labels.team==infra"]).await.unwrap(),
        strings(&["ctr"])
    );
    assert_eq!(
        list(&svc, NS, &[r#"labels."committed-by"==test"#])
            .await
            .unwrap(),
        strings(&["base"])
    );
    assert_eq!(
        list(&svc, NS, &["parent==base,kind==view"]).await.unwrap(),
        strings(&["ro"])
    );
    assert_eq!(
        list(&svc, NS, &["name==ro", "name==ctr"]).await.unwrap(),
        strings(&["ctr", "ro"])
    );
    assert_eq!(
        list(&svc, NS, &["labels.team"]).await.unwrap(),
        strings(&["ctr"])
    );
    assert_eq!(
        code(list(&svc, NS, &["labels.team=infra"]).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(list(&svc, NS, &["size==3"]).await),
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn update_field_paths() {
    let dir = tempfile::tempdir().unwrap();
    let svc = open(dir.path(), Arc::new(NoRemoteLayers));
    prepare(&svc, NS, "a", "", labels(&[("keep", "1"), ("drop", "2")]))
        .await
        .unwrap();
    let before = stat(&svc, NS, "a").await.unwrap();
    let update = |l: HashMap<String, String>, paths: &[&str]| UpdateSnapshotRequest {
        snapshotter: "ferry".into(),
        info: Some(pb::Info {
            name: "a".into(),
            labels: l,
            ..Default::default()
        }),
        update_mask: Some(prost_types::FieldMask {
            paths: strings(paths),
        }),
    };

    // labels.KEY sets one label and deletes one absent from the request.
    let r = update(
        labels(&[("new", "3"), ("keep", "ignored")]),
        &["labels.new", "labels.drop"],
    );
    let info = svc
        .update(req(NS, r))
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(info.labels, labels(&[("keep", "1"), ("new", "3")]));
    assert_eq!(stat(&svc, NS, "a").await.unwrap().labels, info.labels);
    assert!(info.updated_at.unwrap().seconds >= before.updated_at.unwrap().seconds);
    assert_eq!(info.created_at, before.created_at);

    // "labels" replaces them all; no paths does the same.
    let r = update(labels(&[("only", "x")]), &["labels"]);
    let info = svc
        .update(req(NS, r))
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(info.labels, labels(&[("only", "x")]));
    let r = update(labels(&[("other", "y")]), &[]);
    let info = svc
        .update(req(NS, r))
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(info.labels, labels(&[("other", "y")]));

    // Other fields are not updatable; unknown snapshots are NotFound.
    let r = update(HashMap::new(), &["parent"]);
    assert_eq!(code(svc.update(req(NS, r)).await), Code::InvalidArgument);
    let mut r = update(HashMap::new(), &["labels"]);
    r.info.as_mut().unwrap().name = "missing".into();
    assert_eq!(code(svc.update(req(NS, r)).await), Code::NotFound);
    assert_eq!(
        stat(&svc, NS, "a").await.unwrap().labels,
        labels(&[("other", "y")])
    );
}

/// A request without containerd's namespace header, as containerd's garbage collector
/// sends its List and Remove.
fn no_ns<T>(msg: T) -> Request<T> {
    Request::new(msg)
}

/// containerd 2.x sends the caller's namespace with a client's Prepare and Commit (1.6
/// with its CRI plugin's) but none with its garbage collector's List and Remove, and the
/// keys it sends are unique across namespaces already. So the header scopes nothing:
/// what a request with one namespace made, a request with another or none sees and
/// removes.
#[tokio::test]
async fn the_namespace_header_does_not_scope_keys() {
    let dir = tempfile::tempdir().unwrap();
    let svc = open(dir.path(), Arc::new(NoRemoteLayers));
    let (layer, ctr) = ("k8s.io/2/sha256:aa", "k8s.io/3/ctr");
    prepare(&svc, "k8s.io", "k8s.io/1/extract", "", HashMap::new())
        .await
        .unwrap();
    commit(&svc, "k8s.io", layer, "k8s.io/1/extract")
        .await
        .unwrap();
    prepare(&svc, "k8s.io", ctr, layer, HashMap::new())
        .await
        .unwrap();
    // The collector's walk: no header, every snapshot.
    let r = ListSnapshotsRequest {
        snapshotter: "ferry".into(),
        filters: Vec::new(),
    };
    let mut stream = svc.list(no_ns(r)).await.unwrap().into_inner();
    let mut names = Vec::new();
    while let Some(batch) = stream.next().await {
        names.extend(batch.unwrap().info.into_iter().map(|i| i.name));
    }
    names.sort();
    assert_eq!(names, strings(&[layer, ctr]));
    // Its removal: no header.
    let r = RemoveSnapshotRequest {
        snapshotter: "ferry".into(),
        key: ctr.into(),
    };
    svc.remove(no_ns(r)).await.unwrap();
    assert_eq!(list(&svc, "k8s.io", &[]).await.unwrap(), strings(&[layer]));
    // Another namespace's request reaches the same snapshot, and cannot make a second
    // one of the same key.
    assert_eq!(stat(&svc, "other", layer).await.unwrap().name, layer);
    assert_eq!(
        code(prepare(&svc, "other", layer, "", HashMap::new()).await),
        Code::AlreadyExists
    );
    remove(&svc, "other", layer).await.unwrap();
    assert!(list(&svc, "k8s.io", &[]).await.unwrap().is_empty());
}

/// Records an older ferry filed under each request's namespace are merged into the one
/// key space when the service starts; a key the space already holds is left alone.
#[tokio::test]
async fn records_kept_per_namespace_are_merged_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    {
        let snap = Snapshotter::open(root, Arc::new(NoRemoteLayers)).unwrap();
        snap.prepare("k8s.io", "k8s.io/1/extract", "", HashMap::new())
            .unwrap();
        snap.commit(
            "k8s.io",
            "k8s.io/2/layer",
            "k8s.io/1/extract",
            HashMap::new(),
        )
        .unwrap();
        snap.prepare("k8s.io", "k8s.io/3/ctr", "k8s.io/2/layer", HashMap::new())
            .unwrap();
        snap.prepare("default", "clash", "", HashMap::new())
            .unwrap();
        snap.prepare("other", "clash", "", HashMap::new()).unwrap();
    }
    let svc = open(root, Arc::new(NoRemoteLayers));
    assert_eq!(
        list(&svc, NS, &[]).await.unwrap(),
        strings(&["clash", "k8s.io/2/layer", "k8s.io/3/ctr"])
    );
    // The merged container snapshot still stacks on its merged parent's directory.
    let m = mounts(&svc, NS, "k8s.io/3/ctr").await.unwrap();
    assert_eq!(m[0].options[2], format!("lowerdir={}", fs(root, 1)));
    // The clashing record kept its place (the one in the key space is id 3).
    assert_eq!(
        mounts(&svc, NS, "clash").await.unwrap()[0].source,
        fs(root, 3)
    );
    drop(svc);
    let snap = Snapshotter::open(root, Arc::new(NoRemoteLayers)).unwrap();
    assert!(snap.stat("other", "clash").is_ok());
    assert_eq!(snap.merge_namespaces("default").unwrap(), 0);
}

#[tokio::test]
async fn restart_keeps_metadata_and_ids() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    {
        let svc = open(root, Arc::new(NoRemoteLayers));
        prepare(&svc, NS, "a", "", labels(&[("l", "v")]))
            .await
            .unwrap();
        commit(&svc, NS, "base", "a").await.unwrap();
        prepare(&svc, NS, "ctr", "base", HashMap::new())
            .await
            .unwrap();
    }
    let svc = open(root, Arc::new(NoRemoteLayers));
    assert_eq!(
        list(&svc, NS, &[]).await.unwrap(),
        strings(&["base", "ctr"])
    );
    assert_eq!(
        stat(&svc, NS, "base").await.unwrap().labels,
        labels(&[("committed-by", "test")])
    );
    let m = mounts(&svc, NS, "ctr").await.unwrap();
    assert_eq!(m[0].options[2], format!("lowerdir={}", fs(root, 1)));
    // New snapshots get fresh directories.
    let m = prepare(&svc, NS, "ctr2", "base", HashMap::new())
        .await
        .unwrap();
    assert_eq!(m[0].options[1], format!("upperdir={}", fs(root, 3)));
}

#[tokio::test]
async fn usage_counts_real_disk_use() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let svc = open(root, Arc::new(NoRemoteLayers));
    prepare(&svc, NS, "a", "", HashMap::new()).await.unwrap();
    assert_eq!(usage(&svc, NS, "a").await.unwrap().1, 1);
    let upper = PathBuf::from(fs(root, 1));
    std::fs::write(upper.join("f"), vec![1u8; 100_000]).unwrap();
    std::fs::hard_link(upper.join("f"), upper.join("g")).unwrap();
    let (size, inodes) = usage(&svc, NS, "a").await.unwrap();
    assert_eq!(inodes, 2);
    assert!((100_000..200_000).contains(&size), "size {size}");
    // Committed: measured at commit, unchanged by later writes into the directory.
    commit(&svc, NS, "layer", "a").await.unwrap();
    assert_eq!(usage(&svc, NS, "layer").await.unwrap(), (size, inodes));
}

fn remote_labels(target: &str, digest: &str) -> HashMap<String, String> {
    labels(&[
        (LABEL_TARGET, target),
        (LABEL_CRI_IMAGE_REF, "registry.test/app:1"),
        (LABEL_CRI_LAYER_DIGEST, digest),
        (LABEL_CRI_IMAGE_LAYERS, &format!("{digest},sha256:next")),
    ])
}

#[tokio::test]
async fn remote_layer_already_exists_protocol() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let remote = Arc::new(MemoryRemoteLayers::new());
    remote.add_layer(
        "sha256:lazy",
        vec![(PathBuf::from("bin/app"), b"#!/bin/true\n".to_vec())],
    );
    remote.fail_layer(
        "sha256:broken",
        ferry_snapshotter::NotLazyReason::Unreachable,
        "registry unreachable",
    );
    let svc = open(root, remote.clone());

    // The lazy layer: committed under the target, answered with AlreadyExists.
    let err = prepare(
        &svc,
        NS,
        "extract-1 chain1",
        "",
        remote_labels("chain1", "sha256:lazy"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let info = stat(&svc, NS, "chain1").await.unwrap();
    assert_eq!(info.kind, pb::Kind::Committed as i32);
    assert_eq!(
        info.labels.get(LABEL_FERRY_REMOTE).map(String::as_str),
        Some("memory")
    );
    assert_eq!(
        info.labels.get(LABEL_TARGET).map(String::as_str),
        Some("chain1")
    );
    assert_eq!(
        code(stat(&svc, NS, "extract-1 chain1").await),
        Code::NotFound
    );
    assert_eq!(
        std::fs::read(Path::new(&fs(root, 1)).join("bin/app")).unwrap(),
        b"#!/bin/true\n"
    );
    assert_eq!(usage(&svc, NS, "chain1").await.unwrap(), (12, 1));
    let seen = remote.prepared();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].target, "chain1");
    assert_eq!(seen[0].image_ref.as_deref(), Some("registry.test/app:1"));
    assert_eq!(
        seen[0].image_layers,
        strings(&["sha256:lazy", "sha256:next"])
    );

    // Preparing the same target again: AlreadyExists without asking the hook.
    let err = prepare(
        &svc,
        NS,
        "extract-2 chain1",
        "",
        remote_labels("chain1", "sha256:lazy"),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(remote.prepared().len(), 1);

    // A layer the hook does not know, on top of the lazy one: the ordinary path.
    let mut l = remote_labels("chain2", "sha256:unknown");
    l.insert(LABEL_FERRY_LAYER_DIGEST.into(), "sha256:unknown".into());
    let m = prepare(&svc, NS, "extract-3 chain2", "chain1", l)
        .await
        .unwrap();
    assert_eq!(m[0].r#type, "overlay");
    assert_eq!(m[0].options[2], format!("lowerdir={}", fs(root, 1)));
    assert_eq!(
        stat(&svc, NS, "extract-3 chain2").await.unwrap().kind,
        pb::Kind::Active as i32
    );

    // A failing hook falls back too, with an empty upper dir.
    let m = prepare(
        &svc,
        NS,
        "extract-4 chain3",
        "",
        remote_labels("chain3", "sha256:broken"),
    )
    .await
    .unwrap();
    assert_eq!(
        m,
        vec![mount("bind", &fs(root, 3), &strings(&["rw", "rbind"]))]
    );
    assert_eq!(std::fs::read_dir(fs(root, 3)).unwrap().count(), 0);

    // A read-only view of the lazy layer alone is a bind mount of the lazy mount itself:
    // it must say ro,nosuid,nodev, since the runtime's ro remount of a bind mount keeps
    // only the flags it is given (issue 11).
    let m = view(&svc, NS, "view-lazy", "chain1").await.unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(
        (m[0].r#type.as_str(), m[0].source.as_str()),
        ("bind", fs(root, 1).as_str())
    );
    for flag in ["ro", "nosuid", "nodev"] {
        assert!(
            m[0].options.iter().any(|o| o == flag),
            "{flag}: {:?}",
            m[0].options
        );
    }
    assert!(
        !m[0]
            .options
            .iter()
            .any(|o| o == "rw" || o == "suid" || o == "dev")
    );
    remove(&svc, NS, "view-lazy").await.unwrap();

    // Restart restores the lazy mount; Remove releases it.
    drop(svc);
    let svc = open(root, remote.clone());
    assert_eq!(remote.restored(), strings(&["sha256:lazy"]));
    remove(&svc, NS, "extract-3 chain2").await.unwrap();
    remove(&svc, NS, "chain1").await.unwrap();
    assert_eq!(remote.released(), strings(&["sha256:lazy"]));
    assert!(!root.join("snapshots/1").exists());
}

#[tokio::test]
async fn cleanup_removes_only_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let svc = open(root, Arc::new(NoRemoteLayers));
    prepare(&svc, NS, "a", "", HashMap::new()).await.unwrap();
    commit(&svc, NS, "base", "a").await.unwrap();
    prepare(&svc, NS, "ctr", "base", HashMap::new())
        .await
        .unwrap();
    // What a crash between mkdir and the metadata commit leaves, and junk.
    std::fs::create_dir_all(root.join("snapshots/77/fs/etc")).unwrap();
    std::fs::write(root.join("snapshots/77/fs/etc/passwd"), b"x").unwrap();
    std::fs::create_dir_all(root.join("snapshots/not-an-id")).unwrap();
    let r = Request::new(CleanupRequest {
        snapshotter: "ferry".into(),
    });
    svc.cleanup(r).await.unwrap();
    assert!(!root.join("snapshots/77").exists());
    assert!(!root.join("snapshots/not-an-id").exists());
    assert!(root.join("snapshots/1/fs").exists());
    assert!(root.join("snapshots/2/work").exists());
    assert_eq!(
        list(&svc, NS, &[]).await.unwrap(),
        strings(&["base", "ctr"])
    );
}

#[tokio::test]
async fn a_fresh_id_reuses_no_orphan_content() {
    // A crash after mkdir but before the metadata commit leaves snapshots/<next id>; the
    // next Prepare must not hand that content out as a fresh upper dir.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let svc = open(root, Arc::new(NoRemoteLayers));
    std::fs::create_dir_all(root.join("snapshots/1/fs")).unwrap();
    std::fs::write(root.join("snapshots/1/fs/stale"), b"x").unwrap();
    prepare(&svc, NS, "a", "", HashMap::new()).await.unwrap();
    assert_eq!(std::fs::read_dir(fs(root, 1)).unwrap().count(), 0);
}

#[tokio::test]
async fn round_trip_over_unix_socket_with_containerd_stubs() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/snap.sock");
    let snapshotter =
        Arc::new(Snapshotter::open(&dir.path().join("root"), Arc::new(NoRemoteLayers)).unwrap());
    let listener = ferry_snapshotter::server::bind(&socket).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server_socket = socket.clone();
    let server = tokio::spawn(async move {
        ferry_snapshotter::server::serve(snapshotter, listener, &server_socket, async {
            let _ = stopped.await;
        })
        .await
    });
    // A second server on a live socket is refused.
    assert!(ferry_snapshotter::server::bind(&socket).await.is_err());

    let channel = containerd_client::connect(&socket).await.unwrap();
    let mut client = pb::snapshots_client::SnapshotsClient::new(channel);
    let m = client
        .prepare(req(
            NS,
            PrepareSnapshotRequest {
                snapshotter: "ferry".into(),
                key: "k".into(),
                parent: String::new(),
                labels: HashMap::new(),
            },
        ))
        .await
        .unwrap()
        .into_inner()
        .mounts;
    assert_eq!(m[0].r#type, "bind");
    let err = client
        .stat(req(
            NS,
            StatSnapshotRequest {
                snapshotter: "ferry".into(),
                key: "other".into(),
            },
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let mut stream = client
        .list(req(
            NS,
            ListSnapshotsRequest {
                snapshotter: "ferry".into(),
                filters: vec![],
            },
        ))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.info[0].name, "k");
    assert!(stream.message().await.unwrap().is_none());

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    assert!(!socket.exists(), "socket removed on shutdown");
}

/// Lazy layers are mounted and layers unpacked under the root: no other local user may
/// reach it, and a root made with wider modes is tightened when opened.
#[test]
fn the_root_is_private_and_an_old_root_is_tightened() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let dirs = [root.clone(), root.join("snapshots"), root.join("staging")];
    drop(Snapshotter::open(&root, Arc::new(NoRemoteLayers)).unwrap());
    for d in &dirs {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert_eq!(mode(&root.join("metadata.redb")), 0o600);
    for d in &dirs {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    drop(Snapshotter::open(&root, Arc::new(NoRemoteLayers)).unwrap());
    for d in &dirs {
        assert_eq!(mode(d), 0o700, "{} tightened", d.display());
    }
}
