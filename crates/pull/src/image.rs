//! The image as `ferry pull` sees it, without I/O: manifest, index and config parsing
//! (bounded by the caller; manifests, indexes and descriptors are oci-spec's types, whose
//! digests are validated as they are read, and the platform in an index is chosen by
//! [`ferry_oci::choose_manifest`]), chain ids, the snapshot labels of a
//! layer Prepare and the name containerd's image record gets. Pure functions, so the
//! rules containerd depends on (chain ids, label spellings) are unit-tested exactly.

use std::collections::HashMap;

pub use ferry_oci::{Descriptor, ImageManifest};
use ferry_oci::{ImageIndex, Platform, media};
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

/// The manifest of `index` for `platform` (ferry-oci's one chooser), as the digest to
/// fetch it by.
pub fn select_platform(index: &ImageIndex, platform: &Platform) -> Result<String, PullError> {
    let chosen =
        ferry_oci::choose_manifest(index, platform).map_err(|e| PullError::Image(e.to_string()))?;
    if !is_manifest(chosen.media_type().as_ref()) {
        return Err(PullError::Image(format!(
            "the index's entry for {platform} ({}) has media type {}, not an image manifest",
            chosen.digest(),
            chosen.media_type()
        )));
    }
    Ok(chosen.digest().to_string())
}

/// Parses a manifest and checks it is one ferry can pull.
pub fn parse_manifest(bytes: &[u8]) -> Result<ImageManifest, PullError> {
    let manifest: ImageManifest = serde_json::from_slice(bytes)
        .map_err(|e| PullError::Image(format!("image manifest: {e}")))?;
    // oci-spec has checked each digest's grammar; ferry stores and verifies sha256 only.
    let not_sha256 = |what: &str, d: &ferry_oci::Digest| {
        PullError::Image(format!("{what} digest {d}: only sha256 is supported"))
    };
    for layer in manifest.layers() {
        if !ferry_oci::digest::is_sha256(layer.digest()) {
            return Err(not_sha256("layer", layer.digest()));
        }
        if media::layer_compression(layer.media_type().as_ref()).is_none() {
            return Err(PullError::Image(format!(
                "layer {} has media type {:?}, which is not a tar layer ferry can unpack",
                layer.digest(),
                layer.media_type().to_string()
            )));
        }
    }
    if !ferry_oci::digest::is_sha256(manifest.config().digest()) {
        return Err(not_sha256("config", manifest.config().digest()));
    }
    Ok(manifest)
}

