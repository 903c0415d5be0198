//! Startup traces nobody has to record: finding the trace a mount prefetches with,
//! recording one during an image's first start on this node when there is none, and
//! sharing it so other nodes (and later versions of the image) start warm.
//!
//! * Lookup ([`lookup`]), in order: the trace published for the image manifest (OCI
//!   referrer); the node's own trace of that manifest ([`NodeTraces`]); the newest trace
//!   of the same repository, from the node, then from the registry's
//!   `ferry_fs::trace::REPOSITORY_TRACE_TAG` (a trace is in terms of paths, so the
//!   trace of the version before maps onto a new tag's files).
//! * Recording ([`watch`]): every mount of one image manifest notes into one shared
//!   passive recorder (the read path is unchanged) from the first read until reads go
//!   quiet or a maximum duration has passed ([`StopRule`]).
//! * Sharing ([`share`]): pushed as the image's referrer with the node's credentials;
//!   when that is refused, sent to ferry's registry endpoint for pull-only nodes; and
//!   always kept in the node's own store (the cheapest lookup for its next start and for
//!   a new tag of the repository).
//!
//! The registry side is behind [`RemoteTraces`] so lookup order and sharing are tested
//! with an in-memory implementation. Everything here runs on background threads: it must
//! not be called on a mount's or a read's path.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use ferry_fs::Trace;
use ferry_fs::image::recorder::Recorder;
use ferry_fs::trace::MAX_TRACE_BYTES;
use ferry_oci::ImageRef;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where the trace a mount prefetches with came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceSource {
    /// Published for this image manifest (an OCI referrer in its registry or layout).
    Published,
    /// This node's own trace of this image manifest.
    Node,
    /// A trace of another version (tag) of the same repository.
    PreviousVersion,
}

/// The trace a mount uses, as status shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceUse {
    /// Where it came from.
    pub source: TraceSource,
    /// The image manifest it was recorded for.
    pub recorded_for: String,
    /// Reads in it.
    pub reads: usize,
    /// Bytes it reads.
    pub bytes: u64,
}

/// A trace found for a mount.
#[derive(Debug, Clone, PartialEq)]
pub struct FoundTrace {
    /// The trace.
    pub trace: Trace,
    /// Where it came from and what it holds.
    pub info: TraceUse,
}

impl FoundTrace {
    fn new(trace: Trace, source: TraceSource, recorded_for: &str) -> FoundTrace {
        let info = TraceUse {
            source,
            recorded_for: recorded_for.to_owned(),
            reads: trace.reads.len(),
            bytes: trace.bytes(),
        };
        FoundTrace { trace, info }
    }
}

/// How a recorded trace was shared with other nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shared {
    /// Pushed as the image's referrer (artifact digest).
    Referrer(String),
    /// Accepted by ferry's registry from a node that may only pull (artifact digest).
    RegistryEndpoint(String),
    /// Not shared beyond this node (why).
    NodeOnly(String),
}

/// A registry (or layout) as trace lookups and sharing see it.
pub trait RemoteTraces: Send + Sync {
    /// The trace published for manifest `manifest` of `image`.
    fn published(&self, image: &str, manifest: &str) -> Result<Option<Trace>>;
    /// The newest trace of `image`'s repository and the manifest it was recorded for.
    fn repository_newest(&self, image: &str) -> Result<Option<(String, Trace)>>;
    /// Pushes `trace` as the referrer of manifest `manifest` of `image`.
    fn publish(&self, image: &str, manifest: &str, trace: &Trace) -> Result<String>;
    /// Sends `trace` to ferry's registry endpoint for nodes that may only pull.
    fn send(&self, image: &str, manifest: &str, trace: &Trace) -> Result<String>;
}

/// The repository `image` belongs to, as the node store indexes it: `HOST/REPO` or
/// `oci:DIR`.
pub fn repository_of(image: &str) -> Result<String> {
    match ImageRef::parse(image)
        .map_err(|e| Error::InvalidRequest(format!("image {image:?}: {e}")))?
    {
        ImageRef::Layout { dir, .. } => Ok(format!("oci:{}", dir.display())),
        ImageRef::Registry {
            registry,
            repository,
            ..
        } => Ok(format!("{registry}/{repository}")),
    }
}

