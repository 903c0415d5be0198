//! Staged Prepare (the hook `ferry pull` uses to unpack layers in parallel): only a real
//! directory directly under the snapshotter's staging directory is adopted; it is moved
//! into a snapshot committed under the target chain id, usage counts it, and the answer
//! is AlreadyExists. Everything else is refused and leaves no snapshot behind.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ferry_snapshotter::meta::Kind;
use ferry_snapshotter::remote::{
    LABEL_CRI_LAYER_DIGEST, LABEL_FERRY_STAGED_DIR, LABEL_STAGED_DIR, LABEL_TARGET,
    MemoryRemoteLayers,
};
use ferry_snapshotter::{Error, NoRemoteLayers, Snapshotter};

const NS: &str = "staging-test";

fn open(root: &Path) -> Snapshotter {
    Snapshotter::open(root, Arc::new(NoRemoteLayers)).unwrap()
}

fn staged_labels(target: &str, dir: &Path, key: &str) -> HashMap<String, String> {
    [
        (LABEL_TARGET, target.to_string()),
        (LABEL_CRI_LAYER_DIGEST, "sha256:aa".to_string()),
        (key, dir.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn stage(s: &Snapshotter, name: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = s.staging_dir().join(name);
    std::fs::create_dir(&dir).unwrap();
    for (rel, content) in files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    dir
}

fn assert_nothing_left(s: &Snapshotter, key: &str, target: &str) {
    assert!(matches!(s.stat(NS, key), Err(Error::NotFound { .. })));
    assert!(matches!(s.stat(NS, target), Err(Error::NotFound { .. })));
}

#[test]
fn staged_layers_are_adopted_committed_and_chained() {
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    assert!(
        s.staging_dir().is_dir(),
        "open creates the staging directory"
    );

    let base = stage(&s, "base", &[("etc/os-release", "ferry"), ("bin/sh", "#!")]);
    let err = s
        .prepare(
            NS,
            "extract-1",
            "",
            staged_labels("chain-1", &base, LABEL_STAGED_DIR),
        )
        .unwrap_err();
    assert!(
        matches!(err, Error::AlreadyExists { ref key } if key == "chain-1"),
        "{err}"
    );
    assert!(!base.exists(), "the staged directory was moved, not copied");
    let info = s.stat(NS, "chain-1").unwrap();
    assert_eq!(info.kind, Kind::Committed);
    assert!(
        !info.labels.contains_key(LABEL_STAGED_DIR),
        "staging label not kept"
    );
    assert_eq!(
        info.labels.get(LABEL_TARGET).map(String::as_str),
        Some("chain-1")
    );
    assert!(matches!(
        s.stat(NS, "extract-1"),
        Err(Error::NotFound { .. })
    ));
    let usage = s.usage(NS, "chain-1").unwrap();
    // root dir, etc, bin and two files
    assert_eq!(usage.inodes, 5);
    assert!(usage.size > 0);

    // The second layer on top, with the ferry.dev spelling of the label.
    let top = stage(&s, "top", &[("app/hello.txt", "hi")]);
    let err = s
        .prepare(
            NS,
            "extract-2",
            "chain-1",
            staged_labels("chain-2", &top, LABEL_FERRY_STAGED_DIR),
        )
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
    assert_eq!(s.stat(NS, "chain-2").unwrap().parent, "chain-1");

    // A container on top sees both layers as lower dirs, top first.
    let mounts = s
        .prepare(NS, "container", "chain-2", HashMap::new())
        .unwrap();
    let lower = mounts[0]
        .options
        .iter()
        .find_map(|o| o.strip_prefix("lowerdir="))
        .unwrap()
        .to_string();
    let dirs: Vec<&str> = lower.split(':').collect();
    assert_eq!(dirs.len(), 2);
    assert_eq!(
        std::fs::read_to_string(Path::new(dirs[0]).join("app/hello.txt")).unwrap(),
        "hi"
    );
    assert_eq!(
        std::fs::read_to_string(Path::new(dirs[1]).join("etc/os-release")).unwrap(),
        "ferry"
    );
}

#[test]
fn an_existing_target_answers_already_exists_and_leaves_the_staged_dir() {
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    let first = stage(&s, "first", &[("a", "1")]);
    assert!(
        s.prepare(
            NS,
            "k1",
            "",
            staged_labels("chain", &first, LABEL_STAGED_DIR)
        )
        .is_err()
    );
    let second = stage(&s, "second", &[("a", "2")]);
    let err = s
        .prepare(
            NS,
            "k2",
            "",
            staged_labels("chain", &second, LABEL_STAGED_DIR),
        )
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }));
    assert!(second.is_dir(), "not adopted: the caller removes it");
    assert!(matches!(s.stat(NS, "k2"), Err(Error::NotFound { .. })));
}

