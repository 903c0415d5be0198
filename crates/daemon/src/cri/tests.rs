//! The proxy between a real HTTP/2 client and an in-process fake runtime, over Unix
//! sockets in a temporary directory.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use ferry_registry_client::pullsecrets::PullSecrets;
use futures_util::stream;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message as _;
use tokio::net::{UnixListener, UnixStream};

use super::*;

/// A fake runtime: answers every call with the request's body, the path in a header,
/// and grpc-status 0 in trailers.
async fn fake_runtime(listener: UnixListener) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let path = req.uri().path().to_owned();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let mut trailers = hyper::HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    let frames = vec![
                        Ok::<_, Infallible>(Frame::data(body)),
                        Ok(Frame::trailers(trailers)),
                    ];
                    let mut resp = Response::new(StreamBody::new(stream::iter(frames)));
                    resp.headers_mut().insert("x-path", path.parse().unwrap());
                    Ok::<_, Infallible>(resp)
                });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(s), service)
                .await;
        });
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    socket: std::path::PathBuf,
    proxy: Arc<CriProxy>,
    secrets: Arc<PullSecrets>,
}

async fn setup(with_runtime: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let runtime = dir.path().join("containerd.sock");
    if with_runtime {
        tokio::spawn(fake_runtime(UnixListener::bind(&runtime).unwrap()));
    }
    let socket = dir.path().join("cri.sock");
    let secrets = Arc::new(PullSecrets::new());
    let proxy = Arc::new(CriProxy::new(runtime, secrets.clone()));
    let listener = bind(&socket).await.unwrap();
    let (s, p) = (socket.clone(), proxy.clone());
    tokio::spawn(async move { serve(listener, p, &s, std::future::pending()).await });
    Setup {
        _dir: dir,
        socket,
        proxy,
        secrets,
    }
}

/// One call through the proxy: (headers, body, trailers).
async fn call(
    socket: &Path,
    path: &str,
    body: Bytes,
) -> (hyper::HeaderMap, Bytes, Option<hyper::HeaderMap>) {
    let stream = UnixStream::connect(socket).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .body(Full::new(body))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let headers = resp.headers().clone();
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (headers, collected.to_bytes(), trailers)
}

fn grpc_frame(msg: &[u8]) -> Bytes {
    let mut b = vec![0u8];
    b.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    b.extend_from_slice(msg);
    Bytes::from(b)
}

fn pull(image: &str, user: &str, pass: &str) -> Bytes {
    let req = PullImageRequest {
        image: Some(ImageSpec {
            image: image.into(),
        }),
        auth: Some(AuthConfig {
            username: user.into(),
            password: pass.into(),
            ..AuthConfig::default()
        }),
    };
    grpc_frame(&req.encode_to_vec())
}

#[tokio::test]
async fn a_pull_is_forwarded_unchanged_and_its_credentials_kept_for_its_repository_only() {
    let s = setup(true).await;
    let body = pull("reg.example:5000/team/app:v1", "alice", "s3cret");
    let (headers, echoed, trailers) = call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        body.clone(),
    )
    .await;
    assert_eq!(echoed, body, "the runtime got the request's bytes as sent");
    assert_eq!(headers["x-path"], "/runtime.v1.ImageService/PullImage");
    assert_eq!(
        trailers.unwrap()["grpc-status"],
        "0",
        "trailers pass through"
    );
    assert!(s.secrets.has("reg.example:5000", "team/app"));
    assert!(!s.secrets.has("reg.example:5000", "team/other"));
    assert!(!s.secrets.has("reg.example:5000", "team"));
    assert_eq!((s.proxy.captured(), s.proxy.forwarded()), (1, 1));
    // A name without a host is Docker Hub's, as containerd reads it.
    call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        pull("debian", "u", "p"),
    )
    .await;
    assert!(s.secrets.has("docker.io", "library/debian"));
}

#[tokio::test]
async fn other_calls_and_unreadable_pulls_go_through_and_keep_nothing() {
    let s = setup(true).await;
    for (path, body) in [
        (
            "/runtime.v1.ImageService/ImageStatus",
            pull("r/a/b:v1", "u", "p"),
        ),
        (
            "/runtime.v1.RuntimeService/Version",
            Bytes::from_static(b"\0\0\0\0\0"),
        ),
        (
            "/runtime.v1.ImageService/PullImage",
            Bytes::from_static(b"\x01garbage"),
        ),
        (
            "/runtime.v1.ImageService/PullImage",
            Bytes::from_static(b"\0\0\0\0\x09short"),
        ),
        (
            "/runtime.v1.ImageService/PullImage",
            pull("oci:/tmp/x:v1", "u", "p"),
        ),
        (
            "/runtime.v1.ImageService/PullImage",
            pull("r:1/anon:v1", "", ""),
        ),
    ] {
        let (headers, echoed, _) = call(&s.socket, path, body.clone()).await;
        assert_eq!(echoed, body, "{path}");
        assert_eq!(headers["x-path"], path);
    }
    assert!(s.secrets.is_empty());
    assert_eq!(s.proxy.captured(), 0);
    assert_eq!(s.proxy.forwarded(), 6);
}

#[tokio::test]
async fn an_anonymous_pull_forgets_the_repository_credentials() {
    let s = setup(true).await;
    call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        pull("r:1/a:v1", "u", "p"),
    )
    .await;
    assert!(s.secrets.has("r:1", "a"));
    call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        pull("r:1/a:v2", "", ""),
    )
    .await;
    assert!(!s.secrets.has("r:1", "a"));
}

#[tokio::test]
async fn an_oversized_pull_is_refused_and_a_missing_runtime_is_named() {
    let s = setup(false).await;
    let (headers, _, _) = call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        Bytes::from(vec![0u8; MAX_PULL_REQUEST + 1]),
    )
    .await;
    assert_eq!(headers["grpc-status"], "3");
    let (headers, _, _) = call(
        &s.socket,
        "/runtime.v1.ImageService/PullImage",
        pull("r:1/a:v1", "u", "p"),
    )
    .await;
    assert_eq!(headers["grpc-status"], "14");
    let msg = headers["grpc-message"].to_str().unwrap();
    assert!(
        msg.contains("containerd.sock") && msg.contains("containerd running"),
        "{msg}"
    );
}

#[test]
fn the_decoder_survives_any_prefix() {
    let body = pull("r:1/a:v1", "u", "p");
    for n in 0..body.len() {
        let _ = decode_pull(&body[..n]);
    }
    assert!(decode_pull(&body).is_some());
    assert!(decode_pull(&[0, 0xff, 0xff, 0xff, 0xff]).is_none());
}
