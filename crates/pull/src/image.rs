//! The image as `ferry pull` sees it, without I/O: manifest and config parsing (bounded
//! by the caller), platform selection in an index, chain ids, the snapshot labels of a
//! layer Prepare and the name containerd's image record gets. Pure functions, so the
//! rules containerd depends on (chain ids, label spellings) are unit-tested exactly.

use std::collections::HashMap;

use ferry_oci::media;
use ferry_snapshotter::remote::{
    LABEL_CRI_IMAGE_LAYERS, LABEL_CRI_IMAGE_REF, LABEL_CRI_LAYER_DIGEST, LABEL_CRI_MANIFEST_DIGEST,
    LABEL_FERRY_IMAGE_REF, LABEL_FERRY_LAYER_DIGEST, LABEL_FERRY_LAYER_MEDIA_TYPE,
    LABEL_FERRY_LAYER_SIZE, LABEL_FERRY_MANIFEST_DIGEST, LABEL_TARGET,
};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::PullError;

/// containerd caps a label (key + value) at 4 KiB; the image-layers list is cut to fit.
const MAX_LABEL_LEN: usize = 4096;

/// A content descriptor as manifests carry it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type.
    pub media_type: String,
    /// `sha256:<hex>`.
    pub digest: String,
    /// Size in bytes.
    pub size: u64,
    /// Platform (index entries only).
    #[serde(default)]
    pub platform: Option<Platform>,
    /// Annotations.
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

/// An index entry's platform.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Platform {
    /// e.g. `amd64`.
    pub architecture: String,
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `v8`.
    #[serde(default)]
    pub variant: Option<String>,
}

/// An image manifest (OCI or Docker v2 schema 2).
#[derive(Debug, Clone, Deserialize)]
pub struct ImageManifest {
    /// The config blob.
    pub config: Descriptor,
    /// Layers, base first.
    pub layers: Vec<Descriptor>,
}

/// An image index / manifest list.
#[derive(Debug, Clone, Deserialize)]
pub struct ImageIndex {
    /// One manifest per platform (and possibly attestations).
    pub manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct ConfigDoc {
    rootfs: RootFs,
}

#[derive(Debug, Deserialize)]
struct RootFs {
    diff_ids: Vec<String>,
}

/// Whether a media type is an index (manifest list).
pub fn is_index(media_type: &str) -> bool {
    media_type == media::OCI_INDEX || media_type == media::DOCKER_MANIFEST_LIST
}

/// Whether a media type is an image manifest (OCI or Docker v2 schema 2).
pub fn is_manifest(media_type: &str) -> bool {
    media_type == media::OCI_MANIFEST || media_type == media::DOCKER_MANIFEST
}

/// This machine's architecture in OCI spelling.
pub fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// Picks the manifest for `os`/`arch` from an index: an exact match, else the only
/// image manifest when there is exactly one without a platform.
pub fn select_platform<'a>(
    index: &'a ImageIndex,
    os: &str,
    arch: &str,
) -> Result<&'a Descriptor, PullError> {
    let manifests: Vec<&Descriptor> = index
        .manifests
        .iter()
        .filter(|d| !is_index(&d.media_type))
        .collect();
    if let Some(found) = manifests.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == os && p.architecture == arch)
    }) {
        return Ok(found);
    }
    let unplatformed: Vec<&&Descriptor> =
        manifests.iter().filter(|d| d.platform.is_none()).collect();
    if let [only] = unplatformed.as_slice() {
        return Ok(only);
    }
    let offered: Vec<String> = manifests
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .map(|p| format!("{}/{}", p.os, p.architecture))
        .collect();
    Err(PullError::Image(format!(
        "the image index has no manifest for {os}/{arch} (it offers: {})",
        if offered.is_empty() {
            "none".to_owned()
        } else {
            offered.join(", ")
        }
    )))
}

/// Parses a manifest and checks it is one ferry can pull.
pub fn parse_manifest(bytes: &[u8]) -> Result<ImageManifest, PullError> {
    let manifest: ImageManifest = serde_json::from_slice(bytes)
        .map_err(|e| PullError::Image(format!("image manifest: {e}")))?;
    for layer in &manifest.layers {
        ferry_oci::digest::parse_sha256(&layer.digest)
            .map_err(|e| PullError::Image(format!("layer digest: {e}")))?;
        if media::layer_compression(&layer.media_type).is_none() {
            return Err(PullError::Image(format!(
                "layer {} has media type {:?}, which is not a tar layer ferry can unpack",
                layer.digest, layer.media_type
            )));
        }
    }
    ferry_oci::digest::parse_sha256(&manifest.config.digest)
        .map_err(|e| PullError::Image(format!("config digest: {e}")))?;
    Ok(manifest)
}

