//! `ferry sim`'s command-line contract: later checks parse its JSON by these keys.
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn sim(extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "sim",
            "--nodes",
            "40",
            "--containers-per-node",
            "3",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "one JSON object: {text}");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn json_has_the_contract_keys_with_and_without_peers() {
    let keys = [
        "all_started_s",
        "p50_started_s",
        "p99_started_s",
        "registry_egress_bytes",
        "working_set_bytes",
        "peer_bytes",
        "topology",
    ];
    let p2p = sim(&[]);
    let origin = sim(&["--no-p2p"]);
    for doc in [&p2p, &origin] {
        for k in keys {
            assert!(doc.get(k).is_some(), "missing {k} in {doc}");
        }
        assert_eq!(doc["containers"], 120);
    }
    assert_eq!(p2p["topology"], "piece-hrw");
    assert_eq!(origin["topology"], "none");
    let ws = origin["working_set_bytes"].as_u64().unwrap();
    assert_eq!(origin["registry_egress_bytes"].as_u64().unwrap(), 40 * ws);
    assert!(p2p["registry_egress_bytes"].as_u64().unwrap() <= 2 * ws);
    assert_eq!(origin["peer_bytes"], 0);
}

#[test]
fn bad_flags_fail_with_a_message() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["sim", "--nodes", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nodes"));
}
