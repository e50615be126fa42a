//! The GPU rewrite: from the scheduler's allocation to the container's env, device
//! nodes and CDI devices. Pure: the node's devices come in as a [`NodeDevices`] value.
//!
//! # The device env rule
//!
//! kubelet sends a device plugin's env first and the pod's own env after it, so a
//! key can come more than once; containerd and the NVIDIA toolkit obey the last
//! entry, and an image's env applies where the CRI env has none. So the hook decides
//! on the last entry ([`effective`]), and on every container it rewrites it sets
//! each device key exactly once ([`tessera_hook_protocol::edit::apply`] replaces every entry of a
//! key): `NVIDIA_VISIBLE_DEVICES`, the toolkit's other device variables
//! ([`DEVICE_SWITCHES`]) and the volume-mounts device list
//! ([`DEVICE_LIST_MOUNT_ROOT`]). What a container ends up with:
//!
//! - **allocated** (the scheduler's annotation grants this container GPUs: its
//!   per-container grant, or every GPU of an annotation in the pod-level form, see
//!   [`rewrite`]): its GPUs' UUIDs (`void` in CDI mode, where CDI carries them),
//!   with limiter env from its own share. Every earlier value, the device plugin's
//!   or the pod's, is replaced: the annotation is the grant. The other device
//!   variables are switched off and device-list mounts removed: Tessera gives
//!   GPUs and RDMA functions by their device nodes, and `NVIDIA_MOFED=enabled`
//!   would add every RDMA device of the node, `NVIDIA_IMEX_CHANNELS` channels
//!   shared with other tenants, and so on. NVIDIA CDI devices a device plugin added
//!   go too.
//! - **allocated pod, not this container** (the per-container grants do not name
//!   it: a sidecar that asked for no GPU): `void`, switches off, device-list mounts,
//!   GPU device nodes, NVIDIA CDI devices and limiter env removed, whatever its env
//!   or a device plugin says ([`not_granted`]).
//! - **not allocated, the last `NVIDIA_VISIBLE_DEVICES` asks for no GPU** (absent,
//!   `void`, `none`, empty): `void` (the configured value), switches off,
//!   device-list mounts removed. Nothing to decide: this only narrows.
//! - **not allocated, the last value asks for GPUs** (`all` or IDs), checked
//!   against kubelet's checkpoint, the only record of what a device plugin gave:
//!   - kept, as the only entry, when every ID it names is one a device plugin gave
//!     this container (pod UID and name): a legacy `nvidia.com/gpu` pod. The
//!     plugin's own values of the other device variables and its device-list
//!     mounts are kept with it; any other value of those is switched off.
//!   - voided when no device plugin gave this container anything: the pod asked
//!     Kubernetes for no GPU, and `void` is exactly what it was given.
//!   - **refused** ([`GpuHookError::EnvConflict`]) when a device plugin gave this
//!     container GPUs and the last value names others (`[GPU-granted, all]`,
//!     `[GPU-granted, GPU-of-another-tenant]`): keeping it widens, and either safe
//!     choice silently overrules the pod — the plugin's value ignores what its spec
//!     says, `void` strands the GPU kubelet reserved for it. The message names both.
//!   - refused when the checkpoint exists but cannot be read
//!     ([`GpuHookError::Checkpoint`]): the hook cannot tell the cases apart.
//!
//! The other device variables are never refused, only narrowed: they add
//! node-wide helper devices, not GPUs, and pod specs copied from NVIDIA's guides
//! set them (`NVIDIA_GDRCOPY=enabled`); switched off they widen nothing.
//!
//! # Trusted GPU agents and privileged containers
//!
//! Two node settings ([`trust`]) come before the rule above:
//!
//! - a container of a pod with **no allocation** in a trusted namespace
//!   (`--trusted-gpu-agents`) keeps its device env as given: every device key
//!   it has is set once, to the value the runtime would have used (the last
//!   entry), and nothing else is touched ([`trusted_agent`]). A pod with an
//!   allocation is never trusted: it gets exactly its grant, trust never widens it.
//! - a **privileged** container sees every device node of the host, so no
//!   rewrite confines it. On a node with GPUs, unless `--privileged allow`, one
//!   the scheduler granted GPUs is refused, and so (by default) is one that is
//!   not a trusted agent and asks for GPUs ([`privileged_refusal`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

