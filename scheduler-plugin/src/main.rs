use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tessera_allocator::allocate::Policy;
use tessera_allocator::ledger::Ledger;
use tessera_allocator::simulate::{self, SimulateOptions, Snapshot};
use tessera_api::request::{MemoryUnit, RequestOptions};
use tessera_daemon::metrics::MetricsListen;
use tessera_scheduler::events::{
    BindObserver, KubePodEvents, PodEvents, QUEUE_CAPACITY, RECORD_TIMEOUT,
};
use tessera_scheduler::extender::{Extender, ExtenderConfig, serve};
use tessera_scheduler::leader::{Election, ElectionTiming, Leader, LeaseConfig, parse_duration};
use tessera_scheduler::metrics::{DEFAULT_METRICS_LISTEN, SchedulerMetrics, SchedulerState};
use tessera_scheduler::transport::{
    self, BindAccess, DEFAULT_BIND_CLIENT, DEFAULT_PEER_CLIENT, TlsFiles, Transport,
};

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
    /// The most GPUs the sharing groups of one namespace may hold at once. A group
    /// closes its GPU to every other pod, however small its pods' shares, while
    /// ResourceQuota counts only the shares; a new group past this waits. 0: no
    /// sharing groups.
    #[arg(long, value_name = "N", default_value_t = tessera_allocator::allocate::GROUP_GPUS_PER_NAMESPACE)]
    max_group_gpus_per_namespace: u32,
}

impl PolicyArgs {
    fn request_options(&self) -> RequestOptions {
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
    Serve {
        /// Address to listen on. Plain HTTP (no TLS files) only on a loopback
        /// address, unless --insecure-listen.
        #[arg(long, default_value = "0.0.0.0:8888")]
        listen: SocketAddr,
        /// The extender's certificate (PEM; chain allowed). Its EKU must allow
        /// serverAuth and, for followers to hand binds to the leader, clientAuth.
        #[arg(long, value_name = "PATH")]
        tls_cert_file: Option<PathBuf>,
        /// The private key of --tls-cert-file (PEM: PKCS#8, PKCS#1 or SEC1).
        #[arg(long, value_name = "PATH")]
        tls_key_file: Option<PathBuf>,
        /// CA certificates (PEM) that sign clients' certificates: a client without
        /// a certificate signed by one of them is refused in the TLS handshake.
        #[arg(long, value_name = "PATH")]
        client_ca_file: Option<PathBuf>,
        /// A client identity (certificate CN or DNS SAN) allowed to POST /bind;
        /// repeat for more. Other verified clients may call filter and prioritize.
        #[arg(long = "bind-client-name", value_name = "NAME", default_values_t = [DEFAULT_BIND_CLIENT.to_owned()])]
        bind_client_names: Vec<String>,
        /// The identity in the replicas' own certificate: a follower presents it when
        /// handing kube-scheduler's bind to the leader, and it may bind only such a
        /// handed-over bind. Empty: no hand-over (a bind sent to a follower fails and
        /// kube-scheduler retries).
        #[arg(long, value_name = "NAME", default_value = DEFAULT_PEER_CLIENT)]
        peer_client_name: String,
        /// CA certificates (PEM) a follower trusts for the leader's certificate
        /// [default: --client-ca-file].
        #[arg(long, value_name = "PATH")]
        peer_ca_file: Option<PathBuf>,
        /// The name a follower checks in the leader's certificate (the leader is
        /// dialled by pod IP) [default: the first DNS SAN of --tls-cert-file].
        #[arg(long, value_name = "NAME")]
        peer_server_name: Option<String>,
        /// Plain HTTP for kubelet's probes, GET /healthz and /readyz only, e.g.
        /// 0.0.0.0:8889 (kubelet has no client certificate for the TLS port).
        #[arg(long, value_name = "ADDR")]
        probe_listen: Option<SocketAddr>,
        /// Plain HTTP for Prometheus, GET /metrics only (OpenMetrics text), or `off`.
        /// Never the extender's port: scrapers have no client certificate, and need
        /// none to read counts.
        #[arg(long, value_name = "ADDR|off", default_value_t = MetricsListen::At(DEFAULT_METRICS_LISTEN))]
        metrics_listen: MetricsListen,
        /// Serve plain HTTP on a non-loopback --listen with no authentication.
        /// INSECURE: anything that can reach the port can bind any pending pod to
        /// any node with tessera-scheduler's rights. Only for a migration.
        #[arg(long)]
        insecure_listen: bool,
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
        /// Nodes filter answers for a GPU pod: the N that score best for its GPUs
        /// (kube-scheduler's order among equals). With 1, kube-scheduler takes that
        /// node without running its score plugins or calling prioritize, which on
        /// thousands of nodes is most of a GPU pod's cost; its soft preferences
        /// (preferred affinity, ScheduleAnyway spread) then do not choose among GPU
        /// nodes. 0: every node that fits, all scored by prioritize.
        #[arg(long, value_name = "N", default_value_t = tessera_scheduler::extender::CANDIDATES)]
        candidates: usize,
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
        /// [default: https://$POD_IP:<--listen port> under mutual TLS, http:// on
        /// plain HTTP, when POD_IP is set; else binds sent to a follower fail and
        /// kube-scheduler retries them].
        #[arg(long, value_name = "URL")]
        advertise_url: Option<String>,
    },
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
        /// kube-scheduler's percentageOfNodesToScore: each cycle the extender sees
        /// only the nodes kube-scheduler sampled. 0 is kube-scheduler's own default
        /// (50 − nodes/125 %, at least 5 % and 100 nodes); Tessera's deploy sets 100
        /// [default: both, each from the same start: 100 (the pods' lines), then 0]
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100))]
        percentage_of_nodes_to_score: Option<u32>,
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

