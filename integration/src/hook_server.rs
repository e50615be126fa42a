//! `tessera.hook.v1` servers on unix sockets, for tests and benchmarks.

use std::path::Path;

use tessera_hook_protocol::hook::v1::hook_server::HookServer as GeneratedServer;
use tessera_hook_protocol::hook::v1::{ContainerHookRequest, ContainerHookResponse};
use tessera_hook_protocol::server::{ContainerHook, HookServer};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;

/// A hook server task; aborted on drop.
#[derive(Debug)]
pub struct RunningHookServer(JoinHandle<()>);

impl Drop for RunningHookServer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `hook` on `socket`.
pub fn serve(socket: &Path, hook: impl ContainerHook) -> anyhow::Result<RunningHookServer> {
    let listener = UnixListener::bind(socket)?;
    let service = GeneratedServer::new(HookServer::new(hook));
    Ok(RunningHookServer(tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await;
    })))
}

/// A hook made of a function.
pub struct FnHook<F>(pub F);

impl<F> std::fmt::Debug for FnHook<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnHook")
    }
}

impl<F> ContainerHook for FnHook<F>
where
    F: Fn(&ContainerHookRequest) -> Result<ContainerHookResponse, tonic::Status>
        + Send
        + Sync
        + 'static,
{
    type Error = tonic::Status;

    fn pre_container(
        &self,
        request: &ContainerHookRequest,
    ) -> Result<ContainerHookResponse, tonic::Status> {
        (self.0)(request)
    }
}
