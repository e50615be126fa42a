use std::collections::HashMap;

use proptest::prelude::*;
use tessera_api::checkpoint::{CheckpointEntry, DEVICE_LIST_MOUNT_ROOT};
use tessera_hook_protocol::hook::v1::{ContainerMetadata, Mount, PodMetadata};

use super::*;
use tessera_hook_protocol::edit::apply;

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
        book: None,
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

/// A compute share whose memory is 0 (annotations written before compute-only
/// requests were refused, or by hand) is refused: "0m" would be no limit at all.
#[test]
fn a_share_with_no_memory_is_refused_never_limited_to_0m() {
    for resources in [
        r#""koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":0,"koordinator.sh/gpu-memory":0"#,
        r#""koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory":"1000""#,
        r#""koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":0"#,
    ] {
        let annotation =
            format!(r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","resources":{{{resources}}}}}]}}"#);
        let error = rewrite(
            &container(Some(&annotation)),
            &node(),
            &GpuHookConfig::default(),
        )
        .expect_err(resources)
        .to_string();
        assert!(
            error.starts_with(
                "pod ml/train-0: annotation scheduling.koordinator.sh/device-allocated: gpu[0].resources: "
            ) && error.contains(&format!(
                "of GPU memory for GPU {UUID0} is a memory limit of 0 MiB, which the limiter (HAMi-core) reads as no limit"
            )),
            "{resources}: {error}"
        );
    }
    // Without the limiter env, nothing is written and nothing refused.
    let off = GpuHookConfig {
        limiter_env: false,
        ..GpuHookConfig::default()
    };
    let annotation = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","resources":{{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory":0}}}}]}}"#
    );
    assert!(rewrite(&container(Some(&annotation)), &node(), &off).is_ok());
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
    // Memory alone is no compute share: no SM limit (docs/compat.md, Koordinator).
    assert_eq!(env(&c, SM_LIMIT), None);
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

/// Container `main` of pod `uid-1` with no allocation, whose env is `PATH` then
/// `envs` (kubelet's order: the device plugin's, then the pod's), on a node whose
/// checkpoint says `grants`.
fn legacy_container(envs: &[(&str, &str)]) -> ContainerHookRequest {
    let mut c = container(None);
    c.envs = std::iter::once(kv("PATH", "/bin"))
        .chain(envs.iter().map(|(k, v)| kv(k, *v)))
        .collect();
    if let Some(pod) = c.pod.as_mut() {
        pod.uid = "uid-1".into();
    }
    c.container = Some(ContainerMetadata {
        name: "main".into(),
        ..Default::default()
    });
    c
}

/// `container` after the hook on a node whose checkpoint says `grants`.
fn after_hook(
    mut c: ContainerHookRequest,
    grants: PluginGrants,
) -> Result<ContainerHookRequest, GpuHookError> {
    let mut node = node();
    node.plugin_grants = grants;
    let edit = rewrite(&c, &node, &GpuHookConfig::default())?;
    apply(&mut c, &edit);
    Ok(c)
}

/// A container of a pod with no allocation whose env has one
/// `NVIDIA_VISIBLE_DEVICES=value`, after the hook.
fn legacy(value: &str, grants: PluginGrants) -> Result<ContainerHookRequest, GpuHookError> {
    after_hook(legacy_container(&[(VISIBLE_DEVICES, value)]), grants)
}

/// Every value of `key` the container ends up with.
fn all_values(c: &ContainerHookRequest, key: &str) -> Vec<String> {
    c.envs
        .iter()
        .filter(|e| e.key == key)
        .map(|e| e.value.clone())
        .collect()
}

/// The device variables' values a container ends up with, each asserted to be
/// there exactly once.
fn device_values(c: &ContainerHookRequest) -> BTreeMap<String, String> {
    std::iter::once(VISIBLE_DEVICES)
        .chain(DEVICE_SWITCHES.iter().map(|(key, _)| *key))
        .map(|key| {
            let values = all_values(c, key);
            assert_eq!(values.len(), 1, "{key}: {values:?} in {:?}", c.envs);
            (key.to_owned(), values[0].clone())
        })
        .collect()
}

fn recorded(entries: Vec<CheckpointEntry>) -> PluginGrants {
    PluginGrants::Recorded(entries)
}

#[test]
fn legacy_device_plugin_grant_is_kept() {
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
        // A part of the grant: narrower is fine.
        (UUID1, grant("uid-1", "main", &[UUID1, UUID2], &[])),
        ("1", grant("uid-1", "main", &["1"], &["1"])),
        (
            DEVICE_LIST_MOUNT_ROOT,
            grant("uid-1", "main", &[UUID2], &[DEVICE_LIST_MOUNT_ROOT]),
        ),
    ] {
        let c = legacy(value, recorded(vec![entry])).expect(value);
        assert_eq!(all_values(&c, VISIBLE_DEVICES), [value], "{value}");
    }
}

#[test]
fn gpus_named_in_env_without_a_device_plugin_grant_are_hidden() {
    let hidden = |result: Result<ContainerHookRequest, GpuHookError>| {
        let c = result.expect("voided, not refused");
        assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    };
    // No plugin on the node; another pod's grant; another container's; another resource's.
    hidden(legacy(UUID2, PluginGrants::NoCheckpoint));
    hidden(legacy("all", PluginGrants::NoCheckpoint));
    let mut other_resource = grant("uid-1", "main", &[UUID2], &[]);
    other_resource.resource_name = "example.com/fpga".into();
    for entry in [
        grant("uid-2", "main", &[UUID2], &[]),
        grant("uid-1", "sidecar", &[UUID2], &[]),
        other_resource,
    ] {
        hidden(legacy(UUID2, recorded(vec![entry])));
    }
}

#[test]
fn an_unreadable_checkpoint_fails_the_container_naming_it() {
    let unreadable = || {
        PluginGrants::Unreadable("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint: not a kubelet device checkpoint".into())
    };
    let error = legacy(UUID2, unreadable()).expect_err("fails closed");
    let text = error.to_string();
    for part in [
        "ml/train-0",
        "container main",
        UUID2,
        "kubelet_internal_checkpoint",
    ] {
        assert!(text.contains(part), "{text}");
    }
    // `all` after a plugin's grant is refused, and without the checkpoint the hook
    // cannot tell it from a hand-written `all`: it fails too.
    assert!(legacy("all", unreadable()).is_err());
    // Asking for no GPU needs no checkpoint.
    let c = legacy("none", unreadable()).expect("narrows");
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
}

/// The hole this rule closes: kubelet's `[plugin's value, …, pod's value]`, and the
/// runtime obeying the last.
#[test]
fn a_pod_env_after_the_device_plugins_is_never_what_the_runtime_gets() {
    // Not allocated, no grant: `[void, all]` used to reach the runtime as is.
    let c = after_hook(
        legacy_container(&[(VISIBLE_DEVICES, "void"), (VISIBLE_DEVICES, "all")]),
        PluginGrants::NoCheckpoint,
    )
    .expect("voided");
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    // Allocated: `[GPU-granted, …, all]` ends as the allocation alone.
    let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
    c.envs = vec![
        kv(VISIBLE_DEVICES, UUID1),
        kv("PATH", "/bin"),
        kv(VISIBLE_DEVICES, "all"),
        kv(VISIBLE_DEVICES, UUID2),
    ];
    let c = after_hook(c, PluginGrants::NoCheckpoint).expect("rewrites");
    assert_eq!(all_values(&c, VISIBLE_DEVICES), [UUID1]);
}

#[test]
fn a_pod_env_overruling_its_device_plugin_grant_is_refused() {
    let grants = || recorded(vec![grant("uid-1", "main", &[UUID2], &[UUID2])]);
    // Another tenant's GPU, every GPU, or more than given, after the plugin's value.
    for asked in [
        UUID1,
        "all",
        &format!("{UUID2},{UUID1}"),
        &format!("{UUID2},all"),
    ] {
        let c = legacy_container(&[(VISIBLE_DEVICES, UUID2), (VISIBLE_DEVICES, asked)]);
        let error = after_hook(c, grants()).expect_err(asked);
        assert!(
            matches!(&error, GpuHookError::EnvConflict { values, .. } if values.last().is_some_and(|v| v == asked)),
            "{error:?}"
        );
    }
    let error = after_hook(
        legacy_container(&[(VISIBLE_DEVICES, UUID2), (VISIBLE_DEVICES, UUID1)]),
        grants(),
    )
    .expect_err("refused");
    assert_eq!(
        error.to_string(),
        format!(
            "pod ml/train-0: container main: NVIDIA_VISIBLE_DEVICES: the runtime would use the last of [\"{UUID2}\", \"{UUID1}\"], \"{UUID1}\", but the device plugin gave this container [\"{UUID2}\"]; ask for those GPUs, or drop NVIDIA_VISIBLE_DEVICES from the pod spec"
        )
    );
    assert_eq!(
        tonic::Status::from(error).code(),
        tonic::Code::InvalidArgument
    );
}

#[test]
fn a_pod_env_within_its_grant_is_kept_once() {
    let grants = || recorded(vec![grant("uid-1", "main", &[UUID1, UUID2], &[])]);
    let both = format!("{UUID1},{UUID2}");
    for (envs, kept) in [
        // The last names the grant: whatever came before goes.
        (
            vec![(VISIBLE_DEVICES, UUID0), (VISIBLE_DEVICES, &both as &str)],
            &both as &str,
        ),
        (
            vec![(VISIBLE_DEVICES, "all"), (VISIBLE_DEVICES, UUID2)],
            UUID2,
        ),
        // The pod narrows its grant.
        (
            vec![(VISIBLE_DEVICES, &both as &str), (VISIBLE_DEVICES, UUID1)],
            UUID1,
        ),
        // The pod asks for no GPU.
        (
            vec![(VISIBLE_DEVICES, &both as &str), (VISIBLE_DEVICES, "void")],
            "void",
        ),
        (
            vec![(VISIBLE_DEVICES, &both as &str), (VISIBLE_DEVICES, "none")],
            "void",
        ),
        (
            vec![(VISIBLE_DEVICES, &both as &str), (VISIBLE_DEVICES, "")],
            "void",
        ),
    ] {
        let c = after_hook(legacy_container(&envs), grants()).expect("kept");
        assert_eq!(all_values(&c, VISIBLE_DEVICES), [kept], "{envs:?}");
    }
}

