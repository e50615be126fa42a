//! `tessera-bench cluster`: placements per second through the real kube-scheduler
//! of a harness cluster, with tessera-scheduler in its production mode (mutual TLS:
//! kube-scheduler presents its client certificate, only it may bind), and how long
//! each pod waited from its create to its bind.
//!
//! The pods go to fake nodes: Node objects with Device CRs and no kubelet, so the
//! measurement is scheduling and binding only, not containers starting on a 2-vCPU
//! machine. The pods tolerate every taint (the node controller marks nodes without
//! a kubelet unreachable after its grace period) and select the fake nodes by label.
//! Baselines in the same run: as many pods with no GPU request, which kube-scheduler
//! places without calling the extender (it is interested only in pods asking for
//! its managed resources) and binds itself; and as many asking two extended
//! resources the extender does not manage, counted like the fractional pods' two
//! but by kube-scheduler alone: the difference to those is the extender's own cost.
//! And as many through DRA (docs/dra.md): each pod's claim, made from one
//! ResourceClaimTemplate, asks the same share of a GPU of the fake nodes'
//! ResourceSlices, and kube-scheduler's own allocator places it. The fake nodes
//! offer their GPUs in both books (no pod ever runs there); a real node is in one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;
use tessera_harness::cluster::{
    Cluster, ClusterOptions, Component, ExtenderTls, K8sBinaries, tessera_binary,
};

/// The label on the fake nodes and on the bench's pods.
const BENCH_LABEL: &str = "tessera.io/bench";
/// GPUs per fake node.
const GPUS: usize = 8;
/// Compute percent of each fractional pod: ten to a GPU.
const SHARE: usize = 10;
/// The extended resources of the second baseline: advertised by the fake nodes as
/// the GPU ones are, and managed by no extender.
const UNMANAGED: [&str; 2] = ["example.com/bench-core", "example.com/bench-memory"];

/// What a round's pods ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodKind {
    /// Nothing: kube-scheduler alone, no extended resource.
    Plain,
    /// [`UNMANAGED`], `SHARE` of each: kube-scheduler alone, counting two extended
    /// resources as it counts the fractional pods'.
    Unmanaged,
    /// A GPU share: the extender filters and binds.
    Fractional,
    /// The same share through DRA: a claim from [`DRA_TEMPLATE`], allocated and
    /// bound by kube-scheduler alone.
    Dra,
}

/// The ResourceClaimTemplate of the DRA rounds' pods.
const DRA_TEMPLATE: &str = "bench-share";

impl PodKind {
    const ALL: [Self; 4] = [Self::Plain, Self::Unmanaged, Self::Fractional, Self::Dra];

    /// The label value and pod name part of its rounds.
    fn tag(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Unmanaged => "unmanaged",
            Self::Fractional => "gpu",
            Self::Dra => "dra",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Plain => "no GPU (kube-scheduler alone)",
            Self::Unmanaged => "2 unmanaged extended resources",
            Self::Fractional => "fractional GPU (extender, mTLS)",
            Self::Dra => "fractional GPU (DRA claim)",
        }
    }

    fn limits(self) -> serde_json::Value {
        let share = SHARE.to_string();
        match self {
            Self::Plain => json!({}),
            Self::Unmanaged => json!({UNMANAGED[0]: share, UNMANAGED[1]: share}),
            Self::Fractional => {
                json!({"koordinator.sh/gpu-core": share, "koordinator.sh/gpu-memory-ratio": share})
            }
            Self::Dra => json!({}),
        }
    }
}
/// Where the bench's extender listens (mutual TLS), its probes and its metrics.
const TLS_PORT: u16 = 18889;
const PROBE_PORT: u16 = 18890;
const METRICS_PORT: u16 = 18891;

/// One round: N pods created at once, each timed from its create to its bind.
#[derive(Debug)]
pub struct Round {
    /// What the round's pods ask for.
    pub name: &'static str,
    /// Create returned → the watch showed `spec.nodeName`, per pod.
    pub latencies: Vec<Duration>,
    /// First create sent → last pod bound.
    pub wall: Duration,
    /// First create sent → last create returned.
    pub creating: Duration,
}

