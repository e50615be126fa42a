//! Kubernetes Events on the Node about its GPUs' health: `Warning GpuUnhealthy` when a
//! critical XID takes a GPU out of the node's capacity, `Normal GpuHealthy` when it is
//! back. Nothing is recorded on pods: the device plugin's pods (and everyone else's) learn
//! about a GPU from the Node and the Device CR.
//!
//! What to announce is decided by a pure step, [`health_changes`]; announcing is a task
//! behind the [`NodeEventSink`] trait, fed through [`GpuEvents`], so a slow or refusing API
//! server never holds the reporter's loop up. The real sink, [`KubeNodeEvents`], writes
//! `events.k8s.io/v1` Events in the `default` namespace, as kubelet does for Nodes.
//!
//! Not kube-runtime's `Recorder`: it folds Events with the same reason on the same object
//! into one series for six minutes and keeps the first Event's note, so a second GPU
//! going bad within that time would be reported under the first GPU's UUID.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client, Resource};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tessera_api::Device;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::metrics::EventLabels;

/// `reportingController` of every Event the reporter writes.
pub const REPORTING_CONTROLLER: &str = "tessera.io/reporter";
/// Reason of the Event a GPU gets when a critical XID takes it out.
pub const REASON_UNHEALTHY: &str = "GpuUnhealthy";
/// Reason of the Event a GPU gets when it is healthy again.
pub const REASON_HEALTHY: &str = "GpuHealthy";
/// Where Events about cluster-scoped objects (Nodes) live.
pub const EVENT_NAMESPACE: &str = "default";

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

    /// `Warning` or `Normal`.
    pub fn event_type(&self) -> &'static str {
        match self {
            Self::Unhealthy { .. } => "Warning",
            Self::Healthy { .. } => "Normal",
        }
    }

    /// `GpuUnhealthy` or `GpuHealthy`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unhealthy { .. } => REASON_UNHEALTHY,
            Self::Healthy { .. } => REASON_HEALTHY,
        }
    }

    /// What the reporter does about it (the Event's machine-readable `action`).
    pub fn action(&self) -> &'static str {
        match self {
            Self::Unhealthy { .. } => "WithdrawCapacity",
            Self::Healthy { .. } => "RestoreCapacity",
        }
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

/// Why an Event was not written; it is logged and counted, never retried.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// The API server refused the Event or could not be reached.
    #[error("creating Event {reason} for GPU {uuid} on node {node}")]
    Api {
        /// The Node the Event is about.
        node: String,
        /// The GPU.
        uuid: String,
        /// The Event's reason.
        reason: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// Where the node's GPU health Events go.
pub trait NodeEventSink: Send + Sync + 'static {
    /// Records one change on the Node.
    fn record(
        &self,
        change: &GpuHealthChange,
    ) -> impl Future<Output = Result<(), EventError>> + Send;
}

/// The loop's handle on the task that records Events: sending never waits.
#[derive(Debug, Clone, Default)]
pub struct GpuEvents {
    changes: Option<UnboundedSender<GpuHealthChange>>,
}

impl GpuEvents {
    /// Records nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// Spawns the task that hands each change to `sink`, in order, counting outcomes into
    /// `counts` (`tessera_reporter_events_total`). The task ends once every handle is
    /// dropped and what was sent is recorded: await it to flush on shutdown.
    pub fn spawn(
        sink: impl NodeEventSink,
        counts: Family<EventLabels, Counter>,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(record_all(sink, rx, counts));
        (Self { changes: Some(tx) }, task)
    }

    /// Queues `change` for the Node.
    pub fn send(&self, change: GpuHealthChange) {
        if let Some(changes) = &self.changes {
            // The task only stops when every sender is gone, so this cannot fail while
            // `self` lives; a change after a panic in the task is lost, and logged there.
            let _ = changes.send(change);
        }
    }
}

async fn record_all(
    sink: impl NodeEventSink,
    mut changes: UnboundedReceiver<GpuHealthChange>,
    counts: Family<EventLabels, Counter>,
) {
    while let Some(change) = changes.recv().await {
        let outcome = match sink.record(&change).await {
            Ok(()) => {
                tracing::info!(
                    uuid = change.uuid(),
                    reason = change.reason(),
                    "Event recorded on the node"
                );
                "recorded"
            }
            Err(error) => {
                tracing::warn!(error = %crate::chain(&error), "Event not recorded");
                "failed"
            }
        };
        counts
            .get_or_create(&EventLabels {
                reason: change.reason().to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }
}

/// Writes `events.k8s.io/v1` Events about one Node.
#[derive(Clone)]
pub struct KubeNodeEvents {
    client: Client,
    node: String,
    recovery_after: Duration,
}

impl std::fmt::Debug for KubeNodeEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeNodeEvents")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// The longest object name the API server takes (a DNS subdomain).
const MAX_NAME: usize = 253;
/// The longest `reportingInstance`.
const MAX_INSTANCE: usize = 128;

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl KubeNodeEvents {
    /// Events about `node`, whose notes name `recovery_after` (`--recovery-after`).
    pub fn new(client: Client, node: impl Into<String>, recovery_after: Duration) -> Self {
        Self {
            client,
            node: node.into(),
            recovery_after,
        }
    }
}

/// The Event about `node` for `change` at `now`, whose note names `recovery_after`. Like
/// kubelet's, it regards the Node with the node's name as its UID (no need to read the
/// Node first); it relates to the node's Device CR, where the GPU's health is published.
pub fn node_event(
    node: &str,
    recovery_after: Duration,
    change: &GpuHealthChange,
    now: Timestamp,
) -> Event {
    // `<node>.<nanoseconds in hex>`, as client-go names Events; cut to fit.
    let stamp = format!(".{:x}", now.as_nanosecond());
    let name = format!(
        "{}{stamp}",
        truncated(node, MAX_NAME.saturating_sub(stamp.len()))
    );
    Event {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(EVENT_NAMESPACE.to_owned()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(now)),
        type_: Some(change.event_type().to_owned()),
        reason: Some(change.reason().to_owned()),
        action: Some(change.action().to_owned()),
        note: Some(change.note(recovery_after)),
        regarding: Some(ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            uid: Some(node.to_owned()),
            ..ObjectReference::default()
        }),
        related: Some(ObjectReference {
            api_version: Some(Device::api_version(&()).into_owned()),
            kind: Some(Device::kind(&()).into_owned()),
            name: Some(node.to_owned()),
            ..ObjectReference::default()
        }),
        reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
        reporting_instance: Some(truncated(node, MAX_INSTANCE).to_owned()),
        ..Event::default()
    }
}

impl NodeEventSink for KubeNodeEvents {
    async fn record(&self, change: &GpuHealthChange) -> Result<(), EventError> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), EVENT_NAMESPACE);
        events
            .create(
                &PostParams::default(),
                &node_event(&self.node, self.recovery_after, change, Timestamp::now()),
            )
            .await
            .map_err(|source| EventError::Api {
                node: self.node.clone(),
                uuid: change.uuid().to_owned(),
                reason: change.reason(),
                source,
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
