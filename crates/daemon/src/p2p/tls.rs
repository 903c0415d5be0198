//! TLS between peers, optionally mutual (`[p2p] tls_cert`, `tls_key`, `tls_ca`,
//! `tls_client_auth`).
//!
//! Every daemon of a cluster holds a certificate signed by the cluster's CA. The server
//! presents it; the client trusts that CA only (never the system roots) and, when the
//! server asks (mTLS), presents its own. A peer's certificate must name the address it
//! is dialled at (an IP or DNS subject alternative name), or, with `tls_server_name`,
//! that one name, which then every daemon's certificate carries (handy when membership
//! comes from DNS and names are pod IPs). The cluster token is still required on every
//! request: TLS keeps it (and the forwarded registry credentials) from being read on the
//! wire, and mTLS refuses a stranger before it can send a byte of HTTP.
//!
//! [`PeerTls::load`] checks everything it can at start: files readable and PEM, the key
//! file not readable by group or others (as ssh refuses such keys), the key matching the
//! certificate, the certificate chaining to the CA, valid now and carrying the name
//! peers will check. [`TlsListener`] does the server's handshakes off the accept loop,
//! each under a timeout, at most [`MAX_HANDSHAKES`] at once.
//!
//! Rotation and revocation: certificates of a cluster are short-lived and renewed in
//! place (cert-manager, a Kubernetes secret's atomic symlink swap), and a stolen one is
//! revoked. The configurations handed to the server and the client never change; the
//! certificate, key, CA and CRL (`tls_crl`) they use are one [`Material`] value that
//! [`PeerTls::reload_if_changed`] replaces whole, after the same checks as at start,
//! when any file changed (the daemon looks every [`RELOAD_EVERY`]). A change that fails
//! the checks is refused, logged once and counted, and the material in use stays: a
//! half-written renewal never takes the daemon off the cluster. Connections already
//! open keep the material of their handshake; every new one uses the new material.

use std::fmt;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{
    ResolvesClientCert, WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{
    CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName, UnixTime,
};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig,
    SignatureScheme,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Longest a peer's TLS handshake may take (server side; the client's is bounded by
/// its connect timeout and the read's peer deadline).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most server handshakes in progress at once; further connections wait in the
/// kernel's backlog.
pub const MAX_HANDSHAKES: usize = 256;
/// Most bytes read of a PEM file.
const MAX_PEM_BYTES: u64 = 1 << 20;
/// How often the daemon looks whether the TLS files changed.
pub const RELOAD_EVERY: Duration = Duration::from_secs(30);

/// Why the peer TLS settings cannot be used. Each message names the setting and says
/// what to do.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("p2p.{field}: cannot read {path}: {source}")]
    Read {
        field: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("p2p.{field}: {path}: {what}")]
    Invalid {
        field: &'static str,
        path: String,
        what: String,
    },
    #[error(
        "p2p.tls_key: {path} can be read or written by group or others (mode {mode:03o}); a \
         private key must be readable by the daemon's user only: chmod 600 {path}"
    )]
    KeyPermissions { path: String, mode: u32 },
    #[error(
        "p2p.tls_key: {key} is not the key of the certificate in p2p.tls_cert {cert} ({what}); \
         give the key the certificate was issued for"
    )]
    KeyMismatch {
        key: String,
        cert: String,
        what: String,
    },
    #[error(
        "p2p.tls_cert: {cert} is not accepted under p2p.tls_ca {ca}: {what}; peers would \
         refuse this daemon (issue it from the cluster CA, renew it if it expired, and give \
         it {usage})"
    )]
    NotTrusted {
        cert: String,
        ca: String,
        what: String,
        usage: &'static str,
    },
    #[error("p2p TLS setup: {0}")]
    Setup(String),
}

/// Where the peer TLS material is, and how it is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This daemon's certificate chain (PEM), leaf first: its server and client
    /// certificate.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1), not readable by group or others.
    pub key: PathBuf,
    /// The cluster CA (PEM, one or more certificates): the only roots peers are
    /// checked against.
    pub ca: PathBuf,
    /// Require a client certificate chained to `ca` (mTLS).
    pub client_auth: bool,
    /// The name every peer's certificate is checked for, instead of the address it is
    /// dialled at.
    pub server_name: Option<String>,
    /// Certificate revocation lists of the cluster CA (PEM, one or more): a peer
    /// certificate listed there is refused, as a server's and as a client's.
    pub crl: Option<PathBuf>,
}

