//! The snapshotter itself, without gRPC: snapshot lifecycle over overlayfs directories
//! and the redb metadata, plus the remote (lazy) layer path. Synchronous on purpose: the
//! service runs each call on a blocking thread, and tests drive it directly.
//!
//! Layout under the root:
//! ```text
//! metadata.redb            all snapshot records, every namespace
//! snapshots/<id>/fs        upper dir (active), contents (committed), remote mount point
//! snapshots/<id>/work      overlayfs work dir (active only)
//! staging/<name>/          layers unpacked by `ferry pull`, adopted by a staged Prepare
//! ```

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::filter::{Fields, FilterSet};
use crate::meta::{Kind, Metadata, Record, Stamp};
use crate::remote::{
    LABEL_FERRY_REMOTE, LABEL_FERRY_STAGED_DIR, LABEL_STAGED_DIR, LayerLabels, NotLazy,
    RemoteLayers, RemoteMount,
};
use crate::usage::{Usage, disk_usage};

/// Longest key or name accepted.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest label (key + value), as in containerd.
pub const MAX_LABEL_LEN: usize = 4096;
/// Most labels on one snapshot.
pub const MAX_LABELS: usize = 256;
/// The staging directory's name under the root.
const STAGING_DIR: &str = "staging";
/// A staged directory older than this is left over from a pull that died (a pull's
/// containerd lease lasts an hour), and `Cleanup` removes it.
pub const STAGING_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(2 * 3600);
/// Longest parent chain followed (a loop in a corrupt database must not hang us).
const MAX_CHAIN: usize = 4096;

/// One mount containerd should perform to use a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Filesystem type (`bind`, `overlay`).
    pub fs_type: String,
    /// Mount source.
    pub source: String,
    /// Mount options, as `mount -o` takes them.
    pub options: Vec<String>,
}

/// What Stat, Update and Walk report about a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// Key (active, view) or name (committed).
    pub name: String,
    /// Parent's name, empty for none.
    pub parent: String,
    /// State.
    pub kind: Kind,
    /// Labels.
    pub labels: HashMap<String, String>,
    /// Creation time.
    pub created: SystemTime,
    /// Last change.
    pub updated: SystemTime,
}

/// What Cleanup did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Orphan directories removed.
    pub removed: u64,
    /// Orphan directories left in place (a mount inside could not be undone).
    pub skipped: u64,
}

/// The snapshotter over one root directory.
pub struct Snapshotter {
    root: PathBuf,
    meta: Metadata,
    remote: Arc<dyn RemoteLayers>,
    /// Serializes changes that touch both metadata and directories.
    changes: Mutex<()>,
}

