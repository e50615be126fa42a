//! The listening socket, the accept loop and graceful draining.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::UnixListener;

use crate::proxy::Proxy;

/// Where the listening socket came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListenerSource {
    /// Passed by systemd socket activation.
    Systemd,
    /// Bound by the proxy itself.
    Bound,
}

/// Takes the socket systemd passed (`LISTEN_FDS`), or binds `path` with mode 0660,
/// creating its directory and replacing a stale socket.
pub fn listen(path: &Path) -> io::Result<(UnixListener, ListenerSource)> {
    let mut fds = listenfd::ListenFd::from_env();
    if let Some(listener) = fds.take_unix_listener(0)? {
        listener.set_nonblocking(true)?;
        return Ok((UnixListener::from_std(listener)?, ListenerSource::Systemd));
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ));
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok((listener, ListenerSource::Bound))
}

/// Serves kubelet on `listener` until `shutdown` resolves, then stops accepting and
/// waits up to `drain` for in-flight calls.
pub async fn serve(
    listener: UnixListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    // Kubelet multiplexes every CRI call on one connection.
    builder.max_concurrent_streams(Some(1000));
    builder.initial_stream_window_size(crate::backend::RECEIVE_WINDOW);
    builder.initial_connection_window_size(crate::backend::RECEIVE_WINDOW * 4);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let proxy = Arc::clone(&proxy);
                    let service = hyper::service::service_fn(move |request| {
                        let proxy = Arc::clone(&proxy);
                        async move { Ok::<_, std::convert::Infallible>(proxy.handle(request).await) }
                    });
                    let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
                    tokio::spawn(async move {
                        if let Err(error) = connection.await {
                            tracing::debug!(%error, "kubelet connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(
        drain_secs = drain.as_secs(),
        "shutting down: draining in-flight calls"
    );
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out; closing remaining connections");
    }
}
