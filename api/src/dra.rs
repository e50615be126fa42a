//! Tessera's GPUs as Kubernetes Dynamic Resource Allocation sees them
//! (`resource.k8s.io/v1`): one ResourceSlice per node, built from the node's
//! Device CR, whose GPUs each offer consumable capacity (KEP-5075) — `cores`
//! (percent of the GPU's compute) and `memory` (bytes) — so that kube-scheduler's
//! own allocator places fractions of a GPU. No I/O here: the publisher and the
//! kubelet plugin build on these (docs/dra.md).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequestPolicy, CapacityRequestPolicyRange, Device as DraDevice,
    DeviceAttribute, DeviceCapacity, DeviceClass, DeviceClassSpec, DeviceSelector, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::device::{Device, DeviceInfo};
use crate::resources::{DEVICE_TYPE_GPU, GPU_MEMORY, LABEL_GPU_MODEL};

pub mod prepared;

/// The DRA driver name: devices, classes and prepared claims carry it.
pub const DRIVER: &str = "gpu.tessera.io";
/// The DeviceClass a claim names for one of Tessera's GPUs, whole or a share.
pub const DEVICE_CLASS: &str = "gpu.tessera.io";
/// A GPU's compute, in percent of the GPU: what a claim's `cores` consumes.
pub const CORES: &str = "cores";
/// A GPU's memory, in bytes: what a claim's `memory` consumes.
pub const MEMORY: &str = "memory";
/// The step a memory request is rounded up to: one MiB, as HAMi's `gpumem` counts.
pub const MEMORY_STEP: u64 = 1 << 20;

/// Why a node's GPUs, or one of them, cannot be published as a ResourceSlice.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SliceError {
    /// A GPU reports less than one MiB of memory (or none): no share of it could
    /// be granted or held. The GPU is left out; the others are published.
    #[error(
        "Device {node}: GPU {uuid} reports no memory ({GPU_MEMORY}): left out of the ResourceSlice"
    )]
    NoMemory {
        /// The node.
        node: String,
        /// The GPU.
        uuid: String,
    },
    /// Two GPUs would have the same device name.
    #[error("Device {node}: two GPUs are both device {name} (a minor number repeated)")]
    Duplicate {
        /// The node.
        node: String,
        /// The name.
        name: String,
    },
}

/// The DeviceClass claims name for Tessera's GPUs: every device of [`DRIVER`].
pub fn device_class() -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(DEVICE_CLASS.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!("device.driver == {DRIVER:?}"),
                }),
            }]),
            ..DeviceClassSpec::default()
        }),
    }
}

/// The name of the ResourceSlice that publishes `node`'s GPUs.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{DRIVER}")
}

/// `node`'s healthy GPUs (from its Device CR `device`) as one ResourceSlice of
/// pool `node` at `generation`. Each GPU is one device that many claims may share
/// (`allowMultipleAllocations`), each consuming `cores` and `memory`. A claim that
/// states neither gets the whole GPU (every default is all of it); a share states
/// both, and a memory-only share states `cores: 0` (Tessera's "memory, no compute
/// share", docs/compat.md). Unhealthy GPUs are left out: a slice lists what can be
/// allocated now. So is a GPU with no memory, which comes back with the slice, as
/// why, for the caller to say.
pub fn resource_slice(
    node: &str,
    device: &Device,
    generation: i64,
) -> Result<(ResourceSlice, Vec<SliceError>), SliceError> {
    let mut devices: Vec<DraDevice> = Vec::new();
    let mut left_out = Vec::new();
    let gpus = device
        .spec
        .devices
        .iter()
        .filter(|d| d.device_type == DEVICE_TYPE_GPU && d.health);
    for (index, gpu) in gpus.enumerate() {
        let dra = match gpu_device(node, index, gpu) {
            Ok(dra) => dra,
            Err(error @ SliceError::NoMemory { .. }) => {
                left_out.push(error);
                continue;
            }
            Err(error) => return Err(error),
        };
        if devices.iter().any(|d| d.name == dra.name) {
            return Err(SliceError::Duplicate {
                node: node.to_owned(),
                name: dra.name,
            });
        }
        devices.push(dra);
    }
    let slice = ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    };
    Ok((slice, left_out))
}

/// A GPU's device name: `gpu-MINOR` (kubelet and nvidia-smi's number), or
/// `gpu-at-INDEX` for a GPU that reports no minor.
pub fn device_name(gpu: &DeviceInfo, index: usize) -> String {
    match gpu.minor {
        Some(minor) if minor >= 0 => format!("gpu-{minor}"),
        _ => format!("gpu-at-{index}"),
    }
}

fn gpu_device(node: &str, index: usize, gpu: &DeviceInfo) -> Result<DraDevice, SliceError> {
    let memory = gpu
        .resources
        .get(GPU_MEMORY)
        .and_then(|q| crate::Quantity::parse(&q.0).ok())
        .map(|q| q.value())
        // Whole MiB: kube-apiserver requires the capacity, less the smallest
        // request, to be whole steps. Rounded down, never offering more than is.
        .map(|bytes| bytes / MEMORY_STEP * MEMORY_STEP)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| SliceError::NoMemory {
            node: node.to_owned(),
            uuid: gpu.id.clone(),
        })?;
    let mut attributes = BTreeMap::new();
    let text = |value: &str| DeviceAttribute {
        string: Some(value.to_owned()),
        ..DeviceAttribute::default()
    };
    let number = |value: i64| DeviceAttribute {
        int: Some(value),
        ..DeviceAttribute::default()
    };
    attributes.insert("uuid".to_owned(), text(&gpu.id));
    if let Some(model) = gpu.labels.get(LABEL_GPU_MODEL) {
        attributes.insert("model".to_owned(), text(model));
    }
    if let Some(minor) = gpu.minor {
        attributes.insert("minor".to_owned(), number(i64::from(minor)));
    }
    if let Some(topology) = &gpu.topology {
        if topology.node_id >= 0 {
            attributes.insert("numaNode".to_owned(), number(i64::from(topology.node_id)));
        }
        if !topology.pcie_id.is_empty() {
            attributes.insert("pcieSwitch".to_owned(), text(&topology.pcie_id));
        }
        if !topology.bus_id.is_empty() {
            attributes.insert("pciBusID".to_owned(), text(&topology.bus_id));
        }
    }
    let capacity = BTreeMap::from([
        (CORES.to_owned(), consumable(100, 0, 1)),
        (
            MEMORY.to_owned(),
            consumable(memory, MEMORY_STEP, MEMORY_STEP),
        ),
    ]);
    Ok(DraDevice {
        name: device_name(gpu, index),
        attributes: Some(attributes),
        capacity: Some(capacity),
        allow_multiple_allocations: Some(true),
        ..DraDevice::default()
    })
}

/// A capacity of `value` that claims consume in steps of `step`, from `min` up
/// to all of it, and all of it when a claim does not say.
fn consumable(value: u64, min: u64, step: u64) -> DeviceCapacity {
    let all = Quantity(value.to_string());
    DeviceCapacity {
        value: all.clone(),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(all.clone()),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(min.to_string()),
                max: Some(all),
                step: Some(Quantity(step.to_string())),
            }),
            valid_values: None,
        }),
    }
}

#[cfg(test)]
mod tests;
