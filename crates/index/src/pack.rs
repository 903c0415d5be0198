//! Packing a directory straight into a layer that is lazy-loadable from birth.
//!
//! [`pack_dir`] walks a directory deterministically, writes it as a tar stream, and
//! compresses that stream as a sequence of *independent* gzip members, one per `span`
//! bytes of tar (the last one shorter), in parallel on all cores. The result is an
//! ordinary multi-member gzip that `gzip -dc`, `tar -xzf` and containerd accept, and
//! because every member starts with empty history, the ferry index for it needs no
//! inflate windows: checkpoint `k` is simply the start of member `k`. The index, the
//! blob digest and the diff_id all come out of the same single pass.
//!
//! ## Pipeline
//!
//! ```text
//!  caller thread            N workers                 writer thread
//!  walk + read files  ──►  gzip_compress(piece)  ──►  reorder, write, sha256(blob),
//!  into span pieces        sha256(member)             sha256(tar), checkpoints
//!        ▲                                                  │
//!        └────────────── free piece buffers ◄───────────────┘
//! ```
//!
//! A fixed number of piece buffers (`2 * N + 2`) circulates, so memory stays at a few
//! spans per worker whatever the directory size, and the walker can never run further
//! ahead of the output than that. File data is `read` straight into the piece buffers
//! (one `read` per file for files that fit, at most `span` bytes per `read` otherwise);
//! small files share pieces, nothing is flushed per file.
//!
//! ## Tar conventions
//!
//! GNU headers (long paths and link targets as GNU `L`/`K` extension members, as the
//! `tar` crate writes them), directories with a trailing `/`, paths relative without
//! `./`, no root entry, numeric ids only (uname/gname empty), whole-second mtimes
//! (negative mtimes clamp to 0). Hard links (regular files with `nlink > 1`, keyed by
//! `(dev, inode)`) become link entries to the first path seen in walk order. Sockets and
//! unknown file types are skipped with a warning. Extended attributes are kept as PAX `SCHILY.xattr.*` records (except
//! `trusted.overlay.*` and `security.selinux`). Names that are not UTF-8 are refused.

use std::collections::hash_map;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};

use libdeflater::{CompressionLvl, Compressor};
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use tar::{EntryType, Header};

use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};
use crate::ferryidx::{Checkpoint, Compression, LayerIndex};

/// Default uncompressed bytes per independent gzip member (= index span) for packed
/// layers. Packed members need no inflate windows, so a finer span costs the index only
/// 40 bytes per member: measured on /usr/lib/x86_64-linux-gnu (677 MiB), 256 KiB members
/// make the layer 0.44% larger than 1 MiB members at the same speed, and every random
/// read fetches a quarter as much (docs/benchmarks.md).
pub const DEFAULT_SPAN: u64 = 256 << 10;

/// Default libdeflate level, chosen by measurement on this project's 2-core build
/// machine, packing `/usr` (5.46 GB of tar, 134k entries) against
/// `tar -cf - /usr | gzip -6` (348 CPU-s, output 37.1% of the tar):
///
/// | level | CPU-s | output / tar |
/// |------:|------:|-------------:|
/// | 1     |  66   | 39.4%        |
/// | 2     |  87   | 38.2%        |
/// | 3     |  89   | 37.8%        |
/// | 4     |  96   | 37.6%        |
/// | 5     | 101   | 37.0%        |
/// | 6     | 112   | 36.8%        |
///
/// Levels 2–4 are libdeflate's greedy parser (one speed class); 4 is its best ratio,
/// within 1.3% of `gzip -6`, at 3.6x less CPU, so still ≥3x faster than `tar | gzip -6`
/// when the machine is too busy to give the workers more than one core, and ~7x when it
/// is idle. Level 6 would be only ~3x less CPU.
pub const DEFAULT_LEVEL: u32 = 4;

/// Smallest accepted span (one tar block).
pub const MIN_SPAN: u64 = 512;

/// Largest accepted span.
pub const MAX_SPAN: u64 = 1 << 30;

/// Most compression threads [`pack_dir`] starts, whatever [`PackOptions::threads`] says.
pub const MAX_THREADS: usize = 256;

/// How to pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackOptions {
    /// Uncompressed bytes per independent gzip member (= ferry index span), in
    /// [`MIN_SPAN`]`..=`[`MAX_SPAN`].
    pub span: u64,
    /// libdeflate compression level, 0..=12.
    pub level: u32,
    /// Compression threads; 0 = all cores. Memory use is about `(2 * threads + 2)`
    /// pieces of `span` bytes, plus their compressed copies.
    pub threads: usize,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            span: DEFAULT_SPAN,
            level: DEFAULT_LEVEL,
            threads: 0,
        }
    }
}

/// What [`pack_dir`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackOutput {
    /// The ferry index of the written blob.
    pub index: LayerIndex,
    /// `sha256:<hex>` of the uncompressed tar stream.
    pub diff_id: String,
    /// `sha256:<hex>` of the written (compressed) blob.
    pub digest: String,
    /// Size of the written blob in bytes.
    pub size: u64,
}

