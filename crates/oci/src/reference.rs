//! Image references in skopeo's spelling.
//!
//! * `oci:DIR[:TAG]` — an OCI image layout on disk (TAG defaults to `latest`; `oci:DIR@sha256:…`
//!   names a manifest by digest).
//! * `[docker://]HOST[:PORT]/REPO[:TAG|@DIGEST]` — a registry. A name without a registry
//!   host (`library/debian`) gets `docker.io`, as docker and containerd do.

use std::fmt;
use std::path::PathBuf;

use crate::{Error, Result};

/// Where an image lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// An OCI image layout directory.
    Layout {
        /// The layout directory.
        dir: PathBuf,
        /// Tag (`org.opencontainers.image.ref.name`) or `sha256:` digest.
        reference: String,
    },
    /// A repository in a registry.
    Registry {
        /// `host[:port]`.
        registry: String,
        /// Repository path, e.g. `library/debian`.
        repository: String,
        /// Tag, when given (`latest` when neither tag nor digest is).
        tag: Option<String>,
        /// Manifest digest, when given.
        digest: Option<String>,
    },
}

const MAX_REF_LEN: usize = 4096;

impl ImageRef {
    /// Parses a reference.
    pub fn parse(input: &str) -> Result<Self> {
        let bad = |reason: &str| Error::BadReference {
            input: input.to_string(),
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
            crate::digest::parse_sha256(digest).map_err(|e| e.to_string())?;
            return Ok(ImageRef::Layout {
                dir: PathBuf::from(dir),
                reference: digest.to_string(),
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
        validate_tag(tag)?;
        Ok(ImageRef::Layout {
            dir: PathBuf::from(dir),
            reference: tag.to_string(),
        })
    }

    fn parse_registry(rest: &str) -> std::result::Result<Self, String> {
        let (name, digest) = match rest.split_once('@') {
            Some((name, d)) => {
                crate::digest::parse_sha256(d).map_err(|e| e.to_string())?;
                (name, Some(d.to_string()))
            }
            None => (rest, None),
        };
        // A tag follows the last ':' after the last '/'.
        let last_slash = name.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match name[last_slash..].rfind(':') {
            Some(i) => {
                let tag = &name[last_slash + i + 1..];
                validate_tag(tag)?;
                (&name[..last_slash + i], Some(tag.to_string()))
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
        validate_repository(&repository)?;
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".to_string())
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

    /// The tag or digest a registry reference resolves (`latest` by default).
    pub fn reference(&self) -> &str {
        match self {
            ImageRef::Layout { reference, .. } => reference,
            ImageRef::Registry { tag, digest, .. } => {
                digest.as_deref().or(tag.as_deref()).unwrap_or("latest")
            }
        }
    }
}

/// Checks a tag against the distribution spec's grammar `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn validate_tag(tag: &str) -> std::result::Result<(), String> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_alphanumeric() || b == b'_' || (i > 0 && (b == b'.' || b == b'-'))
        });
    if ok {
        Ok(())
    } else {
        Err(format!("invalid tag {tag:?}"))
    }
}

/// Checks a repository name against the distribution spec's grammar: lowercase
/// alphanumeric components separated by `/`, each joined by `.`, `_`, `__` or `-`.
pub fn validate_repository(repo: &str) -> std::result::Result<(), String> {
    let component_ok = |c: &str| {
        !c.is_empty()
            && c.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'_' || b == b'-'
            })
            && c.as_bytes()
                .first()
                .is_some_and(|b| b.is_ascii_alphanumeric())
            && c.as_bytes()
                .last()
                .is_some_and(|b| b.is_ascii_alphanumeric())
    };
    if repo.len() > 255 || !repo.split('/').all(component_ok) {
        return Err(format!("invalid repository name {repo:?}"));
    }
    Ok(())
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Layout { dir, reference } if reference.starts_with("sha256:") => {
                write!(f, "oci:{}@{reference}", dir.display())
            }
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
            reference: r.to_string(),
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
                repository: "team/app".into(),
                tag: Some("1.2".into()),
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
}
