//! A raw HTTP/2 gRPC client: sends exact bytes and headers and returns exactly
//! what came back, for byte-level passthrough checks.

use std::path::Path;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
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

impl RawResponse {
    async fn read(response: http::Response<hyper::body::Incoming>) -> anyhow::Result<Self> {
        let (parts, body) = response.into_parts();
        let collected = body.collect().await?;
        let trailers = collected.trailers().cloned();
        Ok(Self {
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        })
    }
}

/// An HTTP/2 connection to a unix socket.
#[derive(Debug, Clone)]
pub struct RawClient {
    sender: SendRequest<RawBody>,
}

/// A request body: whole, or chunks sent as they are pushed into a channel.
type RawBody = UnsyncBoxBody<Bytes, std::convert::Infallible>;

impl RawClient {
    /// Connects to `socket`.
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        let io = crate::unix::connect(socket).await?;
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
        RawResponse::read(response).await
    }

    /// Sends a request and returns the response with its body still streaming.
    pub async fn send(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        self.send_body(path, headers, Full::new(body).boxed_unsync())
            .await
    }

    /// Sends a request whose body goes out chunk by chunk as `chunks` yields them,
    /// and ends when the channel closes; returns the whole response.
    pub async fn call_streaming(
        &mut self,
        path: &str,
        chunks: tokio::sync::mpsc::Receiver<Bytes>,
    ) -> anyhow::Result<RawResponse> {
        let stream = futures_util::stream::unfold(chunks, |mut chunks| async move {
            let chunk = chunks.recv().await?;
            Some((Ok(Frame::data(chunk)), chunks))
        });
        let response = self
            .send_body(path, &[], StreamBody::new(stream).boxed_unsync())
            .await?;
        RawResponse::read(response).await
    }

    async fn send_body(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: RawBody,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        let mut request = Request::post(format!("http://localhost{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.sender.ready().await?;
        Ok(self.sender.send_request(request.body(body)?).await?)
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