/// Parses an index (oci-spec's type: its digests are validated as it is read).
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
        .manifests()
        .iter()
        .filter(|d| {
            let media_type = d.media_type().to_string();
            is_index(&media_type) || is_manifest(&media_type)
        })
        .enumerate()
        .map(|(n, d)| {
            (
                format!("{LABEL_GC_REF_MANIFEST}{n}"),
                d.digest().to_string(),
            )
        })
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
    labels.insert(
        LABEL_CRI_LAYER_DIGEST.to_owned(),
        layer.digest().to_string(),
    );
    labels.insert(
        LABEL_CRI_MANIFEST_DIGEST.to_owned(),
        ctx.manifest_digest.to_owned(),
    );
    let mut following = String::new();
    for d in &ctx.layers[i..] {
        let digest: &str = d.digest().as_ref();
        let add = if following.is_empty() {
            digest.len()
        } else {
            digest.len() + 1
        };
        if LABEL_CRI_IMAGE_LAYERS.len() + following.len() + add > MAX_LABEL_LEN {
            break;
        }
        if !following.is_empty() {
            following.push(',');
        }
        following.push_str(digest);
    }
    labels.insert(LABEL_CRI_IMAGE_LAYERS.to_owned(), following);
    labels.insert(LABEL_FERRY_IMAGE_REF.to_owned(), ctx.image_ref.to_owned());
    labels.insert(
        LABEL_FERRY_LAYER_DIGEST.to_owned(),
        layer.digest().to_string(),
    );
    labels.insert(
        LABEL_FERRY_MANIFEST_DIGEST.to_owned(),
        ctx.manifest_digest.to_owned(),
    );
    labels.insert(
        LABEL_FERRY_LAYER_MEDIA_TYPE.to_owned(),
        layer.media_type().to_string(),
    );
    labels.insert(LABEL_FERRY_LAYER_SIZE.to_owned(), layer.size().to_string());
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

    fn desc(media_type: &str, digest: &str, size: u64) -> Descriptor {
        ferry_oci::layout::descriptor(
            media_type,
            ferry_oci::layout::digest(digest).unwrap(),
            size,
            &[],
        )
    }

    fn entry(media_type: &str, digest: &str, platform: Option<&str>) -> serde_json::Value {
        let mut e = serde_json::json!({"mediaType": media_type, "digest": digest, "size": 7});
        if let Some(p) = platform {
            let (os, arch) = p.split_once('/').unwrap();
            e["platform"] = serde_json::json!({"os": os, "architecture": arch});
        }
        e
    }

    fn index_of(entries: Vec<serde_json::Value>) -> ImageIndex {
        let doc = serde_json::json!({"schemaVersion": 2, "mediaType": media::OCI_INDEX, "manifests": entries});
        parse_index(doc.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn platform_selection_uses_the_one_chooser() {
        let index = index_of(vec![
            entry(media::OCI_MANIFEST, A, Some("linux/arm64")),
            entry(media::OCI_MANIFEST, B, Some("linux/amd64")),
            entry(media::OCI_MANIFEST, C, Some("windows/amd64")),
        ]);
        let pick = |p: &str| select_platform(&index, &Platform::parse(p).unwrap());
        assert_eq!(pick("linux/amd64").unwrap(), B);
        assert_eq!(pick("linux/arm64/v8").unwrap(), A);
        let err = pick("linux/s390x").unwrap_err().to_string();
        assert!(
            err.contains("linux/s390x") && err.contains("linux/arm64/v8, linux/amd64"),
            "{err}"
        );
        // A platform entry that is itself an index is refused (no nested indexes).
        let nested = index_of(vec![entry(media::OCI_INDEX, A, Some("linux/amd64"))]);
        assert!(select_platform(&nested, &Platform::parse("linux/amd64").unwrap()).is_err());
        // Bad digests in an index are refused as it is parsed.
        let bad = serde_json::json!({"schemaVersion": 2, "manifests": [entry(media::OCI_MANIFEST, "sha256:abc", None)]});
        assert!(parse_index(bad.to_string().as_bytes()).is_err());
    }

    #[test]
    fn index_labels_name_every_manifest_for_gc() {
        let index = index_of(vec![
            entry(media::OCI_MANIFEST, A, Some("linux/amd64")),
            entry("application/vnd.example.sbom+json", C, None),
            entry(media::DOCKER_MANIFEST, B, Some("linux/arm64")),
            entry(media::OCI_INDEX, C, None),
        ]);
        let labels = index_labels(&index);
        assert_eq!(labels.len(), 3, "{labels:?}");
        assert_eq!(labels["containerd.io/gc.ref.content.m.0"], A);
        assert_eq!(labels["containerd.io/gc.ref.content.m.1"], B);
        assert_eq!(labels["containerd.io/gc.ref.content.m.2"], C);
        assert!(index_labels(&index_of(vec![])).is_empty());
    }

    #[test]
    fn manifests_and_configs_are_checked() {
        let manifest = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"{}","digest":"{A}","size":2}},"layers":[{{"mediaType":"{}","digest":"{B}","size":3}}]}}"#,
            media::OCI_CONFIG,
            media::LAYER_TAR_GZIP
        );
        let m = parse_manifest(manifest.as_bytes()).unwrap();
        assert_eq!(m.layers()[0].digest().as_ref() as &str, B);
        let bad_type = manifest.replace(media::LAYER_TAR_GZIP, "application/x-foo");
        assert!(parse_manifest(bad_type.as_bytes()).is_err());
        assert!(parse_manifest(b"{").is_err());
        // A digest oci-spec accepts but ferry does not store: refused at the manifest.
        let sha512 = format!("sha512:{}", "b".repeat(128));
        assert!(parse_manifest(manifest.replace(B, &sha512).as_bytes()).is_err());
        assert!(parse_manifest(manifest.replace(B, "sha256:abc").as_bytes()).is_err());
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
            desc(media::LAYER_TAR_GZIP, A, 7),
            desc(media::LAYER_TAR_GZIP, B, 42),
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
        let many: Vec<Descriptor> = (0..100).map(|_| desc(media::OCI_MANIFEST, A, 7)).collect();
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
