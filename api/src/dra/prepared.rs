//! The claims Tessera's kubelet plugin has prepared on a node: its checkpoint,
//! and what the runtime proxy reads to give each container of a pod exactly the
//! shares its claims were allocated. No I/O here beyond (de)serialising.
//!
//! The plugin writes the file at `NodePrepareResources` (before kubelet creates the
//! pod's sandbox) and at `NodeUnprepareResources`; the proxy turns a pod's entries
//! into the per-container form of the allocation annotation
//! ([`PreparedClaims::allocation_of_pod`]), so that the GPU hook and every
//! enforcement backend hold a claim's share exactly as they hold the extender's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::allocation::{DeviceAllocation, DeviceAllocations};
use crate::quantity::Quantity;
use crate::resources::{DEVICE_TYPE_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO};

/// The checkpoint's file name, in the plugin's directory
/// (`/var/lib/kubelet/plugins/gpu.tessera.io/claims.json`).
pub const FILE_NAME: &str = "claims.json";
/// The CDI kind of a prepared claim's devices: `gpu.tessera.io/claim=<name>`.
pub const CDI_KIND: &str = "gpu.tessera.io/claim";
/// The pod annotation the runtime proxy sets, and only it (a pod's own value is
/// dropped), on a pod whose prepared claims it turned into the allocation
/// annotation: the claims, `namespace/name`, comma-separated.
pub const CLAIMS_ANNOTATION: &str = "tessera.io/dra-claims";
/// The pod annotation the runtime proxy sets, and only it, with the CDI devices
/// prepared for the pod's claims, comma-separated: a container may carry those
/// of Tessera's claim devices and no other.
pub const DEVICES_ANNOTATION: &str = "tessera.io/dra-devices";
/// The pod annotation the runtime proxy sets, and only it, when a pod's claims
/// cannot be honoured: why. The GPU hook refuses its containers with it.
pub const REFUSED_ANNOTATION: &str = "tessera.io/dra-refused";
/// Every annotation only the runtime proxy may set.
pub const PROXY_ANNOTATIONS: &[&str] = &[CLAIMS_ANNOTATION, DEVICES_ANNOTATION, REFUSED_ANNOTATION];

/// Whether a CDI device name is one of Tessera's DRA driver's (`gpu.tessera.io/…`).
pub fn is_claim_cdi(name: &str) -> bool {
    name.split('/').next() == Some(super::DRIVER)
}

/// The version of the file's format this code writes and reads.
pub const VERSION: u32 = 1;

/// Every claim prepared on the node, by claim UID.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaims {
    /// [`VERSION`].
    pub version: u32,
    /// Claim UID → what was prepared for it.
    #[serde(default)]
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// One prepared ResourceClaim.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The claim's UID.
    pub uid: String,
    /// The pods the claim was reserved for when it was prepared, and which of
    /// their containers use it.
    #[serde(default)]
    pub pods: Vec<ClaimPod>,
    /// Tessera's GPUs the claim was allocated on this node, one per allocation
    /// result.
    #[serde(default)]
    pub devices: Vec<PreparedDevice>,
}

/// A pod a claim is reserved for, and its containers that use the claim.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimPod {
    /// The pod's UID.
    pub uid: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// Container name (init containers included) → the claim's requests it uses
    /// (`resources.claims[].request`); empty: every request of the claim.
    #[serde(default)]
    pub containers: BTreeMap<String, Vec<String>>,
    /// Those of `containers` that are init containers run to completion before
    /// the others start (not sidecars): they never run beside another user.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub run_before: Vec<String>,
}

impl ClaimPod {
    /// How many of this pod's containers use `request` at the same time: those
    /// that run beside each other, or one when only init containers use it.
    fn concurrent_users(&self, request: &str) -> Vec<&str> {
        let users: Vec<&str> = self
            .containers
            .iter()
            .filter(|(_, requests)| uses(requests, request))
            .map(|(name, _)| name.as_str())
            .collect();
        let beside: Vec<&str> = users
            .iter()
            .copied()
            .filter(|name| !self.run_before.iter().any(|r| r == name))
            .collect();
        if beside.is_empty() {
            users.into_iter().take(1).collect()
        } else {
            beside
        }
    }
}

