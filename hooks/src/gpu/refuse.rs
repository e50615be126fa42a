//! Who may see which GPUs: privileged containers, trusted GPU agents, containers
//! the grant does not name, unallocated ones whose env asks for GPUs (checked
//! against kubelet's device checkpoint), and CDI devices no grant backs.

use super::*;

/// Whether a privileged container is refused, and why; `None` lets it through.
/// See [`PrivilegedPolicy`] for why the default refuses only privileged
/// containers that ask for GPUs.
///
/// `granted`: the scheduler's allocation gives this container GPUs. `trusted`: its
/// pod is a trusted GPU agent (never true for an allocated pod).
pub(super) fn privileged_refusal(
    container: &ContainerHookRequest,
    granted: bool,
    trusted: bool,
    node: &NodeDevices,
    config: &GpuHookConfig,
) -> Option<PrivilegedReason> {
    // A node without GPUs has nothing a privileged container could take.
    if !container.privileged || config.privileged == PrivilegedPolicy::Allow || !has_gpus(node) {
        return None;
    }
    if granted {
        return Some(PrivilegedReason::Allocated);
    }
    if trusted {
        return None;
    }
    match config.privileged {
        PrivilegedPolicy::Refuse => Some(PrivilegedReason::Untrusted),
        PrivilegedPolicy::RefuseGpu => asks_for_any_gpu(container, node, config),
        PrivilegedPolicy::Allow => None,
    }
}

/// Whether the node has a GPU a container could reach: one in its inventory,
/// or a `/dev/nvidia<N>` node under the device root.
pub(super) fn has_gpus(node: &NodeDevices) -> bool {
    node.gpus.as_ref().is_some_and(|gpus| !gpus.is_empty()) || has_gpu_nodes(&node.nodes)
}

/// Whether device node names (as [`crate::probe::device_nodes`] lists them, relative
/// to the device root) include a GPU's (`nvidiaN`).
pub fn has_gpu_nodes(nodes: &BTreeSet<String>) -> bool {
    nodes
        .iter()
        .any(|name| is_gpu_node(&format!("/dev/{name}")))
}

/// What about an unallocated container asks for GPUs, for a privileged one: its
/// device env (`all` or IDs), a device plugin's grant in kubelet's checkpoint, or
/// an NVIDIA CDI device.
pub(super) fn asks_for_any_gpu(
    container: &ContainerHookRequest,
    node: &NodeDevices,
    config: &GpuHookConfig,
) -> Option<PrivilegedReason> {
    if let Some(value) = requested_gpus(container) {
        return Some(PrivilegedReason::AsksForGpus(format!(
            "{VISIBLE_DEVICES}={value}"
        )));
    }
    let uid = container.pod.as_ref().map_or("", |p| p.uid.as_str());
    let name = container.container.as_ref().map_or("", |c| c.name.as_str());
    if let Some(grant) = node.plugin_grants.of_container(uid, name) {
        return Some(PrivilegedReason::AsksForGpus(format!(
            "a device plugin gave it {:?}",
            grant.describe()
        )));
    }
    let cdi = nvidia_cdi_names(container, config).min();
    cdi.map(|name| PrivilegedReason::AsksForGpus(format!("CDI device {name}")))
}

/// A trusted GPU agent's container: its device env as given. Each device key it
/// has is set once, to the value the runtime would use (the last entry, see
/// [`effective`]); keys it lacks stay absent, so an image's default applies as it
/// would without Tessera. Device nodes, mounts and CDI devices are untouched.
pub(super) fn trusted_agent(
    container: &ContainerHookRequest,
    pod: &str,
    agent: &TrustedGpuAgent,
) -> ContainerHookResponse {
    let mut edit = ContainerHookResponse::default();
    let keys = std::iter::once(VISIBLE_DEVICES).chain(DEVICE_SWITCHES.iter().map(|(key, _)| *key));
    for key in keys {
        if let Some(value) = effective(container, key) {
            edit.set_envs.push(kv(key, value));
        }
    }
    let name = container.container.as_ref().map_or("", |c| c.name.as_str());
    tracing::info!(
        pod,
        container = name,
        trusted = %agent,
        visible_devices = effective(container, VISIBLE_DEVICES).unwrap_or("(unset: the image's)"),
        privileged = container.privileged,
        "trusted GPU agent: device env kept as given"
    );
    edit
}

/// A container that the per-container grants of its allocated pod do not name:
/// no GPU. Every device key off (`NVIDIA_VISIBLE_DEVICES=void`), GPU device nodes
/// and NVIDIA CDI devices removed, limiter env dropped. A device plugin's grant
/// is not kept either: the scheduler granted this pod's GPUs container by
/// container, and this container is not among them.
pub(super) fn not_granted(
    container: &ContainerHookRequest,
    config: &GpuHookConfig,
    edit: &mut ContainerHookResponse,
) {
    device_env(container, "void", None, edit);
    remove_plugin_cdi(container, &[], config, edit);
    remove_gpu_nodes(container, &BTreeSet::new(), edit);
    edit.remove_envs.extend(
        container
            .envs
            .iter()
            .filter(|e| e.key.starts_with(MEMORY_LIMIT_PREFIX) || e.key == SM_LIMIT)
            .map(|e| e.key.clone()),
    );
}

