//! End to end on a real one-node cluster: kube-apiserver, kube-controller-manager,
//! kube-scheduler with tessera-scheduler as its extender (deploy/'s
//! configuration), kubelet → tessera-runtime-proxy → containerd 2.x, NVIDIA's
//! device plugin on the fake NVML library, tessera-reporter.
//!
//! One cluster serves every scenario, in order (kubelet's device-plugin path is
//! fixed, so clusters cannot run side by side). Its own harness (`harness =
//! false`): `cargo test --test cluster -- NAME` runs the scenarios whose name
//! contains NAME. Without Kubernetes binaries it skips loudly, and fails when
//! `TESSERA_REQUIRE_CLUSTER=1` (the test command sets it). It lives in the harness
//! crate, which links no product crate: it tests the binaries users install.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tessera_harness::cluster::{
    ALLOCATED, Cluster, ClusterOptions, Component, K8sBinaries, allocated_gpus, env_values,
    gpu_device_minors, probe_pod as pod, runtime_env,
};
use tessera_harness::image::CUDA_PROBE_IMAGE;

#[path = "cluster/chart.rs"]
mod chart;
#[path = "cluster/enforcement.rs"]
mod enforcement;
#[path = "cluster/faults.rs"]
mod faults;
#[path = "cluster/integrity.rs"]
mod integrity;
#[path = "cluster/migration.rs"]
mod migration;
#[path = "cluster/observability.rs"]
mod observability;
#[path = "cluster/preemption.rs"]
mod preemption;
#[path = "cluster/prometheus.rs"]
mod prometheus;
#[path = "cluster/topology.rs"]
mod topology;

/// The namespace the proxy's GPU hook trusts (`--trusted-gpu-agents`), as an
/// operator would trust `gpu-operator`.
const AGENTS_NAMESPACE: &str = "tessera-agents";

type Scenario =
    for<'a> fn(&'a mut Cluster) -> Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;

fn scenarios() -> Vec<(&'static str, Scenario)> {
    vec![
        ("fractional_pods_get_exactly_their_grant", |c| {
            Box::pin(fractional_pods(c))
        }),
        ("unfit_pod_stays_pending_with_the_extenders_reason", |c| {
            Box::pin(unfit_pod(c))
        }),
        ("legacy_pod_runs_with_the_device_plugins_gpu", |c| {
            Box::pin(legacy_pod(c))
        }),
        ("annotation_written_by_a_tenant_is_refused", |c| {
            Box::pin(forged_on_create(c))
        }),
        (
            "annotation_forged_on_any_write_path_never_yields_a_gpu",
            |c| Box::pin(forged_write_paths(c)),
        ),
        ("device_env_in_the_pod_spec_never_widens_a_grant", |c| {
            Box::pin(env_never_widens(c))
        }),
        (
            "each_container_gets_its_own_share_and_a_sidecar_none",
            |c| Box::pin(per_container(c)),
        ),
        (
            "trusted_gpu_agents_keep_their_env_privileged_gpu_pods_are_refused",
            |c| Box::pin(trusted_agents_and_privileged(c)),
        ),
        (
            "nvidia_device_plugin_as_a_trusted_pod_keeps_working_behind_the_proxy",
            |c| Box::pin(device_plugin_pod(c)),
        ),
        (
            "reporter_daemonset_from_its_built_image_publishes_the_node",
            |c| Box::pin(reporter_image(c)),
        ),
        (
            "node_switch_over_is_proven_before_the_taint_goes_and_undone_by_switch_back",
            |c| Box::pin(switch_over(c)),
        ),
        (
            "node_cleanup_says_when_a_reporter_process_puts_it_back",
            |c| Box::pin(cleanup_beside_a_reporter_process(c)),
        ),
        (
            "hami_volcano_and_koordinator_manifests_get_their_own_semantics",
            |c| Box::pin(compat_manifests(c)),
        ),
        (
            "kubeshare_annotation_pods_are_translated_at_admission_and_share_by_group",
            |c| Box::pin(kubeshare(c)),
        ),
        ("kubeshare_sharepods_are_made_into_their_pods", |c| {
            Box::pin(sharepods(c))
        }),
        ("k8sgpusharing_mtgpupods_are_made_into_their_pods", |c| {
            Box::pin(mtgpupods(c))
        }),
        ("readme_first_pod_runs_and_inspect_shows_its_grant", |c| {
            Box::pin(migration::readme_first_pod_runs_and_inspect_shows_its_grant(c))
        }),
        ("migration_guides_examples_run_as_written", |c| {
            Box::pin(migration::migration_guides_examples_run_as_written(c))
        }),
        (
            "shared_containers_get_driver_memory_limits_on_their_own_cgroup",
            |c| Box::pin(enforcement::driver_memory_limits_on_the_containers_own_cgroup(c)),
        ),
        (
            "hami_core_is_preloaded_in_shared_containers_even_under_env_i",
            |c| Box::pin(enforcement::hami_core_is_preloaded_even_under_env_i(c)),
        ),
        ("gpu_time_holds_a_compute_share", |c| {
            Box::pin(enforcement::gpu_time_holds_a_compute_share(c))
        }),
        ("gpu_memory_use_is_reported_against_each_grant", |c| {
            Box::pin(enforcement::gpu_memory_use_is_reported_against_each_grant(
                c,
            ))
        }),
        (
            "mps_holds_each_shared_container_in_its_own_namespace",
            |c| Box::pin(enforcement::mps_holds_each_shared_container_in_its_own_namespace(c)),
        ),
        (
            "required_enforcement_places_pods_only_where_the_node_holds_it",
            |c| Box::pin(enforcement::required_enforcement_places_only_where_held(c)),
        ),
        (
            "pods_naming_koordinator_volcano_kubeshare_or_hami_schedulers_are_placed",
            |c| Box::pin(integrity::other_systems_scheduler_names_are_served(c)),
        ),
        (
            "sharing_groups_hold_no_more_gpus_than_their_namespaces_allowance",
            |c| {
                Box::pin(
                    integrity::sharing_groups_hold_no_more_gpus_than_their_namespaces_allowance(c),
                )
            },
        ),
        ("tenant_host_paths_to_node_files_are_refused", |c| {
            Box::pin(integrity::tenant_host_paths_to_node_files_are_refused(c))
        }),
        (
            "tenant_pods_are_held_to_pod_security_where_the_chart_enforces_it",
            |c| {
                Box::pin(
                    integrity::tenant_pods_are_held_to_pod_security_where_the_chart_enforces_it(c),
                )
            },
        ),
        (
            "gpu_pods_that_would_skip_tessera_scheduler_are_refused_at_creation",
            |c| Box::pin(integrity::gpu_pods_that_would_skip_tessera_scheduler_are_refused(c)),
        ),
        ("impossible_gpu_requests_are_refused_at_creation", |c| {
            Box::pin(integrity::impossible_gpu_requests_are_refused_at_creation(
                c,
            ))
        }),
        ("node_agents_write_only_their_own_node", |c| {
            Box::pin(integrity::node_agents_write_only_their_own_node(c))
        }),
        (
            "device_plugin_bypass_by_node_name_never_gets_a_shared_gpu",
            |c| Box::pin(integrity::device_plugin_bypass_never_gets_a_shared_gpu(c)),
        ),
        ("restarts_lose_nothing", |c| Box::pin(restarts(c))),
        ("faults_two_replicas_place_a_burst_once", |c| {
            Box::pin(faults::two_replicas(c))
        }),
        ("faults_slow_binding_webhook_books_nothing_twice", |c| {
            Box::pin(faults::slow_binding(c))
        }),
        ("faults_leader_killed_while_its_bindings_wait", |c| {
            Box::pin(faults::leader_killed_mid_bind(c))
        }),
        (
            "faults_scheduler_restart_during_a_burst_loses_nothing",
            |c| Box::pin(faults::restart_during_burst(c)),
        ),
        ("faults_apiserver_restart_relists_during_binds", |c| {
            Box::pin(faults::relist_during_binds(c))
        }),
        ("two_gpu_pod_lands_on_an_nvlink_pair", |c| {
            Box::pin(topology::two_gpu_pod_lands_on_an_nvlink_pair(c))
        }),
        (
            "gpu_allocated_event_names_the_gpu_and_metrics_count_the_bind",
            |c| Box::pin(observability::gpu_allocated_event_and_metrics(c)),
        ),
        (
            "chart_alerts_and_dashboard_load_in_a_real_prometheus_over_the_daemons",
            |c| Box::pin(prometheus::chart_monitoring_in_a_real_prometheus(c)),
        ),
        (
            "preemption_evicts_only_the_pods_on_the_gpu_the_pod_gets",
            |c| Box::pin(preemption::only_the_pods_on_the_gpu_the_preemptor_gets_are_evicted(c)),
        ),
    ]
}

/// The scenarios that run a second time against Tessera installed from the Helm
/// chart (the `chart/` suite): those that need none of the harness's own daemons
/// (restarts, their metrics ports, NVIDIA's device plugin, a changed deploy).
/// `device_env_in_the_pod_spec_never_widens_a_grant` is not among them: its
/// device-plugin pod is refused where NVIDIA's plugin serves nvidia.com/gpu, and is
/// a Tessera pod (its env overruled, as the other scenarios check) where the chart's
/// reporter does.
const ON_CHART: &[&str] = &[
    "fractional_pods_get_exactly_their_grant",
    "pods_naming_koordinator_volcano_kubeshare_or_hami_schedulers_are_placed",
    "tenant_host_paths_to_node_files_are_refused",
    "tenant_pods_are_held_to_pod_security_where_the_chart_enforces_it",
    "unfit_pod_stays_pending_with_the_extenders_reason",
    "annotation_written_by_a_tenant_is_refused",
    "annotation_forged_on_any_write_path_never_yields_a_gpu",
    "each_container_gets_its_own_share_and_a_sidecar_none",
    "trusted_gpu_agents_keep_their_env_privileged_gpu_pods_are_refused",
    "kubeshare_annotation_pods_are_translated_at_admission_and_share_by_group",
    "migration_guides_examples_run_as_written",
];

/// The chart suite's own steps, around the scenarios it runs.
const CHART_STEPS: &[&str] = &[
    "install_switch_and_place",
    "upgrade_and_uninstall_leave_nothing",
];

