//! Unpacks one layer tar (plain, gzip or zstd) into an empty directory the way overlayfs
//! wants a layer directory: whiteouts become 0/0 character devices, opaque-directory
//! markers the `trusted.overlay.opaque=y` xattr; hard links, symlinks, devices, fifos,
//! xattrs, ownership, modes and mtimes are kept. It also hashes the uncompressed stream so
//! the caller can check the layer's diff id.
//!
//! The tar is read by `ferry_index::tarwalk`, the walker the lazy mounts read layers
//! with, so what a layer means (which entries are accepted, how paths are normalized,
//! which orders of entries are refused, what a whiteout is) is decided in one place and
//! a layer unpacked here cannot differ from the same layer mounted lazily
//! (`crates/pull/tests/lazy_parity.rs` holds the two side by side). What is left here is
//! writing: later entries of a path replace earlier ones, directories made up for
//! entries whose parents the tar never lists get mode 0755 and mtime 0 (as the lazy tree
//! shows them), and directory metadata is applied last.
//!
//! Safety is the point of this file: a layer is untrusted input. The walker refuses `..`
//! and entries beneath a symlink; this file checks again on disk before each write (no
//! parent may be a symlink, hard links only to files under the destination), bounds file
//! bytes, and must not follow symlinks when creating, chmod-ing or timestamping anything.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ferry_index::entry::{Entry, EntryKind, OPAQUE_MARKER, WHITEOUT_PREFIX};
use ferry_index::tarwalk::{Limits, TarWalker};
use ferry_oci::media::LayerCompression;
use sha2::{Digest as _, Sha256};

/// The overlayfs opaque-directory xattr (the lazy tree sets the same one).
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Bounds on what one layer may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Most entries (files, dirs, links…) in one layer (the tar walker's bound, so going
    /// over it is an [`UnpackError::Tar`]).
    pub max_entries: u64,
    /// Most bytes of regular-file content in one layer.
    pub max_file_bytes: u64,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits {
            max_entries: 10_000_000,
            max_file_bytes: 1 << 40,
        }
    }
}

/// What an unpack wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpackStats {
    /// Tar entries processed (including whiteouts).
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub file_bytes: u64,
    /// `sha256:<hex>` of the uncompressed tar stream (the layer's diff id).
    pub diff_id: String,
}

/// Why a layer could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The compression is malformed or truncated.
    #[error("layer is not a valid compressed stream: {0}")]
    Format(String),
    /// The tar walker refused the layer (the same error a lazy mount of it gets).
    #[error("layer is not a valid tar stream: {0}")]
    Tar(#[from] ferry_index::Error),
    /// An entry would write outside the destination, or is otherwise unsafe.
    #[error("refusing layer entry {path:?}: {reason}")]
    Unsafe {
        /// The entry's path as written in the tar.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The layer exceeds a bound of [`UnpackLimits`].
    #[error("layer too large: {0}")]
    Limit(String),
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// To which path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> UnpackError + 'a {
    move |source| UnpackError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(e: io::Error) -> UnpackError {
    UnpackError::Format(e.to_string())
}

/// Hashes everything read through it.
struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpacks the layer file at `blob` (compressed as `compression`) into `dest`, which must
/// exist and be empty.
pub fn unpack_layer_file(
    blob: &Path,
    compression: LayerCompression,
    dest: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, UnpackError> {
    let file = File::open(blob).map_err(io_err("open", blob))?;
    unpack_layer(
        BufReader::with_capacity(1 << 20, file),
        compression,
        dest,
        limits,
    )
}

/// Unpacks a layer stream into `dest` (an existing, empty directory).
pub fn unpack_layer<R: Read>(
    reader: R,
    compression: LayerCompression,
    dest: &Path,
    limits: &UnpackLimits,
) -> Result<UnpackStats, UnpackError> {
    let decoded: Box<dyn Read + '_> = match compression {
        LayerCompression::None => Box::new(reader),
        LayerCompression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(reader)),
        LayerCompression::Zstd => {
            Box::new(zstd::stream::read::Decoder::new(reader).map_err(format_err)?)
        }
    };
    let hashing = HashingReader {
        inner: decoded,
        hasher: Sha256::new(),
    };
    let walker_limits = Limits {
        max_entries: limits.max_entries,
        ..Limits::default()
    };
    let mut walker = TarWalker::with_limits(hashing, walker_limits);
    let mut unpacker = Unpacker {
        dest,
        limits,
        file_bytes: 0,
        dirs: BTreeMap::new(),
        buf: vec![0; 1 << 16],
    };
    // The layer root, unless the tar lists it, is shown as a made-up directory.
    unpacker.dirs.insert(dest.to_path_buf(), DirMeta::made_up());
    while let Some(entry) = walker.next_entry()? {
        unpacker.entry(&entry, &mut walker)?;
    }
    unpacker.finish_dirs()?;
    let (entries, file_bytes) = (walker.entry_count(), unpacker.file_bytes);
    // The diff id covers the whole stream, including the zero blocks after the last entry.
    let mut rest = walker.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(format_err)?;
    Ok(UnpackStats {
        entries,
        file_bytes,
        diff_id: format!("sha256:{}", hex::encode(rest.hasher.finalize())),
    })
}

/// Metadata applied to a directory after all its children are written. The last entry
/// of a directory's path wins, as in the lazy tree.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DirMeta {
    mode: u32,
    owner: Option<(u32, u32)>,
    mtime: (i64, u32),
    xattrs: BTreeMap<String, Vec<u8>>,
}

