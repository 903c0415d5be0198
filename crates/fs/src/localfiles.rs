//! Per-mount policy for files that are fully local: which opens go through FUSE
//! passthrough or a cached file, when a file is handed to the [`FileCache`] to be
//! materialized, and the per-inode open state the kernel's passthrough rules need.
//!
//! The kernel refuses to mix modes on one inode: while any handle of an inode is open
//! in cached (page cache, FUSE read) mode a passthrough open fails, and the other way
//! round. So the first open of an inode decides its mode and every open until the last
//! release follows it; the passthrough backing id is shared by those opens and closed
//! after the last release.
//!
//! Recording a startup trace: reads served by passthrough never reach this process, so
//! while the mount records every read ([`MountedImage::records_every_read`], `ferry
//! trace record`) a cached file is opened in cached mode (served with pread, every read
//! noted) instead. An inode that is already in passthrough mode when the recording
//! starts cannot switch (the kernel would refuse the open), so its opens are recorded as
//! a read of the whole file: the trace then holds at least what was read, which is what
//! prefetch needs. A passive recording (the daemon's automatic one) changes nothing
//! here: a passthrough open is noted as a read of the whole file.
//!
//! This module must not read layer bytes in a FUSE request
//! (materialization is queued to the cache's background worker) nor talk to the kernel
//! (the transport passes in how to register a backing file).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferry_index::merged::Location;
use ferry_index::reader::LayerFormat;
use ferry_store::ChunkKey;
use parking_lot::{Mutex, RwLock};

use crate::filecache::{CachedFile, FileCache, FileKey, Materialize};
use crate::image::MountedImage;
use crate::image::tree::{Ino, Node, NodeKind};

/// Most inodes whose read-in-full progress is tracked at once (then the tracking
/// restarts; a missed materialization is only a missed optimisation).
const MAX_TRACKED: usize = 4096;

/// Longest an open waits for its file while a put writes it to the cache: writing a
/// few MiB takes tens of milliseconds; past this the open is served through FUSE.
const WAIT_FOR_WRITE: std::time::Duration = std::time::Duration::from_millis(200);

/// How an open is answered.
#[derive(Debug)]
pub(crate) enum OpenMode<B> {
    /// Through the FUSE read path (from a cached file with pread when one was found).
    Served(u64),
    /// Through passthrough with this backing id.
    Passthrough(u64, Arc<B>),
}

/// Open state of one inode.
#[derive(Debug)]
struct InodeOpens<B> {
    opens: usize,
    backing: Option<Arc<B>>,
}

/// The local-files state of one mount. `B` is the transport's backing-file handle
/// (fuser's `BackingId`), closed when dropped.
#[derive(Debug)]
pub(crate) struct LocalFiles<B> {
    cache: Arc<FileCache>,
    image: Arc<MountedImage>,
    /// Negotiated at init and not refused since.
    passthrough: AtomicBool,
    warned: AtomicBool,
    next_fh: AtomicU64,
    handles: RwLock<HashMap<u64, Arc<CachedFile>>>,
    inodes: Mutex<HashMap<Ino, InodeOpens<B>>>,
    read_bytes: Mutex<HashMap<Ino, u64>>,
    eager_tried: Mutex<HashSet<Ino>>,
}

impl<B> LocalFiles<B> {
    pub(crate) fn new(cache: Arc<FileCache>, image: Arc<MountedImage>) -> LocalFiles<B> {
        LocalFiles {
            cache,
            image,
            passthrough: AtomicBool::new(false),
            warned: AtomicBool::new(false),
            next_fh: AtomicU64::new(1),
            handles: RwLock::new(HashMap::new()),
            inodes: Mutex::new(HashMap::new()),
            read_bytes: Mutex::new(HashMap::new()),
            eager_tried: Mutex::new(HashSet::new()),
        }
    }

    pub(crate) fn cache(&self) -> &Arc<FileCache> {
        &self.cache
    }

    /// Whether passthrough should be asked of the kernel at init.
    pub(crate) fn wants_passthrough(&self) -> bool {
        self.cache.config().passthrough
    }

    pub(crate) fn set_passthrough(&self, on: bool) {
        self.passthrough.store(on, Ordering::Relaxed);
    }

