//! Small frame-level steps both loops take: cut-through of DATA, forwarding,
//! flow-control credit, the relay's own frames and refusals.

use super::*;

/// A DATA frame of a passthrough call passed on as its bytes come, as a byte
/// relay would, rather than once whole: what of it is still to come.
#[derive(Debug)]
pub(super) struct Passing {
    pub(super) left: usize,
    /// Its stream, when the frame ends the call.
    pub(super) ends: Option<u32>,
}

/// Starts passing on the partial frame at the front of `input` if it is DATA of
/// a passthrough call: the relay reads nothing of it but its header. Unpadded
/// only (padding is counted from the frame's end), outside a header block
/// (DATA there goes whole, for the receiver to fail the connection on).
pub(super) fn cut_through(
    shared: &Shared,
    blocks: &HeaderBlocks,
    input: &mut BytesMut,
    out: &mut BytesMut,
) -> Option<Passing> {
    let head = FrameHead::parse(input)?;
    let passthrough = shared
        .calls
        .get(&head.stream)
        .is_some_and(|call| call.intercept.is_none());
    if head.kind != kind::DATA || head.has(flag::PADDED) || !blocks.at_boundary() || !passthrough {
        return None;
    }
    // `input` holds less than the whole frame, or it would have been cut whole.
    let left = frame::HEAD_LEN + head.len - input.len();
    out.unsplit(input.split());
    Some(Passing {
        left,
        ends: head.has(flag::END_STREAM).then_some(head.stream),
    })
}

/// Writes what of `out` the socket takes now; the rest stays, in order.
pub(super) fn flush(to: &Socket, out: &mut BytesMut) -> std::io::Result<()> {
    if !out.is_empty() {
        let written = to.try_write(out)?;
        let _ = out.split_to(written);
    }
    Ok(())
}

/// Records the calls that ended, once what ended them is on its way.
pub(super) fn finish(ended: &mut Vec<(CallRecord, Code)>) {
    for (record, code) in ended.drain(..) {
        record.finish(code);
    }
}

/// Sends a frame from kubelet on now, or queues it behind others waiting for window.
pub(super) fn forward(shared: &mut Shared, out: &mut BytesMut, head: FrameHead, frame: BytesMut) {
    let flow = if head.kind == kind::DATA {
        head.len as i64
    } else {
        0
    };
    if shared.to_runtime.is_empty() && flow <= shared.runtime_window {
        shared.runtime_window -= flow;
        out.unsplit(frame);
    } else {
        shared.to_runtime.push_back(Outbound {
            frame: frame.freeze(),
            stream: head.stream,
            flow,
            own: false,
        });
    }
}

/// The head `forward` takes for a whole header block: no flow control.
pub(super) fn block_head(stream: u32) -> FrameHead {
    FrameHead {
        len: 0,
        kind: kind::HEADERS,
        flags: 0,
        stream,
    }
}

pub(super) fn push_own(
    queue: &mut VecDeque<Outbound>,
    stream: u32,
    write: impl FnOnce(&mut BytesMut),
) {
    let mut frame = BytesMut::new();
    write(&mut frame);
    queue.push_back(Outbound {
        frame: frame.freeze(),
        stream,
        flow: 0,
        own: false,
    });
}

pub(super) fn credit_kubelet(dst: &mut BytesMut, stream: u32, len: usize) {
    if let Ok(increment) = u32::try_from(len) {
        if increment > 0 {
            frame::put_window_update(dst, stream, increment);
        }
    }
}

/// Answers `stream` with `refusal` as a trailers-only response, ends it at
/// kubelet (RST_STREAM NO_ERROR, as gRPC servers do, so kubelet sends no more of
/// its body) and cancels it at the runtime.
pub(super) fn refuse(shared: &mut Shared, stream: u32, refusal: &Refusal) {
    frame::put_status_headers(
        &mut shared.to_kubelet,
        stream,
        refusal.code as i32,
        &refusal.message,
    );
    frame::put_rst_stream(&mut shared.to_kubelet, stream, reason::NO_ERROR);
    push_own(&mut shared.injected_runtime, stream, |b| {
        frame::put_rst_stream(b, stream, reason::CANCEL)
    });
    if let Some(call) = shared.remove_call(stream) {
        shared.ended.push((call.record, refusal.code));
    }
}
