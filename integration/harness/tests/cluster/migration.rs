//! The migration guides' examples (`docs/migrate-*.md`, each guide's section
//! "Examples the tests apply"), read from the guides themselves and applied to the
//! real cluster as a tenant, so that a guide cannot promise what the cluster does
//! not do. Each is applied as written but for what this cluster cannot run: the
//! image (no registry: the CUDA-like probe, whose own `NVIDIA_VISIBLE_DEVICES=all`
//! the grant must overrule), its command, and CPU and memory (two cores).
//!
//! The guide is the manifest; what each example must get is here, in the guide's
//! order, and a guide with an example this table lacks (or the reverse) fails.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ApiResource, DynamicObject};
use serde_json::Value;
use tessera_harness::cluster::{
    Cluster, KUBELET_CHECKPOINT, NODE_NAME, allocated_gpus, device_api, gpu_device_minors,
    is_running, runtime_env,
};
use tessera_harness::image::CUDA_PROBE_IMAGE;

/// What a container of an example must run with.
struct Container {
    name: &'static str,
    /// How many GPUs (distinct), 0 for none.
    gpus: usize,
    /// `CUDA_DEVICE_SM_LIMIT`, or `None` for unset.
    sm: Option<&'static str>,
    /// `CUDA_DEVICE_MEMORY_LIMIT_<i>` on each of its GPUs, or `None` for unset.
    memory: Option<&'static str>,
    /// Another system's env, `{index}` standing for the GPU's index on the node.
    env: &'static [(&'static str, &'static str)],
}

