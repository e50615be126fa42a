//! Kubernetes Events on pods, where `kubectl describe pod` shows them: `Normal
//! GpuAllocated` when a bind placed the pod's GPUs ("placed on GPU GPU-… (50% compute,
//! 8GiB memory = 50%) on node n1"), `Warning GpuBindRefused` when a bind was refused
//! for a reason the pod's owner must see (its request is invalid, or it does not fit
//! the node kube-scheduler chose).
//!
//! An Event never fails or delays a bind: [`PodEvents`] only queues (the daemons'
//! one bounded [`EventQueue`]: when it is full the Event is dropped and counted),
//! and one task hands the queue to an [`EventSink`], each write bounded by
//! [`RECORD_TIMEOUT`]. The real sink, [`KubePodEvents`], writes `events.k8s.io/v1`
//! Events in the pod's namespace through [`tessera_daemon::events`] (not
//! kube-runtime's `Recorder`: see there why); each Event is built by the pure
//! [`pod_event`] and created as it is.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use tessera_api::DeviceAllocations;
use tessera_daemon::events::{
    Announcement, EventKind, EventQueue, EventSink, EventSpec, EventWriter,
};
pub use tessera_daemon::events::{QUEUE_CAPACITY, RECORD_TIMEOUT, counted_in};

use crate::bind::{BindError, BindFailure};
use crate::metrics::{BindResult, SchedulerMetrics, Verb};
use crate::protocol::{ExtenderBindingArgs, ExtenderBindingResult};

/// `reportingController` of every Event the scheduler writes.
pub const REPORTING_CONTROLLER: &str = "tessera.io/scheduler";
/// Reason of the Event a pod gets when its GPUs are placed.
pub const REASON_ALLOCATED: &str = "GpuAllocated";
/// Reason of the Event a pod gets when its bind is refused for a reason of its own.
pub const REASON_REFUSED: &str = "GpuBindRefused";
/// The Event a pod gets when its GPUs are placed.
pub const ALLOCATED: EventKind = EventKind::normal(REASON_ALLOCATED, "Bind");
/// The Event a pod gets when its bind is refused for a reason of its own.
pub const REFUSED: EventKind = EventKind::warning(REASON_REFUSED, "Bind");

/// The pod an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

impl PodRef {
    /// The pod of a bind.
    pub fn of(args: &ExtenderBindingArgs) -> Self {
        Self {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            uid: args.pod_uid.clone(),
        }
    }
}

/// Something a pod's owner is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// A bind wrote the pod's allocation and bound it to `node`.
    Allocated {
        /// The pod.
        pod: PodRef,
        /// Its node.
        node: String,
        /// The allocation annotation written.
        annotation: String,
    },
    /// A bind to `node` was refused for a reason the pod's owner must see.
    Refused {
        /// The pod.
        pod: PodRef,
        /// The node kube-scheduler chose.
        node: String,
        /// Why, in the bind's words.
        why: String,
    },
}

/// Bytes in a GiB and a MiB, for notes.
const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn bytes_text(bytes: u64) -> String {
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{}GiB", bytes / GIB)
    } else if bytes >= MIB && bytes % MIB == 0 {
        format!("{}MiB", bytes / MIB)
    } else {
        format!("{bytes}B")
    }
}

/// "placed on GPU GPU-a (50% compute, 8GiB memory = 50%), GPU GPU-b (…) on node n1",
/// from the annotation written; an annotation that does not parse (never written by
/// this scheduler) is named as it is.
pub fn allocated_note(node: &str, annotation: &str) -> String {
    let Ok(allocations) = DeviceAllocations::parse(annotation) else {
        return format!("placed on node {node}: {annotation}");
    };
    let gpus: Vec<String> = allocations
        .gpus()
        .iter()
        .map(|gpu| {
            let mut share = Vec::new();
            if let Some(core) = gpu.gpu_core() {
                share.push(format!("{core}% compute"));
            }
            match (gpu.gpu_memory(), gpu.gpu_memory_ratio()) {
                (Some(bytes), Some(ratio)) => {
                    share.push(format!("{} memory = {ratio}%", bytes_text(bytes)));
                }
                (Some(bytes), None) => share.push(format!("{} memory", bytes_text(bytes))),
                (None, Some(ratio)) => share.push(format!("{ratio}% memory")),
                (None, None) => {}
            }
            format!("GPU {} ({})", gpu.id, share.join(", "))
        })
        .collect();
    if gpus.is_empty() {
        return format!("placed on node {node} with no GPU");
    }
    format!("placed on {} on node {node}", gpus.join(", "))
}

impl PodEvent {
    /// The pod.
    pub fn pod(&self) -> &PodRef {
        match self {
            Self::Allocated { pod, .. } | Self::Refused { pod, .. } => pod,
        }
    }

    /// The node.
    pub fn node(&self) -> &str {
        match self {
            Self::Allocated { node, .. } | Self::Refused { node, .. } => node,
        }
    }

    /// [`ALLOCATED`] or [`REFUSED`].
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Allocated { .. } => ALLOCATED,
            Self::Refused { .. } => REFUSED,
        }
    }

    /// `GpuAllocated` or `GpuBindRefused`.
    pub fn reason(&self) -> &'static str {
        self.kind().reason
    }

    /// The Event's note, for people (the Event holds its first 1 kB).
    pub fn note(&self) -> String {
        match self {
            Self::Allocated {
                node, annotation, ..
            } => allocated_note(node, annotation),
            Self::Refused { node, why, .. } => format!("not bound to node {node}: {why}"),
        }
    }

    /// The Event, to be stamped: it regards the pod (by UID, so it never lands on a
    /// pod of the same name created later) and relates to the node.
    pub fn spec(&self) -> EventSpec {
        let pod = self.pod();
        EventSpec {
            namespace: pod.namespace.clone(),
            regarding: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                namespace: Some(pod.namespace.clone()),
                name: Some(pod.name.clone()),
                uid: Some(pod.uid.clone()),
                ..ObjectReference::default()
            },
            related: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(self.node().to_owned()),
                ..ObjectReference::default()
            }),
            kind: self.kind(),
            note: self.note(),
        }
    }
}

