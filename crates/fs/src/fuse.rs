//! The transport layer: the inode tree and the layer readers served over FUSE.
//!
//! The image never changes, so the kernel is told to cache everything for long: entry
//! and attribute TTLs of a day, `keep_cache` on open (page cache survives close), cached
//! directories and symlinks, readdirplus. Writes are refused with EROFS (the mount is
//! also read-only). Reads that cannot be served (fetch failed, timed out or did not
//! verify) fail with EIO; nothing is retried forever here, the device layer bounds it.
//!
//! With a [`FileCache`] (see [`FerryFs::with_file_cache`]), files that are fully local
//! are served without inflating: the first open of a cached file registers it with
//! the kernel for FUSE passthrough (reads then never reach this process), or, when the
//! kernel refuses, reads are answered with pread from the cached file. Which opens go
//! which way is decided in `localfiles`.
//!
//! A mount made with [`mount_keepable`] can be served again by another process
//! ([`resume`]) while something keeps its `/dev/fuse` descriptor open (the daemon's fd
//! holder): inode numbers are the tree's, deterministic for an image and view, and file
//! handles carry the serving process's generation ([`FerryFs::resumed`]) so a handle
//! from before is served by inode, never mistaken for another file's.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, MountOption, OpenAccMode, OpenFlags,
    ReplyAttr, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyXattr, Request, SessionACL,
};

use crate::device;
use crate::error::{Error, Result};
use crate::filecache::FileCache;
use crate::image::MountedImage;
use crate::image::tree::{Ino, Node, NodeKind};
use crate::localfiles::{LocalFiles, OpenMode};
use crate::stats::MountStats;

/// How long the kernel may cache entries and attributes: the image is immutable.
const TTL: Duration = Duration::from_secs(24 * 3600);

/// Largest single read served (the kernel asks for at most max_pages of 4 KiB).
const MAX_READ: u32 = 4 << 20;
/// Reads slower than this are logged at debug level with their path (what a start
/// waited for, to tune prefetching by).
const SLOW_READ: std::time::Duration = std::time::Duration::from_millis(2);

/// The FUSE filesystem of one mounted image.
#[derive(Debug, Clone)]
pub struct FerryFs {
    image: Arc<MountedImage>,
    local: Option<Arc<LocalFiles<BackingId>>>,
    read_requests: Arc<AtomicU64>,
    /// False when no inode has an xattr: getxattr and listxattr then answer ENOSYS,
    /// which the kernel remembers for the connection and stops asking. Overlayfs asks
    /// every lower for its `trusted.overlay.*` xattrs at each lookup (a pandas import:
    /// ~2,300 requests, 70 ms of a warm start), and an image's layers rarely have any.
    serves_xattrs: bool,
    /// Tag in the top bits of every file handle this process hands out: 0 on a fresh
    /// mount, the resume generation on a resumed connection (see [`FerryFs::resumed`]).
    handle_epoch: u64,
}

/// File handles carry their process's epoch above this many bits.
const HANDLE_EPOCH_SHIFT: u32 = 48;

impl FerryFs {
    /// Serves `image`.
    pub fn new(image: Arc<MountedImage>) -> FerryFs {
        FerryFs::with_file_cache(image, None)
    }

    /// Serves `image`, with files that are fully local served from `cache` (through
    /// FUSE passthrough when the kernel grants it) and files read in full handed to
    /// it. `None`, or a cache whose config is not enabled: every read inflates spans.
    pub fn with_file_cache(image: Arc<MountedImage>, cache: Option<Arc<FileCache>>) -> FerryFs {
        let local = cache
            .filter(|c| c.config().enabled)
            .map(|c| Arc::new(LocalFiles::new(c, image.clone())));
        if let Some(local) = &local {
            let _ = image.files.set(local.cache().clone());
        }
        FerryFs {
            serves_xattrs: image.tree.has_xattrs(),
            image,
            local,
            read_requests: Arc::new(AtomicU64::new(0)),
            handle_epoch: 0,
        }
    }

    /// This filesystem serving a connection that an earlier process initialized (its
    /// `generation`-th resume, 1 or more). Handles the kernel still holds from before
    /// carry another epoch: reads on them are served by inode (inode numbers are the
    /// same for the same image and view), never from this process's per-handle state,
    /// which could belong to another file. FUSE passthrough stays off for new opens:
    /// this process cannot know which inodes the kernel still has open in which mode.
    pub fn resumed(mut self, generation: u16) -> FerryFs {
        self.handle_epoch = u64::from(generation.max(1));
        if let Some(local) = &self.local {
            local.set_passthrough(false);
        }
        self
    }

    /// `fh` as handed to the kernel: tagged with this process's epoch.
    fn tag_handle(&self, fh: u64) -> FileHandle {
        FileHandle(fh | (self.handle_epoch << HANDLE_EPOCH_SHIFT))
    }

    /// The local handle behind `fh` when this process handed it out; `None` for a
    /// handle of an earlier process (a resumed connection).
    fn own_handle(&self, fh: FileHandle) -> Option<u64> {
        (fh.0 >> HANDLE_EPOCH_SHIFT == self.handle_epoch)
            .then_some(fh.0 & ((1 << HANDLE_EPOCH_SHIFT) - 1))
    }

    /// The file cache, when one is in use.
    pub fn file_cache(&self) -> Option<&Arc<FileCache>> {
        self.local.as_ref().map(|l| l.cache())
    }

    /// True when the kernel granted FUSE passthrough and has not refused a file since.
    pub fn passthrough_active(&self) -> bool {
        self.local.as_ref().is_some_and(|l| l.passthrough())
    }

    /// FUSE read requests received so far (passthrough reads never arrive here).
    pub fn read_requests(&self) -> u64 {
        self.read_requests.load(Ordering::Relaxed)
    }

    /// The mounted image (tree, layers, counters).
    pub fn image(&self) -> &Arc<MountedImage> {
        &self.image
    }

    fn node(&self, ino: INodeNo) -> std::result::Result<&Node, Errno> {
        self.image.tree.get(ino.0).ok_or(Errno::ENOENT)
    }

    /// The attributes of inode `ino`.
    pub fn attr(&self, ino: Ino, node: &Node) -> FileAttr {
        let mtime = system_time(node.mtime, node.mtime_nsec);
        FileAttr {
            ino: INodeNo(ino),
            size: node.size,
            blocks: node.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind: file_type(node.kind),
            perm: (node.mode & 0o7777) as u16,
            nlink: node.nlink,
            uid: node.uid,
            gid: node.gid,
            rdev: encode_dev(node.rdev.0, node.rdev.1),
            blksize: 4096,
            flags: 0,
        }
    }

