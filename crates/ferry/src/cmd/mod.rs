//! One module per subcommand.

pub mod bench;
pub mod cat;
pub mod convert;
pub mod copy;
pub mod daemon;
pub mod demo;
pub mod index;
pub mod inspect;
pub mod mount;
pub mod pack;
pub mod prewarm;
pub mod pull;
pub mod registry;
pub mod remote;
pub mod sim;
pub mod snapshotter;
pub mod status;
pub mod store;
pub mod store_plan;
pub mod trace;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ferry_oci::{ImageRef, OciLayout, Platform};
use ferry_registry_client::{Client, ClientConfig};

/// Opens the OCI layout an `oci:DIR:TAG` reference names (registry references are
/// opened with [`remote::RemoteImage`]; commands that take both check which first).
pub fn layout_ref(image: &str) -> Result<(OciLayout, String, PathBuf)> {
    match ImageRef::parse(image)? {
        ImageRef::Layout { dir, reference } => {
            let layout = OciLayout::open(&dir).with_context(|| format!("opening {image}"))?;
            Ok((layout, reference.to_string(), dir))
        }
        ImageRef::Registry { .. } => bail!(
            "{image} is a registry reference, and this command takes an OCI layout (oci:DIR:TAG); \
             copy the image first with `ferry copy {image} oci:DIR:TAG`"
        ),
    }
}

/// `--platform`'s value parser (ferry-oci's one platform grammar).
pub fn parse_platform(s: &str) -> Result<Platform, String> {
    Platform::parse(s).map_err(|e| e.to_string())
}

/// The reference `--platform` makes of `reference` in `layout`: the digest of that
/// platform's manifest (an image index resolves to its entry for it, by ferry-oci's one
/// chooser; the layout resolves the digest), else `reference` itself, which means this
/// machine's platform.
pub fn layout_platform_ref(
    layout: &OciLayout,
    reference: String,
    platform: Option<&Platform>,
) -> Result<String> {
    match platform {
        None => Ok(reference),
        Some(p) => Ok(layout
            .image_manifest_for(&reference, p)
            .with_context(|| format!("{reference} for {p}"))?
            .0
            .digest()
            .to_string()),
    }
}

/// The image `--platform` names: the platform's manifest by digest (`oci:DIR@sha256:…`,
/// `HOST/REPO@sha256:…`), chosen from an image index by ferry-oci's one chooser, so that
/// the lazy filesystem and the daemon open exactly it; an image that is not an index is
/// itself. A registry is asked with `cfg`, the command's own client configuration (its
/// credentials, hosts.toml and credential providers), as every later request is.
pub fn platform_image(
    image: &str,
    platform: &ferry_oci::Platform,
    cfg: ClientConfig,
) -> Result<String> {
    let parsed = ferry_oci::ImageRef::parse(image)?;
    let reference = parsed.reference().to_owned();
    match parsed {
        ferry_oci::ImageRef::Layout { dir, .. } => {
            let layout = ferry_oci::OciLayout::open(&dir)
                .with_context(|| format!("opening {}", dir.display()))?;
            let chosen = layout_platform_ref(&layout, reference, Some(platform))?;
            Ok(format!("oci:{}@{chosen}", dir.display()))
        }
        ferry_oci::ImageRef::Registry {
            registry,
            repository,
            ..
        } => {
            let client = Client::new(cfg)?;
            let repo = ferry_registry_client::Repo::new(registry.clone(), repository.clone());
            let chosen = current_thread_runtime()?
                .block_on(registry_platform_ref(&client, &repo, &reference, platform))
                .with_context(|| format!("resolving {image}"))?;
            if chosen == reference {
                return Ok(image.to_owned());
            }
            Ok(format!("{registry}/{repository}@{chosen}"))
        }
    }
}

/// The reference of `platform`'s manifest in a registry: for an image index the digest
/// of its entry for the platform (ferry-oci's one chooser), else `reference` itself.
pub async fn registry_platform_ref(
    client: &Client,
    repo: &ferry_registry_client::Repo,
    reference: &str,
    platform: &Platform,
) -> Result<String> {
    use ferry_oci::media::{DOCKER_MANIFEST_LIST, OCI_INDEX};
    let doc = client.get_manifest(repo, reference, &[]).await?;
    if doc.media_type != OCI_INDEX && doc.media_type != DOCKER_MANIFEST_LIST {
        return Ok(reference.to_owned());
    }
    let index: ferry_oci::ImageIndex = serde_json::from_slice(&doc.bytes)
        .with_context(|| format!("image index {}", doc.digest))?;
    let chosen = ferry_oci::choose_manifest(&index, platform)
        .with_context(|| format!("image index {}", doc.digest))?;
    Ok(chosen.digest().to_string())
}

