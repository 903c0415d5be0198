//! Writing eStargz: one uncompressed tar stream in, one eStargz blob out.
//!
//! # Layout (the same as stargz-snapshotter's `estargz.Build`)
//!
//! The output tar holds, in order: the prioritized entries (each preceded by its parent
//! directories and, for hard links, by their targets, as stargz's `moveRec` does), then
//! `.prefetch.landmark` — or, without priorities, `.no.prefetch.landmark` first — then
//! every other entry in input order, then `stargz.index.json` and the end-of-archive
//! blocks. Input entries named like a landmark or the TOC are dropped, as stargz does.
//!
//! gzip members start at offset 0, at the first data byte of every non-empty regular
//! file and at every `chunk_size` bytes inside one; a member therefore holds one chunk of
//! file data, the tar padding after it (for a file's last chunk) and the headers of the
//! entries that follow up to and including the next non-empty file's header. Directories,
//! links, devices, FIFOs and empty files thus share the member of the data before them.
//! One deviation, for bounded memory: a run of more than 8 MiB of such headers is cut
//! into several members (between two headers; stargz's parallel `Build` cuts members at
//! header boundaries too, and readers do not care). The TOC (tar header, JSON, padding,
//! end-of-archive) is one member, followed by the 51-byte footer.
//!
//! Tar headers are rewritten (like stargz's non-lossless `AppendTar`): ustar, with a PAX
//! extended header in front when something does not fit (long path or link target, long
//! user/group name, large ids/sizes, sub-second or negative mtime, devices beyond the
//! ustar range, xattrs as `SCHILY.xattr.*`).
//!
//! # Speed and memory
//!
//! One thread reads and parses the tar ([`crate::tarwalk`]) and cuts it into members;
//! members are grouped into jobs of ~2 MiB that a rayon pool (one thread per core)
//! compresses with libdeflate and hashes (chunk digests); the calling thread writes the
//! jobs in order, hashing the blob and the uncompressed stream. At most 64 MiB of
//! uncompressed data is in flight (plus one member being filled), so memory does not grow
//! with the layer. The output depends only on the input and the options, never on the
//! number of threads.
//!
//! Prioritized entries are collected by a first pass over the input and kept in memory
//! (at most [`PRIORITY_BUFFER_MAX`] bytes of file data) so they can be written in the
//! requested order; the second pass writes everything else. A prioritized hard link whose
//! target is not prioritized needs one more pass to fetch the target.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};

use libdeflater::{CompressionLvl, Compressor};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use super::footer::footer_bytes;
use super::toc::{B64, JToc, TocEntry, format_modtime, sha256_string};
use super::{
    DEFAULT_CHUNK_SIZE, LANDMARK_CONTENTS, NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, TOC_TAR_NAME,
};
use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::tarwalk::{TarWalker, normalize_path};

/// Default gzip level: libdeflate level 6 is about as small as Go's level 9 (stargz's
/// default) and several times faster.
pub const DEFAULT_LEVEL: u32 = 6;
/// Largest accepted chunk size (a chunk is held in memory whole).
pub const MAX_CHUNK_SIZE: u64 = 256 << 20;
/// Most file data of prioritized entries held in memory between the two passes.
pub const PRIORITY_BUFFER_MAX: u64 = 1 << 30;

/// Uncompressed bytes per compression job.
const JOB_TARGET: usize = 2 << 20;
/// Members per compression job at most.
const JOB_MAX_MEMBERS: usize = 4096;
/// Uncompressed bytes handed to the compressors and not yet written, at most (one job
/// may exceed it alone).
const IN_FLIGHT: u64 = 64 << 20;
/// A member holding only headers is closed once it reaches this size.
const MAX_HEADER_RUN: usize = 8 << 20;
/// Read buffer in front of the input tar stream.
const READ_BUF: usize = 1 << 20;
/// Output buffer.
const WRITE_BUF: usize = 1 << 20;
/// Passes over the input to collect prioritized entries (hard link chains need more).
const MAX_PRIORITY_PASSES: usize = 4;

const OCTAL8_MAX: u64 = 0o7_777_777;
const OCTAL12_MAX: u64 = 0o77_777_777_777;

/// How to write an eStargz layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EstargzOptions {
    /// Regular files larger than this are split into chunks of this size, each its own
    /// gzip member with its own digest (1 ..= [`MAX_CHUNK_SIZE`]; default 4 MiB).
    pub chunk_size: u64,
    /// gzip level, 0 ..= 12 (libdeflate levels; default [`DEFAULT_LEVEL`]).
    pub level: u32,
    /// Normalized paths to put first, in this order, followed by `.prefetch.landmark`.
    /// Paths the layer lacks are ignored. Empty: `.no.prefetch.landmark`.
    pub priority: Vec<String>,
}

