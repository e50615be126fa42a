//! `simulate`: the same allocation core over a snapshot of Nodes, Device CRs and
//! Pods, placing pending pods one after the other as the extender would.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::Value;
use tessera_api::request::{RequestOptions, pod_gpu_request};
use tessera_api::{Device, DeviceInfo, DeviceSpec, DeviceTopology};

use crate::core::{
    PodPlacement, Policy, allocate_pod, group_elsewhere, group_home, node_policy_of, score,
    selected_nowhere,
};
use crate::ledger::{Ledger, annotation_of, pod_name};

/// Why a snapshot cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Neither JSON nor YAML.
    #[error("{what}: not JSON or YAML")]
    Syntax {
        what: String,
        #[source]
        source: serde_yaml::Error,
    },
    /// An object of a known kind that does not decode.
    #[error("{what}: item {index} ({kind}): {source}")]
    Object {
        what: String,
        index: usize,
        kind: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Objects of a snapshot.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Device CRs.
    pub devices: Vec<Device>,
    /// Pods.
    pub pods: Vec<Pod>,
    /// How many Node objects were seen.
    pub nodes: usize,
}

/// Reads `kubectl get -o yaml|json` output: a List, a single object, or several YAML documents.
pub fn parse_snapshot(text: &str, what: &str) -> Result<Snapshot, SnapshotError> {
    let mut items = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(document).map_err(|source| SnapshotError::Syntax {
            what: what.into(),
            source,
        })?;
        match value.get("items").and_then(Value::as_array) {
            Some(list) => items.extend(list.iter().cloned()),
            None if !value.is_null() => items.push(value),
            None => {}
        }
    }
    let mut snapshot = Snapshot::default();
    for (index, item) in items.into_iter().enumerate() {
        let kind = item
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let object = |source| SnapshotError::Object {
            what: what.into(),
            index,
            kind: kind.clone(),
            source,
        };
        match kind.as_str() {
            "Device" => snapshot
                .devices
                .push(serde_json::from_value(item).map_err(object)?),
            "Pod" => snapshot
                .pods
                .push(serde_json::from_value(item).map_err(object)?),
            "Node" => snapshot.nodes += 1,
            _ => {}
        }
    }
    Ok(snapshot)
}

/// The outcome for one pending pod.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    /// `namespace/name`.
    pub pod: String,
    /// The chosen node, if any.
    pub node: Option<String>,
    /// The allocation annotation written on the pod.
    pub annotation: Option<String>,
    /// Why it fits nowhere (or why it was not placed).
    pub reason: Option<String>,
}

/// Settings of a simulation.
#[derive(Debug, Clone, Copy, Default)]
pub struct SimulateOptions {
    /// Which GPU.
    pub gpu_policy: Policy,
    /// Which node.
    pub node_policy: Policy,
    /// Request parsing.
    pub request: RequestOptions,
    /// Nodes evaluated per pod, as kube-scheduler's percentageOfNodesToScore
    /// (0: kube-scheduler's adaptive default).
    pub nodes_to_score: usize,
}

/// kube-scheduler's adaptive number of nodes to score (percentageOfNodesToScore unset).
pub fn adaptive_nodes_to_score(total: usize) -> usize {
    if total < 100 {
        return total;
    }
    let percent = (50usize.saturating_sub(total / 125)).max(5);
    (total * percent / 100).max(100)
}

/// A ledger holding the snapshot's devices and running pods.
pub fn ledger_of(snapshot: &Snapshot) -> Ledger {
    let mut ledger = Ledger::default();
    for device in &snapshot.devices {
        ledger.apply_device(device);
    }
    for pod in &snapshot.pods {
        ledger.apply_pod(pod);
    }
    ledger
}

