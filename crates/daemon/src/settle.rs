//! When an image's pull has mounted the lazy layers it is going to mount.
//!
//! containerd prepares an image's layers one after another, and each lazy mount reads
//! its layer's file table as it mounts. A trace prefetch started at the first mount
//! competes with the later mounts for the two scarce things of a cold node, CPU and the
//! registry, and the pull (which the container waits for) gets slower by more than the
//! prefetch gains (measured: a pandas start's `ferry pull` 0.29 s warm, 0.55-0.86 s with
//! the prefetch of the first layers under way). So an image's prefetch waits, bounded,
//! until the image's lazy layers are mounted: the container's setup that follows the
//! pull is where prefetch runs for free.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The layers of one image still to be mounted by its pull.
#[derive(Debug, Default)]
pub struct PullSettle {
    /// `None` until the first mount says which layers to expect.
    pending: Mutex<Option<HashSet<String>>>,
    settled: Condvar,
}

impl PullSettle {
    /// The pull will mount `layers` (the first call decides; later ones are ignored, as
    /// every mount of one image names the same layers).
    pub fn expect(&self, layers: impl IntoIterator<Item = String>) {
        let mut pending = self.pending.lock();
        if pending.is_none() {
            *pending = Some(layers.into_iter().collect());
            self.wake_if_settled(&pending);
        }
    }

    /// `layer` is mounted now.
    pub fn mounted(&self, layer: &str) {
        let mut pending = self.pending.lock();
        if let Some(set) = pending.as_mut() {
            set.remove(layer);
        }
        self.wake_if_settled(&pending);
    }

    /// True once every expected layer is mounted (false while nothing is expected yet).
    pub fn is_settled(&self) -> bool {
        self.pending.lock().as_ref().is_some_and(HashSet::is_empty)
    }

    /// Waits until [`Self::is_settled`], at most `timeout`; says whether it is.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut pending = self.pending.lock();
        loop {
            if pending.as_ref().is_some_and(HashSet::is_empty) {
                return true;
            }
            if self.settled.wait_until(&mut pending, deadline).timed_out() {
                return pending.as_ref().is_some_and(HashSet::is_empty);
            }
        }
    }

    fn wake_if_settled(&self, pending: &Option<HashSet<String>>) {
        if pending.as_ref().is_some_and(HashSet::is_empty) {
            self.settled.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn layers(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn settles_once_every_expected_layer_is_mounted() {
        let settle = PullSettle::default();
        assert!(!settle.is_settled(), "nothing expected yet is not settled");
        settle.expect(layers(&["a", "b", "c"]));
        settle.mounted("a");
        settle.mounted("c");
        assert!(!settle.is_settled());
        assert!(!settle.wait(Duration::ZERO));
        settle.mounted("b");
        assert!(settle.is_settled());
        assert!(settle.wait(Duration::ZERO));
    }

    #[test]
    fn the_first_expectation_decides() {
        let settle = PullSettle::default();
        settle.expect(layers(&["a"]));
        // A later mount's expectation (same image) does not reopen the pull.
        settle.expect(layers(&["a", "b"]));
        settle.mounted("a");
        assert!(settle.is_settled());
        settle.expect(layers(&["c"]));
        assert!(settle.is_settled());
    }

    #[test]
    fn nothing_to_mount_is_settled_at_once() {
        let settle = PullSettle::default();
        settle.expect(Vec::new());
        assert!(settle.wait(Duration::ZERO));
    }

    #[test]
    fn a_waiter_wakes_when_the_last_layer_mounts() {
        let settle = Arc::new(PullSettle::default());
        settle.expect(layers(&["a", "b"]));
        let waiter = {
            let settle = settle.clone();
            std::thread::spawn(move || settle.wait(Duration::from_secs(600)))
        };
        settle.mounted("a");
        settle.mounted("b");
        assert!(waiter.join().unwrap(), "woken settled, not by the timeout");
    }
}
