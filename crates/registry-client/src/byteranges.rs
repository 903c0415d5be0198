//! Several ranges of a blob in one request: the `Range: bytes=a-b,c-d` header and the
//! `multipart/byteranges` answer (RFC 9110 §14.6) it gets.
//!
//! A registry pays per request, whatever its size (Debian's `docker-registry` about
//! 7 ms of CPU for a 256 KiB range, 13 ms for eight of them in one request), and a
//! cloud registry charges every request a round trip and a share of its rate limit;
//! a start's fetches of one layer lie in a few stretches with gaps between them. This
//! module only formats and parses (pure, bounded, no I/O); [`crate::Client::blob_ranges`]
//! sends the request and falls back to one request per range where a server answers
//! with the whole blob.

use std::ops::Range;

/// Most ranges one request asks for: Go's `http.ServeContent` (behind Debian's
/// registry) and most servers take far more, but each part costs the server a seek and
/// the answer ~150 bytes of headers.
pub const MAX_RANGES: usize = 64;
/// Longest header block of one part accepted (a `Content-Type` and a `Content-Range`
/// take ~100 bytes).
const MAX_PART_HEADER_BYTES: usize = 4096;
/// Longest boundary RFC 2046 allows.
const MAX_BOUNDARY: usize = 70;

/// The `Range` header value asking for `ranges` (non-empty, sorted, non-overlapping:
/// see [`check`]).
pub fn range_header(ranges: &[Range<u64>]) -> String {
    let mut v = String::from("bytes=");
    for (i, r) in ranges.iter().enumerate() {
        if i > 0 {
            v.push(',');
        }
        v.push_str(&format!("{}-{}", r.start, r.end - 1));
    }
    v
}

/// Checks that `ranges` can be asked for in one request: 1 to [`MAX_RANGES`] of them,
/// none empty, sorted and not touching (a server may merge touching or overlapping
/// ranges, and Go's answers the whole blob when the ranges add up to more than it).
pub fn check(ranges: &[Range<u64>]) -> Result<(), String> {
    if ranges.is_empty() || ranges.len() > MAX_RANGES {
        return Err(format!(
            "{} ranges in one request (1 to {MAX_RANGES})",
            ranges.len()
        ));
    }
    for (i, r) in ranges.iter().enumerate() {
        if r.start >= r.end {
            return Err(format!(
                "range {}..{} is empty or backwards",
                r.start, r.end
            ));
        }
        if i > 0 && ranges[i - 1].end >= r.start {
            return Err(format!(
                "ranges {}..{} and {}..{} overlap, touch or are out of order",
                ranges[i - 1].start,
                ranges[i - 1].end,
                r.start,
                r.end
            ));
        }
    }
    Ok(())
}

/// The boundary of a `multipart/byteranges` content type, `None` for any other type
/// or a boundary RFC 2046 does not allow.
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    let kind = params.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/byteranges") {
        return None;
    }
    for p in params {
        let Some((name, value)) = p.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("boundary") {
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            return (!value.is_empty() && value.len() <= MAX_BOUNDARY).then_some(value);
        }
    }
    None
}

/// One part of a multipart answer: blob bytes from `start`, at `body` of the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub start: u64,
    pub body: Range<usize>,
}

