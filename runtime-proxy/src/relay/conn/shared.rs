//! What the relay's two loops share: the calls in flight on each stream, the
//! routes of intercepted calls, and the frames waiting to go out.

use super::*;

/// One call on the connection, from its request HEADERS until its stream ends.
pub(super) struct Call {
    pub(super) record: CallRecord,
    pub(super) intercept: Option<Intercept>,
}

/// What a request's `:path` resolves to, kept per connection: kubelet calls a
/// handful of methods many times.
#[derive(Clone)]
pub(super) struct Route {
    pub(super) method: Option<Method>,
    pub(super) series: MethodSeries,
}

/// A call whose request header block was read, to be opened.
pub(super) struct NewCall {
    pub(super) stream: u32,
    pub(super) end_stream: bool,
    pub(super) path: String,
    pub(super) timeout: Option<Duration>,
}

/// What the relay keeps of a lifecycle call.
pub(super) struct Intercept {
    pub(super) method: Method,
    pub(super) span: Span,
    pub(super) deadline: Option<Duration>,
    /// The request body so far; handed to the pre stage at END_STREAM.
    pub(super) request: BytesMut,
    /// The runtime's window on this stream for the relay's own DATA.
    pub(super) send_window: i64,
    /// Where the answer goes once the request was forwarded.
    pub(super) answer_to: Option<oneshot::Sender<Answer>>,
    pub(super) answer: Answer,
}

/// The runtime's answer to a lifecycle call, as observed on its way to kubelet.
#[derive(Default)]
pub(super) struct Answer {
    pub(super) code: Option<Code>,
    pub(super) message: String,
    pub(super) data: BytesMut,
    /// The answer was larger than the proxy holds: the post stage sees it as undecodable.
    pub(super) truncated: bool,
}

/// A frame for the runtime, waiting its turn.
pub(super) struct Outbound {
    pub(super) frame: Bytes,
    pub(super) stream: u32,
    /// Its flow-controlled length (DATA), else 0.
    pub(super) flow: i64,
    /// The relay's own DATA: also bounded by the stream's window.
    pub(super) own: bool,
}

/// What both loops and the lifecycle tasks of one connection share. Locked for
/// the handling of one read, never across an await.
pub(super) struct Shared {
    pub(super) calls: HashMap<u32, Call>,
    /// How many of `calls` are lifecycle calls.
    pub(super) intercepted: usize,
    /// The runtime's connection window for what the relay sends it.
    pub(super) runtime_window: i64,
    /// Bytes the relay sent the runtime that kubelet never sent (see the module doc).
    pub(super) debt: i64,
    /// The runtime's SETTINGS_INITIAL_WINDOW_SIZE.
    pub(super) initial_window: i64,
    /// Frames for the runtime that wait for window, in kubelet's order.
    pub(super) to_runtime: VecDeque<Outbound>,
    /// The relay's own frames for the runtime, joined to `to_runtime` at a header
    /// block boundary of kubelet's.
    pub(super) injected_runtime: VecDeque<Outbound>,
    /// The relay's own frames for kubelet, written at a header block boundary of the runtime's.
    pub(super) to_kubelet: BytesMut,
    /// The largest SETTINGS_HEADER_TABLE_SIZE each side advertised.
    pub(super) runtime_table_limit: usize,
    pub(super) kubelet_table_limit: usize,
    pub(super) highest_stream: u32,
    /// Draining: streams above this one are refused.
    pub(super) last_stream: Option<u32>,
    /// Calls that ended, recorded once the frames that ended them are written.
    pub(super) ended: Vec<(CallRecord, Code)>,
    pub(super) routes: HashMap<String, Route>,
}

impl Shared {
    /// Moves what the runtime's windows allow from the queues to `out`.
    pub(super) fn pump(&mut self, out: &mut BytesMut, at_boundary: bool) {
        if at_boundary {
            self.to_runtime.extend(self.injected_runtime.drain(..));
        }
        while let Some(next) = self.to_runtime.front_mut() {
            if next.flow > self.runtime_window {
                return;
            }
            if next.own {
                match self
                    .calls
                    .get_mut(&next.stream)
                    .and_then(|c| c.intercept.as_mut())
                {
                    Some(intercept) if next.flow > intercept.send_window => return,
                    Some(intercept) => intercept.send_window -= next.flow,
                    // Kubelet cancelled the call: the rest of its body is not sent,
                    // and the runtime will not credit it.
                    None => {
                        self.debt -= next.flow;
                        self.to_runtime.pop_front();
                        continue;
                    }
                }
            }
            self.runtime_window -= next.flow;
            if let Some(next) = self.to_runtime.pop_front() {
                out.extend_from_slice(&next.frame);
            }
        }
    }

    pub(super) fn open_call(&mut self, stream: u32, call: Call) {
        let intercepted = call.intercept.is_some();
        if let Some(old) = self.calls.insert(stream, call) {
            self.intercepted -= usize::from(old.intercept.is_some());
        }
        self.intercepted += usize::from(intercepted);
    }

    pub(super) fn remove_call(&mut self, stream: u32) -> Option<Call> {
        let call = self.calls.remove(&stream)?;
        self.intercepted -= usize::from(call.intercept.is_some());
        Some(call)
    }

    /// Whether every frame the runtime sends now goes to kubelet unchanged, and
    /// nothing of the relay's own is due there: no lifecycle call is open, the
    /// runtime owes no credit for the relay's own DATA, nothing waits for kubelet.
    pub(super) fn answers_pass_unchanged(&self) -> bool {
        self.intercepted == 0 && self.debt == 0 && self.to_kubelet.is_empty()
    }

    /// A call's stream ended at the runtime's side (or was reset): record it and
    /// hand a lifecycle call's answer to its post stage.
    pub(super) fn end_call(&mut self, stream: u32, code: Option<Code>) {
        let Some(call) = self.remove_call(stream) else {
            return;
        };
        let Call { record, intercept } = call;
        let Some(mut intercept) = intercept else {
            self.ended.push((record, code.unwrap_or(Code::Unknown)));
            return;
        };
        let code = code.or(intercept.answer.code).unwrap_or(Code::Unknown);
        self.ended.push((record, code));
        intercept.answer.code = Some(code);
        if let Some(to) = intercept.answer_to.take() {
            let _ = to.send(intercept.answer);
        }
    }
}
