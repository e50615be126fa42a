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

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use tessera_api::LegacyDeviceEntry;
use tessera_api::usage::{ContainerGpuMemory, GpuMemoryKill, MemoryGrant, NodeGpuMemory};
use tessera_daemon::events::{EventKind, EventSpec};

/// Reason of the Event a container gets when its use reaches its limit.
pub const REASON_AT_LIMIT: &str = "GpuMemoryAtLimit";
/// Reason of the Event a container gets when it uses a GPU it was not granted.
pub const REASON_UNGRANTED: &str = "GpuUsedWithoutGrant";
/// Reason of the Event a container gets when the node's OOM kill killed its
/// processes for holding more of a GPU than its grant.
pub const REASON_OOM_KILLED: &str = "GpuMemoryOomKilled";
/// A container whose use reached its limit is told again only after its use
/// fell below this fraction of it.
const REARM: f64 = 0.9;
/// The least time between two Events of one reason about one container and GPU,
/// however its use comes and goes: a tenant cannot drive the reporter's writes.
pub const RETELL_AFTER: Duration = Duration::from_secs(600);

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
    /// The node's OOM kill killed its processes on a GPU.
    OomKilled {
        /// The kill, as the proxy recorded it.
        kill: GpuMemoryKill,
    },
}

/// The container an Event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodContainer<'a> {
    /// Its pod's namespace.
    pub namespace: &'a str,
    /// Its pod's name.
    pub pod: &'a str,
    /// Its pod's UID.
    pub pod_uid: &'a str,
    /// Its name.
    pub container: &'a str,
}

impl MemoryEvent {
    /// The container it is about.
    pub fn container(&self) -> PodContainer<'_> {
        let entry = match self {
            Self::AtLimit { entry, .. } | Self::Ungranted { entry } => entry,
            Self::OomKilled { kill } => &kill.entry,
        };
        PodContainer {
            namespace: &entry.namespace,
            pod: &entry.pod,
            pod_uid: &entry.pod_uid,
            container: &entry.container,
        }
    }

    /// Its Event's type, reason and action.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::AtLimit { .. } => EventKind::warning(REASON_AT_LIMIT, "Measure"),
            Self::Ungranted { .. } => EventKind::warning(REASON_UNGRANTED, "Measure"),
            Self::OomKilled { .. } => EventKind::warning(REASON_OOM_KILLED, "Kill"),
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
            Self::OomKilled { kill } => format!(
                "container {} held {} on GPU {}, past its {} grant and the node's {} margin: its process{} {} killed (oom-kill)",
                kill.entry.container,
                gib(kill.entry.used),
                kill.entry.gpu,
                gib(kill.entry.limit().unwrap_or_default()),
                gib(kill.margin),
                if kill.pids.len() == 1 { "" } else { "es" },
                kill.pids
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
                    + if kill.pids.len() == 1 {
                        " was"
                    } else {
                        " were"
                    }
            ),
        }
    }

    /// The Event, on the pod, related to `node`'s Device CR.
    pub fn spec(&self, node: &str) -> EventSpec {
        let about = self.container();
        EventSpec {
            namespace: about.namespace.to_owned(),
            regarding: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(about.pod.to_owned()),
                namespace: Some(about.namespace.to_owned()),
                uid: Some(about.pod_uid.to_owned()),
                ..ObjectReference::default()
            },
            related: Some(tessera_api::Device::reference(node)),
            kind: self.kind(),
            note: self.note(),
        }
    }
}

