//! When an image's pull has brought in the layers it is going to bring in.
//!
//! containerd prepares an image's layers one after another; each lazy mount reads its
//! layer's file table as it mounts, and a layer without an index is downloaded and
//! unpacked. A trace prefetch started at the first mount competes with all of that for
//! the two scarce things of a cold node, CPU and the registry, and the pull (which the
//! container waits for) got slower by more than the prefetch gained (measured: a pandas
//! start's `ferry pull` 0.29 s warm, 0.55-0.86 s with the prefetch of the first layers
//! under way; with the lazy layers awaited, the small unindexed top layer's download
//! still took 64 ms instead of ~1 ms under the prefetch's burst). So an image's prefetch
//! waits, bounded, until the pull's layers are in: the container's setup that follows the
//! pull is where prefetch runs for free. Lazy layers count as in when mounted, the others
//! when their unpacked snapshot is committed; the others are awaited for a shorter
//! bound, since a layer some earlier image already unpacked is never announced.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

#[derive(Debug, Default)]
struct Pending {
    /// `false` until the first mount says which layers to expect.
    known: bool,
    /// Lazy layers not mounted yet.
    lazy: HashSet<String>,
    /// Layers unpacked the ordinary way, not committed yet.
    unpacked: HashSet<String>,
}

impl Pending {
    /// Every expected layer is in (never before the expectation is known).
    fn all_in(&self) -> bool {
        self.known && self.lazy.is_empty() && self.unpacked.is_empty()
    }
}

/// The layers of one image still to come in through its pull.
#[derive(Debug, Default)]
pub struct PullSettle {
    pending: Mutex<Pending>,
    changed: Condvar,
}

impl PullSettle {
    /// The pull will mount `lazy` and unpack `unpacked` (the first call decides; later
    /// ones are ignored, as every mount of one image names the same layers).
    pub fn expect(
        &self,
        lazy: impl IntoIterator<Item = String>,
        unpacked: impl IntoIterator<Item = String>,
    ) {
        let mut pending = self.pending.lock();
        if !pending.known {
            pending.known = true;
            pending.lazy = lazy.into_iter().collect();
            pending.unpacked = unpacked.into_iter().collect();
            self.changed.notify_all();
        }
    }

    /// `layer` is in: mounted lazily, or unpacked and committed.
    pub fn arrived(&self, layer: &str) {
        let mut pending = self.pending.lock();
        if pending.lazy.remove(layer) | pending.unpacked.remove(layer) {
            self.changed.notify_all();
        }
    }

    /// True once every expected layer is in (false while nothing is expected yet).
    pub fn is_settled(&self) -> bool {
        self.pending.lock().all_in()
    }

    /// Waits until the lazy layers are mounted (at most `lazy_bound`), then until the
    /// unpacked ones are committed (at most `rest_bound` more); says whether all are in.
    pub fn wait(&self, lazy_bound: Duration, rest_bound: Duration) -> bool {
        let mut pending = self.pending.lock();
        let deadline = Instant::now() + lazy_bound;
        while !(pending.known && pending.lazy.is_empty()) {
            if self.changed.wait_until(&mut pending, deadline).timed_out() {
                break;
            }
        }
        let deadline = Instant::now() + rest_bound;
        while !pending.all_in() {
            if self.changed.wait_until(&mut pending, deadline).timed_out() {
                return pending.all_in();
            }
        }
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn layers(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn settles_once_every_expected_layer_is_in() {
        let settle = PullSettle::default();
        assert!(!settle.is_settled(), "nothing expected yet is not settled");
        settle.expect(layers(&["a", "b"]), layers(&["top"]));
        settle.arrived("a");
        settle.arrived("b");
        assert!(
            !settle.is_settled(),
            "the unpacked top layer is still to come"
        );
        assert!(!settle.wait(Duration::ZERO, Duration::ZERO));
        settle.arrived("top");
        assert!(settle.is_settled());
        assert!(settle.wait(Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn the_first_expectation_decides() {
        let settle = PullSettle::default();
        settle.expect(layers(&["a"]), Vec::new());
        // A later mount's expectation (same image) does not reopen the pull.
        settle.expect(layers(&["a", "b"]), layers(&["c"]));
        settle.arrived("a");
        assert!(settle.is_settled());
        settle.expect(layers(&["d"]), Vec::new());
        assert!(settle.is_settled());
    }

    #[test]
    fn nothing_to_bring_in_is_settled_at_once() {
        let settle = PullSettle::default();
        settle.expect(Vec::new(), Vec::new());
        assert!(settle.wait(Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn a_waiter_wakes_when_the_last_layer_arrives() {
        let settle = Arc::new(PullSettle::default());
        settle.expect(layers(&["a"]), layers(&["b"]));
        let waiter = {
            let settle = settle.clone();
            std::thread::spawn(move || {
                settle.wait(Duration::from_secs(600), Duration::from_secs(600))
            })
        };
        settle.arrived("a");
        settle.arrived("b");
        assert!(waiter.join().unwrap(), "woken settled, not by a bound");
    }

    #[test]
    fn a_layer_never_announced_only_costs_the_shorter_bound() {
        let settle = Arc::new(PullSettle::default());
        settle.expect(layers(&["a"]), layers(&["shared-with-an-earlier-image"]));
        settle.arrived("a");
        // The unpacked layer never arrives: the wait ends at the rest's bound (zero
        // here), not at the lazy layers' (ten minutes).
        assert!(!settle.wait(Duration::from_secs(600), Duration::ZERO));
    }
}
