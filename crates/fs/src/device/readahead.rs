//! Readahead along a layer's compressed stream: which spans a read fetches beyond the
//! ones it needs, so that a start does not wait for one round trip per miss.
//!
//! A tar is written in directory order, so what follows a miss in the stream is what a
//! starting program reads next (the other modules of a package, the next libraries of a
//! directory). Like the kernel's page-cache readahead, the window starts small after a
//! miss far from the last one and doubles while the reads keep landing in or near it,
//! up to [`FetchConfig::readahead_bytes`](crate::FetchConfig::readahead_bytes):
//!
//! * a **miss** fetches its own spans and the window after them in one request (one
//!   round trip, however many spans);
//! * a **hit** on the window's first span (the reader has caught up with the window)
//!   fetches the next window in the background, so a reader moving along the stream
//!   finds its spans local or already in flight.
//!
//! Windows only cover spans still missing: a window stops at the first span that is
//! local or being fetched. This module only plans (pure, no I/O, no clock); the device
//! ([`crate::device`]) fetches what it plans with its usual verification and accounting.

use std::ops::Range;

/// The readahead state of one layer.
#[derive(Debug, Default)]
pub(crate) struct Readahead {
    /// The spans of the latest window (with the read that started it, for a miss).
    window: Range<usize>,
    /// Compressed bytes the next window may take.
    next_bytes: u64,
    /// A read reaching this span starts the next window in the background.
    trigger: Option<usize>,
}

/// What a read fetches besides its own spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The read's own request is extended to end at this span (exclusive; at least the
    /// read's own end).
    pub sync_end: usize,
    /// Spans to fetch in the background, after the read is served.
    pub background: Option<Range<usize>>,
}

/// The layer as readahead sees it: span count and sizes, and which spans are missing
/// (neither local nor being fetched).
pub(crate) trait SpanMap {
    fn spans(&self) -> usize;
    fn span_bytes(&self, k: usize) -> u64;
    fn is_missing(&self, k: usize) -> bool;
}

impl Readahead {
    /// Plans the readahead of a read of spans `demand`; `missed` tells whether any of
    /// them had to be fetched (else they were all local or in flight). `max_bytes` is the
    /// largest window (0: no readahead).
    pub(crate) fn plan(
        &mut self,
        demand: Range<usize>,
        missed: bool,
        max_bytes: u64,
        map: &dyn SpanMap,
    ) -> Plan {
        let none = Plan {
            sync_end: demand.end,
            background: None,
        };
        if max_bytes == 0 || demand.is_empty() {
            return none;
        }
        let first_bytes = (max_bytes / crate::device::READAHEAD_START_DIVISOR).max(1);
        if missed {
            // Near the last window (within its own length on either side): the reads are
            // moving along the stream, so grow; anywhere else: start small again.
            let len = self.window.len();
            let near = len > 0
                && demand.start + len >= self.window.start
                && demand.start <= self.window.end + len;
            let bytes = if near {
                self.next_bytes.max(first_bytes)
            } else {
                first_bytes
            };
            let ext = missing_run(map, demand.end, bytes);
            self.window = demand.start..ext.end.max(demand.end);
            self.trigger = (!ext.is_empty()).then_some(ext.start);
            self.next_bytes = bytes.saturating_mul(2).min(max_bytes);
            return Plan {
                sync_end: ext.end.max(demand.end),
                background: None,
            };
        }
        let Some(trigger) = self.trigger else {
            return none;
        };
        if !(demand.start <= trigger && trigger < demand.end) {
            return none;
        }
        // The reader reached the window: fetch the next one while it reads this one.
        let bytes = self.next_bytes.max(first_bytes);
        let ext = missing_run(map, self.window.end, bytes);
        if ext.is_empty() {
            self.trigger = None;
            return none;
        }
        self.window = ext.clone();
        self.trigger = Some(ext.start);
        self.next_bytes = bytes.saturating_mul(2).min(max_bytes);
        Plan {
            sync_end: demand.end,
            background: Some(ext),
        }
    }
}

