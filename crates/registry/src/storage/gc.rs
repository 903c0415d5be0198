//! Garbage collection: removes what no repository can reach any more, while the registry
//! keeps serving.
//!
//! Mark: in every repository, the roots are its tagged manifests (and every linked
//! manifest unless `delete_untagged`); from each reachable manifest, its config, layers,
//! index children and subject are reachable, and so are the manifests that refer to it
//! (referrers). Sweep: unreachable manifests are unlinked (only with `delete_untagged`),
//! unreachable blob links removed, and blobs that no repository links any more deleted;
//! upload sessions untouched for a day are dropped.
//!
//! Why it is safe to run while serving: nothing younger than the grace period is removed
//! — not a manifest link, not a blob link, not a blob. A client pushes layers before the
//! manifest that references them, so a layer pushed just before this run started is
//! young and survives until its manifest arrives. Backends refresh a blob's time when it
//! is pushed again (and the filesystem and memory backends when it is linked), so a
//! re-push of an old unreferenced blob during a run keeps it too. The grace period must
//! therefore exceed the longest push (layers → manifest) a client may take.
//!
//! A manifest that cannot be parsed is reported, and nothing its repository links is
//! removed, since what it references is unknown.
//!
//! # Collections and manifest pushes agree through storage
//!
//! The grace period protects a push whose manifest arrives while a collection runs; it
//! cannot protect one whose blob a collection *already decided* to remove, a moment
//! before the push re-checked and refreshed that blob and committed the manifest. So the
//! two sides also meet in storage, through empty records in four places
//! ([`RECORD_DIRS`]), which every backend (and every process on one store) shares:
//!
//! * A collection writes `running/<id>` before it reads anything, refreshes it while it
//!   works and removes it (with its other records) when done.
//! * Before each removal (a manifest link, a blob link, a blob) of digest `d`, the
//!   collection writes `deleting/<id>-<d>`, then reads `pins/<id>-<d>`: if that exists
//!   it spares `d`; otherwise it writes `removed/<d>`, removes `d`, then its `deleting`
//!   record. The `removed` record outlives the collection: a later collection reaps it
//!   once it is older than [`LEASE`].
//! * After committing a manifest (and its tag), a push lists `running/`, writes
//!   `pins/<id>-<d>` for every running collection and every digest `d` the manifest
//!   reaches (itself, config, layers, index children and what they reach), waits until no
//!   `deleting/<id>-<d>` of those exists, and only then checks in storage that every one
//!   of them is still there. If one is gone it undoes its commit (the tag goes back to
//!   what it was, a manifest it created is unlinked) and answers `MANIFEST_BLOB_UNKNOWN`
//!   ([`pin_referenced`]).
//! * A sparse manifest may leave references out, so a push that finds one absent before
//!   committing cannot tell a gap from content a collection removed (pushed, say, and
//!   collected before its manifest arrived). Absent `d` is a gap only if `removed/<d>`
//!   does not exist; otherwise the push refuses as if sparse manifests were not accepted
//!   ([`removed_recently`]).
//!
//! Why no committed manifest then references a removed blob, in every interleaving
//! (storage operations are atomic and each is seen by every later one): take a removal of
//! `d` by collection G and a push P whose final check found `d`.
//! - G wrote `running` after P listed `running/`: G's reads all come after P's commit,
//!   so G reaches `d` from P's manifest and does not remove it.
//! - G's `running` was listed by P, so P pinned `d` under G. If G read the pin after P
//!   wrote it, G spared `d`. Otherwise G wrote `deleting` before reading the pin, so
//!   before P's pin and before P's wait: P either saw that record and waited until G
//!   removed it — after removing `d` — or G had already removed it, and `d` with it. In
//!   both cases the removal came before P's final check, which would have found `d`
//!   missing: contradiction.
//! - G had already ended (removed `running`) when P listed: every removal of G came
//!   before P's check, which would have noticed it.
//!
//! And no committed manifest leaves out, as a sparse gap, something a collection removed
//! before the push looked: the collection wrote `removed/<d>` before removing `d`, so
//! before the push found `d` absent and then looked for the record, which it found (it
//! lives [`LEASE`], far longer than a push takes between the two).
//!
//! So a push that succeeds is never undercut by a collection, and one that loses the
//! race says so instead of leaving a tag that cannot be pulled. Costs: one listing per
//! manifest push while no collection runs, one read per reference a manifest leaves out;
//! three small writes and a read per deletion.
//!
//! Liveness: a collection that crashes leaves its records; a collection record not
//! refreshed for [`LEASE`] is ignored by pushes and removed by the next collection. A
//! collection that finds it has not refreshed its record for half the lease (a process
//! stopped for minutes) stops instead of removing anything, so the one assumption left is
//! that a collection is not suspended for more than half the lease between refreshing
//! its record and the removal that follows, and that the clocks of the hosts involved
//! (the store's, for S3) agree to within minutes. Until a dead collection's records are
//! reaped, a push referencing the one digest it was removing waits [`DELETION_WAIT`] and
//! fails rather than risk it.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use ferry_oci::{RepositoryName, Tag};
use serde::Deserialize;

