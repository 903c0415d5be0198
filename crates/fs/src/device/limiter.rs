//! How an image's fetches become backend requests: a bound on the requests in flight,
//! per image and per blob, and fetches that would wait for one joined into the next
//! request to the same blob.
//!
//! A registry pays per request, not per byte (Debian's `docker-registry` spends ~4.5 ms
//! of CPU on a Range request of 16 KiB or of 1 MiB alike), and during a start the fetches
//! of a layer come in bursts: a miss, its readahead, the file's rest, its directory's
//! small files, the modules and libraries followed from it. So a fetch that finds no
//! slot free does not wait to send a request of its own: it queues, and the fetch that
//! takes the next slot for the same blob carries every queued fetch of that blob along,
//! as ranges of one multi-range request (up to [`JOIN_MAX_RANGES`] ranges and the
//! request size it is given). A fetch taken along waits, with its own deadline, for its
//! share of that request's answer. Each blob has at most `per_blob` requests in flight,
//! so that a burst queues and goes out together instead of each fetch paying a request.
//!
//! Only backends that batch ranges (`RangeSource::batches_ranges`) are joined; others
//! take slots one fetch at a time, in arrival order.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Most ranges a joined request asks for: what one `multipart/byteranges` request may
/// carry (`ferry_registry_client::byteranges::MAX_RANGES`).
pub const JOIN_MAX_RANGES: usize = 64;

/// Which blob a fetch is for, as far as joining goes: the address of its backend (two
/// sources of one blob that are different objects are simply never joined).
pub(crate) type BlobKey = usize;

/// A fetch's share of a joined request's answer: its ranges' bytes, in its order.
pub(crate) type Share = io::Result<Vec<Vec<u8>>>;

/// Bounds concurrent backend requests of one image, and joins fetches that queue for
/// the same blob. Slots are released when the fetch thread finishes, so a hung backend
/// keeps its slot and cannot pile up threads.
#[derive(Debug)]
pub struct Limiter {
    slots: usize,
    per_blob: usize,
    state: Mutex<State>,
    cv: Condvar,
    /// Callers blocked waiting for a slot right now (background fill backs off while
    /// anyone waits).
    waiting: AtomicUsize,
}

#[derive(Debug)]
struct State {
    free: usize,
    in_flight: HashMap<BlobKey, usize>,
    /// Fetches waiting, oldest first.
    queue: VecDeque<Queued>,
    next_id: u64,
}

#[derive(Debug)]
struct Queued {
    id: u64,
    blob: Option<BlobKey>,
    ranges: Vec<Range<u64>>,
    bytes: u64,
    /// Where a request that takes this fetch along sends its share (joinable only).
    tx: Option<mpsc::SyncSender<Share>>,
}

/// A queued fetch taken along by a request: its ranges and where its share goes.
#[derive(Debug)]
pub(crate) struct Rider {
    pub ranges: Vec<Range<u64>>,
    pub tx: mpsc::SyncSender<Share>,
}

/// What a fetch got from [`Limiter::turn`].
#[derive(Debug)]
pub(crate) enum Turn {
    /// A slot: send a request for the fetch's ranges and the riders', and give each
    /// rider its share.
    Lead { slot: Slot, riders: Vec<Rider> },
    /// Another fetch's request took this one along: its share arrives here.
    Joined(mpsc::Receiver<Share>),
}

impl Limiter {
    /// A limiter with `slots` slots (at least one), any number of them for one blob.
    pub fn new(slots: usize) -> Arc<Limiter> {
        Limiter::with_per_blob(slots, slots)
    }

    /// A limiter with `slots` slots, at most `per_blob` (at least one) of them for
    /// requests to the same blob.
    pub fn with_per_blob(slots: usize, per_blob: usize) -> Arc<Limiter> {
        let slots = slots.max(1);
        Arc::new(Limiter {
            slots,
            per_blob: per_blob.clamp(1, slots),
            state: Mutex::new(State {
                free: slots,
                in_flight: HashMap::new(),
                queue: VecDeque::new(),
                next_id: 0,
            }),
            cv: Condvar::new(),
            waiting: AtomicUsize::new(0),
        })
    }

    /// Slots in all.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Requests at most in flight to one blob.
    pub fn per_blob(&self) -> usize {
        self.per_blob
    }