/// Parses an index.
pub fn parse_index(bytes: &[u8]) -> Result<ImageIndex, PullError> {
    serde_json::from_slice(bytes).map_err(|e| PullError::Image(format!("image index: {e}")))
}

/// The config's diff ids (uncompressed layer digests), one per layer.
pub fn diff_ids(config: &[u8], layers: usize) -> Result<Vec<String>, PullError> {
    let doc: ConfigDoc = serde_json::from_slice(config)
        .map_err(|e| PullError::Image(format!("image config: {e}")))?;
    if doc.rootfs.diff_ids.len() != layers {
        return Err(PullError::Image(format!(
            "the config lists {} diff ids for {layers} layers",
            doc.rootfs.diff_ids.len()
        )));
    }
    for d in &doc.rootfs.diff_ids {
        ferry_oci::digest::parse_sha256(d)
            .map_err(|e| PullError::Image(format!("config diff id: {e}")))?;
    }
    Ok(doc.rootfs.diff_ids)
}

/// Chain ids (OCI image spec): the first layer's is its diff id; each next one is
/// `sha256(parent_chain_id + " " + diff_id)`.
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for diff_id in diff_ids {
        let next = match out.last() {
            None => diff_id.clone(),
            Some(parent) => {
                let mut h = Sha256::new();
                h.update(parent.as_bytes());
                h.update(b" ");
                h.update(diff_id.as_bytes());
                format!("sha256:{}", hex::encode(h.finalize()))
            }
        };
        out.push(next);
    }
    out
}

/// The image record's name, as `ctr` names a pulled image: `host/repo:tag`,
/// `host/repo@digest`, or `host/repo:tag@digest`.
pub fn image_name(
    registry: &str,
    repository: &str,
    tag: Option<&str>,
    digest: Option<&str>,
) -> String {
    let mut name = format!("{registry}/{repository}");
    if let Some(tag) = tag {
        name.push(':');
        name.push_str(tag);
    }
    if let Some(digest) = digest {
        name.push('@');
        name.push_str(digest);
    }
    name
}

/// containerd's GC label prefix for the manifests (and nested indexes) an index refers to.
pub const LABEL_GC_REF_MANIFEST: &str = "containerd.io/gc.ref.content.m.";

/// The labels an index gets in containerd's content store, as `ctr image pull` sets them:
/// `containerd.io/gc.ref.content.m.<n>` naming each manifest or nested index it lists,
/// numbered in the index's order, so the image record (whose target the index is) keeps
/// them from garbage collection. Other entries (unknown artifact types) get no label.
pub fn index_labels(index: &ImageIndex) -> HashMap<String, String> {
    index
        .manifests
        .iter()
        .filter(|d| is_index(&d.media_type) || is_manifest(&d.media_type))
        .enumerate()
        .map(|(n, d)| (format!("{LABEL_GC_REF_MANIFEST}{n}"), d.digest.clone()))
        .collect()
}

/// What a layer Prepare tells the snapshotter.
#[derive(Debug, Clone, Copy)]
pub struct LayerContext<'a> {
    /// The image record's name.
    pub image_ref: &'a str,
    /// The manifest's digest.
    pub manifest_digest: &'a str,
    /// All layers of the image, base first.
    pub layers: &'a [Descriptor],
    /// All chain ids, base first.
    pub chain_ids: &'a [String],
}

