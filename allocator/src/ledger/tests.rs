use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tessera_api::resources::DEVICES_CHECKPOINTS;
use tessera_api::{DeviceInfo, DeviceSpec, LegacyDeviceEntry};

use super::*;
use crate::allocate::ContainerPlacement;

fn device(name: &str, gpus: u32, legacy: &[&str]) -> Device {
    let devices = (0..gpus)
        .map(|i| DeviceInfo {
            device_type: "gpu".into(),
            labels: BTreeMap::new(),
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

/// Four GPUs on two PCIe switches ({0,1}, {2,3}) whose NVLinks cross them
/// (0-2, 1-3), as the reporter publishes them: only the NVLink annotation can
/// make a 2-GPU pick other than a switch pair.
#[test]
fn an_unreadable_checkpoint_annotation_holds_every_gpu_of_the_node() {
    // The reporter's list of device-plugin grants, cut short: which GPUs those
    // pods hold is unknown, so none is handed out until it is readable again.
    let mut broken = device("n1", 2, &["GPU-0"]);
    broken.metadata.annotations.get_or_insert_default().insert(
        DEVICES_CHECKPOINTS.to_owned(),
        "[{\"podUID\":\"old\"".into(),
    );
    assert!(device_gpus(&broken).iter().all(|gpu| gpu.legacy));
    let readable = device("n1", 2, &["GPU-0"]);
    let held: Vec<bool> = device_gpus(&readable).iter().map(|g| g.legacy).collect();
    assert_eq!(held, [true, false]);
}

#[test]
fn nvlink_peers_of_the_device_cr_steer_a_two_gpu_pick() {
    use tessera_api::DeviceTopology;
    let mut crossed = device("n1", 4, &[]);
    for (i, gpu) in crossed.spec.devices.iter_mut().enumerate() {
        gpu.topology = Some(DeviceTopology {
            socket_id: 0,
            node_id: 0,
            pcie_id: format!("sw{}", i / 2),
            bus_id: String::new(),
        });
    }
    let mut links = NvlinkPeers::default();
    links.link("GPU-0", "GPU-2");
    links.link("GPU-1", "GPU-3");
    links.link("GPU-1", "GPU-on-another-node");
    crossed
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(NVLINK_PEERS.to_owned(), links.encode());
    let pick = |device: &Device| {
        let mut ledger = Ledger::default();
        ledger.apply_device(device);
        let request = tessera_api::request::GpuRequest {
            count: 2,
            core: 100,
            memory: tessera_api::request::GpuMemory::Ratio(100),
        };
        crate::allocate::allocate(
            ledger.node("n1").expect("node"),
            &request,
            crate::allocate::Policy::Binpack,
        )
        .expect("fits")
        .gpus
        .into_iter()
        .map(|share| share.uuid)
        .collect::<Vec<_>>()
    };
    let node_gpus = device_gpus(&crossed);
    assert_eq!(node_gpus[1].nvlink_peers, ["GPU-3"], "unknown peer dropped");
    assert_eq!(pick(&crossed), ["GPU-0", "GPU-2"]);
    // A malformed annotation leaves the node schedulable, by PCIe switch.
    let mut malformed = crossed.clone();
    malformed
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(NVLINK_PEERS.to_owned(), r#"{"GPU-0":"GPU-2"}"#.to_owned());
    assert_eq!(pick(&malformed), ["GPU-0", "GPU-1"]);
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

/// A sharing group is written into the allocation annotation and counted per
/// GPU from it: the GPU is the group's while a pod of the group holds it, in
/// flight or running, through a Device update, until its last pod ends.
#[test]
fn sharing_groups_are_counted_from_the_allocation_annotation() {
    const GROUP_0: &str = r#"{"gpu":[{"minor":0,"id":"GPU-0","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25},"extension":{"sharingGroup":"a"}}]}"#;
    let share = GpuShare {
        uuid: "GPU-0".into(),
        minor: 0,
        core: 25,
        memory: 4 << 30,
        ratio: 25,
    };
    let placement = PodPlacement {
        booked: Placement {
            gpus: vec![share.clone()],
            group: Some("a".into()),
        },
        containers: vec![ContainerPlacement {
            name: "main".into(),
            gpus: vec![share],
        }],
    };
    let text = annotation_of(&placement);
    assert!(text.contains(r#""sharingGroup":"a""#), "{text}");
    let back = placement_of(&DeviceAllocations::parse(&text).expect("valid"), &[]);
    assert_eq!(back.group.as_deref(), Some("a"));

    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 2, &[]));
    let groups = |ledger: &Ledger| ledger.node("n1").expect("node").gpus[0].groups.clone();
    ledger.reserve("p0", "n1", placement.booked.clone(), 100);
    assert_eq!(groups(&ledger), BTreeMap::from([("a".to_owned(), 1)]));
    ledger.apply_pod(&pod("p1", Some("n1"), Some(GROUP_0), "Running"));
    assert_eq!(groups(&ledger), BTreeMap::from([("a".to_owned(), 2)]));
    ledger.apply_device(&device("n1", 2, &[]));
    assert_eq!(groups(&ledger), BTreeMap::from([("a".to_owned(), 2)]));
    assert!(ledger.release("p0"));
    ledger.apply_pod(&pod("p1", Some("n1"), Some(GROUP_0), "Running"));
    assert_eq!(groups(&ledger), BTreeMap::from([("a".to_owned(), 1)]));
    ledger.apply_pod(&pod("p1", Some("n1"), Some(GROUP_0), "Succeeded"));
    assert!(groups(&ledger).is_empty());
}

/// The group is read from the allocation annotation the scheduler wrote, never
/// from the pod's own group annotation: a pod that changes it later does not
/// move its GPU to another group.
#[test]
fn a_group_annotation_changed_later_does_not_move_the_gpu() {
    const GROUP_0: &str = r#"{"gpu":[{"minor":0,"id":"GPU-0","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25},"extension":{"sharingGroup":"a"}}]}"#;
    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 2, &[]));
    for key in ["tessera.io/sharing-group", "lsalab.nthu/GPUID"] {
        let mut changed = pod("p1", Some("n1"), Some(GROUP_0), "Running");
        changed
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(key.to_owned(), "b".to_owned());
        ledger.apply_pod(&changed);
        assert_eq!(
            ledger.node("n1").expect("node").gpus[0].groups,
            BTreeMap::from([("a".to_owned(), 1)]),
            "{key}"
        );
    }
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

fn half_of_gpu0(ledger: &Ledger) -> Placement {
    placement_of(
        &DeviceAllocations::parse(HALF_0).expect("valid"),
        &ledger.node("n1").expect("node").gpus,
    )
}

/// Under watch lag a bound pod's reservation must outlive any TTL: only the
/// watch (bound pod with its annotation) or a delete ends it.
#[test]
fn bound_reservations_wait_for_the_watch_not_the_clock() {
    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 1, &[]));
    let placement = half_of_gpu0(&ledger);
    ledger.reserve("p1", "n1", placement.clone(), 10);
    assert!(ledger.assume("p1"));
    assert_eq!(ledger.expire(1_000), 0, "an assumed use expired");
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
    // The watch shows it annotated but not yet bound: still assumed.
    ledger.apply_pod(&pod("p1", None, Some(HALF_0), "Pending"));
    assert_eq!((ledger.assumed(), ledger.expire(2_000)), (1, 0));
    // Bound, with the annotation: counted from the pod, once.
    ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Pending"));
    assert_eq!((ledger.in_flight(), ledger.assumed()), (0, 0));
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
    // A delete ends an assumed use too, and so does a relist without the pod.
    ledger.reserve("p2", "n1", placement.clone(), 10);
    ledger.assume("p2");
    ledger.delete_pod("p2");
    ledger.reserve("p3", "n1", placement, 10);
    ledger.assume("p3");
    ledger.retain_pods(&std::collections::HashSet::from(["p1".to_owned()]));
    assert_eq!(ledger.in_flight(), 0);
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
}

/// A tentative reservation (filter or prioritize chose the node) holds the
/// GPUs for the next cycles; the pod's next choice replaces it, never adds to
/// it; it expires on the TTL without counting as a late bind; a bind's
/// reservation replaces it and is never replaced by it.
#[test]
fn tentative_reservations_hold_until_replaced_bound_or_expired() {
    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 1, &[]));
    let placement = half_of_gpu0(&ledger);
    let used = |ledger: &Ledger| ledger.node("n1").expect("node").gpus[0].core_used;
    assert!(ledger.reserve_tentative("a", "n1", placement.clone(), 10));
    assert_eq!(
        (used(&ledger), ledger.tentative(), ledger.in_flight()),
        (50, 1, 0)
    );
    // The pod's next cycle: replaced, not doubled.
    assert!(ledger.reserve_tentative("a", "n1", placement.clone(), 20));
    assert_eq!(
        (used(&ledger), ledger.tentative_node("a")),
        (50, Some("n1"))
    );
    // Expiry: the first deadline is gone, the second holds until its time.
    assert_eq!((ledger.expire(19), used(&ledger)), (0, 50));
    assert_eq!(
        (ledger.expire(20), used(&ledger), ledger.tentative()),
        (0, 0, 0)
    );
    // A bind's reservation replaces the tentative one, and outlives its offers.
    ledger.reserve_tentative("a", "n1", placement.clone(), 30);
    ledger.reserve("a", "n1", placement.clone(), 40);
    assert_eq!(
        (used(&ledger), ledger.tentative(), ledger.in_flight()),
        (50, 0, 1)
    );
    assert!(!ledger.reserve_tentative("a", "n1", placement.clone(), 50));
    assert!(!ledger.release_tentative("a"));
    assert_eq!((used(&ledger), ledger.in_flight()), (50, 1));
    // A tentative reservation is never assumed (only a bind's is).
    ledger.reserve_tentative("b", "n1", placement.clone(), 30);
    assert!(!ledger.assume("b"));
    assert!(ledger.release_tentative("b"));
    // An annotated unbound pod replaces its tentative reservation in flight.
    ledger.reserve_tentative("c", "n1", placement, 30);
    ledger.apply_pod(&pod("c", None, Some(HALF_0), "Pending"));
    assert_eq!((ledger.tentative(), ledger.in_flight()), (0, 2));
    ledger.delete_pod("c");
    assert_eq!(used(&ledger), 50);
}

