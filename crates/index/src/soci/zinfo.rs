//! The gzip zinfo blob: a zTOC's `checkpoints` for a gzip layer (soci-snapshotter's
//! `ztoc/compression/gzip_zinfo.c`, itself after zlib's `zran.c`).
//!
//! Little-endian and packed: `i32` checkpoint count N, `i64` span size, then the
//! checkpoints, 32785 bytes each: `i64` compressed offset (first whole byte), `i64`
//! uncompressed offset, `u8` bits (0..=7) of the byte before still to be read, and the
//! 32 KiB of output before the checkpoint, oldest first. The version is told by the
//! length alone: N records (version 2, what is written today) or N - 1 (version 1,
//! whose checkpoint 0 is left out and taken as compressed offset 10).
//!
//! This module parses and encodes the blob; it does not decide what the offsets mean for
//! a layer ([`super::Ztoc::to_layer_index`] checks them). Windows are borrowed from the
//! input, never copied, and the count is checked against the length in 64-bit
//! arithmetic before anything is allocated.

use super::soci_err;
use crate::error::Result;
use crate::zran::WINDOW_SIZE;

/// Bytes before the first checkpoint: count and span size.
pub const ZINFO_HEADER_LEN: usize = 12;
/// Bytes per checkpoint record: in, out, bits, window.
pub const ZINFO_CHECKPOINT_LEN: usize = 8 + 8 + 1 + WINDOW_SIZE;
/// Compressed offset of version 1's implicit checkpoint 0 (a flagless gzip header).
pub const V1_FIRST_IN_OFFSET: u64 = 10;

/// One checkpoint of a gzip zinfo blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZinfoCheckpoint<'a> {
    /// Compressed offset of the first whole byte inflation resumes at.
    pub in_offset: u64,
    /// Uncompressed offset the checkpoint resumes at.
    pub out_offset: u64,
    /// High bits (0..=7) of the byte at `in_offset - 1` still to be read.
    pub bits: u8,
    /// The 32 KiB of history before `out_offset`, oldest first (zero-filled in front
    /// when less output came before); empty for version 1's implicit checkpoint 0.
    pub window: &'a [u8],
}

/// A parsed gzip zinfo blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GzipZinfo<'a> {
    /// The span size the builder was asked for (informational: boundaries come from the
    /// checkpoints).
    pub span_size: u64,
    /// The checkpoints, as stored (version 1's implicit first one included).
    pub checkpoints: Vec<ZinfoCheckpoint<'a>>,
    /// True when the blob is version 1 (checkpoint 0 not stored).
    pub legacy_v1: bool,
}

fn read_i64(b: &[u8], at: usize) -> Option<i64> {
    Some(i64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Parses a gzip zinfo blob. Refuses a count below 1 (no span could be read), a length
/// that fits neither version, negative offsets and bit counts above 7.
pub fn parse_gzip_zinfo(blob: &[u8]) -> Result<GzipZinfo<'_>> {
    if blob.len() < ZINFO_HEADER_LEN {
        return Err(soci_err(format!(
            "checkpoints blob of {} bytes is shorter than its {ZINFO_HEADER_LEN}-byte header",
            blob.len()
        )));
    }
    let count = i32::from_le_bytes([blob[0], blob[1], blob[2], blob[3]]);
    let span_size = read_i64(blob, 4).unwrap_or_default();
    if count < 1 {
        return Err(soci_err(format!(
            "checkpoints blob claims {count} checkpoints; at least one is needed"
        )));
    }
    let span_size = u64::try_from(span_size).map_err(|_| {
        soci_err(format!(
            "checkpoints blob span size is negative ({span_size})"
        ))
    })?;
    let count = count as u64;
    // 64-bit arithmetic: count <= i32::MAX, so neither product can overflow, and a
    // claimed count is only believed when the blob really has its records.
    let records = (blob.len() - ZINFO_HEADER_LEN) as u64;
    let per = ZINFO_CHECKPOINT_LEN as u64;
    let legacy_v1 = if records == count * per {
        false
    } else if records == (count - 1) * per {
        true
    } else {
        return Err(soci_err(format!(
            "checkpoints blob of {} bytes fits neither {count} checkpoint records nor {} \
             ({ZINFO_CHECKPOINT_LEN} bytes each after a {ZINFO_HEADER_LEN}-byte header)",
            blob.len(),
            count - 1
        )));
    };
    let mut checkpoints = Vec::with_capacity(count as usize);
    if legacy_v1 {
        checkpoints.push(ZinfoCheckpoint {
            in_offset: V1_FIRST_IN_OFFSET,
            out_offset: 0,
            bits: 0,
            window: &[],
        });
    }
    for (i, rec) in blob[ZINFO_HEADER_LEN..]
        .chunks_exact(ZINFO_CHECKPOINT_LEN)
        .enumerate()
    {
        let i = i + usize::from(legacy_v1);
        let in_offset = read_i64(rec, 0).unwrap_or_default();
        let out_offset = read_i64(rec, 8).unwrap_or_default();
        let bits = rec[16];
        let in_offset = u64::try_from(in_offset).map_err(|_| {
            soci_err(format!(
                "checkpoint {i}: negative compressed offset {in_offset}"
            ))
        })?;
        let out_offset = u64::try_from(out_offset).map_err(|_| {
            soci_err(format!(
                "checkpoint {i}: negative uncompressed offset {out_offset}"
            ))
        })?;
        if bits > 7 {
            return Err(soci_err(format!(
                "checkpoint {i}: bit count {bits} is above 7"
            )));
        }
        checkpoints.push(ZinfoCheckpoint {
            in_offset,
            out_offset,
            bits,
            window: &rec[17..],
        });
    }
    Ok(GzipZinfo {
        span_size,
        checkpoints,
        legacy_v1,
    })
}

/// Encodes checkpoints as a version-2 gzip zinfo blob. A window shorter than 32 KiB is
/// zero-filled in front, as the published builder stores one taken early in the stream.
pub fn encode_gzip_zinfo(span_size: u64, checkpoints: &[ZinfoCheckpoint<'_>]) -> Result<Vec<u8>> {
    let count = i32::try_from(checkpoints.len()).map_err(|_| {
        soci_err(format!(
            "{} checkpoints do not fit the count",
            checkpoints.len()
        ))
    })?;
    let span_size = i64::try_from(span_size)
        .map_err(|_| soci_err(format!("span size {span_size} does not fit an i64")))?;
    let mut blob = Vec::with_capacity(ZINFO_HEADER_LEN + checkpoints.len() * ZINFO_CHECKPOINT_LEN);
    blob.extend_from_slice(&count.to_le_bytes());
    blob.extend_from_slice(&span_size.to_le_bytes());
    for (i, cp) in checkpoints.iter().enumerate() {
        let offset = |v: u64| {
            i64::try_from(v).map_err(|_| soci_err(format!("checkpoint {i}: offset {v} too large")))
        };
        if cp.window.len() > WINDOW_SIZE || cp.bits > 7 {
            return Err(soci_err(format!(
                "checkpoint {i}: window or bit count out of range"
            )));
        }
        blob.extend_from_slice(&offset(cp.in_offset)?.to_le_bytes());
        blob.extend_from_slice(&offset(cp.out_offset)?.to_le_bytes());
        blob.push(cp.bits);
        blob.resize(blob.len() + WINDOW_SIZE - cp.window.len(), 0);
        blob.extend_from_slice(cp.window);
    }
    Ok(blob)
}
