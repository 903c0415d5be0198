//! The OCI distribution-spec conformance suite's cases (its Go module cannot be fetched
//! here), each run with sha256 and sha512 digests, in process over [`MemoryStorage`]. Test
//! names follow the suite's: `blobs_<case>` for its blob API matrix, `data_<workflow>` for
//! its data workflows (push, head, pull, list, referrers, delete), and the sparse image
//! and index it pushes with every optional workflow on.

#![allow(clippy::unwrap_used)]

use axum::body::Body;
use ferry_oci::digest::{digest_like, sha256_digest, sha512_digest};
use ferry_oci::{Digest, media};
use http::{Method, StatusCode};

use super::tests::{Resp, TestApp, app, strict_app};

/// The digest algorithms every case runs with.
#[derive(Debug, Clone, Copy)]
enum Alg {
    Sha256,
    Sha512,
}

const ALGS: [Alg; 2] = [Alg::Sha256, Alg::Sha512];

impl Alg {
    fn digest(self, data: &[u8]) -> String {
        let d: Digest = match self {
            Alg::Sha256 => sha256_digest(data),
            Alg::Sha512 => sha512_digest(data),
        };
        d.to_string()
    }
}

impl TestApp {
    /// Monolithic `POST ?digest=`; returns the digest.
    async fn push_blob_as(&self, alg: Alg, repo: &str, data: &[u8]) -> String {
        let digest = alg.digest(data);
        let r = self
            .send(
                Method::POST,
                &format!("/v2/{repo}/blobs/uploads/?digest={digest}"),
                &[("content-length", &data.len().to_string())],
                data.to_vec(),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
        digest
    }

    async fn start(&self, repo: &str) -> String {
        let r = self
            .send(
                Method::POST,
                &format!("/v2/{repo}/blobs/uploads/"),
                &[("content-length", "0")],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED);
        assert_eq!(r.header("range"), "0-0");
        r.header("location").to_string()
    }

    /// PUT `doc` with the media type it names.
    async fn put_doc(&self, repo: &str, reference: &str, doc: &[u8]) -> Resp {
        let mt = serde_json::from_slice::<serde_json::Value>(doc).unwrap()["mediaType"]
            .as_str()
            .unwrap()
            .to_string();
        self.send(
            Method::PUT,
            &format!("/v2/{repo}/manifests/{reference}"),
            &[("content-type", &mt)],
            doc.to_vec(),
        )
        .await
    }

    /// The checks the suite makes after every blob push: HEAD and GET with the digest and
    /// length headers, then DELETE and a HEAD that finds nothing.
    async fn check_blob_then_delete(&self, repo: &str, digest: &str, data: &[u8]) {
        let r = self.head(&format!("/v2/{repo}/blobs/{digest}")).await;
        assert_eq!(r.status, StatusCode::OK, "{digest}");
        assert_eq!(r.header("docker-content-digest"), digest);
        assert_eq!(r.header("content-length"), data.len().to_string());
        let r = self.get(&format!("/v2/{repo}/blobs/{digest}")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(&r.body[..], data);
        assert_eq!(r.header("docker-content-digest"), digest);
        let r = self
            .send(
                Method::DELETE,
                &format!("/v2/{repo}/blobs/{digest}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.body);
        let r = self.head(&format!("/v2/{repo}/blobs/{digest}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
    }
}

fn blob(alg: Alg, tag: &str, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ tag.len() as u8 ^ matches!(alg, Alg::Sha512) as u8)
        .collect()
}

fn created_at(r: &Resp, repo: &str, digest: &str) {
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.body);
    assert_eq!(r.header("location"), format!("/v2/{repo}/blobs/{digest}"));
    assert_eq!(r.header("docker-content-digest"), digest);
}

// ------------------------------------------------------------------- blob API matrix

#[tokio::test]
async fn blobs_get_missing() {
    let t = app();
    for alg in ALGS {
        let d = alg.digest(b"never pushed");
        let r = t.get(&format!("/v2/repo/blobs/{d}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.error_code(), "BLOB_UNKNOWN");
    }
}

#[tokio::test]
async fn blobs_post_only() {
    let t = app();
    for alg in ALGS {
        let data = blob(alg, "post only", 512);
        let d = alg.digest(&data);
        let r = t
            .send(
                Method::POST,
                &format!("/v2/repo/blobs/uploads/?digest={d}"),
                &[
                    ("content-length", "512"),
                    ("content-type", "application/octet-stream"),
                ],
                data.clone(),
            )
            .await;
        created_at(&r, "repo", &d);
        t.check_blob_then_delete("repo", &d, &data).await;
    }
}

#[tokio::test]
async fn blobs_post_put() {
    let t = app();
    for alg in ALGS {
        let data = blob(alg, "post+put", 512);
        let d = alg.digest(&data);
        let loc = t.start("repo").await;
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[("content-length", "512")],
                data.clone(),
            )
            .await;
        created_at(&r, "repo", &d);
        t.check_blob_then_delete("repo", &d, &data).await;
    }
}

/// Chunked uploads: one chunk, several in order (with and without the last one sent
/// with the PUT), and an out-of-order chunk refused with 416 and the current range.
#[tokio::test]
async fn blobs_chunked_single_multi_and_out_of_order() {
    let t = app();
    for alg in ALGS {
        for (case, chunks, put_last, out_of_order) in [
            ("chunked single", 1, false, false),
            ("chunked multi", 3, false, false),
            ("chunked multi and put chunk", 3, true, false),
            ("chunked out-of-order", 3, false, true),
            ("chunked out-of-order and put chunk", 3, true, true),
        ] {
            let data = blob(alg, case, 3 * 100 - 5);
            let d = alg.digest(&data);
            let mut loc = t.start("repo").await;
            let parts: Vec<&[u8]> = data.chunks(data.len().div_ceil(chunks)).collect();
            let (body_parts, last) = if put_last {
                (&parts[..parts.len() - 1], Some(parts[parts.len() - 1]))
            } else {
                (&parts[..], None)
            };
            let mut at = 0usize;
            for (i, part) in body_parts.iter().enumerate() {
                if out_of_order && i == 1 {
                    // The suite sends a later chunk first: refused, the range unchanged.
                    let skip = at + part.len();
                    let r = t
                        .send(
                            Method::PATCH,
                            &loc,
                            &[
                                ("content-range", &format!("{skip}-{}", skip + 9)),
                                ("content-length", "10"),
                            ],
                            vec![0u8; 10],
                        )
                        .await;
                    assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE, "{case}");
                    assert_eq!(r.header("range"), format!("0-{}", at - 1));
                }
                let range = format!("{at}-{}", at + part.len() - 1);
                let r = t
                    .send(
                        Method::PATCH,
                        &loc,
                        &[
                            ("content-range", &range),
                            ("content-length", &part.len().to_string()),
                            ("content-type", "application/octet-stream"),
                        ],
                        part.to_vec(),
                    )
                    .await;
                assert_eq!(r.status, StatusCode::ACCEPTED, "{case} {alg:?}");
                at += part.len();
                assert_eq!(r.header("range"), format!("0-{}", at - 1), "Range on 202");
                assert!(!r.header("location").is_empty());
                loc = r.header("location").to_string();
            }
            let body = last.map(<[u8]>::to_vec).unwrap_or_default();
            let r = t
                .send(
                    Method::PUT,
                    &format!("{loc}?digest={d}"),
                    &[("content-length", &body.len().to_string())],
                    body,
                )
                .await;
            created_at(&r, "repo", &d);
            t.check_blob_then_delete("repo", &d, &data).await;
        }
    }
}

#[tokio::test]
async fn blobs_stream() {
    let t = app();
    for alg in ALGS {
        let data = blob(alg, "stream", 700);
        let d = alg.digest(&data);
        let loc = t.start("repo").await;
        let r = t.send(Method::PATCH, &loc, &[], data.clone()).await;
        assert_eq!(r.status, StatusCode::ACCEPTED);
        assert_eq!(r.header("range"), "0-699");
        let loc = r.header("location").to_string();
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[("content-length", "0")],
                Body::empty(),
            )
            .await;
        created_at(&r, "repo", &d);
        t.check_blob_then_delete("repo", &d, &data).await;
    }
}

/// The spec's hint for a non-sha256 chunked push: `?digest-algorithm=` on the POST.
#[tokio::test]
async fn blobs_chunked_with_digest_algorithm_parameter() {
    let t = app();
    let r = t
        .send(
            Method::POST,
            "/v2/repo/blobs/uploads/?digest-algorithm=sha512",
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let loc = r.header("location").to_string();
    let r = t.send(Method::PATCH, &loc, &[], "abc").await;
    let loc = r.header("location").to_string();
    let d = Alg::Sha512.digest(b"abc");
    let r = t
        .send(
            Method::PUT,
            &format!("{loc}?digest={d}"),
            &[],
            Body::empty(),
        )
        .await;
    created_at(&r, "repo", &d);
    let r = t
        .send(
            Method::POST,
            "/v2/repo/blobs/uploads/?digest-algorithm=md5",
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.error_code(), "DIGEST_INVALID");
}

#[tokio::test]
async fn blobs_mount_mount_anonymous_and_mount_missing() {
    let t = app();
    for alg in ALGS {
        // mount: from a repository that links the blob.
        let data = blob(alg, "mount", 512);
        let d = t.push_blob_as(alg, "repo2", &data).await;
        let r = t
            .send(
                Method::POST,
                &format!("/v2/repo/blobs/uploads/?mount={d}&from=repo2"),
                &[],
                Body::empty(),
            )
            .await;
        created_at(&r, "repo", &d);
        t.check_blob_then_delete("repo", &d, &data).await;
        t.check_blob_then_delete("repo2", &d, &data).await;

        // mount anonymous (no `from`): a session to push into, as the spec allows.
        let data = blob(alg, "mount anonymous", 512);
        let d = t.push_blob_as(alg, "repo2", &data).await;
        let r = t
            .send(
                Method::POST,
                &format!("/v2/repo/blobs/uploads/?mount={d}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED);
        let loc = r.header("location").to_string();
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[("content-length", "512")],
                data.clone(),
            )
            .await;
        created_at(&r, "repo", &d);

        // mount missing: the source does not have it, so a session, and nothing linked.
        let d = alg.digest(b"mount missing");
        let r = t
            .send(
                Method::POST,
                &format!("/v2/repo/blobs/uploads/?mount={d}&from=repo2"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED);
        assert!(r.header("location").starts_with("/v2/repo/blobs/uploads/"));
        assert_eq!(
            t.head(&format!("/v2/repo/blobs/{d}")).await.status,
            StatusCode::NOT_FOUND
        );
    }
}

#[tokio::test]
async fn blobs_post_cancel() {
    let t = app();
    for alg in ALGS {
        let loc = t.start("repo").await;
        t.send(Method::PATCH, &loc, &[], "partial").await;
        let r = t.send(Method::DELETE, &loc, &[], Body::empty()).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
        let r = t.get(&loc).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.error_code(), "BLOB_UPLOAD_UNKNOWN");
        let d = alg.digest(b"partial");
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn blobs_range_requests() {
    let t = app();
    for alg in ALGS {
        let data = blob(alg, "range", 2048);
        let d = t.push_blob_as(alg, "repo", &data).await;
        let uri = format!("/v2/repo/blobs/{d}");
        for (range, want) in [
            ("bytes=500-1499", Some((500, 1500))),
            ("bytes=500-", Some((500, 2048))),
            ("bytes=-500", Some((1548, 2048))),
            ("bytes=2000-5000", Some((2000, 2048))),
            // Last before first: RFC 9110 would ignore the header, the suite wants 416.
            ("bytes=500-0", None),
            ("bytes=5000-10000", None),
        ] {
            let r = t
                .send(Method::GET, &uri, &[("range", range)], Body::empty())
                .await;
            match want {
                Some((a, b)) => {
                    assert_eq!(r.status, StatusCode::PARTIAL_CONTENT, "{range}");
                    assert_eq!(&r.body[..], &data[a..b]);
                    assert_eq!(r.header("content-length"), (b - a).to_string());
                    assert_eq!(
                        r.header("content-range"),
                        format!("bytes {a}-{}/2048", b - 1)
                    );
                }
                None => assert_eq!(r.status, StatusCode::RANGE_NOT_SATISFIABLE, "{range}"),
            }
        }
    }
}

/// The well-known contents: the empty blob and the empty JSON `{}`.
#[tokio::test]
async fn blobs_empty_and_empty_json() {
    let t = app();
    for alg in ALGS {
        for data in [&b""[..], b"{}"] {
            let d = t.push_blob_as(alg, "repo", data).await;
            t.check_blob_then_delete("repo", &d, data).await;
            // Also by POST then an empty PUT.
            let loc = t.start("repo").await;
            let r = t
                .send(
                    Method::PUT,
                    &format!("{loc}?digest={d}"),
                    &[("content-length", &data.len().to_string())],
                    data.to_vec(),
                )
                .await;
            created_at(&r, "repo", &d);
        }
    }
}

/// Every push path refuses content that does not hash to the digest named, with 400
/// `DIGEST_INVALID`, and stores nothing.
#[tokio::test]
async fn blobs_bad_digest_post_only_post_put_chunked_stream() {
    let t = app();
    for alg in ALGS {
        let data = blob(alg, "bad digest", 300);
        let d = alg.digest(&data);
        let mut corrupt = data.clone();
        corrupt.extend_from_slice(b"oh no");
        let len = corrupt.len().to_string();
        let r = t
            .send(
                Method::POST,
                &format!("/v2/repo/blobs/uploads/?digest={d}"),
                &[("content-length", &len)],
                corrupt.clone(),
            )
            .await;
        assert_eq!(
            (r.status, r.error_code()),
            (StatusCode::BAD_REQUEST, "DIGEST_INVALID".into())
        );
        let loc = t.start("repo").await;
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[("content-length", &len)],
                corrupt.clone(),
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "post+put");
        let loc = t.start("repo").await;
        let range = format!("0-{}", corrupt.len() - 1);
        let r = t
            .send(
                Method::PATCH,
                &loc,
                &[("content-range", &range), ("content-length", &len)],
                corrupt.clone(),
            )
            .await;
        let loc = r.header("location").to_string();
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "chunked");
        let loc = t.start("repo").await;
        let r = t.send(Method::PATCH, &loc, &[], corrupt.clone()).await;
        let loc = r.header("location").to_string();
        let r = t
            .send(
                Method::PUT,
                &format!("{loc}?digest={d}"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "stream");
        assert_eq!(
            t.head(&format!("/v2/repo/blobs/{d}")).await.status,
            StatusCode::NOT_FOUND
        );
    }
}

// ------------------------------------------------------------------- data workflows

fn descriptor(mt: &str, digest: &str, size: usize) -> serde_json::Value {
    serde_json::json!({"mediaType": mt, "digest": digest, "size": size})
}

/// An image: config and `layers` layers pushed (under `alg`), manifest bytes returned.
async fn image(
    t: &TestApp,
    alg: Alg,
    repo: &str,
    seed: &str,
    layers: usize,
) -> (Vec<u8>, Vec<String>) {
    let config = format!(r#"{{"architecture":"amd64","os":"linux","seed":"{seed}"}}"#);
    let cd = t.push_blob_as(alg, repo, config.as_bytes()).await;
    let mut descs = Vec::new();
    let mut blobs = vec![cd.clone()];
    for i in 0..layers {
        let data = blob(alg, &format!("{seed}{i}"), 64 + i);
        let d = t.push_blob_as(alg, repo, &data).await;
        descs.push(descriptor(media::LAYER_TAR_GZIP, &d, data.len()));
        blobs.push(d);
    }
    let doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::OCI_MANIFEST,
        "config": descriptor(media::OCI_CONFIG, &cd, config.len()),
        "layers": descs,
    });
    (serde_json::to_vec(&doc).unwrap(), blobs)
}

/// The suite's manifest push checks: 201, Location that serves the same bytes with the
/// pushed Content-Type and Content-Length, and Docker-Content-Digest.
async fn push_manifest_checked(t: &TestApp, repo: &str, reference: &str, doc: &[u8], digest: &str) {
    let r = t.put_doc(repo, reference, doc).await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.header("docker-content-digest"), digest);
    let loc = r.header("location").to_string();
    assert_eq!(loc, format!("/v2/{repo}/manifests/{digest}"));
    let r = t
        .send(
            Method::GET,
            &loc,
            &[
                ("accept", media::OCI_MANIFEST),
                ("accept", media::OCI_INDEX),
            ],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.body[..], doc);
    assert_eq!(r.header("content-length"), doc.len().to_string());
    assert_eq!(r.header("docker-content-digest"), digest);
}

/// Image and index pushed by digest (in the digest's algorithm) and by tag (sha256, the
/// canonical algorithm), then HEAD, GET, tag listing and deletes, with the 404 codes.
#[tokio::test]
async fn data_image_and_index_by_digest_and_tag() {
    let t = app();
    for alg in ALGS {
        let repo = format!("data/{alg:?}").to_ascii_lowercase();
        let (doc, blobs) = image(&t, alg, &repo, "img", 2).await;
        let d = alg.digest(&doc);
        push_manifest_checked(&t, &repo, &d, &doc, &d).await;
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": media::OCI_INDEX,
            "manifests": [descriptor(media::OCI_MANIFEST, &d, doc.len())],
        }))
        .unwrap();
        let xd = alg.digest(&index);
        push_manifest_checked(&t, &repo, &xd, &index, &xd).await;
        // By tag: the digest is sha256 whatever the document's descriptors use.
        let tagged = sha256_digest(&index).to_string();
        push_manifest_checked(&t, &repo, "latest", &index, &tagged).await;

        for reference in [d.as_str(), xd.as_str(), "latest"] {
            let r = t.head(&format!("/v2/{repo}/manifests/{reference}")).await;
            assert_eq!(r.status, StatusCode::OK, "{reference}");
            assert!(!r.header("docker-content-digest").is_empty());
        }
        let r = t.get(&format!("/v2/{repo}/tags/list")).await;
        assert_eq!(r.json()["tags"], serde_json::json!(["latest"]));

        // Deletes: the tag, then manifests, then blobs; each gone at once.
        let r = t
            .send(
                Method::DELETE,
                &format!("/v2/{repo}/manifests/latest"),
                &[],
                Body::empty(),
            )
            .await;
        assert_eq!(r.status, StatusCode::ACCEPTED);
        assert_eq!(
            t.head(&format!("/v2/{repo}/manifests/latest")).await.status,
            StatusCode::NOT_FOUND
        );
        let mut manifests = vec![&xd, &tagged, &d];
        manifests.dedup(); // with sha256, the index by digest and by tag are one
        for m in manifests {
            let r = t
                .send(
                    Method::DELETE,
                    &format!("/v2/{repo}/manifests/{m}"),
                    &[],
                    Body::empty(),
                )
                .await;
            assert_eq!(r.status, StatusCode::ACCEPTED, "{m}");
            let r = t.get(&format!("/v2/{repo}/manifests/{m}")).await;
            assert_eq!(
                (r.status, r.error_code()),
                (StatusCode::NOT_FOUND, "MANIFEST_UNKNOWN".into())
            );
        }
        for b in &blobs {
            let r = t
                .send(
                    Method::DELETE,
                    &format!("/v2/{repo}/blobs/{b}"),
                    &[],
                    Body::empty(),
                )
                .await;
            assert_eq!(r.status, StatusCode::ACCEPTED);
            assert_eq!(
                t.head(&format!("/v2/{repo}/blobs/{b}")).await.status,
                StatusCode::NOT_FOUND
            );
        }
    }
}

/// A manifest PUT by digest whose content hashes otherwise (in that digest's algorithm)
/// is 400 `DIGEST_INVALID`; so is `sha256:baddigeststring`, which GET answers 400 or 404.
#[tokio::test]
async fn data_bad_digest_image_and_invalid_digest_format() {
    let t = app();
    for alg in ALGS {
        let (doc, _) = image(&t, alg, "repo", "bad", 1).await;
        let d = alg.digest(&doc);
        let mut spaced = doc.clone();
        spaced.extend_from_slice(b"  ");
        let r = t.put_doc("repo", &d, &spaced).await;
        assert_eq!(
            (r.status, r.error_code()),
            (StatusCode::BAD_REQUEST, "DIGEST_INVALID".into())
        );
        // The same bytes under the other algorithm's digest are refused too.
        let other = match alg {
            Alg::Sha256 => Alg::Sha512,
            Alg::Sha512 => Alg::Sha256,
        };
        let r = t.put_doc("repo", &other.digest(&spaced), &doc).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
    }
    let (doc, _) = image(&t, Alg::Sha256, "repo", "fmt", 1).await;
    let r = t.put_doc("repo", "sha256:baddigeststring", &doc).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = t.get("/v2/repo/manifests/sha256:baddigeststring").await;
    assert!(matches!(
        r.status,
        StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND
    ));
}

#[tokio::test]
async fn data_missing_manifest_blob_and_repository_codes() {
    let t = app();
    for alg in ALGS {
        let d = alg.digest(b"nothing");
        let r = t.get(&format!("/v2/nowhere/manifests/{d}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert!(matches!(
            r.error_code().as_str(),
            "MANIFEST_UNKNOWN" | "NAME_UNKNOWN"
        ));
        let r = t.get(&format!("/v2/nowhere/blobs/{d}")).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert!(matches!(
            r.error_code().as_str(),
            "BLOB_UNKNOWN" | "NAME_UNKNOWN"
        ));
    }
    let r = t.get("/v2/nowhere/tags/list").await;
    assert_eq!(
        (r.status, r.error_code()),
        (StatusCode::NOT_FOUND, "NAME_UNKNOWN".into())
    );
}

/// Tags list with `n` and `last`, and the `Link` to the next page.
#[tokio::test]
async fn data_tag_list_n_and_last() {
    let t = app();
    for alg in ALGS {
        let repo = format!("tags/{alg:?}").to_ascii_lowercase();
        let (doc, _) = image(&t, alg, &repo, "tags", 1).await;
        for tag in ["a", "b", "c", "d"] {
            assert_eq!(
                t.put_doc(&repo, tag, &doc).await.status,
                StatusCode::CREATED
            );
        }
        let r = t.get(&format!("/v2/{repo}/tags/list?n=2")).await;
        assert_eq!(r.json()["tags"], serde_json::json!(["a", "b"]));
        assert!(r.header("link").contains("last=b"), "{}", r.header("link"));
        let r = t.get(&format!("/v2/{repo}/tags/list?n=2&last=b")).await;
        assert_eq!(r.json()["tags"], serde_json::json!(["c", "d"]));
        let r = t.get(&format!("/v2/{repo}/tags/list?last=d")).await;
        assert_eq!(r.json()["tags"], serde_json::json!([]));
    }
}

/// The suite's tag parameters (`manifest-by-digest` with `?tag=`): a push by digest sets
/// every tag it names, each listed in `OCI-Tag`; the tags then resolve and list. An
/// invalid tag refuses the push with nothing stored; more tags than the registry takes
/// is 414 (the spec's answer), and 10, the spec's floor, are taken.
#[tokio::test]
async fn data_manifest_push_with_tag_parameters() {
    let t = app();
    for alg in ALGS {
        let repo = format!("tagparam/{alg:?}").to_ascii_lowercase();
        let (doc, _) = image(&t, alg, &repo, "tagparam", 1).await;
        let d = alg.digest(&doc);
        let tags: Vec<String> = (0..10).map(|i| format!("v1.{i}")).collect();
        let query: Vec<String> = tags.iter().map(|t| format!("tag={t}")).collect();
        let r = t
            .put_doc(&repo, &format!("{d}?{}", query.join("&")), &doc)
            .await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.header("docker-content-digest"), d);
        // RFC 9110 list semantics: the header's comma-separated values, across headers.
        let listed: Vec<String> = r
            .headers
            .get_all("oci-tag")
            .iter()
            .flat_map(|v| v.to_str().unwrap().split(','))
            .map(|s| s.trim().to_string())
            .collect();
        assert_eq!(listed, tags);
        for tag in &tags {
            let r = t.head(&format!("/v2/{repo}/manifests/{tag}")).await;
            assert_eq!(r.status, StatusCode::OK, "{tag}");
            assert_eq!(r.header("docker-content-digest"), d, "{tag}");
        }
        let r = t.get(&format!("/v2/{repo}/tags/list")).await;
        let mut want = tags.clone();
        want.sort();
        assert_eq!(r.json()["tags"], serde_json::json!(want));

        // One bad tag among good ones: 400, and neither the manifest nor a tag is stored.
        let (other, _) = image(&t, alg, &repo, "tagparam-bad", 1).await;
        let od = alg.digest(&other);
        let r = t
            .put_doc(&repo, &format!("{od}?tag=fine&tag=-bad"), &other)
            .await;
        assert_eq!(
            (r.status, r.error_code()),
            (StatusCode::BAD_REQUEST, "MANIFEST_INVALID".into())
        );
        assert_eq!(
            t.head(&format!("/v2/{repo}/manifests/{od}")).await.status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            t.head(&format!("/v2/{repo}/manifests/fine")).await.status,
            StatusCode::NOT_FOUND
        );

        // Too many: 414, nothing stored.
        let many: Vec<String> = (0..=super::manifests::MAX_TAGS_PER_PUSH)
            .map(|i| format!("tag=t{i}"))
            .collect();
        let r = t
            .put_doc(&repo, &format!("{od}?{}", many.join("&")), &other)
            .await;
        assert_eq!(r.status, StatusCode::URI_TOO_LONG);
        assert_eq!(
            t.head(&format!("/v2/{repo}/manifests/t0")).await.status,
            StatusCode::NOT_FOUND
        );

        // A push by tag may name more tags; its own is set too, the others listed.
        let r = t.put_doc(&repo, "own?tag=extra", &other).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert_eq!(r.header("oci-tag"), "extra");
        for tag in ["own", "extra"] {
            assert_eq!(
                t.head(&format!("/v2/{repo}/manifests/{tag}")).await.status,
                StatusCode::OK
            );
        }
    }
}

