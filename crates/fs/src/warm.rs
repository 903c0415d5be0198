//! Getting ahead of the reads: recorded startup traces, eStargz prefetch landmarks and
//! background fill of the rest of every layer.
//!
//! CONTRACT (filled in by the prefetch work; signatures are binding for the daemon):
//! * [`Trace`]: which byte ranges of which files a workload read, in order; JSON on disk
//!   and as an OCI artifact (media type [`TRACE_MEDIA_TYPE`]) whose subject is the image.
//! * [`start`]: begins prefetch (trace first, then eStargz landmarks) and, when enabled,
//!   throttled background fill; the returned [`WarmHandle`] stops it on drop.
//! * [`MountedImage::note_read`] records reads into the mount's trace recorder, if any.

use std::sync::Arc;

use crate::image::MountedImage;

/// Media type of a published startup trace (artifactType of its manifest).
pub const TRACE_MEDIA_TYPE: &str = "application/vnd.ferry.trace.v1+json";

/// What to warm and how hard.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmConfig {
    /// Prefetch the recorded trace / eStargz landmark files at mount.
    pub prefetch: bool,
    /// Fetch the rest of every layer in the background after prefetch.
    pub background_fill: bool,
    /// Concurrent requests used by prefetch and fill (taken from the image's limit).
    pub concurrency: usize,
    /// Background fill bandwidth cap in bytes per second (0: unlimited).
    pub fill_bytes_per_sec: u64,
}

impl Default for WarmConfig {
    fn default() -> Self {
        WarmConfig {
            prefetch: true,
            background_fill: true,
            concurrency: 4,
            fill_bytes_per_sec: 0,
        }
    }
}

/// A recorded startup trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Trace {
    /// Reads in first-touch order.
    pub reads: Vec<TraceRead>,
}

/// One recorded read: `len` bytes at `offset` of the file at `path` in the merged tree.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceRead {
    /// Absolute path in the image's root filesystem.
    pub path: String,
    /// Offset of the read within the file.
    pub offset: u64,
    /// Bytes read.
    pub len: u64,
}

/// Running prefetch / fill; stops (promptly, between requests) when dropped.
#[derive(Debug, Default)]
pub struct WarmHandle {}

/// Starts warming `image` (see the module doc).
pub fn start(
    _image: &Arc<MountedImage>,
    _config: &WarmConfig,
    _trace: Option<Trace>,
) -> WarmHandle {
    WarmHandle::default()
}

impl MountedImage {
    /// Called by the FUSE layer for every read of a regular file, before it is served.
    /// Must be cheap: the read path calls it on every request.
    pub fn note_read(&self, _ino: u64, _offset: u64, _len: u32) {}
}
