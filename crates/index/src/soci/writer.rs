//! Our own zTOC writer, following the published layout (soci-snapshotter's `ztoc.fbs`
//! and gzip zinfo), for tests and test fixtures. Not a port of the published builder:
//! the flatbuffer's byte layout (field and vtable placement) differs from theirs, its
//! meaning does not.

use ferry_oci::digest::sha256_digest;
use flatbuffers::{FlatBufferBuilder, WIPOffset};

use super::zinfo::{ZinfoCheckpoint, encode_gzip_zinfo};
use super::*;
use crate::entry::{Entry, EntryKind};
use crate::tarwalk::TarWalker;
use crate::zran::{GzipIndexer, HeaderParse, inflate_window, parse_member_header};

/// Builds a zTOC for the gzip layer `layer` (the whole blob), with a checkpoint wherever
/// a deflate block boundary lies more than `span_size` uncompressed bytes past the
/// previous checkpoint, as `soci create` places them; `build_tool` is written as the
/// build tool identifier.
///
/// Our own writer following the published layout (see `docs/formats.md`, "SOCI zTOC"):
/// the blob holds a version-2 gzip zinfo, one `sha256:` digest per span over exactly the
/// compressed range a SOCI reader fetches for it, and the TOC as our tar walker reads the
/// layer (PAX records other than xattrs are not carried). Differences from the published
/// builder: a later gzip member's start is a checkpoint (at its deflate data) whenever it
/// is far enough from the previous one, and checkpoints after the tar's end-of-archive
/// blocks are left out.
pub fn write_ztoc(layer: &[u8], span_size: u64, build_tool: &str) -> Result<Vec<u8>> {
    // The indexer places a checkpoint at `span` or more bytes; SOCI's rule is "more than".
    let indexer = GzipIndexer::new(layer, span_size.saturating_add(1));
    let mut walker = TarWalker::new(indexer);
    // The zTOC gives every member its data offset (ferry's entries only files'): where
    // the walker stands right after the member's headers.
    let mut entries = Vec::new();
    while let Some(e) = walker.next_entry()? {
        let data_offset = walker.position();
        entries.push((e, data_offset));
    }
    let tar_end = walker.position();
    let index = walker.into_inner().finish()?;
    if index.compressed_size != layer.len() as u64 {
        return Err(soci_err("the gzip stream does not span the whole layer"));
    }

    let mut windows: Vec<Vec<u8>> = Vec::new();
    let mut points: Vec<(u64, u64, u8)> = Vec::new();
    for cp in index
        .checkpoints
        .iter()
        .filter(|c| c.out_offset < tar_end.max(1))
    {
        if cp.member_start {
            // SOCI resumes in a member's deflate data, never at its header.
            let at = usize::try_from(cp.in_offset).unwrap_or(usize::MAX);
            let header = match parse_member_header(layer.get(at..).unwrap_or_default())? {
                HeaderParse::Complete(len) => len as u64,
                HeaderParse::Incomplete => {
                    return Err(soci_err(format!("gzip member header at {at} is cut short")));
                }
            };
            points.push((cp.in_offset + header, cp.out_offset, 0));
            windows.push(Vec::new());
        } else {
            points.push((cp.in_offset, cp.out_offset, cp.bits));
            windows.push(inflate_window(&cp.window_deflate)?);
        }
    }
    let zinfo: Vec<ZinfoCheckpoint<'_>> = points
        .iter()
        .zip(&windows)
        .map(|(&(in_offset, out_offset, bits), w)| ZinfoCheckpoint {
            in_offset,
            out_offset,
            bits,
            window: w,
        })
        .collect();
    let span_digests: Vec<String> = (0..zinfo.len())
        .map(|i| {
            let start = zinfo[i].in_offset - u64::from(zinfo[i].bits > 0);
            let end = zinfo.get(i + 1).map_or(layer.len() as u64, |n| n.in_offset);
            let bytes = layer.get(start as usize..end as usize).unwrap_or_default();
            sha256_digest(bytes).to_string()
        })
        .collect();
    let checkpoints = encode_gzip_zinfo(span_size, &zinfo)?;
    let max_span_id = i32::try_from(zinfo.len().saturating_sub(1))
        .map_err(|_| soci_err("too many spans for max_span_id"))?;

    let mut fbb = FlatBufferBuilder::new();
    let metadata = entries
        .iter()
        .map(|(e, data_offset)| file_metadata(&mut fbb, e, *data_offset))
        .collect::<Result<Vec<_>>>()?;
    let metadata = fbb.create_vector(&metadata);
    let toc = {
        let t = fbb.start_table();
        fbb.push_slot_always(TOC_METADATA, metadata);
        fbb.end_table(t)
    };
    let digests: Vec<_> = span_digests.iter().map(|d| fbb.create_string(d)).collect();
    let digests = fbb.create_vector(&digests);
    let checkpoints = fbb.create_vector(&checkpoints);
    let info = {
        let t = fbb.start_table();
        // Gzip is the field's default, so, like the published writer, it is left out.
        fbb.push_slot::<i8>(CI_ALGORITHM, ALGORITHM_GZIP, ALGORITHM_GZIP);
        fbb.push_slot::<i32>(CI_MAX_SPAN_ID, max_span_id, 0);
        fbb.push_slot_always(CI_SPAN_DIGESTS, digests);
        fbb.push_slot_always(CI_CHECKPOINTS, checkpoints);
        fbb.end_table(t)
    };
    let version = fbb.create_string(ZTOC_VERSION);
    let tool = fbb.create_string(build_tool);
    let size = |v: u64| i64::try_from(v).map_err(|_| soci_err(format!("size {v} too large")));
    let root = {
        let t = fbb.start_table();
        fbb.push_slot_always(ZTOC_VERSION_SLOT, version);
        fbb.push_slot_always(ZTOC_BUILD_TOOL, tool);
        fbb.push_slot::<i64>(ZTOC_COMPRESSED_SIZE, size(layer.len() as u64)?, 0);
        fbb.push_slot::<i64>(ZTOC_UNCOMPRESSED_SIZE, size(tar_end)?, 0);
        fbb.push_slot_always(ZTOC_TOC, toc);
        fbb.push_slot_always(ZTOC_COMPRESSION_INFO, info);
        fbb.end_table(t)
    };
    fbb.finish_minimal(root);
    Ok(fbb.finished_data().to_vec())
}

