//! TLS between peers, from the attacker's side: a stranger's certificate, none at all,
//! plain HTTP, an expired certificate, a silent connection — each refused before a byte
//! of HTTP reaches the server — and the start-up checks of the TLS files. Certificates
//! are made here (rcgen), for a cluster CA and an outsider's CA.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry_p2p::PeerId;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use super::auth::ClusterToken;
use super::fetch::{HttpPeers, PeerError, PeerRequest, PeerTransport};
use super::tests::{Served, TOKEN, limits, repo, serve_with};
use super::tls::{PeerTls, TlsError, TlsFiles};

/// A CA: its certificate and key.
pub(crate) struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

pub(crate) fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca { cert, key }
}

/// What a leaf is made like.
pub(crate) struct Leaf<'a> {
    names: &'a [&'a str],
    expired: bool,
    usages: Vec<ExtendedKeyUsagePurpose>,
    /// Its serial number (random when `None`), for revoking it.
    serial: Option<u64>,
}

impl Default for Leaf<'_> {
    fn default() -> Self {
        Leaf {
            names: &["127.0.0.1"],
            expired: false,
            serial: None,
            usages: vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        }
    }
}

/// A daemon's files in `dir`: its certificate from `issuer`, its key (mode 600) and the
/// CA it trusts (`trusts`).
pub(crate) fn daemon_files(
    dir: &Path,
    tag: &str,
    issuer: &Ca,
    trusts: &Ca,
    leaf: Leaf<'_>,
) -> TlsFiles {
    let names: Vec<String> = leaf.names.iter().map(|s| s.to_string()).collect();
    let mut p = CertificateParams::new(names).unwrap();
    p.distinguished_name.push(DnType::CommonName, tag);
    p.extended_key_usages = leaf.usages;
    p.serial_number = leaf.serial.map(rcgen::SerialNumber::from);
    if leaf.expired {
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    }
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &issuer.cert, &issuer.key).unwrap();
    let write = |name: &str, text: &str| -> PathBuf {
        let path = dir.join(format!("{tag}-{name}"));
        std::fs::write(&path, text).unwrap();
        path
    };
    let key_path = write("key.pem", &key.serialize_pem());
    set_mode(&key_path, 0o600);
    TlsFiles {
        cert: write("cert.pem", &cert.pem()),
        key: key_path,
        ca: write("ca.pem", &trusts.cert.pem()),
        client_auth: false,
        server_name: None,
        crl: None,
    }
}

pub(crate) fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub(crate) fn mtls(mut f: TlsFiles) -> TlsFiles {
    f.client_auth = true;
    f
}

/// A daemon of the cluster of `ca` with mTLS on and an ordinary certificate.
pub(crate) fn member(dir: &Path, tag: &str, ca: &Ca) -> TlsFiles {
    mtls(daemon_files(dir, tag, ca, ca, Leaf::default()))
}

/// A peer server over TLS with `files` (handshakes bounded by `timeout`).
async fn tls_server(files: &TlsFiles, timeout: Duration) -> Served {
    let tls = PeerTls::load(files, Some("127.0.0.1")).unwrap();
    serve_with(limits(), None, Some((tls, timeout))).await
}

/// A peer client over TLS with `files` (`None`: plain HTTP).
fn client(files: Option<&TlsFiles>) -> HttpPeers {
    let tls = files.map(|f| PeerTls::load(f, None).unwrap().client);
    HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_secs(5),
        tls,
    )
    .unwrap()
}

/// Alice's read of bytes 0..2000 of the served blob, from `peers`.
async fn fetch(s: &Served, peers: &HttpPeers) -> Result<Vec<u8>, PeerError> {
    let repo = repo("team/app");
    let req = PeerRequest {
        repo: &repo,
        blob: &s.digest,
        range: 0..2000,
        registry_authorization: Some("Bearer alice"),
    };
    peers.fetch(&PeerId(s.addr.to_string()), &req).await
}

