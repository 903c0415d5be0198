//! What a dynamic loader reads of a shared library or program at load time, from the
//! ELF header and program headers at its start, and what it loads next: the parts of the file its loadable
//! segments map that are not code (symbol and string tables, relocations, read-only
//! data, the data segment and `.dynamic`). The loader touches those by page faults all
//! over a large library as it relocates it, each a round trip on a lazy mount; the code
//! segment is faulted in only where it runs.
//!
//! The bytes come from a file in an image, so from a stranger: parsing is bounded (at
//! most [`MAX_PROGRAM_HEADERS`] headers, all inside the bytes given), never panics and
//! allocates nothing a header merely claims. It reads no file itself: [`dependencies`]
//! (the `PT_INTERP` and `DT_NEEDED` names, for following a program's libraries ahead of
//! its loader) asks its caller for the few bounded pieces it needs.
//!
//! It lives here, not in the filesystem, because both sides use it: `ferry index`
//! records each ELF file's [`Dependencies`] in the index ([`crate::ferryidx::Library`])
//! while the layer streams past, and a mount reads them from files it fetched when an
//! index has none (an older index, an eStargz layer).

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

/// One program header, the fields this module uses.
#[derive(Debug, Clone, Copy)]
struct Segment {
    kind: u32,
    flags: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// The header's reader and its program headers (at most [`MAX_PROGRAM_HEADERS`], all
/// inside `head`).
fn segments(head: &[u8]) -> Result<(Reader<'_>, Vec<Segment>), ElfError> {
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
    let mut out = Vec::with_capacity(phnum);
    for i in 0..phnum {
        let at = table.start + i * phentsize;
        out.push(if e.wide {
            Segment {
                kind: e.u32(at)?,
                flags: e.u32(at + 4)?,
                offset: e.u64(at + 8)?,
                vaddr: e.u64(at + 16)?,
                filesz: e.u64(at + 32)?,
            }
        } else {
            Segment {
                kind: e.u32(at)?,
                offset: u64::from(e.u32(at + 4)?),
                vaddr: u64::from(e.u32(at + 8)?),
                filesz: u64::from(e.u32(at + 16)?),
                flags: e.u32(at + 24)?,
            }
        });
    }
    Ok((e, out))
}

/// The file ranges of `file_len`-byte ELF file `head` (its first bytes) that its
/// loadable segments map and that are not executable, in file order, clamped to the
/// file and merged where they touch.
pub fn loader_ranges(head: &[u8], file_len: u64) -> Result<Vec<Range<u64>>, ElfError> {
    let (_, segments) = segments(head)?;
    let mut out: Vec<Range<u64>> = Vec::new();
    for s in segments {
        if s.kind != PT_LOAD || s.flags & PF_X != 0 || s.filesz == 0 {
            continue;
        }
        let start = s.offset.min(file_len);
        let end = s.offset.saturating_add(s.filesz).min(file_len);
        if start < end {
            out.push(start..end);
        }
    }
    Ok(crate::source::merge_ranges(out, 0))
}

/// What a program or library asks the dynamic loader for, from its `PT_INTERP` and
/// `.dynamic`: the names as the file gives them, unresolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dependencies {
    /// The loader a program names (`/lib64/ld-linux-x86-64.so.2`); none for a library.
    pub interpreter: Option<String>,
    /// `DT_NEEDED` names (sonames such as `libc.so.6`), in the file's order, at most
    /// [`MAX_NEEDED`].
    pub needed: Vec<String>,
    /// `DT_RUNPATH`, or `DT_RPATH` without one: the directories searched first,
    /// `$ORIGIN` and all, as written.
    pub search: Vec<String>,
    /// `e_machine`, which picks the loader's multiarch directories.
    pub machine: u16,
    /// A 64-bit file.
    pub wide: bool,
}

/// `DT_NEEDED` names taken from one file, at most.
pub const MAX_NEEDED: usize = 64;
/// Bytes of `.dynamic` looked at, at most (a library's is a few hundred).
const MAX_DYNAMIC_BYTES: u64 = 64 << 10;
/// Longest string read from the string table or `PT_INTERP`.
const MAX_STRING: usize = 4096;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const DT_RPATH: u64 = 15;
const DT_RUNPATH: u64 = 29;