/// Packs `dir` into `out`. `progress` is called with the number of uncompressed bytes
/// produced so far (for a progress bar).
///
/// `out` receives a multi-member gzip of the tar of `dir`'s contents (`dir` itself has no
/// entry); the returned index describes exactly those bytes. The tar's two end-of-archive
/// blocks are the last 1024 bytes of the last span. `out` is written from a helper thread,
/// and `progress` is called from it after each member is written, with the tar bytes
/// written so far; its last call reports the whole tar size. On error, `out` may hold a
/// truncated blob. A file that shrinks while being read is an error; one that grows is cut
/// at the size it had when it was listed, as tar does.
pub fn pack_dir<W: Write + Send>(
    dir: &Path,
    out: W,
    opts: &PackOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<PackOutput> {
    if !(MIN_SPAN..=MAX_SPAN).contains(&opts.span) {
        return Err(invalid(format!(
            "span {} is outside {MIN_SPAN}..={MAX_SPAN}",
            opts.span
        )));
    }
    let level = i32::try_from(opts.level)
        .ok()
        .and_then(|l| CompressionLvl::new(l).ok())
        .ok_or_else(|| {
            invalid(format!(
                "compression level {} is outside 0..=12",
                opts.level
            ))
        })?;
    let md = fs::metadata(dir).map_err(|e| at(dir, e))?;
    if !md.is_dir() {
        return Err(at(
            dir,
            io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
        ));
    }
    let span = opts.span as usize;
    let threads = match opts.threads {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n.min(MAX_THREADS),
    };
    let slots = 2 * threads + 2;

    let (job_tx, job_rx) = mpsc::sync_channel::<Piece>(threads);
    // Shared by the workers only: when the last one exits, the walker's sends fail
    // instead of blocking forever.
    let job_rx = Arc::new(Mutex::new(job_rx));
    let (res_tx, res_rx) = mpsc::channel::<io::Result<Piece>>();
    let (free_tx, free_rx) = mpsc::channel::<Piece>();

    let (produced, written) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let res_tx = res_tx.clone();
                let job_rx = Arc::clone(&job_rx);
                s.spawn(move || compress_worker(&job_rx, res_tx, level))
            })
            .collect();
        drop(res_tx);
        drop(job_rx);
        let writer = s.spawn(move || write_members(out, res_rx, free_tx, progress));
        let sink = TarSink::new(span, slots, free_rx, job_tx);
        let produced = produce(dir, sink);
        let written = writer.join().unwrap_or_else(|_| Err(panicked("writer")));
        for w in workers {
            if w.join().is_err() {
                return (produced, Err(panicked("compression worker")));
            }
        }
        (produced, written)
    });
    // A failing writer makes the walker fail with a generic "pipeline stopped": report
    // the writer's error first. A failing walker makes the writer stop early but cleanly.
    let written = written?;
    let (entries, tar_size) = produced?;
    if written.uncompressed_size != tar_size {
        return Err(Error::Io(io::Error::other(format!(
            "pack pipeline lost data: produced {tar_size} tar bytes, wrote {}",
            written.uncompressed_size
        ))));
    }
    let digest = format!("sha256:{}", hex::encode(written.blob_digest));
    let index = LayerIndex {
        layer_digest: digest.clone(),
        compression: Compression::Gzip,
        compressed_size: written.compressed_size,
        uncompressed_size: written.uncompressed_size,
        span_size: opts.span,
        checkpoints: written.checkpoints,
        span_digests: written.span_digests,
        entries,
        windows: None,
        libraries: Vec::new(),
    };
    Ok(PackOutput {
        index,
        diff_id: format!("sha256:{}", hex::encode(written.diff_id)),
        digest,
        size: written.compressed_size,
    })
}

fn invalid(msg: String) -> Error {
    Error::Io(io::Error::new(io::ErrorKind::InvalidInput, msg))
}

fn panicked(what: &str) -> Error {
    Error::Io(io::Error::other(format!("pack: {what} thread panicked")))
}

fn at(path: &Path, e: io::Error) -> Error {
    Error::Io(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn pipeline_stopped() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "pack: compression pipeline stopped",
    )
}

/// One span of the tar stream on its way through the pipeline.
struct Piece {
    /// Position of this piece in the stream.
    seq: u64,
    /// Uncompressed bytes; `raw.len() == span`, only `raw[..len]` is meaningful.
    raw: Vec<u8>,
    len: usize,
    /// Compressed member; only `packed[..packed_len]` is meaningful.
    packed: Vec<u8>,
    packed_len: usize,
    /// SHA-256 of the compressed member.
    digest: [u8; 32],
}

// ---------------------------------------------------------------------------------------
// Producer: the tar stream, cut into pieces.

/// The `Write` the tar builder writes into: fills span-sized pieces and hands each full
/// one to the compression workers. Counts the stream position.
struct TarSink {
    span: usize,
    pos: u64,
    seq: u64,
    cur: Option<Piece>,
    allocated: usize,
    max_pieces: usize,
    free: Receiver<Piece>,
    jobs: SyncSender<Piece>,
}

impl TarSink {
    fn new(span: usize, max_pieces: usize, free: Receiver<Piece>, jobs: SyncSender<Piece>) -> Self {
        TarSink {
            span,
            pos: 0,
            seq: 0,
            cur: None,
            allocated: 0,
            max_pieces,
            free,
            jobs,
        }
    }

    /// The piece being filled, taking a free buffer (or waiting for one) if needed.
    fn current(&mut self) -> io::Result<&mut Piece> {
        if self.cur.is_none() {
            let mut piece = match self.free.try_recv() {
                Ok(p) => p,
                Err(_) if self.allocated < self.max_pieces => {
                    self.allocated += 1;
                    Piece {
                        seq: 0,
                        raw: vec![0; self.span],
                        len: 0,
                        packed: Vec::new(),
                        packed_len: 0,
                        digest: [0; 32],
                    }
                }
                Err(_) => self.free.recv().map_err(|_| pipeline_stopped())?,
            };
            piece.seq = self.seq;
            piece.len = 0;
            self.seq += 1;
            self.cur = Some(piece);
        }
        Ok(self.cur.as_mut().expect("just filled"))
    }

    /// Hands the current piece to the workers.
    fn ship(&mut self) -> io::Result<()> {
        if let Some(piece) = self.cur.take() {
            self.jobs.send(piece).map_err(|_| pipeline_stopped())?;
        }
        Ok(())
    }