impl Round {
    /// Pods placed per second over the round.
    pub fn rate(&self) -> f64 {
        self.latencies.len() as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// The `q` quantile of the create→bind latencies.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let at = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
        sorted.get(at).copied().unwrap_or_default()
    }
}

/// Brings a cluster up, puts tessera-scheduler behind mutual TLS, runs the baseline
/// round and the fractional-GPU round with `pods` pods each on `nodes` fake nodes
/// (at least enough for the pods), and prints them.
pub async fn run(
    pods: usize,
    nodes: Option<usize>,
    rounds: usize,
    qps: Option<u32>,
    profile: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    ensure!(pods > 0, "--pods must be at least 1");
    ensure!(rounds > 0, "--rounds must be at least 1");
    let binaries = K8sBinaries::locate()?.context(
        "no Kubernetes binaries: set TESSERA_K8S_BIN or put ../shared/k8s/bin beside the repository",
    )?;
    let begun = Instant::now();
    let mut cluster = Cluster::start(binaries, ClusterOptions::default()).await?;
    eprintln!(
        "cluster up in {:.1} s ({})",
        begun.elapsed().as_secs_f64(),
        cluster.dir().display()
    );
    let client = cluster.client().await?;
    let extender = start_tls_extender(&mut cluster).await?;
    if let Some(qps) = qps {
        cluster
            .set_scheduler_client_qps(qps, qps.saturating_mul(2))
            .await?;
    }
    let nodes = nodes
        .unwrap_or(0)
        .max((pods * rounds).div_ceil(GPUS * 100 / SHARE) + 1);
    let outcome = async {
        let adding = Instant::now();
        add_fake_nodes(&client, nodes).await?;
        add_dra_template(&client).await?;
        wait_for_metric(
            &format!(
                "tessera_scheduler_node_gpus{{node=\"{}\"}} {GPUS}",
                node_name(nodes - 1)
            ),
            Duration::from_secs(60 + nodes as u64 / 20),
        )
        .await?;
        eprintln!(
            "{nodes} fake nodes and their Device CRs in {:.1} s",
            adding.elapsed().as_secs_f64()
        );
        // CPU time of each process in the path, per round: where a placement's cost is.
        let pids = [
            ("kube-scheduler", cluster.pid(Component::Scheduler)),
            ("kube-apiserver", cluster.pid(Component::ApiServer)),
            ("etcd", cluster.pid(Component::Etcd)),
            ("tessera-scheduler", extender.id()),
        ];
        let profiled = [pids[0], pids[3]];
        // Rounds alternate between the kinds: what loads the machine meanwhile
        // (a 2-core VM's neighbours, a GC) falls on each alike.
        let mut by_kind: [Vec<Round>; 4] = Default::default();
        let mut cpu = [(); 4].map(|()| vec![0.0; pids.len()]);
        let mut calls: [ApiCalls; 4] = Default::default();
        let bind_before = bind_histogram().await?;
        let mut spent = 0.0;
        for round in 0..rounds {
            for (index, kind) in PodKind::ALL.into_iter().enumerate() {
                let before = cpu_of(&pids);
                let calls_before = api_calls(&client).await?;
                let spent_before = extender_seconds().await?;
                let profiling = profile.filter(|_| round == 0);
                let recording = Profile::start(profiling, &profiled, kind.tag())?;
                by_kind[index].push(place(&client, pods, kind, round).await?);
                recording.stop();
                if kind == PodKind::Fractional {
                    spent += extender_seconds().await? - spent_before;
                }
                let after = cpu_of(&pids);
                add_delta(&mut calls[index], &calls_before, &api_calls(&client).await?);
                for (total, (b, a)) in cpu[index].iter_mut().zip(before.iter().zip(&after)) {
                    *total += a - b;
                }
            }
        }
        let placed = (pods * rounds) as f64;
        let heading = "(no GPU / unmanaged extended / fractional GPU / DRA claim)";
        println!("CPU milliseconds per pod, by process {heading}:");
        for (index, (name, _)) in pids.iter().enumerate() {
            let [p, u, g, d] = cpu.each_ref().map(|kind| kind[index] * 1e3 / placed);
            println!("  {name:<18} {p:>8.2} {u:>8.2} {g:>8.2} {d:>8.2}");
        }
        println!("API server requests per pod, by verb and resource {heading}:");
        let kinds: std::collections::BTreeSet<&String> =
            calls.iter().flat_map(|c| c.keys()).collect();
        for kind in kinds {
            let [p, u, g, d] = calls
                .each_ref()
                .map(|calls| calls.get(kind).copied().unwrap_or(0.0) / placed);
            // Below a request per 20 pods: the control plane's own background.
            if p.max(u).max(g).max(d) >= 0.05 {
                println!("  {kind:<40} {p:>8.2} {u:>8.2} {g:>8.2} {d:>8.2}");
            }
        }
        let bind_after = bind_histogram().await?;
        let binds = histogram_delta(&bind_before, &bind_after);
        print(&by_kind, nodes, qps, &binds, spent);
        anyhow::Ok(())
    }
    .await;
    let cleanup = clean_up(&client, nodes).await;
    drop(extender);
    if outcome.is_err() {
        eprintln!(
            "--- kube-scheduler log (tail) ---\n{}",
            cluster.log_tail(Component::Scheduler, 30)
        );
        let log = cluster.dir().join("logs/bench-extender.log");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        eprintln!(
            "--- bench extender log (tail) ---\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    outcome?;
    cleanup
}

/// `apiserver_request_total` summed by `verb resource/subresource`.
type ApiCalls = std::collections::BTreeMap<String, f64>;

/// The API server's request counts so far, from its /metrics.
async fn api_calls(client: &Client) -> anyhow::Result<ApiCalls> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .context("reading kube-apiserver's /metrics")?;
    let mut calls = ApiCalls::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let subresource = label("subresource");
        let kind = if subresource.is_empty() {
            format!("{} {}", label("verb"), label("resource"))
        } else {
            format!("{} {}/{subresource}", label("verb"), label("resource"))
        };
        *calls.entry(kind).or_default() += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    Ok(calls)
}

/// Adds `after - before` into `total`, per kind of request.
fn add_delta(total: &mut ApiCalls, before: &ApiCalls, after: &ApiCalls) {
    for (kind, count) in after {
        let delta = count - before.get(kind).copied().unwrap_or(0.0);
        *total.entry(kind.clone()).or_default() += delta;
    }
}

/// `perf record` of some processes over one round, when asked for.
struct Profile(Vec<std::process::Child>);

impl Profile {
    /// Starts `perf record -g` on each process into `dir/<name>-<round>.data`
    /// (nothing without `dir`).
    fn start(
        dir: Option<&std::path::Path>,
        processes: &[(&str, Option<u32>)],
        round: &str,
    ) -> anyhow::Result<Self> {
        let Some(dir) = dir else {
            return Ok(Self(Vec::new()));
        };
        std::fs::create_dir_all(dir).with_context(|| format!("--profile {}", dir.display()))?;
        let mut children = Vec::new();
        for (name, pid) in processes {
            let Some(pid) = pid else { continue };
            let out = dir.join(format!("{name}-{round}.data"));
            let child = std::process::Command::new("perf")
                .args([
                    "record",
                    "-F",
                    "999",
                    "-g",
                    "-q",
                    "-p",
                    &pid.to_string(),
                    "-o",
                ])
                .arg(&out)
                .stdout(std::process::Stdio::null())
                .spawn()
                .context("--profile: starting perf (apt-get install linux-perf)")?;
            children.push(child);
        }
        // perf attaches in a moment; the round's first pods are not missed much.
        std::thread::sleep(Duration::from_millis(300));
        Ok(Self(children))
    }

    /// Stops each recording (SIGINT: perf writes its file and exits).
    fn stop(self) {
        for mut child in self.0 {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGINT,
                );
            }
            let _ = child.wait();
        }
    }
}