/// What a pod's prepared claims give it, as the runtime proxy applies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaims {
    /// The claims, `namespace/name`.
    pub claims: Vec<String>,
    /// The CDI devices prepared for them.
    pub cdi_devices: Vec<String>,
    /// The allocation they amount to, or why they cannot be honoured.
    pub allocation: Result<DeviceAllocations, String>,
}

/// One allocation result of a claim: a share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    /// The claim's request (`req`, or `req/sub` for a subrequest).
    pub request: String,
    /// The device's pool (the node's name).
    pub pool: String,
    /// The device's name in the ResourceSlice (`gpu-<minor>`).
    pub device: String,
    /// The GPU's UUID.
    pub uuid: String,
    /// The GPU's minor number (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// Percent of the GPU's compute consumed (0: memory alone, no compute share).
    pub cores: u64,
    /// Bytes of the GPU's memory consumed.
    pub memory: u64,
    /// The bytes the slice offered: the GPU's memory in whole MiB. A result that
    /// consumed all of it is the whole GPU.
    pub memory_offered: u64,
    /// The share's ID, when the device is shared (`allowMultipleAllocations`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The CDI device kubelet was given for this result.
    pub cdi_device: String,
}

impl PreparedDevice {
    /// Whether the result is the whole GPU: all of its compute and all the
    /// memory offered.
    pub fn is_whole(&self) -> bool {
        self.cores >= 100 && self.memory >= self.memory_offered
    }
}

impl PreparedClaims {
    /// An empty book.
    pub fn new() -> Self {
        Self {
            version: VERSION,
            claims: BTreeMap::new(),
        }
    }

    /// Reads the file's text, refusing another format version.
    pub fn parse(text: &str) -> Result<Self, String> {
        let claims: Self = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if claims.version != VERSION {
            return Err(format!(
                "format version {} (this build reads {VERSION})",
                claims.version
            ));
        }
        Ok(claims)
    }

