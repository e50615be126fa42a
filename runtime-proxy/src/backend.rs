//! The way to the runtime: one HTTP/2 connection per unix socket, redialed by itself.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::net::UnixStream;
use tonic::Code;

use crate::body::{ProxyBody, full_body};
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
    sender: Arc<Mutex<Option<SendRequest<ProxyBody>>>>,
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

    fn cached(&self) -> Option<SendRequest<ProxyBody>> {
        let guard = self
            .sender
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        guard.as_ref().filter(|sender| !sender.is_closed()).cloned()
    }

    async fn dial(&self) -> Result<SendRequest<ProxyBody>, BackendError> {
        let unavailable = |error: &dyn std::fmt::Display| BackendError {
            code: Code::Unavailable,
            message: format!(
                "connection error: dial unix {}: {error}",
                self.path.display()
            ),
        };
        let io = connect_unix(&self.path)
            .await
            .map_err(|e| unavailable(&e))?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            // Large receive windows: a big ListContainers answer never waits on WINDOW_UPDATE.
            .initial_stream_window_size(RECEIVE_WINDOW)
            .initial_connection_window_size(RECEIVE_WINDOW * 4)
            .handshake(io)
            .await
            .map_err(|e| unavailable(&e))?;
        let path = Arc::clone(&self.path);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(socket = %path.display(), %error, "runtime connection ended");
            }
        });
        self.metrics.backend_connects.inc();
        tracing::debug!(socket = %self.path.display(), "connected to runtime");
        *self
            .sender
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(sender.clone());
        Ok(sender)
    }

    /// Sends one HTTP/2 request to the runtime; headers and body pass as they are.
    pub async fn send(
        &self,
        request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, BackendError> {
        let mut sender = match self.cached() {
            Some(sender) => sender,
            None => self.dial().await?,
        };
        if sender.ready().await.is_err() {
            // The connection died since it was cached: one fresh dial.
            sender = self.dial().await?;
            sender.ready().await.map_err(|error| self.error(&error))?;
        }
        sender
            .send_request(request)
            .await
            .map_err(|error| self.error(&error))
    }

    fn error(&self, error: &hyper::Error) -> BackendError {
        let mut message = String::new();
        let mut source: Option<&dyn std::error::Error> = Some(error);
        while let Some(cause) = source {
            if !message.is_empty() {
                message.push_str(": ");
            }
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        BackendError {
            code: Code::Unavailable,
            message: format!("runtime {}: {message}", self.path.display()),
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
        let request = Request::post(path)
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
