//! HTTP `Range` (blob reads) and `Content-Range` (chunked uploads) parsing.
//!
//! One byte range per request here; a request for several ranges of a blob is answered
//! as `multipart/byteranges` by the blob handler (`ferry_registry_client::byteranges`)
//! where they are in order and apart, and with the whole blob otherwise (allowed by
//! RFC 9110, and every client handles it).

pub use ferry_registry_client::{RangeRequest, parse_range};

/// A chunk's `Content-Range` on `PATCH` as `(first, last)` inclusive: the client crate's
/// one parser (spec form `first-last` or RFC form `bytes first-last/total`). `last` is
/// always below `u64::MAX`, so callers may compute the length `last - first + 1`.
pub fn parse_content_range(value: &str) -> Option<(u64, u64)> {
    ferry_registry_client::parse_content_range(value).map(|(first, last, _)| (first, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        use RangeRequest::*;
        assert_eq!(parse_range(None, 10), Full);
        assert_eq!(parse_range(Some("bytes=0-4"), 10), Partial(0..5));
        assert_eq!(parse_range(Some("bytes=5-"), 10), Partial(5..10));
        assert_eq!(parse_range(Some("bytes=-3"), 10), Partial(7..10));
        assert_eq!(parse_range(Some("bytes=-30"), 10), Partial(0..10));
        assert_eq!(parse_range(Some("bytes=8-100"), 10), Partial(8..10));
        assert_eq!(parse_range(Some("bytes=9-9"), 10), Partial(9..10));
        assert_eq!(parse_range(Some("bytes=10-"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=10-20"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-0"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-"), 0), Unsatisfiable);
        // Last before first: 416, as the OCI conformance suite wants.
        assert_eq!(parse_range(Some("bytes=5-2"), 10), Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=0-1,4-5"), 10), Full);
        assert_eq!(parse_range(Some("items=0-1"), 10), Full);
        assert_eq!(parse_range(Some("bytes=x-1"), 10), Full);
        assert_eq!(
            parse_range(Some("bytes=18446744073709551615-"), 10),
            Unsatisfiable
        );
    }

    #[test]
    fn content_ranges() {
        assert_eq!(parse_content_range("0-99"), Some((0, 99)));
        assert_eq!(parse_content_range("bytes 100-199/*"), Some((100, 199)));
        assert_eq!(parse_content_range("bytes 100-199/500"), Some((100, 199)));
        assert_eq!(parse_content_range("bytes 100-199/150"), None);
        assert_eq!(parse_content_range("5-4"), None);
        assert_eq!(parse_content_range("abc"), None);
        assert_eq!(parse_content_range("-4"), None);
    }

    /// Found by fuzzing: a last byte of `u64::MAX` made the upload handler's
    /// `end - start + 1` overflow (a panic in debug builds, a wrong length in release).
    #[test]
    fn content_range_length_cannot_overflow() {
        assert_eq!(parse_content_range("0-18446744073709551615"), None);
        assert_eq!(
            parse_content_range("bytes 18446744073709551614-18446744073709551615/*"),
            None
        );
        assert_eq!(
            parse_content_range("0-18446744073709551614"),
            Some((0, u64::MAX - 1))
        );
    }
}
