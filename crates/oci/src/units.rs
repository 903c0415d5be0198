//! Sizes and durations as people write them in config files and flags (`8M`, `1GiB`,
//! `500ms`, `1.5m`, `2d`), read once here for every crate: this is the lowest crate the
//! daemon, the registry, the load tester and the command line all depend on.
//!
//! A size is a whole number of bytes with an optional unit K, M, G or T (powers of 1024,
//! any case, optionally followed by `B` or `iB`; `B` alone is bytes). A duration is a
//! number (a decimal fraction allowed, to the nanosecond) with an optional unit `ms`, `s`
//! (`sec`, `secs`), `m` (`min`, `mins`), `h` or `d`; a bare number is seconds. Space
//! between number and unit is allowed. Anything else, negative numbers, and values that
//! do not fit (u64 bytes, u64 seconds) are a [`UnitError`], never a wrapped value.

use std::time::Duration;

/// Why a size or duration text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// Not a number with a known size unit.
    #[error("{0:?} is not a size (bytes, or with K, M, G or T: 8M, 1GiB)")]
    NotASize(String),
    /// Not a number with a known duration unit.
    #[error("{0:?} is not a duration (seconds, or with ms, s, m, h or d: 500ms, 30s, 2m)")]
    NotADuration(String),
    /// A valid spelling whose value does not fit.
    #[error("{0:?} is out of range")]
    OutOfRange(String),
    /// Zero where only a positive value makes sense.
    #[error("{0:?} must be more than zero")]
    Zero(String),
}

/// `text` split into its number and unit (both trimmed).
fn split_number(text: &str) -> (&str, &str) {
    let t = text.trim();
    let at = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    (&t[..at], t[at..].trim())
}

/// Parses a size in bytes (see the module docs).
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::NotASize(text.to_string());
    let (digits, unit) = split_number(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let unit = unit.to_ascii_lowercase();
    let prefix = unit
        .strip_suffix("ib")
        .filter(|p| !p.is_empty())
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(&unit);
    let shift = match prefix {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(bad()),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| UnitError::OutOfRange(text.to_string()))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| UnitError::OutOfRange(text.to_string()))
}

/// [`parse_size`] for settings where zero means nothing useful (chunk sizes, limits).
pub fn parse_nonzero_size(text: &str) -> Result<u64, UnitError> {
    match parse_size(text)? {
        0 => Err(UnitError::Zero(text.to_string())),
        n => Ok(n),
    }
}

/// Formats a size the way [`parse_size`] reads it, exactly (the largest unit that
/// divides it).
pub fn format_size(bytes: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Parses a duration (see the module docs).
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let bad = || UnitError::NotADuration(text.to_string());
    let range = || UnitError::OutOfRange(text.to_string());
    let (number, unit) = split_number(text);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(bad());
    }
    let nanos_per_unit: u128 = match unit {
        "ms" => 1_000_000,
        "" | "s" | "sec" | "secs" => 1_000_000_000,
        "m" | "min" | "mins" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "d" => 86_400_000_000_000,
        _ => return Err(bad()),
    };
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| range())?
    };
    // The fraction, to 18 digits, as a fraction of 10^18 (more digits cannot matter).
    let digits: String = fraction.chars().take(18).collect();
    let scaled: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse::<u128>().map_err(|_| bad())? * 10u128.pow(18 - digits.len() as u32)
    };
    let nanos = whole
        .checked_mul(nanos_per_unit)
        .and_then(|n| n.checked_add(scaled * nanos_per_unit / 1_000_000_000_000_000_000))
        .ok_or_else(range)?;
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| range())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// Formats a duration the way [`parse_duration`] reads it, exactly when it is a whole
/// number of milliseconds (`30s`, `1500ms`).
pub fn format_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}.{:09}s", d.as_secs(), d.subsec_nanos())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_their_units() {
        for (text, want) in [
            ("0", 0),
            ("123", 123),
            (" 8M ", 8 << 20),
            ("8 MiB", 8 << 20),
            ("8MB", 8 << 20),
            ("2k", 2 << 10),
            ("1g", 1 << 30),
            ("20GiB", 20 << 30),
            ("1tb", 1 << 40),
            ("512B", 512),
        ] {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
        for text in ["", "G", "-1", "1.5M", "12X", "8 M B", "iB", "0x10", "1e3"] {
            assert_eq!(
                parse_size(text),
                Err(UnitError::NotASize(text.into())),
                "{text}"
            );
        }
    }

    #[test]
    fn sizes_that_do_not_fit_are_out_of_range() {
        // 2^24 TiB is 2^64, one past u64.
        for text in ["16777216T", "99999999999999G", "18446744073709551616"] {
            assert_eq!(
                parse_size(text),
                Err(UnitError::OutOfRange(text.into())),
                "{text}"
            );
        }
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_size("16777215T"), Ok(16_777_215 << 40));
        assert_eq!(parse_nonzero_size("0"), Err(UnitError::Zero("0".into())));
        assert_eq!(parse_nonzero_size("4K"), Ok(4096));
    }

    #[test]
    fn sizes_format_back_exactly() {
        for n in [0, 1, 1536, 2 << 10, 8 << 20, 3 << 30, 5 << 40, u64::MAX] {
            assert_eq!(parse_size(&format_size(n)), Ok(n), "{n}");
        }
        assert_eq!(format_size(2 << 10), "2K");
        assert_eq!(format_size(1536), "1536");
    }

    #[test]
    fn durations_and_their_units() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        for (text, want) in [
            ("0", Duration::ZERO),
            ("45", s(45)),
            ("30s", s(30)),
            ("30 secs", s(30)),
            ("500ms", ms(500)),
            ("2m", s(120)),
            ("2min", s(120)),
            ("1.5m", s(90)),
            ("1.5", ms(1500)),
            (".5s", ms(500)),
            ("1h", s(3600)),
            ("2d", s(172_800)),
            ("0.000000001", Duration::from_nanos(1)),
            ("1.0000000019", Duration::new(1, 1)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for text in [
            "", "s", ".", "-1s", "1y", "10x", "5 weeks", "1.2.3s", "1e400", "ms",
        ] {
            assert_eq!(
                parse_duration(text),
                Err(UnitError::NotADuration(text.into())),
                "{text}"
            );
        }
    }

    #[test]
    fn durations_that_do_not_fit_are_out_of_range() {
        for text in [
            "99999999999999999999d",
            "18446744073709551616",
            "999999999999999999999999999999999999999999",
        ] {
            assert_eq!(
                parse_duration(text),
                Err(UnitError::OutOfRange(text.into())),
                "{text}"
            );
        }
        assert_eq!(
            parse_duration("18446744073709551615"),
            Ok(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn durations_format_back_exactly() {
        for d in [
            Duration::ZERO,
            Duration::from_secs(30),
            Duration::from_millis(1500),
            Duration::new(3, 7),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{d:?}");
        }
        assert_eq!(format_duration(Duration::from_secs(30)), "30s");
        assert_eq!(format_duration(Duration::from_millis(20)), "20ms");
    }
}