/// Nothing reached the HTTP layer: no status decided, no registry asked, no byte.
fn nothing_reached_http(s: &Served) {
    let st = s.stats.snapshot();
    assert_eq!(
        (
            st.bytes_served,
            st.refused_unauthenticated,
            st.refused_forbidden
        ),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(s.rights.calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn the_happy_path_serves_a_range_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = member(dir.path(), "a", &cluster);
    let peer = member(dir.path(), "b", &cluster);
    let s = tls_server(&server, Duration::from_secs(5)).await;
    assert!(s.base.starts_with("https://"));
    let got = fetch(&s, &client(Some(&peer))).await.unwrap();
    assert_eq!(got, s.bytes[..2000]);
    assert_eq!(s.stats.snapshot().bytes_served, 2000);
    // Without mTLS, the server certificate alone: the same.
    let server = daemon_files(dir.path(), "c", &cluster, &cluster, Leaf::default());
    let s = tls_server(&server, Duration::from_secs(5)).await;
    assert_eq!(
        fetch(&s, &client(Some(&peer))).await.unwrap(),
        s.bytes[..2000]
    );
}

#[tokio::test]
async fn the_cluster_token_is_still_required_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = member(dir.path(), "a", &cluster);
    let peer = member(dir.path(), "b", &cluster);
    let s = tls_server(&server, Duration::from_secs(5)).await;
    let tls = PeerTls::load(&peer, None).unwrap().client;
    let wrong = HttpPeers::new(
        ClusterToken::new("another-cluster-secret-42").unwrap(),
        Duration::from_secs(5),
        Some(tls),
    )
    .unwrap();
    assert_eq!(fetch(&s, &wrong).await, Err(PeerError::Refused(401)));
    assert_eq!(s.stats.snapshot().bytes_served, 0);
}

#[tokio::test]
async fn a_peer_with_a_certificate_from_another_ca_is_refused_at_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let (cluster, outsider) = (ca("cluster"), ca("outsider"));
    // A client whose certificate another CA signed (it trusts ours, to get that far).
    let server = member(dir.path(), "a", &cluster);
    let s = tls_server(&server, Duration::from_secs(5)).await;
    let stranger = daemon_files(dir.path(), "x", &outsider, &cluster, Leaf::default());
    // (Its own daemon would refuse to start with it: built by hand to get past that.)
    let stranger = HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_secs(5),
        Some(client_config_unchecked(&stranger)),
    )
    .unwrap();
    let err = fetch(&s, &stranger).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
    // A server whose certificate another CA signed: our client refuses it, and so
    // sends it neither the token nor the registry credential.
    let impostor = daemon_files(dir.path(), "y", &outsider, &outsider, Leaf::default());
    let s = tls_server(&impostor, Duration::from_secs(5)).await;
    let ours = daemon_files(dir.path(), "b", &cluster, &cluster, Leaf::default());
    let err = fetch(&s, &client(Some(&ours))).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused_when_mtls_is_on() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = member(dir.path(), "a", &cluster);
    let s = tls_server(&server, Duration::from_secs(5)).await;
    // Trusts the cluster CA, has the token, presents no certificate.
    let mut roots = rustls::RootCertStore::empty();
    for c in super::tls::read_certs("tls_ca", &server.ca).unwrap() {
        roots.add(c).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let anonymous = HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_secs(5),
        Some(config),
    )
    .unwrap();
    let err = fetch(&s, &anonymous).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
}

#[tokio::test]
async fn a_plain_http_client_gets_nothing_from_a_tls_server() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = daemon_files(dir.path(), "a", &cluster, &cluster, Leaf::default());
    let s = tls_server(&server, Duration::from_secs(5)).await;
    let err = fetch(&s, &client(None)).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
}

