//! One kubelet connection relayed to one runtime connection, frame by frame.
//!
//! Two loops share one task: kubelet → runtime ([`Relay::kubelet_side`]) and
//! runtime → kubelet ([`Relay::runtime_side`]). Each cuts what it reads into whole
//! frames and writes them on in the order they came, unchanged, in one write per
//! read; DATA of a passthrough answer goes on as its bytes come ([`Passing`]),
//! as a byte relay would pass them. The bookkeeping a read causes comes after
//! its write: a passthrough call's record is opened once its request headers
//! went (a lifecycle call's at once: its DATA is held), and answers are written
//! before they are even decoded while nothing of them can change
//! ([`Shared::answers_pass_unchanged`]). Header blocks are decoded, never
//! re-encoded: stream IDs and both HPACK tables stay identical on the two legs,
//! and any `:authority` reaches the runtime as it was sent. A call's metrics are
//! recorded after the write that ended it, off the answer's way. Splitting a
//! read's frames over two writes would cost more than all of this saves: the
//! runtime wakes for each.
//!
//! A lifecycle call ([`Method`]) differs in one way: its request DATA is held by
//! the relay, run through [`Proxy::pre_stage`] and re-emitted (rewritten or not)
//! as the relay's own DATA on the same stream; its answer passes unchanged and is
//! observed for [`Proxy::post_stage`]. Flow control stays right because:
//! - the relay credits kubelet (stream and connection WINDOW_UPDATE) for every
//!   byte it holds, so kubelet never waits on a window the runtime cannot see;
//! - every byte the relay sends the runtime itself is a *debt*: the runtime will
//!   credit it to kubelet's view, so that much is withheld from the runtime's next
//!   connection WINDOW_UPDATEs;
//! - until a debt is paid kubelet may send more than the runtime's window holds:
//!   the relay tracks that window and queues DATA that does not fit (at most the
//!   debt). Without lifecycle calls the queue stays empty.

use std::collections::{HashMap, VecDeque};
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, watch};
use tonic::Code;
use tracing::{Instrument, Span};

use super::io::{READ_CHUNK, Socket, Wake};
use crate::hook::Method;
use crate::http2::frame::{self, FrameHead, flag, kind, reason, setting};
use crate::http2::hpack;
use crate::metrics::MethodSeries;
use crate::proxy::{CallRecord, Proxy, Refusal, call_outcome, call_span};

/// Paths a connection remembers the method and metric series of; past that,
/// they are looked up per call.
const MAX_ROUTES: usize = 64;

/// Why a relayed connection ended early.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Reading from or writing to kubelet or the runtime failed.
    #[error("{side}: {source}")]
    Io {
        /// "kubelet" or "runtime".
        side: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
}

use tessera_daemon::sync::lock;

mod frames;
mod headers;
mod pre_stage;
mod shared;
use frames::*;
pub use headers::{Fields, HeaderBlocks, Step};
use pre_stage::*;
use shared::*;

// === impl Relay ===

/// One relayed connection.
pub(crate) struct Relay {
    proxy: Arc<Proxy>,
    shared: Arc<Mutex<Shared>>,
    /// Wakes the kubelet side to write the relay's own frames to the runtime.
    runtime_wake: Arc<Wake>,
    /// Wakes the runtime side to write the relay's own frames to kubelet.
    kubelet_wake: Arc<Wake>,
}