/// Artifacts with a subject (present, or missing as the spec requires accepting), listed
/// by the referrers API under the subject's digest in either algorithm, filtered by
/// `artifactType` with `OCI-Filters-Applied`; `OCI-Subject` on the push.
#[tokio::test]
async fn data_subject_subject_missing_and_referrers() {
    let t = app();
    for alg in ALGS {
        let repo = format!("refs/{alg:?}").to_ascii_lowercase();
        let (doc, _) = image(&t, alg, &repo, "subject", 1).await;
        let subject = alg.digest(&doc);
        push_manifest_checked(&t, &repo, &subject, &doc, &subject).await;
        let missing = alg.digest(b"a subject never pushed");
        let empty = t.push_blob_as(alg, &repo, b"{}").await;
        let mut referrers = Vec::new();
        for (at, subj) in [
            ("application/vnd.example.sig", &subject),
            ("application/vnd.example.sbom", &subject),
            ("application/vnd.example.sig", &missing),
        ] {
            let art = serde_json::to_vec(&serde_json::json!({
                "schemaVersion": 2,
                "mediaType": media::OCI_MANIFEST,
                "artifactType": at,
                "config": descriptor("application/vnd.oci.empty.v1+json", &empty, 2),
                "layers": [descriptor("application/vnd.oci.empty.v1+json", &empty, 2)],
                "subject": descriptor(media::OCI_MANIFEST, subj, doc.len()),
            }))
            .unwrap();
            let ad = alg.digest(&art);
            let r = t.put_doc(&repo, &ad, &art).await;
            assert_eq!(
                r.status,
                StatusCode::CREATED,
                "{}",
                String::from_utf8_lossy(&r.body)
            );
            assert_eq!(r.header("oci-subject"), subj.as_str());
            referrers.push(ad);
        }
        let r = t.get(&format!("/v2/{repo}/referrers/{subject}")).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("content-type"), media::OCI_INDEX);
        let listed: Vec<String> = r.json()["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["digest"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(listed.len(), 2);
        assert!(listed.contains(&referrers[0]) && listed.contains(&referrers[1]));
        let r = t
            .get(&format!(
                "/v2/{repo}/referrers/{subject}?artifactType=application/vnd.example.sbom"
            ))
            .await;
        assert_eq!(r.header("oci-filters-applied"), "artifactType");
        assert_eq!(r.json()["manifests"][0]["digest"], referrers[1]);
        assert_eq!(r.json()["manifests"].as_array().unwrap().len(), 1);
        let r = t.get(&format!("/v2/{repo}/referrers/{missing}")).await;
        assert_eq!(r.json()["manifests"][0]["digest"], referrers[2]);
        // A subject nobody refers to: an empty index, not a 404.
        let r = t
            .get(&format!("/v2/{repo}/referrers/{}", alg.digest(b"lonely")))
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.json()["manifests"], serde_json::json!([]));
    }
}

