//! Prometheus metrics of tessera-scheduler, served by `serve --metrics-listen`
//! (OpenMetrics text, `GET /metrics`) on a listener of its own: never the extender's
//! authenticated port, whose callers are kube-scheduler and the other replicas.
//!
//! Counters and histograms are updated on the request path; what the scheduler holds
//! (GPU use per node, reservations, cache readiness, leadership) is read from the
//! ledger, the readiness flag and the leader view at each scrape by [`StateCollector`],
//! so it is never stale and the request path pays nothing for it.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tessera_daemon::metrics::{HistogramFamily, LatencyBuckets, register};

use crate::bind::BindError;
use crate::leader::Leader;
use tessera_allocator::ledger::Ledger;

/// Default metrics endpoint: all interfaces, as the scheduler runs in a pod whose own
/// network namespace only its pod IP reaches (Prometheus scrapes the pod). 9466: after
/// the proxy's 9464 and the reporter's 9465, so one node can run all three; apart from
/// the extender's 8888 (mutual TLS) and the probes' 8889.
pub const DEFAULT_METRICS_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9466));

/// An extender call kube-scheduler makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    /// `POST /filter`.
    Filter,
    /// `POST /prioritize`.
    Prioritize,
    /// `POST /bind`.
    Bind,
    /// `POST /preempt` (kube-scheduler's preemption asks which victims free GPUs).
    Preempt,
}

impl Verb {
    /// The verb a request path names (`<urlPrefix>/<verb>`), if it is one of ours.
    pub fn of(verb: &str) -> Option<Self> {
        match verb {
            "filter" => Some(Self::Filter),
            "prioritize" => Some(Self::Prioritize),
            "bind" => Some(Self::Bind),
            "preempt" => Some(Self::Preempt),
            _ => None,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Filter => "filter",
            Self::Prioritize => "prioritize",
            Self::Bind => "bind",
            Self::Preempt => "preempt",
        }
    }
}

/// How one bind ended, as this replica saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindResult {
    /// The pod is bound: placed now, or found bound already to that node.
    Bound,
    /// A follower handed the bind to the leader, which bound the pod.
    Forwarded,
    /// Nothing was written because the bind would be wrong or unsafe: the request
    /// does not fit, the cache is not synced, this replica does not lead.
    Refused,
    /// A call to the API server (or the hand-over to the leader) failed.
    Failed,
}

impl BindResult {
    fn label(self) -> &'static str {
        match self {
            Self::Bound => "bound",
            Self::Forwarded => "forwarded",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }
}

/// The `error` label of a bind error, and whether it is a refusal or a failure.
/// Exhaustive on purpose: a new [`BindError`] variant must be classified here.
pub fn classify(error: &BindError) -> (&'static str, BindResult) {
    use BindResult::{Failed, Refused};
    match error {
        BindError::NotSynced => ("not_synced", Refused),
        BindError::NotLeader => ("not_leader", Refused),
        BindError::LeadershipLost => ("leadership_lost", Refused),
        BindError::UidMismatch { .. } => ("uid_mismatch", Refused),
        BindError::Request(_) => ("invalid_request", Refused),
        BindError::BoundElsewhere { .. } => ("bound_elsewhere", Refused),
        BindError::BoundWithoutAllocation { .. } => ("bound_without_allocation", Refused),
        BindError::NoDevice { .. } => ("no_device", Refused),
        BindError::Unfit { .. } => ("unfit", Refused),
        BindError::Forward { .. } => ("forward", Failed),
        BindError::NoClient => ("no_client", Failed),
        BindError::Read(_) => ("read", Failed),
        BindError::Bind { .. } => ("binding", Failed),
        BindError::BindUnconfirmed { .. } => ("bind_unconfirmed", Failed),
        BindError::BindPending { .. } => ("bind_pending", Failed),
    }
}

/// Labels of `tessera_scheduler_request_duration_seconds`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    /// `filter`, `prioritize`, `bind` or `preempt`.
    pub verb: String,
}

