//! Serving a container hook over `tessera.hook.v1`: a domain trait
//! ([`ContainerHook`]) and a thin wrapper implementing the generated server trait
//! ([`HookServer`]). The GPU hook implements it (`tessera_hooks::server::GpuHook`);
//! so can any other hook written in Rust.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::hook::v1::hook_server;
use crate::hook::v1::{
    ContainerHookRequest, ContainerHookResponse, PodSandboxHookRequest, PodSandboxHookResponse,
    PostHookResponse,
};

/// A hook that edits containers before they are created.
pub trait ContainerHook: Send + Sync + 'static {
    /// The hook's failures, as the gRPC status the proxy receives.
    type Error: Into<Status>;

    /// Edits for the container at a Pre stage.
    fn pre_container(
        &self,
        request: &ContainerHookRequest,
    ) -> Result<ContainerHookResponse, Self::Error>;
}

/// The generated `tessera.hook.v1.Hook` service over a [`ContainerHook`].
#[derive(Debug)]
pub struct HookServer<H> {
    hook: Arc<H>,
}

impl<H> HookServer<H> {
    /// Serves `hook`.
    pub fn new(hook: H) -> Self {
        Self {
            hook: Arc::new(hook),
        }
    }
}

#[tonic::async_trait]
impl<H: ContainerHook> hook_server::Hook for HookServer<H> {
    async fn pre_pod_sandbox(
        &self,
        _request: Request<PodSandboxHookRequest>,
    ) -> Result<Response<PodSandboxHookResponse>, Status> {
        Ok(Response::new(PodSandboxHookResponse::default()))
    }

    async fn post_pod_sandbox(
        &self,
        _request: Request<PodSandboxHookRequest>,
    ) -> Result<Response<PostHookResponse>, Status> {
        Ok(Response::new(PostHookResponse {}))
    }

    async fn pre_container(
        &self,
        request: Request<ContainerHookRequest>,
    ) -> Result<Response<ContainerHookResponse>, Status> {
        let hook = Arc::clone(&self.hook);
        let request = request.into_inner();
        // The probe reads /dev and /proc: off the async threads.
        let edit =
            tokio::task::spawn_blocking(move || hook.pre_container(&request).map_err(Into::into))
                .await
                .map_err(|e| Status::internal(format!("hook task failed: {e}")))??;
        Ok(Response::new(edit))
    }

    async fn post_container(
        &self,
        _request: Request<ContainerHookRequest>,
    ) -> Result<Response<PostHookResponse>, Status> {
        Ok(Response::new(PostHookResponse {}))
    }
}