/// The Event for `event` at `now`, written by replica `instance` (see [`PodEvent::spec`]).
pub fn pod_event(event: &PodEvent, instance: &str, now: Timestamp) -> Event {
    event.spec().event(REPORTING_CONTROLLER, instance, now)
}

/// Why an Event was not written; it is logged and counted, never retried.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// The API server refused the Event or could not be reached.
    #[error("creating Event {reason} on pod {namespace}/{name}")]
    Api {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
        /// The Event's reason.
        reason: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// Writes `events.k8s.io/v1` Events on pods.
#[derive(Debug, Clone)]
pub struct KubePodEvents(EventWriter);

impl KubePodEvents {
    /// Events written by replica `instance` (its Lease identity).
    pub fn new(client: Client, instance: impl Into<String>) -> Self {
        Self(EventWriter::new(client, REPORTING_CONTROLLER, instance))
    }
}

impl EventSink<PodEvent> for KubePodEvents {
    type Error = EventError;

    async fn record(&self, event: &PodEvent) -> Result<(), EventError> {
        self.0
            .create(&event.spec())
            .await
            .map_err(|source| EventError::Api {
                namespace: event.pod().namespace.clone(),
                name: event.pod().name.clone(),
                reason: event.reason(),
                source,
            })
    }
}

/// The bind path's handle on the task that writes Events: sending never waits.
pub type PodEvents = EventQueue<PodEvent>;

impl Announcement for PodEvent {
    fn reason(&self) -> &'static str {
        self.kind().reason
    }

    fn subject(&self) -> String {
        format!("pod {}/{}", self.pod().namespace, self.pod().name)
    }
}

/// Whether the pod's owner must see `error` on the pod: the request itself is
/// wrong, or it does not fit the chosen node. Not leadership, cache or API server
/// trouble: that is the operator's, in the metrics and the log.
pub fn owner_must_see(error: &BindError) -> bool {
    matches!(
        error,
        BindError::Request(_)
            | BindError::Unfit { .. }
            | BindError::NoDevice { .. }
            | BindError::BoundWithoutAllocation { .. }
    )
}

// === impl BindObserver ===

/// What the extender tells about its calls: metrics, and Events on pods. Cheap to
/// clone; every method returns at once.
#[derive(Debug, Clone, Default)]
pub struct BindObserver {
    /// The metrics.
    pub metrics: Arc<SchedulerMetrics>,
    /// The Event queue.
    pub events: PodEvents,
}

impl BindObserver {
    /// Tells through `metrics` and `events`.
    pub fn new(metrics: Arc<SchedulerMetrics>, events: PodEvents) -> Self {
        Self { metrics, events }
    }

    /// One extender call of `verb` (a path's last segment) took `took`.
    pub fn request(&self, verb: &str, took: Duration) {
        if let Some(verb) = Verb::of(verb) {
            self.metrics.record_request(verb, took);
        }
    }

    /// A bind wrote `written` on the pod and bound it to `node` (`None`: a pod that
    /// asks for no GPU, which gets no Event).
    pub fn placed(&self, args: &ExtenderBindingArgs, written: Option<&str>) {
        if let Some(annotation) = written {
            self.events.send(PodEvent::Allocated {
                pod: PodRef::of(args),
                node: args.node.clone(),
                annotation: annotation.to_owned(),
            });
        }
    }

    /// A bind run by this replica ended with `outcome`.
    pub fn finished(&self, args: &ExtenderBindingArgs, outcome: &Result<(), BindFailure>) {
        match outcome {
            Ok(()) => self.metrics.record_bind(BindResult::Bound),
            Err(failure) => self.refused(args, &failure.error),
        }
    }

    /// A bind ended with `error` (before running, or after).
    pub fn refused(&self, args: &ExtenderBindingArgs, error: &BindError) {
        self.metrics.record_bind_error(error);
        if owner_must_see(error) {
            let why = match error {
                // The node is named by the note already.
                BindError::Unfit { reason, .. } => reason.clone(),
                BindError::NoDevice { .. } => {
                    "the node has no Device CR: it reports no GPUs".to_owned()
                }
                other => other.to_string(),
            };
            self.events.send(PodEvent::Refused {
                pod: PodRef::of(args),
                node: args.node.clone(),
                why,
            });
        }
    }

    /// A follower handed the bind to the leader, which answered `result`. An error is
    /// counted as `failed`, cause `forward`, whether the hand-over failed or the leader
    /// refused (the leader's own metrics and Events say why).
    pub fn forwarded(&self, result: &ExtenderBindingResult) {
        if result.error.is_empty() {
            self.metrics.record_bind(BindResult::Forwarded);
        } else {
            self.metrics.record_bind(BindResult::Failed);
            self.metrics
                .bind_errors
                .get_or_create(&crate::metrics::BindErrorLabels {
                    error: "forward".to_owned(),
                    result: "failed".to_owned(),
                })
                .inc();
        }
    }
}

#[cfg(test)]
mod tests;