/// The trace a mount of manifest `manifest` of `image` prefetches with (see the module
/// doc for the order). A source that fails is logged and the next one asked.
pub fn lookup(
    remote: &dyn RemoteTraces,
    node: Option<&NodeTraces>,
    image: &str,
    manifest: &str,
) -> Option<FoundTrace> {
    fn logged<T>(image: &str, what: &str, e: Error) -> Option<T> {
        tracing::warn!(image, error = %e, "startup trace: {what} not usable; ignored");
        None
    }
    if let Some(t) = remote
        .published(image, manifest)
        .unwrap_or_else(|e| logged(image, "published trace", e))
    {
        return Some(FoundTrace::new(t, TraceSource::Published, manifest));
    }
    let repository = repository_of(image).ok();
    if let Some(node) = node {
        if let Some(t) = node
            .for_manifest(manifest)
            .unwrap_or_else(|e| logged(image, "node trace", e))
        {
            return Some(FoundTrace::new(t, TraceSource::Node, manifest));
        }
        if let Some(repo) = &repository
            && let Some((m, t)) = node
                .newest_of(repo, manifest)
                .unwrap_or_else(|e| logged(image, "node trace of the repository", e))
        {
            return Some(FoundTrace::new(t, TraceSource::PreviousVersion, &m));
        }
    }
    let (m, t) = remote
        .repository_newest(image)
        .unwrap_or_else(|e| logged(image, "repository trace", e))?;
    // The repository's newest trace may be this very manifest's (published after the
    // first lookup, or through the endpoint's tag only).
    let source = if m == manifest {
        TraceSource::Published
    } else {
        TraceSource::PreviousVersion
    };
    Some(FoundTrace::new(t, source, &m))
}

/// True when `error` says the registry refused the push itself (credentials that may
/// not push, or a registry that takes no pushes), as opposed to failing.
fn push_refused(error: &Error) -> bool {
    let status = match error {
        Error::Registry(e) | Error::Fs(ferry_fs::Error::Registry(e)) => e.status(),
        _ => None,
    };
    matches!(status, Some(401 | 403 | 405))
}

/// Shares `trace`, recorded for manifest `manifest` of `image` (see the module doc).
/// Never fails: what could not be done is logged.
pub fn share(
    remote: &dyn RemoteTraces,
    node: Option<&NodeTraces>,
    image: &str,
    manifest: &str,
    trace: &Trace,
) -> Shared {
    if let Some(node) = node
        && let Ok(repo) = repository_of(image)
        && let Err(e) = node.save(&repo, manifest, trace)
    {
        tracing::warn!(image, error = %e, "startup trace: not kept in the node store");
    }
    let layout = image.starts_with("oci:");
    if layout {
        // A layout is someone's directory: the node does not write into it.
        return Shared::NodeOnly("an OCI layout is not written to".into());
    }
    match remote.publish(image, manifest, trace) {
        Ok(d) => return Shared::Referrer(d),
        Err(e) if push_refused(&e) => {
            tracing::info!(image, error = %e, "startup trace: push refused; sending it to the registry's trace endpoint");
        }
        Err(e) => {
            tracing::warn!(image, error = %e, "startup trace: publishing failed");
            return Shared::NodeOnly(e.to_string());
        }
    }
    match remote.send(image, manifest, trace) {
        Ok(d) => Shared::RegistryEndpoint(d),
        Err(e) => {
            tracing::warn!(image, error = %e, "startup trace: the registry did not accept it; kept on this node only");
            Shared::NodeOnly(e.to_string())
        }
    }
}

/// When a recording ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopRule {
    /// Reads without a new first touch for this long: the start is over.
    pub quiet: Duration,
    /// This long after the first read, whatever happens.
    pub max_duration: Duration,
}

