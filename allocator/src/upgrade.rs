//! Allocation annotations in the pod-level form, written before per-container
//! grants (or by another Koordinator-style scheduler), give every device to the
//! whole pod: the GPU hook cannot tell which of its containers asked, so it gives
//! each container the pod's devices, a sidecar with no GPU request included. The
//! leader rewrites such an annotation of a running pod, once, into per-container
//! grants that keep what the pod had, but only for the containers that ask for a
//! GPU resource: each of them gets every device of the pod with the pod's share
//! (the old behaviour, so nothing running shrinks on a restart), the others none.
//! The pod's booking, the pod-level list, does not change. Containers already
//! running keep what they were started with; kubelet passes the annotation anew
//! with each container it creates, and those get the upgraded grants.

use k8s_openapi::api::core::v1::Pod;
use tessera_api::DeviceAllocations;
use tessera_api::request::container_asks_for_gpu;
use tessera_api::resources::DEVICE_ALLOCATED;

use crate::ledger::holds_devices;

/// The per-container form of `pod`'s allocation annotation, when the pod holds
/// devices and its annotation is in the pod-level form; `None` otherwise (no
/// annotation, already per-container, malformed: the hook refuses those anyway).
pub fn upgraded_annotation(pod: &Pod) -> Option<String> {
    holds_devices(pod)?;
    let text = pod.metadata.annotations.as_ref()?.get(DEVICE_ALLOCATED)?;
    let mut allocations = DeviceAllocations::parse(text).ok()?;
    if allocations.is_per_container() || allocations.devices.values().all(Vec::is_empty) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let asking: Vec<&str> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .filter(|c| container_asks_for_gpu(c))
        .map(|c| c.name.as_str())
        .collect();
    for device in allocations.devices.values_mut().flatten() {
        device.containers = Some(
            asking
                .iter()
                .map(|name| ((*name).to_owned(), device.resources.clone()))
                .collect(),
        );
    }
    Some(allocations.to_annotation())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(annotation: &str, phase: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u",
                "annotations": {DEVICE_ALLOCATED: annotation}},
            "spec": {
                "nodeName": "n1",
                "initContainers": [
                    {"name": "setup", "resources": {"limits": {"koordinator.sh/gpu": "10"}}},
                    {"name": "fetch"}
                ],
                "containers": [
                    {"name": "a", "resources": {"limits": {"koordinator.sh/gpu": "25"}}},
                    {"name": "b", "resources": {"requests": {"nvidia.com/gpumem": "1024"}, "limits": {"cpu": "1"}}},
                    {"name": "sidecar", "resources": {"limits": {"cpu": "1", "koordinator.sh/gpu-core": "0"}}}
                ]
            },
            "status": {"phase": phase}
        }))
        .expect("pod")
    }

    const POD_LEVEL: &str = r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#;

    #[test]
    fn only_containers_asking_for_a_gpu_keep_the_pods_share() {
        let text = upgraded_annotation(&pod(POD_LEVEL, "Running")).expect("upgraded");
        let upgraded = DeviceAllocations::parse(&text).expect("valid");
        assert!(upgraded.is_per_container());
        let before = DeviceAllocations::parse(POD_LEVEL).expect("valid");
        assert_eq!(
            upgraded.gpus()[0].resources,
            before.gpus()[0].resources,
            "the booking is unchanged"
        );
        for name in ["setup", "a", "b"] {
            let gpus = upgraded.gpus_of_container(name);
            assert_eq!(gpus.len(), 1, "{name}");
            assert_eq!(gpus[0].1.gpu_core(), Some(50), "{name}: the old behaviour");
        }
        for name in ["fetch", "sidecar"] {
            assert!(upgraded.gpus_of_container(name).is_empty(), "{name}");
        }
        // Once: the upgraded pod is left alone.
        assert_eq!(upgraded_annotation(&pod(&text, "Running")), None);
    }

    #[test]
    fn finished_or_malformed_pods_are_left_alone() {
        assert_eq!(upgraded_annotation(&pod(POD_LEVEL, "Succeeded")), None);
        assert_eq!(upgraded_annotation(&pod("{", "Running")), None);
        assert_eq!(upgraded_annotation(&pod(r#"{"gpu":[]}"#, "Running")), None);
    }
}