/// What applying an example must come to.
enum Outcome {
    /// It runs (every replica of a StatefulSet), each container as listed.
    Runs(&'static [Container]),
    /// As `Runs` on a node without MPS; where MPS holds shares (one GPU's per
    /// container) it stays Pending, the reason saying so.
    RunsWithoutMps(&'static [Container]),
    /// The API server refuses it at creation, with a message containing this.
    Refused(&'static str),
    /// It stays Pending, a FailedScheduling event containing this.
    Waits(&'static str),
}

/// Why a pod with a container holding shares of several GPUs waits on an MPS node.
const MPS_REASON: &str = "not where MPS holds shares, one GPU per container";

/// Every other system's env the GPU hook may set: set only where a container asked
/// in that system's names.
const SYSTEM_ENV: [&str; 6] = [
    "ALIYUN_COM_GPU_MEM_IDX",
    "ALIYUN_COM_GPU_MEM_POD",
    "ALIYUN_COM_GPU_MEM_CONTAINER",
    "ALIYUN_COM_GPU_MEM_DEV",
    "VOLCANO_GPU_ALLOCATED",
    "VOLCANO_GPU_MEMORY_TOTAL",
];

const fn whole(name: &'static str, gpus: usize) -> Container {
    Container {
        name,
        gpus,
        sm: None,
        memory: None,
        env: &[],
    }
}

/// A guide's examples in its order: (kind/name, outcome).
type Examples = &'static [(&'static str, Outcome)];

/// HAMi's guide, on the chart suite's cluster: there Tessera, not NVIDIA's device
/// plugin, serves `nvidia.com/gpu` (as the guide's switch has it).
const HAMI: Examples = &[(
    "Pod/gpu-pod",
    Outcome::Runs(&[Container {
        name: "ubuntu-container",
        gpus: 1,
        sm: None,
        memory: Some("3000m"),
        env: &[],
    }]),
)];

/// The guides the main suite applies.
const GUIDES: &[(&str, Examples)] = &[
    (
        "migrate-kubeshare.md",
        &[
            (
                // Half the compute booked, all of it the ceiling (gpu_limit 1.0).
                "SharePod/sharepod1",
                Outcome::Runs(&[Container {
                    name: "cuda",
                    gpus: 1,
                    sm: Some("100"),
                    memory: Some("1024m"),
                    env: &[],
                }]),
            ),
            (
                "Pod/mnist",
                Outcome::Waits(
                    "lsalab.nthu/gpu_model=\"NVIDIA-GeForce-GTX-1080\" rules out every GPU of every node",
                ),
            ),
        ],
    ),
    (
        "migrate-gpushare.md",
        &[(
            "StatefulSet/binpack-1",
            Outcome::Runs(&[Container {
                name: "binpack-1",
                gpus: 1,
                sm: None,
                memory: Some("3072m"),
                env: &[
                    ("ALIYUN_COM_GPU_MEM_IDX", "{index}"),
                    ("ALIYUN_COM_GPU_MEM_POD", "3"),
                    ("ALIYUN_COM_GPU_MEM_CONTAINER", "3"),
                    ("ALIYUN_COM_GPU_MEM_DEV", "80"),
                ],
            }]),
        )],
    ),
    (
        "migrate-volcano.md",
        &[
            ("Pod/gpu-pod1", Outcome::Runs(&[whole("cuda-container", 1)])),
            (
                "Pod/gpu-pod1",
                Outcome::Runs(&[Container {
                    name: "cuda-container",
                    gpus: 1,
                    sm: None,
                    memory: Some("1024m"),
                    env: &[
                        ("VOLCANO_GPU_ALLOCATED", "1024"),
                        ("VOLCANO_GPU_MEMORY_TOTAL", "81920"),
                    ],
                }]),
            ),
            (
                "Pod/hami-pod",
                Outcome::Runs(&[Container {
                    name: "cuda-container",
                    gpus: 1,
                    sm: Some("50"),
                    memory: Some("3000m"),
                    env: &[],
                }]),
            ),
            (
                "Pod/gpu-pod12",
                Outcome::RunsWithoutMps(&[
                    Container {
                        name: "ubuntu-container",
                        gpus: 2,
                        sm: None,
                        memory: Some("2000m"),
                        env: &[],
                    },
                    whole("ubuntu-container0", 0),
                    Container {
                        name: "ubuntu-container1",
                        gpus: 2,
                        sm: None,
                        memory: Some("3000m"),
                        env: &[],
                    },
                ]),
            ),
        ],
    ),
    (
        "migrate-koordinator.md",
        &[
            (
                "Pod/pod-example",
                Outcome::Runs(&[Container {
                    name: "curlimage",
                    gpus: 1,
                    sm: Some("50"),
                    memory: Some("40960m"),
                    env: &[],
                }]),
            ),
            (
                "Pod/pod-example",
                Outcome::Refused("write koordinator.sh/gpu: 100 instead"),
            ),
            ("Pod/pod-example", Outcome::Runs(&[whole("curlimage", 1)])),
            ("Pod/gpus-on-one-switch", Outcome::Runs(&[whole("main", 2)])),
            (
                "Pod/gpus-on-one-numa-node",
                Outcome::Waits(
                    "requires all of the pod's GPUs under one NUMA node, and no NUMA node of this node has room for them, even with nothing running",
                ),
            ),
        ],
    ),
];

/// Applies the gpushare, Volcano and Koordinator guides' examples.
pub(super) async fn migration_guides_examples_run_as_written(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    for (guide, expected) in GUIDES {
        run_guide(cluster, guide, expected).await?;
    }
    Ok(())
}

/// Applies the HAMi guide's examples (the chart suite's cluster).
pub(super) async fn hami_guide_examples_run_as_written(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    run_guide(cluster, "migrate-hami.md", HAMI).await
}

/// Applies a guide's examples, one at a time (two may share a name), and checks
/// each against what it must get.
async fn run_guide(cluster: &mut Cluster, guide: &str, expected: Examples) -> anyhow::Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs")
        .join(guide);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let examples = examples(&text).with_context(|| format!("docs/{guide}"))?;
    let found: Vec<String> = examples.iter().map(kind_name).collect();
    let want: Vec<&str> = expected.iter().map(|(what, _)| *what).collect();
    ensure!(
        found == want,
        "docs/{guide}'s examples are {found:?}, but migration.rs expects {want:?}: keep them in step"
    );
    let mps = node_has_mps(cluster).await?;
    for (example, (what, outcome)) in examples.into_iter().zip(expected.iter()) {
        apply(cluster, as_test_cluster(example)?, outcome, mps)
            .await
            .with_context(|| format!("docs/{guide}: {what}"))?;
    }
    Ok(())
}

/// The YAML documents of the code blocks under "## Examples the tests apply".
fn examples(guide: &str) -> anyhow::Result<Vec<Value>> {
    let section = guide
        .split("\n## ")
        .find(|s| s.starts_with("Examples the tests apply"))
        .context("no section \"## Examples the tests apply\"")?;
    let mut docs = Vec::new();
    for block in section.split("```yaml\n").skip(1) {
        let (yaml, _) = block
            .split_once("\n```")
            .context("a yaml block never closed")?;
        for doc in serde_yaml::Deserializer::from_str(yaml) {
            let value: Value = serde::Deserialize::deserialize(doc)?;
            docs.push(value);
        }
    }
    Ok(docs)
}

fn kind_name(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The example as this cluster can run it: the probe image in place of the
/// example's (and no command, which the probe's entrypoint is), and no CPU or
/// memory request, which a two-core node may not hold.
fn as_test_cluster(mut doc: Value) -> anyhow::Result<Value> {
    let spec = match doc["kind"].as_str() {
        Some("Pod" | "SharePod") => &mut doc["spec"],
        Some("StatefulSet") => &mut doc["spec"]["template"]["spec"],
        other => bail!("kind {other:?}: the scenario applies Pods, StatefulSets and SharePods"),
    };
    spec["terminationGracePeriodSeconds"] = 0.into();
    for container in spec["containers"]
        .as_array_mut()
        .context("no containers")?
        .iter_mut()
    {
        let container = container.as_object_mut().context("a container")?;
        container.insert("image".into(), CUDA_PROBE_IMAGE.into());
        container.insert("imagePullPolicy".into(), "Never".into());
        container.remove("command");
        container.remove("args");
        for list in ["limits", "requests"] {
            if let Some(map) = container
                .get_mut("resources")
                .and_then(|r| r.get_mut(list))
                .and_then(Value::as_object_mut)
            {
                map.remove("cpu");
                map.remove("memory");
            }
        }
    }
    Ok(doc)
}

/// The node's GPUs as its Device CR lists them.
async fn device_gpus(cluster: &Cluster) -> anyhow::Result<Vec<Value>> {
    let device = device_api(&cluster.client().await?).get(NODE_NAME).await?;
    Ok(device.data["spec"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Whether the node's GPUs carry MPS's label (the proxy runs `--mps on`).
async fn node_has_mps(cluster: &Cluster) -> anyhow::Result<bool> {
    Ok(device_gpus(cluster)
        .await?
        .iter()
        .any(|gpu| gpu["labels"]["tessera.io/enforce-mps"] == "true"))
}

/// Applies one example as the tenant and checks it against `outcome` (on a node
/// with MPS or not), then removes it.
async fn apply(
    cluster: &mut Cluster,
    doc: Value,
    outcome: &Outcome,
    mps: bool,
) -> anyhow::Result<()> {
    let name = doc["metadata"]["name"]
        .as_str()
        .context("no name")?
        .to_owned();
    let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
    let owner = owner_api(cluster.client_as("tenant").await?, &kind);
    let created = match &owner {
        Some(api) => api
            .create(&Default::default(), &serde_json::from_value(doc.clone())?)
            .await
            .map(drop)
            .map_err(anyhow::Error::from),
        None => cluster.create_pod("tenant", &doc).await.map(drop),
    };
    // The pods it makes: a StatefulSet's by ordinal, a SharePod's of its own name.
    let pods: Vec<String> = if kind == "StatefulSet" {
        let replicas = doc["spec"]["replicas"].as_u64().unwrap_or(1);
        (0..replicas).map(|i| format!("{name}-{i}")).collect()
    } else {
        vec![name.clone()]
    };
    let outcome = match (outcome, created) {
        (Outcome::Refused(want), Err(e)) => {
            let message = format!("{e:#}");
            ensure!(
                message.contains(want),
                "refused, but not saying {want:?}: {message}"
            );
            return Ok(());
        }
        (_, Err(e)) => return Err(e.context("refused at creation")),
        (Outcome::Refused(want), Ok(())) => Err(anyhow::anyhow!(
            "created, though it should be refused ({want:?})"
        )),
        (Outcome::Waits(reason), Ok(())) => waits_for(cluster, &name, reason).await,
        (Outcome::RunsWithoutMps(_), Ok(())) if mps => waits_for(cluster, &name, MPS_REASON).await,
        (Outcome::Runs(containers) | Outcome::RunsWithoutMps(containers), Ok(())) => {
            let mut outcome = Ok(());
            for pod in &pods {
                outcome = match wait_running(cluster, pod).await {
                    Ok(running) => match check(cluster, &running, containers) {
                        Ok(()) => extra(cluster, &running).await,
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                };
                if outcome.is_err() {
                    break;
                }
            }
            outcome
        }
    };
    // Every removal tried, whatever failed before; the example's own failure first.
    let mut removed: anyhow::Result<()> = Ok(());
    if let Some(api) = owner.as_ref()
        && let Err(e) = api.delete(&name, &Default::default()).await
    {
        removed = Err(e.into());
    }
    for pod in &pods {
        if let Err(e) = cluster.delete_pod(pod).await {
            removed = removed.and(Err(e));
        }
    }
    outcome.and(removed)
}

/// What some examples' guides promise beyond [`check`], by pod name.
async fn extra(cluster: &Cluster, pod: &Pod) -> anyhow::Result<()> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    match name {
        // KubeShare's README SharePod: half a GPU's compute booked (the ceiling is
        // the limiter's, checked by `check`).
        "sharepod1" => {
            let limits = pod
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.resources.as_ref())
                .and_then(|r| r.limits.as_ref());
            let core = limits.and_then(|l| l.get("koordinator.sh/gpu-core"));
            ensure!(
                core.is_some_and(|q| q.0 == "50"),
                "pod {name}: koordinator.sh/gpu-core {core:?}, want 50 (gpu_request 0.5 booked)"
            );
        }
        // Koordinator's PCIe scope: both GPUs under one switch, as the Device CR says.
        "gpus-on-one-switch" => {
            let granted = allocated_gpus(pod)?;
            let gpus = device_gpus(cluster).await?;
            let switch_of = |uuid: &str| {
                gpus.iter()
                    .find(|gpu| gpu["id"] == uuid)
                    .and_then(|gpu| gpu["topology"]["pcieID"].as_str())
                    .map(str::to_owned)
            };
            let switches: std::collections::BTreeSet<Option<String>> =
                granted.iter().map(|(uuid, _)| switch_of(uuid)).collect();
            ensure!(
                switches.len() == 1 && switches.iter().all(Option::is_some),
                "pod {name}: GPUs {granted:?} under switches {switches:?}, want one"
            );
        }
        _ => {}
    }
    Ok(())
}

/// The API of a kind that makes pods (`None` for a Pod itself).
fn owner_api(client: kube::Client, kind: &str) -> Option<Api<DynamicObject>> {
    let (group, version, plural) = match kind {
        "StatefulSet" => ("apps", "v1", "statefulsets"),
        "SharePod" => ("kubeshare.nthu", "v1", "sharepods"),
        _ => return None,
    };
    let resource = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    };
    Some(Api::namespaced_with(client, "default", &resource))
}

/// Waits for pod `default/name`'s FailedScheduling event naming `reason`.
async fn waits_for(cluster: &Cluster, name: &str, reason: &str) -> anyhow::Result<()> {
    let events = cluster
        .wait_events_in("default", name, &[reason], Duration::from_secs(60))
        .await?;
    ensure!(
        events
            .iter()
            .any(|e| e.starts_with("FailedScheduling") && e.contains(reason)),
        "pod {name}: {reason:?} is in no FailedScheduling event: {events:?}"
    );
    Ok(())
}

/// Waits for pod `default/name` to run, also while a controller has yet to make it.
async fn wait_running(cluster: &Cluster, name: &str) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(cluster.client().await?, "default");
    let started = Instant::now();
    loop {
        let pod = pods.get_opt(name).await?;
        if let Some(pod) = &pod
            && is_running(pod)
        {
            return Ok(pod.clone());
        }
        if started.elapsed() > Duration::from_secs(90) {
            let status = pod.map(|p| serde_json::to_string(&p.status).unwrap_or_default());
            let events = cluster.events_of(name).await.unwrap_or_default();
            bail!("pod {name} not running after 90 s: status {status:?}; events {events:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Each container's OCI spec against what it must get: the GPUs the toolkit will
/// expose (the last `NVIDIA_VISIBLE_DEVICES`, overruling the image's `all`) and
/// their device nodes, the limiter env, and another system's env only where wanted.
fn check(cluster: &Cluster, pod: &Pod, containers: &[Container]) -> anyhow::Result<()> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let granted: BTreeMap<String, u64> = if containers.iter().any(|c| c.gpus > 0) {
        allocated_gpus(pod)?.into_iter().collect()
    } else {
        BTreeMap::new()
    };
    let specs = cluster.container_specs(pod)?;
    let mut given = BTreeMap::new();
    for want in containers {
        let spec = specs
            .get(want.name)
            .with_context(|| format!("pod {name}: no container {}", want.name))?;
        let at = format!("pod {name} container {}", want.name);
        let visible = runtime_env(spec, "NVIDIA_VISIBLE_DEVICES").unwrap_or_default();
        let mine: BTreeMap<String, u64> = if want.gpus == 0 {
            ensure!(
                visible == "void",
                "{at}: NVIDIA_VISIBLE_DEVICES {visible:?}, want void"
            );
            BTreeMap::new()
        } else {
            visible
                .split(',')
                .map(|uuid| {
                    granted
                        .get_key_value(uuid)
                        .map(|(k, v)| (k.clone(), *v))
                        .with_context(|| {
                            format!("{at}: sees {uuid:?}, not one of the pod's GPUs {granted:?}")
                        })
                })
                .collect::<anyhow::Result<_>>()?
        };
        ensure!(
            mine.len() == want.gpus,
            "{at}: NVIDIA_VISIBLE_DEVICES {visible:?}, want {} distinct GPUs",
            want.gpus
        );
        let minors = gpu_device_minors(spec);
        ensure!(
            minors == mine.values().copied().collect(),
            "{at}: GPU device nodes {minors:?}, want those of {mine:?}"
        );
        let sm = runtime_env(spec, "CUDA_DEVICE_SM_LIMIT");
        ensure!(
            sm.as_deref() == want.sm,
            "{at}: CUDA_DEVICE_SM_LIMIT {sm:?}, want {:?}",
            want.sm
        );
        for i in 0..want.gpus.max(1) {
            let key = format!("CUDA_DEVICE_MEMORY_LIMIT_{i}");
            let memory = runtime_env(spec, &key);
            let expected = if want.gpus == 0 { None } else { want.memory };
            ensure!(
                memory.as_deref() == expected,
                "{at}: {key} {memory:?}, want {expected:?}"
            );
        }
        let index = mine.values().next().map(u64::to_string).unwrap_or_default();
        for key in SYSTEM_ENV {
            let expected = want
                .env
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.replace("{index}", &index));
            let value = runtime_env(spec, key);
            ensure!(
                value == expected,
                "{at}: {key} {value:?}, want {expected:?}"
            );
        }
        given.extend(mine);
    }
    // Tessera's grant alone: kubelet handed out no device-plugin GPU besides.
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let checkpoint = std::fs::read_to_string(KUBELET_CHECKPOINT).unwrap_or_default();
    ensure!(
        uid.is_empty() || !checkpoint.contains(uid),
        "pod {name}: kubelet's checkpoint gives it a device-plugin device: {checkpoint}"
    );
    ensure!(
        given == granted,
        "pod {name}: its containers see {given:?}, but it was granted {granted:?}"
    );
    ensure!(
        specs.len() == containers.len(),
        "pod {name}: containers {:?}, want only {:?}",
        specs.keys().collect::<Vec<_>>(),
        containers.iter().map(|c| c.name).collect::<Vec<_>>()
    );
    Ok(())
}

/// The README's first pod ("Your own pod on the demo cluster"), applied verbatim
/// as a tenant: it runs with one GPU, the container sees exactly that GPU, and
/// `tessera inspect --pod` (the way the README tells users to look) shows its
/// share on that GPU.
pub async fn readme_first_pod_runs_and_inspect_shows_its_grant(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let yaml = tessera_harness::cluster_demo::readme_first_pod()?;
    let pod: Value = serde_yaml::from_str(&yaml)?;
    let name = pod["metadata"]["name"]
        .as_str()
        .context("the README's pod has no name")?
        .to_owned();
    let namespace = pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_owned();
    cluster.create_pod_in("tenant", &namespace, &pod).await?;
    let outcome = async {
        let running = cluster.wait_running(&name).await?;
        let gpus = tessera_harness::cluster::allocated_gpus(&running)?;
        ensure!(
            gpus.len() == 1,
            "the README's pod was granted {gpus:?}, want one GPU"
        );
        let specs = cluster.container_specs(&running)?;
        for (container, spec) in &specs {
            ensure!(
                tessera_harness::cluster::env_values(spec, "NVIDIA_VISIBLE_DEVICES").last()
                    == Some(&gpus[0].0),
                "the README's pod: container {container} sees {:?}, was granted {}",
                tessera_harness::cluster::env_values(spec, "NVIDIA_VISIBLE_DEVICES"),
                gpus[0].0
            );
        }
        let inspect =
            std::process::Command::new(tessera_harness::cluster::tessera_binary("tessera")?)
                .arg("--kubeconfig")
                .arg(cluster.kubeconfig())
                .args(["inspect", "--pod", &format!("{namespace}/{name}")])
                .output()?;
        let text = String::from_utf8_lossy(&inspect.stdout);
        ensure!(
            inspect.status.success()
                && text.contains(&gpus[0].0)
                && text.contains(&format!("{namespace}/{name} (25%")),
            "tessera inspect --pod {namespace}/{name} does not show its 25% on {}: {text}{}",
            gpus[0].0,
            String::from_utf8_lossy(&inspect.stderr)
        );
        // `kubectl logs` and `kubectl exec` as the tenant: through the API server
        // to kubelet, which the demo cluster reaches at the node's address. The
        // probe prints the device nodes and GPU env it sees.
        let pods = Api::<Pod>::namespaced(cluster.client_as("tenant").await?, &namespace);
        let minor = gpus[0].1;
        let shows_grant = |text: &str| {
            text.contains(&format!("/dev/nvidia{minor}=195:{minor}"))
                && text.contains(&format!("NVIDIA_VISIBLE_DEVICES={}", gpus[0].0))
        };
        // Running is not yet printed: the probe writes its lines just after.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let logs = pods
                .logs(&name, &Default::default())
                .await
                .context("the README's pod: kubectl logs (pods/log) as the tenant")?;
            if shows_grant(&logs) {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "the README's pod: kubectl logs shows {logs:?}, want /dev/nvidia{minor} and {}",
                gpus[0].0
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let mut process = pods
            .exec(
                &name,
                ["/probe", "once"],
                &kube::api::AttachParams::default()
                    .stdout(true)
                    .stderr(false),
            )
            .await
            .context("the README's pod: kubectl exec (pods/exec) as the tenant")?;
        let mut printed = String::new();
        if let Some(mut stdout) = process.stdout() {
            tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut printed).await?;
        }
        process.join().await?;
        ensure!(
            shows_grant(&printed),
            "the README's pod: kubectl exec mine -- /probe once printed {printed:?}"
        );
        Ok(())
    }
    .await;
    cluster.delete_pod_in(&namespace, &name).await?;
    outcome
}

/// `scripts/run.sh --cluster --exit`, as a user runs it, on its own cluster (the
/// demo's: no MPS): beside a pod holding a GPU through NVIDIA's device plugin,
/// every sample pod runs, each container with exactly the GPU device nodes of its
/// grant, and the one that fits nowhere waits with kube-scheduler's reason. The
/// demo had no test once, and five of its pods failed to start unseen (the hook
/// counted the plugin's grants to pods Tessera had placed, which the plugin also
/// serves there).
pub async fn cluster_demo_tells_its_story() -> anyhow::Result<()> {
    let mut out = Vec::new();
    let rows = tessera_harness::cluster_demo::run(&mut out, false).await;
    let printed = String::from_utf8_lossy(&out).into_owned();
    let rows = rows.with_context(|| format!("the demo failed:\n{printed}"))?;
    ensure!(
        rows.len() == 8,
        "the demo's table has {} rows:\n{printed}",
        rows.len()
    );
    for row in &rows {
        match (&row.got, row.pod.as_str()) {
            (Err(reason), "another-whole-gpu") => ensure!(
                reason.starts_with("FailedScheduling"),
                "another-whole-gpu waits without kube-scheduler's reason: {reason}"
            ),
            (Ok(_), "another-whole-gpu") => {
                bail!("another-whole-gpu ran, with every GPU taken:\n{printed}")
            }
            (Err(reason), pod) => bail!("{pod} did not run: {reason}\n{printed}"),
            (Ok(got), "legacy-training") => ensure!(
                got.gpus.contains("device plugin"),
                "legacy-training: {got:?}"
            ),
            (Ok(got), pod) => {
                let want: Vec<String> = got.gpus.split(',').map(|m| format!("nvidia{m}")).collect();
                ensure!(
                    got.devices == want.join(",") && got.visible.starts_with("GPU-"),
                    "{pod}: granted GPUs {}, its OCI spec has device nodes {} and NVIDIA_VISIBLE_DEVICES {}",
                    got.gpus,
                    got.devices,
                    got.visible
                );
            }
        }
    }
    ensure!(
        printed.contains("$ tessera inspect") && printed.contains("==> tearing the cluster down"),
        "the demo's story is incomplete:\n{printed}"
    );
    Ok(())
}