    /// Callers waiting for a slot right now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// A turn for a fetch of `ranges` (sorted) of `blob` (`None`: a backend that does
    /// not batch ranges, never joined): a slot, with the queued fetches of the same blob
    /// that fit in one request of at most `max_bytes` (the fetch's own ranges count, and
    /// are never refused), or, when another fetch's request took this one along, where
    /// its share will arrive. A `reader` (a process's read, the critical path) waits only
    /// for a slot, never for the blob's bound or the fetches queued before it. Fails with
    /// `TimedOut` when `deadline` passes first.
    pub(crate) fn turn(
        self: &Arc<Self>,
        blob: Option<BlobKey>,
        reader: bool,
        ranges: &[Range<u64>],
        max_bytes: u64,
        deadline: Instant,
    ) -> io::Result<Turn> {
        let mut st = self.state.lock();
        let bytes = ranges.iter().map(|r| r.end - r.start).sum::<u64>();
        if self.can_lead(&st, blob, reader) && (reader || !st.queue.iter().any(|q| q.blob == blob))
        {
            return Ok(self.lead(&mut st, blob, ranges.len(), bytes, max_bytes));
        }
        let id = st.next_id;
        st.next_id += 1;
        let (tx, rx) = match blob {
            Some(_) => {
                let (tx, rx) = mpsc::sync_channel(1);
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        st.queue.push_back(Queued {
            id,
            blob,
            ranges: ranges.to_vec(),
            bytes,
            tx,
        });
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let turn = loop {
            let Some(pos) = st.queue.iter().position(|q| q.id == id) else {
                // Taken along; only joinable fetches are.
                match rx {
                    Some(rx) => break Ok(Turn::Joined(rx)),
                    None => unreachable!("a fetch that cannot be joined was taken along"),
                }
            };
            // Oldest of its blob first: a later guess of the same blob never overtakes.
            let first = reader || !st.queue.iter().take(pos).any(|q| q.blob == blob);
            if first && self.can_lead(&st, blob, reader) {
                st.queue.remove(pos);
                break Ok(self.lead(&mut st, blob, ranges.len(), bytes, max_bytes));
            }
            let now = Instant::now();
            if now >= deadline {
                st.queue.remove(pos);
                break Err(super::timed_out("waiting for a fetch slot"));
            }
            self.cv.wait_for(&mut st, deadline - now);
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        turn
    }

    fn can_lead(&self, st: &State, blob: Option<BlobKey>, reader: bool) -> bool {
        st.free > 0
            && (reader
                || blob.is_none_or(|b| st.in_flight.get(&b).copied().unwrap_or(0) < self.per_blob))
    }

    /// Takes a slot, and the queued fetches of `blob` that fit beside the leader's
    /// `ranges` ranges and `bytes` bytes, oldest first.
    fn lead(
        self: &Arc<Self>,
        st: &mut State,
        blob: Option<BlobKey>,
        ranges: usize,
        bytes: u64,
        max_bytes: u64,
    ) -> Turn {
        st.free -= 1;
        let mut riders = Vec::new();
        if let Some(b) = blob {
            *st.in_flight.entry(b).or_default() += 1;
            let (mut n, mut total) = (ranges, bytes);
            let mut i = 0;
            while i < st.queue.len() {
                let q = &st.queue[i];
                let fits = n + q.ranges.len() <= JOIN_MAX_RANGES && total + q.bytes <= max_bytes;
                if q.blob == Some(b) && fits {
                    if let Some(Queued {
                        ranges,
                        bytes,
                        tx: Some(tx),
                        ..
                    }) = st.queue.remove(i)
                    {
                        n += ranges.len();
                        total += bytes;
                        riders.push(Rider { ranges, tx });
                    }
                    continue;
                }
                i += 1;
            }
            if !riders.is_empty() {
                // The riders wake to find themselves taken along.
                self.cv.notify_all();
            }
        }
        Turn::Lead {
            slot: Slot {
                limiter: self.clone(),
                blob,
            },
            riders,
        }
    }
}

/// A request's slot, given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    limiter: Arc<Limiter>,
    blob: Option<BlobKey>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.limiter.state.lock();
        st.free += 1;
        if let Some(b) = self.blob
            && let Some(n) = st.in_flight.get_mut(&b)
        {
            *n -= 1;
            if *n == 0 {
                st.in_flight.remove(&b);
            }
        }
        drop(st);
        self.limiter.cv.notify_all();
    }
}

/// `wanted`'s bytes cut out of the answer to `unions` (the request's merged ranges, each
/// of `wanted` inside one of them). A short answer gives short pieces, which the fetch's own length check refuses.
pub(crate) fn share_of(
    unions: &[Range<u64>],
    answer: &[Vec<u8>],
    wanted: &[Range<u64>],
) -> Vec<Vec<u8>> {
    wanted
        .iter()
        .map(|r| {
            let i = unions
                .partition_point(|u| u.start <= r.start)
                .saturating_sub(1);
            let (Some(u), Some(bytes)) = (unions.get(i), answer.get(i)) else {
                return Vec::new();
            };
            let from = (r.start.saturating_sub(u.start) as usize).min(bytes.len());
            let to = (r.end.saturating_sub(u.start) as usize).clamp(from, bytes.len());
            bytes[from..to].to_vec()
        })
        .collect()
}

/// `e` again, for one more recipient (`io::Error` is not `Clone`).
pub(crate) fn copy_error(e: &io::Error) -> io::Error {
    io::Error::new(e.kind(), e.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::single_range_in_vec_init)] // one range: the common fetch
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn shares_are_cut_from_the_unions() {
        let us = vec![0..8, 10..30];
        let answer = vec![(0u8..8).collect::<Vec<_>>(), (10u8..30).collect()];
        let got = share_of(&us, &answer, &[2..4, 10..12, 25..30]);
        assert_eq!(
            got,
            vec![vec![2, 3], vec![10, 11], vec![25, 26, 27, 28, 29]]
        );
        // A short answer gives a short piece, never a panic.
        let short = vec![vec![0u8; 8], vec![0u8; 3]];
        assert_eq!(share_of(&us, &short, &[10..20])[0].len(), 3);
        assert_eq!(share_of(&us, &short, &[15..20])[0].len(), 0);
        assert_eq!(share_of(&[], &[], &[1..2])[0].len(), 0);
    }