pub use tessera_api::checkpoint::VISIBLE_DEVICES;
use tessera_api::checkpoint::{
    CheckpointEntry, DEVICE_LIST_MOUNT_ROOT, DEVICE_SWITCHES, without_replica,
};
use tessera_api::dra::prepared;
use tessera_api::resources::{DEVICE_ALLOCATED, DEVICE_TYPE_RDMA};
use tessera_api::{AllocationError, DeviceAllocation, DeviceAllocations};
use tessera_hook_protocol::hook::v1::{
    CdiDevice, ContainerHookRequest, ContainerHookResponse, DeviceNode, Event, KeyValue,
};

mod asked;
pub mod enforce;
pub mod trust;
pub use enforce::{
    Enforcement, HamiCoreFiles, MpsFiles, SharedLimits, granted_memory, shared_limits,
};
pub use trust::{PrivilegedPolicy, PrivilegedReason, TrustedGpuAgent, TrustedGpuAgentError};

mod edits;
mod error;
mod refuse;
use edits::*;
pub use error::*;
pub use refuse::*;

/// Container annotations through which a device plugin asks containerd for CDI devices.
const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// Per visible GPU memory limit for an in-container limiter (HAMi-core's `<MiB>m` form).
pub const MEMORY_LIMIT_PREFIX: &str = "CUDA_DEVICE_MEMORY_LIMIT_";
/// Compute limit in percent for an in-container limiter.
pub const SM_LIMIT: &str = "CUDA_DEVICE_SM_LIMIT";
/// Control nodes a GPU container needs, added when the host has them.
pub const CONTROL_NODES: &[&str] = &[
    "nvidiactl",
    "nvidia-uvm",
    "nvidia-uvm-tools",
    "nvidia-modeset",
];
/// RDMA connection-manager node, added with any RDMA allocation when present.
pub const RDMA_CM: &str = "infiniband/rdma_cm";

/// How GPUs reach the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GpuMode {
    /// `NVIDIA_VISIBLE_DEVICES` and `/dev/nvidia*` device nodes.
    #[default]
    Env,
    /// CDI device names (`nvidia.com/gpu=<UUID>`) in the CRI CDI field.
    Cdi,
}

/// Settings of the GPU hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHookConfig {
    /// Where the host's device nodes are (`/dev`; a test directory in tests).
    pub device_root: PathBuf,
    /// Env and device nodes, or CDI.
    pub mode: GpuMode,
    /// CDI kind prefix of GPU devices.
    pub cdi_kind: String,
    /// Whether fractional allocations get limiter env.
    pub limiter_env: bool,
    /// `NVIDIA_VISIBLE_DEVICES` for containers of pods with no allocation; `None` leaves them alone.
    pub unallocated_visible_devices: Option<String>,
    /// Pods with no allocation that keep their device env as given (NVIDIA's
    /// agents). Empty by default: trust is granted by the node's operator, in
    /// writing, never assumed from a namespace's name.
    pub trusted_agents: Vec<TrustedGpuAgent>,
    /// What privileged containers may do on a node with GPUs.
    pub privileged: PrivilegedPolicy,
    /// What holds shared containers to their share on this node.
    pub enforcement: Enforcement,
}

impl GpuHookConfig {
    /// The entry of `--trusted-gpu-agents` that trusts `container`'s pod, if any.
    pub fn trusted_agent(&self, container: &ContainerHookRequest) -> Option<&TrustedGpuAgent> {
        let pod = container.pod.as_ref()?;
        self.trusted_agents.iter().find(|agent| agent.matches(pod))
    }
}