fn main() -> std::process::ExitCode {
    tessera_harness::init_tracing();
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |name: &str| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str()));
    let selected: Vec<_> = scenarios()
        .into_iter()
        .filter(|(name, _)| wanted(name))
        .collect();
    // The chart suite runs when its steps or one of its scenarios are asked for.
    let on_chart: Vec<_> = scenarios()
        .into_iter()
        .filter(|(name, _)| ON_CHART.contains(name) && wanted(&format!("chart/{name}")))
        .collect();
    let chart_suite =
        !on_chart.is_empty() || CHART_STEPS.iter().any(|s| wanted(&format!("chart/{s}")));
    let demo = wanted(DEMO);
    // `cargo test --workspace --list` and filters that select none: nothing to start.
    if (selected.is_empty() && !chart_suite && !demo) || std::env::args().any(|a| a == "--list") {
        for (name, _) in &selected {
            println!("{name}: test");
        }
        if chart_suite {
            for name in CHART_STEPS.iter().chain(on_chart.iter().map(|(n, _)| n)) {
                println!("chart/{name}: test");
            }
        }
        if demo {
            println!("{DEMO}: test");
        }
        return std::process::ExitCode::SUCCESS;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(selected, chart_suite.then_some(on_chart), demo)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cluster tests: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs `selected` on a cluster whose Tessera is the harness's own processes,
/// then, when asked, the chart suite with `on_chart` on a second cluster.
async fn run(
    selected: Vec<(&'static str, Scenario)>,
    on_chart: Option<Vec<(&'static str, Scenario)>>,
    demo: bool,
) -> anyhow::Result<bool> {
    let Some(binaries) = K8sBinaries::require_or_skip("cluster tests")? else {
        return Ok(true);
    };
    let mut failed = Vec::new();
    let mut passed = 0;
    if !selected.is_empty() {
        let (ok, bad) = harness_suite(binaries.clone(), &selected).await?;
        passed += ok;
        failed.extend(bad);
    }
    if let Some(on_chart) = on_chart {
        let started = Instant::now();
        let mut cluster = match Cluster::start(binaries, chart::options(AGENTS_NAMESPACE)).await {
            Ok(cluster) => cluster,
            Err(e) => {
                // Reported with the harness suite's failures, not in their place.
                println!("chart suite: its cluster did not start: {e:#}");
                failed.push(Failure::new("chart/(cluster start)".to_owned(), &e));
                return Ok(summarise(passed, &failed));
            }
        };
        println!(
            "cluster without Tessera's cluster side up in {:.1} s ({})",
            started.elapsed().as_secs_f64(),
            cluster.dir().display()
        );
        let bad = chart::suite(&mut cluster, &on_chart).await;
        passed += on_chart.len() + CHART_STEPS.len() - bad.len();
        if !bad.is_empty() {
            for component in [Component::RuntimeProxy, Component::Kubelet] {
                println!(
                    "--- chart suite: {component} log (tail) ---\n{}",
                    cluster.log_tail(component, 20)
                );
            }
        }
        failed.extend(bad);
    }
    if demo {
        // The demo starts (and tears down) a cluster of its own, as a user's does.
        let started = Instant::now();
        let secs = || started.elapsed().as_secs_f64();
        match migration::cluster_demo_tells_its_story().await {
            Ok(()) => {
                println!("test {DEMO} ... ok ({:.1} s)", secs());
                passed += 1;
            }
            Err(e) => {
                println!("test {DEMO} ... FAILED ({:.1} s)\n{e:#}\n", secs());
                failed.push(Failure::new(DEMO.to_owned(), &e));
            }
        }
    }
    Ok(summarise(passed, &failed))
}

/// `scripts/run.sh --cluster --exit` on a cluster of its own, after the suites.
const DEMO: &str = "demo/cluster_demo_tells_its_story";

/// Prints the suite's result line and each failure's reason; true when none failed.
fn summarise(passed: usize, failed: &[Failure]) -> bool {
    println!(
        "\ncluster test result: {}. {passed} passed; {} failed{}",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = failed.iter().map(|f| f.name.as_str()).collect();
            format!(": {}", names.join(", "))
        }
    );
    // Once more after the components' log tails, so the last lines of a long run
    // (all that a CI summary may keep) say why each failed.
    for failure in failed {
        println!("  {}: {}", failure.name, failure.reason);
    }
    failed.is_empty()
}

/// A scenario that failed: its name and its error, cut to what a summary line holds.
struct Failure {
    name: String,
    reason: String,
}

impl Failure {
    /// Errors longer than this are cut (the whole one is printed where it failed).
    const REASON_CHARS: usize = 600;

    fn new(name: String, error: &anyhow::Error) -> Self {
        // One line: a reason may quote a log.
        let whole = format!("{error:#}").replace('\n', " | ");
        let mut reason: String = whole.chars().take(Self::REASON_CHARS).collect();
        if reason.len() < whole.len() {
            reason.push_str(" …");
        }
        Self { name, reason }
    }
}

/// The scenarios on a cluster whose Tessera is the harness's processes; returns
/// how many passed and those that failed.
async fn harness_suite(
    binaries: K8sBinaries,
    selected: &[(&'static str, Scenario)],
) -> anyhow::Result<(usize, Vec<Failure>)> {
    let started = Instant::now();
    let options = ClusterOptions {
        // The GPU hook trusts one namespace of GPU agents; privileged containers
        // are left to the default policy (refuse-gpu), which the scenarios check.
        proxy_args: vec![format!("--trusted-gpu-agents={AGENTS_NAMESPACE}")],
        // Every scenario's shared containers go through the enforcement backends.
        enforcement: true,
        mps: true,
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(binaries, options).await?;
    println!(
        "cluster up in {:.1} s ({})",
        started.elapsed().as_secs_f64(),
        cluster.dir().display()
    );
    // The proxy's default (one containerd socket): this suite's kubelet goes
    // through the frame relay, the chart suite's through `--relay=h2`.
    ensure!(
        cluster
            .log(Component::RuntimeProxy)
            .contains("relay=frames"),
        "the proxy does not say it serves kubelet through the frame relay (its default)"
    );
    let mut failed = Vec::new();
    for (name, scenario) in selected {
        let started = Instant::now();
        let outcome = scenario(&mut cluster).await;
        let secs = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => println!("test {name} ... ok ({secs:.1} s)"),
            Err(e) => {
                println!("test {name} ... FAILED ({secs:.1} s)\n{e:#}\n");
                failed.push(Failure::new((*name).to_owned(), &e));
            }
        }
    }
    if !failed.is_empty() {
        for component in [
            Component::RuntimeProxy,
            Component::Extender,
            Component::Reporter,
            Component::Containerd,
            Component::Kubelet,
        ] {
            println!(
                "--- {component} log (tail) ---\n{}",
                cluster.log_tail(component, 20)
            );
        }
    }
    Ok((selected.len() - failed.len(), failed))
}

/// Checks a container's spec against the GPUs granted to it: exactly one
/// `NVIDIA_VISIBLE_DEVICES`, naming them, and only their device nodes.
fn assert_grant(
    pod: &str,
    container: &str,
    spec: &Value,
    gpus: &[(String, u64)],
) -> anyhow::Result<()> {
    let visible = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
    let want = gpus
        .iter()
        .map(|(id, _)| id.as_str())
        .collect::<Vec<_>>()
        .join(",");
    ensure!(
        visible == [want.clone()],
        "pod {pod} container {container}: NVIDIA_VISIBLE_DEVICES entries {visible:?}, want exactly [{want:?}]"
    );
    let minors = gpu_device_minors(spec);
    let want: BTreeSet<u64> = gpus.iter().map(|(_, m)| *m).collect();
    ensure!(
        minors == want,
        "pod {pod} container {container}: GPU device nodes of minors {minors:?}, want {want:?}"
    );
    Ok(())
}

/// Creates, as the admin, a pod of one container `main` with `limits`.
async fn create_one(cluster: &Cluster, name: &str, limits: Value) -> anyhow::Result<()> {
    cluster
        .create_pod("admin", &pod(name, &[("main", limits)], &[]))
        .await
        .map(drop)
}

// === scenarios ===

/// Every fractional resource kind goes through kube-scheduler → the extender →
/// the proxy's GPU hook, and the container gets exactly its grant.
async fn fractional_pods(cluster: &mut Cluster) -> anyhow::Result<()> {
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        (
            "frac-core-ratio",
            json!({"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}),
            Some("50"),
        ),
        ("frac-gpu", json!({"koordinator.sh/gpu": "25"}), Some("25")),
        (
            "frac-memory",
            json!({"koordinator.sh/gpu-memory": "8Gi"}),
            None,
        ),
        (
            "frac-hami",
            json!({"nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}),
            Some("30"),
        ),
        ("frac-gpushare", json!({"aliyun.com/gpu-mem": "2"}), None),
        (
            "frac-volcano",
            json!({"volcano.sh/gpu-memory": "1024"}),
            None,
        ),
        ("frac-two-gpus", json!({"koordinator.sh/gpu": "200"}), None),
    ];
    for (name, limits, _) in &cases {
        cluster
            .create_pod("admin", &pod(name, &[("main", limits.clone())], &[]))
            .await?;
    }
    for (name, limits, sm_limit) in &cases {
        let pod = cluster.wait_running(name).await?;
        let gpus = allocated_gpus(&pod)?;
        let want_gpus = if *name == "frac-two-gpus" { 2 } else { 1 };
        ensure!(
            gpus.len() == want_gpus,
            "pod {name} ({limits}): granted {gpus:?}, want {want_gpus} GPU(s)"
        );
        let specs = cluster.container_specs(&pod)?;
        let spec = specs.get("main").context("no spec for main")?;
        assert_grant(name, "main", spec, &gpus)?;
        let sm = env_values(spec, "CUDA_DEVICE_SM_LIMIT");
        match sm_limit {
            Some(want) => ensure!(
                sm == [want.to_string()],
                "pod {name}: CUDA_DEVICE_SM_LIMIT {sm:?}, want [{want}]"
            ),
            // Memory alone, or whole GPUs: no compute limit.
            None => ensure!(
                sm.is_empty(),
                "pod {name}: CUDA_DEVICE_SM_LIMIT {sm:?}, want none"
            ),
        }
        if want_gpus == 1 {
            let memory = env_values(spec, "CUDA_DEVICE_MEMORY_LIMIT_0");
            ensure!(
                memory.len() == 1,
                "pod {name}: CUDA_DEVICE_MEMORY_LIMIT_0 {memory:?}, want one value"
            );
        }
        // The env gpushare's and Volcano's device plugins set, from the grant
        // (the fake GPUs have 80 GiB), only where the pod asked in their names.
        let index = allocated_gpus(&pod)?
            .first()
            .map(|(_, minor)| minor.to_string())
            .unwrap_or_default();
        let system_env: &[(&str, &str)] = match *name {
            "frac-gpushare" => &[
                ("ALIYUN_COM_GPU_MEM_IDX", &index),
                ("ALIYUN_COM_GPU_MEM_POD", "2"),
                ("ALIYUN_COM_GPU_MEM_CONTAINER", "2"),
                ("ALIYUN_COM_GPU_MEM_DEV", "80"),
            ],
            "frac-volcano" => &[
                ("VOLCANO_GPU_ALLOCATED", "1024"),
                ("VOLCANO_GPU_MEMORY_TOTAL", "81920"),
            ],
            _ => &[],
        };
        for (key, want) in system_env {
            ensure!(
                env_values(spec, key) == [want.to_string()],
                "pod {name}: {key} {:?}, want [{want}]",
                env_values(spec, key)
            );
        }
        let others = ["ALIYUN_COM_GPU_MEM_CONTAINER", "VOLCANO_GPU_ALLOCATED"]
            .iter()
            .filter(|key| !system_env.iter().any(|(k, _)| k == *key))
            .find(|key| !env_values(spec, key).is_empty());
        ensure!(
            others.is_none(),
            "pod {name}: {others:?} set, though it did not ask in that system's names"
        );
    }
    for (name, _, _) in &cases {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// A pod no GPU can hold stays Pending, and its events carry the extender's reason.
async fn unfit_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    // Too much memory for any GPU; and more whole GPUs than the node has, whose
    // reason names a percentage (kube-scheduler prints reasons as a format).
    for (name, limits) in [
        ("unfit", json!({"koordinator.sh/gpu-memory": "100Gi"})),
        ("unfit-gpus", json!({"koordinator.sh/gpu": "500"})),
    ] {
        unfit_one(cluster, name, limits).await?;
    }
    Ok(())
}

async fn unfit_one(cluster: &mut Cluster, name: &str, limits: Value) -> anyhow::Result<()> {
    create_one(cluster, name, limits).await?;
    let started = Instant::now();
    loop {
        let events = cluster.events_of(name).await?;
        if let Some(event) = events
            .iter()
            .find(|e| e.starts_with("FailedScheduling") && e.contains("GPU"))
        {
            tracing::info!(event, "extender's reason");
            ensure!(
                !event.contains("%!"),
                "pod {name}: the extender's reason reads as a broken format: {event}"
            );
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "pod {name}: no FailedScheduling event naming GPUs after 60 s; events: {events:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let pods: kube::Api<Pod> = kube::Api::namespaced(cluster.client().await?, "default");
    let pod = pods.get(name).await?;
    ensure!(
        pod.spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "pod {name} was bound to a node"
    );
    cluster.delete_pod(name).await
}

/// A `nvidia.com/gpu` pod is served by NVIDIA's real device plugin: it runs with
/// the GPU kubelet gave it (read back from kubelet's real checkpoint), the
/// reporter publishes that GPU as held, and the scheduler never hands it out.
/// Creates pod `default/name` asking `nvidia.com/gpu: 1` and binds it as another
/// scheduler would (as before Tessera was installed): kubelet asks the device
/// plugin, which picks the GPU; Tessera never saw the pod. Returns it Running.
async fn legacy_running(cluster: &mut Cluster, name: &str) -> anyhow::Result<Pod> {
    let mut spec = pod(name, &[("main", json!({"nvidia.com/gpu": "1"}))], &[]);
    spec["spec"]["schedulerName"] = json!("nobody");
    cluster.create_pod("admin", &spec).await?;
    cluster.bind_as_other_scheduler(name).await?;
    cluster.wait_running(name).await
}

async fn legacy_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    let name = "legacy";
    let running = legacy_running(cluster, name).await?;
    let uid = running.metadata.uid.clone().unwrap_or_default();
    let checkpoint = std::fs::read_to_string(tessera_harness::cluster::KUBELET_CHECKPOINT)
        .context("reading kubelet's checkpoint")?;
    let entries: Value = serde_json::from_str(&checkpoint)?;
    let entry = entries["Data"]["PodDeviceEntries"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["PodUID"] == uid.as_str())
        .with_context(|| {
            format!("kubelet's checkpoint has no entry for pod {uid}: {checkpoint}")
        })?;
    let ids: Vec<String> = entry["DeviceIDs"]
        .as_object()
        .into_iter()
        .flat_map(|numa| numa.values())
        .flat_map(|ids| ids.as_array().cloned().unwrap_or_default())
        .filter_map(|id| id.as_str().map(str::to_owned))
        .collect();
    ensure!(
        ids.len() == 1,
        "checkpoint entry names {ids:?}, want one GPU"
    );
    let gpu = cluster
        .gpu_node
        .gpus
        .iter()
        .find(|g| g.uuid == ids[0])
        .with_context(|| format!("device plugin gave {}, not a GPU of this node", ids[0]))?
        .clone();
    let specs = cluster.container_specs(&running)?;
    let spec = specs.get("main").context("no spec for main")?;
    ensure!(
        env_values(spec, "NVIDIA_VISIBLE_DEVICES") == [gpu.uuid.clone()],
        "legacy container: NVIDIA_VISIBLE_DEVICES {:?}, want [{}]",
        env_values(spec, "NVIDIA_VISIBLE_DEVICES"),
        gpu.uuid
    );

    // The reporter publishes the GPU as held by a device-plugin pod.
    let devices = tessera_harness::cluster::device_api(&cluster.client().await?);
    let started = Instant::now();
    loop {
        let device = devices.get(tessera_harness::cluster::NODE_NAME).await?;
        let held = device
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("node.koordinator.sh/devices-checkpoints"))
            .cloned()
            .unwrap_or_default();
        if held.contains(&gpu.uuid) && held.contains(&uid) {
            break;
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!(
                "Device CR does not record {} held by pod {uid}: {held:?}",
                gpu.uuid
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Whole-GPU Tessera pods fill every other GPU; none may land on the legacy one.
    let others = cluster.gpu_node.gpus.len() - 1;
    let mut names = Vec::new();
    for i in 0..others {
        let name = format!("whole-{i}");
        create_one(cluster, &name, json!({"koordinator.sh/gpu": "100"})).await?;
        names.push(name);
    }
    for name in &names {
        let pod = cluster.wait_running(name).await?;
        let gpus = allocated_gpus(&pod)?;
        ensure!(
            gpus.iter().all(|(id, _)| *id != gpu.uuid),
            "pod {name} was granted {} which the device plugin gave pod {uid}",
            gpu.uuid
        );
    }
    // And one more finds no room.
    create_one(cluster, "whole-extra", json!({"koordinator.sh/gpu": "100"})).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let pods: kube::Api<Pod> = kube::Api::namespaced(cluster.client().await?, "default");
    let extra = pods.get("whole-extra").await?;
    ensure!(
        extra
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "a fifth whole GPU was handed out on a 4-GPU node with one held by the device plugin: {:?}",
        extra.metadata.annotations
    );
    for name in names
        .iter()
        .map(String::as_str)
        .chain(["whole-extra", name])
    {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// An allocation annotation granting the node's first GPU whole, as a tenant
/// would forge it.
fn forged_annotation(cluster: &Cluster) -> String {
    let gpu = &cluster.gpu_node.gpus[0].uuid;
    json!({"gpu": [{"minor": 0, "id": gpu, "resources": {"koordinator.sh/gpu-core": 100}}]})
        .to_string()
}

/// A tenant cannot write the allocation annotation on create or update.
async fn forged_on_create(cluster: &mut Cluster) -> anyhow::Result<()> {
    // A forged grant, and an empty annotation (a write of the key all the same).
    for forged in [forged_annotation(cluster), String::new()] {
        let mut spec = pod("forged", &[("main", json!({}))], &[]);
        spec["metadata"]["annotations"] = json!({ALLOCATED: forged});
        match cluster.create_pod("tenant", &spec).await {
            Err(e) => {
                let text = format!("{e:#}");
                ensure!(
                    text.contains("only tessera-scheduler"),
                    "{forged:?}: refused, but not by the policy: {text}"
                );
            }
            Ok(_) => {
                cluster.delete_pod("forged").await?;
                bail!("a tenant created a pod carrying {ALLOCATED}: {forged:?}");
            }
        }
    }
    Ok(())
}

/// Every other way to write the annotation, as a tenant and as a second
/// scheduler would: update, `pods/status`, `pods/binding` and the legacy
/// `bindings`. Each is refused, and the pod, bound without it, gets no GPU.
async fn forged_write_paths(cluster: &mut Cluster) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams, PostParams};
    let forged = forged_annotation(cluster);
    let name = "forge-target";
    // Nobody schedules it: the writes below are the only way it gets a node.
    let mut spec = pod(
        name,
        &[("main", json!({}))],
        &[("NVIDIA_VISIBLE_DEVICES", "all")],
    );
    spec["spec"]["schedulerName"] = json!("nobody");
    cluster.create_pod("tenant", &spec).await?;
    let annotation = json!({"metadata": {"annotations": {ALLOCATED: forged}}});
    let refused = |what: &str, outcome: Result<(), kube::Error>| -> anyhow::Result<()> {
        match outcome {
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 || e.code == 400 => {
                ensure!(
                    e.message.contains("only tessera-scheduler"),
                    "{what}: refused, but not by the policy: {}",
                    e.message
                );
                Ok(())
            }
            Err(e) => bail!("{what}: unexpected error {e}"),
            Ok(()) => bail!("{what}: the write carrying {ALLOCATED} was accepted"),
        }
    };
    for identity in ["tenant", "other-scheduler"] {
        let pods: kube::Api<Pod> =
            kube::Api::namespaced(cluster.client_as(identity).await?, "default");
        let patch = pods
            .patch(name, &PatchParams::default(), &Patch::Merge(&annotation))
            .await
            .map(drop);
        refused(&format!("{identity}: patch pods"), patch)?;
        let status = pods
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&annotation))
            .await
            .map(drop);
        refused(&format!("{identity}: patch pods/status"), status)?;
        let binding = json!({"apiVersion": "v1", "kind": "Binding",
                             "metadata": {"name": name, "annotations": {ALLOCATED: forged}},
                             "target": {"apiVersion": "v1", "kind": "Node", "name": tessera_harness::cluster::NODE_NAME}});
        let bind = pods
            .create_subresource::<Value, Value>("binding", name, &PostParams::default(), &binding)
            .await
            .map(drop);
        refused(&format!("{identity}: create pods/binding"), bind)?;
        let request = http::Request::post("/api/v1/namespaces/default/bindings")
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&binding)?)?;
        let legacy = cluster
            .client_as(identity)
            .await?
            .request::<Value>(request)
            .await
            .map(drop);
        refused(&format!("{identity}: create bindings"), legacy)?;
    }
    // Bound the honest way, it runs with no GPU at all, whatever its env says.
    cluster.bind_as_other_scheduler(name).await?;
    let running = cluster.wait_running(name).await?;
    ensure!(
        running
            .metadata
            .annotations
            .as_ref()
            .is_none_or(|a| !a.contains_key(ALLOCATED)),
        "pod {name} carries {ALLOCATED} after every write was refused"
    );
    let specs = cluster.container_specs(&running)?;
    let spec = specs.get("main").context("no spec")?;
    ensure!(
        env_values(spec, "NVIDIA_VISIBLE_DEVICES") == ["void"],
        "pod {name}: NVIDIA_VISIBLE_DEVICES {:?}, want [\"void\"]",
        env_values(spec, "NVIDIA_VISIBLE_DEVICES")
    );
    ensure!(
        gpu_device_minors(spec).is_empty(),
        "pod {name} got GPU device nodes {:?}",
        gpu_device_minors(spec)
    );
    cluster.delete_pod(name).await
}

/// kubelet puts a device plugin's env first and the pod's own after it, and the
/// runtime obeys the last: a pod's `NVIDIA_VISIBLE_DEVICES=all` must neither
/// widen a Tessera grant nor a device plugin's.
async fn env_never_widens(cluster: &mut Cluster) -> anyhow::Result<()> {
    // Tessera's grant: the container ends with exactly one entry, the grant.
    let name = "env-all-fractional";
    cluster
        .create_pod(
            "admin",
            &pod(
                name,
                &[("main", json!({"koordinator.sh/gpu": "30"}))],
                &[("NVIDIA_VISIBLE_DEVICES", "all")],
            ),
        )
        .await?;
    let running = cluster.wait_running(name).await?;
    let specs = cluster.container_specs(&running)?;
    assert_grant(
        name,
        "main",
        specs.get("main").context("no spec")?,
        &allocated_gpus(&running)?,
    )?;
    cluster.delete_pod(name).await?;

    // A CUDA image's own `NVIDIA_VISIBLE_DEVICES=all` comes first, where the
    // runtime ignores it: the entry it obeys is `void` for a pod with no grant,
    // the grant for a fractional one.
    for (name, limits) in [
        ("image-env-none", json!({})),
        ("image-env-fractional", json!({"koordinator.sh/gpu": "30"})),
    ] {
        let mut spec = pod(name, &[("main", limits)], &[]);
        spec["spec"]["containers"][0]["image"] = json!(CUDA_PROBE_IMAGE);
        cluster.create_pod("admin", &spec).await?;
        let running = cluster.wait_running(name).await?;
        let specs = cluster.container_specs(&running)?;
        let spec = specs.get("main").context("no spec")?;
        let granted = allocated_gpus(&running).unwrap_or_default();
        let want = if granted.is_empty() {
            "void".to_owned()
        } else {
            granted
                .iter()
                .map(|(uuid, _)| uuid.as_str())
                .collect::<Vec<_>>()
                .join(",")
        };
        let entries = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
        ensure!(
            entries.first().map(String::as_str) == Some("all")
                && runtime_env(spec, "NVIDIA_VISIBLE_DEVICES").as_deref() == Some(want.as_str()),
            "pod {name}: NVIDIA_VISIBLE_DEVICES entries {entries:?}, want the image's \"all\" first and {want:?} last"
        );
        let minors = gpu_device_minors(spec);
        let granted_minors: BTreeSet<u64> = granted.iter().map(|(_, minor)| *minor).collect();
        ensure!(
            minors == granted_minors,
            "pod {name}: device nodes for minors {minors:?}, granted {granted_minors:?}"
        );
        cluster.delete_pod(name).await?;
    }

    // A device plugin's grant overruled by the pod spec: not started, and the
    // reason names the variable.
    let name = "env-all-legacy";
    let mut spec = pod(
        name,
        &[("main", json!({"nvidia.com/gpu": "1"}))],
        &[("NVIDIA_VISIBLE_DEVICES", "all")],
    );
    spec["spec"]["schedulerName"] = json!("nobody");
    cluster.create_pod("admin", &spec).await?;
    cluster.bind_as_other_scheduler(name).await?;
    let refused = cluster
        .wait_pod(
            name,
            Duration::from_secs(60),
            "refused by the GPU hook",
            |pod| {
                pod.status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c.state.as_ref()?.waiting.as_ref()?.message.clone())
                    .any(|m| m.contains("NVIDIA_VISIBLE_DEVICES"))
            },
        )
        .await?;
    ensure!(
        !tessera_harness::cluster::is_running(&refused),
        "pod {name} runs although its env overrules its device plugin's grant"
    );
    cluster.delete_pod(name).await
}

/// Two quarter-GPU containers and a GPU-less sidecar in one pod: each GPU
/// container is limited to its own quarter (not the pod's half), the sidecar sees
/// no GPU, whatever their env says.
async fn per_container(cluster: &mut Cluster) -> anyhow::Result<()> {
    let name = "two-quarters";
    let quarter = json!({"koordinator.sh/gpu": "25"});
    let spec = pod(
        name,
        &[
            ("a", quarter.clone()),
            ("b", quarter),
            ("sidecar", json!({})),
        ],
        &[
            ("NVIDIA_VISIBLE_DEVICES", "all"),
            ("CUDA_DEVICE_SM_LIMIT", "100"),
        ],
    );
    cluster.create_pod("admin", &spec).await?;
    let running = cluster.wait_running(name).await?;
    let gpus = allocated_gpus(&running)?;
    let specs = cluster.container_specs(&running)?;
    // Which GPUs a and b got is the allocator's choice; that each is limited to
    // its own quarter of what it got is the promise.
    for container in ["a", "b"] {
        let spec = specs
            .get(container)
            .with_context(|| format!("no spec for {container}"))?;
        let visible = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
        let mine: Vec<(String, u64)> = gpus
            .iter()
            .filter(|(id, _)| visible.iter().any(|v| v == id))
            .cloned()
            .collect();
        ensure!(
            mine.len() == 1,
            "pod {name} container {container}: NVIDIA_VISIBLE_DEVICES {visible:?}, want one of the pod's GPUs {gpus:?}"
        );
        assert_grant(name, container, spec, &mine)?;
        let sm = env_values(spec, "CUDA_DEVICE_SM_LIMIT");
        ensure!(
            sm == ["25"],
            "pod {name} container {container}: CUDA_DEVICE_SM_LIMIT {sm:?}, want [\"25\"] (its own share, not the pod's)"
        );
    }
    let sidecar = specs.get("sidecar").context("no spec for sidecar")?;
    ensure!(
        env_values(sidecar, "NVIDIA_VISIBLE_DEVICES") == ["void"]
            && gpu_device_minors(sidecar).is_empty(),
        "pod {name}: the GPU-less sidecar got NVIDIA_VISIBLE_DEVICES {:?} and GPU nodes {:?}",
        env_values(sidecar, "NVIDIA_VISIBLE_DEVICES"),
        gpu_device_minors(sidecar)
    );
    ensure!(
        env_values(sidecar, "CUDA_DEVICE_SM_LIMIT").is_empty(),
        "pod {name}: the sidecar keeps CUDA_DEVICE_SM_LIMIT {:?}",
        env_values(sidecar, "CUDA_DEVICE_SM_LIMIT")
    );
    cluster.delete_pod(name).await
}

/// The waiting messages of a pod's containers (why kubelet could not create them).
/// The chart's documents as `python3 scripts/chart.py render ARGS` renders them
/// (the values a scenario needs that the install left off).
fn rendered_chart(args: &[&str]) -> anyhow::Result<Vec<Value>> {
    let output = std::process::Command::new("python3")
        .current_dir(tessera_harness::cluster::repo_root())
        .args(["scripts/chart.py", "render"])
        .args(args)
        .output()
        .context("running python3 scripts/chart.py render")?;
    ensure!(
        output.status.success(),
        "chart.py render: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout)?;
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Ok(serde::Deserialize::deserialize(doc)?))
        .collect()
}

fn waiting_messages(pod: &Pod) -> Vec<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref()?.message.clone())
        .collect()
}

/// NVIDIA's agents ask for no GPU and need `NVIDIA_VISIBLE_DEVICES=all`: in the
/// trusted namespace a pod keeps it, in `default` the same pod gets `void`, and a
/// trusted pod with an allocation still gets exactly its grant. Privileged
/// containers see every GPU whatever the hook writes: under the default policy one
/// that asks for GPUs is refused (visible in its container status), and so is one
/// the scheduler granted GPUs; one that asks for none (a CNI or CSI agent) runs.
async fn trusted_agents_and_privileged(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster.create_namespace(AGENTS_NAMESPACE).await?;
    // Where GPU agents run privileged, an administrator exempts the namespace from
    // Pod Security (the chart suite holds tenants to it).
    cluster
        .label_namespace(
            AGENTS_NAMESPACE,
            "pod-security.kubernetes.io/enforce",
            "privileged",
        )
        .await?;
    let all = [("NVIDIA_VISIBLE_DEVICES", "all")];
    let agent = pod("gpu-agent", &[("agent", json!({}))], &all);
    let quarter = pod(
        "agent-with-grant",
        &[("main", json!({"koordinator.sh/gpu": "25"}))],
        &all,
    );
    let privileged = |mut spec: Value| {
        spec["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
        spec
    };
    let privileged_all = privileged(pod("privileged-all", &[("main", json!({}))], &all));
    let privileged_quarter = privileged(pod(
        "privileged-quarter",
        &[("main", json!({"koordinator.sh/gpu": "25"}))],
        &[],
    ));
    let privileged_plain = privileged(pod("privileged-plain", &[("main", json!({}))], &[]));
    // (namespace, pod): every pod is created as admin (the tenant has RBAC in
    // `default` only, and the point is the node's policy, not the API's).
    let running = [
        (AGENTS_NAMESPACE, &agent),
        (AGENTS_NAMESPACE, &quarter),
        (AGENTS_NAMESPACE, &privileged_all),
        ("default", &agent),
        ("default", &privileged_plain),
    ];
    let refused = [
        ("default", &privileged_all),
        ("default", &privileged_quarter),
    ];
    for (namespace, spec) in running.iter().chain(&refused) {
        cluster.create_pod_in("admin", namespace, spec).await?;
    }

    // (namespace, pod, container) → the one NVIDIA_VISIBLE_DEVICES it must end with.
    for (namespace, name, container, want) in [
        (AGENTS_NAMESPACE, "gpu-agent", "agent", "all"),
        (AGENTS_NAMESPACE, "privileged-all", "main", "all"),
        ("default", "gpu-agent", "agent", "void"),
        ("default", "privileged-plain", "main", "void"),
    ] {
        let running = cluster
            .wait_pod_in(
                namespace,
                name,
                Duration::from_secs(90),
                "Running",
                tessera_harness::cluster::is_running,
            )
            .await?;
        let specs = cluster.container_specs(&running)?;
        let spec = specs
            .get(container)
            .with_context(|| format!("pod {namespace}/{name}: no spec for {container}"))?;
        let visible = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
        ensure!(
            visible == [want],
            "pod {namespace}/{name} container {container}: NVIDIA_VISIBLE_DEVICES entries {visible:?}, want exactly [{want:?}]"
        );
    }
    // Trust never widens an allocation: the trusted pod's `all` becomes its grant.
    let granted = cluster
        .wait_pod_in(
            AGENTS_NAMESPACE,
            "agent-with-grant",
            Duration::from_secs(90),
            "Running",
            tessera_harness::cluster::is_running,
        )
        .await?;
    let specs = cluster.container_specs(&granted)?;
    assert_grant(
        &format!("{AGENTS_NAMESPACE}/agent-with-grant"),
        "main",
        specs.get("main").context("no spec for main")?,
        &allocated_gpus(&granted)?,
    )?;

    // Refused, with the reason and the setting in the container's status.
    for (name, reason) in [
        (
            "privileged-all",
            "it asks for GPUs (NVIDIA_VISIBLE_DEVICES=all)",
        ),
        ("privileged-quarter", "the scheduler granted it GPUs"),
    ] {
        let pod = cluster
            .wait_pod(
                name,
                Duration::from_secs(60),
                "refused by the GPU hook",
                |pod| {
                    waiting_messages(pod)
                        .iter()
                        .any(|m| m.contains("securityContext.privileged=true"))
                },
            )
            .await?;
        let messages = waiting_messages(&pod);
        ensure!(
            messages.iter().any(|m| m.contains(&format!(
                "pod default/{name}: container main: securityContext.privileged=true"
            )) && m.contains(reason)
                && m.contains("privileged=refuse-gpu")),
            "pod default/{name}: waiting messages {messages:?} do not name the pod, container, reason {reason:?} and setting"
        );
        ensure!(
            !tessera_harness::cluster::is_running(&pod),
            "privileged pod default/{name} runs although it would see every GPU"
        );
    }
    ensure!(
        cluster
            .log(Component::RuntimeProxy)
            .contains("trusted GPU agent: device env kept as given"),
        "the proxy's log does not say it kept a trusted agent's env"
    );

    for (namespace, spec) in running.iter().chain(&refused) {
        let name = spec["metadata"]["name"].as_str().unwrap_or_default();
        cluster.delete_pod_in(namespace, name).await?;
    }
    Ok(())
}

/// NVIDIA's device plugin as NVIDIA ships it: a pod, in a namespace the node
/// trusts, whose image sets `NVIDIA_VISIBLE_DEVICES=all` and whose container is
/// created through the proxy like any other. It keeps that env, registers
/// `nvidia.com/gpu` with kubelet and serves a legacy pod; after kubelet restarts
/// its killed container (where a hook that voided agents broke it) it does all
/// of that again.
async fn device_plugin_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    const NAME: &str = "nvidia-device-plugin";
    const CONTAINER: &str = "nvidia-device-plugin-ctr";
    cluster.create_namespace(AGENTS_NAMESPACE).await?;
    // The plugin mounts kubelet's device-plugin directory: its namespace is labelled
    // a node agents' one, as the chart's docs tell operators to.
    cluster
        .label_namespace(AGENTS_NAMESPACE, "tessera.io/node-agents", "true")
        .await?;
    // The pod takes over from the plugin the harness ran as a process.
    cluster.stop(Component::DevicePlugin)?;
    let spec = cluster.device_plugin_pod(AGENTS_NAMESPACE, NAME);
    cluster
        .create_pod_in("admin", AGENTS_NAMESPACE, &spec)
        .await?;
    for restarts in 0..2 {
        let plugin = cluster
            .wait_pod_in(
                AGENTS_NAMESPACE,
                NAME,
                Duration::from_secs(90),
                &format!("Running after {restarts} restarts"),
                |p| tessera_harness::cluster::is_running(p) && restart_count(p) >= restarts,
            )
            .await?;
        let specs = cluster.container_specs(&plugin)?;
        let spec = specs.get(CONTAINER).context("no spec for the plugin")?;
        let visible = env_values(spec, "NVIDIA_VISIBLE_DEVICES");
        ensure!(
            visible == ["all"],
            "device plugin pod after {restarts} restarts: NVIDIA_VISIBLE_DEVICES {visible:?}, want the image's [\"all\"]"
        );
        // Registered (again): its log for this run says so.
        let started = Instant::now();
        loop {
            let log = cluster.container_log(&plugin, CONTAINER)?;
            let registered = log
                .matches("Registered device plugin for 'nvidia.com/gpu'")
                .count();
            if registered > restarts as usize {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!(
                    "device plugin pod registered {registered} times after {restarts} restarts; its log:\n{log}"
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let name = format!("legacy-via-plugin-pod-{restarts}");
        let legacy = legacy_running(cluster, &name).await?;
        let specs = cluster.container_specs(&legacy)?;
        let visible = env_values(
            specs.get("main").context("no spec for main")?,
            "NVIDIA_VISIBLE_DEVICES",
        );
        ensure!(
            visible.len() == 1 && cluster.gpu_node.gpus.iter().any(|g| g.uuid == visible[0]),
            "pod {name}: NVIDIA_VISIBLE_DEVICES {visible:?}, want the one GPU the plugin pod allocated"
        );
        cluster.delete_pod(&name).await?;
        if restarts == 0 {
            let id = plugin
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|s| s.first())
                .and_then(|s| s.container_id.clone())
                .context("the plugin's container has no ID")?;
            cluster.kill_container(&id)?;
        }
    }
    // The pod's plugin removes the socket both plugins use when it stops: the
    // process may start again only once that container is gone, not merely its
    // pod object (deleted at once with a grace period of 0).
    let plugin = cluster
        .wait_pod_in(
            AGENTS_NAMESPACE,
            NAME,
            Duration::from_secs(30),
            "Running",
            tessera_harness::cluster::is_running,
        )
        .await?;
    let ids: Vec<String> = plugin
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|s| s.container_id.clone())
        .collect();
    cluster.delete_pod_in(AGENTS_NAMESPACE, NAME).await?;
    let started = Instant::now();
    while ids.iter().any(|id| cluster.oci_spec(id).is_ok()) {
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the device plugin pod's container still runs 30 s after its pod was deleted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.start_again(Component::DevicePlugin).await
}

/// tessera-reporter installed as an operator would: `tessera image build` makes
/// its image, deploy/reporter.yaml's DaemonSet runs it (in-cluster config through
/// the `kubernetes` Service, its own service account and RBAC, privileged, NVML
/// from the host's driver directory), and it publishes the node's Device CR again
/// after it was deleted.
async fn reporter_image(cluster: &mut Cluster) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{ListParams, Patch, PatchParams};
    const NAMESPACE: &str = "tessera-system";
    let tessera = tessera_harness::cluster::tessera_binary("tessera")?;
    let bin_dir = tessera.parent().context("tessera has no directory")?;
    let out = tempfile::tempdir()?;
    let output = std::process::Command::new(&tessera)
        .args(["image", "build", "--tag", "test", "--out"])
        .arg(out.path())
        .arg("--bin-dir")
        .arg(bin_dir)
        .arg("tessera-reporter")
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "tessera image build failed with {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    // `<reference> <digest> <archive>`
    let fields: Vec<&str> = stdout.split_whitespace().collect();
    let [reference, digest, archive] = fields[..] else {
        bail!("tessera image build printed {stdout:?}, want `REFERENCE DIGEST ARCHIVE`");
    };
    ensure!(
        reference == "tessera.local/tessera-reporter:test" && digest.starts_with("sha256:"),
        "tessera image build printed {stdout:?}"
    );
    cluster.import_image(std::path::Path::new(archive))?;

    // The DaemonSet takes over from the process; the Device CR it must bring back
    // is gone. Its nodeSelector is the label an operator puts on GPU nodes.
    cluster.stop(Component::Reporter)?;
    let client = cluster.client().await?;
    let devices = tessera_harness::cluster::device_api(&client);
    let node = tessera_harness::cluster::NODE_NAME;
    devices.delete(node, &Default::default()).await?;
    kube::Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tessera.io/gpu-node": "true"}}})),
        )
        .await?;
    let daemonset = cluster.reporter_daemonset(reference)?;
    cluster.apply(&daemonset).await?;
    let selector = daemonset["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("the DaemonSet has no matchLabels")?
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(",");
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), NAMESPACE);
    let started = Instant::now();
    loop {
        let running = pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        let published = devices
            .get_opt(node)
            .await?
            .and_then(|d| d.data["spec"]["devices"].as_array().map(Vec::len));
        if published == Some(cluster.gpu_node.gpus.len()) {
            ensure!(
                running.iter().any(tessera_harness::cluster::is_running),
                "the Device CR came back, but not from the DaemonSet's pod"
            );
            break;
        }
        if started.elapsed() > Duration::from_secs(90) {
            let logs: Vec<String> = running
                .iter()
                .map(|pod| cluster.container_log(pod, "reporter").unwrap_or_default())
                .collect();
            let states: Vec<_> = running.iter().map(|p| p.status.clone()).collect();
            bail!(
                "deploy/reporter.yaml's DaemonSet published {published:?} GPUs in 90 s; its pods: {states:?}; their logs:\n{}",
                logs.join("\n---\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let daemonsets: kube::Api<k8s_openapi::api::apps::v1::DaemonSet> =
        kube::Api::namespaced(client.clone(), NAMESPACE);
    daemonsets
        .delete("tessera-reporter", &Default::default())
        .await?;
    for pod in pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let name = pod.metadata.name.clone().unwrap_or_default();
        cluster.delete_pod_in(NAMESPACE, &name).await?;
    }
    cluster.start_again(Component::Reporter).await
}

/// Runs `tessera node <verb>` against this node, restarting kubelet whenever its
/// `--restart-command` asks (it touches a file; kubelet here is the harness's
/// child, not a systemd unit). Returns whether it succeeded, its output, and
/// whether the node carried the switch taint while it ran.
async fn tessera_node(
    cluster: &mut Cluster,
    verb: &str,
    restart: bool,
    verify_timeout: u32,
) -> anyhow::Result<(bool, String, bool)> {
    let flag = tempfile::NamedTempFile::new()?.into_temp_path();
    std::fs::remove_file(&flag)?;
    let restart_command = if restart {
        format!("touch {}", flag.display())
    } else {
        "true".to_owned()
    };
    let mut child =
        tokio::process::Command::new(tessera_harness::cluster::tessera_binary("tessera")?)
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig())
            .args(["node", verb, "--node", tessera_harness::cluster::NODE_NAME])
            .arg(format!(
                "--endpoint=unix://{}",
                cluster.proxy_socket().display()
            ))
            .arg(format!("--proxy-metrics={}", cluster.proxy_metrics_addr()))
            .arg(format!(
                "--enforcement-dir={}",
                cluster.dir().join("enforce").display()
            ))
            .arg(format!("--restart-command={restart_command}"))
            .arg(format!("--verify-timeout={verify_timeout}"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
        kube::Api::all(cluster.client().await?);
    let mut tainted = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
        tainted |= node_taints(&node)
            .iter()
            .any(|t| t == "tessera.io/runtime-proxy");
        if flag.exists() {
            std::fs::remove_file(&flag)?;
            cluster.restart(Component::Kubelet).await?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let output = child.wait_with_output().await?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((status.success(), text, tainted))
}

fn node_taints(node: &k8s_openapi::api::core::v1::Node) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .map(|t| t.key.clone())
        .collect()
}

/// A node whose kubelet talks to containerd, as before Tessera: `tessera node
/// switch-over` finds kubelet's `--config` file from its command line, sets the
/// proxy there (keeping a backup), taints the node, restarts kubelet and lifts the
/// taint only once the proxy counts kubelet's calls; a GPU pod then gets its grant
/// through the hook. `switch-back` restores the file and proves kubelet left the
/// proxy. A switch whose kubelet never restarts keeps the taint and says why.
async fn switch_over(cluster: &mut Cluster) -> anyhow::Result<()> {
    let config = cluster.kubelet_config_path();
    let backup = std::path::PathBuf::from(format!("{}.tessera-backup", config.display()));
    let containerd = cluster.containerd_socket();
    cluster.set_kubelet_endpoint(&containerd).await?;
    // No taint, but kubelet calls containerd directly (a GPU node registered
    // without the taint, or its taint lifted by hand): the proxy sees no kubelet,
    // so the node is unproven all the same, and a GPU pod waits with the reason.
    let node = kube::Api::<k8s_openapi::api::core::v1::Node>::all(cluster.client().await?)
        .get(tessera_harness::cluster::NODE_NAME)
        .await?;
    ensure!(
        node_taints(&node).is_empty(),
        "the node is tainted {:?}: the step would not show the kubelet proof",
        node_taints(&node)
    );
    wait_switch_advertised(cluster, true).await?;
    let unguarded = "unguarded-node";
    cluster
        .create_pod(
            "admin",
            &pod(
                unguarded,
                &[("main", json!({"koordinator.sh/gpu": "20"}))],
                &[],
            ),
        )
        .await?;
    cluster
        .wait_events_in(
            "default",
            unguarded,
            &["or kubelet not connected to the proxy"],
            Duration::from_secs(30),
        )
        .await?;
    cluster.delete_pod(unguarded).await?;
    let endpoint = |cluster: &Cluster| -> anyhow::Result<String> {
        let text = std::fs::read_to_string(cluster.kubelet_config_path())?;
        let config: serde_yaml::Value = serde_yaml::from_str(&text)?;
        Ok(config["containerRuntimeEndpoint"]
            .as_str()
            .unwrap_or_default()
            .to_owned())
    };
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
        kube::Api::all(cluster.client().await?);
    let proxy = format!("unix://{}", cluster.proxy_socket().display());

    let (ok, output, tainted) = tessera_node(cluster, "switch-over", true, 60).await?;
    ensure!(ok, "switch-over failed: {output}");
    ensure!(
        tainted,
        "the node was never tainted while switching: {output}"
    );
    // NVIDIA's plugin registered devices in kubelet's checkpoint: moved aside when
    // no pod holds any (a previous plugin's would make kubelet refuse GPU pods), kept
    // otherwise; either way the report says which.
    ensure!(
        output.contains("kubelet's device checkpoint"),
        "switch-over said nothing of kubelet's device checkpoint: {output}"
    );
    ensure!(
        endpoint(cluster)? == proxy && backup.is_file(),
        "after switch-over kubelet's config names {:?} (backup there: {}): {output}",
        endpoint(cluster)?,
        backup.is_file()
    );
    let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
    ensure!(
        node_taints(&node).is_empty(),
        "taints left after a proven switch: {:?}",
        node_taints(&node)
    );
    let name = "after-switch-over";
    create_one(cluster, name, json!({"koordinator.sh/gpu": "20"})).await?;
    let running = cluster.wait_running(name).await?;
    let specs = cluster.container_specs(&running)?;
    assert_grant(
        name,
        "main",
        specs.get("main").context("no spec")?,
        &allocated_gpus(&running)?,
    )?;
    cluster.delete_pod(name).await?;

    let (ok, output, _) = tessera_node(cluster, "switch-back", true, 60).await?;
    ensure!(ok, "switch-back failed: {output}");
    ensure!(
        endpoint(cluster)? == format!("unix://{}", containerd.display()) && !backup.exists(),
        "after switch-back kubelet's config names {:?}: {output}",
        endpoint(cluster)?
    );

    // kubelet is never restarted (the restart command does nothing): the same
    // process runs on, so the switch cannot be proven, and the taint stays.
    let (ok, output, _) = tessera_node(cluster, "switch-over", false, 5).await?;
    ensure!(
        !ok,
        "a switch-over whose kubelet never restarted succeeded: {output}"
    );
    ensure!(
        output.contains("keeps the taint tessera.io/runtime-proxy:NoSchedule")
            && output.contains("kubelet was not restarted: its process"),
        "the failed switch-over does not say why: {output}"
    );
    let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
    ensure!(
        node_taints(&node)
            .iter()
            .any(|t| t == "tessera.io/runtime-proxy"),
        "the taint is gone after an unproven switch"
    );
    // Unproven, the node's Device CR says so: a GPU pod that tolerates the taint
    // (in a namespace the admission policy exempts) is not placed there, and the
    // extender says why.
    wait_switch_advertised(cluster, true).await?;
    let tolerating = "tolerates-unproven";
    let mut spec = pod(
        tolerating,
        &[("main", json!({"koordinator.sh/gpu": "20"}))],
        &[],
    );
    spec["spec"]["tolerations"] =
        json!([{"key": "tessera.io/runtime-proxy", "operator": "Exists"}]);
    cluster.create_pod("admin", &spec).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let events = cluster.events_of(tolerating).await?;
        if events.iter().any(|e| {
            e.starts_with("FailedScheduling")
                && e.contains("switch to tessera-runtime-proxy is not proven yet")
        }) {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{tolerating}: no FailedScheduling within 30 s on an unproven node: {events:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // kubelet put back on the proxy by hand, through another path to its socket
    // (a symlink), the taint still there: switch-over sees kubelet's runtime calls
    // at the proxy, writes nothing, restarts nothing (its restart command would
    // fail the step), says so and lifts the taint.
    std::fs::remove_file(&backup)?;
    let link = cluster.dir().join("proxy-link.sock");
    std::os::unix::fs::symlink(cluster.proxy_socket(), &link)?;
    cluster.set_kubelet_endpoint(&link).await?;
    let linked = format!("unix://{}", link.display());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let output = loop {
        // Until the proxy has seen the restarted kubelet's calls, switch-over would
        // take the write path: wait for the proof first.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let seen = std::fs::read_to_string(cluster.dir().join("enforce").join("kubelet")).ok();
        if tessera_api::kubelet_seen::KubeletSeen::proves(seen.as_deref(), now).is_ok() {
            let (ok, output, _) = tessera_node(cluster, "switch-over", false, 5).await?;
            ensure!(
                ok,
                "switch-over on a kubelet already on the proxy failed: {output}"
            );
            break output;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the proxy never saw kubelet's runtime calls through {linked}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    ensure!(
        output.contains("already switched")
            && output.contains("it reaches the proxy another way")
            && output.contains("nothing written, kubelet not restarted"),
        "switch-over on a kubelet already on the proxy: {output}"
    );
    ensure!(
        endpoint(cluster)? == linked && !backup.exists(),
        "switch-over changed kubelet's config to {:?} (backup there: {}): {output}",
        endpoint(cluster)?,
        backup.exists()
    );
    let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
    ensure!(
        node_taints(&node).is_empty(),
        "the taint stays after a switch-over found kubelet on the proxy: {output}"
    );
    // Proven again: the GPUs come back and the waiting pod is placed.
    wait_switch_advertised(cluster, false).await?;
    cluster.wait_running(tolerating).await?;
    cluster.delete_pod(tolerating).await?;
    // Back to how the other scenarios expect the node: kubelet names the proxy.
    let proxy_socket = cluster.proxy_socket();
    cluster.set_kubelet_endpoint(&proxy_socket).await?;
    std::fs::remove_file(&link)?;
    Ok(())
}

/// `tessera node cleanup` while this cluster's tessera-reporter runs as a
/// process (as a systemd service does), not as a pod it could see: it removes
/// Tessera's capacity and labels, sees them published again within its settle
/// time, and fails naming the node rather than reporting them gone.
async fn cleanup_beside_a_reporter_process(cluster: &mut Cluster) -> anyhow::Result<()> {
    let output = std::process::Command::new(tessera_harness::cluster::tessera_binary("tessera")?)
        .args([
            "node",
            "cleanup",
            "--node",
            tessera_harness::cluster::NODE_NAME,
        ])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        !output.status.success()
            && text.contains(&format!(
                "came back on node(s) {} within 5 s",
                tessera_harness::cluster::NODE_NAME
            ))
            && text.contains("a tessera-reporter still runs"),
        "cleanup beside a running reporter process: {text}"
    );
    // The reporter put it all back: the node offers its GPUs as before.
    wait_switch_advertised(cluster, false).await
}

/// Waits (30 s at most) until the reporter has published the node's switch
/// state on the Device CR (`tessera.io/switch-unproven`), its GPU capacity
/// unchanged either way (the 4 GPUs' 400 % of `koordinator.sh/gpu-core`: a
/// kubelet restarted with less would reject the GPU pods it runs).
async fn wait_switch_advertised(cluster: &Cluster, unproven: bool) -> anyhow::Result<()> {
    let client = cluster.client().await?;
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let devices = tessera_harness::cluster::device_api(&client);
    let (core, mark) = ("400", if unproven { "true" } else { "false" });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
        let capacity = node
            .status
            .and_then(|s| s.capacity)
            .and_then(|c| c.get("koordinator.sh/gpu-core").map(|q| q.0.clone()));
        let device = devices.get(tessera_harness::cluster::NODE_NAME).await?;
        let annotation = device
            .metadata
            .annotations
            .and_then(|a| a.get("tessera.io/switch-unproven").cloned());
        if capacity.as_deref() == Some(core) && annotation.as_deref() == Some(mark) {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "unproven={unproven}: after 30 s gpu-core capacity {capacity:?} (want {core}), tessera.io/switch-unproven {annotation:?} (want {mark})"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Manifests as HAMi, Volcano and Koordinator document them, on the real
/// cluster: HAMi's memory and cores pinned to one GPU by `nvidia.com/use-gpuuuid`
/// and kept off another by `nouse-gpuuuid`; Volcano's `gpu-number` as a whole
/// GPU; Koordinator's device hint selecting the GPU model, and one naming a model
/// the cluster lacks refused with the reason in the pod's events.
async fn compat_manifests(cluster: &mut Cluster) -> anyhow::Result<()> {
    let uuid = |i: usize| cluster.gpu_node.gpus[i].uuid.clone();
    let with = |name: &str, limits: Value, annotations: Value| {
        let mut spec = pod(name, &[("main", limits)], &[]);
        spec["metadata"]["annotations"] = annotations;
        spec
    };
    // (pod, its spec, the GPUs it may get, SM limit, memory limit of GPU 0)
    let model = "NVIDIA-H100-80GB-HBM3";
    let cases = [
        (
            "hami-pinned",
            with(
                "hami-pinned",
                json!({"nvidia.com/gpumem": "3000", "nvidia.com/gpucores": "30"}),
                json!({"nvidia.com/use-gpuuuid": uuid(2)}),
            ),
            vec![uuid(2)],
            Some("30"),
            Some("3000m"),
        ),
        (
            "hami-excluded",
            with(
                "hami-excluded",
                json!({"nvidia.com/gpumem-percentage": "50"}),
                json!({"nvidia.com/nouse-gpuuuid": format!("{},{}", uuid(0), uuid(1)),
                       "hami.io/gpu-scheduler-policy": "spread"}),
            ),
            vec![uuid(2), uuid(3)],
            None,
            None,
        ),
        (
            "volcano-whole",
            with(
                "volcano-whole",
                json!({"volcano.sh/gpu-number": "1"}),
                json!({}),
            ),
            (0..cluster.gpu_node.gpus.len()).map(uuid).collect(),
            None,
            None,
        ),
        (
            "koordinator-hint",
            with(
                "koordinator-hint",
                json!({"koordinator.sh/gpu-core": "20", "koordinator.sh/gpu-memory-ratio": "20"}),
                json!({"scheduling.koordinator.sh/device-allocate-hint":
                       json!({"gpu": {"selector": {"matchLabels": {"node.koordinator.sh/gpu-model": model}}}}).to_string()}),
            ),
            (0..cluster.gpu_node.gpus.len()).map(uuid).collect(),
            Some("20"),
            None,
        ),
    ];
    for (_, spec, _, _, _) in &cases {
        cluster.create_pod("tenant", spec).await?;
    }
    for (name, _, allowed, sm, memory) in &cases {
        let running = cluster.wait_running(name).await?;
        let granted = allocated_gpus(&running)?;
        ensure!(
            granted.len() == 1 && allowed.contains(&granted[0].0),
            "pod {name} granted {granted:?}, want one of {allowed:?}"
        );
        let specs = cluster.container_specs(&running)?;
        let spec = specs.get("main").context("no spec")?;
        ensure!(
            env_values(spec, "NVIDIA_VISIBLE_DEVICES") == [granted[0].0.clone()],
            "pod {name}: NVIDIA_VISIBLE_DEVICES {:?}, granted {granted:?}",
            env_values(spec, "NVIDIA_VISIBLE_DEVICES")
        );
        ensure!(
            runtime_env(spec, "CUDA_DEVICE_SM_LIMIT").as_deref() == *sm
                && (memory.is_none()
                    || runtime_env(spec, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref() == *memory),
            "pod {name}: SM limit {:?} (want {sm:?}), memory limit {:?} (want {memory:?})",
            env_values(spec, "CUDA_DEVICE_SM_LIMIT"),
            env_values(spec, "CUDA_DEVICE_MEMORY_LIMIT_0")
        );
    }
    for (name, _, _, _, _) in &cases {
        cluster.delete_pod(name).await?;
    }

    // A model no GPU of the cluster is: refused, the reason in the pod's events.
    let name = "koordinator-no-such-model";
    let spec = with(
        name,
        json!({"koordinator.sh/gpu-core": "20", "koordinator.sh/gpu-memory-ratio": "20"}),
        json!({"scheduling.koordinator.sh/device-allocate-hint":
               json!({"gpu": {"selector": {"matchLabels": {"node.koordinator.sh/gpu-model": "A100"}}}}).to_string()}),
    );
    cluster.create_pod("tenant", &spec).await?;
    let started = Instant::now();
    loop {
        let events = cluster.events_of(name).await?;
        if events
            .iter()
            .any(|e| e.starts_with("FailedScheduling") && e.contains("device-allocate-hint"))
        {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("pod {name}: no FailedScheduling event naming the hint after 60 s: {events:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    cluster.delete_pod(name).await
}

/// KubeShare's pods, written as its documentation writes them: no GPU resource,
/// only `lsalab.nthu/*` annotations (1.x), or `sharedgpu/*` labels (2.0, one pod
/// here). The admission policies (deploy/) turn them
/// into `koordinator.sh/*` resources, so kube-scheduler calls the extender; pods of
/// one GPUID share one GPU, another GPUID takes another, each container limited to
/// its own request. What Tessera cannot honour is refused at creation, naming the
/// annotation.
async fn kubeshare(cluster: &mut Cluster) -> anyhow::Result<()> {
    let share = |name: &str, annotations: Value| {
        let mut spec = pod(name, &[("main", json!({}))], &[]);
        spec["metadata"]["annotations"] = annotations;
        spec
    };
    let pods = [
        ("ks-a1", "team-a", "0.5"),
        ("ks-a2", "team-a", "0.3"),
        ("ks-b1", "team-b", "0.4"),
    ];
    for (name, group, request) in pods {
        let spec = if name == "ks-a2" {
            // KubeShare 2.0 asks by label (sharedgpu/*), with the same four keys.
            let mut spec = share(name, json!({}));
            spec["metadata"]["labels"] = json!({"sharedgpu/gpu_request": request,
                "sharedgpu/gpu_limit": request, "sharedgpu/gpu_mem": "1073741824",
                "sharedgpu/GPUID": group});
            spec
        } else {
            share(
                name,
                json!({"lsalab.nthu/gpu_request": request, "lsalab.nthu/gpu_limit": request,
                       "lsalab.nthu/gpu_mem": "1073741824", "lsalab.nthu/GPUID": group}),
            )
        };
        cluster.create_pod("tenant", &spec).await?;
    }
    let mut gpus = std::collections::BTreeMap::new();
    for (name, group, request) in pods {
        let running = cluster.wait_running(name).await?;
        let limits = first_limits(&running);
        let core = (request.parse::<f64>()? * 100.0).round() as u64;
        ensure!(
            limits.get("koordinator.sh/gpu-core").map(|q| q.0.as_str())
                == Some(core.to_string().as_str())
                && limits
                    .get("koordinator.sh/gpu-memory")
                    .map(|q| q.0.as_str())
                    == Some("1073741824"),
            "pod {name}: admission gave limits {limits:?}, want gpu-core {core} and gpu-memory 1073741824"
        );
        let granted = allocated_gpus(&running)?;
        ensure!(
            granted.len() == 1,
            "pod {name} granted {granted:?}, want one GPU"
        );
        let specs = cluster.container_specs(&running)?;
        let spec = specs.get("main").context("no spec")?;
        ensure!(
            runtime_env(spec, "CUDA_DEVICE_SM_LIMIT") == Some(core.to_string())
                && runtime_env(spec, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref() == Some("1024m"),
            "pod {name}: limiter env SM {:?} memory {:?}, want {core} and 1024m",
            env_values(spec, "CUDA_DEVICE_SM_LIMIT"),
            env_values(spec, "CUDA_DEVICE_MEMORY_LIMIT_0")
        );
        gpus.entry(group)
            .or_insert_with(BTreeSet::new)
            .insert(granted[0].0.clone());
    }
    let (a, b) = (&gpus["team-a"], &gpus["team-b"]);
    ensure!(
        a.len() == 1 && b.len() == 1 && a != b,
        "GPUID team-a got {a:?}, team-b {b:?}: want one GPU each, not the same"
    );

    // KubeShare's burst ceiling: 20 % booked, compute capped at 90 %.
    cluster
        .create_pod(
            "tenant",
            &share(
                "ks-burst",
                json!({"lsalab.nthu/gpu_request": "0.2", "lsalab.nthu/gpu_limit": "0.9",
                       "lsalab.nthu/gpu_mem": "1073741824"}),
            ),
        )
        .await?;
    let burst = cluster.wait_running("ks-burst").await?;
    let booked = first_limits(&burst)
        .get("koordinator.sh/gpu-core")
        .map(|q| q.0.clone());
    let specs = cluster.container_specs(&burst)?;
    let spec = specs.get("main").context("no spec")?;
    ensure!(
        booked.as_deref() == Some("20")
            && runtime_env(spec, "CUDA_DEVICE_SM_LIMIT").as_deref() == Some("90"),
        "ks-burst: booked gpu-core {booked:?}, CUDA_DEVICE_SM_LIMIT {:?}; want 20 booked and 90 as the ceiling",
        env_values(spec, "CUDA_DEVICE_SM_LIMIT")
    );
    cluster.delete_pod("ks-burst").await?;

    // Refused at creation, naming the annotation and the value.
    for (name, annotations, want) in [
        (
            "ks-under",
            json!({"lsalab.nthu/gpu_request": "0.5", "lsalab.nthu/gpu_limit": "0.4"}),
            "annotation lsalab.nthu/gpu_limit \"0.4\": the compute ceiling, a fraction of one GPU at least gpu_request (\"0.5\")",
        ),
        (
            "ks-bad",
            json!({"lsalab.nthu/gpu_request": "half"}),
            "annotation lsalab.nthu/gpu_request \"half\": a fraction of one GPU",
        ),
        (
            "ks-tiny",
            json!({"lsalab.nthu/gpu_request": "0.001"}),
            "annotation lsalab.nthu/gpu_request \"0.001\": a fraction of one GPU, at least 0.005",
        ),
        (
            "ks-over",
            json!({"lsalab.nthu/gpu_request": "1.5"}),
            "annotation lsalab.nthu/gpu_request \"1.5\": a fraction of one GPU, at least 0.005 (1%) and at most 1",
        ),
        (
            "ks-no-request",
            json!({"lsalab.nthu/gpu_mem": "1073741824"}),
            "annotation lsalab.nthu/gpu_request missing: a fraction of one GPU",
        ),
        (
            "ks-mem-unit",
            json!({"lsalab.nthu/gpu_request": "0.5", "lsalab.nthu/gpu_mem": "1Gi"}),
            "annotation lsalab.nthu/gpu_mem \"1Gi\": bytes of GPU memory, a whole number",
        ),
        (
            "ks-limit-word",
            json!({"lsalab.nthu/gpu_request": "0.5", "lsalab.nthu/gpu_limit": "lots"}),
            "annotation lsalab.nthu/gpu_limit \"lots\": the compute ceiling",
        ),
    ] {
        cluster
            .expect_refused("tenant", "default", &share(name, annotations), &[want])
            .await?;
    }
    // Admission keeps what else the container asks for and sets the share as
    // requests too; an annotation the pod sets wins over its 2.0 label.
    let mut mixed = share(
        "ks-mixed",
        json!({"lsalab.nthu/gpu_request": "0.3",
        "lsalab.nthu/gpu_mem": "1073741824"}),
    );
    mixed["metadata"]["labels"] = json!({"sharedgpu/gpu_request": "0.5"});
    mixed["spec"]["containers"][0]["resources"] = json!({"limits": {"cpu": "100m"}});
    let created = cluster.create_pod("tenant", &mixed).await?;
    let resources = created
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.clone())
        .unwrap_or_default();
    let get = |list: &Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >,
               key: &str| {
        list.as_ref().and_then(|l| l.get(key)).map(|q| q.0.clone())
    };
    ensure!(
        get(&resources.limits, "cpu").as_deref() == Some("100m")
            && get(&resources.limits, "koordinator.sh/gpu-core").as_deref() == Some("30")
            && get(&resources.requests, "koordinator.sh/gpu-core").as_deref() == Some("30"),
        "ks-mixed: admission gave {resources:?}; want cpu kept, gpu-core 30 (the annotation's, not the label's 50) as limit and request"
    );
    cluster.delete_pod("ks-mixed").await?;

    let mut both = share("ks-both", json!({"lsalab.nthu/gpu_request": "0.5"}));
    both["spec"]["containers"][0]["resources"] =
        json!({"limits": {"koordinator.sh/gpu-core": "30"}});
    match cluster.create_pod("tenant", &both).await {
        Ok(_) => {
            cluster.delete_pod("ks-both").await?;
            bail!("a pod asking both by annotation and by resource was created");
        }
        Err(e) => ensure!(
            format!("{e:#}").contains("both ask for GPUs"),
            "ks-both refused with {e:#}"
        ),
    }
    // An init container asking for a GPU resource is asking too.
    let mut init = share("ks-init-both", json!({"lsalab.nthu/gpu_request": "0.5"}));
    init["spec"]["initContainers"] = json!([{"name": "warm", "image": "tessera.local/probe:1",
        "imagePullPolicy": "Never", "resources": {"limits": {"koordinator.sh/gpu-core": "100"}}}]);
    match cluster.create_pod("tenant", &init).await {
        Ok(_) => {
            cluster.delete_pod("ks-init-both").await?;
            bail!("a pod asking by annotation and by an init container's resource was created");
        }
        Err(e) => ensure!(
            format!("{e:#}").contains("both ask for GPUs"),
            "ks-init-both refused with {e:#}"
        ),
    }
    for (name, _, _) in pods {
        cluster.delete_pod(name).await?;
    }
    kubeshare_2_labels(cluster).await
}

/// KubeShare 2.0's README pod (its "Pod specification": labels only, no gpu_mem,
/// `schedulerName: kubeshare-scheduler`) and its other labels: `gpu_model` is the
/// GPU model, exactly (a model no node has leaves the pod Pending, saying so);
/// without `gpu_mem` the memory share is gpu_request's fraction; `priority` is
/// checked and placed as guaranteed; coscheduling that needs several pods at once is
/// refused at creation, one that needs at most one is placed pod by pod.
async fn kubeshare_2_labels(cluster: &mut Cluster) -> anyhow::Result<()> {
    let readme = |name: &str, labels: Value| {
        let mut spec = pod(name, &[("pytorch", json!({}))], &[]);
        spec["metadata"]["labels"] = labels;
        spec["spec"]["schedulerName"] = json!("kubeshare-scheduler");
        spec["spec"]["restartPolicy"] = json!("Never");
        spec
    };
    // As its README writes it: a GTX 1080, which this cluster does not have.
    cluster
        .create_pod(
            "tenant",
            &readme(
                "ks2-readme",
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0",
                       "sharedgpu/gpu_model": "NVIDIA-GeForce-GTX-1080"}),
            ),
        )
        .await?;
    let want_model =
        r#"lsalab.nthu/gpu_model="NVIDIA-GeForce-GTX-1080" rules out every GPU of every node"#;
    cluster
        .wait_events_in(
            "default",
            "ks2-readme",
            &[want_model],
            Duration::from_secs(30),
        )
        .await?;
    cluster.delete_pod("ks2-readme").await?;
    // The same on this cluster's model, with the lowest priority (still placed as
    // guaranteed) and a group that needs no two pods at once (its README Job's 5 × 0.2).
    cluster
        .create_pod(
            "tenant",
            &readme(
                "ks2-h100",
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0",
                       "sharedgpu/gpu_model": "NVIDIA-H100-80GB-HBM3", "sharedgpu/priority": "0",
                       "sharedgpu/group_name": "a", "sharedgpu/group_headcount": "5",
                       "sharedgpu/group_threshold": "0.2"}),
            ),
        )
        .await?;
    let running = cluster.wait_running("ks2-h100").await?;
    let specs = cluster.container_specs(&running)?;
    let spec = specs.get("pytorch").context("no spec")?;
    ensure!(
        runtime_env(spec, "CUDA_DEVICE_SM_LIMIT").as_deref() == Some("100")
            && runtime_env(spec, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref() == Some("40960m"),
        "ks2-h100: limiter env SM {:?} memory {:?}; want the gpu_limit ceiling 100 and half of the 80 GiB GPU (no gpu_mem: gpu_request's fraction)",
        env_values(spec, "CUDA_DEVICE_SM_LIMIT"),
        env_values(spec, "CUDA_DEVICE_MEMORY_LIMIT_0")
    );
    cluster.delete_pod("ks2-h100").await?;
    for (name, labels, want) in [
        (
            "ks2-priority",
            json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "sharedgpu/priority": "101"}),
            r#"label sharedgpu/priority "101": a priority from 0 to 100"#,
        ),
        (
            "ks2-gang",
            json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "sharedgpu/group_name": "b",
                   "sharedgpu/group_headcount": "5", "sharedgpu/group_threshold": "0.6"}),
            "KubeShare 2.0 coscheduling, which Tessera does not do: 3 pods would have to start together",
        ),
        (
            // Its README's name for the group.
            "ks2-gang-readme",
            json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "sharedgpu/pod_group_name": "b",
                   "sharedgpu/group_headcount": "5", "sharedgpu/group_threshold": "0.6"}),
            "KubeShare 2.0 coscheduling, which Tessera does not do: 3 pods would have to start together",
        ),
    ] {
        cluster
            .expect_refused("tenant", "default", &readme(name, labels), &[want])
            .await?;
    }
    // The labels count on a pod that asks with GPU resources of its own too.
    let own = |name: &str, labels: Value| {
        let mut spec = pod(
            name,
            &[("pytorch", json!({"koordinator.sh/gpu": "25"}))],
            &[],
        );
        spec["metadata"]["labels"] = labels;
        spec
    };
    cluster
        .expect_refused(
            "tenant",
            "default",
            &own(
                "ks2-own-gang",
                json!({"sharedgpu/group_name": "c", "sharedgpu/group_headcount": "4",
                       "sharedgpu/group_threshold": "1"}),
            ),
            &["4 pods would have to start together"],
        )
        .await?;
    cluster
        .create_pod(
            "tenant",
            &own(
                "ks2-own-model",
                json!({"sharedgpu/gpu_model": "NVIDIA-GeForce-GTX-1080"}),
            ),
        )
        .await?;
    cluster
        .wait_events_in(
            "default",
            "ks2-own-model",
            &[want_model],
            Duration::from_secs(30),
        )
        .await?;
    cluster.delete_pod("ks2-own-model").await?;
    Ok(())
}

/// KubeShare 1.x's SharePod, as its README's "SharePod Specification" writes one
/// (`kubeshare.nthu/v1`, the share in `kubeshare/*` annotations; the image is the
/// cluster's probe, as there is no registry): tessera-scheduler makes its pod,
/// which admission gives the share's resources, kube-scheduler and Tessera place,
/// and the GPU hook limits; the SharePod shows the pod's phase and takes it with
/// it when deleted. What Tessera cannot honour (KubeShare's scheduling tags) and
/// what would forge a grant (an allocation annotation) make no pod, and the
/// SharePod says why; the scheduler's identity cannot create a pod with an
/// allocation either.
async fn sharepods(cluster: &mut Cluster) -> anyhow::Result<()> {
    use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
    let resource = ApiResource {
        group: "kubeshare.nthu".into(),
        version: "v1".into(),
        api_version: "kubeshare.nthu/v1".into(),
        kind: "SharePod".into(),
        plural: "sharepods".into(),
    };
    let sharepods: Api<DynamicObject> =
        Api::namespaced_with(cluster.client_as("tenant").await?, "default", &resource);
    let sharepod = |name: &str, annotations: Value| -> anyhow::Result<DynamicObject> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "kubeshare.nthu/v1", "kind": "SharePod",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{"name": "cuda",
                "image": "tessera.local/probe:1", "imagePullPolicy": "Never",
                "resources": {"limits": {"cpu": "1", "memory": "500Mi"}}}]}
        }))?)
    };
    let phase_of = |name: &'static str| {
        let sharepods = sharepods.clone();
        async move {
            let object = sharepods.get(name).await?;
            Ok::<_, anyhow::Error>((
                object.data["status"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                object.data["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ))
        }
    };
    sharepods
        .create(
            &PostParams::default(),
            &sharepod(
                "sharepod1",
                json!({"kubeshare/gpu_request": "0.5", "kubeshare/gpu_limit": "1.0",
                       "kubeshare/gpu_mem": "1073741824"}),
            )?,
        )
        .await?;
    // Made by tessera-scheduler from the SharePod's watch event: not there at once.
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let exists = |name: &'static str| {
        let pods = pods.clone();
        move || {
            let pods = pods.clone();
            async move { Ok::<_, anyhow::Error>(pods.get_opt(name).await?.is_some()) }
        }
    };
    let (running, _) = made_pod_holds_its_share(cluster, "SharePod", "sharepod1", "cuda").await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (phase, _) = phase_of("sharepod1").await?;
        if phase == "Running" {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "sharepod1 shows phase {phase:?}, not its pod's Running, after 30 s; tessera-scheduler says: {}",
            cluster
                .log(tessera_harness::cluster::Component::Extender)
                .lines()
                .filter(|l| l.contains("SharePod") || l.contains("sharepod"))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Its pod deleted alone is made again, at once.
    let first_uid = running.metadata.uid.clone();
    cluster.delete_pod("sharepod1").await?;
    let again = cluster.wait_running("sharepod1").await?;
    ensure!(
        again.metadata.uid != first_uid,
        "sharepod1's pod deleted alone was not made again"
    );

    // A pod of the SharePod's name that is not its own is left alone, and the
    // SharePod says so.
    cluster
        .create_pod("admin", &pod("sharepod-taken", &[("main", json!({}))], &[]))
        .await?;
    // Refused: no pod (none of its own), and the SharePod says why.
    for (name, annotations, want) in [
        (
            "sharepod-tag",
            json!({"kubeshare/gpu_request": "0.5", "kubeshare/gpu_limit": "0.5",
                   "kubeshare/gpu_mem": "1073741824", "kubeshare/sched_affinity": "red"}),
            "annotation kubeshare/sched_affinity \"red\": KubeShare's scheduling tags are not Tessera's",
        ),
        (
            "sharepod-forged",
            json!({"kubeshare/gpu_request": "0.5", "kubeshare/gpu_limit": "0.5",
                   "scheduling.koordinator.sh/device-allocated": "{\"gpu\":[{\"minor\":0,\"resources\":{\"koordinator.sh/gpu-core\":100}}]}"}),
            "annotation scheduling.koordinator.sh/device-allocated: only the scheduler writes it",
        ),
        (
            "sharepod-half",
            json!({"kubeshare/gpu_request": "half", "kubeshare/gpu_mem": "1073741824"}),
            "its pod was refused:",
        ),
        (
            "sharepod-taken",
            json!({"kubeshare/gpu_request": "0.5", "kubeshare/gpu_mem": "1073741824"}),
            "a pod named sharepod-taken exists in default and is not this SharePod's",
        ),
        (
            "sharepod-anti",
            json!({"kubeshare/gpu_request": "0.5", "kubeshare/gpu_mem": "1073741824",
                   "kubeshare/sched_anti-affinity": "blue"}),
            "annotation kubeshare/sched_anti-affinity \"blue\": KubeShare's scheduling tags are not Tessera's",
        ),
    ] {
        sharepods
            .create(&PostParams::default(), &sharepod(name, annotations)?)
            .await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (phase, message) = phase_of(name).await?;
            if phase == "Failed" {
                ensure!(
                    message.contains(want),
                    "{name}: Failed with {message:?}, want {want:?}"
                );
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "{name}: phase {phase:?} after 30 s, want Failed saying {want:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
        let made = pods.get_opt(name).await?.is_some_and(|pod| {
            pod.metadata
                .owner_references
                .unwrap_or_default()
                .iter()
                .any(|owner| owner.kind == "SharePod")
        });
        ensure!(!made, "{name}: a pod was made from a refused SharePod");
        sharepods.delete(name, &DeleteParams::default()).await?;
    }
    cluster.delete_pod("sharepod-taken").await?;
    // The scheduler's identity makes pods only from SharePods, and never with an
    // allocation.
    cluster
        .expect_refused(
            "extender",
            "default",
            &pod("made-by-scheduler", &[("main", json!({}))], &[]),
            &["tessera-scheduler makes pods only from SharePods"],
        )
        .await?;
    let mut forged = pod("sharepod1-forged", &[("main", json!({}))], &[]);
    forged["metadata"]["labels"] = json!({"tessera.io/sharepod": "true"});
    forged["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubeshare.nthu/v1",
        "kind": "SharePod", "name": "sharepod1-forged", "uid": "00000000-0000-0000-0000-000000000001",
        "controller": true}]);
    forged["metadata"]["annotations"] = json!({"scheduling.koordinator.sh/device-allocated":
        "{\"gpu\":[{\"minor\":0,\"resources\":{\"koordinator.sh/gpu-core\":100}}]}"});
    cluster
        .expect_refused(
            "extender",
            "default",
            &forged,
            &["only tessera-scheduler may set or change the annotation"],
        )
        .await?;
    cluster
        .expect_refused(
            "extender",
            "kube-system",
            &pod("sharepod1-forged", &[("main", json!({}))], &[]),
            &["tessera-scheduler makes"],
        )
        .await?;
    // Not even a pod shaped as a SharePod's, in the namespace Tessera exempts.
    let mut exempt = forged.clone();
    exempt["metadata"]["annotations"] = json!({});
    cluster
        .expect_refused(
            "extender",
            tessera_harness::cluster::REPORTER_NAMESPACE,
            &exempt,
            &["tessera-scheduler makes no pod in namespace tessera-system"],
        )
        .await?;

    // Deleted, the SharePod takes its pod with it (the garbage collector).
    sharepods
        .delete("sharepod1", &DeleteParams::default())
        .await?;
    let gone = exists("sharepod1");
    tessera_harness::until(
        "sharepod1's pod deleted with its SharePod",
        Duration::from_secs(60),
        move || {
            let exists = gone();
            async move { Ok(!exists.await?) }
        },
    )
    .await
}

/// K8sGPUSharing's MtgpuPod (`lsalab.nthu/v1`, KubeShare's predecessor), as its
/// README's "Using Shareable GPU" writes one, created by a tenant: the image is the
/// cluster's probe (no registry), and `spec.nodeName`, which that README says
/// "must be assigned", names this cluster's node rather than its `node1`.
/// tessera-scheduler makes its pod, which admission gives the share's resources
/// and the GPU hook limits; the MtgpuPod's status shows the pod's in that
/// project's shape (`PodStatus`, `BoundDeviceID`: the GPU granted). One that would
/// forge a grant makes no pod and says why; deleted, it takes its pod with it.
async fn mtgpupods(cluster: &mut Cluster) -> anyhow::Result<()> {
    use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams};
    let resource = ApiResource {
        group: "lsalab.nthu".into(),
        version: "v1".into(),
        api_version: "lsalab.nthu/v1".into(),
        kind: "MtgpuPod".into(),
        plural: "mtgpupods".into(),
    };
    let mtgpupods: Api<DynamicObject> =
        Api::namespaced_with(cluster.client_as("tenant").await?, "default", &resource);
    let mtgpupod = |name: &str, annotations: Value| -> anyhow::Result<DynamicObject> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "lsalab.nthu/v1", "kind": "MtgpuPod",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"nodeName": tessera_harness::cluster::NODE_NAME,
                "terminationGracePeriodSeconds": 0, "containers": [{"name": "sleep",
                "image": "tessera.local/probe:1", "imagePullPolicy": "Never",
                "resources": {"requests": {"cpu": "1", "memory": "500Mi"},
                    "limits": {"cpu": "1", "memory": "500Mi"}}}]}
        }))?)
    };
    let status_of = |name: &'static str| {
        let mtgpupods = mtgpupods.clone();
        async move { Ok::<_, anyhow::Error>(mtgpupods.get(name).await?.data["status"].clone()) }
    };
    mtgpupods
        .create(
            &PostParams::default(),
            &mtgpupod(
                "pod1",
                json!({"lsalab.nthu/gpu_request": "0.5", "lsalab.nthu/gpu_limit": "1.0",
                       "lsalab.nthu/gpu_mem": "1073741824", "lsalab.nthu/GPUID": "abc"}),
            )?,
        )
        .await?;
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let exists = |name: &'static str| {
        let pods = pods.clone();
        move || {
            let pods = pods.clone();
            async move { Ok::<_, anyhow::Error>(pods.get_opt(name).await?.is_some()) }
        }
    };
    let (_, gpus) = made_pod_holds_its_share(cluster, "MtgpuPod", "pod1", "sleep").await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = status_of("pod1").await?;
        if status["PodStatus"]["phase"] == "Running" {
            ensure!(
                status["BoundDeviceID"] == gpus[0].0.as_str()
                    && status["PodObjectMeta"]["name"] == "pod1",
                "pod1's status {status}: want BoundDeviceID {} and its pod's name",
                gpus[0].0
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "pod1 shows {status} after 30 s, not its pod's Running"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // One that would forge a grant makes no pod, and says why.
    mtgpupods
        .create(
            &PostParams::default(),
            &mtgpupod(
                "pod-forged",
                json!({"lsalab.nthu/gpu_request": "0.5",
                       "scheduling.koordinator.sh/device-allocated": "{\"gpu\":[{\"minor\":0,\"resources\":{\"koordinator.sh/gpu-core\":100}}]}"}),
            )?,
        )
        .await?;
    let want =
        "annotation scheduling.koordinator.sh/device-allocated: only the scheduler writes it";
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = status_of("pod-forged").await?;
        if status["PodStatus"]["phase"] == "Failed" {
            ensure!(
                status["PodStatus"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(want)),
                "pod-forged: {status}, want a message saying {want:?}"
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "pod-forged shows {status} after 30 s, want Failed saying {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ensure!(
        pods.get_opt("pod-forged").await?.is_none(),
        "a pod was made from a refused MtgpuPod"
    );
    mtgpupods
        .delete("pod-forged", &DeleteParams::default())
        .await?;

    // Deleted, the MtgpuPod takes its pod with it (the garbage collector).
    mtgpupods.delete("pod1", &DeleteParams::default()).await?;
    let gone = exists("pod1");
    tessera_harness::until(
        "pod1's pod deleted with its MtgpuPod",
        Duration::from_secs(60),
        move || {
            let exists = gone();
            async move { Ok(!exists.await?) }
        },
    )
    .await
}

/// The pod `name` made from the `kind` object of its name, which asked 0.5 of a
/// GPU with a ceiling of 1.0 and 1 GiB: it appears (tessera-scheduler makes it from
/// a watch event, not at once), runs, is controlled by that object, holds
/// gpu-core 50 and 1 GiB on one GPU, and its `container` gets the ceiling and the
/// memory as limiter env. Returns it and its GPUs.
async fn made_pod_holds_its_share(
    cluster: &mut Cluster,
    kind: &str,
    name: &'static str,
    container: &str,
) -> anyhow::Result<(Pod, Vec<(String, u64)>)> {
    let pods: kube::Api<Pod> = kube::Api::namespaced(cluster.client().await?, "default");
    tessera_harness::until(
        &format!("a pod made from {kind} {name}"),
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            async move { Ok::<_, anyhow::Error>(pods.get_opt(name).await?.is_some()) }
        },
    )
    .await?;
    let running = cluster.wait_running(name).await?;
    let owner = running
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default()
        .into_iter()
        .next()
        .with_context(|| format!("{name}'s pod has no owner"))?;
    ensure!(
        owner.kind == kind && owner.name == name,
        "{name}'s pod is owned by {owner:?}"
    );
    let limits = first_limits(&running);
    ensure!(
        limits.get("koordinator.sh/gpu-core").map(|q| q.0.as_str()) == Some("50")
            && limits
                .get("koordinator.sh/gpu-memory")
                .map(|q| q.0.as_str())
                == Some("1073741824"),
        "{name}'s pod has limits {limits:?}, want gpu-core 50 and gpu-memory 1073741824"
    );
    let gpus = allocated_gpus(&running)?;
    ensure!(
        gpus.len() == 1,
        "{name}'s pod was granted {gpus:?}, want one GPU"
    );
    let specs = cluster.container_specs(&running)?;
    let spec = specs.get(container).context("no spec")?;
    ensure!(
        runtime_env(spec, "CUDA_DEVICE_SM_LIMIT").as_deref() == Some("100")
            && runtime_env(spec, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref() == Some("1024m"),
        "{name}: limiter env SM {:?} memory {:?}, want the ceiling 100 and 1024m",
        env_values(spec, "CUDA_DEVICE_SM_LIMIT"),
        env_values(spec, "CUDA_DEVICE_MEMORY_LIMIT_0")
    );
    Ok((running, gpus))
}

/// The limits of a pod's first container (where KubeShare's admission puts the share).
fn first_limits(
    pod: &Pod,
) -> std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity> {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.clone())
        .unwrap_or_default()
}

fn restart_count(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|s| s.first())
        .map_or(0, |s| s.restart_count)
}