fn node_name(index: usize) -> String {
    format!("bench-node-{index:04}")
}

/// Writes the CA and certificates (`tessera-scheduler certs`), stops the harness's
/// loopback extender, starts one with mutual TLS and points kube-scheduler at it
/// with its client certificate. Returns the extender process (killed on drop).
async fn start_tls_extender(cluster: &mut Cluster) -> anyhow::Result<tokio::process::Child> {
    let scheduler = tessera_binary("tessera-scheduler")?;
    let pki = cluster.dir().join("bench-pki");
    let tls = ExtenderTls::make(&pki, "tessera-system")?;
    // One leader: the harness's replica lets go of the Lease on SIGTERM.
    cluster.stop(Component::Extender)?;
    let log = std::fs::File::create(cluster.dir().join("logs/bench-extender.log"))?;
    let path = |name: &str| pki.join(name).display().to_string();
    let child = tokio::process::Command::new(&scheduler)
        .arg("serve")
        .arg(format!("--listen=127.0.0.1:{TLS_PORT}"))
        .arg(format!("--tls-cert-file={}", path("tessera-scheduler.crt")))
        .arg(format!("--tls-key-file={}", path("tessera-scheduler.key")))
        .arg(format!("--client-ca-file={}", path("ca.crt")))
        .arg(format!("--probe-listen=127.0.0.1:{PROBE_PORT}"))
        .arg(format!("--metrics-listen=127.0.0.1:{METRICS_PORT}"))
        .arg(format!(
            "--kubeconfig={}",
            cluster.dir().join("extender.kubeconfig").display()
        ))
        .arg(format!("--advertise-url=https://127.0.0.1:{TLS_PORT}"))
        .arg("--identity=tessera-bench-extender")
        .env("RUST_LOG", "warn")
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", scheduler.display()))?;
    // Synced and leading: binds neither refused nor handed over.
    wait_for_metric("tessera_scheduler_leader 1", Duration::from_secs(90)).await?;
    wait_for_metric("tessera_scheduler_cache_synced 1", Duration::from_secs(30)).await?;

    cluster
        .set_extender(&format!("https://127.0.0.1:{TLS_PORT}"), Some(&tls))
        .await?;
    Ok(child)
}