impl Default for EstargzOptions {
    fn default() -> Self {
        EstargzOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            level: DEFAULT_LEVEL,
            priority: Vec::new(),
        }
    }
}

/// What [`convert`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EstargzOutput {
    /// Digest of the blob, `sha256:<hex>`.
    pub digest: String,
    /// Size of the blob in bytes.
    pub size: u64,
    /// Digest of the uncompressed tar stream (the layer's diff ID), `sha256:<hex>`.
    pub diff_id: String,
    /// Digest of the TOC JSON (`containerd.io/snapshot/stargz/toc.digest`).
    pub toc_digest: String,
    /// Size of the uncompressed tar stream (`io.containers.estargz.uncompressed-size`).
    pub uncompressed_size: u64,
}

fn esgz(msg: impl Into<String>) -> Error {
    Error::Estargz(msg.into())
}

/// Converts one uncompressed tar stream into eStargz, written to `out`.
///
/// `open_tar` opens the input from its start; it is called once without priorities,
/// twice with them (a first pass collects the prioritized entries), and a few more times
/// (at most three) when prioritized hard links point at entries not collected yet. The input is parsed by [`crate::tarwalk::TarWalker`], so it must be a
/// well-formed tar with an end-of-archive marker.
pub fn convert<W: Write>(
    open_tar: &mut dyn FnMut() -> Result<Box<dyn Read + Send>>,
    out: W,
    opts: &EstargzOptions,
) -> Result<EstargzOutput> {
    if opts.chunk_size == 0 || opts.chunk_size > MAX_CHUNK_SIZE {
        return Err(esgz(format!(
            "chunk size {} is outside 1..={MAX_CHUNK_SIZE}",
            opts.chunk_size
        )));
    }
    if opts.level > 12 {
        return Err(esgz(format!("gzip level {} is outside 0..=12", opts.level)));
    }
    let plan = if opts.priority.is_empty() {
        None
    } else {
        Some(plan_priority(open_tar, &opts.priority)?)
    };
    let input = open_tar()?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("esgz-gzip-{i}"))
        .build()
        .map_err(|e| {
            Error::Io(io::Error::other(format!(
                "starting compression threads: {e}"
            )))
        })?;
    let budget = Arc::new(Budget::new(IN_FLIGHT));
    let (tx, rx) = mpsc::channel::<Msg>();
    let (chunk_size, level) = (opts.chunk_size, opts.level);
    std::thread::scope(|s| {
        let builder_budget = Arc::clone(&budget);
        let pool = &pool;
        s.spawn(move || {
            let mut b = Builder::new(chunk_size, level, pool, tx.clone(), builder_budget);
            let res = b.run(plan, input).map(|()| b.into_state());
            let _ = tx.send(Msg::Done(res));
        });
        let res = write_all(rx, out, &budget, level);
        if res.is_err() {
            budget.abort();
        }
        res
    })
}

// ---------------------------------------------------------------------------------------
// Priority planning

/// The prioritized entries in output order, with their data, and the paths they cover.
#[derive(Debug, Default)]
struct PriorityPlan {
    ordered: Vec<(Entry, Vec<u8>)>,
    picked: HashSet<String>,
}

fn is_reserved(path: &str) -> bool {
    path == TOC_TAR_NAME || path == PREFETCH_LANDMARK || path == NO_PREFETCH_LANDMARK
}

fn parent_of(path: &str) -> &str {
    path.rfind('/').map_or("", |i| &path[..i])
}

fn with_ancestors(path: &str, set: &mut HashSet<String>) {
    let mut p = path;
    // Paths always go in with their ancestors, so a path already present ends the walk.
    while set.insert(p.to_string()) && !p.is_empty() {
        p = parent_of(p);
    }
}

