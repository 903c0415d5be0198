//! Fuzzes `ferry pull`'s layer unpacker, which writes a stranger's tar to disk: any bytes
//! must unpack or fail cleanly, and nothing may ever appear outside the destination
//! (traversal, absolute paths, writes through symlinks, hard links out of the tree).
#![no_main]

use std::path::Path;

use ferry_oci::media::LayerCompression;
use ferry_pull::unpack::{UnpackLimits, unpack_layer};
use libfuzzer_sys::fuzz_target;

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fuzz_target!(|data: &[u8]| {
    let Ok(outer) = tempfile::tempdir() else {
        return;
    };
    let dest = outer.path().join("layer");
    std::fs::create_dir(&dest).expect("create the destination");
    let limits = UnpackLimits {
        max_entries: 10_000,
        max_file_bytes: 64 << 20,
    };
    let compression = if data.starts_with(&[0x1f, 0x8b]) {
        LayerCompression::Gzip
    } else {
        LayerCompression::None
    };
    let _ = unpack_layer(data, compression, &dest, &limits);
    // Only the destination directory may exist beside it.
    assert_eq!(
        listing(outer.path()),
        vec!["layer".to_string()],
        "something escaped the layer"
    );
});
