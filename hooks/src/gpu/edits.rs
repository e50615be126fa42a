//! The edits that give a container exactly its GPUs: the device env set once per
//! key, device nodes and CDI devices in either mode, limiter env from the share,
//! other GPUs' nodes and a device plugin's CDI devices removed, RDMA functions.

use super::*;

/// Sets every device key once (see the module docs): `NVIDIA_VISIBLE_DEVICES` to
/// `visible`; the other device variables to the plugin's value when `grant` is a
/// kept device-plugin grant that set one (unless the pod switched it off), else
/// off; device-list mounts other than the grant's removed.
pub(super) fn device_env(
    container: &ContainerHookRequest,
    visible: &str,
    grant: Option<&Grant<'_>>,
    edit: &mut ContainerHookResponse,
) {
    edit.set_envs.push(kv(VISIBLE_DEVICES, visible));
    for (key, off) in DEVICE_SWITCHES {
        let value = match grant.and_then(|g| g.switch(key)) {
            Some(plugin) if effective(container, key) != Some(*off) => plugin,
            _ => off,
        };
        if let Some(asked) = effective(container, key).filter(|asked| *asked != value) {
            tracing::info!(key, asked, value, "device variable narrowed");
        }
        edit.set_envs.push(kv(key, value));
    }
    let kept = grant.map(Grant::device_list_mounts).unwrap_or_default();
    edit.remove_mounts.extend(
        container
            .mounts
            .iter()
            .filter(|m| {
                let path = clean_path(&m.container_path);
                is_device_list_mount(&path) && !kept.contains(&path)
            })
            .map(|m| m.container_path.clone()),
    );
}

pub(super) fn resolve_gpus<'a>(
    granted: &'a [(usize, DeviceAllocation)],
    node: &NodeDevices,
    pod: &str,
    container: &str,
) -> Result<Vec<ResolvedGpu<'a>>, GpuHookError> {
    let error = |path: String, problem: String| GpuHookError::Device {
        pod: pod.to_owned(),
        container: container.to_owned(),
        path,
        problem,
    };
    granted
        .iter()
        .map(|(index, allocation)| {
            let index = *index;
            let path = format!("gpu[{index}]");
            let Some(inventory) = &node.gpus else {
                if allocation.id.is_empty() {
                    return Err(error(
                        format!("{path}.id"),
                        format!("missing, and the node's GPU inventory is unavailable to map minor {} to a UUID", allocation.minor),
                    ));
                }
                return Ok(ResolvedGpu { index, uuid: allocation.id.clone(), minor: allocation.minor, allocation, memory_total: None });
            };
            let found = if allocation.id.is_empty() {
                inventory.iter().find(|gpu| gpu.minor == allocation.minor)
            } else {
                inventory.iter().find(|gpu| gpu.uuid.eq_ignore_ascii_case(&allocation.id))
            };
            // The UUID is the truth: never fall back to another GPU.
            let gpu = found.ok_or_else(|| {
                let have: Vec<String> = inventory.iter().map(|g| format!("{} (minor {})", g.uuid, g.minor)).collect();
                let wanted = if allocation.id.is_empty() { format!("minor {}", allocation.minor) } else { allocation.id.clone() };
                error(path.clone(), format!("GPU {wanted} is not on this node; it has {}", if have.is_empty() { "none".into() } else { have.join(", ") }))
            })?;
            Ok(ResolvedGpu { index, uuid: gpu.uuid.clone(), minor: gpu.minor, allocation, memory_total: gpu.memory_bytes })
        })
        .collect()
}

pub(super) fn device(config: &GpuHookConfig, name: &str) -> DeviceNode {
    DeviceNode {
        container_path: format!("/dev/{name}"),
        host_path: config.device_root.join(name).to_string_lossy().into_owned(),
        permissions: "rwm".into(),
    }
}

pub(super) fn env_mode(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    node: &NodeDevices,
    config: &GpuHookConfig,
    edit: &mut ContainerHookResponse,
) {
    let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    device_env(container, &uuids.join(","), None, edit);
    remove_plugin_cdi(container, &[], config, edit);
    let allocated: BTreeSet<String> = gpus
        .iter()
        .map(|g| format!("/dev/nvidia{}", g.minor))
        .collect();
    // GPU nodes a device plugin (or the user) put there that are not this pod's.
    remove_gpu_nodes(container, &allocated, edit);
    edit.add_devices.extend(
        gpus.iter()
            .map(|g| device(config, &format!("nvidia{}", g.minor))),
    );
    edit.add_devices.extend(
        CONTROL_NODES
            .iter()
            .filter(|name| node.nodes.contains(**name))
            .map(|name| device(config, name)),
    );
}

