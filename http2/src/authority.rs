//! Any `:authority` kubelet sends is accepted, as containerd (grpc-go) accepts it.
//!
//! kubelet up to 1.30 and grpc-core clients send the unix socket's path as
//! `:authority` (`/run/containerd/containerd.sock`, or `%2Frun%2F...`), which h2
//! refuses as a URI authority by resetting the stream. [`KubeletStream`] sits
//! between kubelet's socket and h2's server and hands every frame on unchanged,
//! except request header blocks whose `:authority` h2 would refuse: those it
//! re-encodes with `:authority: localhost`, what grpc-go sends on unix sockets and
//! what the proxy sends the runtime anyway.
//!
//! HPACK makes this a job for the whole connection. kubelet's encoder refers back
//! to its dynamic table, so every header block goes through an [`hpack::Decoder`]
//! that keeps kubelet's table; and once a block was re-encoded, h2's table no
//! longer matches kubelet's, so from then on every block is re-encoded, as
//! literals that leave h2's table alone. Until then (for good, with a kubelet from
//! 1.31 on) h2 reads kubelet's bytes exactly as they were sent.
//!
//! What h2 would refuse at the frame level (bad padding, a CONTINUATION out of
//! place, a frame over the size h2 advertised, too many CONTINUATIONs) is handed
//! on as it came, and the pass steps aside: h2 fails the connection exactly as it
//! would have. A header block that does not decode fails the connection the way
//! h2 fails it for such a block: a GOAWAY.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::hpack;
// The frame layout the frame relay reads and writes too: one definition of it.
use crate::frame::flag::{END_HEADERS, END_STREAM, PADDED, PRIORITY};
use crate::frame::kind::{CONTINUATION, HEADERS};
use crate::frame::{FrameHead, HEAD_LEN as FRAME_HEAD_LEN, PREFACE, put_head as put_frame_head};

/// SETTINGS_HEADER_TABLE_SIZE the proxy's HTTP/2 server advertises to kubelet
/// (h2's default): the most kubelet's dynamic table may hold.
pub const HEADER_TABLE_SIZE: usize = 4096;
/// SETTINGS_MAX_FRAME_SIZE the server advertises (h2's default): the largest
/// frame kubelet may send, and the largest the pass emits.
pub const MAX_FRAME_SIZE: usize = 16_384;
/// SETTINGS_MAX_HEADER_LIST_SIZE the server advertises (h2's default).
pub const MAX_HEADER_LIST_SIZE: usize = 16 << 20;
/// CONTINUATION frames (without END_HEADERS) h2 takes in one header block for
/// these settings before it fails the connection; the pass buffers no more.
const MAX_CONTINUATIONS: usize = {
    let frames = MAX_HEADER_LIST_SIZE / MAX_FRAME_SIZE;
    frames + frames / 4
};
/// What the pass puts in place of an `:authority` h2 would refuse.
pub const NORMALISED_AUTHORITY: &[u8] = b"localhost";

const PRIORITY_LEN: usize = 5;

/// Whether h2 takes `value` as `:authority`: it parses it as a URI authority.
pub fn h2_accepts_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

// === impl AuthorityNormaliser ===

/// The pass itself, without I/O: bytes from kubelet in, bytes for h2 out.
#[derive(Debug)]
pub struct AuthorityNormaliser {
    state: State,
    /// A header block whose END_HEADERS has not come yet.
    block: Option<PendingBlock>,
    decoder: hpack::Decoder,
    /// Some block was re-encoded: h2's table no longer matches kubelet's.
    rewriting: bool,
    /// The fragments of a block that came in several frames, joined.
    joined: Vec<u8>,
    /// The block being decoded, re-encoded as literals.
    encoded: BytesMut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The client connection preface, this many bytes of it still to come.
    Preface(usize),
    /// At a frame boundary.
    FrameHead,
    /// Inside a frame handed on as it is, this many payload bytes still to come.
    Forward(usize),
    /// Stepped aside: h2 is about to fail the connection on what it was handed.
    Transparent,
    /// The pass failed the connection: nothing more reaches h2.
    Closed,
}

