//! Platforms and the one rule for choosing a platform's manifest from an image index.
//!
//! Matching follows containerd's: both sides are normalised first (`x86_64` → `amd64`,
//! `aarch64` → `arm64`, arm64 without a variant is `v8`, arm without one is `v7`, amd64
//! `v1` is no variant), then os and architecture must be equal. The variant must be
//! equal too, except that an older arm or amd64 variant runs on a newer CPU (`arm/v6`
//! on a `v7` host, `amd64` on `amd64/v3`); the closest one wins. Attestation manifests
//! (the `vnd.docker.reference.type` annotation) are never chosen. Nothing falls back to
//! "the first manifest": a mount of the wrong architecture is an error that names what
//! the index has.

use std::fmt;
use std::str::FromStr;

use crate::{Descriptor, Error, ImageIndex, Result};

/// The annotation BuildKit puts on attestation manifests (SBOM, provenance) in an index.
pub const ATTESTATION_ANNOTATION: &str = "vnd.docker.reference.type";

/// Longest `os/arch/variant` text accepted.
const MAX_PLATFORM_LEN: usize = 64;

/// An operating system, CPU architecture and optional variant, normalised as containerd
/// normalises them (so two spellings of one platform compare equal).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Platform {
    os: String,
    architecture: String,
    variant: Option<String>,
}

impl Platform {
    /// A platform from its parts, normalised.
    pub fn new(os: &str, architecture: &str, variant: Option<&str>) -> Self {
        let os = match os.to_ascii_lowercase().as_str() {
            "macos" => "darwin".to_string(),
            other => other.to_string(),
        };
        let arch = architecture.to_ascii_lowercase();
        let variant = variant
            .filter(|v| !v.is_empty())
            .map(str::to_ascii_lowercase);
        let (architecture, variant) = match (arch.as_str(), variant.as_deref()) {
            ("x86_64" | "x86-64" | "amd64", None | Some("v1")) => ("amd64", None),
            ("x86_64" | "x86-64" | "amd64", Some(v)) => ("amd64", Some(v.to_string())),
            ("i386" | "i686" | "x86" | "386", v) => ("386", v.map(str::to_string)),
            ("aarch64" | "arm64", None | Some("8" | "v8" | "v8.0")) => {
                ("arm64", Some("v8".to_string()))
            }
            ("aarch64" | "arm64", Some(v)) => ("arm64", Some(v.to_string())),
            ("armhf", _) => ("arm", Some("v7".to_string())),
            ("armel", _) => ("arm", Some("v6".to_string())),
            ("arm", None | Some("7" | "v7")) => ("arm", Some("v7".to_string())),
            ("arm", Some(v @ ("5" | "6" | "8"))) => ("arm", Some(format!("v{v}"))),
            ("arm", Some(v)) => ("arm", Some(v.to_string())),
            (other, v) => (other, v.map(str::to_string)),
        };
        Platform {
            os,
            architecture: architecture.to_string(),
            variant,
        }
    }

    /// This machine's platform as containerd names it: linux, the architecture of
    /// `std::env::consts::ARCH` in OCI spelling (arm64 as `v8`; 32-bit arm as `v7`, the
    /// variant containerd assumes when it cannot tell).
    pub fn host() -> Self {
        Platform::new(std::env::consts::OS, host_arch(), None)
    }

