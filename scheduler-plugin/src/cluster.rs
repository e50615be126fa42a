//! The cluster view: kube-rs reflectors over Device CRs and Pods whose events
//! also keep the [`Ledger`] current. On a (re)list the ledger is rebuilt from
//! what the list holds, so a restarted scheduler starts from the pods' annotations.
//!
//! Readiness: the view is ready only while every watch has listed and is live. A
//! relist makes it not ready until the list is done; a watch error ends the watch
//! and, after a backoff, starts a relist (so a watch that died and came back proves
//! it with a complete list, not with silence). [`synced_after`] decides it.
//!
//! Memory: the Pod store holds every pod of the cluster, so each pod is trimmed
//! ([`trim_pod`]) as it comes off the watch, before the store or the ledger sees it:
//! only what the ledger, bind and the request parser read is kept.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tessera_api::Device;

use tessera_allocator::ledger::Ledger;

/// Readers of the reflectors and readiness.
#[derive(Debug, Clone)]
pub struct ClusterView {
    /// Pods, for bind (the extender's bind args carry only names).
    pub pods: Store<Pod>,
    /// Device CRs.
    pub devices: Store<Device>,
    /// True while every watch has listed and is live (false at start, during a
    /// relist, after a watch error until its relist is done).
    pub ready: Arc<AtomicBool>,
}

use tessera_daemon::sync::lock;

/// How one kind of object feeds the ledger.
trait Feed:
    kube::Resource + Clone + std::fmt::Debug + Send + Sync + serde::de::DeserializeOwned + 'static
{
    /// The ledger's key of an object (node name, pod UID).
    fn key(&self) -> Option<String>;
    /// Added or changed.
    fn apply(&self, ledger: &mut Ledger);
    /// Deleted.
    fn delete(key: &str, ledger: &mut Ledger);
    /// After a relist: forget what was not listed.
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger);
    /// Drops what no reader of the store or the ledger needs, as the object comes
    /// off the watch.
    fn trim(&mut self) {}
    /// Whether `self`, trimmed, says to the ledger what `other` (the stored
    /// version) did: then the update is not applied again.
    fn same(&self, _other: &Self) -> bool {
        false
    }
}

impl Feed for Device {
    fn key(&self) -> Option<String> {
        self.metadata.name.clone()
    }
    fn apply(&self, ledger: &mut Ledger) {
        ledger.apply_device(self);
    }
    fn delete(key: &str, ledger: &mut Ledger) {
        ledger.delete_device(key);
    }
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger) {
        ledger.retain_devices(seen);
    }
    /// Drops the containers' GPU memory (`tessera.io/gpu-memory-used`, for
    /// `tessera inspect`), which no scheduler reads and which changes far more
    /// often than the GPUs, and the managed fields.
    fn trim(&mut self) {
        self.metadata.managed_fields = None;
        if let Some(annotations) = &mut self.metadata.annotations {
            annotations.remove(tessera_api::usage::DEVICE_ANNOTATION);
        }
    }
    fn same(&self, other: &Self) -> bool {
        self.metadata.annotations == other.metadata.annotations
            && self.metadata.labels == other.metadata.labels
            && self.spec == other.spec
    }
}

impl Feed for Pod {
    fn key(&self) -> Option<String> {
        self.metadata.uid.clone()
    }
    fn apply(&self, ledger: &mut Ledger) {
        ledger.apply_pod(self);
    }
    fn delete(key: &str, ledger: &mut Ledger) {
        ledger.delete_pod(key);
    }
    fn retain(seen: &HashSet<String>, ledger: &mut Ledger) {
        ledger.retain_pods(seen);
    }
    fn trim(&mut self) {
        trim_pod(self);
    }
}

