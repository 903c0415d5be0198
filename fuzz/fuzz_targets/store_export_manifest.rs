//! Fuzzes the store export manifest parser (`ferry store import` reads it from a volume
//! someone else wrote): arbitrary bytes must parse or fail cleanly within the bounds,
//! and whatever parses must serialise back to a manifest that parses the same.
#![no_main]

use std::path::Path;

use ferry_store::{EXPORT_FORMAT, ExportManifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("ferry-store.json");
    if let Ok(manifest) = ExportManifest::parse(path, data) {
        assert_eq!(manifest.format, EXPORT_FORMAT);
        let again = serde_json::to_vec(&manifest).expect("a parsed manifest serialises");
        assert_eq!(
            ExportManifest::parse(path, &again).expect("its JSON parses"),
            manifest
        );
    }
});