fn plan_priority(
    open_tar: &mut dyn FnMut() -> Result<Box<dyn Read + Send>>,
    priority: &[String],
) -> Result<PriorityPlan> {
    let wanted_order: Vec<String> = priority
        .iter()
        .filter_map(|p| normalize_path(p))
        .filter(|p| !is_reserved(p))
        .collect();
    let mut wanted = HashSet::new();
    for p in &wanted_order {
        with_ancestors(p, &mut wanted);
    }
    let mut buffered: HashMap<String, (Entry, Vec<u8>)> = HashMap::new();
    let mut total = 0u64;
    for _ in 0..MAX_PRIORITY_PASSES {
        if wanted.is_empty() {
            break;
        }
        let mut walker = TarWalker::new(BufReader::with_capacity(READ_BUF, open_tar()?));
        let mut missing = HashSet::new();
        while let Some(e) = walker.next_entry()? {
            if is_reserved(&e.path) || !wanted.contains(&e.path) {
                continue;
            }
            let mut data = Vec::new();
            if e.kind == EntryKind::File && e.size > 0 {
                if total + e.size > PRIORITY_BUFFER_MAX {
                    return Err(esgz(format!(
                        "prioritized files hold more than {PRIORITY_BUFFER_MAX} bytes; prioritize fewer"
                    )));
                }
                data = vec![0u8; e.size as usize];
                walker.read_exact(&mut data)?;
            }
            if e.kind == EntryKind::Hardlink && !buffered.contains_key(&e.link_target) {
                with_ancestors(&e.link_target, &mut missing);
            }
            total += data.len() as u64;
            if let Some((_, old)) = buffered.insert(e.path.clone(), (e, data)) {
                total -= old.len() as u64;
            }
        }
        missing.retain(|p| !buffered.contains_key(p));
        wanted = missing;
    }
    let mut order = Vec::new();
    let mut picked = HashSet::new();
    let mut visiting = HashSet::new();
    for p in &wanted_order {
        move_rec(p, &buffered, &mut order, &mut picked, &mut visiting);
    }
    let missed = wanted_order.iter().filter(|p| !picked.contains(*p)).count();
    if missed > 0 {
        tracing::debug!(missed, "prioritized paths not found in the layer");
    }
    let ordered = order
        .into_iter()
        .filter_map(|p| buffered.remove(&p))
        .collect();
    Ok(PriorityPlan { ordered, picked })
}

/// Appends `name` to `order` after its parent directories and, for a hard link, after its
/// target (stargz's `moveRec`). Paths the layer lacks are skipped; a hard link whose
/// target cannot go first stays where it was.
fn move_rec(
    name: &str,
    buffered: &HashMap<String, (Entry, Vec<u8>)>,
    order: &mut Vec<String>,
    picked: &mut HashSet<String>,
    visiting: &mut HashSet<String>,
) {
    if picked.contains(name) || visiting.contains(name) {
        return;
    }
    visiting.insert(name.to_string());
    if !name.is_empty() {
        move_rec(parent_of(name), buffered, order, picked, visiting);
    }
    if let Some((e, _)) = buffered.get(name) {
        let ok = if e.kind == EntryKind::Hardlink {
            move_rec(&e.link_target, buffered, order, picked, visiting);
            picked.contains(&e.link_target)
        } else {
            true
        };
        if ok {
            picked.insert(name.to_string());
            order.push(name.to_string());
        }
    }
    visiting.remove(name);
}

// ---------------------------------------------------------------------------------------
// Tar headers

fn typeflag(kind: EntryKind) -> u8 {
    match kind {
        EntryKind::File => b'0',
        EntryKind::Hardlink => b'1',
        EntryKind::Symlink => b'2',
        EntryKind::Char => b'3',
        EntryKind::Block => b'4',
        EntryKind::Dir => b'5',
        EntryKind::Fifo => b'6',
    }
}

pub(super) fn toc_type(kind: EntryKind) -> &'static str {
    match kind {
        EntryKind::File => "reg",
        EntryKind::Hardlink => "hardlink",
        EntryKind::Symlink => "symlink",
        EntryKind::Char => "char",
        EntryKind::Block => "block",
        EntryKind::Dir => "dir",
        EntryKind::Fifo => "fifo",
    }
}

/// The TOC entry of tar entry `e`, named `name`, with user and group names `uname` and
/// `gname` (eStargz writes a name only when it changes for an id): its metadata, no data
/// fields yet. Modification times are rounded to the second, as stargz writes them.
pub(super) fn toc_entry(e: &Entry, name: String, uname: String, gname: String) -> TocEntry {
    let is_dev = matches!(e.kind, EntryKind::Char | EntryKind::Block);
    TocEntry {
        name,
        typ: toc_type(e.kind).to_string(),
        size: if e.kind == EntryKind::File {
            e.size as i64
        } else {
            0
        },
        modtime: format_modtime(e.mtime, e.mtime_nsec),
        link_name: match e.kind {
            EntryKind::Symlink | EntryKind::Hardlink => e.link_target.clone(),
            _ => String::new(),
        },
        mode: i64::from(e.mode & 0o7777),
        uid: i64::from(e.uid),
        gid: i64::from(e.gid),
        uname,
        gname,
        dev_major: if is_dev { i64::from(e.dev_major) } else { 0 },
        dev_minor: if is_dev { i64::from(e.dev_minor) } else { 0 },
        xattrs: e
            .xattrs
            .iter()
            .map(|(k, v)| (k.clone(), B64(v.clone())))
            .collect(),
        ..TocEntry::default()
    }
}

