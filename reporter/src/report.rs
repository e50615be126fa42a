//! The pure step: from GPUs, health and the checkpoint to what is published.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::resources::{
    DEVICE_ALLOCATED, DEVICE_TYPE_GPU, DEVICES_CHECKPOINTS, ENFORCEMENT, GPU_CORE, GPU_MEMORY,
    GPU_MEMORY_RATIO, NVIDIA_GPU, NVLINK_PEERS, label_value,
};
pub use tessera_api::resources::{LABEL_DRIVER_VERSION, LABEL_GPU_MODEL};
use tessera_api::{DeviceInfo, DeviceSpec, DeviceTopology, LegacyDeviceEntry, NvlinkPeers};

use crate::checkpoint::{Checkpoint, CheckpointEntry, gpu_index};
use crate::gpu::NodeGpus;

/// Which extended resources the node advertises besides `koordinator.sh/*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityOptions {
    /// `aliyun.com/gpu-mem`, `nvidia.com/gpumem`, `nvidia.com/gpucores`, `volcano.sh/gpu-memory`.
    pub aliases: bool,
    /// `nvidia.com/gpu` (only when no device plugin serves it).
    pub nvidia_gpu: bool,
    /// `nvidia.com/gpu` slots per GPU: HAMi's `deviceSplitCount`, under which
    /// several pods asking `nvidia.com/gpu: 1` with a memory or core share fit one
    /// GPU in kube-scheduler's count; 1 is the physical count (NVIDIA's plugin).
    pub nvidia_gpu_split: u32,
    /// The unit of `aliyun.com/gpu-mem`: the same as tessera-scheduler's
    /// `--gpushare-memory-unit`, so capacity and requests count alike.
    pub gpushare_memory_unit: tessera_api::request::MemoryUnit,
}

impl Default for CapacityOptions {
    fn default() -> Self {
        Self {
            aliases: true,
            nvidia_gpu: false,
            nvidia_gpu_split: 1,
            gpushare_memory_unit: tessera_api::request::MemoryUnit::default(),
        }
    }
}

/// Where tessera-runtime-proxy lists the node's enforcement backends (its
/// `--enforcement-dir`, default `/run/tessera/enforce`, then `backends`).
pub const DEFAULT_ENFORCEMENT_FILE: &str = "/run/tessera/enforce/backends";

/// The node's enforcement backends from the proxy's file: none when it is missing
/// (no proxy, or one before enforcement) or unreadable, which keeps pods that
/// require enforcement off the node rather than on it.
pub fn read_enforcement(path: &std::path::Path) -> Vec<tessera_api::enforcement::Backend> {
    match std::fs::read_to_string(path) {
        Ok(text) => tessera_api::enforcement::parse_joined(&text).unwrap_or_else(|error| {
            tracing::error!(file = %path.display(), %error, "enforcement backends not understood; publishing none");
            Vec::new()
        }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => {
            tracing::error!(file = %path.display(), %error, "enforcement backends not readable; publishing none");
            Vec::new()
        }
    }
}

/// Puts the node's enforcement on the Device CR: the `tessera.io/enforcement`
/// annotation and, on each GPU, the labels of what is held.
pub fn with_enforcement(
    spec: &mut DeviceSpec,
    annotations: &mut BTreeMap<String, String>,
    backends: &[tessera_api::enforcement::Backend],
) {
    use tessera_api::enforcement::{gpu_labels, joined};
    annotations.insert(ENFORCEMENT.to_owned(), joined(backends));
    let labels = gpu_labels(backends);
    for device in &mut spec.devices {
        device.labels.extend(labels.clone());
    }
}

/// Whether `node` carries the switch taint (its runtime proxy unproven).
pub fn switch_unproven(node: &k8s_openapi::api::core::v1::Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| {
            taints
                .iter()
                .any(|t| t.key == tessera_api::resources::SWITCH_TAINT)
        })
}

/// Whether the node's switch is unproven (`unproven`: it carries the switch taint,
/// so no GPU hook runs there), on the Device CR, for tessera-scheduler's refusal.
/// Capacity stays as it is: a kubelet restarted with less allocatable than its
/// running pods hold rejects them at re-admission, and a switch-over restarts it.
pub fn with_switch(annotations: &mut BTreeMap<String, String>, unproven: bool) {
    annotations.insert(
        tessera_api::resources::SWITCH_UNPROVEN.to_owned(),
        unproven.to_string(),
    );
}

fn quantity(value: u64) -> Quantity {
    Quantity(value.to_string())
}

