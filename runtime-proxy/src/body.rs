//! The one body type the proxy hands to hyper, in both directions.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
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

/// A streamed body whose already-arrived frames are taken up front, so a unary
/// message goes on together with its headers instead of trickling behind them:
/// one write and one wake-up of the peer instead of several.
#[derive(Debug)]
pub struct Prefetched<B: Body> {
    ready: VecDeque<Frame<Bytes>>,
    error: Option<B::Error>,
    rest: Option<B>,
}

impl<B: Body<Data = Bytes> + Unpin> Prefetched<B> {
    /// Takes every frame of `body` that is ready now, without waiting.
    pub fn new(mut body: B) -> Self {
        let mut ready = VecDeque::new();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        loop {
            if body.is_end_stream() {
                return Self {
                    ready,
                    error: None,
                    rest: None,
                };
            }
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(frame))) => ready.push_back(frame),
                Poll::Ready(Some(Err(error))) => {
                    return Self {
                        ready,
                        error: Some(error),
                        rest: None,
                    };
                }
                Poll::Ready(None) => {
                    return Self {
                        ready,
                        error: None,
                        rest: None,
                    };
                }
                // Polled again later with the real waker, which replaces the no-op one.
                Poll::Pending => {
                    return Self {
                        ready,
                        error: None,
                        rest: Some(body),
                    };
                }
            }
        }
    }
}

impl<B> Body for Prefetched<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(frame) = this.ready.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        if let Some(error) = this.error.take() {
            return Poll::Ready(Some(Err(error.into())));
        }
        match this.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx).map_err(Into::into),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_empty()
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }
}
