//! The daemon's configuration file (TOML): every section and field optional, the
//! embedded defaults complete. It only describes and validates settings; it must not
//! open anything (the store, sockets) so it can be printed and tested on any machine.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_fs::{FetchConfig, WarmConfig};
use ferry_registry_client::ClientConfig;
use ferry_store::StoreConfig;
use serde::{Deserialize, Serialize};

use ferry_oci::units::{format_duration, format_size};

use crate::error::{Error, Result};

/// Largest accepted `fetch.request_size` (a merged request is held in memory).
const MAX_REQUEST_SIZE: u64 = 1 << 30;
/// Most accepted `fetch.concurrency`, `fuse.threads` and `warm.concurrency`.
const MAX_PARALLELISM: usize = 1024;
/// Most bytes of a config file read.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// How `--print-config` shows `[store] seed` when there is none.
const UNSET_SEED: &str = "# seed = \"/vol/ferry-seed\"  # none by default: a read-only `ferry store export` \
     directory used in place under the live store (docs/node-cache.md)";

/// The whole configuration (`ferry daemon --print-config` shows the effective one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// `[store]`: the node chunk store (`FERRY_STORE` overrides `path`).
    pub store: StoreConfig,
    /// `[fetch]`: how lazy reads reach the registry.
    pub fetch: FetchSection,
    /// `[fuse]`: FUSE transport.
    pub fuse: FuseSection,
    /// `[warm]`: prefetch and background fill.
    pub warm: WarmConfig,
    /// `[file_cache]`: fully local files kept decompressed and served by the kernel
    /// (FUSE passthrough) at native speed.
    pub file_cache: ferry_fs::FileCacheConfig,
    /// `[control]`: the control socket `ferry mount` / `ferry status` talk to.
    pub control: ControlSection,
    /// `[metrics]`: Prometheus endpoint.
    pub metrics: MetricsSection,
    /// `[snapshotter]`: containerd's proxy snapshotter.
    pub snapshotter: SnapshotterSection,
    /// `[registry]`: registry client settings.
    pub registry: RegistrySection,
    /// `[trace]`: startup traces recorded automatically during an image's first start.
    pub trace: TraceSection,
    /// `[p2p]`: serve verified pieces to peers and fetch from them before the registry.
    pub p2p: P2pSection,
    /// `[cri]`: the CRI image-service proxy in front of the container runtime.
    pub cri: CriSection,
    /// A store directory given on the command line: wins over `FERRY_STORE` and
    /// `store.path` (not part of the file).
    #[serde(skip)]
    pub store_path_flag: Option<PathBuf>,
    /// The ferry executable that can run the fd holder (`ferry daemon --fd-holder
    /// SOCKET`), set by the binary; `None`: only a holder already listening is used (not
    /// part of the file).
    #[serde(skip)]
    pub holder_program: Option<PathBuf>,
}

/// `[fetch]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FetchSection {
    /// Concurrent registry requests per mounted image.
    pub concurrency: usize,
    /// Concurrent registry requests to one layer blob, at most `concurrency`. A fetch
    /// that finds them all busy queues, and the queued fetches of that layer go out
    /// together, in one multi-range request, when one returns: a registry pays per
    /// request, and a start's fetches of a layer come in bursts.
    pub layer_concurrency: usize,
    /// Largest merged request (`"8M"`; K/M/G are powers of 1024; or a number of bytes).
    #[serde(with = "size_text")]
    pub request_size: u64,
    /// Longest an uncached read waits (`"30s"`, `"500ms"`, `"2m"`; or seconds).
    #[serde(with = "duration_text")]
    pub timeout: Duration,
    /// Largest readahead window along a layer's compressed stream (`"2M"`; 0: off): a
    /// miss brings the spans after it in the same request, and a read catching up with
    /// a window starts the next in the background, so a start waits for few round trips.
    /// At most `request_size` (a window is one request).
    #[serde(with = "size_text")]
    pub readahead: u64,
    /// A file at most this large is fetched whole at its first read that misses
    /// (`"8M"`; 0: off): a start that opens a module or a library reads nearly all of it
    /// (the loader by page faults all over it), in one round trip instead of several.
    #[serde(with = "size_text")]
    pub whole_file: u64,
    /// The first miss in a directory also fetches the directory's other small files
    /// (each at most 1 MiB), nearest first, up to this many compressed bytes (`"4M"`; 0:
    /// off): a package's modules are read together, in no particular order.
    #[serde(with = "size_text")]
    pub nearby: u64,
}

impl Default for FetchSection {
    fn default() -> Self {
        FetchSection {
            concurrency: 8,
            layer_concurrency: ferry_fs::device::DEFAULT_LAYER_CONCURRENCY,
            request_size: 8 << 20,
            timeout: Duration::from_secs(30),
            readahead: ferry_fs::device::DEFAULT_READAHEAD_BYTES,
            whole_file: ferry_fs::device::DEFAULT_WHOLE_FILE_BYTES,
            nearby: ferry_fs::device::DEFAULT_NEARBY_BYTES,
        }
    }
}

/// `[fuse]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FuseSection {
    /// FUSE worker threads per mount.
    pub threads: usize,
    /// Let every user use the mounts (the kernel checking permissions), as containers
    /// need; a daemon not run by root needs `user_allow_other` in /etc/fuse.conf for it.
    /// Mounts are always `nosuid,nodev`.
    pub allow_other: bool,
    /// Keep every mount's FUSE connection in a holder process (`ferry daemon
    /// --fd-holder`, started on demand) so that running containers keep their lazy
    /// layers across a daemon restart or crash; the restarted daemon resumes them.
    pub keep_connections: bool,
    /// The holder's socket; `None`: `fdstore.sock` beside the control socket.
    pub holder_socket: Option<PathBuf>,
    /// Memory for recently inflated spans, shared by every mount (`"16M"`; 0: off): a
    /// read inside a span inflated moments ago copies instead of inflating it again,
    /// which is most reads of a start that opens many small neighbouring files. Given
    /// back when idle (within 10 s).
    #[serde(with = "size_text")]
    pub inflated_cache: u64,
}

