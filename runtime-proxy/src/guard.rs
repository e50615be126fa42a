//! External GPU hook mode fails closed: with the embedded GPU hook off
//! (`--no-gpu-hook`), a container that could see GPUs is created only while a
//! valid registration of the GPU hook (`--required-gpu-hook`, `gpu` by default:
//! systemd/hooks.d/10-gpu.toml) runs at PreCreateContainer with failure policy
//! Fail. A missing or invalid file is then a refusal naming it, never a GPU
//! container started without its rewrite.

use std::sync::Arc;

use async_trait::async_trait;
use tessera_hooks::gpu::{GpuHookConfig, could_see_gpus, has_gpu_nodes};
use tonic::Code;

use crate::convert;
use crate::external_hooks::{FailurePolicy, HookRegistry, StageKind};
use crate::hook::{Hook, HookContext, HookRejection, LifecycleRequest, Method};

/// Refuses GPU containers while the external GPU hook is not registered. A
/// privileged container counts only on a node with GPU device nodes under
/// `config.device_root` (`/dev`).
#[derive(Debug)]
pub struct ExternalGpuHookGuard {
    registry: Arc<HookRegistry>,
    name: String,
    config: GpuHookConfig,
}

impl ExternalGpuHookGuard {
    /// Guards containers behind the registration named `name` in `registry`.
    pub fn new(registry: Arc<HookRegistry>, name: impl Into<String>) -> Self {
        Self {
            registry,
            name: name.into(),
            config: GpuHookConfig::default(),
        }
    }

    /// Whether the GPU hook is registered to run, and to fail closed, where it must.
    fn registered(&self) -> bool {
        self.registry.hooks().iter().any(|hook| {
            hook.name == self.name
                && hook
                    .stages
                    .contains(&(StageKind::Pre, Method::CreateContainer))
                && hook.policy == FailurePolicy::Fail
        })
    }
}

#[async_trait]
impl Hook for ExternalGpuHookGuard {
    fn name(&self) -> &str {
        "external-gpu-hook-guard"
    }

    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        if !matches!(request, LifecycleRequest::CreateContainer(_)) || self.registered() {
            return Ok(());
        }
        let view = convert::container_request(ctx, request);
        // Whether the node has GPU device nodes decides only for a privileged
        // container: read then, off the async threads.
        let node_has_gpus = if view.privileged {
            let root = self.config.device_root.clone();
            tokio::task::spawn_blocking(move || {
                has_gpu_nodes(&tessera_hooks::probe::device_nodes(&root))
            })
            .await
            .unwrap_or(true)
        } else {
            false
        };
        if !could_see_gpus(&view, &self.config, node_has_gpus) {
            return Ok(());
        }
        Err(HookRejection::new(
            Code::FailedPrecondition,
            format!(
                "the embedded GPU hook is off (--no-gpu-hook) and no valid registration of the GPU hook {:?} runs at PreCreateContainer with failure_policy Fail in {}: a container that could see GPUs is not created without its rewrite (see the proxy's log for why the file was not used)",
                self.name,
                self.registry.dir().display()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use k8s_cri::v1 as cri;

    use super::*;
    use crate::store::PodInfo;

    fn create(envs: &[(&str, &str)]) -> LifecycleRequest {
        LifecycleRequest::CreateContainer(cri::CreateContainerRequest {
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: "main".into(),
                    attempt: 0,
                }),
                envs: envs
                    .iter()
                    .map(|(k, v)| cri::KeyValue {
                        key: (*k).into(),
                        value: (*v).into(),
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    fn ctx(annotations: &[(&str, &str)]) -> HookContext {
        HookContext {
            pod: Some(Arc::new(PodInfo {
                name: "p".into(),
                namespace: "ns".into(),
                annotations: annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect::<HashMap<_, _>>(),
                ..Default::default()
            })),
            container: None,
        }
    }

    #[tokio::test]
    async fn without_the_gpu_hooks_registration_gpu_containers_are_refused()
    -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let registry = HookRegistry::new(dir.path());
        let guard = ExternalGpuHookGuard::new(Arc::clone(&registry), "gpu");
        let allocated = ctx(&[(
            tessera_api::resources::DEVICE_ALLOCATED,
            r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":50,"koordinator.sh/gpu-memory-ratio":50}}]}"#,
        )]);
        // No registration: an allocated pod's container and one asking by env are refused.
        let refused = guard.pre(&allocated, &mut create(&[])).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|r| r.code == Code::FailedPrecondition && r.message.contains("\"gpu\"")),
            "{refused:?}"
        );
        assert!(
            guard
                .pre(&ctx(&[]), &mut create(&[("NVIDIA_VISIBLE_DEVICES", "all")]))
                .await
                .is_err()
        );
        // A container that could see no GPU is not the GPU hook's business.
        guard
            .pre(&ctx(&[]), &mut create(&[("PATH", "/bin")]))
            .await?;

        // An invalid file (Ignore policy) does not count; a valid one does.
        std::fs::write(
            dir.path().join("10-gpu.toml"),
            "name = \"gpu\"\nendpoint = \"/run/x.sock\"\nstages = [\"PreCreateContainer\"]\nfailure_policy = \"Ignore\"\n",
        )?;
        registry.reload_if_changed();
        assert!(guard.pre(&allocated, &mut create(&[])).await.is_err());
        std::fs::write(
            dir.path().join("10-gpu.toml"),
            "name = \"gpu\"\nendpoint = \"/run/x.sock\"\nstages = [\"PreCreateContainer\"]\nfailure_policy = \"Fail\"\n",
        )?;
        registry.reload_if_changed();
        guard.pre(&allocated, &mut create(&[])).await?;
        Ok(())
    }
}
