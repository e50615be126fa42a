//! The way to the runtime: one HTTP/2 client per unix socket, reconnecting by itself.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::net::UnixStream;
use tonic::Code;

use crate::body::{ProxyBody, full_body};
use crate::grpc;
use crate::metrics::Metrics;

/// How long the proxy's own lookups (store rebuild, pod of a container) may take.
pub const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Connects to a unix socket; the one connector every Tessera client uses.
pub async fn connect_unix(path: &Path) -> io::Result<TokioIo<UnixStream>> {
    UnixStream::connect(path).await.map(TokioIo::new)
}

/// A `tower::Service<Uri>` that ignores the URI and dials a fixed unix socket.
#[derive(Debug, Clone)]
pub struct UnixConnector {
    path: Arc<PathBuf>,
    metrics: Arc<Metrics>,
}

impl tower::Service<Uri> for UnixConnector {
    type Response = TokioIo<UnixStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let path = Arc::clone(&self.path);
        let metrics = Arc::clone(&self.metrics);
        Box::pin(async move {
            let stream = connect_unix(&path).await?;
            metrics.backend_connects.inc();
            tracing::debug!(socket = %path.display(), "connected to runtime");
            Ok(stream)
        })
    }
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

/// The runtime's HTTP/2 endpoint.
#[derive(Debug, Clone)]
pub struct Backend {
    client: Client<UnixConnector, ProxyBody>,
    path: Arc<PathBuf>,
}

impl Backend {
    /// A client for the runtime at `path`; it dials lazily and redials after failures.
    pub fn new(path: impl Into<PathBuf>, metrics: Arc<Metrics>) -> Self {
        let path = Arc::new(path.into());
        let connector = UnixConnector {
            path: Arc::clone(&path),
            metrics,
        };
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build(connector);
        Self { client, path }
    }

    /// The socket this backend dials.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one HTTP/2 request; the URI's path is kept, the socket is fixed.
    pub async fn send(
        &self,
        mut request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, BackendError> {
        // The pooled client wants an absolute URI; keep the caller's authority.
        let uri = request.uri();
        let authority = uri.authority().map_or("localhost", |a| a.as_str());
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        *request.uri_mut() =
            format!("http://{authority}{path}")
                .parse()
                .map_err(|e| BackendError {
                    code: Code::Internal,
                    message: format!("bad request URI: {e}"),
                })?;
        self.client
            .request(request)
            .await
            .map_err(|error| self.error(&error))
    }

    fn error(&self, error: &hyper_util::client::legacy::Error) -> BackendError {
        let mut message = String::new();
        let mut source: Option<&dyn std::error::Error> = Some(error);
        while let Some(cause) = source {
            if !message.is_empty() {
                message.push_str(": ");
            }
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        let message = if error.is_connect() {
            format!(
                "connection error: dial unix {}: {message}",
                self.path.display()
            )
        } else {
            format!("runtime {}: {message}", self.path.display())
        };
        BackendError {
            code: Code::Unavailable,
            message,
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
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let code = grpc::status_code(&trailers)
            .or_else(|| grpc::status_code(&parts.headers))
            .unwrap_or(Code::Unknown);
        if code != Code::Ok {
            let message =
                grpc::status_message(&trailers).or_else(|| grpc::status_message(&parts.headers));
            return Err(BackendError {
                code,
                message: message.unwrap_or_default(),
            });
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
