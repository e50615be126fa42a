//! KubeShare's pod-making kinds ([`ShareKind`]): 1.x's `SharePod`
//! (`kubeshare.nthu/v1`, its README's "SharePod Specification"), a pod spec with
//! the GPU share in annotations (`kubeshare/gpu_request`, `gpu_limit`, `gpu_mem`,
//! `GPUID`), and its predecessor K8sGPUSharing's `MtgpuPod` (`lsalab.nthu/v1`,
//! "Multi-tenant GPU Pod"), the same with the share already in `lsalab.nthu/*`
//! annotations. Their controllers made a Pod of the same namespace and name from
//! each; tessera-scheduler does the same ([`ShareKind::pod_for`], pure), with the
//! share in the annotations Tessera's admission policy already turns into
//! resources (`lsalab.nthu/*`), so the pod is placed, limited and grouped as any
//! KubeShare pod.
//!
//! The pod is made by tessera-scheduler's identity, which alone may write the
//! allocation annotation: nothing of the SharePod's reaches the pod unless it
//! is the tenant's own to give. Refused, naming what: the annotations only a
//! scheduler writes, KubeShare's scheduling tags (`sched_affinity`,
//! `sched_anti-affinity`, `sched_exclusion`), which Tessera does not have, and a
//! share given twice, differently. A `nodeName` (the pod would skip the
//! scheduler) becomes a required node affinity.

use serde_json::{Map, Value, json};

/// One kind of object that makes a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareKind {
    /// Its API group.
    pub group: &'static str,
    /// Its version.
    pub version: &'static str,
    /// Its kind.
    pub kind: &'static str,
    /// Its resource.
    pub plural: &'static str,
    /// The label on a pod made from one (`"true"`; the object is its controller
    /// owner reference: a name may be longer than a label value).
    pub pod_label: &'static str,
    /// Its own share annotations and the pod annotations they become.
    share_keys: &'static [(&'static str, &'static str)],
    /// Its scheduling tags, which Tessera does not have.
    tags: &'static [&'static str],
    /// Another kind's share annotations, which this kind does not read: refused,
    /// naming the one to write.
    foreign_keys: &'static [(&'static str, &'static str)],
}

/// KubeShare 1.x's SharePod.
pub const SHARE_POD: ShareKind = ShareKind {
    group: "kubeshare.nthu",
    version: "v1",
    kind: "SharePod",
    plural: "sharepods",
    pod_label: "tessera.io/sharepod",
    share_keys: &SHARE_KEYS,
    tags: &TAGS,
    foreign_keys: &[],
};

/// K8sGPUSharing's MtgpuPod (ncy9371/K8sGPUSharing, KubeShare's predecessor).
pub const MTGPU_POD: ShareKind = ShareKind {
    group: "lsalab.nthu",
    version: "v1",
    kind: "MtgpuPod",
    plural: "mtgpupods",
    pod_label: "tessera.io/mtgpupod",
    share_keys: &[],
    tags: &[],
    // SharePod's names: on an MtgpuPod nothing would read them.
    foreign_keys: &SHARE_KEYS,
};

/// Every kind served.
pub const KINDS: [ShareKind; 2] = [SHARE_POD, MTGPU_POD];

/// KubeShare 1.x's SharePod annotations and the pod annotations they become.
const SHARE_KEYS: [(&str, &str); 4] = [
    ("kubeshare/gpu_request", "lsalab.nthu/gpu_request"),
    ("kubeshare/gpu_limit", "lsalab.nthu/gpu_limit"),
    ("kubeshare/gpu_mem", "lsalab.nthu/gpu_mem"),
    ("kubeshare/GPUID", "lsalab.nthu/GPUID"),
];

/// KubeShare's scheduling tags, which Tessera does not have.
const TAGS: [&str; 3] = [
    "kubeshare/sched_affinity",
    "kubeshare/sched_anti-affinity",
    "kubeshare/sched_exclusion",
];

/// Annotations only schedulers write: never copied from a SharePod.
const SCHEDULER_WRITTEN: [&str; 2] = [
    crate::resources::DEVICE_ALLOCATED,
    crate::asked::REQUESTED_AS,
];