impl std::fmt::Debug for Snapshotter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshotter")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl Snapshotter {
    /// Opens (creating if needed) the snapshotter rooted at `root`, detaches what a crash
    /// left mounted on snapshots that are not remote layers, and restores the remote
    /// mounts of committed snapshots through `remote`.
    ///
    /// The root, `snapshots/` and `staging/` are made 0700 (tightened if they exist):
    /// lazy layers are mounted below them and layer contents unpacked there, and no
    /// other local user may reach either (as containerd keeps its own snapshotters).
    pub fn open(root: &Path, remote: Arc<dyn RemoteLayers>) -> Result<Snapshotter> {
        let snapshots = root.join("snapshots");
        let staging = root.join(STAGING_DIR);
        for dir in [root, &snapshots, &staging] {
            private_dir(dir).map_err(|e| Error::io("create", dir, e))?;
        }
        let meta_path = root.join("metadata.redb");
        let meta = Metadata::open(&meta_path)?;
        std::fs::set_permissions(&meta_path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io("chmod", &meta_path, e))?;
        let snapshotter = Snapshotter {
            root: root.to_path_buf(),
            meta,
            remote,
            changes: Mutex::new(()),
        };
        let records = snapshotter.meta.list(None)?;
        snapshotter.detach_crash_leftovers(&records);
        for (ns, key, record) in records {
            if let Some(mount) = &record.remote {
                let dir = snapshotter.fs_dir(record.id);
                match snapshotter.remote.restore(mount, &dir) {
                    Ok(()) => {
                        tracing::info!(ns, key, provider = mount.provider, "restored remote layer")
                    }
                    Err(e) => {
                        tracing::error!(ns, key, provider = mount.provider, error = %e, "cannot restore remote layer; reads from it will fail")
                    }
                }
            }
        }
        Ok(snapshotter)
    }

    /// Only the remote hook mounts anything on a snapshot's directory, and only for the
    /// snapshot it then commits as a remote layer. A crash between that mount and the
    /// commit leaves the mount (dead with the process that served it) on an active
    /// snapshot that containerd will remove; until then it would show as a mount nobody
    /// serves. Detach those; remote layers' own mounts are left to `restore`.
    fn detach_crash_leftovers(&self, records: &[(String, String, Record)]) {
        let snapshots = self.root.join("snapshots");
        let mounted = match mounts_under(&snapshots) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for mounts a crash left behind");
                return;
            }
        };
        if mounted.is_empty() {
            return;
        }
        let base = std::fs::canonicalize(&snapshots).unwrap_or(snapshots);
        for (ns, key, record) in records {
            if record.remote.is_some() {
                continue;
            }
            let dir = base.join(record.id.to_string());
            for mount_point in mounted.iter().filter(|m| m.starts_with(&dir)) {
                match detach(mount_point) {
                    Ok(()) => tracing::info!(
                        ns,
                        key,
                        path = %mount_point.display(),
                        "detached a mount a crash left on a snapshot that is not a remote layer"
                    ),
                    Err(e) => tracing::warn!(ns, key, error = %e, "cannot detach a leftover mount"),
                }
            }
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where `ferry pull` unpacks layers before a staged Prepare adopts them (see
    /// [`LABEL_STAGED_DIR`]): on the same filesystem as the snapshots, so adoption is a
    /// rename.
    pub fn staging_dir(&self) -> PathBuf {
        self.root.join(STAGING_DIR)
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.changes.lock()
    }

    fn snapshot_dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// Where snapshot `id`'s contents live (upper dir, layer contents or mount point).
    pub fn fs_dir(&self, id: u64) -> PathBuf {
        self.snapshot_dir(id).join("fs")
    }

    fn work_dir(&self, id: u64) -> PathBuf {
        self.snapshot_dir(id).join("work")
    }

    /// Creates a writable snapshot. With the `containerd.io/snapshot.ref` label, the
    /// remote hook may provide the layer instead: then the snapshot is committed under
    /// that name and the answer is AlreadyExists (containerd's remote-snapshot protocol).
    pub fn prepare(
        &self,
        ns: &str,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>> {
        let layer = LayerLabels::parse(&labels);
        if let Some(layer) = &layer {
            check_key(&layer.target)?;
            if self.meta.get(ns, &layer.target)?.is_some() {
                return Err(Error::already_exists(&layer.target));
            }
        }
        let staged = labels
            .get(LABEL_STAGED_DIR)
            .or_else(|| labels.get(LABEL_FERRY_STAGED_DIR))
            .cloned();
        if let Some(staged) = staged {
            let Some(layer) = &layer else {
                return Err(Error::InvalidArgument(format!(
                    "a staged layer ({LABEL_STAGED_DIR}) needs the {} label naming its chain id",
                    crate::remote::LABEL_TARGET
                )));
            };
            return self.adopt_staged(ns, key, parent, labels.clone(), &layer.target, &staged);
        }
        let (id, mounts) = self.create(ns, key, parent, &labels, Kind::Active)?;
        let Some(layer) = layer else {
            return Ok(mounts);
        };
        let dir = self.fs_dir(id);
        match self.remote.prepare_remote(&labels, &dir) {
            Ok(mount) => {
                tracing::info!(
                    ns,
                    key,
                    target = layer.target,
                    provider = mount.provider,
                    "layer mounted remotely"
                );
                match self.commit_remote(ns, &layer.target, key, labels, mount.clone()) {
                    Ok(()) => Err(Error::already_exists(&layer.target)),
                    Err(e) => {
                        if let Err(release) = self.remote.release(&mount, &dir) {
                            tracing::warn!(error = %release, "releasing remote layer after failed commit");
                        }
                        if let Err(remove) = self.remove(ns, key) {
                            tracing::warn!(error = %remove, key, "removing snapshot after failed remote commit");
                        }
                        Err(e)
                    }
                }
            }
            Err(not_lazy) => {
                log_not_lazy(ns, key, &layer, &not_lazy);
                // The directory is the upper dir of an ordinary unpack: it must be empty.
                empty_dir(&dir)?;
                Ok(mounts)
            }
        }
    }

    /// A staged Prepare: `staged` is a directory directly under [`Self::staging_dir`]
    /// holding the layer's unpacked contents. It becomes the contents of a snapshot
    /// committed as `target` (usage measured as for any commit), and the answer is
    /// AlreadyExists, as for a remote layer. Anything else named by the label is refused.
    fn adopt_staged(
        &self,
        ns: &str,
        key: &str,
        parent: &str,
        mut labels: HashMap<String, String>,
        target: &str,
        staged: &str,
    ) -> Result<Vec<Mount>> {
        let staged = self.check_staged(staged)?;
        labels.remove(LABEL_STAGED_DIR);
        labels.remove(LABEL_FERRY_STAGED_DIR);
        let (id, _) = self.create(ns, key, parent, &labels, Kind::Active)?;
        let adopted = self.move_into_snapshot(id, &staged).and_then(|()| {
            // The upper dir's work dir is not needed by a committed layer.
            let work = self.work_dir(id);
            std::fs::remove_dir(&work).map_err(|e| Error::io("remove", &work, e))?;
            self.commit(ns, target, key, labels)
        });
        match adopted {
            Ok(()) => {
                tracing::info!(ns, key, target, staged = %staged.display(), "adopted staged layer");
                Err(Error::already_exists(target))
            }
            Err(e) => {
                if let Err(remove) = self.remove(ns, key) {
                    tracing::warn!(error = %remove, key, "removing snapshot after failed staged commit");
                }
                Err(e)
            }
        }
    }

    /// The staged directory named by a label, if it is a real directory directly under
    /// the staging directory (not a symlink, not the staging directory itself, not a
    /// hidden name); its canonical path.
    fn check_staged(&self, staged: &str) -> Result<PathBuf> {
        let refuse =
            |why: &str| Error::InvalidArgument(format!("staged layer directory {staged:?} {why}"));
        let path = Path::new(staged);
        if !path.is_absolute() {
            return Err(refuse("is not an absolute path"));
        }
        let plain = path.components().all(|c| {
            matches!(
                c,
                std::path::Component::RootDir | std::path::Component::Normal(_)
            )
        });
        if !plain {
            return Err(refuse("has `.` or `..` components"));
        }
        let name = match path.file_name().and_then(|n| n.to_str()) {
            Some(n) if !n.starts_with('.') => n.to_owned(),
            _ => return Err(refuse("has no plain final name")),
        };
        let meta = match std::fs::symlink_metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(refuse("does not exist"));
            }
            Err(e) => return Err(Error::io("stat", path, e)),
        };
        if !meta.file_type().is_dir() {
            return Err(refuse("is not a directory"));
        }
        let staging = self.staging_dir();
        let staging =
            std::fs::canonicalize(&staging).map_err(|e| Error::io("resolve", &staging, e))?;
        let parent = path.parent().ok_or_else(|| refuse("has no parent"))?;
        let parent = std::fs::canonicalize(parent).map_err(|e| Error::io("resolve", parent, e))?;
        if parent != staging {
            return Err(refuse(&format!(
                "is not directly under the snapshotter's staging directory {}",
                staging.display()
            )));
        }
        Ok(staging.join(name))
    }

    fn move_into_snapshot(&self, id: u64, staged: &Path) -> Result<()> {
        let fs = self.fs_dir(id);
        std::fs::remove_dir(&fs).map_err(|e| Error::io("remove", &fs, e))?;
        std::fs::rename(staged, &fs).map_err(|e| Error::io("rename", staged, e))
    }

    /// Creates a read-only snapshot of `parent`.
    pub fn view(
        &self,
        ns: &str,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(ns, key, parent, &labels, Kind::View)
            .map(|(_, mounts)| mounts)
    }

    fn create(
        &self,
        ns: &str,
        key: &str,
        parent: &str,
        labels: &HashMap<String, String>,
        kind: Kind,
    ) -> Result<(u64, Vec<Mount>)> {
        check_key(key)?;
        if !parent.is_empty() {
            check_key(parent)?;
        }
        check_labels(labels)?;
        let _guard = self.lock();
        let txn = self.meta.write()?;
        if txn.get(ns, key)?.is_some() {
            return Err(Error::already_exists(key));
        }
        if !parent.is_empty() {
            match txn.get(ns, parent)? {
                None => {
                    return Err(Error::NotFound {
                        key: parent.to_owned(),
                    });
                }
                Some(p) if p.kind != Kind::Committed => {
                    return Err(Error::InvalidArgument(format!(
                        "parent {parent:?} is not a committed snapshot"
                    )));
                }
                Some(_) => {}
            }
        }
        let id = txn.next_id()?;
        let now = Stamp::now();
        let record = Record {
            id,
            kind,
            parent: parent.to_owned(),
            labels: labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            created: now,
            updated: now,
            usage: None,
            remote: None,
        };
        txn.put(ns, key, &record)?;
        self.make_dirs(id, kind)?;
        let mounts = match self.mounts_of(&txn_view(&txn), ns, &record) {
            Ok(m) => m,
            Err(e) => {
                drop(txn);
                let _ = remove_snapshot_dir(&self.snapshot_dir(id));
                return Err(e);
            }
        };
        if let Err(e) = txn.commit() {
            let _ = remove_snapshot_dir(&self.snapshot_dir(id));
            return Err(e);
        }
        tracing::debug!(
            ns,
            key,
            parent,
            id,
            kind = kind.as_str(),
            "created snapshot"
        );
        Ok((id, mounts))
    }

    fn make_dirs(&self, id: u64, kind: Kind) -> Result<()> {
        let dir = self.snapshot_dir(id);
        // An existing directory with a fresh id was made by a transaction that never
        // committed (crash): nothing refers to it.
        if dir.exists() {
            remove_snapshot_dir(&dir)?;
        }
        let fs = self.fs_dir(id);
        let made = std::fs::create_dir_all(&fs).map_err(|e| Error::io("create", &fs, e));
        let made = made.and_then(|()| {
            if kind == Kind::Active {
                let work = self.work_dir(id);
                std::fs::create_dir(&work).map_err(|e| Error::io("create", &work, e))
            } else {
                Ok(())
            }
        });
        if made.is_err() {
            let _ = remove_snapshot_dir(&dir);
        }
        made
    }

    /// The mounts for an active snapshot or view.
    pub fn mounts(&self, ns: &str, key: &str) -> Result<Vec<Mount>> {
        check_key(key)?;
        let record = self
            .meta
            .get(ns, key)?
            .ok_or_else(|| Error::not_found(key))?;
        self.mounts_of(&ReadView::Meta(&self.meta), ns, &record)
    }

    fn mounts_of(&self, view: &ReadView<'_>, ns: &str, record: &Record) -> Result<Vec<Mount>> {
        if record.kind == Kind::Committed {
            return Err(Error::FailedPrecondition(
                "a committed snapshot has no mounts; View or Prepare a child".to_owned(),
            ));
        }
        let mut lowers = Vec::new();
        let mut parent = record.parent.clone();
        while !parent.is_empty() {
            if lowers.len() >= MAX_CHAIN {
                return Err(Error::Metadata(format!(
                    "parent chain longer than {MAX_CHAIN}"
                )));
            }
            let p = view
                .get(ns, &parent)?
                .ok_or_else(|| Error::Metadata(format!("parent {parent:?} is missing")))?;
            lowers.push(self.fs_dir(p.id).display().to_string());
            parent = p.parent;
        }
        let own = self.fs_dir(record.id).display().to_string();
        let bind = |source: String, options: &[&str]| Mount {
            fs_type: "bind".to_owned(),
            source,
            options: options.iter().map(|o| (*o).to_owned()).collect(),
        };
        // A read-only view of one layer is that layer itself, bind-mounted — for a lazy
        // layer, ferry's FUSE mount, which is nosuid,nodev. A bind mount inherits those
        // flags, but the runtime makes it read-only with a remount, and a remount sets a
        // bind mount's flags to exactly the ones it is given: without nosuid,nodev here it
        // would turn an image's setuid programs and device nodes on again, wherever the
        // view is mounted (issue 11). So views say them explicitly (the cost: a container
        // run read-only on a one-layer image gets a nosuid,nodev root, where overlay views
        // of several layers do not).
        const VIEW: &[&str] = &["ro", "rbind", "nosuid", "nodev"];
        let mount = match (record.kind, lowers.len()) {
            (Kind::Active, 0) => bind(own, &["rw", "rbind"]),
            (Kind::View, 0) => bind(own, VIEW),
            (Kind::View, 1) => bind(lowers.remove(0), VIEW),
            (Kind::View, _) => Mount {
                fs_type: "overlay".to_owned(),
                source: "overlay".to_owned(),
                options: vec![format!("lowerdir={}", lowers.join(":"))],
            },
            (_, _) => Mount {
                fs_type: "overlay".to_owned(),
                source: "overlay".to_owned(),
                options: vec![
                    format!("workdir={}", self.work_dir(record.id).display()),
                    format!("upperdir={own}"),
                    format!("lowerdir={}", lowers.join(":")),
                ],
            },
        };
        Ok(vec![mount])
    }

    /// Commits active snapshot `key` as `name` (immutable, can be a parent).
    pub fn commit(
        &self,
        ns: &str,
        name: &str,
        key: &str,
        labels: HashMap<String, String>,
    ) -> Result<()> {
        check_key(name)?;
        check_key(key)?;
        check_labels(&labels)?;
        let guard = self.lock();
        let txn = self.meta.write()?;
        let active = txn.get(ns, key)?.ok_or_else(|| Error::not_found(key))?;
        if active.kind != Kind::Active {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key:?} is {}, only an active snapshot can be committed",
                active.kind.as_str()
            )));
        }
        if txn.get(ns, name)?.is_some() {
            return Err(Error::already_exists(name));
        }
        let usage = disk_usage(&self.fs_dir(active.id))?;
        let now = Stamp::now();
        // An unpacked image layer (its Prepare carried the layer's labels).
        let layer = LayerLabels::parse(
            &active
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        let committed = Record {
            kind: Kind::Committed,
            labels: labels.into_iter().collect(),
            updated: now,
            usage: Some(usage),
            ..active
        };
        txn.delete(ns, key)?;
        txn.put(ns, name, &committed)?;
        txn.commit()?;
        drop(guard);
        tracing::debug!(ns, key, name, id = committed.id, "committed snapshot");
        if let Some(layer) = layer {
            self.remote.layer_committed(&layer);
        }
        Ok(())
    }

    fn commit_remote(
        &self,
        ns: &str,
        name: &str,
        key: &str,
        mut labels: HashMap<String, String>,
        mount: RemoteMount,
    ) -> Result<()> {
        labels.insert(LABEL_FERRY_REMOTE.to_owned(), mount.provider.clone());
        let _guard = self.lock();
        let txn = self.meta.write()?;
        let active = txn.get(ns, key)?.ok_or_else(|| Error::not_found(key))?;
        if txn.get(ns, name)?.is_some() {
            return Err(Error::already_exists(name));
        }
        let committed = Record {
            kind: Kind::Committed,
            labels: labels.into_iter().collect(),
            updated: Stamp::now(),
            usage: Some(mount.usage),
            remote: Some(mount),
            ..active
        };
        txn.delete(ns, key)?;
        txn.put(ns, name, &committed)?;
        txn.commit()
    }

    /// Removes a snapshot that no other snapshot has as parent.
    pub fn remove(&self, ns: &str, key: &str) -> Result<()> {
        check_key(key)?;
        let record = {
            let _guard = self.lock();
            let txn = self.meta.write()?;
            let record = txn.get(ns, key)?.ok_or_else(|| Error::not_found(key))?;
            if txn.has_children(ns, key)? {
                return Err(Error::FailedPrecondition(format!(
                    "cannot remove snapshot {key:?}: other snapshots have it as parent"
                )));
            }
            txn.delete(ns, key)?;
            txn.commit()?;
            record
        };
        let fs = self.fs_dir(record.id);
        if let Some(mount) = &record.remote
            && let Err(e) = self.remote.release(mount, &fs)
        {
            tracing::warn!(ns, key, error = %e, "releasing remote layer");
        }
        // The record is gone: a directory that cannot be removed now is left to Cleanup.
        if let Err(e) = remove_snapshot_dir(&self.snapshot_dir(record.id)) {
            tracing::warn!(ns, key, id = record.id, error = %e, "snapshot directory left for Cleanup");
        }
        tracing::debug!(ns, key, id = record.id, "removed snapshot");
        Ok(())
    }

    /// Information about one snapshot.
    pub fn stat(&self, ns: &str, key: &str) -> Result<Info> {
        check_key(key)?;
        let record = self
            .meta
            .get(ns, key)?
            .ok_or_else(|| Error::not_found(key))?;
        Ok(info(key, &record))
    }

    /// Changes labels. `paths` as in containerd: empty or `labels` replaces all labels,
    /// `labels.KEY` sets (or, when absent or empty in `labels`, deletes) one label.
    pub fn update(
        &self,
        ns: &str,
        name: &str,
        labels: HashMap<String, String>,
        paths: &[String],
    ) -> Result<Info> {
        check_key(name)?;
        check_labels(&labels)?;
        let _guard = self.lock();
        let txn = self.meta.write()?;
        let mut record = txn.get(ns, name)?.ok_or_else(|| Error::not_found(name))?;
        let mut new_labels = record.labels.clone();
        if paths.is_empty() {
            new_labels = labels.into_iter().collect();
        } else {
            for path in paths {
                if path == "labels" {
                    new_labels = labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                } else if let Some(label) = path.strip_prefix("labels.") {
                    if label.is_empty() {
                        return Err(Error::InvalidArgument(
                            "field path \"labels.\" names no label".to_owned(),
                        ));
                    }
                    match labels.get(label).filter(|v| !v.is_empty()) {
                        Some(v) => {
                            new_labels.insert(label.to_owned(), v.clone());
                        }
                        None => {
                            new_labels.remove(label);
                        }
                    }
                } else {
                    return Err(Error::InvalidArgument(format!(
                        "cannot update field {path:?} of a snapshot (only labels and labels.KEY)"
                    )));
                }
            }
        }
        new_labels.retain(|_, v| !v.is_empty());
        if new_labels.len() > MAX_LABELS {
            return Err(Error::InvalidArgument(format!(
                "more than {MAX_LABELS} labels"
            )));
        }
        record.labels = new_labels;
        record.updated = Stamp::now();
        txn.put(ns, name, &record)?;
        txn.commit()?;
        Ok(info(name, &record))
    }

    /// Disk use: measured now for active snapshots and views, at commit for committed ones.
    pub fn usage(&self, ns: &str, key: &str) -> Result<Usage> {
        check_key(key)?;
        let record = self
            .meta
            .get(ns, key)?
            .ok_or_else(|| Error::not_found(key))?;
        match (record.kind, record.usage) {
            (Kind::Committed, Some(usage)) => Ok(usage),
            _ => disk_usage(&self.fs_dir(record.id)),
        }
    }

    /// Moves every record kept under another namespace into `into`, in one transaction,
    /// and returns how many moved. A key that `into` already holds stays where it was
    /// (logged): the two records are different snapshots and neither may be lost. Records
    /// keep their directory id, so nothing on disk moves.
    ///
    /// The gRPC service answers every request in one key space (see
    /// [`crate::service::KEY_SPACE`]); this brings records an older ferry filed under the
    /// namespace a request carried into that space.
    pub fn merge_namespaces(&self, into: &str) -> Result<usize> {
        let _guard = self.lock();
        let records = self.meta.list(None)?;
        if records.iter().all(|(ns, _, _)| ns == into) {
            return Ok(0);
        }
        let txn = self.meta.write()?;
        let mut moved = 0;
        for (ns, key, record) in records.into_iter().filter(|(ns, _, _)| ns != into) {
            if txn.get(into, &key)?.is_some() {
                tracing::warn!(
                    ns,
                    key,
                    into,
                    id = record.id,
                    "a snapshot of this key already exists in the merged key space; this one stays unreachable until removed by hand"
                );
                continue;
            }
            txn.delete(&ns, &key)?;
            txn.put(into, &key, &record)?;
            moved += 1;
        }
        txn.commit()?;
        Ok(moved)
    }

    /// Every snapshot of `ns` that `filters` selects, ordered by name.
    pub fn walk(&self, ns: &str, filters: &FilterSet) -> Result<Vec<Info>> {
        let mut out = Vec::new();
        for (_, key, record) in self.meta.list(Some(ns))? {
            let labels: HashMap<String, String> = record.labels.clone().into_iter().collect();
            let fields = Fields {
                name: &key,
                parent: &record.parent,
                kind: record.kind.as_str(),
                labels: &labels,
            };
            if filters.matches(&fields) {
                out.push(info(&key, &record));
            }
        }
        Ok(out)
    }

    /// Removes snapshot directories no snapshot refers to (left by a crash between
    /// creating a directory and committing its record, or by a failed removal).
    pub fn cleanup(&self) -> Result<CleanupReport> {
        let _guard = self.lock();
        let ids: HashSet<u64> = self
            .meta
            .list(None)?
            .into_iter()
            .map(|(_, _, r)| r.id)
            .collect();
        let dir = self.root.join("snapshots");
        let mut report = CleanupReport::default();
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("read dir", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("read dir", &dir, e))?;
            let name = entry.file_name();
            let referenced = name
                .to_str()
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|id| ids.contains(&id));
            if referenced {
                continue;
            }
            match remove_snapshot_dir(&entry.path()) {
                Ok(()) => {
                    tracing::info!(dir = %entry.path().display(), "cleanup removed orphan directory");
                    report.removed += 1;
                }
                Err(e) => {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "cleanup cannot remove orphan directory");
                    report.skipped += 1;
                }
            }
        }
        self.cleanup_staging(std::time::SystemTime::now(), &mut report);
        Ok(report)
    }

    /// Removes staged layers untouched for [`STAGING_MAX_AGE`] before `now`: a pull that
    /// was killed leaves its unpacked directories behind. Age is the directory's inode
    /// change time, which unpacking refreshes and nothing can set back (its mtime is the
    /// layer's own, often days old, so it says nothing about the pull).
    pub fn cleanup_staging(&self, now: std::time::SystemTime, report: &mut CleanupReport) {
        use std::os::unix::fs::MetadataExt;
        let dir = self.staging_dir();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let changed = entry.metadata().ok().and_then(|m| {
                std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(
                    u64::try_from(m.ctime()).ok()?,
                ))
            });
            let age = changed.and_then(|c| now.duration_since(c).ok());
            if age.is_none_or(|a| a < STAGING_MAX_AGE) {
                continue;
            }
            match remove_snapshot_dir(&entry.path()) {
                Ok(()) => {
                    tracing::info!(dir = %entry.path().display(), "cleanup removed a stale staged layer");
                    report.removed += 1;
                }
                Err(e) => {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "cleanup cannot remove a stale staged layer");
                    report.skipped += 1;
                }
            }
        }
    }
}

