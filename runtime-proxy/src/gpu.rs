//! The GPU hook embedded in the proxy: no extra hop, same rewrite as `tessera-gpu-hook`.

use std::sync::Arc;

use async_trait::async_trait;
use tessera_api::DeviceAllocations;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hooks::gpu::{BookEntry, NodeBook};
use tessera_hooks::server::{ContainerHook, GpuHook};
use tonic::Code;

use crate::convert;
use crate::hook::{Hook, HookContext, HookRejection, LifecycleRequest};
use crate::store::PodStore;

/// Runs the GPU rewrite at PreCreateContainer.
#[derive(Debug, Clone)]
pub struct EmbeddedGpuHook {
    hook: Arc<GpuHook>,
    store: Option<Arc<PodStore>>,
}

impl EmbeddedGpuHook {
    /// Embeds `hook`.
    pub fn new(hook: GpuHook) -> Self {
        Self {
            hook: Arc::new(hook),
            store: None,
        }
    }

    /// Checks every GPU grant against the node's live pods in `store` (the
    /// proxy's): a GPU another pod holds, through Tessera or a device plugin, is
    /// never given again.
    pub fn with_store(mut self, store: Arc<PodStore>) -> Self {
        self.store = Some(store);
        self
    }
}

/// The node's one book from the proxy's live pods: their UIDs, and the GPUs
/// Tessera's allocations give them.
pub fn node_book(store: &PodStore) -> NodeBook {
    let mut book = NodeBook::default();
    for pod in store.live_pods() {
        book.live_pods.insert(pod.uid.clone());
        let Some(Ok(allocations)) = pod
            .annotations
            .get(DEVICE_ALLOCATED)
            .map(|a| DeviceAllocations::parse(a))
        else {
            continue;
        };
        book.allocated.extend(
            allocations
                .gpus()
                .iter()
                .filter(|gpu| !gpu.id.is_empty())
                .map(|gpu| BookEntry {
                    uuid: gpu.id.clone(),
                    pod_uid: pod.uid.clone(),
                    pod: pod.display_name(),
                }),
        );
    }
    book
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
            let book = self.store.as_deref().map(node_book);
            // The node probe reads NVML, /dev and /proc: off the async thread.
            tokio::task::spawn_blocking(move || hook.pre_container_in(&view, book))
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