/// Why a recording ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// No new first touch for [`StopRule::quiet`].
    Quiet,
    /// [`StopRule::max_duration`] since the first read.
    MaxDuration,
    /// The trace is full.
    Full,
    /// Every mount recording into it went away.
    Unmounted,
    /// Someone else stopped the recorder (a trace turned up meanwhile).
    Cancelled,
}

impl StopRule {
    /// The decision at `now` given when the first and the latest new first touch were.
    pub fn check(
        &self,
        now: Instant,
        first: Option<Instant>,
        latest: Option<Instant>,
    ) -> Option<StopReason> {
        let (first, latest) = (first?, latest?);
        if now.saturating_duration_since(first) >= self.max_duration {
            Some(StopReason::MaxDuration)
        } else if now.saturating_duration_since(latest) >= self.quiet {
            Some(StopReason::Quiet)
        } else {
            None
        }
    }
}

/// Time as [`watch`] sees it (injectable for tests).
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> Instant;
    /// Waits `d`.
    fn sleep(&self, d: Duration);
}

/// The real clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// How often [`watch`] looks at the recorder.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(200);

/// Watches `recorder` until `rule` says the start is over, the trace is full, `alive`
/// turns false (the mounts went away) or the recorder is stopped by someone else.
pub fn watch(
    recorder: &Recorder,
    rule: &StopRule,
    clock: &dyn Clock,
    alive: &dyn Fn() -> bool,
) -> StopReason {
    let mut seen = 0u64;
    let mut first = None;
    let mut latest = None;
    loop {
        if !recorder.is_recording() {
            return StopReason::Cancelled;
        }
        let now = clock.now();
        let touches = recorder.touches();
        if touches != seen {
            seen = touches;
            first.get_or_insert(now);
            latest = Some(now);
        }
        if recorder.is_full() {
            return StopReason::Full;
        }
        if let Some(reason) = rule.check(now, first, latest) {
            return reason;
        }
        if !alive() {
            return StopReason::Unmounted;
        }
        clock.sleep(WATCH_INTERVAL);
    }
}

/// Suffix of a node trace file.
const TRACE_FILE_SUFFIX: &str = ".trace.json";

/// The node's own traces: `traces/` in the store directory (0700, files 0600), one file
/// per image manifest named `REPOKEY-MANIFESTHEX.trace.json` (REPOKEY: the first 16 hex
/// digits of the SHA-256 of the repository), so a manifest and a repository are found
/// by listing the directory. Bounded in count and bytes: the oldest go first.
#[derive(Debug)]
pub struct NodeTraces {
    dir: PathBuf,
    max_entries: usize,
    max_bytes: u64,
    /// Serializes saves (and their eviction) within the process.
    writing: Mutex<()>,
}

#[derive(Debug)]
struct StoredTrace {
    path: PathBuf,
    repo_key: String,
    manifest: String,
    bytes: u64,
    modified: SystemTime,
}

fn repo_key(repository: &str) -> String {
    let digest = ferry_oci::sha256_digest(repository.as_bytes()).to_string();
    let hex = digest.trim_start_matches("sha256:");
    hex[..16.min(hex.len())].to_owned()
}

/// The 64 hex digits of a `sha256:` manifest digest, checked by ferry-oci's one digest
/// parser (so uppercase hex is refused, as everywhere else).
fn manifest_hex(manifest: &str) -> Result<&str> {
    ferry_oci::digest::parse_sha256(manifest).map_err(|e| {
        Error::InvalidRequest(format!("{manifest:?} is not a manifest digest: {e}"))
    })?;
    Ok(&manifest["sha256:".len()..])
}

