//! Image references in skopeo's spelling.
//!
//! * `oci:DIR[:TAG]` — an OCI image layout on disk (TAG defaults to `latest`; `oci:DIR@sha256:…`
//!   names a manifest by digest).
//! * `[docker://]HOST[:PORT]/REPO[:TAG|@DIGEST]` — a registry. A name without a registry
//!   host (`library/debian`) gets `docker.io`, as docker and containerd do.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::{Digest, Error, Result};

/// Where an image lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// An OCI image layout directory.
    Layout {
        /// The layout directory.
        dir: PathBuf,
        /// Tag (`org.opencontainers.image.ref.name`) or sha256 digest.
        reference: Reference,
    },
    /// A repository in a registry.
    Registry {
        /// `host[:port]`.
        registry: String,
        /// Repository path, e.g. `library/debian`.
        repository: RepositoryName,
        /// Tag, when given (`latest` when neither tag nor digest is).
        tag: Option<Tag>,
        /// Manifest digest (sha256), when given.
        digest: Option<Digest>,
    },
}

const MAX_REF_LEN: usize = 4096;

impl ImageRef {
    /// Parses a reference.
    pub fn parse(input: &str) -> Result<Self> {
        let bad = |reason: &str| Error::BadReference {
            input: crate::shown(input),
            reason: reason.to_string(),
        };
        if input.is_empty() || input.len() > MAX_REF_LEN {
            return Err(bad("empty or longer than 4096 characters"));
        }
        if let Some(rest) = input.strip_prefix("oci:") {
            return Self::parse_layout(rest).map_err(|r| bad(&r));
        }
        let rest = input.strip_prefix("docker://").unwrap_or(input);
        Self::parse_registry(rest).map_err(|r| bad(&r))
    }

    fn parse_layout(rest: &str) -> std::result::Result<Self, String> {
        if rest.is_empty() {
            return Err("oci: needs a directory, as in oci:DIR:TAG".into());
        }
        if let Some((dir, digest)) = rest.rsplit_once('@') {
            let digest = crate::digest::parse_sha256(digest).map_err(|e| e.to_string())?;
            return Ok(ImageRef::Layout {
                dir: PathBuf::from(dir),
                reference: Reference::Digest(digest),
            });
        }
        // The tag is after the last ':' unless that ':' is part of the path (a '/' follows).
        let (dir, tag) = match rest.rsplit_once(':') {
            Some((dir, tag)) if !tag.contains('/') && !dir.is_empty() => (dir, tag),
            _ => (rest, "latest"),
        };
        if tag.is_empty() {
            return Err("empty tag after ':'".into());
        }
        let tag = Tag::parse(tag).map_err(|e| e.to_string())?;
        Ok(ImageRef::Layout {
            dir: PathBuf::from(dir),
            reference: Reference::Tag(tag),
        })
    }

