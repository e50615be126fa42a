//! Prometheus metrics of the reporter: what it saw on the node and how publishing went.
//! Served by `tessera-reporter run --metrics-addr` (OpenMetrics text).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tessera_api::LegacyDeviceEntry;

/// Default metrics endpoint. All interfaces, because the reporter's usual home is a
/// DaemonSet pod, whose own network namespace only its pod IP reaches; the host
/// systemd unit binds loopback instead. 9465: beside the proxy's 9464.
pub const DEFAULT_METRICS_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9465));

/// What was published.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum PublishedObject {
    /// The node's Device CR.
    Device,
    /// The node's capacity and labels.
    Node,
    /// The node's ResourceSlice (DRA mode).
    Slice,
}

/// How one publish ended.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Written: it had changed.
    Changed,
    /// Nothing to write: the API server already had it.
    Unchanged,
    /// Not written: the API server refused or could not be reached.
    Failed,
}

/// Labels of an enforcement backend.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    /// `driver-memory` or `hami-core`.
    pub backend: String,
}

/// Labels of `tessera_reporter_publishes_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PublishLabels {
    /// `device` or `node`.
    pub object: String,
    /// `changed`, `unchanged` or `failed`.
    pub outcome: String,
}

/// Labels of `tessera_reporter_xid_errors_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XidLabels {
    /// The GPU's UUID (a node has a handful: the cardinality stays small).
    pub gpu: String,
    /// The XID number.
    pub xid: String,
}

/// Labels of `tessera_reporter_events_total`.
pub use tessera_daemon::events::EventLabels;

/// Labels of a container's use of a GPU.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContainerGpuLabels {
    /// Its pod's namespace.
    pub namespace: String,
    /// Its pod.
    pub pod: String,
    /// The container.
    pub container: String,
    /// The GPU's UUID.
    pub gpu: String,
}

/// Every metric the reporter exports.
#[derive(Debug)]
pub struct ReporterMetrics {
    registry: Arc<Registry>,
    /// `tessera_reporter_publishes_total{object,outcome}`.
    pub publishes: Family<PublishLabels, Counter>,
    /// `tessera_reporter_last_publish_timestamp_seconds`: when the Device CR and the
    /// node were last both in place (written or already current).
    pub last_publish: Gauge<f64, AtomicU64>,
    /// `tessera_reporter_gpus`: GPUs NVML reported at the last good discovery.
    pub gpus: Gauge,
    /// `tessera_reporter_unhealthy_gpus`: GPUs published unhealthy (critical XIDs).
    pub unhealthy_gpus: Gauge,
    /// `tessera_reporter_legacy_gpus`: GPUs held by device-plugin pods (kubelet's
    /// checkpoint), as published.
    pub legacy_gpus: Gauge,
    /// `tessera_reporter_legacy_pods`: device-plugin pods holding those GPUs.
    pub legacy_pods: Gauge,
    /// `tessera_reporter_xid_errors_total{gpu,xid}`: XID events NVML reported,
    /// application XIDs (which leave the GPU healthy) included.
    pub xid_errors: Family<XidLabels, Counter>,
    /// `tessera_reporter_discovery_failures_total`: NVML discoveries that failed.
    pub discovery_failures: Counter,
    /// `tessera_reporter_checkpoint_errors_total`: reads of kubelet's checkpoint that
    /// failed or did not parse (the last good one is kept).
    pub checkpoint_errors: Counter,
    /// `tessera_reporter_events_total{reason,outcome}`: Kubernetes Events about GPU
    /// health written on the Node, or not.
    pub events: Family<EventLabels, Counter>,
    /// `tessera_reporter_enforcement{backend}`: 1 for each backend that holds shares on
    /// the node (as tessera-runtime-proxy lists them), 0 for the others.
    pub enforcement: Family<BackendLabels, Gauge>,
    /// `tessera_reporter_container_gpu_memory_used_bytes{namespace,pod,container,gpu}`:
    /// what each container's processes hold of each GPU, per the driver.
    pub gpu_memory_used: Family<ContainerGpuLabels, Gauge>,
    /// `tessera_reporter_container_gpu_memory_limit_bytes{...}`: each shared
    /// container's limit on each GPU.
    pub gpu_memory_limit: Family<ContainerGpuLabels, Gauge>,
    /// `tessera_reporter_container_gpu_ungranted{...}`: 1 for each container on a
    /// GPU it was not granted (a breach).
    pub gpu_ungranted: Family<ContainerGpuLabels, Gauge>,
    /// `tessera_reporter_container_gpu_memory_oom_kills{...}`: the node's OOM kills
    /// of each container's processes on each GPU in the last ten minutes (as the
    /// proxy keeps them).
    pub gpu_memory_oom_kills: Family<ContainerGpuLabels, Gauge>,
}

