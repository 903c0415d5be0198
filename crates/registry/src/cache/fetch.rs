//! One upstream blob download shared by every concurrent reader, and the streams that read
//! a blob file — complete, or still growing while the download runs.
//!
//! The download writes into a temp file and publishes how many bytes are on disk through a
//! `watch` channel; each reader holds its own handle on that file and follows the count, so
//! bytes reach every waiter as soon as they arrive from upstream and a slow or vanished
//! reader never holds the download (or the others) back. Readers of the blob's final bytes
//! are held one byte short until the digest is verified: if it does not match, their
//! stream ends with an error instead of a complete-looking wrong body, and nothing is
//! cached.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, StreamExt};
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;

use super::CacheError;
use super::disk::{BlobPin, DiskCache, read_exact_at, write_all};
use crate::storage::ByteStream;

/// Largest read a stream does at once.
const READ_CHUNK: u64 = 256 << 10;
/// A reader of a growing file with less than this much new waits up to
/// [`GROWING_READ_LINGER`] for more, so hundreds of readers do not each wake and read for
/// every small upstream chunk; bytes still flow when upstream stalls.
const MIN_GROWING_READ: u64 = 64 << 10;
const GROWING_READ_LINGER: Duration = Duration::from_millis(2);
/// Upstream chunks already received are batched into one write up to this size.
const WRITE_BATCH: usize = 1 << 20;
/// Batches queued for the writer thread (bounds a download's memory to about 4 MiB).
const WRITE_QUEUE: usize = 4;

/// Where a download stands.
#[derive(Debug, Clone, PartialEq)]
pub enum FetchState {
    Running,
    /// All bytes are on disk and hash to the digest.
    Verified,
    /// The download failed; nothing will be cached.
    Failed(CacheError),
}

/// What a download has published so far.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Bytes written to the temp file (readable by every reader's handle).
    pub written: u64,
    /// Total size, once upstream said (or once the download ended).
    pub size: Option<u64>,
    pub state: FetchState,
}

/// A download in progress, as readers see it.
#[derive(Debug)]
pub struct Inflight {
    /// Repository the download was requested through (upstream vouches for it).
    pub repo: String,
    /// Read handle on the temp file (stays valid after rename or deletion).
    pub file: Arc<File>,
    pub progress: watch::Receiver<Progress>,
}

impl Inflight {
    /// Whether the download has failed (a new request must start another).
    pub fn failed(&self) -> bool {
        matches!(self.progress.borrow().state, FetchState::Failed(_))
    }
}

/// Everything the download task needs.
pub struct FetchJob {
    pub hex: String,
    pub temp_path: PathBuf,
    pub writer: File,
    pub upstream: ByteStream,
    /// Size upstream announced, if any.
    pub announced: Option<u64>,
    pub max_blob_bytes: u64,
    pub idle_timeout: Duration,
    pub progress: watch::Sender<Progress>,
    pub disk: DiskCache,
    /// Keeps the blob from eviction until the download and commit are over.
    pub pin: BlobPin,
    /// Called with each batch of bytes written (metrics).
    pub on_bytes: Arc<dyn Fn(u64) + Send + Sync>,
}

impl std::fmt::Debug for FetchJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchJob")
            .field("hex", &self.hex)
            .field("temp_path", &self.temp_path)
            .field("announced", &self.announced)
            .finish_non_exhaustive()
    }
}

/// Outcome of a download, for the caller's bookkeeping.
#[derive(Debug)]
pub struct FetchOutcome {
    pub result: Result<u64, CacheError>,
    /// Whether the blob is now in the disk cache.
    pub cached: bool,
}

impl FetchJob {
    /// Downloads, verifies, publishes, and commits into the disk cache (or discards).
    pub async fn run(self) -> FetchOutcome {
        let FetchJob {
            hex,
            temp_path,
            writer,
            upstream,
            announced,
            max_blob_bytes,
            idle_timeout,
            progress,
            disk,
            pin,
            on_bytes,
        } = self;
        let reservation = match announced {
            Some(size) => Some(disk.reserve(size).await),
            None => None,
        };
        let result = download(
            &hex,
            writer,
            upstream,
            announced,
            max_blob_bytes,
            idle_timeout,
            &progress,
            on_bytes,
        )
        .await;
        drop(reservation);
        match result {
            Ok(size) => {
                // Readers finish first; durability (fsync + rename) follows.
                progress.send_modify(|p| {
                    p.size = Some(size);
                    p.state = FetchState::Verified;
                });
                let cached = match disk.commit(&hex, &temp_path, size).await {
                    Ok(cached) => cached,
                    Err(e) => {
                        tracing::warn!(digest = %hex, error = %e, "cannot keep fetched blob in the cache");
                        disk.discard_temp(&temp_path).await;
                        false
                    }
                };
                drop(pin);
                FetchOutcome {
                    result: Ok(size),
                    cached,
                }
            }
            Err(e) => {
                progress.send_modify(|p| p.state = FetchState::Failed(e.clone()));
                disk.discard_temp(&temp_path).await;
                drop(pin);
                FetchOutcome {
                    result: Err(e),
                    cached: false,
                }
            }
        }
    }
}