#[tokio::test]
async fn an_expired_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let expired = Leaf {
        expired: true,
        ..Leaf::default()
    };
    // An expired client certificate, under mTLS.
    let server = member(dir.path(), "a", &cluster);
    let s = tls_server(&server, Duration::from_secs(5)).await;
    let old = mtls(daemon_files(dir.path(), "old", &cluster, &cluster, expired));
    // (Loading it is refused too; a client config is built by hand to get past that.)
    let err = PeerTls::load(&old, None).unwrap_err();
    assert!(
        matches!(err, TlsError::NotTrusted { .. }) && err.to_string().contains("expired"),
        "{err}"
    );
    let old_client = client_config_unchecked(&old);
    let peers = HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_secs(5),
        Some(old_client),
    )
    .unwrap();
    let err = fetch(&s, &peers).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
    // An expired server certificate.
    let old_server = daemon_files(
        dir.path(),
        "olds",
        &cluster,
        &cluster,
        Leaf {
            expired: true,
            ..Leaf::default()
        },
    );
    let s = serve_with(
        limits(),
        None,
        Some((server_config_unchecked(&old_server), Duration::from_secs(5))),
    )
    .await;
    let ours = daemon_files(dir.path(), "b", &cluster, &cluster, Leaf::default());
    let err = fetch(&s, &client(Some(&ours))).await.unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    nothing_reached_http(&s);
}

/// A client config of `f` without [`PeerTls::load`]'s checks (to present a certificate
/// the load would refuse).
fn client_config_unchecked(f: &TlsFiles) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for c in super::tls::read_certs("tls_ca", &f.ca).unwrap() {
        roots.add(c).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            super::tls::read_certs("tls_cert", &f.cert).unwrap(),
            super::tls::read_key(&f.key).unwrap(),
        )
        .unwrap()
}

/// A server of `f` without [`PeerTls::load`]'s checks.
fn server_config_unchecked(f: &TlsFiles) -> PeerTls {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            super::tls::read_certs("tls_cert", &f.cert).unwrap(),
            super::tls::read_key(&f.key).unwrap(),
        )
        .unwrap();
    PeerTls::unchecked(server, client_config_unchecked(f))
}

#[tokio::test]
async fn a_silent_connection_is_dropped_after_the_handshake_timeout() {
    use tokio::io::AsyncReadExt;
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = member(dir.path(), "a", &cluster);
    let s = tls_server(&server, Duration::from_millis(200)).await;
    // Connects and says nothing: the server hangs up once the handshake timeout passes.
    let mut silent = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("the server should have hung up")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(started.elapsed() >= Duration::from_millis(150));
    // Meanwhile (and after) the others are served.
    let peer = member(dir.path(), "b", &cluster);
    assert!(fetch(&s, &client(Some(&peer))).await.is_ok());
}

