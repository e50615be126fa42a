//! External hook servers registered through hooks.d: merging, timeouts, servers
//! that are down, Fail and Ignore, reload, and tessera-gpu-hook's server code.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_cri::v1 as cri;
use prost::Message;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hook_protocol::hook::v1::{ContainerHookResponse, DeviceNode, KeyValue};
use tessera_hooks::gpu::GpuHookConfig;
use tessera_hooks::probe::HostProbe;
use tessera_hooks::server::GpuHook;
use tessera_integration::fake_runtime::{FakeRuntime, Script, grpc_headers, reply};
use tessera_integration::gpu_node::FakeGpuNode;
use tessera_integration::hook_server::{FnHook, RunningHookServer, serve};
use tessera_integration::proxy::{RelayMode, RunningProxy};
use tessera_integration::raw::{RawClient, frame};
use tessera_runtime_proxy::HookRegistry;

struct Setup {
    dir: tempfile::TempDir,
    fake: FakeRuntime,
    proxy: RunningProxy,
    registry: Arc<HookRegistry>,
}

fn created() -> Script {
    Arc::new(|_| {
        let body = frame(
            &cri::CreateContainerResponse {
                container_id: "c1".into(),
            }
            .encode_to_vec(),
        );
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        reply(grpc_headers(), body, trailers)
    })
}

async fn setup(mode: RelayMode) -> Setup {
    tessera_integration::init_tracing();
    let dir = tempfile::Builder::new()
        .prefix("text-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    std::fs::create_dir(dir.path().join("hooks.d")).expect("mkdir");
    let fake =
        FakeRuntime::start(&dir.path().join("runtime.sock"), created()).expect("fake runtime");
    let registry = HookRegistry::new(dir.path().join("hooks.d"));
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        fake.socket(),
        vec![registry.clone()],
    )
    .await
    .expect("proxy");
    Setup {
        dir,
        fake,
        proxy,
        registry,
    }
}

impl Setup {
    fn register(&self, file: &str, socket: &Path, policy: &str, timeout: &str) {
        let text = format!(
            "endpoint = \"{}\"\nstages = [\"PreCreateContainer\"]\nfailure_policy = \"{policy}\"\ntimeout = \"{timeout}\"\n",
            socket.display()
        );
        std::fs::write(self.dir.path().join("hooks.d").join(file), text).expect("register");
        self.registry.reload_if_changed();
    }

    fn socket(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }

    async fn create(
        &self,
        annotations: &[(&str, &str)],
    ) -> (http::HeaderMap, Option<cri::CreateContainerRequest>) {
        let before = self.fake.forwarded().len();
        let request = cri::CreateContainerRequest {
            pod_sandbox_id: "sb".into(),
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: "main".into(),
                    attempt: 0,
                }),
                envs: vec![cri::KeyValue {
                    key: "KEEP".into(),
                    value: "1".into(),
                }],
                ..Default::default()
            }),
            sandbox_config: Some(cri::PodSandboxConfig {
                metadata: Some(cri::PodSandboxMetadata {
                    name: "p".into(),
                    namespace: "ns".into(),
                    uid: "u".into(),
                    attempt: 0,
                }),
                annotations: annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                ..Default::default()
            }),
        };
        let mut client = RawClient::connect(&self.proxy.socket)
            .await
            .expect("connect");
        let response = client
            .call(
                "/runtime.v1.RuntimeService/CreateContainer",
                &[],
                frame(&request.encode_to_vec()),
            )
            .await
            .expect("answered");
        let status = response.trailers.unwrap_or(response.headers);
        let forwarded = self.fake.forwarded();
        let sent = forwarded
            .get(before)
            .map(|r| cri::CreateContainerRequest::decode(r.body.slice(5..)).expect("decodes"));
        (status, sent)
    }
}

