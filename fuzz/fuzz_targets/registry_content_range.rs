//! Fuzzes both `Content-Range` parsers: the server's (chunked upload `PATCH`, spec form
//! `a-b` or RFC form `bytes a-b/total`) and the client's (a `206` answer, `bytes a-b/total`).
//! Whatever either accepts must be an ordered inclusive range whose exclusive end does not
//! overflow (callers compute `last + 1`), and for the client, lie inside a stated total.
//! A formatted range must parse back to itself.
#![no_main]

use ferry_registry_client::fuzz_api::client_content_range;
use ferry_registry::server::range::parse_content_range;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some((first, last)) = parse_content_range(text) {
        assert!(first <= last, "{text:?}");
        assert!(last.checked_add(1).is_some(), "server: last byte {last} overflows");
    }
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
