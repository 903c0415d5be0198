//! Streaming, bounded, strict walker over an uncompressed tar stream (an OCI layer).
//!
//! [`TarWalker`] reads any [`Read`] once, front to back, and yields one normalized
//! [`Entry`] per member, with exact byte offsets: [`Entry::header_offset`] is where the
//! member's *first* header block starts (including any PAX `x` / GNU `L`/`K` extension
//! headers in front of it) and [`Entry::offset`] is where a regular file's data starts.
//! The caller may read the current entry's data through [`TarWalker::read_data`] (or the
//! [`Read`] impl); whatever it leaves unread is skipped by the next
//! [`TarWalker::next_entry`] call. [`walk`] collects the whole file table.
//!
//! # Accepted
//!
//! * Header formats: POSIX ustar (the 155-byte `prefix` field is joined to `name`), the
//!   `star` variant of ustar (131-byte prefix), old GNU (`"ustar  \0"` magic; its
//!   atime/ctime/sparse area is ignored) and v7 (any other magic; no user/group names).
//! * Numeric fields in octal (leading/trailing spaces and NULs allowed, the value ends at
//!   the first NUL, like Go's `archive/tar`) or GNU base-256 (high bit of the first byte
//!   set; two's complement, so negative mtimes work). The checksum field must be octal and
//!   match either the unsigned or the signed byte sum, as GNU tar checks.
//! * Entry types `0`, `\0`, `7` (regular file; a trailing `/` in the name makes it a
//!   directory, as GNU tar does), `1` hard link, `2` symlink, `3` char device, `4` block
//!   device, `5` directory, `6` FIFO.
//! * GNU long names (`L`) and long link targets (`K`).
//! * PAX extended headers (`x`): `path`, `linkpath`, `size` (sizes beyond the 8 GiB octal
//!   limit), `mtime` (with a fractional part, kept to the nanosecond; negative times are
//!   handled like Go does), `uid`, `gid`, `uname`, `gname`, `SCHILY.devmajor`,
//!   `SCHILY.devminor`, and `SCHILY.xattr.NAME` (binary values allowed). A record with an
//!   empty value removes the field, so the header's own field is used (POSIX); an empty
//!   `SCHILY.xattr.*` value is kept as an empty attribute. Other keys (`atime`, `ctime`,
//!   `comment`, `charset`, `hdrcharset`, `LIBARCHIVE.*`, other `SCHILY.*`, vendor keys) are
//!   ignored, as POSIX asks. When a key appears twice, the last record wins.
//! * PAX global headers (`g`) are **ignored**: their body is skipped (bounded by
//!   [`Limits::max_extension_bytes`]) and nothing in it applies to later entries. This is
//!   what Docker and containerd (Go's `archive/tar`) do, so ferry sees the same file table
//!   they extract.
//! * Whiteouts (`.wh.name`, `.wh..wh..opq`) are ordinary entries here; see
//!   [`Entry::whiteout`].
//!
//! # Refused (an [`Error::Tar`] naming the entry and the offset of its first header)
//!
//! * GNU sparse files (`S` typeflag or any PAX `GNU.sparse.*` record) and every other
//!   typeflag (`D`, `M`, `N`, `V`, `X`, vendor letters, ...).
//! * Bad header checksums, invalid or out-of-range numeric fields (uid/gid/device numbers
//!   must fit in 32 bits, sizes in 63 bits), non-UTF-8 paths, link targets, user and group
//!   names, paths containing a `..` component (names and hard link targets), non-directory
//!   entries for the layer root, empty names and empty link targets.
//! * Non-regular entries that claim data (a non-zero size on a directory, link, device or
//!   FIFO): other readers disagree on whether such data exists.
//! * Hard links whose normalized target does not name an earlier regular file (or hard
//!   link to one) of the same stream, and the other orders of entries whose meaning would
//!   depend on the extractor (writing beneath a symlink, a file replacing a directory,
//!   whiteouts of paths the layer also adds, ...): see [`shape`], so that `ferry pull`'s
//!   unpacker and a lazy mount, which both read layers through this walker, cannot differ.
//! * Extended attributes Linux could not set: names over 255 bytes, values over 64 KiB.
//! * Malformed PAX records (length field not decimal, not followed by a space, too small,
//!   running past the body, record not ending in a newline, no `=`, empty key, NUL in a
//!   path or name), two extension headers of the same kind for one entry, a PAX `path`
//!   that disagrees with a GNU long name (or `linkpath` with a long link), a global header
//!   between an extension header and its entry, and extension bodies larger than
//!   [`Limits::max_extension_bytes`]. More than [`Limits::max_entries`] entries.
//! * Truncation anywhere: EOF inside a header block, inside an extension body or its
//!   padding, inside file data or its padding, right after an extension header, and EOF at
//!   a header boundary *without* an end-of-archive marker.
//!
//! # End of archive
//!
//! The archive ends at its first all-zero block. Real layers have two zero blocks there;
//! one zero block followed by EOF is accepted too. A zero block followed by a partial
//! block is a truncation error, and a zero block followed by a non-zero block is refused
//! (GNU tar would stop there while `tar --ignore-zeros` would read on; ferry refuses the
//! ambiguity, as Go's reader does). Nothing after the two zero blocks is read: the record
//! padding tar writers add is left in the reader, which [`TarWalker::into_inner`] returns.
//! A stream that ends cleanly at a header boundary but has no zero block at all is
//! **refused** as truncated (Go's reader would accept it).
//!
//! # Bounds
//!
//! Memory per member is one 512-byte header block plus the extension bodies, each capped
//! by [`Limits::max_extension_bytes`] before anything is allocated and read incrementally;
//! sizes claimed by headers are never allocated. Across the stream, the walker keeps one
//! 64-bit hash and a byte per distinct path and parent (for the [`shape`] rules; hashes
//! are keyed per walker, so a stream cannot craft collisions) and a 64 KiB skip buffer.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read};

use crate::entry::{Entry, EntryKind};
use crate::error::{Error, Result};

pub mod shape;
use shape::Shape;

/// Size of a tar block.
const BLOCK: usize = 512;
/// [`BLOCK`] as a stream offset.
pub(crate) const BLOCK_U64: u64 = BLOCK as u64;
/// Size of the reusable buffer used to skip file data the caller does not read.
const SKIP_BUF_LEN: usize = 64 * 1024;
/// Longest extended attribute name Linux sets (XATTR_NAME_MAX).
const MAX_XATTR_NAME: usize = 255;
/// Largest extended attribute value Linux sets (XATTR_SIZE_MAX).
const MAX_XATTR_VALUE: usize = 64 << 10;

/// Bounds on what one tar stream may make the walker hold or do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest body of one extension header (PAX `x`/`g`, GNU `L`/`K`), in bytes.
    pub max_extension_bytes: u64,
    /// Largest number of entries (members other than extension headers) in one stream.
    pub max_entries: u64,
}

impl Limits {
    /// Default for [`Limits::max_extension_bytes`]: 1 MiB.
    pub const DEFAULT_MAX_EXTENSION_BYTES: u64 = 1 << 20;
    /// Default for [`Limits::max_entries`]: ten million.
    pub const DEFAULT_MAX_ENTRIES: u64 = 10_000_000;
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_extension_bytes: Self::DEFAULT_MAX_EXTENSION_BYTES,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
        }
    }
}

/// Where the walker is in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// More entries may follow.
    Active,
    /// The end-of-archive marker was read.
    Ended,
    /// An error was returned; the stream position is no longer meaningful.
    Failed,
}

/// A streaming tar reader yielding normalized [`Entry`] values; see the module docs for
/// what it accepts and refuses.
pub struct TarWalker<R> {
    reader: R,
    limits: Limits,
    /// Bytes consumed from `reader`.
    pos: u64,
    /// Unread file data of the current entry.
    remaining: u64,
    /// Padding after the current entry's data (not yet consumed).
    padding: u64,
    /// Path of the current entry, for error messages.
    cur_path: String,
    /// First header offset of the current entry, for error messages.
    cur_offset: u64,
    /// Entries yielded so far.
    entries: u64,
    state: State,
    /// The paths seen so far, for the layer shape rules.
    shape: Shape,
    /// Reusable buffer for skipping data; allocated on first use.
    skip_buf: Vec<u8>,
}

impl<R> fmt::Debug for TarWalker<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TarWalker")
            .field("limits", &self.limits)
            .field("position", &self.pos)
            .field("entries", &self.entries)
            .field("current", &self.cur_path)
            .field("data_remaining", &self.remaining)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// Builds an [`Error::Tar`].
fn tar_err(entry: impl Into<String>, offset: u64, reason: impl Into<String>) -> Error {
    Error::Tar {
        entry: entry.into(),
        offset,
        reason: reason.into(),
    }
}

/// Padding needed after `size` bytes of data to reach a block boundary.
fn padding_for(size: u64) -> u64 {
    (BLOCK_U64 - size % BLOCK_U64) % BLOCK_U64
}

/// Extension headers seen in front of the entry being read.
#[derive(Debug, Default)]
struct Pending {
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    pax: Option<Pax>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.long_name.is_none() && self.long_link.is_none() && self.pax.is_none()
    }

    /// The best name known for the entry before its own header is parsed.
    fn name_hint(&self) -> String {
        let pax_path = self.pax.as_ref().and_then(|p| p.path.as_deref());
        match pax_path.or(self.long_name.as_deref()) {
            Some(p) => String::from_utf8_lossy(p).into_owned(),
            None => String::new(),
        }
    }
}

/// The records of one PAX extended header that ferry uses.
#[derive(Debug, Default)]
struct Pax {
    path: Option<Vec<u8>>,
    linkpath: Option<Vec<u8>>,
    size: Option<u64>,
    mtime: Option<(i64, u32)>,
    uid: Option<u32>,
    gid: Option<u32>,
    uname: Option<String>,
    gname: Option<String>,
    devmajor: Option<u32>,
    devminor: Option<u32>,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// The first `GNU.sparse.*` key seen, if any (sparse files are refused).
    sparse: Option<String>,
}

/// Header layout flavours that matter for parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// POSIX ustar (`"ustar\0"`): 155-byte prefix.
    Ustar,
    /// Schily's star (`"ustar\0"` plus `"tar\0"` trailer): 131-byte prefix.
    Star,
    /// Old GNU (`"ustar "` + `" \0"`): no prefix.
    Gnu,
    /// Anything else: v7, no prefix, no user/group names.
    V7,
}

impl Format {
    fn of(h: &[u8; BLOCK]) -> Format {
        let magic = &h[257..263];
        if magic == b"ustar\0" {
            if &h[508..512] == b"tar\0" {
                Format::Star
            } else {
                Format::Ustar
            }
        } else if magic == b"ustar " && &h[263..265] == b" \0" {
            Format::Gnu
        } else {
            Format::V7
        }
    }
}

/// The bytes of a NUL-terminated field, without the terminator and what follows it.
fn cstr(field: &[u8]) -> &[u8] {
    match field.iter().position(|&b| b == 0) {
        Some(i) => &field[..i],
        None => field,
    }
}

/// The path stored in the header block itself (name, joined with the prefix for ustar).
fn header_path(h: &[u8; BLOCK], format: Format) -> Vec<u8> {
    let name = cstr(&h[0..100]);
    let prefix = match format {
        Format::Ustar => cstr(&h[345..500]),
        Format::Star => cstr(&h[345..476]),
        Format::Gnu | Format::V7 => &[],
    };
    if prefix.is_empty() {
        name.to_vec()
    } else {
        let mut p = Vec::with_capacity(prefix.len() + 1 + name.len());
        p.extend_from_slice(prefix);
        p.push(b'/');
        p.extend_from_slice(name);
        p
    }
}

