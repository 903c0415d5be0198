//! Two nodes on loopback and ferry's own registry with token auth: node B reads a
//! range of a private layer from node A's peer server, not from the registry; node A
//! checks B's forwarded registry token with the registry first. A node whose account
//! may not pull the repository is refused and goes to the registry itself.

#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_daemon::p2p::auth::{ClusterToken, PullGate, RegistryPullRights};
use ferry_daemon::p2p::fetch::{FetcherConfig, HttpPeers, PeerFetcher, PeerRangeSource};
use ferry_daemon::p2p::server::{self, PeerServer, ServerLimits};
use ferry_daemon::p2p::{BlobCatalog, P2pStats, SpanTable};
use ferry_index::source::RangeSource;
use ferry_registry::auth::{AccessRule, AuthConfig, AuthMode, htpasswd_line};
use ferry_registry::server::{Config, Server};
use ferry_registry_client::{Client, ClientConfig, Credentials, Repo};
use ferry_store::{ChunkKey, Store, StoreOptions};

const TOKEN: &str = "loopback-cluster-token-0123456789";
const SPAN: usize = 64 << 10;

fn client(registry: &str, user: &str, password: &str) -> Client {
    let mut cfg = ClientConfig {
        use_auth_files: false,
        ..ClientConfig::default()
    };
    let rc = cfg.registry.entry(registry.to_owned()).or_default();
    rc.plain_http = true;
    rc.credentials = Some(Credentials {
        username: user.into(),
        password: password.into(),
    });
    Client::new(cfg).unwrap()
}

/// Counts the registry reads a layer makes.
struct Counting {
    inner: Arc<dyn RangeSource>,
    reads: AtomicUsize,
}

impl RangeSource for Counting {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_range(&self, range: Range<u64>) -> std::io::Result<Vec<u8>> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.inner.read_range(range)
    }
}

