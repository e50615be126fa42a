//! The proxy service: every HTTP/2 request from kubelet lands in [`Proxy::handle`].
//! Lifecycle calls are decoded and run through hooks; every other call is
//! forwarded frame by frame without decoding.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use k8s_cri::v1 as cri;
use tonic::Code;
use tracing::{Instrument, Span, field};

use crate::backend::{Backend, BackendError};
use crate::body::{BoxError, ProxyBody, RecvBody, full_body};
use crate::grpc;
use crate::hook::{CallOutcome, Hook, HookContext, LifecycleRequest, LifecycleResponse, Method};
use crate::metrics::{HookLabels, MethodSeries, Metrics};
use crate::store::{ContainerInfo, PodInfo, PodStore, container_info};
use crate::wire;

const LIST_PODS: &str = "/runtime.v1.RuntimeService/ListPodSandbox";
const LIST_CONTAINERS: &str = "/runtime.v1.RuntimeService/ListContainers";

/// The CRI proxy: backends, hooks, store and metrics.
#[derive(Debug)]
pub struct Proxy {
    runtime: Backend,
    image: Backend,
    hooks: Vec<Arc<dyn Hook>>,
    store: Arc<PodStore>,
    metrics: Arc<Metrics>,
    max_message_bytes: usize,
    /// kubelet's connections, counted for tessera-reporter's proof of the switch.
    kubelet: Option<Arc<crate::kubelet_seen::KubeletConnections>>,
}

/// How to build a [`Proxy`].
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// The runtime service socket.
    pub runtime_endpoint: std::path::PathBuf,
    /// The image service socket (usually the same as the runtime's).
    pub image_endpoint: std::path::PathBuf,
    /// Largest intercepted request or response the proxy will hold.
    pub max_message_bytes: usize,
}

impl Proxy {
    /// A proxy running `hooks`, in order, around lifecycle calls.
    pub fn new(options: &ProxyOptions, hooks: Vec<Arc<dyn Hook>>, metrics: Arc<Metrics>) -> Self {
        Self::with_store(options, hooks, metrics, Arc::new(PodStore::default()))
    }

    /// [`Proxy::new`] recording pods and containers in `store`, which hooks may
    /// also read (the GPU hook's one book).
    pub fn with_store(
        options: &ProxyOptions,
        hooks: Vec<Arc<dyn Hook>>,
        metrics: Arc<Metrics>,
        store: Arc<PodStore>,
    ) -> Self {
        let runtime = Backend::new(&options.runtime_endpoint, Arc::clone(&metrics));
        let image = if options.image_endpoint == options.runtime_endpoint {
            runtime.clone()
        } else {
            Backend::new(&options.image_endpoint, Arc::clone(&metrics))
        };
        Self {
            runtime,
            image,
            hooks,
            store,
            metrics,
            max_message_bytes: options.max_message_bytes,
            kubelet: None,
        }
    }

    /// Counts kubelet's connections in `kubelet` as they are accepted and end.
    #[must_use]
    pub fn with_kubelet_connections(
        mut self,
        kubelet: Arc<crate::kubelet_seen::KubeletConnections>,
    ) -> Self {
        self.kubelet = Some(kubelet);
        self
    }

    /// Where kubelet's connections are counted, if anywhere.
    pub fn kubelet_connections(&self) -> Option<&Arc<crate::kubelet_seen::KubeletConnections>> {
        self.kubelet.as_ref()
    }

