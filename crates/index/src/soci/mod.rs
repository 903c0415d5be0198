//! SOCI zTOCs: reading them into typed values and into a ferry [`LayerIndex`], and a
//! writer of our own for tests and fixtures.
//!
//! A zTOC (from awslabs/soci-snapshotter, `ztoc/fbs/ztoc.fbs`) is a flatbuffer that
//! describes one unmodified gzip layer: its tar file table and a *checkpoints blob*
//! (gzip zinfo, [`zinfo`]) from which inflation can restart at each span. Its layout, as
//! ferry relies on it, is in `docs/formats.md` ("SOCI zTOC"); the research note is
//! `docs/research/soci-ztoc.md`.
//!
//! * [`parse_ztoc`] verifies the flatbuffer (every offset, vtable, vector and string
//!   bounds-checked by the `flatbuffers` crate's verifier, with limits derived from the
//!   input's length) and copies it into a [`Ztoc`];
//! * [`Ztoc::to_layer_index`] checks it against the layer it claims to describe and
//!   converts it, so the crate's one read path ([`crate::reader`]) serves SOCI layers;
//! * [`write_ztoc`] builds a zTOC from a gzip layer held in memory.
//!
//! This module owns the zTOC bytes and their mapping onto ferry's types. It must not
//! fetch anything (the SOCI index manifest and the zTOC blob are the caller's business),
//! and, as everything here comes from strangers, it must never panic or allocate more
//! than a bounded multiple of its input.

mod convert;
mod writer;
pub mod zinfo;

#[cfg(test)]
mod tests;

use flatbuffers::{
    ForwardsUOffset, InvalidFlatbuffer, Table, Vector, Verifiable, Verifier, VerifierOptions,
};

use crate::error::{Error, Result};

pub use writer::write_ztoc;
pub use zinfo::{GzipZinfo, ZinfoCheckpoint, parse_gzip_zinfo};

#[cfg(doc)]
use crate::ferryidx::LayerIndex;

/// Largest zTOC accepted: a flatbuffer cannot be larger (its offsets are 31-bit).
pub const MAX_ZTOC_BYTES: usize = 1 << 31;

/// Largest number of TOC entries accepted (the tar walker's default limit).
pub const MAX_ZTOC_ENTRIES: usize = crate::tarwalk::Limits::DEFAULT_MAX_ENTRIES as usize;

/// The zTOC version the published writer puts in every zTOC (informational; not checked).
pub const ZTOC_VERSION: &str = "0.9";

/// A parsed zTOC: what the flatbuffer says, typed, not yet checked against a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ztoc {
    /// The `version` string ("0.9" from the published writer; not interpreted).
    pub version: String,
    /// Free text naming the tool that built the zTOC.
    pub build_tool_identifier: String,
    /// Size of the compressed layer blob.
    pub compressed_archive_size: u64,
    /// Where the tar stream ends (after its end-of-archive blocks).
    pub uncompressed_archive_size: u64,
    /// The tar members, as listed.
    pub entries: Vec<ZtocEntry>,
    /// How the layer is compressed and where inflation can restart.
    pub compression: CompressionInfo,
}

/// The kind of a TOC entry (the zTOC's `type` string).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZtocEntryType {
    /// `reg`
    Regular,
    /// `dir`
    Dir,
    /// `symlink`
    Symlink,
    /// `hardlink`
    Hardlink,
    /// `char`
    Char,
    /// `block`
    Block,
    /// `fifo`
    Fifo,
}

impl ZtocEntryType {
    /// The string the zTOC stores.
    pub fn as_str(self) -> &'static str {
        match self {
            ZtocEntryType::Regular => "reg",
            ZtocEntryType::Dir => "dir",
            ZtocEntryType::Symlink => "symlink",
            ZtocEntryType::Hardlink => "hardlink",
            ZtocEntryType::Char => "char",
            ZtocEntryType::Block => "block",
            ZtocEntryType::Fifo => "fifo",
        }
    }

    /// Inverse of [`ZtocEntryType::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "reg" => ZtocEntryType::Regular,
            "dir" => ZtocEntryType::Dir,
            "symlink" => ZtocEntryType::Symlink,
            "hardlink" => ZtocEntryType::Hardlink,
            "char" => ZtocEntryType::Char,
            "block" => ZtocEntryType::Block,
            "fifo" => ZtocEntryType::Fifo,
            _ => return None,
        })
    }
}

