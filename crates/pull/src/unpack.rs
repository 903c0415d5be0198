//! Unpacks one layer tar (plain, gzip or zstd) into an empty directory the way overlayfs
//! wants a layer directory: whiteouts become 0/0 character devices, opaque-directory
//! markers the `trusted.overlay.opaque=y` xattr; hard links, symlinks, devices, fifos,
//! xattrs, ownership, modes and mtimes are kept. It also hashes the uncompressed stream so
//! the caller can check the layer's diff id.
//!
//! Safety is the point of this file: a layer is untrusted input. No entry may write
//! outside the destination (absolute paths, `..`, and paths through a symlink created
//! by an earlier entry are refused with an error naming the entry), hard links may only
//! point inside the destination, and entry counts, sizes and xattrs are bounded. It must
//! not follow symlinks when creating, chmod-ing or timestamping anything.

use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ferry_oci::media::LayerCompression;
use sha2::{Digest as _, Sha256};

/// The overlayfs opaque-directory xattr.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// Longest path accepted for one entry (Linux's PATH_MAX).
const MAX_PATH_LEN: usize = 4096;
/// Largest single xattr value accepted (Linux's XATTR_SIZE_MAX).
const MAX_XATTR_VALUE: usize = 64 << 10;
/// PAX record prefix carrying xattrs.
const PAX_XATTR: &str = "SCHILY.xattr.";

/// Bounds on what one layer may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Most entries (files, dirs, links…) in one layer.
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
    /// The tar (or its compression) is malformed or truncated.
    #[error("layer is not a valid tar stream: {0}")]
    Format(String),
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
    /// The layer uses a tar feature ferry does not unpack.
    #[error("unsupported layer entry {path:?}: {reason}")]
    Unsupported {
        /// The entry's path.
        path: String,
        /// Which feature.
        reason: String,
    },
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
    let mut archive = tar::Archive::new(hashing);
    let mut unpacker = Unpacker {
        dest,
        limits,
        entries: 0,
        file_bytes: 0,
        dirs: Vec::new(),
    };
    for entry in archive.entries().map_err(format_err)? {
        let entry = entry.map_err(format_err)?;
        unpacker.entry(entry)?;
    }
    unpacker.finish_dirs()?;
    let (entries, file_bytes) = (unpacker.entries, unpacker.file_bytes);
    // The diff id covers the whole stream, including the zero blocks after the last entry.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(format_err)?;
    Ok(UnpackStats {
        entries,
        file_bytes,
        diff_id: format!("sha256:{}", hex::encode(rest.hasher.finalize())),
    })
}

/// Metadata applied to a directory after all its children are written.
struct DirMeta {
    path: PathBuf,
    mode: u32,
    mtime: Mtime,
}

/// A modification time: whole seconds from the tar header, nanoseconds from a PAX
/// `mtime` record when the layer has one (overlayfs unpacks keep them, so must we).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mtime {
    secs: u64,
    nanos: u32,
}

struct Unpacker<'a> {
    dest: &'a Path,
    limits: &'a UnpackLimits,
    entries: u64,
    file_bytes: u64,
    dirs: Vec<DirMeta>,
}

/// The entry path as a list of normal components; `..` and absolute paths are refused.
fn safe_components(raw: &[u8]) -> Result<Vec<&OsStr>, String> {
    if raw.len() > MAX_PATH_LEN {
        return Err(format!("path longer than {MAX_PATH_LEN} bytes"));
    }
    if raw.contains(&0) {
        return Err("path contains NUL".into());
    }
    if raw.first() == Some(&b'/') {
        return Err("absolute path".into());
    }
    let mut out = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err("path contains `..`".into()),
            p => out.push(OsStr::from_bytes(p)),
        }
    }
    Ok(out)
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

