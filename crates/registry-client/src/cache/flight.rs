//! Single-flight: concurrent requests for the same key share one upstream call.
//!
//! The call runs in its own task, so a caller that gives up (client disconnect, timeout)
//! cancels nothing for the others; the key is released when the call finishes, after it
//! has had the chance to fill the cache, so the next caller finds a hit instead of starting
//! a second call.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

/// Coalesces concurrent calls by key; `V` is the shared outcome (cloned to every waiter).
#[derive(Debug)]
pub struct SingleFlight<K, V> {
    inflight: Arc<Mutex<HashMap<K, watch::Receiver<Option<V>>>>>,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        SingleFlight {
            inflight: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// Removes the key when the task ends, also if it panics or is aborted at shutdown.
struct ReleaseKey<K: Eq + Hash, V> {
    inflight: Arc<Mutex<HashMap<K, watch::Receiver<Option<V>>>>>,
    key: Option<K>,
}

impl<K: Eq + Hash, V> Drop for ReleaseKey<K, V> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.inflight.lock().remove(&key);
        }
    }
}

/// Why a shared call produced no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the shared upstream call ended without a result (task panicked or was cancelled)")]
pub struct FlightAborted;

impl<K, V> SingleFlight<K, V>
where
    K: Eq + Hash + Clone + Send + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// A new, empty group.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `make()` unless a call for `key` is already running, and returns that call's
    /// outcome. `make` is only invoked by the first caller.
    pub async fn run<F, Fut>(&self, key: K, make: F) -> Result<V, FlightAborted>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
    {
        let mut receiver = {
            let mut inflight = self.inflight.lock();
            match inflight.get(&key) {
                Some(receiver) => receiver.clone(),
                None => {
                    let (sender, receiver) = watch::channel(None);
                    inflight.insert(key.clone(), receiver.clone());
                    let release = ReleaseKey {
                        inflight: Arc::clone(&self.inflight),
                        key: Some(key),
                    };
                    let call = make();
                    tokio::spawn(async move {
                        let value = call.await;
                        // Release first: anyone arriving after this finds the cache filled
                        // by `call`; anyone who already holds the receiver gets the value.
                        drop(release);
                        sender.send_replace(Some(value));
                    });
                    receiver
                }
            }
        };
        let outcome = receiver
            .wait_for(Option::is_some)
            .await
            .map_err(|_| FlightAborted)?;
        outcome.clone().ok_or(FlightAborted)
    }

    /// Number of calls running now.
    pub fn running(&self) -> usize {
        self.inflight.lock().len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn concurrent_callers_share_one_call() {
        let flight: Arc<SingleFlight<&'static str, u32>> = Arc::new(SingleFlight::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let (release_tx, release_rx) = watch::channel(false);
        let mut waiters = Vec::new();
        for _ in 0..50 {
            let flight = Arc::clone(&flight);
            let calls = Arc::clone(&calls);
            let mut release_rx = release_rx.clone();
            waiters.push(tokio::spawn(async move {
                flight
                    .run("k", || async move {
                        calls.fetch_add(1, Ordering::SeqCst);
                        release_rx.wait_for(|go| *go).await.unwrap();
                        7
                    })
                    .await
            }));
        }
        // Every waiter is parked on the same call before it is allowed to finish.
        while flight.running() == 0 {
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        release_tx.send_replace(true);
        for waiter in waiters {
            assert_eq!(waiter.await.unwrap(), Ok(7));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(flight.running(), 0);
        // A later call runs again.
        assert_eq!(flight.run("k", || async { 8 }).await, Ok(8));
    }

    #[tokio::test]
    async fn a_caller_giving_up_does_not_cancel_the_call() {
        let flight: Arc<SingleFlight<u8, u8>> = Arc::new(SingleFlight::new());
        let (release_tx, release_rx) = watch::channel(false);
        let first = {
            let flight = Arc::clone(&flight);
            let mut release_rx = release_rx.clone();
            tokio::spawn(async move {
                flight
                    .run(1, || async move {
                        release_rx.wait_for(|go| *go).await.unwrap();
                        42
                    })
                    .await
            })
        };
        while flight.running() == 0 {
            tokio::task::yield_now().await;
        }
        let second = {
            let flight = Arc::clone(&flight);
            tokio::spawn(async move { flight.run(1, || async { 0 }).await })
        };
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        release_tx.send_replace(true);
        assert_eq!(second.await.unwrap(), Ok(42));
    }

    #[tokio::test]
    async fn a_panicking_call_reports_aborted_and_frees_the_key() {
        let flight: SingleFlight<u8, u8> = SingleFlight::new();
        let outcome = flight
            .run(1, || async {
                panic!("boom");
                #[allow(unreachable_code)]
                0
            })
            .await;
        assert_eq!(outcome, Err(FlightAborted));
        assert_eq!(flight.running(), 0);
        assert_eq!(flight.run(1, || async { 3 }).await, Ok(3));
    }
}
