//! A pod's GPU request, from any of the resource names the scheduler accepts, and
//! from the pod annotations that choose GPUs and placement ([`selection`]).
//!
//! One parser for every system Tessera stands in for; each name keeps the meaning
//! its own system gives it (docs/compat.md).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

use crate::quantity::Quantity;
use crate::resources::{
    DEPRECATED_GPU_NAMES, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED, GPU_SHARED_COUNT,
    MISSPELLED_GPU_NAMES, NVIDIA_GPU,
};

pub mod selection;

pub use selection::{GpuSelection, PlacementPolicy};

/// `aliyun.com/gpu-mem`: memory on one GPU (gpushare), in GiB unless the scheduler
/// is told otherwise (`--gpushare-memory-unit`), as gpushare's device plugin counts it.
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// `nvidia.com/gpumem`: MiB per GPU (HAMi), with `nvidia.com/gpu` as the count.
pub const HAMI_GPU_MEM: &str = "nvidia.com/gpumem";
/// `nvidia.com/gpumem-percentage`: percent of each GPU's memory (HAMi), with
/// `nvidia.com/gpu` as the count.
pub const HAMI_GPU_MEM_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
/// `nvidia.com/gpucores`: percent per GPU (HAMi).
pub const HAMI_GPU_CORES: &str = "nvidia.com/gpucores";
/// `volcano.sh/gpu-memory`: memory on one GPU, in a configurable unit.
pub const VOLCANO_GPU_MEMORY: &str = "volcano.sh/gpu-memory";
/// `volcano.sh/gpu-number`: whole GPUs (Volcano).
pub const VOLCANO_GPU_NUMBER: &str = "volcano.sh/gpu-number";
/// `volcano.sh/vgpu-number`: how many GPUs, one vGPU on each (Volcano's vGPU,
/// HAMi-core), as HAMi's `nvidia.com/gpu`.
pub const VOLCANO_VGPU_NUMBER: &str = "volcano.sh/vgpu-number";
/// `volcano.sh/vgpu-memory`: MiB per vGPU, as HAMi's `nvidia.com/gpumem`.
pub const VOLCANO_VGPU_MEMORY: &str = "volcano.sh/vgpu-memory";
/// `volcano.sh/vgpu-memory-percentage`: percent of each GPU's memory per vGPU.
pub const VOLCANO_VGPU_MEMORY_PERCENTAGE: &str = "volcano.sh/vgpu-memory-percentage";
/// `volcano.sh/vgpu-cores`: percent of each GPU's compute per vGPU.
pub const VOLCANO_VGPU_CORES: &str = "volcano.sh/vgpu-cores";

/// Every resource name the scheduler manages.
pub const MANAGED_RESOURCES: &[&str] = &[
    GPU_CORE,
    GPU_MEMORY,
    GPU_MEMORY_RATIO,
    GPU_SHARED,
    GPU_SHARED_COUNT,
    NVIDIA_GPU,
    ALIYUN_GPU_MEM,
    HAMI_GPU_MEM,
    HAMI_GPU_MEM_PERCENTAGE,
    HAMI_GPU_CORES,
    VOLCANO_GPU_MEMORY,
    VOLCANO_GPU_NUMBER,
    VOLCANO_VGPU_NUMBER,
    VOLCANO_VGPU_MEMORY,
    VOLCANO_VGPU_MEMORY_PERCENTAGE,
    VOLCANO_VGPU_CORES,
];

/// The names of a system that limits shares with HAMi-core: each asks for `count`
/// distinct GPUs, on each MiB or a percent of its memory (its whole memory when
/// neither is set) and a percent of its compute.
#[derive(Debug)]
struct HamiCoreNames {
    count: &'static str,
    memory: &'static str,
    percentage: &'static str,
    cores: &'static str,
}

const HAMI: HamiCoreNames = HamiCoreNames {
    count: NVIDIA_GPU,
    memory: HAMI_GPU_MEM,
    percentage: HAMI_GPU_MEM_PERCENTAGE,
    cores: HAMI_GPU_CORES,
};

/// Volcano's vGPU names: the volcano-vgpu-device-plugin is HAMi's, and Volcano's
/// `ExtractResourceRequest` reads them as HAMi reads its own.
const VOLCANO_VGPU: HamiCoreNames = HamiCoreNames {
    count: VOLCANO_VGPU_NUMBER,
    memory: VOLCANO_VGPU_MEMORY,
    percentage: VOLCANO_VGPU_MEMORY_PERCENTAGE,
    cores: VOLCANO_VGPU_CORES,
};

impl HamiCoreNames {
    fn all(&self) -> [&'static str; 4] {
        [self.count, self.memory, self.percentage, self.cores]
    }
}