/// One TOC entry (`FileMetadata`), fields as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZtocEntry {
    /// The raw tar name (may start with `./` or end with `/`).
    pub name: String,
    /// What kind of member it is.
    pub kind: ZtocEntryType,
    /// Offset of the member's data in the tar stream (just past its header blocks).
    pub uncompressed_offset: u64,
    /// The tar header's size field.
    pub uncompressed_size: u64,
    /// Symlink or hard-link target.
    pub linkname: String,
    /// The raw tar mode.
    pub mode: u64,
    /// Owner user id.
    pub uid: u32,
    /// Owner group id.
    pub gid: u32,
    /// Owner user name.
    pub uname: String,
    /// Owner group name.
    pub gname: String,
    /// Modification time as RFC 3339 text (empty when absent).
    pub mod_time: String,
    /// Device major number.
    pub devmajor: u64,
    /// Device minor number.
    pub devminor: u64,
    /// The member's PAX records (the schema calls them xattrs), in stored order; Linux
    /// xattrs are the `SCHILY.xattr.`-prefixed keys.
    pub pax_records: Vec<(String, Vec<u8>)>,
}

/// The zTOC's `compression_algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZtocCompression {
    /// 1: gzip; the checkpoints blob is gzip zinfo ([`zinfo`]).
    Gzip,
    /// 2: plain tar; the checkpoints blob is a nested `TarZinfo` flatbuffer.
    Uncompressed,
}

/// The zTOC's `CompressionInfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressionInfo {
    /// How the layer is compressed (gzip when the field is absent, its default).
    pub algorithm: ZtocCompression,
    /// Number of spans minus one.
    pub max_span_id: u32,
    /// One digest string (`sha256:<hex>`) per span, over its compressed bytes.
    pub span_digests: Vec<String>,
    /// The checkpoints blob, uninterpreted (see [`parse_gzip_zinfo`]).
    pub checkpoints: Vec<u8>,
}

fn soci_err(msg: impl Into<String>) -> Error {
    Error::Soci(msg.into())
}

// ---------------------------------------------------------------------------------------
// Field slots (vtable byte offsets, 4 + 2·id), from ztoc.fbs.

const ZTOC_VERSION_SLOT: u16 = 4;
const ZTOC_BUILD_TOOL: u16 = 6;
const ZTOC_COMPRESSED_SIZE: u16 = 8;
const ZTOC_UNCOMPRESSED_SIZE: u16 = 10;
const ZTOC_TOC: u16 = 12;
const ZTOC_COMPRESSION_INFO: u16 = 14;

const TOC_METADATA: u16 = 4;

const XATTR_KEY: u16 = 4;
const XATTR_VALUE: u16 = 6;

const FM_NAME: u16 = 4;
const FM_TYPE: u16 = 6;
const FM_UNCOMPRESSED_OFFSET: u16 = 8;
const FM_UNCOMPRESSED_SIZE: u16 = 10;
const FM_LINKNAME: u16 = 12;
const FM_MODE: u16 = 14;
const FM_UID: u16 = 16;
const FM_GID: u16 = 18;
const FM_UNAME: u16 = 20;
const FM_GNAME: u16 = 22;
const FM_MOD_TIME: u16 = 24;
const FM_DEVMAJOR: u16 = 26;
const FM_DEVMINOR: u16 = 28;
const FM_XATTRS: u16 = 30;

const CI_ALGORITHM: u16 = 4;
const CI_MAX_SPAN_ID: u16 = 6;
const CI_SPAN_DIGESTS: u16 = 8;
const CI_CHECKPOINTS: u16 = 10;

/// `CompressionAlgorithm` values.
const ALGORITHM_GZIP: i8 = 1;
const ALGORITHM_UNCOMPRESSED: i8 = 2;