    /// The pod/container store.
    pub fn store(&self) -> &Arc<PodStore> {
        &self.store
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The runtime backend.
    pub fn runtime(&self) -> &Backend {
        &self.runtime
    }

    /// Loads every sandbox and container the runtime knows into the store.
    pub async fn resync(&self) -> Result<(usize, usize), BackendError> {
        let pods: cri::ListPodSandboxResponse = self
            .runtime
            .unary(LIST_PODS, &cri::ListPodSandboxRequest::default())
            .await?;
        let containers: cri::ListContainersResponse = self
            .runtime
            .unary(LIST_CONTAINERS, &cri::ListContainersRequest::default())
            .await?;
        self.store.load(&pods.items, &containers.containers);
        Ok((pods.items.len(), containers.containers.len()))
    }

    /// Serves one request from kubelet. Never fails: errors become gRPC statuses.
    pub async fn handle(self: Arc<Self>, request: Request<RecvBody>) -> Response<ProxyBody> {
        let path = request.uri().path();
        if let Some(kubelet) = &self.kubelet {
            kubelet.call(path);
        }
        let method_name = path.rsplit('/').next().unwrap_or(path).to_owned();
        let intercepted = Method::from_path(path);
        let span = call_span(&method_name, intercepted.is_some());
        let series = self.metrics.method_series(&method_name);
        let record = CallRecord::start(Arc::clone(&self.metrics), series, span.clone());
        let deadline = request
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .map(grpc::parse_timeout);
        let deadline = match deadline {
            Some(Ok(deadline)) => Some(deadline),
            // A bad header goes to the runtime as it is: its answer is the one kubelet would get.
            Some(Err(_)) | None => None,
        };
        match intercepted {
            Some(method) => {
                // The caller's deadline bounds the whole call: lookups, hooks and the runtime.
                // Boxed: hooks make this future large, and every call's task would
                // otherwise carry (and move) it, passthrough calls included.
                let call = Box::pin(
                    self.intercept(method, request, &record.span)
                        .instrument(span),
                );
                let (response, code) =
                    match deadline {
                        Some(deadline) => tokio::time::timeout(deadline, call)
                            .await
                            .unwrap_or_else(|_| {
                                let message = "context deadline exceeded";
                                (
                                    grpc::status_response(Code::DeadlineExceeded, message),
                                    Code::DeadlineExceeded,
                                )
                            }),
                        None => call.await,
                    };
                record.finish(code);
                response
            }
            None => {
                self.passthrough(request, deadline, record)
                    .instrument(span)
                    .await
            }
        }
    }

    fn backend_for(&self, path: &str) -> &Backend {
        if path.contains(".ImageService/") {
            &self.image
        } else {
            &self.runtime
        }
    }

    async fn passthrough(
        &self,
        request: Request<RecvBody>,
        deadline: Option<Duration>,
        record: CallRecord,
    ) -> Response<ProxyBody> {
        let backend = self.backend_for(request.uri().path()).clone();
        let (parts, body) = request.into_parts();
        let request = Request::from_parts(parts, body.map_err(BoxError::from).boxed_unsync());
        match with_deadline(deadline, backend.send(request)).await {
            Ok(response) => {
                let (parts, body) = response.into_parts();
                match grpc::status_code(&parts.headers) {
                    // Trailers-only: the status is already here.
                    Some(code) => {
                        record.finish(code);
                        Response::from_parts(parts, body.map_err(BoxError::from).boxed_unsync())
                    }
                    None => Response::from_parts(
                        parts,
                        ObservedBody {
                            inner: body,
                            record: Some(record),
                        }
                        .boxed_unsync(),
                    ),
                }
            }
            Err(error) => {
                record.finish(error.code);
                grpc::status_response(error.code, &error.message)
            }
        }
    }

    /// An intercepted call over the proxy's own HTTP/2 connection to the runtime:
    /// read → pre stage → forward → read the answer → post stage.
    async fn intercept(
        &self,
        method: Method,
        request: Request<RecvBody>,
        span: &Span,
    ) -> (Response<ProxyBody>, Code) {
        let (mut parts, body) = request.into_parts();
        let body = match Limited::new(body, self.max_message_bytes).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                let (code, message) = if error.is::<http_body_util::LengthLimitError>() {
                    (Code::ResourceExhausted, self.too_large(method))
                } else {
                    (
                        Code::Cancelled,
                        format!("{}: reading request: {error}", method.name()),
                    )
                };
                return fail(code, &message);
            }
        };
        let prepared = match self.pre_stage(method, body, span).await {
            Ok(prepared) => prepared,
            Err(refusal) => return fail(refusal.code, &refusal.message),
        };
        parts.headers.remove(http::header::CONTENT_LENGTH);
        let request = Request::from_parts(parts, full_body(prepared.forwarded.clone(), None));