/// The name an entry gets in the tar and the TOC: directories end in `/`, the root is
/// `./`.
pub(super) fn tar_name(e: &Entry) -> String {
    match e.kind {
        EntryKind::Dir if e.path.is_empty() => "./".to_string(),
        EntryKind::Dir => format!("{}/", e.path),
        _ => e.path.clone(),
    }
}

/// Splits a name into ustar `(prefix, name)`, or `None` when it does not fit.
fn split_ustar(name: &[u8]) -> Option<(&[u8], &[u8])> {
    if name.len() <= 100 {
        return Some((&[], name));
    }
    if name.len() > 256 {
        return None;
    }
    // The largest prefix (at most 155 bytes) ending before a '/' that leaves a non-empty
    // name of at most 100 bytes.
    (0..name.len().min(156)).rev().find_map(|i| {
        let rest = name.len() - i - 1;
        (name[i] == b'/' && rest > 0 && rest <= 100).then(|| (&name[..i], &name[i + 1..]))
    })
}

/// Longest prefix of `s` of at most `max` bytes ending on a character boundary.
fn truncate_str(s: &str, max: usize) -> &[u8] {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s.as_bytes()[..end]
}

pub(super) fn pax_record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let base = key.len() + value.len() + 3;
    let mut len = base + 1;
    loop {
        let total = base + len.to_string().len();
        if total == len {
            break;
        }
        len = total;
    }
    out.extend_from_slice(format!("{len} {key}=").as_bytes());
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// A PAX time: seconds and a fraction, negative times written as Go and GNU tar do.
fn pax_time(secs: i64, nsec: u32) -> String {
    if nsec == 0 {
        return secs.to_string();
    }
    let s = if secs >= 0 {
        format!("{secs}.{nsec:09}")
    } else {
        // secs + nsec/1e9 with secs < 0: -(|secs + 1|).(1e9 - nsec)
        format!("-{}.{:09}", (secs + 1).unsigned_abs(), 1_000_000_000 - nsec)
    };
    s.trim_end_matches('0').to_string()
}

fn put_field(block: &mut [u8; 512], at: usize, len: usize, value: &[u8]) {
    let n = value.len().min(len);
    block[at..at + n].copy_from_slice(&value[..n]);
}

fn octal(block: &mut [u8; 512], at: usize, len: usize, v: u64) {
    let s = format!("{v:0width$o}", width = len - 1);
    put_field(block, at, len - 1, s.as_bytes());
}

fn pad_to_block(out: &mut Vec<u8>) {
    let rem = out.len() % 512;
    if rem != 0 {
        out.resize(out.len() + 512 - rem, 0);
    }
}