/// Why a SharePod (or MtgpuPod) makes no pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {namespace}/{name}: {problem}")]
pub struct SharePodError {
    /// Its kind.
    pub kind: &'static str,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// What is wrong, naming the field or annotation.
    pub problem: String,
}

impl ShareKind {
    /// `group/version`.
    pub fn api_version(&self) -> String {
        format!("{}/{}", self.group, self.version)
    }

    /// The pod an object of this kind (as JSON, as the API server serves it)
    /// makes, as JSON: its namespace, name, labels and spec (as written: the API
    /// server checks it, and fields newer than Tessera's pod types are kept), its
    /// share as `lsalab.nthu/*` annotations, owned by the object (deleted with it).
    pub fn pod_for(&self, object: &Value) -> Result<Value, SharePodError> {
        pod_for(self, object)
    }

    /// The name of the object of this kind that controls a pod (its owner
    /// references).
    pub fn owner_name<'a>(
        &self,
        owners: &'a [k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference],
    ) -> Option<&'a str> {
        let api_version = self.api_version();
        owners
            .iter()
            .find(|o| {
                o.controller == Some(true) && o.kind == self.kind && o.api_version == api_version
            })
            .map(|o| o.name.as_str())
    }

    /// The status an object of this kind shows: its pod's (`Ok`), or why it has
    /// none (`Err`). Both kinds' Go types (KubeShare's `SharePodStatus`,
    /// K8sGPUSharing's `MtgpuPodStatus`) have no JSON tags, so their fields are
    /// `PodStatus`, `PodObjectMeta` and `BoundDeviceID` (the GPU's UUID; Tessera
    /// runs no pod manager, so no `PodManagerPort`); `phase` and, on a refusal,
    /// `message` are added for `kubectl get`.
    pub fn status_of(&self, pod: Result<&k8s_openapi::api::core::v1::Pod, &str>) -> Value {
        match pod {
            Ok(pod) => {
                let mut status = pod.status.clone().unwrap_or_default();
                let phase = status.phase.get_or_insert_with(|| "Pending".into()).clone();
                let gpus: Vec<String> = pod
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(crate::resources::DEVICE_ALLOCATED))
                    .and_then(|text| crate::DeviceAllocations::parse(text).ok())
                    .map(|a| a.gpus().iter().map(|g| g.id.clone()).collect())
                    .unwrap_or_default();
                json!({
                    "phase": phase,
                    "PodStatus": status,
                    "PodObjectMeta": {
                        "name": pod.metadata.name,
                        "namespace": pod.metadata.namespace,
                        "uid": pod.metadata.uid,
                    },
                    "BoundDeviceID": gpus.join(","),
                })
            }
            Err(message) => json!({
                "phase": "Failed",
                "message": message,
                "PodStatus": {"phase": "Failed", "reason": "NoPod", "message": message},
                "BoundDeviceID": "",
            }),
        }
    }

    /// Whether `pod` is the one this kind's object `name` (UID `uid`) made: its
    /// controller reference names that object, kind and UID together.
    pub fn made(&self, pod: &k8s_openapi::api::core::v1::Pod, name: &str, uid: &str) -> bool {
        let api_version = self.api_version();
        pod.metadata.owner_references.iter().flatten().any(|o| {
            o.controller == Some(true)
                && o.kind == self.kind
                && o.api_version == api_version
                && o.name == name
                && o.uid == uid
        })
    }
}