impl NodeTraces {
    /// Opens (creating) the trace directory `dir`, bounded by `max_entries` and
    /// `max_bytes`.
    pub fn open(dir: &Path, max_entries: usize, max_bytes: u64) -> Result<NodeTraces> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        // An existing directory gets the same mode (traces name what a node runs).
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io(format!("restricting {}", dir.display()), e))?;
        Ok(NodeTraces {
            dir: dir.to_path_buf(),
            max_entries,
            max_bytes,
            writing: Mutex::new(()),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn list(&self) -> Result<Vec<StoredTrace>> {
        let mut out = Vec::new();
        let entries = fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(stem) = name
                .to_str()
                .and_then(|n| n.strip_suffix(TRACE_FILE_SUFFIX))
            else {
                continue;
            };
            let Some((key, hex)) = stem.split_once('-') else {
                continue;
            };
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            out.push(StoredTrace {
                path: entry.path(),
                repo_key: key.to_owned(),
                manifest: format!("sha256:{hex}"),
                bytes: meta.len(),
                modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            });
        }
        Ok(out)
    }

    fn read(&self, stored: &StoredTrace) -> Result<Trace> {
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&stored.path)
            .map_err(|e| Error::io(format!("opening {}", stored.path.display()), e))?;
        let mut bytes = Vec::new();
        file.take(MAX_TRACE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(format!("reading {}", stored.path.display()), e))?;
        Trace::from_json(&bytes).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// The node's trace of image manifest `manifest`.
    pub fn for_manifest(&self, manifest: &str) -> Result<Option<Trace>> {
        manifest_hex(manifest)?;
        let Some(stored) = self.list()?.into_iter().find(|s| s.manifest == manifest) else {
            return Ok(None);
        };
        self.read(&stored).map(Some)
    }

    /// The newest trace of `repository` recorded for another manifest than `except`,
    /// and that manifest.
    pub fn newest_of(&self, repository: &str, except: &str) -> Result<Option<(String, Trace)>> {
        let key = repo_key(repository);
        let Some(stored) = self
            .list()?
            .into_iter()
            .filter(|s| s.repo_key == key && s.manifest != except)
            .max_by_key(|s| s.modified)
        else {
            return Ok(None);
        };
        Ok(Some((stored.manifest.clone(), self.read(&stored)?)))
    }

    /// Keeps `trace` of manifest `manifest` of `repository` (replacing the node's earlier
    /// trace of that manifest), then drops the oldest traces beyond the bounds.
    pub fn save(&self, repository: &str, manifest: &str, trace: &Trace) -> Result<()> {
        let hex = manifest_hex(manifest)?;
        let json = trace
            .to_json()
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        if json.len() as u64 > self.max_bytes {
            return Err(Error::InvalidRequest(format!(
                "a trace of {} bytes is larger than the node's trace store ({} bytes)",
                json.len(),
                self.max_bytes
            )));
        }
        let _writing = self.writing.lock();
        // Another repository's file of the same manifest goes too: one per manifest.
        for s in self.list()?.into_iter().filter(|s| s.manifest == manifest) {
            let _ = fs::remove_file(&s.path);
        }
        let name = format!("{}-{hex}{TRACE_FILE_SUFFIX}", repo_key(repository));
        let tmp = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all(&json)?;
            f.sync_all()?;
            fs::rename(&tmp, self.dir.join(&name))
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io(format!("writing {name}"), e));
        }
        self.evict()
    }

    /// Removes the oldest traces until the bounds hold.
    fn evict(&self) -> Result<()> {
        let mut all = self.list()?;
        all.sort_by_key(|s| std::cmp::Reverse(s.modified));
        let mut count = 0usize;
        let mut bytes = 0u64;
        for s in all {
            count += 1;
            bytes += s.bytes;
            if count > self.max_entries || bytes > self.max_bytes {
                tracing::debug!(path = %s.path.display(), "node trace store full: dropped the oldest trace");
                let _ = fs::remove_file(&s.path);
            }
        }
        Ok(())
    }
}

/// Registry and layout traces through the daemon's client (the real [`RemoteTraces`]).
#[derive(Debug)]
pub struct RegistryTraces {
    /// The node's registry client (its credentials).
    pub client: ferry_registry_client::Client,
    /// Runtime the client's calls run on.
    pub runtime: ferry_registry_client::RangeRuntime,
    /// Longest one lookup or share step may take.
    pub timeout: Duration,
}