/// TLS counters, for `ferry status` and metrics.
#[derive(Debug, Default)]
pub struct TlsCounters {
    /// Material replaced after its files changed.
    pub reloads: AtomicU64,
    /// Changed files refused (the material in use stayed).
    pub reload_failures: AtomicU64,
    /// Server handshakes that failed or timed out (strangers, expired or revoked
    /// certificates, clients that said nothing).
    pub handshake_failures: AtomicU64,
}

/// [`TlsCounters`] at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TlsSnapshot {
    pub reloads: u64,
    pub reload_failures: u64,
    pub handshake_failures: u64,
}

impl TlsCounters {
    /// A copy of the counters.
    pub fn snapshot(&self) -> TlsSnapshot {
        TlsSnapshot {
            reloads: self.reloads.load(Ordering::Relaxed),
            reload_failures: self.reload_failures.load(Ordering::Relaxed),
            handshake_failures: self.handshake_failures.load(Ordering::Relaxed),
        }
    }
}

/// What handshakes use right now: replaced whole, never in part.
struct Material {
    certified: Arc<CertifiedKey>,
    server_verifier: Arc<WebPkiServerVerifier>,
    /// Under mTLS.
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
    /// The files it was loaded from, as they were.
    stamps: Stamps,
}

/// Identity of each TLS file (device, inode, size, modification time), symlinks
/// followed: a renewal that writes in place or swaps a link changes it.
type Stamps = Vec<Option<(u64, u64, u64, i64, i64)>>;

fn stamps(files: &TlsFiles) -> Stamps {
    use std::os::unix::fs::MetadataExt;
    [
        Some(&files.cert),
        Some(&files.key),
        Some(&files.ca),
        files.crl.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(|p| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
    })
    .collect()
}

/// The material and where it comes from, shared by the configurations' resolvers and
/// verifiers.
struct Live {
    files: TlsFiles,
    own_name: Option<String>,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<Material>>,
    /// Stamps of the last change refused, so it is logged once.
    refused: Mutex<Option<Stamps>>,
    counters: Arc<TlsCounters>,
}

impl fmt::Debug for Live {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Live").field("files", &self.files).finish()
    }
}

impl Live {
    fn now(&self) -> Arc<Material> {
        self.current.read().clone()
    }
}

/// The loaded server and client configurations.
#[derive(Clone)]
pub struct PeerTls {
    /// For the peer server.
    pub server: Arc<ServerConfig>,
    /// For the peer client (`reqwest`'s preconfigured TLS).
    pub client: ClientConfig,
    /// `None`: configurations made by hand (tests), never reloaded.
    live: Option<Arc<Live>>,
    counters: Arc<TlsCounters>,
}

impl fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerTls(..)")
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn setup(e: impl fmt::Display) -> TlsError {
    TlsError::Setup(e.to_string())
}

/// At most [`MAX_PEM_BYTES`] of an opened file.
fn read_limited(
    field: &'static str,
    path: &Path,
    file: std::fs::File,
) -> Result<Vec<u8>, TlsError> {
    let mut out = Vec::new();
    file.take(MAX_PEM_BYTES)
        .read_to_end(&mut out)
        .map_err(|source| TlsError::Read {
            field,
            path: path.display().to_string(),
            source,
        })?;
    Ok(out)
}

fn open(field: &'static str, path: &Path) -> Result<std::fs::File, TlsError> {
    std::fs::File::open(path).map_err(|source| TlsError::Read {
        field,
        path: path.display().to_string(),
        source,
    })
}

fn invalid(field: &'static str, path: &Path, what: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        field,
        path: path.display().to_string(),
        what: what.into(),
    }
}

/// The items `parse` finds in a PEM file (at least one; `what` names the kind).
fn read_pem<T>(
    field: &'static str,
    path: &Path,
    parse: impl FnOnce(&[u8]) -> Result<Vec<T>, std::io::Error>,
    what: &str,
) -> Result<Vec<T>, TlsError> {
    let pem = read_limited(field, path, open(field, path)?)?;
    let items = parse(&pem).map_err(|e| invalid(field, path, format!("not PEM: {e}")))?;
    if items.is_empty() {
        return Err(invalid(field, path, format!("no PEM {what} in it")));
    }
    Ok(items)
}