#[tokio::test]
async fn a_server_that_never_answers_the_handshake_fails_within_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let files = daemon_files(dir.path(), "b", &cluster, &cluster, Leaf::default());
    // Accepts TCP and then says nothing.
    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mute.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((c, _)) = mute.accept().await {
            held.push(c);
        }
    });
    let tls = PeerTls::load(&files, None).unwrap().client;
    let peers = HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_millis(300),
        Some(tls),
    )
    .unwrap();
    let repo = repo("team/app");
    let digest = ferry_oci::sha256_digest(b"x");
    let req = PeerRequest {
        repo: &repo,
        blob: &digest,
        range: 0..10,
        registry_authorization: None,
    };
    let started = Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        peers.fetch(&PeerId(addr.to_string()), &req),
    )
    .await
    .expect("the connect timeout bounds the handshake")
    .unwrap_err();
    assert!(matches!(err, PeerError::Failed(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    held.abort();
}

#[tokio::test]
async fn one_name_for_every_peer_with_tls_server_name() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let named = Leaf {
        names: &["ferry-peer"],
        ..Leaf::default()
    };
    let mut server = daemon_files(dir.path(), "a", &cluster, &cluster, named);
    server.server_name = Some("ferry-peer".into());
    let tls = PeerTls::load(&server, None).unwrap();
    let s = serve_with(limits(), None, Some((tls, Duration::from_secs(5)))).await;
    // Dialled at 127.0.0.1, which its certificate does not name: refused...
    let by_address = daemon_files(dir.path(), "b", &cluster, &cluster, Leaf::default());
    assert!(fetch(&s, &client(Some(&by_address))).await.is_err());
    // ...unless every peer is checked for the cluster's one name (which its own
    // certificate carries too).
    let named = Leaf {
        names: &["ferry-peer"],
        ..Leaf::default()
    };
    let mut by_name = daemon_files(dir.path(), "c", &cluster, &cluster, named);
    by_name.server_name = Some("ferry-peer".into());
    assert_eq!(
        fetch(&s, &client(Some(&by_name))).await.unwrap(),
        s.bytes[..2000]
    );
}

#[test]
fn the_tls_files_are_checked_at_start_with_errors_that_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let (cluster, outsider) = (ca("cluster"), ca("outsider"));
    let good = daemon_files(dir.path(), "a", &cluster, &cluster, Leaf::default());
    PeerTls::load(&good, Some("127.0.0.1")).unwrap();

    // A key others can read: refused, as ssh refuses it, with the fix.
    for mode in [0o644, 0o640, 0o604, 0o620] {
        set_mode(&good.key, mode);
        let err = PeerTls::load(&good, None).unwrap_err();
        assert!(matches!(err, TlsError::KeyPermissions { .. }), "{err}");
        assert!(err.to_string().contains("chmod 600"), "{err}");
    }
    set_mode(&good.key, 0o400);
    PeerTls::load(&good, None).unwrap();

    // Another certificate's key.
    let other = daemon_files(dir.path(), "b", &cluster, &cluster, Leaf::default());
    let swapped = TlsFiles {
        key: other.key.clone(),
        ..good.clone()
    };
    let err = PeerTls::load(&swapped, None).unwrap_err();
    assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");

    // Missing and non-PEM files name the setting.
    let missing = TlsFiles {
        ca: dir.path().join("nope.pem"),
        ..good.clone()
    };
    let err = PeerTls::load(&missing, None).unwrap_err().to_string();
    assert!(
        err.contains("p2p.tls_ca") && err.contains("nope.pem"),
        "{err}"
    );
    std::fs::write(dir.path().join("junk.pem"), "not a certificate").unwrap();
    let junk = TlsFiles {
        cert: dir.path().join("junk.pem"),
        ..good.clone()
    };
    let err = PeerTls::load(&junk, None).unwrap_err().to_string();
    assert!(
        err.contains("p2p.tls_cert") && err.contains("no PEM certificate"),
        "{err}"
    );

    // A certificate the cluster CA did not sign: every peer would refuse it.
    let foreign = daemon_files(dir.path(), "x", &outsider, &cluster, Leaf::default());
    let err = PeerTls::load(&foreign, None).unwrap_err();
    assert!(matches!(err, TlsError::NotTrusted { .. }), "{err}");

    // A name peers will check that the certificate does not carry.
    let err = PeerTls::load(&good, Some("10.9.9.9"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tls_server_name"), "{err}");

    // Under mTLS the certificate must be usable by a client too.
    let server_only = daemon_files(
        dir.path(),
        "s",
        &cluster,
        &cluster,
        Leaf {
            usages: vec![ExtendedKeyUsagePurpose::ServerAuth],
            ..Leaf::default()
        },
    );
    PeerTls::load(&server_only, None).unwrap();
    let err = PeerTls::load(&mtls(server_only), None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("clientAuth"), "{err}");
}

/// A PEM revocation list of `ca` listing the serial numbers `revoked`.
fn crl_pem(ca: &Ca, number: u64, revoked: &[u64]) -> String {
    let params = rcgen::CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(2024, 1, 1),
        next_update: rcgen::date_time_ymd(2099, 1, 1),
        crl_number: rcgen::SerialNumber::from(number),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|&n| rcgen::RevokedCertParams {
                serial_number: rcgen::SerialNumber::from(n),
                revocation_time: rcgen::date_time_ymd(2024, 6, 1),
                reason_code: Some(rcgen::RevocationReason::KeyCompromise),
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    };
    params.signed_by(&ca.cert, &ca.key).unwrap().pem().unwrap()
}

/// Replaces `to`'s certificate, key and CA files with `from`'s, in place (as a renewal
/// that writes the files does), keeping the key's mode.
fn renew_in_place(from: &TlsFiles, to: &TlsFiles) {
    for (a, b) in [
        (&from.cert, &to.cert),
        (&from.key, &to.key),
        (&from.ca, &to.ca),
    ] {
        std::fs::write(b, std::fs::read(a).unwrap()).unwrap();
    }
}

/// A peer server over TLS with `files`, and its TLS (to reload it).
async fn tls_server_live(files: &TlsFiles) -> (Served, PeerTls) {
    let tls = PeerTls::load(files, Some("127.0.0.1")).unwrap();
    let s = serve_with(limits(), None, Some((tls.clone(), Duration::from_secs(5)))).await;
    (s, tls)
}

#[tokio::test]
async fn a_renewed_certificate_and_ca_are_used_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, new_ca) = (ca("cluster-2025"), ca("cluster-2026"));
    let server = daemon_files(dir.path(), "a", &old_ca, &old_ca, Leaf::default());
    let (s, tls) = tls_server_live(&server).await;
    let old_peer = daemon_files(dir.path(), "b", &old_ca, &old_ca, Leaf::default());
    let new_peer = daemon_files(dir.path(), "c", &new_ca, &new_ca, Leaf::default());
    assert_eq!(
        fetch(&s, &client(Some(&old_peer))).await.unwrap(),
        s.bytes[..2000]
    );
    assert!(!tls.reload_if_changed().unwrap(), "nothing changed yet");

    // The cluster moves to a new CA: this daemon's files are rewritten in place.
    let renewed = daemon_files(dir.path(), "a-new", &new_ca, &new_ca, Leaf::default());
    renew_in_place(&renewed, &server);
    assert!(tls.reload_if_changed().unwrap(), "the change is taken");
    assert!(!tls.reload_if_changed().unwrap(), "and only once");
    // New connections: the server presents the new certificate, so a peer still on the
    // old CA refuses it, and one on the new CA is served.
    assert!(matches!(
        fetch(&s, &client(Some(&old_peer))).await,
        Err(PeerError::Failed(_))
    ));
    assert_eq!(
        fetch(&s, &client(Some(&new_peer))).await.unwrap(),
        s.bytes[..2000]
    );
    let c = tls.counters().snapshot();
    assert_eq!((c.reloads, c.reload_failures), (1, 0), "{c:?}");
    assert!(c.handshake_failures >= 1, "the old peer's handshake: {c:?}");

    // The client side follows too: the old peer's own files renewed, its client (the
    // same configuration, reloaded) trusts the new CA.
    let old_peer_tls = PeerTls::load(&old_peer, None).unwrap();
    let peers = HttpPeers::new(
        ClusterToken::new(TOKEN).unwrap(),
        Duration::from_secs(5),
        Some(old_peer_tls.client.clone()),
    )
    .unwrap();
    assert!(fetch(&s, &peers).await.is_err());
    let renewed_b = daemon_files(dir.path(), "b-new", &new_ca, &new_ca, Leaf::default());
    renew_in_place(&renewed_b, &old_peer);
    assert!(old_peer_tls.reload_if_changed().unwrap());
    assert_eq!(fetch(&s, &peers).await.unwrap(), s.bytes[..2000]);
}

