//! Prometheus metrics of the proxy, and the endpoint that serves them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tessera_daemon::metrics::{HistogramFamily, LatencyBuckets, register};

/// Labels of a finished CRI call.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// The CRI method's short name.
    pub method: String,
    /// The gRPC code, e.g. `Ok`, `Unavailable`.
    pub code: String,
}

/// Labels of a CRI method.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// The CRI method's short name.
    pub method: String,
}

/// Labels of one hook stage.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HookLabels {
    /// The hook's name.
    pub hook: String,
    /// `pre` or `post`.
    pub stage: String,
}

/// Labels of a shared container's enforcement.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EnforcementLabels {
    /// The backends that hold its share (`driver-memory+hami-core`, `none`).
    pub enforcement: String,
}

/// 50 µs .. ~1.6 s.
const LATENCY: LatencyBuckets = LatencyBuckets {
    start: 0.000_05,
    count: 16,
};

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// `tessera_proxy_requests_total{method,code}`.
    pub requests: Family<CallLabels, Counter>,
    /// `tessera_proxy_request_duration_seconds{method}`.
    pub request_duration: HistogramFamily<MethodLabels>,
    /// `tessera_proxy_hook_duration_seconds{hook,stage}`.
    pub hook_duration: HistogramFamily<HookLabels>,
    /// `tessera_proxy_hook_failures_total{hook,stage}`.
    pub hook_failures: Family<HookLabels, Counter>,
    /// `tessera_proxy_backend_connects_total`: dials of the runtime socket that succeeded.
    pub backend_connects: Counter,
    /// `tessera_proxy_shared_containers_total{enforcement}`: containers holding part
    /// of a GPU created through the proxy, by the backends that hold their share.
    pub shared_containers: Family<EnforcementLabels, Counter>,
    /// `tessera_proxy_gpu_time_held_containers`: containers held to their share of
    /// GPU time now.
    pub gpu_time_held: Gauge,
    /// `tessera_proxy_gpu_time_frozen_containers`: of those, frozen now.
    pub gpu_time_frozen: Gauge,
    /// `tessera_proxy_gpu_time_freezes_total`: freezes of a container over its share.
    pub gpu_time_freezes: Counter,
    /// `tessera_proxy_gpu_time_frozen_seconds_total`: seconds containers spent
    /// frozen, all added up.
    pub gpu_time_frozen_seconds: Counter<f64, AtomicU64>,
    /// `tessera_proxy_gpu_time_unsampled_gpus`: granted GPUs NVML could not
    /// sample in the last round (their shared containers are not held).
    pub gpu_time_unsampled: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tessera_proxy");
        let requests = register(
            &mut registry,
            "requests",
            "CRI calls by method and gRPC code",
            Family::default(),
        );
        let request_duration = register(
            &mut registry,
            "request_duration_seconds",
            "CRI call latency through the proxy",
            HistogramFamily::new_with_constructor(LATENCY),
        );
        let hook_duration = register(
            &mut registry,
            "hook_duration_seconds",
            "Time spent in hooks",
            HistogramFamily::new_with_constructor(LATENCY),
        );
        let hook_failures = register(
            &mut registry,
            "hook_failures",
            "Hook stages that failed or refused a call",
            Family::default(),
        );
        let backend_connects = register(
            &mut registry,
            "backend_connects",
            "Connections made to the runtime socket",
            Counter::default(),
        );
        let shared_containers = register(
            &mut registry,
            "shared_containers",
            "Containers holding part of a GPU created through the proxy, by the backends holding their share",
            Family::default(),
        );
        let gpu_time_held = register(
            &mut registry,
            "gpu_time_held_containers",
            "Shared containers held to their share of GPU time (gpu-time)",
            Gauge::default(),
        );
        let gpu_time_frozen = register(
            &mut registry,
            "gpu_time_frozen_containers",
            "Shared containers frozen now for using more than their share of GPU time",
            Gauge::default(),
        );
        let gpu_time_freezes = register(
            &mut registry,
            "gpu_time_freezes",
            "Freezes of shared containers over their share of GPU time",
            Counter::default(),
        );
        let gpu_time_frozen_seconds = register(
            &mut registry,
            "gpu_time_frozen_seconds",
            "Seconds shared containers spent frozen for their share of GPU time, added up",
            Counter::<f64, AtomicU64>::default(),
        );
        let gpu_time_unsampled = register(
            &mut registry,
            "gpu_time_unsampled_gpus",
            "GPUs with shared containers held to their GPU time that NVML could not sample in the last round",
            Gauge::default(),
        );
        Self {
            registry: Arc::new(registry),
            requests,
            request_duration,
            hook_duration,
            hook_failures,
            backend_connects,
            shared_containers,
            gpu_time_held,
            gpu_time_frozen,
            gpu_time_freezes,
            gpu_time_frozen_seconds,
            gpu_time_unsampled,
        }
    }
}