/// What preemption reads: running GPU pods with their priority, the priority
/// of every running pod, and which pods hold GPUs through the device plugin.
#[test]
fn preemption_sees_gpu_holders_priorities_and_device_plugin_pods() {
    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 2, &["GPU-1"]));
    let mut gpu_pod = pod("g", Some("n1"), Some(HALF_0), "Running");
    gpu_pod.spec.as_mut().expect("spec").priority = Some(7);
    ledger.apply_pod(&gpu_pod);
    let mut plain = pod("p", Some("n1"), None, "Running");
    plain.spec.as_mut().expect("spec").priority = Some(3);
    ledger.apply_pod(&plain);
    ledger.reserve("in-flight", "n1", half_of_gpu0(&ledger), 100);
    let holders = ledger.gpu_holders("n1");
    assert_eq!(holders.len(), 1, "reservations are not running pods");
    assert_eq!((holders[0].uid.as_str(), holders[0].priority), ("g", 7));
    assert_eq!(holders[0].placement.gpus[0].core, 50);
    assert_eq!(
        (ledger.priority("p"), ledger.priority("nobody")),
        (Some(3), None)
    );
    assert!(ledger.holds_legacy_gpus("n1", "old"));
    assert!(!ledger.holds_legacy_gpus("n1", "g"));
    ledger.apply_pod(&pod("p", Some("n1"), None, "Succeeded"));
    ledger.delete_pod("g");
    assert_eq!((ledger.priority("p"), ledger.priority("g")), (None, None));
    assert!(ledger.gpu_holders("n1").is_empty());
}