pub(super) fn cdi_mode(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    config: &GpuHookConfig,
    edit: &mut ContainerHookResponse,
) {
    let prefix = format!("{}=", config.cdi_kind);
    let wanted: Vec<String> = gpus.iter().map(|g| format!("{prefix}{}", g.uuid)).collect();
    remove_plugin_cdi(container, &wanted, config, edit);
    edit.add_cdi_devices
        .extend(wanted.into_iter().map(|name| CdiDevice { name }));
    remove_gpu_nodes(container, &BTreeSet::new(), edit);
    // CDI injects the devices; keep the legacy runtime hook from adding any.
    device_env(container, "void", None, edit);
}

/// Removes the container's `/dev/nvidia<N>` device nodes other than `keep`.
pub(super) fn remove_gpu_nodes(
    container: &ContainerHookRequest,
    keep: &BTreeSet<String>,
    edit: &mut ContainerHookResponse,
) {
    edit.remove_devices.extend(
        container
            .devices
            .iter()
            .filter(|d| {
                let host = host_gpu_node(&d.host_path);
                let gpu = is_gpu_node(&d.container_path) || host.is_some();
                // Kept only where both paths are the granted GPU's: a granted
                // container path over another GPU's host node is not that GPU.
                let granted = keep.contains(&d.container_path)
                    && host.is_none_or(|h| d.container_path == format!("/dev/{h}"));
                gpu && !granted
            })
            .map(|d| d.container_path.clone()),
    );
}

/// Removes NVIDIA CDI devices other than `wanted` that a device plugin asked
/// containerd for, in the CRI field or by `cdi.k8s.io/*` annotation: an allocated
/// container gets only the annotation's GPUs, whatever a plugin also gave it.
pub(super) fn remove_plugin_cdi(
    container: &ContainerHookRequest,
    wanted: &[String],
    config: &GpuHookConfig,
    edit: &mut ContainerHookResponse,
) {
    edit.remove_cdi_devices.extend(
        container
            .cdi_devices
            .iter()
            .filter(|c| is_nvidia_cdi(&c.name, config) && !wanted.contains(&c.name))
            .map(|c| c.name.clone()),
    );
    let mut annotations: Vec<String> = container
        .annotations
        .iter()
        .filter(|(key, value)| {
            key.starts_with(CDI_ANNOTATION_PREFIX)
                && items(value).any(|name| is_nvidia_cdi(name, config))
        })
        .map(|(key, _)| key.clone())
        .collect();
    // A map's order is not the request's: sorted, so the edit is the same each time.
    annotations.sort();
    edit.remove_annotations.extend(annotations);
}

/// Sets the limiter's env for a fractional grant. Refuses (path, problem) a share
/// whose memory limit would be 0 MiB: HAMi-core reads `CUDA_DEVICE_MEMORY_LIMIT_<i>=0m`
/// as no limit at all, so writing it would hand the container the whole memory.
pub(super) fn limiter_env(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    edit: &mut ContainerHookResponse,
) -> Result<(), (String, String)> {
    // Limits the user or image set are never trusted.
    remove_envs_where(container, edit, |key| {
        key.starts_with(MEMORY_LIMIT_PREFIX) || key == SM_LIMIT
    });
    if !gpus.iter().any(|g| g.allocation.is_fractional()) {
        return Ok(());
    }
    for (index, gpu) in gpus.iter().enumerate() {
        if let Some(bytes) = enforce::granted_bytes(gpu) {
            if bytes >> 20 == 0 {
                return Err((
                    format!("gpu[{}].resources", gpu.index),
                    format!(
                        "{bytes} bytes of GPU memory for GPU {} is a memory limit of 0 MiB, which the limiter (HAMi-core) reads as no limit; the share cannot be enforced, so the container is refused (tessera-scheduler refuses compute-only requests: re-create the pod to be scheduled again)",
                        gpu.uuid
                    ),
                ));
            }
            edit.set_envs.push(kv(
                &format!("{MEMORY_LIMIT_PREFIX}{index}"),
                format!("{}m", bytes >> 20),
            ));
        }
    }
    let annotations = container.pod.as_ref().map(|p| &p.annotations);
    if let Some(percent) = compute_percent(gpus, annotations) {
        edit.set_envs.push(kv(SM_LIMIT, percent.to_string()));
    }
    // A limit env removed above and set again is a replacement, not a removal.
    let set: BTreeMap<&str, ()> = edit.set_envs.iter().map(|e| (e.key.as_str(), ())).collect();
    edit.remove_envs
        .retain(|key| !set.contains_key(key.as_str()));
    Ok(())
}