/// A HEADERS frame and its CONTINUATIONs so far.
#[derive(Debug)]
struct PendingBlock {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; PRIORITY_LEN]>,
    /// The frames as they came, for handing on unchanged.
    raw: BytesMut,
    /// Where the header block fragments lie in `raw`.
    fragments: Vec<Range<usize>>,
    continuations: usize,
}

impl Default for AuthorityNormaliser {
    fn default() -> Self {
        Self::new()
    }
}

impl AuthorityNormaliser {
    /// A pass for a new connection, before its preface.
    pub fn new() -> Self {
        Self {
            state: State::Preface(PREFACE.len()),
            block: None,
            decoder: hpack::Decoder::new(HEADER_TABLE_SIZE),
            rewriting: false,
            joined: Vec::new(),
            encoded: BytesMut::new(),
        }
    }

    /// Whether the pass failed the connection: h2 has its GOAWAY to send, and
    /// nothing more from kubelet is for it.
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// Whether some header block was re-encoded on this connection.
    pub fn is_rewriting(&self) -> bool {
        self.rewriting
    }

    /// Takes what it can of `input` (kubelet's bytes) and appends what h2 is to
    /// read to `output`. What is left in `input` is an incomplete frame.
    pub fn process(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        loop {
            match self.state {
                State::Preface(left) | State::Forward(left) => {
                    let n = left.min(input.len());
                    if n == 0 && left > 0 {
                        return;
                    }
                    forward(input, n, output);
                    self.state = match (self.state, left - n) {
                        (_, 0) => State::FrameHead,
                        (State::Preface(_), left) => State::Preface(left),
                        (_, left) => State::Forward(left),
                    };
                }
                State::Transparent => {
                    forward(input, input.len(), output);
                    return;
                }
                State::Closed => {
                    input.clear();
                    return;
                }
                State::FrameHead => {
                    let Some(head) = FrameHead::parse(input) else {
                        return;
                    };
                    let header_frame = head.kind == HEADERS || head.kind == CONTINUATION;
                    if header_frame && head.len <= MAX_FRAME_SIZE {
                        if input.len() < FRAME_HEAD_LEN + head.len {
                            return;
                        }
                        let frame = input.split_to(FRAME_HEAD_LEN + head.len);
                        self.header_frame(&head, frame, output);
                    } else if self.block.is_some() || header_frame {
                        // A frame inside a header block, or one over h2's frame size:
                        // h2 fails the connection on it.
                        self.step_aside(output);
                    } else {
                        forward(input, FRAME_HEAD_LEN, output);
                        self.state = State::Forward(head.len);
                    }
                }
            }
        }
    }

    /// kubelet closed its side: whatever is held goes to h2 as it came, for h2
    /// to judge the truncated frame.
    pub fn finish(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        if self.state != State::Closed {
            self.step_aside(output);
        }
        self.process(input, output);
    }

    fn header_frame(&mut self, head: &FrameHead, frame: BytesMut, output: &mut BytesMut) {
        if head.kind == HEADERS {
            if self.block.is_some() {
                // h2: "expected CONTINUATION".
                self.step_aside(output);
                output.unsplit(frame);
                return;
            }
            match self.start_block(head, frame) {
                Ok(block) => self.block = Some(block),
                Err(frame) => {
                    self.step_aside(output);
                    output.unsplit(frame);
                    return;
                }
            }
        } else {
            let Some(block) = self.block.as_mut().filter(|b| b.stream_id == head.stream) else {
                // h2: unexpected CONTINUATION, or one for another stream.
                self.step_aside(output);
                output.unsplit(frame);
                return;
            };
            if head.flags & END_HEADERS == 0 {
                block.continuations += 1;
                if block.continuations > MAX_CONTINUATIONS {
                    // h2: "too_many_continuations".
                    self.step_aside(output);
                    output.unsplit(frame);
                    return;
                }
            }
            let start = block.raw.len() + FRAME_HEAD_LEN;
            block.raw.unsplit(frame);
            block.fragments.push(start..block.raw.len());
        }
        if head.flags & END_HEADERS != 0 {
            if let Some(block) = self.block.take() {
                self.finish_block(block, output);
            }
        }
    }

