//! deploy/crd-device.yaml is generated from the Rust type; this fails when they drift.
//! Regenerate with: cargo run -p tessera-reporter -- crd > deploy/crd-device.yaml

use kube::CustomResourceExt;
use tessera_api::Device;
use tessera_harness::deploy::{documents, role_allows};

#[test]
fn deployed_crd_matches_the_rust_type() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crd-device.yaml");
    let deployed = std::fs::read_to_string(&path).expect("deploy/crd-device.yaml");
    let generated = serde_yaml::to_string(&Device::crd()).expect("serializes");
    assert!(
        deployed == generated,
        "{} is stale: run `cargo run -p tessera-reporter -- crd > deploy/crd-device.yaml`",
        path.display()
    );
}

#[test]
fn reporter_rbac_covers_what_it_calls() {
    let documents = documents("reporter.yaml");
    let role = documents
        .iter()
        .find(|d| d["kind"] == "ClusterRole")
        .expect("ClusterRole");
    for (resource, verb) in [
        ("nodes", "get"),
        ("nodes", "patch"),
        ("nodes/status", "patch"),
        ("pods", "list"),
        ("devices", "get"),
        ("devices", "create"),
        ("devices", "patch"),
        ("events", "create"),
        ("events", "patch"),
    ] {
        assert!(
            role_allows(role, resource, verb),
            "ClusterRole lacks {verb} {resource}"
        );
    }
    let daemonset = documents
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("DaemonSet");
    let args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args");
    assert_eq!(args[0], "run");
}
