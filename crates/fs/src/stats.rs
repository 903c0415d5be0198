//! Per-mount counters: what `ferry status` will show for a mount (bytes fetched out of
//! the total, cache hits, fetch errors). Lock-free so the read path never waits on them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Live counters of one mount, shared by its layers' sources.
#[derive(Debug, Default)]
pub struct MountStats {
    /// Compressed bytes of all layers (what a full pull would fetch).
    pub bytes_total: AtomicU64,
    /// Bytes fetched from the backend (registry or layout), verified or not.
    pub bytes_fetched: AtomicU64,
    /// Backend requests made.
    pub requests: AtomicU64,
    /// Fetches that went out in another fetch's request instead of one of their own
    /// (queued for the same blob while its requests were in flight).
    pub requests_joined: AtomicU64,
    /// Spans served from the chunk store without a fetch.
    pub cache_hits: AtomicU64,
    /// Spans that had to be fetched.
    pub cache_misses: AtomicU64,
    /// Fetches that failed, timed out or did not verify.
    pub fetch_errors: AtomicU64,
    /// Spans whose bytes did not match the index's digest.
    pub verify_failures: AtomicU64,
    /// Reads that waited for another thread's fetch of the same span instead of fetching.
    pub shared_waits: AtomicU64,
    /// Uncompressed bytes served to readers.
    pub bytes_served: AtomicU64,
    /// Compressed bytes fetched by prefetch (trace or eStargz landmarks).
    pub bytes_prefetched: AtomicU64,
    /// Compressed bytes fetched by background fill.
    pub bytes_filled: AtomicU64,
    /// Reads of a process that waited for the network: their own fetch or one in flight
    /// they joined, each read counted once. The start's critical path in round trips.
    pub read_waits: AtomicU64,
    /// Compressed bytes fetched by readahead along a layer's stream (ahead of misses).
    pub bytes_readahead: AtomicU64,
    /// Compressed bytes fetched as the rest of a file or the small files beside it, at a
    /// miss ([`crate::image::nearby`]).
    pub bytes_nearby: AtomicU64,
    /// Compressed bytes of spans fetched as guesses rather than for a read that wanted
    /// them, by [`Guess`] kind (its index in [`Guess::ALL`]).
    pub bytes_guessed: [AtomicU64; Guess::KINDS],
    /// Of [`Self::bytes_guessed`], the bytes of spans a read has used since: what each
    /// kind of guess was worth. Their difference is what guessing has cost so far, and
    /// bounds further guesses of that kind ([`crate::image::nearby`]).
    pub bytes_guessed_used: [AtomicU64; Guess::KINDS],
    /// Compressed bytes of the hot set pinned in the chunk store for this mount (set
    /// once, before prefetch; 0 when the mount pins nothing).
    pub hot_bytes: AtomicU64,
    /// Prefetch has finished (or there was nothing to prefetch).
    pub prefetch_done: AtomicBool,
    /// Background fill has finished: every byte of the mount's layers is local.
    pub fill_done: AtomicBool,
}

/// Why spans were fetched before a read asked for them. Each kind is accounted apart,
/// because each has its own bound: a library's rest that its loader never faults in
/// must not hold back the neighbours of the next package's first miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guess {
    /// Along the layer's stream past a miss ([`crate::device::readahead`]).
    Readahead,
    /// The rest of a file a read started on ([`crate::image::nearby`]).
    Rest,
    /// The small files around a directory's first miss ([`crate::image::nearby`]).
    Neighbours,
}

impl Guess {
    /// How many kinds there are.
    pub const KINDS: usize = 3;
    /// Every kind, in the order of [`MountStats::bytes_guessed`].
    pub const ALL: [Guess; Guess::KINDS] = [Guess::Readahead, Guess::Rest, Guess::Neighbours];

    /// The kind's name in status and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Guess::Readahead => "readahead",
            Guess::Rest => "rest",
            Guess::Neighbours => "neighbours",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The per-span flag of this kind (0 is "no guess").
    pub(crate) fn flag(self) -> u8 {
        self as u8 + 1
    }

    pub(crate) fn of_flag(flag: u8) -> Option<Guess> {
        Guess::ALL.get(usize::from(flag).checked_sub(1)?).copied()
    }
}

/// Bytes fetched as guesses of one kind, and how many a read has used since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct GuessBytes {
    /// Compressed bytes fetched as this kind of guess.
    pub fetched: u64,
    /// Of them, the bytes of spans a read has used since.
    pub used: u64,
}

/// [`GuessBytes`] by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Guesses {
    /// See [`Guess::Readahead`].
    pub readahead: GuessBytes,
    /// See [`Guess::Rest`].
    pub rest: GuessBytes,
    /// See [`Guess::Neighbours`].
    pub neighbours: GuessBytes,
}

