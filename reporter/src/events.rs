//! Kubernetes Events the reporter writes:
//! - on the Node, about its GPUs' health: `Warning GpuUnhealthy` when a critical XID
//!   takes a GPU out of the node's capacity, `Normal GpuHealthy` when it is back;
//! - on a pod, about its containers' GPU memory ([`crate::usage::MemoryEvent`]):
//!   `Warning GpuMemoryAtLimit`, `Warning GpuUsedWithoutGrant`.
//!
//! What to announce is decided by pure steps ([`health_changes`],
//! [`crate::usage::MemoryAlerts`]); announcing is a task behind an [`EventSink`],
//! fed through [`GpuEvents`] (bounded, each write given up after
//! [`RECORD_TIMEOUT`]), so a slow or refusing API server never holds the
//! reporter's loop up. The real sink, [`KubeNodeEvents`], writes
//! `events.k8s.io/v1` Events (a Node's in the `default` namespace, as kubelet does),
//! through [`tessera_daemon::events`] (not kube-runtime's `Recorder`: see there why).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use tessera_api::Device;
use tessera_daemon::events::{
    Announcement, EventKind, EventQueue, EventSink, EventSpec, EventWriter,
};
pub use tessera_daemon::events::{QUEUE_CAPACITY, RECORD_TIMEOUT, counted_in};

/// `reportingController` of every Event the reporter writes.
pub const REPORTING_CONTROLLER: &str = "tessera.io/reporter";
/// Reason of the Event a GPU gets when a critical XID takes it out.
pub const REASON_UNHEALTHY: &str = "GpuUnhealthy";
/// Reason of the Event a GPU gets when it is healthy again.
pub const REASON_HEALTHY: &str = "GpuHealthy";
/// Where Events about cluster-scoped objects (Nodes) live.
pub const EVENT_NAMESPACE: &str = "default";
/// The Event a GPU gets when a critical XID takes it out of the node's capacity.
pub const UNHEALTHY: EventKind = EventKind::warning(REASON_UNHEALTHY, "WithdrawCapacity");
/// The Event a GPU gets when it is back in the node's capacity.
pub const HEALTHY: EventKind = EventKind::normal(REASON_HEALTHY, "RestoreCapacity");

/// A change in one GPU's health, as announced on the Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuHealthChange {
    /// A critical XID made the GPU unhealthy: it leaves the node's capacity.
    Unhealthy {
        /// The GPU's UUID.
        uuid: String,
        /// The XID that took it out.
        xid: u64,
    },
    /// No critical XID for the recovery period: the GPU is back in the node's capacity.
    Healthy {
        /// The GPU's UUID.
        uuid: String,
    },
}

impl GpuHealthChange {
    /// The GPU's UUID.
    pub fn uuid(&self) -> &str {
        match self {
            Self::Unhealthy { uuid, .. } | Self::Healthy { uuid } => uuid,
        }
    }

    /// [`UNHEALTHY`] or [`HEALTHY`]: the Event's type, reason, and what the reporter
    /// does about it (its machine-readable `action`).
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Unhealthy { .. } => UNHEALTHY,
            Self::Healthy { .. } => HEALTHY,
        }
    }

    /// `GpuUnhealthy` or `GpuHealthy`.
    pub fn reason(&self) -> &'static str {
        self.kind().reason
    }

    /// The Event's note, for people: the GPU, the XID and what follows.
    pub fn note(&self, recovery_after: Duration) -> String {
        let period = if recovery_after.subsec_millis() == 0 {
            format!("{}s", recovery_after.as_secs())
        } else {
            format!("{}ms", recovery_after.as_millis())
        };
        match self {
            Self::Unhealthy { uuid, xid } => format!(
                "GPU {uuid} unhealthy: XID {xid}; taken out of the node's capacity until {period} pass without a critical XID"
            ),
            Self::Healthy { uuid } => format!(
                "GPU {uuid} healthy again: no critical XID for {period}; back in the node's capacity"
            ),
        }
    }
}