#[test]
fn a_range_comes_from_the_peer_not_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // The registry: alice pushes team/**, bob pulls it, eve has only eve/**.
    let htpasswd = dir.path().join("htpasswd");
    let lines = [
        htpasswd_line("alice", "wonderland", 4).unwrap(),
        htpasswd_line("bob", "builder", 4).unwrap(),
        htpasswd_line("eve", "listening", 4).unwrap(),
    ];
    std::fs::write(&htpasswd, lines.join("\n") + "\n").unwrap();
    let rule = |repository: &str, user: &str, actions: &[&str]| AccessRule {
        repository: repository.into(),
        users: vec![user.into()],
        actions: actions.iter().map(|a| a.to_string()).collect(),
    };
    let mut config = Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    config.set_root(dir.path().join("registry"));
    config.auth = AuthConfig {
        enabled: Some(true),
        htpasswd: Some(htpasswd),
        secret: Some("0123456789abcdef0123456789abcdef".into()),
        mode: AuthMode::Token,
        rules: vec![
            rule("team/**", "alice", &["*"]),
            rule("team/**", "bob", &["pull"]),
            rule("eve/**", "eve", &["*"]),
        ],
        ..AuthConfig::default()
    };
    let (registry, _stop) = rt.block_on(async {
        let server = Server::bind(&config).await.unwrap();
        let addr = server.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            server
                .run(async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        (addr.to_string(), tx)
    });

    // A private layer of four spans.
    let bytes: Vec<u8> = (0..4 * SPAN).map(|i| (i * 31 % 253) as u8).collect();
    let digest = ferry_oci::sha256_digest(&bytes);
    let repo = Repo::parse(registry.clone(), "team/app").unwrap();
    let alice = client(&registry, "alice", "wonderland");
    rt.block_on(async {
        let body: ferry_registry_client::ByteStream = Box::pin(futures_util::stream::once(
            futures_util::future::ready(Ok(bytes::Bytes::from(bytes.clone()))),
        ));
        alice
            .push_blob(&repo, digest.as_ref(), bytes.len() as u64, body)
            .await
            .unwrap();
    });
    let spans: Vec<(Range<u64>, ChunkKey)> = (0..4)
        .map(|k| {
            let r = (k * SPAN) as u64..((k + 1) * SPAN) as u64;
            (r, ChunkKey::of(&bytes[k * SPAN..(k + 1) * SPAN]))
        })
        .collect();
    let table = Arc::new(SpanTable::new(bytes.len() as u64, spans.clone()).unwrap());

    // Node A holds the whole layer, verified, and serves it (its own client, as anonymous
    // as a daemon without credentials for the registry: it asks with the peer's).
    let store = Store::open_with(&dir.path().join("store-a"), StoreOptions::default()).unwrap();
    for (r, key) in &spans {
        store
            .put(key, &bytes[r.start as usize..r.end as usize])
            .unwrap();
    }
    let catalog = Arc::new(BlobCatalog::new(16));
    catalog.register(digest.clone(), &registry, table.clone());
    let a_stats = Arc::new(P2pStats::default());
    let a_client = {
        let mut cfg = ClientConfig {
            use_auth_files: false,
            ..ClientConfig::default()
        };
        cfg.registry.entry(registry.clone()).or_default().plain_http = true;
        Client::new(cfg).unwrap()
    };
    let a = PeerServer::new(
        catalog,
        Arc::new(store),
        ClusterToken::new(TOKEN).unwrap(),
        PullGate::new(
            Arc::new(RegistryPullRights { client: a_client }),
            Duration::from_secs(300),
        ),
        ServerLimits {
            max_concurrent: 16,
            request_timeout: Duration::from_secs(30),
            max_range: 16 << 20,
            arrival_wait: Duration::ZERO,
        },
        a_stats.clone(),
    );
    let a_addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = server::router(Arc::new(a));
        tokio::spawn(server::serve(listener, router, std::future::pending()));
        addr.to_string()
    });

    // A reading node: its membership is A and itself; a piece per span, one root, so for
    // each span either A is its root (and this node's parent) or this node is.
    let node = |user: &str, password: &str, self_name: &str| {
        let c = client(&registry, user, password);
        // The node has spoken to the registry (its index fetch would have), so it knows
        // how the registry authenticates.
        let _ = rt.block_on(c.blob_size(&repo, digest.as_ref()));
        let stats = Arc::new(P2pStats::default());
        let fetcher = Arc::new(
            PeerFetcher::new(
                FetcherConfig {
                    self_name: self_name.into(),
                    peers: vec![a_addr.clone()],
                    roots: 1,
                    fan_out: 1,
                    fallbacks: 1,
                    piece_size: SPAN as u64,
                    peer_timeout: Duration::from_secs(10),
                    penalty: Duration::from_secs(60),
                },
                Arc::new(
                    HttpPeers::new(
                        ClusterToken::new(TOKEN).unwrap(),
                        Duration::from_secs(5),
                        None,
                    )
                    .unwrap(),
                ),
                Arc::new(c.clone()),
                stats,
                rt.handle().clone(),
            )
            .unwrap(),
        );
        let runtime = ferry_registry_client::RangeRuntime::new().unwrap();
        let origin = Arc::new(Counting {
            inner: Arc::new(
                ferry_fs::HttpRangeSource::with_runtime(
                    c,
                    repo.clone(),
                    digest.as_ref(),
                    bytes.len() as u64,
                    &runtime,
                )
                .unwrap(),
            ),
            reads: AtomicUsize::new(0),
        });
        let source = PeerRangeSource::new(
            origin.clone(),
            fetcher.clone(),
            repo.clone(),
            digest.clone(),
            table.clone(),
        );
        (source, origin, fetcher, runtime)
    };

    // A's address (so the ranking) changes from run to run: pick this node's name so
    // that A is the parent of span 0's piece.
    let me = (1..)
        .map(|port| format!("127.0.0.2:{port}"))
        .find(|name| {
            let members = ferry_p2p::Membership::new([
                ferry_p2p::PeerId(a_addr.clone()),
                ferry_p2p::PeerId(name.clone()),
            ]);
            let schedule = ferry_p2p::Schedule::new(ferry_p2p::Topology::PieceHrw, 1, 1).unwrap();
            let tree = schedule.tree(&members, &ferry_p2p::PieceId::new(digest.clone(), 0));
            let mine = members.index_of(&ferry_p2p::PeerId(name.clone())).unwrap();
            tree.parent(mine) != ferry_p2p::Source::Origin
        })
        .unwrap();
    let range = 0..SPAN as u64;

    // Bob may pull team/app: the span comes from A.
    let (source, origin, fetcher, _rt_b) = node("bob", "builder", &me);
    let got = source.read_range(range.clone()).unwrap();
    assert_eq!(got, bytes[range.start as usize..range.end as usize]);
    assert_eq!(
        origin.reads.load(Ordering::SeqCst),
        0,
        "read from the registry"
    );
    assert_eq!(fetcher.stats().snapshot().bytes_from_peers, SPAN as u64);
    assert_eq!(a_stats.snapshot().bytes_served, SPAN as u64);

    // Eve may not: A refuses her (403) and she goes to the registry herself, which
    // refuses her too.
    let (source, origin, fetcher, _rt_e) = node("eve", "listening", &me);
    assert!(source.read_range(range.clone()).is_err());
    assert_eq!(origin.reads.load(Ordering::SeqCst), 1);
    assert_eq!(fetcher.stats().snapshot().bytes_from_peers, 0);
    assert_eq!(a_stats.snapshot().refused_forbidden, 1);
    assert_eq!(a_stats.snapshot().bytes_served, SPAN as u64);
}