    /// Accounts for `n` bytes just added to the current piece; ships it when full.
    fn advance(&mut self, n: usize) -> io::Result<()> {
        self.pos += n as u64;
        let full = match &mut self.cur {
            Some(p) => {
                p.len += n;
                p.len == self.span
            }
            None => false,
        };
        if full { self.ship() } else { Ok(()) }
    }

    fn write_zeros(&mut self, mut n: usize) -> io::Result<()> {
        while n > 0 {
            let piece = self.current()?;
            let k = n.min(piece.raw.len() - piece.len);
            piece.raw[piece.len..piece.len + k].fill(0);
            self.advance(k)?;
            n -= k;
        }
        Ok(())
    }

    /// Copies exactly `size` bytes of `file` into the stream, reading straight into the
    /// piece buffers.
    fn copy_file(&mut self, file: &mut File, size: u64, path: &Path) -> Result<()> {
        let mut left = size;
        while left > 0 {
            let piece = self.current()?;
            let room = piece.raw.len() - piece.len;
            let want = room.min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = match file.read(&mut piece.raw[piece.len..piece.len + want]) {
                Ok(0) => {
                    return Err(at(
                        path,
                        io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "file shrank while packing: {} of {size} bytes read",
                                size - left
                            ),
                        ),
                    ));
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(at(path, e)),
            };
            self.advance(n)?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Ships the last, partial piece; returns the total stream size.
    fn finish(mut self) -> io::Result<u64> {
        if self.cur.as_ref().is_some_and(|p| p.len > 0) {
            self.ship()?;
        }
        Ok(self.pos)
    }
}

impl Write for TarSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut data = buf;
        while !data.is_empty() {
            let piece = self.current()?;
            let k = data.len().min(piece.raw.len() - piece.len);
            piece.raw[piece.len..piece.len + k].copy_from_slice(&data[..k]);
            self.advance(k)?;
            data = &data[k..];
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A directory entry waiting to be packed: its normalized path and its `DirEntry`.
struct Pending {
    rel: String,
    dirent: fs::DirEntry,
}

/// Reads `abs`'s children, sorted by name bytes, onto `stack` so that they pop in order.
fn push_children(stack: &mut Vec<Pending>, parent: &str, abs: &Path) -> Result<()> {
    let mut children = Vec::new();
    for de in fs::read_dir(abs).map_err(|e| at(abs, e))? {
        let de = de.map_err(|e| at(abs, e))?;
        let name = de.file_name();
        let Some(name) = name.to_str() else {
            return Err(Error::Tar {
                entry: format!("{parent}/{}", name.to_string_lossy()),
                offset: 0,
                reason: "file name is not UTF-8".into(),
            });
        };
        let rel = if parent.is_empty() {
            name.to_string()
        } else {
            format!("{parent}/{name}")
        };
        children.push(Pending { rel, dirent: de });
    }
    // Descending, so that popping yields ascending name-byte order.
    children.sort_unstable_by(|a, b| {
        b.dirent
            .file_name()
            .as_bytes()
            .cmp(a.dirent.file_name().as_bytes())
    });
    stack.append(&mut children);
    Ok(())
}

/// Device major/minor from a Linux `dev_t` (glibc encoding).
fn dev_split(rdev: u64) -> (u32, u32) {
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// Header and entry fields common to every member kind.
fn base(rel: &str, md: &Metadata, kind: EntryKind) -> (Header, Entry) {
    let mode = md.mode() & 0o7777;
    let mtime = md.mtime().max(0);
    let mut h = Header::new_gnu();
    h.set_mode(mode);
    h.set_uid(u64::from(md.uid()));
    h.set_gid(u64::from(md.gid()));
    h.set_mtime(mtime as u64);
    h.set_size(0);
    h.set_entry_type(match kind {
        EntryKind::File => EntryType::Regular,
        EntryKind::Dir => EntryType::Directory,
        EntryKind::Symlink => EntryType::Symlink,
        EntryKind::Hardlink => EntryType::Link,
        EntryKind::Char => EntryType::Char,
        EntryKind::Block => EntryType::Block,
        EntryKind::Fifo => EntryType::Fifo,
    });
    let entry = Entry {
        path: rel.to_string(),
        kind,
        mode,
        uid: md.uid(),
        gid: md.gid(),
        mtime,
        ..Entry::default()
    };
    (h, entry)
}

/// Walks `dir` and writes its tar stream into `sink`; returns the file table and the
/// stream size.
/// Extended attributes of `path` (not following symlinks), as tar records them.
/// overlayfs' own `trusted.overlay.*` and SELinux labels describe the build host, not the
/// image, so they are left out, as container builders do. Unreadable or non-UTF-8 names
/// are skipped with a warning: losing an attribute must not fail a pack.
fn read_xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let names = match xattr::list(path) {
        Ok(n) => n,
        Err(e) => {
            if e.raw_os_error() != Some(95) {
                // 95 = EOPNOTSUPP: the filesystem has no xattrs at all.
                tracing::warn!(path = %path.display(), error = %e, "pack: cannot list xattrs");
            }
            return out;
        }
    };
    for name in names {
        let Some(key) = name.to_str() else {
            tracing::warn!(path = %path.display(), "pack: skipping a non-UTF-8 xattr name");
            continue;
        };
        if key.starts_with("trusted.overlay.") || key == "security.selinux" {
            continue;
        }
        match xattr::get(path, &name) {
            Ok(Some(v)) => {
                out.insert(key.to_string(), v);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), xattr = key, error = %e, "pack: cannot read xattr")
            }
        }
    }
    out
}