impl DirMeta {
    /// A directory the tar never lists (the parent of entries that are): 0755, mtime 0.
    fn made_up() -> DirMeta {
        DirMeta {
            mode: 0o755,
            owner: None,
            mtime: (0, 0),
            xattrs: BTreeMap::new(),
        }
    }

    fn of(entry: &Entry) -> DirMeta {
        DirMeta {
            mode: entry.mode,
            owner: Some((entry.uid, entry.gid)),
            mtime: (entry.mtime, entry.mtime_nsec),
            xattrs: entry.xattrs.clone(),
        }
    }
}

struct Unpacker<'a> {
    dest: &'a Path,
    limits: &'a UnpackLimits,
    file_bytes: u64,
    /// Every directory written or made up, by path.
    dirs: BTreeMap<PathBuf, DirMeta>,
    /// Copy buffer for file data.
    buf: Vec<u8>,
}

fn lstat(path: &Path) -> io::Result<Option<std::fs::Metadata>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn cstring(path: &Path) -> Result<CString, UnpackError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| UnpackError::Unsafe {
        path: path.display().to_string(),
        reason: "path contains NUL".into(),
    })
}

fn os_check(rc: libc::c_int, op: &'static str, path: &Path) -> Result<(), UnpackError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(UnpackError::Io {
            op,
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        })
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// `path` split into its parent and last component (the walker normalized it: relative,
/// no `.`, `..` or empty components; `""` is the root).
fn split_path(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

impl Unpacker<'_> {
    fn entry<R: Read>(
        &mut self,
        entry: &Entry,
        walker: &mut TarWalker<R>,
    ) -> Result<(), UnpackError> {
        let unsafe_entry = |reason: String| UnpackError::Unsafe {
            path: entry.path.clone(),
            reason,
        };
        if entry.path.is_empty() {
            // The layer's root directory ("./"): its metadata applies to dest itself.
            self.dirs
                .insert(self.dest.to_path_buf(), DirMeta::of(entry));
            return Ok(());
        }
        let (parent_rel, name) = split_path(&entry.path);
        let parent = self.make_parents(parent_rel, &entry.path)?;
        if name == OPAQUE_MARKER {
            return set_xattr(&parent, OPAQUE_XATTR, b"y");
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            // The walker refused whiteouts of nothing and of paths this layer adds, so
            // only an earlier whiteout of the same name can be in the way.
            let target = parent.join(hidden);
            remove_existing(&target)?;
            mknod(&target, libc::S_IFCHR, 0, 0, 0)?;
            self.set_owner(entry, &target)?;
            chmod(&target, entry.mode)?;
            return set_mtime(&target, (entry.mtime, entry.mtime_nsec));
        }
        let path = parent.join(name);
        match entry.kind {
            EntryKind::Dir => {
                match lstat(&path).map_err(io_err("stat", &path))? {
                    Some(m) if m.is_dir() => {}
                    Some(_) => {
                        remove_existing(&path)?;
                        make_dir(&path)?;
                    }
                    None => make_dir(&path)?,
                }
                self.dirs.insert(path, DirMeta::of(entry));
                return Ok(());
            }
            EntryKind::File => {
                if self.file_bytes.saturating_add(entry.size) > self.limits.max_file_bytes {
                    return Err(UnpackError::Limit(format!(
                        "more than {} bytes of file content",
                        self.limits.max_file_bytes
                    )));
                }
                remove_existing(&path)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io_err("create", &path))?;
                self.file_bytes += self.copy_data(walker, &mut file, &path)?;
            }
            EntryKind::Symlink => {
                remove_existing(&path)?;
                std::os::unix::fs::symlink(&entry.link_target, &path)
                    .map_err(io_err("symlink", &path))?;
            }
            EntryKind::Hardlink => {
                let (target_parent, target_name) = split_path(&entry.link_target);
                let target_dir = self
                    .existing_parents(target_parent)
                    .map_err(|why| unsafe_entry(format!("hard link target: {why}")))?;
                let target_path = target_dir.join(target_name);
                match lstat(&target_path).map_err(io_err("stat", &target_path))? {
                    Some(m) if m.is_file() => {}
                    _ => {
                        return Err(unsafe_entry(
                            "hard link target is not a file of this layer".into(),
                        ));
                    }
                }
                remove_existing(&path)?;
                std::fs::hard_link(&target_path, &path).map_err(io_err("link", &path))?;
                // The link shares the target's inode and so its metadata.
                return Ok(());
            }
            EntryKind::Char | EntryKind::Block | EntryKind::Fifo => {
                let (file_type, dev) = match entry.kind {
                    EntryKind::Char => (libc::S_IFCHR, (entry.dev_major, entry.dev_minor)),
                    EntryKind::Block => (libc::S_IFBLK, (entry.dev_major, entry.dev_minor)),
                    _ => (libc::S_IFIFO, (0, 0)),
                };
                remove_existing(&path)?;
                mknod(&path, file_type, entry.mode & 0o777, dev.0, dev.1)?;
            }
        }
        self.set_owner(entry, &path)?;
        set_xattrs(&path, &entry.xattrs)?;
        if entry.kind != EntryKind::Symlink {
            chmod(&path, entry.mode)?;
        }
        set_mtime(&path, (entry.mtime, entry.mtime_nsec))
    }

    /// Copies the current entry's data into `file`. A stream that ends inside the data
    /// is the walker's truncation error, the one a lazy index of the layer reports.
    fn copy_data<R: Read>(
        &mut self,
        walker: &mut TarWalker<R>,
        file: &mut File,
        path: &Path,
    ) -> Result<u64, UnpackError> {
        let mut copied = 0u64;
        loop {
            let n = match walker.read_data(&mut self.buf) {
                Ok(0) => return Ok(copied),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    walker.skip_data()?;
                    return Err(UnpackError::Format(e.to_string()));
                }
                Err(e) => return Err(format_err(e)),
            };
            file.write_all(&self.buf[..n])
                .map_err(io_err("write", path))?;
            copied += n as u64;
        }
    }

    /// Creates missing parent directories (made up: 0755, mtime 0) of an entry; refuses a
    /// parent that is a symlink or not a directory. Returns the parent path.
    fn make_parents(&mut self, parents: &str, shown: &str) -> Result<PathBuf, UnpackError> {
        let mut dir = self.dest.to_path_buf();
        for part in parents.split('/').filter(|p| !p.is_empty()) {
            dir.push(part);
            match lstat(&dir).map_err(io_err("stat", &dir))? {
                Some(m) if m.file_type().is_symlink() => {
                    return Err(UnpackError::Unsafe {
                        path: shown.to_owned(),
                        reason: format!(
                            "its parent {} is a symlink (an entry may not write through a link)",
                            dir.strip_prefix(self.dest).unwrap_or(&dir).display()
                        ),
                    });
                }
                Some(m) if m.is_dir() => {}
                Some(_) => {
                    return Err(UnpackError::Unsafe {
                        path: shown.to_owned(),
                        reason: format!(
                            "its parent {} is not a directory",
                            dir.strip_prefix(self.dest).unwrap_or(&dir).display()
                        ),
                    });
                }
                None => {
                    make_dir(&dir)?;
                    self.dirs.insert(dir.clone(), DirMeta::made_up());
                }
            }
        }
        Ok(dir)
    }

    /// The existing directory `parents` names, without following symlinks.
    fn existing_parents(&self, parents: &str) -> Result<PathBuf, String> {
        let mut dir = self.dest.to_path_buf();
        for part in parents.split('/').filter(|p| !p.is_empty()) {
            dir.push(part);
            match lstat(&dir) {
                Ok(Some(m)) if m.is_dir() && !m.file_type().is_symlink() => {}
                Ok(Some(_)) => return Err("goes through a symlink or a file".into()),
                Ok(None) => return Err("not in this layer".into()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(dir)
    }

    fn set_owner(&self, entry: &Entry, path: &Path) -> Result<(), UnpackError> {
        lchown(path, entry.uid, entry.gid)
    }

    /// Directory owners, xattrs, modes and mtimes, deepest first, once nothing more is
    /// written into them.
    fn finish_dirs(&mut self) -> Result<(), UnpackError> {
        let mut dirs: Vec<(&PathBuf, &DirMeta)> = self.dirs.iter().collect();
        dirs.sort_by_key(|(path, _)| std::cmp::Reverse(path.components().count()));
        for (path, meta) in dirs {
            // Only a path of real directories is touched (chmod follows links); the walker
            // refuses layers that replace a directory, so this holds unless something
            // else changed the destination meanwhile.
            if !self.is_real_dir_path(path)? {
                continue;
            }
            if let Some((uid, gid)) = meta.owner {
                lchown(path, uid, gid)?;
            }
            set_xattrs(path, &meta.xattrs)?;
            chmod(path, meta.mode)?;
            set_mtime(path, meta.mtime)?;
        }
        Ok(())
    }

    /// Whether `path` (under dest) and every directory between dest and it are real
    /// directories, not symlinks.
    fn is_real_dir_path(&self, path: &Path) -> Result<bool, UnpackError> {
        let Ok(rel) = path.strip_prefix(self.dest) else {
            return Ok(false);
        };
        let mut at = self.dest.to_path_buf();
        for part in rel.components() {
            at.push(part);
            match lstat(&at).map_err(io_err("stat", &at))? {
                Some(m) if m.is_dir() => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }
}

fn lchown(path: &Path, uid: u32, gid: u32) -> Result<(), UnpackError> {
    let c = cstring(path)?;
    // SAFETY: c is a valid NUL-terminated path.
    let rc = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
    if rc != 0 && !is_root() {
        // An unprivileged unpack (tests) keeps the caller's ownership.
        return Ok(());
    }
    os_check(rc, "chown", path)
}

fn set_xattrs(path: &Path, xattrs: &BTreeMap<String, Vec<u8>>) -> Result<(), UnpackError> {
    for (name, value) in xattrs {
        set_xattr(path, name, value)?;
    }
    Ok(())
}

fn make_dir(path: &Path) -> Result<(), UnpackError> {
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(path)
        .map_err(io_err("mkdir", path))
}

/// Removes whatever is at `path` (a later entry replaces an earlier one).
fn remove_existing(path: &Path) -> Result<(), UnpackError> {
    match lstat(path).map_err(io_err("stat", path))? {
        None => Ok(()),
        Some(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(io_err("remove", path)),
        Some(_) => std::fs::remove_file(path).map_err(io_err("remove", path)),
    }
}

fn mknod(
    path: &Path,
    file_type: libc::mode_t,
    perm: u32,
    major: u32,
    minor: u32,
) -> Result<(), UnpackError> {
    let c = cstring(path)?;
    let dev = libc::makedev(major, minor);
    // SAFETY: c is a valid NUL-terminated path.
    let rc = unsafe { libc::mknod(c.as_ptr(), file_type | perm, dev) };
    os_check(rc, "mknod", path)
}

fn chmod(path: &Path, mode: u32) -> Result<(), UnpackError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io_err("chmod", path))
}

fn set_mtime(path: &Path, (secs, nanos): (i64, u32)) -> Result<(), UnpackError> {
    let c = cstring(path)?;
    let secs = libc::time_t::try_from(secs).unwrap_or(libc::time_t::MAX);
    let nanos = libc::c_long::from(nanos.min(999_999_999));
    let times = [
        libc::timespec {
            tv_sec: secs,
            tv_nsec: nanos,
        },
        libc::timespec {
            tv_sec: secs,
            tv_nsec: nanos,
        },
    ];
    // SAFETY: c is a valid path and times points to two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    os_check(rc, "set mtime of", path)
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) -> Result<(), UnpackError> {
    let c = cstring(path)?;
    let cname = CString::new(name).map_err(|_| UnpackError::Unsafe {
        path: path.display().to_string(),
        reason: "xattr name contains NUL".into(),
    })?;
    // SAFETY: valid NUL-terminated strings; value pointer and length describe one slice.
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            cname.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    os_check(rc, "set xattr on", path)
}