#[test]
fn other_device_variables_are_off_unless_the_kept_grants_plugin_set_them() {
    let asked = [
        ("NVIDIA_MOFED", "enabled"),
        ("NVIDIA_NVSWITCH", "true"),
        ("NVIDIA_GDS", "disabled"),
        ("NVIDIA_GDRCOPY", "enabled"),
        ("NVIDIA_IMEX_CHANNELS", "all"),
        ("NVIDIA_MIG_CONFIG_DEVICES", "all"),
        ("NVIDIA_MIG_MONITOR_DEVICES", "all"),
    ];
    let off: BTreeMap<String, String> = DEVICE_SWITCHES
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    // Allocated, in both modes: off, whatever the pod asked.
    for mode in [GpuMode::Env, GpuMode::Cdi] {
        let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
        c.envs.extend(asked.iter().map(|(k, v)| kv(k, *v)));
        let config = GpuHookConfig {
            mode,
            ..GpuHookConfig::default()
        };
        let edit = rewrite(&c, &node(), &config).expect("rewrites");
        apply(&mut c, &edit);
        let mut values = device_values(&c);
        values.remove(VISIBLE_DEVICES);
        assert_eq!(values, off, "{mode:?}");
    }
    // Not allocated, no grant: off.
    let mut envs = vec![(VISIBLE_DEVICES, "all")];
    envs.extend(asked);
    let c = after_hook(legacy_container(&envs), PluginGrants::NoCheckpoint).expect("voided");
    let mut values = device_values(&c);
    assert_eq!(values.remove(VISIBLE_DEVICES).as_deref(), Some("void"));
    assert_eq!(values, off);
    // A kept grant whose plugin set GDS and IMEX channel 0: those, and only those.
    let mut entry = grant("uid-1", "main", &[UUID2], &[UUID2]);
    entry.device_envs = BTreeMap::from([
        ("NVIDIA_GDS".to_owned(), "enabled".to_owned()),
        ("NVIDIA_IMEX_CHANNELS".to_owned(), "0".to_owned()),
    ]);
    let mut envs = vec![
        (VISIBLE_DEVICES, UUID2),
        ("NVIDIA_GDS", "enabled"),
        ("NVIDIA_IMEX_CHANNELS", "0"),
        (VISIBLE_DEVICES, UUID2),
    ];
    envs.extend(asked);
    let c = after_hook(legacy_container(&envs), recorded(vec![entry.clone()])).expect("kept");
    let mut expected = off.clone();
    expected.insert(VISIBLE_DEVICES.into(), UUID2.into());
    // The pod switched GDS off: it stays off. Channel `all` narrows to the plugin's 0.
    expected.insert("NVIDIA_IMEX_CHANNELS".into(), "0".into());
    assert_eq!(device_values(&c), expected);
    let c = after_hook(
        legacy_container(&[
            (VISIBLE_DEVICES, UUID2),
            ("NVIDIA_GDS", "enabled"),
            ("NVIDIA_IMEX_CHANNELS", "0"),
        ]),
        recorded(vec![entry]),
    )
    .expect("kept");
    assert_eq!(all_values(&c, "NVIDIA_GDS"), ["enabled"]);
    assert_eq!(all_values(&c, "NVIDIA_IMEX_CHANNELS"), ["0"]);
}

#[test]
fn device_list_mounts_are_the_grants_alone() {
    let mount = |path: &str| Mount {
        container_path: path.into(),
        host_path: "/dev/null".into(),
        readonly: false,
    };
    let granted = format!("{DEVICE_LIST_MOUNT_ROOT}/{UUID2}");
    let smuggled = [
        format!("{DEVICE_LIST_MOUNT_ROOT}/all"),
        format!("{DEVICE_LIST_MOUNT_ROOT}/{UUID1}"),
        "/var/run/../run/nvidia-container-devices/all".to_owned(),
        "//var/run/./nvidia-container-devices//GPU-x/".to_owned(),
        format!("{DEVICE_LIST_MOUNT_ROOT}all"),
        format!("{DEVICE_LIST_MOUNT_ROOT}/imex/3"),
    ];
    let with_mounts = |mut c: ContainerHookRequest| {
        c.mounts = std::iter::once(mount("/data"))
            .chain(std::iter::once(mount(&granted)))
            .chain(smuggled.iter().map(|p| mount(p)))
            .collect();
        c
    };
    let mount_paths = |c: &ContainerHookRequest| -> Vec<String> {
        c.mounts.iter().map(|m| m.container_path.clone()).collect()
    };
    // Allocated: the annotation's GPUs come by env; no device-list mount stays.
    let c = with_mounts(container(Some(&format!(
        r#"{{"gpu":[{}]}}"#,
        whole(UUID1, 1)
    ))));
    let c = after_hook(c, PluginGrants::NoCheckpoint).expect("rewrites");
    assert_eq!(mount_paths(&c), ["/data"]);
    // Not allocated, no grant.
    let c = with_mounts(legacy_container(&[]));
    let c = after_hook(c, PluginGrants::NoCheckpoint).expect("voided");
    assert_eq!(mount_paths(&c), ["/data"]);
    // A volume-mounts plugin's grant: its mount stays, the pod's do not.
    let mut entry = grant("uid-1", "main", &[UUID2], &[DEVICE_LIST_MOUNT_ROOT]);
    entry.mounts = vec![granted.clone()];
    let c = with_mounts(legacy_container(&[(
        VISIBLE_DEVICES,
        DEVICE_LIST_MOUNT_ROOT,
    )]));
    let c = after_hook(c, recorded(vec![entry])).expect("kept");
    assert_eq!(mount_paths(&c), ["/data".to_owned(), granted]);
}

#[test]
fn a_device_plugins_cdi_devices_do_not_reach_an_allocated_container() {
    let plugin_cdi = format!("k8s.device-plugin.nvidia.com/gpu={UUID2}");
    let mut c = container(Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))));
    c.cdi_devices = vec![
        CdiDevice {
            name: plugin_cdi.clone(),
        },
        CdiDevice {
            name: "vendor.com/fpga=0".into(),
        },
    ];
    c.annotations = HashMap::from([
        (
            "cdi.k8s.io/nvidia-device-plugin_abc".to_owned(),
            plugin_cdi.clone(),
        ),
        ("cdi.k8s.io/fpga".to_owned(), "vendor.com/fpga=0".to_owned()),
        ("other".to_owned(), plugin_cdi),
    ]);
    for mode in [GpuMode::Env, GpuMode::Cdi] {
        let config = GpuHookConfig {
            mode,
            ..GpuHookConfig::default()
        };
        let mut c = c.clone();
        let edit = rewrite(&c, &node(), &config).expect("rewrites");
        apply(&mut c, &edit);
        let mut names: Vec<&str> = c.cdi_devices.iter().map(|d| d.name.as_str()).collect();
        names.sort_unstable();
        let mut expected = vec!["vendor.com/fpga=0".to_owned()];
        if mode == GpuMode::Cdi {
            expected.insert(0, format!("nvidia.com/gpu={UUID1}"));
        }
        assert_eq!(names, expected, "{mode:?}");
        let mut keys: Vec<&str> = c.annotations.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["cdi.k8s.io/fpga", "other"], "{mode:?}");
    }
}

