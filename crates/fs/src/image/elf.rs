//! What a dynamic loader reads of a shared library or program at load time, from the
//! ELF header and program headers at its start: the parts of the file its loadable
//! segments map that are not code (symbol and string tables, relocations, read-only
//! data, the data segment and `.dynamic`). The loader touches those by page faults all
//! over a large library as it relocates it, each a round trip on a lazy mount; the code
//! segment is faulted in only where it runs.
//!
//! The bytes come from a file in an image, so from a stranger: parsing is bounded (at
//! most [`MAX_PROGRAM_HEADERS`] headers, all inside the bytes given), never panics and
//! allocates nothing a header merely claims. It reads no file itself.

use std::ops::Range;

/// Program headers looked at, at most (a library has about ten).
pub const MAX_PROGRAM_HEADERS: usize = 64;

const PT_LOAD: u32 = 1;
const PF_X: u32 = 1;

/// Why a file's start gave no segments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    /// The bytes do not start with the ELF magic and a known class and byte order.
    #[error("not an ELF file")]
    NotElf,
    /// The program header table does not lie within the bytes given.
    #[error("the program headers ({0}) lie beyond the {1} bytes read")]
    Beyond(String, usize),
    /// More program headers than [`MAX_PROGRAM_HEADERS`], or an entry size that does
    /// not fit the class.
    #[error("program header table not as ELF defines it: {0}")]
    Malformed(String),
}

/// The file ranges of `file_len`-byte ELF file `head` (its first bytes) that its
/// loadable segments map and that are not executable, in file order, clamped to the
/// file and merged where they touch.
pub fn loader_ranges(head: &[u8], file_len: u64) -> Result<Vec<Range<u64>>, ElfError> {
    let e = Reader::of(head)?;
    let (phoff, phentsize, phnum) = if e.wide {
        (e.u64(0x20)?, e.u16(0x36)?, e.u16(0x38)?)
    } else {
        (u64::from(e.u32(0x1c)?), e.u16(0x2a)?, e.u16(0x2c)?)
    };
    let (phentsize, phnum) = (usize::from(phentsize), usize::from(phnum));
    let min_entry = if e.wide { 56 } else { 32 };
    if phnum > MAX_PROGRAM_HEADERS {
        return Err(ElfError::Malformed(format!("{phnum} headers")));
    }
    if phnum > 0 && phentsize < min_entry {
        return Err(ElfError::Malformed(format!("entries of {phentsize} bytes")));
    }
    let table = usize::try_from(phoff)
        .ok()
        .and_then(|start| Some(start..start.checked_add(phentsize.checked_mul(phnum)?)?))
        .filter(|t| t.end <= head.len())
        .ok_or_else(|| {
            ElfError::Beyond(
                format!("{phnum} at offset {phoff}, {phentsize} bytes each"),
                head.len(),
            )
        })?;
    let mut out: Vec<Range<u64>> = Vec::new();
    for i in 0..phnum {
        let at = table.start + i * phentsize;
        let (kind, flags, offset, filesz) = if e.wide {
            (e.u32(at)?, e.u32(at + 4)?, e.u64(at + 8)?, e.u64(at + 32)?)
        } else {
            (
                e.u32(at)?,
                e.u32(at + 24)?,
                u64::from(e.u32(at + 4)?),
                u64::from(e.u32(at + 16)?),
            )
        };
        if kind != PT_LOAD || flags & PF_X != 0 || filesz == 0 {
            continue;
        }
        let start = offset.min(file_len);
        let end = offset.saturating_add(filesz).min(file_len);
        if start < end {
            out.push(start..end);
        }
    }
    Ok(crate::ranges::merge_ranges(out))
}

/// Readers of unsigned fields of each width, in the header's byte order.
macro_rules! unsigned {
    ($($t:ident),*) => {$(
        fn $t(&self, at: usize) -> Result<$t, ElfError> {
            let b = self.field::<{ std::mem::size_of::<$t>() }>(at)?;
            Ok(if self.big_endian { $t::from_be_bytes(b) } else { $t::from_le_bytes(b) })
        }
    )*};
}

/// Fields of an ELF header in its class and byte order.
struct Reader<'a> {
    bytes: &'a [u8],
    wide: bool,
    big_endian: bool,
}

impl<'a> Reader<'a> {
    fn of(bytes: &'a [u8]) -> Result<Reader<'a>, ElfError> {
        let ident = bytes.get(..6).ok_or(ElfError::NotElf)?;
        if &ident[..4] != b"\x7fELF" {
            return Err(ElfError::NotElf);
        }
        let wide = match ident[4] {
            1 => false,
            2 => true,
            _ => return Err(ElfError::NotElf),
        };
        let big_endian = match ident[5] {
            1 => false,
            2 => true,
            _ => return Err(ElfError::NotElf),
        };
        Ok(Reader {
            bytes,
            wide,
            big_endian,
        })
    }

    fn field<const N: usize>(&self, at: usize) -> Result<[u8; N], ElfError> {
        at.checked_add(N)
            .and_then(|end| self.bytes.get(at..end))
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| ElfError::Beyond(format!("a field at offset {at}"), self.bytes.len()))
    }

