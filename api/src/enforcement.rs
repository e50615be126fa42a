//! Enforcement backends: their names, as the proxy's node file, the Device CR's
//! `tessera.io/enforcement` annotation and a shared container's
//! `TESSERA_ENFORCEMENT` carry them (`driver-memory+hami-core`, or `none`), and the
//! per-GPU labels through which a pod's `tessera.io/require-enforcement` selects
//! GPUs. The one codec for all of them.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Device CR GPU label: the GPU's node holds shares' memory (`"true"`).
pub const LABEL_ENFORCE_MEMORY: &str = "tessera.io/enforce-memory";
/// Device CR GPU label: the GPU's node holds shares' compute (`"true"`).
pub const LABEL_ENFORCE_COMPUTE: &str = "tessera.io/enforce-compute";
/// Device CR GPU label: the GPU's node holds shares with MPS (`"true"`), which
/// holds one GPU's share per container: a container asking for shares of several
/// GPUs is not placed on such GPUs.
pub const LABEL_ENFORCE_MPS: &str = "tessera.io/enforce-mps";
/// Pod annotation: the parts of its share the node must hold (`memory`, `compute`,
/// or both, comma-separated).
pub const REQUIRE_ENFORCEMENT: &str = "tessera.io/require-enforcement";

/// A way of holding a container to its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Backend {
    /// The driver's per-cgroup memory limits (NVML ≥ r615): memory only, enforced by
    /// the kernel driver for every process of the container's cgroup.
    DriverMemory,
    /// NVIDIA's Multi-Process Service, v3 namespaces (driver ≥ r615): compute,
    /// enforced by the MPS server for every client of the container's own
    /// namespace, on GPUs in exclusive-process mode so no process bypasses it. Its
    /// memory limit is set too, but is not counted as held: a client whose
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` names a GPU it cannot see drops every
    /// pinned limit (NVIDIA's measurement), and the env is the tenant's.
    Mps,
    /// Compute as GPU time: each shared container's use of its GPUs, as the driver
    /// measures it (NVML's per-process utilization), is held to its share by
    /// freezing its cgroup while it has used more (`tessera_enforce::throttle`).
    /// Every process of the container is measured and frozen, however it reached
    /// the GPU; work already queued on the GPU is charged, not stopped, so the
    /// share holds over time, not within each kernel.
    GpuTime,
    /// GPU memory held by the node's OOM kill: each shared container's memory on
    /// each GPU, as the driver counts it (NVML's per-process memory, every process
    /// of its cgroup, however it reached the GPU), may not pass its grant plus the
    /// node's margin; past it, its largest users there are killed, as the kernel's
    /// OOM killer does past a memory limit. It holds after the fact: for up to one
    /// sampling round (0.5 s) an allocation past the grant stands, and a
    /// neighbour's own allocation may fail meanwhile.
    OomKill,
    /// HAMi-core (`libvgpu.so`, supplied by the operator) preloaded through
    /// `/etc/ld.so.preload`: memory, enforced inside the container's processes, so
    /// cooperative against a process that avoids the loader. Its compute limit is
    /// applied but not counted as held: it meters launched grid blocks, not work,
    /// and let a large GEMM run at 0.99 of the unlimited rate for 75 s at a 25 %
    /// limit on an H100 (docs/enforcement.md).
    HamiCore,
}

impl Backend {
    /// Every backend, strongest first.
    pub const ALL: [Backend; 5] = [
        Backend::DriverMemory,
        Backend::Mps,
        Backend::GpuTime,
        Backend::OomKill,
        Backend::HamiCore,
    ];

    /// Its name in flags, annotations, metrics and the Device CR.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::DriverMemory => "driver-memory",
            Backend::Mps => "mps",
            Backend::GpuTime => "gpu-time",
            Backend::OomKill => "oom-kill",
            Backend::HamiCore => "hami-core",
        }
    }

    /// What it holds.
    pub fn holds(self) -> Holds {
        match self {
            Backend::DriverMemory => Holds {
                memory: true,
                compute: false,
            },
            // MPS's memory limit is the client's to drop (see the variant's docs).
            Backend::Mps => Holds {
                memory: false,
                compute: true,
            },
            Backend::GpuTime => Holds {
                memory: false,
                compute: true,
            },
            Backend::OomKill => Holds {
                memory: true,
                compute: false,
            },
            // Its compute limit did not hold on an H100 (see the variant's docs).
            Backend::HamiCore => Holds {
                memory: true,
                compute: false,
            },
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown enforcement backend {0:?}: expected driver-memory, mps, gpu-time, oom-kill or hami-core"
)]
pub struct UnknownBackend(pub String);

impl FromStr for Backend {
    type Err = UnknownBackend;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Backend::ALL
            .into_iter()
            .find(|b| b.as_str() == text.trim())
            .ok_or_else(|| UnknownBackend(text.to_owned()))
    }
}

/// Which parts of a share are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Holds {
    /// GPU memory.
    pub memory: bool,
    /// Compute (SM share).
    pub compute: bool,
}

impl Holds {
    /// What `backends` hold together.
    pub fn of(backends: &[Backend]) -> Self {
        backends.iter().fold(Holds::default(), |all, b| {
            let h = b.holds();
            Holds {
                memory: all.memory || h.memory,
                compute: all.compute || h.compute,
            }
        })
    }

    /// The per-GPU labels that say so (only the parts held).
    pub fn labels(self) -> BTreeMap<String, String> {
        [
            (self.memory, LABEL_ENFORCE_MEMORY),
            (self.compute, LABEL_ENFORCE_COMPUTE),
        ]
        .into_iter()
        .filter(|(held, _)| *held)
        .map(|(_, key)| (key.to_owned(), "true".to_owned()))
        .collect()
    }
}

/// The per-GPU labels of a node with `backends`: what they hold, and whether MPS
/// is one of them.
pub fn gpu_labels(backends: &[Backend]) -> BTreeMap<String, String> {
    let mut labels = Holds::of(backends).labels();
    if backends.contains(&Backend::Mps) {
        labels.insert(LABEL_ENFORCE_MPS.to_owned(), "true".to_owned());
    }
    labels
}

/// The backends joined as annotations carry them (`a+b`), or `none`.
pub fn joined(backends: &[Backend]) -> String {
    if backends.is_empty() {
        return "none".into();
    }
    backends
        .iter()
        .map(|b| b.as_str())
        .collect::<Vec<_>>()
        .join("+")
}

/// Reads [`joined`]'s form back.
pub fn parse_joined(text: &str) -> Result<Vec<Backend>, UnknownBackend> {
    let text = text.trim();
    if text == "none" || text.is_empty() {
        return Ok(Vec::new());
    }
    let mut backends = text
        .split('+')
        .map(str::parse)
        .collect::<Result<Vec<Backend>, _>>()?;
    backends.sort();
    backends.dedup();
    Ok(backends)
}

/// The GPU labels a pod's `tessera.io/require-enforcement` value requires, or
/// what is wrong with it.
pub fn required_labels(value: &str) -> Result<Vec<&'static str>, String> {
    let mut labels = Vec::new();
    for part in value.split(',').map(str::trim) {
        let label = match part {
            "memory" => LABEL_ENFORCE_MEMORY,
            "compute" => LABEL_ENFORCE_COMPUTE,
            "" => return Err("names nothing between its commas".into()),
            other => return Err(format!("{other:?} is not memory or compute")),
        };
        if !labels.contains(&label) {
            labels.push(label);
        }
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_round_trip_and_hold_what_they_say() {
        let both = [Backend::DriverMemory, Backend::HamiCore];
        assert_eq!(joined(&both), "driver-memory+hami-core");
        assert_eq!(parse_joined("hami-core+driver-memory"), Ok(both.to_vec()));
        assert_eq!(parse_joined("none"), Ok(Vec::new()));
        assert_eq!(joined(&[]), "none");
        assert!(parse_joined("driver-memory+gemini").is_err());
        assert_eq!(
            parse_joined("hami-core+gpu-time+mps+driver-memory+oom-kill"),
            Ok(Backend::ALL.to_vec())
        );
        // GPU time holds compute, with HAMi-core's memory: both parts.
        assert_eq!(
            Holds::of(&[Backend::GpuTime, Backend::HamiCore]),
            Holds {
                memory: true,
                compute: true
            }
        );
        assert!(!gpu_labels(&[Backend::GpuTime]).contains_key(LABEL_ENFORCE_MPS));
        assert_eq!(
            Holds::of(&[Backend::Mps]).labels(),
            BTreeMap::from([(LABEL_ENFORCE_COMPUTE.to_owned(), "true".to_owned())])
        );
        assert_eq!(
            gpu_labels(&[Backend::Mps])
                .get(LABEL_ENFORCE_MPS)
                .map(String::as_str),
            Some("true")
        );
        assert!(!gpu_labels(&both).contains_key(LABEL_ENFORCE_MPS));
        assert_eq!(
            Holds::of(&[Backend::DriverMemory]).labels(),
            BTreeMap::from([(LABEL_ENFORCE_MEMORY.to_owned(), "true".to_owned())])
        );
        // HAMi-core holds memory; its compute limit is not counted (see Backend).
        assert_eq!(
            Holds::of(&both).labels(),
            BTreeMap::from([(LABEL_ENFORCE_MEMORY.to_owned(), "true".to_owned())])
        );
        assert_eq!(
            Holds::of(&[Backend::HamiCore, Backend::Mps]).labels().len(),
            2
        );
        assert!(Holds::of(&[]).labels().is_empty());
        // The OOM kill holds memory, on any driver.
        assert_eq!(
            Holds::of(&[Backend::GpuTime, Backend::OomKill]),
            Holds {
                memory: true,
                compute: true
            }
        );
        assert_eq!(
            joined(&[Backend::GpuTime, Backend::OomKill]),
            "gpu-time+oom-kill"
        );
    }

    #[test]
    fn requirements_name_labels_or_the_mistake() {
        assert_eq!(required_labels("memory"), Ok(vec![LABEL_ENFORCE_MEMORY]));
        assert_eq!(
            required_labels("compute, memory,memory"),
            Ok(vec![LABEL_ENFORCE_COMPUTE, LABEL_ENFORCE_MEMORY])
        );
        assert!(required_labels("mem").is_err_and(|e| e.contains("\"mem\"")));
        assert!(required_labels("memory,").is_err());
    }
}