/// Places `pending` one after the other; each placement counts for the next.
pub fn simulate(ledger: &mut Ledger, pending: &[Pod], options: &SimulateOptions) -> Vec<Outcome> {
    let mut names: Vec<String> = ledger.nodes().map(|n| n.name.clone()).collect();
    names.sort();
    let window = if options.nodes_to_score == 0 {
        adaptive_nodes_to_score(names.len())
    } else {
        options.nodes_to_score.min(names.len())
    };
    let mut start = 0usize;
    let mut outcomes = Vec::with_capacity(pending.len());
    for (index, pod) in pending.iter().enumerate() {
        let who = pod_name(pod);
        let request = match pod_gpu_request(pod, &options.request) {
            Ok(Some(request)) => request,
            Ok(None) => {
                outcomes.push(Outcome {
                    pod: who,
                    node: None,
                    annotation: None,
                    reason: Some("asks for no GPU".into()),
                });
                continue;
            }
            Err(error) => {
                outcomes.push(Outcome {
                    pod: who,
                    node: None,
                    annotation: None,
                    reason: Some(error.to_string()),
                });
                continue;
            }
        };
        if let Some(why) = selected_nowhere(ledger.nodes(), &request.selection) {
            outcomes.push(Outcome {
                pod: who,
                node: None,
                annotation: None,
                reason: Some(why),
            });
            continue;
        }
        let node_policy = node_policy_of(&request, options.node_policy);
        let home = group_home(ledger.nodes(), &request);
        // Like kube-scheduler: look at nodes round-robin from where the last pod
        // stopped, until `window` feasible nodes are found, then score those.
        let mut best: Option<(i64, &str, PodPlacement)> = None;
        let mut feasible = 0;
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let mut looked = 0;
        while looked < names.len() && feasible < window {
            let name = &names[(start + looked) % names.len()];
            looked += 1;
            let Some(node) = ledger.node(name) else {
                continue;
            };
            if let Some(why) = group_elsewhere(home.as_ref(), &request, name) {
                *reasons.entry(why).or_default() += 1;
                continue;
            }
            match allocate_pod(node, &request, options.gpu_policy) {
                Ok(placement) => {
                    feasible += 1;
                    let value = score(node, &placement.booked, node_policy);
                    if best
                        .as_ref()
                        .is_none_or(|(b, n, _)| value > *b || (value == *b && name.as_str() < *n))
                    {
                        best = Some((value, name, placement));
                    }
                }
                Err(reason) => *reasons.entry(reason).or_default() += 1,
            }
        }
        start = (start + looked) % names.len().max(1);
        match best {
            Some((_, node, placement)) => {
                let uid = pod
                    .metadata
                    .uid
                    .clone()
                    .unwrap_or_else(|| format!("simulated-{index}"));
                let annotation = annotation_of(&placement);
                let node = node.to_owned();
                ledger.reserve(&uid, &node, placement.booked, u64::MAX);
                outcomes.push(Outcome {
                    pod: who,
                    node: Some(node),
                    annotation: Some(annotation),
                    reason: None,
                });
            }
            None => {
                let mut reason = format!("fits none of {} nodes", names.len());
                for (text, count) in reasons.iter().take(3) {
                    let _ = write!(reason, "; {count} node(s): {text}");
                }
                outcomes.push(Outcome {
                    pod: who,
                    node: None,
                    annotation: None,
                    reason: Some(reason),
                });
            }
        }
    }
    outcomes
}

