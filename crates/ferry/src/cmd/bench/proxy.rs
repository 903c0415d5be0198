//! `ferry bench proxy`: a loopback TCP relay that puts a fixed one-way delay on every
//! byte, in both directions, so `bench/cold-start.sh` can place a registry "20 ms
//! away" on a kernel without netem.
//!
//! Like netem's delay it adds latency without cutting bandwidth: each direction reads
//! chunks as they come, stamps each with its due time (arrival + delay) and queues it;
//! a writer sends every chunk at its due time, so a stream keeps flowing while earlier
//! chunks wait. The queue is bounded (chunks and their size), so a slow reader on one
//! side pushes back on the other instead of growing memory. Bytes delivered each way are
//! counted and written to a stats file and printed on exit.
//!
//! A benchmark tool, not a network component: it only listens on and connects to
//! loopback addresses and knows nothing of HTTP.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

/// Largest chunk read (and queued) at once.
const CHUNK_BYTES: usize = 64 * 1024;
/// Bytes queued per direction: 16 MiB keeps loopback bandwidth at tens of milliseconds
/// of delay, however small the reads.
const QUEUE_BYTES: usize = 16 << 20;
/// Chunks queued per direction (a second bound, for floods of tiny reads).
const QUEUE_CHUNKS: usize = 4096;
/// How often the stats file is rewritten (when a counter moved).
const STATS_EVERY: Duration = Duration::from_millis(20);

/// Arguments of `ferry bench proxy`.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    /// Where to listen, `127.0.0.1:PORT` (loopback only).
    #[arg(long)]
    pub listen: SocketAddr,
    /// Where to relay to, `127.0.0.1:PORT` (loopback only).
    #[arg(long)]
    pub upstream: SocketAddr,
    /// One-way delay added to every chunk in each direction (`10ms`, `0`).
    #[arg(long, default_value = "0", value_parser = ferry_oci::units::parse_duration)]
    pub delay: Duration,
    /// Rewrite this file with `{"up":N,"down":N,"connections":N}` while bytes move
    /// (every 20 ms at most) and on exit.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// Give up connecting to the upstream after this long.
    #[arg(long, default_value = "10s", value_parser = ferry_oci::units::parse_duration)]
    pub connect_timeout: Duration,
    /// Close a connection when one direction has carried nothing for this long.
    #[arg(long, default_value = "10m", value_parser = ferry_oci::units::parse_duration)]
    pub idle_timeout: Duration,
}

/// The time a chunk arrives, as the relay sees it (a test steps it by hand).
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
}

/// The runtime's clock.
#[derive(Debug)]
pub struct RuntimeClock;

impl Clock for RuntimeClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Bytes delivered each way and connections accepted.
#[derive(Debug, Default)]
pub struct Counters {
    /// Client to upstream (requests).
    pub up: AtomicU64,
    /// Upstream to client (responses: what crosses "the wire" to the node).
    pub down: AtomicU64,
    pub connections: AtomicU64,
}

impl Counters {
    fn json(&self) -> String {
        format!(
            "{{\"up\":{},\"down\":{},\"connections\":{}}}",
            self.up.load(Ordering::Relaxed),
            self.down.load(Ordering::Relaxed),
            self.connections.load(Ordering::Relaxed)
        )
    }
}

/// A chunk of one direction's stream and when it may be sent on. Empty data is the
/// end of the stream (the writer then shuts its side down, delayed like the data).
#[derive(Debug, PartialEq, Eq)]
pub struct Chunk {
    pub due: Instant,
    pub data: Vec<u8>,
}