impl Default for GpuHookConfig {
    fn default() -> Self {
        Self {
            device_root: PathBuf::from("/dev"),
            mode: GpuMode::Env,
            cdi_kind: "nvidia.com/gpu".into(),
            limiter_env: true,
            unallocated_visible_devices: Some("void".into()),
            trusted_agents: Vec::new(),
            privileged: PrivilegedPolicy::default(),
            enforcement: Enforcement::default(),
        }
    }
}

/// One GPU the node has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDevice {
    /// `GPU-…`.
    pub uuid: String,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Total memory in bytes, when known.
    pub memory_bytes: Option<u64>,
}

/// What the node has, read by [`crate::probe`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeDevices {
    /// The node's GPUs, from NVML or `/proc/driver/nvidia`; `None` when neither could
    /// be read, and then the annotation's minors are trusted.
    pub gpus: Option<Vec<GpuDevice>>,
    /// Device node names present under the device root (`nvidia0`, `nvidiactl`,
    /// `infiniband/uverbs0`, …).
    pub nodes: BTreeSet<String>,
    /// What kubelet's device checkpoint says device plugins gave to containers.
    pub plugin_grants: PluginGrants,
    /// Who holds which GPU on the node now, when the caller knows (the runtime
    /// proxy's view of its live pods); `None` skips the one-book check.
    pub book: Option<NodeBook>,
}

/// The node's live pods and the GPUs Tessera's allocations give them: with
/// kubelet's checkpoint, the one book every GPU grant is checked against.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeBook {
    /// UIDs of the pods whose sandbox is up (a checkpoint entry of any other pod is stale).
    pub live_pods: BTreeSet<String>,
    /// The GPUs Tessera's allocations give the live pods.
    pub allocated: Vec<BookEntry>,
}

/// A live pod's Tessera allocation of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookEntry {
    /// The GPU's UUID.
    pub uuid: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// `namespace/name`.
    pub pod: String,
}

/// The device-plugin grants kubelet recorded in its checkpoint: the only way to
/// tell a plugin's `NVIDIA_VISIBLE_DEVICES` from one a user wrote into the pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PluginGrants {
    /// No checkpoint file: no device plugin ever gave anything on this node.
    #[default]
    NoCheckpoint,
    /// The checkpoint's entries.
    Recorded(Vec<CheckpointEntry>),
    /// The file exists but cannot be read or parsed: `path: reason`.
    Unreadable(String),
}

impl PluginGrants {
    /// What device plugins gave `container` of the pod with `pod_uid`, or `None`
    /// when the checkpoint records nothing for it.
    fn of_container(&self, pod_uid: &str, container: &str) -> Option<Grant<'_>> {
        let Self::Recorded(entries) = self else {
            return None;
        };
        let entries: Vec<&CheckpointEntry> = entries
            .iter()
            .filter(|e| {
                e.pod_uid == pod_uid
                    && e.container_name == container
                    && e.resource_name.starts_with("nvidia.com/")
            })
            .collect();
        (!entries.is_empty()).then_some(Grant { entries })
    }
}

/// What device plugins gave one container, per kubelet's checkpoint.
struct Grant<'a> {
    entries: Vec<&'a CheckpointEntry>,
}