use super::{LinkInfo, Result, Storage, StorageError, digest_hex, new_upload_id};

/// Where collections and pushes leave their coordination records (see the module
/// documentation): running collections, removals in progress, digests pushes pinned,
/// and digests collections removed (in the last [`LEASE`]).
pub const RECORD_DIRS: &[&str] = &[RUNNING, DELETING, PINS, REMOVED];
const RUNNING: &str = "running";
const DELETING: &str = "deleting";
const PINS: &str = "pins";
const REMOVED: &str = "removed";

/// A collection whose `running` record was not refreshed for this long is taken for dead:
/// pushes ignore it and the next collection removes its records. Also how long a
/// `removed` record is kept.
pub const LEASE: Duration = Duration::from_secs(10 * 60);
/// A running collection refreshes its record at least this often (before a removal).
const HEARTBEAT: Duration = Duration::from_secs(30);
/// How long a push waits for a collection to finish removing something it references.
pub const DELETION_WAIT: Duration = Duration::from_secs(30);
/// How often a waiting push looks again.
const DELETION_POLL: Duration = Duration::from_millis(10);

/// Upload sessions untouched this long are abandoned.
pub const UPLOAD_MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// What a collection may remove.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcOptions {
    /// Nothing written more recently than this is removed.
    pub grace: Duration,
    /// Also unlink manifests no tag reaches (and then what only they referenced).
    pub delete_untagged: bool,
    /// Report what would be removed, change nothing.
    pub dry_run: bool,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            grace: Duration::from_secs(60 * 60),
            delete_untagged: false,
            dry_run: false,
        }
    }
}

/// What a collection removed (or, in a dry run, would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub repositories: usize,
    /// `(repository, digest)` of each manifest unlinked.
    pub manifests_deleted: Vec<(String, String)>,
    pub blob_links_removed: usize,
    pub blobs_deleted: usize,
    pub bytes_freed: u64,
    pub uploads_removed: usize,
    /// Unreachable manifests, links and blobs spared only because they are young.
    pub kept_young: usize,
    /// Removals decided and then skipped because a manifest push pinned the digest.
    pub kept_pinned: usize,
    /// `repository@digest: problem` for manifests that could not be read or parsed.
    pub problems: Vec<String>,
}

/// The parts of any manifest kind that reference other content. Unknown fields are
/// ignored; a field of the wrong shape makes the manifest malformed.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct References {
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    /// Image index children.
    #[serde(default)]
    manifests: Vec<Descriptor>,
    /// OCI artifact manifest (1.1 release candidates).
    #[serde(default)]
    blobs: Vec<Descriptor>,
    #[serde(default)]
    subject: Option<Descriptor>,
    /// Docker schema 1.
    #[serde(default)]
    fs_layers: Vec<Schema1Layer>,
}