#[test]
fn paths_clean_as_go_cleans_them() {
    for (path, clean) in [
        (
            "/var/run/nvidia-container-devices/x",
            "/var/run/nvidia-container-devices/x",
        ),
        (
            "//var//run/./a/../nvidia-container-devices/x/",
            "/var/run/nvidia-container-devices/x",
        ),
        ("/../..", "/"),
        ("a/../../b", "../b"),
        ("", "."),
    ] {
        assert_eq!(clean_path(path), clean, "{path}");
    }
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

// === Per-container grants ===

/// A per-container entry: the pod books `booked` percent of `uuid`; each of
/// `shares` (container, percent) gets its own.
fn entry(uuid: &str, minor: u32, booked: u64, shares: &[(&str, u64)]) -> String {
    let resources = |percent: u64| {
        format!(
            r#"{{"koordinator.sh/gpu-core":{percent},"koordinator.sh/gpu-memory-ratio":{percent},"koordinator.sh/gpu-memory":{}}}"#,
            (16u64 << 30) * percent / 100
        )
    };
    let containers: Vec<String> = shares
        .iter()
        .map(|(name, percent)| format!(r#""{name}":{}"#, resources(*percent)))
        .collect();
    format!(
        r#"{{"minor":{minor},"id":"{uuid}","resources":{},"extension":{{"containers":{{{}}}}}}}"#,
        resources(booked),
        containers.join(",")
    )
}

/// Container `name` of a pod annotated `annotation`, after the hook.
fn named(annotation: &str, name: &str, config: &GpuHookConfig) -> ContainerHookRequest {
    let mut c = container(Some(annotation));
    c.container = Some(ContainerMetadata {
        name: name.into(),
        ..Default::default()
    });
    // What the pod spec may set: a limit of its own, a GPU by env.
    c.envs.push(kv(SM_LIMIT, "100"));
    c.envs.push(kv("CUDA_DEVICE_MEMORY_LIMIT_0", "99999m"));
    let edit = rewrite(&c, &node(), config).expect("rewrites");
    apply(&mut c, &edit);
    c
}

/// The scheduler's annotation for containers a (25%), b (25%) and a sidecar
/// that asked for no GPU: one GPU booked 50%.
fn two_quarters() -> String {
    format!(
        r#"{{"gpu":[{}]}}"#,
        entry(UUID0, 0, 50, &[("a", 25), ("b", 25)])
    )
}

#[test]
fn each_container_gets_its_own_share_and_a_sidecar_gets_none() {
    let annotation = two_quarters();
    for name in ["a", "b"] {
        let c = named(&annotation, name, &GpuHookConfig::default());
        assert_eq!(all_values(&c, VISIBLE_DEVICES), [UUID0], "{name}");
        assert_eq!(all_values(&c, SM_LIMIT), ["25"], "{name}: not the pod's 50");
        assert_eq!(
            all_values(&c, "CUDA_DEVICE_MEMORY_LIMIT_0"),
            ["4096m"],
            "{name}"
        );
        assert_eq!(
            paths(&c),
            [
                "/dev/fuse",
                "/dev/nvidia0",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm"
            ]
        );
    }
    for name in ["sidecar", ""] {
        let c = named(&annotation, name, &GpuHookConfig::default());
        let values = device_values(&c);
        assert_eq!(values[VISIBLE_DEVICES], "void", "{name:?}");
        for (key, off) in DEVICE_SWITCHES {
            assert_eq!(&values[*key], off, "{name:?}");
        }
        assert_eq!(paths(&c), ["/dev/fuse"], "{name:?}: no GPU device node");
        assert!(all_values(&c, SM_LIMIT).is_empty(), "{name:?}");
        assert!(all_values(&c, "CUDA_DEVICE_MEMORY_LIMIT_0").is_empty());
    }
}

#[test]
fn a_container_sees_only_its_gpus_in_order_whatever_the_others_have() {
    // a: a quarter of GPU 0; b: a quarter of GPU 0 and GPU 2 whole.
    let annotation = format!(
        r#"{{"gpu":[{},{}]}}"#,
        entry(UUID0, 0, 50, &[("a", 25), ("b", 25)]),
        entry(UUID2, 2, 100, &[("b", 100)])
    );
    let a = named(&annotation, "a", &GpuHookConfig::default());
    assert_eq!(all_values(&a, VISIBLE_DEVICES), [UUID0]);
    assert!(!paths(&a).contains(&"/dev/nvidia2"), "{:?}", paths(&a));
    let b = named(&annotation, "b", &GpuHookConfig::default());
    assert_eq!(
        all_values(&b, VISIBLE_DEVICES),
        [format!("{UUID0},{UUID2}")]
    );
    assert!(paths(&b).contains(&"/dev/nvidia0") && paths(&b).contains(&"/dev/nvidia2"));
    // In CDI mode too: its own CDI devices, no other.
    let cdi = GpuHookConfig {
        mode: GpuMode::Cdi,
        ..GpuHookConfig::default()
    };
    let a = named(&annotation, "a", &cdi);
    let names: Vec<&str> = a.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, [format!("nvidia.com/gpu={UUID0}")]);
    let mut sidecar = container(Some(&annotation));
    sidecar.container = Some(ContainerMetadata {
        name: "sidecar".into(),
        ..Default::default()
    });
    sidecar.cdi_devices.push(CdiDevice {
        name: format!("nvidia.com/gpu={UUID1}"),
    });
    let edit = rewrite(&sidecar, &node(), &cdi).expect("voided");
    apply(&mut sidecar, &edit);
    assert!(sidecar.cdi_devices.is_empty(), "{:?}", sidecar.cdi_devices);
}

#[test]
fn grants_of_containers_that_do_not_exist_are_harmless() {
    // A grant to a container this pod does not have, on a GPU this node does not have.
    let annotation = format!(
        r#"{{"gpu":[{},{}]}}"#,
        entry(UUID0, 0, 25, &[("a", 25)]),
        entry("GPU-elsewhere", 7, 50, &[("ghost", 50)])
    );
    let a = named(&annotation, "a", &GpuHookConfig::default());
    assert_eq!(all_values(&a, VISIBLE_DEVICES), [UUID0]);
    let sidecar = named(&annotation, "sidecar", &GpuHookConfig::default());
    assert_eq!(all_values(&sidecar, VISIBLE_DEVICES), ["void"]);
    // The ghost's own GPU is what fails, for the ghost alone.
    let mut ghost = container(Some(&annotation));
    ghost.container = Some(ContainerMetadata {
        name: "ghost".into(),
        ..Default::default()
    });
    let error = rewrite(&ghost, &node(), &GpuHookConfig::default())
        .expect_err("not on this node")
        .to_string();
    assert!(
        error.contains("gpu[1]: GPU GPU-elsewhere is not on this node"),
        "{error}"
    );
    assert!(error.ends_with("(container ghost)"), "{error}");
}

#[test]
fn a_malformed_grant_refuses_the_container_naming_everything() {
    let annotation = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","resources":{{"koordinator.sh/gpu-core":50}},"extension":{{"containers":{{"a":{{"koordinator.sh/gpu-core":60}}}}}}}}]}}"#
    );
    let mut c = container(Some(&annotation));
    c.container = Some(ContainerMetadata {
        name: "a".into(),
        ..Default::default()
    });
    let error = rewrite(&c, &node(), &GpuHookConfig::default()).expect_err("malformed");
    assert_eq!(
        error.to_string(),
        r#"pod ml/train-0: annotation scheduling.koordinator.sh/device-allocated: gpu[0].extension.containers["a"]["koordinator.sh/gpu-core"]: 60 is more than the pod's 50 on this device (container a)"#
    );
    assert_eq!(
        tonic::Status::from(error).code(),
        tonic::Code::InvalidArgument
    );
    let bad_value = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","extension":{{"containers":{{"b":{{"koordinator.sh/gpu-core":"lots"}}}}}}}}]}}"#
    );
    let mut c = container(Some(&bad_value));
    c.container = Some(ContainerMetadata {
        name: "sidecar".into(),
        ..Default::default()
    });
    assert_eq!(
        rewrite(&c, &node(), &GpuHookConfig::default())
            .expect_err("malformed")
            .to_string(),
        r#"pod ml/train-0: annotation scheduling.koordinator.sh/device-allocated: gpu[0].extension.containers["b"]["koordinator.sh/gpu-core"]: expected a quantity such as 100, 8Gi or 500m, got "lots" (container sidecar)"#
    );
}

#[test]
fn the_pod_level_form_still_gives_every_container_the_pods_gpus() {
    // Annotations written before per-container grants: the old behaviour.
    let annotation = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{UUID0}","resources":{{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}}}]}}"#
    );
    for name in ["a", "sidecar"] {
        let c = named(&annotation, name, &GpuHookConfig::default());
        assert_eq!(all_values(&c, VISIBLE_DEVICES), [UUID0], "{name}");
        assert_eq!(all_values(&c, SM_LIMIT), ["50"], "{name}");
    }
}

#[test]
fn rdma_follows_the_per_container_grant() {
    let annotation = format!(
        r#"{{"gpu":[{}],"rdma":[{{"minor":3,"extension":{{"containers":{{"a":{{}}}}}}}}]}}"#,
        entry(UUID0, 0, 50, &[("a", 25), ("b", 25)])
    );
    let a = named(&annotation, "a", &GpuHookConfig::default());
    assert!(paths(&a).contains(&"/dev/infiniband/uverbs3"));
    for name in ["b", "sidecar"] {
        let c = named(&annotation, name, &GpuHookConfig::default());
        assert!(!paths(&c).contains(&"/dev/infiniband/uverbs3"), "{name}");
        assert!(!paths(&c).contains(&"/dev/infiniband/rdma_cm"), "{name}");
    }
}

