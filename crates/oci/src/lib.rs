//! # ferry-oci: the OCI model
//!
//! This crate owns what ferry knows about OCI images as data: digests ([`digest`]), media
//! types ([`media`]), image references in skopeo's spelling ([`reference`]), and OCI image
//! layout directories on disk ([`layout`]), including the referrers tag fallback that
//! ferry uses to keep its index artifacts beside an image. Manifest, index and descriptor
//! types are oci-spec's, re-exported here. Being the crate every other one depends on, it
//! also holds the size and duration spellings of configs and flags ([`units`]).
//!
//! It must not talk to the network or know about layer formats: registries live in the
//! registry crate, tar/gzip in the index crate. Everything it parses (JSON documents,
//! references, digests) may come from strangers, so parsing is bounded and returns
//! [`Error`].

pub mod digest;
pub mod layout;
pub mod media;
pub mod reference;
pub mod units;

pub use digest::{Sha256Writer, sha256_digest};
pub use layout::OciLayout;
pub use oci_spec::image::{
    Descriptor, Digest, ImageConfiguration, ImageIndex, ImageManifest, MediaType,
};
pub use reference::ImageRef;

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
    #[error("invalid digest {0:?}: expected sha256:<64 lowercase hex>")]
    BadDigest(String),
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

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
