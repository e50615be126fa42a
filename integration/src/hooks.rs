//! Hooks that prove the proxy's wiring in tests.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use k8s_cri::v1 as cri;
use tessera_runtime_proxy::{CallOutcome, Hook, HookContext, HookRejection, LifecycleRequest};
use tonic::Code;

/// One hook invocation as seen by [`RecordingHook`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `pre` or `post`.
    pub stage: &'static str,
    /// The CRI method.
    pub method: &'static str,
    /// `namespace/name` of the pod, when the proxy resolved it.
    pub pod: Option<String>,
    /// The container name, when the proxy resolved it.
    pub container: Option<String>,
    /// Whether the call succeeded (post only).
    pub ok: Option<bool>,
}

/// Records every call and, on CreateContainer, sets env `TESSERA_TEST_HOOK=<pod name>`;
/// refuses CreateContainer for containers named `refuse-me`.
#[derive(Debug, Clone, Default)]
pub struct RecordingHook {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl RecordingHook {
    /// What the hook has seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn push(&self, seen: Seen) {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(seen);
    }
}

fn names(ctx: &HookContext) -> (Option<String>, Option<String>) {
    (
        ctx.pod.as_ref().map(|p| p.display_name()),
        ctx.container.as_ref().map(|c| c.name.clone()),
    )
}

#[async_trait]
impl Hook for RecordingHook {
    fn name(&self) -> &str {
        "recording"
    }

    async fn pre(
        &self,
        ctx: &HookContext,
        request: &mut LifecycleRequest,
    ) -> Result<(), HookRejection> {
        let (pod, container) = names(ctx);
        self.push(Seen {
            stage: "pre",
            method: request.method().name(),
            pod: pod.clone(),
            container: container.clone(),
            ok: None,
        });
        if let LifecycleRequest::CreateContainer(req) = request {
            if container.as_deref() == Some("refuse-me") {
                return Err(HookRejection::new(
                    Code::FailedPrecondition,
                    "container refuse-me is refused by the test hook",
                ));
            }
            if let Some(config) = req.config.as_mut() {
                let value = ctx.pod.as_ref().map(|p| p.name.clone()).unwrap_or_default();
                config.envs.retain(|kv| kv.key != "TESSERA_TEST_HOOK");
                config.envs.push(cri::KeyValue {
                    key: "TESSERA_TEST_HOOK".into(),
                    value,
                });
            }
        }
        Ok(())
    }

    async fn post(&self, ctx: &HookContext, request: &LifecycleRequest, outcome: &CallOutcome) {
        let (pod, container) = names(ctx);
        let ok = Some(matches!(outcome, CallOutcome::Ok(_)));
        self.push(Seen {
            stage: "post",
            method: request.method().name(),
            pod,
            container,
            ok,
        });
    }
}