/// The labels of the Prepare for layer `i`: the target chain id, CRI's labels (the only
/// ones containerd passes on to a proxy snapshotter besides the target) and ferry's.
pub fn layer_labels(ctx: &LayerContext<'_>, i: usize) -> HashMap<String, String> {
    let layer = &ctx.layers[i];
    let mut labels = HashMap::new();
    labels.insert(LABEL_TARGET.to_owned(), ctx.chain_ids[i].clone());
    labels.insert(LABEL_CRI_IMAGE_REF.to_owned(), ctx.image_ref.to_owned());
    labels.insert(LABEL_CRI_LAYER_DIGEST.to_owned(), layer.digest.clone());
    labels.insert(
        LABEL_CRI_MANIFEST_DIGEST.to_owned(),
        ctx.manifest_digest.to_owned(),
    );
    let mut following = String::new();
    for d in &ctx.layers[i..] {
        let add = if following.is_empty() {
            d.digest.len()
        } else {
            d.digest.len() + 1
        };
        if LABEL_CRI_IMAGE_LAYERS.len() + following.len() + add > MAX_LABEL_LEN {
            break;
        }
        if !following.is_empty() {
            following.push(',');
        }
        following.push_str(&d.digest);
    }
    labels.insert(LABEL_CRI_IMAGE_LAYERS.to_owned(), following);
    labels.insert(LABEL_FERRY_IMAGE_REF.to_owned(), ctx.image_ref.to_owned());
    labels.insert(LABEL_FERRY_LAYER_DIGEST.to_owned(), layer.digest.clone());
    labels.insert(
        LABEL_FERRY_MANIFEST_DIGEST.to_owned(),
        ctx.manifest_digest.to_owned(),
    );
    labels.insert(
        LABEL_FERRY_LAYER_MEDIA_TYPE.to_owned(),
        layer.media_type.clone(),
    );
    labels.insert(LABEL_FERRY_LAYER_SIZE.to_owned(), layer.size.to_string());
    labels
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const A: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
    const C: &str = "sha256:cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

    #[test]
    fn chain_ids_follow_the_image_spec() {
        let ids = chain_ids(&[A.to_string(), B.to_string(), C.to_string()]);
        assert_eq!(ids[0], A);
        let second = format!(
            "sha256:{}",
            hex::encode(Sha256::digest(format!("{A} {B}").as_bytes()))
        );
        assert_eq!(ids[1], second);
        let third = format!(
            "sha256:{}",
            hex::encode(Sha256::digest(format!("{second} {C}").as_bytes()))
        );
        assert_eq!(ids[2], third);
        assert!(chain_ids(&[]).is_empty());
    }

    fn desc(digest: &str, platform: Option<(&str, &str)>) -> Descriptor {
        Descriptor {
            media_type: media::OCI_MANIFEST.to_owned(),
            digest: digest.to_owned(),
            size: 1,
            platform: platform.map(|(os, arch)| Platform {
                os: os.to_owned(),
                architecture: arch.to_owned(),
                variant: None,
            }),
            annotations: HashMap::new(),
        }
    }

    #[test]
    fn platform_selection_picks_this_os_and_arch() {
        let index = ImageIndex {
            manifests: vec![
                desc(A, Some(("linux", "arm64"))),
                desc(B, Some(("linux", "amd64"))),
                desc(C, Some(("windows", "amd64"))),
            ],
        };
        assert_eq!(select_platform(&index, "linux", "amd64").unwrap().digest, B);
        assert_eq!(select_platform(&index, "linux", "arm64").unwrap().digest, A);
        let err = select_platform(&index, "linux", "s390x")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("linux/s390x") && err.contains("linux/arm64"),
            "{err}"
        );
        let single = ImageIndex {
            manifests: vec![desc(A, None)],
        };
        assert_eq!(
            select_platform(&single, "linux", "amd64").unwrap().digest,
            A
        );
        let parsed = parse_index(
            br#"{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":7,"platform":{"os":"linux","architecture":"amd64"}}]}"#,
        )
        .unwrap();
        assert_eq!(parsed.manifests[0].platform.as_ref().unwrap().os, "linux");
    }

    #[test]
    fn index_labels_name_every_manifest_for_gc() {
        let mut other = desc(C, None);
        other.media_type = "application/vnd.example.sbom+json".into();
        let mut nested = desc(C, None);
        nested.media_type = media::OCI_INDEX.into();
        let mut docker = desc(B, Some(("linux", "arm64")));
        docker.media_type = media::DOCKER_MANIFEST.into();
        let index = ImageIndex {
            manifests: vec![desc(A, Some(("linux", "amd64"))), other, docker, nested],
        };
        let labels = index_labels(&index);
        assert_eq!(labels.len(), 3, "{labels:?}");
        assert_eq!(labels["containerd.io/gc.ref.content.m.0"], A);
        assert_eq!(labels["containerd.io/gc.ref.content.m.1"], B);
        assert_eq!(labels["containerd.io/gc.ref.content.m.2"], C);
        assert!(index_labels(&ImageIndex { manifests: vec![] }).is_empty());
        // Parsed from JSON as a registry serves it.
        let parsed = parse_index(
            format!(
                r#"{{"schemaVersion":2,"mediaType":"{}","manifests":[{{"mediaType":"{}","digest":"{A}","size":7,"platform":{{"os":"linux","architecture":"amd64"}}}},{{"mediaType":"{}","digest":"{B}","size":9,"platform":{{"os":"linux","architecture":"arm64"}}}}]}}"#,
                media::OCI_INDEX,
                media::OCI_MANIFEST,
                media::OCI_MANIFEST
            )
            .as_bytes(),
        )
        .unwrap();
        let labels = index_labels(&parsed);
        assert_eq!(labels["containerd.io/gc.ref.content.m.0"], A);
        assert_eq!(labels["containerd.io/gc.ref.content.m.1"], B);
    }

    #[test]
    fn manifests_and_configs_are_checked() {
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"{}","digest":"{A}","size":2}},"layers":[{{"mediaType":"{}","digest":"{B}","size":3}}]}}"#,
            media::OCI_CONFIG,
            media::LAYER_TAR_GZIP
        );
        let m = parse_manifest(manifest.as_bytes()).unwrap();
        assert_eq!(m.layers[0].digest, B);
        let bad_type = manifest.replace(media::LAYER_TAR_GZIP, "application/x-foo");
        assert!(parse_manifest(bad_type.as_bytes()).is_err());
        assert!(parse_manifest(b"{").is_err());
        let config = format!(r#"{{"rootfs":{{"type":"layers","diff_ids":["{C}"]}}}}"#);
        assert_eq!(diff_ids(config.as_bytes(), 1).unwrap(), vec![C.to_string()]);
        assert!(
            diff_ids(config.as_bytes(), 2).is_err(),
            "count must match the layers"
        );
        assert!(diff_ids(br#"{"rootfs":{"diff_ids":["md5:x"]}}"#, 1).is_err());
    }

    #[test]
    fn image_names_match_ctr() {
        assert_eq!(
            image_name("127.0.0.1:5000", "app/small", Some("v1"), None),
            "127.0.0.1:5000/app/small:v1"
        );
        assert_eq!(
            image_name("docker.io", "library/debian", None, Some(A)),
            format!("docker.io/library/debian@{A}")
        );
        assert_eq!(
            image_name("r", "x", Some("t"), Some(A)),
            format!("r/x:t@{A}")
        );
    }

    #[test]
    fn layer_labels_carry_target_cri_and_ferry_fields() {
        let layers = vec![
            Descriptor {
                media_type: media::LAYER_TAR_GZIP.into(),
                ..desc(A, None)
            },
            Descriptor {
                media_type: media::LAYER_TAR_GZIP.into(),
                size: 42,
                ..desc(B, None)
            },
        ];
        let chains = chain_ids(&[C.to_string(), A.to_string()]);
        let ctx = LayerContext {
            image_ref: "r/x:t",
            manifest_digest: C,
            layers: &layers,
            chain_ids: &chains,
        };
        let l = layer_labels(&ctx, 1);
        assert_eq!(l[LABEL_TARGET], chains[1]);
        assert_eq!(l[LABEL_CRI_LAYER_DIGEST], B);
        assert_eq!(l[LABEL_CRI_IMAGE_REF], "r/x:t");
        assert_eq!(l[LABEL_CRI_MANIFEST_DIGEST], C);
        assert_eq!(
            l[LABEL_CRI_IMAGE_LAYERS], B,
            "this and the following layers"
        );
        assert_eq!(
            layer_labels(&ctx, 0)[LABEL_CRI_IMAGE_LAYERS],
            format!("{A},{B}")
        );
        assert_eq!(l[LABEL_FERRY_LAYER_SIZE], "42");
        assert_eq!(l[LABEL_FERRY_LAYER_MEDIA_TYPE], media::LAYER_TAR_GZIP);
        assert_eq!(l[LABEL_FERRY_LAYER_DIGEST], B);
        // What the snapshotter parses out of them.
        let parsed = ferry_snapshotter::LayerLabels::parse(&l).unwrap();
        assert_eq!(parsed.target, chains[1]);
        assert_eq!(parsed.layer_digest.as_deref(), Some(B));
        // A long image keeps the image-layers label under containerd's 4 KiB.
        let many: Vec<Descriptor> = (0..100).map(|_| desc(A, None)).collect();
        let chains: Vec<String> = (0..100).map(|_| A.to_string()).collect();
        let ctx = LayerContext {
            layers: &many,
            chain_ids: &chains,
            ..ctx
        };
        let l = layer_labels(&ctx, 0);
        assert!(LABEL_CRI_IMAGE_LAYERS.len() + l[LABEL_CRI_IMAGE_LAYERS].len() <= 4096);
    }
}
