//! A pod's GPU request, from any of the resource names the scheduler accepts.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as K8sQuantity;

use crate::quantity::Quantity;
use crate::resources::{GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED, NVIDIA_GPU};

/// `aliyun.com/gpu-mem`: MiB on one GPU (gpushare).
pub const ALIYUN_GPU_MEM: &str = "aliyun.com/gpu-mem";
/// `nvidia.com/gpumem`: MiB per GPU (HAMi), with `nvidia.com/gpu` as the count.
pub const HAMI_GPU_MEM: &str = "nvidia.com/gpumem";
/// `nvidia.com/gpucores`: percent per GPU (HAMi).
pub const HAMI_GPU_CORES: &str = "nvidia.com/gpucores";
/// `volcano.sh/gpu-memory`: memory on one GPU, in a configurable unit.
pub const VOLCANO_GPU_MEMORY: &str = "volcano.sh/gpu-memory";

/// Every resource name the scheduler manages.
pub const MANAGED_RESOURCES: &[&str] = &[
    GPU_CORE,
    GPU_MEMORY,
    GPU_MEMORY_RATIO,
    GPU_SHARED,
    NVIDIA_GPU,
    ALIYUN_GPU_MEM,
    HAMI_GPU_MEM,
    HAMI_GPU_CORES,
    VOLCANO_GPU_MEMORY,
];

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

/// Settings of request parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestOptions {
    /// Bytes in one unit of `volcano.sh/gpu-memory` (MiB by default).
    pub volcano_memory_unit: u64,
}

impl Default for RequestOptions {
    fn default() -> Self {
        Self {
            volcano_memory_unit: 1 << 20,
        }
    }
}

/// Why a request is invalid; the message is shown to the user as the filter error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{container}: {problem}")]
pub struct RequestError {
    /// `container NAME` or `init container NAME`.
    pub container: String,
    /// What is wrong.
    pub problem: String,
}

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
) -> Result<(BTreeMap<&'static str, u64>, String), RequestError> {
    let name = container.name.clone();
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
    let mut out = BTreeMap::new();
    for key in MANAGED_RESOURCES {
        if let Some(quantity) = pick(key) {
            let value = Quantity::parse(&quantity.0).map_err(|e| RequestError {
                container: format!("container {name}"),
                problem: format!("{key}: {e}"),
            })?;
            let unit = match *key {
                ALIYUN_GPU_MEM | HAMI_GPU_MEM => 1 << 20,
                VOLCANO_GPU_MEMORY => options.volcano_memory_unit,
                _ => 1,
            };
            out.insert(*key, value.value().saturating_mul(unit));
        }
    }
    Ok((out, name))
}

