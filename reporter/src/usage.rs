//! Each container's GPU memory, as tessera-runtime-proxy measures it
//! ([`tessera_api::usage`]): read from the proxy's file, checked against
//! kubelet's device checkpoint (a device-plugin grant is a whole GPU, not a
//! breach), exported as metrics, published on the Device CR, and told to the pod
//! by an Event when its use reaches its limit ([`MemoryEvent::AtLimit`]) or a GPU
//! it was not granted ([`MemoryEvent::Ungranted`]).
//!
//! The driver does not say when an allocation failed: an out-of-memory inside a
//! container is its program's error, seen by nobody else. What is seen is the
//! use that made it: a container at [`tessera_api::usage::AT_LIMIT`] of its limit.

use std::collections::BTreeSet;
use std::path::Path;

use k8s_openapi::api::core::v1::ObjectReference;
use tessera_api::LegacyDeviceEntry;
use tessera_api::events::{EventKind, EventSpec};
use tessera_api::usage::{ContainerGpuMemory, MemoryGrant, NodeGpuMemory};

/// Reason of the Event a container gets when its use reaches its limit.
pub const REASON_AT_LIMIT: &str = "GpuMemoryAtLimit";
/// Reason of the Event a container gets when it uses a GPU it was not granted.
pub const REASON_UNGRANTED: &str = "GpuUsedWithoutGrant";
/// A container whose use reached its limit is told again only after its use
/// fell below this fraction of it.
const REARM: f64 = 0.9;

/// The proxy's file: `None` when it is missing (no proxy, or the driver
/// unreadable there) or not understood (logged).
pub fn read_usage(path: &Path) -> Option<NodeGpuMemory> {
    match std::fs::read_to_string(path) {
        Ok(text) => NodeGpuMemory::parse(&text)
            .inspect_err(|error| {
                tracing::error!(file = %path.display(), %error, "GPU memory use not understood");
            })
            .ok(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => {
            tracing::error!(file = %path.display(), %error, "GPU memory use not readable");
            None
        }
    }
}

/// `usage` with the GPUs kubelet's device checkpoint granted (`legacy`: the
/// NVIDIA device plugin's pods) read as whole GPUs.
pub fn with_legacy(mut usage: NodeGpuMemory, legacy: &[LegacyDeviceEntry]) -> NodeGpuMemory {
    for entry in &mut usage.containers {
        if entry.grant != MemoryGrant::None {
            continue;
        }
        let granted = legacy.iter().any(|l| {
            l.pod_uid == entry.pod_uid
                && l.container_name == entry.container
                && l.device_ids.iter().any(|id| {
                    // A time-sliced replica is `<uuid>::<n>`.
                    id.split("::").next() == Some(entry.gpu.as_str())
                })
        });
        if granted {
            entry.grant = MemoryGrant::Whole;
        }
    }
    usage
}

/// What a container is told about its GPU memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryEvent {
    /// Its use reached its limit: allocations past it fail.
    AtLimit {
        /// Its use.
        entry: ContainerGpuMemory,
        /// The node's backends (`driver-memory+mps`, `none`).
        backends: String,
    },
    /// It uses a GPU it was not granted.
    Ungranted {
        /// Its use.
        entry: ContainerGpuMemory,
    },
}

impl MemoryEvent {
    /// Its use.
    pub fn entry(&self) -> &ContainerGpuMemory {
        match self {
            Self::AtLimit { entry, .. } | Self::Ungranted { entry } => entry,
        }
    }

    /// Its Event's type, reason and action.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::AtLimit { .. } => EventKind::warning(REASON_AT_LIMIT, "Measure"),
            Self::Ungranted { .. } => EventKind::warning(REASON_UNGRANTED, "Measure"),
        }
    }

    /// The Event's note, for people.
    pub fn note(&self) -> String {
        let gib = |bytes: u64| format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30));
        match self {
            Self::AtLimit { entry, backends } => {
                let limit = entry.limit().unwrap_or_default();
                let held = if backends == "none" || backends.is_empty() {
                    "nothing on this node holds the limit, so it may go on past it, into its neighbours' memory".to_owned()
                } else {
                    format!(
                        "allocations past the limit fail with out-of-memory (held by {backends})"
                    )
                };
                format!(
                    "container {} uses {} of its {} limit on GPU {}: {held}",
                    entry.container,
                    gib(entry.used),
                    gib(limit),
                    entry.gpu
                )
            }
            Self::Ungranted { entry } => format!(
                "container {} holds {} on GPU {}, which it was not granted: it reached the GPU around Tessera's grant (see docs/enforcement.md)",
                entry.container,
                gib(entry.used),
                entry.gpu
            ),
        }
    }

    /// The Event, on the pod, related to `node`'s Device CR.
    pub fn spec(&self, node: &str) -> EventSpec {
        let entry = self.entry();
        EventSpec {
            namespace: entry.namespace.clone(),
            regarding: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(entry.pod.clone()),
                namespace: Some(entry.namespace.clone()),
                uid: Some(entry.pod_uid.clone()),
                field_path: Some(format!("spec.containers{{{}}}", entry.container)),
                ..ObjectReference::default()
            },
            related: Some(crate::events::device_reference(node)),
            kind: self.kind(),
            note: self.note(),
        }
    }
}