/// An octal field: leading and trailing spaces/NULs trimmed, cut at the first NUL, the
/// rest must be octal digits; empty means 0 (what Go's `archive/tar` accepts).
fn parse_octal(field: &[u8]) -> Option<u64> {
    let is_pad = |b: &u8| *b == b' ' || *b == 0;
    let start = field.iter().position(|b| !is_pad(b)).unwrap_or(field.len());
    let end = field
        .iter()
        .rposition(|b| !is_pad(b))
        .map_or(start, |i| i + 1);
    let digits = cstr(field.get(start..end).unwrap_or(&[]));
    let mut v: u64 = 0;
    for &b in digits {
        if !(b'0'..=b'7').contains(&b) {
            return None;
        }
        v = v.checked_mul(8)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

/// A numeric header field, octal or GNU base-256 (two's complement).
fn parse_numeric(field: &[u8]) -> Option<i128> {
    let (&first, rest) = field.split_first()?;
    if first & 0x80 == 0 {
        return parse_octal(field).map(i128::from);
    }
    // Base-256: the flag bit is dropped, bit 6 of the first byte is the sign.
    let mut v: i128 = if first & 0x40 != 0 {
        i128::from((first | 0x80) as i8)
    } else {
        i128::from(first & 0x7f)
    };
    for &b in rest {
        v = v.checked_mul(256)?.checked_add(i128::from(b))?;
    }
    Some(v)
}

fn numeric_u64(field: &[u8]) -> Option<u64> {
    u64::try_from(parse_numeric(field)?).ok()
}

fn numeric_u32(field: &[u8]) -> Option<u32> {
    u32::try_from(parse_numeric(field)?).ok()
}

fn numeric_i64(field: &[u8]) -> Option<i64> {
    i64::try_from(parse_numeric(field)?).ok()
}

/// Checks the header checksum against both the unsigned and the signed byte sums (the
/// checksum field itself counts as eight spaces). Returns the three numbers on mismatch.
fn check_checksum(h: &[u8; BLOCK]) -> std::result::Result<(), String> {
    let mut unsigned: i64 = 0;
    let mut signed: i64 = 0;
    for (i, &b) in h.iter().enumerate() {
        let b = if (148..156).contains(&i) { b' ' } else { b };
        unsigned += i64::from(b);
        signed += i64::from(b as i8);
    }
    let stored = if h[148] & 0x80 != 0 {
        None
    } else {
        parse_octal(&h[148..156]).and_then(|v| i64::try_from(v).ok())
    };
    match stored {
        Some(s) if s == unsigned || s == signed => Ok(()),
        Some(s) => Err(format!(
            "header checksum mismatch: stored {s}, computed {unsigned} (unsigned) / {signed} (signed)"
        )),
        None => Err("header checksum field is not an octal number (not a tar header?)".into()),
    }
}

/// Describes a typeflag byte for messages.
fn describe_typeflag(t: u8) -> String {
    if t.is_ascii_graphic() {
        format!("'{}'", t as char)
    } else {
        format!("0x{t:02x}")
    }
}

/// A PAX decimal number: ASCII digits only.
fn parse_pax_u64(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    let mut n: u64 = 0;
    for &b in v {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(n)
}

/// A PAX time: `[-]SECONDS[.FRACTION]`; the fraction is kept to nanoseconds (extra digits
/// are truncated). Negative times with a fraction are floored, like Go does.
fn parse_pax_time(v: &[u8]) -> Option<(i64, u32)> {
    let (neg, v) = match v.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, v),
    };
    let (secs, frac) = match v.iter().position(|&b| b == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &[][..]),
    };
    let secs = i64::try_from(parse_pax_u64(secs)?).ok()?;
    let mut nsec: u32 = 0;
    for (i, &b) in frac.iter().enumerate() {
        if !b.is_ascii_digit() {
            return None;
        }
        if i < 9 {
            nsec = nsec * 10 + u32::from(b - b'0');
        }
    }
    for _ in frac.len()..9 {
        nsec *= 10;
    }
    if !neg {
        Some((secs, nsec))
    } else if nsec == 0 {
        Some((-secs, 0))
    } else {
        Some(((-secs).checked_sub(1)?, 1_000_000_000 - nsec))
    }
}

/// A PAX path-like value: no NUL allowed; empty means "unset".
fn pax_bytes(key: &str, v: &[u8]) -> std::result::Result<Option<Vec<u8>>, String> {
    if v.contains(&0) {
        return Err(format!("PAX record {key:?} contains a NUL byte"));
    }
    Ok((!v.is_empty()).then(|| v.to_vec()))
}

/// A PAX user/group name: UTF-8, no NUL; empty means "unset".
fn pax_string(key: &str, v: &[u8]) -> std::result::Result<Option<String>, String> {
    match pax_bytes(key, v)? {
        None => Ok(None),
        Some(b) => String::from_utf8(b)
            .map(Some)
            .map_err(|_| format!("PAX record {key:?} is not valid UTF-8")),
    }
}

/// A PAX number that must fit in 32 bits; empty means "unset".
fn pax_u32(key: &str, v: &[u8]) -> std::result::Result<Option<u32>, String> {
    if v.is_empty() {
        return Ok(None);
    }
    parse_pax_u64(v)
        .and_then(|n| u32::try_from(n).ok())
        .map(Some)
        .ok_or_else(|| {
            format!(
                "PAX record {key:?} is not a 32-bit decimal number: {:?}",
                String::from_utf8_lossy(v)
            )
        })
}

/// Applies one PAX record of a local (`x`) header.
fn apply_pax_record(pax: &mut Pax, key: &str, value: &[u8]) -> std::result::Result<(), String> {
    if key.starts_with("GNU.sparse.") {
        // Refused once the entry's name is known (see `build_entry`).
        pax.sparse.get_or_insert_with(|| key.to_string());
        return Ok(());
    }
    if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
        if name.is_empty() || name.contains('\0') || name.len() > MAX_XATTR_NAME {
            return Err(format!(
                "invalid extended attribute name in PAX record {key:?}"
            ));
        }
        if value.len() > MAX_XATTR_VALUE {
            return Err(format!(
                "extended attribute {name:?} has {} bytes, more than Linux's {MAX_XATTR_VALUE}",
                value.len()
            ));
        }
        pax.xattrs.insert(name.to_string(), value.to_vec());
        return Ok(());
    }
    match key {
        "path" => pax.path = pax_bytes(key, value)?,
        "linkpath" => pax.linkpath = pax_bytes(key, value)?,
        "uname" => pax.uname = pax_string(key, value)?,
        "gname" => pax.gname = pax_string(key, value)?,
        "uid" => pax.uid = pax_u32(key, value)?,
        "gid" => pax.gid = pax_u32(key, value)?,
        "SCHILY.devmajor" => pax.devmajor = pax_u32(key, value)?,
        "SCHILY.devminor" => pax.devminor = pax_u32(key, value)?,
        "size" => {
            pax.size = if value.is_empty() {
                None
            } else {
                Some(
                    parse_pax_u64(value)
                        .filter(|&n| i64::try_from(n).is_ok())
                        .ok_or_else(|| {
                            format!(
                                "PAX size is not a valid size: {:?}",
                                String::from_utf8_lossy(value)
                            )
                        })?,
                )
            }
        }
        "mtime" => {
            pax.mtime = if value.is_empty() {
                None
            } else {
                Some(parse_pax_time(value).ok_or_else(|| {
                    format!(
                        "PAX mtime is not a valid time: {:?}",
                        String::from_utf8_lossy(value)
                    )
                })?)
            }
        }
        _ => {}
    }
    Ok(())
}

/// Parses the body of a PAX extended header (`"%d %s=%s\n"` records).
fn parse_pax(body: &[u8]) -> std::result::Result<Pax, String> {
    let mut pax = Pax::default();
    let mut rest = body;
    let mut at = 0usize;
    while !rest.is_empty() {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || digits > 19 {
            return Err(format!(
                "malformed PAX record at byte {at}: length is not a decimal number"
            ));
        }
        if rest.get(digits) != Some(&b' ') {
            return Err(format!(
                "malformed PAX record at byte {at}: length is not followed by a space"
            ));
        }
        let len = parse_pax_u64(&rest[..digits])
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("malformed PAX record at byte {at}: length out of range"))?;
        if len > rest.len() {
            return Err(format!(
                "malformed PAX record at byte {at}: length {len} runs past the end of the header ({} bytes left)",
                rest.len()
            ));
        }
        // "<digits> k=\n" is the smallest possible record.
        if len < digits + 4 {
            return Err(format!(
                "malformed PAX record at byte {at}: length {len} is too small"
            ));
        }
        let record = &rest[digits + 1..len];
        let Some((&b'\n', kv)) = record.split_last() else {
            return Err(format!(
                "malformed PAX record at byte {at}: length {len} does not end at a newline"
            ));
        };
        let Some(eq) = kv.iter().position(|&b| b == b'=') else {
            return Err(format!(
                "malformed PAX record at byte {at}: no '=' in the record"
            ));
        };
        let (key, value) = (&kv[..eq], &kv[eq + 1..]);
        if key.is_empty() {
            return Err(format!("malformed PAX record at byte {at}: empty key"));
        }
        let key = std::str::from_utf8(key)
            .map_err(|_| format!("malformed PAX record at byte {at}: key is not UTF-8"))?;
        apply_pax_record(&mut pax, key, value)?;
        at += len;
        rest = &rest[len..];
    }
    Ok(pax)
}

/// A NUL-terminated UTF-8 user or group name from the header.
fn header_name(field: &[u8]) -> Option<String> {
    String::from_utf8(cstr(field).to_vec()).ok()
}

/// Normalizes a tar path: strips leading `/` and `./`, trailing `/`, collapses `//` and
/// `.` components. Returns `None` when a component is `..`. The root becomes `""`.
pub fn normalize_path(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    for comp in raw.split('/') {
        match comp {
            "" | "." => {}
            ".." => return None,
            c => {
                if !out.is_empty() {
                    out.push('/');
                }
                out.push_str(c);
            }
        }
    }
    Some(out)
}

