//! # ferry-loadtest: `ferry bench registry`, a fleet's node-startup flow against any registry
//!
//! This crate owns the load tester: the virtual nodes, their request loop, the
//! histograms and the report. It reads challenges with the registry client's parser and
//! asks for manifests with the client's `Accept` list, so it exercises a registry the way
//! ferry's nodes do, but it does not use the client's [`Client`](ferry_registry_client::Client)
//! for the measured requests (a pooled, retrying client would hide what is measured). It
//! must not depend on ferry's registry server: it measures any registry from outside.
//!
//! Each virtual node owns one keep-alive HTTP/1.1 connection (raw hyper 1 client
//! connections: no pool, no per-request allocation beyond the request itself) and loops
//! over what a starting node does: authenticate once (`GET /v2/`, then a token from the
//! realm the challenge names, or Basic), then per start: manifest by tag with the usual
//! `Accept` list (and the platform manifest when the tag is an index), the config blob,
//! and one request per layer. A 401 mid-run refreshes the token once and retries, as a
//! node does when its token expires.
//!
//! Layer requests are `--layer-mode get` by default: one `GET` with `Range: bytes=0-4095`.
//! A lazily starting node's first touch of a layer is a small range read (its footer /
//! table of contents), and a whole-layer GET would measure loopback bandwidth rather than
//! the registry's request handling, which is what fleets saturate (Harbor fell over on
//! request rate, not bytes). `head` and `redirect` (follow 3xx, e.g. to presigned object
//! store URLs) are the other modes; `--range 0` fetches whole blobs.
//!
//! Only the target registry, loopback, and hosts given explicitly are ever contacted
//! (token realms and redirect targets are checked). Only plain HTTP is spoken: this is a
//! tester for registries on the machine or behind a trusted network, not a TLS client.
//!
//! Numbers: latencies go into log-linear histograms ([`histogram`]) per request kind;
//! only requests that complete inside the measured window (after warmup, before the end)
//! count. LPM = layer requests per minute that succeeded.

mod challenge;
mod engine;
pub mod histogram;
mod report;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

pub use challenge::{Challenge, parse_challenge};
pub use engine::run;
pub use report::{ErrorReport, KindReport, Report, RequestKind};

/// Most virtual nodes (connections) one run may open.
pub const MAX_CONNECTIONS: usize = 10_000;
/// Longest measured duration.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
/// Shortest measured duration.
pub const MIN_DURATION: Duration = Duration::from_millis(100);
/// Longest warmup.
pub const MAX_WARMUP: Duration = Duration::from_secs(600);
/// Largest `Range` a layer GET may ask for.
pub const MAX_RANGE_BYTES: u64 = 64 << 20;
/// Bounds of the per-request timeout.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// Bounds of the per-request timeout.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(300);

/// Errors that stop a load test before it measures anything.
#[derive(Debug, thiserror::Error)]
pub enum LoadTestError {
    /// A setting is out of bounds or malformed.
    #[error("invalid load test setting: {0}")]
    InvalidConfig(String),
    /// Resolving the image (auth, manifest) before the run failed.
    #[error("preparing the run against {registry}: {reason}")]
    Discovery {
        /// `host[:port]` of the registry.
        registry: String,
        /// What went wrong.
        reason: String,
    },
}

/// How each layer is requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerMode {
    /// `HEAD` the blob (size check only).
    Head,
    /// `GET` the blob (a `Range` of it when a range is set); a 3xx is an error.
    Get,
    /// `GET` the blob and follow 3xx redirects (to presigned object-store URLs).
    Redirect,
}

impl FromStr for LayerMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "head" => Ok(LayerMode::Head),
            "get" => Ok(LayerMode::Get),
            "redirect" => Ok(LayerMode::Redirect),
            other => Err(format!(
                "unknown layer mode {other:?} (expected head, get or redirect)"
            )),
        }
    }
}

impl fmt::Display for LayerMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayerMode::Head => "head",
            LayerMode::Get => "get",
            LayerMode::Redirect => "redirect",
        })
    }
}

/// `user:password` for the registry (Basic, or to obtain bearer tokens).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password.
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl FromStr for Credentials {
    type Err = String;
    /// Parses `user:password` (the password may contain `:`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            Some((u, p)) if !u.is_empty() && s.len() <= 4096 => Ok(Credentials {
                username: u.to_string(),
                password: p.to_string(),
            }),
            _ => Err("credentials must be USER:PASSWORD".to_string()),
        }
    }
}