#[tokio::test]
async fn a_renewal_that_fails_the_checks_is_refused_and_the_old_files_stay_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let server = member(dir.path(), "a", &cluster);
    let peer = member(dir.path(), "b", &cluster);
    let (s, tls) = tls_server_live(&server).await;
    // Half a renewal: the new certificate is written, its key not yet.
    let next = member(dir.path(), "a-next", &cluster);
    std::fs::write(&server.cert, std::fs::read(&next.cert).unwrap()).unwrap();
    let err = tls.reload_if_changed().unwrap_err();
    assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
    // Refused once, not again at every look while the files stay so.
    assert!(!tls.reload_if_changed().unwrap());
    assert_eq!(tls.counters().snapshot().reload_failures, 1);
    // Still serving with what it had.
    assert_eq!(
        fetch(&s, &client(Some(&peer))).await.unwrap(),
        s.bytes[..2000]
    );
    // An expired certificate is refused the same way.
    let expired = daemon_files(
        dir.path(),
        "a-old",
        &cluster,
        &cluster,
        Leaf {
            expired: true,
            ..Leaf::default()
        },
    );
    renew_in_place(&expired, &server);
    let err = tls.reload_if_changed().unwrap_err();
    assert!(matches!(err, TlsError::NotTrusted { .. }), "{err}");
    // The key arrives: the renewal completes.
    renew_in_place(&next, &server);
    assert!(tls.reload_if_changed().unwrap());
    assert_eq!(
        fetch(&s, &client(Some(&peer))).await.unwrap(),
        s.bytes[..2000]
    );
    let c = tls.counters().snapshot();
    assert_eq!((c.reloads, c.reload_failures), (1, 2), "{c:?}");
}