/// Appends the header block(s) of `e`, named `name`, to `out`.
pub(super) fn push_header(out: &mut Vec<u8>, e: &Entry, name: &str) -> Result<()> {
    let mut pax = Vec::new();
    let (prefix, short) = match split_ustar(name.as_bytes()) {
        Some(split) => split,
        None => {
            pax_record(&mut pax, "path", name.as_bytes());
            (&[][..], truncate_str(name, 100))
        }
    };
    let link: &str = match e.kind {
        EntryKind::Symlink | EntryKind::Hardlink => &e.link_target,
        _ => "",
    };
    if link.len() > 100 {
        pax_record(&mut pax, "linkpath", link.as_bytes());
    }
    if e.uname.len() > 32 {
        pax_record(&mut pax, "uname", e.uname.as_bytes());
    }
    if e.gname.len() > 32 {
        pax_record(&mut pax, "gname", e.gname.as_bytes());
    }
    if u64::from(e.uid) > OCTAL8_MAX {
        pax_record(&mut pax, "uid", e.uid.to_string().as_bytes());
    }
    if u64::from(e.gid) > OCTAL8_MAX {
        pax_record(&mut pax, "gid", e.gid.to_string().as_bytes());
    }
    let size = if e.kind == EntryKind::File { e.size } else { 0 };
    if size > OCTAL12_MAX {
        pax_record(&mut pax, "size", size.to_string().as_bytes());
    }
    let mtime_fits = u64::try_from(e.mtime).is_ok_and(|m| m <= OCTAL12_MAX);
    if !mtime_fits || e.mtime_nsec != 0 {
        pax_record(
            &mut pax,
            "mtime",
            pax_time(e.mtime, e.mtime_nsec).as_bytes(),
        );
    }
    let is_dev = matches!(e.kind, EntryKind::Char | EntryKind::Block);
    if is_dev && u64::from(e.dev_major) > OCTAL8_MAX {
        pax_record(
            &mut pax,
            "SCHILY.devmajor",
            e.dev_major.to_string().as_bytes(),
        );
    }
    if is_dev && u64::from(e.dev_minor) > OCTAL8_MAX {
        pax_record(
            &mut pax,
            "SCHILY.devminor",
            e.dev_minor.to_string().as_bytes(),
        );
    }
    for (k, v) in &e.xattrs {
        pax_record(&mut pax, &format!("SCHILY.xattr.{k}"), v);
    }
    if !pax.is_empty() {
        let base = name.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        let pax_name = format!("PaxHeaders.0/{base}");
        let mut h = tar::Header::new_ustar();
        h.as_mut_bytes()[..100].fill(0);
        put_field(h.as_mut_bytes(), 0, 100, truncate_str(&pax_name, 100));
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(pax.len() as u64);
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(&pax);
        // `out` may start mid-block (a member starting at a chunk), so pad by length.
        out.resize(out.len() + (512 - pax.len() % 512) % 512, 0);
    }
    let mut h = tar::Header::new_ustar();
    {
        let b = h.as_mut_bytes();
        put_field(b, 0, 100, short);
        put_field(b, 345, 155, prefix);
        put_field(b, 157, 100, truncate_str(link, 100));
        put_field(b, 265, 32, truncate_str(&e.uname, 32));
        put_field(b, 297, 32, truncate_str(&e.gname, 32));
        if is_dev {
            // Too large for the field: 0 here, the PAX record carries it.
            let fit = |v: u32| {
                if u64::from(v) <= OCTAL8_MAX {
                    u64::from(v)
                } else {
                    0
                }
            };
            octal(b, 329, 8, fit(e.dev_major));
            octal(b, 337, 8, fit(e.dev_minor));
        }
    }
    h.set_mode(e.mode & 0o7777);
    h.set_uid(u64::from(e.uid));
    h.set_gid(u64::from(e.gid));
    h.set_size(size);
    h.set_mtime(u64::try_from(e.mtime).map_or(0, |m| m.min(OCTAL12_MAX)));
    h.as_mut_bytes()[156] = typeflag(e.kind);
    h.set_cksum();
    out.extend_from_slice(h.as_bytes());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The pipeline

/// The uncompressed bytes of one gzip member; the first `chunk_len` bytes are a chunk of
/// file data (hashed for its `chunkDigest`).
#[derive(Debug)]
struct Member {
    data: Vec<u8>,
    chunk_len: usize,
}

/// Per member of a job: the gzip bytes and the chunk digest.
type Compressed = Vec<(Vec<u8>, Option<[u8; 32]>)>;

/// A compressed job, with its uncompressed members (for the diff ID).
#[derive(Debug)]
struct JobOut {
    compressed: Compressed,
    raw: Vec<Member>,
    bytes: u64,
}

#[derive(Debug)]
enum Msg {
    Job(u64, Result<JobOut>),
    Done(Result<BuilderState>),
}

/// Bounds the uncompressed bytes in flight between the builder and the writer.
#[derive(Debug)]
struct Budget {
    state: Mutex<(u64, bool)>,
    cv: Condvar,
    limit: u64,
}

impl Budget {
    fn new(limit: u64) -> Self {
        Budget {
            state: Mutex::new((0, false)),
            cv: Condvar::new(),
            limit,
        }
    }

    /// Waits until `n` more bytes fit (or nothing is in flight); false once aborted.
    fn acquire(&self, n: u64) -> bool {
        let mut g = self.state.lock();
        while !g.1 && g.0 > 0 && g.0 + n > self.limit {
            self.cv.wait(&mut g);
        }
        if g.1 {
            return false;
        }
        g.0 += n;
        true
    }

    fn release(&self, n: u64) {
        let mut g = self.state.lock();
        g.0 = g.0.saturating_sub(n);
        self.cv.notify_all();
    }

    fn abort(&self) {
        self.state.lock().1 = true;
        self.cv.notify_all();
    }

    fn aborted(&self) -> bool {
        self.state.lock().1
    }
}

thread_local! {
    static COMPRESSOR: RefCell<Option<(u32, Compressor)>> = const { RefCell::new(None) };
}

/// gzip-compresses one member with this thread's libdeflate compressor.
pub(super) fn gzip(level: u32, data: &[u8]) -> Result<Vec<u8>> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|(l, _)| *l != level) {
            let lvl = CompressionLvl::new(level as i32)
                .map_err(|e| esgz(format!("gzip level {level}: {e:?}")))?;
            *slot = Some((level, Compressor::new(lvl)));
        }
        let Some((_, comp)) = slot.as_mut() else {
            return Err(esgz("internal error: no compressor"));
        };
        let mut out = vec![0u8; comp.gzip_compress_bound(data.len())];
        let n = comp
            .gzip_compress(data, &mut out)
            .map_err(|e| esgz(format!("gzip compression failed: {e:?}")))?;
        out.truncate(n);
        Ok(out)
    })
}

