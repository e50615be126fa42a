//! The node demo: a private containerd with tessera-runtime-proxy and its embedded
//! GPU hook in front; a fake 4-GPU node (fake NVML, fake /dev/nvidia*) published by
//! tessera-reporter to the API server double; a legacy pod holding a GPU through
//! kubelet's checkpoint; tessera-scheduler placing sample pods through its extender
//! API; the kubelet-like driver creating them through the proxy; and `tessera
//! inspect` plus what each container really got, read back from containerd.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use k8s_cri::v1 as cri;
use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hooks::gpu::{Enforcement, GpuHookConfig, HamiCoreFiles};
use tessera_hooks::probe::HostProbe;
use tessera_hooks::server::GpuHook;
use tessera_reporter::gpu::NvmlSource;
use tessera_reporter::publish::Publisher;
use tessera_reporter::report::CapacityOptions;
use tessera_runtime_proxy::EmbeddedGpuHook;
use tessera_scheduler::extender::{Extender, ExtenderConfig};
use tessera_scheduler::protocol::{ExtenderArgs, ExtenderBindingArgs};

use crate::apiserver::ApiServer;
use crate::cluster_demo::{Got, Row, asked, gpu_nodes, limiter, limiter_env, table};
use crate::containerd::Containerd;
use crate::gpu_node::FakeGpuNode;
use crate::image::PROBE_IMAGE;
use crate::kubelet::{KubeletDriver, PodSpec, RunningPod, spec_env};
use crate::proxy::RunningProxy;

const NODE: &str = "demo-node";
const DEVICES: &str = "scheduling.koordinator.sh/v1alpha1";

/// What one sample pod got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodResult {
    /// Pod name.
    pub name: String,
    /// Its container's limits (`name=value …`).
    pub asked: String,
    /// The GPU UUIDs the scheduler chose, or why it fits nowhere.
    pub placement: Result<Vec<String>, String>,
    /// `NVIDIA_VISIBLE_DEVICES` in the container's effective OCI spec.
    pub visible_devices: Option<String>,
    /// GPU device nodes in the OCI spec (`/dev/nvidiaN`).
    pub gpu_devices: Vec<String>,
    /// Limiter env in the OCI spec.
    pub limits: BTreeMap<String, String>,
    /// `TESSERA_ENFORCEMENT` in the OCI spec: which backends hold its share.
    pub enforcement: Option<String>,
    /// Device nodes the probe saw from inside the running container.
    pub seen_inside: Vec<String>,
}

/// What the demo did.
#[derive(Debug, Clone, Default)]
pub struct DemoSummary {
    /// Per pod, in order.
    pub pods: Vec<PodResult>,
    /// The `tessera inspect` table.
    pub table: String,
    /// The GPUs' UUIDs by minor.
    pub uuids: Vec<String>,
}