/// What the writer thread reports when the upstream body is done.
struct Written {
    bytes: u64,
    sha256_hex: String,
}

/// Writes and hashes batches on a blocking thread, publishing progress after each write, so
/// receiving the next bytes from upstream overlaps with writing the previous ones.
fn spawn_writer(
    writer: File,
    mut batches: tokio::sync::mpsc::Receiver<Bytes>,
    progress: watch::Sender<Progress>,
    on_bytes: Arc<dyn Fn(u64) + Send + Sync>,
) -> tokio::task::JoinHandle<io::Result<Written>> {
    tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        let mut bytes: u64 = 0;
        while let Some(batch) = batches.blocking_recv() {
            write_all(&writer, &batch)?;
            hasher.update(&batch);
            bytes += batch.len() as u64;
            on_bytes(batch.len() as u64);
            progress.send_modify(|p| p.written = bytes);
        }
        Ok(Written {
            bytes,
            sha256_hex: hex::encode(hasher.finalize()),
        })
    })
}

#[allow(clippy::too_many_arguments)]
async fn download(
    hex: &str,
    writer: File,
    upstream: ByteStream,
    announced: Option<u64>,
    max_blob_bytes: u64,
    idle_timeout: Duration,
    progress: &watch::Sender<Progress>,
    on_bytes: Arc<dyn Fn(u64) + Send + Sync>,
) -> Result<u64, CacheError> {
    if let Some(size) = announced
        && size > max_blob_bytes
    {
        return Err(CacheError::TooLarge {
            what: format!("blob sha256:{hex}"),
            limit: max_blob_bytes,
        });
    }
    let (batch_tx, batch_rx) = tokio::sync::mpsc::channel::<Bytes>(WRITE_QUEUE);
    let writer = spawn_writer(writer, batch_rx, progress.clone(), on_bytes);
    let received = receive(
        hex,
        upstream,
        announced,
        max_blob_bytes,
        idle_timeout,
        batch_tx,
    )
    .await;
    // The writer ends once the sender is gone; wait for it so the file is quiet.
    let written = writer
        .await
        .map_err(|e| CacheError::Internal(format!("write task failed: {e}")))?
        .map_err(|e| CacheError::Io {
            path: format!("temp file of sha256:{hex}"),
            message: e.to_string(),
        });
    received?;
    let written = written?;
    if let Some(size) = announced
        && written.bytes != size
    {
        return Err(CacheError::Unavailable(format!(
            "upstream ended sha256:{hex} after {} of {size} bytes",
            written.bytes
        )));
    }
    if written.sha256_hex != hex {
        return Err(CacheError::DigestMismatch {
            expected: format!("sha256:{hex}"),
            actual: format!("sha256:{}", written.sha256_hex),
        });
    }
    Ok(written.bytes)
}

/// Pulls the upstream body, batching what has already arrived, and queues it for the
/// writer. Consumes the sender, so the writer sees the end when this returns.
async fn receive(
    hex: &str,
    mut upstream: ByteStream,
    announced: Option<u64>,
    max_blob_bytes: u64,
    idle_timeout: Duration,
    batches: tokio::sync::mpsc::Sender<Bytes>,
) -> Result<(), CacheError> {
    let limit = announced.unwrap_or(max_blob_bytes);
    let mut received: u64 = 0;
    let body_failed = |e: io::Error| {
        CacheError::Unavailable(format!("upstream body of sha256:{hex} failed: {e}"))
    };
    loop {
        let first = match tokio::time::timeout(idle_timeout, upstream.next()).await {
            Err(_) => {
                return Err(CacheError::Unavailable(format!(
                    "upstream sent nothing for {idle_timeout:?} while sending sha256:{hex}"
                )));
            }
            Ok(None) => return Ok(()),
            Ok(Some(Err(e))) => return Err(body_failed(e)),
            Ok(Some(Ok(chunk))) => chunk,
        };
        // Batch whatever else has already arrived into one write.
        let mut upstream_ended = false;
        let batch = if first.len() >= WRITE_BATCH {
            first
        } else {
            let mut batch = BytesMut::from(&first[..]);
            while batch.len() < WRITE_BATCH {
                match upstream.next().now_or_never() {
                    Some(Some(Ok(chunk))) => batch.extend_from_slice(&chunk),
                    Some(Some(Err(e))) => return Err(body_failed(e)),
                    Some(None) => {
                        upstream_ended = true;
                        break;
                    }
                    None => break,
                }
            }
            batch.freeze()
        };
        received += batch.len() as u64;
        if received > limit {
            return Err(match announced {
                Some(size) => CacheError::Upstream(format!(
                    "upstream sent more than the {size} bytes it announced for sha256:{hex}"
                )),
                None => CacheError::TooLarge {
                    what: format!("blob sha256:{hex}"),
                    limit: max_blob_bytes,
                },
            });
        }
        if batches.send(batch).await.is_err() {
            // The writer stopped (disk error); its result says why.
            return Ok(());
        }
        if upstream_ended {
            return Ok(());
        }
    }
}

