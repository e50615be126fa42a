//! The way to the runtime: one HTTP/2 connection per unix socket, redialed by itself.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use h2::client::SendRequest;
use http::{Request, Response};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use prost::Message;
use tokio::net::UnixStream;
use tonic::Code;

use crate::body::{Prefetched, ProxyBody, RecvBody, full_body};
use crate::grpc;
use crate::metrics::Metrics;

/// How long the proxy's own lookups (store rebuild, pod of a container) may take.
pub const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// HTTP/2 receive window per stream, both towards kubelet and towards the runtime.
pub const RECEIVE_WINDOW: u32 = 4 << 20;

/// Connects to a unix socket; the one connector every Tessera client uses.
pub async fn connect_unix(path: &Path) -> io::Result<TokioIo<UnixStream>> {
    UnixStream::connect(path).await.map(TokioIo::new)
}

/// Why a call could not reach the runtime or come back from it.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    /// The gRPC code the caller gets, as a direct client would.
    pub code: Code,
    /// What went wrong, naming the socket.
    pub message: String,
}

/// The runtime's HTTP/2 endpoint: one multiplexed connection, dialed lazily and
/// redialed when it closes (containerd restarted).
#[derive(Debug, Clone)]
pub struct Backend {
    path: Arc<PathBuf>,
    metrics: Arc<Metrics>,
    // Held only to clone or replace the sender, never across an await.
    sender: Arc<Mutex<Option<Connection>>>,
}

/// One dialed connection: its request handle and whether its driver task ended.
#[derive(Debug, Clone)]
struct Connection {
    sender: SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
}

impl Backend {
    /// A client for the runtime at `path`; it dials on first use.
    pub fn new(path: impl Into<PathBuf>, metrics: Arc<Metrics>) -> Self {
        Self {
            path: Arc::new(path.into()),
            metrics,
            sender: Arc::new(Mutex::new(None)),
        }
    }

    /// The socket this backend dials.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn cached(&self) -> Option<SendRequest<Bytes>> {
        let guard = tessera_daemon::sync::lock(&self.sender);
        guard
            .as_ref()
            .filter(|connection| !connection.closed.load(Ordering::Acquire))
            .map(|connection| connection.sender.clone())
    }

    /// Boxed: dialing is rare, and its handshake state would otherwise sit in
    /// every call's future.
    fn dial(
        &self,
    ) -> Pin<Box<dyn Future<Output = Result<SendRequest<Bytes>, BackendError>> + Send + '_>> {
        Box::pin(self.dial_unboxed())
    }

    async fn dial_unboxed(&self) -> Result<SendRequest<Bytes>, BackendError> {
        let unavailable = |error: &dyn std::fmt::Display| BackendError {
            code: Code::Unavailable,
            message: format!(
                "connection error: dial unix {}: {error}",
                self.path.display()
            ),
        };
        let io = UnixStream::connect(&*self.path)
            .await
            .map_err(|e| unavailable(&e))?;
        let (sender, connection) = h2::client::Builder::new()
            // Large receive windows: a big ListContainers answer never waits on WINDOW_UPDATE.
            .initial_window_size(RECEIVE_WINDOW)
            .initial_connection_window_size(RECEIVE_WINDOW * 4)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|e| unavailable(&e))?;
        let closed = Arc::new(AtomicBool::new(false));
        let path = Arc::clone(&self.path);
        let ended = Arc::clone(&closed);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(socket = %path.display(), %error, "runtime connection ended");
            }
            ended.store(true, Ordering::Release);
        });
        self.metrics.backend_connects.inc();
        tracing::debug!(socket = %self.path.display(), "connected to runtime");
        *tessera_daemon::sync::lock(&self.sender) = Some(Connection {
            sender: sender.clone(),
            closed,
        });
        Ok(sender)
    }

    /// Sends one HTTP/2 request to the runtime; headers and body pass as they are.
    /// Whatever of the body is already here leaves with the headers in one write.
    pub async fn send(
        &self,
        request: Request<ProxyBody>,
    ) -> Result<Response<RecvBody>, BackendError> {
        let sender = match self.cached() {
            Some(sender) => sender,
            None => self.dial().await?,
        };
        let mut sender = match sender.ready().await {
            Ok(sender) => sender,
            // The connection died since it was cached: one fresh dial.
            Err(_) => self
                .dial()
                .await?
                .ready()
                .await
                .map_err(|error| self.error(&error))?,
        };
        let (parts, body) = request.into_parts();
        let body = Prefetched::new(body);
        let end_of_stream = body.is_end_stream();
        let (response, mut stream) = sender
            .send_request(Request::from_parts(parts, ()), end_of_stream)
            .map_err(|error| self.error(&error))?;
        if !end_of_stream {
            let rest = body
                .send_ready(&mut stream)
                .map_err(|error| self.error(&error))?;
            if let Some(rest) = rest {
                tokio::spawn(crate::body::pipe(rest, stream));
            }
        }
        let response = response.await.map_err(|error| self.error(&error))?;
        Ok(response.map(RecvBody::new))
    }

    fn error(&self, error: &h2::Error) -> BackendError {
        BackendError {
            code: Code::Unavailable,
            message: format!("runtime {}: {error}", self.path.display()),
        }
    }

    /// Makes one unary gRPC call with typed messages; the proxy's own lookups use
    /// it. Bounded by [`LOOKUP_TIMEOUT`] so a hung runtime cannot hold a call forever.
    pub async fn unary<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        request: &Req,
    ) -> Result<Resp, BackendError> {
        tokio::time::timeout(LOOKUP_TIMEOUT, self.unary_unbounded(path, request))
            .await
            .unwrap_or_else(|_| {
                Err(BackendError {
                    code: Code::DeadlineExceeded,
                    message: format!(
                        "runtime {}: {path} took longer than {LOOKUP_TIMEOUT:?}",
                        self.path.display()
                    ),
                })
            })
    }

    async fn unary_unbounded<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        request: &Req,
    ) -> Result<Resp, BackendError> {
        let body = full_body(grpc::encode_frame(&request.encode_to_vec()), None);
        // HTTP/2 wants :scheme and :authority; "localhost" is what grpc-go sends on unix sockets.
        let request = Request::post(format!("http://localhost{path}"))
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(body)
            .map_err(|e| BackendError {
                code: Code::Internal,
                message: e.to_string(),
            })?;
        let response = self.send(request).await?;
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.map_err(|e| BackendError {
            code: Code::Unavailable,
            message: format!("runtime {}: reading response: {e}", self.path.display()),
        })?;
        let (code, message) = grpc::call_status(&parts.headers, collected.trailers());
        if code != Code::Ok {
            return Err(BackendError { code, message });
        }
        let bytes = collected.to_bytes();
        let message = grpc::decode_frame(&bytes).map_err(|e| BackendError {
            code: Code::Internal,
            message: format!("{path}: {e}"),
        })?;
        Resp::decode(message).map_err(|e| BackendError {
            code: Code::Internal,
            message: format!("{path}: {e}"),
        })
    }
}
