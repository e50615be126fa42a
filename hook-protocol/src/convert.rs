//! CRI ↔ `tessera.hook.v1`: the view of a call a hook gets, and writing a hook's
//! edits back onto the CRI request.

use crate::edit;
use crate::hook::v1 as hook;
use k8s_cri::v1 as cri;

use crate::lifecycle::{CallOutcome, HookContext, LifecycleRequest, Method, PodInfo};

/// The `tessera.hook.v1` event of an intercepted method.
pub fn event(method: Method) -> hook::Event {
    match method {
        Method::RunPodSandbox => hook::Event::RunPodSandbox,
        Method::StopPodSandbox => hook::Event::StopPodSandbox,
        Method::RemovePodSandbox => hook::Event::RemovePodSandbox,
        Method::CreateContainer => hook::Event::CreateContainer,
        Method::StartContainer => hook::Event::StartContainer,
        Method::StopContainer => hook::Event::StopContainer,
        Method::RemoveContainer => hook::Event::RemoveContainer,
        Method::UpdateContainerResources => hook::Event::UpdateContainerResources,
    }
}

/// Whether the method concerns a pod sandbox (else a container).
pub fn is_sandbox_method(method: Method) -> bool {
    matches!(
        method,
        Method::RunPodSandbox | Method::StopPodSandbox | Method::RemovePodSandbox
    )
}

fn pod_metadata(pod: Option<&PodInfo>) -> Option<hook::PodMetadata> {
    pod.map(|pod| hook::PodMetadata {
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        uid: pod.uid.clone(),
        sandbox_id: pod.sandbox_id.clone(),
        labels: pod.labels.clone(),
        annotations: pod.annotations.clone(),
    })
}

/// The outcome as the hook protocol carries it.
pub fn outcome(outcome: &CallOutcome) -> hook::Outcome {
    match outcome {
        CallOutcome::Ok(_) => hook::Outcome {
            ok: true,
            code: 0,
            message: String::new(),
        },
        CallOutcome::Failed { code, message } => hook::Outcome {
            ok: false,
            code: *code as i32,
            message: message.clone(),
        },
    }
}

/// The pod sandbox view of a sandbox call.
pub fn sandbox_request(
    ctx: &HookContext,
    request: &LifecycleRequest,
) -> hook::PodSandboxHookRequest {
    hook::PodSandboxHookRequest {
        event: event(request.method()) as i32,
        pod: pod_metadata(ctx.pod.as_deref()),
        outcome: None,
    }
}

fn resources_view(resources: &cri::LinuxContainerResources) -> hook::LinuxResources {
    hook::LinuxResources {
        cpu_period: resources.cpu_period,
        cpu_quota: resources.cpu_quota,
        cpu_shares: resources.cpu_shares,
        memory_limit_in_bytes: resources.memory_limit_in_bytes,
        oom_score_adj: resources.oom_score_adj,
        cpuset_cpus: resources.cpuset_cpus.clone(),
        cpuset_mems: resources.cpuset_mems.clone(),
    }
}

fn write_resources(resources: &mut cri::LinuxContainerResources, view: &hook::LinuxResources) {
    resources.cpu_period = view.cpu_period;
    resources.cpu_quota = view.cpu_quota;
    resources.cpu_shares = view.cpu_shares;
    resources.memory_limit_in_bytes = view.memory_limit_in_bytes;
    resources.oom_score_adj = view.oom_score_adj;
    resources.cpuset_cpus.clone_from(&view.cpuset_cpus);
    resources.cpuset_mems.clone_from(&view.cpuset_mems);
}

/// The container view of a container call.
pub fn container_request(
    ctx: &HookContext,
    request: &LifecycleRequest,
) -> hook::ContainerHookRequest {
    let mut view = hook::ContainerHookRequest {
        event: event(request.method()) as i32,
        pod: pod_metadata(ctx.pod.as_deref()),
        container: ctx.container.as_ref().map(|c| hook::ContainerMetadata {
            name: c.name.clone(),
            id: c.id.clone(),
            attempt: 0,
        }),
        ..Default::default()
    };
    match request {
        LifecycleRequest::CreateContainer(req) => {
            if let Some(config) = &req.config {
                fill_from_config(&mut view, config);
            }
        }
        LifecycleRequest::UpdateContainerResources(req) => {
            view.resources = req.linux.as_ref().map(resources_view);
        }
        _ => {}
    }
    view
}

fn fill_from_config(view: &mut hook::ContainerHookRequest, config: &cri::ContainerConfig) {
    if let (Some(container), Some(metadata)) = (view.container.as_mut(), &config.metadata) {
        container.attempt = metadata.attempt;
    }
    view.envs = config
        .envs
        .iter()
        .map(|kv| hook::KeyValue {
            key: kv.key.clone(),
            value: kv.value.clone(),
        })
        .collect();
    view.devices = config
        .devices
        .iter()
        .map(|d| hook::DeviceNode {
            container_path: d.container_path.clone(),
            host_path: d.host_path.clone(),
            permissions: d.permissions.clone(),
        })
        .collect();
    view.mounts = config
        .mounts
        .iter()
        .map(|m| hook::Mount {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            readonly: m.readonly,
        })
        .collect();
    view.cdi_devices = config
        .cdi_devices
        .iter()
        .map(|c| hook::CdiDevice {
            name: c.name.clone(),
        })
        .collect();
    view.annotations = config.annotations.clone();
    view.resources = config
        .linux
        .as_ref()
        .and_then(|l| l.resources.as_ref())
        .map(resources_view);
    // The container's own flag, not the sandbox's: containerd gives host devices
    // only to a privileged container (and refuses one in an unprivileged sandbox).
    view.privileged = config
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .is_some_and(|s| s.privileged);
}