/// The dependencies of `file_len`-byte ELF file `head` (its first bytes, holding its
/// program headers). `read(offset, len)` returns up to `len` bytes of the file at
/// `offset` (fewer at its end), or `None` when they cannot be had: it is called for
/// `PT_INTERP`, `.dynamic` (at most 64 KiB) and each string, never for more than that.
/// A file without `.dynamic` (static) has none; names that are not UTF-8, hold a `/`
/// (a path, not a soname) or lie outside the string table are left out.
pub fn dependencies(
    head: &[u8],
    file_len: u64,
    read: &mut dyn FnMut(u64, usize) -> Option<Vec<u8>>,
) -> Result<Dependencies, ElfError> {
    let (e, segments) = segments(head)?;
    let mut deps = Dependencies {
        machine: e.u16(0x12)?,
        wide: e.wide,
        ..Dependencies::default()
    };
    let string_at = |read: &mut dyn FnMut(u64, usize) -> Option<Vec<u8>>, at: u64| {
        if at >= file_len {
            return None;
        }
        let bytes = read(at, MAX_STRING)?;
        let end = bytes.iter().position(|&b| b == 0)?;
        String::from_utf8(bytes[..end].to_vec()).ok()
    };
    if let Some(interp) = segments.iter().find(|s| s.kind == PT_INTERP) {
        deps.interpreter = string_at(read, interp.offset).filter(|p| p.starts_with('/'));
    }
    let Some(dynamic) = segments.iter().find(|s| s.kind == PT_DYNAMIC) else {
        return Ok(deps);
    };
    let len = dynamic.filesz.min(MAX_DYNAMIC_BYTES) as usize;
    let table = read(dynamic.offset, len)
        .ok_or_else(|| ElfError::Beyond(format!(".dynamic at offset {}", dynamic.offset), 0))?;
    let table = Reader {
        bytes: &table,
        wide: e.wide,
        big_endian: e.big_endian,
    };
    let step = if e.wide { 16 } else { 8 };
    let (mut strtab, mut strsz) = (None, None);
    let (mut needed, mut runpath, mut rpath) = (Vec::new(), None, None);
    let mut at = 0;
    while at + step <= table.bytes.len() {
        let (tag, val) = if e.wide {
            (table.u64(at)?, table.u64(at + 8)?)
        } else {
            (u64::from(table.u32(at)?), u64::from(table.u32(at + 4)?))
        };
        at += step;
        match tag {
            DT_NULL => break,
            DT_NEEDED if needed.len() < MAX_NEEDED => needed.push(val),
            DT_STRTAB => strtab = Some(val),
            DT_STRSZ => strsz = Some(val),
            DT_RPATH => rpath = Some(val),
            DT_RUNPATH => runpath = Some(val),
            _ => {}
        }
    }
    // The string table is named by its address: where a loadable segment maps it.
    let Some(strtab) = strtab.and_then(|v| {
        segments
            .iter()
            .find(|s| s.kind == PT_LOAD && s.vaddr <= v && v - s.vaddr < s.filesz)
            .and_then(|s| s.offset.checked_add(v - s.vaddr))
    }) else {
        return Ok(deps);
    };
    let mut string = |off: u64| {
        if strsz.is_some_and(|n| off >= n) {
            return None;
        }
        string_at(read, strtab.checked_add(off)?)
    };
    deps.needed = needed
        .into_iter()
        .filter_map(&mut string)
        .filter(|n| !n.is_empty() && !n.contains('/'))
        .collect();
    if let Some(path) = runpath.or(rpath).and_then(string) {
        deps.search = path
            .split(':')
            .filter(|d| !d.is_empty())
            .map(str::to_string)
            .collect();
    }
    Ok(deps)
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
/// filesz)` right after it, for tests (of this crate and of the filesystem's).
#[doc(hidden)]
pub fn test_header(phdrs: &[(u32, u32, u64, u64)]) -> Vec<u8> {
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
/// The first 4 KiB of a 64-bit x86-64 ELF file with one `PT_LOAD` over `len` bytes
/// (addresses are offsets), `interp` as its `PT_INTERP` and a `.dynamic` naming
/// `needed`, for tests (of this crate and of the filesystem's).
#[doc(hidden)]
pub fn test_program(interp: Option<&str>, needed: &[&str], len: u64) -> Vec<u8> {
    let mut strtab = vec![0u8];
    let mut dynamic: Vec<(u64, u64)> = Vec::new();
    for n in needed {
        dynamic.push((DT_NEEDED, strtab.len() as u64));
        strtab.extend_from_slice(n.as_bytes());
        strtab.push(0);
    }
    dynamic.push((DT_STRTAB, 512));
    dynamic.push((DT_STRSZ, strtab.len() as u64));
    dynamic.push((DT_NULL, 0));
    let mut phdrs = vec![(PT_LOAD, 5, 0, len)];
    if let Some(i) = interp {
        phdrs.push((PT_INTERP, 4, 256, i.len() as u64 + 1));
    }
    phdrs.push((PT_DYNAMIC, 6, 1024, 16 * dynamic.len() as u64));
    let mut f = test_header(&phdrs);
    f[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
    f.resize(4096, 0);
    if let Some(i) = interp {
        f[256..256 + i.len()].copy_from_slice(i.as_bytes());
    }
    f[512..512 + strtab.len()].copy_from_slice(&strtab);
    for (k, (tag, val)) in dynamic.iter().enumerate() {
        let at = 1024 + k * 16;
        f[at..at + 8].copy_from_slice(&tag.to_le_bytes());
        f[at + 8..at + 16].copy_from_slice(&val.to_le_bytes());
    }
    f
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

    /// A 64-bit x86-64 program: PT_LOAD over the whole file (so addresses are offsets),
    /// PT_INTERP, and a `.dynamic` naming `needed` (string offsets into `strtab`).
    fn program(needed: &[u64], strtab: &[u8], extra: &[(u64, u64)]) -> Vec<u8> {
        let mut f = elf64(&[
            (PT_LOAD, 4, 0, 4096),
            (PT_INTERP, 4, 256, 28),
            (PT_DYNAMIC, 6, 1024, 512),
        ]);
        f[0x12..0x14].copy_from_slice(&62u16.to_le_bytes());
        f.resize(4096, 0);
        f[256..256 + 28].copy_from_slice(b"/lib64/ld-linux-x86-64.so.2\0");
        f[512..512 + strtab.len()].copy_from_slice(strtab);
        let mut dynamic: Vec<(u64, u64)> = needed.iter().map(|&n| (DT_NEEDED, n)).collect();
        dynamic.extend_from_slice(extra);
        dynamic.push((DT_STRTAB, 512));
        dynamic.push((DT_STRSZ, strtab.len() as u64));
        dynamic.push((DT_NULL, 0));
        for (i, (tag, val)) in dynamic.iter().enumerate() {
            let at = 1024 + i * 16;
            f[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&val.to_le_bytes());
        }
        f
    }

    fn reader(file: &[u8]) -> impl FnMut(u64, usize) -> Option<Vec<u8>> + '_ {
        |off, len| {
            let off = usize::try_from(off).ok()?;
            let end = off.saturating_add(len).min(file.len());
            file.get(off..end).map(<[u8]>::to_vec)
        }
    }

    #[test]
    fn a_programs_interpreter_libraries_and_run_path() {
        let strtab = b"\0libm.so.6\0libc.so.6\0$ORIGIN/../lib:/opt/x\0";
        let f = program(&[1, 11], strtab, &[(DT_RUNPATH, 21)]);
        let deps = dependencies(&f[..512], f.len() as u64, &mut reader(&f)).unwrap();
        assert_eq!(
            deps,
            Dependencies {
                interpreter: Some("/lib64/ld-linux-x86-64.so.2".into()),
                needed: vec!["libm.so.6".into(), "libc.so.6".into()],
                search: vec!["$ORIGIN/../lib".into(), "/opt/x".into()],
                machine: 62,
                wide: true,
            }
        );
        // RPATH counts only without RUNPATH.
        let f = program(&[1], strtab, &[(DT_RPATH, 1), (DT_RUNPATH, 21)]);
        let deps = dependencies(&f[..512], f.len() as u64, &mut reader(&f)).unwrap();
        assert_eq!(deps.search, vec!["$ORIGIN/../lib", "/opt/x"]);
        let f = program(&[1], strtab, &[(DT_RPATH, 11)]);
        let deps = dependencies(&f[..512], f.len() as u64, &mut reader(&f)).unwrap();
        assert_eq!(deps.search, vec!["libc.so.6"]);
    }

    #[test]
    fn names_outside_the_table_paths_and_bad_strings_are_left_out() {
        // Offsets: 1 a path, 9 past the table's size, 100 beyond it, 0 the empty name.
        let strtab = b"\0a/b.so\0";
        let f = program(&[1, 9, 100, 0], strtab, &[]);
        let deps = dependencies(&f[..512], f.len() as u64, &mut reader(&f)).unwrap();
        assert!(deps.needed.is_empty(), "{deps:?}");
        // A string without its NUL within the bytes read.
        let f = program(&[1], b"\0libz.so.1\0", &[]);
        let mut short = |off: u64, len: usize| {
            let got = reader(&f)(off, len)?;
            Some(if (512..1024).contains(&off) {
                got[..3].to_vec()
            } else {
                got
            })
        };
        let deps = dependencies(&f[..512], 4096, &mut short).unwrap();
        assert!(deps.needed.is_empty(), "{deps:?}");
    }

    #[test]
    fn a_static_file_has_none_and_an_unreadable_dynamic_is_an_error() {
        let head = elf64(&[(PT_LOAD, 5, 0, 4096)]);
        let deps = dependencies(&head, 4096, &mut |_, _| None).unwrap();
        assert_eq!((deps.interpreter, deps.needed.len()), (None, 0));
        let f = program(&[1], b"\0libm.so.6\0", &[]);
        assert!(dependencies(&f[..512], 4096, &mut |_, _| None).is_err());
    }

    #[test]
    fn at_most_max_needed_names_and_no_panic_on_any_truncation() {
        // A .dynamic of 100 DT_NEEDED entries (2 KiB; its header rewritten to say so).
        let mut f = program(&[], b"\0libm.so.6\0", &[]);
        f[208..216].copy_from_slice(&2048u64.to_le_bytes());
        let mut at = 1024;
        for (tag, val) in std::iter::repeat_n((DT_NEEDED, 1u64), 100).chain([
            (DT_STRTAB, 512),
            (DT_STRSZ, 11),
            (DT_NULL, 0),
        ]) {
            f[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&val.to_le_bytes());
            at += 16;
        }
        let deps = dependencies(&f[..512], 4096, &mut reader(&f)).unwrap();
        assert_eq!(deps.needed.len(), MAX_NEEDED);
        let f = program(&[1, 11], b"\0libm.so.6\0libc.so.6\0", &[]);
        for n in 0..f.len() {
            let cut = &f[..n];
            let _ = dependencies(cut, n as u64, &mut reader(cut));
        }
    }
}