/// Labels of `tessera_scheduler_binds_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BindLabels {
    /// `bound`, `forwarded`, `refused` or `failed`.
    pub result: String,
}

/// Labels of `tessera_scheduler_bind_errors_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BindErrorLabels {
    /// The step or reason, e.g. `unfit`, `not_leader`, `annotate` (see [`classify`]).
    pub error: String,
    /// `refused` or `failed`.
    pub result: String,
}

/// Labels of `tessera_scheduler_events_total`.
pub use tessera_daemon::events::EventLabels;

/// 100 µs .. ~3.3 s: filter over thousands of nodes is milliseconds; a bind is
/// two or three API calls, and kube-scheduler gives up at 5 s.
const LATENCY: LatencyBuckets = LatencyBuckets {
    start: 0.000_1,
    count: 16,
};

/// What the scheduler holds, read at each scrape.
#[derive(Debug, Clone, Default)]
pub struct SchedulerState {
    /// GPU use per node, reservations included.
    pub ledger: Arc<Mutex<Ledger>>,
    /// Whether every reflector has listed and is live.
    pub ready: Arc<AtomicBool>,
    /// Whether this replica leads.
    pub leader: Arc<Leader>,
    /// When the serving certificate loaded at start expires (Unix seconds); `None`
    /// without mutual TLS.
    pub tls_not_after: Option<i64>,
}

/// Every metric tessera-scheduler exports.
#[derive(Debug)]
pub struct SchedulerMetrics {
    registry: Arc<Registry>,
    /// `tessera_scheduler_request_duration_seconds{verb}`: extender calls, from the
    /// request's body read to the answer.
    pub request_duration: HistogramFamily<VerbLabels>,
    /// `tessera_scheduler_binds_total{result}`.
    pub binds: Family<BindLabels, Counter>,
    /// `tessera_scheduler_bind_errors_total{error,result}`: refused and failed binds by cause.
    pub bind_errors: Family<BindErrorLabels, Counter>,
    /// `tessera_scheduler_reservations_expired_total`: in-flight allocations given
    /// back because their bind did not finish within `--reservation-ttl`.
    pub reservations_expired: Counter,
    /// `tessera_scheduler_events_total{reason,outcome}`: Kubernetes Events on pods.
    pub events: Family<EventLabels, Counter>,
}

impl Default for SchedulerMetrics {
    /// Metrics over an empty state (tests, and an extender built without one).
    fn default() -> Self {
        Self::new(SchedulerState::default())
    }
}

impl SchedulerMetrics {
    /// The metrics, with `state` read at each scrape.
    pub fn new(state: SchedulerState) -> Self {
        let mut registry = Registry::with_prefix("tessera_scheduler");
        let request_duration = register(
            &mut registry,
            "request_duration_seconds",
            "Extender calls (filter, prioritize, bind, preempt) from request to answer",
            HistogramFamily::new_with_constructor(LATENCY),
        );
        let binds = register(&mut registry, "binds", "Binds by result", Family::default());
        let bind_errors = register(
            &mut registry,
            "bind_errors",
            "Refused and failed binds by cause",
            Family::default(),
        );
        let reservations_expired = register(
            &mut registry,
            "reservations_expired",
            "In-flight allocations given back because their bind did not finish in time",
            Counter::default(),
        );
        let events = register(
            &mut registry,
            "events",
            "Kubernetes Events on pods by reason and outcome",
            Family::default(),
        );
        registry.register_collector(Box::new(StateCollector(state)));
        Self {
            registry: Arc::new(registry),
            request_duration,
            binds,
            bind_errors,
            reservations_expired,
            events,
        }
    }

    /// The metrics in the OpenMetrics text format, as the endpoint serves them.
    pub fn encode(&self) -> String {
        tessera_daemon::metrics::encode(&self.registry)
    }

