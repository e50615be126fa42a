use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tessera_api::request::{MemoryUnit, RequestOptions};
use tessera_scheduler::core::Policy;
use tessera_scheduler::extender::{Extender, ExtenderConfig, serve};
use tessera_scheduler::leader::{Election, ElectionTiming, Leader, LeaseConfig, parse_duration};
use tessera_scheduler::ledger::Ledger;
use tessera_scheduler::simulate::{self, SimulateOptions, Snapshot};

/// A kube-scheduler extender that shares GPUs: it picks GPUs per node by UUID and
/// writes scheduling.koordinator.sh/device-allocated on the pod before binding it.
#[derive(Debug, Parser)]
#[command(name = "tessera-scheduler", version)]
struct Cli {
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, value_name = "text|json", env = tessera_api::binary::LOG_FORMAT_ENV, default_value_t = tessera_api::binary::LogFormat::Text, global = true)]
    log_format: tessera_api::binary::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args, Clone, Copy)]
struct PolicyArgs {
    /// Which GPU on a node: binpack (fullest that fits) or spread (emptiest).
    #[arg(long, value_enum, default_value_t = Policy::Binpack)]
    gpu_policy: Policy,
    /// Which node (prioritize scores): binpack or spread.
    #[arg(long, value_enum, default_value_t = Policy::Binpack)]
    node_policy: Policy,
    /// Bytes in one unit of volcano.sh/gpu-memory.
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20)]
    volcano_memory_unit: u64,
    /// The unit of aliyun.com/gpu-mem: GiB, as gpushare's device plugin counts by
    /// default, or MiB for clusters whose gpushare ran with --memory-unit=MiB.
    #[arg(long, value_name = "MiB|GiB", default_value_t = MemoryUnit::GiB)]
    gpushare_memory_unit: MemoryUnit,
}

impl PolicyArgs {
    fn request_options(&self) -> RequestOptions {
        RequestOptions {
            volcano_memory_unit: self.volcano_memory_unit,
            gpushare_memory_unit: self.gpushare_memory_unit,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the extender API (POST /filter, /prioritize, /bind; GET /healthz, /readyz).
    ///
    /// Replicas elect one leader through a Lease; only it binds. On SIGTERM or
    /// SIGINT the leader stops binding, lets running binds end (5 s at most) and
    /// releases the Lease, so the next leader takes over at its next round.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:8888")]
        listen: SocketAddr,
        /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster].
        #[arg(long, value_name = "PATH")]
        kubeconfig: Option<PathBuf>,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Seconds an allocation stays reserved while in flight (its bind has not
        /// finished, or its pod is annotated and not bound). Bound pods' allocations
        /// do not expire: they are held until the watch shows the pod, or its delete.
        #[arg(long, value_name = "SECS", default_value_t = 30)]
        reservation_ttl: u64,
        /// Namespace of the leader-election Lease.
        #[arg(
            long,
            alias = "leader-elect-resource-namespace",
            default_value = "tessera-system"
        )]
        lease_namespace: String,
        /// Name of the leader-election Lease.
        #[arg(long, default_value = "tessera-scheduler")]
        leader_elect_resource_name: String,
        /// How long the Lease holds without renewal. Another replica takes it over
        /// only after seeing it unchanged this long by its own clock (the holder's
        /// renewTime is never compared with a clock). A Go duration: 15s, 1m.
        #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_duration)]
        leader_elect_lease_duration: Duration,
        /// A leader that has not renewed the Lease within this stops binding at
        /// once (before any other replica can take the Lease); must be below
        /// --leader-elect-lease-duration.
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
        leader_elect_renew_deadline: Duration,
        /// Time between election rounds; a follower adds up to 1.2 times this at
        /// random. 1.2 times it must be below --leader-elect-renew-deadline.
        #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
        leader_elect_retry_period: Duration,
        /// This replica's identity in the Lease [default: the host name].
        #[arg(long, env = "POD_NAME")]
        identity: Option<String>,
        /// Where the other replicas reach this one, written into the Lease while it
        /// leads so that a follower hands kube-scheduler's binds over to it
        /// [default: http://$POD_IP:<--listen port> when POD_IP is set; else binds
        /// sent to a follower fail and kube-scheduler retries them].
        #[arg(long, value_name = "URL")]
        advertise_url: Option<String>,
    },
    /// Place pending pods on a cluster snapshot and print each pod's node and
    /// annotation, or why it fits nowhere.
    Simulate {
        /// Nodes, Device CRs and running Pods (kubectl get -o yaml|json output, a List or documents).
        #[arg(long, value_name = "FILE", required_unless_present = "synthetic_nodes")]
        cluster: Option<PathBuf>,
        /// Pending pods, placed in file order.
        #[arg(long, value_name = "FILE", required_unless_present = "synthetic_nodes")]
        pods: Option<PathBuf>,
        /// Instead of files: a synthetic cluster of this many nodes (for benchmarks).
        #[arg(long, value_name = "N")]
        synthetic_nodes: Option<usize>,
        /// GPUs per synthetic node.
        #[arg(long, default_value_t = 8)]
        synthetic_gpus: u32,
        /// Running quarter-GPU pods in the synthetic cluster.
        #[arg(long, default_value_t = 40_000)]
        synthetic_running: usize,
        /// Pending pods to place in the synthetic cluster.
        #[arg(long, default_value_t = 20_000)]
        synthetic_pending: usize,
        /// Nodes scored per pod [default: kube-scheduler's adaptive percentage].
        #[arg(long, default_value_t = 0)]
        nodes_to_score: usize,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        policy: PolicyArgs,
    },
}