/// The certificates of a PEM file (at least one).
pub fn read_certs(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    read_pem(
        field,
        path,
        |mut pem| rustls_pemfile::certs(&mut pem).collect(),
        "certificate (-----BEGIN CERTIFICATE-----)",
    )
}

/// The certificate revocation lists of a PEM file (at least one).
pub fn read_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    read_pem(
        "tls_crl",
        path,
        |mut pem| rustls_pemfile::crls(&mut pem).collect(),
        "revocation list (-----BEGIN X509 CRL-----)",
    )
}

/// The private key of a PEM file, refused when group or others may read or write it.
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    const FIELD: &str = "tls_key";
    let file = open(FIELD, path)?;
    // The opened file's mode, not the path's: no window between the check and the read.
    let meta = file.metadata().map_err(|source| TlsError::Read {
        field: FIELD,
        path: path.display().to_string(),
        source,
    })?;
    check_key_mode(path, &meta)?;
    let pem = read_limited(FIELD, path, file)?;
    rustls_pemfile::private_key(&mut &pem[..])
        .map_err(|e| invalid(FIELD, path, format!("not PEM: {e}")))?
        .ok_or_else(|| {
            invalid(
                FIELD,
                path,
                "no PEM private key (PKCS#8, PKCS#1 or SEC1) in it",
            )
        })
}

