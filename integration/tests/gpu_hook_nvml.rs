//! The GPU hook's inventory from NVML (the fake library, through nvml-wrapper).

use std::sync::Arc;

use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hook_protocol::edit::apply;
use tessera_hook_protocol::hook::v1::{ContainerHookRequest, Event, PodMetadata};
use tessera_hooks::gpu::{GpuHookConfig, rewrite};
use tessera_hooks::probe::{DeviceProbe, HostProbe};
use tessera_integration::fake_nvml;
use tessera_integration::gpu_node::FakeGpuNode;

#[test]
fn nvml_inventory_maps_uuids_and_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = fake_nvml::four_gpu_node();
    let library = fake_nvml::install(&dir.path().join("driver"), &node).expect("fake driver");
    let devices = FakeGpuNode::create(dir.path(), 4).expect("device nodes (root)");
    // /proc information says other UUIDs: NVML must win.
    let probe = Arc::new(HostProbe::with_nvml(
        tessera_integration::probe_paths(&devices),
        &library,
    ));
    assert!(probe.has_nvml());
    let seen = probe.probe();
    let gpus = seen.gpus.expect("inventory");
    assert_eq!(gpus.len(), 4);
    assert_eq!(gpus[2].uuid, node["gpus"][2]["uuid"]);
    assert_eq!(gpus[2].memory_bytes, Some(85_899_345_920));

    let uuid = node["gpus"][2]["uuid"].as_str().expect("uuid").to_owned();
    let annotation = format!(
        r#"{{"gpu":[{{"minor":2,"id":"{uuid}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}}]}}"#
    );
    let mut container = ContainerHookRequest {
        event: Event::CreateContainer as i32,
        pod: Some(PodMetadata {
            name: "p".into(),
            namespace: "ns".into(),
            annotations: [(DEVICE_ALLOCATED.to_owned(), annotation)].into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let config = GpuHookConfig {
        device_root: devices.device_root.clone(),
        ..GpuHookConfig::default()
    };
    let edit = rewrite(&container, &probe.probe(), &config).expect("rewrites");
    apply(&mut container, &edit);
    let env = |key: &str| {
        container
            .envs
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.clone())
    };
    assert_eq!(env("NVIDIA_VISIBLE_DEVICES"), Some(uuid));
    assert_eq!(
        env("CUDA_DEVICE_MEMORY_LIMIT_0").as_deref(),
        Some("20480m"),
        "a quarter of 80 GiB, from NVML"
    );

    // A library that does not load: /proc is used.
    let fallback = HostProbe::with_nvml(
        tessera_integration::probe_paths(&devices),
        std::path::Path::new("/nonexistent/libnvidia-ml.so.1"),
    );
    assert!(!fallback.has_nvml());
    assert_eq!(
        fallback.probe().gpus.map(|g| g[0].uuid.clone()),
        Some(devices.gpus[0].uuid.clone())
    );
}
