use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kube::CustomResourceExt;
use kube::api::ObjectMeta;
use tessera_api::{Device, LegacyDeviceEntry};
use tessera_daemon::binary::LogFormat;
use tessera_daemon::metrics::MetricsListen;
use tessera_reporter::checkpoint::{CheckpointEntry, gpu_index, is_device_uuid, parse_checkpoint};
use tessera_reporter::events::{GpuEvents, KubeNodeEvents};
use tessera_reporter::gpu::{GpuSource, NodeGpus, NvmlSource, library_path};
use tessera_reporter::metrics::{DEFAULT_METRICS_ADDR, ReporterMetrics};
use tessera_reporter::publish::Publisher;
use tessera_reporter::report::{CapacityOptions, device_annotations, device_spec, legacy_entry};
use tessera_reporter::run::{LoopConfig, run_with_metrics};

const DEFAULT_CHECKPOINT: &str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint";

/// Publishes a GPU node's devices (the Device CR), its extended-resource capacity,
/// and the GPUs held by pods allocated by the NVIDIA device plugin (from kubelet's
/// checkpoint), so the Tessera scheduler never hands a GPU out twice.
#[derive(Debug, Parser)]
#[command(name = "tessera-reporter", version)]
struct Cli {
    /// The NVML library: a file name the loader finds, or a path [default: libnvidia-ml.so.1].
    #[arg(long, global = true, value_name = "PATH", env = "TESSERA_NVML_LIBRARY")]
    nvml_library: Option<PathBuf>,
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(
        long,
        global = true,
        value_name = "text|json",
        env = tessera_daemon::binary::LOG_FORMAT_ENV,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

// Parsed once, at start: the size of `Run` costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Print the Device CR this node would publish (YAML).
    Discover {
        /// The node's name [default: the host name].
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
    },
    /// Print the device-plugin allocations in kubelet's checkpoint (JSON), as the
    /// Device annotation node.koordinator.sh/devices-checkpoints lists them
    /// (before dropping pods that are gone or placed by Tessera).
    Checkpoint {
        /// The checkpoint file.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_CHECKPOINT)]
        file: PathBuf,
    },
    /// Print the Device CustomResourceDefinition (YAML), as deploy/crd-device.yaml holds it.
    Crd,
    /// Publish the Device CR and node capacity, and keep them current.
    Run {
        /// The node this reporter runs on.
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
        #[arg(long, value_name = "PATH")]
        kubeconfig: Option<PathBuf>,
        /// kubelet's device checkpoint.
        #[arg(long, value_name = "PATH", default_value = DEFAULT_CHECKPOINT)]
        checkpoint: PathBuf,
        /// Extended resources whose checkpoint entries are published (repeatable).
        #[arg(
            long = "legacy-resource",
            value_name = "NAME",
            default_value = "nvidia.com/gpu"
        )]
        legacy_resources: Vec<String>,
        /// Seconds between full resyncs.
        #[arg(long, value_name = "SECS", default_value_t = 30)]
        interval: u64,
        /// Do not advertise aliyun.com/gpu-mem, nvidia.com/gpumem, nvidia.com/gpucores, volcano.sh/gpu-memory.
        #[arg(long)]
        no_alias_resources: bool,
        /// Advertise nvidia.com/gpu (only where no NVIDIA device plugin serves it).
        #[arg(long)]
        advertise_nvidia_gpu: bool,
        /// With --advertise-nvidia-gpu: nvidia.com/gpu slots per GPU, as HAMi's
        /// deviceSplitCount (10 in HAMi), so that pods asking nvidia.com/gpu: 1 with
        /// nvidia.com/gpumem or gpucores share a GPU in kube-scheduler's count too;
        /// tessera-scheduler still gives a pod's count distinct GPUs and books their
        /// shares. 1: the physical count, as NVIDIA's device plugin
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
        nvidia_gpu_split: u32,
        /// The unit of the aliyun.com/gpu-mem capacity: as tessera-scheduler's
        /// --gpushare-memory-unit (GiB, gpushare's default, or MiB).
        #[arg(long, value_name = "MiB|GiB", default_value_t = tessera_api::request::MemoryUnit::GiB)]
        gpushare_memory_unit: tessera_api::request::MemoryUnit,
        /// Seconds after its last critical XID before a GPU counts as healthy again.
        #[arg(long, value_name = "SECS", default_value_t = 300)]
        recovery_after: u64,
        /// The node's enforcement backends, as tessera-runtime-proxy writes them
        /// (`driver-memory+hami-core`, or `none`); published on the Device CR and as
        /// each GPU's tessera.io/enforce-memory / enforce-compute labels, which a
        /// pod's tessera.io/require-enforcement selects. A missing file is `none`.
        #[arg(long, value_name = "PATH", default_value = tessera_reporter::report::DEFAULT_ENFORCEMENT_FILE)]
        enforcement_file: PathBuf,
        /// Publish the node's GPUs for Kubernetes' own allocator (DRA) as a
        /// ResourceSlice of driver gpu.tessera.io (docs/dra.md), not to
        /// tessera-scheduler: the Device CR then lists no GPU and the node offers
        /// none of Tessera's extended resources, so tessera-scheduler and DRA never
        /// share a GPU. Also serves Tessera's kubelet plugin (the flags below),
        /// whose prepared claims tessera-runtime-proxy holds as grants. Better run no
        /// NVIDIA device plugin there: the proxy refuses a GPU it hands out that a
        /// claim holds, so that pod fails to start
        #[arg(long)]
        dra: bool,
        /// With --dra: kubelet's plugin directory; the kubelet plugin serves at
        /// DIR/gpu.tessera.io/dra.sock and keeps its checkpoint (claims.json)
        /// there, which tessera-runtime-proxy's --dra-claims reads.
        #[arg(long, value_name = "DIR", default_value = "/var/lib/kubelet/plugins")]
        kubelet_plugins_dir: PathBuf,
        /// With --dra: kubelet's plugin-watcher directory, where the plugin's
        /// registration socket goes (gpu.tessera.io-reg.sock).
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/var/lib/kubelet/plugins_registry"
        )]
        kubelet_registry_dir: PathBuf,
        /// Serve Prometheus (OpenMetrics) metrics at http://ADDR/metrics, or `off`.
        #[arg(long, value_name = "ADDR|off", default_value_t = MetricsListen::At(DEFAULT_METRICS_ADDR))]
        metrics_addr: MetricsListen,
    },
}

