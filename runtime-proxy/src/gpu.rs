//! The GPU hook embedded in the proxy: no extra hop, same rewrite as `tessera-gpu-hook`.

use std::sync::Arc;

use async_trait::async_trait;
use tessera_api::DeviceAllocations;
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hook_protocol::server::ContainerHook;
use tessera_hooks::gpu::{BookEntry, NodeBook};
use tessera_hooks::server::GpuHook;
use tonic::Code;

use crate::backend::Backend;
use crate::convert;
use crate::hook::{Hook, HookContext, HookRejection, LifecycleRequest};
use crate::store::PodStore;
use k8s_cri::v1 as cri;
use tessera_hooks::gpu::GpuHookError;

/// Runs the GPU rewrite at PreCreateContainer.
#[derive(Debug, Clone)]
pub struct EmbeddedGpuHook {
    hook: Arc<GpuHook>,
    store: Option<Arc<PodStore>>,
    runtime: Option<Backend>,
}

impl EmbeddedGpuHook {
    /// Embeds `hook`.
    pub fn new(hook: GpuHook) -> Self {
        Self {
            hook: Arc::new(hook),
            store: None,
            runtime: None,
        }
    }

    /// Checks every GPU grant against the node's live pods in `store` (the
    /// proxy's): a GPU another pod holds, through Tessera or a device plugin, is
    /// never given again.
    pub fn with_store(mut self, store: Arc<PodStore>, runtime: Backend) -> Self {
        self.store = Some(store);
        self.runtime = Some(runtime);
        self
    }

    /// Brings the store in line with the runtime's sandboxes, before a refusal
    /// that names another pod: the proxy may have missed its removal.
    async fn reconcile(&self) -> bool {
        let (Some(store), Some(runtime)) = (&self.store, &self.runtime) else {
            return false;
        };
        let listed: Result<cri::ListPodSandboxResponse, _> = runtime
            .unary(
                "/runtime.v1.RuntimeService/ListPodSandbox",
                &cri::ListPodSandboxRequest::default(),
            )
            .await;
        match listed {
            Ok(listed) => {
                store.reconcile(&listed.items);
                true
            }
            Err(error) => {
                tracing::warn!(error = %error.message, "listing the runtime's sandboxes to confirm a refusal failed");
                false
            }
        }
    }
}

impl EmbeddedGpuHook {
    /// The rewrite with the node probed (NVML, /dev, /proc: off the async thread),
    /// checked against the store's book.
    async fn probed(
        &self,
        view: Arc<tessera_hook_protocol::hook::v1::ContainerHookRequest>,
    ) -> Result<
        Result<tessera_hook_protocol::hook::v1::ContainerHookResponse, GpuHookError>,
        HookRejection,
    > {
        let hook = Arc::clone(&self.hook);
        let book = self.store.as_deref().map(node_book);
        tokio::task::spawn_blocking(move || hook.pre_container_in(&view, book))
            .await
            .map_err(|e| HookRejection::new(Code::Internal, format!("GPU hook task failed: {e}")))
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
            let view = Arc::new(view);
            let mut edit = self.probed(Arc::clone(&view)).await?;
            // A GPU held by another pod: confirm that pod is still there first.
            if matches!(edit, Err(GpuHookError::Taken { .. })) && self.reconcile().await {
                edit = self.probed(view).await?;
            }
            edit
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
