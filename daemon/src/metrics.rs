//! The Prometheus endpoint every daemon serves: `GET /metrics` from a
//! `prometheus-client` registry.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;

/// What [`encode`] writes: `prometheus-client`'s text encoder emits the OpenMetrics
/// 1.0 text format (counter families named without `_total` in `# TYPE`, a closing
/// `# EOF`), which Prometheus parses as OpenMetrics only when told so.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Where a metrics endpoint listens: `HOST:PORT`, or `off`. A string in config files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum MetricsListen {
    /// No metrics endpoint.
    Off,
    /// Serve at this address.
    At(SocketAddr),
}

/// A metrics address that is neither `HOST:PORT` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metrics address {0:?}: expected HOST:PORT (e.g. 127.0.0.1:9464) or off")]
pub struct BadMetricsListen(pub String);

impl MetricsListen {
    /// The address to serve at, if any.
    pub fn addr(self) -> Option<SocketAddr> {
        match self {
            Self::Off => None,
            Self::At(addr) => Some(addr),
        }
    }
}

impl std::str::FromStr for MetricsListen {
    type Err = BadMetricsListen;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "off" {
            return Ok(Self::Off);
        }
        text.parse()
            .map(Self::At)
            .map_err(|_| BadMetricsListen(text.to_owned()))
    }
}

impl std::fmt::Display for MetricsListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::At(addr) => addr.fmt(f),
        }
    }
}

impl TryFrom<String> for MetricsListen {
    type Error = BadMetricsListen;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

/// A connection that has not sent its request headers by then is closed, so idle
/// scrapers cannot pile up connections.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The registry in the OpenMetrics text format ([`CONTENT_TYPE`]).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail; a metric whose own encoder fails leaves
    // what was written so far, which is still better than no answer.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// Binds `addr` and serves `registry` there from a spawned task, returning the
/// bound address (the port when `addr` asked for port 0). Fails only when the
/// address cannot be bound; the caller decides whether that stops the daemon.
pub async fn spawn(addr: SocketAddr, registry: Arc<Registry>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "serving metrics");
    tokio::spawn(serve(listener, registry));
    Ok(bound)
}

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning on the error.
                tracing::warn!(%error, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let response = respond(&registry, request.method(), request.uri().path());
                    async move { response }
                });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond(
    registry: &Registry,
    method: &Method,
    path: &str,
) -> Result<Response<Full<Bytes>>, http::Error> {
    let plain = |status: StatusCode, text: &'static str| {
        Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from_static(text.as_bytes())))
    };
    if path != "/metrics" {
        return plain(
            StatusCode::NOT_FOUND,
            "not found; metrics are at /metrics\n",
        );
    }
    if method != Method::GET && method != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    Response::builder()
        .header(http::header::CONTENT_TYPE, CONTENT_TYPE)
        .body(Full::new(Bytes::from(encode(registry))))
}

/// Latency histograms: exponential buckets from `start` seconds, doubling `count`
/// times. A family's constructor, so each daemon's families state their range once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyBuckets {
    /// The first bucket's upper bound, in seconds.
    pub start: f64,
    /// How many buckets (besides `+Inf`).
    pub count: u16,
}

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(self.start, 2.0, self.count))
    }
}

/// A family of latency histograms, one per label set.
pub type HistogramFamily<L> = Family<L, Histogram, LatencyBuckets>;

/// Registers `metric` in `registry` as `name` with `help`, and returns it: the
/// handle shares its values with the registered copy, so the caller records
/// through it.
pub fn register<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// A plain HTTP/1.1 `GET` of `path` on `addr`, returning the status line and
/// headers, and the body: what the daemons' tests scrape with.
#[doc(hidden)]
pub async fn scrape(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    match text.split_once("\r\n\r\n") {
        Some((head, body)) => Ok((head.to_owned(), body.to_owned())),
        None => Ok((text, String::new())),
    }
}

