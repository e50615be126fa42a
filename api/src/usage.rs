//! What each container on a node uses of each GPU's memory, against what it was
//! granted: measured by tessera-runtime-proxy (the driver's per-process memory,
//! each process traced to its container by its cgroup), written to
//! `<enforcement-dir>/`[`USAGE_FILE`]; read by tessera-reporter, which exports it
//! as metrics, tells a pod at its limit (or using a GPU it was not granted) with an
//! Event, and publishes it, coarsened, on the Device CR ([`DEVICE_ANNOTATION`]),
//! where `tessera inspect` shows it.

use serde::{Deserialize, Serialize};

/// The proxy's file in its enforcement directory.
pub const USAGE_FILE: &str = "gpu-memory.json";
/// The Device CR annotation: [`NodeGpuMemory`] with each use rounded up to
/// [`PUBLISHED_STEP`], so that a use moving by a few MiB is not a write.
pub const DEVICE_ANNOTATION: &str = "tessera.io/gpu-memory-used";
/// The step published uses are rounded up to (a CUDA context alone is ~500 MiB).
pub const PUBLISHED_STEP: u64 = 256 << 20;
/// The most bytes of entries published on the Device CR (its annotations hold
/// 256 kB in all, and the reporter's others must fit beside): the largest uses
/// first. The metrics carry every one.
pub const PUBLISHED_MAX_BYTES: usize = 64 << 10;
/// The fraction of its limit at which a container is told it is at its limit:
/// allocations past the limit fail, and a program's allocator rarely lands on
/// the last byte.
pub const AT_LIMIT: f64 = 0.95;

/// What a container was granted of a GPU's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MemoryGrant {
    /// Tessera granted it nothing of this GPU (the reporter checks kubelet's
    /// device checkpoint before it calls that a breach).
    #[default]
    None,
    /// The whole GPU: no limit below the GPU's own.
    Whole,
    /// A GPU agent the node trusts with its GPUs (`--trusted-gpu-agents`): no
    /// grant, and none needed.
    Trusted,
    /// A share: this many bytes.
    Share(u64),
}

/// One container's use of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerGpuMemory {
    /// Its pod's namespace.
    pub namespace: String,
    /// Its pod's name.
    pub pod: String,
    /// Its pod's UID.
    pub pod_uid: String,
    /// Its name.
    pub container: String,
    /// The GPU's UUID.
    pub gpu: String,
    /// Bytes its processes hold on the GPU, as the driver counts them.
    pub used: u64,
    /// What it was granted of that GPU.
    #[serde(default)]
    pub grant: MemoryGrant,
}

impl ContainerGpuMemory {
    /// Its limit in bytes, for a share.
    pub fn limit(&self) -> Option<u64> {
        match self.grant {
            MemoryGrant::Share(bytes) => Some(bytes),
            MemoryGrant::None | MemoryGrant::Whole | MemoryGrant::Trusted => None,
        }
    }

    /// Whether a share's use has reached [`AT_LIMIT`] of it.
    pub fn at_limit(&self) -> bool {
        self.limit()
            .is_some_and(|limit| self.used as f64 >= limit as f64 * AT_LIMIT)
    }
}

/// A node's containers' GPU memory.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeGpuMemory {
    /// One entry per container and GPU it uses, ordered by pod, container, GPU.
    pub containers: Vec<ContainerGpuMemory>,
    /// The OOM kill's kills of the last [`KILLS_KEPT_SECONDS`], oldest first (the
    /// proxy's file only: the reporter tells each on its pod once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kills: Vec<GpuMemoryKill>,
}

/// How long the proxy's file keeps a kill, for a reporter that polls or
/// restarts to see it.
pub const KILLS_KEPT_SECONDS: u64 = 600;

/// A kill's pod UID, container, GPU, time and processes.
pub type KillKey = (String, String, String, u64, Vec<u32>);

/// Processes of a shared container killed because it held more of a GPU's
/// memory than its grant plus the node's margin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuMemoryKill {
    /// The container, GPU, what its processes held there (as the driver counted
    /// them) and its grant (a share).
    #[serde(flatten)]
    pub entry: ContainerGpuMemory,
    /// The node's margin above the grant (`--oom-kill-margin`).
    pub margin: u64,
    /// The processes killed (host PIDs), largest first.
    pub pids: Vec<u32>,
    /// When, in seconds since the Unix epoch.
    pub at: u64,
}

impl GpuMemoryKill {
    /// What identifies this kill among others.
    pub fn key(&self) -> KillKey {
        (
            self.entry.pod_uid.clone(),
            self.entry.container.clone(),
            self.entry.gpu.clone(),
            self.at,
            self.pids.clone(),
        )
    }
}

