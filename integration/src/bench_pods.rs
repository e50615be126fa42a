//! `tessera-bench pod-cache`: what tessera-scheduler's Pod reflector holds for a
//! cluster's pods, with the pods as served (full objects) and as it keeps them
//! ([`tessera_scheduler::cluster::trim_pod`]). Each variant runs in a process of its
//! own ([`measure`]), so one's freed memory never counts for the other.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{reflector, watcher};
use serde_json::{Value, json};
use tessera_allocator::ledger::Ledger;

/// Pods a node runs in the synthetic cluster (so `pods / PODS_PER_NODE` nodes).
pub const PODS_PER_NODE: usize = 8;
/// Pods per list page, as kube-rs's watcher asks the API server for.
const PAGE: usize = 500;

/// Pod `index` as the API server serves it: a Deployment's pod (`kubectl get pod
/// -o json` shape: managed fields from kube-controller-manager and kubelet, an
/// owner, labels, kubectl's last-applied annotation, an app container with env,
/// probes and mounts, a sidecar, the service-account volume, tolerations, five
/// conditions and container statuses), running on `node-<index / 8>`. Every other
/// pod holds a quarter of a GPU and carries its allocation annotation.
pub fn served_pod(index: usize) -> Value {
    let node = index / PODS_PER_NODE;
    let app = format!("app-{}", index / 40);
    let hash = format!("{:010x}", index / 40 * 2_654_435_761 % 0xff_ffff_ffff);
    let name = format!("{app}-{hash}-{index:05x}");
    let uid = format!("{index:08x}-7d1c-4a8e-9b0f-{index:012x}");
    let time = "2026-11-20T08:00:00Z";
    let gpu = index % 2 == 0;
    let mut annotations = json!({
        "kubectl.kubernetes.io/last-applied-configuration": json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": app, "namespace": "ml", "labels": {"app": app, "team": "vision"}},
            "spec": {"replicas": 40, "selector": {"matchLabels": {"app": app}},
                "template": {"metadata": {"labels": {"app": app}}, "spec": {"containers": [
                    {"name": "main", "image": "registry.example.com/ml/train:2026.11",
                     "args": ["--epochs", "90", "--batch", "256"],
                     "resources": {"limits": {"cpu": "4", "memory": "16Gi"}}}]}}}
        }).to_string(),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9100",
    });
    let mut limits = json!({"cpu": "4", "memory": "16Gi"});
    if gpu {
        let gpu_index = (index / 2) % 8;
        annotations["scheduling.koordinator.sh/device-allocated"] = json!(format!(
            r#"{{"gpu":[{{"minor":{gpu_index},"id":"GPU-{node:05}-{gpu_index:02}","resources":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}},"extension":{{"containers":{{"main":{{"koordinator.sh/gpu-core":25,"koordinator.sh/gpu-memory-ratio":25}}}}}}}}]}}"#
        ));
        limits["koordinator.sh/gpu-core"] = json!("25");
        limits["koordinator.sh/gpu-memory-ratio"] = json!("25");
    }
    let statuses: Vec<Value> = ["main", "log-shipper"]
        .iter()
        .map(|c| {
            json!({
                "name": c, "ready": true, "restartCount": 0, "started": true,
                "image": "registry.example.com/ml/train:2026.11",
                "imageID": format!("registry.example.com/ml/train@sha256:{:064x}", index),
                "containerID": format!("containerd://{:064x}", index * 7 + 1),
                "lastState": {}, "state": {"running": {"startedAt": time}},
                "volumeMounts": [{"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true, "recursiveReadOnly": "Disabled"}]
            })
        })
        .collect();
    let condition = |kind: &str| json!({"type": kind, "status": "True", "lastProbeTime": null, "lastTransitionTime": time});
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "generateName": format!("{app}-{hash}-"), "namespace": "ml", "uid": uid,
            "resourceVersion": (100_000 + index).to_string(), "creationTimestamp": time,
            "labels": {"app": app, "pod-template-hash": hash, "team": "vision"},
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{app}-{hash}"),
                "uid": format!("{:08x}-0000-4000-8000-000000000000", index / 40), "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [
                {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1", "time": time,
                 "fieldsType": "FieldsV1", "fieldsV1": {
                    "f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}, "f:team": {}},
                        "f:ownerReferences": {".": {}, "k:{\"uid\":\"0\"}": {}}},
                    "f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:args": {}, "f:env": {}, "f:image": {},
                        "f:imagePullPolicy": {}, "f:livenessProbe": {}, "f:name": {}, "f:ports": {}, "f:resources": {},
                        "f:terminationMessagePath": {}, "f:terminationMessagePolicy": {}, "f:volumeMounts": {}},
                        "k:{\"name\":\"log-shipper\"}": {".": {}, "f:image": {}, "f:name": {}, "f:resources": {}}},
                        "f:dnsPolicy": {}, "f:enableServiceLinks": {}, "f:restartPolicy": {}, "f:schedulerName": {},
                        "f:securityContext": {}, "f:terminationGracePeriodSeconds": {}, "f:volumes": {}}}},
                {"manager": "tessera-scheduler", "operation": "Update", "apiVersion": "v1", "time": time,
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {"f:scheduling.koordinator.sh/device-allocated": {}}}}},
                {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": time, "subresource": "status",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"ContainersReady\"}": {".": {}, "f:status": {}, "f:type": {}},
                    "k:{\"type\":\"Initialized\"}": {".": {}, "f:status": {}, "f:type": {}}, "k:{\"type\":\"Ready\"}": {".": {}, "f:status": {}, "f:type": {}}},
                    "f:containerStatuses": {}, "f:hostIP": {}, "f:hostIPs": {}, "f:phase": {}, "f:podIP": {}, "f:podIPs": {}, "f:startTime": {}}}}
            ]
        },
        "spec": {
            "nodeName": format!("node-{node:05}"), "priority": 0, "schedulerName": "default-scheduler",
            "serviceAccountName": "default", "serviceAccount": "default", "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst", "enableServiceLinks": true,
            "preemptionPolicy": "PreemptLowerPriority", "securityContext": {},
            "containers": [
                {"name": "main", "image": "registry.example.com/ml/train:2026.11", "imagePullPolicy": "IfNotPresent",
                 "args": ["--epochs", "90", "--batch", "256"],
                 "env": [{"name": "EPOCHS", "value": "90"}, {"name": "DATA_DIR", "value": "/data"},
                         {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                         {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}}],
                 "ports": [{"containerPort": 9100, "name": "metrics", "protocol": "TCP"}],
                 "resources": {"limits": limits.clone(), "requests": limits},
                 "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9100, "scheme": "HTTP"}, "periodSeconds": 10,
                    "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3},
                 "volumeMounts": [{"name": "data", "mountPath": "/data"},
                    {"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                 "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"},
                {"name": "log-shipper", "image": "registry.example.com/infra/log-shipper:1.2.3", "imagePullPolicy": "IfNotPresent",
                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                 "volumeMounts": [{"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
                 "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}
            ],
            "volumes": [{"name": "data", "emptyDir": {}},
                {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        },
        "status": {
            "phase": "Running", "qosClass": "Burstable", "startTime": time,
            "hostIP": "10.0.0.7", "hostIPs": [{"ip": "10.0.0.7"}],
            "podIP": format!("10.88.{}.{}", (index / 250) % 250, index % 250 + 2),
            "podIPs": [{"ip": format!("10.88.{}.{}", (index / 250) % 250, index % 250 + 2)}],
            "conditions": [condition("PodReadyToStartContainers"), condition("Initialized"), condition("Ready"),
                condition("ContainersReady"), condition("PodScheduled")],
            "containerStatuses": statuses
        }
    })
}

/// What one variant of the store held.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct CacheFigures {
    /// Resident memory the pods added (VmRSS after − before), bytes.
    pub rss_added: u64,
    /// Peak resident memory of the process, bytes.
    pub peak: u64,
    /// Pods in the store.
    pub pods: usize,
    /// Mean bytes of a served pod's JSON.
    pub json_bytes: usize,
}

/// Lists `pods` served pods into a reflector store and a ledger the way
/// tessera-scheduler's Pod watch does (page by page: decode, trim when `trim`,
/// store, book), then reports the resident memory they added.
pub fn measure(pods: usize, trim: bool) -> anyhow::Result<CacheFigures> {
    let (reader, mut writer) = reflector::store::<Pod>();
    let mut ledger = Ledger::default();
    let before = status_bytes("VmRSS:")?;
    let mut json_bytes = 0;
    writer.apply_watcher_event(&watcher::Event::Init);
    for page in (0..pods).step_by(PAGE) {
        // The page as bytes off the wire: decoding it is part of what is measured.
        let items: Vec<Value> = (page..(page + PAGE).min(pods)).map(served_pod).collect();
        let body = serde_json::to_vec(&items)?;
        drop(items);
        json_bytes += body.len();
        let decoded: Vec<Pod> = serde_json::from_slice(&body)?;
        drop(body);
        for pod in decoded {
            let mut event = watcher::Event::InitApply(pod);
            if trim {
                event = event.modify(tessera_scheduler::cluster::trim_pod);
            }
            writer.apply_watcher_event(&event);
            if let watcher::Event::InitApply(pod) = &event {
                ledger.apply_pod(pod);
            }
        }
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    let after = status_bytes("VmRSS:")?;
    let figures = CacheFigures {
        rss_added: after.saturating_sub(before),
        peak: status_bytes("VmHWM:")?,
        pods: reader.state().len(),
        json_bytes: json_bytes / pods.max(1),
    };
    drop(ledger);
    Ok(figures)
}

/// utime + stime of a `/proc/…/stat` file, seconds (USER_HZ 100); 0 when it
/// cannot be read (the process is gone).
pub fn cpu_seconds(stat: impl AsRef<std::path::Path>) -> f64 {
    let stat = std::fs::read_to_string(stat).unwrap_or_default();
    // Fields after the command (which may hold spaces) end with ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// A `/proc/self/status` field in bytes.
pub fn status_bytes(field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("/proc/self/status has no {field}"))?;
    Ok(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The served pods decode, and the trim keeps what the ledger books.
    #[test]
    fn served_pods_are_pods_the_ledger_books_trimmed_or_not() {
        for index in [0, 1, 4097] {
            let full: Pod = serde_json::from_value(served_pod(index)).expect("a pod");
            let mut trimmed = full.clone();
            tessera_scheduler::cluster::trim_pod(&mut trimmed);
            let options = tessera_api::request::RequestOptions::default();
            let request = tessera_api::request::pod_gpu_request(&full, &options).expect("valid");
            assert_eq!(request.is_some(), index % 2 == 0);
            assert_eq!(
                tessera_api::request::pod_gpu_request(&trimmed, &options).expect("valid"),
                request
            );
        }
    }
}
