//! The runtime proxy against a real containerd (Debian's containerd + runc).
//! Needs root; the README's test command installs containerd, runc and gcc.

use std::sync::Arc;

use k8s_cri::v1 as cri;
use tessera_integration::containerd::Containerd;
use tessera_integration::hooks::RecordingHook;
use tessera_integration::image::PAUSE_IMAGE;
use tessera_integration::kubelet::{KubeletDriver, PodSpec};
use tessera_integration::proxy::{RelayMode, RunningProxy};
use tessera_runtime_proxy::Hook;

fn env_of(spec: &serde_json::Value) -> Vec<String> {
    spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

/// The spec with this run's IDs, UIDs and namespace replaced, so two runs compare.
fn normalized(spec: &serde_json::Value, replacements: &[(&str, &str)]) -> serde_json::Value {
    let mut text = spec.to_string();
    for (from, to) in replacements {
        text = text.replace(from, to);
    }
    let mut spec: serde_json::Value = serde_json::from_str(&text).expect("still JSON");
    // Namespace paths name the sandbox's pause process, which differs per run.
    for namespace in spec["linux"]["namespaces"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if namespace.get("path").is_some() {
            namespace["path"] = "/proc/PAUSE/ns".into();
        }
    }
    spec
}

async fn harness() -> (Containerd, tempfile::TempDir) {
    tessera_integration::init_tracing();
    let containerd = Containerd::start()
        .await
        .expect("private containerd starts");
    let dir = tempfile::Builder::new()
        .prefix("tprx-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    (containerd, dir)
}

async fn pod_lifecycle_through_proxy_equals_direct(mode: RelayMode) {
    let (containerd, dir) = harness().await;
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![Arc::new(NoEnvHook)],
    )
    .await
    .expect("proxy");

    let mut direct = KubeletDriver::connect(&containerd.socket())
        .await
        .expect("direct");
    let mut proxied = KubeletDriver::connect(&proxy.socket)
        .await
        .expect("proxied");

    let mut runs = Vec::new();
    for (driver, namespace) in [(&mut direct, "direct"), (&mut proxied, "proxied")] {
        let pod = PodSpec::new(namespace, "lifecycle");
        let container = pod.container_config("main", PAUSE_IMAGE, &[("A", "1")]);
        let running = driver
            .start_pod(&pod, &[container])
            .await
            .unwrap_or_else(|e| panic!("{namespace}: {e}\n{}", containerd.log_tail()));
        assert_eq!(
            driver
                .container_state(&running.containers[0])
                .await
                .expect("status"),
            cri::ContainerState::ContainerRunning
        );
        let spec = driver
            .container_spec(&running.containers[0])
            .await
            .expect("spec");
        let spec = normalized(
            &spec,
            &[
                (&running.sandbox_id, "SANDBOX"),
                (&running.containers[0], "CONTAINER"),
                (&pod.uid, "UID"),
                (namespace, "NS"),
            ],
        );
        driver
            .stop_and_remove_pod(&running)
            .await
            .expect("teardown");
        runs.push(spec);
    }
    assert_eq!(
        runs[0], runs[1],
        "the OCI spec through the proxy differs from the direct one"
    );
    assert!(env_of(&runs[1]).contains(&"A=1".to_owned()));
    assert!(
        proxy.proxy.store().is_empty(),
        "store keeps removed pods: {:?}",
        proxy.proxy.store().len()
    );
}

/// A hook that changes nothing, but still goes through the decode/forward path.
#[derive(Debug)]
struct NoEnvHook;
impl Hook for NoEnvHook {
    fn name(&self) -> &str {
        "no-env"
    }
}

async fn hooks_see_every_lifecycle_call_and_rewrite_reaches_containerd(mode: RelayMode) {
    let (containerd, dir) = harness().await;
    let hook = RecordingHook::default();
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![Arc::new(hook.clone())],
    )
    .await
    .expect("proxy");
    let mut kubelet = KubeletDriver::connect(&proxy.socket)
        .await
        .expect("proxied");
    let pod = PodSpec::new("default", "hooked");
    let container =
        pod.container_config("main", PAUSE_IMAGE, &[("TESSERA_TEST_HOOK", "from-image")]);
    let running = kubelet
        .start_pod(&pod, &[container])
        .await
        .expect("pod starts");
    let spec = kubelet
        .container_spec(&running.containers[0])
        .await
        .expect("spec");
    let env = env_of(&spec);
    assert!(
        env.contains(&"TESSERA_TEST_HOOK=hooked".to_owned()),
        "hook's env missing: {env:?}"
    );
    assert!(
        !env.contains(&"TESSERA_TEST_HOOK=from-image".to_owned()),
        "original env kept: {env:?}"
    );

    kubelet
        .runtime
        .update_container_resources(cri::UpdateContainerResourcesRequest {
            container_id: running.containers[0].clone(),
            linux: Some(cri::LinuxContainerResources {
                cpu_shares: 4,
                cpu_period: 100_000,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("update");

    // A refused container never reaches containerd; kubelet gets the hook's error.
    let refused = kubelet
        .create(
            &running.sandbox_id,
            &pod.sandbox_config(),
            pod.container_config("refuse-me", PAUSE_IMAGE, &[]),
        )
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("tessera hook \"recording\""),
        "{}",
        refused.message()
    );
    kubelet
        .stop_and_remove_pod(&running)
        .await
        .expect("teardown");
    let direct = KubeletDriver::connect(&containerd.socket())
        .await
        .expect("direct")
        .runtime
        .list_containers(cri::ListContainersRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(
        direct.containers.is_empty(),
        "refused container was created: {:?}",
        direct.containers
    );

    let seen = hook.seen();
    for method in tessera_runtime_proxy::Method::ALL {
        for stage in ["pre", "post"] {
            let found = seen
                .iter()
                .find(|s| s.method == method.name() && s.stage == stage);
            let found =
                found.unwrap_or_else(|| panic!("{stage} {} not seen: {seen:#?}", method.name()));
            assert_eq!(
                found.pod.as_deref(),
                Some("default/hooked"),
                "{stage} {}",
                method.name()
            );
        }
    }
    let start = seen
        .iter()
        .find(|s| s.method == "StartContainer" && s.stage == "post")
        .expect("start");
    assert_eq!(start.container.as_deref(), Some("main"));
    assert_eq!(start.ok, Some(true));
}

async fn image_calls_pass_through(mode: RelayMode) {
    let (containerd, dir) = harness().await;
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![],
    )
    .await
    .expect("proxy");
    let mut direct = KubeletDriver::connect(&containerd.socket())
        .await
        .expect("direct");
    let mut proxied = KubeletDriver::connect(&proxy.socket)
        .await
        .expect("proxied");
    let a = direct
        .image
        .list_images(cri::ListImagesRequest::default())
        .await
        .expect("direct")
        .into_inner();
    let b = proxied
        .image
        .list_images(cri::ListImagesRequest::default())
        .await
        .expect("proxied")
        .into_inner();
    // containerd lists from a map: order varies between calls.
    let (mut a, mut b) = (a, b);
    a.images.sort_by(|x, y| x.id.cmp(&y.id));
    b.images.sort_by(|x, y| x.id.cmp(&y.id));
    assert_eq!(a, b);
    assert!(
        b.images
            .iter()
            .any(|i| i.repo_tags.contains(&PAUSE_IMAGE.to_owned())),
        "{b:?}"
    );
    let spec = Some(cri::ImageSpec {
        image: PAUSE_IMAGE.into(),
        ..Default::default()
    });
    let a = direct
        .image
        .image_status(cri::ImageStatusRequest {
            image: spec.clone(),
            verbose: true,
        })
        .await
        .expect("direct");
    let b = proxied
        .image
        .image_status(cri::ImageStatusRequest {
            image: spec,
            verbose: true,
        })
        .await
        .expect("proxied");
    assert_eq!(a.into_inner(), b.into_inner());
    let a = direct
        .image
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .expect("direct")
        .into_inner();
    let b = proxied
        .image
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .expect("proxied")
        .into_inner();
    assert_eq!(a.image_filesystems.len(), b.image_filesystems.len());
    // A pull from a registry this machine cannot reach: the same error either way.
    let missing = Some(cri::ImageSpec {
        image: "tessera.invalid/none:1".into(),
        ..Default::default()
    });
    let a = direct
        .image
        .pull_image(cri::PullImageRequest {
            image: missing.clone(),
            ..Default::default()
        })
        .await
        .expect_err("direct");
    let b = proxied
        .image
        .pull_image(cri::PullImageRequest {
            image: missing,
            ..Default::default()
        })
        .await
        .expect_err("proxied");
    assert_eq!(a.code(), b.code());
    assert_eq!(a.message(), b.message());
}

async fn containerd_restart_mid_test(mode: RelayMode) {
    let (mut containerd, dir) = harness().await;
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &containerd.socket(),
        vec![],
    )
    .await
    .expect("proxy");
    let mut kubelet = KubeletDriver::connect(&proxy.socket)
        .await
        .expect("proxied");
    let pod = PodSpec::new("default", "survivor");
    let running = kubelet
        .start_pod(&pod, &[pod.container_config("main", PAUSE_IMAGE, &[])])
        .await
        .expect("pod");

    containerd.stop().await.expect("containerd stops");
    let down = kubelet.version().await.expect_err("runtime is down");
    assert_eq!(down.code(), tonic::Code::Unavailable, "{down:?}");
    assert!(
        down.message().contains("containerd.sock"),
        "error should name the socket: {}",
        down.message()
    );
    let down = kubelet
        .runtime
        .start_container(cri::StartContainerRequest {
            container_id: "x".into(),
        })
        .await
        .expect_err("intercepted call while down");
    assert_eq!(down.code(), tonic::Code::Unavailable, "{down:?}");

    containerd.restart().await.expect("containerd back");
    kubelet
        .version()
        .await
        .expect("proxy reconnected by itself");
    assert_eq!(
        kubelet
            .container_state(&running.containers[0])
            .await
            .expect("status"),
        cri::ContainerState::ContainerRunning
    );
    kubelet
        .stop_and_remove_pod(&running)
        .await
        .expect("teardown");
    assert!(
        proxy.metrics.backend_connects.get() >= 2,
        "reconnect counted"
    );
}

async fn proxy_restart_mid_test_keeps_containers_and_hook_context(mode: RelayMode) {
    let (containerd, dir) = harness().await;
    let socket = dir.path().join("proxy.sock");
    let first = RunningProxy::start_mode(mode, &socket, &containerd.socket(), vec![])
        .await
        .expect("proxy");
    let mut kubelet = KubeletDriver::connect(&socket).await.expect("proxied");
    let pod = PodSpec::new("default", "before-restart");
    let config = pod.sandbox_config();
    let running = kubelet
        .start_pod(&pod, &[pod.container_config("main", PAUSE_IMAGE, &[])])
        .await
        .expect("pod");
    let second_id = kubelet
        .create(
            &running.sandbox_id,
            &config,
            pod.container_config("late", PAUSE_IMAGE, &[]),
        )
        .await
        .expect("create");
    first.shutdown().await;

    let hook = RecordingHook::default();
    let second = RunningProxy::start_mode(
        mode,
        &socket,
        &containerd.socket(),
        vec![Arc::new(hook.clone())],
    )
    .await
    .expect("proxy again");
    assert_eq!(
        second.proxy.store().len(),
        (1, 2),
        "store rebuilt from the runtime"
    );
    let mut kubelet = KubeletDriver::connect(&socket).await.expect("reconnect");
    assert_eq!(
        kubelet
            .container_state(&running.containers[0])
            .await
            .expect("status"),
        cri::ContainerState::ContainerRunning
    );
    kubelet
        .runtime
        .start_container(cri::StartContainerRequest {
            container_id: second_id.clone(),
        })
        .await
        .expect("start");
    let seen = hook.seen();
    let start = seen
        .iter()
        .find(|s| s.method == "StartContainer" && s.stage == "pre")
        .expect("start seen");
    assert_eq!(start.pod.as_deref(), Some("default/before-restart"));
    assert_eq!(start.container.as_deref(), Some("late"));
    let all = tessera_integration::kubelet::RunningPod {
        containers: vec![running.containers[0].clone(), second_id],
        sandbox_id: running.sandbox_id,
        cgroup_parent: running.cgroup_parent,
    };
    kubelet.stop_and_remove_pod(&all).await.expect("teardown");
}

tessera_integration::each_relay_mode! {
    pod_lifecycle_through_proxy_equals_direct(flavor = "multi_thread", worker_threads = 2);
    hooks_see_every_lifecycle_call_and_rewrite_reaches_containerd(flavor = "multi_thread", worker_threads = 2);
    image_calls_pass_through(flavor = "multi_thread", worker_threads = 2);
    containerd_restart_mid_test(flavor = "multi_thread", worker_threads = 2);
    proxy_restart_mid_test_keeps_containers_and_hook_context(flavor = "multi_thread", worker_threads = 2);
}