impl Default for FuseSection {
    fn default() -> Self {
        FuseSection {
            threads: 4,
            allow_other: true,
            keep_connections: true,
            holder_socket: None,
            inflated_cache: ferry_fs::image::DEFAULT_INFLATED_SPANS_BYTES as u64,
        }
    }
}

/// `[control]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlSection {
    /// Socket path; `None`: [`default_control_socket`].
    pub socket: Option<PathBuf>,
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// `host:port` to serve `/metrics` on; `None`: no metrics endpoint.
    pub addr: Option<SocketAddr>,
}

/// `[snapshotter]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnapshotterSection {
    /// Serve containerd's Snapshots API with lazy layers.
    pub enabled: bool,
    /// Its unix socket (`[proxy_plugins.ferry] address`).
    pub socket: PathBuf,
    /// Its root directory (metadata and snapshot directories).
    pub root: PathBuf,
}

impl Default for SnapshotterSection {
    fn default() -> Self {
        SnapshotterSection {
            enabled: true,
            socket: PathBuf::from(ferry_snapshotter::server::DEFAULT_SOCKET),
            root: PathBuf::from(ferry_snapshotter::server::DEFAULT_ROOT),
        }
    }
}

/// `[cri]`: the kubelet's image service endpoint (see `crate::cri`): every call is
/// forwarded to the container runtime, and the credentials of each `PullImage` are kept
/// in memory for that image's lazy reads. Off by default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriSection {
    /// Serve the proxy (point the kubelet's `--image-service-endpoint` at `socket`).
    pub enabled: bool,
    /// The proxy's unix socket.
    pub socket: PathBuf,
    /// The container runtime's CRI socket every call is forwarded to.
    pub runtime_socket: PathBuf,
}

impl Default for CriSection {
    fn default() -> Self {
        CriSection {
            enabled: false,
            socket: PathBuf::from("/run/ferry/cri.sock"),
            runtime_socket: PathBuf::from("/run/containerd/containerd.sock"),
        }
    }
}

/// `[trace]`: an image with no trace records one during its first start on this node and
/// shares it (see `crate::autotrace`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceSection {
    /// Record a trace during the first start of an image that has none.
    pub auto_record: bool,
    /// The recording ends when reads have gone this long without a new first touch.
    #[serde(with = "duration_text")]
    pub quiet: Duration,
    /// The recording ends this long after its first read, whatever happens.
    #[serde(with = "duration_text")]
    pub max_duration: Duration,
    /// Most traces the node keeps (`traces/` in the store directory).
    pub store_entries: usize,
    /// Most bytes of traces the node keeps.
    #[serde(with = "size_text")]
    pub store_bytes: u64,
}

impl Default for TraceSection {
    fn default() -> Self {
        TraceSection {
            auto_record: true,
            quiet: Duration::from_secs(3),
            max_duration: Duration::from_secs(60),
            store_entries: 256,
            store_bytes: 64 << 20,
        }
    }
}

/// `[p2p]`: peers serve each other the verified spans of lazy layers (see
/// `crate::p2p`). Off by default; when on, `token_file` is required.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct P2pSection {
    /// Serve peers and fetch from them.
    pub enabled: bool,
    /// Address the peer server listens on.
    pub listen: SocketAddr,
    /// The other daemons, `host:port` as each listens (a static membership).
    pub peers: Vec<String>,
    /// This daemon's name in the membership, spelled as the other daemons list it;
    /// `None`: `listen` as text (right when `listen` is a routable address).
    pub self_name: Option<String>,
    /// File holding the cluster's shared secret (at least 16 bytes; surrounding
    /// whitespace ignored). Required when enabled.
    pub token_file: Option<PathBuf>,
    /// Longest a read waits on peers (all candidates together) before the registry.
    #[serde(with = "duration_text")]
    pub peer_timeout: Duration,
    /// Members that fetch each piece from the registry (R).
    pub roots: usize,
    /// Children a member serves per piece at most (F).
    pub fan_out: usize,
    /// Other members asked after the parent, before the registry.
    pub fallbacks: usize,
    /// The unit peers are ranked by (`"1M"`): a range is asked of the parent of the
    /// piece it starts in.
    #[serde(with = "size_text")]
    pub piece_size: u64,
    /// Peer requests served at once; more are answered 503.
    pub max_concurrent: usize,
    /// Longest the server spends on one request.
    #[serde(with = "duration_text")]
    pub request_timeout: Duration,
    /// Longest range served in one request (`"16M"`); longer ones are answered 416.
    #[serde(with = "size_text")]
    pub max_range: u64,
    /// How long a peer that failed (timed out, served bytes that did not verify) is
    /// skipped.
    #[serde(with = "duration_text")]
    pub penalty: Duration,
    /// How long a registry's yes to a forwarded credential is cached (at most 5 min,
    /// and never past the credential's own expiry when it says).
    #[serde(with = "duration_text")]
    pub pull_check_ttl: Duration,
    /// This daemon's certificate chain (PEM, leaf first), its server and client
    /// certificate for peers. With `tls_key` and `tls_ca`, peers talk HTTPS; without
    /// all three, plain HTTP.
    pub tls_cert: Option<PathBuf>,
    /// Its private key (PEM); refused when group or others may read or write it.
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM) that signs every daemon's certificate: the only roots a
    /// peer is checked against.
    pub tls_ca: Option<PathBuf>,
    /// mTLS: the server requires a client certificate chained to `tls_ca`.
    pub tls_client_auth: bool,
    /// The name every peer's certificate is checked for; `None`: the host it is dialled
    /// at (its address in the membership), which its certificate must then carry.
    pub tls_server_name: Option<String>,
    /// Revocation lists of the cluster CA (PEM): a peer whose certificate is listed is
    /// refused, as a server and (under mTLS) as a client. The TLS files (this one
    /// included) are looked at every 30 s and used anew when they change and pass the
    /// start-up checks: a renewed certificate or a new CRL needs no restart.
    pub tls_crl: Option<PathBuf>,
    /// `name:port` resolved into members (every A/AAAA record, at that port), merged
    /// with `peers`: a Kubernetes headless service, say.
    pub peers_dns: Option<String>,
    /// How often `peers_dns` is resolved again.
    #[serde(with = "duration_text")]
    pub peers_dns_refresh: Duration,
    /// Membership by gossip (SWIM over UDP, datagrams authenticated with a key derived
    /// from the cluster token), merged with `peers` and `peers_dns`.
    pub gossip: bool,
    /// UDP address the gossip listens on.
    pub gossip_listen: SocketAddr,
    /// The address the other daemons send gossip to (an IP and port); `None`:
    /// `gossip_listen` when it is not a wildcard, else the IP of `self_name` at
    /// `gossip_listen`'s port.
    pub gossip_advertise: Option<SocketAddr>,
    /// Gossip addresses (`host:port`) of daemons to join through; asked again while
    /// no member is known.
    pub gossip_seeds: Vec<String>,
    /// How often a random member is probed (its answer awaited for a third of it).
    #[serde(with = "duration_text")]
    pub gossip_probe_period: Duration,
    /// How often updates go to three random members besides the probes.
    #[serde(with = "duration_text")]
    pub gossip_interval: Duration,
    /// How long a suspected member has to answer before it is removed.
    #[serde(with = "duration_text")]
    pub gossip_suspect_after: Duration,
    /// Most members gossip knows; datagrams that would add more are dropped.
    pub gossip_max_members: usize,
    /// Datagrams stamped further than this from this daemon's clock are dropped
    /// (so is any datagram seen before).
    #[serde(with = "duration_text")]
    pub gossip_max_skew: Duration,
}