/// An annotation kubectl writes with the whole manifest in it; nothing here reads it.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Keeps of a pod only what the scheduler reads from its Pod store: names, UID and
/// resourceVersion (bind's preconditions), deletion state, annotations (the
/// allocation, GPU selection and sharing-group hints; not kubectl's copy of the
/// manifest), node, priority and scheduler, each container's name, resources and
/// restart policy (the request parser, sidecar init containers), and the phase and
/// nominated node. Dropped: managed fields, labels, owners, images, commands, env,
/// mounts, probes, volumes, affinity, tolerations, conditions and container
/// statuses: most of a pod's bytes, and nothing here reads them.
pub fn trim_pod(pod: &mut Pod) {
    let metadata = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta {
        name: metadata.name,
        namespace: metadata.namespace,
        uid: metadata.uid,
        resource_version: metadata.resource_version,
        deletion_timestamp: metadata.deletion_timestamp,
        deletion_grace_period_seconds: metadata.deletion_grace_period_seconds,
        annotations: metadata
            .annotations
            .map(|mut annotations| {
                annotations.remove(LAST_APPLIED);
                annotations
            })
            .filter(|annotations| !annotations.is_empty()),
        ..ObjectMeta::default()
    };
    let trim_container = |container: Container| Container {
        name: container.name,
        resources: container.resources,
        restart_policy: container.restart_policy,
        ..Container::default()
    };
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        priority: spec.priority,
        preemption_policy: spec.preemption_policy,
        scheduler_name: spec.scheduler_name,
        containers: spec.containers.into_iter().map(trim_container).collect(),
        init_containers: spec
            .init_containers
            .map(|containers| containers.into_iter().map(trim_container).collect()),
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        nominated_node_name: status.nominated_node_name,
        ..PodStatus::default()
    });
}

/// How many watches must be synced for the view to be ready.
const WATCHES: usize = 2;

/// Whether a watch is synced after `event`: `Some(false)` when a relist starts or
/// the watch failed, `Some(true)` when a list is complete, `None` when unchanged.
pub fn synced_after<K>(event: &Result<watcher::Event<K>, watcher::Error>) -> Option<bool> {
    match event {
        Ok(watcher::Event::Init) | Err(_) => Some(false),
        Ok(watcher::Event::InitDone) => Some(true),
        Ok(_) => None,
    }
}

/// Per-watch sync state; `ready` is true when all are synced.
#[derive(Debug)]
struct Readiness {
    synced: Mutex<[bool; WATCHES]>,
    ready: Arc<AtomicBool>,
}

impl Readiness {
    fn set(&self, watch: usize, synced: bool) {
        let mut all = lock(&self.synced);
        all[watch] = synced;
        let ready = all.iter().all(|s| *s);
        if self.ready.swap(ready, Ordering::SeqCst) != ready {
            tracing::info!(ready, "cluster cache readiness changed");
        }
    }
}

/// Shortest and longest wait before a relist after a watch error.
const RELIST_BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// Runs a reflector over every `K` and applies its events to the ledger; returns its store.
fn follow<K>(
    client: Client,
    ledger: Arc<Mutex<Ledger>>,
    readiness: Arc<Readiness>,
    watch: usize,
) -> Store<K>
where
    K: Feed<DynamicType = ()>,
{
    let (reader, mut writer) = reflector::store::<K>();
    let stored = reader.clone();
    let api = Api::<K>::all(client);
    tokio::spawn(async move {
        let mut seen = HashSet::new();
        let mut backoff = RELIST_BACKOFF.0;
        loop {
            let mut stream =
                std::pin::pin!(watcher(api.clone(), watcher::Config::default()).modify(K::trim));
            while let Some(event) = stream.next().await {
                if let Some(synced) = synced_after(&event) {
                    readiness.set(watch, synced);
                }
                let event = match event {
                    Ok(event) => event,
                    Err(error) => {
                        tracing::warn!(kind = %K::kind(&()), %error, ?backoff, "watch failed; relisting");
                        break;
                    }
                };
                // A Device whose update changed only what trimming drops (its
                // containers' GPU memory): the ledger is not recomputed for it.
                let unchanged = match &event {
                    watcher::Event::Apply(object) => stored
                        .get(&reflector::ObjectRef::from_obj(object))
                        .is_some_and(|stored| object.same(&stored)),
                    _ => false,
                };
                writer.apply_watcher_event(&event);
                match event {
                    watcher::Event::Init => seen.clear(),
                    watcher::Event::InitApply(object) | watcher::Event::Apply(object) => {
                        seen.extend(object.key());
                        if !unchanged {
                            object.apply(&mut lock(&ledger));
                        }
                    }
                    watcher::Event::Delete(object) => {
                        if let Some(key) = object.key() {
                            K::delete(&key, &mut lock(&ledger));
                        }
                    }
                    watcher::Event::InitDone => {
                        K::retain(&seen, &mut lock(&ledger));
                        backoff = RELIST_BACKOFF.0;
                    }
                }
            }
            readiness.set(watch, false);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RELIST_BACKOFF.1);
        }
    });
    reader
}

