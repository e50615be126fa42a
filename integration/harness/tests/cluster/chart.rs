//! Tessera installed the way an operator installs it, on a real one-node cluster
//! that has none of it: `tessera image build` makes the daemons' images, the Helm
//! chart (through `scripts/chart.py`, Helm's own Go SDK) installs the CRD, RBAC,
//! admission policies, tessera-scheduler, the reporter DaemonSet and the node
//! installer; kube-scheduler calls the installed extender over mutual TLS. The node
//! starts with kubelet talking to containerd directly; the chart's node installer
//! switches it to the proxy and proves it. The scenarios of [`super::ON_CHART`] then
//! run against that installation (a fractional pod, HAMi's documented example and a
//! tenant's forged allocation are checked here too); an upgrade changes a setting and
//! rolls the scheduler; an uninstall switches the node back and leaves nothing of
//! Tessera in the cluster. The proxy and GPU hook are the harness's, as systemd would
//! run them, with the proxy's h2 path (`--relay h2`). Needs python3.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;
use tessera_harness::cluster::{
    Cluster, ClusterOptions, ExtenderTls, NODE_NAME, allocated_gpus, env_values, probe_pod,
    repo_root, tessera_binary,
};

const NAMESPACE: &str = "tessera-system";
const TAG: &str = "chart-test";

/// `python3 scripts/chart.py <verb> …` against the cluster, with the values this
/// cluster needs: the images built here (never pulled), one scheduler replica, and
/// the driver directory where the fake NVML library is.
fn chart(cluster: &Cluster, verb: &str, extra: &[&str]) -> anyhow::Result<String> {
    let driver = cluster.dir().join("nvml");
    let mut command = Command::new("python3");
    command
        .current_dir(repo_root())
        .args(["scripts/chart.py", verb, "--kubeconfig"])
        .arg(cluster.kubeconfig())
        .args(["--namespace", NAMESPACE]);
    if verb != "uninstall" {
        command.args([
            "--set",
            &format!("image.tag={TAG}"),
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "scheduler.replicas=1",
            "--set",
            &format!("reporter.driverLibraryDir={}", driver.display()),
            // Where this cluster's proxy writes the node's files (backends,
            // kubelet's connections), not the host's /run/tessera.
            "--set",
            &format!(
                "reporter.enforcementDir={}",
                cluster.dir().join("enforce").display()
            ),
            "--set",
            "reporter.advertiseNvidiaGpu=true",
            // Tenants held to Pod Security by the chart's own policy, as a strict
            // operator installs it (off by default).
            "--set",
            "admissionPolicy.tenantPodSecurity=true",
        ]);
    }
    for value in extra {
        command.args(["--set", value]);
    }
    let output = command
        .output()
        .context("running python3 scripts/chart.py")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(output.status.success(), "chart.py {verb} failed: {text}");
    Ok(text)
}