    pub(crate) fn passthrough(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// The smallest file this mount ever caches; smaller ones skip all bookkeeping.
    fn min_bytes(&self) -> u64 {
        let c = self.cache.config();
        match c.eager_min_bytes {
            0 => c.min_file_bytes,
            e => e.min(c.min_file_bytes),
        }
        .max(1)
    }

    /// True when `node` can ever be served from the cache.
    fn eligible(&self, node: &Node) -> Option<Location> {
        (node.kind == NodeKind::File && node.size >= self.min_bytes())
            .then_some(node.data)
            .flatten()
    }

    /// The small-file pack's key for `node`, when the pack is on and takes it: a regular
    /// file under `min_file_bytes` (bigger ones go to the file cache) of a layer that is
    /// not held whole in memory.
    pub(crate) fn pack_key(&self, node: &Node) -> Option<FileKey> {
        self.cache.pack()?;
        if node.kind != NodeKind::File
            || node.size == 0
            || node.size >= self.cache.config().min_file_bytes
        {
            return None;
        }
        let loc = node.data?;
        let layer = self.image.image.layers().get(loc.layer)?;
        if matches!(layer.format(), LayerFormat::Whole { .. }) {
            return None;
        }
        self.key(loc, node.size)
    }

    /// Reads file `key` from the small-file pack; `None` when it is not there.
    pub(crate) fn read_packed(&self, key: &FileKey, offset: u64, buf: &mut [u8]) -> Option<usize> {
        self.cache.pack()?.read_at(key, offset, buf)
    }

    /// Keeps `data`, read at `offset` of `node`, in the small-file pack when it is the
    /// whole file (a small file is read whole at once: the kernel's readahead asks for
    /// all of it).
    pub(crate) fn pack_whole(&self, key: &FileKey, node: &Node, offset: u64, data: &[u8]) {
        if offset == 0
            && data.len() as u64 == node.size
            && let Some(pack) = self.cache.pack()
        {
            pack.put(key, data);
        }
    }

    /// The cache key of the file at `loc`.
    pub(crate) fn key(&self, loc: Location, size: u64) -> Option<FileKey> {
        file_key(&self.image, loc, size)
    }

    /// Notes an open whose reads will not reach this process (passthrough) as a read of
    /// the whole file.
    fn note_whole(&self, ino: Ino, node: &Node) {
        self.image.recorder.note(
            self.image.recorder_view,
            &self.image.tree,
            ino,
            0,
            node.size,
        );
    }

    /// Opens regular file `ino`; `register` turns a cached file into a backing id.
    pub(crate) fn open(
        &self,
        ino: Ino,
        node: &Node,
        register: impl FnOnce(&File) -> io::Result<B>,
    ) -> OpenMode<B> {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let Some(loc) = self.eligible(node) else {
            return OpenMode::Served(fh);
        };
        let key = self.key(loc, node.size);
        let recording = self.image.is_recording();
        let every_read = self.image.records_every_read();
        if let Some(k) = &key
            && !every_read
        {
            // When prefetch is writing it just ahead of us, a short wait buys a file the
            // kernel serves, where serving it now would inflate it a second time
            // (returns at once when nothing writes it).
            self.cache.wait_written(k, WAIT_FOR_WRITE);
        }
        let stats = self.cache.stats();
        let mut inodes = self.inodes.lock();
        let state = inodes.entry(ino).or_insert(InodeOpens {
            opens: 0,
            backing: None,
        });
        state.opens += 1;
        if let Some(backing) = &state.backing {
            let backing = backing.clone();
            drop(inodes);
            if recording {
                // Its reads will not reach us (see the module doc).
                self.note_whole(ino, node);
            }
            stats.passthrough_opens.fetch_add(1, Ordering::Relaxed);
            return OpenMode::Passthrough(fh, backing);
        }
        let first = state.opens == 1;
        let Some(cached) = key.and_then(|k| self.cache.get(&k, node.size)) else {
            drop(inodes);
            if first && let Some(k) = key {
                self.maybe_eager(ino, loc, node.size, k);
            }
            return OpenMode::Served(fh);
        };
        if first && self.passthrough() && !every_read {
            match register(cached.file()) {
                Ok(b) => {
                    let b = Arc::new(b);
                    state.backing = Some(b.clone());
                    drop(inodes);
                    if recording {
                        self.note_whole(ino, node);
                    }
                    stats.passthrough_opens.fetch_add(1, Ordering::Relaxed);
                    return OpenMode::Passthrough(fh, b);
                }
                Err(e) => {
                    self.passthrough.store(false, Ordering::Relaxed);
                    if !self.warned.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "FUSE passthrough refused; serving cached files with pread");
                    }
                }
            }
        }
        drop(inodes);
        stats.pread_opens.fetch_add(1, Ordering::Relaxed);
        self.handles.write().insert(fh, Arc::new(cached));
        OpenMode::Served(fh)
    }

    /// The cached file handle `fh` reads from, if any.
    pub(crate) fn cached(&self, fh: u64) -> Option<Arc<CachedFile>> {
        self.handles.read().get(&fh).cloned()
    }

    /// Handle `fh` of `ino` was released.
    pub(crate) fn release(&self, ino: Ino, fh: u64) {
        self.handles.write().remove(&fh);
        let mut inodes = self.inodes.lock();
        if let Some(state) = inodes.get_mut(&ino) {
            state.opens = state.opens.saturating_sub(1);
            if state.opens == 0 {
                // Drops the backing id: the kernel holds its own reference while open.
                inodes.remove(&ino);
            }
        }
    }

    /// `n` bytes of `ino` were served through the FUSE read path; once as many bytes
    /// as the file has were served, the file is queued for materialization.
    pub(crate) fn served(&self, ino: Ino, node: &Node, n: u64) {
        if n == 0 || node.size < self.cache.config().min_file_bytes {
            return;
        }
        let Some(loc) = self.eligible(node) else {
            return;
        };
        let done = {
            let mut tracked = self.read_bytes.lock();
            if tracked.len() >= MAX_TRACKED && !tracked.contains_key(&ino) {
                tracked.clear();
            }
            let sum = tracked.entry(ino).or_insert(0);
            *sum += n;
            let done = *sum >= node.size;
            if done {
                tracked.remove(&ino);
            }
            done
        };
        if done && let Some(key) = self.key(loc, node.size) {
            self.schedule(key, loc, node.size, None);
        }
    }

    /// Policy (b): a big file opened while all its data is in the chunk store is
    /// materialized now (checked on the worker, once per inode and mount).
    fn maybe_eager(&self, ino: Ino, loc: Location, size: u64, key: FileKey) {
        let min = self.cache.config().eager_min_bytes;
        if min == 0 || size < min || !self.eager_tried.lock().insert(ino) {
            return;
        }
        let image = self.image.clone();
        let store = self.cache.chunk_store().cloned();
        let check = move || all_local(&image, store.as_deref(), loc, size);
        self.schedule(key, loc, size, Some(Box::new(check)));
    }

    fn schedule(
        &self,
        key: FileKey,
        loc: Location,
        size: u64,
        only_if: Option<crate::filecache::CheckFn>,
    ) {
        let image = self.image.clone();
        let fill = move |out: &mut dyn io::Write| copy_file_to(&image, loc, out);
        self.cache.schedule(Materialize {
            key,
            len: size,
            only_if,
            fill: Box::new(fill),
        });
    }
}