/// Which containers were told what, so that each is told once per episode.
#[derive(Debug, Default)]
pub struct MemoryAlerts {
    /// (pod UID, container, GPU, reason) told and still so.
    told: BTreeSet<(String, String, String, &'static str)>,
}

impl MemoryAlerts {
    /// What to tell, now that the node's use is `usage` (and its backends
    /// `backends`): a container newly at its limit, or newly on a GPU it was not
    /// granted. One that left its limit (below 90 % of it) or the GPU may be told
    /// again when it is back.
    pub fn changes(&mut self, usage: &NodeGpuMemory, backends: &str) -> Vec<MemoryEvent> {
        let key = |e: &ContainerGpuMemory, reason| {
            (
                e.pod_uid.clone(),
                e.container.clone(),
                e.gpu.clone(),
                reason,
            )
        };
        let mut still = BTreeSet::new();
        let mut events = Vec::new();
        for entry in &usage.containers {
            let (reason, now, stays) = match entry.grant {
                MemoryGrant::None => (REASON_UNGRANTED, true, true),
                MemoryGrant::Share(limit) => (
                    REASON_AT_LIMIT,
                    entry.at_limit(),
                    entry.used as f64 >= limit as f64 * REARM,
                ),
                MemoryGrant::Whole => continue,
            };
            let key = key(entry, reason);
            let told = self.told.contains(&key);
            if (told && stays) || (!told && now) {
                still.insert(key);
            }
            if !told && now {
                events.push(match entry.grant {
                    MemoryGrant::None => MemoryEvent::Ungranted {
                        entry: entry.clone(),
                    },
                    _ => MemoryEvent::AtLimit {
                        entry: entry.clone(),
                        backends: backends.to_owned(),
                    },
                });
            }
        }
        self.told = still;
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn entry(container: &str, used: u64, grant: MemoryGrant) -> ContainerGpuMemory {
        ContainerGpuMemory {
            namespace: "team".into(),
            pod: "train".into(),
            pod_uid: "uid-1".into(),
            container: container.into(),
            gpu: "GPU-0".into(),
            used,
            grant,
        }
    }

    fn node(entries: Vec<ContainerGpuMemory>) -> NodeGpuMemory {
        NodeGpuMemory {
            containers: entries,
        }
    }

    #[test]
    fn device_plugin_grants_read_as_whole_gpus() {
        let legacy = LegacyDeviceEntry {
            pod_uid: "uid-1".into(),
            container_name: "cuda".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_ids: vec!["GPU-0::3".into()],
        };
        let usage = with_legacy(
            node(vec![
                entry("cuda", GIB, MemoryGrant::None),
                entry("other", GIB, MemoryGrant::None),
            ]),
            &[legacy],
        );
        let grants: Vec<MemoryGrant> = usage.containers.iter().map(|e| e.grant).collect();
        assert_eq!(grants, [MemoryGrant::Whole, MemoryGrant::None]);
    }

    #[test]
    fn a_container_is_told_once_per_episode_at_its_limit() {
        let mut alerts = MemoryAlerts::default();
        let share = MemoryGrant::Share(20 * GIB);
        let at = |used| node(vec![entry("main", used, share)]);
        assert!(alerts.changes(&at(10 * GIB), "mps").is_empty());
        let told = alerts.changes(&at(19 * GIB + GIB / 2), "mps");
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].kind().reason, REASON_AT_LIMIT);
        assert_eq!(
            told[0].note(),
            "container main uses 19.5 GiB of its 20.0 GiB limit on GPU GPU-0: allocations past the limit fail with out-of-memory (held by mps)"
        );
        // Still there, or a little below: not again.
        assert!(alerts.changes(&at(20 * GIB), "mps").is_empty());
        assert!(alerts.changes(&at(18 * GIB + GIB / 2), "mps").is_empty());
        // Below 90 % of it, then back: told again.
        assert!(alerts.changes(&at(10 * GIB), "mps").is_empty());
        assert_eq!(alerts.changes(&at(20 * GIB), "mps").len(), 1);
        // Gone, then back: told again.
        assert!(alerts.changes(&node(vec![]), "mps").is_empty());
        let again = alerts.changes(&at(20 * GIB), "none");
        assert!(
            again[0]
                .note()
                .contains("nothing on this node holds the limit")
        );
    }

    #[test]
    fn a_container_on_a_gpu_it_was_not_granted_is_told_and_whole_gpus_never() {
        let mut alerts = MemoryAlerts::default();
        let usage = node(vec![
            entry("sidecar", GIB, MemoryGrant::None),
            entry("whole", 80 * GIB, MemoryGrant::Whole),
        ]);
        let told = alerts.changes(&usage, "mps");
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].kind().reason, REASON_UNGRANTED);
        assert!(
            told[0].note().starts_with(
                "container sidecar holds 1.0 GiB on GPU GPU-0, which it was not granted"
            )
        );
        assert!(alerts.changes(&usage, "mps").is_empty());
        let spec = told[0].spec("gpu-node-1");
        assert_eq!(spec.namespace, "team");
        assert_eq!(spec.regarding.kind.as_deref(), Some("Pod"));
        assert_eq!(spec.regarding.uid.as_deref(), Some("uid-1"));
        assert_eq!(
            spec.regarding.field_path.as_deref(),
            Some("spec.containers{sidecar}")
        );
    }
}