        let call = async {
            let response = self.runtime.send(request).await?;
            let (parts, body) = response.into_parts();
            let collected = body.collect().await.map_err(|e| BackendError {
                code: Code::Unavailable,
                message: format!(
                    "runtime {}: reading response: {e}",
                    self.runtime.path().display()
                ),
            })?;
            Ok::<_, BackendError>((parts, collected))
        };
        let (parts, collected) = match call.await {
            Ok(answer) => answer,
            Err(error) => {
                let outcome = CallOutcome::Failed {
                    code: error.code,
                    message: error.message.clone(),
                };
                self.post_stage(&prepared, &outcome).await;
                return fail(error.code, &error.message);
            }
        };
        let trailers = collected.trailers().cloned();
        let (code, message) = grpc::call_status(&parts.headers, trailers.as_ref());
        let data = collected.to_bytes();
        let outcome = call_outcome(method, code, message, &data);
        self.post_stage(&prepared, &outcome).await;
        (Response::from_parts(parts, full_body(data, trailers)), code)
    }

    /// The message for a request over the size the proxy holds.
    pub(crate) fn too_large(&self, method: Method) -> String {
        format!(
            "{}: request larger than {} bytes",
            method.name(),
            self.max_message_bytes
        )
    }

    /// Largest intercepted request or response the proxy will hold.
    pub(crate) fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// The pre stage of an intercepted call, given its whole request body: decode →
    /// context (pod, container) → pre hooks → splice. Returns the body to forward,
    /// or the status the call is refused with.
    pub(crate) async fn pre_stage(
        &self,
        method: Method,
        body: Bytes,
        span: &Span,
    ) -> Result<Prepared, Refusal> {
        let message = grpc::decode_frame(&body)
            .map_err(|error| Refusal::new(Code::Internal, format!("{}: {error}", method.name())))?;
        let original = method.decode_request(message).map_err(|error| {
            let text = format!(
                "grpc: error unmarshalling {} request: {error}",
                method.name()
            );
            Refusal::new(Code::Internal, text)
        })?;

        let ctx = self.context(&original).await;
        if let Some(pod) = &ctx.pod {
            span.record("pod", pod.display_name());
        }
        if let Some(container) = &ctx.container {
            span.record("container", container.name.as_str());
        }

        let mut rewritten = original.clone();
        for hook in &self.hooks {
            let started = Instant::now();
            let result = hook.pre(&ctx, &mut rewritten).await;
            self.observe_hook(hook.name(), "pre", started, result.is_err());
            if let Err(rejection) = result {
                tracing::warn!(hook = hook.name(), code = ?rejection.code, reason = %rejection.message, "hook refused call");
                return Err(Refusal::new(
                    rejection.code,
                    format!("tessera hook {:?}: {}", hook.name(), rejection.message),
                ));
            }
        }

        let forwarded = if rewritten == original {
            body
        } else {
            // Spliced at the wire level: fields our CRI types do not know survive.
            let merged = wire::merge(
                message,
                &original.encode_to_vec(),
                &rewritten.encode_to_vec(),
            )
            .map_err(|error| {
                Refusal::new(
                    Code::Internal,
                    format!("{}: rewriting request: {error}", method.name()),
                )
            })?;
            grpc::encode_frame(&merged)
        };
        Ok(Prepared {
            ctx,
            request: rewritten,
            forwarded,
        })
    }

    /// The post stage of an intercepted call: the store learns the outcome, then
    /// every hook observes it.
    pub(crate) async fn post_stage(&self, prepared: &Prepared, outcome: &CallOutcome) {
        self.update_store(&prepared.request, &prepared.ctx, outcome);
        self.run_post(&prepared.ctx, &prepared.request, outcome)
            .await;
    }

    fn observe_hook(&self, hook: &str, stage: &str, started: Instant, failed: bool) {
        let labels = HookLabels {
            hook: hook.to_owned(),
            stage: stage.to_owned(),
        };
        self.metrics
            .hook_duration
            .get_or_create(&labels)
            .observe(started.elapsed().as_secs_f64());
        if failed {
            self.metrics.hook_failures.get_or_create(&labels).inc();
        }
    }

    async fn run_post(&self, ctx: &HookContext, request: &LifecycleRequest, outcome: &CallOutcome) {
        for hook in &self.hooks {
            let started = Instant::now();
            hook.post(ctx, request, outcome).await;
            self.observe_hook(hook.name(), "post", started, false);
        }
    }

    /// The pod and container a lifecycle call concerns.
    async fn context(&self, request: &LifecycleRequest) -> HookContext {
        match request {
            LifecycleRequest::RunPodSandbox(req) => HookContext {
                pod: req
                    .config
                    .as_ref()
                    .map(|config| Arc::new(self.store.pod_from_config("", config))),
                container: None,
            },
            LifecycleRequest::StopPodSandbox(cri::StopPodSandboxRequest { pod_sandbox_id })
            | LifecycleRequest::RemovePodSandbox(cri::RemovePodSandboxRequest { pod_sandbox_id }) => {
                HookContext {
                    pod: self.lookup_pod(pod_sandbox_id).await,
                    container: None,
                }
            }
            LifecycleRequest::CreateContainer(req) => {
                // kubelet sends the pod's config with every CreateContainer: it is the freshest view.
                let pod = match &req.sandbox_config {
                    Some(config) => Some(Arc::new(
                        self.store.pod_from_config(&req.pod_sandbox_id, config),
                    )),
                    None => self.lookup_pod(&req.pod_sandbox_id).await,
                };
                let name = req
                    .config
                    .as_ref()
                    .and_then(|c| c.metadata.as_ref())
                    .map(|m| m.name.clone())
                    .unwrap_or_default();
                let container = ContainerInfo {
                    id: String::new(),
                    name,
                    sandbox_id: req.pod_sandbox_id.clone(),
                };
                HookContext {
                    pod,
                    container: Some(container),
                }
            }
            LifecycleRequest::StartContainer(cri::StartContainerRequest { container_id })
            | LifecycleRequest::StopContainer(cri::StopContainerRequest { container_id, .. })
            | LifecycleRequest::RemoveContainer(cri::RemoveContainerRequest { container_id })
            | LifecycleRequest::UpdateContainerResources(cri::UpdateContainerResourcesRequest {
                container_id,
                ..
            }) => match self.lookup_container(container_id).await {
                Some((container, pod)) => HookContext {
                    pod,
                    container: Some(container),
                },
                None => HookContext::default(),
            },
        }
    }

    async fn lookup_pod(&self, sandbox_id: &str) -> Option<Arc<PodInfo>> {
        if let Some(pod) = self.store.pod(sandbox_id) {
            return Some(pod);
        }
        let filter = cri::PodSandboxFilter {
            id: sandbox_id.to_owned(),
            ..Default::default()
        };
        let request = cri::ListPodSandboxRequest {
            filter: Some(filter),
        };
        let response: cri::ListPodSandboxResponse =
            self.runtime.unary(LIST_PODS, &request).await.ok()?;
        let sandbox = response.items.into_iter().find(|s| s.id == sandbox_id)?;
        Some(self.store.insert_pod(self.store.pod_from_sandbox(&sandbox)))
    }

    async fn lookup_container(
        &self,
        container_id: &str,
    ) -> Option<(ContainerInfo, Option<Arc<PodInfo>>)> {
        if let Some(found) = self.store.container(container_id) {
            if found.1.is_some() {
                return Some(found);
            }
            let pod = self.lookup_pod(&found.0.sandbox_id).await;
            return Some((found.0, pod));
        }
        let filter = cri::ContainerFilter {
            id: container_id.to_owned(),
            ..Default::default()
        };
        let request = cri::ListContainersRequest {
            filter: Some(filter),
        };
        let response: cri::ListContainersResponse =
            self.runtime.unary(LIST_CONTAINERS, &request).await.ok()?;
        let container = response
            .containers
            .iter()
            .find(|c| c.id == container_id)
            .map(container_info)?;
        self.store.insert_container(container.clone());
        let pod = self.lookup_pod(&container.sandbox_id).await;
        Some((container, pod))
    }

    fn update_store(&self, request: &LifecycleRequest, ctx: &HookContext, outcome: &CallOutcome) {
        let CallOutcome::Ok(response) = outcome else {
            return;
        };
        match (request, response) {
            (LifecycleRequest::RunPodSandbox(_), LifecycleResponse::RunPodSandbox(resp)) => {
                // The pod the call's context read from its config (and the DRA
                // claims file), now with the sandbox ID the runtime gave it.
                if let Some(pod) = &ctx.pod {
                    let mut pod = PodInfo::clone(pod);
                    pod.sandbox_id.clone_from(&resp.pod_sandbox_id);
                    self.store.insert_pod(pod);
                }
            }
            (LifecycleRequest::CreateContainer(req), LifecycleResponse::CreateContainer(resp)) => {
                if self.store.pod(&req.pod_sandbox_id).is_none() {
                    if let Some(pod) = &ctx.pod {
                        self.store.insert_pod(PodInfo::clone(pod));
                    }
                }
                let name = ctx
                    .container
                    .as_ref()
                    .map(|c| c.name.clone())
                    .unwrap_or_default();
                self.store.insert_container(ContainerInfo {
                    id: resp.container_id.clone(),
                    name,
                    sandbox_id: req.pod_sandbox_id.clone(),
                });
            }
            (LifecycleRequest::StopPodSandbox(req), _) => {
                self.store.mark_stopped(&req.pod_sandbox_id)
            }
            (LifecycleRequest::RemovePodSandbox(req), _) => {
                self.store.remove_pod(&req.pod_sandbox_id)
            }
            (LifecycleRequest::RemoveContainer(req), _) => {
                self.store.remove_container(&req.container_id)
            }
            _ => {}
        }
    }
}