impl Default for P2pSection {
    fn default() -> Self {
        P2pSection {
            enabled: false,
            listen: SocketAddr::from(([0, 0, 0, 0], 7050)),
            peers: Vec::new(),
            self_name: None,
            token_file: None,
            peer_timeout: Duration::from_millis(500),
            roots: 2,
            fan_out: 4,
            fallbacks: 2,
            piece_size: 1 << 20,
            max_concurrent: 64,
            request_timeout: Duration::from_secs(30),
            max_range: 16 << 20,
            penalty: Duration::from_secs(30),
            pull_check_ttl: Duration::from_secs(300),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_client_auth: false,
            tls_server_name: None,
            tls_crl: None,
            peers_dns: None,
            peers_dns_refresh: Duration::from_secs(30),
            gossip: false,
            gossip_listen: SocketAddr::from(([0, 0, 0, 0], 7946)),
            gossip_advertise: None,
            gossip_seeds: Vec::new(),
            gossip_probe_period: Duration::from_secs(1),
            gossip_interval: Duration::from_millis(200),
            gossip_suspect_after: Duration::from_secs(5),
            gossip_max_members: crate::p2p::gossip::DEFAULT_MAX_MEMBERS,
            gossip_max_skew: Duration::from_secs(30),
        }
    }
}

/// Longest accepted `p2p.pull_check_ttl`.
pub const MAX_PULL_CHECK_TTL: Duration = Duration::from_secs(300);

impl P2pSection {
    /// This daemon's name in the membership.
    pub fn self_name(&self) -> String {
        self.self_name
            .clone()
            .unwrap_or_else(|| self.listen.to_string())
    }