fn container_request(
    amounts: &BTreeMap<&'static str, u64>,
    who: &str,
) -> Result<Option<Sums>, RequestError> {
    let err = |problem: String| RequestError {
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
    let mut sums = Sums::default();
    let hami = get(HAMI_GPU_MEM).is_some() || get(HAMI_GPU_CORES).is_some();
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
    if hami {
        let count = get(NVIDIA_GPU).unwrap_or(1).max(1);
        let cores = get(HAMI_GPU_CORES).unwrap_or(0);
        if cores > 100 {
            return Err(err(format!(
                "{HAMI_GPU_CORES} {cores}: at most 100 (percent of one GPU)"
            )));
        }
        sums.count = count;
        sums.core = cores;
        sums.memory = get(HAMI_GPU_MEM).unwrap_or(0);
    } else if let Some(count) = get(NVIDIA_GPU) {
        if sums != Sums::default() {
            return Err(err(format!(
                "{NVIDIA_GPU} cannot be combined with koordinator.sh/* GPU resources"
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
            if sums.memory != 0 || sums.ratio != 0 {
                return Err(err(format!(
                    "{key} cannot be combined with other GPU memory resources"
                )));
            }
            sums.memory = bytes;
        }
    }
    Ok((sums != Sums::default()).then_some(sums))
}

fn to_request(sums: Sums, who: &str) -> Result<GpuRequest, RequestError> {
    let err = |problem: String| RequestError {
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

/// The pod's GPU request: app containers summed, init containers' maximum, as
/// Kubernetes computes effective requests. `None` when the pod asks for no GPU.
pub fn pod_gpu_request(
    pod: &Pod,
    options: &RequestOptions,
) -> Result<Option<GpuRequest>, RequestError> {
    let Some(spec) = &pod.spec else {
        return Ok(None);
    };
    let mut apps: Option<(Sums, String)> = None;
    for container in &spec.containers {
        let (amounts, name) = amounts(container, options)?;
        let who = format!("container {name}");
        if let Some(sums) = container_request(&amounts, &who)? {
            let total = apps.get_or_insert((Sums::default(), who));
            total.0.core += sums.core;
            total.0.memory += sums.memory;
            total.0.ratio += sums.ratio;
            total.0.count += sums.count;
        }
    }
    let mut request = match apps {
        Some((sums, who)) => Some(to_request(sums, &who)?),
        None => None,
    };
    for container in spec.init_containers.iter().flatten() {
        let (amounts, name) = amounts(container, options)?;
        let who = format!("init container {name}");
        if let Some(sums) = container_request(&amounts, &who)? {
            let init = to_request(sums, &who)?;
            // The larger of the two: init containers run before, never beside, app containers.
            let bigger = match request {
                None => true,
                Some(current) => (init.count, init.core) > (current.count, current.core),
            };
            if bigger {
                request = Some(init);
            }
        }
    }
    Ok(request)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};

    use super::*;

    fn container(name: &str, resources: &[(&str, &str)]) -> Container {
        Container {
            name: name.into(),
            resources: Some(ResourceRequirements {
                limits: Some(
                    resources
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), K8sQuantity((*v).to_owned())))
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn pod(containers: Vec<Container>, init: Vec<Container>) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers,
                init_containers: Some(init),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn request(resources: &[(&str, &str)]) -> Result<Option<GpuRequest>, RequestError> {
        pod_gpu_request(
            &pod(vec![container("main", resources)], vec![]),
            &RequestOptions::default(),
        )
    }

    #[test]
    fn every_name() {
        assert_eq!(request(&[]), Ok(None));
        assert_eq!(
            request(&[(GPU_SHARED, "50")]),
            Ok(Some(GpuRequest {
                count: 1,
                core: 50,
                memory: GpuMemory::Ratio(50)
            }))
        );
        assert_eq!(
            request(&[(GPU_SHARED, "200")]),
            Ok(Some(GpuRequest {
                count: 2,
                core: 100,
                memory: GpuMemory::Ratio(100)
            }))
        );
        assert_eq!(
            request(&[(GPU_CORE, "25"), (GPU_MEMORY, "8Gi")]),
            Ok(Some(GpuRequest {
                count: 1,
                core: 25,
                memory: GpuMemory::Bytes(8 << 30)
            }))
        );
        assert_eq!(
            request(&[(GPU_MEMORY_RATIO, "30")]),
            Ok(Some(GpuRequest {
                count: 1,
                core: 0,
                memory: GpuMemory::Ratio(30)
            }))
        );
        assert_eq!(
            request(&[(NVIDIA_GPU, "2")]),
            Ok(Some(GpuRequest {
                count: 2,
                core: 100,
                memory: GpuMemory::Ratio(100)
            }))
        );
        assert_eq!(
            request(&[(ALIYUN_GPU_MEM, "8138")]),
            Ok(Some(GpuRequest {
                count: 1,
                core: 0,
                memory: GpuMemory::Bytes(8138 << 20)
            }))
        );
        assert_eq!(
            request(&[
                (NVIDIA_GPU, "2"),
                (HAMI_GPU_MEM, "4096"),
                (HAMI_GPU_CORES, "30")
            ]),
            Ok(Some(GpuRequest {
                count: 2,
                core: 30,
                memory: GpuMemory::Bytes(4096 << 20)
            }))
        );
        assert_eq!(
            request(&[(VOLCANO_GPU_MEMORY, "1024")]),
            Ok(Some(GpuRequest {
                count: 1,
                core: 0,
                memory: GpuMemory::Bytes(1 << 30)
            }))
        );
        assert!(
            request(&[(NVIDIA_GPU, "1")])
                .expect("valid")
                .expect("gpu")
                .is_whole()
        );
    }

    #[test]
    fn invalid_requests_say_why() {
        let error = request(&[(GPU_CORE, "150")])
            .expect_err("not a multiple")
            .to_string();
        assert_eq!(
            error,
            "container main: koordinator.sh/gpu-core 150: values above 100 must be multiples of 100 (whole GPUs)"
        );
        assert!(
            request(&[(NVIDIA_GPU, "1"), (GPU_CORE, "50")])
                .expect_err("mixed")
                .to_string()
                .contains("cannot be combined")
        );
        assert!(
            request(&[(GPU_MEMORY, "1Gi"), (GPU_MEMORY_RATIO, "10")])
                .expect_err("both")
                .to_string()
                .contains("cannot both be set")
        );
        assert!(
            request(&[(GPU_CORE, "x")])
                .expect_err("syntax")
                .to_string()
                .contains("koordinator.sh/gpu-core: expected a quantity")
        );
        assert!(
            request(&[(GPU_CORE, "200"), (GPU_MEMORY_RATIO, "300")])
                .expect_err("counts")
                .to_string()
                .contains("different numbers")
        );
    }

    #[test]
    fn apps_sum_and_init_containers_take_the_max() {
        let apps = vec![
            container("a", &[(GPU_CORE, "20"), (GPU_MEMORY_RATIO, "20")]),
            container("b", &[(GPU_CORE, "30"), (GPU_MEMORY_RATIO, "30")]),
        ];
        let init = vec![container(
            "i",
            &[(GPU_CORE, "40"), (GPU_MEMORY_RATIO, "40")],
        )];
        let summed =
            pod_gpu_request(&pod(apps.clone(), init), &RequestOptions::default()).expect("valid");
        assert_eq!(
            summed,
            Some(GpuRequest {
                count: 1,
                core: 50,
                memory: GpuMemory::Ratio(50)
            })
        );
        let bigger_init = vec![container("i", &[(NVIDIA_GPU, "1")])];
        let result =
            pod_gpu_request(&pod(apps, bigger_init), &RequestOptions::default()).expect("valid");
        assert_eq!(
            result,
            Some(GpuRequest {
                count: 1,
                core: 100,
                memory: GpuMemory::Ratio(100)
            })
        );
    }
}