    #[test]
    fn a_free_slot_leads_alone() {
        let l = Limiter::new(2);
        match l.turn(Some(1), false, &[0..10], 100, soon()).unwrap() {
            Turn::Lead { riders, .. } => assert!(riders.is_empty()),
            Turn::Joined(_) => panic!("nobody to join"),
        }
    }

    /// A turn that must lead (a slot free for the blob): its slot and riders.
    fn lead(
        l: &Arc<Limiter>,
        blob: Option<BlobKey>,
        reader: bool,
        ranges: &[Range<u64>],
        max_bytes: u64,
    ) -> (Slot, Vec<Rider>) {
        match l.turn(blob, reader, ranges, max_bytes, soon()).unwrap() {
            Turn::Lead { slot, riders } => (slot, riders),
            Turn::Joined(_) => panic!("expected to lead: {ranges:?}"),
        }
    }

    /// A turn for `20..30` of blob 1 that may wait 20 ms: its error.
    fn brief_turn_error(l: &Arc<Limiter>, reader: bool) -> io::Error {
        let deadline = Instant::now() + Duration::from_millis(20);
        l.turn(Some(1), reader, &[20..30], 100, deadline)
            .unwrap_err()
    }

    /// Queues a fetch of `ranges` on another thread; returns once it is waiting.
    fn queued(
        l: &Arc<Limiter>,
        blob: Option<BlobKey>,
        ranges: Vec<Range<u64>>,
    ) -> std::thread::JoinHandle<io::Result<Turn>> {
        let before = l.waiting();
        let l2 = l.clone();
        let h = std::thread::spawn(move || l2.turn(blob, false, &ranges, 100, soon()));
        while l.waiting() == before {
            std::thread::yield_now();
        }
        h
    }

    #[test]
    fn fetches_queued_for_a_blob_ride_with_the_next_request_to_it() {
        let l = Limiter::with_per_blob(4, 1);
        let (slot, _) = lead(&l, Some(7), false, &[0..10], 100);
        // The blob's one request is in flight: these queue, one for another blob too.
        let a = queued(&l, Some(7), vec![20..30]);
        let b = queued(&l, Some(7), vec![40..50, 60..70]);
        // Another blob has slots of its own.
        let other = l.turn(Some(8), false, &[0..10], 100, soon()).unwrap();
        assert!(matches!(other, Turn::Lead { ref riders, .. } if riders.is_empty()));
        assert_eq!(l.waiting(), 2);
        // A third fetch of blob 7 queues too; when the request ends, the oldest leads and
        // takes the others along.
        let c = queued(&l, Some(7), vec![80..90]);
        drop(slot);
        let turns = [a, b, c].map(|h| h.join().unwrap().unwrap());
        let leads: Vec<&Turn> = turns
            .iter()
            .filter(|t| matches!(t, Turn::Lead { .. }))
            .collect();
        assert_eq!(leads.len(), 1, "one request for the three: {turns:?}");
        let Turn::Lead { riders, .. } = &turns[0] else {
            panic!("the oldest leads: {turns:?}")
        };
        let taken: Vec<Vec<Range<u64>>> = riders.iter().map(|r| r.ranges.clone()).collect();
        assert_eq!(taken, vec![vec![40..50, 60..70], vec![80..90]]);
        assert_eq!(l.waiting(), 0);
    }

