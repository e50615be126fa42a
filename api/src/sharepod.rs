//! KubeShare 1.x's `SharePod` (`kubeshare.nthu/v1`, its README's "SharePod
//! Specification"): a pod spec with the GPU share in annotations
//! (`kubeshare/gpu_request`, `gpu_limit`, `gpu_mem`, `GPUID`). KubeShare's device
//! manager made a Pod of the same namespace and name from each; tessera-scheduler
//! does the same ([`pod_for`], pure), with the share in the annotations Tessera's
//! admission policy already turns into resources (`lsalab.nthu/*`), so the pod is
//! placed, limited and grouped as any KubeShare pod.
//!
//! The pod is made by tessera-scheduler's identity, which alone may write the
//! allocation annotation: nothing of the SharePod's reaches the pod unless it
//! is the tenant's own to give. Refused, naming what: the annotations only a
//! scheduler writes, KubeShare's scheduling tags (`sched_affinity`,
//! `sched_anti-affinity`, `sched_exclusion`), which Tessera does not have, and a
//! share given twice, differently. A `nodeName` (the pod would skip the
//! scheduler) becomes a required node affinity.

use serde_json::{Map, Value, json};

/// The SharePod's API group.
pub const GROUP: &str = "kubeshare.nthu";
/// Its version.
pub const VERSION: &str = "v1";
/// Its kind.
pub const KIND: &str = "SharePod";
/// Its resource.
pub const PLURAL: &str = "sharepods";
/// The label on a pod made from a SharePod (`"true"`; the SharePod is its
/// controller owner reference: a name may be longer than a label value).
pub const POD_LABEL: &str = "tessera.io/sharepod";

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

/// Why a SharePod makes no pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SharePod {namespace}/{name}: {problem}")]
pub struct SharePodError {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// What is wrong, naming the field or annotation.
    pub problem: String,
}

/// The pod a SharePod (as JSON, as the API server serves it) makes, as JSON:
/// its namespace, name, labels and spec (as written: the API server checks it,
/// and fields newer than Tessera's pod types are kept), its share as
/// `lsalab.nthu/*` annotations, owned by the SharePod (deleted with it).
pub fn pod_for(sharepod: &Value) -> Result<Value, SharePodError> {
    let metadata = &sharepod["metadata"];
    let text = |key: &str| metadata[key].as_str().unwrap_or_default().to_owned();
    let (name, namespace, uid) = (text("name"), text("namespace"), text("uid"));
    let refuse = |problem: String| SharePodError {
        namespace: namespace.clone(),
        name: name.clone(),
        problem,
    };
    if name.is_empty() || namespace.is_empty() || uid.is_empty() {
        return Err(refuse("no name, namespace or UID".into()));
    }
    let mut spec = sharepod["spec"].clone();
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
        if TAGS.contains(&key.as_str()) {
            return Err(refuse(format!(
                "annotation {key} {shown:?}: KubeShare's scheduling tags are not Tessera's; use kubeshare/GPUID to share one GPU with chosen pods, and pod (anti-)affinity for the rest"
            )));
        }
        if SCHEDULER_WRITTEN.contains(&key.as_str()) {
            return Err(refuse(format!(
                "annotation {key}: only the scheduler writes it, on the pod"
            )));
        }
        let key = match SHARE_KEYS.iter().find(|(from, _)| from == key) {
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
    labels.insert(POD_LABEL.to_owned(), "true".into());
    let mut pod_metadata = json!({
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [{
            "apiVersion": format!("{GROUP}/{VERSION}"), "kind": KIND,
            "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true,
        }],
    });
    if !annotations.is_empty() {
        pod_metadata["annotations"] = Value::Object(annotations);
    }
    Ok(json!({"apiVersion": "v1", "kind": "Pod", "metadata": pod_metadata, "spec": spec}))
}

/// The name of the SharePod that controls `pod` (JSON metadata's owner references).
pub fn owner_name(
    owners: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference],
) -> Option<&str> {
    owners
        .iter()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == KIND
                && o.api_version == format!("{GROUP}/{VERSION}")
        })
        .map(|o| o.name.as_str())
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
        let pod = pod_for(&readme()).expect("a pod");
        let annotations = &pod["metadata"]["annotations"];
        assert_eq!(annotations["lsalab.nthu/gpu_request"], "0.5");
        assert_eq!(annotations["lsalab.nthu/gpu_limit"], "1.0");
        assert_eq!(annotations["lsalab.nthu/gpu_mem"], "1073741824");
        assert_eq!(annotations["note"], "kept");
        assert!(annotations.get("kubeshare/gpu_request").is_none());
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels[POD_LABEL], "true");
        assert_eq!(labels["app"], "x");
        let typed: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(pod.clone()).expect("a pod");
        let owners = typed.metadata.owner_references.clone().expect("owner");
        assert_eq!(owner_name(&owners), Some("sharepod1"));
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
        let pod = pod_for(&newer).expect("a pod");
        assert_eq!(pod["spec"]["containers"][0]["someFieldOfTomorrow"], "x");
    }

    #[test]
    fn a_node_name_becomes_a_requirement_and_forged_scheduling_is_refused() {
        let mut pinned = readme();
        pinned["spec"]["nodeName"] = "node01".into();
        pinned["metadata"]["annotations"]["kubeshare/GPUID"] = "abcde".into();
        let pod = pod_for(&pinned).expect("a pod");
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
        let pod = pod_for(&both).expect("a pod");
        let terms = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(terms[1]["matchFields"][0]["values"][0], "node01");
        assert_eq!(terms[0]["matchExpressions"][0]["key"], "a");
        let mut empty = readme();
        empty["spec"]["nodeName"] = "".into();
        assert!(
            pod_for(&empty).expect("a pod")["spec"]
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
            let refused = pod_for(&forged).expect_err(key);
            assert!(
                refused.to_string().contains(want) && refused.to_string().contains(key),
                "{refused}"
            );
        }
        // Koordinator's hint is the tenant's to give.
        let mut hinted = readme();
        hinted["metadata"]["annotations"]["scheduling.koordinator.sh/device-allocate-hint"] =
            "{}".into();
        assert!(pod_for(&hinted).is_ok());
        let mut bad = readme();
        bad["spec"] = serde_json::json!({"containers": "nope"});
        assert!(
            pod_for(&bad)
                .expect_err("no spec")
                .problem
                .starts_with("spec:")
        );
    }
}