/// Fake nodes `bench-node-NNN`: Ready, `GPUS` GPUs in their Device CR and in the
/// aggregate resources kube-scheduler counts, no kubelet behind them.
async fn add_fake_nodes(client: &Client, count: usize) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let devices: Api<tessera_api::Device> = Api::all(client.clone());
    let percent = (GPUS * 100).to_string();
    // 32 in flight: thousands of nodes in seconds, not minutes.
    futures_util::stream::iter(0..count)
        .map(|index| {
            let (nodes, devices, percent) = (nodes.clone(), devices.clone(), percent.clone());
            async move { add_fake_node(&nodes, &devices, &percent, index).await }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn add_fake_node(
    nodes: &Api<Node>,
    devices: &Api<tessera_api::Device>,
    percent: &str,
    index: usize,
) -> anyhow::Result<()> {
    {
        let name = node_name(index);
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {BENCH_LABEL: "true", "kubernetes.io/hostname": name}},
            "status": {
                "capacity": {"cpu": "64", "memory": "256Gi", "pods": "1000",
                    "koordinator.sh/gpu-core": percent, "koordinator.sh/gpu-memory-ratio": percent,
                    UNMANAGED[0]: percent, UNMANAGED[1]: percent},
                "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "1000",
                    "koordinator.sh/gpu-core": percent, "koordinator.sh/gpu-memory-ratio": percent,
                    UNMANAGED[0]: percent, UNMANAGED[1]: percent},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "tessera-bench fake node", "lastHeartbeatTime": now(), "lastTransitionTime": now()}]
            }
        }))?;
        nodes.create(&PostParams::default(), &node).await?;
        let gpus: Vec<serde_json::Value> = (0..GPUS)
            .map(|g| {
                json!({"type": "gpu", "id": format!("GPU-{name}-{g}"), "minor": g, "health": true,
                       "resources": {"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory-ratio": "100",
                                     "koordinator.sh/gpu-memory": (80u64 << 30).to_string()}})
            })
            .collect();
        let device: tessera_api::Device = serde_json::from_value(json!({
            "apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
            "metadata": {"name": name, "labels": {BENCH_LABEL: "true"}}, "spec": {"devices": gpus}
        }))?;
        devices.create(&PostParams::default(), &device).await?;
        // The same GPUs for the DRA rounds, as `tessera-reporter --dra` publishes them.
        let (mut slice, _) = tessera_api::dra::resource_slice(&name, &device, 1)?;
        slice.metadata.labels = Some([(BENCH_LABEL.to_owned(), "true".to_owned())].into());
        Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(nodes.clone().into_client())
            .create(&PostParams::default(), &slice)
            .await?;
    }
    Ok(())
}

fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// Creates `count` pods named `bench-<kind><round>-N` at once (16 creates in
/// flight) and waits until every one is bound.
async fn place(
    client: &Client,
    count: usize,
    kind: PodKind,
    round: usize,
) -> anyhow::Result<Round> {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let kind_round = format!("{}{round}", kind.tag());
    let selector = format!("{BENCH_LABEL}={kind_round}");
    let bound: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
    let watch = {
        let bound = Arc::clone(&bound);
        let stream = watcher(api.clone(), watcher::Config::default().labels(&selector));
        tokio::spawn(async move {
            let mut synced = Some(synced_tx);
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                        let on_node = pod
                            .spec
                            .as_ref()
                            .and_then(|s| s.node_name.as_deref())
                            .is_some_and(|n| !n.is_empty());
                        if on_node && let Some(name) = pod.metadata.name {
                            bound
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .entry(name)
                                .or_insert_with(Instant::now);
                        }
                    }
                    _ => {}
                }
            }
        })
    };
    synced_rx
        .await
        .context("the pod watch ended before listing")?;
    let limits = kind.limits();
    // A DRA pod's claim, made from the template by kube-controller-manager.
    let (claims, claim_refs) = if kind == PodKind::Dra {
        (
            json!([{"name": "gpu", "resourceClaimTemplateName": DRA_TEMPLATE}]),
            json!([{"name": "gpu"}]),
        )
    } else {
        (json!([]), json!([]))
    };
    let started = Instant::now();
    let created: Vec<(String, Instant)> = futures_util::stream::iter(0..count)
        .map(|index| {
            let api = api.clone();
            let (claims, claim_refs) = (claims.clone(), claim_refs.clone());
            let name = format!("bench-{kind_round}-{index}");
            let pod: anyhow::Result<Pod> = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {BENCH_LABEL: kind_round}},
                "spec": {
                    "nodeSelector": {BENCH_LABEL: "true"},
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": false,
                    "resourceClaims": claims,
                    "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": limits, "claims": claim_refs}}]
                }
            }))
            .map_err(Into::into);
            async move {
                api.create(&PostParams::default(), &pod?)
                    .await
                    .with_context(|| format!("creating pod {name}"))?;
                anyhow::Ok((name, Instant::now()))
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    let creating = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60 + count as u64 / 2);
    loop {
        let done = bound
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        if done >= count {
            break;
        }
        if Instant::now() > deadline {
            watch.abort();
            bail!("{kind_round} round: {done} of {count} pods bound before the deadline");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watch.abort();
    let bound = bound
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let last = bound.values().max().copied().unwrap_or(started);
    let latencies = created
        .iter()
        .map(|(name, at)| {
            bound
                .get(name)
                .map(|b| b.saturating_duration_since(*at))
                .unwrap_or_default()
        })
        .collect();
    Ok(Round {
        name: kind.describe(),
        latencies,
        wall: last.saturating_duration_since(started),
        creating,
    })
}

/// Each process's CPU time (user + kernel, seconds; 0 where it cannot be read).
fn cpu_of(pids: &[(&str, Option<u32>)]) -> Vec<f64> {
    pids.iter()
        .map(|(_, pid)| {
            pid.map_or(0.0, |pid| {
                crate::bench_pods::cpu_seconds(format!("/proc/{pid}/stat"))
            })
        })
        .collect()
}

/// Seconds the extender has spent answering filter and prioritize (its latency
/// histograms' sums): inside kube-scheduler's scheduling cycle, which is serial.
async fn extender_seconds() -> anyhow::Result<f64> {
    let text = metrics().await?;
    Ok(text
        .lines()
        .filter_map(|line| line.strip_prefix("tessera_scheduler_request_duration_seconds_sum{"))
        .filter(|rest| rest.contains("verb=\"filter\"") || rest.contains("verb=\"prioritize\""))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// `(le, cumulative count)` of the extender's bind latency histogram.
async fn bind_histogram() -> anyhow::Result<Vec<(f64, f64)>> {
    let text = metrics().await?;
    let mut buckets = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("tessera_scheduler_request_duration_seconds_bucket{")
        else {
            continue;
        };
        if !rest.contains("verb=\"bind\"") {
            continue;
        }
        let le = rest
            .split("le=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .map(|s| {
                if s == "+Inf" {
                    f64::INFINITY
                } else {
                    s.parse().unwrap_or(f64::NAN)
                }
            });
        let count = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let (Some(le), Some(count)) = (le, count) {
            buckets.push((le, count));
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(buckets)
}

fn histogram_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|(le, count)| {
            let earlier = before
                .iter()
                .find(|(l, _)| l == le)
                .map_or(0.0, |(_, c)| *c);
            (*le, count - earlier)
        })
        .collect()
}

/// The upper bound of the bucket holding the `q` quantile.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, count)| *count >= total * q)
        .map(|(le, _)| *le)
}

