//! `tessera-demo --cluster`: the demo's story on a real one-node cluster. The
//! sample pods go through the real kube-scheduler and tessera-scheduler, start
//! through kubelet → tessera-runtime-proxy → containerd 2.x, and what each
//! container got is read from the OCI spec containerd wrote. The cluster stays up
//! until Ctrl-C, for `kubectl` and `tessera inspect`.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::cluster::{
    Cluster, ClusterOptions, K8sBinaries, allocated_gpus, env_values, gpu_device_minors,
    is_running, probe_pod, tessera_binary,
};

macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Runs the story; with `keep_up`, waits for Ctrl-C before tearing the cluster down.
pub async fn run(out: &mut (dyn Write + Send), keep_up: bool) -> anyhow::Result<()> {
    let binaries = K8sBinaries::locate()?.with_context(|| {
        format!(
            "no Kubernetes binaries: set {} to a directory holding kubelet, kube-apiserver, … \
             or put ../shared/k8s/bin beside the repository",
            crate::cluster::K8S_BIN_ENV
        )
    })?;
    say!(
        out,
        "==> starting a one-node cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler + tessera-scheduler, kubelet -> tessera-runtime-proxy -> containerd 2.x, NVIDIA device plugin on a fake 4-GPU node, tessera-reporter)"
    );
    let started = Instant::now();
    // Shares held by the driver's memory limits (the fake NVML has them) and a
    // stand-in HAMi-core, as on a GPU node with both.
    let options = ClusterOptions {
        enforcement: true,
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(binaries, options).await?;
    say!(out, "    up in {:.1} s", started.elapsed().as_secs_f64());

    // A device-plugin pod placed by another scheduler, as before Tessera was installed.
    let mut legacy = probe_pod(
        "legacy-training",
        &[("main", json!({"nvidia.com/gpu": "1"}))],
        &[],
    );
    legacy["spec"]["schedulerName"] = json!("another-scheduler");
    cluster.create_pod("admin", &legacy).await?;
    cluster.bind_as_other_scheduler("legacy-training").await?;
    cluster.wait_running("legacy-training").await?;
    say!(
        out,
        "==> legacy-training runs with nvidia.com/gpu: 1 from NVIDIA's device plugin (kubelet's checkpoint records its GPU)"
    );
    // Give the reporter a resync to publish it before Tessera places anything.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let samples = sample_pods();
    say!(out, "==> creating sample pods through kube-scheduler:");
    for (name, limits) in &samples {
        say!(out, "    {name:<18} {limits}");
        cluster
            .create_pod("admin", &probe_pod(name, &[("main", limits.clone())], &[]))
            .await?;
    }
    say!(
        out,
        "\n{:<18} {:<10} {:<44} {:<34} {:<24} {}",
        "POD",
        "GPU MINOR",
        "NVIDIA_VISIBLE_DEVICES (OCI spec)",
        "LIMITER ENV (m = MiB)",
        "HELD BY",
        "GPU DEVICE NODES (OCI spec)"
    );
    for name in std::iter::once("legacy-training").chain(samples.iter().map(|(n, _)| *n)) {
        match cluster
            .wait_pod(name, Duration::from_secs(30), "Running", is_running)
            .await
        {
            Ok(pod) => {
                let specs = cluster.container_specs(&pod)?;
                let Some(spec) = specs.get("main") else {
                    continue;
                };
                let minors: Vec<String> =
                    gpu_device_minors(spec).iter().map(u64::to_string).collect();
                let limits: Vec<String> = [
                    "CUDA_DEVICE_SM_LIMIT",
                    "CUDA_DEVICE_MEMORY_LIMIT_0",
                    "CUDA_DEVICE_MEMORY_LIMIT_1",
                ]
                .iter()
                .flat_map(|key| {
                    env_values(spec, key)
                        .into_iter()
                        .map(move |v| format!("{}={v}", key.trim_start_matches("CUDA_DEVICE_")))
                })
                .collect();
                let placed = allocated_gpus(&pod).map_or("kubelet".into(), |gpus| {
                    gpus.iter()
                        .map(|(_, m)| m.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                });
                say!(
                    out,
                    "{:<18} {:<10} {:<44} {:<34} {:<24} {}",
                    name,
                    placed,
                    env_values(spec, "NVIDIA_VISIBLE_DEVICES")
                        .join(" | ")
                        .replace("GPU-7e55e2a0-0000-4000-8000-", "GPU-…"),
                    if limits.is_empty() {
                        "-".into()
                    } else {
                        limits.join(" ")
                    },
                    env_values(spec, "TESSERA_ENFORCEMENT")
                        .pop()
                        .unwrap_or_else(|| "-".into()),
                    minors.join(",")
                );
            }
            Err(_) => {
                let reason = cluster
                    .events_of(name)
                    .await?
                    .into_iter()
                    .rfind(|e| e.starts_with("FailedScheduling"))
                    .unwrap_or_else(|| "not running".into());
                say!(out, "{name:<18} Pending: {reason}");
            }
        }
    }

    let inspect = Command::new(tessera_binary("tessera")?)
        .arg("inspect")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .output()
        .context("running tessera inspect")?;
    say!(
        out,
        "\n$ tessera inspect\n{}",
        String::from_utf8_lossy(&inspect.stdout)
    );
    if !inspect.status.success() {
        say!(out, "{}", String::from_utf8_lossy(&inspect.stderr));
    }
    if keep_up {
        let kubeconfig = cluster.kubeconfig();
        say!(out, "==> the cluster stays up until Ctrl-C. Try:");
        say!(out, "    export KUBECONFIG={}", kubeconfig.display());
        say!(
            out,
            "    kubectl get pods -o wide        # if kubectl is installed"
        );
        say!(out, "    {} inspect", tessera_binary("tessera")?.display());
        say!(
            out,
            "    your own pod: image tessera.local/probe:1 with imagePullPolicy: Never (there is no registry; README, \"Your own pod on the demo cluster\")"
        );
        say!(
            out,
            "    what a container got (kubectl logs/exec need cluster DNS, absent here): {} --runtime-endpoint unix://{} ps, then inspect <id>",
            cluster.k8s_path("crictl").display(),
            cluster.proxy_socket().display()
        );
        say!(out, "    logs: {}/logs/", cluster.dir().display());
        let _ = out.flush();
        tokio::signal::ctrl_c().await?;
    }
    say!(out, "==> tearing the cluster down");
    drop(cluster);
    Ok(())
}

/// The demo's sample pods (embedded and on the cluster), by name, with their
/// containers' limits.
pub fn sample_pods() -> Vec<(&'static str, Value)> {
    vec![
        ("whole-gpu", json!({"nvidia.com/gpu": "1"})),
        (
            "two-gpus-shared",
            json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "25"}),
        ),
        ("half-gpu", json!({"koordinator.sh/gpu": "50"})),
        ("quarter-a", json!({"koordinator.sh/gpu": "25"})),
        ("quarter-b", json!({"koordinator.sh/gpu": "25"})),
        ("memory-20gi", json!({"koordinator.sh/gpu-memory": "20Gi"})),
        ("another-whole-gpu", json!({"nvidia.com/gpu": "1"})),
    ]
}
