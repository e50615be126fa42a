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

/// Above this many GiB, `aliyun.com/gpu-mem` is surely written in MiB: no GPU has
/// a TiB of memory.
const GPUSHARE_GIB_SANITY: u64 = 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sums {
    core: u64,
    memory: u64,
    ratio: u64,
    count: u64,
}

fn amounts(
    container: &Container,
    options: &RequestOptions,
    who: &str,
) -> Result<BTreeMap<&'static str, u64>, RequestError> {
    let resources = container.resources.as_ref();
    // Extended resources: limits are authoritative, requests must equal them.
    let pick = |key: &str| -> Option<&K8sQuantity> {
        resources.and_then(|r| {
            r.limits
                .as_ref()
                .and_then(|l| l.get(key))
                .or_else(|| r.requests.as_ref().and_then(|q| q.get(key)))
        })
    };
    // Koordinator's old names would be placed as if they were not there: refused,
    // with the same words as the admission policy that refuses them at creation.
    for (old, new) in DEPRECATED_GPU_NAMES {
        if let Some(quantity) = pick(old) {
            return Err(RequestError::Container {
                container: who.to_owned(),
                problem: format!(
                    "{old} {q}: Koordinator's deprecated name, which kube-scheduler never hands to an extender (no kubernetes.io/ resource is an extended resource): write {new}: {q} instead, with the same meaning",
                    q = quantity.0
                ),
            });
        }
    }
    for (wrong, meant) in MISSPELLED_GPU_NAMES {
        if let Some(quantity) = pick(wrong) {
            return Err(RequestError::Container {
                container: who.to_owned(),
                problem: format!(
                    "{wrong} {q}: no such resource (Koordinator's v1.6 release notes spell it so; no node offers it, and the pod would wait forever): write {meant}: {q}, the number of GPUs the share is spread over",
                    q = quantity.0
                ),
            });
        }
    }
    let mut out = BTreeMap::new();
    for key in MANAGED_RESOURCES {
        if let Some(quantity) = pick(key) {
            let value = Quantity::parse(&quantity.0).map_err(|e| RequestError::Container {
                container: who.to_owned(),
                problem: format!("{key}: {e}"),
            })?;
            let unit = match *key {
                ALIYUN_GPU_MEM => options.gpushare_memory_unit.bytes(),
                HAMI_GPU_MEM | VOLCANO_VGPU_MEMORY => 1 << 20,
                VOLCANO_GPU_MEMORY => options.volcano_memory_unit,
                _ => 1,
            };
            if *key == ALIYUN_GPU_MEM
                && options.gpushare_memory_unit == MemoryUnit::GiB
                && value.value() > GPUSHARE_GIB_SANITY
            {
                return Err(RequestError::Container {
                    container: who.to_owned(),
                    problem: format!(
                        "{key} {}: {} GiB is more than any GPU holds; gpushare counts GiB unless its device plugin runs with --memory-unit=MiB, and then tessera-scheduler needs --gpushare-memory-unit MiB",
                        quantity.0,
                        value.value()
                    ),
                });
            }
            out.insert(*key, value.value().saturating_mul(unit));
        }
    }
    Ok(out)
}