/// How long a stopping leader lets running binds finish before releasing the
/// Lease: kube-scheduler stops waiting for a bind after its 5 s httpTimeout anyway.
const BIND_DRAIN: Duration = Duration::from_secs(5);

fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tessera_api::binary::init_logging_as("info", cli.log_format);
    match real_main(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tessera-scheduler: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve {
            listen,
            kubeconfig,
            policy,
            reservation_ttl,
            lease_namespace,
            leader_elect_resource_name,
            leader_elect_lease_duration,
            leader_elect_renew_deadline,
            leader_elect_retry_period,
            identity,
            advertise_url,
        } => {
            let timing = ElectionTiming {
                renew_deadline: leader_elect_renew_deadline,
                retry_period: leader_elect_retry_period,
            };
            timing.validate(leader_elect_lease_duration)?;
            let advertise_url = advertise_url.or_else(|| {
                let ip: std::net::IpAddr = std::env::var("POD_IP").ok()?.parse().ok()?;
                Some(format!("http://{}", SocketAddr::new(ip, listen.port())))
            });
            let client = tessera_api::client::kube_client(kubeconfig.as_deref()).await?;
            let ledger = Arc::new(Mutex::new(Ledger::default()));
            let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
            let leader = Arc::new(Leader::new(false));
            let identity = identity
                .or_else(tessera_api::binary::hostname)
                .unwrap_or_else(|| "tessera-scheduler".into());
            let mut election = Election::start(
                client.clone(),
                LeaseConfig {
                    namespace: lease_namespace,
                    name: leader_elect_resource_name,
                    identity,
                    duration: leader_elect_lease_duration,
                    url: advertise_url,
                },
                timing,
                Arc::clone(&leader),
                Arc::clone(&view.ready),
            );
            let config = ExtenderConfig {
                gpu_policy: policy.gpu_policy,
                node_policy: policy.node_policy,
                request: policy.request_options(),
                reservation_ttl: Duration::from_secs(reservation_ttl),
            };
            let extender = Extender::new(
                ledger,
                Some(client),
                Some(view.pods),
                config,
                view.ready,
                Arc::clone(&leader),
            );
            let expiring = extender.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let expired = expiring.expire_reservations();
                    if expired > 0 {
                        tracing::warn!(
                            expired,
                            "in-flight allocations released: their binds did not finish in time"
                        );
                    }
                }
            });
            // Pods placed before per-container grants: rewritten once the view is synced.
            let upgrading = extender.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    upgrading.upgrade_pod_level_allocations().await;
                }
            });
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            tracing::info!(%listen, "serving the extender");
            tokio::select! {
                () = serve(listener, extender.clone()) => {}
                signal = tessera_api::binary::shutdown_signal() => {
                    signal?;
                    tracing::info!("shutting down on a signal");
                }
            }
            // Hand over in order: no renewal and no new bind writes, running binds
            // end, then the Lease is released so the next leader need not wait it out.
            election.step_down().await;
            let running = extender.drain(BIND_DRAIN).await;
            if running > 0 {
                tracing::warn!(running, "binds still running at shutdown");
            }
            match election.release().await {
                Ok(true) => tracing::info!("Lease released"),
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%error, "releasing the Lease failed; it expires on its own")
                }
            }
        }
        Command::Simulate {
            cluster,
            pods,
            synthetic_nodes,
            synthetic_gpus,
            synthetic_running,
            synthetic_pending,
            nodes_to_score,
            json,
            policy,
        } => {
            let started = Instant::now();
            let (snapshot, pending) = match synthetic_nodes {
                Some(nodes) => (
                    simulate::synthetic_cluster(nodes, synthetic_gpus, synthetic_running),
                    simulate::synthetic_pending(synthetic_pending),
                ),
                None => {
                    let read = |path: &PathBuf| -> anyhow::Result<Snapshot> {
                        let text = std::fs::read_to_string(path)
                            .with_context(|| format!("reading {}", path.display()))?;
                        Ok(simulate::parse_snapshot(
                            &text,
                            &path.display().to_string(),
                        )?)
                    };
                    let cluster = read(cluster.as_ref().context("--cluster is required")?)?;
                    let pending = read(pods.as_ref().context("--pods is required")?)?.pods;
                    (cluster, pending)
                }
            };
            let mut ledger = simulate::ledger_of(&snapshot);
            let loaded = started.elapsed();
            let options = SimulateOptions {
                gpu_policy: policy.gpu_policy,
                node_policy: policy.node_policy,
                request: policy.request_options(),
                nodes_to_score,
            };
            let placing = Instant::now();
            let outcomes = simulate::simulate(&mut ledger, &pending, &options);
            let took = placing.elapsed();
            if synthetic_nodes.is_none() {
                if json {
                    println!("{}", serde_json::to_string_pretty(&outcomes)?);
                } else {
                    for outcome in &outcomes {
                        match (&outcome.node, &outcome.annotation) {
                            (Some(node), Some(annotation)) => {
                                println!("{}\t-> {node}\t{annotation}", outcome.pod)
                            }
                            _ => println!(
                                "{}\t-> (none)\t{}",
                                outcome.pod,
                                outcome.reason.as_deref().unwrap_or("")
                            ),
                        }
                    }
                }
            }
            let placed = outcomes.iter().filter(|o| o.node.is_some()).count();
            eprintln!(
                "simulate: {} nodes with Device CRs, {} running pods loaded in {:.2?}; placed {placed} of {} pending pods in {:.2?} ({:.0} placements/s); RSS {:.1} MiB",
                snapshot.devices.len(),
                snapshot.pods.len(),
                loaded,
                pending.len(),
                took,
                pending.len() as f64 / took.as_secs_f64().max(1e-9),
                rss_mib().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
