//! Bodies crossing the proxy: what it receives from an HTTP/2 stream, what it
//! holds, and how it sends them on so a unary call leaves in one write.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
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

impl<B> Prefetched<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + Unpin,
{
    /// Sends every frame already here on `stream` at once, so that whatever was
    /// queued on the stream before (its headers) leaves with them in one write;
    /// returns what remains to be piped, if the body is not over yet. Ready data
    /// is queued beyond the peer's window: it is in memory already, and h2 holds
    /// it until the window opens.
    pub fn send_ready(mut self, stream: &mut SendStream<Bytes>) -> Result<Option<Self>, h2::Error> {
        while let Some(frame) = self.ready.pop_front() {
            let last = self.ready.is_empty() && self.error.is_none() && self.rest.is_none();
            match frame.into_data() {
                Ok(data) => stream.send_data(data, last)?,
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        return stream.send_trailers(trailers).map(|()| None);
                    }
                }
            }
            if last {
                return Ok(None);
            }
        }
        if self.error.is_some() {
            stream.send_reset(h2::Reason::INTERNAL_ERROR);
            return Ok(None);
        }
        match self.rest {
            Some(_) => Ok(Some(self)),
            None => stream.send_data(Bytes::new(), true).map(|()| None),
        }
    }
}

/// Sends `body` on `stream` to its end, within the peer's flow-control window.
/// A body error resets the stream, so the peer sees the call fail; a reset from
/// the peer drops `body`, which cancels the stream it comes from (a watch kubelet
/// gave up on does not stay open at containerd).
pub async fn pipe(mut body: Prefetched<ProxyBody>, mut stream: SendStream<Bytes>) {
    loop {
        let next = std::future::poll_fn(|cx| {
            if stream.poll_reset(cx).is_ready() {
                return Poll::Ready(None);
            }
            Pin::new(&mut body).poll_frame(cx).map(Some)
        })
        .await;
        let Some(next) = next else {
            return;
        };
        let frame = match next {
            None => {
                let _ = stream.send_data(Bytes::new(), true);
                return;
            }
            Some(Ok(frame)) => frame,
            Some(Err(_)) => {
                stream.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
        };
        let mut data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = stream.send_trailers(trailers);
                    return;
                }
                continue;
            }
        };
        while !data.is_empty() {
            stream.reserve_capacity(data.len());
            // poll_capacity only reports increases: look at what is there first.
            let mut capacity = stream.capacity();
            while capacity == 0 {
                match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
                    Some(Ok(n)) => capacity = n,
                    // Reset or closed by the peer: nobody is reading any more.
                    Some(Err(_)) | None => return,
                }
            }
            let chunk = data.split_to(capacity.min(data.len()));
            if stream.send_data(chunk, false).is_err() {
                return;
            }
        }
    }
}

/// The receiving half of an HTTP/2 stream as a body. Flow-control credit goes
/// back as soon as a chunk is taken: the proxy relays, it does not hoard.
#[derive(Debug)]
pub struct RecvBody {
    stream: RecvStream,
    data_done: bool,
    done: bool,
}

impl RecvBody {
    /// Wraps an h2 receive stream.
    pub fn new(stream: RecvStream) -> Self {
        Self {
            stream,
            data_done: false,
            done: false,
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if !this.data_done {
            match std::task::ready!(this.stream.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Only fails once the stream is gone, when credit no longer matters.
                    let _ = this.stream.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(error)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(error)));
                }
                None => this.data_done = true,
            }
        }
        let polled = std::task::ready!(this.stream.poll_trailers(cx));
        this.done = true;
        Poll::Ready(match polled {
            Ok(Some(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Ok(None) => None,
            Err(error) => Some(Err(error)),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.stream.is_end_stream()
    }
}
