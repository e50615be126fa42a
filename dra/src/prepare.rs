//! From a ResourceClaim's allocation, this node's ResourceSlice and the pods the
//! claim is reserved for to what the node prepares: pure, so every refusal is
//! unit-tested without kubelet or an API server.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use tessera_api::dra::prepared::{ClaimPod, PreparedClaim, PreparedDevice};
use tessera_api::dra::{CORES, DRIVER, MEMORY};
use tessera_api::quantity::Quantity;

pub use tessera_api::dra::prepared::CDI_KIND;

/// Why a claim cannot be prepared on this node. Each names the claim and what
/// in it, or in the node's slice, is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrepareError {
    /// The claim has no allocation (kubelet prepares allocated claims only).
    #[error("ResourceClaim {claim}: not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// The claim kubelet named is not the one the API server has (recreated).
    #[error("ResourceClaim {claim}: UID {found}, kubelet asked for {asked}")]
    Uid {
        /// `namespace/name`.
        claim: String,
        /// The API server's UID.
        found: String,
        /// kubelet's.
        asked: String,
    },
    /// An allocation result names a device this node's slice does not offer
    /// (or lists without the UUID, minor and memory a GPU needs on the node).
    #[error(
        "ResourceClaim {claim}: result {index} (request {request}) is device {device} of pool {pool}, which this node's ResourceSlice does not list with a uuid, a minor and memory"
    )]
    UnknownDevice {
        /// `namespace/name`.
        claim: String,
        /// The result's index in `status.allocation.devices.results`.
        index: usize,
        /// Its request.
        request: String,
        /// Its pool.
        pool: String,
        /// Its device.
        device: String,
    },
    /// An admin-access result: it consumes nothing of a device other claims may
    /// share, so no share of it can be held; refused rather than given the GPU.
    #[error(
        "ResourceClaim {claim}: result {index} (request {request}) has adminAccess: Tessera does not grant admin access to its GPUs (it would reach a GPU other claims share, with no share of its own to hold)"
    )]
    AdminAccess {
        /// `namespace/name`.
        claim: String,
        /// The result's index.
        index: usize,
        /// Its request.
        request: String,
    },
    /// A slice device or a result's consumed capacity cannot be read.
    #[error("ResourceClaim {claim}: {path}: {problem}")]
    Field {
        /// `namespace/name`.
        claim: String,
        /// Where.
        path: String,
        /// What is wrong.
        problem: String,
    },
}

/// One GPU of this node's slice, as preparing needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceGpu {
    /// Its UUID.
    pub uuid: String,
    /// Its minor number.
    pub minor: u32,
    /// The memory the slice offers, bytes.
    pub memory: u64,
}

/// The GPUs of `slice` by device name. A device without a UUID, a minor or a
/// memory capacity is left out (a claim on it then fails as unknown).
pub fn slice_gpus(slice: &ResourceSlice) -> BTreeMap<String, SliceGpu> {
    let mut gpus = BTreeMap::new();
    for device in slice.spec.devices.iter().flatten() {
        let attributes = device.attributes.as_ref();
        let uuid = attributes
            .and_then(|a| a.get("uuid"))
            .and_then(|a| a.string.clone());
        let minor = attributes
            .and_then(|a| a.get("minor"))
            .and_then(|a| a.int)
            .and_then(|m| u32::try_from(m).ok());
        let memory = device
            .capacity
            .as_ref()
            .and_then(|c| c.get(MEMORY))
            .and_then(|c| Quantity::parse(&c.value.0).ok())
            .map(|q| q.value());
        if let (Some(uuid), Some(minor), Some(memory)) = (uuid, minor, memory) {
            gpus.insert(
                device.name.clone(),
                SliceGpu {
                    uuid,
                    minor,
                    memory,
                },
            );
        }
    }
    gpus
}

/// The CDI device name of a claim's `index`th result: `<claim UID>-<index>`
/// (CDI names allow letters, digits, `-`, `_`, `.`, `:`; a UID is hex and `-`).
pub fn cdi_device_name(claim_uid: &str, index: usize) -> String {
    format!("{claim_uid}-{index}")
}