/// An annotated pod that is not bound holds its GPUs in flight (with the TTL),
/// also when its pod arrives before its node's Device CR.
#[test]
fn annotated_unbound_pods_count_in_flight() {
    let mut ledger = Ledger::default();
    ledger.set_in_flight_ttl(5);
    ledger.apply_pod(&pod("p1", None, Some(HALF_0), "Pending"));
    ledger.apply_device(&device("n1", 1, &[]));
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 50);
    ledger.apply_pod(&pod("p2", None, Some(HALF_0), "Pending"));
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 100);
    assert_eq!(ledger.expire(4), 0);
    assert_eq!(ledger.expire(5), 2);
    assert_eq!(ledger.node("n1").expect("node").gpus[0].core_used, 0);
    // Seen again later: in flight again from the clock's time.
    ledger.apply_pod(&pod("p1", None, Some(HALF_0), "Pending"));
    assert_eq!((ledger.expire(9), ledger.expire(10)), (0, 1));
    ledger.apply_pod(&pod("p1", None, Some(HALF_0), "Failed"));
    ledger.apply_pod(&pod("p3", None, Some(HALF_0), "Pending"));
    ledger.delete_pod("p3");
    assert_eq!(ledger.in_flight(), 0);
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
            group: None,
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
            group: None,
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