/// Why a usage file or annotation was not understood.
#[derive(Debug, thiserror::Error)]
#[error("GPU memory use: {0}")]
pub struct UsageError(#[from] serde_json::Error);

impl NodeGpuMemory {
    /// Parses the proxy's file or the Device CR's annotation.
    pub fn parse(text: &str) -> Result<Self, UsageError> {
        Ok(serde_json::from_str(text)?)
    }

    /// The proxy's file.
    pub fn to_json(&self) -> String {
        // Plain strings and numbers: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The Device CR's annotation: uses rounded up to [`PUBLISHED_STEP`], entries
    /// of at most [`PUBLISHED_MAX_BYTES`] in all (the largest uses), in the file's
    /// order.
    pub fn published(&self) -> String {
        // (place in the file, entry, its bytes in the annotation)
        let mut kept: Vec<(usize, ContainerGpuMemory, usize)> = self
            .containers
            .iter()
            .cloned()
            .map(|mut entry| {
                entry.used = entry.used.div_ceil(PUBLISHED_STEP) * PUBLISHED_STEP;
                let size = serde_json::to_string(&entry).map_or(0, |text| text.len() + 1);
                (entry, size)
            })
            .enumerate()
            .map(|(i, (entry, size))| (i, entry, size))
            .collect();
        if kept.iter().map(|(_, _, size)| size).sum::<usize>() > PUBLISHED_MAX_BYTES {
            kept.sort_by(|a, b| b.1.used.cmp(&a.1.used).then(a.0.cmp(&b.0)));
            let mut total = 0;
            kept.retain(|(_, _, size)| {
                total += size;
                total <= PUBLISHED_MAX_BYTES
            });
            kept.sort_by_key(|(i, _, _)| *i);
        }
        Self {
            containers: kept.into_iter().map(|(_, e, _)| e).collect(),
            kills: Vec::new(),
        }
        .to_json()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(container: &str, used: u64, grant: MemoryGrant) -> ContainerGpuMemory {
        ContainerGpuMemory {
            namespace: "default".into(),
            pod: "p".into(),
            pod_uid: "u".into(),
            container: container.into(),
            gpu: "GPU-0".into(),
            used,
            grant,
        }
    }

    #[test]
    fn file_round_trips_and_grants_read_as_written() {
        let node = NodeGpuMemory {
            containers: vec![
                entry("a", 1, MemoryGrant::Share(20 << 30)),
                entry("b", 2, MemoryGrant::Whole),
                entry("c", 3, MemoryGrant::None),
            ],
            kills: vec![GpuMemoryKill {
                entry: entry("a", 30 << 30, MemoryGrant::Share(20 << 30)),
                margin: 1 << 30,
                pids: vec![7],
                at: 1_800_000_000,
            }],
        };
        let text = node.to_json();
        assert!(text.contains(r#""pids":[7]"#), "{text}");
        // None: no key at all (the file reads as before the OOM kill).
        assert!(!NodeGpuMemory::default().to_json().contains("kills"));
        assert!(text.contains(r#""grant":{"share":21474836480}"#), "{text}");
        assert!(text.contains(r#""grant":"whole""#), "{text}");
        assert_eq!(NodeGpuMemory::parse(&text).expect("parses"), node);
        // A missing grant is no grant.
        let bare = r#"{"containers":[{"namespace":"n","pod":"p","podUid":"u","container":"c","gpu":"g","used":1}]}"#;
        assert_eq!(
            NodeGpuMemory::parse(bare).expect("parses").containers[0].grant,
            MemoryGrant::None
        );
        assert!(NodeGpuMemory::parse("{\"containers\": 3}").is_err());
    }

    #[test]
    fn at_limit_is_a_share_used_to_95_percent() {
        let share = |used| entry("a", used, MemoryGrant::Share(100));
        assert!(!share(94).at_limit());
        assert!(share(95).at_limit());
        assert!(share(130).at_limit());
        assert!(!entry("a", u64::MAX, MemoryGrant::Whole).at_limit());
        assert!(!entry("a", u64::MAX, MemoryGrant::None).at_limit());
        assert!(!entry("a", u64::MAX, MemoryGrant::Trusted).at_limit());
    }

    #[test]
    fn published_rounds_up_and_keeps_the_largest() {
        let node = NodeGpuMemory {
            containers: vec![
                entry("a", 1, MemoryGrant::Whole),
                entry("b", PUBLISHED_STEP, MemoryGrant::Whole),
                entry("c", 0, MemoryGrant::Whole),
            ],
            kills: Vec::new(),
        };
        let published = NodeGpuMemory::parse(&node.published()).expect("parses");
        let used: Vec<u64> = published.containers.iter().map(|e| e.used).collect();
        assert_eq!(used, [PUBLISHED_STEP, PUBLISHED_STEP, 0]);

        let many = NodeGpuMemory {
            containers: (0..2000u64)
                .map(|i| entry(&format!("c{i:04}"), i * PUBLISHED_STEP, MemoryGrant::Whole))
                .collect(),
            kills: Vec::new(),
        };
        let text = many.published();
        assert!(
            text.len() <= PUBLISHED_MAX_BYTES + 64,
            "{} bytes",
            text.len()
        );
        let published = NodeGpuMemory::parse(&text).expect("parses");
        let kept = published.containers.len();
        assert!(kept > 100 && kept < 2000, "{kept} kept");
        // The smallest went; the order stayed.
        assert_eq!(
            published.containers[0].container,
            format!("c{:04}", 2000 - kept)
        );
        assert!(
            published
                .containers
                .windows(2)
                .all(|w| w[0].container < w[1].container)
        );
    }
}