/// Per-container annotations: up to three GPUs, each booked for the sum of the
/// shares of containers a, b and c on it.
fn per_container_strategy() -> impl Strategy<Value = (String, BTreeMap<String, Vec<(u32, u64)>>)> {
    proptest::collection::btree_map(
        0u32..3,
        proptest::collection::btree_map(
            proptest::sample::select(vec!["a", "b", "c"]),
            1u64..=33,
            1..3,
        ),
        1..4,
    )
    .prop_map(|gpus| {
        let mut grants: BTreeMap<String, Vec<(u32, u64)>> = BTreeMap::new();
        let entries: Vec<String> = gpus
            .iter()
            .map(|(minor, shares)| {
                for (name, percent) in shares {
                    grants
                        .entry((*name).to_owned())
                        .or_default()
                        .push((*minor, *percent));
                }
                let booked = shares.values().sum();
                let shares: Vec<(&str, u64)> = shares.iter().map(|(n, p)| (*n, *p)).collect();
                entry(
                    [UUID0, UUID1, UUID2][*minor as usize],
                    *minor,
                    booked,
                    &shares,
                )
            })
            .collect();
        (format!(r#"{{"gpu":[{}]}}"#, entries.join(",")), grants)
    })
}

proptest! {
    /// Whatever the pod and its env: a container sees exactly its own GPUs (env and
    /// device nodes) with its own limits, and a container no grant names sees none.
    #[test]
    fn a_container_gets_exactly_its_grant(
        (annotation, grants) in per_container_strategy(),
        name in proptest::sample::select(vec!["a", "b", "c", "sidecar"]),
        envs in device_envs(),
    ) {
        let mut c = container(Some(&annotation));
        c.container = Some(ContainerMetadata { name: name.into(), ..Default::default() });
        c.envs = envs.iter().map(|(k, v)| kv(k, v.clone())).collect();
        c.envs.push(kv(SM_LIMIT, "100"));
        let edit = rewrite(&c, &node(), &GpuHookConfig::default()).expect("valid");
        apply(&mut c, &edit);
        let mine = grants.get(name).cloned().unwrap_or_default();
        let uuids: Vec<&str> = mine.iter().map(|(minor, _)| [UUID0, UUID1, UUID2][*minor as usize]).collect();
        let values = device_values(&c);
        let visible = if uuids.is_empty() { "void".to_owned() } else { uuids.join(",") };
        prop_assert_eq!(&values[VISIBLE_DEVICES], &visible);
        let nodes: BTreeSet<String> = c.devices.iter().map(|d| d.container_path.clone()).filter(|p| is_gpu_node(p)).collect();
        let expected: BTreeSet<String> = mine.iter().map(|(minor, _)| format!("/dev/nvidia{minor}")).collect();
        prop_assert_eq!(nodes, expected);
        let limit = mine.iter().map(|(_, percent)| percent.to_string()).max_by_key(|p| p.parse::<u64>().unwrap_or(0));
        prop_assert_eq!(all_values(&c, SM_LIMIT), limit.into_iter().collect::<Vec<_>>());
        for (index, (_, percent)) in mine.iter().enumerate() {
            let bytes = (16u64 << 30) * percent / 100;
            prop_assert_eq!(all_values(&c, &format!("{MEMORY_LIMIT_PREFIX}{index}")), [format!("{}m", bytes >> 20)]);
        }
    }
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

/// Values a device key may have in a pod spec, an image or a plugin's env.
fn device_value(key: &'static str) -> BoxedStrategy<String> {
    if key == VISIBLE_DEVICES {
        proptest::sample::select(vec![
            UUID0.to_owned(),
            UUID1.to_owned(),
            UUID2.to_owned(),
            format!("{UUID1},{UUID2}"),
            format!("{UUID2},all"),
            format!("{UUID2},void"),
            "all".into(),
            "void".into(),
            "none".into(),
            String::new(),
            "1".into(),
            DEVICE_LIST_MOUNT_ROOT.into(),
        ])
        .boxed()
    } else {
        proptest::sample::select(vec!["enabled", "disabled", "true", "false", "", "0", "all"])
            .prop_map(String::from)
            .boxed()
    }
}

/// An env with device keys repeated in any position, among unrelated entries.
fn device_envs() -> impl Strategy<Value = Vec<(String, String)>> {
    let keys: Vec<&'static str> = std::iter::repeat_n(VISIBLE_DEVICES, 4)
        .chain(DEVICE_SWITCHES.iter().map(|(key, _)| *key))
        .chain(["X_A"])
        .collect();
    let entry = proptest::sample::select(keys)
        .prop_flat_map(|key| (Just(key.to_owned()), device_value(key)));
    proptest::collection::vec(entry, 0..10)
}

/// Mounts a pod spec may carry (hostPath `/dev/null`), device-list ones among them.
fn smuggled_mounts() -> impl Strategy<Value = Vec<Mount>> {
    let path = proptest::sample::select(vec![
        format!("{DEVICE_LIST_MOUNT_ROOT}/all"),
        format!("{DEVICE_LIST_MOUNT_ROOT}/{UUID1}"),
        format!("{DEVICE_LIST_MOUNT_ROOT}all"),
        "/var/run/./nvidia-container-devices/0".to_owned(),
        "/data".to_owned(),
    ]);
    proptest::collection::vec(path, 0..4).prop_map(|paths| {
        paths
            .into_iter()
            .map(|container_path| Mount {
                container_path,
                host_path: "/dev/null".into(),
                readonly: true,
            })
            .collect()
    })
}

/// Whether any mount is one the toolkit reads as naming a device.
fn has_device_list_mount(c: &ContainerHookRequest) -> bool {
    c.mounts
        .iter()
        .any(|m| is_device_list_mount(&clean_path(&m.container_path)))
}

/// What kubelet's checkpoint may record for container `main` of pod `uid-1`.
fn grants() -> impl Strategy<Value = PluginGrants> {
    let entry = prop_oneof![
        Just(grant("uid-1", "main", &[UUID2], &[UUID2])),
        Just(grant("uid-1", "main", &[UUID1, UUID2], &[])),
        Just(grant(
            "uid-1",
            "main",
            &[&format!("{UUID2}::1")],
            &[DEVICE_LIST_MOUNT_ROOT]
        )),
        Just(grant("uid-1", "main", &["1"], &["1"])),
        Just(grant("uid-1", "sidecar", &[UUID0], &[UUID0])),
        Just(grant("uid-2", "main", &[UUID1], &[UUID1])),
    ];
    let plugin_env = proptest::option::of(proptest::sample::select(vec![
        ("NVIDIA_GDS", "enabled"),
        ("NVIDIA_IMEX_CHANNELS", "0"),
    ]));
    prop_oneof![
        Just(PluginGrants::NoCheckpoint),
        proptest::collection::vec((entry, plugin_env), 0..3).prop_map(|entries| {
            PluginGrants::Recorded(
                entries
                    .into_iter()
                    .map(|(mut entry, env)| {
                        if let Some((key, value)) = env {
                            entry.device_envs.insert(key.into(), value.into());
                        }
                        entry
                    })
                    .collect(),
            )
        }),
    ]
}

/// The rule, written out plainly (module docs of `gpu`): what the hook must do
/// with a container of no allocation whose env is `envs`.
#[derive(Debug, PartialEq)]
enum Expected {
    Void,
    Kept(String),
    Refused,
}

fn expected(envs: &[(String, String)], grants: &PluginGrants) -> Expected {
    let Some(last) = envs.iter().rev().find(|(k, _)| k == VISIBLE_DEVICES) else {
        return Expected::Void;
    };
    let items: Vec<&str> = last
        .1
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() || items.iter().any(|i| *i == "void" || *i == "none") {
        return Expected::Void;
    }
    let PluginGrants::Recorded(entries) = grants else {
        return Expected::Void;
    };
    let given: BTreeSet<&str> = entries
        .iter()
        .filter(|e| e.pod_uid == "uid-1" && e.container_name == "main")
        .flat_map(|e| {
            e.visible_devices.iter().map(String::as_str).chain(
                e.device_ids
                    .iter()
                    .map(|id| id.split("::").next().unwrap_or(id)),
            )
        })
        .collect();
    let has_grant = entries
        .iter()
        .any(|e| e.pod_uid == "uid-1" && e.container_name == "main");
    match (has_grant, items.iter().all(|i| given.contains(i))) {
        (false, _) => Expected::Void,
        (true, true) => Expected::Kept(last.1.clone()),
        (true, false) => Expected::Refused,
    }
}

proptest! {
    /// Allocated: whatever the env holds, in whatever order, each device key comes
    /// out once, `NVIDIA_VISIBLE_DEVICES` as the annotation's GPUs and the rest off.
    #[test]
    fn an_allocated_container_ends_with_one_entry_per_device_key_its_grant(
        annotation in allocation_strategy().prop_filter_map("allocated", |a| a),
        envs in device_envs(),
        mounts in smuggled_mounts(),
        cdi in any::<bool>(),
    ) {
        let config = GpuHookConfig { mode: if cdi { GpuMode::Cdi } else { GpuMode::Env }, ..GpuHookConfig::default() };
        let mut c = container(Some(&annotation));
        c.envs = envs.iter().map(|(k, v)| kv(k, v.clone())).collect();
        c.mounts = mounts;
        let edit = rewrite(&c, &node(), &config).expect("valid allocation");
        apply(&mut c, &edit);
        let values = device_values(&c);
        let uuids: Vec<String> = DeviceAllocations::parse(&annotation).expect("valid").gpus().iter().map(|g| g.id.clone()).collect();
        let visible = if cdi { "void".to_owned() } else { uuids.join(",") };
        prop_assert_eq!(&values[VISIBLE_DEVICES], &visible);
        for (key, off) in DEVICE_SWITCHES {
            prop_assert_eq!(&values[*key], off, "{}", key);
        }
        prop_assert!(!has_device_list_mount(&c), "{:?}", c.mounts);
    }

    /// Not allocated: each device key comes out once, and `NVIDIA_VISIBLE_DEVICES`
    /// is `void` or names only what a device plugin gave this very container — or
    /// the container is refused, exactly when its last value overrules its grant.
    #[test]
    fn an_unallocated_container_ends_with_one_entry_per_device_key_within_its_grant(
        envs in device_envs(),
        mounts in smuggled_mounts(),
        grants in grants(),
    ) {
        let pairs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut c = legacy_container(&pairs);
        c.mounts = mounts;
        let result = after_hook(c, grants.clone());
        let expected = expected(&envs, &grants);
        let c = match result {
            Err(error) => {
                prop_assert_eq!(expected, Expected::Refused, "{}", error);
                prop_assert!(matches!(error, GpuHookError::EnvConflict { .. }), "{:?}", error);
                return Ok(());
            }
            Ok(c) => c,
        };
        let values = device_values(&c);
        let kept = match expected {
            Expected::Void => { prop_assert_eq!(&values[VISIBLE_DEVICES], "void"); None }
            Expected::Kept(value) => { prop_assert_eq!(&values[VISIBLE_DEVICES], &value); Some(value) }
            Expected::Refused => { prop_assert!(false, "not refused: {:?}", values); None }
        };
        let plugin_envs: BTreeMap<&str, BTreeSet<&str>> = match (&grants, &kept) {
            (PluginGrants::Recorded(entries), Some(_)) => entries
                .iter()
                .filter(|e| e.pod_uid == "uid-1" && e.container_name == "main")
                .flat_map(|e| e.device_envs.iter())
                .fold(BTreeMap::new(), |mut map, (k, v)| { map.entry(k.as_str()).or_insert_with(BTreeSet::new).insert(v.as_str()); map }),
            _ => BTreeMap::new(),
        };
        for (key, off) in DEVICE_SWITCHES {
            let value = values[*key].as_str();
            let from_plugin = plugin_envs.get(key).is_some_and(|set| set.len() == 1 && set.contains(value));
            prop_assert!(value == *off || from_plugin, "{}={} neither off nor the plugin's", key, value);
        }
        prop_assert!(c.envs.iter().any(|e| e.key == "PATH"));
        // No plugin in this checkpoint mounts a device list: none may stay.
        prop_assert!(!has_device_list_mount(&c), "{:?}", c.mounts);
    }
}

// === trusted GPU agents and privileged containers ===

/// A config trusting `entries` (`--trusted-gpu-agents`), with `privileged`.
fn trusting(entries: &[&str], privileged: PrivilegedPolicy) -> GpuHookConfig {
    GpuHookConfig {
        trusted_agents: entries
            .iter()
            .map(|e| e.parse().expect("valid entry"))
            .collect(),
        privileged,
        ..GpuHookConfig::default()
    }
}

/// Container `main` of pod `namespace/agent` (labels `labels`) with no
/// allocation and env `PATH` then `envs`; `privileged` as the CRI config says.
fn agent(
    namespace: &str,
    labels: &[(&str, &str)],
    envs: &[(&str, &str)],
    privileged: bool,
) -> ContainerHookRequest {
    let mut c = legacy_container(envs);
    if let Some(pod) = c.pod.as_mut() {
        pod.name = "agent".into();
        pod.namespace = namespace.into();
        pod.labels = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
    }
    c.privileged = privileged;
    c
}

/// `c` after the hook on the test node with `config`.
fn hooked(
    mut c: ContainerHookRequest,
    config: &GpuHookConfig,
) -> Result<ContainerHookRequest, GpuHookError> {
    let edit = rewrite(&c, &node(), config)?;
    apply(&mut c, &edit);
    Ok(c)
}

#[test]
fn a_trusted_agent_keeps_its_device_env_as_given_once_per_key() -> Result<(), GpuHookError> {
    let config = trusting(&["gpu-operator"], PrivilegedPolicy::default());
    // A plugin-like first value, the pod's `all` after it, a switch the agent needs.
    let envs = [
        (VISIBLE_DEVICES, UUID1),
        (VISIBLE_DEVICES, "all"),
        ("NVIDIA_MOFED", "enabled"),
    ];
    let before = agent("gpu-operator", &[], &envs, false);
    let c = hooked(before.clone(), &config)?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["all"]);
    assert_eq!(all_values(&c, "NVIDIA_MOFED"), ["enabled"]);
    assert_eq!(env(&c, "PATH").as_deref(), Some("/bin"));
    assert_eq!(c.devices, before.devices, "device nodes untouched");
    assert_eq!(c.mounts, before.mounts, "mounts untouched");
    // Keys it does not set stay unset, so the image's own default applies.
    assert_eq!(all_values(&c, "NVIDIA_GDRCOPY"), Vec::<String>::new());
    let bare = hooked(agent("gpu-operator", &[], &[], false), &config)?;
    assert_eq!(all_values(&bare, VISIBLE_DEVICES), Vec::<String>::new());

    // The same pod in a namespace nobody trusted: hidden, as before.
    let c = hooked(agent("default", &[], &envs, false), &config)?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    assert_eq!(all_values(&c, "NVIDIA_MOFED"), ["disabled"]);
    // Nothing is trusted by default.
    let c = hooked(
        agent("gpu-operator", &[], &envs, false),
        &GpuHookConfig::default(),
    )?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    Ok(())
}

#[test]
fn a_label_narrows_a_trusted_namespace_and_never_trusts_alone() -> Result<(), GpuHookError> {
    let config = trusting(
        &["kube-system:name=nvidia-device-plugin-ds"],
        PrivilegedPolicy::default(),
    );
    let envs = [(VISIBLE_DEVICES, "all")];
    let label = [("name", "nvidia-device-plugin-ds")];
    for (namespace, labels, want) in [
        ("kube-system", &label[..], "all"),
        ("kube-system", &[][..], "void"),
        ("kube-system", &[("name", "other")][..], "void"),
        // The label in a namespace where anyone may create pods proves nothing.
        ("default", &label[..], "void"),
    ] {
        let c = hooked(agent(namespace, labels, &envs, false), &config)?;
        assert_eq!(
            all_values(&c, VISIBLE_DEVICES),
            [want],
            "{namespace} {labels:?}"
        );
    }
    Ok(())
}

#[test]
fn trust_never_widens_an_allocation() {
    let config = trusting(&["ml"], PrivilegedPolicy::default());
    // `container()` is pod ml/train-0, env `all`: its grant, not `all`.
    let c = rewritten(
        Some(&format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1))),
        &config,
    );
    assert_eq!(all_values(&c, VISIBLE_DEVICES), [UUID1]);
    assert_eq!(
        paths(&c),
        [
            "/dev/fuse",
            "/dev/nvidia1",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm"
        ]
    );
    // A sidecar the grants do not name: none.
    let sidecar = named(&two_quarters(), "sidecar", &config);
    assert_eq!(all_values(&sidecar, VISIBLE_DEVICES), ["void"]);
}