/// Reads `from` until its end, queueing each chunk with its due time (arrival on
/// `clock` + `delay`); the end of the stream is queued as an empty chunk. Each chunk takes
/// its size from `budget` (the writer gives it back once sent), so the queue never holds
/// more than the budget. Returns when the stream ended or the writer went away; an idle
/// read longer than `idle` is an error.
pub async fn read_side<R: AsyncRead + Unpin>(
    mut from: R,
    queue: mpsc::Sender<Chunk>,
    budget: &Semaphore,
    clock: &dyn Clock,
    delay: Duration,
    idle: Duration,
) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        let n = tokio::time::timeout(idle, from.read(&mut buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle connection"))??;
        let chunk = Chunk {
            due: clock.now() + delay,
            data: buf[..n].to_vec(),
        };
        if n > 0 {
            // n <= CHUNK_BYTES fits u32; an error means the semaphore was closed
            match budget.acquire_many(n as u32).await {
                Ok(permits) => permits.forget(),
                Err(_) => return Ok(()),
            }
        }
        if queue.send(chunk).await.is_err() || n == 0 {
            return Ok(());
        }
    }
}

/// Sends each queued chunk to `to` at its due time, in order, counting what it wrote
/// in `delivered` and giving its size back to `budget`; shuts `to` down at the queued end
/// of the stream.
pub async fn write_side<W: AsyncWrite + Unpin>(
    mut queue: mpsc::Receiver<Chunk>,
    mut to: W,
    budget: &Semaphore,
    delivered: &AtomicU64,
) -> io::Result<()> {
    while let Some(chunk) = queue.recv().await {
        tokio::time::sleep_until(chunk.due).await;
        if chunk.data.is_empty() {
            return to.shutdown().await;
        }
        to.write_all(&chunk.data).await?;
        delivered.fetch_add(chunk.data.len() as u64, Ordering::Relaxed);
        budget.add_permits(chunk.data.len());
    }
    Ok(())
}

/// One direction: `from` to `to`, delayed.
async fn direction<R, W>(
    from: R,
    to: W,
    clock: &dyn Clock,
    delay: Duration,
    idle: Duration,
    delivered: &AtomicU64,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
    let budget = Semaphore::new(QUEUE_BYTES);
    tokio::try_join!(
        read_side(from, tx, &budget, clock, delay, idle),
        write_side(rx, to, &budget, delivered)
    )?;
    Ok(())
}

