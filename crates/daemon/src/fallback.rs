//! Which images the snapshotter did not serve lazily, and why: a bounded in-memory record
//! for `ferry status` and the `ferry_not_lazy_layers_total{reason}` counter.
//!
//! [`crate::LazyLayers`] decides, for each layer it declines, a typed
//! [`NotLazyReason`] where the fact is known (no index in the lookup, a 401 from the
//! registry client, a timeout, a failed mount…): [`reason_of`] maps the daemon's typed
//! errors, never their text. The record keeps the last [`MAX_IMAGES`] images (the least
//! recently seen goes first) and, per image, the layers that took the ordinary path: the
//! ones declined and, for `ferry pull` (which stops asking at the first layer it cannot
//! serve lazily and downloads the rest itself), the ones unpacked after that.
//! It is the daemon's memory only: a restart starts a new record.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_registry_client::ClientError;
use ferry_snapshotter::{NotLazy, NotLazyReason};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::indexes::ResolveError;

/// Most images recorded; older ones are dropped (the totals by reason keep counting).
pub const MAX_IMAGES: usize = 256;
/// Most distinct layer digests remembered per image, to count each layer once (an image
/// has tens; this bounds what hostile labels can make the daemon hold).
const MAX_LAYERS_PER_IMAGE: usize = 1024;
/// Longest detail kept per image (an error message).
const MAX_DETAIL: usize = 512;

/// One image with layers that were not served lazily.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotLazyImage {
    /// The image reference as containerd named it; `None` when the labels named none.
    pub image: Option<String>,
    /// The manifest digest, when known.
    pub manifest_digest: Option<String>,
    /// Layers that took the ordinary download-and-unpack path (each counted once).
    pub layers: u64,
    /// Declined Prepares by reason.
    pub reasons: BTreeMap<NotLazyReason, u64>,
    /// The last reason.
    pub reason: NotLazyReason,
    /// The last error or fact behind it.
    pub detail: String,
    /// What to do about the last reason.
    pub hint: String,
    /// First seen (seconds since the Unix epoch).
    pub first_seen: u64,
    /// Last seen (seconds since the Unix epoch).
    pub last_seen: u64,
}

/// The record as `ferry status` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotLazyStatus {
    /// The images, most recently seen first.
    pub images: Vec<NotLazyImage>,
    /// Declined layers by reason since the daemon started (not bounded by the record).
    pub layers_by_reason: BTreeMap<NotLazyReason, u64>,
    /// Images dropped from the record to keep it bounded.
    pub images_dropped: u64,
}

struct Entry {
    image: NotLazyImage,
    /// Layer digests counted in `image.layers`.
    seen: HashSet<String>,
    /// Order of last use, for dropping the least recently seen.
    touched: u64,
}

#[derive(Default)]
struct State {
    images: HashMap<Option<String>, Entry>,
    totals: BTreeMap<NotLazyReason, u64>,
    dropped: u64,
    clock: u64,
}

/// See the module doc.
pub struct FallbackLog {
    state: Mutex<State>,
    capacity: usize,
}