/// Reads from `reader` until `buf` is full or EOF; returns the number of bytes read.
fn read_full<R: Read>(reader: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n.min(buf.len() - filled),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Discards up to `n` bytes of `reader` through `buf`; returns how many were discarded
/// (fewer than `n` only at EOF). `pos` is advanced as bytes are consumed.
fn discard<R: Read>(reader: &mut R, buf: &mut [u8], n: u64, pos: &mut u64) -> io::Result<u64> {
    let mut left = n;
    while left > 0 {
        let chunk = usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()));
        match reader.read(&mut buf[..chunk]) {
            Ok(0) => break,
            Ok(r) => {
                let r = r.min(chunk) as u64;
                *pos += r;
                left -= r;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n - left)
}

impl<R: Read> TarWalker<R> {
    /// A walker with the default [`Limits`].
    pub fn new(reader: R) -> Self {
        Self::with_limits(reader, Limits::default())
    }

    /// A walker with the given limits.
    pub fn with_limits(reader: R, limits: Limits) -> Self {
        TarWalker {
            reader,
            limits,
            pos: 0,
            remaining: 0,
            padding: 0,
            cur_path: String::new(),
            cur_offset: 0,
            entries: 0,
            state: State::Active,
            shape: Shape::default(),
            skip_buf: Vec::new(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes of the stream consumed so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// Number of entries yielded so far.
    pub fn entry_count(&self) -> u64 {
        self.entries
    }

    /// Bytes of the current entry's file data not read yet.
    pub fn data_remaining(&self) -> u64 {
        self.remaining
    }

    /// The underlying reader. Reading from it directly would desynchronize the walker, so
    /// only a shared reference is offered (e.g. to ask a decoder where it is).
    pub fn get_ref(&self) -> &R {
        &self.reader
    }

    /// Gives the underlying reader back, positioned [`TarWalker::position`] bytes in
    /// (after the end-of-archive marker once [`TarWalker::next_entry`] returned `None`).
    pub fn into_inner(self) -> R {
        self.reader
    }

    /// The next entry, or `None` at a proper end of archive. Data of the previous entry
    /// that the caller did not read is skipped. After an error, every later call fails.
    pub fn next_entry(&mut self) -> Result<Option<Entry>> {
        match self.state {
            State::Ended => return Ok(None),
            State::Failed => {
                return Err(tar_err(
                    self.cur_path.clone(),
                    self.cur_offset,
                    "the walker stopped at an earlier error",
                ));
            }
            State::Active => {}
        }
        let result = self.next_inner();
        match &result {
            Ok(Some(_)) => {}
            Ok(None) => self.state = State::Ended,
            Err(_) => self.state = State::Failed,
        }
        result
    }

    /// Reads the current entry's file data; returns 0 at its end (and before the first
    /// entry, after the last one, and for entries without data). A stream that ends inside
    /// the data is an [`io::ErrorKind::UnexpectedEof`] error.
    pub fn read_data(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = usize::try_from(self.remaining).map_or(buf.len(), |r| r.min(buf.len()));
        let n = self.reader.read(&mut buf[..want])?.min(want);
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "tar: entry {:?} at offset {}: truncated archive: stream ends at offset {} with {} bytes of its data missing",
                    self.cur_path, self.cur_offset, self.pos, self.remaining
                ),
            ));
        }
        self.pos += n as u64;
        self.remaining -= n as u64;
        Ok(n)
    }

    /// Skips whatever is left of the current entry's data and padding.
    pub fn skip_data(&mut self) -> Result<()> {
        let data_left = self.remaining;
        let total = data_left + self.padding;
        if total == 0 {
            return Ok(());
        }
        let skipped = if total <= BLOCK_U64 {
            let mut small = [0u8; BLOCK];
            discard(&mut self.reader, &mut small, total, &mut self.pos)
        } else {
            if self.skip_buf.is_empty() {
                self.skip_buf = vec![0; SKIP_BUF_LEN];
            }
            discard(&mut self.reader, &mut self.skip_buf, total, &mut self.pos)
        };
        let skipped = match skipped {
            Ok(s) => s,
            Err(e) => {
                self.state = State::Failed;
                return Err(e.into());
            }
        };
        self.remaining = data_left.saturating_sub(skipped);
        self.padding = total - skipped - self.remaining;
        if skipped < total {
            self.state = State::Failed;
            let place = if skipped < data_left {
                "inside its file data"
            } else {
                "inside the padding after its data"
            };
            return Err(tar_err(
                self.cur_path.clone(),
                self.cur_offset,
                format!(
                    "truncated archive: stream ends at offset {} {place}",
                    self.pos
                ),
            ));
        }
        Ok(())
    }

    /// Reads one block at a header boundary; returns the bytes read (0 at clean EOF).
    fn read_block(&mut self, block: &mut [u8; BLOCK]) -> io::Result<usize> {
        let n = read_full(&mut self.reader, block)?;
        self.pos += n as u64;
        Ok(n)
    }

    /// Reads the body of an extension header (`size` already checked against the limit)
    /// and skips its padding.
    fn read_ext_body(&mut self, size: u64, what: &str, hint: &str, start: u64) -> Result<Vec<u8>> {
        let mut body = Vec::new();
        let res = (&mut self.reader).take(size).read_to_end(&mut body);
        self.pos += body.len() as u64;
        res?;
        let pad = padding_for(size);
        let mut small = [0u8; BLOCK];
        let skipped = discard(&mut self.reader, &mut small, pad, &mut self.pos)?;
        if (body.len() as u64) < size || skipped < pad {
            return Err(tar_err(
                hint,
                start,
                format!(
                    "truncated archive: stream ends at offset {} inside a {what} body",
                    self.pos
                ),
            ));
        }
        Ok(body)
    }

    /// Skips the body of an ignored extension header (a PAX global header) and its padding.
    fn skip_ext_body(&mut self, size: u64, hint: &str, start: u64) -> Result<()> {
        let total = size + padding_for(size);
        if self.skip_buf.is_empty() {
            self.skip_buf = vec![0; SKIP_BUF_LEN];
        }
        let skipped = discard(&mut self.reader, &mut self.skip_buf, total, &mut self.pos)?;
        if skipped < total {
            return Err(tar_err(
                hint,
                start,
                format!(
                    "truncated archive: stream ends at offset {} inside a PAX global header body",
                    self.pos
                ),
            ));
        }
        Ok(())
    }

    /// Reads what follows a zero block. `Ok` means a proper end of archive.
    fn end_of_archive(&mut self, first_zero: u64) -> Result<()> {
        let mut block = [0u8; BLOCK];
        let n = self.read_block(&mut block)?;
        if n == 0 {
            return Ok(());
        }
        if n < BLOCK {
            return Err(tar_err(
                "",
                first_zero,
                format!(
                    "truncated archive: stream ends at offset {} inside the end-of-archive marker",
                    self.pos
                ),
            ));
        }
        if block.iter().any(|&b| b != 0) {
            return Err(tar_err(
                "",
                first_zero,
                "a single zero block is followed by more headers (a lone zero block inside the archive)",
            ));
        }
        Ok(())
    }

    fn next_inner(&mut self) -> Result<Option<Entry>> {
        self.skip_data()?;
        let mut start = self.pos;
        let mut pending = Pending::default();
        let mut block = [0u8; BLOCK];
        loop {
            let header_pos = self.pos;
            let n = self.read_block(&mut block)?;
            if n == 0 {
                return Err(if pending.is_empty() {
                    tar_err(
                        "",
                        header_pos,
                        "truncated archive: stream ends without the end-of-archive marker",
                    )
                } else {
                    tar_err(
                        pending.name_hint(),
                        start,
                        "truncated archive: stream ends after an extension header, before its entry",
                    )
                });
            }
            if n < BLOCK {
                return Err(tar_err(
                    pending.name_hint(),
                    start,
                    format!(
                        "truncated archive: stream ends at offset {} inside a header block",
                        self.pos
                    ),
                ));
            }
            if block.iter().all(|&b| b == 0) {
                if !pending.is_empty() {
                    return Err(tar_err(
                        pending.name_hint(),
                        start,
                        "end-of-archive marker right after an extension header",
                    ));
                }
                self.end_of_archive(header_pos)?;
                return Ok(None);
            }
            let format = Format::of(&block);
            if let Err(reason) = check_checksum(&block) {
                let name = String::from_utf8_lossy(&header_path(&block, format)).into_owned();
                return Err(tar_err(name, start, reason));
            }
            let typeflag = block[156];
            if !matches!(typeflag, b'x' | b'g' | b'L' | b'K') {
                return self.build_entry(&block, format, pending, start).map(Some);
            }

            let hint = pending.name_hint();
            let size = numeric_u64(&block[124..136]).ok_or_else(|| {
                tar_err(
                    hint.clone(),
                    start,
                    format!(
                        "invalid size field in a {} extension header",
                        describe_typeflag(typeflag)
                    ),
                )
            })?;
            if size > self.limits.max_extension_bytes {
                return Err(tar_err(
                    hint,
                    start,
                    format!(
                        "{} extension header of {size} bytes exceeds the limit of {} bytes",
                        describe_typeflag(typeflag),
                        self.limits.max_extension_bytes
                    ),
                ));
            }
            let duplicate = match typeflag {
                b'x' => pending.pax.is_some(),
                b'L' => pending.long_name.is_some(),
                b'K' => pending.long_link.is_some(),
                _ => !pending.is_empty(),
            };
            if duplicate {
                let reason = if typeflag == b'g' {
                    "a PAX global header sits between an extension header and its entry".to_string()
                } else {
                    format!(
                        "two {} extension headers for one entry",
                        describe_typeflag(typeflag)
                    )
                };
                return Err(tar_err(hint, start, reason));
            }
            match typeflag {
                b'g' => {
                    // Global headers are ignored (see the module docs): skip the body.
                    self.skip_ext_body(size, &hint, start)?;
                    start = self.pos;
                }
                b'x' => {
                    let body = self.read_ext_body(size, "PAX header", &hint, start)?;
                    let pax = parse_pax(&body).map_err(|r| tar_err(hint, start, r))?;
                    pending.pax = Some(pax);
                }
                b'L' => {
                    let body = self.read_ext_body(size, "GNU long name", &hint, start)?;
                    pending.long_name = Some(cstr(&body).to_vec());
                }
                _ => {
                    let body = self.read_ext_body(size, "GNU long link", &hint, start)?;
                    pending.long_link = Some(cstr(&body).to_vec());
                }
            }
        }
    }

    /// Builds the entry described by header block `h` and the extensions before it.
    fn build_entry(
        &mut self,
        h: &[u8; BLOCK],
        format: Format,
        pending: Pending,
        start: u64,
    ) -> Result<Entry> {
        let Pending {
            long_name,
            long_link,
            pax,
        } = pending;
        let mut pax = pax.unwrap_or_default();
        if let Some(key) = &pax.sparse {
            let name = match (&pax.path, &long_name) {
                (Some(p), _) | (None, Some(p)) => p.clone(),
                (None, None) => header_path(h, format),
            };
            return Err(tar_err(
                String::from_utf8_lossy(&name).into_owned(),
                start,
                format!("GNU sparse files are not supported (PAX record {key:?})"),
            ));
        }

        let raw_path = match (pax.path.take(), long_name) {
            (Some(p), Some(l)) if p != l => {
                return Err(tar_err(
                    String::from_utf8_lossy(&p).into_owned(),
                    start,
                    format!(
                        "PAX path disagrees with the GNU long name {:?}",
                        String::from_utf8_lossy(&l)
                    ),
                ));
            }
            (Some(p), _) => p,
            (None, Some(l)) => l,
            (None, None) => header_path(h, format),
        };
        let raw_path = String::from_utf8(raw_path).map_err(|e| {
            tar_err(
                String::from_utf8_lossy(e.as_bytes()).into_owned(),
                start,
                "path is not valid UTF-8",
            )
        })?;
        let err = |reason: String| tar_err(raw_path.clone(), start, reason);
        if raw_path.is_empty() {
            return Err(err("empty path".into()));
        }

        let typeflag = h[156];
        let kind = match typeflag {
            b'0' | b'\0' | b'7' if raw_path.ends_with('/') => EntryKind::Dir,
            b'0' | b'\0' | b'7' => EntryKind::File,
            b'1' => EntryKind::Hardlink,
            b'2' => EntryKind::Symlink,
            b'3' => EntryKind::Char,
            b'4' => EntryKind::Block,
            b'5' => EntryKind::Dir,
            b'6' => EntryKind::Fifo,
            b'S' => return Err(err("GNU sparse files ('S') are not supported".into())),
            t => {
                return Err(err(format!(
                    "unsupported entry type {}",
                    describe_typeflag(t)
                )));
            }
        };
        let path = normalize_path(&raw_path)
            .ok_or_else(|| err("path escapes the layer root (\"..\" component)".into()))?;
        if path.is_empty() && kind != EntryKind::Dir {
            return Err(err(format!(
                "the layer root must be a directory, not a {kind:?}"
            )));
        }

        let mode = numeric_u64(&h[100..108]).ok_or_else(|| err("invalid mode field".into()))?;
        let mode = (mode & 0o7777) as u32;
        let uid = match pax.uid {
            Some(u) => u,
            None => numeric_u32(&h[108..116]).ok_or_else(|| err("invalid uid field".into()))?,
        };
        let gid = match pax.gid {
            Some(g) => g,
            None => numeric_u32(&h[116..124]).ok_or_else(|| err("invalid gid field".into()))?,
        };
        let size = match pax.size {
            Some(s) => s,
            None => numeric_u64(&h[124..136])
                .filter(|&s| i64::try_from(s).is_ok())
                .ok_or_else(|| err("invalid size field".into()))?,
        };
        let (mtime, mtime_nsec) = match pax.mtime {
            Some(t) => t,
            None => (
                numeric_i64(&h[136..148]).ok_or_else(|| err("invalid mtime field".into()))?,
                0,
            ),
        };
        let uname = match pax.uname.take() {
            Some(u) => u,
            None if format == Format::V7 => String::new(),
            None => header_name(&h[265..297])
                .ok_or_else(|| err("user name is not valid UTF-8".into()))?,
        };
        let gname = match pax.gname.take() {
            Some(g) => g,
            None if format == Format::V7 => String::new(),
            None => header_name(&h[297..329])
                .ok_or_else(|| err("group name is not valid UTF-8".into()))?,
        };
        if kind != EntryKind::File && size != 0 {
            return Err(err(format!("{kind:?} entry claims {size} bytes of data")));
        }
        let data_offset = self.pos;
        if data_offset
            .checked_add(size)
            .and_then(|end| end.checked_add(padding_for(size)))
            .is_none()
        {
            return Err(err(format!("size {size} is too large")));
        }

        let link_target = match kind {
            EntryKind::Hardlink | EntryKind::Symlink => {
                let raw = match (pax.linkpath.take(), long_link) {
                    (Some(p), Some(l)) if p != l => {
                        return Err(err(format!(
                            "PAX linkpath {:?} disagrees with the GNU long link {:?}",
                            String::from_utf8_lossy(&p),
                            String::from_utf8_lossy(&l)
                        )));
                    }
                    (Some(p), _) => p,
                    (None, Some(l)) => l,
                    (None, None) => cstr(&h[157..257]).to_vec(),
                };
                let raw = String::from_utf8(raw)
                    .map_err(|_| err("link target is not valid UTF-8".into()))?;
                if raw.is_empty() {
                    return Err(err("empty link target".into()));
                }
                if kind == EntryKind::Hardlink {
                    let target = normalize_path(&raw).ok_or_else(|| {
                        err(format!(
                            "hard link target {raw:?} escapes the layer root (\"..\" component)"
                        ))
                    })?;
                    if target.is_empty() {
                        return Err(err("hard link to the layer root".into()));
                    }
                    target
                } else {
                    raw
                }
            }
            _ => String::new(),
        };

        let (dev_major, dev_minor) = match kind {
            EntryKind::Char | EntryKind::Block => (
                match pax.devmajor {
                    Some(d) => d,
                    None => numeric_u32(&h[329..337])
                        .ok_or_else(|| err("invalid device major field".into()))?,
                },
                match pax.devminor {
                    Some(d) => d,
                    None => numeric_u32(&h[337..345])
                        .ok_or_else(|| err("invalid device minor field".into()))?,
                },
            ),
            _ => (0, 0),
        };

        if self.entries >= self.limits.max_entries {
            return Err(err(format!(
                "more than {} entries in one layer",
                self.limits.max_entries
            )));
        }
        self.entries += 1;
        self.remaining = size;
        self.padding = padding_for(size);
        self.cur_path.clone_from(&path);
        self.cur_offset = start;

        let entry = Entry {
            path,
            kind,
            mode,
            uid,
            gid,
            uname,
            gname,
            mtime,
            mtime_nsec,
            size,
            offset: if kind == EntryKind::File {
                data_offset
            } else {
                0
            },
            header_offset: start,
            link_target,
            dev_major,
            dev_minor,
            xattrs: pax.xattrs,
        };
        self.shape
            .admit(&entry)
            .map_err(|reason| tar_err(entry.path.clone(), start, reason))?;
        Ok(entry)
    }
}