    /// The file's text.
    pub fn to_json(&self) -> String {
        // A map of strings and numbers always serialises.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// What the prepared claims reserved for the pod with `pod_uid` give it;
    /// `None` when there are none.
    ///
    /// The allocation is the per-container form of the allocation annotation: one
    /// entry per GPU, booking for the pod the sum of its claims' results on it
    /// (each result counted once, however many containers use it), and for each
    /// container the sum of the results of the requests it uses (capped at one
    /// GPU). A share of a GPU (a result not the whole GPU) that two containers
    /// would use at the same time — two of the pod's, or containers of two pods
    /// the claim is reserved for — is refused: each container is held to what it
    /// is given, so each would get the whole share, and the share would be given
    /// twice. A whole GPU may be used by several.
    pub fn of_pod(&self, pod_uid: &str) -> Option<PodClaims> {
        let mine: Vec<(&PreparedClaim, &ClaimPod)> = self
            .claims
            .values()
            .filter_map(|c| Some((c, c.pods.iter().find(|p| p.uid == pod_uid)?)))
            .collect();
        if mine.is_empty() {
            return None;
        }
        let claims = mine
            .iter()
            .map(|(c, _)| format!("{}/{}", c.namespace, c.name))
            .collect();
        let cdi_devices = mine
            .iter()
            .flat_map(|(c, _)| c.devices.iter().map(|d| d.cdi_device.clone()))
            .collect();
        let allocation = shared_twice(&mine).map_or_else(|| Ok(allocation(&mine)), Err);
        Some(PodClaims {
            claims,
            cdi_devices,
            allocation,
        })
    }
}

/// Why one of `claims`' shares would be used by two containers at once, if so.
fn shared_twice(claims: &[(&PreparedClaim, &ClaimPod)]) -> Option<String> {
    for (claim, _) in claims {
        for device in claim.devices.iter().filter(|d| !d.is_whole()) {
            let users: Vec<String> = claim
                .pods
                .iter()
                .flat_map(|pod| {
                    pod.concurrent_users(&device.request)
                        .into_iter()
                        .map(move |c| format!("{}/{} container {c}", pod.namespace, pod.name))
                })
                .collect();
            if users.len() > 1 {
                return Some(format!(
                    "ResourceClaim {}/{}: request {} is a share of GPU {} (cores {}, memory {} bytes), and {} containers would use it at once ({}); a share is held per container, so each would get all of it: give each container a claim of its own (a ResourceClaimTemplate per pod, a request per container)",
                    claim.namespace,
                    claim.name,
                    device.request,
                    device.uuid,
                    device.cores,
                    device.memory,
                    users.len(),
                    users.join(", ")
                ));
            }
        }
    }
    None
}

/// The allocation `claims` amount to for their pod; see [`PreparedClaims::of_pod`].
fn allocation(claims: &[(&PreparedClaim, &ClaimPod)]) -> DeviceAllocations {
    let mut gpus: BTreeMap<String, GpuSum> = BTreeMap::new();
    for (claim, pod) in claims {
        for device in &claim.devices {
            let sum = gpus.entry(device.uuid.clone()).or_insert_with(|| GpuSum {
                minor: device.minor,
                offered: device.memory_offered,
                ..GpuSum::default()
            });
            sum.pod.add(device);
            for (container, requests) in &pod.containers {
                if uses(requests, &device.request) {
                    sum.containers
                        .entry(container.clone())
                        .or_default()
                        .add(device);
                }
            }
        }
    }
    let entries = gpus
        .into_iter()
        .map(|(uuid, sum)| DeviceAllocation {
            minor: sum.minor,
            id: uuid,
            resources: sum.pod.resources(sum.offered),
            containers: Some(
                sum.containers
                    .iter()
                    .map(|(name, share)| (name.clone(), share.resources(sum.offered)))
                    .collect(),
            ),
            extension: None,
        })
        .collect();
    DeviceAllocations {
        devices: BTreeMap::from([(DEVICE_TYPE_GPU.to_owned(), entries)]),
    }
}

/// Whether a container that uses `requests` of a claim (empty: all) uses `request`
/// (a subrequest `req/sub` is used through its request `req`).
fn uses(requests: &[String], request: &str) -> bool {
    let parent = request.split('/').next().unwrap_or(request);
    requests.is_empty() || requests.iter().any(|r| r == request || r == parent)
}

#[derive(Debug, Default)]
struct GpuSum {
    minor: u32,
    offered: u64,
    pod: Share,
    containers: BTreeMap<String, Share>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Share {
    cores: u64,
    memory: u64,
    whole: bool,
}

impl Share {
    fn add(&mut self, device: &PreparedDevice) {
        self.cores = self.cores.saturating_add(device.cores).min(100);
        self.memory = self.memory.saturating_add(device.memory);
        self.whole |= device.is_whole();
    }

    /// In the annotation's resource names. All the memory offered (the GPU's in
    /// whole MiB) is the whole GPU: ratio 100, so no limiter holds a whole grant.
    fn resources(self, offered: u64) -> BTreeMap<String, Quantity> {
        let whole_memory = self.whole || (offered > 0 && self.memory >= offered);
        let ratio = if whole_memory {
            100
        } else if offered == 0 {
            0
        } else {
            u64::try_from(u128::from(self.memory) * 100 / u128::from(offered))
                .unwrap_or(100)
                .min(99)
        };
        let cores = if self.whole { 100 } else { self.cores };
        let mut resources = BTreeMap::from([
            (GPU_CORE.to_owned(), Quantity::from_units(cores)),
            (GPU_MEMORY_RATIO.to_owned(), Quantity::from_units(ratio)),
        ]);
        if !whole_memory {
            resources.insert(GPU_MEMORY.to_owned(), Quantity::from_units(self.memory));
        }
        resources
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn device(request: &str, uuid: &str, minor: u32, cores: u64, memory: u64) -> PreparedDevice {
        PreparedDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: format!("gpu-{minor}"),
            uuid: uuid.into(),
            minor,
            cores,
            memory,
            memory_offered: 80 * GIB,
            share_id: Some("s".into()),
            cdi_device: format!("gpu.tessera.io/claim=x-{request}"),
        }
    }

