//! The node's enforcement, set up once at start: which backends this node can
//! hold shares with (the driver's memory limits, MPS, GPU time, HAMi-core) and
//! what the runtime says of its CDI support.

use super::*;

pub(super) const STATUS: &str = "/runtime.v1.RuntimeService/Status";

/// What the runtime says of its CDI support (its verbose Status `config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeCdi {
    /// `enable_cdi`.
    pub enabled: bool,
    /// `cdi_spec_dirs`, lowest priority first.
    pub spec_dirs: Vec<PathBuf>,
}

impl RuntimeCdi {
    /// Reads containerd's CRI config, as its verbose Status reports it under
    /// `info["config"]` (`enableCDI`, `cdiSpecDirs`). A runtime that reports
    /// neither (containerd 1.6, which has no CDI) has it off.
    pub fn from_status(status: &cri::StatusResponse) -> Self {
        let config: serde_json::Value = status
            .info
            .get("config")
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        let enabled = config
            .get("enableCDI")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        let spec_dirs = config
            .get("cdiSpecDirs")
            .and_then(serde_json::Value::as_array)
            .map(|dirs| {
                dirs.iter()
                    .filter_map(|d| d.as_str().map(PathBuf::from))
                    .collect()
            })
            .unwrap_or_default();
        Self { enabled, spec_dirs }
    }

    /// The directory to write in: the runtime's last (highest priority) one.
    pub fn spec_dir(&self) -> Option<&Path> {
        self.spec_dirs.last().map(PathBuf::as_path)
    }
}

/// Where the runtime's CDI support comes from: the runtime, asked once.
#[async_trait]
pub trait CdiSource: Send + Sync + std::fmt::Debug {
    /// The runtime's CDI support.
    async fn runtime_cdi(&self) -> Result<RuntimeCdi, String>;
}

#[async_trait]
impl CdiSource for Backend {
    async fn runtime_cdi(&self) -> Result<RuntimeCdi, String> {
        let status: cri::StatusResponse = self
            .unary(STATUS, &cri::StatusRequest { verbose: true })
            .await
            .map_err(|e| format!("asking the runtime for its status: {}", e.message))?;
        Ok(RuntimeCdi::from_status(&status))
    }
}

/// The driver-memory part: the hook command and where the runtime's CDI is.
#[derive(Debug)]
pub struct DriverMemory {
    /// What the CDI hook runs.
    pub hook: HookCommand,
    /// The runtime, asked for its CDI support.
    pub runtime: Arc<dyn CdiSource>,
    /// A CDI directory that overrides the runtime's own (`--cdi-spec-dir`).
    pub spec_dir: Option<PathBuf>,
}

/// Why the node's enforcement could not be set up as configured.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// `--gpu-memory-limits=on` on a node whose driver cannot.
    #[error("--gpu-memory-limits=on: {0}")]
    DriverMemory(String),
    /// The tessera-enforce binary is not where it should be.
    #[error(
        "GPU memory limits: the tessera-enforce hook binary {0} is not a file (--enforce-binary)"
    )]
    HookBinary(PathBuf),
    /// HAMi-core's files could not be laid out.
    #[error("--hami-core-library: {0}")]
    HamiCore(std::io::Error),
    /// `--mps=on` on a node whose MPS daemon does not answer.
    #[error("--mps=on: {0}")]
    Mps(String),
    /// `--gpu-time=on` on a node that cannot hold GPU time.
    #[error("--gpu-time=on: {0}")]
    GpuTime(String),
    /// `--oom-kill=on` on a node whose GPUs' processes cannot be read.
    #[error("--oom-kill=on: {0}")]
    OomKill(String),
    /// The node's backends could not be written for the reporter.
    #[error("writing {0} (--enforcement-dir): {1}")]
    BackendsFile(PathBuf, std::io::Error),
}

/// The node's enforcement, as [`node`] set it up.
#[derive(Debug)]
pub struct NodeEnforcement {
    /// What the GPU hook puts on shared containers.
    pub enforcement: Enforcement,
    /// Driver memory limits, when on.
    pub driver: Option<DriverMemory>,
    /// MPS, when on.
    pub mps: Option<Mps>,
    /// The GPU-time hold, when on (not yet ticking).
    pub gpu_time: Option<GpuTimeHold>,
    /// What reads each container's GPU memory (and, with the OOM kill on, kills),
    /// where NVML loads.
    pub usage: Option<crate::usage::Sampler>,
}