fn file_metadata<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    e: &Entry,
    data_offset: u64,
) -> Result<WIPOffset<flatbuffers::TableFinishedWIPOffset>> {
    let kind = match e.kind {
        EntryKind::File => ZtocEntryType::Regular,
        EntryKind::Dir => ZtocEntryType::Dir,
        EntryKind::Symlink => ZtocEntryType::Symlink,
        EntryKind::Hardlink => ZtocEntryType::Hardlink,
        EntryKind::Char => ZtocEntryType::Char,
        EntryKind::Block => ZtocEntryType::Block,
        EntryKind::Fifo => ZtocEntryType::Fifo,
    };
    // Names as a tar writer spells them: directories with a trailing slash.
    let name = match e.kind {
        EntryKind::Dir if e.path.is_empty() => "./".to_string(),
        EntryKind::Dir => format!("{}/", e.path),
        _ => e.path.clone(),
    };
    let name = fbb.create_string(&name);
    let kind = fbb.create_string(kind.as_str());
    let link = (!e.link_target.is_empty()).then(|| fbb.create_string(&e.link_target));
    let uname = (!e.uname.is_empty()).then(|| fbb.create_string(&e.uname));
    let gname = (!e.gname.is_empty()).then(|| fbb.create_string(&e.gname));
    let mod_time = crate::rfc3339::format(e.mtime, e.mtime_nsec).ok_or_else(|| {
        soci_err(format!(
            "time {}.{:09} cannot be written as RFC 3339",
            e.mtime, e.mtime_nsec
        ))
    })?;
    let mod_time = fbb.create_string(&mod_time);
    let xattrs: Vec<_> = e
        .xattrs
        .iter()
        .map(|(k, v)| {
            let key = fbb.create_string(&format!("SCHILY.xattr.{k}"));
            let value = fbb.create_vector(v);
            let t = fbb.start_table();
            fbb.push_slot_always(XATTR_KEY, key);
            fbb.push_slot_always(XATTR_VALUE, value);
            fbb.end_table(t)
        })
        .collect();
    let xattrs = (!xattrs.is_empty()).then(|| fbb.create_vector(&xattrs));
    let long = |v: u64| i64::try_from(v).map_err(|_| soci_err(format!("value {v} too large")));

    let t = fbb.start_table();
    fbb.push_slot_always(FM_NAME, name);
    fbb.push_slot_always(FM_TYPE, kind);
    fbb.push_slot::<i64>(FM_UNCOMPRESSED_OFFSET, long(data_offset)?, 0);
    fbb.push_slot::<i64>(FM_UNCOMPRESSED_SIZE, long(e.size)?, 0);
    if let Some(link) = link {
        fbb.push_slot_always(FM_LINKNAME, link);
    }
    fbb.push_slot::<i64>(FM_MODE, i64::from(e.mode), 0);
    fbb.push_slot::<u32>(FM_UID, e.uid, 0);
    fbb.push_slot::<u32>(FM_GID, e.gid, 0);
    if let Some(uname) = uname {
        fbb.push_slot_always(FM_UNAME, uname);
    }
    if let Some(gname) = gname {
        fbb.push_slot_always(FM_GNAME, gname);
    }
    fbb.push_slot_always(FM_MOD_TIME, mod_time);
    fbb.push_slot::<i64>(FM_DEVMAJOR, i64::from(e.dev_major), 0);
    fbb.push_slot::<i64>(FM_DEVMINOR, i64::from(e.dev_minor), 0);
    if let Some(xattrs) = xattrs {
        fbb.push_slot_always(FM_XATTRS, xattrs);
    }
    Ok(fbb.end_table(t))
}