/// The relay: where to connect and how much to delay.
pub struct Relay {
    pub upstream: SocketAddr,
    pub delay: Duration,
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    pub clock: Arc<dyn Clock>,
    pub counters: Arc<Counters>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("upstream", &self.upstream)
            .field("delay", &self.delay)
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Relays one accepted connection until both directions ended (or one failed,
    /// which drops both).
    pub async fn relay(&self, client: TcpStream) -> io::Result<()> {
        let upstream =
            tokio::time::timeout(self.connect_timeout, TcpStream::connect(self.upstream))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting upstream"))??;
        let _ = client.set_nodelay(true);
        let _ = upstream.set_nodelay(true);
        let (client_r, client_w) = client.into_split();
        let (up_r, up_w) = upstream.into_split();
        let clock = self.clock.as_ref();
        tokio::try_join!(
            direction(
                client_r,
                up_w,
                clock,
                self.delay,
                self.idle_timeout,
                &self.counters.up
            ),
            direction(
                up_r,
                client_w,
                clock,
                self.delay,
                self.idle_timeout,
                &self.counters.down
            ),
        )?;
        Ok(())
    }

    /// Accepts and relays connections until `stop` completes.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, stop: impl Future<Output = ()>) {
        let mut stop = pin!(stop);
        loop {
            let accepted = tokio::select! {
                () = &mut stop => return,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((client, _)) => {
                    self.counters.connections.fetch_add(1, Ordering::Relaxed);
                    let relay = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = relay.relay(client).await {
                            tracing::debug!(error = %e, "connection ended");
                        }
                    });
                }
                // e.g. out of file descriptors: back off instead of spinning
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

fn write_stats(path: &Path, counters: &Counters) -> io::Result<()> {
    // whole-file replace, so a reader never sees half a line
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, counters.json() + "\n")?;
    std::fs::rename(&tmp, path)
}

pub fn run(args: ProxyArgs) -> Result<()> {
    if !args.listen.ip().is_loopback() || !args.upstream.ip().is_loopback() {
        bail!(
            "ferry bench proxy relays between loopback addresses only (got --listen {} --upstream {})",
            args.listen,
            args.upstream
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async {
        let listener = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let counters = Arc::new(Counters::default());
        let relay = Arc::new(Relay {
            upstream: args.upstream,
            delay: args.delay,
            connect_timeout: args.connect_timeout,
            idle_timeout: args.idle_timeout,
            clock: Arc::new(RuntimeClock),
            counters: counters.clone(),
        });
        if let Some(path) = &args.stats {
            write_stats(path, &counters).with_context(|| format!("writing {}", path.display()))?;
            let (path, counters) = (path.clone(), counters.clone());
            tokio::spawn(async move {
                let mut last = String::new();
                loop {
                    tokio::time::sleep(STATS_EVERY).await;
                    let now = counters.json();
                    if now != last {
                        if let Err(e) = write_stats(&path, &counters) {
                            tracing::warn!(error = %e, path = %path.display(), "cannot write stats");
                        }
                        last = now;
                    }
                }
            });
        }
        eprintln!(
            "ferry bench proxy: {} -> {}, {:?} each way",
            args.listen, args.upstream, args.delay
        );
        relay.serve(listener, ferry_daemon::stop_signal()).await;
        if let Some(path) = &args.stats {
            write_stats(path, &counters).with_context(|| format!("writing {}", path.display()))?;
        }
        eprintln!("ferry bench proxy: {}", counters.json());
        Ok(())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::task::{Context as TaskContext, Poll};
    use tokio::io::ReadBuf;

    /// A clock that moves only when told: each `now()` returns the next preset instant.
    struct SteppedClock(Mutex<VecDeque<Instant>>);
    impl Clock for SteppedClock {
        fn now(&self) -> Instant {
            self.0
                .lock()
                .unwrap()
                .pop_front()
                .expect("clock asked too often")
        }
    }

    /// A stream that yields preset chunks, one per read, then ends.
    struct Chunks(VecDeque<Vec<u8>>);
    impl AsyncRead for Chunks {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut TaskContext<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if let Some(c) = self.0.pop_front() {
                buf.put_slice(&c);
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn each_chunk_is_due_its_arrival_plus_the_delay() {
        let base = Instant::now();
        let arrivals = [0u64, 3, 3, 40].map(|ms| base + Duration::from_millis(ms));
        let clock = SteppedClock(Mutex::new(arrivals.into_iter().collect()));
        let input = Chunks([b"ab".to_vec(), b"cde".to_vec(), b"f".to_vec()].into());
        let (tx, mut rx) = mpsc::channel(8);
        let delay = Duration::from_millis(25);
        let budget = Semaphore::new(16);
        read_side(input, tx, &budget, &clock, delay, Duration::from_secs(5))
            .await
            .unwrap();
        let mut got = Vec::new();
        while let Some(c) = rx.recv().await {
            got.push(c);
        }
        let want: Vec<Chunk> = [&b"ab"[..], b"cde", b"f", b""]
            .iter()
            .zip(arrivals)
            .map(|(d, at)| Chunk {
                due: at + delay,
                data: d.to_vec(),
            })
            .collect();
        assert_eq!(
            got, want,
            "one chunk per read, due = arrival + delay, end last"
        );
        assert_eq!(budget.available_permits(), 10, "6 bytes queued, 6 taken");
    }

    #[tokio::test]
    async fn a_full_budget_holds_the_reader_until_the_writer_gives_bytes_back() {
        let budget = Arc::new(Semaphore::new(3));
        let (tx, mut rx) = mpsc::channel(8);
        let reader = {
            let budget = budget.clone();
            tokio::spawn(async move {
                let input = Chunks([b"ab".to_vec(), b"cd".to_vec()].into());
                read_side(
                    input,
                    tx,
                    &budget,
                    &RuntimeClock,
                    Duration::ZERO,
                    Duration::from_secs(5),
                )
                .await
            })
        };
        // on this single-threaded runtime the reader runs until it has to wait
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(rx.recv().await.unwrap().data, b"ab");
        assert!(
            rx.try_recv().is_err(),
            "\"cd\" must wait: 2 of 3 bytes are queued"
        );
        budget.add_permits(2); // the writer sent "ab"
        assert_eq!(rx.recv().await.unwrap().data, b"cd");
        assert_eq!(rx.recv().await.unwrap().data, b"", "then the end");
        reader.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn writer_sends_in_order_counts_and_shuts_down_at_the_end() {
        let (tx, rx) = mpsc::channel(8);
        let past = Instant::now();
        for d in [&b"one "[..], b"two ", b"three", b""] {
            tx.send(Chunk {
                due: past,
                data: d.to_vec(),
            })
            .await
            .unwrap();
        }
        drop(tx);
        let (w, mut r) = tokio::io::duplex(64);
        let delivered = AtomicU64::new(0);
        let budget = Semaphore::new(0);
        write_side(rx, w, &budget, &delivered).await.unwrap();
        let mut out = Vec::new();
        r.read_to_end(&mut out).await.unwrap(); // ends: the writer shut down
        assert_eq!(out, b"one two three");
        assert_eq!(delivered.load(Ordering::Relaxed), 13);
        assert_eq!(
            budget.available_permits(),
            13,
            "what was sent is given back"
        );
    }

    /// Pseudo-random bytes, so a reordered or dropped chunk cannot go unnoticed.
    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[tokio::test]
    async fn bytes_pass_intact_and_in_order_both_ways_over_tcp() {
        const UP: usize = 3 << 20;
        const DOWN: usize = 5 << 20;
        // upstream: reads the whole request, checks it, answers with DOWN bytes
        let up_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = up_listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = up_listener.accept().await.unwrap();
            let mut req = Vec::new();
            s.read_to_end(&mut req).await.unwrap();
            s.write_all(&pattern(DOWN, 2)).await.unwrap();
            s.shutdown().await.unwrap();
            req
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let relay = Arc::new(Relay {
            upstream,
            delay: Duration::from_millis(2),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            clock: Arc::new(RuntimeClock),
            counters: counters.clone(),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(relay.serve(listener, async {
            let _ = stop_rx.await;
        }));

        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(&pattern(UP, 1)).await.unwrap();
        c.shutdown().await.unwrap(); // the half-close passes through
        let mut resp = Vec::new();
        c.read_to_end(&mut resp).await.unwrap();
        let req = server.await.unwrap();
        assert!(req == pattern(UP, 1), "request bytes changed in transit");
        assert!(
            resp == pattern(DOWN, 2),
            "response bytes changed in transit"
        );
        assert_eq!(counters.up.load(Ordering::Relaxed), UP as u64);
        assert_eq!(counters.down.load(Ordering::Relaxed), DOWN as u64);
        assert_eq!(counters.connections.load(Ordering::Relaxed), 1);
        assert_eq!(
            counters.json(),
            format!("{{\"up\":{UP},\"down\":{DOWN},\"connections\":1}}")
        );
        stop_tx.send(()).unwrap();
        serving.await.unwrap();
    }

    #[test]
    fn refuses_addresses_off_loopback() {
        let args = ProxyArgs {
            listen: "0.0.0.0:5000".parse().unwrap(),
            upstream: "127.0.0.1:5001".parse().unwrap(),
            delay: Duration::ZERO,
            stats: None,
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        };
        let e = run(args).unwrap_err();
        assert!(e.to_string().contains("loopback addresses only"), "{e}");
    }
}
