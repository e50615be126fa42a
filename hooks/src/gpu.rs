//! The GPU rewrite: from the scheduler's allocation to the container's env, device
//! nodes and CDI devices. Pure: the node's devices come in as a [`NodeDevices`] value.
//!
//! # The device env rule
//!
//! kubelet sends a device plugin's env first and the pod's own env after it, so a
//! key can come more than once; containerd and the NVIDIA toolkit obey the last
//! entry, and an image's env applies where the CRI env has none. So the hook decides
//! on the last entry ([`effective`]), and on every container it rewrites it sets
//! each device key exactly once ([`crate::edit::apply`] replaces every entry of a
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
use tessera_api::resources::{DEVICE_ALLOCATED, DEVICE_TYPE_RDMA};
use tessera_api::{AllocationError, DeviceAllocation, DeviceAllocations};
use tessera_protos::hook::v1::{
    CdiDevice, ContainerHookRequest, ContainerHookResponse, DeviceNode, Event, KeyValue,
};

mod asked;
pub mod enforce;
pub mod trust;
pub use enforce::{
    Enforcement, HamiCoreFiles, MpsFiles, SharedLimits, granted_memory, shared_limits,
};
pub use trust::{PrivilegedPolicy, PrivilegedReason, TrustedGpuAgent, TrustedGpuAgentError};

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
}

/// The CDI vendor of NVIDIA's DRA driver for GPUs (`k8s.` + its driver name
/// `gpu.nvidia.com`): its devices are `k8s.gpu.nvidia.com/device=…` and
/// `k8s.gpu.nvidia.com/claim=…`.
const DRA_CDI_VENDOR: &str = "k8s.gpu.nvidia.com";

/// Whether a CDI device name is one NVIDIA's DRA driver prepared for a claim.
fn is_dra_claim(name: &str) -> bool {
    name.split('/').next() == Some(DRA_CDI_VENDOR)
}

/// ` (container NAME)` when the name is known, for the end of a message.
fn refused(container: &str) -> String {
    if container.is_empty() {
        String::new()
    } else {
        format!(" (container {container})")
    }
}

/// Why a container cannot be given its GPUs. The message names the pod, the
/// annotation, the field and value, and the container; kubelet shows it as the
/// container's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuHookError {
    /// The annotation is malformed.
    #[error("pod {pod}: annotation {DEVICE_ALLOCATED}: {source}{}", refused(.container))]
    Annotation {
        /// `namespace/name`.
        pod: String,
        /// The container being created (empty when unknown).
        container: String,
        /// What is wrong with it.
        #[source]
        source: AllocationError,
    },
    /// The annotation names a device this node cannot provide.
    #[error("pod {pod}: annotation {DEVICE_ALLOCATED}: {path}: {problem}{}", refused(.container))]
    Device {
        /// `namespace/name`.
        pod: String,
        /// The container being created (empty when unknown).
        container: String,
        /// Where in the annotation, e.g. `gpu[0].id`.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// The container names GPUs in its env but kubelet's checkpoint, which would
    /// say whether a device plugin gave them, cannot be read: nothing is started
    /// with GPUs that may not be its own.
    #[error(
        "pod {pod}: container {container}: {VISIBLE_DEVICES}={value}: cannot check it against kubelet's device checkpoint: {reason}"
    )]
    Checkpoint {
        /// `namespace/name`.
        pod: String,
        /// The container's name.
        container: String,
        /// The env value.
        value: String,
        /// `path: what is wrong`.
        reason: String,
    },
    /// The container holds a GPU claimed through Dynamic Resource Allocation
    /// (a CDI device of NVIDIA's DRA driver): Tessera's ledger does not see DRA
    /// claims, so that GPU may be another tenant's share too.
    #[error(
        "pod {pod}: container {container}: CDI device {device}: a GPU claimed through Dynamic Resource Allocation (NVIDIA's DRA driver) on a node whose GPUs Tessera shares; tessera-scheduler does not see DRA claims and could grant that GPU twice, so it is refused: run DRA GPU pods on nodes without tessera-runtime-proxy, or ask Tessera for the GPU (nvidia.com/gpu or koordinator.sh/gpu)"
    )]
    DraClaim {
        /// `namespace/name`.
        pod: String,
        /// The container being created.
        container: String,
        /// The CDI device NVIDIA's DRA driver prepared for it.
        device: String,
    },
    /// A device plugin gave the container GPUs, and the value of the device env
    /// the runtime would use (the last entry) names others: keeping it widens,
    /// and neither the plugin's value nor `void` is what the pod spec says.
    #[error(
        "pod {pod}: container {container}: {key}: the runtime would use the last of {values:?}, {:?}, but the device plugin gave this container {granted:?}; ask for those GPUs, or drop {key} from the pod spec",
        .values.last().map(String::as_str).unwrap_or_default()
    )]
    EnvConflict {
        /// `namespace/name`.
        pod: String,
        /// The container's name.
        container: String,
        /// The env key.
        key: &'static str,
        /// Every value of the key, in kubelet's order (the plugin's first); the
        /// runtime would use the last.
        values: Vec<String>,
        /// What kubelet's checkpoint records the plugin giving.
        granted: Vec<String>,
    },
    /// A privileged container, which would see every GPU device of the node,
    /// that the `--privileged` setting does not let run.
    #[error(
        "pod {pod}: container {container}: securityContext.privileged=true: the runtime gives a privileged container every GPU of this node, and {reason}; refused by setting privileged={policy} (--privileged): {}",
        privileged_hint(.reason)
    )]
    Privileged {
        /// `namespace/name`.
        pod: String,
        /// The container's name.
        container: String,
        /// Why it is refused.
        reason: PrivilegedReason,
        /// The setting that refused it.
        policy: PrivilegedPolicy,
    },
    /// The container's grant would take a GPU another live pod holds: a GPU is
    /// never given twice, whoever asks (Tessera's scheduler or a device plugin).
    #[error(
        "pod {pod}: container {container}: GPU {gpu} is already held by {holder}; {how} gives it again, and a GPU is never given twice: the container is not created"
    )]
    Taken {
        /// `namespace/name`.
        pod: String,
        /// The container's name.
        container: String,
        /// The GPU's UUID.
        gpu: String,
        /// Who holds it.
        holder: String,
        /// What would give it again.
        how: &'static str,
    },
}