/// No allocation: hide every GPU, unless a device plugin already gave this
/// container the ones its env asks for (a legacy `nvidia.com/gpu` pod, tracked
/// through kubelet's checkpoint). See the module docs for the rule.
pub(super) fn unallocated(
    container: &ContainerHookRequest,
    pod: &str,
    node: &NodeDevices,
    config: &GpuHookConfig,
) -> Result<ContainerHookResponse, GpuHookError> {
    let mut edit = ContainerHookResponse::default();
    let Some(void) = &config.unallocated_visible_devices else {
        return Ok(edit);
    };
    let uid = container
        .pod
        .as_ref()
        .map(|p| p.uid.as_str())
        .unwrap_or_default();
    let name = container
        .container
        .as_ref()
        .map(|c| c.name.as_str())
        .unwrap_or_default();
    // NVIDIA CDI devices reach the runtime whatever the env says: each must be one a
    // device plugin gave this container (`deviceListStrategy: cdi-cri`).
    let cdi = asks_for_nvidia_cdi(container, config);
    let value = requested_gpus(container);
    if let PluginGrants::Unreadable(reason) = &node.plugin_grants {
        if cdi || value.is_some() {
            return Err(GpuHookError::Checkpoint {
                pod: pod.to_owned(),
                container: name.to_owned(),
                value: value.unwrap_or("NVIDIA CDI devices").to_owned(),
                reason: reason.clone(),
            });
        }
    }
    let grant = node.plugin_grants.of_container(uid, name);
    shared_by_tessera(node.book.as_ref(), grant.as_ref(), uid, pod, name)?;
    if cdi {
        unbacked_cdi(container, grant.as_ref(), config, &mut edit);
    }
    let Some(value) = value else {
        device_env(container, void, None, &mut edit);
        return Ok(edit);
    };
    match grant {
        Some(grant) if grant.allows(value) => device_env(container, value, Some(&grant), &mut edit),
        Some(grant) => {
            return Err(GpuHookError::EnvConflict {
                pod: pod.to_owned(),
                container: name.to_owned(),
                key: VISIBLE_DEVICES,
                values: values(container, VISIBLE_DEVICES),
                granted: grant.describe(),
            });
        }
        None => {
            tracing::warn!(
                pod,
                container = name,
                value,
                "{VISIBLE_DEVICES} names GPUs no device plugin gave this container; hiding every GPU"
            );
            device_env(container, void, None, &mut edit);
        }
    }
    Ok(edit)
}

/// The NVIDIA CDI device names a container asks for, in the CRI field and in
/// `cdi.k8s.io/*` annotations.
pub(super) fn nvidia_cdi_names<'a>(
    container: &'a ContainerHookRequest,
    config: &'a GpuHookConfig,
) -> impl Iterator<Item = &'a str> + 'a {
    container
        .cdi_devices
        .iter()
        .map(|c| c.name.as_str())
        .chain(
            container
                .annotations
                .iter()
                .filter(|(key, _)| key.starts_with(CDI_ANNOTATION_PREFIX))
                .flat_map(|(_, value)| items(value)),
        )
        .filter(move |name| is_nvidia_cdi(name, config))
}

/// One book, plugin side: a device plugin's grant to this container (kubelet's
/// checkpoint) of a GPU Tessera has given a live container of another pod is
/// refused. kubelet admits such a pod against the plugin's count alone (a pod
/// with `spec.nodeName` never meets the scheduler), and the plugin knows nothing
/// of Tessera's shares.
pub(super) fn shared_by_tessera(
    book: Option<&NodeBook>,
    grant: Option<&Grant<'_>>,
    uid: &str,
    pod: &str,
    container: &str,
) -> Result<(), GpuHookError> {
    let (Some(book), Some(grant)) = (book, grant) else {
        return Ok(());
    };
    for id in grant.describe() {
        if let Some(entry) = book
            .allocated
            .iter()
            .find(|e| e.pod_uid != uid && e.uuid.eq_ignore_ascii_case(&id))
        {
            return Err(GpuHookError::Taken {
                pod: pod.to_owned(),
                container: container.to_owned(),
                gpu: entry.uuid.clone(),
                holder: format!("pod {} (Tessera's allocation)", entry.pod),
                how: "the device plugin's grant to this container (kubelet's checkpoint)",
            });
        }
    }
    Ok(())
}

