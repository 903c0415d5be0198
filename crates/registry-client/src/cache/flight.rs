//! Single flight: concurrent requests for the same key share one call. The one
//! implementation in ferry: ferry-fs's device fetches spans with it from blocking FUSE
//! threads, the daemon's index lookups and the registry's pull-through cache share
//! upstream calls with it on tokio.
//!
//! [`Flights::claim`] makes the caller the key's leader (it does the work on its own
//! thread and [`Lead::land`]s the outcome) or a follower of the flight already under
//! way, which waits for that outcome with a deadline ([`Flight::wait`]) or on a runtime
//! ([`Flight::wait_async`]). Claiming costs one lock and one allocation, and nothing
//! is spawned: the device claims on every miss of a cold start. A leader dropped
//! without landing (it panicked) releases the key and its followers get
//! [`FlightAborted`], never a wait until their deadline.
//!
//! [`SingleFlight::run`] is the async convenience: the call runs in its own task, so a
//! caller that gives up (client disconnect, timeout) cancels nothing for the others.
//! Either way the key is released just before the outcome is handed out, after the
//! leader had the chance to fill its cache, so the next caller finds a hit instead of
//! starting a second call.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

/// Why a shared call produced no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the shared call ended without a result (its leader panicked or was cancelled)")]
pub struct FlightAborted;

/// The flights under way, by key; `V` is the shared outcome (cloned to every follower).
#[derive(Debug)]
pub struct Flights<K, V> {
    inflight: Arc<Mutex<HashMap<K, Arc<Flight<V>>>>>,
}