impl<R: Read> Read for TarWalker<R> {
    /// Same as [`TarWalker::read_data`].
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_data(buf)
    }
}

/// Walks a whole stream and returns its file table (file data is skipped).
pub fn walk<R: Read>(reader: R) -> Result<Vec<Entry>> {
    let mut walker = TarWalker::new(reader);
    let mut entries = Vec::new();
    while let Some(entry) = walker.next_entry()? {
        entries.push(entry);
    }
    Ok(entries)
}

/// Every entry of a well-formed tar with its data, by the strict walker: what the
/// format tests (eStargz, SOCI) compare their readers' views with.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn walk_all(tar: &[u8]) -> Vec<(Entry, Vec<u8>)> {
    let mut w = TarWalker::new(tar);
    let mut out = Vec::new();
    while let Some(e) = w.next_entry().unwrap() {
        let mut data = Vec::new();
        w.read_to_end(&mut data).unwrap();
        out.push((e, data));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;
    use tar::{Builder, EntryType, Header};

    // ---------- helpers ----------

    fn put_octal(field: &mut [u8], v: u64) {
        let w = field.len() - 1;
        let s = format!("{v:0w$o}");
        field[..w].copy_from_slice(s.as_bytes());
        field[w] = 0;
    }

    fn set_cksum(h: &mut [u8; BLOCK]) {
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    }

    /// A ustar header block with the given name, typeflag and size.
    fn raw_header(name: &[u8], typeflag: u8, size: u64) -> [u8; BLOCK] {
        let mut h = [0u8; BLOCK];
        h[..name.len()].copy_from_slice(name);
        put_octal(&mut h[100..108], 0o644);
        put_octal(&mut h[108..116], 1000);
        put_octal(&mut h[116..124], 1000);
        put_octal(&mut h[124..136], size);
        put_octal(&mut h[136..148], 1_600_000_000);
        h[156] = typeflag;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        set_cksum(&mut h);
        h
    }

    fn pad(v: &mut Vec<u8>) {
        while !v.len().is_multiple_of(BLOCK) {
            v.push(0);
        }
    }

    /// Header block plus data plus padding.
    fn member(h: &[u8; BLOCK], data: &[u8]) -> Vec<u8> {
        let mut v = h.to_vec();
        v.extend_from_slice(data);
        pad(&mut v);
        v
    }

    fn file(name: &str, data: &[u8]) -> Vec<u8> {
        member(&raw_header(name.as_bytes(), b'0', data.len() as u64), data)
    }

    fn pax_body(records: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (k, v) in records {
            let rest = 3 + k.len() + v.len();
            let mut len = rest + 1;
            while len != rest + len.to_string().len() {
                len = rest + len.to_string().len();
            }
            out.extend_from_slice(format!("{len} {k}=").as_bytes());
            out.extend_from_slice(v);
            out.push(b'\n');
        }
        out
    }

    /// An extension member (typeflag `x`, `g`, `L`, `K`) with a raw body.
    fn ext(typeflag: u8, body: &[u8]) -> Vec<u8> {
        member(&raw_header(b"././@ext", typeflag, body.len() as u64), body)
    }

    fn pax(records: &[(&str, &[u8])]) -> Vec<u8> {
        ext(b'x', &pax_body(records))
    }

    fn archive(parts: &[Vec<u8>]) -> Vec<u8> {
        let mut v = parts.concat();
        v.extend_from_slice(&[0u8; 2 * BLOCK]);
        v
    }

    fn tar_error(r: Result<Vec<Entry>>) -> (String, u64, String) {
        match r {
            Err(Error::Tar {
                entry,
                offset,
                reason,
            }) => (entry, offset, reason),
            Err(e) => panic!("expected a tar error, got {e:?}"),
            Ok(v) => panic!("expected a tar error, got {} entries: {v:?}", v.len()),
        }
    }

    fn assert_refused(bytes: &[u8], needle: &str) -> (String, u64, String) {
        let (entry, offset, reason) = tar_error(walk(bytes));
        assert!(
            reason.contains(needle),
            "reason {reason:?} does not mention {needle:?}"
        );
        (entry, offset, reason)
    }

    fn build(f: impl FnOnce(&mut Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = Builder::new(Vec::new());
        f(&mut b);
        b.into_inner().unwrap()
    }

    fn header(gnu: bool, ty: EntryType, size: u64) -> Header {
        let mut h = if gnu {
            Header::new_gnu()
        } else {
            Header::new_ustar()
        };
        h.set_entry_type(ty);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_mtime(1_700_000_000);
        h
    }

    /// (header position, file position) of each entry, as the tar crate sees them.
    fn tar_crate_positions(bytes: &[u8]) -> Vec<(u64, u64)> {
        let mut ar = tar::Archive::new(bytes);
        ar.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.raw_header_position(), e.raw_file_position())
            })
            .collect()
    }

    /// Walks and reads every file's data through the walker.
    fn walk_data(bytes: &[u8]) -> Result<Vec<(Entry, Vec<u8>)>> {
        let mut w = TarWalker::new(bytes);
        let mut out = Vec::new();
        while let Some(e) = w.next_entry()? {
            let mut data = Vec::new();
            w.read_to_end(&mut data)?;
            out.push((e, data));
        }
        assert_eq!(w.position() % BLOCK_U64, 0);
        Ok(out)
    }

    // ---------- normalize_path ----------

    #[test]
    fn normalize_path_cases() {
        let ok = [
            ("a", "a"),
            ("/a/b", "a/b"),
            ("./a/b/", "a/b"),
            ("a//b///c", "a/b/c"),
            ("a/./b/.", "a/b"),
            ("///", ""),
            ("./", ""),
            (".", ""),
            ("", ""),
            ("/.wh..wh..opq", ".wh..wh..opq"),
            ("...", "..."),
            ("..a/b..", "..a/b.."),
        ];
        for (raw, want) in ok {
            assert_eq!(normalize_path(raw).as_deref(), Some(want), "{raw:?}");
        }
        for raw in ["..", "../x", "a/../b", "a/..", "/../etc", "./a/../../x"] {
            assert_eq!(normalize_path(raw), None, "{raw:?}");
        }
    }

    // ---------- builder-made archives ----------

    #[test]
    fn ustar_entries_data_and_offsets() {
        let bytes = build(|b| {
            let mut h = header(false, EntryType::Directory, 0);
            h.set_mode(0o755);
            b.append_data(&mut h, "etc/", io::empty()).unwrap();
            let mut h = header(false, EntryType::Regular, 11);
            h.set_uid(1000);
            h.set_gid(100);
            h.set_username("alice").unwrap();
            h.set_groupname("users").unwrap();
            h.set_mode(0o4755);
            b.append_data(&mut h, "etc/passwd", &b"root:x:0:0\n"[..])
                .unwrap();
            let mut h = header(false, EntryType::Symlink, 0);
            b.append_link(&mut h, "bin/sh", "../usr/bin/busybox")
                .unwrap();
            let mut h = header(false, EntryType::Link, 0);
            b.append_link(&mut h, "etc/passwd-", "etc/passwd").unwrap();
            let mut h = header(false, EntryType::Regular, 0);
            b.append_data(&mut h, "empty", io::empty()).unwrap();
            let mut h = header(false, EntryType::Regular, 1000);
            b.append_data(&mut h, "big", &[7u8; 1000][..]).unwrap();
        });
        let got = walk_data(&bytes).unwrap();
        let positions = tar_crate_positions(&bytes);
        assert_eq!(got.len(), 6);
        assert_eq!(positions.len(), 6);
        let names: Vec<_> = got.iter().map(|(e, _)| e.path.as_str()).collect();
        assert_eq!(
            names,
            ["etc", "etc/passwd", "bin/sh", "etc/passwd-", "empty", "big"]
        );
        let (dir, _) = &got[0];
        assert_eq!(
            (dir.kind, dir.mode, dir.size, dir.offset),
            (EntryKind::Dir, 0o755, 0, 0)
        );
        let (f, data) = &got[1];
        assert_eq!(f.kind, EntryKind::File);
        assert_eq!(data, b"root:x:0:0\n");
        assert_eq!((f.uid, f.gid, f.mode), (1000, 100, 0o4755));
        assert_eq!((f.uname.as_str(), f.gname.as_str()), ("alice", "users"));
        assert_eq!((f.mtime, f.mtime_nsec), (1_700_000_000, 0));
        assert_eq!(&bytes[f.offset as usize..][..11], b"root:x:0:0\n");
        let (l, _) = &got[2];
        assert_eq!(
            (l.kind, l.link_target.as_str()),
            (EntryKind::Symlink, "../usr/bin/busybox")
        );
        let (hl, _) = &got[3];
        assert_eq!(
            (hl.kind, hl.link_target.as_str()),
            (EntryKind::Hardlink, "etc/passwd")
        );
        assert_eq!(got[5].1, vec![7u8; 1000]);
        for ((e, _), (hpos, fpos)) in got.iter().zip(&positions) {
            assert_eq!(e.header_offset, *hpos, "{}", e.path);
            if e.kind == EntryKind::File {
                assert_eq!(e.offset, *fpos, "{}", e.path);
            }
        }
        let mut w = TarWalker::new(&bytes[..]);
        while w.next_entry().unwrap().is_some() {}
        assert_eq!(w.position(), bytes.len() as u64);
        assert_eq!(w.entry_count(), 6);
    }

    #[test]
    fn gnu_long_names_and_long_links() {
        let n150 = format!("d/{}", "n".repeat(148));
        let n300 = format!("{}/{}/{}", "a".repeat(100), "b".repeat(100), "c".repeat(98));
        let t150 = "t".repeat(150);
        let bytes = build(|b| {
            let mut h = header(true, EntryType::Regular, 5);
            b.append_data(&mut h, &n150, &b"hello"[..]).unwrap();
            let mut h = header(true, EntryType::Regular, 600);
            b.append_data(&mut h, &n300, &[1u8; 600][..]).unwrap();
            let mut h = header(true, EntryType::Symlink, 0);
            b.append_link(&mut h, "link", &t150).unwrap();
            let mut h = header(true, EntryType::Link, 0);
            b.append_link(&mut h, format!("{n150}-hard"), &n300)
                .unwrap();
        });
        let got = walk_data(&bytes).unwrap();
        let positions = tar_crate_positions(&bytes);
        assert_eq!(got[0].0.path, n150);
        assert_eq!(got[0].1, b"hello");
        assert_eq!(got[1].0.path, n300);
        assert_eq!(got[1].0.size, 600);
        assert_eq!(got[2].0.link_target, t150);
        assert_eq!(got[3].0.path, format!("{n150}-hard"));
        assert_eq!(got[3].0.link_target, n300);
        assert_eq!(got[3].0.kind, EntryKind::Hardlink);
        // The member starts at its 'L' header: 512 + padded body before the real header.
        assert_eq!(got[0].0.header_offset, 0);
        assert_eq!(positions[0].0, 1024);
        assert_eq!(got[0].0.offset, positions[0].1);
        assert_eq!(got[1].0.header_offset, 1536 + 512);
        assert_eq!(got[1].0.offset, positions[1].1);
        let link_member = got[3].0.header_offset;
        // 'L' + body(1 block) + 'K' + body(1 block) + header.
        assert_eq!(positions[3].0, link_member + 4 * 512);
    }

    #[test]
    fn ustar_prefix_is_joined() {
        let long = format!("{}/{}", "p".repeat(120), "f".repeat(90));
        let bytes = build(|b| {
            let mut h = header(false, EntryType::Regular, 3);
            b.append_data(&mut h, &long, &b"abc"[..]).unwrap();
        });
        // A single header block: the name went into prefix + name, no 'L' member.
        assert_eq!(bytes[156], b'0');
        assert_ne!(bytes[345], 0);
        let got = walk_data(&bytes).unwrap();
        assert_eq!(got[0].0.path, long);
        assert_eq!(got[0].0.offset, 512);
        assert_eq!(got[0].1, b"abc");
    }

    #[test]
    fn pax_records_apply() {
        let long = "x/".repeat(150) + "file";
        let cap = [0x01u8, 0x00, 0x00, 0x02, 0xff, 0x00, 0x00, 0x00];
        let bytes = build(|b| {
            b.append_pax_extensions([
                ("path", long.as_bytes()),
                ("mtime", &b"1700000000.123456789"[..]),
                ("atime", &b"1.5"[..]),
                ("uid", &b"4000000000"[..]),
                ("gid", &b"70000"[..]),
                ("uname", "jürgen".as_bytes()),
                ("gname", &b"staff"[..]),
                ("comment", &b"ignored"[..]),
                ("SCHILY.xattr.security.capability", &cap[..]),
                ("SCHILY.xattr.user.empty", &b""[..]),
                ("LIBARCHIVE.xattr.user.other", &b"aWdub3JlZA"[..]),
            ])
            .unwrap();
            let mut h = header(false, EntryType::Regular, 4);
            b.append_data(&mut h, "short", &b"data"[..]).unwrap();
        });
        let got = walk_data(&bytes).unwrap();
        let (e, data) = &got[0];
        assert_eq!(e.path, long);
        assert_eq!(data, b"data");
        assert_eq!((e.mtime, e.mtime_nsec), (1_700_000_000, 123_456_789));
        assert_eq!((e.uid, e.gid), (4_000_000_000, 70000));
        assert_eq!((e.uname.as_str(), e.gname.as_str()), ("jürgen", "staff"));
        assert_eq!(e.xattrs.len(), 2);
        assert_eq!(e.xattrs["security.capability"], cap);
        assert_eq!(e.xattrs["user.empty"], b"");
        assert_eq!(e.header_offset, 0);
        assert_eq!(e.offset, tar_crate_positions(&bytes)[0].1);
    }

    #[test]
    fn pax_time_parsing() {
        type Case<'a> = (&'a [u8], Option<(i64, u32)>);
        let cases: [Case; 12] = [
            (b"5", Some((5, 0))),
            (b"5.", Some((5, 0))),
            (b"5.5", Some((5, 500_000_000))),
            (b"1.1234567891", Some((1, 123_456_789))),
            (b"-1.25", Some((-2, 750_000_000))),
            (b"-3", Some((-3, 0))),
            (b"0.000000001", Some((0, 1))),
            (b"", None),
            (b"-", None),
            (b"+1", None),
            (b"1.2x", None),
            (b"99999999999999999999", None),
        ];
        for (raw, want) in cases {
            assert_eq!(
                parse_pax_time(raw),
                want,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn pax_empty_values_fall_back_to_the_header() {
        let bytes = archive(&[
            pax(&[("path", b""), ("mtime", b""), ("uid", b""), ("size", b"")]),
            file("from-header", b"abc"),
        ]);
        let got = walk(&bytes[..]).unwrap();
        assert_eq!(got[0].path, "from-header");
        assert_eq!(
            (got[0].mtime, got[0].uid, got[0].size),
            (1_600_000_000, 1000, 3)
        );
    }

    #[test]
    fn pax_last_duplicate_key_wins() {
        let bytes = archive(&[pax(&[("path", b"one"), ("path", b"two")]), file("x", b"")]);
        assert_eq!(walk(&bytes[..]).unwrap()[0].path, "two");
    }

    #[test]
    fn pax_size_beyond_octal_limit_is_not_allocated() {
        // Claims 20 GB of data but the stream ends after 10 bytes.
        let size = 20_000_000_000u64;
        let mut bytes = pax(&[("size", size.to_string().as_bytes())]);
        bytes.extend_from_slice(&raw_header(b"huge", b'0', 0));
        bytes.extend_from_slice(&[9u8; 10]);
        let mut w = TarWalker::new(&bytes[..]);
        let e = w.next_entry().unwrap().unwrap();
        assert_eq!((e.path.as_str(), e.size, e.offset), ("huge", size, 1536));
        let mut buf = [0u8; 64];
        assert_eq!(w.read_data(&mut buf).unwrap(), 10);
        let err = w.read_data(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        match w.next_entry() {
            Err(Error::Tar {
                entry,
                offset,
                reason,
            }) => {
                assert_eq!((entry.as_str(), offset), ("huge", 0));
                assert!(reason.contains("inside its file data"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // The same through walk() (which skips instead of reading).
        let (entry, _, reason) = tar_error(walk(&bytes[..]));
        assert_eq!(entry, "huge");
        assert!(reason.contains("truncated"), "{reason}");
    }

    #[test]
    fn base256_size_in_header() {
        let bytes = build(|b| {
            let mut h = header(true, EntryType::Regular, 0);
            h.set_path("giant").unwrap();
            h.set_size(1 << 40);
            h.set_cksum();
            b.append(&h, io::empty()).unwrap();
        });
        assert_ne!(bytes[124] & 0x80, 0, "tar crate should have used base-256");
        let mut w = TarWalker::new(&bytes[..]);
        let e = w.next_entry().unwrap().unwrap();
        assert_eq!(e.size, 1 << 40);
        // The end-of-archive blocks are taken as data, then the stream ends.
        let (entry, _, reason) = tar_error(w.next_entry().map(|_| Vec::new()));
        assert_eq!(entry, "giant");
        assert!(reason.contains("truncated"), "{reason}");
    }

    #[test]
    fn base256_ids_and_times() {
        let bytes = build(|b| {
            let mut h = header(true, EntryType::Regular, 0);
            h.set_uid(5_000_000);
            h.set_gid(3_000_000_000);
            h.set_mtime(1 << 34);
            b.append_data(&mut h, "f", io::empty()).unwrap();
        });
        assert_ne!(bytes[108] & 0x80, 0);
        assert_ne!(bytes[136] & 0x80, 0);
        let e = &walk(&bytes[..]).unwrap()[0];
        assert_eq!((e.uid, e.gid, e.mtime), (5_000_000, 3_000_000_000, 1 << 34));

        // Negative mtime (-1) in base-256, hand-made.
        let mut h = raw_header(b"old", b'0', 0);
        h[136..148].fill(0xff);
        set_cksum(&mut h);
        let e = &walk(&archive(&[h.to_vec()])[..]).unwrap()[0];
        assert_eq!(e.mtime, -1);

        // A uid that does not fit in 32 bits is refused.
        let mut h = raw_header(b"bigid", b'0', 0);
        h[108..116].copy_from_slice(&[0x80, 0, 0, 1, 0, 0, 0, 0]);
        set_cksum(&mut h);
        let (entry, _, reason) = assert_refused(&archive(&[h.to_vec()]), "uid");
        assert_eq!(entry, "bigid");
        assert!(reason.contains("invalid"));

        // A negative size is refused.
        let mut h = raw_header(b"neg", b'0', 0);
        h[124..136].fill(0xff);
        set_cksum(&mut h);
        assert_refused(&archive(&[h.to_vec()]), "size");
    }

    #[test]
    fn numeric_field_parsing() {
        assert_eq!(parse_octal(b"0000644\0"), Some(0o644));
        assert_eq!(parse_octal(b"  644 \0"), Some(0o644));
        assert_eq!(parse_octal(b"644\0junk"), Some(0o644));
        assert_eq!(parse_octal(b"\0\0\0\0\0\0\0\0"), Some(0));
        assert_eq!(parse_octal(b"        "), Some(0));
        assert_eq!(parse_octal(b"0000648\0"), None);
        assert_eq!(parse_octal(b"12 34\0"), None);
        assert_eq!(parse_octal(b"777777777777777777777777"), None);
        assert_eq!(parse_numeric(&[0x80, 0, 0, 0, 0, 0, 1, 2]), Some(258));
        assert_eq!(parse_numeric(&[0xff; 8]), Some(-1));
        assert_eq!(parse_numeric(&[0xff, 0xff, 0xff, 0xfe]), Some(-2));
        assert_eq!(parse_numeric(&[0xc0, 0, 0, 0]), Some(-(1 << 30)));
        assert_eq!(parse_numeric(&[]), None);
    }

    #[test]
    fn hard_links() {
        let bytes = archive(&[
            file("./etc/passwd", b"x"),
            member(
                &{
                    let mut h = raw_header(b"etc/passwd-", b'1', 0);
                    h[157..170].copy_from_slice(b"/etc//passwd/");
                    set_cksum(&mut h);
                    h
                },
                b"",
            ),
        ]);
        let got = walk(&bytes[..]).unwrap();
        assert_eq!(got[1].link_target, "etc/passwd");
        assert_eq!((got[1].size, got[1].offset), (0, 0));

        let link = |name: &[u8], target: &[u8]| {
            let mut h = raw_header(name, b'1', 0);
            h[157..157 + target.len()].copy_from_slice(target);
            set_cksum(&mut h);
            h.to_vec()
        };
        // Target missing, target later in the stream, target a directory, escaping, root.
        let cases: [(Vec<Vec<u8>>, &str); 6] = [
            (vec![link(b"l", b"nope")], "does not name an earlier"),
            (
                vec![link(b"l", b"later"), file("later", b"")],
                "does not name an earlier",
            ),
            (
                vec![member(&raw_header(b"d", b'5', 0), b""), link(b"l", b"d")],
                "does not name an earlier",
            ),
            (vec![file("x", b""), link(b"l", b"../x")], "escapes"),
            (vec![file("x", b""), link(b"l", b"./")], "layer root"),
            (vec![file("x", b""), link(b"l", b"")], "empty link target"),
        ];
        for (parts, needle) in cases {
            let (entry, _, _) = assert_refused(&archive(&parts), needle);
            assert_eq!(entry, "l");
        }
        // A path that became a directory is no longer a valid target.
        let parts = vec![
            file("p", b""),
            member(&raw_header(b"p/", b'5', 0), b""),
            link(b"l", b"p"),
        ];
        assert_refused(&archive(&parts), "does not name an earlier");
        // Links to other hard links are fine; links to symlinks are not (no data to share).
        let parts = vec![file("f", b"x"), link(b"l1", b"f"), link(b"l2", b"l1")];
        assert_eq!(walk(&archive(&parts)[..]).unwrap().len(), 3);
        let mut sym = raw_header(b"s", b'2', 0);
        sym[157..160].copy_from_slice(b"abc");
        set_cksum(&mut sym);
        let (entry, _, _) =
            assert_refused(&archive(&[sym.to_vec(), link(b"l", b"s")]), "regular file");
        assert_eq!(entry, "l");
    }

    #[test]
    fn devices_and_fifos() {
        let bytes = build(|b| {
            let mut h = header(false, EntryType::Char, 0);
            h.set_device_major(1).unwrap();
            h.set_device_minor(3).unwrap();
            b.append_data(&mut h, "dev/null", io::empty()).unwrap();
            let mut h = header(false, EntryType::Block, 0);
            h.set_device_major(8).unwrap();
            h.set_device_minor(16).unwrap();
            b.append_data(&mut h, "dev/sdb", io::empty()).unwrap();
            let mut h = header(false, EntryType::Fifo, 0);
            b.append_data(&mut h, "run/fifo", io::empty()).unwrap();
            b.append_pax_extensions([
                ("SCHILY.devmajor", &b"4000000"[..]),
                ("SCHILY.devminor", &b"5000000"[..]),
            ])
            .unwrap();
            let mut h = header(false, EntryType::Char, 0);
            b.append_data(&mut h, "dev/big", io::empty()).unwrap();
        });
        let got = walk(&bytes[..]).unwrap();
        let summary: Vec<_> = got
            .iter()
            .map(|e| (e.path.as_str(), e.kind, e.dev_major, e.dev_minor))
            .collect();
        assert_eq!(
            summary,
            [
                ("dev/null", EntryKind::Char, 1, 3),
                ("dev/sdb", EntryKind::Block, 8, 16),
                ("run/fifo", EntryKind::Fifo, 0, 0),
                ("dev/big", EntryKind::Char, 4_000_000, 5_000_000),
            ]
        );
    }

    #[test]
    fn whiteouts_are_plain_entries() {
        let bytes = archive(&[
            file("etc/.wh.passwd", b""),
            file("var/cache/.wh..wh..opq", b""),
            file(".wh.tmp", b""),
        ]);
        let got = walk(&bytes[..]).unwrap();
        assert_eq!(
            got[0].whiteout(),
            crate::Whiteout::Remove("etc/passwd".into())
        );
        assert_eq!(got[1].whiteout(), crate::Whiteout::Opaque("var/cache"));
        assert_eq!(got[2].whiteout(), crate::Whiteout::Remove("tmp".into()));
        assert!(got.iter().all(|e| e.kind == EntryKind::File));
    }

    #[test]
    fn sparse_is_refused() {
        let (entry, offset, _) = assert_refused(
            &archive(&[member(&raw_header(b"sp", b'S', 0), b"")]),
            "sparse",
        );
        assert_eq!((entry.as_str(), offset), ("sp", 0));
        let bytes = archive(&[
            file("first", b"1"),
            pax(&[("GNU.sparse.major", b"1"), ("GNU.sparse.minor", b"0")]),
            file("sp", b""),
        ]);
        let (entry, offset, reason) = assert_refused(&bytes, "sparse");
        assert_eq!((entry.as_str(), offset), ("sp", 1024));
        assert!(reason.contains("GNU.sparse.major"), "{reason}");
    }

    #[test]
    fn unknown_typeflags_are_refused() {
        for t in [b'V', b'D', b'M', b'N', b'X', b'A', b'Z', b'8', 0x01, 0xff] {
            let bytes = archive(&[member(&raw_header(b"odd", t, 0), b"")]);
            let (entry, _, reason) = assert_refused(&bytes, "unsupported entry type");
            assert_eq!(entry, "odd");
            assert!(reason.contains(&describe_typeflag(t)), "{reason}");
        }
    }

    #[test]
    fn checksums() {
        let mut h = raw_header(b"file", b'0', 0);
        h[0] = b'F';
        let (entry, offset, _) =
            assert_refused(&archive(&[file("ok", b""), h.to_vec()]), "checksum");
        assert_eq!((entry.as_str(), offset), ("File", 512));

        // High bytes in an unused area; a signed checksum (as old Sun tar wrote) is accepted.
        let mut h = raw_header(b"signed", b'0', 0);
        h[500..508].fill(0xff);
        h[148..156].fill(b' ');
        let signed: i64 = h.iter().map(|&b| i64::from(b as i8)).sum();
        h[148..156].copy_from_slice(format!("{signed:06o}\0 ").as_bytes());
        assert_eq!(walk(&archive(&[h.to_vec()])[..]).unwrap()[0].path, "signed");
        // The unsigned sum is accepted too.
        set_cksum(&mut h);
        assert_eq!(walk(&archive(&[h.to_vec()])[..]).unwrap()[0].path, "signed");
        // A random non-zero block is not a header.
        let junk = [0x41u8; BLOCK];
        assert_refused(&archive(&[junk.to_vec()]), "checksum");
    }

    #[test]
    fn truncation_is_refused_everywhere() {
        let data = [5u8; 1000];
        let bytes = archive(&[pax(&[("path", b"the/file")]), file("f", &data)]);
        // Layout: pax header 0..512, body 512..1024, header 1024..1536, data 1536..2536,
        // padding ..2560, zero blocks 2560..3584.
        assert_eq!(bytes.len(), 3584);
        let cases: [(usize, &str); 10] = [
            (0, "without the end-of-archive marker"),
            (100, "inside a header block"),
            (600, "inside a PAX header body"),
            (1024, "after an extension header"),
            (1200, "inside a header block"),
            (2000, "inside its file data"),
            (2540, "inside the padding"),
            (2560, "without the end-of-archive marker"),
            (2600, "inside a header block"),
            (3100, "inside the end-of-archive marker"),
        ];
        for (cut, needle) in cases {
            let (entry, _, reason) = tar_error(walk(&bytes[..cut]));
            assert!(reason.contains(needle), "cut {cut}: {reason:?}");
            if (1024..2560).contains(&cut) {
                assert_eq!(entry, "the/file", "cut {cut}");
            }
        }
        // One zero block then EOF is a proper end, and so are two.
        assert_eq!(walk(&bytes[..3072]).unwrap().len(), 1);
        assert_eq!(walk(&bytes[..]).unwrap().len(), 1);
        // Reading the data of a truncated entry fails with UnexpectedEof.
        let mut w = TarWalker::new(&bytes[..2000]);
        w.next_entry().unwrap().unwrap();
        let mut sink = Vec::new();
        let err = w.read_to_end(&mut sink).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(sink.len(), 464);
        assert!(err.to_string().contains("the/file"));
        // Extension body truncated inside its padding.
        let mut long = ext(b'L', b"abc\0");
        long.truncate(512 + 100);
        assert_refused(&long, "inside a GNU long name body");
    }

    #[test]
    fn end_of_archive_variants() {
        assert!(walk(&[0u8; 1024][..]).unwrap().is_empty());
        assert!(walk(&[0u8; 512][..]).unwrap().is_empty());
        assert!(walk(&[0u8; 10240][..]).unwrap().is_empty());
        assert_refused(&[], "without the end-of-archive marker");
        assert_refused(&[0u8; 700], "inside the end-of-archive marker");
        // A lone zero block in the middle of the archive.
        let mut bytes = vec![0u8; 512];
        bytes.extend_from_slice(&archive(&[file("hidden", b"")]));
        assert_refused(&bytes, "lone zero block");
        // Nothing after the marker is read.
        let mut bytes = archive(&[file("a", b"1")]);
        bytes.extend_from_slice(b"trailing garbage that nobody reads");
        let mut w = TarWalker::new(&bytes[..]);
        assert!(w.next_entry().unwrap().is_some());
        assert!(w.next_entry().unwrap().is_none());
        assert!(w.next_entry().unwrap().is_none());
        assert_eq!(w.position(), 2048);
        let mut rest = Vec::new();
        w.into_inner().read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"trailing garbage that nobody reads");
    }

    #[test]
    fn paths_are_normalized_and_dotdot_refused() {
        let bytes = archive(&[
            member(&raw_header(b"./", b'5', 0), b""),
            member(&raw_header(b"/abs/dir/", b'5', 0), b""),
            file("/abs//dir/./file", b"x"),
            file("./rel", b""),
            member(&raw_header(b"plain-dir/", b'0', 0), b""),
            member(&raw_header(b"/", b'\0', 0), b""),
        ]);
        let got: Vec<_> = walk(&bytes[..])
            .unwrap()
            .into_iter()
            .map(|e| (e.path, e.kind))
            .collect();
        assert_eq!(
            got,
            [
                ("".to_string(), EntryKind::Dir),
                ("abs/dir".to_string(), EntryKind::Dir),
                ("abs/dir/file".to_string(), EntryKind::File),
                ("rel".to_string(), EntryKind::File),
                ("plain-dir".to_string(), EntryKind::Dir),
                ("".to_string(), EntryKind::Dir),
            ]
        );
        for name in ["../x", "a/../../x", "a/..", ".."] {
            let (entry, _, _) =
                assert_refused(&archive(&[file(name, b"")]), "escapes the layer root");
            assert_eq!(entry, name);
        }
        let bytes = archive(&[pax(&[("path", b"ok/../../etc/shadow")]), file("x", b"")]);
        let (entry, _, _) = assert_refused(&bytes, "escapes");
        assert_eq!(entry, "ok/../../etc/shadow");
        // The root must be a directory.
        assert_refused(
            &archive(&[file(".", b"")]),
            "layer root must be a directory",
        );
        let mut sym = raw_header(b"./", b'2', 0);
        sym[157] = b'x';
        set_cksum(&mut sym);
        assert_refused(&archive(&[sym.to_vec()]), "layer root must be a directory");
        assert_refused(&archive(&[file("", b"")]), "empty path");
    }

    #[test]
    fn non_utf8_is_refused() {
        let bytes = archive(&[member(&raw_header(b"caf\xe9", b'0', 0), b"")]);
        let (entry, _, _) = assert_refused(&bytes, "not valid UTF-8");
        assert_eq!(entry, "caf\u{fffd}");
        let bytes = archive(&[ext(b'L', b"long\xff\0"), file("x", b"")]);
        assert_refused(&bytes, "path is not valid UTF-8");
        let bytes = archive(&[
            pax(&[("linkpath", b"\xff\xfe")]),
            member(&raw_header(b"sym", b'2', 0), b""),
        ]);
        assert_refused(&bytes, "link target is not valid UTF-8");
        let bytes = archive(&[pax(&[("uname", b"\xff")]), file("x", b"")]);
        assert_refused(&bytes, "not valid UTF-8");
        let mut h = raw_header(b"x", b'0', 0);
        h[265] = 0xff;
        set_cksum(&mut h);
        assert_refused(&archive(&[h.to_vec()]), "user name is not valid UTF-8");
    }

    #[test]
    fn malformed_pax_is_refused() {
        let bad: [(&[u8], &str); 12] = [
            (b"10 path=abc\n", "does not end at a newline"),
            (b"12 pathabcd\n", "no '='"),
            (b"x3 path=a\n", "not a decimal number"),
            (b"12path=abcd\n", "not followed by a space"),
            (b"99 path=a\n", "runs past the end"),
            (b"13 path=abcd\n\0\0\0", "not a decimal number"),
            (b"8 =abcd\n", "empty key"),
            (b"3 a\n", "too small"),
            (b"12 path=a\0b\n", "NUL"),
            (b"12 size=-12\n", "PAX size"),
            (b"11 uid=1.5\n", "uid"),
            (b"15 mtime=1.5.6\n", "mtime"),
        ];
        for (body, needle) in bad {
            let bytes = archive(&[ext(b'x', body), file("after", b"")]);
            let (_, offset, reason) = tar_error(walk(&bytes[..]));
            assert!(
                reason.contains(needle),
                "{:?}: {reason:?} lacks {needle:?}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(offset, 0);
        }
        // A uid beyond 32 bits and a size beyond 63 bits.
        assert_refused(
            &archive(&[pax(&[("uid", b"4294967296")]), file("x", b"")]),
            "uid",
        );
        assert_refused(
            &archive(&[pax(&[("size", b"9223372036854775808")]), file("x", b"")]),
            "size",
        );
        // Correct records parse, including a value that contains '=' and newlines.
        let bytes = archive(&[pax(&[("SCHILY.xattr.user.k", b"a=b\nc")]), file("x", b"")]);
        assert_eq!(walk(&bytes[..]).unwrap()[0].xattrs["user.k"], b"a=b\nc");
    }

    #[test]
    fn extension_header_rules() {
        // Two PAX headers, or two long names, for one entry.
        let bytes = archive(&[
            pax(&[("path", b"a")]),
            pax(&[("path", b"b")]),
            file("x", b""),
        ]);
        assert_refused(&bytes, "two 'x' extension headers");
        let bytes = archive(&[ext(b'L', b"a\0"), ext(b'L', b"b\0"), file("x", b"")]);
        assert_refused(&bytes, "two 'L' extension headers");
        // PAX path and GNU long name disagree / agree.
        let bytes = archive(&[ext(b'L', b"a\0"), pax(&[("path", b"b")]), file("x", b"")]);
        assert_refused(&bytes, "disagrees");
        let bytes = archive(&[
            ext(b'L', b"same\0"),
            pax(&[("path", b"same")]),
            file("x", b""),
        ]);
        assert_eq!(walk(&bytes[..]).unwrap()[0].path, "same");
        // Extension header then end of archive.
        assert_refused(
            &archive(&[pax(&[("path", b"a")])]),
            "right after an extension header",
        );
        // A global header between a local header and its entry.
        let bytes = archive(&[
            pax(&[("path", b"a")]),
            ext(b'g', &pax_body(&[("comment", b"x")])),
            file("x", b""),
        ]);
        assert_refused(&bytes, "global header");
        // Global headers are skipped and do not apply.
        let bytes = archive(&[
            ext(
                b'g',
                &pax_body(&[("comment", b"git archive"), ("uname", b"global")]),
            ),
            file("x", b"12"),
            ext(b'g', b"not even parsed"),
        ]);
        let mut w = TarWalker::new(&bytes[..]);
        let e = w.next_entry().unwrap().unwrap();
        assert_eq!(
            (e.path.as_str(), e.uname.as_str(), e.header_offset, e.offset),
            ("x", "", 1024, 1536)
        );
        assert!(w.next_entry().unwrap().is_none());
        // Long link on a non-link entry is ignored; long link used for a symlink.
        let bytes = archive(&[
            ext(b'K', b"target\0"),
            member(&raw_header(b"s", b'2', 0), b""),
        ]);
        assert_eq!(walk(&bytes[..]).unwrap()[0].link_target, "target");
        let bytes = archive(&[ext(b'K', b"target\0"), file("f", b"")]);
        assert_eq!(walk(&bytes[..]).unwrap()[0].link_target, "");
        // Empty symlink target.
        assert_refused(
            &archive(&[member(&raw_header(b"s", b'2', 0), b"")]),
            "empty link target",
        );
    }

    #[test]
    fn limits_are_enforced() {
        let limits = Limits {
            max_extension_bytes: 1024,
            max_entries: 2,
        };
        let long = vec![b'n'; 2000];
        let bytes = archive(&[ext(b'L', &long), file("x", b"")]);
        let mut w = TarWalker::with_limits(&bytes[..], limits);
        match w.next_entry() {
            Err(Error::Tar { reason, .. }) => {
                assert!(reason.contains("exceeds the limit"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert!(w.next_entry().is_err(), "errors are sticky");
        let bytes = archive(&[file("a", b""), file("b", b""), file("c", b"")]);
        let mut w = TarWalker::with_limits(&bytes[..], limits);
        assert!(w.next_entry().unwrap().is_some());
        assert!(w.next_entry().unwrap().is_some());
        match w.next_entry() {
            Err(Error::Tar { entry, reason, .. }) => {
                assert_eq!(entry, "c");
                assert!(reason.contains("more than 2 entries"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let bytes = archive(&[file("a", b""), file("b", b"")]);
        let mut w = TarWalker::with_limits(&bytes[..], limits);
        while w.next_entry().unwrap().is_some() {}
        assert_eq!(Limits::default().max_extension_bytes, 1 << 20);
        assert_eq!(Limits::default().max_entries, 10_000_000);
    }

    #[test]
    fn non_regular_entries_with_data_are_refused() {
        for t in [b'1', b'2', b'3', b'4', b'5', b'6'] {
            let mut h = raw_header(b"thing", t, 10);
            h[157] = b't';
            set_cksum(&mut h);
            let bytes = archive(&[file("t", b""), member(&h, &[0u8; 10])]);
            assert_refused(&bytes, "claims 10 bytes of data");
        }
        let bytes = archive(&[member(&raw_header(b"d/", b'0', 3), b"abc")]);
        assert_refused(&bytes, "Dir entry claims 3 bytes");
    }

    #[test]
    fn v7_old_gnu_and_star_headers() {
        // v7: no magic; typeflag NUL; trailing slash makes a directory; no user names.
        let mut v7 = Header::new_old();
        v7.set_path("v7dir/").unwrap();
        v7.set_size(0);
        v7.set_mode(0o755);
        let mut raw = *v7.as_bytes();
        raw[156] = 0;
        raw[265..270].copy_from_slice(b"bogus");
        set_cksum(&mut raw);
        let mut v7f = Header::new_old();
        v7f.set_path("v7dir/file").unwrap();
        v7f.set_size(2);
        v7f.set_cksum();
        // Old GNU: the prefix area holds atime/ctime and must not be joined.
        let mut gnu = raw_header(b"gnufile", b'0', 0);
        gnu[257..265].copy_from_slice(b"ustar  \0");
        gnu[345..357].copy_from_slice(b"14000000000\0");
        set_cksum(&mut gnu);
        // star: 131-byte prefix, atime/ctime after it, "tar\0" trailer.
        let mut star = raw_header(b"name", b'0', 0);
        star[345..348].copy_from_slice(b"pre");
        star[476..488].copy_from_slice(b"14000000000\0");
        star[508..512].copy_from_slice(b"tar\0");
        set_cksum(&mut star);
        let bytes = archive(&[
            raw.to_vec(),
            member(v7f.as_bytes(), b"hi"),
            gnu.to_vec(),
            star.to_vec(),
        ]);
        let got = walk_data(&bytes).unwrap();
        assert_eq!(
            (
                got[0].0.path.as_str(),
                got[0].0.kind,
                got[0].0.uname.as_str()
            ),
            ("v7dir", EntryKind::Dir, "")
        );
        assert_eq!(
            (got[1].0.path.as_str(), got[1].1.as_slice()),
            ("v7dir/file", &b"hi"[..])
        );
        assert_eq!(got[2].0.path, "gnufile");
        assert_eq!(got[3].0.path, "pre/name");
    }

    #[test]
    fn partial_reads_skipping_and_position() {
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let bytes = build(|b| {
            let mut h = header(false, EntryType::Regular, 3000);
            b.append_data(&mut h, "one", &[1u8; 3000][..]).unwrap();
            let mut h = header(false, EntryType::Regular, 10);
            b.append_data(&mut h, "two", &b"0123456789"[..]).unwrap();
            let mut h = header(false, EntryType::Regular, big.len() as u64);
            b.append_data(&mut h, "three", &big[..]).unwrap();
            let mut h = header(false, EntryType::Regular, 1);
            b.append_data(&mut h, "four", &b"!"[..]).unwrap();
        });
        let mut w = TarWalker::new(&bytes[..]);
        let mut buf = [0u8; 100];
        assert_eq!(w.read_data(&mut buf).unwrap(), 0, "no entry yet");
        let one = w.next_entry().unwrap().unwrap();
        assert_eq!(w.position(), one.offset);
        assert_eq!(w.read(&mut buf).unwrap(), 100);
        assert_eq!(w.data_remaining(), 2900);
        assert_eq!(w.position(), one.offset + 100);
        let two = w.next_entry().unwrap().unwrap();
        assert_eq!(two.header_offset, one.offset + 3072);
        let mut data = Vec::new();
        w.read_to_end(&mut data).unwrap();
        assert_eq!(data, b"0123456789");
        assert_eq!(w.read_data(&mut buf).unwrap(), 0);
        let three = w.next_entry().unwrap().unwrap();
        assert_eq!(three.size, 100_000);
        let mut part = [0u8; 7];
        w.read_exact(&mut part).unwrap();
        assert_eq!(part, big[..7]);
        let four = w.next_entry().unwrap().unwrap();
        assert_eq!(four.header_offset, three.offset + 100_352);
        assert_eq!(&bytes[three.offset as usize..][..100_000], &big[..]);
        assert!(w.next_entry().unwrap().is_none());
        assert_eq!(w.position(), bytes.len() as u64);
        assert!(format!("{w:?}").contains("TarWalker"));
    }

    #[test]
    fn errors_are_sticky() {
        let bytes = archive(&[file("a", b""), file("../b", b""), file("c", b"")]);
        let mut w = TarWalker::new(&bytes[..]);
        assert!(w.next_entry().unwrap().is_some());
        assert!(w.next_entry().is_err());
        assert!(w.next_entry().is_err());
        assert!(w.next_entry().is_err());
    }

    #[test]
    fn io_errors_propagate() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("boom"))
            }
        }
        assert!(matches!(walk(Failing), Err(Error::Io(_))));
        // A reader that returns one byte at a time (and spurious interrupts) still works.
        struct Trickle<'a>(&'a [u8], bool);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                self.1 = !self.1;
                if self.1 {
                    return Err(io::ErrorKind::Interrupted.into());
                }
                if self.0.is_empty() || buf.is_empty() {
                    return Ok(0);
                }
                buf[0] = self.0[0];
                self.0 = &self.0[1..];
                Ok(1)
            }
        }
        let bytes = archive(&[
            pax(&[("path", b"p")]),
            file("f", &[3u8; 700]),
            file("g", b""),
        ]);
        let got = walk(Trickle(&bytes, false)).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].path, "p");
    }

    // ---------- property tests ----------

    #[derive(Debug, Clone)]
    enum Kind {
        File(Vec<u8>),
        Dir,
        Symlink(String),
        Hardlink(usize),
    }

    #[derive(Debug, Clone)]
    struct Spec {
        comps: Vec<String>,
        kind: Kind,
        gnu: bool,
        uid: u32,
        mtime: u64,
        pax_nsec: Option<u32>,
        xattr: Option<Vec<u8>>,
        trailing_slash: bool,
        read_data: bool,
    }

    fn component() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9_.é-]{1,40}".prop_filter("dot components", |c| c != "." && c != "..")
    }

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            3 => prop::collection::vec(any::<u8>(), 0..1500).prop_map(Kind::File),
            1 => Just(Kind::Dir),
            1 => prop::collection::vec(prop_oneof!["[a-z0-9]{1,30}", Just("..".to_string())], 1..8)
                .prop_map(|c| Kind::Symlink(c.join("/"))),
            1 => any::<usize>().prop_map(Kind::Hardlink),
        ]
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            prop::collection::vec(component(), 1..8),
            kind(),
            any::<bool>(),
            prop_oneof![0u32..70000, any::<u32>()],
            prop_oneof![0u64..(1 << 33), 0u64..(1 << 40)],
            prop::option::of(0u32..1_000_000_000),
            prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(
                |(comps, kind, gnu, uid, mtime, pax_nsec, xattr, trailing_slash, read_data)| Spec {
                    comps,
                    kind,
                    gnu,
                    uid,
                    mtime,
                    pax_nsec,
                    xattr,
                    trailing_slash,
                    read_data,
                },
            )
    }

    /// An expected entry, its data, and whether the test reads the data.
    type Expected = (Entry, Vec<u8>, bool);

    /// Writes the specs with tar::Builder; returns the archive and the expected entries.
    fn write_specs(specs: &[Spec]) -> (Vec<u8>, Vec<Expected>) {
        let mut b = Builder::new(Vec::new());
        let mut seen = HashSet::new();
        // Paths the layer shape rules leave alone: beneath directories only, no directory
        // replaced by a non-directory, hard links to regular files only.
        let mut dirs: HashSet<String> = HashSet::new();
        let mut files: Vec<String> = Vec::new();
        let mut expected = Vec::new();
        for s in specs {
            let path = s.comps.join("/");
            let ancestors: Vec<String> =
                (1..s.comps.len()).map(|n| s.comps[..n].join("/")).collect();
            let beneath_non_dir = ancestors
                .iter()
                .any(|a| seen.contains(a) && !dirs.contains(a));
            let replaces_dir = dirs.contains(&path) && !matches!(s.kind, Kind::Dir);
            if beneath_non_dir || replaces_dir || !seen.insert(path.clone()) {
                continue;
            }
            for a in ancestors {
                seen.insert(a.clone());
                dirs.insert(a);
            }
            if matches!(s.kind, Kind::Dir) {
                dirs.insert(path.clone());
            }
            let mut records: Vec<(&str, Vec<u8>)> = Vec::new();
            if let Some(nsec) = s.pax_nsec {
                records.push(("mtime", format!("{}.{nsec:09}", s.mtime).into_bytes()));
            }
            if let Some(x) = &s.xattr {
                records.push(("SCHILY.xattr.user.prop", x.clone()));
            }
            if !records.is_empty() {
                b.append_pax_extensions(records.iter().map(|(k, v)| (*k, v.as_slice())))
                    .unwrap();
            }
            let mut want = Entry {
                path: path.clone(),
                uid: s.uid,
                gid: 42,
                mode: 0o640,
                mtime: s.mtime as i64,
                mtime_nsec: s.pax_nsec.unwrap_or(0),
                ..Entry::default()
            };
            if let Some(x) = &s.xattr {
                want.xattrs.insert("user.prop".into(), x.clone());
            }
            let mut h = header(s.gnu, EntryType::Regular, 0);
            h.set_uid(u64::from(s.uid));
            h.set_gid(42);
            h.set_mtime(s.mtime);
            h.set_mode(0o100640);
            let mut data = Vec::new();
            match &s.kind {
                Kind::File(d) => {
                    h.set_size(d.len() as u64);
                    b.append_data(&mut h, &path, &d[..]).unwrap();
                    want.kind = EntryKind::File;
                    want.size = d.len() as u64;
                    data.clone_from(d);
                    files.push(path);
                }
                Kind::Dir => {
                    h.set_entry_type(EntryType::Directory);
                    let name = if s.trailing_slash {
                        format!("{path}/")
                    } else {
                        path
                    };
                    b.append_data(&mut h, &name, io::empty()).unwrap();
                    want.kind = EntryKind::Dir;
                }
                Kind::Symlink(t) => {
                    h.set_entry_type(EntryType::Symlink);
                    b.append_link(&mut h, &path, t).unwrap();
                    want.kind = EntryKind::Symlink;
                    want.link_target.clone_from(t);
                }
                Kind::Hardlink(i) if !files.is_empty() => {
                    let target = files[i % files.len()].clone();
                    h.set_entry_type(EntryType::Link);
                    b.append_link(&mut h, &path, &target).unwrap();
                    want.kind = EntryKind::Hardlink;
                    want.link_target = target;
                    files.push(path);
                }
                Kind::Hardlink(_) => {
                    b.append_data(&mut h, &path, io::empty()).unwrap();
                    want.kind = EntryKind::File;
                    files.push(path);
                }
            }
            expected.push((want, data, s.read_data));
        }
        (b.into_inner().unwrap(), expected)
    }

    fn specs() -> impl Strategy<Value = Vec<Spec>> {
        prop::collection::vec(spec(), 0..12)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn prop_roundtrip(specs in specs()) {
            let (bytes, expected) = write_specs(&specs);
            let positions = tar_crate_positions(&bytes);
            prop_assert_eq!(positions.len(), expected.len());
            let mut w = TarWalker::new(&bytes[..]);
            let mut prev_end = 0u64;
            for ((want, data, read), (hpos, fpos)) in expected.iter().zip(&positions) {
                let got = w.next_entry().unwrap().unwrap();
                prop_assert_eq!(&got.path, &want.path);
                prop_assert_eq!(got.kind, want.kind);
                prop_assert_eq!(got.size, want.size);
                prop_assert_eq!(&got.link_target, &want.link_target);
                prop_assert_eq!((got.uid, got.gid, got.mode), (want.uid, want.gid, want.mode));
                prop_assert_eq!((got.mtime, got.mtime_nsec), (want.mtime, want.mtime_nsec));
                prop_assert_eq!(&got.xattrs, &want.xattrs);
                // The member starts right after the previous one; extension blocks sit
                // between it and the header the tar crate reports.
                prop_assert_eq!(got.header_offset, prev_end);
                prop_assert!(got.header_offset <= *hpos);
                prop_assert_eq!((*hpos - got.header_offset) % BLOCK_U64, 0);
                if got.kind == EntryKind::File {
                    prop_assert_eq!(got.offset, *fpos);
                    prop_assert_eq!(&bytes[got.offset as usize..][..data.len()], &data[..]);
                }
                prev_end = *hpos + BLOCK_U64 + got.size + padding_for(got.size);
                if *read {
                    let mut buf = Vec::new();
                    w.read_to_end(&mut buf).unwrap();
                    prop_assert_eq!(&buf, data);
                }
            }
            prop_assert!(w.next_entry().unwrap().is_none());
            prop_assert_eq!(w.position(), bytes.len() as u64);
        }

        #[test]
        fn prop_truncation_is_always_detected(specs in specs(), cut in any::<prop::sample::Index>()) {
            let (bytes, expected) = write_specs(&specs);
            let cut = cut.index(bytes.len() - BLOCK);
            prop_assert!(walk(&bytes[..cut]).is_err(), "cut at {} of {}", cut, bytes.len());
            prop_assert_eq!(walk(&bytes[..bytes.len() - BLOCK]).unwrap().len(), expected.len());
        }

        #[test]
        fn prop_mutations_never_panic(
            specs in specs(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        ) {
            let (mut bytes, _) = write_specs(&specs);
            for (i, v) in edits {
                let i = i.index(bytes.len());
                bytes[i] = v;
            }
            let mut w = TarWalker::new(&bytes[..]);
            while let Ok(Some(e)) = w.next_entry() {
                if e.kind == EntryKind::File {
                    let mut data = Vec::new();
                    if w.read_to_end(&mut data).is_ok() {
                        prop_assert_eq!(data.len() as u64, e.size);
                        let start = e.offset as usize;
                        prop_assert_eq!(&bytes[start..start + data.len()], &data[..]);
                    }
                }
                prop_assert!(normalize_path(&e.path).as_deref() == Some(e.path.as_str()));
            }
        }
    }
}