/// The Running, Ready pods of `selector` in the install's namespace (90 s).
async fn ready_pods(cluster: &Cluster, selector: &str, what: &str) -> anyhow::Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, NAMESPACE);
    let started = Instant::now();
    loop {
        let ready: Vec<Pod> = pods
            .list(&ListParams::default().labels(selector))
            .await?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .collect();
        if !ready.is_empty() {
            return Ok(ready);
        }
        if started.elapsed() > Duration::from_secs(90) {
            let all = pods.list(&ListParams::default()).await?.items;
            let states: Vec<_> = all
                .iter()
                .map(|p| (p.metadata.name.clone(), p.status.clone()))
                .collect();
            bail!("no Ready {what} pod ({selector}) in 90 s; pods in {NAMESPACE}: {states:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Points kube-scheduler at the Ready scheduler pod run with `arg` (the spec being
/// rolled out), and returns its name.
async fn use_scheduler_pod(cluster: &mut Cluster, arg: &str) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let pods = ready_pods(
            cluster,
            "app.kubernetes.io/name=tessera-scheduler",
            "tessera-scheduler",
        )
        .await?;
        // During a rollout the old pod may still be Ready: wait for one of this spec.
        let current = pods.iter().find(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.args.as_ref())
                .is_some_and(|args| args.iter().any(|a| a == arg))
        });
        if let Some(pod) = current {
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .context("the scheduler pod has no IP")?;
            let tls = ExtenderTls::of(&cluster.dir().join("extender-pki"), NAMESPACE);
            cluster
                .set_extender(&format!("https://{ip}:8888"), Some(&tls))
                .await?;
            return Ok(pod.metadata.name.clone().unwrap_or_default());
        }
        if started.elapsed() > Duration::from_secs(90) {
            bail!("no Ready tessera-scheduler pod runs with {arg} in 90 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Creates pod `name` as the tenant with `limits` on one container and checks it
/// runs with exactly one GPU, that GPU's UUID its only visible device, and the
/// limiter `env` (key, value) it was granted. Returns it, Running.
async fn one_gpu_pod(
    cluster: &mut Cluster,
    name: &str,
    limits: serde_json::Value,
    env: (&str, &str),
) -> anyhow::Result<Pod> {
    cluster
        .create_pod("tenant", &probe_pod(name, &[("main", limits)], &[]))
        .await?;
    let running = cluster.wait_running(name).await?;
    let granted = allocated_gpus(&running)?;
    ensure!(
        granted.len() == 1,
        "pod {name} granted {granted:?}, want one GPU"
    );
    let specs = cluster.container_specs(&running)?;
    let spec = specs.get("main").context("no spec for main")?;
    let (key, value) = env;
    ensure!(
        env_values(spec, "NVIDIA_VISIBLE_DEVICES") == [granted[0].0.clone()]
            && env_values(spec, key) == [value],
        "pod {name}: NVIDIA_VISIBLE_DEVICES {:?}, {key} {:?} (want {value}); granted {granted:?}",
        env_values(spec, "NVIDIA_VISIBLE_DEVICES"),
        env_values(spec, key)
    );
    Ok(running)
}

/// A quarter-GPU pod placed through the installed extender and started through
/// the node's proxy: exactly one GPU, its UUID the only visible device, a 25% limit.
async fn fractional_pod(cluster: &mut Cluster, name: &str) -> anyhow::Result<()> {
    let limits = json!({"koordinator.sh/gpu": "25"});
    one_gpu_pod(cluster, name, limits, ("CUDA_DEVICE_SM_LIMIT", "25")).await?;
    cluster.delete_pod(name).await
}

/// HAMi's guide's example (`docs/migrate-hami.md`: `nvidia.com/gpu: 1` with
/// `nvidia.com/gpumem: 3000`) on a node where Tessera serves nvidia.com/gpu: one
/// GPU, 3000 MiB of it, and kubelet hands out no device-plugin GPU besides; then
/// HAMi's split count.
async fn hami_documented_pod(cluster: &mut Cluster) -> anyhow::Result<()> {
    super::migration::hami_guide_examples_run_as_written(cluster).await?;
    hami_split_pods_share_gpus(cluster).await
}

/// HAMi's split count (chart reporter.nvidiaGpuSplit, 10 as HAMi's): the node
/// advertises nvidia.com/gpu as GPUs × 10, so six pods each asking
/// `nvidia.com/gpu: 1` with 1000 MiB all run on the 4-GPU node (with the physical
/// count the fifth would stay Pending: "Insufficient nvidia.com/gpu").
async fn hami_split_pods_share_gpus(cluster: &mut Cluster) -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::Node;
    let nodes: kube::Api<Node> = kube::Api::all(cluster.client().await?);
    let node = nodes.get(tessera_harness::cluster::NODE_NAME).await?;
    let advertised = node
        .status
        .and_then(|s| s.capacity)
        .and_then(|c| c.get("nvidia.com/gpu").map(|q| q.0.clone()));
    ensure!(
        advertised.as_deref() == Some("40"),
        "nvidia.com/gpu capacity {advertised:?}, want 40 (4 GPUs × split 10)"
    );
    let names: Vec<String> = (0..6).map(|i| format!("hami-split-{i}")).collect();
    let limits = json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"});
    for name in &names {
        cluster
            .create_pod("tenant", &probe_pod(name, &[("main", limits.clone())], &[]))
            .await?;
    }
    let mut gpus = std::collections::BTreeSet::new();
    for name in &names {
        let running = cluster.wait_running(name).await?;
        let granted = allocated_gpus(&running)?;
        ensure!(
            granted.len() == 1,
            "pod {name} granted {granted:?}, want one GPU"
        );
        gpus.insert(granted[0].0.clone());
    }
    ensure!(
        gpus.len() <= 4,
        "six HAMi pods on {} GPUs of a 4-GPU node",
        gpus.len()
    );
    for name in &names {
        cluster.delete_pod(name).await?;
    }
    Ok(())
}

/// What an installation needs to be upgraded and uninstalled.
struct Installed {
    /// The node installer's values, given again on upgrade.
    installer: Vec<String>,
    /// The file the installer's restart command touches.
    restart_flag: PathBuf,
}

/// The cluster this suite installs Tessera on: none of Tessera's cluster side, the
/// proxy's h2 path, and Tessera (not NVIDIA's device plugin) serving
/// nvidia.com/gpu (chart value reporter.advertiseNvidiaGpu), so HAMi's manifests,
/// which ask nvidia.com/gpu with their memory, get no whole device-plugin GPU besides.
pub(super) fn options(trusted_agents: &str) -> ClusterOptions {
    ClusterOptions {
        cluster_side: false,
        // This cluster's kubelet talks through the h2 path (the main suite's
        // through the default frame relay): every call of a real kubelet, both ways.
        proxy_args: vec![
            "--relay=h2".into(),
            format!("--trusted-gpu-agents={trusted_agents}"),
        ],
        device_plugin: false,
        ..ClusterOptions::default()
    }
}

/// Runs the install, then `scenarios` against it, then the upgrade and the
/// uninstall, each reported as a test; returns those that failed.
pub(super) async fn suite(
    cluster: &mut Cluster,
    scenarios: &[(&'static str, super::Scenario)],
) -> Vec<super::Failure> {
    let mut failed = Vec::new();
    let mut report = |name: &str, started: Instant, outcome: anyhow::Result<()>| {
        let secs = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => println!("test chart/{name} ... ok ({secs:.1} s)"),
            Err(e) => {
                println!("test chart/{name} ... FAILED ({secs:.1} s)\n{e:#}\n");
                failed.push(super::Failure::new(format!("chart/{name}"), &e));
            }
        }
    };
    let started = Instant::now();
    let installed = match install(cluster).await {
        Ok(installed) => {
            report("install_switch_and_place", started, Ok(()));
            installed
        }
        Err(e) => {
            report("install_switch_and_place", started, Err(e));
            return failed;
        }
    };
    for (name, scenario) in scenarios {
        let started = Instant::now();
        let outcome = scenario(cluster).await;
        report(name, started, outcome);
    }
    let started = Instant::now();
    let outcome = upgrade_and_uninstall(cluster, installed).await;
    report("upgrade_and_uninstall_leave_nothing", started, outcome);
    failed
}

async fn install(cluster: &mut Cluster) -> anyhow::Result<Installed> {
    ensure!(
        cluster
            .log(tessera_harness::cluster::Component::RuntimeProxy)
            .contains("relay=h2"),
        "the proxy does not say it serves kubelet through the h2 path"
    );

    // The images, as an operator builds them.
    let tessera = tessera_binary("tessera")?;
    let images = tempfile::tempdir()?;
    let names = ["tessera-scheduler", "tessera-reporter", "tessera"];
    let output = Command::new(&tessera)
        .args(["image", "build", "--tag", TAG, "--out"])
        .arg(images.path())
        .arg("--bin-dir")
        .arg(tessera.parent().context("tessera has no directory")?)
        .args(names)
        .output()?;
    ensure!(
        output.status.success(),
        "tessera image build: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for name in names {
        cluster.import_image(&images.path().join(format!("{name}.tar")))?;
    }

    // The reporter's DaemonSet runs on nodes labelled as GPU nodes.
    let client = cluster.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            NODE_NAME,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tessera.io/gpu-node": "true"}}})),
        )
        .await?;

    // The extender serves mutual TLS: its CA and certificates, as the operator
    // makes them, the serving one in the Secret the chart mounts, kube-scheduler's
    // client one on the "control-plane host".
    let pki = cluster.dir().join("extender-pki");
    ExtenderTls::make(&pki, NAMESPACE)?;
    // The node as before Tessera: kubelet talks to containerd; the installer switches it.
    let containerd = cluster.containerd_socket();
    cluster.set_kubelet_endpoint(&containerd).await?;
    let restart_flag = cluster.dir().join("restart-kubelet");
    let installer = [
        "nodeInstaller.enabled=true".to_owned(),
        format!(
            "nodeInstaller.endpoint=unix://{}",
            cluster.proxy_socket().display()
        ),
        format!(
            "nodeInstaller.proxyMetrics={}",
            cluster.proxy_metrics_addr()
        ),
        // No systemd here: the harness restarts kubelet when the flag appears.
        format!(
            "nodeInstaller.restartCommand=touch {}",
            restart_flag.display()
        ),
    ];
    let installer: Vec<&str> = installer.iter().map(String::as_str).collect();
    let output = chart(cluster, "install", &installer)?;
    println!("install: {}", output.trim());
    let switched = node_switch(cluster, &restart_flag, true).await?;
    println!("node installer: {switched}");
    let read = |name: &str| -> anyhow::Result<k8s_openapi::ByteString> {
        Ok(k8s_openapi::ByteString(std::fs::read(pki.join(name))?))
    };
    let secret = k8s_openapi::api::core::v1::Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("tessera-scheduler-tls".into()),
            ..Default::default()
        },
        data: Some(
            [
                ("tls.crt".to_owned(), read("tessera-scheduler.crt")?),
                ("tls.key".to_owned(), read("tessera-scheduler.key")?),
                ("ca.crt".to_owned(), read("ca.crt")?),
            ]
            .into(),
        ),
        ..Default::default()
    };
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), NAMESPACE);
    secrets.create(&Default::default(), &secret).await?;
    ready_pods(
        cluster,
        "app.kubernetes.io/name=tessera-reporter",
        "tessera-reporter",
    )
    .await?;
    let devices = tessera_harness::cluster::device_api(&client);
    let started = Instant::now();
    while devices
        .get_opt(NODE_NAME)
        .await?
        .and_then(|d| d.data["spec"]["devices"].as_array().map(Vec::len))
        != Some(cluster.gpu_node.gpus.len())
    {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "the installed reporter did not publish the node's GPUs in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    use_scheduler_pod(cluster, "--gpu-policy=binpack").await?;
    fractional_pod(cluster, "installed-quarter").await?;
    hami_documented_pod(cluster).await?;

    // The installed admission policy: a tenant's own allocation is refused.
    let gpu = &cluster.gpu_node.gpus[0].uuid;
    let mut forged = probe_pod("forged", &[("main", json!({}))], &[]);
    forged["metadata"]["annotations"] = json!({
        tessera_harness::cluster::ALLOCATED:
            json!({"gpu": [{"minor": 0, "id": gpu, "resources": {"koordinator.sh/gpu-core": 100}}]}).to_string()
    });
    match cluster.create_pod("tenant", &forged).await {
        Ok(_) => bail!("the installed admission policy let a tenant write an allocation"),
        Err(e) => ensure!(
            format!("{e:#}").contains("only tessera-scheduler"),
            "forged pod refused, but not by the installed policy: {e:#}"
        ),
    }

    Ok(Installed {
        installer: installer.iter().map(|v| (*v).to_owned()).collect(),
        restart_flag,
    })
}