/// Every node's load is the load of its state, after every kind of change:
/// filter and prioritize read only the load of most nodes.
#[test]
fn loads_follow_every_change() {
    const GROUP_1: &str = r#"{"gpu":[{"minor":1,"id":"GPU-1","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25},"extension":{"sharingGroup":"g"}}]}"#;
    let current = |ledger: &Ledger| {
        for (name, node) in &ledger.nodes.slots {
            assert_eq!(
                node.load,
                NodeLoad::of(&node.state),
                "node {}",
                name.as_str()
            );
        }
        ledger.loaded_node("n1").map(|n| n.load.clone())
    };
    let mut ledger = Ledger::default();
    ledger.set_in_flight_ttl(5);
    ledger.apply_pod(&pod("early", None, Some(HALF_0), "Pending"));
    ledger.apply_device(&device("n1", 2, &["GPU-1"]));
    let empty_but_early = current(&ledger).expect("n1");
    assert_eq!(empty_but_early.gpus[0].core_used, 50);
    assert!(
        !empty_but_early.gpus[1].counted,
        "GPU-1 is held by the device plugin"
    );
    ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Running"));
    assert_eq!(current(&ledger).expect("n1").gpus[0].core_used, 100);
    ledger.apply_device(&device("n1", 2, &[]));
    ledger.apply_pod(&pod("g", Some("n1"), Some(GROUP_1), "Running"));
    assert!(current(&ledger).expect("n1").grouped);
    let half = half_of_gpu0(&ledger);
    ledger.reserve_tentative("t", "n1", half.clone(), 10);
    current(&ledger);
    ledger.reserve("b", "n1", half.clone(), 10);
    let aside = ledger.set_aside("b");
    assert_eq!(current(&ledger).expect("n1").gpus[0].core_used, 150);
    ledger.put_back(aside);
    current(&ledger);
    assert!(ledger.release_tentative("t"));
    assert_eq!(ledger.expire(10), 2, "b and the early pod");
    current(&ledger);
    ledger.delete_pod("g");
    assert!(!current(&ledger).expect("n1").grouped);
    ledger.retain_pods(&std::collections::HashSet::new());
    assert_eq!(current(&ledger).expect("n1").gpus[0].core_used, 0);
    ledger.delete_device("n1");
    assert_eq!(current(&ledger), None);
}