/// (pod UID, container, GPU, reason): what one Event is about.
type AlertKey = (String, String, String, &'static str);

/// Which containers were told what, so that each is told once per episode.
#[derive(Debug, Default)]
pub struct MemoryAlerts {
    /// Told and still so.
    told: BTreeSet<AlertKey>,
    /// Seen on a GPU not granted once: told if seen so again (a device plugin's
    /// grant may reach kubelet's checkpoint a moment after its process starts).
    suspected: BTreeSet<AlertKey>,
    /// When each was last told.
    last: BTreeMap<AlertKey, Instant>,
    /// The OOM kills told, while the proxy's file keeps them.
    kills: BTreeSet<tessera_api::usage::KillKey>,
}

impl MemoryAlerts {
    /// What to tell, now (`now`) that the node's use is `usage` (and its backends
    /// `backends`): a container newly at its limit, or on a GPU it was not
    /// granted in two readings running. One that left its limit (below 90 % of
    /// it) or the GPU may be told again when it is back, but not within
    /// [`RETELL_AFTER`] of the last time.
    pub fn changes(
        &mut self,
        usage: &NodeGpuMemory,
        backends: &str,
        now: Instant,
    ) -> Vec<MemoryEvent> {
        let key = |e: &ContainerGpuMemory, reason| {
            (
                e.pod_uid.clone(),
                e.container.clone(),
                e.gpu.clone(),
                reason,
            )
        };
        let mut still = BTreeSet::new();
        let mut suspected = BTreeSet::new();
        let mut events = Vec::new();
        for entry in &usage.containers {
            let (reason, at, stays) = match entry.grant {
                MemoryGrant::None => (REASON_UNGRANTED, true, true),
                MemoryGrant::Share(limit) => (
                    REASON_AT_LIMIT,
                    entry.at_limit(),
                    entry.used as f64 >= limit as f64 * REARM,
                ),
                MemoryGrant::Whole | MemoryGrant::Trusted => continue,
            };
            let key = key(entry, reason);
            if self.told.contains(&key) {
                if stays {
                    still.insert(key);
                }
                continue;
            }
            if !at {
                continue;
            }
            if reason == REASON_UNGRANTED && !self.suspected.contains(&key) {
                suspected.insert(key);
                continue;
            }
            still.insert(key.clone());
            let recent = self
                .last
                .get(&key)
                .is_some_and(|told| now.duration_since(*told) < RETELL_AFTER);
            if recent {
                continue;
            }
            self.last.insert(key, now);
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
        // Each kill once, while the proxy keeps it on record.
        let mut kills = BTreeSet::new();
        for kill in &usage.kills {
            let key = kill.key();
            if !self.kills.contains(&key) {
                events.push(MemoryEvent::OomKilled { kill: kill.clone() });
            }
            kills.insert(key);
        }
        self.kills = kills;
        self.told = still;
        self.suspected = suspected;
        self.last
            .retain(|_, told| now.duration_since(*told) < RETELL_AFTER);
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
            kills: Vec::new(),
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
        let t0 = Instant::now();
        let minutes = |m: u64| t0 + Duration::from_secs(60 * m);
        assert!(alerts.changes(&at(10 * GIB), "mps", t0).is_empty());
        let told = alerts.changes(&at(19 * GIB + GIB / 2), "mps", t0);
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].kind().reason, REASON_AT_LIMIT);
        assert_eq!(
            told[0].note(),
            "container main uses 19.5 GiB of its 20.0 GiB limit on GPU GPU-0: allocations past the limit fail with out-of-memory (held by mps)"
        );
        // Still there, or a little below: not again.
        assert!(alerts.changes(&at(20 * GIB), "mps", minutes(1)).is_empty());
        assert!(
            alerts
                .changes(&at(18 * GIB + GIB / 2), "mps", minutes(2))
                .is_empty()
        );
        // Below 90 % of it, then back within ten minutes: not yet told again.
        assert!(alerts.changes(&at(10 * GIB), "mps", minutes(3)).is_empty());
        assert!(alerts.changes(&at(20 * GIB), "mps", minutes(4)).is_empty());
        // Below, then back after ten minutes: told again.
        assert!(alerts.changes(&at(10 * GIB), "mps", minutes(11)).is_empty());
        assert_eq!(alerts.changes(&at(20 * GIB), "mps", minutes(12)).len(), 1);
        // Gone, then back later: told again, in the node's words.
        assert!(alerts.changes(&node(vec![]), "mps", minutes(13)).is_empty());
        let again = alerts.changes(&at(20 * GIB), "none", minutes(30));
        assert!(
            again[0]
                .note()
                .contains("nothing on this node holds the limit")
        );
    }

    #[test]
    fn a_container_on_a_gpu_it_was_not_granted_is_told_when_seen_twice() {
        let mut alerts = MemoryAlerts::default();
        let now = Instant::now();
        let usage = node(vec![
            entry("sidecar", GIB, MemoryGrant::None),
            entry("whole", 80 * GIB, MemoryGrant::Whole),
            entry("agent", 80 * GIB, MemoryGrant::Trusted),
        ]);
        // Once is a suspicion (a device plugin's grant may be on its way).
        assert!(alerts.changes(&usage, "mps", now).is_empty());
        let told = alerts.changes(&usage, "mps", now);
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].kind().reason, REASON_UNGRANTED);
        assert!(
            told[0].note().starts_with(
                "container sidecar holds 1.0 GiB on GPU GPU-0, which it was not granted"
            )
        );
        assert!(alerts.changes(&usage, "mps", now).is_empty());
        // Seen once, then granted: never told.
        let mut alerts = MemoryAlerts::default();
        assert!(alerts.changes(&usage, "mps", now).is_empty());
        let granted = node(vec![entry("sidecar", GIB, MemoryGrant::Whole)]);
        assert!(alerts.changes(&granted, "mps", now).is_empty());
        assert!(alerts.changes(&usage, "mps", now).is_empty());
        let spec = told[0].spec("gpu-node-1");
        assert_eq!(spec.namespace, "team");
        assert_eq!(spec.regarding.kind.as_deref(), Some("Pod"));
        assert_eq!(spec.regarding.uid.as_deref(), Some("uid-1"));
        assert_eq!(spec.regarding.name.as_deref(), Some("train"));
    }

    #[test]
    fn each_oom_kill_is_told_once_while_on_record() {
        let kill = GpuMemoryKill {
            entry: entry("main", 22 * GIB, MemoryGrant::Share(20 * GIB)),
            margin: GIB,
            pids: vec![41, 42],
            at: 1_800_000_000,
        };
        let mut usage = node(vec![entry("main", GIB, MemoryGrant::Share(20 * GIB))]);
        usage.kills = vec![kill.clone()];
        let mut alerts = MemoryAlerts::default();
        let now = Instant::now();
        let told = alerts.changes(&usage, "oom-kill", now);
        assert_eq!(told, [MemoryEvent::OomKilled { kill: kill.clone() }]);
        assert_eq!(told[0].kind().reason, REASON_OOM_KILLED);
        assert_eq!(
            told[0].note(),
            "container main held 22.0 GiB on GPU GPU-0, past its 20.0 GiB grant and the node's 1.0 GiB margin: its processes 41, 42 were killed (oom-kill)"
        );
        assert_eq!(told[0].container().pod_uid, "uid-1");
        // Read again: not told again. A second kill is.
        assert!(alerts.changes(&usage, "oom-kill", now).is_empty());
        let again = GpuMemoryKill {
            at: kill.at + 5,
            pids: vec![43],
            ..kill.clone()
        };
        usage.kills.push(again.clone());
        assert_eq!(
            alerts.changes(&usage, "oom-kill", now),
            [MemoryEvent::OomKilled { kill: again }]
        );
    }
}
