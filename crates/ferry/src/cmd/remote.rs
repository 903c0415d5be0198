//! Registry images for the commands that read or write an image (`index`, `inspect`,
//! `cat`, `convert`): the registry flags they share with `ferry mount` and `ferry pull`,
//! the client those make, and a registry image as these commands read it — its manifest
//! (the platform chosen from an image index by ferry-oci's one chooser), its layers
//! lazily through ferry-fs's registry backend (HTTP Range, the same sources a mount
//! reads), or each blob streamed once from first byte to last.

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use ferry_index::ferryidx::LayerIndex;
use ferry_index::image::{LayerSummary, layer_reader};
use ferry_index::merged::MergedImage;
use ferry_index::source::RangeSource;
use ferry_oci::{Descriptor, ImageManifest, ImageRef, Platform};
use ferry_registry_client::{ByteStream, Client, ClientConfig, RangeRuntime, Repo};
use futures_util::StreamExt;
use sha2::Digest as _;

use super::CredentialProviderArgs;

/// How to reach registries: the flags `ferry mount` and `ferry pull` take too. Credentials
/// come from docker's and podman's auth files (and the credential provider plugins).
#[derive(Debug, Clone, clap::Args)]
pub struct RegistryArgs {
    /// Speak plain HTTP to the registries named (loopback registries get it
    /// automatically).
    #[arg(long)]
    pub plain_http: bool,
    /// containerd's registry host directory (`<DIR>/<host[:port]>/hosts.toml`: mirrors,
    /// `server`, certificates), as containerd's `config_path`; "" turns it off.
    #[arg(long, value_name = "DIR", env = "FERRY_REGISTRY_CONFIG_PATH", default_value = ferry_registry_client::hosts::DEFAULT_CONFIG_PATH)]
    pub registry_config_path: PathBuf,
    #[command(flatten)]
    pub credential_providers: CredentialProviderArgs,
}

impl Default for RegistryArgs {
    fn default() -> Self {
        RegistryArgs {
            plain_http: false,
            registry_config_path: ferry_registry_client::hosts::DEFAULT_CONFIG_PATH.into(),
            credential_providers: CredentialProviderArgs::default(),
        }
    }
}

impl RegistryArgs {
    /// The client for `images` (the registries among them get `--plain-http`).
    pub fn client(&self, images: &[&ImageRef]) -> Result<Client> {
        Ok(Client::new(self.client_config(images))?)
    }

    /// The client configuration for `images` (as [`Self::client`]).
    pub fn client_config(&self, images: &[&ImageRef]) -> ClientConfig {
        let mut cfg = ClientConfig {
            config_path: super::registry_config_path(&self.registry_config_path),
            ..ClientConfig::default()
        };
        if self.plain_http {
            for image in images {
                if let ImageRef::Registry { registry, .. } = image {
                    cfg.registry.entry(registry.clone()).or_default().plain_http = true;
                }
            }
        }
        self.credential_providers.apply(&mut cfg);
        cfg
    }
}

/// An image in a registry, as `index`, `inspect`, `cat` and `convert` read it.
#[derive(Debug)]
pub struct RemoteImage {
    pub client: Client,
    pub repo: Repo,
    /// The tag or digest the reference names.
    pub reference: String,
    /// Where the (synchronous) readers' requests run.
    pub runtime: RangeRuntime,
}

impl RemoteImage {
    /// The registry image `image` names, `None` for a layout.
    pub fn open(image: &ImageRef, client: &Client) -> Result<Option<RemoteImage>> {
        let ImageRef::Registry {
            registry,
            repository,
            ..
        } = image
        else {
            return Ok(None);
        };
        Ok(Some(RemoteImage {
            client: client.clone(),
            repo: Repo::new(registry.clone(), repository.clone()),
            reference: image.reference().to_owned(),
            runtime: RangeRuntime::new()?,
        }))
    }

    /// The image manifest and its descriptor: for an image index the entry for
    /// `platform` (default: this machine's).
    pub fn manifest(&self, platform: Option<&Platform>) -> Result<(Descriptor, ImageManifest)> {
        let reference = match platform {
            Some(p) => self
                .runtime
                .handle()
                .block_on(super::registry_platform_ref(
                    &self.client,
                    &self.repo,
                    &self.reference,
                    p,
                ))
                .with_context(|| format!("resolving {}", self.shown()))?,
            None => self.reference.clone(),
        };
        ferry_fs::registry_manifest(&self.client, &self.repo, &reference, &self.runtime)
            .with_context(|| format!("reading the manifest of {}", self.shown()))
    }

    /// The reference as a user writes it.
    pub fn shown(&self) -> String {
        if self.reference.contains(':') {
            format!("{}@{}", self.repo, self.reference)
        } else {
            format!("{}:{}", self.repo, self.reference)
        }
    }

