//! Fuzzes the registry server's `Range` parser (blob GET/HEAD): any header value against
//! any blob size must give a full answer, a partial range that is non-empty and inside the
//! blob, or 416; never a panic or an overflow. A well-formed `bytes=a-b` inside the blob
//! must be honoured exactly.
#![no_main]

use ferry_registry::server::range::{RangeRequest, parse_range};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (size_bytes, rest) = data.split_at(8);
    let mut size = u64::from_le_bytes(size_bytes.try_into().unwrap_or([0; 8]));
    // Mostly small blobs so ranges land inside, sometimes huge ones for overflow edges.
    if size_bytes[0] & 0x80 == 0 {
        size %= 1 << 20;
    }
    let Ok(header) = std::str::from_utf8(rest) else {
        return;
    };
    match parse_range(Some(header), size) {
        RangeRequest::Full | RangeRequest::Unsatisfiable => {}
        RangeRequest::Partial(r) => {
            assert!(r.start < r.end, "empty partial range {r:?} for {header:?}");
            assert!(r.end <= size, "range {r:?} past blob size {size} for {header:?}");
        }
    }
    assert_eq!(parse_range(None, size), RangeRequest::Full);

    // Round trip: a well-formed range derived from the input is answered exactly.
    if size > 0 {
        let a = u64::from_le_bytes(size_bytes.try_into().unwrap_or([0; 8])) % size;
        let len = (rest.len() as u64).max(1);
        let b = a.saturating_add(len - 1);
        let want_end = b.saturating_add(1).min(size);
        assert_eq!(
            parse_range(Some(&format!("bytes={a}-{b}")), size),
            RangeRequest::Partial(a..want_end)
        );
        assert_eq!(
            parse_range(Some(&format!("bytes={a}-")), size),
            RangeRequest::Partial(a..size)
        );
        let n = len.min(size);
        assert_eq!(
            parse_range(Some(&format!("bytes=-{len}")), size),
            RangeRequest::Partial(size - n..size)
        );
    }
});
