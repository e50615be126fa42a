//! The scheduler's view of GPU use, derived from Device CRs and pods: per node, its
//! GPUs (from the Device CR) with the use of every assigned, non-terminated pod's
//! allocation annotation, plus allocations in flight (annotated by us, not yet seen
//! back). Pure data: the cluster watchers feed it, the extender reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::core::v1::Pod;
use tessera_api::resources::{
    DEVICE_ALLOCATED, DEVICE_TYPE_GPU, DEVICES_CHECKPOINTS, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO,
};
use tessera_api::{Device, DeviceAllocation, DeviceAllocations, LegacyDeviceEntry, Quantity};

use crate::core::{GpuShare, GpuState, NodeState, Placement, PodPlacement, account};

/// A pod's use of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodUse {
    node: String,
    /// The annotation, kept to re-resolve ratios when the node's GPUs change.
    allocations: DeviceAllocations,
    placement: Placement,
}

/// An allocation written by this scheduler but not yet seen back on the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reservation {
    node: String,
    placement: Placement,
    expires_at: u64,
}

/// Per-node GPU state with every known use applied.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Node → GPUs with use applied.
    nodes: HashMap<String, NodeState>,
    /// Pod UID → its use (from its annotation).
    pods: HashMap<String, PodUse>,
    /// Node → UIDs of pods using it.
    by_node: HashMap<String, BTreeSet<String>>,
    /// Pod UID → in-flight allocation.
    reservations: HashMap<String, Reservation>,
}

fn quantity(
    resources: &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    key: &str,
) -> u64 {
    resources
        .get(key)
        .and_then(|q| Quantity::parse(&q.0).ok())
        .map_or(0, |q| q.value())
}

/// The node's GPUs from its Device CR, with nothing in use.
pub fn device_gpus(device: &Device) -> Vec<GpuState> {
    let legacy: BTreeSet<String> = device
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DEVICES_CHECKPOINTS))
        .and_then(|text| serde_json::from_str::<Vec<LegacyDeviceEntry>>(text).ok())
        .into_iter()
        .flatten()
        .flat_map(|entry| entry.device_ids)
        .collect();
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
            legacy: legacy.contains(&d.id),
            memory_total: quantity(&d.resources, GPU_MEMORY),
            numa: d.topology.as_ref().map_or(-1, |t| t.node_id),
            pcie: d
                .topology
                .as_ref()
                .map(|t| t.pcie_id.clone())
                .unwrap_or_default(),
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
    }
}

fn share_resources(share: &GpuShare) -> BTreeMap<String, Quantity> {
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
            extension: None,
        })
        .collect();
    DeviceAllocations {
        devices: BTreeMap::from([(DEVICE_TYPE_GPU.to_owned(), gpus)]),
    }
    .to_annotation()
}

impl Ledger {
    fn remove_use(&mut self, uid: &str) {
        if let Some(old) = self.pods.remove(uid) {
            if let Some(node) = self.nodes.get_mut(&old.node) {
                account(node, &old.placement, false);
            }
            if let Some(set) = self.by_node.get_mut(&old.node) {
                set.remove(uid);
            }
        }
    }

    fn remove_reservation(&mut self, uid: &str) -> Option<Reservation> {
        let reservation = self.reservations.remove(uid)?;
        if let Some(node) = self.nodes.get_mut(&reservation.node) {
            account(node, &reservation.placement, false);
        }
        Some(reservation)
    }

    /// A Device CR was added or changed: its node's GPUs, then every use re-applied.
    pub fn apply_device(&mut self, device: &Device) {
        let Some(name) = device.metadata.name.clone() else {
            return;
        };
        let mut node = NodeState {
            name: name.clone(),
            gpus: device_gpus(device),
        };
        for uid in self.by_node.get(&name).into_iter().flatten() {
            if let Some(used) = self.pods.get_mut(uid) {
                // Memory given as a ratio depends on the GPU's size: resolve it again.
                used.placement = placement_of(&used.allocations, &node.gpus);
                account(&mut node, &used.placement, true);
            }
        }
        for reservation in self.reservations.values().filter(|r| r.node == name) {
            account(&mut node, &reservation.placement, true);
        }
        self.nodes.insert(name, node);
    }

