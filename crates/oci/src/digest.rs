//! SHA-256 digests in OCI's `sha256:<hex>` spelling.

use std::io::{self, Write};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::{Digest, Error, Result};

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> Digest {
    from_sha256(Sha256::digest(bytes).into())
}

/// Builds a digest from a raw SHA-256 value.
pub fn from_sha256(raw: [u8; 32]) -> Digest {
    // A 64-hex sha256 always parses; fall back to a plain error-free construction path.
    match Digest::from_str(&format!("sha256:{}", hex::encode(raw))) {
        Ok(d) => d,
        Err(_) => unreachable_digest(),
    }
}

#[cold]
fn unreachable_digest() -> Digest {
    // Only reachable if oci-spec stopped accepting canonical sha256 digests.
    panic!("oci-spec rejected a canonical sha256 digest")
}

/// Longest digest string accepted (a sha512 digest is 135 characters; this leaves room
/// for the other registered algorithms without letting a peer hand over megabytes).
pub const MAX_DIGEST_LEN: usize = 256;

/// Parses a digest in the OCI grammar: `algorithm:encoded`, the algorithm lowercase
/// components joined by `+._-`, the encoded part `[a-zA-Z0-9=_-]+`; sha256 and sha512
/// must be 64 and 128 lowercase hex (oci-spec's rules, which ferry does not repeat).
/// This is ferry's one digest validator: every digest that arrives from a URL, a CLI
/// argument or a document field goes through it (or through [`parse_sha256`]).
pub fn parse(s: &str) -> Result<Digest> {
    if s.len() > MAX_DIGEST_LEN {
        return Err(bad_digest(s, "longer than 256 characters"));
    }
    Digest::from_str(s).map_err(|e| bad_digest(s, &e.to_string()))
}

/// [`parse`], restricted to sha256: the only algorithm ferry stores content under (its
/// stores, layouts and caches are keyed by the 64 hex digits).
pub fn parse_sha256(s: &str) -> Result<Digest> {
    let d = parse(s)?;
    if !is_sha256(&d) {
        return Err(bad_digest(s, "unsupported algorithm (only sha256)"));
    }
    Ok(d)
}

/// [`parse_sha256`], as the 32 bytes its hex spells (for indexes and stores that keep
/// digests raw).
pub fn parse_sha256_bytes(s: &str) -> Result<[u8; 32]> {
    let d = parse_sha256(s)?;
    let mut raw = [0u8; 32];
    hex::decode_to_slice(d.digest(), &mut raw).map_err(|e| bad_digest(s, &e.to_string()))?;
    Ok(raw)
}

/// Whether a manifest reference (the `REF` of `/v2/NAME/manifests/REF`) names a digest
/// rather than a tag: a `:` makes it a digest, since no tag may contain one. The one rule
/// for telling them apart; [`parse`] still decides whether the digest is valid.
pub fn is_digest_reference(reference: &str) -> bool {
    reference.contains(':')
}

/// Whether `s` is exactly `len` lowercase hex digits (no uppercase, no prefix).
pub fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` is the hex part of a sha256 digest: 64 lowercase hex digits, as ferry's
/// stores and caches name their files and keys.
pub fn is_sha256_hex(s: &str) -> bool {
    is_lower_hex(s, 64)
}

/// Whether `d` is a sha256 digest (and so, being parsed, 64 lowercase hex digits).
pub fn is_sha256(d: &Digest) -> bool {
    *d.algorithm() == oci_spec::image::DigestAlgorithm::Sha256
}

fn bad_digest(s: &str, reason: &str) -> Error {
    Error::BadDigest {
        input: crate::shown(s),
        reason: reason.to_string(),
    }
}

/// The hex part of a sha256 digest.
pub fn hex_of(d: &Digest) -> &str {
    d.digest()
}

/// A writer that hashes and counts what passes through it.
#[derive(Debug)]
pub struct Sha256Writer<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> Sha256Writer<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        Sha256Writer {
            inner,
            hasher: Sha256::new(),
            written: 0,
        }
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Finishes: returns the inner writer, the digest and the byte count.
    pub fn finish(self) -> (W, Digest, u64) {
        (
            self.inner,
            from_sha256(self.hasher.finalize().into()),
            self.written,
        )
    }
}

impl<W: Write> Write for Sha256Writer<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_known_value() {
        let d = sha256_digest(b"");
        assert_eq!(
            d.to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn sha256_hex_is_64_lowercase_hex() {
        let good = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert!(is_sha256_hex(good));
        assert!(!is_sha256_hex(&good.to_uppercase()));
        assert!(!is_sha256_hex(&good[1..]));
        assert!(!is_sha256_hex(&format!("{good}0")));
        assert!(!is_sha256_hex(&format!("sha256:{good}")));
        assert!(!is_sha256_hex(&good.replace('e', "g")));
        assert!(is_lower_hex("0a", 2));
        assert!(!is_lower_hex("0A", 2));
    }

    #[test]
    fn digest_references_have_a_colon() {
        assert!(is_digest_reference("sha256:abc"));
        assert!(!is_digest_reference("latest"));
    }

    #[test]
    fn parse_rejects_bad_digests() {
        assert!(parse_sha256("sha256:abc").is_err());
        assert!(
            parse_sha256("md5:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
                .is_err()
        );
        assert!(
            parse_sha256("sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855")
                .is_err()
        );
        assert!(
            parse_sha256("sha256:../../../../etc/passwd000000000000000000000000000000000000000")
                .is_err()
        );
        assert!(
            parse_sha256("sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
                .is_ok()
        );
        let upper = "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855";
        assert!(
            parse_sha256_bytes(upper).is_err(),
            "uppercase hex is refused"
        );
        let raw = parse_sha256_bytes(&upper.to_ascii_lowercase()).map_err(|e| e.to_string());
        assert_eq!(raw, Ok(<[u8; 32]>::from(Sha256::digest(b""))));
        let sha512 = format!("sha512:{}", "a".repeat(128));
        assert!(parse(&sha512).is_ok());
        assert!(parse_sha256(&sha512).is_err(), "parses, but is not sha256");
        assert!(parse("sha512:abc").is_err(), "sha512 is 128 hex digits");
        assert!(parse(&format!("sha512:{}", "A".repeat(128))).is_err());
        assert!(parse("multihash+base58:QmRZxt2b1FVZPNqd8hsiykDL3TdBDeTSPX9Kv46HmX4Gx8").is_ok());
        assert!(parse("nocolon").is_err());
        assert!(parse(":abc").is_err());
        assert!(parse("sha256:").is_err());
        assert!(
            parse(&format!("x:{}", "a".repeat(300))).is_err(),
            "length bound"
        );
    }

    #[test]
    fn writer_hashes_what_passes() -> std::io::Result<()> {
        let mut w = Sha256Writer::new(Vec::new());
        w.write_all(b"hello ")?;
        w.write_all(b"world")?;
        let (buf, d, n) = w.finish();
        assert_eq!(buf, b"hello world");
        assert_eq!(n, 11);
        assert_eq!(d, sha256_digest(b"hello world"));
        Ok(())
    }
}