impl std::fmt::Debug for FallbackLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FallbackLog")
            .field("images", &self.state.lock().images.len())
            .finish_non_exhaustive()
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn clip(text: &str) -> String {
    match text.char_indices().nth(MAX_DETAIL) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

impl Default for FallbackLog {
    fn default() -> FallbackLog {
        FallbackLog::new()
    }
}

impl FallbackLog {
    /// A record of at most [`MAX_IMAGES`] images.
    pub fn new() -> FallbackLog {
        FallbackLog::with_capacity(MAX_IMAGES)
    }

    /// A record of at most `capacity` images (at least one).
    pub fn with_capacity(capacity: usize) -> FallbackLog {
        FallbackLog {
            state: Mutex::new(State::default()),
            capacity: capacity.max(1),
        }
    }

    /// Layer `layer` of `image` (as the labels name them) was declined: `not_lazy` says
    /// why.
    pub fn declined(
        &self,
        image: Option<&str>,
        manifest_digest: Option<&str>,
        layer: Option<&str>,
        not_lazy: &NotLazy,
    ) {
        let mut state = self.state.lock();
        *state.totals.entry(not_lazy.reason).or_default() += 1;
        state.clock += 1;
        let clock = state.clock;
        let key = image.map(str::to_owned);
        if !state.images.contains_key(&key) && state.images.len() >= self.capacity {
            let oldest = state
                .images
                .iter()
                .min_by_key(|(_, e)| e.touched)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                state.images.remove(&oldest);
                state.dropped += 1;
            }
        }
        let at = now();
        let entry = state.images.entry(key.clone()).or_insert_with(|| Entry {
            image: NotLazyImage {
                image: key,
                manifest_digest: None,
                layers: 0,
                reasons: BTreeMap::new(),
                reason: not_lazy.reason,
                detail: String::new(),
                hint: String::new(),
                first_seen: at,
                last_seen: at,
            },
            seen: HashSet::new(),
            touched: clock,
        });
        entry.touched = clock;
        let record = &mut entry.image;
        if let Some(m) = manifest_digest {
            record.manifest_digest = Some(m.to_owned());
        }
        *record.reasons.entry(not_lazy.reason).or_default() += 1;
        record.reason = not_lazy.reason;
        record.detail = clip(&not_lazy.detail);
        record.hint = not_lazy.reason.hint(image);
        record.last_seen = at;
        count_layer(entry, layer);
    }

    /// Layer `layer` of `image` was unpacked the ordinary way and committed: counted for
    /// an image already recorded (a layer of an image never declined is not news).
    pub fn unpacked(&self, image: Option<&str>, layer: &str) {
        let mut state = self.state.lock();
        if let Some(entry) = state.images.get_mut(&image.map(str::to_owned)) {
            count_layer(entry, Some(layer));
        }
    }

    /// Declined layers by reason since the start.
    pub fn totals(&self) -> BTreeMap<NotLazyReason, u64> {
        self.state.lock().totals.clone()
    }

    /// The record, most recently seen first.
    pub fn status(&self) -> NotLazyStatus {
        let state = self.state.lock();
        let mut entries: Vec<&Entry> = state.images.values().collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.touched));
        NotLazyStatus {
            images: entries.into_iter().map(|e| e.image.clone()).collect(),
            layers_by_reason: state.totals.clone(),
            images_dropped: state.dropped,
        }
    }
}

/// Counts `layer` once for `entry` (a layer without a digest always counts).
fn count_layer(entry: &mut Entry, layer: Option<&str>) {
    let new = match layer {
        Some(l) if entry.seen.contains(l) => false,
        Some(l) if entry.seen.len() < MAX_LAYERS_PER_IMAGE => entry.seen.insert(l.to_owned()),
        _ => true,
    };
    if new {
        entry.image.layers += 1;
    }
}

/// Why a registry client error keeps a layer from being served lazily.
pub fn client_reason(e: &ClientError) -> NotLazyReason {
    match e {
        ClientError::Unauthorized { .. } | ClientError::Denied { .. } => {
            NotLazyReason::Unauthorized
        }
        ClientError::NotFound { .. } => NotLazyReason::NotFound,
        ClientError::Transport { .. } => NotLazyReason::Unreachable,
        ClientError::Status { status, .. } => match *status {
            401 | 403 => NotLazyReason::Unauthorized,
            404 => NotLazyReason::NotFound,
            429 | 500.. => NotLazyReason::Unreachable,
            _ => NotLazyReason::Invalid,
        },
        ClientError::DigestMismatch { .. }
        | ClientError::TooLarge { .. }
        | ClientError::Invalid { .. }
        | ClientError::Layout(_) => NotLazyReason::Invalid,
        ClientError::Config(_) | ClientError::Io { .. } => NotLazyReason::Other,
    }
}

