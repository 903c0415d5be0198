//! Command-line contracts of the commands that need no daemon, store or registry
//! (`ferry sim`, `ferry store plan`): later checks parse their JSON by these keys.
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

fn plan(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "store",
            "plan",
            "--store",
            "/nonexistent/ferry-store-plan-opens-no-store",
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn store_plan_answers_without_a_store_and_its_break_even_holds() {
    let base = [
        "--image",
        "1G",
        "--hot",
        "50M",
        "--volume-read",
        "80M/s",
        "--egress-price",
        "0.02",
        "--json",
    ];
    let at = |starts: u64| {
        let starts = starts.to_string();
        let mut args = base.to_vec();
        args.extend(["--starts", &starts]);
        let out = plan(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let p = at(1000);
    let names: Vec<_> = p["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["pull", "lazy", "prewarm", "baked"]);
    for o in p["options"].as_array().unwrap() {
        for key in [
            "wait_s",
            "node_time_cost",
            "egress_cost",
            "storage_cost",
            "total",
        ] {
            assert!(o[key].as_f64().unwrap() >= 0.0, "{key} of {o}");
        }
    }
    assert_eq!(p["inputs"]["image_bytes"], 1u64 << 30);
    let n = p["baked_pays_from_starts"].as_u64().unwrap();
    assert!(n > 1, "{p}");
    assert_eq!(at(n)["cheapest"], "baked");
    assert_ne!(at(n - 1)["cheapest"], "baked");
}

#[test]
fn store_plan_refuses_what_is_not_a_number() {
    for (args, says) in [
        (&["--image", "0"][..], "zero"),
        (&["--image", "1G", "--link", "fast"][..], "rate"),
        (&["--image", "1G", "--node-price=-1"][..], "node-price"),
        (&["--image", "1G", "--rtt", "soon"][..], "duration"),
    ] {
        let out = plan(args);
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