async fn upgrade_and_uninstall(cluster: &mut Cluster, installed: Installed) -> anyhow::Result<()> {
    let Installed {
        installer,
        restart_flag,
    } = installed;
    // Upgrade: a changed setting reaches the scheduler, which rolls, and still places.
    let mut upgrade: Vec<&str> = installer.iter().map(String::as_str).collect();
    upgrade.push("scheduler.gpuPolicy=spread");
    // And the replicas' NetworkPolicy on: the API server takes it as rendered (this
    // cluster's bridge network does not enforce it; kube-scheduler here is a host
    // process, so its source is the node's loopback and address range).
    upgrade.extend([
        "scheduler.networkPolicy.enabled=true",
        "scheduler.networkPolicy.extenderFrom[0].ipBlock.cidr=0.0.0.0/0",
    ]);
    let output = chart(cluster, "upgrade", &upgrade)?;
    println!("upgrade: {}", output.trim());
    use_scheduler_pod(cluster, "--gpu-policy=spread").await?;
    fractional_pod(cluster, "upgraded-quarter").await?;
    let policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy> =
        Api::namespaced(cluster.client().await?, NAMESPACE);
    let policy = policies.get("tessera-scheduler").await?;
    let rules = serde_json::to_value(policy.spec.as_ref().map(|s| &s.ingress))?;
    ensure!(
        rules.to_string().contains("\"port\":\"extender\"")
            && rules.to_string().contains("\"app\":\"tessera-scheduler\"")
            && rules.to_string().contains("0.0.0.0/0"),
        "the scheduler's NetworkPolicy admits other than the replicas and extenderFrom: {rules}"
    );

    // Cleaning the node while the reporter runs is refused: it would publish it all again.
    let cleanup = tessera_cleanup(cluster)?;
    ensure!(
        !cleanup.status.success()
            && String::from_utf8_lossy(&cleanup.stderr).contains("tessera-reporter pod still runs"),
        "tessera node cleanup with the reporter running: {cleanup:?}"
    );

    // Uninstall: nothing of Tessera is left but the namespace and the operator's Secret.
    let output = chart(cluster, "uninstall", &[])?;
    println!("uninstall: {}", output.trim());
    let switched = node_switch(cluster, &restart_flag, false).await?;
    println!("node installer at uninstall: {switched}");
    let backup = format!("{}.tessera-backup", cluster.kubelet_config_path().display());
    ensure!(
        !Path::new(&backup).exists(),
        "switched back, but {backup} is left"
    );
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(cluster.client().await?, NAMESPACE);
    secrets
        .delete("tessera-scheduler-tls", &Default::default())
        .await?;
    let started = Instant::now();
    loop {
        let left = leftovers(cluster).await?;
        if left.is_empty() {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "60 s after uninstall these are left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // What the reporter left on the node goes with `tessera node cleanup`, and only
    // that; and the switch taint an unproven switch-over leaves (its installer may
    // lose the rights to lift it at an uninstall): set here as one would be.
    let nodes = Api::<Node>::all(cluster.client().await?);
    let mut taints = nodes
        .get(NODE_NAME)
        .await?
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default();
    taints.push(k8s_openapi::api::core::v1::Taint {
        key: "tessera.io/runtime-proxy".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    });
    nodes
        .patch(
            NODE_NAME,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"taints": taints}})),
        )
        .await?;
    let cleanup = tessera_cleanup(cluster)?;
    ensure!(
        cleanup.status.success(),
        "tessera node cleanup: {cleanup:?}"
    );
    let node = nodes.get(NODE_NAME).await?;
    let status = node.status.unwrap_or_default();
    let resources: Vec<String> = status
        .capacity
        .unwrap_or_default()
        .into_keys()
        .chain(status.allocatable.unwrap_or_default().into_keys())
        .filter(|r| r.contains("gpu"))
        .collect();
    let labels: Vec<String> = node
        .metadata
        .labels
        .unwrap_or_default()
        .into_keys()
        .filter(|l| l.starts_with("node.koordinator.sh/"))
        .collect();
    let taints: Vec<String> = node
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.key)
        .filter(|k| k.starts_with("tessera.io/"))
        .collect();
    ensure!(
        resources.is_empty() && labels.is_empty() && taints.is_empty(),
        "after tessera node cleanup the node still has {resources:?} {labels:?} {taints:?}: {}",
        String::from_utf8_lossy(&cleanup.stdout)
    );
    Ok(())
}

