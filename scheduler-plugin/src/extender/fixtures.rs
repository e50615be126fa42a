//! Builders the extender's tests share: Device CRs, pods, and an extender over them.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::*;

pub(super) const GIB: u64 = 1 << 30;

/// A Device CR for `node`: one GPU per `(memory GiB, healthy)`, `GPU-<node>-<i>`
/// of minor `i`; GPU indexes in `legacy` are held by a device-plugin pod.
pub(super) fn device(node: &str, gpus: &[(u64, bool)], legacy: &[usize]) -> Value {
    let devices: Vec<Value> = gpus
        .iter()
        .enumerate()
        .map(|(i, &(gib, health))| {
            json!({"type": "gpu", "id": format!("GPU-{node}-{i}"), "minor": i, "health": health,
            "resources": {"koordinator.sh/gpu-memory": (gib * GIB).to_string()}})
        })
        .collect();
    let legacy: Vec<Value> = legacy
        .iter()
        .map(|i| json!({"podUID": "dp", "containerName": "c", "resourceName": "nvidia.com/gpu", "deviceIDs": [format!("GPU-{node}-{i}")]}))
        .collect();
    json!({"apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
        "metadata": {"name": node, "annotations": {"node.koordinator.sh/devices-checkpoints": json!(legacy).to_string()}},
        "spec": {"devices": devices}})
}

/// A Device CR for `node` with `gpus` healthy GPUs of 16 GiB.
pub(super) fn healthy_device(node: &str, gpus: usize) -> Value {
    device(node, &vec![(16, true); gpus], &[])
}

/// Pod `default/p` (UID `u-p`) with `containers`.
pub(super) fn pod(containers: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": "u-p"},
        "spec": {"containers": containers}})
}

/// Pod `default/p` with one container of these limits.
pub(super) fn one_container(limits: Value) -> Value {
    pod(json!([{"name": "main", "image": "x", "resources": {"limits": limits}}]))
}

/// Pod `uid` (its name too) asking `percent` of one GPU.
pub(super) fn share_pod(uid: &str, percent: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": uid, "namespace": "default", "uid": uid},
        "spec": {"containers": [{"name": "main", "image": "x",
            "resources": {"limits": {"koordinator.sh/gpu": percent.to_string()}}}]}})
}

/// Filter or prioritize arguments: `pod` over `nodes` by name.
pub(super) fn args(pod: &Value, nodes: &[&str]) -> ExtenderArgs {
    serde_json::from_value(json!({"Pod": pod, "NodeNames": nodes})).expect("args")
}

/// The names filter lets through for `pod` among `nodes`.
pub(super) fn fitting(extender: &Extender, pod: &Value, nodes: &[&str]) -> Vec<String> {
    extender
        .filter(args(pod, nodes))
        .node_names
        .unwrap_or_default()
}

/// A synced leader's extender over these Device CRs.
pub(super) fn extender(devices: &[Value]) -> Extender {
    let mut ledger = Ledger::default();
    for device in devices {
        ledger.apply_device(&serde_json::from_value(device.clone()).expect("device"));
    }
    extender_over(ledger)
}

/// A synced leader's extender over `ledger`. Its filter answers every node that
/// fits (`candidates` 0), so that tests of fitting see each node's verdict.
pub(super) fn extender_over(ledger: Ledger) -> Extender {
    extender_with(
        ledger,
        ExtenderConfig {
            candidates: 0,
            ..ExtenderConfig::default()
        },
    )
}

/// A synced leader's extender over `ledger`, with `config`.
pub(super) fn extender_with(ledger: Ledger, config: ExtenderConfig) -> Extender {
    Extender::new(
        Arc::new(Mutex::new(ledger)),
        None,
        None,
        config,
        Arc::new(AtomicBool::new(true)),
        Arc::new(Leader::new(true)),
    )
}
