//! A [`Ztoc`] as a ferry [`LayerIndex`]: the checks a reader relies on, and the mapping.
//!
//! Span boundaries agree exactly: ferry's span `i` is `[start_byte(i), in_offset(i + 1))`
//! (the last one to the end of the blob), which is the published reader's range for its
//! span `i`, so every SOCI span digest vouches for exactly the bytes ferry fetches for
//! that span. SOCI's checkpoint 0 sits after the first gzip header (no span covers the
//! header), so it becomes a plain raw-deflate checkpoint with no history rather than one
//! of ferry's member-start checkpoints; ferry's extraction then crosses later member
//! boundaries exactly as SOCI's does (trailer skipped, next header parsed).

use std::collections::BTreeMap;

use ferry_oci::digest::parse_sha256_bytes;

use super::zinfo::{ZinfoCheckpoint, parse_gzip_zinfo};
use super::{Ztoc, ZtocCompression, ZtocEntry, ZtocEntryType, soci_err};
use crate::entry::{Entry, EntryKind};
use crate::error::Result;
use crate::ferryidx::{Checkpoint, Compression, LayerIndex};
use crate::tarwalk::{BLOCK_U64, normalize_path};
use crate::zran::{WINDOW_SIZE, deflate_window};

/// PAX record prefix of a Linux extended attribute.
const XATTR_PREFIX: &str = "SCHILY.xattr.";
impl Ztoc {
    /// Checks this zTOC against the layer it describes (`layer_digest`, `layer_size` as
    /// the image manifest gives them) and converts it into a ferry index with the
    /// checkpoint windows inline. Refuses, naming what is wrong: plain-tar zTOCs (not
    /// supported yet), a size that is not the layer's, a span count that disagrees with
    /// `max_span_id` or the digests, checkpoints that do not advance or lie outside the
    /// layer, malformed digests, and TOC entries that overlap or reach past the tar.
    pub fn to_layer_index(&self, layer_digest: &str, layer_size: u64) -> Result<LayerIndex> {
        let info = &self.compression;
        if info.algorithm == ZtocCompression::Uncompressed {
            return Err(soci_err(
                "zTOCs of uncompressed (plain tar) layers are not supported",
            ));
        }
        if self.compressed_archive_size != layer_size {
            return Err(soci_err(format!(
                "compressed_archive_size {} is not the layer's size {layer_size}",
                self.compressed_archive_size
            )));
        }
        let uncompressed_size = self.uncompressed_archive_size;
        let zinfo = parse_gzip_zinfo(&info.checkpoints)?;
        let spans = zinfo.checkpoints.len() as u64;
        if u64::from(info.max_span_id) + 1 != spans {
            return Err(soci_err(format!(
                "max_span_id {} disagrees with the {spans} checkpoints",
                info.max_span_id
            )));
        }
        if info.span_digests.len() as u64 != spans {
            return Err(soci_err(format!(
                "{} span digests for {spans} spans",
                info.span_digests.len()
            )));
        }
        let checkpoints = convert_checkpoints(&zinfo.checkpoints, layer_size, uncompressed_size)?;
        let span_digests = info
            .span_digests
            .iter()
            .enumerate()
            .map(|(i, d)| {
                parse_sha256_bytes(d).map_err(|e| soci_err(format!("span digest {i}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let entries = convert_entries(&self.entries, uncompressed_size)?;
        let index = LayerIndex {
            layer_digest: layer_digest.to_string(),
            compression: Compression::Gzip,
            compressed_size: layer_size,
            uncompressed_size,
            span_size: zinfo.span_size,
            checkpoints,
            span_digests,
            entries,
            windows: None,
            libraries: Vec::new(),
        };
        index
            .validate()
            .map_err(|e| soci_err(format!("converted index is inconsistent: {e}")))?;
        Ok(index)
    }
}

fn convert_checkpoints(
    zinfo: &[ZinfoCheckpoint<'_>],
    layer_size: u64,
    uncompressed_size: u64,
) -> Result<Vec<Checkpoint>> {
    let mut compressor = None;
    let mut out = Vec::with_capacity(zinfo.len());
    for (i, cp) in zinfo.iter().enumerate() {
        if i == 0 && cp.out_offset != 0 {
            return Err(soci_err(format!(
                "checkpoint 0 is at uncompressed offset {}, not 0",
                cp.out_offset
            )));
        }
        if cp.bits > 0 && cp.in_offset == 0 {
            return Err(soci_err(format!(
                "checkpoint {i} starts mid-byte before the first byte"
            )));
        }
        let start = cp.in_offset - u64::from(cp.bits > 0);
        let end = zinfo.get(i + 1).map_or(layer_size, |next| next.in_offset);
        if cp.in_offset > layer_size || start >= end {
            return Err(soci_err(format!(
                "checkpoint {i} (compressed offset {}) does not start a non-empty span \
                 inside the {layer_size}-byte layer",
                cp.in_offset
            )));
        }
        let next_out = zinfo.get(i + 1).map_or(uncompressed_size, |n| n.out_offset);
        if cp.out_offset >= next_out.max(1) {
            return Err(soci_err(format!(
                "checkpoint {i} (uncompressed offset {}) is not before {} ({})",
                cp.out_offset,
                next_out,
                if i + 1 < zinfo.len() {
                    "the next checkpoint"
                } else {
                    "the end of the archive"
                }
            )));
        }
        // Only the history that really came before the checkpoint matters: the zero
        // fill in front of an early window is nothing a back-reference may reach.
        let history = usize::try_from(cp.out_offset).map_or(WINDOW_SIZE, |o| o.min(WINDOW_SIZE));
        let window = cp
            .window
            .get(cp.window.len().saturating_sub(history)..)
            .unwrap_or_default();
        let window_deflate = deflate_window(&mut compressor, window)
            .map_err(|e| soci_err(format!("checkpoint {i}: {e}")))?;
        out.push(Checkpoint {
            in_offset: cp.in_offset,
            bits: cp.bits,
            out_offset: cp.out_offset,
            member_start: false,
            window_deflate,
            window: None,
        });
    }
    Ok(out)
}

/// Converts the TOC, in tar order, rebuilding each member's header offset the way the
/// published reader does (the first header at 0, each next one at the previous member's
/// data end rounded up to a block), and refusing entries that overlap.
fn convert_entries(list: &[ZtocEntry], uncompressed_size: u64) -> Result<Vec<Entry>> {
    let mut order: Vec<usize> = (0..list.len()).collect();
    order.sort_by_key(|&i| list[i].uncompressed_offset);
    let mut entries = Vec::with_capacity(list.len());
    let mut next_header = 0u64;
    for i in order {
        let z = &list[i];
        let bad = |m: String| soci_err(format!("TOC entry {i} {:?}: {m}", z.name));
        let mut e = convert_entry(z).map_err(bad)?;
        let offset = z.uncompressed_offset;
        let data_end = offset.checked_add(z.uncompressed_size);
        if !offset.is_multiple_of(BLOCK_U64)
            || offset < next_header.saturating_add(BLOCK_U64)
            || data_end.is_none_or(|end| end > uncompressed_size)
        {
            return Err(bad(format!(
                "data at {} (+{} bytes) overlaps the previous member or its own header, \
                 is not block-aligned, or ends past the {uncompressed_size}-byte archive",
                offset, z.uncompressed_size
            )));
        }
        e.header_offset = next_header;
        let end = data_end.unwrap_or(u64::MAX);
        next_header = end.div_ceil(BLOCK_U64).saturating_mul(BLOCK_U64);
        entries.push(e);
    }
    Ok(entries)
}

fn convert_entry(z: &ZtocEntry) -> std::result::Result<Entry, String> {
    let kind = match z.kind {
        ZtocEntryType::Regular => EntryKind::File,
        ZtocEntryType::Dir => EntryKind::Dir,
        ZtocEntryType::Symlink => EntryKind::Symlink,
        ZtocEntryType::Hardlink => EntryKind::Hardlink,
        ZtocEntryType::Char => EntryKind::Char,
        ZtocEntryType::Block => EntryKind::Block,
        ZtocEntryType::Fifo => EntryKind::Fifo,
    };
    let path = normalize_path(&z.name).ok_or("the name has a \"..\" component")?;
    if kind != EntryKind::File && z.uncompressed_size != 0 {
        return Err(format!(
            "a {} entry claims {} bytes of data",
            z.kind.as_str(),
            z.uncompressed_size
        ));
    }
    let link_target = match kind {
        EntryKind::Symlink if z.linkname.is_empty() => return Err("empty symlink target".into()),
        EntryKind::Symlink => z.linkname.clone(),
        EntryKind::Hardlink => match normalize_path(&z.linkname) {
            Some(t) if !t.is_empty() => t,
            _ => {
                return Err(format!(
                    "hard link target {:?} is not in the layer",
                    z.linkname
                ));
            }
        },
        _ => String::new(),
    };
    let device = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| format!("{what} {v} does not fit 32 bits"))
    };
    let (mtime, mtime_nsec) = if z.mod_time.is_empty() {
        (0, 0)
    } else {
        crate::rfc3339::parse(&z.mod_time)
            .ok_or_else(|| format!("mod_time {:?} is not an RFC 3339 time", z.mod_time))?
    };
    let xattrs: BTreeMap<String, Vec<u8>> = z
        .pax_records
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(XATTR_PREFIX)?.to_string(), v.clone())))
        .collect();
    Ok(Entry {
        path,
        kind,
        mode: (z.mode & 0o7777) as u32,
        uid: z.uid,
        gid: z.gid,
        uname: z.uname.clone(),
        gname: z.gname.clone(),
        mtime,
        mtime_nsec,
        size: if kind == EntryKind::File {
            z.uncompressed_size
        } else {
            0
        },
        // Ferry keeps a data offset for files only.
        offset: if kind == EntryKind::File {
            z.uncompressed_offset
        } else {
            0
        },
        header_offset: 0,
        link_target,
        dev_major: device(z.devmajor, "devmajor")?,
        dev_minor: device(z.devminor, "devminor")?,
        xattrs,
    })
}
