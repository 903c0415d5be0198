//! Recording a startup trace: which file bytes a workload reads, in first-touch order,
//! noted by inode of a mount's tree and kept by path ([`crate::trace`] is the format
//! and its home in a layout or registry).
//!
//! It must stay cheap on the read path: [`Recorder::note`] is one atomic load when not
//! recording.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::tree::{Ino, InodeTree};
use crate::trace::{MAX_TRACE_READS, Trace, TraceRead};

/// Per-file state of a recording.
#[derive(Debug)]
struct FileRecord {
    path: String,
    /// Indices into `reads` of this file's recorded reads.
    reads: Vec<usize>,
}

#[derive(Debug, Default)]
struct Recording {
    reads: Vec<TraceRead>,
    /// Keyed by (view, inode): one recording may take the reads of several mounts (the
    /// layer mounts of one image), whose inode numbers overlap.
    files: HashMap<(u64, Ino), FileRecord>,
    /// Reads dropped because the trace was full.
    dropped: u64,
}

/// Records reads in first-touch order while switched on; a no-op otherwise.
///
/// Two modes: [`Recorder::start`] (`ferry trace record`) asks the FUSE layer to serve
/// every read itself ([`Recorder::records_every_read`]: no passthrough, no page cache
/// kept from before an open), so a workload re-run on a warm node is seen whole;
/// [`Recorder::start_passive`] (the daemon's automatic recording during a first start)
/// leaves the read path as it is and notes what reaches it, which on a fresh mount is
/// every first touch (the mount's page cache starts empty; a file opened through
/// passthrough is noted whole at open).
///
/// One recorder may be shared (`Arc`) by several mounts; each passes its own `view` id
/// to [`Recorder::note`], and the reads of all of them land in one first-touch order.
#[derive(Debug, Default)]
pub struct Recorder {
    on: AtomicBool,
    every_read: AtomicBool,
    /// Reads that touched bytes no recorded read held (new first touches), for
    /// deciding when a start has gone quiet.
    touches: AtomicU64,
    state: Mutex<Recording>,
}

impl Recorder {
    /// Starts (or restarts, discarding what was recorded) recording, with the FUSE layer
    /// serving every read itself so that none is missed.
    pub fn start(&self) {
        *self.state.lock() = Recording::default();
        self.every_read.store(true, Ordering::Release);
        self.on.store(true, Ordering::Release);
    }

    /// Starts (or restarts) recording without changing how reads are served.
    pub fn start_passive(&self) {
        *self.state.lock() = Recording::default();
        self.every_read.store(false, Ordering::Release);
        self.on.store(true, Ordering::Release);
    }

    /// True while recording.
    pub fn is_recording(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// True while recording in the mode that wants every read served by FUSE.
    pub fn records_every_read(&self) -> bool {
        self.is_recording() && self.every_read.load(Ordering::Acquire)
    }

    /// New first touches noted since the recording started (grows by one for each
    /// read that added or widened a recorded read).
    pub fn touches(&self) -> u64 {
        self.touches.load(Ordering::Acquire)
    }

    /// Reads recorded so far (a read later joined into another still counts: the bound
    /// is on what the recording holds).
    pub fn len(&self) -> usize {
        self.state.lock().reads.len()
    }

    /// True when nothing was recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the recording is full ([`MAX_TRACE_READS`]).
    pub fn is_full(&self) -> bool {
        self.len() >= MAX_TRACE_READS
    }

    /// Stops recording and returns what was recorded.
    pub fn take(&self) -> Trace {
        self.on.store(false, Ordering::Release);
        self.every_read.store(false, Ordering::Release);
        let rec = std::mem::take(&mut *self.state.lock());
        if rec.dropped > 0 {
            tracing::warn!(
                dropped = rec.dropped,
                "startup trace full: later reads were not recorded"
            );
        }
        let mut reads = rec.reads;
        reads.retain(|r| r.len > 0);
        Trace { reads }
    }

    /// Notes a read of `len` bytes at `offset` of file `ino` of `tree`, the tree of
    /// mount `view` (any id unique among the mounts sharing this recorder). A read that
    /// touches or overlaps a recorded read of the same file widens that read in place
    /// (so a re-read records nothing); others are appended in first-touch order.
    pub fn note(&self, view: u64, tree: &InodeTree, ino: Ino, offset: u64, len: u64) {
        if !self.on.load(Ordering::Acquire) || len == 0 {
            return;
        }
        let Some(node) = tree.get(ino) else { return };
        // Clamp to the file: the kernel reads past the end of files.
        let end = offset.saturating_add(len).min(node.size);
        if offset >= end {
            return;
        }
        let mut guard = self.state.lock();
        let rec = &mut *guard;
        let file = match rec.files.entry((view, ino)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let Some(path) = tree.path_of(ino) else {
                    return;
                };
                e.insert(FileRecord {
                    path,
                    reads: Vec::new(),
                })
            }
        };
        // A read touching or overlapping reads already recorded for the file widens the
        // earliest of them in place and absorbs the others it bridges (the kernel's
        // readahead can fetch a file's middle last, after its start and its end).
        let mut touching = file.reads.iter().copied().filter(|&i| {
            let r = &rec.reads[i];
            offset <= r.offset + r.len && r.offset <= end
        });
        if let Some(first) = touching.next() {
            let (mut lo, mut hi) = (offset, end);
            let r = &rec.reads[first];
            let before = (r.offset, r.len);
            lo = lo.min(r.offset);
            hi = hi.max(r.offset + r.len);
            let absorbed: Vec<usize> = touching.collect();
            for &i in &absorbed {
                let r = &mut rec.reads[i];
                lo = lo.min(r.offset);
                hi = hi.max(r.offset + r.len);
                // Emptied, not removed: the indices of other files stay valid; `take`
                // leaves empty reads out.
                r.len = 0;
            }
            file.reads.retain(|i| !absorbed.contains(i));
            let r = &mut rec.reads[first];
            (r.offset, r.len) = (lo, hi - lo);
            if before != (lo, hi - lo) {
                self.touches.fetch_add(1, Ordering::AcqRel);
            }
            return;
        }
        if rec.reads.len() >= MAX_TRACE_READS {
            rec.dropped += 1;
            return;
        }
        file.reads.push(rec.reads.len());
        rec.reads.push(TraceRead {
            path: file.path.clone(),
            offset,
            len: end - offset,
        });
        self.touches.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
#[path = "recorder_tests.rs"]
mod tests;
