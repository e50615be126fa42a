use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use serde_json::json;

use super::*;
use crate::device::{DeviceSpec, DeviceTopology};
use crate::resources::{DEVICE_TYPE_RDMA, GPU_CORE};

fn gpu(minor: i32, healthy: bool, memory: &str) -> DeviceInfo {
    DeviceInfo {
        device_type: DEVICE_TYPE_GPU.to_owned(),
        labels: BTreeMap::from([(
            LABEL_GPU_MODEL.to_owned(),
            "NVIDIA-H100-80GB-HBM3".to_owned(),
        )]),
        id: format!("GPU-{minor}"),
        minor: Some(minor),
        health: healthy,
        resources: BTreeMap::from([
            (GPU_CORE.to_owned(), K8sQuantity("100".to_owned())),
            (GPU_MEMORY.to_owned(), K8sQuantity(memory.to_owned())),
        ]),
        topology: Some(DeviceTopology {
            socket_id: 0,
            node_id: 1,
            pcie_id: "sw0".to_owned(),
            bus_id: "0000:19:00.0".to_owned(),
        }),
    }
}

/// The names of `slice`'s devices, in its order.
fn device_names(slice: ResourceSlice) -> Vec<String> {
    slice
        .spec
        .devices
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.name)
        .collect()
}

fn node_device(devices: Vec<DeviceInfo>) -> Device {
    Device::new("node-a", DeviceSpec { devices })
}

#[test]
fn each_healthy_gpu_is_a_shared_device_with_cores_and_memory() {
    let rdma = DeviceInfo {
        device_type: DEVICE_TYPE_RDMA.to_owned(),
        id: "mlx5_0".to_owned(),
        health: true,
        ..DeviceInfo::default()
    };
    let device = node_device(vec![gpu(0, true, "80Gi"), gpu(1, false, "80Gi"), rdma]);
    let (slice, left_out) = resource_slice("node-a", &device, 3).expect("slice");
    assert!(left_out.is_empty(), "{left_out:?}");
    let value = serde_json::to_value(&slice).expect("json");
    assert_eq!(value["metadata"]["name"], json!("node-a-gpu.tessera.io"));
    assert_eq!(value["spec"]["driver"], json!(DRIVER));
    assert_eq!(value["spec"]["nodeName"], json!("node-a"));
    assert_eq!(
        value["spec"]["pool"],
        json!({"name": "node-a", "generation": 3, "resourceSliceCount": 1})
    );
    // The unhealthy GPU and the RDMA device are not offered.
    let devices = value["spec"]["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 1);
    assert_eq!(
        devices[0],
        json!({
            "name": "gpu-0",
            "allowMultipleAllocations": true,
            "attributes": {
                "uuid": {"string": "GPU-0"},
                "model": {"string": "NVIDIA-H100-80GB-HBM3"},
                "minor": {"int": 0},
                "numaNode": {"int": 1},
                "pcieSwitch": {"string": "sw0"},
                "pciBusID": {"string": "0000:19:00.0"},
            },
            "capacity": {
                "cores": {"value": "100", "requestPolicy": {
                    "default": "100", "validRange": {"min": "0", "max": "100", "step": "1"}}},
                "memory": {"value": "85899345920", "requestPolicy": {
                    "default": "85899345920",
                    "validRange": {"min": "1048576", "max": "85899345920", "step": "1048576"}}},
            },
        })
    );
}

#[test]
fn a_gpu_without_memory_is_left_out_naming_it_and_a_repeated_minor_refused() {
    let (slice, left_out) = resource_slice(
        "node-a",
        &node_device(vec![gpu(0, true, "0"), gpu(1, true, "80Gi")]),
        1,
    )
    .expect("slice");
    assert_eq!(
        left_out,
        [SliceError::NoMemory {
            node: "node-a".to_owned(),
            uuid: "GPU-0".to_owned()
        }]
    );
    assert_eq!(device_names(slice), ["gpu-1"]);
    let twice = resource_slice(
        "node-a",
        &node_device(vec![gpu(2, true, "80Gi"), gpu(2, true, "80Gi")]),
        1,
    );
    let error = twice.map(|_| ()).expect_err("repeated minor");
    assert_eq!(
        error.to_string(),
        "Device node-a: two GPUs are both device gpu-2 (a minor number repeated)"
    );
}

#[test]
fn a_gpu_without_a_minor_is_named_by_its_place() {
    let mut unnumbered = gpu(0, true, "16Gi");
    unnumbered.minor = None;
    let (slice, _) = resource_slice(
        "node-a",
        &node_device(vec![gpu(0, true, "16Gi"), unnumbered]),
        1,
    )
    .expect("slice");
    assert_eq!(device_names(slice), ["gpu-0", "gpu-at-1"]);
}

#[test]
fn the_device_class_selects_the_drivers_devices() {
    let class = serde_json::to_value(device_class()).expect("json");
    assert_eq!(class["metadata"]["name"], json!(DEVICE_CLASS));
    assert_eq!(
        class["spec"]["selectors"],
        json!([{"cel": {"expression": "device.driver == \"gpu.tessera.io\""}}])
    );
}

#[test]
fn memory_not_a_whole_mib_is_offered_rounded_down_to_one() {
    // 80 GiB and half a MiB, as NVML may report a total: kube-apiserver refuses a
    // capacity that is not whole steps of the smallest request.
    let odd = (80u64 << 30) + (1 << 19);
    let (slice, _) = resource_slice(
        "node-a",
        &node_device(vec![gpu(0, true, &odd.to_string())]),
        1,
    )
    .expect("slice");
    let value = serde_json::to_value(&slice).expect("json");
    let memory = &value["spec"]["devices"][0]["capacity"]["memory"];
    let whole = (80u64 << 30).to_string();
    assert_eq!(memory["value"], json!(whole));
    assert_eq!(memory["requestPolicy"]["default"], json!(whole));
    assert_eq!(memory["requestPolicy"]["validRange"]["max"], json!(whole));
}
