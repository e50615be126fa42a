use std::collections::HashMap;

use tessera_hooks::gpu::{GpuDevice, PluginGrants};

use super::*;

const GPU_A: &str = "GPU-aaaaaaaa-0000-4000-8000-000000000000";
const GPU_B: &str = "GPU-bbbbbbbb-0000-4000-8000-000000000000";

#[derive(Debug)]
struct Node;

impl DeviceProbe for Node {
    fn probe(&self) -> NodeDevices {
        NodeDevices {
            gpus: Some(vec![
                GpuDevice {
                    uuid: GPU_A.into(),
                    minor: 0,
                    memory_bytes: Some(80 << 30),
                },
                GpuDevice {
                    uuid: GPU_B.into(),
                    minor: 1,
                    memory_bytes: Some(80 << 30),
                },
            ]),
            nodes: ["nvidia0", "nvidia1"].map(String::from).into(),
            plugin_grants: PluginGrants::NoCheckpoint,
            book: None,
        }
    }
}

#[derive(Debug)]
struct Runtime(Result<RuntimeCdi, String>);

#[async_trait]
impl CdiSource for Runtime {
    async fn runtime_cdi(&self) -> Result<RuntimeCdi, String> {
        self.0.clone()
    }
}

fn hook(runtime: Result<RuntimeCdi, String>, spec_dir: Option<PathBuf>) -> EnforceHook {
    EnforceHook::new(
        Enforcement {
            driver_memory: true,
            mps: None,
            gpu_time: false,
            oom_kill: false,
            hami_core: None,
        },
        Some(DriverMemory {
            hook: HookCommand {
                binary: "/opt/tessera/tessera-enforce".into(),
                nvml_library: "libnvidia-ml.so.1".into(),
            },
            runtime: Arc::new(Runtime(runtime)),
            spec_dir,
        }),
        None,
        Arc::new(Node),
        Arc::new(Metrics::default()),
    )
}

/// `main` holds 25 % / 20 GiB of GPU A, `whole` all of GPU B, `sidecar` nothing.
fn pod() -> Arc<PodInfo> {
    let annotation = format!(
        r#"{{"gpu":[{{"minor":0,"id":"{GPU_A}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25,"koordinator.sh/gpu-memory":"20Gi"}},"extension":{{"containers":{{"main":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25,"koordinator.sh/gpu-memory":"20Gi"}}}}}}}},{{"minor":1,"id":"{GPU_B}","resources":{{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}},"extension":{{"containers":{{"whole":{{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}}}}}}}]}}"#
    );
    Arc::new(PodInfo {
        uid: "0b6c2a1e-1111-4222-8333-444455556666".into(),
        name: "train".into(),
        namespace: "team".into(),
        annotations: HashMap::from([(DEVICE_ALLOCATED.to_owned(), annotation)]),
        ..PodInfo::default()
    })
}

fn run_sandbox() -> LifecycleRequest {
    LifecycleRequest::RunPodSandbox(cri::RunPodSandboxRequest::default())
}

fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn containerd_status_config_says_whether_cdi_is_on() {
    let status = |config: &str| cri::StatusResponse {
        info: HashMap::from([("config".to_owned(), config.to_owned())]),
        ..Default::default()
    };
    assert_eq!(
        RuntimeCdi::from_status(&status(
            r#"{"enableCDI":true,"cdiSpecDirs":["/etc/cdi","/var/run/cdi"],"enableSelinux":false}"#
        )),
        RuntimeCdi {
            enabled: true,
            spec_dirs: vec!["/etc/cdi".into(), "/var/run/cdi".into()]
        }
    );
    // containerd 1.6: no CDI in its config at all.
    let old = RuntimeCdi::from_status(&status(r#"{"containerd":{"snapshotter":"native"}}"#));
    assert!(!old.enabled);
    assert_eq!(old.spec_dir(), None);
    assert!(!RuntimeCdi::from_status(&cri::StatusResponse::default()).enabled);
}

#[tokio::test]
async fn a_sandbox_gets_a_spec_per_shared_container_and_loses_them_with_the_pod()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let cdi_dirs = vec![dir.path().join("etc"), dir.path().join("run")];
    let hook = hook(
        Ok(RuntimeCdi {
            enabled: true,
            spec_dirs: cdi_dirs.clone(),
        }),
        None,
    );
    let ctx = HookContext {
        pod: Some(pod()),
        container: None,
    };
    hook.pre(&ctx, &mut run_sandbox()).await?;
    // The runtime's last directory; only the shared container.
    let device = "0b6c2a1e-1111-4222-8333-444455556666_main";
    assert_eq!(
        files(&cdi_dirs[1]),
        [format!("tessera-enforce-{device}.json")]
    );
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(
        cdi_dirs[1].join(format!("tessera-enforce-{device}.json")),
    )?)?;
    assert_eq!(spec["kind"], "tessera.io/enforce");
    assert_eq!(spec["devices"][0]["name"], device);
    let hook_entry = &spec["devices"][0]["containerEdits"]["hooks"][0];
    assert_eq!(hook_entry["hookName"], "createRuntime");
    assert_eq!(hook_entry["path"], "/opt/tessera/tessera-enforce");
    assert_eq!(
        hook_entry["args"],
        serde_json::json!([
            "tessera-enforce",
            "memory-limits",
            "--nvml-library=libnvidia-ml.so.1",
            format!("--limit={GPU_A}={}", 20u64 << 30)
        ])
    );

    // Another pod's file stays when this one goes.
    std::fs::write(cdi_dirs[1].join("tessera-enforce-other_main.json"), "{}")?;
    let removed = LifecycleRequest::RemovePodSandbox(cri::RemovePodSandboxRequest::default());
    hook.post(
        &ctx,
        &removed,
        &CallOutcome::Ok(crate::hook::LifecycleResponse::RemovePodSandbox(
            cri::RemovePodSandboxResponse::default(),
        )),
    )
    .await;
    assert_eq!(files(&cdi_dirs[1]), ["tessera-enforce-other_main.json"]);
    Ok(())
}

#[tokio::test]
async fn a_runtime_without_cdi_refuses_shared_pods_only() -> Result<(), Box<dyn std::error::Error>>
{
    let dir = tempfile::tempdir()?;
    let hook = hook(
        Ok(RuntimeCdi {
            enabled: false,
            spec_dirs: vec![dir.path().into()],
        }),
        None,
    );
    let shared = HookContext {
        pod: Some(pod()),
        container: None,
    };
    let Err(refusal) = hook.pre(&shared, &mut run_sandbox()).await else {
        panic!("a shared pod was let through a runtime that would not run its hook");
    };
    assert_eq!(refusal.code, Code::FailedPrecondition);
    assert!(refusal.message.contains("CDI off"), "{}", refusal.message);
    assert!(files(dir.path()).is_empty());

    // A pod with no share needs nothing of the runtime.
    let plain = HookContext {
        pod: Some(Arc::new(PodInfo::default())),
        container: None,
    };
    hook.pre(&plain, &mut run_sandbox()).await?;
    Ok(())
}