    /// Serves `GET /metrics` on `addr` from a spawned task; returns the bound address.
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        tessera_daemon::metrics::spawn(addr, Arc::clone(&self.registry)).await
    }

    /// Records one extender call of `verb` that took `took`.
    pub fn record_request(&self, verb: Verb, took: Duration) {
        self.request_duration
            .get_or_create(&VerbLabels {
                verb: verb.label().to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts one bind that ended with `result`.
    pub fn record_bind(&self, result: BindResult) {
        self.binds
            .get_or_create(&BindLabels {
                result: result.label().to_owned(),
            })
            .inc();
    }

    /// Counts one bind that ended with `error`, by result and by cause.
    pub fn record_bind_error(&self, error: &BindError) {
        let (cause, result) = classify(error);
        self.record_bind(result);
        self.bind_errors
            .get_or_create(&BindErrorLabels {
                error: cause.to_owned(),
                result: result.label().to_owned(),
            })
            .inc();
    }
}

/// GPU totals of one node, as the gauges show them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeGpuTotals {
    /// GPUs on the node's Device CR.
    pub gpus: u64,
    /// Compute percent allocated, summed over the GPUs (100 = one whole GPU).
    pub core_allocated: u64,
    /// Compute percent free on GPUs that can be given (healthy, not held by a
    /// device-plugin pod).
    pub core_free: u64,
    /// Memory bytes allocated.
    pub memory_allocated: u64,
    /// Memory bytes free on GPUs that can be given.
    pub memory_free: u64,
}

impl NodeGpuTotals {
    /// The totals of `node`'s GPUs (pure).
    pub fn of(node: &tessera_allocator::allocate::NodeState) -> Self {
        let mut totals = Self::default();
        for gpu in &node.gpus {
            totals.gpus += 1;
            totals.core_allocated += gpu.core_used;
            totals.memory_allocated += gpu.memory_used;
            if gpu.healthy && !gpu.legacy {
                totals.core_free += 100u64.saturating_sub(gpu.core_used);
                totals.memory_free += gpu.memory_total.saturating_sub(gpu.memory_used);
            }
        }
        totals
    }
}

/// Labels of the per-node gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

/// Labels of `tessera_scheduler_reservations`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

/// A per-node gauge: its name, its help, and how it reads a node's totals.
type NodeGauge = (&'static str, &'static str, fn(&NodeGpuTotals) -> u64);

/// Reads [`SchedulerState`] at each scrape.
#[derive(Debug)]
struct StateCollector(SchedulerState);

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(value);
    let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
    gauge.encode(metric)
}

