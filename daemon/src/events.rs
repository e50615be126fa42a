//! Writing `events.k8s.io/v1` Events, shared by the daemons that tell people what they
//! did: the scheduler (on pods: GPUs placed, a bind refused) and the reporter (on Nodes:
//! a GPU unhealthy, healthy again). Each daemon says what an Event is about and what
//! it says ([`EventSpec`]); the Event's name, its fields' limits and the write are here,
//! and the one queue ([`EventQueue`]) that keeps the writes off the daemons' loops.
//!
//! Not kube-runtime's `Recorder`: it folds Events with the same reason on the same
//! object into one series for six minutes and keeps the first Event's note, so a
//! second GPU going bad (or a second refusal naming another node) within that time
//! would be shown in the first one's words. Each Event here is created as it is built.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::mpsc::{Receiver, Sender, error::TrySendError};

use crate::binary::error_chain;

/// The longest note the API server takes (1 kB).
pub const MAX_NOTE: usize = 1024;
/// The longest object name the API server takes (a DNS subdomain).
pub const MAX_NAME: usize = 253;
/// The longest `reportingInstance`.
pub const MAX_INSTANCE: usize = 128;

/// `text` cut to at most `max` bytes, on a character boundary.
pub fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// What kind of Event: its `type`, `reason` and machine-readable `action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventKind {
    /// `Normal` or `Warning`.
    pub type_: &'static str,
    /// Why, in one CamelCase word, e.g. `GpuAllocated`.
    pub reason: &'static str,
    /// What the writer did, e.g. `Bind`.
    pub action: &'static str,
}

impl EventKind {
    /// A `Normal` Event: something went as it should.
    pub const fn normal(reason: &'static str, action: &'static str) -> Self {
        Self {
            type_: "Normal",
            reason,
            action,
        }
    }

    /// A `Warning` Event: something someone may have to act on.
    pub const fn warning(reason: &'static str, action: &'static str) -> Self {
        Self {
            type_: "Warning",
            reason,
            action,
        }
    }
}

/// One Event, before it is stamped and named.
#[derive(Debug, Clone, PartialEq)]
pub struct EventSpec {
    /// The namespace the Event is written in: the object's own, or `default` for a
    /// cluster-scoped object (as kubelet does for Nodes).
    pub namespace: String,
    /// The object the Event is about; its name names the Event.
    pub regarding: ObjectReference,
    /// A second object it relates to.
    pub related: Option<ObjectReference>,
    /// Its type, reason and action.
    pub kind: EventKind,
    /// What it says to people; cut to [`MAX_NOTE`].
    pub note: String,
}

impl EventSpec {
    /// The Event at `now`, written by `controller`'s replica `instance`.
    pub fn event(&self, controller: &str, instance: &str, now: Timestamp) -> Event {
        let regarding = self.regarding.name.as_deref().unwrap_or_default();
        // `<object>.<nanoseconds in hex>`, as client-go names Events; cut to fit.
        let stamp = format!(".{:x}", now.as_nanosecond());
        let name = format!(
            "{}{stamp}",
            truncated(regarding, MAX_NAME.saturating_sub(stamp.len()))
        );
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(self.kind.type_.to_owned()),
            reason: Some(self.kind.reason.to_owned()),
            action: Some(self.kind.action.to_owned()),
            note: Some(truncated(&self.note, MAX_NOTE).to_owned()),
            regarding: Some(self.regarding.clone()),
            related: self.related.clone(),
            reporting_controller: Some(controller.to_owned()),
            reporting_instance: Some(truncated(instance, MAX_INSTANCE).to_owned()),
            ..Event::default()
        }
    }
}

/// Creates Events as one replica of one controller.
#[derive(Clone)]
pub struct EventWriter {
    client: Client,
    controller: &'static str,
    instance: String,
}