#[tokio::test]
async fn create_container_writes_a_missing_spec_for_its_device()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    // --cdi-spec-dir wins over the runtime's (here: none).
    let hook = hook(
        Ok(RuntimeCdi {
            enabled: true,
            spec_dirs: Vec::new(),
        }),
        Some(dir.path().into()),
    );
    let ctx = HookContext {
        pod: Some(pod()),
        container: Some(crate::store::ContainerInfo {
            name: "main".into(),
            ..Default::default()
        }),
    };
    let create = |cdi: &[&str]| {
        LifecycleRequest::CreateContainer(cri::CreateContainerRequest {
            config: Some(cri::ContainerConfig {
                cdi_devices: cdi
                    .iter()
                    .map(|name| cri::CdiDevice {
                        name: (*name).to_owned(),
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
    };
    // Without the GPU hook's device, nothing to do.
    hook.pre(&ctx, &mut create(&["nvidia.com/gpu=all"])).await?;
    assert!(files(dir.path()).is_empty());
    hook.pre(
        &ctx,
        &mut create(&["tessera.io/enforce=0b6c2a1e-1111-4222-8333-444455556666_main"]),
    )
    .await
    .map_err(|e| e.message)?;
    assert_eq!(
        files(dir.path()),
        ["tessera-enforce-0b6c2a1e-1111-4222-8333-444455556666_main.json"]
    );
    Ok(())
}

#[tokio::test]
async fn created_shared_containers_are_counted_by_their_backends() {
    let hook = hook(Err("unused".into()), None);
    let created = |env: Option<&str>, ok: bool| {
        let request = LifecycleRequest::CreateContainer(cri::CreateContainerRequest {
            config: Some(cri::ContainerConfig {
                envs: env
                    .map(|v| cri::KeyValue {
                        key: "TESSERA_ENFORCEMENT".into(),
                        value: v.into(),
                    })
                    .into_iter()
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        });
        let outcome = if ok {
            CallOutcome::Ok(crate::hook::LifecycleResponse::CreateContainer(
                cri::CreateContainerResponse::default(),
            ))
        } else {
            CallOutcome::Failed {
                code: Code::Internal,
                message: "no".into(),
            }
        };
        (request, outcome)
    };
    let ctx = HookContext::default();
    for (env, ok) in [
        (Some("driver-memory+hami-core"), true),
        (Some("driver-memory+hami-core"), true),
        (Some("none"), true),
        (Some("none"), false),
        (None, true),
    ] {
        let (request, outcome) = created(env, ok);
        hook.post(&ctx, &request, &outcome).await;
    }
    let text = hook.metrics.encode();
    assert!(
        text.contains(
            r#"tessera_proxy_shared_containers_total{enforcement="driver-memory+hami-core"} 2"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"tessera_proxy_shared_containers_total{enforcement="none"} 1"#),
        "{text}"
    );
}

/// The fake MPS daemon's state machine, called in process.
#[derive(Debug, Default)]
struct FakeControl(std::sync::Mutex<tessera_fake_mps::FakeMps>);

impl mps::Control for FakeControl {
    fn run(&self, args: &[String]) -> Result<String, mps::MpsError> {
        let mut fake = self.0.lock().unwrap_or_else(|p| p.into_inner());
        fake.execute(args).map_err(|reason| mps::MpsError::Control {
            command: args.join(" "),
            reason,
        })
    }
}

#[derive(Debug)]
struct AnyMode;

impl mps::ComputeMode for AnyMode {
    fn mode(&self, _: &str) -> Result<mps::GpuMode, mps::MpsError> {
        Ok(mps::GpuMode::ExclusiveProcess)
    }

    fn set(&self, _: &str, _: mps::GpuMode) -> Result<(), mps::MpsError> {
        Ok(())
    }
}

#[tokio::test]
async fn a_shared_container_with_a_pipe_directory_gets_its_namespace_until_its_pod_goes()
-> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let control = Arc::new(FakeControl::default());
    let mps = Mps::new(
        control.clone(),
        Arc::new(AnyMode),
        "/run/nvidia-mps".into(),
        dir.path().join("state"),
    );
    let hook = EnforceHook::new(
        Enforcement {
            driver_memory: false,
            mps: Some(tessera_hooks::gpu::MpsFiles {
                pipe_dir: "/run/nvidia-mps".into(),
            }),
            gpu_time: false,
            oom_kill: false,
            hami_core: None,
        },
        None,
        Some(mps),
        Arc::new(Node),
        Arc::new(Metrics::default()),
    );
    let ctx = |container: &str| HookContext {
        pod: Some(pod()),
        container: Some(crate::store::ContainerInfo {
            name: container.into(),
            ..Default::default()
        }),
    };
    let create_from = |host: Option<&str>| {
        LifecycleRequest::CreateContainer(cri::CreateContainerRequest {
            config: Some(cri::ContainerConfig {
                mounts: host
                    .map(|host| cri::Mount {
                        container_path: mps::CONTAINER_PIPE_DIR.into(),
                        host_path: host.into(),
                        readonly: true,
                        ..Default::default()
                    })
                    .into_iter()
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
    };
    let get = |name: &str, field: &str| {
        mps::Control::run(
            control.as_ref(),
            &["namespace", "get", name, "gpu_0", field].map(str::to_owned),
        )
    };
    let uid = "0b6c2a1e-1111-4222-8333-444455556666";
    let name = mps::namespace_name(uid, "main").unwrap_or_default();
    let create = |piped: bool| create_from(piped.then_some("/run/nvidia-mps/gpu_0/x"));
    // Without the GPU hook's mount, or with a tenant's own volume there: nothing made.
    hook.pre(&ctx("main"), &mut create(false))
        .await
        .map_err(|e| e.message)?;
    hook.pre(
        &ctx("whole"),
        &mut create_from(Some("/var/lib/kubelet/pods/x/volumes/data")),
    )
    .await
    .map_err(|e| e.message)?;
    assert!(get(&name, "name").is_err());
    hook.pre(&ctx("main"), &mut create(true))
        .await
        .map_err(|e| e.message)?;
    assert_eq!(get(&name, "pinned-memory-limit")?, "20G");
    assert_eq!(get(&name, "active-thread-percentage")?, "25.00");
    // A pipe directory on a container with no share of one GPU: refused, not made.
    let Err(refusal) = hook.pre(&ctx("whole"), &mut create(true)).await else {
        panic!("a whole-GPU container with a pipe directory was let through");
    };
    assert_eq!(refusal.code, Code::FailedPrecondition);

    // The sandbox stops: no container of it runs again, its namespaces go.
    let stopped = LifecycleRequest::StopPodSandbox(cri::StopPodSandboxRequest::default());
    hook.post(
        &ctx("main"),
        &stopped,
        &CallOutcome::Ok(crate::hook::LifecycleResponse::StopPodSandbox(
            cri::StopPodSandboxResponse::default(),
        )),
    )
    .await;
    assert!(get(&name, "name").is_err());
    assert!(
        mps::Control::run(
            control.as_ref(),
            &["server", "get", "gpu_0", "status"].map(str::to_owned)
        )
        .is_err(),
        "the GPU's server outlived its last namespace"
    );
    Ok(())
}

mod gpu_time {
    use tessera_enforce::throttle::{
        Freezer, GpuTime, Lookup, Processes, Sample, Throttle, ThrottleError,
    };

    use super::*;
    use crate::store::ContainerInfo;

    struct Idle;
    impl GpuTime for Idle {
        fn samples(&mut self, _: &str, _: u64) -> Result<Vec<Sample>, ThrottleError> {
            Ok(Vec::new())
        }
    }
    impl Processes for Idle {
        fn cgroup(&self, _: u32) -> Lookup {
            Lookup::NotContainer
        }
    }
    impl Freezer for Idle {
        fn set(&self, _: &Path, _: bool) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn id(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn ctx(name: &str, c: char) -> HookContext {
        HookContext {
            pod: Some(pod()),
            container: Some(ContainerInfo {
                id: id(c),
                name: name.into(),
                ..ContainerInfo::default()
            }),
        }
    }

    fn start(c: char) -> LifecycleRequest {
        LifecycleRequest::StartContainer(cri::StartContainerRequest {
            container_id: id(c),
        })
    }

    fn held(dir: &Path) -> Result<(EnforceHook, GpuTimeHold), Box<dyn std::error::Error>> {
        let throttle = Throttle::open(dir.to_owned(), Box::new(Idle), Box::new(Idle))?;
        let hold = GpuTimeHold::new(throttle, Box::new(Idle));
        let hook = EnforceHook::new(
            Enforcement {
                gpu_time: true,
                ..Enforcement::default()
            },
            None,
            None,
            Arc::new(Node),
            Arc::new(Metrics::default()),
        )
        .with_gpu_time(Some(hold.clone()));
        Ok((hook, hold))
    }

    #[tokio::test]
    async fn shares_of_several_gpus_are_each_held_to_their_own()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let (hook, hold) = held(dir.path())?;
        // 25 % of GPU A, and all of GPU B's compute with half its memory: held
        // on GPU A alone.
        let annotation = format!(
            r#"{{"gpu":[{{"minor":0,"id":"{GPU_A}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}},{{"minor":1,"id":"{GPU_B}","resources":{{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":50}}}}]}}"#
        );
        let pod = Arc::new(PodInfo {
            annotations: HashMap::from([(DEVICE_ALLOCATED.to_owned(), annotation)]),
            ..(*pod()).clone()
        });
        let ctx = HookContext {
            pod: Some(Arc::clone(&pod)),
            container: Some(ContainerInfo {
                id: id('e'),
                name: "main".into(),
                ..ContainerInfo::default()
            }),
        };
        hook.pre(&ctx, &mut start('e')).await?;
        assert_eq!(hold.accounts().len(), 1);
        let file = dir.path().join(format!("{}_{}", pod.uid, id('e')));
        let text = std::fs::read_to_string(&file)?;
        assert!(
            text.contains(&format!("gpus={GPU_A},{GPU_B}\n")) && text.contains("percents=25,100\n"),
            "{text}"
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_compute_share_is_held_from_its_start_until_its_stop()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let (hook, hold) = held(dir.path())?;
        // A whole GPU and a container with no grant are not held.
        hook.pre(&ctx("whole", 'b'), &mut start('b')).await?;
        hook.pre(&ctx("sidecar", 'c'), &mut start('c')).await?;
        assert!(hold.accounts().is_empty());

        hook.pre(&ctx("main", 'a'), &mut start('a')).await?;
        let accounts = hold.accounts();
        assert_eq!(accounts.len(), 1);
        assert_eq!(
            (accounts[0].container_id.as_str(), accounts[0].percent),
            (id('a').as_str(), 25)
        );

        let mut stop = LifecycleRequest::StopContainer(cri::StopContainerRequest {
            container_id: id('a'),
            timeout: 30,
        });
        hook.pre(&ctx("main", 'a'), &mut stop).await?;
        assert!(hold.accounts().is_empty());

        // Restarted by kubelet (a new container), then its pod stops: let go
        // with the pod.
        hook.pre(&ctx("main", 'd'), &mut start('d')).await?;
        assert_eq!(hold.accounts().len(), 1);
        let mut stop_pod = LifecycleRequest::StopPodSandbox(cri::StopPodSandboxRequest::default());
        let pod_only = HookContext {
            pod: Some(pod()),
            container: None,
        };
        hook.pre(&pod_only, &mut stop_pod).await?;
        assert!(hold.accounts().is_empty());
        assert!(files(dir.path()).is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn at_the_proxys_start_running_shared_containers_are_held_and_gone_pods_let_go()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let (hook, hold) = held(dir.path())?;
        let store = crate::store::PodStore::default();
        let live = PodInfo {
            sandbox_id: "sandbox-1".into(),
            ..(*pod()).clone()
        };
        store.insert_pod(live);
        for (name, c) in [("main", 'a'), ("whole", 'b'), ("sidecar", 'c')] {
            store.insert_container(ContainerInfo {
                id: id(c),
                name: name.into(),
                sandbox_id: "sandbox-1".into(),
            });
        }
        // A stopped pod's shared container is not held.
        let stopped = PodInfo {
            sandbox_id: "sandbox-2".into(),
            uid: "0b6c2a1e-2222-4222-8333-444455556666".into(),
            ..(*pod()).clone()
        };
        store.insert_pod(stopped);
        store.insert_container(ContainerInfo {
            id: id('e'),
            name: "main".into(),
            sandbox_id: "sandbox-2".into(),
        });
        store.mark_stopped("sandbox-2");
        // Held before the restart, of a pod removed while the proxy was down.
        hold.grant(tessera_enforce::throttle::Grant {
            pod_uid: "0b6c2a1e-3333-4222-8333-444455556666".into(),
            container_id: id('f'),
            percent: 25,
            gpus: vec![GPU_A.into()],
            percents: Vec::new(),
        })?;
        assert_eq!(hook.resync_gpu_time(&store).await, (1, 1));
        let accounts = hold.accounts();
        assert_eq!(accounts.len(), 1);
        assert_eq!(accounts[0].container_id, id('a'));
        // Again (a second resync): already held, nothing new.
        assert_eq!(hook.resync_gpu_time(&store).await, (0, 0));
        assert_eq!(hold.accounts().len(), 1);
        Ok(())
    }

    #[tokio::test]
    async fn a_share_that_cannot_be_held_is_not_started() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let grants = dir.path().join("grants");
        let (hook, hold) = held(&grants)?;
        // Its grant file cannot be written.
        std::fs::remove_dir(&grants)?;
        std::fs::write(&grants, "not a directory")?;
        let refused = hook
            .pre(&ctx("main", 'a'), &mut start('a'))
            .await
            .err()
            .ok_or("started unheld")?;
        assert_eq!(refused.code, Code::Unavailable);
        assert!(
            refused.message.contains("container main of pod team/train")
                && refused.message.contains("compute share cannot be held"),
            "{}",
            refused.message
        );
        assert!(hold.accounts().is_empty());
        Ok(())
    }
}

/// The driver's processes, as a test sets them; or its error.
struct Driver(Arc<std::sync::Mutex<Result<Vec<tessera_enforce::usage::ProcessMemory>, String>>>);

impl tessera_enforce::usage::GpuMemory for Driver {
    fn processes(
        &mut self,
    ) -> Result<tessera_enforce::usage::GpuProcesses, tessera_enforce::usage::UsageError> {
        self.0
            .lock()
            .expect("not poisoned")
            .clone()
            .map(|processes| tessera_enforce::usage::GpuProcesses {
                processes,
                failed: Vec::new(),
            })
            .map_err(tessera_enforce::usage::UsageError::from)
    }
}

/// pid N runs in the container whose ID is N repeated (pid 9: the node's).
struct Pids;

impl tessera_enforce::throttle::Processes for Pids {
    fn cgroup(&self, pid: u32) -> tessera_enforce::throttle::Lookup {
        use tessera_enforce::throttle::{Lookup, ProcessCgroup};
        if pid == 9 {
            return Lookup::NotContainer;
        }
        Lookup::Container(ProcessCgroup {
            container_id: pid.to_string().repeat(64),
            dir: "/sys/fs/cgroup/x".into(),
        })
    }
}

#[tokio::test]
async fn memory_report_names_each_containers_use_against_its_grant() {
    use tessera_api::usage::{MemoryGrant, NodeGpuMemory};
    use tessera_enforce::usage::ProcessMemory;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(crate::store::PodStore::default());
    let pod = pod();
    store.insert_pod(PodInfo {
        sandbox_id: "sandbox".into(),
        ..(*pod).clone()
    });
    // A trusted GPU agent's pod, and a pod whose grant cannot be read.
    store.insert_pod(PodInfo {
        sandbox_id: "agent".into(),
        uid: "agent-uid".into(),
        name: "dcgm".into(),
        namespace: "gpu-agents".into(),
        ..PodInfo::default()
    });
    store.insert_pod(PodInfo {
        sandbox_id: "broken".into(),
        uid: "broken-uid".into(),
        name: "broken".into(),
        namespace: "team".into(),
        annotations: HashMap::from([(DEVICE_ALLOCATED.to_owned(), "{not json".to_owned())]),
        ..PodInfo::default()
    });
    for (pid, name, sandbox) in [
        (1, "main", "sandbox"),
        (2, "whole", "sandbox"),
        (3, "sidecar", "sandbox"),
        (5, "exporter", "agent"),
        (6, "main", "broken"),
    ] {
        store.insert_container(crate::store::ContainerInfo {
            id: pid.to_string().repeat(64),
            name: name.into(),
            sandbox_id: sandbox.into(),
        });
    }
    let process = |gpu: &str, pid, used| ProcessMemory {
        gpu: gpu.into(),
        pid,
        used,
    };
    let driver = Arc::new(std::sync::Mutex::new(Ok(vec![
        process(GPU_A, 1, 12 << 30),
        process(GPU_B, 2, 30 << 30),
        // A sidecar with no grant on a GPU, the node's own process, and a
        // container the proxy never saw.
        process(GPU_A, 3, 1 << 30),
        process(GPU_A, 9, 1 << 30),
        process(GPU_A, 4, 1 << 30),
        // The agent, and the pod whose grant is unknown (left out, not ungranted).
        process(GPU_B, 5, 1 << 20),
        process(GPU_B, 6, 1 << 20),
    ])));
    let mut report = crate::usage::Report::new(
        crate::usage::Sampler::new(Box::new(Driver(Arc::clone(&driver))), Box::new(Pids)),
        Arc::new(hook(Err("unused".into()), None)),
        store,
        vec!["gpu-agents".parse().expect("an agent entry")],
        dir.path(),
    );
    report.round().await.expect("a round");
    let file = dir.path().join(tessera_api::usage::USAGE_FILE);
    let read = || {
        NodeGpuMemory::parse(&std::fs::read_to_string(&file).expect("the report"))
            .expect("a report")
    };
    let seen: Vec<(String, String, u64, MemoryGrant)> = read()
        .containers
        .into_iter()
        .map(|c| (format!("{}/{}", c.pod, c.container), c.gpu, c.used, c.grant))
        .collect();
    assert_eq!(
        seen,
        [
            (
                "dcgm/exporter".into(),
                GPU_B.into(),
                1 << 20,
                MemoryGrant::Trusted
            ),
            (
                "train/main".into(),
                GPU_A.into(),
                12 << 30,
                MemoryGrant::Share(20 << 30)
            ),
            (
                "train/sidecar".into(),
                GPU_A.into(),
                1 << 30,
                MemoryGrant::None
            ),
            (
                "train/whole".into(),
                GPU_B.into(),
                30 << 30,
                MemoryGrant::Whole
            ),
        ]
    );
    // The driver failing withdraws the report; read again, it is back.
    *driver.lock().expect("not poisoned") = Err("GPU is lost".into());
    assert!(
        report
            .round()
            .await
            .expect_err("the driver failed")
            .contains("GPU is lost")
    );
    assert!(!file.exists());
    *driver.lock().expect("not poisoned") = Ok(vec![process(GPU_A, 1, 1)]);
    report.round().await.expect("a round");
    assert_eq!(read().containers.len(), 1);
}

/// Records each kill; a pid in `gone` has already exited.
#[derive(Clone, Default)]
struct Kills {
    done: Arc<std::sync::Mutex<Vec<(u32, String)>>>,
    gone: Vec<u32>,
}

impl tessera_enforce::oom::Killer for Kills {
    fn kill(
        &self,
        pid: u32,
        _start: Option<u64>,
        container_id: &str,
    ) -> Result<(), tessera_enforce::oom::KillError> {
        if self.gone.contains(&pid) {
            return Err(tessera_enforce::oom::KillError::Gone(
                pid,
                container_id.to_owned(),
            ));
        }
        self.done
            .lock()
            .expect("not poisoned")
            .push((pid, container_id.to_owned()));
        Ok(())
    }
}

/// pid N runs in the container whose ID is its first digit repeated (pids 1,
/// 11 and 12 share one).
struct FirstDigit;

impl tessera_enforce::throttle::Processes for FirstDigit {
    fn cgroup(&self, pid: u32) -> tessera_enforce::throttle::Lookup {
        use tessera_enforce::throttle::{Lookup, ProcessCgroup};
        let first = pid.to_string()[..1].to_owned();
        Lookup::Container(ProcessCgroup {
            container_id: first.repeat(64),
            dir: "/sys/fs/cgroup/x".into(),
        })
    }
}

#[tokio::test]
async fn oom_kill_takes_a_shares_largest_processes_past_its_grant_and_margin() {
    use tessera_api::usage::NodeGpuMemory;
    use tessera_enforce::usage::ProcessMemory;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(crate::store::PodStore::default());
    store.insert_pod(PodInfo {
        sandbox_id: "sandbox".into(),
        ..(*pod()).clone()
    });
    for (id, name) in [(1, "main"), (2, "whole"), (3, "sidecar")] {
        store.insert_container(crate::store::ContainerInfo {
            id: id.to_string().repeat(64),
            name: name.into(),
            sandbox_id: "sandbox".into(),
        });
    }
    let process = |gpu: &str, pid, used: u64| ProcessMemory {
        gpu: gpu.into(),
        pid,
        used,
    };
    let gib = |n: u64| n << 30;
    // main (a 20 GiB share of GPU A) holds 22 GiB in three processes: past its
    // grant and a 1 GiB margin. whole holds 30 GiB of its own GPU; the sidecar
    // 1 GiB of a GPU it was not granted (the reporter's to judge).
    let driver = Arc::new(std::sync::Mutex::new(Ok(vec![
        process(GPU_A, 1, gib(16)),
        process(GPU_A, 11, gib(5)),
        process(GPU_A, 12, gib(1)),
        process(GPU_B, 2, gib(30)),
        process(GPU_A, 3, gib(1)),
    ])));
    let kills = Kills::default();
    let report = |margin: Option<u64>| {
        let report = crate::usage::Report::new(
            crate::usage::Sampler::new(Box::new(Driver(Arc::clone(&driver))), Box::new(FirstDigit))
                .killing(Box::new(kills.clone())),
            Arc::new(hook(Err("unused".into()), None)),
            Arc::clone(&store),
            Vec::new(),
            dir.path(),
        );
        match margin {
            Some(margin) => report.with_oom_kill(margin),
            None => report,
        }
    };
    let file = dir.path().join(tessera_api::usage::USAGE_FILE);
    let read = || {
        NodeGpuMemory::parse(&std::fs::read_to_string(&file).expect("the report"))
            .expect("a report")
    };
    // Off: measured, nothing killed.
    report(None).round().await.expect("a round");
    assert!(kills.done.lock().expect("not poisoned").is_empty());
    assert!(read().kills.is_empty());

    // On: the 16 GiB process alone brings it within 21 GiB.
    let mut on = report(Some(gib(1)));
    on.round().await.expect("a round");
    assert_eq!(
        *kills.done.lock().expect("not poisoned"),
        [(1, "1".repeat(64))]
    );
    let told = read().kills;
    assert_eq!(told.len(), 1, "{told:?}");
    let kill = &told[0];
    assert_eq!(
        (
            kill.entry.pod.as_str(),
            kill.entry.container.as_str(),
            kill.entry.gpu.as_str(),
            kill.entry.used,
            kill.entry.limit().unwrap_or_default(),
            kill.margin,
            kill.pids.as_slice()
        ),
        (
            "train",
            "main",
            GPU_A,
            gib(22),
            gib(20),
            gib(1),
            &[1u32][..]
        )
    );
    // Still listed by the driver while it dies: neither counted nor killed again,
    // and the kill stays on record.
    on.round().await.expect("a round");
    assert_eq!(kills.done.lock().expect("not poisoned").len(), 1);
    let now = read();
    assert_eq!(now.kills, told);
    assert!(
        now.containers
            .iter()
            .any(|c| c.container == "main" && c.used == gib(6)),
        "{now:?}"
    );

    // A process that exits before its kill is no kill.
    let gone = Kills {
        gone: vec![11],
        ..Kills::default()
    };
    *driver.lock().expect("not poisoned") = Ok(vec![process(GPU_A, 11, gib(25))]);
    let mut exiting = crate::usage::Report::new(
        crate::usage::Sampler::new(Box::new(Driver(Arc::clone(&driver))), Box::new(FirstDigit))
            .killing(Box::new(gone.clone())),
        Arc::new(hook(Err("unused".into()), None)),
        Arc::clone(&store),
        Vec::new(),
        dir.path(),
    )
    .with_oom_kill(gib(1));
    exiting.round().await.expect("a round");
    assert!(gone.done.lock().expect("not poisoned").is_empty());
    assert!(read().kills.is_empty());
}
