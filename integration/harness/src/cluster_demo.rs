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

/// The README's first pod ("Your own pod on the demo cluster"), as the banner
/// prints it: a tenant in `default`, a quarter of a GPU, the probe image.
pub const FIRST_POD: &str = "apiVersion: v1
kind: Pod
metadata: {name: mine, namespace: default}
spec:
  dnsPolicy: Default        # demo only: the demo cluster runs no cluster DNS
  containers:
    - name: main
      image: tessera.local/probe:1
      imagePullPolicy: Never  # built here and imported: there is no registry
      resources:
        limits: {koordinator.sh/gpu: \"25\"}";

/// The yaml block of the README's section "Your own pod on the demo cluster":
/// the pod a new user applies first, which the banner prints and the cluster tier
/// applies verbatim.
pub fn readme_first_pod() -> anyhow::Result<String> {
    let readme = std::fs::read_to_string(crate::cluster::repo_root().join("README.md"))?;
    let section = readme
        .split("\n### ")
        .find(|s| s.starts_with("Your own pod on the demo cluster"))
        .context("README.md has no section \"### Your own pod on the demo cluster\"")?;
    section
        .split("```yaml\n")
        .nth(1)
        .and_then(|block| block.split_once("\n```"))
        .map(|(yaml, _)| yaml.to_owned())
        .context("that section has no yaml block")
}

use crate::cluster::{
    Cluster, ClusterOptions, K8sBinaries, allocated_gpus, env_values, gpu_device_minors,
    is_running, probe_pod, tessera_binary,
};

macro_rules! say {
    ($out:expr, $($arg:tt)*) => {{
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Runs the story; with `keep_up`, waits for Ctrl-C before tearing the cluster
/// down. Returns the table's rows (the cluster tier checks them).
pub async fn run(out: &mut (dyn Write + Send), keep_up: bool) -> anyhow::Result<Vec<Row>> {
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

    let rows = story(&mut cluster, out).await?;

    if keep_up {
        let tessera = tessera_binary("tessera")?;
        say!(out, "==> the cluster stays up until Ctrl-C. Try:");
        say!(
            out,
            "    export KUBECONFIG={}   # cluster admin",
            cluster.kubeconfig().display()
        );
        say!(
            out,
            "    (or KUBECONFIG={}: a tenant's, with pods, logs and exec in namespace default only)",
            cluster.tenant_kubeconfig().display()
        );
        say!(
            out,
            "    kubectl get pods -o wide; kubectl logs whole-gpu   # with a kubectl of your own, as root; the probe prints the GPU device nodes and env it sees"
        );
        say!(out, "    {} inspect", tessera.display());
        say!(
            out,
            "    your own pod (no registry here: the demo's probe image, never pulled), then `{} inspect --pod mine` (as admin) and `kubectl logs mine`:",
            tessera.display()
        );
        for line in FIRST_POD.lines() {
            say!(out, "        {line}");
        }
        say!(
            out,
            "    metrics: http://{}/metrics (tessera-runtime-proxy), http://{}/metrics (tessera-reporter), http://{}/metrics (tessera-scheduler)",
            cluster.proxy_metrics_addr(),
            cluster.reporter_metrics_addr(),
            cluster.scheduler_metrics_addr()
        );
        say!(
            out,
            "    a container's OCI spec: {} --runtime-endpoint unix://{} ps, then inspect <id>",
            cluster.k8s_path("crictl").display(),
            cluster.proxy_socket().display()
        );
        say!(out, "    logs: {}/logs/", cluster.dir().display());
        let _ = out.flush();
        tokio::signal::ctrl_c().await?;
    }
    say!(out, "==> tearing the cluster down");
    drop(cluster);
    Ok(rows)
}

/// The demo's story on a running cluster: a device-plugin pod placed by another
/// scheduler, then the sample pods through kube-scheduler and tessera-scheduler;
/// prints what each container got and `tessera inspect`, and returns the table's
/// rows (the cluster tier checks them).
pub async fn story(
    cluster: &mut Cluster,
    out: &mut (dyn Write + Send),
) -> anyhow::Result<Vec<Row>> {
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
        say!(out, "    {name:<18} {}", asked(limits));
        cluster
            .create_pod("admin", &probe_pod(name, &[("main", limits.clone())], &[]))
            .await?;
    }
    let mut rows = Vec::new();
    let asked_by: Vec<(&str, String)> =
        std::iter::once(("legacy-training", json!({"nvidia.com/gpu": "1"})))
            .chain(samples.iter().map(|(n, l)| (*n, l.clone())))
            .map(|(n, l)| (n, asked(&l)))
            .collect();
    for (name, asked) in asked_by {
        let got = match running_or_refused(cluster, name).await? {
            Ok(pod) => {
                let specs = cluster.container_specs(&pod)?;
                let Some(spec) = specs.get("main") else {
                    continue;
                };
                let minors: Vec<String> =
                    gpu_device_minors(spec).iter().map(u64::to_string).collect();
                let env = limiter_env(spec);
                let annotated = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(crate::cluster::ALLOCATED));
                Ok(Got {
                    gpus: match allocated_gpus(&pod) {
                        Ok(gpus) => gpus
                            .iter()
                            .map(|(_, m)| m.to_string())
                            .collect::<Vec<_>>()
                            .join(","),
                        Err(error) if annotated => format!("unreadable allocation: {error:#}"),
                        Err(_) if minors.is_empty() => "device plugin".into(),
                        Err(_) => format!("{} (device plugin)", minors.join(",")),
                    },
                    visible: env_values(spec, "NVIDIA_VISIBLE_DEVICES")
                        .pop()
                        .unwrap_or_else(|| "-".into()),
                    limits: limiter(&env),
                    held_by: env_values(spec, "TESSERA_ENFORCEMENT")
                        .pop()
                        .unwrap_or_else(|| "-".into()),
                    devices: gpu_nodes(
                        minors
                            .iter()
                            .map(|m| format!("/dev/nvidia{m}"))
                            .collect::<Vec<_>>()
                            .iter()
                            .map(String::as_str),
                    ),
                })
            }
            Err(reason) => Err(reason),
        };
        rows.push(Row {
            pod: name.to_owned(),
            asked,
            got,
        });
    }
    say!(
        out,
        "\nWhat each container got, read from the OCI spec containerd wrote (GPU device nodes: the spec's):\n{}",
        table(&rows)
    );

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
    Ok(rows)
}

/// The pod once it runs, or why kube-scheduler left it unplaced, as soon as
/// either shows (30 s at most): no half-minute wait on a pod that fits nowhere.
async fn running_or_refused(
    cluster: &mut Cluster,
    name: &str,
) -> anyhow::Result<Result<k8s_openapi::api::core::v1::Pod, String>> {
    let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(
        cluster.client().await?,
        "default",
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pod = pods.get(name).await?;
        if is_running(&pod) {
            return Ok(Ok(pod));
        }
        let bound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        if !bound
            && let Some(reason) = cluster
                .events_of(name)
                .await?
                .into_iter()
                .rfind(|e| e.starts_with("FailedScheduling"))
        {
            return Ok(Err(reason));
        }
        if Instant::now() >= deadline {
            return Ok(Err(if bound {
                // What kubelet says of the containers (CreateContainerError and
                // the GPU hook's reason, an image it cannot pull).
                let waiting: Vec<String> = pod
                    .status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
                    .filter_map(|c| {
                        let waiting = c.state.as_ref()?.waiting.as_ref()?;
                        Some(format!(
                            "container {}: {}: {}",
                            c.name,
                            waiting.reason.as_deref().unwrap_or("waiting"),
                            waiting.message.as_deref().unwrap_or_default()
                        ))
                    })
                    .collect();
                format!("placed, not running after 30 s; {}", waiting.join("; "))
            } else {
                "not placed after 30 s".into()
            }));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
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

/// One pod in the demo's table: what it asked, and what its container got or
/// why it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The pod's name.
    pub pod: String,
    /// Its container's limits, as [`asked`] writes them.
    pub asked: String,
    /// What the container got, or why the pod is not placed.
    pub got: Result<Got, String>,
}

/// What a container got, from its OCI spec (or, for device nodes, from inside it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Got {
    /// GPU minors, comma-separated; `N (device plugin)` or `device plugin` (its
    /// minors are not in the OCI spec) for a device-plugin pod.
    pub gpus: String,
    /// `NVIDIA_VISIBLE_DEVICES`.
    pub visible: String,
    /// HAMi-core's limiter env, as [`limiter`] writes it.
    pub limits: String,
    /// `TESSERA_ENFORCEMENT`: the backends holding the share.
    pub held_by: String,
    /// `/dev/nvidiaN` nodes, by name.
    pub devices: String,
}

/// A container's limits, `name=value`, space-separated, in name order.
pub fn asked(limits: &Value) -> String {
    limits
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, value)| format!("{name}={}", value.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// HAMi-core's limiter env in an OCI spec: every `CUDA_DEVICE_*` key, the last
/// value of each (the one the runtime acts on).
pub fn limiter_env(spec: &Value) -> Vec<(String, String)> {
    let mut env = std::collections::BTreeMap::new();
    for entry in spec["process"]["env"].as_array().into_iter().flatten() {
        if let Some((key, value)) = entry.as_str().and_then(|e| e.split_once('='))
            && key.starts_with("CUDA_DEVICE_")
        {
            env.insert(key.to_owned(), value.to_owned());
        }
    }
    env.into_iter().collect()
}

/// HAMi-core's limiter env (`CUDA_DEVICE_SM_LIMIT`, `CUDA_DEVICE_MEMORY_LIMIT_N`)
/// read for a person: `8192m` is MiB to HAMi-core, not milli, and N counts the
/// container's own GPUs (not their minors), so memory reads per GPU in order.
pub fn limiter(env: &[(String, String)]) -> String {
    let mut compute = None;
    let mut memory = std::collections::BTreeMap::new();
    for (key, value) in env {
        if key == "CUDA_DEVICE_SM_LIMIT" {
            compute = Some(format!("compute {value}%"));
        } else if let Some(index) = key
            .strip_prefix("CUDA_DEVICE_MEMORY_LIMIT_")
            .and_then(|i| i.parse::<u32>().ok())
        {
            // HAMi-core's suffixes: k, m, g (KiB, MiB, GiB); none is bytes.
            let (digits, unit) = match value.char_indices().last() {
                Some((i, c)) if c.is_ascii_alphabetic() => (&value[..i], c.to_ascii_lowercase()),
                _ => (value.as_str(), 'b'),
            };
            let mib = digits.parse::<u64>().ok().and_then(|n| match unit {
                'g' => Some(n * 1024),
                'm' => Some(n),
                'k' if n % 1024 == 0 => Some(n / 1024),
                'b' if n % (1 << 20) == 0 => Some(n >> 20),
                _ => None,
            });
            memory.insert(
                index,
                match mib {
                    Some(mib) if mib % 1024 == 0 => format!("{} GiB", mib / 1024),
                    Some(mib) => format!("{mib} MiB"),
                    None => value.clone(),
                },
            );
        }
    }
    let memory = (!memory.is_empty()).then(|| {
        format!(
            "memory {}",
            memory.into_values().collect::<Vec<_>>().join(" + ")
        )
    });
    let parts: Vec<String> = compute.into_iter().chain(memory).collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

/// The `/dev/nvidiaN` nodes among `paths`, by name (`nvidia0,nvidia2`).
pub fn gpu_nodes<'a>(paths: impl IntoIterator<Item = &'a str>) -> String {
    let mut nodes: Vec<&str> = paths
        .into_iter()
        .filter_map(|p| p.strip_prefix("/dev/"))
        .filter(|n| {
            n.strip_prefix("nvidia")
                .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    if nodes.is_empty() {
        "-".into()
    } else {
        nodes.join(",")
    }
}

/// The demo's table, the same for the embedded and the cluster demo: each column
/// as wide as its widest cell, UUIDs shortened to their last group.
pub fn table(rows: &[Row]) -> String {
    const HEADER: [&str; 7] = [
        "POD",
        "ASKED",
        "GPUS",
        "NVIDIA_VISIBLE_DEVICES",
        "HAMI-CORE LIMITS",
        "HELD BY",
        "GPU DEVICE NODES",
    ];
    let short = |uuids: &str| {
        uuids
            .split(',')
            .map(|u| match u.rsplit_once('-') {
                Some((_, last)) if u.starts_with("GPU-") => format!("GPU-…{last}"),
                _ => u.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let mut cells = vec![row.pod.clone(), row.asked.clone()];
            match &row.got {
                Ok(got) => cells.extend([
                    got.gpus.clone(),
                    short(&got.visible),
                    got.limits.clone(),
                    got.held_by.clone(),
                    got.devices.clone(),
                ]),
                Err(reason) => cells.push(format!("Pending: {reason}")),
            }
            cells
        })
        .collect();
    // A Pending row's reason runs on past the columns: it does not widen them.
    let mut widths: Vec<usize> = HEADER.iter().map(|h| h.chars().count()).collect();
    for row in &cells {
        let sized = if row.len() == HEADER.len() {
            row.len()
        } else {
            row.len() - 1
        };
        for (width, cell) in widths.iter_mut().zip(&row[..sized]) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let pad = widths[i].saturating_sub(cell.chars().count()) + 2;
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            }
        }
        text.trim_end().to_owned() + "\n"
    };
    let mut text = line(&HEADER.map(str::to_owned));
    for row in &cells {
        text.push_str(&line(row));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_banner_prints_the_readmes_first_pod() {
        assert_eq!(
            readme_first_pod().expect("the README's first pod"),
            FIRST_POD
        );
    }

    #[test]
    fn the_table_says_what_each_pod_asked_and_got_in_aligned_columns() {
        let rows = vec![
            Row {
                pod: "two-gpus-shared".into(),
                asked: asked(&sample_pods()[1].1),
                got: Ok(Got {
                    gpus: "1,2".into(),
                    visible: "GPU-7e55e2a0-0000-4000-8000-000000000001,GPU-7e55e2a0-0000-4000-8000-000000000002".into(),
                    limits: limiter(&[
                        ("CUDA_DEVICE_SM_LIMIT".into(), "25".into()),
                        ("CUDA_DEVICE_MEMORY_LIMIT_0".into(), "8192m".into()),
                        ("CUDA_DEVICE_MEMORY_LIMIT_1".into(), "1000m".into()),
                    ]),
                    held_by: "hami-core".into(),
                    devices: gpu_nodes(["/dev/nvidiactl", "/dev/nvidia2", "/dev/nvidia1", "/dev/nvidia-uvm"]),
                }),
            },
            Row {
                pod: "another-whole-gpu".into(),
                asked: asked(&sample_pods()[6].1),
                got: Err("0 of 3 usable GPUs have room".into()),
            },
        ];
        assert_eq!(
            table(&rows),
            "POD                ASKED                                                           GPUS  NVIDIA_VISIBLE_DEVICES               HAMI-CORE LIMITS                      HELD BY    GPU DEVICE NODES\n\
             two-gpus-shared    nvidia.com/gpu=2 nvidia.com/gpucores=25 nvidia.com/gpumem=8192  1,2   GPU-…000000000001,GPU-…000000000002  compute 25%, memory 8 GiB + 1000 MiB  hami-core  nvidia1,nvidia2\n\
             another-whole-gpu  nvidia.com/gpu=1                                                Pending: 0 of 3 usable GPUs have room\n"
        );
        assert_eq!(limiter(&[]), "-");
        // Three GPUs, HAMi-core's other units; an unknown one shown as written.
        let memory = |values: [&str; 3]| {
            limiter(
                &values
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), (*v).to_owned()))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(
            memory(["2g", "2048m", "2147483648"]),
            "memory 2 GiB + 2 GiB + 2 GiB"
        );
        assert_eq!(
            memory(["1048576k", "12x", "100"]),
            "memory 1 GiB + 12x + 100"
        );
        let spec = serde_json::json!({"process": {"env": [
            "CUDA_DEVICE_SM_LIMIT=10", "PATH=/bin", "CUDA_DEVICE_MEMORY_LIMIT_2=1g",
            "CUDA_DEVICE_SM_LIMIT=25"]}});
        assert_eq!(
            limiter_env(&spec),
            vec![
                ("CUDA_DEVICE_MEMORY_LIMIT_2".to_owned(), "1g".to_owned()),
                ("CUDA_DEVICE_SM_LIMIT".to_owned(), "25".to_owned())
            ]
        );
        assert_eq!(gpu_nodes(["/dev/nvidiactl"]), "-");
    }
}
