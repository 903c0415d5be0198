//! Tests of the trace JSON and trace artifacts in an OCI layout and in
//! an in-process ferry registry.
#![allow(clippy::unwrap_used)]

use ferry_oci::layout::{OciLayout, descriptor};
use ferry_oci::media::OCI_MANIFEST;
use ferry_registry_client::{Client, ClientConfig, RangeRuntime};

use super::*;

/// A trace read (for the recorder's tests too).
pub(crate) fn read(path: &str, offset: u64, len: u64) -> TraceRead {
    TraceRead {
        path: path.into(),
        offset,
        len,
    }
}

#[test]
fn json_round_trips_and_carries_a_version() {
    let trace = Trace {
        reads: vec![
            read("/bin/sh", 0, 4096),
            read("/lib/libc.so.6", 8192, 65_536),
        ],
    };
    let json = trace.to_json().unwrap();
    let value: serde_json::Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(value["version"], 1);
    assert_eq!(Trace::from_json(&json).unwrap(), trace);
    // What the struct's own serde derive writes (no version) reads as version 1.
    let plain = serde_json::to_vec(&trace).unwrap();
    assert_eq!(Trace::from_json(&plain).unwrap(), trace);
}

#[test]
fn bad_json_is_refused_with_a_reason() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"not json".to_vec(), "startup trace"),
        (br#"{"version":2,"reads":[]}"#.to_vec(), "version 2"),
        (
            br#"{"version":1,"reads":[{"path":"rel","offset":0,"len":1}]}"#.to_vec(),
            "absolute",
        ),
        (
            br#"{"version":1,"reads":[{"path":"/a","offset":0,"len":0}]}"#.to_vec(),
            "empty",
        ),
        (
            br#"{"version":1,"reads":[{"path":"/a","offset":18446744073709551615,"len":2}]}"#
                .to_vec(),
            "past the largest offset",
        ),
        (
            br#"{"version":1,"reads":[],"extra":1}"#.to_vec(),
            "unknown field",
        ),
        (
            format!(
                r#"{{"version":1,"reads":[{{"path":"/{}","offset":0,"len":1}}]}}"#,
                "x".repeat(MAX_TRACE_PATH)
            )
            .into_bytes(),
            "at most",
        ),
    ];
    for (input, want) in cases {
        let err = Trace::from_json(&input).unwrap_err().to_string();
        assert!(err.contains(want), "{err:?} should mention {want:?}");
    }
    let too_many = format!(
        r#"{{"version":1,"reads":[{}]}}"#,
        vec![r#"{"path":"/a","offset":0,"len":1}"#; MAX_TRACE_READS + 1].join(",")
    );
    let err = Trace::from_json(too_many.as_bytes())
        .unwrap_err()
        .to_string();
    assert!(err.contains("reads, more than"), "{err}");
    let huge = vec![b' '; MAX_TRACE_BYTES as usize + 1];
    assert!(Trace::from_json(&huge).is_err());
}

fn sample() -> Trace {
    Trace {
        reads: vec![read("/bin/sh", 0, 4096), read("/etc/passwd", 0, 100)],
    }
}

#[test]
fn layout_trace_is_stored_as_a_referrer_and_found_again() {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path()).unwrap();
    let doc = br#"{"schemaVersion":2}"#;
    let digest = layout.write_blob(doc).unwrap();
    let subject = descriptor(OCI_MANIFEST, digest, doc.len() as u64, &[]);
    assert_eq!(find_layout_trace(&layout, &subject).unwrap(), None);
    let desc = store_layout_trace(&layout, &subject, &sample()).unwrap();
    assert_eq!(
        desc.artifact_type().as_ref().unwrap().to_string(),
        crate::trace::TRACE_MEDIA_TYPE
    );
    assert_eq!(
        find_layout_trace(&layout, &subject).unwrap(),
        Some(sample())
    );
    // A newer trace replaces the older one.
    let newer = Trace {
        reads: vec![read("/usr/bin/env", 0, 1)],
    };
    store_layout_trace(&layout, &subject, &newer).unwrap();
    assert_eq!(find_layout_trace(&layout, &subject).unwrap(), Some(newer));
    // Found through the image-level helper too (digest only).
    let image = format!("oci:{}", dir.path().display());
    let client = Client::new(ClientConfig::default()).unwrap();
    let rt = RangeRuntime::new().unwrap();
    let found =
        crate::backend::find_trace(&image, subject.digest().as_ref(), &client, &rt).unwrap();
    assert_eq!(found.unwrap().reads[0].path, "/usr/bin/env");
}