    fn parse_registry(rest: &str) -> std::result::Result<Self, String> {
        let (name, digest) = match rest.split_once('@') {
            Some((name, d)) => (
                name,
                Some(crate::digest::parse_sha256(d).map_err(|e| e.to_string())?),
            ),
            None => (rest, None),
        };
        // A tag follows the last ':' after the last '/'.
        let last_slash = name.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match name[last_slash..].rfind(':') {
            Some(i) => {
                let tag = Tag::parse(&name[last_slash + i + 1..]).map_err(|e| e.to_string())?;
                (&name[..last_slash + i], Some(tag))
            }
            None => (name, None),
        };
        let (registry, repository) = match name.split_once('/') {
            Some((first, repo))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_string(), repo.to_string())
            }
            Some(_) => ("docker.io".to_string(), name.to_string()),
            None => ("docker.io".to_string(), format!("library/{name}")),
        };
        let repository = RepositoryName::parse(&repository).map_err(|e| e.to_string())?;
        let tag = if tag.is_none() && digest.is_none() {
            Some(Tag::latest())
        } else {
            tag
        };
        Ok(ImageRef::Registry {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The tag or digest a reference resolves (`latest` by default).
    pub fn reference(&self) -> &str {
        match self {
            ImageRef::Layout { reference, .. } => reference.as_str(),
            ImageRef::Registry { tag, digest, .. } => digest
                .as_ref()
                .map(|d| d.as_ref())
                .or(tag.as_ref().map(Tag::as_str))
                .unwrap_or("latest"),
        }
    }
}

/// Longest repository name accepted: the distribution spec's grammar has no bound of its
/// own, and 255 is what registries and clients enforce.
pub const MAX_REPOSITORY_LEN: usize = 255;

/// Longest tag: the grammar's `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub const MAX_TAG_LEN: usize = 128;

/// A repository name in the distribution spec's grammar, checked once where it arrives:
/// components `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*` separated by `/`, at most
/// [`MAX_REPOSITORY_LEN`] bytes. A valid name is always a safe relative path (no empty,
/// `.` or `..` component, nothing but `[a-z0-9._/-]`).
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct RepositoryName(String);

impl RepositoryName {
    /// Parses a repository name (ferry's one validator for them).
    pub fn parse(s: &str) -> Result<Self> {
        match repository_rule_broken(s) {
            None => Ok(RepositoryName(s.to_string())),
            Some(reason) => Err(Error::BadName {
                what: "repository name",
                input: crate::shown(s),
                reason,
            }),
        }
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Which rule of the repository grammar `s` breaks, if any.
fn repository_rule_broken(s: &str) -> Option<&'static str> {
    if s.is_empty() {
        return Some("empty");
    }
    if s.len() > MAX_REPOSITORY_LEN {
        return Some("longer than 255 characters");
    }
    if s.split('/').all(component_ok) {
        None
    } else {
        Some("components must be [a-z0-9]+ joined by '.', '_', '__' or '-'s, separated by '/'")
    }
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`.
fn component_ok(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if b.is_empty() || !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &b[start..i];
        if !(sep == b"." || sep == b"_" || sep == b"__" || sep.iter().all(|&x| x == b'-')) {
            return false;
        }
    }
    true
}

/// A tag in the distribution spec's grammar `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`, checked
/// once where it arrives. A valid tag is always one safe path component.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct Tag(String);

impl Tag {
    /// Parses a tag (ferry's one validator for them).
    pub fn parse(s: &str) -> Result<Self> {
        let mut bytes = s.bytes();
        let reason = if s.is_empty() {
            Some("empty")
        } else if s.len() > MAX_TAG_LEN {
            Some("longer than 128 characters")
        } else if !bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            Some("must start with a letter, digit or '_'")
        } else if !bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
            Some("only letters, digits, '.', '_' and '-' may follow")
        } else {
            None
        };
        match reason {
            None => Ok(Tag(s.to_string())),
            Some(reason) => Err(Error::BadName {
                what: "tag",
                input: crate::shown(s),
                reason,
            }),
        }
    }

    /// The tag as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `latest`, the tag a reference without tag or digest means.
    pub fn latest() -> Self {
        Tag("latest".to_string())
    }
}

/// What a manifest is asked for by: a tag or a digest (as in `/v2/NAME/manifests/REF`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reference {
    /// A tag.
    Tag(Tag),
    /// A digest (any algorithm the grammar allows; stores accept only sha256).
    Digest(Digest),
}

impl Reference {
    /// Parses a tag or a digest: a `:` makes it a digest, since no tag may contain one.
    pub fn parse(s: &str) -> Result<Self> {
        if crate::digest::is_digest_reference(s) {
            crate::digest::parse(s).map(Reference::Digest)
        } else {
            Tag::parse(s).map(Reference::Tag)
        }
    }

    /// The reference as text.
    pub fn as_str(&self) -> &str {
        match self {
            Reference::Tag(t) => t.as_str(),
            Reference::Digest(d) => d.as_ref(),
        }
    }
}

macro_rules! text_impls {
    ($t:ty) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl AsRef<str> for $t {
            fn as_ref(&self) -> &str {
                self.as_str()
            }
        }
        impl FromStr for $t {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                Self::parse(s)
            }
        }
        impl PartialEq<str> for $t {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other
            }
        }
        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}
text_impls!(RepositoryName);
text_impls!(Tag);
text_impls!(Reference);

// A validated name is a string everywhere a string is read (paths, keys, URLs), so typed
// values pass through code that only reads them without conversions at every use.
impl std::ops::Deref for RepositoryName {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Tag {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for RepositoryName {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        match repository_rule_broken(&s) {
            None => Ok(RepositoryName(s)),
            Some(_) => Self::parse(&s),
        }
    }
}

impl From<RepositoryName> for String {
    fn from(n: RepositoryName) -> String {
        n.0
    }
}

impl TryFrom<String> for Tag {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        Self::parse(&s)
    }
}

impl From<Tag> for String {
    fn from(t: Tag) -> String {
        t.0
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Layout {
                dir,
                reference: Reference::Digest(d),
            } => write!(f, "oci:{}@{d}", dir.display()),
            ImageRef::Layout { dir, reference } => write!(f, "oci:{}:{reference}", dir.display()),
            ImageRef::Registry {
                registry,
                repository,
                tag,
                digest,
            } => {
                write!(f, "{registry}/{repository}")?;
                if let Some(t) = tag {
                    write!(f, ":{t}")?;
                }
                if let Some(d) = digest {
                    write!(f, "@{d}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dir: &str, r: &str) -> ImageRef {
        ImageRef::Layout {
            dir: PathBuf::from(dir),
            reference: Reference::parse(r).expect("test reference"),
        }
    }

    #[test]
    fn parses_layouts() -> Result<()> {
        assert_eq!(
            ImageRef::parse("oci:/tmp/img:v1")?,
            layout("/tmp/img", "v1")
        );
        assert_eq!(ImageRef::parse("oci:img")?, layout("img", "latest"));
        assert_eq!(ImageRef::parse("oci:./a:b/c")?, layout("./a:b/c", "latest"));
        let d = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(ImageRef::parse(&format!("oci:img@{d}"))?, layout("img", d));
        assert!(ImageRef::parse("oci:").is_err());
        assert!(ImageRef::parse("oci:img:").is_err());
        Ok(())
    }

    #[test]
    fn parses_registry_refs() -> Result<()> {
        let r = ImageRef::parse("127.0.0.1:5000/team/app:1.2")?;
        assert_eq!(
            r,
            ImageRef::Registry {
                registry: "127.0.0.1:5000".into(),
                repository: RepositoryName::parse("team/app")?,
                tag: Some(Tag::parse("1.2")?),
                digest: None
            }
        );
        let r = ImageRef::parse("docker://localhost/app")?;
        assert_eq!(r.reference(), "latest");
        let r = ImageRef::parse("debian")?;
        assert_eq!(r.to_string(), "docker.io/library/debian:latest");
        assert!(ImageRef::parse("host:5000/UPPER:tag").is_err());
        assert!(ImageRef::parse("host:5000/a/../b").is_err());
        assert!(ImageRef::parse("host:5000/app@sha256:zz").is_err());
        Ok(())
    }

    #[test]
    fn repository_names_follow_the_grammar() {
        for ok in [
            "a",
            "library/debian",
            "a0/b-c/d.e/f_g/h__i/j---k",
            "x/y/z/0/9",
            &"a".repeat(255),
        ] {
            assert!(RepositoryName::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "A",
            "a/",
            "/a",
            "a//b",
            "a/../b",
            "..",
            ".",
            "a..b",
            "a___b",
            "a_-b",
            "a.-b",
            "-a",
            "a-",
            "a_",
            "a%2fb",
            "a b",
            "é",
            &"a".repeat(256),
        ] {
            assert!(RepositoryName::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tags_follow_the_grammar() {
        for ok in ["latest", "v1.0_rc-1", "_x", "0", "A.B", &"t".repeat(128)] {
            assert!(Tag::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "-x", "a:b", "a/b", "a b", &"t".repeat(129)] {
            assert!(Tag::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn references_are_tags_or_digests() -> Result<()> {
        assert!(matches!(Reference::parse("v1")?, Reference::Tag(_)));
        let d = format!("sha256:{}", "a".repeat(64));
        assert!(matches!(Reference::parse(&d)?, Reference::Digest(_)));
        assert_eq!(Reference::parse(&d)?.as_str(), d);
        assert!(Reference::parse("sha256:abc").is_err());
        assert!(Reference::parse(".x").is_err());
        Ok(())
    }

    #[test]
    fn typed_names_round_trip_through_serde() -> std::result::Result<(), serde_json::Error> {
        let n: RepositoryName = serde_json::from_str("\"a/b\"")?;
        assert_eq!(serde_json::to_string(&n)?, "\"a/b\"");
        assert!(serde_json::from_str::<RepositoryName>("\"A/b\"").is_err());
        assert!(serde_json::from_str::<Tag>("\".x\"").is_err());
        Ok(())
    }
}