/// What the pod's owner or the node's operator can do about a refused
/// privileged container.
fn privileged_hint(reason: &PrivilegedReason) -> &'static str {
    match reason {
        PrivilegedReason::Allocated => "drop privileged from the container",
        PrivilegedReason::AsksForGpus(_) | PrivilegedReason::Untrusted => {
            "drop privileged, or run it in a namespace named by --trusted-gpu-agents"
        }
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

/// Whether a privileged container is refused, and why; `None` lets it through.
/// See [`PrivilegedPolicy`] for why the default refuses only privileged
/// containers that ask for GPUs.
///
/// `granted`: the scheduler's allocation gives this container GPUs. `trusted`: its
/// pod is a trusted GPU agent (never true for an allocated pod).
fn privileged_refusal(
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
fn has_gpus(node: &NodeDevices) -> bool {
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
fn asks_for_any_gpu(
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
fn trusted_agent(
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
fn not_granted(
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
fn unallocated(
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
fn nvidia_cdi_names<'a>(
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
fn shared_by_tessera(
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
fn held_by_a_device_plugin(
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
fn cdi_backed(name: &str, grant: Option<&Grant<'_>>) -> bool {
    let (Some(grant), Some((_, id))) = (grant, name.split_once('=')) else {
        return false;
    };
    grant.ids().contains(without_replica(id))
}

/// Removes the container's NVIDIA CDI devices that no device plugin gave it: in
/// the CRI field by name, and every `cdi.k8s.io/*` annotation that names one.
fn unbacked_cdi(
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

/// Sets every device key once (see the module docs): `NVIDIA_VISIBLE_DEVICES` to
/// `visible`; the other device variables to the plugin's value when `grant` is a
/// kept device-plugin grant that set one (unless the pod switched it off), else
/// off; device-list mounts other than the grant's removed.
fn device_env(
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

fn resolve_gpus<'a>(
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

fn device(config: &GpuHookConfig, name: &str) -> DeviceNode {
    DeviceNode {
        container_path: format!("/dev/{name}"),
        host_path: config.device_root.join(name).to_string_lossy().into_owned(),
        permissions: "rwm".into(),
    }
}

fn env_mode(
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

fn cdi_mode(
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
fn remove_gpu_nodes(
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
fn remove_plugin_cdi(
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
fn limiter_env(
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
fn remove_envs_where(
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
const KUBESHARE_REQUEST: &str = "lsalab.nthu/gpu_request";
const KUBESHARE_LIMIT: &str = "lsalab.nthu/gpu_limit";

/// The compute a shared container may use, in percent of each GPU: its core
/// share, or KubeShare's burst ceiling above it (the request is booked, compute
/// capped at the limit). `None` for a memory-only share: no compute limit.
fn compute_percent<S: std::hash::BuildHasher>(
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
fn kubeshare_ceiling<S: std::hash::BuildHasher>(
    annotations: &std::collections::HashMap<String, String, S>,
) -> Option<u64> {
    annotations.get(KUBESHARE_REQUEST)?;
    let limit: f64 = annotations.get(KUBESHARE_LIMIT)?.trim().parse().ok()?;
    (limit > 0.0 && limit <= 1.0).then(|| (limit * 100.0).round() as u64)
}

/// Adds the RDMA devices granted to the container (with their virtual functions)
/// and the connection manager.
fn add_rdma(
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

#[cfg(test)]
mod tests;