impl Guesses {
    /// The bytes of `kind`.
    pub fn of(&self, kind: Guess) -> GuessBytes {
        match kind {
            Guess::Readahead => self.readahead,
            Guess::Rest => self.rest,
            Guess::Neighbours => self.neighbours,
        }
    }
}

/// A copy of [`MountStats`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct StatsSnapshot {
    /// See [`MountStats::bytes_total`].
    pub bytes_total: u64,
    /// See [`MountStats::bytes_fetched`].
    pub bytes_fetched: u64,
    /// See [`MountStats::requests`].
    pub requests: u64,
    /// See [`MountStats::requests_joined`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub requests_joined: u64,
    /// See [`MountStats::cache_hits`].
    pub cache_hits: u64,
    /// See [`MountStats::cache_misses`].
    pub cache_misses: u64,
    /// See [`MountStats::fetch_errors`].
    pub fetch_errors: u64,
    /// See [`MountStats::verify_failures`].
    pub verify_failures: u64,
    /// See [`MountStats::shared_waits`].
    pub shared_waits: u64,
    /// See [`MountStats::bytes_served`].
    pub bytes_served: u64,
    /// See [`MountStats::bytes_prefetched`].
    pub bytes_prefetched: u64,
    /// See [`MountStats::bytes_filled`].
    pub bytes_filled: u64,
    /// See [`MountStats::read_waits`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub read_waits: u64,
    /// See [`MountStats::bytes_readahead`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub bytes_readahead: u64,
    /// See [`MountStats::bytes_nearby`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub bytes_nearby: u64,
    /// See [`MountStats::bytes_guessed`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub bytes_guessed: u64,
    /// See [`MountStats::bytes_guessed_used`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub bytes_guessed_used: u64,
    /// The guesses by kind: [`Self::bytes_guessed`] and [`Self::bytes_guessed_used`]
    /// are their sums (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub guesses: Guesses,
    /// See [`MountStats::hot_bytes`] (absent from an older daemon's answer: 0).
    #[serde(default)]
    pub hot_bytes: u64,
    /// See [`MountStats::prefetch_done`].
    pub prefetch_done: bool,
    /// See [`MountStats::fill_done`].
    pub fill_done: bool,
}

impl MountStats {
    /// Reads every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            bytes_total: l(&self.bytes_total),
            bytes_fetched: l(&self.bytes_fetched),
            requests: l(&self.requests),
            requests_joined: l(&self.requests_joined),
            cache_hits: l(&self.cache_hits),
            cache_misses: l(&self.cache_misses),
            fetch_errors: l(&self.fetch_errors),
            verify_failures: l(&self.verify_failures),
            shared_waits: l(&self.shared_waits),
            bytes_served: l(&self.bytes_served),
            bytes_prefetched: l(&self.bytes_prefetched),
            bytes_filled: l(&self.bytes_filled),
            read_waits: l(&self.read_waits),
            bytes_readahead: l(&self.bytes_readahead),
            bytes_nearby: l(&self.bytes_nearby),
            bytes_guessed: self.bytes_guessed.iter().map(l).sum(),
            bytes_guessed_used: self.bytes_guessed_used.iter().map(l).sum(),
            guesses: {
                let bytes = |kind: Guess| GuessBytes {
                    fetched: l(&self.bytes_guessed[kind.index()]),
                    used: l(&self.bytes_guessed_used[kind.index()]),
                };
                Guesses {
                    readahead: bytes(Guess::Readahead),
                    rest: bytes(Guess::Rest),
                    neighbours: bytes(Guess::Neighbours),
                }
            },
            hot_bytes: l(&self.hot_bytes),
            prefetch_done: self.prefetch_done.load(Ordering::Relaxed),
            fill_done: self.fill_done.load(Ordering::Relaxed),
        }
    }

    /// Counts a read that waited for the network, here and node-wide
    /// ([`node_read_waits`]).
    pub(crate) fn read_waited(&self) {
        self.read_waits.fetch_add(1, Ordering::Relaxed);
        NODE_READ_WAITS.fetch_add(1, Ordering::Relaxed);
    }

    /// Compressed bytes fetched as guesses of `kind` that no read has used yet.
    pub(crate) fn guessed_unused(&self, kind: Guess) -> u64 {
        let used = self.bytes_guessed_used[kind.index()].load(Ordering::Relaxed);
        self.bytes_guessed[kind.index()]
            .load(Ordering::Relaxed)
            .saturating_sub(used)
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Reads that waited for the network, summed over every mount of the process.
static NODE_READ_WAITS: AtomicU64 = AtomicU64::new(0);

/// Reads of any mount of this process that waited for the network so far: a start on
/// the node is one image's several layer mounts, and background fill of any of them
/// waits until none of them waits ([`crate::warm`]).
pub fn node_read_waits() -> u64 {
    NODE_READ_WAITS.load(Ordering::Relaxed)
}