#[test]
fn a_privileged_container_that_asks_for_gpus_is_refused_naming_everything() {
    let c = agent("default", &[], &[(VISIBLE_DEVICES, "all")], true);
    let err = rewrite(&c, &node(), &GpuHookConfig::default()).expect_err("refused");
    assert_eq!(
        err.to_string(),
        "pod default/agent: container main: securityContext.privileged=true: the runtime gives a privileged container every GPU of this node, and it asks for GPUs (NVIDIA_VISIBLE_DEVICES=all); refused by setting privileged=refuse-gpu (--privileged): drop privileged, or run it in a namespace named by --trusted-gpu-agents"
    );
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::PermissionDenied
    );

    // A device plugin's grant or an NVIDIA CDI device asks for GPUs too.
    let plain = agent("default", &[], &[], true);
    let mut node = node();
    node.plugin_grants = recorded(vec![grant("uid-1", "main", &[UUID2], &[])]);
    let err = rewrite(&plain, &node, &GpuHookConfig::default()).expect_err("plugin grant");
    assert!(
        err.to_string()
            .contains(&format!("a device plugin gave it [\"{UUID2}\"]")),
        "{err}"
    );
    let mut cdi = plain.clone();
    cdi.annotations.insert(
        "cdi.k8s.io/nvidia-device-plugin_uuid".into(),
        "k8s.device-plugin.nvidia.com/gpu=GPU-x".into(),
    );
    let err = rewrite(&cdi, &self::node(), &GpuHookConfig::default()).expect_err("CDI");
    assert!(
        err.to_string()
            .contains("(CDI device k8s.device-plugin.nvidia.com/gpu=GPU-x)"),
        "{err}"
    );
}

#[test]
fn privileged_system_agents_that_ask_for_no_gpu_run_by_default() -> Result<(), GpuHookError> {
    // A CNI or CSI agent: privileged, no GPU asked. Runs, its env voided.
    for envs in [&[][..], &[(VISIBLE_DEVICES, "void")][..]] {
        let c = hooked(
            agent("kube-system", &[], envs, true),
            &GpuHookConfig::default(),
        )?;
        assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"], "{envs:?}");
    }
    // `refuse` refuses it unless trusted.
    let strict = trusting(&["gpu-operator"], PrivilegedPolicy::Refuse);
    let err = rewrite(&agent("kube-system", &[], &[], true), &node(), &strict).expect_err("refuse");
    assert!(
        err.to_string()
            .contains("and it is not a trusted GPU agent; refused by setting privileged=refuse"),
        "{err}"
    );
    let c = hooked(
        agent("gpu-operator", &[], &[(VISIBLE_DEVICES, "all")], true),
        &strict,
    )?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["all"]);
    // Unprivileged containers are never refused for it.
    let c = hooked(agent("kube-system", &[], &[], false), &strict)?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    Ok(())
}

#[test]
fn a_trusted_privileged_agent_runs_with_its_env() -> Result<(), GpuHookError> {
    let config = trusting(&["gpu-operator"], PrivilegedPolicy::RefuseGpu);
    let c = hooked(
        agent("gpu-operator", &[], &[(VISIBLE_DEVICES, "all")], true),
        &config,
    )?;
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["all"]);
    Ok(())
}

