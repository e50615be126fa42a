//! The GPU hook embedded in the proxy: no extra hop, same rewrite as `tessera-gpu-hook`.

use std::sync::Arc;

use async_trait::async_trait;
use tessera_hooks::server::{ContainerHook, GpuHook};
use tonic::Code;

use crate::convert;
use crate::hook::{Hook, HookContext, HookRejection, LifecycleRequest};

/// Runs the GPU rewrite at PreCreateContainer.
#[derive(Debug, Clone)]
pub struct EmbeddedGpuHook {
    hook: Arc<GpuHook>,
}

impl EmbeddedGpuHook {
    /// Embeds `hook`.
    pub fn new(hook: GpuHook) -> Self {
        Self {
            hook: Arc::new(hook),
        }
    }
}

#[async_trait]
impl Hook for EmbeddedGpuHook {
    fn name(&self) -> &str {
        "gpu"
    }

    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        if !matches!(request, LifecycleRequest::CreateContainer(_)) {
            return Ok(());
        }
        let view = convert::container_request(ctx, request);
        let edit = if self.hook.needs_probe(&view) {
            let hook = Arc::clone(&self.hook);
            // The node probe reads NVML, /dev and /proc: off the async thread.
            tokio::task::spawn_blocking(move || hook.pre_container(&view))
                .await
                .map_err(|e| {
                    HookRejection::new(Code::Internal, format!("GPU hook task failed: {e}"))
                })?
        } else {
            self.hook.pre_container(&view)
        };
        let edit = edit.map_err(|error| {
            let status: tonic::Status = error.into();
            HookRejection::new(status.code(), status.message())
        })?;
        convert::apply_container_edit(request, &edit);
        Ok(())
    }
}