#[tokio::test]
async fn a_revoked_peer_is_refused_at_the_handshake_once_the_crl_lists_it() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = ca("cluster");
    let mut server = member(dir.path(), "a", &cluster);
    let crl = dir.path().join("cluster.crl.pem");
    std::fs::write(&crl, crl_pem(&cluster, 1, &[])).unwrap();
    server.crl = Some(crl.clone());
    let stolen = mtls(daemon_files(
        dir.path(),
        "b",
        &cluster,
        &cluster,
        Leaf {
            serial: Some(4242),
            ..Leaf::default()
        },
    ));
    let honest = member(dir.path(), "c", &cluster);
    let (s, tls) = tls_server_live(&server).await;
    assert_eq!(
        fetch(&s, &client(Some(&stolen))).await.unwrap(),
        s.bytes[..2000]
    );

    // b's key leaks; the CA revokes its certificate and the new CRL is published.
    std::fs::write(&crl, crl_pem(&cluster, 2, &[4242])).unwrap();
    assert!(tls.reload_if_changed().unwrap());
    let before = tls.counters().snapshot().handshake_failures;
    assert!(matches!(
        fetch(&s, &client(Some(&stolen))).await,
        Err(PeerError::Failed(_))
    ));
    nothing_reached_http_since(&s, 2000);
    assert!(tls.counters().snapshot().handshake_failures > before);
    assert_eq!(
        fetch(&s, &client(Some(&honest))).await.unwrap(),
        s.bytes[..2000]
    );

    // A daemon whose own certificate is revoked is told so at start.
    let mut revoked_self = stolen.clone();
    revoked_self.crl = Some(crl.clone());
    let err = PeerTls::load(&revoked_self, None).unwrap_err();
    assert!(err.to_string().to_lowercase().contains("revoked"), "{err}");
    // A CRL file that is not one names the setting.
    std::fs::write(dir.path().join("junk.crl"), "junk").unwrap();
    server.crl = Some(dir.path().join("junk.crl"));
    let err = PeerTls::load(&server, None).unwrap_err().to_string();
    assert!(err.contains("p2p.tls_crl"), "{err}");
}

/// Only the first fetch's `served` bytes were served: the refused ones reached nothing.
fn nothing_reached_http_since(s: &Served, served: u64) {
    let st = s.stats.snapshot();
    assert_eq!(
        (
            st.bytes_served,
            st.refused_unauthenticated,
            st.refused_forbidden
        ),
        (served, 0, 0),
        "{st:?}"
    );
}
