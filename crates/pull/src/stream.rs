//! One layer downloaded and unpacked at the same time: the blob is cut into pieces of
//! `chunk_size`, fetched with concurrent Range requests (they land in any order), and the
//! in-order prefix is handed to the unpacker on a blocking thread while later pieces are
//! still downloading. The layer digest is hashed over exactly the bytes the unpacker
//! consumed and checked at the end; a mismatch, a bad piece or a failed unpack removes
//! the destination directory.
//!
//! Memory is bounded by a [`BufferBudget`] shared by every layer of a pull: a piece
//! reserves its bytes before its request starts and gives them back only once the
//! unpacker has read past it, so a slow unpacker stops the downloader (backpressure)
//! instead of letting pieces pile up. Reservations are taken in piece order, which is
//! what keeps this deadlock-free: every layer holding budget has its lowest unread piece
//! among its reservations, and (the caller's job) a running unpacker.
//!
//! Where the bytes come from is a [`PieceSource`], so the ordering, bounding and
//! verification are tested with in-memory sources; [`RegistryPieces`] is the real one.
//! Nothing here knows containerd or the snapshotter.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::io::{self, Read};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry_oci::media::LayerCompression;
use ferry_registry_client::{Client, ClientError, Repo};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use sha2::{Digest as _, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::PullError;
use crate::unpack::{self, UnpackError, UnpackLimits, UnpackStats};

/// Largest piece (Range request) accepted: a piece is held in memory whole.
pub const MAX_CHUNK_SIZE: u64 = 1 << 30;

/// Where a layer's bytes come from.
pub trait PieceSource: Send + Sync {
    /// Fetches exactly the bytes `range` of the blob, as one or more frames.
    fn fetch(
        &self,
        range: Range<u64>,
    ) -> impl Future<Output = Result<Vec<Bytes>, PullError>> + Send;
}

/// Bytes of layer data a pull may hold in memory at once (downloading, downloaded but not
/// yet unpacked, being unpacked), shared by all its layers. Also counts what is held.
#[derive(Debug)]
pub struct BufferBudget {
    permits: Arc<Semaphore>,
    limit: u64,
    held: AtomicU64,
    peak: AtomicU64,
}

impl BufferBudget {
    /// A budget of `limit` bytes (at least 1).
    pub fn new(limit: u64) -> Arc<BufferBudget> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS as u64);
        Arc::new(BufferBudget {
            permits: Arc::new(Semaphore::new(
                usize::try_from(limit).unwrap_or(Semaphore::MAX_PERMITS),
            )),
            limit,
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved right now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Most bytes ever reserved at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Waits until `bytes` (at most the limit) can be reserved.
    async fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, PullError> {
        let wanted = u32::try_from(bytes)
            .ok()
            .filter(|b| u64::from(*b) <= self.limit)
            .ok_or_else(|| {
                PullError::Usage(format!(
                    "a piece of {bytes} bytes does not fit the {} byte buffer budget",
                    self.limit
                ))
            })?;
        let permit = self
            .permits
            .clone()
            .acquire_many_owned(wanted)
            .await
            .map_err(|e| PullError::Internal(format!("buffer budget: {e}")))?;
        let now = self.held.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(Reservation {
            budget: self.clone(),
            bytes,
            _permit: permit,
        })
    }
}

/// Bytes reserved from a [`BufferBudget`], given back on drop.
#[derive(Debug)]
struct Reservation {
    budget: Arc<BufferBudget>,
    bytes: u64,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A landed piece on its way to the unpacker, with the budget it holds.
#[derive(Debug)]
struct Piece {
    frames: Vec<Bytes>,
    reservation: Reservation,
}

/// What to stream.
#[derive(Debug, Clone)]
pub struct LayerStream {
    /// `sha256:<hex>` of the blob, checked over the bytes consumed.
    pub digest: String,
    /// Blob size in bytes.
    pub size: u64,
    /// How the tar is compressed.
    pub compression: LayerCompression,
    /// Directory to create and unpack into (must not exist; removed on failure).
    pub dest: PathBuf,
    /// Bytes per Range request (1 ..= [`MAX_CHUNK_SIZE`]).
    pub chunk_size: u64,
    /// Bounds on the layer's contents.
    pub limits: UnpackLimits,
}

/// Downloads `layer` from `source` and unpacks it into `layer.dest` as the bytes arrive.
///
/// `connections` bounds Range requests in flight (shared by the pull's layers), `budget`
/// the bytes held. `unpack_slot` is held by the unpacking thread until it ends, so a
/// caller that acquires all slots afterwards knows nothing writes into staging any more.
/// `on_landed` is called with each piece's size as it arrives.
pub async fn stream_layer<S: PieceSource>(
    source: &S,
    layer: &LayerStream,
    budget: &Arc<BufferBudget>,
    connections: &Arc<Semaphore>,
    unpack_slot: OwnedSemaphorePermit,
    on_landed: &(dyn Fn(u64) + Send + Sync),
) -> Result<UnpackStats, PullError> {
    if layer.chunk_size == 0 || layer.chunk_size > MAX_CHUNK_SIZE {
        return Err(PullError::Usage(format!(
            "chunk size {} is not between 1 and {MAX_CHUNK_SIZE}",
            layer.chunk_size
        )));
    }
    if layer.chunk_size.min(layer.size) > budget.limit() {
        return Err(PullError::Usage(format!(
            "the buffer budget ({} bytes) is smaller than one piece ({} bytes)",
            budget.limit(),
            layer.chunk_size
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let reader = PieceReader {
        rx,
        frames: VecDeque::new(),
        current: None,
        hasher: Sha256::new(),
        consumed: 0,
        expected: layer.size,
    };
    let (dest, compression, limits) = (layer.dest.clone(), layer.compression, layer.limits);
    let unpacker = tokio::task::spawn_blocking(move || {
        let _slot = unpack_slot;
        std::fs::create_dir(&dest).map_err(|source| UnpackError::Io {
            op: "mkdir",
            path: dest.clone(),
            source,
        })?;
        let result = unpack_from(reader, compression, &dest, &limits);
        if result.is_err() {
            // This thread created dest and is its only writer: removing it cannot race.
            remove_dir(&dest);
        }
        result
    });
    let download = download(source, layer, budget, connections, tx, on_landed);
    tokio::pin!(download, unpacker);
    let mut downloaded: Option<Result<(), DownloadStop>> = None;
    let unpacked = loop {
        tokio::select! {
            result = &mut download, if downloaded.is_none() => downloaded = Some(result),
            joined = &mut unpacker => break joined,
        }
    };
    let unpacked = match unpacked {
        Ok(result) => result,
        Err(e) => return Err(PullError::Internal(format!("unpack task: {e}"))),
    };
    // A download failure explains an unpack that ran out of bytes; it comes first.
    if let Some(Err(DownloadStop::Failed(e))) = downloaded {
        return Err(e);
    }
    let (stats, digest) = match unpacked {
        Ok(done) => done,
        Err(source) => {
            return Err(PullError::Unpack {
                digest: layer.digest.clone(),
                source,
            });
        }
    };
    if downloaded.is_none() {
        // The unpacker saw the end of the stream, so the downloader has returned (its
        // sender is gone); this only collects its result.
        if let Err(stop) = download.await {
            remove_dir(&layer.dest);
            return Err(match stop {
                DownloadStop::Failed(e) => e,
                DownloadStop::UnpackerGone => {
                    PullError::Internal("the unpacker ended before the download".into())
                }
            });
        }
    }
    if digest != layer.digest {
        remove_dir(&layer.dest);
        return Err(PullError::Registry(ClientError::DigestMismatch {
            expected: layer.digest.clone(),
            actual: digest,
        }));
    }
    Ok(stats)
}

fn remove_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a failed layer's directory")
        }
    }
}

/// Unpacks the stream into `dest` (an empty directory), then reads whatever the decoder
/// left so the digest covers the whole blob. Returns the stats and the blob's digest.
fn unpack_from(
    mut reader: PieceReader,
    compression: LayerCompression,
    dest: &Path,
    limits: &UnpackLimits,
) -> Result<(UnpackStats, String), UnpackError> {
    let stats = unpack::unpack_layer(&mut reader, compression, dest, limits)?;
    io::copy(&mut reader, &mut io::sink()).map_err(|e| UnpackError::Format(e.to_string()))?;
    let digest = format!("sha256:{}", hex::encode(reader.hasher.finalize()));
    Ok((stats, digest))
}

/// The unpacker's end: reads pieces in order, hashing them, and gives each piece's
/// budget back as soon as it has been read.
struct PieceReader {
    rx: mpsc::UnboundedReceiver<Piece>,
    frames: VecDeque<Bytes>,
    current: Option<Reservation>,
    hasher: Sha256,
    consumed: u64,
    expected: u64,
}

impl Read for PieceReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if let Some(frame) = self.frames.front_mut() {
                let n = frame.len().min(buf.len());
                buf[..n].copy_from_slice(&frame[..n]);
                let _ = frame.split_to(n);
                if frame.is_empty() {
                    self.frames.pop_front();
                }
                self.hasher.update(&buf[..n]);
                self.consumed += n as u64;
                return Ok(n);
            }
            // The piece is read: its budget goes back before waiting for the next.
            self.current = None;
            match self.rx.blocking_recv() {
                Some(piece) => {
                    self.frames = piece.frames.into();
                    self.frames.retain(|f| !f.is_empty());
                    self.current = Some(piece.reservation);
                }
                None if self.consumed == self.expected => return Ok(0),
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "the download stopped after {} of {} bytes",
                            self.consumed, self.expected
                        ),
                    ));
                }
            }
        }
    }
}

