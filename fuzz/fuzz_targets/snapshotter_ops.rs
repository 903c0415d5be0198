//! Fuzzes what containerd sends the snapshotter (keys, parents, labels, filters, update
//! paths) as sequences of Snapshots calls against the real `Snapshotter` over a temp
//! root, with the daemon's real lazy-layer hook (`LazyLayers`) over an in-memory mount
//! backend. Any caller of the snapshotter's socket is a stranger here.
//!
//! Asserted after every sequence: nothing outside the root was created, moved or
//! removed (staged-dir labels name only directories under `staging/`); every snapshot
//! listed answers Stat and its parent exists and is committed (parent chains stay
//! whole, without loops); every path in a Mounts answer lies under `snapshots/`; every
//! lazy layer the hook mounted lies under `snapshots/`.
#![no_main]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_daemon::{LayerKind, LazyLayers, MemoryBackend, MountBackend};
use ferry_snapshotter::filter::FilterSet;
use ferry_snapshotter::meta::Kind;
use ferry_snapshotter::remote::{
    LABEL_CRI_IMAGE_LAYERS, LABEL_CRI_IMAGE_REF, LABEL_CRI_LAYER_DIGEST, LABEL_FERRY_IMAGE_REF,
    LABEL_FERRY_LAYER_DIGEST, LABEL_FERRY_MANIFEST_DIGEST, LABEL_FERRY_STAGED_DIR,
    LABEL_STAGED_DIR, LABEL_TARGET,
};
use ferry_snapshotter::{Snapshotter, snapshotter::MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

const IMAGE: &str = "reg.local/app:v1";
const MANIFEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const LAZY: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const PLAIN: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
const NAMESPACES: [&str; 2] = ["default", "other"];

/// Reads fuzz bytes as choices.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }

    fn raw(&mut self) -> String {
        let n = usize::from(self.byte().unwrap_or(0) % 48);
        let n = n.min(self.0.len());
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8_lossy(s).into_owned()
    }

    /// A key: mostly from a small pool, so calls meet each other.
    fn key(&mut self) -> String {
        match self.byte().unwrap_or(0) % 12 {
            n @ 0..=5 => format!("k{n}"),
            6 => String::new(),
            7 => "a".repeat(MAX_KEY_LEN + 1),
            8 => "../../outside".into(),
            9 => "k\0nul".into(),
            _ => self.raw(),
        }
    }

    fn label_key(&mut self) -> String {
        match self.byte().unwrap_or(0) % 11 {
            0 => LABEL_TARGET.into(),
            1 => LABEL_FERRY_IMAGE_REF.into(),
            2 => LABEL_CRI_IMAGE_REF.into(),
            3 => LABEL_FERRY_LAYER_DIGEST.into(),
            4 => LABEL_CRI_LAYER_DIGEST.into(),
            5 => LABEL_FERRY_MANIFEST_DIGEST.into(),
            6 => LABEL_STAGED_DIR.into(),
            7 => LABEL_FERRY_STAGED_DIR.into(),
            8 => LABEL_CRI_IMAGE_LAYERS.into(),
            9 => String::new(),
            _ => self.raw(),
        }
    }

    fn label_value(&mut self) -> String {
        match self.byte().unwrap_or(0) % 14 {
            n @ 0..=3 => format!("k{n}"),
            4 => IMAGE.into(),
            5 => LAZY.into(),
            6 => PLAIN.into(),
            7 => MANIFEST.into(),
            8 => "layer0".into(),
            9 => "../outside".into(),
            10 => "/tmp".into(),
            11 => "x".repeat(5000),
            12 => format!("{LAZY},{PLAIN}"),
            _ => self.raw(),
        }
    }

    fn labels(&mut self) -> HashMap<String, String> {
        let n = self.byte().unwrap_or(0) % 6;
        (0..n)
            .map(|_| (self.label_key(), self.label_value()))
            .collect()
    }
}

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("root");
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).expect("outside dir");
    std::fs::write(outside.join("keep"), b"keep").expect("sentinel");
    let backend = Arc::new(MemoryBackend::new());
    backend.add_image(
        IMAGE,
        MANIFEST,
        &[(LAZY, LayerKind::FerryIndex), (PLAIN, LayerKind::Plain)],
    );
    let lazy = Arc::new(LazyLayers::new(backend.clone()));
    let snap = Snapshotter::open(&root, lazy).expect("open the snapshotter");
    // A layer `ferry pull` staged, for staged-dir labels to adopt.
    let staged = snap.staging_dir().join("layer0");
    std::fs::create_dir(&staged).expect("staged dir");
    std::fs::write(staged.join("file"), b"layer").expect("staged file");

    let mut input = Input(data);
    for _ in 0..24 {
        let Some(op) = input.byte() else { break };
        let ns = NAMESPACES[usize::from(op >> 7)];
        // Errors are the answers to bad calls; only panics and broken invariants count.
        match op % 10 {
            0 => drop(snap.prepare(ns, &input.key(), &input.key(), input.labels())),
            1 => drop(snap.view(ns, &input.key(), &input.key(), input.labels())),
            2 => drop(snap.commit(ns, &input.key(), &input.key(), input.labels())),
            3 => drop(snap.remove(ns, &input.key())),
            4 => drop(snap.mounts(ns, &input.key())),
            5 => drop(snap.stat(ns, &input.key())),
            6 => {
                let paths: Vec<String> = (0..input.byte().unwrap_or(0) % 3)
                    .map(|_| format!("labels.{}", input.label_key()))
                    .collect();
                drop(snap.update(ns, &input.key(), input.labels(), &paths));
            }
            7 => {
                let filters: Vec<String> = (0..input.byte().unwrap_or(0) % 3)
                    .map(|_| input.raw())
                    .collect();
                if let Ok(set) = FilterSet::parse(&filters) {
                    drop(snap.walk(ns, &set));
                }
            }
            8 => drop(snap.usage(ns, &input.key())),
            _ => drop(snap.cleanup()),
        }
    }

    // Nothing outside the root changed.
    let mut entries: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list the temp dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        ["outside", "root"],
        "something appeared beside the root"
    );
    assert_eq!(
        std::fs::read(outside.join("keep")).expect("sentinel"),
        b"keep"
    );
    assert_eq!(std::fs::read_dir(&outside).expect("outside").count(), 1);

    let snapshots = root.canonicalize().expect("root").join("snapshots");
    let under =
        |p: &Path| p.starts_with(&snapshots) && !p.components().any(|c| c.as_os_str() == "..");
    for ns in NAMESPACES {
        let all = snap.walk(ns, &FilterSet::default()).expect("walk");
        for info in &all {
            let stat = snap
                .stat(ns, &info.name)
                .expect("a listed snapshot answers Stat");
            assert_eq!(stat.parent, info.parent);
            if !info.parent.is_empty() {
                let parent = snap.stat(ns, &info.parent).expect("the parent exists");
                assert_eq!(parent.kind, Kind::Committed, "parents are committed");
            }
            if info.kind == Kind::Committed {
                continue;
            }
            for mount in snap
                .mounts(ns, &info.name)
                .expect("mounts of a live snapshot")
            {
                let mut paths = Vec::new();
                if mount.fs_type == "bind" {
                    paths.push(PathBuf::from(&mount.source));
                }
                for opt in &mount.options {
                    for (name, value) in [
                        ("lowerdir=", true),
                        ("upperdir=", false),
                        ("workdir=", false),
                    ] {
                        if let Some(v) = opt.strip_prefix(name) {
                            if value {
                                paths.extend(v.split(':').map(PathBuf::from));
                            } else {
                                paths.push(PathBuf::from(v));
                            }
                        }
                    }
                }
                for p in paths {
                    assert!(
                        under(&p),
                        "mount path {} outside {}",
                        p.display(),
                        snapshots.display()
                    );
                }
            }
        }
        // Parent chains end: following parents never takes more steps than snapshots.
        for info in &all {
            let mut parent = info.parent.clone();
            let mut steps = 0;
            while !parent.is_empty() {
                steps += 1;
                assert!(steps <= all.len(), "parent chain of {} loops", info.name);
                parent = snap.stat(ns, &parent).expect("parent").parent;
            }
        }
    }
    for m in backend.list() {
        assert!(
            under(&m.info.mountpoint),
            "lazy layer mounted at {}",
            m.info.mountpoint.display()
        );
        assert_eq!(
            m.info.layer.as_deref(),
            Some(LAZY),
            "only the lazy layer is mounted"
        );
    }
});
