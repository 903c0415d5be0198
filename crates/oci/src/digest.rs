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

/// Parses and validates a `sha256:<64 lowercase hex>` digest (the only algorithm ferry
/// stores content under).
pub fn parse_sha256(s: &str) -> Result<Digest> {
    let hex_part = s
        .strip_prefix("sha256:")
        .ok_or_else(|| Error::BadDigest(s.to_string()))?;
    if hex_part.len() != 64
        || !hex_part
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(Error::BadDigest(s.to_string()));
    }
    Digest::from_str(s).map_err(|_| Error::BadDigest(s.to_string()))
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