/// The Device CR spec: one `gpu` entry per GPU, healthy or not, each labelled
/// with its model (the scheduler matches HAMi's `use-gputype` and Koordinator's
/// device hints against it; a node may hold GPUs of several models).
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
                labels: BTreeMap::from([(LABEL_GPU_MODEL.to_owned(), label_value(&gpu.model))]),
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

/// The node's NVLinks, from each GPU's peers as NVML reports them.
pub fn nvlink_peers(gpus: &NodeGpus) -> NvlinkPeers {
    let mut links = NvlinkPeers::default();
    for gpu in &gpus.gpus {
        for peer in &gpu.nvlink_peers {
            links.link(&gpu.uuid, peer);
        }
    }
    links
}

/// The Device CR's annotations the reporter owns: the legacy pods' GPUs and the
/// GPUs' NVLink peers (`{}` when there are none, so the scheduler can tell "no
/// NVLink" from a reporter that predates the annotation).
pub fn device_annotations(
    gpus: &NodeGpus,
    legacy: &[LegacyDeviceEntry],
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            DEVICES_CHECKPOINTS.to_owned(),
            LegacyDeviceEntry::encode_all(legacy),
        ),
        (NVLINK_PEERS.to_owned(), nvlink_peers(gpus).encode()),
    ])
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
        capacity.insert(
            "aliyun.com/gpu-mem".into(),
            quantity(
                healthy
                    .iter()
                    .map(|g| g.memory_bytes / options.gpushare_memory_unit.bytes())
                    .sum(),
            ),
        );
        capacity.insert("nvidia.com/gpumem".into(), quantity(mib));
        capacity.insert("nvidia.com/gpucores".into(), quantity(100 * count));
        capacity.insert("volcano.sh/gpu-memory".into(), quantity(mib));
    }
    if options.nvidia_gpu {
        // kube-scheduler only counts slots; tessera-scheduler books the GPUs.
        let slots = count * u64::from(options.nvidia_gpu_split.max(1));
        capacity.insert(NVIDIA_GPU.into(), quantity(slots));
    }
    capacity
}

/// Labels naming the GPU model and driver version (label-safe values).
pub fn node_labels(gpus: &NodeGpus) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    if let Some(gpu) = gpus.gpus.first() {
        labels.insert(LABEL_GPU_MODEL.to_owned(), label_value(&gpu.model));
    }
    if !gpus.driver_version.is_empty() {
        labels.insert(
            LABEL_DRIVER_VERSION.to_owned(),
            label_value(&gpus.driver_version),
        );
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
/// exists on the node and was not placed by Tessera, naming their GPUs by UUID.
/// A device plugin run with `--device-id-strategy index` names GPUs by NVML index:
/// `gpus` (this node's NVML view) maps them, or the scheduler would not see them
/// as taken and could hand them out again.
pub fn legacy_entries(
    checkpoint: &Checkpoint,
    pods: &[NodePod],
    resources: &[String],
    gpus: &NodeGpus,
) -> Vec<LegacyDeviceEntry> {
    entries_of(checkpoint, resources)
        .filter(|e| {
            pods.iter()
                .any(|p| p.uid == e.pod_uid && !p.tessera_allocated)
        })
        .map(|e| legacy_entry(e, gpus))
        .collect()
}

/// Every grant of `resources` kubelet's checkpoint records, whoever's pod, GPUs
/// by UUID as [`legacy_entries`] names them (unmapped indices are said there, once
/// a publish, not here).
pub fn plugin_grants(
    checkpoint: &Checkpoint,
    resources: &[String],
    gpus: &NodeGpus,
) -> Vec<LegacyDeviceEntry> {
    entries_of(checkpoint, resources)
        .map(|e| by_uuid(e, gpus))
        .collect()
}

/// The checkpoint's entries of `resources`.
fn entries_of<'a>(
    checkpoint: &'a Checkpoint,
    resources: &'a [String],
) -> impl Iterator<Item = &'a CheckpointEntry> {
    checkpoint
        .entries
        .iter()
        .filter(|e| resources.contains(&e.resource_name))
}

/// One checkpoint entry, indices mapped through `gpus`.
fn by_uuid(entry: &CheckpointEntry, gpus: &NodeGpus) -> LegacyDeviceEntry {
    entry.legacy_entry(|index| {
        gpus.gpus
            .iter()
            .find(|gpu| gpu.index == index)
            .map(|gpu| gpu.uuid.clone())
    })
}

/// One checkpoint entry as the Device CR publishes it, indices mapped through `gpus`.
pub fn legacy_entry(entry: &CheckpointEntry, gpus: &NodeGpus) -> LegacyDeviceEntry {
    let published = by_uuid(entry, gpus);
    for id in &published.device_ids {
        if gpu_index(id).is_some() {
            tracing::warn!(
                pod_uid = %entry.pod_uid,
                container = %entry.container_name,
                id,
                "a device plugin's GPU index names no GPU NVML lists; published as it is"
            );
        }
    }
    published
}

