//! The footer: an empty gzip member whose extra field points at the TOC.

use crate::error::{Error, Result};

/// Size of the eStargz footer.
///
/// 10 bytes gzip header, 2 bytes XLEN (= 26), 4 bytes subfield header (`'S'`, `'G'`,
/// LEN = 22), 22 bytes `"%016xSTARGZ"`, 5 bytes empty stored deflate block, 8 bytes gzip
/// trailer.
pub const FOOTER_SIZE: u64 = 51;
/// Size of the legacy stargz footer: like [`FOOTER_SIZE`] but the 22-byte string is the
/// whole extra field (XLEN = 22, no subfield header).
pub const LEGACY_FOOTER_SIZE: u64 = 47;

const FEXTRA: u8 = 0x04;
/// FHCRC, FNAME, FCOMMENT and the reserved bits: any of them would move the extra field
/// out of its fixed place.
const OTHER_FLAGS: u8 = 0x02 | 0x08 | 0x10 | 0xe0;
const MAGIC: &[u8] = b"STARGZ";
const EXTERNAL_TOC_MAGIC: &[u8] = b"STARGZEXTERNALTOC";

/// The 51-byte eStargz footer pointing at a TOC member starting at `toc_offset`.
pub fn footer_bytes(toc_offset: u64) -> [u8; FOOTER_SIZE as usize] {
    let mut f = [0u8; FOOTER_SIZE as usize];
    // gzip header: magic, deflate, FEXTRA, mtime 0, xfl 0, OS unknown.
    f[..10].copy_from_slice(&[0x1f, 0x8b, 8, FEXTRA, 0, 0, 0, 0, 0, 255]);
    f[10..12].copy_from_slice(&26u16.to_le_bytes());
    f[12] = b'S';
    f[13] = b'G';
    f[14..16].copy_from_slice(&22u16.to_le_bytes());
    f[16..38].copy_from_slice(format!("{toc_offset:016x}STARGZ").as_bytes());
    // Final stored block of length 0: BFINAL=1 BTYPE=00, LEN=0, NLEN=0xffff.
    f[38..43].copy_from_slice(&[1, 0, 0, 0xff, 0xff]);
    // CRC32 and ISIZE of nothing: zero (already).
    f
}

/// Parses the TOC offset out of the tail of a blob: `tail` is (at least) its last 47
/// bytes, normally its last [`FOOTER_SIZE`]. The eStargz footer is tried first, then the
/// legacy stargz one.
pub fn parse_footer(tail: &[u8]) -> Result<u64> {
    parse_footer_sized(tail).map(|(off, _)| off)
}

/// Like [`parse_footer`], also returning the size of the footer that matched.
pub(crate) fn parse_footer_sized(tail: &[u8]) -> Result<(u64, u64)> {
    let mut errors = Vec::new();
    if tail.len() as u64 >= FOOTER_SIZE {
        let f = &tail[tail.len() - FOOTER_SIZE as usize..];
        match parse_estargz(f) {
            Ok(off) => return Ok((off, FOOTER_SIZE)),
            Err(e) => errors.push(e),
        }
    }
    if tail.len() as u64 >= LEGACY_FOOTER_SIZE {
        let f = &tail[tail.len() - LEGACY_FOOTER_SIZE as usize..];
        match parse_legacy(f) {
            Ok(off) => return Ok((off, LEGACY_FOOTER_SIZE)),
            Err(e) => errors.push(format!("legacy footer: {e}")),
        }
    } else {
        return Err(Error::Estargz(format!(
            "blob of {} bytes is smaller than a footer",
            tail.len()
        )));
    }
    if is_external_toc(tail) {
        return Err(Error::Estargz(
            "the layer's TOC is in a separate image (external TOC footer); not supported".into(),
        ));
    }
    Err(Error::Estargz(format!(
        "no eStargz footer: {}",
        errors.join("; ")
    )))
}

fn check_gzip_header(f: &[u8], xlen: u16) -> std::result::Result<(), String> {
    if f[0] != 0x1f || f[1] != 0x8b {
        return Err("not a gzip member".into());
    }
    if f[2] != 8 {
        return Err(format!("gzip compression method {} is not deflate", f[2]));
    }
    if f[3] & FEXTRA == 0 {
        return Err("gzip header has no extra field".into());
    }
    if f[3] & OTHER_FLAGS != 0 {
        return Err(format!("unexpected gzip header flags {:#04x}", f[3]));
    }
    let got = u16::from_le_bytes([f[10], f[11]]);
    if got != xlen {
        return Err(format!("extra field length {got}, want {xlen}"));
    }
    Ok(())
}

fn parse_offset_magic(s: &[u8]) -> std::result::Result<u64, String> {
    // s = 16 hex digits + "STARGZ"
    if &s[16..22] != MAGIC {
        return Err("STARGZ magic not found".into());
    }
    let hex = &s[..16];
    if !hex.iter().all(u8::is_ascii_hexdigit) {
        return Err("TOC offset is not 16 hex digits".into());
    }
    let hex = std::str::from_utf8(hex).map_err(|_| "TOC offset is not ASCII".to_string())?;
    u64::from_str_radix(hex, 16).map_err(|e| format!("TOC offset: {e}"))
}

fn parse_estargz(f: &[u8]) -> std::result::Result<u64, String> {
    check_gzip_header(f, 26)?;
    if f[12] != b'S' || f[13] != b'G' {
        return Err(format!(
            "extra subfield id {:?}, want \"SG\"",
            String::from_utf8_lossy(&f[12..14])
        ));
    }
    let len = u16::from_le_bytes([f[14], f[15]]);
    if len != 22 {
        return Err(format!("extra subfield length {len}, want 22"));
    }
    parse_offset_magic(&f[16..38])
}

fn parse_legacy(f: &[u8]) -> std::result::Result<u64, String> {
    check_gzip_header(f, 22)?;
    parse_offset_magic(&f[12..34])
}

fn is_external_toc(tail: &[u8]) -> bool {
    // 10 header + 2 XLEN + 4 subfield header + 17 magic + 5 + 8 = 46 bytes.
    const SIZE: usize = 46;
    if tail.len() < SIZE {
        return false;
    }
    let f = &tail[tail.len() - SIZE..];
    f[0] == 0x1f && f[1] == 0x8b && &f[12..14] == b"SG" && &f[16..33] == EXTERNAL_TOC_MAGIC
}
