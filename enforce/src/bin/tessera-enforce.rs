//! `tessera-enforce`: the node's share holders.
//!
//! - `memory-limits`: the OCI hook that puts a shared container's GPU memory
//!   limits in force before its first process runs. The runtime runs it from the
//!   CDI spec tessera-runtime-proxy writes (see `tessera_enforce::cdi`); a failure
//!   fails the container's creation.
//! - `mps-daemon`: runs and supervises the node's MPS v3 control daemon (the
//!   `tessera-mps` systemd unit), see `tessera_enforce::mps`.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tessera_enforce::nvml::NvmlMemoryLimits;
use tessera_enforce::{MemoryLimit, cgroup, hook_memory_limits, parse_limit};

#[derive(Debug, Parser)]
#[command(
    name = "tessera-enforce",
    version,
    about = "Holds shared containers to their GPU share: the OCI hook that sets a container's GPU memory limit (run by the container runtime), the node's supervised MPS daemon, and the writer of HAMi-core's per-container region (run by the GPU hook)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// As a createRuntime hook: reads the OCI state on stdin, finds the container's
    /// cgroup from its process, sets each GPU's hard (and soft) memory limit there
    /// through NVML (r615 or later) and reads it back. Exits non-zero, so the
    /// container does not start, when any limit is not in force.
    MemoryLimits {
        /// The NVML library to load.
        #[arg(long, value_name = "PATH", default_value = "libnvidia-ml.so.1")]
        nvml_library: PathBuf,
        /// A GPU's limit, GPU-UUID=BYTES; repeat for each GPU.
        #[arg(long = "limit", value_name = "UUID=BYTES", required = true, value_parser = parse_limit)]
        limits: Vec<MemoryLimit>,
    },
    /// Runs NVIDIA's MPS control daemon (v3, multi-user) in the foreground and
    /// starts it again whenever it exits, each time with every namespace the
    /// runtime proxy keeps in --state-dir. Stops it (and its servers) on SIGTERM.
    /// The runtime proxy (--mps) makes the servers and namespaces.
    MpsDaemon {
        /// NVIDIA's control program (in the driver's bin directory).
        #[arg(long, value_name = "PATH", default_value = "nvidia-cuda-mps-control")]
        control: PathBuf,
        /// The daemon's pipe directory; the same as the proxy's --mps-pipe-dir.
        #[arg(long, value_name = "DIR", default_value = tessera_enforce::mps::DEFAULT_PIPE_DIR)]
        pipe_dir: PathBuf,
        /// The daemon's log directory.
        #[arg(long, value_name = "DIR", default_value = "/var/log/tessera-mps")]
        log_dir: PathBuf,
        /// Where the runtime proxy keeps its namespaces (<its --enforcement-dir>/mps).
        #[arg(long, value_name = "DIR", default_value = tessera_enforce::mps::DEFAULT_STATE_DIR)]
        state_dir: PathBuf,
        /// The NVML library, through which each GPU holding shares is made
        /// exclusive-process (and handed back to DEFAULT when it holds none).
        #[arg(long, value_name = "PATH", default_value = "libnvidia-ml.so.1")]
        nvml_library: PathBuf,
    },
    /// Run by the GPU hook at CreateContainer, with HAMi-core's libvgpu.so in
    /// LD_PRELOAD and a shared container's grant as its env: has HAMi-core write
    /// the container's shared region (its limits) before the container's first
    /// process runs, and checks that it did. Not for use by hand.
    HamiPrime {
        /// The container's region file on the host (also in
        /// CUDA_DEVICE_MEMORY_SHARED_CACHE).
        #[arg(long, value_name = "PATH")]
        region: PathBuf,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::MemoryLimits {
            nvml_library,
            limits,
        } => memory_limits(&nvml_library, &limits),
        Command::MpsDaemon {
            control,
            pipe_dir,
            log_dir,
            state_dir,
            nvml_library,
        } => mps_daemon(
            tessera_enforce::mps::DaemonConfig {
                control,
                pipe_dir,
                log_dir,
                state_dir,
                min_backoff: std::time::Duration::from_secs(1),
                max_backoff: std::time::Duration::from_secs(30),
            },
            &nvml_library,
        ),
        Command::HamiPrime { region } => match tessera_enforce::hami::prime_here(&region) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("tessera-enforce hami-prime: {error}");
                ExitCode::FAILURE
            }
        },
    }
}

fn mps_daemon(config: tessera_enforce::mps::DaemonConfig, nvml: &std::path::Path) -> ExitCode {
    tessera_daemon::binary::init_logging("info");
    let compute = match tessera_enforce::compute::NvmlComputeMode::open(nvml) {
        Ok(compute) => compute,
        Err(error) => {
            tracing::error!(%error, "MPS daemon not started: NVML is needed to make GPUs exclusive-process");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("tessera-enforce mps-daemon: {error}");
            return ExitCode::FAILURE;
        }
    };
    let stop = async {
        if let Err(error) = tessera_daemon::binary::shutdown_signal().await {
            tracing::error!(%error, "cannot wait for SIGTERM; stopping");
        }
    };
    match runtime.block_on(tessera_enforce::mps::supervise(&config, &compute, stop)) {
        Ok(starts) => {
            tracing::info!(starts, "stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            tracing::error!(%error, "MPS daemon not running");
            ExitCode::FAILURE
        }
    }
}

fn memory_limits(nvml_library: &std::path::Path, limits: &[MemoryLimit]) -> ExitCode {
    let run = || -> anyhow::Result<PathBuf> {
        let mut state = Vec::new();
        std::io::stdin().read_to_end(&mut state)?;
        let limiter = NvmlMemoryLimits::open(nvml_library)?;
        Ok(hook_memory_limits(
            &state,
            limits,
            &limiter,
            std::path::Path::new("/proc"),
            &cgroup::host_v2_mount(),
        )?)
    };
    match run() {
        Ok(cgroup) => {
            let set: Vec<String> = limits
                .iter()
                .map(|l| format!("{}={}", l.uuid, l.bytes))
                .collect();
            eprintln!(
                "tessera-enforce: GPU memory limits {} in force on {}",
                set.join(","),
                cgroup.display()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            // runc puts a failing hook's stderr in the error kubelet reports.
            eprintln!(
                "tessera-enforce: GPU memory limits not in force, container not started: {error:#}"
            );
            ExitCode::FAILURE
        }
    }
}