    /// Parses `os/arch[/variant]` (a `--platform` argument).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |reason| Error::BadPlatform {
            input: crate::shown(s),
            reason,
        };
        if s.len() > MAX_PLATFORM_LEN {
            return Err(bad("longer than 64 characters"));
        }
        let parts: Vec<&str> = s.split('/').collect();
        if !(2..=3).contains(&parts.len()) {
            return Err(bad("expected os/arch or os/arch/variant"));
        }
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        };
        if !parts.iter().all(|p| part_ok(p)) {
            return Err(bad("each part must be letters, digits, '.', '_' or '-'"));
        }
        let p = Platform::new(parts[0], parts[1], parts.get(2).copied());
        // Normalising may add a variant (`arm64` -> `arm64/v8`): the bound holds for the
        // printed form too, so whatever parses prints to text that parses again.
        if p.to_string().len() > MAX_PLATFORM_LEN {
            return Err(bad("longer than 64 characters once normalised"));
        }
        Ok(p)
    }

    /// The platform an index entry declares, normalised.
    pub fn of_spec(p: &oci_spec::image::Platform) -> Self {
        Platform::new(
            &p.os().to_string(),
            &p.architecture().to_string(),
            p.variant().as_deref(),
        )
    }

    /// The operating system (`linux`).
    pub fn os(&self) -> &str {
        &self.os
    }

    /// The architecture in OCI (GOARCH) spelling (`amd64`, `arm64`).
    pub fn architecture(&self) -> &str {
        &self.architecture
    }

    /// The variant (`v8`, `v7`), if any.
    pub fn variant(&self) -> Option<&str> {
        self.variant.as_deref()
    }

    /// How well an image built for `candidate` runs here: `Some(0)` for the same
    /// platform, `Some(n)` for a variant `n` generations older, `None` when it does not
    /// run at all.
    pub fn distance(&self, candidate: &Platform) -> Option<u32> {
        if self.os != candidate.os || self.architecture != candidate.architecture {
            return None;
        }
        if self.variant == candidate.variant {
            return Some(0);
        }
        // Older arm and amd64 levels run on newer CPUs (containerd's platform vector).
        let level = |v: Option<&str>| -> Option<u32> {
            match (self.architecture.as_str(), v) {
                ("amd64", None) => Some(1),
                ("amd64" | "arm", Some(v)) => v.strip_prefix('v')?.parse().ok(),
                _ => None,
            }
        };
        let (want, have) = (level(self.variant())?, level(candidate.variant())?);
        let floor = if self.architecture == "arm" { 5 } else { 1 };
        (have < want && have >= floor).then(|| want - have)
    }
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "powerpc64" => "ppc64",
        "riscv64" => "riscv64",
        "loongarch64" => "loong64",
        other => other,
    }
}

impl Default for Platform {
    fn default() -> Self {
        Platform::host()
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

impl FromStr for Platform {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Platform::parse(s)
    }
}

/// `a, b, c`, or `no platform-specific manifests` (for [`Error::NoPlatform`]).
pub(crate) fn list(platforms: &[Platform]) -> String {
    if platforms.is_empty() {
        return "no platform-specific manifests".to_string();
    }
    platforms
        .iter()
        .map(Platform::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether an index entry is an attestation (SBOM, provenance), never an image to run.
pub fn is_attestation(d: &Descriptor) -> bool {
    d.annotations()
        .as_ref()
        .is_some_and(|a| a.contains_key(ATTESTATION_ANNOTATION))
}

/// The manifest of `index` for `want` (see the module doc for the rules). An index whose
/// entries declare no platform at all and hold exactly one image manifest yields that
/// one; otherwise an entry without a platform is never chosen.
pub fn choose_manifest<'a>(index: &'a ImageIndex, want: &Platform) -> Result<&'a Descriptor> {
    let images: Vec<&Descriptor> = index
        .manifests()
        .iter()
        .filter(|d| !is_attestation(d))
        .collect();
    let declared: Vec<(&Descriptor, Platform)> = images
        .iter()
        .filter_map(|d| d.platform().as_ref().map(|p| (*d, Platform::of_spec(p))))
        .collect();
    // The closest match; the first in index order among equals.
    let best = declared
        .iter()
        .filter_map(|(d, p)| want.distance(p).map(|n| (n, *d)))
        .min_by_key(|(n, _)| *n);
    if let Some((_, d)) = best {
        return Ok(d);
    }
    if declared.is_empty()
        && let [only] = images.as_slice()
    {
        return Ok(only);
    }
    Err(Error::NoPlatform {
        wanted: want.clone(),
        available: declared.into_iter().map(|(_, p)| p).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_parses_prints_to_text_that_parses_again() {
        // Found by fuzzing: 62 characters, 65 once `arm64` gained its `v8`.
        let long = format!("{}/arm64", "a".repeat(56));
        assert!(Platform::parse(&long).is_err());
        let p = Platform::parse("linux/arm64").expect("parses");
        assert_eq!(Platform::parse(&p.to_string()).ok(), Some(p));
    }

    fn digest(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn entry(c: char, platform: Option<&str>, attestation: bool) -> serde_json::Value {
        let mut e = serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(c),
            "size": 100,
        });
        if let Some(p) = platform {
            let parts: Vec<&str> = p.split('/').collect();
            let mut pj = serde_json::json!({"os": parts[0], "architecture": parts[1]});
            if let Some(v) = parts.get(2) {
                pj["variant"] = serde_json::json!(v);
            }
            e["platform"] = pj;
        }
        if attestation {
            e["annotations"] = serde_json::json!({
                ATTESTATION_ANNOTATION: "attestation-manifest",
                "vnd.docker.reference.digest": digest('a'),
            });
        }
        e
    }

    fn index(entries: Vec<serde_json::Value>) -> ImageIndex {
        let doc = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": entries,
        });
        serde_json::from_value(doc).expect("test index parses")
    }