fn envs(request: &cri::CreateContainerRequest) -> Vec<(String, String)> {
    request
        .config
        .as_ref()
        .map(|c| {
            c.envs
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn setting(pairs: &[(&str, &str)], device: Option<&str>) -> ContainerHookResponse {
    ContainerHookResponse {
        set_envs: pairs
            .iter()
            .map(|(k, v)| KeyValue {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        add_devices: device
            .map(|host| DeviceNode {
                container_path: "/dev/extra".into(),
                host_path: host.into(),
                permissions: "rw".into(),
            })
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

fn fixed(
    edit: ContainerHookResponse,
) -> FnHook<
    impl Fn(
        &tessera_hook_protocol::hook::v1::ContainerHookRequest,
    ) -> Result<ContainerHookResponse, tonic::Status>,
> {
    FnHook(move |_: &tessera_hook_protocol::hook::v1::ContainerHookRequest| Ok(edit.clone()))
}

fn message(status: &http::HeaderMap) -> String {
    tessera_runtime_proxy::status_message(status).unwrap_or_default()
}

async fn two_hooks_merge_in_file_order(mode: RelayMode) {
    let s = setup(mode).await;
    let _a: RunningHookServer = serve(
        &s.socket("a.sock"),
        fixed(setting(&[("X", "a"), ("Y", "a")], Some("/dev/a"))),
    )
    .expect("a");
    let _b = serve(
        &s.socket("b.sock"),
        fixed(setting(&[("X", "b")], Some("/dev/b"))),
    )
    .expect("b");
    s.register("10-a.toml", &s.socket("a.sock"), "Fail", "2s");
    s.register("20-b.toml", &s.socket("b.sock"), "Fail", "2s");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(status["grpc-status"], "0", "{}", message(&status));
    let sent = sent.expect("forwarded");
    let envs = envs(&sent);
    assert!(
        envs.contains(&("X".into(), "b".into())),
        "later hook wins: {envs:?}"
    );
    assert!(
        envs.contains(&("Y".into(), "a".into())) && envs.contains(&("KEEP".into(), "1".into())),
        "{envs:?}"
    );
    let devices = sent.config.expect("config").devices;
    assert_eq!(devices.len(), 1, "unique by container path: {devices:?}");
    assert_eq!(devices[0].host_path, "/dev/b");
}

async fn slow_hook_under_fail_and_ignore(mode: RelayMode) {
    let s = setup(mode).await;
    let slow = FnHook(
        |_: &tessera_hook_protocol::hook::v1::ContainerHookRequest| {
            std::thread::sleep(Duration::from_secs(2));
            Ok(setting(&[("SLOW", "1")], None))
        },
    );
    let _slow = serve(&s.socket("slow.sock"), slow).expect("slow");
    s.register("10-slow.toml", &s.socket("slow.sock"), "Fail", "200ms");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(
        status["grpc-status"],
        "4",
        "DeadlineExceeded: {}",
        message(&status)
    );
    assert!(
        message(&status).contains("hook \"10-slow\"")
            && message(&status).contains("timed out after 200ms"),
        "{}",
        message(&status)
    );
    assert!(sent.is_none(), "a refused call reached the runtime");

    s.register("10-slow.toml", &s.socket("slow.sock"), "Ignore", "250ms");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(status["grpc-status"], "0");
    assert!(
        !envs(&sent.expect("forwarded"))
            .iter()
            .any(|(k, _)| k == "SLOW")
    );
}

async fn hook_that_is_down_under_fail_and_ignore(mode: RelayMode) {
    let s = setup(mode).await;
    s.register("10-down.toml", &s.socket("nobody.sock"), "Fail", "2s");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(
        status["grpc-status"],
        "14",
        "Unavailable: {}",
        message(&status)
    );
    assert!(
        message(&status).contains("hook \"10-down\"") && message(&status).contains("nobody.sock"),
        "{}",
        message(&status)
    );
    assert!(sent.is_none());

    s.register("10-down.toml", &s.socket("nobody.sock"), "Ignore", "2s");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(status["grpc-status"], "0");
    assert!(sent.is_some());
}

async fn refusal_reaches_kubelet_with_the_hooks_code(mode: RelayMode) {
    let s = setup(mode).await;
    let refusing = FnHook(
        |_: &tessera_hook_protocol::hook::v1::ContainerHookRequest| {
            Err(tonic::Status::permission_denied("no GPUs on Sundays"))
        },
    );
    let _r = serve(&s.socket("r.sock"), refusing).expect("serve");
    s.register("10-r.toml", &s.socket("r.sock"), "Fail", "2s");
    let (status, sent) = s.create(&[]).await;
    assert_eq!(status["grpc-status"], "7");
    assert!(
        message(&status).contains("no GPUs on Sundays"),
        "{}",
        message(&status)
    );
    assert!(sent.is_none());
}

async fn registry_watch_picks_up_new_files_without_restart(mode: RelayMode) {
    let s = setup(mode).await;
    let _w = s.registry.watch(Duration::from_millis(50));
    let _a = serve(
        &s.socket("a.sock"),
        fixed(setting(&[("WATCHED", "yes")], None)),
    )
    .expect("serve");
    std::fs::write(
        s.dir.path().join("hooks.d/30-w.toml"),
        format!(
            "endpoint = \"{}\"\nstages = [\"PreCreateContainer\"]\n",
            s.socket("a.sock").display()
        ),
    )
    .expect("write");
    for _ in 0..100 {
        if !s.registry.hooks().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, sent) = s.create(&[]).await;
    assert!(envs(&sent.expect("forwarded")).contains(&("WATCHED".into(), "yes".into())));
}

async fn tessera_gpu_hook_server_as_an_external_hook(mode: RelayMode) {
    let s = setup(mode).await;
    let node = FakeGpuNode::create(s.dir.path(), 2).expect("fake GPUs (root)");
    let config = GpuHookConfig {
        device_root: node.device_root.clone(),
        ..GpuHookConfig::default()
    };
    let _gpu = serve(
        &s.socket("gpu.sock"),
        GpuHook::new(
            config,
            Arc::new(HostProbe::new(tessera_integration::probe_paths(&node))),
        ),
    )
    .expect("serve");
    s.register("00-gpu.toml", &s.socket("gpu.sock"), "Fail", "2s");
    let uuid = node.gpus[1].uuid.clone();
    let annotation = format!(
        r#"{{"gpu":[{{"minor":1,"id":"{uuid}","resources":{{"koordinator.sh/gpu-core":100}}}}]}}"#
    );
    let (status, sent) = s.create(&[(DEVICE_ALLOCATED, &annotation)]).await;
    assert_eq!(status["grpc-status"], "0", "{}", message(&status));
    let sent = sent.expect("forwarded");
    assert!(envs(&sent).contains(&("NVIDIA_VISIBLE_DEVICES".into(), uuid)));
    let devices: Vec<String> = sent
        .config
        .expect("config")
        .devices
        .iter()
        .map(|d| d.container_path.clone())
        .collect();
    assert!(devices.contains(&"/dev/nvidia1".to_owned()), "{devices:?}");

    let (status, sent) = s
        .create(&[(DEVICE_ALLOCATED, r#"{"gpu":[{"minor":"x"}]}"#)])
        .await;
    assert_eq!(status["grpc-status"], "3", "InvalidArgument");
    assert!(
        message(&status).contains(
            "pod ns/p: annotation scheduling.koordinator.sh/device-allocated: gpu[0].minor"
        ),
        "{}",
        message(&status)
    );
    assert!(sent.is_none());
}

tessera_integration::each_relay_mode! {
    two_hooks_merge_in_file_order;
    slow_hook_under_fail_and_ignore;
    hook_that_is_down_under_fail_and_ignore;
    refusal_reaches_kubelet_with_the_hooks_code;
    registry_watch_picks_up_new_files_without_restart;
    tessera_gpu_hook_server_as_an_external_hook;
}
