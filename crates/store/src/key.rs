//! Chunk keys: the SHA-256 of a chunk's bytes, spelled `sha256:<hex>` like an OCI digest.
//!
//! The store keeps its own key type (not ferry-oci's `Digest`) so it depends on nothing but
//! hashing: the key *is* the content's hash, which is what lets every layer and image share
//! one copy and lets every read be checked against its name.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::error::Error;

/// The SHA-256 of a chunk's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey([u8; 32]);

/// Bytes together with the key hashed from them in this process; only [`Hashed::new`]
/// makes one. A caller that hashes a piece anyway (to check it against an index) hands
/// this to [`crate::Store::put_hashed`], which then need not hash it a second time: on a
/// cold start that was every fetched byte hashed twice.
#[derive(Debug, Clone, Copy)]
pub struct Hashed<'a> {
    key: ChunkKey,
    bytes: &'a [u8],
}

impl<'a> Hashed<'a> {
    /// Hashes `bytes`.
    pub fn new(bytes: &'a [u8]) -> Hashed<'a> {
        Hashed {
            key: ChunkKey::of(bytes),
            bytes,
        }
    }

    /// Their key.
    pub fn key(&self) -> &ChunkKey {
        &self.key
    }

    /// The bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl ChunkKey {
    /// The key of `bytes`.
    pub fn of(bytes: &[u8]) -> ChunkKey {
        ChunkKey(Sha256::digest(bytes).into())
    }

    /// A key from a raw SHA-256 value.
    pub const fn from_raw(raw: [u8; 32]) -> ChunkKey {
        ChunkKey(raw)
    }

    /// The raw SHA-256 value.
    pub const fn raw(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex of the hash, without the `sha256:` prefix (the entry's file name).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses `sha256:<64 lowercase hex>`.
    pub fn parse(s: &str) -> Result<ChunkKey, Error> {
        let bad = || Error::InvalidKey(s.chars().take(80).collect());
        let hex_part = s.strip_prefix("sha256:").ok_or_else(bad)?;
        Self::from_hex(hex_part).ok_or_else(bad)
    }

    /// Parses 64 lowercase hex digits (an entry's file name); `None` for anything else.
    pub fn from_hex(hex_part: &str) -> Option<ChunkKey> {
        if hex_part.len() != 64
            || !hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        let mut raw = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut raw).ok()?;
        Some(ChunkKey(raw))
    }

    /// A key from its stored 32-byte form; `None` when the length is wrong.
    pub(crate) fn from_slice(bytes: &[u8]) -> Option<ChunkKey> {
        <[u8; 32]>::try_from(bytes).ok().map(ChunkKey)
    }
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkKey({self})")
    }
}

impl FromStr for ChunkKey {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChunkKey::parse(s)
    }
}

impl Serialize for ChunkKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ChunkKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ChunkKey::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn key_of_empty_is_the_well_known_digest() {
        assert_eq!(
            ChunkKey::of(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn parse_round_trips_and_rejects_bad_spellings() {
        let k = ChunkKey::of(b"hello");
        assert_eq!(ChunkKey::parse(&k.to_string()).unwrap(), k);
        let upper = k.to_string().to_uppercase().replace("SHA256", "sha256");
        assert!(ChunkKey::parse(&upper).is_err());
        assert!(ChunkKey::parse(&k.hex()).is_err());
        assert!(ChunkKey::parse("sha256:abc").is_err());
        assert!(ChunkKey::parse("sha512:00").is_err());
        assert!(ChunkKey::from_hex(&format!("{}0", k.hex())).is_none());
        assert!(ChunkKey::from_slice(&[0u8; 31]).is_none());
    }

    #[test]
    fn serde_uses_the_string_form() {
        let k = ChunkKey::of(b"x");
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(json, format!("\"{k}\""));
        assert_eq!(serde_json::from_str::<ChunkKey>(&json).unwrap(), k);
        assert!(serde_json::from_str::<ChunkKey>("\"sha256:zz\"").is_err());
    }
}
