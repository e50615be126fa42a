//! Per-container grants through the extender, against the API server double: a
//! bind writes each container's share, and the leader upgrades pod-level
//! annotations of pods placed before per-container grants.

use std::time::Duration;

mod common;

use common::extender;
use serde_json::{Value, json};
use tessera_api::DeviceAllocations;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_harness::apiserver::ApiServer;
use tessera_scheduler::extender::ExtenderConfig;
use tessera_scheduler::protocol::ExtenderBindingArgs;

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";

fn device(node: &str, gpus: usize) -> Value {
    let devices: Vec<Value> = (0..gpus)
        .map(|i| json!({"type":"gpu","id":format!("GPU-{node}-{i}"),"minor":i,"health":true,
            "resources":{"koordinator.sh/gpu-core":"100","koordinator.sh/gpu-memory":(16u64 << 30).to_string(),"koordinator.sh/gpu-memory-ratio":"100"}}))
        .collect();
    json!({"apiVersion": DEVICES, "kind": "Device", "metadata": {"name": node}, "spec": {"devices": devices}})
}

/// Containers a and b asking 25% each, a sidecar asking for none.
fn containers() -> Value {
    json!([
        {"name":"a","image":"x","resources":{"limits":{"koordinator.sh/gpu":"25"}}},
        {"name":"b","image":"x","resources":{"limits":{"koordinator.sh/gpu":"25"}}},
        {"name":"sidecar","image":"x"}
    ])
}

fn annotation(api: &ApiServer, name: &str) -> DeviceAllocations {
    let pod = api.get("v1", "pods", "default", name).expect("pod");
    let text = pod["metadata"]["annotations"][DEVICE_ALLOCATED]
        .as_str()
        .unwrap_or_else(|| panic!("{name} not annotated: {pod}"));
    DeviceAllocations::parse(text).expect("valid")
}

#[tokio::test]
async fn bind_writes_each_containers_share() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 2));
    api.insert(
        "v1",
        "pods",
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"two","namespace":"default","uid":"u-two"},
            "spec":{"containers":containers()},"status":{"phase":"Pending"}}),
    );
    let (extender, ledger) = extender(&api, ExtenderConfig::default()).await;
    let bound = extender
        .bind(
            &ExtenderBindingArgs {
                pod_name: "two".into(),
                pod_namespace: "default".into(),
                pod_uid: "u-two".into(),
                node: "n1".into(),
            },
            false,
        )
        .await;
    assert_eq!(bound.error, "");
    let allocations = annotation(&api, "two");
    assert_eq!(allocations.gpus().len(), 1, "binpack: one GPU");
    assert_eq!(
        allocations.gpus()[0].gpu_core(),
        Some(50),
        "the pod books 50%"
    );
    for name in ["a", "b"] {
        let gpus = allocations.gpus_of_container(name);
        assert_eq!(gpus.len(), 1, "{name}");
        assert_eq!(gpus[0].1.gpu_core(), Some(25), "{name}");
        assert_eq!(gpus[0].1.gpu_memory(), Some(4 << 30), "{name}");
    }
    assert!(allocations.gpus_of_container("sidecar").is_empty());
    let used = ledger
        .lock()
        .expect("ledger")
        .node("n1")
        .expect("node")
        .gpus
        .iter()
        .map(|g| g.core_used)
        .sum::<u64>();
    assert_eq!(used, 50);
}

#[tokio::test]
async fn pod_level_annotations_of_running_pods_are_upgraded_once() {
    let api = ApiServer::start().await.expect("api");
    api.insert(DEVICES, "devices", device("n1", 1));
    let pod_level = r#"{"gpu":[{"minor":0,"id":"GPU-n1-0","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#;
    api.insert(
        "v1",
        "pods",
        json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"old","namespace":"default","uid":"u-old",
                "annotations":{DEVICE_ALLOCATED: pod_level}},
            "spec":{"nodeName":"n1","containers":containers()},"status":{"phase":"Running"}}),
    );
    let (extender, _) = extender(&api, ExtenderConfig::default()).await;
    assert_eq!(extender.upgrade_pod_level_allocations().await, 1);
    let allocations = annotation(&api, "old");
    assert!(allocations.is_per_container());
    assert_eq!(allocations.gpus()[0].gpu_core(), Some(50));
    for name in ["a", "b"] {
        assert_eq!(
            allocations.gpus_of_container(name)[0].1.gpu_core(),
            Some(50),
            "{name} keeps what it had"
        );
    }
    assert!(allocations.gpus_of_container("sidecar").is_empty());
    // Seen back through the watch: nothing more to do.
    for _ in 0..250 {
        if extender.upgrade_pod_level_allocations().await == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("upgraded again and again");
}