impl std::fmt::Debug for EventWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventWriter")
            .field("controller", &self.controller)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl EventWriter {
    /// Events whose `reportingController` is `controller` (e.g. `tessera.io/scheduler`)
    /// and `reportingInstance` is `instance` (the replica: a Lease identity, a node).
    pub fn new(client: Client, controller: &'static str, instance: impl Into<String>) -> Self {
        Self {
            client,
            controller,
            instance: instance.into(),
        }
    }

    /// The replica's name.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Creates the Event of `spec`, stamped now, once: no retry, no series.
    pub async fn create(&self, spec: &EventSpec) -> Result<(), kube::Error> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &spec.namespace);
        let event = spec.event(self.controller, &self.instance, Timestamp::now());
        events.create(&PostParams::default(), &event).await?;
        Ok(())
    }
}

// === The queue: Events off the hot path ===

/// An Event a daemon queues: what the queue logs and counts it by.
pub trait Announcement: Send + 'static {
    /// The Event's reason (`GpuAllocated`, `GpuUnhealthy`, …): its count's label.
    fn reason(&self) -> &'static str;
    /// What it is about, for logs: a pod, a GPU, a container.
    fn subject(&self) -> String;
}

/// Where a queue's Events go: the API server, or a test's recording.
pub trait EventSink<E>: Send + Sync + 'static {
    /// Why an Event was not recorded.
    type Error: std::error::Error + Send;
    /// Records one Event.
    fn record(&self, event: &E) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// Counts each Event's outcome by its reason: `recorded`, `failed` (refused, or no
/// answer in time) or `dropped` (the queue was full). Each daemon counts into its
/// own `*_events_total`.
pub type OutcomeCounter = Arc<dyn Fn(&'static str, &'static str) + Send + Sync>;

/// Labels of a daemon's `*_events_total` (`tessera_scheduler_events_total`,
/// `tessera_reporter_events_total`).
#[cfg(feature = "metrics")]
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct EventLabels {
    /// The Event's reason (`GpuAllocated`, `GpuUnhealthy`, …).
    pub reason: String,
    /// `recorded`, `failed` (the API server refused it or did not answer in time) or
    /// `dropped` (the queue was full).
    pub outcome: String,
}

/// Counts Events' outcomes into a daemon's `*_events_total`.
#[cfg(feature = "metrics")]
pub fn counted_in(
    counts: prometheus_client::metrics::family::Family<
        EventLabels,
        prometheus_client::metrics::counter::Counter,
    >,
) -> OutcomeCounter {
    Arc::new(move |reason, outcome| {
        counts
            .get_or_create(&EventLabels {
                reason: reason.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    })
}

/// Events waiting to be written; more are dropped (and counted) rather than held.
pub const QUEUE_CAPACITY: usize = 1024;
/// How long one Event's write may take before it is given up.
pub const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

/// A daemon's handle on the one task that writes its Events, in order: sending never
/// waits, and a slow or refusing API server never holds the sender up. At most a
/// bounded number wait; each write is given up after a timeout. Cheap to clone.
pub struct EventQueue<E> {
    queue: Option<Sender<E>>,
    count: Option<OutcomeCounter>,
}

impl<E> Clone for EventQueue<E> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            count: self.count.clone(),
        }
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self {
            queue: None,
            count: None,
        }
    }
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("writing", &self.queue.is_some())
            .finish_non_exhaustive()
    }
}