impl Grant<'_> {
    /// The IDs an `NVIDIA_VISIBLE_DEVICES` value may name: the plugin's own items
    /// (UUIDs, indices, the volume-mounts path) and kubelet's device IDs without
    /// replica suffixes. Each names only what the plugin gave.
    fn ids(&self) -> BTreeSet<&str> {
        self.entries
            .iter()
            .flat_map(|e| {
                let ids = e.device_ids.iter().map(|id| without_replica(id));
                e.visible_devices.iter().map(String::as_str).chain(ids)
            })
            .collect()
    }

    /// Whether every ID `value` names was given. `all` is not an ID: no plugin gives it.
    fn allows(&self, value: &str) -> bool {
        let ids = self.ids();
        let mut named = items(value).peekable();
        named.peek().is_some() && named.all(|id| ids.contains(id))
    }

    /// The plugin's value of a device variable, when the plugins that gave this
    /// container anything set one and agree on it.
    fn switch(&self, key: &str) -> Option<&str> {
        let values: BTreeSet<&str> = self
            .entries
            .iter()
            .filter_map(|e| e.device_envs.get(key).map(String::as_str))
            .collect();
        let mut values = values.into_iter();
        match (values.next(), values.next()) {
            (Some(value), None) => Some(value),
            _ => None,
        }
    }

    /// Device-list mounts the plugin gave, as the toolkit reads them.
    fn device_list_mounts(&self) -> BTreeSet<String> {
        self.entries
            .iter()
            .flat_map(|e| &e.mounts)
            .map(|path| clean_path(path))
            .filter(|path| is_device_list_mount(path))
            .collect()
    }

    /// For messages: the IDs the plugins gave, in kubelet's terms.
    fn describe(&self) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for entry in &self.entries {
            for id in entry.gpu_ids() {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }
}

/// The items of a device list, as the toolkit splits it.
fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|v| !v.is_empty())
}

/// Whether the toolkit reads `value` (an `NVIDIA_VISIBLE_DEVICES` value) as asking
/// for GPUs: it does unless the list is empty or holds `void` or `none`, which win
/// over every other item (`GPU-a,void` is void, `GPU-a,all` is all).
fn asks_for_gpus(value: &str) -> bool {
    let mut items = items(value).peekable();
    items.peek().is_some() && items.all(|item| item != "void" && item != "none")
}

/// The value the runtime will use for `key`: containerd and the toolkit obey
/// the last entry.
fn effective<'a>(container: &'a ContainerHookRequest, key: &str) -> Option<&'a str> {
    container
        .envs
        .iter()
        .rev()
        .find(|e| e.key == key)
        .map(|e| e.value.as_str())
}

/// Every value of `key`, in the order kubelet sent them.
fn values(container: &ContainerHookRequest, key: &str) -> Vec<String> {
    container
        .envs
        .iter()
        .filter(|e| e.key == key)
        .map(|e| e.value.clone())
        .collect()
}

/// `path` as Go's `filepath.Clean` makes it, which is how the toolkit compares
/// mount destinations: `/var/run/x/../nvidia-container-devices/all` is a device list.
fn clean_path(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." if parts.last().is_some_and(|last| *last != "..") => {
                parts.pop();
            }
            ".." if absolute => {}
            _ => parts.push(part),
        }
    }
    match (absolute, parts.is_empty()) {
        (true, _) => format!("/{}", parts.join("/")),
        (false, true) => ".".into(),
        (false, false) => parts.join("/"),
    }
}

/// Whether the toolkit reads a mount at (cleaned) `path` as naming a device: it
/// matches the root as a plain string prefix, so `…-devicesall` counts too.
fn is_device_list_mount(path: &str) -> bool {
    path.starts_with(DEVICE_LIST_MOUNT_ROOT)
}

/// Whether a CDI device name (`vendor/class=device`) is an NVIDIA device: the
/// toolkit's (`nvidia.com/gpu`), the device plugin's (`k8s.device-plugin.nvidia.com/gpu`),
/// the DRA driver's and the hook's own kind.
fn is_nvidia_cdi(name: &str, config: &GpuHookConfig) -> bool {
    let vendor = name.split('/').next().unwrap_or_default();
    vendor == "nvidia.com"
        || vendor.ends_with(".nvidia.com")
        || name.starts_with(&format!("{}=", config.cdi_kind))
        // A prepared claim of Tessera's DRA driver: its grant reaches the
        // container through the allocation the proxy made of it, with the
        // enforcement, not through the plugin's spec.
        || prepared::is_claim_cdi(name)
}

/// The CDI vendor of NVIDIA's DRA driver for GPUs (`k8s.` + its driver name
/// `gpu.nvidia.com`): its devices are `k8s.gpu.nvidia.com/device=…` and
/// `k8s.gpu.nvidia.com/claim=…`.
const DRA_CDI_VENDOR: &str = "k8s.gpu.nvidia.com";