    /// Reads `[offset, offset + size)` of regular file `ino`.
    pub fn read_file(
        &self,
        ino: Ino,
        offset: u64,
        size: u32,
    ) -> std::result::Result<Vec<u8>, Errno> {
        self.read_file_for(ino, offset, size, 0)
    }

    /// [`Self::read_file`] for process `pid` (the FUSE request's; 0 when unknown),
    /// whose command line may say what it reads next ([`crate::image`]'s interpreter
    /// follower).
    pub fn read_file_for(
        &self,
        ino: Ino,
        offset: u64,
        size: u32,
        pid: u32,
    ) -> std::result::Result<Vec<u8>, Errno> {
        let node = self.image.tree.get(ino).ok_or(Errno::ENOENT)?;
        if node.kind != NodeKind::File {
            return Err(Errno::EISDIR);
        }
        self.image.note_read(ino, offset, size);
        if offset >= node.size || size == 0 {
            return Ok(Vec::new());
        }
        let Some(loc) = node.data else {
            return Ok(Vec::new());
        };
        let len = (node.size - offset).min(u64::from(size.min(MAX_READ))) as usize;
        // From here: a read's first miss in a file may fetch the file whole first.
        let started = std::time::Instant::now();
        // Only reads that wait ask for more (a start served by its trace adds nothing):
        // a first read's header, after it lands, may ask for its libraries and its
        // loader's segments.
        let header_waits = offset == 0
            && self.image.nearby.follows_headers()
            && !self.image.read_is_local(node, 0, len as u64);
        self.image.read_nearby(ino, node, offset, len as u64);
        let mut buf = vec![0u8; len];
        let layer = self.image.image.layers().get(loc.layer).ok_or(Errno::EIO)?;
        let read = layer.read_at(loc.entry, offset, &mut buf);
        let took = started.elapsed();
        if took >= SLOW_READ && tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                path = self.image.tree.path_of(ino).unwrap_or_default(),
                offset,
                len,
                ms = took.as_secs_f64() * 1e3,
                "slow read"
            );
        }
        match read {
            Ok(n) => {
                buf.truncate(n);
                MountStats::add(&self.image.stats.bytes_served, n as u64);
                if header_waits {
                    self.image.read_landed(ino, node, offset, &buf, pid);
                } else if offset == 0 {
                    self.image.module_landed(node, &buf);
                    self.image.interpreter_landed(ino, node, &buf, pid);
                }
                Ok(buf)
            }
            Err(e) => {
                tracing::warn!(ino, offset, size, error = %e, "read failed; EIO");
                Err(Errno::EIO)
            }
        }
    }
}

impl FerryFs {
    /// Reads `[offset, offset + size)` of small file `ino` from the small-file pack;
    /// `None` when the pack does not hold it.
    fn read_packed(
        &self,
        local: &LocalFiles<BackingId>,
        ino: Ino,
        node: &Node,
        key: &crate::filecache::FileKey,
        offset: u64,
        size: u32,
    ) -> Option<Vec<u8>> {
        let len = node
            .size
            .saturating_sub(offset)
            .min(u64::from(size.min(MAX_READ))) as usize;
        let mut buf = vec![0u8; len];
        let n = local.read_packed(key, offset, &mut buf)?;
        buf.truncate(n);
        self.image.note_read(ino, offset, size);
        // A guess that packed the file ahead of this read was worth its bytes.
        if let Some(loc) = node.data {
            self.image.note_guess_used(loc, offset, n as u64);
        }
        MountStats::add(&self.image.stats.bytes_served, n as u64);
        Some(buf)
    }

    /// Reads `[offset, offset + size)` of regular file `ino` from its cached copy.
    fn read_cached(
        &self,
        ino: Ino,
        file: &crate::filecache::CachedFile,
        offset: u64,
        size: u32,
    ) -> std::result::Result<Vec<u8>, Errno> {
        self.image.note_read(ino, offset, size);
        if offset >= file.len() || size == 0 {
            return Ok(Vec::new());
        }
        let len = (file.len() - offset).min(u64::from(size.min(MAX_READ))) as usize;
        let mut buf = vec![0u8; len];
        match file.read_at(&mut buf, offset) {
            Ok(n) => {
                buf.truncate(n);
                MountStats::add(&self.image.stats.bytes_served, n as u64);
                Ok(buf)
            }
            Err(e) => {
                tracing::warn!(ino, offset, size, error = %e, "cached file read failed; EIO");
                Err(Errno::EIO)
            }
        }
    }
}

/// Asks for FUSE passthrough when `wanted`, the kernel offers it and this process may
/// register backing files (root); returns whether it was granted. The stack depth is 1:
/// backing files must be on a plain filesystem, and overlayfs can still stack on the
/// mount (a depth-2 FUSE mount could not be an overlayfs lower directory).
fn negotiate_passthrough(wanted: bool, config: &mut KernelConfig) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !wanted || !root || !config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH) {
        return false;
    }
    if config.set_max_stack_depth(1).is_err() {
        return false;
    }
    if config
        .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
        .is_err()
    {
        let _ = config.set_max_stack_depth(0);
        return false;
    }
    true
}

fn file_type(kind: NodeKind) -> FileType {
    match kind {
        NodeKind::Dir => FileType::Directory,
        NodeKind::File => FileType::RegularFile,
        NodeKind::Symlink => FileType::Symlink,
        NodeKind::Char => FileType::CharDevice,
        NodeKind::Block => FileType::BlockDevice,
        NodeKind::Fifo => FileType::NamedPipe,
    }
}

/// The kernel's 32-bit device number encoding (`new_encode_dev`), which FUSE uses.
pub fn encode_dev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

fn name_str(name: &OsStr) -> std::result::Result<&str, Errno> {
    // Every name in the tree is UTF-8 (tar paths are decoded as such); others cannot match.
    name.to_str().ok_or(Errno::ENOENT)
}