impl Relay {
    pub(crate) fn new(proxy: Arc<Proxy>) -> Self {
        let shared = Shared {
            calls: HashMap::new(),
            intercepted: 0,
            runtime_window: frame::DEFAULT_WINDOW,
            debt: 0,
            initial_window: frame::DEFAULT_WINDOW,
            to_runtime: VecDeque::new(),
            injected_runtime: VecDeque::new(),
            to_kubelet: BytesMut::new(),
            runtime_table_limit: frame::DEFAULT_TABLE_SIZE,
            kubelet_table_limit: frame::DEFAULT_TABLE_SIZE,
            highest_stream: 0,
            last_stream: None,
            ended: Vec::new(),
            routes: HashMap::new(),
        };
        Self {
            proxy,
            shared: Arc::new(Mutex::new(shared)),
            runtime_wake: Arc::new(Wake::default()),
            kubelet_wake: Arc::new(Wake::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    /// Relays until either side closes; on `stopping`, sends kubelet GOAWAY and
    /// returns once its calls have ended.
    pub(crate) async fn run(
        self,
        kubelet: UnixStream,
        runtime: UnixStream,
        stopping: watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let kubelet = Socket::new(kubelet).map_err(|source| RelayError::Io {
            side: "kubelet",
            source,
        })?;
        let runtime = Socket::new(runtime).map_err(|source| RelayError::Io {
            side: "runtime",
            source,
        })?;
        tokio::select! {
            result = self.kubelet_side(&kubelet, &runtime) => result,
            result = self.runtime_side(&runtime, &kubelet, stopping) => result,
        }
    }

    /// kubelet → runtime: requests. Returns only on an error; after kubelet closes
    /// (or is failed) it waits for the runtime side to end the connection.
    async fn kubelet_side(&self, from: &Socket, to: &Socket) -> Result<(), RelayError> {
        let io = |source| RelayError::Io {
            side: "runtime",
            source,
        };
        let mut input = BytesMut::with_capacity(READ_CHUNK);
        let mut scratch = vec![0; READ_CHUNK];
        let mut preface = frame::PREFACE.len();
        let mut blocks = HeaderBlocks::requests();
        // The frames of a request header block until its END_HEADERS.
        let mut held = BytesMut::new();
        let mut open = true;
        let mut out = BytesMut::new();
        let mut ended = Vec::new();
        loop {
            if open {
                tokio::select! {
                    read = from.read(&mut input, &mut scratch) => match read {
                        Ok(0) | Err(_) => open = false,
                        Ok(_) => {}
                    },
                    () = self.runtime_wake.notified() => {}
                }
            } else {
                self.runtime_wake.notified().await;
            }
            if preface > 0 {
                // The preface goes on as it came; the runtime judges it.
                let n = preface.min(input.len());
                out.extend_from_slice(&input.split_to(n));
                preface -= n;
            }
            if preface == 0 && open {
                open = self
                    .requests(&mut input, &mut blocks, &mut held, &mut out, &mut ended, to)
                    .map_err(io)?;
            } else {
                let mut shared = self.lock();
                shared.pump(&mut out, blocks.at_boundary());
                std::mem::swap(&mut shared.ended, &mut ended);
            }
            if !out.is_empty() {
                to.write_all(&out).await.map_err(io)?;
            }
            // Dropped, not cleared: it may share `input`'s buffer, which can then
            // be reused in place.
            out = BytesMut::new();
            finish(&mut ended);
            if !open && !input.is_empty() {
                // Kubelet closed, or sent what the runtime fails it on: that goes as it came.
                to.write_all(&input).await.map_err(io)?;
                input.clear();
            }
            if !open {
                to.shutdown_write();
            }
        }
    }

    /// Handles every whole frame in `input`, and writes to the runtime what its
    /// window lets go now, in one write; false when nothing more is to be read.
    ///
    /// Passthrough calls the read started are opened after that write: their
    /// bookkeeping is off the request's way. What the socket does not take stays
    /// in `out`, in order.
    fn requests(
        &self,
        input: &mut BytesMut,
        blocks: &mut HeaderBlocks,
        held: &mut BytesMut,
        out: &mut BytesMut,
        ended: &mut Vec<(CallRecord, Code)>,
        to: &Socket,
    ) -> std::io::Result<bool> {
        let started = Instant::now();
        let mut deferred = Vec::new();
        let mut shared = self.lock();
        let shared = &mut *shared;
        let open = self.read_requests(shared, input, blocks, held, out, &mut deferred, started);
        shared.pump(out, blocks.at_boundary());
        // What the read brought goes in one write, as it came; the passthrough
        // calls it started are registered after it, and before anything awaits
        // (the answers' side finds them).
        flush(to, out)?;
        for call in deferred {
            self.start_call(shared, call, started);
        }
        std::mem::swap(&mut shared.ended, ended);
        Ok(open)
    }

    #[allow(clippy::too_many_arguments)]
    fn read_requests(
        &self,
        shared: &mut Shared,
        input: &mut BytesMut,
        blocks: &mut HeaderBlocks,
        held: &mut BytesMut,
        out: &mut BytesMut,
        deferred: &mut Vec<NewCall>,
        started: Instant,
    ) -> bool {
        while let Some((head, frame)) = frame::next_frame(input) {
            let step = blocks.read(&head, &frame, shared.runtime_table_limit);
            match step {
                Step::Fatal => {
                    forward(shared, out, block_head(head.stream), held.split());
                    forward(shared, out, head, frame);
                    return false;
                }
                Step::Block(block, fields) => {
                    // A block goes on whole, as sent or re-encoded: only now is
                    // it known which.
                    held.unsplit(frame);
                    if blocks.diverged || fields.lifecycle_content_length {
                        blocks.diverged |= fields.changed_table;
                        held.clear();
                        frame::put_block(held, &block, blocks.reencoded());
                    }
                    forward(shared, out, block_head(block.stream), held.split());
                    self.request_block(shared, block, fields, deferred, started);
                }
                Step::Forward if matches!(head.kind, kind::HEADERS | kind::CONTINUATION) => {
                    held.unsplit(frame);
                }
                Step::Forward => match head.kind {
                    kind::DATA => self.request_data(shared, out, head, frame),
                    kind::RST_STREAM => {
                        // The call ends here; a lifecycle call's pre stage finds it gone.
                        for call in deferred.drain(..) {
                            self.start_call(shared, call, started);
                        }
                        forward(shared, out, head, frame);
                        shared.end_call(head.stream, Some(Code::Cancelled));
                        if shared.last_stream.is_some() {
                            // Draining: the runtime side ends the connection with the last call.
                            self.kubelet_wake.notify();
                        }
                    }
                    kind::SETTINGS => {
                        for (id, value) in frame::settings(&head, &frame) {
                            if id == setting::HEADER_TABLE_SIZE {
                                shared.kubelet_table_limit =
                                    shared.kubelet_table_limit.max(value as usize);
                            }
                        }
                        forward(shared, out, head, frame);
                    }
                    _ => forward(shared, out, head, frame),
                },
            }
        }
        true
    }

    /// A whole request header block: a new call, or trailers of one.
    /// A lifecycle call is opened now (its DATA is held from the next frame on);
    /// a passthrough call is left in `deferred` for after the write.
    fn request_block(
        &self,
        shared: &mut Shared,
        head: FrameHead,
        fields: Fields,
        deferred: &mut Vec<NewCall>,
        started: Instant,
    ) {
        if head.stream <= shared.highest_stream {
            return;
        }
        shared.highest_stream = head.stream;
        if shared.last_stream.is_some_and(|last| head.stream > last) {
            // Draining: kubelet had not seen the GOAWAY yet. The runtime must read
            // the block (its table), and neither side may run the call.
            push_own(&mut shared.injected_runtime, head.stream, |b| {
                frame::put_rst_stream(b, head.stream, reason::REFUSED_STREAM)
            });
            frame::put_rst_stream(&mut shared.to_kubelet, head.stream, reason::REFUSED_STREAM);
            self.kubelet_wake.notify();
            return;
        }
        let call = NewCall {
            stream: head.stream,
            end_stream: head.has(flag::END_STREAM),
            path: fields.path.unwrap_or_default(),
            timeout: fields.timeout,
        };
        if fields.lifecycle {
            self.start_call(shared, call, started);
        } else {
            deferred.push(call);
        }
    }

    /// Starts the record (and for a lifecycle call, the interception) of a call.
    fn start_call(&self, shared: &mut Shared, call: NewCall, started: Instant) {
        let NewCall {
            stream,
            end_stream,
            path,
            timeout,
        } = call;
        if let Some(kubelet) = self.proxy.kubelet_connections() {
            kubelet.call(&path);
        }
        let Route { method, series } = match shared.routes.get(&path) {
            Some(route) => route.clone(),
            None => {
                let name = path.rsplit('/').next().unwrap_or(&path);
                let route = Route {
                    method: Method::from_path(&path),
                    series: self.proxy.metrics().method_series(name),
                };
                if shared.routes.len() < MAX_ROUTES {
                    shared.routes.insert(path, route.clone());
                }
                route
            }
        };
        let span = call_span(series.method(), method.is_some());
        let record = CallRecord::started_at(
            Arc::clone(self.proxy.metrics()),
            series,
            span.clone(),
            started,
        );
        let intercept = method.map(|method| Intercept {
            method,
            span,
            deadline: timeout,
            request: BytesMut::new(),
            send_window: shared.initial_window,
            answer_to: None,
            answer: Answer::default(),
        });
        let lifecycle = intercept.is_some();
        shared.open_call(stream, Call { record, intercept });
        if lifecycle && end_stream {
            self.start_pre_stage(shared, stream);
        }
    }

    fn request_data(
        &self,
        shared: &mut Shared,
        out: &mut BytesMut,
        head: FrameHead,
        frame: BytesMut,
    ) {
        let limit = self.proxy.max_message_bytes();
        let Some(intercept) = shared
            .calls
            .get_mut(&head.stream)
            .and_then(|c| c.intercept.as_mut())
            .filter(|i| i.answer_to.is_none())
        else {
            forward(shared, out, head, frame);
            return;
        };
        let Ok(payload) = frame::data_payload(&head, &frame) else {
            // The runtime fails the connection on it; the call goes with it.
            forward(shared, out, head, frame);
            return;
        };
        if intercept.request.len() + payload.len() > limit {
            let method = intercept.method;
            let refusal = Refusal::new(Code::ResourceExhausted, self.proxy.too_large(method));
            self.refuse(shared, head.stream, &refusal);
            // Kubelet's connection window for this frame: the runtime never sees it.
            credit_kubelet(&mut shared.to_kubelet, 0, head.len);
            self.kubelet_wake.notify();
            return;
        }
        intercept.request.extend_from_slice(&frame[payload]);
        // The relay took these bytes: kubelet gets its window back from the relay.
        if !head.has(flag::END_STREAM) {
            credit_kubelet(&mut shared.to_kubelet, head.stream, head.len);
        }
        credit_kubelet(&mut shared.to_kubelet, 0, head.len);
        self.kubelet_wake.notify();
        if head.has(flag::END_STREAM) {
            self.start_pre_stage(shared, head.stream);
        }
    }

    /// The request of a lifecycle call is complete: its pre stage runs on a task
    /// of its own, so other calls on the connection go on meanwhile.
    fn start_pre_stage(&self, shared: &mut Shared, stream: u32) {
        let Some(intercept) = shared
            .calls
            .get_mut(&stream)
            .and_then(|c| c.intercept.as_mut())
        else {
            return;
        };
        let body = std::mem::take(&mut intercept.request).freeze();
        let task = PreStage {
            proxy: Arc::clone(&self.proxy),
            shared: Arc::clone(&self.shared),
            runtime_wake: Arc::clone(&self.runtime_wake),
            kubelet_wake: Arc::clone(&self.kubelet_wake),
            stream,
            method: intercept.method,
            deadline: intercept.deadline,
        };
        let span = intercept.span.clone();
        tokio::spawn(task.run(body).instrument(span));
    }

    /// Answers a lifecycle call from the relay and cancels it at the runtime.
    fn refuse(&self, shared: &mut Shared, stream: u32, refusal: &Refusal) {
        refuse(shared, stream, refusal);
        self.runtime_wake.notify();
        self.kubelet_wake.notify();
    }

    /// runtime → kubelet: answers. Returns when the runtime closes, or when
    /// draining and no call is left.
    async fn runtime_side(
        &self,
        from: &Socket,
        to: &Socket,
        mut stopping: watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let io = |source| RelayError::Io {
            side: "kubelet",
            source,
        };
        let mut input = BytesMut::with_capacity(READ_CHUNK);
        let mut scratch = vec![0; READ_CHUNK];
        let mut blocks = HeaderBlocks::answers();
        let mut passing = None;
        let mut out = BytesMut::new();
        let mut ended = Vec::new();
        let mut open = true;
        let mut draining = false;
        let mut stop = pin!(stopping.changed());
        loop {
            tokio::select! {
                read = from.read(&mut input, &mut scratch) => match read {
                    Ok(0) | Err(_) => open = false,
                    Ok(_) => {}
                },
                () = self.kubelet_wake.notified() => {}
                changed = &mut stop, if !draining => {
                    draining = true;
                    if changed.is_ok() {
                        let mut shared = self.lock();
                        let last = shared.highest_stream;
                        shared.last_stream = Some(last);
                        frame::put_goaway(&mut shared.to_kubelet, last, reason::NO_ERROR);
                    }
                }
            }
            let fatal = !self
                .answers(&mut input, &mut blocks, &mut passing, &mut out, to)
                .map_err(io)?;
            let done = {
                let mut shared = self.lock();
                if blocks.at_boundary() && passing.is_none() && !shared.to_kubelet.is_empty() {
                    out.unsplit(shared.to_kubelet.split());
                }
                std::mem::swap(&mut shared.ended, &mut ended);
                draining && shared.calls.is_empty() && passing.is_none()
            };
            if !out.is_empty() {
                to.write_all(&out).await.map_err(io)?;
            }
            out = BytesMut::new();
            finish(&mut ended);
            if !open || fatal || done {
                if !input.is_empty() {
                    to.write_all(&input).await.map_err(io)?;
                }
                to.shutdown_write();
                return Ok(());
            }
        }
    }

    /// Handles every whole frame from the runtime; false when the connection is
    /// to end after what is in `out`.
    ///
    /// While answers pass unchanged ([`Shared::answers_pass_unchanged`]) the
    /// whole frames read go to kubelet first, as a byte relay would send them,
    /// and are read afterwards: decoding and bookkeeping are off the answer's
    /// way. The lock is held from that check to the end of the reading, so what
    /// the check found holds for every frame written early.
    fn answers(
        &self,
        input: &mut BytesMut,
        blocks: &mut HeaderBlocks,
        passing: &mut Option<Passing>,
        out: &mut BytesMut,
        to: &Socket,
    ) -> std::io::Result<bool> {
        let mut guard = self.lock();
        let shared = &mut *guard;
        if passing.is_none() && blocks.at_boundary() && shared.answers_pass_unchanged() {
            // Only whole frames: a part of one goes with what follows it
            // ([`cut_through`]), and one read's bytes go in one write.
            if !input.is_empty() && frame::whole_frames_len(input) == input.len() {
                let written = to.try_write(input)?;
                let mut early = input.split();
                // What the socket did not take now goes with the rest, unchanged.
                out.extend_from_slice(&early[written..]);
                #[cfg(debug_assertions)]
                let sent = early.clone();
                let mut read = BytesMut::new();
                let ok = self.read_answers(shared, &mut early, blocks, passing, &mut read);
                #[cfg(debug_assertions)]
                if ok {
                    debug_assert!(read == sent, "an answer frame sent early was to be changed");
                }
                if !ok {
                    // The receiver fails the connection on a frame in there; what
                    // followed it went too, as a byte relay would send it.
                    return Ok(false);
                }
            }
        }
        Ok(self.read_answers(shared, input, blocks, passing, out))
    }

    fn read_answers(
        &self,
        shared: &mut Shared,
        input: &mut BytesMut,
        blocks: &mut HeaderBlocks,
        passing: &mut Option<Passing>,
        out: &mut BytesMut,
    ) -> bool {
        let limit = self.proxy.max_message_bytes();
        let mut wake_runtime = false;
        loop {
            if let Some(rest) = passing {
                let n = rest.left.min(input.len());
                out.unsplit(input.split_to(n));
                rest.left -= n;
                if rest.left > 0 {
                    break;
                }
                if let Some(stream) = rest.ends {
                    shared.end_call(stream, None);
                }
                *passing = None;
            }
            let Some((head, frame)) = frame::next_frame(input) else {
                *passing = cut_through(shared, blocks, input, out);
                break;
            };
            match blocks.read(&head, &frame, shared.kubelet_table_limit) {
                Step::Fatal => {
                    out.unsplit(frame);
                    self.wake_runtime_if(wake_runtime);
                    return false;
                }
                Step::Block(block, fields) => {
                    out.unsplit(frame);
                    if let Some(intercept) = shared
                        .calls
                        .get_mut(&block.stream)
                        .and_then(|c| c.intercept.as_mut())
                    {
                        let answer = &mut intercept.answer;
                        answer.code = fields.status.or(answer.code);
                        if let Some(message) = fields.message {
                            answer.message = message;
                        }
                    }
                    if block.has(flag::END_STREAM) {
                        shared.end_call(block.stream, fields.status);
                    }
                }
                Step::Forward => match head.kind {
                    kind::DATA => {
                        if let Some(intercept) = shared
                            .calls
                            .get_mut(&head.stream)
                            .and_then(|c| c.intercept.as_mut())
                        {
                            // Observed, never changed.
                            let answer = &mut intercept.answer;
                            if let Ok(payload) = frame::data_payload(&head, &frame) {
                                if answer.data.len() + payload.len() <= limit {
                                    answer.data.extend_from_slice(&frame[payload]);
                                } else {
                                    answer.truncated = true;
                                }
                            }
                        }
                        let end = head.has(flag::END_STREAM);
                        out.unsplit(frame);
                        if end {
                            shared.end_call(head.stream, None);
                        }
                    }
                    kind::WINDOW_UPDATE => {
                        let increment = i64::from(frame::window_increment(&frame).unwrap_or(0));
                        if head.stream == 0 {
                            shared.runtime_window += increment;
                            wake_runtime = true;
                            let paid = shared.debt.min(increment);
                            if paid == 0 {
                                out.unsplit(frame);
                            } else {
                                shared.debt -= paid;
                                credit_kubelet(out, 0, (increment - paid) as usize);
                            }
                        } else if let Some(intercept) = shared
                            .calls
                            .get_mut(&head.stream)
                            .and_then(|c| c.intercept.as_mut())
                        {
                            // For the relay's own DATA: kubelet had its window from the relay.
                            intercept.send_window += increment;
                            wake_runtime = true;
                        } else {
                            out.unsplit(frame);
                        }
                    }
                    kind::SETTINGS => {
                        for (id, value) in frame::settings(&head, &frame) {
                            match id {
                                setting::INITIAL_WINDOW_SIZE => {
                                    let delta = i64::from(value) - shared.initial_window;
                                    shared.initial_window = i64::from(value);
                                    for intercept in shared
                                        .calls
                                        .values_mut()
                                        .filter_map(|c| c.intercept.as_mut())
                                    {
                                        intercept.send_window += delta;
                                    }
                                    wake_runtime = true;
                                }
                                setting::HEADER_TABLE_SIZE => {
                                    shared.runtime_table_limit =
                                        shared.runtime_table_limit.max(value as usize);
                                }
                                _ => {}
                            }
                        }
                        out.unsplit(frame);
                    }
                    kind::RST_STREAM => {
                        out.unsplit(frame);
                        shared.end_call(head.stream, Some(Code::Cancelled));
                    }
                    _ => out.unsplit(frame),
                },
            }
        }
        self.wake_runtime_if(wake_runtime);
        true
    }

    fn wake_runtime_if(&self, wake: bool) {
        if wake {
            self.runtime_wake.notify();
        }
    }
}

#[cfg(test)]
mod tests;
