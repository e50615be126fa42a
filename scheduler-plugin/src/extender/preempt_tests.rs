//! `preempt` as kube-scheduler calls it: the dry run's victims per node come in
//! (chosen on aggregate GPU capacity), the victims per GPU go back; nodes where
//! no eviction helps are left out.

use serde_json::{Value, json};

use super::fixtures::{extender_over, healthy_device};
use super::*;

/// A running pod `uid` of `priority` on `node`, holding `percent` of GPU `gpu`
/// (none when `gpu` is `None`).
fn running(uid: &str, priority: i32, node: &str, gpu: Option<(usize, u32)>) -> Pod {
    let annotations = gpu.map(|(index, percent)| {
        let allocated = json!({"gpu": [{"minor": index, "id": format!("GPU-{node}-{index}"),
            "resources": {"koordinator.sh/gpu-core": percent, "koordinator.sh/gpu-memory-ratio": percent}}]});
        json!({"scheduling.koordinator.sh/device-allocated": allocated.to_string()})
    });
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": uid, "namespace": "default", "uid": uid, "annotations": annotations},
        "spec": {"nodeName": node, "priority": priority, "containers": [{"name": "main", "image": "x"}]},
        "status": {"phase": "Running"}}))
    .expect("pod")
}

fn preemptor(limits: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "urgent", "namespace": "default", "uid": "urgent"},
        "spec": {"priority": 100, "containers": [{"name": "main", "image": "x",
            "resources": {"limits": limits}}]}})
}

/// n1: GPU 0 holds a and b (50% each, priority 0); GPU 1 holds c (priority 0)
/// beside h (priority 100); cpu-hog (priority 5) holds no GPU. n2: one GPU held
/// whole by a priority-100 pod.
fn cluster() -> Extender {
    let mut ledger = Ledger::default();
    for device in [healthy_device("n1", 2), healthy_device("n2", 1)] {
        ledger.apply_device(&serde_json::from_value(device).expect("device"));
    }
    for pod in [
        running("a", 0, "n1", Some((0, 50))),
        running("b", 0, "n1", Some((0, 50))),
        running("c", 0, "n1", Some((1, 50))),
        running("h", 100, "n1", Some((1, 50))),
        running("cpu-hog", 5, "n1", None),
        running("h2", 100, "n2", Some((0, 100))),
    ] {
        ledger.apply_pod(&pod);
    }
    extender_over(ledger)
}

fn meta(uids: &[&str], pdb: i64) -> Value {
    json!({"Pods": uids.iter().map(|uid| json!({"UID": uid})).collect::<Vec<_>>(), "NumPDBViolations": pdb})
}

fn preempt(extender: &Extender, args: Value) -> Value {
    let args: ExtenderPreemptionArgs = serde_json::from_value(args).expect("args");
    serde_json::to_value(extender.preempt(args)).expect("json")
}

/// The dry run, counting GPU capacity in aggregate, evicts cpu-hog (for CPU), b
/// and c: on n1 the answer is cpu-hog with a and b (the pods on GPU 0, which the
/// pod gets), never c (GPU 1 stays held by h). n2 (only a priority-100 pod) and
/// n3 (no Device CR) are left out. kube-scheduler's field names; the most
/// important victim first; its PDB count passed on.
#[test]
fn victims_are_chosen_per_gpu_and_hopeless_nodes_left_out() {
    let extender = cluster();
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu": "100"})),
            "NodeNameToMetaVictims": {
                "n1": meta(&["cpu-hog", "c", "b"], 1),
                "n2": meta(&["h2"], 0),
                "n3": meta(&["x"], 0)}}),
    );
    assert_eq!(
        answer,
        json!({"NodeNameToMetaVictims": {"n1": meta(&["cpu-hog", "a", "b"], 1)}})
    );
    // Without nodeCacheCapable kube-scheduler sends whole pods: the same answer.
    let pods = |uids: &[&str]| -> Vec<Value> {
        uids.iter()
            .map(|uid| json!({"metadata": {"name": uid, "namespace": "default", "uid": uid}}))
            .collect()
    };
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu": "100"})),
            "NodeNameToVictims": {"n1": {"Pods": pods(&["cpu-hog", "c", "b"]), "NumPDBViolations": 1}}}),
    );
    assert_eq!(
        answer,
        json!({"NodeNameToMetaVictims": {"n1": meta(&["cpu-hog", "a", "b"], 1)}})
    );
}

/// Half a GPU fits after evicting one pod; a node where it fits already and the
/// dry run chose only GPU pods elsewhere is left out (nothing there needs to go).
#[test]
fn one_victim_for_half_a_gpu_and_none_where_it_fits() {
    let extender = cluster();
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu": "50"})),
            "NodeNameToMetaVictims": {"n1": meta(&["a", "b", "c"], 0)}}),
    );
    let victims = &answer["NodeNameToMetaVictims"]["n1"]["Pods"];
    assert_eq!(victims.as_array().map(Vec::len), Some(1), "{answer}");
    extender.ledger().delete_pod("a");
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu": "50"})),
            "NodeNameToMetaVictims": {"n1": meta(&["b", "c"], 0)}}),
    );
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
}

/// A pod asking no GPU: the dry run's answer stands. An invalid request or an
/// unsynced cache: no node (kube-scheduler then evicts nothing).
#[test]
fn no_gpu_request_keeps_the_dry_run_doubt_leaves_every_node_out() {
    let extender = cluster();
    let dry_run = json!({"n1": meta(&["cpu-hog"], 0)});
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"cpu": "1"})), "NodeNameToMetaVictims": dry_run}),
    );
    assert_eq!(answer, json!({"NodeNameToMetaVictims": dry_run}));
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu-core": "150"})),
            "NodeNameToMetaVictims": {"n1": meta(&["a", "b"], 0)}}),
    );
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
    extender.ready.store(false, Ordering::SeqCst);
    let answer = preempt(
        &extender,
        json!({"Pod": preemptor(json!({"koordinator.sh/gpu": "100"})),
            "NodeNameToMetaVictims": {"n1": meta(&["a", "b"], 0)}}),
    );
    assert_eq!(answer, json!({"NodeNameToMetaVictims": {}}));
}
