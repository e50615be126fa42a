//! Why a container cannot be given its GPUs: each refusal names the pod, the
//! annotation, the field and value, and the container.

use super::*;

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
    /// A claim of Tessera's own DRA driver that the node cannot honour: its CDI
    /// device names no claim prepared for this pod, or the pod also carries the
    /// scheduler's allocation annotation (two books for one pod).
    #[error("pod {pod}: container {container}: {problem}")]
    TesseraClaim {
        /// `namespace/name`.
        pod: String,
        /// The container being created.
        container: String,
        /// What is wrong, naming the device or claims.
        problem: String,
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
pub(super) fn privileged_hint(reason: &PrivilegedReason) -> &'static str {
    match reason {
        PrivilegedReason::Allocated => "drop privileged from the container",
        PrivilegedReason::AsksForGpus(_) | PrivilegedReason::Untrusted => {
            "drop privileged, or run it in a namespace named by --trusted-gpu-agents"
        }
    }
}
