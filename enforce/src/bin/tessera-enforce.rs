//! `tessera-enforce`: the OCI hook that puts a shared container's GPU memory
//! limits in force before its first process runs. The runtime runs it from the
//! CDI spec tessera-runtime-proxy writes (see `tessera_enforce::cdi`); a failure
//! fails the container's creation.

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
    about = "OCI hook: puts a shared container's GPU limits in force (run by the container runtime, not by hand)."
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
}

fn main() -> ExitCode {
    let Command::MemoryLimits {
        nvml_library,
        limits,
    } = Cli::parse().command;
    let run = || -> anyhow::Result<PathBuf> {
        let mut state = Vec::new();
        std::io::stdin().read_to_end(&mut state)?;
        let limiter = NvmlMemoryLimits::open(&nvml_library)?;
        Ok(hook_memory_limits(
            &state,
            &limits,
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