/// The suite's `sparse` workflow: an image with one layer never pushed (tagged
/// `sparse-image`), and an index of a pushed image and a manifest that is not in the
/// registry (tagged `sparse-index`): both accepted, listed, served; a missing config is
/// still refused.
#[tokio::test]
async fn data_sparse_image_and_sparse_index() {
    let t = app();
    for alg in ALGS {
        let repo = format!("sparse/{alg:?}").to_ascii_lowercase();
        let (doc, _) = image(&t, alg, &repo, "sparse", 1).await;
        let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
        let absent = alg.digest(b"a layer never pushed");
        v["layers"]
            .as_array_mut()
            .unwrap()
            .push(descriptor(media::LAYER_TAR_GZIP, &absent, 20));
        let sparse_image = serde_json::to_vec(&v).unwrap();
        let sd = sha256_digest(&sparse_image).to_string();
        push_manifest_checked(&t, &repo, "sparse-image", &sparse_image, &sd).await;
        let sd_alg = alg.digest(&sparse_image);
        push_manifest_checked(&t, &repo, &sd_alg, &sparse_image, &sd_alg).await;

        let (platform_image, _) = image(&t, alg, &repo, "amd64", 1).await;
        let pd = alg.digest(&platform_image);
        push_manifest_checked(&t, &repo, &pd, &platform_image, &pd).await;
        let random = alg.digest(&[7u8; 1024]);
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": media::OCI_INDEX,
            "manifests": [
                {"mediaType": media::OCI_MANIFEST, "digest": pd, "size": platform_image.len(),
                 "platform": {"os": "linux", "architecture": "amd64"}},
                {"mediaType": media::OCI_MANIFEST, "digest": random, "size": 1024,
                 "platform": {"os": "linux", "architecture": "arm64"}},
            ],
        }))
        .unwrap();
        let xd = sha256_digest(&index).to_string();
        push_manifest_checked(&t, &repo, "sparse-index", &index, &xd).await;
        let r = t.get(&format!("/v2/{repo}/tags/list")).await;
        assert_eq!(
            r.json()["tags"],
            serde_json::json!(["sparse-image", "sparse-index"])
        );
        assert_eq!(
            t.head(&format!("/v2/{repo}/manifests/{random}"))
                .await
                .status,
            StatusCode::NOT_FOUND
        );

        // What is present must still match its descriptor.
        let mut wrong: serde_json::Value = serde_json::from_slice(&index).unwrap();
        wrong["manifests"][0]["size"] = serde_json::json!(1);
        let r = t
            .put_doc(&repo, "wrong", &serde_json::to_vec(&wrong).unwrap())
            .await;
        assert_eq!(
            (r.status, r.error_code()),
            (StatusCode::BAD_REQUEST, "MANIFEST_INVALID".into())
        );
        // The config is never optional.
        let mut no_config = v.clone();
        no_config["config"]["digest"] = serde_json::json!(alg.digest(b"no such config"));
        let r = t
            .put_doc(&repo, "no-config", &serde_json::to_vec(&no_config).unwrap())
            .await;
        assert_eq!(
            (r.status, r.error_code()),
            (StatusCode::NOT_FOUND, "MANIFEST_BLOB_UNKNOWN".into())
        );
    }
}

