//! The GPU hook's command-line settings, shared by `tessera-gpu-hook` and the
//! runtime proxy that embeds the hook.

use std::path::PathBuf;

use crate::gpu::{
    Enforcement, GpuHookConfig, GpuMode, HamiCoreFiles, PrivilegedPolicy, TrustedGpuAgent,
};
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
    /// The driver's per-cgroup GPU memory limits (NVML r615 and later): each shared
    /// container's cgroup gets its granted bytes on each of its GPUs before its first
    /// process runs, and a container whose limit cannot be set is not started. auto:
    /// on where the NVML library has the calls and the driver answers them; on: the
    /// proxy does not start without them; off: never. The external tessera-gpu-hook
    /// cannot set them (only the proxy sees StartContainer)
    #[arg(long, value_enum, value_name = "auto|on|off", default_value_t = Switch::Auto)]
    pub gpu_memory_limits: Switch,
    /// HAMi-core's libvgpu.so on the host (from HAMi's image; Tessera does not ship
    /// it): each shared container gets it read-only at /usr/local/vgpu/libvgpu.so,
    /// named in a read-only /etc/ld.so.preload (so LD_PRELOAD stays the user's), with
    /// its own HAMi-core directory and the node's lock directory. It holds memory and
    /// compute inside the container's processes: see docs/enforcement.md for what a
    /// process can still do [default: none]
    #[arg(long, value_name = "PATH")]
    pub hami_core_library: Option<PathBuf>,
    /// Host directory for the node's backends file (read by tessera-reporter),
    /// HAMi-core's preload list, lock directory and per-container directories
    /// (removed with their pod), and the MPS namespaces kept for the MPS daemon (mps/)
    #[arg(long, value_name = "DIR", default_value = "/run/tessera/enforce")]
    pub enforcement_dir: PathBuf,
    /// The tessera-enforce binary: the OCI hook the runtime runs to set GPU memory
    /// limits, and what writes each shared container's HAMi-core region with its
    /// grant before the container starts [default: tessera-enforce beside this
    /// program's own binary]
    #[arg(long, value_name = "PATH")]
    pub enforce_binary: Option<PathBuf>,
    /// CDI spec directory for the GPU memory limit hooks (runtime proxy only)
    /// [default: the last of the runtime's cdi_spec_dirs, as its Status reports them]
    #[arg(long, value_name = "DIR")]
    pub cdi_spec_dir: Option<PathBuf>,
    /// NVIDIA's MPS, v3 (driver r615 and later), for shared containers (runtime
    /// proxy only): each gets a namespace of its GPU's MPS server holding its
    /// compute share (and, as advice, its memory), with the GPU in exclusive-process
    /// mode while it holds shares. Needs the node's MPS daemon (tessera-enforce
    /// mps-daemon, the tessera-mps unit). off: never; auto: when the daemon answers
    /// at start; on: the proxy does not start without it. A shared container with
    /// shares of several GPUs is refused while it is on
    #[arg(long, value_enum, value_name = "auto|on|off", default_value_t = Switch::Off)]
    pub mps: Switch,
    /// Compute shares held as GPU time (runtime proxy only): each shared
    /// container's use of its GPUs, as NVML measures it per process, may not pass
    /// its compute share (over a 0.5 s burst); while it has used more, its cgroup is
    /// frozen. Needs a writable cgroup v2 hierarchy and NVML's per-process
    /// utilization. auto: on where both are; on: the proxy does not start without
    /// them; off: never
    #[arg(long, value_enum, value_name = "auto|on|off", default_value_t = Switch::Auto)]
    pub gpu_time: Switch,
    /// GPU memory held by an OOM kill (runtime proxy only): every 0.5 s the proxy
    /// reads each GPU's processes and their memory from NVML (any driver), and a
    /// shared container whose processes hold more of a GPU than its grant plus
    /// --oom-kill-margin loses its largest ones there (SIGKILL), as the kernel's OOM
    /// killer does past a memory limit. It counts every process, however it reached
    /// the GPU, but after the fact: an allocation past the grant stands for up to
    /// one reading. auto: on where NVML loads; on: the proxy does not start without
    /// it; off: never
    #[arg(long, value_enum, value_name = "auto|on|off", default_value_t = Switch::Auto)]
    pub oom_kill: Switch,
    /// What a shared container may hold of a GPU beyond its grant before the OOM
    /// kill acts, as a Kubernetes quantity: the driver counts each process's CUDA
    /// context (about 0.5 GiB on an H100), which a limiter in the container may
    /// not, and the allocator's rounding
    #[arg(long, value_name = "BYTES", default_value = "1Gi", value_parser = parse_bytes)]
    pub oom_kill_margin: u64,
    /// NVIDIA's MPS control program, through which the proxy makes servers and
    /// namespaces (runtime proxy only)
    #[arg(long, value_name = "PATH", default_value = "nvidia-cuda-mps-control")]
    pub mps_control: PathBuf,
    /// The MPS daemon's pipe directory: tessera-enforce mps-daemon's --pipe-dir
    /// (runtime proxy only)
    #[arg(long, value_name = "DIR", default_value = tessera_enforce::mps::DEFAULT_PIPE_DIR)]
    pub mps_pipe_dir: PathBuf,
}

/// A byte count written as a Kubernetes quantity (`1Gi`, `512Mi`, `1073741824`).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let quantity = tessera_api::quantity::Quantity::parse(text).map_err(|e| e.to_string())?;
    if quantity.milli_value() % 1000 != 0 {
        return Err(format!("{text:?} is not a whole number of bytes"));
    }
    Ok(quantity.value())
}

/// An on/off setting that can also follow what the node supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Switch {
    /// On where the node supports it.
    #[default]
    Auto,
    /// On; not starting without it.
    On,
    /// Off.
    Off,
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
            gpu_memory_limits: Switch::Auto,
            hami_core_library: None,
            enforcement_dir: "/run/tessera/enforce".into(),
            enforce_binary: None,
            cdi_spec_dir: None,
            mps: Switch::Off,
            gpu_time: Switch::Auto,
            oom_kill: Switch::Auto,
            oom_kill_margin: 1 << 30,
            mps_control: "nvidia-cuda-mps-control".into(),
            mps_pipe_dir: tessera_enforce::mps::DEFAULT_PIPE_DIR.into(),
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
            enforcement: Enforcement {
                driver_memory: false,
                mps: None,
                gpu_time: false,
                oom_kill: false,
                hami_core: self.hami_core_files(),
            },
            ..GpuHookConfig::default()
        }
    }

    /// HAMi-core's host files, when `--hami-core-library` names the library.
    pub fn hami_core_files(&self) -> Option<HamiCoreFiles> {
        self.hami_core_library.as_deref().map(|library| {
            HamiCoreFiles::under(
                &self.enforcement_dir.join("hami-core"),
                library,
                &self.enforce_binary_path(),
            )
        })
    }

    /// `--enforce-binary`, or `tessera-enforce` beside this program's binary.
    pub fn enforce_binary_path(&self) -> PathBuf {
        match &self.enforce_binary {
            Some(path) => path.clone(),
            None => std::env::current_exe()
                .ok()
                .and_then(|exe| exe.parent().map(|dir| dir.join("tessera-enforce")))
                .unwrap_or_else(|| PathBuf::from("/usr/local/bin/tessera-enforce")),
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