/// Answers an xattr request of `size` bytes with `value`: its size when `size` is 0,
/// ERANGE when it does not fit.
fn reply_xattr(reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

impl Filesystem for FerryFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let wanted = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_PARALLEL_DIROPS;
        let supported = config.capabilities() & wanted;
        let _ = config.add_capabilities(supported);
        let _ = config.set_max_readahead(1 << 20);
        if let Some(local) = &self.local {
            local.set_passthrough(negotiate_passthrough(local.wants_passthrough(), config));
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = name_str(name)
            .ok()
            .and_then(|n| self.image.tree.lookup(parent.0, n));
        match found.and_then(|ino| self.image.tree.get(ino).map(|n| (ino, n))) {
            Some((ino, node)) => reply.entry(&TTL, &self.attr(ino, node), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino) {
            Ok(node) => reply.attr(&TTL, &self.attr(ino.0, node)),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.node(ino) {
            Ok(node) if node.kind == NodeKind::Symlink => reply.data(node.link_target.as_bytes()),
            Ok(_) => reply.error(Errno::EINVAL),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.node(ino) {
            Ok(node) if node.kind == NodeKind::Dir => reply.error(Errno::EISDIR),
            Ok(_) if flags.acc_mode() != OpenAccMode::O_RDONLY => reply.error(Errno::EROFS),
            Ok(node) => {
                // While a trace is recorded no read may be served from pages cached
                // before: without KEEP_CACHE the kernel drops the inode's page cache at
                // open, so the reads of this open reach `read` and the recorder (and
                // `LocalFiles::open` hands out no passthrough then).
                let keep = if self.image.records_every_read() {
                    FopenFlags::empty()
                } else {
                    FopenFlags::FOPEN_KEEP_CACHE
                };
                let Some(local) = &self.local else {
                    return reply.opened(FileHandle(0), keep);
                };
                match local.open(ino.0, node, |file| reply.open_backing(file)) {
                    OpenMode::Served(fh) => reply.opened(self.tag_handle(fh), keep),
                    // The kernel refuses any flag outside its passthrough mask
                    // (FOPEN_KEEP_CACHE included) with EIO on open.
                    OpenMode::Passthrough(fh, backing) => {
                        reply.opened_passthrough(self.tag_handle(fh), FopenFlags::empty(), &backing)
                    }
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // A handle of an earlier process was never counted here.
        if let Some(local) = &self.local
            && let Some(fh) = self.own_handle(fh)
        {
            local.release(ino.0, fh);
        }
        reply.ok();
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.read_requests.fetch_add(1, Ordering::Relaxed);
        let Some(local) = &self.local else {
            return match device::for_a_reader(|| self.read_file_for(ino.0, offset, size, req.pid()))
            {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(e),
            };
        };
        local.cache().note_foreground_read();
        if let Some(file) = self.own_handle(fh).and_then(|fh| local.cached(fh)) {
            return match self.read_cached(ino.0, &file, offset, size) {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(e),
            };
        }
        let node = self.image.tree.get(ino.0);
        let packed = node.and_then(|n| local.pack_key(n));
        if let (Some(node), Some(key)) = (node, &packed)
            && let Some(data) = self.read_packed(local, ino.0, node, key, offset, size)
        {
            return reply.data(&data);
        }
        match device::for_a_reader(|| self.read_file_for(ino.0, offset, size, req.pid())) {
            Ok(data) => {
                reply.data(&data);
                // After the reply: the reader does not wait for the bookkeeping.
                if let Some(node) = node {
                    local.served(ino.0, node, data.len() as u64);
                    if let Some(key) = &packed {
                        local.pack_whole(key, node, offset, &data);
                    }
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.node(ino) {
            Ok(node) if node.kind == NodeKind::Dir => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
            ),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(items) = self.image.tree.readdir(ino.0, offset) else {
            return reply.error(Errno::ENOTDIR);
        };
        for item in items {
            let kind = self
                .image
                .tree
                .get(item.ino)
                .map(|n| file_type(n.kind))
                .unwrap_or(FileType::RegularFile);
            if reply.add(INodeNo(item.ino), item.next_offset, kind, item.name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let Some(items) = self.image.tree.readdir(ino.0, offset) else {
            return reply.error(Errno::ENOTDIR);
        };
        for item in items {
            let Some(node) = self.image.tree.get(item.ino) else {
                continue;
            };
            let attr = self.attr(item.ino, node);
            if reply.add(
                INodeNo(item.ino),
                item.next_offset,
                item.name,
                &TTL,
                &attr,
                Generation(0),
            ) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let total = self.image.stats.snapshot().bytes_total;
        let files = self.image.tree.len() as u64;
        reply.statfs(total.div_ceil(4096), 0, 0, files, 0, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if !self.serves_xattrs {
            return reply.error(Errno::ENOSYS);
        }
        let node = match self.node(ino) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        match name.to_str().and_then(|n| node.xattr(n)) {
            Some(value) => reply_xattr(reply, size, value),
            None => reply.error(Errno::NO_XATTR),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        if !self.serves_xattrs {
            return reply.error(Errno::ENOSYS);
        }
        let node = match self.node(ino) {
            Ok(n) => n,
            Err(e) => return reply.error(e),
        };
        let mut list = Vec::new();
        for (name, _) in &node.xattrs {
            list.extend_from_slice(name.as_bytes());
            list.push(0);
        }
        reply_xattr(reply, size, &list);
    }

    /// Nothing to flush on a read-only mount. ENOSYS (which the kernel remembers, so
    /// closes stop asking), answered here because fuser's default logs a warning.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        match self.node(ino) {
            Ok(_) if mask.contains(AccessFlags::W_OK) => reply.error(Errno::EROFS),
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }
}

/// How to mount.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// FUSE worker threads (each with its own cloned /dev/fuse descriptor when > 1).
    pub threads: usize,
    /// Let every user (not only the mounting one) use the mount, the kernel checking
    /// permissions as on any filesystem; what containers need. Mounts are always
    /// `nosuid,nodev`, so this never lets anyone gain privilege through the mount.
    pub allow_other: bool,
    /// Name shown in /proc/mounts.
    pub fsname: String,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            threads: 4,
            allow_other: true,
            fsname: "ferry".into(),
        }
    }
}

fn config(opts: &MountOptions) -> fuser::Config {
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(opts.fsname.clone()),
        MountOption::Subtype("ferry".into()),
        MountOption::RO,
        MountOption::DefaultPermissions,
        // An image's setuid binaries and device nodes must give nothing to a host user
        // who reaches the mount. Containers still get them: their rootfs is an overlayfs
        // (or a bind mount remounted by the runtime) whose own mount flags the kernel
        // checks at exec and open, not those of the layers below it.
        MountOption::NoSuid,
        MountOption::NoDev,
        MountOption::Exec,
        MountOption::NoAtime,
    ];
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads.max(1));
    cfg.clone_fd = opts.threads > 1;
    cfg
}

/// Mounts `fs` at `mountpoint`, served by background threads; dropping the session (or
/// [`fuser::BackgroundSession::umount_and_join`]) unmounts.
pub fn mount(
    fs: FerryFs,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<fuser::BackgroundSession> {
    fuser::spawn_mount(fs, mountpoint, &config(opts))
        .map_err(|e| Error::io(format!("mounting at {}", mountpoint.display()), e))
}

/// What resuming a FUSE connection needs from its first INIT: the ABI version the
/// kernel negotiated. Persisted by the caller beside the kept device descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InitRecord {
    /// FUSE ABI major version (7).
    pub proto_major: u32,
    /// FUSE ABI minor version.
    pub proto_minor: u32,
}

/// A mount whose FUSE connection can outlive this process: while another process
/// holds a copy of `device`, the kernel keeps the connection (and every open file on
/// it) alive, and [`resume`] serves it again from a new process.
#[derive(Debug)]
pub struct KeepableMount {
    /// The session serving it now; dropping it unmounts.
    pub session: fuser::BackgroundSession,
    /// A duplicate of the connection's `/dev/fuse` descriptor (close-on-exec).
    pub device: std::os::fd::OwnedFd,
    /// What [`resume`] needs.
    pub init: InitRecord,
}

/// Like [`mount`], also returning a duplicate of the connection's descriptor and its
/// negotiated INIT data, so the connection can be kept alive across a restart.
pub fn mount_keepable(
    fs: FerryFs,
    mountpoint: &Path,
    opts: &MountOptions,
) -> Result<KeepableMount> {
    use std::os::fd::AsFd;
    let at = || format!("mounting at {}", mountpoint.display());
    let session = fuser::Session::new(fs, mountpoint, &keepable_config(opts))
        .map_err(|e| Error::io(at(), e))?;
    // The handshake ran inside Session::new; a session without a version is a bug.
    let version = session
        .proto_version()
        .ok_or_else(|| Error::Invalid(format!("{}: no FUSE INIT negotiated", at())))?;
    // Dropping `session` on an error below unmounts.
    let device = session
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io("duplicating the /dev/fuse descriptor", e))?;
    let session = session.spawn().map_err(|e| Error::io(at(), e))?;
    Ok(KeepableMount {
        session,
        device,
        init: InitRecord {
            proto_major: version.0,
            proto_minor: version.1,
        },
    })
}

/// The session config of a mount whose connection is kept: every worker thread reads
/// the one descriptor the holder keeps (no per-thread clones). A clone's requests die
/// with the process that owns it (the kernel ends them with an error when it closes),
/// while requests on the kept descriptor stay queued and are resent to the next daemon.
fn keepable_config(opts: &MountOptions) -> fuser::Config {
    let mut cfg = config(opts);
    cfg.clone_fd = false;
    cfg
}

/// The FUSE notification that makes the kernel requeue every request a dead server
/// read but never answered (`FUSE_NOTIFY_RESEND`, Linux 6.9 and later).
const FUSE_NOTIFY_RESEND: i32 = 7;

/// Asks the kernel to send again the requests read on `device`'s connection and never
/// answered (by a process that died). An error means the kernel does not know the
/// notification (before 6.9): those requests then stay unanswered until the mount is
/// aborted (`/sys/fs/fuse/connections/N/abort`).
pub fn notify_resend(device: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // struct fuse_out_header { u32 len; i32 error (the notify code); u64 unique (0) }.
    let mut header = [0u8; 16];
    header[0..4].copy_from_slice(&16u32.to_ne_bytes());
    header[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    // SAFETY: writes 16 bytes from a live local buffer to a descriptor we borrow.
    let n = unsafe { libc::write(device.as_raw_fd(), header.as_ptr().cast(), header.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != header.len() {
        return Err(std::io::Error::other("short write of FUSE_NOTIFY_RESEND"));
    }
    Ok(())
}

/// Serves an existing FUSE connection again: `device` is a descriptor of a connection
/// that an earlier process mounted with [`mount_keepable`] (kept alive by a holder),
/// `fs` the same image and view, made with [`FerryFs::resumed`]. Nothing is mounted: the
/// mount is where it was. Requests the dead process had read are requeued first (see
/// [`notify_resend`]; a kernel without it is logged). Dropping the returned session
/// does not unmount.
pub fn resume(
    fs: FerryFs,
    device: std::os::fd::OwnedFd,
    init: &InitRecord,
    opts: &MountOptions,
) -> Result<fuser::BackgroundSession> {
    use std::os::fd::AsFd;
    if let Err(e) = notify_resend(device.as_fd()) {
        tracing::warn!(error = %e, "FUSE_NOTIFY_RESEND refused (kernel before 6.9?): requests in flight when the previous daemon died stay unanswered");
    }
    let cfg = keepable_config(opts);
    let acl = cfg.acl;
    let version = fuser::Version(init.proto_major, init.proto_minor);
    let session = fuser::Session::resume_from_fd(fs, device, acl, cfg, version)
        .map_err(|e| Error::io("resuming the FUSE connection", e))?;
    session
        .spawn()
        .map_err(|e| Error::io("resuming the FUSE connection", e))
}

/// Blocks SIGINT and SIGTERM in the calling thread and every thread it starts later, so
/// that [`mount_foreground`] can wait for them. Call first thing, before any thread.
pub fn block_stop_signals() -> Result<()> {
    // SAFETY: sigset_t is plain data initialised by sigemptyset before use; the calls
    // only read and write that local set and this thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(Error::io(
                "blocking SIGINT/SIGTERM",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
    }
    Ok(())
}

/// Waits up to `timeout` for SIGINT or SIGTERM (blocked by [`block_stop_signals`]);
/// returns the signal number when one arrived.
fn wait_stop_signal(timeout: Duration) -> Option<i32> {
    // SAFETY: as in block_stop_signals; sigtimedwait reads the set and the timespec and
    // writes nothing else (null siginfo).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        let sig = libc::sigtimedwait(&set, std::ptr::null_mut(), &ts);
        (sig > 0).then_some(sig)
    }
}

/// Mounts and serves until SIGINT/SIGTERM (then unmounts cleanly) or until the
/// filesystem is unmounted from outside (`ferry umount`, `umount`). `ready` is called
/// once the mount is in place, `tick` about every 200 ms while it is served (to publish
/// counters). Call [`block_stop_signals`] before starting any thread.
pub fn mount_foreground(
    fs: FerryFs,
    mountpoint: &Path,
    opts: &MountOptions,
    ready: impl FnOnce(),
    mut tick: impl FnMut(),
) -> Result<()> {
    let session = mount(fs, mountpoint, opts)?;
    ready();
    loop {
        tick();
        if session.guard.is_finished() {
            return session
                .join()
                .map_err(|e| Error::io("serving the mount", e));
        }
        if let Some(sig) = wait_stop_signal(Duration::from_millis(200)) {
            tracing::info!(signal = sig, mountpoint = %mountpoint.display(), "unmounting");
            let result = session
                .umount_and_join()
                .map_err(|e| Error::io(format!("unmounting {}", mountpoint.display()), e));
            tick();
            return result;
        }
    }
}

/// Makes the process `cmd` starts the leader of a new session, so it outlives the
/// terminal and process group of the one starting it (a detached mount server).
pub fn detach_on_spawn(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // setsid, which is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// True when `mountpoint` (an absolute, canonical path) is a FUSE mount of ferry's, as
/// /proc/self/mountinfo lists it.
pub fn is_mounted(mountpoint: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = mountpoint.to_string_lossy();
    info.lines()
        .filter_map(parse_mountinfo_line)
        .any(|m| m.mountpoint == want && (m.fstype == "fuse.ferry" || m.fstype == "fuse"))
}

/// Every mount point of ferry's FUSE filesystems in this mount namespace (subtype
/// `ferry`, or plain `fuse` with a `ferry` source), in mountinfo order; a point mounted
/// twice is listed twice.
pub fn ferry_mountpoints() -> Vec<PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    ferry_mountpoints_in(&info)
}

fn ferry_mountpoints_in(info: &str) -> Vec<PathBuf> {
    info.lines()
        .filter_map(parse_mountinfo_line)
        .filter(|m| {
            m.fstype == "fuse.ferry"
                || (m.fstype == "fuse" && (m.source == "ferry" || m.source.starts_with("ferry:")))
        })
        .map(|m| PathBuf::from(m.mountpoint))
        .collect()
}

/// The fields of one /proc/self/mountinfo line that ferry reads.
struct MountinfoLine {
    mountpoint: String,
    fstype: String,
    source: String,
}

fn parse_mountinfo_line(line: &str) -> Option<MountinfoLine> {
    let fields: Vec<&str> = line.split(' ').collect();
    let dash = fields.iter().position(|f| *f == "-")?;
    Some(MountinfoLine {
        mountpoint: unescape_mountinfo(fields.get(4)?),
        fstype: (*fields.get(dash + 1)?).to_owned(),
        source: unescape_mountinfo(fields.get(dash + 2)?),
    })
}

/// What asking a FUSE mount's connection found (see [`probe_connection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionProbe {
    /// Answered (or the kernel answered for it): something serves it.
    Alive,
    /// `ENOTCONN`: the connection ended (its server and every holder of its descriptor
    /// are gone) and it never comes back; only unmounting helps.
    Dead,
    /// No answer within the timeout: a connection still open whose server does not
    /// answer (e.g. kept by a holder while its daemon restarts). Left alone.
    NoAnswer,
}

/// Asks the filesystem mounted at `mountpoint` for its statistics (`statfs`), which a
/// FUSE mount whose connection ended refuses at once with `ENOTCONN`. A live but
/// unserved connection would block the caller, so the call runs on its own thread and
/// is given up after `timeout` (the thread then ends whenever the kernel answers).
pub fn probe_connection(mountpoint: &Path, timeout: Duration) -> ConnectionProbe {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return ConnectionProbe::Alive;
    };
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("ferry-mount-probe".into())
        .spawn(move || {
            // SAFETY: statfs is plain data, valid when zeroed.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: the call fills `st` only; path is NUL-terminated and owned by this
            // thread for the duration of the call.
            let rc = unsafe { libc::statfs(path.as_ptr(), &mut st) };
            let errno = (rc != 0).then(|| std::io::Error::last_os_error().raw_os_error());
            let _ = tx.send(errno.flatten());
        });
    if spawned.is_err() {
        return ConnectionProbe::NoAnswer;
    }
    match rx.recv_timeout(timeout) {
        Ok(Some(libc::ENOTCONN)) => ConnectionProbe::Dead,
        Ok(_) => ConnectionProbe::Alive,
        Err(_) => ConnectionProbe::NoAnswer,
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space and so on).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            match u8::try_from(v) {
                Ok(byte) => {
                    out.push(byte);
                    i += 4;
                }
                Err(_) => {
                    out.push(b[i]);
                    i += 1;
                }
            }
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unmounts a ferry mount point: `umount2(2)` when privileged, else `fusermount3 -u`.
pub fn unmount(mountpoint: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("{} contains a NUL byte", mountpoint.display())))?;
    // SAFETY: path is a valid NUL-terminated string that outlives the call.
    let rc = unsafe { libc::umount2(path.as_ptr(), 0) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(Error::io(
            format!("unmounting {}", mountpoint.display()),
            err,
        ));
    }
    let status = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(mountpoint)
        .status()
        .map_err(|e| Error::io("running fusermount3 -u", e))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "fusermount3 -u {} failed ({status})",
            mountpoint.display()
        )))
    }
}

/// A tar mtime as a `SystemTime` (before the epoch too).
fn system_time(secs: i64, nsec: u32) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsec.min(999_999_999))
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(secs.unsigned_abs()))
            .unwrap_or(UNIX_EPOCH)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Write;
    use std::sync::atomic::Ordering;

    use ferry_oci::media::LAYER_TAR_GZIP;

    use super::*;
    use crate::backend::{ImageSource, LayerSpec};
    use crate::device::FetchConfig;
    use crate::device::tests::{TestBackend, gzip_layer, open_store};
    use crate::image::View;

    /// A gzip layer (unindexed) that removes `b`, links `link -> a`, adds `dir/d` and
    /// hard-links `dir/hard` to it.
    fn upper_layer() -> Vec<u8> {
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        h.set_size(0);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, ".wh.b", &[][..]).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(4);
        h.set_mode(0o600);
        h.set_uid(7);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        tar.append_data(&mut h, "dir/d", &b"data"[..]).unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        tar.append_link(&mut h, "link", "a").unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Link);
        h.set_size(0);
        h.set_mode(0o644);
        tar.append_link(&mut h, "dir/hard", "dir/d").unwrap();
        let tar = tar.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar).unwrap();
        gz.finish().unwrap()
    }

    fn spec(blob: &[u8], backend: Arc<dyn ferry_index::source::RangeSource>) -> LayerSpec {
        let digest = ferry_oci::sha256_digest(blob);
        LayerSpec::new(
            ferry_oci::layout::descriptor(LAYER_TAR_GZIP, digest, blob.len() as u64, &[]),
            None,
            backend,
        )
    }

    struct Fixture {
        fs: FerryFs,
        lower: Arc<TestBackend>,
        files: Vec<(String, Vec<u8>)>,
        _store: tempfile::TempDir,
    }

    fn fixture(view: View) -> Fixture {
        let (blob, index, files) = gzip_layer();
        let lower = TestBackend::new(blob.clone());
        let mut l0 = spec(&blob, lower.clone());
        l0.index = Some(Arc::new(index));
        let upper = upper_layer();
        let l1 = spec(&upper, TestBackend::new(upper.clone()));
        let source = ImageSource {
            manifest_digest: "sha256:test".into(),
            layers: vec![l0, l1],
        };
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(dir.path());
        // Nearby fetches off: the tests count what each read fetched and failed.
        let config = FetchConfig {
            whole_file_bytes: 0,
            nearby_bytes: 0,
            ..FetchConfig::default()
        };
        let image = MountedImage::new(source, Some(store), config, &view).unwrap();
        Fixture {
            fs: FerryFs::new(Arc::new(image)),
            lower,
            files,
            _store: dir,
        }
    }

    fn ino(fs: &FerryFs, path: &str) -> Ino {
        fs.image().tree.resolve(path).unwrap()
    }

    #[test]
    fn merged_image_serves_files_links_and_hides_whiteouts() {
        let f = fixture(View::Merged);
        let tree = &f.fs.image().tree;
        assert!(tree.resolve("b").is_none(), "whited out");
        let a = ino(&f.fs, "a");
        let whole = f.fs.read_file(a, 0, 1 << 20).unwrap();
        assert_eq!(whole, f.files[0].1);
        assert_eq!(
            f.fs.read_file(a, 300 << 10, 10).unwrap(),
            b"",
            "read at EOF"
        );
        let d = ino(&f.fs, "dir/d");
        assert_eq!(ino(&f.fs, "dir/hard"), d);
        let attr = f.fs.attr(d, tree.get(d).unwrap());
        assert_eq!(
            (attr.nlink, attr.size, attr.perm, attr.uid),
            (2, 4, 0o600, 7)
        );
        assert_eq!(f.fs.read_file(d, 1, 100).unwrap(), b"ata");
        let c = ino(&f.fs, "dir/c");
        assert_eq!(f.fs.read_file(c, 7, 3).unwrap(), &f.files[2].1[7..10]);
        let link = tree.get(ino(&f.fs, "link")).unwrap();
        assert_eq!(link.link_target, "a");
        let s = f.fs.image().stats.snapshot();
        assert!(
            s.bytes_fetched > 0 && s.bytes_fetched < s.bytes_total,
            "{s:?}"
        );
        assert_eq!(s.bytes_served, (300 << 10) + 6);
    }

    #[test]
    fn corrupt_layer_bytes_read_as_eio() {
        let f = fixture(View::Merged);
        f.lower.corrupt.store(true, Ordering::SeqCst);
        assert_eq!(f.fs.read_file(ino(&f.fs, "a"), 0, 4096), Err(Errno::EIO));
        assert_eq!(f.fs.image().stats.snapshot().verify_failures, 1);
    }

    #[test]
    fn one_layer_view_shows_whiteouts_as_devices() {
        let (blob, _, _) = gzip_layer();
        let upper = ferry_oci::sha256_digest(&upper_layer()).to_string();
        let f = fixture(View::Layer(upper));
        let tree = &f.fs.image().tree;
        let b = tree.get(ino(&f.fs, "b")).unwrap();
        let attr = f.fs.attr(ino(&f.fs, "b"), b);
        assert_eq!((attr.kind, attr.rdev), (FileType::CharDevice, 0));
        assert!(
            tree.resolve("a").is_none(),
            "lower files are not in the upper layer"
        );
        let missing = ferry_oci::sha256_digest(&blob[..10]).to_string();
        let (blob2, index, _) = gzip_layer();
        let mut l0 = spec(&blob2, TestBackend::new(blob2.clone()));
        l0.index = Some(Arc::new(index));
        let source = ImageSource {
            manifest_digest: "sha256:test".into(),
            layers: vec![l0],
        };
        let err = MountedImage::new(source, None, FetchConfig::default(), &View::Layer(missing))
            .unwrap_err();
        assert!(err.to_string().contains("no layer"), "{err}");
    }

    #[test]
    fn handles_of_another_process_are_never_taken_for_this_ones() {
        let f = fixture(View::Merged);
        let fresh = f.fs.clone();
        assert_eq!(
            fresh.tag_handle(5),
            FileHandle(5),
            "fresh mounts keep plain handles"
        );
        assert_eq!(fresh.own_handle(FileHandle(5)), Some(5));
        let resumed = f.fs.clone().resumed(2);
        let tagged = resumed.tag_handle(5);
        assert_ne!(tagged, FileHandle(5));
        assert_eq!(resumed.own_handle(tagged), Some(5));
        // The previous process's handle 5 (and generation 1's) are not this one's 5.
        assert_eq!(resumed.own_handle(FileHandle(5)), None);
        assert_eq!(
            resumed.own_handle(f.fs.clone().resumed(1).tag_handle(5)),
            None
        );
        assert_eq!(fresh.own_handle(tagged), None);
        // Generation 0 is not a resume.
        assert_ne!(f.fs.clone().resumed(0).tag_handle(1), FileHandle(1));
    }

    #[test]
    fn resend_is_a_header_only_notification() {
        // Written to a pipe instead of /dev/fuse: exactly fuse_out_header{16, 7, 0}.
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (r, w) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        use std::os::fd::AsFd;
        notify_resend(w.as_fd()).unwrap();
        drop(w);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &r, &mut got).unwrap();
        let mut want = Vec::new();
        want.extend_from_slice(&16u32.to_ne_bytes());
        want.extend_from_slice(&7i32.to_ne_bytes());
        want.extend_from_slice(&0u64.to_ne_bytes());
        assert_eq!(got, want);
    }

    #[test]
    fn device_numbers_use_the_kernel_encoding() {
        assert_eq!(encode_dev(1, 3), 0x103);
        assert_eq!(encode_dev(8, 0x123), 0x10_0823);
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/x\\777"), "/x\\777");
    }

    /// True when kernel mounts can be tested here (root and /dev/fuse); says so when not,
    /// and the test then passes without running.
    pub(super) fn can_mount_fuse() -> bool {
        // SAFETY: geteuid has no preconditions.
        let ok = unsafe { libc::geteuid() } == 0 && Path::new("/dev/fuse").exists();
        if !ok {
            eprintln!("skipped: needs root and /dev/fuse");
        }
        ok
    }

    /// The real transport: needs root and /dev/fuse; skipped (passes) without them.
    #[test]
    fn kernel_mount_serves_reads_and_unmounts() {
        if !can_mount_fuse() {
            return;
        }
        let f = fixture(View::Merged);
        let mnt = tempfile::tempdir().unwrap();
        let mountpoint = mnt.path().canonicalize().unwrap();
        let session = match mount(f.fs.clone(), &mountpoint, &MountOptions::default()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("skipped: cannot mount here: {e}");
                return;
            }
        };
        assert!(is_mounted(&mountpoint));
        let read = std::fs::read(mountpoint.join("a"));
        let names: Vec<String> = std::fs::read_dir(&mountpoint)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        let link = std::fs::read_link(mountpoint.join("link"));
        let write = std::fs::write(mountpoint.join("new"), b"x");
        let flags = statvfs_flags(&mountpoint);
        unmount(&mountpoint).unwrap();
        session.join().unwrap();
        assert!(!is_mounted(&mountpoint));
        assert_eq!(read.unwrap(), f.files[0].1);
        let mut names = names;
        names.sort();
        assert_eq!(names, vec!["a", "dir", "link"]);
        assert_eq!(link.unwrap(), Path::new("a"));
        assert_eq!(write.unwrap_err().raw_os_error(), Some(libc::EROFS));
        // The kernel ignores setuid bits and device nodes on the mount itself.
        let flags = flags.unwrap();
        assert_ne!(flags & libc::ST_NOSUID, 0, "mounted nosuid");
        assert_ne!(flags & libc::ST_NODEV, 0, "mounted nodev");
        assert_ne!(flags & libc::ST_RDONLY, 0, "mounted ro");
    }

    fn statvfs_flags(path: &Path) -> std::io::Result<libc::c_ulong> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: statvfs is plain data, valid when zeroed.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: the call writes only into `st` and reads the NUL-terminated path that
        // outlives the call.
        let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st.f_flag)
    }

    #[test]
    fn ferry_mounts_are_found_in_mountinfo() {
        let info = "\
36 25 0:32 / /var/lib/ferry/snapshotter/snapshots/7/fs ro,nosuid,nodev,noatime shared:1 - fuse.ferry ferry:sha256:ab rw,user_id=0
37 25 0:33 / /mnt/with\\040space ro - fuse ferry:sha256:cd rw
38 25 0:34 / /mnt/other rw - fuse sshfs#host: rw
39 25 0:35 / /mnt/plain rw - ext4 /dev/sda1 rw
garbage line
40 25 0:36 / /mnt/short - fuse.ferry
";
        assert_eq!(
            ferry_mountpoints_in(info),
            vec![
                PathBuf::from("/var/lib/ferry/snapshotter/snapshots/7/fs"),
                PathBuf::from("/mnt/with space"),
            ]
        );
    }

    /// A mount whose connection ended answers ENOTCONN; a served one answers.
    #[test]
    fn kernel_probe_tells_a_dead_connection_from_a_live_one() {
        use std::os::unix::fs::MetadataExt;
        if !can_mount_fuse() {
            return;
        }
        let f = fixture(View::Merged);
        let mnt = tempfile::tempdir().unwrap();
        let mountpoint = mnt.path().canonicalize().unwrap();
        let session = match mount(f.fs.clone(), &mountpoint, &MountOptions::default()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("skipped: cannot mount here: {e}");
                return;
            }
        };
        let probe = |p: &Path| probe_connection(p, Duration::from_secs(10));
        assert_eq!(probe(&mountpoint), ConnectionProbe::Alive);
        assert!(ferry_mountpoints().contains(&mountpoint));
        // End the connection as a crash of every descriptor holder does.
        let dev = std::fs::metadata(&mountpoint).unwrap().dev();
        let minor = libc::minor(dev);
        let abort = format!("/sys/fs/fuse/connections/{minor}/abort");
        if !Path::new(&abort).exists() {
            // fusectl is not mounted here: the connection cannot be ended from outside.
            eprintln!("skipped the dead half: no {abort}");
            drop(session);
            return;
        }
        std::fs::write(&abort, b"1").unwrap();
        assert_eq!(probe(&mountpoint), ConnectionProbe::Dead);
        let c = std::ffi::CString::new(mountpoint.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) }, 0);
        drop(session);
        assert!(!is_mounted(&mountpoint));
        // Not a mount at all: an ordinary directory answers.
        assert_eq!(probe(&mountpoint), ConnectionProbe::Alive);
    }

    #[test]
    fn mounts_ignore_setuid_bits_and_device_nodes() {
        let cfg = config(&MountOptions::default());
        for wanted in [MountOption::NoSuid, MountOption::NoDev, MountOption::RO] {
            assert!(cfg.mount_options.contains(&wanted), "{wanted:?}");
        }
        for refused in [MountOption::Suid, MountOption::Dev, MountOption::RW] {
            assert!(!cfg.mount_options.contains(&refused), "{refused:?}");
        }
        // A kept connection's mount is made the same way.
        assert_eq!(
            keepable_config(&MountOptions::default()).mount_options,
            cfg.mount_options
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod passthrough_tests {
    use std::os::fd::AsRawFd;
    use std::time::Instant;

    use ferry_oci::media::LAYER_TAR_GZIP;

    use super::tests::can_mount_fuse;
    use super::*;
    use crate::backend::{ImageSource, LayerSpec};
    use crate::device::FetchConfig;
    use crate::device::tests::{TestBackend, gzip_layer, open_store};
    use crate::filecache::FileCacheConfig;
    use crate::image::View;

    fn run(cmd: &str, args: &[&str]) -> bool {
        std::process::Command::new(cmd)
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Reads the whole file through a fresh descriptor after dropping that
    /// descriptor's page cache (FUSE page cache in cached mode; in passthrough mode the
    /// FUSE inode has none and reads go to the backing file).
    fn read_uncached(path: &Path) -> Vec<u8> {
        let file = std::fs::File::open(path).unwrap();
        // SAFETY: fd is open for the call; fadvise only drops clean cached pages.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut out).unwrap();
        out
    }

    /// What the root-only kernel tests mount: one gzip layer, merged, with a file cache
    /// (files of 64 KiB and more) over a temp store. `dir` owns every path.
    struct KernelMount {
        files: Vec<(String, Vec<u8>)>,
        dir: tempfile::TempDir,
        cache: Arc<FileCache>,
        fs: FerryFs,
        mnt: std::path::PathBuf,
        session: fuser::BackgroundSession,
    }

    /// Mounts it; `None` (skipped, logged) when the kernel will not mount here.
    fn kernel_mount_with_file_cache() -> Option<KernelMount> {
        let (blob, index, files) = gzip_layer();
        let digest = ferry_oci::sha256_digest(&blob);
        let desc = ferry_oci::layout::descriptor(LAYER_TAR_GZIP, digest, blob.len() as u64, &[]);
        let source = ImageSource {
            manifest_digest: "sha256:test".into(),
            layers: vec![LayerSpec::new(
                desc,
                Some(Arc::new(index)),
                TestBackend::new(blob),
            )],
        };
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(&dir.path().join("store"));
        let image = MountedImage::new(
            source,
            Some(store.clone()),
            FetchConfig::default(),
            &View::Merged,
        )
        .unwrap();
        let config = FileCacheConfig {
            min_file_bytes: 64 << 10,
            ..FileCacheConfig::default()
        };
        let cache = Arc::new(FileCache::open(&config, Some(store)).unwrap());
        let fs = FerryFs::with_file_cache(Arc::new(image), Some(cache.clone()));
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let session = match mount(fs.clone(), &mnt, &MountOptions::default()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("skipped: cannot mount here: {e}");
                return None;
            }
        };
        Some(KernelMount {
            files,
            dir,
            cache,
            fs,
            mnt,
            session,
        })
    }

    /// The real thing: a kernel mount with the file cache. Needs root, /dev/fuse and a
    /// kernel with FUSE passthrough; skipped (passes) without them.
    #[test]
    fn kernel_passthrough_serves_cached_files_and_overlayfs_stacks_on_top() {
        if !can_mount_fuse() {
            return;
        }
        let Some(KernelMount {
            files,
            dir,
            cache,
            fs,
            mnt,
            session,
        }) = kernel_mount_with_file_cache()
        else {
            return;
        };
        let a = mnt.join("a");
        assert_eq!(std::fs::read(&a).unwrap(), files[0].1, "first read");
        let deadline = Instant::now() + Duration::from_secs(30);
        while cache.snapshot().materialized == 0 {
            assert!(Instant::now() < deadline, "never materialized");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The first open's release reaches the daemon asynchronously; until it does the
        // inode stays in cached mode (served with pread from the cached file).
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut passthrough = false;
        while !passthrough && Instant::now() < deadline {
            let before = fs.read_requests();
            let bytes = read_uncached(&a);
            assert_eq!(bytes, files[0].1);
            passthrough = cache.snapshot().passthrough_opens > 0;
            if passthrough {
                assert!(fs.passthrough_active());
                assert_eq!(
                    fs.read_requests(),
                    before,
                    "passthrough reads skip the daemon"
                );
            } else {
                assert!(cache.snapshot().pread_opens > 0, "{:?}", cache.snapshot());
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let kernel_has_passthrough = std::fs::read("/proc/config.gz").is_ok() && passthrough;
        eprintln!(
            "passthrough granted: {passthrough} ({:?})",
            cache.snapshot()
        );
        // overlayfs over the mount (as the snapshotter uses single-layer mounts).
        let empty = dir.path().join("empty");
        let merged = dir.path().join("merged");
        std::fs::create_dir(&empty).unwrap();
        std::fs::create_dir(&merged).unwrap();
        let lower = format!("lowerdir={}:{}", mnt.display(), empty.display());
        let overlay = run(
            "mount",
            &[
                "-t",
                "overlay",
                "overlay",
                "-o",
                &lower,
                merged.to_str().unwrap(),
            ],
        );
        let through_overlay = overlay.then(|| std::fs::read(merged.join("a")));
        if overlay {
            assert!(run("umount", &[merged.to_str().unwrap()]));
        }
        unmount(&mnt).unwrap();
        session.join().unwrap();
        assert!(
            overlay,
            "overlayfs must mount over a passthrough ferry mount"
        );
        assert_eq!(through_overlay.unwrap().unwrap(), files[0].1);
        if kernel_has_passthrough {
            assert!(passthrough);
        }
    }

    /// A small file read whole through the mount goes into the small-file pack after
    /// the reply, and the next read that reaches the daemon is served from it (the same
    /// bytes, no layer read). Needs root and /dev/fuse; skipped (passes) without.
    #[test]
    fn a_small_file_read_once_is_served_from_the_pack() {
        if !can_mount_fuse() {
            return;
        }
        let Some(KernelMount {
            files,
            dir: _dir,
            cache,
            fs: _fs,
            mnt,
            session,
        }) = kernel_mount_with_file_cache()
        else {
            return;
        };
        let b = mnt.join("b");
        assert_eq!(std::fs::read(&b).unwrap(), files[1].1);
        let pack = cache.pack().expect("the pack is on by default");
        let deadline = Instant::now() + Duration::from_secs(10);
        while pack.stats().packed.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "never packed");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pack.occupancy(), (1, files[1].1.len() as u64));
        assert_eq!(read_uncached(&b), files[1].1);
        assert_eq!(pack.stats().hits.load(Ordering::Relaxed), 1);
        unmount(&mnt).unwrap();
        session.join().unwrap();
    }

    /// A recording mount with a file cache records every read: of a cached file the
    /// kernel served by passthrough before the recording, and of a file whose pages the
    /// kernel had cached before it. Needs root and /dev/fuse; skipped (passes) without.
    #[test]
    fn a_recording_mount_with_a_file_cache_records_every_read() {
        if !can_mount_fuse() {
            return;
        }
        let Some(KernelMount {
            files,
            dir: _dir,
            cache,
            fs,
            mnt,
            session,
        }) = kernel_mount_with_file_cache()
        else {
            return;
        };
        let (a, b) = (mnt.join("a"), mnt.join("b"));
        assert_eq!(std::fs::read(&a).unwrap(), files[0].1);
        let deadline = Instant::now() + Duration::from_secs(30);
        while cache.snapshot().materialized == 0 {
            assert!(Instant::now() < deadline, "never materialized");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Until `a` is opened through passthrough (when the kernel grants it).
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs.passthrough_active()
            && cache.snapshot().passthrough_opens == 0
            && Instant::now() < deadline
        {
            assert_eq!(read_uncached(&a), files[0].1);
            std::thread::sleep(Duration::from_millis(20));
        }
        let passthrough = cache.snapshot().passthrough_opens > 0;
        // `b` is too small for the file cache: its pages stay in the kernel's cache.
        assert_eq!(std::fs::read(&b).unwrap(), files[1].1);
        let before = fs.read_requests();
        assert_eq!(std::fs::read(&b).unwrap(), files[1].1);
        assert_eq!(
            fs.read_requests(),
            before,
            "the page cache served the re-read"
        );

        fs.image().start_recording();
        // The release of the last passthrough open reaches us asynchronously; until it
        // has, `a` stays in passthrough mode and its opens are recorded whole.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut served_here = false;
        while !served_here && Instant::now() < deadline {
            let before = fs.read_requests();
            assert_eq!(std::fs::read(&a).unwrap(), files[0].1);
            served_here = fs.read_requests() > before;
            if !served_here {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let before = fs.read_requests();
        assert_eq!(std::fs::read(&b).unwrap(), files[1].1);
        let b_reached_us = fs.read_requests() > before;
        let trace = fs.image().take_trace();
        unmount(&mnt).unwrap();
        session.join().unwrap();

        eprintln!(
            "passthrough before recording: {passthrough}; {:?}",
            cache.snapshot()
        );
        assert!(
            served_here,
            "while recording, reads of a cached file reach the daemon"
        );
        if passthrough {
            assert!(
                cache.snapshot().pread_opens > 0,
                "served from the cached file"
            );
        }
        assert!(b_reached_us, "an open while recording drops the page cache");
        let reads: Vec<(&str, u64, u64)> = trace
            .reads
            .iter()
            .map(|r| (r.path.as_str(), r.offset, r.len))
            .collect();
        assert_eq!(
            reads,
            vec![
                ("/a", 0, files[0].1.len() as u64),
                ("/b", 0, files[1].1.len() as u64)
            ]
        );
    }
}