    /// What docker hub serves for a multi-arch image with BuildKit attestations.
    fn multi_arch() -> ImageIndex {
        index(vec![
            entry('a', Some("linux/amd64"), false),
            entry('b', Some("linux/arm64/v8"), false),
            entry('c', Some("linux/arm/v7"), false),
            entry('d', Some("linux/arm/v6"), false),
            entry('e', Some("linux/s390x"), false),
            entry('f', Some("unknown/unknown"), true),
            entry('9', None, true),
        ])
    }

    fn chosen(index: &ImageIndex, want: &str) -> Result<String> {
        Ok(choose_manifest(index, &Platform::parse(want)?)?
            .digest()
            .to_string())
    }

    #[test]
    fn chooses_each_platform_of_a_multi_arch_index() -> Result<()> {
        let idx = multi_arch();
        assert_eq!(chosen(&idx, "linux/amd64")?, digest('a'));
        assert_eq!(chosen(&idx, "linux/x86_64")?, digest('a'));
        assert_eq!(chosen(&idx, "linux/arm64")?, digest('b'), "arm64 means v8");
        assert_eq!(chosen(&idx, "linux/arm64/v8")?, digest('b'));
        assert_eq!(chosen(&idx, "linux/aarch64")?, digest('b'));
        assert_eq!(chosen(&idx, "linux/arm/v7")?, digest('c'));
        assert_eq!(chosen(&idx, "linux/arm")?, digest('c'), "arm means v7");
        assert_eq!(chosen(&idx, "linux/arm/v6")?, digest('d'));
        assert_eq!(chosen(&idx, "linux/s390x")?, digest('e'));
        Ok(())
    }

    #[test]
    fn arm64_without_a_variant_in_the_index_matches_v8() -> Result<()> {
        let idx = index(vec![
            entry('a', Some("linux/amd64"), false),
            entry('b', Some("linux/arm64"), false),
        ]);
        assert_eq!(chosen(&idx, "linux/arm64/v8")?, digest('b'));
        assert_eq!(chosen(&idx, "linux/arm64")?, digest('b'));
        Ok(())
    }

