//! The pure step: from GPUs, health and the checkpoint to what is published.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::resources::{
    DEVICE_ALLOCATED, DEVICE_TYPE_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, NVIDIA_GPU,
};
use tessera_api::{DeviceInfo, DeviceSpec, DeviceTopology, LegacyDeviceEntry};

use crate::checkpoint::{Checkpoint, CheckpointEntry};
use crate::gpu::NodeGpus;

/// Node label of the GPU model.
pub const LABEL_GPU_MODEL: &str = "node.koordinator.sh/gpu-model";
/// Node label of the driver version.
pub const LABEL_DRIVER_VERSION: &str = "node.koordinator.sh/gpu-driver-version";

/// Which extended resources the node advertises besides `koordinator.sh/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityOptions {
    /// `aliyun.com/gpu-mem`, `nvidia.com/gpumem`, `nvidia.com/gpucores`, `volcano.sh/gpu-memory`.
    pub aliases: bool,
    /// `nvidia.com/gpu` (only when no device plugin serves it).
    pub nvidia_gpu: bool,
}

impl Default for CapacityOptions {
    fn default() -> Self {
        Self {
            aliases: true,
            nvidia_gpu: false,
        }
    }
}

fn quantity(value: u64) -> Quantity {
    Quantity(value.to_string())
}

/// The Device CR spec: one `gpu` entry per GPU, healthy or not.
pub fn device_spec(gpus: &NodeGpus, unhealthy: &BTreeSet<String>) -> DeviceSpec {
    let devices = gpus
        .gpus
        .iter()
        .map(|gpu| {
            let numa = gpu
                .numa_node
                .and_then(|n| i32::try_from(n).ok())
                .unwrap_or(-1);
            DeviceInfo {
                device_type: DEVICE_TYPE_GPU.into(),
                id: gpu.uuid.clone(),
                minor: i32::try_from(gpu.minor).ok(),
                health: !unhealthy.contains(&gpu.uuid),
                resources: BTreeMap::from([
                    (GPU_CORE.to_owned(), quantity(100)),
                    (GPU_MEMORY.to_owned(), quantity(gpu.memory_bytes)),
                    (GPU_MEMORY_RATIO.to_owned(), quantity(100)),
                ]),
                topology: Some(DeviceTopology {
                    // NVML reports NUMA nodes, not sockets; one NUMA node per socket is the common case.
                    socket_id: numa,
                    node_id: numa,
                    pcie_id: gpu.pcie_id.clone(),
                    bus_id: gpu.bus_id.clone(),
                }),
            }
        })
        .collect();
    DeviceSpec { devices }
}

/// Extended resources for the node's capacity and allocatable: sums over healthy GPUs.
pub fn node_capacity(
    gpus: &NodeGpus,
    unhealthy: &BTreeSet<String>,
    options: &CapacityOptions,
) -> BTreeMap<String, Quantity> {
    let healthy: Vec<_> = gpus
        .gpus
        .iter()
        .filter(|g| !unhealthy.contains(&g.uuid))
        .collect();
    let count = healthy.len() as u64;
    let bytes: u64 = healthy.iter().map(|g| g.memory_bytes).sum();
    let mib = bytes >> 20;
    let mut capacity = BTreeMap::from([
        (GPU_CORE.to_owned(), quantity(100 * count)),
        (GPU_MEMORY.to_owned(), quantity(bytes)),
        (GPU_MEMORY_RATIO.to_owned(), quantity(100 * count)),
    ]);
    if options.aliases {
        // Each alias in its own system's unit.
        capacity.insert("aliyun.com/gpu-mem".into(), quantity(mib));
        capacity.insert("nvidia.com/gpumem".into(), quantity(mib));
        capacity.insert("nvidia.com/gpucores".into(), quantity(100 * count));
        capacity.insert("volcano.sh/gpu-memory".into(), quantity(mib));
    }
    if options.nvidia_gpu {
        capacity.insert(NVIDIA_GPU.into(), quantity(count));
    }
    capacity
}

/// Labels naming the GPU model and driver version (label-safe values).
pub fn node_labels(gpus: &NodeGpus) -> BTreeMap<String, String> {
    let safe = |text: &str| -> String {
        let mapped: String = text
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        mapped
            .trim_matches(|c: char| !c.is_ascii_alphanumeric())
            .chars()
            .take(63)
            .collect()
    };
    let mut labels = BTreeMap::new();
    if let Some(gpu) = gpus.gpus.first() {
        labels.insert(LABEL_GPU_MODEL.to_owned(), safe(&gpu.model));
    }
    if !gpus.driver_version.is_empty() {
        labels.insert(LABEL_DRIVER_VERSION.to_owned(), safe(&gpus.driver_version));
    }
    labels
}