fn pod_for(kind: &ShareKind, object: &Value) -> Result<Value, SharePodError> {
    let metadata = &object["metadata"];
    let text = |key: &str| metadata[key].as_str().unwrap_or_default().to_owned();
    let (name, namespace, uid) = (text("name"), text("namespace"), text("uid"));
    let refuse = |problem: String| SharePodError {
        kind: kind.kind,
        namespace: namespace.clone(),
        name: name.clone(),
        problem,
    };
    if name.is_empty() || namespace.is_empty() || uid.is_empty() {
        return Err(refuse("no name, namespace or UID".into()));
    }
    let mut spec = object["spec"].clone();
    // Checked early, so that the SharePod says what is wrong in Tessera's words.
    serde_json::from_value::<k8s_openapi::api::core::v1::PodSpec>(spec.clone())
        .map_err(|e| refuse(format!("spec: not a pod spec: {e}")))?;
    let given: Map<String, Value> = metadata["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let mut annotations = Map::new();
    for (key, value) in &given {
        let shown = value.as_str().unwrap_or_default();
        if let Some((_, meant)) = kind.foreign_keys.iter().find(|(from, _)| from == key) {
            return Err(refuse(format!(
                "annotation {key} {shown:?}: a SharePod's name, which a {} does not read: write {meant}",
                kind.kind
            )));
        }
        if kind.tags.contains(&key.as_str()) {
            return Err(refuse(format!(
                "annotation {key} {shown:?}: KubeShare's scheduling tags are not Tessera's; use kubeshare/GPUID to share one GPU with chosen pods, and pod (anti-)affinity for the rest"
            )));
        }
        if SCHEDULER_WRITTEN.contains(&key.as_str()) {
            return Err(refuse(format!(
                "annotation {key}: only the scheduler writes it, on the pod"
            )));
        }
        let key = match kind.share_keys.iter().find(|(from, _)| from == key) {
            Some((from, to)) => {
                if given.get(*to).is_some_and(|v| v != value) {
                    return Err(refuse(format!(
                        "annotations {from} {shown:?} and {to} {:?} disagree: give one",
                        given[*to].as_str().unwrap_or_default()
                    )));
                }
                *to
            }
            None => key.as_str(),
        };
        annotations.insert(key.to_owned(), value.clone());
    }
    // KubeShare's scheduler filled spec.nodeName; a pod made with one would skip
    // kube-scheduler (and Tessera's) altogether: the node becomes a requirement.
    let node = spec
        .as_object_mut()
        .and_then(|s| s.remove("nodeName"))
        .and_then(|n| n.as_str().map(str::to_owned))
        .filter(|n| !n.is_empty());
    if let Some(node) = node {
        let field = json!({"key": "metadata.name", "operator": "In", "values": [node]});
        let required = &mut spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        match required.as_array_mut() {
            // Terms are ORed: the node is ANDed into each of them.
            Some(terms) if !terms.is_empty() => {
                for term in terms {
                    match term["matchFields"].as_array_mut() {
                        Some(fields) => fields.push(field.clone()),
                        None => term["matchFields"] = json!([field.clone()]),
                    }
                }
            }
            _ => *required = json!([{"matchFields": [field]}]),
        }
    }
    let mut labels: Map<String, Value> =
        metadata["labels"].as_object().cloned().unwrap_or_default();
    labels.insert(kind.pod_label.to_owned(), "true".into());
    let mut pod_metadata = json!({
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [{
            "apiVersion": kind.api_version(), "kind": kind.kind,
            "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true,
        }],
    });
    if !annotations.is_empty() {
        pod_metadata["annotations"] = Value::Object(annotations);
    }
    Ok(json!({"apiVersion": "v1", "kind": "Pod", "metadata": pod_metadata, "spec": spec}))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Its README's SharePod, with a UID and namespace as the API server adds them.
    fn readme() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "kubeshare.nthu/v1", "kind": "SharePod",
            "metadata": {"name": "sharepod1", "namespace": "default", "uid": "u-1",
                "labels": {"app": "x"},
                "annotations": {"kubeshare/gpu_request": "0.5", "kubeshare/gpu_limit": "1.0",
                    "kubeshare/gpu_mem": "1073741824", "note": "kept"}},
            "spec": {"containers": [{"name": "cuda", "image": "nvidia/cuda:9.0-base",
                "command": ["nvidia-smi", "-L"],
                "resources": {"limits": {"cpu": "1", "memory": "500Mi"}}}]}
        })
    }

    #[test]
    fn a_sharepod_makes_its_pod_with_the_share_as_kubeshare_annotations() {
        let pod = SHARE_POD.pod_for(&readme()).expect("a pod");
        let annotations = &pod["metadata"]["annotations"];
        assert_eq!(annotations["lsalab.nthu/gpu_request"], "0.5");
        assert_eq!(annotations["lsalab.nthu/gpu_limit"], "1.0");
        assert_eq!(annotations["lsalab.nthu/gpu_mem"], "1073741824");
        assert_eq!(annotations["note"], "kept");
        assert!(annotations.get("kubeshare/gpu_request").is_none());
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels[SHARE_POD.pod_label], "true");
        assert_eq!(labels["app"], "x");
        let typed: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(pod.clone()).expect("a pod");
        let owners = typed.metadata.owner_references.clone().expect("owner");
        assert_eq!(SHARE_POD.owner_name(&owners), Some("sharepod1"));
        assert_eq!(
            (owners[0].uid.as_str(), owners[0].controller),
            ("u-1", Some(true))
        );
        assert_eq!(pod["spec"]["containers"][0]["name"], "cuda");
    }

    #[test]
    fn fields_newer_than_tesseras_types_are_kept() {
        let mut newer = readme();
        newer["spec"]["containers"][0]["someFieldOfTomorrow"] = "x".into();
        let pod = SHARE_POD.pod_for(&newer).expect("a pod");
        assert_eq!(pod["spec"]["containers"][0]["someFieldOfTomorrow"], "x");
    }

    #[test]
    fn a_node_name_becomes_a_requirement_and_forged_scheduling_is_refused() {
        let mut pinned = readme();
        pinned["spec"]["nodeName"] = "node01".into();
        pinned["metadata"]["annotations"]["kubeshare/GPUID"] = "abcde".into();
        let pod = SHARE_POD.pod_for(&pinned).expect("a pod");
        assert!(pod["spec"].get("nodeName").is_none());
        let terms = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(
            terms[0]["matchFields"][0],
            serde_json::json!({"key": "metadata.name", "operator": "In", "values": ["node01"]})
        );
        assert_eq!(pod["metadata"]["annotations"]["lsalab.nthu/GPUID"], "abcde");
        // Existing terms each get the node; an empty nodeName is none.
        let mut both = pinned.clone();
        both["spec"]["affinity"] = serde_json::json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "b", "operator": "Exists"}]}]}}});
        let pod = SHARE_POD.pod_for(&both).expect("a pod");
        let terms = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(terms[1]["matchFields"][0]["values"][0], "node01");
        assert_eq!(terms[0]["matchExpressions"][0]["key"], "a");
        let mut empty = readme();
        empty["spec"]["nodeName"] = "".into();
        assert!(
            SHARE_POD.pod_for(&empty).expect("a pod")["spec"]
                .get("affinity")
                .is_none()
        );

        for (key, value, want) in [
            (
                "scheduling.koordinator.sh/device-allocated",
                r#"{"gpu":[{"minor":0}]}"#,
                "only the scheduler writes it",
            ),
            (
                "tessera.io/requested-as",
                "{}",
                "only the scheduler writes it",
            ),
            (
                "kubeshare/sched_affinity",
                "red",
                "KubeShare's scheduling tags are not Tessera's",
            ),
            ("lsalab.nthu/gpu_request", "0.9", "disagree"),
        ] {
            let mut forged = readme();
            forged["metadata"]["annotations"][key] = value.into();
            let refused = SHARE_POD.pod_for(&forged).expect_err(key);
            assert!(
                refused.to_string().contains(want) && refused.to_string().contains(key),
                "{refused}"
            );
        }
        // Koordinator's hint is the tenant's to give.
        let mut hinted = readme();
        hinted["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocate-hint"] =
            "{}".into();
        assert!(SHARE_POD.pod_for(&hinted).is_ok());
        let mut bad = readme();
        bad["spec"] = serde_json::json!({"containers": "nope"});
        assert!(
            SHARE_POD
                .pod_for(&bad)
                .expect_err("no spec")
                .problem
                .starts_with("spec:")
        );
    }

    /// K8sGPUSharing's README's MtgpuPod, with a UID and namespace as the API
    /// server adds them.
    fn mtgpupod_readme() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "lsalab.nthu/v1", "kind": "MtgpuPod",
            "metadata": {"name": "pod1", "namespace": "default", "uid": "u-2",
                "annotations": {"lsalab.nthu/gpu_request": "0.5", "lsalab.nthu/gpu_limit": "1.0",
                    "lsalab.nthu/gpu_mem": "1073741824", "lsalab.nthu/GPUID": "abc"}},
            "spec": {"nodeName": "node1", "containers": [{"name": "sleep",
                "image": "nvidia/cuda:9.0-base", "command": ["sh", "-c"], "args": ["nvidia-smi -L"],
                "resources": {"requests": {"cpu": "1", "memory": "500Mi"},
                    "limits": {"cpu": "1", "memory": "500Mi"}}}]}
        })
    }

    #[test]
    fn an_mtgpupod_makes_its_pod_with_its_annotations_and_node_as_a_requirement() {
        let pod = MTGPU_POD.pod_for(&mtgpupod_readme()).expect("a pod");
        let annotations = &pod["metadata"]["annotations"];
        assert_eq!(annotations["lsalab.nthu/gpu_request"], "0.5");
        assert_eq!(annotations["lsalab.nthu/GPUID"], "abc");
        assert_eq!(pod["metadata"]["labels"][MTGPU_POD.pod_label], "true");
        assert!(pod["metadata"]["labels"].get(SHARE_POD.pod_label).is_none());
        assert!(pod["spec"].get("nodeName").is_none());
        assert_eq!(
            pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
            "node1"
        );
        let typed: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).expect("a pod");
        let owners = typed.metadata.owner_references.clone().expect("owner");
        assert_eq!(MTGPU_POD.owner_name(&owners), Some("pod1"));
        // Each kind claims only its own pods.
        assert_eq!(SHARE_POD.owner_name(&owners), None);
        let refused = MTGPU_POD
            .pod_for(&serde_json::json!({"metadata": {"name": "x"}}))
            .expect_err("no namespace");
        assert!(
            refused.to_string().starts_with("MtgpuPod /x: "),
            "{refused}"
        );
    }

    #[test]
    fn the_status_is_the_go_types_shape_with_the_phase() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pod1", "namespace": "default", "uid": "p-1", "annotations": {
                crate::resources::DEVICE_ALLOCATED:
                    r#"{"gpu":[{"minor":2,"id":"GPU-2","resources":{"koordinator.sh/gpu-core":50}}]}"#}},
            "status": {"phase": "Running", "podIP": "10.0.0.1"}
        }))
        .expect("pod");
        for kind in KINDS {
            let status = kind.status_of(Ok(&pod));
            assert_eq!(status["phase"], "Running");
            assert_eq!(status["PodStatus"]["phase"], "Running");
            assert_eq!(status["PodStatus"]["podIP"], "10.0.0.1");
            assert_eq!(status["PodObjectMeta"]["name"], "pod1");
            assert_eq!(status["BoundDeviceID"], "GPU-2");
            let failed = kind.status_of(Err("no"));
            assert_eq!(
                (failed["phase"].as_str(), failed["message"].as_str()),
                (Some("Failed"), Some("no"))
            );
            assert_eq!(failed["PodStatus"]["message"], "no");
        }
    }

    #[test]
    fn a_pod_is_an_objects_only_by_its_controller_reference() {
        let pod = MTGPU_POD.pod_for(&mtgpupod_readme()).expect("a pod");
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod).expect("a pod");
        assert!(MTGPU_POD.made(&pod, "pod1", "u-2"));
        // Another object's name or UID, or the other kind: not this one's.
        assert!(!MTGPU_POD.made(&pod, "pod1", "u-other"));
        assert!(!MTGPU_POD.made(&pod, "pod2", "u-2"));
        assert!(!SHARE_POD.made(&pod, "pod1", "u-2"));
    }

    #[test]
    fn a_sharepods_names_on_an_mtgpupod_are_refused_naming_its_own() {
        let mut mixed = mtgpupod_readme();
        mixed["metadata"]["annotations"]["kubeshare/gpu_mem"] = "1073741824".into();
        let refused = MTGPU_POD.pod_for(&mixed).expect_err("a SharePod's name");
        assert!(
            refused
                .to_string()
                .contains("annotation kubeshare/gpu_mem \"1073741824\": a SharePod's name, which a MtgpuPod does not read: write lsalab.nthu/gpu_mem"),
            "{refused}"
        );
    }
}