    #[test]
    fn older_variants_run_but_exact_ones_win() -> Result<()> {
        let idx = index(vec![
            entry('a', Some("linux/arm/v5"), false),
            entry('b', Some("linux/arm/v6"), false),
        ]);
        assert_eq!(chosen(&idx, "linux/arm/v7")?, digest('b'), "closest older");
        assert_eq!(chosen(&idx, "linux/arm/v5")?, digest('a'));
        let idx = index(vec![
            entry('a', Some("linux/amd64"), false),
            entry('b', Some("linux/amd64/v3"), false),
        ]);
        assert_eq!(chosen(&idx, "linux/amd64/v3")?, digest('b'));
        assert_eq!(chosen(&idx, "linux/amd64/v2")?, digest('a'));
        assert_eq!(chosen(&idx, "linux/amd64")?, digest('a'));
        // A newer variant never runs on an older CPU.
        let idx = index(vec![entry('a', Some("linux/arm/v7"), false)]);
        assert!(chosen(&idx, "linux/arm/v6").is_err());
        Ok(())
    }

    #[test]
    fn a_missing_platform_is_an_error_naming_what_the_index_has() {
        let idx = index(vec![
            entry('a', Some("linux/amd64"), false),
            entry('e', Some("linux/s390x"), false),
            entry('f', Some("unknown/unknown"), true),
        ]);
        let Err(err) = chosen(&idx, "linux/arm64") else {
            panic!("linux/arm64 is not in the index");
        };
        assert_eq!(
            err.to_string(),
            "no manifest for linux/arm64/v8 in the index; it has linux/amd64, linux/s390x"
        );
        assert!(matches!(err, Error::NoPlatform { .. }));
        let Err(err) = chosen(&idx, "windows/amd64") else {
            panic!("windows/amd64 is not in the index");
        };
        assert!(err.to_string().contains("windows/amd64"), "{err}");
    }

    #[test]
    fn attestations_and_unplatformed_entries_are_never_chosen() {
        // Only attestations: nothing to run.
        let idx = index(vec![
            entry('f', Some("unknown/unknown"), true),
            entry('9', None, true),
        ]);
        assert!(chosen(&idx, "linux/amd64").is_err());
        // An unplatformed entry beside platform entries is not a fallback.
        let idx = index(vec![
            entry('a', Some("linux/s390x"), false),
            entry('b', None, false),
        ]);
        assert!(chosen(&idx, "linux/amd64").is_err());
        // Two unplatformed manifests: no way to tell.
        let idx = index(vec![entry('a', None, false), entry('b', None, false)]);
        assert!(chosen(&idx, "linux/amd64").is_err());
    }

    #[test]
    fn an_index_that_declares_no_platform_yields_its_one_manifest() -> Result<()> {
        let idx = index(vec![entry('a', None, false), entry('f', None, true)]);
        assert_eq!(chosen(&idx, "linux/arm64")?, digest('a'));
        Ok(())
    }

    #[test]
    fn parses_and_prints_platforms() -> Result<()> {
        assert_eq!(Platform::parse("linux/amd64")?.to_string(), "linux/amd64");
        assert_eq!(
            Platform::parse("linux/arm64")?.to_string(),
            "linux/arm64/v8"
        );
        assert_eq!(Platform::parse("Linux/ARM/7")?.to_string(), "linux/arm/v7");
        assert_eq!(
            Platform::parse("linux/amd64/v1")?.to_string(),
            "linux/amd64"
        );
        assert_eq!(
            Platform::parse("linux/arm64/v8")?,
            Platform::new("linux", "aarch64", None)
        );
        for bad in [
            "",
            "linux",
            "linux/",
            "/amd64",
            "a/b/c/d",
            "linux/am d64",
            "l/a/v/",
        ] {
            assert!(Platform::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Platform::parse(&format!("linux/{}", "a".repeat(80))).is_err());
        Ok(())
    }

    #[test]
    fn the_host_platform_is_in_oci_spelling() {
        let host = Platform::host();
        assert_eq!(host.os(), "linux");
        match std::env::consts::ARCH {
            "x86_64" => assert_eq!(host.to_string(), "linux/amd64"),
            "aarch64" => assert_eq!(host.to_string(), "linux/arm64/v8"),
            _ => assert_ne!(host.architecture(), ""),
        }
    }
}