fn container_request(
    amounts: &BTreeMap<&'static str, u64>,
    who: &str,
) -> Result<Option<Sums>, RequestError> {
    let err = |problem: String| RequestError::Container {
        container: who.to_owned(),
        problem,
    };
    let get = |key: &str| amounts.get(key).copied();
    let multiple = |key: &str, value: u64| -> Result<u64, RequestError> {
        if value > 100 && value % 100 != 0 {
            return Err(err(format!(
                "{key} {value}: values above 100 must be multiples of 100 (whole GPUs)"
            )));
        }
        Ok(value)
    };
    // Volcano's vGPU names make the whole request of their container.
    if VOLCANO_VGPU
        .all()
        .iter()
        .any(|key| get(key).is_some_and(|v| v > 0))
    {
        return volcano_vgpu(amounts, who).map(Some);
    }
    let mut sums = Sums::default();
    // 0 of a HAMi name is unset, as in HAMi: beside nvidia.com/gpu, only HAMi names
    // above 0 make the request HAMi's (so `nvidia.com/gpu: 1` with `gpumem: 0` is a
    // whole GPU, as without it). Alone, a HAMi name makes it HAMi's whatever its
    // value: HAMi's webhook gives such a container one GPU by the name's presence.
    let hami_names = [HAMI_GPU_MEM, HAMI_GPU_MEM_PERCENTAGE, HAMI_GPU_CORES];
    let hami = hami_names.iter().any(|key| get(key).is_some_and(|v| v > 0))
        || (get(NVIDIA_GPU).is_none() && hami_names.iter().any(|key| get(key).is_some()));
    if let Some(count) = get(GPU_SHARED_COUNT) {
        sums = koordinator_shared(count, amounts, who)?;
    } else {
        if let Some(shared) = get(GPU_SHARED) {
            sums.core = multiple(GPU_SHARED, shared)?;
            sums.ratio = sums.core;
        }
        if let Some(core) = get(GPU_CORE) {
            sums.core = multiple(GPU_CORE, core)?;
        }
        if let Some(ratio) = get(GPU_MEMORY_RATIO) {
            sums.ratio = multiple(GPU_MEMORY_RATIO, ratio)?;
        }
        if let Some(bytes) = get(GPU_MEMORY) {
            sums.memory = bytes;
        }
    }
    // Whole GPUs: the NVIDIA device plugin's name and Volcano's mean the same.
    let whole = match (get(NVIDIA_GPU), get(VOLCANO_GPU_NUMBER)) {
        (Some(_), Some(_)) => {
            return Err(err(format!(
                "{NVIDIA_GPU} and {VOLCANO_GPU_NUMBER} cannot both be set: each asks for whole GPUs"
            )));
        }
        (Some(count), None) => Some((NVIDIA_GPU, count)),
        (None, Some(count)) => Some((VOLCANO_GPU_NUMBER, count)),
        (None, None) => None,
    };
    if hami {
        if sums != Sums::default() {
            return Err(err(format!(
                "HAMi's {HAMI_GPU_MEM}, {HAMI_GPU_MEM_PERCENTAGE} and {HAMI_GPU_CORES} cannot be combined with koordinator.sh/* GPU resources"
            )));
        }
        if get(VOLCANO_GPU_NUMBER).is_some() {
            return Err(err(format!(
                "{VOLCANO_GPU_NUMBER} cannot be combined with HAMi's names: the count is {NVIDIA_GPU}"
            )));
        }
        // HAMi's webhook gives a container with only memory or cores one GPU.
        let count = get(NVIDIA_GPU).unwrap_or(1).max(1);
        sums = hami_core(&HAMI, count, amounts, who)?;
    } else if let Some((key, count)) = whole {
        if sums != Sums::default() {
            return Err(err(format!(
                "{key} cannot be combined with koordinator.sh/* GPU resources"
            )));
        }
        sums = Sums {
            core: 100 * count,
            ratio: 100 * count,
            memory: 0,
            count,
        };
    }
    for (key, bytes) in [
        (ALIYUN_GPU_MEM, get(ALIYUN_GPU_MEM)),
        (VOLCANO_GPU_MEMORY, get(VOLCANO_GPU_MEMORY)),
    ] {
        if let Some(bytes) = bytes {
            // Whole GPUs carry their whole memory: name that conflict, not memory.
            if let Some((whole_key, _)) = whole.filter(|_| !hami) {
                return Err(err(format!(
                    "{whole_key} asks for whole GPUs, with all their memory, and {key} for memory on one GPU: give one of them"
                )));
            }
            if sums.memory != 0 || sums.ratio != 0 {
                return Err(err(format!(
                    "{key} cannot be combined with other GPU memory resources"
                )));
            }
            sums.memory = bytes;
        }
    }
    // Compute with no memory: Koordinator refuses `gpu-core` without `gpu-memory` or
    // `gpu-memory-ratio` (not one of its valid combinations), and a share with no
    // memory would reach the limiter as a memory limit of 0, which HAMi-core reads
    // as no limit at all. Only `gpu-core` can get here: every other name gives memory.
    if sums.core > 0 && sums.memory == 0 && sums.ratio == 0 {
        return Err(err(format!(
            "{GPU_CORE} {} asks for GPU compute and no GPU memory: add {GPU_MEMORY} or {GPU_MEMORY_RATIO} (Koordinator refuses {GPU_CORE} alone too), or ask {GPU_SHARED} for both",
            sums.core
        )));
    }
    Ok((sums != Sums::default()).then_some(sums))
}

