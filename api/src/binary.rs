//! What every Tessera binary does the same way: logging, the host name, shutdown on
//! signals, and (feature `metrics`) the Prometheus endpoint.

use std::fmt;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::util::SubscriberInitExt;

/// The environment variable a daemon reads for its log format when no
/// `--log-format` flag says otherwise (daemons whose flags predate it read only this).
pub const LOG_FORMAT_ENV: &str = "TESSERA_LOG_FORMAT";

/// How a daemon writes its log lines. Parsed from `text` or `json`, also in config
/// files, where it is a string.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum LogFormat {
    /// One human-readable line per event; colour only on a terminal.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`, `span`,
    /// `spans`), for log collectors.
    Json,
}

/// A `--log-format` value that is neither `text` nor `json`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("log format {0:?}: expected text or json")]
pub struct UnknownLogFormat(pub String);

impl FromStr for LogFormat {
    type Err = UnknownLogFormat;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(UnknownLogFormat(other.to_owned())),
        }
    }
}

impl TryFrom<String> for LogFormat {
    type Error = UnknownLogFormat;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Text => "text",
            Self::Json => "json",
        })
    }
}

/// Logs to stderr as [`init_logging_as`] does, in the format `TESSERA_LOG_FORMAT`
/// names (text when unset; a bad value is logged and text is used, since a daemon
/// should not refuse to start over how it logs).
pub fn init_logging(default: &str) {
    let (format, bad) = match std::env::var(LOG_FORMAT_ENV) {
        Ok(value) => match value.parse() {
            Ok(format) => (format, None),
            Err(error) => (LogFormat::Text, Some(error)),
        },
        Err(_) => (LogFormat::Text, None),
    };
    init_logging_as(default, format);
    if let Some(error) = bad {
        tracing::warn!(variable = LOG_FORMAT_ENV, %error, "logging as text");
    }
}

/// Logs to stderr (stdout is for a command's output), filtered by `RUST_LOG`,
/// `default` when it is unset or invalid, in `format`. Colour only on a terminal:
/// a journal, a file or a container log gets plain text. A second call does nothing.
pub fn init_logging_as(default: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    // Fails only when a subscriber is already set (tests, a second call): keep that one.
    let _ = log_subscriber(
        format,
        filter,
        std::io::stderr().is_terminal(),
        std::io::stderr,
    )
    .try_init();
}

/// The subscriber behind [`init_logging_as`], writing to `writer`.
fn log_subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    ansi: bool,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => Box::new(builder.with_ansi(ansi).finish()),
        // Escape codes inside JSON strings would only corrupt a collector's fields.
        LogFormat::Json => Box::new(builder.with_ansi(false).json().finish()),
    }
}

/// An error and its causes on one line, for logs and exit messages: `a: b: c`,
/// each cause once: one whose text its parent already ends with (a library that
/// prints its own source, as kube's kubeconfig errors and libloading's do) is
/// not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.ends_with(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

/// This machine's host name (the node name on a Kubernetes node, the pod name in a pod).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

/// Resolves on SIGTERM or SIGINT: what kubelet and systemd send to stop a daemon
/// (as PID 1 in a container nothing else does it). Fails only when the handlers
/// cannot be installed, naming the signal.
pub async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGTERM handler: {e}")))?;
    let mut interrupt = signal(SignalKind::interrupt())
        .map_err(|e| std::io::Error::new(e.kind(), format!("installing a SIGINT handler: {e}")))?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    Ok(())
}

/// The Prometheus endpoint every daemon serves: `GET /metrics` from a
/// `prometheus-client` registry.
#[cfg(feature = "metrics")]
pub mod metrics {
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
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let response = respond(&registry, request.method(), request.uri().path());
                        async move { response }
                    },
                );
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
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
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
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn error_chain_names_every_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("reading /x")]
        struct Outer(#[source] std::io::Error);
        let error = Outer(std::io::Error::other("denied"));
        assert_eq!(error_chain(&error), "reading /x: denied");
        assert_eq!(error_chain(&std::io::Error::other("alone")), "alone");
        // A cause its parent already prints is said once.
        #[derive(Debug, thiserror::Error)]
        #[error("failed to read kubeconfig: {0}")]
        struct Echoing(#[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("reading kubeconfig /k")]
        struct Top(#[source] Echoing);
        let error = Top(Echoing(std::io::Error::other("No such file")));
        assert_eq!(
            error_chain(&error),
            "reading kubeconfig /k: failed to read kubeconfig: No such file"
        );
    }

    #[test]
    fn log_format_parses_text_and_json_only() {
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(LogFormat::default(), LogFormat::Text);
        let error = "JSON".parse::<LogFormat>().expect_err("case matters");
        assert_eq!(
            error.to_string(),
            "log format \"JSON\": expected text or json"
        );
        for format in [LogFormat::Text, LogFormat::Json] {
            assert_eq!(format.to_string().parse::<LogFormat>(), Ok(format));
        }
    }

    /// Collects what a subscriber writes.
    #[derive(Debug, Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().expect("not poisoned").clone()).expect("utf-8")
        }
    }

    fn log_with(format: LogFormat, ansi: bool) -> String {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber =
            log_subscriber(format, EnvFilter::new("info"), ansi, move || writer.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("call", method = "CreateContainer");
            let _entered = span.enter();
            tracing::info!(pod = "default/train-0", gpus = 2, "placed \"quoted\"");
            tracing::debug!("filtered out");
        });
        captured.text()
    }

    #[test]
    fn json_lines_are_json_with_level_target_and_fields() {
        let text = log_with(LogFormat::Json, true);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "one line per event, debug filtered: {text}");
        let line: serde_json::Value = serde_json::from_str(lines[0]).expect("valid JSON");
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["target"], module_path!());
        assert_eq!(line["fields"]["message"], "placed \"quoted\"");
        assert_eq!(line["fields"]["pod"], "default/train-0");
        assert_eq!(line["fields"]["gpus"], 2);
        assert_eq!(line["span"]["method"], "CreateContainer");
        assert!(line["timestamp"].is_string(), "{line}");
        assert!(!text.contains('\u{1b}'), "no escape codes in JSON: {text}");
    }

    #[test]
    fn text_has_colour_only_when_asked() {
        let plain = log_with(LogFormat::Text, false);
        assert!(plain.contains("placed"), "{plain}");
        assert!(plain.contains("pod=\"default/train-0\""), "{plain}");
        assert!(
            !plain.contains('\u{1b}'),
            "escape codes off a terminal: {plain}"
        );
        assert!(log_with(LogFormat::Text, true).contains('\u{1b}'));
    }
}