/// Memory wanted on each GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMemory {
    /// No memory asked (compute only).
    None,
    /// Bytes.
    Bytes(u64),
    /// Percent of each GPU's memory.
    Ratio(u64),
}

/// What a pod asks of GPUs: `count` GPUs, each with `core` percent of compute and `memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuRequest {
    /// How many GPUs.
    pub count: u32,
    /// Percent of each GPU's compute (100: the whole compute).
    pub core: u64,
    /// Memory on each GPU.
    pub memory: GpuMemory,
}

impl GpuRequest {
    /// Whether each GPU is wanted whole.
    pub fn is_whole(&self) -> bool {
        self.core >= 100 && matches!(self.memory, GpuMemory::Ratio(100))
    }
}

/// The unit of `aliyun.com/gpu-mem`, as gpushare's device plugin `--memory-unit` sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryUnit {
    /// Mebibytes.
    MiB,
    /// Gibibytes: gpushare's default.
    #[default]
    GiB,
}

impl MemoryUnit {
    /// Bytes in one unit.
    pub fn bytes(self) -> u64 {
        match self {
            Self::MiB => 1 << 20,
            Self::GiB => 1 << 30,
        }
    }
}

impl fmt::Display for MemoryUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MiB => "MiB",
            Self::GiB => "GiB",
        })
    }
}

/// A memory unit other than `MiB` or `GiB`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("memory unit {0:?}: expected MiB or GiB")]
pub struct UnknownMemoryUnit(pub String);

impl FromStr for MemoryUnit {
    type Err = UnknownMemoryUnit;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.to_ascii_lowercase().as_str() {
            "mib" => Ok(Self::MiB),
            "gib" => Ok(Self::GiB),
            _ => Err(UnknownMemoryUnit(text.to_owned())),
        }
    }
}

/// Settings of request parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestOptions {
    /// Bytes in one unit of `volcano.sh/gpu-memory` (MiB by default).
    pub volcano_memory_unit: u64,
    /// The unit of `aliyun.com/gpu-mem` (GiB by default, as gpushare's device plugin).
    pub gpushare_memory_unit: MemoryUnit,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            volcano_memory_unit: 1 << 20,
            gpushare_memory_unit: MemoryUnit::default(),
        }
    }
}

/// Why a request is invalid; the message is shown to the user as the filter error
/// (kube-scheduler puts it in the pod's `FailedScheduling` event).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A container's resources cannot be read or do not make one request.
    #[error("{container}: {problem}")]
    Container {
        /// `container NAME` or `init container NAME`.
        container: String,
        /// What is wrong, naming the resource and its value.
        problem: String,
    },
    /// A pod annotation that chooses GPUs or placement cannot be honoured.
    #[error("annotation {key}: {value:?}: {problem}")]
    Annotation {
        /// The annotation.
        key: String,
        /// Its value, as written.
        value: String,
        /// What is wrong.
        problem: String,
    },
}

mod translate;
use translate::*;

/// Whether `container` names any GPU resource the scheduler manages, in its
/// limits or requests, with a value other than zero. The containers that do are
/// the ones a pod-level allocation was meant for.
pub fn container_asks_for_gpu(container: &Container) -> bool {
    let Some(resources) = &container.resources else {
        return false;
    };
    [&resources.limits, &resources.requests]
        .into_iter()
        .flatten()
        .flat_map(|list| list.iter())
        .any(|(name, quantity)| {
            MANAGED_RESOURCES.contains(&name.as_str())
                && Quantity::parse(&quantity.0).map_or(true, |q| q.milli_value() > 0)
        })
}

/// Where a container runs in its pod's life, as Kubernetes orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ContainerRole {
    /// An init container: runs to completion before the next one starts, beside
    /// the native sidecars started before it, and never beside app containers.
    Init,
    /// A native sidecar: an init container with `restartPolicy: Always`. It starts
    /// in init order and keeps running beside everything that starts after it.
    Sidecar,
    /// An app container: runs beside the other app containers and every sidecar.
    App,
}

impl ContainerRole {
    /// `init container` (sidecars too: that is where the pod spec lists them) or
    /// `container`, for messages.
    pub fn noun(self) -> &'static str {
        match self {
            Self::Init | Self::Sidecar => "init container",
            Self::App => "container",
        }
    }
}

/// One container's GPU request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerGpuRequest {
    /// The container's name (unique in its pod, init containers included).
    pub name: String,
    /// When it runs.
    pub role: ContainerRole,
    /// What it asks for: `count` GPUs, each with `core` and `memory`.
    pub gpu: GpuRequest,
    /// The system whose device plugin's env it gets, when it asked in that
    /// system's names (gpushare's, Volcano's GPU share).
    pub asked_as: Option<crate::asked::AskedAs>,
}

