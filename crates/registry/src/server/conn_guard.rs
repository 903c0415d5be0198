//! Per-connection limits the HTTP stack does not give: a deadline for the first request
//! from accept, an idle timeout between requests, a stall timeout for responses nobody
//! reads, and a cap on connections per client address.
//!
//! Why: hyper's `header_read_timeout` starts only once HTTP/1 parsing begins, but the
//! auto (h1 + h2c) builder first waits for the protocol preface with no deadline, and an
//! HTTP/2 connection with no streams (answering pings) never ends. A few hundred silent
//! sockets would then hold every connection slot. The watchdog here sees the raw socket:
//! [`ActivityIo`] records when bytes last moved, [`InFlight`] counts requests (until their
//! response body is done), and [`watch`] resolves when the connection must go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody};
use bytes::Bytes;
use http::{Request, Response};
use hyper::rt::{Read, ReadBufCursor, Write};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::auth::ClientAddr;

/// What a connection's watchdog observes. Shared by the I/O wrapper, the request counter
/// and the watchdog.
#[derive(Debug)]
pub struct Activity {
    start: Instant,
    /// Milliseconds after `start` when a byte was last read or written.
    last_io_ms: AtomicU64,
    /// A write is waiting for the client to read.
    write_blocked: AtomicBool,
    /// Requests received so far.
    requests: AtomicU64,
    /// Requests whose response has not been fully sent.
    in_flight: AtomicUsize,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: Instant::now(),
            last_io_ms: AtomicU64::new(0),
            write_blocked: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        })
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_io_ms.fetch_max(ms, Ordering::Relaxed);
    }

    fn last_io(&self) -> Instant {
        self.start + Duration::from_millis(self.last_io_ms.load(Ordering::Relaxed))
    }
}

/// Why a connection was closed by its watchdog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// No complete request head within the header timeout of accept.
    NoRequest,
    /// Idle (no request in flight) for the idle timeout.
    Idle,
    /// A response write made no progress for the idle timeout (a client that stopped
    /// reading).
    Stalled,
}

/// What the watchdog does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Close(Expired),
    LookAgainAt(Instant),
}

/// The watchdog's rule at `now`: close when no first request arrived within
/// `first_request` of accept, when nothing is in flight and no bytes moved for `idle`, or
/// when a write is blocked with no progress for `idle`. A request in flight that is merely
/// slow to compute is left alone (its body has its own idle timeout).
fn verdict(activity: &Activity, now: Instant, first_request: Duration, idle: Duration) -> Verdict {
    let idle_deadline = activity.last_io() + idle;
    let deadline = if activity.requests.load(Ordering::Relaxed) == 0 {
        let first = activity.start + first_request;
        if now >= first {
            return Verdict::Close(Expired::NoRequest);
        }
        first.min(idle_deadline)
    } else {
        idle_deadline
    };
    if now < deadline {
        return Verdict::LookAgainAt(deadline);
    }
    if activity.in_flight.load(Ordering::Relaxed) == 0 {
        return Verdict::Close(Expired::Idle);
    }
    if activity.write_blocked.load(Ordering::Relaxed) {
        return Verdict::Close(Expired::Stalled);
    }
    Verdict::LookAgainAt(now + idle)
}

/// Resolves when the connection must be closed (see [`verdict`]).
pub async fn watch(activity: Arc<Activity>, first_request: Duration, idle: Duration) -> Expired {
    loop {
        match verdict(&activity, Instant::now(), first_request, idle) {
            Verdict::Close(why) => return why,
            Verdict::LookAgainAt(at) => tokio::time::sleep_until(at).await,
        }
    }
}

/// An I/O stream that records activity for the watchdog.
#[derive(Debug)]
pub struct ActivityIo<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I> ActivityIo<I> {
    pub fn new(inner: I, activity: Arc<Activity>) -> Self {
        ActivityIo { inner, activity }
    }
}

impl<I: Read + Unpin> Read for ActivityIo<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        // Whether bytes arrived is not visible through the cursor; any completed read
        // (data or EOF) counts as activity, a pending one does not.
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if result.is_ready() {
            this.activity.touch();
        }
        result
    }
}

