//! The plugin's two sockets: the DRA service in kubelet's plugin directory
//! (`<plugins>/gpu.tessera.io/dra.sock`) and the registration service in its
//! plugin-watcher directory (`<registry>/gpu.tessera.io-reg.sock`), which kubelet
//! finds, asks for the plugin's name, endpoint and versions, and tells whether it
//! registered it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::pin::Pin;
use std::task::{Context, Poll};

use tessera_api::dra::DRIVER;
use tessera_http2::authority::{KubeletStream, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};

use crate::plugin::{DraService, Plugin};
use crate::proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, registration_server,
};

/// kubelet's plugin type for DRA drivers.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA service versions served: kubelet's `v1.DRAPlugin`.
pub const SUPPORTED_VERSIONS: &[&str] = &["v1.DRAPlugin"];

/// Where kubelet looks and where the plugin serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sockets {
    /// The DRA service's socket.
    pub dra: PathBuf,
    /// The registration socket.
    pub registration: PathBuf,
}

impl Sockets {
    /// Under kubelet's `plugins` and `plugins_registry` directories.
    pub fn under(plugins_dir: &Path, registry_dir: &Path) -> Self {
        Self {
            dra: plugins_dir.join(DRIVER).join("dra.sock"),
            registration: registry_dir.join(format!("{DRIVER}-reg.sock")),
        }
    }
}

/// The registration service.
#[derive(Debug, Clone)]
pub struct Registration {
    endpoint: String,
}

#[tonic::async_trait]
impl registration_server::Registration for Registration {
    async fn get_info(
        &self,
        _request: Request<InfoRequest>,
    ) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = DRIVER, "kubelet registered the plugin");
        } else {
            tracing::error!(driver = DRIVER, error = %status.error, "kubelet refused the plugin");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// A kubelet connection through the `:authority` pass: kubelet's plugin watcher
/// (1.36 too) sends the socket's path as `:authority`, which h2 refuses, failing
/// `GetInfo` with PROTOCOL_ERROR.
#[derive(Debug)]
struct KubeletIo(KubeletStream<UnixStream>);

impl Connected for KubeletIo {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for KubeletIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for KubeletIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// kubelet's connections on `listener`, each through the pass.
fn kubelet_connections(
    listener: UnixListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<KubeletIo>> {
    UnixListenerStream::new(listener).map(|c| c.map(|s| KubeletIo(KubeletStream::new(s))))
}

/// A tonic server whose h2 settings are those the pass reads frames by.
fn builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_frame_size(Some(MAX_FRAME_SIZE as u32))
        .http2_max_header_list_size(Some(MAX_HEADER_LIST_SIZE as u32))
}

/// The inode at `path`, if any.
fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

/// Binds `path` afresh: a socket left by an earlier run is removed (binding
/// over it fails), its directory made.
fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
        _ => {}
    }
    UnixListener::bind(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Serves `plugin` and GPU `health` on `sockets` until `shutdown` completes. The DRA socket is
/// bound before the registration socket, so kubelet never finds the plugin
/// before it can call it; the registration socket is removed on the way out so
/// that kubelet deregisters the plugin.
pub async fn serve(
    plugin: Arc<Plugin>,
    health: crate::health::HealthService,
    sockets: &Sockets,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let dra = bind(&sockets.dra)?;
    let registration = bind(&sockets.registration)?;
    let bound = inode(&sockets.registration);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let dra_server = builder()
        .add_service(DraService::new(plugin).into_server())
        .add_service(health.into_server())
        .serve_with_incoming_shutdown(kubelet_connections(dra), wait(stopped.clone()));
    let registration_server = builder()
        .add_service(registration_server::RegistrationServer::new(Registration {
            endpoint: sockets.dra.display().to_string(),
        }))
        .serve_with_incoming_shutdown(kubelet_connections(registration), wait(stopped));
    tracing::info!(
        dra = %sockets.dra.display(),
        registration = %sockets.registration.display(),
        "kubelet plugin serving"
    );
    let signal = async move {
        shutdown.await;
        let _ = stop.send(true);
    };
    let (dra_result, registration_result, ()) =
        tokio::join!(dra_server, registration_server, signal);
    // Only our own socket: a successor may have bound the path already.
    if bound.is_some() && inode(&sockets.registration) == bound {
        let _ = std::fs::remove_file(&sockets.registration);
    }
    dra_result
        .and(registration_result)
        .map_err(std::io::Error::other)
}
