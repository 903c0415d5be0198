//! The ELF program-header parser a lazy mount runs on the first bytes of a large file
//! from an image: any bytes and claimed file length give ranges inside the file, or a
//! typed error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((len, head)) = data.split_first_chunk::<8>() else {
        return;
    };
    let file_len = u64::from_le_bytes(*len);
    if let Ok(ranges) = ferry_fs::elf::loader_ranges(head, file_len) {
        let mut end = 0;
        for r in ranges {
            assert!(r.start < r.end && r.end <= file_len && r.start >= end);
            end = r.end;
        }
    }
});