#[test]
fn only_real_directories_directly_under_staging_are_accepted() {
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "x").unwrap();
    let nested = s.staging_dir().join("outer/inner");
    std::fs::create_dir_all(&nested).unwrap();
    let link = s.staging_dir().join("link");
    std::os::unix::fs::symlink(outside.path(), &link).unwrap();
    let file = s.staging_dir().join("file");
    std::fs::write(&file, "x").unwrap();
    let hidden = s.staging_dir().join(".hidden");
    std::fs::create_dir(&hidden).unwrap();
    let dotdot = s.staging_dir().join("outer/../outer");
    let bad: Vec<(&str, std::path::PathBuf)> = vec![
        ("outside the root", outside.path().to_path_buf()),
        ("nested", nested.clone()),
        ("symlink", link.clone()),
        ("file", file),
        ("hidden", hidden),
        ("missing", s.staging_dir().join("missing")),
        ("relative", "staging/outer".into()),
        ("the staging dir itself", s.staging_dir()),
        ("dot-dot", dotdot),
        ("snapshots dir", root.path().join("snapshots")),
    ];
    for (what, dir) in bad {
        let err = s
            .prepare(
                NS,
                "key",
                "",
                staged_labels("target", &dir, LABEL_STAGED_DIR),
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err}");
        assert_nothing_left(&s, "key", "target");
    }
    assert!(
        outside.path().join("secret").is_file(),
        "nothing outside was touched"
    );
    assert!(nested.is_dir());
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[test]
fn a_staged_label_needs_a_target_and_a_committed_parent() {
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    let dir = stage(&s, "layer", &[("a", "1")]);
    let mut no_target = staged_labels("t", &dir, LABEL_STAGED_DIR);
    no_target.remove(LABEL_TARGET);
    assert!(matches!(
        s.prepare(NS, "key", "", no_target),
        Err(Error::InvalidArgument(_))
    ));
    let err = s
        .prepare(
            NS,
            "key",
            "no-such-parent",
            staged_labels("t", &dir, LABEL_STAGED_DIR),
        )
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert!(
        dir.is_dir(),
        "a refused staged dir stays for the caller to remove"
    );
    assert_nothing_left(&s, "key", "t");
}

#[test]
fn containerd_finds_the_adopted_layer_with_its_walk_filter() {
    use ferry_snapshotter::filter::FilterSet;
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    let target = "sha256:621b1454d2511c0886740b883e89dd1185afb96faa131176dca945685106c7d1";
    let dir = stage(&s, "layer", &[("a", "1")]);
    assert!(
        s.prepare(
            NS,
            "ns/1/extract",
            "",
            staged_labels(target, &dir, LABEL_STAGED_DIR)
        )
        .is_err()
    );
    // What containerd 1.6 asks after an AlreadyExists with a target.
    let filter = format!(r#"labels."containerd.io/snapshot.ref"=={target},parent=="""#);
    let found = s.walk(NS, &FilterSet::parse(&[filter]).unwrap()).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].name, target);
}

#[test]
fn cleanup_removes_only_stale_staged_layers() {
    use ferry_snapshotter::snapshotter::{CleanupReport, STAGING_MAX_AGE};
    use std::time::{Duration, SystemTime};
    let root = tempfile::tempdir().unwrap();
    let s = open(root.path());
    let staged = stage(&s, "pull-1-a-1", &[("b/c", "2")]);
    // A layer's own mtime says nothing about the pull: an old one must not get it removed.
    let old = SystemTime::now() - STAGING_MAX_AGE - Duration::from_secs(3600);
    std::fs::File::open(&staged)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let report = s.cleanup().unwrap();
    assert_eq!(report.removed, 0);
    assert!(
        staged.join("b/c").is_file(),
        "a live pull's staged layer is kept"
    );
    // Untouched for longer than the limit (seen from the future): removed.
    let mut report = CleanupReport::default();
    s.cleanup_staging(
        SystemTime::now() + STAGING_MAX_AGE + Duration::from_secs(60),
        &mut report,
    );
    assert_eq!(report.removed, 1);
    assert!(!staged.exists(), "a stale staged layer is removed");
}

/// The daemon holds an image's trace prefetch until its pull is through (crates/daemon
/// `settle`): it learns that an unpacked layer is in when that layer's snapshot commits,
/// staged or unpacked by containerd, and only for image layers.
#[test]
fn committed_image_layers_are_reported_to_the_remote_side() {
    let root = tempfile::tempdir().unwrap();
    let remote = Arc::new(MemoryRemoteLayers::new());
    let s = Snapshotter::open(root.path(), remote.clone()).unwrap();

    let base = stage(&s, "base", &[("etc/os-release", "ferry")]);
    let err = s
        .prepare(
            NS,
            "extract-1",
            "",
            staged_labels("chain-1", &base, LABEL_STAGED_DIR),
        )
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyExists { .. }), "{err}");
    // containerd's own unpack: Prepare with the layer's labels, Commit under the target.
    let labels: HashMap<String, String> = [
        (LABEL_TARGET, "chain-2"),
        (LABEL_CRI_LAYER_DIGEST, "sha256:bb"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    s.prepare(NS, "extract-2", "chain-1", labels).unwrap();
    s.commit(NS, "chain-2", "extract-2", HashMap::new())
        .unwrap();
    // A container's snapshot committed (as `ctr snapshot commit` does) is no image layer.
    s.prepare(NS, "work", "chain-2", HashMap::new()).unwrap();
    s.commit(NS, "saved", "work", HashMap::new()).unwrap();

    let reported: Vec<(String, Option<String>)> = remote
        .committed()
        .into_iter()
        .map(|l| (l.target, l.layer_digest))
        .collect();
    assert_eq!(
        reported,
        vec![
            ("chain-1".to_string(), Some("sha256:aa".to_string())),
            ("chain-2".to_string(), Some("sha256:bb".to_string())),
        ]
    );
}