    #[test]
    fn riders_fit_the_request_size_and_range_count() {
        let l = Limiter::with_per_blob(2, 1);
        let (slot, _) = lead(&l, Some(1), false, &[0..10], 100);
        let big = queued(&l, Some(1), vec![0..60]);
        let too_big = queued(&l, Some(1), vec![100..150]);
        let small = queued(&l, Some(1), vec![200..230]);
        drop(slot);
        let Turn::Lead { riders, slot } = big.join().unwrap().unwrap() else {
            panic!("the oldest leads")
        };
        // 60 + 30 fit in 100 bytes, 60 + 50 do not: the fetch that does not fit waits
        // for the next request.
        assert_eq!(riders.len(), 1);
        assert_eq!(riders[0].ranges, vec![200..230]);
        assert!(matches!(small.join().unwrap().unwrap(), Turn::Joined(_)));
        drop(slot);
        assert!(matches!(
            too_big.join().unwrap().unwrap(),
            Turn::Lead { ref riders, .. } if riders.is_empty()
        ));

        let l = Limiter::with_per_blob(1, 1);
        let (slot, _) = lead(&l, Some(1), false, &[0..1], 1 << 20);
        let many: Vec<Range<u64>> = (0..JOIN_MAX_RANGES as u64)
            .map(|i| i * 10..i * 10 + 1)
            .collect();
        let leader = queued(&l, Some(1), vec![0..1]);
        let over = queued(&l, Some(1), many);
        drop(slot);
        let Turn::Lead { riders, slot } = leader.join().unwrap().unwrap() else {
            panic!("the oldest leads")
        };
        assert!(
            riders.is_empty(),
            "1 + {JOIN_MAX_RANGES} ranges do not fit one request"
        );
        drop(slot);
        assert!(matches!(over.join().unwrap().unwrap(), Turn::Lead { .. }));
    }

    #[test]
    fn a_reader_passes_the_blob_bound_and_takes_the_queued_guesses_along() {
        let l = Limiter::with_per_blob(4, 1);
        let _held = lead(&l, Some(1), false, &[0..10], 100);
        let guess = queued(&l, Some(1), vec![20..30]);
        // A process's read does not wait behind the blob's request in flight.
        let (slot, riders) = lead(&l, Some(1), true, &[50..60], 100);
        assert_eq!(riders.len(), 1);
        assert_eq!(riders[0].ranges, vec![20..30]);
        assert!(matches!(guess.join().unwrap().unwrap(), Turn::Joined(_)));
        drop(slot);
        // Slots still bound a reader.
        let l = Limiter::with_per_blob(1, 1);
        let _only = lead(&l, Some(1), false, &[0..10], 100);
        assert_eq!(brief_turn_error(&l, true).kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn backends_that_do_not_batch_are_never_joined() {
        let l = Limiter::new(1);
        let (slot, _) = lead(&l, None, false, &[0..10], 100);
        let a = queued(&l, None, vec![20..30]);
        let b = queued(&l, None, vec![40..50]);
        drop(slot);
        let Turn::Lead { riders, slot } = a.join().unwrap().unwrap() else {
            panic!("each leads in turn")
        };
        assert!(riders.is_empty());
        drop(slot);
        assert!(matches!(b.join().unwrap().unwrap(), Turn::Lead { .. }));
    }

    #[test]
    fn a_queued_fetch_times_out_and_leaves_the_queue() {
        let l = Limiter::with_per_blob(1, 1);
        let _held = lead(&l, Some(1), false, &[0..10], 100);
        assert_eq!(brief_turn_error(&l, false).kind(), io::ErrorKind::TimedOut);
        assert_eq!(l.waiting(), 0);
        assert!(l.state.lock().queue.is_empty());
    }
}