/// The file cache key of the `size`-byte file at `loc` of `image`.
pub(crate) fn file_key(image: &MountedImage, loc: Location, size: u64) -> Option<FileKey> {
    let layer = image.image.layers().get(loc.layer)?;
    let entry = layer.entries().get(loc.entry)?;
    // A layer's identity when its digest is not known here: the manifest digest fixes
    // every layer of the image.
    let image_layer_id = || format!("{}#layer{}", image.manifest_digest, loc.layer);
    let (identity, space, offset) = match layer.format() {
        LayerFormat::Indexed(index) => (index.layer_digest.clone(), "tar", entry.offset),
        // A TOC gives no tar offsets (every entry's is 0), so a TOC layer's files are told
        // apart by the member their data starts in; a space of its own, so keys made from
        // the tar offset of 0 by older versions are never read.
        LayerFormat::Estargz(toc) => (
            image_layer_id(),
            "estargz-member",
            toc.data_member(loc.entry)?,
        ),
        LayerFormat::Whole { .. } => (image_layer_id(), "tar", entry.offset),
    };
    Some(FileKey::new(&identity, space, offset, size))
}

/// Writes the whole file at `loc` of `image` to `out` (what a materialization fills
/// the file cache with).
pub(crate) fn copy_file_to(
    image: &MountedImage,
    loc: Location,
    out: &mut dyn io::Write,
) -> io::Result<()> {
    let layer = image
        .image
        .layers()
        .get(loc.layer)
        .ok_or_else(|| io::Error::other("no such layer"))?;
    crate::device::in_background(|| layer.copy_file(loc.entry, out))
        .map(|_| ())
        .map_err(io::Error::other)
}