impl<I: Write + Unpin> Write for ActivityIo<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.note_write(&result);
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.note_write(&result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<I> ActivityIo<I> {
    fn note_write(&self, result: &Poll<std::io::Result<usize>>) {
        match result {
            Poll::Pending => self.activity.write_blocked.store(true, Ordering::Relaxed),
            Poll::Ready(_) => {
                self.activity.write_blocked.store(false, Ordering::Relaxed);
                self.activity.touch();
            }
        }
    }
}

/// A tower service wrapper that counts requests and responses in flight on one
/// connection, and tags each request with the client's address.
#[derive(Debug, Clone)]
pub struct InFlight<S> {
    inner: S,
    activity: Arc<Activity>,
    client: ClientAddr,
}

impl<S> InFlight<S> {
    pub fn new(inner: S, activity: Arc<Activity>, client: IpAddr) -> Self {
        InFlight {
            inner,
            activity,
            client: ClientAddr(client),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for InFlight<S>
where
    S: tower::Service<Request<B>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        req.extensions_mut().insert(self.client);
        self.activity.requests.fetch_add(1, Ordering::Relaxed);
        let guard = InFlightGuard::new(Arc::clone(&self.activity));
        let future = self.inner.call(req);
        Box::pin(async move {
            let response = future.await?;
            // The request stays in flight until its body has been sent (or dropped).
            Ok(response.map(|body| {
                Body::new(GuardedBody {
                    body,
                    _guard: guard,
                })
            }))
        })
    }
}

struct InFlightGuard(Arc<Activity>);

impl InFlightGuard {
    fn new(activity: Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlightGuard(activity)
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

struct GuardedBody {
    body: Body,
    _guard: InFlightGuard,
}

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Open connections per client address, bounded.
#[derive(Debug)]
pub struct ClientSlots {
    per_client: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One open connection of a client; frees its slot when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    slots: Arc<ClientSlots>,
    ip: IpAddr,
}

impl ClientSlots {
    pub fn new(per_client: usize) -> Arc<ClientSlots> {
        Arc::new(ClientSlots {
            per_client: per_client.max(1),
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for one more connection from `ip`, or `None` if it has its share open.
    pub fn acquire(self: &Arc<Self>, ip: IpAddr) -> Option<ClientSlot> {
        let mut open = self.open.lock();
        let count = open.entry(ip).or_insert(0);
        if *count >= self.per_client {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            slots: Arc::clone(self),
            ip,
        })
    }

    /// Connections open from `ip`.
    pub fn open(&self, ip: IpAddr) -> usize {
        self.open.lock().get(&ip).copied().unwrap_or(0)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock();
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn client_slots_cap_each_address_and_free_on_drop() {
        let slots = ClientSlots::new(2);
        let a = IpAddr::from([10, 0, 0, 1]);
        let b = IpAddr::from([10, 0, 0, 2]);
        let first = slots.acquire(a).unwrap();
        let _second = slots.acquire(a).unwrap();
        assert!(slots.acquire(a).is_none());
        assert!(slots.acquire(b).is_some());
        drop(first);
        assert_eq!(slots.open(a), 1);
        assert!(slots.acquire(a).is_some());
    }

    const FIRST: Duration = Duration::from_secs(5);
    const IDLE: Duration = Duration::from_secs(10);

    #[test]
    fn a_silent_connection_closes_at_the_first_request_deadline() {
        let a = Activity::new();
        let t0 = a.start;
        assert_eq!(
            verdict(&a, t0, FIRST, IDLE),
            Verdict::LookAgainAt(t0 + FIRST)
        );
        assert_eq!(
            verdict(&a, t0 + FIRST, FIRST, IDLE),
            Verdict::Close(Expired::NoRequest)
        );
    }

    #[test]
    fn a_busy_request_is_left_alone_and_the_connection_closes_once_idle() {
        let a = Activity::new();
        let t0 = a.start;
        a.requests.fetch_add(1, Ordering::Relaxed);
        let guard = InFlightGuard::new(Arc::clone(&a));
        // Long past the idle timeout with the request still computing: look again later.
        let later = t0 + IDLE * 3;
        assert_eq!(
            verdict(&a, later, FIRST, IDLE),
            Verdict::LookAgainAt(later + IDLE)
        );
        drop(guard); // the response was sent: that is activity
        let last = a.last_io();
        assert_eq!(
            verdict(&a, last, FIRST, IDLE),
            Verdict::LookAgainAt(last + IDLE)
        );
        assert_eq!(
            verdict(&a, last + IDLE, FIRST, IDLE),
            Verdict::Close(Expired::Idle)
        );
    }

    #[test]
    fn a_response_nobody_reads_is_closed() {
        let a = Activity::new();
        a.requests.fetch_add(1, Ordering::Relaxed);
        let _guard = InFlightGuard::new(Arc::clone(&a));
        a.write_blocked.store(true, Ordering::Relaxed);
        assert_eq!(
            verdict(&a, a.start + IDLE, FIRST, IDLE),
            Verdict::Close(Expired::Stalled)
        );
    }
}
