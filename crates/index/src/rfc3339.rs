//! RFC 3339 times as Go writes them (`time.Time`'s text form), for the formats whose
//! tables come from Go tools: eStargz TOC `modtime`, SOCI zTOC `mod_time`. The one parser
//! and formatter of them in the crate; no clock, no time zone database (UTC only out,
//! numeric offsets in).

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Parses an RFC 3339 time (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`) into seconds and
/// nanoseconds since the epoch; fraction digits past the ninth are dropped, as Go's
/// parser does. `None` when malformed.
pub(crate) fn parse(s: &str) -> Option<(i64, u32)> {
    let b = s.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let part = b.get(r)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    if b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let dim = match mo {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        _ => return None,
    };
    if d == 0 || d > dim || h > 23 || mi > 59 || sec > 59 {
        return None;
    }
    let mut i = 19;
    let mut nsec = 0u32;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 9 {
                nsec = nsec * 10 + u32::from(b[i] - b'0');
            }
            i += 1;
        }
        let digits = i - start;
        if digits == 0 {
            return None;
        }
        for _ in digits..9 {
            nsec *= 10;
        }
    }
    let offset: i64 = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let oh = i64::from(num(i + 1..i + 3)?);
            let om = i64::from(num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let o = oh * 3600 + om * 60;
            if *sign == b'-' { -o } else { o }
        }
        _ => return None,
    };
    let days = days_from_civil(i64::from(y), mo, d);
    let secs = days * 86_400 + i64::from(h) * 3600 + i64::from(mi) * 60 + i64::from(sec) - offset;
    Some((secs, nsec))
}

/// Formats seconds and nanoseconds since the epoch as RFC 3339 in UTC with the
/// fraction's trailing zeros dropped (Go's `RFC3339Nano`); `None` for years RFC 3339
/// cannot spell and nanoseconds of a second or more.
pub(crate) fn format(secs: i64, nanos: u32) -> Option<String> {
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    if !(0..=9999).contains(&y) || nanos >= 1_000_000_000 {
        return None;
    }
    let s = secs.rem_euclid(86_400);
    let mut out = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        s / 3600,
        s / 60 % 60,
        s % 60
    );
    if nanos > 0 {
        let frac = format!("{nanos:09}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_and_format_as_go_writes_them() {
        assert_eq!(parse("1970-01-01T00:00:00Z"), Some((0, 0)));
        assert_eq!(parse("0001-01-01T00:00:00Z"), Some((-62_135_596_800, 0)));
        assert_eq!(
            parse("2023-11-14T23:13:20.5+01:00"),
            Some((1_700_000_000, 500_000_000))
        );
        // more than nine fraction digits: the rest dropped, as Go does
        assert_eq!(
            parse("2023-11-14T22:13:20.1234567891Z"),
            Some((1_700_000_000, 123_456_789))
        );
        for bad in [
            "",
            "2023-13-01T00:00:00Z",
            "2023-02-30T00:00:00Z",
            "2019-02-29T00:00:00Z",
            "2023-01-01 00:00:00Z",
            "2023-01-01T00:00:00",
            "2023-01-01T00:00:00.Z",
            "2023-01-01T24:00:00Z",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        for (s, n) in [
            (0i64, 0u32),
            (1_700_000_000, 250_000_000),
            (-62_135_596_800, 1),
        ] {
            assert_eq!(parse(&format(s, n).unwrap()), Some((s, n)));
        }
        assert_eq!(
            format(1_700_000_000, 250_000_000).unwrap(),
            "2023-11-14T22:13:20.25Z"
        );
        assert_eq!(format(253_402_300_800, 0), None);
        assert_eq!(format(0, 1_000_000_000), None);
    }
}