async fn with_deadline<T>(
    deadline: Option<Duration>,
    call: impl std::future::Future<Output = Result<T, BackendError>>,
) -> Result<T, BackendError> {
    let exceeded = || BackendError {
        code: Code::DeadlineExceeded,
        message: "context deadline exceeded".to_owned(),
    };
    match deadline {
        None => call.await,
        Some(deadline) => {
            let started = tokio::time::Instant::now();
            match tokio::time::timeout(deadline, call).await {
                Err(_) => Err(exceeded()),
                // The runtime resets a call whose deadline (the one forwarded to it)
                // passed, and that reads as Unavailable here: past the caller's
                // deadline, the caller is told what it would hear from the runtime.
                Ok(Err(_)) if started.elapsed() >= deadline => Err(exceeded()),
                Ok(answer) => answer,
            }
        }
    }
}

/// An intercepted call that passed its pre stage.
#[derive(Debug)]
pub(crate) struct Prepared {
    ctx: HookContext,
    /// The request as the hooks left it.
    request: LifecycleRequest,
    /// The gRPC body to send the runtime: the original bytes, or the splice.
    pub(crate) forwarded: Bytes,
}

/// Why the proxy answers an intercepted call itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) code: Code,
    pub(crate) message: String,
}

impl Refusal {
    pub(crate) fn new(code: Code, message: String) -> Self {
        Self { code, message }
    }
}