#[cfg(unix)]
fn check_key_mode(path: &Path, meta: &std::fs::Metadata) -> Result<(), TlsError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(TlsError::KeyPermissions {
            path: path.display().to_string(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_key_mode(_: &Path, _: &std::fs::Metadata) -> Result<(), TlsError> {
    Ok(())
}

impl PeerTls {
    /// Loads and checks `files`. `own_name` is the name peers will check this daemon's
    /// certificate for (`tls_server_name`, else the host of its `self_name`); `None`:
    /// not known yet (a name from DNS), so only the chain and validity are checked.
    pub fn load(files: &TlsFiles, own_name: Option<&str>) -> Result<PeerTls, TlsError> {
        let provider = provider();
        let material = material(files, own_name, &provider)?;
        let live = Arc::new(Live {
            files: files.clone(),
            own_name: own_name.map(str::to_owned),
            provider: provider.clone(),
            current: RwLock::new(Arc::new(material)),
            refused: Mutex::new(None),
            counters: Arc::new(TlsCounters::default()),
        });
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(setup)?;
        let builder = if files.client_auth {
            builder.with_client_cert_verifier(Arc::new(LiveClientVerifier(live.clone())))
        } else {
            builder.with_no_client_auth()
        };
        let mut server = builder.with_cert_resolver(Arc::new(LiveCert(live.clone())));
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];

        let fixed_name = match &files.server_name {
            Some(n) => Some(
                ServerName::try_from(n.clone())
                    .map_err(|e| TlsError::Setup(format!("p2p.tls_server_name {n:?}: {e}")))?,
            ),
            None => None,
        };
        let verifier = Arc::new(PeerVerifier {
            live: live.clone(),
            fixed_name,
        });
        // The certificate is always configured: it is sent only when a server asks, so
        // turning mTLS on across a cluster node by node keeps every pair talking.
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(setup)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(Arc::new(LiveCert(live.clone())));
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(PeerTls {
            server: Arc::new(server),
            client,
            counters: live.counters.clone(),
            live: Some(live),
        })
    }

    /// Configurations made by hand, without [`PeerTls::load`]'s checks and never
    /// reloaded (tests present certificates the load would refuse).
    #[cfg(test)]
    pub(crate) fn unchecked(server: ServerConfig, client: ClientConfig) -> PeerTls {
        PeerTls {
            server: Arc::new(server),
            client,
            live: None,
            counters: Arc::default(),
        }
    }

    /// Loads the files again when any of them changed since the material in use was
    /// loaded, and, when they pass every check [`PeerTls::load`] makes, makes new
    /// handshakes (server and client) use them. `Ok(true)`: replaced; `Ok(false)`:
    /// nothing changed (or the same refused change again); `Err`: a change was refused
    /// and the material in use stays.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let Some(live) = &self.live else {
            return Ok(false);
        };
        let now = stamps(&live.files);
        if now == live.now().stamps || live.refused.lock().as_ref() == Some(&now) {
            return Ok(false);
        }
        match material(&live.files, live.own_name.as_deref(), &live.provider) {
            Ok(m) => {
                *live.current.write() = Arc::new(m);
                *live.refused.lock() = None;
                live.counters.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) => {
                *live.refused.lock() = Some(now);
                live.counters
                    .reload_failures
                    .fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// The TLS counters.
    pub fn counters(&self) -> Arc<TlsCounters> {
        self.counters.clone()
    }

    /// An acceptor of the server configuration.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.server.clone())
    }
}

/// Reads and checks `files` into the material handshakes use.
fn material(
    files: &TlsFiles,
    own_name: Option<&str>,
    provider: &Arc<CryptoProvider>,
) -> Result<Material, TlsError> {
    // Before reading: a file replaced while it is read shows as a change next time.
    let stamps = stamps(files);
    let chain = read_certs("tls_cert", &files.cert)?;
    let key = read_key(&files.key)?;
    let ca_certs = read_certs("tls_ca", &files.ca)?;
    let crls = match &files.crl {
        Some(p) => read_crls(p)?,
        None => Vec::new(),
    };
    let mut roots = RootCertStore::empty();
    for c in ca_certs {
        roots
            .add(c)
            .map_err(|e| invalid("tls_ca", &files.ca, format!("not a usable CA: {e}")))?;
    }
    let roots = Arc::new(roots);
    let mismatch = |what: String| TlsError::KeyMismatch {
        key: files.key.display().to_string(),
        cert: files.cert.display().to_string(),
        what,
    };
    let certified = CertifiedKey::from_der(chain.clone(), key, provider)
        .map_err(|e| mismatch(e.to_string()))?;
    // `from_der` lets a key whose public half it cannot derive through; this does not.
    certified
        .keys_match()
        .map_err(|e| mismatch(e.to_string()))?;
    let crl_error = |e: rustls::server::VerifierBuilderError| match &files.crl {
        Some(p) => invalid("tls_crl", p, e.to_string()),
        None => setup(e),
    };
    let client_verifier = if files.client_auth {
        let v: Arc<dyn ClientCertVerifier> =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                .with_crls(crls.clone())
                .only_check_end_entity_revocation()
                .allow_unknown_revocation_status()
                .build()
                .map_err(crl_error)?;
        Some(v)
    } else {
        None
    };
    check_own_certificate(
        files,
        &chain,
        &roots,
        provider,
        own_name,
        client_verifier.as_deref(),
    )?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .with_crls(crls)
        .only_check_end_entity_revocation()
        .allow_unknown_revocation_status()
        .build()
        .map_err(crl_error)?;
    Ok(Material {
        certified: Arc::new(certified),
        server_verifier,
        client_verifier,
        stamps,
    })
}

/// Looks every `every` whether `tls`'s files changed and uses them anew when they pass
/// the checks ([`PeerTls::reload_if_changed`]), until `stop`.
pub async fn watch(tls: PeerTls, every: Duration, stop: impl Future<Output = ()>) {
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(every) => {}
        }
        let t = tls.clone();
        match tokio::task::spawn_blocking(move || t.reload_if_changed()).await {
            Ok(Ok(true)) => tracing::info!(
                "p2p: TLS files changed; new connections use the new certificate, CA and CRL"
            ),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(
                error = %e,
                "p2p: TLS files changed but are refused; the ones loaded before stay in use"
            ),
            Err(e) => tracing::warn!(error = %e, "p2p: TLS reload task failed"),
        }
    }
}

/// This daemon's certificate and key, as the server presents it and as the client
/// does when a server asks: the material's of the moment.
#[derive(Debug)]
struct LiveCert(Arc<Live>);

impl ResolvesServerCert for LiveCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.now().certified.clone())
    }
}

impl ResolvesClientCert for LiveCert {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.now().certified.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The server's check of a client certificate (mTLS), with the material's CA and CRLs
/// of the moment.
#[derive(Debug)]
struct LiveClientVerifier(Arc<Live>);

impl LiveClientVerifier {
    fn inner(&self) -> Result<Arc<dyn ClientCertVerifier>, rustls::Error> {
        self.0
            .now()
            .client_verifier
            .clone()
            .ok_or_else(|| rustls::Error::General("client certificates are not checked".into()))
    }
}

impl ClientCertVerifier for LiveClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // Hints are optional; a peer presents its one certificate whatever they say.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()?
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner()?.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner()?.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner()
            .map(|v| v.supported_verify_schemes())
            .unwrap_or_default()
    }
}

