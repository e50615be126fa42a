//! `tessera-scheduler`: the command line, and each command over the library
//! (`serve`: config → build → run; `certs`; `simulate`).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use tessera_allocator::allocate::Policy;
use tessera_api::request::{MemoryUnit, RequestOptions};

mod certs;
mod serve;
mod simulate;

/// A kube-scheduler extender that shares GPUs: it picks GPUs per node by UUID and
/// writes scheduling.koordinator.sh/device-allocated on the pod before binding it.
#[derive(Debug, Parser)]
#[command(name = "tessera-scheduler", version)]
struct Cli {
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, value_name = "text|json", env = tessera_daemon::binary::LOG_FORMAT_ENV, default_value_t = tessera_daemon::binary::LogFormat::Text, global = true)]
    log_format: tessera_daemon::binary::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args, Clone, Copy)]
pub(crate) struct PolicyArgs {
    /// Which GPU on a node: binpack (fullest that fits) or spread (emptiest).
    #[arg(long, value_enum, default_value_t = Policy::Binpack)]
    pub(crate) gpu_policy: Policy,
    /// Which node (prioritize scores): binpack or spread.
    #[arg(long, value_enum, default_value_t = Policy::Binpack)]
    pub(crate) node_policy: Policy,
    /// Bytes in one unit of volcano.sh/gpu-memory.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    volcano_memory_unit: u64,
    /// The unit of aliyun.com/gpu-mem: GiB, as gpushare's device plugin counts by
    /// default, or MiB for clusters whose gpushare ran with --memory-unit=MiB.
    #[arg(long, value_name = "MiB|GiB", default_value_t = MemoryUnit::GiB)]
    gpushare_memory_unit: MemoryUnit,
    /// The most GPUs the sharing groups of one namespace may hold at once. A group
    /// closes its GPU to every other pod, however small its pods' shares, while
    /// ResourceQuota counts only the shares; a new group past this waits. 0: no
    /// sharing groups.
    #[arg(long, value_name = "N", default_value_t = tessera_allocator::allocate::GROUP_GPUS_PER_NAMESPACE)]
    pub(crate) max_group_gpus_per_namespace: u32,
}

impl PolicyArgs {
    pub(crate) fn request_options(&self) -> RequestOptions {
        RequestOptions {
            volcano_memory_unit: self.volcano_memory_unit,
            gpushare_memory_unit: self.gpushare_memory_unit,
        }
    }
}
// Parsed once at startup: the size of `Serve` costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the extender API (POST /filter, /prioritize, /bind; GET /healthz, /readyz).
    ///
    /// Over mutual TLS (--tls-cert-file, --tls-key-file, --client-ca-file): every
    /// client presents a certificate signed by the client CA; only
    /// --bind-client-name may bind. Plain HTTP only on loopback (tessera-scheduler
    /// beside kube-scheduler in one pod), or anywhere with --insecure-listen.
    ///
    /// Replicas elect one leader through a Lease; only it binds. On SIGTERM or
    /// SIGINT the leader stops binding, lets running binds end (5 s at most) and
    /// releases the Lease, so the next leader takes over at its next round.
    Serve(serve::ServeArgs),
    /// Write a CA and the extender's certificates (PEM) into a directory: ca.crt and
    /// ca.key; tessera-scheduler.crt/.key (CN tessera-scheduler, the Service's DNS
    /// names; serving and client); tessera-kube-scheduler.crt/.key (CN
    /// tessera-kube-scheduler, client). Existing files are not overwritten.
    Certs {
        /// The directory (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The namespace of the extender's Service.
        #[arg(long, default_value = "tessera-system")]
        namespace: String,
        /// The extender's Service.
        #[arg(long, default_value = "tessera-scheduler")]
        service: String,
        /// Days the CA and the certificates are valid.
        #[arg(long, default_value_t = 365)]
        days: i64,
    },
    /// Place pending pods on a cluster snapshot and print each pod's node and
    /// annotation, or why it fits nowhere.
    Simulate(simulate::SimulateArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tessera_daemon::binary::init_logging_as("info", cli.log_format);
    let outcome = match cli.command {
        Command::Serve(args) => serve::run(args).await,
        Command::Certs {
            out,
            namespace,
            service,
            days,
        } => certs::write(&out, &service, &namespace, days),
        Command::Simulate(args) => simulate::run(args),
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "tessera-scheduler: {}",
                tessera_daemon::binary::error_chain(error.as_ref())
            );
            std::process::ExitCode::FAILURE
        }
    }
}
