//! The chart's alerts (templates/monitoring.yaml) and Grafana dashboard
//! (files/grafana-dashboard.json) name only metrics the daemons export, and the dashboard
//! shows every metric the reporter exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tessera_reporter::metrics::{EventLabels, PublishOutcome, PublishedObject, ReporterMetrics};

fn chart_file(path: &str) -> (PathBuf, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/tessera")
        .join(path);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (path, text)
}

/// Every `tessera_<daemon>_…` name in `text`.
fn metric_names(text: &str, daemon: &str) -> BTreeSet<String> {
    let prefix = format!("tessera_{daemon}_");
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find(&prefix) {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The sample names the reporter serves, with one series in every family.
fn reporter_samples() -> BTreeSet<String> {
    let metrics = ReporterMetrics::default();
    metrics.record_publish(PublishedObject::Device, PublishOutcome::Failed);
    metrics.record_xid("GPU-0", 79);
    metrics
        .events
        .get_or_create(&EventLabels {
            reason: "GpuUnhealthy".into(),
            outcome: "recorded".into(),
        })
        .inc();
    metrics
        .encode()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The proxy's metric names as its registry is built (runtime-proxy/src/metrics.rs):
/// `tessera_proxy_` and each registered name, the first string of each
/// `register(&mut registry, "name", …)` call.
fn proxy_registered() -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime-proxy/src/metrics.rs");
    let source = std::fs::read_to_string(&path).expect("runtime-proxy/src/metrics.rs");
    assert!(source.contains("Registry::with_prefix(\"tessera_proxy\")"));
    source
        .split("register(")
        .skip(1)
        .filter_map(|call| call.split('"').nth(1))
        .map(|name| format!("tessera_proxy_{name}"))
        .collect()
}

/// Whether `used` is a sample name of a registered `base`: counters end in `_total`,
/// histograms (`_seconds`) give `_bucket`, `_sum` and `_count`. The proxy has no gauge:
/// a bare registered name is never a sample (add gauges here when it gets one).
fn proxy_sample_exists(used: &str, registered: &BTreeSet<String>) -> bool {
    [
        ("_total", false),
        ("_bucket", true),
        ("_sum", true),
        ("_count", true),
    ]
    .iter()
    .any(|(suffix, histogram)| {
        used.strip_suffix(suffix).is_some_and(|base| {
            registered.contains(base) && (!histogram || base.ends_with("_seconds"))
        })
    })
}

#[test]
fn alerts_and_dashboard_name_only_exported_metrics() {
    let reporter = reporter_samples();
    let proxy = proxy_registered();
    assert!(
        proxy.contains("tessera_proxy_requests"),
        "proxy registry not read: {proxy:?}"
    );
    for file in ["templates/monitoring.yaml", "files/grafana-dashboard.json"] {
        let (path, text) = chart_file(file);
        let used = metric_names(&text, "reporter");
        assert!(
            !used.is_empty(),
            "{} names no reporter metric",
            path.display()
        );
        for name in &used {
            assert!(
                reporter.contains(name),
                "{}: {name} is not a metric tessera-reporter serves ({reporter:?})",
                path.display()
            );
        }
        for name in metric_names(&text, "proxy") {
            assert!(
                proxy_sample_exists(&name, &proxy),
                "{}: {name} is not a metric tessera-runtime-proxy serves ({proxy:?})",
                path.display()
            );
        }
    }
}

#[test]
fn dashboard_is_json_and_shows_every_reporter_metric() {
    let (path, text) = chart_file("files/grafana-dashboard.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(dashboard["uid"], "tessera");
    let used = metric_names(&text, "reporter");
    let missing: Vec<_> = reporter_samples().difference(&used).cloned().collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

#[test]
fn alerts_cover_what_operators_page_on() {
    let (_, text) = chart_file("templates/monitoring.yaml");
    for (alert, metric) in [
        ("TesseraReporterDown", "up{"),
        (
            "TesseraReporterPublishFailing",
            "tessera_reporter_publishes_total{",
        ),
        (
            "TesseraReporterPublishStale",
            "tessera_reporter_last_publish_timestamp_seconds{",
        ),
        ("TesseraGpuUnhealthy", "tessera_reporter_unhealthy_gpus{"),
        ("TesseraGpuXidErrors", "tessera_reporter_xid_errors_total{"),
        (
            "TesseraProxyHookFailures",
            "tessera_proxy_hook_failures_total[",
        ),
    ] {
        let rule = text
            .split("- alert: ")
            .find(|r| r.starts_with(alert))
            .unwrap_or_else(|| panic!("no alert {alert}"));
        let expr = rule
            .lines()
            .find_map(|l| l.trim().strip_prefix("expr: "))
            .unwrap_or_else(|| panic!("{alert}: no expr"));
        assert!(expr.contains(metric), "{alert}: {expr}");
    }
}