/// This daemon's certificate as its peers will check it: chained to the CA, valid now,
/// for the name they will check, and (under mTLS) usable as a client certificate.
fn check_own_certificate(
    files: &TlsFiles,
    chain: &[CertificateDer<'static>],
    roots: &RootCertStore,
    provider: &CryptoProvider,
    own_name: Option<&str>,
    client_verifier: Option<&dyn ClientCertVerifier>,
) -> Result<(), TlsError> {
    let usage = if files.client_auth {
        "both the serverAuth and clientAuth extended key usages"
    } else {
        "the serverAuth extended key usage"
    };
    let not_trusted = |what: String| TlsError::NotTrusted {
        cert: files.cert.display().to_string(),
        ca: files.ca.display().to_string(),
        what,
        usage,
    };
    let (leaf, intermediates) = chain
        .split_first()
        .ok_or_else(|| invalid("tls_cert", &files.cert, "empty chain"))?;
    let parsed = ParsedCertificate::try_from(leaf).map_err(|e| not_trusted(e.to_string()))?;
    let now = UnixTime::now();
    verify_server_cert_signed_by_trust_anchor(
        &parsed,
        roots,
        intermediates,
        now,
        provider.signature_verification_algorithms.all,
    )
    .map_err(|e| not_trusted(e.to_string()))?;
    let name = files.server_name.as_deref().or(own_name);
    if let Some(name) = name
        && let Ok(server_name) = ServerName::try_from(name)
    {
        rustls::client::verify_server_name(&parsed, &server_name).map_err(|e| {
            not_trusted(format!(
                "{e}: peers dial this daemon as {name:?} (set p2p.tls_server_name to the \
                 name all peer certificates carry, or add {name:?} to its subject \
                 alternative names)"
            ))
        })?;
    }
    if let Some(verifier) = client_verifier {
        // With the CRLs: a revoked certificate of its own is refused here too.
        verifier
            .verify_client_cert(leaf, intermediates, now)
            .map_err(|e| not_trusted(format!("as a client certificate: {e}")))?;
    }
    Ok(())
}

/// The cluster CA's verifier, checking every peer for one fixed name when
/// `tls_server_name` is set (else for the address it is dialled at).
#[derive(Debug)]
struct PeerVerifier {
    live: Arc<Live>,
    fixed_name: Option<ServerName<'static>>,
}

impl PeerVerifier {
    fn inner(&self) -> Arc<WebPkiServerVerifier> {
        self.live.now().server_verifier.clone()
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name = self.fixed_name.as_ref().unwrap_or(server_name);
        self.inner()
            .verify_server_cert(end_entity, intermediates, name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

/// A listener for `axum::serve` whose connections have finished a TLS handshake. The
/// handshakes run in their own tasks, each bounded by a timeout and at most
/// [`MAX_HANDSHAKES`] at once, so a client that connects and says nothing holds one
/// slot for a while and never the accept loop.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsListener")
            .field("local", &self.local)
            .finish()
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // Closes the socket: a stopped server accepts nothing more.
        self.accepting.abort();
    }
}

impl TlsListener {
    /// Accepts on `tcp`, handshaking with `acceptor` within `handshake_timeout`. Call
    /// inside a tokio runtime.
    pub fn new(
        tcp: TcpListener,
        tls: &PeerTls,
        handshake_timeout: Duration,
    ) -> std::io::Result<TlsListener> {
        let acceptor = tls.acceptor();
        let counters = tls.counters();
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(16);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let accepting = tokio::spawn(async move {
            loop {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (stream, addr) = tokio::select! {
                    _ = tx.closed() => return,
                    accepted = tcp.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // EMFILE and the like: back off rather than spin.
                            tracing::warn!(error = %e, "p2p: accepting a connection");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let (acceptor, tx, counters) = (acceptor.clone(), tx.clone(), counters.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    let failed = || counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, addr)).await;
                        }
                        // A stranger's failure is not worth more than a debug line (they
                        // could fill the log otherwise); the counter shows how many.
                        Ok(Err(e)) => {
                            failed();
                            tracing::debug!(peer = %addr, error = %e, "p2p: TLS handshake refused")
                        }
                        Err(_) => {
                            failed();
                            tracing::debug!(peer = %addr, "p2p: TLS handshake timed out")
                        }
                    }
                });
            }
        });
        Ok(TlsListener {
            ready,
            local,
            accepting,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accepting task ended (aborted): nothing will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