fn produce(dir: &Path, sink: TarSink) -> Result<(Vec<Entry>, u64)> {
    let mut builder = tar::Builder::new(sink);
    let mut entries = Vec::new();
    let mut links: HashMap<(u64, u64), String> = HashMap::new();
    let mut stack = Vec::new();
    push_children(&mut stack, "", dir)?;

    while let Some(Pending { rel, dirent }) = stack.pop() {
        let abs = dirent.path();
        let md = dirent.metadata().map_err(|e| at(&abs, e))?;
        let ft = md.file_type();
        let header_offset = builder.get_mut().pos;
        let tar_err = |reason: String| Error::Tar {
            entry: rel.clone(),
            offset: header_offset,
            reason,
        };
        // Errors of the sink (pipeline stopped) stay I/O errors; the rest are about the entry.
        let append_err = |e: io::Error| match e.kind() {
            io::ErrorKind::BrokenPipe => Error::Io(e),
            _ => tar_err(e.to_string()),
        };

        let mut file = None;
        let (mut h, mut entry) = if ft.is_dir() {
            base(&rel, &md, EntryKind::Dir)
        } else if ft.is_file() {
            let first = if md.nlink() > 1 {
                match links.entry((md.dev(), md.ino())) {
                    hash_map::Entry::Occupied(o) => Some(o.get().clone()),
                    hash_map::Entry::Vacant(v) => {
                        v.insert(rel.clone());
                        None
                    }
                }
            } else {
                None
            };
            match first {
                Some(target) => {
                    let (h, mut e) = base(&rel, &md, EntryKind::Hardlink);
                    e.link_target = target;
                    (h, e)
                }
                None => {
                    file = Some(File::open(&abs).map_err(|e| at(&abs, e))?);
                    let (mut h, mut e) = base(&rel, &md, EntryKind::File);
                    h.set_size(md.len());
                    e.size = md.len();
                    (h, e)
                }
            }
        } else if ft.is_symlink() {
            let target = fs::read_link(&abs).map_err(|e| at(&abs, e))?;
            let Some(target) = target.to_str() else {
                return Err(tar_err("symlink target is not UTF-8".into()));
            };
            let (h, mut e) = base(&rel, &md, EntryKind::Symlink);
            e.link_target = target.to_string();
            (h, e)
        } else if ft.is_char_device() || ft.is_block_device() {
            let kind = if ft.is_char_device() {
                EntryKind::Char
            } else {
                EntryKind::Block
            };
            let (mut h, mut e) = base(&rel, &md, kind);
            let (major, minor) = dev_split(md.rdev());
            h.set_device_major(major)
                .map_err(|e| tar_err(e.to_string()))?;
            h.set_device_minor(minor)
                .map_err(|e| tar_err(e.to_string()))?;
            e.dev_major = major;
            e.dev_minor = minor;
            (h, e)
        } else if ft.is_fifo() {
            base(&rel, &md, EntryKind::Fifo)
        } else {
            tracing::warn!(path = %abs.display(), "pack: skipping socket or unknown file type");
            continue;
        };

        entry.xattrs = read_xattrs(&abs);
        if !entry.xattrs.is_empty() {
            let records: Vec<(String, &[u8])> = entry
                .xattrs
                .iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
                .collect();
            builder
                .append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
                .map_err(append_err)?;
        }
        if !entry.link_target.is_empty() {
            let target = entry.link_target.as_bytes();
            if h.set_link_name_literal(target).is_err() {
                // Too long for the header (or NUL inside, refused just below): a GNU `K`
                // member carries the raw target, as GNU tar and the tar crate write it.
                if target.contains(&0) {
                    return Err(tar_err("link target contains a NUL byte".into()));
                }
                let mut k = Header::new_gnu();
                k.as_gnu_mut().expect("gnu header").name[..13].copy_from_slice(b"././@LongLink");
                k.set_mode(0o644);
                k.set_uid(0);
                k.set_gid(0);
                k.set_mtime(0);
                k.set_size(target.len() as u64 + 1);
                k.set_entry_type(EntryType::GNULongLink);
                k.set_cksum();
                builder
                    .append(&k, target.chain(&[0u8][..]))
                    .map_err(append_err)?;
            }
        }
        let name = if entry.kind == EntryKind::Dir {
            format!("{rel}/")
        } else {
            rel.clone()
        };
        // An empty reader: the builder writes only the header blocks (and a GNU `L`
        // member for long names); file data is copied below, straight into the pieces.
        builder
            .append_data(&mut h, &name, io::empty())
            .map_err(append_err)?;
        entry.header_offset = header_offset;
        if let Some(mut f) = file {
            let sink = builder.get_mut();
            entry.offset = sink.pos;
            sink.copy_file(&mut f, entry.size, &abs)?;
            let pad = (512 - (entry.size % 512) as usize) % 512;
            sink.write_zeros(pad)?;
        }
        let is_dir = entry.kind == EntryKind::Dir;
        entries.push(entry);
        if is_dir {
            push_children(&mut stack, &rel, &abs)?;
        }
    }
    let sink = builder.into_inner()?; // appends the two zero blocks
    let size = sink.finish()?;
    Ok((entries, size))
}

// ---------------------------------------------------------------------------------------
// Workers and writer.

fn compress_worker(
    jobs: &Mutex<Receiver<Piece>>,
    results: Sender<io::Result<Piece>>,
    level: CompressionLvl,
) {
    let mut compressor = Compressor::new(level);
    loop {
        let job = {
            let rx = jobs.lock();
            rx.recv()
        };
        let Ok(mut piece) = job else { return };
        let bound = compressor.gzip_compress_bound(piece.len);
        if piece.packed.len() < bound {
            piece.packed.resize(bound, 0);
        }
        let res = match compressor.gzip_compress(&piece.raw[..piece.len], &mut piece.packed) {
            Ok(n) => {
                piece.packed_len = n;
                piece.digest = Sha256::digest(&piece.packed[..n]).into();
                Ok(piece)
            }
            Err(e) => Err(io::Error::other(format!("libdeflate gzip_compress: {e:?}"))),
        };
        let failed = res.is_err();
        if results.send(res).is_err() || failed {
            return;
        }
    }
}