// ---------------------------------------------------------------------------------------
// Verification: one marker type per table, each visiting every field with the type the
// accessors below read it as. Only after the whole buffer passed do the accessors run.

struct ZtocTable;
struct TocTable;
struct FileMetadataTable;
struct XattrTable;
struct CompressionInfoTable;

type Str<'a> = ForwardsUOffset<&'a str>;
type Bytes<'a> = ForwardsUOffset<Vector<'a, u8>>;
type TableVec<'a, T> = ForwardsUOffset<Vector<'a, ForwardsUOffset<T>>>;

impl Verifiable for ZtocTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
        v.visit_table(pos)?
            .visit_field::<Str>("version", ZTOC_VERSION_SLOT, false)?
            .visit_field::<Str>("build_tool_identifier", ZTOC_BUILD_TOOL, false)?
            .visit_field::<i64>("compressed_archive_size", ZTOC_COMPRESSED_SIZE, false)?
            .visit_field::<i64>("uncompressed_archive_size", ZTOC_UNCOMPRESSED_SIZE, false)?
            .visit_field::<ForwardsUOffset<TocTable>>("toc", ZTOC_TOC, false)?
            .visit_field::<ForwardsUOffset<CompressionInfoTable>>(
                "compression_info",
                ZTOC_COMPRESSION_INFO,
                false,
            )?
            .finish();
        Ok(())
    }
}

impl Verifiable for TocTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
        v.visit_table(pos)?
            .visit_field::<TableVec<FileMetadataTable>>("metadata", TOC_METADATA, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for XattrTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
        v.visit_table(pos)?
            .visit_field::<Str>("key", XATTR_KEY, false)?
            // Read as bytes: an xattr value need not be UTF-8.
            .visit_field::<Bytes>("value", XATTR_VALUE, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for FileMetadataTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
        v.visit_table(pos)?
            .visit_field::<Str>("name", FM_NAME, false)?
            .visit_field::<Str>("type", FM_TYPE, false)?
            .visit_field::<i64>("uncompressed_offset", FM_UNCOMPRESSED_OFFSET, false)?
            .visit_field::<i64>("uncompressed_size", FM_UNCOMPRESSED_SIZE, false)?
            .visit_field::<Str>("linkname", FM_LINKNAME, false)?
            .visit_field::<i64>("mode", FM_MODE, false)?
            .visit_field::<u32>("uid", FM_UID, false)?
            .visit_field::<u32>("gid", FM_GID, false)?
            .visit_field::<Str>("uname", FM_UNAME, false)?
            .visit_field::<Str>("gname", FM_GNAME, false)?
            .visit_field::<Str>("mod_time", FM_MOD_TIME, false)?
            .visit_field::<i64>("devmajor", FM_DEVMAJOR, false)?
            .visit_field::<i64>("devminor", FM_DEVMINOR, false)?
            .visit_field::<TableVec<XattrTable>>("xattrs", FM_XATTRS, false)?
            .finish();
        Ok(())
    }
}

impl Verifiable for CompressionInfoTable {
    fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
        v.visit_table(pos)?
            .visit_field::<i8>("compression_algorithm", CI_ALGORITHM, false)?
            .visit_field::<i32>("max_span_id", CI_MAX_SPAN_ID, false)?
            .visit_field::<ForwardsUOffset<Vector<Str>>>("span_digests", CI_SPAN_DIGESTS, false)?
            .visit_field::<Bytes>("checkpoints", CI_CHECKPOINTS, false)?
            .finish();
        Ok(())
    }
}

/// A verified table. Every accessor reads a slot with exactly the type its table's
/// [`Verifiable`] impl checked it as.
#[derive(Clone, Copy)]
struct Verified<'a>(Table<'a>);