    unsigned!(u16, u32, u64);
}

/// A 64-bit little-endian ELF header with program headers `(type, flags, offset,
/// filesz)` right after it, for tests.
#[cfg(test)]
pub(crate) fn test_header(phdrs: &[(u32, u32, u64, u64)]) -> Vec<u8> {
    let mut b = vec![0u8; 64];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2;
    b[5] = 1;
    b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
    b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
    b[0x38..0x3a].copy_from_slice(&(phdrs.len() as u16).to_le_bytes());
    for &(kind, flags, offset, filesz) in phdrs {
        let mut p = [0u8; 56];
        p[..4].copy_from_slice(&kind.to_le_bytes());
        p[4..8].copy_from_slice(&flags.to_le_bytes());
        p[8..16].copy_from_slice(&offset.to_le_bytes());
        p[32..40].copy_from_slice(&filesz.to_le_bytes());
        b.extend_from_slice(&p);
    }
    b
}
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn elf64(phdrs: &[(u32, u32, u64, u64)]) -> Vec<u8> {
        test_header(phdrs)
    }

    #[test]
    fn a_librarys_data_and_tables_but_not_its_code() {
        // As a linker lays out a shared library: R (headers, symbols, relocations),
        // RX (code), R (read-only data, unwind tables), RW (data, GOT, .dynamic).
        let head = elf64(&[
            (6, 4, 64, 0x2a0),                    // PT_PHDR
            (PT_LOAD, 4, 0, 0x9_0000),            // R
            (PT_LOAD, 5, 0x9_0000, 0x1_000_000),  // RX
            (PT_LOAD, 4, 0x1_090_000, 0x20_0000), // R
            (PT_LOAD, 6, 0x1_290_000, 0x1_8000),  // RW
            (2, 6, 0x1_2a0_000, 0x200),           // PT_DYNAMIC
        ]);
        let got = loader_ranges(&head, 0x1_2a8_000).unwrap();
        assert_eq!(
            got,
            vec![0..0x9_0000, 0x1_090_000..0x1_2a8_000],
            "the two read-only parts and the data, merged where they touch"
        );
    }

    #[test]
    fn big_endian_and_32_bit_headers_read_the_same() {
        let mut b = vec![0u8; 52];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 1;
        b[5] = 2;
        b[0x1c..0x20].copy_from_slice(&52u32.to_be_bytes());
        b[0x2a..0x2c].copy_from_slice(&32u16.to_be_bytes());
        b[0x2c..0x2e].copy_from_slice(&2u16.to_be_bytes());
        for (flags, offset, filesz) in [(5u32, 0u32, 0x1000u32), (6, 0x3000, 0x800)] {
            let mut p = [0u8; 32];
            p[..4].copy_from_slice(&PT_LOAD.to_be_bytes());
            p[4..8].copy_from_slice(&offset.to_be_bytes());
            p[16..20].copy_from_slice(&filesz.to_be_bytes());
            p[24..28].copy_from_slice(&flags.to_be_bytes());
            b.extend_from_slice(&p);
        }
        assert_eq!(loader_ranges(&b, 0x10_000).unwrap(), vec![0x3000..0x3800]);
    }

    #[test]
    fn hostile_headers_are_errors_or_clamped_never_panics() {
        assert_eq!(loader_ranges(b"#!/bin/sh\n", 10), Err(ElfError::NotElf));
        assert_eq!(loader_ranges(b"\x7fELF", 4), Err(ElfError::NotElf));
        // Headers claimed beyond the bytes read.
        let mut head = elf64(&[(PT_LOAD, 6, 0, 100)]);
        head[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            loader_ranges(&head, 1000),
            Err(ElfError::Beyond(..))
        ));
        let mut head = elf64(&[(PT_LOAD, 6, 0, 100)]);
        head[0x38..0x3a].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            loader_ranges(&head, 1000),
            Err(ElfError::Malformed(_))
        ));
        let mut head = elf64(&[(PT_LOAD, 6, 0, 100)]);
        head[0x36..0x38].copy_from_slice(&8u16.to_le_bytes());
        assert!(matches!(
            loader_ranges(&head, 1000),
            Err(ElfError::Malformed(_))
        ));
        // A segment past the file's end, or of absurd size, is clamped to the file.
        let head = elf64(&[(PT_LOAD, 6, 900, u64::MAX), (PT_LOAD, 4, 5000, 10)]);
        assert_eq!(loader_ranges(&head, 1000).unwrap(), vec![900..1000]);
        // Every truncation of a valid header is an error, not a panic.
        let head = elf64(&[(PT_LOAD, 6, 0, 100), (PT_LOAD, 4, 200, 100)]);
        for n in 0..head.len() {
            assert!(loader_ranges(&head[..n], 1000).is_err(), "{n}");
        }
    }
}
