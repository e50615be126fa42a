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
//! is the tenant's own to give. Refused, naming what: Tessera's or Koordinator's
//! scheduling annotations, a `nodeName` (the pod would skip the scheduler; it is
//! turned into a node affinity instead), and KubeShare's scheduling tags
//! (`sched_affinity`, `sched_anti-affinity`, `sched_exclusion`), which Tessera
//! does not have.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// The SharePod's API group.
pub const GROUP: &str = "kubeshare.nthu";
/// Its version.
pub const VERSION: &str = "v1";
/// Its kind.
pub const KIND: &str = "SharePod";
/// Its resource.
pub const PLURAL: &str = "sharepods";
/// The label on a pod made from a SharePod: the SharePod's name.
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

/// Annotation prefixes only schedulers write: never copied from a SharePod.
const SCHEDULER_WRITTEN: [&str; 2] = ["scheduling.koordinator.sh/", "tessera.io/requested-as"];

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

/// The pod a SharePod (as JSON, as the API server serves it) makes: its
/// namespace, name, labels and spec, its share as `lsalab.nthu/*` annotations,
/// owned by the SharePod (deleted with it).
pub fn pod_for(sharepod: &serde_json::Value) -> Result<Pod, SharePodError> {
    let metadata: ObjectMeta =
        serde_json::from_value(sharepod["metadata"].clone()).unwrap_or_default();
    let name = metadata.name.clone().unwrap_or_default();
    let namespace = metadata.namespace.clone().unwrap_or_default();
    let refuse = |problem: String| SharePodError {
        namespace: namespace.clone(),
        name: name.clone(),
        problem,
    };
    if name.is_empty() || namespace.is_empty() {
        return Err(refuse("no name or namespace".into()));
    }
    let uid = metadata
        .uid
        .clone()
        .ok_or_else(|| refuse("no UID".into()))?;
    let mut spec: PodSpec = serde_json::from_value(sharepod["spec"].clone())
        .map_err(|e| refuse(format!("spec: not a pod spec: {e}")))?;
    let given = metadata.annotations.clone().unwrap_or_default();
    let mut annotations = BTreeMap::new();
    for (key, value) in &given {
        if let Some(tag) = TAGS.iter().find(|t| **t == key) {
            return Err(refuse(format!(
                "annotation {tag} {value:?}: KubeShare's scheduling tags are not Tessera's; use kubeshare/GPUID to share one GPU with chosen pods, and pod (anti-)affinity for the rest"
            )));
        }
        if SCHEDULER_WRITTEN.iter().any(|p| key.starts_with(p)) {
            return Err(refuse(format!(
                "annotation {key}: only the scheduler writes it, on the pod"
            )));
        }
        let key = SHARE_KEYS
            .iter()
            .find(|(from, _)| from == key)
            .map_or(key.as_str(), |(_, to)| to);
        annotations.insert(key.to_owned(), value.clone());
    }
    // KubeShare's scheduler filled spec.nodeName; a pod made with one would skip
    // kube-scheduler (and Tessera's) altogether: the node becomes a requirement.
    if let Some(node) = spec.node_name.take() {
        let term = NodeSelectorTerm {
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".into(),
                operator: "In".into(),
                values: Some(vec![node]),
            }]),
            ..NodeSelectorTerm::default()
        };
        let affinity = spec.affinity.get_or_insert_with(Affinity::default);
        let nodes = affinity
            .node_affinity
            .get_or_insert_with(NodeAffinity::default);
        match &mut nodes.required_during_scheduling_ignored_during_execution {
            // Terms are ORed: the node must be ANDed into each of them.
            Some(selector) => {
                for existing in &mut selector.node_selector_terms {
                    existing
                        .match_fields
                        .get_or_insert_with(Vec::new)
                        .extend(term.match_fields.clone().unwrap_or_default());
                }
            }
            none => {
                *none = Some(NodeSelector {
                    node_selector_terms: vec![term],
                });
            }
        }
    }
    let mut labels = metadata.labels.clone().unwrap_or_default();
    labels.insert(POD_LABEL.to_owned(), name.clone());
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![OwnerReference {
                api_version: format!("{GROUP}/{VERSION}"),
                kind: KIND.to_owned(),
                name,
                uid,
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
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
        let annotations = pod.metadata.annotations.clone().expect("annotations");
        assert_eq!(annotations["lsalab.nthu/gpu_request"], "0.5");
        assert_eq!(annotations["lsalab.nthu/gpu_limit"], "1.0");
        assert_eq!(annotations["lsalab.nthu/gpu_mem"], "1073741824");
        assert_eq!(annotations["note"], "kept");
        assert!(!annotations.contains_key("kubeshare/gpu_request"));
        let labels = pod.metadata.labels.clone().expect("labels");
        assert_eq!(labels[POD_LABEL], "sharepod1");
        assert_eq!(labels["app"], "x");
        let owner = &pod.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("SharePod", "u-1", Some(true))
        );
        assert_eq!(pod.spec.expect("spec").containers[0].name, "cuda");
    }

    #[test]
    fn a_node_name_becomes_a_requirement_and_forged_scheduling_is_refused() {
        let mut pinned = readme();
        pinned["spec"]["nodeName"] = "node01".into();
        pinned["metadata"]["annotations"]["kubeshare/GPUID"] = "abcde".into();
        let pod = pod_for(&pinned).expect("a pod");
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.node_name, None);
        let terms = spec
            .affinity
            .and_then(|a| a.node_affinity)
            .and_then(|n| n.required_during_scheduling_ignored_during_execution)
            .expect("a node requirement")
            .node_selector_terms;
        let fields = terms[0].match_fields.clone().expect("fields");
        assert_eq!(
            fields[0].values.as_deref(),
            Some(&["node01".to_owned()][..])
        );
        assert_eq!(
            pod.metadata.annotations.expect("annotations")["lsalab.nthu/GPUID"],
            "abcde"
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
        ] {
            let mut forged = readme();
            forged["metadata"]["annotations"][key] = value.into();
            let refused = pod_for(&forged).expect_err(key);
            assert!(
                refused.to_string().contains(want) && refused.to_string().contains(key),
                "{refused}"
            );
        }
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