fn as_gauge(value: impl TryInto<i64>) -> i64 {
    value.try_into().unwrap_or(i64::MAX)
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let SchedulerState {
            ledger,
            ready,
            leader,
            tls_not_after,
        } = &self.0;
        if let Some(not_after) = tls_not_after {
            gauge(
                &mut encoder,
                "tls_certificate_expiry_timestamp_seconds",
                "When the extender's serving certificate (loaded at start) expires, in Unix seconds",
                *not_after,
            )?;
        }
        gauge(
            &mut encoder,
            "cache_synced",
            "1 while every watch of the cluster cache has listed and is live",
            i64::from(ready.load(Ordering::SeqCst)),
        )?;
        gauge(
            &mut encoder,
            "leader",
            "1 while this replica leads (only the leader binds)",
            i64::from(leader.leading()),
        )?;
        // Copied out under the lock, encoded after: a slow scraper never holds the ledger.
        let (reservations, assumed, mut nodes) = {
            let ledger = tessera_daemon::sync::lock(ledger);
            let nodes: Vec<(String, NodeGpuTotals)> = ledger
                .nodes()
                .map(|node| (node.name.clone(), NodeGpuTotals::of(node)))
                .collect();
            (ledger.in_flight(), ledger.assumed(), nodes)
        };
        nodes.sort_by(|a, b| a.0.cmp(&b.0));
        let phases = [
            ("in_flight", reservations.saturating_sub(assumed)),
            ("assumed", assumed),
        ];
        let mut metric = encoder.encode_descriptor(
            "reservations",
            "Allocations made here that no bound pod of the watch shows yet: in_flight (reserved, bind not finished) or assumed (bound, not yet seen bound)",
            None,
            MetricType::Gauge,
        )?;
        for (phase, count) in phases {
            let labels = PhaseLabels {
                phase: phase.to_owned(),
            };
            ConstGauge::new(as_gauge(count)).encode(metric.encode_family(&labels)?)?;
        }
        let per_node: [NodeGauge; 5] = [
            ("node_gpus", "GPUs on the node's Device CR", |t| t.gpus),
            (
                "node_gpu_core_allocated_percent",
                "Compute allocated on the node's GPUs, in percent of one GPU (100 = one whole GPU), in-flight allocations included",
                |t| t.core_allocated,
            ),
            (
                "node_gpu_core_free_percent",
                "Compute free on the node's healthy GPUs not held by device-plugin pods, in percent of one GPU",
                |t| t.core_free,
            ),
            (
                "node_gpu_memory_allocated_bytes",
                "GPU memory allocated on the node, in-flight allocations included",
                |t| t.memory_allocated,
            ),
            (
                "node_gpu_memory_free_bytes",
                "GPU memory free on the node's healthy GPUs not held by device-plugin pods",
                |t| t.memory_free,
            ),
        ];
        for (name, help, value) in per_node {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (node, totals) in &nodes {
                let labels = NodeLabels { node: node.clone() };
                ConstGauge::new(as_gauge(value(totals))).encode(metric.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tessera_daemon::metrics::scrape_openmetrics;

    use super::*;
    use tessera_allocator::allocate::{GpuShare, Placement};

    const GIB: u64 = 1 << 30;

    /// A ledger with node `n1`: two 16 GiB GPUs, the second held by a device-plugin pod.
    fn ledger() -> Ledger {
        let devices: Vec<_> = (0..2)
            .map(|i| {
                json!({"type": "gpu", "id": format!("GPU-n1-{i}"), "minor": i, "health": true,
                "resources": {"koordinator.sh/gpu-memory": (16 * GIB).to_string()}})
            })
            .collect();
        let legacy = json!([{"podUID": "dp", "containerName": "c", "resourceName": "nvidia.com/gpu", "deviceIDs": ["GPU-n1-1"]}]);
        let device = json!({"apiVersion": "scheduling.koordinator.sh/v1alpha1", "kind": "Device",
            "metadata": {"name": "n1", "annotations": {"node.koordinator.sh/devices-checkpoints": legacy.to_string()}},
            "spec": {"devices": devices}});
        let mut ledger = Ledger::default();
        ledger.apply_device(&serde_json::from_value(device).expect("device"));
        ledger
    }

    fn half_of_gpu0() -> Placement {
        Placement {
            gpus: vec![GpuShare {
                uuid: "GPU-n1-0".into(),
                minor: 0,
                core: 50,
                memory: 8 * GIB,
                ratio: 50,
            }],
            group: None,
        }
    }

    fn has(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(text.contains(line), "lacks {line:?}:\n{text}");
        }
    }

    #[test]
    fn state_is_read_at_each_scrape() {
        let state = SchedulerState {
            ledger: Arc::new(Mutex::new(ledger())),
            ready: Arc::new(AtomicBool::new(false)),
            leader: Arc::new(Leader::new(true)),
            tls_not_after: Some(1_900_000_000),
        };
        let metrics = SchedulerMetrics::new(state.clone());
        has(
            &metrics.encode(),
            &[
                "tessera_scheduler_cache_synced 0\n",
                "tessera_scheduler_leader 1\n",
                "tessera_scheduler_node_gpus{node=\"n1\"} 2\n",
                "tessera_scheduler_node_gpu_core_allocated_percent{node=\"n1\"} 0\n",
                // The device-plugin pod's GPU is not free to give.
                "tessera_scheduler_node_gpu_core_free_percent{node=\"n1\"} 100\n",
                "tessera_scheduler_node_gpu_memory_free_bytes{node=\"n1\"} 17179869184\n",
                "tessera_scheduler_reservations{phase=\"in_flight\"} 0\n",
                "tessera_scheduler_reservations{phase=\"assumed\"} 0\n",
                "tessera_scheduler_tls_certificate_expiry_timestamp_seconds 1900000000\n",
            ],
        );
        state.ready.store(true, Ordering::SeqCst);
        state.leader.step_down();
        state
            .ledger
            .lock()
            .expect("ledger")
            .reserve("u-a", "n1", half_of_gpu0(), u64::MAX);
        state
            .ledger
            .lock()
            .expect("ledger")
            .reserve("u-b", "n1", half_of_gpu0(), u64::MAX);
        state.ledger.lock().expect("ledger").assume("u-b");
        has(
            &metrics.encode(),
            &[
                "tessera_scheduler_cache_synced 1\n",
                "tessera_scheduler_leader 0\n",
                "tessera_scheduler_node_gpu_core_allocated_percent{node=\"n1\"} 100\n",
                "tessera_scheduler_node_gpu_core_free_percent{node=\"n1\"} 0\n",
                "tessera_scheduler_node_gpu_memory_allocated_bytes{node=\"n1\"} 17179869184\n",
                "tessera_scheduler_node_gpu_memory_free_bytes{node=\"n1\"} 0\n",
                "tessera_scheduler_reservations{phase=\"in_flight\"} 1\n",
                "tessera_scheduler_reservations{phase=\"assumed\"} 1\n",
            ],
        );
    }

    #[test]
    fn binds_and_calls_are_counted_by_result_cause_and_verb() {
        let metrics = SchedulerMetrics::default();
        metrics.record_bind(BindResult::Bound);
        metrics.record_bind(BindResult::Forwarded);
        metrics.record_bind_error(&BindError::Unfit {
            node: "n1".into(),
            reason: "full".into(),
        });
        metrics.record_bind_error(&BindError::NotLeader);
        metrics.record_bind_error(&BindError::Bind {
            node: "n1".into(),
            source: kube::Error::LinesCodecMaxLineLengthExceeded,
        });
        metrics.record_request(Verb::Bind, Duration::from_millis(3));
        metrics.record_request(Verb::Filter, Duration::from_micros(150));
        metrics.record_request(
            Verb::of("preempt").expect("a verb"),
            Duration::from_millis(1),
        );
        assert_eq!(Verb::of("healthz"), None);
        metrics.reservations_expired.inc();
        let text = metrics.encode();
        has(
            &text,
            &[
                "tessera_scheduler_binds_total{result=\"bound\"} 1\n",
                "tessera_scheduler_binds_total{result=\"forwarded\"} 1\n",
                "tessera_scheduler_binds_total{result=\"refused\"} 2\n",
                "tessera_scheduler_binds_total{result=\"failed\"} 1\n",
                "tessera_scheduler_bind_errors_total{error=\"unfit\",result=\"refused\"} 1\n",
                "tessera_scheduler_bind_errors_total{error=\"not_leader\",result=\"refused\"} 1\n",
                "tessera_scheduler_bind_errors_total{error=\"binding\",result=\"failed\"} 1\n",
                "tessera_scheduler_request_duration_seconds_count{verb=\"bind\"} 1\n",
                "tessera_scheduler_request_duration_seconds_count{verb=\"preempt\"} 1\n",
                "tessera_scheduler_request_duration_seconds_sum{verb=\"filter\"} 0.00015\n",
                "tessera_scheduler_request_duration_seconds_bucket{le=\"0.0002\",verb=\"filter\"} 1\n",
                "tessera_scheduler_reservations_expired_total 1\n",
                "# TYPE tessera_scheduler_node_gpus gauge\n",
            ],
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[tokio::test]
    async fn endpoint_serves_openmetrics() {
        let metrics = SchedulerMetrics::default();
        metrics.record_bind(BindResult::Bound);
        let addr = metrics
            .serve("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let body = scrape_openmetrics(addr).await.expect("scrape");
        assert!(
            body.contains("tessera_scheduler_binds_total{result=\"bound\"} 1\n"),
            "{body}"
        );
    }
}
