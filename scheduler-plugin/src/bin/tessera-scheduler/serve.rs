//! `tessera-scheduler serve`: config → build → run. [`Settings::settle`] reads and
//! checks every flag and TLS file before anything touches the cluster, so a bad
//! setting exits naming it; [`Daemon::build`] connects and starts the watches, the
//! election, the Event queue and the background tasks; [`Daemon::run`] serves until
//! a signal and then hands over in order.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tessera_allocator::ledger::Ledger;
use tessera_daemon::metrics::MetricsListen;
use tessera_scheduler::events::{
    BindObserver, KubePodEvents, PodEvents, QUEUE_CAPACITY, RECORD_TIMEOUT, counted_in,
};
use tessera_scheduler::extender::{Extender, ExtenderConfig, serve};
use tessera_scheduler::leader::{Election, ElectionTiming, Leader, LeaseConfig, parse_duration};
use tessera_scheduler::metrics::{DEFAULT_METRICS_LISTEN, SchedulerMetrics, SchedulerState};
use tessera_scheduler::transport::{
    self, BindAccess, DEFAULT_BIND_CLIENT, DEFAULT_PEER_CLIENT, TlsFiles, Transport,
};

use crate::PolicyArgs;

/// `serve`'s flags.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
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
}

/// How long a stopping leader lets running binds finish before releasing the
/// Lease: kube-scheduler stops waiting for a bind after its 5 s httpTimeout anyway.
const BIND_DRAIN: Duration = Duration::from_secs(5);

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

/// Every setting checked, the TLS files read: what [`Daemon::build`] needs.
struct Settings {
    listen: SocketAddr,
    tls: Option<TlsSetup>,
    /// The serving certificate's expiry, as loaded: a metric, alerted 14 days ahead.
    tls_not_after: Option<i64>,
    access: Arc<BindAccess>,
    probe_listen: Option<SocketAddr>,
    metrics_listen: MetricsListen,
    kubeconfig: Option<PathBuf>,
    lease: LeaseConfig,
    timing: ElectionTiming,
    extender: ExtenderConfig,
}

impl Settings {
    /// The flags checked and the TLS files read, touching no cluster.
    fn settle(args: ServeArgs) -> anyhow::Result<Self> {
        let ServeArgs {
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
        } = args;
        let timing = ElectionTiming {
            renew_deadline: leader_elect_renew_deadline,
            retry_period: leader_elect_retry_period,
        };
        timing.validate(leader_elect_lease_duration)?;
        if let Some(metrics) = metrics_listen.addr() {
            for (flag, taken) in [("--listen", Some(listen)), ("--probe-listen", probe_listen)] {
                anyhow::ensure!(
                    taken.is_none_or(|taken| taken.port() != metrics.port()),
                    "--metrics-listen {metrics}: port {} is {flag}'s; metrics are served on a port of their own",
                    metrics.port()
                );
            }
        }
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
        let identity = identity
            .or_else(tessera_daemon::binary::hostname)
            .unwrap_or_else(|| "tessera-scheduler".into());
        Ok(Self {
            listen,
            tls,
            tls_not_after,
            access,
            probe_listen,
            metrics_listen,
            kubeconfig,
            lease: LeaseConfig {
                namespace: lease_namespace,
                name: leader_elect_resource_name,
                identity,
                duration: leader_elect_lease_duration,
                url: advertise_url,
            },
            timing,
            extender: ExtenderConfig {
                gpu_policy: policy.gpu_policy,
                node_policy: policy.node_policy,
                request: policy.request_options(),
                reservation_ttl: Duration::from_secs(reservation_ttl),
                group_gpus_per_namespace: policy.max_group_gpus_per_namespace,
                candidates,
            },
        })
    }
}

/// The daemon, built and connected: its listener bound, its watches, election,
/// Event queue and background tasks started.
struct Daemon {
    listen: SocketAddr,
    listener: tokio::net::TcpListener,
    tls: Option<TlsSetup>,
    access: Arc<BindAccess>,
    extender: Extender,
    election: Election,
}

impl Daemon {
    async fn build(settings: Settings) -> anyhow::Result<Self> {
        let Settings {
            listen,
            tls,
            tls_not_after,
            access,
            probe_listen,
            metrics_listen,
            kubeconfig,
            lease,
            timing,
            extender: config,
        } = settings;
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
            KubePodEvents::new(client.clone(), lease.identity.clone()),
            counted_in(metrics.events.clone()),
            QUEUE_CAPACITY,
            RECORD_TIMEOUT,
        );
        let election = Election::start(
            client.clone(),
            lease,
            timing,
            Arc::clone(&leader),
            Arc::clone(&view.ready),
        );
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
        spawn_expiry(extender.clone(), &metrics);
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
        Ok(Self {
            listen,
            listener,
            tls,
            access,
            extender,
            election,
        })
    }

    /// Serves until SIGTERM or SIGINT, then hands over in order: no renewal and no
    /// new bind writes, running binds end, then the Lease is released so the next
    /// leader need not wait it out.
    async fn run(self) -> anyhow::Result<()> {
        let Self {
            listen,
            listener,
            tls,
            access,
            extender,
            mut election,
        } = self;
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
        Ok(())
    }
}

/// Every second, in-flight allocations whose binds did not finish in time are
/// released, and counted.
fn spawn_expiry(extender: Extender, metrics: &SchedulerMetrics) {
    let expired_count = metrics.reservations_expired.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let expired = extender.expire_reservations();
            expired_count.inc_by(u64::try_from(expired).unwrap_or(u64::MAX));
            if expired > 0 {
                tracing::warn!(
                    expired,
                    "in-flight allocations released: their binds did not finish in time"
                );
            }
        }
    });
}

/// `serve`: the extender daemon until a signal.
pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings = Settings::settle(args)?;
    Daemon::build(settings).await?.run().await
}