#[derive(Debug, Deserialize)]
struct Descriptor {
    digest: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Schema1Layer {
    blob_sum: String,
}

/// Runs one collection over every repository of `storage`.
pub async fn collect(storage: &dyn Storage, opts: &GcOptions) -> Result<GcReport> {
    if opts.dry_run {
        return collect_with(storage, opts, None).await;
    }
    let mut run = Running::begin(storage).await?;
    let result = collect_with(storage, opts, Some(&mut run)).await;
    let ended = run.end().await;
    let report = result?;
    ended?;
    Ok(report)
}

/// What a collection removes, one digest at a time.
enum Removal<'a> {
    Manifest(&'a RepositoryName),
    BlobLink(&'a RepositoryName),
    Blob,
}

/// A collection's presence in storage (its `running` record) and its removals.
struct Running<'a> {
    storage: &'a dyn Storage,
    id: String,
    beat: Instant,
}

impl<'a> Running<'a> {
    /// Reaps the records of dead collections, then announces this one.
    async fn begin(storage: &'a dyn Storage) -> Result<Running<'a>> {
        reap_dead(storage).await?;
        let id = new_upload_id();
        storage.gc_record_put(RUNNING, &id).await?;
        Ok(Running {
            storage,
            id,
            beat: Instant::now(),
        })
    }

    /// Refreshes the `running` record if due; stops the collection if it has been away
    /// so long that pushes may have taken it for dead, or another collection reaped it.
    async fn beat(&mut self) -> Result<()> {
        let since = self.beat.elapsed();
        if since < HEARTBEAT {
            return Ok(());
        }
        if since >= LEASE / 2 || !self.storage.gc_record_exists(RUNNING, &self.id).await? {
            return Err(StorageError::Io(std::io::Error::other(
                "garbage collection stalled past its lease; stopping before removing anything more",
            )));
        }
        self.storage.gc_record_put(RUNNING, &self.id).await?;
        self.beat = Instant::now();
        Ok(())
    }

    /// Removes `digest` as `what` says unless a push pinned it: `None` if spared,
    /// else whether it existed.
    async fn remove(&mut self, digest: &str, what: Removal<'_>) -> Result<Option<bool>> {
        self.beat().await?;
        let name = record_name(&self.id, digest)?;
        // Listed by the backend, so valid; parsed once here, where it enters as text.
        let digest =
            ferry_oci::digest::parse(digest).map_err(|e| StorageError::Invalid(e.to_string()))?;
        let digest = &digest;
        self.storage.gc_record_put(DELETING, &name).await?;
        let result = if self.storage.gc_record_exists(PINS, &name).await? {
            Ok(None)
        } else {
            // Before the removal: a push that then finds `digest` absent knows it was
            // removed, not left out.
            self.storage
                .gc_record_put(REMOVED, digest_hex(digest.as_ref())?)
                .await?;
            match what {
                Removal::Manifest(repo) => self.storage.manifest_delete(repo, digest).await,
                Removal::BlobLink(repo) => self.storage.unlink_blob(repo, digest).await,
                Removal::Blob => self.storage.blob_delete(digest).await,
            }
            .map(Some)
        };
        self.storage.gc_record_delete(DELETING, &name).await?;
        result
    }

    /// Removes this collection's records, `running` last.
    async fn end(self) -> Result<()> {
        let prefix = format!("{}-", self.id);
        for dir in [PINS, DELETING] {
            for (name, _) in self.storage.gc_record_list(dir).await? {
                if name.starts_with(&prefix) {
                    self.storage.gc_record_delete(dir, &name).await?;
                }
            }
        }
        self.storage.gc_record_delete(RUNNING, &self.id).await?;
        Ok(())
    }
}

/// `<collection id>-<hex of digest>` (64 hex digits for sha256, 128 for sha512: the
/// length tells the algorithms apart, and sha256 records keep the name they always had).
fn record_name(id: &str, digest: &str) -> Result<String> {
    Ok(format!("{id}-{}", digest_hex(digest)?))
}

fn older_than(t: SystemTime, age: Duration, now: SystemTime) -> bool {
    now.duration_since(t).is_ok_and(|a| a >= age)
}

/// Removes the records of collections that stopped refreshing theirs for [`LEASE`],
/// `pins`/`deleting` records older than that of collections no longer running, and
/// `removed` records older than that.
async fn reap_dead(storage: &dyn Storage) -> Result<()> {
    let now = SystemTime::now();
    let mut live = HashSet::new();
    for (id, t) in storage.gc_record_list(RUNNING).await? {
        if older_than(t, LEASE, now) {
            tracing::warn!(collection = %id, "removing the records of a dead garbage collection");
            storage.gc_record_delete(RUNNING, &id).await?;
        } else {
            live.insert(id);
        }
    }
    for dir in [PINS, DELETING] {
        for (name, t) in storage.gc_record_list(dir).await? {
            let owner = name.split('-').next().unwrap_or_default();
            if !live.contains(owner) && older_than(t, LEASE, now) {
                storage.gc_record_delete(dir, &name).await?;
            }
        }
    }
    for (name, t) in storage.gc_record_list(REMOVED).await? {
        if older_than(t, LEASE, now) {
            storage.gc_record_delete(REMOVED, &name).await?;
        }
    }
    Ok(())
}

/// Whether a collection removed `digest` (a manifest link, a blob link or the blob) in
/// the last [`LEASE`] or so (module documentation): a push that found a reference absent
/// asks this before taking it for a gap a sparse manifest may leave. Conservative: a
/// record older than the lease counts until a collection reaps it, and a removal from
/// any repository counts.
pub async fn removed_recently(storage: &dyn Storage, digest: &str) -> Result<bool> {
    storage.gc_record_exists(REMOVED, digest_hex(digest)?).await
}

/// The push's side of the protocol (module documentation), called after a manifest that
/// reaches `digests` was committed: pins every digest under every running collection and
/// waits until none of them is being removed. The caller must then check in storage that
/// each digest is still there, and undo its commit if not. Returns the first digest a
/// collection was still removing after [`DELETION_WAIT`] (treat it as gone), else `None`.
pub async fn pin_referenced(storage: &dyn Storage, digests: &[String]) -> Result<Option<String>> {
    let now = SystemTime::now();
    let running: Vec<String> = storage
        .gc_record_list(RUNNING)
        .await?
        .into_iter()
        .filter(|(_, t)| !older_than(*t, LEASE, now))
        .map(|(id, _)| id)
        .collect();
    let mut names = Vec::with_capacity(running.len() * digests.len());
    for id in &running {
        for d in digests {
            let name = record_name(id, d)?;
            storage.gc_record_put(PINS, &name).await?;
            names.push((name, d));
        }
    }
    let deadline = Instant::now() + DELETION_WAIT;
    for (name, d) in &names {
        while storage.gc_record_exists(DELETING, name).await? {
            if Instant::now() >= deadline {
                return Ok(Some((*d).clone()));
            }
            tokio::time::sleep(DELETION_POLL).await;
        }
    }
    // Pins under a collection that has ended since protect nothing (it removes nothing
    // more), and it may have cleared its pins before these were written: remove them.
    for id in &running {
        if storage.gc_record_exists(RUNNING, id).await? {
            continue;
        }
        for (name, _) in names.iter().filter(|(n, _)| n.starts_with(id.as_str())) {
            storage.gc_record_delete(PINS, name).await?;
        }
    }
    Ok(None)
}

async fn collect_with(
    storage: &dyn Storage,
    opts: &GcOptions,
    mut run: Option<&mut Running<'_>>,
) -> Result<GcReport> {
    let now = SystemTime::now();
    let young = |modified: Option<SystemTime>| match modified {
        // Unknown age: treat as young rather than risk removing something in use.
        None => true,
        Some(t) => now.duration_since(t).map_or(true, |age| age < opts.grace),
    };
    let mut report = GcReport::default();
    // Digests some repository still links after the sweep (used by a dry run, where the
    // store itself does not change).
    let mut still_linked: HashSet<String> = HashSet::new();

    let repos = storage.repo_list().await?;
    report.repositories = repos.len();
    for repo in &repos {
        let Ok(repo) = RepositoryName::parse(repo) else {
            report
                .problems
                .push(format!("{repo:?}: not a repository name"));
            continue;
        };
        let repo = &repo;
        sweep_repository(
            storage,
            repo,
            opts,
            &young,
            &mut report,
            &mut still_linked,
            run.as_deref_mut(),
        )
        .await?;
    }

    // Blobs first, then links: a link made after this listing belongs to a blob that was
    // just pushed or linked, which is young.
    let blobs = storage.blob_list().await?;
    let linked = if opts.dry_run {
        still_linked
    } else {
        let mut linked = HashSet::new();
        for repo in storage.repo_list().await? {
            let Ok(repo) = RepositoryName::parse(&repo) else {
                continue;
            };
            for link in storage.repo_blob_links(&repo).await? {
                linked.insert(link.digest);
            }
            for link in storage.manifest_links(&repo).await? {
                linked.insert(link.digest);
            }
        }
        linked
    };
    for blob in blobs {
        if linked.contains(&blob.digest) {
            continue;
        }
        if young(Some(blob.modified)) {
            report.kept_young += 1;
            continue;
        }
        let removed = match run.as_deref_mut() {
            None => Some(true),
            Some(run) => run.remove(&blob.digest, Removal::Blob).await?,
        };
        match removed {
            None => report.kept_pinned += 1,
            Some(true) => {
                report.blobs_deleted += 1;
                report.bytes_freed += blob.size;
            }
            Some(false) => {}
        }
    }

    for id in storage.upload_list_stale(UPLOAD_MAX_AGE).await? {
        if opts.dry_run || storage.upload_cancel(&id).await? {
            report.uploads_removed += 1;
        }
    }
    tracing::debug!(
        ?report,
        dry_run = opts.dry_run,
        "garbage collection finished"
    );
    Ok(report)
}

/// Marks what `repo` reaches and removes its unreachable manifest and blob links.
async fn sweep_repository(
    storage: &dyn Storage,
    repo: &RepositoryName,
    opts: &GcOptions,
    young: &impl Fn(Option<SystemTime>) -> bool,
    report: &mut GcReport,
    still_linked: &mut HashSet<String>,
    mut run: Option<&mut Running<'_>>,
) -> Result<()> {
    let manifests: Vec<LinkInfo> = storage.manifest_links(repo).await?;
    let linked_manifests: HashSet<&str> = manifests.iter().map(|m| m.digest.as_str()).collect();

    let mut work: Vec<String> = Vec::new();
    if opts.delete_untagged {
        for tag in storage.tag_list(repo).await?.unwrap_or_default() {
            let Ok(tag) = Tag::parse(&tag) else {
                continue;
            };
            if let Some(target) = storage.tag_get(repo, &tag).await? {
                work.push(target);
            }
        }
        // A manifest pushed by digest just now may be about to be tagged or referenced.
        work.extend(
            manifests
                .iter()
                .filter(|m| young(m.modified))
                .map(|m| m.digest.clone()),
        );
    } else {
        work.extend(manifests.iter().map(|m| m.digest.clone()));
    }

    let mut reachable_manifests: HashSet<String> = HashSet::new();
    let mut reachable_blobs: HashSet<String> = HashSet::new();
    let mut links_unknown = false;
    while let Some(digest) = work.pop() {
        if !linked_manifests.contains(digest.as_str()) || reachable_manifests.contains(&digest) {
            continue;
        }
        reachable_manifests.insert(digest.clone());
        reachable_blobs.insert(digest.clone());
        // A linked manifest's digest came from the backend's listing: it parses.
        let Ok(typed) = ferry_oci::digest::parse(&digest) else {
            continue;
        };
        let Some(manifest) = storage.manifest_get(repo, &typed).await? else {
            report.problems.push(format!(
                "{repo}@{digest}: linked but its content is missing"
            ));
            continue;
        };
        let refs: References = match serde_json::from_slice(&manifest.bytes) {
            Ok(refs) => refs,
            Err(e) => {
                report
                    .problems
                    .push(format!("{repo}@{digest}: not a manifest: {e}"));
                links_unknown = true;
                continue;
            }
        };
        let blobs = refs
            .config
            .iter()
            .chain(&refs.layers)
            .chain(&refs.blobs)
            .map(|d| d.digest.clone())
            .chain(refs.fs_layers.into_iter().map(|l| l.blob_sum));
        reachable_blobs.extend(blobs);
        for child in refs.manifests.into_iter().chain(refs.subject) {
            reachable_blobs.insert(child.digest.clone());
            work.push(child.digest);
        }
        work.extend(storage.referrer_list(repo, &typed).await?);
    }

    for manifest in &manifests {
        if reachable_manifests.contains(&manifest.digest) {
            still_linked.insert(manifest.digest.clone());
            continue;
        }
        // Only reached when `delete_untagged`: otherwise every manifest is a root.
        if links_unknown {
            still_linked.insert(manifest.digest.clone());
            continue;
        }
        let removed = match run.as_deref_mut() {
            None => Some(true),
            Some(run) => {
                run.remove(&manifest.digest, Removal::Manifest(repo))
                    .await?
            }
        };
        match removed {
            None => {
                report.kept_pinned += 1;
                still_linked.insert(manifest.digest.clone());
            }
            Some(true) => report
                .manifests_deleted
                .push((repo.to_string(), manifest.digest.clone())),
            Some(false) => {}
        }
    }

    for link in storage.repo_blob_links(repo).await? {
        if reachable_blobs.contains(&link.digest) || links_unknown {
            still_linked.insert(link.digest);
            continue;
        }
        if young(link.modified) {
            report.kept_young += 1;
            still_linked.insert(link.digest);
            continue;
        }
        let removed = match run.as_deref_mut() {
            None => Some(true),
            Some(run) => run.remove(&link.digest, Removal::BlobLink(repo)).await?,
        };
        match removed {
            None => {
                report.kept_pinned += 1;
                still_linked.insert(link.digest);
            }
            Some(true) => report.blob_links_removed += 1,
            Some(false) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use super::super::StoredManifest;
    use super::super::conformance::{LIMIT, body, digest, manifest_json, stored, td, tr, tt};
    use super::super::fs::FsStorage;
    use super::super::memory::MemoryStorage;
    use super::*;

    fn now_opts(delete_untagged: bool) -> GcOptions {
        GcOptions {
            grace: Duration::ZERO,
            delete_untagged,
            dry_run: false,
        }
    }

    /// Pushes a blob and links it into `repo`, like a client's layer push.
    async fn push_blob(s: &dyn Storage, repo: &str, data: &[u8]) -> String {
        let d = digest(data);
        s.blob_put(&td(&d), body(&[data]), LIMIT).await.unwrap();
        s.link_blob(&tr(repo), &td(&d)).await.unwrap();
        d
    }

    /// Pushes an image (config + layers + manifest), tagged if `tag` is given.
    async fn push_image(
        s: &dyn Storage,
        repo: &str,
        name: &str,
        tag: Option<&str>,
    ) -> (StoredManifest, Vec<String>) {
        let config = push_blob(s, repo, format!("{name} config").as_bytes()).await;
        let layer = push_blob(s, repo, format!("{name} layer").as_bytes()).await;
        let m = stored(manifest_json(&config, &[&layer], None));
        s.manifest_put(&tr(repo), &m).await.unwrap();
        if let Some(tag) = tag {
            s.tag_set(&tr(repo), &tt(tag), &td(&m.digest))
                .await
                .unwrap();
        }
        (m, vec![config, layer])
    }

    async fn exists(s: &dyn Storage, d: &str) -> bool {
        s.blob_size(&td(d)).await.unwrap().is_some()
    }

    #[tokio::test]
    async fn keeps_what_manifests_reach_and_deletes_the_rest() {
        let s = MemoryStorage::default();
        let (tagged, tagged_blobs) = push_image(&s, "app", "one", Some("v1")).await;
        let (untagged, untagged_blobs) = push_image(&s, "app", "two", None).await;
        let orphan = push_blob(&s, "app", b"orphan layer").await;
        let unlinked = digest(b"never linked");
        s.blob_put(&td(&unlinked), body(&[b"never linked"]), LIMIT)
            .await
            .unwrap();

        let report = collect(&s, &now_opts(false)).await.unwrap();
        assert_eq!(report.repositories, 1);
        assert!(report.manifests_deleted.is_empty());
        assert_eq!(report.blob_links_removed, 1);
        assert_eq!(report.blobs_deleted, 2);
        assert_eq!(
            report.bytes_freed,
            (b"orphan layer".len() + b"never linked".len()) as u64
        );
        assert!(!exists(&s, &orphan).await && !exists(&s, &unlinked).await);
        assert!(!s.blob_linked(&tr("app"), &td(&orphan)).await.unwrap());
        for d in tagged_blobs.iter().chain(&untagged_blobs) {
            assert!(
                exists(&s, d).await && s.blob_linked(&tr("app"), &td(d)).await.unwrap(),
                "{d}"
            );
        }
        assert!(
            s.manifest_get(&tr("app"), &td(&untagged.digest))
                .await
                .unwrap()
                .is_some()
        );

        // Now drop untagged manifests too.
        let report = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!(
            report.manifests_deleted,
            vec![("app".to_string(), untagged.digest.clone())]
        );
        assert_eq!(report.blob_links_removed, 2);
        assert_eq!(
            report.blobs_deleted, 3,
            "config, layer and the manifest itself"
        );
        assert!(
            s.manifest_get(&tr("app"), &td(&untagged.digest))
                .await
                .unwrap()
                .is_none()
        );
        assert!(!exists(&s, &untagged.digest).await);
        for d in &untagged_blobs {
            assert!(!exists(&s, d).await, "{d}");
        }
        assert!(
            s.manifest_get(&tr("app"), &td(&tagged.digest))
                .await
                .unwrap()
                .is_some()
        );
        for d in &tagged_blobs {
            assert!(exists(&s, d).await, "{d}");
        }
        // A second run finds nothing more.
        let again = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!((again.blobs_deleted, again.blob_links_removed), (0, 0));
        assert!(again.manifests_deleted.is_empty());
    }

    #[tokio::test]
    async fn a_blob_used_by_another_repository_survives() {
        let s = MemoryStorage::default();
        let shared = push_blob(&s, "a", b"shared layer").await;
        s.link_blob(&tr("b"), &td(&shared)).await.unwrap();
        let config = push_blob(&s, "b", b"config").await;
        let m = stored(manifest_json(&config, &[&shared], None));
        s.manifest_put(&tr("b"), &m).await.unwrap();
        s.tag_set(&tr("b"), &tt("latest"), &td(&m.digest))
            .await
            .unwrap();

        let report = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!(report.blob_links_removed, 1, "a's link goes");
        assert_eq!(report.blobs_deleted, 0, "b still links it");
        assert!(!s.blob_linked(&tr("a"), &td(&shared)).await.unwrap());
        assert!(s.blob_linked(&tr("b"), &td(&shared)).await.unwrap());
        assert!(exists(&s, &shared).await);
    }

    #[tokio::test]
    async fn index_children_and_referrers_stay_reachable() {
        let s = MemoryStorage::default();
        let (amd64, amd64_blobs) = push_image(&s, "multi", "amd64", None).await;
        let (arm64, _) = push_image(&s, "multi", "arm64", None).await;
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd64.digest, "size": 1},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm64.digest, "size": 1},
            ],
        });
        let index = stored(serde_json::to_vec(&index).unwrap());
        s.manifest_put(&tr("multi"), &index).await.unwrap();
        s.tag_set(&tr("multi"), &tt("latest"), &td(&index.digest))
            .await
            .unwrap();
        // A signature of the index (untagged, found through referrers), and a signature of
        // a manifest that is itself garbage.
        let sig_config = push_blob(&s, "multi", b"sig config").await;
        let sig = stored(manifest_json(&sig_config, &[], Some(&index.digest)));
        s.manifest_put(&tr("multi"), &sig).await.unwrap();
        s.referrer_add(&tr("multi"), &td(&index.digest), &td(&sig.digest))
            .await
            .unwrap();
        let (garbage, _) = push_image(&s, "multi", "garbage", None).await;
        let garbage_sig = stored(manifest_json(
            &sig_config,
            &[&digest(b"x")],
            Some(&garbage.digest),
        ));
        s.manifest_put(&tr("multi"), &garbage_sig).await.unwrap();
        s.referrer_add(&tr("multi"), &td(&garbage.digest), &td(&garbage_sig.digest))
            .await
            .unwrap();