/// Whether a CDI device name is one NVIDIA's DRA driver prepared for a claim.
fn is_dra_claim(name: &str) -> bool {
    name.split('/').next() == Some(DRA_CDI_VENDOR)
}

/// Tessera's own DRA claims: a container of a pod whose claims the proxy could
/// not honour is refused with its reason, and so is one that kubelet gave a
/// claim's CDI device the proxy did not find prepared for this pod (the device
/// names a claim of another pod, or one not in the plugin's checkpoint: a claim
/// shared with a pod started after it was prepared, which kubelet never asks the
/// plugin about). The proxy's allocation gives the claims' GPUs; the CDI devices
/// themselves are stripped.
fn tessera_claims(
    container: &ContainerHookRequest,
    pod: &str,
    name: &str,
    config: &GpuHookConfig,
) -> Result<(), GpuHookError> {
    let annotations = container.pod.as_ref().map(|p| &p.annotations);
    let refusal = |problem: String| GpuHookError::TesseraClaim {
        pod: pod.to_owned(),
        container: name.to_owned(),
        problem,
    };
    if let Some(reason) = annotations.and_then(|a| a.get(prepared::REFUSED_ANNOTATION)) {
        return Err(refusal(reason.clone()));
    }
    let prepared_for_pod: BTreeSet<&str> = annotations
        .and_then(|a| a.get(prepared::DEVICES_ANNOTATION))
        .map(|devices| items(devices).collect())
        .unwrap_or_default();
    let unprepared = nvidia_cdi_names(container, config)
        .find(|n| prepared::is_claim_cdi(n) && !prepared_for_pod.contains(n));
    if let Some(device) = unprepared {
        return Err(refusal(format!(
            "CDI device {device} names a claim of driver {} that is not prepared for this pod on this node (tessera-runtime-proxy --dra-claims; a claim another pod already used here is prepared for that pod only); the container would get a GPU no claim of its pod backs",
            tessera_api::dra::DRIVER
        )));
    }
    Ok(())
}

/// ` (container NAME)` when the name is known, for the end of a message.
fn refused(container: &str) -> String {
    if container.is_empty() {
        String::new()
    } else {
        format!(" (container {container})")
    }
}

fn kv(key: &str, value: impl Into<String>) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: value.into(),
    }
}

/// The GPU node (`nvidiaN`) a host path names, whatever directory it is in.
fn host_gpu_node(host_path: &str) -> Option<&str> {
    let name = host_path.rsplit('/').next()?;
    is_gpu_node(&format!("/dev/{name}")).then_some(name)
}

fn is_gpu_node(container_path: &str) -> bool {
    container_path
        .strip_prefix("/dev/nvidia")
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
}

/// A GPU resolved against the node: its UUID, minor and the container's share.
struct ResolvedGpu<'a> {
    /// Its index in the annotation's `gpu` list, for messages.
    index: usize,
    uuid: String,
    minor: u32,
    allocation: &'a DeviceAllocation,
    memory_total: Option<u64>,
}

/// The pod's allocation annotation, if the scheduler wrote one. Only a container
/// of such a pod, or one whose env asks for GPUs ([`requested_gpus`]), needs the
/// node read: the rest are voided without it.
pub fn allocation_of(container: &ContainerHookRequest) -> Option<&String> {
    container
        .pod
        .as_ref()
        .and_then(|p| p.annotations.get(DEVICE_ALLOCATED))
}

