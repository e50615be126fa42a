//! tessera-reporter end to end: real nvml-wrapper code against the fake NVML
//! library, publishing to the API server double over HTTP.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use serde_json::{Value, json};
use tessera_integration::apiserver::ApiServer;
use tessera_integration::fake_nvml;
use tessera_reporter::gpu::{GpuSource, NvmlSource};
use tessera_reporter::publish::Publisher;
use tessera_reporter::report::CapacityOptions;
use tessera_reporter::run::{LoopConfig, run};

const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";
const LEGACY_UID: &str = "513cb897-0262-4868-826f-aa943ee45a38";
const TESSERA_UID: &str = "94283d1b-ce5a-4797-bff8-0cf0c7143b2b";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/kubelet-checkpoint")
        .join(name)
}

async fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..200 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

fn pod(uid: &str, name: &str, annotations: Value) -> Value {
    json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default","uid":uid,"annotations":annotations},
        "spec":{"nodeName":"gpu-node-1","containers":[{"name":"app","image":"x"}]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_publish_health_and_legacy_pods() {
    tessera_integration::init_tracing();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = fake_nvml::four_gpu_node();
    node["xidEvents"] =
        json!([{"gpu": 2, "xid": 13, "afterMs": 0}, {"gpu": 2, "xid": 79, "afterMs": 600}]);
    let library = fake_nvml::install(&dir.path().join("driver"), &node).expect("fake driver");

    // Discovery through nvml-wrapper.
    let source = NvmlSource::open(&library).expect("NVML loads");
    let gpus = source.discover().expect("discovers");
    assert_eq!(gpus.driver_version, "550.54.15");
    assert_eq!(gpus.gpus.len(), 4);
    let uuid = |i: usize| gpus.gpus[i].uuid.clone();
    assert_eq!(gpus.gpus[1].minor, 1);
    assert_eq!(gpus.gpus[1].memory_bytes, 85_899_345_920);
    assert_eq!(gpus.gpus[2].numa_node, Some(1));
    assert_eq!(
        gpus.gpus[1].pcie_id, gpus.gpus[0].bus_id,
        "0 and 1 share a switch"
    );
    assert_eq!(gpus.gpus[3].pcie_id, gpus.gpus[2].bus_id);
    assert_eq!(gpus.gpus[0].nvlink_peers, [uuid(1)]);
    assert_eq!(gpus.gpus[3].nvlink_peers, [uuid(2)]);

    // The API server: the node, a legacy pod, a Tessera pod, a pod elsewhere.
    let api = ApiServer::start().await.expect("api server");
    api.insert("v1", "nodes", json!({"apiVersion":"v1","kind":"Node","metadata":{"name":"gpu-node-1","labels":{"kubernetes.io/hostname":"gpu-node-1"}},"status":{"capacity":{"cpu":"8"}}}));
    api.insert("v1", "pods", pod(LEGACY_UID, "legacy", json!({})));
    api.insert(
        "v1",
        "pods",
        pod(
            TESSERA_UID,
            "shared",
            json!({"scheduling.koordinator.sh/device-allocated": "{\"gpu\":[]}"}),
        ),
    );
    let checkpoint = dir.path().join("kubelet_internal_checkpoint");
    std::fs::copy(fixture("two-pods-two-numa.json"), &checkpoint).expect("checkpoint");

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    tessera_reporter::health::watch_xids(source.nvml(), tx, Arc::clone(&stop)).expect("XID watch");
    let loop_config = LoopConfig {
        checkpoint: checkpoint.clone(),
        legacy_resources: vec!["nvidia.com/gpu".into()],
        interval: Duration::from_secs(3600),
        checkpoint_poll: Duration::from_millis(50),
        capacity: CapacityOptions {
            aliases: true,
            nvidia_gpu: false,
            ..CapacityOptions::default()
        },
        recovery_after: Duration::from_secs(3600),
        // No proxy here: the node holds no share (none).
        enforcement_file: "/nonexistent/tessera-enforcement".into(),
        dra: false,
        dra_health: None,
    };
    let publisher = Publisher::new(api.client().expect("client"), "gpu-node-1");
    let (stop_loop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(
        Arc::new(source),
        publisher,
        loop_config,
        rx,
        async move {
            let _ = stopped.await;
        },
    ));

    // Device CR: four healthy GPUs, owned by the node; the legacy pod only.
    wait_until("the Device CR", || {
        api.get(DEVICES, "devices", "", "gpu-node-1").is_some()
    })
    .await;
    let device = api
        .get(DEVICES, "devices", "", "gpu-node-1")
        .expect("device");
    assert_eq!(device["metadata"]["ownerReferences"][0]["kind"], "Node");
    let devices = device["spec"]["devices"]
        .as_array()
        .expect("devices")
        .clone();
    assert_eq!(devices.len(), 4);
    assert_eq!(devices[0]["type"], "gpu");
    assert_eq!(
        devices[0]["resources"]["koordinator.sh/gpu-memory"],
        "85899345920"
    );
    assert_eq!(devices[2]["topology"]["nodeID"], 1);
    let legacy: Value = serde_json::from_str(
        device["metadata"]["annotations"]["node.koordinator.sh/devices-checkpoints"]
            .as_str()
            .expect("annotation"),
    )
    .expect("json");
    assert_eq!(
        legacy,
        json!([{"podUID": LEGACY_UID, "containerName": "app", "resourceName": "nvidia.com/gpu", "deviceIDs": ["GPU-77a702db-e37f-3a74-d46d-c5713f66058c"]}])
    );
    // NVML's NVLinks (0-1, 2-3), as the scheduler reads them.
    let nvlinks: Value = serde_json::from_str(
        device["metadata"]["annotations"]["tessera.io/nvlink-peers"]
            .as_str()
            .expect("NVLink annotation"),
    )
    .expect("json");
    assert_eq!(
        nvlinks,
        json!({uuid(0): [uuid(1)], uuid(1): [uuid(0)], uuid(2): [uuid(3)], uuid(3): [uuid(2)]})
    );

    // Node: capacity, allocatable, labels; the XID 79 on GPU 2 (after 600 ms; the XID 13 is ignored) takes one GPU out.
    // The node is written after the Device CR, in the same round: wait for it too.
    wait_until("the node's GPU labels", || {
        api.get("v1", "nodes", "", "gpu-node-1")
            .is_some_and(|n| n["metadata"]["labels"]["node.koordinator.sh/gpu-model"].is_string())
    })
    .await;
    let node = api.get("v1", "nodes", "", "gpu-node-1").expect("node");
    assert_eq!(
        node["metadata"]["labels"]["node.koordinator.sh/gpu-model"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert_eq!(
        node["metadata"]["labels"]["kubernetes.io/hostname"],
        "gpu-node-1"
    );
    assert_eq!(
        node["status"]["capacity"]["cpu"], "8",
        "other capacity untouched"
    );
    // The Device CR is published before the node's capacity: wait for both.
    wait_until("GPU 2 unhealthy", || {
        api.get(DEVICES, "devices", "", "gpu-node-1")
            .is_some_and(|d| d["spec"]["devices"][2]["health"] == false)
            && api
                .get("v1", "nodes", "", "gpu-node-1")
                .is_some_and(|n| n["status"]["capacity"]["koordinator.sh/gpu-core"] == "300")
    })
    .await;
    let node = api.get("v1", "nodes", "", "gpu-node-1").expect("node");
    assert_eq!(node["status"]["capacity"]["koordinator.sh/gpu-core"], "300");
    assert_eq!(
        node["status"]["allocatable"]["koordinator.sh/gpu-memory-ratio"],
        "300"
    );
    assert_eq!(
        node["status"]["allocatable"]["nvidia.com/gpumem"],
        (3 * 81920).to_string()
    );
    // GiB, gpushare's default unit, as tessera-scheduler reads aliyun.com/gpu-mem.
    assert_eq!(
        node["status"]["capacity"]["aliyun.com/gpu-mem"],
        (3 * 80).to_string()
    );

    // Nothing changes: nothing is written.
    let settled = api.resource_version();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        api.resource_version(),
        settled,
        "the reporter wrote without a change"
    );

    // A corrupt checkpoint keeps the last good annotation.
    std::fs::write(&checkpoint, b"{\"Data\":{\"PodDeviceEntries\":[{\"PodUID\"").expect("truncate");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        api.resource_version(),
        settled,
        "a corrupt checkpoint changed what is published"
    );

    // The legacy pod goes away: its entry is dropped.
    std::fs::copy(fixture("two-pods-two-numa.json"), &checkpoint).expect("restore");
    api.remove("v1", "pods", "default", "legacy");
    std::fs::copy(fixture("one-gpu-numa0.json"), &checkpoint).expect("kubelet rewrote it");
    wait_until("legacy entry dropped", || {
        api.get(DEVICES, "devices", "", "gpu-node-1")
            .is_some_and(|d| {
                d["metadata"]["annotations"]["node.koordinator.sh/devices-checkpoints"] == "[]"
            })
    })
    .await;

    let _ = stop_loop.send(());
    let _ = task.await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
}