/// What a pod asks of GPUs: one request per container that asks for any, init
/// containers (sidecars among them) in spec order, then app containers in spec
/// order. Containers that ask for no GPU are not listed: they get none. Beside
/// them, what the pod's annotations say about which GPUs and how to place it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodGpuRequest {
    /// The containers that ask for GPUs.
    pub containers: Vec<ContainerGpuRequest>,
    /// Which GPUs the pod may get (every GPU when empty).
    pub selection: GpuSelection,
    /// Which GPU on a node, overriding the scheduler's `--gpu-policy` for this pod.
    pub gpu_policy: Option<PlacementPolicy>,
    /// Which node, overriding the scheduler's `--node-policy` for this pod.
    pub node_policy: Option<PlacementPolicy>,
    /// The pod's sharing group: its GPU containers share the group's one GPU.
    pub sharing_group: Option<String>,
}

impl PodGpuRequest {
    /// The [`crate::asked::REQUESTED_AS`] annotation's value: the containers that
    /// asked in a system's names, or `None` when none did.
    pub fn requested_as(&self) -> Option<String> {
        let asked: BTreeMap<String, crate::asked::AskedAs> = self
            .containers
            .iter()
            .filter_map(|c| Some((c.name.clone(), c.asked_as?)))
            .collect();
        (!asked.is_empty()).then(|| crate::asked::encode(&asked))
    }
}

/// Scalar totals of GPU requests: what Kubernetes would add up if GPU shares
/// were ordinary resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuTotals {
    /// GPUs held (a share of a GPU counts as one).
    pub gpus: u64,
    /// Compute percent, summed over GPUs (200: two whole GPUs' compute).
    pub core: u64,
    /// Memory bytes asked as bytes, summed over GPUs.
    pub memory_bytes: u64,
    /// Memory percent asked as a ratio, summed over GPUs.
    pub memory_ratio: u64,
}

impl GpuTotals {
    fn of(request: &GpuRequest) -> Self {
        let count = u64::from(request.count);
        let (memory_bytes, memory_ratio) = match request.memory {
            GpuMemory::None => (0, 0),
            GpuMemory::Bytes(bytes) => (bytes.saturating_mul(count), 0),
            GpuMemory::Ratio(ratio) => (0, ratio.saturating_mul(count)),
        };
        Self {
            gpus: count,
            core: request.core.saturating_mul(count),
            memory_bytes,
            memory_ratio,
        }
    }

    fn add(self, other: Self) -> Self {
        Self {
            gpus: self.gpus.saturating_add(other.gpus),
            core: self.core.saturating_add(other.core),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
            memory_ratio: self.memory_ratio.saturating_add(other.memory_ratio),
        }
    }

    /// Each resource's maximum, as Kubernetes' `maxResourceList` takes it.
    fn max(self, other: Self) -> Self {
        Self {
            gpus: self.gpus.max(other.gpus),
            core: self.core.max(other.core),
            memory_bytes: self.memory_bytes.max(other.memory_bytes),
            memory_ratio: self.memory_ratio.max(other.memory_ratio),
        }
    }
}

impl PodGpuRequest {
    /// The request of the container named `name`.
    pub fn container(&self, name: &str) -> Option<&ContainerGpuRequest> {
        self.containers.iter().find(|c| c.name == name)
    }

    /// The groups of containers that run at the same time, as indices into
    /// [`Self::containers`], by Kubernetes' rule for effective pod requests: each
    /// init container beside the sidecars started before it; each sidecar, as it
    /// starts, beside the sidecars started before it; last, every sidecar beside
    /// every app container. A GPU share the pod books must hold each group that
    /// uses it; the last group (possibly empty) is the one that runs for the pod's life.
    pub fn phases(&self) -> Vec<Vec<usize>> {
        let mut phases = Vec::new();
        let mut sidecars = Vec::new();
        for (index, container) in self.containers.iter().enumerate() {
            match container.role {
                ContainerRole::Sidecar => {
                    sidecars.push(index);
                    phases.push(sidecars.clone());
                }
                ContainerRole::Init => {
                    let mut phase = sidecars.clone();
                    phase.push(index);
                    phases.push(phase);
                }
                ContainerRole::App => {}
            }
        }
        let mut running = sidecars;
        running.extend(
            self.containers
                .iter()
                .enumerate()
                .filter(|(_, c)| c.role == ContainerRole::App)
                .map(|(index, _)| index),
        );
        phases.push(running);
        phases
    }