    fn validate(&self) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let bad = |m: String| Err(Error::Config(format!("p2p.{m}")));
        if self.token_file.is_none() {
            return bad("token_file is required when p2p is enabled".into());
        }
        for peer in self.peers.iter().chain(self.self_name.iter()) {
            if !is_host_port(peer) {
                return bad(format!("peers: {peer:?} is not host:port"));
            }
        }
        if self.peers.len() > 100_000 {
            return bad("peers: more than 100000".into());
        }
        if let Err(e) =
            ferry_p2p::Schedule::new(ferry_p2p::Topology::PieceHrw, self.roots, self.fan_out)
        {
            return bad(format!("roots/fan_out: {e}"));
        }
        if self.roots > 64 || self.fallbacks > 64 {
            return bad("roots and fallbacks must be at most 64".into());
        }
        if self.peer_timeout < Duration::from_millis(10)
            || self.peer_timeout > Duration::from_secs(60)
        {
            return bad("peer_timeout must be between 10ms and 60s".into());
        }
        if !(64 << 10..=1 << 30).contains(&self.piece_size) {
            return bad("piece_size must be between 64K and 1G".into());
        }
        if self.max_concurrent == 0 || self.max_concurrent > MAX_PARALLELISM {
            return bad(format!(
                "max_concurrent must be between 1 and {MAX_PARALLELISM}"
            ));
        }
        if self.request_timeout < Duration::from_millis(100) {
            return bad("request_timeout must be at least 100ms".into());
        }
        if self.max_range == 0 || self.max_range > MAX_REQUEST_SIZE {
            return bad("max_range must be between 1 byte and 1G".into());
        }
        if self.pull_check_ttl > MAX_PULL_CHECK_TTL {
            return bad("pull_check_ttl must be at most 5m".into());
        }
        let tls = [&self.tls_cert, &self.tls_key, &self.tls_ca];
        let given = tls.iter().filter(|f| f.is_some()).count();
        if given != 0 && given != 3 {
            return bad(
                "tls_cert, tls_key and tls_ca go together: give all three for TLS between \
                 peers, or none for plain HTTP"
                    .into(),
            );
        }
        if given == 0
            && (self.tls_client_auth || self.tls_server_name.is_some() || self.tls_crl.is_some())
        {
            return bad(
                "tls_client_auth, tls_server_name and tls_crl need tls_cert, tls_key and tls_ca"
                    .into(),
            );
        }
        if let Some(name) = &self.tls_server_name
            && rustls::pki_types::ServerName::try_from(name.as_str()).is_err()
        {
            return bad(format!(
                "tls_server_name: {name:?} is not a DNS name or IP address"
            ));
        }
        if let Some(dns) = &self.peers_dns
            && !is_host_port(dns)
        {
            return bad(format!(
                "peers_dns: {dns:?} is not name:port (a headless service such as \
                 ferry-peers.kube-system.svc.cluster.local:7050)"
            ));
        }
        if self.peers_dns_refresh < Duration::from_secs(1)
            || self.peers_dns_refresh > Duration::from_secs(3600)
        {
            return bad("peers_dns_refresh must be between 1s and 1h".into());
        }
        if self.gossip {
            for seed in &self.gossip_seeds {
                if !is_host_port(seed) {
                    return bad(format!("gossip_seeds: {seed:?} is not host:port"));
                }
            }
            if self.gossip_seeds.len() > 1024 {
                return bad("gossip_seeds: more than 1024".into());
            }
            if self.gossip_advertise().is_none() {
                return bad(
                    "gossip_advertise: gossip_listen is a wildcard and self_name is not an \
                     IP address; give the address other daemons send gossip to"
                        .into(),
                );
            }
            let ms = Duration::from_millis;
            if self.gossip_probe_period < ms(100) || self.gossip_probe_period > ms(60_000) {
                return bad("gossip_probe_period must be between 100ms and 60s".into());
            }
            if self.gossip_interval < ms(10) || self.gossip_interval > ms(60_000) {
                return bad("gossip_interval must be between 10ms and 60s".into());
            }
            if self.gossip_suspect_after < self.gossip_probe_period
                || self.gossip_suspect_after > ms(600_000)
            {
                return bad(
                    "gossip_suspect_after must be between gossip_probe_period and 10m".into(),
                );
            }
            if !(1..=100_000).contains(&self.gossip_max_members) {
                return bad("gossip_max_members must be between 1 and 100000".into());
            }
            if self.gossip_max_skew < ms(1000) || self.gossip_max_skew > ms(600_000) {
                return bad("gossip_max_skew must be between 1s and 10m".into());
            }
        }
        Ok(())
    }

    /// The address other daemons send this one's gossip to (see `gossip_advertise`).
    pub fn gossip_advertise(&self) -> Option<SocketAddr> {
        if let Some(a) = self.gossip_advertise {
            return Some(a);
        }
        if !self.gossip_listen.ip().is_unspecified() {
            return Some(self.gossip_listen);
        }
        let name = self.self_name();
        let (host, _) = name.rsplit_once(':')?;
        let ip: std::net::IpAddr = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()?;
        (!ip.is_unspecified()).then(|| SocketAddr::new(ip, self.gossip_listen.port()))
    }

    /// The TLS files, when peers talk TLS (all three given; checked by `validate`).
    pub fn tls_files(&self) -> Option<crate::p2p::tls::TlsFiles> {
        Some(crate::p2p::tls::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
            client_auth: self.tls_client_auth,
            server_name: self.tls_server_name.clone(),
            crl: self.tls_crl.clone(),
        })
    }
}

/// `host:port` with a non-empty host, a port number and no path or whitespace.
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && port.parse::<u16>().is_ok()
        && s.len() <= 255
        && !s.contains(['/', '@', '?', '#'])
        && !s.contains(char::is_whitespace)
}

/// Longest accepted `trace.max_duration`.
const MAX_TRACE_DURATION: Duration = Duration::from_secs(3600);

/// `[registry]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistrySection {
    /// `host[:port]` of registries spoken to over plain HTTP (loopback ones always are).
    pub plain_http: Vec<String>,
    /// containerd's registry host directory (`<dir>/<host[:port]>/hosts.toml`: mirrors,
    /// `server`, CA and client certificates), read so that one configuration serves
    /// containerd and ferry. A missing directory means none; `""` turns it off.
    pub config_path: PathBuf,
    /// The kubelet's credential provider config (its `--image-credential-provider-config`,
    /// a `CredentialProviderConfig`): plugins asked for credentials of repositories that
    /// neither explicit config nor auth files cover, cached in memory only. `""`: off.
    pub credential_provider_config: PathBuf,
    /// Where those plugins are (the kubelet's `--image-credential-provider-bin-dir`).
    pub credential_provider_bin_dir: PathBuf,
}

impl Default for RegistrySection {
    fn default() -> Self {
        RegistrySection {
            plain_http: Vec::new(),
            config_path: PathBuf::from(ferry_registry_client::hosts::DEFAULT_CONFIG_PATH),
            credential_provider_config: PathBuf::new(),
            credential_provider_bin_dir: PathBuf::new(),
        }
    }
}