struct Written {
    blob_digest: [u8; 32],
    diff_id: [u8; 32],
    compressed_size: u64,
    uncompressed_size: u64,
    checkpoints: Vec<Checkpoint>,
    span_digests: Vec<[u8; 32]>,
}

fn write_members<W: Write>(
    mut out: W,
    results: Receiver<io::Result<Piece>>,
    free: Sender<Piece>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Written> {
    let mut pending: BTreeMap<u64, Piece> = BTreeMap::new();
    let mut next = 0u64;
    let mut blob = Sha256::new();
    let mut tar = Sha256::new();
    let mut w = Written {
        blob_digest: [0; 32],
        diff_id: [0; 32],
        compressed_size: 0,
        uncompressed_size: 0,
        checkpoints: Vec::new(),
        span_digests: Vec::new(),
    };
    for res in results {
        let piece = res?;
        pending.insert(piece.seq, piece);
        while let Some(piece) = pending.remove(&next) {
            let member = &piece.packed[..piece.packed_len];
            out.write_all(member)?;
            blob.update(member);
            tar.update(&piece.raw[..piece.len]);
            w.checkpoints.push(Checkpoint {
                in_offset: w.compressed_size,
                bits: 0,
                out_offset: w.uncompressed_size,
                member_start: true,
                window_deflate: Vec::new(),
                window: None,
            });
            w.span_digests.push(piece.digest);
            w.compressed_size += piece.packed_len as u64;
            w.uncompressed_size += piece.len as u64;
            next += 1;
            progress(w.uncompressed_size);
            // The walker may be done already; then the buffer is simply dropped.
            let _ = free.send(piece);
        }
    }
    out.flush()?;
    if !pending.is_empty() {
        return Err(Error::Io(io::Error::other(format!(
            "pack: member {next} never arrived ({} later ones did)",
            pending.len()
        ))));
    }
    w.blob_digest = blob.finalize().into();
    w.diff_id = tar.finalize().into();
    Ok(w)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::process::Command;
    use std::time::{Duration, SystemTime};

    const SPAN: u64 = 64 << 10;

    /// Deterministic bytes: half incompressible noise, half text, so members vary in size.
    fn data(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut v = Vec::with_capacity(len);
        while v.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (v.len() / 4096) % 2 == 0 {
                v.extend_from_slice(&x.to_le_bytes());
            } else {
                v.extend_from_slice(format!("line {} of seed {seed}\n", v.len()).as_bytes());
            }
        }
        v.truncate(len);
        v
    }

    fn write(path: &Path, bytes: &[u8], mode: u32, mtime: u64) {
        fs::write(path, bytes).unwrap();
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(mtime))
            .unwrap();
    }

    /// A tree with every kind of member ferry packs, plus a socket it must skip.
    fn make_tree(root: &Path) {
        let s = SPAN as usize;
        let sizes = [
            0,
            1,
            511,
            512,
            513,
            s - 1,
            s,
            s + 1,
            3 * s + s / 2,
            10 * s + 7,
        ];
        for (i, &n) in sizes.iter().enumerate() {
            write(
                &root.join(format!("f{i:02}_{n}")),
                &data(n, i as u64),
                0o644,
                1_600_000_000 + i as u64,
            );
        }
        fs::create_dir_all(root.join("a/b/c")).unwrap();
        fs::create_dir(root.join("empty")).unwrap();
        write(
            &root.join("a/b/c/deep.txt"),
            b"deep\n",
            0o600,
            1_500_000_000,
        );
        write(
            &root.join("a/setuid"),
            &data(1000, 99),
            0o4755,
            1_500_000_001,
        );
        write(
            &root.join("a/ünï cødé.txt"),
            b"utf-8 name\n",
            0o640,
            1_500_000_002,
        );
        write(
            &root.join("a.txt"),
            b"sorts after a/ by bytes? no: '.' < '/'\n",
            0o644,
            1,
        );
        fs::set_permissions(root.join("a/b"), fs::Permissions::from_mode(0o1777)).unwrap();
        fs::set_permissions(root.join("a/b/c"), fs::Permissions::from_mode(0o700)).unwrap();

        symlink("f01_1", root.join("link_rel")).unwrap();
        symlink("/etc/passwd", root.join("link_abs")).unwrap();
        symlink("does/not/exist", root.join("link_dangling")).unwrap();
        symlink("./odd//target/.", root.join("link_odd")).unwrap();
        symlink("t".repeat(150), root.join("link_long")).unwrap();
        symlink("a", root.join("link_dir")).unwrap();

        fs::create_dir(root.join("hl")).unwrap();
        write(&root.join("hl/a"), &data(70_000, 7), 0o644, 1_400_000_000);
        fs::hard_link(root.join("hl/a"), root.join("hl/b")).unwrap();
        fs::hard_link(root.join("hl/a"), root.join("z_hard")).unwrap();

        let st = Command::new("mkfifo")
            .arg(root.join("a/fifo"))
            .status()
            .unwrap();
        assert!(st.success());
        // Devices need CAP_MKNOD; test them when we have it.
        let _ = Command::new("mknod")
            .arg(root.join("a/null"))
            .args(["c", "1", "3"])
            .status();
        let _ = Command::new("mknod")
            .arg(root.join("a/blk"))
            .args(["b", "7", "200"])
            .status();
        let _sock = std::os::unix::net::UnixListener::bind(root.join("a/sock")).unwrap();

        let long_name = "n".repeat(200);
        write(&root.join(&long_name), b"long name\n", 0o644, 2);
        let deep = root.join("d".repeat(120)).join("e".repeat(120));
        fs::create_dir_all(&deep).unwrap();
        write(&deep.join("f".repeat(60)), &data(5000, 3), 0o644, 3);
        fs::hard_link(deep.join("f".repeat(60)), root.join("z_hard_long")).unwrap();
        symlink("x".repeat(300), deep.join("long_link")).unwrap();
    }

    fn pack(dir: &Path, opts: &PackOptions) -> (Vec<u8>, PackOutput) {
        let mut out = Vec::new();
        let last = std::sync::atomic::AtomicU64::new(0);
        let res = pack_dir(dir, &mut out, opts, &|n| {
            assert!(n >= last.load(std::sync::atomic::Ordering::Relaxed));
            last.store(n, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(last.into_inner(), res.index.uncompressed_size);
        (out, res)
    }

    fn gunzip(gz: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        flate2::read::MultiGzDecoder::new(gz)
            .read_to_end(&mut v)
            .unwrap();
        v
    }

    fn sha(b: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(b)))
    }

    fn opts(span: u64, threads: usize) -> PackOptions {
        PackOptions {
            span,
            level: 6,
            threads,
        }
    }

    /// Checks that the index describes `gz` exactly; returns the tar stream.
    fn check_index(gz: &[u8], out: &PackOutput) -> Vec<u8> {
        let idx = &out.index;
        let tar = gunzip(gz);
        assert_eq!(out.size, gz.len() as u64);
        assert_eq!(idx.compressed_size, gz.len() as u64);
        assert_eq!(idx.uncompressed_size, tar.len() as u64);
        assert_eq!(out.digest, sha(gz));
        assert_eq!(idx.layer_digest, out.digest);
        assert_eq!(out.diff_id, sha(&tar));
        assert_eq!(idx.compression, Compression::Gzip);
        let span = idx.span_size;
        let n = tar.len().div_ceil(span as usize);
        assert_eq!(idx.checkpoints.len(), n);
        assert_eq!(idx.span_digests.len(), n);
        let mut joined = Vec::new();
        for k in 0..n {
            let cp = &idx.checkpoints[k];
            assert_eq!(
                (cp.bits, cp.member_start, cp.window_deflate.len()),
                (0, true, 0)
            );
            assert_eq!(cp.out_offset, k as u64 * span);
            let r = idx.span_range(k).unwrap();
            assert_eq!(r.start, cp.in_offset);
            let member = &gz[r.start as usize..r.end as usize];
            assert_eq!(Sha256::digest(member).as_slice(), &idx.span_digests[k][..]);
            // Independently decompressible, and exactly one member of exactly one span.
            let mut one = Vec::new();
            let mut dec = flate2::read::GzDecoder::new(member);
            dec.read_to_end(&mut one).unwrap();
            assert_eq!(gunzip(member), one, "span {k} holds more than one member");
            let want = if k + 1 < n {
                span
            } else {
                tar.len() as u64 - k as u64 * span
            };
            assert_eq!(one.len() as u64, want, "span {k}");
            assert_eq!(idx.span_for(cp.out_offset), Some(k));
            joined.extend_from_slice(&one);
        }
        assert_eq!(joined, tar);
        // The end-of-archive blocks close the stream.
        assert!(tar.len() >= 1024 && tar[tar.len() - 1024..].iter().all(|&b| b == 0));
        tar
    }

    /// What the tar crate reads from `tar`, as entries, plus each member's end offset.
    fn tar_crate_entries(tar: &[u8]) -> Vec<(Entry, u64)> {
        let mut ar = tar::Archive::new(tar);
        let mut v = Vec::new();
        for e in ar.entries().unwrap() {
            let e = e.unwrap();
            let h = e.header();
            let kind = match h.entry_type() {
                EntryType::Regular => EntryKind::File,
                EntryType::Directory => EntryKind::Dir,
                EntryType::Symlink => EntryKind::Symlink,
                EntryType::Link => EntryKind::Hardlink,
                EntryType::Char => EntryKind::Char,
                EntryType::Block => EntryKind::Block,
                EntryType::Fifo => EntryKind::Fifo,
                t => panic!("unexpected entry type {t:?}"),
            };
            let path = String::from_utf8(e.path_bytes().into_owned()).unwrap();
            let dev = matches!(kind, EntryKind::Char | EntryKind::Block);
            let entry = Entry {
                path: path.trim_end_matches('/').to_string(),
                kind,
                mode: h.mode().unwrap() & 0o7777,
                uid: h.uid().unwrap() as u32,
                gid: h.gid().unwrap() as u32,
                mtime: h.mtime().unwrap() as i64,
                size: if kind == EntryKind::File { e.size() } else { 0 },
                offset: if kind == EntryKind::File {
                    e.raw_file_position()
                } else {
                    0
                },
                link_target: e
                    .link_name_bytes()
                    .map(|b| String::from_utf8(b.into_owned()).unwrap())
                    .unwrap_or_default(),
                dev_major: if dev {
                    h.device_major().unwrap().unwrap()
                } else {
                    0
                },
                dev_minor: if dev {
                    h.device_minor().unwrap().unwrap()
                } else {
                    0
                },
                ..Entry::default()
            };
            let end = e.raw_header_position() + 512 + e.size().div_ceil(512) * 512;
            v.push((entry, end));
        }
        v
    }

    fn run(cmd: &mut Command) -> String {
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// (path, kind, mode, size, content/target, mtime) of every object below `root`.
    fn snapshot(root: &Path) -> Vec<(String, String, u32, Vec<u8>, i64)> {
        let mut v = Vec::new();
        let mut stack = vec![String::new()];
        while let Some(rel) = stack.pop() {
            let abs = if rel.is_empty() {
                root.to_path_buf()
            } else {
                root.join(&rel)
            };
            for de in fs::read_dir(&abs).unwrap() {
                let de = de.unwrap();
                let name = de.file_name().into_string().unwrap();
                let r = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                let md = de.metadata().unwrap();
                let ft = md.file_type();
                let (kind, body) = if ft.is_dir() {
                    stack.push(r.clone());
                    ("dir", Vec::new())
                } else if ft.is_file() {
                    ("file", fs::read(de.path()).unwrap())
                } else if ft.is_symlink() {
                    (
                        "symlink",
                        fs::read_link(de.path())
                            .unwrap()
                            .into_os_string()
                            .into_vec(),
                    )
                } else if ft.is_fifo() {
                    ("fifo", Vec::new())
                } else if ft.is_char_device() || ft.is_block_device() {
                    ("dev", md.rdev().to_le_bytes().to_vec())
                } else {
                    continue; // sockets are not packed
                };
                let mtime = if kind == "symlink" { 0 } else { md.mtime() };
                let mode = if kind == "symlink" {
                    0
                } else {
                    md.mode() & 0o7777
                };
                v.push((r, kind.to_string(), mode, body, mtime));
            }
        }
        v.sort();
        v
    }

    use std::os::unix::ffi::OsStringExt;

    #[test]
    fn pack_tree_round_trips() {
        let src = tempfile::tempdir().unwrap();
        make_tree(src.path());
        let (gz, out) = pack(src.path(), &opts(SPAN, 0));
        let tmp = tempfile::tempdir().unwrap();
        let blob = tmp.path().join("layer.tar.gz");
        fs::write(&blob, &gz).unwrap();

        // (1) system tools accept it; extraction equals the source tree.
        run(Command::new("gzip").arg("-t").arg(&blob));
        let listing = run(Command::new("tar").arg("-tzvf").arg(&blob));
        assert!(listing.contains(&"n".repeat(200)), "{listing}");
        assert!(listing.contains("hl/b link to hl/a"), "{listing}");
        let dest = tmp.path().join("x");
        fs::create_dir(&dest).unwrap();
        run(Command::new("tar")
            .arg("-xzf")
            .arg(&blob)
            .arg("-C")
            .arg(&dest));
        assert_eq!(snapshot(&dest), snapshot(src.path()));
        use std::os::unix::fs::MetadataExt as _;
        let ino = |p: &str| fs::metadata(dest.join(p)).unwrap().ino();
        assert_eq!(ino("hl/a"), ino("hl/b"));
        assert_eq!(ino("hl/a"), ino("z_hard"));

        // (2) checkpoints and span digests match independent members.
        let tar = check_index(&gz, &out);
        assert!(
            out.index.checkpoints.len() > 15,
            "{}",
            out.index.checkpoints.len()
        );

        // (3) every file's offset points at its bytes.
        let entries = &out.index.entries;
        for e in entries.iter().filter(|e| e.is_file()) {
            let want = fs::read(src.path().join(&e.path)).unwrap();
            assert_eq!(e.size, want.len() as u64, "{}", e.path);
            assert_eq!(
                &tar[e.offset as usize..][..want.len()],
                &want[..],
                "{}",
                e.path
            );
        }

        // (4) the entries are what a tar reader sees, and member boundaries chain up.
        let theirs = tar_crate_entries(&tar);
        assert_eq!(theirs.len(), entries.len());
        let mut expect_header = 0;
        for (ours, (theirs, end)) in entries.iter().zip(&theirs) {
            assert_eq!(ours.header_offset, expect_header, "{}", ours.path);
            let mut ours_cmp = ours.clone();
            ours_cmp.header_offset = 0;
            assert_eq!(&ours_cmp, theirs);
            expect_header = *end;
        }
        assert_eq!(expect_header + 1024, tar.len() as u64);
        // ... and exactly what ferry's own tar walker reads back.
        assert_eq!(&crate::tarwalk::walk(&tar[..]).unwrap(), entries);
        // The index passes ferry's validation and survives encoding.
        out.index.validate().unwrap();
        assert_eq!(
            LayerIndex::decode(&out.index.encode().unwrap()).unwrap(),
            out.index
        );

        // Walk order, kinds and link targets.
        let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
        let mut sorted = paths.clone();
        sorted.sort_by(|a, b| {
            a.split('/')
                .map(str::as_bytes)
                .cmp(b.split('/').map(str::as_bytes))
        });
        assert_eq!(
            paths, sorted,
            "parents before children, siblings by name bytes"
        );
        assert!(!paths.contains(&"a/sock"));
        let get = |p: &str| entries.iter().find(|e| e.path == p).unwrap();
        assert_eq!(get("hl/a").kind, EntryKind::File);
        assert_eq!(
            (get("hl/b").kind, get("hl/b").link_target.as_str()),
            (EntryKind::Hardlink, "hl/a")
        );
        assert_eq!(get("z_hard").link_target, "hl/a");
        assert_eq!(get("z_hard_long").kind, EntryKind::Hardlink);
        assert_eq!(get("link_odd").link_target, "./odd//target/.");
        assert_eq!(get("link_long").link_target, "t".repeat(150));
        assert_eq!(get("a/fifo").kind, EntryKind::Fifo);
        assert_eq!(get("a/setuid").mode, 0o4755);
        assert_eq!(get("a/b").mode, 0o1777);
        assert_eq!(get("f00_0").mtime, 1_600_000_000);
        if let Some(null) = entries.iter().find(|e| e.path == "a/null") {
            assert_eq!(
                (null.kind, null.dev_major, null.dev_minor),
                (EntryKind::Char, 1, 3)
            );
            let blk = get("a/blk");
            assert_eq!(
                (blk.kind, blk.dev_major, blk.dev_minor),
                (EntryKind::Block, 7, 200)
            );
        }

        // (5) determinism, whatever the thread count.
        for threads in [1, 3] {
            let (gz2, out2) = pack(src.path(), &opts(SPAN, threads));
            assert!(gz2 == gz, "threads={threads}: output differs");
            assert_eq!(out2, out);
        }
    }

    #[test]
    fn pack_span_edge_cases() {
        let src = tempfile::tempdir().unwrap();
        write(&src.path().join("x"), &data(3000, 1), 0o644, 5);
        write(&src.path().join("y"), b"", 0o644, 5);
        // Minimal span: every tar stream is a whole number of spans, the last one full.
        let (gz, out) = pack(src.path(), &opts(MIN_SPAN, 2));
        let tar = check_index(&gz, &out);
        assert_eq!(tar.len() % 512, 0);
        assert_eq!(out.index.checkpoints.len(), tar.len() / 512);
        // One span for everything.
        let (gz, out) = pack(src.path(), &opts(MAX_SPAN, 0));
        check_index(&gz, &out);
        assert_eq!(out.index.checkpoints.len(), 1);
        // Default options and levels 0 (stored) and 12.
        for o in [
            PackOptions::default(),
            PackOptions {
                level: 0,
                ..PackOptions::default()
            },
            PackOptions {
                level: 12,
                ..PackOptions::default()
            },
        ] {
            let (gz, out) = pack(src.path(), &o);
            check_index(&gz, &out);
        }
    }

    #[test]
    fn pack_keeps_xattrs() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("capable");
        fs::write(&f, b"x").unwrap();
        if let Err(e) = xattr::set(&f, "user.ferry", b"v1\0bin") {
            eprintln!("skipping: this filesystem has no user xattrs ({e})");
            return;
        }
        let (gz, out) = pack(dir.path(), &opts(64 << 10, 1));
        let e = out
            .index
            .entries
            .iter()
            .find(|e| e.path == "capable")
            .unwrap();
        assert_eq!(
            e.xattrs.get("user.ferry").map(|v| v.as_slice()),
            Some(&b"v1\0bin"[..])
        );
        let walked = crate::tarwalk::walk(&gunzip(&gz)[..]).unwrap();
        let w = walked.iter().find(|e| e.path == "capable").unwrap();
        assert_eq!(
            w, e,
            "the tar must carry the xattr exactly as the index records it"
        );
    }

    #[test]
    fn pack_empty_dir() {
        let src = tempfile::tempdir().unwrap();
        let (gz, out) = pack(src.path(), &PackOptions::default());
        let tar = check_index(&gz, &out);
        assert_eq!(tar, vec![0; 1024]);
        assert!(out.index.entries.is_empty());
    }

    #[test]
    fn pack_rejects_bad_input() {
        let src = tempfile::tempdir().unwrap();
        let bad = |o: PackOptions| pack_dir(src.path(), Vec::new(), &o, &|_| {}).is_err();
        assert!(bad(PackOptions {
            span: 100,
            ..PackOptions::default()
        }));
        assert!(bad(PackOptions {
            span: MAX_SPAN + 1,
            ..PackOptions::default()
        }));
        assert!(bad(PackOptions {
            level: 13,
            ..PackOptions::default()
        }));
        let missing = src.path().join("missing");
        assert!(pack_dir(&missing, Vec::new(), &PackOptions::default(), &|_| {}).is_err());
        let file = src.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(pack_dir(&file, Vec::new(), &PackOptions::default(), &|_| {}).is_err());
        // A name that is not UTF-8 is refused, not mangled.
        let odd = src.path().join(std::ffi::OsStr::from_bytes(b"bad\xff"));
        fs::write(odd, b"x").unwrap();
        let err = pack_dir(src.path(), Vec::new(), &PackOptions::default(), &|_| {}).unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{err}");
    }

    /// Throughput/size measurement on a real directory (not run by default):
    /// `FERRY_PACK_DIR=/usr FERRY_PACK_LEVELS=1,2,3,4,5,6 cargo test --release -p ferry-index
    /// --lib pack::tests::measure_pack -- --ignored --nocapture`
    #[test]
    #[ignore = "measurement; needs FERRY_PACK_DIR"]
    fn measure_pack() {
        let dir = std::env::var("FERRY_PACK_DIR").unwrap();
        let levels = std::env::var("FERRY_PACK_LEVELS").unwrap_or_else(|_| "1,6".into());
        let span = std::env::var("FERRY_PACK_SPAN").map_or(DEFAULT_SPAN, |s| s.parse().unwrap());
        let threads = std::env::var("FERRY_PACK_THREADS").map_or(0, |s| s.parse().unwrap());
        for level in levels.split(',') {
            let o = PackOptions {
                span,
                level: level.parse().unwrap(),
                threads,
            };
            let t = std::time::Instant::now();
            let out = pack_dir(Path::new(&dir), io::sink(), &o, &|_| {}).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let raw = out.index.uncompressed_size;
            println!(
                "level {level:>2}: tar {raw} B, out {} B, ratio {:.4}, {secs:.2} s, {:.0} MB/s, {} entries",
                out.size,
                out.size as f64 / raw as f64,
                raw as f64 / secs / 1e6,
                out.index.entries.len()
            );
        }
    }

    /// A sink that fails after `left` bytes.
    struct Failing {
        left: usize,
    }

    impl Write for Failing {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if buf.len() > self.left {
                return Err(io::Error::other("disk full"));
            }
            self.left -= buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn pack_writer_error_stops_pipeline() {
        let src = tempfile::tempdir().unwrap();
        for i in 0..40 {
            write(
                &src.path().join(format!("f{i}")),
                &data(50_000, i),
                0o644,
                5,
            );
        }
        for threads in [1, 2, 4] {
            let o = PackOptions {
                span: 4096,
                level: 1,
                threads,
            };
            let err = pack_dir(src.path(), Failing { left: 10_000 }, &o, &|_| {}).unwrap_err();
            assert!(err.to_string().contains("disk full"), "{err}");
        }
    }
}