async fn wait<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    for _ in 0..400 {
        if let Some(value) = probe() {
            return Ok(value);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    anyhow::bail!("timed out waiting for {what}")
}

/// Runs the demo, printing as it goes to `out`. Needs root (containerd, mknod).
pub async fn run(out: &mut (dyn Write + Send)) -> anyhow::Result<DemoSummary> {
    macro_rules! say { ($($arg:tt)*) => { let _ = writeln!(out, $($arg)*); let _ = out.flush(); } }
    say!("==> starting a private containerd (Debian's containerd + runc)");
    let containerd = Containerd::start().await?;
    let dir = tempfile::Builder::new()
        .prefix("tdemo-")
        .tempdir_in("/tmp")?;
    say!("==> faking a 4-GPU node: /dev/nvidia0-3 (mknod c 195 N), driver info, libnvidia-ml.so");
    let gpus = FakeGpuNode::create(dir.path(), 4)?;
    let nvml = crate::fake_nvml::install(
        &dir.path().join("driver"),
        &crate::fake_nvml::describe(&gpus),
    )?;
    let uuids: Vec<String> = gpus.gpus.iter().map(|g| g.uuid.clone()).collect();

    say!(
        "==> API server double; node {NODE}; a legacy pod holding GPU 3 through the NVIDIA device plugin"
    );
    let api = ApiServer::start().await?;
    api.insert("v1", "nodes", json!({"apiVersion":"v1","kind":"Node","metadata":{"name":NODE,"labels":{"kubernetes.io/hostname":NODE}},"status":{"capacity":{"cpu":"2"}}}));
    let legacy_uid = "1e9ac1e5-0000-4000-8000-00000000003a";
    api.insert("v1", "pods", json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":"legacy-training","namespace":"default","uid":legacy_uid},
        "spec":{"nodeName":NODE,"containers":[{"name":"main","image":"x","resources":{"limits":{"nvidia.com/gpu":"1"}}}]},"status":{"phase":"Running"}}));
    // The reporter (legacy pods' GPUs) and the GPU hook (which env grants are real)
    // read this one file, as they do kubelet's on a node.
    let checkpoint = gpus.kubelet_checkpoint.clone();
    std::fs::write(
        &checkpoint,
        json!({"Data":{"PodDeviceEntries":[{"PodUID":legacy_uid,"ContainerName":"main","ResourceName":"nvidia.com/gpu","DeviceIDs":{"1":[uuids[3]]},"AllocResp":""}],
            "RegisteredDevices":{"nvidia.com/gpu":uuids}},"Checksum":0})
        .to_string(),
    )?;

    say!("==> tessera-reporter: NVML discovery → Device CR and node capacity");
    let source = NvmlSource::open(&nvml)?;
    let (_xid_tx, xid_rx) = tokio::sync::mpsc::unbounded_channel();
    // Shares held by HAMi-core (a stand-in libvgpu.so: no CUDA here), as the proxy
    // lists it for the reporter. Containerd 1.6 has no CDI, so no driver limits.
    let enforcement_dir = dir.path().join("enforce");
    let hami = HamiCoreFiles::under(
        &enforcement_dir.join("hami-core"),
        &crate::image::vgpu_stand_in(&dir.path().join("hami"))?,
        &tessera_harness::cluster::tessera_binary("tessera-enforce")?,
    );
    hami.install()?;
    std::fs::write(enforcement_dir.join("backends"), "hami-core\n")?;
    let reporter = tokio::spawn(tessera_reporter::run::run(
        Arc::new(source),
        Publisher::new(api.client()?, NODE),
        tessera_reporter::run::LoopConfig {
            checkpoint,
            legacy_resources: vec!["nvidia.com/gpu".into()],
            interval: Duration::from_secs(60),
            checkpoint_poll: Duration::from_millis(200),
            capacity: CapacityOptions::default(),
            recovery_after: Duration::from_secs(300),
            enforcement_file: enforcement_dir.join("backends"),
            dra: false,
            dra_health: None,
        },
        xid_rx,
        std::future::pending::<()>(),
    ));
    wait("the Device CR", || {
        api.get(DEVICES, "devices", "", NODE).filter(|d| {
            d["metadata"]["annotations"]["node.koordinator.sh/devices-checkpoints"] != "[]"
        })
    })
    .await?;

    say!("==> tessera-scheduler: reflectors over Devices and Pods, extender API");
    let client = api.client()?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let view = tessera_scheduler::cluster::watch(client.clone(), Arc::clone(&ledger));
    let ready = Arc::clone(&view.ready);
    let extender = Extender::new(
        ledger,
        Some(client.clone()),
        Some(view.pods),
        ExtenderConfig::default(),
        view.ready,
        Arc::new(tessera_scheduler::leader::Leader::new(true)),
    );
    wait("the scheduler's caches", || {
        ready
            .load(std::sync::atomic::Ordering::SeqCst)
            .then_some(())
    })
    .await?;

    say!("==> tessera-runtime-proxy with the embedded GPU hook, in front of containerd");
    let hook = GpuHook::new(
        GpuHookConfig {
            device_root: gpus.device_root.clone(),
            enforcement: Enforcement {
                driver_memory: false,
                mps: None,
                gpu_time: false,
                oom_kill: false,
                hami_core: Some(hami),
            },
            ..GpuHookConfig::default()
        },
        Arc::new(HostProbe::with_nvml(crate::probe_paths(&gpus), &nvml)),
    );
    // The demo's kubelet is this process: the proxy counts its connection as
    // kubelet's, which the reporter takes as the node's proven switch.
    let proxy = RunningProxy::start_counting_kubelet(
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![Arc::new(EmbeddedGpuHook::new(hook))],
        &enforcement_dir,
    )
    .await?;
    let mut kubelet = KubeletDriver::connect(&proxy.socket).await?;
    let mut running: Vec<RunningPod> = Vec::new();

    // The legacy pod, as kubelet starts it with the device plugin's grant.
    let mut legacy = PodSpec::new("default", "legacy-training");
    legacy.uid = legacy_uid.into();
    legacy.log_directory = Some(dir.path().join("logs/legacy-training"));
    let mut legacy_container = legacy.container_config(
        "main",
        PROBE_IMAGE,
        &[("NVIDIA_VISIBLE_DEVICES", &uuids[3])],
    );
    legacy_container.devices.push(cri::Device {
        container_path: "/dev/nvidia3".into(),
        host_path: gpus
            .device_root
            .join("nvidia3")
            .to_string_lossy()
            .into_owned(),
        permissions: "rw".into(),
    });
    running.push(
        kubelet
            .start_pod(&legacy, &[legacy_container])
            .await
            .context("starting the legacy pod")?,
    );

    say!("==> scheduling and starting the sample pods\n");
    let mut summary = DemoSummary {
        uuids: uuids.clone(),
        ..DemoSummary::default()
    };
    for (name, limits) in tessera_harness::cluster_demo::sample_pods() {
        let pod = api.insert("v1", "pods", json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":name,"namespace":"default"},
            "spec":{"containers":[{"name":"main","image":PROBE_IMAGE,"resources":{"limits":limits}}]},"status":{"phase":"Pending"}}));
        let args: ExtenderArgs = serde_json::from_value(json!({"Pod": pod, "NodeNames": [NODE]}))?;
        let filtered = extender.filter(args.clone());
        let fits = filtered.node_names.as_ref().is_some_and(|n| !n.is_empty());
        let placement = if fits {
            let _ = extender.prioritize(args);
            let uid = pod["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let bound = extender
                .bind(
                    &ExtenderBindingArgs {
                        pod_name: name.into(),
                        pod_namespace: "default".into(),
                        pod_uid: uid,
                        node: NODE.into(),
                    },
                    false,
                )
                .await;
            anyhow::ensure!(bound.error.is_empty(), "binding {name}: {}", bound.error);
            let pod = api
                .get("v1", "pods", "default", name)
                .context("bound pod")?;
            let annotation = pod["metadata"]["annotations"][DEVICE_ALLOCATED]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let parsed: Value = serde_json::from_str(&annotation)?;
            let chosen: Vec<String> = parsed["gpu"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g["id"].as_str().map(str::to_owned))
                .collect();
            Ok((chosen, annotation))
        } else {
            Err(filtered
                .failed_nodes
                .get(NODE)
                .cloned()
                .unwrap_or(filtered.error))
        };
        let mut result = PodResult {
            name: name.into(),
            asked: asked(&limits),
            placement: placement
                .as_ref()
                .map(|(c, _)| c.clone())
                .map_err(Clone::clone),
            visible_devices: None,
            gpu_devices: Vec::new(),
            limits: BTreeMap::new(),
            enforcement: None,
            seen_inside: Vec::new(),
        };
        if let Ok((_, annotation)) = placement {
            let api_pod = api.get("v1", "pods", "default", name).context("pod")?;
            let mut spec = PodSpec::new("default", name);
            spec.uid = api_pod["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .into();
            spec.annotations.insert(DEVICE_ALLOCATED.into(), annotation);
            spec.log_directory = Some(dir.path().join("logs").join(name));
            // The image's own default, which the hook must override.
            let container =
                spec.container_config("main", PROBE_IMAGE, &[("NVIDIA_VISIBLE_DEVICES", "all")]);
            let started = kubelet
                .start_pod(&spec, &[container])
                .await
                .with_context(|| format!("starting {name}"))?;
            let oci = kubelet.container_spec(&started.containers[0]).await?;
            result.visible_devices = spec_env(&oci, "NVIDIA_VISIBLE_DEVICES");
            result.enforcement = spec_env(&oci, "TESSERA_ENFORCEMENT");
            result.gpu_devices = oci["linux"]["devices"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|d| {
                    d["path"]
                        .as_str()
                        .map(|p| format!("{p}={}:{}", d["major"], d["minor"]))
                })
                .filter(|p| p.starts_with("/dev/nvidia"))
                .collect();
            result.limits.extend(limiter_env(&oci));
            let log_pod = spec.clone();
            result.seen_inside = wait("the probe's output", || {
                let log = log_pod.container_log("main");
                log.lines().find_map(|l| {
                    l.split_once("devices:").map(|(_, rest)| {
                        rest.split_whitespace()
                            .map(str::to_owned)
                            .collect::<Vec<_>>()
                    })
                })
            })
            .await?;
            running.push(started);
        }
        summary.pods.push(result);
    }

    // The reporter keeps the Device CR current; give the scheduler's watch a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    summary.table = tessera_cli::inspect(client, None, None, false).await?;
    say!("$ tessera inspect\n{}", summary.table);
    let rows: Vec<Row> = summary
        .pods
        .iter()
        .map(|pod| Row {
            pod: pod.name.clone(),
            asked: pod.asked.clone(),
            got: pod
                .placement
                .as_ref()
                .map_err(Clone::clone)
                .map(|chosen| Got {
                    gpus: chosen
                        .iter()
                        .filter_map(|id| uuids.iter().position(|u| u == id))
                        .map(|m| m.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    visible: pod.visible_devices.clone().unwrap_or_else(|| "-".into()),
                    limits: limiter(
                        &pod.limits
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect::<Vec<_>>(),
                    ),
                    held_by: pod.enforcement.clone().unwrap_or_else(|| "-".into()),
                    devices: gpu_nodes(
                        pod.seen_inside
                            .iter()
                            .filter_map(|d| d.split_once('=').map(|(path, _)| path)),
                    ),
                }),
        })
        .collect();
    say!(
        "What each container got, read from the OCI spec containerd wrote (GPU device nodes: as the probe inside lists them):\n{}",
        table(&rows)
    );
    say!("\n==> cleaning up");
    for pod in &running {
        let _ = kubelet.stop_and_remove_pod(pod).await;
    }
    reporter.abort();
    drop(proxy);
    drop(containerd);
    Ok(summary)
}
