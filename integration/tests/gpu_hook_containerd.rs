//! The embedded GPU hook through the proxy, against a real containerd with fake
//! GPU device nodes: the OCI spec read back and what a started container sees.

use std::sync::Arc;

use k8s_cri::v1 as cri;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hooks::gpu::GpuHookConfig;
use tessera_hooks::probe::HostProbe;
use tessera_hooks::server::GpuHook;
use tessera_integration::containerd::Containerd;
use tessera_integration::gpu_node::{FakeGpuNode, NVIDIA_MAJOR};
use tessera_integration::image::PROBE_IMAGE;
use tessera_integration::kubelet::{KubeletDriver, PodSpec, spec_env};
use tessera_integration::proxy::{RelayMode, RunningProxy};
use tessera_runtime_proxy::EmbeddedGpuHook;

struct Node {
    containerd: Containerd,
    gpus: FakeGpuNode,
    proxy: RunningProxy,
    dir: tempfile::TempDir,
}

async fn node(mode: RelayMode) -> Node {
    tessera_integration::init_tracing();
    let containerd = Containerd::start().await.expect("containerd");
    let dir = tempfile::Builder::new()
        .prefix("tgpu-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let gpus = FakeGpuNode::create(dir.path(), 4).expect("fake GPU node");
    let config = GpuHookConfig {
        device_root: gpus.device_root.clone(),
        ..GpuHookConfig::default()
    };
    let hook = GpuHook::new(
        config,
        Arc::new(HostProbe::new(tessera_integration::probe_paths(&gpus))),
    );
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![Arc::new(EmbeddedGpuHook::new(hook))],
    )
    .await
    .expect("proxy");
    Node {
        containerd,
        gpus,
        proxy,
        dir,
    }
}

/// The device node the NVIDIA device plugin hands a container for GPU `minor`.
fn plugin_device(node: &Node, minor: u32) -> cri::Device {
    cri::Device {
        container_path: format!("/dev/nvidia{minor}"),
        host_path: node
            .gpus
            .device_root
            .join(format!("nvidia{minor}"))
            .to_string_lossy()
            .into_owned(),
        permissions: "rw".into(),
    }
}

fn share(uuid: &str, minor: u32, core: u32, memory: &str) -> String {
    format!(
        r#"{{"minor":{minor},"id":"{uuid}","resources":{{"koordinator.sh/gpu-core":{core},"koordinator.sh/gpu-memory-ratio":{core},"koordinator.sh/gpu-memory":"{memory}"}}}}"#
    )
}

/// `(path, major, minor)` of the spec's GPU device nodes.
fn gpu_devices(spec: &serde_json::Value) -> Vec<(String, u64, u64)> {
    let mut devices: Vec<(String, u64, u64)> = spec["linux"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| {
            Some((
                d["path"].as_str()?.to_owned(),
                d["major"].as_u64()?,
                d["minor"].as_u64()?,
            ))
        })
        .filter(|(path, _, _)| {
            path.starts_with("/dev/nvidia") || path.starts_with("/dev/infiniband")
        })
        .collect();
    devices.sort();
    devices
}

/// The device nodes the probe printed from inside the container.
async fn seen_inside(pod: &PodSpec, container: &str) -> Vec<String> {
    for _ in 0..100 {
        let log = pod.container_log(container);
        if let Some(line) = log
            .lines()
            .find_map(|l| l.split_once("devices:").map(|(_, rest)| rest.to_owned()))
        {
            let mut seen: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            seen.sort();
            return seen;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let listing: Vec<String> = std::fs::read_dir(pod.log_directory())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().display().to_string())
        .collect();
    panic!(
        "probe printed nothing for {container}; {} holds {listing:?}",
        pod.log_directory().display()
    );
}

async fn run(
    node: &Node,
    name: &str,
    annotation: Option<String>,
    envs: &[(&str, &str)],
    extra: Vec<cri::Device>,
) -> (PodSpec, serde_json::Value, String) {
    let mut pod = PodSpec::new("gpu", name);
    pod.log_directory = Some(node.dir.path().join("logs").join(name));
    if let Some(annotation) = annotation {
        pod.annotations.insert(DEVICE_ALLOCATED.into(), annotation);
    }
    let mut container = pod.container_config("main", PROBE_IMAGE, envs);
    container.devices = extra;
    let mut kubelet = KubeletDriver::connect(&node.proxy.socket)
        .await
        .expect("kubelet");
    let running = kubelet
        .start_pod(&pod, &[container])
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}\n{}", node.containerd.log_tail()));
    let spec = kubelet
        .container_spec(&running.containers[0])
        .await
        .expect("spec");
    (pod, spec, running.containers[0].clone())
}