/// Restarting each part while pods run and new ones arrive loses nothing: every
/// pod ends Running with its grant, and no GPU is booked twice. Each part must
/// stop on SIGTERM alone.
async fn restarts(cluster: &mut Cluster) -> anyhow::Result<()> {
    let components = [
        Component::RuntimeProxy,
        Component::Extender,
        Component::Reporter,
        Component::Kubelet,
        Component::Containerd,
        Component::Scheduler,
        Component::DevicePlugin,
    ];
    let mut names = Vec::new();
    for (i, component) in components.into_iter().enumerate() {
        let before = format!("before-{i}");
        create_one(cluster, &before, json!({"koordinator.sh/gpu": "10"})).await?;
        cluster.wait_running(&before).await?;
        cluster
            .restart(component)
            .await
            .with_context(|| format!("restarting {component}"))?;
        let after = format!("after-{i}");
        create_one(cluster, &after, json!({"koordinator.sh/gpu": "10"})).await?;
        names.push(before);
        names.push(after);
    }
    let mut share = std::collections::BTreeMap::<String, u64>::new();
    for name in &names {
        let pod = cluster
            .wait_running(name)
            .await
            .with_context(|| format!("after the restarts, pod {name}"))?;
        for (id, _) in allocated_gpus(&pod)? {
            *share.entry(id).or_default() += 10;
        }
        let specs = cluster.container_specs(&pod)?;
        assert_grant(
            name,
            "main",
            specs.get("main").context("no spec")?,
            &allocated_gpus(&pod)?,
        )?;
    }
    ensure!(
        share.values().all(|s| *s <= 100),
        "a GPU is booked over 100%: {share:?}"
    );
    for name in &names {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}
