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
    let doc = include_str!("../../../docs/scheduler.md");
    let quoted = doc
        .split_once("It prints one line per pending pod of the first run")
        .and_then(|(_, after)| after.split_once("```\n"))
        .and_then(|(_, block)| block.split_once("```"))
        .map(|(block, _)| block)
        .expect("docs/scheduler.md quotes simulate's output");
    let cluster = parse_snapshot(
        include_str!("../../../docs/examples/cluster.yaml"),
        "cluster",
    )
    .expect("cluster");
    let pods = parse_snapshot(include_str!("../../../docs/examples/pods.yaml"), "pods")
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