/// Why [`download`] stopped early.
#[derive(Debug)]
enum DownloadStop {
    /// A piece could not be fetched (or was wrong).
    Failed(PullError),
    /// The unpacker stopped reading (its own error says why).
    UnpackerGone,
}

impl From<PullError> for DownloadStop {
    fn from(e: PullError) -> Self {
        DownloadStop::Failed(e)
    }
}

/// Fetches every piece (reserving budget and a connection first, in piece order) and
/// sends the in-order prefix to the unpacker as it grows. Returns when the last piece is
/// sent, dropping the sender, which is the unpacker's end of stream.
async fn download<S: PieceSource>(
    source: &S,
    layer: &LayerStream,
    budget: &Arc<BufferBudget>,
    connections: &Arc<Semaphore>,
    to_unpacker: mpsc::UnboundedSender<Piece>,
    on_landed: &(dyn Fn(u64) + Send + Sync),
) -> Result<(), DownloadStop> {
    let chunk = layer.chunk_size;
    let count = layer.size.div_ceil(chunk);
    let range_of = |k: u64| k * chunk..((k + 1) * chunk).min(layer.size);
    type Reserving = Pin<
        Box<dyn Future<Output = Result<(Reservation, OwnedSemaphorePermit), PullError>> + Send>,
    >;
    let reserve = |k: u64| -> Reserving {
        let (budget, connections) = (budget.clone(), connections.clone());
        let len = range_of(k).end - range_of(k).start;
        Box::pin(async move {
            let reservation = budget.reserve(len).await?;
            let connection = connections
                .acquire_owned()
                .await
                .map_err(|e| PullError::Internal(format!("connection budget: {e}")))?;
            Ok((reservation, connection))
        })
    };
    let mut in_flight = FuturesUnordered::new();
    let mut landed: BTreeMap<u64, Piece> = BTreeMap::new();
    let mut next_start = 0u64;
    let mut next_send = 0u64;
    let mut reserving: Option<Reserving> = (count > 0).then(|| reserve(0));
    while next_send < count {
        tokio::select! {
            Some((k, fetched, reservation)) = in_flight.next() => {
                let frames: Vec<Bytes> = fetched?;
                let want = range_of(k);
                let got: u64 = frames.iter().map(|f| f.len() as u64).sum();
                if got != want.end - want.start {
                    return Err(DownloadStop::Failed(PullError::Registry(ClientError::Invalid {
                        what: format!("blob {}", layer.digest),
                        reason: format!(
                            "bytes {}..{}: got {got} bytes",
                            want.start, want.end
                        ),
                    })));
                }
                on_landed(got);
                landed.insert(k, Piece { frames, reservation });
                while let Some(piece) = landed.remove(&next_send) {
                    if to_unpacker.send(piece).is_err() {
                        return Err(DownloadStop::UnpackerGone);
                    }
                    next_send += 1;
                }
            }
            reserved = async {
                match reserving.as_mut() {
                    Some(f) => f.await,
                    None => std::future::pending().await,
                }
            }, if reserving.is_some() =>
            {
                let (reservation, connection) = reserved?;
                let k = next_start;
                let range = range_of(k);
                in_flight.push(async move {
                    let fetched = source.fetch(range).await;
                    drop(connection);
                    (k, fetched, reservation)
                });
                next_start += 1;
                reserving = (next_start < count).then(|| reserve(next_start));
            }
        }
    }
    Ok(())
}

