//! The `marshal` reader a lazy mount runs on a compiled Python module from an image, to
//! follow its imports ahead of the interpreter. Any bytes give a bounded list of imports
//! with bounded names, or a typed error, never a panic or an allocation the bytes only
//! claim.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Most inputs would stop at the magic number: put a 3.11 header in front of half.
    let mut with_header;
    let input = if data.first().is_some_and(|b| b & 1 == 1) {
        with_header = vec![0xa7, 0x0d, b'\r', b'\n'];
        with_header.extend_from_slice(&[0; 12]);
        with_header.extend_from_slice(&data[1..]);
        &with_header[..]
    } else {
        data
    };
    if let Ok(imports) = ferry_fs::image::pyc::imports(input) {
        assert!(imports.len() <= ferry_fs::image::pyc::MAX_IMPORTS);
        for i in &imports {
            assert!(i.module.len() <= input.len() && i.names.len() <= input.len());
        }
    }
});
