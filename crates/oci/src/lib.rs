//! # ferry-oci: the OCI model
//!
//! This crate owns what ferry knows about OCI images as data: digests ([`digest`]), media
//! types ([`media`]), image references in skopeo's spelling and the typed identifiers they
//! are made of — [`RepositoryName`], [`Tag`], [`Reference`] ([`reference`]) —, platforms
//! and the one rule for choosing a platform's manifest from an image index ([`platform`]),
//! and OCI image layout directories on disk ([`layout`]), including the referrers tag
//! fallback that ferry uses to keep its index artifacts beside an image. Manifest, index,
//! descriptor and digest types are oci-spec's, re-exported here. Being the crate every
//! other one depends on, it also holds the size and duration spellings of configs and
//! flags ([`units`]).
//!
//! Each identifier has exactly one validator, here; the registry, its client, the pull
//! path and the CLI parse names, tags and digests with it where they arrive and pass the
//! typed values inward.
//!
//! It must not talk to the network or know about layer formats: registries live in the
//! registry crate, tar/gzip in the index crate. Everything it parses (JSON documents,
//! references, digests) may come from strangers, so parsing is bounded and returns
//! [`Error`].

pub mod digest;
pub mod layout;
pub mod media;
pub mod platform;
pub mod reference;
pub mod units;

pub use digest::{Sha256Writer, sha256_digest};
pub use layout::OciLayout;
pub use oci_spec::image::{
    Descriptor, Digest, ImageConfiguration, ImageIndex, ImageManifest, MediaType,
};
pub use platform::{Platform, choose_manifest};
pub use reference::{ImageRef, Reference, RepositoryName, Tag};

/// Largest manifest or index document ferry will read (the distribution spec suggests
/// registries accept at least 4 MiB).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// Errors of the OCI model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Filesystem I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A document (manifest, index, config, index.json) is not valid.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// Which document.
        what: String,
        /// Why.
        reason: String,
    },
    /// A digest string is malformed or uses an unsupported algorithm.
    #[error("invalid digest {input:?}: {reason}")]
    BadDigest {
        /// The string (cut to 100 characters).
        input: String,
        /// Why it is not a digest ferry accepts.
        reason: String,
    },
    /// A repository name or tag does not follow the distribution spec's grammar.
    #[error("invalid {what} {input:?}: {reason}")]
    BadName {
        /// `repository name` or `tag`.
        what: &'static str,
        /// The string (cut to 100 characters).
        input: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// A platform (`os/arch[/variant]`) could not be parsed.
    #[error("invalid platform {input:?}: {reason}")]
    BadPlatform {
        /// What was given (cut to 100 characters).
        input: String,
        /// Why.
        reason: &'static str,
    },
    /// An image index has no manifest for the wanted platform.
    #[error("no manifest for {wanted} in the index; it has {}", platform::list(.available))]
    NoPlatform {
        /// The platform asked for.
        wanted: platform::Platform,
        /// The platforms of the index's image manifests (attestations left out).
        available: Vec<platform::Platform>,
    },
    /// An image reference could not be parsed.
    #[error("invalid image reference {input:?}: {reason}")]
    BadReference {
        /// What the user typed.
        input: String,
        /// Why it is not a reference.
        reason: String,
    },
    /// Content did not match its digest or size.
    #[error("content of {digest} does not match: {reason}")]
    Mismatch {
        /// The digest expected.
        digest: String,
        /// What differed.
        reason: String,
    },
    /// Something named does not exist.
    #[error("not found: {0}")]
    NotFound(String),
}

/// `s` as shown in an error: at most 100 characters, so a hostile input is not echoed
/// whole into logs and responses.
pub(crate) fn shown(s: &str) -> String {
    match s.char_indices().nth(100) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
