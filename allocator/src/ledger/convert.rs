//! Between the cluster's objects and the allocator's state: a Device CR's GPUs
//! (with device-plugin holders and NVLink peers), a pod's allocation annotation
//! read as a placement and a placement written as one.

use super::*;

pub(super) fn quantity(
    resources: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    key: &str,
) -> u64 {
    resources
        .get(key)
        .and_then(|q| Quantity::parse(&q.0).ok())
        .map_or(0, |q| q.value())
}

/// The node's NVLinks from its Device CR's annotation, limited to its GPUs. A
/// malformed annotation gives no links (it only ever steers a preference, so the
/// node stays schedulable); links to GPUs the CR does not list are dropped.
pub(super) fn device_nvlinks(device: &Device) -> NvlinkPeers {
    let name = device.metadata.name.as_deref().unwrap_or_default();
    let Some(text) = device
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NVLINK_PEERS))
    else {
        return NvlinkPeers::default();
    };
    let mut links = match NvlinkPeers::decode(text) {
        Ok(links) => links,
        Err(error) => {
            tracing::warn!(device = name, %error, "NVLink peers ignored");
            return NvlinkPeers::default();
        }
    };
    let known: BTreeSet<&str> = device.spec.devices.iter().map(|d| d.id.as_str()).collect();
    let dropped = links.retain_known(&known);
    if !dropped.is_empty() {
        tracing::warn!(
            device = name,
            ?dropped,
            "NVLink peers name GPUs the Device does not list; those links are ignored"
        );
    }
    links
}

/// UIDs of the pods holding GPUs through the device plugin, from a Device CR's
/// kubelet checkpoint annotation.
pub(super) fn legacy_pod_uids(device: &Device) -> BTreeSet<String> {
    // Unreadable: no pod is known to hold GPUs that way (device_gpus then holds
    // every GPU of the node, so none is handed out meanwhile).
    device
        .legacy_entries()
        .unwrap_or_default()
        .into_iter()
        .map(|entry| entry.pod_uid)
        .collect()
}

/// The node's GPUs from its Device CR, with nothing in use.
pub fn device_gpus(device: &Device) -> Vec<GpuState> {
    let nvlinks = device_nvlinks(device);
    // Which GPUs device-plugin pods hold. Unreadable, any GPU may be one of them:
    // every GPU counts as held until the reporter writes it again, rather than a
    // GPU a device-plugin pod holds being granted a second time.
    let legacy: Option<BTreeSet<String>> = match device.legacy_entries() {
        Ok(entries) => Some(
            entries
                .into_iter()
                .flat_map(|entry| entry.device_ids)
                .collect(),
        ),
        Err(error) => {
            tracing::warn!(%error, cause = %error.source, "every GPU of the node held meanwhile");
            None
        }
    };
    device
        .spec
        .devices
        .iter()
        .filter(|d| d.device_type == DEVICE_TYPE_GPU && !d.id.is_empty())
        .map(|d| GpuState {
            uuid: d.id.clone(),
            minor: d
                .minor
                .and_then(|m| u32::try_from(m).ok())
                .unwrap_or_default(),
            healthy: d.health,
            legacy: legacy.as_ref().is_none_or(|held| held.contains(&d.id)),
            memory_total: quantity(&d.resources, GPU_MEMORY),
            numa: d.topology.as_ref().map_or(-1, |t| t.node_id),
            pcie: d
                .topology
                .as_ref()
                .map(|t| t.pcie_id.clone())
                .unwrap_or_default(),
            nvlink_peers: nvlinks.peers_of(&d.id).map(str::to_owned).collect(),
            labels: std::sync::Arc::new(d.labels.clone()),
            ..GpuState::default()
        })
        .collect()
}

/// `namespace/name` of a pod, for messages and reports.
pub fn pod_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("")
    )
}

/// Whether a pod still holds its devices: assigned and not finished.
pub fn holds_devices(pod: &Pod) -> Option<&str> {
    let node = pod
        .spec
        .as_ref()?
        .node_name
        .as_deref()
        .filter(|n| !n.is_empty())?;
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    (!matches!(phase, Some("Succeeded" | "Failed"))).then_some(node)
}

/// The placement an allocation annotation describes, resolved against the node's GPUs.
pub fn placement_of(allocations: &DeviceAllocations, gpus: &[GpuState]) -> Placement {
    let share = |a: &DeviceAllocation| {
        let total = gpus
            .iter()
            .find(|g| g.uuid == a.id)
            .map_or(0, |g| g.memory_total);
        let memory = a.gpu_memory().unwrap_or_else(|| {
            a.gpu_memory_ratio()
                .map_or(0, |r| (u128::from(total) * u128::from(r) / 100) as u64)
        });
        GpuShare {
            uuid: a.id.clone(),
            minor: a.minor,
            core: a.gpu_core().unwrap_or(0),
            memory,
            ratio: a.gpu_memory_ratio().unwrap_or(0),
        }
    };
    Placement {
        gpus: allocations.gpus().iter().map(share).collect(),
        group: allocations.gpus().iter().find_map(sharing_group_of),
    }
}

/// Where the allocation annotation names a pod's sharing group: in each GPU entry's
/// `extension`, beside the per-container grants. Read from there, not from the
/// pod's own annotations, because only the scheduler writes this one (the admission
/// policy): a pod that changes its group annotation later does not move its GPU.
pub const SHARING_GROUP_EXTENSION: &str = "sharingGroup";

pub(super) fn sharing_group_of(entry: &DeviceAllocation) -> Option<String> {
    entry
        .extension
        .as_ref()?
        .get(SHARING_GROUP_EXTENSION)?
        .as_str()
        .map(str::to_owned)
}

pub(super) fn share_resources(share: &GpuShare) -> BTreeMap<String, Quantity> {
    BTreeMap::from([
        (GPU_CORE.to_owned(), Quantity::from_units(share.core)),
        (
            GPU_MEMORY_RATIO.to_owned(),
            Quantity::from_units(share.ratio),
        ),
        (GPU_MEMORY.to_owned(), Quantity::from_units(share.memory)),
    ])
}

/// The annotation value for a pod's placement: the pod-level list (what the pod
/// books on each GPU), each entry naming the containers that get the GPU and
/// their shares (`extension.containers`, see [`tessera_api::allocation`]).
pub fn annotation_of(placement: &PodPlacement) -> String {
    let gpus = placement
        .booked
        .gpus
        .iter()
        .map(|booked| DeviceAllocation {
            minor: booked.minor,
            id: booked.uuid.clone(),
            resources: share_resources(booked),
            containers: Some(
                placement
                    .containers
                    .iter()
                    .filter_map(|container| {
                        let share = container.gpus.iter().find(|s| s.uuid == booked.uuid)?;
                        Some((container.name.clone(), share_resources(share)))
                    })
                    .collect(),
            ),
            extension: placement
                .booked
                .group
                .as_ref()
                .map(|group| serde_json::json!({ SHARING_GROUP_EXTENSION: group })),
        })
        .collect();
    DeviceAllocations {
        devices: BTreeMap::from([(DEVICE_TYPE_GPU.to_owned(), gpus)]),
    }
    .to_annotation()
}
