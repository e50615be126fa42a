//! `simulate`: the same allocation core over a snapshot of Nodes, Device CRs and
//! Pods, placing pending pods one after the other as the extender would.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::Value;
use tessera_api::request::{RequestOptions, pod_gpu_request};
use tessera_api::{Device, DeviceInfo, DeviceSpec, DeviceTopology};

use crate::allocate::{
    LoadedNode, NodeLoad, NodeState, Policy, allocate_pod, group_elsewhere, group_home,
    group_over_allowance, score_pod_loaded, selected_nowhere, unfit_reason_pod,
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
    /// Names of the Node objects, in snapshot order.
    pub nodes: Vec<String>,
}

impl Snapshot {
    /// kube-scheduler's node list for this snapshot: its Node objects, or, when it
    /// has none (a snapshot of Device CRs and pods only), one node per Device CR;
    /// sorted by name. Nodes without a Device CR are in it: kube-scheduler's own
    /// filters pass them (the GPU share resources are `ignoredByScheduler`), so they
    /// take places in its sample and the extender refuses them.
    pub fn node_list(&self) -> Vec<String> {
        let mut names: Vec<String> = if self.nodes.is_empty() {
            self.devices
                .iter()
                .filter_map(|d| d.metadata.name.clone())
                .collect()
        } else {
            self.nodes.clone()
        };
        names.sort();
        names.dedup();
        names
    }
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
            "Node" => {
                let name = item
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                snapshot.nodes.push(name.to_owned());
            }
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

impl Outcome {
    /// One line for a person: `ns/pod -> node: GPU 1 (GPU-…) main 25%, 4.0 GiB`,
    /// or `ns/pod -> (none): why`. `--json` keeps the raw annotation for scripts.
    pub fn line(&self) -> String {
        match (&self.node, &self.annotation) {
            (Some(node), Some(annotation)) => {
                format!(
                    "{} -> {node}: {}",
                    self.pod,
                    describe_allocation(annotation)
                )
            }
            _ => format!(
                "{} -> (none): {}",
                self.pod,
                self.reason.as_deref().unwrap_or("not placed")
            ),
        }
    }
}

/// The pods a run left unplaced, for its summary: how many, how many of them
/// `before` (an earlier run of the same pods with another sample, the deploy's
/// 100 %) placed, and the first `limit` names.
pub fn unplaced_summary(outcomes: &[Outcome], before: Option<&[Outcome]>, limit: usize) -> String {
    let unplaced: Vec<&Outcome> = outcomes.iter().filter(|o| o.node.is_none()).collect();
    if unplaced.is_empty() {
        return "every pod placed".into();
    }
    let placed_before = before.map(|before| {
        let placed: std::collections::HashSet<&str> = before
            .iter()
            .filter(|o| o.node.is_some())
            .map(|o| o.pod.as_str())
            .collect();
        unplaced
            .iter()
            .filter(|o| placed.contains(o.pod.as_str()))
            .count()
    });
    let mut text = format!("{} left unplaced", unplaced.len());
    if let Some(missed) = placed_before.filter(|m| *m > 0) {
        let _ = write!(
            text,
            " ({missed} of them placed when every node is looked at: free shares the sample missed)"
        );
    }
    let names: Vec<&str> = unplaced
        .iter()
        .take(limit)
        .map(|o| o.pod.as_str())
        .collect();
    let _ = write!(text, ": {}", names.join(", "));
    if unplaced.len() > limit {
        let _ = write!(text, " and {} more", unplaced.len() - limit);
    }
    text
}

/// An allocation annotation in words: each GPU by minor and UUID, with each
/// container's share (`memory only` where it holds no compute), `; `-separated.
/// An annotation that does not parse is shown as it is.
pub fn describe_allocation(annotation: &str) -> String {
    let Ok(parsed) = tessera_api::allocation::DeviceAllocations::parse(annotation) else {
        return annotation.to_owned();
    };
    let share = |resources: &BTreeMap<String, tessera_api::Quantity>| {
        let get = |name: &str| resources.get(name).map_or(0, tessera_api::Quantity::value);
        let core = get(tessera_api::resources::GPU_CORE);
        let gib = get(tessera_api::resources::GPU_MEMORY) as f64 / f64::from(1u32 << 30);
        if core == 0 {
            format!("memory only, {gib:.1} GiB")
        } else {
            format!("{core}%, {gib:.1} GiB")
        }
    };
    parsed
        .gpus()
        .iter()
        .map(|gpu| {
            let shares = match &gpu.containers {
                Some(containers) => containers
                    .iter()
                    .map(|(name, resources)| format!("{name} {}", share(resources)))
                    .collect::<Vec<_>>()
                    .join(", "),
                None => share(&gpu.resources),
            };
            format!("GPU {} ({}) {shares}", gpu.minor, gpu.id)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Settings of a simulation.
#[derive(Debug, Clone, Copy)]
pub struct SimulateOptions {
    /// Which GPU.
    pub gpu_policy: Policy,
    /// Which node.
    pub node_policy: Policy,
    /// Request parsing.
    pub request: RequestOptions,
    /// kube-scheduler's `percentageOfNodesToScore` (0: its adaptive default; Tessera's
    /// deploy sets 100).
    pub percentage_of_nodes_to_score: u32,
    /// The most GPUs the sharing groups of one namespace hold at once.
    pub group_gpus_per_namespace: u32,
}

impl Default for SimulateOptions {
    fn default() -> Self {
        Self {
            gpu_policy: Policy::default(),
            node_policy: Policy::default(),
            request: RequestOptions::default(),
            percentage_of_nodes_to_score: 0,
            group_gpus_per_namespace: crate::allocate::GROUP_GPUS_PER_NAMESPACE,
        }
    }
}

/// How many feasible nodes kube-scheduler looks for before it stops filtering
/// (`numFeasibleNodesToFind`, pkg/scheduler/schedule_one.go, 1.36): all of them
/// under 100 nodes; else `percentage` of them (0: 50 − nodes/125, at least 5), at
/// least 100.
pub fn nodes_to_find(percentage: u32, total: usize) -> usize {
    const MIN_NODES: usize = 100;
    const MIN_PERCENT: usize = 5;
    if total < MIN_NODES {
        return total;
    }
    let percent = match percentage {
        0 => 50usize.saturating_sub(total / 125).max(MIN_PERCENT),
        p => p as usize,
    };
    (total * percent / 100).clamp(MIN_NODES, total)
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

/// Places `pending` one after the other, one scheduling cycle each, as
/// kube-scheduler with Tessera as its extender does; each placement counts for the
/// next. `nodes` is kube-scheduler's node list ([`Snapshot::node_list`]).
///
/// Node sampling as kube-scheduler does it: each cycle its own filters stop after
/// [`nodes_to_find`] feasible nodes, starting where the previous cycle stopped, and
/// only those go to the extender. Every node passes kube-scheduler's own filters
/// here (taints, affinity, CPU and memory are not in the snapshot's model), so a
/// cycle sees the next `nodes_to_find` nodes round-robin. A pod that fits none of
/// them is unschedulable in that cycle even when a node outside the sample has
/// room (kube-scheduler retries it later, with another sample).
/// Within the sample: filter, prioritize and bind as the extender does them.
pub fn simulate<P: std::borrow::Borrow<Pod>>(
    ledger: &mut Ledger,
    nodes: &[String],
    pending: impl IntoIterator<Item = P>,
    options: &SimulateOptions,
) -> Vec<Outcome> {
    let window = nodes_to_find(options.percentage_of_nodes_to_score, nodes.len());
    // Each node's state and load by its place in `nodes`: a cycle reads its sample
    // in order instead of looking each name up (the lookups were most of the time),
    // and judges most nodes from the load alone, as the extender's filter does; a
    // placement refreshes the one node it changed.
    let copy = |ledger: &Ledger, name: &str| {
        ledger
            .loaded_node(name)
            .map(|node| (node.state.clone(), node.load.clone()))
    };
    let mut states: Vec<Option<(NodeState, NodeLoad)>> =
        nodes.iter().map(|name| copy(ledger, name)).collect();
    let mut start = 0usize;
    let mut outcomes = Vec::new();
    let unplaced = |pod: String, reason: String| Outcome {
        pod,
        node: None,
        annotation: None,
        reason: Some(reason),
    };
    for (index, pod) in pending.into_iter().enumerate() {
        let pod = pod.borrow();
        let who = pod_name(pod);
        let request = match pod_gpu_request(pod, &options.request) {
            Ok(Some(request)) => request,
            Ok(None) => {
                outcomes.push(unplaced(who, "asks for no GPU".into()));
                continue;
            }
            Err(error) => {
                outcomes.push(unplaced(who, error.to_string()));
                continue;
            }
        };
        if let Some(why) = selected_nowhere(ledger.nodes(), &request.selection) {
            outcomes.push(unplaced(who, why));
            continue;
        }
        let first = start;
        let sample = (0..window).map(move |i| (first + i) % nodes.len());
        // kube-scheduler's nextStartNodeIndex: on by the nodes its filters processed.
        start = (start + window) % nodes.len().max(1);
        let home = group_home(ledger.nodes(), &request);
        if let Some(why) = group_over_allowance(
            ledger.nodes(),
            &request,
            home.as_ref(),
            options.group_gpus_per_namespace,
        ) {
            outcomes.push(unplaced(who, why));
            continue;
        }
        // The extender's filter and prioritize over the sample: the best score, the
        // first in the sample among equals (kube-scheduler draws one at random).
        let mut best: Option<(i64, usize)> = None;
        for at in sample.clone() {
            let Some((state, load)) = &states[at] else {
                continue;
            };
            if group_elsewhere(home.as_ref(), &request, &nodes[at]).is_some() {
                continue;
            }
            // A score is the verdict that the pod fits, as in the extender's filter.
            let loaded = LoadedNode { state, load };
            let Some(value) =
                score_pod_loaded(loaded, &request, options.gpu_policy, options.node_policy)
            else {
                continue;
            };
            if best.is_none_or(|(b, _)| value > b) {
                best = Some((value, at));
            }
        }
        // The extender's bind on the chosen node.
        let placed = best.and_then(|(_, at)| {
            let (state, _) = states[at].as_ref()?;
            let placement = allocate_pod(state, &request, options.gpu_policy).ok()?;
            Some((at, placement))
        });
        let Some((at, placement)) = placed else {
            let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
            for at in sample {
                let reason = match &states[at] {
                    None => "no Device CR: the node reports no GPUs".to_owned(),
                    Some((node, _)) => group_elsewhere(home.as_ref(), &request, &nodes[at])
                        .unwrap_or_else(|| unfit_reason_pod(node, &request, options.gpu_policy)),
                };
                *reasons.entry(reason).or_default() += 1;
            }
            let mut reason = if window < nodes.len() {
                format!(
                    "fits none of the {window} nodes kube-scheduler sampled this cycle (of {}; percentageOfNodesToScore {})",
                    nodes.len(),
                    options.percentage_of_nodes_to_score
                )
            } else {
                format!("fits none of {} nodes", nodes.len())
            };
            for (text, count) in reasons.iter().take(3) {
                let _ = write!(reason, "; {count} node(s): {text}");
            }
            outcomes.push(unplaced(who, reason));
            continue;
        };
        let node = nodes[at].clone();
        let uid = pod
            .metadata
            .uid
            .clone()
            .unwrap_or_else(|| format!("simulated-{index}"));
        let annotation = annotation_of(&placement);
        ledger.reserve(&uid, &node, placement.booked, u64::MAX);
        states[at] = copy(ledger, &node);
        outcomes.push(Outcome {
            pod: who,
            node: Some(node),
            annotation: Some(annotation),
            reason: None,
        });
    }
    outcomes
}

/// A synthetic cluster: `nodes` nodes of `gpus` 80 GiB GPUs (PCIe switch pairs, two
/// NUMA nodes) and `running` quarter-GPU pods, two to a GPU, filling nodes in order
/// (40,000 pods on 5,000 × 8 GPUs: half the nodes half-used, half empty).
pub fn synthetic_cluster(nodes: usize, gpus: u32, running: usize) -> Snapshot {
    Snapshot {
        nodes: synthetic_node_names(nodes),
        devices: (0..nodes).map(|n| synthetic_device(n, gpus)).collect(),
        pods: (0..running)
            .map(|p| synthetic_running_pod(p, nodes, gpus))
            .collect(),
    }
}

/// The ledger of [`synthetic_cluster`] without the snapshot: each pod is booked and
/// dropped, so the process holds what the extender holds, not 40,000 Pod objects.
/// Returns the ledger and the node list.
pub fn synthetic_ledger(nodes: usize, gpus: u32, running: usize) -> (Ledger, Vec<String>) {
    let mut ledger = Ledger::default();
    for n in 0..nodes {
        ledger.apply_device(&synthetic_device(n, gpus));
    }
    for p in 0..running {
        ledger.apply_pod(&synthetic_running_pod(p, nodes, gpus));
    }
    (ledger, synthetic_node_names(nodes))
}

fn synthetic_node_names(nodes: usize) -> Vec<String> {
    (0..nodes).map(|n| format!("node-{n:05}")).collect()
}

fn synthetic_device(n: usize, gpus: u32) -> Device {
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
    Device::new(&format!("node-{n:05}"), DeviceSpec { devices })
}

fn synthetic_running_pod(p: usize, nodes: usize, gpus: u32) -> Pod {
    let slot = p / 2;
    let node = (slot / gpus.max(1) as usize) % nodes.max(1);
    let gpu = (slot % gpus.max(1) as usize) as u32;
    let annotation = format!(
        r#"{{"gpu":[{{"minor":{gpu},"id":"GPU-{node:05}-{gpu:02}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}}]}}"#
    );
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("running-{p}"), "namespace": "default", "uid": format!("uid-running-{p}"),
            "annotations": {"scheduling.koordinator.sh/device-allocated": annotation}},
        "spec": {"nodeName": format!("node-{node:05}"), "containers": [{"name": "main", "image": "x",
            "resources": {"limits": {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25"}}}]},
        "status": {"phase": "Running"}
    }))
    .unwrap_or_default()
}

/// `count` pending pods, cycling through quarter, half and whole-GPU requests.
pub fn synthetic_pending(count: usize) -> Vec<Pod> {
    (0..count).map(synthetic_pending_pod).collect()
}

/// Pending pod `i` of [`synthetic_pending`], made when needed: `simulate` takes
/// pods one at a time, so a run need not hold them all.
pub fn synthetic_pending_pod(i: usize) -> Pod {
    use k8s_openapi::api::core::v1::{Container, PodSpec, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let share = ["25", "50", "100"][i % 3];
    let limits = ["koordinator.sh/gpu-core", "koordinator.sh/gpu-memory-ratio"]
        .map(|name| (name.to_owned(), Quantity(share.to_owned())));
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(format!("pending-{i}")),
            namespace: Some("default".into()),
            uid: Some(format!("uid-pending-{i}")),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".into(),
                image: Some("x".into()),
                resources: Some(ResourceRequirements {
                    limits: Some(limits.into_iter().collect()),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_reads_as_gpus_and_shares_or_as_its_reason() {
        let placed = Outcome {
            pod: "default/two".into(),
            node: Some("n2".into()),
            annotation: Some(
                r#"{"gpu":[{"minor":0,"id":"GPU-a","resources":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory":4294967296,"koordinator.sh/gpu-memory-ratio":25},"extension":{"containers":{"a":{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory":4294967296,"koordinator.sh/gpu-memory-ratio":25}}}},{"minor":1,"id":"GPU-b","resources":{"koordinator.sh/gpu-core":0,"koordinator.sh/gpu-memory":7516192768,"koordinator.sh/gpu-memory-ratio":45}}]}"#
                    .into(),
            ),
            reason: None,
        };
        assert_eq!(
            placed.line(),
            "default/two -> n2: GPU 0 (GPU-a) a 25%, 4.0 GiB; GPU 1 (GPU-b) memory only, 7.0 GiB"
        );
        let unplaced = Outcome {
            pod: "default/big".into(),
            node: None,
            annotation: None,
            reason: Some("fits none of 3 nodes".into()),
        };
        assert_eq!(
            unplaced.line(),
            "default/big -> (none): fits none of 3 nodes"
        );
        assert_eq!(describe_allocation("not json"), "not json");
    }

    #[test]
    fn a_summary_names_the_unplaced_and_those_only_the_sample_missed() {
        let outcome = |pod: &str, placed: bool| Outcome {
            pod: pod.into(),
            node: placed.then(|| "n".to_owned()),
            annotation: None,
            reason: (!placed).then(|| "no room".to_owned()),
        };
        let every = [outcome("a", true), outcome("b", true), outcome("c", false)];
        let sampled = [outcome("a", false), outcome("b", true), outcome("c", false)];
        assert_eq!(unplaced_summary(&every, None, 10), "1 left unplaced: c");
        assert_eq!(
            unplaced_summary(&sampled, Some(&every), 1),
            "2 left unplaced (1 of them placed when every node is looked at: free shares the sample missed): a and 1 more"
        );
        assert_eq!(unplaced_summary(&every[..2], None, 10), "every pod placed");
    }

    /// docs/scheduler.md quotes `simulate` on docs/examples: it must be what
    /// simulate prints.
    #[test]
    fn the_docs_quote_simulate_on_the_examples_as_it_prints() {
        let doc = include_str!("../../docs/scheduler.md");
        let quoted = doc
            .split_once("It prints one line per pending pod of the first run")
            .and_then(|(_, after)| after.split_once("```\n"))
            .and_then(|(_, block)| block.split_once("```"))
            .map(|(block, _)| block)
            .expect("docs/scheduler.md quotes simulate's output");
        let cluster = parse_snapshot(include_str!("../../docs/examples/cluster.yaml"), "cluster")
            .expect("cluster");
        let pods = parse_snapshot(include_str!("../../docs/examples/pods.yaml"), "pods")
            .expect("pods")
            .pods;
        let mut ledger = ledger_of(&cluster);
        let printed: String = simulate(
            &mut ledger,
            &cluster.node_list(),
            &pods,
            // The first run's: the deploy's mode.
            &SimulateOptions {
                percentage_of_nodes_to_score: 100,
                ..SimulateOptions::default()
            },
        )
        .iter()
        .map(|o| o.line() + "\n")
        .collect();
        assert_eq!(printed, quoted);
    }

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
            (
                snapshot.nodes.clone(),
                snapshot.devices.len(),
                snapshot.pods.len()
            ),
            (vec!["n1".to_owned()], 1, 1)
        );
        let pending = parse_snapshot(PENDING, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &pending,
            &SimulateOptions::default(),
        );
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
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &pending,
            &SimulateOptions::default(),
        );
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
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &pending,
            &SimulateOptions::default(),
        );
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

    /// `--gpushare-memory-unit` reaches simulate: `aliyun.com/gpu-mem: 3` is 3 MiB
    /// under MiB; 8138 under the default GiB is refused with the filter's message.
    #[test]
    fn simulate_reads_gpushare_in_the_unit_it_is_given() {
        let snapshot = parse_snapshot(MIXED, "cluster").expect("parses");
        let mib = SimulateOptions {
            request: RequestOptions {
                gpushare_memory_unit: tessera_api::request::MemoryUnit::MiB,
                ..RequestOptions::default()
            },
            ..SimulateOptions::default()
        };
        let memory_of = |outcome: &Outcome| {
            let annotation = outcome.annotation.as_deref().expect("placed");
            tessera_api::DeviceAllocations::parse(annotation)
                .expect("valid")
                .gpus()[0]
                .gpu_memory()
        };
        let pending = parse_snapshot(COMPAT_PODS, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &snapshot.node_list(), &pending, &mib);
        assert_eq!(outcomes[3].pod, "default/gpushare", "{outcomes:?}");
        assert_eq!(memory_of(&outcomes[3]), Some(3 << 20));

        let meant_mib = parse_snapshot(
            r#"
apiVersion: v1
kind: Pod
metadata: {name: meant-mib, namespace: default}
spec:
  containers:
  - {name: binpack-1, image: x, resources: {limits: {aliyun.com/gpu-mem: 8138}}}
"#,
            "pods",
        )
        .expect("parses")
        .pods;
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &meant_mib,
            &SimulateOptions::default(),
        );
        assert_eq!(outcomes[0].node, None);
        assert_eq!(
            outcomes[0].reason.as_deref(),
            Some(
                "container binpack-1: aliyun.com/gpu-mem 8138: 8138 GiB is more than any GPU holds; gpushare counts GiB unless its device plugin runs with --memory-unit=MiB, and then tessera-scheduler needs --gpushare-memory-unit MiB"
            )
        );
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &snapshot.node_list(), &meant_mib, &mib);
        assert_eq!(memory_of(&outcomes[0]), Some(8138 << 20), "{outcomes:?}");
    }

    #[test]
    fn a_namespaces_sharing_groups_hold_no_more_gpus_than_its_allowance() {
        let snapshot = parse_snapshot(MIXED, "cluster").expect("parses");
        let member = |name: &str, namespace: &str, group: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, annotations: {{lsalab.nthu/GPUID: {group}}}}}\nspec:\n  containers: [{{name: c, image: x, resources: {{limits: {{koordinator.sh/gpu-core: \"1\", koordinator.sh/gpu-memory-ratio: \"1\"}}}}}}]\n---\n"
            )
        };
        let pods = [
            member("g1", "default", "g1"),
            member("g2", "default", "g2"),
            // A third 1 % group of the namespace: past its allowance of 2.
            member("g3", "default", "g3"),
            // Joining a group that holds a GPU is no new GPU.
            member("g1-b", "default", "g1"),
            // Another namespace has its own allowance.
            member("o1", "other", "g3"),
        ]
        .concat();
        let pending = parse_snapshot(&pods, "pods").expect("parses").pods;
        let mut ledger = ledger_of(&snapshot);
        let options = SimulateOptions {
            group_gpus_per_namespace: 2,
            ..SimulateOptions::default()
        };
        let outcomes = simulate(&mut ledger, &snapshot.node_list(), &pending, &options);
        let placed: Vec<bool> = outcomes.iter().map(|o| o.node.is_some()).collect();
        assert_eq!(placed, [true, true, false, true, true], "{outcomes:?}");
        assert_eq!(
            outcomes[2].reason.as_deref(),
            Some(
                r#"sharing group "default/g3" is new, and the sharing groups of namespace "default" already hold 2 GPUs, the most one namespace's groups may hold (--max-group-gpus-per-namespace=2): it waits until one of them ends"#
            )
        );
        // Without the cap, the third takes a third GPU for its 1 %.
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &pending,
            &SimulateOptions {
                group_gpus_per_namespace: u32::MAX,
                ..SimulateOptions::default()
            },
        );
        assert!(outcomes.iter().all(|o| o.node.is_some()), "{outcomes:?}");
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
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            &pending,
            &SimulateOptions::default(),
        );
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

    /// kube-scheduler 1.36's numFeasibleNodesToFind, case by case.
    #[test]
    fn nodes_to_find_is_kube_schedulers() {
        for (percentage, total, want) in [
            (0, 0, 0),
            (0, 50, 50),
            (0, 99, 99),
            (0, 100, 100),   // 49% is 49: at least 100
            (0, 500, 230),   // 46%
            (0, 1000, 420),  // 42%
            (0, 5000, 500),  // 10%
            (0, 10000, 500), // 50 - 80 < 5: 5%
            (0, 20000, 1000),
            (100, 5000, 5000),
            (10, 5000, 500),
            (1, 5000, 100), // 50 nodes: at least 100
            (50, 80, 80),   // under 100 nodes: all of them
        ] {
            assert_eq!(
                nodes_to_find(percentage, total),
                want,
                "percentage {percentage}, {total} nodes"
            );
        }
    }

    /// 200 nodes, GPUs only on the second half: kube-scheduler's adaptive sample is
    /// 100 nodes a cycle, so the first cycle sees no GPU node and the pod is
    /// unschedulable there; the next cycle samples the other half. With
    /// percentageOfNodesToScore 100 (Tessera's deploy) every cycle sees every node.
    #[test]
    fn simulate_sees_only_kube_schedulers_sample_of_nodes() {
        let snapshot = Snapshot {
            nodes: (0..200).map(|n| format!("node-{n:05}")).collect(),
            devices: (100..200).map(|n| synthetic_device(n, 8)).collect(),
            pods: Vec::new(),
        };
        let nodes = snapshot.node_list();
        assert_eq!(nodes.len(), 200);
        let pending = synthetic_pending(3);

        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(&mut ledger, &nodes, &pending, &SimulateOptions::default());
        assert_eq!(outcomes[0].node, None, "{outcomes:?}");
        assert_eq!(
            outcomes[0].reason.as_deref(),
            Some(
                "fits none of the 100 nodes kube-scheduler sampled this cycle (of 200; percentageOfNodesToScore 0); 100 node(s): no Device CR: the node reports no GPUs"
            )
        );
        assert!(
            outcomes[1]
                .node
                .as_deref()
                .is_some_and(|n| n >= "node-00100"),
            "{outcomes:?}"
        );
        assert_eq!(outcomes[2].node, None, "{outcomes:?}");

        let mut ledger = ledger_of(&snapshot);
        let all = SimulateOptions {
            percentage_of_nodes_to_score: 100,
            ..SimulateOptions::default()
        };
        let outcomes = simulate(&mut ledger, &nodes, &pending, &all);
        assert!(outcomes.iter().all(|o| o.node.is_some()), "{outcomes:?}");
    }

    /// The sample is the next nodes round-robin from where the last cycle stopped,
    /// whatever fits: nodes with no room in it are not passed over for nodes
    /// outside it.
    #[test]
    fn the_sample_moves_on_by_what_kube_scheduler_processed() {
        // 300 one-GPU nodes, the first 144 half-used; 48% of 300: 144 nodes a cycle.
        let snapshot = synthetic_cluster(300, 1, 288);
        let nodes = snapshot.node_list();
        let mut ledger = ledger_of(&snapshot);
        let whole = |i: usize| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("w{i}"), "namespace": "default", "uid": format!("w{i}")},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
            }))
            .expect("a pod")
        };
        let pending: Vec<Pod> = (0..3).map(whole).collect();
        let outcomes = simulate(&mut ledger, &nodes, &pending, &SimulateOptions::default());
        let placed: Vec<Option<&str>> = outcomes.iter().map(|o| o.node.as_deref()).collect();
        // Cycle 1 samples the half-used nodes 0-143; cycle 2 nodes 144-287 (equal
        // scores: the first name); cycle 3 nodes 288-299 and 0-131.
        assert_eq!(
            placed,
            [None, Some("node-00144"), Some("node-00288")],
            "{outcomes:?}"
        );
        assert!(
            outcomes[0]
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("the 144 nodes kube-scheduler sampled")),
            "{outcomes:?}"
        );
    }

    #[test]
    fn synthetic_clusters_fill_up() {
        let snapshot = synthetic_cluster(10, 8, 80);
        let mut ledger = ledger_of(&snapshot);
        let outcomes = simulate(
            &mut ledger,
            &snapshot.node_list(),
            synthetic_pending(30),
            &SimulateOptions::default(),
        );
        assert!(outcomes.iter().all(|o| o.node.is_some()), "{outcomes:?}");
        // The streamed ledger books the same as the snapshot's.
        let (streamed, names) = synthetic_ledger(10, 8, 80);
        assert_eq!(names, snapshot.node_list());
        let fresh = ledger_of(&snapshot);
        for name in &names {
            assert_eq!(streamed.node(name), fresh.node(name), "{name}");
        }
    }
}