async fn gpu_pods_get_exactly_their_gpus(mode: RelayMode) {
    let node = node(mode).await;
    let uuid = |minor: usize| node.gpus.gpus[minor].uuid.clone();
    let ctl = ("/dev/nvidiactl".to_owned(), NVIDIA_MAJOR, 255);
    let uvm = ("/dev/nvidia-uvm".to_owned(), 235, 0);

    // Whole GPU 1; the device plugin had put GPU 3 there, and the image says "all".
    let plugin_device = plugin_device(&node, 3);
    let (pod, spec, _) = run(
        &node,
        "whole",
        Some(format!(
            r#"{{"gpu":[{}]}}"#,
            share(&uuid(1), 1, 100, "16Gi")
        )),
        &[("NVIDIA_VISIBLE_DEVICES", "all")],
        vec![plugin_device],
    )
    .await;
    assert_eq!(spec_env(&spec, "NVIDIA_VISIBLE_DEVICES"), Some(uuid(1)));
    assert_eq!(spec_env(&spec, "CUDA_DEVICE_SM_LIMIT"), None);
    assert_eq!(
        gpu_devices(&spec),
        vec![
            uvm.clone(),
            ("/dev/nvidia1".to_owned(), NVIDIA_MAJOR, 1),
            ctl.clone()
        ]
    );
    assert_eq!(
        seen_inside(&pod, "main").await,
        [
            "/dev/nvidia-uvm=235:0",
            "/dev/nvidia1=195:1",
            "/dev/nvidiactl=195:255"
        ]
    );

    // Half of GPU 0.
    let (pod, spec, _) = run(
        &node,
        "half",
        Some(format!(r#"{{"gpu":[{}]}}"#, share(&uuid(0), 0, 50, "8Gi"))),
        &[],
        vec![],
    )
    .await;
    assert_eq!(spec_env(&spec, "NVIDIA_VISIBLE_DEVICES"), Some(uuid(0)));
    assert_eq!(
        spec_env(&spec, "CUDA_DEVICE_MEMORY_LIMIT_0").as_deref(),
        Some("8192m")
    );
    assert_eq!(
        spec_env(&spec, "CUDA_DEVICE_SM_LIMIT").as_deref(),
        Some("50")
    );
    assert_eq!(
        seen_inside(&pod, "main").await,
        [
            "/dev/nvidia-uvm=235:0",
            "/dev/nvidia0=195:0",
            "/dev/nvidiactl=195:255"
        ]
    );

    // GPUs 2 and 3, plus an RDMA function.
    let annotation = format!(
        r#"{{"gpu":[{},{}],"rdma":[{{"minor":0}}]}}"#,
        share(&uuid(2), 2, 100, "16Gi"),
        share(&uuid(3), 3, 100, "16Gi")
    );
    let (pod, spec, _) = run(&node, "multi", Some(annotation), &[], vec![]).await;
    assert_eq!(
        spec_env(&spec, "NVIDIA_VISIBLE_DEVICES"),
        Some(format!("{},{}", uuid(2), uuid(3)))
    );
    let devices = gpu_devices(&spec);
    assert!(
        devices.contains(&("/dev/nvidia2".to_owned(), NVIDIA_MAJOR, 2))
            && devices.contains(&("/dev/nvidia3".to_owned(), NVIDIA_MAJOR, 3))
    );
    assert!(devices.contains(&("/dev/infiniband/uverbs0".to_owned(), 231, 192)));
    assert!(devices.contains(&("/dev/infiniband/rdma_cm".to_owned(), 10, 58)));
    let seen = seen_inside(&pod, "main").await;
    assert!(
        seen.contains(&"/dev/nvidia2=195:2".to_owned())
            && seen.contains(&"/dev/nvidia3=195:3".to_owned()),
        "{seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|s| s.starts_with("/dev/nvidia0") || s.starts_with("/dev/nvidia1=")),
        "{seen:?}"
    );

    // No allocation: nothing visible, even with the image's "all".
    let (pod, spec, _) = run(
        &node,
        "cpu-only",
        None,
        &[("NVIDIA_VISIBLE_DEVICES", "all")],
        vec![],
    )
    .await;
    assert_eq!(
        spec_env(&spec, "NVIDIA_VISIBLE_DEVICES").as_deref(),
        Some("void")
    );
    assert!(gpu_devices(&spec).is_empty());
    assert!(seen_inside(&pod, "main").await.is_empty());
}

async fn bad_annotations_fail_create_container_and_start_nothing(mode: RelayMode) {
    let node = node(mode).await;
    let mut kubelet = KubeletDriver::connect(&node.proxy.socket)
        .await
        .expect("kubelet");
    let cases = [
        (
            r#"{"gpu":[{"minor":"x"}]}"#.to_owned(),
            "gpu[0].minor: expected a number, got \"x\"",
        ),
        (
            format!(r#"{{"gpu":[{}]}}"#, share("GPU-not-here", 0, 100, "1Gi")),
            "GPU GPU-not-here is not on this node",
        ),
        ("{".to_owned(), "not valid JSON"),
    ];
    for (index, (annotation, expected)) in cases.into_iter().enumerate() {
        let mut pod = PodSpec::new("gpu", &format!("bad-{index}"));
        pod.log_directory = Some(node.dir.path().join("logs").join(&pod.name));
        pod.annotations.insert(DEVICE_ALLOCATED.into(), annotation);
        let error = kubelet
            .start_pod(&pod, &[pod.container_config("main", PROBE_IMAGE, &[])])
            .await
            .expect_err("refused");
        let message = error.message();
        assert!(
            message.contains(&format!(
                "pod gpu/{}: annotation scheduling.koordinator.sh/device-allocated:",
                pod.name
            )),
            "{message}"
        );
        assert!(message.contains(expected), "{message}");
    }
    let direct = KubeletDriver::connect(&node.containerd.socket())
        .await
        .expect("direct");
    let containers = direct
        .runtime
        .clone()
        .list_containers(cri::ListContainersRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(
        containers.containers.is_empty(),
        "a container was created: {:?}",
        containers.containers
    );
}

/// Containerd 1.6/1.7 still serve CRI v1alpha2: a container created on it goes
/// through the same GPU rewrite, so that service is no way around the hook.
async fn a_container_created_over_cri_v1alpha2_gets_the_same_rewrite(mode: RelayMode) {
    use k8s_cri::v1alpha2;
    use prost::Message;

    let node = node(mode).await;
    let uuid = node.gpus.gpus[2].uuid.clone();
    let mut pod = PodSpec::new("gpu", "legacy-api");
    pod.log_directory = Some(node.dir.path().join("logs").join("legacy-api"));
    pod.annotations.insert(
        DEVICE_ALLOCATED.into(),
        format!(r#"{{"gpu":[{}]}}"#, share(&uuid, 2, 100, "16Gi")),
    );
    let mut kubelet = KubeletDriver::connect(&node.proxy.socket)
        .await
        .expect("kubelet");
    let sandbox = kubelet.start_pod(&pod, &[]).await.expect("sandbox");

    // The same messages, re-read as v1alpha2 types: the two versions share the wire format.
    let config = pod.container_config("main", PROBE_IMAGE, &[("NVIDIA_VISIBLE_DEVICES", "all")]);
    let request = v1alpha2::CreateContainerRequest {
        pod_sandbox_id: sandbox.sandbox_id.clone(),
        config: Some(
            v1alpha2::ContainerConfig::decode(&config.encode_to_vec()[..])
                .expect("v1alpha2 container config"),
        ),
        sandbox_config: Some(
            v1alpha2::PodSandboxConfig::decode(&pod.sandbox_config().encode_to_vec()[..])
                .expect("v1alpha2 sandbox config"),
        ),
    };
    let channel = tessera_integration::kubelet::unix_channel(&node.proxy.socket)
        .await
        .expect("channel");
    let id = v1alpha2::runtime_service_client::RuntimeServiceClient::new(channel)
        .create_container(request)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "v1alpha2 CreateContainer: {e}\n{}",
                node.containerd.log_tail()
            )
        })
        .into_inner()
        .container_id;
    let spec = kubelet.container_spec(&id).await.expect("spec");
    assert_eq!(spec_env(&spec, "NVIDIA_VISIBLE_DEVICES"), Some(uuid));
    assert_eq!(
        gpu_devices(&spec),
        vec![
            ("/dev/nvidia-uvm".to_owned(), 235, 0),
            ("/dev/nvidia2".to_owned(), NVIDIA_MAJOR, 2),
            ("/dev/nvidiactl".to_owned(), NVIDIA_MAJOR, 255),
        ]
    );
}

/// A pod with no allocation keeps NVIDIA_VISIBLE_DEVICES naming a GPU only when
/// kubelet's checkpoint records the device plugin giving it that GPU.
async fn only_device_plugin_grants_in_kubelets_checkpoint_survive(mode: RelayMode) {
    use tessera_integration::gpu_node::PluginGrant;

    let node = node(mode).await;
    let uuid = |minor: usize| node.gpus.gpus[minor].uuid.clone();
    let legacy_uid = "0c0ffee0-0000-4000-8000-000000000001";
    node.gpus
        .write_checkpoint(&[PluginGrant {
            pod_uid: legacy_uid.into(),
            container: "main".into(),
            device_ids: vec![uuid(3)],
        }])
        .expect("checkpoint");

    // What the NVIDIA device plugin gives: the env and the GPU's node.
    let mut legacy = PodSpec::new("gpu", "legacy");
    legacy.uid = legacy_uid.into();
    legacy.log_directory = Some(node.dir.path().join("logs").join("legacy"));
    let mut container =
        legacy.container_config("main", PROBE_IMAGE, &[("NVIDIA_VISIBLE_DEVICES", &uuid(3))]);
    container.devices.push(plugin_device(&node, 3));
    let mut kubelet = KubeletDriver::connect(&node.proxy.socket)
        .await
        .expect("kubelet");
    let running = kubelet
        .start_pod(&legacy, &[container])
        .await
        .expect("legacy pod");
    let spec = kubelet
        .container_spec(&running.containers[0])
        .await
        .expect("spec");
    assert_eq!(spec_env(&spec, "NVIDIA_VISIBLE_DEVICES"), Some(uuid(3)));

    // The same env written into a pod by hand, for another GPU: no grant, no GPU.
    let (_, spec, _) = run(
        &node,
        "self-served",
        None,
        &[("NVIDIA_VISIBLE_DEVICES", &uuid(2))],
        vec![],
    )
    .await;
    assert_eq!(
        spec_env(&spec, "NVIDIA_VISIBLE_DEVICES").as_deref(),
        Some("void")
    );

    // A checkpoint that cannot be read: a container naming GPUs is not started.
    std::fs::write(&node.gpus.kubelet_checkpoint, b"{truncated").expect("corrupt it");
    let mut pod = PodSpec::new("gpu", "unverifiable");
    pod.log_directory = Some(node.dir.path().join("logs").join("unverifiable"));
    let container =
        pod.container_config("main", PROBE_IMAGE, &[("NVIDIA_VISIBLE_DEVICES", &uuid(3))]);
    let error = kubelet
        .start_pod(&pod, &[container])
        .await
        .expect_err("refused");
    assert_eq!(error.code(), tonic::Code::FailedPrecondition, "{error}");
    assert!(
        error.message().contains("kubelet_internal_checkpoint"),
        "{}",
        error.message()
    );
}

tessera_integration::each_relay_mode! {
    gpu_pods_get_exactly_their_gpus(flavor = "multi_thread", worker_threads = 2);
    bad_annotations_fail_create_container_and_start_nothing(flavor = "multi_thread", worker_threads = 2);
    a_container_created_over_cri_v1alpha2_gets_the_same_rewrite(flavor = "multi_thread", worker_threads = 2);
    only_device_plugin_grants_in_kubelets_checkpoint_survive(flavor = "multi_thread", worker_threads = 2);
}