impl<'a> Verified<'a> {
    fn str(self, slot: u16) -> &'a str {
        // SAFETY: the slot was verified as an offset to a string (bounds, UTF-8, NUL).
        unsafe { self.0.get::<Str>(slot, None) }.unwrap_or_default()
    }

    fn bytes(self, slot: u16) -> &'a [u8] {
        // SAFETY: the slot was verified as an offset to a `[ubyte]` inside the buffer.
        unsafe { self.0.get::<Bytes>(slot, None) }.map_or(&[], |v| v.bytes())
    }

    fn i64(self, slot: u16) -> i64 {
        // SAFETY: the slot was verified as an in-bounds, aligned i64.
        unsafe { self.0.get::<i64>(slot, Some(0)) }.unwrap_or(0)
    }

    fn i32(self, slot: u16) -> i32 {
        // SAFETY: the slot was verified as an in-bounds, aligned i32.
        unsafe { self.0.get::<i32>(slot, Some(0)) }.unwrap_or(0)
    }

    fn u32(self, slot: u16) -> u32 {
        // SAFETY: the slot was verified as an in-bounds, aligned u32.
        unsafe { self.0.get::<u32>(slot, Some(0)) }.unwrap_or(0)
    }

    fn i8(self, slot: u16, default: i8) -> i8 {
        // SAFETY: the slot was verified as an in-bounds i8.
        unsafe { self.0.get::<i8>(slot, Some(default)) }.unwrap_or(default)
    }

    fn table(self, slot: u16) -> Option<Verified<'a>> {
        // SAFETY: the slot was verified as an offset to a table of the expected type.
        unsafe { self.0.get::<ForwardsUOffset<Table>>(slot, None) }.map(Verified)
    }

    fn tables(self, slot: u16) -> Option<Vector<'a, ForwardsUOffset<Table<'a>>>> {
        // SAFETY: the slot was verified as an offset to a vector of offsets to tables of
        // the expected type.
        unsafe {
            self.0
                .get::<ForwardsUOffset<Vector<ForwardsUOffset<Table>>>>(slot, None)
        }
    }

    fn strings(self, slot: u16) -> Option<Vector<'a, Str<'a>>> {
        // SAFETY: the slot was verified as an offset to a vector of strings.
        unsafe { self.0.get::<ForwardsUOffset<Vector<Str>>>(slot, None) }
    }
}

/// A long (i64) field that must not be negative.
fn non_negative(value: i64, what: &str) -> Result<u64> {
    u64::try_from(value).map_err(|_| soci_err(format!("{what} is negative ({value})")))
}

/// Parses a zTOC blob. Verifies the whole flatbuffer first (limits scale with the input,
/// so nothing the buffer merely claims is allocated), then copies it out; the result is
/// typed but not yet checked against a layer ([`Ztoc::to_layer_index`] does that).
pub fn parse_ztoc(bytes: &[u8]) -> Result<Ztoc> {
    if bytes.len() > MAX_ZTOC_BYTES {
        return Err(soci_err(format!(
            "{} bytes is larger than any flatbuffer can be",
            bytes.len()
        )));
    }
    if bytes.len() < 4 {
        return Err(soci_err(format!(
            "{} bytes is too short for a flatbuffer (no root offset)",
            bytes.len()
        )));
    }
    // Every table costs at least its 4-byte vtable offset plus the 4-byte offset that
    // reaches it; the apparent size bounds what shared (aliased) strings and vectors
    // could expand into.
    let opts = VerifierOptions {
        max_depth: 8,
        max_tables: bytes.len() / 4 + 8,
        max_apparent_size: bytes.len().saturating_mul(8).saturating_add(4096),
        ignore_missing_null_terminator: false,
    };
    let mut verifier = Verifier::new(&opts, bytes);
    <ForwardsUOffset<ZtocTable>>::run_verifier(&mut verifier, 0)
        .map_err(|e| soci_err(format!("not a valid zTOC flatbuffer: {e}")))?;
    // SAFETY: offset 0 was verified as the offset of a root `Ztoc` table.
    let root = Verified(unsafe { flatbuffers::root_unchecked::<Table>(bytes) });

    let mut entries = Vec::new();
    if let Some(toc) = root.table(ZTOC_TOC)
        && let Some(list) = toc.tables(TOC_METADATA)
    {
        // Aliased tables would let 4 bytes of input expand into a whole entry; the
        // published writer never shares them, so one entry per 8 input bytes is ample.
        if list.len() > MAX_ZTOC_ENTRIES || list.len() > bytes.len() / 8 {
            return Err(soci_err(format!(
                "the TOC lists {} entries, more than a {}-byte zTOC can hold",
                list.len(),
                bytes.len()
            )));
        }
        entries.reserve(list.len());
        for (i, fm) in list.iter().enumerate() {
            entries.push(
                parse_entry(Verified(fm)).map_err(|e| soci_err(format!("TOC entry {i}: {e}")))?,
            );
        }
    }

    let compression = match root.table(ZTOC_COMPRESSION_INFO) {
        Some(ci) => parse_compression_info(ci)?,
        None => return Err(soci_err("the zTOC has no compression_info")),
    };

    Ok(Ztoc {
        version: root.str(ZTOC_VERSION_SLOT).to_string(),
        build_tool_identifier: root.str(ZTOC_BUILD_TOOL).to_string(),
        compressed_archive_size: non_negative(
            root.i64(ZTOC_COMPRESSED_SIZE),
            "compressed_archive_size",
        )?,
        uncompressed_archive_size: non_negative(
            root.i64(ZTOC_UNCOMPRESSED_SIZE),
            "uncompressed_archive_size",
        )?,
        entries,
        compression,
    })
}