fn compress_job(level: u32, members: &[Member]) -> Result<Compressed> {
    members
        .iter()
        .map(|m| {
            let digest = (m.chunk_len > 0).then(|| Sha256::digest(&m.data[..m.chunk_len]).into());
            Ok((gzip(level, &m.data)?, digest))
        })
        .collect()
}

/// One TOC entry being built: its JSON fields, the member holding its data and whether
/// its `digest` is its only chunk's digest.
#[derive(Debug)]
struct Rec {
    toc: TocEntry,
    member: Option<usize>,
    digest_is_chunk: bool,
}

/// What the builder hands the writer at the end.
#[derive(Debug)]
struct BuilderState {
    recs: Vec<Rec>,
    jobs: u64,
    tar_bytes: u64,
}

/// Cuts the tar stream into members and sends them off in jobs.
struct Builder<'p> {
    chunk_size: u64,
    level: u32,
    /// The member being filled.
    cur: Vec<u8>,
    /// Chunk bytes at the start of `cur`.
    cur_chunk: usize,
    job: Vec<Member>,
    job_bytes: usize,
    /// Members created so far (the next member's number).
    members: usize,
    /// Jobs sent so far.
    jobs: u64,
    tar_bytes: u64,
    recs: Vec<Rec>,
    unames: HashMap<u32, String>,
    gnames: HashMap<u32, String>,
    pool: &'p rayon::ThreadPool,
    tx: Sender<Msg>,
    budget: Arc<Budget>,
}

/// Returns `name` unless it is what `map` already says for `id` (stargz writes user
/// and group names only when they change for an id).
fn name_if_changed(map: &mut HashMap<u32, String>, id: u32, name: &str) -> String {
    if name.is_empty() || map.get(&id).is_some_and(|n| n == name) {
        return String::new();
    }
    map.insert(id, name.to_string());
    name.to_string()
}

impl<'p> Builder<'p> {
    fn new(
        chunk_size: u64,
        level: u32,
        pool: &'p rayon::ThreadPool,
        tx: Sender<Msg>,
        budget: Arc<Budget>,
    ) -> Self {
        Builder {
            chunk_size,
            level,
            cur: Vec::new(),
            cur_chunk: 0,
            job: Vec::new(),
            job_bytes: 0,
            members: 0,
            jobs: 0,
            tar_bytes: 0,
            recs: Vec::new(),
            unames: HashMap::new(),
            gnames: HashMap::new(),
            pool,
            tx,
            budget,
        }
    }

    fn run(&mut self, plan: Option<PriorityPlan>, input: Box<dyn Read + Send>) -> Result<()> {
        let picked = match plan {
            Some(plan) => {
                for (e, data) in &plan.ordered {
                    self.add(e, &mut &data[..])?;
                }
                self.add_landmark(PREFETCH_LANDMARK)?;
                plan.picked
            }
            None => {
                self.add_landmark(NO_PREFETCH_LANDMARK)?;
                HashSet::new()
            }
        };
        let mut walker = TarWalker::new(BufReader::with_capacity(READ_BUF, input));
        while let Some(e) = walker.next_entry()? {
            if is_reserved(&e.path) || picked.contains(&e.path) {
                continue;
            }
            self.add(&e, &mut walker)?;
        }
        self.finish_member()?;
        self.submit()
    }

