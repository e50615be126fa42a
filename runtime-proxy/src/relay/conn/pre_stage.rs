//! The pre stage of a lifecycle call: its request body held, the hooks run, the
//! (possibly rewritten) request re-emitted.

use super::*;

/// A lifecycle call whose request is complete, on its own task.
pub(super) struct PreStage {
    pub(super) proxy: Arc<Proxy>,
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) runtime_wake: Arc<Wake>,
    pub(super) kubelet_wake: Arc<Wake>,
    pub(super) stream: u32,
    pub(super) method: Method,
    pub(super) deadline: Option<Duration>,
}

impl PreStage {
    /// pre stage (under the caller's deadline) → forward → observe → post stage.
    pub(super) async fn run(self, body: Bytes) {
        let span = Span::current();
        let pre = self.proxy.pre_stage(self.method, body, &span);
        let prepared = match self.deadline {
            Some(deadline) => tokio::time::timeout(deadline, pre)
                .await
                .unwrap_or_else(|_| {
                    Err(Refusal::new(
                        Code::DeadlineExceeded,
                        "context deadline exceeded".to_owned(),
                    ))
                }),
            None => pre.await,
        };
        let (answer_to, answer) = oneshot::channel();
        {
            let mut shared = lock(&self.shared);
            let shared = &mut *shared;
            let Some(intercept) = shared
                .calls
                .get_mut(&self.stream)
                .and_then(|c| c.intercept.as_mut())
            else {
                // Kubelet cancelled the call meanwhile.
                return;
            };
            match &prepared {
                Err(refusal) => {
                    if refusal.code != Code::Unavailable {
                        tracing::warn!(code = ?refusal.code, message = %refusal.message, "call failed");
                    }
                    refuse(shared, self.stream, refusal);
                    self.kubelet_wake.notify();
                }
                Ok(prepared) => {
                    intercept.answer_to = Some(answer_to);
                    for data in frame::data_frames(self.stream, &prepared.forwarded, true) {
                        let flow = (data.len() - frame::HEAD_LEN) as i64;
                        shared.debt += flow;
                        shared.injected_runtime.push_back(Outbound {
                            frame: data,
                            stream: self.stream,
                            flow,
                            own: true,
                        });
                    }
                }
            }
            self.runtime_wake.notify();
        }
        let Ok(prepared) = prepared else {
            return;
        };
        // Kubelet has (or is getting) the answer already: post hooks observe it
        // after the fact and cannot delay it.
        let Ok(answer) = answer.await else {
            return;
        };
        let code = answer.code.unwrap_or(Code::Unknown);
        let data: &[u8] = if answer.truncated { &[] } else { &answer.data };
        let outcome = call_outcome(self.method, code, answer.message, data);
        self.proxy.post_stage(&prepared, &outcome).await;
    }
}