/// A request in the names of a HAMi-core system, read as HAMi reads its own (and
/// Volcano its vGPU names, with HAMi's code): `count` GPUs, each with
/// the cores and the memory the names give; 0 of a memory name is unset, and with
/// no memory name each GPU's whole memory is booked (HAMi's `defaultMem: 0`).
fn hami_core(
    names: &HamiCoreNames,
    count: u64,
    amounts: &BTreeMap<&'static str, u64>,
    who: &str,
) -> Result<Sums, RequestError> {
    let err = |problem: String| RequestError::Container {
        container: who.to_owned(),
        problem,
    };
    let get = |key: &str| amounts.get(key).copied().filter(|&v| v > 0);
    let cores = get(names.cores).unwrap_or(0);
    if cores > 100 {
        return Err(err(format!(
            "{} {cores}: at most 100 (percent of one GPU)",
            names.cores
        )));
    }
    let mut sums = Sums {
        count,
        core: cores,
        ..Sums::default()
    };
    match (get(names.memory), get(names.percentage)) {
        (Some(_), Some(_)) => {
            return Err(err(format!(
                "{} and {} cannot both be set: memory is either MiB or a percent of each GPU",
                names.memory, names.percentage
            )));
        }
        (Some(bytes), None) => sums.memory = bytes,
        (None, Some(percent)) if percent > 100 => {
            return Err(err(format!(
                "{} {percent}: at most 100 (percent of each GPU's memory)",
                names.percentage
            )));
        }
        (None, Some(percent)) => sums.ratio = percent,
        (None, None) => sums.ratio = 100,
    }
    Ok(sums)
}

/// Volcano's vGPU request, as Volcano's `ExtractResourceRequest`
/// (pkg/scheduler/api/devices/util.go) reads it: `vgpu-number` GPUs, or one when
/// only `vgpu-memory` is set. `vgpu-cores` or `vgpu-memory-percentage` without
/// either asks Volcano for nothing: refused, not ignored. Another system's names
/// beside them are refused too.
fn volcano_vgpu(amounts: &BTreeMap<&'static str, u64>, who: &str) -> Result<Sums, RequestError> {
    let err = |problem: String| RequestError::Container {
        container: who.to_owned(),
        problem,
    };
    let get = |key: &str| amounts.get(key).copied().filter(|&v| v > 0);
    let names = VOLCANO_VGPU.all();
    let set = names.into_iter().find(|key| get(key).is_some());
    if let Some(other) = amounts.keys().find(|key| !names.contains(key)) {
        return Err(err(format!(
            "{} cannot be combined with {other}: one system's names per container; Volcano's vGPU names are {VOLCANO_VGPU_NUMBER}, {VOLCANO_VGPU_MEMORY} or {VOLCANO_VGPU_MEMORY_PERCENTAGE}, and {VOLCANO_VGPU_CORES}",
            set.unwrap_or(VOLCANO_VGPU_NUMBER)
        )));
    }
    let count = match (get(VOLCANO_VGPU_NUMBER), get(VOLCANO_VGPU_MEMORY)) {
        (Some(count), _) => count,
        (None, Some(_)) => 1,
        (None, None) => {
            let key = set.unwrap_or(VOLCANO_VGPU_CORES);
            return Err(err(format!(
                "{key} {} alone asks Volcano for no vGPU (it reads one from {VOLCANO_VGPU_NUMBER} or {VOLCANO_VGPU_MEMORY}): add {VOLCANO_VGPU_NUMBER}: 1",
                get(key).unwrap_or(0)
            )));
        }
    };
    hami_core(&VOLCANO_VGPU, count, amounts, who)
}