impl RegistryTraces {
    fn repo(image: &str) -> Result<Option<ferry_registry_client::Repo>> {
        match ImageRef::parse(image)
            .map_err(|e| Error::InvalidRequest(format!("image {image:?}: {e}")))?
        {
            ImageRef::Layout { .. } => Ok(None),
            ImageRef::Registry {
                registry,
                repository,
                ..
            } => Ok(Some(ferry_registry_client::Repo::new(registry, repository))),
        }
    }

    fn bounded<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = ferry_fs::Result<T>>,
    ) -> Result<T> {
        self.runtime
            .handle()
            .block_on(async { tokio::time::timeout(self.timeout, call).await })
            .map_err(|_| Error::Control(format!("{what}: no answer within {:?}", self.timeout)))?
            .map_err(Error::from)
    }
}

impl RemoteTraces for RegistryTraces {
    fn published(&self, image: &str, manifest: &str) -> Result<Option<Trace>> {
        Ok(ferry_fs::find_trace(
            image,
            manifest,
            &self.client,
            &self.runtime,
        )?)
    }

    fn repository_newest(&self, image: &str) -> Result<Option<(String, Trace)>> {
        let Some(repo) = Self::repo(image)? else {
            return Ok(None);
        };
        Ok(ferry_fs::trace::find_repository_trace(
            &self.client,
            &repo,
            &self.runtime,
        )?)
    }

    fn publish(&self, image: &str, manifest: &str, trace: &Trace) -> Result<String> {
        let Some(repo) = Self::repo(image)? else {
            return Err(Error::InvalidRequest("not a registry image".into()));
        };
        let digest = ferry_oci::layout::digest(manifest).map_err(ferry_fs::Error::from)?;
        let subject = ferry_oci::layout::descriptor(ferry_oci::media::OCI_MANIFEST, digest, 0, &[]);
        self.bounded(
            "publishing a startup trace",
            ferry_fs::trace::publish_registry_trace(&self.client, &repo, &subject, trace),
        )
    }

    fn send(&self, image: &str, manifest: &str, trace: &Trace) -> Result<String> {
        let Some(repo) = Self::repo(image)? else {
            return Err(Error::InvalidRequest("not a registry image".into()));
        };
        self.bounded(
            "sending a startup trace",
            ferry_fs::trace::send_registry_trace(&self.client, &repo, manifest, trace),
        )
    }
}

/// The per-image-manifest trace state of the node's mounts (and how far the image's
/// pull has come, which its prefetch waits for).
#[derive(Debug, Default)]
pub struct ImageTraces {
    state: Mutex<LookupState>,
    ready: parking_lot::Condvar,
    /// The shared recorder, while this image's first start is recorded.
    pub recorder: Mutex<Option<std::sync::Arc<Recorder>>>,
    /// The layers the image's pull has still to bring in (mount, or unpack and commit).
    pub settle: crate::settle::PullSettle,
}

#[derive(Debug, Default)]
enum LookupState {
    #[default]
    Pending,
    Done(Option<FoundTrace>),
}

impl ImageTraces {
    /// Sets the lookup's answer (a later one replaces it: a recording that finished).
    pub fn set(&self, found: Option<FoundTrace>) {
        *self.state.lock() = LookupState::Done(found);
        self.ready.notify_all();
    }

    /// The lookup's answer, waiting at most `timeout` for it (`None` then).
    pub fn wait(&self, timeout: Duration) -> Option<FoundTrace> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock();
        loop {
            if let LookupState::Done(found) = &*state {
                return found.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.ready.wait_for(&mut state, left);
        }
    }

    /// True when this image's own trace (not another version's) is known.
    pub fn has_own_trace(&self) -> bool {
        matches!(
            &*self.state.lock(),
            LookupState::Done(Some(f)) if f.info.source != TraceSource::PreviousVersion
        )
    }
}

/// Per image manifest: its [`ImageTraces`] and when it was made.
pub type ImageTraceMap = HashMap<String, (Instant, std::sync::Arc<ImageTraces>)>;

#[cfg(test)]
#[path = "autotrace_tests.rs"]
mod tests;