async fn metrics() -> anyhow::Result<String> {
    use http_body_util::{BodyExt, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let uri: http::Uri = format!("http://127.0.0.1:{METRICS_PORT}/metrics").parse()?;
    let response = client.get(uri).await?;
    let body = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Waits until the bench extender's metrics hold `line`.
async fn wait_for_metric(line: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = metrics().await
            && text.lines().any(|l| l == line)
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the bench extender's metrics never showed {line:?} in {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn clean_up(client: &Client, nodes: usize) -> anyhow::Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete_collection(&now, &ListParams::default().labels(BENCH_LABEL))
        .await?;
    let fake = ListParams::default().labels(&format!("{BENCH_LABEL}=true"));
    Api::<Node>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake)
        .await
        .with_context(|| format!("deleting the {nodes} fake nodes"))?;
    Api::<tessera_api::Device>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake)
        .await
        .context("deleting the fake nodes' Device CRs")?;
    Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
        .delete_collection(&DeleteParams::default(), &fake)
        .await
        .context("deleting the fake nodes' ResourceSlices")?;
    Ok(())
}

/// The DeviceClass and the template every DRA round's claim is made from: the
/// share a fractional pod asks ([`SHARE`] percent of compute and of memory).
async fn add_dra_template(client: &Client) -> anyhow::Result<()> {
    use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
    Api::<DeviceClass>::all(client.clone())
        .create(&PostParams::default(), &tessera_api::dra::device_class())
        .await
        .context("creating the DeviceClass")?;
    let memory = (80u64 << 30) / 100 * SHARE as u64;
    let template: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": DRA_TEMPLATE, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": tessera_api::dra::DEVICE_CLASS,
            "capacity": {"requests": {"cores": SHARE.to_string(), "memory": memory.to_string()}}}}]}}}
    }))?;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &template)
        .await
        .context("creating the ResourceClaimTemplate")?;
    Ok(())
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// The median of `values` (the upper one of an even count; 0 when none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or_default()
}