/// `tessera node cleanup --nvidia-gpu` (the chart advertised nvidia.com/gpu) for this node.
fn tessera_cleanup(cluster: &Cluster) -> anyhow::Result<std::process::Output> {
    Ok(Command::new(tessera_binary("tessera")?)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(["node", "cleanup", "--nvidia-gpu", "--node", NODE_NAME])
        .output()?)
}

/// kubelet's runtime endpoint in its configuration file.
fn kubelet_endpoint(cluster: &Cluster) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(cluster.kubelet_config_path())?;
    let config: serde_yaml::Value = serde_yaml::from_str(&text)?;
    Ok(config["containerRuntimeEndpoint"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// Waits (90 s) until the node installer has switched kubelet to the proxy (`over`)
/// or back to containerd, restarting kubelet whenever the installer's restart
/// command asks: the endpoint is in kubelet's configuration, the switch taint is
/// gone, and the installer's log says it proved the switch. Returns that log line.
async fn node_switch(cluster: &mut Cluster, flag: &Path, over: bool) -> anyhow::Result<String> {
    let client = cluster.client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
    let want = if over {
        format!("unix://{}", cluster.proxy_socket().display())
    } else {
        format!("unix://{}", cluster.containerd_socket().display())
    };
    let proof = if over {
        "calls through the proxy; taint tessera.io/runtime-proxy removed"
    } else {
        "no longer calls the proxy"
    };
    let started = Instant::now();
    let mut log = String::new();
    loop {
        if flag.exists() {
            std::fs::remove_file(flag)?;
            cluster
                .restart(tessera_harness::cluster::Component::Kubelet)
                .await?;
        }
        let installers = pods
            .list(&ListParams::default().labels("app=tessera-node-installer"))
            .await?
            .items;
        for pod in &installers {
            // kubelet's files: every restart's words (a failed one's too).
            if let Ok(text) = cluster.container_log(pod, "installer") {
                log = text;
            }
        }
        let tainted = nodes
            .get(NODE_NAME)
            .await?
            .spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .iter()
            .any(|t| t.key == "tessera.io/runtime-proxy");
        if kubelet_endpoint(cluster)? == want && !tainted {
            if let Some(line) = log.lines().find(|l| l.contains(proof)) {
                return Ok(line.to_owned());
            }
            if !over && installers.is_empty() {
                // The pod went with the uninstall before its last words were read.
                return Ok(format!(
                    "kubelet's configuration names {want} again; log: {log}"
                ));
            }
        }
        ensure!(
            started.elapsed() < Duration::from_secs(90),
            "the node installer did not switch the node {} in 90 s: kubelet names {}, \
             tainted {tainted}; installer log: {log}",
            if over { "over" } else { "back" },
            kubelet_endpoint(cluster)?
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// What of the install is still in the cluster: objects labelled as part of
/// Tessera (cluster-wide and in its namespace), the Device CRD, and pods.
async fn leftovers(cluster: &Cluster) -> anyhow::Result<Vec<String>> {
    use kube::discovery::{Discovery, Scope};
    let client = cluster.client().await?;
    // While the CRD goes away its group may be listed but no longer served.
    let discovery = match Discovery::new(client.clone()).run().await {
        Ok(discovery) => discovery,
        Err(e) => return Ok(vec![format!("(discovery failed: {e})")]),
    };
    let mut left = Vec::new();
    let params = ListParams::default().labels("app.kubernetes.io/part-of=tessera");
    for group in discovery.groups() {
        for (resource, caps) in group.recommended_resources() {
            if !caps.supports_operation(kube::discovery::verbs::LIST)
                || resource.kind == "Namespace"
                || resource.kind == "Event"
            {
                continue;
            }
            let api: Api<kube::api::DynamicObject> = match caps.scope {
                Scope::Cluster => Api::all_with(client.clone(), &resource),
                Scope::Namespaced => Api::namespaced_with(client.clone(), NAMESPACE, &resource),
            };
            if let Ok(list) = api.list(&params).await {
                left.extend(list.items.iter().map(|o| {
                    format!(
                        "{} {}",
                        resource.kind,
                        o.metadata.name.clone().unwrap_or_default()
                    )
                }));
            }
        }
    }
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    if crds
        .get_opt("devices.scheduling.koordinator.sh")
        .await?
        .is_some()
    {
        left.push("CustomResourceDefinition devices.scheduling.koordinator.sh".into());
    }
    let pods: Api<Pod> = Api::namespaced(client, NAMESPACE);
    left.extend(
        pods.list(&ListParams::default())
            .await?
            .items
            .iter()
            .map(|p| format!("Pod {}", p.metadata.name.clone().unwrap_or_default())),
    );
    Ok(left)
}