/// This thread's CPU time (user + kernel) in seconds, from /proc/thread-self/stat.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command (which may hold spaces) end with ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// `field` of /proc/self/status (`VmRSS:` now, `VmHWM:` the peak) in MiB.
fn rss_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// What mutual TLS needs, read from the files at startup.
struct TlsSetup {
    server: Arc<rustls::ServerConfig>,
    peer: rustls::ClientConfig,
    peer_server_name: rustls::pki_types::ServerName<'static>,
}

impl TlsSetup {
    fn load(
        files: &TlsFiles,
        peer_ca: Option<&std::path::Path>,
        peer_server_name: Option<&str>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            server: transport::server_config(files)?,
            peer: transport::peer_client_config(files, peer_ca.unwrap_or(&files.client_ca))?,
            peer_server_name: transport::peer_server_name(peer_server_name, &files.cert)?,
        })
    }
}

/// `certs`: the CA and certificates into `out`, never over an existing file.
fn write_certs(
    out: &std::path::Path,
    service: &str,
    namespace: &str,
    days: i64,
) -> anyhow::Result<()> {
    use std::io::Write;
    let certs = tessera_scheduler::certs::generate(service, namespace, days)
        .context("generating the certificates")?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let files = [
        ("ca.crt", &certs.ca.cert, false),
        ("ca.key", &certs.ca.key, true),
        ("tessera-scheduler.crt", &certs.scheduler.cert, false),
        ("tessera-scheduler.key", &certs.scheduler.key, true),
        (
            "tessera-kube-scheduler.crt",
            &certs.kube_scheduler.cert,
            false,
        ),
        (
            "tessera-kube-scheduler.key",
            &certs.kube_scheduler.key,
            true,
        ),
    ];
    for (name, _, _) in &files {
        let path = out.join(name);
        anyhow::ensure!(
            !path.exists(),
            "{} exists; not overwriting it",
            path.display()
        );
    }
    for (name, text, secret) in files {
        let path = out.join(name);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        if secret {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        options
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tessera_daemon::binary::init_logging_as("info", cli.log_format);
    match real_main(cli).await {
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

async fn real_main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve {
            listen,
            tls_cert_file,
            tls_key_file,
            client_ca_file,
            bind_client_names,
            peer_client_name,
            peer_ca_file,
            peer_server_name,
            probe_listen,
            metrics_listen,
            insecure_listen,
            kubeconfig,
            policy,
            reservation_ttl,
            candidates,
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
            if let Some(metrics) = metrics_listen.addr() {
                for (flag, taken) in [("--listen", Some(listen)), ("--probe-listen", probe_listen)]
                {
                    anyhow::ensure!(
                        taken.is_none_or(|taken| taken.port() != metrics.port()),
                        "--metrics-listen {metrics}: port {} is {flag}'s; metrics are served on a port of their own",
                        metrics.port()
                    );
                }
            }
            // How to listen is settled, and the TLS files read, before anything
            // touches the cluster: a bad setting exits naming it.
            let transport = transport::choose_transport(
                listen,
                tls_cert_file,
                tls_key_file,
                client_ca_file,
                insecure_listen,
            )?;
            let tls = match &transport {
                Transport::MutualTls(files) => Some(TlsSetup::load(
                    files,
                    peer_ca_file.as_deref(),
                    peer_server_name.as_deref(),
                )?),
                Transport::PlainLoopback => None,
                Transport::PlainInsecure => {
                    tracing::warn!(
                        %listen,
                        "INSECURE: plain HTTP with no authentication (--insecure-listen): anything that reaches this port can bind any pending pod to any node"
                    );
                    None
                }
            };
            // The serving certificate's expiry, as loaded: a metric, alerted 14 days ahead.
            let tls_not_after = match &transport {
                Transport::MutualTls(files) => Some(transport::certificate_not_after(&files.cert)?),
                _ => None,
            };
            let access = Arc::new(BindAccess {
                bind_clients: bind_client_names,
                peer: Some(peer_client_name).filter(|name| !name.is_empty()),
            });
            let scheme = if tls.is_some() { "https" } else { "http" };
            let advertise_url = advertise_url.or_else(|| {
                let ip: std::net::IpAddr = std::env::var("POD_IP").ok()?.parse().ok()?;
                Some(format!("{scheme}://{}", SocketAddr::new(ip, listen.port())))
            });
            let client = tessera_daemon::client::kube_client(kubeconfig.as_deref()).await?;
            let ledger = Arc::new(Mutex::new(Ledger::default()));
            let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
            let leader = Arc::new(Leader::new(false));
            // KubeShare's SharePods and MtgpuPods: each gets its pod (the leader
            // makes them).
            for kind in tessera_api::sharepod::KINDS {
                tokio::spawn(tessera_scheduler::sharepods::run(
                    client.clone(),
                    Arc::clone(&leader),
                    kind,
                ));
            }
            let identity = identity
                .or_else(tessera_daemon::binary::hostname)
                .unwrap_or_else(|| "tessera-scheduler".into());
            let metrics = Arc::new(SchedulerMetrics::new(SchedulerState {
                ledger: Arc::clone(&ledger),
                ready: Arc::clone(&view.ready),
                leader: Arc::clone(&leader),
                tls_not_after,
            }));
            // As the node daemons do: no metrics is no reason to stop placing pods.
            if let Some(addr) = metrics_listen.addr() {
                if let Err(error) = metrics.serve(addr).await {
                    tracing::warn!(%addr, %error, "--metrics-listen: cannot listen; serving no metrics");
                }
            }
            let (events, _recording) = PodEvents::spawn(
                KubePodEvents::new(client.clone(), identity.clone()),
                tessera_scheduler::events::counted_in(Arc::clone(&metrics)),
                QUEUE_CAPACITY,
                RECORD_TIMEOUT,
            );
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
                group_gpus_per_namespace: policy.max_group_gpus_per_namespace,
                candidates,
            };
            let extender = Extender::new(
                ledger,
                Some(client),
                Some(view.pods),
                config,
                view.ready,
                Arc::clone(&leader),
            )
            .with_observer(BindObserver::new(Arc::clone(&metrics), events));
            let extender = match &tls {
                Some(tls) if access.peer.is_some() => {
                    extender.with_peer_tls(tls.peer.clone(), tls.peer_server_name.clone())
                }
                _ => extender,
            };
            let expiring = extender.clone();
            let expired_count = metrics.reservations_expired.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let expired = expiring.expire_reservations();
                    expired_count.inc_by(u64::try_from(expired).unwrap_or(u64::MAX));
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
            if let Some(probe_listen) = probe_listen {
                let probes = tokio::net::TcpListener::bind(probe_listen)
                    .await
                    .with_context(|| format!("--probe-listen {probe_listen}"))?;
                tracing::info!(%probe_listen, "serving /healthz and /readyz, plain HTTP");
                tokio::spawn(transport::serve_probes(probes, extender.clone()));
            }
            let serving = match tls {
                Some(tls) => {
                    tracing::info!(%listen, bind_clients = ?access.bind_clients, peer = ?access.peer, "serving the extender over mutual TLS");
                    futures_util::future::Either::Left(transport::serve_tls(
                        listener,
                        tls.server,
                        extender.clone(),
                        access,
                    ))
                }
                None => {
                    tracing::info!(%listen, "serving the extender, plain HTTP");
                    futures_util::future::Either::Right(serve(listener, extender.clone()))
                }
            };
            tokio::select! {
                () = serving => {}
                signal = tessera_daemon::binary::shutdown_signal() => {
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
        Command::Certs {
            out,
            namespace,
            service,
            days,
        } => write_certs(&out, &service, &namespace, days)?,
        Command::Simulate {
            cluster,
            pods,
            synthetic_nodes,
            synthetic_gpus,
            synthetic_running,
            synthetic_pending,
            percentage_of_nodes_to_score,
            json,
            policy,
        } => {
            let options = |percentage_of_nodes_to_score| SimulateOptions {
                gpu_policy: policy.gpu_policy,
                node_policy: policy.node_policy,
                request: policy.request_options(),
                percentage_of_nodes_to_score,
                group_gpus_per_namespace: policy.max_group_gpus_per_namespace,
            };
            // The deploy's mode first: its outcomes are the pods' lines.
            let modes = match percentage_of_nodes_to_score {
                Some(percentage) => vec![percentage],
                None => vec![100, 0],
            };
            let mut first: Option<Vec<simulate::Outcome>> = None;
            for percentage in modes {
                let started = Instant::now();
                // The snapshot's pods are booked and dropped: the process then holds
                // what the extender would, not every Pod object. Each mode starts
                // from the same cluster.
                let (mut ledger, nodes, devices, running, pending) = match synthetic_nodes {
                    Some(nodes) => {
                        let (ledger, names) =
                            simulate::synthetic_ledger(nodes, synthetic_gpus, synthetic_running);
                        // Made one at a time as simulate takes them.
                        (ledger, names, nodes, synthetic_running, Vec::new())
                    }
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
                        let ledger = simulate::ledger_of(&cluster);
                        let counts = (cluster.devices.len(), cluster.pods.len());
                        (ledger, cluster.node_list(), counts.0, counts.1, pending)
                    }
                };
                let loaded = started.elapsed();
                let options = options(percentage);
                let placing = Instant::now();
                let cpu = cpu_seconds();
                let outcomes = match synthetic_nodes {
                    Some(_) => simulate::simulate(
                        &mut ledger,
                        &nodes,
                        (0..synthetic_pending).map(simulate::synthetic_pending_pod),
                        &options,
                    ),
                    None => simulate::simulate(&mut ledger, &nodes, &pending, &options),
                };
                let took = placing.elapsed();
                // CPU time too: on a busy machine the wall clock also counts others' work.
                let cpu = cpu_seconds().zip(cpu).map(|(after, before)| after - before);
                if first.is_none() && synthetic_nodes.is_none() {
                    if json {
                        println!("{}", serde_json::to_string_pretty(&outcomes)?);
                    } else {
                        for outcome in &outcomes {
                            println!("{}", outcome.line());
                        }
                    }
                }
                let placed = outcomes.iter().filter(|o| o.node.is_some()).count();
                eprintln!(
                    "simulate: {} nodes ({devices} with Device CRs), {running} running pods loaded in {:.2?}; {} nodes sampled a cycle (percentageOfNodesToScore {percentage}); placed {placed} of {} pending pods in {:.2?} ({:.0} pods/s; {} per CPU-second); RSS {:.1} MiB (peak {:.1} MiB)",
                    nodes.len(),
                    loaded,
                    simulate::nodes_to_find(percentage, nodes.len()),
                    outcomes.len(),
                    took,
                    outcomes.len() as f64 / took.as_secs_f64().max(1e-9),
                    // Under a tenth of a second of CPU the 10 ms ticks say nothing.
                    cpu.filter(|c| *c >= 0.1)
                        .map_or("-".to_owned(), |c| format!(
                            "{:.0}",
                            outcomes.len() as f64 / c
                        )),
                    rss_mib("VmRSS:").unwrap_or(0.0),
                    rss_mib("VmHWM:").unwrap_or(0.0)
                );
                eprintln!(
                    "simulate: percentageOfNodesToScore {percentage}: {}",
                    simulate::unplaced_summary(&outcomes, first.as_deref(), 10)
                );
                drop(ledger);
                first.get_or_insert(outcomes);
            }
        }
    }
    Ok(())
}
