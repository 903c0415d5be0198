//! [`HttpRangeSource`]: the synchronous [`RangeSource`] the lazy reader pulls a remote
//! layer through, one blob per source, sharing the [`Client`]'s connections and tokens.
//! It is the registry backend's, not the client's: the client moves bytes and knows no
//! layer formats; this is where a registry blob becomes something `ferry-index` reads.
//!
//! The reader runs on plain threads (FUSE workers, rayon), so the source hands each read
//! to a tokio runtime and blocks for the answer. That runtime is either one the source
//! was given a [`tokio::runtime::Handle`] of, or a [`RangeRuntime`]: a runtime on a
//! dedicated thread, safe to create and drop anywhere. Calling a source from inside an
//! async task would block a runtime worker, so it is refused with an error instead.

use std::io;
use std::ops::Range;
use std::sync::Arc;

use ferry_index::source::RangeSource;
use futures_util::StreamExt;

use ferry_registry_client::{
    Client, ClientError, RangeRuntime, Repo, byteranges, check_digest, retry,
};

/// One remote blob as a synchronous [`RangeSource`].
#[derive(Debug, Clone)]
pub struct HttpRangeSource {
    client: Client,
    repo: Repo,
    digest: String,
    size: u64,
    handle: tokio::runtime::Handle,
    /// Keeps an owned runtime alive as long as the source.
    _runtime: Option<RangeRuntime>,
}

fn to_io(e: ClientError) -> io::Error {
    let kind = match &e {
        ClientError::NotFound { .. } => io::ErrorKind::NotFound,
        ClientError::Unauthorized { .. } | ClientError::Denied { .. } => {
            io::ErrorKind::PermissionDenied
        }
        ClientError::DigestMismatch { .. } | ClientError::Invalid { .. } => {
            io::ErrorKind::InvalidData
        }
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl HttpRangeSource {
    /// A source for blob `digest` of known `size`, running its requests on `handle`.
    pub fn new(
        client: Client,
        repo: Repo,
        digest: &str,
        size: u64,
        handle: tokio::runtime::Handle,
    ) -> Result<Self, ClientError> {
        check_digest(digest)?;
        Ok(HttpRangeSource {
            client,
            repo,
            digest: digest.to_string(),
            size,
            handle,
            _runtime: None,
        })
    }

    /// A source on a [`RangeRuntime`] (kept alive by the source).
    pub fn with_runtime(
        client: Client,
        repo: Repo,
        digest: &str,
        size: u64,
        runtime: &RangeRuntime,
    ) -> Result<Self, ClientError> {
        let mut s = Self::new(client, repo, digest, size, runtime.handle().clone())?;
        s._runtime = Some(runtime.clone());
        Ok(s)
    }

    /// A source whose size is asked of the registry (HEAD). Synchronous: not from
    /// inside an async context.
    pub fn open(
        client: Client,
        repo: Repo,
        digest: &str,
        runtime: &RangeRuntime,
    ) -> Result<Self, ClientError> {
        check_digest(digest)?;
        let (c, r, d) = (client.clone(), repo.clone(), digest.to_string());
        let size = run_on(runtime.handle(), async move { c.blob_size(&r, &d).await })
            .map_err(|e| ClientError::Config(e.to_string()))??
            .ok_or_else(|| ClientError::NotFound {
                what: format!("blob {digest} in {repo}"),
            })?;
        Self::with_runtime(client, repo, digest, size, runtime)
    }

    /// The blob's digest.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The same blob read from the registry itself, never from a pull mirror: where a
    /// reader refetches a range whose bytes did not verify. `None` when this registry
    /// has no mirrors (a refetch would go to the same place).
    pub fn origin_fallback(&self) -> Option<HttpRangeSource> {
        self.client
            .has_mirrors(&self.repo.registry)
            .then(|| HttpRangeSource {
                client: self.client.origin_only(),
                ..self.clone()
            })
    }

    /// Ranges of the blob (one, or several in one request: see
    /// [`Client::blob_ranges`]), retried as the client's config says.
    async fn fetch(
        client: Client,
        repo: Repo,
        digest: String,
        ranges: Vec<Range<u64>>,
    ) -> io::Result<Vec<Vec<u8>>> {
        let max = client.config().max_attempts.max(1);
        let mut attempt = 1;
        loop {
            // One range or several: the client sends a single range as a plain Range
            // request, and several in one request where the registry batches them.
            match client.blob_ranges(&repo, &digest, &ranges).await {
                Err(e) if e.is_retryable() && attempt < max => {
                    retry::sleep(client.config(), attempt, None).await;
                    attempt += 1;
                }
                other => return other.map_err(to_io),
            }
        }
    }

    fn check(&self, rg: &Range<u64>) -> io::Result<()> {
        if rg.start > rg.end || rg.end > self.size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "range {}..{} is outside blob {} of {} bytes",
                    rg.start, rg.end, self.digest, self.size
                ),
            ));
        }
        Ok(())
    }
}