/// The parts of a `multipart/byteranges` body, each located by its `Content-Range`.
/// Tolerates a preamble, LF line ends and an epilogue; refuses a part without a
/// `Content-Range`, one whose bytes run past the body, more than [`MAX_RANGES`] parts,
/// and a body without the closing delimiter.
pub fn parse(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut pos = find(body, delimiter, 0).ok_or("no boundary in the multipart answer")?;
    let mut parts = Vec::new();
    loop {
        pos += delimiter.len();
        if body.get(pos..pos + 2) == Some(b"--") {
            return Ok(parts);
        }
        if parts.len() == MAX_RANGES {
            return Err(format!("more than {MAX_RANGES} parts"));
        }
        pos = skip_line_end(body, pos).ok_or("a boundary not followed by a line end")?;
        // Headers up to an empty line.
        let mut range = None;
        let header_start = pos;
        loop {
            if pos - header_start > MAX_PART_HEADER_BYTES {
                return Err("a part's headers are too long".into());
            }
            let end = find(body, b"\n", pos).ok_or("a part's headers are cut off")?;
            let line = &body[pos..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            pos = end + 1;
            if line.is_empty() {
                break;
            }
            let line = std::str::from_utf8(line).map_err(|_| "a part header is not text")?;
            if let Some((name, value)) = line.split_once(':')
                && name.trim().eq_ignore_ascii_case("content-range")
            {
                range = Some(
                    crate::parse_content_range(value)
                        .ok_or_else(|| format!("unusable Content-Range {value:?} in a part"))?,
                );
            }
        }
        let (first, last, _) = range.ok_or("a part without a Content-Range")?;
        let len = usize::try_from(last - first + 1).map_err(|_| "a part is too large")?;
        let end = pos
            .checked_add(len)
            .filter(|&e| e <= body.len())
            .ok_or("a part runs past the end of the answer")?;
        parts.push(Part {
            start: first,
            body: pos..end,
        });
        pos = skip_line_end(body, end).ok_or("a part not followed by a line end")?;
        if !body[pos..].starts_with(delimiter) {
            return Err("a part not followed by the boundary".into());
        }
    }
}

/// The bytes of each of `ranges` out of `parts` of `body` (in any order; a part may
/// cover several ranges, as a server may merge them). Errors naming the first range
/// that no part covers.
pub fn slices(ranges: &[Range<u64>], parts: &[Part], body: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    ranges
        .iter()
        .map(|r| {
            parts
                .iter()
                .find_map(|p| {
                    let len = (p.body.end - p.body.start) as u64;
                    let from = r.start.checked_sub(p.start)?;
                    let to = r.end.checked_sub(p.start).filter(|&t| t <= len)?;
                    let at = p.body.start + from as usize;
                    body.get(at..at + (to - from) as usize)
                })
                .map(<[u8]>::to_vec)
                .ok_or_else(|| format!("the answer has no bytes {}..{}", r.start, r.end))
        })
        .collect()
}

/// The ranges of a `Range` header asking for several (`bytes=a-b,c-d`, suffix and
/// open-ended forms allowed) of a blob of `size` bytes, for a server answering them in
/// one `multipart/byteranges` body: `None` (answer as for one range, or the whole
/// blob) unless there are 2 to [`MAX_RANGES`] of them, each satisfiable, in order and
/// apart, adding up to less than the blob (RFC 9110 lets a server refuse to serve
/// anything else as several parts, and a client asking sensibly never needs it).
pub fn parse_ranges(header: Option<&str>, size: u64) -> Option<Vec<Range<u64>>> {
    let spec = header?.trim().strip_prefix("bytes=")?;
    if !spec.contains(',') {
        return None;
    }
    let mut out: Vec<Range<u64>> = Vec::new();
    for one in spec.split(',') {
        if out.len() == MAX_RANGES {
            return None;
        }
        let (first, last) = one.trim().split_once('-')?;
        let (first, last) = (first.trim(), last.trim());
        let r = if first.is_empty() {
            let n: u64 = last.parse().ok()?;
            size.checked_sub(n).filter(|_| n > 0)?..size
        } else {
            let start: u64 = first.parse().ok()?;
            let end = if last.is_empty() {
                size
            } else {
                last.parse::<u64>().ok()?.checked_add(1)?.min(size)
            };
            start..end
        };
        if r.start >= r.end || out.last().is_some_and(|p| p.end >= r.start) {
            return None;
        }
        out.push(r);
    }
    let total: u64 = out.iter().map(|r| r.end - r.start).sum();
    (out.len() >= 2 && total < size).then_some(out)
}

/// The content type of a multipart answer with `boundary`.
pub fn content_type(boundary: &str) -> String {
    format!("multipart/byteranges; boundary={boundary}")
}

/// What goes before range `r`'s bytes in a multipart answer (of a blob of `size`
/// bytes): the delimiter and the part's headers.
pub fn part_head(boundary: &str, r: &Range<u64>, size: u64) -> String {
    format!(
        "\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\
         Content-Range: bytes {}-{}/{size}\r\n\r\n",
        r.start,
        r.end - 1
    )
}

/// What ends a multipart answer.
pub fn tail(boundary: &str) -> String {
    format!("\r\n--{boundary}--\r\n")
}

/// The length of the whole multipart answer for `ranges`: its `Content-Length`.
pub fn body_len(boundary: &str, ranges: &[Range<u64>], size: u64) -> u64 {
    ranges
        .iter()
        .map(|r| part_head(boundary, r, size).len() as u64 + (r.end - r.start))
        .sum::<u64>()
        + tail(boundary).len() as u64
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| from + i)
}

