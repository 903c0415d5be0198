//! Fuzzes the tar walker: arbitrary bytes must never panic, and whatever the walker
//! accepts must be self-consistent (offsets inside the input, data equal to the input
//! bytes at those offsets, normalized paths, `walk` agreeing with a data-reading walk).
#![no_main]

use ferry_index::EntryKind;
use ferry_index::tarwalk::{TarWalker, normalize_path, walk};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let table = walk(data);

    let len = data.len() as u64;
    let mut walker = TarWalker::new(data);
    let mut buf = [0u8; 700];
    let mut entries = Vec::new();
    let outcome = loop {
        let entry = match walker.next_entry() {
            Ok(Some(e)) => e,
            Ok(None) => break true,
            Err(_) => break false,
        };
        assert!(walker.position() <= len);
        assert_eq!(walker.position() % 512, 0);
        assert!(entry.header_offset < walker.position());
        assert_eq!(
            normalize_path(&entry.path).as_deref(),
            Some(entry.path.as_str())
        );
        match entry.kind {
            EntryKind::File => {
                assert_eq!(entry.offset, walker.position());
                // Read the data of every other file; let the walker skip the rest.
                if entries.len() % 2 == 0 {
                    let mut got = 0u64;
                    loop {
                        match walker.read_data(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => {
                                let start = (entry.offset + got) as usize;
                                assert_eq!(&buf[..n], &data[start..start + n]);
                                got += n as u64;
                            }
                            Err(_) => {
                                assert!(entry.offset + entry.size > len);
                                break;
                            }
                        }
                    }
                    assert!(got <= entry.size);
                }
            }
            EntryKind::Hardlink => {
                assert_eq!(entry.size, 0);
                assert!(!entry.link_target.is_empty());
                assert_eq!(
                    normalize_path(&entry.link_target).as_deref(),
                    Some(entry.link_target.as_str())
                );
            }
            _ => assert_eq!(entry.size, 0),
        }
        if entry.path.is_empty() {
            assert_eq!(entry.kind, EntryKind::Dir);
        }
        entries.push(entry);
    };
    assert!(
        walker
            .next_entry()
            .map_or(!outcome, |e| outcome && e.is_none())
    );

    // Skipping data and reading it must see the same archive.
    match table {
        Ok(table) => {
            assert!(outcome);
            assert_eq!(table, entries);
        }
        Err(_) => assert!(!outcome),
    }
});