/// A layer blob in a registry, fetched one Range request per piece, retrying transport
/// failures and 429/5xx answers with exponential backoff.
#[derive(Debug, Clone)]
pub struct RegistryPieces {
    client: Client,
    repo: Repo,
    digest: String,
    warned_no_range: Arc<std::sync::atomic::AtomicBool>,
}

impl RegistryPieces {
    /// Blob `digest` in `repo`.
    pub fn new(client: Client, repo: Repo, digest: String) -> RegistryPieces {
        RegistryPieces {
            client,
            repo,
            digest,
            warned_no_range: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    async fn fetch_once(&self, range: Range<u64>) -> Result<Vec<Bytes>, ClientError> {
        let (stream, honoured) = self
            .client
            .open_blob(&self.repo, &self.digest, Some(range.clone()))
            .await?;
        // A registry that ignores Range sends the blob from its first byte: skip to the
        // piece and stop after it. Correct, though each piece then re-reads the blob's
        // head; such a registry cannot serve lazy layers either, so say so once.
        let mut skip = if honoured { 0 } else { range.start };
        if !honoured
            && !self
                .warned_no_range
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(registry = %self.repo.registry, digest = %self.digest,
                "the registry ignores Range requests: each piece re-reads the blob from its start");
        }
        let mut body = stream.body;
        let mut frames = Vec::new();
        let mut got = 0u64;
        let want = range.end - range.start;
        while let Some(frame) = body.next().await {
            let mut frame = frame.map_err(|e| ClientError::Transport {
                registry: self.repo.registry.clone(),
                message: format!(
                    "blob {} bytes {}..{}: {e}",
                    self.digest, range.start, range.end
                ),
            })?;
            if skip > 0 {
                let n = skip.min(frame.len() as u64);
                let _ = frame.split_to(n as usize);
                skip -= n;
                if frame.is_empty() {
                    continue;
                }
            }
            if !honoured && got + frame.len() as u64 > want {
                frame.truncate((want - got) as usize);
                frames.push(frame);
                break;
            }
            got += frame.len() as u64;
            if got > want {
                return Err(ClientError::Invalid {
                    what: format!("blob {}", self.digest),
                    reason: format!("bytes {}..{}: more than asked", range.start, range.end),
                });
            }
            frames.push(frame);
        }
        Ok(frames)
    }
}

impl PieceSource for RegistryPieces {
    async fn fetch(&self, range: Range<u64>) -> Result<Vec<Bytes>, PullError> {
        let config = self.client.config();
        let attempts = config.max_attempts.max(1);
        let mut attempt = 1;
        loop {
            match self.fetch_once(range.clone()).await {
                Err(e) if e.is_retryable() && attempt < attempts => {
                    let delay = config
                        .base_backoff
                        .saturating_mul(1 << (attempt - 1).min(6))
                        .min(Duration::from_secs(10));
                    tracing::debug!(digest = %self.digest, start = range.start, error = %e, ?delay, "piece failed; retrying");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                other => return other.map_err(PullError::Registry),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::io::Write as _;
    use std::sync::Mutex;

    /// An in-memory blob whose first `reversed` pieces complete in reverse order (piece
    /// i waits until every piece after it among those has landed), optionally with one
    /// byte flipped, one piece failing or one piece short.
    struct MemoryPieces {
        blob: Vec<u8>,
        chunk: u64,
        reversed: u64,
        corrupt_at: Option<usize>,
        fail_piece: Option<u64>,
        short_piece: Option<u64>,
        landed: Mutex<BTreeSet<u64>>,
        changed: tokio::sync::Notify,
        order: Mutex<Vec<u64>>,
    }

    impl MemoryPieces {
        fn new(blob: Vec<u8>, chunk: u64, reversed: u64) -> MemoryPieces {
            MemoryPieces {
                blob,
                chunk,
                reversed,
                corrupt_at: None,
                fail_piece: None,
                short_piece: None,
                landed: Mutex::new(BTreeSet::new()),
                changed: tokio::sync::Notify::new(),
                order: Mutex::new(Vec::new()),
            }
        }
    }

    impl PieceSource for MemoryPieces {
        async fn fetch(&self, range: Range<u64>) -> Result<Vec<Bytes>, PullError> {
            let k = range.start / self.chunk;
            if self.fail_piece == Some(k) {
                return Err(PullError::Registry(ClientError::Transport {
                    registry: "memory".into(),
                    message: "connection reset".into(),
                }));
            }
            if self.short_piece == Some(k) {
                return Ok(vec![Bytes::from_static(b"x")]);
            }
            let last = self
                .reversed
                .min(self.blob.len() as u64 / self.chunk + 1)
                .saturating_sub(1);
            if k < last {
                loop {
                    let notified = self.changed.notified();
                    if (k + 1..=last).all(|j| self.landed.lock().unwrap().contains(&j)) {
                        break;
                    }
                    notified.await;
                }
            }
            let mut bytes = self.blob[range.start as usize..range.end as usize].to_vec();
            if let Some(at) = self.corrupt_at
                && (range.start as usize..range.end as usize).contains(&at)
            {
                bytes[at - range.start as usize] ^= 0x55;
            }
            // Two frames per piece, to exercise frame handling.
            let tail = Bytes::from(bytes.split_off(bytes.len() / 2));
            self.landed.lock().unwrap().insert(k);
            self.order.lock().unwrap().push(k);
            self.changed.notify_waiters();
            Ok(vec![Bytes::from(bytes), tail])
        }
    }

    fn sha(data: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(data)))
    }

    /// A gzip layer with several files (some larger than a piece) and its tar.
    fn layer() -> (Vec<u8>, Vec<u8>) {
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |path: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_mtime(1_600_000_000);
            h.set_uid(0);
            h.set_gid(0);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, path, data).unwrap();
        };
        let big: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i * 7919).to_le_bytes())
            .collect();
        add("a/big.bin", &big);
        add("a/small.txt", b"hello");
        add("b/mid.bin", &big[..30_000]);
        let tar = b.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar).unwrap();
        (gz.finish().unwrap(), tar)
    }

    fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                if p.is_dir() {
                    out.insert(format!("{rel}/"), Vec::new());
                    stack.push(p);
                } else {
                    out.insert(rel, std::fs::read(&p).unwrap());
                }
            }
        }
        out
    }

    fn spec(blob: &[u8], dest: PathBuf, chunk: u64) -> LayerStream {
        LayerStream {
            digest: sha(blob),
            size: blob.len() as u64,
            compression: LayerCompression::Gzip,
            dest,
            chunk_size: chunk,
            limits: UnpackLimits::default(),
        }
    }

    async fn run(
        source: &MemoryPieces,
        layer: &LayerStream,
        budget: &Arc<BufferBudget>,
        connections: usize,
    ) -> (Result<UnpackStats, PullError>, u64) {
        let slots = Arc::new(Semaphore::new(1));
        let slot = slots.clone().acquire_owned().await.unwrap();
        let landed = AtomicU64::new(0);
        let result = stream_layer(
            source,
            layer,
            budget,
            &Arc::new(Semaphore::new(connections)),
            slot,
            &|n| {
                landed.fetch_add(n, Ordering::Relaxed);
            },
        )
        .await;
        // The unpack thread gives its slot back when it is done writing.
        let _all = slots.acquire().await.unwrap();
        (result, landed.load(Ordering::Relaxed))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn out_of_order_pieces_give_the_same_tree_as_a_whole_unpack() {
        let (blob, tar) = layer();
        let chunk = 4096;
        let pieces = (blob.len() as u64).div_ceil(chunk);
        assert!(pieces > 8, "the test wants many pieces, got {pieces}");
        let tmp = tempfile::tempdir().unwrap();

        let whole = tmp.path().join("whole");
        std::fs::create_dir(&whole).unwrap();
        let expected = unpack::unpack_layer(
            &blob[..],
            LayerCompression::Gzip,
            &whole,
            &UnpackLimits::default(),
        )
        .unwrap();

        let source = MemoryPieces::new(blob.clone(), chunk, 6);
        let budget = BufferBudget::new(8 * chunk);
        let streamed = tmp.path().join("streamed");
        let (result, landed) =
            run(&source, &spec(&blob, streamed.clone(), chunk), &budget, 6).await;
        let stats = result.unwrap();
        assert_eq!(stats, expected);
        assert_eq!(stats.diff_id, sha(&tar));
        assert_eq!(landed, blob.len() as u64);
        assert_eq!(tree(&streamed), tree(&whole));
        assert!(tree(&streamed).contains_key("a/big.bin"));
        let order = source.order.lock().unwrap().clone();
        let first: Vec<u64> = order.iter().copied().filter(|k| *k < 6).collect();
        assert_eq!(
            first,
            [5, 4, 3, 2, 1, 0],
            "pieces landed in reverse: {order:?}"
        );
        assert_eq!(order.len() as u64, pieces, "each piece fetched once");
        assert_eq!(budget.held(), 0, "every reservation given back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn buffered_bytes_stay_within_the_budget() {
        let (blob, _) = layer();
        let chunk = 4096;
        let tmp = tempfile::tempdir().unwrap();
        // Reversal deeper than the budget: pieces 0..2 can be in flight, not more.
        let source = MemoryPieces::new(blob.clone(), chunk, 3);
        let budget = BufferBudget::new(3 * chunk);
        let (result, _) = run(
            &source,
            &spec(&blob, tmp.path().join("l"), chunk),
            &budget,
            10,
        )
        .await;
        result.unwrap();
        assert!(
            budget.peak() <= 3 * chunk,
            "peak {} over the budget",
            budget.peak()
        );
        assert!(
            budget.peak() > chunk,
            "pieces were fetched in parallel (peak {})",
            budget.peak()
        );
        assert_eq!(budget.held(), 0);

        // An existing destination is refused and left as it was.
        let taken = tmp.path().join("taken");
        std::fs::create_dir(&taken).unwrap();
        std::fs::write(taken.join("keep"), b"mine").unwrap();
        let (result, _) = run(&source, &spec(&blob, taken.clone(), chunk), &budget, 2).await;
        assert!(
            matches!(result, Err(PullError::Unpack { .. })),
            "{result:?}"
        );
        assert_eq!(std::fs::read(taken.join("keep")).unwrap(), b"mine");

        // A budget smaller than a piece is refused up front.
        let small = BufferBudget::new(chunk - 1);
        let (result, _) = run(
            &source,
            &spec(&blob, tmp.path().join("m"), chunk),
            &small,
            2,
        )
        .await;
        assert!(matches!(result, Err(PullError::Usage(_))), "{result:?}");
        assert!(!tmp.path().join("m").exists());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_corrupt_piece_fails_and_leaves_nothing() {
        let (blob, tar) = layer();
        let chunk = 4096;
        let tmp = tempfile::tempdir().unwrap();
        // Compressed: the flipped byte breaks inflate or the gzip CRC.
        let mut source = MemoryPieces::new(blob.clone(), chunk, 4);
        source.corrupt_at = Some(blob.len() / 2);
        let budget = BufferBudget::new(6 * chunk);
        let dest = tmp.path().join("gz");
        let (result, _) = run(&source, &spec(&blob, dest.clone(), chunk), &budget, 4).await;
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                PullError::Unpack { .. } | PullError::Registry(ClientError::DigestMismatch { .. })
            ),
            "{err}"
        );
        assert!(!dest.exists(), "nothing staged after a corrupt piece");
        assert_eq!(budget.held(), 0);

        // Uncompressed, a flipped byte inside file content still unpacks: only the digest
        // check catches it, and it must remove what was written.
        let mut source = MemoryPieces::new(tar.clone(), chunk, 4);
        let content = tar.windows(5).position(|w| w == b"hello").unwrap();
        source.corrupt_at = Some(content);
        let dest = tmp.path().join("plain");
        let layer = LayerStream {
            compression: LayerCompression::None,
            ..spec(&tar, dest.clone(), chunk)
        };
        let (result, _) = run(&source, &layer, &budget, 4).await;
        match result {
            Err(PullError::Registry(ClientError::DigestMismatch { expected, .. })) => {
                assert_eq!(expected, sha(&tar));
            }
            other => panic!("expected a digest mismatch, got {other:?}"),
        }
        assert!(!dest.exists(), "nothing staged after a digest mismatch");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_or_short_piece_is_the_error_reported_and_nothing_is_left() {
        let (blob, _) = layer();
        let chunk = 4096;
        let tmp = tempfile::tempdir().unwrap();
        let budget = BufferBudget::new(4 * chunk);

        let mut failing = MemoryPieces::new(blob.clone(), chunk, 0);
        failing.fail_piece = Some(3);
        let dest = tmp.path().join("failing");
        let (result, _) = run(&failing, &spec(&blob, dest.clone(), chunk), &budget, 1).await;
        let err = result.unwrap_err().to_string();
        assert!(err.contains("connection reset"), "{err}");
        assert!(!dest.exists());
        assert_eq!(budget.held(), 0);

        let mut short = MemoryPieces::new(blob.clone(), chunk, 0);
        short.short_piece = Some(2);
        let dest = tmp.path().join("short");
        let (result, _) = run(&short, &spec(&blob, dest.clone(), chunk), &budget, 2).await;
        let err = result.unwrap_err().to_string();
        assert!(err.contains("bytes 8192..12288: got 1 bytes"), "{err}");
        assert!(!dest.exists());
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layers_sharing_a_small_budget_all_finish() {
        let (blob, _) = layer();
        let chunk = 4096;
        let tmp = tempfile::tempdir().unwrap();
        // Room for three pieces across three layers and two unpack slots: each layer can
        // only progress as the others give budget back.
        let budget = BufferBudget::new(3 * chunk);
        let connections = Arc::new(Semaphore::new(2));
        let slots = Arc::new(Semaphore::new(2));
        let source = MemoryPieces::new(blob.clone(), chunk, 0);
        let mut running = Vec::new();
        for i in 0..3 {
            let slot = slots.clone().acquire_owned().await.unwrap();
            let layer = spec(&blob, tmp.path().join(format!("l{i}")), chunk);
            let (budget, connections, source) = (&budget, &connections, &source);
            running.push(async move {
                stream_layer(source, &layer, budget, connections, slot, &|_| {}).await
            });
            if running.len() == 2 {
                // Both slots are taken: run these two before starting the third.
                let mut both = futures_util::future::join_all(running.drain(..)).await;
                for r in both.drain(..) {
                    r.unwrap();
                }
            }
        }
        for r in futures_util::future::join_all(running).await {
            r.unwrap();
        }
        let _all = slots.acquire_many(2).await.unwrap();
        assert!(budget.peak() <= 3 * chunk);
        assert_eq!(budget.held(), 0);
        let first = tree(&tmp.path().join("l0"));
        assert_eq!(tree(&tmp.path().join("l1")), first);
        assert_eq!(tree(&tmp.path().join("l2")), first);
    }
}