#[test]
fn a_privileged_container_granted_gpus_is_refused_even_when_trusted() {
    let annotation = format!(r#"{{"gpu":[{}]}}"#, whole(UUID1, 1));
    for policy in [PrivilegedPolicy::RefuseGpu, PrivilegedPolicy::Refuse] {
        let mut c = container(Some(&annotation));
        c.container = Some(ContainerMetadata {
            name: "main".into(),
            ..Default::default()
        });
        c.privileged = true;
        let err = rewrite(&c, &node(), &trusting(&["ml"], policy)).expect_err("refused");
        assert_eq!(
            err.to_string(),
            format!(
                "pod ml/train-0: container main: securityContext.privileged=true: the runtime gives a privileged container every GPU of this node, and the scheduler granted it GPUs, and privileged it would use every GPU of the node; refused by setting privileged={policy} (--privileged): drop privileged from the container"
            )
        );
    }
    // `allow`: the old behaviour, its grant written as for any container.
    let mut c = container(Some(&annotation));
    c.privileged = true;
    let edit = rewrite(&c, &node(), &trusting(&[], PrivilegedPolicy::Allow)).expect("allowed");
    apply(&mut c, &edit);
    assert_eq!(all_values(&c, VISIBLE_DEVICES), [UUID1]);
}

#[test]
fn privileged_containers_are_not_refused_on_a_node_without_gpus() -> Result<(), GpuHookError> {
    let mut c = agent("default", &[], &[(VISIBLE_DEVICES, "all")], true);
    let strict = trusting(&[], PrivilegedPolicy::Refuse);
    let edit = rewrite(&c, &NodeDevices::default(), &strict)?;
    apply(&mut c, &edit);
    assert_eq!(all_values(&c, VISIBLE_DEVICES), ["void"]);
    // A GPU node whose inventory could not be read still has its device nodes.
    let nodes_only = NodeDevices {
        gpus: None,
        nodes: ["nvidia3"].map(String::from).into(),
        plugin_grants: PluginGrants::NoCheckpoint,
        book: None,
    };
    let c = agent("default", &[], &[], true);
    assert!(rewrite(&c, &nodes_only, &strict).is_err());
    Ok(())
}

#[test]
fn trusted_agent_entries_parse_or_name_what_is_wrong() {
    for (entry, namespace, label) in [
        ("gpu-operator", "gpu-operator", None),
        (
            "kube-system:name=nvidia-device-plugin-ds",
            "kube-system",
            Some(("name", "nvidia-device-plugin-ds")),
        ),
        (
            "nvidia-device-plugin:app.kubernetes.io/name=nvidia-device-plugin",
            "nvidia-device-plugin",
            Some(("app.kubernetes.io/name", "nvidia-device-plugin")),
        ),
        ("ns:tier=", "ns", Some(("tier", ""))),
    ] {
        let agent: TrustedGpuAgent = entry.parse().expect(entry);
        assert_eq!(agent.namespace, namespace);
        assert_eq!(
            agent.label,
            label.map(|(k, v): (&str, &str)| (k.to_owned(), v.to_owned()))
        );
        assert_eq!(agent.to_string(), entry);
    }
    for (entry, message) in [
        (
            "",
            r#""": namespace "" is not a namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"#,
        ),
        (
            "GPU_Operator",
            r#""GPU_Operator": namespace "GPU_Operator" is not a namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"#,
        ),
        (
            "kube-system:app",
            r#""kube-system:app": expected NAMESPACE or NAMESPACE:KEY=VALUE, got "app" after ':'"#,
        ),
        (
            "kube-system:=x",
            r#""kube-system:=x": label key "" is not a valid Kubernetes label key"#,
        ),
        (
            "kube-system:a=b c",
            r#""kube-system:a=b c": label value "b c" is not a valid Kubernetes label value"#,
        ),
    ] {
        let err = entry.parse::<TrustedGpuAgent>().expect_err(entry);
        assert_eq!(err.to_string(), message);
    }
}

mod enforcement {
    use super::*;
    use crate::gpu::enforce::{
        ENFORCEMENT_ENV, HAMI_CACHE_ENV, HAMI_CACHE_FILE, HAMI_LIBRARY, HAMI_LOCK_DIR,
        LD_SO_PRELOAD,
    };
    use tessera_api::resources::ENFORCEMENT;

    const SHARE: &str = r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}]}"#;
    const WHOLE: &str = r#"{"gpu":[{"minor":1,"id":"GPU-11111111-1111-1111-1111-111111111111","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}]}"#;

    fn files() -> HamiCoreFiles {
        HamiCoreFiles::under(
            std::path::Path::new("/run/t/hami"),
            std::path::Path::new("/opt/libvgpu.so"),
            std::path::Path::new("/usr/local/bin/tessera-enforce"),
        )
    }

    fn both() -> GpuHookConfig {
        GpuHookConfig {
            enforcement: Enforcement {
                driver_memory: true,
                mps: None,
                gpu_time: false,
                oom_kill: false,
                hami_core: Some(files()),
            },
            ..GpuHookConfig::default()
        }
    }

    /// A container of pod UID `uid` named `main`, with the tenant's own HAMi
    /// switches, a CDI device of Tessera's kind and `LD_PRELOAD`.
    fn tenant(annotation: &str, uid: &str) -> ContainerHookRequest {
        let mut request = container(Some(annotation));
        if let Some(pod) = request.pod.as_mut() {
            pod.uid = uid.into();
        }
        request.container = Some(ContainerMetadata {
            name: "main".into(),
            ..Default::default()
        });
        request.envs.extend([
            kv("CUDA_DISABLE_CONTROL", "true"),
            kv(HAMI_CACHE_ENV, "/tmp/other-tenant.cache"),
            kv(ENFORCEMENT_ENV, "none-of-your-business"),
            kv("LD_PRELOAD", "/usr/lib/libmine.so"),
        ]);
        request.cdi_devices.push(CdiDevice {
            name: "tessera.io/enforce=victim_main".into(),
        });
        request
    }

    fn env(edit: &ContainerHookResponse, request: &ContainerHookRequest) -> Vec<(String, String)> {
        let mut view = request.clone();
        apply(&mut view, edit);
        view.envs.into_iter().map(|e| (e.key, e.value)).collect()
    }

    #[test]
    fn a_shared_container_gets_both_backends_and_loses_the_tenants_switches()
    -> Result<(), GpuHookError> {
        let request = tenant(SHARE, "uid-1");
        let edit = rewrite(&request, &node(), &both())?;
        let envs = env(&edit, &request);
        let value = |key: &str| -> Vec<&str> {
            envs.iter()
                .filter(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
                .collect()
        };
        assert_eq!(value(ENFORCEMENT_ENV), ["driver-memory+hami-core"]);
        assert_eq!(value(HAMI_CACHE_ENV), [HAMI_CACHE_FILE]);
        assert!(value("CUDA_DISABLE_CONTROL").is_empty(), "{envs:?}");
        // The user's own preload stays theirs: HAMi-core comes through /etc/ld.so.preload.
        assert_eq!(value("LD_PRELOAD"), ["/usr/lib/libmine.so"]);
        assert_eq!(
            edit.set_annotations.get(ENFORCEMENT).map(String::as_str),
            Some("driver-memory+hami-core")
        );
        assert_eq!(
            edit.add_cdi_devices,
            [CdiDevice {
                name: "tessera.io/enforce=uid-1_main".into()
            }]
        );
        assert_eq!(edit.remove_cdi_devices, ["tessera.io/enforce=victim_main"]);
        let mounts: Vec<(&str, &str, bool)> = edit
            .add_mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str(), m.readonly))
            .collect();
        assert_eq!(
            mounts,
            [
                (HAMI_LIBRARY, "/opt/libvgpu.so", true),
                (LD_SO_PRELOAD, "/run/t/hami/ld.so.preload", true),
                (HAMI_LOCK_DIR, "/run/t/hami/lock", false),
                (
                    HAMI_CACHE_FILE,
                    "/run/t/hami/containers/uid-1/main/cudevshr.cache",
                    false,
                ),
            ]
        );
        Ok(())
    }

    #[test]
    fn a_whole_gpu_needs_no_limiter() -> Result<(), GpuHookError> {
        let request = tenant(WHOLE, "uid-1");
        let edit = rewrite(&request, &node(), &both())?;
        assert!(edit.add_mounts.is_empty(), "{:?}", edit.add_mounts);
        assert!(edit.add_cdi_devices.is_empty());
        assert!(!edit.set_annotations.contains_key(ENFORCEMENT));
        assert!(!edit.set_envs.iter().any(|e| e.key == ENFORCEMENT_ENV));
        Ok(())
    }

    #[test]
    fn without_backends_a_share_says_none() -> Result<(), GpuHookError> {
        let request = tenant(SHARE, "uid-1");
        let edit = rewrite(&request, &node(), &GpuHookConfig::default())?;
        assert_eq!(
            edit.set_annotations.get(ENFORCEMENT).map(String::as_str),
            Some("none")
        );
        assert!(edit.add_mounts.is_empty() && edit.add_cdi_devices.is_empty());
        Ok(())
    }

    #[test]
    fn a_name_unfit_for_a_host_path_is_refused() {
        for uid in ["../../etc", "a/b", ""] {
            let request = tenant(SHARE, uid);
            let result = rewrite(&request, &node(), &both());
            assert!(
                matches!(&result, Err(GpuHookError::Device { problem, .. }) if problem.contains("cannot name")),
                "{uid:?}: {result:?}"
            );
        }
    }

    #[test]
    fn a_container_that_asked_in_gpushares_or_volcanos_names_gets_their_env()
    -> Result<(), GpuHookError> {
        let asked = |value: &str| {
            let mut request = tenant(SHARE, "uid-3");
            if let Some(pod) = request.pod.as_mut() {
                pod.annotations
                    .insert("tessera.io/requested-as".into(), value.into());
            }
            // The tenant's own value is never the one that counts.
            request.envs.push(kv("ALIYUN_COM_GPU_MEM_CONTAINER", "99"));
            request
        };
        let config = GpuHookConfig::default();
        let values =
            |request: &ContainerHookRequest| -> Result<Vec<(String, String)>, GpuHookError> {
                let edit = rewrite(request, &node(), &config)?;
                Ok(env(&edit, request)
                    .into_iter()
                    .filter(|(k, _)| k.starts_with("ALIYUN_") || k.starts_with("VOLCANO_"))
                    .collect())
            };
        // 25 % of GPU 0's 16 GiB.
        let gpushare = asked(r#"{"main":"gpushare:1073741824"}"#);
        assert_eq!(
            values(&gpushare)?,
            [
                ("ALIYUN_COM_GPU_MEM_CONTAINER".to_owned(), "4".to_owned()),
                ("ALIYUN_COM_GPU_MEM_IDX".to_owned(), "0".to_owned()),
                ("ALIYUN_COM_GPU_MEM_POD".to_owned(), "4".to_owned()),
                ("ALIYUN_COM_GPU_MEM_DEV".to_owned(), "16".to_owned()),
            ]
        );
        let volcano = asked(r#"{"main":"volcano:1048576"}"#);
        assert_eq!(
            values(&volcano)?,
            [
                ("ALIYUN_COM_GPU_MEM_CONTAINER".to_owned(), "99".to_owned()),
                ("VOLCANO_GPU_ALLOCATED".to_owned(), "4096".to_owned()),
                ("VOLCANO_GPU_MEMORY_TOTAL".to_owned(), "16384".to_owned()),
            ]
        );
        // Another container's entry, or a value that does not parse: nothing added.
        for other in [r#"{"side":"gpushare:1073741824"}"#, "not json"] {
            assert_eq!(
                values(&asked(other))?,
                [("ALIYUN_COM_GPU_MEM_CONTAINER".to_owned(), "99".to_owned())]
            );
        }
        Ok(())
    }

    /// `ALIYUN_COM_GPU_MEM_POD` is the pod's GPU memory: every gpushare
    /// container's grant, while `_CONTAINER` is this container's own.
    #[test]
    fn gpushares_pod_env_is_the_sum_of_its_containers_grants() -> Result<(), GpuHookError> {
        // main and side: a quarter of GPU 0's 16 GiB each.
        let annotation = format!(
            r#"{{"gpu":[{}]}}"#,
            entry(UUID0, 0, 50, &[("main", 25), ("side", 25)])
        );
        let mut request = tenant(&annotation, "uid-4");
        if let Some(pod) = request.pod.as_mut() {
            pod.annotations.insert(
                "tessera.io/requested-as".into(),
                r#"{"main":"gpushare:1073741824","side":"gpushare:1073741824"}"#.into(),
            );
        }
        let edit = rewrite(&request, &node(), &GpuHookConfig::default())?;
        let values: Vec<(String, String)> = env(&edit, &request)
            .into_iter()
            .filter(|(k, _)| k.starts_with("ALIYUN_"))
            .collect();
        assert_eq!(
            values,
            [
                ("ALIYUN_COM_GPU_MEM_IDX".to_owned(), "0".to_owned()),
                ("ALIYUN_COM_GPU_MEM_POD".to_owned(), "8".to_owned()),
                ("ALIYUN_COM_GPU_MEM_CONTAINER".to_owned(), "4".to_owned()),
                ("ALIYUN_COM_GPU_MEM_DEV".to_owned(), "16".to_owned()),
            ]
        );
        Ok(())
    }

    fn with_mps() -> GpuHookConfig {
        GpuHookConfig {
            enforcement: Enforcement {
                driver_memory: false,
                mps: Some(crate::gpu::MpsFiles {
                    pipe_dir: "/run/tessera/mps/pipe".into(),
                }),
                gpu_time: false,
                oom_kill: false,
                hami_core: None,
            },
            ..GpuHookConfig::default()
        }
    }

    #[test]
    fn mps_gives_a_shared_container_its_namespace_alone_and_its_limits() -> Result<(), GpuHookError>
    {
        use tessera_enforce::mps;
        let uid = "0b6c2a1e-1111-4222-8333-444455556666";
        let mut request = tenant(SHARE, uid);
        // The tenant points MPS elsewhere and asks for the whole GPU.
        request.envs.extend([
            kv(mps::PIPE_ENV, "/elsewhere"),
            kv(mps::THREAD_PERCENTAGE_ENV, "100"),
            kv(mps::PINNED_MEMORY_ENV, "0=80G,7=1G"),
            kv("CUDA_MPS_SM_PARTITION", "all"),
        ]);
        let edit = rewrite(&request, &node(), &with_mps())?;
        let namespace = mps::namespace_name(uid, "main").unwrap_or_default();
        let dir = format!("/run/tessera/mps/pipe/gpu_0/{namespace}");
        for path in [mps::CONTAINER_PIPE_DIR, mps::CONTAINER_PIPE_DIR_USER] {
            assert!(
                edit.add_mounts
                    .iter()
                    .any(|m| m.container_path == path && m.host_path == dir && m.readonly),
                "{path}: {:?}",
                edit.add_mounts
            );
        }
        let envs = env(&edit, &request);
        let mps_envs: Vec<(&str, &str)> = envs
            .iter()
            .filter(|(k, _)| k.starts_with(mps::ENV_PREFIX))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // 25 % of a 16 GiB GPU; nothing of the tenant's left.
        assert_eq!(
            mps_envs,
            [
                (mps::PIPE_ENV, mps::CONTAINER_PIPE_DIR),
                (mps::THREAD_PERCENTAGE_ENV, "25"),
                (mps::PINNED_MEMORY_ENV, "0=4096M"),
            ]
        );
        assert!(envs.contains(&(ENFORCEMENT_ENV.to_owned(), "mps".to_owned())));

        // A whole GPU needs no MPS.
        let whole = rewrite(&tenant(WHOLE, uid), &node(), &with_mps())?;
        assert!(
            whole
                .add_mounts
                .iter()
                .all(|m| !m.container_path.contains("nvidia-mps"))
        );
        // Shares of two GPUs cannot be one namespace: refused, with why.
        let two = r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}},{"minor":1,"id":"GPU-11111111-1111-1111-1111-111111111111","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}]}"#;
        let refused = rewrite(&tenant(two, uid), &node(), &with_mps());
        assert!(
            matches!(&refused, Err(GpuHookError::Device { problem, .. }) if problem.contains("shares of 2 GPUs")),
            "{refused:?}"
        );
        Ok(())
    }

    #[test]
    fn shared_limits_are_the_granted_bytes_and_core_of_each_gpu() -> Result<(), GpuHookError> {
        let none: Option<&std::collections::HashMap<String, String>> = None;
        // 25 % of 16 GiB, 25 % of its compute.
        let limits = shared_limits("ml/train-0", SHARE, "main", &node(), none)?;
        assert_eq!(
            limits.memory,
            [tessera_enforce::MemoryLimit {
                uuid: UUID0.into(),
                bytes: 4 << 30
            }]
        );
        assert_eq!(limits.compute_percent, Some(25));
        // KubeShare's burst ceiling caps compute above the booked request.
        let kubeshare = std::collections::HashMap::from([
            ("lsalab.nthu/gpu_request".to_owned(), "0.25".to_owned()),
            ("lsalab.nthu/gpu_limit".to_owned(), "0.6".to_owned()),
        ]);
        let burst = shared_limits("ml/train-0", SHARE, "main", &node(), Some(&kubeshare))?;
        assert_eq!(burst.compute_percent, Some(60));
        assert_eq!(burst.compute_by_gpu, [Some(60)]);
        // Shares of two GPUs: each GPU its own core share (none: memory only there).
        let two = r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}},{"minor":1,"id":"GPU-11111111-1111-1111-1111-111111111111","resources":{"koordinator.sh/gpu-memory-ratio":50}}]}"#;
        let both = shared_limits("ml/train-0", two, "main", &node(), Some(&kubeshare))?;
        assert_eq!(both.compute_percent, Some(25));
        assert_eq!(both.compute_by_gpu, [Some(25), None]);
        assert!(shared_limits("ml/train-0", WHOLE, "main", &node(), none)?.is_empty());
        // A ratio on a GPU of unknown size cannot be held: refused, not skipped.
        let unknown = NodeDevices {
            gpus: None,
            ..node()
        };
        let error = shared_limits("ml/train-0", SHARE, "main", &unknown, none);
        assert!(
            matches!(&error, Err(GpuHookError::Device { problem, .. }) if problem.contains("unknown")),
            "{error:?}"
        );
        Ok(())
    }

    #[test]
    fn granted_memory_is_a_shares_bytes_or_the_whole_gpu() -> Result<(), GpuHookError> {
        use tessera_api::usage::MemoryGrant;
        assert_eq!(
            granted_memory("ml/train-0", SHARE, "main", &node())?,
            [(UUID0.to_owned(), MemoryGrant::Share(4 << 30))]
        );
        let whole = granted_memory("ml/train-0", WHOLE, "main", &node())?;
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].1, MemoryGrant::Whole);
        assert!(granted_memory("ml/train-0", "{not json", "main", &node()).is_err());
        // A ratio of a GPU of unknown size: unknown, never a whole GPU.
        let unknown = NodeDevices {
            gpus: None,
            ..node()
        };
        assert!(granted_memory("ml/train-0", SHARE, "main", &unknown).is_err());
        Ok(())
    }

    #[test]
    fn host_dirs_are_made_for_the_containers_mounts_and_removed_with_the_pod()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let library = dir.path().join("libvgpu.so");
        std::fs::write(&library, b"")?;
        // Stands in for `tessera-enforce hami-prime --region R`: appends what
        // HAMi-core would read (its env) to the region.
        let primer = dir.path().join("primer");
        std::fs::write(
            &primer,
            "#!/bin/sh\n[ \"$CUDA_DEVICE_MEMORY_SHARED_CACHE\" = \"$3\" ] && same=cache-is-its-file\necho \"$1 $LD_PRELOAD $same $CUDA_DEVICE_MEMORY_LIMIT_0 $CUDA_DEVICE_SM_LIMIT ${HOME:-nohome}\" >> \"$3\"\n",
        )?;
        std::fs::set_permissions(&primer, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let files = HamiCoreFiles::under(&dir.path().join("hami"), &library, &primer);
        files.install()?;
        assert_eq!(
            std::fs::read_to_string(&files.preload)?,
            format!("{HAMI_LIBRARY}\n")
        );
        let config = GpuHookConfig {
            enforcement: Enforcement {
                driver_memory: false,
                mps: None,
                gpu_time: false,
                oom_kill: false,
                hami_core: Some(files.clone()),
            },
            ..GpuHookConfig::default()
        };
        let edit = rewrite(&tenant(SHARE, "uid-9"), &node(), &config)?;
        enforce::prepare_host(&edit, &config.enforcement)?;
        let region = files.cache_root.join("uid-9/main/cudevshr.cache");
        // Written once, by the primer, with the grant's env and nothing of ours;
        // a restarted container (the hook runs again) keeps its region.
        let want = format!(
            "hami-prime {} cache-is-its-file 4096m 25 nohome\n",
            library.display()
        );
        assert_eq!(std::fs::read_to_string(&region)?, want);
        enforce::prepare_host(&edit, &config.enforcement)?;
        assert_eq!(std::fs::read_to_string(&region)?, want);
        enforce::remove_pod_dirs(&config.enforcement, "uid-9")?;
        assert!(!files.cache_root.join("uid-9").exists());
        // A primer that fails fails the container, named.
        let failing = dir.path().join("failing");
        // It writes part of its file first, as HAMi-core does before it dies half way.
        std::fs::write(
            &failing,
            "#!/bin/sh\necho partial > \"$3\"\necho no libcuda >&2\nexit 3\n",
        )?;
        std::fs::set_permissions(
            &failing,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        let mut config = config;
        if let Some(hami) = config.enforcement.hami_core.as_mut() {
            hami.primer = failing.clone();
        }
        let error = enforce::prepare_host(&edit, &config.enforcement)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains(&failing.display().to_string()) && error.contains("no libcuda"),
            "{error}"
        );
        // Nothing of the failed primer is left, and the region stays empty: the
        // next try primes again.
        let dir_of = |p: &std::path::Path| -> Vec<String> {
            std::fs::read_dir(p.parent().expect("a directory"))
                .map(|d| {
                    d.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        assert_eq!(dir_of(&region), ["cudevshr.cache"]);
        assert_eq!(std::fs::metadata(&region)?.len(), 0);
        // No limit env for HAMi-core (--no-limiter-env): refused, not primed unlimited.
        config.limiter_env = false;
        if let Some(hami) = config.enforcement.hami_core.as_mut() {
            hami.primer = primer.clone();
        }
        let edit = rewrite(&tenant(SHARE, "uid-10"), &node(), &config)?;
        let error = enforce::prepare_host(&edit, &config.enforcement)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("--no-limiter-env"), "{error}");
        // A missing library or primer is named.
        let missing = HamiCoreFiles::under(dir.path(), &dir.path().join("nope.so"), &primer);
        assert!(missing.install().is_err());
        let missing = HamiCoreFiles::under(dir.path(), &library, &dir.path().join("nope"));
        let error = missing
            .install()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("--enforce-binary"), "{error}");
        Ok(())
    }
}