/// Starts the watches; they run until the process ends, retrying with backoff.
pub fn watch(client: Client, ledger: Arc<Mutex<Ledger>>) -> ClusterView {
    let ready = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(Readiness {
        synced: Mutex::new([false; WATCHES]),
        ready: Arc::clone(&ready),
    });
    let devices = follow::<Device>(
        client.clone(),
        Arc::clone(&ledger),
        Arc::clone(&readiness),
        0,
    );
    let pods = follow::<Pod>(client, ledger, readiness, 1);
    ClusterView {
        pods,
        devices,
        ready,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_update_of_only_its_containers_gpu_memory_is_not_applied_again() {
        let device = |used: &str, healthy: bool| -> Device {
            let mut device: Device = serde_json::from_value(serde_json::json!({
                "apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
                "metadata": {"name": "n1", "resourceVersion": used,
                             "annotations": {"tessera.io/gpu-memory-used": used, "tessera.io/enforcement": "mps"}},
                "spec": {"devices": [{"type": "gpu", "id": "GPU-a", "minor": 0, "health": healthy}]}
            }))
            .expect("device");
            Feed::trim(&mut device);
            device
        };
        let before = device("1", true);
        assert!(
            before
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| !a.contains_key(tessera_api::usage::DEVICE_ANNOTATION)
                    && a.contains_key("tessera.io/enforcement"))
        );
        assert!(device("2", true).same(&before));
        assert!(!device("2", false).same(&before));
    }

    #[test]
    fn a_watch_is_synced_from_a_complete_list_until_a_relist_or_an_error() {
        let event = |e: watcher::Event<Pod>| synced_after(&Ok(e));
        assert_eq!(event(watcher::Event::Init), Some(false));
        assert_eq!(event(watcher::Event::InitApply(Pod::default())), None);
        assert_eq!(event(watcher::Event::InitDone), Some(true));
        assert_eq!(event(watcher::Event::Apply(Pod::default())), None);
        assert_eq!(event(watcher::Event::Delete(Pod::default())), None);
        let failed: Result<watcher::Event<Pod>, _> = Err(watcher::Error::NoResourceVersion);
        assert_eq!(synced_after(&failed), Some(false));
    }

    /// A pod as the API server serves it (`kubectl get pod -o json` of a Deployment's
    /// pod, bound and running, with a GPU share and kubectl's last-applied copy).
    const SERVED_POD: &str = r#"{
      "apiVersion": "v1", "kind": "Pod",
      "metadata": {
        "name": "train-7d9f8b6c5-x2x7q", "generateName": "train-7d9f8b6c5-", "namespace": "ml",
        "uid": "6f1f7c2e-8a4b-4c0e-9d55-0c1f2b3a4d5e", "resourceVersion": "912345",
        "creationTimestamp": "2026-11-20T08:00:00Z",
        "labels": {"app": "train", "pod-template-hash": "7d9f8b6c5"},
        "annotations": {
          "scheduling.koordinator.sh/device-allocated": "{\"gpu\":[{\"minor\":1,\"id\":\"GPU-b\",\"resources\":{\"koordinator.sh/gpu-core\":50,\"koordinator.sh/gpu-memory-ratio\":50}}]}",
          "nvidia.com/use-gputype": "A100",
          "kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"apps/v1\",\"kind\":\"Deployment\",\"metadata\":{\"name\":\"train\",\"namespace\":\"ml\"},\"spec\":{\"replicas\":4,\"template\":{\"spec\":{\"containers\":[{\"name\":\"main\",\"image\":\"registry.example.com/ml/train:2026.11\"}]}}}}"
        },
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "train-7d9f8b6c5", "uid": "0b0f", "controller": true, "blockOwnerDeletion": true}],
        "managedFields": [
          {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1", "time": "2026-11-20T08:00:00Z", "fieldsType": "FieldsV1",
           "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:image": {}, "f:env": {}}}}}},
          {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": "2026-11-20T08:00:05Z", "fieldsType": "FieldsV1", "subresource": "status",
           "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {}, "f:hostIP": {}, "f:phase": {}, "f:podIP": {}, "f:startTime": {}}}}
        ]
      },
      "spec": {
        "nodeName": "n1", "priority": 1000, "schedulerName": "default-scheduler", "serviceAccountName": "default",
        "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["sh", "-c", "wget -O /data/model http://models/x"],
          "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "containers": [
          {"name": "main", "image": "registry.example.com/ml/train:2026.11", "command": ["python", "train.py"], "args": ["--epochs", "90"],
           "env": [{"name": "EPOCHS", "value": "90"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
           "resources": {"limits": {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "cpu": "4", "memory": "16Gi"},
                         "requests": {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "cpu": "2", "memory": "8Gi"}},
           "volumeMounts": [{"name": "data", "mountPath": "/data"}, {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}],
           "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10},
           "terminationMessagePath": "/dev/termination-log", "imagePullPolicy": "IfNotPresent"},
          {"name": "sidecar", "image": "registry.example.com/log-shipper:1.2", "resources": {"requests": {"cpu": "100m"}}}
        ],
        "volumes": [{"name": "data", "emptyDir": {}},
          {"name": "kube-api-access-abcde", "projected": {"sources": [{"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}],
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
      },
      "status": {
        "phase": "Running", "hostIP": "10.0.0.7", "podIP": "10.88.0.12", "startTime": "2026-11-20T08:00:01Z", "qosClass": "Burstable",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-20T08:00:05Z"},
                       {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-20T08:00:00Z"}],
        "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0, "image": "registry.example.com/ml/train:2026.11",
          "imageID": "registry.example.com/ml/train@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
          "containerID": "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
          "state": {"running": {"startedAt": "2026-11-20T08:00:04Z"}}}]
      }
    }"#;

    fn served_pod() -> Pod {
        serde_json::from_str(SERVED_POD).expect("the fixture is a pod")
    }

    /// Every reader of the Pod store and the ledger sees the same in a trimmed pod
    /// as in the served one, and most of the bytes are gone.
    #[test]
    fn a_trimmed_pod_keeps_what_the_scheduler_reads() {
        use tessera_allocator::ledger::holds_devices;
        use tessera_api::request::{RequestOptions, pod_gpu_request};

        let full = served_pod();
        let mut trimmed = full.clone();
        <Pod as Feed>::trim(&mut trimmed);

        let options = RequestOptions::default();
        let request = pod_gpu_request(&full, &options).expect("valid");
        assert!(request.is_some());
        assert_eq!(pod_gpu_request(&trimmed, &options).expect("valid"), request);
        assert_eq!(holds_devices(&trimmed), holds_devices(&full));
        assert_eq!(Feed::key(&trimmed), Feed::key(&full));
        for (uid, node) in [
            (full.metadata.uid.as_deref().unwrap_or(""), "n1"),
            ("other", "n2"),
        ] {
            assert_eq!(
                format!("{:?}", crate::bind::decide(&trimmed, uid, node, true)),
                format!("{:?}", crate::bind::decide(&full, uid, node, true))
            );
        }
        assert_eq!(
            tessera_allocator::upgrade::upgraded_annotation(&trimmed),
            tessera_allocator::upgrade::upgraded_annotation(&full)
        );
        assert_eq!(trimmed.metadata.resource_version.as_deref(), Some("912345"));
        let spec = trimmed.spec.as_ref().expect("spec");
        assert_eq!(
            (spec.priority, spec.node_name.as_deref()),
            (Some(1000), Some("n1"))
        );

        // The ledger books the same from either.
        let device: Device = serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device", "metadata": {"name": "n1"},
            "spec": {"devices": [
                {"type": "gpu", "id": "GPU-a", "minor": 0, "health": true, "resources": {"koordinator.sh/gpu-memory": "85899345920"}},
                {"type": "gpu", "id": "GPU-b", "minor": 1, "health": true, "resources": {"koordinator.sh/gpu-memory": "85899345920"}}]}
        }))
        .expect("a device");
        let booked = |pod: &Pod| {
            let mut ledger = Ledger::default();
            ledger.apply_device(&device);
            ledger.apply_pod(pod);
            ledger.node("n1").cloned()
        };
        assert_eq!(booked(&trimmed), booked(&full));
        assert_eq!(booked(&full).expect("node").gpus[1].core_used, 50);

        // What is gone.
        let annotations = trimmed.metadata.annotations.as_ref().expect("annotations");
        assert!(!annotations.contains_key(LAST_APPLIED));
        assert!(annotations.contains_key("nvidia.com/use-gputype"));
        assert!(trimmed.metadata.managed_fields.is_none() && trimmed.metadata.labels.is_none());
        assert!(spec.volumes.is_none() && spec.containers[0].env.is_none());
        assert!(
            trimmed
                .status
                .as_ref()
                .is_some_and(|s| s.conditions.is_none())
        );
        let size = |pod: &Pod| serde_json::to_vec(pod).expect("encodes").len();
        assert!(
            size(&trimmed) * 4 < size(&full),
            "trimmed {} bytes of {}",
            size(&trimmed),
            size(&full)
        );
    }

    /// Deletion state and sidecar init containers survive the trim: a deleted pod's
    /// GPUs and a sidecar's request are still seen.
    #[test]
    fn a_trimmed_pod_keeps_deletion_state_and_sidecars() {
        let mut pod = served_pod();
        pod.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-11-20T09:00:00Z".parse().expect("a time"),
            ));
        let spec = pod.spec.as_mut().expect("spec");
        let init = &mut spec.init_containers.as_mut().expect("init")[0];
        init.restart_policy = Some("Always".into());
        init.resources = spec.containers[0].resources.clone();
        let full = pod.clone();
        trim_pod(&mut pod);
        assert!(pod.metadata.deletion_timestamp.is_some());
        let init = &pod
            .spec
            .as_ref()
            .expect("spec")
            .init_containers
            .as_ref()
            .expect("init")[0];
        assert_eq!(init.restart_policy.as_deref(), Some("Always"));
        let options = tessera_api::request::RequestOptions::default();
        assert_eq!(
            tessera_api::request::pod_gpu_request(&pod, &options).expect("valid"),
            tessera_api::request::pod_gpu_request(&full, &options).expect("valid")
        );
    }

    #[test]
    fn ready_only_while_every_watch_is_synced() {
        let readiness = Readiness {
            synced: Mutex::new([false; WATCHES]),
            ready: Arc::new(AtomicBool::new(false)),
        };
        readiness.set(0, true);
        assert!(!readiness.ready.load(Ordering::SeqCst));
        readiness.set(1, true);
        assert!(readiness.ready.load(Ordering::SeqCst));
        readiness.set(1, false);
        assert!(!readiness.ready.load(Ordering::SeqCst));
    }
}
