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

use std::fmt;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
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
}

/// The loaded server and client configurations.
#[derive(Clone)]
pub struct PeerTls {
    /// For the peer server.
    pub server: Arc<ServerConfig>,
    /// For the peer client (`reqwest`'s preconfigured TLS).
    pub client: ClientConfig,
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

/// The certificates of a PEM file (at least one).
pub fn read_certs(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_limited(field, path, open(field, path)?)?;
    let certs = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(field, path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(invalid(
            field,
            path,
            "no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
        ));
    }
    Ok(certs)
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
        let chain = read_certs("tls_cert", &files.cert)?;
        let key = read_key(&files.key)?;
        let ca_certs = read_certs("tls_ca", &files.ca)?;
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
        let certified = CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider)
            .map_err(|e| mismatch(e.to_string()))?;
        // `from_der` lets a key whose public half it cannot derive through; this does not.
        certified
            .keys_match()
            .map_err(|e| mismatch(e.to_string()))?;
        check_own_certificate(files, &chain, &roots, &provider, own_name)?;

        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(setup)?;
        let builder = if files.client_auth {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                    .build()
                    .map_err(setup)?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut server = builder
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| mismatch(e.to_string()))?;
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];

        let inner = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(setup)?;
        let fixed_name = match &files.server_name {
            Some(n) => Some(
                ServerName::try_from(n.clone())
                    .map_err(|e| TlsError::Setup(format!("p2p.tls_server_name {n:?}: {e}")))?,
            ),
            None => None,
        };
        let verifier = Arc::new(PeerVerifier { inner, fixed_name });
        // The certificate is always configured: it is sent only when a server asks, so
        // turning mTLS on across a cluster node by node keeps every pair talking.
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(setup)?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)
            .map_err(|e| mismatch(e.to_string()))?;
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(PeerTls {
            server: Arc::new(server),
            client,
        })
    }

    /// An acceptor of the server configuration.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.server.clone())
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
    if files.client_auth {
        let verifier = WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots.clone()),
            Arc::new(provider.clone()),
        )
        .build()
        .map_err(setup)?;
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
    inner: Arc<WebPkiServerVerifier>,
    fixed_name: Option<ServerName<'static>>,
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
        self.inner
            .verify_server_cert(end_entity, intermediates, name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
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
        acceptor: TlsAcceptor,
        handshake_timeout: Duration,
    ) -> std::io::Result<TlsListener> {
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
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, addr)).await;
                        }
                        // A stranger's failure is not worth more than a debug line (they
                        // could fill the log otherwise).
                        Ok(Err(e)) => {
                            tracing::debug!(peer = %addr, error = %e, "p2p: TLS handshake refused")
                        }
                        Err(_) => tracing::debug!(peer = %addr, "p2p: TLS handshake timed out"),
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
