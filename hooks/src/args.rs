//! The GPU hook's command-line settings, shared by `tessera-gpu-hook` and the
//! runtime proxy that embeds the hook.

use std::path::PathBuf;

use crate::gpu::{GpuHookConfig, GpuMode, PrivilegedPolicy, TrustedGpuAgent};
use crate::probe::ProbePaths;

/// GPU hook flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuHookArgs {
    /// Host directory holding the nvidia* device nodes.
    #[arg(long, value_name = "DIR", default_value = "/dev")]
    pub device_root: PathBuf,
    /// Directory of the driver's per-GPU information files (UUID → minor), used
    /// when present; otherwise the annotation's minors are trusted.
    #[arg(long, value_name = "DIR", default_value = "/proc/driver/nvidia/gpus")]
    pub driver_gpus: PathBuf,
    /// How GPUs reach containers: env (NVIDIA_VISIBLE_DEVICES + /dev/nvidia* nodes) or
    /// cdi (nvidia.com/gpu=<UUID> CDI devices).
    #[arg(long, value_enum, default_value_t = GpuMode::Env)]
    pub gpu_mode: GpuMode,
    /// Do not set CUDA_DEVICE_MEMORY_LIMIT_<i> / CUDA_DEVICE_SM_LIMIT for fractional GPUs.
    #[arg(long)]
    pub no_limiter_env: bool,
    /// NVIDIA_VISIBLE_DEVICES for containers of pods with no allocation.
    #[arg(long, value_name = "VALUE", default_value = "void")]
    pub unallocated_visible_devices: String,
    /// Leave containers of pods with no allocation untouched.
    #[arg(long)]
    pub keep_unallocated: bool,
    /// NVML library for the UUID → minor inventory (first choice; --driver-gpus is
    /// the fallback when it does not load).
    #[arg(long, value_name = "PATH", default_value = "libnvidia-ml.so.1")]
    pub nvml_library: PathBuf,
    /// kubelet's device checkpoint. A container of a pod with no allocation keeps an
    /// NVIDIA_VISIBLE_DEVICES naming GPUs only when this records a device plugin
    /// giving it those GPUs; a missing file means no plugin gave any.
    #[arg(long, value_name = "PATH", default_value = crate::probe::KUBELET_CHECKPOINT)]
    pub kubelet_checkpoint: PathBuf,
    /// Pods that keep the device env they were given (NVIDIA_VISIBLE_DEVICES=all and
    /// the toolkit's other variables) although they hold no Tessera allocation:
    /// NVIDIA's own agents (device plugin, dcgm-exporter, GPU feature discovery, GPU
    /// Operator validators). Each entry is NAMESPACE (every pod of it) or
    /// NAMESPACE:KEY=VALUE (its pods with that label); repeat the flag or separate
    /// entries with ','. Trust is by namespace, an RBAC boundary, because anyone who
    /// may create pods can set a label. The GPU Operator installs into gpu-operator;
    /// the device plugin's Helm chart into nvidia-device-plugin, its static manifest
    /// into kube-system (label name=nvidia-device-plugin-ds). A pod with an allocation
    /// still gets exactly its grant [default: none]
    #[arg(long, value_name = "NAMESPACE[:KEY=VALUE]", value_delimiter = ',')]
    pub trusted_gpu_agents: Vec<TrustedGpuAgent>,
    /// Privileged containers on a node with GPUs (they see every GPU device whatever
    /// the hook does): refuse-gpu refuses those that ask for GPUs (env, device plugin,
    /// CDI) unless trusted; refuse refuses every one not trusted; allow lets all run.
    /// Under refuse-gpu and refuse, a privileged container the scheduler granted GPUs
    /// is always refused [default: refuse-gpu]
    #[arg(long, value_enum, value_name = "POLICY")]
    pub privileged: Option<PrivilegedPolicy>,
}

impl Default for GpuHookArgs {
    fn default() -> Self {
        Self {
            device_root: "/dev".into(),
            driver_gpus: "/proc/driver/nvidia/gpus".into(),
            gpu_mode: GpuMode::Env,
            no_limiter_env: false,
            unallocated_visible_devices: "void".into(),
            keep_unallocated: false,
            nvml_library: "libnvidia-ml.so.1".into(),
            kubelet_checkpoint: crate::probe::KUBELET_CHECKPOINT.into(),
            trusted_gpu_agents: Vec::new(),
            privileged: None,
        }
    }
}

impl GpuHookArgs {
    /// The hook settings these flags describe.
    pub fn config(&self) -> GpuHookConfig {
        GpuHookConfig {
            device_root: self.device_root.clone(),
            mode: self.gpu_mode,
            limiter_env: !self.no_limiter_env,
            unallocated_visible_devices: (!self.keep_unallocated)
                .then(|| self.unallocated_visible_devices.clone()),
            trusted_agents: self.trusted_gpu_agents.clone(),
            privileged: self.privileged.unwrap_or_default(),
            ..GpuHookConfig::default()
        }
    }

    /// The node probe these flags describe (NVML first, then /proc).
    pub fn probe(&self) -> crate::probe::HostProbe {
        crate::probe::HostProbe::with_nvml(self.probe_paths(), &self.nvml_library)
    }

    /// Where the probe reads the node.
    pub fn probe_paths(&self) -> ProbePaths {
        ProbePaths {
            device_root: self.device_root.clone(),
            driver_gpus: self.driver_gpus.clone(),
            kubelet_checkpoint: self.kubelet_checkpoint.clone(),
        }
    }
}