        let report = collect(&s, &now_opts(true)).await.unwrap();
        let mut deleted: Vec<&str> = report
            .manifests_deleted
            .iter()
            .map(|(_, d)| d.as_str())
            .collect();
        deleted.sort();
        let mut expected = vec![garbage.digest.as_str(), garbage_sig.digest.as_str()];
        expected.sort();
        assert_eq!(deleted, expected);
        for m in [&index, &amd64, &arm64, &sig] {
            assert!(
                s.manifest_get(&tr("multi"), &td(&m.digest))
                    .await
                    .unwrap()
                    .is_some(),
                "{}",
                m.digest
            );
        }
        for d in amd64_blobs.iter().chain([&sig_config]) {
            assert!(exists(&s, d).await, "{d}");
        }
    }

    #[tokio::test]
    async fn grace_period_protects_a_push_in_progress() {
        let s = Arc::new(MemoryStorage::default());
        let hour = GcOptions {
            grace: Duration::from_secs(3600),
            delete_untagged: true,
            dry_run: false,
        };
        // A client has pushed its layers and not yet its manifest when collection runs.
        let config = push_blob(s.as_ref(), "app", b"config").await;
        let layer = push_blob(s.as_ref(), "app", b"layer").await;
        let untagged = stored(manifest_json(&config, &[], None));
        s.manifest_put(&tr("app"), &untagged).await.unwrap();
        let report = collect(s.as_ref(), &hour).await.unwrap();
        assert_eq!(report.blobs_deleted + report.blob_links_removed, 0);
        assert!(report.manifests_deleted.is_empty());
        assert_eq!(report.kept_young, 1, "the layer's link: {report:?}");
        // The push completes and refers to everything it uploaded.
        let m = stored(manifest_json(&config, &[&layer], None));
        s.manifest_put(&tr("app"), &m).await.unwrap();
        s.tag_set(&tr("app"), &tt("v1"), &td(&m.digest))
            .await
            .unwrap();
        assert!(
            exists(s.as_ref(), &layer).await
                && s.blob_linked(&tr("app"), &td(&layer)).await.unwrap()
        );

        // Pushes racing a collection, many times over: nothing pushed is ever lost.
        for round in 0..20u32 {
            let s2 = s.clone();
            let push = async move {
                let layer =
                    push_blob(s2.as_ref(), "race", format!("layer {round}").as_bytes()).await;
                tokio::task::yield_now().await;
                let m = stored(manifest_json(&layer, &[&layer], None));
                s2.manifest_put(&tr("race"), &m).await.unwrap();
                s2.tag_set(&tr("race"), &tt(&format!("r{round}")), &td(&m.digest))
                    .await
                    .unwrap();
                (layer, m.digest)
            };
            let (pushed, gc) = tokio::join!(push, collect(s.as_ref(), &hour));
            gc.unwrap();
            let (layer, manifest) = pushed;
            assert!(exists(s.as_ref(), &layer).await, "round {round}");
            assert!(
                s.manifest_get(&tr("race"), &td(&manifest))
                    .await
                    .unwrap()
                    .is_some(),
                "round {round}"
            );
        }
        // Without the grace period the same layers would be gone: the test can tell.
        let orphan = push_blob(s.as_ref(), "app", b"orphan").await;
        collect(s.as_ref(), &hour).await.unwrap();
        assert!(exists(s.as_ref(), &orphan).await);
        collect(s.as_ref(), &now_opts(true)).await.unwrap();
        assert!(!exists(s.as_ref(), &orphan).await);
    }

    #[tokio::test]
    async fn old_content_on_disk_goes_after_the_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsStorage::open(dir.path()).unwrap();
        let old = push_blob(&s, "app", b"old orphan").await;
        let fresh = push_blob(&s, "app", b"fresh orphan").await;
        let two_hours_ago = SystemTime::now() - Duration::from_secs(7200);
        let hex = old.strip_prefix("sha256:").unwrap();
        for path in [
            dir.path().join(format!("blobs/sha256/{}/{hex}", &hex[..2])),
            dir.path()
                .join(format!("repositories/app/_layers/sha256/{hex}")),
        ] {
            std::fs::File::options()
                .write(true)
                .open(path)
                .unwrap()
                .set_modified(two_hours_ago)
                .unwrap();
        }
        // Upload sessions: one abandoned two days ago, one in progress.
        let abandoned = s.upload_start(&tr("conformance/repo")).await.unwrap();
        let active = s.upload_start(&tr("conformance/repo")).await.unwrap();
        let data = dir.path().join("uploads").join(&abandoned).join("data");
        std::fs::File::options()
            .write(true)
            .open(data)
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(2 * 86400))
            .unwrap();

        let opts = GcOptions {
            grace: Duration::from_secs(3600),
            ..GcOptions::default()
        };
        let dry = collect(
            &s,
            &GcOptions {
                dry_run: true,
                ..opts.clone()
            },
        )
        .await
        .unwrap();
        assert_eq!(
            (
                dry.blob_links_removed,
                dry.blobs_deleted,
                dry.uploads_removed
            ),
            (1, 1, 1)
        );
        assert!(exists(&s, &old).await, "dry run changes nothing");
        assert_eq!(s.upload_size(&abandoned).await.unwrap(), Some(0));

        let report = collect(&s, &opts).await.unwrap();
        assert_eq!(report.blob_links_removed, dry.blob_links_removed);
        assert_eq!(report.blobs_deleted, dry.blobs_deleted);
        assert_eq!(report.bytes_freed, b"old orphan".len() as u64);
        assert_eq!(report.uploads_removed, 1);
        assert!(!exists(&s, &old).await);
        assert!(exists(&s, &fresh).await && s.blob_linked(&tr("app"), &td(&fresh)).await.unwrap());
        assert_eq!(s.upload_size(&abandoned).await.unwrap(), None);
        assert_eq!(s.upload_size(&active).await.unwrap(), Some(0));
    }

    /// A collection that died leaves its records: pushes ignore it once its lease ran out,
    /// and the next collection removes them; a collection leaves none of its own.
    #[tokio::test]
    async fn a_dead_collections_records_are_ignored_then_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let s = FsStorage::open(dir.path()).unwrap();
        let dead = "0123456789abcdef0123456789abcdef";
        let d = digest(b"some layer");
        let stale_pin = record_name(dead, &d).unwrap();
        s.gc_record_put(RUNNING, dead).await.unwrap();
        s.gc_record_put(DELETING, &stale_pin).await.unwrap();
        // What collections removed: one long ago, one just now.
        let (old_removal, new_removal) = (digest(b"old removal"), digest(b"new removal"));
        for d in [&old_removal, &new_removal] {
            s.gc_record_put(REMOVED, digest_hex(d).unwrap())
                .await
                .unwrap();
        }
        let long_ago = SystemTime::now() - LEASE - Duration::from_secs(60);
        for rel in [
            format!("gc/running/{dead}"),
            format!("gc/deleting/{stale_pin}"),
            format!("gc/removed/{}", digest_hex(&old_removal).unwrap()),
        ] {
            std::fs::File::options()
                .write(true)
                .open(dir.path().join(rel))
                .unwrap()
                .set_modified(long_ago)
                .unwrap();
        }
        // A push neither pins under the dead collection nor waits for its removal.
        let t0 = Instant::now();
        assert_eq!(
            pin_referenced(&s, std::slice::from_ref(&d)).await.unwrap(),
            None
        );
        assert!(t0.elapsed() < DELETION_WAIT / 2);
        assert!(s.gc_record_list(PINS).await.unwrap().is_empty());
        // A live collection's record counts: the push pins under it.
        let live = "fedcba9876543210fedcba9876543210";
        s.gc_record_put(RUNNING, live).await.unwrap();
        assert_eq!(
            pin_referenced(&s, std::slice::from_ref(&d)).await.unwrap(),
            None
        );
        assert!(
            s.gc_record_exists(PINS, &record_name(live, &d).unwrap())
                .await
                .unwrap()
        );
        s.gc_record_delete(RUNNING, live).await.unwrap();

        collect(&s, &now_opts(false)).await.unwrap();
        for dir in [RUNNING, DELETING] {
            assert!(s.gc_record_list(dir).await.unwrap().is_empty(), "{dir}");
        }
        // The live collection's young pin stays until it is older than the lease (its
        // owner may just have started); nothing of the collection that ran is left.
        let pins = s.gc_record_list(PINS).await.unwrap();
        assert_eq!(pins.len(), 1, "{pins:?}");
        assert!(pins[0].0.starts_with(live));
        // A removal record goes once older than the lease, not before.
        assert!(!removed_recently(&s, &old_removal).await.unwrap());
        assert!(removed_recently(&s, &new_removal).await.unwrap());
    }

    #[tokio::test]
    async fn malformed_manifests_are_reported_and_their_repository_kept() {
        let s = MemoryStorage::default();
        let layer = push_blob(&s, "odd", b"some layer").await;
        let bad = StoredManifest {
            digest: digest(b"{\"layers\": 7}"),
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            bytes: bytes::Bytes::from_static(b"{\"layers\": 7}"),
        };
        s.manifest_put(&tr("odd"), &bad).await.unwrap();
        s.tag_set(&tr("odd"), &tt("v1"), &td(&bad.digest))
            .await
            .unwrap();
        let report = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!(report.problems.len(), 1, "{report:?}");
        assert!(report.problems[0].starts_with(&format!("odd@{}", bad.digest)));
        assert_eq!((report.blob_links_removed, report.blobs_deleted), (0, 0));
        assert!(exists(&s, &layer).await && s.blob_linked(&tr("odd"), &td(&layer)).await.unwrap());
    }
}
