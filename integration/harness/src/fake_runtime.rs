//! A recording fake runtime: an HTTP/2 server on a unix socket that records the
//! raw bytes of every request and answers as each test scripts it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixListener;
use tokio::sync::mpsc;

/// One request as the fake runtime received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The HTTP/2 path (`/runtime.v1.RuntimeService/...`).
    pub path: String,
    /// The request headers, as received.
    pub headers: HeaderMap,
    /// The request body bytes, concatenated.
    pub body: Bytes,
}

/// What the script hands back for a request: headers, then frames sent as they
/// are pushed into the channel (data or trailers).
pub type Reply = (HeaderMap, mpsc::Receiver<Frame<Bytes>>);

/// Decides the reply to a recorded request.
pub type Script = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// A running fake runtime.
#[derive(Clone)]
pub struct FakeRuntime {
    socket: PathBuf,
    recorded: Arc<Mutex<Vec<Recorded>>>,
}

impl std::fmt::Debug for FakeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeRuntime")
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

/// A reply of `body` (one data frame) and then `trailers`.
pub fn reply(headers: HeaderMap, body: Bytes, trailers: HeaderMap) -> Reply {
    let (tx, rx) = mpsc::channel(2);
    if !body.is_empty() {
        let _ = tx.try_send(Frame::data(body));
    }
    let _ = tx.try_send(Frame::trailers(trailers));
    (headers, rx)
}

/// Headers of a normal gRPC response.
pub fn grpc_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/grpc"),
    );
    headers
}

impl FakeRuntime {
    /// Serves on `socket` with `script`.
    pub fn start(socket: &Path, script: Script) -> anyhow::Result<Self> {
        let listener = UnixListener::bind(socket)?;
        let recorded = Arc::new(Mutex::new(Vec::new()));
        let fake = Self {
            socket: socket.to_path_buf(),
            recorded: Arc::clone(&recorded),
        };
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let recorded = Arc::clone(&recorded);
                let script = Arc::clone(&script);
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let recorded = Arc::clone(&recorded);
                    let script = Arc::clone(&script);
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await?.to_bytes();
                        let entry = Recorded {
                            path: parts.uri.path().to_owned(),
                            headers: parts.headers,
                            body,
                        };
                        let (headers, frames) = script(&entry);
                        recorded
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push(entry);
                        let stream =
                            futures_util::stream::unfold(frames, |mut frames| async move {
                                frames
                                    .recv()
                                    .await
                                    .map(|frame| (Ok::<_, hyper::Error>(frame), frames))
                            });
                        let mut response = Response::new(StreamBody::new(stream));
                        *response.headers_mut() = headers;
                        Ok::<_, hyper::Error>(response)
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(fake)
    }

    /// The socket it serves.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Requests received so far, less the proxy's own store lookups (ListPodSandbox, ListContainers).
    pub fn forwarded(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| {
                !r.path.ends_with("/ListPodSandbox") && !r.path.ends_with("/ListContainers")
            })
            .collect()
    }

    /// Every request received so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.recorded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}
