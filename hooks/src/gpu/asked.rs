//! The env another system's device plugin sets, for a container that asked in
//! that system's names (`tessera.io/requested-as`, written by tessera-scheduler
//! with the allocation): its users' applications size themselves from it. Every
//! value comes from the grant and the node, never from the pod.
//!
//! - gpushare (`aliyun.com/gpu-mem`), in its memory unit: `ALIYUN_COM_GPU_MEM_IDX`
//!   (the GPU's index), `ALIYUN_COM_GPU_MEM_POD` (the pod's GPU memory),
//!   `ALIYUN_COM_GPU_MEM_CONTAINER` (the container's), `ALIYUN_COM_GPU_MEM_DEV`
//!   (the GPU's total), as its device plugin's Allocate sets them.
//! - Volcano's GPU share (`volcano.sh/gpu-memory`), in its unit:
//!   `VOLCANO_GPU_ALLOCATED` (the container's), `VOLCANO_GPU_MEMORY_TOTAL` (the
//!   GPU's).

use tessera_api::DeviceAllocations;
use tessera_api::asked::{AskedAs, REQUESTED_AS, parse};
use tessera_hook_protocol::hook::v1::{ContainerHookRequest, ContainerHookResponse};

use super::enforce::granted_bytes;
use super::{NodeDevices, ResolvedGpu, kv, resolve_gpus};

/// Sets the env of the system `container` asked in, if the pod's annotation
/// names one for it and the grant is one GPU (as both systems grant). An
/// annotation that does not parse is ignored: it only ever adds env.
pub(super) fn system_env(
    container: &ContainerHookRequest,
    name: &str,
    allocations: &DeviceAllocations,
    gpus: &[ResolvedGpu<'_>],
    node: &NodeDevices,
    edit: &mut ContainerHookResponse,
) {
    let Some(asked) = container
        .pod
        .as_ref()
        .and_then(|p| p.annotations.get(REQUESTED_AS))
        .and_then(|text| parse(text).ok())
    else {
        return;
    };
    let (Some(system), [gpu]) = (asked.get(name), gpus) else {
        return;
    };
    let Some(bytes) = granted_bytes(gpu) else {
        return;
    };
    let total = gpu.memory_total;
    match *system {
        AskedAs::Gpushare { unit } => {
            // The pod's: every container that asked in gpushare's names.
            let pod_bytes: u64 = asked
                .iter()
                .filter(|(_, s)| matches!(s, AskedAs::Gpushare { .. }))
                .filter_map(|(other, _)| {
                    let granted = allocations.gpus_of_container(other);
                    let resolved = resolve_gpus(&granted, node, "", other).ok()?;
                    Some(resolved.iter().filter_map(granted_bytes).sum::<u64>())
                })
                .sum();
            let index = node
                .gpus
                .as_ref()
                .and_then(|gpus| gpus.iter().position(|g| g.uuid == gpu.uuid));
            if let Some(index) = index {
                edit.set_envs
                    .push(kv("ALIYUN_COM_GPU_MEM_IDX", index.to_string()));
            }
            edit.set_envs
                .push(kv("ALIYUN_COM_GPU_MEM_POD", (pod_bytes / unit).to_string()));
            edit.set_envs.push(kv(
                "ALIYUN_COM_GPU_MEM_CONTAINER",
                (bytes / unit).to_string(),
            ));
            if let Some(total) = total {
                edit.set_envs
                    .push(kv("ALIYUN_COM_GPU_MEM_DEV", (total / unit).to_string()));
            }
        }
        AskedAs::Volcano { unit } => {
            edit.set_envs
                .push(kv("VOLCANO_GPU_ALLOCATED", (bytes / unit).to_string()));
            if let Some(total) = total {
                edit.set_envs
                    .push(kv("VOLCANO_GPU_MEMORY_TOTAL", (total / unit).to_string()));
            }
        }
    }
}
