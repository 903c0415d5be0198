//! Request bodies as storage streams, guarded against slow and oversized clients.
//!
//! A client that stops sending mid-upload would otherwise pin a connection, a task and an
//! upload session forever; [`IdleTimeoutBody`] fails the stream once nothing arrives for
//! the configured idle time. Sizes are checked against `Content-Length` before reading a
//! byte, and bounded while reading, so an oversized body is never buffered.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::body::HttpBody as _;
use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use http::HeaderMap;
use tokio::time::{Instant, Sleep};

use crate::server::errors::{ApiError, ErrorCode};
use crate::server::metrics::Metrics;
use crate::storage::ByteStream;

/// A request body as a stream of chunks that fails with `TimedOut` when the client goes
/// quiet for `idle`.
pub struct IdleTimeoutBody {
    body: Body,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    metrics: Metrics,
    done: bool,
}

impl std::fmt::Debug for IdleTimeoutBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleTimeoutBody")
            .field("idle", &self.idle)
            .finish()
    }
}

impl IdleTimeoutBody {
    pub fn new(body: Body, idle: Duration, metrics: Metrics) -> Self {
        IdleTimeoutBody {
            body,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            metrics,
            done: false,
        }
    }

    /// As a storage [`ByteStream`].
    pub fn into_stream(self) -> ByteStream {
        Box::pin(self)
    }
}

impl Stream for IdleTimeoutBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers carry nothing we store
                    };
                    if data.is_empty() {
                        continue;
                    }
                    this.metrics.bytes_received(data.len() as u64);
                    let deadline = Instant::now() + this.idle;
                    this.timer.as_mut().reset(deadline);
                    return Poll::Ready(Some(Ok(data)));
                }
                Poll::Ready(Some(Err(err))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(std::io::Error::other(err))));
                }
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if this.timer.as_mut().poll(cx).is_ready() {
                        this.done = true;
                        return Poll::Ready(Some(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("no request body data for {:?}", this.idle),
                        ))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Whether the body is known to be empty (no `Content-Length`/chunked data to come).
pub fn body_is_empty(body: &Body) -> bool {
    body.is_end_stream() || body.size_hint().upper() == Some(0)
}

/// The declared `Content-Length`, if any and well-formed.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Refuses up front a body whose declared length exceeds `limit`.
pub fn check_declared_length(
    headers: &HeaderMap,
    limit: u64,
    code: ErrorCode,
) -> Result<(), ApiError> {
    match content_length(headers) {
        Some(n) if n > limit => Err(ApiError::too_large(code, limit)),
        _ => Ok(()),
    }
}

/// Reads a whole body of at most `limit` bytes (manifests). Fails as soon as the limit is
/// passed, without reading the rest.
pub async fn collect_bounded(
    body: Body,
    limit: u64,
    idle: Duration,
    metrics: &Metrics,
    code: ErrorCode,
) -> Result<Bytes, ApiError> {
    let mut stream = IdleTimeoutBody::new(body, idle, metrics.clone());
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(body_error)?;
        if (buf.len() + chunk.len()) as u64 > limit {
            return Err(ApiError::too_large(code, limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The answer to a body that failed while being read.
pub fn body_error(err: std::io::Error) -> ApiError {
    if err.kind() == std::io::ErrorKind::TimedOut {
        ApiError::new(ErrorCode::BlobUploadInvalid, err.to_string())
            .with_status(http::StatusCode::REQUEST_TIMEOUT)
    } else {
        ApiError::new(
            ErrorCode::BlobUploadInvalid,
            format!("request body failed: {err}"),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn collects_within_limit_and_refuses_beyond() {
        let m = Metrics::new();
        let b = collect_bounded(
            Body::from("hello"),
            5,
            Duration::from_secs(5),
            &m,
            ErrorCode::ManifestInvalid,
        )
        .await
        .unwrap();
        assert_eq!(&b[..], b"hello");
        let e = collect_bounded(
            Body::from("hello!"),
            5,
            Duration::from_secs(5),
            &m,
            ErrorCode::ManifestInvalid,
        )
        .await
        .unwrap_err();
        assert_eq!(e.status, http::StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn idle_body_times_out() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let stream = tokio_stream_from(rx);
        let body = Body::from_stream(stream);
        let mut s = IdleTimeoutBody::new(body, Duration::from_millis(100), Metrics::new());
        tx.send(Ok(Bytes::from_static(b"ab"))).await.unwrap();
        assert_eq!(&s.next().await.unwrap().unwrap()[..], b"ab");
        // Nothing more arrives (the sender stays open): the stream fails.
        let err = s.next().await.unwrap().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(s.next().await.is_none());
        drop(tx);
    }

    fn tokio_stream_from(
        mut rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    ) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }
}
