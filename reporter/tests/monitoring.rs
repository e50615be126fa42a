//! The chart's alerts (templates/monitoring.yaml) and Grafana dashboard
//! (files/grafana-dashboard.json) name only metrics the daemons export, and the dashboard
//! shows every metric the reporter exports.

use std::collections::BTreeSet;
use std::path::Path;

use tessera_harness::monitoring::{alert_expr, chart_file, metric_names, sample_names};
use tessera_reporter::metrics::{EventLabels, PublishOutcome, PublishedObject, ReporterMetrics};

/// The sample names the reporter serves, with one series in every family.
fn reporter_samples() -> BTreeSet<String> {
    let metrics = ReporterMetrics::default();
    metrics.record_publish(PublishedObject::Device, PublishOutcome::Failed);
    metrics.record_xid("GPU-0", 79);
    metrics.record_enforcement(&[]);
    let entry = |container: &str, grant| tessera_api::usage::ContainerGpuMemory {
        namespace: "default".into(),
        pod: "p".into(),
        pod_uid: "u".into(),
        container: container.into(),
        gpu: "GPU-0".into(),
        used: 1,
        grant,
    };
    metrics.record_gpu_memory(Some(&tessera_api::usage::NodeGpuMemory {
        containers: vec![
            entry("a", tessera_api::usage::MemoryGrant::Share(2)),
            entry("b", tessera_api::usage::MemoryGrant::None),
        ],
        kills: vec![tessera_api::usage::GpuMemoryKill {
            entry: entry("a", tessera_api::usage::MemoryGrant::Share(2)),
            margin: 0,
            pids: vec![1],
            at: 0,
        }],
    }));
    metrics
        .events
        .get_or_create(&EventLabels {
            reason: "GpuUnhealthy".into(),
            outcome: "recorded".into(),
        })
        .inc();
    sample_names(&metrics.encode())
}

/// The proxy's metric names as its registry is built (runtime-proxy/src/metrics.rs):
/// `tessera_proxy_` and each registered name, the first string of each
/// `register(&mut registry, "name", …)` call; and of those, the gauges (a call whose
/// metric is a `Gauge`).
fn proxy_registered() -> (BTreeSet<String>, BTreeSet<String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime-proxy/src/metrics.rs");
    let source = std::fs::read_to_string(&path).expect("runtime-proxy/src/metrics.rs");
    assert!(source.contains("Registry::with_prefix(\"tessera_proxy\")"));
    let (mut all, mut gauges) = (BTreeSet::new(), BTreeSet::new());
    for call in source.split("register(").skip(1) {
        let Some(name) = call.split('"').nth(1) else {
            continue;
        };
        let name = format!("tessera_proxy_{name}");
        // The call's arguments: up to its closing `);`.
        if call
            .split(");")
            .next()
            .is_some_and(|args| args.contains("Gauge::"))
        {
            gauges.insert(name.clone());
        }
        all.insert(name);
    }
    (all, gauges)
}

/// Whether `used` is a sample name of a registered `base`: counters end in `_total`,
/// histograms (`_seconds`) give `_bucket`, `_sum` and `_count`, a gauge is its bare
/// registered name.
fn proxy_sample_exists(
    used: &str,
    registered: &BTreeSet<String>,
    gauges: &BTreeSet<String>,
) -> bool {
    gauges.contains(used)
        || [
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
    let (proxy, gauges) = proxy_registered();
    assert!(
        proxy.contains("tessera_proxy_requests"),
        "proxy registry not read: {proxy:?}"
    );
    assert!(
        gauges.contains("tessera_proxy_gpu_time_unsampled_gpus")
            && !gauges.contains("tessera_proxy_requests"),
        "proxy gauges not told apart: {gauges:?}"
    );
    for file in ["templates/monitoring.yaml", "files/grafana-dashboard.json"] {
        let text = chart_file(file).expect("chart file");
        let used = metric_names(&text, "tessera_reporter_");
        assert!(!used.is_empty(), "{file} names no reporter metric");
        for name in &used {
            assert!(
                reporter.contains(name),
                "{file}: {name} is not a metric tessera-reporter serves ({reporter:?})"
            );
        }
        for name in metric_names(&text, "tessera_proxy_") {
            assert!(
                proxy_sample_exists(&name, &proxy, &gauges),
                "{file}: {name} is not a metric tessera-runtime-proxy serves ({proxy:?})"
            );
        }
    }
}

#[test]
fn dashboard_is_json_and_shows_every_reporter_metric() {
    let text = chart_file("files/grafana-dashboard.json").expect("chart file");
    let dashboard: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("charts/tessera/files/grafana-dashboard.json: {e}"));
    assert_eq!(dashboard["uid"], "tessera");
    let used = metric_names(&text, "tessera_reporter_");
    let missing: Vec<_> = reporter_samples().difference(&used).cloned().collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

#[test]
fn alerts_cover_what_operators_page_on() {
    let text = chart_file("templates/monitoring.yaml").expect("chart file");
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
            "TesseraGpuUsedWithoutGrant",
            "tessera_reporter_container_gpu_ungranted{",
        ),
        (
            "TesseraGpuMemoryOomKill",
            "tessera_reporter_container_gpu_memory_oom_kills{",
        ),
        (
            "TesseraProxyHookFailures",
            "tessera_proxy_hook_failures_total[",
        ),
    ] {
        let expr = alert_expr(&text, alert).unwrap_or_else(|| panic!("no alert {alert}"));
        assert!(expr.contains(metric), "{alert}: {expr}");
    }
}