/// What to announce when the unhealthy GPUs (UUID → last critical XID) go from
/// `announced` to `now`: GPUs that turned unhealthy first, then those that recovered,
/// each in UUID order. A GPU unhealthy in both, whatever its XID, is not announced again.
pub fn health_changes(
    announced: &BTreeMap<String, u64>,
    now: &BTreeMap<String, u64>,
) -> Vec<GpuHealthChange> {
    let turned = now
        .iter()
        .filter(|(uuid, _)| !announced.contains_key(*uuid))
        .map(|(uuid, xid)| GpuHealthChange::Unhealthy {
            uuid: uuid.clone(),
            xid: *xid,
        });
    let recovered = announced
        .keys()
        .filter(|uuid| !now.contains_key(*uuid))
        .map(|uuid| GpuHealthChange::Healthy { uuid: uuid.clone() });
    turned.chain(recovered).collect()
}

/// What the reporter tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReporterEvent {
    /// A GPU's health changed (on the Node).
    Health(GpuHealthChange),
    /// A container's GPU memory (on its pod).
    Memory(crate::usage::MemoryEvent),
}

impl From<GpuHealthChange> for ReporterEvent {
    fn from(change: GpuHealthChange) -> Self {
        Self::Health(change)
    }
}

impl From<crate::usage::MemoryEvent> for ReporterEvent {
    fn from(event: crate::usage::MemoryEvent) -> Self {
        Self::Memory(event)
    }
}

impl ReporterEvent {
    /// Its reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Health(change) => change.reason(),
            Self::Memory(event) => event.kind().reason,
        }
    }

    /// What it is about, for logs: a GPU, or `namespace/pod/container`.
    pub fn subject(&self) -> String {
        match self {
            Self::Health(change) => change.uuid().to_owned(),
            Self::Memory(event) => {
                let about = event.container();
                format!("{}/{}/{}", about.namespace, about.pod, about.container)
            }
        }
    }
}

/// Why an Event was not written; it is logged and counted, never retried.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// The API server refused the Event or could not be reached.
    #[error("creating Event {reason} about {subject} (node {node})")]
    Api {
        /// The node whose reporter wrote it.
        node: String,
        /// What it is about: a GPU, or `namespace/pod/container`.
        subject: String,
        /// The Event's reason.
        reason: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// The loop's handle on the task that records Events (the daemons' one
/// [`EventQueue`]): sending never waits.
pub type GpuEvents = EventQueue<ReporterEvent>;

impl Announcement for ReporterEvent {
    fn reason(&self) -> &'static str {
        ReporterEvent::reason(self)
    }

    fn subject(&self) -> String {
        ReporterEvent::subject(self)
    }
}

/// Writes `events.k8s.io/v1` Events about one Node, as that node's reporter.
#[derive(Debug, Clone)]
pub struct KubeNodeEvents {
    /// Its instance is the node's name.
    writer: EventWriter,
    recovery_after: Duration,
}

impl KubeNodeEvents {
    /// Events about `node`, whose notes name `recovery_after` (`--recovery-after`).
    pub fn new(client: Client, node: impl Into<String>, recovery_after: Duration) -> Self {
        Self {
            writer: EventWriter::new(client, REPORTING_CONTROLLER, node),
            recovery_after,
        }
    }
}

/// The Event about `node` for `change`, to be stamped, whose note names `recovery_after`.
/// Like kubelet's, it regards the Node with the node's name as its UID (no need to read
/// the Node first); it relates to the node's Device CR, where the GPU's health is published.
pub fn node_event_spec(
    node: &str,
    recovery_after: Duration,
    change: &GpuHealthChange,
) -> EventSpec {
    EventSpec {
        namespace: EVENT_NAMESPACE.to_owned(),
        regarding: ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            uid: Some(node.to_owned()),
            ..ObjectReference::default()
        },
        related: Some(Device::reference(node)),
        kind: change.kind(),
        note: change.note(recovery_after),
    }
}

/// The Event about `node` for `change` at `now`, written by that node's reporter (see
/// [`node_event_spec`]).
pub fn node_event(
    node: &str,
    recovery_after: Duration,
    change: &GpuHealthChange,
    now: Timestamp,
) -> Event {
    node_event_spec(node, recovery_after, change).event(REPORTING_CONTROLLER, node, now)
}

impl EventSink<ReporterEvent> for KubeNodeEvents {
    type Error = EventError;

