//! Fuzzes the one `Content-Range` parser (the client's; the server's chunked upload
//! `PATCH` reads through it): spec form `a-b` or RFC form `bytes a-b/total`. Whatever it
//! accepts must be an ordered inclusive range whose exclusive end does not overflow
//! (callers compute `last + 1`) and lie inside a stated total, and the server's view must
//! be the same range. A formatted range must parse back to itself.
#![no_main]

use ferry_registry_client::parse_content_range as client_content_range;
use ferry_registry::server::range::parse_content_range;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    assert_eq!(
        parse_content_range(text),
        client_content_range(text).map(|(first, last, _)| (first, last)),
        "{text:?}"
    );
    if let Some((first, last, total)) = client_content_range(text) {
        assert!(first <= last, "{text:?}");
        assert!(last.checked_add(1).is_some(), "client: last byte {last} overflows");
        if let Some(total) = total {
            assert!(last < total, "client: range {first}-{last} past total {total}");
        }
    }

    // Round trips from numbers taken from the input.
    if data.len() >= 16 {
        let a = u64::from_le_bytes(data[..8].try_into().unwrap_or([0; 8])) >> 1;
        let b = a.saturating_add(u64::from_le_bytes(data[8..16].try_into().unwrap_or([0; 8])) >> 2);
        if b < u64::MAX {
            assert_eq!(parse_content_range(&format!("{a}-{b}")), Some((a, b)));
            assert_eq!(parse_content_range(&format!("bytes {a}-{b}/*")), Some((a, b)));
            assert_eq!(client_content_range(&format!("bytes {a}-{b}/*")), Some((a, b, None)));
            let total = b + 1;
            assert_eq!(
                client_content_range(&format!("bytes {a}-{b}/{total}")),
                Some((a, b, Some(total)))
            );
        }
    }
});
