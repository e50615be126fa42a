//! Resource, annotation and label names.

/// Percent of one GPU's compute; 100 is a whole GPU.
pub const GPU_CORE: &str = "koordinator.sh/gpu-core";
/// GPU memory in bytes.
pub const GPU_MEMORY: &str = "koordinator.sh/gpu-memory";
/// Percent of one GPU's memory; 100 is a whole GPU's memory.
pub const GPU_MEMORY_RATIO: &str = "koordinator.sh/gpu-memory-ratio";
/// Shorthand for core + memory ratio.
pub const GPU_SHARED: &str = "koordinator.sh/gpu";
/// Whole GPUs, as the NVIDIA device plugin names them.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";

/// Pod annotation holding the scheduler's device allocation.
pub const DEVICE_ALLOCATED: &str = "scheduling.koordinator.sh/device-allocated";
/// Device CR annotation listing GPUs held by legacy (device-plugin) pods.
pub const DEVICES_CHECKPOINTS: &str = "node.koordinator.sh/devices-checkpoints";

/// Device type key of GPUs in the allocation annotation.
pub const DEVICE_TYPE_GPU: &str = "gpu";
/// Device type key of RDMA devices in the allocation annotation.
pub const DEVICE_TYPE_RDMA: &str = "rdma";