/// One load test run.
#[derive(Debug, Clone)]
pub struct LoadTestConfig {
    /// `host[:port]` of the registry (port 80 when absent); plain HTTP.
    pub registry: String,
    /// Repository, e.g. `bench/small`.
    pub repository: String,
    /// Tag or digest of the image to start.
    pub reference: String,
    /// Virtual nodes, each with its own keep-alive connection (1..=10,000).
    pub connections: usize,
    /// Measured duration (100 ms..=1 h).
    pub duration: Duration,
    /// Run before measuring, so connections, tokens and caches are warm (≤ 10 min).
    pub warmup: Duration,
    /// How layers are requested.
    pub layer_mode: LayerMode,
    /// Bytes asked of each layer GET (`Range: bytes=0-N-1`); `None` = whole blob.
    pub range_bytes: Option<u64>,
    /// Credentials, if the registry wants them.
    pub credentials: Option<Credentials>,
    /// Hosts besides the registry and loopback that token realms and redirects may name.
    pub allowed_hosts: Vec<String>,
    /// Time limit of one request, body included.
    pub request_timeout: Duration,
    /// `os/arch` picked from an image index, e.g. `linux/amd64`.
    pub platform: String,
}

impl Default for LoadTestConfig {
    fn default() -> Self {
        LoadTestConfig {
            registry: "127.0.0.1:5000".to_string(),
            repository: String::new(),
            reference: "latest".to_string(),
            connections: 256,
            duration: Duration::from_secs(30),
            warmup: Duration::from_secs(5),
            layer_mode: LayerMode::Get,
            range_bytes: Some(4096),
            credentials: None,
            allowed_hosts: Vec::new(),
            request_timeout: Duration::from_secs(10),
            platform: default_platform(),
        }
    }
}

/// This machine's platform (`linux/amd64`, `linux/arm64/v8`), as ferry-oci names it.
pub fn default_platform() -> String {
    ferry_oci::Platform::host().to_string()
}

impl LoadTestConfig {
    /// Checks every bound; the run does nothing unchecked.
    pub fn validate(&self) -> Result<(), LoadTestError> {
        let bad = |m: String| Err(LoadTestError::InvalidConfig(m));
        if let Err(e) = split_authority(&self.registry) {
            return bad(e);
        }
        if let Err(e) = ferry_oci::RepositoryName::parse(&self.repository) {
            return bad(e.to_string());
        }
        match ferry_oci::Reference::parse(&self.reference) {
            Ok(ferry_oci::Reference::Tag(_)) => {}
            Ok(ferry_oci::Reference::Digest(_)) => {
                if let Err(e) = ferry_oci::digest::parse_sha256(&self.reference) {
                    return bad(e.to_string());
                }
            }
            Err(e) => return bad(e.to_string()),
        }
        if self.connections == 0 || self.connections > MAX_CONNECTIONS {
            return bad(format!(
                "connections must be 1..={MAX_CONNECTIONS}, not {}",
                self.connections
            ));
        }
        if self.duration < MIN_DURATION || self.duration > MAX_DURATION {
            return bad(format!(
                "duration must be between {MIN_DURATION:?} and {MAX_DURATION:?}, not {:?}",
                self.duration
            ));
        }
        if self.warmup > MAX_WARMUP {
            return bad(format!(
                "warmup must be at most {MAX_WARMUP:?}, not {:?}",
                self.warmup
            ));
        }
        if self.request_timeout < MIN_TIMEOUT || self.request_timeout > MAX_TIMEOUT {
            return bad(format!(
                "request timeout must be between {MIN_TIMEOUT:?} and {MAX_TIMEOUT:?}, not {:?}",
                self.request_timeout
            ));
        }
        if let Some(r) = self.range_bytes
            && (r == 0 || r > MAX_RANGE_BYTES)
        {
            return bad(format!(
                "range must be 1..={MAX_RANGE_BYTES} bytes (or none for whole blobs), not {r}"
            ));
        }
        if self.allowed_hosts.len() > 64
            || self
                .allowed_hosts
                .iter()
                .any(|h| h.is_empty() || h.len() > 253 || h.contains(['/', '@', ' ']))
        {
            return bad("allowed hosts must be at most 64 plain host names".to_string());
        }
        if let Err(e) = ferry_oci::Platform::parse(&self.platform) {
            return bad(e.to_string());
        }
        Ok(())
    }
}

/// Splits `host[:port]` (IPv6 as `[::1]:port`) into host and port (80 when absent).
pub(crate) fn split_authority(authority: &str) -> Result<(String, u16), String> {
    let bad = || format!("registry must be HOST[:PORT] with no scheme or path, not {authority:?}");
    if authority.is_empty()
        || authority.len() > 260
        || authority.contains(['/', '@', '?', '#', ' '])
    {
        return Err(bad());
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (h, after) = rest.split_once(']').ok_or_else(bad)?;
        match after {
            "" => (h, None),
            p => (h, Some(p.strip_prefix(':').ok_or_else(bad)?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, Some(p)),
            Some(_) => return Err(bad()),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(bad());
    }
    let port = match port {
        None => 80,
        Some(p) => p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(bad)?,
    };
    Ok((host.to_string(), port))
}