/// Runs `fut` on `handle` and blocks the calling (non-async) thread for its result.
fn run_on<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> io::Result<T> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(io::Error::other(
            "HttpRangeSource was called from inside an async task; call it from a plain thread or tokio::task::spawn_blocking",
        ));
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv()
        .map_err(|_| io::Error::other("the range runtime shut down before answering"))
}

impl RangeSource for HttpRangeSource {
    fn len(&self) -> u64 {
        self.size
    }

    fn read_range(&self, range: Range<u64>) -> io::Result<Vec<u8>> {
        self.check(&range)?;
        if range.start == range.end {
            return Ok(Vec::new());
        }
        let fut = Self::fetch(
            self.client.clone(),
            self.repo.clone(),
            self.digest.clone(),
            vec![range],
        );
        run_on(&self.handle, fut)??
            .pop()
            .ok_or_else(|| io::Error::other("no bytes for the range"))
    }

    /// Blob `digest` of the same repository, through the same client and runtime (so a
    /// source reading from the origin only gives siblings that do too).
    fn sibling(&self, digest: &str, size: u64) -> Option<Arc<dyn RangeSource>> {
        check_digest(digest).ok()?;
        Some(Arc::new(HttpRangeSource {
            digest: digest.to_string(),
            size,
            ..self.clone()
        }))
    }

    /// Several ranges in one request each [`byteranges::MAX_RANGES`] (see
    /// [`Client::blob_ranges`]; ranges that touch or are out of order, one request
    /// each, concurrently); results come back in the order asked.
    fn read_ranges(&self, ranges: &[Range<u64>]) -> io::Result<Vec<Vec<u8>>> {
        for r in ranges {
            self.check(r)?;
        }
        let asked: Vec<Range<u64>> = ranges.iter().filter(|r| r.start < r.end).cloned().collect();
        let batches: Vec<Vec<Range<u64>>> = if asked.windows(2).all(|w| w[0].end < w[1].start) {
            asked
                .chunks(byteranges::MAX_RANGES)
                .map(<[_]>::to_vec)
                .collect()
        } else {
            asked.iter().map(|r| vec![r.clone()]).collect()
        };
        let concurrency = self.client.config().max_concurrent_downloads.max(1);
        let jobs: Vec<_> = batches
            .into_iter()
            .map(|batch| {
                Self::fetch(
                    self.client.clone(),
                    self.repo.clone(),
                    self.digest.clone(),
                    batch,
                )
            })
            .collect();
        let fut = async move {
            futures_util::stream::iter(jobs)
                .buffered(concurrency)
                .collect::<Vec<io::Result<Vec<Vec<u8>>>>>()
                .await
        };
        let mut fetched = Vec::with_capacity(asked.len());
        for batch in run_on(&self.handle, fut)? {
            fetched.extend(batch?);
        }
        let mut fetched = fetched.into_iter();
        ranges
            .iter()
            .map(|r| {
                if r.start == r.end {
                    Ok(Vec::new())
                } else {
                    fetched
                        .next()
                        .ok_or_else(|| io::Error::other("a range went unanswered"))
                }
            })
            .collect()
    }

    fn batches_ranges(&self) -> bool {
        self.client.batches_ranges(&self.repo.registry)
    }
}
