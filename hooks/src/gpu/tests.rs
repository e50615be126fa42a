use std::collections::HashMap;

use proptest::prelude::*;
use tessera_api::checkpoint::CheckpointEntry;
use tessera_protos::hook::v1::{ContainerMetadata, Mount, PodMetadata};

use super::*;
use crate::edit::apply;

const UUID0: &str = "GPU-00000000-0000-0000-0000-000000000000";
const UUID1: &str = "GPU-11111111-1111-1111-1111-111111111111";
const UUID2: &str = "GPU-22222222-2222-2222-2222-222222222222";

fn node() -> NodeDevices {
    NodeDevices {
        gpus: Some(vec![
            GpuDevice {
                uuid: UUID0.into(),
                minor: 0,
                memory_bytes: Some(16 << 30),
            },
            GpuDevice {
                uuid: UUID1.into(),
                minor: 1,
                memory_bytes: Some(16 << 30),
            },
            GpuDevice {
                uuid: UUID2.into(),
                minor: 2,
                memory_bytes: Some(16 << 30),
            },
        ]),
        nodes: [
            "nvidia0",
            "nvidia1",
            "nvidia2",
            "nvidiactl",
            "nvidia-uvm",
            "infiniband/uverbs3",
            "infiniband/rdma_cm",
        ]
        .into_iter()
        .map(String::from)
        .collect(),
        plugin_grants: PluginGrants::NoCheckpoint,
    }
}

fn container(annotation: Option<&str>) -> ContainerHookRequest {
    let mut annotations = HashMap::new();
    if let Some(annotation) = annotation {
        annotations.insert(DEVICE_ALLOCATED.to_owned(), annotation.to_owned());
    }
    ContainerHookRequest {
        event: Event::CreateContainer as i32,
        pod: Some(PodMetadata {
            name: "train-0".into(),
            namespace: "ml".into(),
            annotations,
            ..Default::default()
        }),
        envs: vec![kv("PATH", "/bin"), kv(VISIBLE_DEVICES, "all")],
        devices: vec![
            DeviceNode {
                container_path: "/dev/nvidia2".into(),
                host_path: "/dev/nvidia2".into(),
                permissions: "rw".into(),
            },
            DeviceNode {
                container_path: "/dev/fuse".into(),
                host_path: "/dev/fuse".into(),
                permissions: "rwm".into(),
            },
        ],
        mounts: vec![Mount {
            container_path: "/data".into(),
            host_path: "/srv".into(),
            readonly: true,
        }],
        ..Default::default()
    }
}

fn rewritten(annotation: Option<&str>, config: &GpuHookConfig) -> ContainerHookRequest {
    let mut c = container(annotation);
    let edit = rewrite(&c, &node(), config).expect("rewrites");
    apply(&mut c, &edit);
    c
}

fn env(c: &ContainerHookRequest, key: &str) -> Option<String> {
    c.envs
        .iter()
        .rev()
        .find(|e| e.key == key)
        .map(|e| e.value.clone())
}

fn paths(c: &ContainerHookRequest) -> Vec<&str> {
    c.devices
        .iter()
        .map(|d| d.container_path.as_str())
        .collect()
}

fn whole(uuid: &str, minor: u32) -> String {
    format!(
        r#"{{"minor":{minor},"id":"{uuid}","resources":{{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}}}"#
    )
}

