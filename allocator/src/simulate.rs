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
                        .unwrap_or_else(|| {
                            unfit_reason_pod(node, &request, options.gpu_policy).to_string()
                        }),
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
mod tests;