/// With `sparse_manifests = false`, both sparse documents are refused as before.
#[tokio::test]
async fn data_sparse_refused_when_configured_strict() {
    let t = strict_app();
    for alg in ALGS {
        let (doc, _) = image(&t, alg, "strict", "strict", 1).await;
        let mut v: serde_json::Value = serde_json::from_slice(&doc).unwrap();
        v["layers"][0]["digest"] = serde_json::json!(alg.digest(b"absent"));
        let r = t
            .put_doc("strict", "x", &serde_json::to_vec(&v).unwrap())
            .await;
        assert_eq!(r.error_code(), "MANIFEST_BLOB_UNKNOWN");
        let index = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": media::OCI_INDEX,
            "manifests": [descriptor(media::OCI_MANIFEST, &alg.digest(b"absent"), 6)],
        }))
        .unwrap();
        let r = t.put_doc("strict", "y", &index).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.error_code(), "MANIFEST_UNKNOWN");
    }
}

/// A sha512 manifest's digest is computed in sha512 for the digest URL, and the same
/// bytes may also live under their sha256 digest: two manifests, one content.
#[tokio::test]
async fn data_sha512_and_sha256_of_one_document_coexist() {
    let t = app();
    let (doc, _) = image(&t, Alg::Sha512, "both", "both", 1).await;
    let d512 = Alg::Sha512.digest(&doc);
    let d256 = Alg::Sha256.digest(&doc);
    assert_eq!(
        d512,
        digest_like(&ferry_oci::digest::parse(&d512).unwrap(), &doc).to_string()
    );
    push_manifest_checked(&t, "both", &d512, &doc, &d512).await;
    push_manifest_checked(&t, "both", &d256, &doc, &d256).await;
    let r = t
        .send(
            Method::DELETE,
            &format!("/v2/both/manifests/{d512}"),
            &[],
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED);
    assert_eq!(
        t.head(&format!("/v2/both/manifests/{d256}")).await.status,
        StatusCode::OK
    );
}