/// Koordinator's `gpu.shared` request (1.6+: deviceshare's
/// `ValidDeviceResourceCombinationsGPUShared` and
/// `calcDesiredRequestsAndCountForGPU`): `count` GPUs, with `gpu-core`,
/// `gpu-memory` and `gpu-memory-ratio` the totals over them, divided evenly. A
/// count of at least 1 and a memory name are required, and each percent must
/// divide evenly into at most 100 per GPU, as Koordinator requires.
fn koordinator_shared(
    count: u64,
    amounts: &BTreeMap<&'static str, u64>,
    who: &str,
) -> Result<Sums, RequestError> {
    let err = |problem: String| RequestError::Container {
        container: who.to_owned(),
        problem,
    };
    let get = |key: &str| amounts.get(key).copied().unwrap_or(0);
    if count == 0 {
        return Err(err(format!(
            "{GPU_SHARED_COUNT} 0: at least 1, the number of GPUs (Koordinator refuses 0 too)"
        )));
    }
    if amounts.contains_key(GPU_SHARED) {
        return Err(err(format!(
            "{GPU_SHARED_COUNT} and {GPU_SHARED} cannot both be set (Koordinator refuses them together): with {GPU_SHARED_COUNT}, ask {GPU_CORE} and {GPU_MEMORY_RATIO}"
        )));
    }
    if get(GPU_MEMORY) == 0 && get(GPU_MEMORY_RATIO) == 0 {
        return Err(err(format!(
            "{GPU_SHARED_COUNT} {count} asks for no GPU memory: add {GPU_MEMORY} or {GPU_MEMORY_RATIO}, the total over its GPUs (Koordinator refuses it without one too)"
        )));
    }
    let per_gpu = |key: &str| -> Result<u64, RequestError> {
        let total = get(key);
        if total % count != 0 || total / count > 100 {
            return Err(err(format!(
                "{key} {total}: {GPU_SHARED_COUNT} {count} spreads it over {count} GPUs, so it must be a multiple of {count} and at most {}",
                100 * count
            )));
        }
        Ok(total / count)
    };
    Ok(Sums {
        count,
        core: per_gpu(GPU_CORE)?,
        ratio: per_gpu(GPU_MEMORY_RATIO)?,
        memory: get(GPU_MEMORY) / count,
    })
}

fn to_request(sums: Sums, who: &str) -> Result<GpuRequest, RequestError> {
    let err = |problem: String| RequestError::Container {
        container: who.to_owned(),
        problem,
    };
    // Count: explicit (nvidia.com/gpu, HAMi) or from multiples of 100.
    let count = if sums.count > 0 {
        sums.count
    } else {
        (sums.core.max(sums.ratio) / 100).max(1)
    };
    let per_gpu = |total: u64| {
        if sums.count > 0 || total <= 100 {
            total.min(100)
        } else {
            total / count
        }
    };
    if sums.count == 0 && sums.core > 100 && sums.ratio > 100 && sums.core != sums.ratio {
        return Err(err(format!(
            "{GPU_CORE} {} and {GPU_MEMORY_RATIO} {} ask for different numbers of GPUs",
            sums.core, sums.ratio
        )));
    }
    let memory = if sums.ratio > 0 {
        if sums.memory > 0 {
            return Err(err(format!(
                "{GPU_MEMORY} and {GPU_MEMORY_RATIO} cannot both be set"
            )));
        }
        GpuMemory::Ratio(per_gpu(sums.ratio))
    } else if sums.memory > 0 {
        GpuMemory::Bytes(if sums.count > 0 {
            sums.memory
        } else {
            sums.memory / count
        })
    } else {
        GpuMemory::None
    };
    let core = per_gpu(sums.core);
    if core == 0 && memory == GpuMemory::None {
        return Err(err("asks for no GPU compute and no GPU memory".into()));
    }
    Ok(GpuRequest {
        count: u32::try_from(count).map_err(|_| err(format!("{count} GPUs is too many")))?,
        core,
        memory,
    })
}

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