#[test]
fn a_kubeshare_burst_ceiling_caps_compute_at_its_limit() -> Result<(), GpuHookError> {
    let annotation = r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":30,"koordinator.sh/gpu-memory":"1Gi"}}]}"#;
    let sm = |annotations: &[(&str, &str)]| -> Result<Vec<String>, GpuHookError> {
        let mut request = container(Some(annotation));
        if let Some(pod) = request.pod.as_mut() {
            for (k, v) in annotations {
                pod.annotations.insert((*k).to_owned(), (*v).to_owned());
            }
        }
        let edit = rewrite(&request, &node(), &GpuHookConfig::default())?;
        Ok(edit
            .set_envs
            .iter()
            .filter(|e| e.key == SM_LIMIT)
            .map(|e| e.value.clone())
            .collect())
    };
    let request = ("lsalab.nthu/gpu_request", "0.3");
    // Booked 30 %, capped at 80 %.
    assert_eq!(sm(&[request, ("lsalab.nthu/gpu_limit", "0.8")])?, ["80"]);
    // No ceiling, or one not above the booked share: the share itself.
    assert_eq!(sm(&[request])?, ["30"]);
    assert_eq!(sm(&[request, ("lsalab.nthu/gpu_limit", "0.2")])?, ["30"]);
    assert_eq!(sm(&[request, ("lsalab.nthu/gpu_limit", "2")])?, ["30"]);
    assert_eq!(sm(&[request, ("lsalab.nthu/gpu_limit", "lots")])?, ["30"]);
    // A limit without KubeShare's request is not KubeShare's: ignored.
    assert_eq!(sm(&[("lsalab.nthu/gpu_limit", "0.8")])?, ["30"]);
    Ok(())
}

mod integrity {
    use super::*;

    /// Container `main` of pod `uid-1`, no allocation, no NVIDIA env, with these CDI
    /// devices in the CRI field and a `cdi.k8s.io/*` annotation.
    fn cdi_only(field: &[&str], annotation: Option<&str>) -> ContainerHookRequest {
        let mut c = legacy_container(&[]);
        c.container = Some(ContainerMetadata {
            name: "main".into(),
            ..Default::default()
        });
        c.cdi_devices = field
            .iter()
            .map(|name| CdiDevice {
                name: (*name).to_owned(),
            })
            .collect();
        if let Some(value) = annotation {
            c.annotations
                .insert("cdi.k8s.io/nvidia-device-plugin_uuid".into(), value.into());
        }
        c.devices.clear();
        c
    }

    fn with_grants(grants: Vec<CheckpointEntry>) -> NodeDevices {
        NodeDevices {
            plugin_grants: PluginGrants::Recorded(grants),
            ..node()
        }
    }

    #[test]
    fn nvidia_cdi_without_env_or_grant_never_reaches_the_runtime() -> Result<(), GpuHookError> {
        let request = cdi_only(
            &["nvidia.com/gpu=all", "vendor.example/fpga=0"],
            Some("nvidia.com/gpu=all"),
        );
        let edit = rewrite(
            &request,
            &with_grants(Vec::new()),
            &GpuHookConfig::default(),
        )?;
        assert_eq!(edit.remove_cdi_devices, ["nvidia.com/gpu=all"]);
        assert_eq!(
            edit.remove_annotations,
            ["cdi.k8s.io/nvidia-device-plugin_uuid"]
        );
        let mut applied = request.clone();
        apply(&mut applied, &edit);
        assert_eq!(
            applied.cdi_devices,
            [CdiDevice {
                name: "vendor.example/fpga=0".into()
            }],
            "another vendor's device is not ours to judge"
        );
        Ok(())
    }

    #[test]
    fn a_device_plugins_cdi_grant_is_kept_and_only_it() -> Result<(), GpuHookError> {
        // deviceListStrategy cdi-cri: no env, the plugin's CDI devices in the CRI field.
        let grants = vec![grant("uid-1", "main", &[UUID1], &[])];
        let request = cdi_only(
            &[
                &format!("nvidia.com/gpu={UUID1}"),
                &format!("nvidia.com/gpu={UUID2}"),
            ],
            None,
        );
        let edit = rewrite(&request, &with_grants(grants), &GpuHookConfig::default())?;
        assert_eq!(edit.remove_cdi_devices, [format!("nvidia.com/gpu={UUID2}")]);
        Ok(())
    }