/// What the hooks' post stage is told about the runtime's answer: its status and,
/// when Ok, its decoded message.
pub(crate) fn call_outcome(
    method: Method,
    code: Code,
    message: String,
    data: &[u8],
) -> CallOutcome {
    if code != Code::Ok {
        return CallOutcome::Failed { code, message };
    }
    match grpc::decode_frame(data)
        .map_err(|e| e.to_string())
        .and_then(|m| method.decode_response(m).map_err(|e| e.to_string()))
    {
        Ok(response) => CallOutcome::Ok(response),
        Err(error) => {
            tracing::warn!(%error, "could not decode the runtime's response; passing it on unchanged");
            CallOutcome::Failed {
                code: Code::Internal,
                message: error,
            }
        }
    }
}

/// The span of one call. Lifecycle calls are rare and matter: info. Kubelet polls
/// the rest many times a second: their spans exist at debug, off the default hot path.
pub(crate) fn call_span(method: &str, intercepted: bool) -> Span {
    if intercepted {
        tracing::info_span!(
            "cri",
            method = %method,
            pod = field::Empty,
            container = field::Empty,
            code = field::Empty,
            duration_us = field::Empty,
        )
    } else {
        tracing::debug_span!("cri", method = %method, code = field::Empty, duration_us = field::Empty)
    }
}