/// The node's enforcement from the GPU hook's flags: driver memory limits where
/// NVML has them (`auto`) or as required (`on`), HAMi-core's files installed.
pub fn node(
    args: &tessera_hooks::args::GpuHookArgs,
    runtime: Arc<dyn CdiSource>,
) -> Result<NodeEnforcement, SetupError> {
    use tessera_hooks::args::Switch;
    let hami_core = args.hami_core_files();
    if let Some(files) = &hami_core {
        files.install().map_err(SetupError::HamiCore)?;
    }
    let driver_memory = match args.gpu_memory_limits {
        Switch::Off => false,
        Switch::Auto | Switch::On => {
            match tessera_enforce::nvml::NvmlMemoryLimits::open(&args.nvml_library) {
                Ok(_) => true,
                Err(error) if args.gpu_memory_limits == Switch::On => {
                    return Err(SetupError::DriverMemory(error.to_string()));
                }
                Err(error) => {
                    tracing::info!(%error, "GPU memory limits off: the driver does not support them");
                    false
                }
            }
        }
    };
    let driver = if driver_memory {
        let binary = args.enforce_binary_path();
        if !binary.is_file() {
            if args.gpu_memory_limits == Switch::On {
                return Err(SetupError::HookBinary(binary));
            }
            tracing::warn!(binary = %binary.display(), "GPU memory limits off: the driver supports them, but the tessera-enforce hook binary is not there (--enforce-binary)");
            None
        } else {
            Some(DriverMemory {
                hook: HookCommand {
                    binary,
                    nvml_library: args.nvml_library.clone(),
                },
                runtime,
                spec_dir: args.cdi_spec_dir.clone(),
            })
        }
    } else {
        None
    };
    let mps = node_mps(args)?;
    let grants = args.enforcement_dir.join("gpu-time");
    let gpu_time = match args.gpu_time {
        Switch::Off => None,
        Switch::Auto | Switch::On => match GpuTimeHold::open(&args.nvml_library, &grants) {
            Ok(hold) => Some(hold),
            Err(error) if args.gpu_time == Switch::On => {
                return Err(SetupError::GpuTime(error));
            }
            Err(error) => {
                tracing::info!(%error, "GPU time off: the node cannot hold it");
                None
            }
        },
    };
    // Off now, on before: what it held goes free, none left frozen.
    if gpu_time.is_none() {
        let freed = tessera_enforce::throttle::thaw_leftovers(
            &grants,
            &tessera_enforce::throttle::CgroupFreezer,
        );
        if freed > 0 {
            tracing::info!(
                containers = freed,
                "GPU time is off: the containers it held before are let go"
            );
        }
    }
    let (usage, oom_kill) = node_usage(args)?;
    let enforcement = Enforcement {
        driver_memory: driver.is_some(),
        mps: mps.as_ref().map(|m| tessera_hooks::gpu::MpsFiles {
            pipe_dir: m.pipe_dir().to_owned(),
        }),
        gpu_time: gpu_time.is_some(),
        oom_kill,
        hami_core,
    };
    let backends = tessera_enforce::joined(&enforcement.backends());
    tracing::info!(%backends, "share enforcement");
    // For tessera-reporter, which publishes it (Device CR, GPU labels): written whole.
    let file = args.enforcement_dir.join("backends");
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(&args.enforcement_dir)?;
        let temp = args.enforcement_dir.join(".backends.tmp");
        std::fs::write(&temp, format!("{backends}\n"))?;
        std::fs::set_permissions(&temp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        std::fs::rename(&temp, &file)
    };
    write().map_err(|e| SetupError::BackendsFile(file.clone(), e))?;
    Ok(NodeEnforcement {
        enforcement,
        driver,
        mps,
        gpu_time,
        usage,
    })
}

/// The reader of each container's GPU memory, where NVML loads, and whether it
/// kills (`--oom-kill`).
pub(super) fn node_usage(
    args: &tessera_hooks::args::GpuHookArgs,
) -> Result<(Option<crate::usage::Sampler>, bool), SetupError> {
    use tessera_hooks::args::Switch;
    let mut sampler = match crate::usage::Sampler::open(&args.nvml_library) {
        Ok(sampler) => sampler,
        Err(error) if args.oom_kill == Switch::On => return Err(SetupError::OomKill(error)),
        Err(error) => {
            tracing::info!(%error, "GPU memory use not read: neither reported nor held by the OOM kill");
            return Ok((None, false));
        }
    };
    if args.oom_kill == Switch::Off {
        return Ok((Some(sampler), false));
    }
    match sampler.kill_host_processes() {
        Ok(()) => Ok((Some(sampler), true)),
        Err(error) if args.oom_kill == Switch::On => Err(SetupError::OomKill(error)),
        Err(error) => {
            tracing::info!(%error, "OOM kill off: the node's processes cannot be found by container");
            Ok((Some(sampler), false))
        }
    }
}

/// How often the MPS daemon is asked at start (every 0.5 s) before `--mps`
/// gives up on it.
pub(super) const PROBE_TRIES: u32 = 20;

/// The node's MPS, from `--mps`: its daemon must answer, and NVML must load (it
/// sets the GPUs' compute mode).
pub(super) fn node_mps(args: &tessera_hooks::args::GpuHookArgs) -> Result<Option<Mps>, SetupError> {
    use tessera_hooks::args::Switch;
    if args.mps == Switch::Off {
        return Ok(None);
    }
    let open = || -> Result<Mps, String> {
        let compute = tessera_enforce::compute::NvmlComputeMode::open(&args.nvml_library)
            .map_err(|e| e.to_string())?;
        let mps = Mps::new(
            Arc::new(mps::ControlProgram {
                binary: args.mps_control.clone(),
                pipe_dir: args.mps_pipe_dir.clone(),
            }),
            Arc::new(compute),
            args.mps_pipe_dir.clone(),
            args.enforcement_dir.join("mps"),
        );
        // The MPS unit may still be starting its daemon (both start at boot).
        let mut tries = 0;
        while let Err(error) = mps.probe() {
            tries += 1;
            if tries >= PROBE_TRIES {
                return Err(format!(
                    "{error} (is the node's MPS daemon, tessera-enforce mps-daemon, running with --pipe-dir {}?)",
                    args.mps_pipe_dir.display()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        Ok(mps)
    };
    match open() {
        Ok(mps) => Ok(Some(mps)),
        Err(error) if args.mps == Switch::On => Err(SetupError::Mps(error)),
        Err(error) => {
            tracing::warn!(%error, "MPS off: the node's MPS daemon does not answer");
            Ok(None)
        }
    }
}
