//! Each system's names for a container's GPU share (Koordinator's, HAMi's, gpushare's,
//! Volcano's, KubeShare's) summed and checked into one [`GpuRequest`].

use super::*;

/// Above this many GiB, `aliyun.com/gpu-mem` is surely written in MiB: no GPU has
/// a TiB of memory.
pub(super) const GPUSHARE_GIB_SANITY: u64 = 1024;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sums {
    pub(super) core: u64,
    pub(super) memory: u64,
    pub(super) ratio: u64,
    pub(super) count: u64,
}

pub(super) fn amounts(
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

pub(super) fn container_request(
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
pub(super) fn hami_core(
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
pub(super) fn volcano_vgpu(
    amounts: &BTreeMap<&'static str, u64>,
    who: &str,
) -> Result<Sums, RequestError> {
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
pub(super) fn koordinator_shared(
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

pub(super) fn to_request(sums: Sums, who: &str) -> Result<GpuRequest, RequestError> {
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