/// Where a reader's bytes come from.
enum Source {
    /// A committed file, all of it readable.
    Complete,
    /// A temp file still being written.
    Growing(watch::Receiver<Progress>),
}

struct Reader {
    file: Arc<File>,
    pos: u64,
    end: u64,
    /// Whether `end` is the blob's last byte (held back until verified).
    reaches_end: bool,
    source: Source,
    done: bool,
    _pin: BlobPin,
}

/// A stream of `range` of a committed blob file.
pub fn complete_stream(file: Arc<File>, range: Range<u64>, pin: BlobPin) -> ByteStream {
    reader_stream(Reader {
        file,
        pos: range.start,
        end: range.end,
        reaches_end: false,
        source: Source::Complete,
        done: false,
        _pin: pin,
    })
}

/// A stream of `range` of a blob (of total `size`) still being downloaded: bytes are
/// delivered as they land; the stream errors if the download fails.
pub fn growing_stream(
    inflight: &Inflight,
    range: Range<u64>,
    size: u64,
    pin: BlobPin,
) -> ByteStream {
    reader_stream(Reader {
        file: Arc::clone(&inflight.file),
        pos: range.start,
        end: range.end,
        reaches_end: range.end == size,
        source: Source::Growing(inflight.progress.clone()),
        done: false,
        _pin: pin,
    })
}

fn reader_stream(reader: Reader) -> ByteStream {
    Box::pin(futures_util::stream::unfold(
        reader,
        |mut reader| async move {
            if reader.done {
                return None;
            }
            match reader.next_chunk().await {
                Ok(Some(bytes)) => Some((Ok(bytes), reader)),
                Ok(None) => None,
                Err(e) => {
                    reader.done = true;
                    Some((Err(e), reader))
                }
            }
        },
    ))
}

impl Reader {
    /// How far this reader may read now; `Err` if the download failed.
    async fn readable_until(&mut self) -> io::Result<u64> {
        let Source::Growing(progress) = &mut self.source else {
            return Ok(self.end);
        };
        loop {
            let snapshot = progress.borrow_and_update().clone();
            let readable = match &snapshot.state {
                FetchState::Failed(e) => {
                    return Err(io::Error::other(format!("upstream fetch failed: {e}")));
                }
                FetchState::Verified => self.end,
                FetchState::Running => {
                    let mut limit = snapshot.written.min(self.end);
                    if self.reaches_end && limit == self.end {
                        // Hold the last byte until the digest is checked.
                        limit = self.end.saturating_sub(1);
                    }
                    limit
                }
            };
            let want = MIN_GROWING_READ.min(self.end.saturating_sub(self.pos));
            let range_written = snapshot.written >= self.end;
            if self.pos >= self.end
                || readable >= self.pos.saturating_add(want)
                || (readable > self.pos && (range_written || snapshot.state != FetchState::Running))
            {
                return Ok(readable);
            }
            let changed = if readable > self.pos {
                // Something to send already: linger briefly for more, then send it anyway.
                match tokio::time::timeout(GROWING_READ_LINGER, progress.changed()).await {
                    Ok(changed) => changed,
                    Err(_) => return Ok(readable),
                }
            } else {
                progress.changed().await
            };
            if changed.is_err() {
                // The download task is gone without a verdict.
                let last = progress.borrow().clone();
                if last.state == FetchState::Verified {
                    return Ok(self.end);
                }
                return Err(io::Error::other(
                    "upstream fetch ended without completing the blob",
                ));
            }
        }
    }

    async fn next_chunk(&mut self) -> io::Result<Option<Bytes>> {
        if self.pos >= self.end {
            return Ok(None);
        }
        let readable = self.readable_until().await?;
        if self.pos >= self.end {
            return Ok(None);
        }
        let len = (readable - self.pos).min(READ_CHUNK);
        let (file, offset) = (Arc::clone(&self.file), self.pos);
        let usize_len = usize::try_from(len).map_err(io::Error::other)?;
        let bytes = tokio::task::spawn_blocking(move || read_exact_at(&file, offset, usize_len))
            .await
            .map_err(io::Error::other)??;
        self.pos += len;
        Ok(Some(bytes))
    }
}