    /// The pod's effective request in scalar totals, exactly as Kubernetes computes
    /// effective pod requests (`max(sum(app) + sum(sidecars), max over init
    /// containers of (init + sidecars started before it))`, each resource on its
    /// own). A placement books at least this much: per GPU it holds every phase.
    pub fn effective(&self) -> GpuTotals {
        self.phases()
            .iter()
            .map(|phase| {
                phase
                    .iter()
                    .map(|&index| GpuTotals::of(&self.containers[index].gpu))
                    .fold(GpuTotals::default(), GpuTotals::add)
            })
            .fold(GpuTotals::default(), GpuTotals::max)
    }
}

/// The pod's GPU request, container by container (see [`PodGpuRequest`]); `None`
/// when no container asks for a GPU. Each container's request is checked on its
/// own: values above 100 must be whole GPUs in one container, not in the pod's sum
/// (two containers of 60 are two shares, on one GPU or two).
pub fn pod_gpu_request(
    pod: &Pod,
    options: &RequestOptions,
) -> Result<Option<PodGpuRequest>, RequestError> {
    let Some(spec) = &pod.spec else {
        return Ok(None);
    };
    let init = spec.init_containers.iter().flatten().map(|container| {
        let sidecar = container.restart_policy.as_deref() == Some("Always");
        let role = if sidecar {
            ContainerRole::Sidecar
        } else {
            ContainerRole::Init
        };
        (container, role)
    });
    let apps = spec.containers.iter().map(|c| (c, ContainerRole::App));
    let mut containers = Vec::new();
    for (container, role) in init.chain(apps) {
        let who = format!("{} {}", role.noun(), container.name);
        let amounts = amounts(container, options, &who)?;
        if let Some(sums) = container_request(&amounts, &who)? {
            let asked_as = if amounts.contains_key(ALIYUN_GPU_MEM) {
                Some(crate::asked::AskedAs::Gpushare {
                    unit: options.gpushare_memory_unit.bytes(),
                })
            } else if amounts.contains_key(VOLCANO_GPU_MEMORY) {
                Some(crate::asked::AskedAs::Volcano {
                    unit: options.volcano_memory_unit,
                })
            } else {
                None
            };
            containers.push(ContainerGpuRequest {
                name: container.name.clone(),
                role,
                gpu: to_request(sums, &who)?,
                asked_as,
            });
        }
    }
    if containers.is_empty() {
        // Annotations alone ask for nothing: without a GPU resource there is nothing to place.
        return Ok(None);
    }
    let mut rules = selection::PodRules::parse(pod.metadata.annotations.as_ref())?;
    // MPS holds one GPU's share per container (a namespace is one GPU's server's):
    // shares of several GPUs in one container go where MPS is not.
    if let Some(many) = containers
        .iter()
        .find(|c| c.gpu.count > 1 && !c.gpu.is_whole())
    {
        rules.selection.rules.push(selection::GpuRule {
            annotation: format!(
                "{} {} (shares of {} GPUs)",
                many.role.noun(),
                many.name,
                many.gpu.count
            ),
            value: "not where MPS holds shares, one GPU per container".to_owned(),
            matches: selection::GpuMatch::Labels(vec![selection::LabelRequirement {
                key: crate::enforcement::LABEL_ENFORCE_MPS.to_owned(),
                operator: selection::LabelOperator::NotIn,
                values: vec!["true".to_owned()],
            }]),
        });
    }
    // A group is a namespace's own: the same name in another namespace is another
    // group, so no tenant can join (or squat) another tenant's GPU by its name.
    if let Some(name) = rules.sharing_group.take() {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        rules.sharing_group = Some(format!("{namespace}/{name}"));
    }
    if let Some(group) = &rules.sharing_group {
        // A group is one GPU: a container asking for more could never be in it.
        if let Some(many) = containers.iter().find(|c| c.gpu.count != 1) {
            let annotations = pod.metadata.annotations.as_ref();
            let (key, value) = [selection::SHARING_GROUP, selection::KUBESHARE_GPUID]
                .into_iter()
                .find_map(|key| Some((key, annotations?.get(key)?.clone())))
                .unwrap_or((selection::SHARING_GROUP, group.clone()));
            return Err(RequestError::Annotation {
                key: key.to_owned(),
                value,
                problem: format!(
                    "a sharing group shares one GPU; {} {} asks for {}",
                    many.role.noun(),
                    many.name,
                    many.gpu.count
                ),
            });
        }
    }
    Ok(Some(PodGpuRequest {
        containers,
        selection: rules.selection,
        gpu_policy: rules.gpu_policy,
        node_policy: rules.node_policy,
        sharing_group: rules.sharing_group,
    }))
}

#[cfg(test)]
mod compat_tests;

#[cfg(test)]
mod tests;