/// Reads records either from a pending write transaction or from the database.
enum ReadView<'a> {
    Txn(&'a crate::meta::Txn),
    Meta(&'a Metadata),
}

fn txn_view(txn: &crate::meta::Txn) -> ReadView<'_> {
    ReadView::Txn(txn)
}

impl ReadView<'_> {
    fn get(&self, ns: &str, key: &str) -> Result<Option<Record>> {
        match self {
            ReadView::Txn(t) => t.get(ns, key),
            ReadView::Meta(m) => m.get(ns, key),
        }
    }
}

fn info(name: &str, record: &Record) -> Info {
    Info {
        name: name.to_owned(),
        parent: record.parent.clone(),
        kind: record.kind,
        labels: record
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        created: record.created.system_time(),
        updated: record.updated.system_time(),
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidArgument(
            "snapshot key must not be empty".to_owned(),
        ));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "snapshot key longer than {MAX_KEY_LEN} bytes"
        )));
    }
    if key.contains('\0') {
        return Err(Error::InvalidArgument(
            "snapshot key must not contain NUL".to_owned(),
        ));
    }
    Ok(())
}

fn check_labels(labels: &HashMap<String, String>) -> Result<()> {
    if labels.len() > MAX_LABELS {
        return Err(Error::InvalidArgument(format!(
            "more than {MAX_LABELS} labels"
        )));
    }
    for (k, v) in labels {
        if k.is_empty() {
            return Err(Error::InvalidArgument(
                "label key must not be empty".to_owned(),
            ));
        }
        if k.len() + v.len() > MAX_LABEL_LEN {
            return Err(Error::InvalidArgument(format!(
                "label {:?}: key and value longer than {MAX_LABEL_LEN} bytes",
                k.chars().take(64).collect::<String>()
            )));
        }
    }
    Ok(())
}