/// Node names are found whatever their length: held in the key itself up to
/// its inline size, on the heap beyond (Kubernetes allows 253 bytes).
#[test]
fn node_names_of_any_length_are_keys() {
    let names = [
        "n1".to_owned(),
        "x".repeat(NodeKey::INLINE),
        "y".repeat(NodeKey::INLINE + 1),
        "z".repeat(253),
        "nœud-ü".to_owned(),
    ];
    let mut ledger = Ledger::default();
    for name in &names {
        ledger.apply_device(&device(name, 1, &[]));
    }
    for name in &names {
        assert_eq!(
            ledger.node(name).map(|n| n.name.as_str()),
            Some(name.as_str())
        );
        assert_eq!(ledger.loaded_node(name).map(|n| n.load.gpus.len()), Some(1));
    }
    assert!(ledger.node("n").is_none() && ledger.node(&"x".repeat(45)).is_none());
    ledger.retain_devices(&std::collections::HashSet::from([names[3].clone()]));
    let left: Vec<&str> = ledger.nodes().map(|n| n.name.as_str()).collect();
    assert_eq!(left, [names[3].as_str()]);
    // The slot stays small: a name inline costs no more than a pointer pair and tag.
    assert_eq!(std::mem::size_of::<NodeKey>(), 48);
}

/// A node deleted from the middle of the dense array: the last one moves into
/// its slot, and every name still finds its own node, through any order of
/// deletes, re-adds and updates.
#[test]
fn deleted_nodes_leave_every_other_name_on_its_own_node() {
    let mut ledger = Ledger::default();
    for (i, name) in ["n1", "n2", "n3", "n4"].into_iter().enumerate() {
        ledger.apply_device(&device(name, i as u32 + 1, &[]));
    }
    let gpus = |ledger: &Ledger, name: &str| ledger.node(name).map(|n| n.gpus.len());
    ledger.delete_device("n1");
    assert_eq!(gpus(&ledger, "n1"), None);
    assert_eq!(
        ["n2", "n3", "n4"].map(|n| gpus(&ledger, n)),
        [Some(2), Some(3), Some(4)]
    );
    ledger.delete_device("n4");
    ledger.delete_device("n4");
    ledger.apply_device(&device("n1", 5, &[]));
    ledger.apply_device(&device("n3", 6, &[]));
    assert_eq!(
        ["n1", "n2", "n3", "n4"].map(|n| gpus(&ledger, n)),
        [Some(5), Some(2), Some(6), None]
    );
    assert_eq!(ledger.nodes().count(), 3);
    for name in ["n1", "n2", "n3"] {
        assert_eq!(ledger.node(name).map(|n| n.name.as_str()), Some(name));
    }
}

/// Each node's last change is stamped on its slot, and slots moving (a node
/// added or removed) advance the layout: what a cache of per-node verdicts
/// across calls needs to know which nodes to judge again.
#[test]
fn each_change_stamps_its_node_and_moving_slots_advance_the_layout() {
    let mut ledger = Ledger::default();
    ledger.apply_device(&device("n1", 2, &[]));
    ledger.apply_device(&device("n2", 2, &[]));
    let slot = |ledger: &Ledger, name: &str| ledger.loaded_node_slot(name).expect("a node").0;
    let (s1, s2) = (slot(&ledger, "n1"), slot(&ledger, "n2"));
    let (layout, seen) = (ledger.layout(), ledger.generation());
    assert!(ledger.changed_at(s1) <= seen && ledger.changed_at(s2) <= seen);
    ledger.apply_pod(&pod("p1", Some("n1"), Some(HALF_0), "Running"));
    assert!(ledger.changed_at(s1) > seen, "n1's use changed");
    assert!(ledger.changed_at(s2) <= seen, "n2 did not change");
    assert_eq!(ledger.layout(), layout, "no node came or went");
    let seen = ledger.generation();
    // A Device update of a node in place: that node's stamp, the same layout.
    ledger.apply_device(&device("n2", 2, &[]));
    assert!(ledger.changed_at(s2) > seen && ledger.changed_at(s1) <= seen);
    assert_eq!(ledger.layout(), layout);
    // A node added or removed moves slots.
    ledger.apply_device(&device("n3", 1, &[]));
    assert_ne!(ledger.layout(), layout);
    let layout = ledger.layout();
    ledger.delete_device("n1");
    assert_ne!(ledger.layout(), layout);
    let moved = slot(&ledger, "n3");
    assert!(ledger.loaded_at(moved).is_some());
    assert_eq!(ledger.changed_at(99), u64::MAX);
}