    fn into_state(self) -> BuilderState {
        BuilderState {
            recs: self.recs,
            jobs: self.jobs,
            tar_bytes: self.tar_bytes,
        }
    }

    fn add_landmark(&mut self, name: &str) -> Result<()> {
        // Mode 0, no owner, no time: what stargz writes.
        let e = Entry {
            path: name.to_string(),
            kind: EntryKind::File,
            size: 1,
            ..Entry::default()
        };
        self.add(&e, &mut &[LANDMARK_CONTENTS][..])
    }

    /// Appends one entry: its header(s), and its data as chunk members.
    fn add(&mut self, e: &Entry, data: &mut dyn Read) -> Result<()> {
        if self.budget.aborted() {
            return Err(esgz("conversion aborted"));
        }
        let name = tar_name(e);
        push_header(&mut self.cur, e, &name)?;
        let uname = name_if_changed(&mut self.unames, e.uid, &e.uname);
        let gname = name_if_changed(&mut self.gnames, e.gid, &e.gname);
        let toc = toc_entry(e, name, uname, gname);
        if e.kind != EntryKind::File || e.size == 0 {
            let mut toc = toc;
            if e.kind == EntryKind::File {
                toc.digest = sha256_string(&Sha256::digest(b"").into());
            }
            self.recs.push(Rec {
                toc,
                member: None,
                digest_is_chunk: false,
            });
            if self.cur.len() >= MAX_HEADER_RUN {
                self.finish_member()?;
            }
            return Ok(());
        }
        // A non-empty regular file: its data starts a new member.
        self.finish_member()?;
        let size = e.size;
        let chunked = size > self.chunk_size;
        let mut file_hash = chunked.then(Sha256::new);
        let first_rec = self.recs.len();
        let mut first = Some(toc);
        let mut off = 0u64;
        while off < size {
            let n = (size - off).min(self.chunk_size);
            let last = off + n == size;
            let pad = if last {
                ((512 - size % 512) % 512) as usize
            } else {
                0
            };
            let mut buf = Vec::with_capacity(n as usize + pad + if last { 4096 } else { 0 });
            buf.resize(n as usize, 0);
            data.read_exact(&mut buf).map_err(|err| match err.kind() {
                io::ErrorKind::UnexpectedEof => Error::Tar {
                    entry: e.path.clone(),
                    offset: e.header_offset,
                    reason: format!("data ends after {off} of {size} bytes"),
                },
                _ => Error::Io(err),
            })?;
            if let Some(h) = file_hash.as_mut() {
                h.update(&buf);
            }
            buf.resize(n as usize + pad, 0);
            let chunk_field = if last { 0 } else { n as i64 };
            let toc = match first.take() {
                Some(mut t) => {
                    t.chunk_size = chunk_field;
                    t
                }
                None => TocEntry {
                    name: self.recs[first_rec].toc.name.clone(),
                    typ: "chunk".to_string(),
                    chunk_offset: off as i64,
                    chunk_size: chunk_field,
                    ..TocEntry::default()
                },
            };
            self.recs.push(Rec {
                toc,
                member: Some(self.members),
                digest_is_chunk: !chunked,
            });
            if last {
                self.cur = buf;
                self.cur_chunk = n as usize;
            } else {
                self.push_member(buf, n as usize)?;
            }
            off += n;
        }
        if let Some(h) = file_hash {
            self.recs[first_rec].toc.digest = sha256_string(&h.finalize().into());
        }
        Ok(())
    }

    /// Closes the member being filled (if any) and queues it.
    fn finish_member(&mut self) -> Result<()> {
        if self.cur.is_empty() {
            return Ok(());
        }
        let data = std::mem::take(&mut self.cur);
        let chunk = std::mem::take(&mut self.cur_chunk);
        self.push_member(data, chunk)
    }

    fn push_member(&mut self, data: Vec<u8>, chunk_len: usize) -> Result<()> {
        self.tar_bytes += data.len() as u64;
        self.job_bytes += data.len();
        self.job.push(Member { data, chunk_len });
        self.members += 1;
        if self.job_bytes >= JOB_TARGET || self.job.len() >= JOB_MAX_MEMBERS {
            self.submit()?;
        }
        Ok(())
    }