    /// Opens the image whose manifest is `manifest` lazily, exactly as a mount does
    /// (ferry-fs's registry backend: its index artifact by referrers or tag fallback,
    /// an HTTP Range source per layer), each layer's source wrapped by `wrap`.
    pub fn open_merged(
        &self,
        manifest: &Descriptor,
        wrap: &dyn Fn(Arc<dyn RangeSource>) -> Arc<dyn RangeSource>,
    ) -> Result<(MergedImage, Vec<LayerSummary>)> {
        let source = ferry_fs::ImageSource::from_registry(
            &self.client,
            &self.repo,
            manifest.digest().as_ref(),
            &self.runtime,
        )
        .with_context(|| format!("opening {}", self.shown()))?;
        let indexes: HashMap<String, Arc<LayerIndex>> = source
            .layers
            .iter()
            .filter_map(|l| {
                l.index
                    .clone()
                    .map(|i| (l.descriptor.digest().to_string(), i))
            })
            .collect();
        let mut readers = Vec::with_capacity(source.layers.len());
        let mut summaries = Vec::with_capacity(source.layers.len());
        for layer in &source.layers {
            let reader = layer_reader(&layer.descriptor, &indexes, wrap(layer.source.clone()))
                .with_context(|| format!("opening layer {}", layer.descriptor.digest()))?;
            summaries.push(LayerSummary {
                descriptor: layer.descriptor.clone(),
                format: reader.format_name().to_string(),
                entries: Some(reader.entries().len()),
            });
            readers.push(reader);
        }
        Ok((MergedImage::new(readers), summaries))
    }

    /// Streams blob `desc` once, first byte to last (one GET); with `verify`, the stream
    /// fails at its end unless the bytes hash to the descriptor's digest.
    pub fn stream_blob(&self, desc: &Descriptor, verify: bool) -> Result<BlobRead> {
        let digest = desc.digest().to_string();
        let stream = self
            .runtime
            .handle()
            .block_on(self.client.blob_stream(&self.repo, &digest, None))
            .with_context(|| format!("fetching blob {digest} from {}", self.repo))?;
        Ok(BlobRead {
            handle: self.runtime.handle().clone(),
            body: stream.body,
            buf: Vec::new(),
            pos: 0,
            hasher: verify.then(sha2::Sha256::new),
            expected: digest,
        })
    }

    /// A small blob (a config), verified, at most `max` bytes.
    pub fn read_blob(&self, desc: &Descriptor, max: u64) -> Result<Vec<u8>> {
        if desc.size() > max {
            bail!(
                "blob {} is {} bytes, more than the {max} accepted",
                desc.digest(),
                desc.size()
            );
        }
        let digest = desc.digest().to_string();
        Ok(self
            .runtime
            .handle()
            .block_on(
                self.client
                    .blob_verified(&self.repo, &digest, desc.size(), "blob"),
            )
            .with_context(|| format!("fetching blob {digest} from {}", self.repo))?
            .to_vec())
    }
}

/// A registry blob being received, as a synchronous [`Read`] (for the indexer and the
/// converters, which run on plain threads): each read waits for the next piece of the
/// one GET. Not for use inside an async task.
pub struct BlobRead {
    handle: tokio::runtime::Handle,
    body: ByteStream,
    buf: Vec<u8>,
    pos: usize,
    hasher: Option<sha2::Sha256>,
    expected: String,
}

impl std::fmt::Debug for BlobRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobRead")
            .field("digest", &self.expected)
            .finish()
    }
}

impl BlobRead {
    /// A reader of `body` (tests: a stream made in memory).
    #[cfg(test)]
    fn of(handle: tokio::runtime::Handle, body: ByteStream, verify_as: Option<&str>) -> Self {
        BlobRead {
            handle,
            body,
            buf: Vec::new(),
            pos: 0,
            hasher: verify_as.map(|_| sha2::Sha256::new()),
            expected: verify_as.unwrap_or_default().to_owned(),
        }
    }
}

impl Read for BlobRead {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.handle.block_on(self.body.next()) {
                Some(Ok(piece)) => {
                    if let Some(h) = &mut self.hasher {
                        h.update(&piece);
                    }
                    self.buf.clear();
                    self.buf.extend_from_slice(&piece);
                    self.pos = 0;
                }
                Some(Err(e)) => return Err(e),
                None => {
                    if let Some(h) = self.hasher.take() {
                        let got = format!("sha256:{}", hex::encode(h.finalize()));
                        if got != self.expected {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                format!(
                                    "blob {} arrived with digest {got}; the registry served other \
                                     bytes than the manifest names (try again, or check the \
                                     registry's storage)",
                                    self.expected
                                ),
                            ));
                        }
                    }
                    return Ok(0);
                }
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn stream(pieces: Vec<&'static [u8]>) -> ByteStream {
        Box::pin(futures_util::stream::iter(
            pieces.into_iter().map(|p| Ok(p.to_vec().into())),
        ))
    }

    #[test]
    fn blob_read_joins_pieces_and_checks_the_digest_at_the_end() {
        let rt = RangeRuntime::new().unwrap();
        let digest = ferry_oci::sha256_digest(b"hello world").to_string();
        let mut r = BlobRead::of(
            rt.handle().clone(),
            stream(vec![b"hello", b"", b" world"]),
            Some(&digest),
        );
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"hello world");

        let mut bad = BlobRead::of(
            rt.handle().clone(),
            stream(vec![b"hello", b" there"]),
            Some(&digest),
        );
        let err = bad.read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains(&digest), "{err}");
    }

    #[test]
    fn blob_read_passes_stream_errors_on() {
        let rt = RangeRuntime::new().unwrap();
        let body: ByteStream = Box::pin(futures_util::stream::iter(vec![
            Ok(b"abc".to_vec().into()),
            Err(std::io::Error::other("connection reset")),
        ]));
        let mut r = BlobRead::of(rt.handle().clone(), body, None);
        let err = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("connection reset"));
    }
}
