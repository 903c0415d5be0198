//! Fuzzes what a node reads of its store's image metadata (`ferry pull` and the daemon
//! start an image from it with no registry): an image record file (`images/*.json`,
//! written by whoever could write the store's directory, or damaged on disk) and a
//! metadata blob under its digest's name. The invariants: a record is listed only if it
//! is within the bounds ([`ImageRecord::check`]) and serialises back to itself; a blob
//! is handed out only if its bytes hash to the name it was asked by, else it is refused
//! as corrupt (never served, never a panic).
//!
//! Input: a selector byte; with an even selector the rest is the record file, with an
//! odd one the rest is written as the blob of a key that either is its SHA-256 (the low
//! bit of a second byte) or is not.
#![no_main]

use ferry_store::{ChunkKey, Error, ImageRecord, MetadataOrigin, StoreMetadata};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let live = dir.path();
    let meta = StoreMetadata::open(live, None).expect("a store without a seed opens");
    if selector & 1 == 0 {
        std::fs::create_dir_all(live.join("images")).expect("images dir");
        std::fs::write(live.join("images").join("fuzzed.json"), rest).expect("record");
        for (record, origin) in meta.images() {
            assert_eq!(origin, MetadataOrigin::Live);
            assert!(record.check().is_ok(), "listed out of bounds: {record:?}");
            let again = serde_json::to_vec(&record).expect("a record serialises");
            let parsed: ImageRecord = serde_json::from_slice(&again).expect("its JSON parses");
            assert_eq!(parsed, record);
        }
        return;
    }
    let Some((&how, bytes)) = rest.split_first() else {
        return;
    };
    let actual = ChunkKey::of(bytes);
    let key = if how & 1 == 0 {
        actual
    } else {
        // Another key: the hash of the bytes with one more byte.
        ChunkKey::of(rest)
    };
    std::fs::create_dir_all(live.join("metadata")).expect("metadata dir");
    std::fs::write(live.join("metadata").join(key.hex()), bytes).expect("blob");
    match meta.blob(&key) {
        Ok(Some((served, origin))) => {
            assert_eq!(origin, MetadataOrigin::Live);
            assert_eq!(ChunkKey::of(&served), key, "served bytes that are not the key's");
            assert_eq!(served, bytes);
        }
        Ok(None) => panic!("a blob present under its name reported missing"),
        Err(Error::CorruptMetadata { key: k, .. }) => {
            assert_eq!(k, key);
            assert_ne!(actual, key, "refused a blob that hashes to its name");
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
});