#[cfg(test)]
mod tests {
    use super::*;
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
        // Each GPU carries its model, for HAMi's use-gputype and Koordinator's hints.
        assert_eq!(
            spec.devices[1].labels[LABEL_GPU_MODEL],
            "NVIDIA-H100-80GB-HBM3"
        );
    }

    /// NVML's per-GPU peers reach the Device CR as the annotation the scheduler
    /// decodes, a link listed by one side only included.
    #[test]
    fn nvlink_peers_are_published_in_the_annotation() {
        let mut node = gpus();
        node.gpus[0].nvlink_peers = vec!["GPU-1".into()];
        let annotations = device_annotations(&node, &[]);
        assert_eq!(annotations[DEVICES_CHECKPOINTS], "[]");
        let links = NvlinkPeers::decode(&annotations[NVLINK_PEERS]).expect("decodes");
        assert_eq!(links.peers_of("GPU-0").collect::<Vec<_>>(), ["GPU-1"]);
        assert_eq!(links.peers_of("GPU-1").collect::<Vec<_>>(), ["GPU-0"]);
        assert_eq!(device_annotations(&gpus(), &[])[NVLINK_PEERS], "{}");
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
                ..CapacityOptions::default()
            },
        );
        assert_eq!(capacity[GPU_CORE], quantity(100));
        assert_eq!(capacity[GPU_MEMORY_RATIO], quantity(100));
        // GiB per GPU, gpushare's default unit, as tessera-scheduler reads requests.
        assert_eq!(capacity["aliyun.com/gpu-mem"], quantity(80));
        assert_eq!(capacity["nvidia.com/gpucores"], quantity(100));
        assert_eq!(capacity[NVIDIA_GPU], quantity(1));
        // HAMi's split: slots per healthy GPU.
        let split = node_capacity(
            &gpus(),
            &unhealthy,
            &CapacityOptions {
                nvidia_gpu: true,
                nvidia_gpu_split: 10,
                ..CapacityOptions::default()
            },
        );
        assert_eq!(split[NVIDIA_GPU], quantity(10));
        let plain = node_capacity(
            &gpus(),
            &BTreeSet::new(),
            &CapacityOptions {
                aliases: false,
                nvidia_gpu: false,
                ..CapacityOptions::default()
            },
        );
        assert_eq!(plain.len(), 3);
        assert_eq!(plain[GPU_CORE], quantity(200));
    }

    #[test]
    fn the_device_cr_says_whether_the_switch_is_proven() {
        let node = |taints: serde_json::Value| -> k8s_openapi::api::core::v1::Node {
            serde_json::from_value(
                serde_json::json!({"metadata": {"name": "n"}, "spec": {"taints": taints}}),
            )
            .expect("a Node")
        };
        assert!(switch_unproven(&node(serde_json::json!([
            {"key": "tessera.io/runtime-proxy", "effect": "NoSchedule"}
        ]))));
        assert!(!switch_unproven(&node(serde_json::json!([
            {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
        ]))));
        assert!(!switch_unproven(&node(serde_json::json!(null))));
        let mut annotations = BTreeMap::new();
        with_switch(&mut annotations, false);
        assert_eq!(
            annotations[tessera_api::resources::SWITCH_UNPROVEN],
            "false"
        );
        with_switch(&mut annotations, true);
        assert_eq!(annotations[tessera_api::resources::SWITCH_UNPROVEN], "true");
    }

    #[test]
    fn labels_are_label_safe() {
        let labels = node_labels(&gpus());
        assert_eq!(labels[LABEL_GPU_MODEL], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(labels[LABEL_DRIVER_VERSION], "550.54.15");
    }

    /// A node may hold several models: the node label names the first GPU's, each
    /// Device CR entry its own.
    #[test]
    fn the_node_label_names_the_first_gpus_model() {
        let mut node = gpus();
        node.gpus[1].model = "NVIDIA A100-SXM4-80GB".into();
        assert_eq!(node_labels(&node)[LABEL_GPU_MODEL], "NVIDIA-H100-80GB-HBM3");
        let spec = device_spec(&node, &BTreeSet::new());
        assert_eq!(
            spec.devices[1].labels[LABEL_GPU_MODEL],
            "NVIDIA-A100-SXM4-80GB"
        );
    }

    #[test]
    fn legacy_filter_drops_gone_and_tessera_pods() {
        let entry = |uid: &str| checkpoint_entry(uid, &["GPU-0"], &[]);
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
        let resources = [NVIDIA_GPU.to_owned()];
        let entries = legacy_entries(&checkpoint, &pods, &resources, &gpus());
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].pod_uid, "live");
        let other = ["other.com/x".to_owned()];
        assert!(legacy_entries(&checkpoint, &pods, &other, &gpus()).is_empty());
    }

    /// An `nvidia.com/gpu` entry of container `app` of pod `uid`: kubelet's
    /// `device_ids` and the plugin's `NVIDIA_VISIBLE_DEVICES` items.
    fn checkpoint_entry(uid: &str, device_ids: &[&str], visible: &[&str]) -> CheckpointEntry {
        let owned = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect();
        CheckpointEntry {
            pod_uid: uid.into(),
            container_name: "app".into(),
            resource_name: NVIDIA_GPU.into(),
            device_ids: owned(device_ids),
            numa_nodes: vec![0],
            visible_devices: owned(visible),
            device_envs: BTreeMap::new(),
            mounts: vec![],
            device_nodes: vec![],
        }
    }

    /// Whatever the device plugin's strategy, a legacy pod's GPUs reach the Device
    /// CR as the UUIDs the scheduler matches, so they are never handed out twice.
    #[test]
    fn legacy_gpus_are_published_by_uuid_for_every_plugin_strategy() {
        let volume = tessera_api::checkpoint::DEVICE_LIST_MOUNT_ROOT;
        /// (strategy, kubelet's DeviceIDs, plugin's NVIDIA_VISIBLE_DEVICES, published)
        type Row<'a> = (&'a str, &'a [&'a str], &'a [&'a str], &'a [&'a str]);
        #[rustfmt::skip]
        let table: &[Row] = &[
            ("envvar, uuid", &["GPU-1"], &["GPU-1"], &["GPU-1"]),
            ("envvar, index", &["1", "0"], &["1", "0"], &["GPU-1", "GPU-0"]),
            ("volume-mounts, uuid", &["GPU-1"], &[volume], &["GPU-1"]),
            ("volume-mounts, index", &["1"], &[volume], &["GPU-1"]),
            ("time-slicing replicas", &["GPU-0::2", "GPU-0::5"], &["GPU-0"], &["GPU-0"]),
            ("time-slicing replicas, index", &["0::2"], &["0"], &["GPU-0"]),
            ("cdi, env void", &["GPU-1"], &["void"], &["GPU-1"]),
            ("mig, index", &["1:0", "1:3"], &["1:0", "1:3"], &["GPU-1"]),
            ("no AllocResp", &["GPU-0"], &[], &["GPU-0"]),
            ("an index NVML does not list", &["5"], &["5"], &["5"]),
        ];
        let pods = [NodePod {
            uid: "legacy".into(),
            tessera_allocated: false,
        }];
        for (strategy, device_ids, visible, published) in table {
            let checkpoint = Checkpoint {
                entries: vec![checkpoint_entry("legacy", device_ids, visible)],
                ..Default::default()
            };
            let entries = legacy_entries(&checkpoint, &pods, &[NVIDIA_GPU.to_owned()], &gpus());
            assert_eq!(entries.len(), 1, "{strategy}");
            assert_eq!(entries[0].device_ids, *published, "{strategy}");
        }
    }

    #[test]
    fn the_proxys_backends_reach_the_device_cr() -> Result<(), Box<dyn std::error::Error>> {
        use tessera_api::enforcement::{Backend, LABEL_ENFORCE_COMPUTE, LABEL_ENFORCE_MEMORY};
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("backends");
        assert!(read_enforcement(&file).is_empty(), "missing file: none");
        std::fs::write(&file, "driver-memory\n")?;
        assert_eq!(read_enforcement(&file), [Backend::DriverMemory]);
        std::fs::write(&file, "driver-memory+warp-drive")?;
        assert!(read_enforcement(&file).is_empty(), "not understood: none");

        let mut spec = device_spec(&gpus(), &BTreeSet::new());
        let mut annotations = device_annotations(&gpus(), &[]);
        with_enforcement(&mut spec, &mut annotations, &[Backend::DriverMemory]);
        assert_eq!(annotations[ENFORCEMENT], "driver-memory");
        for device in &spec.devices {
            assert_eq!(
                device.labels.get(LABEL_ENFORCE_MEMORY).map(String::as_str),
                Some("true")
            );
            assert!(!device.labels.contains_key(LABEL_ENFORCE_COMPUTE));
            assert!(device.labels.contains_key(LABEL_GPU_MODEL));
        }
        Ok(())
    }
}