/// The one line that says a layer takes the ordinary path: image, layer, why, and what
/// to do about it. A failure (registry, credentials, mount) is a warning; an image that
/// simply has no index is not.
fn log_not_lazy(ns: &str, key: &str, layer: &LayerLabels, not_lazy: &NotLazy) {
    let image = layer.image_ref.as_deref().unwrap_or("-");
    let digest = layer.layer_digest.as_deref().unwrap_or("-");
    let reason = not_lazy.reason.name();
    let hint = not_lazy.reason.hint(layer.image_ref.as_deref());
    let detail = not_lazy.detail.as_str();
    let target = layer.target.as_str();
    if not_lazy.reason.is_failure() {
        tracing::warn!(
            ns,
            key,
            target,
            image,
            layer = digest,
            reason,
            detail,
            hint,
            "layer not served lazily: it is downloaded and unpacked the ordinary way"
        );
    } else {
        tracing::info!(
            ns,
            key,
            target,
            image,
            layer = digest,
            reason,
            detail,
            hint,
            "layer not served lazily: it is downloaded and unpacked the ordinary way"
        );
    }
}

/// Removes everything in `dir` (used when a remote attempt left files behind).
fn empty_dir(dir: &Path) -> Result<()> {
    if !mounts_under(dir)?.is_empty() {
        return Err(Error::Internal(format!(
            "{} is still a mount point after a failed remote mount",
            dir.display()
        )));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("read dir", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read dir", dir, e))?;
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let removed = if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| Error::io("remove", &path, e))?;
    }
    Ok(())
}