impl<E: Announcement> EventQueue<E> {
    /// Records nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Spawns the task that hands each Event to `sink`, in order, each write given up
    /// after `timeout` ([`RECORD_TIMEOUT`]), counting outcomes with `count`; at most
    /// `capacity` ([`QUEUE_CAPACITY`]) wait. The task ends once every handle is
    /// dropped and what was queued is written: await it to flush on shutdown.
    pub fn spawn(
        sink: impl EventSink<E>,
        count: OutcomeCounter,
        capacity: usize,
        timeout: Duration,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (queue, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        let task = tokio::spawn(record_all(sink, rx, Arc::clone(&count), timeout));
        let handle = Self {
            queue: Some(queue),
            count: Some(count),
        };
        (handle, task)
    }

    /// Queues `event`; when the queue is full it is dropped, logged and counted.
    pub fn send(&self, event: impl Into<E>) {
        let Some(queue) = &self.queue else {
            return;
        };
        if let Err(error) = queue.try_send(event.into()) {
            let (event, why) = match error {
                TrySendError::Full(event) => (event, "the queue to the API server is full"),
                TrySendError::Closed(event) => (event, "the task writing Events has stopped"),
            };
            tracing::warn!(
                subject = event.subject(),
                reason = event.reason(),
                "Event dropped: {why}"
            );
            if let Some(count) = &self.count {
                count(event.reason(), "dropped");
            }
        }
    }
}

async fn record_all<E: Announcement>(
    sink: impl EventSink<E>,
    mut queue: Receiver<E>,
    count: OutcomeCounter,
    timeout: Duration,
) {
    while let Some(event) = queue.recv().await {
        let outcome = match tokio::time::timeout(timeout, sink.record(&event)).await {
            Ok(Ok(())) => {
                tracing::debug!(
                    subject = event.subject(),
                    reason = event.reason(),
                    "Event recorded"
                );
                "recorded"
            }
            Ok(Err(error)) => {
                tracing::warn!(error = %error_chain(&error), "Event not recorded");
                "failed"
            }
            Err(_) => {
                tracing::warn!(
                    subject = event.subject(),
                    reason = event.reason(),
                    "Event not recorded: no answer from the API server within {timeout:?}"
                );
                "failed"
            }
        };
        count(event.reason(), outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(regarding: &str, note: String) -> EventSpec {
        EventSpec {
            namespace: "team-a".into(),
            regarding: ObjectReference {
                kind: Some("Pod".into()),
                name: Some(regarding.into()),
                ..ObjectReference::default()
            },
            related: None,
            kind: EventKind::normal("Tested", "Test"),
            note,
        }
    }

    #[test]
    fn the_event_is_named_after_its_object_and_stamped() {
        let now = Timestamp::from_second(1_700_000_000).expect("time");
        let event = spec("train-0", "ok".into()).event("tessera.io/test", "replica-0", now);
        assert_eq!(
            event.metadata.name.as_deref(),
            Some("train-0.17979cfe362a0000")
        );
        assert_eq!(event.metadata.namespace.as_deref(), Some("team-a"));
        assert_eq!(event.event_time, Some(MicroTime(now)));
        assert_eq!(
            (
                event.type_.as_deref(),
                event.reason.as_deref(),
                event.action.as_deref(),
                event.note.as_deref()
            ),
            (Some("Normal"), Some("Tested"), Some("Test"), Some("ok"))
        );
        assert_eq!(
            event.regarding.and_then(|r| r.name),
            Some("train-0".to_owned())
        );
        assert_eq!(event.related, None);
        assert_eq!(
            (
                event.reporting_controller.as_deref(),
                event.reporting_instance.as_deref()
            ),
            (Some("tessera.io/test"), Some("replica-0"))
        );
    }

    #[test]
    fn long_names_notes_and_instances_are_cut_to_what_the_api_server_takes() {
        let event = spec(&"n".repeat(253), "é".repeat(600)).event(
            "tessera.io/test",
            &"i".repeat(300),
            Timestamp::now(),
        );
        assert!(event.metadata.name.expect("name").len() <= MAX_NAME);
        // 1200 bytes of two-byte characters: cut at a boundary, not mid-character.
        assert_eq!(event.note.expect("note"), "é".repeat(512));
        assert_eq!(
            event.reporting_instance.expect("instance").len(),
            MAX_INSTANCE
        );
    }

    #[test]
    fn truncation_keeps_whole_characters() {
        assert_eq!(truncated("abc", 10), "abc");
        assert_eq!(truncated("abc", 2), "ab");
        assert_eq!(truncated("aé", 2), "a");
        assert_eq!(truncated("", 0), "");
    }
}