#[test]
fn whole_gpu_gets_its_uuid_and_node_only() {
    let c = rewritten(
        Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))),
        &GpuHookConfig::default(),
    );
    assert_eq!(env(&c, VISIBLE_DEVICES).as_deref(), Some(UUID1));
    assert_eq!(
        paths(&c),
        [
            "/dev/fuse",
            "/dev/nvidia1",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    assert_eq!(c.devices[1].host_path, "/dev/nvidia1");
    assert_eq!(env(&c, SM_LIMIT), None, "no limiter for a whole GPU");
    assert_eq!(env(&c, "PATH").as_deref(), Some("/bin"));
    assert_eq!(c.mounts.len(), 1);
}

#[test]
fn half_gpu_gets_limiter_env() {
    let annotation = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","resources":{{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50,"koordinator.sh/gpu-memory":"8Gi"}}}}]}}"#
    );
    let c = rewritten(Some(&annotation), &GpuHookConfig::default());
    assert_eq!(env(&c, VISIBLE_DEVICES).as_deref(), Some(UUID0));
    assert_eq!(
        env(&c, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref(),
        Some("8192m")
    );
    assert_eq!(env(&c, SM_LIMIT).as_deref(), Some("50"));
    let no_limiter = GpuHookConfig {
        limiter_env: false,
        ..GpuHookConfig::default()
    };
    assert_eq!(
        env(&rewritten(Some(&annotation), &no_limiter), SM_LIMIT),
        None
    );
}

#[test]
fn memory_ratio_resolves_against_the_gpus_memory() {
    let annotation = format!(
        r#"{{"gpu":[{{"minor":1,"id":"{UUID1}","resources":{{"koordinator.sh/gpu-memory-ratio":25}}}}]}}"#
    );
    let c = rewritten(Some(&annotation), &GpuHookConfig::default());
    assert_eq!(
        env(&c, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref(),
        Some("4096m")
    );
}

#[test]
fn multi_gpu_in_annotation_order() {
    let annotation = format!(r#"{{"gpu":[{},{}]}}"#, whole(UUID2, 2), whole(UUID0, 0));
    let c = rewritten(Some(&annotation), &GpuHookConfig::default());
    assert_eq!(env(&c, VISIBLE_DEVICES), Some(format!("{UUID2},{UUID0}")));
    assert_eq!(
        paths(&c),
        [
            "/dev/nvidia2",
            "/dev/fuse",
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
}

#[test]
fn no_allocation_hides_every_gpu_unless_configured_off() {
    let c = rewritten(None, &GpuHookConfig::default());
    assert_eq!(env(&c, VISIBLE_DEVICES).as_deref(), Some("void"));
    let off = GpuHookConfig {
        unallocated_visible_devices: None,
        ..GpuHookConfig::default()
    };
    assert_eq!(
        env(&rewritten(None, &off), VISIBLE_DEVICES).as_deref(),
        Some("all")
    );
}

/// A checkpoint entry: `device_ids` of `nvidia.com/gpu` given to `container` of pod `uid`.
fn grant(uid: &str, container: &str, device_ids: &[&str], visible: &[&str]) -> CheckpointEntry {
    CheckpointEntry {
        pod_uid: uid.into(),
        container_name: container.into(),
        resource_name: "nvidia.com/gpu".into(),
        device_ids: device_ids.iter().map(|s| (*s).to_owned()).collect(),
        numa_nodes: vec![0],
        visible_devices: visible.iter().map(|s| (*s).to_owned()).collect(),
        device_envs: BTreeMap::new(),
        mounts: Vec::new(),
        device_nodes: Vec::new(),
    }
}

/// A container of a pod with no allocation whose env says `value`, on a node
/// whose checkpoint says `grants`.
fn legacy(value: &str, grants: PluginGrants) -> Result<ContainerHookResponse, GpuHookError> {
    let mut c = container(None);
    c.envs[1].value = value.into();
    if let Some(pod) = c.pod.as_mut() {
        pod.uid = "uid-1".into();
    }
    c.container = Some(ContainerMetadata {
        name: "main".into(),
        ..Default::default()
    });
    let mut node = node();
    node.plugin_grants = grants;
    rewrite(&c, &node, &GpuHookConfig::default())
}

#[test]
fn legacy_device_plugin_grant_is_left_alone() {
    let recorded = |entries| PluginGrants::Recorded(entries);
    let untouched = Ok(ContainerHookResponse::default());
    // kubelet's device IDs (time-slicing replicas too) or the plugin's own env value.
    for (value, entry) in [
        (UUID2, grant("uid-1", "main", &[UUID2], &[])),
        (
            UUID2,
            grant("uid-1", "main", &[&format!("{UUID2}::3")], &[]),
        ),
        (
            &format!("{UUID1},{UUID2}") as &str,
            grant("uid-1", "main", &[UUID1, UUID2], &[]),
        ),
        (
            "/var/run/nvidia-container-devices",
            grant(
                "uid-1",
                "main",
                &[UUID2],
                &["/var/run/nvidia-container-devices"],
            ),
        ),
    ] {
        assert_eq!(legacy(value, recorded(vec![entry])), untouched, "{value}");
    }
}

#[test]
fn gpus_named_in_env_without_a_device_plugin_grant_are_hidden() {
    let void = Ok(ContainerHookResponse {
        set_envs: vec![kv(VISIBLE_DEVICES, "void")],
        ..Default::default()
    });
    // No plugin on the node; another pod's grant; another container's; more than given.
    assert_eq!(legacy(UUID2, PluginGrants::NoCheckpoint), void);
    for entry in [
        grant("uid-2", "main", &[UUID2], &[]),
        grant("uid-1", "sidecar", &[UUID2], &[]),
        grant("uid-1", "main", &[UUID1], &[]),
    ] {
        assert_eq!(legacy(UUID2, PluginGrants::Recorded(vec![entry])), void);
    }
    assert_eq!(
        legacy(
            &format!("{UUID1},{UUID2}"),
            PluginGrants::Recorded(vec![grant("uid-1", "main", &[UUID1], &[])])
        ),
        void
    );
}

#[test]
fn an_unreadable_checkpoint_fails_the_container_naming_it() {
    let error = legacy(
        UUID2,
        PluginGrants::Unreadable("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint: not a kubelet device checkpoint".into()),
    )
    .expect_err("fails closed");
    let text = error.to_string();
    for part in [
        "ml/train-0",
        "container main",
        UUID2,
        "kubelet_internal_checkpoint",
    ] {
        assert!(text.contains(part), "{text}");
    }
    // "all" names no GPU in particular: voided without the checkpoint.
    assert!(legacy("all", PluginGrants::Unreadable("x".into())).is_ok());
}

#[test]
fn index_shift_uses_the_uuid_not_the_minor() {
    // The scheduler saw UUID1 at minor 1; the node now has it at minor 2.
    let mut shifted = node();
    shifted.gpus = Some(vec![GpuDevice {
        uuid: UUID1.into(),
        minor: 2,
        memory_bytes: None,
    }]);
    let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
    let edit = rewrite(&c, &shifted, &GpuHookConfig::default()).expect("rewrites");
    apply(&mut c, &edit);
    assert!(paths(&c).contains(&"/dev/nvidia2"));
    assert!(!paths(&c).contains(&"/dev/nvidia1"));
}

#[test]
fn unknown_uuid_fails_naming_pod_annotation_and_gpu() {
    let c = container(Some(&format!(
        r#"{{"gpu":[{}]}}"#,
        whole("GPU-deadbeef", 0)
    )));
    let error = rewrite(&c, &node(), &GpuHookConfig::default())
        .expect_err("not on node")
        .to_string();
    assert!(
        error.starts_with(
            "pod ml/train-0: annotation scheduling.koordinator.sh/device-allocated: gpu[0]:"
        ),
        "{error}"
    );
    assert!(
        error.contains("GPU GPU-deadbeef is not on this node"),
        "{error}"
    );
}

#[test]
fn malformed_annotation_fails_with_its_path() {
    let c = container(Some(r#"{"gpu":[{"minor":"x"}]}"#));
    let error = rewrite(&c, &node(), &GpuHookConfig::default())
        .expect_err("malformed")
        .to_string();
    assert_eq!(
        error,
        "pod ml/train-0: annotation scheduling.koordinator.sh/device-allocated: gpu[0].minor: expected a number, got \"x\""
    );
}

#[test]
fn missing_device_node_fails() {
    let mut partial = node();
    partial.nodes.remove("nvidia1");
    let c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
    let error = rewrite(&c, &partial, &GpuHookConfig::default())
        .expect_err("no node")
        .to_string();
    assert!(
        error.contains("device node /dev/nvidia1 for GPU"),
        "{error}"
    );
}

#[test]
fn without_inventory_the_annotation_is_trusted_but_needs_uuids() {
    let mut blind = node();
    blind.gpus = None;
    let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
    let edit = rewrite(&c, &blind, &GpuHookConfig::default()).expect("trusted");
    apply(&mut c, &edit);
    assert_eq!(env(&c, VISIBLE_DEVICES).as_deref(), Some(UUID1));
    let c = container(Some(r#"{"gpu":[{"minor":1}]}"#));
    assert!(rewrite(&c, &blind, &GpuHookConfig::default()).is_err());
}

#[test]
fn cdi_mode_uses_cdi_names() {
    let config = GpuHookConfig {
        mode: GpuMode::Cdi,
        ..GpuHookConfig::default()
    };
    let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID0, 0))));
    c.cdi_devices.push(CdiDevice {
        name: format!("nvidia.com/gpu={UUID2}"),
    });
    c.cdi_devices.push(CdiDevice {
        name: "vendor.com/other=x".into(),
    });
    let edit = rewrite(&c, &node(), &config).expect("rewrites");
    apply(&mut c, &edit);
    let names: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "vendor.com/other=x".to_owned(),
            format!("nvidia.com/gpu={UUID0}")
        ]
    );
    assert_eq!(paths(&c), ["/dev/fuse"]);
    assert_eq!(env(&c, VISIBLE_DEVICES).as_deref(), Some("void"));
}

#[test]
fn rdma_functions_and_rdma_cm() {
    let annotation = format!(r#"{{"gpu":[{}],"rdma":[{{"minor":3}}]}}"#, whole(UUID0, 0));
    let c = rewritten(Some(&annotation), &GpuHookConfig::default());
    assert!(paths(&c).contains(&"/dev/infiniband/uverbs3"));
    assert!(paths(&c).contains(&"/dev/infiniband/rdma_cm"));
    let missing = r#"{"rdma":[{"minor":3,"extension":{"vfs":[{"minor":9}]}}]}"#;
    let error = rewrite(
        &container(Some(missing)),
        &node(),
        &GpuHookConfig::default(),
    )
    .expect_err("vf 9 missing");
    assert!(
        error
            .to_string()
            .contains("rdma[0].extension.vfs[0].minor: RDMA device /dev/infiniband/uverbs9"),
        "{error}"
    );
}

#[test]
fn other_events_are_untouched() {
    let mut c = container(Some("not json"));
    c.event = Event::StartContainer as i32;
    assert_eq!(
        rewrite(&c, &node(), &GpuHookConfig::default()),
        Ok(ContainerHookResponse::default())
    );
}

fn allocation_strategy() -> impl Strategy<Value = Option<String>> {
    let share = (1u64..=100, 1u64..=100);
    proptest::option::of(proptest::collection::btree_map(0usize..3, share, 1..3).prop_map(|gpus| {
        let entries: Vec<String> = gpus
            .into_iter()
            .map(|(minor, (core, ratio))| {
                let uuid = [UUID0, UUID1, UUID2][minor];
                format!(r#"{{"minor":{minor},"id":"{uuid}","resources":{{"koordinator.sh/gpu-core":{core},"koordinator.sh/gpu-memory-ratio":{ratio}}}}}"#)
            })
            .collect();
        format!(r#"{{"gpu":[{}]}}"#, entries.join(","))
    }))
}

proptest! {
    #[test]
    fn rewrite_is_idempotent_and_keeps_unrelated_entries(
        annotation in allocation_strategy(),
        extra_env in proptest::collection::vec(("[A-Z]{1,6}", "[a-z]{0,6}"), 0..4),
        cdi in any::<bool>(),
    ) {
        let config = GpuHookConfig { mode: if cdi { GpuMode::Cdi } else { GpuMode::Env }, ..GpuHookConfig::default() };
        let mut c = container(annotation.as_deref());
        c.envs.extend(extra_env.iter().map(|(k, v)| kv(&format!("X_{k}"), v.clone())));
        let before = c.clone();
        let edit = rewrite(&c, &node(), &config).expect("valid allocation");
        apply(&mut c, &edit);
        let once = c.clone();
        let again = rewrite(&c, &node(), &config).expect("still valid");
        apply(&mut c, &again);
        prop_assert_eq!(&c, &once, "second rewrite changed the container");
        for e in before.envs.iter().filter(|e| e.key.starts_with("X_") || e.key == "PATH") {
            prop_assert!(once.envs.contains(e), "unrelated env {:?} lost", e);
        }
        prop_assert!(once.devices.iter().any(|d| d.container_path == "/dev/fuse"));
        prop_assert_eq!(&once.mounts, &before.mounts);
        // Exactly the allocated GPU nodes, never another.
        let allocated: BTreeSet<String> = annotation.as_deref()
            .map(|a| DeviceAllocations::parse(a).expect("valid").gpus().iter().map(|g| format!("/dev/nvidia{}", g.minor)).collect())
            .unwrap_or_default();
        let present: BTreeSet<String> = once.devices.iter().map(|d| d.container_path.clone()).filter(|p| is_gpu_node(p)).collect();
        if cdi || annotation.is_none() {
            prop_assert!(present.is_empty() || annotation.is_none());
        } else {
            prop_assert_eq!(present, allocated);
        }
    }
}