    fn claim(uid: &str, pods: Vec<ClaimPod>, devices: Vec<PreparedDevice>) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
            pods,
            devices,
        }
    }

    fn pod(uid: &str, containers: &[(&str, &[&str])]) -> ClaimPod {
        ClaimPod {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("pod-{uid}"),
            containers: containers
                .iter()
                .map(|(name, requests)| {
                    (
                        (*name).to_owned(),
                        requests.iter().map(|r| (*r).to_owned()).collect(),
                    )
                })
                .collect(),
            run_before: Vec::new(),
        }
    }

    /// The allocation of the pod `uid`, which must have one.
    fn allocation_of(book: &PreparedClaims, uid: &str) -> DeviceAllocations {
        book.of_pod(uid)
            .expect("reserved")
            .allocation
            .expect("honoured")
    }

    fn book(claims: Vec<PreparedClaim>) -> PreparedClaims {
        let mut book = PreparedClaims::new();
        for claim in claims {
            book.claims.insert(claim.uid.clone(), claim);
        }
        book
    }

    #[test]
    fn a_quarter_claim_is_a_fractional_per_container_grant() {
        let book = book(vec![claim(
            "c1",
            vec![pod("p1", &[("app", &[])])],
            vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
        )]);
        let allocation = allocation_of(&book, "p1");
        let text = allocation.to_annotation();
        let parsed = DeviceAllocations::parse(&text).expect("a valid annotation");
        assert!(parsed.is_per_container());
        let granted = parsed.gpus_of_container("app");
        assert_eq!(granted.len(), 1);
        let gpu = &granted[0].1;
        assert_eq!((gpu.minor, gpu.id.as_str()), (0, "GPU-a"));
        assert_eq!(gpu.gpu_core(), Some(25));
        assert_eq!(gpu.gpu_memory(), Some(20 * GIB));
        assert_eq!(gpu.gpu_memory_ratio(), Some(25));
        assert!(gpu.is_fractional());
        assert!(parsed.gpus_of_container("sidecar").is_empty());
        assert_eq!(book.of_pod("other"), None);
        let claims = book.of_pod("p1").expect("reserved");
        assert_eq!(claims.claims, vec!["ns/claim-c1".to_owned()]);
        assert_eq!(
            claims.cdi_devices,
            vec!["gpu.tessera.io/claim=x-gpu".to_owned()]
        );
    }

    #[test]
    fn a_whole_claim_is_not_fractional_though_memory_is_offered_in_whole_mib() {
        let mut whole = device("gpu", "GPU-a", 0, 100, 80 * GIB - (1 << 20));
        whole.memory_offered = whole.memory;
        let book = book(vec![claim(
            "c1",
            vec![pod("p1", &[("app", &[])])],
            vec![whole],
        )]);
        let allocation = allocation_of(&book, "p1");
        let gpu = &allocation.gpus_of_container("app")[0].1;
        assert!(!gpu.is_fractional());
        assert_eq!(gpu.gpu_memory(), None);
        assert_eq!(gpu.gpu_core(), Some(100));
    }