/// The missing spans from `start` on, up to `bytes` compressed bytes (at least one span
/// when `start` is missing), ending before the first span that is not missing.
fn missing_run(map: &dyn SpanMap, start: usize, bytes: u64) -> Range<usize> {
    let mut end = start;
    let mut taken = 0u64;
    while end < map.spans() && map.is_missing(end) {
        let b = map.span_bytes(end);
        if end > start && taken.saturating_add(b) > bytes {
            break;
        }
        taken = taken.saturating_add(b);
        end += 1;
        if taken >= bytes {
            break;
        }
    }
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashSet;

    /// `n` spans of 100 bytes; `local` are not missing.
    struct Map {
        n: usize,
        local: RefCell<HashSet<usize>>,
    }

    impl Map {
        fn new(n: usize) -> Map {
            Map {
                n,
                local: RefCell::new(HashSet::new()),
            }
        }
        fn fetch(&self, r: Range<usize>) {
            self.local.borrow_mut().extend(r);
        }
    }

    impl SpanMap for Map {
        fn spans(&self) -> usize {
            self.n
        }
        fn span_bytes(&self, _k: usize) -> u64 {
            100
        }
        fn is_missing(&self, k: usize) -> bool {
            !self.local.borrow().contains(&k)
        }
    }

    /// Reads spans `k` one by one like a sequential reader, fetching what the plans say;
    /// returns the (sync, background) requests made.
    fn walk(
        map: &Map,
        ra: &mut Readahead,
        ks: Range<usize>,
        max: u64,
    ) -> Vec<(bool, Range<usize>)> {
        let mut requests = Vec::new();
        for k in ks {
            let missed = map.is_missing(k);
            let plan = ra.plan(k..k + 1, missed, max, map);
            if missed {
                requests.push((true, k..plan.sync_end));
                map.fetch(k..plan.sync_end);
            }
            if let Some(bg) = plan.background {
                requests.push((false, bg.clone()));
                map.fetch(bg);
            }
        }
        requests
    }

    #[test]
    fn a_sequential_reader_waits_once_and_the_windows_double_up_to_the_bound() {
        let map = Map::new(200);
        let mut ra = Readahead::default();
        // 1600 bytes max: first window 200 bytes (2 spans), then 400, 800, 1600, 1600…
        let requests = walk(&map, &mut ra, 0..60, 1600);
        assert_eq!(
            requests[0],
            (true, 0..3),
            "the miss and a first window of two spans"
        );
        let background: Vec<_> = requests[1..].iter().collect();
        assert!(
            background.iter().all(|(sync, _)| !sync),
            "one wait only: {requests:?}"
        );
        let lens: Vec<usize> = background.iter().map(|(_, r)| r.len()).collect();
        assert_eq!(&lens[..4], &[4, 8, 16, 16], "{requests:?}");
        // Every span the reader wanted was fetched exactly once, in stream order.
        let mut next = 0;
        for (_, r) in &requests {
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert!(next >= 60);
    }

    #[test]
    fn a_far_miss_starts_small_again_and_a_near_one_keeps_growing() {
        let map = Map::new(1000);
        let mut ra = Readahead::default();
        let p = ra.plan(0..1, true, 1600, &map);
        assert_eq!(p.sync_end, 3);
        map.fetch(0..3);
        // A miss just past the window: moving along, so the window grows.
        let p = ra.plan(4..5, true, 1600, &map);
        assert_eq!(p.sync_end, 9, "4 spans after the read");
        map.fetch(4..9);
        // A miss far away: back to the first size.
        let p = ra.plan(500..501, true, 1600, &map);
        assert_eq!(p.sync_end, 503);
        assert_eq!(p.background, None);
    }

    #[test]
    fn windows_stop_at_local_spans_and_at_the_layer_end() {
        let map = Map::new(10);
        map.fetch(2..3);
        let mut ra = Readahead::default();
        let p = ra.plan(0..1, true, 1600, &map);
        assert_eq!(p.sync_end, 2, "span 2 is local: the window stops before it");
        map.fetch(0..2);
        let p = ra.plan(8..9, true, 100_000, &map);
        assert_eq!(p.sync_end, 10, "the layer ends");
    }

    #[test]
    fn hits_outside_a_window_and_readahead_off_plan_nothing() {
        let map = Map::new(100);
        map.fetch(0..100);
        let mut ra = Readahead::default();
        let p = ra.plan(10..12, false, 1600, &map);
        assert_eq!(
            p,
            Plan {
                sync_end: 12,
                background: None
            }
        );
        let map = Map::new(100);
        let p = ra.plan(10..12, true, 0, &map);
        assert_eq!(p.sync_end, 12);
        assert_eq!(p.background, None);
    }

    #[test]
    fn a_window_that_is_already_local_ends_the_background_chain() {
        let map = Map::new(100);
        let mut ra = Readahead::default();
        let p = ra.plan(0..1, true, 1600, &map);
        map.fetch(0..p.sync_end);
        map.fetch(p.sync_end..100); // prefetch got there first
        let p = ra.plan(1..2, false, 1600, &map);
        assert_eq!(p.background, None);
        let p = ra.plan(2..3, false, 1600, &map);
        assert_eq!(p.background, None, "no trigger left");
    }
}
