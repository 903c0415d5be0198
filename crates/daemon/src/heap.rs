//! The daemon's allocator policy: buffers up to a few MiB reused inside the heap, and
//! the heap's free pages handed back to the kernel once a burst of work is over.
//!
//! Why: a start makes the daemon allocate and free many buffers on many threads, the
//! big ones (spans, windows, inflate passes, fetch bodies) of 100 KiB to 4 MiB.
//! [`tune_allocator`] keeps those inside glibc's heap arenas, where a freed one is
//! reused by the next without a page fault, gives back an arena's free top above
//! 1 MiB, and bounds the arenas to four. The free pages left inside the arenas are what
//! [`HeapTrimmer`] hands back: once the process has gone quiet after some work, never
//! in the middle of a burst (trimming takes the arenas' locks and pages given back
//! would be faulted in again at once).
//!
//! Measured through containerd (`bench/cold-start.sh`, pandas on Debian's registry,
//! interleaved, three rounds each, 2026-12-04): against a fixed 128 KiB mmap threshold
//! (every big buffer its own mapping, faulted in and zeroed each time), 16-20 % less
//! daemon CPU during the start and the same resident memory 11 s after it (55-56 MB
//! with a trace; the trim does the work the mmap threshold did). Before the trimmer,
//! glibc's own dynamic threshold kept 86-128 MB resident after a start.
//!
//! What it must not do: trim on a timer regardless of load, or hold any state but two
//! CPU-time readings. The decision is a pure function of the CPU times it is handed,
//! so it is tested without a clock; [`spawn_heap_trimmer`] feeds it the process's.

use std::time::Duration;

/// Buffers up to this size come from the heap arenas (glibc's fixed mmap threshold;
/// setting it also turns glibc's dynamic adjustment off).
const MMAP_THRESHOLD: i32 = 4 << 20;
/// An arena's free top above this goes back to the kernel when memory is freed.
const TRIM_THRESHOLD: i32 = 1 << 20;
/// At most this many heap arenas (glibc's default is eight per core).
const ARENA_MAX: i32 = 4;

/// Sets glibc's allocator up for the daemon (see the module doc), before any thread
/// starts. A setting an operator gives in `GLIBC_TUNABLES` (`glibc.malloc.mmap_threshold`,
/// `trim_threshold`, `arena_max`) is left alone.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        for (name, param, value) in [
            ("mmap_threshold", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            ("trim_threshold", libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            ("arena_max", libc::M_ARENA_MAX, ARENA_MAX),
        ] {
            if tunables.contains(&format!("glibc.malloc.{name}")) {
                tracing::info!("GLIBC_TUNABLES sets glibc.malloc.{name}; keeping it");
                continue;
            }
            // SAFETY: mallopt only changes allocator tuning; called before other threads.
            let ok = unsafe { libc::mallopt(param, value) };
            if ok != 1 {
                tracing::debug!("mallopt({name}) refused; keeping glibc's default");
            }
        }
    }
}

/// How often the trimmer looks at the process's CPU time.
pub const TRIM_TICK: Duration = Duration::from_secs(5);

/// Decides, tick by tick, whether to trim the heap now (see the module doc).
#[derive(Debug, Clone)]
pub struct HeapTrimmer {
    /// A tick whose CPU time is above this is a burst: no trim.
    busy_above: Duration,
    /// CPU time spent since the last trim before another one is worth making.
    worth_after: Duration,
    /// The CPU time at the previous tick.
    last: Option<Duration>,
    /// CPU time spent since the last trim (or the start).
    since_trim: Duration,
}

impl HeapTrimmer {
    /// A trimmer for ticks of `tick`: a tick using more than a quarter of one core is
    /// busy, and 50 ms of work since the last trim makes another worth it.
    pub fn new(tick: Duration) -> HeapTrimmer {
        HeapTrimmer {
            busy_above: tick / 4,
            worth_after: Duration::from_millis(50),
            last: None,
            since_trim: Duration::ZERO,
        }
    }

    /// The process's CPU time now (monotonic); true when the heap should be trimmed.
    pub fn tick(&mut self, cpu: Duration) -> bool {
        let Some(last) = self.last.replace(cpu) else {
            return false;
        };
        let spent = cpu.saturating_sub(last);
        self.since_trim += spent;
        if spent > self.busy_above || self.since_trim < self.worth_after {
            return false;
        }
        self.since_trim = Duration::ZERO;
        true
    }
}

/// The CPU time of the whole process (every thread), `None` where it cannot be read.
fn process_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// Resident bytes of this process, from `/proc/self/statm` (for the log line only).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

/// Gives the heap arenas' free pages back to the kernel; logs what it changed.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let before = resident_bytes();
        let started = std::time::Instant::now();
        // SAFETY: malloc_trim only returns free memory of the allocator to the kernel.
        unsafe { libc::malloc_trim(0) };
        tracing::debug!(
            took_us = started.elapsed().as_micros() as u64,
            rss_before = before,
            rss_after = resident_bytes(),
            "heap trimmed after a burst of work"
        );
    }
}

/// Starts a thread that ticks a [`HeapTrimmer`] every [`TRIM_TICK`] with the process's
/// CPU time and trims the heap when it says so, for the life of the process.
pub fn spawn_heap_trimmer() {
    let spawned = std::thread::Builder::new()
        .name("ferry-heap-trim".into())
        .spawn(|| {
            let mut trimmer = HeapTrimmer::new(TRIM_TICK);
            loop {
                std::thread::sleep(TRIM_TICK);
                let Some(cpu) = process_cpu_time() else {
                    return;
                };
                if trimmer.tick(cpu) {
                    trim_heap();
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the heap trimmer; freed memory may stay resident");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_burst_is_trimmed_once_when_it_ends() {
        let mut t = HeapTrimmer::new(TRIM_TICK);
        assert!(!t.tick(ms(100)), "the first reading only sets the baseline");
        // A start: two ticks of more than a quarter of a core each.
        assert!(!t.tick(ms(3_100)));
        assert!(!t.tick(ms(5_000)));
        // It goes quiet: one trim, then none while nothing happens.
        assert!(t.tick(ms(5_010)));
        assert!(!t.tick(ms(5_011)));
        assert!(!t.tick(ms(5_012)));
    }

    #[test]
    fn quiet_work_adds_up_to_a_trim() {
        let mut t = HeapTrimmer::new(TRIM_TICK);
        assert!(!t.tick(ms(0)));
        // Background fill at a few percent of a core: 20 ms a tick.
        assert!(!t.tick(ms(20)));
        assert!(!t.tick(ms(40)));
        assert!(t.tick(ms(60)), "50 ms of work since the last trim");
        assert!(!t.tick(ms(80)));
    }

    #[test]
    fn an_idle_process_is_never_trimmed() {
        let mut t = HeapTrimmer::new(TRIM_TICK);
        for _ in 0..100 {
            assert!(!t.tick(ms(7)));
        }
    }

    #[test]
    fn a_clock_going_back_counts_as_no_work() {
        let mut t = HeapTrimmer::new(TRIM_TICK);
        assert!(!t.tick(ms(1_000)));
        assert!(!t.tick(ms(10)));
        assert!(!t.tick(ms(20)));
    }

    #[test]
    fn the_process_cpu_time_reads_and_moves_forward() {
        let a = process_cpu_time().expect("CLOCK_PROCESS_CPUTIME_ID");
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let b = process_cpu_time().expect("CLOCK_PROCESS_CPUTIME_ID");
        assert!(b >= a);
        assert!(resident_bytes().is_some_and(|r| r > 0));
    }
}