impl DaemonConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml(text: &str) -> Result<DaemonConfig> {
        let config: DaemonConfig =
            toml::from_str(text).map_err(|e| Error::Config(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<DaemonConfig> {
        use std::io::Read;
        let file = std::fs::File::open(path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(Error::Config(format!(
                "{} is larger than {MAX_CONFIG_BYTES} bytes",
                path.display()
            )));
        }
        Self::from_toml(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Checks bounds the types cannot express.
    pub fn validate(&self) -> Result<()> {
        let range = |name: &str, v: usize| {
            if v == 0 || v > MAX_PARALLELISM {
                Err(Error::Config(format!(
                    "{name} must be between 1 and {MAX_PARALLELISM}, not {v}"
                )))
            } else {
                Ok(())
            }
        };
        range("fetch.concurrency", self.fetch.concurrency)?;
        range("fetch.layer_concurrency", self.fetch.layer_concurrency)?;
        range("fuse.threads", self.fuse.threads)?;
        range("warm.concurrency", self.warm.concurrency)?;
        if self.fetch.request_size == 0 || self.fetch.request_size > MAX_REQUEST_SIZE {
            return Err(Error::Config(format!(
                "fetch.request_size must be between 1 byte and 1G, not {}",
                self.fetch.request_size
            )));
        }
        if self.fetch.timeout < Duration::from_millis(100) {
            return Err(Error::Config("fetch.timeout must be at least 100ms".into()));
        }
        if self.store.max_bytes == 0 {
            return Err(Error::Config("store.max_bytes must be positive".into()));
        }
        if let Some(seed) = &self.store.seed {
            if !seed.is_absolute() {
                return Err(Error::Config(format!(
                    "store.seed must be an absolute path to a directory written by \
                     `ferry store export`, not {:?}",
                    seed.display().to_string()
                )));
            }
            if self.store.path.as_deref() == Some(seed.as_path()) {
                return Err(Error::Config(format!(
                    "store.seed and store.path are both {}: the seed is a read-only export \
                     beside the live store, not the store itself",
                    seed.display()
                )));
            }
        }
        if self.cri.enabled && self.cri.socket == self.cri.runtime_socket {
            return Err(Error::Config(format!(
                "cri.socket and cri.runtime_socket are both {}: the proxy would call itself; \
                 point the kubelet at another path (default /run/ferry/cri.sock)",
                self.cri.socket.display()
            )));
        }
        let t = &self.trace;
        if t.quiet < Duration::from_millis(100) || t.quiet > t.max_duration {
            return Err(Error::Config(format!(
                "trace.quiet must be at least 100ms and at most trace.max_duration ({}), not {}",
                format_duration(t.max_duration),
                format_duration(t.quiet)
            )));
        }
        if t.max_duration > MAX_TRACE_DURATION {
            return Err(Error::Config(format!(
                "trace.max_duration must be at most {}, not {}",
                format_duration(MAX_TRACE_DURATION),
                format_duration(t.max_duration)
            )));
        }
        if t.store_entries == 0 || t.store_entries > 100_000 {
            return Err(Error::Config(format!(
                "trace.store_entries must be between 1 and 100000, not {}",
                t.store_entries
            )));
        }
        if t.store_bytes < 1 << 20 {
            return Err(Error::Config(format!(
                "trace.store_bytes must be at least 1M, not {}",
                format_size(t.store_bytes)
            )));
        }
        self.p2p.validate()?;
        for host in &self.registry.plain_http {
            if host.is_empty() || host.contains('/') || host.contains(char::is_whitespace) {
                return Err(Error::Config(format!(
                    "registry.plain_http: {host:?} is not host[:port]"
                )));
            }
        }
        if !self
            .registry
            .credential_provider_config
            .as_os_str()
            .is_empty()
            && self
                .registry
                .credential_provider_bin_dir
                .as_os_str()
                .is_empty()
        {
            return Err(Error::Config(
                "registry.credential_provider_config needs registry.credential_provider_bin_dir \
                 (the kubelet's --image-credential-provider-bin-dir)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The store directory: [`DaemonConfig::store_path_flag`], else
    /// [`StoreConfig::resolve_path`] (`FERRY_STORE`, then `store.path`, then the per-user
    /// default).
    pub fn store_path(&self) -> PathBuf {
        match &self.store_path_flag {
            Some(p) => p.clone(),
            None => self.store.resolve_path(),
        }
    }

    /// The control socket (`control.socket`, else [`default_control_socket`]).
    pub fn control_socket(&self) -> PathBuf {
        self.control
            .socket
            .clone()
            .unwrap_or_else(default_control_socket)
    }

    /// The fd holder's socket (`fuse.holder_socket`, else `fdstore.sock` beside the
    /// control socket).
    pub fn holder_socket(&self) -> PathBuf {
        self.fuse
            .holder_socket
            .clone()
            .unwrap_or_else(|| self.control_socket().with_file_name("fdstore.sock"))
    }

    /// This config with every defaulted path made concrete (what `--print-config` shows).
    pub fn resolved(&self) -> DaemonConfig {
        let mut out = self.clone();
        out.store.path = Some(self.store_path());
        out.store_path_flag = None;
        out.control.socket = Some(self.control_socket());
        out.fuse.holder_socket = Some(self.holder_socket());
        out.holder_program = None;
        out
    }

    /// The config as TOML. Settings that are off by default and have no value to print
    /// (TOML has no null) are shown as comments, so `--print-config` names them too.
    pub fn to_toml(&self) -> Result<String> {
        let text =
            toml::to_string(self).map_err(|e| Error::Config(format!("cannot print: {e}")))?;
        Ok(match self.store.seed {
            Some(_) => text,
            None => text.replacen("[store]\n", &format!("[store]\n{UNSET_SEED}\n"), 1),
        })
    }

    /// The lazy filesystem's fetch knobs.
    pub fn fetch_config(&self) -> FetchConfig {
        FetchConfig {
            concurrency: self.fetch.concurrency,
            layer_concurrency: self.fetch.layer_concurrency.min(self.fetch.concurrency),
            max_request_bytes: self.fetch.request_size,
            timeout: self.fetch.timeout,
            // A window is fetched in one request.
            readahead_bytes: self.fetch.readahead.min(self.fetch.request_size),
            whole_file_bytes: self.fetch.whole_file,
            nearby_bytes: self.fetch.nearby,
        }
    }

    /// The registry client's config.
    pub fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig {
            max_concurrent_downloads: self.fetch.concurrency,
            ..ClientConfig::default()
        };
        for host in &self.registry.plain_http {
            cfg.registry.entry(host.clone()).or_default().plain_http = true;
        }
        cfg.config_path =
            Some(self.registry.config_path.clone()).filter(|p| !p.as_os_str().is_empty());
        let set = |p: &PathBuf| Some(p.clone()).filter(|p| !p.as_os_str().is_empty());
        cfg.credential_provider_config = set(&self.registry.credential_provider_config);
        cfg.credential_provider_bin_dir = set(&self.registry.credential_provider_bin_dir);
        cfg
    }
}

/// The default control socket: `/run/ferry/daemon.sock` for root, else
/// `$XDG_RUNTIME_DIR/ferry/daemon.sock`, else `/tmp/ferry-$UID/daemon.sock`.
pub fn default_control_socket() -> PathBuf {
    let uid = nix::unistd::getuid().as_raw();
    control_socket_for(uid, std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from))
}

fn control_socket_for(uid: u32, runtime_dir: Option<PathBuf>) -> PathBuf {
    if uid == 0 {
        return PathBuf::from("/run/ferry/daemon.sock");
    }
    match runtime_dir.filter(|p| p.is_absolute()) {
        Some(dir) => dir.join("ferry/daemon.sock"),
        None => PathBuf::from(format!("/tmp/ferry-{uid}/daemon.sock")),
    }
}

/// A number or a text, for fields that take either.
#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrText {
    Num(u64),
    Text(String),
}

mod size_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_size(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match super::NumOrText::deserialize(d)? {
            super::NumOrText::Num(n) => Ok(n),
            super::NumOrText::Text(t) => {
                ferry_oci::units::parse_size(&t).map_err(serde::de::Error::custom)
            }
        }
    }
}

mod duration_text {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        match super::NumOrText::deserialize(d)? {
            super::NumOrText::Num(n) => Ok(Duration::from_secs(n)),
            super::NumOrText::Text(t) => {
                ferry_oci::units::parse_duration(&t).map_err(serde::de::Error::custom)
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn empty_document_gives_the_documented_defaults() {
        let c = DaemonConfig::from_toml("").unwrap();
        assert_eq!(c, DaemonConfig::default());
        assert_eq!(c.fetch.concurrency, 8);
        assert_eq!(c.fetch.request_size, 8 << 20);
        assert_eq!(c.fetch.timeout, Duration::from_secs(30));
        assert_eq!(c.fuse.threads, 4);
        assert!(c.snapshotter.enabled);
        assert_eq!(
            c.snapshotter.socket,
            Path::new("/run/ferry/snapshotter.sock")
        );
        assert_eq!(c.snapshotter.root, Path::new("/var/lib/ferry/snapshotter"));
        assert_eq!(c.metrics.addr, None);
        assert_eq!(c.warm, WarmConfig::default());
        assert_eq!(c.store.max_bytes, ferry_store::DEFAULT_MAX_BYTES);
        assert!(c.trace.auto_record);
        assert_eq!(c.trace.quiet, Duration::from_secs(3));
        assert_eq!(c.trace.max_duration, Duration::from_secs(60));
        assert_eq!(c.trace.store_entries, 256);
        assert_eq!(c.trace.store_bytes, 64 << 20);
        c.validate().unwrap();
    }

    #[test]
    fn overrides_are_read_in_every_section() {
        let c = DaemonConfig::from_toml(
            r#"
            [store]
            path = "/s"
            max_bytes = 1048576
            [fetch]
            concurrency = 3
            layer_concurrency = 5
            request_size = "512K"
            timeout = "1500ms"
            [fuse]
            threads = 2
            [warm]
            prefetch = false
            background_fill = false
            concurrency = 2
            fill_bytes_per_sec = 1000
            [control]
            socket = "/c.sock"
            [metrics]
            addr = "127.0.0.1:9109"
            [snapshotter]
            enabled = false
            socket = "/snap.sock"
            root = "/root"
            [registry]
            plain_http = ["reg.local:5000"]
            config_path = "/etc/ferry/certs.d"
            [trace]
            auto_record = false
            quiet = "500ms"
            max_duration = "2m"
            store_entries = 8
            store_bytes = "4M"
            "#,
        )
        .unwrap();
        assert!(!c.trace.auto_record);
        assert_eq!(c.trace.quiet, Duration::from_millis(500));
        assert_eq!(c.trace.max_duration, Duration::from_secs(120));
        assert_eq!((c.trace.store_entries, c.trace.store_bytes), (8, 4 << 20));
        assert_eq!(c.store.path.as_deref(), Some(Path::new("/s")));
        assert_eq!(c.store.max_bytes, 1 << 20);
        assert_eq!(c.fetch_config().concurrency, 3);
        // No more for one layer than for the whole image.
        assert_eq!(c.fetch_config().layer_concurrency, 3);
        assert_eq!(c.fetch_config().max_request_bytes, 512 << 10);
        assert_eq!(c.fetch_config().timeout, Duration::from_millis(1500));
        assert_eq!(c.fuse.threads, 2);
        assert!(!c.warm.prefetch && !c.warm.background_fill);
        assert_eq!(c.warm.fill_bytes_per_sec, 1000);
        assert_eq!(c.control_socket(), Path::new("/c.sock"));
        assert_eq!(c.metrics.addr, Some("127.0.0.1:9109".parse().unwrap()));
        assert!(!c.snapshotter.enabled);
        assert_eq!(c.snapshotter.root, Path::new("/root"));
        let client = c.client_config();
        assert!(client.registry["reg.local:5000"].plain_http);
        assert_eq!(client.max_concurrent_downloads, 3);
        assert_eq!(
            client.config_path.as_deref(),
            Some(Path::new("/etc/ferry/certs.d"))
        );
        assert_eq!(client.credential_provider_config, None, "off by default");
        let kubelet = DaemonConfig::from_toml(
            "[registry]\ncredential_provider_config = \"/etc/kubernetes/credential-providers.yaml\"\n\
             credential_provider_bin_dir = \"/usr/libexec/kubernetes/kubelet-plugins/credential-provider/exec\"\n",
        )
        .unwrap()
        .client_config();
        assert_eq!(
            kubelet.credential_provider_config.as_deref(),
            Some(Path::new("/etc/kubernetes/credential-providers.yaml"))
        );
        assert!(kubelet.credential_provider_bin_dir.is_some());
        assert!(
            DaemonConfig::from_toml("[registry]\ncredential_provider_config = \"/x.yaml\"\n")
                .unwrap_err()
                .to_string()
                .contains("credential_provider_bin_dir")
        );
        let off = DaemonConfig::from_toml("[registry]\nconfig_path = \"\"\n").unwrap();
        assert_eq!(off.client_config().config_path, None, "\"\" turns it off");
        assert_eq!(
            DaemonConfig::default()
                .client_config()
                .config_path
                .as_deref(),
            Some(Path::new("/etc/containerd/certs.d")),
            "containerd's default"
        );
        // Numbers are accepted where texts are.
        let n = DaemonConfig::from_toml("[fetch]\nrequest_size = 4096\ntimeout = 7\n").unwrap();
        assert_eq!(n.fetch.request_size, 4096);
        assert_eq!(n.fetch.timeout, Duration::from_secs(7));
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        for (doc, needle) in [
            ("[fetch]\nconcurency = 3", "concurency"),
            ("[nope]\n", "nope"),
            ("[fetch]\nrequest_size = \"8X\"", "not a size"),
            ("[fetch]\ntimeout = \"soon\"", "not a duration"),
            ("[fetch]\nconcurrency = 0", "fetch.concurrency"),
            ("[fetch]\nlayer_concurrency = 0", "fetch.layer_concurrency"),
            ("[fuse]\nthreads = 100000", "fuse.threads"),
            ("[fetch]\nrequest_size = \"2G\"", "request_size"),
            ("[fetch]\ntimeout = \"10ms\"", "timeout"),
            ("[metrics]\naddr = \"not an address\"", "addr"),
            ("[registry]\nplain_http = [\"http://x/\"]", "plain_http"),
            ("[store]\nmax_bytes = 0", "max_bytes"),
            ("[trace]\nquiet = \"10ms\"", "trace.quiet"),
            (
                "[trace]\nquiet = \"2m\"\nmax_duration = \"1m\"",
                "trace.quiet",
            ),
            ("[trace]\nmax_duration = \"2h\"", "trace.max_duration"),
            ("[trace]\nstore_entries = 0", "trace.store_entries"),
            ("[trace]\nstore_bytes = \"1K\"", "trace.store_bytes"),
            ("[trace]\nrecord = true", "record"),
            ("this is not toml", ""),
        ] {
            let err = DaemonConfig::from_toml(doc).unwrap_err().to_string();
            assert!(err.contains(needle), "{doc:?}: {err}");
        }
    }

    #[test]
    fn printed_config_reads_back_identically() {
        let mut c = DaemonConfig::default();
        c.fetch.request_size = 3 << 20;
        c.fetch.timeout = Duration::from_millis(2500);
        c.metrics.addr = Some("127.0.0.1:1".parse().unwrap());
        let resolved = c.resolved();
        assert!(resolved.store.path.is_some() && resolved.control.socket.is_some());
        let flagged = DaemonConfig {
            store_path_flag: Some("/flag".into()),
            ..DaemonConfig::default()
        };
        assert_eq!(flagged.store_path(), Path::new("/flag"));
        assert_eq!(
            flagged.resolved().store.path.as_deref(),
            Some(Path::new("/flag"))
        );
        let text = resolved.to_toml().unwrap();
        assert!(text.contains("request_size = \"3M\""), "{text}");
        assert!(text.contains("timeout = \"2500ms\""), "{text}");
        assert_eq!(DaemonConfig::from_toml(&text).unwrap(), resolved);
    }

    #[test]
    fn a_seed_store_is_an_absolute_path_apart_from_the_store_and_printed_when_unset() {
        let c = DaemonConfig::from_toml("[store]\npath = \"/s\"\nseed = \"/vol/seed\"\n").unwrap();
        assert_eq!(c.store.seed.as_deref(), Some(Path::new("/vol/seed")));
        let text = c.resolved().to_toml().unwrap();
        assert!(text.contains("seed = \"/vol/seed\""), "{text}");
        assert!(!text.contains("# seed"), "{text}");
        assert_eq!(DaemonConfig::from_toml(&text).unwrap(), c.resolved());
        for (doc, needle) in [
            (
                "[store]\nseed = \"vol/seed\"",
                "store.seed must be an absolute path",
            ),
            (
                "[store]\nseed = \"\"",
                "store.seed must be an absolute path",
            ),
            (
                "[store]\npath = \"/s\"\nseed = \"/s\"",
                "not the store itself",
            ),
            ("[store]\nseed = 3", "seed"),
            ("[store]\nseeds = \"/vol/seed\"", "seeds"),
        ] {
            let err = DaemonConfig::from_toml(doc).unwrap_err().to_string();
            assert!(err.contains(needle), "{doc:?}: {err}");
        }
        // No seed by default, and --print-config says so in a comment that reads back.
        let d = DaemonConfig::default();
        assert_eq!(d.store.seed, None);
        let text = d.resolved().to_toml().unwrap();
        let store_section = text.split("[store]\n").nth(1).unwrap();
        assert!(store_section.starts_with("# seed = "), "{text}");
        assert_eq!(DaemonConfig::from_toml(&text).unwrap(), d.resolved());
    }

    #[test]
    fn connections_are_kept_by_a_holder_beside_the_control_socket_by_default() {
        let mut c = DaemonConfig::default();
        assert!(c.fuse.keep_connections);
        c.control.socket = Some("/run/x/daemon.sock".into());
        assert_eq!(c.holder_socket(), Path::new("/run/x/fdstore.sock"));
        assert_eq!(
            c.resolved().fuse.holder_socket.as_deref(),
            Some(Path::new("/run/x/fdstore.sock"))
        );
        let t = DaemonConfig::from_toml(
            "[fuse]\nkeep_connections = false\nholder_socket = \"/h.sock\"\n",
        )
        .unwrap();
        assert!(!t.fuse.keep_connections);
        assert_eq!(t.holder_socket(), Path::new("/h.sock"));
    }

    #[test]
    fn control_socket_defaults_by_user() {
        assert_eq!(
            control_socket_for(0, None),
            Path::new("/run/ferry/daemon.sock")
        );
        assert_eq!(
            control_socket_for(1000, Some("/run/user/1000".into())),
            Path::new("/run/user/1000/ferry/daemon.sock")
        );
        assert_eq!(
            control_socket_for(1000, Some("relative".into())),
            Path::new("/tmp/ferry-1000/daemon.sock")
        );
    }

    #[test]
    fn the_p2p_section_is_off_by_default_and_checked_when_on() {
        let c = DaemonConfig::from_toml("").unwrap();
        assert!(!c.p2p.enabled);
        assert_eq!((c.p2p.roots, c.p2p.fan_out), (2, 4));
        let c = DaemonConfig::from_toml(
            r#"
            [p2p]
            enabled = true
            listen = "10.0.0.5:7050"
            peers = ["10.0.0.6:7050", "node-7:7050"]
            token_file = "/etc/ferry/p2p-token"
            peer_timeout = "250ms"
            max_range = "4M"
            "#,
        )
        .unwrap();
        assert_eq!(c.p2p.self_name(), "10.0.0.5:7050");
        assert_eq!(c.p2p.peer_timeout, Duration::from_millis(250));
        assert_eq!(c.p2p.max_range, 4 << 20);
        for bad in [
            "[p2p]\nenabled = true",
            "[p2p]\nenabled = true\ntoken_file = \"t\"\npeers = [\"no-port\"]",
            "[p2p]\nenabled = true\ntoken_file = \"t\"\npeers = [\"http://a:1/x\"]",
            "[p2p]\nenabled = true\ntoken_file = \"t\"\nfan_out = 0",
            "[p2p]\nenabled = true\ntoken_file = \"t\"\npull_check_ttl = \"10m\"",
            "[p2p]\nenabled = true\ntoken_file = \"t\"\nmax_concurrent = 0",
        ] {
            assert!(DaemonConfig::from_toml(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn p2p_tls_and_dns_settings_are_read_and_checked() {
        let c = DaemonConfig::from_toml("").unwrap();
        assert_eq!(c.p2p.tls_files(), None, "plain HTTP by default");
        assert_eq!(c.p2p.peers_dns_refresh, Duration::from_secs(30));
        let on = "[p2p]\nenabled = true\ntoken_file = \"t\"\n";
        let c = DaemonConfig::from_toml(&format!(
            "{on}tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\ntls_ca = \"/ca.pem\"\n\
             tls_client_auth = true\ntls_server_name = \"ferry-peer\"\n\
             tls_crl = \"/ca.crl\"\n\
             peers_dns = \"ferry-peers.kube-system.svc.cluster.local:7050\"\n\
             peers_dns_refresh = \"10s\"\n"
        ))
        .unwrap();
        let files = c.p2p.tls_files().unwrap();
        assert_eq!(files.key, Path::new("/k.pem"));
        assert!(files.client_auth);
        assert_eq!(files.server_name.as_deref(), Some("ferry-peer"));
        assert_eq!(files.crl.as_deref(), Some(Path::new("/ca.crl")));
        assert_eq!(c.p2p.peers_dns_refresh, Duration::from_secs(10));
        // The printed config reads back, TLS and DNS settings included.
        assert_eq!(
            DaemonConfig::from_toml(&c.to_toml().unwrap()).unwrap(),
            c,
            "round trip"
        );
        for (bad, needle) in [
            ("tls_cert = \"/c.pem\"", "go together"),
            ("tls_cert = \"/c\"\ntls_key = \"/k\"", "go together"),
            ("tls_client_auth = true", "need tls_cert"),
            ("tls_server_name = \"x\"", "need tls_cert"),
            ("tls_crl = \"/crl.pem\"", "need tls_cert"),
            (
                "tls_cert = \"/c\"\ntls_key = \"/k\"\ntls_ca = \"/a\"\ntls_server_name = \"a b\"",
                "tls_server_name",
            ),
            ("peers_dns = \"no-port\"", "peers_dns"),
            ("peers_dns = \"http://x:1/\"", "peers_dns"),
            (
                "peers_dns = \"x:1\"\npeers_dns_refresh = \"100ms\"",
                "peers_dns_refresh",
            ),
        ] {
            let err = DaemonConfig::from_toml(&format!("{on}{bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    #[test]
    fn p2p_gossip_settings_are_off_by_default_read_and_checked() {
        let c = DaemonConfig::from_toml("").unwrap();
        assert!(!c.p2p.gossip);
        assert_eq!(c.p2p.gossip_max_members, 10_000);
        let on = "[p2p]\nenabled = true\ntoken_file = \"t\"\ngossip = true\n";
        let c = DaemonConfig::from_toml(&format!(
            "{on}self_name = \"10.0.0.5:7050\"\ngossip_seeds = [\"10.0.0.6:7946\", \"seed.svc:7946\"]\n\
             gossip_interval = \"100ms\"\ngossip_suspect_after = \"3s\"\n"
        ))
        .unwrap();
        assert_eq!(
            c.p2p.gossip_advertise(),
            Some("10.0.0.5:7946".parse().unwrap()),
            "self_name's IP at the gossip port"
        );
        assert_eq!(c.p2p.gossip_interval, Duration::from_millis(100));
        assert_eq!(
            DaemonConfig::from_toml(&c.to_toml().unwrap()).unwrap(),
            c,
            "round trip"
        );
        let c =
            DaemonConfig::from_toml(&format!("{on}gossip_listen = \"10.0.0.7:9000\"\n")).unwrap();
        assert_eq!(
            c.p2p.gossip_advertise(),
            Some("10.0.0.7:9000".parse().unwrap())
        );
        for (bad, needle) in [
            ("", "gossip_advertise"),
            ("self_name = \"node-1:7050\"", "gossip_advertise"),
            (
                "gossip_advertise = \"10.0.0.5:7946\"\ngossip_seeds = [\"x\"]",
                "gossip_seeds",
            ),
            (
                "gossip_advertise = \"10.0.0.5:7946\"\ngossip_suspect_after = \"100ms\"",
                "gossip_suspect_after",
            ),
            (
                "gossip_advertise = \"10.0.0.5:7946\"\ngossip_max_members = 0",
                "gossip_max_members",
            ),
            (
                "gossip_advertise = \"10.0.0.5:7946\"\ngossip_max_skew = \"10ms\"",
                "gossip_max_skew",
            ),
        ] {
            let err = DaemonConfig::from_toml(&format!("{on}{bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }
}