fn hostname() -> String {
    tessera_daemon::binary::hostname().unwrap_or_else(|| "localhost".into())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tessera_daemon::binary::init_logging_as("info", cli.log_format);
    match real_main(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!(
                "tessera-reporter: {}",
                tessera_reporter::chain(error.as_ref())
            );
            std::process::ExitCode::FAILURE
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Crd => {
            print!("{}", serde_yaml::to_string(&Device::crd())?);
        }
        Command::Checkpoint { file } => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let checkpoint =
                parse_checkpoint(&bytes).with_context(|| file.display().to_string())?;
            // GPU indices (a plugin run with --device-id-strategy index) are published
            // as UUIDs: NVML is read only when there are some.
            let has_indices = checkpoint
                .entries
                .iter()
                .flat_map(CheckpointEntry::gpu_ids)
                .any(|id| !is_device_uuid(&id) && gpu_index(&id).is_some());
            let gpus = if has_indices {
                NvmlSource::open(&library_path(cli.nvml_library))
                    .and_then(|source| source.discover())
                    .unwrap_or_else(|error| {
                        eprintln!(
                            "# GPU indices left as they are: {}",
                            tessera_reporter::chain(&error)
                        );
                        NodeGpus::default()
                    })
            } else {
                NodeGpus::default()
            };
            let entries: Vec<LegacyDeviceEntry> = checkpoint
                .entries
                .iter()
                .map(|entry| legacy_entry(entry, &gpus))
                .collect();
            println!("{}", serde_json::to_string_pretty(&entries)?);
        }
        Command::Discover { node_name } => {
            let source = NvmlSource::open(&library_path(cli.nvml_library))?;
            let gpus = source.discover()?;
            let device = Device {
                metadata: ObjectMeta {
                    name: Some(node_name.unwrap_or_else(hostname)),
                    annotations: Some(device_annotations(&gpus, &[])),
                    ..ObjectMeta::default()
                },
                spec: device_spec(&gpus, &BTreeSet::new()),
            };
            print!("{}", serde_yaml::to_string(&device)?);
            eprintln!(
                "# driver {}, {} GPU(s)",
                gpus.driver_version,
                gpus.gpus.len()
            );
        }
        Command::Run {
            node_name,
            kubeconfig,
            checkpoint,
            legacy_resources,
            interval,
            no_alias_resources,
            advertise_nvidia_gpu,
            nvidia_gpu_split,
            gpushare_memory_unit,
            recovery_after,
            enforcement_file,
            dra,
            kubelet_plugins_dir,
            kubelet_registry_dir,
            metrics_addr,
        } => {
            let source = NvmlSource::open(&library_path(cli.nvml_library))?;
            let client = tessera_daemon::client::kube_client(kubeconfig.as_deref()).await?;
            let plugin_failed = Arc::new((std::sync::OnceLock::new(), tokio::sync::Notify::new()));
            let (kubelet_plugin, health) = if dra {
                // Each round's GPU health, from the loop to kubelet.
                let health = tessera_dra::health::HealthFeed::default();
                let plugin = tessera_dra::plugin::Plugin::start(
                    node_name.clone(),
                    Arc::new(tessera_dra::plugin::KubeReader::new(client.clone())),
                    tessera_dra::store::Checkpoint::new(
                        kubelet_plugins_dir
                            .join(tessera_api::dra::DRIVER)
                            .join(tessera_api::dra::prepared::FILE_NAME),
                    ),
                )
                .context("starting the kubelet plugin")?;
                let sockets = tessera_dra::server::Sockets::under(
                    &kubelet_plugins_dir,
                    &kubelet_registry_dir,
                );
                // kubelet takes a GPU's health as unknown after three rounds unheard.
                let service = tessera_dra::health::HealthService::new(
                    node_name.clone(),
                    health.clone(),
                    Duration::from_secs(interval.max(1).saturating_mul(3)),
                );
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let failed = Arc::clone(&plugin_failed);
                let serving = tokio::spawn(async move {
                    let shutdown = async move {
                        let _ = stopped.await;
                    };
                    if let Err(error) =
                        tessera_dra::server::serve(Arc::new(plugin), service, &sockets, shutdown)
                            .await
                    {
                        // A node whose slice is published but whose plugin is down
                        // gets claims it cannot prepare: the reporter stops too, and
                        // its DaemonSet brings both back.
                        tracing::error!(%error, "kubelet plugin stopped; stopping the reporter");
                        let _ = failed.0.set(error.to_string());
                        failed.1.notify_one();
                    }
                });
                (Some((stop, serving)), Some(health))
            } else {
                (None, None)
            };
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let stop = Arc::new(AtomicBool::new(false));
            if let Err(error) =
                tessera_reporter::health::watch_xids(source.nvml(), tx, Arc::clone(&stop))
            {
                tracing::error!(%error, "cannot watch XID events; GPU health is not tracked");
            }
            let config = LoopConfig {
                checkpoint,
                legacy_resources,
                interval: Duration::from_secs(interval.max(1)),
                checkpoint_poll: Duration::from_secs(2),
                capacity: CapacityOptions {
                    aliases: !no_alias_resources,
                    nvidia_gpu: advertise_nvidia_gpu,
                    nvidia_gpu_split,
                    gpushare_memory_unit,
                },
                recovery_after: Duration::from_secs(recovery_after),
                enforcement_file,
                dra,
                dra_health: health,
            };
            let metrics = ReporterMetrics::default();
            if let Some(addr) = metrics_addr.addr() {
                // Not fatal: the node's Device CR matters more than its metrics.
                if let Err(error) = metrics.serve(addr).await {
                    tracing::error!(%addr, %error, "metrics endpoint not served (--metrics-addr)");
                }
            }
            let (events, recording) = GpuEvents::spawn(
                KubeNodeEvents::new(client.clone(), node_name.clone(), config.recovery_after),
                tessera_reporter::events::counted_in(metrics.events.clone()),
                tessera_reporter::events::QUEUE_CAPACITY,
                tessera_reporter::events::RECORD_TIMEOUT,
            );
            tracing::info!(node = %node_name, "reporting");
            let plugin_down = Arc::clone(&plugin_failed);
            let shutdown = async move {
                tokio::select! {
                    signal = tessera_daemon::binary::shutdown_signal() => {
                        if let Err(error) = signal {
                            tracing::error!(%error, "stopping: no signal handler");
                        }
                    }
                    () = plugin_down.1.notified() => {}
                }
                tracing::info!("shutting down");
            };
            run_with_metrics(
                Arc::new(source),
                Publisher::new(client, node_name),
                config,
                &metrics,
                events,
                rx,
                shutdown,
            )
            .await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            if let Some((stop, serving)) = kubelet_plugin {
                let _ = stop.send(());
                let _ = tokio::time::timeout(Duration::from_secs(5), serving).await;
            }
            // The loop dropped its handle: Events already queued are written, briefly.
            if tokio::time::timeout(Duration::from_secs(5), recording)
                .await
                .is_err()
            {
                tracing::warn!("stopped before every GPU health Event was recorded");
            }
            if let Some(error) = plugin_failed.0.get() {
                anyhow::bail!("the kubelet plugin stopped: {error}");
            }
        }
    }
    Ok(())
}