    /// Sends the queued members to the compressors as one job.
    fn submit(&mut self) -> Result<()> {
        if self.job.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.job_bytes) as u64;
        let members = std::mem::take(&mut self.job);
        if !self.budget.acquire(bytes) {
            return Err(esgz("conversion aborted"));
        }
        let seq = self.jobs;
        self.jobs += 1;
        let tx = self.tx.clone();
        let level = self.level;
        self.pool.spawn_fifo(move || {
            let res = compress_job(level, &members).map(|compressed| JobOut {
                compressed,
                raw: members,
                bytes,
            });
            let _ = tx.send(Msg::Job(seq, res));
        });
        Ok(())
    }
}

/// Counts and hashes what goes to the output (eStargz and zstd:chunked blobs).
pub(super) struct HashingWriter<W: Write> {
    pub(super) inner: BufWriter<W>,
    pub(super) hasher: Sha256,
    pub(super) n: u64,
}

impl<W: Write> HashingWriter<W> {
    /// A writer counting and hashing into `out`.
    pub(super) fn new(out: W) -> Self {
        HashingWriter {
            inner: BufWriter::with_capacity(WRITE_BUF, out),
            hasher: Sha256::new(),
            n: 0,
        }
    }

    pub(super) fn put(&mut self, data: &[u8]) -> Result<()> {
        self.inner.write_all(data)?;
        self.hasher.update(data);
        self.n += data.len() as u64;
        Ok(())
    }
}

/// Receives compressed jobs, writes them in order, then writes the TOC and the footer.
fn write_all<W: Write>(
    rx: Receiver<Msg>,
    out: W,
    budget: &Budget,
    level: u32,
) -> Result<EstargzOutput> {
    let mut out = HashingWriter::new(out);
    let mut diff = Sha256::new();
    let mut pending: BTreeMap<u64, Result<JobOut>> = BTreeMap::new();
    let mut next = 0u64;
    let mut offsets: Vec<u64> = Vec::new();
    let mut digests: Vec<Option<[u8; 32]>> = Vec::new();
    let mut done: Option<BuilderState> = None;
    let state = loop {
        if let Some(st) = done.take_if(|st| st.jobs == next) {
            break st;
        }
        let msg = rx
            .recv()
            .map_err(|_| esgz("internal error: the conversion pipeline stopped early"))?;
        match msg {
            Msg::Done(res) => done = Some(res?),
            Msg::Job(seq, res) => {
                pending.insert(seq, res);
                while let Some(res) = pending.remove(&next) {
                    let job = res?;
                    for ((gz, digest), raw) in job.compressed.iter().zip(&job.raw) {
                        offsets.push(out.n);
                        digests.push(*digest);
                        out.put(gz)?;
                        diff.update(&raw.data);
                    }
                    budget.release(job.bytes);
                    next += 1;
                }
            }
        }
    };

    let mut entries = Vec::with_capacity(state.recs.len());
    for rec in state.recs {
        let mut t = rec.toc;
        if let Some(m) = rec.member {
            let (Some(&off), Some(Some(d))) = (offsets.get(m), digests.get(m)) else {
                return Err(esgz("internal error: a chunk's member was not written"));
            };
            t.offset = off as i64;
            t.chunk_digest = sha256_string(d);
            if rec.digest_is_chunk {
                t.digest = t.chunk_digest.clone();
            }
        }
        entries.push(t);
    }
    let toc = JToc {
        version: 1,
        entries,
    };
    let mut json = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut json,
        serde_json::ser::PrettyFormatter::with_indent(b"\t"),
    );
    toc.serialize(&mut ser)
        .map_err(|e| esgz(format!("encoding the TOC: {e}")))?;
    drop(toc);
    let toc_digest = sha256_string(&Sha256::digest(&json).into());

    let mut toc_tar = Vec::with_capacity(json.len() + 2048);
    let toc_entry = Entry {
        path: TOC_TAR_NAME.to_string(),
        kind: EntryKind::File,
        size: json.len() as u64,
        ..Entry::default()
    };
    push_header(&mut toc_tar, &toc_entry, TOC_TAR_NAME)?;
    toc_tar.extend_from_slice(&json);
    pad_to_block(&mut toc_tar);
    toc_tar.resize(toc_tar.len() + 1024, 0);
    let toc_offset = out.n;
    out.put(&gzip(level, &toc_tar)?)?;
    diff.update(&toc_tar);
    out.put(&footer_bytes(toc_offset))?;
    out.inner.flush()?;
    Ok(EstargzOutput {
        digest: sha256_string(&out.hasher.finalize().into()),
        size: out.n,
        diff_id: sha256_string(&diff.finalize().into()),
        toc_digest,
        uncompressed_size: state.tar_bytes + toc_tar.len() as u64,
    })
}