/// A call the proxy fails itself, as a gRPC status and its code.
fn fail(code: Code, message: &str) -> (Response<ProxyBody>, Code) {
    if code != Code::Unavailable {
        tracing::warn!(?code, message, "call failed");
    }
    (grpc::status_response(code, message), code)
}

// === impl CallRecord ===

/// Metrics and span fields of one call, recorded once when it ends (on both
/// serve paths: [`Proxy::handle`] and the frame relay).
pub(crate) struct CallRecord {
    metrics: Arc<Metrics>,
    series: MethodSeries,
    start: Instant,
    span: Span,
    finished: bool,
}

impl CallRecord {
    /// Starts timing a call of `series`' method, whose fields are recorded on `span`.
    pub(crate) fn start(metrics: Arc<Metrics>, series: MethodSeries, span: Span) -> Self {
        Self::started_at(metrics, series, span, Instant::now())
    }

    /// As [`CallRecord::start`], for a call that began at `start`.
    pub(crate) fn started_at(
        metrics: Arc<Metrics>,
        series: MethodSeries,
        span: Span,
        start: Instant,
    ) -> Self {
        Self {
            metrics,
            series,
            start,
            span,
            finished: false,
        }
    }

    pub(crate) fn finish(mut self, code: Code) {
        self.complete(code);
    }

    fn complete(&mut self, code: Code) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let elapsed = self.start.elapsed();
        self.metrics
            .record(&self.series, code, elapsed.as_secs_f64());
        self.span.record("code", format_args!("{code:?}"));
        self.span.record("duration_us", elapsed.as_micros() as u64);
        tracing::debug!(parent: &self.span, "call finished");
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        // The caller (or the relayed connection) went away before the call ended.
        self.complete(Code::Cancelled);
    }
}

// === impl ObservedBody ===

/// A streamed response body that records the call's status when its trailers pass.
struct ObservedBody {
    inner: RecvBody,
    record: Option<CallRecord>,
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref() {
                    let code = grpc::status_code(trailers).unwrap_or(Code::Unknown);
                    if let Some(record) = self.record.take() {
                        record.finish(code);
                    }
                }
            }
            Poll::Ready(Some(Err(_))) => {
                if let Some(record) = self.record.take() {
                    record.finish(Code::Unavailable);
                }
            }
            Poll::Ready(None) => {
                if let Some(record) = self.record.take() {
                    record.finish(Code::Unknown);
                }
            }
            Poll::Pending => {}
        }
        polled.map_err(BoxError::from)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod deadline_tests {
    use super::*;

    fn reset() -> Result<(), BackendError> {
        Err(BackendError {
            code: Code::Unavailable,
            message: "stream reset".to_owned(),
        })
    }

    /// A runtime that resets a call whose deadline has passed: the caller hears
    /// DeadlineExceeded, as from the runtime directly; a reset within the deadline
    /// stays what it is.
    #[tokio::test]
    async fn a_reset_past_the_callers_deadline_is_deadline_exceeded() {
        let past = with_deadline(Some(Duration::ZERO), async { reset() }).await;
        assert_eq!(past.err().map(|e| e.code), Some(Code::DeadlineExceeded));
        let within = with_deadline(Some(Duration::from_secs(10)), async { reset() }).await;
        assert_eq!(within.err().map(|e| e.code), Some(Code::Unavailable));
        let none = with_deadline(None, async { reset() }).await;
        assert_eq!(none.err().map(|e| e.code), Some(Code::Unavailable));
    }
}