/// Error text without the variant's prefix, for nesting.
fn reason(e: Error) -> String {
    match e {
        Error::Soci(m) => m,
        other => other.to_string(),
    }
}

fn parse_entry(fm: Verified<'_>) -> std::result::Result<ZtocEntry, String> {
    let name = fm.str(FM_NAME);
    let with_name = |m: String| format!("{name:?}: {m}");
    let kind_str = fm.str(FM_TYPE);
    let kind = ZtocEntryType::parse(kind_str)
        .ok_or_else(|| with_name(format!("unknown entry type {kind_str:?}")))?;
    let field = |slot, what| non_negative(fm.i64(slot), what).map_err(|e| with_name(reason(e)));
    let mut pax_records = Vec::new();
    if let Some(list) = fm.tables(FM_XATTRS) {
        pax_records.reserve(list.len());
        for x in list.iter() {
            let x = Verified(x);
            pax_records.push((x.str(XATTR_KEY).to_string(), x.bytes(XATTR_VALUE).to_vec()));
        }
    }
    Ok(ZtocEntry {
        name: name.to_string(),
        kind,
        uncompressed_offset: field(FM_UNCOMPRESSED_OFFSET, "uncompressed_offset")?,
        uncompressed_size: field(FM_UNCOMPRESSED_SIZE, "uncompressed_size")?,
        linkname: fm.str(FM_LINKNAME).to_string(),
        mode: field(FM_MODE, "mode")?,
        uid: fm.u32(FM_UID),
        gid: fm.u32(FM_GID),
        uname: fm.str(FM_UNAME).to_string(),
        gname: fm.str(FM_GNAME).to_string(),
        mod_time: fm.str(FM_MOD_TIME).to_string(),
        devmajor: field(FM_DEVMAJOR, "devmajor")?,
        devminor: field(FM_DEVMINOR, "devminor")?,
        pax_records,
    })
}

fn parse_compression_info(ci: Verified<'_>) -> Result<CompressionInfo> {
    let algorithm = match ci.i8(CI_ALGORITHM, ALGORITHM_GZIP) {
        ALGORITHM_GZIP => ZtocCompression::Gzip,
        ALGORITHM_UNCOMPRESSED => ZtocCompression::Uncompressed,
        other => {
            return Err(soci_err(format!(
                "unknown compression_algorithm {other} (the format knows 1 = gzip and \
                 2 = uncompressed; there is no zstd zTOC)"
            )));
        }
    };
    let max_span_id = ci.i32(CI_MAX_SPAN_ID);
    let max_span_id = u32::try_from(max_span_id)
        .map_err(|_| soci_err(format!("max_span_id is negative ({max_span_id})")))?;
    let span_digests = ci
        .strings(CI_SPAN_DIGESTS)
        .map(|v| v.iter().map(str::to_string).collect())
        .unwrap_or_default();
    Ok(CompressionInfo {
        algorithm,
        max_span_id,
        span_digests,
        checkpoints: ci.bytes(CI_CHECKPOINTS).to_vec(),
    })
}