fn print(
    by_kind: &[Vec<Round>; 4],
    nodes: usize,
    qps: Option<u32>,
    binds: &[(f64, f64)],
    extender: f64,
) {
    let [plain, unmanaged, gpu, dra] = by_kind;
    let pods = plain.first().map_or(0, |r| r.latencies.len());
    println!(
        "tessera-bench cluster: {pods} pods created at once per round (16 creates in flight), {} rounds of each kind, alternating, on {nodes} fake nodes × {GPUS} GPUs; real kube-scheduler 1.36, tessera-scheduler behind mutual TLS",
        plain.len()
    );
    println!(
        "{:<34} {:>10} {:>12} {:>14} {:>14} {:>10}",
        "pods", "create s", "placed/s", "bind p50", "bind p99", "bind max"
    );
    for index in 0..plain.len() {
        for round in by_kind.iter().filter_map(|rounds| rounds.get(index)) {
            println!(
                "{:<34} {:>10.2} {:>12.1} {:>12.1}ms {:>12.1}ms {:>8.1}ms",
                format!("{} #{}", round.name, index + 1),
                round.creating.as_secs_f64(),
                round.rate(),
                ms(round.quantile(0.5)),
                ms(round.quantile(0.99)),
                ms(round.quantile(1.0)),
            );
        }
    }
    let rates = |rounds: &[Round]| median(rounds.iter().map(Round::rate).collect());
    let p99s = |rounds: &[Round]| median(rounds.iter().map(|r| ms(r.quantile(0.99))).collect());
    let p50s = |rounds: &[Round]| median(rounds.iter().map(|r| ms(r.quantile(0.5))).collect());
    for (own, what, base, against) in [
        (gpu, "fractional GPU", plain, "no GPU"),
        (gpu, "fractional GPU", unmanaged, "unmanaged extended"),
        (dra, "DRA claim", plain, "no GPU"),
        (gpu, "fractional GPU (extender)", dra, "DRA claim"),
    ] {
        let pairs: Vec<String> = base
            .iter()
            .zip(own)
            .map(|(b, g)| format!("{:.2}", g.rate() / b.rate().max(1e-9)))
            .collect();
        println!(
            "ratio {what} / {against} (medians of the rounds): placed/s {:.2} (each pair: {}), bind p50 {:.2}, bind p99 {:.2}",
            rates(own) / rates(base).max(1e-9),
            pairs.join(" "),
            p50s(own) / p50s(base).max(1e-9),
            p99s(own) / p99s(base).max(1e-9),
        );
    }
    // kube-scheduler schedules one pod at a time: the extender's filter and
    // prioritize answers are that share of the rounds' serial scheduling time.
    let placed: usize = gpu.iter().map(|r| r.latencies.len()).sum();
    let wall: f64 = gpu.iter().map(|r| r.wall.as_secs_f64()).sum();
    println!(
        "extender filter + prioritize: {:.2} ms per pod, {:.0}% of the fractional rounds' wall time",
        extender * 1e3 / placed.max(1) as f64,
        100.0 * extender / wall.max(1e-9)
    );
    let bound =
        |q| bucket_quantile(binds, q).map_or("-".to_owned(), |s| format!("≤ {:.1}ms", s * 1e3));
    let client = qps.map_or_else(
        || "deploy/'s (kube-scheduler's own 50 QPS, bursts of 100)".to_owned(),
        |qps| format!("{qps} QPS, bursts of {}", qps.saturating_mul(2)),
    );
    println!(
        "(bind = pod created → spec.nodeName seen by a watch; kube-scheduler binds plain pods through its own API client, {client}, the extender binds fractional ones with its own; the extender's own /bind, from its histogram: p50 {}, p99 {})",
        bound(0.5),
        bound(0.99)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_of_rounds_and_histograms() {
        let round = Round {
            name: "x",
            latencies: (1..=100).map(Duration::from_millis).collect(),
            wall: Duration::from_secs(2),
            creating: Duration::from_secs(1),
        };
        assert_eq!(round.quantile(0.5), Duration::from_millis(50));
        assert_eq!(round.quantile(0.99), Duration::from_millis(99));
        assert!((round.rate() - 50.0).abs() < 1e-9);
        let before = [(0.001, 1.0), (0.002, 1.0), (f64::INFINITY, 1.0)];
        let after = [(0.001, 3.0), (0.002, 10.0), (f64::INFINITY, 11.0)];
        let delta = histogram_delta(&before, &after);
        assert_eq!(delta, [(0.001, 2.0), (0.002, 9.0), (f64::INFINITY, 10.0)]);
        assert_eq!(bucket_quantile(&delta, 0.5), Some(0.002));
        assert_eq!(bucket_quantile(&delta, 0.99), Some(f64::INFINITY));
        assert_eq!(bucket_quantile(&[], 0.5), None);
    }
}