impl<K, V> Default for Flights<K, V> {
    fn default() -> Self {
        Flights {
            inflight: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// What [`Flights::claim`] made of the caller.
#[derive(Debug)]
pub enum Claim<K: Eq + Hash, V> {
    /// No flight for the key was under way: do the work and [`Lead::land`] it.
    Lead(Lead<K, V>),
    /// Another caller leads: wait for its outcome.
    Follow(Arc<Flight<V>>),
}

impl<K: Eq + Hash + Clone, V: Clone> Flights<K, V> {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leads `key`'s flight, or follows the one under way.
    pub fn claim(&self, key: K) -> Claim<K, V> {
        let mut inflight = self.inflight.lock();
        if let Some(flight) = inflight.get(&key) {
            return Claim::Follow(flight.clone());
        }
        let flight = Arc::new(Flight::default());
        inflight.insert(key.clone(), flight.clone());
        Claim::Lead(Lead {
            inflight: self.inflight.clone(),
            key: Some(key),
            flight,
        })
    }

    /// Whether a flight for `key` is under way.
    pub fn contains(&self, key: &K) -> bool {
        self.inflight.lock().contains_key(key)
    }

    /// Flights under way.
    pub fn running(&self) -> usize {
        self.inflight.lock().len()
    }
}

/// The leader's hold on a key: [`Lead::land`] hands the outcome to the followers;
/// dropped without landing, it hands them [`FlightAborted`].
#[derive(Debug)]
pub struct Lead<K: Eq + Hash, V> {
    inflight: Arc<Mutex<HashMap<K, Arc<Flight<V>>>>>,
    /// `None` once landed.
    key: Option<K>,
    flight: Arc<Flight<V>>,
}

impl<K: Eq + Hash, V> Lead<K, V> {
    /// The flight this leads (for the leader to wait on it like a follower).
    pub fn flight(&self) -> &Arc<Flight<V>> {
        &self.flight
    }

    /// Releases the key and hands `outcome` to every follower; once (a second landing
    /// does nothing).
    pub fn land(&mut self, outcome: V) {
        self.finish(Ok(outcome));
    }

    fn finish(&mut self, outcome: Result<V, FlightAborted>) {
        if let Some(key) = self.key.take() {
            self.inflight.lock().remove(&key);
            self.flight.finish(outcome);
        }
    }
}

impl<K: Eq + Hash, V> Drop for Lead<K, V> {
    fn drop(&mut self) {
        self.finish(Err(FlightAborted));
    }
}

/// One flight: its outcome once landed, and its followers' wake-ups.
#[derive(Debug)]
pub struct Flight<V> {
    outcome: Mutex<Option<Result<V, FlightAborted>>>,
    /// Wakes followers blocked in [`Flight::wait`].
    landed: Condvar,
    /// Wakes followers awaiting [`Flight::wait_async`].
    notify: Notify,
}

impl<V> Default for Flight<V> {
    fn default() -> Self {
        Flight {
            outcome: Mutex::new(None),
            landed: Condvar::new(),
            notify: Notify::new(),
        }
    }
}

impl<V> Flight<V> {
    fn finish(&self, outcome: Result<V, FlightAborted>) {
        let mut slot = self.outcome.lock();
        if slot.is_none() {
            *slot = Some(outcome);
        }
        drop(slot);
        self.landed.notify_all();
        self.notify.notify_waiters();
    }
}

impl<V: Clone> Flight<V> {
    /// Blocks until the flight lands, or until `deadline`: `None` when it passed first.
    pub fn wait(&self, deadline: Instant) -> Option<Result<V, FlightAborted>> {
        let mut slot = self.outcome.lock();
        loop {
            if let Some(outcome) = slot.as_ref() {
                return Some(outcome.clone());
            }
            if self.landed.wait_until(&mut slot, deadline).timed_out() {
                return slot.clone();
            }
        }
    }

    /// Waits on the runtime until the flight lands (callers bound it with a timeout of
    /// their own when they must).
    pub async fn wait_async(&self) -> Result<V, FlightAborted> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check, so a landing in between still wakes it.
            notified.as_mut().enable();
            if let Some(outcome) = self.outcome.lock().as_ref() {
                return outcome.clone();
            }
            notified.await;
        }
    }
}

/// Coalesces concurrent async calls by key; `V` is the shared outcome (cloned to every
/// waiter).
#[derive(Debug)]
pub struct SingleFlight<K, V> {
    flights: Flights<K, V>,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        SingleFlight {
            flights: Flights::default(),
        }
    }
}

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
    /// outcome. `make` is only invoked by the first caller; its call runs in a task of
    /// its own, so it finishes (and lands) whoever stops waiting for it.
    pub async fn run<F, Fut>(&self, key: K, make: F) -> Result<V, FlightAborted>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = V> + Send + 'static,
    {
        let flight = match self.flights.claim(key) {
            Claim::Follow(flight) => flight,
            Claim::Lead(lead) => {
                let flight = lead.flight().clone();
                let call = make();
                tokio::spawn(async move {
                    let mut lead = lead;
                    let value = call.await;
                    lead.land(value);
                });
                flight
            }
        };
        flight.wait_async().await
    }

    /// Number of calls running now.
    pub fn running(&self) -> usize {
        self.flights.running()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::watch;

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

    #[test]
    fn blocking_followers_get_the_leaders_outcome() {
        let flights: Arc<Flights<u8, u32>> = Arc::new(Flights::new());
        let Claim::Lead(mut lead) = flights.claim(1) else {
            panic!("the first claim leads");
        };
        assert!(flights.contains(&1));
        let followers: Vec<_> = (0..4)
            .map(|_| {
                let Claim::Follow(flight) = flights.claim(1) else {
                    panic!("a claim under way follows");
                };
                std::thread::spawn(move || flight.wait(Instant::now() + Duration::from_secs(30)))
            })
            .collect();
        lead.land(9);
        for follower in followers {
            assert_eq!(follower.join().unwrap(), Some(Ok(9)));
        }
        assert!(!flights.contains(&1));
        assert!(matches!(flights.claim(1), Claim::Lead(_)));
    }

    #[test]
    fn a_follower_stops_at_its_deadline_and_a_dropped_leader_aborts() {
        let flights: Flights<u8, u32> = Flights::new();
        let Claim::Lead(lead) = flights.claim(1) else {
            panic!("the first claim leads");
        };
        let Claim::Follow(flight) = flights.claim(1) else {
            panic!("a claim under way follows");
        };
        assert_eq!(flight.wait(Instant::now()), None);
        drop(lead);
        assert_eq!(flight.wait(Instant::now()), Some(Err(FlightAborted)));
        assert_eq!(flights.running(), 0);
    }
}
