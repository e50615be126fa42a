//! Tessera's DRA claims on this node, as the pods' allocation: the kubelet
//! plugin (tessera-reporter `run --dra`) records each prepared claim, its GPUs,
//! consumed shares and the pods and containers that use it, in its checkpoint;
//! every pod the proxy learns of is given, from that file, the allocation
//! annotation its claims amount to ([`PreparedClaims::of_pod`]), so the GPU
//! hook, the one-book checks and every enforcement backend hold a claim's share
//! exactly as they hold the extender's grant.
//!
//! The annotations [`PROXY_ANNOTATIONS`] ([`CLAIMS_ANNOTATION`],
//! [`DEVICES_ANNOTATION`], [`REFUSED_ANNOTATION`]) are the proxy's alone: a pod's
//! own values are dropped. A pod with prepared claims that also carries the
//! scheduler's annotation is refused (two books), and so is one whose claims'
//! share two containers would use at once.

use std::path::PathBuf;

use tessera_api::dra::prepared::{
    CLAIMS_ANNOTATION, DEVICES_ANNOTATION, PROXY_ANNOTATIONS, PreparedClaims, REFUSED_ANNOTATION,
};
use tessera_api::resources::DEVICE_ALLOCATED;
use tessera_hook_protocol::lifecycle::PodInfo;

/// Where tessera-reporter's kubelet plugin keeps its checkpoint by default.
pub const DEFAULT_CLAIMS_FILE: &str = "/var/lib/kubelet/plugins/gpu.tessera.io/claims.json";

/// The plugin's checkpoint, read afresh for each pod event (a few KiB, read at
/// the pace of pods starting: no cache whose staleness could outlive an
/// unprepare).
#[derive(Debug)]
pub struct DraClaims {
    path: PathBuf,
}

impl DraClaims {
    /// Reads the checkpoint at `path` (a missing file: no claims).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The claims now. A file that cannot be read or parsed counts as no claims
    /// (logged): a container kubelet gives a claim's CDI device is then refused
    /// by the GPU hook, never given the GPU unheld.
    pub fn read(&self) -> PreparedClaims {
        let text = match std::fs::read_to_string(&self.path) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return PreparedClaims::new();
            }
            read => read.map_err(|error| error.to_string()),
        };
        text.and_then(|text| PreparedClaims::parse(&text))
            .unwrap_or_else(|error| {
                tracing::error!(
                    path = %self.path.display(),
                    %error,
                    "DRA claims unreadable: containers given Tessera claims are refused"
                );
                PreparedClaims::new()
            })
    }
}

/// Gives `pod` the allocation its prepared `claims` amount to; see the module docs.
pub fn annotate(claims: &PreparedClaims, pod: &mut PodInfo) {
    drop_marks(pod);
    if pod.uid.is_empty() {
        return;
    }
    let Some(mine) = claims.of_pod(&pod.uid) else {
        return;
    };
    let names = mine.claims.join(",");
    let refusal = match mine.allocation {
        _ if pod.annotations.contains_key(DEVICE_ALLOCATED) => Some(format!(
            "the pod has DRA claims of driver {} ({names}) and tessera-scheduler's {DEVICE_ALLOCATED} annotation: a GPU node is in one book only (docs/dra.md)",
            tessera_api::dra::DRIVER
        )),
        Err(why) => Some(why),
        Ok(allocation) => {
            pod.annotations
                .insert(DEVICE_ALLOCATED.to_owned(), allocation.to_annotation());
            None
        }
    };
    match refusal {
        Some(why) => {
            pod.annotations.insert(REFUSED_ANNOTATION.to_owned(), why);
        }
        None => {
            pod.annotations.insert(CLAIMS_ANNOTATION.to_owned(), names);
            pod.annotations
                .insert(DEVICES_ANNOTATION.to_owned(), mine.cdi_devices.join(","));
        }
    }
}

/// Drops the proxy's own annotations from what kubelet sent: only the proxy sets them.
pub fn drop_marks(pod: &mut PodInfo) {
    for key in PROXY_ANNOTATIONS {
        pod.annotations.remove(*key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::DeviceAllocations;
    use tessera_api::dra::prepared::{ClaimPod, PreparedClaim, PreparedDevice};

    fn checkpoint() -> PreparedClaims {
        let mut claims = PreparedClaims::new();
        claims.claims.insert(
            "c1".into(),
            PreparedClaim {
                namespace: "ns".into(),
                name: "quarter".into(),
                uid: "c1".into(),
                pods: vec![ClaimPod {
                    uid: "p1".into(),
                    namespace: "ns".into(),
                    name: "pod".into(),
                    containers: [("app".to_owned(), Vec::new())].into(),
                    run_before: Vec::new(),
                }],
                devices: vec![PreparedDevice {
                    request: "gpu".into(),
                    pool: "node".into(),
                    device: "gpu-0".into(),
                    uuid: "GPU-a".into(),
                    minor: 0,
                    cores: 25,
                    memory: 20 << 30,
                    memory_offered: 80 << 30,
                    share_id: None,
                    cdi_device: "gpu.tessera.io/claim=c1-0".into(),
                }],
            },
        );
        claims
    }

    fn pod(uid: &str, annotations: &[(&str, &str)]) -> PodInfo {
        PodInfo {
            uid: uid.into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..PodInfo::default()
        }
    }

    #[test]
    fn a_pod_with_claims_gets_their_allocation_and_forged_marks_are_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("claims.json");
        let claims = DraClaims::new(&path);
        let annotated = |pod: &mut PodInfo| annotate(&claims.read(), pod);
        // No file yet: nothing, and the pod's own marks go.
        let mut forged = pod(
            "p1",
            &[
                (CLAIMS_ANNOTATION, "ns/x"),
                (DEVICES_ANNOTATION, "gpu.tessera.io/claim=other-0"),
                (REFUSED_ANNOTATION, "x"),
            ],
        );
        annotated(&mut forged);
        assert!(forged.annotations.is_empty());

        std::fs::write(&path, checkpoint().to_json()).expect("write");
        let mut with = pod("p1", &[]);
        annotated(&mut with);
        assert_eq!(with.annotations[CLAIMS_ANNOTATION], "ns/quarter");
        assert_eq!(
            with.annotations[DEVICES_ANNOTATION],
            "gpu.tessera.io/claim=c1-0"
        );
        let allocation =
            DeviceAllocations::parse(&with.annotations[DEVICE_ALLOCATED]).expect("valid");
        assert_eq!(
            allocation.gpus_of_container("app")[0].1.gpu_core(),
            Some(25)
        );

        let mut other = pod("p2", &[]);
        annotated(&mut other);
        assert!(other.annotations.is_empty());

        let mut both = pod("p1", &[(DEVICE_ALLOCATED, "{}")]);
        annotated(&mut both);
        assert!(both.annotations[REFUSED_ANNOTATION].contains("ns/quarter"));
        assert_eq!(both.annotations[DEVICE_ALLOCATED], "{}");
        assert!(!both.annotations.contains_key(CLAIMS_ANNOTATION));

        // Unprepared: the file changes, the pod has nothing.
        std::fs::write(&path, PreparedClaims::new().to_json()).expect("write");
        let mut after = pod("p1", &[]);
        annotated(&mut after);
        assert!(after.annotations.is_empty());

        // Corrupt: nothing (the GPU hook refuses the claim's CDI device).
        std::fs::write(&path, "{not json").expect("write");
        let mut corrupt = pod("p1", &[]);
        annotated(&mut corrupt);
        assert!(corrupt.annotations.is_empty());
    }
}