/// True when every byte of the file at `loc` can be read without a fetch: a layer
/// held whole in memory, or an indexed layer whose spans for the file are all in the
/// chunk store.
fn all_local(
    image: &MountedImage,
    store: Option<&ferry_store::Store>,
    loc: Location,
    size: u64,
) -> bool {
    let Some(layer) = image.image.layers().get(loc.layer) else {
        return false;
    };
    let Some(entry) = layer.entries().get(loc.entry) else {
        return false;
    };
    match layer.format() {
        LayerFormat::Whole { .. } => true,
        LayerFormat::Estargz(_) => false,
        LayerFormat::Indexed(index) => {
            let Some(store) = store else { return false };
            if size == 0 {
                return true;
            }
            let (Some(first), Some(last)) = (
                index.span_for(entry.offset),
                index.span_for(entry.offset + size - 1),
            ) else {
                return false;
            };
            (first..=last).all(|i| {
                index
                    .span_digests
                    .get(i)
                    .is_some_and(|d| store.contains(&ChunkKey::from_raw(*d)))
            })
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::{Duration, Instant};

    use ferry_oci::media::LAYER_TAR_GZIP;

    use super::*;
    use crate::backend::{ImageSource, LayerSpec};
    use crate::device::FetchConfig;
    use crate::device::tests::{TestBackend, gzip_layer, open_store};
    use crate::filecache::FileCacheConfig;
    use crate::image::View;

    /// A backing id stand-in that counts how many are alive.
    #[derive(Debug)]
    struct FakeBacking(Arc<AtomicUsize>);

    impl Drop for FakeBacking {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    struct Fixture {
        local: LocalFiles<FakeBacking>,
        image: Arc<MountedImage>,
        backend: Arc<TestBackend>,
        files: Vec<(String, Vec<u8>)>,
        _dir: tempfile::TempDir,
    }

    fn fixture(eager_min_bytes: u64) -> Fixture {
        let (blob, index, files) = gzip_layer();
        let backend = TestBackend::new(blob.clone());
        let digest = ferry_oci::sha256_digest(&blob);
        let desc = ferry_oci::layout::descriptor(LAYER_TAR_GZIP, digest, blob.len() as u64, &[]);
        let source = ImageSource {
            manifest_digest: "sha256:test".into(),
            layers: vec![LayerSpec::new(desc, Some(Arc::new(index)), backend.clone())],
        };
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(&dir.path().join("store"));
        let image = Arc::new(
            MountedImage::new(
                source,
                Some(store.clone()),
                FetchConfig::default(),
                &View::Merged,
            )
            .unwrap(),
        );
        let config = FileCacheConfig {
            min_file_bytes: 100 << 10,
            eager_min_bytes,
            ..FileCacheConfig::default()
        };
        let cache = Arc::new(FileCache::open(&config, Some(store)).unwrap());
        let local = LocalFiles::new(cache, image.clone());
        Fixture {
            local,
            image,
            backend,
            files,
            _dir: dir,
        }
    }

    fn node<'a>(f: &'a Fixture, path: &str) -> (Ino, &'a Node) {
        let ino = f.image.tree.resolve(path).unwrap();
        (ino, f.image.tree.get(ino).unwrap())
    }

    fn wait_cached(f: &Fixture, node: &Node) {
        let key = f.local.key(node.data.unwrap(), node.size).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !f.local.cache().contains(&key) {
            assert!(Instant::now() < deadline, "never materialized");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Reads the whole file the way the FUSE read path does, reporting what was served.
    fn read_through(f: &Fixture, ino: Ino, node: &Node) {
        let loc = node.data.unwrap();
        let layer = &f.image.image.layers()[loc.layer];
        let mut off = 0;
        while off < node.size {
            let mut buf = vec![0u8; 128 << 10];
            let n = layer.read_at(loc.entry, off, &mut buf).unwrap();
            f.local.served(ino, node, n as u64);
            off += n as u64;
        }
    }

    #[test]
    fn a_file_read_in_full_is_materialized_then_opened_through_passthrough() {
        let f = fixture(0);
        f.local.set_passthrough(true);
        let alive = Arc::new(AtomicUsize::new(0));
        let register = |_: &File| {
            alive.fetch_add(1, Ordering::SeqCst);
            Ok(FakeBacking(alive.clone()))
        };
        let (ino, a) = node(&f, "a");
        // Not cached yet: served through the read path.
        let OpenMode::Served(first) = f.local.open(ino, a, register) else {
            panic!("nothing is cached yet")
        };
        assert!(f.local.cached(first).is_none());
        read_through(&f, ino, a);
        wait_cached(&f, a);
        // The inode is still open in cached mode: a second open must follow it, but
        // reads come from the cached file.
        let OpenMode::Served(second) = f.local.open(ino, a, register) else {
            panic!("an inode open in cached mode cannot switch to passthrough")
        };
        let file = f.local.cached(second).unwrap();
        let mut buf = vec![0u8; a.size as usize];
        assert_eq!(file.read_at(&mut buf, 0).unwrap(), buf.len());
        assert_eq!(buf, f.files[0].1);
        f.local.release(ino, first);
        f.local.release(ino, second);
        assert!(f.local.cached(second).is_none());
        // Last handle gone: the next open goes through passthrough; later opens share
        // its backing id, which is closed after the last release.
        let OpenMode::Passthrough(p1, b1) = f.local.open(ino, a, register) else {
            panic!("cached file, passthrough on")
        };
        let OpenMode::Passthrough(p2, b2) = f.local.open(ino, a, register) else {
            panic!("inode in passthrough mode")
        };
        assert!(Arc::ptr_eq(&b1, &b2));
        assert_eq!(alive.load(Ordering::SeqCst), 1);
        drop((b1, b2));
        f.local.release(ino, p1);
        assert_eq!(alive.load(Ordering::SeqCst), 1, "still open once");
        f.local.release(ino, p2);
        assert_eq!(
            alive.load(Ordering::SeqCst),
            0,
            "closed after the last release"
        );
        let snap = f.local.cache().snapshot();
        assert_eq!((snap.passthrough_opens, snap.pread_opens), (2, 1));
    }

    #[test]
    fn refused_passthrough_falls_back_to_pread_and_stays_off() {
        let f = fixture(0);
        f.local.set_passthrough(true);
        let (ino, a) = node(&f, "a");
        read_through(&f, ino, a);
        wait_cached(&f, a);
        let refuse = |_: &File| -> io::Result<FakeBacking> {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        };
        let OpenMode::Served(fh) = f.local.open(ino, a, refuse) else {
            panic!("refused")
        };
        assert!(f.local.cached(fh).is_some(), "served from the cached file");
        assert!(!f.local.passthrough());
        f.local.release(ino, fh);
        let mut called = false;
        let OpenMode::Served(fh) = f.local.open(ino, a, |_: &File| {
            called = true;
            Err(io::Error::other("unreachable"))
        }) else {
            panic!("passthrough is off")
        };
        assert!(!called, "not retried after a refusal");
        assert!(f.local.cached(fh).is_some());
    }

    #[test]
    fn a_recording_mount_serves_cached_files_itself_so_every_read_is_noted() {
        let f = fixture(0);
        f.local.set_passthrough(true);
        let alive = Arc::new(AtomicUsize::new(0));
        let register = |_: &File| {
            alive.fetch_add(1, Ordering::SeqCst);
            Ok(FakeBacking(alive.clone()))
        };
        let (ino, a) = node(&f, "a");
        read_through(&f, ino, a);
        wait_cached(&f, a);
        // Held open in passthrough mode from before the recording.
        let OpenMode::Passthrough(held, _) = f.local.open(ino, a, register) else {
            panic!("cached file, passthrough on, not recording")
        };
        let (c_ino, c) = node(&f, "dir/c");
        read_through(&f, c_ino, c);
        wait_cached(&f, c);

        f.image.start_recording();
        // A cached file opened while recording: served from the cached file by this
        // process (the transport's cached read path notes each read), never passthrough.
        let OpenMode::Served(fh) = f
            .local
            .open(c_ino, c, |_: &File| -> io::Result<FakeBacking> {
                panic!("no passthrough while recording")
            })
        else {
            panic!("no passthrough while recording")
        };
        assert!(f.local.cached(fh).is_some(), "served from the cached file");
        f.image.note_read(c_ino, 4096, 8192); // what FerryFs::read_cached does
        // An inode already in passthrough mode cannot switch: the open counts as a read
        // of the whole file.
        let OpenMode::Passthrough(again, _) = f.local.open(ino, a, register) else {
            panic!("the inode is in passthrough mode")
        };
        let trace = f.image.take_trace();
        let reads: Vec<(&str, u64, u64)> = trace
            .reads
            .iter()
            .map(|r| (r.path.as_str(), r.offset, r.len))
            .collect();
        assert_eq!(reads, vec![("/dir/c", 4096, 8192), ("/a", 0, a.size)]);
        f.local.release(c_ino, fh);
        f.local.release(ino, held);
        f.local.release(ino, again);
        // Recording over: passthrough again.
        let OpenMode::Passthrough(p, _) = f.local.open(c_ino, c, register) else {
            panic!("not recording any more")
        };
        f.local.release(c_ino, p);
        assert_eq!(alive.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn small_and_partly_read_files_are_not_materialized() {
        let f = fixture(0);
        let (ino, b) = node(&f, "b");
        let OpenMode::Served(_) = f.local.open(ino, b, |_: &File| -> io::Result<FakeBacking> {
            panic!("small files never register")
        }) else {
            panic!()
        };
        f.local.served(ino, b, b.size);
        let (ino, a) = node(&f, "a");
        f.local.served(ino, a, a.size / 2);
        let key = f.local.key(a.data.unwrap(), a.size).unwrap();
        assert!(!f.local.cache().is_pending(&key) && !f.local.cache().contains(&key));
        assert_eq!(f.local.cache().snapshot().files, 0);
    }

    #[test]
    fn eager_materialization_waits_for_local_data_and_never_fetches() {
        let f = fixture(64 << 10);
        let (ino, c) = node(&f, "dir/c");
        let calls = f.backend.calls.load(Ordering::SeqCst);
        // Nothing local: the open queues a check that declines.
        let OpenMode::Served(fh) = f.local.open(ino, c, |_: &File| -> io::Result<FakeBacking> {
            unreachable!()
        }) else {
            panic!()
        };
        let key = f.local.key(c.data.unwrap(), c.size).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while f.local.cache().is_pending(&key) {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!f.local.cache().contains(&key));
        assert_eq!(f.backend.calls.load(Ordering::SeqCst), calls, "no fetch");
        f.local.release(ino, fh);
        // Once the data is in the chunk store, a fresh mount's open materializes it.
        let loc = c.data.unwrap();
        let mut out = Vec::new();
        f.image.image.layers()[loc.layer]
            .copy_file(loc.entry, &mut out)
            .unwrap();
        let g = LocalFiles::<FakeBacking>::new(f.local.cache().clone(), f.image.clone());
        let calls = f.backend.calls.load(Ordering::SeqCst);
        let OpenMode::Served(_) = g.open(ino, c, |_: &File| -> io::Result<FakeBacking> {
            unreachable!()
        }) else {
            panic!()
        };
        wait_cached(&f, c);
        assert_eq!(f.backend.calls.load(Ordering::SeqCst), calls, "no fetch");
        let cached = f.local.cache().get(&key, c.size).unwrap();
        let mut buf = vec![0u8; c.size as usize];
        cached.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, f.files[2].1);
    }
}