/// Removes a snapshot directory, first detaching anything still mounted inside it, so a
/// recursive delete can never reach into a mounted filesystem.
pub(crate) fn remove_snapshot_dir(dir: &Path) -> Result<()> {
    for mount_point in mounts_under(dir)? {
        detach(&mount_point)?;
    }
    if !mounts_under(dir)?.is_empty() {
        return Err(Error::Internal(format!(
            "{} still has mounts inside",
            dir.display()
        )));
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", dir, e)),
    }
}

/// Mount points at or below `dir`, deepest first (from /proc/self/mountinfo).
/// Creates `dir` (and missing parents) 0700, and makes an existing one 0700; a shared
/// sticky directory (`/tmp`) is refused rather than locked.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    if std::fs::metadata(dir)?.permissions().mode() & 0o1000 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "a shared (sticky) directory cannot be the snapshotter's root",
        ));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let info = match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(s) => s,
        Err(e) => return Err(Error::io("read", "/proc/self/mountinfo", e)),
    };
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|p| p.starts_with(&dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    Ok(found)
}

fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            let value = std::str::from_utf8(digits)
                .ok()
                .and_then(|oct| u8::from_str_radix(oct, 8).ok());
            if let Some(v) = value {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn detach(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument(format!("path {} contains NUL", path.display())))?;
    // SAFETY: c_path is a valid NUL-terminated string that outlives the call.
    let rc = unsafe { libc::umount2(c_path.as_ptr(), libc::MNT_DETACH) };
    if rc != 0 {
        return Err(Error::io("unmount", path, std::io::Error::last_os_error()));
    }
    tracing::info!(path = %path.display(), "detached leftover mount");
    Ok(())
}
