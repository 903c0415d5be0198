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

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use super::{LinkInfo, Result, Storage};

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
        sweep_repository(storage, repo, opts, &young, &mut report, &mut still_linked).await?;
    }

    // Blobs first, then links: a link made after this listing belongs to a blob that was
    // just pushed or linked, which is young.
    let blobs = storage.blob_list().await?;
    let linked = if opts.dry_run {
        still_linked
    } else {
        let mut linked = HashSet::new();
        for repo in storage.repo_list().await? {
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
        if opts.dry_run || storage.blob_delete(&blob.digest).await? {
            report.blobs_deleted += 1;
            report.bytes_freed += blob.size;
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
    repo: &str,
    opts: &GcOptions,
    young: &impl Fn(Option<SystemTime>) -> bool,
    report: &mut GcReport,
    still_linked: &mut HashSet<String>,
) -> Result<()> {
    let manifests: Vec<LinkInfo> = storage.manifest_links(repo).await?;
    let linked_manifests: HashSet<&str> = manifests.iter().map(|m| m.digest.as_str()).collect();

    let mut work: Vec<String> = Vec::new();
    if opts.delete_untagged {
        for tag in storage.tag_list(repo).await?.unwrap_or_default() {
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
        let Some(manifest) = storage.manifest_get(repo, &digest).await? else {
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
        work.extend(storage.referrer_list(repo, &digest).await?);
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
        if opts.dry_run || storage.manifest_delete(repo, &manifest.digest).await? {
            report
                .manifests_deleted
                .push((repo.to_string(), manifest.digest.clone()));
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
        if opts.dry_run || storage.unlink_blob(repo, &link.digest).await? {
            report.blob_links_removed += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use super::super::StoredManifest;
    use super::super::conformance::{LIMIT, body, digest, manifest_json, stored};
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
        s.blob_put(&d, body(&[data]), LIMIT).await.unwrap();
        s.link_blob(repo, &d).await.unwrap();
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
        s.manifest_put(repo, &m).await.unwrap();
        if let Some(tag) = tag {
            s.tag_set(repo, tag, &m.digest).await.unwrap();
        }
        (m, vec![config, layer])
    }

    async fn exists(s: &dyn Storage, d: &str) -> bool {
        s.blob_size(d).await.unwrap().is_some()
    }

    #[tokio::test]
    async fn keeps_what_manifests_reach_and_deletes_the_rest() {
        let s = MemoryStorage::default();
        let (tagged, tagged_blobs) = push_image(&s, "app", "one", Some("v1")).await;
        let (untagged, untagged_blobs) = push_image(&s, "app", "two", None).await;
        let orphan = push_blob(&s, "app", b"orphan layer").await;
        let unlinked = digest(b"never linked");
        s.blob_put(&unlinked, body(&[b"never linked"]), LIMIT)
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
        assert!(!s.blob_linked("app", &orphan).await.unwrap());
        for d in tagged_blobs.iter().chain(&untagged_blobs) {
            assert!(
                exists(&s, d).await && s.blob_linked("app", d).await.unwrap(),
                "{d}"
            );
        }
        assert!(
            s.manifest_get("app", &untagged.digest)
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
            s.manifest_get("app", &untagged.digest)
                .await
                .unwrap()
                .is_none()
        );
        assert!(!exists(&s, &untagged.digest).await);
        for d in &untagged_blobs {
            assert!(!exists(&s, d).await, "{d}");
        }
        assert!(
            s.manifest_get("app", &tagged.digest)
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
        s.link_blob("b", &shared).await.unwrap();
        let config = push_blob(&s, "b", b"config").await;
        let m = stored(manifest_json(&config, &[&shared], None));
        s.manifest_put("b", &m).await.unwrap();
        s.tag_set("b", "latest", &m.digest).await.unwrap();

        let report = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!(report.blob_links_removed, 1, "a's link goes");
        assert_eq!(report.blobs_deleted, 0, "b still links it");
        assert!(!s.blob_linked("a", &shared).await.unwrap());
        assert!(s.blob_linked("b", &shared).await.unwrap());
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
        s.manifest_put("multi", &index).await.unwrap();
        s.tag_set("multi", "latest", &index.digest).await.unwrap();
        // A signature of the index (untagged, found through referrers), and a signature of
        // a manifest that is itself garbage.
        let sig_config = push_blob(&s, "multi", b"sig config").await;
        let sig = stored(manifest_json(&sig_config, &[], Some(&index.digest)));
        s.manifest_put("multi", &sig).await.unwrap();
        s.referrer_add("multi", &index.digest, &sig.digest)
            .await
            .unwrap();
        let (garbage, _) = push_image(&s, "multi", "garbage", None).await;
        let garbage_sig = stored(manifest_json(
            &sig_config,
            &[&digest(b"x")],
            Some(&garbage.digest),
        ));
        s.manifest_put("multi", &garbage_sig).await.unwrap();
        s.referrer_add("multi", &garbage.digest, &garbage_sig.digest)
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
                s.manifest_get("multi", &m.digest).await.unwrap().is_some(),
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
        s.manifest_put("app", &untagged).await.unwrap();
        let report = collect(s.as_ref(), &hour).await.unwrap();
        assert_eq!(report.blobs_deleted + report.blob_links_removed, 0);
        assert!(report.manifests_deleted.is_empty());
        assert_eq!(report.kept_young, 1, "the layer's link: {report:?}");
        // The push completes and refers to everything it uploaded.
        let m = stored(manifest_json(&config, &[&layer], None));
        s.manifest_put("app", &m).await.unwrap();
        s.tag_set("app", "v1", &m.digest).await.unwrap();
        assert!(exists(s.as_ref(), &layer).await && s.blob_linked("app", &layer).await.unwrap());

        // Pushes racing a collection, many times over: nothing pushed is ever lost.
        for round in 0..20u32 {
            let s2 = s.clone();
            let push = async move {
                let layer =
                    push_blob(s2.as_ref(), "race", format!("layer {round}").as_bytes()).await;
                tokio::task::yield_now().await;
                let m = stored(manifest_json(&layer, &[&layer], None));
                s2.manifest_put("race", &m).await.unwrap();
                s2.tag_set("race", &format!("r{round}"), &m.digest)
                    .await
                    .unwrap();
                (layer, m.digest)
            };
            let (pushed, gc) = tokio::join!(push, collect(s.as_ref(), &hour));
            gc.unwrap();
            let (layer, manifest) = pushed;
            assert!(exists(s.as_ref(), &layer).await, "round {round}");
            assert!(
                s.manifest_get("race", &manifest).await.unwrap().is_some(),
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
        let abandoned = s.upload_start("conformance/repo").await.unwrap();
        let active = s.upload_start("conformance/repo").await.unwrap();
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
        assert!(exists(&s, &fresh).await && s.blob_linked("app", &fresh).await.unwrap());
        assert_eq!(s.upload_size(&abandoned).await.unwrap(), None);
        assert_eq!(s.upload_size(&active).await.unwrap(), Some(0));
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
        s.manifest_put("odd", &bad).await.unwrap();
        s.tag_set("odd", "v1", &bad.digest).await.unwrap();
        let report = collect(&s, &now_opts(true)).await.unwrap();
        assert_eq!(report.problems.len(), 1, "{report:?}");
        assert!(report.problems[0].starts_with(&format!("odd@{}", bad.digest)));
        assert_eq!((report.blob_links_removed, report.blobs_deleted), (0, 0));
        assert!(exists(&s, &layer).await && s.blob_linked("odd", &layer).await.unwrap());
    }
}