    #[test]
    fn containers_get_the_requests_they_use_and_the_pod_books_each_result_once() {
        // An init container and the app container after it use the same share
        // (never at once); another app container a request of its own.
        let mut pod = pod(
            "p1",
            &[("init", &["one"]), ("a", &["one"]), ("c", &["two/sub"])],
        );
        pod.run_before = vec!["init".into()];
        let book = book(vec![claim(
            "c1",
            vec![pod],
            vec![
                device("one", "GPU-a", 0, 10, GIB),
                device("two/sub", "GPU-a", 0, 20, 2 * GIB),
                device("one", "GPU-b", 1, 30, 3 * GIB),
            ],
        )]);
        let allocation = allocation_of(&book, "p1");
        let a = allocation.gpus_of_container("a");
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].1.gpu_core(), Some(10));
        assert_eq!(a[1].1.gpu_core(), Some(30));
        assert_eq!(a[1].1.gpu_memory(), Some(3 * GIB));
        assert_eq!(allocation.gpus_of_container("init").len(), 2);
        let c = allocation.gpus_of_container("c");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].1.gpu_core(), Some(20));
        // The pod's booking of GPU-a: both results, once each.
        let gpu_a = &allocation.gpus()[0];
        assert_eq!(gpu_a.gpu_core(), Some(30));
        assert_eq!(gpu_a.gpu_memory(), Some(3 * GIB));
    }

    #[test]
    fn a_share_two_containers_would_use_at_once_is_refused_a_whole_gpu_is_not() {
        let two_containers = book(vec![claim(
            "c1",
            vec![pod("p1", &[("a", &[]), ("b", &["gpu"])])],
            vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
        )]);
        let refused = two_containers.of_pod("p1").expect("reserved");
        let why = refused.allocation.expect_err("refused");
        assert!(
            why.contains("ResourceClaim ns/claim-c1")
                && why.contains("2 containers would use it at once")
                && why.contains("ns/pod-p1 container a")
                && why.contains("ns/pod-p1 container b"),
            "{why}"
        );
        let two_pods = book(vec![claim(
            "c1",
            vec![pod("p1", &[("app", &[])]), pod("p2", &[("app", &[])])],
            vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
        )]);
        for uid in ["p1", "p2"] {
            let why = two_pods
                .of_pod(uid)
                .expect("reserved")
                .allocation
                .expect_err("refused");
            assert!(why.contains("ns/pod-p2 container app"), "{why}");
        }
        let mut whole = device("gpu", "GPU-a", 0, 100, 80 * GIB);
        whole.memory_offered = 80 * GIB;
        let shared_whole = book(vec![claim(
            "c1",
            vec![
                pod("p1", &[("a", &[]), ("b", &[])]),
                pod("p2", &[("app", &[])]),
            ],
            vec![whole],
        )]);
        for (uid, container) in [("p1", "a"), ("p1", "b"), ("p2", "app")] {
            let allocation = allocation_of(&shared_whole, uid);
            assert!(!allocation.gpus_of_container(container)[0].1.is_fractional());
        }
    }

    #[test]
    fn other_claims_on_the_same_gpu_stay_their_pods() {
        let book = book(vec![
            claim(
                "c1",
                vec![pod("p1", &[("app", &[])])],
                vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
            ),
            claim(
                "c2",
                vec![pod("p3", &[("app", &[])])],
                vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
            ),
        ]);
        for uid in ["p1", "p3"] {
            let allocation = allocation_of(&book, uid);
            assert_eq!(allocation.gpus()[0].gpu_core(), Some(25));
            assert_eq!(allocation.gpus()[0].gpu_memory(), Some(20 * GIB));
        }
    }

    #[test]
    fn the_file_round_trips_and_another_version_is_refused() {
        let book = book(vec![claim(
            "c1",
            vec![pod("p1", &[("app", &[])])],
            vec![device("gpu", "GPU-a", 0, 25, 20 * GIB)],
        )]);
        assert_eq!(PreparedClaims::parse(&book.to_json()), Ok(book.clone()));
        let other = book.to_json().replace("\"version\": 1", "\"version\": 2");
        let error = PreparedClaims::parse(&other).expect_err("refused");
        assert!(error.contains("format version 2"), "{error}");
        assert!(PreparedClaims::parse("{").is_err());
    }
}