    /// Reads a HEADERS frame as h2 does; hands the frame back where h2 would fail
    /// the connection on it.
    fn start_block(&self, head: &FrameHead, frame: BytesMut) -> Result<PendingBlock, BytesMut> {
        if head.stream == 0 {
            return Err(frame);
        }
        let mut start = FRAME_HEAD_LEN;
        let mut end = frame.len();
        let mut pad = 0;
        if head.flags & PADDED != 0 {
            match frame.get(start) {
                Some(&len) => pad = usize::from(len),
                None => return Err(frame),
            }
            start += 1;
        }
        let mut priority = None;
        if head.flags & PRIORITY != 0 {
            match frame.get(start..start + PRIORITY_LEN) {
                Some(bytes) => priority = bytes.try_into().ok(),
                None => return Err(frame),
            }
            start += PRIORITY_LEN;
        }
        if pad > end - start {
            return Err(frame);
        }
        end -= pad;
        Ok(PendingBlock {
            stream_id: head.stream,
            flags: head.flags,
            priority,
            raw: frame,
            // A list of ranges holding one so far, not the range's numbers:
            // CONTINUATIONs add theirs.
            #[allow(clippy::single_range_in_vec_init)]
            fragments: vec![start..end],
            continuations: 0,
        })
    }

    fn finish_block(&mut self, block: PendingBlock, output: &mut BytesMut) {
        let self_dependent = block.priority.is_some_and(|p| {
            u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff == block.stream_id
        });
        if self_dependent && !self.rewriting {
            // h2 resets such a stream without decoding its block, and so must the
            // pass, or its table would part from the one h2 keeps.
            output.unsplit(block.raw);
            return;
        }
        let encoded: &[u8] = match block.fragments.as_slice() {
            [one] => &block.raw[one.clone()],
            many => {
                self.joined.clear();
                for range in many {
                    self.joined.extend_from_slice(&block.raw[range.clone()]);
                }
                &self.joined
            }
        };
        // Every block is re-encoded as it is decoded, whether or not it will be
        // needed: a refused `:authority` may come after fields already seen.
        self.encoded.clear();
        let mut refused = false;
        let mut list_size = 0usize;
        let reencoded = &mut self.encoded;
        let decoded = self.decoder.decode(encoded, |name, value, indexing| {
            let value = if name == b":authority" && !h2_accepts_authority(value) {
                refused = true;
                NORMALISED_AUTHORITY
            } else {
                value
            };
            list_size = list_size.saturating_add(hpack::field_size(name, value));
            if list_size <= MAX_HEADER_LIST_SIZE {
                hpack::encode_literal(name, value, indexing, reencoded);
            }
        });
        if let Err(error) = decoded {
            tracing::debug!(stream = block.stream_id, %error, "kubelet sent a header block that does not decode; failing the connection");
            self.fail(block.stream_id, output);
            return;
        }
        if !self.rewriting && !refused {
            output.unsplit(block.raw);
            return;
        }
        if list_size > MAX_HEADER_LIST_SIZE {
            // h2 would refuse the stream, but what it is to refuse can no longer
            // be handed on.
            tracing::debug!(
                stream = block.stream_id,
                "header list over {MAX_HEADER_LIST_SIZE} bytes to re-encode; failing the connection"
            );
            self.fail(block.stream_id, output);
            return;
        }
        if !self.rewriting {
            tracing::debug!(
                stream = block.stream_id,
                "kubelet's :authority is not a URI authority; re-encoding its header blocks with :authority localhost"
            );
            self.rewriting = true;
        }
        emit_block(&block, &self.encoded, output);
    }

