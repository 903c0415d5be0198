//! The ELF parsers a lazy mount runs on a file from an image: the program headers of
//! its first bytes (loader segments) and, through reads of the same bytes, its
//! interpreter and libraries. Any bytes and claimed file length give ranges inside the
//! file and bounded names, or a typed error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((len, head)) = data.split_first_chunk::<8>() else {
        return;
    };
    let file_len = u64::from_le_bytes(*len);
    if let Ok(ranges) = ferry_fs::image::elf::loader_ranges(head, file_len) {
        let mut end = 0;
        for r in ranges {
            assert!(r.start < r.end && r.end <= file_len && r.start >= end);
            end = r.end;
        }
    }
    let mut read = |off: u64, n: usize| -> Option<Vec<u8>> {
        assert!(n <= 64 << 10, "a read of {n} bytes");
        let off = usize::try_from(off).ok()?;
        let end = off.saturating_add(n).min(head.len());
        head.get(off..end).map(<[u8]>::to_vec)
    };
    if let Ok(deps) = ferry_fs::image::elf::dependencies(head, file_len, &mut read) {
        assert!(deps.needed.len() <= ferry_fs::image::elf::MAX_NEEDED);
        assert!(deps.needed.iter().all(|n| !n.contains('/') && !n.is_empty()));
    }
});
