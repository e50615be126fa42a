//! A raw HTTP/2 gRPC client: sends exact bytes and headers and returns exactly
//! what came back, for byte-level passthrough checks.

use std::path::Path;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::TokioExecutor;

/// What came back for a raw call.
#[derive(Debug, Clone, Default)]
pub struct RawResponse {
    /// Response headers.
    pub headers: HeaderMap,
    /// The data frames' bytes, concatenated.
    pub body: Bytes,
    /// Trailers, when any were sent.
    pub trailers: Option<HeaderMap>,
}

/// An HTTP/2 connection to a unix socket.
#[derive(Debug, Clone)]
pub struct RawClient {
    sender: SendRequest<Full<Bytes>>,
}

impl RawClient {
    /// Connects to `socket`.
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        let io = tessera_runtime_proxy::backend::connect_unix(socket).await?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(connection);
        Ok(Self { sender })
    }

    /// Sends a POST to `path` with `headers` and `body`; returns the whole response.
    pub async fn call(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<RawResponse> {
        let response = self.send(path, headers, body).await?;
        let (parts, body) = response.into_parts();
        let collected = body.collect().await?;
        let trailers = collected.trailers().cloned();
        Ok(RawResponse {
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        })
    }

    /// Sends a request and returns the response with its body still streaming.
    pub async fn send(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        let mut request = Request::post(format!("http://localhost{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.sender.ready().await?;
        Ok(self
            .sender
            .send_request(request.body(Full::new(body))?)
            .await?)
    }
}

/// Frames `message` as one uncompressed gRPC message.
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.extend_from_slice(&[0]);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    out.freeze()
}