/// One book, Tessera side: an allocation of a GPU that a device plugin gave a
/// live container of another pod (kubelet's checkpoint) is refused. A pod with
/// Tessera's own allocation does not hold its plugin grant: kubelet asked the
/// plugin too (it serves `nvidia.com/gpu` beside Tessera), but this hook gave the
/// pod Tessera's GPUs in its place, and tessera-reporter does not publish such an
/// entry, so the scheduler counts that GPU free; refusing it here would leave the
/// pods placed there failing to start forever.
pub(super) fn held_by_a_device_plugin(
    container: &ContainerHookRequest,
    gpus: &[ResolvedGpu<'_>],
    node: &NodeDevices,
    pod: &str,
    name: &str,
) -> Result<(), GpuHookError> {
    let (Some(book), PluginGrants::Recorded(entries)) = (&node.book, &node.plugin_grants) else {
        return Ok(());
    };
    let uid = container.pod.as_ref().map_or("", |p| p.uid.as_str());
    for gpu in gpus {
        let holder = entries.iter().find(|e| {
            e.pod_uid != uid
                && book.live_pods.contains(&e.pod_uid)
                && !book.allocated.iter().any(|a| a.pod_uid == e.pod_uid)
                && e.resource_name.starts_with("nvidia.com/")
                && e.gpu_ids()
                    .iter()
                    .any(|id| id.eq_ignore_ascii_case(&gpu.uuid))
        });
        if let Some(entry) = holder {
            return Err(GpuHookError::Taken {
                pod: pod.to_owned(),
                container: name.to_owned(),
                gpu: gpu.uuid.clone(),
                holder: format!(
                    "pod UID {} container {} ({} from the device plugin)",
                    entry.pod_uid, entry.container_name, entry.resource_name
                ),
                how: "the scheduler's allocation",
            });
        }
    }
    Ok(())
}

/// Whether a container could see a GPU without a GPU hook's rewrite: its pod has
/// an allocation, its env asks for GPUs, or it names an NVIDIA CDI device or a GPU
/// device node (by either path). A privileged container sees every device node:
/// it counts where `node_has_gpus` (a node without GPUs has none to show).
pub fn could_see_gpus(
    container: &ContainerHookRequest,
    config: &GpuHookConfig,
    node_has_gpus: bool,
) -> bool {
    allocation_of(container).is_some()
        || requested_gpus(container).is_some()
        || asks_for_nvidia_cdi(container, config)
        || (container.privileged && node_has_gpus)
        || container
            .devices
            .iter()
            .any(|d| is_gpu_node(&d.container_path) || host_gpu_node(&d.host_path).is_some())
}

/// Whether the container names an NVIDIA CDI device: then the device plugin's
/// grants (kubelet's checkpoint) decide which it keeps.
pub fn asks_for_nvidia_cdi(container: &ContainerHookRequest, config: &GpuHookConfig) -> bool {
    nvidia_cdi_names(container, config).next().is_some()
}

/// Whether the NVIDIA CDI device `name` (`vendor/class=id`) is one `grant` gave.
pub(super) fn cdi_backed(name: &str, grant: Option<&Grant<'_>>) -> bool {
    let (Some(grant), Some((_, id))) = (grant, name.split_once('=')) else {
        return false;
    };
    grant.ids().contains(without_replica(id))
}

/// Removes the container's NVIDIA CDI devices that no device plugin gave it: in
/// the CRI field by name, and every `cdi.k8s.io/*` annotation that names one.
pub(super) fn unbacked_cdi(
    container: &ContainerHookRequest,
    grant: Option<&Grant<'_>>,
    config: &GpuHookConfig,
    edit: &mut ContainerHookResponse,
) {
    let pod = container
        .pod
        .as_ref()
        .map(|p| format!("{}/{}", p.namespace, p.name));
    let removed: Vec<String> = container
        .cdi_devices
        .iter()
        .filter(|c| is_nvidia_cdi(&c.name, config) && !cdi_backed(&c.name, grant))
        .map(|c| c.name.clone())
        .collect();
    let mut annotations: Vec<String> = container
        .annotations
        .iter()
        .filter(|(key, value)| {
            key.starts_with(CDI_ANNOTATION_PREFIX)
                && items(value).any(|name| is_nvidia_cdi(name, config) && !cdi_backed(name, grant))
        })
        .map(|(key, _)| key.clone())
        .collect();
    annotations.sort();
    if !removed.is_empty() || !annotations.is_empty() {
        tracing::warn!(
            pod,
            devices = ?removed,
            annotations = ?annotations,
            "NVIDIA CDI devices no device plugin gave this container; removed"
        );
    }
    edit.remove_cdi_devices.extend(removed);
    edit.remove_annotations.extend(annotations);
}

/// The `NVIDIA_VISIBLE_DEVICES` the runtime would use, when it asks for GPUs
/// (`all` or IDs) rather than none.
pub fn requested_gpus(container: &ContainerHookRequest) -> Option<&str> {
    effective(container, VISIBLE_DEVICES).filter(|value| asks_for_gpus(value))
}