    async fn record(&self, event: &ReporterEvent) -> Result<(), EventError> {
        let node = self.writer.instance();
        let spec = match event {
            ReporterEvent::Health(change) => node_event_spec(node, self.recovery_after, change),
            ReporterEvent::Memory(memory) => memory.spec(node),
        };
        self.writer
            .create(&spec)
            .await
            .map_err(|source| EventError::Api {
                node: node.to_owned(),
                subject: event.subject(),
                reason: event.reason(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    use super::*;

    fn map(entries: &[(&str, u64)]) -> BTreeMap<String, u64> {
        entries.iter().map(|(u, x)| ((*u).to_owned(), *x)).collect()
    }

    #[test]
    fn changes_are_new_unhealthy_then_recovered_gpus() {
        let unhealthy = |uuid: &str, xid| GpuHealthChange::Unhealthy {
            uuid: uuid.into(),
            xid,
        };
        let healthy = |uuid: &str| GpuHealthChange::Healthy { uuid: uuid.into() };
        assert_eq!(health_changes(&map(&[]), &map(&[])), vec![]);
        assert_eq!(
            health_changes(&map(&[]), &map(&[("GPU-1", 79), ("GPU-0", 48)])),
            vec![unhealthy("GPU-0", 48), unhealthy("GPU-1", 79)]
        );
        // Still unhealthy, with a later XID: announced once already.
        assert_eq!(
            health_changes(&map(&[("GPU-1", 79)]), &map(&[("GPU-1", 94)])),
            vec![]
        );
        assert_eq!(
            health_changes(&map(&[("GPU-1", 79)]), &map(&[("GPU-2", 63)])),
            vec![unhealthy("GPU-2", 63), healthy("GPU-1")]
        );
    }

    #[test]
    fn unhealthy_event_regards_the_node_and_names_gpu_and_xid() {
        let now = Timestamp::from_second(1_700_000_000).expect("time");
        let make = |change| node_event("gpu-node-1", Duration::from_secs(300), &change, now);
        let event = make(GpuHealthChange::Unhealthy {
            uuid: "GPU-7e55".into(),
            xid: 79,
        });
        assert_eq!(event.type_.as_deref(), Some("Warning"));
        assert_eq!(event.reason.as_deref(), Some("GpuUnhealthy"));
        assert_eq!(event.action.as_deref(), Some("WithdrawCapacity"));
        assert_eq!(
            event.note.as_deref(),
            Some(
                "GPU GPU-7e55 unhealthy: XID 79; taken out of the node's capacity until 300s pass without a critical XID"
            )
        );
        let regarding = event.regarding.expect("regarding");
        assert_eq!(
            (regarding.kind.as_deref(), regarding.name.as_deref()),
            (Some("Node"), Some("gpu-node-1"))
        );
        assert_eq!(regarding.namespace, None);
        assert_eq!(
            event.related.and_then(|r| r.kind),
            Some("Device".to_owned())
        );
        assert_eq!(event.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(
            event.metadata.name.as_deref(),
            Some("gpu-node-1.17979cfe362a0000")
        );
        assert_eq!(event.event_time, Some(MicroTime(now)));
        assert_eq!(
            event.reporting_controller.as_deref(),
            Some("tessera.io/reporter")
        );

        let event = make(GpuHealthChange::Healthy {
            uuid: "GPU-7e55".into(),
        });
        assert_eq!(event.type_.as_deref(), Some("Normal"));
        assert_eq!(event.reason.as_deref(), Some("GpuHealthy"));
        assert_eq!(
            event.note.as_deref(),
            Some(
                "GPU GPU-7e55 healthy again: no critical XID for 300s; back in the node's capacity"
            )
        );
    }

    #[test]
    fn long_node_names_still_give_valid_event_names() {
        let event = node_event(
            &"n".repeat(253),
            Duration::from_secs(1),
            &GpuHealthChange::Healthy {
                uuid: "GPU-0".into(),
            },
            Timestamp::now(),
        );
        assert!(event.metadata.name.expect("name").len() <= 253);
        assert_eq!(event.reporting_instance.expect("instance").len(), 128);
    }
}