fn skip_line_end(body: &[u8], pos: usize) -> Option<usize> {
    match body.get(pos..) {
        Some([b'\r', b'\n', ..]) => Some(pos + 2),
        Some([b'\n', ..]) => Some(pos + 1),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    fn multipart(boundary: &str, parts: &[(u64, &[u8])], total: u64) -> Vec<u8> {
        let mut out = b"preamble\r\n".to_vec();
        for (start, bytes) in parts {
            out.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Type: application/octet-stream\r\n\
                     Content-Range: bytes {}-{}/{total}\r\n\r\n",
                    start,
                    start + bytes.len() as u64 - 1
                )
                .as_bytes(),
            );
            out.extend_from_slice(bytes);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        out
    }

    #[test]
    fn server_side_ranges() {
        assert_eq!(
            parse_ranges(Some("bytes=0-9,20-29"), 100),
            Some(vec![0..10, 20..30])
        );
        assert_eq!(
            parse_ranges(Some("bytes=0-9, 90-"), 100),
            Some(vec![0..10, 90..100])
        );
        assert_eq!(
            parse_ranges(Some("bytes=0-9,-5"), 100),
            Some(vec![0..10, 95..100])
        );
        assert_eq!(parse_ranges(Some("bytes=0-9"), 100), None, "one range");
        assert_eq!(parse_ranges(Some("bytes=0-9,5-20"), 100), None, "overlap");
        assert_eq!(parse_ranges(Some("bytes=20-29,0-9"), 100), None, "order");
        assert_eq!(
            parse_ranges(Some("bytes=0-49,50-99"), 100),
            None,
            "touching"
        );
        assert_eq!(
            parse_ranges(Some("bytes=0-9,200-300"), 100),
            None,
            "past the end"
        );
        assert_eq!(parse_ranges(Some("bytes=0-9,x-y"), 100), None);
        assert_eq!(parse_ranges(Some("items=0-9,20-29"), 100), None);
        assert_eq!(
            parse_ranges(Some("bytes=0-9,20-18446744073709551615"), 100),
            None,
            "all but 10 bytes is fine, overflow is not"
        );
        assert_eq!(parse_ranges(None, 100), None);
    }

    #[test]
    fn what_a_server_writes_a_client_reads() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let ranges = vec![3..10, 100..400, 999..1000];
        let mut body = Vec::new();
        for r in &ranges {
            body.extend_from_slice(part_head("zz", r, 1000).as_bytes());
            body.extend_from_slice(&data[r.start as usize..r.end as usize]);
        }
        body.extend_from_slice(tail("zz").as_bytes());
        assert_eq!(body.len() as u64, body_len("zz", &ranges, 1000));
        let parts = parse(&body, "zz").unwrap();
        let got = slices(&ranges, &parts, &body).unwrap();
        for (r, g) in ranges.iter().zip(got) {
            assert_eq!(g, &data[r.start as usize..r.end as usize]);
        }
        assert_eq!(boundary(&content_type("zz")), Some("zz"));
    }

    #[test]
    fn header_and_check() {
        assert_eq!(range_header(&[0..10, 20..21]), "bytes=0-9,20-20");
        assert!(check(&[0..10, 20..30]).is_ok());
        assert!(check(&[]).is_err());
        assert!(check(&[0..10, 10..20]).is_err(), "touching");
        assert!(check(&[20..30, 0..10]).is_err(), "out of order");
        assert!(check(&[5..5]).is_err(), "empty");
        let many: Vec<_> = (0..=MAX_RANGES as u64)
            .map(|i| i * 10..i * 10 + 1)
            .collect();
        assert!(check(&many).is_err());
    }

    #[test]
    fn boundary_of_content_type() {
        assert_eq!(boundary("multipart/byteranges; boundary=abc"), Some("abc"));
        assert_eq!(
            boundary("Multipart/ByteRanges;boundary=\"a b\""),
            Some("a b")
        );
        assert_eq!(boundary("application/octet-stream"), None);
        assert_eq!(boundary("multipart/byteranges"), None);
        assert_eq!(
            boundary(&format!(
                "multipart/byteranges; boundary={}",
                "x".repeat(71)
            )),
            None
        );
    }

    #[test]
    fn parses_parts_and_slices_ranges() {
        let body = multipart("B0", &[(0, b"hello"), (100, b"world!")], 1000);
        let parts = parse(&body, "B0").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].start, 100);
        let got = slices(&[0..5, 101..104], &parts, &body).unwrap();
        assert_eq!(got, vec![b"hello".to_vec(), b"orl".to_vec()]);
        // A server that merged two asked ranges into one part.
        let got = slices(&[0..2, 3..5], &parts, &body).unwrap();
        assert_eq!(got, vec![b"he".to_vec(), b"lo".to_vec()]);
        assert!(slices(&[4..6], &parts, &body).is_err(), "past a part's end");
        assert!(slices(&[50..60], &parts, &body).is_err(), "in no part");
    }

    #[test]
    fn body_bytes_that_look_like_a_boundary_are_data() {
        let body = multipart("B0", &[(7, b"--B0\r\n"), (30, b"x")], 100);
        let parts = parse(&body, "B0").unwrap();
        assert_eq!(slices(&[7..13], &parts, &body).unwrap()[0], b"--B0\r\n");
    }

    #[test]
    fn lf_line_ends() {
        let body = b"--b\nContent-Range: bytes 2-3/9\n\nab\n--b--".to_vec();
        let parts = parse(&body, "b").unwrap();
        assert_eq!(slices(&[2..4], &parts, &body).unwrap()[0], b"ab");
    }

    #[test]
    fn refuses_malformed_answers() {
        let good = multipart("B", &[(0, b"abc")], 10);
        assert!(parse(&good, "C").is_err(), "other boundary");
        // Cut before the closing delimiter.
        let cut = &good[..good.len() - 8];
        assert!(parse(cut, "B").is_err());
        // A part claiming more bytes than the body holds.
        let long = b"--B\r\nContent-Range: bytes 0-999/1000\r\n\r\nabc\r\n--B--".to_vec();
        assert!(parse(&long, "B").is_err());
        // No Content-Range.
        let bare = b"--B\r\nContent-Type: x\r\n\r\nabc\r\n--B--".to_vec();
        assert!(parse(&bare, "B").is_err());
        // Too many parts.
        let many: Vec<(u64, &[u8])> = (0..=MAX_RANGES as u64)
            .map(|i| (i * 10, &b"a"[..]))
            .collect();
        assert!(parse(&multipart("B", &many, 10_000), "B").is_err());
        // Endless headers.
        let mut endless = b"--B\r\n".to_vec();
        endless.extend(std::iter::repeat_n(b"X-A: b\r\n".iter().copied(), 1000).flatten());
        assert!(parse(&endless, "B").is_err());
    }
}