/// A pod on this node, as far as the legacy filter needs it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodePod {
    /// The pod's UID.
    pub uid: String,
    /// Whether the pod carries Tessera's allocation annotation.
    pub tessera_allocated: bool,
}

impl NodePod {
    /// From a Kubernetes pod.
    pub fn from_pod(pod: &k8s_openapi::api::core::v1::Pod) -> Self {
        Self {
            uid: pod.metadata.uid.clone().unwrap_or_default(),
            tessera_allocated: pod
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(DEVICE_ALLOCATED)),
        }
    }
}

/// Legacy entries to publish: checkpoint entries of `resources` whose pod still
/// exists on the node and was not placed by Tessera.
pub fn legacy_entries(
    checkpoint: &Checkpoint,
    pods: &[NodePod],
    resources: &[String],
) -> Vec<LegacyDeviceEntry> {
    checkpoint
        .entries
        .iter()
        .filter(|e| resources.contains(&e.resource_name))
        .filter(|e| {
            pods.iter()
                .any(|p| p.uid == e.pod_uid && !p.tessera_allocated)
        })
        .map(CheckpointEntry::legacy_entry)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointEntry;
    use crate::gpu::GpuInfo;

    fn gpus() -> NodeGpus {
        let gpu = |i: u32| GpuInfo {
            uuid: format!("GPU-{i}"),
            index: i,
            minor: i,
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 80 << 30,
            bus_id: format!("00000000:{:02X}:00.0", 0x19 + i),
            numa_node: Some(i / 2),
            pcie_id: "00000000:19:00.0".into(),
            nvlink_peers: vec![],
        };
        NodeGpus {
            driver_version: "550.54.15".into(),
            gpus: vec![gpu(0), gpu(1)],
        }
    }

    #[test]
    fn device_spec_per_gpu() {
        let unhealthy = BTreeSet::from(["GPU-1".to_owned()]);
        let spec = device_spec(&gpus(), &unhealthy);
        assert_eq!(spec.devices.len(), 2);
        assert!(spec.devices[0].health && !spec.devices[1].health);
        assert_eq!(
            spec.devices[1].resources[GPU_MEMORY],
            Quantity((80u64 << 30).to_string())
        );
        assert_eq!(
            spec.devices[1].topology.as_ref().map(|t| t.node_id),
            Some(0)
        );
    }

    #[test]
    fn capacity_sums_healthy_gpus_in_each_unit() {
        let unhealthy = BTreeSet::from(["GPU-1".to_owned()]);
        let capacity = node_capacity(
            &gpus(),
            &unhealthy,
            &CapacityOptions {
                aliases: true,
                nvidia_gpu: true,
            },
        );
        assert_eq!(capacity[GPU_CORE], quantity(100));
        assert_eq!(capacity[GPU_MEMORY_RATIO], quantity(100));
        assert_eq!(capacity["aliyun.com/gpu-mem"], quantity(80 * 1024));
        assert_eq!(capacity["nvidia.com/gpucores"], quantity(100));
        assert_eq!(capacity[NVIDIA_GPU], quantity(1));
        let plain = node_capacity(
            &gpus(),
            &BTreeSet::new(),
            &CapacityOptions {
                aliases: false,
                nvidia_gpu: false,
            },
        );
        assert_eq!(plain.len(), 3);
        assert_eq!(plain[GPU_CORE], quantity(200));
    }

    #[test]
    fn labels_are_label_safe() {
        let labels = node_labels(&gpus());
        assert_eq!(labels[LABEL_GPU_MODEL], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(labels[LABEL_DRIVER_VERSION], "550.54.15");
    }

    #[test]
    fn legacy_filter_drops_gone_and_tessera_pods() {
        let entry = |uid: &str| CheckpointEntry {
            pod_uid: uid.into(),
            container_name: "app".into(),
            resource_name: NVIDIA_GPU.into(),
            device_ids: vec!["GPU-0".into()],
            numa_nodes: vec![0],
            visible_devices: vec![],
            device_nodes: vec![],
        };
        let checkpoint = Checkpoint {
            entries: vec![entry("live"), entry("gone"), entry("tessera")],
            ..Default::default()
        };
        let pods = [
            NodePod {
                uid: "live".into(),
                tessera_allocated: false,
            },
            NodePod {
                uid: "tessera".into(),
                tessera_allocated: true,
            },
        ];
        let entries = legacy_entries(&checkpoint, &pods, &[NVIDIA_GPU.to_owned()]);
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].pod_uid, "live");
        assert!(legacy_entries(&checkpoint, &pods, &["other.com/x".to_owned()]).is_empty());
    }
}