impl Default for ReporterMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tessera_reporter");
        let metrics = Self {
            registry: Arc::new(Registry::default()),
            publishes: Family::default(),
            last_publish: Gauge::default(),
            gpus: Gauge::default(),
            unhealthy_gpus: Gauge::default(),
            legacy_gpus: Gauge::default(),
            legacy_pods: Gauge::default(),
            xid_errors: Family::default(),
            discovery_failures: Counter::default(),
            checkpoint_errors: Counter::default(),
            events: Family::default(),
            enforcement: Family::default(),
            gpu_memory_used: Family::default(),
            gpu_memory_limit: Family::default(),
            gpu_ungranted: Family::default(),
            gpu_memory_oom_kills: Family::default(),
        };
        registry.register(
            "publishes",
            "Publishes of the Device CR and the node by outcome",
            metrics.publishes.clone(),
        );
        registry.register(
            "last_publish_timestamp_seconds",
            "Unix time the Device CR and the node were last both published or current",
            metrics.last_publish.clone(),
        );
        registry.register(
            "gpus",
            "GPUs NVML reported at the last good discovery",
            metrics.gpus.clone(),
        );
        registry.register(
            "unhealthy_gpus",
            "GPUs published unhealthy after a critical XID",
            metrics.unhealthy_gpus.clone(),
        );
        registry.register(
            "legacy_gpus",
            "GPUs held by device-plugin pods per kubelet's checkpoint, as published",
            metrics.legacy_gpus.clone(),
        );
        registry.register(
            "legacy_pods",
            "Device-plugin pods holding GPUs per kubelet's checkpoint, as published",
            metrics.legacy_pods.clone(),
        );
        registry.register(
            "xid_errors",
            "XID events NVML reported, by GPU and XID",
            metrics.xid_errors.clone(),
        );
        registry.register(
            "discovery_failures",
            "NVML discoveries that failed",
            metrics.discovery_failures.clone(),
        );
        registry.register(
            "checkpoint_errors",
            "Reads of kubelet's device checkpoint that failed or did not parse",
            metrics.checkpoint_errors.clone(),
        );
        registry.register(
            "events",
            "Kubernetes Events about GPU health on the node, by reason and outcome",
            metrics.events.clone(),
        );
        registry.register(
            "enforcement",
            "Enforcement backends holding shares on the node: 1 on, 0 off",
            metrics.enforcement.clone(),
        );
        registry.register(
            "container_gpu_memory_used_bytes",
            "GPU memory each container's processes hold, by GPU, per the driver",
            metrics.gpu_memory_used.clone(),
        );
        registry.register(
            "container_gpu_memory_limit_bytes",
            "GPU memory limit of each shared container, by GPU",
            metrics.gpu_memory_limit.clone(),
        );
        registry.register(
            "container_gpu_ungranted",
            "1 for each container using a GPU it was not granted",
            metrics.gpu_ungranted.clone(),
        );
        registry.register(
            "container_gpu_memory_oom_kills",
            "OOM kills of each container's processes on each GPU in the last ten minutes, for holding more than its grant",
            metrics.gpu_memory_oom_kills.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }
}

impl ReporterMetrics {
    /// Records each container's GPU memory (none when `usage` is unknown): the
    /// series of containers gone go with them.
    pub fn record_gpu_memory(&self, usage: Option<&tessera_api::usage::NodeGpuMemory>) {
        use tessera_api::usage::MemoryGrant;
        self.gpu_memory_used.clear();
        self.gpu_memory_limit.clear();
        self.gpu_ungranted.clear();
        self.gpu_memory_oom_kills.clear();
        for kill in usage.map(|u| u.kills.as_slice()).unwrap_or_default() {
            self.gpu_memory_oom_kills
                .get_or_create(&ContainerGpuLabels {
                    namespace: kill.entry.namespace.clone(),
                    pod: kill.entry.pod.clone(),
                    container: kill.entry.container.clone(),
                    gpu: kill.entry.gpu.clone(),
                })
                .inc();
        }
        for entry in usage.map(|u| u.containers.as_slice()).unwrap_or_default() {
            let labels = ContainerGpuLabels {
                namespace: entry.namespace.clone(),
                pod: entry.pod.clone(),
                container: entry.container.clone(),
                gpu: entry.gpu.clone(),
            };
            let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
            self.gpu_memory_used
                .get_or_create(&labels)
                .set(gauge(entry.used));
            match entry.grant {
                MemoryGrant::Share(limit) => {
                    self.gpu_memory_limit
                        .get_or_create(&labels)
                        .set(gauge(limit));
                }
                MemoryGrant::None => {
                    self.gpu_ungranted.get_or_create(&labels).set(1);
                }
                MemoryGrant::Whole | MemoryGrant::Trusted => {}
            }
        }
    }

