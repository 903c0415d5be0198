//! Digests in OCI's `algorithm:<hex>` spelling: parsing for every registered algorithm,
//! hashing for the two content is stored under (sha256, the canonical one, and sha512).

use std::io::{self, Write};
use std::str::FromStr;

use oci_spec::image::DigestAlgorithm;
use sha2::{Digest as _, Sha256, Sha512};

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

/// `sha512:<hex>` of `bytes`.
pub fn sha512_digest(bytes: &[u8]) -> Digest {
    let mut h = ContentHasher::Sha512(Sha512::new());
    h.update(bytes);
    h.finish()
}

/// Builds a digest from a raw SHA-512 value.
pub fn from_sha512(raw: [u8; 64]) -> Digest {
    match Digest::from_str(&format!("sha512:{}", hex::encode(raw))) {
        Ok(d) => d,
        Err(_) => unreachable_digest(),
    }
}

/// `bytes` hashed with the algorithm of `like` (which must be a [stored
/// algorithm](is_stored_algorithm); sha256 otherwise, the canonical one): the digest a
/// document pushed under `like` must have.
pub fn digest_like(like: &Digest, bytes: &[u8]) -> Digest {
    let mut h = ContentHasher::for_digest(like).unwrap_or_default();
    h.update(bytes);
    h.finish()
}

/// A running hash in one of the algorithms content is stored under.
#[derive(Debug, Clone)]
pub enum ContentHasher {
    /// SHA-256 (the canonical algorithm).
    Sha256(Sha256),
    /// SHA-512.
    Sha512(Sha512),
}

impl Default for ContentHasher {
    fn default() -> Self {
        ContentHasher::Sha256(Sha256::new())
    }
}

impl ContentHasher {
    /// A fresh hasher for `algorithm`, or `None` if content is not stored under it.
    pub fn new(algorithm: &DigestAlgorithm) -> Option<ContentHasher> {
        match algorithm {
            DigestAlgorithm::Sha256 => Some(ContentHasher::Sha256(Sha256::new())),
            DigestAlgorithm::Sha512 => Some(ContentHasher::Sha512(Sha512::new())),
            _ => None,
        }
    }

    /// A fresh hasher in the algorithm of `d`, or `None` if content is not stored under
    /// it.
    pub fn for_digest(d: &Digest) -> Option<ContentHasher> {
        ContentHasher::new(d.algorithm())
    }

    /// The algorithm this hasher computes.
    pub fn algorithm(&self) -> DigestAlgorithm {
        match self {
            ContentHasher::Sha256(_) => DigestAlgorithm::Sha256,
            ContentHasher::Sha512(_) => DigestAlgorithm::Sha512,
        }
    }

    /// Feeds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            ContentHasher::Sha256(h) => h.update(bytes),
            ContentHasher::Sha512(h) => h.update(bytes),
        }
    }

    /// The digest of everything fed.
    pub fn finish(self) -> Digest {
        match self {
            ContentHasher::Sha256(h) => from_sha256(h.finalize().into()),
            ContentHasher::Sha512(h) => from_sha512(h.finalize().into()),
        }
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

/// [`parse`], restricted to the algorithms content is stored under ([`is_stored_algorithm`]):
/// what a registry accepts for a blob, a manifest, a mount or a referrers subject.
pub fn parse_stored(s: &str) -> Result<Digest> {
    let d = parse(s)?;
    if !is_stored_algorithm(&d) {
        return Err(bad_digest(
            s,
            "unsupported algorithm (only sha256 and sha512)",
        ));
    }
    Ok(d)
}

/// Whether content can be stored under `d`: sha256 or sha512, the algorithms the OCI image
/// spec registers (and so, `d` being parsed, 64 or 128 lowercase hex digits).
pub fn is_stored_algorithm(d: &Digest) -> bool {
    matches!(
        d.algorithm(),
        DigestAlgorithm::Sha256 | DigestAlgorithm::Sha512
    )
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
    *d.algorithm() == DigestAlgorithm::Sha256
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
    fn stored_algorithms_are_sha256_and_sha512() {
        let s256 = sha256_digest(b"abc");
        let s512 = sha512_digest(b"abc");
        assert_eq!(
            s512.to_string(),
            "sha512:ddaf35a193617abacc417349ae20413112e6fa4e89a97ea20a9eeee64b55d39a\
             2192992a274fc1a836ba3c23a3feebbd454d4423643ce80e2a9ac94fa54ca49f"
        );
        assert!(parse_stored(s256.as_ref()).is_ok());
        assert!(parse_stored(s512.as_ref()).is_ok());
        assert!(parse_stored(&format!("sha384:{}", "a".repeat(96))).is_err());
        assert!(
            parse_stored("multihash+base58:QmRZxt2b1FVZPNqd8hsiykDL3TdBDeTSPX9Kv46HmX4Gx8")
                .is_err()
        );
        assert_eq!(digest_like(&s512, b"abc"), s512);
        assert_eq!(digest_like(&s256, b"abc"), s256);
        let mut h = ContentHasher::for_digest(&s512).unwrap_or_default();
        h.update(b"a");
        h.update(b"bc");
        assert_eq!(h.algorithm(), DigestAlgorithm::Sha512);
        assert_eq!(h.finish(), s512);
        assert!(ContentHasher::new(&DigestAlgorithm::Sha384).is_none());
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
