//! The one body type the proxy hands to hyper, in both directions.

use std::convert::Infallible;

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use http_body_util::{BodyExt, Empty, StreamBody, combinators::UnsyncBoxBody};

/// Errors crossing the proxy's body streams.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed body: streamed passthrough, or bytes the proxy already holds.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body with no data and no trailers.
pub fn empty_body() -> ProxyBody {
    Empty::<Bytes>::new()
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// A body of bytes the proxy already holds, followed by `trailers` when present.
pub fn full_body(data: Bytes, trailers: Option<HeaderMap>) -> ProxyBody {
    let mut frames = Vec::with_capacity(2);
    if !data.is_empty() {
        frames.push(Ok::<_, BoxError>(Frame::data(data)));
    }
    if let Some(trailers) = trailers {
        frames.push(Ok(Frame::trailers(trailers)));
    }
    StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
}