/// A synthetic cluster: `nodes` nodes of `gpus` 80 GiB GPUs (PCIe switch pairs, two
/// NUMA nodes) and `running` quarter-GPU pods, two to a GPU, filling nodes in order
/// (40,000 pods on 5,000 × 8 GPUs: half the nodes half-used, half empty).
pub fn synthetic_cluster(nodes: usize, gpus: u32, running: usize) -> Snapshot {
    let mut snapshot = Snapshot {
        nodes,
        ..Snapshot::default()
    };
    for n in 0..nodes {
        let devices = (0..gpus)
            .map(|g| DeviceInfo {
                device_type: "gpu".into(),
                labels: BTreeMap::new(),
                id: format!("GPU-{n:05}-{g:02}"),
                minor: i32::try_from(g).ok(),
                health: true,
                resources: BTreeMap::from([
                    (
                        "koordinator.sh/gpu-core".to_owned(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity("100".into()),
                    ),
                    (
                        "koordinator.sh/gpu-memory".to_owned(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                            (80u64 << 30).to_string(),
                        ),
                    ),
                    (
                        "koordinator.sh/gpu-memory-ratio".to_owned(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity("100".into()),
                    ),
                ]),
                topology: Some(DeviceTopology {
                    socket_id: i32::try_from(g * 2 / gpus.max(1)).unwrap_or(0),
                    node_id: i32::try_from(g * 2 / gpus.max(1)).unwrap_or(0),
                    pcie_id: format!("sw{}", g / 2),
                    bus_id: format!("0000:{:02x}:00.0", 0x18 + g),
                }),
            })
            .collect();
        snapshot
            .devices
            .push(Device::new(&format!("node-{n:05}"), DeviceSpec { devices }));
    }
    for p in 0..running {
        let slot = p / 2;
        let node = (slot / gpus.max(1) as usize) % nodes.max(1);
        let gpu = (slot % gpus.max(1) as usize) as u32;
        let annotation = format!(
            r#"{{"gpu":[{{"minor":{gpu},"id":"GPU-{node:05}-{gpu:02}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}}]}}"#
        );
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("running-{p}"), "namespace": "default", "uid": format!("uid-running-{p}"),
                "annotations": {"scheduling.koordinator.sh/device-allocated": annotation}},
            "spec": {"nodeName": format!("node-{node:05}"), "containers": [{"name": "main", "image": "x",
                "resources": {"limits": {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25"}}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap_or_default();
        snapshot.pods.push(pod);
    }
    snapshot
}

/// `count` pending pods, cycling through quarter, half and whole-GPU requests.
pub fn synthetic_pending(count: usize) -> Vec<Pod> {
    (0..count)
        .map(|i| {
            let share = ["25", "50", "100"][i % 3];
            serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("pending-{i}"), "namespace": "default", "uid": format!("uid-pending-{i}")},
                "spec": {"containers": [{"name": "main", "image": "x",
                    "resources": {"limits": {"koordinator.sh/gpu-core": share, "koordinator.sh/gpu-memory-ratio": share}}}]}
            }))
            .unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: n1}
- apiVersion: scheduling.koordinator.sh/v1alpha1
  kind: Device
  metadata:
    name: n1
  spec:
    devices:
    - {type: gpu, id: GPU-a, minor: 0, health: true, resources: {koordinator.sh/gpu-memory: "17066622976"}}
    - {type: gpu, id: GPU-b, minor: 1, health: true, resources: {koordinator.sh/gpu-memory: "17066622976"}}
- apiVersion: v1
  kind: Pod
  metadata:
    name: running
    namespace: default
    uid: r1
    annotations:
      scheduling.koordinator.sh/device-allocated: '{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":100,"koordinator.sh/gpu-memory-ratio":100}}]}'
  spec:
    nodeName: n1
    containers: [{name: main, image: x}]
  status: {phase: Running}
"#;

    const PENDING: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: half, namespace: default}
spec:
  containers:
  - name: main
    image: x
    resources: {limits: {koordinator.sh/gpu: "50"}}
---
apiVersion: v1
kind: Pod
metadata: {name: two, namespace: default}
spec:
  containers:
  - name: main
    image: x
    resources: {limits: {nvidia.com/gpu: "2"}}
"#;

    #[test]
    fn places_pending_pods_on_a_snapshot() {
        let snapshot = parse_snapshot(CLUSTER, "cluster").expect("parses");
        assert_eq!(
            (snapshot.nodes, snapshot.devices.len(), snapshot.pods.len()),
            (1, 1, 1)
        );
        let pending = parse_snapshot(PENDING, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &pending, &SimulateOptions::default());
        assert_eq!(outcomes[0].node.as_deref(), Some("n1"));
        assert!(
            outcomes[0]
                .annotation
                .as_deref()
                .is_some_and(|a| a.contains("GPU-b")),
            "{outcomes:?}"
        );
        assert_eq!(outcomes[1].node, None);
        assert!(
            outcomes[1]
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("fits none of 1 nodes")),
            "{outcomes:?}"
        );
    }

    /// Two 25% containers and a sidecar with no GPU: one GPU booked 50%, each
    /// container granted its quarter, the sidecar nothing.
    #[test]
    fn places_pods_container_by_container() {
        let snapshot = parse_snapshot(CLUSTER, "cluster").expect("parses");
        let pending = parse_snapshot(
            r#"
apiVersion: v1
kind: Pod
metadata: {name: two-quarters, namespace: default}
spec:
  containers:
  - {name: a, image: x, resources: {limits: {koordinator.sh/gpu: "25"}}}
  - {name: b, image: x, resources: {limits: {koordinator.sh/gpu: "25"}}}
  - {name: sidecar, image: x}
"#,
            "pods",
        )
        .expect("parses")
        .pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &pending, &SimulateOptions::default());
        let annotation = outcomes[0].annotation.as_deref().expect("placed");
        let parsed = tessera_api::DeviceAllocations::parse(annotation).expect("valid");
        assert_eq!(parsed.gpus().len(), 1);
        assert_eq!(parsed.gpus()[0].id, "GPU-b");
        assert_eq!(parsed.gpus()[0].gpu_core(), Some(50));
        for name in ["a", "b"] {
            let granted = parsed.gpus_of_container(name);
            assert_eq!(granted.len(), 1, "{name}");
            assert_eq!(granted[0].1.gpu_core(), Some(25), "{name}");
        }
        assert!(parsed.gpus_of_container("sidecar").is_empty());
        assert_eq!(ledger.node("n1").expect("node").gpus[1].core_used, 50);
    }

    /// Two nodes of different models; pods written as HAMi, Volcano, gpushare and
    /// Koordinator users write them, with their annotations.
    const MIXED: &str = r#"
apiVersion: v1
kind: List
items:
- apiVersion: scheduling.koordinator.sh/v1alpha1
  kind: Device
  metadata: {name: a100}
  spec:
    devices:
    - {type: gpu, id: GPU-a0, minor: 0, health: true, labels: {node.koordinator.sh/gpu-model: NVIDIA-A100-SXM4-80GB}, resources: {koordinator.sh/gpu-memory: "85899345920"}}
    - {type: gpu, id: GPU-a1, minor: 1, health: true, labels: {node.koordinator.sh/gpu-model: NVIDIA-A100-SXM4-80GB}, resources: {koordinator.sh/gpu-memory: "85899345920"}}
- apiVersion: scheduling.koordinator.sh/v1alpha1
  kind: Device
  metadata: {name: h100}
  spec:
    devices:
    - {type: gpu, id: GPU-h0, minor: 0, health: true, labels: {node.koordinator.sh/gpu-model: NVIDIA-H100-80GB-HBM3}, resources: {koordinator.sh/gpu-memory: "85899345920"}}
    - {type: gpu, id: GPU-h1, minor: 1, health: true, labels: {node.koordinator.sh/gpu-model: NVIDIA-H100-80GB-HBM3}, resources: {koordinator.sh/gpu-memory: "85899345920"}}
"#;

    const COMPAT_PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: hami-h100
  namespace: default
  annotations:
    nvidia.com/use-gputype: "H100"
    hami.io/gpu-scheduler-policy: "spread"
spec:
  containers:
    - name: ubuntu-container
      image: ubuntu:18.04
      resources:
        limits:
          nvidia.com/gpu: 2
          nvidia.com/gpumem-percentage: 25
          nvidia.com/gpucores: 30
---
apiVersion: v1
kind: Pod
metadata: {name: volcano-whole, namespace: default}
spec:
  schedulerName: volcano
  containers:
    - name: cuda-container
      image: nvidia/cuda:9.0-devel
      resources:
        limits:
          volcano.sh/gpu-number: 1
---
apiVersion: v1
kind: Pod
metadata:
  name: koord-a100
  namespace: default
  annotations:
    scheduling.koordinator.sh/device-allocate-hint: '{"gpu":{"selector":{"matchLabels":{"node.koordinator.sh/gpu-model":"NVIDIA-A100-SXM4-80GB"}}}}'
spec:
  containers:
  - name: main
    image: nginx
    resources: {limits: {koordinator.sh/gpu: "50"}}
---
apiVersion: v1
kind: Pod
metadata:
  name: gpushare
  namespace: default
spec:
  containers:
  - name: binpack-1
    image: cheyang/gpu-player:v2
    resources:
      limits:
        # GiB
        aliyun.com/gpu-mem: 3
---
apiVersion: v1
kind: Pod
metadata:
  name: wants-v100
  namespace: default
  annotations: {nvidia.com/use-gputype: "V100"}
spec:
  containers:
    - {name: c, image: x, resources: {limits: {nvidia.com/gpu: 1}}}
---
apiVersion: v1
kind: Pod
metadata:
  name: bad-policy
  namespace: default
  annotations: {hami.io/gpu-scheduler-policy: "fast"}
spec:
  containers:
    - {name: c, image: x, resources: {limits: {nvidia.com/gpu: 1}}}
"#;

    #[test]
    fn simulates_other_systems_manifests_with_their_annotations() {
        let snapshot = parse_snapshot(MIXED, "cluster").expect("parses");
        let pending = parse_snapshot(COMPAT_PODS, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &pending, &SimulateOptions::default());
        let gpus_of = |index: usize| -> Vec<(String, Option<u64>, Option<u64>)> {
            let annotation = outcomes[index].annotation.as_deref().expect("placed");
            tessera_api::DeviceAllocations::parse(annotation)
                .expect("valid")
                .gpus()
                .iter()
                .map(|a| (a.id.clone(), a.gpu_core(), a.gpu_memory_ratio()))
                .collect()
        };
        // HAMi: two H100s, 30% compute and a quarter of the memory on each.
        assert_eq!(outcomes[0].node.as_deref(), Some("h100"), "{outcomes:?}");
        assert_eq!(
            gpus_of(0),
            [
                ("GPU-h0".to_owned(), Some(30), Some(25)),
                ("GPU-h1".to_owned(), Some(30), Some(25))
            ]
        );
        // Volcano: a whole GPU, so an empty one: only the A100 node has any left.
        assert_eq!(outcomes[1].node.as_deref(), Some("a100"), "{outcomes:?}");
        assert_eq!(gpus_of(1)[0].1, Some(100));
        // Koordinator's hint: an A100, the one left.
        assert_eq!(outcomes[2].node.as_deref(), Some("a100"), "{outcomes:?}");
        assert_eq!(gpus_of(2)[0].0, "GPU-a1");
        // gpushare: 3 GiB.
        let annotation = outcomes[3].annotation.as_deref().expect("placed");
        let parsed = tessera_api::DeviceAllocations::parse(annotation).expect("valid");
        assert_eq!(parsed.gpus()[0].gpu_memory(), Some(3 << 30));
        // Refusals name the annotation and its value.
        assert_eq!(
            outcomes[4].reason.as_deref(),
            Some(
                r#"nvidia.com/use-gputype="V100" rules out every GPU of every node: no node has such a GPU (GPU models in the cluster: NVIDIA-A100-SXM4-80GB, NVIDIA-H100-80GB-HBM3)"#
            )
        );
        assert_eq!(
            outcomes[5].reason.as_deref(),
            Some(
                r#"annotation hami.io/gpu-scheduler-policy: "fast": "fast": expected binpack or spread, optionally with topology-aware or numa"#
            )
        );
    }

    #[test]
    fn simulates_sharing_groups() {
        let snapshot = parse_snapshot(MIXED, "cluster").expect("parses");
        let member = |name: &str, group: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default, annotations: {{lsalab.nthu/GPUID: {group}}}}}\nspec:\n  containers: [{{name: c, image: x, resources: {{limits: {{koordinator.sh/gpu: \"25\"}}}}}}]\n---\n"
            )
        };
        let pods = [
            member("a-0", "a"),
            member("b-0", "b"),
            member("a-1", "a"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: loner, namespace: default}\nspec:\n  containers: [{name: c, image: x, resources: {limits: {koordinator.sh/gpu: \"25\"}}}]\n".to_owned(),
        ]
        .concat();
        let pending = parse_snapshot(&pods, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &pending, &SimulateOptions::default());
        let gpu = |index: usize| {
            let annotation = outcomes[index].annotation.as_deref().expect("placed");
            tessera_api::DeviceAllocations::parse(annotation)
                .expect("valid")
                .gpus()[0]
                .id
                .clone()
        };
        assert_eq!(gpu(0), gpu(2), "{outcomes:?}");
        let taken = [gpu(0), gpu(1), gpu(3)];
        assert!(
            taken[0] != taken[1] && taken[0] != taken[2] && taken[1] != taken[2],
            "{outcomes:?}"
        );
    }

    #[test]
    fn bad_snapshots_are_named() {
        assert!(
            parse_snapshot("{", "cluster.yaml")
                .expect_err("syntax")
                .to_string()
                .starts_with("cluster.yaml: not JSON or YAML")
        );
        let bad = r#"{"kind":"Device","metadata":{"name":"n"},"spec":{"devices":"x"}}"#;
        assert!(
            parse_snapshot(bad, "c")
                .expect_err("shape")
                .to_string()
                .starts_with("c: item 0 (Device)")
        );
    }

    #[test]
    fn synthetic_clusters_fill_up() {
        let snapshot = synthetic_cluster(10, 8, 80);
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(
            &mut ledger,
            &synthetic_pending(30),
            &SimulateOptions::default(),
        );
        assert!(outcomes.iter().all(|o| o.node.is_some()), "{outcomes:?}");
        assert_eq!(adaptive_nodes_to_score(5000), 500);
        assert_eq!(adaptive_nodes_to_score(50), 50);
    }
}
