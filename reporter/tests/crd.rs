//! deploy/crd-device.yaml is generated from the Rust type; this fails when they drift.
//! Regenerate with: cargo run -p tessera-reporter -- crd > deploy/crd-device.yaml

use kube::CustomResourceExt;
use tessera_api::Device;

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