/// Applies a hook's container edits to the CRI request: everything for
/// CreateContainer, resources for UpdateContainerResources, nothing otherwise.
pub fn apply_container_edit(request: &mut LifecycleRequest, change: &hook::ContainerHookResponse) {
    match request {
        LifecycleRequest::CreateContainer(req) => {
            // Only the config's parts matter for writing back: no pod metadata, no request copy.
            let config = req.config.get_or_insert_with(Default::default);
            let mut view = hook::ContainerHookRequest::default();
            fill_from_config(&mut view, config);
            edit::apply(&mut view, change);
            write_back(config, &view);
        }
        LifecycleRequest::UpdateContainerResources(req) => {
            if let Some(overrides) = &change.resources {
                let resources = req.linux.get_or_insert_with(Default::default);
                let mut view = resources_view(resources);
                edit::override_resources(&mut view, overrides);
                write_resources(resources, &view);
            }
        }
        _ => {}
    }
}

/// Writes the edited view onto the CRI config, keeping each CRI entry's own
/// fields (mount propagation, SELinux relabel, …) where the entry is unchanged.
fn write_back(config: &mut cri::ContainerConfig, view: &hook::ContainerHookRequest) {
    config.envs = view
        .envs
        .iter()
        .map(|kv| cri::KeyValue {
            key: kv.key.clone(),
            value: kv.value.clone(),
        })
        .collect();
    config.devices = view
        .devices
        .iter()
        .map(|d| cri::Device {
            container_path: d.container_path.clone(),
            host_path: d.host_path.clone(),
            permissions: d.permissions.clone(),
        })
        .collect();
    let original = std::mem::take(&mut config.mounts);
    config.mounts = view
        .mounts
        .iter()
        .map(|m| {
            original
                .iter()
                .find(|o| {
                    o.container_path == m.container_path
                        && o.host_path == m.host_path
                        && o.readonly == m.readonly
                })
                .cloned()
                .unwrap_or_else(|| cri::Mount {
                    container_path: m.container_path.clone(),
                    host_path: m.host_path.clone(),
                    readonly: m.readonly,
                    ..Default::default()
                })
        })
        .collect();
    config.cdi_devices = view
        .cdi_devices
        .iter()
        .map(|c| cri::CdiDevice {
            name: c.name.clone(),
        })
        .collect();
    config.annotations.clone_from(&view.annotations);
    if let Some(resources) = &view.resources {
        let linux = config.linux.get_or_insert_with(Default::default);
        write_resources(
            linux.resources.get_or_insert_with(Default::default),
            resources,
        );
    }
}

/// Applies a hook's sandbox edits to RunPodSandbox (annotations); nothing otherwise.
pub fn apply_sandbox_edit(request: &mut LifecycleRequest, change: &hook::PodSandboxHookResponse) {
    if let LifecycleRequest::RunPodSandbox(req) = request {
        if let Some(config) = req.config.as_mut() {
            for key in &change.remove_annotations {
                config.annotations.remove(key);
            }
            for (key, value) in &change.set_annotations {
                config.annotations.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create() -> LifecycleRequest {
        LifecycleRequest::CreateContainer(cri::CreateContainerRequest {
            pod_sandbox_id: "s".into(),
            config: Some(cri::ContainerConfig {
                envs: vec![cri::KeyValue {
                    key: "A".into(),
                    value: "1".into(),
                }],
                mounts: vec![cri::Mount {
                    container_path: "/data".into(),
                    host_path: "/srv".into(),
                    propagation: cri::MountPropagation::PropagationHostToContainer as i32,
                    selinux_relabel: true,
                    ..Default::default()
                }],
                linux: Some(cri::LinuxContainerConfig {
                    resources: Some(cri::LinuxContainerResources {
                        cpu_shares: 2,
                        hugepage_limits: vec![cri::HugepageLimit {
                            page_size: "2MB".into(),
                            limit: 4,
                        }],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            sandbox_config: None,
        })
    }

    #[test]
    fn an_empty_edit_changes_nothing() {
        let original = create();
        let mut request = original.clone();
        apply_container_edit(&mut request, &hook::ContainerHookResponse::default());
        assert_eq!(request, original);
    }

    #[test]
    fn edits_land_and_cri_only_fields_survive() {
        let mut request = create();
        let change = hook::ContainerHookResponse {
            set_envs: vec![hook::KeyValue {
                key: "B".into(),
                value: "2".into(),
            }],
            add_devices: vec![hook::DeviceNode {
                container_path: "/dev/nvidia0".into(),
                host_path: "/dev/nvidia0".into(),
                permissions: "rwm".into(),
            }],
            add_cdi_devices: vec![hook::CdiDevice {
                name: "nvidia.com/gpu=GPU-1".into(),
            }],
            resources: Some(hook::LinuxResources {
                cpu_quota: 50_000,
                ..Default::default()
            }),
            ..Default::default()
        };
        apply_container_edit(&mut request, &change);
        let LifecycleRequest::CreateContainer(req) = request else {
            unreachable!()
        };
        let config = req.config.expect("config");
        assert_eq!(config.envs.len(), 2);
        assert_eq!(config.devices[0].container_path, "/dev/nvidia0");
        assert_eq!(config.cdi_devices[0].name, "nvidia.com/gpu=GPU-1");
        assert!(
            config.mounts[0].selinux_relabel,
            "mount fields unknown to the hook view survive"
        );
        let resources = config.linux.and_then(|l| l.resources).expect("resources");
        assert_eq!((resources.cpu_shares, resources.cpu_quota), (2, 50_000));
        assert_eq!(resources.hugepage_limits.len(), 1);
    }
}
