//! The TOC JSON model (stargz-snapshotter `estargz/types.go`: `JTOC`, `TOCEntry`) and the
//! small encodings it needs: base64 for xattr values (Go's `[]byte` in JSON), RFC 3339
//! modification times, `sha256:<hex>` digests.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::MAX_TOC_ENTRIES;

/// The whole TOC.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct JToc {
    #[serde(default, deserialize_with = "null_default")]
    pub version: i64,
    #[serde(default, deserialize_with = "bounded_entries")]
    pub entries: Vec<TocEntry>,
}

/// One TOC entry. Field order and `omitempty` behaviour follow Go's `TOCEntry`, so the
/// JSON looks like what stargz writes; `null` reads as the zero value, as in Go.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub(crate) struct TocEntry {
    #[serde(default, deserialize_with = "null_default")]
    pub name: String,
    #[serde(rename = "type", default, deserialize_with = "null_default")]
    pub typ: String,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub size: i64,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub modtime: String,
    #[serde(
        rename = "linkName",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub link_name: String,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub mode: i64,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub uid: i64,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub gid: i64,
    #[serde(
        rename = "userName",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub uname: String,
    #[serde(
        rename = "groupName",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub gname: String,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub offset: i64,
    #[serde(
        rename = "innerOffset",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub inner_offset: i64,
    #[serde(
        rename = "devMajor",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub dev_major: i64,
    #[serde(
        rename = "devMinor",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub dev_minor: i64,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub xattrs: BTreeMap<String, B64>,
    #[serde(
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub digest: String,
    #[serde(
        rename = "chunkOffset",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub chunk_offset: i64,
    #[serde(
        rename = "chunkSize",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub chunk_size: i64,
    #[serde(
        rename = "chunkDigest",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub chunk_digest: String,
    /// zstd:chunked only: where the compressed frames of a file's data end.
    #[serde(
        rename = "endOffset",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "is_zero"
    )]
    pub end_offset: i64,
    /// zstd:chunked only: `""` (data) or `"zeros"` (a hole; its frame still holds the
    /// zeros, so it reads like data).
    #[serde(
        rename = "chunkType",
        default,
        deserialize_with = "null_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub chunk_type: String,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// `null` reads as the type's default, like Go's `encoding/json`.
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Deserializes the entries array, refusing more than [`MAX_TOC_ENTRIES`] before
/// allocating for them.
fn bounded_entries<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<TocEntry>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<TocEntry>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array of TOC entries")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Vec::new())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut v = Vec::new();
            while let Some(e) = seq.next_element::<TocEntry>()? {
                if v.len() >= MAX_TOC_ENTRIES {
                    return Err(de::Error::custom(format!(
                        "more than {MAX_TOC_ENTRIES} TOC entries"
                    )));
                }
                v.push(e);
            }
            Ok(v)
        }
    }
    d.deserialize_any(V)
}

/// Bytes that travel as standard base64 in JSON (Go's `[]byte`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct B64(pub Vec<u8>);

impl Serialize for B64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64_encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for B64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        base64_decode(&s)
            .map(B64)
            .ok_or_else(|| de::Error::custom("xattr value is not valid base64"))
    }
}

const B64_ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub(crate) fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let idx = [(n >> 18) & 63, (n >> 12) & 63, (n >> 6) & 63, n & 63];
        for (i, &k) in idx.iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(B64_ALPHABET[k as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64; padding is optional, `\r` and `\n` are skipped (as Go does).
pub(crate) fn base64_decode(s: &str) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'\r' && c != b'\n').collect();
    let body_len = bytes.iter().rposition(|&c| c != b'=').map_or(0, |p| p + 1);
    let pad = bytes.len() - body_len;
    if pad > 2 || (pad > 0 && !bytes.len().is_multiple_of(4)) {
        return None;
    }
    let body = &bytes[..body_len];
    if body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() / 4 * 3 + 2);
    for chunk in body.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        // Non-zero trailing bits are ignored, as Go's (non-strict) decoder does.
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    Some(out)
}

/// Formats a modification time like stargz's writer: UTC, rounded to the second
/// (half away from zero, as Go's `Round`), RFC 3339; empty for the epoch itself and for
/// years RFC 3339 cannot spell.
pub(crate) fn format_modtime(secs: i64, nsec: u32) -> String {
    if secs == 0 {
        return String::new();
    }
    let secs = if nsec >= 500_000_000 {
        secs.saturating_add(1)
    } else {
        secs
    };
    crate::rfc3339::format(secs, 0).unwrap_or_default()
}

/// `sha256:<hex>` of 32 digest bytes.
pub(crate) fn sha256_string(d: &[u8; 32]) -> String {
    format!("sha256:{}", hex::encode(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trip() {
        for n in 0..40usize {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let enc = base64_encode(&data);
            assert_eq!(enc.len() % 4, 0);
            assert_eq!(base64_decode(&enc).as_deref(), Some(&data[..]), "n={n}");
        }
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_decode("Zm8").as_deref(), Some(&b"fo"[..]));
        assert_eq!(base64_decode("Zm9=").as_deref(), Some(&b"fo"[..]));
        assert_eq!(base64_decode("Z"), None);
        assert_eq!(base64_decode("Zm8==="), None);
        assert_eq!(base64_decode("Zm!="), None);
    }

    #[test]
    fn modtime_round_trip() {
        for &(secs, nsec, s) in &[
            (1_566_297_043i64, 0u32, "2019-08-20T10:30:43Z"),
            (951_782_400, 0, "2000-02-29T00:00:00Z"),
            (1, 0, "1970-01-01T00:00:01Z"),
            (-1, 0, "1969-12-31T23:59:59Z"),
            (253_402_300_799, 0, "9999-12-31T23:59:59Z"),
        ] {
            assert_eq!(format_modtime(secs, nsec), s);
            assert_eq!(crate::rfc3339::parse(s), Some((secs, 0)));
        }
        assert_eq!(format_modtime(0, 0), "");
        assert_eq!(format_modtime(10, 600_000_000), "1970-01-01T00:00:11Z");
        assert_eq!(format_modtime(253_402_300_800, 0), "");
        assert_eq!(
            crate::rfc3339::parse("2019-08-20T12:30:43.5+02:00"),
            Some((1_566_297_043, 500_000_000))
        );
        assert_eq!(crate::rfc3339::parse("2019-02-29T00:00:00Z"), None);
        assert_eq!(crate::rfc3339::parse("2019-08-20 10:30:43Z"), None);
        assert_eq!(crate::rfc3339::parse("2019-08-20T10:30:43"), None);
        assert_eq!(crate::rfc3339::parse(""), None);
    }

    #[test]
    fn toc_json_null_and_unknown_fields() {
        let j = br#"{"version":1,"entries":[{"name":"a","type":"reg","size":null,"NumLink":3,"xattrs":{"user.x":"eHl6"}}]}"#;
        let toc: JToc = serde_json::from_slice(j).unwrap_or_default();
        assert_eq!(toc.version, 1);
        assert_eq!(toc.entries.len(), 1);
        assert_eq!(
            toc.entries[0].xattrs.get("user.x"),
            Some(&B64(b"xyz".to_vec()))
        );
        let out = serde_json::to_string(&toc.entries[0]).unwrap_or_default();
        assert_eq!(
            out,
            r#"{"name":"a","type":"reg","xattrs":{"user.x":"eHl6"}}"#
        );
    }
}
