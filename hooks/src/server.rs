//! The GPU hook as a [`ContainerHook`]: it probes the node and rewrites the
//! container; `tessera_hook_protocol::server` serves it over `tessera.hook.v1`.

use std::sync::Arc;

use tessera_hook_protocol::hook::v1::{ContainerHookRequest, ContainerHookResponse};
use tonic::Status;

use crate::gpu::{GpuHookConfig, GpuHookError, NodeBook, NodeDevices, PrivilegedPolicy, rewrite};
use crate::probe::DeviceProbe;
use tessera_hook_protocol::server::ContainerHook;

/// The GPU hook: probes the node and rewrites the container.
#[derive(Debug, Clone)]
pub struct GpuHook {
    config: GpuHookConfig,
    probe: Arc<dyn DeviceProbe>,
}

impl GpuHook {
    /// A GPU hook with `config`, reading the node through `probe`.
    pub fn new(config: GpuHookConfig, probe: Arc<dyn DeviceProbe>) -> Self {
        Self { config, probe }
    }

    /// Its settings.
    pub fn config(&self) -> &GpuHookConfig {
        &self.config
    }

    /// Whether the rewrite of `request` reads the node (blocking I/O); when it
    /// does not, [`ContainerHook::pre_container`] is cheap enough for an async thread.
    /// A privileged container needs it unless privileged containers are allowed:
    /// whether the node has GPUs, and the device plugin's grants, decide it.
    pub fn needs_probe(&self, request: &ContainerHookRequest) -> bool {
        crate::gpu::allocation_of(request).is_some()
            || crate::gpu::requested_gpus(request).is_some()
            || crate::gpu::asks_for_nvidia_cdi(request, &self.config)
            || (request.privileged && self.config.privileged != PrivilegedPolicy::Allow)
    }
}

impl ContainerHook for GpuHook {
    type Error = GpuHookError;

    fn pre_container(
        &self,
        request: &ContainerHookRequest,
    ) -> Result<ContainerHookResponse, GpuHookError> {
        self.pre_container_in(request, None)
    }
}

impl GpuHook {
    /// [`ContainerHook::pre_container`], checking every GPU grant against `book`
    /// (the node's live pods and Tessera's allocations) when the caller has it:
    /// the runtime proxy does; an external hook server does not.
    pub fn pre_container_in(
        &self,
        request: &ContainerHookRequest,
        book: Option<NodeBook>,
    ) -> Result<ContainerHookResponse, GpuHookError> {
        if request.event != tessera_hook_protocol::hook::v1::Event::CreateContainer as i32 {
            return Ok(ContainerHookResponse::default());
        }
        // NVML, /dev and the checkpoint are read only for containers that name GPUs.
        let node = if self.needs_probe(request) {
            NodeDevices {
                book,
                ..self.probe.probe()
            }
        } else {
            NodeDevices::default()
        };
        let edit = rewrite(request, &node, &self.config)?;
        // A bind mount's source must exist before the runtime mounts it.
        crate::gpu::enforce::prepare_host(&edit, &self.config.enforcement).map_err(|error| {
            GpuHookError::Device {
                pod: request
                    .pod
                    .as_ref()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .unwrap_or_default(),
                container: request
                    .container
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_default(),
                path: "HAMi-core region".into(),
                problem: error.to_string(),
            }
        })?;
        Ok(edit)
    }
}

impl From<GpuHookError> for Status {
    fn from(error: GpuHookError) -> Self {
        match error {
            GpuHookError::Annotation { .. } | GpuHookError::EnvConflict { .. } => {
                Status::invalid_argument(error.to_string())
            }
            GpuHookError::Device { .. }
            | GpuHookError::Checkpoint { .. }
            | GpuHookError::Taken { .. }
            | GpuHookError::TesseraClaim { .. } => Status::failed_precondition(error.to_string()),
            // The node's policy, not the request's shape, refuses it.
            GpuHookError::Privileged { .. } | GpuHookError::DraClaim { .. } => {
                Status::permission_denied(error.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tessera_api::resources::DEVICE_ALLOCATED;
    use tessera_hook_protocol::hook::v1::{Event, PodMetadata};

    use super::*;
    use crate::gpu::{GpuDevice, PluginGrants};

    /// Counts probes; the node it reports has one GPU.
    #[derive(Debug, Default)]
    struct CountingProbe(AtomicUsize);

    impl DeviceProbe for CountingProbe {
        fn probe(&self) -> NodeDevices {
            self.0.fetch_add(1, Ordering::SeqCst);
            NodeDevices {
                gpus: Some(vec![GpuDevice {
                    uuid: "GPU-a".into(),
                    minor: 0,
                    memory_bytes: Some(16 << 30),
                }]),
                nodes: ["nvidia0", "nvidiactl"].map(String::from).into(),
                plugin_grants: PluginGrants::NoCheckpoint,
                book: None,
            }
        }
    }

    fn create(annotations: HashMap<String, String>) -> ContainerHookRequest {
        ContainerHookRequest {
            event: Event::CreateContainer as i32,
            pod: Some(PodMetadata {
                name: "p".into(),
                namespace: "ns".into(),
                annotations,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_node_is_probed_only_for_pods_given_gpus() -> Result<(), GpuHookError> {
        let probe = Arc::new(CountingProbe::default());
        let hook = GpuHook::new(GpuHookConfig::default(), probe.clone());

        let plain = create(HashMap::new());
        assert!(!hook.needs_probe(&plain));
        hook.pre_container(&plain)?;
        assert_eq!(probe.0.load(Ordering::SeqCst), 0);

        let annotation = r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}]}"#;
        let given = create(HashMap::from([(
            DEVICE_ALLOCATED.to_owned(),
            annotation.to_owned(),
        )]));
        assert!(hook.needs_probe(&given));
        let edit = hook.pre_container(&given)?;
        assert_eq!(probe.0.load(Ordering::SeqCst), 1);
        assert!(
            edit.set_envs.iter().any(|kv| kv.value == "GPU-a"),
            "{edit:?}"
        );
        Ok(())
    }

    #[test]
    fn a_privileged_container_is_checked_against_the_node() {
        let probe = Arc::new(CountingProbe::default());
        let hook = GpuHook::new(GpuHookConfig::default(), probe.clone());
        let mut privileged = create(HashMap::new());
        privileged.privileged = true;
        assert!(
            hook.needs_probe(&privileged),
            "whether the node has GPUs decides"
        );
        // Asks for no GPU: runs (voided) under the default policy, after the probe.
        assert!(hook.pre_container(&privileged).is_ok());
        assert_eq!(probe.0.load(Ordering::SeqCst), 1);

        let allow = GpuHook::new(
            GpuHookConfig {
                privileged: PrivilegedPolicy::Allow,
                ..GpuHookConfig::default()
            },
            probe,
        );
        assert!(!allow.needs_probe(&privileged));
    }
}