/// Why a lazy filesystem error keeps a layer from being served lazily; `otherwise` for
/// local failures (what they mean depends on the step: a lookup or the mount).
pub fn fs_reason(e: &ferry_fs::Error, otherwise: NotLazyReason) -> NotLazyReason {
    match e {
        ferry_fs::Error::Registry(c) => client_reason(c),
        ferry_fs::Error::Index(_) | ferry_fs::Error::Oci(_) => NotLazyReason::Invalid,
        ferry_fs::Error::Store(_) | ferry_fs::Error::Io { .. } | ferry_fs::Error::Invalid(_) => {
            otherwise
        }
    }
}

/// Why a layer lookup failed.
pub fn resolve_reason(e: &ResolveError) -> NotLazyReason {
    match e {
        ResolveError::Registry { reason, .. } => *reason,
        ResolveError::TimedOut { .. } => NotLazyReason::Unreachable,
        ResolveError::NoSuchLayer { .. } => NotLazyReason::NotFound,
        ResolveError::Aborted => NotLazyReason::Other,
    }
}

/// Why a daemon error keeps a layer from being served lazily; `otherwise` for errors
/// that say nothing about the registry or the index (their meaning depends on the step).
pub fn reason_of(e: &Error, otherwise: NotLazyReason) -> NotLazyReason {
    match e {
        Error::Registry(c) => client_reason(c),
        Error::Fs(f) => fs_reason(f, otherwise),
        Error::Resolve(r) => resolve_reason(r),
        _ => otherwise,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn no_index() -> NotLazy {
        NotLazy::new(NotLazyReason::NoIndex, "no ferry index or eStargz TOC")
    }

    #[test]
    fn an_image_counts_each_layer_once_with_its_reasons() {
        let log = FallbackLog::new();
        log.declined(
            Some("reg/app:v1"),
            Some("sha256:m"),
            Some("sha256:a"),
            &no_index(),
        );
        // The same layer again (a retried Prepare): one more event, not one more layer.
        log.declined(Some("reg/app:v1"), None, Some("sha256:a"), &no_index());
        let down = NotLazy::new(NotLazyReason::Unreachable, "connection refused");
        log.declined(Some("reg/app:v1"), None, Some("sha256:b"), &down);
        // Unpacked afterwards: a layer already counted, and one `ferry pull` never asked about.
        log.unpacked(Some("reg/app:v1"), "sha256:a");
        log.unpacked(Some("reg/app:v1"), "sha256:c");
        // An image never declined is not recorded by an unpack.
        log.unpacked(Some("reg/lazy:v1"), "sha256:z");
        let status = log.status();
        assert_eq!(status.images.len(), 1);
        let image = &status.images[0];
        assert_eq!(image.image.as_deref(), Some("reg/app:v1"));
        assert_eq!(image.manifest_digest.as_deref(), Some("sha256:m"));
        assert_eq!(image.layers, 3);
        assert_eq!(image.reasons[&NotLazyReason::NoIndex], 2);
        assert_eq!(image.reasons[&NotLazyReason::Unreachable], 1);
        assert_eq!(image.reason, NotLazyReason::Unreachable);
        assert_eq!(image.detail, "connection refused");
        assert!(image.hint.contains("reg "), "{}", image.hint);
        assert!(image.first_seen <= image.last_seen);
        assert_eq!(status.layers_by_reason[&NotLazyReason::NoIndex], 2);
        // JSON round trip, reasons by their names.
        let json = serde_json::to_string(&status).unwrap();
        assert!(json.contains(r#""no-index":2"#), "{json}");
        let back: NotLazyStatus = serde_json::from_str(&json).unwrap();
        assert_eq!(back, status);
    }

    #[test]
    fn the_record_is_bounded_and_drops_the_least_recently_seen() {
        let log = FallbackLog::with_capacity(3);
        for i in 0..3 {
            log.declined(
                Some(&format!("reg/app{i}:v1")),
                None,
                Some("sha256:a"),
                &no_index(),
            );
        }
        // app0 is seen again, so app1 is now the least recently seen.
        log.declined(Some("reg/app0:v1"), None, Some("sha256:b"), &no_index());
        log.declined(Some("reg/app3:v1"), None, Some("sha256:a"), &no_index());
        let status = log.status();
        let names: Vec<&str> = status
            .images
            .iter()
            .map(|i| i.image.as_deref().unwrap())
            .collect();
        assert_eq!(names, ["reg/app3:v1", "reg/app0:v1", "reg/app2:v1"]);
        assert_eq!(status.images_dropped, 1);
        // The totals keep every event.
        assert_eq!(status.layers_by_reason[&NotLazyReason::NoIndex], 5);
        // The default bound.
        let log = FallbackLog::new();
        for i in 0..MAX_IMAGES + 10 {
            log.declined(Some(&format!("r/{i}")), None, None, &no_index());
        }
        assert_eq!(log.status().images.len(), MAX_IMAGES);
        assert_eq!(log.status().images_dropped, 10);
    }

    #[test]
    fn layers_per_image_and_details_are_bounded() {
        let log = FallbackLog::new();
        for i in 0..MAX_LAYERS_PER_IMAGE + 5 {
            log.declined(Some("r/a"), None, Some(&format!("sha256:{i}")), &no_index());
        }
        let long = NotLazy::new(NotLazyReason::Other, "x".repeat(10 * MAX_DETAIL));
        log.declined(None, None, None, &long);
        let status = log.status();
        assert_eq!(status.images[1].layers as usize, MAX_LAYERS_PER_IMAGE + 5);
        // Labels that named no image are one entry of their own.
        assert_eq!(status.images[0].image, None);
        assert!(status.images[0].detail.chars().count() <= MAX_DETAIL + 1);
    }

    #[test]
    fn errors_map_to_reasons_by_type() {
        let registry = "reg.local".to_owned();
        let cases = [
            (
                ClientError::Unauthorized {
                    registry: registry.clone(),
                    message: "no".into(),
                },
                NotLazyReason::Unauthorized,
            ),
            (
                ClientError::Denied {
                    registry: registry.clone(),
                    message: "no".into(),
                },
                NotLazyReason::Unauthorized,
            ),
            (
                ClientError::Transport {
                    registry: registry.clone(),
                    message: "connection refused".into(),
                },
                NotLazyReason::Unreachable,
            ),
            (
                ClientError::Status {
                    registry: registry.clone(),
                    method: "GET".into(),
                    path: "/v2/".into(),
                    status: 503,
                    message: "busy".into(),
                },
                NotLazyReason::Unreachable,
            ),
            (
                ClientError::NotFound {
                    what: "manifest".into(),
                },
                NotLazyReason::NotFound,
            ),
            (
                ClientError::DigestMismatch {
                    expected: "a".into(),
                    actual: "b".into(),
                },
                NotLazyReason::Invalid,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(client_reason(&e), want, "{e}");
            let wrapped = Error::Fs(ferry_fs::Error::Registry(e));
            assert_eq!(reason_of(&wrapped, NotLazyReason::MountFailed), want);
        }
        let timed_out = Error::Resolve(ResolveError::TimedOut {
            what: "resolving".into(),
            timeout: std::time::Duration::from_secs(1),
        });
        assert_eq!(
            reason_of(&timed_out, NotLazyReason::Other),
            NotLazyReason::Unreachable
        );
        let local = Error::Fs(ferry_fs::Error::io(
            "mounting",
            std::io::Error::other("no /dev/fuse"),
        ));
        assert_eq!(
            reason_of(&local, NotLazyReason::MountFailed),
            NotLazyReason::MountFailed
        );
        assert_eq!(
            reason_of(&Error::InvalidRequest("bad".into()), NotLazyReason::Other),
            NotLazyReason::Other
        );
    }
}