/// Removes every env of the container whose key `tenant_set` picks: values only
/// the hook may set.
pub(super) fn remove_envs_where(
    container: &ContainerHookRequest,
    edit: &mut ContainerHookResponse,
    tenant_set: impl Fn(&str) -> bool,
) {
    edit.remove_envs.extend(
        container
            .envs
            .iter()
            .filter(|e| tenant_set(&e.key))
            .map(|e| e.key.clone()),
    );
}

/// KubeShare's annotations: the booked share and its compute ceiling.
pub(super) const KUBESHARE_REQUEST: &str = "lsalab.nthu/gpu_request";
pub(super) const KUBESHARE_LIMIT: &str = "lsalab.nthu/gpu_limit";

/// The compute a shared container may use, in percent of each GPU: its core
/// share, or KubeShare's burst ceiling above it (the request is booked, compute
/// capped at the limit). `None` for a memory-only share: no compute limit.
pub(super) fn compute_percent<S: std::hash::BuildHasher>(
    gpus: &[ResolvedGpu<'_>],
    pod_annotations: Option<&std::collections::HashMap<String, String, S>>,
) -> Option<u64> {
    let core = gpus
        .iter()
        .filter_map(|g| g.allocation.gpu_core())
        .max()
        .filter(|core| *core > 0)?;
    let ceiling = pod_annotations
        .and_then(kubeshare_ceiling)
        .filter(|c| *c > core && gpus.len() == 1);
    Some(ceiling.unwrap_or(core))
}

/// The compute ceiling in percent of a KubeShare pod (`lsalab.nthu/gpu_limit`,
/// a fraction of one GPU, with `lsalab.nthu/gpu_request` beside it), when the
/// value is one; the admission policy refuses pods whose value is not.
pub(super) fn kubeshare_ceiling<S: std::hash::BuildHasher>(
    annotations: &std::collections::HashMap<String, String, S>,
) -> Option<u64> {
    annotations.get(KUBESHARE_REQUEST)?;
    let limit: f64 = annotations.get(KUBESHARE_LIMIT)?.trim().parse().ok()?;
    (limit > 0.0 && limit <= 1.0).then(|| (limit * 100.0).round() as u64)
}

/// Adds the RDMA devices granted to the container (with their virtual functions)
/// and the connection manager.
pub(super) fn add_rdma(
    granted: &[(usize, DeviceAllocation)],
    node: &NodeDevices,
    config: &GpuHookConfig,
    pod: &str,
    container: &str,
    edit: &mut ContainerHookResponse,
) -> Result<(), GpuHookError> {
    if granted.is_empty() {
        return Ok(());
    }
    for (index, allocation) in granted {
        let mut minors = vec![(format!("rdma[{index}].minor"), allocation.minor)];
        let vfs = allocation
            .extension
            .as_ref()
            .and_then(|e| e.get("vfs"))
            .and_then(|v| v.as_array());
        for (vf_index, vf) in vfs.into_iter().flatten().enumerate() {
            let path = format!("rdma[{index}].extension.vfs[{vf_index}].minor");
            let minor = vf
                .get("minor")
                .and_then(serde_json::Value::as_u64)
                .and_then(|m| u32::try_from(m).ok());
            let minor = minor.ok_or_else(|| GpuHookError::Device {
                pod: pod.to_owned(),
                container: container.to_owned(),
                path: path.clone(),
                problem: format!(
                    "expected a device minor number, got {}",
                    vf.get("minor").cloned().unwrap_or_default()
                ),
            })?;
            minors.push((path, minor));
        }
        for (path, minor) in minors {
            let name = format!("infiniband/uverbs{minor}");
            if !node.nodes.contains(&name) {
                return Err(GpuHookError::Device {
                    pod: pod.to_owned(),
                    container: container.to_owned(),
                    path,
                    problem: format!("RDMA device /dev/{name} does not exist on this node"),
                });
            }
            edit.add_devices.push(device(config, &name));
        }
    }
    if node.nodes.contains(RDMA_CM) {
        edit.add_devices.push(device(config, RDMA_CM));
    }
    Ok(())
}
