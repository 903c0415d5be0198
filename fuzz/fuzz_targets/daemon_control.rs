//! Fuzzes the daemon's control API (`ferry mount`/`umount`/`status` over its unix
//! socket): arbitrary methods, paths and bodies through the real router over an
//! in-memory mount backend, plus the mount-request checks the real backend makes
//! (`canonical_mountpoint`) and the fd holder's kept-mount records.
//!
//! Asserted: no request gets a 5xx or a panic; a 201 only answers a POST whose body is a
//! valid mount request for a known image, and the backend then holds exactly that
//! mount; every error our handlers make is a JSON `{"error": …}`; a parsed request
//! serialises back to the same request; a canonical mount point is absolute and keeps
//! the requested name; an accepted kept-mount record is for the key it was held under.
#![no_main]

use std::path::Path;
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use ferry_daemon::control::{self, DaemonInfo, ErrorBody};
use ferry_daemon::mounts::canonical_mountpoint;
use ferry_daemon::{KeptMount, LayerKind, MemoryBackend, MountBackend, MountInfo, MountRequest};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const IMAGE: &str = "reg.local/app:v1";
const LAYER: &str = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let (head, body) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Some((&m, path)) = head.split_first() else {
        return;
    };
    let method = ["GET", "POST", "DELETE", "PUT", "PATCH"][usize::from(m % 5)];
    let path = String::from_utf8_lossy(path);

    // What the parsers alone make of the body.
    if let Ok(req) = serde_json::from_slice::<MountRequest>(body) {
        let again: MountRequest =
            serde_json::from_str(&serde_json::to_string(&req).expect("serialises"))
                .expect("parses");
        assert_eq!(again, req);
        if let Ok(mp) = canonical_mountpoint(&req.mountpoint) {
            assert!(mp.is_absolute(), "{}", mp.display());
            assert_eq!(mp.file_name(), req.mountpoint.file_name());
        }
    }
    if let Ok(text) = std::str::from_utf8(body)
        && let Ok(record) = KeptMount::from_json("/mnt/x", text)
    {
        assert_eq!(record.info.mountpoint, Path::new("/mnt/x"));
    }

    let Ok(request) = http::Request::builder()
        .method(method)
        .uri(&*path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
    else {
        return;
    };
    let backend = Arc::new(MemoryBackend::new());
    backend.add_image(IMAGE, "sha256:m", &[(LAYER, LayerKind::FerryIndex)]);
    let info = DaemonInfo {
        pid: 1,
        version: "fuzz".into(),
        control_socket: "/run/ferry/daemon.sock".into(),
        metrics_addr: None,
        p2p_addr: None,
        snapshotter_socket: None,
        dead_mounts: Vec::new(),
        cri_socket: None,
    };
    let router = control::router(backend.clone(), info, None);
    let (status, bytes) = runtime().block_on(async move {
        let response = router.oneshot(request).await.expect("the router answers");
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (status, bytes)
    });
    assert!(!status.is_server_error(), "{method} {path}: {status}");
    let mounts = backend.list();
    if status == http::StatusCode::CREATED {
        assert_eq!(method, "POST");
        let req: MountRequest =
            serde_json::from_slice(body).expect("a 201 answers a valid request");
        let made: MountInfo = serde_json::from_slice(&bytes).expect("a 201 body is a MountInfo");
        assert_eq!(req.image, IMAGE);
        assert_eq!(made.mountpoint, req.mountpoint);
        assert!(made.mountpoint.is_absolute());
        assert_eq!(mounts.len(), 1);
    } else {
        assert!(mounts.is_empty(), "{status} but something was mounted");
    }
    // 400/404/409 come from our handlers and say why in JSON.
    if matches!(status.as_u16(), 400 | 409) {
        let err: ErrorBody = serde_json::from_slice(&bytes).expect("an error body");
        assert!(!err.error.is_empty());
    }
});
