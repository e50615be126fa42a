//! Resource, annotation and label names.

/// Percent of one GPU's compute; 100 is a whole GPU.
pub const GPU_CORE: &str = "koordinator.sh/gpu-core";
/// GPU memory in bytes.
pub const GPU_MEMORY: &str = "koordinator.sh/gpu-memory";
/// Percent of one GPU's memory; 100 is a whole GPU's memory.
pub const GPU_MEMORY_RATIO: &str = "koordinator.sh/gpu-memory-ratio";
/// Shorthand for core + memory ratio.
pub const GPU_SHARED: &str = "koordinator.sh/gpu";
/// `koordinator.sh/gpu.shared` (Koordinator's `ResourceGPUShared`): how many GPUs a
/// share is spread over; `gpu-core`, `gpu-memory` and `gpu-memory-ratio` are then
/// totals, divided evenly among them.
pub const GPU_SHARED_COUNT: &str = "koordinator.sh/gpu.shared";
/// Whole GPUs, as the NVIDIA device plugin names them.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
/// Koordinator's deprecated `kubernetes.io/` GPU names, each with the name that
/// replaced it (`apis/extension/deprecated.go`). No `kubernetes.io/` resource is an
/// extended resource, so kube-scheduler never hands one to an extender: refused.
pub const DEPRECATED_GPU_NAMES: &[(&str, &str)] = &[
    ("kubernetes.io/gpu", GPU_SHARED),
    ("kubernetes.io/gpu-core", GPU_CORE),
    ("kubernetes.io/gpu-memory", GPU_MEMORY),
    ("kubernetes.io/gpu-memory-ratio", GPU_MEMORY_RATIO),
];

/// Names that look like Koordinator's but are served by nothing, and the name
/// meant: `koordinator.sh/gpu-shared`, as Koordinator's v1.6 release blog spells
/// `gpu.shared`. Left alone, such a pod waits forever on "Insufficient …".
pub const MISSPELLED_GPU_NAMES: &[(&str, &str)] =
    &[("koordinator.sh/gpu-shared", GPU_SHARED_COUNT)];

/// Pod annotation holding the scheduler's device allocation.
pub const DEVICE_ALLOCATED: &str = "scheduling.koordinator.sh/device-allocated";
/// Device CR annotation listing GPUs held by legacy (device-plugin) pods.
pub const DEVICES_CHECKPOINTS: &str = "node.koordinator.sh/devices-checkpoints";
/// Device CR annotation naming each GPU's NVLink peers ([`crate::nvlink`]).
pub const NVLINK_PEERS: &str = "tessera.io/nvlink-peers";

/// Which enforcement backends hold a share: on a shared container (its OCI spec's
/// annotations, set by the GPU hook) the ones that hold it, and on the Device CR the
/// ones the node has; `+`-joined names (`driver-memory+hami-core`), or `none`.
pub const ENFORCEMENT: &str = "tessera.io/enforcement";

/// The taint a node carries while its switch to the runtime proxy is unproven
/// (set and lifted by `tessera node switch-over` and the node installer): no GPU
/// hook runs there yet.
pub const SWITCH_TAINT: &str = "tessera.io/runtime-proxy";
/// Device CR annotation and Node label: `"true"` while the node carries
/// [`SWITCH_TAINT`]; tessera-scheduler then places no GPU pod there, whatever the
/// pod tolerates.
pub const SWITCH_UNPROVEN: &str = "tessera.io/switch-unproven";

/// Device type key of GPUs in the allocation annotation.
pub const DEVICE_TYPE_GPU: &str = "gpu";
/// Device type key of RDMA devices in the allocation annotation.
pub const DEVICE_TYPE_RDMA: &str = "rdma";

/// Label of the GPU model (label-safe, e.g. `NVIDIA-H100-80GB-HBM3`): on the node, as
/// Koordinator names it, and on each GPU of the Device CR (`spec.devices[].labels`), where
/// Koordinator's `device-allocate-hint` selectors and HAMi's `use-gputype` match it.
pub const LABEL_GPU_MODEL: &str = "node.koordinator.sh/gpu-model";
/// Node label of the driver version.
pub const LABEL_DRIVER_VERSION: &str = "node.koordinator.sh/gpu-driver-version";

/// `text` as a label value: characters other than ASCII letters, digits, `-`, `_`
/// and `.` become `-`, the ends start and stop with a letter or digit, at most 63
/// characters. `NVIDIA H100 80GB HBM3` is `NVIDIA-H100-80GB-HBM3`.
pub fn label_value(text: &str) -> String {
    let mapped: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    let mut value: String = mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(63)
        .collect();
    // Cutting at 63 may leave a separator at the end, which a label may not have.
    while value.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        value.pop();
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_label_safe() {
        assert_eq!(
            label_value("NVIDIA H100 80GB HBM3"),
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(
            label_value(" Tesla V100-SXM2-16GB "),
            "Tesla-V100-SXM2-16GB"
        );
        assert_eq!(label_value("550.54.15"), "550.54.15");
        let long = format!("{}-x", "a".repeat(62));
        assert_eq!(label_value(&long), "a".repeat(62));
    }
}