    /// Records which backends hold shares on the node.
    pub fn record_enforcement(&self, backends: &[tessera_api::enforcement::Backend]) {
        for backend in tessera_api::enforcement::Backend::ALL {
            self.enforcement
                .get_or_create(&BackendLabels {
                    backend: backend.as_str().to_owned(),
                })
                .set(i64::from(backends.contains(&backend)));
        }
    }
}

fn gauge_value(count: usize) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

impl ReporterMetrics {
    /// The metrics in the OpenMetrics text format, as the endpoint serves them.
    pub fn encode(&self) -> String {
        tessera_daemon::metrics::encode(&self.registry)
    }

    /// Serves `GET /metrics` on `addr` from a spawned task; returns the bound address.
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        tessera_daemon::metrics::spawn(addr, Arc::clone(&self.registry)).await
    }

    /// Counts one publish of `object`.
    pub fn record_publish(&self, object: PublishedObject, outcome: PublishOutcome) {
        let object = match object {
            PublishedObject::Device => "device",
            PublishedObject::Node => "node",
            PublishedObject::Slice => "resourceslice",
        };
        let outcome = match outcome {
            PublishOutcome::Changed => "changed",
            PublishOutcome::Unchanged => "unchanged",
            PublishOutcome::Failed => "failed",
        };
        self.publishes
            .get_or_create(&PublishLabels {
                object: object.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Marks `now` as the last time everything was published.
    pub fn record_published_at(&self, now: SystemTime) {
        let seconds = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.last_publish.set(seconds);
    }

    /// Records what is about to be published: the unhealthy GPUs and the legacy entries.
    pub fn record_published_view(
        &self,
        unhealthy: &BTreeSet<String>,
        legacy: &[LegacyDeviceEntry],
    ) {
        self.unhealthy_gpus.set(gauge_value(unhealthy.len()));
        let gpus: BTreeSet<&str> = legacy
            .iter()
            .flat_map(|e| e.device_ids.iter().map(String::as_str))
            .collect();
        let pods: BTreeSet<&str> = legacy.iter().map(|e| e.pod_uid.as_str()).collect();
        self.legacy_gpus.set(gauge_value(gpus.len()));
        self.legacy_pods.set(gauge_value(pods.len()));
    }

    /// Counts one XID event.
    pub fn record_xid(&self, gpu: &str, xid: u64) {
        self.xid_errors
            .get_or_create(&XidLabels {
                gpu: gpu.to_owned(),
                xid: xid.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(pod: &str, gpus: &[&str]) -> LegacyDeviceEntry {
        LegacyDeviceEntry {
            pod_uid: pod.into(),
            container_name: "app".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_ids: gpus.iter().map(|g| (*g).to_owned()).collect(),
        }
    }

    #[test]
    fn legacy_gpus_and_pods_are_counted_once() {
        let metrics = ReporterMetrics::default();
        metrics.record_published_view(
            &BTreeSet::from(["GPU-2".to_owned()]),
            &[
                legacy("pod-a", &["GPU-0"]),
                legacy("pod-a", &["GPU-1"]),
                // The same GPU twice (two containers' entries): one GPU.
                legacy("pod-b", &["GPU-1"]),
            ],
        );
        metrics.record_publish(PublishedObject::Device, PublishOutcome::Changed);
        metrics.record_publish(PublishedObject::Node, PublishOutcome::Failed);
        metrics.record_xid("GPU-2", 79);
        metrics.record_published_at(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(7));
        let text = metrics.encode();
        for line in [
            "tessera_reporter_legacy_gpus 2\n",
            "tessera_reporter_legacy_pods 2\n",
            "tessera_reporter_unhealthy_gpus 1\n",
            "tessera_reporter_publishes_total{object=\"device\",outcome=\"changed\"} 1\n",
            "tessera_reporter_publishes_total{object=\"node\",outcome=\"failed\"} 1\n",
            "tessera_reporter_xid_errors_total{gpu=\"GPU-2\",xid=\"79\"} 1\n",
            "tessera_reporter_last_publish_timestamp_seconds 7.0\n",
            "tessera_reporter_discovery_failures_total 0\n",
        ] {
            assert!(text.contains(line), "lacks {line:?}:\n{text}");
        }
    }

    #[test]
    fn enforcement_is_one_per_backend_held() {
        use tessera_api::enforcement::Backend;
        let metrics = ReporterMetrics::default();
        metrics.record_enforcement(&[Backend::HamiCore]);
        let text = metrics.encode();
        assert!(
            text.contains("tessera_reporter_enforcement{backend=\"hami-core\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tessera_reporter_enforcement{backend=\"driver-memory\"} 0"),
            "{text}"
        );
    }
}