/// What to prepare for `claim` (kubelet asked for UID `uid`) on `node`: each of
/// its allocation results for [`DRIVER`] in this node's pool, resolved against
/// `gpus` (this node's slice), and `pods` (those it is reserved for that could be
/// read) with the containers that use it.
pub fn prepared_claim(
    claim: &ResourceClaim,
    uid: &str,
    node: &str,
    gpus: &BTreeMap<String, SliceGpu>,
    pods: &[Pod],
) -> Result<PreparedClaim, PrepareError> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let at = format!("{namespace}/{name}");
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != uid {
        return Err(PrepareError::Uid {
            claim: at,
            found,
            asked: uid.to_owned(),
        });
    }
    let results = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .ok_or_else(|| PrepareError::NotAllocated { claim: at.clone() })?;
    let mut devices = Vec::new();
    for (index, result) in results.iter().enumerate() {
        if result.driver != DRIVER || result.pool != node {
            continue;
        }
        if result.admin_access == Some(true) {
            return Err(PrepareError::AdminAccess {
                claim: at.clone(),
                index,
                request: result.request.clone(),
            });
        }
        let gpu = gpus
            .get(&result.device)
            .ok_or_else(|| PrepareError::UnknownDevice {
                claim: at.clone(),
                index,
                request: result.request.clone(),
                pool: result.pool.clone(),
                device: result.device.clone(),
            })?;
        let consumed = |key: &str| -> Result<Option<u64>, PrepareError> {
            let Some(value) = result.consumed_capacity.as_ref().and_then(|c| c.get(key)) else {
                return Ok(None);
            };
            Quantity::parse(&value.0)
                .map(|q| Some(q.value()))
                .map_err(|error| PrepareError::Field {
                    claim: at.clone(),
                    path: format!(
                        "status.allocation.devices.results[{index}].consumedCapacity.{key}"
                    ),
                    problem: format!("{:?}: {error}", value.0),
                })
        };
        // No consumed capacity: allocated without consumable capacity (the
        // feature off), which makes the device exclusive, so the whole GPU.
        let cores = consumed(CORES)?.unwrap_or(100);
        let memory = consumed(MEMORY)?.unwrap_or(gpu.memory);
        if cores > 100 || memory > gpu.memory {
            return Err(PrepareError::Field {
                claim: at.clone(),
                path: format!("status.allocation.devices.results[{index}].consumedCapacity"),
                problem: format!(
                    "cores {cores}, memory {memory} is more than device {} offers (cores 100, memory {})",
                    result.device, gpu.memory
                ),
            });
        }
        devices.push(PreparedDevice {
            request: result.request.clone(),
            pool: result.pool.clone(),
            device: result.device.clone(),
            uuid: gpu.uuid.clone(),
            minor: gpu.minor,
            cores,
            memory,
            memory_offered: gpu.memory,
            share_id: result.share_id.clone(),
            cdi_device: format!("{CDI_KIND}={}", cdi_device_name(uid, index)),
        });
    }
    let pods = pods
        .iter()
        .map(|pod| claim_pod(pod, &name))
        .filter(|pod| !pod.containers.is_empty())
        .collect();
    Ok(PreparedClaim {
        namespace,
        name,
        uid: uid.to_owned(),
        pods,
        devices,
    })
}

/// The pods `status.reservedFor` names, as `(name, uid)`.
pub fn reserved_pods(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| (r.name.clone(), r.uid.clone()))
        .collect()
}

/// `pod`, and its containers that use the claim named `claim`: through a pod
/// claim entry that names it (`resourceClaimName`) or whose generated claim it
/// is (`status.resourceClaimStatuses`).
fn claim_pod(pod: &Pod, claim: &str) -> ClaimPod {
    let statuses: BTreeMap<&str, &str> = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|s| Some((s.name.as_str(), s.resource_claim_name.as_deref()?)))
        .collect();
    let spec = pod.spec.as_ref();
    let entries: Vec<&str> = spec
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .filter(|entry| {
            let named = entry
                .resource_claim_name
                .as_deref()
                .or_else(|| statuses.get(entry.name.as_str()).copied());
            named == Some(claim)
        })
        .map(|entry| entry.name.as_str())
        .collect();
    let mut containers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Init containers that are not sidecars (restartPolicy Always) run to their
    // end, one at a time, before the others start.
    let run_before: Vec<String> = spec
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() != Some("Always"))
        .map(|c| c.name.clone())
        .collect();
    let all = spec
        .map(|s| s.init_containers.iter().flatten().chain(&s.containers))
        .into_iter()
        .flatten();
    for container in all {
        let uses: Vec<Option<&str>> = container
            .resources
            .as_ref()
            .and_then(|r| r.claims.as_ref())
            .into_iter()
            .flatten()
            .filter(|c| entries.contains(&c.name.as_str()))
            .map(|c| c.request.as_deref().filter(|r| !r.is_empty()))
            .collect();
        if uses.is_empty() {
            continue;
        }
        // An entry with no request uses the whole claim: every request.
        let requests = if uses.iter().any(Option::is_none) {
            Vec::new()
        } else {
            uses.into_iter().flatten().map(str::to_owned).collect()
        };
        containers.insert(container.name.clone(), requests);
    }
    let metadata = &pod.metadata;
    let run_before = run_before
        .into_iter()
        .filter(|name| containers.contains_key(name))
        .collect();
    ClaimPod {
        uid: metadata.uid.clone().unwrap_or_default(),
        namespace: metadata.namespace.clone().unwrap_or_default(),
        name: metadata.name.clone().unwrap_or_default(),
        containers,
        run_before,
    }
}