impl Unpacker<'_> {
    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), UnpackError> {
        self.entries += 1;
        if self.entries > self.limits.max_entries {
            return Err(UnpackError::Limit(format!(
                "more than {} entries",
                self.limits.max_entries
            )));
        }
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader
                | tar::EntryType::XHeader
                | tar::EntryType::GNULongName
                | tar::EntryType::GNULongLink
        ) {
            return Ok(());
        }
        let raw_path = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw_path).into_owned();
        let pax_mtime = pax_mtime(&mut entry);
        let unsafe_entry = |reason: String| UnpackError::Unsafe {
            path: shown.clone(),
            reason,
        };
        let parts = safe_components(&raw_path).map_err(unsafe_entry)?;
        let Some((name, parents)) = parts.split_last() else {
            // The layer's root directory ("./"): its metadata applies to dest itself.
            if kind == tar::EntryType::Directory {
                let (mode, mtime) = header_mode_mtime(entry.header(), &shown, pax_mtime)?;
                self.set_owner(entry.header(), self.dest)?;
                self.dirs.push(DirMeta {
                    path: self.dest.to_path_buf(),
                    mode,
                    mtime,
                });
            }
            return Ok(());
        };
        let parent = self.make_parents(parents, &shown)?;
        let name_bytes = name.as_bytes();
        if name_bytes == OPAQUE_MARKER.as_bytes() {
            return set_xattr(&parent, OPAQUE_XATTR, b"y");
        }
        if let Some(hidden) = name_bytes.strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            if hidden.starts_with(WHITEOUT_PREFIX.as_bytes()) {
                // Other `.wh..wh.` names are aufs bookkeeping, meaningless to overlayfs.
                return Ok(());
            }
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(unsafe_entry("whiteout of nothing".into()));
            }
            let target = parent.join(OsStr::from_bytes(hidden));
            remove_existing(&target)?;
            return mknod(&target, libc::S_IFCHR, 0, 0, 0);
        }
        let path = parent.join(name);
        let header = entry.header().clone();
        let (mode, mtime) = header_mode_mtime(&header, &shown, pax_mtime)?;
        match kind {
            tar::EntryType::Directory => {
                match lstat(&path).map_err(io_err("stat", &path))? {
                    Some(m) if m.is_dir() => {}
                    Some(_) => {
                        remove_existing(&path)?;
                        make_dir(&path)?;
                    }
                    None => make_dir(&path)?,
                }
                self.set_owner(&header, &path)?;
                self.set_xattrs(&mut entry, &path, &shown)?;
                self.dirs.push(DirMeta { path, mode, mtime });
                return Ok(());
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = header.entry_size().map_err(format_err)?;
                if self.file_bytes.saturating_add(size) > self.limits.max_file_bytes {
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
                let copied = io::copy(&mut entry, &mut file).map_err(format_err)?;
                if copied != size {
                    return Err(UnpackError::Format(format!(
                        "{shown}: {copied} bytes of {size}"
                    )));
                }
                self.file_bytes += copied;
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| unsafe_entry("symlink without a target".into()))?
                    .into_owned();
                if target.is_empty() || target.len() > MAX_PATH_LEN || target.contains(&0) {
                    return Err(unsafe_entry(
                        "symlink target empty, too long or with NUL".into(),
                    ));
                }
                remove_existing(&path)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &path)
                    .map_err(io_err("symlink", &path))?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| unsafe_entry("hard link without a target".into()))?
                    .into_owned();
                let target_parts = safe_components(&target)
                    .map_err(|why| unsafe_entry(format!("hard link target: {why}")))?;
                let Some((target_name, target_parents)) = target_parts.split_last() else {
                    return Err(unsafe_entry("hard link to the layer root".into()));
                };
                let target_dir = self
                    .existing_parents(target_parents)
                    .map_err(|why| unsafe_entry(format!("hard link target: {why}")))?;
                let target_path = target_dir.join(target_name);
                match lstat(&target_path).map_err(io_err("stat", &target_path))? {
                    Some(m) if !m.is_dir() => {}
                    Some(_) => return Err(unsafe_entry("hard link to a directory".into())),
                    None => {
                        return Err(unsafe_entry(
                            "hard link to a file that is not in this layer".into(),
                        ));
                    }
                }
                if target_path == path {
                    return Ok(());
                }
                remove_existing(&path)?;
                std::fs::hard_link(&target_path, &path).map_err(io_err("link", &path))?;
                // The link shares the target's inode and so its metadata.
                return Ok(());
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let file_type = match kind {
                    tar::EntryType::Char => libc::S_IFCHR,
                    tar::EntryType::Block => libc::S_IFBLK,
                    _ => libc::S_IFIFO,
                };
                // A fifo has no device numbers; some writers leave the fields blank.
                let (major, minor) = if kind == tar::EntryType::Fifo {
                    (0, 0)
                } else {
                    (
                        header.device_major().map_err(format_err)?.unwrap_or(0),
                        header.device_minor().map_err(format_err)?.unwrap_or(0),
                    )
                };
                remove_existing(&path)?;
                mknod(&path, file_type, mode & 0o777, major, minor)?;
            }
            other => {
                return Err(UnpackError::Unsupported {
                    path: shown,
                    reason: format!("tar entry type {other:?}"),
                });
            }
        }
        self.set_owner(&header, &path)?;
        self.set_xattrs(&mut entry, &path, &shown)?;
        if kind != tar::EntryType::Symlink {
            chmod(&path, mode)?;
        }
        set_mtime(&path, mtime)
    }

    /// Creates missing parent directories (0755) of an entry; refuses a parent that is a
    /// symlink or not a directory. Returns the parent path.
    fn make_parents(&self, parents: &[&OsStr], shown: &str) -> Result<PathBuf, UnpackError> {
        let mut dir = self.dest.to_path_buf();
        for part in parents {
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
                None => make_dir(&dir)?,
            }
        }
        Ok(dir)
    }

    /// The existing directory `parents` names, without following symlinks.
    fn existing_parents(&self, parents: &[&OsStr]) -> Result<PathBuf, String> {
        let mut dir = self.dest.to_path_buf();
        for part in parents {
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

    fn set_owner(&self, header: &tar::Header, path: &Path) -> Result<(), UnpackError> {
        let uid = header.uid().map_err(format_err)?;
        let gid = header.gid().map_err(format_err)?;
        let (Ok(uid), Ok(gid)) = (u32::try_from(uid), u32::try_from(gid)) else {
            return Err(UnpackError::Unsafe {
                path: path.display().to_string(),
                reason: "uid or gid out of range".into(),
            });
        };
        let c = cstring(path)?;
        // SAFETY: c is a valid NUL-terminated path.
        let rc = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
        if rc != 0 && !is_root() {
            // An unprivileged unpack (tests) keeps the caller's ownership.
            return Ok(());
        }
        os_check(rc, "chown", path)
    }

    fn set_xattrs<R: Read>(
        &self,
        entry: &mut tar::Entry<'_, R>,
        path: &Path,
        shown: &str,
    ) -> Result<(), UnpackError> {
        let Some(extensions) = entry.pax_extensions().map_err(format_err)? else {
            return Ok(());
        };
        for ext in extensions {
            let ext = ext.map_err(format_err)?;
            let Ok(key) = ext.key() else { continue };
            let Some(name) = key.strip_prefix(PAX_XATTR) else {
                continue;
            };
            let value = ext.value_bytes();
            if value.len() > MAX_XATTR_VALUE || name.is_empty() {
                return Err(UnpackError::Unsafe {
                    path: shown.to_owned(),
                    reason: format!(
                        "xattr {name:?} empty name or value over {MAX_XATTR_VALUE} bytes"
                    ),
                });
            }
            set_xattr(path, name, value)?;
        }
        Ok(())
    }

    /// Directory modes and mtimes, deepest first, once nothing more is written into them.
    fn finish_dirs(&mut self) -> Result<(), UnpackError> {
        self.dirs
            .sort_by_key(|d| std::cmp::Reverse(d.path.components().count()));
        for dir in &self.dirs {
            // A later entry may have replaced this directory, or one above it, with a
            // symlink: chmod follows links, so only a path of real directories is touched.
            if !self.is_real_dir_path(&dir.path)? {
                continue;
            }
            chmod(&dir.path, dir.mode)?;
            set_mtime(&dir.path, dir.mtime)?;
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

fn header_mode_mtime(
    header: &tar::Header,
    shown: &str,
    pax_mtime: Option<Mtime>,
) -> Result<(u32, Mtime), UnpackError> {
    let mode = header
        .mode()
        .map_err(|e| UnpackError::Format(format!("{shown}: mode: {e}")))?;
    let mtime = match pax_mtime {
        Some(m) => m,
        None => Mtime {
            secs: header
                .mtime()
                .map_err(|e| UnpackError::Format(format!("{shown}: mtime: {e}")))?,
            nanos: 0,
        },
    };
    Ok((mode & 0o7777, mtime))
}

/// The entry's PAX `mtime` record, if it has a well-formed one (`SECS[.FRACTION]`); an
/// unreadable or malformed record falls back to the header's whole seconds.
fn pax_mtime<R: Read>(entry: &mut tar::Entry<'_, R>) -> Option<Mtime> {
    let extensions = entry.pax_extensions().ok()??;
    for ext in extensions {
        let Ok(ext) = ext else { continue };
        if ext.key_bytes() == b"mtime" {
            return parse_pax_time(ext.value_bytes());
        }
    }
    None
}

/// Parses a PAX time such as `1700000000.123456789` (at most nanosecond precision is
/// kept; times before 1970 are refused).
fn parse_pax_time(value: &[u8]) -> Option<Mtime> {
    let text = std::str::from_utf8(value).ok()?;
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    if secs.is_empty() || !secs.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs: u64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let nanos = if digits.is_empty() {
        0
    } else {
        digits.parse::<u32>().ok()? * 10u32.pow(9 - digits.len() as u32)
    };
    Some(Mtime { secs, nanos })
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

fn set_mtime(path: &Path, mtime: Mtime) -> Result<(), UnpackError> {
    let c = cstring(path)?;
    let secs = libc::time_t::try_from(mtime.secs).unwrap_or(libc::time_t::MAX);
    let nanos = libc::c_long::from(mtime.nanos.min(999_999_999));
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
