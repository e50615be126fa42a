//! The listening socket, the accept loop and graceful draining.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use http::{Request, Response};
use http_body::Body as _;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::body::{Prefetched, RecvBody};
use crate::proxy::Proxy;
use tessera_http2::authority::{self, KubeletStream};

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
    accept_until(listener, proxy, shutdown, drain, serve_connection).await;
}

/// The accept loop both paths share: each connection served by `connection`
/// until `shutdown` resolves; then `true` on the watch tells every connection to
/// stop taking calls, and they get up to `drain` to end.
pub(crate) async fn accept_until<F, Fut>(
    listener: UnixListener,
    proxy: Arc<Proxy>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
    connection: F,
) where
    F: Fn(UnixStream, Arc<Proxy>, watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Who is at the other end, read before the stream moves on;
                    // counted for as long as the connection is served.
                    let kubelet = proxy.kubelet_connections().cloned();
                    let peer = stream.peer_cred().ok().and_then(|c| c.pid());
                    let served = connection(stream, Arc::clone(&proxy), stopping.clone());
                    connections.spawn(async move {
                        let _kubelet = match kubelet {
                            Some(kubelet) => kubelet.accepted(peer).await,
                            None => None,
                        };
                        served.await;
                    });
                }
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            // Reap ended connections so the set does not grow with kubelet restarts.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(
        drain_secs = drain.as_secs(),
        "shutting down: draining in-flight calls"
    );
    let _ = stop.send(true);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!("drain timed out; closing remaining connections");
    }
}

/// The HTTP/2 server kubelet talks to.
pub(crate) fn kubelet_h2() -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        // Kubelet multiplexes every CRI call on one connection.
        .max_concurrent_streams(1000)
        .initial_window_size(crate::backend::RECEIVE_WINDOW)
        .initial_connection_window_size(crate::backend::RECEIVE_WINDOW * 4)
        // h2's defaults, named: the authority pass reads kubelet's frames by them.
        .header_table_size(authority::HEADER_TABLE_SIZE as u32)
        .max_frame_size(authority::MAX_FRAME_SIZE as u32)
        .max_header_list_size(authority::MAX_HEADER_LIST_SIZE as u32);
    builder
}

/// One kubelet connection: every CRI call is a stream on it, served on its own task.
/// It reaches h2 through the authority pass ([`KubeletStream`]). The frame relay
/// serves a connection this way when the runtime cannot be dialled for it.
pub(crate) async fn serve_connection(
    stream: UnixStream,
    proxy: Arc<Proxy>,
    mut stopping: watch::Receiver<bool>,
) {
    let handshake = kubelet_h2().handshake::<_, Bytes>(KubeletStream::new(stream));
    let mut connection = match handshake.await {
        Ok(connection) => connection,
        Err(error) => {
            tracing::debug!(%error, "kubelet connection failed its HTTP/2 handshake");
            return;
        }
    };
    let mut draining = *stopping.borrow();
    if draining {
        connection.graceful_shutdown();
    }
    loop {
        tokio::select! {
            next = connection.accept() => match next {
                Some(Ok((request, respond))) => {
                    tokio::spawn(serve_call(Arc::clone(&proxy), request, respond));
                }
                Some(Err(error)) => {
                    tracing::debug!(%error, "kubelet connection ended with an error");
                    return;
                }
                // After a graceful shutdown: every call on it has ended.
                None => return,
            },
            changed = stopping.changed(), if !draining => {
                // GOAWAY: no new calls; the connection stays polled until its calls end.
                draining = true;
                if changed.is_ok() {
                    connection.graceful_shutdown();
                }
            }
        }
    }
}

/// One CRI call: the proxy's answer goes back with every part that is ready in one
/// write. A reset from kubelet (deadline, cancel) drops the call, which cancels
/// it towards the runtime too.
async fn serve_call(
    proxy: Arc<Proxy>,
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    let call = proxy.handle(request.map(RecvBody::new));
    let response = tokio::select! {
        response = call => response,
        _ = std::future::poll_fn(|cx| respond.poll_reset(cx)) => return,
    };
    let (parts, body) = response.into_parts();
    let body = Prefetched::new(body);
    let end_of_stream = body.is_end_stream();
    let mut stream = match respond.send_response(Response::from_parts(parts, ()), end_of_stream) {
        Ok(stream) => stream,
        Err(error) => {
            tracing::debug!(%error, "answering kubelet failed");
            return;
        }
    };
    if end_of_stream {
        return;
    }
    match body.send_ready(&mut stream) {
        Ok(Some(rest)) => crate::body::pipe(rest, stream).await,
        Ok(None) => {}
        Err(error) => tracing::debug!(%error, "answering kubelet failed"),
    }
}