/// [`scrape`]s `GET /metrics` on `addr` and returns the body when the answer is a
/// 200 in [`CONTENT_TYPE`]; anything else is an `InvalidData` error naming the head.
#[doc(hidden)]
pub async fn scrape_openmetrics(addr: SocketAddr) -> std::io::Result<String> {
    let (head, body) = scrape(addr, "/metrics").await?;
    let content_type = head.lines().find_map(|l| l.strip_prefix("content-type: "));
    if head.starts_with("HTTP/1.1 200") && content_type == Some(CONTENT_TYPE) {
        Ok(body)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("GET /metrics on {addr}: not a 200 in {CONTENT_TYPE}: {head}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[test]
    fn listen_is_an_address_or_off() {
        assert_eq!("off".parse(), Ok(MetricsListen::Off));
        assert_eq!(
            "127.0.0.1:9464"
                .parse::<MetricsListen>()
                .map(MetricsListen::addr),
            Ok(Some(SocketAddr::from(([127, 0, 0, 1], 9464))))
        );
        assert_eq!(
            "[::]:9465"
                .parse::<MetricsListen>()
                .map(MetricsListen::addr),
            Ok(Some(SocketAddr::from(([0u16; 8], 9465))))
        );
        let error = "9464".parse::<MetricsListen>().expect_err("a port alone");
        assert_eq!(
            error.to_string(),
            "metrics address \"9464\": expected HOST:PORT (e.g. 127.0.0.1:9464) or off"
        );
    }

    #[tokio::test]
    async fn serves_openmetrics_with_its_content_type() {
        let mut registry = Registry::with_prefix("tessera_test");
        let calls = Counter::<u64>::default();
        registry.register("calls", "Calls", calls.clone());
        calls.inc();
        let addr = spawn("127.0.0.1:0".parse().expect("addr"), Arc::new(registry))
            .await
            .expect("bind");

        let (head, body) = scrape(addr, "/metrics").await.expect("scrape");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let content_type = head
            .lines()
            .find_map(|l| l.strip_prefix("content-type: "))
            .expect("a content-type header");
        assert_eq!(content_type, CONTENT_TYPE);
        // What makes it OpenMetrics rather than Prometheus 0.0.4 text.
        assert!(
            body.contains("# TYPE tessera_test_calls counter\n"),
            "{body}"
        );
        assert!(body.contains("tessera_test_calls_total 1\n"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");

        let (head, _) = scrape(addr, "/").await.expect("scrape /");
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    }

    #[test]
    fn registered_handles_and_latency_families_record_into_the_registry() {
        let mut registry = Registry::with_prefix("tessera_test");
        let calls = register(&mut registry, "calls", "Calls", Counter::<u64>::default());
        let latency = register(
            &mut registry,
            "latency_seconds",
            "Latency",
            HistogramFamily::<Vec<(String, String)>>::new_with_constructor(LatencyBuckets {
                start: 0.001,
                count: 3,
            }),
        );
        calls.inc();
        latency
            .get_or_create(&vec![("verb".to_owned(), "get".to_owned())])
            .observe(0.003);
        let text = encode(&registry);
        for line in [
            "tessera_test_calls_total 1",
            "tessera_test_latency_seconds_bucket{le=\"0.001\",verb=\"get\"} 0",
            "tessera_test_latency_seconds_bucket{le=\"0.002\",verb=\"get\"} 0",
            "tessera_test_latency_seconds_bucket{le=\"0.004\",verb=\"get\"} 1",
            "tessera_test_latency_seconds_bucket{le=\"+Inf\",verb=\"get\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
        // Three buckets besides +Inf, no more.
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("tessera_test_latency_seconds_bucket"))
                .count(),
            4,
            "{text}"
        );
    }

    #[tokio::test]
    async fn scrape_openmetrics_takes_only_a_200_in_openmetrics() {
        let mut registry = Registry::default();
        register(&mut registry, "calls", "Calls", Counter::<u64>::default());
        let addr = spawn("127.0.0.1:0".parse().expect("addr"), Arc::new(registry))
            .await
            .expect("bind");
        let body = scrape_openmetrics(addr).await.expect("openmetrics");
        assert!(body.ends_with("# EOF\n"), "{body}");

        // A server answering in the Prometheus 0.0.4 text format is refused.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let other = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
            let _ = stream
                .write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\nconnection: close\r\n\r\ncalls_total 0\n",
                )
                .await;
        });
        let error = scrape_openmetrics(other)
            .await
            .expect_err("not openmetrics");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
        assert!(
            error.to_string().contains("text/plain; version=0.0.4"),
            "{error}"
        );
    }
}