impl Metrics {
    /// The GPU-time series from the throttle's totals now and at the last report.
    pub fn record_gpu_time(
        &self,
        now: &tessera_enforce::throttle::Totals,
        before: &tessera_enforce::throttle::Totals,
    ) {
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.gpu_time_held.set(count(now.held));
        self.gpu_time_frozen.set(count(now.frozen));
        self.gpu_time_unsampled.set(count(now.unsampled_gpus));
        self.gpu_time_freezes
            .inc_by(now.freezes.saturating_sub(before.freezes));
        self.gpu_time_frozen_seconds
            .inc_by((now.frozen_seconds - before.frozen_seconds).max(0.0));
    }

    /// The metrics in the OpenMetrics text format, as the endpoint serves them.
    pub fn encode(&self) -> String {
        tessera_daemon::metrics::encode(&self.registry)
    }

    /// `method`'s series, to record many of its calls with [`Metrics::record`].
    pub fn method_series(&self, method: &str) -> MethodSeries {
        MethodSeries {
            method: method.into(),
            ok: self
                .requests
                .get_or_create(&CallLabels {
                    method: method.to_owned(),
                    code: format!("{:?}", tonic::Code::Ok),
                })
                .clone(),
            duration: self
                .request_duration
                .get_or_create(&MethodLabels {
                    method: method.to_owned(),
                })
                .clone(),
        }
    }

    /// Records a finished call of `series`' method, as [`Metrics::record_call`]
    /// does; an `Ok` call without a lookup or an allocation.
    pub fn record(&self, series: &MethodSeries, code: tonic::Code, seconds: f64) {
        if code == tonic::Code::Ok {
            series.ok.inc();
        } else {
            self.requests
                .get_or_create(&CallLabels {
                    method: series.method.to_string(),
                    code: format!("{code:?}"),
                })
                .inc();
        }
        series.duration.observe(seconds);
    }

    /// Records a finished call.
    pub fn record_call(&self, method: &str, code: tonic::Code, seconds: f64) {
        self.requests
            .get_or_create(&CallLabels {
                method: method.to_owned(),
                code: format!("{code:?}"),
            })
            .inc();
        self.request_duration
            .get_or_create(&MethodLabels {
                method: method.to_owned(),
            })
            .observe(seconds);
    }
}

/// The series of one CRI method that every call records (its `Ok` count and its
/// latency), held by whoever records many calls of it: a metric handle shares
/// its value with the family it came from.
#[derive(Debug, Clone)]
pub struct MethodSeries {
    method: std::sync::Arc<str>,
    ok: Counter,
    duration: Histogram,
}

impl MethodSeries {
    /// The method's short name.
    pub fn method(&self) -> &str {
        &self.method
    }
}

/// Serves `GET /metrics` on `addr` from a spawned task (OpenMetrics text, with its
/// content type), returning the bound address.
pub async fn serve(addr: SocketAddr, metrics: &Metrics) -> std::io::Result<SocketAddr> {
    tessera_daemon::metrics::spawn(addr, Arc::clone(&metrics.registry)).await
}

#[cfg(test)]
mod tests {
    use tessera_daemon::metrics::scrape_openmetrics;

    use super::*;

    #[tokio::test]
    async fn endpoint_says_openmetrics_and_writes_it() {
        let metrics = Metrics::default();
        metrics.record_call("Version", tonic::Code::Ok, 0.001);
        let addr = serve("127.0.0.1:0".parse().expect("addr"), &metrics)
            .await
            .expect("bind");
        let body = scrape_openmetrics(addr).await.expect("scrape");
        assert!(
            body.contains("tessera_proxy_requests_total{method=\"Version\",code=\"Ok\"} 1"),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[test]
    fn a_method_series_records_into_the_same_families_as_record_call() {
        let metrics = Metrics::default();
        let series = metrics.method_series("Version");
        metrics.record(&series, tonic::Code::Ok, 0.001);
        metrics.record(&series, tonic::Code::Unavailable, 0.002);
        metrics.record_call("Version", tonic::Code::Ok, 0.003);
        let text = metrics.encode();
        for line in [
            "tessera_proxy_requests_total{method=\"Version\",code=\"Ok\"} 2",
            "tessera_proxy_requests_total{method=\"Version\",code=\"Unavailable\"} 1",
            "tessera_proxy_request_duration_seconds_count{method=\"Version\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
    }
}