/// Computes the edits that give the container exactly the GPUs (and RDMA devices)
/// the scheduler granted it. Only `CreateContainer` is rewritten.
///
/// With per-container grants (see [`tessera_api::allocation`]) the container gets
/// the devices whose entries name it, with its own share; a container they do not
/// name gets no GPU at all ([`not_granted`]). An annotation in the pod-level form
/// (written before per-container grants) gives every container the pod's devices,
/// as before: the hook cannot tell which containers asked for them, so the
/// scheduler rewrites such annotations of running pods into per-container grants
/// (`tessera_allocator::upgrade`) and the next container created reads those.
pub fn rewrite(
    container: &ContainerHookRequest,
    node: &NodeDevices,
    config: &GpuHookConfig,
) -> Result<ContainerHookResponse, GpuHookError> {
    if container.event != Event::CreateContainer as i32 {
        return Ok(ContainerHookResponse::default());
    }
    let pod = container
        .pod
        .as_ref()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .unwrap_or_default();
    let name = container
        .container
        .as_ref()
        .map(|c| c.name.as_str())
        .unwrap_or_default();
    // A GPU claimed through DRA: Tessera's ledger does not see the claim, so the
    // GPU could be granted twice; refused rather than silently stripped.
    if let Some(device) = nvidia_cdi_names(container, config).find(|name| is_dra_claim(name)) {
        return Err(GpuHookError::DraClaim {
            pod,
            container: name.to_owned(),
            device: device.to_owned(),
        });
    }
    tessera_claims(container, &pod, name, config)?;
    let allocations = allocation_of(container)
        .map(|annotation| {
            DeviceAllocations::parse(annotation).map_err(|source| GpuHookError::Annotation {
                pod: pod.clone(),
                container: name.to_owned(),
                source,
            })
        })
        .transpose()?;
    let granted = allocations
        .as_ref()
        .map(|a| a.gpus_of_container(name))
        .unwrap_or_default();
    // Trust is for pods that asked the scheduler for nothing: an allocated pod
    // gets exactly its grant, whatever its namespace.
    let trusted = match allocations {
        None => config.trusted_agent(container),
        Some(_) => None,
    };
    if let Some(reason) = privileged_refusal(
        container,
        !granted.is_empty(),
        trusted.is_some(),
        node,
        config,
    ) {
        return Err(GpuHookError::Privileged {
            pod,
            container: name.to_owned(),
            reason,
            policy: config.privileged,
        });
    }
    let Some(allocations) = allocations else {
        if let Some(agent) = trusted {
            return Ok(trusted_agent(container, &pod, agent));
        }
        return unallocated(container, &pod, node, config);
    };
    let gpus = resolve_gpus(&granted, node, &pod, name)?;
    held_by_a_device_plugin(container, &gpus, node, &pod, name)?;
    let mut edit = ContainerHookResponse::default();
    if gpus.is_empty() {
        if allocations.is_per_container() {
            // An allocated pod's container that asked for no GPU: none, whatever its env says.
            not_granted(container, config, &mut edit);
        } else {
            edit = unallocated(container, &pod, node, config)?;
        }
    } else {
        match config.mode {
            GpuMode::Env => {
                for gpu in &gpus {
                    if !node.nodes.contains(&format!("nvidia{}", gpu.minor)) {
                        return Err(GpuHookError::Device {
                            pod,
                            container: name.to_owned(),
                            path: format!("gpu[{}]", gpu.index),
                            problem: format!(
                                "device node {} for GPU {} does not exist on this node",
                                config
                                    .device_root
                                    .join(format!("nvidia{}", gpu.minor))
                                    .display(),
                                gpu.uuid
                            ),
                        });
                    }
                }
                env_mode(container, &gpus, node, config, &mut edit);
            }
            GpuMode::Cdi => cdi_mode(container, &gpus, config, &mut edit),
        }
        let device_error = |(path, problem)| GpuHookError::Device {
            pod: pod.clone(),
            container: name.to_owned(),
            path,
            problem,
        };
        if config.limiter_env {
            limiter_env(container, &gpus, &mut edit).map_err(device_error)?;
        }
        enforce::shared_edits(container, &gpus, &config.enforcement, &mut edit)
            .map_err(device_error)?;
        asked::system_env(container, name, &allocations, &gpus, node, &mut edit);
    }
    let rdma = allocations.devices_of_container(DEVICE_TYPE_RDMA, name);
    add_rdma(&rdma, node, config, &pod, name, &mut edit)?;
    Ok(edit)
}

#[cfg(test)]
mod tests;