    /// NVIDIA's DRA driver hands a claimed GPU to the container as a CDI device of
    /// its own vendor, in the CRI field (kubelet) or an annotation: refused,
    /// allocated or not, trusted or not, naming the device and why.
    #[test]
    fn a_gpu_claimed_through_dra_is_refused_naming_the_device() {
        let claim = "k8s.gpu.nvidia.com/claim=6c1f3a2e-0000-4000-8000-000000000000-gpu-0";
        let device = "k8s.gpu.nvidia.com/device=gpu-0";
        let trusting = GpuHookConfig {
            trusted_agents: vec!["default".parse().expect("entry")],
            ..GpuHookConfig::default()
        };
        let allocated = {
            let mut c = container(Some(
                r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#,
            ));
            c.cdi_devices = vec![CdiDevice { name: claim.into() }];
            c
        };
        let cases = [
            (cdi_only(&[claim], None), GpuHookConfig::default(), claim),
            (
                cdi_only(&[], Some(device)),
                GpuHookConfig::default(),
                device,
            ),
            (cdi_only(&[claim], None), trusting, claim),
            (allocated, GpuHookConfig::default(), claim),
        ];
        for (request, config, named) in cases {
            match rewrite(&request, &with_grants(Vec::new()), &config) {
                Err(error @ GpuHookError::DraClaim { .. }) => {
                    let text = error.to_string();
                    assert!(
                        text.contains(&format!(
                            "CDI device {named}: a GPU claimed through Dynamic Resource Allocation"
                        )) && text.contains("could grant that GPU twice"),
                        "{text}"
                    );
                }
                other => panic!("{named}: {other:?}"),
            }
        }
        // Another vendor's `k8s.` device (a NIC's DRA driver) is not ours to judge.
        let nic = cdi_only(&["k8s.net.example.com/claim=nic-0"], None);
        assert!(rewrite(&nic, &with_grants(Vec::new()), &GpuHookConfig::default()).is_ok());
    }

    /// Tessera's own DRA claims: the proxy turned the pod's prepared claims into
    /// its allocation (and marked it); the claim's CDI device is stripped and the
    /// allocation gives the GPU with its share. Without the mark it is refused.
    #[test]
    fn a_tessera_claims_cdi_device_is_honoured_only_through_the_proxys_allocation() {
        use tessera_api::dra::prepared::{
            CLAIMS_ANNOTATION, DEVICES_ANNOTATION, REFUSED_ANNOTATION,
        };
        let device = "gpu.tessera.io/claim=uid-q-0";
        let unprepared = cdi_only(&[device], None);
        match rewrite(&unprepared, &node(), &GpuHookConfig::default()) {
            Err(error @ GpuHookError::TesseraClaim { .. }) => {
                let text = error.to_string();
                assert!(
                    text.contains(device) && text.contains("not prepared for this pod"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        let quarter = format!(
            r#"{{"gpu":[{{"minor":1,"id":"{UUID1}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory":4294967296,"koordinator.sh/gpu-memory-ratio":25}},"extension":{{"containers":{{"main":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory":4294967296,"koordinator.sh/gpu-memory-ratio":25}}}}}}}}]}}"#
        );
        let mut prepared = cdi_only(&[device], None);
        let pod = prepared.pod.as_mut().expect("a pod");
        pod.annotations.insert(DEVICE_ALLOCATED.into(), quarter);
        pod.annotations
            .insert(CLAIMS_ANNOTATION.into(), "ml/quarter".into());
        pod.annotations
            .insert(DEVICES_ANNOTATION.into(), device.into());
        // Another pod's claim device beside its own: refused.
        let mut other = prepared.clone();
        other.cdi_devices.push(CdiDevice {
            name: "gpu.tessera.io/claim=uid-other-0".into(),
        });
        match rewrite(&other, &node(), &GpuHookConfig::default()) {
            Err(error @ GpuHookError::TesseraClaim { .. }) => {
                assert!(error.to_string().contains("uid-other-0"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let edit = rewrite(&prepared, &node(), &GpuHookConfig::default()).expect("granted");
        apply(&mut prepared, &edit);
        assert!(
            prepared.cdi_devices.is_empty(),
            "{:?}",
            prepared.cdi_devices
        );
        assert_eq!(env(&prepared, VISIBLE_DEVICES).as_deref(), Some(UUID1));
        assert_eq!(paths(&prepared).first().copied(), Some("/dev/nvidia1"));
        assert_eq!(env(&prepared, SM_LIMIT).as_deref(), Some("25"));
        assert_eq!(
            env(&prepared, &format!("{MEMORY_LIMIT_PREFIX}0")).as_deref(),
            Some("4096m")
        );

        let mut refused = cdi_only(&[device], None);
        refused
            .pod
            .as_mut()
            .expect("a pod")
            .annotations
            .insert(REFUSED_ANNOTATION.into(), "two books".into());
        match rewrite(&refused, &node(), &GpuHookConfig::default()) {
            Err(error @ GpuHookError::TesseraClaim { .. }) => {
                assert!(error.to_string().ends_with("two books"), "{error}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cdi_with_an_unreadable_checkpoint_is_refused() {
        let request = cdi_only(&["nvidia.com/gpu=0"], None);
        let node = NodeDevices {
            plugin_grants: PluginGrants::Unreadable("bad json".into()),
            ..node()
        };
        let result = rewrite(&request, &node, &GpuHookConfig::default());
        assert!(
            matches!(result, Err(GpuHookError::Checkpoint { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn a_gpu_device_is_removed_by_its_host_path_too() -> Result<(), GpuHookError> {
        let annotation = r#"{"gpu":[{"minor":0,"id":"GPU-00000000-0000-0000-0000-000000000000","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}]}"#;
        let mut request = container(Some(annotation));
        request.devices = vec![
            // Another GPU's node under a harmless container path.
            DeviceNode {
                container_path: "/dev/fuse-ish".into(),
                host_path: "/dev/nvidia2".into(),
                permissions: "rw".into(),
            },
            // The granted path over another GPU's node.
            DeviceNode {
                container_path: "/dev/nvidia0".into(),
                host_path: "/dev/nvidia1".into(),
                permissions: "rw".into(),
            },
            DeviceNode {
                container_path: "/dev/fuse".into(),
                host_path: "/dev/fuse".into(),
                permissions: "rwm".into(),
            },
        ];
        let edit = rewrite(&request, &node(), &GpuHookConfig::default())?;
        let mut applied = request.clone();
        apply(&mut applied, &edit);
        let nodes: Vec<(String, String)> = applied
            .devices
            .iter()
            .map(|d| (d.container_path.clone(), d.host_path.clone()))
            .filter(|(_, h)| h.contains("nvidia") && !h.ends_with("ctl") && !h.contains("uvm"))
            .collect();
        assert_eq!(
            nodes,
            [("/dev/nvidia0".to_owned(), "/dev/nvidia0".to_owned())]
        );
        assert!(
            applied
                .devices
                .iter()
                .any(|d| d.container_path == "/dev/fuse")
        );
        Ok(())
    }
}

mod one_book {
    use super::*;

    fn book(allocated: &[(&str, &str)], live: &[&str]) -> NodeBook {
        NodeBook {
            live_pods: live.iter().map(|s| (*s).to_owned()).collect(),
            allocated: allocated
                .iter()
                .map(|(uuid, uid)| BookEntry {
                    uuid: (*uuid).to_owned(),
                    pod_uid: (*uid).to_owned(),
                    pod: format!("ml/{uid}"),
                })
                .collect(),
        }
    }

    #[test]
    fn a_device_plugin_grant_of_a_gpu_tessera_shares_is_refused() {
        // A tenant pod with spec.nodeName and nvidia.com/gpu: 1: the plugin gave it GPU 1.
        let mut request = legacy_container(&[(VISIBLE_DEVICES, UUID1)]);
        request.container = Some(ContainerMetadata {
            name: "main".into(),
            ..Default::default()
        });
        let node = NodeDevices {
            plugin_grants: PluginGrants::Recorded(vec![grant("uid-1", "main", &[UUID1], &[UUID1])]),
            book: Some(book(&[(UUID1, "tessera-pod")], &["uid-1", "tessera-pod"])),
            ..node()
        };
        let result = rewrite(&request, &node, &GpuHookConfig::default());
        let Err(error) = result else {
            panic!("a GPU Tessera shares was given whole by the device plugin: {result:?}");
        };
        let text = error.to_string();
        assert!(matches!(error, GpuHookError::Taken { .. }), "{text}");
        assert!(
            text.contains(UUID1) && text.contains("ml/tessera-pod"),
            "{text}"
        );

        // Another GPU: the plugin's grant stands.
        let free = NodeDevices {
            book: Some(book(&[(UUID2, "tessera-pod")], &["uid-1", "tessera-pod"])),
            ..node
        };
        assert!(rewrite(&request, &free, &GpuHookConfig::default()).is_ok());
    }

    #[test]
    fn an_allocation_of_a_gpu_a_live_plugin_pod_holds_is_refused() {
        let annotation = r#"{"gpu":[{"minor":1,"id":"GPU-11111111-1111-1111-1111-111111111111","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#;
        let mut request = container(Some(annotation));
        if let Some(pod) = request.pod.as_mut() {
            pod.uid = "tessera-pod".into();
        }
        let grants = PluginGrants::Recorded(vec![grant("plugin-pod", "main", &[UUID1], &[UUID1])]);
        let live = NodeDevices {
            plugin_grants: grants.clone(),
            book: Some(book(&[], &["plugin-pod", "tessera-pod"])),
            ..node()
        };
        let result = rewrite(&request, &live, &GpuHookConfig::default());
        assert!(
            matches!(&result, Err(GpuHookError::Taken { holder, .. }) if holder.contains("plugin-pod")),
            "{result:?}"
        );
        // The plugin's grant to a pod Tessera placed (it asked nvidia.com/gpu where
        // the plugin serves it too) was replaced by Tessera's GPUs: not a holder, as
        // tessera-reporter does not publish it either.
        let replaced = NodeDevices {
            plugin_grants: grants.clone(),
            book: Some(book(
                &[(UUID2, "plugin-pod")],
                &["plugin-pod", "tessera-pod"],
            )),
            ..node()
        };
        assert!(
            rewrite(&request, &replaced, &GpuHookConfig::default()).is_ok(),
            "a Tessera pod's replaced plugin grant held a GPU"
        );
        // A checkpoint entry of a pod that is gone is stale: no refusal.
        let stale = NodeDevices {
            plugin_grants: grants,
            book: Some(book(&[], &["tessera-pod"])),
            ..node()
        };
        assert!(rewrite(&request, &stale, &GpuHookConfig::default()).is_ok());
        // Without a book (an external hook server) nothing is checked.
        assert!(
            rewrite(
                &request,
                &NodeDevices { book: None, ..live },
                &GpuHookConfig::default()
            )
            .is_ok()
        );
    }
}
