//! Prometheus metrics of the proxy, and the endpoint that serves them.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

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

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

/// Every metric the proxy exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
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
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tessera_proxy");
        let requests = Family::<CallLabels, Counter>::default();
        let request_duration = HistogramFamily::<MethodLabels>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let hook_duration = HistogramFamily::<HookLabels>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let hook_failures = Family::<HookLabels, Counter>::default();
        let backend_connects = Counter::default();
        registry.register(
            "requests",
            "CRI calls by method and gRPC code",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "CRI call latency through the proxy",
            request_duration.clone(),
        );
        registry.register(
            "hook_duration_seconds",
            "Time spent in hooks",
            hook_duration.clone(),
        );
        registry.register(
            "hook_failures",
            "Hook stages that failed or refused a call",
            hook_failures.clone(),
        );
        registry.register(
            "backend_connects",
            "Connections made to the runtime socket",
            backend_connects.clone(),
        );
        Self {
            registry,
            requests,
            request_duration,
            hook_duration,
            hook_failures,
            backend_connects,
        }
    }
}

impl Metrics {
    /// The metrics in Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
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

/// Serves `GET /metrics` on `addr` until the task is dropped.
pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving metrics");
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "metrics accept failed");
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let metrics = Arc::clone(&metrics);
                    async move {
                        let response = if request.uri().path() == "/metrics" {
                            Response::builder()
                                .header(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")
                                .body(Full::new(Bytes::from(metrics.encode())))
                        } else {
                            Response::builder()
                                .status(StatusCode::NOT_FOUND)
                                .body(Full::new(Bytes::from_static(b"not found\n")))
                        };
                        response.map_err(std::io::Error::other)
                    }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