/// Opens `image` (`oci:DIR[:TAG]` or a registry reference) for reading files lazily:
/// per layer its ferry index, eStargz TOC or whole blob, each layer's source wrapped by
/// `wrap`; a registry image through ferry-fs's registry backend, as a mount reads it.
/// Returns the merged image, its layers, and the manifest's digest.
pub fn open_image(
    image: &str,
    registry: &remote::RegistryArgs,
    platform: Option<&Platform>,
    wrap: &dyn Fn(
        std::sync::Arc<dyn ferry_index::source::RangeSource>,
    ) -> std::sync::Arc<dyn ferry_index::source::RangeSource>,
) -> Result<(
    ferry_index::merged::MergedImage,
    Vec<ferry_index::image::LayerSummary>,
    String,
)> {
    let parsed = ImageRef::parse(image)?;
    if let ImageRef::Layout { .. } = parsed {
        let (layout, reference, _) = layout_ref(image)?;
        let reference = layout_platform_ref(&layout, reference, platform)?;
        let (mdesc, _) = layout.image_manifest(&reference)?;
        let (merged, layers) = ferry_index::image::open_layout_image(&layout, &reference, wrap)
            .with_context(|| format!("opening {image}"))?;
        return Ok((merged, layers, mdesc.digest().to_string()));
    }
    let client = registry.client(&[&parsed])?;
    let remote = remote::RemoteImage::open(&parsed, &client)?.context("a registry image")?;
    let (mdesc, _) = remote.manifest(platform)?;
    let (merged, layers) = remote.open_merged(&mdesc, wrap)?;
    Ok((merged, layers, mdesc.digest().to_string()))
}

/// The kubelet's credential provider plugins, with the kubelet's own flag names.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CredentialProviderArgs {
    /// The kubelet's credential provider config (`CredentialProviderConfig`, YAML or
    /// JSON): its plugins are asked for credentials that neither --creds nor docker's or
    /// podman's auth files have; answers are kept in memory only.
    #[arg(
        long,
        value_name = "FILE",
        env = "FERRY_IMAGE_CREDENTIAL_PROVIDER_CONFIG",
        requires = "image_credential_provider_bin_dir"
    )]
    pub image_credential_provider_config: Option<PathBuf>,
    /// The directory of the plugins that config names.
    #[arg(
        long,
        value_name = "DIR",
        env = "FERRY_IMAGE_CREDENTIAL_PROVIDER_BIN_DIR"
    )]
    pub image_credential_provider_bin_dir: Option<PathBuf>,
}

impl CredentialProviderArgs {
    /// Sets the client config's plugin settings.
    pub fn apply(&self, cfg: &mut ClientConfig) {
        cfg.credential_provider_config = self.image_credential_provider_config.clone();
        cfg.credential_provider_bin_dir = self.image_credential_provider_bin_dir.clone();
    }

    /// Whether any is set.
    pub fn is_set(&self) -> bool {
        self.image_credential_provider_config.is_some()
    }

    /// The flags again, for a child `ferry` process.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut out = Vec::new();
        if let Some(c) = &self.image_credential_provider_config {
            out.push("--image-credential-provider-config".into());
            out.push(c.clone().into_os_string());
        }
        if let Some(d) = &self.image_credential_provider_bin_dir {
            out.push("--image-credential-provider-bin-dir".into());
            out.push(d.clone().into_os_string());
        }
        out
    }
}

/// The registry client's `config_path` from a `--registry-config-path` value (`""`: off).
pub fn registry_config_path(flag: &Path) -> Option<PathBuf> {
    (!flag.as_os_str().is_empty()).then(|| flag.to_path_buf())
}

/// A current-thread async runtime for one command's registry calls.
pub fn current_thread_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Like [`layout_ref`] but creates the layout when it does not exist (outputs).
pub fn output_layout(image: &str) -> Result<(OciLayout, String)> {
    match ImageRef::parse(image)? {
        ImageRef::Layout { dir, reference } => {
            let ferry_oci::Reference::Tag(tag) = reference else {
                bail!("{image}: an output needs a tag, not a digest");
            };
            Ok((
                OciLayout::open_or_create(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?,
                tag.to_string(),
            ))
        }
        ImageRef::Registry { .. } => {
            bail!("{image}: outputs must be OCI layouts (oci:DIR:TAG) in this build")
        }
    }
}

/// Human-readable byte count.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Writes an image (config + manifest) for `layers` into `layout` under `tag`.
/// `config` is the image config to start from (its `rootfs.diff_ids` are replaced);
/// `None` makes a minimal linux config for this machine's architecture. No timestamps
/// are added, so the same layers give the same manifest digest.
pub fn write_image(
    layout: &OciLayout,
    tag: &str,
    layers: Vec<(ferry_oci::Descriptor, String)>,
    config: Option<serde_json::Value>,
) -> Result<ferry_oci::Descriptor> {
    use ferry_oci::layout::{canonical_json, descriptor};
    use ferry_oci::media::{OCI_CONFIG, OCI_MANIFEST};
    let mut config = config.unwrap_or_else(|| {
        let host = ferry_oci::Platform::host();
        let mut config = serde_json::json!({
            "architecture": host.architecture(),
            "os": host.os(),
            "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        });
        if let Some(variant) = host.variant() {
            config["variant"] = serde_json::json!(variant);
        }
        config
    });
    let diff_ids: Vec<String> = layers.iter().map(|(_, d)| d.clone()).collect();
    config["rootfs"] = serde_json::json!({"type": "layers", "diff_ids": diff_ids});
    let config_bytes = canonical_json(&config)?;
    let config_digest = layout.write_blob(&config_bytes)?;
    let descs: Vec<ferry_oci::Descriptor> = layers.into_iter().map(|(d, _)| d).collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": descriptor(OCI_CONFIG, config_digest, config_bytes.len() as u64, &[]),
        "layers": descs,
    });
    let bytes = canonical_json(&manifest)?;
    let digest = layout.write_blob(&bytes)?;
    let desc = descriptor(OCI_MANIFEST, digest, bytes.len() as u64, &[]);
    layout.set_tag(tag, &desc)?;
    Ok(desc)
}