    /// A Device CR was deleted.
    pub fn delete_device(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    /// A pod was added or changed.
    pub fn apply_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        self.remove_use(&uid);
        let Some(node_name) = holds_devices(pod) else {
            // Finished pods give their GPUs back; an unassigned pod may still have a reservation.
            if pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Succeeded" || p == "Failed")
            {
                self.remove_reservation(&uid);
            }
            return;
        };
        let annotation = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(DEVICE_ALLOCATED));
        let Some(allocations) = annotation.and_then(|text| DeviceAllocations::parse(text).ok())
        else {
            return;
        };
        // Seen back: the pod's own annotation now counts, not the reservation.
        self.remove_reservation(&uid);
        let gpus = self
            .nodes
            .get(node_name)
            .map(|n| n.gpus.clone())
            .unwrap_or_default();
        let placement = placement_of(&allocations, &gpus);
        if let Some(node) = self.nodes.get_mut(node_name) {
            account(node, &placement, true);
        }
        self.by_node
            .entry(node_name.to_owned())
            .or_default()
            .insert(uid.clone());
        self.pods.insert(
            uid,
            PodUse {
                node: node_name.to_owned(),
                allocations,
                placement,
            },
        );
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, uid: &str) {
        self.remove_use(uid);
        self.remove_reservation(uid);
    }

    /// The node's GPUs with all use applied, in flight included.
    pub fn node(&self, name: &str) -> Option<&NodeState> {
        self.nodes.get(name)
    }

    /// Every node with a Device CR.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeState> {
        self.nodes.values()
    }

    /// Holds `placement` for pod `uid` until its annotation is seen or `expires_at` passes.
    pub fn reserve(&mut self, uid: &str, node: &str, placement: Placement, expires_at: u64) {
        self.remove_reservation(uid);
        if let Some(state) = self.nodes.get_mut(node) {
            account(state, &placement, true);
        }
        self.reservations.insert(
            uid.to_owned(),
            Reservation {
                node: node.to_owned(),
                placement,
                expires_at,
            },
        );
    }

    /// Gives back pod `uid`'s in-flight allocation (bind failed).
    pub fn release(&mut self, uid: &str) -> bool {
        self.remove_reservation(uid).is_some()
    }

    /// Gives back reservations that expired at `now`; returns how many.
    pub fn expire(&mut self, now: u64) -> usize {
        let expired: Vec<String> = self
            .reservations
            .iter()
            .filter(|(_, r)| r.expires_at <= now)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &expired {
            self.remove_reservation(uid);
        }
        expired.len()
    }

    /// Number of in-flight reservations.
    pub fn in_flight(&self) -> usize {
        self.reservations.len()
    }

    /// Forgets nodes whose Device CR is not in `names` (after a relist: they are gone).
    pub fn retain_devices(&mut self, names: &std::collections::HashSet<String>) {
        self.nodes.retain(|name, _| names.contains(name));
    }

    /// Forgets the use of pods not in `uids` (after a relist: they are gone).
    pub fn retain_pods(&mut self, uids: &std::collections::HashSet<String>) {
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|uid| !uids.contains(*uid))
            .cloned()
            .collect();
        for uid in gone {
            self.remove_use(&uid);
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
    use kube::api::ObjectMeta;
    use tessera_api::{DeviceInfo, DeviceSpec};

    use super::*;
    use crate::core::ContainerPlacement;

    fn device(name: &str, gpus: u32, legacy: &[&str]) -> Device {
        let devices = (0..gpus)
            .map(|i| DeviceInfo {
                device_type: "gpu".into(),
                id: format!("GPU-{i}"),
                minor: Some(i as i32),
                health: true,
                resources: BTreeMap::from([(
                    GPU_MEMORY.to_owned(),
                    K8sQuantity((16u64 << 30).to_string()),
                )]),
                topology: None,
            })
            .collect();
        let entries: Vec<LegacyDeviceEntry> = legacy
            .iter()
            .map(|id| LegacyDeviceEntry {
                pod_uid: "old".into(),
                container_name: "c".into(),
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec![(*id).into()],
            })
            .collect();
        Device {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: Some(BTreeMap::from([(
                    DEVICES_CHECKPOINTS.to_owned(),
                    serde_json::to_string(&entries).expect("json"),
                )])),
                ..ObjectMeta::default()
            },
            spec: DeviceSpec { devices },
        }
    }

    fn pod(uid: &str, node: Option<&str>, annotation: Option<&str>, phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                annotations: annotation
                    .map(|a| BTreeMap::from([(DEVICE_ALLOCATED.to_owned(), a.to_owned())])),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..PodStatus::default()
            }),
        }
    }

    const HALF_0: &str = r#"{"gpu":[{"minor":0,"id":"GPU-0","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#;

    #[test]
    fn pods_count_until_they_finish() {
        let mut ledger = Ledger::default();
        ledger.apply_device(&device("n1", 2, &["GPU-1"]));
        assert!(ledger.node("n1").expect("node").gpus[1].legacy);
        ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Running"));
        let gpu0 = &ledger.node("n1").expect("node").gpus[0];
        assert_eq!((gpu0.core_used, gpu0.memory_used), (50, 8 << 30));
        // The same pod again: no double counting.
        ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Running"));
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        // A Device update keeps the use.
        ledger.apply_device(&device("n1", 2, &[]));
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Succeeded"));
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 0);
    }

    #[test]
    fn ratios_resolve_when_the_device_arrives_after_the_pod() {
        let mut ledger = Ledger::default();
        ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Running"));
        ledger.apply_device(&device("n1", 1, &[]));
        let gpu0 = &ledger.node("n1").expect("node").gpus[0];
        assert_eq!((gpu0.core_used, gpu0.memory_used), (50, 8 << 30));
    }

    #[test]
    fn reservations_hold_until_seen_back_or_expired() {
        let mut ledger = Ledger::default();
        ledger.apply_device(&device("n1", 1, &[]));
        let placement = placement_of(
            &DeviceAllocations::parse(HALF_0).expect("valid"),
            &ledger.node("n1").expect("node").gpus,
        );
        ledger.reserve("p1", "n1", placement.clone(), 100);
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        // The annotated pod arrives: the reservation turns into the pod's own use.
        ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Pending"));
        assert_eq!(ledger.in_flight(), 0);
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        ledger.reserve("p2", "n1", placement.clone(), 100);
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 100);
        assert_eq!(ledger.expire(99), 0);
        assert_eq!(ledger.expire(100), 1);
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        ledger.reserve("p3", "n1", placement, 100);
        assert!(ledger.release("p3"));
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
        ledger.delete_pod("p1");
        assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 0);
    }

    /// The pod-level list is as before (what the pod books); each entry now also
    /// names the containers that get the GPU (the old exact-text assertion had no
    /// `extension.containers`: the format grew, the pod-level part did not change).
    #[test]
    fn annotation_roundtrip() {
        let share = GpuShare {
            uuid: "GPU-0".into(),
            minor: 0,
            core: 50,
            memory: 8 << 30,
            ratio: 50,
        };
        let placement = PodPlacement {
            booked: Placement {
                gpus: vec![share.clone()],
            },
            containers: vec![ContainerPlacement {
                name: "main".into(),
                gpus: vec![share],
            }],
        };
        let text = annotation_of(&placement);
        assert_eq!(
            text,
            r#"{"gpu":[{"extension":{"containers":{"main":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory":8589934592,"koordinator.sh/gpu-memory-ratio":50}}},"id":"GPU-0","minor":0,"resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory":8589934592,"koordinator.sh/gpu-memory-ratio":50}}]}"#
        );
        let back = placement_of(&DeviceAllocations::parse(&text).expect("valid"), &[]);
        assert_eq!(back, placement.booked);
    }

    /// Two 25% containers on one GPU: the ledger books the pod's 50%, each
    /// container's entry says 25%, a container with no GPU is not named.
    #[test]
    fn two_quarter_containers_book_half_a_gpu() {
        let quarter = |name: &str| ContainerPlacement {
            name: name.into(),
            gpus: vec![GpuShare {
                uuid: "GPU-0".into(),
                minor: 0,
                core: 25,
                memory: 4 << 30,
                ratio: 25,
            }],
        };
        let placement = PodPlacement {
            booked: Placement {
                gpus: vec![GpuShare {
                    uuid: "GPU-0".into(),
                    minor: 0,
                    core: 50,
                    memory: 8 << 30,
                    ratio: 50,
                }],
            },
            containers: vec![quarter("a"), quarter("b")],
        };
        let text = annotation_of(&placement);
        let mut ledger = Ledger::default();
        ledger.apply_device(&device("n1", 1, &[]));
        ledger.apply_pod(&pod("p1", Some("n1"), Some(&text), "Running"));
        let gpu0 = &ledger.node("n1").expect("node").gpus[0];
        assert_eq!((gpu0.core_used, gpu0.memory_used), (50, 8 << 30));
        let parsed = DeviceAllocations::parse(&text).expect("valid");
        for name in ["a", "b"] {
            let gpus = parsed.gpus_of_container(name);
            assert_eq!(gpus.len(), 1);
            assert_eq!(gpus[0].1.gpu_core(), Some(25));
        }
        assert!(parsed.gpus_of_container("sidecar").is_empty());
    }
}