    /// Hands h2 a header block it fails the connection on, as it would have on
    /// kubelet's: an indexed field at index 0 (RFC 7541 §6.1).
    fn fail(&mut self, stream_id: u32, output: &mut BytesMut) {
        put_frame_head(
            output,
            1,
            HEADERS,
            END_HEADERS | END_STREAM,
            stream_id.max(1),
        );
        output.put_u8(0x80);
        self.state = State::Closed;
    }

    /// Hands on what is held as it came and forwards everything from now on.
    fn step_aside(&mut self, output: &mut BytesMut) {
        if let Some(block) = self.block.take() {
            output.unsplit(block.raw);
        }
        self.state = State::Transparent;
    }
}

/// Frames a re-encoded block as HEADERS (with the original's END_STREAM and
/// priority, without padding) and CONTINUATIONs, none over [`MAX_FRAME_SIZE`].
fn emit_block(block: &PendingBlock, encoded: &[u8], output: &mut BytesMut) {
    let prefix = if block.priority.is_some() {
        PRIORITY_LEN
    } else {
        0
    };
    let first = encoded.len().min(MAX_FRAME_SIZE - prefix);
    let (head, mut rest) = encoded.split_at(first);
    let mut flags = block.flags & (END_STREAM | PRIORITY);
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    output.reserve(encoded.len() + FRAME_HEAD_LEN * (2 + encoded.len() / MAX_FRAME_SIZE));
    put_frame_head(output, prefix + head.len(), HEADERS, flags, block.stream_id);
    if let Some(priority) = &block.priority {
        output.put_slice(priority);
    }
    output.put_slice(head);
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(rest.len().min(MAX_FRAME_SIZE));
        let flags = if after.is_empty() { END_HEADERS } else { 0 };
        put_frame_head(output, chunk.len(), CONTINUATION, flags, block.stream_id);
        output.put_slice(chunk);
        rest = after;
    }
}

/// Moves the first `n` bytes of `input` to `output`, without copying where they
/// are contiguous (the common case: `output` was emptied by the reader).
fn forward(input: &mut BytesMut, n: usize, output: &mut BytesMut) {
    if n > 0 {
        output.unsplit(input.split_to(n));
    }
}

// === impl KubeletStream ===

/// kubelet's connection as h2's server reads it: through an
/// [`AuthorityNormaliser`]. Writes go straight through.
#[derive(Debug)]
pub struct KubeletStream<T> {
    inner: T,
    normaliser: AuthorityNormaliser,
    input: BytesMut,
    output: BytesMut,
    eof: bool,
}

/// What `input` grows by when a read does not fit.
const READ_RESERVE: usize = 16 * 1024;

impl<T> KubeletStream<T> {
    /// Wraps a freshly accepted connection.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            normaliser: AuthorityNormaliser::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
            eof: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for KubeletStream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof || this.normaliser.is_closed() {
                return Poll::Ready(Ok(()));
            }
            // Read into h2's own buffer and take the bytes back out of it: no
            // buffer of the pass's own to initialise, and no `unsafe`.
            let before = buf.filled().len();
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
            let fresh = &buf.filled()[before..];
            if fresh.is_empty() {
                this.eof = true;
                this.normaliser.finish(&mut this.input, &mut this.output);
            } else {
                if this.input.capacity() - this.input.len() < fresh.len() {
                    // One allocation for many calls: forwarded bytes leave `input`
                    // without a copy, and share its buffer until h2 has read them.
                    this.input.reserve(fresh.len().max(READ_RESERVE));
                }
                this.input.extend_from_slice(fresh);
                buf.set_filled(before);
                this.normaliser.process(&mut this.input, &mut this.output);
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for KubeletStream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
